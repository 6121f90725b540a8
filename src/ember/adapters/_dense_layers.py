"""sentence-transformers `Dense` modules: the linear layers (with an activation) some
bi-encoders put between pooling and normalizing (LaBSE, the GTR and sentence-T5 models).
Read from the module's folder, weights from safetensors (a pickle only where the spec
allows it), applied in numpy after ONNX Runtime or in torch after a torch forward."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ember.errors import ModelLoadError

Floats = npt.NDArray[np.float32]

# The activations sentence-transformers writes (the class's full name), as Ember runs them.
# A config without one means Tanh, the module's default (defaults are left out on save).
ACTIVATIONS = {"torch.nn.modules.activation.Tanh": "tanh",
               "torch.nn.modules.linear.Identity": "identity",
               "torch.nn.modules.activation.ReLU": "relu",
               "torch.nn.modules.activation.Sigmoid": "sigmoid"}
DEFAULT_ACTIVATION = "torch.nn.modules.activation.Tanh"
SAFE_WEIGHTS = "model.safetensors"
PICKLE_WEIGHTS = "pytorch_model.bin"


@dataclass(frozen=True, eq=False)
class DenseLayer:
    """out = activation(x @ weight.T + bias), as sentence-transformers' Dense."""

    weight: Floats  # (out_features, in_features)
    bias: Floats | None
    activation: str
    # The weights as tensors, per device and dtype: copied to a GPU once, not per forward.
    _tensors: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor | None]] \
        = field(default_factory=dict, repr=False)

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def arrays(self, vectors: Floats) -> Floats:
        out = vectors @ self.weight.T
        if self.bias is not None:
            out += self.bias
        return _ARRAY_ACTIVATIONS[self.activation](out)

    def tensors(self, vectors: torch.Tensor) -> torch.Tensor:
        key = (vectors.device, vectors.dtype)
        if key not in self._tensors:
            self._tensors[key] = (
                torch.from_numpy(self.weight).to(*key),
                None if self.bias is None else torch.from_numpy(self.bias).to(*key))
        out = torch.nn.functional.linear(vectors, *self._tensors[key])
        return _TORCH_ACTIVATIONS[self.activation](out)


def _sigmoid(values: Floats) -> Floats:
    out: Floats = np.reciprocal(np.float32(1) + np.exp(-values), dtype=np.float32)
    return out


# Each activation as Ember runs it on numpy arrays (in place where it can) and on tensors.
_ARRAY_ACTIVATIONS: dict[str, Callable[[Floats], Floats]] = {
    "tanh": lambda values: np.tanh(values, out=values),
    "relu": lambda values: np.maximum(values, np.float32(0), out=values),
    "sigmoid": _sigmoid,
    "identity": lambda values: values}
_TORCH_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "tanh": torch.tanh, "relu": torch.relu, "sigmoid": torch.sigmoid,
    "identity": lambda values: values}


def read_dense(folder: Path, model: str, config: dict[str, Any], in_features: int | None,
               allow_pickle: bool) -> DenseLayer:
    """The Dense module in `folder`, checked against its config and the width it is fed
    (`in_features`: the module before's; None for the first, which the adapter checks
    against the model); every refusal names the file and what to do."""
    where = f"{folder.name}/config.json"
    if config.get("use_residual"):
        raise ModelLoadError(model, f"{where}: a Dense module with a residual connection is "
                                    "not supported")
    name = str(config.get("activation_function") or DEFAULT_ACTIVATION)
    if name not in ACTIVATIONS:
        raise ModelLoadError(model, f"{where}: activation {name!r} is not supported; "
                                    f"Ember runs {sorted(ACTIVATIONS)}")
    tensors = read_weights(folder, model, allow_pickle)
    weight = tensors.get("linear.weight")
    bias = tensors.get("linear.bias") if config.get("bias", True) else None
    declared = (_count(config, "out_features", where, model),
                _count(config, "in_features", where, model))
    if weight is None or weight.ndim != 2 or tuple(weight.shape) != declared:
        shape = None if weight is None else tuple(weight.shape)
        raise ModelLoadError(model, f"{folder.name}: linear.weight has shape {shape}, but "
                                    f"its config says (out_features, in_features) = {declared}")
    if in_features is not None and declared[1] != in_features:
        raise ModelLoadError(model, f"{where}: in_features is {declared[1]}, but the module "
                                    f"before it gives {in_features}")
    if bias is not None and tuple(bias.shape) != (declared[0],):
        raise ModelLoadError(model, f"{folder.name}: linear.bias has shape "
                                    f"{tuple(bias.shape)}, expected ({declared[0]},)")
    return DenseLayer(np.ascontiguousarray(weight, dtype=np.float32),
                      None if bias is None else np.ascontiguousarray(bias, dtype=np.float32),
                      ACTIVATIONS[name])


def _count(config: dict[str, Any], key: str, where: str, model: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelLoadError(model, f"{where}: {key} is {value!r}, where a whole number >= 1 "
                                    "is expected")
    return value


def read_weights(folder: Path, model: str, allow_pickle: bool, safe_name: str = SAFE_WEIGHTS,
                 pickle_name: str = PICKLE_WEIGHTS) -> dict[str, Floats]:
    """The tensors of `safe_name` in `folder`, else of the pickle `pickle_name` where the
    spec allows pickles (through torch's weights-only unpickler), as float32 arrays."""
    safe, pickled = folder / safe_name, folder / pickle_name
    if safe.is_file():
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        try:  # the library checks the header's size and every offset against the file
            return dict(load_file(str(safe)))
        except SafetensorError as error:
            raise ModelLoadError(model, f"{folder.name}/{safe_name} is not a readable "
                                        f"safetensors file: {error}") from None
    if pickled.is_file():
        if not allow_pickle:
            raise ModelLoadError(model, f"{folder.name}/{pickle_name} is a pickle; Ember "
                                        "loads it only where the model's spec sets "
                                        "allow_pickle: true (a pickle can run code when "
                                        "loaded), or convert it to safetensors")
        try:  # torch's weights-only unpickler: tensors and plain containers, nothing callable
            state = torch.load(str(pickled), map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as error:
            raise ModelLoadError(model, f"{folder.name}/{pickle_name} was refused by "
                                        f"torch's weights-only unpickler: {error}") from error
        if not isinstance(state, dict):
            raise ModelLoadError(model, f"{folder.name}/{pickle_name} holds no state dict")
        return {str(k): v.float().numpy() for k, v in state.items()
                if isinstance(v, torch.Tensor)}
    raise ModelLoadError(model, f"{folder.name} holds no weights ({safe_name} or "
                                f"{pickle_name}); a Hub download fetches a pickle only "
                                "where the spec sets allow_pickle: true")
