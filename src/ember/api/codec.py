"""Wire formats: JSON by default, msgpack (msgpack-numpy layout for arrays) on request.

JSON is written by orjson, which prints numpy arrays natively: a float32 vector keeps
float32's shortest digits (about 10 bytes a value) instead of float64's 20. Request
bodies are decoded once, straight into the route's model: msgpack never passes
through JSON.
"""

from __future__ import annotations

import json
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
    accept = headers.get("accept", "")
    return any(kind in accept for kind in MSGPACK_TYPES)


def is_msgpack(headers: Headers) -> bool:
    kind = headers.get("content-type", "")
    return kind.split(";", 1)[0].strip().lower() in MSGPACK_TYPES


def dumps_json(payload: Any) -> bytes:
    return orjson.dumps(payload, default=_orjson_default, option=_ORJSON_OPTIONS)


def encode(headers: Headers, payload: Any) -> tuple[bytes, str]:
    """The payload as msgpack if the client accepts it, else JSON; arrays go as arrays."""
    if wants_msgpack(headers):
        return msgpack.packb(payload, default=msgpack_numpy.encode, use_bin_type=True), MSGPACK
    return dumps_json(payload), JSON


def render(headers: Headers, payload: Any, status: int = 200) -> Response:
    body, media_type = encode(headers, payload)
    return Response(body, status_code=status, media_type=media_type)


def decode(raw: bytes, headers: Headers) -> Any:
    """A request body as Python values (None when empty); undecodable input is a 422
    naming the body."""
    if not raw:
        return None
    if is_msgpack(headers):
        try:
            return msgpack.unpackb(raw, object_hook=msgpack_numpy.decode, raw=False,
                                   strict_map_key=False)
        except Exception:
            raise ApiError(422, "invalid_request", "the request body is not valid msgpack",
                           "body") from None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    # orjson refuses lone surrogates and NaN, which the standard reader accepts; the schema
    # and the input checks then name the field at fault instead of the whole body.
    try:
        return json.loads(raw)
    except RecursionError:
        raise ApiError(422, "invalid_request", "body: invalid JSON (nested too deep)",
                       "body") from None
    except (UnicodeDecodeError, ValueError) as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
        raise ApiError(422, "invalid_request", f"body: invalid JSON ({reason})",
                       "body") from None
