"""Many calls in one message: token ids as one array with offsets, vectors as one 2-D
array, other payloads as a list; and a hostile block is refused before anything is built."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ember.adapters.cross_encoder import Pair
from ember.adapters.multivector import TokenRow
from ember.engine import PreparedItem
from ember.ipc.batch import items_from_wire, items_to_wire, values_from_wire, values_to_wire
from ember.ipc.wire import pack, unpack

PAIR = "ember.adapters.cross_encoder:Pair"


def crossed(value: Any) -> Any:
    return unpack(pack(value))


def test_token_rows_travel_as_one_array_with_offsets() -> None:
    items = [PreparedItem([101, 7, 102], 3, 0), PreparedItem((101, 2**20, 9, 102), 4, 1),
             PreparedItem([5], 1, 2)]
    block = items_to_wire(items)
    payloads = block[0]
    assert payloads[0] == "tokens" and payloads[1].dtype == np.int32
    assert payloads[2].tolist() == [0, 3, 7, 8]
    back = items_from_wire(crossed(block))
    assert [list(item.payload) for item in back] == [[101, 7, 102], [101, 2**20, 9, 102], [5]]
    assert [(item.cost, item.index) for item in back] == [(3, 0), (4, 1), (1, 2)]


def test_array_rows_travel_as_one_array_too() -> None:
    block = np.array([101, 7, 102, 101, 9, 8, 102], dtype=np.int32)
    items = [PreparedItem(block[:3], 3, 0), PreparedItem(block[3:], 4, 1)]
    payloads = items_to_wire(items)[0]
    assert payloads[0] == "tokens" and payloads[2].tolist() == [0, 3, 7]
    back = items_from_wire(crossed(items_to_wire(items)))
    assert [item.payload.tolist() for item in back] == [[101, 7, 102], [101, 9, 8, 102]]
    wide = [PreparedItem(np.array([1, 2**40], dtype=np.int64), 2, 0)]
    assert items_to_wire(wide)[0][1].dtype == np.int64  # not cut to int32
    for odd in ([np.array([1, 2]), np.array([], dtype=np.int32)], [np.array([1.5, 2.0])],
                [np.array([1, 2]), [3, 4]]):
        listed = items_to_wire([PreparedItem(p, 1, i) for i, p in enumerate(odd)])
        assert listed[0][0] == "list"
        assert [np.asarray(item.payload).tolist() for item in
                items_from_wire(crossed(listed))] == [np.asarray(p).tolist() for p in odd]


def test_pairs_and_multivector_rows_travel_as_one_column_a_field() -> None:
    block = np.array([101, 7, 102, 101, 9, 8, 102], dtype=np.int32)
    types = np.array([0, 0, 0, 0, 0, 1, 1], dtype=np.int32)
    pairs = [Pair(block[:3], types[:3]), Pair(block[3:], types[3:])]
    wire = items_to_wire([PreparedItem(p, len(p.input_ids), i) for i, p in enumerate(pairs)])
    assert wire[0][0] == "fields" and wire[0][1] == "ember.adapters.cross_encoder:Pair"
    back = [item.payload for item in items_from_wire(crossed(wire))]
    assert [(p.input_ids.tolist(), p.token_type_ids.tolist()) for p in back] == [
        ([101, 7, 102], [0, 0, 0]), ([101, 9, 8, 102], [0, 0, 1, 1])]
    # A field some rows lack (an expanded query's attention beside documents) stays None.
    rows = [TokenRow(block[:3], np.ones(3, np.int32), np.array([1, 1, 0], np.int32)),
            TokenRow(block[3:], np.ones(4, np.int32), None)]
    back_rows = [item.payload for item in items_from_wire(crossed(items_to_wire(
        [PreparedItem(r, 3, i) for i, r in enumerate(rows)])))]
    assert back_rows[0].attend.tolist() == [1, 1, 0] and back_rows[1].attend is None
    assert [r.ids.tolist() for r in back_rows] == [[101, 7, 102], [101, 9, 8, 102]]
    # Client-sent lists cross the same way; a pair with no rows at all goes as a list.
    listed = items_from_wire(crossed(items_to_wire([PreparedItem(Pair([1, 2], None), 2, 0)])))
    assert listed[0].payload.input_ids.tolist() == [1, 2]
    assert listed[0].payload.token_type_ids is None


def test_texts_and_empty_rows_travel_as_a_list() -> None:
    for payloads in (["a text", "another"], [[1, 2], []], [[1.5, 2.0]]):
        items = [PreparedItem(p, 1, i) for i, p in enumerate(payloads)]
        block = items_to_wire(items)
        assert block[0][0] == "list"
        back = [item.payload for item in items_from_wire(crossed(block))]
        assert [list(p) if isinstance(p, tuple) else p for p in back] == [
            list(p) if isinstance(p, list) else p for p in payloads]


def test_vectors_of_one_shape_travel_as_rows_of_one_array() -> None:
    values = [np.full(4, i, np.float32) for i in range(5)]
    block = crossed(values_to_wire(values))
    assert block[0] == "rows" and block[1].shape == (5, 4)
    middle = values_from_wire(block, 1, 3)
    assert [v.tolist() for v in middle] == [[1.0] * 4, [2.0] * 4]
    mixed = crossed(values_to_wire([np.zeros(2, np.float32), np.zeros(3, np.float32)]))
    assert mixed[0] == "list" and [len(v) for v in values_from_wire(mixed, 0, 2)] == [2, 3]


@pytest.mark.parametrize("block", [
    "not a block",
    (("tokens", np.arange(3), np.array([0, 2])), np.array([1, 1]), np.array([0, 1])),
    (("tokens", np.arange(3), np.array([0, 2, 9])), np.array([1, 1]), np.array([0, 1])),
    (("tokens", np.arange(3), np.array([0, 3, 3])), np.array([1, 1]), np.array([0, 1])),
    (("tokens", np.arange(3), np.array([1, 2, 3])), np.array([1, 1]), np.array([0, 1])),
    (("tokens", np.arange(3.0), np.array([0, 1, 3])), np.array([1, 1]), np.array([0, 1])),
    # Found by a code review: unsigned offsets that fall passed (their difference wraps).
    (("tokens", np.arange(6), np.array([0, 5, 3, 6], np.uint64)), np.array([1, 1, 1]),
     np.array([0, 1, 2])),
    (("list", ("a",)), np.array([1, 1]), np.array([0, 1])),
    (("list", ("a", "b")), np.array([1.0, 1.0]), np.array([0, 1])),
    (("list", ("a", "b")), np.array([1, 1]), np.array([0])),
    (("pickle", b"..."), np.array([1]), np.array([0])),
    # Field columns: a class outside the wire types, the wrong number of columns, no
    # rows at all, offsets past the block, an empty row not flagged missing, bad flags.
    (("fields", "os:system", ((np.arange(2), np.array([0, 1, 2]), None),)),
     np.array([1, 1]), np.array([0, 1])),
    (("fields", PAIR, ((np.arange(2), np.array([0, 1, 2]), None),)),
     np.array([1, 1]), np.array([0, 1])),
    (("fields", PAIR, (None, None)), np.array([1, 1]), np.array([0, 1])),
    (("fields", PAIR, ((np.arange(2), np.array([0, 1, 5]), None), None)),
     np.array([1, 1]), np.array([0, 1])),
    (("fields", PAIR, ((np.arange(2), np.array([0, 2, 2]), None), None)),
     np.array([1, 1]), np.array([0, 1])),
    (("fields", PAIR, ((np.arange(2), np.array([0, 2, 2]), np.array([1, 0])), None)),
     np.array([1, 1]), np.array([0, 1])),
    (("fields", PAIR, ((np.arange(2.0), np.array([0, 1, 2]), None), None)),
     np.array([1, 1]), np.array([0, 1])),
    (("fields", PAIR, ((np.arange(2), np.array([0, 1, 2]), np.array([True, False])), None)),
     np.array([1, 1]), np.array([0, 1])),
])
def test_a_hostile_items_block_is_refused(block: Any) -> None:
    with pytest.raises(ValueError):
        items_from_wire(crossed(block))


@pytest.mark.parametrize(("block", "start", "end"), [
    (("rows", np.zeros((2, 3), np.float32)), 1, 3),
    (("rows", np.zeros(3, np.float32)), 0, 1),
    (("list", (1, 2)), -1, 1),
    (("eval", ("x",)), 0, 1),
])
def test_a_hostile_values_block_is_refused(block: Any, start: int, end: int) -> None:
    with pytest.raises(ValueError):
        values_from_wire(crossed(block), start, end)
