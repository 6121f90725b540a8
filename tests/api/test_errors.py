"""Every refusal of the HTTP contract (docs/architecture.md): its status and its body
`{"error": {"type", "message", "param"?}}`."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from ember.api.errors import scrub
from ember.engine import WorkerConfig
from tests.api.conftest import (
    BUSY,
    MINILM,
    SPACY,
    SYNTH,
    AppFactory,
    Served,
    assert_error,
    encode_body,
    fill_queue,
    gated_loader,
    vectors,
    wait_for,
)

# -- 422: invalid input, naming the field ------------------------------------------------------


@pytest.mark.parametrize(("body", "param"), [
    ({"items": [{"id": "a"}]}, "items[0].text"),
    ({"items": [{"text": "ok"}, {"text": 5}]}, "items[1].text"),
    ({"items": "not a list"}, "items"),
    ({}, "items"),
    ({"items": []}, "items"),
    ({"items": [{"text": "a"}], "params": {"is_query": "maybe"}}, "params.is_query"),
    ({"items": [{"text": "a"}], "params": {"options": {"truncate": []}}},
     "params.options.truncate"),
])
async def test_invalid_encode_bodies(shared: Served, body: dict[str, Any], param: str) -> None:
    response = await shared.client.post(f"/v1/encode/{SYNTH}", json=body)
    error = assert_error(response, 422, "invalid_request", param)
    assert param.split("[")[0].split(".")[0] in error["message"]


@pytest.mark.parametrize(("route", "body", "param"), [
    (f"/v1/encode/{SYNTH}", {"items": [{"text": "a"}], "params": {"is_query": "yes"}},
     "params.is_query"),
    (f"/v1/encode/{SYNTH}", {"items": [{"text": "a"}], "params": {"options": {"truncate": 0}}},
     "params.options.truncate"),
    ("/v1/embeddings", {"input": "a", "truncate": "false"}, "truncate"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "return_documents": 1},
     "return_documents"),
    ("/embed", {"inputs": "a", "normalize": "no"}, "normalize"),
])
async def test_a_boolean_field_takes_only_true_or_false(shared: Served, route: str,
                                                        body: dict[str, Any], param: str) -> None:
    """Found by a black-box review: "false", "no", 0 and 1 were read as booleans, where the
    README promises strict bodies (and integers were strict already)."""
    response = await shared.client.post(route, json=body)
    assert_error(response, 422, "invalid_request", param)


async def test_body_that_is_not_json_is_422(shared: Served) -> None:
    response = await shared.client.post(f"/v1/encode/{SYNTH}", content=b'{"items": [',
                                        headers={"content-type": "application/json"})
    assert_error(response, 422, "invalid_request")


async def test_text_over_the_token_limit_with_truncate_false(shared: Served) -> None:
    body = encode_body("fine", "word " * 600, options={"truncate": False})
    response = await shared.client.post(f"/v1/encode/{MINILM}", json=body)
    error = assert_error(response, 400, "input_too_long", "items[1].text")
    assert "256" in error["message"]
    # Found by a black-box review: the advice named TEI's field, not the native option.
    assert "params.options.truncate" in error["message"]


async def test_cohere_truncate_none_over_the_limit_names_cohere_s_own_setting(
        shared: Served) -> None:
    """Found by a black-box review: the advice named the native field (truncate=true)."""
    response = await shared.client.post("/v2/embed", json={
        "model": MINILM, "texts": ["fine", "word " * 600], "input_type": "search_document",
        "truncate": "NONE"})
    error = assert_error(response, 400, "input_too_long", "texts[1]")
    assert "set truncate to END" in error["message"] and "=true" not in error["message"]


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/embeddings", {"model": MINILM, "input": ["fine", "word " * 600], "truncate": False},
     "input[1]"),
    ("/embed", {"inputs": ["fine", "word " * 600], "truncate": False}, "inputs[1]"),
    ("/similarity", {"inputs": {"source_sentence": "fine", "sentences": ["word " * 600]},
                     "truncate": False}, "inputs.sentences[0]"),
])
async def test_compatible_routes_over_the_limit_name_their_own_truncate_field(
        apps: AppFactory, route: str, body: dict[str, object], param: str) -> None:
    """Found by a fresh-clone walkthrough: /v1/embeddings advised the native option."""
    async with apps.serve(default_model=MINILM) as served:  # TEI's routes take the default
        response = await served.client.post(route, json=body)
    error = assert_error(response, 400, "input_too_long", param)
    assert "set truncate to true" in error["message"], error
    assert "params.options" not in error["message"], error


async def test_score_query_over_the_limit_with_truncate_false(shared: Served) -> None:
    body = {"query": {"text": "long " * 600}, "items": [{"text": "a"}],
            "params": {"options": {"truncate": False}}}
    response = await shared.client.post(f"/v1/score/{MINILM}", json=body)
    assert_error(response, 400, "input_too_long", "query.text")


async def test_text_over_the_character_limit(apps: AppFactory) -> None:
    async with apps.serve(max_text_chars=100) as served:
        response = await served.client.post(f"/v1/encode/{SYNTH}",
                                            json=encode_body("short", "x" * 101))
        error = assert_error(response, 422, "invalid_request", "items[1].text")
        assert "limit of 100 (--max-text-chars)" in error["message"]


@pytest.mark.parametrize("model", [SYNTH, MINILM])
async def test_unknown_lora(shared: Served, model: str) -> None:
    body = encode_body("x", options={"lora": "legal"})
    response = await shared.client.post(f"/v1/encode/{model}", json=body)
    error = assert_error(response, 422, "invalid_request", "params.options.lora")
    assert "legal" in error["message"]


async def test_an_unknown_lora_loads_nothing(apps: AppFactory) -> None:
    """Found by a black-box review: the model was loaded (evicting another one, in use)
    before the name was refused. The model's entry lists its LoRAs: the name is checked
    there first, on the score route too."""
    async with apps.serve() as served:
        for path, body in ((f"/v1/encode/{BUSY}", encode_body("x", options={"lora": "zz"})),
                           (f"/v1/score/{BUSY}", {"query": {"text": "q"},
                                                  "items": [{"text": "x"}],
                                                  "options": {"lora": "zz"}})):
            response = await served.client.post(path, json=body)
            error = assert_error(response, 422, "invalid_request")
            assert error["message"] == ("unknown LoRA 'zz'; known LoRAs: none (this model "
                                        "has no LoRA adapters)"), error
        assert served.registry.state(BUSY) == "available"  # not loaded


@pytest.mark.parametrize(("body", "param"), [
    ({"options": {"lora": "legal"}}, "options.lora"),  # where sie-sdk puts a score's options
    ({"params": {"options": {"lora": "legal"}}}, "params.options.lora"),
])
async def test_a_scores_unknown_lora_is_named_where_it_was_sent(
        shared: Served, body: dict[str, Any], param: str) -> None:
    sent = {"query": {"text": "q"}, "items": [{"text": "x"}], **body}
    response = await shared.client.post(f"/v1/score/{MINILM}", json=sent)
    assert "legal" in assert_error(response, 422, "invalid_request", param)["message"]


@pytest.mark.parametrize(("message", "scrubbed"), [
    # Found by a black-box review: a space in a folder's name left the rest of its path.
    ("model directory '/srv/my models/secret-emb' does not exist",
     "model directory <path> does not exist"),
    ('no weights in "/srv/a b/c d"; fetch it', "no weights in <path>; fetch it"),
    ("no file named model.safetensors found in directory /srv/models/emb; fetch it",
     "no file named model.safetensors found in directory <path>; fetch it"),
])
def test_a_file_path_never_reaches_a_client(message: str, scrubbed: str) -> None:
    assert scrub(message) == scrubbed


# -- 404 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("route", "body"), [
    ("/v1/encode/{}", encode_body("x")),
    ("/v1/score/{}", {"query": {"text": "q"}, "items": [{"text": "x"}]}),
    ("/v1/extract/{}", {"items": [{"text": "x"}]}),
])
async def test_unknown_model_lists_the_available_ones(shared: Served, route: str,
                                                      body: dict[str, Any]) -> None:
    response = await shared.client.post(route.format("acme/missing-model"), json=body)
    error = assert_error(response, 404, "model_not_found", "model")
    assert "acme/missing-model" in error["message"]
    for name in (SYNTH, MINILM, SPACY):
        assert name in error["message"]


@pytest.mark.parametrize(("path", "example"), [
    ("/v1/encode", f"/v1/encode/{SYNTH}"),  # the default model, which encodes
    ("/v1/encode/", f"/v1/encode/{SYNTH}"),
    ("/v1/score", "/v1/score/"),
    ("/v1/extract/", f"/v1/extract/{SPACY}"),  # the default does not extract: one that does
])
async def test_a_native_path_without_its_model_says_how_to_name_one(
        shared: Served, path: str, example: str) -> None:
    response = await shared.client.post(path, json={"items": [{"text": "x"}]})
    assert not response.is_redirect
    error = assert_error(response, 404, "model_not_found", "model")
    task = path.strip("/").split("/")[1]
    assert f"POST /v1/{task}/{{model}}" in error["message"]
    assert example in error["message"]


async def test_unknown_route_and_wrong_method(shared: Served) -> None:
    assert_error(await shared.client.get("/v2/nothing"), 404, "not_found")
    wrong = await shared.client.get(f"/v1/encode/{SYNTH}")
    error = assert_error(wrong, 405, "method_not_allowed")
    # Found by a fresh-clone walkthrough: a bare "Method Not Allowed".
    assert error["message"] == f"Method Not Allowed: /v1/encode/{SYNTH} takes POST, not GET"
    assert wrong.headers["allow"] == "POST"


# -- 413 ----------------------------------------------------------------------------------------


async def test_body_over_the_byte_limit(apps: AppFactory) -> None:
    async with apps.serve(max_body_bytes=1000) as served:
        small = await served.client.post(f"/v1/encode/{SYNTH}", json=encode_body("x" * 100))
        assert small.status_code == 200, small.text
        body = encode_body("x" * 2000)
        response = await served.client.post(f"/v1/encode/{SYNTH}", json=body)
        error = assert_error(response, 413, "payload_too_large", "body")
        assert "1000" in error["message"]

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: a chunked body
            yield b'{"items": [{"text": "'
            for _ in range(20):
                yield b"y" * 100
            yield b'"}]}'

        chunked = await served.client.post(f"/v1/encode/{SYNTH}", content=chunks(),
                                           headers={"content-type": "application/json"})
        assert_error(chunked, 413, "payload_too_large", "body")
        text = await served.metrics()
        assert 'ember_rejections_total{reason="body_too_large"} 2.0' in text
        # A form's body is refused from its headers, before a byte of it is read.
        form = await served.client.post(f"/v1/encode/{SYNTH}", content=chunks(),
                                        headers={"content-type": "text/plain"})
        assert_error(form, 415, "unsupported_media_type", "body")


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/encode/ember/synthetic", {"items": [{"text": "x"}] * 5}, "items"),
    ("/v1/score/ember/synthetic", {"query": {"text": "q"}, "items": [{"text": "x"}] * 5},
     "items"),
    ("/v1/embeddings", {"input": ["x"] * 5}, "input"),
    ("/v1/rerank", {"query": "q", "documents": ["x"] * 5}, "documents"),
    ("/embed", {"inputs": ["x"] * 5}, "inputs"),
    ("/rerank", {"query": "q", "texts": ["x"] * 5}, "texts"),
])
async def test_too_many_items(apps: AppFactory, route: str, body: dict[str, Any],
                              param: str) -> None:
    async with apps.serve(max_items_per_request=4) as served:
        error = assert_error(await served.client.post(route, json=body), 413,
                             "payload_too_large", param)
        assert "5" in error["message"] and "4" in error["message"]
        assert served.worker().stats.batches == 0  # refused before any work
        # Found by a review: counted as a refusal, as the body limit's 413 is.
        assert 'ember_rejections_total{reason="payload_too_large"} 1.0' in await served.metrics()


async def test_similarity_takes_the_sentence_limit_and_names_its_fields(
        apps: AppFactory) -> None:
    """The source sentence is not one of the request's items: 4 sentences pass a limit of 4
    (a black-box review found 4 refused as "5 items"), and its errors name it."""
    async with apps.serve(max_items_per_request=4) as served:
        def body(source: str, sentences: int) -> dict[str, Any]:
            return {"inputs": {"source_sentence": source, "sentences": ["b"] * sentences}}

        ok = await served.client.post("/similarity", json=body("a", 4))
        assert ok.status_code == 200, ok.text
        assert len(ok.json()) == 4
        over = assert_error(await served.client.post("/similarity", json=body("a", 5)), 413,
                            "payload_too_large", "inputs.sentences")
        assert "5" in over["message"] and "4" in over["message"]
        assert_error(await served.client.post("/similarity", json=body("  ", 1)), 422,
                     param="inputs.source_sentence")


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/score/ember/synthetic", {"query": {"text": "q"}, "items": [{"text": "x"}] * 5},
     "items"),
    ("/v1/rerank", {"query": "q", "documents": ["x"] * 5}, "documents"),
    ("/v2/rerank", {"model": SYNTH, "query": "q", "documents": ["x"] * 5}, "documents"),
    ("/rerank", {"query": "q", "texts": ["x"] * 5}, "texts"),
])
async def test_a_score_over_the_queue_counts_the_query_in_the_clients_terms(
        apps: AppFactory, route: str, body: dict[str, Any], param: str) -> None:
    """5 documents and the query take 6 places; the advice is 4 documents a request (it
    had said "6 items", and "at most 5", which is still refused)."""
    async with apps.serve(worker=WorkerConfig(max_queue_items=5)) as served:
        error = assert_error(await served.client.post(route, json=body), 413,
                             "payload_too_large", param)
        assert error["message"] == (
            f"request too large: 5 {param} and the query take 6 places in the model's queue, "
            f"over max_queue_items=5; split it into requests of at most 4 {param}")
        fewer = {**body, param: body[param][:4]}
        assert (await served.client.post(route, json=fewer)).status_code == 200


# -- 429 ----------------------------------------------------------------------------------------


async def test_queue_full_is_429_with_retry_after(apps: AppFactory) -> None:
    async with apps.serve(worker=WorkerConfig(max_queue_items=2)) as served:
        first = await fill_queue(served)
        refused = await served.client.post(f"/v1/encode/{SYNTH}", json=encode_body("c"))
        error = assert_error(refused, 429, "queue_full")
        assert int(refused.headers["retry-after"]) >= 1
        assert "2" in error["message"]
        openai_refused = await served.client.post("/v1/embeddings", json={"input": "c"})
        assert_error(openai_refused, 429, "queue_full")
        served.worker().resume()
        accepted = await first
        assert accepted.status_code == 200, accepted.text
        adapter = served.synthetic()
        np.testing.assert_allclose(vectors(accepted.json()),
                                   [adapter.vector("a"), adapter.vector("b")], atol=1e-6)
        after = await served.client.post(f"/v1/encode/{SYNTH}", json=encode_body("c"))
        assert after.status_code == 200
        assert 'ember_rejections_total{reason="queue_full"} 2.0' in await served.metrics()


# -- 503 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("route", "body"), [
    ("/v1/encode/ember/synthetic", encode_body("x")),
    ("/v1/embeddings", {"input": "x"}),
    ("/embed", {"inputs": "x"}),
    ("/v1/rerank", {"query": "q", "documents": ["x"]}),
])
async def test_draining_refuses_new_work_with_503(synthetic_app: Served, route: str,
                                                  body: dict[str, Any],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    synthetic_app.state.draining = True
    with caplog.at_level(logging.INFO, logger="ember.access"):
        response = await synthetic_app.client.post(route, json=body)
    # The operator's stop at work, not a fault: the access line is no warning.
    assert [r.levelname for r in caplog.records if r.name == "ember.access"] == ["INFO"]
    error = assert_error(response, 503, "unavailable")
    assert "draining" in error["message"]
    assert int(response.headers["retry-after"]) >= 1
    assert (await synthetic_app.client.get("/healthz")).status_code == 200


async def test_draining_lets_accepted_requests_finish(synthetic_app: Served) -> None:
    worker = synthetic_app.worker()
    worker.pause()
    accepted = asyncio.create_task(synthetic_app.client.post(f"/v1/encode/{SYNTH}",
                                                             json=encode_body("kept")))
    await wait_for(lambda: worker.pending_items == 1)
    synthetic_app.state.draining = True
    refused = await synthetic_app.client.post(f"/v1/encode/{SYNTH}", json=encode_body("new"))
    assert_error(refused, 503, "unavailable")
    worker.resume()
    response = await accepted
    assert response.status_code == 200, response.text
    np.testing.assert_allclose(vectors(response.json())[0],
                               synthetic_app.synthetic().vector("kept"), atol=1e-6)


# -- 500 ----------------------------------------------------------------------------------------


async def test_inference_fault_is_500_without_internals_and_the_next_request_works(
        synthetic_app: Served) -> None:
    client = synthetic_app.client
    response = await client.post(f"/v1/encode/{SYNTH}", json=encode_body("x __fail__ y"))
    error = assert_error(response, 500, "inference_error")
    assert "inference failed" in error["message"]
    assert "SyntheticFault" in error["message"]  # says what failed
    assert "/" not in error["message"] and "line " not in error["message"]
    assert "param" not in error
    for route, body in (("/v1/embeddings", {"input": ["__fail__"]}),
                        ("/v1/rerank", {"query": "__fail__", "documents": ["a"]}),
                        ("/embed", {"inputs": "__fail__"})):
        assert_error(await client.post(route, json=body), 500, "inference_error")
    ok = await client.post(f"/v1/encode/{SYNTH}", json=encode_body("fine"))
    assert ok.status_code == 200, ok.text
    assert synthetic_app.worker().stats.failed_batches == 4


# -- 504 ----------------------------------------------------------------------------------------


async def test_request_timeout_is_504_and_drops_the_queued_work(apps: AppFactory) -> None:
    async with apps.serve(request_timeout_s=0.05) as served:
        worker = served.worker()
        worker.pause()  # nothing is dispatched: the request can only time out
        response = await served.client.post(f"/v1/encode/{SYNTH}", json=encode_body("a", "b"))
        error = assert_error(response, 504, "timeout")
        assert "dropped" in error["message"]
        # Found by a review: it read 0 ms queued, where it waited the whole timeout.
        assert float(response.headers["x-queue-time-ms"]) >= 50
        assert float(response.headers["x-inference-time-ms"]) == 0
        worker.resume()
        await wait_for(lambda: worker.pending_items == 0)  # dropped before dispatch (R9)
        ok = await served.client.post(f"/v1/encode/{SYNTH}", json=encode_body("c"))
        assert ok.status_code == 200, ok.text
        assert worker.stats.items == 1  # the timed-out items never reached a forward
        assert worker.stats.dropped_items == 2
        metrics = await served.metrics()
        assert 'ember_rejections_total{reason="timeout"} 1.0' in metrics
        # The timed-out wait is in the queue histogram (a review found it missing); its
        # request had no inference.
        assert f'ember_queue_duration_seconds_count{{model="{SYNTH}"}} 2.0' in metrics
        assert f'ember_inference_duration_seconds_count{{model="{SYNTH}"}} 1.0' in metrics


async def test_the_timeout_covers_a_requests_wait_for_its_models_load(
        apps: AppFactory) -> None:
    """Found by a black-box review: a request that waited for its model's load (an ONNX
    export, a download) outlived --request-timeout-s. The load goes on for the next."""
    gate = threading.Event()
    async with apps.serve(wait=False, loader=gated_loader(gate),
                          request_timeout_s=0.2) as served:
        started = time.monotonic()
        response = await served.client.post(f"/v1/encode/{SYNTH}", json=encode_body("a"))
        assert_error(response, 504, "timeout")
        assert time.monotonic() - started < 5  # the gate holds the load for 30 s
        gate.set()
        await wait_for(lambda: served.registry.ready(SYNTH) is not None)
        ok = await served.client.post(f"/v1/encode/{SYNTH}", json=encode_body("a"))
        assert ok.status_code == 200, ok.text


async def test_a_wait_for_the_models_load_counts_as_queue_time(apps: AppFactory) -> None:
    """Found by an operator's review: a first request that waited 4 s for its model's load
    said X-Queue-Time-Ms 0.14, so nothing told where its time went."""
    gate = threading.Event()
    async with apps.serve(wait=False, loader=gated_loader(gate)) as served:
        first = asyncio.ensure_future(
            served.client.post(f"/v1/encode/{SYNTH}", json=encode_body("a")))
        await asyncio.sleep(0.3)  # the load is held by the gate meanwhile
        gate.set()
        response = await first
        assert response.status_code == 200, response.text
        assert float(response.headers["x-queue-time-ms"]) >= 250
        again = await served.client.post(f"/v1/encode/{SYNTH}", json=encode_body("a"))
        assert float(again.headers["x-queue-time-ms"]) < 250  # loaded: no such wait


async def test_requests_awaiting_a_load_are_refused_at_once_past_the_queues_room(
        apps: AppFactory) -> None:
    """Found by a review: requests that came during a model's load all waited for it, with
    no bound (500 for 20 s, then 468 of them got 429). As many items as the model's queue
    takes may wait for the load; a request past that is refused at once."""
    gate = threading.Event()
    async with apps.serve(wait=False, loader=gated_loader(gate),
                          worker=WorkerConfig(max_queue_items=4)) as served:
        state = served.app.state.ember
        waiting = [asyncio.create_task(served.client.post(
            f"/v1/encode/{SYNTH}", json=encode_body(f"w{i}a", f"w{i}b"))) for i in range(2)]
        await wait_for(lambda: state.load_waiters.items(SYNTH) == 4)
        refused = await served.client.post(f"/v1/encode/{SYNTH}", json=encode_body("late"))
        error = assert_error(refused, 429, "queue_full")
        assert "4 items pending + 1 requested" in error["message"]
        too_large = await served.client.post(f"/v1/encode/{SYNTH}",
                                              json=encode_body(*"abcde"))
        assert_error(too_large, 413, "payload_too_large")
        assert not gate.is_set() and not any(task.done() for task in waiting)
        gate.set()
        for task in waiting:
            assert (await task).status_code == 200
        assert state.load_waiters.items(SYNTH) == 0  # none left counted
        ok = await served.client.post(f"/v1/encode/{SYNTH}", json=encode_body(*"abcd"))
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(("content", "param"), [
    (b"{", "body"),  # malformed JSON: the field is the body, not a character offset
    (b'{"items": [{"text": "caf\xe9"}]}', "body"),  # not UTF-8
    (b"[" * 5000 + b"]" * 5000, "body"),  # nests past the JSON reader's limit
    (b'{"items": [{"text": "a\\ud800"}]}', "items[0].text"),  # a lone surrogate is no text
])
async def test_undecodable_bodies_are_422_naming_the_body_or_item(
        shared: Served, content: bytes, param: str) -> None:
    response = await shared.client.post(f"/v1/encode/{SYNTH}", content=content,
                                        headers={"content-type": "application/json"})
    assert_error(response, 422, "invalid_request", param=param)


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/embeddings", {"model": SYNTH, "input": "x", "dimensions": 65}, "dimensions"),
    ("/v2/embed", {"model": SYNTH, "texts": ["x"], "input_type": "search_document",
                   "output_dimension": 65}, "output_dimension"),
    ("/embed", {"inputs": "x", "dimensions": 65}, "dimensions"),
])
async def test_a_vector_size_the_model_cannot_be_cut_to_is_refused_on_every_route(
        shared: Served, route: str, body: dict[str, Any], param: str) -> None:
    error = assert_error(await shared.client.post(route, json=body), 422, "invalid_request",
                         param)
    assert f"{param}=65 is out of range" in error["message"]
    assert "send 1 to 64" in error["message"]


@pytest.mark.parametrize(("route", "content", "param", "wanted"), [
    (f"/v1/encode/{SYNTH}", b'{"items": ["hello"]}', "items[0]",
     'expected a JSON object like {"text": "..."}, got a string'),
    (f"/v1/score/{SYNTH}", b'{"query": "q", "items": [{"text": "a"}]}', "query",
     'expected a JSON object like {"text": "..."}, got a string'),
    ("/v1/embeddings", b"null", "body",
     "expected a JSON object with this route's fields (/openapi.json and /docs list "
     "them), got null"),
    (f"/v1/encode/{SYNTH}", b"[1, 2]", "body", "got an array"),
])
async def test_a_value_where_an_object_belongs_is_told_what_object(
        shared: Served, route: str, content: bytes, param: str, wanted: str) -> None:
    """Found by a black-box review: "Input should be a valid dictionary or instance of
    Item", the validation library's words and a class name the client never sees."""
    response = await shared.client.post(route, content=content,
                                        headers={"content-type": "application/json"})
    error = assert_error(response, 422, "invalid_request", param)
    assert wanted in error["message"] and "instance of" not in error["message"], error


@pytest.mark.parametrize(("route", "body", "param"), [
    (f"/v1/encode/{SYNTH}", {"items": [{"text": "x"}], **{f"k{i}": 0 for i in range(100_000)}},
     "body"),
    (f"/v1/encode/{SYNTH}", {"items": [{"text": "x"}, {f"k{i}": 0 for i in range(300)}]},
     "items[1]"),
    (f"/v1/encode/{SYNTH}", {"items": [{"text": "x", "image": {f"k{i}": 0 for i in range(300)}}]},
     "items[0].image"),
    ("/v1/embeddings", {"input": "x", "extra": {f"k{i}": 0 for i in range(300)}}, "extra"),
    ("/v1/rerank", {"query": "q", "documents": [{"text": "a", "meta": {
        f"k{i}": 0 for i in range(300)}}]}, "documents[0].meta"),
])
async def test_an_object_of_hundreds_of_fields_is_refused_before_validation(
        shared: Served, route: str, body: dict[str, Any], param: str) -> None:
    """Found by a security review: pydantic builds an error for each unknown field, so a
    12 MB body of 1M of them held the event loop 2.3 s for a 422."""
    response = await shared.client.post(route, json=body)
    error = assert_error(response, 422, "invalid_request", param)
    assert "fields is over the limit of 256" in error["message"], error  # not the schema's


async def test_an_object_up_to_the_field_limit_gets_the_schemas_own_refusal(
        shared: Served) -> None:
    crowded = {"items": [{"text": "x"}], **{f"k{i}": 0 for i in range(255)}}  # 256 fields
    error = assert_error(await shared.client.post(f"/v1/encode/{SYNTH}", json=crowded), 422,
                         "invalid_request")
    assert "unknown fields" in error["message"]  # pydantic's own refusal, not the cap
