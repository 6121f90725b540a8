"""A score whose query and documents go in two parameter groups (a model with a query
prompt, ColBERT's markers): both sides stand or fall together."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Sequence

import pytest

from ember.adapters._torch import submit_sides
from ember.adapters.synthetic import CostModel, SyntheticAdapter, SyntheticFault
from ember.engine import ModelWorker, PreparedItem, RequestResult, WorkerConfig


async def test_when_one_side_fails_the_other_sides_items_are_dropped() -> None:
    """Found by a code review: the documents kept running through forwards after the
    client had the query side's error (and each retry queued them all again)."""
    adapter = SyntheticAdapter(dims=8, cost=CostModel(overhead_ms=20.0, per_token_us=0.0))
    worker = ModelWorker(adapter, WorkerConfig(max_batch_items=8), name="sides")
    await worker.start()

    async def submit(items: Sequence[PreparedItem], params: Hashable,
                     lora: str | None) -> RequestResult:
        return await (await worker.submit(items, params, lora=lora))

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
