"""Wire formats: JSON by default, msgpack (msgpack-numpy layout for arrays) on request.

JSON is written by orjson, which prints numpy arrays natively: a float32 vector keeps
float32's shortest digits (about 10 bytes a value) instead of float64's 20. Request
bodies are decoded once, straight into the route's model: msgpack never passes
through JSON.

A msgpack body is read by msgpack alone, never by `msgpack_numpy.decode` (which unpickles
arrays of dtype kind `O`): maps, lists, strings, bytes, numbers, and arrays in
msgpack-numpy's layout of numeric dtypes only. Anything else (an object or structured
array, an extension type) is a 422 naming the body, before any other work.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from typing import Any

import msgpack
import msgpack_numpy
import numpy as np
import orjson
from starlette.datastructures import Headers
from starlette.responses import Response

from ember.api.errors import ApiError

MSGPACK = "application/msgpack"
MSGPACK_TYPES = (MSGPACK, "application/x-msgpack")
JSON = "application/json"
_ORJSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY


def _orjson_default(value: object) -> object:
    # orjson hands over only what it cannot write itself: non-contiguous arrays, scalars.
    if isinstance(value, np.ndarray):
        # A contiguous copy is written natively; a dtype orjson lacks goes as a list.
        return value.tolist() if value.flags.c_contiguous else np.ascontiguousarray(value)
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def wants_msgpack(headers: Headers) -> bool:
    """Whether the Accept header prefers msgpack to JSON (a tie goes to msgpack, which a
    client names only on purpose; `q=0` means not at all)."""
    accept = headers.get("accept", "").lower()  # media types are case-insensitive
    if "msgpack" not in accept:
        return False
    msgpack_q = json_q = 0.0
    for part in accept.split(","):
        kind, *params = (piece.strip() for piece in part.split(";"))
        q = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if kind in MSGPACK_TYPES:
            msgpack_q = max(msgpack_q, q)
        elif kind in ("application/json", "application/*", "*/*"):
            json_q = max(json_q, q)
    return msgpack_q > 0 and msgpack_q >= json_q


def is_msgpack(headers: Headers) -> bool:
    kind = headers.get("content-type", "")
    return kind.split(";", 1)[0].strip().lower() in MSGPACK_TYPES


# What a browser's form or a page's fetch may send another origin without asking it first
# (no CORS preflight): a body of one of these kinds is never read.
FORM_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")


def check_body_type(headers: Headers) -> None:
    """Refuse a body a web page could have sent here from another origin: of a form's
    type, or (from a browser, which names the page's origin) of no type at all. A page
    that may call the server (--cors-allow-origin) sends JSON after its preflight."""
    kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind in FORM_TYPES or (not kind and "origin" in headers):
        sent = f"Content-Type {kind}" if kind else "a body without a Content-Type"
        raise ApiError(415, "unsupported_media_type", f"{sent} is not read: send "
                       "Content-Type: application/json (or application/msgpack)", "body")


def dumps_json(payload: Any) -> bytes:
    return orjson.dumps(payload, default=_orjson_default, option=_ORJSON_OPTIONS)


def encode(headers: Headers, payload: Any) -> tuple[bytes, str]:
    """The payload as msgpack if the client accepts it, else JSON; arrays go as arrays."""
    if wants_msgpack(headers):
        return msgpack.packb(payload, default=msgpack_numpy.encode, use_bin_type=True), MSGPACK
    return dumps_json(payload), JSON


def render(headers: Headers, payload: Any) -> Response:
    body, media_type = encode(headers, payload)
    return Response(body, media_type=media_type)


def decode(raw: bytes, headers: Headers) -> Any:
    """A request body as Python values (None when empty); undecodable input is a 422
    naming the body."""
    if not raw:
        return None
    coding = headers.get("content-encoding", "identity").strip().lower()
    if coding != "identity":  # read as sent, it would be called invalid JSON or msgpack
        raise ApiError(415, "unsupported_media_type", f"Content-Encoding {coding!r} is not "
                       "supported: send the body uncompressed", "body")
    if is_msgpack(headers):
        return decode_msgpack(raw)
    if not may_hold_a_long_integer(raw):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    # orjson refuses lone surrogates and NaN, which the standard reader accepts; the schema
    # and the input checks then name the field at fault instead of the whole body.
    try:
        value = json.loads(raw)
    except RecursionError:
        raise ApiError(422, "invalid_request", "body: invalid JSON (nested too deep)",
                       "body") from None
    except ValueError as exc:
        raise ApiError(422, "invalid_request", f"body: invalid JSON ({json_failure(exc)})",
                       "body") from None
    where = lone_surrogate(value)
    if where is not None:  # in any field (an id, a label): no answer could carry it back
        raise ApiError(422, "invalid_request", f"{where or 'body'} is not valid Unicode (it "
                       "holds a lone surrogate)", where or "body")
    return value


# orjson reads an integer outside 64 bits as a float, rounded without a word (a document
# id sent back changed); the standard reader keeps it exact. Such an integer has at least
# 19 digits in a row: a C-speed look for one (1.4 ms a MB) sends those bodies there.
_DIGITS_TO_ZERO = bytes(48 if 48 <= byte <= 57 else 32 for byte in range(256))
_LONG_DIGIT_RUN = b"0" * 19


def may_hold_a_long_integer(raw: bytes) -> bool:
    """Whether the body holds a run of 19 digits (in a number, or in a string)."""
    return _LONG_DIGIT_RUN in raw.translate(_DIGITS_TO_ZERO)


def json_failure(exc: ValueError) -> str:
    """Why the standard reader refused a body, in the client's terms."""
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at line {exc.lineno}, column {exc.colno}"
    if isinstance(exc, UnicodeDecodeError):
        return "not UTF-8"
    # Python's guard against slow big-integer parsing: the only other ValueError it raises.
    return f"a number of over {sys.get_int_max_str_digits()} digits"


# Where a value sits in a body, as a chain back to the body: (parent's link, its key or
# index). Spelt out (`spelt`) only for the value a message names: spelling each path as
# the walk went cost a copy of every key per element (a 1 MB key over 2,000 list
# elements asked for gigabytes).
Link = tuple["Link", str | int] | None


def json_values(value: Any) -> Iterator[tuple[Any, Link]]:
    """Every value of a decoded body, in document order, with its link. A stack, not
    recursion: the body may nest as deep as the reader allows."""
    pending: list[tuple[Any, Link]] = [(value, None)]
    while pending:
        item, link = pending.pop()
        yield item, link
        if isinstance(item, dict):
            pending.extend((child, (link, key)) for key, child in reversed(item.items()))
        elif isinstance(item, list):
            pending.extend((item[i], (link, i)) for i in range(len(item) - 1, -1, -1))


def spelt(link: Link, within: str = "") -> str:
    """A link as a path (`items[0].id`), after `within` (the place of the value walked)."""
    steps: list[str | int] = []
    while link is not None:
        link, step = link
        steps.append(step)
    path = within
    for step in reversed(steps):
        path += f"[{step}]" if isinstance(step, int) else f".{step}" if path else str(step)
    return path


# A request's objects hold a few named fields (the largest, under 30); pydantic builds an
# error per unknown one, so 1M of them in a 12 MB body held the event loop 2.3 s.
MAX_FIELDS = 256
FIELDS_DEPTH = 4  # where a request's objects sit: `items[i].image` is the deepest


def crowded_object(value: Any, size: int) -> tuple[str, int] | None:
    """The place and size of the first object of a body (of `size` bytes) with more than
    MAX_FIELDS fields, or None. It looks where models sit: in objects, and in lists of
    them, never down a list of lists (token ids), so its cost is the body's objects, not
    its numbers."""
    # A field takes two bytes at the least (msgpack: a one-byte key and value; JSON more),
    # so a short body, as most are, holds no such object.
    if type(value) is not dict or size <= 2 * MAX_FIELDS:
        return None
    pending: list[tuple[dict[Any, Any], Link, int]] = [(value, None, 0)]
    while pending:
        item, link, depth = pending.pop()
        if len(item) > MAX_FIELDS:
            return spelt(link) or "body", len(item)
        if depth == FIELDS_DEPTH:
            continue
        for key, child in item.items():
            if type(child) is dict:
                pending.append((child, (link, key), depth + 1))
            elif type(child) is list:
                pending.extend((element, ((link, key), i), depth + 1)
                               for i, element in enumerate(child) if type(element) is dict)
    return None


def lone_surrogate(value: Any) -> str | None:
    """The path (`items[0].id`) of the first text or key holding a lone UTF-16 surrogate,
    which JSON can escape (`\\ud800`) but UTF-8 cannot carry; None when there is none."""
    for item, link in json_values(value):
        if isinstance(item, str):
            if not _is_unicode(item):
                return spelt(link)
        elif isinstance(item, dict) and not all(_is_unicode(str(key)) for key in item):
            return spelt(link) or "body"
    return None


def _is_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# msgpack-numpy's array map: {nd: True, type: dtype.str, kind: b"", shape, data}, its keys
# bytes (as its encoder writes them) or str; {nd: False, type, data} is a numpy scalar.
_ND = ("nd", b"nd")
_ARRAY_KINDS = frozenset("biuf")  # bool, int, uint, float: what a vector or an id is made of
_MAX_DIMS = 8


class _Refused(Exception):
    """A msgpack value outside the contract; its message names what was refused."""


def _no_extensions(code: int, data: bytes) -> Any:
    raise _Refused(f"msgpack extension type {code} is not accepted")


def _field(obj: dict[Any, Any], name: str) -> Any:
    if name in obj:
        return obj[name]
    return obj.get(name.encode())


def _numeric_dtype(descr: Any) -> np.dtype[Any]:
    if isinstance(descr, bytes):
        descr = descr.decode("ascii", "replace")
    if not isinstance(descr, str) or len(descr) > 8:
        raise _Refused("an array's type must be a numeric dtype string such as '<f4'")
    try:
        dtype = np.dtype(descr)
    except TypeError:
        raise _Refused(f"unknown array dtype {descr!r}") from None
    if dtype.kind not in _ARRAY_KINDS or dtype.shape != () or dtype.fields is not None:
        raise _Refused(f"arrays of dtype {descr!r} are not accepted (numeric dtypes only: "
                       "bool, int, uint, float)")
    return dtype


def _array_or_map(obj: dict[Any, Any]) -> Any:
    """Each decoded map: a msgpack-numpy array is checked and rebuilt without pickle;
    every other map stays a dict."""
    if not any(key in obj for key in _ND):
        return obj
    kind = _field(obj, "kind")
    if kind not in (None, b"", ""):
        raise _Refused(f"arrays of kind {kind!r} are not accepted (numeric dtypes only)")
    dtype = _numeric_dtype(_field(obj, "type"))
    data = _field(obj, "data")
    if not isinstance(data, bytes):
        raise _Refused("an array's data must be bytes")
    if _field(obj, "nd") is not True:  # a scalar
        if len(data) != dtype.itemsize:
            raise _Refused("a numpy scalar's data does not match its dtype")
        return np.frombuffer(data, dtype=dtype)[0].item()
    shape = _field(obj, "shape")
    if (not isinstance(shape, list | tuple) or len(shape) > _MAX_DIMS
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                       for n in shape)):
        raise _Refused(f"an array's shape must be a list of at most {_MAX_DIMS} sizes")
    if math.prod(shape) * dtype.itemsize != len(data):
        raise _Refused("an array's data does not match its shape and dtype")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def decode_msgpack(raw: bytes) -> Any:
    """A msgpack body under the contract above; anything else is a 422 naming the body.
    Lengths are bounded by the body's own size (msgpack's defaults), so a header that
    claims 2^31 elements fails before anything is allocated."""
    try:
        return msgpack.unpackb(raw, object_hook=_array_or_map, ext_hook=_no_extensions,
                               raw=False, strict_map_key=False)
    except _Refused as exc:
        raise ApiError(422, "invalid_request", f"body: {exc}", "body") from None
    except UnicodeDecodeError:  # valid msgpack, but a str whose bytes are not text
        raise ApiError(422, "invalid_request", "body: a msgpack string is not valid UTF-8; "
                       "send text as UTF-8", "body") from None
    except Exception:
        raise ApiError(422, "invalid_request", "body: not valid msgpack (or nested too "
                       "deep)", "body") from None
