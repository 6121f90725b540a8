"""The ingress's calls to the engine replicas (`RayEngineClient`): what Ray's router
raises becomes the answer Ember gives for the same state in its other modes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Generator
from typing import Any

import pytest
from ray.serve._private.common import DeploymentID
from ray.serve.exceptions import DeploymentUnavailableError

from ember.adapters.base import Runtime
from ember.api.errors import as_api_error
from ember.api.state import STATUS_TIMEOUT_S, ServerState
from ember.cluster.client import RayEngineClient
from ember.config import ServerSettings, load_catalog
from ember.engine import QueueFull, WorkerConfig, WorkerFailed
from ember.engine.errors import RequestTooLarge
from ember.ipc.models import RemoteModel, RemoteModels
from ember.ipc.wire import error_to_wire
from ember.metrics import Metrics


class Unavailable:
    """A deployment handle whose every call fails as Ray's router fails it when no engine
    replica runs nor will (the engine application failed to deploy, or was deleted)."""

    def options(self, **_: Any) -> Unavailable:
        return self

    def __getattr__(self, op: str) -> Unavailable:
        return self

    def remote(self, fields: dict[str, Any]) -> Any:
        async def fail() -> None:
            raise DeploymentUnavailableError(DeploymentID("EmberEngine", "ember-engine"))

        return fail()


async def test_no_engine_deployment_is_a_503_to_retry_not_a_500() -> None:
    """Found by a review of the Ray path: Ray's DeploymentUnavailableError fell through to
    a 500 `inference_error`, logged as a fault of the request."""
    client = RayEngineClient(Unavailable())  # type: ignore[arg-type]
    with pytest.raises(WorkerFailed) as caught:
        await client.call("submit", model="ember/synthetic", items=[])
    error = as_api_error(caught.value)
    assert (error.status, error.kind) == (503, "unavailable")
    assert error.headers == {"Retry-After": "1"}
    assert "no engine replica is running" in error.message


def test_one_replicas_full_queue_refuses_nothing_at_the_ingress() -> None:
    """Found by a review of the Ray path: the ingress refused every request for a model
    for 0.5 s after one replica said its queue was full, though another (a new one, after
    a scale-up) had room. Each replica's queue is its own: Ray's router and the replica
    decide."""
    model = RemoteModel(load_catalog()["ember/synthetic"], None,  # type: ignore[arg-type]
                        RayEngineClient(Unavailable()), max_queue_items=10)  # type: ignore[arg-type]
    model.note_pending(10)  # one replica's figure, just now
    model.check_room(1)  # not refused here
    with pytest.raises(RequestTooLarge):  # what no replica could take still is
        model.check_room(11)


SYNTHETIC = "ember/synthetic"


class Response:
    """What Ray's handle gives for a call, as the client uses it: `_to_object_ref` returns
    once the router has given the call a replica (`routed` set), awaiting it the
    replica's answer."""

    def __init__(self, routed: asyncio.Event,
                 answer: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        self.routed, self.answer = routed, answer

    async def _to_object_ref(self) -> None:
        await self.routed.wait()

    def __await__(self) -> Generator[Any, None, dict[str, Any]]:
        return self._answered().__await__()

    async def _answered(self) -> dict[str, Any]:
        await self.routed.wait()
        return await self.answer()

    def cancel(self) -> None:
        """Nothing runs until awaited."""


class StatusBehindRequests:
    """A deployment handle as Ray's router behaves under overload: requests are answered,
    while a status call, after the first, is given a replica that does not answer it, or
    (`queued`) waits in the router's queue for a replica with room, until `held` is set."""

    def __init__(self, queued: bool = False) -> None:
        self.statuses = 0
        self.queued = queued
        self.held = asyncio.Event()  # set: the held status calls go through
        self.room = asyncio.Event()  # a replica with room, at once
        self.room.set()

    def options(self, **_: Any) -> StatusBehindRequests:
        return self

    def __getattr__(self, op: str) -> Any:
        handle = self

        class Method:
            def remote(self, fields: dict[str, Any]) -> Response:
                queued = handle.queued and op == "status" and handle.statuses > 0
                return Response(handle.held if queued else handle.room,
                                lambda: handle.answer(op))

        return Method()

    async def answer(self, op: str) -> dict[str, Any]:
        if op == "status":
            self.statuses += 1
            if self.statuses > 1:
                await self.held.wait()
            return {"op": "result", "states": {SYNTHETIC: "loaded"}, "info": {},
                    "pending": {}, "running": {}}
        if op == "submit":
            return {"op": "result", "values": [], "pending": 0, "queue_ms": 0.0,
                    "inference_ms": 0.0, "forwards": 1}
        return {"op": "result"}  # load: the replica holds the model


def ingress_state(handle: StatusBehindRequests) -> tuple[ServerState, RemoteModels]:
    """An ingress replica's server state over `handle` (the default model synthetic), and
    its models."""
    settings = ServerSettings(default_model=SYNTHETIC)
    models = RemoteModels(load_catalog(), Runtime.from_settings(settings),
                          RayEngineClient(handle), worker=WorkerConfig(max_queue_items=8))  # type: ignore[arg-type]
    return ServerState(settings, models, Metrics()), models


async def test_readyz_stays_ready_while_the_status_waits_behind_answered_requests() -> None:
    """Found in CI-like runs of the overload test: under load /readyz answered 503 "the
    engine did not answer" (30 of 100), its status call waiting behind the requests the
    engine was answering. An engine that answers requests is busy, not silent: the last
    status stands. One that answers nothing is still a 503."""
    handle = StatusBehindRequests()
    state, models = ingress_state(handle)
    try:
        assert await state.unready() is None  # the first status is answered
        model = await models.get(SYNTHETIC)
        await asyncio.sleep(STATUS_TIMEOUT_S + 0.1)  # that status is old now; nothing answered
        assert await state.unready() == (
            "not_ready", f"the engine did not answer within {STATUS_TIMEOUT_S:g} s")
        await model.submit([], "encode", None)  # a request is answered meanwhile
        started = time.monotonic()
        assert await state.unready() is None
        assert time.monotonic() - started < STATUS_TIMEOUT_S  # not a full status timeout
        assert handle.statuses == 2  # one status call waits; the probes share it
    finally:
        handle.held.set()
        await models.close()


class RequestsHeldToo(StatusBehindRequests):
    """The same router, where a burst's requests are not answered yet either."""

    async def answer(self, op: str) -> dict[str, Any]:
        if op == "submit":
            await self.held.wait()
        return await super().answer(op)


async def test_readyz_stays_ready_while_a_bursts_first_answers_are_on_their_way(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine sent requests a moment ago has not had the time to answer one: it is busy,
    not silent. Requests it has held too long without a word make it silent again."""
    monkeypatch.setattr("ember.api.state.BUSY_ANSWER_S", 0.5)
    handle = RequestsHeldToo()
    state, models = ingress_state(handle)
    try:
        assert await state.unready() is None  # the first status is answered
        model = await models.get(SYNTHETIC)
        await asyncio.sleep(STATUS_TIMEOUT_S + 0.1)  # that status is old now
        burst = [asyncio.create_task(model.submit([], "encode", None)) for _ in range(3)]
        await asyncio.sleep(0)  # sent
        started = time.monotonic()
        assert await state.unready() is None
        assert time.monotonic() - started < STATUS_TIMEOUT_S  # a short wait, not a timeout
        await asyncio.sleep(0.5)  # held past BUSY_ANSWER_S, unanswered
        assert await state.unready() == (
            "not_ready", f"the engine did not answer within {STATUS_TIMEOUT_S:g} s")
        handle.held.set()
        await asyncio.gather(*burst)
    finally:
        handle.held.set()
        await models.close()


async def test_readyz_stays_ready_where_the_probes_own_process_got_no_cpu() -> None:
    """Found in CI-like runs of the overload test (a core taken by another process): 20 to
    40 of 75 probes answered 503 "the engine did not answer" before the ingress had sent
    the engine a request. Its event loop ran its 1 s timer 1.6-8.6 s late, the status's
    answer unread behind the backlog. A wait so overrun says nothing of the engine."""
    handle = StatusBehindRequests()
    state, models = ingress_state(handle)
    try:
        assert await state.unready() is None  # the first status is answered
        await asyncio.sleep(STATUS_TIMEOUT_S + 0.1)  # that status is old now; nothing sent
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, time.sleep, STATUS_TIMEOUT_S + 1)  # the loop gets no CPU
        assert await state.unready() is None
        assert await state.unready() == (  # with the CPU back, silence is silence
            "not_ready", f"the engine did not answer within {STATUS_TIMEOUT_S:g} s")
    finally:
        handle.held.set()
        await models.close()


async def test_readyz_stays_ready_while_its_status_waits_for_a_replica_with_room(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in CI (3 of 75 probes of the overload test): /readyz answered 503 "the engine
    did not answer" from an ingress that had no request of its own out, its status call
    waiting in Ray's router while the other ingress's requests held every replica's cap.
    Every replica full is a busy engine: the last status stands. A status call that has
    waited for room longer than the busy window reads as silence again (a replica whose
    forwards hang holds its cap for good)."""
    monkeypatch.setattr("ember.api.state.BUSY_ANSWER_S", 3.0)  # 1.75 s beyond the checks
    handle = StatusBehindRequests(queued=True)
    state, models = ingress_state(handle)
    try:
        assert await state.unready() is None  # the first status is answered
        await asyncio.sleep(STATUS_TIMEOUT_S + 0.1)  # that status is old now; nothing sent
        assert await state.unready() is None  # its refresh waits for a replica
        started = time.monotonic()
        assert await state.unready() is None  # the same refresh, still waiting
        assert time.monotonic() - started < STATUS_TIMEOUT_S  # a short wait, not a timeout
        assert handle.statuses == 1  # no status call reached a replica meanwhile
        await asyncio.sleep(2.0)  # it has waited past the busy window
        assert await state.unready() == (
            "not_ready", f"the engine did not answer within {STATUS_TIMEOUT_S:g} s")
    finally:
        handle.held.set()
        await models.close()


class TwoReplicas:
    """A deployment handle whose status calls Ray's router sends to one engine replica of
    two, in turn, each with its own models and queue."""

    def __init__(self, views: list[dict[str, Any]]) -> None:
        self.views, self.calls = views, 0

    def options(self, **_: Any) -> TwoReplicas:
        return self

    @property
    def status(self) -> TwoReplicas:
        return self

    def remote(self, fields: dict[str, Any]) -> Response:
        view = self.views[self.calls % len(self.views)]
        self.calls += 1

        async def answer() -> dict[str, Any]:
            return {"op": "result", **view}

        room = asyncio.Event()
        room.set()
        return Response(room, answer)


def replica_view(name: str, states: dict[str, str], pending: dict[str, int]
                 ) -> dict[str, Any]:
    return {"replica": name, "states": states, "pending": pending,
            "running": dict.fromkeys(pending, 0), "info": {}, "dispatch": {}}


async def test_the_pool_status_merges_what_each_replica_said(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each status call reaches one engine replica: a model is loaded where any replica
    holds it, queues add up, and a replica not heard from for a while is forgotten."""
    monkeypatch.setattr("ember.ipc.models.REPLICA_QUEUES_S", 0.2)
    monkeypatch.setattr("ember.ipc.models.REPLICA_MODELS_S", 0.4)
    handle = TwoReplicas([
        replica_view("a", {SYNTHETIC: "loaded", "ember/other": "available"}, {SYNTHETIC: 3}),
        replica_view("b", {SYNTHETIC: "loaded", "ember/other": "loading"},
                     {SYNTHETIC: 4, "ember/other": 0})])
    models = RemoteModels(load_catalog(), Runtime.from_settings(ServerSettings()),
                          RayEngineClient(handle), worker=WorkerConfig(max_queue_items=8))  # type: ignore[arg-type]
    for _ in range(2):
        await models.refresh()
        assert models.state(SYNTHETIC) == "loaded"
    assert models.state("ember/other") == "loading"  # whichever replica was asked last
    assert models.pending() == {SYNTHETIC: 7, "ember/other": 0}
    handle.views = handle.views[:1]  # replica b stops answering (it was scaled down)
    await asyncio.sleep(0.25)
    await models.refresh()
    assert models.pending() == {SYNTHETIC: 3}  # b's queue is too old to count
    assert models.state("ember/other") == "loading"  # its models, not yet
    await asyncio.sleep(0.2)
    await models.refresh()
    assert models.state("ember/other") == "available"


class RefusedThenHeld(StatusBehindRequests):
    """A router whose first status call it refuses (its queue full), the later ones held."""

    async def answer(self, op: str) -> dict[str, Any]:
        if op == "status" and self.statuses == 0:
            self.statuses += 1
            return {"op": "error", "error": error_to_wire(QueueFull(64, 1, 64))}
        return await super().answer(op)


async def test_a_refresh_another_probe_replaced_is_read_as_the_probes_own() -> None:
    """Found in a loaded Ray run: /readyz answered 500 (InvalidStateError) when, as its
    status call ended, another probe had already started the next one, which it read."""
    handle = RefusedThenHeld()
    state, models = ingress_state(handle)
    try:
        probe = asyncio.create_task(state.recent_status())
        await asyncio.sleep(0)  # the probe has started the refresh and waits on it
        first = state._refreshing
        assert first is not None and not first.done()

        def next_probe_starts(_: object) -> None:  # before the first probe reads its own
            state._refreshing = asyncio.get_running_loop().create_task(state._refresh())

        first.add_done_callback(next_probe_starts)
        assert await probe is True  # refused for a full queue: busy, not silent
    finally:
        handle.held.set()
        await models.close()
