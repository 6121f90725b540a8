"""What a worker did: per-batch records, request timings, and listeners for metrics."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

HISTORY = 10_000  # recent records kept for inspection; totals are never trimmed


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """One forward."""

    items: int
    requests: int
    padded_tokens: int
    lora: str | None
    duration_ms: float
    failed: bool
    started: float = 0.0  # perf_counter seconds, for gaps between forwards
    ended: float = 0.0
    real_tokens: int = 0  # the items' own costs, before padding
    dispatched: float = 0.0  # released with the device free; started - dispatched: hand-off


@dataclass(slots=True)  # not frozen: one is made a request, and frozen init costs 3x
class RequestRecord:
    """One finished request (R10)."""

    items: int
    queue_ms: float
    inference_ms: float
    failed: bool
    cancelled: bool = False  # the caller went away while its forward ran

    @property
    def succeeded(self) -> bool:
        return not (self.failed or self.cancelled)


BatchListener = Callable[[BatchRecord], None]
RequestListener = Callable[[Sequence[RequestRecord]], None]  # the requests one forward ended


@dataclass
class WorkerStats:
    batches: int = 0
    items: int = 0
    failed_batches: int = 0
    dropped_items: int = 0
    recent_batches: deque[BatchRecord] = field(default_factory=lambda: deque(maxlen=HISTORY))
    recent_requests: deque[RequestRecord] = field(default_factory=lambda: deque(maxlen=HISTORY))
    batch_listeners: list[BatchListener] = field(default_factory=list)
    request_listeners: list[RequestListener] = field(default_factory=list)
    drop_listeners: list[Callable[[int], None]] = field(default_factory=list)

    @property
    def batch_sizes(self) -> list[int]:
        """Items per forward, oldest first (the last HISTORY forwards)."""
        return [b.items for b in self.recent_batches]

    @property
    def batch_requests(self) -> list[int]:
        return [b.requests for b in self.recent_batches]

    @property
    def batch_loras(self) -> list[str | None]:
        return [b.lora for b in self.recent_batches]

    @property
    def queue_ms(self) -> list[float]:
        return [r.queue_ms for r in self.recent_requests]

    @property
    def inference_ms(self) -> list[float]:
        return [r.inference_ms for r in self.recent_requests]

    def record_batch(self, record: BatchRecord) -> None:
        self.batches += 1
        self.items += record.items
        self.failed_batches += record.failed
        self.recent_batches.append(record)
        for listener in self.batch_listeners:
            listener(record)

    def record_requests(self, records: Sequence[RequestRecord]) -> None:
        self.recent_requests.extend(records)
        for listener in self.request_listeners:
            listener(records)

    def record_dropped(self, count: int) -> None:
        self.dropped_items += count
        for listener in self.drop_listeners:
            listener(count)
