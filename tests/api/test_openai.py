"""OpenAI-compatible /v1/embeddings, through raw HTTP and through the `openai` SDK."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator

import httpx2  # the openai SDK's HTTP client
import numpy as np
import openai
import pytest
import pytest_asyncio
from sentence_transformers import SentenceTransformer

from ember.config import load_catalog, resolve_source
from tests.api.conftest import MINILM, SYNTH, Served, assert_error, encode_body, vectors


@pytest_asyncio.fixture(loop_scope="session")
async def sdk(shared: Served) -> AsyncIterator[openai.AsyncOpenAI]:
    """The real SDK, its HTTP client on the app's ASGI transport."""
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=shared.app))
    client = openai.AsyncOpenAI(base_url="http://localhost/v1", api_key="unused", max_retries=0,
                                http_client=http)
    yield client
    await client.close()


async def native_vectors(served: Served, model: str, texts: list[str]) -> np.ndarray:
    response = await served.client.post(f"/v1/encode/{model}", json=encode_body(*texts))
    assert response.status_code == 200, response.text
    return np.array(vectors(response.json()), dtype=np.float32)


async def test_float_embeddings_match_the_native_route(shared: Served) -> None:
    texts = ["hello world", "a second, longer sentence about search"]
    response = await shared.client.post("/v1/embeddings", json={
        "model": MINILM, "input": texts, "encoding_format": "float"})
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["object"] == "list" and data["model"] == MINILM
    assert [d["index"] for d in data["data"]] == [0, 1]
    assert all(d["object"] == "embedding" for d in data["data"])
    got = np.array([d["embedding"] for d in data["data"]], dtype=np.float32)
    np.testing.assert_allclose(got, await native_vectors(shared, MINILM, texts), atol=1e-6)
    usage = data["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > len(texts)


async def test_a_long_input_is_cut_or_with_truncate_false_refused(shared: Served) -> None:
    """Found by a black-box review: OpenAI refuses an input over the model's limit, and
    Ember cut it with no way to ask otherwise."""
    texts = ["short", "word " * 600]
    cut = await shared.client.post("/v1/embeddings", json={"model": MINILM, "input": texts})
    assert cut.status_code == 200, cut.text
    assert cut.json()["usage"]["prompt_tokens"] <= 256 + 3  # the long one cut at 256
    error = assert_error(await shared.client.post("/v1/embeddings", json={
        "model": MINILM, "input": texts, "truncate": False}), 400, "input_too_long", "input[1]")
    assert "256" in error["message"]


async def test_base64_embeddings_are_little_endian_float32(shared: Served) -> None:
    response = await shared.client.post("/v1/embeddings", json={
        "model": SYNTH, "input": "just one", "encoding_format": "base64"})
    assert response.status_code == 200, response.text
    [entry] = response.json()["data"]
    decoded = np.frombuffer(base64.b64decode(entry["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, shared.synthetic().vector("just one"))


async def test_model_defaults_to_the_servers_default(shared: Served) -> None:
    response = await shared.client.post("/v1/embeddings", json={"input": "x"})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == shared.settings.default_model == SYNTH


async def test_dimensions_keep_the_first_components_as_sentence_transformers_does(
        shared: Served, sdk: openai.AsyncOpenAI) -> None:
    # A Matryoshka model's smaller embedding: the first 128 of MiniLM's 384, unit again
    # (the model normalizes), sent and read by the real SDK.
    texts = ["hello world", "a second, longer sentence about search"]
    response = await sdk.embeddings.create(model=MINILM, input=texts, dimensions=128)
    got = np.array([entry.embedding for entry in response.data], dtype=np.float32)
    folder = resolve_source(load_catalog()[MINILM])
    expected = SentenceTransformer(str(folder), device="cpu").encode(
        texts, truncate_dim=128, normalize_embeddings=True)
    assert got.shape == (2, 128)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    whole = await sdk.embeddings.create(model=MINILM, input=texts, dimensions=384)
    np.testing.assert_allclose([entry.embedding for entry in whole.data],
                               await native_vectors(shared, MINILM, texts), atol=1e-6)


@pytest.mark.parametrize("dims", [0, -1, True, 8.0, "8"])
async def test_dimensions_outside_the_models_size_or_not_an_integer_are_422(
        shared: Served, dims: object) -> None:
    response = await shared.client.post("/v1/embeddings", json={"model": SYNTH, "input": "x",
                                                                "dimensions": dims})
    error = assert_error(response, 422, "invalid_request", "dimensions")
    if isinstance(dims, int) and not isinstance(dims, bool):
        assert "send 1 to 64" in error["message"], error
    else:
        assert "valid integer" in error["message"], error


@pytest.mark.parametrize(("body", "param"), [
    ({"model": SYNTH}, "input"),
    ({"model": SYNTH, "input": []}, "input"),
    ({"model": SYNTH, "input": 3}, None),
    ({"model": SYNTH, "input": "x", "encoding_format": "int8"}, "encoding_format"),
])
async def test_invalid_bodies_are_422_naming_the_field(shared: Served, body: dict[str, object],
                                                       param: str | None) -> None:
    response = await shared.client.post("/v1/embeddings", json=body)
    error = assert_error(response, 422, "invalid_request")
    if param is None:
        assert error["param"].startswith("input"), error
    else:
        assert error["param"] == param, error


async def test_unknown_model_is_404_listing_the_catalog(shared: Served) -> None:
    response = await shared.client.post("/v1/embeddings", json={"model": "nope/none",
                                                                "input": "x"})
    error = assert_error(response, 404, "model_not_found", "model")
    assert "nope/none" in error["message"]
    assert MINILM in error["message"] and SYNTH in error["message"]


# -- the openai SDK, in process ---------------------------------------------------------------


async def test_sdk_default_call_decodes_to_the_native_vector(shared: Served,
                                                             sdk: openai.AsyncOpenAI) -> None:
    """Without encoding_format the SDK asks for base64 and decodes it itself."""
    texts = ["the SDK path", "and another"]
    result = await sdk.embeddings.create(model=MINILM, input=texts)
    got = np.array([d.embedding for d in result.data], dtype=np.float32)
    np.testing.assert_allclose(got, await native_vectors(shared, MINILM, texts), atol=1e-6)
    assert result.usage.prompt_tokens > 0
    assert result.model == MINILM


async def test_sdk_float_and_explicit_base64(shared: Served, sdk: openai.AsyncOpenAI) -> None:
    floats = await sdk.embeddings.create(model=SYNTH, input=["x y"], encoding_format="float")
    raw = await sdk.embeddings.create(model=SYNTH, input=["x y"], encoding_format="base64")
    expected = shared.synthetic().vector("x y")
    np.testing.assert_allclose(floats.data[0].embedding, expected, atol=1e-6)
    encoded = raw.data[0].embedding
    assert isinstance(encoded, str)
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(encoded), "<f4"), expected)


async def test_sdk_sees_a_404_as_not_found(sdk: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await sdk.embeddings.create(model="missing/model", input=["x"])
    assert caught.value.status_code == 404
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "model_not_found"


@pytest.mark.parametrize("value", [None, [["a"]], [True], ["a", 1], 5])
async def test_an_input_of_no_accepted_form_names_the_field_and_the_forms(
        shared: Served, value: object) -> None:
    """Found by a black-box review: the error named pydantic's union branch as the field
    (`input.str: Input should be a valid string`)."""
    response = await shared.client.post("/v1/embeddings", json={"input": value})
    error = assert_error(response, 422, "invalid_request", "input")
    assert error["message"] == "input: expected one of str, list[str], list[int], list[list[int]]"


@pytest.mark.parametrize(("value", "where", "advice"), [
    ([{"text": "a"}, {"image": "data:image/png;base64,AAAA"}], "input[1]", "/v2/embed"),
    ({"image": "https://example.com/cat.png"}, "input", "/v1/encode/"),
    (["a", {"text": "b"}], "input[1]", "send each text as a string"),
])
async def test_jina_style_objects_are_told_what_to_send(shared: Served, value: object,
                                                        where: str, advice: str) -> None:
    """Found by a black-box review: Jina's `{"image": ...}` objects got the union's forms."""
    response = await shared.client.post("/v1/embeddings", json={"model": SYNTH, "input": value})
    error = assert_error(response, 422, "invalid_request", where)
    assert error["message"].startswith(f"{where} is an object"), error
    assert advice in error["message"], error


@pytest.mark.parametrize(("route", "body"), [("/v1/embeddings", {"input": "a"}),
                                             ("/v1/rerank", {"query": "q", "documents": ["a"]})])
async def test_a_model_left_out_is_the_default_and_a_null_or_empty_one_is_refused(
        shared: Served, route: str, body: dict[str, object]) -> None:
    """Found by a black-box review: the schema said `model` may be null, where a null (or
    empty) name is refused as a client bug; the schema now says a string."""
    omitted = await shared.client.post(route, json=body)
    assert omitted.status_code == 200 and omitted.json()["model"] == SYNTH, omitted.text
    for name in (None, "", " "):
        assert_error(await shared.client.post(route, json={**body, "model": name}), 422,
                     "invalid_request", "model")
    schema = (await shared.client.get("/openapi.json")).json()["components"]["schemas"]
    for request in ("EmbeddingsRequest", "RerankRequest"):
        assert schema[request]["properties"]["model"]["type"] == "string"
