"""End to end through a real `ember serve` process (uvicorn, uvloop, httptools) on
127.0.0.1, with clients nobody here wrote: the `openai` SDK and huggingface_hub's
InferenceClient."""

from __future__ import annotations

import base64
import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import huggingface_hub.constants
import msgpack
import msgpack_numpy
import numpy as np
import pytest
from huggingface_hub import InferenceClient
from openai import NotFoundError, OpenAI

from ember.adapters.synthetic import SyntheticAdapter
from tests.api.conftest import (
    MINILM,
    SLOW,
    SPACY,
    SYNTH,
    assert_error,
    encode_body,
    vectors,
)
from tests.live_server import REPO, ServerProcess, free_port, server_env, start_server

SYNTH_DIMS = 64  # the catalog's ember/synthetic
SLOW_DIMS = 16


def native(server: ServerProcess, texts: list[str], model: str = MINILM) -> np.ndarray:
    response = httpx.post(f"{server.url}/v1/encode/{model}", json=encode_body(*texts),
                          timeout=60)
    assert response.status_code == 200, response.text
    return np.array(vectors(response.json()), dtype=np.float32)


def metric(server: ServerProcess, pattern: str) -> float:
    """The value of the first /metrics line matching `pattern` (a regex), else 0."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    for line in text.splitlines():
        if re.match(pattern, line):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_ready_health_docs(live_server: ServerProcess) -> None:
    ready = httpx.get(f"{live_server.url}/readyz")
    assert ready.status_code == 200 and ready.json()["default_model"] == MINILM
    assert httpx.get(f"{live_server.url}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{live_server.url}/docs").status_code == 200
    models = {m["id"]: m for m in httpx.get(f"{live_server.url}/v1/models").json()["data"]}
    assert models[MINILM]["state"] == "loaded" and models[SYNTH]["state"] == "loaded"
    assert "Ember listening on http://127.0.0.1:" in live_server.log_tail(100_000)


def test_native_routes(live_server: ServerProcess) -> None:
    url = live_server.url
    vecs = native(live_server, ["a small dog", "a puppy", "quarterly earnings"])
    assert vecs.shape == (3, 384)
    score = httpx.post(f"{url}/v1/score/{MINILM}", json={
        "query": {"text": "young dog"},
        "items": [{"id": "money", "text": "quarterly earnings"}, {"id": "dog",
                                                                 "text": "a puppy"}]})
    assert score.status_code == 200 and score.json()["scores"][0]["item_id"] == "dog"
    extract = httpx.post(f"{url}/v1/extract/{SPACY}", timeout=60, json={
        "items": [{"text": "Angela Merkel met Emmanuel Macron in Berlin."}]})
    assert extract.status_code == 200, extract.text
    texts = {e["text"] for e in extract.json()["items"][0]["entities"]}
    assert {"Angela Merkel", "Berlin"} <= texts


def test_openai_sdk_float_matches_the_native_route(live_server: ServerProcess) -> None:
    client = OpenAI(base_url=f"{live_server.url}/v1", api_key="x", max_retries=0)
    texts = ["OpenAI SDK against Ember", "a second input"]
    result = client.embeddings.create(model=MINILM, input=texts, encoding_format="float")
    got = np.array([d.embedding for d in result.data], dtype=np.float32)
    np.testing.assert_allclose(got, native(live_server, texts), atol=1e-6)
    assert [d.index for d in result.data] == [0, 1]
    assert result.usage.prompt_tokens == result.usage.total_tokens > 0


def test_openai_sdk_base64_matches_the_native_route(live_server: ServerProcess) -> None:
    client = OpenAI(base_url=f"{live_server.url}/v1", api_key="x", max_retries=0)
    texts = ["base64 on the wire"]
    expected = native(live_server, texts)[0]
    decoded = client.embeddings.create(model=MINILM, input=texts)  # SDK asks base64, decodes
    np.testing.assert_allclose(decoded.data[0].embedding, expected, atol=1e-6)
    raw = client.embeddings.create(model=MINILM, input=texts, encoding_format="base64")
    encoded = raw.data[0].embedding
    assert isinstance(encoded, str)
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(encoded), "<f4"), expected,
                               atol=1e-6)
    with pytest.raises(NotFoundError):
        client.embeddings.create(model="not/served", input=["x"])


def test_hf_inference_client_feature_extraction(live_server: ServerProcess,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """InferenceClient posts to the URL it is given as `model` (huggingface_hub's
    hf-inference provider), so a TEI-style server is addressed by its /embed URL."""
    # HF_HUB_OFFLINE blocks every request of huggingface_hub's session, even to
    # 127.0.0.1; lift it for this local call only (a URL model needs no hub lookup).
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    client = InferenceClient(model=f"{live_server.url}/embed", timeout=60)
    texts = ["feature extraction through huggingface_hub", "second"]
    got = client.feature_extraction(texts)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    assert got.shape == (2, 384)
    np.testing.assert_allclose(got, native(live_server, texts), atol=1e-6)
    one = client.feature_extraction("single text")
    assert one.shape == (1, 384)
    np.testing.assert_allclose(one[0], native(live_server, ["single text"])[0], atol=1e-6)
    raw = client.feature_extraction("single text", normalize=False)
    assert abs(float(np.linalg.norm(raw[0])) - 1.0) > 1e-3
    at_base = InferenceClient(model=live_server.url, timeout=60)  # TEI answers POST / too
    np.testing.assert_allclose(at_base.feature_extraction(texts), got, atol=1e-6)


def test_msgpack_over_the_wire(live_server: ServerProcess) -> None:
    body = msgpack.packb(encode_body("packed"), use_bin_type=True)
    response = httpx.post(f"{live_server.url}/v1/encode/{MINILM}", content=body, headers={
        "content-type": "application/msgpack", "accept": "application/msgpack"})
    assert response.status_code == 200
    data = msgpack.unpackb(response.content, object_hook=msgpack_numpy.decode, raw=False)
    values = data["items"][0]["dense"]["values"]
    assert isinstance(values, np.ndarray) and values.dtype == np.float32
    np.testing.assert_allclose(values, native(live_server, ["packed"])[0], atol=1e-6)
    cut = httpx.post(f"{live_server.url}/v1/encode/{MINILM}", content=body[:-3],
                     headers={"content-type": "application/msgpack"})
    assert_error(cut, 422, "invalid_request", "body")


def test_errors_and_headers_over_the_wire(live_server: ServerProcess) -> None:
    url = live_server.url
    missing = httpx.post(f"{url}/v1/encode/no/such", json=encode_body("x"),
                         headers={"x-request-id": "e2e-1"})
    error = assert_error(missing, 404, "model_not_found", "model")
    assert MINILM in error["message"]
    assert missing.headers["x-request-id"] == "e2e-1"
    invalid = httpx.post(f"{url}/v1/encode/{MINILM}", json={"items": [{}]})
    assert_error(invalid, 422, "invalid_request", "items[0].text")
    too_many = httpx.post(f"{url}/v1/encode/{SYNTH}", json=encode_body(*["x"] * 65))
    assert_error(too_many, 413, "payload_too_large", "items")
    fault = httpx.post(f"{url}/v1/encode/{SYNTH}", json=encode_body("__fail__"))
    assert_error(fault, 500, "inference_error")
    ok = httpx.post(f"{url}/v1/encode/{SYNTH}", json=encode_body("after the fault"))
    assert ok.status_code == 200
    for response in (missing, invalid, too_many, fault):  # no result, so no timings
        assert response.headers["x-queue-time-ms"] == "0.00"
        assert response.headers["x-inference-time-ms"] == "0.00"
    # The synthetic model sleeps 2 ms a forward; the queue time is part of the total.
    assert float(ok.headers["x-inference-time-ms"]) >= 1.0
    assert 0 <= float(ok.headers["x-queue-time-ms"]) <= float(ok.headers["x-total-time-ms"])
    assert "Traceback" not in httpx.post(f"{url}/v1/encode/{SYNTH}",
                                         json=encode_body("__fail__")).text


def test_concurrent_requests_each_get_their_own_vectors(live_server: ServerProcess) -> None:
    reference = SyntheticAdapter(dims=SYNTH_DIMS)
    batches = [[f"client {c} item {i}" for i in range(1 + c % 4)] for c in range(16)]
    before = metric(live_server, r'ember_batch_items_count\{model="ember/synthetic"\}')

    def call(texts: list[str]) -> list[list[float]]:
        response = httpx.post(f"{live_server.url}/v1/encode/{SYNTH}",
                              json=encode_body(*texts), timeout=60)
        assert response.status_code == 200, response.text
        return vectors(response.json())

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(call, batches))
    for texts, got in zip(batches, results, strict=True):
        np.testing.assert_allclose(got, [reference.vector(t) for t in texts], atol=1e-6)
    forwards = metric(live_server, r'ember_batch_items_count\{model="ember/synthetic"\}')
    assert 1 <= forwards - before <= len(batches)


@pytest.mark.one_mode  # every mode's uvicorn gets its keep-alive from server.run_http
def test_an_idle_keep_alive_connection_outlives_client_pools(live_server: ServerProcess) -> None:
    """A connection idle for longer than httpx keeps one (5 s) still takes a request: the
    server never closes a connection a client's pool may still hand out."""
    host, port = live_server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        sockets = []
        for pause in (0.0, 6.0):
            time.sleep(pause)
            conn.request("GET", "/healthz")
            response = conn.getresponse()  # a closed connection raises here
            assert response.status == 200 and response.read() == b'{"status":"ok"}'
            sockets.append(conn.sock)
        assert sockets[0] is sockets[1] is not None  # the same connection, kept open
    finally:
        conn.close()


def test_metrics_over_the_wire(live_server: ServerProcess) -> None:
    native(live_server, ["counted"])
    assert metric(live_server, r'ember_requests_total\{model="sentence-transformers/all-MiniLM'
                               r'-L6-v2",route="/v1/encode/\{model:path\}",status="200"\}') >= 1
    assert metric(live_server, r'ember_inference_duration_seconds_count\{model="sentence-') >= 1
    assert metric(live_server, r'ember_model_loads_total\{model="sentence-') == 1


def test_a_client_that_goes_away_has_its_queued_work_dropped(live_server: ServerProcess) -> None:
    """While one slow forward runs and another request waits, a third request's client
    gives up: its item is dropped before it reaches a forward (the watch starts once a
    request has waited WATCH_AFTER_S, 0.1 s; this one would wait ~0.5 s, and its client
    leaves after 0.25 s: long enough for it to reach the engine's queue, with --workers too
    on a busy machine, where a client that left after 0.1 s had nothing queued to drop)."""
    url = live_server.url
    reason = r'ember_rejections_total\{reason="client_disconnected"\}'
    dropped = r'ember_dropped_items_total\{model="test/slow-synthetic"\}'
    rejected_before, dropped_before = metric(live_server, reason), metric(live_server, dropped)
    with ThreadPoolExecutor(2) as pool:
        busy = [pool.submit(httpx.post, f"{url}/v1/encode/{SLOW}",
                            json=encode_body(f"busy {i}"), timeout=60) for i in range(2)]
        time.sleep(0.1)  # the first request runs its 300 ms forward, the second waits
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/encode/{SLOW}", json=encode_body("abandoned"), timeout=0.25)
        assert all(future.result().status_code == 200 for future in busy)
    deadline = time.monotonic() + 10
    # Both counts come a little after the answers: with --workers the drop is the engine's,
    # read by the API process's next status call, which can come before the engine's count.
    while ((metric(live_server, reason), metric(live_server, dropped))
           != (rejected_before + 1, dropped_before + 1) and time.monotonic() < deadline):
        time.sleep(0.05)
    assert metric(live_server, reason) == rejected_before + 1
    assert metric(live_server, dropped) == dropped_before + 1


def test_a_client_that_leaves_mid_upload_is_a_499_not_a_server_fault(
        live_server: ServerProcess) -> None:
    """Found by a black-box review: the body's disconnect was answered as a 500
    `inference_error` (logged at ERROR, counted as a 500), though nothing had run."""
    import socket

    path = f"/v1/encode/{MINILM}"
    route = r'route="/v1/encode/\{model:path\}"'
    # Counted under the model its path names, though it never reached it.
    model = re.escape(MINILM)
    gone = rf'ember_requests_total\{{model="{model}",{route},status="499"\}}'
    fault = rf'ember_requests_total\{{model="{model}",{route},status="500"\}}'
    reason = r'ember_rejections_total\{reason="client_disconnected"\}'
    before = (metric(live_server, gone), metric(live_server, fault),
              metric(live_server, reason))
    with socket.create_connection(("127.0.0.1", live_server.port)) as raw:
        raw.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    "Content-Length: 100\r\nX-Request-Id: left-mid-upload\r\n\r\n"
                    '{"items": ['.encode())
        time.sleep(0.2)
    deadline = time.monotonic() + 10
    while metric(live_server, gone) == before[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    after = (metric(live_server, gone), metric(live_server, fault),
             metric(live_server, reason))
    assert after == (before[0] + 1, before[1], before[2] + 1)
    log = live_server.log_tail(200_000)
    line = next(line for line in log.splitlines() if "left-mid-upload" in line)
    assert " 499 " in line and " INFO " in line
    assert "ClientDisconnect" not in log


def test_a_path_cannot_write_a_line_of_its_own_into_the_log(live_server: ServerProcess) -> None:
    """Found by a black-box review: a percent-encoded newline in the path started a forged
    access line (and a NUL made the log a binary file); an over-long or unprintable
    X-Request-Id was echoed and logged as sent."""
    forged = "2026-12-05 15:00:00,000 INFO MainProcess ember.access: FORGED"
    response = httpx.post(f"{live_server.url}/v1/encode/nothing%0a{forged.replace(' ', '%20')}"
                          "%00end", json=encode_body("x"), headers={"x-request-id": "probe-1"})
    assert response.status_code == 404
    long_id = httpx.get(f"{live_server.url}/healthz", headers={"x-request-id": "r" * 5000})
    assert long_id.headers["x-request-id"] != "r" * 5000
    assert len(long_id.headers["x-request-id"]) == 32  # the server's own
    kept = httpx.get(f"{live_server.url}/healthz", headers={"x-request-id": "client-id-7"})
    assert kept.headers["x-request-id"] == "client-id-7"
    probe = access_line(live_server, "probe-1")  # one line, or this fails
    assert "\\n2026-12-05" in probe and "\\x00end" in probe
    lines = live_server.log_tail(200_000).splitlines()
    assert not any(line.startswith("2026-12-05 15:00:00,000") for line in lines)
    assert "\x00" not in live_server.log_tail(200_000)
    # A later review: spaces in the path or the id wrote fields of the client's making.
    spaced = httpx.get(f"{live_server.url}/healthz%20200%20model=x%20items=5/probe-2",
                       headers={"x-request-id": "r1 client=10.1.2.3:443"})
    assert spaced.status_code == 404 and len(spaced.headers["x-request-id"]) == 32
    line = access_line(live_server, "probe-2")
    assert line.split(" ember.access: ")[1].split()[:3] == [
        "GET", "/healthz%20200%20model=x%20items=5/probe-2", "404"]
    assert line.count("client=") == 1 and "10.1.2.3" not in line


def access_line(server: ServerProcess, request_id: str) -> str:
    deadline = time.monotonic() + 5
    while request_id not in server.log_tail(200_000) and time.monotonic() < deadline:
        time.sleep(0.05)
    [line] = [line for line in server.log_tail(200_000).splitlines() if request_id in line]
    return line


def test_the_access_line_names_the_client_behind_a_trusted_proxy_only(
        live_server: ServerProcess, model_dir: Path, tmp_path: Path) -> None:
    """Found by a code review: the docs said the client behind a proxy was logged, and
    uvicorn was told to believe no proxy."""
    headers = {"x-forwarded-for": "203.0.113.9", "x-request-id": "not-trusted-1"}
    assert httpx.get(f"{live_server.url}/healthz", headers=headers).status_code == 200
    assert "client=127.0.0.1:" in access_line(live_server, "not-trusted-1")
    server = start_slow_server(model_dir, tmp_path / "server.log",
                               "--forwarded-allow-ips", "127.0.0.1")
    try:
        headers = {"x-forwarded-for": "203.0.113.9", "x-request-id": "trusted-1"}
        assert httpx.get(f"{server.url}/healthz", headers=headers).status_code == 200
        # X-Forwarded-For gives no port: the address alone, not `203.0.113.9:0`.
        assert access_line(server, "trusted-1").endswith(" client=203.0.113.9")
    finally:
        server.stop()


# -- shutdown --------------------------------------------------------------------------------


def start_slow_server(model_dir: Path, log: Path, *flags: str) -> ServerProcess:
    return start_server(log, ["--model-dir", str(model_dir), "--default-model", SLOW, *flags],
                        ready_timeout=60)


def send_in_flight(server: ServerProcess, pool: ThreadPoolExecutor,
                   count: int) -> list[Future[httpx.Response]]:
    """`count` requests on the slow model (one item per 300 ms forward), returned once the
    server has taken all of them: one in its forward, the rest queued (on a busy machine
    the last may arrive after the first was answered, so those answered count too)."""
    futures = [pool.submit(httpx.post, f"{server.url}/v1/encode/{SLOW}",
                           json=encode_body(f"in flight {i}"), timeout=60)
               for i in range(count)]
    deadline = time.monotonic() + 30
    while held_items(server) + sum(future.done() for future in futures) < count:
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.02)
    return futures


def held_items(server: ServerProcess) -> float:
    """The slow model's items queued and in its forward, read from one scrape."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    gauges = ("ember_pending_items", "ember_running_items")
    return sum(float(value) for name, value in re.findall(
        r'^(ember_\w+_items)\{model="test/slow-synthetic"\} (\S+)$', text, re.M)
        if name in gauges)


def test_sigterm_drains_in_flight_requests_then_exits_0(model_dir: Path,
                                                        tmp_path: Path) -> None:
    server = start_slow_server(model_dir, tmp_path / "drain.log")
    reference = SyntheticAdapter(dims=SLOW_DIMS)
    count = 5
    try:
        with ThreadPoolExecutor(count) as pool:
            futures = send_in_flight(server, pool, count)
            server.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while (ready := httpx.get(f"{server.url}/readyz")).status_code == 200:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert_error(ready, 503, "unavailable")
            # Late requests, each on a new connection, while the queue still holds two
            # forwards: every one is refused with 503, none is reset (with several API
            # processes, the idle ones finish first and must not drop what they accepted).
            late = 0
            while sum(future.done() for future in futures) < count - 2:
                refused = httpx.post(f"{server.url}/v1/encode/{SLOW}",
                                     json=encode_body(f"late {late}"))
                assert_error(refused, 503, "unavailable")
                assert "retry-after" in refused.headers
                late += 1
            assert late >= 1
            assert httpx.get(f"{server.url}/healthz").status_code == 200
            for i, future in enumerate(futures):
                response = future.result()
                assert response.status_code == 200, response.text
                np.testing.assert_allclose(vectors(response.json())[0],
                                           reference.vector(f"in flight {i}"), atol=1e-6)
        assert server.process.wait(30) == 0, server.log_tail()
        log = server.log_tail(100_000)
        # Each API process says what it holds: every request not answered before its drain
        # began (the first forward may end while the signal travels, on a busy machine;
        # the last /metrics poll may still be leaving, so at least that many).
        held = re.findall(r"(?:SIGTERM|supervisor's order): draining, (\d+) requests? in "
                          r"flight", log)
        before = log[:log.rfind("draining, ")]
        answered_before = before.count(f"POST /v1/encode/{SLOW} 200")
        assert held and sum(map(int, held)) >= count - answered_before, log
        assert "drained in" in log
    finally:
        server.stop()


def test_a_hang_up_drains_as_sigterm_does(model_dir: Path, tmp_path: Path) -> None:
    """Found by a black-box review: SIGHUP (a closed terminal or SSH session) ended the
    server at once, with its requests in flight."""
    server = start_slow_server(model_dir, tmp_path / "hup.log")
    try:
        with ThreadPoolExecutor(3) as pool:
            futures = send_in_flight(server, pool, 3)
            server.process.send_signal(signal.SIGHUP)
            statuses = [future.result().status_code for future in futures]
        assert statuses == [200] * 3
        assert server.process.wait(30) == 0, server.log_tail()
        assert "drained in" in server.log_text()
    finally:
        server.stop()


WIDE = "test/wide-synthetic"


def test_a_client_that_does_not_read_its_answer_cannot_hold_the_exit(tmp_path: Path) -> None:
    """Found by a review: a client that never read a large answer kept the server from
    exiting after its drain (40 s and on, in either mode): uvicorn's shutdown waited for
    the connection without end. It is cut 10 s after the drain's end."""
    (tmp_path / "wide.yaml").write_text(f"""
name: {WIDE}
description: synthetic test model of 4,096 dimensions (large answers; not a real model)
adapter: synthetic
tasks: [encode]
options: {{dims: 4096}}
""", encoding="utf-8")
    server = start_server(tmp_path / "unread.log", ["--model-dir", str(tmp_path),
                                                    "--default-model", WIDE], ready_timeout=60)
    try:
        body = json.dumps(encode_body(*(f"text {i}" for i in range(512)))).encode()
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # it reads no more
        client.connect(("127.0.0.1", server.port))
        client.sendall(f"POST /v1/encode/{WIDE} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                       f"Content-Type: application/json\r\nContent-Length: {len(body)}"
                       "\r\n\r\n".encode() + body)
        assert client.recv(12) == b"HTTP/1.1 200"  # its answer (~25 MB) has begun
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(40) == 0, server.log_tail()
        assert time.monotonic() - signalled < 30  # the bound is 10 s after the drain
        assert "1 client did not read its answer" in server.log_text(), server.log_tail()
        client.close()
    finally:
        server.stop()


LONG_LOAD = "test/long-load"


def test_a_load_no_request_awaits_cannot_hold_the_exit(tmp_path: Path) -> None:
    """Found by a review: a model load whose client had gone held the exit until it ended
    (18 s more in one process); with --workers the engine outlived its drain, was killed
    after 10 s and the server exited 1."""
    (tmp_path / "long.yaml").write_text(f"""
name: {LONG_LOAD}
description: synthetic test model whose weights take 60 s to load (not a real model)
adapter: synthetic
tasks: [encode]
options: {{dims: 8, load_ms: 60000}}
""", encoding="utf-8")
    server = start_server(tmp_path / "long.log", ["--model-dir", str(tmp_path),
                                                  "--default-model", SYNTH], ready_timeout=60)
    try:
        with pytest.raises(httpx.TimeoutException):  # the client leaves during the load
            httpx.post(f"{server.url}/v1/encode/{LONG_LOAD}", json=encode_body("x"),
                       timeout=1.0)
        deadline = time.monotonic() + 10
        while f"loading model {LONG_LOAD}" not in server.log_text():
            assert time.monotonic() < deadline, server.log_tail()
            time.sleep(0.05)
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(40) == 0, server.log_tail()
        assert time.monotonic() - signalled < 9  # well before the load's end, or a 10 s kill
        assert f"exiting without waiting for {LONG_LOAD}" in server.log_text()
    finally:
        server.stop()


@pytest.mark.own_mode  # one process: its port is bound before the app is built
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_as_the_port_opens_drains_and_answers_what_was_sent(
        stop: signal.Signals, tmp_path: Path) -> None:
    """Found by a review: a stop signal in the first second after the port opened (bound
    before the app is built) killed the process (-15, -2 with a traceback, -1), without a
    drain or a line, resetting a connection that had sent its request."""
    port = free_port()
    with (tmp_path / "early.log").open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "ember.cli", "serve", "--host", "127.0.0.1", "--port",
             str(port), "--default-model", SYNTH], stdout=out, stderr=subprocess.STDOUT,
            env=server_env(), cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                client = socket.create_connection(("127.0.0.1", port), timeout=30)
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline and process.poll() is None
                time.sleep(0.005)
        body = json.dumps(encode_body("sent as the port opened")).encode()
        client.sendall(f"POST /v1/encode/{SYNTH} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                       f"Content-Type: application/json\r\nContent-Length: {len(body)}"
                       "\r\n\r\n".encode() + body)
        process.send_signal(stop)
        answer = client.recv(65536)  # not a reset: an answer (503 unless it came first)
        client.close()
        assert answer.startswith((b"HTTP/1.1 503", b"HTTP/1.1 200")), answer[:200]
        assert process.wait(30) == 0
        log = (tmp_path / "early.log").read_text()
        assert f"{stop.name}: draining" in log and "Traceback" not in log, log
    finally:
        if process.poll() is None:
            process.kill()


def test_a_second_signal_exits_at_once(model_dir: Path, tmp_path: Path) -> None:
    server = start_slow_server(model_dir, tmp_path / "twice.log")
    try:
        with ThreadPoolExecutor(5) as pool:
            futures = send_in_flight(server, pool, 5)
            server.process.send_signal(signal.SIGINT)
            deadline = time.monotonic() + 10
            while httpx.get(f"{server.url}/readyz").status_code == 200:  # first one handled
                assert time.monotonic() < deadline
                time.sleep(0.01)
            server.process.send_signal(signal.SIGTERM)
            code = server.process.wait(10)
            unfinished = 0
            for future in futures:
                try:
                    future.result()
                except httpx.HTTPError:
                    unfinished += 1
        assert code != 0
        assert unfinished >= 1  # it did not wait for the queue
        assert "second signal" in server.log_tail()
    finally:
        server.stop()


def test_a_sentence_transformers_folder_with_dense_and_an_excluded_prompt_is_served_as_it_is(
        tmp_path: Path) -> None:
    # Every part crosses the server: the folder's family read from its files, the front
    # half in an API process (with --workers N), the parameters (the prompt's length) over
    # the wire, the Dense layer in the engine's forward. A PyLate ColBERT beside it: its
    # markers and expanded queries (token rows with their attention) over the wire too.
    import torch
    from sentence_transformers import MultiVectorEncoder, SentenceTransformer

    from tests.adapters.tiny_models import (
        build_bi_encoder,
        build_pylate_colbert,
        build_st_pipeline,
    )

    folder = build_st_pipeline(
        tmp_path / "dense-model", build_bi_encoder(tmp_path / "base", normalize=False),
        dense=[(12, torch.nn.Tanh(), True)], include_prompt=False,
        prompts={"query": "what is the ", "document": ""})
    colbert = build_pylate_colbert(tmp_path / "colbert")
    server = start_server(tmp_path / "server.log", ["--model", f"{folder}:{colbert}"])
    texts = ["the cat is big", "paris is the capital of france"]
    query = "what is the capital of france?"
    try:
        response = httpx.post(f"{server.url}/v1/encode/local/dense-model", timeout=60,
                              json={"items": [{"text": t} for t in texts],
                                    "params": {"options": {"is_query": True}}})
        assert response.status_code == 200, response.text
        got = np.array(vectors(response.json()), dtype=np.float32)
        scored = httpx.post(f"{server.url}/v1/score/local/colbert", timeout=60,
                            json={"query": {"text": query},
                                  "items": [{"id": str(i), "text": t}
                                            for i, t in enumerate(texts)]})
        assert scored.status_code == 200, scored.text
        scores = {s["item_id"]: s["score"] for s in scored.json()["scores"]}
    finally:
        server.stop()
    expected = SentenceTransformer(str(folder), device="cpu").encode(texts, prompt_name="query")
    assert got.shape == (2, 12)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    reference = MultiVectorEncoder(str(colbert), device="cpu")
    want = reference.similarity(reference.encode_query([query]),
                                reference.encode_document(texts))[0].numpy()
    np.testing.assert_allclose([scores["0"], scores["1"]], want, rtol=1e-4)
