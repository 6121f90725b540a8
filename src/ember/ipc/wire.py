"""What crosses the process boundary: msgpack frames, numpy arrays as raw bytes.

Two extension types carry what plain msgpack cannot: a numpy array (dtype, shape and
its bytes, no copy into lists) and a frozen dataclass of Ember's own (parameter
groups, token pairs, entities, sparse vectors), rebuilt from its fields. Lists come
back as tuples, so parameter groups stay hashable (R6).

What `unpack` accepts, and nothing else: msgpack's own types; an array of a numeric or
boolean dtype whose bytes match its shape; one of the dataclasses named in `WIRE_TYPES`
(its module is imported only then). Anything else (an object or unknown dtype, another
class, an unknown extension type) raises ValueError before anything is built.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from typing import Any

import msgpack
import numpy as np

from ember.engine import QueueFull, RequestTooLarge, ShuttingDown, WorkerFailed
from ember.errors import (
    InputTooLong,
    InvalidInput,
    ModelLoadError,
    ModelNotFound,
    UnsupportedOutput,
    UnsupportedTask,
)

EXT_ARRAY = 1
EXT_DATACLASS = 2
# The dataclasses that cross the wire, by module and name: parameter groups, payloads,
# results and model facts. No other class is ever imported or built from a frame.
WIRE_TYPES = frozenset({
    "ember.adapters.base:EncodeOptions", "ember.adapters.base:ScoreOptions",
    "ember.adapters.base:ExtractOptions", "ember.adapters.base:SparseVector",
    "ember.adapters.base:Encoded", "ember.adapters.base:Entity",
    "ember.adapters.base:TaskOutput", "ember.adapters.base:ModelInfo",
    "ember.adapters.clip:ClipParams", "ember.adapters.gliner:GlinerParams",
    "ember.adapters.gliner:Words",
    "ember.adapters.cross_encoder:ScoreParams", "ember.adapters.cross_encoder:Pair",
    "ember.adapters.multivector:MultiVectorParams", "ember.adapters.multivector:TokenRow",
    "ember.adapters.m3:M3Params",
    "ember.adapters.spacy_ner:NerParams", "ember.adapters.sparse:SparseParams",
    "ember.adapters.sparse:Pruning", "ember.adapters.transformer:EncodeParams",
    "ember.outputs:Quantized",
})
ARRAY_KINDS = frozenset("biufc")  # bool, signed, unsigned, float, complex: never objects
MAX_DIMS = 32  # an array's dimensions at most (numpy's own limit is 64)


def pack(value: Any) -> bytes:
    data: bytes = msgpack.packb(value, default=_default, use_bin_type=True)
    return data


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, use_list=False,
                           strict_map_key=False)


def _default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        return msgpack.ExtType(EXT_ARRAY, msgpack.packb(
            [array.dtype.str, list(array.shape), array.tobytes()], use_bin_type=True))
    if isinstance(value, np.generic):
        return value.item()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [getattr(value, f.name) for f in dataclasses.fields(value)]
        return msgpack.ExtType(EXT_DATACLASS, pack([wire_name(type(value)), fields]))
    raise TypeError(f"{type(value).__name__} cannot cross the process boundary")


def wire_name(kind: type) -> str:
    """The name a dataclass crosses the wire by; TypeError for one not in WIRE_TYPES."""
    name = f"{kind.__module__}:{kind.__qualname__}"
    if name not in WIRE_TYPES:
        raise TypeError(f"{kind.__qualname__} is not one of Ember's wire types "
                        "(ember.ipc.wire.WIRE_TYPES)")
    return name


def _ext_hook(code: int, data: bytes) -> Any:
    if code == EXT_ARRAY:
        return _array(data)
    if code == EXT_DATACLASS:
        name, fields = unpack(data)
        if not isinstance(fields, tuple):
            raise ValueError(f"the fields of {name!r} are not a list")
        return wire_class(name)(*fields)
    raise ValueError(f"unknown extension type {code} on the wire")


def _array(data: bytes) -> np.ndarray:
    dtype_name, shape, raw = msgpack.unpackb(data, raw=False, use_list=False)
    if not isinstance(dtype_name, str) or not isinstance(raw, bytes):
        raise ValueError("a wire array needs a dtype name and its bytes")
    dtype = _wire_dtype(dtype_name)
    if len(shape) > MAX_DIMS or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise ValueError(f"bad array shape {str(shape)[:80]}")
    # Python's integers, exact whatever the shape (numpy's prod: 3 us a call, and int64)
    if math.prod(shape) * dtype.itemsize != len(raw):
        raise ValueError(f"array bytes ({len(raw)}) do not match shape {shape!r}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


@functools.lru_cache(maxsize=64)  # a few dtypes cross; a new np.dtype costs each array 1 us
def _wire_dtype(name: str) -> np.dtype[Any]:
    dtype = np.dtype(name)
    if dtype.kind not in ARRAY_KINDS or dtype.hasobject or dtype.fields is not None:
        raise ValueError(f"refusing an array of dtype {name!r}: numeric dtypes only")
    return dtype


def wire_class(name: str) -> type:
    """The dataclass a wire name names; ValueError for any name not in WIRE_TYPES."""
    if not isinstance(name, str) or name not in WIRE_TYPES:
        raise ValueError(f"refusing to rebuild {name!r}: not one of Ember's wire types")
    module, _, qualname = name.partition(":")
    kind = getattr(importlib.import_module(module), qualname)
    if not (isinstance(kind, type) and dataclasses.is_dataclass(kind)):
        raise ValueError(f"{name!r} is not a dataclass")
    return kind


class RemoteFault(Exception):
    """An unexpected error raised in the engine process, named by its original type."""

    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind
        super().__init__(f"{kind}: {message}")


def error_to_wire(exc: BaseException) -> dict[str, Any]:
    """An exception as fields the other side can rebuild it from (`error_from_wire`)."""
    kind = type(exc).__name__
    body: dict[str, Any] = {"type": kind, "message": str(exc)}
    if isinstance(exc, InvalidInput):
        body["args"] = [exc.message, exc.param]
    elif isinstance(exc, ModelNotFound):
        body["args"] = [exc.name, exc.available, exc.why, exc.hint]
    elif isinstance(exc, ModelLoadError):
        body["args"] = [exc.name, exc.cause]
    elif isinstance(exc, UnsupportedTask):
        body["args"] = [exc.model, exc.task, list(exc.tasks)]
    elif isinstance(exc, QueueFull):
        body["args"] = [exc.pending, exc.requested, exc.limit]
    elif isinstance(exc, RequestTooLarge):
        body["args"] = [exc.requested, exc.limit]
    elif isinstance(exc, WorkerFailed):
        body["args"] = [exc.name, type(exc.cause).__name__, str(exc.cause)]
    elif isinstance(exc, ShuttingDown | TimeoutError):
        body["args"] = []
    return body


def error_from_wire(body: dict[str, Any]) -> Exception:
    kinds: dict[str, type[Exception]] = {
        "InvalidInput": InvalidInput, "InputTooLong": InputTooLong,
        "UnsupportedOutput": UnsupportedOutput, "ModelNotFound": ModelNotFound,
        "ModelLoadError": ModelLoadError, "UnsupportedTask": UnsupportedTask,
        "QueueFull": QueueFull, "RequestTooLarge": RequestTooLarge,
        "ShuttingDown": ShuttingDown, "TimeoutError": TimeoutError}
    if body["type"] == "WorkerFailed":
        name, cause_kind, cause_message = body["args"]
        # The cause keeps its own type's name, as the engine process saw it.
        return WorkerFailed(name, type(cause_kind, (Exception,), {})(cause_message))
    kind = kinds.get(body["type"])
    if kind is not None and "args" in body:
        return kind(*body["args"])
    return RemoteFault(body["type"], body["message"])
