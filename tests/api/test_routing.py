"""The inference dispatcher: routes matched once per path, each request with its own
path parameters, and every other request left to FastAPI."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest

from ember.api import routing
from ember.api.errors import ApiError
from ember.config import RaySettings
from tests.api.conftest import SYNTH, AppFactory, Served, assert_error, encode_body, vectors


async def test_paths_route_the_same_before_and_after_the_match_cache_fills(
        shared: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(routing, "MATCH_CACHE_SIZE", 2)  # cleared every third new path
    for _ in range(2):
        ok = await shared.client.post(f"/v1/encode/{SYNTH}", json=encode_body("a"))
        assert ok.status_code == 200 and len(vectors(ok.json())) == 1
        scored = await shared.client.post(f"/v1/score/{SYNTH}", json={
            "query": {"text": "q"}, "items": [{"text": "a"}, {"text": "b"}]})
        assert scored.status_code == 200 and len(scored.json()["scores"]) == 2
        for missing in ("no/such-model", "another/missing-one"):
            response = await shared.client.post(f"/v1/encode/{missing}",
                                                json=encode_body("a"))
            body = assert_error(response, 404)
            assert missing in body["message"]  # this request's own path parameter
        assert (await shared.client.post("/v1/not-a-route", json={})).status_code == 404
        assert (await shared.client.get(f"/v1/models/{SYNTH}")).status_code == 200


async def test_a_body_that_stops_coming_is_a_408_that_closes_the_connection() -> None:
    """Found by a black-box review: a client that sent part of its body and then nothing
    held its connection open for good."""
    parts = [{"type": "http.request", "body": b'{"items": [', "more_body": True}]

    async def receive() -> dict[str, object]:
        if parts:
            return parts.pop(0)
        await asyncio.Event().wait()  # the rest never comes
        raise AssertionError("unreachable")

    with pytest.raises(ApiError) as caught:
        await routing.read_body(receive, idle_s=0.05)
    error = caught.value
    assert (error.status, error.kind, error.param) == (408, "request_timeout", "body")
    assert error.headers == {"Connection": "close"}
    whole = [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def at_once() -> dict[str, object]:
        return whole.pop(0)

    assert await routing.read_body(at_once, idle_s=0.05) == b"{}"


async def test_a_body_wait_cancelled_from_outside_stays_cancelled() -> None:
    """The wait's slices end by cancelling the task; a cancel of its own (the client
    left, the server stops) must not be taken for the end of a slice."""
    async def never() -> dict[str, object]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    reading = asyncio.ensure_future(routing.read_body(never, idle_s=5))
    await asyncio.sleep(0.05)
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading


async def test_a_body_that_comes_after_several_slices_of_the_wait_is_read_whole(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(routing, "WAIT_SLICE_S", 0.02)
    parts = [b'{"items": ', b'[]}']
    arrived = asyncio.Event()  # as a server's receive: a part comes whenever it comes
    asyncio.get_running_loop().call_later(0.1, arrived.set)  # five slices on

    async def late() -> dict[str, object]:
        await arrived.wait()
        return {"type": "http.request", "body": parts.pop(0), "more_body": bool(parts)}

    assert await routing.read_body(late, idle_s=5) == b'{"items": []}'
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_the_wait_slices_count_cancels_from_where_the_task_stood(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a review: a slice's own cancel was told from another by a count of 0, so
    a task holding a cancel it had caught (not undone) took each slice's end for a real
    cancel, and the request ended as a client's leaving."""
    monkeypatch.setattr(routing, "WAIT_SLICE_S", 0.02)
    arrived = asyncio.Event()
    asyncio.get_running_loop().call_later(0.1, arrived.set)

    async def late() -> dict[str, object]:
        await arrived.wait()
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def reader() -> bytes:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):  # caught and kept: a count of 1
            await asyncio.sleep(1)
        assert task.cancelling() == 1
        return await routing.read_body(late, idle_s=5)

    assert await asyncio.ensure_future(reader()) == b"{}"


async def trickle() -> dict[str, object]:
    """A body that comes a byte at a time, for ever."""
    await asyncio.sleep(0.02)
    return {"type": "http.request", "body": b" ", "more_body": True}


async def test_a_body_that_trickles_is_a_408_once_it_took_too_long() -> None:
    """Found by a black-box review: a byte every few seconds never let the idle wait run
    out, so a client held its connection, and a drain, as long as it pleased."""
    with pytest.raises(ApiError) as caught:
        await asyncio.wait_for(routing.read_body(trickle, idle_s=0.5, whole_s=0.2), 5)
    assert caught.value.status == 408 and "did not arrive whole within" in \
        caught.value.message


async def test_a_drain_gives_a_body_still_arriving_a_short_while(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(routing, "DRAIN_BODY_S", 0.1)
    state = SimpleNamespace(drain_started=None)

    async def drain_soon() -> None:
        await asyncio.sleep(0.1)
        state.drain_started = time.monotonic()

    draining = asyncio.ensure_future(drain_soon())
    with pytest.raises(ApiError) as caught:  # the trickle never ends: only the drain does
        await asyncio.wait_for(routing.read_body(trickle, state), 5)  # type: ignore[arg-type]
    await draining
    assert caught.value.status == 408 and "draining" in caught.value.message


async def test_behind_rays_proxy_a_body_may_pause_until_the_whole_body_bound(
        apps: AppFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by CI: under overload, Ray's proxy, which holds the client's connection, took
    over 30 s to hand an ingress replica bodies the clients had sent whole, and 465 of
    3,000 requests were answered 408 as if their clients had fallen silent. A pause that
    is a 408 on its own is served behind Ray."""
    monkeypatch.setattr(routing, "BODY_IDLE_S", 0.1)

    async def paused_body() -> AsyncIterator[bytes]:
        yield b'{"items": [{"text": '
        await asyncio.sleep(0.4)
        yield b'"paused"}]}'

    for ray, status in ((None, 408), (RaySettings(), 200)):
        async with apps.serve(ray=ray) as served:
            response = await served.client.post(
                f"/v1/encode/{SYNTH}", content=paused_body(),
                headers={"Content-Type": "application/json"})
        assert response.status_code == status, (ray, response.text)
    assert len(vectors(response.json())) == 1
