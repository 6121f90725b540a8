"""The device's cost per forward, learned online: `fixed + per_token x padded tokens`.

A ring of the last WINDOW forwards is refitted every REFIT_EVERY forwards (O(1)
amortised per forward, ~1 us). The slope is Tukey's resistant line: the forwards split
into thirds by padded tokens, and the slope joins the medians of the outer thirds; the
fixed part is the median of what the slope leaves. Outliers (a collector pause, a page
fault) move neither unless they are a large part of a third, and a device that drifts
(clocks, thermal limits, another tenant) is followed within one window.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

WINDOW = 128  # recent forwards a fit reads
REFIT_EVERY = 32
MIN_FORWARDS = 8  # until this many forwards, there is no estimate
# Below this spread of padded tokens (the outer thirds' medians, highest / lowest) a slope
# is noise: the last one found (or 0) stays, and only the fixed part is refitted.
MIN_SPREAD = 1.5


@dataclass(frozen=True, slots=True)
class CostEstimate:
    """What a fit says about the device: a forward of P padded tokens takes
    `fixed_ms + per_token_us * P / 1000` milliseconds."""

    fixed_ms: float
    per_token_us: float
    forwards: int  # forwards the fit read
    item_tokens: float  # median real tokens per item, over those forwards
    forward_ms: float  # median forward time, over those forwards
    per_token_seen: bool = True  # some window had the spread of sizes to measure a slope

    @property
    def tokens_per_fixed(self) -> float:
        """Padded tokens that cost as much as one forward's fixed part (inf: padding is free)."""
        if self.per_token_us <= 0:
            return float("inf")
        return self.fixed_ms * 1000 / self.per_token_us


class CostFit:
    """Learns a CostEstimate from the forwards a worker runs."""

    def __init__(self, window: int = WINDOW, refit_every: int = REFIT_EVERY,
                 min_forwards: int = MIN_FORWARDS) -> None:
        if not 2 <= min_forwards <= window or refit_every < 1:
            raise ValueError("need 2 <= min_forwards <= window and refit_every >= 1")
        self.window, self.refit_every, self.min_forwards = window, refit_every, min_forwards
        # Plain lists: a slot's write costs ~50 ns; the fit reads them into arrays.
        self._padded = [0.0] * window
        self._item_tokens = [0.0] * window
        self._seconds = [0.0] * window
        self._next = 0  # ring position of the next forward
        self.seen = 0  # forwards observed, ever
        self._since_fit = 0
        self._slope_s = 0.0  # seconds per padded token, the last slope with enough spread
        self._slope_seen = False
        self.estimate: CostEstimate | None = None

    def observe(self, padded_tokens: int, real_tokens: int, items: int,
                seconds: float) -> bool:
        """Record one forward; return True when the estimate was refitted."""
        if padded_tokens < 1 or items < 1 or not 0 < seconds < 3600:  # NaN fails too
            return False  # an empty or impossible forward says nothing about the device
        slot = self._next
        self._padded[slot], self._item_tokens[slot], self._seconds[slot] = (
            padded_tokens, real_tokens / items, seconds)
        self._next = (slot + 1) % self.window
        self.seen += 1
        self._since_fit += 1
        count = min(self.seen, self.window)
        # The first estimate comes as soon as there are enough forwards, then every refit_every.
        if count < self.min_forwards or (self.estimate is not None
                                         and self._since_fit < self.refit_every):
            return False
        self._since_fit = 0
        self.estimate = self._fit(count)
        return True

    def _fit(self, count: int) -> CostEstimate:
        x, y = np.array(self._padded[:count]), np.array(self._seconds[:count])
        slope = resistant_slope(x, y)
        if slope is not None:
            self._slope_s = max(0.0, slope)
            self._slope_seen = True
        fixed = max(0.0, float(np.median(y - self._slope_s * x)))
        return CostEstimate(fixed_ms=fixed * 1000, per_token_us=self._slope_s * 1e6,
                            forwards=count, item_tokens=float(np.median(self._item_tokens[:count])),
                            forward_ms=float(np.median(y)) * 1000,
                            per_token_seen=self._slope_seen)


def resistant_slope(x: npt.NDArray[np.float64],
                    y: npt.NDArray[np.float64]) -> float | None:
    """Tukey's resistant line's slope: through the medians of the lowest and the highest
    third of the points by x; None when those medians are under MIN_SPREAD apart. The
    spread is the thirds', not the extremes': a few forwards of another size leave both
    thirds on one size, and a slope of 0 read there would switch the padding bound off."""
    order = np.argsort(x, kind="stable")
    third = max(1, len(order) // 3)
    low, high = order[:third], order[-third:]
    low_x, high_x = float(np.median(x[low])), float(np.median(x[high]))
    if high_x < MIN_SPREAD * low_x:
        return None
    return float(np.median(y[high]) - np.median(y[low])) / (high_x - low_x)
