"""Batching and dispatch settings of one model worker."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Dispatch = Literal["auto", "fixed"]
DISPATCH_MODES: tuple[Dispatch, ...] = ("auto", "fixed")

# The windows of `dispatch="fixed"`, and of "auto" until a model's cost is learned.
FIXED_MAX_BATCH_WAIT_MS = 10.0
FIXED_IDLE_COALESCE_MS = 3.0
FIXED_MAX_PADDING = 1.05
# The padded tokens of a forward under "fixed", and the most "auto" ever learns.
FIXED_MAX_BATCH_TOKENS = 16384
# A request with at most 1/LEAD_RATIO the items of the largest one pending leads the next
# forward (every other one at most), so a query does not wait out a bulk request's sweep.
LEAD_RATIO = 4.0


class SettingError(ValueError):
    """A setting out of its range: its name, and what is wrong with its value (a flag or a
    YAML key each name it their own way)."""

    def __init__(self, name: str, problem: str) -> None:
        self.name, self.problem = name, problem
        super().__init__(f"{name} {problem}")


@dataclass(frozen=True)
class WorkerConfig:
    """Limits and windows of the dispatch rules (docs/architecture.md).

    The three windows (`max_batch_wait_ms`, `idle_coalesce_ms`, `max_padding`) and the
    token budget (`max_batch_tokens`) are None unless set: with `dispatch="auto"` the
    worker then derives them from the cost per forward it measures (ember.engine.costfit);
    with "fixed" they take the FIXED_* values. One that is set is used as it is, in both
    modes.

    `hold_fraction`: after a forward that carried several requests, the next batch
    of that LoRA waits for those senders to come back, at most this fraction of that
    forward's duration (and at most `max_batch_wait_ms`; 0 turns the hold off). With
    `dispatch="auto"`, a model whose forward keeps every core of the host busy
    (`forward_fills_cores`) holds up to half a forward instead (policy.py).

    `max_padding`: a batch takes no item that would raise its padded tokens past
    this many per real token (plus a few per item, so close lengths still share a
    forward); the item waits for a batch of its own length. 0 turns it off (for a
    device whose fixed cost per forward dwarfs its cost per padded token).

    `lead_ratio`: a request with at most 1/`lead_ratio` the items of the largest request
    queued beside it leads the next forward, outside the sweep, every other forward at
    most; 0 turns it off (every batch is the sweep's).
    """

    max_batch_tokens: int | None = None
    max_batch_items: int = 64
    max_batch_wait_ms: float | None = None
    idle_coalesce_ms: float | None = None
    max_queue_items: int = 4096
    hold_fraction: float = 0.25
    max_padding: float | None = None
    dispatch: Dispatch = "auto"
    forward_fills_cores: bool = False  # a forward keeps every core busy (set by the registry)
    lead_ratio: float = LEAD_RATIO

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_batch_items", "max_queue_items"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise SettingError(name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("max_batch_wait_ms", "idle_coalesce_ms", "hold_fraction", "max_padding"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < math.inf:  # NaN compares false
                raise SettingError(name, f"must be a number >= 0, got {value}")
        if self.max_padding is not None and 0 < self.max_padding < 1:
            raise SettingError("max_padding", f"must be 0 (off) or >= 1, got {self.max_padding}")
        if not (self.lead_ratio == 0 or self.lead_ratio >= 1):
            raise SettingError("lead_ratio", f"must be 0 (off) or >= 1, got {self.lead_ratio}")
        if self.dispatch not in DISPATCH_MODES:
            raise SettingError("dispatch",
                               f"must be one of {DISPATCH_MODES}, got {self.dispatch!r}")

    @property
    def batch_tokens(self) -> int:
        """`max_batch_tokens` as set, else the fixed default."""
        return FIXED_MAX_BATCH_TOKENS if self.max_batch_tokens is None else self.max_batch_tokens

    @property
    def batch_wait_ms(self) -> float:
        """`max_batch_wait_ms` as set, else the fixed default."""
        return FIXED_MAX_BATCH_WAIT_MS if self.max_batch_wait_ms is None else self.max_batch_wait_ms

    @property
    def coalesce_ms(self) -> float:
        """`idle_coalesce_ms` as set, else the fixed default."""
        return FIXED_IDLE_COALESCE_MS if self.idle_coalesce_ms is None else self.idle_coalesce_ms

    @property
    def padding(self) -> float:
        """`max_padding` as set, else the fixed default."""
        return FIXED_MAX_PADDING if self.max_padding is None else self.max_padding
