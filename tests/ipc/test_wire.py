"""What crosses the process boundary comes back as it went: arrays, Ember's dataclasses,
hashable parameter groups, and errors with their HTTP meaning."""

from __future__ import annotations

import dataclasses
import importlib
import pickle
import sys
from typing import Any

import msgpack
import numpy as np
import pytest

from ember.adapters.base import Entity, ModelInfo, SparseVector
from ember.adapters.cross_encoder import Pair, ScoreParams
from ember.adapters.transformer import EncodeParams
from ember.api.errors import as_api_error
from ember.engine import QueueFull, RequestTooLarge, ShuttingDown, WorkerFailed
from ember.errors import (
    InputTooLong,
    InvalidInput,
    ModelLoadError,
    ModelNotFound,
    UnsupportedOutput,
    UnsupportedTask,
)
from ember.ipc.wire import (
    WIRE_TYPES,
    RemoteFault,
    error_from_wire,
    error_to_wire,
    pack,
    unpack,
)


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8", "uint8", "int64"])
def test_arrays_keep_dtype_shape_and_values(dtype: str) -> None:
    array = (np.arange(24).reshape(2, 3, 4) - 7).astype(dtype)
    back = unpack(pack({"v": array}))["v"]
    assert back.dtype == array.dtype and back.shape == array.shape
    np.testing.assert_array_equal(back, array)


def test_a_non_contiguous_array_goes_as_its_values() -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4)[:, 1]
    np.testing.assert_array_equal(unpack(pack(array)), array)


def test_embers_dataclasses_are_rebuilt_and_parameter_groups_stay_hashable() -> None:
    params = EncodeParams("query: ", True, ("dense",))
    values = [params, ScoreParams("sigmoid"), Pair([101, 7, 102], None),
              Entity("Paris", "GPE", 0, 5, 1.0),
              SparseVector(np.array([3, 9], np.int32), np.array([0.5, 0.25], np.float32), 30),
              ModelInfo("m", ("encode",), 8, extra={"prompts": {"query": "q: "}})]
    back = unpack(pack(values))
    assert back[0] == params and hash(back[0]) == hash(params)
    assert back[1] == ScoreParams("sigmoid")
    assert list(back[2].input_ids) == [101, 7, 102] and back[2].token_type_ids is None
    assert back[3] == values[3]
    np.testing.assert_array_equal(back[4].indices, values[4].indices)
    assert back[4].dims == 30
    assert back[5].extra == {"prompts": {"query": "q: "}}


def test_only_embers_own_classes_are_rebuilt() -> None:
    @dataclasses.dataclass
    class Foreign:
        x: int

    with pytest.raises(TypeError, match="not one of Ember's wire types"):
        pack(Foreign(1))
    forged = msgpack.ExtType(2, pack(["os:system", ["true"]]))
    with pytest.raises(ValueError, match="not one of Ember's wire types"):
        unpack(msgpack.packb(forged))


@pytest.mark.parametrize("name", [
    "ember.config:ServerSettings",  # an Ember dataclass, but not a wire type
    "ember.supervisor:Supervisor",  # an Ember class whose module has side effects
    "ember.cli:main",
    "ember.adapters.transformer:EncodeParams.__init__",
])
def test_no_class_off_the_allow_list_is_imported_or_built(name: str) -> None:
    forged = msgpack.packb(msgpack.ExtType(2, pack([name, []])))
    modules = set(sys.modules)
    with pytest.raises(ValueError, match="not one of Ember's wire types"):
        unpack(forged)
    assert set(sys.modules) == modules  # refused before any import


def _array_frame(dtype: str, shape: list[int], raw: bytes) -> bytes:
    body = msgpack.packb([dtype, shape, raw], use_bin_type=True)
    return msgpack.packb(msgpack.ExtType(1, body), use_bin_type=True)


@pytest.mark.parametrize(("frame", "why"), [
    (_array_frame("|O", [1], pickle.dumps(["x"])[:8]), "numeric dtypes only"),  # object
    (_array_frame("|V8", [1], b"\0" * 8), "numeric dtypes only"),
    (_array_frame("<U2", [1], b"\0" * 8), "numeric dtypes only"),
    (_array_frame("<f4", [2**31], b"\0" * 8), "do not match"),  # a size it does not have
    (_array_frame("<f4", [-2, -2], b"\0" * 16), "bad array shape"),
    (_array_frame("<f4", [2**32, 2**32], b""), "do not match"),  # 2**64: 0 in int64
    (_array_frame("<f4", [1] * 33, b"\0" * 4), "bad array shape"),  # past MAX_DIMS
    (msgpack.packb(msgpack.ExtType(42, b"anything")), "unknown extension type 42"),
])
def test_hostile_frames_are_refused(frame: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        unpack(frame)


def test_every_wire_type_exists_and_is_a_dataclass() -> None:
    for name in WIRE_TYPES:
        module, _, qualname = name.partition(":")
        kind = getattr(importlib.import_module(module), qualname)
        assert dataclasses.is_dataclass(kind), name


ERRORS: list[tuple[Exception, int, str]] = [
    (InvalidInput("not a label; use one of a, b", "params.labels[0]"), 422,
     "invalid_request"),
    (InputTooLong("600 tokens exceeds max_seq_length 256", "items[2].text"), 400,
     "input_too_long"),
    (UnsupportedOutput("output_types ['sparse'] not supported", "params.output_types"), 422,
     "unsupported_output"),
    (ModelNotFound("nope", ["a", "b"]), 404, "model_not_found"),
    (ModelNotFound("org/x", ["a"], hint="start it with --model org/x; "), 404,
     "model_not_found"),
    (ModelLoadError("m", "weights missing"), 502, "model_load_failed"),
    (UnsupportedTask("m", "extract", ("encode",)), 422, "unsupported_task"),
    (QueueFull(4000, 200, 4096), 429, "queue_full"),
    (RequestTooLarge(5000, 4096), 413, "payload_too_large"),
    (ShuttingDown(), 503, "unavailable"),
    (TimeoutError(), 504, "timeout"),
    (WorkerFailed("m", KeyError("boom")), 503, "unavailable"),
    (ZeroDivisionError("division by zero"), 500, "inference_error"),
]


@pytest.mark.parametrize(("error", "status", "kind"), ERRORS,
                         ids=[type(e).__name__ for e, *_ in ERRORS])
def test_errors_keep_their_meaning_across_the_boundary(error: Exception, status: int,
                                                       kind: str) -> None:
    back = error_from_wire(unpack(pack(error_to_wire(error))))
    local, remote = as_api_error(error), as_api_error(back)
    assert (remote.status, remote.kind, remote.param) == (status, kind, local.param)
    assert remote.message == local.message


def test_an_unexpected_fault_is_named_by_its_original_type() -> None:
    back: Any = error_from_wire(error_to_wire(RuntimeError("CUDA out of memory")))
    assert isinstance(back, RemoteFault)
    assert as_api_error(back).message == "inference failed: RuntimeError: CUDA out of memory"


def test_every_familys_parameter_group_is_a_wire_type() -> None:
    """A family whose parameter group is missing from the allow-list works in one process
    and fails every request under --workers N: each `*Params` dataclass must be listed."""
    import dataclasses
    import importlib
    import pkgutil

    import ember.adapters
    from ember.ipc.wire import WIRE_TYPES

    found = set()
    for module_info in pkgutil.iter_modules(ember.adapters.__path__):
        module = importlib.import_module(f"ember.adapters.{module_info.name}")
        for name, value in vars(module).items():
            if (name.endswith("Params") and dataclasses.is_dataclass(value)
                    and value.__module__ == module.__name__):
                found.add(f"{module.__name__}:{name}")
    assert {"ember.adapters.clip:ClipParams", "ember.adapters.gliner:GlinerParams"} <= found
    assert found <= WIRE_TYPES, sorted(found - WIRE_TYPES)


def test_a_models_dispatch_crosses_as_plain_values() -> None:
    """The status's learned cost and windows need no wire type: plain maps and numbers."""
    from ember.engine import WorkerConfig
    from ember.engine.policy import DispatchPolicy

    policy = DispatchPolicy(WorkerConfig())
    for tokens in range(10, 400, 10):
        policy.observe(None, tokens, tokens, 1, 0.002 + tokens * 1e-6)
        policy.observe("a-lora", tokens, tokens, 1, 0.004 + tokens * 1e-6)
    described = policy.describe()
    assert described["cost"] is not None and "a-lora" in described["loras"]
    assert unpack(pack(described)) == described
