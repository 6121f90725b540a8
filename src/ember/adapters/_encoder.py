"""What the bi-encoder families (transformer, sparse, multivector, m3) share: the encode
and score flow around one family's forward.

Each text becomes one value (a dense vector, a sparse vector, a token matrix). A
family supplies `forward` and three hooks: `params` (its parameter group for one
side), `encoded` (how a value is returned by encode) and `similarity` (how score
compares the query's value with each document's); it may override `tokenize`.
Large inputs are tokenized, and long similarities computed, in the tokenizing pool
(`_tokenize.off_loop`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from ember.adapters import _torch as common
from ember.adapters._backend import Forward
from ember.adapters._tokenize import OFFLOAD_US, TextTokenizer, id_rows, off_loop, off_loop_if
from ember.adapters.base import (
    Encoded,
    EncodeOptions,
    ModelInfo,
    Runtime,
    ScoreOptions,
    Submit,
    Task,
    TaskOutput,
    combine,
)
from ember.config import ModelSpec
from ember.engine.types import PreparedItem
from ember.errors import ModelLoadError, UnsupportedTask

TASKS: tuple[Task, ...] = ("encode", "score")


class SideParams(Hashable, Protocol):
    """What the shared flow reads of a family's parameter group (R6), a hashable
    frozen dataclass: the prompt and instruction text put before every input of one
    side."""

    @property
    def prefix(self) -> str: ...


ParamsT = TypeVar("ParamsT", bound=SideParams)
ValueT = TypeVar("ValueT")
# Score's values of the documents against the query, from their forwards' values.
Comparison = Callable[[ValueT, Sequence[ValueT]], list[float]]


class BiEncoder(common.TorchModel, Generic[ParamsT, ValueT]):
    """One bi-encoder. Task methods run on the event loop; forward and set_lora in
    the worker's thread. A family sets `max_seq_length`, `tokens` (its tokenizer at
    that limit), `prompts` and `info` (through `describe`) in its __init__."""

    max_seq_length: int
    tokens: TextTokenizer
    prompts: dict[str, str]
    # Whether score's forwards normalize: the family's own setting (None), or always where
    # its scores are defined on unit rows.
    score_normalize: bool | None = None

    def __init__(self, spec: ModelSpec, family: str, tokenizer: Any, runtime: Runtime,
                 model: Forward) -> None:
        unknown = [t for t in spec.tasks if t not in TASKS]
        if unknown:
            raise ModelLoadError(spec.name, f"the {family} family does not do {unknown}; "
                                            f"it does {TASKS}")
        super().__init__(spec, tokenizer, runtime, model)

    def describe(self, dims: int, output_types: tuple[str, ...], extra: dict[str, object],
                 output_dims: dict[str, int] | None = None) -> ModelInfo:
        """The model's info: the spec's tasks, the family's dims, output types and extra
        fields, then the prompts. A catalog entry's `options.dims` (what `ember models`
        shows before a load) must be what the model gives."""
        declared = self.spec.options.get("dims")
        if declared is not None and declared != dims:
            raise ModelLoadError(self.spec.name, f"options.dims is {declared!r}, but the model "
                                                 f"gives {dims} dimensions; correct or remove "
                                                 "options.dims")
        return ModelInfo(
            name=self.spec.name,
            tasks=tuple(t for t in TASKS if t in self.spec.tasks),
            dims=dims,
            max_seq_length=self.max_seq_length,
            loras=self.model.loras,
            output_types=output_types,
            extra={**extra, "prompts": dict(self.prompts)},
            output_dims=dict(output_dims or {}),
        )

    # -- the family's hooks -----------------------------------------------------------

    def params(self, options: EncodeOptions) -> ParamsT:
        """The parameter group of one side's forward; invalid options are a 422."""
        raise NotImplementedError

    def encoded(self, value: ValueT) -> Encoded:
        """One forward value as encode returns it."""
        raise NotImplementedError

    def similarity(self, query: ValueT, docs: Sequence[ValueT]) -> list[float]:
        """Score's value for each document against the query."""
        raise NotImplementedError

    def scoring(self, options: ScoreOptions) -> tuple[tuple[str, ...], Comparison[ValueT]]:
        """The outputs score's forwards make and how they are compared: every output the
        model has, by `similarity`, unless a family compares fewer (or weighs them by
        request)."""
        return self.info.output_types, self.similarity

    def similarity_us(self, query: ValueT, docs: Sequence[ValueT]) -> float:
        """About how long `similarity` takes, in microseconds: a long one runs off the
        event loop. Dense cosines take ~1 us a document (2 cores, 384 dimensions)."""
        return 1.0 * len(docs)

    def tokenize(self, texts: Sequence[str], truncate: bool, where: Sequence[str],
                 queries: int = 0) -> list[PreparedItem]:
        """Prepared items of token ids (cost = tokens after truncation), in one batch
        call; over-long texts are cut or refused. The first `queries` texts are queries
        (a family may treat the sides apart). Any thread may call it."""
        encodings = self.tokens.encode(texts, truncate, where)
        return [PreparedItem(row, len(row), i) for i, row in enumerate(id_rows(encodings))]

    # -- the request path (event loop) ----------------------------------------------

    def side_prefix(self, options: EncodeOptions) -> str:
        return common.side_prefix(self.info.name, self.prompts, options.is_query,
                                  options.instruction)

    def prepare(self, texts: Sequence[str],
                options: EncodeOptions) -> tuple[list[PreparedItem], ParamsT]:
        """Prepared items (cost = tokens after truncation) and their parameter group.
        Any thread may call it."""
        params = self.params(options)
        where = [f"items[{i}].text" for i in range(len(texts))]
        return self.tokenize([params.prefix + t for t in texts], options.truncate, where,
                             len(texts) if options.is_query else 0), params

    async def encode(self, submit: Submit, texts: Sequence[str],
                     options: EncodeOptions) -> TaskOutput[list[Encoded]]:
        self._require("encode")
        common.require_items(len(texts))
        self.model.check_lora(options.lora)
        items, params = await off_loop(sum(map(len, texts)),
                                       lambda: self.prepare(texts, options))
        result = await submit(items, params, options.lora)
        return TaskOutput([self.encoded(v) for v in result.values], result.queue_ms,
                          result.inference_ms, sum(item.cost for item in items))

    async def score(self, submit: Submit, query: str, docs: Sequence[str],
                    options: ScoreOptions) -> TaskOutput[list[float]]:
        self._require("score")
        common.require_items(len(docs))
        self.model.check_lora(options.lora)
        output_types, compare = self.scoring(options)
        q_params, d_params = (self.params(EncodeOptions(
            is_query=side, output_types=output_types, normalize=self.score_normalize))
            for side in (True, False))
        where = ["query.text", *(f"items[{i}].text" for i in range(len(docs)))]
        texts = [q_params.prefix + query, *(d_params.prefix + d for d in docs)]
        items = await off_loop(sum(map(len, texts)),
                               lambda: self.tokenize(texts, options.truncate, where, 1))
        results, values = await common.submit_sides(submit, items, q_params, d_params,
                                                    options.lora)
        queue_ms, inference_ms = combine(results)
        asked, candidates = values[0], values[1:]
        scores = await off_loop_if(self.similarity_us(asked, candidates) >= OFFLOAD_US,
                                   lambda: compare(asked, candidates))
        return TaskOutput(scores, queue_ms, inference_ms, sum(item.cost for item in items))

    async def encode_ids(self, submit: Submit, rows: Sequence[Sequence[int]],
                         options: EncodeOptions) -> TaskOutput[list[Encoded]]:
        """Encode token ids of this model's own vocabulary (OpenAI's token-id inputs) as
        the ids of a text: the tokenizer's special tokens go around each row, unless it
        already has them; a row over the limit is cut, or refused without `truncate`."""
        self._require("encode")
        common.require_items(len(rows))
        self.model.check_lora(options.lora)
        # Arrays, as tokenized texts are, so a batch of both still packs and pads as one
        # block; the route checked the ids against the vocabulary, so int32 holds them.
        items = [PreparedItem(np.asarray(row, np.int32), len(row), i) for i, row in
                 enumerate(self.tokens.wrap_ids(rows, options.truncate, "input"))]
        result = await submit(items, self.params(options), options.lora)
        return TaskOutput([self.encoded(v) for v in result.values], result.queue_ms,
                          result.inference_ms, sum(item.cost for item in items))

    def _require(self, task: Task) -> None:
        if task not in self.info.tasks:
            raise UnsupportedTask(self.spec.name, task, self.info.tasks)
