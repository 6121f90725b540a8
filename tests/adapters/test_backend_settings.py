"""The backend settings: the YAML fields, the flags and variables, the Runtime they
make, and which backend each kind of model gets."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ember.adapters._backend import choose_backend
from ember.adapters._onnx import session_options
from ember.adapters.base import (
    Runtime,
    default_onnx_threads,
    default_threads,
    forward_fills_cores,
    usable_cores,
)
from ember.cli import build_parser, main, settings_from
from ember.config import CatalogError, ModelSpec, Source, Spinning, parse_spec
from ember.errors import ModelLoadError

BASE = {"name": "me/model", "adapter": "transformer", "source": {"path": "/m"},
        "tasks": ["encode"]}
PLAIN = ModelSpec("me/model", "transformer", Source(path=Path("/m")), ("encode",))
WITH_LORA = dataclasses.replace(PLAIN, loras={"a": Path("/lora")})


def test_the_yaml_fields() -> None:
    spec = parse_spec({**BASE, "backend": "onnx", "quantize": "int8"}, "x.yaml")
    assert spec.backend == "onnx" and spec.quantize == "int8"
    assert parse_spec(BASE, "x.yaml").backend is None
    with pytest.raises(CatalogError, match="backend 'tensorrt' is unknown"):
        parse_spec({**BASE, "backend": "tensorrt"}, "x.yaml")
    with pytest.raises(CatalogError, match="quantize 'int4' is unknown"):
        parse_spec({**BASE, "quantize": "int4"}, "x.yaml")


def test_flags_and_variables_make_the_runtime(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    for name in ("EMBER_BACKEND", "EMBER_CACHE_DIR", "EMBER_ONNX_THREADS",
                 "EMBER_ONNX_SPINNING", "EMBER_TORCH_THREADS"):
        monkeypatch.delenv(name, raising=False)
    default = Runtime.from_settings(settings_from(build_parser().parse_args(["serve"])))
    assert default == Runtime()
    assert default.backend == "onnx" and default.onnx_spinning == "forward"
    flags = ["serve", "--backend", "torch", "--cache-dir", str(tmp_path), "--onnx-threads",
             "3", "--onnx-spinning", "--torch-threads", "2"]
    runtime = Runtime.from_settings(settings_from(build_parser().parse_args(flags)))
    assert runtime == Runtime("cpu", 2, "torch", tmp_path, 3, "on")
    off = settings_from(build_parser().parse_args(["serve", "--onnx-spinning", "off"]))
    assert off.onnx_spinning == "off"
    monkeypatch.setenv("EMBER_BACKEND", "torch")
    monkeypatch.setenv("EMBER_ONNX_SPINNING", "1")  # yes/no words, as before
    from_env = settings_from(build_parser().parse_args(["serve"]))
    assert from_env.backend == "torch" and from_env.onnx_spinning == "on"
    monkeypatch.setenv("EMBER_ONNX_SPINNING", "no")
    assert settings_from(build_parser().parse_args(["serve"])).onnx_spinning == "off"


def test_a_bad_spinning_mode_is_refused(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--onnx-spinning", "sometimes"])
    assert "invalid choice: 'sometimes'" in capsys.readouterr().err
    monkeypatch.setenv("EMBER_ONNX_SPINNING", "sometimes")
    assert main(["serve"]) == 2
    assert "EMBER_ONNX_SPINNING) 'sometimes' is not one of" in capsys.readouterr().err


def test_a_bad_batching_limit_is_refused_with_its_name(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--max-batch-items", "0"]) == 2  # an exit, not a traceback
    assert "--max-batch-items must be >= 1, got 0 (or EMBER_MAX_BATCH_ITEMS)" in \
        capsys.readouterr().err


@pytest.mark.parametrize(("mode", "spinning", "stop"), [
    ("off", "0", "0"), ("forward", "1", "1"), ("on", "1", "0")])
def test_each_spinning_mode_sets_the_session_options(mode: Spinning, spinning: str,
                                                     stop: str) -> None:
    options = session_options(Runtime(onnx_spinning=mode, onnx_threads=2))
    assert options.intra_op_num_threads == 2
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == spinning
    assert options.get_session_config_entry("session.force_spinning_stop") == stop


def test_a_bad_backend_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--backend", "tensorrt"])
    assert "invalid choice: 'tensorrt'" in capsys.readouterr().err


def test_torch_threads_default_to_all_cores_but_one_and_onnx_threads_to_every_core() -> None:
    assert default_threads() == max(1, usable_cores() - 1)
    assert default_onnx_threads() == usable_cores()


@pytest.mark.parametrize(("spec", "runtime", "backend"), [
    (PLAIN, Runtime(), "onnx"),
    (PLAIN, Runtime(backend="torch"), "torch"),
    (PLAIN, Runtime(device="cuda"), "torch"),  # the server's preference, off CPU
    (WITH_LORA, Runtime(), "torch"),  # LoRAs fall back to torch
    (dataclasses.replace(PLAIN, backend="torch"), Runtime(), "torch"),
    (dataclasses.replace(PLAIN, backend="onnx"), Runtime(backend="torch"), "onnx"),
    (dataclasses.replace(PLAIN, quantize="int8"), Runtime(backend="torch"), "onnx"),
])
def test_which_backend_a_model_gets(spec: ModelSpec, runtime: Runtime, backend: str) -> None:
    assert choose_backend(spec, runtime) == backend


@pytest.mark.parametrize(("spec", "message"), [
    (dataclasses.replace(WITH_LORA, backend="onnx"), "LoRA adapters need backend: torch"),
    (dataclasses.replace(WITH_LORA, quantize="int8"), "LoRA adapters need backend: torch"),
    (dataclasses.replace(PLAIN, backend="torch", quantize="int8"),
     "quantize applies to the onnx backend"),
])
def test_contradictions_are_refused(spec: ModelSpec, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        choose_backend(spec, Runtime())


def test_a_forward_fills_the_cores_with_a_thread_on_each_on_cpu_only() -> None:
    cores = usable_cores()
    assert forward_fills_cores(Runtime(), "onnx")  # ONNX Runtime's default: every core
    assert forward_fills_cores(Runtime(onnx_threads=cores), "onnx")
    assert forward_fills_cores(Runtime(torch_threads=cores), "torch")
    assert forward_fills_cores(Runtime(), "torch") is (cores == 1)  # torch leaves one free
    if cores > 1:
        assert not forward_fills_cores(Runtime(onnx_threads=cores - 1), "onnx")
    assert not forward_fills_cores(Runtime(device="cuda", torch_threads=cores), "torch")


def test_torch_runs_one_thread_around_onnx_forwards(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from ember.adapters import _torch, transformer
    from ember.config import load_catalog

    before = torch.get_num_threads()
    monkeypatch.setattr(_torch, "_torch_forwards", False)  # no torch model loaded yet
    try:
        torch.set_num_threads(2)
        model = transformer.load(load_catalog()["sentence-transformers/all-MiniLM-L6-v2"],
                                 Runtime())
        assert model.model.backend == "onnx"
        assert torch.get_num_threads() == 1  # no OpenMP team spinning beside ORT's threads
        torch.set_num_threads(2)
        _torch.apply_runtime_around_onnx(Runtime(torch_threads=2))  # set by hand: kept
        assert torch.get_num_threads() == 2
        _torch.apply_runtime(Runtime(torch_threads=2))  # a torch model: its setting stays
        _torch.apply_runtime_around_onnx(Runtime())
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("flag", ["--request-timeout-s", "--max-batch-wait-ms",
                                  "--max-padding", "--idle-coalesce-ms", "--lead-ratio"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_number_flag_refuses_nan_and_infinity(flag: str, value: str,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a black-box review: `--request-timeout-s nan` started a server whose
    timeout was ignored, and logged a traceback for each slow request."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", flag, value])
    assert f"argument {flag}: invalid number value: '{value}'" in capsys.readouterr().err
    monkeypatch.setenv("EMBER_" + flag[2:].replace("-", "_").upper(), value)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve"])
    assert f"={value!r} is not a valid number" in capsys.readouterr().err
