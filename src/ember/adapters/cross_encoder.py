"""Cross-encoders (rerankers): one sequence-classification forward per (query, document) pair.

A pair is tokenized with the document truncated first (`only_second`); only
when the query alone leaves no room for the document is the longer of the two
cut (`longest_first`). The score is the model's single logit through a
sigmoid, or the raw logit with `options: {activation: none}` in the spec.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from ember.adapters import _arrays as arrays
from ember.adapters import _torch as common
from ember.adapters._backend import FEEDABLE, Forward, load_model
from ember.adapters._tokenize import TextTokenizer, off_loop, over_limit
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
from ember.config import ModelSpec, resolve_source
from ember.engine.types import PreparedItem
from ember.errors import ModelLoadError, UnsupportedTask

Activation = Literal["sigmoid", "none"]
ACTIVATIONS: tuple[Activation, ...] = ("sigmoid", "none")
TASKS: tuple[Task, ...] = ("score",)


@dataclass(frozen=True)
class ScoreParams:
    """The parameter group of one forward (R6)."""

    activation: Activation


@dataclass(frozen=True, slots=True)
class Pair:
    """A tokenized (query, document) pair: the payload of one prepared item."""

    input_ids: list[int]
    token_type_ids: list[int] | None


class CrossEncoderAdapter(common.TorchModel):
    """One reranker. `score` runs on the event loop (large inputs are tokenized in the
    tokenizing pool); forward and set_lora in the worker's thread."""

    def __init__(self, spec: ModelSpec, model: Forward, config: Any, tokenizer: Any,
                 runtime: Runtime) -> None:
        super().__init__(spec, tokenizer, runtime, model)
        labels = int(config.num_labels)
        if labels != 1:
            raise ModelLoadError(spec.name, f"a cross-encoder needs one output label, this "
                                            f"model has {labels}")
        activation = str(spec.options.get("activation", "sigmoid")).lower()
        if activation not in ACTIVATIONS:
            raise ModelLoadError(spec.name, f"options.activation {activation!r} is unknown; "
                                            f"use one of {ACTIVATIONS}")
        self.params = ScoreParams("sigmoid" if activation == "sigmoid" else "none")
        self.max_seq_length = common.model_max_length(spec, config, tokenizer)
        self.tokens = TextTokenizer(tokenizer, self.max_seq_length, pairs=True)
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
        typed = all(p.token_type_ids is not None for p in pairs)
        if self.model.backend == "onnx":  # no torch between the graph and the scores
            ids, mask = arrays.padded(rows, self.pad_id)
            feeds = {"input_ids": ids, "attention_mask": mask}
            if typed:
                feeds["token_type_ids"] = arrays.padded([p.token_type_ids or [] for p in pairs],
                                                        0)[0]
            scores = self.model.run_arrays(feeds)[:, 0].astype(np.float32)
            return arrays.sigmoid(scores) if params.activation == "sigmoid" else [
                float(s) for s in scores]
        with torch.inference_mode():
            inputs = {"input_ids": common.pad(rows, self.pad_id, self.device),
                      "attention_mask": common.attention_mask(rows, self.device)}
            if typed:
                types = [p.token_type_ids or [] for p in pairs]
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
            raise over_limit(query_tokens + self.specials, limit, "query.text")
        # only_second fails when the query alone fills the limit; then cut both.
        strategy = "only_second" if query_tokens + self.specials < limit else "longest_first"
        encodings = self.tokens.encode_pairs(query, docs, strategy if truncate else None)
        items = []
        for i, encoding in enumerate(encodings):
            if len(encoding) > limit:
                raise over_limit(len(encoding), limit, f"items[{i}].text")
            types = encoding.type_ids if self.tokens.token_types else None
            items.append(PreparedItem(Pair(encoding.ids, types), len(encoding), i))
        return items

    async def score(self, submit: Submit, query: str, docs: Sequence[str],
                    options: ScoreOptions) -> TaskOutput[list[float]]:
        common.require_items(len(docs))
        self.model.check_lora(options.lora)
        # The query is tokenized once alone and again with each document.
        chars = len(query) * (len(docs) + 1) + sum(map(len, docs))
        items = await off_loop(chars, lambda: self.prepare(query, docs, options.truncate))
        result = await submit(items, self.params, options.lora)
        return TaskOutput([float(v) for v in result.values], result.queue_ms,
                          result.inference_ms, sum(item.cost for item in items))

    async def encode(self, submit: Submit, texts: Sequence[str],
                     options: EncodeOptions) -> TaskOutput[list[Encoded]]:
        raise UnsupportedTask(self.spec.name, "encode", self.info.tasks)


def load(spec: ModelSpec, runtime: Runtime, weights: bool = True) -> CrossEncoderAdapter:
    """Load a sequence-classification directory with one label, offline."""
    from transformers import AutoModelForSequenceClassification

    model, config, tokenizer = load_model(spec, resolve_source(spec), runtime,
                                          AutoModelForSequenceClassification, "logits",
                                          FEEDABLE, weights=weights)
    return CrossEncoderAdapter(spec, model, config, tokenizer, runtime)


def load_front(spec: ModelSpec, runtime: Runtime) -> CrossEncoderAdapter:
    """The request path alone (pair tokenizing, activation), without weights."""
    return load(spec, runtime, weights=False)
