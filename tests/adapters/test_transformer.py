"""The transformer family on the shipped all-MiniLM-L6-v2 and on tiny local models (LoRA)."""

from __future__ import annotations

import asyncio
import gc
import json
import random
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from transformers import BertModel

from ember.adapters import transformer
from ember.adapters._similarity import Vector
from ember.adapters.base import (
    Encoded,
    EncodeOptions,
    ExtractOptions,
    Runtime,
    ScoreOptions,
    TaskOutput,
)
from ember.adapters.transformer import TransformerAdapter
from ember.config import DEFAULT_MODEL, load_catalog, resolve_source
from ember.engine import WorkerConfig
from ember.errors import InvalidInput, ModelLoadError, UnsupportedTask
from ember.ipc.batch import items_to_wire
from tests.adapters.serving import ServeFactory
from tests.adapters.tiny_models import (
    bert_config,
    build_bi_encoder,
    build_lora,
    build_st_pipeline,
    spec_for,
)

PROSE = """search engines rank documents by relevance to a query while embeddings map
text into vectors so that similar meanings land close together the model reads
tokens attends across the sentence and pools the hidden states into one vector
cats sleep dogs bark rivers flow mountains rise cities grow markets fall prices
rise weather changes quickly in spring music plays softly at night café naïve
résumé 2024 3.14 e-mail U.S. New York Paris Tokyo"""
WORDS = PROSE.split()


def corpus(count: int = 60, seed: int = 7) -> list[str]:
    """Deterministic texts from 1 to ~400 words; a few pass the 256-token limit."""
    rng = random.Random(seed)
    lengths = [1, 2, 3, 5, 8, 400, 300] + [rng.choice([rng.randint(1, 20), rng.randint(20, 120),
                                                       rng.randint(120, 350)])
                                           for _ in range(count - 7)]
    texts = []
    for n in lengths:
        words = [rng.choice(WORDS) for _ in range(n)]
        texts.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ""]))
    return texts


@pytest.fixture(scope="module")
def minilm() -> Iterator[TransformerAdapter]:
    adapter = transformer.load(load_catalog()[DEFAULT_MODEL], Runtime())
    yield adapter
    adapter.close()


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    return resolve_source(load_catalog()[DEFAULT_MODEL])


def dense(out: TaskOutput[list[Encoded]]) -> list[Vector]:
    vectors = [e.dense for e in out.values]
    assert all(v is not None for v in vectors)
    return [v for v in vectors if v is not None]


def tokens(adapter: TransformerAdapter, text: str) -> int:
    return len(adapter.tokenizer(text, verbose=False)["input_ids"])


# -- the shipped model ------------------------------------------------------------


async def test_embeddings_match_sentence_transformers(minilm: TransformerAdapter,
                                                      minilm_dir: Path,
                                                      serve: ServeFactory) -> None:
    texts = corpus()
    assert len(texts) >= 50 and any(tokens(minilm, t) > 256 for t in texts)
    reference = SentenceTransformer(str(minilm_dir), device="cpu").encode(
        texts, batch_size=16, convert_to_numpy=True)
    async with serve(minilm, WorkerConfig(max_batch_items=16)) as served:
        out = await minilm.encode(served.submit, texts, EncodeOptions())
    ours = np.stack(dense(out))
    assert ours.shape == (len(texts), 384) and ours.dtype == np.float32
    cos = (ours * reference).sum(1) / (np.linalg.norm(ours, axis=1)
                                       * np.linalg.norm(reference, axis=1))
    assert cos.min() >= 0.9999, f"worst text {int(cos.argmin())}: cosine {cos.min()}"
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_padding_does_not_change_an_embedding(minilm: TransformerAdapter) -> None:
    texts = corpus()
    short, longs = "Cats sleep in the sun.", [t for t in texts if tokens(minilm, t) > 200][:3]
    items, params = minilm.prepare([short, *longs], EncodeOptions())
    alone = minilm.forward(items[:1], params)[0]
    batched = minilm.forward(items, params)
    assert max(i.cost for i in items) > 20 * items[0].cost
    assert float(np.abs(alone - batched[0]).max()) <= 1e-5
    # And a long text in the middle of a batch matches itself alone.
    assert float(np.abs(minilm.forward(items[1:2], params)[0] - batched[1]).max()) <= 1e-5


def test_a_bulk_request_holds_its_ids_in_one_compact_block(minilm: TransformerAdapter) -> None:
    texts = [f"passage {i}: {PROSE[i % 200:][:300]}" for i in range(1024)]
    expected = [minilm.tokenizer(t, truncation=True, max_length=256)["input_ids"]
                for t in texts]
    # Counted where Ember's adapters allocate, so no other thread of the process adds to it.
    adapters = [tracemalloc.Filter(True, "*/ember/adapters/*")]
    minilm.prepare(texts[:8], EncodeOptions())  # caches of a first call are not the request's
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot().filter_traces(adapters)
        items, _ = minilm.prepare(texts, EncodeOptions())
        after = tracemalloc.take_snapshot().filter_traces(adapters)
    finally:
        tracemalloc.stop()
    held = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert [np.asarray(item.payload).tolist() for item in items] == expected
    assert [item.cost for item in items] == [len(ids) for ids in expected]
    # A list of Python ints holds ~40 bytes a token; the block 4, plus a view an item.
    tokens = sum(item.cost for item in items)
    assert held < 8 * tokens + 300 * len(items), (held, tokens)


async def test_token_ids_encode_as_their_text_and_pack_with_texts(
        minilm: TransformerAdapter, serve: ServeFactory) -> None:
    text = "search engines rank documents"
    ids = minilm.tokenizer(text, add_special_tokens=False)["input_ids"]
    sent: list[Any] = []
    async with serve(minilm) as served:
        async def submit(items: Any, params: Any, lora: str | None) -> Any:
            sent.extend(items)
            return await served.submit(items, params, lora)

        by_ids = await minilm.encode_ids(submit, [ids], EncodeOptions())
        by_text = await minilm.encode(served.submit, [text], EncodeOptions())
    assert np.allclose(dense(by_ids)[0], dense(by_text)[0], atol=1e-6)
    # A client's ids and tokenized texts gathered in one message still cross as one block.
    texts, _ = minilm.prepare([text, "more"], EncodeOptions())
    assert items_to_wire([*sent, *texts])[0][0] == "tokens"


async def test_long_text_is_truncated_by_default(minilm: TransformerAdapter,
                                                 serve: ServeFactory) -> None:
    long = "relevance " * 600
    items, _ = minilm.prepare(["short text", long], EncodeOptions())
    assert [i.cost for i in items] == [4, 256]
    async with serve(minilm) as served:
        out = await minilm.encode(served.submit, ["short text", long], EncodeOptions())
    assert out.tokens == 4 + 256


def test_truncate_false_refuses_a_long_text(minilm: TransformerAdapter) -> None:
    long = "relevance " * 600
    with pytest.raises(InvalidInput) as caught:
        minilm.prepare(["fine", long], EncodeOptions(truncate=False))
    assert caught.value.param == "items[1].text"
    assert f"{tokens(minilm, long)} tokens" in caught.value.message
    assert "max_seq_length 256" in caught.value.message
    assert "truncate=true" in caught.value.message


async def test_score_puts_the_relevant_document_first(minilm: TransformerAdapter,
                                                      serve: ServeFactory) -> None:
    docs = ["The stock market fell sharply on Monday.",
            "A simple recipe for baking homemade bread in your oven.",
            "Football results from the weekend league matches."]
    async with serve(minilm) as served:
        out = await minilm.score(served.submit, "How do I bake bread at home?", docs,
                                 ScoreOptions())
        encoded = await minilm.encode(served.submit, ["How do I bake bread at home?", *docs],
                                      EncodeOptions())
        # No prompts: query and documents share parameters, so one request of 1+N items.
        assert served.worker.stats.batch_sizes[0] == 1 + len(docs)
    assert int(np.argmax(out.values)) == 1
    vectors = dense(encoded)
    expected = [float(np.dot(vectors[0], v)) for v in vectors[1:]]  # unit vectors
    np.testing.assert_allclose(out.values, expected, atol=1e-5)


async def test_refusals(minilm: TransformerAdapter, serve: ServeFactory) -> None:
    async with serve(minilm) as served:
        with pytest.raises(UnsupportedTask, match="encode, score"):
            await minilm.extract(served.submit, ["text"], ExtractOptions())
        with pytest.raises(InvalidInput, match="no LoRA adapters") as caught:
            await minilm.encode(served.submit, ["text"], EncodeOptions(lora="nope"))
        assert caught.value.param == "params.options.lora"
        with pytest.raises(InvalidInput, match="sparse") as caught:
            await minilm.encode(served.submit, ["text"], EncodeOptions(output_types=("sparse",)))
        with pytest.raises(InvalidInput, match="at least one"):
            await minilm.score(served.submit, "query", [], ScoreOptions())
    assert minilm.info.dims == 384 and minilm.info.max_seq_length == 256
    assert minilm.memory_bytes() > 80_000_000


def test_normalize_option_and_info(minilm: TransformerAdapter) -> None:
    items, plain = minilm.prepare(["a cat sleeps"], EncodeOptions(normalize=False))
    _, unit = minilm.prepare(["a cat sleeps"], EncodeOptions())
    assert plain != unit  # different parameter groups (R6)
    raw = minilm.forward(items, plain)[0]
    assert abs(float(np.linalg.norm(raw)) - 1.0) > 1e-3
    np.testing.assert_allclose(raw / np.linalg.norm(raw), minilm.forward(items, unit)[0],
                               atol=1e-6)


# -- tiny local models: prompts and LoRA -------------------------------------------


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-bi")
    base = build_bi_encoder(root / "base")
    return {"base": base, "a": build_lora(base, root / "lora-a", seed=1),
            "b": build_lora(base, root / "lora-b", seed=2)}


@pytest.fixture(scope="module")
def with_loras(tiny_dirs: dict[str, Path]) -> TransformerAdapter:
    loras = {"a": tiny_dirs["a"], "b": tiny_dirs["b"]}
    return transformer.load(spec_for(tiny_dirs["base"], "transformer", ("encode", "score"),
                                     loras=loras), Runtime())


def test_a_declared_dims_is_checked_at_load(tiny_dirs: dict[str, Path]) -> None:
    # The catalog's options.dims is what `ember models` shows before any load.
    spec = spec_for(tiny_dirs["base"], "transformer", ("encode",), options={"dims": 32})
    assert transformer.load(spec, Runtime()).info.dims == 32
    wrong = spec_for(tiny_dirs["base"], "transformer", ("encode",), options={"dims": 768})
    with pytest.raises(ModelLoadError, match=r"options\.dims is 768, but the model gives 32"):
        transformer.load(wrong, Runtime())


TINY_TEXTS = ["the cat is big", "paris is the capital of france", "a slow river",
              "what is the weather in london"]


async def test_lora_changes_the_output(with_loras: TransformerAdapter,
                                       tiny_dirs: dict[str, Path],
                                       serve: ServeFactory) -> None:
    plain = transformer.load(spec_for(tiny_dirs["base"], "transformer", ("encode",)), Runtime())
    async with serve(with_loras) as served:
        got = {name: await with_loras.encode(served.submit, TINY_TEXTS, EncodeOptions(lora=name))
               for name in (None, "a", "b", None)}
    async with serve(plain) as served:
        reference = await plain.encode(served.submit, TINY_TEXTS, EncodeOptions())
    vectors = {name: np.stack(dense(out)) for name, out in got.items()}
    base = np.stack(dense(reference))
    np.testing.assert_allclose(vectors[None], base, atol=1e-6)  # adapters off = the base
    assert np.abs(vectors["a"] - base).max() > 1e-3
    assert np.abs(vectors["b"] - base).max() > 1e-3
    assert np.abs(vectors["a"] - vectors["b"]).max() > 1e-3
    assert with_loras.info.loras == ("a", "b")


async def test_a_batch_never_mixes_loras(with_loras: TransformerAdapter,
                                         serve: ServeFactory) -> None:
    names = [None, "a", "b"]
    references = {}
    for name in names:  # each text alone under each adapter
        items, params = with_loras.prepare(TINY_TEXTS, EncodeOptions())
        with_loras.set_lora(name)
        references[name] = [with_loras.forward([item], params)[0] for item in items]
    with_loras.set_lora(None)
    async with serve(with_loras) as served:
        served.worker.pause()  # queue every request first, so batches form deterministically
        futures = []
        for i, text in enumerate(TINY_TEXTS * 3):
            items, params = with_loras.prepare([text], EncodeOptions())
            name = names[i % 3]
            futures.append((name, text, await served.worker.submit(items, params, lora=name)))
        served.worker.resume()
        results = await asyncio.gather(*(f for _, _, f in futures))
        stats = served.worker.stats
    assert sorted(stats.batch_loras, key=str) == [None, "a", "b"]
    assert stats.batch_sizes == [4, 4, 4]
    for (name, text, _), result in zip(futures, results, strict=True):
        expected = references[name][TINY_TEXTS.index(text)]
        assert float(np.abs(result.values[0] - expected).max()) <= 1e-5


async def test_unknown_lora_lists_the_known_ones(with_loras: TransformerAdapter,
                                                 serve: ServeFactory) -> None:
    async with serve(with_loras) as served:
        with pytest.raises(InvalidInput, match="known LoRAs: a, b") as caught:
            await with_loras.score(served.submit, "query", ["doc"], ScoreOptions(lora="c"))
    assert caught.value.param == "params.options.lora"


async def test_prompts_split_query_and_document_sides(tiny_dirs: dict[str, Path],
                                                      serve: ServeFactory) -> None:
    spec = spec_for(tiny_dirs["base"], "transformer", ("encode", "score"),
                    prompts={"query": "query: ", "document": "passage: "})
    adapter = transformer.load(spec, Runtime())
    q_items, q_params = adapter.prepare(["the cat"], EncodeOptions(is_query=True))
    d_items, d_params = adapter.prepare(["the cat"], EncodeOptions())
    assert q_params != d_params and q_params.prefix == "query: "
    assert q_items[0].cost == d_items[0].cost == 2 + 2 + 2  # specials, prompt, text
    async with serve(adapter) as served:
        out = await adapter.score(served.submit, "the cat", ["the cat", "a river"],
                                  ScoreOptions())
        assert sorted(served.worker.stats.batch_sizes) == [1, 2]  # two sides, two forwards
    assert len(out.values) == 2 and out.tokens == 6 * 3
    _, params = adapter.prepare(["x"], EncodeOptions(is_query=True, instruction="find"))
    assert params.prefix == "find query: "


def test_a_missing_lora_directory_fails_the_load(tiny_dirs: dict[str, Path],
                                                 tmp_path: Path) -> None:
    spec = spec_for(tiny_dirs["base"], "transformer", ("encode",),
                    loras={"gone": tmp_path / "nowhere"})
    with pytest.raises(FileNotFoundError, match=r"'gone'.*adapter_config\.json"):
        transformer.load(spec, Runtime())


def test_an_instruction_on_a_model_without_prompts_is_refused(
        minilm: TransformerAdapter) -> None:
    with pytest.raises(InvalidInput, match="has no prompts configured") as caught:
        minilm.prepare(["x"], EncodeOptions(instruction="Represent this for retrieval"))
    assert caught.value.param == "params.instruction"


# -- what a sentence-transformers directory says, against sentence-transformers --------

ONNX, TORCH = Runtime(backend="onnx"), Runtime(backend="torch")
REFERENCE_TEXTS = ["the cat is big", "paris is the capital of france", "a slow river",
                   "what is the weather in london today and tomorrow"]


def ember_vectors(directory: Path, runtime: Runtime, options: EncodeOptions) -> np.ndarray:
    adapter = transformer.load(spec_for(directory, "transformer", ("encode",)), runtime)
    items, params = adapter.prepare(REFERENCE_TEXTS, options)
    return np.stack(adapter.forward(items, params))


def reference(directory: Path, **encode: Any) -> np.ndarray:
    model = SentenceTransformer(str(directory), device="cpu")
    return np.asarray(model.encode(REFERENCE_TEXTS, convert_to_numpy=True, **encode))


@pytest.mark.parametrize("runtime", [ONNX, TORCH], ids=["onnx", "torch"])
@pytest.mark.parametrize("mode", ["mean", "cls", "max", "lasttoken"])
def test_each_pooling_mode_matches_sentence_transformers(
        tiny_dirs: dict[str, Path], tmp_path: Path, mode: str, runtime: Runtime) -> None:
    # Saved by sentence-transformers 5+ (`pooling_mode`, not one boolean a mode).
    directory = build_st_pipeline(tmp_path / mode, tiny_dirs["base"], pooling=mode,
                                  normalize=False)
    np.testing.assert_allclose(ember_vectors(directory, runtime, EncodeOptions()),
                               reference(directory), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("runtime", [ONNX, TORCH], ids=["onnx", "torch"])
def test_dense_layers_run_between_pooling_and_normalize(
        tiny_dirs: dict[str, Path], tmp_path: Path, runtime: Runtime) -> None:
    directory = build_st_pipeline(tmp_path / "dense", tiny_dirs["base"], dense=[
        (24, torch.nn.Tanh(), True), (20, torch.nn.ReLU(), True),
        (18, torch.nn.Sigmoid(), True), (16, None, False)])  # None: Identity
    vectors = ember_vectors(directory, runtime, EncodeOptions())
    assert vectors.shape == (len(REFERENCE_TEXTS), 16)
    np.testing.assert_allclose(vectors, reference(directory), rtol=1e-4, atol=1e-5)
    adapter = transformer.load(spec_for(directory, "transformer", ("encode",)), runtime)
    assert adapter.info.dims == 16
    # Without the layers the vectors would be the pooled 32 dims: the test can fail.
    assert not np.allclose(vectors[:, :16], ember_vectors(
        build_st_pipeline(tmp_path / "plain", tiny_dirs["base"]), runtime,
        EncodeOptions())[:, :16], atol=1e-3)


@pytest.mark.parametrize("runtime", [ONNX, TORCH], ids=["onnx", "torch"])
def test_a_prompt_left_out_of_pooling_matches_sentence_transformers(
        tiny_dirs: dict[str, Path], tmp_path: Path, runtime: Runtime) -> None:
    prompts = {"query": "what is the ", "document": ""}
    directory = build_st_pipeline(tmp_path / "excluded", tiny_dirs["base"],
                                  include_prompt=False, prompts=prompts)
    queries = ember_vectors(directory, runtime, EncodeOptions(is_query=True))
    np.testing.assert_allclose(queries, reference(directory, prompt_name="query"),
                               rtol=1e-4, atol=1e-5)
    included = build_st_pipeline(tmp_path / "included", tiny_dirs["base"], prompts=prompts)
    assert not np.allclose(queries, ember_vectors(included, runtime,
                                                  EncodeOptions(is_query=True)), atol=1e-3)


@pytest.mark.parametrize("similarity", ["cosine", "dot", "euclidean", "manhattan"])
async def test_score_uses_the_models_own_similarity(tiny_dirs: dict[str, Path], tmp_path: Path,
                                                    serve: ServeFactory,
                                                    similarity: str) -> None:
    # Unnormalized vectors, so that each function ranks differently.
    directory = build_st_pipeline(tmp_path / similarity, tiny_dirs["base"], normalize=False,
                                  similarity=similarity)
    model = SentenceTransformer(str(directory), device="cpu")
    query, docs = REFERENCE_TEXTS[0], REFERENCE_TEXTS[1:]
    expected = model.similarity(model.encode([query]), model.encode(docs))[0].tolist()
    adapter = transformer.load(spec_for(directory, "transformer", ("encode", "score")), ONNX)
    assert adapter.info.extra["similarity"] == similarity
    async with serve(adapter) as served:
        out = await adapter.score(served.submit, query, docs, ScoreOptions())
    np.testing.assert_allclose(out.values, expected, rtol=1e-4, atol=1e-4)


def test_an_unknown_similarity_is_refused_at_load(tiny_dirs: dict[str, Path],
                                                  tmp_path: Path) -> None:
    directory = build_st_pipeline(tmp_path / "model", tiny_dirs["base"])
    config_file = directory / "config_sentence_transformers.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "similarity_fn_name": "jaccard"}))
    with pytest.raises(ModelLoadError, match="similarity_fn_name 'jaccard' is not one of"):
        transformer.load(spec_for(directory, "transformer", ("encode",)), ONNX)


@pytest.mark.parametrize("backend", [ONNX, Runtime(backend="torch")], ids=["onnx", "torch"])
def test_a_folder_without_its_tokenizer_files_fails_the_load(tmp_path: Path,
                                                            backend: Runtime) -> None:
    """Found by a black-box review: transformers then builds a tokenizer of special tokens
    only, every word became [UNK], and "cat" and "dog" got the same vector."""
    directory = build_bi_encoder(tmp_path / "model", seed=4)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                 "special_tokens_map.json"):
        (directory / name).unlink(missing_ok=True)
    with pytest.raises(ModelLoadError, match=r"the tokenizer knows \d+ tokens where the "
                       r"model embeds \d+: its files .* are missing"):
        transformer.load(spec_for(directory, "transformer", ("encode",)), backend)


def test_an_oversized_config_json_is_refused_before_transformers_reads_it(
        tmp_path: Path) -> None:
    """Found by a black-box review: a 17 MiB config.json loaded and served, past the
    16 MiB every other JSON file of a model directory is held to."""
    from ember.model_files import MAX_MODEL_JSON_BYTES, ModelFileError

    directory = build_bi_encoder(tmp_path / "model", seed=4)
    config = json.loads((directory / "config.json").read_text())
    config["padding"] = "x" * (MAX_MODEL_JSON_BYTES + 1024)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises((ModelFileError, ModelLoadError), match=r"config\.json is .* bytes"):
        transformer.load(spec_for(directory, "transformer", ("encode",)), ONNX)


def test_a_folder_that_names_its_document_prompt_passage_gets_it_on_documents(
        tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    directory = build_st_pipeline(tmp_path / "passage", tiny_dirs["base"],
                                  prompts={"query": "query: ", "passage": "passage: "})
    # As E5-style folders have it: no "document" prompt (sentence-transformers adds "").
    config_file = directory / "config_sentence_transformers.json"
    config = json.loads(config_file.read_text())
    del config["prompts"]["document"]
    config_file.write_text(json.dumps(config))
    adapter = transformer.load(spec_for(directory, "transformer", ("encode",)), ONNX)
    assert adapter.params(EncodeOptions(is_query=True)).prefix == "query: "
    assert adapter.params(EncodeOptions()).prefix == "passage: "
    # What the model card asks of a sentence-transformers user (its encode_document would
    # find the empty "document" prompt it adds to a loaded model's prompts first).
    np.testing.assert_allclose(ember_vectors(directory, ONNX, EncodeOptions()),
                               reference(directory, prompt_name="passage"),
                               rtol=1e-4, atol=1e-5)
    # A spec's own document prompt still wins.
    spec = spec_for(directory, "transformer", ("encode",), prompts={"document": "doc: "})
    assert transformer.load(spec, ONNX).params(EncodeOptions()).prefix == "doc: "


def test_a_lora_made_for_another_model_is_refused_in_one_line(
        tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Found by a black-box review: a LoRA trained on a wider base failed the model's load
    with 1,843 characters of torch's size mismatches, naming neither the LoRA nor its
    folder."""
    wider = tmp_path / "wider"
    BertModel(bert_config(hidden_size=48)).save_pretrained(str(wider), safe_serialization=True)
    stranger = build_lora(wider, tmp_path / "stranger", seed=3)
    spec = spec_for(tiny_dirs["base"], "transformer", ("encode",),
                    loras={"a": tiny_dirs["a"], "wrong": stranger})
    with pytest.raises(ValueError) as caught:
        transformer.load(spec, Runtime())
    message = str(caught.value)
    assert message.startswith(f"LoRA 'wrong' ({stranger}) was made for another model: "
                              "size mismatch for "), message
    assert "\n" not in message and len(message) < 400, message
