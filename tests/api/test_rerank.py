"""Cohere/Jina-style /v1/rerank."""

from __future__ import annotations

import msgpack
import pytest

from tests.api.conftest import MINILM, SPACY, SYNTH, Served, assert_error

DOCS = ["It will rain tomorrow in Oslo.",
        "Paris is the capital and largest city of France.",
        "Bananas are rich in potassium.",
        "France's capital hosts the Louvre."]
QUERY = "What is the capital of France?"


async def test_results_are_sorted_with_indices_into_the_request(shared: Served) -> None:
    response = await shared.client.post("/v1/rerank", json={
        "model": MINILM, "query": QUERY, "documents": DOCS})
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["model"] == MINILM
    results = data["results"]
    assert sorted(r["index"] for r in results) == list(range(len(DOCS)))
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    assert {results[0]["index"], results[1]["index"]} == {1, 3}  # the two about Paris
    assert all("document" not in r for r in results)
    assert data["usage"]["total_tokens"] > 0


async def test_top_n_and_return_documents(shared: Served) -> None:
    full = await shared.client.post("/v1/rerank", json={
        "model": SYNTH, "query": QUERY, "documents": DOCS})
    top = await shared.client.post("/v1/rerank", json={
        "model": SYNTH, "query": QUERY, "documents": [{"text": d} for d in DOCS],
        "top_n": 2, "return_documents": True})
    assert full.status_code == top.status_code == 200, top.text
    results = top.json()["results"]
    assert len(results) == 2
    assert [r["index"] for r in results] == [r["index"] for r in full.json()["results"][:2]]
    for result in results:
        assert result["document"] == {"text": DOCS[result["index"]]}


async def test_document_objects_come_back_whole_in_cohere_v1s_answer(shared: Served) -> None:
    """Found by a black-box review: a document's other fields were dropped, where Cohere's
    v1 returns the document as it was sent; and its answer's id and meta were missing."""
    sent = [{"text": DOCS[0], "title": "Berlin", "id": "d1", "tags": ["city"]}, DOCS[1]]
    response = await shared.client.post("/v1/rerank", json={
        "model": SYNTH, "query": QUERY, "documents": sent, "return_documents": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert {r["index"]: r["document"] for r in body["results"]} == {
        0: sent[0], 1: {"text": DOCS[1]}}
    assert len(body["id"]) == 32 and body["meta"]["api_version"] == {"version": "1"}


@pytest.mark.parametrize(("field", "value", "param"), [
    ("raw", b"\x00\x01", "documents[0].raw"),
    ("nested", {"scores": [1.0, float("nan")]}, "documents[0].nested.scores[1]"),
    ("far", float("inf"), "documents[0].far"),
])
async def test_a_documents_field_that_cannot_come_back_as_json_is_refused(
        shared: Served, field: str, value: object, param: str) -> None:
    """Found by a code review: a msgpack body's bytes in a document object, echoed into a
    JSON answer, failed the request with a 500 after its forward."""
    body = {"model": SYNTH, "query": QUERY, "return_documents": True,
            "documents": [{"text": "x", field: value}]}
    response = await shared.client.post("/v1/rerank", content=msgpack.packb(body),
                                        headers={"content-type": "application/msgpack"})
    assert_error(response, 422, "invalid_request", param)


async def test_a_documents_integers_come_back_exact_or_are_refused(shared: Served) -> None:
    """Found by a black-box review: an integer past 64 bits in a document came back as a
    rounded float with a 200 (the JSON reader had made it one)."""
    sent = [{"text": "id 12345678901234567890 in a text", "low": -2**63, "high": 2**64 - 1}]
    response = await shared.client.post("/v1/rerank", json={
        "model": SYNTH, "query": QUERY, "documents": sent, "return_documents": True})
    assert response.status_code == 200, response.text
    assert response.json()["results"][0]["document"] == sent[0]
    for wide in (2**64, -2**63 - 1, 12345678901234567890123):
        response = await shared.client.post("/v1/rerank", json={
            "model": SYNTH, "query": QUERY, "return_documents": True,
            "documents": [{"text": "x", "id": wide}]})
        assert_error(response, 422, "invalid_request", "documents[0].id")


async def test_top_n_above_the_count_returns_all(shared: Served) -> None:
    response = await shared.client.post("/v1/rerank", json={
        "query": QUERY, "documents": DOCS[:2], "top_n": 10})
    assert response.status_code == 200, response.text
    assert len(response.json()["results"]) == 2
    assert response.json()["model"] == SYNTH  # the default model


@pytest.mark.parametrize(("body", "param"), [
    ({"documents": DOCS}, "query"),
    ({"query": QUERY}, "documents"),
    ({"query": QUERY, "documents": []}, "documents"),
    ({"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
    # Found by a black-box review: true was read as 1, and 2.0 as 2.
    ({"query": QUERY, "documents": DOCS, "top_n": True}, "top_n"),
    ({"query": QUERY, "documents": DOCS, "top_n": 2.0}, "top_n"),
    ({"query": QUERY, "documents": [{"txt": "x"}]}, None),
    # Found by a black-box review: ranked on "text" with a 200 while the client asked for
    # its title; any field Cohere or Jina have that Ember does not is named too.
    ({"query": QUERY, "documents": [{"text": "x"}], "rank_fields": ["title"]}, "rank_fields"),
    ({"query": QUERY, "documents": DOCS, "max_chunks_per_doc": 3}, "max_chunks_per_doc"),
    # Found by a black-box review: a Jina image beside a text was ranked by the text.
    ({"query": QUERY, "documents": [{"text": "x", "image": "https://x/y.png"}]},
     "documents[0].image"),
    ({"query": QUERY, "documents": ["a", {"image": "https://x/y.png"}]}, "documents[1].image"),
    ({"query": QUERY, "documents": [{"title": "no text"}]}, "documents[0].text"),
])
async def test_invalid_bodies_are_422_naming_the_field(shared: Served, body: dict[str, object],
                                                       param: str | None) -> None:
    response = await shared.client.post("/v1/rerank", json={"model": SYNTH, **body})
    error = assert_error(response, 422, "invalid_request")
    if param is None:
        assert error["param"].startswith("documents[0]"), error
    else:
        assert error["param"] == param, error


async def test_cohere_v1s_chunking_is_refused_with_its_reason(shared: Served) -> None:
    """Found by a black-box review: cohere.Client.rerank's max_chunks_per_doc was told
    "unknown field", as if the client had misspelt something."""
    response = await shared.client.post("/v1/rerank", json={
        "query": QUERY, "documents": DOCS, "max_chunks_per_doc": 3})
    error = assert_error(response, 422, "invalid_request", "max_chunks_per_doc")
    assert "scored whole, not in chunks" in error["message"], error


async def test_unknown_model_is_404(shared: Served) -> None:
    response = await shared.client.post("/v1/rerank", json={
        "model": "no/such", "query": QUERY, "documents": DOCS})
    error = assert_error(response, 404, "model_not_found", "model")
    assert SYNTH in error["message"]


async def test_a_model_that_cannot_score_is_422(shared: Served) -> None:
    response = await shared.client.post("/v1/rerank", json={
        "model": SPACY, "query": QUERY, "documents": DOCS})
    assert_error(response, 422, "unsupported_task", "model")


async def test_rank_fields_naming_the_text_is_taken(shared: Served) -> None:
    response = await shared.client.post("/v1/rerank", json={
        "model": SYNTH, "query": QUERY, "documents": [{"text": "x", "title": "t"}],
        "rank_fields": ["text"]})
    assert response.status_code == 200, response.text
