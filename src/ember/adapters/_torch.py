"""What the torch families share: loading weights safely, LoRA switching,
dynamic padding, token-budget checks and the device."""

from __future__ import annotations

import gc
import json
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ember.adapters.base import Runtime
from ember.config import ModelSpec
from ember.errors import InvalidInput, ModelLoadError


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def apply_runtime(runtime: Runtime) -> None:
    """Set the torch thread count if asked (process-wide, as torch has it)."""
    if runtime.torch_threads:
        torch.set_num_threads(runtime.torch_threads)


def load_kwargs(spec: ModelSpec) -> dict[str, Any]:
    """from_pretrained arguments every family uses: offline, safetensors unless allowed."""
    return {
        "local_files_only": True,
        "trust_remote_code": spec.trust_remote_code,
        # None lets transformers fall back to a pickle checkpoint; True refuses one.
        "use_safetensors": None if spec.allow_pickle else True,
    }


def place(model: torch.nn.Module, runtime: Runtime) -> torch.nn.Module:
    """Move to the runtime's device (fp16 on CUDA) in eval mode."""
    if runtime.half:
        model = model.half()
    return model.to(torch.device(runtime.device)).eval()


def model_max_length(spec: ModelSpec, config: Any, tokenizer: Any,
                     configured: int | None = None) -> int:
    """The token limit: the spec's, else the model directory's, within the positions."""
    positions = getattr(config, "max_position_embeddings", None)
    limit = spec.max_seq_length or configured
    if limit is None:
        tok_limit = getattr(tokenizer, "model_max_length", None)
        # Tokenizers without a limit report a huge sentinel (1e30).
        limit = tok_limit if tok_limit and tok_limit < 1_000_000 else positions
    if limit is None:
        raise ModelLoadError(spec.name, "no max_seq_length in the spec or the model directory")
    if positions is not None and limit > positions:
        raise ModelLoadError(spec.name, f"max_seq_length {limit} exceeds the model's "
                                        f"{positions} position embeddings")
    return int(limit)


class LoraSet:
    """The model with its PEFT LoRA adapters, on the runtime's device; `None` (the
    base) is active after loading."""

    def __init__(self, model: torch.nn.Module, loras: Mapping[str, Path],
                 runtime: Runtime) -> None:
        self.names: tuple[str, ...] = tuple(loras)
        self.active: str | None = None
        self._peft: Any = None
        if loras:
            model = self._attach(model, loras)
        # Placed after the adapters attach, so base and adapters share device and dtype.
        self.model = place(model, runtime)

    def _attach(self, model: torch.nn.Module, loras: Mapping[str, Path]) -> torch.nn.Module:
        from peft import PeftModel  # only models with adapters pay for the import

        for name, path in loras.items():
            # A path PEFT cannot find locally would be taken for a hub id and fetched.
            if not (Path(path) / "adapter_config.json").is_file():
                raise FileNotFoundError(f"LoRA {name!r}: {path} is not a PEFT adapter "
                                        f"directory (no adapter_config.json)")
        first, *rest = self.names
        with warnings.catch_warnings():
            # peft 0.21 reads an attribute transformers 5 deprecated; nothing to act on.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing",
                                    category=FutureWarning)
            peft_model = PeftModel.from_pretrained(model, str(loras[first]),
                                                   adapter_name=first)
        for name in rest:
            peft_model.load_adapter(str(loras[name]), adapter_name=name)
        self._peft = peft_model
        # The worker assumes the base is active until it first calls set_lora.
        self._peft.base_model.disable_adapter_layers()
        return peft_model

    def set(self, name: str | None) -> None:
        if name == self.active:
            return
        if name is None:
            self._peft.base_model.disable_adapter_layers()
        else:
            if name not in self.names:
                raise KeyError(f"unknown LoRA {name!r}; known: {', '.join(self.names)}")
            self._peft.base_model.enable_adapter_layers()
            self._peft.set_adapter(name)
        self.active = name

    def close(self) -> None:
        """Drop the weights; the adapter is unusable afterwards."""
        self.model = torch.nn.Module()
        self._peft = None

    def check(self, name: str | None, param: str = "params.options.lora") -> None:
        """Refuse a request naming a LoRA this model does not have."""
        if name is None or name in self.names:
            return
        known = ", ".join(self.names) if self.names else "none (this model has no LoRA adapters)"
        raise InvalidInput(f"unknown LoRA {name!r}; known LoRAs: {known}", param)


def pad(rows: Sequence[Sequence[int]], value: int, device: torch.device) -> torch.Tensor:
    """Right-pad rows of token ids to the longest row (dynamic padding)."""
    longest = max(len(row) for row in rows)
    out = torch.full((len(rows), longest), value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, dtype=torch.long)
    return out.to(device)


def attention_mask(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    longest = max(len(row) for row in rows)
    lengths = torch.tensor([len(row) for row in rows])
    return (torch.arange(longest)[None, :] < lengths[:, None]).long().to(device)


def over_limit(count: int, limit: int, param: str) -> InvalidInput:
    return InvalidInput(f"{count} tokens exceeds max_seq_length {limit}; shorten the text "
                        f"or set truncate=true", param)


def require_items(count: int, param: str = "items") -> None:
    if count == 0:
        raise InvalidInput("at least one item is required; send 1 or more texts", param)


def module_bytes(model: torch.nn.Module) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
