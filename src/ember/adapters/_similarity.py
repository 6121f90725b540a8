"""How a query's output compares with documents' outputs, in numpy (float64 sums): dense
vectors by a sentence-transformers similarity, sparse vectors by their dot product, token
matrices by MaxSim. Several families score with the same one (m3 with all three)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ember.adapters.base import SparseVector

Vector = npt.NDArray[np.float32]
Matrix = npt.NDArray[np.float32]  # one row a token


def similar(name: str, query: Vector, docs: Sequence[Vector]) -> list[float]:
    """`query` against each of `docs` by similarity `name`: cosine, dot, euclidean or
    manhattan (the distances negated, so that higher is closer)."""
    matrix = np.stack(docs).astype(np.float64)
    q = query.astype(np.float64)
    if name == "cosine":
        norms = np.linalg.norm(matrix, axis=1) * np.linalg.norm(q)
        values = (matrix @ q) / np.maximum(norms, 1e-12)
    elif name == "dot":
        values = matrix @ q
    elif name == "euclidean":
        values = -np.linalg.norm(matrix - q, axis=1)
    else:
        values = -np.abs(matrix - q).sum(axis=1)
    return [float(v) for v in values]


def cosine(query: Vector, docs: Sequence[Vector]) -> list[float]:
    return similar("cosine", query, docs)


def dots(query: SparseVector, docs: Sequence[SparseVector]) -> list[float]:
    """The dot product of the query's sparse vector with each document's: the query laid
    out over its vocabulary once, then one gather a document (a third of the time of
    intersecting the two index sets a document)."""
    weights = np.zeros(query.dims, dtype=np.float64)
    weights[query.indices] = query.values
    return [float(np.dot(weights[doc.indices], doc.values.astype(np.float64)))
            for doc in docs]


def maxsim(query: Matrix, doc: Matrix) -> float:
    """Sum over query rows of the best dot product with a document row (unit rows: cosine)."""
    if query.shape[0] == 0 or doc.shape[0] == 0:
        return 0.0
    sims = query.astype(np.float64) @ doc.astype(np.float64).T
    return float(sims.max(axis=1).sum())
