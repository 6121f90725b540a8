"""Native routes (SIE's wire shapes): /v1/encode, /v1/score, /v1/extract."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.api.conftest import (
    BUSY,
    MINILM,
    SPACY,
    SYNTH,
    AppFactory,
    Served,
    assert_error,
    encode_body,
    vectors,
)

# -- encode -------------------------------------------------------------------------------


async def test_encode_returns_each_items_vector_with_its_id(shared: Served) -> None:
    body = {"items": [{"id": "a", "text": "first text"}, {"text": "second"}]}
    response = await shared.client.post(f"/v1/encode/{SYNTH}", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    data = response.json()
    assert data["model"] == SYNTH
    first, second = data["items"]
    assert first["id"] == "a"
    assert "id" not in second
    adapter = shared.synthetic()
    for item, text in ((first, "first text"), (second, "second")):
        dense = item["dense"]
        assert dense["dims"] == adapter.dims == len(dense["values"])
        assert dense["dtype"] == "float32"
        np.testing.assert_allclose(dense["values"], adapter.vector(text), atol=1e-6)


async def test_encode_on_the_real_model(shared: Served) -> None:
    texts = ["A cat sits on the mat.", "Stock markets fell sharply today.",
             "A kitten is sitting on a rug."]
    response = await shared.client.post(f"/v1/encode/{MINILM}", json=encode_body(*texts))
    assert response.status_code == 200, response.text
    vecs = np.array(vectors(response.json()), dtype=np.float32)
    assert vecs.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-4)  # normalize: true
    similarity = vecs @ vecs.T
    assert similarity[0, 2] > similarity[0, 1] + 0.2  # cat/kitten closer than cat/stocks


async def test_encode_params_change_the_vector_only_as_asked(shared: Served) -> None:
    client = shared.client
    text = "what is the capital of France"
    base = await client.post(f"/v1/encode/{MINILM}", json=encode_body(text))
    same = await client.post(f"/v1/encode/{MINILM}",
                             json=encode_body(text, output_types=["dense"]))
    raw = await client.post(f"/v1/encode/{MINILM}",
                            json=encode_body(text, options={"normalize": False}))
    for response in (base, same, raw):
        assert response.status_code == 200, response.text
    b, s, r = (np.array(vectors(x.json())[0]) for x in (base, same, raw))
    np.testing.assert_allclose(b, s, atol=1e-6)
    assert abs(float(np.linalg.norm(r)) - 1.0) > 1e-3  # not normalized
    np.testing.assert_allclose(r / np.linalg.norm(r), b, atol=1e-5)


async def test_an_instruction_for_a_model_without_prompts_is_422(shared: Served) -> None:
    response = await shared.client.post(
        f"/v1/encode/{MINILM}", json=encode_body("x", instruction="Represent the query:"))
    error = assert_error(response, 422, "invalid_request", "params.instruction")
    assert MINILM in error["message"]


@pytest.mark.parametrize("size", [2001, 1_000_000])
async def test_an_instruction_past_its_limit_is_422_before_any_text_is_read(
        shared: Served, size: int) -> None:
    """Found by a security review: the instruction had no limit, and is put before every
    text: a 1 MB one over 100 texts cost a minute of tokenizing and 6 GB."""
    response = await shared.client.post(f"/v1/encode/{MINILM}", json=encode_body(
        *["x"] * 100, instruction="y" * size))
    error = assert_error(response, 422, "invalid_request", "params.instruction")
    assert f"an instruction of {size:,} characters is over the limit of 2,000" \
        in error["message"]


async def test_encode_truncates_long_text_by_default(shared: Served) -> None:
    long_text = "word " * 2000
    response = await shared.client.post(f"/v1/encode/{MINILM}", json=encode_body(long_text))
    assert response.status_code == 200, response.text
    assert len(vectors(response.json())[0]) == 384


async def test_encode_unknown_output_type_is_422(shared: Served) -> None:
    response = await shared.client.post(f"/v1/encode/{MINILM}",
                                        json=encode_body("x", output_types=["sparse"]))
    assert_error(response, 422, "unsupported_output", "params.output_types")


async def test_concurrent_encodes_get_their_own_vectors_and_share_forwards(
        apps: AppFactory) -> None:
    """16 requests at once through HTTP: each gets its own texts' vectors (in order), and
    the worker fused them into fewer forwards than requests."""
    async with apps.serve(default_model=BUSY) as served:
        adapter = served.synthetic(BUSY)
        before = served.worker(BUSY).stats.batches
        requests = [[f"request {r} text {i}" for i in range(1 + r % 3)] for r in range(16)]
        responses = await asyncio.gather(*(
            served.client.post(f"/v1/encode/{BUSY}", json=encode_body(*texts))
            for texts in requests))
        for texts, response in zip(requests, responses, strict=True):
            assert response.status_code == 200, response.text
            got = vectors(response.json())
            assert len(got) == len(texts)
            for text, vec in zip(texts, got, strict=True):
                np.testing.assert_allclose(vec, adapter.vector(text), atol=1e-6)
        stats = served.worker(BUSY).stats
        forwards = stats.batches - before
        assert 1 <= forwards < len(requests)
        assert stats.items == sum(len(t) for t in requests)
        assert max(stats.batch_requests) > 1


# -- score ----------------------------------------------------------------------------------


async def test_score_ranks_items_best_first(shared: Served) -> None:
    body = {"query": {"text": "the capital of France"},
            "items": [{"id": "weather", "text": "It will rain tomorrow in Oslo."},
                      {"id": "paris", "text": "Paris is the capital and largest city of "
                                              "France."},
                      {"text": "Bananas are rich in potassium."}]}
    response = await shared.client.post(f"/v1/score/{MINILM}", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["model"] == MINILM
    scores = data["scores"]
    assert [s["rank"] for s in scores] == [0, 1, 2]
    assert scores[0]["item_id"] == "paris"
    assert {s["item_id"] for s in scores} == {"weather", "paris", "2"}  # index when no id
    values = [s["score"] for s in scores]
    assert values == sorted(values, reverse=True)


@pytest.mark.parametrize(("items", "param"), [
    ([{"id": "a", "text": "x"}, {"id": "b", "text": "y"}, {"id": "a", "text": "z"}],
     "items[2].id"),
    ([{"text": "x"}, {"id": "0", "text": "y"}], "items[1].id"),  # the first is named "0"
])
async def test_score_items_of_one_id_are_refused(shared: Served, items: list[dict[str, str]],
                                                 param: str) -> None:
    """Found by a black-box review: two items of one id came back as two scores of that
    id, sorted, so a client could not tell which was which."""
    response = await shared.client.post(f"/v1/score/{SYNTH}", json={
        "query": {"text": "q"}, "items": items})
    error = assert_error(response, 422, "invalid_request", param)
    assert "needs its own id" in error["message"], error


async def test_score_on_the_synthetic_model_is_the_dot_product(shared: Served) -> None:
    docs = ["one", "two words", "three words here"]
    body = {"query": {"text": "query"}, "items": [{"text": d} for d in docs]}
    response = await shared.client.post(f"/v1/score/{SYNTH}", json=body)
    assert response.status_code == 200, response.text
    adapter = shared.synthetic()
    expected = {str(i): float(adapter.vector("query") @ adapter.vector(d))
                for i, d in enumerate(docs)}
    scores = response.json()["scores"]
    assert {entry["item_id"] for entry in scores} == set(expected)
    for entry in scores:
        assert entry["score"] == pytest.approx(expected[entry["item_id"]], abs=1e-6)


async def test_score_missing_query_is_422_naming_it(shared: Served) -> None:
    response = await shared.client.post(f"/v1/score/{SYNTH}", json={"items": [{"text": "a"}]})
    assert_error(response, 422, "invalid_request", "query")


async def test_score_with_no_items_is_422(shared: Served) -> None:
    response = await shared.client.post(f"/v1/score/{SYNTH}",
                                        json={"query": {"text": ""}, "items": []})
    assert_error(response, 422, "invalid_request", "items")


# -- extract --------------------------------------------------------------------------------


async def test_extract_finds_entities_with_offsets(shared: Served) -> None:
    texts = ["Barack Obama visited Paris in March 2015.", "No entities here, honestly."]
    body = {"items": [{"id": "x", "text": texts[0]}, {"text": texts[1]}]}
    response = await shared.client.post(f"/v1/extract/{SPACY}", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["model"] == SPACY
    first, _second = data["items"]
    assert first["id"] == "x"
    found = {(e["text"], e["label"]) for e in first["entities"]}
    assert any(text == "Barack Obama" for text, _ in found), found
    assert any(text == "Paris" for text, _ in found), found
    for entity in first["entities"]:
        assert set(entity) == {"text", "label", "start", "end", "score"}
        assert texts[0][entity["start"]:entity["end"]] == entity["text"]


async def test_extract_label_filter(shared: Served) -> None:
    text = "Barack Obama visited Paris in March 2015."
    response = await shared.client.post(
        f"/v1/extract/{SPACY}",
        json={"items": [{"text": text}], "params": {"labels": ["person"]}})
    assert response.status_code == 200, response.text
    entities = response.json()["items"][0]["entities"]
    assert [e["text"] for e in entities] == ["Barack Obama"]


async def test_extract_unknown_label_is_422_naming_it(shared: Served) -> None:
    response = await shared.client.post(
        f"/v1/extract/{SPACY}",
        json={"items": [{"text": "Paris"}], "params": {"labels": ["person", "spaceship"]}})
    error = assert_error(response, 422, "invalid_request", "params.labels[1]")
    assert "spaceship" in error["message"]


async def test_extract_on_an_embedding_model_is_422(shared: Served) -> None:
    response = await shared.client.post(f"/v1/extract/{SYNTH}", json={"items": [{"text": "a"}]})
    error = assert_error(response, 422, "unsupported_task", "model")
    assert "extract" in error["message"] and "encode" in error["message"]


async def test_encode_on_the_extractor_is_422(shared: Served) -> None:
    response = await shared.client.post(f"/v1/encode/{SPACY}", json=encode_body("a"))
    assert_error(response, 422, "unsupported_task", "model")
