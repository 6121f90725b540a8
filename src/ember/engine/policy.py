"""The dispatch policy: when the next batch of a LoRA may go (R3, R4), and the
windows it uses, learned from the device's cost per forward.

It reads only timestamps, counts and the forwards' durations, so the rules fit on
one screen and need no event loop to test. The worker asks again on every arrival,
at every forward's end, and at the time the policy returned; it reports each
forward it ran to `observe`.

The windows (docs/architecture.md, "Self-tuning windows"): with a forward costing
`fixed + per_token x padded tokens`,
- waiting is worth at most what one fewer forward saves, its fixed part: the batch
  wait bound is WAIT_OF_FIXED x fixed, the idle burst's quiet window
  QUIET_OF_FIXED x fixed, and never longer than twice the gaps between the burst's
  own arrivals (a stream that comes faster is over sooner);
- padding is worth taking while it costs less than a forward's fixed part: where the
  padding a full forward (max_batch_items x tokens per item) may take for its fixed part,
  `1 + (fixed / per_token) / full forward`, passes 1.5 (a GPU: padding is nearly free),
  the bound is off; elsewhere it stays at the fixed 1.05, because a looser bound between
  the two broke the overload wait bound (R5) without serving more (docs/bench/notes.md).
- a forward lasts about FORWARD_TARGET_S at most: an item arriving as it starts waits
  all of it (the lead rule, R5, cannot cut into a forward that runs). So the token budget
  is what a forward of that length holds, unless that would leave its fixed part over
  1/TOKENS_OF_FIXED of it (then that many fixed parts' worth of tokens); at least
  MIN_LEARNED_BATCH_TOKENS and at most the fixed 16,384. On a CPU, where 64 long texts
  took seconds, a forward of a quarter second; on a GPU, the fixed budget. Before the
  cost per token is measured, a forward of at least that many tokens that took half the
  target or more gives the budget on its own (its tokens per second, as if it had no
  fixed part: fewer tokens than the fit would give), so the first slow forward already
  shortens the next;
- the hold after a forward (R4: its senders are awaited) is at most `hold_fraction` of the
  forward and the batch wait bound, except where a forward keeps every core of the host
  busy (ONNX Runtime on CPU): there the held time is not lost, the cores do the returning
  senders' request work (HTTP, tokenizing) that a forward started meanwhile would fight
  for, and half-full forwards that alternate for good cost more per item. So there the
  hold lasts until the senders are back, at most HOLD_OF_FORWARD_ON_HOST of the forward,
  and ends early once they stop coming (none back for the fixed batch wait); it awaits
  only the senders of a forward that ended in near quiet (open-loop arrivals keep coming
  through a forward, closed-loop senders wait for their answers).
The time windows never exceed the fixed defaults, and a window set by hand stays as set.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ember.engine.config import (
    FIXED_IDLE_COALESCE_MS,
    FIXED_MAX_BATCH_TOKENS,
    FIXED_MAX_BATCH_WAIT_MS,
    FIXED_MAX_PADDING,
    WorkerConfig,
)
from ember.engine.costfit import CostEstimate, CostFit

WAIT_OF_FIXED = 0.5  # batch wait bound, in forwards' fixed parts
QUIET_OF_FIXED = 0.25  # idle burst's quiet window, in forwards' fixed parts
QUIET_OF_GAPS = 2.0  # ... and in mean gaps between the burst's arrivals
PADDING_OFF_AT = 1.5  # a learned padding bound this loose is no bound: off
FORWARD_TARGET_S = 0.25  # the learned token budget: a forward of this long...
TOKENS_OF_FIXED = 32  # ...unless its fixed part would pass 1/this of it
MIN_LEARNED_BATCH_TOKENS = 512  # ...and never fewer tokens, whatever a noisy fit says
SLOW_OF_TARGET = 0.5  # before the fit: a forward this long of the target says "slow"...
FASTER = 1.25  # ...until one of at least MIN_LEARNED_BATCH_TOKENS runs this much faster
HOLD_OF_FORWARD_ON_HOST = 0.5  # the hold after a forward that fills the cores, in forwards
OTHERS_PER_SENDER = 4  # arrivals in a forward's tail that say its senders are not alone


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
    lora: str | None = None


@dataclass(frozen=True, slots=True)
class Windows:
    """The windows a LoRA's batches are under now."""

    max_batch_wait_ms: float
    idle_coalesce_ms: float
    max_padding: float  # 0: off
    learned: bool  # some window came from what forwards cost (else: settings and defaults)
    hold_of_forward: float = 0.25  # the hold after a forward: at most this part of it...
    hold_max_ms: float | None = None  # ...and at most this (None: no bound but the forward's)
    max_batch_tokens: int = FIXED_MAX_BATCH_TOKENS  # padded tokens a forward may hold

    @property
    def long_hold(self) -> bool:
        """The hold for a forward that fills the cores: until all senders are back."""
        return self.hold_max_ms is None


def learned_batch_tokens(cost: CostEstimate | None, slow_rate: float | None) -> int | None:
    """The token budget for a device of `cost`, or, while its cost per token is unmeasured,
    of `slow_rate` (padded tokens a second of the device's long forwards);
    None where neither says a forward of the fixed budget is too long."""
    if cost is not None and cost.per_token_seen and cost.per_token_us > 0:
        per_token_s = cost.per_token_us / 1e6
        wanted = max((FORWARD_TARGET_S - cost.fixed_ms / 1000) / per_token_s,
                     TOKENS_OF_FIXED * cost.tokens_per_fixed)
    elif slow_rate is not None:
        wanted = FORWARD_TARGET_S * slow_rate
    else:
        return None
    return int(min(FIXED_MAX_BATCH_TOKENS, max(MIN_LEARNED_BATCH_TOKENS, wanted)))


def derive_windows(config: WorkerConfig, cost: CostEstimate | None,
                   slow_rate: float | None = None) -> Windows:
    """The windows for a device of `cost` (None: not learned yet), and of `slow_rate` for
    the token budget (`learned_batch_tokens`). A window set in `config` wins;
    `dispatch="fixed"` or nothing learned gives the fixed defaults."""
    wait, quiet, padding = config.batch_wait_ms, config.coalesce_ms, config.padding
    tokens = config.batch_tokens
    if config.dispatch == "auto" and config.max_batch_tokens is None:
        tokens = learned_batch_tokens(cost, slow_rate) or tokens
    learned = tokens != config.batch_tokens  # before the fit, from a slow forward
    if config.dispatch == "auto" and cost is not None:
        full_forward = config.max_batch_items * max(cost.item_tokens, 1.0)  # real tokens
        # Nearly free: a full forward could pad this far for the price of its fixed part.
        # Not known while every forward had about one size (the slope is unmeasured).
        free = cost.per_token_seen and 1 + cost.tokens_per_fixed / full_forward >= PADDING_OFF_AT
        if config.max_batch_wait_ms is None:
            wait = min(FIXED_MAX_BATCH_WAIT_MS, WAIT_OF_FIXED * cost.fixed_ms)
        if config.idle_coalesce_ms is None:
            quiet = min(FIXED_IDLE_COALESCE_MS, QUIET_OF_FIXED * cost.fixed_ms)
        if config.max_padding is None:
            padding = 0.0 if free else FIXED_MAX_PADDING
        learned = None in (config.max_batch_wait_ms, config.idle_coalesce_ms,
                           config.max_padding, config.max_batch_tokens)
    if (config.dispatch == "auto" and config.forward_fills_cores
            and config.max_batch_wait_ms is None and config.hold_fraction > 0):
        return Windows(wait, quiet, padding, learned, HOLD_OF_FORWARD_ON_HOST, None,
                       max_batch_tokens=tokens)
    return Windows(wait, quiet, padding, learned, config.hold_fraction, wait,
                   max_batch_tokens=tokens)


class DispatchPolicy:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self._fits: dict[str | None, CostFit] = {}  # each LoRA's forwards; None: the base
        self._windows: dict[str | None, Windows] = {}
        # Each LoRA's device speed from its long forwards, in padded tokens a second.
        self._slow_rates: dict[str | None, float] = {}

    # -- the cost model and the windows it gives -----------------------------------

    def observe(self, lora: str | None, padded_tokens: int, real_tokens: int, items: int,
                seconds: float) -> None:
        """One forward ran on `lora`: learn from it (auto dispatch only)."""
        if self.config.dispatch == "fixed":
            return
        fit = self._fits.get(lora)
        if fit is None:
            fit = self._fits[lora] = CostFit()
        refitted = fit.observe(padded_tokens, real_tokens, items, seconds)
        if padded_tokens >= MIN_LEARNED_BATCH_TOKENS and seconds > 0:
            rate, known = padded_tokens / seconds, self._slow_rates.get(lora)
            # A long forward says the device is slow, at once; a much faster one after it
            # says the long one had paused (a collector, another tenant), and undoes it.
            if seconds >= SLOW_OF_TARGET * FORWARD_TARGET_S or (
                    known is not None and rate > FASTER * known):
                self._slow_rates[lora] = rate
                refitted = True
        if refitted:
            self._windows.clear()  # derived again on the next ask: O(1) amortised

    def cost(self, lora: str | None = None) -> CostEstimate | None:
        """The estimate the windows of `lora` come from: its own once it has enough
        forwards (a LoRA may cost more than the base), else the base model's, else any."""
        for fit in (self._fits.get(lora), self._fits.get(None), *self._fits.values()):
            if fit is not None and fit.estimate is not None:
                return fit.estimate
        return None

    def windows(self, lora: str | None = None) -> Windows:
        windows = self._windows.get(lora)
        if windows is None:
            slow_rate = self._slow_rates.get(lora, self._slow_rates.get(None))
            windows = self._windows[lora] = derive_windows(self.config, self.cost(lora),
                                                           slow_rate)
        return windows

    def loras(self) -> list[str | None]:
        """The LoRAs seen so far (None: the base model)."""
        return list(self._fits)

    # -- the rules ----------------------------------------------------------------------

    def hold_s(self, requests: int, duration: float, lora: str | None = None) -> float:
        """How long the senders of a forward of `requests` may be awaited after it."""
        if requests < 2:
            return 0.0
        windows = self.windows(lora)
        hold = windows.hold_of_forward * duration
        return hold if windows.hold_max_ms is None else min(hold, windows.hold_max_ms / 1000)

    def watches_senders(self, requests: int, hold: float,
                        arrived_in_last: Callable[[float], int],
                        lora: str | None = None) -> bool:
        """Whether the senders of a forward of `requests` may be worth awaiting for the
        `hold` after it (`hold_s`); `arrived_in_last(s)` counts the requests that arrived
        in its last `s` seconds (asked only where it matters). Where the hold is long (a
        forward that fills the cores), only if fewer than a quarter of its requests
        arrived in its last stretch as long as that hold: closed-loop senders wait for
        their answers, so their forward runs to its end in near quiet, while open-loop
        arrivals keep coming through it, and a forward's worth of them arriving soon after
        its end, seldom as that is, would otherwise pass for its senders and hold the
        cores idle."""
        if requests < 2:
            return False
        if not self.windows(lora).long_hold:
            return True
        return arrived_in_last(hold) * OTHERS_PER_SENDER < requests

    def returns_needed(self, requests: int, lora: str | None = None) -> int:
        """How many of a forward's `requests` must be back within its hold for its senders
        to count as returning: half, or all where the hold is long (a forward that fills
        the cores), so that open-loop arrivals, which seldom all come that soon, do not
        pass for returning senders and get held."""
        return requests if self.windows(lora).long_hold else (requests + 1) // 2

    def hold_end(self, queue: QueueView, last: LastForward) -> float:
        """When the hold after `last` ends: its own bound, or sooner where only the
        forward bounds it (a forward that fills the cores) and the senders stopped coming."""
        end = last.ended + self.hold_s(last.requests, last.duration, queue.lora)
        if self.windows(queue.lora).long_hold:
            end = min(end, max(last.ended, queue.last_arrival) + FIXED_MAX_BATCH_WAIT_MS / 1000)
        return end

    def release_at(self, queue: QueueView, last: LastForward | None,
                   running_requests: int | None, now: float) -> float | None:
        """When the next batch may go: at or before `now` means at once; None means
        when the forward in flight on this LoRA (of `running_requests`) has ended."""
        if queue.full:
            return now
        if running_requests is not None:  # R4: its backlog goes right after it...
            awaits = queue.senders_return and self.hold_s(running_requests, 1.0, queue.lora) > 0
            return None if awaits else now  # ...unless its senders are worth awaiting
        if last is not None:
            hold_end = last.ended
            if last.senders_return:  # R4: closed-loop clients: they come back at once
                hold_end = self.hold_end(queue, last)
            if now < hold_end and queue.arrived_since_forward < last.requests:
                return hold_end  # over HTTP returns come ms apart: no quiet window here
            if queue.oldest_arrival <= hold_end:
                return now  # R4: work that came during a forward or its hold goes at once
            wait_s = self.windows(queue.lora).max_batch_wait_ms / 1000
            if (queue.arrived_since_forward >= last.requests >= 2
                    and queue.oldest_arrival <= last.ended + wait_s):
                return now  # R3c ends: the senders of the last forward are all back
        return self.idle_release_at(queue)

    def idle_release_at(self, queue: QueueView) -> float:
        """R3: work that reached an idle worker."""
        windows = self.windows(queue.lora)
        if windows.idle_coalesce_ms == 0 or queue.pending_requests == 1:
            return queue.last_arrival  # R3a, R3b: a lone request never waits
        # R3c: a burst already queued coalesces until it goes quiet, or max wait.
        quiet_s = windows.idle_coalesce_ms / 1000
        if windows.learned and self.config.idle_coalesce_ms is None:
            gap_s = (queue.last_arrival - queue.oldest_arrival) / (queue.pending_requests - 1)
            quiet_s = min(quiet_s, QUIET_OF_GAPS * gap_s)  # the burst's own pace
        return min(queue.last_arrival + quiet_s,
                   queue.oldest_arrival + windows.max_batch_wait_ms / 1000)

    def describe(self) -> dict[str, Any]:
        """The learned cost model and the windows in use, as plain values (for
        `GET /v1/models/{id}` and `/metrics`; they cross the engine's wire as they are)."""

        def of(lora: str | None) -> dict[str, Any]:
            cost = self.cost(lora)
            return {"windows": asdict(self.windows(lora)),
                    "cost": described_cost(cost) if cost is not None else None}

        return {"dispatch": self.config.dispatch, **of(None),
                "loras": {lora: of(lora) for lora in self.loras() if lora is not None}}


def described_cost(cost: CostEstimate) -> dict[str, Any]:
    """The estimate as plain values, with `per_token_us` None until some window measured
    it: the fit's 0.0 there means unmeasured, and would read as a token that costs nothing."""
    values = asdict(cost)
    if not cost.per_token_seen:
        values["per_token_us"] = None
    return values
