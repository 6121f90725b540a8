"""The ONNX Runtime backend: parity with sentence-transformers and with torch, the
export cache, int8, and which backend a model gets."""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from bench.retrieval import cosines, retrieval_set, top_k_overlap
from ember.adapters import _onnx, cross_encoder, multivector, sparse, transformer
from ember.adapters._backend import choose_backend
from ember.adapters.base import EncodeOptions, Runtime, ScoreOptions
from ember.adapters.transformer import TransformerAdapter
from ember.config import DEFAULT_MODEL, load_catalog, resolve_source
from ember.engine import WorkerConfig
from ember.errors import ModelLoadError
from tests.adapters.serving import ServeFactory
from tests.adapters.test_transformer import corpus, dense
from tests.adapters.tiny_models import (
    build_bi_encoder,
    build_colbert,
    build_cross_encoder,
    build_lora,
    build_sparse_encoder,
    spec_for,
)

ONNX = Runtime(backend="onnx")
TORCH = Runtime(backend="torch")


def embed(adapter: TransformerAdapter, texts: list[str]) -> np.ndarray:
    items, params = adapter.prepare(texts, EncodeOptions())
    return np.stack(adapter.forward(items, params))


# -- the default model ---------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm_onnx() -> Iterator[TransformerAdapter]:
    adapter = transformer.load(load_catalog()[DEFAULT_MODEL], ONNX)
    yield adapter
    adapter.close()


@pytest.fixture(scope="module")
def reference() -> SentenceTransformer:
    return SentenceTransformer(str(resolve_source(load_catalog()[DEFAULT_MODEL])),
                               device="cpu")


def test_onnx_is_the_default_backend_on_cpu() -> None:
    spec = load_catalog()[DEFAULT_MODEL]
    assert choose_backend(spec, Runtime()) == "onnx"
    assert choose_backend(spec, Runtime(device="cuda")) == "torch"


def test_single_texts_match_sentence_transformers(minilm_onnx: TransformerAdapter,
                                                  reference: SentenceTransformer) -> None:
    assert minilm_onnx.info.extra["backend"] == "onnx"
    texts = corpus(count=24, seed=3)
    want = reference.encode(texts, batch_size=1, convert_to_numpy=True)
    got = np.stack([embed(minilm_onnx, [t])[0] for t in texts])
    assert got.dtype == np.float32 and got.shape == (24, 384)
    assert cosines(got, want).min() >= 0.9999


async def test_mixed_batches_match_sentence_transformers(minilm_onnx: TransformerAdapter,
                                                         reference: SentenceTransformer,
                                                         serve: ServeFactory) -> None:
    texts = corpus(count=40, seed=5)  # 1 to ~400 words, some past the 256-token limit
    want = reference.encode(texts, batch_size=8, convert_to_numpy=True)
    async with serve(minilm_onnx, WorkerConfig(max_batch_items=13)) as served:
        out = await minilm_onnx.encode(served.submit, texts, EncodeOptions())
    got = np.stack(dense(out))
    assert cosines(got, want).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_the_torch_backend_still_matches(reference: SentenceTransformer) -> None:
    torch_minilm = transformer.load(load_catalog()[DEFAULT_MODEL], TORCH)
    assert torch_minilm.info.extra["backend"] == "torch"
    texts = corpus(count=12, seed=9)
    want = reference.encode(texts, batch_size=12, convert_to_numpy=True)
    assert cosines(embed(torch_minilm, texts), want).min() >= 0.9999
    torch_minilm.close()


def test_padding_does_not_change_an_onnx_embedding(minilm_onnx: TransformerAdapter) -> None:
    short, long = "Cats sleep in the sun.", corpus(count=8, seed=1)[5]  # 400 words
    batched = embed(minilm_onnx, [short, long, short])
    alone = embed(minilm_onnx, [short])[0]
    assert float(np.abs(batched[0] - alone).max()) <= 1e-5
    assert float(np.abs(batched[2] - alone).max()) <= 1e-5
    assert float(np.abs(embed(minilm_onnx, [long])[0] - batched[1]).max()) <= 1e-5


def test_an_idle_model_costs_no_cpu_after_forwards(minilm_onnx: TransformerAdapter) -> None:
    """The default spinning ("forward") stops when a forward returns: threads sleep."""
    texts = corpus(count=8, seed=2)
    for _ in range(30):
        embed(minilm_onnx, texts[:4])
    time.sleep(0.2)
    cpu, wall = time.process_time(), time.perf_counter()
    time.sleep(1.0)
    cores = (time.process_time() - cpu) / (time.perf_counter() - wall)
    assert cores < 0.05  # generous: spinning threads would hold whole cores


def test_int8_keeps_the_ranking(minilm_onnx: TransformerAdapter) -> None:
    spec = dataclasses.replace(load_catalog()[DEFAULT_MODEL], quantize="int8")
    int8 = transformer.load(spec, ONNX)
    assert int8.memory_bytes() < minilm_onnx.memory_bytes() / 3  # int8 weights
    texts = retrieval_set()
    queries = [embed(a, texts.queries) for a in (minilm_onnx, int8)]
    docs = [embed(a, texts.documents) for a in (minilm_onnx, int8)]
    cos = cosines(np.vstack([queries[0], docs[0]]), np.vstack([queries[1], docs[1]]))
    overlap = top_k_overlap(queries[0], docs[0], queries[1], docs[1], k=10)
    # Measured: cosine mean 0.992, min 0.987; top-10 overlap mean 0.996, min 0.9.
    assert cos.mean() >= 0.985 and cos.min() >= 0.97
    assert overlap.mean() >= 0.95 and overlap.min() >= 0.8
    assert cos.max() < 0.99999  # it did run quantized


# -- the other families on tiny models, against their torch forward ---------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-onnx")
    base = build_bi_encoder(root / "bi")
    return {"bi": base, "ce": build_cross_encoder(root / "ce"),
            "sparse": build_sparse_encoder(root / "sparse"),
            "colbert": build_colbert(root / "colbert"),
            "lora": build_lora(base, root / "lora", seed=1)}


QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "the dog is big", "music and film",
        "the river and the mountain " * 20]


@pytest.mark.parametrize("activation", ["sigmoid", "none"])
async def test_cross_encoder_scores_match_torch(tiny: dict[str, Path], activation: str,
                                                serve: ServeFactory) -> None:
    spec = spec_for(tiny["ce"], "cross_encoder", ("score",),
                    options={"activation": activation})
    scores = {}
    for runtime in (TORCH, ONNX):
        adapter = cross_encoder.load(spec, runtime)
        assert adapter.info.extra["backend"] == runtime.backend
        async with serve(adapter) as served:
            scores[runtime.backend] = (await adapter.score(served.submit, QUERY, DOCS,
                                                           ScoreOptions())).values
    assert len(set(scores["torch"])) == len(DOCS)  # distinct scores: a real comparison
    assert scores["onnx"] == pytest.approx(scores["torch"], abs=1e-5)


async def test_sparse_and_multivector_match_torch(tiny: dict[str, Path],
                                                  serve: ServeFactory) -> None:
    texts = ["the cat is big", "paris is the capital of france", DOCS[3]]
    for family, folder, kind in ((sparse, "sparse", "sparse"),
                                 (multivector, "colbert", "multivector")):
        spec = spec_for(tiny[folder], kind, ("encode",))
        values = {}
        for runtime in (TORCH, ONNX):
            adapter = family.load(spec, runtime)
            assert adapter.info.extra["backend"] == runtime.backend
            async with serve(adapter) as served:
                values[runtime.backend] = (await adapter.encode(served.submit, texts,
                                                                EncodeOptions())).values
        for a, b in zip(values["torch"], values["onnx"], strict=True):
            if kind == "sparse":
                assert a.sparse is not None and b.sparse is not None
                np.testing.assert_array_equal(a.sparse.indices, b.sparse.indices)
                np.testing.assert_allclose(a.sparse.values, b.sparse.values, atol=1e-4)
            else:
                assert a.multivector is not None and b.multivector is not None
                np.testing.assert_allclose(a.multivector, b.multivector, atol=1e-5)


# -- where the graph comes from ------------------------------------------------------


def load_bi(folder: Path, cache: Path, **fields: object) -> TransformerAdapter:
    spec = spec_for(folder, "transformer", ("encode",), **fields)
    return transformer.load(spec, Runtime(cache_dir=cache))


def test_export_is_cached_and_redone_when_the_weights_change(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder, cache = build_bi_encoder(tmp_path / "bi", seed=0), tmp_path / "cache"
    caplog.set_level(logging.INFO, logger="ember.onnx")
    first = load_bi(folder, cache)
    assert first.model.origin == "exported"  # type: ignore[attr-defined]
    assert "exporting to ONNX" in caplog.text and "ONNX graph ready" in caplog.text
    exported = list((cache / "onnx").glob("*/model.onnx"))
    assert len(exported) == 1
    stamp = exported[0].stat().st_mtime_ns
    caplog.clear()

    second = load_bi(folder, cache)
    assert second.model.origin == "cached"  # type: ignore[attr-defined]
    assert "exporting" not in caplog.text
    assert exported[0].stat().st_mtime_ns == stamp
    np.testing.assert_array_equal(embed(first, ["the cat"]), embed(second, ["the cat"]))

    build_bi_encoder(folder, seed=1)  # new weights in the same folder
    third = load_bi(folder, cache)
    assert third.model.origin == "exported"  # type: ignore[attr-defined]
    assert len(list((cache / "onnx").glob("*/model.onnx"))) == 2
    assert float(np.abs(embed(third, ["the cat"]) - embed(first, ["the cat"])).max()) > 1e-3
    assert not list((cache / "onnx").glob("*/.staging-*"))  # nothing half-written left


def test_truncated_weights_are_called_corrupt_not_an_export_for_torch(
        tmp_path: Path) -> None:
    """Found by a black-box review: the refusal advised backend: torch, which cannot
    read a cut file either."""
    folder = build_bi_encoder(tmp_path / "bi", seed=0)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="incomplete or corrupt") as caught:
        load_bi(folder, tmp_path / "cache")
    assert "backend: torch" not in str(caught.value)


def test_a_shipped_onnx_file_is_used(tmp_path: Path, tiny: dict[str, Path]) -> None:
    folder = tmp_path / "shipped"
    shutil.copytree(tiny["bi"], folder)
    exported = load_bi(folder, tmp_path / "cache")
    (folder / "onnx").mkdir()
    shutil.copy(exported.model.path, folder / "onnx" / "model.onnx")  # type: ignore[attr-defined]
    shipped = load_bi(folder, tmp_path / "other-cache")
    assert shipped.model.origin == "shipped"  # type: ignore[attr-defined]
    assert not (tmp_path / "other-cache").exists()  # nothing exported
    texts = ["the cat is big", "a slow river"]
    np.testing.assert_allclose(embed(shipped, texts), embed(exported, texts), atol=1e-6)


@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("damage", ["cut", "empty"])
def test_a_damaged_cached_graph_is_made_again(tmp_path: Path, tiny: dict[str, Path],
                                              quantize: str | None, damage: str) -> None:
    """Found by a black-box review: a cached graph cut short (a full disk, an interrupted
    copy) failed its model on every load, for good."""
    cache, fields = tmp_path / "cache", {"quantize": quantize} if quantize else {}
    first = load_bi(tiny["bi"], cache, **fields)
    texts = ["the cat is big", "a slow river"]
    want = embed(first, texts)
    for graph in (cache / "onnx").glob("*/model.onnx"):  # the float graph and the int8 one
        graph.write_bytes(graph.read_bytes()[: graph.stat().st_size // 3]
                          if damage == "cut" else b"")
    again = load_bi(tiny["bi"], cache, **fields)
    assert again.model.origin == "exported"  # type: ignore[attr-defined]
    np.testing.assert_allclose(embed(again, texts), want, atol=1e-6)
    assert load_bi(tiny["bi"], cache, **fields).model.origin == "cached"  # type: ignore[attr-defined]


@pytest.mark.parametrize("content", [b"", b"not a graph at all"])
def test_a_shipped_graph_onnx_runtime_cannot_read_is_exported_instead(
        tmp_path: Path, tiny: dict[str, Path], content: bytes,
        caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "shipped"
    shutil.copytree(tiny["bi"], folder)
    (folder / "onnx").mkdir()
    (folder / "onnx" / "model.onnx").write_bytes(content)
    adapter = load_bi(folder, tmp_path / "cache")
    assert adapter.model.origin == "exported"  # type: ignore[attr-defined]
    assert "ONNX Runtime cannot read it" in caplog.text


def test_a_cache_folder_that_cannot_be_written_is_named(
        tmp_path: Path, tiny: dict[str, Path]) -> None:
    """Found by a black-box review: an unwritable --cache-dir failed the model with advice
    to serve it on torch, not a word about the folder."""
    cache = tmp_path / "cache"
    cache.write_text("a file where the cache folder should be", encoding="utf-8")
    with pytest.raises(ModelLoadError, match="cannot write its ONNX export under") as caught:
        load_bi(tiny["bi"], cache)
    assert "--cache-dir (or EMBER_CACHE_DIR)" in str(caught.value)


def test_an_export_that_fails_otherwise_says_to_serve_it_on_torch(
        tmp_path: Path, tiny: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(name: str, plan: object, target: Path) -> None:
        raise RuntimeError("the tracer met an op it cannot export")

    monkeypatch.setattr(_onnx, "export", failing)  # a fault of the exporter's own
    with pytest.raises(ModelLoadError, match=r"cannot export to ONNX \(RuntimeError: the "
                       r"tracer met an op it cannot export\); serve it with backend: torch"):
        load_bi(tiny["bi"], tmp_path / "cache")


def test_a_folder_without_weights_says_so_not_to_serve_it_on_torch(
        tmp_path: Path, tiny: dict[str, Path]) -> None:
    """Found by a black-box review: the export's failure told the user to serve the model
    on torch, which fails the same way."""
    folder = tmp_path / "no-weights"
    shutil.copytree(tiny["bi"], folder, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ModelLoadError, match="its folder holds no weights file") as caught:
        load_bi(folder, tmp_path / "cache")
    assert "backend: torch" not in str(caught.value)


def test_a_folder_of_pickle_weights_only_points_to_allow_pickle(
        tmp_path: Path, tiny: dict[str, Path]) -> None:
    """Found by a review of the start: it said the folder held no weights and to fetch it
    again, with pytorch_model.bin right there."""
    folder = tmp_path / "pickled"
    shutil.copytree(tiny["bi"], folder, ignore=shutil.ignore_patterns("*.safetensors"))
    marker = tmp_path / "unpickled"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(TouchOnUnpickle(marker)))
    with pytest.raises(ModelLoadError, match=r"its weights are a pickle \(pytorch_model.bin\); "
                       "Ember loads safetensors unless the model's YAML says "
                       "allow_pickle: true"):
        load_bi(folder, tmp_path / "cache")
    assert not marker.exists()  # the bait ran no code: nothing unpickled it


class TouchOnUnpickle:
    """A pickle that, loaded, creates a file: code a pickle of weights could run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[Path]]:
        return Path.touch, (self.marker,)


def test_loras_run_on_torch_or_are_refused_on_onnx(tiny: dict[str, Path]) -> None:
    loras = {"a": tiny["lora"]}
    with_loras = transformer.load(spec_for(tiny["bi"], "transformer", ("encode",),
                                           loras=loras), Runtime())
    assert with_loras.info.extra["backend"] == "torch"  # the server default falls back
    with pytest.raises(ModelLoadError, match="LoRA adapters need backend: torch"):
        transformer.load(spec_for(tiny["bi"], "transformer", ("encode",), loras=loras,
                                  backend="onnx"), Runtime())
    with pytest.raises(ModelLoadError, match="quantize applies to the onnx backend"):
        transformer.load(spec_for(tiny["bi"], "transformer", ("encode",),
                                  backend="torch", quantize="int8"), Runtime())


def test_onnx_is_refused_off_cpu(tiny: dict[str, Path]) -> None:
    with pytest.raises(ModelLoadError, match="CPU only"):
        transformer.load(spec_for(tiny["bi"], "transformer", ("encode",), backend="onnx"),
                         Runtime(device="cuda"))


def test_staging_folders_no_export_will_finish_are_swept_by_the_next(tmp_path: Path) -> None:
    """Found by a review: an export a server left unfinished at its exit (no request
    awaited it), or one a crash ended, left its staging folder (a partial graph, hundreds
    of MB for a real model), and nothing removed it."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    host = socket.gethostname().replace("-", "_")
    gone = tmp_path / f".staging-{host}-{ended.pid}-abc"
    alive = tmp_path / f".staging-{host}-{os.getpid()}-def"  # an export of this process
    elsewhere = tmp_path / ".staging-another_host-1-ghi"  # whose owner cannot be told
    stale = tmp_path / ".staging-k2j3h4"  # an older Ember's, untouched for two days
    for folder in (gone, alive, elsewhere, stale):
        folder.mkdir()
        (folder / "model.onnx").write_bytes(b"half")
    two_days_ago = time.time() - 2 * 24 * 3600
    os.utime(stale, (two_days_ago, two_days_ago))
    with _onnx._staging(tmp_path / "model.onnx") as staged:
        staged.write_bytes(b"graph")
    assert not gone.exists() and not stale.exists()
    assert alive.exists() and elsewhere.exists()
    assert (tmp_path / "model.onnx").read_bytes() == b"graph"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["model.onnx", alive.name, elsewhere.name])  # its own staging folder went too


def test_onnx_runtime_writes_nothing_under_the_home_folder(tmp_path: Path) -> None:
    """Found by an operator's review: importing ONNX Runtime wrote a device id and a
    telemetry database under ~/.cache/Microsoft, whatever --cache-dir said (and a
    read-only home would refuse it). Ember turns that off unless the operator says."""
    home = tmp_path / "home"
    home.mkdir()
    env = {key: value for key, value in os.environ.items()
           if key not in ("ORT_DISABLE_TELEMETRY", "XDG_CACHE_HOME")}
    env.update(HOME=str(home), PYTHONPATH=str(Path(_onnx.__file__).parents[2]))
    code = "import ember.adapters._onnx, ember.adapters.gliner"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    assert [p for p in home.rglob("*") if p.is_file()] == []


def test_a_staging_folder_swapped_for_a_link_empties_nothing_it_points_at(
        tmp_path: Path) -> None:
    """Found by a security review: the staging folder's leftovers were unlinked by name,
    so a user who could write in the cache swapped the folder for a link to another
    folder during an export, and the server emptied that folder."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "important.txt").write_text("kept")
    cache = tmp_path / "cache"
    cache.mkdir()
    with (pytest.raises(RuntimeError, match="the export failed"),
          _onnx._staging(cache / "model.onnx") as staged):
        staged.write_bytes(b"graph")
        moved = staged.parent.rename(tmp_path / "moved")
        staged.parent.symlink_to(victim, target_is_directory=True)
        raise RuntimeError("the export failed")  # as the swap makes it fail
    assert (victim / "important.txt").read_text() == "kept"
    assert (moved / "model.onnx").read_bytes() == b"graph"
    assert not (cache / "model.onnx").exists()


@pytest.mark.parametrize(("opened", "refused"), [
    ("onnx", True), ("entry", True),
    ("cache", False),  # --cache-dir itself may be open (an emptyDir): Ember's folders are its
])
def test_a_cache_folder_other_users_may_write_in_is_refused(
        tmp_path: Path, tiny: dict[str, Path], opened: str, refused: bool) -> None:
    """Found by a security review: a graph found in the cache is run, so one planted by
    another user who may write there would run as the server."""
    cache = tmp_path / "cache"
    load_bi(tiny["bi"], cache)  # the cache as an export leaves it
    entry = next((cache / "onnx").glob("*/model.onnx")).parent
    folder = {"cache": cache, "onnx": cache / "onnx", "entry": entry}[opened]
    folder.chmod(0o777)
    if refused:
        with pytest.raises(ModelLoadError, match=rf"the ONNX cache folder {folder} is open to "
                           r"other users \(every user may write in it\)"):
            load_bi(tiny["bi"], cache)
        folder.chmod(0o700)
    assert load_bi(tiny["bi"], cache).model.origin == "cached"  # type: ignore[attr-defined]


@pytest.mark.skipif(os.getuid() != 0, reason="makes a folder another user's (chown)")
def test_another_users_cache_folder_is_refused_only_where_anyone_could_have_made_it(
        tmp_path: Path, tiny: dict[str, Path]) -> None:
    cache = tmp_path / "cache"
    load_bi(tiny["bi"], cache)
    os.chown(cache / "onnx", 65534, 65534)  # a prebuilt image's, say: accepted
    assert load_bi(tiny["bi"], cache).model.origin == "cached"  # type: ignore[attr-defined]
    cache.chmod(0o777)  # now any user could have made it
    with pytest.raises(ModelLoadError, match="another user made it where every user may"):
        load_bi(tiny["bi"], cache)


def test_a_cached_graph_any_user_may_write_is_refused_and_exports_are_not(
        tmp_path: Path, tiny: dict[str, Path]) -> None:
    cache = tmp_path / "cache"
    mask = os.umask(0)  # a umask of 0 would leave an export writable by everyone
    try:
        load_bi(tiny["bi"], cache)
    finally:
        os.umask(mask)
    graph = next((cache / "onnx").glob("*/model.onnx"))
    assert graph.stat().st_mode & 0o022 == 0, oct(graph.stat().st_mode)
    graph.chmod(0o666)
    with pytest.raises(ModelLoadError, match="may be written by every user"):
        load_bi(tiny["bi"], cache)


def test_the_cache_folders_an_export_makes_are_its_users_alone(
        tmp_path: Path, tiny: dict[str, Path]) -> None:
    cache = tmp_path / "cache"
    load_bi(tiny["bi"], cache)
    for folder in (cache / "onnx", *(cache / "onnx").iterdir()):
        assert folder.stat().st_mode & 0o077 == 0, (folder, oct(folder.stat().st_mode))
