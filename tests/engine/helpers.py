"""Workers driven through the public API, on the synthetic adapter (a test model)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from ember.adapters.synthetic import CostModel, SyntheticAdapter
from ember.engine import ModelWorker, PreparedItem, WorkerConfig

# Generous: a lone request must finish well inside a 200 ms window.
WELL_UNDER_WINDOW_S = 0.12


def items(*costs: int, text: str = "t") -> list[PreparedItem]:
    """Prepared items with the given costs; payloads are distinct, readable texts."""
    return [PreparedItem(f"{text}{i}:{cost}", cost, i) for i, cost in enumerate(costs)]


@asynccontextmanager
async def running(config: WorkerConfig | None = None, *, overhead_ms: float = 1.0,
                  per_token_us: float = 0.0) -> AsyncIterator[tuple[ModelWorker, SyntheticAdapter]]:
    adapter = SyntheticAdapter(dims=8, cost=CostModel(overhead_ms, per_token_us, "sleep"))
    worker = ModelWorker(adapter, config or WorkerConfig())
    await worker.start()
    try:
        yield worker, adapter
    finally:
        await worker.stop()


def forward_sizes(adapter: SyntheticAdapter) -> list[int]:
    return [len(call.payloads) for call in adapter.forward_log]


def payloads(adapter: SyntheticAdapter) -> Sequence[tuple[str, ...]]:
    return [call.payloads for call in adapter.forward_log]
