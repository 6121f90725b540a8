"""The cross-encoder family on a tiny BERT reranker built locally and loaded through `load`."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ember.adapters import cross_encoder
from ember.adapters.base import EncodeOptions, Runtime, ScoreOptions
from ember.adapters.cross_encoder import CrossEncoderAdapter
from ember.config import load_catalog
from ember.errors import InvalidInput, ModelLoadError, UnsupportedTask
from tests.adapters.serving import ServeFactory
from tests.adapters.tiny_models import build_cross_encoder, spec_for

QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "the dog is big", "music and film",
        "rain in london", "a good book and a cup of tea"]
LONG = "the river and the mountain " * 30


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_cross_encoder(tmp_path_factory.mktemp("tiny-ce") / "reranker")


@pytest.fixture(scope="module")
def reranker(model_dir: Path) -> CrossEncoderAdapter:
    return cross_encoder.load(spec_for(model_dir, "cross_encoder", ("score",)), Runtime())


async def score(adapter: CrossEncoderAdapter, serve: ServeFactory, query: str,
                docs: list[str]) -> list[float]:
    async with serve(adapter) as served:
        out = await adapter.score(served.submit, query, docs, ScoreOptions())
    return out.values


async def test_scores_are_batch_invariant(reranker: CrossEncoderAdapter,
                                          serve: ServeFactory) -> None:
    alone = await score(reranker, serve, QUERY, DOCS[:1])
    batched = await score(reranker, serve, QUERY, [DOCS[0], LONG, LONG + "city"])
    assert abs(alone[0] - batched[0]) <= 1e-5


async def test_scores_are_deterministic_and_in_input_order(reranker: CrossEncoderAdapter,
                                                           serve: ServeFactory) -> None:
    first = await score(reranker, serve, QUERY, DOCS)
    assert first == await score(reranker, serve, QUERY, DOCS)
    assert len({round(s, 5) for s in first}) == len(DOCS)  # distinct, so order is testable
    backwards = await score(reranker, serve, QUERY, DOCS[::-1])
    assert backwards[::-1] == pytest.approx(first, abs=1e-6)
    singles = [(await score(reranker, serve, QUERY, [doc]))[0] for doc in DOCS]
    assert singles == pytest.approx(first, abs=1e-5)
    assert all(0.0 < s < 1.0 for s in first)  # through the sigmoid


async def test_activation_none_returns_the_logit(model_dir: Path, reranker: CrossEncoderAdapter,
                                                 serve: ServeFactory) -> None:
    raw_model = cross_encoder.load(spec_for(model_dir, "cross_encoder", ("score",),
                                            options={"activation": "none"}), Runtime())
    raw = await score(raw_model, serve, QUERY, DOCS)
    sigmoid = await score(reranker, serve, QUERY, DOCS)
    assert [1 / (1 + math.exp(-x)) for x in raw] == pytest.approx(sigmoid, abs=1e-6)


async def test_a_long_pair_is_cut_from_its_longer_text_and_scores_as_sentence_transformers(
        model_dir: Path, reranker: CrossEncoderAdapter, serve: ServeFactory) -> None:
    """Found by a review: the document was cut first and the query kept whole, where
    sentence-transformers and TEI cut the longer of the two: scores of pairs over the
    limit with a long query differed (0.2664 against 0.2767)."""
    from sentence_transformers import CrossEncoder

    query = "which river runs past the old mountain town " * 5  # ~45 tokens of 64
    docs = ["paris", LONG, "the dog is big " * 4]
    assert [i.cost for i in reranker.prepare(QUERY, ["paris", LONG], truncate=True)] == [10, 64]
    items = reranker.prepare(query, docs, truncate=True)
    want = reranker.tokenizer([query] * len(docs), docs, truncation="longest_first",
                              max_length=64)
    assert [np.asarray(i.payload.input_ids).tolist() for i in items] == want["input_ids"]
    query_ids = reranker.tokenizer(query, add_special_tokens=False)["input_ids"]
    assert len(items[1].payload.input_ids) == 64
    assert items[1].payload.input_ids[1:1 + len(query_ids)].tolist() != query_ids  # cut too
    reference = CrossEncoder(str(model_dir), device="cpu", max_length=64)
    expected = reference.predict([(query, doc) for doc in docs])
    scores = await score(reranker, serve, query, docs)
    assert scores == pytest.approx([float(v) for v in expected], abs=1e-5)
    # A query that fills the limit alone is cut too rather than refused.
    assert [i.cost for i in reranker.prepare(LONG, ["paris"], truncate=True)] == [64]


def test_a_bulk_rerank_holds_its_pairs_ids_in_one_block(reranker: CrossEncoderAdapter) -> None:
    docs = [f"{DOCS[i % len(DOCS)]} {LONG[:20 + i % 120]}" for i in range(800)]
    want = reranker.tokenizer([QUERY] * len(docs), docs, truncation="longest_first",
                              max_length=64)
    items = reranker.prepare(QUERY, docs, truncate=True)
    assert [np.asarray(i.payload.input_ids).tolist() for i in items] == want["input_ids"]
    assert [np.asarray(i.payload.token_type_ids).tolist() for i in items] == want[
        "token_type_ids"]
    # One int32 buffer a field for the whole request, each pair's ids a view of it (the
    # tiny vocabulary's ids are cached small ints, so bytes held would not tell lists apart).
    tokens = sum(item.cost for item in items)
    for field in ("input_ids", "token_type_ids"):
        block = getattr(items[0].payload, field).base
        assert block is not None and block.nbytes == 4 * tokens
        assert all(getattr(item.payload, field).base is block for item in items)


def test_truncate_false_refuses_long_pairs(reranker: CrossEncoderAdapter) -> None:
    with pytest.raises(InvalidInput, match="exceeds max_seq_length 64") as caught:
        reranker.prepare(QUERY, ["paris", LONG], truncate=False)
    assert caught.value.param == "items[1].text"
    with pytest.raises(InvalidInput, match=r"\(the query alone, with the pair's special "
                       r"tokens: no document fits beside it\) exceeds") as caught:
        reranker.prepare(LONG, ["paris"], truncate=False)
    assert caught.value.param == "query.text"


async def test_refusals(reranker: CrossEncoderAdapter, model_dir: Path,
                        serve: ServeFactory) -> None:
    async with serve(reranker) as served:
        with pytest.raises(UnsupportedTask):
            await reranker.encode(served.submit, ["text"], EncodeOptions())
        with pytest.raises(InvalidInput, match="no LoRA adapters"):
            await reranker.score(served.submit, QUERY, DOCS, ScoreOptions(lora="x"))
    with pytest.raises(ModelLoadError, match="activation"):
        cross_encoder.load(spec_for(model_dir, "cross_encoder", ("score",),
                                    options={"activation": "softmax"}), Runtime())
    assert reranker.info.tasks == ("score",) and reranker.info.max_seq_length == 64


async def test_a_reranker_saved_by_sentence_transformers_is_detected_and_scores_as_it_does(
        model_dir: Path, tmp_path: Path, serve: ServeFactory) -> None:
    # sentence-transformers 4+ writes a modules.json beside a reranker's weights too.
    from sentence_transformers import CrossEncoder

    saved = tmp_path / "saved"
    reference = CrossEncoder(str(model_dir), device="cpu")
    reference.save(str(saved))
    assert (saved / "modules.json").is_file()
    spec = load_catalog(model_paths=[saved])["local/saved"]
    assert (spec.adapter, spec.tasks) == ("cross_encoder", ("score",))
    expected = reference.predict([(QUERY, doc) for doc in DOCS])  # its sigmoid, as Ember's
    scores = await score(cross_encoder.load(spec, Runtime()), serve, QUERY, DOCS)
    assert scores == pytest.approx([float(v) for v in expected], abs=1e-5)


def saved_with_activation(model_dir: Path, saved: Path, activation: object) -> Path:
    """The tiny reranker saved by sentence-transformers with `activation` in its config."""
    from sentence_transformers import CrossEncoder

    CrossEncoder(str(model_dir), device="cpu", activation_fn=activation).save(str(saved))
    return saved


async def test_the_activation_a_folder_was_saved_with_is_the_one_served(
        model_dir: Path, tmp_path: Path, serve: ServeFactory) -> None:
    import torch
    from sentence_transformers import CrossEncoder

    saved = saved_with_activation(model_dir, tmp_path / "identity", torch.nn.Identity())
    assert "Identity" in (saved / "config_sentence_transformers.json").read_text()
    spec = load_catalog(model_paths=[saved])["local/identity"]
    adapter = cross_encoder.load(spec, Runtime())
    assert adapter.info.extra["activation"] == "none"
    expected = CrossEncoder(str(saved), device="cpu").predict([(QUERY, d) for d in DOCS])
    scores = await score(adapter, serve, QUERY, DOCS)
    assert scores == pytest.approx([float(v) for v in expected], abs=1e-5)
    # The spec's option still overrides what the folder says.
    forced = cross_encoder.load(spec_for(saved, "cross_encoder", ("score",),
                                         options={"activation": "sigmoid"}), Runtime())
    squashed = await score(forced, serve, QUERY, DOCS)
    assert squashed == pytest.approx([1 / (1 + math.exp(-x)) for x in scores], abs=1e-6)
    assert min(abs(a - b) for a, b in zip(scores, squashed, strict=True)) > 0.1  # raw logits


def rewrite(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_where_a_folder_names_its_activation_in_sentence_transformers_order(
        model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import torch
    from sentence_transformers import CrossEncoder

    saved = saved_with_activation(model_dir, tmp_path / "tanh", torch.nn.Tanh())
    spec = spec_for(saved, "cross_encoder", ("score",))
    with pytest.raises(ModelLoadError, match=r"Tanh.*options\.activation"):
        cross_encoder.load(spec, Runtime())
    served = cross_encoder.load(spec_for(saved, "cross_encoder", ("score",),
                                         options={"activation": "none"}), Runtime())
    assert served.params.activation == "none"
    # A path outside torch is never imported (sentence-transformers, too, passes over it
    # without trust_remote_code) and the next place is read: here config.json's, as 4.x
    # wrote it.
    st_file, config_file = saved / "config_sentence_transformers.json", saved / "config.json"
    rewrite(st_file, lambda c: c.update(activation_fn="os.system"))
    rewrite(config_file, lambda c: c.update(
        sentence_transformers={"activation_fn": "torch.nn.modules.linear.Identity"}))
    with caplog.at_level("WARNING", logger="ember.adapters.cross_encoder"):
        adapter = cross_encoder.load(spec, Runtime())
    assert adapter.params.activation == "none" and "os.system" in caplog.text
    reference = CrossEncoder(str(saved), device="cpu")
    assert isinstance(reference.activation_fn, torch.nn.Identity)  # the library agrees
    # Folders saved before sentence-transformers 4 name it under an older key.
    rewrite(config_file, lambda c: c.pop("sentence_transformers"))
    rewrite(config_file, lambda c: c.update(
        sbert_ce_default_activation_function="torch.nn.modules.linear.Identity"))
    assert cross_encoder.load(spec, Runtime()).params.activation == "none"
    # None named anywhere usable: the default sigmoid.
    rewrite(config_file, lambda c: c.pop("sbert_ce_default_activation_function"))
    assert cross_encoder.load(spec, Runtime()).params.activation == "sigmoid"
    rewrite(st_file, lambda c: c.update(activation_fn=["not", "a", "path"]))
    with pytest.raises(ModelLoadError, match="not a class path"):
        cross_encoder.load(spec, Runtime())
    st_file.write_text("[" * 100_000)  # hostile nesting fails the load, naming the file
    with pytest.raises(ModelLoadError, match=r"config_sentence_transformers\.json"):
        cross_encoder.load(spec, Runtime())


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_long_query_is_cut_before_pairing_with_the_same_pairs_as_whole(
        model_dir: Path, side: str) -> None:
    """Found by a security review: a 200k-character query was tokenized again with each
    of 200 documents (78 s, 3.5 GB for a 201 kB body). It is cut once, past where any
    pair's cut reaches; the pairs are those the whole query gives, token for token."""
    from transformers import AutoTokenizer

    from ember.adapters._tokenize import TextTokenizer, encode_batch

    wrapper = AutoTokenizer.from_pretrained(str(model_dir))
    wrapper.truncation_side = side
    tokens = TextTokenizer(wrapper, 64)
    words = "the river and the mountain near paris " * 100
    queries = [words, "supercalifragilistic" * 200 + " " + words,  # one word of many tokens
               "élève naïve café " * 200, "東京の空は青い。" * 300]
    docs = ["x", *(" ".join(["word"] * n) for n in (20, 29, 30, 31, 32, 33, 61, 62, 63, 64,
                                                     65, 70, 71, 200))]
    for query in queries:
        cut = tokens.encode_pairs(query, docs, True, tokens.count(query))
        whole = encode_batch(tokens._cut, [(query, doc) for doc in docs])
        assert [e.ids for e in cut] == [e.ids for e in whole], query[:40]
        assert [e.type_ids for e in cut] == [e.type_ids for e in whole]


def test_a_long_query_over_many_documents_is_paired_cut(
        reranker: CrossEncoderAdapter) -> None:
    """Each pair once held the whole query: 40,000 words over 200 documents took 16 s."""
    query, docs = "word " * 40_000, ["a document"] * 200
    firsts = reranker.tokens._firsts(query, docs)
    assert len(set(firsts)) == 1 and len(firsts[0]) < 1_000  # one cut, shared by every pair
    items = reranker.prepare(query, docs, truncate=True)
    assert len(items) == 200 and all(item.cost == 64 for item in items)
