"""Which backend runs a model's forward half, and loading it.

A family loads through `load_model`: the tokenizer and config are read the same way
for every backend; the forward comes from torch (`_torch.TorchForward`) or ONNX
Runtime (`_onnx.OnnxForward`), which the family calls alike: padded inputs in, one
named output tensor out.

The choice: a model's YAML `backend:` is obeyed, and refused where it cannot hold
(onnx with LoRAs, or off CPU). Otherwise the server-wide `--backend` applies to the
models it can run (CPU, no LoRAs); the others run on torch, and the log says why.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from ember.adapters import _torch as common
from ember.adapters.base import Runtime, check_lora
from ember.config import Backend, ModelSpec
from ember.errors import ModelLoadError

log = logging.getLogger("ember.backend")
FEEDABLE = ("input_ids", "attention_mask", "token_type_ids")
NO_WEIGHTS = "this process holds no weights: the engine process runs the forwards"


class Forward(Protocol):
    """A model's forward half, on either backend."""

    backend: str
    loras: tuple[str, ...]

    def __call__(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor: ...

    def run_arrays(self, inputs: Mapping[str, npt.NDArray[np.int64]]) -> npt.NDArray[Any]:
        """The same forward over numpy inputs, its output on the CPU as numpy."""
        ...

    def set_lora(self, name: str | None) -> None: ...

    def check_lora(self, name: str | None, param: str = "params.options.lora") -> None: ...

    def memory_bytes(self) -> int: ...

    def close(self) -> None: ...


def choose_backend(spec: ModelSpec, runtime: Runtime) -> Backend:
    """The backend a model runs on (see the module's docstring); `quantize` asks for
    onnx as `backend: onnx` does."""
    wanted = spec.backend or ("onnx" if spec.quantize else None)
    if wanted == "torch" and spec.quantize:
        raise ModelLoadError(spec.name, "quantize applies to the onnx backend; remove it "
                                        "or set backend: onnx")
    if wanted == "onnx":
        if spec.loras:
            raise ModelLoadError(spec.name, "LoRA adapters need backend: torch (the onnx "
                                            "backend, which quantize implies, runs the "
                                            "base model only)")
        return "onnx"
    if wanted == "torch" or runtime.backend == "torch":
        return "torch"
    if spec.loras or not runtime.device.startswith("cpu"):
        why = "it has LoRA adapters" if spec.loras else f"device {runtime.device}"
        log.info("%s: torch backend (%s; onnx runs base models on CPU)", spec.name, why)
        return "torch"
    return "onnx"


class ForwardElsewhere:
    """The forward half as an API process knows it when the engine process runs it: its
    backend and LoRAs (so requests are checked here), and no weights."""

    def __init__(self, backend: Backend, loras: Sequence[str]) -> None:
        self.backend: str = backend
        self.loras: tuple[str, ...] = tuple(loras)

    def __call__(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        raise RuntimeError(NO_WEIGHTS)

    def run_arrays(self, inputs: Mapping[str, npt.NDArray[np.int64]]) -> npt.NDArray[Any]:
        raise RuntimeError(NO_WEIGHTS)

    def set_lora(self, name: str | None) -> None:
        raise RuntimeError(NO_WEIGHTS)

    def check_lora(self, name: str | None, param: str = "params.options.lora") -> None:
        check_lora(name, self.loras, param)

    def memory_bytes(self) -> int:
        return 0

    def close(self) -> None:
        """Nothing to release."""


def load_model(spec: ModelSpec, model_dir: Path, runtime: Runtime, auto_class: Any,
               output: str, inputs: Sequence[str] = FEEDABLE[:2], weights: bool = True
               ) -> tuple[Forward, Any, Any]:
    """The forward half, the config and the fast tokenizer of a transformers directory,
    offline. `auto_class` builds the torch model; `output` names the model output the
    family reads; `inputs` are what its forward feeds (those the tokenizer makes).
    Without `weights` (an API process of several), the forward half stays elsewhere."""
    tokenizer = common.load_tokenizer(spec, model_dir)
    backend = choose_backend(spec, runtime)
    if not weights:
        config = common.load_config(spec, model_dir)
        return ForwardElsewhere(backend, tuple(spec.loras)), config, tokenizer
    if backend == "torch":
        common.apply_runtime(runtime)
        model = auto_class.from_pretrained(str(model_dir), **common.load_kwargs(spec))
        return common.TorchForward(model, spec.loras, runtime, output), model.config, tokenizer
    from ember.adapters import _onnx

    config = common.load_config(spec, model_dir)
    made = set(tokenizer.model_input_names)
    feeds = tuple(n for n in inputs if n in made or n in FEEDABLE[:2])

    def load_torch() -> torch.nn.Module:
        # Eager attention traces to a graph onnxruntime's optimizer fuses.
        model: torch.nn.Module = auto_class.from_pretrained(
            str(model_dir), attn_implementation="eager", **common.load_kwargs(spec))
        return model

    plan = _onnx.ExportPlan(feeds, output, config, load_torch)
    forward = _onnx.load(spec, model_dir, runtime, plan)
    common.apply_runtime_around_onnx(runtime)
    return forward, config, tokenizer
