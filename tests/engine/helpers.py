"""Workers driven through the public API, on the synthetic adapter (a test model)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ember.adapters.synthetic import CostModel, SyntheticAdapter
from ember.engine import ModelWorker, PreparedItem, WorkerConfig

# Generous: a lone request must finish well inside a 200 ms window.
WELL_UNDER_WINDOW_S = 0.12


def items(*costs: int, text: str = "t") -> list[PreparedItem]:
    """Prepared items with the given costs; payloads are distinct, readable texts."""
    return [PreparedItem(f"{text}{i}:{cost}", cost, i) for i, cost in enumerate(costs)]


class PausableWorker(ModelWorker):
    """A worker whose dispatch a test can hold: requests queue, but no batch is formed or
    released until `resume()`, so a test decides what is queued together."""

    paused = False

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self._wake.set()

    async def stop(self) -> None:
        self.paused = False
        await super().stop()

    def _fill_slot(self) -> None:
        if not self.paused or self._stopping:
            super()._fill_slot()

    def _review_slot(self) -> float | None:
        if self.paused and not self._stopping:
            return None
        return super()._review_slot()

    def _idle(self) -> bool:
        return not self.paused and super()._idle()


@dataclass(frozen=True, slots=True)
class ForwardCall:
    """What one synthetic forward was given."""

    payloads: tuple[str, ...]
    params: Hashable
    lora: str | None


class LoggingSynthetic(SyntheticAdapter):
    """The synthetic adapter, keeping what each forward was given for a test to read."""

    def __init__(self, dims: int = 32, cost: CostModel | None = None) -> None:
        super().__init__(dims, cost)
        self.forward_log: list[ForwardCall] = []
        self._log_lock = threading.Lock()

    def forward(self, items: Sequence[PreparedItem],
                params: Hashable) -> list[npt.NDArray[np.float32]]:
        with self._log_lock:
            self.forward_log.append(ForwardCall(tuple(str(i.payload) for i in items), params,
                                                self._lora))
        return super().forward(items, params)


@asynccontextmanager
async def running(config: WorkerConfig | None = None, *, overhead_ms: float = 1.0,
                  per_token_us: float = 0.0,
                  ) -> AsyncIterator[tuple[PausableWorker, LoggingSynthetic]]:
    adapter = LoggingSynthetic(dims=8, cost=CostModel(overhead_ms, per_token_us, "sleep"))
    worker = PausableWorker(adapter, config or WorkerConfig())
    await worker.start()
    try:
        yield worker, adapter
    finally:
        await worker.stop()


async def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Yield to the loop until `condition()` holds (a bound, not a measurement): a sleep
    would guess, and a busy machine can hold a test past the moment it meant to catch."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.002)


async def until_forward_runs(worker: ModelWorker) -> None:
    """Until a forward holds items (a forward of a few hundred ms, so the poll sees it)."""
    await wait_for(lambda: worker.running_items > 0)


def forward_sizes(adapter: LoggingSynthetic) -> list[int]:
    return [len(call.payloads) for call in adapter.forward_log]


def payloads(adapter: LoggingSynthetic) -> Sequence[tuple[str, ...]]:
    return [call.payloads for call in adapter.forward_log]
