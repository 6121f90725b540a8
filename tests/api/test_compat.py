"""Issue 12 in process: the SIE dialect (unknown fields, score placements, codes, request
ids, the model endpoints), TEI's root, similarity, /health and /info, the token-id and
item-count rules of /v1/embeddings, task checks before a load, and the access log."""

from __future__ import annotations

import difflib
import json
import logging
from typing import Any

import numpy as np
import pytest

from ember.api import fields
from ember.api.native import EncodeRequest
from ember.logs import JsonFormatter
from tests.api.conftest import (
    MINILM,
    SLOW,
    SPACY,
    SYNTH,
    AppFactory,
    Served,
    assert_error,
    encode_body,
)


@pytest.mark.parametrize("route, body, param", [
    (f"/v1/encode/{SYNTH}", {**encode_body("x"), "extra": 1}, "extra"),
    (f"/v1/encode/{SYNTH}", encode_body("x", options={"profile": "fast"}),
     "params.options.profile"),
    (f"/v1/encode/{SYNTH}", {"items": [{"text": "x", "image": "y"}]}, "items[0].image"),
    (f"/v1/score/{SYNTH}", {"query": {"text": "q"}, "items": [{"text": "x"}],
                            "options": {"normalize": True}}, "options.normalize"),
    (f"/v1/extract/{SPACY}", {"items": [{"text": "x"}], "params": {"schema": {}}},
     "params.schema"),
    # Found by a black-box review: these three bodies ignored what they did not know.
    ("/v1/embeddings", {"model": SYNTH, "input": "x", "bogus": 1}, "bogus"),
    ("/v2/embed", {"model": SYNTH, "texts": ["x"], "bogus": 1}, "bogus"),
    ("/v2/rerank", {"model": SYNTH, "query": "q", "documents": ["x"],
                    "return_documents": True}, "return_documents"),
])
async def test_unknown_fields_are_refused_by_name(shared: Served, route: str,
                                                  body: dict[str, object], param: str) -> None:
    error = assert_error(await shared.client.post(route, json=body), 422, "invalid_request",
                         param)
    assert param in error["message"] and "unknown field" in error["message"]


@pytest.mark.parametrize("route, body, param, meant", [
    (f"/v1/encode/{SYNTH}", {"items": [{"text": "x"}, {"txt": "y"}]}, "items[1].txt",
     "items[1].text"),
    (f"/v1/encode/{SYNTH}", encode_body("x") | {"params": {"truncate": False}},
     "params.truncate", "params.options.truncate"),
    (f"/v1/score/{SYNTH}", {"querry": {"text": "q"}, "items": [{"text": "x"}]}, "querry",
     "query"),
    ("/v1/embeddings", {"model": SYNTH, "inputs": ["x"]}, "inputs", "input"),
    ("/", {"inputs": "x", "truncat": True}, "truncat", "truncate"),  # TEI's root route
])
async def test_a_misspelled_or_misplaced_field_is_told_the_one_it_stands_for(
        shared: Served, route: str, body: dict[str, object], param: str,
        meant: str) -> None:
    """Found by a fresh-clone walkthrough: "remove it", where the field was misspelled."""
    error = assert_error(await shared.client.post(route, json=body), 422, "invalid_request",
                         param)
    assert f"unknown field {param} (did you mean {meant}?)" in error["message"], error
    assert "remove it" not in error["message"]


async def test_a_body_of_many_unknown_fields_gets_a_short_answer(shared: Served) -> None:
    body = encode_body("x") | {f"field{i}": i for i in range(200)}
    error = assert_error(await shared.client.post(f"/v1/encode/{SYNTH}", json=body), 422,
                         "invalid_request", "field0")
    assert "field4, and 195 more: remove them" in error["message"], error
    assert len(error["message"]) < 300
    # Past the field limit the body is refused before the schema is read (its error list
    # would cost a second per 500,000 fields).
    body = encode_body("x") | {f"field{i}": i for i in range(20_000)}
    error = assert_error(await shared.client.post(f"/v1/encode/{SYNTH}", json=body), 422,
                         "invalid_request", "body")
    assert "an object of 20,002 fields is over the limit of 256" in error["message"], error
    assert len(error["message"]) < 300
    # Found by a review: long keys came back whole in the message, and each was compared
    # with every field (five of 3 M characters held the event loop for 2.9 s).
    long_keys = encode_body("x") | {str(i) * 100_000: i for i in range(1, 6)}
    long = await shared.client.post(f"/v1/encode/{SYNTH}", json=long_keys)
    error = assert_error(long, 422, "invalid_request")
    assert error["param"] == "1" * 80 + "... (100000 characters)"
    assert len(error["message"]) < 900



def test_a_name_too_long_to_be_a_misspelling_is_never_compared(
        monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[str] = []
    real = difflib.get_close_matches

    def counted(word: str, *args: Any, **kwargs: Any) -> list[str]:
        compared.append(word)
        return real(word, *args, **kwargs)

    monkeypatch.setattr(fields.difflib, "get_close_matches", counted)
    assert fields.suggestion(EncodeRequest, ("itemz",)) == ("items",)
    assert fields.suggestion(EncodeRequest, ("i" * 65,)) is None
    assert compared == ["itemz"]


async def test_other_servers_routes_say_what_to_use_instead(shared: Served) -> None:
    """Found by a black-box review: TEI's /predict and /embed_all got a bare 404."""
    for path, hint in (("/predict", "/rerank"), ("/embed_all", "multivector"),
                       ("/v1/classify", "not served")):
        error = assert_error(await shared.client.post(path, json={"inputs": "x"}), 404,
                             "not_found")
        assert error["message"].startswith(f"Not Found: {path} ") and hint in error["message"]
    assert assert_error(await shared.client.post("/nothing", json={}), 404)["message"] == \
        "Not Found"


async def test_cohere_rerank_refuses_the_spans_it_cannot_give(shared: Served) -> None:
    body = {"model": SYNTH, "query": "q", "documents": ["x"]}
    ok = await shared.client.post("/v2/rerank", json={**body, "relevant_spans": False})
    assert ok.status_code == 200, ok.text
    error = assert_error(await shared.client.post("/v2/rerank", json={
        **body, "relevant_spans": True}), 422, "invalid_request", "relevant_spans")
    assert "without spans; remove it" in error["message"]
    # Each refusal gives its own field's reason (a review found "no spans" for `inputs`).
    embed = {"model": SYNTH, "texts": ["x"]}
    for field, value, why in (("inputs", [{"content": []}], "not a content list fused"),
                              ("max_tokens", 8, "embedded whole")):
        error = assert_error(await shared.client.post("/v2/embed", json={
            **embed, field: value}), 422, "invalid_request", field)
        assert why in error["message"] and "spans" not in error["message"], error


async def test_score_options_at_the_top_level_are_applied(shared: Served) -> None:
    body = {"query": {"text": "q"}, "items": [{"text": "word " * 600}],
            "options": {"truncate": False}}
    refused = await shared.client.post(f"/v1/score/{MINILM}", json=body)
    assert_error(refused, 400, "input_too_long", "items[0].text")
    body["options"] = {"truncate": True}
    assert (await shared.client.post(f"/v1/score/{MINILM}", json=body)).status_code == 200
    twice = {**body, "params": {"options": {"truncate": True}}}
    assert_error(await shared.client.post(f"/v1/score/{MINILM}", json=twice), 422,
                 "invalid_request", "options")
    instructed = {**body, "instruction": "rank"}
    assert_error(await shared.client.post(f"/v1/score/{MINILM}", json=instructed), 422,
                 "invalid_request", "instruction")


async def test_request_id_also_as_the_sie_header(shared: Served) -> None:
    response = await shared.client.post(f"/v1/encode/{SYNTH}", json=encode_body("x"),
                                        headers={"X-SIE-Request-ID": "abc-123"})
    assert response.headers["x-sie-request-id"] == response.headers["x-request-id"] == "abc-123"


async def test_models_in_both_shapes_and_one_by_id(shared: Served) -> None:
    body = (await shared.client.get("/v1/models")).json()
    assert body["object"] == "list"
    openai = {m["id"]: m for m in body["data"]}
    sie = {m["name"]: m for m in body["models"]}
    assert openai[MINILM]["dims"] == 384 and sie[MINILM]["dims"] == {"dense": 384}
    assert sie[MINILM]["loaded"] is True and sie[MINILM]["outputs"] == ["dense"]
    one = (await shared.client.get(f"/v1/models/{MINILM}")).json()
    assert one["id"] == one["name"] == MINILM and one["object"] == "model"
    assert one["dims"] == {"dense": 384} and one["max_sequence_length"] == 256
    missing = await shared.client.get("/v1/models/nobody/none")
    error = assert_error(missing, 404, "model_not_found", "model")
    assert MINILM in error["message"]


async def test_gets_ignore_a_msgpack_content_type(shared: Served) -> None:
    headers = {"content-type": "application/msgpack"}
    for path in ("/healthz", "/readyz", "/health", "/info", "/v1/models"):
        response = await shared.client.get(path, headers=headers)
        assert response.status_code == 200, (path, response.text)


async def test_tei_root_reads_each_body(shared: Served) -> None:
    client, adapter = shared.client, shared.synthetic()
    embedded = (await client.post("/", json={"inputs": "one"})).json()
    np.testing.assert_allclose(embedded[0], adapter.vector("one"), atol=1e-6)
    similar = (await client.post("/", json={"inputs": {"source_sentence": "a",
                                                       "sentences": ["a", "b"]}})).json()
    direct = (await client.post("/similarity", json={"inputs": {
        "source_sentence": "a", "sentences": ["a", "b"]}})).json()
    a, b = adapter.vector("a"), adapter.vector("b")
    expected = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    np.testing.assert_allclose(similar, [1.0, expected], atol=1e-5)
    assert similar == direct
    ranked = (await client.post("/", json={"query": "a", "texts": ["b", "a"]})).json()
    assert [r["index"] for r in ranked] == [1, 0]
    bad = await client.post("/", json={"inputs": {"source_sentence": "a"}})
    assert_error(bad, 422, "invalid_request", "inputs.sentences")


async def test_health_and_info(shared: Served) -> None:
    assert (await shared.client.get("/health")).status_code == 200
    info = (await shared.client.get("/info")).json()
    assert info["model_id"] == SYNTH and info["max_client_batch_size"] == 2048
    assert "embedding" in info["model_type"]


async def test_info_reports_the_token_budget_in_use(apps: AppFactory) -> None:
    """Found by a review: /info reported the budget's cap, 16,384, where the server had
    learned a smaller one from the model's slow forwards."""
    async with apps.serve(default_model=SLOW) as served:
        client = served.client
        assert (await client.get("/info")).json()["max_batch_tokens"] == 16384  # nothing run
        long = await client.post(f"/v1/encode/{SLOW}", json=encode_body("word " * 600))
        assert long.status_code == 200, long.text  # 512 tokens in 300 ms: a slow device
        windows = (await client.get(f"/v1/models/{SLOW}")).json()["dispatch"]["windows"]
        info = (await client.get("/info")).json()
    assert info["max_batch_tokens"] == windows["max_batch_tokens"] < 16384


async def test_token_ids_need_a_tokenizer(apps: AppFactory) -> None:
    async with apps.serve(token_ids="model") as served:
        response = await served.client.post("/v1/embeddings", json={"model": SYNTH,
                                                                    "input": [[1, 2]]})
    error = assert_error(response, 422, "invalid_request", "input")
    assert "text only" in error["message"]


async def test_token_ids_are_refused_by_default_with_the_client_fix(shared: Served) -> None:
    """Ids name no vocabulary: read in the wrong one they give a 200 with wrong vectors."""
    for ids in ([101, 7592, 102], [[101, 7592], [2088]]):
        response = await shared.client.post("/v1/embeddings", json={"model": MINILM,
                                                                    "input": ids})
        error = assert_error(response, 422, "invalid_request", "input")
        assert "check_embedding_ctx_length=False" in error["message"]
        assert "--token-ids model" in error["message"]


async def test_2048_inputs_by_default_and_not_one_more(shared: Served) -> None:
    fits = await shared.client.post("/v1/embeddings", json={"input": ["x"] * 2048})
    assert fits.status_code == 200 and len(fits.json()["data"]) == 2048
    over = await shared.client.post("/v1/embeddings", json={"input": ["x"] * 2049})
    error = assert_error(over, 413, "payload_too_large", "input")
    assert "2048" in error["message"]


async def test_a_wrong_task_is_refused_before_the_model_loads(apps: AppFactory) -> None:
    async with apps.serve() as served:
        response = await served.client.post(f"/v1/encode/{SPACY}", json=encode_body("x"))
        assert_error(response, 422, "unsupported_task", "model")
        assert served.registry.state(SPACY) == "available"  # never loaded


async def test_one_access_line_per_request(shared: Served,
                                           caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ember.access"):
        await shared.client.post(f"/v1/encode/{SYNTH}", json=encode_body("a", "b"),
                                 headers={"X-Request-Id": "line-1"})
        await shared.client.post("/v1/encode/nobody/none", json=encode_body("a"),
                                 headers={"X-Request-Id": "line-2"})
    lines = [r for r in caplog.records if r.name == "ember.access"]
    assert len(lines) == 2
    ok, missing = (r.__dict__["fields"] for r in lines)  # set by `extra=`
    assert ok["status"] == 200 and ok["model"] == SYNTH and ok["items"] == 2
    assert ok["request_id"] == "line-1" and ok["route"] == "/v1/encode/{model:path}"
    assert ok["queue_ms"] >= 0 and ok["inference_ms"] > 0
    assert missing["status"] == 404 and missing["request_id"] == "line-2"
    # Found by an operator's review: every refusal looked alike in the log.
    assert missing["error"] == "model_not_found" and missing["param"] == "model"
    assert lines[1].getMessage().endswith(" error=model_not_found param=model")
    assert "error" not in ok
    assert "POST /v1/encode/" in lines[0].getMessage() and "line-1" in lines[0].getMessage()
    # Which client sent it: httpx's ASGI transport calls itself 127.0.0.1:123.
    assert ok["client"] == "127.0.0.1:123"
    assert lines[0].getMessage().endswith(" client=127.0.0.1:123")
    entry = json.loads(JsonFormatter().format(lines[0]))
    assert entry["level"] == "info" and entry["logger"] == "ember.access"
    assert entry["status"] == 200 and entry["request_id"] == "line-1"
