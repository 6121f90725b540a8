"""The numpy batch helpers give what the torch path gives on the same inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ember.adapters import _arrays as arrays
from ember.adapters import _torch as common
from ember.adapters.transformer import pool as torch_pool

ROWS = [[101, 7, 8, 102], [101, 102], [101, 5, 6, 7, 8, 9, 102]]


def test_rows_are_right_padded_with_a_mask_of_their_own_tokens() -> None:
    ids, mask = arrays.padded(ROWS, 0)
    assert ids.dtype == np.int64 and mask.dtype == np.int64
    assert ids.tolist() == [[101, 7, 8, 102, 0, 0, 0], [101, 102, 0, 0, 0, 0, 0],
                            [101, 5, 6, 7, 8, 9, 102]]
    assert mask.sum(axis=1).tolist() == [4, 2, 7]
    assert arrays.padded(ROWS, 3)[0][1].tolist() == [101, 102, 3, 3, 3, 3, 3]


def test_array_rows_and_mixed_rows_pad_as_lists_do() -> None:
    block = np.array([i for row in ROWS for i in row], dtype=np.int32)
    views = [block[0:4], block[4:6], block[6:13]]  # as the front end and the wire make them
    expected = [a.tolist() for a in arrays.padded(ROWS, 0)]
    for rows in (views, [views[0], ROWS[1], views[2]], [np.array(r) for r in ROWS]):
        ids, mask = arrays.padded(rows, 0)
        assert ids.dtype == np.int64 and [ids.tolist(), mask.tolist()] == expected


def test_the_torch_helpers_pad_the_same() -> None:
    cpu = torch.device("cpu")
    assert common.pad(ROWS, 9, cpu).tolist() == arrays.padded(ROWS, 9)[0].tolist()
    ids, mask = common.pad_with_mask(ROWS, 9, cpu)
    assert [ids.tolist(), mask.tolist()] == [a.tolist() for a in arrays.padded(ROWS, 9)]


@pytest.mark.parametrize("mode", ["mean", "cls"])
def test_pooling_and_normalizing_match_torch(mode: str) -> None:
    hidden = np.random.default_rng(0).standard_normal((3, 7, 16)).astype(np.float32)
    _, mask = arrays.padded(ROWS, 0)
    expected = torch_pool(torch.from_numpy(hidden), torch.from_numpy(mask), mode)
    pooled = arrays.pool(hidden, mask, mode)
    assert pooled.dtype == np.float32
    np.testing.assert_allclose(pooled, expected.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(arrays.l2_normalized(pooled),
                               F.normalize(expected, p=2, dim=1).numpy(), rtol=1e-5, atol=1e-6)


def test_padding_tokens_do_not_reach_the_mean() -> None:
    hidden = np.ones((1, 4, 2), dtype=np.float32)
    hidden[0, 2:] = 1000.0  # the padded positions
    pooled = arrays.pool(hidden, np.array([[1, 1, 0, 0]]), "mean")
    assert pooled.tolist() == [[1.0, 1.0]]


def test_a_zero_vector_stays_zero_when_normalized() -> None:
    assert arrays.l2_normalized(np.zeros((1, 3), dtype=np.float32)).tolist() == [[0, 0, 0]]


def test_sigmoid_matches_torch() -> None:
    logits = np.array([-30.0, -1.5, 0.0, 2.25, 40.0], dtype=np.float32)
    assert arrays.sigmoid(logits) == [float(v) for v in torch.sigmoid(torch.from_numpy(logits))]


def test_splade_pooling_matches_torch_and_ignores_padding() -> None:
    logits = np.random.default_rng(1).standard_normal((3, 7, 50)).astype(np.float32)
    _, mask = arrays.padded(ROWS, 0)
    logits[1, 2:, :] = 100.0  # the second row's padding: it must not win the max
    expected = torch.from_numpy(logits.copy())
    expected.masked_fill_(torch.from_numpy(mask).unsqueeze(-1) == 0, float("-inf"))
    expected = torch.log1p(torch.relu(expected.amax(dim=1)))
    frozen = logits.copy()
    frozen.flags.writeable = False  # a read-only output is pooled from a copy
    for source in (frozen, logits):
        pooled = arrays.max_log_relu(source, mask)
        assert pooled.dtype == np.float32 and pooled.shape == (3, 50)
        np.testing.assert_allclose(pooled, expected.numpy(), rtol=1e-6, atol=1e-7)
    assert pooled[1].max() < np.log1p(100.0)
    assert (pooled >= 0).all() and (pooled == 0).any()  # relu: negative maxima pool to 0
