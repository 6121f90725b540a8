"""ColBERT checkpoints, read as sentence-transformers' MultiVectorEncoder reads them.

Three layouts carry a ColBERT model's own handling of text besides its weights:

- sentence-transformers' own (`model_type: MultiVectorEncoder`): modules.json lists the
  Transformer (its sentence_bert_config.json holds `query_length`, `document_length` and
  `query_expansion`), a token-level Dense, a MultiVectorMask (the skiplist) and Normalize;
- PyLate's (`model_type: ColBERT`, or its keys in config_sentence_transformers.json):
  Transformer and Dense, with the markers (`query_prefix`, `document_prefix`), lengths,
  `do_query_expansion`, `attend_to_expansion_tokens` and `skiplist_words` beside them;
- Stanford-NLP ColBERT's (`architectures: [HF_ColBERT]` in config.json): the projection
  is `linear.weight` in model.safetensors, the rest in artifact.metadata.

From these: a marker token before each side's text (`[unused0]`, `[Q] `...), queries
padded to a fixed length with [MASK] tokens that every position scores (query
expansion), documents cut to their own length with punctuation left out of their
vectors (the skiplist), and every token's vector projected and normalized, [CLS] and
[SEP] included. Anything else the files ask for is refused at load, naming the file.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ember.adapters._dense_layers import DenseLayer, read_dense
from ember.adapters._torch import st_modules
from ember.errors import ModelLoadError
from ember.model_files import read_model_file

Layout = Literal["sentence-transformers", "pylate", "stanford"]
SIMILARITIES = ("maxsim", "meanmaxsim")
EXPANSION_KEYS = frozenset({"strategy", "attend", "token", "length"})
STANFORD_MARKERS = {"query": "[unused0]", "document": "[unused1]"}
PYLATE_KEYS = ("query_length", "document_length", "query_expansion", "do_query_expansion",
               "attend_to_expansion_tokens", "attend_to_mask_tokens", "query_prefix",
               "document_prefix", "skiplist_words")
DEFAULT_EXPANSION_LENGTH = 32  # ColBERT's query length where a checkpoint names none
MODULE_TYPES = {  # modules.json types, by class name, as each layout writes them
    "Transformer": "transformer", "Dense": "dense", "MultiVectorMask": "mask",
    "Normalize": "normalize"}


@dataclass(frozen=True)
class Expansion:
    """Queries padded with `token` (None: the tokenizer's mask token) to `length`
    positions, each scored; `fixed` also cuts them there, `min` only pads."""

    strategy: Literal["fixed", "min"]
    attend: bool  # whether the encoder attends to the padded positions
    token: str | None
    length: int


@dataclass(frozen=True)
class ColbertFolder:
    """What a ColBERT checkpoint says about its text, and its projection."""

    layout: Layout
    encoder_dir: Path  # the Transformer module's folder
    markers: dict[str, str]  # side -> the marker put before its text, as a token
    prompts: dict[str, str]  # side -> a prompt after the marker
    expansion: Expansion | None
    query_length: int | None
    document_length: int | None
    skiplist: tuple[str, ...]
    skiplist_sides: tuple[str, ...]
    projection: DenseLayer
    similarity: str


def read_colbert_folder(model_dir: Path, model: str, allow_pickle: bool,
                        stanford_projection: Callable[[], DenseLayer]) -> ColbertFolder | None:
    """The folder's ColBERT settings, in the order sentence-transformers looks for them
    (a modules.json first); None for a folder in none of the three layouts.
    `stanford_projection` reads the projection of a Stanford-NLP checkpoint."""
    st_file = model_dir / "config_sentence_transformers.json"
    st_config: dict[str, Any] = read_model_file(st_file, model) if st_file.is_file() else {}
    kind = st_config.get("model_type")
    if (model_dir / "modules.json").is_file():
        if kind == "MultiVectorEncoder":
            return _sentence_transformers(model_dir, model, st_config, allow_pickle)
        if kind == "ColBERT" or any(key in st_config for key in PYLATE_KEYS):
            return _pylate(model_dir, model, st_config, allow_pickle)
        return None
    config_file = model_dir / "config.json"
    config = read_model_file(config_file, model) if config_file.is_file() else {}
    if "HF_ColBERT" in (config.get("architectures") or []):
        return _stanford(model_dir, model, stanford_projection())
    return None


def _sentence_transformers(model_dir: Path, model: str, st_config: dict[str, Any],
                           allow_pickle: bool) -> ColbertFolder:
    modules = _modules(model_dir, model)
    order = [kind for kind, _ in modules]
    if order not in (["transformer", "dense", "mask", "normalize"],
                     ["transformer", "dense", "normalize", "mask"]):
        raise ModelLoadError(model, f"modules.json: Ember runs a MultiVectorEncoder of "
                                    f"Transformer, Dense, MultiVectorMask and Normalize; this "
                                    f"one has {order}")
    paths = dict(modules)
    backbone = _module_config(paths["transformer"], "sentence_bert_config.json", model)
    task = backbone.get("transformer_task", "feature-extraction")
    if task != "feature-extraction":
        raise ModelLoadError(model, f"sentence_bert_config.json: transformer_task {task!r} "
                                    "is not served; Ember runs text encoders")
    dense_config = _module_config(paths["dense"], "config.json", model)
    if dense_config.get("module_input_name", "token_embeddings") != "token_embeddings":
        raise ModelLoadError(model, f"{paths['dense'].name}/config.json: a Dense module that "
                                    "does not project each token is not a ColBERT projection")
    mask = _module_config(paths["mask"], "config.json", model)
    if mask.get("keep_only_token_ids") is not None:
        raise ModelLoadError(model, f"{paths['mask'].name}/config.json: keep_only_token_ids "
                                    "(image-patch documents) is not served")
    sides = mask.get("skiplist_tasks") or ["document"]
    if isinstance(sides, str):
        sides = [sides]
    if not isinstance(sides, list) or not set(sides) <= {"query", "document"}:
        raise ModelLoadError(model, f"{paths['mask'].name}/config.json: skiplist_tasks "
                                    f"{sides!r} is not a list of query and document")
    if st_config.get("truncate_dim") is not None:
        raise ModelLoadError(model, "config_sentence_transformers.json: truncate_dim is not "
                                    "served")
    return ColbertFolder(
        layout="sentence-transformers", encoder_dir=paths["transformer"], markers={},
        prompts=_prompts(st_config, model),
        expansion=_expansion(backbone.get("query_expansion"), model),
        query_length=_length(backbone, "query_length", model),
        document_length=_length(backbone, "document_length", model),
        skiplist=_words(mask.get("skiplist_words") or [], model), skiplist_sides=tuple(sides),
        projection=read_dense(paths["dense"], model, dense_config, None, allow_pickle),
        similarity=_similarity(st_config, model))


def _pylate(model_dir: Path, model: str, st_config: dict[str, Any],
            allow_pickle: bool) -> ColbertFolder:
    modules = _modules(model_dir, model)
    order = [kind for kind, _ in modules]
    if order != ["transformer", "dense"]:
        raise ModelLoadError(model, f"modules.json: Ember runs a PyLate ColBERT of "
                                    f"Transformer and Dense; this one has {order}")
    paths = dict(modules)
    dense = paths["dense"]
    markers, prompts = {}, _prompts(st_config, model)
    for key, side in (("query_prefix", "query"), ("document_prefix", "document")):
        if key in st_config:
            marker = _text(st_config[key] or "", key, model)
            markers[side] = marker
            prompts[side] = prompts.get(side, "").removeprefix(marker)
    if "query_expansion" in st_config:
        expansion = _expansion(st_config["query_expansion"], model)
        query_length = _length(st_config, "query_length", model)
    elif st_config.get("do_query_expansion") is False:
        expansion, query_length = None, _length(st_config, "query_length", model)
    else:  # PyLate's query_length is the expansion's length
        attend = st_config.get("attend_to_expansion_tokens",
                               st_config.get("attend_to_mask_tokens"))
        length = _length(st_config, "query_length", model) or DEFAULT_EXPANSION_LENGTH
        expansion, query_length = Expansion("fixed", bool(attend), None, length), None
    words = st_config.get("skiplist_words")
    return ColbertFolder(
        layout="pylate", encoder_dir=paths["transformer"], markers=markers, prompts=prompts,
        expansion=expansion,
        query_length=query_length, document_length=_length(st_config, "document_length", model),
        skiplist=_words(list(string.punctuation) if words is None else words, model),
        skiplist_sides=("document",),
        projection=read_dense(dense, model, _module_config(dense, "config.json", model), None,
                              allow_pickle),
        similarity=_similarity(st_config, model))


def _stanford(model_dir: Path, model: str, projection: DenseLayer) -> ColbertFolder:
    file = model_dir / "artifact.metadata"
    metadata: dict[str, Any] = read_model_file(file, model) if file.is_file() else {}
    markers = {side: _text(metadata.get(f"{key}_token_id") or default, f"{key}_token_id",
                           model) + " "
               for (side, default), key in zip(STANFORD_MARKERS.items(), ("query", "doc"),
                                               strict=True)}
    length = _length(metadata, "query_maxlen", model) or DEFAULT_EXPANSION_LENGTH
    skiplist = list(string.punctuation) if metadata.get("mask_punctuation", True) else []
    return ColbertFolder(
        layout="stanford", encoder_dir=model_dir, markers=markers, prompts={},
        expansion=Expansion("fixed", bool(metadata.get("attend_to_mask_tokens")), None, length),
        query_length=None, document_length=_length(metadata, "doc_maxlen", model),
        skiplist=tuple(skiplist), skiplist_sides=("document",), projection=projection,
        similarity="maxsim")


def _modules(model_dir: Path, model: str) -> list[tuple[str, Path]]:
    """modules.json's modules as Ember's kinds; a module Ember does not run is refused."""
    out = []
    for name, folder in st_modules(model_dir, model):
        if name not in MODULE_TYPES:
            raise ModelLoadError(model, f"modules.json: a {name or 'nameless'} module is not "
                                        "run by Ember's multivector family")
        out.append((MODULE_TYPES[name], folder))
    return out


def _module_config(folder: Path, name: str, model: str) -> dict[str, Any]:
    file = folder / name
    config: dict[str, Any] = read_model_file(file, model) if file.is_file() else {}
    return config


def _expansion(value: object, model: str) -> Expansion | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not set(value) <= EXPANSION_KEYS:
        raise ModelLoadError(model, f"query_expansion {value!r} is not an object of "
                                    f"{sorted(EXPANSION_KEYS)}")
    strategy, attend, token = value.get("strategy"), value.get("attend", False), value.get("token")
    length = value.get("length")
    if strategy not in ("fixed", "min") or not isinstance(attend, bool) \
            or not (token is None or isinstance(token, str)) \
            or not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise ModelLoadError(model, f"query_expansion {value!r}: strategy is fixed or min, "
                                    "attend a boolean, token a string or null, length a "
                                    "whole number >= 1")
    return Expansion(strategy, attend, token, length)


def _length(config: dict[str, Any], key: str, model: str) -> int | None:
    value = config.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelLoadError(model, f"{key} is {value!r}, where a whole number >= 1 is "
                                    "expected")
    return value


def _text(value: object, key: str, model: str) -> str:
    if not isinstance(value, str):
        raise ModelLoadError(model, f"{key} is {value!r}, where a text is expected")
    return value


def _words(value: object, model: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(w, str) for w in value):
        raise ModelLoadError(model, "skiplist_words is not a list of texts")
    return tuple(value)


def _prompts(st_config: dict[str, Any], model: str) -> dict[str, str]:
    prompts = st_config.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise ModelLoadError(model, "config_sentence_transformers.json: prompts is not a "
                                    "JSON object of names and texts")
    return {str(k): v for k, v in prompts.items() if k in ("query", "document") and v}


def _similarity(st_config: dict[str, Any], model: str) -> str:
    named = st_config.get("similarity_fn_name")
    if named in (None, "cosine", "dot"):  # PyLate's saves name cosine; MaxSim is meant
        return "maxsim"
    if named not in SIMILARITIES:
        raise ModelLoadError(model, f"config_sentence_transformers.json: similarity_fn_name "
                                    f"{named!r} is not one of {SIMILARITIES}")
    return str(named)


def register_markers(tokenizer: Any, markers: Sequence[str]) -> None:
    """Make each marker the tokenizer knows one token, as sentence-transformers does, so
    that putting it before the text gives the token ColBERT inserted when it trained
    (`[unused0]` would otherwise be cut into `[`, `unused`, `##0`, `]`). A marker the
    vocabulary lacks stays text."""
    added = set(getattr(tokenizer, "added_tokens_encoder", None) or {})
    vocab = tokenizer.get_vocab()
    wanted = []
    for value in markers:
        if not value.split():
            continue
        for marker in (value, value.split(None, 1)[0]):
            if marker not in added and marker not in vocab:
                continue
            if tokenizer.tokenize(marker) != [marker]:
                wanted.append(marker)
            break
    if wanted:
        from transformers import AddedToken

        tokenizer.add_special_tokens({"additional_special_tokens": [
            AddedToken(marker, normalized=False, special=True) for marker in wanted]})


def skiplist_ids(tokenizer: Any, words: Sequence[str]) -> frozenset[int]:
    """The skiplist's token ids; a word that is not one token is dropped (it would skip
    every unknown token), as sentence-transformers drops it."""
    unknown_id, unknown = tokenizer.unk_token_id, tokenizer.unk_token
    ids = {int(tokenizer.convert_tokens_to_ids(word)) for word in words}
    return frozenset(i for i in ids if i != unknown_id or unknown in words)
