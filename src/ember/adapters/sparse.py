"""Sparse (SPLADE-style) encoders: a masked-LM's vocabulary logits pooled to one
weight per vocabulary entry.

A model directory is a transformers masked-LM (`AutoModelForMaskedLM`: config,
safetensors weights unless the spec sets `allow_pickle`, a fast tokenizer). For
an input of attended positions t, the weight of vocabulary entry v is

    w[v] = max_t log(1 + relu(logits[t, v]))

(the max runs over the attention mask, special tokens included, as SPLADE does).
Only the non-zero weights are returned, as a `SparseVector` whose indices are
sorted and unique and whose `dims` is the vocabulary size.

Spec `options` (pruning, applied to every vector, at encode and score alike):

- `top_k` (int >= 1; default: none): keep only the k largest weights.
- `threshold` (number >= 0; default 0): drop weights below it; weights of 0 are
  always dropped.
- `dims` (optional): the vocabulary size, as the catalog shows it; checked at load.

Spec `prompts` (`query`, `document`) are put before the text of each side and a
request's `instruction` before the prompt, as in the transformer family; when
the prompts differ the two sides never share a forward (R6). `score` is the dot
product of the query's sparse vector and each document's. The only output type
is "sparse"; vectors are not normalized (`normalize: true` is refused). LoRA
adapters are not supported.

The head's logits are (tokens x vocabulary); a forward runs its rows in chunks
whose padded logits stay under `LOGIT_BUDGET` elements, so a full batch of a
30k-vocabulary model does not allocate gigabytes at once.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ember.adapters import _arrays as arrays
from ember.adapters import _torch as common
from ember.adapters._backend import Forward, load_model
from ember.adapters._encoder import BiEncoder
from ember.adapters._similarity import dots
from ember.adapters._tokenize import TextTokenizer
from ember.adapters.base import Encoded, EncodeOptions, Runtime, SparseVector
from ember.config import FAMILY_OPTIONS, ModelSpec, resolve_source
from ember.engine.types import PreparedItem
from ember.errors import InvalidInput, ModelLoadError
from ember.model_files import read_model_file

OUTPUT_TYPES = ("sparse",)
OPTIONS = FAMILY_OPTIONS["sparse"]
LOGIT_BUDGET = 1 << 26  # logits per forward chunk: 256 MB in float32


@dataclass(frozen=True)
class SparseParams:
    """The parameter group of one forward (R6): the prompt and instruction prefix."""

    prefix: str
    output_types: tuple[str, ...] = OUTPUT_TYPES


@dataclass(frozen=True)
class Pruning:
    top_k: int | None = None
    threshold: float = 0.0

    @classmethod
    def from_options(cls, name: str, options: Mapping[str, Any]) -> Pruning:
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ModelLoadError(name, f"unknown options {unknown}; the sparse family "
                                       f"takes {list(OPTIONS)}")
        top_k = options.get("top_k")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                                  or top_k < 1):
            raise ModelLoadError(name, f"options.top_k must be an integer >= 1, got {top_k!r}")
        threshold = options.get("threshold", 0.0)
        if (isinstance(threshold, bool) or not isinstance(threshold, int | float)
                or not threshold >= 0):
            raise ModelLoadError(name, f"options.threshold must be a number >= 0, "
                                       f"got {threshold!r}")
        return cls(top_k, float(threshold))

    def apply(self, weights: npt.NDArray[np.float32], dims: int) -> SparseVector:
        """The non-zero weights of one vector that survive pruning, by ascending index."""
        keep = weights > 0
        if self.threshold > 0:
            keep &= weights >= self.threshold
        indices = np.flatnonzero(keep)  # sorted and unique
        if self.top_k is not None and indices.size > self.top_k:
            cut = indices.size - self.top_k
            indices = np.sort(indices[np.argpartition(weights[indices], cut)[cut:]])
        return SparseVector(indices.astype(np.int32), weights[indices].astype(np.float32), dims)


class SparseAdapter(BiEncoder[SparseParams, SparseVector]):
    """One sparse encoder over a masked-LM directory."""

    def __init__(self, spec: ModelSpec, model: Forward, config: Any, tokenizer: Any,
                 runtime: Runtime) -> None:
        super().__init__(spec, "sparse", tokenizer, runtime, model)
        self.pruning = Pruning.from_options(spec.name, spec.options)
        self.vocab_size = int(config.vocab_size)
        self.max_seq_length = common.model_max_length(spec, config, tokenizer)
        self.tokens = TextTokenizer(tokenizer, self.max_seq_length)
        self.prompts = dict(spec.prompts)
        self.logit_budget = LOGIT_BUDGET
        self.info = self.describe(self.vocab_size, OUTPUT_TYPES,
                                  {"top_k": self.pruning.top_k,
                                   "threshold": self.pruning.threshold,
                                   "backend": model.backend})

    # -- the worker thread --------------------------------------------------------

    def forward(self, items: Sequence[PreparedItem], params: Hashable) -> list[SparseVector]:
        assert isinstance(params, SparseParams)
        rows: list[arrays.IdRow] = [item.payload for item in items]
        longest = max(len(row) for row in rows)
        step = max(1, self.logit_budget // (longest * self.vocab_size))
        pooled = self._pooled_arrays if self.model.backend == "onnx" else self._pooled_torch
        out: list[SparseVector] = []
        for start in range(0, len(rows), step):
            weights = pooled(rows[start:start + step])
            out.extend(self.pruning.apply(row, self.vocab_size) for row in weights)
        return out

    def _pooled_torch(self, rows: Sequence[arrays.IdRow]) -> npt.NDArray[np.float32]:
        with torch.inference_mode():
            ids, mask = common.pad_with_mask(rows, self.pad_id, self.device)
            logits = self.model({"input_ids": ids, "attention_mask": mask})
            # log1p(relu(.)) is monotone, so the max of the logits pools the same.
            logits.masked_fill_(mask.unsqueeze(-1) == 0, float("-inf"))
            pooled = torch.log1p(torch.relu(logits.amax(dim=1).float()))
            weights: npt.NDArray[np.float32] = pooled.cpu().numpy()
        return weights

    def _pooled_arrays(self, rows: Sequence[arrays.IdRow]) -> npt.NDArray[np.float32]:
        """ONNX Runtime's logits pooled in numpy: no torch between the graph and the
        weights (each small torch op costs tens of microseconds on CPU)."""
        ids, mask = arrays.padded(rows, self.pad_id)
        logits = self.model.run_arrays({"input_ids": ids, "attention_mask": mask})
        return arrays.max_log_relu(logits.astype(np.float32, copy=False), mask)

    # -- the request path (event loop) ----------------------------------------------

    def params(self, options: EncodeOptions) -> SparseParams:
        output_types = common.check_output_types(options.output_types, OUTPUT_TYPES)
        if options.normalize:
            raise InvalidInput("sparse vectors are not normalized; leave normalize unset "
                               "for this model", "params.options.normalize")
        return SparseParams(self.side_prefix(options), output_types)

    def encoded(self, value: SparseVector) -> Encoded:
        return Encoded(sparse=value)

    def similarity(self, query: SparseVector, docs: Sequence[SparseVector]) -> list[float]:
        return dots(query, docs)

    def similarity_us(self, query: SparseVector, docs: Sequence[SparseVector]) -> float:
        return 2.5 * len(docs)  # a gather and a dot a document: ~2.4 us at 150 weights


def load(spec: ModelSpec, runtime: Runtime, weights: bool = True) -> SparseAdapter:
    """Load a masked-LM directory, offline."""
    from transformers import AutoModelForMaskedLM

    common.refuse_loras(spec, "sparse")
    model_dir = encoder_dir(resolve_source(spec), spec.name)
    model, config, tokenizer = load_model(spec, model_dir, runtime,
                                          AutoModelForMaskedLM, "logits", weights=weights)
    return SparseAdapter(spec, model, config, tokenizer, runtime)


def encoder_dir(model_dir: Path, model: str) -> Path:
    """Where the masked-LM lies: the directory itself, or, in a sparse encoder saved by
    sentence-transformers, its Transformer module's folder. Its SpladePooling must pool
    as this family does (max over the tokens of log(1 + relu)); any other module is
    refused, not skipped."""
    if not (model_dir / "modules.json").is_file():
        return model_dir
    encoder = model_dir
    for kind, path in common.st_modules(model_dir, model):
        if kind in ("Transformer", "MLMTransformer"):
            encoder = path
        elif kind == "SpladePooling":
            config = read_model_file(path / "config.json", model)
            pooling = (config.get("pooling_strategy", "max"),
                       config.get("activation_function", "relu"))
            if pooling != ("max", "relu"):
                raise ModelLoadError(model, f"SpladePooling with pooling_strategy "
                                            f"{pooling[0]!r} and activation_function "
                                            f"{pooling[1]!r} is not supported; the sparse "
                                            "family pools max over log(1 + relu)")
        else:
            raise ModelLoadError(model, f"modules.json: a {kind or 'nameless'} module is not "
                                        "one the sparse family runs (Transformer, "
                                        "SpladePooling)")
    return encoder


def load_front(spec: ModelSpec, runtime: Runtime) -> SparseAdapter:
    """The request path alone (tokenizer, pruning, prompts), without weights."""
    return load(spec, runtime, weights=False)
