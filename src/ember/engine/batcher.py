"""BatchFormer: one pending queue and cost-ordered batch formation (R5, R6)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol

from ember.engine.types import PreparedItem


class Owner(Protocol):
    """The request an item belongs to, as far as the batcher cares."""

    @property
    def live(self) -> bool:
        """False once the request was cancelled or has failed: drop its items."""
        ...


@dataclass(eq=False, slots=True)
class PendingItem:
    """A prepared item waiting in a batcher."""

    item: PreparedItem
    owner: Owner
    group: Hashable
    arrival: float
    seq: int


class BatchFormer:
    """Pending items of one LoRA, and the rule that turns them into batches.

    Items are kept in arrival order. A batch takes the parameter group of the
    oldest eligible item (R6), starved items first, then the rest by cost
    ascending, while `items x longest <= max_batch_tokens` and the count stays
    within `max_batch_items`; it always takes at least one item (R5).
    """

    def __init__(self, max_batch_tokens: int, max_batch_items: int, starvation_s: float) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_items = max_batch_items
        self.starvation_s = starvation_s
        self._pending: list[PendingItem] = []
        self._per_owner: dict[Owner, int] = {}
        self.last_arrival: float | None = None

    @property
    def pending_items(self) -> int:
        return len(self._pending)

    @property
    def pending_requests(self) -> int:
        """Distinct requests that still have an undispatched item here."""
        return len(self._per_owner)

    @property
    def oldest_arrival(self) -> float | None:
        return self._pending[0].arrival if self._pending else None

    @property
    def newest_seq(self) -> int:
        return self._pending[-1].seq if self._pending else -1

    def add(self, items: list[PendingItem]) -> None:
        self._pending.extend(items)
        for pending in items:
            self._per_owner[pending.owner] = self._per_owner.get(pending.owner, 0) + 1
        if items:
            self.last_arrival = items[-1].arrival

    def drop_dead(self) -> int:
        """Remove the items of cancelled or failed requests (R9); return how many."""
        if all(owner.live for owner in self._per_owner):
            return 0
        kept = [p for p in self._pending if p.owner.live]
        dropped = len(self._pending) - len(kept)
        self._pending = kept
        self._per_owner = {o: n for o, n in self._per_owner.items() if o.live}
        return dropped

    def is_full(self, now: float) -> bool:
        """True when a batch formed now would be at a limit: waiting adds nothing."""
        batch, group_size = self._plan(now, upto_seq=None)
        return len(batch) >= self.max_batch_items or len(batch) < group_size

    def form(self, now: float, upto_seq: int | None = None) -> list[PendingItem]:
        """Take the next batch out of the queue (only items up to `upto_seq`, if set)."""
        batch, _ = self._plan(now, upto_seq)
        if not batch:
            return []
        taken = {id(p) for p in batch}
        self._pending = [p for p in self._pending if id(p) not in taken]
        for pending in batch:
            left = self._per_owner[pending.owner] - 1
            if left:
                self._per_owner[pending.owner] = left
            else:
                del self._per_owner[pending.owner]
        return batch

    def _plan(self, now: float, upto_seq: int | None) -> tuple[list[PendingItem], int]:
        eligible = [
            p for p in self._pending if p.owner.live and (upto_seq is None or p.seq <= upto_seq)
        ]
        if not eligible:
            return [], 0
        head_group = eligible[0].group
        group = [p for p in eligible if p.group == head_group]
        starved = [p for p in group if now - p.arrival >= self.starvation_s]
        fresh = sorted((p for p in group if now - p.arrival < self.starvation_s),
                       key=lambda p: (p.item.cost, p.seq))
        batch: list[PendingItem] = []
        longest = 0
        for pending in starved + fresh:
            widest = max(longest, pending.item.cost)
            over_tokens = (len(batch) + 1) * widest > self.max_batch_tokens
            if batch and (over_tokens or len(batch) >= self.max_batch_items):
                break
            batch.append(pending)
            longest = widest
        return batch, len(group)
