"""Bi-encoders: a sentence-transformers model directory run through transformers.

The directory's own settings (modules.json, 1_Pooling/config.json, the
Normalize module, sentence_bert_config.json's max_seq_length, the prompts of
config_sentence_transformers.json) apply unless the spec overrides them.
Pooling is mean or CLS over the attention mask, optionally L2-normalized.
`score` is the cosine of the query's vector and each document's.
LoRA adapters (PEFT) switch per forward through `set_lora`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from ember.adapters import _torch as common
from ember.adapters.base import (
    Encoded,
    EncodeOptions,
    Entity,
    ExtractOptions,
    ModelInfo,
    Runtime,
    ScoreOptions,
    Submit,
    Task,
    TaskOutput,
    combine,
)
from ember.config import ModelSpec, resolve_source
from ember.engine.types import PreparedItem, RequestResult
from ember.errors import ModelLoadError, UnsupportedTask

POOLING_MODES = ("mean", "cls")
TASKS: tuple[Task, ...] = ("encode", "score")
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


class TransformerAdapter:
    """One bi-encoder. Task methods run on the event loop; forward and set_lora
    in the worker's thread."""

    def __init__(self, spec: ModelSpec, model: Any, tokenizer: Any,
                 settings: DirectorySettings, runtime: Runtime) -> None:
        unknown = [t for t in spec.tasks if t not in TASKS]
        if unknown:
            raise ModelLoadError(spec.name, f"the transformer family does not do {unknown}; "
                                            f"it does {TASKS}")
        self.spec = spec
        self.tokenizer = tokenizer
        self.device = torch.device(runtime.device)
        self.pooling = spec.pooling or settings.pooling
        if self.pooling not in POOLING_MODES:
            raise ModelLoadError(spec.name, f"pooling {self.pooling!r} is not supported; "
                                            f"use one of {POOLING_MODES} (spec field 'pooling')")
        self.normalize = settings.normalize if spec.normalize is None else spec.normalize
        self.max_seq_length = common.model_max_length(spec, model.config, tokenizer,
                                                      settings.max_seq_length)
        self.lower_case = settings.lower_case
        self.prompts = {**settings.prompts, **spec.prompts}
        self.pad_id = int(tokenizer.pad_token_id or 0)
        self.loras = common.LoraSet(model, spec.loras, runtime)
        self.info = ModelInfo(
            name=spec.name,
            tasks=tuple(t for t in TASKS if t in spec.tasks),
            dims=int(model.config.hidden_size),
            max_seq_length=self.max_seq_length,
            loras=self.loras.names,
            output_types=OUTPUT_TYPES,
            extra={"pooling": self.pooling, "normalize": self.normalize,
                   "prompts": dict(self.prompts)},
        )

    # -- the worker thread --------------------------------------------------------

    def set_lora(self, name: str | None) -> None:
        self.loras.set(name)

    def forward(self, items: Sequence[PreparedItem], params: Hashable) -> list[Vector]:
        assert isinstance(params, EncodeParams)
        rows = [item.payload for item in items]
        with torch.inference_mode():
            ids = common.pad(rows, self.pad_id, self.device)
            mask = common.attention_mask(rows, self.device)
            hidden = self.loras.model(input_ids=ids, attention_mask=mask).last_hidden_state
            vectors = pool(hidden.float(), mask, self.pooling)
            if params.normalize:
                vectors = F.normalize(vectors, p=2, dim=1)
            array = vectors.cpu().numpy().astype(np.float32)
        return list(array)

    # -- the request path (event loop) ----------------------------------------------

    def params(self, options: EncodeOptions) -> EncodeParams:
        output_types = common.check_output_types(options.output_types, OUTPUT_TYPES)
        normalize = self.normalize if options.normalize is None else options.normalize
        prefix = common.side_prefix(self.info.name, self.prompts, options.is_query,
                                    options.instruction)
        return EncodeParams(prefix, normalize, output_types)

    def tokenize(self, texts: Sequence[str], truncate: bool,
                 where: Sequence[str]) -> list[list[int]]:
        """Token ids of all texts in one batch call; over-long texts are cut or refused."""
        if self.lower_case:
            texts = [t.lower() for t in texts]
        limit = self.max_seq_length
        encoded = self.tokenizer(list(texts), truncation=truncate,
                                 max_length=limit if truncate else None,
                                 return_attention_mask=False, return_token_type_ids=False,
                                 verbose=False)
        rows: list[list[int]] = encoded["input_ids"]
        for row, param in zip(rows, where, strict=True):
            if len(row) > limit:
                raise common.over_limit(len(row), limit, param)
        return rows

    def prepare(self, texts: Sequence[str],
                options: EncodeOptions) -> tuple[list[PreparedItem], EncodeParams]:
        """Prepared items (cost = tokens after truncation) and their parameter group."""
        params = self.params(options)
        where = [f"items[{i}].text" for i in range(len(texts))]
        rows = self.tokenize([params.prefix + t for t in texts], options.truncate, where)
        return [PreparedItem(row, len(row), i) for i, row in enumerate(rows)], params

    async def encode(self, submit: Submit, texts: Sequence[str],
                     options: EncodeOptions) -> TaskOutput[list[Encoded]]:
        self._require("encode")
        common.require_items(len(texts))
        self.loras.check(options.lora)
        items, params = self.prepare(texts, options)
        result = await submit(items, params, options.lora)
        return TaskOutput([Encoded(dense=v) for v in result.values], result.queue_ms,
                          result.inference_ms, sum(item.cost for item in items))

    async def score(self, submit: Submit, query: str, docs: Sequence[str],
                    options: ScoreOptions) -> TaskOutput[list[float]]:
        self._require("score")
        common.require_items(len(docs))
        self.loras.check(options.lora)
        q_params = self.params(EncodeOptions(is_query=True))
        d_params = self.params(EncodeOptions(is_query=False))
        where = ["query.text", *(f"items[{i}].text" for i in range(len(docs)))]
        texts = [q_params.prefix + query, *(d_params.prefix + d for d in docs)]
        rows = self.tokenize(texts, options.truncate, where)
        results, vectors = await self._submit_sides(submit, rows, q_params, d_params,
                                                    options.lora)
        queue_ms, inference_ms = combine(results)
        return TaskOutput(cosine(vectors[0], vectors[1:]), queue_ms, inference_ms,
                          sum(len(row) for row in rows))

    async def _submit_sides(self, submit: Submit, rows: list[list[int]],
                            q_params: EncodeParams, d_params: EncodeParams,
                            lora: str | None) -> tuple[list[RequestResult], list[Vector]]:
        """One submit when both sides share parameters, else the two sides concurrently."""
        if q_params == d_params:
            items = [PreparedItem(row, len(row), i) for i, row in enumerate(rows)]
            result = await submit(items, q_params, lora)
            return [result], list(result.values)
        query_item = [PreparedItem(rows[0], len(rows[0]), 0)]
        doc_items = [PreparedItem(row, len(row), i) for i, row in enumerate(rows[1:])]
        q_result, d_result = await asyncio.gather(submit(query_item, q_params, lora),
                                                  submit(doc_items, d_params, lora))
        return [q_result, d_result], [*q_result.values, *d_result.values]

    async def extract(self, submit: Submit, texts: Sequence[str],
                      options: ExtractOptions) -> TaskOutput[list[list[Entity]]]:
        raise UnsupportedTask(self.spec.name, "extract", self.info.tasks)

    def _require(self, task: Task) -> None:
        if task not in self.info.tasks:
            raise UnsupportedTask(self.spec.name, task, self.info.tasks)

    def memory_bytes(self) -> int:
        return common.module_bytes(self.loras.model)

    def close(self) -> None:
        self.loras.close()
        common.release(self.device)


def load(spec: ModelSpec, runtime: Runtime) -> TransformerAdapter:
    """Load a sentence-transformers (or plain transformers) directory, offline."""
    from transformers import AutoModel, AutoTokenizer

    common.apply_runtime(runtime)
    settings = read_directory(resolve_source(spec))
    kwargs = common.load_kwargs(spec)
    tokenizer = AutoTokenizer.from_pretrained(str(settings.weights_dir), use_fast=True,
                                              local_files_only=True,
                                              trust_remote_code=spec.trust_remote_code)
    if not tokenizer.is_fast:
        raise ModelLoadError(spec.name, "a fast (tokenizers) tokenizer is required; the "
                                        "model directory needs a tokenizer.json")
    model = AutoModel.from_pretrained(str(settings.weights_dir), **kwargs)
    return TransformerAdapter(spec, model, tokenizer, settings, runtime)
