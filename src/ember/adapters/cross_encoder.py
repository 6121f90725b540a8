"""Cross-encoders (rerankers): one sequence-classification forward per (query, document) pair.

A pair over the limit is cut from the longer of its two texts (`longest_first`), as
sentence-transformers and TEI cut it, so scores match theirs. The score is the model's
single logit through the activation the folder names (sentence-transformers 4+ writes it
into config.json), else a sigmoid; `options: {activation: none | sigmoid}` in the spec
overrides both.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from ember.adapters import _arrays as arrays
from ember.adapters import _torch as common
from ember.adapters._backend import FEEDABLE, Forward, load_model
from ember.adapters._tokenize import TextTokenizer, id_rows, off_loop, over_limit
from ember.adapters.base import (
    Encoded,
    EncodeOptions,
    ModelInfo,
    Runtime,
    ScoreOptions,
    Submit,
    Task,
    TaskOutput,
)
from ember.config import CROSS_ENCODER_ACTIVATIONS, ModelSpec, resolve_source
from ember.engine.types import PreparedItem
from ember.errors import ModelLoadError, UnsupportedTask
from ember.model_files import read_model_file

Activation = Literal["sigmoid", "none"]
ACTIVATIONS: tuple[Activation, ...] = CROSS_ENCODER_ACTIVATIONS
TASKS: tuple[Task, ...] = ("score",)
# The torch classes sentence-transformers names in a folder's config, as Ember runs them.
SAVED_ACTIVATIONS: dict[str, Activation] = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "none", "torch.nn.Identity": "none",
}

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScoreParams:
    """The parameter group of one forward (R6)."""

    activation: Activation


@dataclass(frozen=True, slots=True)
class Pair:
    """A tokenized (query, document) pair: the payload of one prepared item."""

    input_ids: arrays.IdRow
    token_type_ids: arrays.IdRow | None


class CrossEncoderAdapter(common.TorchModel):
    """One reranker. `score` runs on the event loop (large inputs are tokenized in the
    tokenizing pool); forward and set_lora in the worker's thread."""

    def __init__(self, spec: ModelSpec, model: Forward, config: Any, tokenizer: Any,
                 runtime: Runtime, activation: Activation) -> None:
        super().__init__(spec, tokenizer, runtime, model)
        labels = int(config.num_labels)
        if labels != 1:
            raise ModelLoadError(spec.name, f"a cross-encoder needs one output label, this "
                                            f"model has {labels}")
        self.params = ScoreParams(activation)
        self.max_seq_length = common.model_max_length(spec, config, tokenizer)
        self.tokens = TextTokenizer(tokenizer, self.max_seq_length)
        self.specials = self.tokens.pair_specials
        if set(spec.tasks) - set(TASKS):
            raise ModelLoadError(spec.name, f"a cross-encoder does only {TASKS}, the spec "
                                            f"lists {list(spec.tasks)}")
        self.info = ModelInfo(name=spec.name, tasks=TASKS,
                              max_seq_length=self.max_seq_length, loras=self.model.loras,
                              output_types=(), extra={"activation": self.params.activation,
                                                      "backend": model.backend})

    # -- the worker thread --------------------------------------------------------

    def forward(self, items: Sequence[PreparedItem], params: Hashable) -> list[float]:
        assert isinstance(params, ScoreParams)
        pairs: list[Pair] = [item.payload for item in items]
        rows = [p.input_ids for p in pairs]
        types = [p.token_type_ids for p in pairs if p.token_type_ids is not None]
        typed = len(types) == len(pairs)  # fed only when every pair has them
        if self.model.backend == "onnx":  # no torch between the graph and the scores
            ids, mask = arrays.padded(rows, self.pad_id)
            feeds = {"input_ids": ids, "attention_mask": mask}
            if typed:
                feeds["token_type_ids"] = arrays.padded(types, 0)[0]
            scores = self.model.run_arrays(feeds)[:, 0].astype(np.float32)
            return arrays.sigmoid(scores) if params.activation == "sigmoid" else [
                float(s) for s in scores]
        with torch.inference_mode():
            id_tensor, mask_tensor = common.pad_with_mask(rows, self.pad_id, self.device)
            inputs = {"input_ids": id_tensor, "attention_mask": mask_tensor}
            if typed:
                inputs["token_type_ids"] = common.pad(types, 0, self.device)
            logits = self.model(inputs)[:, 0].float()
            if params.activation == "sigmoid":
                logits = torch.sigmoid(logits)
        return [float(x) for x in logits.cpu()]

    # -- the request path (event loop) ----------------------------------------------

    def prepare(self, query: str, docs: Sequence[str], truncate: bool) -> list[PreparedItem]:
        """One item per document, cost = the pair's tokens after truncation. Any thread
        may call it."""
        limit = self.max_seq_length
        query_tokens = self.tokens.count(query)
        if not truncate and query_tokens + self.specials > limit:
            raise over_limit(query_tokens + self.specials, limit, "query.text",
                             " (the query alone, with the pair's special tokens: no document "
                             "fits beside it)")
        encodings = self.tokens.encode_pairs(query, docs, truncate, query_tokens)
        for i, encoding in enumerate(encodings):
            if len(encoding) > limit:
                raise over_limit(len(encoding), limit, f"items[{i}].text")
        ids = id_rows(encodings)
        types = id_rows(encodings, "type_ids") if self.tokens.token_types else None
        return [PreparedItem(Pair(row, types[i] if types else None), len(row), i)
                for i, row in enumerate(ids)]

    async def score(self, submit: Submit, query: str, docs: Sequence[str],
                    options: ScoreOptions) -> TaskOutput[list[float]]:
        common.require_items(len(docs))
        self.model.check_lora(options.lora)
        # The query is tokenized once alone and again with each document.
        chars = len(query) * (len(docs) + 1) + sum(map(len, docs))
        items = await off_loop(chars, lambda: self.prepare(query, docs, options.truncate))
        params = ScoreParams("none") if options.raw else self.params
        result = await submit(items, params, options.lora)
        return TaskOutput([float(v) for v in result.values], result.queue_ms,
                          result.inference_ms, sum(item.cost for item in items))

    async def encode(self, submit: Submit, texts: Sequence[str],
                     options: EncodeOptions) -> TaskOutput[list[Encoded]]:
        raise UnsupportedTask(self.spec.name, "encode", self.info.tasks)


def activation_of(spec: ModelSpec, directory: Path, config: Any) -> Activation:
    """The spec's `options.activation`, else the activation the folder was saved with (where
    sentence-transformers looks for it, in its order), else sigmoid, its default for one
    label."""
    if "activation" in spec.options:
        chosen = str(spec.options["activation"]).lower()
        if chosen not in ACTIVATIONS:
            raise ModelLoadError(spec.name, f"options.activation {chosen!r} is unknown; "
                                            f"use one of {ACTIVATIONS}")
        return "sigmoid" if chosen == "sigmoid" else "none"
    st_file = directory / "config_sentence_transformers.json"
    st_config = read_model_file(st_file, spec.name) if st_file.is_file() else {}
    nested = getattr(config, "sentence_transformers", None)  # config.json, 4.x
    saved = [st_config.get("activation_fn"),
             nested.get("activation_fn") if isinstance(nested, dict) else None,
             getattr(config, "sbert_ce_default_activation_function", None)]  # before 4.0
    for path in (p for p in saved if p is not None):
        if not isinstance(path, str):
            raise ModelLoadError(spec.name, f"the folder names its activation as {path!r}, "
                                            "not a class path")
        if path in SAVED_ACTIVATIONS:
            return SAVED_ACTIVATIONS[path]
        if path.startswith("torch."):
            raise ModelLoadError(spec.name, f"the folder names the activation {path}, which "
                                            f"Ember does not run; set options.activation to "
                                            f"one of {ACTIVATIONS} to serve it with that")
        # sentence-transformers imports such a path only with trust_remote_code; Ember never.
        log.warning("model %s: the folder names the activation %s, which is not a torch "
                    "class; it is not imported", spec.name, path)
    return "sigmoid"


def load(spec: ModelSpec, runtime: Runtime, weights: bool = True) -> CrossEncoderAdapter:
    """Load a sequence-classification directory with one label, offline."""
    from transformers import AutoModelForSequenceClassification

    directory = resolve_source(spec)
    model, config, tokenizer = load_model(spec, directory, runtime,
                                          AutoModelForSequenceClassification, "logits",
                                          FEEDABLE, weights=weights)
    return CrossEncoderAdapter(spec, model, config, tokenizer, runtime,
                               activation_of(spec, directory, config))


def load_front(spec: ModelSpec, runtime: Runtime) -> CrossEncoderAdapter:
    """The request path alone (pair tokenizing, activation), without weights."""
    return load(spec, runtime, weights=False)
