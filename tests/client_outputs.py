"""What a client does with Ember's quantized outputs (src/ember/outputs.py): their
inverses, which the tests hold the server's outputs to."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


def dequantize_int8(values: npt.NDArray[np.int8], scale: float) -> npt.NDArray[np.float32]:
    return values.astype(np.float32) * np.float32(scale)


def unpack_binary(packed: npt.NDArray[np.uint8], dims: int) -> npt.NDArray[np.uint8]:
    """The sign bits back as 0/1 per dimension."""
    return np.unpackbits(packed, axis=-1)[..., :dims]


def hamming(a: npt.NDArray[np.uint8], b: npt.NDArray[np.uint8]) -> int:
    """Differing bits between two packed binary vectors."""
    return int(np.unpackbits(np.bitwise_xor(a, b)).sum())
