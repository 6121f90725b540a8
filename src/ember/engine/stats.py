"""What a worker did: per-batch records, request timings, and listeners for metrics."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

HISTORY = 10_000  # recent records kept for inspection; totals are never trimmed
GAP_CAUSES = ("hold", "formation", "wakeup")
GAP_FLOOR_S = 1e-4  # a cause's share under this is not counted as a gap (still summed)

log = logging.getLogger("ember.engine")


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
    oldest_arrival: float = 0.0  # the batch's oldest item reached the worker
    hold_until: float = 0.0  # the policy may hold the next batch until then (R4's hold)


@dataclass(frozen=True, slots=True)
class IdleGap:
    """Before one forward: seconds the device was idle while its items waited, by cause.
    `hold`: within the hold the policy may keep after the last forward (R4); `formation`:
    the rest until the batch was released (an idle burst's window, R3c, or the loop's
    turn to form and release it); `wakeup`: release to the forward thread's start."""

    hold: float
    formation: float
    wakeup: float

    def by_cause(self) -> dict[str, float]:
        return {"hold": self.hold, "formation": self.formation, "wakeup": self.wakeup}


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
GapListener = Callable[[IdleGap], None]
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
    gap_listeners: list[GapListener] = field(default_factory=list)
    # Device idle while work waited: seconds and gaps (share >= GAP_FLOOR_S), by cause.
    idle_gap_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(GAP_CAUSES, 0.0))
    idle_gaps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(GAP_CAUSES, 0))
    _device_free: float = 0.0  # the last forward's end
    _hold_until: float = 0.0
    # Where listeners are called: at once (None), or through this (the worker sets its
    # loop's call_soon), so metric writes run after the answers they describe are out.
    defer: Callable[..., object] | None = None

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
        gap = self.idle_gap(record)
        self._device_free, self._hold_until = record.ended, record.hold_until
        if gap is None:
            self._tell((self.batch_listeners, record))
            return
        for cause, seconds in gap.by_cause().items():
            self.idle_gap_s[cause] += seconds
            self.idle_gaps[cause] += seconds >= GAP_FLOOR_S
        # One call for both: each deferred call is a handle on the loop, per forward.
        self._tell((self.gap_listeners, gap), (self.batch_listeners, record))

    def _tell(self, *news: tuple[Sequence[Callable[[Any], None]], object]) -> None:
        if not any(listeners for listeners, _ in news):
            return
        if self.defer is None:
            _call_each(*news)
        else:
            self.defer(_call_each, *news)

    def idle_gap(self, record: BatchRecord) -> IdleGap | None:
        """The device idle before `record`'s forward while its items waited (records come
        in order, so the last one's end is when the device became free); None if none."""
        waiting = max(self._device_free, record.oldest_arrival)
        if record.oldest_arrival <= 0.0 or record.started <= waiting:
            return None
        released = min(max(record.dispatched, waiting), record.started)
        hold = max(0.0, min(released, self._hold_until) - waiting)
        return IdleGap(hold, released - waiting - hold, record.started - released)

    def record_requests(self, records: Sequence[RequestRecord]) -> None:
        self.recent_requests.extend(records)
        self._tell((self.request_listeners, records))

    def record_dropped(self, count: int) -> None:
        self.dropped_items += count
        self._tell((self.drop_listeners, count))


def _call_each(*news: tuple[Sequence[Callable[[Any], None]], object]) -> None:
    """Each listener hears its value; one that fails is logged and the rest still hear
    theirs (a metric's bug must not cost an answer or another metric)."""
    for listeners, value in news:
        for listener in listeners:
            try:
                listener(value)
            except Exception:
                log.exception("a stats listener failed: %r", listener)
