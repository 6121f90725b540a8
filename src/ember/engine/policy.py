"""The dispatch policy: when the next batch of a LoRA may go (R3, R4).

It reads only timestamps and counts, so the rules fit on one screen and need no
event loop to test. The worker asks again on every arrival, at every forward's
end, and at the time the policy returned.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember.engine.config import WorkerConfig


@dataclass(frozen=True, slots=True)
class LastForward:
    """The last forward that ended on a LoRA."""

    ended: float
    requests: int
    duration: float


@dataclass(frozen=True, slots=True)
class QueueView:
    """What the policy sees of one LoRA's next batch and the queue behind it."""

    pending_requests: int  # distinct requests with an item not yet dispatched
    full: bool  # the next batch is at a limit: waiting cannot add to it
    oldest_arrival: float
    last_arrival: float
    arrived_since_forward: int  # requests submitted since the last forward ended


class DispatchPolicy:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config

    def holds_after(self, requests: int) -> bool:
        """Whether a forward of `requests` requests is followed by a hold for its senders."""
        return requests >= 2 and self.config.hold_fraction > 0

    def release_at(self, queue: QueueView, last: LastForward | None,
                   running_requests: int | None, now: float) -> float | None:
        """When the next batch may go: at or before `now` means at once; None means
        when the forward in flight on this LoRA (of `running_requests`) has ended."""
        cfg = self.config
        if queue.full:
            return now
        if running_requests is not None:  # R4: it goes right after, unless senders return
            return None if self.holds_after(running_requests) else now
        if last is not None:
            hold_end = last.ended
            if self.holds_after(last.requests):
                hold_end += min(cfg.max_batch_wait_ms / 1000, cfg.hold_fraction * last.duration)
            if now < hold_end and queue.arrived_since_forward < last.requests:
                # R4: the senders of the last forward are on their way back, so wait
                # for them, unless they stop coming for `coalesce_ms`.
                quiet_end = max(last.ended, queue.last_arrival) + cfg.coalesce_ms / 1000
                return min(hold_end, quiet_end)
            if queue.oldest_arrival <= hold_end:
                return now  # R4: work that came during a forward or its hold goes at once
        return self.idle_release_at(queue)

    def idle_release_at(self, queue: QueueView) -> float:
        """R3: work that reached an idle worker."""
        cfg = self.config
        if cfg.idle_coalesce_ms == 0 or queue.pending_requests == 1:
            return queue.last_arrival  # R3a, R3b: a lone request never waits
        # R3c: a burst already queued coalesces until it goes quiet, or max wait.
        return min(queue.last_arrival + cfg.idle_coalesce_ms / 1000,
                   queue.oldest_arrival + cfg.max_batch_wait_ms / 1000)
