"""Many calls in one message: the items of every submit an API process gathered in one
turn of its event loop, and the results of every call one forward finished.

Items travel as blocks, not per-item lists: token-id rows as one flat int array and
its offsets, costs and indices as int arrays; rows of a wire dataclass whose fields are
token-id rows (a reranker's pairs, multi-vector rows) as one such column a field; other
payloads (texts, images) as one list. Results that are vectors of one dtype and length
travel as one 2-D array; each call's values are its rows, views of it. Anything else goes
as a list.

`items_from_wire` and `values_from_wire` check what a peer sent (offsets inside the
block, counts that add up) and raise ValueError before anything is built from it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from ember.engine import PreparedItem
from ember.ipc.wire import wire_class, wire_name

TOKENS, FIELDS, LIST, ROWS = "tokens", "fields", "list", "rows"
INT32_MAX = 2**31 - 1
PARAMS_UNKNOWN = "ParamsUnknown"  # the error for a call whose parameter group is not held


def items_to_wire(items: Sequence[PreparedItem]) -> list[Any]:
    """[payloads, costs, indices] for the items of one message, in order."""
    costs = np.fromiter((item.cost for item in items), dtype=np.int64, count=len(items))
    indices = np.fromiter((item.index for item in items), dtype=np.int32, count=len(items))
    return [_payloads(items), costs, indices]


def _payloads(items: Sequence[PreparedItem]) -> list[Any]:
    payloads = [item.payload for item in items]
    tokens = _column(payloads, allow_missing=False)
    if tokens is not None:
        return [TOKENS, *tokens]
    fields = _field_columns(payloads)
    if fields is not None:
        return fields
    return [LIST, payloads]


def _column(rows: list[Any], allow_missing: bool) -> list[Any] | None:
    """[ids, offsets(, missing)] when every row is a non-empty row of integers (an array,
    as the front end tokenizes, or a list, as a client sends ids), else None. With
    `allow_missing`, None rows are allowed too: empty in the block, flagged in `missing`."""
    if not rows:
        return None
    present = [row for row in rows if row is not None] if allow_missing else rows
    if not present:
        return None
    if all(type(r) is np.ndarray and r.ndim == 1 and r.dtype.kind in "iu" and r.size
           for r in present):
        flat = np.concatenate(present)
    elif all((type(r) is list or type(r) is tuple) and r for r in present):
        flat = np.asarray(list(itertools.chain.from_iterable(present)))
        if not (flat.ndim == 1 and flat.dtype.kind in "iu"):
            return None
    else:
        return None
    if flat.min() >= 0 and flat.max() <= INT32_MAX:
        flat = flat.astype(np.int32, copy=False)
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([0 if row is None else len(row) for row in rows], out=offsets[1:])
    if not allow_missing:
        return [flat, offsets]
    missing = np.fromiter((row is None for row in rows), dtype=bool, count=len(rows))
    return [flat, offsets, missing if missing.any() else None]


def _field_columns(payloads: list[Any]) -> list[Any] | None:
    """[fields, wire name, columns] when every payload is a wire dataclass of one class
    (a reranker's pair, a multi-vector row) whose fields are rows of integers or None:
    each field's rows as one column, none where no payload has it."""
    kind = type(payloads[0]) if payloads else None
    if kind is None or not dataclasses.is_dataclass(kind) or any(
            type(p) is not kind for p in payloads):
        return None
    try:
        name = wire_name(kind)
    except TypeError:  # not a wire type: the list path says so when it is packed
        return None
    columns: list[Any] = []
    for field in dataclasses.fields(kind):
        values = [getattr(p, field.name) for p in payloads]
        column = _column(values, allow_missing=True)
        if column is None and any(v is not None for v in values):
            return None
        columns.append(column)
    if all(column is None for column in columns):
        return None
    return [FIELDS, name, columns]


def items_from_wire(block: Any) -> list[PreparedItem]:
    """Every item of a message's [payloads, costs, indices], in order."""
    payloads, costs, indices, kind = _checked_items(block)
    count = len(costs)
    if payloads[0] == TOKENS:
        rows: list[Any] = _rows(payloads[1], payloads[2], None, count)
    elif kind is not None:
        columns = [[None] * count if column is None
                   else _rows(column[0], column[1], column[2], count)
                   for column in payloads[2]]
        rows = [kind(*fields) for fields in zip(*columns, strict=True)]
    else:
        rows = list(payloads[1])
    return [PreparedItem(row, cost, index) for row, cost, index
            in zip(rows, costs.tolist(), indices.tolist(), strict=True)]


def _rows(flat: np.ndarray, offsets: np.ndarray, missing: np.ndarray | None,
          count: int) -> list[Any]:
    """A checked column's rows, views of its block (None where `missing`)."""
    bounds = offsets.tolist()
    rows: list[Any] = [flat[bounds[i]:bounds[i + 1]] for i in range(count)]
    if missing is not None:
        for i in np.flatnonzero(missing).tolist():
            rows[i] = None
    return rows


def _checked_items(block: Any) -> tuple[Any, np.ndarray, np.ndarray, type | None]:
    """The block's parts, checked, and the dataclass of its field columns (if it has them)."""
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
    kind = None
    if payloads[0] == TOKENS:
        if len(payloads) != 3:
            raise ValueError("token payloads are [tokens, ids, offsets]")
        _check_column(payloads[1:], len(costs), allow_missing=False)
    elif payloads[0] == FIELDS:
        if len(payloads) != 3 or not isinstance(payloads[2], tuple):
            raise ValueError("field payloads are [fields, wire name, columns]")
        kind = wire_class(payloads[1])
        fields = dataclasses.fields(kind)
        if len(payloads[2]) != len(fields) or all(c is None for c in payloads[2]):
            raise ValueError(f"{len(fields)} columns expected, some of them rows")
        for column in payloads[2]:
            if column is not None:
                _check_column(column, len(costs), allow_missing=True)
    elif payloads[0] == LIST:
        if len(payloads) != 2 or not isinstance(payloads[1], tuple) or (
                len(payloads[1]) != len(costs)):
            raise ValueError("list payloads are [list, payloads], one per item")
    else:
        raise ValueError(f"unknown payload kind {payloads[0]!r}")
    return payloads, costs, indices, kind


def _check_column(column: Any, count: int, allow_missing: bool) -> None:
    """A column's ids and offsets (and, where allowed, its missing rows) fit together:
    one row an item, each inside the block, and only a missing row empty."""
    if not (isinstance(column, tuple) and len(column) == (3 if allow_missing else 2)):
        raise ValueError("a column is [ids, offsets" + (", missing]" if allow_missing else "]"))
    flat, offsets = column[0], column[1]
    if not all(isinstance(a, np.ndarray) and a.ndim == 1 and a.dtype.kind in "iu"
               for a in (flat, offsets)):
        raise ValueError("token ids and offsets must be 1-D integer arrays")
    missing = column[2] if allow_missing else None
    if missing is not None and not (isinstance(missing, np.ndarray) and missing.dtype == bool
                                    and missing.shape == (count,)):
        raise ValueError("missing rows must be one boolean an item")
    flagged = missing if missing is not None else np.zeros(count, dtype=bool)
    lengths = np.diff(offsets.astype(np.int64))  # unsigned, a fall would wrap to a rise
    if len(offsets) != count + 1 or offsets[0] != 0 or offsets[-1] != len(flat) or bool(
            np.any(lengths < 0)) or bool(np.any((lengths == 0) != flagged)):
        raise ValueError("token offsets must rise from 0 to the number of ids, one row per "
                         "item, empty only where the row is missing")


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
