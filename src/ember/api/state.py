"""What every route reaches through `server_state(request)`, and the models as the routes
see them: in one process the `Registry` itself; in an API process of several, the engine
process's models through `ember.ipc.models.RemoteModels`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Hashable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import Request

from ember.adapters.base import ModelInfo, TaskModel
from ember.config import ModelSpec, ServerSettings
from ember.engine import PreparedItem, RequestResult
from ember.engine.errors import QueueFull, WorkerFailed
from ember.metrics import Metrics
from ember.registry import LoadWaiters


class ServedModel(Protocol):
    """One model, ready for a request: its spec, the request-path half of its adapter,
    and the submit that queues prepared items for its worker."""

    @property
    def spec(self) -> ModelSpec: ...

    @property
    def adapter(self) -> TaskModel: ...

    def submit(self, items: Sequence[PreparedItem], params: Hashable,
               lora: str | None) -> Awaitable[RequestResult]: ...

    def check_room(self, items: int) -> None:
        """Refuse (QueueFull) a request its worker's queue cannot take now."""
        ...


class Models(Protocol):
    """The catalog and the models loaded from it, as the routes use them."""

    @property
    def catalog(self) -> Mapping[str, ModelSpec]: ...

    @property
    def names(self) -> list[str]: ...

    def state(self, name: str) -> str:
        """loaded | loading | failed | available"""
        ...

    def info(self, name: str) -> ModelInfo | None:
        """A loaded model's info; None while it is not loaded."""
        ...

    def dispatch(self, name: str) -> dict[str, Any] | None:
        """A loaded model's learned cost per forward and dispatch windows; None while
        it is not loaded."""
        ...

    async def refresh(self) -> None:
        """Bring `state` and `info` up to date (a no-op where they are always current)."""
        ...

    def unfinished(self) -> list[str]:
        """The models still being downloaded or loaded."""
        ...

    def busy_within(self, seconds: float) -> bool:
        """Whether the engine answered a request in the last `seconds`, holds requests sent
        to it within them, or has kept a status call waiting for room behind other
        requests for less (always, where the engine is this process): a late status is
        then a busy engine's, not a silent one's."""
        ...

    def queue_limit(self, name: str) -> int | None:
        """The queue's size of a catalog model; None for a name the catalog lacks."""
        ...

    def ready(self, name: str) -> object | None:
        """The model, if a request can use it now without awaiting a load."""
        ...

    def use(self, name: str) -> AbstractAsyncContextManager[ServedModel]: ...

    async def get(self, name: str) -> object: ...

    async def close(self) -> None: ...


STATUS_MAX_AGE_S = 1.0  # /readyz answers from a status this recent ...
STATUS_TIMEOUT_S = 1.0  # ... and waits this long for a fresh one ...
BUSY_STATUS_WAIT_S = 0.25  # ... or this long, where requests are being answered meanwhile
BUSY_ANSWER_S = 10.0  # an engine that answered, or was sent, a request this recently is busy
STARVED_S = 0.5  # a wait that overran its timeout by more: this process got no CPU meanwhile


@dataclass
class ServerState:
    settings: ServerSettings
    registry: Models
    metrics: Metrics
    draining: bool = False
    drain_started: float | None = None  # time.monotonic() at the drain's start
    in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    status_at: float = float("-inf")  # when the registry's status was last brought up to date
    load_waiters: LoadWaiters = field(default_factory=LoadWaiters)  # items awaiting a load
    _refreshing: asyncio.Task[None] | None = None
    _reloading: asyncio.Task[None] | None = None

    def model_label(self, name: str) -> str:
        """A model name as metrics and the access log count it: a catalog name, else
        "unknown" (a client's made-up names must not each become a series)."""
        return name if name in self.registry.catalog else "unknown"

    def begin_drain(self) -> None:
        self.draining, self.drain_started = True, time.monotonic()

    def reload_in_background(self, name: str) -> None:
        """Try a failed model's load again (at most one try at a time; within the failure
        window the registry answers with the remembered failure at once): the readiness
        probe's way back, since no request reaches a server that is not ready."""
        if self._reloading is None or self._reloading.done():
            self._reloading = asyncio.get_running_loop().create_task(self._reload(name))

    async def _reload(self, name: str) -> None:
        with contextlib.suppress(Exception):  # the load's own failure is logged there
            await self.registry.get(name)

    def enter(self) -> None:
        self.in_flight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()

    async def unready(self) -> tuple[str, str] | None:
        """Why the server is not ready, as an error's type and message; None: it is. A
        "not loaded" from a status read earlier is read again first: with several API
        processes, another may have read "loaded" since, and a server must not say
        "ready" through one process and "not ready" through the next."""
        default = self.settings.default_model
        if self.draining:
            return "unavailable", "draining before shutdown"
        read_before = self.status_at
        if not await self.recent_status():
            return "not_ready", f"the engine did not answer within {STATUS_TIMEOUT_S:g} s"
        if self.registry.state(default) != "loaded" and self.status_at == read_before:
            await self.fresh_status()
        if (now := self.registry.state(default)) != "loaded":
            if now == "failed":
                self.reload_in_background(default)
            return "not_ready", f"default model {default!r} is not loaded (state: {now})"
        return None

    async def recent_status(self) -> bool:
        """The registry's status, at most STATUS_MAX_AGE_S old: one refresh shared by every
        caller, awaited at most STATUS_TIMEOUT_S. False: the engine did not answer in time
        (a wedged engine makes /readyz a 503, not a hang). An engine that answered a
        request within BUSY_ANSWER_S, holds requests sent within it, or has kept the status
        call waiting that long for a replica with room (on Ray), is busy, not silent: the
        last status stands after a short wait. So it does where this process was starved
        of CPU during the wait: the engine's answer may be unread behind the backlog."""
        loop = asyncio.get_running_loop()
        if loop.time() - self.status_at <= STATUS_MAX_AGE_S:
            return True
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = loop.create_task(self._refresh())
            # Its callers may all have stopped waiting: its failure is no one's to log.
            self._refreshing.add_done_callback(_read_outcome)
        # This caller's refresh: another may start the next one while this one waits.
        refreshing = self._refreshing
        busy = self.registry.busy_within(BUSY_ANSWER_S)
        timeout = BUSY_STATUS_WAIT_S if busy else STATUS_TIMEOUT_S
        waited_from = loop.time()
        done, _ = await asyncio.wait([refreshing], timeout=timeout)
        if not done:
            starved = loop.time() - waited_from > timeout + STARVED_S
            return starved or self.registry.busy_within(BUSY_ANSWER_S)
        if refreshing.cancelled():
            return False
        failure = refreshing.exception()
        return failure is None or isinstance(failure, QueueFull)  # busy, not silent

    async def fresh_status(self) -> bool:
        """The registry's status read now, awaited at most STATUS_TIMEOUT_S; False: the
        engine did not answer in time, and the last status read stands (so a wedged
        engine leaves /v1/models and /metrics a second late, not 30 s and a 503). On Ray a
        status call shares the router's bounded queue with requests: refused while it is
        full (QueueFull), the last status stands too, rather than a 429 for a scrape."""
        try:
            await asyncio.wait_for(self._refresh(), STATUS_TIMEOUT_S)
        except (TimeoutError, WorkerFailed, QueueFull):
            return False
        return True

    async def _refresh(self) -> None:
        await self.registry.refresh()
        self.status_at = asyncio.get_running_loop().time()

    async def wait_idle(self) -> None:
        """Until every accepted HTTP request has had its response."""
        if self.in_flight:
            await self.idle.wait()


def _read_outcome(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()


# The request's scope holds its server's state under this key (RequestContextMiddleware
# puts it there): one lookup, where the app's `State` costs three objects' attributes.
SERVER_KEY = "ember.server"


def server_state(request: Request) -> ServerState:
    state: ServerState | None = request.scope.get(SERVER_KEY)
    if state is None:  # a request that came another way than through the middleware
        state = request.app.state.ember
    return state
