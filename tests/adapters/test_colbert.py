"""ColBERT checkpoints in sentence-transformers', PyLate's and Stanford-NLP's layouts,
built locally as tiny models and served by the multivector family: each token matrix and
score is checked against sentence-transformers' own MultiVectorEncoder on the same
files, on both backends."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ember.adapters import multivector
from ember.adapters.base import EncodeOptions, Runtime, ScoreOptions
from ember.adapters.multivector import MultiVectorAdapter, MultiVectorParams
from ember.config import load_catalog
from ember.errors import InvalidInput, ModelLoadError
from ember.ipc.batch import items_from_wire, items_to_wire
from ember.ipc.wire import pack, unpack
from tests.adapters.serving import ServeFactory
from tests.adapters.tiny_models import (
    build_pylate_colbert,
    build_st_colbert,
    build_stanford_colbert,
    colbert_bert,
    spec_for,
)

QUERIES = ["what is the capital of france?", "paris",
           "the river and the mountain and the city and the country of the sun"]
DOCS = ["paris is the capital of france.", "the dog, the cat and the bird!",
        "music and film", "rain in london, england", "a good book and a cup of tea.",
        "the river and the mountain " * 8]
BACKENDS = ("onnx", "torch")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("colbert-base") / "base"
    colbert_bert(directory, seed=0, max_seq_length=64)
    return directory


def reference(directory: Path) -> Any:
    from sentence_transformers import MultiVectorEncoder

    logging.getLogger("sentence_transformers").setLevel(logging.ERROR)
    return MultiVectorEncoder(str(directory), device="cpu")


def load(directory: Path, backend: str = "onnx", **fields: Any) -> MultiVectorAdapter:
    return multivector.load(spec_for(directory, "multivector", ("encode", "score"),
                                     backend=backend, **fields), Runtime())


async def encode(adapter: MultiVectorAdapter, serve: ServeFactory, texts: list[str],
                 is_query: bool) -> list[np.ndarray]:
    async with serve(adapter) as served:
        out = await adapter.encode(served.submit, texts, EncodeOptions(
            is_query=is_query, output_types=("multivector",)))
    return [np.asarray(e.multivector) for e in out.values]


async def assert_served_as_sentence_transformers_does(directory: Path,
                                                      serve: ServeFactory) -> None:
    """Queries, documents and scores, one by one and batched, on both backends."""
    import torch

    model = reference(directory)
    with torch.no_grad():
        want_q = [q.numpy() for q in model.encode_query(QUERIES)]
        want_d = [d.numpy() for d in model.encode_document(DOCS)]
        want_scores = model.similarity(model.encode_query(QUERIES[:1]),
                                       model.encode_document(DOCS))[0].numpy()
    for backend in BACKENDS:
        adapter = load(directory, backend)
        try:
            got_q = await encode(adapter, serve, QUERIES, True)
            got_d = await encode(adapter, serve, DOCS, False)
            alone = await encode(adapter, serve, DOCS[:1], False)
            async with serve(adapter) as served:
                scores = (await adapter.score(served.submit, QUERIES[0], DOCS,
                                              ScoreOptions())).values
        finally:
            adapter.close()
        for got, want in [*zip(got_q, want_q, strict=True), *zip(got_d, want_d, strict=True),
                          (alone[0], want_d[0])]:
            assert got.shape == want.shape, backend
            np.testing.assert_allclose(got, want, atol=2e-5, err_msg=backend)
        np.testing.assert_allclose(scores, want_scores, rtol=1e-4, err_msg=backend)


# -- sentence-transformers' own layout -------------------------------------------------


@pytest.mark.parametrize("settings", [
    {"expansion": {"strategy": "fixed", "attend": False, "length": 12},
     "document_length": 20},
    {"expansion": {"strategy": "min", "attend": True, "length": 8}, "query_length": 40,
     "skiplist_tasks": ("query", "document"), "similarity": "meanmaxsim",
     "prompts": {"query": "what ", "document": "the "}},
    {"expansion": None, "query_length": 10, "skiplist": ()},
], ids=["classic", "min-attend-meanmaxsim-prompts", "no-expansion"])
async def test_a_sentence_transformers_colbert_is_served_as_it_serves_it(
        base: Path, tmp_path: Path, serve: ServeFactory, settings: dict[str, Any]) -> None:
    directory = build_st_colbert(tmp_path / "st", base, **settings)
    await assert_served_as_sentence_transformers_does(directory, serve)


async def test_expansion_pads_queries_with_mask_tokens_every_position_scored(
        base: Path, tmp_path: Path, serve: ServeFactory) -> None:
    directory = build_st_colbert(tmp_path / "st", base, document_length=20, expansion={
        "strategy": "fixed", "attend": False, "length": 12})
    adapter = load(directory)
    short, long = adapter.tokenize(["paris", QUERIES[2]], True, ["q0", "q1"], queries=2)
    mask_id = adapter.tokenizer.mask_token_id
    assert len(short.payload.ids) == 12 and short.payload.ids[3:].tolist() == [mask_id] * 9
    assert short.payload.attend.tolist() == [1, 1, 1] + [0] * 9
    assert short.payload.keep.sum() == 12
    assert len(long.payload.ids) == 12 and long.payload.attend is None  # cut at 12
    with pytest.raises(InvalidInput, match="exceeds max_seq_length 12") as caught:
        adapter.tokenize([QUERIES[2]], False, ["query.text"], queries=1)
    assert caught.value.param == "query.text"
    doc = adapter.tokenize(["paris, france."], True, ["d"])[0].payload
    assert doc.keep.tolist() == [1, 1, 0, 1, 0, 1]  # [CLS] and [SEP] kept, punctuation not
    assert adapter.info.extra["colbert"] == {
        "layout": "sentence-transformers", "markers": {}, "query_tokens": 12,
        "document_tokens": 20, "query_expansion": {"strategy": "fixed", "attend": False,
                                                   "length": 12}, "skiplist": 4}


def test_token_rows_cross_the_process_wire_as_arrays(base: Path, tmp_path: Path) -> None:
    """Queries (expanded, attending as the checkpoint says) and documents (skiplist)
    after the IPC wire, as an engine process gets them, give the same vectors."""
    directory = build_st_colbert(tmp_path / "st", base, document_length=20, expansion={
        "strategy": "fixed", "attend": False, "length": 12})
    adapter = load(directory, backend="torch")
    items = adapter.tokenize([*QUERIES[:2], *DOCS], True, ["t"] * (2 + len(DOCS)), queries=2)
    crossed = items_from_wire(unpack(pack(items_to_wire(items))))
    assert all(isinstance(item.payload.ids, np.ndarray) for item in crossed)
    params = MultiVectorParams("", True)
    for mine, theirs in zip(adapter.forward(items, params), adapter.forward(crossed, params),
                            strict=True):
        assert mine.shape == theirs.shape and np.allclose(mine, theirs, atol=1e-6)


# -- PyLate's layout ---------------------------------------------------------------------


@pytest.mark.parametrize("markers,settings", [
    (("[Q] ", "[D] "), {}),
    (("[unused0]", "[unused1]"), {"attend_to_expansion_tokens": True,
                                  "skiplist_words": ["!", "?"]}),
    (("[Q] ", "[D] "), {"do_query_expansion": False, "query_length": 6,
                        "prompts": {"query": "[Q] what "}}),
    (("[Q] ", "[D] "), {"model_type": None, "skiplist_words": None}),
], ids=["added-markers", "vocabulary-markers-attend", "no-expansion-prompt",
        "before-model-type"])
async def test_a_pylate_colbert_is_served_as_sentence_transformers_serves_it(
        tmp_path: Path, serve: ServeFactory, markers: tuple[str, str],
        settings: dict[str, Any]) -> None:
    directory = build_pylate_colbert(tmp_path / "pylate", markers=markers, settings=settings)
    await assert_served_as_sentence_transformers_does(directory, serve)


def test_a_marker_becomes_one_token_before_the_text(tmp_path: Path) -> None:
    directory = build_pylate_colbert(tmp_path / "pylate", markers=("[unused0]", "[unused1]"))
    adapter = load(directory)
    items, params = adapter.prepare(["paris"], EncodeOptions(is_query=False))
    marker = adapter.tokenizer.convert_tokens_to_ids("[unused1]")
    assert params.prefix == "[unused1]"
    assert items[0].payload.ids[:3].tolist() == [
        adapter.tokenizer.cls_token_id, marker, adapter.tokenizer.convert_tokens_to_ids("paris")]
    # A request's instruction goes after the marker (this model has no prompts: refused).
    with pytest.raises(InvalidInput, match="takes no instruction"):
        adapter.prepare(["paris"], EncodeOptions(is_query=True, instruction="find"))


# -- Stanford-NLP's layout ---------------------------------------------------------------


@pytest.mark.parametrize("metadata", [
    {"query_token_id": "[unused0]", "doc_token_id": "[unused1]", "query_maxlen": 12,
     "doc_maxlen": 20, "mask_punctuation": True, "attend_to_mask_tokens": False},
    {"query_maxlen": 10, "mask_punctuation": False, "attend_to_mask_tokens": True},
    None,
], ids=["metadata", "attend-no-skiplist", "no-metadata"])
async def test_a_stanford_colbert_is_served_as_sentence_transformers_serves_it(
        tmp_path: Path, serve: ServeFactory, metadata: dict[str, Any] | None) -> None:
    directory = build_stanford_colbert(tmp_path / "stanford", metadata=metadata)
    await assert_served_as_sentence_transformers_does(directory, serve)


def test_the_catalogs_colberts_are_stanford_checkpoints_read_as_such(tmp_path: Path) -> None:
    """The catalog's ColBERT entries name their projection as the Stanford layout has it;
    their folder (built here in that layout) is read with markers and expansion."""
    directory = build_stanford_colbert(tmp_path / "stanford", metadata={"query_maxlen": 32})
    for name in ("colbert-ir/colbertv2.0", "answerdotai/answerai-colbert-small-v1"):
        entry = load_catalog()[name]
        options = {k: v for k, v in entry.options.items() if k != "dims"}
        adapter = load(directory, options=options)
        assert adapter.info.extra["colbert"]["layout"] == "stanford"
        assert adapter.markers == {"query": "[unused0] ", "document": "[unused1] "}
        assert adapter.info.extra["colbert"]["query_tokens"] == 32


# -- what the files may not ask --------------------------------------------------------


def rewrite(path: Path, change: Callable[[Any], Any]) -> None:
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


@pytest.fixture
def pylate(tmp_path: Path) -> Iterator[Path]:
    yield build_pylate_colbert(tmp_path / "pylate")


@pytest.mark.parametrize("file,change,message", [
    ("modules.json", lambda m: [*m, {"idx": 2, "name": "2", "path": "2_Pool",
                                     "type": "sentence_transformers.models.Pooling"}],
     "a Pooling module is not run"),
    ("modules.json", lambda m: [m[1], m[0]], "Transformer and Dense; this one has"),
    ("modules.json", lambda m: [m[0], {**m[1], "path": "../elsewhere"}],
     "leaves the model's directory"),
    ("modules.json", lambda m: {"not": "a list"}, "where an array is expected"),
    ("config_sentence_transformers.json", lambda c: {**c, "query_length": "32"},
     "query_length is '32'"),
    ("config_sentence_transformers.json", lambda c: {**c, "query_prefix": 7},
     "query_prefix is 7"),
    ("config_sentence_transformers.json", lambda c: {**c, "skiplist_words": "?!"},
     "skiplist_words is not a list"),
    ("config_sentence_transformers.json",
     lambda c: {**c, "query_expansion": {"strategy": "grow", "length": 4}},
     "strategy is fixed or min"),
    ("config_sentence_transformers.json", lambda c: {**c, "similarity_fn_name": "l2"},
     "similarity_fn_name 'l2'"),
    ("1_Dense/config.json", lambda c: {**c, "out_features": 3}, "linear.weight has shape"),
], ids=["module", "order", "path", "modules-type", "length", "marker", "skiplist", "expansion",
        "similarity", "dense"])
def test_what_a_colbert_folder_may_not_ask_is_refused_naming_it(
        pylate: Path, file: str, change: Callable[[Any], Any], message: str) -> None:
    rewrite(pylate / file, change)
    with pytest.raises(ModelLoadError, match=message):
        load(pylate)


def test_hostile_colbert_files_fail_the_load_naming_the_file(pylate: Path,
                                                             tmp_path: Path) -> None:
    (pylate / "config_sentence_transformers.json").write_text("[" * 100_000)
    with pytest.raises(ModelLoadError, match=r"config_sentence_transformers\.json"):
        load(pylate)
    stanford = build_stanford_colbert(tmp_path / "stanford", metadata={})
    (stanford / "artifact.metadata").write_bytes(b"\xff\xfe not json")
    with pytest.raises(ModelLoadError, match=r"artifact\.metadata"):
        load(stanford)
    (stanford / "artifact.metadata").write_text(json.dumps({"query_maxlen": 10_000}))
    with pytest.raises(ModelLoadError, match="queries expand to 10000 tokens"):
        load(stanford)


def test_projection_options_give_way_to_the_folders_own_dense(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = build_pylate_colbert(tmp_path / "pylate")
    plain = load(folder)
    with caplog.at_level("WARNING", logger="ember.adapters.multivector"):
        named = load(folder, options={"projection": "model.safetensors",
                                      "projection_key": "linear.weight"})
    assert "are not used" in caplog.text
    np.testing.assert_array_equal(named.projection.weight, plain.projection.weight)


def test_each_layout_is_detected_as_the_multivector_family(base: Path,
                                                           tmp_path: Path) -> None:
    folders = [build_st_colbert(tmp_path / "st", base),
               build_pylate_colbert(tmp_path / "pylate"),
               build_stanford_colbert(tmp_path / "stanford", metadata=None)]
    older = build_pylate_colbert(tmp_path / "older", settings={"model_type": None})
    catalog = load_catalog(model_paths=[*folders, older])
    for name in ("st", "pylate", "stanford", "older"):
        spec = catalog[f"local/{name}"]
        assert (spec.adapter, spec.tasks) == ("multivector", ("encode", "score")), name
        layout = multivector.load(spec, Runtime()).info.extra["colbert"]["layout"]
        assert layout == {"st": "sentence-transformers", "stanford": "stanford"}.get(
            name, "pylate")


@pytest.mark.parametrize("file,change,message", [
    ("2_MultiVectorMask/config.json", lambda c: {**c, "keep_only_token_ids": [5]},
     "keep_only_token_ids"),
    ("2_MultiVectorMask/config.json", lambda c: {**c, "skiplist_tasks": ["image"]},
     "skiplist_tasks"),
    ("sentence_bert_config.json", lambda c: {**c, "transformer_task": "text-generation"},
     "transformer_task 'text-generation'"),
    ("config_sentence_transformers.json", lambda c: {**c, "truncate_dim": 8}, "truncate_dim"),
    ("1_Dense/config.json", lambda c: {**c, "module_input_name": "sentence_embedding"},
     "does not project each token"),
    ("sentence_bert_config.json", lambda c: {**c, "query_expansion": ["fixed", 32]},
     "is not an object of"),
], ids=["image-patches", "skiplist-side", "task", "truncate-dim", "sentence-dense", "expansion"])
def test_what_a_sentence_transformers_colbert_may_not_ask_is_refused(
        base: Path, tmp_path: Path, file: str, change: Callable[[Any], Any],
        message: str) -> None:
    folder = build_st_colbert(tmp_path / "st", base)
    rewrite(folder / file, change)
    with pytest.raises(ModelLoadError, match=message):
        load(folder)


def test_a_colbert_projection_that_is_a_pickle_never_runs_code(pylate: Path,
                                                               tmp_path: Path) -> None:
    import pickle

    from tests.adapters.test_dense_layers import Payload

    (pylate / "1_Dense" / "model.safetensors").unlink()
    marker = tmp_path / "ran"
    (pylate / "1_Dense" / "pytorch_model.bin").write_bytes(
        pickle.dumps({"linear.weight": Payload(marker)}, protocol=2))
    with pytest.raises(ModelLoadError, match="allow_pickle: true"):
        load(pylate)  # a pickle, not allowed by the spec: never opened
    with pytest.raises(ModelLoadError, match="refused by torch's weights-only unpickler"):
        load(pylate, allow_pickle=True)
    assert not marker.exists()


def test_oversized_and_bomb_colbert_files_fail_the_load_naming_them(pylate: Path,
                                                                    tmp_path: Path) -> None:
    import struct

    settings = pylate / "config_sentence_transformers.json"
    original = settings.read_text()
    settings.write_text(original[:-1] + ', "pad": "' + "x" * (17 << 20) + '"}')
    with pytest.raises(ModelLoadError, match=r"config_sentence_transformers\.json is .* bytes"):
        load(pylate)
    settings.write_text(original)
    exabytes = struct.pack("<Q", 1 << 60) + b"{}"  # a header claiming 2^60 bytes
    (pylate / "1_Dense" / "model.safetensors").write_bytes(exabytes)
    with pytest.raises(ModelLoadError, match=r"1_Dense/model\.safetensors is not a readable"):
        load(pylate)
    stanford = build_stanford_colbert(tmp_path / "stanford", metadata={})
    (stanford / "model.safetensors").write_bytes(exabytes)  # the projection's file
    with pytest.raises(ModelLoadError, match=r"model\.safetensors is not a readable"):
        load(stanford)
