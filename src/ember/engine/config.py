"""Batching and dispatch settings of one model worker."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkerConfig:
    """Limits and windows of the dispatch rules (DESIGN.md R3-R7).

    `hold_lone_idle_requests` restores the earlier rule in which an idle worker
    held even a lone request for `idle_coalesce_ms`. It exists only so the
    benchmarks can compare before and after; leave it off.

    `hold_for_returning_senders` (R3d): a lone arrival on an idle worker whose
    last forward on that LoRA ended within `returning_window_ms` carrying N >= 2
    requests is held for the idle window, or until N requests are pending,
    since a closed-loop burst is on its way back. A sequential client (last
    forward of one request) still never waits.

    `drain_hold_ms` (R4b, 0 = off): after a forward of N >= 2 requests, the backlog
    drain waits until the N senders are back beside it, no arrival came for that
    long, or `max_batch_wait_ms` passed since the hold began, so two cohorts of
    clients merge into one forward instead of alternating.
    """

    max_batch_tokens: int = 16384
    max_batch_items: int = 64
    max_batch_wait_ms: float = 10.0
    coalesce_ms: float = 2.0
    idle_coalesce_ms: float = 3.0
    max_queue_items: int = 4096
    starvation_ms: float = field(default=-1.0)
    hold_lone_idle_requests: bool = False
    hold_for_returning_senders: bool = False
    returning_window_ms: float = 5.0
    drain_hold_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.starvation_ms < 0:
            # A few batch windows: long enough to batch, short enough to bound waiting.
            object.__setattr__(self, "starvation_ms", 4 * self.max_batch_wait_ms)
        for name in ("max_batch_tokens", "max_batch_items", "max_queue_items"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_batch_wait_ms", "coalesce_ms", "idle_coalesce_ms",
                     "returning_window_ms", "drain_hold_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
