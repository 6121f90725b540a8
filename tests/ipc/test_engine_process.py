"""The engine process, driven the way API processes drive it: each `EngineClient` is one
API process (its own ZeroMQ identity). The rules hold across the process boundary:
requests of every process join the same batcher, a caller that goes away has its queued
work dropped, the queue refuses what it cannot take, timings come back, and SIGTERM
drains everything accepted before the engine exits 0."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
from collections.abc import AsyncIterator, Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest
import pytest_asyncio

from ember.config import ServerSettings
from ember.engine import QueueFull, WorkerConfig
from ember.ipc.client import EngineClient
from ember.ipc.engine import run_engine

SLOW = "test/ipc-slow"  # 300 ms forwards of up to 64 items: arrivals pile up behind one
MODEL = f"""
name: {SLOW}
description: synthetic test model with slow forwards (not a real model)
adapter: synthetic
tasks: [encode]
options: {{dims: 8, overhead_ms: 300, per_token_us: 0}}
"""
PARAMS = ("encode", False)  # the synthetic model's parameter group for documents


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[str, BaseProcess]]:
    (tmp_path / "slow.yaml").write_text(MODEL, encoding="utf-8")
    settings = ServerSettings(default_model=SLOW, model_dirs=(tmp_path,),
                              worker=WorkerConfig(max_queue_items=8), log_level="warning")
    address = f"ipc://{tmp_path / 'engine.sock'}"
    context = multiprocessing.get_context("spawn")
    ready, ready_send = context.Pipe(duplex=False)
    process = context.Process(target=run_engine, args=(settings, address, ready_send))
    process.start()
    assert ready.poll(60), "the engine process did not start"
    ready.recv()
    yield address, process
    if process.is_alive():
        process.kill()
    process.join(10)


@pytest_asyncio.fixture
async def clients(engine: tuple[str, BaseProcess]) -> AsyncIterator[list[EngineClient]]:
    address, _ = engine
    pair = [EngineClient(address, f"api-test-{i}") for i in range(2)]
    await pair[0].call("load", model=SLOW)
    yield pair
    for client in pair:
        client.close()


def submit(client: EngineClient, *texts: str) -> asyncio.Future[dict[str, object]]:
    items = [[text, 1, index] for index, text in enumerate(texts)]
    return asyncio.ensure_future(client.call("submit", model=SLOW, params=PARAMS, lora=None,
                                             items=items))


async def forwards(client: EngineClient) -> tuple[int, int]:
    """Forwards and items the engine's worker has run for the model."""
    status = await client.call("status")
    batches, items = status["forwards"][SLOW]
    return int(batches), int(items)


async def test_requests_of_two_api_processes_share_one_forward(
        clients: list[EngineClient]) -> None:
    first, second = clients
    busy = submit(first, "busy")
    await asyncio.sleep(0.1)  # its 300 ms forward runs; the next two queue behind it
    mine, theirs = submit(first, "from one"), submit(second, "from the other")
    results = await asyncio.gather(busy, mine, theirs)
    assert await forwards(first) == (2, 3)  # the two later requests rode together
    assert all(len(r["values"]) == len(texts)  # type: ignore[arg-type]
               for r, texts in zip(results, [["busy"], ["a"], ["b"]], strict=True))
    later = results[1]
    assert float(later["queue_ms"]) > 100  # type: ignore[arg-type]  # waited for the first
    assert float(later["inference_ms"]) >= 250  # type: ignore[arg-type]


async def test_a_caller_that_goes_away_has_its_queued_item_dropped(
        clients: list[EngineClient]) -> None:
    first, second = clients
    busy = submit(first, "busy")
    await asyncio.sleep(0.1)
    abandoned = submit(second, "abandoned")
    await asyncio.sleep(0.05)
    abandoned.cancel()
    await busy
    await asyncio.sleep(0.4)  # a forward's time: the abandoned item would have run by now
    assert await forwards(first) == (1, 1)


async def test_the_queue_refuses_what_it_cannot_take_from_any_process(
        clients: list[EngineClient]) -> None:
    first, second = clients
    busy = submit(first, "busy")
    await asyncio.sleep(0.1)
    queued = submit(first, *[f"q{i}" for i in range(6)])
    await asyncio.sleep(0.05)
    with pytest.raises(QueueFull) as refused:
        await submit(second, "one", "two", "three")  # 6 pending + 3 > max_queue_items 8
    assert (refused.value.pending, refused.value.requested, refused.value.limit) == (6, 3, 8)
    await asyncio.gather(busy, queued)


async def test_a_dead_api_process_has_its_work_forgotten(
        engine: tuple[str, BaseProcess], clients: list[EngineClient]) -> None:
    address, _ = engine
    first, second = clients
    busy = submit(first, "busy")
    await asyncio.sleep(0.1)
    orphan = submit(second, "orphan one", "orphan two")
    await asyncio.sleep(0.05)
    supervisor = EngineClient(address, "supervisor-test")
    await supervisor.notify("forget", peer=second.identity)
    await busy
    await asyncio.sleep(0.4)
    assert await forwards(first) == (1, 1)  # the orphans never ran
    assert not orphan.done()  # no answer is sent to a process that is gone
    orphan.cancel()
    supervisor.close()


async def test_sigterm_finishes_what_was_accepted_then_exits_0(
        engine: tuple[str, BaseProcess], clients: list[EngineClient]) -> None:
    _, process = engine
    first, second = clients
    accepted = [submit(first, "a"), submit(second, "b", "c"), submit(first, "d")]
    await asyncio.sleep(0.1)
    assert process.pid is not None
    os.kill(process.pid, signal.SIGTERM)
    results = await asyncio.wait_for(asyncio.gather(*accepted), 10)
    assert [len(r["values"]) for r in results] == [1, 2, 1]  # type: ignore[arg-type]
    await asyncio.to_thread(process.join, 10)
    assert process.exitcode == 0
