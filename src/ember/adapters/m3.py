"""M3 encoders (BGE-M3): a dense, a sparse and a multi-vector output from one forward.

A model directory is a transformers encoder (`AutoModel`: config, safetensors weights
unless the spec sets `allow_pickle`, a fast tokenizer) with two linear heads beside it,
as FlagEmbedding saves them:

    sparse_linear.safetensors | sparse_linear.pt    weight (1, hidden), bias (1,)
    colbert_linear.safetensors | colbert_linear.pt  weight (token_dims, hidden), bias

(the `.pt` files, which BAAI/bge-m3 ships, are pickles: read only where the spec sets
`allow_pickle`, and then through torch's weights-only unpickler). Over the encoder's
last hidden states h of an input of n tokens:

- dense: h[0] (the CLS position), L2-normalized;
- sparse: w_t = relu(h_t . sparse_weight + bias) for each token, and for each vocabulary
  id the largest w_t of its occurrences, leaving out the CLS, EOS, padding and unknown
  tokens and weights of 0 (FlagEmbedding's lexical weights), as a `SparseVector` over
  the vocabulary;
- multivector: colbert_linear(h_t) for the n - 1 tokens after CLS (EOS included), each
  row L2-normalized.

A request's `params.output_types` picks any of them (none: dense); only those are
computed. `normalize: false` returns dense and multi-vector outputs unnormalized (sparse
weights never are). `score` compares by the dense vectors' cosine, or, with spec
`options: {score_weights: {dense: 0.4, sparse: 0.2, multivector: 0.4}}`, by the weighted
mean of the three scores FlagEmbedding computes: the dense cosine, the sparse dot product
over shared ids, and the multi-vector MaxSim averaged over the query's vectors; only the
outputs with a weight are made. Spec `prompts` and a request's `instruction` go before
the text as in the transformer family. LoRA adapters are not supported.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from ember.adapters import _arrays as arrays
from ember.adapters import _torch as common
from ember.adapters._backend import Forward, load_model
from ember.adapters._dense_layers import DenseLayer, read_weights
from ember.adapters._encoder import BiEncoder, Comparison
from ember.adapters._similarity import dots, maxsim, similar
from ember.adapters._tokenize import TextTokenizer
from ember.adapters.base import Encoded, EncodeOptions, Runtime, ScoreOptions, SparseVector
from ember.config import M3_HEADS, ModelSpec, m3_score_weights, resolve_source
from ember.engine.types import PreparedItem
from ember.errors import InvalidInput, ModelLoadError

OUTPUT_TYPES = ("dense", "sparse", "multivector")
Floats = npt.NDArray[np.float32]


@dataclass(frozen=True)
class M3Params:
    """The parameter group of one forward (R6): the prefix, and which outputs it makes."""

    prefix: str
    normalize: bool
    output_types: tuple[str, ...] = ("dense",)


def read_head(spec: ModelSpec, model_dir: Path, head: str, hidden_size: int,
              out_features: int | None, activation: str) -> DenseLayer:
    """One head as a linear layer from `hidden_size` (to `out_features` where fixed), its
    shapes checked before any forward."""
    tensors = read_weights(model_dir, spec.name, spec.allow_pickle, f"{head}.safetensors",
                           f"{head}.pt")
    weight, bias = tensors.get("weight"), tensors.get("bias")
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    rows = out_features or (shapes["weight"][0] if len(shapes.get("weight", ())) == 2 else 0)
    if weight is None or bias is None or shapes["weight"] != (rows, hidden_size) \
            or shapes["bias"] != (rows,):
        wanted = f"({out_features or 'token_dims'}, {hidden_size})"
        raise ModelLoadError(spec.name, f"{head}: expected tensors weight {wanted} and bias, "
                                        f"got {shapes}")
    return DenseLayer(np.ascontiguousarray(weight, dtype=np.float32),
                      np.ascontiguousarray(bias, dtype=np.float32), activation)


def score_weights(spec: ModelSpec) -> dict[str, float]:
    """The spec's `score_weights` (default: the dense cosine alone), scaled to sum to 1."""
    try:
        return m3_score_weights(spec.options.get("score_weights", {"dense": 1.0}))
    except ValueError as exc:
        raise ModelLoadError(spec.name, f"options.score_weights {exc}") from None


def lexical_weights(ids: npt.NDArray[Any], weights: Floats, unused: npt.NDArray[np.int64],
                    vocab_size: int) -> SparseVector:
    """Each vocabulary id's largest weight over its occurrences, without the `unused` ids
    and weights of 0, by ascending id."""
    keep = (weights > 0) & ~np.isin(ids, unused)
    ids, weights = ids[keep], weights[keep]
    order = np.lexsort((-weights, ids))  # by id, the largest weight first
    ids, weights = ids[order], weights[order]
    first = np.ones(len(ids), dtype=bool)
    first[1:] = ids[1:] != ids[:-1]
    return SparseVector(ids[first].astype(np.int32), weights[first].astype(np.float32),
                        vocab_size)


class M3Adapter(BiEncoder[M3Params, Encoded]):
    """One M3 encoder over an encoder directory and its two heads."""

    score_normalize = True  # FlagEmbedding's scores: cosines and MaxSim of unit rows

    def __init__(self, spec: ModelSpec, model: Forward, config: Any, tokenizer: Any,
                 runtime: Runtime, heads: tuple[DenseLayer, DenseLayer],
                 weights: dict[str, float]) -> None:
        super().__init__(spec, "m3", tokenizer, runtime, model)
        self.sparse_head, self.colbert_head = heads
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(config.vocab_size)
        self.token_dims = self.colbert_head.out_features
        self.max_seq_length = common.model_max_length(spec, config, tokenizer)
        self.tokens = TextTokenizer(tokenizer, self.max_seq_length)
        self.prompts = dict(spec.prompts)
        specials = (tokenizer.cls_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
                    tokenizer.unk_token_id)
        self.unused = np.array(sorted({int(i) for i in specials if i is not None}), np.int64)
        self.weights = weights  # score's, by output type
        # BGE-M3's dense and multivector rows are unit unless the spec says otherwise.
        self.normalize = True if spec.normalize is None else spec.normalize
        self.info = self.describe(
            self.hidden_size, OUTPUT_TYPES,
            {"token_dims": self.token_dims, "score_weights": dict(self.weights),
             "normalize": self.normalize, "backend": model.backend},
            {"dense": self.hidden_size, "sparse": self.vocab_size,
             "multivector": self.token_dims})

    # -- the worker thread --------------------------------------------------------

    def forward(self, items: Sequence[PreparedItem], params: Hashable) -> list[Encoded]:
        assert isinstance(params, M3Params)
        rows: list[arrays.IdRow] = [item.payload for item in items]
        lengths = [len(row) for row in rows]
        ids, mask = arrays.padded(rows, self.pad_id)
        with torch.inference_mode():
            if self.model.backend == "onnx":
                hidden = torch.from_numpy(self.model.run_arrays(
                    {"input_ids": ids, "attention_mask": mask}).astype(np.float32, copy=False))
            else:
                # In the encoder's dtype (fp16 on CUDA): each output casts up only its part.
                hidden = self.model({"input_ids": torch.from_numpy(ids).to(self.device),
                                     "attention_mask": torch.from_numpy(mask).to(self.device)})
            wanted = params.output_types
            dense = self._dense(hidden, params.normalize) if "dense" in wanted else None
            sparse = self._sparse(hidden, ids, lengths) if "sparse" in wanted else None
            multi = (self._multivector(hidden, mask, lengths, params.normalize)
                     if "multivector" in wanted else None)
        return [Encoded(dense=None if dense is None else dense[i],
                        sparse=None if sparse is None else sparse[i],
                        multivector=None if multi is None else multi[i])
                for i in range(len(rows))]

    def _dense(self, hidden: torch.Tensor, normalize: bool) -> Floats:
        cls = hidden[:, 0].float()
        out: Floats = (F.normalize(cls, p=2, dim=-1) if normalize else cls).cpu().numpy()
        return out

    def _sparse(self, hidden: torch.Tensor, ids: npt.NDArray[np.int64],
                lengths: Sequence[int]) -> list[SparseVector]:
        weights = self.sparse_head.tensors(hidden).squeeze(-1).float().cpu().numpy()
        return [lexical_weights(ids[i, :n], weights[i, :n], self.unused, self.vocab_size)
                for i, n in enumerate(lengths)]

    def _multivector(self, hidden: torch.Tensor, mask: npt.NDArray[np.int64],
                     lengths: Sequence[int], normalize: bool) -> list[Floats]:
        keep = mask.astype(bool)
        keep[:, 0] = False  # not the CLS position
        kept = hidden[torch.from_numpy(keep).to(hidden.device)].float()
        vectors = self.colbert_head.tensors(kept)
        if normalize:
            vectors = F.normalize(vectors, p=2, dim=-1)
        flat: Floats = vectors.cpu().numpy()
        counts = [max(n - 1, 0) for n in lengths]
        return list(np.split(flat, np.cumsum(counts)[:-1]))

    # -- the request path (event loop) ----------------------------------------------

    def params(self, options: EncodeOptions) -> M3Params:
        asked = common.check_output_types(options.output_types, OUTPUT_TYPES)
        normalize = self.normalize if options.normalize is None else options.normalize
        # In one order, so requests naming the same outputs share forwards (R6).
        return M3Params(self.side_prefix(options), normalize,
                        tuple(t for t in OUTPUT_TYPES if t in asked))

    def weights_of(self, options: ScoreOptions) -> dict[str, float]:
        """The request's score weights, else the spec's."""
        if options.score_weights is None:
            return self.weights
        try:
            return m3_score_weights(options.score_weights)
        except ValueError as exc:
            raise InvalidInput(f"options.score_weights {exc}",
                               "params.options.score_weights") from None

    def scoring(self, options: ScoreOptions) -> tuple[tuple[str, ...], Comparison[Encoded]]:
        weights = self.weights_of(options)
        return tuple(weights), partial(self.weighted, weights)

    def encoded(self, value: Encoded) -> Encoded:
        return value

    def similarity(self, query: Encoded, docs: Sequence[Encoded]) -> list[float]:
        return self.weighted(self.weights, query, docs)

    def weighted(self, weights: dict[str, float], query: Encoded,
                 docs: Sequence[Encoded]) -> list[float]:
        """The weighted mean of the scores of the outputs with a weight (weights sum to 1)."""
        total = np.zeros(len(docs))
        for kind, weight in weights.items():
            total += weight * np.asarray(_SCORES[kind](query, docs))
        return [float(s) for s in total]

    def similarity_us(self, query: Encoded, docs: Sequence[Encoded]) -> float:
        if query.multivector is None:  # made only where its score is weighed
            return 2.5 * len(docs)
        # MaxSim's pairs, as the multivector family counts them.
        pairs = len(query.multivector) * sum(len(d.multivector) for d in docs
                                             if d.multivector is not None)
        return 2.5 * len(docs) + 0.01 * pairs * self.token_dims / 128

    def memory_bytes(self) -> int:
        heads = (self.sparse_head, self.colbert_head)
        return super().memory_bytes() + sum(h.weight.nbytes for h in heads)


def _dense_scores(query: Encoded, docs: Sequence[Encoded]) -> list[float]:
    vectors = [d.dense for d in docs if d.dense is not None]
    assert query.dense is not None and len(vectors) == len(docs)
    return similar("dot", query.dense, vectors)


def _sparse_scores(query: Encoded, docs: Sequence[Encoded]) -> list[float]:
    vectors = [d.sparse for d in docs if d.sparse is not None]
    assert query.sparse is not None and len(vectors) == len(docs)
    return dots(query.sparse, vectors)


def _multivector_scores(query: Encoded, docs: Sequence[Encoded]) -> list[float]:
    """MaxSim over the query's vectors, averaged (FlagEmbedding's colbert score)."""
    matrices = [d.multivector for d in docs if d.multivector is not None]
    assert query.multivector is not None and len(matrices) == len(docs)
    count = max(len(query.multivector), 1)
    return [maxsim(query.multivector, m) / count for m in matrices]


_SCORES = {"dense": _dense_scores, "sparse": _sparse_scores,
           "multivector": _multivector_scores}


def load(spec: ModelSpec, runtime: Runtime, weights: bool = True) -> M3Adapter:
    """Load an encoder directory and its two heads, offline (the options and heads first, so
    a bad one fails the load before the encoder is read)."""
    from transformers import AutoModel

    common.refuse_loras(spec, "m3")
    weights_of_scores = score_weights(spec)
    model_dir = resolve_source(spec)
    config = common.load_config(spec, model_dir)
    hidden_size = int(config.hidden_size)
    sparse, colbert = M3_HEADS
    heads = (read_head(spec, model_dir, sparse, hidden_size, 1, "relu"),
             read_head(spec, model_dir, colbert, hidden_size, None, "identity"))
    model, config, tokenizer = load_model(spec, model_dir, runtime, AutoModel,
                                          "last_hidden_state", weights=weights)
    return M3Adapter(spec, model, config, tokenizer, runtime, heads, weights_of_scores)


def load_front(spec: ModelSpec, runtime: Runtime) -> M3Adapter:
    """The request path alone (tokenizer, heads' shapes), without the encoder's weights."""
    return load(spec, runtime, weights=False)
