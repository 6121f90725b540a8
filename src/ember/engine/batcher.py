"""BatchFormer: one LoRA's pending items, kept in cost order as they arrive (R5, R6).

Each parameter group keeps a deque per cost bucket (arrival order inside a bucket)
and the sorted list of its non-empty buckets, so a formation walks only the
buckets it takes from: O(batch), never a sort of the whole queue. Batches sweep
the buckets upward from where the last one ended and wrap around at the top, so
no item waits more than one sweep and neighbours in length drain together.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Self

from ember.engine.config import LEAD_RATIO, WorkerConfig
from ember.engine.types import PreparedItem

_SEQ = attrgetter("seq")  # a pending item's place in line
_COST = attrgetter("item.cost")

EXACT_COSTS = 64  # costs below this get a bucket each
STEPS_PER_OCTAVE = 32  # above it, buckets at most 1/32 (~3 %) apart
# Padding every item may carry besides `max_padding`: short texts of a few tokens'
# difference still share a forward (their padding costs next to nothing).
PADDING_SLACK = 4


@dataclass(frozen=True, slots=True)
class Limits:
    """A batch's limits (R5): items, padded tokens, and padded tokens per real token
    (`max_padding`, plus PADDING_SLACK per item; 0 turns it off)."""

    max_tokens: int
    max_items: int
    max_padding: float = 0.0


def cost_bucket(cost: int) -> int:
    """A key that orders like the cost and groups costs at most ~3 % apart."""
    if 0 <= cost < TABLED_COSTS:
        return _BUCKETS[cost]
    return _cost_bucket(cost)


def _cost_bucket(cost: int) -> int:
    if cost < EXACT_COSTS:
        return max(cost, 0)
    shift = cost.bit_length() - 6
    return shift * STEPS_PER_OCTAVE + (cost >> shift)


TABLED_COSTS = 8192  # the bucket of every cost below this is looked up, not computed
_BUCKETS = [_cost_bucket(cost) for cost in range(TABLED_COSTS)]


# The request an item belongs to: the batcher keys its per-request counts by it (a
# cancelled request's items are dropped by `remove`, which the worker calls).
Owner = Hashable


@dataclass(eq=False, slots=True)
class PendingItem:
    """A prepared item waiting in a batcher; `queued` turns False once it leaves."""

    item: PreparedItem
    owner: Owner
    group: Hashable
    arrival: float
    seq: int
    queued: bool = True


@dataclass(eq=False)
class Batch:
    """Items that will run in one forward: one LoRA, one parameter group.

    `full` is True once it reached a limit (items, padded tokens or padding with an
    item left out): waiting for more arrivals cannot add to it.
    """

    lora: str | None
    group: Hashable
    items: list[PendingItem] = field(default_factory=list)
    widest: int = 0
    real_tokens: int = 0
    full: bool = False
    released_at: float = 0.0  # when the policy let it go to the device (R10)
    # Where its group's sweep stood when it formed, and the bucket it started from.
    cursor: int = 0
    start: int = 0
    led: bool = False  # a small request's items lead it, outside the sweep
    after_led: bool = False  # the batch formed before it was led

    def fits(self, cost: int, limits: Limits) -> bool:
        """Whether one more item of `cost` keeps the batch within its limits (R5)."""
        count = len(self.items)
        if count >= limits.max_items:
            return False
        if count == 0:
            return True
        padded = (count + 1) * max(self.widest, cost)
        return padded <= limits.max_tokens and (
            not limits.max_padding
            or padded <= limits.max_padding * (self.real_tokens + cost)
            + PADDING_SLACK * (count + 1))

    def add(self, pending: PendingItem) -> None:
        pending.queued = False
        self.items.append(pending)
        self.widest = max(self.widest, pending.item.cost)
        self.real_tokens += pending.item.cost

    def add_level(self, level: list[PendingItem]) -> None:
        """Add items that cost exactly the batch's widest, already out of their queue."""
        self.items.extend(level)
        self.real_tokens += self.widest * len(level)

    def remove(self, owner: Owner) -> int:
        """Drop the items of `owner`; return how many left."""
        kept = [p for p in self.items if p.owner is not owner]
        dropped = len(self.items) - len(kept)
        self.items = kept
        self.widest = max((p.item.cost for p in kept), default=0)
        self.real_tokens = sum(p.item.cost for p in kept)
        return dropped

    @property
    def padded_tokens(self) -> int:
        return len(self.items) * self.widest


class _Group:
    """The queued items of one parameter group, bucketed by cost."""

    __slots__ = ("buckets", "cursor", "keys", "live")

    def __init__(self) -> None:
        self.buckets: dict[int, deque[PendingItem]] = {}
        self.live: dict[int, int] = {}  # queued items per bucket (the deques keep tombstones)
        self.keys: list[int] = []  # buckets with a queued item, ascending
        self.cursor = 0  # the sweep: the next batch starts at the first bucket >= this

    def forget(self, key: int, count: int = 1) -> None:
        """Bookkeeping for `count` items that left bucket `key` (taken or dropped)."""
        left = self.live[key] - count
        if left:
            self.live[key] = left
            return
        del self.live[key], self.buckets[key]
        del self.keys[bisect.bisect_left(self.keys, key)]

    def head(self, key: int) -> PendingItem | None:
        """The oldest queued item of bucket `key`."""
        bucket = self.buckets[key]
        while bucket and not bucket[0].queued:
            bucket.popleft()
        return bucket[0] if bucket else None


class BatchFormer:
    """Pending items of one LoRA, and the rule that turns them into batches (R5).

    A batch takes the parameter group of the oldest pending item (R6) and packs
    upward in cost from the group's sweep cursor: items are added while
    `items x longest <= max_batch_tokens`, the count stays within `max_batch_items`
    and, with `max_padding`, the padded tokens stay within `max_padding` x the real
    ones (+ PADDING_SLACK per item); a batch always has at least one item. The
    cursor then moves to the batch's top bucket (past it when the batch held one
    bucket only), so it rises with every batch and wraps to the cheapest bucket at
    the top: every item goes within one sweep of the buckets.
    """

    def __init__(self, max_batch_tokens: int, max_batch_items: int,
                 max_padding: float = 0.0, lead_ratio: float = LEAD_RATIO) -> None:
        self.limits = Limits(max_batch_tokens, max_batch_items, max_padding)
        self.lead_ratio = lead_ratio
        self._groups: dict[Hashable, _Group] = {}
        # Arrival order, one entry a request (its first item here: a request's items share
        # group, arrival and place in line); requests with nothing queued are skipped lazily.
        self._arrivals: deque[PendingItem] = deque()
        self._per_owner: dict[Owner, int] = {}
        self._count = 0
        # Pending requests by their size (items when queued), for the lead rule: each one's
        # size, how many there are of each size, the sizes in order, and each size's
        # requests in arrival order (served ones are dropped from the front lazily).
        self._size_of: dict[Owner, int] = {}
        self._of_size: dict[int, int] = {}
        self._sizes: list[int] = []
        self._by_size: dict[int, deque[list[PendingItem]]] = {}
        self._led_last = False  # the last batch formed was led: the sweep's turn

    @classmethod
    def for_config(cls, config: WorkerConfig) -> Self:
        return cls(config.batch_tokens, config.max_batch_items, config.padding,
                   config.lead_ratio)

    @property
    def pending_items(self) -> int:
        return self._count

    @property
    def pending_requests(self) -> int:
        """Distinct requests that still have a queued item here."""
        return len(self._per_owner)

    def holds(self, owner: Owner) -> bool:
        return owner in self._per_owner

    def oldest(self) -> PendingItem | None:
        """An item of the request that arrived first among those with an item queued here:
        its group, arrival and place in line are those of the oldest pending item."""
        arrivals, owners = self._arrivals, self._per_owner
        while arrivals and arrivals[0].owner not in owners:
            arrivals.popleft()
        return arrivals[0] if arrivals else None

    def add(self, items: list[PendingItem]) -> None:
        """Queue `items`, of any requests and groups."""
        begin = 0
        for end in range(1, len(items) + 1):
            if end == len(items) or (items[end].owner is not items[begin].owner
                                     or items[end].group is not items[begin].group):
                self.add_request(items[begin:end])
                begin = end

    def add_request(self, items: list[PendingItem]) -> None:
        """Queue items of one request and one parameter group (what `submit` brings): its
        place in line and its count are kept once, and each item only joins its bucket."""
        if not items:
            return
        first = items[0]
        owner, owners = first.owner, self._per_owner
        held = owners.get(owner, 0)
        if not held:  # already in line when it has items queued here
            self._arrivals.append(first)
            self._sized(items)
        owners[owner] = held + len(items)
        self._count += len(items)
        group = self._groups.get(first.group)
        if group is None:
            group = self._groups[first.group] = _Group()
        buckets, live = group.buckets, group.live
        for pending in items:  # this loop runs once for every item
            cost = pending.item.cost
            key = _BUCKETS[cost] if 0 <= cost < TABLED_COSTS else _cost_bucket(cost)
            bucket = buckets.get(key)
            if bucket is None:
                bucket = buckets[key] = deque()
                bisect.insort(group.keys, key)
                live[key] = 1
            else:
                live[key] += 1
            bucket.append(pending)

    def discard(self, pending: PendingItem) -> bool:
        """Take a queued item out without running it (its request is gone, R9)."""
        if not pending.queued:
            return False
        pending.queued = False
        self._groups[pending.group].forget(cost_bucket(pending.item.cost))
        self._left((pending,))
        return True

    def form(self, lora: str | None = None) -> Batch | None:
        """Take the next batch out of the queue (None when it is empty)."""
        head = self.oldest()
        if head is None:
            return None
        leader = self._leader()
        batch = self._led(lora, leader) if leader else self._swept(lora, head)
        batch.after_led, self._led_last = self._led_last, batch.led
        return batch

    def _swept(self, lora: str | None, head: PendingItem) -> Batch:
        """The sweep's next batch, in the group of the oldest pending request."""
        group = self._groups[head.group]
        start = bisect.bisect_left(group.keys, group.cursor)
        if start == len(group.keys):  # the sweep reached the top: wrap to the cheapest
            start = 0
        bottom = group.keys[start]
        batch = Batch(lora, head.group, cursor=group.cursor, start=bottom)
        taken: dict[int, int] = {}  # items taken per bucket, forgotten once packing ends
        self._pack(batch, group, -1, start, taken)  # upward first: the sweep's items lead
        if not batch.full and start > 0:
            # Room left above: the cheaper buckets too, so a request's items and a burst
            # that fits one forward are not split by where the cursor stood.
            self._pack(batch, group, start - 1, len(group.keys), taken)
        self._taken(batch, group, taken)
        top = cost_bucket(batch.widest)
        # Leftovers of the top bucket lead the next batch; a one-bucket batch moves on, so
        # the cursor rises with every batch and a busy bucket cannot hold the sweep.
        group.cursor = top + 1 if top == bottom else top
        return batch

    def _led(self, lora: str | None, leader: list[PendingItem]) -> Batch:
        """A batch that a small request's queued items lead, cheapest first, packed with
        the items that pad it least; the sweep's cursor stays where it was."""
        group = self._groups[leader[0].group]
        batch = Batch(lora, leader[0].group, cursor=group.cursor, start=group.cursor,
                      led=True)
        taken: dict[int, int] = {}
        for pending in sorted((p for p in leader if p.queued), key=_COST):
            if not batch.fits(pending.item.cost, self.limits):
                batch.full = True
                break
            key = cost_bucket(pending.item.cost)
            batch.add(pending)  # a tombstone in its bucket from here on
            taken[key] = taken.get(key, 0) + 1
        if not batch.full:  # from the widest outward: what pads least comes first
            at = bisect.bisect_left(group.keys, cost_bucket(batch.widest))
            self._pack(batch, group, at - 1, at, taken)
        self._taken(batch, group, taken)
        return batch

    def _sized(self, items: list[PendingItem]) -> None:
        """Enter a request new to the queue by its size (what may lead, or be led)."""
        size, owners = len(items), self._per_owner
        self._size_of[items[0].owner] = size
        count = self._of_size.get(size, 0)
        self._of_size[size] = count + 1
        if not count:
            bisect.insort(self._sizes, size)
            line = self._by_size[size] = deque()
        else:
            line = self._waiting(size)
            if len(line) > 2 * count + 64:  # served ones behind one that waits long
                line = self._by_size[size] = deque(
                    entry for entry in line if entry[0].owner in owners)
        line.append(items)

    def _unsized(self, owner: Owner) -> None:
        """A request left the queue (its last item taken or dropped)."""
        size = self._size_of.pop(owner)
        count = self._of_size[size] - 1
        if count:
            self._of_size[size] = count
        else:
            del self._of_size[size], self._by_size[size]
            del self._sizes[bisect.bisect_left(self._sizes, size)]

    def _leader(self) -> list[PendingItem] | None:
        """The oldest of the smallest pending requests, when it holds at most
        1/`lead_ratio` of the items of the largest and the last batch was the sweep's (so
        the sweep keeps every other forward, and its bound, at most doubled, holds)."""
        sizes = self._sizes
        if self._led_last or not self.lead_ratio or len(sizes) < 2 or (
                sizes[0] * self.lead_ratio > sizes[-1]):
            return None  # requests of like sizes (one text each, say): the sweep alone
        line = self._waiting(sizes[0])
        return line[0] if line else None

    def _waiting(self, size: int) -> deque[list[PendingItem]]:
        """The requests of `size` in arrival order, the served ones at its front dropped
        (amortized O(1): each leaves once)."""
        line, owners = self._by_size[size], self._per_owner
        while line and line[0][0].owner not in owners:
            line.popleft()
        return line

    def would_lead(self, batch: Batch, items: Sequence[PendingItem]) -> bool:
        """Whether one request's `items`, had they come before `batch` formed, would have
        led it: `batch` began a new sweep (it wrapped to the cheapest bucket) and they are
        cheaper still, or they are a small request beside a large one and neither `batch`
        nor the one before it was led. (A batch formed ahead of a long forward would
        otherwise make them wait through one more.)"""
        if batch.group == items[0].group and batch.start < batch.cursor and cost_bucket(
                min(map(_COST, items))) < batch.start:
            return True
        return (bool(self.lead_ratio) and not batch.led and not batch.after_led
                and bool(self._sizes) and len(items) * self.lead_ratio <= self._sizes[-1])

    def put_back(self, batch: Batch) -> None:
        """Queue a formed batch's items again, each at the head of its bucket and in its
        request's place in line, and the sweep where it stood: as if it never formed."""
        group = self._groups.setdefault(batch.group, _Group())
        owners = self._per_owner
        rejoined: dict[Owner, list[PendingItem]] = {}
        for pending in reversed(batch.items):
            key = cost_bucket(pending.item.cost)
            bucket = group.buckets.get(key)
            if bucket is None:
                bucket = group.buckets[key] = deque()
                bisect.insort(group.keys, key)
                group.live[key] = 0
            pending.queued = True
            bucket.appendleft(pending)
            group.live[key] += 1
            held = owners.get(pending.owner, 0)
            if not held or pending.owner in rejoined:
                rejoined.setdefault(pending.owner, []).append(pending)
            owners[pending.owner] = held + 1
        if rejoined:  # rare (a batch put back holds the oldest requests): restore the order
            for items in rejoined.values():
                self._arrivals.append(items[-1])
                self._sized(items[::-1])
                self._by_size[len(items)] = deque(sorted(self._by_size[len(items)],
                                                         key=lambda line: line[0].seq))
            self._arrivals = deque(sorted(self._arrivals, key=_SEQ))
        self._count += len(batch.items)
        group.cursor = batch.cursor
        self._led_last = batch.after_led

    def _taken(self, batch: Batch, group: _Group, taken: dict[int, int]) -> None:
        """Counters for the items `batch` took out of the queue (`taken`: per bucket)."""
        for key, count in taken.items():
            group.forget(key, count)
        self._left(batch.items)

    def _left(self, items: Sequence[PendingItem]) -> None:
        """Per-request counts for `items`, which left the queue (taken or dropped)."""
        owners = self._per_owner
        for pending in items:
            left = owners[pending.owner] - 1
            if left:
                owners[pending.owner] = left
            else:
                del owners[pending.owner]
                self._unsized(pending.owner)
        self._count -= len(items)

    def _pack(self, batch: Batch, group: _Group, low: int, high: int,
              taken: dict[int, int]) -> None:
        """Grow `batch` from the buckets around it: at each step the candidate (next
        shorter or next longer) that adds the fewest padded tokens, while it fits."""
        keys, limits = group.keys, self.limits
        shorter = longer = None
        while len(batch.items) < limits.max_items:
            while low >= 0 and (shorter := group.head(keys[low])) is None:
                low -= 1
            while high < len(keys) and (longer := group.head(keys[high])) is None:
                high += 1
            if low < 0:
                shorter = None
            if high >= len(keys):
                longer = None
            if shorter is None and longer is None:
                return  # nothing eligible is left: the batch holds all of it
            first, second = (shorter, longer) if longer is None or (
                shorter is not None and self._added_padding(batch, shorter.item.cost)
                <= self._added_padding(batch, longer.item.cost)) else (longer, shorter)
            for chosen in (first, second):
                if chosen is not None and batch.fits(chosen.item.cost, limits):
                    key = keys[low] if chosen is shorter else keys[high]
                    bucket = group.buckets[key]
                    bucket.popleft()
                    batch.add(chosen)
                    taken[key] = taken.get(key, 0) + 1 + self._take_level(batch, bucket)
                    break
            else:
                batch.full = True
                return
        batch.full = True

    def _take_level(self, batch: Batch, bucket: deque[PendingItem]) -> int:
        """The items of `bucket` that cost exactly the batch's widest add no padding, so
        the choice above would take each of them next: take them at once while they fit.
        Returns how many it took."""
        cost, limits, count = batch.widest, self.limits, len(batch.items)
        # Items as wide as the widest only lower the padding ratio: the count limits alone.
        room = limits.max_items - count
        if cost > 0:
            room = min(room, limits.max_tokens // cost - count)
        level: list[PendingItem] = []
        passed = 0  # items taken and tombstones, from the bucket's head
        if room > 0:
            for pending in bucket:  # read in place; the bucket is cut once below
                if pending.queued:
                    if pending.item.cost != cost:
                        break
                    pending.queued = False
                    level.append(pending)
                    passed += 1
                    if len(level) == room:
                        break
                else:
                    passed += 1
        if passed == len(bucket):
            bucket.clear()
        else:
            popleft = bucket.popleft
            for _ in range(passed):
                popleft()
        batch.add_level(level)
        return len(level)

    @staticmethod
    def _added_padding(batch: Batch, cost: int) -> int:
        widest = max(batch.widest, cost)
        return (widest - cost) + len(batch.items) * (widest - batch.widest)
