"""Output dtypes on real vectors of the default model."""

from __future__ import annotations

import numpy as np
import pytest

from ember.outputs import quantize, quantize_sparse, quantize_unit, unit_range
from tests.client_outputs import dequantize_int8, hamming, unpack_binary


def unit(seed: int, dims: int = 384) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(dims).astype(np.float32)
    return v / np.linalg.norm(v)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_int8_round_trip_keeps_the_direction() -> None:
    for seed in range(20):
        v = unit(seed)
        q = quantize(v, "int8")
        assert q.values.dtype == np.int8 and q.scale is not None
        assert cosine(dequantize_int8(q.values, q.scale), v) >= 0.99


def test_float16_is_close() -> None:
    v = unit(1)
    assert np.max(np.abs(quantize(v, "float16").values.astype(np.float32) - v)) < 1e-3


def test_binary_packs_sign_bits_and_hamming_finds_the_neighbour() -> None:
    v = unit(2, 16)
    packed = quantize(v, "binary").values
    assert packed.dtype == np.uint8 and packed.shape == (2,)
    assert unpack_binary(packed, 16).tolist() == (v > 0).astype(np.uint8).tolist()
    near = v + 0.05 * unit(3, 16)
    far = -v
    p_near, p_far = quantize(near, "binary").values, quantize(far, "binary").values
    assert hamming(packed, p_near) < hamming(packed, p_far)


def test_an_unknown_dtype_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="float32, float16, int8, uint8, binary, ubinary"):
        quantize(unit(0), "int4")


def test_quantize_unit_has_one_scale_for_every_vector_of_a_model() -> None:
    rng = np.random.default_rng(3)
    docs = rng.normal(size=(200, 384)).astype(np.float32)
    query = rng.normal(size=384).astype(np.float32)
    codes = np.stack([quantize_unit(v, "int8") for v in docs]).astype(np.int64)
    np.testing.assert_array_equal(quantize_unit(docs[0] * 7.5, "int8"), codes[0])  # unit first
    np.testing.assert_array_equal(quantize_unit(docs[0], "uint8").astype(np.int64) - 128,
                                  codes[0])
    # One scale: x ~= q * unit_range / 127 for every vector, so dot products keep the order.
    unit = docs / np.linalg.norm(docs, axis=1, keepdims=True)
    inside = np.abs(unit) <= unit_range(384)  # the rest (4 standard deviations out) clips
    assert inside.mean() > 0.999
    np.testing.assert_allclose((codes * unit_range(384) / 127)[inside], unit[inside],
                               atol=unit_range(384) / 127)
    floats = unit @ (query / np.linalg.norm(query))
    dots = codes @ quantize_unit(query, "int8").astype(np.int64)
    assert np.corrcoef(floats, dots)[0, 1] > 0.999
    with pytest.raises(ValueError, match="int8 or uint8"):
        quantize_unit(query, "float16")


@pytest.mark.parametrize("dtype", ["int8", "uint8", "float16", "float32"])
def test_a_sparse_vector_lists_no_weight_whose_code_is_zero(dtype: str) -> None:
    """Found by a black-box review: a weight under half an int8 step of the peak was
    listed with the code for 0."""
    indices = np.array([2, 5, 7, 11], np.int32)
    values = np.array([3.0, 0.004, 1e-9, 0.5], np.float32)
    kept, q = quantize_sparse(indices, values, dtype)
    want = [2, 11] if dtype in ("int8", "uint8") else [2, 5, 11] if dtype == "float16" \
        else [2, 5, 7, 11]
    assert kept.tolist() == want and len(q.values) == len(want)
    zero = 128 if dtype == "uint8" else 0
    assert (q.values != zero).all()
    if q.scale is not None:  # the codes kept still decode to their weights
        decoded = (q.values.astype(np.float32) - zero) * q.scale
        np.testing.assert_allclose(decoded, values[np.isin(indices, want)], atol=q.scale / 2)
