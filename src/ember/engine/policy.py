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
    """The last forward that ended on a LoRA; `senders_return` tells whether the
    senders of the forward before it all came back within `max_batch_wait_ms`."""

    ended: float
    requests: int
    duration: float
    senders_return: bool = False


@dataclass(frozen=True, slots=True)
class QueueView:
    """What the policy sees of one LoRA's next batch and the queue behind it."""

    pending_requests: int  # distinct requests with an item not yet dispatched
    full: bool  # the next batch is at a limit: waiting cannot add to it
    oldest_arrival: float
    last_arrival: float
    arrived_since_forward: int  # requests submitted since the last forward ended
    senders_return: bool = False  # the last forward's senders are back, or may still be


class DispatchPolicy:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config

    def hold_s(self, requests: int, duration: float) -> float:
        """How long the senders of a forward of `requests` may be awaited after it."""
        if requests < 2:
            return 0.0
        return min(self.config.max_batch_wait_ms / 1000, self.config.hold_fraction * duration)

    def release_at(self, queue: QueueView, last: LastForward | None,
                   running_requests: int | None, now: float) -> float | None:
        """When the next batch may go: at or before `now` means at once; None means
        when the forward in flight on this LoRA (of `running_requests`) has ended."""
        cfg = self.config
        if queue.full:
            return now
        if running_requests is not None:  # R4: its backlog goes right after it...
            awaits = queue.senders_return and self.hold_s(running_requests, 1.0) > 0
            return None if awaits else now  # ...unless its senders are worth awaiting
        if last is not None:
            hold_end = last.ended
            if last.senders_return:  # R4: closed-loop clients: they come back at once
                hold_end += self.hold_s(last.requests, last.duration)
            if now < hold_end and queue.arrived_since_forward < last.requests:
                return hold_end  # over HTTP returns come ms apart: no quiet window here
            if queue.oldest_arrival <= hold_end:
                return now  # R4: work that came during a forward or its hold goes at once
            if (queue.arrived_since_forward >= last.requests >= 2
                    and queue.oldest_arrival <= last.ended + cfg.max_batch_wait_ms / 1000):
                return now  # R3c ends: the senders of the last forward are all back
        return self.idle_release_at(queue)

    def idle_release_at(self, queue: QueueView) -> float:
        """R3: work that reached an idle worker."""
        cfg = self.config
        if cfg.idle_coalesce_ms == 0 or queue.pending_requests == 1:
            return queue.last_arrival  # R3a, R3b: a lone request never waits
        # R3c: a burst already queued coalesces until it goes quiet, or max wait.
        return min(queue.last_arrival + cfg.idle_coalesce_ms / 1000,
                   queue.oldest_arrival + cfg.max_batch_wait_ms / 1000)
