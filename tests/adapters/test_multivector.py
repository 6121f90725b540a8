"""The multi-vector (ColBERT-style) family on a tiny BertModel with a projection file,
built locally and loaded through `load`, driven through a real worker."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import BertModel

from ember.adapters import multivector
from ember.adapters._similarity import Matrix, maxsim
from ember.adapters._tokenize import OFFLOAD_US, in_pool
from ember.adapters.base import (
    Encoded,
    EncodeOptions,
    ExtractOptions,
    Runtime,
    ScoreOptions,
    TaskOutput,
)
from ember.adapters.multivector import MultiVectorAdapter
from ember.config import load_catalog, parse_spec
from ember.errors import InvalidInput, ModelLoadError, UnsupportedTask
from ember.registry import Registry
from tests.adapters.serving import ServeFactory
from tests.adapters.tiny_models import build_colbert, spec_for

MULTI = EncodeOptions(output_types=("multivector",))
TOKEN_DIMS = 16
QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "the dog is big", "music and film",
        "rain in london", "a good book and a cup of tea"]
LONG = "the river and the mountain " * 30


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_colbert(tmp_path_factory.mktemp("tiny-colbert") / "colbert",
                         token_dims=TOKEN_DIMS)


def load(model_dir: Path, **fields: Any) -> MultiVectorAdapter:
    return multivector.load(spec_for(model_dir, "multivector", ("encode", "score"), **fields),
                            Runtime())


@pytest.fixture(scope="module")
def colbert(model_dir: Path) -> Iterator[MultiVectorAdapter]:
    adapter = load(model_dir)
    yield adapter
    adapter.close()


def matrices(out: TaskOutput[list[Encoded]]) -> list[Matrix]:
    found = [e.multivector for e in out.values]
    assert all(m is not None for m in found) and all(e.dense is None for e in out.values)
    return [m for m in found if m is not None]


async def test_one_unit_vector_per_token_without_specials(colbert: MultiVectorAdapter,
                                                          model_dir: Path,
                                                          serve: ServeFactory) -> None:
    texts = [QUERY, *DOCS, "cats?", ""]
    async with serve(colbert) as served:
        out = await colbert.encode(served.submit, texts, MULTI)
    # The reference: each text alone through the encoder, [CLS] and [SEP] cut off.
    model = BertModel.from_pretrained(str(model_dir))
    model.eval()  # type: ignore[no-untyped-call]
    weight = load_file(str(model_dir / "colbert_linear.safetensors"))["weight"]
    for text, matrix in zip(texts, matrices(out), strict=True):
        words = colbert.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert matrix.shape == (len(words), TOKEN_DIMS) and matrix.dtype == np.float32
        ids = colbert.tokenizer(text)["input_ids"]
        with torch.inference_mode():
            hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0, 1:-1]
        expected = torch.nn.functional.normalize(hidden @ weight.T, dim=-1).numpy()
        np.testing.assert_allclose(matrix, expected, atol=1e-5)
        np.testing.assert_allclose(np.linalg.norm(matrix, axis=1), 1.0, atol=1e-5)
    assert matrices(out)[-1].shape == (0, TOKEN_DIMS)  # no tokens, no rows
    assert out.tokens == sum(len(colbert.tokenizer(t)["input_ids"]) for t in texts)
    assert colbert.info.dims == TOKEN_DIMS and colbert.info.output_types == ("multivector",)


def test_a_padded_batch_gives_the_same_vectors(colbert: MultiVectorAdapter) -> None:
    items, params = colbert.prepare([DOCS[1], LONG, LONG + " city", DOCS[0]], MULTI)
    assert max(i.cost for i in items) > 10 * items[0].cost
    batched = colbert.forward(items, params)
    assert [m.shape[0] for m in batched] == [i.cost - 2 for i in items]
    for position in (0, 3):
        alone = colbert.forward(items[position:position + 1], params)[0]
        assert alone.shape == batched[position].shape
        assert float(np.abs(alone - batched[position]).max()) <= 1e-5


def test_truncation_and_normalize_false(colbert: MultiVectorAdapter) -> None:
    items, params = colbert.prepare([LONG], MULTI)
    assert items[0].cost == 64 and colbert.forward(items, params)[0].shape == (62, TOKEN_DIMS)
    with pytest.raises(InvalidInput, match="exceeds max_seq_length 64") as caught:
        colbert.prepare(["fine", LONG], EncodeOptions(truncate=False,
                                                      output_types=("multivector",)))
    assert caught.value.param == "items[1].text"
    raw_items, raw_params = colbert.prepare(DOCS[:1], EncodeOptions(
        normalize=False, output_types=("multivector",)))
    assert raw_params != colbert.prepare(DOCS[:1], MULTI)[1]  # different groups (R6)
    raw = colbert.forward(raw_items, raw_params)[0]
    norms = np.linalg.norm(raw, axis=1, keepdims=True)
    assert np.abs(norms - 1.0).max() > 1e-2
    np.testing.assert_allclose(raw / norms, colbert.forward(raw_items, params)[0], atol=1e-5)


async def test_maxsim_ranks_the_document_sharing_tokens_first(colbert: MultiVectorAdapter,
                                                              serve: ServeFactory) -> None:
    async with serve(colbert) as served:
        out = await colbert.score(served.submit, QUERY, DOCS, ScoreOptions())
        # No prompts: query and documents share parameters, so one request of 1+N items.
        assert served.worker.stats.batch_sizes == [1 + len(DOCS)]
        encoded = matrices(await colbert.encode(served.submit, [QUERY, *DOCS], MULTI))
    assert int(np.argmax(out.values)) == 0
    query = encoded[0].astype(np.float64)
    expected = [float(sum(max(float(q @ d) for d in doc) for q in query))
                for doc in encoded[1:]]
    np.testing.assert_allclose(out.values, expected, atol=1e-5)
    assert maxsim(query.astype(np.float32), np.zeros((0, TOKEN_DIMS), np.float32)) == 0.0


async def test_a_long_maxsim_runs_off_the_event_loop(colbert: MultiVectorAdapter,
                                                     serve: ServeFactory,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # 1,600 documents of 62 tokens against 6 query tokens: ~0.6 M token pairs, about 1 ms
    # at 16 dimensions (~6 ms at 128) that would hold every other request of the process.
    ran_in_pool: list[bool] = []
    real = colbert.similarity

    def similarity(query: Matrix, docs: Sequence[Matrix]) -> list[float]:
        ran_in_pool.append(in_pool())
        return real(query, docs)

    monkeypatch.setattr(colbert, "similarity", similarity)
    many = [LONG] * 1600
    async with serve(colbert) as served:
        short = await colbert.score(served.submit, QUERY, DOCS, ScoreOptions())
        long = await colbert.score(served.submit, QUERY, many, ScoreOptions())
        encoded = matrices(await colbert.encode(served.submit, [QUERY, LONG], MULTI))
    assert ran_in_pool == [False, True]
    np.testing.assert_allclose(long.values, maxsim(encoded[0], encoded[1]), atol=1e-5)
    assert len(long.values) == len(many)
    assert len(set(short.values)) == len(DOCS)
    query, doc = encoded[0], encoded[1]
    assert colbert.similarity_us(query, [doc] * 1600) >= OFFLOAD_US > colbert.similarity_us(
        query, [doc] * 100)


async def test_refusals(colbert: MultiVectorAdapter, model_dir: Path,
                        serve: ServeFactory) -> None:
    async with serve(colbert) as served:
        for types in [("dense",), ("multivector", "sparse")]:
            with pytest.raises(InvalidInput, match=r"returns \['multivector'\]") as caught:
                await colbert.encode(served.submit, ["text"], EncodeOptions(output_types=types))
            assert caught.value.param == "params.output_types"
        with pytest.raises(UnsupportedTask, match="encode, score"):
            await colbert.extract(served.submit, ["text"], ExtractOptions())
        with pytest.raises(InvalidInput, match="no LoRA adapters"):
            await colbert.score(served.submit, QUERY, DOCS, ScoreOptions(lora="x"))
        with pytest.raises(InvalidInput, match="at least one"):
            await colbert.encode(served.submit, [], MULTI)
    with pytest.raises(ModelLoadError, match="does not do"):
        multivector.load(spec_for(model_dir, "multivector", ("extract",)), Runtime())


def test_projection_file_options(model_dir: Path, tmp_path: Path,
                                 colbert: MultiVectorAdapter) -> None:
    other = build_colbert(tmp_path / "named", token_dims=8, projection="proj.safetensors",
                          key="linear.weight")
    named = load(other, options={"projection": "proj.safetensors",
                                 "projection_key": "linear.weight"})
    items, params = named.prepare(["the cat"], MULTI)
    assert named.forward(items, params)[0].shape == (2, 8) and named.info.dims == 8
    with pytest.raises(ModelLoadError, match="no projection file"):
        load(other)  # the default file name is not there
    with pytest.raises(ModelLoadError, match=r"no tensor 'weight'.*linear\.weight"):
        load(other, options={"projection": "proj.safetensors"})
    with pytest.raises(ModelLoadError, match="unknown options"):
        load(model_dir, options={"projection_file": "x.safetensors"})
    wrong = build_colbert(tmp_path / "wrong", token_dims=8)
    save_file({"weight": torch.zeros(8, 31)},  # the hidden size is 32
              str(wrong / "colbert_linear.safetensors"))
    with pytest.raises(ModelLoadError, match=r"expected \(token_dims, 32\)"):
        load(wrong)
    assert colbert.memory_bytes() > named.memory_bytes() > 0


@pytest.mark.parametrize("name", ["colbert-ir/colbertv2.0",
                                  "answerdotai/answerai-colbert-small-v1"])
def test_the_catalogs_colbert_entries_take_their_projection_as_named(
        name: str, tmp_path: Path) -> None:
    """Their files as the Hub has them: the projection is `linear.weight` in
    model.safetensors, of the token dimension the entry declares."""
    spec = load_catalog()[name]
    dims = int(spec.options["dims"])
    save_file({"linear.weight": torch.zeros(dims, 32)}, str(tmp_path / "model.safetensors"))
    assert multivector.read_projection(spec, tmp_path).weight.shape == (dims, 32)


def test_a_declared_dims_must_be_the_projections(model_dir: Path) -> None:
    assert load(model_dir, options={"dims": TOKEN_DIMS}).info.dims == TOKEN_DIMS
    with pytest.raises(ModelLoadError, match=r"options\.dims is 128, but the model gives 16"):
        load(model_dir, options={"dims": 128})


async def test_loads_from_a_catalog_entry_through_the_registry(model_dir: Path) -> None:
    spec = parse_spec({"name": "tiny-colbert", "adapter": "multivector",
                       "tasks": ["encode", "score"], "source": {"path": model_dir.name}},
                      "tiny-colbert.yaml", model_dir.parent)
    registry = Registry({spec.name: spec})
    try:
        async with registry.use("tiny-colbert") as model:
            assert isinstance(model.adapter, MultiVectorAdapter)
            scores = await model.adapter.score(model.submit, QUERY, DOCS, ScoreOptions())
            out = await model.adapter.encode(model.submit, DOCS[:1], MULTI)
    finally:
        await registry.close()
    assert int(np.argmax(scores.values)) == 0
    assert matrices(out)[0].shape == (6, TOKEN_DIMS)
