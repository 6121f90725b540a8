"""Bi-encoders: a sentence-transformers model directory run through transformers.

The directory's own settings (modules.json, 1_Pooling/config.json, the
Normalize module, sentence_bert_config.json's max_seq_length, the prompts of
config_sentence_transformers.json) apply unless the spec overrides them.
Pooling is mean or CLS over the attention mask, optionally L2-normalized.
`score` is the cosine of the query's vector and each document's.
LoRA adapters (PEFT) switch per forward through `set_lora`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from ember.adapters import _arrays as arrays
from ember.adapters import _torch as common
from ember.adapters._backend import Forward, load_model
from ember.adapters._encoder import BiEncoder
from ember.adapters._tokenize import TextTokenizer
from ember.adapters.base import Encoded, EncodeOptions, Runtime
from ember.config import ModelSpec, resolve_source
from ember.engine.types import PreparedItem
from ember.errors import ModelLoadError

POOLING_MODES = ("mean", "cls")
OUTPUT_TYPES = ("dense",)
Vector = npt.NDArray[np.float32]


@dataclass(frozen=True)
class EncodeParams:
    """The parameter group of one forward (R6). `prefix` is the prompt and
    instruction text put before every input, so the query and document sides of
    a model with prompts never share a forward, and those of a model without
    prompts may."""

    prefix: str
    normalize: bool
    output_types: tuple[str, ...] = OUTPUT_TYPES


@dataclass(frozen=True)
class DirectorySettings:
    """What a sentence-transformers directory says about itself."""

    weights_dir: Path
    pooling: str = "mean"
    normalize: bool = False
    max_seq_length: int | None = None
    lower_case: bool = False
    prompts: dict[str, str] = field(default_factory=dict)


def read_directory(model_dir: Path) -> DirectorySettings:
    """Settings from modules.json and the module configs; plain HF dirs get the defaults."""
    modules_file = model_dir / "modules.json"
    if not modules_file.exists():
        return DirectorySettings(model_dir)
    weights_dir, pooling, normalize = model_dir, "mean", False
    for module in common.read_json(modules_file):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        path = model_dir / str(module.get("path", ""))
        if kind == "Transformer":
            weights_dir = path
        elif kind == "Pooling":
            pooling = _pooling_mode(common.read_json(path / "config.json"))
        elif kind == "Normalize":
            normalize = True
    bert_config = weights_dir / "sentence_bert_config.json"
    st_config = common.read_json(bert_config) if bert_config.exists() else {}
    prompts_file = model_dir / "config_sentence_transformers.json"
    prompts = (common.read_json(prompts_file).get("prompts") or {}) if prompts_file.exists() else {}
    return DirectorySettings(weights_dir, pooling, normalize, st_config.get("max_seq_length"),
                             bool(st_config.get("do_lower_case", False)),
                             {str(k): str(v) for k, v in prompts.items()})


def _pooling_mode(config: dict[str, Any]) -> str:
    if config.get("pooling_mode_cls_token"):
        return "cls"
    if config.get("pooling_mode_mean_tokens"):
        return "mean"
    enabled = [k for k, v in config.items() if k.startswith("pooling_mode") and v is True]
    # Reported at load time unless the spec overrides the pooling.
    return "+".join(enabled) or "none"


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "cls":
        return hidden[:, 0]
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)


def cosine(query: Vector, docs: Sequence[Vector]) -> list[float]:
    matrix = np.stack(docs).astype(np.float64)
    q = query.astype(np.float64)
    norms = np.linalg.norm(matrix, axis=1) * np.linalg.norm(q)
    return [float(s) for s in (matrix @ q) / np.maximum(norms, 1e-12)]


class TransformerAdapter(BiEncoder[EncodeParams, Vector]):
    """One bi-encoder over a sentence-transformers directory."""

    def __init__(self, spec: ModelSpec, model: Forward, config: Any, tokenizer: Any,
                 settings: DirectorySettings, runtime: Runtime) -> None:
        super().__init__(spec, "transformer", tokenizer, runtime, model)
        self.pooling = spec.pooling or settings.pooling
        if self.pooling not in POOLING_MODES:
            raise ModelLoadError(spec.name, f"pooling {self.pooling!r} is not supported; "
                                            f"use one of {POOLING_MODES} (spec field 'pooling')")
        self.normalize = settings.normalize if spec.normalize is None else spec.normalize
        self.max_seq_length = common.model_max_length(spec, config, tokenizer,
                                                      settings.max_seq_length)
        self.tokens = TextTokenizer(tokenizer, self.max_seq_length)
        self.lower_case = settings.lower_case
        self.prompts = {**settings.prompts, **spec.prompts}
        self.info = self.describe(int(config.hidden_size), OUTPUT_TYPES,
                                  {"pooling": self.pooling, "normalize": self.normalize,
                                   "backend": model.backend})

    # -- the worker thread --------------------------------------------------------

    def forward(self, items: Sequence[PreparedItem], params: Hashable) -> list[Vector]:
        assert isinstance(params, EncodeParams)
        rows = [item.payload for item in items]
        if self.model.backend == "onnx":  # no torch between the graph and the vectors
            return self._forward_arrays(rows, params)
        with torch.inference_mode():
            ids = common.pad(rows, self.pad_id, self.device)
            mask = common.attention_mask(rows, self.device)
            hidden = self.model({"input_ids": ids, "attention_mask": mask})
            vectors = pool(hidden.float(), mask, self.pooling)
            if params.normalize:
                vectors = F.normalize(vectors, p=2, dim=1)
            array = vectors.cpu().numpy().astype(np.float32)
        return list(array)

    def _forward_arrays(self, rows: Sequence[list[int]], params: EncodeParams) -> list[Vector]:
        ids, mask = arrays.padded(rows, self.pad_id)
        hidden = self.model.run_arrays({"input_ids": ids, "attention_mask": mask})
        pooled = arrays.pool(hidden, mask, self.pooling)
        return list(arrays.l2_normalized(pooled) if params.normalize else pooled)

    # -- the request path (event loop) ----------------------------------------------

    def params(self, options: EncodeOptions) -> EncodeParams:
        output_types = common.check_output_types(options.output_types, OUTPUT_TYPES)
        normalize = self.normalize if options.normalize is None else options.normalize
        return EncodeParams(self.side_prefix(options), normalize, output_types)

    def tokenize(self, texts: Sequence[str], truncate: bool,
                 where: Sequence[str]) -> list[PreparedItem]:
        if self.lower_case:  # the directory's do_lower_case
            texts = [t.lower() for t in texts]
        return super().tokenize(texts, truncate, where)

    def encoded(self, value: Vector) -> Encoded:
        return Encoded(dense=value)

    def similarity(self, query: Vector, docs: Sequence[Vector]) -> list[float]:
        return cosine(query, docs)


def load(spec: ModelSpec, runtime: Runtime, weights: bool = True) -> TransformerAdapter:
    """Load a sentence-transformers (or plain transformers) directory, offline."""
    from transformers import AutoModel

    settings = read_directory(resolve_source(spec))
    model, config, tokenizer = load_model(spec, settings.weights_dir, runtime, AutoModel,
                                          "last_hidden_state", weights=weights)
    return TransformerAdapter(spec, model, config, tokenizer, settings, runtime)


def load_front(spec: ModelSpec, runtime: Runtime) -> TransformerAdapter:
    """The request path alone (tokenizer, prompts, pooling settings), without weights."""
    return load(spec, runtime, weights=False)
