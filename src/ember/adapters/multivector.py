"""Multi-vector (ColBERT-style) encoders: one vector per token, scored by MaxSim.

A ColBERT checkpoint in sentence-transformers', PyLate's or Stanford-NLP's layout is
served as sentence-transformers' MultiVectorEncoder serves it (ember.adapters._colbert):
its markers before each side's text, queries expanded with [MASK] tokens to their fixed
length, documents cut to theirs and stripped of punctuation (the skiplist), every
token's vector (its [CLS] and [SEP] included) projected and normalized.

Any other directory is a transformers encoder (`AutoModel`: config, safetensors
weights unless the spec sets `allow_pickle`, a fast tokenizer) plus the projection
from the encoder's hidden size to the token dimension:

    colbert_linear.safetensors    one tensor "weight", shape (token_dims, hidden_size)

applied as `hidden @ weight.T` (no bias); an item's vectors are those of its own
tokens, without padding and without the special tokens the tokenizer's template adds
([CLS], [SEP]). Spec `options`:

- `projection` (default "colbert_linear.safetensors", for a Stanford-NLP checkpoint
  "model.safetensors"): the projection's file, relative to the model directory; always
  safetensors.
- `projection_key` (default "weight", for a Stanford-NLP checkpoint "linear.weight"):
  the tensor's name in that file.
- `dims` (optional): the token dimension, as the catalog shows it; checked at load.

An item's output is a float32 array (num_tokens, token_dims), each row L2-normalized
(a request's `normalize: false` returns the raw projections). Text that yields no
tokens gives a (0, token_dims) array.

`score` is MaxSim over normalized rows: the sum, over the query's tokens, of the
largest cosine with any of the document's tokens (0 when either side has no tokens);
divided by the query's token count where the checkpoint names `meanmaxsim`. Spec
`prompts` (`query`, `document`) and a request's `instruction` are put before the text
(after a ColBERT marker) as in the transformer family; differing prompts keep the two
sides in separate forwards (R6). The only output type is "multivector". LoRA adapters
are not supported.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from ember.adapters import _arrays as arrays
from ember.adapters import _torch as common
from ember.adapters._backend import Forward, load_model
from ember.adapters._colbert import (
    ColbertFolder,
    Expansion,
    read_colbert_folder,
    register_markers,
    skiplist_ids,
)
from ember.adapters._dense_layers import DenseLayer
from ember.adapters._encoder import BiEncoder
from ember.adapters._similarity import Matrix, maxsim
from ember.adapters._tokenize import TextTokenizer, cut, id_rows
from ember.adapters.base import Encoded, EncodeOptions, Runtime
from ember.config import FAMILY_OPTIONS, ModelSpec, resolve_source
from ember.engine.types import PreparedItem
from ember.errors import ModelLoadError

OUTPUT_TYPES = ("multivector",)
OPTIONS = FAMILY_OPTIONS["multivector"]
PROJECTION_FILE = "colbert_linear.safetensors"
PROJECTION_KEY = "weight"
STANFORD_FILE, STANFORD_KEY = "model.safetensors", "linear.weight"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MultiVectorParams:
    """The parameter group of one forward (R6)."""

    prefix: str
    normalize: bool
    output_types: tuple[str, ...] = OUTPUT_TYPES


@dataclass(frozen=True, slots=True)
class TokenRow:
    """A tokenized input: the payload of one prepared item. `keep` is 1 at the
    positions whose vectors are returned; `attend` 1 where the encoder attends (None:
    everywhere), 0 at a query's expansion tokens where the checkpoint says so."""

    ids: arrays.IdRow
    keep: arrays.IdRow
    attend: arrays.IdRow | None = None


@dataclass(frozen=True)
class SideRows:
    """How one side's texts become token rows: a ColBERT checkpoint's (its length,
    expansion and skiplist), or the plain layout's (every token but the specials)."""

    tokens: TextTokenizer
    expansion: Expansion | None = None
    expansion_id: int = 0
    skip: frozenset[int] = frozenset()
    colbert: bool = False

    def rows(self, texts: Sequence[str], truncate: bool,
             where: Sequence[str]) -> list[TokenRow]:
        encodings = self.tokens.encode(texts, truncate, where)
        if not encodings:
            return []
        if not self.colbert:
            specials = id_rows(encodings, "special_tokens_mask")
            return [TokenRow(ids, 1 - special)
                    for ids, special in zip(id_rows(encodings), specials, strict=True)]
        expanded = [self.expanded(ids) for ids in id_rows(encodings)]
        # One lookup for the whole request: which positions are not in the skiplist.
        kept = np.isin(np.concatenate([ids for ids, _ in expanded]),
                       np.fromiter(self.skip, np.int64, len(self.skip)), invert=True)
        keeps = cut(kept.astype(np.int32), [len(ids) for ids, _ in expanded])
        return [TokenRow(ids, keep, attend)
                for (ids, attend), keep in zip(expanded, keeps, strict=True)]

    def expanded(self, ids: npt.NDArray[np.int32]) -> tuple[npt.NDArray[np.int32],
                                                            npt.NDArray[np.int32] | None]:
        """A query's ids filled up to the expansion length with the expansion token, and
        where the encoder attends (None: everywhere)."""
        missing = self.expansion.length - len(ids) if self.expansion is not None else 0
        if self.expansion is None or missing <= 0:
            return ids, None
        attend = np.ones(len(ids) + missing, np.int32)
        attend[len(ids):] = int(self.expansion.attend)
        return np.concatenate([ids, np.full(missing, self.expansion_id, np.int32)]), attend


def read_projection(spec: ModelSpec, model_dir: Path, file: str = PROJECTION_FILE,
                    key: str = PROJECTION_KEY) -> DenseLayer:
    """The projection weight named by the spec's options (else `file` and `key`), as a
    layer without bias or activation."""
    from safetensors import SafetensorError, safe_open

    options: Mapping[str, Any] = spec.options
    name = str(options.get("projection", file))
    key = str(options.get("projection_key", key))
    path = model_dir / name
    if path.suffix != ".safetensors" or not path.is_file():
        raise ModelLoadError(spec.name, f"no projection file {path} (options.projection: a "
                                        f".safetensors file in the model directory)")
    try:  # the library checks the header's size and every offset against the file
        with safe_open(str(path), framework="np") as tensors:
            names = sorted(tensors.keys())
            if key not in names:
                raise ModelLoadError(spec.name, f"{path.name} has no tensor {key!r} "
                                                f"(options.projection_key); it has {names}")
            weight = tensors.get_tensor(key)
    except SafetensorError as error:
        raise ModelLoadError(spec.name, f"{path.name} is not a readable safetensors file: "
                                        f"{error}") from None
    if weight.ndim != 2:
        raise ModelLoadError(spec.name, f"the projection has shape {tuple(weight.shape)}; "
                                        "expected (token_dims, hidden_size)")
    return DenseLayer(np.ascontiguousarray(weight, dtype=np.float32), None, "identity")


def read_layout(spec: ModelSpec, model_dir: Path) -> tuple[DenseLayer, ColbertFolder | None]:
    """The projection, and the ColBERT checkpoint's settings where the folder is one
    (read before the encoder, so a bad file fails the load early)."""
    unknown = sorted(set(spec.options) - set(OPTIONS))
    if unknown:
        raise ModelLoadError(spec.name, f"unknown options {unknown}; the multivector family "
                                        f"takes {list(OPTIONS)}")
    colbert = read_colbert_folder(
        model_dir, spec.name, spec.allow_pickle,
        lambda: read_projection(spec, model_dir, STANFORD_FILE, STANFORD_KEY))
    if colbert is None:
        return read_projection(spec, model_dir), None
    named = sorted({"projection", "projection_key"} & set(spec.options))
    if colbert.layout != "stanford" and named:  # the folder's own Dense module is the one
        log.warning("model %s: options %s are not used; the folder's own Dense module "
                    "projects its tokens", spec.name, named)
    return colbert.projection, colbert


class MultiVectorAdapter(BiEncoder[MultiVectorParams, Matrix]):
    """One multi-vector encoder over an encoder directory and its projection."""

    def __init__(self, spec: ModelSpec, model: Forward, config: Any, tokenizer: Any,
                 projection: DenseLayer, colbert: ColbertFolder | None,
                 runtime: Runtime) -> None:
        super().__init__(spec, "multivector", tokenizer, runtime, model)
        hidden_size = int(config.hidden_size)
        if projection.weight.shape[1] != hidden_size:
            raise ModelLoadError(spec.name, f"the projection has shape "
                                            f"{tuple(projection.weight.shape)}; expected "
                                            f"(token_dims, {hidden_size})")
        self.projection = projection
        self.token_dims = projection.out_features
        self.max_seq_length = common.model_max_length(spec, config, tokenizer)
        self.colbert = colbert
        self.markers = dict(colbert.markers) if colbert else {}
        self.prompts = {**(colbert.prompts if colbert else {}), **spec.prompts}
        self.similarity_name = colbert.similarity if colbert else "maxsim"
        if colbert is None:
            self.tokens = TextTokenizer(tokenizer, self.max_seq_length)
            self.queries = self.documents = SideRows(self.tokens)
        else:
            register_markers(tokenizer, list(self.markers.values()))
            self.tokens = TextTokenizer(tokenizer, self._limit(colbert.document_length))
            self.documents, self.queries = self._colbert_sides(colbert, tokenizer)
        extra: dict[str, object] = {"token_dims": self.token_dims,
                                    "scoring": self.similarity_name,
                                    "backend": model.backend}
        if colbert is not None:
            expansion = colbert.expansion
            extra["colbert"] = {
                "layout": colbert.layout, "markers": self.markers,
                "query_tokens": self.queries.tokens.limit,
                "document_tokens": self.documents.tokens.limit,
                "query_expansion": None if expansion is None else {
                    "strategy": expansion.strategy, "attend": expansion.attend,
                    "length": expansion.length},
                "skiplist": len(self.documents.skip)}
        self.info = self.describe(self.token_dims, OUTPUT_TYPES, extra)

    def _limit(self, length: int | None) -> int:
        """A side's token limit: the checkpoint's, within the model's."""
        return self.max_seq_length if length is None else min(length, self.max_seq_length)

    def _colbert_sides(self, colbert: ColbertFolder, tokenizer: Any) -> tuple[SideRows,
                                                                             SideRows]:
        skip = skiplist_ids(tokenizer, colbert.skiplist)
        expansion = colbert.expansion
        query_limit = self._limit(colbert.query_length)
        expansion_id = self.pad_id
        if expansion is not None:
            if expansion.length > self.max_seq_length:
                raise ModelLoadError(self.spec.name, f"queries expand to {expansion.length} "
                                                     f"tokens, past the model's "
                                                     f"{self.max_seq_length}")
            # `fixed` cuts a query at the expansion's length; `min` only pads it there.
            query_limit = (expansion.length if expansion.strategy == "fixed"
                           else max(query_limit, expansion.length))
            named = expansion.token
            found = (tokenizer.convert_tokens_to_ids(named) if named is not None
                     else tokenizer.mask_token_id if tokenizer.mask_token_id is not None
                     else tokenizer.eos_token_id)
            if named is not None and found == tokenizer.unk_token_id:
                raise ModelLoadError(self.spec.name, f"query_expansion token {named!r} is "
                                                     "not in the tokenizer's vocabulary")
            expansion_id = self.pad_id if found is None else int(found)
        documents = SideRows(self.tokens, skip=(skip if "document" in colbert.skiplist_sides
                                                else frozenset()), colbert=True)
        queries = SideRows(TextTokenizer(tokenizer, query_limit), expansion, expansion_id,
                           skip if "query" in colbert.skiplist_sides else frozenset(), True)
        return documents, queries

    # -- the worker thread --------------------------------------------------------

    def forward(self, items: Sequence[PreparedItem], params: Hashable) -> list[Matrix]:
        assert isinstance(params, MultiVectorParams)
        rows: list[TokenRow] = [item.payload for item in items]
        kept = self._kept_arrays if self.model.backend == "onnx" else self._kept_torch
        flat = kept(rows, params.normalize)
        counts = [int(np.count_nonzero(row.keep)) for row in rows]
        return list(np.split(flat, np.cumsum(counts)[:-1]))

    def _padded(self, rows: Sequence[TokenRow]) -> tuple[npt.NDArray[np.int64], ...]:
        """The rows' ids, attention mask (a query's expansion tokens as its row says) and
        kept positions, padded; padding is 0 in `keep` as well, so one gather drops it."""
        ids, mask = arrays.padded([row.ids for row in rows], self.pad_id)
        if any(row.attend is not None for row in rows):
            mask = arrays.padded([np.ones(len(row.ids), np.int32) if row.attend is None
                                  else row.attend for row in rows], 0)[0]
        return ids, mask, arrays.padded([row.keep for row in rows], 0)[0]

    def _kept_torch(self, rows: Sequence[TokenRow], normalize: bool) -> Matrix:
        """The kept positions' projected vectors, all rows in one (kept, token_dims)
        array; only the kept positions are projected."""
        ids, mask, keep = self._padded(rows)
        with torch.inference_mode():
            states = self.model({"input_ids": torch.from_numpy(ids).to(self.device),
                                 "attention_mask": torch.from_numpy(mask).to(self.device)})
            # float32 for the projection; the encoder's (fp16 on CUDA) output cast up.
            kept = states[torch.from_numpy(keep).to(self.device).bool()].float()
            vectors = self.projection.tensors(kept)
            if normalize:
                vectors = F.normalize(vectors, p=2, dim=-1)
            flat: Matrix = vectors.cpu().numpy().astype(np.float32)
        return flat

    def _kept_arrays(self, rows: Sequence[TokenRow], normalize: bool) -> Matrix:
        """As `_kept_torch`, in numpy from ONNX Runtime's hidden states: no torch between
        the graph and the vectors (each small torch op costs tens of microseconds)."""
        ids, mask, keep = self._padded(rows)
        hidden = self.model.run_arrays({"input_ids": ids, "attention_mask": mask})
        # ONNX Runtime runs on CPU, where numpy's view shares the tensor's memory.
        flat = self.projection.arrays(hidden[keep.astype(bool)].astype(np.float32, copy=False))
        return arrays.l2_normalized(flat) if normalize else flat

    # -- the request path (event loop) ----------------------------------------------

    def params(self, options: EncodeOptions) -> MultiVectorParams:
        output_types = common.check_output_types(options.output_types, OUTPUT_TYPES)
        normalize = True if options.normalize is None else options.normalize
        marker = self.markers.get("query" if options.is_query else "document", "")
        return MultiVectorParams(marker + self.side_prefix(options), normalize, output_types)

    def tokenize(self, texts: Sequence[str], truncate: bool, where: Sequence[str],
                 queries: int = 0) -> list[PreparedItem]:
        """Prepared items of `TokenRow`s: the ids, which positions' vectors to keep and
        where the encoder attends; the first `queries` texts are queries."""
        rows = [*self.queries.rows(texts[:queries], truncate, where[:queries]),
                *self.documents.rows(texts[queries:], truncate, where[queries:])]
        return [PreparedItem(row, len(row.ids), i) for i, row in enumerate(rows)]

    def encoded(self, value: Matrix) -> Encoded:
        return Encoded(multivector=value)

    def similarity(self, query: Matrix, docs: Sequence[Matrix]) -> list[float]:
        scores = [maxsim(query, doc) for doc in docs]
        if self.similarity_name == "meanmaxsim" and query.shape[0]:
            return [score / query.shape[0] for score in scores]
        return scores

    def similarity_us(self, query: Matrix, docs: Sequence[Matrix]) -> float:
        # ~9 ns a (query token, document token) pair at 128 dimensions, 2 cores: 100
        # documents of 200 tokens against 32 query tokens hold the loop for ~6 ms.
        pairs = int(query.shape[0]) * sum(int(doc.shape[0]) for doc in docs)
        return 0.01 * pairs * self.token_dims / 128

    def memory_bytes(self) -> int:
        return super().memory_bytes() + self.projection.weight.nbytes

    def close(self) -> None:
        self.projection = DenseLayer(np.empty((0, 0), dtype=np.float32), None, "identity")
        super().close()


def load(spec: ModelSpec, runtime: Runtime, weights: bool = True) -> MultiVectorAdapter:
    """Load an encoder directory and its projection file, offline."""
    from transformers import AutoModel

    common.refuse_loras(spec, "multivector")
    model_dir = resolve_source(spec)
    projection, colbert = read_layout(spec, model_dir)
    encoder_dir = model_dir if colbert is None else colbert.encoder_dir
    model, config, tokenizer = load_model(spec, encoder_dir, runtime, AutoModel,
                                          "last_hidden_state", weights=weights)
    return MultiVectorAdapter(spec, model, config, tokenizer, projection, colbert, runtime)


def load_front(spec: ModelSpec, runtime: Runtime) -> MultiVectorAdapter:
    """The request path alone (tokenizer, markers, token dims from the projection's
    shape), without the encoder's weights."""
    return load(spec, runtime, weights=False)
