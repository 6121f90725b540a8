"""Models by Hub id, through a local stand-in of the Hub (tests/hub_standin.py): the real
huggingface_hub client runs against it, in processes whose HF_ENDPOINT points at it and
whose cache is the test's own. Nothing here reaches the internet."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from ember.hub import HubRef, Wanted, cached, parse_hub_id
from tests.hub_standin import MINILM, HubStandIn, files_of, hub_env, minilm_folder
from tests.live_server import REPO, server_env, start_server

PICKLED = "someone/pickled-only"
TINY = "someone/tiny-encoder"
SLOW = "someone/slow-encoder"  # its weights come late: a large download
DENSE = "someone/tiny-encoder-dense"
GLINER = "someone/gliner-tiny"
COLBERTS = {"stanford": "someone/tiny-colbert-stanford", "pylate": "someone/tiny-colbert-pylate"}
M3S = {".pt": "someone/tiny-m3-pickled-heads", ".safetensors": "someone/tiny-m3"}
TEXTS = ["How do I reset my password?", "Paris is the capital of France."]


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubStandIn]:
    import torch

    from tests.adapters.tiny_models import build_bi_encoder, build_st_pipeline

    hub = HubStandIn()
    hub.add(MINILM, minilm_folder())
    root = tmp_path_factory.mktemp("repos")
    # An older commit of the same repository (a tiny model), reachable by its sha only.
    hub.notes = {"old": hub.add(MINILM, build_bi_encoder(root / "old", seed=3),
                                branch=None, salt="old")}
    hub.add(TINY, build_bi_encoder(root / "tiny", seed=4))
    hub.add(SLOW, build_bi_encoder(root / "slow", seed=6))
    # A sentence-transformers folder with a Dense module: its weights lie in a subfolder.
    dense = build_st_pipeline(root / "dense", build_bi_encoder(
        root / "dense-base", seed=5, normalize=False), dense=[(16, torch.nn.Tanh(), True)])
    hub.notes["dense"] = str(dense)
    hub.add(DENSE, dense)
    # ColBERTs as Stanford-NLP's and PyLate's ColBERT save them (artifact.metadata, 1_Dense/).
    from tests.adapters.tiny_models import build_pylate_colbert, build_stanford_colbert

    for layout, build in (("stanford", build_stanford_colbert), ("pylate", build_pylate_colbert)):
        folder = (build(root / layout, metadata={"query_maxlen": 10, "doc_maxlen": 24})
                  if layout == "stanford" else build(root / layout))
        hub.notes[layout] = str(folder)
        hub.add(COLBERTS[layout], folder)
    # M3 models: their heads as BAAI/bge-m3 ships them (pickles) and as safetensors.
    from tests.adapters.tiny_models import build_m3

    for heads, repo in M3S.items():
        hub.notes[repo] = str(build_m3(root / repo.split("/")[1], seed=7, heads=heads))
        hub.add(repo, Path(hub.notes[repo]))
    pickled = root / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    hub.add(PICKLED, pickled)
    # A GLiNER repository as the v2 ones are: its weights and config, the backbone's
    # tokenizer and config taken from another repository (TINY) named in its config.
    from tests.adapters.test_gliner import build_gliner

    gliner = build_gliner(root / "gliner", seed=4)
    config = json.loads((gliner / "gliner_config.json").read_text())
    (gliner / "gliner_config.json").write_text(json.dumps({**config, "model_name": TINY}))
    for extra in gliner.iterdir():
        if extra.name not in ("gliner_config.json", "model.safetensors"):
            extra.unlink()
    hub.add(GLINER, gliner)
    hub.start()
    yield hub
    hub.stop()


def in_process(standin: HubStandIn, home: Path, code: str, *, offline: bool = False,
               extra: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Python `code` in its own process, with the stand-in as its Hub; it prints JSON."""
    env = server_env({**hub_env(standin, home, offline), **(extra or {})})
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def run(standin: HubStandIn, home: Path, code: str, **kwargs: object) -> dict[str, object]:
    process = in_process(standin, home, code, **kwargs)  # type: ignore[arg-type]
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err[-3000:]
    result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return result


SNAPSHOT = """
import json, sys
from ember import hub
try:
    folder = hub.snapshot(hub.HubRef({repo!r}, {revision!r}), hub.Wanted(allow_pickle={pickle}))
    print(json.dumps({{"folder": str(folder)}}))
except hub.HubError as exc:
    print(json.dumps({{"error": str(exc)}}))
"""


def snapshot(repo: str, revision: str | None = None, pickle: bool = False) -> str:
    return SNAPSHOT.format(repo=repo, revision=revision, pickle=pickle)


def reference_vectors() -> np.ndarray:
    """The packaged model's own vectors, by sentence-transformers."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_folder()), device="cpu")
    return np.asarray(model.encode(TEXTS, normalize_embeddings=True))


def encode(url: str) -> np.ndarray:
    response = httpx.post(f"{url}/v1/encode/{MINILM}", timeout=60,
                          json={"items": [{"text": t} for t in TEXTS]})
    assert response.status_code == 200, response.text
    return np.array([item["dense"]["values"] for item in response.json()["items"]])


def test_a_first_start_downloads_and_serves_a_second_makes_no_request_offline_serves(
        standin: HubStandIn, tmp_path: Path) -> None:
    home = tmp_path / "hf"
    # torch: the ONNX export has its own test below; here what matters is the cache.
    args = ["--model", MINILM, "--backend", "torch"]
    first = start_server(tmp_path / "first.log", args, env=hub_env(standin, home))
    try:
        expected = reference_vectors()
        assert np.allclose(encode(first.url), expected, atol=1e-5)
    finally:
        first.stop()
    for name in files_of(minilm_folder()):
        wanted = not name.endswith((".md", ".gitattributes"))
        assert standin.gets(name) == (1 if wanted else 0), name
    assert "downloading model.safetensors" in first.log_text()

    seen = len(standin.requests)
    second = start_server(tmp_path / "second.log", args, env=hub_env(standin, home))
    try:
        assert np.allclose(encode(second.url), expected, atol=1e-5)
    finally:
        second.stop()
    assert len(standin.requests) == seen, standin.requests[seen:]

    third = start_server(tmp_path / "third.log", args,
                         env=hub_env(standin, home, offline=True))
    try:
        assert np.allclose(encode(third.url), expected, atol=1e-5)
    finally:
        third.stop()
    assert len(standin.requests) == seen


def test_a_start_that_downloads_exports_and_loads_writes_only_json_lines(
        standin: HubStandIn, tmp_path: Path) -> None:
    env = {**hub_env(standin, tmp_path / "hf"), "EMBER_CACHE_DIR": str(tmp_path / "onnx")}
    server = start_server(tmp_path / "json.log", ["--model", TINY, "--default-model", TINY,
                                                 "--log-format", "json"], env=env)
    try:
        response = httpx.post(f"{server.url}/v1/encode/{TINY}", timeout=60,
                              json={"items": [{"text": "the cat"}]})
        assert response.status_code == 200, response.text
    finally:
        server.stop()
    lines = [line for line in server.log_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line is JSON, or this fails
    messages = " ".join(str(r["message"]) for r in records)
    assert "downloading model.safetensors" in messages  # the download, file by file
    assert "export" in messages.lower()  # the ONNX export, in the same log
    assert any(r["message"].startswith("loaded model") for r in records)
    assert (tmp_path / "onnx").is_dir() and any((tmp_path / "onnx").rglob("*.onnx"))
    readyz = [r for r in records if r.get("path") == "/readyz" and r.get("status") == 503]
    assert all(r["level"] == "info" for r in readyz)  # a probe's 503 is no warning


def test_offline_without_the_cache_is_one_line_that_says_how_to_fetch(
        standin: HubStandIn, tmp_path: Path) -> None:
    env = server_env(hub_env(standin, tmp_path / "empty", offline=True))
    result = subprocess.run([sys.executable, "-m", "ember.cli", "serve", "--model", TINY,
                             "--port", "1"], capture_output=True, text=True, env=env,
                            cwd=REPO, timeout=120)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "Traceback" not in result.stderr
    assert TINY in errors[0] and "HF_HUB_OFFLINE" in errors[0] and "--preload" in errors[0]


def test_offline_with_part_of_a_model_in_the_cache_says_it_is_incomplete(
        standin: HubStandIn, tmp_path: Path) -> None:
    """Found by a black-box review: after a download cut short, the offline start said
    the model was not in the cache at all."""
    folder = Path(str(run(standin, tmp_path / "hf", snapshot(TINY))["folder"]))
    (folder / "model.safetensors").unlink()  # as if its download never finished
    refused = run(standin, tmp_path / "hf", snapshot(TINY), offline=True)
    assert "is incomplete in the Hugging Face cache" in str(refused["error"]), refused
    empty = run(standin, tmp_path / "other", snapshot(TINY), offline=True)
    assert "is not in the Hugging Face cache" in str(empty["error"]), empty


def test_a_revision_pin_is_honoured(standin: HubStandIn, tmp_path: Path) -> None:
    old = standin.notes["old"]
    pinned = run(standin, tmp_path / "hf", snapshot(MINILM, old))
    head = run(standin, tmp_path / "hf", snapshot(MINILM))
    assert Path(str(pinned["folder"])).name == old
    assert Path(str(head["folder"])).name != old
    config = json.loads((Path(str(pinned["folder"])) / "config.json").read_text())
    assert config["hidden_size"] != 384  # the tiny model of that commit, not MiniLM
    code = ("import json; from ember.config import load_catalog; "
            f"s = load_catalog(model_paths=['{MINILM}@{old}'])['{MINILM}']; "
            "print(json.dumps({'revision': s.source.revision, 'hub': s.source.hub, "
            "'prompts': dict(s.prompts), 'pooling': s.pooling}))")
    spec = run(standin, tmp_path / "hf", code)
    assert spec["revision"] == old and spec["hub"] == MINILM and spec["pooling"] == "mean"


def test_a_branch_that_moves_during_a_download_brings_the_commit_that_was_judged(
        standin: HubStandIn, tmp_path: Path) -> None:
    """Found by a review: the download was judged (its size, its files) at the listing's
    commit, then fetched at the branch, whose head an owner could move in between, with
    other files past --max-download-gb. It is fetched at the commit listed, and the
    branch's name is kept in the cache for the offline start."""
    import shutil

    repo = "someone/moving-encoder"
    judged = standin.add(repo, Path(str(run(standin, tmp_path / "tiny", snapshot(TINY))["folder"])))
    pushed = tmp_path / "pushed"
    shutil.copytree(Path(str(run(standin, tmp_path / "tiny", snapshot(TINY))["folder"])), pushed)
    (pushed / "pushed-later.json").write_text(json.dumps({"pad": "x" * 100_000}))
    standin.moves[repo] = standin.add(repo, pushed, branch=None, salt="pushed")
    fetched = Path(str(run(standin, tmp_path / "hf", snapshot(repo))["folder"]))
    assert fetched.name == judged
    assert not (fetched / "pushed-later.json").exists()
    assert standin.gets("pushed-later.json") == 0
    offline = run(standin, tmp_path / "hf", snapshot(repo), offline=True)
    assert Path(str(offline["folder"])) == fetched
    assert (fetched.parent.parent / "refs" / "main").read_text() == judged


def test_a_branch_that_cannot_be_recorded_in_the_cache_is_a_warning_not_a_failure(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Found by a review of the change: a download that had succeeded failed with a bare
    OSError where the cache could not take the branch's name (read-only, full)."""
    from ember.hub import remember_revision

    snapshot_folder = tmp_path / "models--org--name" / "snapshots" / ("a" * 40)
    snapshot_folder.mkdir(parents=True)
    (tmp_path / "models--org--name" / "refs").write_text("not a folder")
    with caplog.at_level("WARNING", logger="ember.hub"):
        remember_revision(snapshot_folder, "main", "a" * 40)
    assert "could not record" in caplog.text and "name the commit instead" in caplog.text
    refs = tmp_path / "models--org--name" / "refs"
    refs.unlink()
    refs.mkdir()
    (refs / "main").write_text("a" * 40)
    written = (refs / "main").stat().st_mtime_ns
    remember_revision(snapshot_folder, "main", "a" * 40)  # already so: nothing is written
    assert (refs / "main").stat().st_mtime_ns == written


@pytest.mark.parametrize("sha", ["../../../../escaped", "0" * 39, "main", "A" * 40])
def test_a_listing_whose_commit_is_no_commit_id_is_refused(
        standin: HubStandIn, tmp_path: Path, sha: str) -> None:
    """The listing's commit names a folder in the cache: a hostile Hub's path is refused
    before anything is fetched."""
    before = len(standin.requests)
    standin.shas[TINY] = sha
    try:
        refused = run(standin, tmp_path / "hf", snapshot(TINY))
    finally:
        del standin.shas[TINY]
    assert "as its commit, not a commit id; refused" in str(refused["error"]), refused
    assert not [p for m, p, _ in standin.requests[before:] if "/resolve/" in p]
    assert not list(tmp_path.rglob("escaped"))


def test_a_pickle_only_repository_is_refused_unless_allowed(
        standin: HubStandIn, tmp_path: Path) -> None:
    refused = run(standin, tmp_path / "hf", snapshot(PICKLED))
    assert "pickle weights only" in str(refused["error"])
    assert "allow_pickle: true" in str(refused["error"])
    assert standin.gets("pytorch_model.bin") == 0
    allowed = run(standin, tmp_path / "hf", snapshot(PICKLED, pickle=True))
    assert (Path(str(allowed["folder"])) / "pytorch_model.bin").is_file()
    assert standin.gets("pytorch_model.bin") == 1


@pytest.mark.parametrize("name", ["../../outside.json", "/etc/outside.json",
                                  "sub/../../outside.json", "a\\..\\outside.json"])
def test_a_repository_listing_files_outside_itself_is_refused(
        standin: HubStandIn, tmp_path: Path, name: str) -> None:
    """Found by a black-box review: such a name reached huggingface_hub's own check and
    came back as a 500; it is a model that cannot be had (502 on a request)."""
    repo = f"someone/escapes-{abs(hash(name)) % 10**6}"
    standin.add(repo, Path(standin.notes["dense"]))
    standin.listed[repo] = [name]
    refused = run(standin, tmp_path / "hf", snapshot(repo))
    assert "lists files outside itself" in str(refused["error"]), refused
    assert repr(name) in str(refused["error"])
    assert not [path for method, path, _ in standin.requests  # nothing downloaded
                if method == "GET" and path.startswith(f"/{repo}/resolve/")]
    assert not list(tmp_path.rglob("outside.json"))


def test_a_dense_module_in_a_subfolder_is_fetched_and_run(standin: HubStandIn,
                                                          tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    from ember.adapters import transformer
    from ember.adapters.base import EncodeOptions, Runtime
    from tests.adapters.tiny_models import spec_for

    folder = Path(str(run(standin, tmp_path / "hf", snapshot(DENSE))["folder"]))
    assert (folder / "2_Dense" / "model.safetensors").is_file()
    adapter = transformer.load(spec_for(folder, "transformer", ("encode",)),
                               Runtime(backend="torch"))
    items, params = adapter.prepare(TEXTS, EncodeOptions())
    expected = SentenceTransformer(standin.notes["dense"], device="cpu").encode(TEXTS)
    np.testing.assert_allclose(np.stack(adapter.forward(items, params)), expected,
                               rtol=1e-4, atol=1e-5)


COLBERT_BY_ID = """
import json
from ember.adapters import multivector
from ember.adapters.base import EncodeOptions, Runtime
from ember.config import load_catalog
spec = load_catalog(model_paths=[{repo!r}])[{repo!r}]
adapter = multivector.load(spec, Runtime(backend="torch"))  # fetching is the subject, not export
out = {{"adapter": spec.adapter, "layout": adapter.info.extra["colbert"]["layout"]}}
for side, text in (("query", {query!r}), ("document", {document!r})):
    items, params = adapter.prepare([text], EncodeOptions(is_query=side == "query"))
    out[side] = adapter.forward(items, params)[0].tolist()
print(json.dumps(out))
"""


@pytest.mark.parametrize("layout", ["stanford", "pylate"])
def test_a_colbert_by_hub_id_is_fetched_whole_and_served_as_sentence_transformers_does(
        standin: HubStandIn, tmp_path: Path, layout: str) -> None:
    from sentence_transformers import MultiVectorEncoder

    query, document = "what is the capital of france?", "paris, the capital of france."
    repo = COLBERTS[layout]
    out = run(standin, tmp_path / "hf", COLBERT_BY_ID.format(repo=repo, query=query,
                                                             document=document),
              extra={"EMBER_ALLOW_HUB_MODELS": "1"})
    assert (out["adapter"], out["layout"]) == ("multivector", layout)
    reference = MultiVectorEncoder(standin.notes[layout], device="cpu")
    np.testing.assert_allclose(out["query"], reference.encode_query([query])[0].numpy(),
                               atol=2e-5)
    np.testing.assert_allclose(out["document"],
                               reference.encode_document([document])[0].numpy(), atol=2e-5)
    fetched = "artifact.metadata" if layout == "stanford" else "1_Dense/model.safetensors"
    assert standin.gets(fetched) == 1


M3_BY_ID = """
import json
from ember.adapters import m3
from ember.adapters.base import EncodeOptions, Runtime
from ember.config import load_catalog
spec = load_catalog(model_paths=[{repo!r}])[{repo!r}]
out = {{"adapter": spec.adapter}}
if spec.adapter == "m3":
    adapter = m3.load(spec, Runtime(backend="torch"))  # fetching is the subject, not export
    items, params = adapter.prepare([{text!r}], EncodeOptions(output_types=("sparse",)))
    out["sparse"] = adapter.forward(items, params)[0].sparse.indices.tolist()
print(json.dumps(out))
"""


M3_CURATED = """
import json
from ember import hub
from ember.adapters import m3
from ember.adapters.base import EncodeOptions, Runtime
from ember.config import ModelSpec, Source, hub_wanted
spec = ModelSpec(name={repo!r}, adapter="m3", source=Source(hub={repo!r}),
                 tasks=("encode",), allow_pickle=True)
hub.snapshot(hub.HubRef({repo!r}, None), hub_wanted(spec), download=True)
adapter = m3.load(spec, Runtime(backend="torch"))
items, params = adapter.prepare([{text!r}], EncodeOptions(output_types=("sparse",)))
print(json.dumps({{"sparse": adapter.forward(items, params)[0].sparse.indices.tolist()}}))
"""


def test_an_m3_model_by_hub_id_brings_its_heads_where_they_need_no_pickle(
        standin: HubStandIn, tmp_path: Path) -> None:
    """Heads in safetensors come with a bare Hub id and make it an M3 model; pickled heads
    (BAAI/bge-m3's) are fetched only for a spec that allows pickles, as its catalog entry
    does, beside safetensors weights too; a bare id of such a repository is served by its
    encoder alone."""
    from ember.adapters import m3
    from ember.adapters.base import EncodeOptions, Runtime
    from tests.adapters.tiny_models import spec_for

    text = "the cat and the dog"
    safe = run(standin, tmp_path / "hf", M3_BY_ID.format(repo=M3S[".safetensors"], text=text),
               extra={"EMBER_ALLOW_HUB_MODELS": "1"})
    local = m3.load(spec_for(Path(standin.notes[M3S[".safetensors"]]), "m3", ("encode",)),
                    Runtime(backend="torch"))
    items, params = local.prepare([text], EncodeOptions(output_types=("sparse",)))
    wanted = local.forward(items, params)[0].sparse
    assert wanted is not None and safe == {"adapter": "m3", "sparse": wanted.indices.tolist()}
    pickled, home = M3S[".pt"], tmp_path / "hf2"
    bare = M3_BY_ID.format(repo=pickled, text=text)
    hub_models = {"EMBER_ALLOW_HUB_MODELS": "1"}
    assert run(standin, home, bare, extra=hub_models) == {"adapter": "transformer"}
    assert standin.gets("sparse_linear.pt") == 0
    curated = run(standin, home, M3_CURATED.format(repo=pickled, text=text))
    assert curated["sparse"] == wanted.indices.tolist()  # the same seed's heads
    assert standin.gets("sparse_linear.pt") == standin.gets("colbert_linear.pt") == 1
    # The heads now in the shared cache change nothing for the bare id.
    assert run(standin, home, bare, extra=hub_models) == {"adapter": "transformer"}
    # A spec allowing pickles over safetensors heads finds them in the cache, offline too.
    safe_curated = M3_CURATED.format(repo=M3S[".safetensors"], text=text)
    for offline in (False, True):
        assert run(standin, tmp_path / "hf4", safe_curated, offline=offline) == {
            "sparse": wanted.indices.tolist()}


def test_two_processes_starting_together_download_each_file_once(
        standin: HubStandIn, tmp_path: Path) -> None:
    before = {name: standin.gets(name) for name in files_of(minilm_folder())}
    both = [in_process(standin, tmp_path / "hf", snapshot(MINILM)) for _ in range(2)]
    outputs = [process.communicate(timeout=120) for process in both]
    assert all(p.returncode == 0 for p in both), outputs
    folders = {json.loads(out.strip().splitlines()[-1])["folder"] for out, _ in outputs}
    assert len(folders) == 1
    for name, count in before.items():
        wanted = not name.endswith((".md", ".gitattributes"))
        assert standin.gets(name) - count == (1 if wanted else 0), name


def test_a_download_cut_in_the_middle_resumes(standin: HubStandIn, tmp_path: Path) -> None:
    standin.cut_once.add("model.safetensors")
    start = len(standin.requests)
    result = run(standin, tmp_path / "hf", snapshot(MINILM))
    folder = Path(str(result["folder"]))
    weights = (folder / "model.safetensors").read_bytes()
    assert weights == (minilm_folder() / "model.safetensors").read_bytes()
    ranges = [r for m, p, r in standin.requests[start:]
              if m == "GET" and p.endswith("/model.safetensors")]
    assert len(ranges) == 2 and ranges[0] == ""
    # The second asks for the rest only: from what the client had written (whole chunks
    # of the half it received), not from zero.
    resumed_at = int(ranges[1].removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at <= len(weights) // 2


def test_a_request_downloads_a_hub_model_only_when_the_server_allows_it(
        standin: HubStandIn, tmp_path: Path) -> None:
    code = f"""
import asyncio, json
from ember.config import load_catalog
from ember.errors import ModelNotFound
from ember.registry import Registry
from ember.adapters.base import Runtime

async def main():
    registry = Registry(load_catalog(), Runtime(backend="torch"))
    try:
        model = await registry.get({TINY!r})
        info = model.adapter.info
        out = {{"loaded": True, "dims": info.dims, "names": registry.names}}
    except ModelNotFound as exc:
        out = {{"loaded": False, "error": str(exc)}}
    await registry.close()
    print(json.dumps(out))

asyncio.run(main())
"""
    refused = run(standin, tmp_path / "hf", code, extra={"EMBER_ALLOW_HUB_MODELS": "0"})
    assert refused["loaded"] is False and TINY in str(refused["error"])
    assert not (tmp_path / "hf" / "hub" / f"models--{TINY.replace('/', '--')}").exists()
    allowed = run(standin, tmp_path / "hf", code, extra={"EMBER_ALLOW_HUB_MODELS": "1"})
    assert allowed["loaded"] is True and allowed["dims"] == 32
    assert TINY in allowed["names"]  # type: ignore[operator]


def test_a_request_for_a_repository_the_hub_lacks_or_a_revision_is_a_404_saying_why(
        standin: HubStandIn, tmp_path: Path) -> None:
    """Found by a black-box review: a repository not on the Hub was a 502 (a load that
    failed), and a revision in a request a 404 listing the catalog without saying why."""
    code = f"""
import asyncio, json
from ember.api.errors import as_api_error
from ember.config import load_catalog
from ember.registry import Registry
from ember.adapters.base import Runtime

async def main():
    registry = Registry(load_catalog(), Runtime(backend="torch"))
    out = {{}}
    for name in ("someone/not-there", {TINY + "@main"!r}, {TINY + " "!r}, {TINY + "  "!r},
                 "someone/gated", "someone/private", "baai/bge-small-en-v1.5",
                 {TINY.upper()!r}):
        try:
            await registry.get(name)
            out[name] = "loaded"
        except Exception as exc:
            error = as_api_error(exc)
            out[name] = [error.status, error.kind, error.message]
    await registry.close()
    print(json.dumps(out))

asyncio.run(main())
"""
    standin.refused.update({"someone/gated": 403, "someone/private": 401})
    try:
        answers = run(standin, tmp_path / "hf", code, extra={"EMBER_ALLOW_HUB_MODELS": "1"})
    finally:
        standin.refused.clear()
    # Found by a black-box review: a 403 was "the Hub could not be reached; check the network".
    for name, code_ in (("someone/gated", 403), ("someone/private", 401)):
        status, kind, message = answers[name]  # type: ignore[misc]
        assert (status, kind) == (404, "model_not_found")
        assert f"refused access to it ({code_})" in message and "HF_TOKEN" in message
        assert "could not be reached" not in message
    status, kind, message = answers["someone/not-there"]  # type: ignore[misc]
    assert (status, kind) == (404, "model_not_found") and "not on the Hub" in message
    status, kind, message = answers[TINY + "@main"]  # type: ignore[misc]
    assert (status, kind) == (404, "model_not_found")
    assert f"--model {TINY}@main" in message and "may not name a Hub revision" in message
    # Found by a review: a catalog name in other case was a second, uncurated copy.
    status, kind, message = answers["baai/bge-small-en-v1.5"]  # type: ignore[misc]
    assert (status, kind) == (404, "model_not_found")
    assert "did you mean 'BAAI/bge-small-en-v1.5'?" in message
    assert not [p for _, p, _ in standin.requests if "baai/" in p]
    # Found by a review: a Hub id in other case was a second download and a second model.
    status, kind, message = answers[TINY.upper()]  # type: ignore[misc]
    assert (status, kind) == (404, "model_not_found")
    assert f"did you mean {TINY!r}?" in message
    assert not [p for _, p, _ in standin.requests if "/resolve/" in p and TINY.upper() in p]
    # A space after the id is no Hub id (it had loaded a second copy under "org/x ").
    for alias in (TINY + " ", TINY + "  "):
        assert answers[alias][:2] == [404, "model_not_found"]  # type: ignore[index]


NOT_DOWNLOADED = """
import asyncio, json
from ember import hub
from ember.api.errors import as_api_error
from ember.config import ModelSpec, Source, hub_wanted, parse_spec
from ember.registry import Registry, RegistryLimits
from ember.adapters.base import Runtime

async def main():
    hub_model = ModelSpec(name={repo!r}, adapter={family!r}, source=Source(hub={repo!r}),
                          tasks=({task!r},))
    if {own_files_here}:  # its own files, not its backbone's
        hub.snapshot(hub.HubRef({repo!r}), hub_wanted(hub_model), download=True)
    other = parse_spec({{"name": "test/loaded", "adapter": "synthetic", "tasks": ["encode"]}},
                       "test")
    registry = Registry({{spec.name: spec for spec in (hub_model, other)}}, Runtime(),
                        limits=RegistryLimits(max_loaded_models=1))
    await registry.get("test/loaded")
    out = {{}}
    try:
        await registry.get({repo!r})
        out["answer"] = "loaded"
    except Exception as exc:
        error = as_api_error(exc)
        out["answer"] = [error.status, error.kind, error.message]
    out["state"] = registry.state({repo!r})
    out["loaded"] = sorted(registry.loaded)
    await registry.close()
    print(json.dumps(out))

asyncio.run(main())
"""


@pytest.mark.parametrize("where", ["offline", "downloads not allowed", "backbone missing"])
def test_a_catalog_model_this_server_may_not_download_is_a_404_that_evicts_nothing(
        standin: HubStandIn, tmp_path: Path, where: str) -> None:
    """Found by a review: such a request was a 502 (a load failure, logged as an error and
    remembered), which clients retry; and room was made for it first, evicting a model.
    A GLiNER whose backbone's tokenizer is not here is checked before room is made too."""
    offline = where == "offline"
    gliner = where == "backbone missing"
    code = NOT_DOWNLOADED.format(repo=GLINER if gliner else TINY, own_files_here=gliner,
                                 family="gliner" if gliner else "transformer",
                                 task="extract" if gliner else "encode")
    before = len(standin.requests)  # the stand-in serves the whole module
    answer = run(standin, tmp_path / "hf", code, offline=offline,
                 extra={"EMBER_ALLOW_HUB_MODELS": "1" if offline else "0"})
    status, kind, message = answer["answer"]  # type: ignore[misc]
    assert (status, kind) == (404, "model_not_found"), answer
    assert f"model {TINY}" in message and "is not in the Hugging Face cache" in message
    if gliner:
        assert message.startswith(f"model {GLINER} takes its tokenizer from {TINY}: ")
    assert ("HF_HUB_OFFLINE is set" if offline else f"--preload {TINY}") in message
    assert answer["state"] == "available"  # not a failure to wait 30 s for
    assert answer["loaded"] == ["test/loaded"]
    assert not [path for method, path, _ in standin.requests[before:] if TINY in path]


def test_a_download_does_not_hold_up_the_loads_of_models_on_disk(
        standin: HubStandIn, tmp_path: Path) -> None:
    """Found by a black-box review: a catalog model's download (its YAML names a Hub
    source) ran under the process's one-load lock, so every other model's load waited
    for the whole download."""
    yaml = tmp_path / "yaml"
    yaml.mkdir()
    (yaml / "slow.yaml").write_text(f"name: {SLOW}\nadapter: transformer\n"
                                    f"source: {{hub: {SLOW}}}\ntasks: [encode]\n")
    code = f"""
import asyncio, json, time
from pathlib import Path
from ember.config import load_catalog
from ember.registry import Registry
from ember.adapters.base import Runtime

async def main():
    registry = Registry(load_catalog([Path({str(yaml)!r})]), Runtime(backend="torch"))
    started = time.monotonic()
    downloading = asyncio.ensure_future(registry.get({SLOW!r}))
    await asyncio.sleep(0.5)
    await registry.get("ember/synthetic")
    local_s = time.monotonic() - started
    await downloading
    print(json.dumps({{"local_s": local_s, "hub_s": time.monotonic() - started}}))
    await registry.close()

asyncio.run(main())
"""
    standin.slow[SLOW] = 4.0
    try:
        times = run(standin, tmp_path / "hf", code, extra={"EMBER_ALLOW_HUB_MODELS": "1"})
    finally:
        standin.slow.clear()
    assert times["hub_s"] >= 4.0  # type: ignore[operator]
    # Not after the download: well before it ended (a bound in seconds failed beside the
    # suite's other process, 3.1 s against 3, with the download taking 11 s).
    assert times["local_s"] < times["hub_s"] - 1.0, times  # type: ignore[operator]


def test_every_api_process_lists_a_hub_model_that_another_one_had_loaded(
        standin: HubStandIn, tmp_path: Path) -> None:
    """Found by a black-box review: under --workers 2, /v1/models listed a Hub model a
    request had loaded, and /v1/models/{id} found it, only when the API process that took
    that request answered."""
    env = {**hub_env(standin, tmp_path / "hf"), "EMBER_ALLOW_HUB_MODELS": "1"}
    server = start_server(tmp_path / "workers.log", ["--workers", "2", "--backend", "torch"],
                          env=env)
    try:
        loaded = httpx.post(f"{server.url}/v1/encode/{TINY}", timeout=60,
                            json={"items": [{"text": "the cat"}]})
        assert loaded.status_code == 200, loaded.text
        for _ in range(8):
            with httpx.Client(base_url=server.url, timeout=30) as fresh:  # either process
                listed = fresh.get("/v1/models").json()
                assert TINY in [entry["id"] for entry in listed["data"]]
                one = fresh.get(f"/v1/models/{TINY}")
                assert one.status_code == 200 and one.json()["state"] == "loaded", one.text
    finally:
        server.stop()


@pytest.mark.parametrize("text", ["org/tiny ", " org/tiny", "org/tiny\n", "org/tiny.git",
                                  "org/ti--ny", "../etc/passwd", "/abs/path", "org/../name",
                                  "org/name/x",
                                  "org name/x", "~/models/x", "./org/name", "org/",
                                  "org/na$me", "o" * 200 + "/x", "org/name@rev with space",
                                  "org/name@/etc/passwd", "org/name@a//b", "org/name@main/",
                                  "org/name@"])
def test_what_is_not_a_hub_id_is_never_fetched(text: str) -> None:
    assert parse_hub_id(text) is None


def test_hub_ids_with_and_without_a_revision() -> None:
    assert parse_hub_id("BAAI/bge-small-en-v1.5") == HubRef("BAAI/bge-small-en-v1.5")
    assert parse_hub_id("org/name@main") == HubRef("org/name", "main")
    assert parse_hub_id("org/name@refs/pr/1") == HubRef("org/name", "refs/pr/1")
    assert str(parse_hub_id("org/name@" + "a" * 40)) == "org/name@" + "a" * 40


SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


@pytest.mark.parametrize(("weight_map", "complete"), [
    ({"a": SHARDS[0], "b": SHARDS[1]}, True),
    ({"a": SHARDS[0], "b": "model-00003-of-00002.safetensors"}, False),  # cut before it
    ({"a": SHARDS[0], "b": "../outside.safetensors"}, False),  # a name outside the folder
    ({"a": SHARDS[0], "b": "OUTSIDE"}, False),  # the same, by an absolute path (below)
    ("oversize", False),  # every shard here, the index over the size a JSON file may have
    ({"a": SHARDS[0], "b": 7}, False),
    ([SHARDS[0]], False),
    ("nested", False),
])
def test_a_sharded_snapshot_is_cached_only_with_every_shard_its_index_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, weight_map: object,
        complete: bool) -> None:
    """Found by a code review: a download cut between two shards left a folder that the
    Hub's client returns as whole where it holds no listing of the snapshot (a cache
    written by another tool or an older client), so it was never resumed and every load
    failed. A hostile index (a shard outside the folder, a deep or odd JSON) is no proof."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    sha = "a" * 40
    repo = tmp_path / "models--someone--sharded"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(sha)
    folder = repo / "snapshots" / sha
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"architectures": ["BertModel"]}')
    for shard in SHARDS:
        (folder / shard).write_bytes(b"weights")
    (tmp_path / "outside.safetensors").write_bytes(b"not this model's")
    if isinstance(weight_map, dict) and weight_map.get("b") == "OUTSIDE":
        weight_map = {**weight_map, "b": str(tmp_path / "outside.safetensors")}
    index: object = {"weight_map": weight_map}
    if weight_map == "oversize":
        monkeypatch.setattr("ember.model_files.MAX_MODEL_JSON_BYTES", 200)
        index = {"weight_map": {"a": SHARDS[0], "b": SHARDS[1]}, "metadata": "x" * 200}
    text = "[" * 100_000 if weight_map == "nested" else json.dumps(index)
    (folder / "model.safetensors.index.json").write_text(text)
    found = cached(HubRef("someone/sharded"), Wanted())
    assert (found == folder) if complete else found is None


def test_a_gliner_from_the_hub_brings_its_backbones_tokenizer_not_its_weights(
        standin: HubStandIn, tmp_path: Path) -> None:
    code = f"""
import json
from ember.adapters.base import ExtractOptions, Runtime
from ember.adapters.gliner import load
from ember.config import load_catalog
spec = load_catalog(model_paths=[{GLINER!r}])[{GLINER!r}]
adapter = load(spec, Runtime(backend="torch"))
items = adapter.prepare(["the cat is in paris"], adapter.params(ExtractOptions(labels=("city",))))
print(json.dumps({{"adapter": spec.adapter, "entities": [
    [e.label for e in found] for found in adapter.forward(items, adapter.params(
        ExtractOptions(labels=("city",), threshold=0.0)))]}}))
"""
    weights_before = standin.gets("model.safetensors")
    result = run(standin, tmp_path / "hf", code)
    found = result["entities"][0]  # type: ignore[index]
    assert result["adapter"] == "gliner" and found and set(found) == {"city"}
    assert standin.gets("model.safetensors") == weights_before + 1  # the GLiNER's own only
    assert (tmp_path / "hf" / "hub" / f"models--{TINY.replace('/', '--')}").is_dir()


LOAD_GLINERS = """
import json
from ember.adapters.base import Runtime
from ember.adapters.gliner import load
from ember.config import CatalogError, load_catalog
from ember.errors import ModelLoadError
results = {{}}
for repo in {repos!r}:  # one process for all: each load stands alone, the import is shared
    try:
        spec = load_catalog(model_paths=[repo])[repo]
        load(spec, Runtime(backend="torch"))
        results[repo] = {{"loaded": True}}
    except (CatalogError, ModelLoadError, FileNotFoundError) as exc:
        results[repo] = {{"error": str(exc)}}
print(json.dumps(results))
"""


def load_gliners(standin: HubStandIn, home: Path, repos: list[str]) -> dict[str, dict[str, str]]:
    """Each Hub GLiNER loaded in turn, in one process: "loaded", or the refusal's "error"."""
    results = run(standin, home, LOAD_GLINERS.format(repos=repos))
    return {repo: dict(result) for repo, result in results.items()}  # type: ignore[call-overload]


def hostile_gliner(standin: HubStandIn, root: Path, repo: str, **config: object) -> None:
    """The test GLiNER with `config` over its gliner_config.json, served as `repo`."""
    from shutil import copytree

    [source] = standin.repos[GLINER].commits.values()
    folder = copytree(source, root / repo.replace("/", "--"))
    fields = json.loads((folder / "gliner_config.json").read_text())
    (folder / "gliner_config.json").write_text(json.dumps({**fields, **config}))
    standin.add(repo, folder)


def code_that_marks(marker: Path) -> str:
    return (f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
            "class EvilModel:\n    pass\n")


def test_a_gliner_whose_files_map_a_class_to_code_runs_none_of_it(
        standin: HubStandIn, tmp_path: Path) -> None:
    """Found by a review: gliner builds its backbone with trust_remote_code on, whatever
    the YAML says, so an `auto_map` in a Hub GLiNER's encoder_config, or in the config of
    the backbone it names, ran the repositories' code in the server; `tokenizer*` fetched
    a tokenizer.py for it. Each is refused now, and no code file is fetched."""
    marker = tmp_path / "ran"
    [tiny] = standin.repos[TINY].commits.values()
    from shutil import copytree

    backbone = copytree(tiny, tmp_path / "backbone")
    config = json.loads((backbone / "config.json").read_text())
    (backbone / "config.json").write_text(json.dumps(
        {**config, "auto_map": {"AutoModel": "tokenizer.EvilModel"}}))
    (backbone / "tokenizer.py").write_text(code_that_marks(marker))
    (backbone / "modeling_evil.py").write_text(code_that_marks(marker))
    standin.add("evil/backbone", backbone)
    # A second review: a config too large for the check (transformers reads any size),
    # and models gliner loads itself from the Hub (a bi-encoder's labels encoder).
    bloated = copytree(backbone, tmp_path / "bloated")
    (bloated / "config.json").write_text(json.dumps(
        {**config, "auto_map": {"AutoModel": "modeling_evil.EvilModel"},
         "padding": "x" * (17 << 20)}))
    standin.add("evil/bloated", bloated)
    encoder = dict(config, auto_map={"AutoModel": "evil/code--modeling_evil.EvilModel"})
    hostile_gliner(standin, tmp_path, "evil/gliner-encoder-code", encoder_config=encoder)
    hostile_gliner(standin, tmp_path, "evil/gliner-backbone-code", model_name="evil/backbone")
    hostile_gliner(standin, tmp_path, "evil/gliner-bloated", model_name="evil/bloated")
    hostile_gliner(standin, tmp_path, "evil/gliner-labels", labels_encoder="evil/backbone")
    hostile_gliner(standin, tmp_path, "evil/gliner-decoder", labels_decoder="evil/backbone")
    refusals = {
        "evil/gliner-encoder-code": "gliner_config.json maps a class to code",
        "evil/gliner-backbone-code": "config.json maps a class to code",
        "evil/gliner-bloated": "config.json cannot be checked for code",
        "evil/gliner-labels": "names other models (labels_encoder: evil/backbone)",
        "evil/gliner-decoder": "names other models (labels_decoder: evil/backbone)"}
    results = load_gliners(standin, tmp_path / "hf", list(refusals))
    for repo, says in refusals.items():
        refused = results[repo]
        assert says in str(refused.get("error")), refused
        assert "trust_remote_code: true" in str(refused["error"])
    assert not marker.exists()
    assert standin.gets("tokenizer.py") == standin.gets("modeling_evil.py") == 0


def test_a_gliner_from_the_hub_may_not_take_a_folder_of_the_server_as_its_backbone(
        standin: HubStandIn, tmp_path: Path) -> None:
    """Found by a review: a Hub GLiNER's `model_name` naming a path made the server read
    that folder of its own disk as the backbone."""
    [tiny] = standin.repos[TINY].commits.values()
    hostile_gliner(standin, tmp_path, "evil/gliner-local", model_name=str(tiny))
    refused = load_gliners(standin, tmp_path / "hf", ["evil/gliner-local"])["evil/gliner-local"]
    assert "names a folder of this machine" in str(refused.get("error")), refused


FAILING_LOOKUPS = """
import asyncio, json, os
from ember.api.errors import as_api_error
from ember.config import load_catalog
from ember.registry import Registry
from ember.adapters.base import Runtime

async def main():
    registry = Registry(load_catalog(), Runtime(backend="torch"))
    out = []
    for _ in range(2):  # the second within the retry window: answered without the Hub
        try:
            await registry.get({repo!r})
            out.append("loaded")
        except Exception as exc:
            error = as_api_error(exc)
            out.append([error.status, error.kind, error.message])
    await registry.close()
    print(json.dumps({{"answers": out}}))

asyncio.run(main())
"""


@pytest.mark.parametrize("fault", ["its files answer 404", "the Hub is unreachable",
                                   "offline without it"])
def test_a_hub_that_fails_a_request_is_a_clear_answer_once_a_retry_window(
        standin: HubStandIn, tmp_path: Path, fault: str) -> None:
    """Found by a review: a file the Hub failed, or a Hub out of reach, was a 500 that
    repeated the Hub's address and answer to the client, every request called the Hub
    again, and a model missing offline was a 502 rather than "not here"."""
    from shutil import copytree

    repo = f"someone/failing-{len(standin.repos)}"
    [tiny] = standin.repos[TINY].commits.values()
    standin.add(repo, copytree(tiny, tmp_path / "repo"))
    standin.failing[repo] = 404  # a 5xx is the same answer, after the client's retries
    extra = {"EMBER_ALLOW_HUB_MODELS": "1"}
    if fault == "the Hub is unreachable":
        from tests.live_server import free_port

        extra["HF_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"
    before = len(standin.requests)
    try:
        answers = run(standin, tmp_path / "hf", FAILING_LOOKUPS.format(repo=repo),
                      offline=fault == "offline without it", extra=extra)["answers"]
    finally:
        standin.failing.clear()
    first, second = answers  # type: ignore[misc]
    assert first == second, answers
    status, kind, message = first
    want = {"its files answer 404": (502, "model_load_failed",
                                     "the Hub answered 404 while downloading its files"),
            "the Hub is unreachable": (502, "model_load_failed", "could not be reached"),
            "offline without it": (404, "model_not_found", "HF_HUB_OFFLINE is set")}[fault]
    assert (status, kind) == want[:2] and want[2] in message, first
    assert "127.0.0.1" not in message and "must not see" not in message
    calls = [path for _, path, _ in standin.requests[before:] if repo in path]
    assert calls.count(f"/api/models/{repo}/revision/main") <= 1  # once, not twice


def test_a_preload_by_hub_id_that_cannot_be_had_is_skipped_and_the_server_starts(
        standin: HubStandIn, tmp_path: Path) -> None:
    """Found by a review: `--preload org/name` the Hub lacked stopped the start with exit 2,
    where a catalog model's missing preload is logged and skipped, as the README says."""
    server = start_server(tmp_path / "server.log", [
        "--default-model", "ember/synthetic", "--preload", "someone/never-published"],
        env=hub_env(standin, tmp_path / "hf", offline=False))
    try:
        assert "could not preload someone/never-published" in server.log_text()
        assert httpx.get(f"{server.url}/readyz").status_code == 200
    finally:
        server.stop()


def test_only_a_models_own_files_are_fetched_and_a_repository_of_thousands_is_refused(
        standin: HubStandIn, tmp_path: Path) -> None:
    """Found by a review: the patterns' `*` crosses folders, so `*.json` fetched a
    repository's 3,000 checkpoint and log files, and `tokenizer*` its pickles."""
    from shutil import copytree

    from ember.hub import MAX_FILES

    [tiny] = standin.repos[TINY].commits.values()
    cluttered = copytree(tiny, tmp_path / "cluttered")
    for junk in ("checkpoint-500/config.json", "runs/x/events.json", "tokenizer.pkl",
                 "tokenizer_extra.bin", "tokenizer.py"):
        (cluttered / junk).parent.mkdir(parents=True, exist_ok=True)
        (cluttered / junk).write_text("{}")
    standin.add("someone/cluttered", cluttered)
    (cluttered / "notes[1].json").write_text("{}")  # a wanted name that reads as a pattern
    folder = Path(str(run(standin, tmp_path / "hf", snapshot("someone/cluttered"))["folder"]))
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    assert (folder / "notes[1].json").is_file()  # fetched by its name, not as a pattern
    for junk in ("checkpoint-500", "runs", "tokenizer.pkl", "tokenizer_extra.bin",
                 "tokenizer.py"):
        assert not (folder / junk).exists(), junk
    crowded = copytree(tiny, tmp_path / "crowded")
    for index in range(MAX_FILES):
        (crowded / f"junk-{index}.json").write_text("{}")
    standin.add("someone/crowded", crowded)
    refused = run(standin, tmp_path / "hf", snapshot("someone/crowded"))
    assert f"over the {MAX_FILES} Ember fetches" in str(refused.get("error")), refused


REQUESTED_DOWNLOADS = """
import asyncio, json, time
from concurrent.futures import ThreadPoolExecutor
from ember.config import load_catalog
from ember.registry import Registry
from ember.adapters.base import Runtime

async def main():
    # A small machine's default pool: two threads, as loads and file checks use.
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(2))
    registry = Registry(load_catalog(), Runtime(backend="torch"))
    started = time.monotonic()
    downloads = [asyncio.ensure_future(registry.get(repo)) for repo in {repos!r}]
    await asyncio.sleep(0.5)
    await registry.get("ember/synthetic")
    local_s = time.monotonic() - started
    await asyncio.wait(downloads, return_when=asyncio.FIRST_COMPLETED)
    first_download_s = time.monotonic() - started
    await asyncio.gather(*downloads)
    print(json.dumps({{"local_s": local_s, "first_download_s": first_download_s}}))
    await registry.close()

asyncio.run(main())
"""


def test_downloads_that_requests_start_leave_the_loads_threads_free(
        standin: HubStandIn, tmp_path: Path) -> None:
    """Found by a review: requests naming new Hub ids ran their downloads on the event
    loop's pool, which loads use too: eight slow ones held a model with no files from
    loading for three minutes. They run on threads of their own now."""
    from shutil import copytree

    [tiny] = standin.repos[TINY].commits.values()
    repos = [f"someone/slow-{len(standin.repos)}-{index}" for index in range(3)]
    for repo in repos:
        standin.add(repo, copytree(tiny, tmp_path / repo.replace("/", "--")))
        standin.slow[repo] = 3.0
    try:
        result = run(standin, tmp_path / "hf", REQUESTED_DOWNLOADS.format(repos=repos),
                     extra={"EMBER_ALLOW_HUB_MODELS": "1"})
    finally:
        standin.slow.clear()
    # A share of a download's time, not most of it: here 0.51 s against 7.3 s; on the
    # loop's pool the model with no files waited 4.8 s for a thread.
    assert result["local_s"] < result["first_download_s"] / 3, result  # type: ignore[operator]


def test_a_request_may_not_start_a_download_over_the_limit(
        standin: HubStandIn, tmp_path: Path) -> None:
    """Found by a review: with --allow-hub-models any client could make the server
    download a repository of any size. Past --max-download-gb (here 10 kB), a request's
    download is refused before anything is fetched."""
    before = len(standin.requests)
    answers = run(standin, tmp_path / "hf", FAILING_LOOKUPS.format(repo=TINY),
                  extra={"EMBER_ALLOW_HUB_MODELS": "1", "EMBER_MAX_DOWNLOAD_GB": "0.00001"}
                  )["answers"]
    status, kind, message = answers[0]  # type: ignore[index]
    assert (status, kind) == (502, "model_load_failed"), answers
    assert "over the 10.0 kB a request may start (--max-download-gb)" in message
    assert f"--preload {TINY}" in message
    assert not [p for m, p, _ in standin.requests[before:] if m == "GET" and "/resolve/" in p]
