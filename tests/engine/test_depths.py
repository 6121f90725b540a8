"""What a worker reports of its load: items queued (`pending_items`) apart from the items
of the forward on the device (`running_items`), which the metrics and a drain's wait read."""

from __future__ import annotations

import asyncio
import time

from ember.engine import WorkerConfig
from tests.engine.helpers import items, running


async def test_a_forward_s_items_count_as_running_and_the_queued_ones_as_pending() -> None:
    config = WorkerConfig(max_batch_items=3, idle_coalesce_ms=0.0, max_batch_wait_ms=0.0)
    async with running(config, overhead_ms=300.0) as (worker, _):
        assert (worker.running_items, worker.pending_items) == (0, 0)
        first = await worker.submit(items(5, 5, 5), None)
        deadline = time.monotonic() + 5
        while worker.running_items == 0:  # the forward thread takes the lone request
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        second = await worker.submit(items(5, 5), None)
        assert (worker.running_items, worker.pending_items) == (3, 2)
        await first
        await second
        assert (worker.running_items, worker.pending_items) == (0, 0)
