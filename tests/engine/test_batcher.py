"""BatchFormer on its own: formation order, limits, groups, counts (R5, R6)."""

from __future__ import annotations

import pytest

from ember.engine import Batch, BatchFormer, PendingItem, PreparedItem, WorkerConfig
from ember.engine.batcher import cost_bucket


class Owner:
    """A request, as the batcher knows one: a key of its own."""


def request(costs: list[int], *, owner: Owner | None = None, group: str = "p",
            arrival: float = 0.0, seq_start: int = 0) -> list[PendingItem]:
    """One request's pending items, not yet queued anywhere."""
    owner = owner or Owner()
    return [PendingItem(PreparedItem(c, c, i), owner, group, arrival, seq_start + i)
            for i, c in enumerate(costs)]


def add(former: BatchFormer, costs: list[int], *, owner: Owner | None = None,
        group: str = "p", arrival: float = 0.0, seq_start: int = 0) -> list[PendingItem]:
    pending = request(costs, owner=owner, group=group, arrival=arrival, seq_start=seq_start)
    former.add(pending)
    return pending


def requests(former: BatchFormer, costs: list[int], *, group: str = "p",
             seq_start: int = 0) -> None:
    """One request of one item for each cost: a queue of like-sized requests, where the
    sweep alone orders the batches."""
    for i, cost in enumerate(costs):
        add(former, [cost], group=group, seq_start=seq_start + i)


def costs(batch: Batch | None) -> list[int]:
    assert batch is not None
    return [p.item.cost for p in batch.items]


def test_formation_takes_cheapest_first_within_padded_token_budget() -> None:
    former = BatchFormer(max_batch_tokens=100, max_batch_items=10, max_padding=0.0)
    add(former, [40, 10, 30, 12, 11])
    first = former.form()
    assert costs(first) == [10, 11, 12]  # 4 x 30 = 120 would pass 100
    assert first is not None and first.full  # at a limit: waiting would not add to it
    second = former.form()
    assert costs(second) == [30, 40]  # 2 x 40 = 80 fits
    assert second is not None and not second.full
    assert former.pending_items == 0 and former.form() is None


def test_formation_respects_the_item_limit_and_always_takes_one() -> None:
    former = BatchFormer(max_batch_tokens=10, max_batch_items=2, max_padding=0.0)
    add(former, [1, 1, 1])
    assert len(costs(former.form())) == 2
    add(former, [99], seq_start=10)
    assert costs(former.form()) == [99]  # over the budget, alone; the sweep goes on upward
    assert costs(former.form()) == [1]  # then wraps to the cheapest


def test_batches_sweep_upward_from_where_the_last_one_ended_then_wrap() -> None:
    former = BatchFormer(max_batch_tokens=10**6, max_batch_items=64, max_padding=1.05)
    requests(former, [100, 10, 50, 11, 104, 52])
    assert costs(former.form()) == [10, 11]  # a fresh sweep starts at the cheapest
    requests(former, [5], seq_start=10)  # behind the sweep: it waits for the wrap
    assert costs(former.form()) == [50, 52]
    assert costs(former.form()) == [100, 104]
    assert costs(former.form()) == [5]
    assert former.form() is None


def test_a_stream_of_cheap_items_cannot_hold_back_a_long_one() -> None:
    """Cheapest-first would serve the new short item every time; the sweep reaches the
    long one on its next batch, whatever keeps arriving below it."""
    former = BatchFormer(max_batch_tokens=10**6, max_batch_items=64, max_padding=1.05)
    add(former, [160])
    taken: list[list[int]] = []
    for n in range(4):
        add(former, [10], seq_start=1 + n)
        taken.append(costs(former.form()))
    assert taken == [[10], [160], [10, 10], [10]]
    assert former.pending_items == 0


def test_a_backlog_at_many_lengths_drains_within_one_sweep_under_new_arrivals() -> None:
    """No item is overtaken without end: with arrivals at every length after every
    batch, each item of the first backlog leaves within one batch per length band."""
    bands = [10, 20, 40, 80, 160, 320]  # far apart: the padding bound keeps them apart
    former = BatchFormer(max_batch_tokens=10**6, max_batch_items=64, max_padding=1.05)
    owner = Owner()
    backlog = add(former, bands, owner=owner)
    for n in range(len(bands)):
        assert former.form() is not None
        add(former, bands, seq_start=100 * (n + 1))  # newer items at every length
    assert not any(p.queued for p in backlog)
    assert not former.holds(owner)


def test_a_busy_bucket_cannot_hold_the_sweep() -> None:
    """A batch that fills from one bucket moves the sweep past it."""
    former = BatchFormer(max_batch_tokens=10**6, max_batch_items=2, max_padding=0.0)
    add(former, [30, 30, 30, 30, 90])
    assert costs(former.form()) == [30, 30]
    add(former, [30, 30], seq_start=10)
    # The sweep is at 90; the room left goes to the oldest cheaper item (no padding bound).
    assert costs(former.form()) == [90, 30]
    assert [p.seq for p in costs_items(former.form())] == [3, 10]  # oldest of the bucket first


def test_a_batch_takes_only_the_head_group() -> None:
    former = BatchFormer(max_batch_tokens=1000, max_batch_items=10, max_padding=0.0)
    add(former, [5], group="q")
    add(former, [1, 2], group="p", seq_start=1)
    assert [p.group for p in costs_items(former.form())] == ["q"]
    assert [p.group for p in costs_items(former.form())] == ["p", "p"]


def costs_items(batch: Batch | None) -> list[PendingItem]:
    assert batch is not None
    return batch.items


def test_pending_counts_and_discarded_items() -> None:
    former = BatchFormer(max_batch_tokens=1000, max_batch_items=10, max_padding=0.0)
    alive = Owner()
    add(former, [1, 2], owner=alive)
    gone = add(former, [3], seq_start=2)
    assert former.pending_requests == 2 and former.pending_items == 3
    assert former.discard(gone[0]) and not former.discard(gone[0])  # once only
    assert former.pending_requests == 1 and former.pending_items == 2
    assert {p.owner for p in costs_items(former.form())} == {alive}


def test_a_deep_queue_drains_in_sweeps_of_ascending_cost() -> None:
    """In cost order up to a bucket's width (costs under 64 exact, above ~3 %), sweep by
    sweep: a batch starts at or above the bucket where the last one ended."""
    former = BatchFormer(max_batch_tokens=10**9, max_batch_items=8, max_padding=0.0)
    add(former, [(i * 37) % 500 + 1 for i in range(4096)])
    seen, sweeps = -1, 1
    while (batch := former.form()) is not None:
        keys = [cost_bucket(c) for c in costs(batch)]
        rise = next((i for i in range(1, len(keys)) if keys[i] < keys[i - 1]), len(keys))
        assert keys[:rise] == sorted(keys[:rise])
        # Room left once nothing above fits: the batch takes cheaper items too.
        assert all(key < keys[0] for key in keys[rise:])
        if keys[0] < seen:  # wrapped to the cheapest
            sweeps += 1
        seen = max(keys)
    assert sweeps > 1  # full batches of one bucket leave its rest to the next sweep
    assert former.pending_items == 0 and former.pending_requests == 0


def test_a_request_that_fits_one_forward_is_not_split_by_the_sweep() -> None:
    former = BatchFormer(max_batch_tokens=1000, max_batch_items=8, max_padding=1.05)
    add(former, [5])
    assert costs(former.form()) == [5]  # the sweep moves past 5
    add(former, [2, 9], seq_start=1)
    assert sorted(costs(former.form())) == [2, 9]
    assert former.form() is None



def test_equal_costs_fill_a_batch_to_each_limit_skipping_dropped_items() -> None:
    former = BatchFormer(max_batch_tokens=100, max_batch_items=64, max_padding=1.05)
    pending = add(former, [13] * 20)
    gone = Owner()
    dropped = add(former, [13] * 3, owner=gone, seq_start=20)
    for item in dropped:
        assert former.discard(item)
    assert len(costs(former.form())) == 7  # 7 x 13 = 91 tokens; an 8th makes 104
    assert former.pending_items == 13
    small = BatchFormer(max_batch_tokens=10**6, max_batch_items=5, max_padding=1.05)
    add(small, [13] * 12)
    assert [len(costs(small.form())) for _ in range(3)] == [5, 5, 2]
    assert small.pending_items == 0 and small.form() is None
    taken = {id(p) for p in pending[:7]}
    assert all(not p.queued for p in pending if id(p) in taken)


def test_one_add_of_several_requests_and_groups_keeps_each_in_line() -> None:
    former = BatchFormer(max_batch_tokens=1000, max_batch_items=10, max_padding=0.0)
    first, second = Owner(), Owner()
    items = [PendingItem(PreparedItem(c, c, i), owner, group, 0.0, seq)
             for i, (c, owner, group, seq) in enumerate(
                 [(7, first, "q", 0), (3, second, "p", 1), (4, second, "p", 1),
                  (8, first, "q", 0)])]
    former.add(items)
    assert former.pending_requests == 2 and former.pending_items == 4
    oldest = former.oldest()
    assert oldest is not None and oldest.owner is first
    assert costs(former.form()) == [7, 8]  # the oldest request's group goes first (R6)
    assert not former.holds(first) and former.pending_requests == 1
    assert costs(former.form()) == [3, 4]
    assert former.oldest() is None and former.pending_requests == 0


def test_a_request_split_across_batches_stays_first_in_line() -> None:
    former = BatchFormer(max_batch_tokens=1000, max_batch_items=2, max_padding=0.0)
    early = Owner()
    add(former, [13, 13, 13], owner=early)
    add(former, [5], seq_start=3, group="q")
    assert costs(former.form()) == [13, 13]
    head = former.oldest()  # its third item still waits: the request keeps its place
    assert head is not None and head.owner is early and former.holds(early)
    assert costs(former.form()) == [13]
    head = former.oldest()
    assert head is not None and head.group == "q"
    assert costs(former.form()) == [5] and former.oldest() is None


def test_a_batch_put_back_forms_again_as_if_it_never_formed() -> None:
    former = BatchFormer(max_batch_tokens=10**6, max_batch_items=3, max_padding=1.05)
    first, second = Owner(), Owner()
    add(former, [20, 20, 21, 40], owner=first)
    add(former, [20, 41], owner=second, seq_start=4)
    formed = [former.form(), former.form()]  # two of the three batches, formed ahead
    assert all(batch is not None for batch in formed)
    left = former.pending_items
    was = [[p.item.payload for p in batch.items] for batch in formed if batch is not None]
    for batch in reversed(formed):  # the later first, so the earlier's items lead again
        assert batch is not None
        former.put_back(batch)
    assert former.pending_items == 6 == left + sum(map(len, was))
    assert former.pending_requests == 2
    head = former.oldest()
    assert head is not None and head.owner is first
    again = [former.form(), former.form()]
    assert [[p.item.payload for p in batch.items] for batch in again if batch is not None] == was


def test_a_cheaper_arrival_would_lead_only_a_batch_that_began_a_new_sweep() -> None:
    former = BatchFormer(max_batch_tokens=10**6, max_batch_items=4, max_padding=1.05)
    requests(former, [100] * 8)
    one, two = former.form(), former.form()  # one bucket: the sweep passes it, then wraps
    assert one is not None and two is not None
    cheap, dear = request([5]), request([150])
    assert not former.would_lead(one, cheap)  # the first sweep began at the cheapest
    assert former.would_lead(two, cheap)  # a new sweep began at 100: 5 comes first
    assert not former.would_lead(two, dear)  # dearer: it waits for its place
    former.put_back(two)
    requests(former, [5], seq_start=8)
    assert costs(former.form()) == [5]
    assert costs(former.form()) == [100] * 4


# -- a small request beside a large one leads (R5) --------------------------------------


def bulk_and_sweep(former: BatchFormer) -> None:
    """A bulk request of 16 items at 8 lengths, its first batch formed: the sweep's
    cursor stands past the cheapest lengths."""
    add(former, [10, 10, 20, 20, 40, 40, 80, 80, 160, 160, 320, 320, 640, 640, 1280, 1280])
    assert costs(former.form())[0] == 10


def test_a_small_request_beside_a_large_one_leads_the_next_batch_below_the_cursor() -> None:
    former = BatchFormer(max_batch_tokens=10**6, max_batch_items=4, max_padding=1.05)
    bulk_and_sweep(former)
    add(former, [5, 6], seq_start=20)  # 2 items against 16: below the cursor, it leads
    led = former.form()
    assert led is not None and led.led and costs(led) == [5, 6]
    # The sweep goes on where it stood, and takes the next batch: it is not starved.
    swept = former.form()
    assert swept is not None and not swept.led and costs(swept) == [20, 20]


def test_the_leader_takes_its_items_first_then_the_nearest_in_cost() -> None:
    former = BatchFormer(max_batch_tokens=10**6, max_batch_items=4, max_padding=0.0)
    bulk_and_sweep(former)
    add(former, [300, 45], seq_start=20)  # its items span lengths: both go, then neighbours
    assert costs(former.form()) == [45, 300, 320, 320]


def test_a_small_request_of_another_group_leads_too() -> None:
    """A query (is_query: its own parameter group) beside a bulk request of documents: by
    arrival, it would wait until every document queued before it had run (R6)."""
    former = BatchFormer(max_batch_tokens=10**6, max_batch_items=4, max_padding=1.05)
    bulk_and_sweep(former)
    add(former, [12], group="query", seq_start=20)
    led = former.form()
    assert led is not None and led.group == "query" and costs(led) == [12]
    assert former.oldest() is not None and former.oldest().group == "p"  # type: ignore[union-attr]


def test_a_stream_of_small_requests_leads_every_other_batch_at_most() -> None:
    former = BatchFormer(max_batch_tokens=10**6, max_batch_items=2, max_padding=1.05)
    bulk_and_sweep(former)
    kinds, swept = [], []
    for n in range(8):
        add(former, [3], seq_start=100 + n)  # one more query before every formation
        batch = former.form()
        assert batch is not None
        kinds.append("led" if batch.led else "sweep")
        if not batch.led:
            swept.append(costs(batch))
    assert kinds == ["led", "sweep"] * 4
    # The sweep went on upward through the bulk request, a batch every other forward.
    assert all(3 not in batch for batch in swept)
    assert [min(batch) for batch in swept] == sorted(min(batch) for batch in swept)
    assert min(swept[-1]) >= 160


def test_requests_of_like_sizes_keep_the_sweep() -> None:
    former = BatchFormer(max_batch_tokens=10**6, max_batch_items=64, max_padding=1.05)
    add(former, [100, 110, 120])
    add(former, [50, 10, 30], seq_start=3)
    assert costs(former.form()) == [10]  # a fresh sweep: the cheapest first
    add(former, [5], seq_start=6)  # 1 item against 3: not small enough to lead
    batch = former.form()
    assert batch is not None and not batch.led and costs(batch) == [30]


def test_a_led_batch_put_back_restores_the_turn_and_the_sweep() -> None:
    former = BatchFormer(max_batch_tokens=10**6, max_batch_items=4, max_padding=1.05)
    bulk_and_sweep(former)
    add(former, [5], seq_start=20)
    led = former.form()
    assert led is not None and led.led
    former.put_back(led)
    assert former.pending_items == 15
    again = former.form()
    assert again is not None and again.led and costs(again) == [5]
    assert costs(former.form()) == [20, 20]


def test_small_requests_lead_in_order_of_size_then_arrival() -> None:
    former = BatchFormer(max_batch_tokens=10**6, max_batch_items=1, max_padding=1.05)
    bulk_and_sweep(former)
    add(former, [7, 7], seq_start=20)
    add(former, [9], seq_start=22)
    add(former, [8], seq_start=23)
    led = [costs(former.form()) for _ in range(6)]
    assert led[0::2] == [[9], [8], [7]]  # one item before two; then by arrival


def test_entries_of_served_requests_do_not_pile_up() -> None:
    """The requests of each size are kept in arrival order; served ones leave from the
    front, and also from behind one that waits long (here: never served)."""
    former = BatchFormer(max_batch_tokens=10**6, max_batch_items=64, max_padding=0.0)
    add(former, [3])  # stays queued throughout
    for n in range(1, 2001):
        for pending in add(former, [4], seq_start=n):
            former.discard(pending)  # served, as far as the queue is concerned
    assert former.pending_requests == 1
    assert sum(map(len, former._by_size.values())) < 200


def test_a_lead_ratio_of_zero_keeps_every_batch_the_sweeps() -> None:
    former = BatchFormer(max_batch_tokens=10**6, max_batch_items=4, max_padding=1.05,
                         lead_ratio=0)
    bulk_and_sweep(former)
    add(former, [5], seq_start=20)
    batch = former.form()
    assert batch is not None and not batch.led and 5 not in costs(batch)
    with pytest.raises(ValueError, match="lead_ratio"):
        WorkerConfig(lead_ratio=0.5)
