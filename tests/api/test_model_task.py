"""`until_disconnect`: a request's work ends when its client leaves or its time is up, and a
request answered at once never starts watching for the disconnect."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request
from starlette.types import Message

from ember.api import model_task
from ember.api.errors import ClientGone
from ember.api.model_task import WATCH_AFTER_S, until_disconnect


class Client:
    """The ASGI receive of a request whose body was read: the next message is the
    disconnect, when `leave` is called."""

    def __init__(self) -> None:
        self.reads = 0
        self.gone = asyncio.Event()

    async def receive(self) -> Message:
        self.reads += 1
        await self.gone.wait()
        return {"type": "http.disconnect"}

    def request(self) -> Request:
        return Request({"type": "http", "method": "POST", "path": "/", "headers": []},
                       self.receive)


async def test_a_client_that_leaves_cancels_the_work() -> None:
    client = Client()
    work = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_later(WATCH_AFTER_S * 3, client.gone.set)
    with pytest.raises(ClientGone):
        await until_disconnect(client.request(), work, timeout=5)
    assert work.cancelled()


async def test_the_timeout_cancels_the_work() -> None:
    client = Client()
    work = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError):
        await until_disconnect(client.request(), work, timeout=0.05)
    assert work.cancelled() and not client.gone.is_set()


async def test_a_timeout_past_the_watch_still_cancels_the_work_in_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A timeout longer than the watch's delay is counted from the request's start, not
    from when the watch began: 0.6 s, not 0.5 + 0.6."""
    monkeypatch.setattr(model_task, "WATCH_AFTER_S", 0.5)
    client = Client()
    loop = asyncio.get_running_loop()
    work = loop.create_future()
    started = loop.time()
    with pytest.raises(TimeoutError):
        await until_disconnect(client.request(), work, timeout=0.6)
    assert work.cancelled() and client.reads == 1  # the watch had begun
    assert 0.59 <= loop.time() - started < 0.85


async def test_work_answered_at_once_never_watches_the_client() -> None:
    client = Client()

    async def quick() -> str:
        await asyncio.sleep(0)
        return "done"

    assert await until_disconnect(client.request(), quick(), timeout=5) == "done"
    await asyncio.sleep(WATCH_AFTER_S * 2)
    assert client.reads == 0


async def test_a_waiting_request_watches_and_stops_watching_when_answered() -> None:
    client = Client()

    async def slow() -> str:
        await asyncio.sleep(WATCH_AFTER_S * 3)
        return "done"

    assert await until_disconnect(client.request(), slow(), timeout=5) == "done"
    assert client.reads == 1
