"""BatchFormer on its own: formation order, limits, groups, counts (R5, R6)."""

from __future__ import annotations

from dataclasses import dataclass

from ember.engine import Batch, BatchFormer, PendingItem, PreparedItem
from ember.engine.batcher import cost_bucket


@dataclass(eq=False)
class Owner:
    live: bool = True


def add(former: BatchFormer, costs: list[int], *, owner: Owner | None = None,
        group: str = "p", arrival: float = 0.0, seq_start: int = 0) -> list[PendingItem]:
    owner = owner or Owner()
    pending = [PendingItem(PreparedItem(c, c, i), owner, group, arrival, seq_start + i)
               for i, c in enumerate(costs)]
    former.add(pending)
    return pending


def costs(batch: Batch | None) -> list[int]:
    assert batch is not None
    return [p.item.cost for p in batch.items]


def test_formation_takes_cheapest_first_within_padded_token_budget() -> None:
    former = BatchFormer(max_batch_tokens=100, max_batch_items=10, starvation_s=60)
    add(former, [40, 10, 30, 12, 11])
    first = former.form(now=0.0)
    assert costs(first) == [10, 11, 12]  # 4 x 30 = 120 would pass 100
    assert first is not None and first.full  # at a limit: waiting would not add to it
    second = former.form(now=0.0)
    assert costs(second) == [30, 40]  # 2 x 40 = 80 fits
    assert second is not None and not second.full
    assert former.pending_items == 0 and former.form(now=0.0) is None


def test_formation_respects_the_item_limit_and_always_takes_one() -> None:
    former = BatchFormer(max_batch_tokens=10, max_batch_items=2, starvation_s=60)
    add(former, [1, 1, 1])
    assert len(costs(former.form(now=0.0))) == 2
    add(former, [99], seq_start=10)
    assert costs(former.form(now=0.0)) == [1]
    assert costs(former.form(now=0.0)) == [99]  # over the budget, alone


def test_a_starved_item_leads_and_the_rest_packs_near_its_length() -> None:
    former = BatchFormer(max_batch_tokens=400, max_batch_items=10, starvation_s=1.0)
    add(former, [100], arrival=0.0)
    add(former, [5, 5, 5, 96, 104, 300], arrival=1.1, seq_start=1)
    # Not [100, 5, 5, 5] (the cheapest) nor arrival order: the neighbours in cost.
    assert costs(former.form(now=1.2)) == [100, 96, 104]
    assert costs(former.form(now=1.2)) == [5, 5, 5]  # nothing starved: cheapest up


def test_without_starvation_the_oldest_long_item_waits_for_the_cheap_ones() -> None:
    former = BatchFormer(max_batch_tokens=100, max_batch_items=10, starvation_s=1.0)
    add(former, [90], arrival=0.0)
    add(former, [10, 10], arrival=0.5, seq_start=1)
    assert costs(former.form(now=0.6)) == [10, 10]
    assert costs(former.form(now=0.6)) == [90]


def test_a_batch_takes_only_the_head_group() -> None:
    former = BatchFormer(max_batch_tokens=1000, max_batch_items=10, starvation_s=60)
    add(former, [5], group="q")
    add(former, [1, 2], group="p", seq_start=1)
    assert [p.group for p in costs_items(former.form(now=0.0))] == ["q"]
    assert [p.group for p in costs_items(former.form(now=0.0))] == ["p", "p"]


def costs_items(batch: Batch | None) -> list[PendingItem]:
    assert batch is not None
    return batch.items


def test_pending_counts_and_discarded_items() -> None:
    former = BatchFormer(max_batch_tokens=1000, max_batch_items=10, starvation_s=60)
    alive = Owner()
    add(former, [1, 2], owner=alive)
    gone = add(former, [3], seq_start=2)
    assert former.pending_requests == 2 and former.pending_items == 3
    assert former.discard(gone[0]) and not former.discard(gone[0])  # once only
    assert former.pending_requests == 1 and former.pending_items == 2
    assert {p.owner for p in costs_items(former.form(now=0.0))} == {alive}


def test_a_deep_queue_drains_in_ascending_cost_order() -> None:
    """In cost order up to a bucket's width (costs under 64 exact, above ~3 %)."""
    former = BatchFormer(max_batch_tokens=10**9, max_batch_items=8, starvation_s=60)
    add(former, [(i * 37) % 500 + 1 for i in range(4096)])
    seen = 0
    while (batch := former.form(now=0.0)) is not None:
        keys = [cost_bucket(c) for c in costs(batch)]
        assert keys == sorted(keys) and keys[0] >= seen
        seen = keys[-1]
    assert former.pending_items == 0 and former.pending_requests == 0
