"""The sparse (SPLADE-style) family on a tiny BertForMaskedLM built locally and loaded
through `load`, driven through a real worker."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import BertForMaskedLM

from ember.adapters import sparse
from ember.adapters.base import (
    Encoded,
    EncodeOptions,
    ExtractOptions,
    Runtime,
    ScoreOptions,
    SparseVector,
    TaskOutput,
)
from ember.adapters.sparse import SparseAdapter
from ember.config import load_catalog, parse_spec
from ember.errors import InvalidInput, ModelLoadError, UnsupportedTask
from ember.registry import Registry
from tests.adapters.serving import ServeFactory
from tests.adapters.tiny_models import build_sparse_encoder, spec_for, vocabulary

SPARSE = EncodeOptions(output_types=("sparse",))
TEXTS = ["the cat", "paris is the capital of france", "what is the weather in london?",
         "a big dog and a small bird", "music"]
LONG = "the river and the mountain " * 30
VOCAB = len(vocabulary())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sparse_encoder(tmp_path_factory.mktemp("tiny-splade") / "splade")


def load(model_dir: Path, **fields: Any) -> SparseAdapter:
    return sparse.load(spec_for(model_dir, "sparse", ("encode", "score"), **fields),
                       Runtime())


@pytest.fixture(scope="module")
def splade(model_dir: Path) -> Iterator[SparseAdapter]:
    adapter = load(model_dir)
    yield adapter
    adapter.close()


def vectors(out: TaskOutput[list[Encoded]]) -> list[SparseVector]:
    found = [e.sparse for e in out.values]
    assert all(v is not None for v in found) and all(e.dense is None for e in out.values)
    return [v for v in found if v is not None]


def reference(model: BertForMaskedLM, ids: list[int]) -> np.ndarray:
    """The SPLADE formula, straight from the masked LM, for one text alone (no padding)."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    return torch.log1p(torch.relu(logits)).max(dim=0).values.numpy()


def dense_of(vector: SparseVector) -> np.ndarray:
    out = np.zeros(vector.dims, dtype=np.float64)
    out[vector.indices] = vector.values
    return out


async def test_vectors_are_sorted_unique_positive_and_follow_the_formula(
        splade: SparseAdapter, model_dir: Path, serve: ServeFactory) -> None:
    async with serve(splade) as served:
        out = await splade.encode(served.submit, TEXTS, SPARSE)
    model = BertForMaskedLM.from_pretrained(str(model_dir))
    model.eval()  # type: ignore[no-untyped-call]
    token_ids = [splade.tokenizer(t)["input_ids"] for t in TEXTS]
    assert out.tokens == sum(len(ids) for ids in token_ids)
    for ids, vector in zip(token_ids, vectors(out), strict=True):
        assert vector.dims == VOCAB
        assert vector.indices.dtype == np.int32 and vector.values.dtype == np.float32
        assert np.all(np.diff(vector.indices) > 0)  # sorted, hence unique
        assert np.all(vector.values > 0)
        assert 0 < vector.indices.size < VOCAB  # only the non-zero entries
        expected = reference(model, ids)
        np.testing.assert_array_equal(vector.indices, np.flatnonzero(expected > 0))
        np.testing.assert_allclose(vector.values, expected[vector.indices], atol=1e-5)
    assert splade.info.dims == VOCAB and splade.info.output_types == ("sparse",)


def test_a_padded_batch_gives_the_same_vectors(splade: SparseAdapter) -> None:
    items, params = splade.prepare([TEXTS[0], LONG, LONG + " city", TEXTS[1]], SPARSE)
    assert max(i.cost for i in items) > 10 * items[0].cost
    batched = splade.forward(items, params)
    for position in (0, 3):
        alone = splade.forward(items[position:position + 1], params)[0]
        np.testing.assert_array_equal(alone.indices, batched[position].indices)
        np.testing.assert_allclose(alone.values, batched[position].values, atol=1e-5)


def test_a_forward_split_in_chunks_gives_the_same_vectors(model_dir: Path,
                                                          splade: SparseAdapter) -> None:
    items, params = splade.prepare([*TEXTS, LONG], SPARSE)
    whole = splade.forward(items, params)
    chunked = load(model_dir)
    chunked.logit_budget = 1  # one row per chunk
    for a, b in zip(whole, chunked.forward(items, params), strict=True):
        np.testing.assert_array_equal(a.indices, b.indices)
        np.testing.assert_allclose(a.values, b.values, atol=1e-5)


@pytest.mark.parametrize(("options", "top_k", "threshold"), [
    ({"top_k": 5}, 5, 0.0),
    ({"threshold": 0.5}, None, 0.5),
    ({"top_k": 3, "threshold": 0.2}, 3, 0.2),
])
def test_pruning_keeps_the_largest_weights(model_dir: Path, splade: SparseAdapter,
                                           options: dict[str, object], top_k: int | None,
                                           threshold: float) -> None:
    pruned = load(model_dir, options=options)
    assert pruned.info.extra["top_k"] == top_k and pruned.info.extra["threshold"] == threshold
    items, params = splade.prepare(TEXTS, SPARSE)
    for full, cut in zip(splade.forward(items, params), pruned.forward(items, params),
                         strict=True):
        assert np.all(np.diff(cut.indices) > 0) and np.all(cut.values >= threshold)
        keep = full.values >= threshold
        order = np.argsort(-full.values[keep], kind="stable")[:top_k]
        expected = np.sort(full.indices[keep][order])
        np.testing.assert_array_equal(cut.indices, expected)
        np.testing.assert_allclose(cut.values, dense_of(full)[expected], atol=1e-6)
        if top_k is not None:
            assert cut.indices.size == min(top_k, int(keep.sum()))


@pytest.mark.parametrize("options", [{"top_k": 0}, {"top_k": "5"}, {"top_k": True},
                                     {"threshold": -1}, {"threshold": "high"},
                                     {"topk": 5}])
def test_bad_pruning_options_fail_the_load(model_dir: Path, options: dict[str, object]) -> None:
    with pytest.raises(ModelLoadError, match="options"):
        load(model_dir, options=options)


async def test_score_is_the_sparse_dot_product(splade: SparseAdapter,
                                               serve: ServeFactory) -> None:
    query, docs = "what is the capital of france", TEXTS
    async with serve(splade) as served:
        out = await splade.score(served.submit, query, docs, ScoreOptions())
        # No prompts: query and documents share parameters, so one request of 1+N items.
        assert served.worker.stats.batch_sizes == [1 + len(docs)]
        encoded = vectors(await splade.encode(served.submit, [query, *docs],
                                              EncodeOptions(is_query=True,
                                                            output_types=("sparse",))))
    expected = [float(dense_of(encoded[0]) @ dense_of(v)) for v in encoded[1:]]
    np.testing.assert_allclose(out.values, expected, rtol=1e-5)
    assert all(s > 0 for s in out.values) and len(set(out.values)) == len(docs)


def test_dots_match_the_dense_dot_products_including_empty_and_disjoint_vectors() -> None:
    rng = np.random.default_rng(3)

    def random_vector(count: int) -> SparseVector:
        indices = np.sort(rng.choice(500, count, replace=False)).astype(np.int32)
        return SparseVector(indices, rng.random(count).astype(np.float32), 500)

    query = random_vector(40)
    docs = [random_vector(n) for n in (0, 1, 60, 200, 500)]
    disjoint = np.setdiff1d(np.arange(500), query.indices)[:30].astype(np.int32)
    docs.append(SparseVector(disjoint, np.ones(30, np.float32), 500))
    got = sparse.dots(query, docs)
    expected = [float(dense_of(query) @ dense_of(doc)) for doc in docs]
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    assert got[0] == 0.0 and got[-1] == 0.0 and got[4] > 0


async def test_prompts_split_query_and_document_sides(model_dir: Path,
                                                      serve: ServeFactory) -> None:
    adapter = load(model_dir, prompts={"query": "what ", "document": "the "})
    _, q_params = adapter.prepare(["cat"], EncodeOptions(is_query=True, output_types=("sparse",)))
    _, d_params = adapter.prepare(["cat"], SPARSE)
    assert (q_params.prefix, d_params.prefix) == ("what ", "the ")
    async with serve(adapter) as served:
        out = await adapter.score(served.submit, "cat", ["cat", "dog"], ScoreOptions())
        assert sorted(served.worker.stats.batch_sizes) == [1, 2]  # two sides, two forwards
    assert len(out.values) == 2 and out.tokens == 4 * 3


async def test_refusals(splade: SparseAdapter, model_dir: Path, serve: ServeFactory) -> None:
    async with serve(splade) as served:
        for types in [("dense",), ("sparse", "multivector")]:
            with pytest.raises(InvalidInput, match=r"returns \['sparse'\]") as caught:
                await splade.encode(served.submit, ["text"], EncodeOptions(output_types=types))
            assert caught.value.param == "params.output_types"
        with pytest.raises(UnsupportedTask, match="encode, score"):
            await splade.extract(served.submit, ["text"], ExtractOptions())
        with pytest.raises(InvalidInput, match="no LoRA adapters") as caught:
            await splade.encode(served.submit, ["text"],
                                EncodeOptions(lora="x", output_types=("sparse",)))
        assert caught.value.param == "params.options.lora"
        with pytest.raises(InvalidInput) as caught:
            await splade.encode(served.submit, ["text"],
                                EncodeOptions(normalize=True, output_types=("sparse",)))
        assert caught.value.param == "params.options.normalize"
        with pytest.raises(InvalidInput, match="at least one"):
            await splade.score(served.submit, "query", [], ScoreOptions())
        with pytest.raises(InvalidInput, match="exceeds max_seq_length 64") as caught:
            await splade.score(served.submit, "query", ["fine", LONG],
                               ScoreOptions(truncate=False))
        assert caught.value.param == "items[1].text"
    items, _ = splade.prepare(["cat", LONG], SPARSE)
    assert [i.cost for i in items] == [3, 64]  # truncated by default
    with pytest.raises(ModelLoadError, match="does not do"):
        sparse.load(spec_for(model_dir, "sparse", ("extract",)), Runtime())
    with pytest.raises(ModelLoadError, match="LoRA"):
        load(model_dir, loras={"a": model_dir})


async def test_loads_from_a_catalog_entry_through_the_registry(model_dir: Path) -> None:
    spec = parse_spec({"name": "tiny-splade", "adapter": "sparse", "tasks": ["encode"],
                       "source": {"path": model_dir.name}, "options": {"top_k": 4}},
                      "tiny-splade.yaml", model_dir.parent)
    registry = Registry({spec.name: spec})
    try:
        async with registry.use("tiny-splade") as model:
            assert isinstance(model.adapter, SparseAdapter)
            out = await model.adapter.encode(model.submit, TEXTS, SPARSE)
            with pytest.raises(UnsupportedTask):
                await model.adapter.score(model.submit, "q", ["d"], ScoreOptions())
    finally:
        await registry.close()
    assert [v.indices.size for v in vectors(out)] == [4] * len(TEXTS)


def test_no_output_types_means_the_models_own(splade: SparseAdapter) -> None:
    _, params = splade.prepare(["x"], EncodeOptions())
    assert params.output_types == ("sparse",)


@pytest.fixture
def saved_by_st(model_dir: Path, tmp_path: Path) -> Path:
    """The tiny SPLADE model as sentence-transformers 5+ saves a sparse encoder: a
    modules.json with the masked LM and a SpladePooling module."""
    from sentence_transformers import SparseEncoder

    SparseEncoder(str(model_dir), device="cpu").save(str(tmp_path / "saved"))
    return tmp_path / "saved"


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")  # the reference's
async def test_a_sparse_encoder_saved_by_sentence_transformers_encodes_as_it_does(
        saved_by_st: Path, serve: ServeFactory) -> None:
    from sentence_transformers import SparseEncoder

    spec = load_catalog(model_paths=[saved_by_st])["local/saved"]
    assert (spec.adapter, spec.tasks) == ("sparse", ("encode", "score"))
    texts = ["the cat is big", "paris is the capital of france"]
    expected = SparseEncoder(str(saved_by_st), device="cpu").encode(
        texts, convert_to_tensor=True, convert_to_sparse_tensor=False).numpy()
    adapter = sparse.load(spec, Runtime())
    async with serve(adapter) as served:
        out = await adapter.encode(served.submit, texts, EncodeOptions())
    got = np.stack([dense_of(v) for v in vectors(out)])
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("change", "message"), [
    ({"pooling_strategy": "sum"}, "pooling_strategy 'sum'"),
    ({"activation_function": "log1p_relu"}, "activation_function 'log1p_relu'"),
])
def test_a_splade_pooling_this_family_does_not_run_is_refused(
        saved_by_st: Path, change: dict[str, str], message: str) -> None:
    config_file = saved_by_st / "1_SpladePooling" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **change}))
    with pytest.raises(ModelLoadError, match=message):
        load(saved_by_st)


def test_a_sparse_module_this_family_does_not_run_is_refused(saved_by_st: Path) -> None:
    modules_file = saved_by_st / "modules.json"
    modules = json.loads(modules_file.read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_Router",
                    "type": "sentence_transformers.base.modules.router.Router"})
    modules_file.write_text(json.dumps(modules))
    with pytest.raises(ModelLoadError, match="a Router module is not one the sparse family"):
        load(saved_by_st)
