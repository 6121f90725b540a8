"""Nothing accepted is lost: every way the loop can fail ends each future with an
error, the worker refuses work until restarted, and works again after (R7-R9)."""

from __future__ import annotations

import asyncio

import pytest

from ember.engine import (
    BatchRecord,
    QueueFull,
    RequestTooLarge,
    WorkerConfig,
    WorkerFailed,
)
from tests.engine.helpers import items, payloads, running, until_forward_runs, wait_for

SLOW = WorkerConfig(idle_coalesce_ms=0.0)


def loop_task(name: str) -> asyncio.Task[object]:
    """The worker's loop, found by its public task name, as an operator would."""
    return next(t for t in asyncio.all_tasks() if t.get_name() == f"ember-worker-{name}")


async def test_an_error_in_the_loop_fails_every_accepted_request_with_an_error() -> None:
    async with running(SLOW, overhead_ms=200.0) as (worker, _):

        def broken(*args: object) -> None:  # the cost model, learning from each forward
            raise RuntimeError("policy bug")

        worker.policy.observe = broken  # type: ignore[method-assign]
        in_flight = await worker.submit(items(2), "p")
        await until_forward_runs(worker)
        queued = await worker.submit(items(2), "q")  # another group: waits behind it
        done = await asyncio.wait_for(asyncio.gather(in_flight, queued,
                                                     return_exceptions=True), 2.0)
        assert all(isinstance(d, WorkerFailed) for d in done)
        assert "policy bug" in str(done[0]) and "restarted" in str(done[0])
        assert isinstance(worker.failure, WorkerFailed) and not worker.running
        with pytest.raises(WorkerFailed):  # refused, not queued onto a dead loop
            await worker.submit(items(2), "p")

        del worker.policy.observe
        await worker.restart()
        result = await asyncio.wait_for(await worker.submit(items(2, 3), "p"), 2.0)
        assert len(result.values) == 2 and worker.failure is None


async def test_a_failing_stats_listener_is_logged_and_loses_no_answer(
        caplog: pytest.LogCaptureFixture) -> None:
    """Listeners (the metrics) hear of a forward once its answers are out: a broken one
    is an error in the log, never a lost answer, a silenced listener or a stopped worker."""
    async with running(SLOW, overhead_ms=5.0) as (worker, _):
        heard: list[int] = []

        def broken(record: BatchRecord) -> None:
            raise RuntimeError("listener bug")

        worker.stats.batch_listeners += [broken, lambda record: heard.append(record.items)]
        first = await (await worker.submit(items(2, 3), "p"))
        assert len(first.values) == 2 and worker.stats.batches == 1
        assert heard == []  # the answer came first; the listeners are next in line
        await asyncio.sleep(0)
        assert heard == [2]
        second = await (await worker.submit(items(4), "p"))
        await asyncio.sleep(0)
        assert len(second.values) == 1 and heard == [2, 1]
        assert worker.failure is None and worker.running
    failures = [r for r in caplog.records if r.exc_info and "listener bug" in str(r.exc_info[1])]
    assert len(failures) == 2 and all(r.name == "ember.engine" for r in failures)


async def test_a_cancelled_loop_during_a_forward_fails_its_requests_with_an_error() -> None:
    async with running(SLOW, overhead_ms=300.0) as (worker, _):
        in_flight = await worker.submit(items(2), "p")
        await until_forward_runs(worker)
        queued = await worker.submit(items(2), "q")
        loop_task(worker.name).cancel()
        done = await asyncio.wait_for(asyncio.gather(in_flight, queued,
                                                     return_exceptions=True), 2.0)
        assert all(isinstance(d, WorkerFailed) for d in done)
        with pytest.raises(WorkerFailed):
            await worker.submit(items(2), "p")
        await worker.restart()
        assert len((await asyncio.wait_for(await worker.submit(items(1), "p"), 2.0)).values) == 1


async def test_a_request_cancelled_while_its_forward_runs_is_not_a_success() -> None:
    async with running(SLOW, overhead_ms=300.0) as (worker, _):
        future = await worker.submit(items(2, 2), "p")
        await until_forward_runs(worker)
        future.cancel()
        await wait_for(lambda: bool(worker.stats.recent_requests))  # its forward ended
        record = worker.stats.recent_requests[-1]
        assert record.cancelled and not record.succeeded
        after = await (await worker.submit(items(2), "p"))
        assert worker.stats.recent_requests[-1].succeeded and len(after.values) == 1


async def test_a_cancelled_awaiting_task_drops_its_pending_items_in_the_engine() -> None:
    async with running(SLOW) as (worker, adapter):
        worker.pause()

        async def caller() -> object:
            return await (await worker.submit(items(2, 2, text="gone"), "p"))

        task = asyncio.create_task(caller())
        await asyncio.sleep(0.01)
        assert worker.pending_items == 2
        task.cancel()  # the caller went away: nothing in between cancels for it
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert worker.pending_items == 0 and worker.stats.dropped_items == 2
        worker.resume()
        await (await worker.submit(items(1, text="kept"), "p"))
    assert [p for call in payloads(adapter) for p in call] == ["kept0:1"]


async def test_a_request_that_can_never_fit_is_refused_as_too_large() -> None:
    async with running(WorkerConfig(max_queue_items=4)) as (worker, _):
        with pytest.raises(RequestTooLarge, match="max_queue_items=4") as caught:
            await worker.submit(items(*[1] * 5), "p")
        assert not isinstance(caught.value, QueueFull)  # not worth retrying
        assert worker.pending_items == 0
        assert len((await (await worker.submit(items(*[1] * 4), "p"))).values) == 4


async def test_fcfs_across_loras_holds_within_one_forward() -> None:
    config = WorkerConfig(idle_coalesce_ms=0.0, max_batch_items=4)
    async with running(config) as (worker, adapter):
        worker.pause()
        older = [await worker.submit(items(1, text="old"), "p", lora="hot") for _ in range(6)]
        cold = await worker.submit(items(1, text="cold"), "p", lora="cold")
        newer = [await worker.submit(items(1, text="new"), "p", lora="hot") for _ in range(6)]
        worker.resume()
        await asyncio.gather(*older, cold, *newer)
    # Each forward re-selects the lane with the oldest item: the cold request runs right
    # after the forward that took the last hot item older than it, so the later hot
    # backlog passes it within one forward at most, never for a whole drain.
    forwards = [[p.removesuffix("0:1") for p in call] for call in payloads(adapter)]
    cold = forwards.index(["cold"])
    assert cold == max(i for i, f in enumerate(forwards) if "old" in f) + 1
    assert sum("new" in f for f in forwards[:cold]) <= 1


async def test_stop_after_a_failure_returns_and_restart_after_a_stop_works() -> None:
    async with running(SLOW) as (worker, _):
        loop_task(worker.name).cancel()
        await asyncio.sleep(0.01)
        await worker.stop()
        await worker.restart()
        assert worker.running
        assert len((await (await worker.submit(items(1), "p"))).values) == 1
