"""Batching and dispatch settings of one model worker."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerConfig:
    """Limits and windows of the dispatch rules (docs/architecture.md).

    `hold_fraction`: after a forward that carried several requests, the next batch
    of that LoRA waits for those senders to come back, at most this fraction of that
    forward's duration (and at most `max_batch_wait_ms`; 0 turns the hold off).

    `max_padding`: a batch takes no item that would raise its padded tokens past
    this many per real token (plus a few per item, so close lengths still share a
    forward); the item waits for a batch of its own length. 0 turns it off (for a
    device whose fixed cost per forward dwarfs its cost per padded token).
    """

    max_batch_tokens: int = 16384
    max_batch_items: int = 64
    max_batch_wait_ms: float = 10.0
    idle_coalesce_ms: float = 3.0
    max_queue_items: int = 4096
    hold_fraction: float = 0.25
    max_padding: float = 1.05

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_batch_items", "max_queue_items"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_batch_wait_ms", "idle_coalesce_ms", "hold_fraction", "max_padding"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if 0 < self.max_padding < 1:
            raise ValueError(f"max_padding must be 0 (off) or >= 1, got {self.max_padding}")
