"""Many calls in one message: the items of every submit an API process gathered in one
turn of its event loop, and the results of every call one forward finished.

Items travel as blocks, not per-item lists: token-id rows as one flat int array and
its offsets, costs and indices as int arrays; other payloads (texts, pairs, images) as
one list. Results that are vectors of one dtype and length travel as one 2-D array;
each call's values are its rows, views of it. Anything else goes as a list.

`items_from_wire` and `values_from_wire` check what a peer sent (offsets inside the
block, counts that add up) and raise ValueError before anything is built from it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from ember.engine import PreparedItem

TOKENS, LIST, ROWS = "tokens", "list", "rows"
INT32_MAX = 2**31 - 1
PARAMS_UNKNOWN = "ParamsUnknown"  # the error for a call whose parameter group is not held


def items_to_wire(items: Sequence[PreparedItem]) -> list[Any]:
    """[payloads, costs, indices] for the items of one message, in order."""
    costs = np.fromiter((item.cost for item in items), dtype=np.int64, count=len(items))
    indices = np.fromiter((item.index for item in items), dtype=np.int32, count=len(items))
    return [_payloads(items), costs, indices]


def _payloads(items: Sequence[PreparedItem]) -> list[Any]:
    payloads = [item.payload for item in items]
    flat = _id_block(payloads)
    if flat is None:
        return [LIST, payloads]
    small = flat.min() >= 0 and flat.max() <= INT32_MAX
    offsets = np.zeros(len(payloads) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in payloads], out=offsets[1:])
    return [TOKENS, flat.astype(np.int32, copy=False) if small else flat, offsets]


def _id_block(payloads: list[Any]) -> np.ndarray | None:
    """Every payload's ids end to end when each is a non-empty row of integers (an
    array, as the front end tokenizes, or a list, as a client sends ids), else None."""
    if not payloads:
        return None
    if all(type(p) is np.ndarray and p.ndim == 1 and p.dtype.kind in "iu" and p.size
           for p in payloads):
        return np.concatenate(payloads)
    if all((type(p) is list or type(p) is tuple) and p for p in payloads):
        flat = np.asarray(list(itertools.chain.from_iterable(payloads)))
        if flat.ndim == 1 and flat.dtype.kind in "iu":
            return flat
    return None


def items_from_wire(block: Any) -> list[PreparedItem]:
    """Every item of a message's [payloads, costs, indices], in order."""
    payloads, costs, indices = _checked_items(block)
    if payloads[0] == TOKENS:
        flat, bounds = payloads[1], payloads[2].tolist()
        rows: list[Any] = [flat[bounds[i]:bounds[i + 1]] for i in range(len(costs))]
    else:
        rows = list(payloads[1])
    return [PreparedItem(row, cost, index) for row, cost, index
            in zip(rows, costs.tolist(), indices.tolist(), strict=True)]


def _checked_items(block: Any) -> tuple[Any, np.ndarray, np.ndarray]:
    if not (isinstance(block, tuple) and len(block) == 3):
        raise ValueError("items are [payloads, costs, indices]")
    payloads, costs, indices = block
    for name, array in (("costs", costs), ("indices", indices)):
        if not (isinstance(array, np.ndarray) and array.ndim == 1 and array.dtype.kind in "iu"):
            raise ValueError(f"item {name} must be a 1-D integer array")
    if len(costs) != len(indices):
        raise ValueError(f"{len(costs)} costs for {len(indices)} indices")
    if not (isinstance(payloads, tuple) and payloads):
        raise ValueError("payloads are [kind, ...]")
    if payloads[0] == TOKENS:
        if len(payloads) != 3:
            raise ValueError("token payloads are [tokens, ids, offsets]")
        flat, offsets = payloads[1], payloads[2]
        if not all(isinstance(a, np.ndarray) and a.ndim == 1 and a.dtype.kind in "iu"
                   for a in (flat, offsets)):
            raise ValueError("token ids and offsets must be 1-D integer arrays")
        if len(offsets) != len(costs) + 1 or (len(offsets) and (
                offsets[0] != 0 or offsets[-1] != len(flat)
                or bool(np.any(np.diff(offsets) <= 0)))):
            raise ValueError("token offsets must rise from 0 to the number of ids, one "
                             "row per item")
    elif payloads[0] == LIST:
        if len(payloads) != 2 or not isinstance(payloads[1], tuple) or (
                len(payloads[1]) != len(costs)):
            raise ValueError("list payloads are [list, payloads], one per item")
    else:
        raise ValueError(f"unknown payload kind {payloads[0]!r}")
    return payloads, costs, indices


def values_to_wire(values: Sequence[Any]) -> list[Any]:
    """Every call's values of one reply, concatenated: [rows, 2-D array] when they are
    all vectors of one dtype and length, else [list, values]."""
    first = values[0] if values else None
    if (isinstance(first, np.ndarray) and first.ndim == 1
            and all(type(v) is np.ndarray and v.shape == first.shape
                    and v.dtype == first.dtype for v in values)):
        return [ROWS, np.stack(values)]
    return [LIST, list(values)]


def values_from_wire(block: Any, start: int, end: int) -> list[Any]:
    """Values `start` to `end` of a reply's block (rows are views of its array)."""
    if not (isinstance(block, tuple) and len(block) == 2):
        raise ValueError("values are [kind, values]")
    kind, values = block
    if kind == ROWS:
        if not (isinstance(values, np.ndarray) and values.ndim == 2):
            raise ValueError("rows must be a 2-D array")
    elif kind != LIST or not isinstance(values, tuple):
        raise ValueError(f"unknown values kind {kind!r}")
    if not (0 <= start <= end <= len(values)):
        raise ValueError(f"values {start}..{end} are outside the reply's {len(values)}")
    return list(values[start:end])
