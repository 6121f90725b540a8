"""The request body decoder: what the contract allows, and nothing else."""

from __future__ import annotations

import pickle
from typing import Any

import msgpack
import msgpack_numpy
import numpy as np
import orjson
import pytest
from starlette.datastructures import Headers

from ember.api.codec import decode
from ember.api.errors import ApiError

MSGPACK = Headers({"content-type": "application/msgpack"})


def body(value: Any) -> bytes:
    return msgpack.packb(value, default=msgpack_numpy.encode, use_bin_type=True)


def refused(raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as caught:
        decode(raw, MSGPACK)
    assert caught.value.status == 422 and caught.value.param == "body"
    return caught.value


@pytest.mark.parametrize("dtype", ["<f4", "<f2", "<f8", "<i8", "|u1", "|i1", "|b1"])
def test_numeric_arrays_decode_as_msgpack_numpy_wrote_them(dtype: str) -> None:
    array = (np.arange(12).reshape(3, 4) % 2).astype(dtype)
    decoded = decode(body({"values": array, "scalar": np.float32(1.5)}), MSGPACK)
    assert decoded["values"].dtype == np.dtype(dtype)
    assert np.array_equal(decoded["values"], array)
    assert decoded["scalar"] == 1.5


def test_plain_values_decode() -> None:
    value = {"items": [{"id": "a", "text": "héllo"}], "n": 3, "x": 1.5, "b": b"\x00\x01"}
    assert decode(body(value), MSGPACK) == value


def test_json_integers_of_any_width_decode_exactly() -> None:
    """orjson reads an integer past 64 bits as a rounded float; the decoder must not."""
    raw = b'{"wide": 123456789012345678901234567, "low": -9223372036854775809, ' \
          b'"top": 18446744073709551615, "x": 1.5, "t": "1234567890123456789"}'
    decoded = decode(raw, Headers({"content-type": "application/json"}))
    assert decoded == {"wide": 123456789012345678901234567, "low": -9223372036854775809,
                       "top": 18446744073709551615, "x": 1.5, "t": "1234567890123456789"}
    assert all(type(decoded[key]) is int for key in ("wide", "low", "top"))


class Boom:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (exec, ("raise SystemExit('unpickled')",))


def test_an_object_array_is_refused_without_unpickling() -> None:
    raw = body({"items": [{"text": np.array([Boom()], dtype=object)}]})
    assert b"unpickled" in raw  # msgpack-numpy put a pickle in the body
    assert "kind" in str(refused(raw))


@pytest.mark.parametrize("keys", ["bytes", "str"])
@pytest.mark.parametrize("dtype,kind", [("|O", b""), ("<U4", b""), ("|S4", b""),
                                        ("<M8[s]", b""), ("<c8", b""), ("V4", b"V"),
                                        ("(2,)<f4", b""), ("<f4", b"O")])
def test_non_numeric_arrays_are_refused(keys: str, dtype: str, kind: bytes) -> None:
    fields = {"nd": True, "type": dtype, "kind": kind, "shape": [1],
              "data": pickle.dumps(Boom()) if "O" in dtype or kind else b"\0" * 16}
    value = {k.encode(): v for k, v in fields.items()} if keys == "bytes" else fields
    refused(body({"items": [{"text": value}]}))


@pytest.mark.parametrize("shape,data", [([3], b"\0" * 8), ([2, -1], b"\0" * 8),
                                        ([True], b"\0" * 4), ([1] * 9, b"\0" * 4),
                                        ("12", b"\0" * 4), ([2**62, 2**62], b"\0" * 4)])
def test_arrays_whose_shape_lies_are_refused(shape: Any, data: bytes) -> None:
    refused(body({b"nd": True, b"type": "<f4", b"kind": b"", b"shape": shape, b"data": data}))


def test_extension_types_are_refused() -> None:
    assert "extension type 5" in str(refused(msgpack.packb([msgpack.ExtType(5, b"x")])))


def test_a_string_that_is_not_utf8_is_named_so() -> None:
    """Found by a black-box review: it was called "not valid msgpack"."""
    raw = msgpack.packb({"items": [{"text": "x"}]}).replace(b"x", b"\xff")
    assert "not valid UTF-8" in str(refused(raw))


def test_length_claims_beyond_the_body_are_refused_before_allocating() -> None:
    refused(b"\xdd" + (2**31).to_bytes(4, "big"))
    refused(b"\xdf" + (2**31).to_bytes(4, "big"))
    refused(b"\x91" * 100_000 + b"\xc0")


@pytest.mark.parametrize(("accept", "wanted"), [
    ("application/msgpack", True),
    ("application/x-msgpack", True),
    ("Application/MsgPack", True),  # found by a code review: the case was matched
    ("APPLICATION/X-MSGPACK;Q=0.9, application/json;q=0.5", True),
    ("application/msgpack, application/json", True),  # a client names msgpack on purpose
    ("application/json;q=0.9, application/msgpack", True),
    ("application/msgpack;q=0, application/json", False),  # q=0: not acceptable
    ("application/msgpack;q=0.5, application/json", False),  # JSON preferred
    ("application/msgpack;q=0.5, */*;q=0.1", True),
    ("application/msgpack;q=oops", False),  # an unreadable weight counts as none
    ("application/json", False),
    ("*/*", False),
    ("", False),
])
def test_msgpack_answers_follow_the_accept_headers_weights(accept: str, wanted: bool) -> None:
    from ember.api.codec import wants_msgpack

    assert wants_msgpack(Headers({"accept": accept})) is wanted


def test_a_long_key_over_a_long_list_costs_no_copy_per_element() -> None:
    """Found by a security review: a 1 MB JSON body (a 1 MB key over 2,000 list elements,
    and a 19-digit run, which sends it to the standard reader and the surrogate walk) made
    the walk spell the key into each element's path: 2.3 GB, where a 16 MB body would
    have ended the process. Paths are spelt only for the value named."""
    import tracemalloc

    from ember.api.rerank import not_json

    key = "k" * 1_000_000
    zeros = ",".join(["0"] * 2000)
    raw = ('{"pad": "0000000000000000000", "' + key + '": [' + zeros
           + '], "bad": ["ok", "\\ud800"]}').encode()
    tracemalloc.start()
    try:
        with pytest.raises(ApiError) as refusal:
            decode(raw, Headers({"content-type": "application/json"}))
        _, decoding_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        assert not_json({key: [0] * 2000, "x": [float("nan")]}, "documents[0].meta") \
            == "documents[0].meta.x[0]"
        _, walking_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert refusal.value.param == "bad[1]"
    assert decoding_peak < 50e6 and walking_peak < 20e6, (decoding_peak, walking_peak)


def test_the_field_count_looks_where_objects_sit_not_down_lists_of_lists() -> None:
    from ember.api.codec import MAX_FIELDS, crowded_object

    def crowded(value: object) -> tuple[str, int] | None:
        return crowded_object(value, len(orjson.dumps(value)))

    many = {f"k{i}": 0 for i in range(300)}
    assert crowded({"a": [{"b": {"c": {"d": many}}}]}) == ("a[0].b.c.d", 300)
    assert crowded({"a": {"b": {"c": {"d": {"e": many}}}}}) is None  # deeper than any
    assert crowded({"inputs": [[many]]}) is None  # token ids' shape: not looked into
    assert crowded([many]) is None and crowded("x") is None
    assert crowded(many) == ("body", 300)
    # The smallest such object: 257 fields of a one-byte key and value in msgpack.
    smallest = {i: None for i in range(MAX_FIELDS + 1)}
    packed = msgpack.packb(smallest)
    assert crowded_object(smallest, len(packed)) == ("body", MAX_FIELDS + 1)
    assert crowded_object(smallest, 2 * MAX_FIELDS) is None  # no body this short holds it
