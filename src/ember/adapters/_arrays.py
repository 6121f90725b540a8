"""A batch's inputs and poolings as numpy arrays: dynamic padding for either backend,
and the pooling of ONNX Runtime outputs, which then never pass through torch (each
small torch op costs tens of microseconds of dispatch on CPU, numpy's a few)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import numpy.typing as npt

Ids = npt.NDArray[np.int64]
Floats = npt.NDArray[np.float32]
# One row of token ids: a list as a client sends them, an array as the front end makes them.
IdRow = Sequence[int] | npt.NDArray[np.integer]


def padded(rows: Sequence[IdRow], value: int) -> tuple[Ids, Ids]:
    """Rows of token ids right-padded to the longest with `value`, and the attention
    mask (1 on a row's own tokens), both (rows, longest) int64."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    mask = np.arange(int(lengths.max())) < lengths[:, None]
    ids = np.full(mask.shape, value, dtype=np.int64)
    ids[mask] = joined(rows, int(lengths.sum()))
    return ids, mask.astype(np.int64)


def joined(rows: Sequence[IdRow], count: int) -> npt.NDArray[np.integer]:
    """The `count` ids of every row, end to end. Array rows (a front end's tokens, the
    wire's) are copied in one call: walking them id by id costs 9 times as long."""
    if rows and all(type(row) is np.ndarray for row in rows):
        block: npt.NDArray[np.integer] = np.concatenate(rows)
        return block
    return np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=count)


def pool(hidden: Floats, mask: Ids, mode: str) -> Floats:
    """One vector a row of (rows, tokens, dims) `hidden`, over the positions `mask` keeps
    (a row's own tokens, less a prompt excluded from pooling), as sentence-transformers
    pools: the first kept token ("cls"), their mean ("mean"), their maximum ("max") or
    the last kept one ("lasttoken"; zeros for a row that keeps none)."""
    hidden = hidden.astype(np.float32, copy=False)
    rows = np.arange(len(mask))
    if mode == "cls":  # the first kept position: 0 unless a prompt is left out
        first: Floats = hidden[rows, mask.argmax(axis=1)]
        return first
    if mode == "lasttoken":
        last = mask.shape[1] - 1 - mask[:, ::-1].argmax(axis=1)
        kept: Floats = hidden[rows, last] * mask[rows, last, None].astype(np.float32)
        return kept
    if mode == "max":
        masked = np.where(mask[..., None] != 0, hidden, np.float32(-np.inf))
        top: Floats = masked.max(axis=1)
        return top
    weights = mask.astype(np.float32)
    sums = np.einsum("btd,bt->bd", hidden, weights)
    counts = np.maximum(weights.sum(axis=1, keepdims=True), np.float32(1e-9))
    means: Floats = (sums / counts).astype(np.float32, copy=False)
    return means


def max_log_relu(logits: Floats, mask: Ids) -> Floats:
    """SPLADE's pooling of (rows, tokens, vocabulary) logits: per row and entry, the max
    over the row's own tokens of log(1 + relu(logit)). Writes -inf over the padding of
    `logits` when it may (the graph's output is ours), else works on a copy."""
    if not logits.flags.writeable:
        logits = logits.copy()
    logits[mask == 0] = -np.inf
    # log1p(relu(.)) is monotone, so the max of the logits pools the same.
    top = logits.max(axis=1)
    pooled: Floats = np.log1p(np.maximum(top, np.float32(0)), dtype=np.float32)
    return pooled


def l2_normalized(vectors: Floats) -> Floats:
    """Each row over its L2 norm (a zero row stays zero), as torch's F.normalize."""
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    unit: Floats = (vectors / np.maximum(norms, np.float32(1e-12))).astype(np.float32,
                                                                           copy=False)
    return unit


def sigmoid(values: Floats) -> list[float]:
    """The logistic of each value, in float32 as torch's."""
    return [float(v) for v in np.float32(1) / (np.float32(1) + np.exp(-values))]
