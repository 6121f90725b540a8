"""What crosses the process boundary: msgpack frames, numpy arrays as raw bytes.

Two extension types carry what plain msgpack cannot: a numpy array (dtype, shape and
its bytes, no copy into lists) and a frozen dataclass of Ember's own (parameter
groups, token pairs, entities, sparse vectors), rebuilt from its fields. Lists come
back as tuples, so parameter groups stay hashable (R6).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import msgpack
import numpy as np

from ember.engine import QueueFull, RequestTooLarge, ShuttingDown, WorkerFailed
from ember.errors import InputTooLong, InvalidInput, ModelLoadError, ModelNotFound, UnsupportedTask

EXT_ARRAY = 1
EXT_DATACLASS = 2
_PACKAGE = "ember."  # only Ember's own classes are rebuilt from the wire


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
        kind = type(value)
        if not kind.__module__.startswith(_PACKAGE):
            raise TypeError(f"{kind.__qualname__} is not one of Ember's wire types")
        fields = [getattr(value, f.name) for f in dataclasses.fields(value)]
        return msgpack.ExtType(EXT_DATACLASS, pack([f"{kind.__module__}:{kind.__qualname__}",
                                                    fields]))
    raise TypeError(f"{type(value).__name__} cannot cross the process boundary")


def _ext_hook(code: int, data: bytes) -> Any:
    if code == EXT_ARRAY:
        dtype, shape, raw = msgpack.unpackb(data, raw=False)
        return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape)
    if code == EXT_DATACLASS:
        name, fields = unpack(data)
        return _class(name)(*fields)
    return msgpack.ExtType(code, data)


def _class(name: str) -> type:
    module, _, qualname = name.partition(":")
    if not module.startswith(_PACKAGE):
        raise ValueError(f"refusing to rebuild {name!r}: not one of Ember's classes")
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
        body["args"] = [exc.name, exc.available]
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
        "InvalidInput": InvalidInput, "InputTooLong": InputTooLong, "ModelNotFound": ModelNotFound,
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
