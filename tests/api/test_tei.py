"""text-embeddings-inference style /embed and /rerank, on the default model."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import torch
from sentence_transformers import CrossEncoder

from ember.config import ServerSettings
from tests.adapters.tiny_models import build_cross_encoder
from tests.api.conftest import (
    MINILM,
    AppFactory,
    Served,
    assert_error,
    encode_body,
    serving,
    vectors,
)


@pytest_asyncio.fixture(loop_scope="session")
async def real_default(apps: AppFactory) -> AsyncIterator[Served]:
    """TEI routes serve the default model: here the real one."""
    async with apps.serve(default_model=MINILM) as served:
        yield served


async def test_embed_a_list_returns_a_list_of_vectors(shared: Served) -> None:
    texts = ["one", "two"]
    response = await shared.client.post("/embed", json={"inputs": texts})
    assert response.status_code == 200, response.text
    got = response.json()
    assert isinstance(got, list) and len(got) == 2
    adapter = shared.synthetic()
    for text, vec in zip(texts, got, strict=True):
        np.testing.assert_allclose(vec, adapter.vector(text), atol=1e-6)


async def test_embed_a_string_is_one_vector_in_a_list(shared: Served) -> None:
    response = await shared.client.post("/embed", json={"inputs": "alone"})
    assert response.status_code == 200, response.text
    [vec] = response.json()
    np.testing.assert_allclose(vec, shared.synthetic().vector("alone"), atol=1e-6)


async def test_embed_on_the_real_model_matches_native(real_default: Served) -> None:
    texts = ["the TEI route", "against the native route"]
    tei = await real_default.client.post("/embed", json={"inputs": texts})
    native = await real_default.client.post(f"/v1/encode/{MINILM}", json=encode_body(*texts))
    assert tei.status_code == native.status_code == 200, tei.text
    np.testing.assert_allclose(tei.json(), vectors(native.json()), atol=1e-6)


async def test_embed_normalize_false(real_default: Served) -> None:
    normal = await real_default.client.post("/embed", json={"inputs": "x y z"})
    raw = await real_default.client.post("/embed", json={"inputs": "x y z",
                                                         "normalize": False})
    assert normal.status_code == raw.status_code == 200, raw.text
    n, r = np.array(normal.json()[0]), np.array(raw.json()[0])
    assert abs(float(np.linalg.norm(n)) - 1.0) < 1e-4
    assert abs(float(np.linalg.norm(r)) - 1.0) > 1e-3
    np.testing.assert_allclose(r / np.linalg.norm(r), n, atol=1e-5)


async def test_embed_truncate_false_refuses_text_over_the_limit(real_default: Served) -> None:
    response = await real_default.client.post("/embed", json={"inputs": ["ok", "word " * 600],
                                                              "truncate": False})
    error = assert_error(response, 400, "input_too_long", "inputs[1]")  # this route's field
    assert "max_seq_length" in error["message"]


@pytest.mark.parametrize(("query", "texts", "param"), [
    ("word " * 600, ["fine"], "query"),
    ("fine", ["fine", "word " * 600], "texts[1]"),
])
async def test_rerank_truncate_false_names_the_long_field(real_default: Served, query: str,
                                                          texts: list[str],
                                                          param: str) -> None:
    response = await real_default.client.post("/rerank", json={
        "query": query, "texts": texts, "truncate": False})
    assert_error(response, 400, "input_too_long", param)


@pytest.mark.parametrize(("source", "sentences", "param"), [
    ("word " * 600, ["fine"], "inputs.source_sentence"),
    ("fine", ["fine", "word " * 600], "inputs.sentences[1]"),
])
async def test_similarity_truncate_false_names_the_long_field(
        real_default: Served, source: str, sentences: list[str], param: str) -> None:
    """Found by a black-box review: both were `inputs[i]` of the texts encoded together.
    TEI reads the option under `parameters` (a later review); Ember at the top level too."""
    inputs = {"source_sentence": source, "sentences": sentences}
    for body in ({"inputs": inputs, "parameters": {"truncate": False}},
                 {"inputs": inputs, "truncate": False}):
        assert_error(await real_default.client.post("/similarity", json=body), 400,
                     "input_too_long", param)
    twice = {"inputs": inputs, "truncate": False, "parameters": {"truncate": False}}
    assert_error(await real_default.client.post("/similarity", json=twice), 422,
                 "invalid_request", "parameters.truncate")
    left = {"inputs": inputs, "parameters": {"truncation_direction": "Left"}}
    assert_error(await real_default.client.post("/similarity", json=left), 422,
                 "invalid_request", "parameters.truncation_direction")


async def test_a_prompt_the_model_lacks_is_refused_as_tei_refuses_it(
        real_default: Served) -> None:
    """Found by a black-box review: all-MiniLM-L6-v2 has no prompts, and a prompt_name gave
    the same vectors as none, where TEI answers with a validation error."""
    similar = {"inputs": {"source_sentence": "a", "sentences": ["b"]}}
    for route, body in (("/embed", {"inputs": "x", "prompt_name": "query"}),
                        ("/embed", {"inputs": "x", "prompt_name": "passage"}),
                        ("/similarity", {**similar, "parameters": {"prompt_name": "query"}}),
                        ("/tokenize", {"inputs": "x", "prompt_name": "query"})):
        place = "parameters.prompt_name" if "parameters" in body else "prompt_name"
        error = assert_error(await real_default.client.post(route, json=body), 422,
                             "invalid_request", place)
        assert "it has no prompts: leave prompt_name out" in error["message"], (route, error)


@pytest.mark.parametrize(("prompts", "name", "refused"), [
    ({"query": "q: ", "document": "p: "}, "passage", None),  # Ember's names of one side
    ({"query": "q: ", "passage": "p: "}, "corpus", None),
    ({"query": "", "document": ""}, "document", None),  # an empty prompt counts, as in TEI
    ({"query": "q: "}, "document", "send query, or leave"),
    ({"document": "p: "}, "query", "send document, passage or corpus, or leave"),
    ({}, "query", "it has no prompts"),
    (None, "query", None),  # a family without prompts: the side alone
])
def test_a_prompt_name_needs_its_side_in_the_models_prompts(
        prompts: dict[str, str] | None, name: str, refused: str | None) -> None:
    from types import SimpleNamespace

    from ember.api.errors import ApiError
    from ember.api.tei import check_prompt

    extra = {} if prompts is None else {"prompts": prompts}
    model = SimpleNamespace(spec=SimpleNamespace(name="m"),
                            adapter=SimpleNamespace(info=SimpleNamespace(extra=extra)))
    if refused is None:
        check_prompt(model, name)  # type: ignore[arg-type]
        return
    with pytest.raises(ApiError) as caught:
        check_prompt(model, name)  # type: ignore[arg-type]
    assert caught.value.param == "prompt_name" and refused in caught.value.message


async def test_tei_rerank(shared: Served) -> None:
    texts = ["first", "second doc", "third one here"]
    response = await shared.client.post("/rerank", json={"query": "q", "texts": texts,
                                                         "return_text": True})
    assert response.status_code == 200, response.text
    results = response.json()
    assert sorted(r["index"] for r in results) == [0, 1, 2]
    scores = [r["score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    adapter = shared.synthetic()
    for result in results:
        assert result["text"] == texts[result["index"]]
        expected = float(adapter.vector("q") @ adapter.vector(texts[result["index"]]))
        assert result["score"] == pytest.approx(expected, abs=1e-6)


async def test_tei_rerank_on_the_real_model(real_default: Served) -> None:
    response = await real_default.client.post("/rerank", json={
        "query": "capital of France",
        "texts": ["Bananas are yellow.", "Paris is the capital of France."]})
    assert response.status_code == 200, response.text
    results = response.json()
    assert results[0]["index"] == 1
    assert "text" not in results[0]


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/embed", {}, "inputs"),
    ("/embed", {"inputs": []}, "inputs"),
    ("/embed", {"inputs": [1, 2]}, None),
    ("/rerank", {"texts": ["a"]}, "query"),
    ("/rerank", {"query": "q", "texts": []}, "texts"),
    # Found by a black-box review: each was ignored with a 200, and a TEI client asking for
    # 100 dimensions got all of them.
    ("/embed", {"inputs": "x", "dimensions": 100}, "dimensions"),
    ("/embed", {"inputs": "x", "prompt_name": "no-such-prompt"}, "prompt_name"),
    ("/embed", {"inputs": "x", "pooling": "cls"}, "pooling"),
    ("/embed", {"inputs": "x", "parameters": {"normalize": False}}, "parameters"),
    ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"], "x": 1}},
     "inputs.x"),
])
async def test_invalid_bodies_are_422_naming_the_field(shared: Served, route: str,
                                                       body: dict[str, object],
                                                       param: str | None) -> None:
    response = await shared.client.post(route, json=body)
    error = assert_error(response, 422, "invalid_request")
    if param is None:
        assert error["param"].startswith("inputs"), error
    else:
        assert error["param"] == param, error


async def test_root_post_embeds_like_tei_for_clients_given_only_the_base_url(
        shared: Served) -> None:
    at_root = await shared.client.post("/", json={"inputs": "one"})
    at_embed = await shared.client.post("/embed", json={"inputs": "one"})
    assert at_root.status_code == 200 and at_root.json() == at_embed.json()


@pytest.mark.parametrize("other", [{"query": "q"}, {"texts": ["a"]}])
async def test_a_root_body_of_two_routes_fields_says_so(shared: Served,
                                                        other: dict[str, object]) -> None:
    """Found by a black-box review: `{inputs, query}` at / was told "unknown field inputs:
    remove it", where inputs is a field of /embed and the body was two routes' at once."""
    response = await shared.client.post("/", json={"inputs": "x", **other})
    error = assert_error(response, 422, "invalid_request", "body")
    assert "both inputs" in error["message"] and next(iter(other)) in error["message"]


@pytest.mark.parametrize("route", ["/embed", "/embed_sparse", "/"])
@pytest.mark.parametrize("ids", [[101, 7592, 102], [[101, 7592, 102], [101, 102]]])
async def test_token_ids_in_inputs_are_refused_as_token_ids(shared: Served, route: str,
                                                            ids: list[object]) -> None:
    """Found by a black-box review: TEI's token-id inputs were told only "expected one of
    str, list[str]"."""
    error = assert_error(await shared.client.post(route, json={"inputs": ids}), 422,
                         "invalid_request", "inputs")
    assert "token ids" in error["message"] and "--token-ids model" in error["message"]


async def test_fields_tei_has_are_taken_when_they_can_be_honoured(shared: Served) -> None:
    dims = shared.synthetic().dims
    for body in ({"inputs": "x", "dimensions": dims}, {"inputs": "x", "prompt_name": "passage"},
                 {"inputs": "x", "parameters": {}}):  # huggingface_hub sends an empty one
        response = await shared.client.post("/embed", json=body)
        assert response.status_code == 200, (body, response.text)
    query = await shared.client.post("/embed", json={"inputs": "x", "prompt_name": "query"})
    assert query.status_code == 200, query.text


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def reranker_default(tmp_path_factory: pytest.TempPathFactory
                           ) -> AsyncIterator[tuple[Served, Path]]:
    """TEI's rerank on a tiny cross-encoder built here, the server's default model."""
    root = tmp_path_factory.mktemp("tei-reranker")
    folder = build_cross_encoder(root / "reranker")
    (root / "reranker.yaml").write_text(f"name: tiny/reranker\nadapter: cross_encoder\n"
                                        f"source: {{path: {folder}}}\ntasks: [score]\n",
                                        encoding="utf-8")
    async with serving(ServerSettings(default_model="tiny/reranker",
                                      model_dirs=(root,))) as served:
        yield served, folder


async def test_raw_scores_are_the_cross_encoders_logits(
        reranker_default: tuple[Served, Path]) -> None:
    """Found by a black-box review: raw_scores was refused, where a cross-encoder has
    logits to give (TEI's meaning)."""
    served, folder = reranker_default
    texts = ["paris is the capital of france", "the dog is big", "rain in london"]
    body = {"query": "capital of france", "texts": texts}
    scored = await served.client.post("/rerank", json=body)
    raw = await served.client.post("/rerank", json={**body, "raw_scores": True})
    assert scored.status_code == raw.status_code == 200, raw.text
    by_index = {r["index"]: r["score"] for r in raw.json()}
    pairs = [(body["query"], text) for text in texts]
    logits = CrossEncoder(str(folder), device="cpu",
                          activation_fn=torch.nn.Identity()).predict(pairs)
    np.testing.assert_allclose([by_index[i] for i in range(3)], logits, atol=1e-5)
    sigmoid = {r["index"]: r["score"] for r in scored.json()}
    np.testing.assert_allclose([sigmoid[i] for i in range(3)],
                               1 / (1 + np.exp(-np.asarray(logits))), atol=1e-5)
    assert [r["index"] for r in raw.json()] == [r["index"] for r in scored.json()]


async def test_raw_scores_of_a_similarity_are_its_scores(shared: Served) -> None:
    body = {"query": "q", "texts": ["a", "b c"]}
    scored = await shared.client.post("/rerank", json=body)
    raw = await shared.client.post("/rerank", json={**body, "raw_scores": True})
    assert scored.status_code == raw.status_code == 200, raw.text
    assert raw.json() == scored.json()
