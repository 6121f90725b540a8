"""Tiny BERT models written to a folder, for tests that need an architecture the
shipped packages lack (LoRA, cross-encoders). Random weights, seeded: the
outputs mean nothing, but they are deterministic and they load through the
real loaders. Each builder takes well under a second.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import WordPiece
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    PreTrainedTokenizerFast,
)

from ember.config import ModelSpec, Source

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORD_LIST = """the a an of to in and is was for on with as by at from that this it be are
search engine query document model text vector score rank result index token batch
cat dog fish bird tree river mountain city country paris france london england
capital weather rain sun music song film book apple banana bread coffee tea water
what where who how why when which big small fast slow good bad new old"""
WORDS = WORD_LIST.split()
SUFFIXES = ["##s", "##ed", "##ing", "##er", "##ly"]
MAX_POSITIONS = 128


def vocabulary(extra: Sequence[str] = ()) -> list[str]:
    return [*SPECIALS, *WORDS, *SUFFIXES, *".,?!", *extra]


def write_tokenizer(directory: Path, max_length: int, extra: Sequence[str] = (),
                    token_types: bool = False) -> None:
    """A lower-casing WordPiece tokenizer with BERT's special-token template (`extra`
    tokens at the end of its vocabulary); with `token_types`, its model reads each
    token's segment too, as a BERT reranker's does."""
    vocab = {token: i for i, token in enumerate(vocabulary(extra))}
    tok = Tokenizer(WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    cls, sep = vocab["[CLS]"], vocab["[SEP]"]
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    inputs = ["input_ids", *(["token_type_ids"] if token_types else []), "attention_mask"]
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]", model_max_length=max_length,
        model_input_names=inputs)
    fast.save_pretrained(str(directory))


def bert_config(**overrides: Any) -> BertConfig:
    settings: dict[str, Any] = {
        "vocab_size": len(vocabulary()), "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "intermediate_size": 64,
        "max_position_embeddings": MAX_POSITIONS, "pad_token_id": 0,
        **overrides}
    return BertConfig(**settings)


def _write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")


def build_bi_encoder(directory: Path, *, seed: int = 0, max_seq_length: int = 64,
                     pooling: str = "mean", normalize: bool = True) -> Path:
    """A sentence-transformers-style directory around a tiny BertModel."""
    torch.manual_seed(seed)
    BertModel(bert_config()).save_pretrained(str(directory), safe_serialization=True)
    write_tokenizer(directory, max_seq_length)
    modules: list[dict[str, object]] = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    _write_json(directory / "modules.json", modules)
    _write_json(directory / "1_Pooling" / "config.json", {
        "word_embedding_dimension": 32,
        "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean"})
    _write_json(directory / "sentence_bert_config.json",
                {"max_seq_length": max_seq_length, "do_lower_case": False})
    return directory


def build_cross_encoder(directory: Path, *, seed: int = 0, max_seq_length: int = 64) -> Path:
    """A one-label BertForSequenceClassification directory (a reranker's shape)."""
    torch.manual_seed(seed)
    # A wider init than BERT's 0.02 so that different pairs get visibly different scores.
    model = BertForSequenceClassification(bert_config(num_labels=1, initializer_range=0.2))
    model.save_pretrained(str(directory), safe_serialization=True)
    write_tokenizer(directory, max_seq_length, token_types=True)
    return directory


def build_lora(base_dir: Path, directory: Path, *, seed: int,
               task_type: str = "FEATURE_EXTRACTION") -> Path:
    """A PEFT LoRA adapter for the model in `base_dir`, with random (nonzero) A and B."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base: torch.nn.Module
    if task_type == "SEQ_CLS":
        base = BertForSequenceClassification.from_pretrained(str(base_dir))
    else:
        base = BertModel.from_pretrained(str(base_dir))
    # init_lora_weights=False draws B at random too, so the adapter changes outputs.
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"],
                        init_lora_weights=False, task_type=task_type)
    with warnings.catch_warnings():
        # peft 0.21 reads an attribute transformers 5 deprecated; nothing to act on.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing",
                                category=FutureWarning)
        peft_model = get_peft_model(base, config)
    peft_model.save_pretrained(str(directory))
    return directory


def spec_for(path: Path, adapter: str, tasks: tuple[str, ...], *,
             loras: Mapping[str, Path] | None = None, **fields: Any) -> ModelSpec:
    """A catalog entry pointing at a local directory."""
    return ModelSpec(name=f"tiny/{path.name}", adapter=adapter, source=Source(path=path),
                     tasks=tasks, loras=dict(loras or {}), **fields)


def build_sparse_encoder(directory: Path, *, seed: int = 0, max_seq_length: int = 64,
                         bias: float = -1.0) -> Path:
    """A BertForMaskedLM directory (a SPLADE model's shape). A negative output bias
    leaves many vocabulary entries without a positive logit anywhere, so the pooled
    vectors have zeros to drop, as trained SPLADE models do."""
    from transformers import BertForMaskedLM

    torch.manual_seed(seed)
    model = BertForMaskedLM(bert_config(initializer_range=0.2))
    with torch.no_grad():
        model.cls.predictions.bias.fill_(bias)
    model.save_pretrained(str(directory), safe_serialization=True)
    write_tokenizer(directory, max_seq_length)
    return directory


def build_colbert(directory: Path, *, seed: int = 0, max_seq_length: int = 64,
                  token_dims: int = 16, projection: str = "colbert_linear.safetensors",
                  key: str = "weight") -> Path:
    """A BertModel directory with a (token_dims, hidden) projection file beside it.
    Position embeddings are scaled down so a token's vector is mostly its identity,
    so that documents sharing the query's tokens score visibly higher under MaxSim."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    model = BertModel(bert_config())
    with torch.no_grad():
        model.embeddings.position_embeddings.weight.mul_(0.1)
    model.save_pretrained(str(directory), safe_serialization=True)
    write_tokenizer(directory, max_seq_length)
    weight = torch.randn(token_dims, int(model.config.hidden_size)) / token_dims ** 0.5
    save_file({key: weight.contiguous()}, str(directory / projection))
    return directory


def build_st_pipeline(directory: Path, base: Path, *, pooling: str = "mean",
                      dense: Sequence[tuple[int, torch.nn.Module | None, bool]] = (),
                      normalize: bool = True, include_prompt: bool = True,
                      prompts: Mapping[str, str] | None = None, seed: int = 0,
                      similarity: str | None = None) -> Path:
    """A directory saved by sentence-transformers itself (its current formats): the
    bi-encoder in `base`, then Pooling, Dense layers (out features, activation, bias) and
    Normalize, with `similarity` as its similarity function. Returns the directory; load
    it with SentenceTransformer for the reference."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    torch.manual_seed(seed)
    encoder = SentenceTransformer(str(base), device="cpu")[0]
    modules: list[torch.nn.Module] = [encoder, models.Pooling(
        encoder.get_embedding_dimension(), pooling_mode=pooling, include_prompt=include_prompt)]
    width = encoder.get_embedding_dimension()
    for out, activation, bias in dense:
        layer = models.Dense(width, out, bias=bias, activation_function=activation)
        torch.nn.init.normal_(layer.linear.weight, std=0.5)  # visible against the default
        modules.append(layer)
        width = out
    if normalize:
        modules.append(models.Normalize())
    SentenceTransformer(modules=modules, device="cpu", prompts=dict(prompts or {}),
                        similarity_fn_name=similarity).save(str(directory))
    return directory


# ColBERT's markers as BERT's vocabulary has them (Stanford-NLP ColBERT's defaults).
UNUSED_MARKERS = ("[unused0]", "[unused1]")


def colbert_bert(directory: Path, *, seed: int, max_seq_length: int,
                 extra: Sequence[str] = ()) -> BertModel:
    """A tiny BertModel and tokenizer saved in `directory` (the encoder of a ColBERT)."""
    torch.manual_seed(seed)
    model = BertModel(bert_config(vocab_size=len(vocabulary(extra))))
    with torch.no_grad():  # a token's vector mostly its identity: MaxSim ranks visibly
        model.embeddings.position_embeddings.weight.mul_(0.1)
    model.save_pretrained(str(directory), safe_serialization=True)
    write_tokenizer(directory, max_seq_length, extra)
    return model


def build_st_colbert(directory: Path, base: Path, *, token_dims: int = 16,
                     expansion: Mapping[str, Any] | None = None,
                     query_length: int | None = None, document_length: int | None = None,
                     skiplist: Sequence[str] = tuple(".,?!"),
                     skiplist_tasks: Sequence[str] = ("document",),
                     prompts: Mapping[str, str] | None = None,
                     similarity: str | None = None, seed: int = 1) -> Path:
    """A ColBERT saved by sentence-transformers itself (its MultiVectorEncoder) over the
    encoder in `base`; load it with MultiVectorEncoder for the reference."""
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.base.modules.dense import Dense
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    torch.manual_seed(seed)
    encoder = Transformer(str(base), query_expansion=dict(expansion) if expansion else None,
                          query_length=query_length, document_length=document_length)
    dense = Dense(in_features=32, out_features=token_dims, bias=False,
                  activation_function=torch.nn.Identity(),
                  module_input_name="token_embeddings")
    mask = MultiVectorMask(skiplist_words=list(skiplist), skiplist_tasks=list(skiplist_tasks))
    MultiVectorEncoder(modules=[encoder, dense, mask,
                                Normalize(module_input_name="token_embeddings")],
                       device="cpu", prompts=dict(prompts or {}),
                       similarity_fn_name=similarity).save(str(directory))
    return directory


def build_pylate_colbert(directory: Path, *, markers: tuple[str, str] = ("[Q] ", "[D] "),
                         settings: Mapping[str, Any] | None = None, token_dims: int = 16,
                         max_seq_length: int = 64, seed: int = 2) -> Path:
    """A ColBERT as PyLate saves it: the encoder at the root with its markers added to
    the tokenizer (PyLate adds them as tokens of their own, trailing space included),
    a Dense module in 1_Dense, and PyLate's settings in config_sentence_transformers.json.
    Markers the vocabulary already has (`[unused0]`) are not added; a setting given as
    None is left out of the file."""
    from safetensors.torch import save_file

    added = [m for m in markers if m not in UNUSED_MARKERS]
    colbert_bert(directory, seed=seed, max_seq_length=max_seq_length,
                 extra=[m for m in markers if m in UNUSED_MARKERS])
    if added:
        fast = PreTrainedTokenizerFast.from_pretrained(str(directory))
        fast.add_tokens(added)
        fast.save_pretrained(str(directory))
        model = BertModel.from_pretrained(str(directory))
        model.resize_token_embeddings(len(fast))
        model.save_pretrained(str(directory), safe_serialization=True)
    _write_json(directory / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"}])
    _write_json(directory / "sentence_bert_config.json",
                {"max_seq_length": max_seq_length - 1, "do_lower_case": False})
    _write_json(directory / "1_Dense" / "config.json", {
        "in_features": 32, "out_features": token_dims, "bias": False,
        "activation_function": "torch.nn.modules.linear.Identity"})
    weight = torch.randn(token_dims, 32) / token_dims ** 0.5
    save_file({"linear.weight": weight.contiguous()},
              str(directory / "1_Dense" / "model.safetensors"))
    config = {"model_type": "ColBERT", "query_prefix": markers[0],
              "document_prefix": markers[1], "query_length": 12, "document_length": 20,
              "attend_to_expansion_tokens": False, "similarity_fn_name": "cosine",
              **(settings or {})}
    _write_json(directory / "config_sentence_transformers.json",  # None: left out
                {key: value for key, value in config.items() if value is not None})
    return directory


def build_stanford_colbert(directory: Path, *, metadata: Mapping[str, Any] | None = None,
                           token_dims: int = 16, max_seq_length: int = 64,
                           seed: int = 3) -> Path:
    """A ColBERT as Stanford-NLP's ColBERT saves it: `architectures: [HF_ColBERT]`, the
    encoder's weights under `bert.` with the projection `linear.weight` beside them in
    model.safetensors, and artifact.metadata (left out where `metadata` is None)."""
    from safetensors.torch import save_file

    model = colbert_bert(directory, seed=seed, max_seq_length=max_seq_length,
                         extra=UNUSED_MARKERS)
    tensors = {f"bert.{name}": value.contiguous() for name, value in
               model.state_dict().items()}
    tensors["linear.weight"] = (torch.randn(token_dims, 32) / token_dims ** 0.5).contiguous()
    save_file(tensors, str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["HF_ColBERT"]
    _write_json(directory / "config.json", config)
    if metadata is not None:
        _write_json(directory / "artifact.metadata", dict(metadata))
    return directory


XLMR_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # XLM-RoBERTa's ids 0-4


def build_m3(directory: Path, *, seed: int = 0, max_seq_length: int = 64,
             token_dims: int = 16, heads: str = ".pt") -> Path:
    """A tiny XLMRobertaModel with BGE-M3's two heads beside it (`heads`: the files'
    suffix, ".pt" as FlagEmbedding saves them or ".safetensors"), and a WordPiece
    tokenizer with XLM-RoBERTa's special tokens and template."""
    from safetensors.torch import save_file
    from transformers import XLMRobertaConfig, XLMRobertaModel

    vocab = {token: i for i, token in enumerate([*XLMR_SPECIALS, *vocabulary()[5:]])}
    torch.manual_seed(seed)
    config = XLMRobertaConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2,
                              num_attention_heads=2, intermediate_size=64,
                              max_position_embeddings=MAX_POSITIONS + 2, pad_token_id=1,
                              bos_token_id=0, eos_token_id=2)
    XLMRobertaModel(config, add_pooling_layer=False).save_pretrained(
        str(directory), safe_serialization=True)
    for name, out_features in (("sparse_linear", 1), ("colbert_linear", token_dims)):
        layer = torch.nn.Linear(32, out_features)
        if name == "sparse_linear":  # most tokens weigh > 0, as a trained head's do
            torch.nn.init.constant_(layer.bias, 1.0)
        state = layer.state_dict()
        if heads == ".pt":
            torch.save(state, directory / f"{name}.pt")
        else:
            save_file({k: v.contiguous() for k, v in state.items()},
                      str(directory / f"{name}.safetensors"))
    tok = Tokenizer(WordPiece(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", vocab["<s>"]), ("</s>", vocab["</s>"])])
    PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", cls_token="<s>",
        sep_token="</s>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>",
        model_max_length=max_seq_length).save_pretrained(str(directory))
    return directory
