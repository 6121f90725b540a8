"""The models as the routes of an API process see them when the forwards run elsewhere
(`RemoteModels`): the catalog read here, each model's request-path half loaded here
(tokenizer, prompts, output shaping; no weights), its forwards run by an engine reached
through `EngineCalls` (the engine process over ZeroMQ, `ember.ipc.client`, or the engine
replicas on Ray, `ember.cluster`). No transport is imported here."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Hashable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from ember import heap
from ember.adapters.base import (
    ModelInfo,
    Runtime,
    TaskModel,
    family_loader,
    import_family,
)
from ember.config import CatalogError, ModelSpec, spec_from_hub
from ember.engine import PreparedItem, QueueFull, RequestResult, RequestTooLarge, WorkerConfig
from ember.errors import ModelLoadError
from ember.hub import parse_hub_id
from ember.registry import CatalogLookup, check_room

FrontLoader = Callable[[ModelSpec, Runtime], TaskModel]
# A queue depth older than this is not enough to refuse a request on: the engine decides.
FRESH_DEPTH_S = 0.5
# On Ray each status comes from one engine replica of several: what a replica said is
# merged with the others' for this long (its models), or this long (its queues), then
# forgotten (a replica that is no longer asked may have stopped).
REPLICA_MODELS_S = 60.0
REPLICA_QUEUES_S = 5.0
# A model's state across replicas: the one a request would meet first.
STATE_RANK = {"loaded": 3, "loading": 2, "failed": 1, "available": 0}


def front_loader(family: str) -> FrontLoader:
    """Each family module exposes `load_front(spec, runtime)`: its request path alone."""
    return cast(FrontLoader, family_loader(family, "load_front"))


class EngineCalls(Protocol):
    """What the remote models need from their engine: `EngineClient` over ZeroMQ, or
    `ember.cluster`'s client of the engine replicas on Ray.

    `one_queue`: whether every answer's queue depth is that of the one queue a model's
    requests all join (one engine process), so that a fresh depth may refuse a request
    before it is sent; on Ray it is one replica's of several, and refuses nothing here."""

    one_queue: bool

    async def call(self, op: str, **fields: Any) -> dict[str, Any]: ...

    def queued_since(self) -> float | None:
        """Since when (time.monotonic()) a status call has waited its turn behind
        requests (on Ray, in the router, while every engine replica holds its cap); None:
        none waits."""
        ...

    def close(self) -> None: ...


@dataclass(eq=False)
class RemoteModel:
    """A model served by the engine process, as a route uses it."""

    spec: ModelSpec
    adapter: TaskModel
    client: EngineCalls
    pending: int = 0  # the engine's queue depth at its last answer ...
    pending_at: float = float("-inf")  # ... and when that answer came (time.monotonic())
    max_queue_items: int = 0
    awaited: int = 0  # requests sent to the engine and not yet answered ...
    awaited_since: float = float("-inf")  # ... since this time, when there were none

    def check_room(self, items: int) -> None:
        """Refuse before tokenizing, without a round trip, only on a fresh figure: an old
        one (the queue may have drained since) lets the request through, and the engine,
        which checks again on submit, decides."""
        if items > self.max_queue_items:
            raise RequestTooLarge(items, self.max_queue_items)
        if self.client.one_queue and time.monotonic() - self.pending_at <= FRESH_DEPTH_S:
            check_room(self.pending, items, self.max_queue_items)

    def note_pending(self, pending: int) -> None:
        self.pending, self.pending_at = pending, time.monotonic()

    async def submit(self, items: Sequence[PreparedItem], params: Hashable,
                     lora: str | None) -> RequestResult:
        sent = time.monotonic()
        if not self.awaited:
            self.awaited_since = sent
        self.awaited += 1
        try:
            reply = await self.client.call(
                "submit", model=self.spec.name, params=params, lora=lora,
                items=items)
        except QueueFull as refused:  # the engine's own figure, now
            self.note_pending(refused.pending)
            raise
        finally:
            self.awaited -= 1
        self.note_pending(reply["pending"])
        queue_ms, inference_ms = reply["queue_ms"], reply["inference_ms"]
        if reply.get("new_engine"):  # timed from the new engine's receipt: it waited before
            queue_ms = max(queue_ms, (time.monotonic() - sent) * 1e3 - inference_ms)
        return RequestResult(list(reply["values"]), queue_ms, inference_ms, reply["forwards"])


@dataclass
class RemoteModels(CatalogLookup):
    """The engine process's models, for the routes of one API process."""

    catalog: Mapping[str, ModelSpec]
    runtime: Runtime
    client: EngineCalls
    worker: WorkerConfig  # the server's batching settings, a model's YAML over them
    loader: Callable[[str], FrontLoader] = front_loader
    _fronts: dict[str, RemoteModel] = field(default_factory=dict)
    _loading: dict[str, asyncio.Future[RemoteModel]] = field(default_factory=dict)
    _states: dict[str, str] = field(default_factory=dict)
    _info: dict[str, ModelInfo] = field(default_factory=dict)
    _pending: dict[str, int] = field(default_factory=dict)
    _running: dict[str, int] = field(default_factory=dict)
    _dispatch: dict[str, dict[str, Any]] = field(default_factory=dict)
    _replicas: dict[str, tuple[float, dict[str, Any]]] = field(default_factory=dict)

    def state(self, name: str) -> str:
        return self._states.get(name, "available")

    def info(self, name: str) -> ModelInfo | None:
        return self._info.get(name)

    def pending(self) -> dict[str, int]:
        return dict(self._pending)

    def running(self) -> dict[str, int]:
        return dict(self._running)

    def dispatch(self, name: str) -> dict[str, Any] | None:
        return self._dispatch.get(name)

    def dispatches(self) -> dict[str, dict[str, Any]]:
        """Every loaded model's dispatch, as of the last status."""
        return dict(self._dispatch)

    def _loads_running(self) -> list[str]:
        return [name for name, load in self._loading.items() if not load.done()]

    def busy_within(self, seconds: float) -> bool:
        """Whether the engine answered (or refused) a request to any model in the last
        `seconds`, holds requests this process has awaited for less than that (a burst's
        first answers may still be on their way: each model notes when its last answer
        came, and since when it has awaited one), or has kept a status call waiting for
        room that long (every replica at its cap with other processes' requests)."""
        now = time.monotonic()
        if (queued := self.client.queued_since()) is not None and now - queued <= seconds:
            return True
        return any(now - model.pending_at <= seconds
                   or (model.awaited and now - model.awaited_since <= seconds)
                   for model in self._fronts.values())

    async def refresh(self) -> None:
        status = await self.client.call("status")
        if (replica := status.get("replica")) is not None:
            status = self._across_replicas(replica, status)
        self._states = dict(status["states"])
        for name in self._states.keys() - self.catalog.keys():
            self._adopt(name)
        self._info = dict(status["info"])
        self._pending = dict(status["pending"])
        self._running = dict(status["running"])
        self._dispatch = dict(status.get("dispatch") or {})

    def _across_replicas(self, replica: str, status: dict[str, Any]) -> dict[str, Any]:
        """The pool's status from each replica's latest: a model is loaded where any
        replica holds it (Ray sends its requests there), and queues add up. Without this,
        `/v1/models` said loaded or not by which replica Ray asked."""
        now = time.monotonic()
        self._replicas[replica] = (now, status)
        for gone in [r for r, (at, _) in self._replicas.items() if now - at > REPLICA_MODELS_S]:
            del self._replicas[gone]
        views = [view for _, view in self._replicas.values()]
        fresh = [view for at, view in self._replicas.values() if now - at <= REPLICA_QUEUES_S]
        states: dict[str, str] = {}
        for view in views:
            for name, state in view["states"].items():
                if STATE_RANK.get(state, 0) >= STATE_RANK.get(states.get(name, ""), -1):
                    states[name] = state
        # A model an engine replica answered for just now is loaded there, whatever an
        # older view of that replica said (the replicas are asked in no order).
        for name, model in self._fronts.items():
            if now - model.pending_at <= REPLICA_QUEUES_S and model.pending >= 0:
                states[name] = "loaded"
        pending: Counter[str] = Counter()
        running: Counter[str] = Counter()
        for view in fresh:
            pending.update(view["pending"])
            running.update(view["running"])
        return {"states": states, "pending": dict(pending), "running": dict(running),
                "info": {k: v for view in views for k, v in view["info"].items()},
                "dispatch": {k: v for view in views
                             for k, v in (view.get("dispatch") or {}).items()}}

    def _adopt(self, name: str) -> None:
        """A Hub model the engine took on at another API process's request: into this
        process's catalog too, from the cache they share, so that every process lists the
        same models (where the cache lacks it, as on another Ray node, its first request
        here adds it)."""
        ref = parse_hub_id(name)
        if ref is None or ref.revision is not None:
            return
        try:
            found = spec_from_hub(ref, download=False)
        except (FileNotFoundError, CatalogError):
            return
        cast(dict[str, ModelSpec], self.catalog)[name] = found

    async def get(self, name: str) -> RemoteModel:
        """The model's front half, loaded here once (concurrent first requests share the
        load), with the engine holding its weights."""
        spec = await self.find(name)
        await self.client.call("load", model=name)  # raises the engine's ModelLoadError
        if name in self._fronts:
            return self._fronts[name]
        loading = self._loading.get(name)
        if loading is None:
            loading = asyncio.ensure_future(self._load_front(spec))
            self._loading[name] = loading
            loading.add_done_callback(lambda _: self._loading.pop(name, None))
        return await asyncio.shield(loading)

    async def _load_front(self, spec: ModelSpec) -> RemoteModel:
        try:
            await asyncio.to_thread(import_family, spec.adapter)  # seconds: off the loop
            adapter = await asyncio.to_thread(self.loader(spec.adapter), spec, self.runtime)
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(spec.name, f"{type(exc).__name__}: {exc}") from None
        model = RemoteModel(spec, adapter, self.client,
                            max_queue_items=spec.worker_config(self.worker).max_queue_items)
        self._fronts[spec.name] = model
        heap.settle()
        return model

    def ready(self, name: str) -> RemoteModel | None:
        return self._fronts.get(name)

    @asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[RemoteModel]:
        model = self._fronts.get(name) or await self.get(name)
        yield model

    async def close(self) -> None:
        """The engine drains on its own; this process only lets go of its socket."""
        self.client.close()

    def queue_limit(self, name: str) -> int | None:
        """The queue's size of a catalog model; None for a name the catalog lacks."""
        spec = self.catalog.get(name)
        return None if spec is None else spec.worker_config(self.worker).max_queue_items
