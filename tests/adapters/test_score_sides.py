"""A score whose query and documents go in two parameter groups (a model with a query
prompt, ColBERT's markers): both sides stand or fall together."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence

import pytest

from ember.adapters._torch import submit_sides
from ember.adapters.synthetic import CostModel, SyntheticAdapter, SyntheticFault
from ember.engine import ModelWorker, PreparedItem, RequestResult, WorkerConfig

Submit = Callable[[Sequence[PreparedItem], Hashable, str | None], Awaitable[RequestResult]]


async def started_worker(cost: CostModel) -> tuple[ModelWorker, Submit]:
    """A synthetic model's worker, started, and a submit that awaits its result."""
    worker = ModelWorker(SyntheticAdapter(dims=8, cost=cost), WorkerConfig(max_batch_items=8),
                         name="sides")
    await worker.start()

    async def submit(items: Sequence[PreparedItem], params: Hashable,
                     lora: str | None) -> RequestResult:
        return await (await worker.submit(items, params, lora=lora))

    return worker, submit


async def test_when_one_side_fails_the_other_sides_items_are_dropped() -> None:
    """Found by a code review: the documents kept running through forwards after the
    client had the query side's error (and each retry queued them all again)."""
    worker, submit = await started_worker(CostModel(overhead_ms=20.0, per_token_us=0.0))
    texts = ["__fail__ query", *(f"doc {i}" for i in range(64))]  # the query's forward fails
    items = [PreparedItem(text, 2, i) for i, text in enumerate(texts)]
    with pytest.raises(SyntheticFault):
        await submit_sides(submit, items, ("query",), ("document",), None)
    for _ in range(100):
        if worker.pending_items == 0:
            break
        await asyncio.sleep(0.01)
    assert worker.pending_items == 0
    assert worker.stats.dropped_items > 32  # most documents never reached a forward
    assert worker.stats.items < 1 + 32
    await worker.stop()


async def test_a_two_sided_scores_timings_count_each_forward_once() -> None:
    """Found by a metrics review: a long query's forward, which the documents waited on,
    was counted as their queue time and as the query's inference time, so the headers'
    queue + inference came to 1.9x the request's whole time."""
    from ember.adapters.base import combine

    worker, submit = await started_worker(CostModel(overhead_ms=2.0, per_token_us=50.0))
    items = [PreparedItem("a long query", 2000, 0),  # a 100 ms forward
             *(PreparedItem(f"doc {i}", 2, i + 1) for i in range(4))]
    started = time.perf_counter()
    results, _ = await submit_sides(submit, items, ("query",), ("document",), None)
    elapsed_ms = (time.perf_counter() - started) * 1e3
    await worker.stop()
    queue_ms, inference_ms = combine(results)
    assert results[1].queue_ms >= 90  # the documents did wait on the query's forward
    assert queue_ms + inference_ms <= elapsed_ms + 1, (queue_ms, inference_ms, elapsed_ms)
    assert inference_ms >= 90 and queue_ms < 50, (queue_ms, inference_ms)
