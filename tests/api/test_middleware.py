"""Cross-cutting HTTP behaviour: request ids and timing headers, the API key, the body
limit, and msgpack in both directions."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import httpx2  # the openai SDK's HTTP client
import msgpack
import msgpack_numpy
import numpy as np
import openai
import pytest
import pytest_asyncio

from ember.config import ServerSettings
from ember.engine import WorkerConfig
from tests.api.conftest import (
    BUSY,
    MINILM,
    SYNTH,
    AppFactory,
    Served,
    assert_error,
    encode_body,
    vectors,
    wait_for,
)

TIMING = ("x-queue-time-ms", "x-inference-time-ms")
MSGPACK = {"accept": "application/msgpack"}


def assert_context_headers(response: httpx.Response, request_id: str | None = None,
                           *, forward: bool) -> None:
    """The request id, and timings that say what happened: a request answered by a forward
    reports that forward's time (the synthetic model sleeps 2 ms in each) within its total;
    any other response reports no queue or inference time."""
    assert "x-request-id" in response.headers, response.headers
    if request_id is not None:
        assert response.headers["x-request-id"] == request_id
    queue_ms, inference_ms = (float(response.headers[name]) for name in TIMING)
    total_ms = float(response.headers["x-total-time-ms"])
    if forward:
        assert inference_ms >= 1.0, response.headers
        assert 0.0 <= queue_ms <= total_ms, response.headers
        assert queue_ms + inference_ms <= total_ms + 0.02, response.headers  # 2-digit rounding
    else:
        assert (queue_ms, inference_ms) == (0.0, 0.0), response.headers
        assert total_ms > 0.0, response.headers


def unpack(response: httpx.Response) -> Any:
    assert response.headers["content-type"] == "application/msgpack"
    return msgpack.unpackb(response.content, object_hook=msgpack_numpy.decode, raw=False)


# -- X-Request-Id and timing headers -------------------------------------------------------------


REQUESTS: list[tuple[str, str, Any, int]] = [
    ("POST", f"/v1/encode/{SYNTH}", encode_body("x"), 200),
    ("POST", "/v1/embeddings", {"input": "x"}, 200),
    ("POST", "/v1/rerank", {"query": "q", "documents": ["a"]}, 200),
    ("POST", "/embed", {"inputs": "x"}, 200),
    ("POST", "/rerank", {"query": "q", "texts": ["a"]}, 200),
    ("GET", "/healthz", None, 200),
    ("GET", "/readyz", None, 200),
    ("GET", "/v1/models", None, 200),
    ("GET", "/metrics", None, 200),
    ("POST", f"/v1/encode/{SYNTH}", {"items": []}, 422),
    ("POST", "/v1/encode/no/model", encode_body("x"), 404),
    ("POST", f"/v1/encode/{SYNTH}", encode_body("__fail__"), 500),
    ("GET", "/nowhere", None, 404),
]


@pytest.mark.parametrize(("method", "path", "body", "status"), REQUESTS)
async def test_every_response_carries_the_request_id_and_timings(
        shared: Served, method: str, path: str, body: Any, status: int) -> None:
    response = await shared.client.request(method, path, json=body,
                                           headers={"x-request-id": "client-id-42"})
    assert response.status_code == status, response.text
    answered_by_forward = method == "POST" and status == 200
    assert_context_headers(response, "client-id-42", forward=answered_by_forward)


async def test_a_log_line_of_a_request_names_it(shared: Served) -> None:
    from ember.logs import request_id_now

    seen: list[str | None] = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("inference failed"):
                seen.append(request_id_now())

    recorder = Recorder()
    logging.getLogger("ember").addHandler(recorder)
    try:
        response = await shared.client.post(f"/v1/encode/{SYNTH}",
                                             json=encode_body("__fail__ here"),
                                             headers={"x-request-id": "the-failing-one"})
    finally:
        logging.getLogger("ember").removeHandler(recorder)
    assert response.status_code == 500
    assert seen == ["the-failing-one"]


async def test_a_request_id_is_made_when_the_client_sends_none(shared: Served) -> None:
    first = await shared.client.get("/healthz")
    second = await shared.client.get("/healthz")
    ids = [r.headers["x-request-id"] for r in (first, second)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert ids[0] != ids[1]


async def test_timing_headers_report_the_forward(apps: AppFactory) -> None:
    async with apps.serve(default_model=BUSY) as served:  # 50 ms per forward
        response = await served.client.post(f"/v1/encode/{BUSY}", json=encode_body("x"))
        assert response.status_code == 200
        assert float(response.headers["x-inference-time-ms"]) >= 40.0
        assert_context_headers(response, forward=True)
        health = await served.client.get("/healthz")
        assert float(health.headers["x-inference-time-ms"]) == 0.0


async def test_a_request_cancelled_before_its_answer_is_a_499_not_a_500(
        apps: AppFactory) -> None:
    """Found by a black-box review: Ray Serve cancels the request of a client that left,
    and the cancelled request was counted (and logged) as a server fault."""
    async with apps.serve() as served:
        worker = served.worker()
        worker.pause()
        left = asyncio.create_task(served.client.post(f"/v1/encode/{SYNTH}",
                                                      json=encode_body("left")))
        await wait_for(lambda: worker.pending_items == 1)
        left.cancel()  # the ASGI app runs in this task: the cancel reaches it as Ray's does
        with pytest.raises(asyncio.CancelledError):
            await left
        worker.resume()
        text = await served.metrics()
        route = 'route="/v1/encode/{model:path}"'
        assert f'ember_requests_total{{model="{SYNTH}",{route},status="499"}} 1.0' in text
        assert 'status="500"' not in text
        assert 'ember_rejections_total{reason="client_disconnected"} 1.0' in text


async def test_a_refused_body_is_counted_under_the_model_its_path_names(
        apps: AppFactory) -> None:
    """Found by a black-box review: a 422 on /v1/encode/<model> was counted under
    model="" (and a model not in the catalog is "unknown", not a new label)."""
    async with apps.serve() as served:
        for model in (SYNTH, "no/such-model"):
            response = await served.client.post(f"/v1/encode/{model}", json={"items": 3})
            assert response.status_code == 422, response.text
        text = await served.metrics()
        route = 'route="/v1/encode/{model:path}"'
        assert f'ember_requests_total{{model="{SYNTH}",{route},status="422"}} 1.0' in text
        assert f'ember_requests_total{{model="unknown",{route},status="422"}} 1.0' in text
        assert 'model=""' not in text


async def test_fastapis_own_pages_are_counted_under_their_path(apps: AppFactory) -> None:
    """Found by a black-box review: /docs was counted as "unrouted", the label of refusals
    and unknown paths."""
    async with apps.serve() as served:
        for path in ("/docs", "/openapi.json", "/no/such/page"):
            await served.client.get(path)
        text = await served.metrics()
        for route, status in (("/docs", 200), ("/openapi.json", 200), ("unrouted", 404)):
            assert f'route="{route}",status="{status}"}} 1.0' in text, (route, text)


async def test_refusals_carry_the_headers_too(apps: AppFactory) -> None:
    async with apps.serve(api_key="k", max_body_bytes=200,
                          worker=WorkerConfig(max_queue_items=1)) as served:
        auth = {"authorization": "Bearer k", "x-request-id": "r1"}
        unauthorized = await served.client.post(f"/v1/encode/{SYNTH}", json=encode_body("x"),
                                                headers={"x-request-id": "r0"})
        assert_error(unauthorized, 401)
        assert_context_headers(unauthorized, "r0", forward=False)
        too_big = await served.client.post(f"/v1/encode/{SYNTH}",
                                           json=encode_body("x" * 500), headers=auth)
        assert_error(too_big, 413)
        assert_context_headers(too_big, "r1", forward=False)
        worker = served.worker()
        worker.pause()
        held = asyncio.create_task(served.client.post(
            f"/v1/encode/{SYNTH}", json=encode_body("held"), headers=auth))
        await wait_for(lambda: worker.pending_items == 1)
        full = await served.client.post(f"/v1/encode/{SYNTH}", json=encode_body("y"),
                                        headers={**auth, "x-request-id": "r2"})
        assert_error(full, 429)
        assert_context_headers(full, "r2", forward=False)
        served.state.draining = True
        draining = await served.client.post(f"/v1/encode/{SYNTH}", json=encode_body("y"),
                                            headers={**auth, "x-request-id": "r3"})
        assert_error(draining, 503)
        assert_context_headers(draining, "r3", forward=False)
        # Every answer during a drain closes its connection: no request is sent on a
        # keep-alive connection just as the server closes it.
        assert draining.headers["connection"] == "close"
        worker.resume()
        answered = await held  # accepted before the drain: served, and closed as well
        assert answered.status_code == 200
        assert answered.headers["connection"] == "close"


# -- API key ----------------------------------------------------------------------------------


@pytest_asyncio.fixture(loop_scope="session")
async def keyed(apps: AppFactory) -> AsyncIterator[Served]:
    async with apps.serve(api_key="s3cret-key") as served:
        yield served


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Bearer s3cret-ke",
                                    "Basic s3cret-key", "s3cret-key", "Bearer "])
async def test_missing_or_wrong_key_is_401(keyed: Served, header: str | None) -> None:
    headers = {"authorization": header} if header is not None else {}
    response = await keyed.client.post(f"/v1/encode/{SYNTH}", json=encode_body("x"),
                                       headers=headers)
    error = assert_error(response, 401, "unauthorized")
    assert "Bearer" in error["message"]
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("path", ["/v1/models", "/metrics", "/docs", "/openapi.json"])
async def test_every_other_route_needs_the_key(keyed: Served, path: str) -> None:
    assert_error(await keyed.client.get(path), 401, "unauthorized")
    ok = await keyed.client.get(path, headers={"authorization": "Bearer s3cret-key"})
    assert ok.status_code == 200


async def test_health_routes_stay_open(keyed: Served) -> None:
    assert (await keyed.client.get("/healthz")).status_code == 200
    assert (await keyed.client.get("/readyz")).status_code == 200


@pytest.mark.parametrize("header", ["Bearer s3cret-key", "bearer s3cret-key"])
async def test_the_right_key_is_served(keyed: Served, header: str) -> None:
    response = await keyed.client.post(f"/v1/encode/{SYNTH}", json=encode_body("x"),
                                       headers={"authorization": header})
    assert response.status_code == 200, response.text


async def test_the_openai_sdk_sends_the_key(keyed: Served) -> None:
    def sdk(key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url="http://localhost/v1", api_key=key, max_retries=0,
            http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=keyed.app)))

    good, bad = sdk("s3cret-key"), sdk("nope")
    try:
        result = await good.embeddings.create(model=SYNTH, input=["x"])
        assert len(result.data[0].embedding) == 64
        with pytest.raises(openai.AuthenticationError):
            await bad.embeddings.create(model=SYNTH, input=["x"])
    finally:
        await good.close()
        await bad.close()
    text = (await keyed.client.get("/metrics",
                                   headers={"authorization": "Bearer s3cret-key"})).text
    assert re.search(r'ember_rejections_total\{reason="unauthorized"\} [1-9]', text)


# -- body limit by declared length -------------------------------------------------------------


async def test_declared_length_over_the_limit_is_refused_before_reading(
        apps: AppFactory) -> None:
    async with apps.serve(max_body_bytes=64) as served:
        response = await served.client.post(f"/v1/encode/{SYNTH}",
                                            content=b"{" + b" " * 100 + b"}",
                                            headers={"content-type": "application/json"})
        error = assert_error(response, 413, "payload_too_large", "body")
        assert "64 bytes (--max-body-bytes)" in error["message"]
        assert served.worker().stats.batches == 0


@pytest.mark.parametrize(("value", "length"), [
    ("10", 10), ("0", 0), ("", None), ("abc", None), ("-1", None), (" 5", None),
    ("\u0661\u0662", None),  # Arabic-Indic digits: str.isdigit, not a length
    ("9" * 5000, 2**63),  # past any limit, where int() would raise
    ("0" * 18 + "2", 2),  # leading zeros, which HTTP's parser takes
])
def test_a_declared_length_is_read_only_from_ascii_digits(value: str,
                                                          length: int | None) -> None:
    from ember.api.middleware import declared_length

    sent = {b"content-length": value} if value else {}
    assert declared_length(sent) == length


@pytest.mark.parametrize("headers", [
    [(b"content-length", b"abc")],  # not a length the server framed the body by
    [(b"transfer-encoding", b"chunked")],
    [],
])
async def test_a_body_no_valid_length_frames_is_counted_as_it_comes(
        headers: list[tuple[bytes, bytes]]) -> None:
    from types import SimpleNamespace

    from ember.api.errors import BodyTooLarge
    from ember.api.middleware import GateMiddleware

    server = SimpleNamespace(settings=SimpleNamespace(max_body_bytes=10),
                             metrics=SimpleNamespace(rejected=lambda reason: None))
    parts = [{"type": "http.request", "body": b"x" * 8, "more_body": True}] * 2

    async def receive() -> dict[str, object]:
        return parts.pop(0)

    async def reader(scope: object, receive: Any, send: object) -> None:
        while (await receive())["more_body"]:
            pass

    gate = GateMiddleware(reader, lambda: server, [], limit_body=True)  # type: ignore[arg-type]
    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers}
    with pytest.raises(BodyTooLarge):
        await gate(scope, receive, None)  # type: ignore[arg-type]


# -- msgpack ---------------------------------------------------------------------------------


async def test_msgpack_encode_response_holds_float32_arrays(shared: Served) -> None:
    texts = ["msgpack one", "msgpack two"]
    as_json = await shared.client.post(f"/v1/encode/{MINILM}", json=encode_body(*texts))
    packed = await shared.client.post(f"/v1/encode/{MINILM}", json=encode_body(*texts),
                                      headers=MSGPACK)
    assert as_json.status_code == packed.status_code == 200
    assert_context_headers(packed, forward=True)
    data = unpack(packed)
    assert data["model"] == MINILM
    for item, expected in zip(data["items"], vectors(as_json.json()), strict=True):
        values = item["dense"]["values"]
        assert isinstance(values, np.ndarray)
        assert values.dtype == np.float32 and values.shape == (384,)
        assert item["dense"]["dims"] == 384 and item["dense"]["dtype"] == "float32"
        np.testing.assert_array_equal(values, np.array(expected, dtype=np.float32))


async def test_msgpack_arrays_are_in_msgpack_numpys_layout(shared: Served) -> None:
    packed = await shared.client.post(f"/v1/encode/{SYNTH}", json=encode_body("x"),
                                      headers=MSGPACK)
    raw = msgpack.unpackb(packed.content, raw=False)  # without the numpy hook
    values = raw["items"][0]["dense"]["values"]
    assert values[b"nd"] is True and values[b"type"] == "<f4"
    assert tuple(values[b"shape"]) == (64,)
    np.testing.assert_array_equal(np.frombuffer(values[b"data"], "<f4"),
                                  shared.synthetic().vector("x"))


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/embeddings", {"input": ["a", "b"]}),
    ("/embed", {"inputs": ["a", "b"]}),
])
async def test_msgpack_on_the_compatible_routes(shared: Served, path: str,
                                                body: dict[str, Any]) -> None:
    as_json = (await shared.client.post(path, json=body)).json()
    data = unpack(await shared.client.post(path, json=body,
                                           headers={"accept": "application/x-msgpack"}))
    if path == "/embed":
        got, want = data, as_json
    else:
        got = [d["embedding"] for d in data["data"]]
        want = [d["embedding"] for d in as_json["data"]]
        assert data["usage"] == as_json["usage"]
    for array, expected in zip(got, want, strict=True):
        assert isinstance(array, np.ndarray) and array.dtype == np.float32
        np.testing.assert_array_equal(array, np.array(expected, dtype=np.float32))


async def test_msgpack_score_response(shared: Served) -> None:
    body = {"query": {"text": "q"}, "items": [{"id": "a", "text": "x"}, {"text": "y z"}]}
    as_json = (await shared.client.post(f"/v1/score/{SYNTH}", json=body)).json()
    data = unpack(await shared.client.post(f"/v1/score/{SYNTH}", json=body, headers=MSGPACK))
    assert data == as_json


@pytest.mark.parametrize("content_type", ["application/msgpack", "application/x-msgpack",
                                          "application/msgpack; charset=binary"])
async def test_msgpack_request_body(shared: Served, content_type: str) -> None:
    body = msgpack.packb(encode_body("from msgpack", "two"), use_bin_type=True)
    response = await shared.client.post(f"/v1/encode/{SYNTH}", content=body,
                                        headers={"content-type": content_type})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    adapter = shared.synthetic()
    np.testing.assert_allclose(vectors(response.json()),
                               [adapter.vector("from msgpack"), adapter.vector("two")],
                               atol=1e-6)


async def test_msgpack_in_and_out(shared: Served) -> None:
    body = msgpack.packb({"input": ["both ways"], "model": SYNTH}, use_bin_type=True)
    response = await shared.client.post("/v1/embeddings", content=body, headers={
        "content-type": "application/msgpack", **MSGPACK})
    assert response.status_code == 200, response.text
    np.testing.assert_array_equal(unpack(response)["data"][0]["embedding"],
                                  shared.synthetic().vector("both ways"))


async def test_truncated_msgpack_is_422(shared: Served) -> None:
    whole = msgpack.packb(encode_body("some text to cut"), use_bin_type=True)
    response = await shared.client.post(f"/v1/encode/{SYNTH}", content=whole[:-5],
                                        headers={"content-type": "application/msgpack",
                                                 "x-request-id": "cut"})
    error = assert_error(response, 422, "invalid_request", "body")
    assert "msgpack" in error["message"]
    assert_context_headers(response, "cut", forward=False)


async def test_msgpack_body_that_is_not_the_right_shape_names_the_field(
        shared: Served) -> None:
    body = msgpack.packb({"items": [{"text": 7}]}, use_bin_type=True)
    response = await shared.client.post(f"/v1/encode/{SYNTH}", content=body,
                                        headers={"content-type": "application/msgpack"})
    assert_error(response, 422, "invalid_request", "items[0].text")


async def test_chunked_msgpack_body_over_the_limit_is_413(apps: AppFactory) -> None:
    async with apps.serve(max_body_bytes=500) as served:
        whole = msgpack.packb(encode_body("z" * 2000), use_bin_type=True)

        async def chunks() -> AsyncIterator[bytes]:
            for start in range(0, len(whole), 100):
                yield whole[start:start + 100]

        response = await served.client.post(f"/v1/encode/{SYNTH}", content=chunks(),
                                            headers={"content-type": "application/msgpack",
                                                     "x-request-id": "big"})
        assert_error(response, 413, "payload_too_large", "body")
        assert_context_headers(response, "big", forward=False)


# -- CORS -------------------------------------------------------------------------------------

PAGE = "https://search.example.com"


async def test_a_page_of_an_allowed_origin_calls_with_its_key(apps: AppFactory,
                                                              caplog: pytest.LogCaptureFixture
                                                              ) -> None:
    async with apps.serve(api_key="k", cors_origins=(PAGE,)) as served:
        # The browser's preflight carries no key: it is answered before the key is asked.
        with caplog.at_level(logging.INFO, logger="ember.access"):
            # Found by a code review: the JS SDKs send headers of their own (OpenAI's
            # x-stainless-*, Cohere's x-fern-*), and a fixed list refused their preflights.
            preflight = await served.client.options(f"/v1/encode/{SYNTH}", headers={
                "origin": PAGE, "access-control-request-method": "POST",
                "access-control-request-headers": "authorization, content-type, "
                                                  "x-stainless-os, x-fern-sdk-name"})
        assert preflight.status_code == 200, preflight.text
        assert preflight.headers["access-control-allow-origin"] == PAGE
        allowed = preflight.headers["access-control-allow-headers"].lower()
        assert "authorization" in allowed and "x-stainless-os" in allowed
        assert [r.__dict__["fields"]["method"] for r in caplog.records] == ["OPTIONS"]
        answer = await served.client.post(f"/v1/encode/{SYNTH}", json=encode_body("x"),
                                          headers={"origin": PAGE, "authorization": "Bearer k"})
        assert answer.status_code == 200, answer.text
        assert answer.headers["access-control-allow-origin"] == PAGE
        exposed = answer.headers["access-control-expose-headers"].lower()
        assert "x-request-id" in exposed and "x-inference-time-ms" in exposed
        # A refusal is readable by the page too, so it can show why.
        refused = await served.client.post(f"/v1/encode/{SYNTH}", json=encode_body("x"),
                                           headers={"origin": PAGE})
        assert_error(refused, 401)
        assert refused.headers["access-control-allow-origin"] == PAGE


async def test_other_origins_get_no_cors_grant(apps: AppFactory) -> None:
    async with apps.serve(cors_origins=(PAGE,)) as served:
        preflight = await served.client.options(f"/v1/encode/{SYNTH}", headers={
            "origin": "https://evil.example", "access-control-request-method": "POST"})
        assert preflight.status_code == 400
        assert "access-control-allow-origin" not in preflight.headers
        answer = await served.client.post(f"/v1/encode/{SYNTH}", json=encode_body("x"),
                                          headers={"origin": "https://evil.example"})
        assert "access-control-allow-origin" not in answer.headers
    async with apps.serve() as served:  # without the flag, no page is granted anything
        answer = await served.client.post(f"/v1/encode/{SYNTH}", json=encode_body("x"),
                                          headers={"origin": PAGE})
        assert answer.status_code == 200
        assert "access-control-allow-origin" not in answer.headers


@pytest.mark.parametrize(("changes", "host", "answered"), [
    ({}, "evil.example", False),  # a page whose DNS name now points at 127.0.0.1
    ({}, "evil.example:8080", False),
    ({}, "localhost:8080", True),
    ({}, "127.0.0.1", True),
    ({}, "[::1]:8080", True),
    ({}, "LOCALHOST", True),
    ({"host": "0.0.0.0"}, "evil.example", True),  # reached by any name: the operator's call
    ({"host": "127.0.0.2"}, "127.0.0.2:80", True),
    ({}, "localhost.", True),
    ({"allowed_hosts": ("api.example.com",)}, "api.example.com", True),
    ({"allowed_hosts": ("api.example.com",)}, "API.example.com.:443", True),
    ({"allowed_hosts": ("ember_api",)}, "ember_api:8080", True),  # a Compose service
    ({"allowed_hosts": ("api.example.com",)}, "localhost", True),  # a local health check
    ({"allowed_hosts": ("api.example.com",)}, "evil.example", False),
    ({"host": "0.0.0.0", "allowed_hosts": ("api.example.com",)}, "evil.example", False),
    ({"allowed_hosts": ("*",)}, "evil.example", True),
])
async def test_a_loopback_server_answers_only_to_loopback_names_unless_told(
        apps: AppFactory, changes: dict[str, Any], host: str, answered: bool) -> None:
    """Found by an operator's review: the Host header was not looked at, so a web page that
    rebinds its own DNS name to 127.0.0.1 could drive a server on the user's machine
    (same-origin to the browser, no preflight, no key by default). The health routes too:
    a page must not learn what runs there."""
    async with apps.serve(**changes) as served:
        for path in ("/v1/models", "/healthz"):
            response = await served.client.get(path, headers={"host": host})
            if answered:
                assert response.status_code == 200, (path, response.text)
            else:
                error = assert_error(response, 400, "invalid_request", "Host")
                # Which names it answers to is not told to a page that rebinds its name.
                assert "--allowed-host" in error["message"] and "localhost" not in error[
                    "message"] and "api.example" not in error["message"]


@pytest.mark.parametrize("name", ["http://api.example.com", "api.example.com:8080", "a b",
                                  "api.example.com/x", ""])
def test_an_allowed_host_that_is_not_a_host_name_is_refused_at_start(name: str) -> None:
    with pytest.raises(ValueError, match="--allowed-host"):
        ServerSettings(allowed_hosts=(name,))
