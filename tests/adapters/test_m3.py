"""The M3 family (BGE-M3's dense, sparse and multi-vector outputs) on a tiny XLM-RoBERTa
built locally with FlagEmbedding's two heads beside it, loaded through `load` on both
backends and driven through a real worker. The reference is transformers' own model
with the heads applied as FlagEmbedding's M3 embedder applies them."""

from __future__ import annotations

import pickle
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

from ember.adapters import m3, transformer
from ember.adapters.base import Encoded, EncodeOptions, Runtime, ScoreOptions, TaskOutput
from ember.adapters.m3 import M3Adapter, lexical_weights
from ember.config import spec_from_directory
from ember.errors import InvalidInput, ModelLoadError
from ember.ipc.batch import items_from_wire, items_to_wire
from ember.ipc.wire import pack, unpack
from tests.adapters.serving import ServeFactory
from tests.adapters.tiny_models import build_m3, spec_for

TEXTS = ["the cat", "paris is the capital of france", "what is the weather in london?",
         "a big dog and a small dog and a big cat", "music", "zzqx unknown words"]
ALL = EncodeOptions(output_types=("dense", "sparse", "multivector"))
TOKEN_DIMS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_m3(tmp_path_factory.mktemp("tiny-m3") / "m3", token_dims=TOKEN_DIMS)


def load(model_dir: Path, backend: str = "torch", **fields: Any) -> M3Adapter:
    spec = spec_for(model_dir, "m3", ("encode", "score"), **{"allow_pickle": True, **fields})
    return m3.load(spec, Runtime(backend=backend))  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=["torch", "onnx"])
def adapter(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[M3Adapter]:
    loaded = load(model_dir, request.param)
    assert loaded.model.backend == request.param
    yield loaded
    loaded.close()


def reference(model_dir: Path, texts: list[str]) -> dict[str, list[Any]]:
    """FlagEmbedding's M3 outputs, from transformers' model and torch's Linear heads."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModel.from_pretrained(str(model_dir)).eval()
    heads = {}
    for name, out in (("sparse_linear", 1), ("colbert_linear", TOKEN_DIMS)):
        heads[name] = torch.nn.Linear(32, out)
        heads[name].load_state_dict(torch.load(model_dir / f"{name}.pt", weights_only=True))
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
        dense = F.normalize(hidden[:, 0], dim=-1).numpy()
        token_weights = torch.relu(heads["sparse_linear"](hidden)).squeeze(-1).numpy()
        colbert = heads["colbert_linear"](hidden[:, 1:]) * batch["attention_mask"][:, 1:, None]
        colbert = F.normalize(colbert, dim=-1).numpy()
    unused = {tokenizer.cls_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
              tokenizer.unk_token_id}
    sparse, multi, raw = [], [], []
    for i, ids in enumerate(batch["input_ids"].tolist()):
        count = int(batch["attention_mask"][i].sum())
        weights: dict[int, float] = defaultdict(float)
        for weight, token in zip(token_weights[i][:count], ids[:count], strict=True):
            if token not in unused and weight > 0 and weight > weights[token]:
                weights[token] = float(weight)
        sparse.append(dict(weights))
        multi.append(colbert[i][:count - 1])
        raw.append(list(zip(ids[:count], token_weights[i][:count].tolist(), strict=True)))
    return {"dense": list(dense), "sparse": sparse, "multivector": multi, "raw": raw}


async def test_every_output_matches_flagembeddings_formulas(
        adapter: M3Adapter, model_dir: Path, serve: ServeFactory) -> None:
    async with serve(adapter) as served:
        out = await adapter.encode(served.submit, TEXTS, ALL)
    wanted = reference(model_dir, TEXTS)
    assert len(out.values) == len(TEXTS)
    for i, encoded in enumerate(out.values):
        assert encoded.dense is not None and encoded.sparse is not None
        assert encoded.multivector is not None
        np.testing.assert_allclose(encoded.dense, wanted["dense"][i], atol=1e-5)
        assert np.isclose(np.linalg.norm(encoded.dense), 1.0, atol=1e-5)
        got = dict(zip(encoded.sparse.indices.tolist(), encoded.sparse.values.tolist(),
                       strict=True))
        assert got.keys() == wanted["sparse"][i].keys()
        np.testing.assert_allclose([got[k] for k in sorted(got)],
                                   [wanted["sparse"][i][k] for k in sorted(got)], atol=1e-5)
        assert encoded.sparse.dims == adapter.vocab_size
        assert list(encoded.sparse.indices) == sorted(set(encoded.sparse.indices.tolist()))
        assert encoded.multivector.shape == wanted["multivector"][i].shape
        np.testing.assert_allclose(encoded.multivector, wanted["multivector"][i], atol=1e-5)
    # What the texts hold, so that the checks above can fail: an id met twice with two
    # different positive weights (the larger is kept), and positive weights at the unknown
    # and special tokens (left out).
    unk, cls = adapter.tokenizer.unk_token_id, adapter.tokenizer.cls_token_id
    positive = [(t, w) for row in wanted["raw"] for t, w in row if w > 0]
    assert {unk, cls} <= {t for t, _ in positive}
    repeated = [pairs for pairs in ([w for t, w in row if t == token and w > 0]
                                    for row in wanted["raw"] for token, _ in row)
                if len(set(pairs)) > 1]
    assert repeated


async def test_only_the_outputs_asked_for_are_made(adapter: M3Adapter,
                                                   serve: ServeFactory) -> None:
    async with serve(adapter) as served:
        default = await adapter.encode(served.submit, TEXTS[:2], EncodeOptions())
        sparse = await adapter.encode(served.submit, TEXTS[:2],
                                      EncodeOptions(output_types=("sparse",)))
        raw = await adapter.encode(served.submit, TEXTS[:2],
                                   EncodeOptions(output_types=("dense", "multivector"),
                                                 normalize=False))
    assert all(e.dense is not None and e.sparse is None and e.multivector is None
               for e in default.values)
    assert all(e.sparse is not None and e.dense is None and e.multivector is None
               for e in sparse.values)
    for e in raw.values:
        assert e.dense is not None and e.multivector is not None and e.sparse is None
        assert not np.isclose(np.linalg.norm(e.dense), 1.0, atol=1e-3)
        assert not np.allclose(np.linalg.norm(e.multivector, axis=1), 1.0, atol=1e-3)
    # The same outputs named in any order are one parameter group: they share forwards.
    assert adapter.params(EncodeOptions(output_types=("sparse", "dense"))) == \
        adapter.params(EncodeOptions(output_types=("dense", "sparse", "dense")))
    with pytest.raises(InvalidInput) as refused:
        adapter.params(EncodeOptions(output_types=("dense", "colour")))
    assert refused.value.param == "params.output_types"


async def test_score_is_the_cosine_of_the_dense_vectors(adapter: M3Adapter,
                                                        serve: ServeFactory) -> None:
    docs = TEXTS[1:]
    async with serve(adapter) as served:
        scored = await adapter.score(served.submit, TEXTS[0], docs, ScoreOptions())
        encoded: TaskOutput[list[Encoded]] = await adapter.encode(served.submit, TEXTS, ALL)
    query = encoded.values[0].dense
    assert query is not None
    wanted = [float(np.dot(query, e.dense)) for e in encoded.values[1:] if e.dense is not None]
    np.testing.assert_allclose(scored.values, wanted, atol=1e-5)


def flag_scores(query: Encoded, doc: Encoded) -> dict[str, float]:
    """FlagEmbedding's three scores of a pair: the dense dot product, the lexical matching
    score over shared ids, and the colbert score (MaxSim summed, over the query's count)."""
    assert query.dense is not None and doc.dense is not None
    assert query.sparse is not None and doc.sparse is not None
    assert query.multivector is not None and doc.multivector is not None
    theirs = dict(zip(doc.sparse.indices.tolist(), doc.sparse.values.tolist(), strict=True))
    lexical = sum(w * theirs[i] for i, w in zip(query.sparse.indices.tolist(),
                                                query.sparse.values.tolist(), strict=True)
                  if i in theirs)
    tokens = torch.einsum("in,jn->ij", torch.from_numpy(query.multivector),
                          torch.from_numpy(doc.multivector))
    colbert = float(tokens.max(-1).values.sum() / query.multivector.shape[0])
    return {"dense": float(query.dense @ doc.dense), "sparse": lexical, "multivector": colbert}


@pytest.mark.parametrize("weights", [{"sparse": 2}, {"multivector": 1.0},
                                     {"dense": 0.4, "sparse": 0.2, "multivector": 0.6}])
async def test_score_weights_mix_flagembeddings_three_scores(
        model_dir: Path, serve: ServeFactory, weights: dict[str, float]) -> None:
    adapter = load(model_dir, options={"score_weights": weights})
    docs = TEXTS[1:]
    async with serve(adapter) as served:
        scored = await adapter.score(served.submit, TEXTS[0], docs, ScoreOptions())
        query = (await adapter.encode(served.submit, TEXTS[:1],
                                      EncodeOptions(is_query=True, output_types=ALL
                                                    .output_types))).values[0]
        encoded = await adapter.encode(served.submit, docs, ALL)
    adapter.close()
    total = sum(weights.values())
    wanted = [sum(w * flag_scores(query, doc)[kind] for kind, w in weights.items()) / total
              for doc in encoded.values]
    np.testing.assert_allclose(scored.values, wanted, atol=1e-5)
    assert adapter.scoring(ScoreOptions())[0] == tuple(
        k for k in ALL.output_types if k in weights)


async def test_a_requests_score_weights_replace_the_models_for_it_alone(
        adapter: M3Adapter, serve: ServeFactory) -> None:
    """FlagEmbedding's compute_score takes its weights per call; so does a request. Weights
    at the ends of the float range mean what their ratios say."""
    docs = TEXTS[1:]
    weighed = {"dense": 0.4, "sparse": 0.2, "multivector": 0.4}
    async with serve(adapter) as served:
        async def score(weights: dict[str, float] | None) -> list[float]:
            return (await adapter.score(served.submit, TEXTS[0], docs,
                                        ScoreOptions(score_weights=weights))).values
        mixed, default = await score(weighed), await score(None)
        sparse_alone = await score({"sparse": 3.0, "dense": 0.0})
        huge = await score({"dense": 1e308, "multivector": 1e308})
        even = await score({"dense": 1.0, "multivector": 1.0})
        tiny = await score({"dense": 1e-320})
        query = (await adapter.encode(served.submit, TEXTS[:1],
                                      EncodeOptions(is_query=True, output_types=ALL
                                                    .output_types))).values[0]
        encoded = await adapter.encode(served.submit, docs, ALL)
        for bad in ({"dense": -1.0}, {"dense": float("nan")}, {"colour": 1.0}, {"dense": 0.0},
                    {}, {"dense": float("inf")}):
            with pytest.raises(InvalidInput, match=r"options\.score_weights must map") as no:
                await score(bad)
            assert no.value.param == "params.options.score_weights"
    flags = [flag_scores(query, doc) for doc in encoded.values]
    np.testing.assert_allclose(mixed, [sum(w * f[k] for k, w in weighed.items())
                                       for f in flags], atol=1e-5)
    np.testing.assert_allclose(default, [f["dense"] for f in flags], atol=1e-5)
    np.testing.assert_allclose(sparse_alone, [f["sparse"] for f in flags], atol=1e-5)
    np.testing.assert_allclose(huge, even, atol=1e-6)
    np.testing.assert_allclose(even, [(f["dense"] + f["multivector"]) / 2 for f in flags],
                               atol=1e-5)
    np.testing.assert_allclose(tiny, default, atol=1e-6)
    # Only the weighed outputs are made for the request.
    assert adapter.scoring(ScoreOptions(score_weights={"sparse": 1.0}))[0] == \
        ("sparse",)


@pytest.mark.parametrize("weights", [{"dense": -1}, {"dense": 0}, {"colour": 1}, [0.4, 0.6],
                                     {"dense": True}, {"sparse": float("nan")}, {},
                                     {"dense": float("inf")}])
def test_score_weights_that_mean_nothing_fail_the_load(model_dir: Path, weights: Any) -> None:
    with pytest.raises(ModelLoadError, match=r"options\.score_weights must map output types"):
        load(model_dir, options={"score_weights": weights})


async def test_normalize_false_in_the_spec_gives_raw_rows_unless_a_request_asks(
        model_dir: Path, serve: ServeFactory) -> None:
    raw = load(model_dir, normalize=False)
    assert raw.info.extra["normalize"] is False
    async with serve(raw) as served:
        plain = await raw.encode(served.submit, TEXTS[:2], ALL)
        unit = await raw.encode(served.submit, TEXTS[:2], EncodeOptions(
            output_types=ALL.output_types, normalize=True))
        # Scores stay FlagEmbedding's, of unit rows (found by a review: raw dot products).
        cosines = await raw.score(served.submit, TEXTS[0], TEXTS[1:3], ScoreOptions())
        maxsims = await raw.score(served.submit, TEXTS[0], TEXTS[1:3],
                                  ScoreOptions(score_weights={"multivector": 1.0}))
    raw.close()
    wanted = reference(model_dir, TEXTS[:3])
    np.testing.assert_allclose(cosines.values, [float(wanted["dense"][0] @ wanted["dense"][i])
                                                for i in (1, 2)], atol=1e-5)
    assert all(0 < score <= 1 + 1e-6 for score in maxsims.values)
    for got, asked, dense in zip(plain.values, unit.values, wanted["dense"][:2], strict=True):
        assert got.dense is not None and got.multivector is not None
        assert not np.isclose(np.linalg.norm(got.dense), 1.0, atol=1e-3)
        np.testing.assert_allclose(got.dense / np.linalg.norm(got.dense), dense, atol=1e-5)
        assert not np.allclose(np.linalg.norm(got.multivector, axis=1), 1.0, atol=1e-3)
        assert asked.dense is not None
        np.testing.assert_allclose(asked.dense, dense, atol=1e-5)


def test_params_items_and_answers_cross_the_process_wire(adapter: M3Adapter) -> None:
    """As under --workers: the engine process gets the items and parameter group, and the
    API process the three outputs, all rebuilt from the wire."""
    items, params = adapter.prepare(TEXTS, ALL)
    crossed_items = items_from_wire(unpack(pack(items_to_wire(items))))
    crossed_params = unpack(pack(params))
    assert crossed_params == params
    answers = adapter.forward(items, params)
    for mine, theirs in zip(answers, unpack(pack(adapter.forward(crossed_items,
                                                                  crossed_params))),
                            strict=True):
        assert isinstance(theirs, Encoded)
        assert mine.dense is not None and theirs.dense is not None
        np.testing.assert_allclose(mine.dense, theirs.dense, atol=1e-6)
        assert mine.sparse is not None and theirs.sparse is not None
        assert mine.sparse.indices.tolist() == theirs.sparse.indices.tolist()
        assert mine.multivector is not None and theirs.multivector is not None
        np.testing.assert_allclose(mine.multivector, theirs.multivector, atol=1e-6)


def test_lexical_weights_keep_each_ids_largest_positive_weight() -> None:
    ids = np.array([0, 7, 9, 7, 3, 5, 9, 2])
    weights = np.array([5.0, 0.2, 0.0, 0.6, 4.0, 0.1, 0.3, 9.0], np.float32)
    vector = lexical_weights(ids, weights, np.array([0, 2, 3]), 12)
    assert vector.indices.tolist() == [5, 7, 9]
    np.testing.assert_allclose(vector.values, [0.1, 0.6, 0.3])
    assert vector.dims == 12
    empty = lexical_weights(np.array([0, 2]), np.array([1.0, 1.0], np.float32),
                            np.array([0, 2]), 12)
    assert empty.indices.size == 0 and empty.values.size == 0


async def test_a_folder_is_an_m3_model_where_its_heads_need_no_pickle(
        model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        serve: ServeFactory) -> None:
    # Pickled heads need a YAML that allows them: the folder alone serves its encoder's
    # dense output as BGE-M3 makes it, the normalized CLS vector (found by a black-box
    # review: it was mean-pooled and left unnormalized).
    plain = spec_from_directory(model_dir)
    assert plain.adapter == "transformer"
    assert (plain.pooling, plain.normalize) == ("cls", True)
    assert "adapter: m3 and allow_pickle: true" in caplog.text
    encoder = transformer.load(plain, Runtime(backend="torch"))
    async with serve(encoder) as served:
        out = await encoder.encode(served.submit, TEXTS[:3], EncodeOptions())
    encoder.close()
    wanted = reference(model_dir, TEXTS[:3])["dense"]
    np.testing.assert_allclose([e.dense for e in out.values], wanted, atol=1e-5)
    safe = build_m3(tmp_path / "safe", heads=".safetensors")
    assert spec_from_directory(safe).adapter == "m3"
    # Safetensors heads need no pickle, and give the same weights' outputs.
    loaded = load(safe, allow_pickle=False)
    assert loaded.info.output_types == ("dense", "sparse", "multivector")
    assert loaded.info.extra["token_dims"] == TOKEN_DIMS
    loaded.close()


# -- hostile and broken heads ------------------------------------------------------------------


class _Bait:
    """Unpickling this writes a marker file: the proof that a pickle ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (exec, (f"import pathlib; pathlib.Path({str(self.marker)!r}).write_text('ran')",))


def test_pickled_heads_load_only_where_the_spec_allows_pickles(model_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"sparse_linear\.pt is a pickle.*allow_pickle"):
        load(model_dir, allow_pickle=False)


def test_a_head_that_runs_code_when_unpickled_is_refused_and_never_run(
        model_dir: Path, tmp_path: Path) -> None:
    hostile = build_m3(tmp_path / "hostile")
    marker = tmp_path / "ran.txt"
    with open(hostile / "colbert_linear.pt", "wb") as file:
        pickle.dump({"weight": _Bait(marker)}, file, protocol=2)
    with pytest.raises(ModelLoadError, match="weights-only unpickler"):
        load(hostile)
    assert not marker.exists()


async def test_a_folder_served_as_its_dense_encoder_never_opens_its_pickled_heads(
        tmp_path: Path, serve: ServeFactory, caplog: pytest.LogCaptureFixture) -> None:
    """Without a YAML, pickled heads only tell the family (their names); neither is read,
    so heads that run code when unpickled stay shut, and a head that is a folder or a link
    out of the model's folder changes nothing."""
    hostile = build_m3(tmp_path / "hostile")
    marker = tmp_path / "ran.txt"
    for head in ("sparse_linear", "colbert_linear"):
        with open(hostile / f"{head}.pt", "wb") as file:
            pickle.dump({"weight": _Bait(marker)}, file, protocol=2)
    spec = spec_from_directory(hostile)
    assert (spec.adapter, spec.pooling) == ("transformer", "cls")
    said = [r.getMessage() for r in caplog.records if "heads as pickles" in r.getMessage()]
    assert len(said) == 1 and "adapter: m3 and allow_pickle: true" in said[0], said
    encoder = transformer.load(spec, Runtime(backend="torch"))
    async with serve(encoder) as served:
        out = await encoder.encode(served.submit, TEXTS[:2], EncodeOptions())
    encoder.close()
    assert len(out.values) == 2 and not marker.exists()
    # A head that is not a file is no pickled head: the folder keeps its own pooling.
    (hostile / "sparse_linear.pt").unlink()
    (hostile / "sparse_linear.pt").mkdir()
    assert spec_from_directory(hostile).pooling is None
    (hostile / "sparse_linear.pt").rmdir()
    outside = tmp_path / "outside.txt"
    outside.write_text("not a pickle")
    (hostile / "sparse_linear.pt").symlink_to(outside)  # a link out is only stat'ed
    assert spec_from_directory(hostile).pooling == "cls" and not marker.exists()


@pytest.mark.parametrize("broken", ["missing", "wrong shape", "no bias", "not a file"])
def test_a_broken_head_fails_the_load_with_the_file_named(tmp_path: Path, broken: str) -> None:
    directory = build_m3(tmp_path / "broken", heads=".safetensors")
    head = directory / "sparse_linear.safetensors"
    from safetensors.torch import save_file

    if broken == "missing":
        head.unlink()
        match = "holds no weights"
    elif broken == "wrong shape":
        save_file({"weight": torch.zeros(2, 32), "bias": torch.zeros(2)}, str(head))
        match = r"sparse_linear: expected tensors weight \(1, 32\)"
    elif broken == "no bias":
        save_file({"weight": torch.zeros(1, 32)}, str(head))
        match = "and bias"
    else:
        head.write_bytes(b"\xff" * 64)
        match = "not a readable safetensors file"
    with pytest.raises(ModelLoadError, match=match):
        load(directory, allow_pickle=False)


def test_a_hostile_config_fails_the_load_before_transformers_reads_it(tmp_path: Path) -> None:
    """config.json goes through the model files' limits first (ember.model_files), in this
    family too: nested past any parser's depth, it is a load error naming the file."""
    directory = build_m3(tmp_path / "hostile", heads=".safetensors")
    (directory / "config.json").write_bytes(b'{"a":' * 100_000 + b"1" + b"}" * 100_000)
    with pytest.raises(ModelLoadError, match=r"config\.json is not valid JSON \(nested too "
                                             r"deeply\)"):
        load(directory, allow_pickle=False)
