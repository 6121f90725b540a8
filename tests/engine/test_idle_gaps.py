"""The device-idle gaps: time a model's device sat idle while its work waited, by cause
(stats.py), through the real worker on the synthetic adapter and on records alone."""

from __future__ import annotations

import asyncio

from ember.engine import WorkerConfig
from ember.engine.stats import GAP_CAUSES, BatchRecord, IdleGap, WorkerStats
from tests.engine.helpers import forward_sizes, items, running


def record(*, arrival: float, dispatched: float, started: float, ended: float,
           hold_until: float = 0.0) -> BatchRecord:
    return BatchRecord(1, 1, 3, None, (ended - started) * 1000, False, started, ended, 3,
                       dispatched, arrival, hold_until)


def test_work_released_before_the_device_got_free_is_no_gap() -> None:
    stats = WorkerStats()
    stats.record_batch(record(arrival=1.0, dispatched=1.0, started=1.0, ended=2.0))
    # queued during the first forward and released before it ended: taken at once
    assert stats.idle_gap(record(arrival=1.5, dispatched=2.0, started=2.0, ended=3.0)) is None


def test_a_gap_splits_into_hold_formation_and_wakeup() -> None:
    stats = WorkerStats()
    stats.record_batch(record(arrival=1.0, dispatched=1.0, started=1.0, ended=2.0,
                              hold_until=2.3))
    # queued at 1.5, device free at 2.0, held until 2.3, released at 2.5, started at 2.6
    gap = stats.idle_gap(record(arrival=1.5, dispatched=2.5, started=2.6, ended=3.0))
    assert gap is not None
    assert abs(gap.hold - 0.3) < 1e-9
    assert abs(gap.formation - 0.2) < 1e-9
    assert abs(gap.wakeup - 0.1) < 1e-9


def test_work_arriving_at_an_idle_device_starts_its_gap_at_arrival() -> None:
    stats = WorkerStats()
    stats.record_batch(record(arrival=1.0, dispatched=1.0, started=1.0, ended=2.0,
                              hold_until=2.5))
    second = record(arrival=4.0, dispatched=4.2, started=4.25, ended=5.0)
    stats.record_batch(second)
    assert stats.idle_gap_s["hold"] == 0.0  # the hold had long run out
    assert abs(stats.idle_gap_s["formation"] - 0.2) < 1e-9
    assert abs(stats.idle_gap_s["wakeup"] - 0.05) < 1e-9
    assert stats.idle_gaps == {"hold": 0, "formation": 1, "wakeup": 1}


def test_listeners_hear_each_gap_once() -> None:
    stats = WorkerStats()
    heard: list[IdleGap] = []
    stats.gap_listeners.append(heard.append)
    stats.record_batch(record(arrival=1.0, dispatched=1.1, started=1.2, ended=2.0))
    stats.record_batch(record(arrival=1.5, dispatched=1.9, started=2.0, ended=3.0))
    assert len(heard) == 1 and abs(heard[0].formation - 0.1) < 1e-9


async def test_an_idle_burst_window_is_counted_as_formation() -> None:
    config = WorkerConfig(idle_coalesce_ms=80.0, max_batch_wait_ms=400.0)
    async with running(config) as (worker, adapter):
        worker.pause()
        futures = [await worker.submit(items(3), "p") for _ in range(3)]
        worker.resume()  # R3c: the burst waits until no arrival for 80 ms
        await asyncio.gather(*futures)
        assert forward_sizes(adapter) == [3]
        gaps = worker.stats.idle_gap_s
        assert gaps["formation"] >= 0.07
        assert gaps["hold"] == 0.0
        assert worker.stats.idle_gaps["formation"] == 1


async def test_sequential_lone_requests_leave_almost_no_gap() -> None:
    # Were each to wait out the 400 ms window, the gaps would add up to 2 s.
    async with running(WorkerConfig(idle_coalesce_ms=400.0)) as (worker, adapter):
        for _ in range(5):
            await (await worker.submit(items(3), "p"))  # R3b: each goes at once
        assert forward_sizes(adapter) == [1] * 5
        assert sum(worker.stats.idle_gap_s[c] for c in GAP_CAUSES) < 0.2
        assert worker.stats.idle_gap_s["hold"] == 0.0
