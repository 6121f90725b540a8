"""A request's objects in the engine are freed by refcounting when it resolves: none is
left in a reference cycle for the garbage collector (a cycle a request made the server's
collections walk and free them in bursts: p99 outliers under load), and none is kept by
the idle engine once its caller lets the answer go."""

from __future__ import annotations

import asyncio
import weakref

import pytest

from ember.engine import PreparedItem, WorkerConfig
from tests.cycles import cyclic_garbage
from tests.engine.helpers import items, running, wait_for

ENGINE_TYPES = {"ember.engine.worker:_Request", "ember.engine.batcher:PendingItem",
                "ember.engine.types:PreparedItem", "ember.engine.types:RequestResult"}


async def test_answered_requests_leave_no_cycle() -> None:
    async with running(WorkerConfig(max_batch_items=4)) as (worker, _):
        with cyclic_garbage() as garbage:
            futures = [await worker.submit(items(1, 2, 3), "p") for _ in range(8)]
            await asyncio.gather(*futures)
            del futures
    assert ENGINE_TYPES.isdisjoint(garbage), garbage


async def test_failed_and_cancelled_requests_leave_no_cycle() -> None:
    async with running(WorkerConfig(max_batch_items=1), overhead_ms=20.0) as (worker, _):
        with cyclic_garbage() as garbage:
            failing = await worker.submit([PreparedItem("__fail__", 1, 0)], "p")
            queued = await worker.submit(items(1, 1), "p")  # waits behind the first
            queued.cancel()
            with pytest.raises(RuntimeError, match="synthetic fault"):
                await failing
            await asyncio.sleep(0.05)
            del failing, queued
    assert ENGINE_TYPES.isdisjoint(garbage), garbage


async def test_an_idle_engine_keeps_no_answer_its_caller_let_go() -> None:
    # The forward thread used to keep its last forward (the batch, its requests and their
    # values) until the next one: a large answer stayed resident while the server idled.
    async with running(WorkerConfig(max_batch_items=2)) as (worker, _):
        answer = await (await worker.submit(items(1, 1, 1), "p"))  # two forwards
        values = [weakref.ref(value) for value in answer.values]
        del answer
        # The thread lets go once it waits for the next batch: then none is alive.
        await wait_for(lambda: all(ref() is None for ref in values))
