"""A request that ends early (abandoned by its client, refused, or failed) is freed by
refcounting as soon as its answer is sent: nothing of it (body, texts, token ids) stays in
a reference cycle until the collector's next pass. Found by the memory probe
(bench/abandoned_memory.py): each abandoned bulk request kept its 2,048 texts and their
token ids through an exception's traceback, which the server's rare collections let pile
up by tens of requests and the allocators then kept."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request
from starlette.types import Message

from ember.api.errors import ClientGone
from ember.api.model_task import WATCH_AFTER_S, until_disconnect
from ember.engine import WorkerConfig
from tests.api.conftest import SYNTH, AppFactory, encode_body, fill_queue
from tests.cycles import cyclic_garbage


class Payload:
    """Stands in for what a request's work holds: its body, texts and token ids."""


async def test_an_abandoned_request_leaves_no_cycle() -> None:
    async def leaves() -> Message:
        await asyncio.sleep(WATCH_AFTER_S + 0.05)  # once the watch has begun
        return {"type": "http.disconnect"}

    async def work(held: Payload) -> None:
        await asyncio.sleep(30)

    with cyclic_garbage() as garbage:
        for _ in range(3):
            request = Request({"type": "http", "method": "POST", "headers": []}, leaves)
            with pytest.raises(ClientGone):
                await until_disconnect(request, work(Payload()), None)
        del request
    assert f"{__name__}:Payload" not in garbage, sorted(set(garbage))


async def test_refused_requests_leave_no_cycle(apps: AppFactory) -> None:
    async with apps.serve(worker=WorkerConfig(max_queue_items=2)) as served:
        first = await fill_queue(served)
        pairs = {"query": {"text": "q"}, "items": [{"text": "a"}]}
        with cyclic_garbage() as garbage:
            for _ in range(3):
                full = await served.client.post(f"/v1/encode/{SYNTH}", json=encode_body("c"))
                assert full.status_code == 429  # refused in the model's task
                weighed = await served.client.post(f"/v1/score/{SYNTH}", json={
                    **pairs, "options": {"score_weights": {"dense": 1.0}}})
                assert weighed.status_code == 422  # refused from the catalog entry
                bad = await served.client.post(f"/v1/encode/{SYNTH}", json={"items": 5})
                assert bad.status_code == 422  # refused by the body's model
            del full, weighed, bad
        served.worker().resume()
        assert (await first).status_code == 200
    # Ember's and the server side's (httpx's client keeps cycles of its own).
    kept = {kind for kind in garbage if kind.startswith(("ember.", "starlette.requests:"))}
    assert not kept, sorted(kept)
