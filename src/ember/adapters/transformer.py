"""Bi-encoders: a sentence-transformers model directory run through transformers.

The directory's own settings (modules.json, the Pooling module's config in either of
sentence-transformers' formats, its Dense modules, the Normalize module,
sentence_bert_config.json's max_seq_length, the prompts of
config_sentence_transformers.json) apply unless the spec overrides them. Pooling is
mean, CLS, max or last-token over the attention mask (less the prompt where the Pooling
module excludes it), then the Dense layers, then optionally L2 normalization. A module
Ember does not run is refused at load rather than skipped, so a vector is never served
without it.
`score` compares the query's vector with each document's by the model's own similarity
(config_sentence_transformers.json's `similarity_fn_name`: cosine by default, or dot
product, or the negative Euclidean or Manhattan distance, as sentence-transformers has
them).
LoRA adapters (PEFT) switch per forward through `set_lora`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ember.adapters import _arrays as arrays
from ember.adapters import _torch as common
from ember.adapters._backend import Forward, load_model
from ember.adapters._dense_layers import DenseLayer, read_dense
from ember.adapters._encoder import BiEncoder
from ember.adapters._similarity import Vector, similar
from ember.adapters._tokenize import TextTokenizer
from ember.adapters.base import Encoded, EncodeOptions, Runtime
from ember.config import POOLING_MODES, ModelSpec, resolve_source
from ember.engine.types import PreparedItem
from ember.errors import ModelLoadError
from ember.model_files import read_model_file

# sentence-transformers' similarity functions by the name its config gives (and an alias).
SIMILARITIES = {"cosine": "cosine", "dot": "dot", "dot_product": "dot",
                "euclidean": "euclidean", "manhattan": "manhattan"}
# sentence-transformers' modules.json types (the class name) that Ember runs.
MODULES = ("Transformer", "Pooling", "Dense", "Normalize")
OUTPUT_TYPES = ("dense",)


@dataclass(frozen=True)
class EncodeParams:
    """The parameter group of one forward (R6). `prefix` is the prompt and
    instruction text put before every input, so the query and document sides of
    a model with prompts never share a forward, and those of a model without
    prompts may."""

    prefix: str
    normalize: bool
    output_types: tuple[str, ...] = OUTPUT_TYPES
    skip: int = 0  # leading positions pooling leaves out: the prompt's, where excluded


@dataclass(frozen=True)
class DirectorySettings:
    """What a sentence-transformers directory says about itself."""

    weights_dir: Path
    pooling: str = "mean"
    normalize: bool = False
    max_seq_length: int | None = None
    lower_case: bool = False
    prompts: dict[str, str] = field(default_factory=dict)
    include_prompt: bool = True  # False: the prompt's tokens are left out of pooling
    dense: tuple[DenseLayer, ...] = ()
    similarity: str = "cosine"


def read_directory(model_dir: Path, model: str = "",
                   allow_pickle: bool = False) -> DirectorySettings:
    """Settings from modules.json and the module configs; plain HF dirs get the defaults.
    `model` names the model in errors; `allow_pickle` lets a Dense module's weights be a
    pickle (read by torch's weights-only unpickler)."""
    modules_file = model_dir / "modules.json"
    if not modules_file.exists():
        return DirectorySettings(model_dir)
    weights_dir, pooling, normalize, include_prompt = model_dir, "", False, True
    dense: list[DenseLayer] = []
    for kind, path in common.st_modules(model_dir, model):
        if kind not in MODULES:
            raise ModelLoadError(model, f"modules.json: a {kind or 'nameless'} module is not "
                                        f"one Ember runs ({', '.join(MODULES)}); serving the "
                                        "model without it would give other vectors")
        if normalize and kind != "Normalize":
            raise ModelLoadError(model, f"modules.json: a {kind} module after Normalize is "
                                        "not supported")
        if kind == "Transformer":
            weights_dir = path
        elif kind == "Pooling":
            config = read_model_file(path / "config.json", model)
            pooling = _pooling_mode(config)
            include_prompt = bool(config.get("include_prompt", True))
        elif kind == "Dense":
            if not pooling:
                break  # token vectors projected (a ColBERT model): refused below
            width = dense[-1].out_features if dense else None
            dense.append(read_dense(path, model, read_model_file(path / "config.json", model),
                                    width, allow_pickle))
        elif kind == "Normalize":
            normalize = True
    if not pooling:
        raise ModelLoadError(model, "modules.json has no Pooling module: the model gives a "
                                    "vector a token (a ColBERT model?), not one a text; "
                                    "serve it with adapter: multivector, which reads "
                                    "sentence-transformers', PyLate's and Stanford-NLP's "
                                    "ColBERT folders")
    bert_config = weights_dir / "sentence_bert_config.json"
    st_config = read_model_file(bert_config, model) if bert_config.exists() else {}
    st_file = model_dir / "config_sentence_transformers.json"
    model_config = read_model_file(st_file, model) if st_file.exists() else {}
    prompts = model_config.get("prompts") or {}
    if not isinstance(prompts, dict):
        raise ModelLoadError(model, "config_sentence_transformers.json: prompts is not a "
                                    "JSON object of names and texts")
    named = str(model_config.get("similarity_fn_name") or "cosine")
    if named not in SIMILARITIES:
        raise ModelLoadError(model, f"config_sentence_transformers.json: similarity_fn_name "
                                    f"{named!r} is not one of {sorted(SIMILARITIES)}")
    return DirectorySettings(weights_dir, pooling, normalize, st_config.get("max_seq_length"),
                             bool(st_config.get("do_lower_case", False)),
                             {str(k): str(v) for k, v in prompts.items()}, include_prompt,
                             tuple(dense), SIMILARITIES[named])


# sentence-transformers' earlier Pooling config: one boolean a mode.
_LEGACY_POOLING = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                   "pooling_mode_max_tokens": "max", "pooling_mode_lasttoken": "lasttoken",
                   "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens": "weightedmean"}


def _pooling_mode(config: dict[str, Any]) -> str:
    """The Pooling module's mode, from either config format (`pooling_mode`, a name or a
    list, since sentence-transformers 5; one boolean key a mode before). Several modes
    (concatenated) come back joined by "+", which the adapter refuses by name."""
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [name for key, name in _LEGACY_POOLING.items() if config.get(key) is True]
    else:
        modes = [str(mode)] if isinstance(mode, str) else [str(m) for m in mode]
    return "+".join(modes) or "none"


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """`arrays.pool` in torch, for the torch backend's forwards."""
    rows = torch.arange(mask.shape[0], device=mask.device)
    if mode == "cls":  # a gather, not a test of the mask: no device sync on a GPU
        return hidden[rows, mask.argmax(dim=1)]
    if mode == "lasttoken":
        last = mask.shape[1] - 1 - mask.flip(1).argmax(dim=1)
        return hidden[rows, last] * mask[rows, last].unsqueeze(-1).to(hidden.dtype)
    if mode == "max":
        return hidden.masked_fill(mask.unsqueeze(-1) == 0, float("-inf")).max(dim=1).values
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)


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
        self.dense = settings.dense
        if self.dense and self.dense[0].weight.shape[1] != int(config.hidden_size):
            raise ModelLoadError(spec.name, f"the first Dense module takes "
                                            f"{self.dense[0].weight.shape[1]} features, but "
                                            f"the model gives {config.hidden_size}")
        self.include_prompt = settings.include_prompt
        self.similarity_name = settings.similarity
        self._prompt_lengths: dict[str, int] = {}
        self.max_seq_length = common.model_max_length(spec, config, tokenizer,
                                                      settings.max_seq_length)
        self.tokens = TextTokenizer(tokenizer, self.max_seq_length)
        self.lower_case = settings.lower_case
        self.prompts = {**settings.prompts, **spec.prompts}
        dims = self.dense[-1].out_features if self.dense else int(config.hidden_size)
        self.info = self.describe(dims, OUTPUT_TYPES,
                                  {"pooling": self.pooling, "normalize": self.normalize,
                                   "similarity": self.similarity_name,
                                   "backend": model.backend})

    # -- the worker thread --------------------------------------------------------

    def forward(self, items: Sequence[PreparedItem], params: Hashable) -> list[Vector]:
        assert isinstance(params, EncodeParams)
        rows = [item.payload for item in items]
        if self.model.backend == "onnx":  # no torch between the graph and the vectors
            return self._forward_arrays(rows, params)
        with torch.inference_mode():
            ids, mask = common.pad_with_mask(rows, self.pad_id, self.device)
            hidden = self.model({"input_ids": ids, "attention_mask": mask})
            if params.skip:
                mask = mask.clone()
                mask[:, :params.skip] = 0
            vectors = pool(hidden.float(), mask, self.pooling)
            for layer in self.dense:
                vectors = layer.tensors(vectors)
            if params.normalize:
                vectors = F.normalize(vectors, p=2, dim=1)
            array = vectors.cpu().numpy().astype(np.float32)
        return list(array)

    def _forward_arrays(self, rows: Sequence[arrays.IdRow], params: EncodeParams) -> list[Vector]:
        ids, mask = arrays.padded(rows, self.pad_id)
        hidden = self.model.run_arrays({"input_ids": ids, "attention_mask": mask})
        if params.skip:
            mask[:, :params.skip] = 0  # after the forward: the prompt was attended to
        pooled = arrays.pool(hidden, mask, self.pooling)
        for layer in self.dense:
            pooled = layer.arrays(pooled)
        return list(arrays.l2_normalized(pooled) if params.normalize else pooled)

    # -- the request path (event loop) ----------------------------------------------

    def params(self, options: EncodeOptions) -> EncodeParams:
        output_types = common.check_output_types(options.output_types, OUTPUT_TYPES)
        normalize = self.normalize if options.normalize is None else options.normalize
        prefix = self.side_prefix(options)
        return EncodeParams(prefix, normalize, output_types, self._prompt_length(prefix))

    def _prompt_length(self, prefix: str) -> int:
        """Leading positions a prompt takes, where the Pooling module leaves it out: its
        tokens with the template's leading special tokens, as sentence-transformers
        counts them (0 otherwise)."""
        if self.include_prompt or not prefix:
            return 0
        length = self._prompt_lengths.get(prefix)
        if length is None:
            text = prefix.lower() if self.lower_case else prefix  # as `tokenize` has it
            length = self._prompt_lengths[prefix] = len(self.tokens.head) + self.tokens.count(text)
        return length

    def tokenize(self, texts: Sequence[str], truncate: bool, where: Sequence[str],
                 queries: int = 0) -> list[PreparedItem]:
        if self.lower_case:
            texts = [t.lower() for t in texts]
        return super().tokenize(texts, truncate, where)

    def reads(self, text: str) -> str:
        return text.lower() if self.lower_case else text  # the directory's do_lower_case

    def encoded(self, value: Vector) -> Encoded:
        return Encoded(dense=value)

    def similarity(self, query: Vector, docs: Sequence[Vector]) -> list[float]:
        return similar(self.similarity_name, query, docs)


def load(spec: ModelSpec, runtime: Runtime, weights: bool = True) -> TransformerAdapter:
    """Load a sentence-transformers (or plain transformers) directory, offline."""
    from transformers import AutoModel

    settings = read_directory(resolve_source(spec), spec.name, spec.allow_pickle)
    model, config, tokenizer = load_model(spec, settings.weights_dir, runtime, AutoModel,
                                          "last_hidden_state", weights=weights)
    return TransformerAdapter(spec, model, config, tokenizer, settings, runtime)


def load_front(spec: ModelSpec, runtime: Runtime) -> TransformerAdapter:
    """The request path alone (tokenizer, prompts, pooling settings), without weights."""
    return load(spec, runtime, weights=False)
