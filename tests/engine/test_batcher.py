"""BatchFormer on its own: formation order, limits, groups, counts (R5, R6)."""

from __future__ import annotations

from dataclasses import dataclass

from ember.engine import BatchFormer, PendingItem, PreparedItem


@dataclass(eq=False)
class Owner:
    live: bool = True


def add(former: BatchFormer, costs: list[int], *, owner: Owner | None = None,
        group: str = "p", arrival: float = 0.0, seq_start: int = 0) -> Owner:
    owner = owner or Owner()
    former.add([PendingItem(PreparedItem(c, c, i), owner, group, arrival, seq_start + i)
                for i, c in enumerate(costs)])
    return owner


def costs(batch: list[PendingItem]) -> list[int]:
    return [p.item.cost for p in batch]


def test_formation_takes_cheapest_first_within_padded_token_budget() -> None:
    former = BatchFormer(max_batch_tokens=100, max_batch_items=10, starvation_s=60)
    add(former, [40, 10, 30, 12, 11])
    assert costs(former.form(now=0.0)) == [10, 11, 12]  # 4 x 30 = 120 would pass 100
    assert costs(former.form(now=0.0)) == [30, 40]  # 2 x 40 = 80 fits
    assert former.pending_items == 0


def test_formation_respects_the_item_limit_and_always_takes_one() -> None:
    former = BatchFormer(max_batch_tokens=10, max_batch_items=2, starvation_s=60)
    add(former, [1, 1, 1])
    assert len(former.form(now=0.0)) == 2
    add(former, [99], seq_start=10)
    assert costs(former.form(now=0.0)) == [1]
    assert costs(former.form(now=0.0)) == [99]  # over the budget, alone


def test_starved_items_go_first() -> None:
    former = BatchFormer(max_batch_tokens=100, max_batch_items=10, starvation_s=1.0)
    add(former, [50], arrival=0.0)
    add(former, [5, 5, 5], arrival=1.1, seq_start=1)
    assert costs(former.form(now=1.2)) == [50, 5]  # the starved one leads: 2 x 50 fits
    assert costs(former.form(now=1.2)) == [5, 5]


def test_a_batch_takes_only_the_head_group() -> None:
    former = BatchFormer(max_batch_tokens=1000, max_batch_items=10, starvation_s=60)
    add(former, [5], group="q")
    add(former, [1, 2], group="p", seq_start=1)
    assert [p.group for p in former.form(now=0.0)] == ["q"]
    assert [p.group for p in former.form(now=0.0)] == ["p", "p"]


def test_pending_requests_counts_distinct_owners_and_dead_ones_drop() -> None:
    former = BatchFormer(max_batch_tokens=1000, max_batch_items=10, starvation_s=60)
    alive = add(former, [1, 2])
    dead = add(former, [3], seq_start=2)
    assert former.pending_requests == 2 and former.pending_items == 3
    dead.live = False
    assert former.drop_dead() == 1
    assert former.pending_requests == 1 and former.pending_items == 2
    assert {p.owner for p in former.form(now=0.0)} == {alive}


def test_full_means_waiting_would_add_nothing() -> None:
    former = BatchFormer(max_batch_tokens=100, max_batch_items=3, starvation_s=60)
    add(former, [1, 1])
    assert not former.is_full(now=0.0)
    add(former, [1], seq_start=2)
    assert former.is_full(now=0.0)


def test_upto_seq_bounds_the_batch_to_an_earlier_backlog() -> None:
    former = BatchFormer(max_batch_tokens=1000, max_batch_items=10, starvation_s=60)
    add(former, [1, 1])
    cutoff = former.newest_seq
    add(former, [1], seq_start=5)
    assert len(former.form(now=0.0, upto_seq=cutoff)) == 2
    assert former.form(now=0.0, upto_seq=cutoff) == []
    assert former.pending_items == 1
