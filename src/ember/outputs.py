"""Output dtypes of encode vectors: float32, float16, int8, uint8, binary and ubinary.

int8 is symmetric scalar quantization calibrated per vector: the largest
absolute component maps to 127, `q = round(127 * x / max|x|)`, and the wire
carries that `scale` (`x ~= q * scale`). Cosine similarity is unchanged by the
per-vector scale, so int8 vectors compare directly. binary keeps the sign bit
of each component (1 for > 0), packed eight to a byte, most significant bit
first (`numpy.packbits`); `dims` still reports the original dimension.
uint8 and ubinary are the names sie-sdk (after sentence-transformers) also
documents: uint8 is int8 shifted by 128 (`x ~= (q - 128) * scale`), ubinary the
same packed bits as binary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

DTYPES = ("float32", "float16", "int8", "uint8", "binary", "ubinary")
PACKED_BITS = ("binary", "ubinary")  # sign bits, eight to a byte
UINT8_ZERO = 128  # uint8 is int8 shifted by this


@dataclass(frozen=True)
class Quantized:
    values: npt.NDArray[Any]
    dtype: str
    scale: float | None = None


def quantize(vector: npt.NDArray[np.float32], dtype: str) -> Quantized:
    """`vector` (any shape, float32) in the requested output dtype."""
    if dtype == "float32":
        return Quantized(vector.astype(np.float32, copy=False), dtype)
    if dtype == "float16":
        return Quantized(vector.astype(np.float16), dtype)
    if dtype == "int8":
        peak = float(np.max(np.abs(vector))) if vector.size else 0.0
        scale = peak / 127.0 if peak > 0 else 1.0
        q = np.clip(np.rint(vector / scale), -127, 127).astype(np.int8)
        return Quantized(q, dtype, scale)
    if dtype == "uint8":
        signed = quantize(vector, "int8")
        return Quantized((signed.values.astype(np.int16) + UINT8_ZERO).astype(np.uint8),
                         dtype, signed.scale)
    if dtype in PACKED_BITS:
        return Quantized(np.packbits(vector > 0, axis=-1), dtype)
    raise ValueError(f"unknown output dtype {dtype!r}; use one of {', '.join(DTYPES)}")


def quantize_sparse(indices: npt.NDArray[np.int32], values: npt.NDArray[np.float32],
                    dtype: str) -> tuple[npt.NDArray[np.int32], Quantized]:
    """A sparse vector's weights in `dtype`, without those whose code stands for 0 (a
    weight under half an int8 step of the peak, or under float16's smallest): a sparse
    vector lists non-zero weights only."""
    q = quantize(values, dtype)
    kept = q.values != (UINT8_ZERO if dtype == "uint8" else 0)
    if kept.all():
        return indices, q
    return indices[kept], Quantized(q.values[kept], q.dtype, q.scale)


def unit_range(dims: int) -> float:
    """The range a unit vector's components are mapped from, for one scale a model: a
    component of a unit vector of `dims` rarely passes 4 / sqrt(dims) (4 standard
    deviations of a random direction's), so that maps to 127 and the rare rest clips."""
    return min(1.0, 4.0 / float(np.sqrt(max(dims, 1))))


def quantize_unit(vector: npt.NDArray[np.float32], dtype: str) -> npt.NDArray[Any]:
    """int8 or uint8 with one scale for every vector of a model, as APIs without a
    per-vector `scale` field need (Cohere's): the vector is made unit, then
    `q = round(127 * x / unit_range(dims))`, clipped; dot products of the codes rank
    as the float vectors' cosines do, where a per-vector scale would skew them."""
    norm = float(np.linalg.norm(vector))
    unit = vector / norm if norm > 0 else vector
    q: npt.NDArray[np.float32] = np.clip(
        np.rint(unit * (127.0 / unit_range(vector.shape[-1]))), -127, 127)
    if dtype == "int8":
        return q.astype(np.int8)
    if dtype == "uint8":
        return (q + UINT8_ZERO).astype(np.uint8)
    raise ValueError(f"quantize_unit makes int8 or uint8, not {dtype!r}")


def shortened(vector: npt.NDArray[np.float32], dims: int,
              unit: bool) -> npt.NDArray[np.float32]:
    """The first `dims` components of a dense vector: a Matryoshka model's smaller
    embedding. Made unit again where the whole vector was (`unit`), as
    sentence-transformers' `truncate_dim` with `normalize_embeddings` does; a zero
    vector stays zero."""
    cut = vector[..., :dims]
    if not unit:
        return cut
    norm = np.linalg.norm(cut, axis=-1, keepdims=True)
    unit_cut: npt.NDArray[np.float32] = (cut / np.maximum(norm, 1e-12)).astype(np.float32)
    return unit_cut

