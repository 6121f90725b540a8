"""Multi-vector (ColBERT-style) encoders: one vector per token, scored by MaxSim.

On disk, a model directory is a transformers encoder (`AutoModel`: config,
safetensors weights unless the spec sets `allow_pickle`, a fast tokenizer) plus
the projection from the encoder's hidden size to the token dimension:

    colbert_linear.safetensors    one tensor "weight", shape (token_dims, hidden_size)

applied as `hidden @ weight.T` (no bias). Spec `options`:

- `projection` (default "colbert_linear.safetensors"): the projection's file,
  relative to the model directory; always safetensors.
- `projection_key` (default "weight"): the tensor's name in that file.
- `dims` (optional): the token dimension, as the catalog shows it; checked at load.

An item's output is a float32 array (num_tokens, token_dims): the projected
last hidden state of each of its tokens, without padding and without the
special tokens the tokenizer's template adds ([CLS], [SEP]), each row
L2-normalized (a request's `normalize: false` returns the raw projections).
Text that yields no tokens gives a (0, token_dims) array.

`score` is MaxSim over normalized rows: the sum, over the query's tokens, of the
largest cosine with any of the document's tokens (0 when either side has no
tokens). Spec `prompts` (`query`, `document`) and a request's `instruction` are
put before the text as in the transformer family; differing prompts keep the two
sides in separate forwards (R6). ColBERT's own query/document marker tokens and
query [MASK] augmentation are not applied; a checkpoint that relies on them
scores differently here. The only output type is "multivector". LoRA adapters
are not supported.
"""

from __future__ import annotations

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
from ember.adapters._backend import Forward, ForwardElsewhere, load_model
from ember.adapters._encoder import BiEncoder
from ember.adapters._tokenize import TextTokenizer
from ember.adapters.base import Encoded, EncodeOptions, Runtime
from ember.config import ModelSpec, resolve_source
from ember.engine.types import PreparedItem
from ember.errors import ModelLoadError

OUTPUT_TYPES = ("multivector",)
OPTIONS = ("projection", "projection_key", "dims")
PROJECTION_FILE = "colbert_linear.safetensors"
PROJECTION_KEY = "weight"
Matrix = npt.NDArray[np.float32]


@dataclass(frozen=True)
class MultiVectorParams:
    """The parameter group of one forward (R6)."""

    prefix: str
    normalize: bool
    output_types: tuple[str, ...] = OUTPUT_TYPES


@dataclass(frozen=True, slots=True)
class TokenRow:
    """A tokenized input: the payload of one prepared item. `keep` is 1 at the
    positions whose vectors are returned (not a template special token)."""

    ids: list[int]
    keep: list[int]


def maxsim(query: Matrix, doc: Matrix) -> float:
    """Sum over query rows of the best dot product with a document row (unit rows: cosine)."""
    if query.shape[0] == 0 or doc.shape[0] == 0:
        return 0.0
    sims = query.astype(np.float64) @ doc.astype(np.float64).T
    return float(sims.max(axis=1).sum())


def read_projection(spec: ModelSpec, model_dir: Path) -> torch.Tensor:
    """The projection weight named by the spec's options (read before the encoder,
    so a missing file fails the load early)."""
    from safetensors import safe_open

    options: Mapping[str, Any] = spec.options
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ModelLoadError(spec.name, f"unknown options {unknown}; the multivector family "
                                        f"takes {list(OPTIONS)}")
    name = str(options.get("projection", PROJECTION_FILE))
    key = str(options.get("projection_key", PROJECTION_KEY))
    path = model_dir / name
    if path.suffix != ".safetensors" or not path.is_file():
        raise ModelLoadError(spec.name, f"no projection file {path} (options.projection: a "
                                        f".safetensors file in the model directory)")
    with safe_open(str(path), framework="pt") as file:
        names = sorted(file.keys())
        if key not in names:
            raise ModelLoadError(spec.name, f"{path.name} has no tensor {key!r} "
                                            f"(options.projection_key); it has {names}")
        weight: torch.Tensor = file.get_tensor(key)
    return weight.float()


class MultiVectorAdapter(BiEncoder[MultiVectorParams, Matrix]):
    """One multi-vector encoder over an encoder directory and its projection."""

    def __init__(self, spec: ModelSpec, model: Forward, config: Any, tokenizer: Any,
                 projection: torch.Tensor, runtime: Runtime) -> None:
        super().__init__(spec, "multivector", tokenizer, runtime, model)
        hidden_size = int(config.hidden_size)
        if projection.ndim != 2 or projection.shape[1] != hidden_size:
            raise ModelLoadError(spec.name, f"the projection has shape "
                                            f"{tuple(projection.shape)}; expected "
                                            f"(token_dims, {hidden_size})")
        self.max_seq_length = common.model_max_length(spec, config, tokenizer)
        self.tokens = TextTokenizer(tokenizer, self.max_seq_length)
        self.prompts = dict(spec.prompts)
        self.token_dims = int(projection.shape[0])
        # Kept in float32 on the device; the encoder's (fp16 on CUDA) output is cast up.
        # An API process without the weights keeps it where it is (it runs no forward).
        self.projection = (projection if isinstance(model, ForwardElsewhere)
                           else projection.to(self.device))
        self.info = self.describe(self.token_dims, OUTPUT_TYPES,
                                  {"token_dims": self.token_dims, "scoring": "maxsim",
                                   "backend": model.backend})

    # -- the worker thread --------------------------------------------------------

    def forward(self, items: Sequence[PreparedItem], params: Hashable) -> list[Matrix]:
        assert isinstance(params, MultiVectorParams)
        rows: list[TokenRow] = [item.payload for item in items]
        kept = self._kept_arrays if self.model.backend == "onnx" else self._kept_torch
        flat = kept(rows, params.normalize)
        return list(np.split(flat, np.cumsum([sum(row.keep) for row in rows])[:-1]))

    def _kept_torch(self, rows: Sequence[TokenRow], normalize: bool) -> Matrix:
        """The kept positions' projected vectors, all rows in one (kept, token_dims)
        array."""
        ids_rows = [row.ids for row in rows]
        with torch.inference_mode():
            ids = common.pad(ids_rows, self.pad_id, self.device)
            mask = common.attention_mask(ids_rows, self.device)
            hidden = self.model({"input_ids": ids, "attention_mask": mask})
            vectors = hidden.float() @ self.projection.T  # (batch, longest, token_dims)
            if normalize:
                vectors = F.normalize(vectors, p=2, dim=-1)
            # Padding is 0 in `keep` as well, so one gather drops both.
            keep = common.pad([row.keep for row in rows], 0, self.device).bool()
            flat: Matrix = vectors[keep].cpu().numpy().astype(np.float32)
        return flat

    def _kept_arrays(self, rows: Sequence[TokenRow], normalize: bool) -> Matrix:
        """As `_kept_torch`, in numpy from ONNX Runtime's hidden states: no torch between
        the graph and the vectors (each small torch op costs tens of microseconds)."""
        ids, mask = arrays.padded([row.ids for row in rows], self.pad_id)
        hidden = self.model.run_arrays({"input_ids": ids, "attention_mask": mask})
        keep = arrays.padded([row.keep for row in rows], 0)[0].astype(bool)
        # Only the kept positions are projected: padding and template tokens never are.
        # ONNX Runtime runs on CPU, where numpy's view shares the tensor's memory.
        flat: Matrix = hidden[keep].astype(np.float32, copy=False) @ self.projection.numpy().T
        return arrays.l2_normalized(flat) if normalize else flat

    # -- the request path (event loop) ----------------------------------------------

    def params(self, options: EncodeOptions) -> MultiVectorParams:
        output_types = common.check_output_types(options.output_types, OUTPUT_TYPES)
        normalize = True if options.normalize is None else options.normalize
        return MultiVectorParams(self.side_prefix(options), normalize, output_types)

    def tokenize(self, texts: Sequence[str], truncate: bool,
                 where: Sequence[str]) -> list[PreparedItem]:
        """Prepared items of `TokenRow`s: the ids, and which positions' vectors to keep."""
        return [PreparedItem(TokenRow(e.ids, [1 - s for s in e.special_tokens_mask]),
                             len(e), i)
                for i, e in enumerate(self.tokens.encode(texts, truncate, where))]

    def encoded(self, value: Matrix) -> Encoded:
        return Encoded(multivector=value)

    def similarity(self, query: Matrix, docs: Sequence[Matrix]) -> list[float]:
        return [maxsim(query, doc) for doc in docs]

    def similarity_us(self, query: Matrix, docs: Sequence[Matrix]) -> float:
        # ~9 ns a (query token, document token) pair at 128 dimensions, 2 cores: 100
        # documents of 200 tokens against 32 query tokens hold the loop for ~6 ms.
        pairs = int(query.shape[0]) * sum(int(doc.shape[0]) for doc in docs)
        return 0.01 * pairs * self.token_dims / 128

    def memory_bytes(self) -> int:
        projection = self.projection.numel() * self.projection.element_size()
        return super().memory_bytes() + projection

    def close(self) -> None:
        self.projection = torch.empty(0)
        super().close()


def load(spec: ModelSpec, runtime: Runtime, weights: bool = True) -> MultiVectorAdapter:
    """Load an encoder directory and its projection file, offline."""
    from transformers import AutoModel

    common.refuse_loras(spec, "multivector")
    model_dir = resolve_source(spec)
    projection = read_projection(spec, model_dir)
    model, config, tokenizer = load_model(spec, model_dir, runtime, AutoModel,
                                          "last_hidden_state", weights=weights)
    return MultiVectorAdapter(spec, model, config, tokenizer, projection, runtime)


def load_front(spec: ModelSpec, runtime: Runtime) -> MultiVectorAdapter:
    """The request path alone (tokenizer, token dims from the projection's shape),
    without the encoder's weights."""
    return load(spec, runtime, weights=False)
