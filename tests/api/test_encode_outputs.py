"""Issue 7 over HTTP: sparse and multi-vector outputs, output dtypes, query/document sides."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgpack
import msgpack_numpy
import numpy as np
import pytest
import pytest_asyncio

from ember.config import ServerSettings
from tests.adapters.tiny_models import (
    build_bi_encoder,
    build_colbert,
    build_m3,
    build_sparse_encoder,
    vocabulary,
)
from tests.api.conftest import MINILM, SYNTH, Served, assert_error, serving
from tests.client_outputs import dequantize_int8, hamming

pytestmark = pytest.mark.asyncio(loop_scope="session")

SPARSE, COLBERT, PROMPTED, M3 = "tiny/sparse", "tiny/colbert", "tiny/prompted", "tiny/m3"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def tiny(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Served]:
    """An app serving tiny sparse, multi-vector and prompted models built here."""
    root = tmp_path_factory.mktemp("tiny-outputs")
    yamls = root / "yaml"
    yamls.mkdir()
    builds = {SPARSE: ("sparse", build_sparse_encoder(root / "sparse"), ""),
              COLBERT: ("multivector", build_colbert(root / "colbert"), ""),
              PROMPTED: ("transformer", build_bi_encoder(root / "prompted"),
                         'prompts: {query: "query: ", document: "passage: "}\n'),
              M3: ("m3", build_m3(root / "m3"), "allow_pickle: true\n")}
    for name, (adapter, path, extra) in builds.items():
        (yamls / f"{name.split('/')[1]}.yaml").write_text(
            f"name: {name}\nadapter: {adapter}\nsource: {{path: {path}}}\n"
            f"tasks: [encode, score]\n{extra}", encoding="utf-8")
    settings = ServerSettings(default_model=SYNTH, model_dirs=(yamls,))
    async with serving(settings) as served:
        yield served


async def encode(served: Served, model: str, texts: list[str], **params: Any) -> Any:
    body = {"items": [{"text": t} for t in texts], "params": params}
    return await served.client.post(f"/v1/encode/{model}", json=body)


async def test_sparse_output_in_the_native_wire_shape(tiny: Served) -> None:
    response = await encode(tiny, SPARSE, ["hello world", "a much longer text " * 5])
    assert response.status_code == 200
    assert len(response.json()["items"]) == 2
    for item in response.json()["items"]:
        sparse = item["sparse"]
        assert set(sparse) == {"dims", "dtype", "indices", "values"}
        assert sparse["dtype"] == "float32" and sparse["indices"] == sorted(set(sparse["indices"]))
        assert all(v > 0 for v in sparse["values"]) and max(sparse["indices"]) < sparse["dims"]


async def test_multivector_output_in_the_native_wire_shape(tiny: Served) -> None:
    response = await encode(tiny, COLBERT, ["hello world"])
    multi = response.json()["items"][0]["multivector"]
    assert set(multi) == {"token_dims", "num_tokens", "dtype", "values"}
    values = np.array(multi["values"], dtype=np.float32)
    assert values.shape == (multi["num_tokens"], multi["token_dims"])
    assert np.allclose(np.linalg.norm(values, axis=1), 1.0, atol=1e-5)


async def test_an_m3_model_answers_the_outputs_asked_for_from_one_forward(
        tiny: Served) -> None:
    texts = ["hello world", "the cat and the dog"]
    both = await encode(tiny, M3, texts, output_types=["dense", "sparse", "multivector"])
    assert both.status_code == 200, both.text
    for item in both.json()["items"]:
        assert set(item) == {"dense", "sparse", "multivector"}
        assert item["dense"]["dims"] == 32
        assert item["sparse"]["indices"] == sorted(set(item["sparse"]["indices"]))
        assert item["multivector"]["token_dims"] == 16
    plain = (await encode(tiny, M3, texts)).json()["items"]
    assert all(set(item) == {"dense"} for item in plain)
    np.testing.assert_allclose([i["dense"]["values"] for i in plain],
                               [i["dense"]["values"] for i in both.json()["items"]], atol=1e-6)
    bits = await encode(tiny, M3, texts, output_types=["sparse"], output_dtype="binary")
    assert_error(bits, 422, "invalid_request", "params.output_dtype")
    listed = (await tiny.client.get(f"/v1/models/{M3}")).json()
    assert listed["output_types"] == ["dense", "sparse", "multivector"]
    assert listed["dims"] == {"dense": 32, "sparse": len(vocabulary()), "multivector": 16}
    scored = await tiny.client.post(f"/v1/score/{M3}", json={
        "query": {"text": "hello"}, "items": [{"text": t} for t in texts]})
    assert scored.status_code == 200 and len(scored.json()["scores"]) == 2


async def test_an_m3_models_weights_per_request_and_its_shortened_vectors(
        tiny: Served) -> None:
    texts = ["hello world", "the cat and the dog", "hello cat"]
    pairs = {"query": {"text": "hello cat"}, "items": [{"text": t} for t in texts]}

    async def score(model: str, options: dict[str, Any], where: str) -> httpx.Response:
        body = {**pairs, "options": options} if where == "top" else \
            {**pairs, "params": {"options": options}}
        return await tiny.client.post(f"/v1/score/{model}", json=body)

    def by_item(response: httpx.Response) -> list[float]:
        assert response.status_code == 200, response.text
        return [s["score"] for s in sorted(response.json()["scores"],
                                           key=lambda s: int(s["item_id"]))]

    dense = by_item(await score(M3, {}, "params"))
    sparse = by_item(await score(M3, {"score_weights": {"sparse": 1.0}}, "top"))
    mixed = by_item(await score(M3, {"score_weights": {"dense": 1, "sparse": 1}}, "params"))
    assert sparse != dense
    np.testing.assert_allclose(mixed, (np.array(dense) + np.array(sparse)) / 2, atol=1e-6)
    for where, param in (("params", "params.options.score_weights"),
                         ("top", "options.score_weights")):
        bad = await score(M3, {"score_weights": {"dense": -1}}, where)
        assert "finite weights >= 0" in assert_error(bad, 422, "invalid_request", param)[
            "message"]
        as_text = await score(M3, {"score_weights": {"dense": "0.5"}}, where)
        assert_error(as_text, 422, "invalid_request", f"{param}.dense")
        other = await score(COLBERT, {"score_weights": {"dense": 1}}, where)
        assert "scores by one output" in assert_error(other, 422, "invalid_request", param)[
            "message"]
    # Refused from the catalog entry, before a load (offline, its files not here: a 404).
    cold = await score("BAAI/bge-base-en-v1.5", {"score_weights": {"dense": 1}}, "params")
    assert "scores by one output" in assert_error(
        cold, 422, "invalid_request", "params.options.score_weights")["message"]
    # NaN, which only msgpack carries.
    nan = await tiny.client.post(f"/v1/score/{M3}", content=msgpack.packb(
        {**pairs, "options": {"score_weights": {"dense": float("nan")}}}),
        headers={"content-type": "application/msgpack"})
    assert "finite weights >= 0" in assert_error(nan, 422, "invalid_request",
                                                 "options.score_weights")["message"]
    # OpenAI's dimensions: BGE-M3's dense vectors are unit, and so are their shortened ones.
    short = await tiny.client.post("/v1/embeddings", json={"model": M3, "input": texts,
                                                           "dimensions": 8})
    assert short.status_code == 200, short.text
    got = np.array([row["embedding"] for row in short.json()["data"]])
    assert got.shape == (3, 8)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


async def test_msgpack_carries_sparse_and_multivector_as_numpy(tiny: Served) -> None:
    for model, key in ((SPARSE, "sparse"), (COLBERT, "multivector")):
        response = await tiny.client.post(
            f"/v1/encode/{model}", json={"items": [{"text": "hello"}]},
            headers={"accept": "application/msgpack"})
        body = msgpack.unpackb(response.content, object_hook=msgpack_numpy.decode)
        assert isinstance(body["items"][0][key]["values"], np.ndarray)


async def test_int8_round_trip_on_the_default_model(shared: Served) -> None:
    texts = ["the cat sat on the mat", "stock markets fell sharply", "a recipe for bread"]
    floats = (await encode(shared, MINILM, texts)).json()["items"]
    ints = (await encode(shared, MINILM, texts, output_dtype="int8")).json()["items"]
    for f, q in zip(floats, ints, strict=True):
        assert q["dense"]["dtype"] == "int8" and q["dense"]["dims"] == 384
        restored = dequantize_int8(np.array(q["dense"]["values"], dtype=np.int8),
                                   q["dense"]["scale"])
        original = np.array(f["dense"]["values"], dtype=np.float32)
        cosine = restored @ original / (np.linalg.norm(restored) * np.linalg.norm(original))
        assert cosine >= 0.99


async def test_binary_hamming_ranks_the_obvious_neighbour_first(shared: Served) -> None:
    query = "How do I bake sourdough bread at home?"
    docs = ["Baking sourdough bread at home: a starter, flour, water and salt.",
            "The central bank raised interest rates by a quarter point.",
            "The football match ended in a goalless draw."]
    response = await encode(shared, MINILM, [query, *docs], output_dtype="binary")
    dense = [item["dense"] for item in response.json()["items"]]
    assert all(d["dtype"] == "binary" and d["dims"] == 384 for d in dense)
    packed = [np.array(d["values"], dtype=np.uint8) for d in dense]
    assert packed[0].shape == (48,)
    distances = [hamming(packed[0], p) for p in packed[1:]]
    assert distances.index(min(distances)) == 0


async def test_float16_halves_and_stays_close(shared: Served) -> None:
    f32 = (await encode(shared, MINILM, ["hello"])).json()["items"][0]["dense"]["values"]
    f16 = (await encode(shared, MINILM, ["hello"], output_dtype="float16")).json()
    values = f16["items"][0]["dense"]["values"]
    assert np.max(np.abs(np.array(values) - np.array(f32))) < 1e-3


@pytest.mark.parametrize(("model", "params", "param", "kind", "words"), [
    (MINILM, {"output_dtype": "int4"}, "params.output_dtype", "invalid_request", "float32"),
    (MINILM, {"output_types": ["sparse"]}, "params.output_types", "unsupported_output",
     "dense"),
    (SPARSE, {"output_types": ["dense"]}, "params.output_types", "unsupported_output",
     "sparse"),
    (SPARSE, {"output_dtype": "binary"}, "params.output_dtype", "invalid_request", "int8"),
    (MINILM, {"instruction": "Represent this"}, "params.instruction", "invalid_request",
     "no prompts"),
])
async def test_what_a_model_cannot_produce_is_a_422_saying_what_it_can(
        shared: Served, tiny: Served, model: str, params: dict[str, Any], param: str,
        kind: str, words: str) -> None:
    served = tiny if model.startswith("tiny/") else shared
    response = await encode(served, model, ["hello"], **params)
    error = assert_error(response, 422, kind, param)
    assert words in error["message"]


async def test_query_and_document_sides_apply_the_models_prompts(tiny: Served) -> None:
    query = (await encode(tiny, PROMPTED, ["cats"], is_query=True)).json()
    document = (await encode(tiny, PROMPTED, ["cats"])).json()
    q_vec = query["items"][0]["dense"]["values"]
    d_vec = document["items"][0]["dense"]["values"]
    assert not np.allclose(q_vec, d_vec)
    openai = await tiny.client.post("/v1/embeddings", json={"model": PROMPTED, "input": "cats"})
    assert np.allclose(openai.json()["data"][0]["embedding"], d_vec, atol=1e-6)


async def test_models_report_outputs_dims_and_dtypes(tiny: Served) -> None:
    await encode(tiny, SPARSE, ["x"])
    models = {m["id"]: m for m in (await tiny.client.get("/v1/models")).json()["data"]}
    assert models[SPARSE]["output_types"] == ["sparse"] and models[SPARSE]["dims"] > 0
    assert models[COLBERT]["output_types"] == ["multivector"]
    assert models[COLBERT]["output_dtypes"] == ["float32", "float16", "int8", "uint8",
                                                "binary", "ubinary"]
    assert models["spacy/en_core_web_sm"]["output_types"] == []


@pytest.mark.parametrize("route, body", [
    ("/v1/embeddings", {"model": SPARSE, "input": ["x"]}),
    ("/v2/embed", {"model": SPARSE, "texts": ["x"], "input_type": "search_document"}),
    ("/v1/embeddings", {"model": COLBERT, "input": "x"}),
])
async def test_dense_only_routes_refuse_other_outputs_clearly(tiny: Served, route: str,
                                                              body: dict[str, Any]) -> None:
    error = assert_error(await tiny.client.post(route, json=body), 422, "unsupported_output",
                         "model")
    assert f"/v1/encode/{body['model']}" in error["message"]


async def test_uint8_is_int8_shifted(tiny: Served) -> None:
    signed = (await encode(tiny, PROMPTED, ["x"], output_dtype="int8")).json()["items"][0]
    unsigned = (await encode(tiny, PROMPTED, ["x"], output_dtype="uint8")).json()["items"][0]
    assert unsigned["dense"]["scale"] == signed["dense"]["scale"]
    np.testing.assert_array_equal(np.array(unsigned["dense"]["values"]) - 128,
                                  signed["dense"]["values"])
    packed = (await encode(tiny, PROMPTED, ["x"], output_dtype="ubinary")).json()["items"][0]
    binary = (await encode(tiny, PROMPTED, ["x"], output_dtype="binary")).json()["items"][0]
    assert packed["dense"]["values"] == binary["dense"]["values"]


async def test_is_query_under_options_is_the_query_side(tiny: Served) -> None:
    under_options = await encode(tiny, PROMPTED, ["x"], options={"is_query": True})
    under_params = await encode(tiny, PROMPTED, ["x"], is_query=True)
    document = await encode(tiny, PROMPTED, ["x"])
    got = under_options.json()["items"][0]["dense"]["values"]
    assert got == under_params.json()["items"][0]["dense"]["values"]
    assert got != document.json()["items"][0]["dense"]["values"]
    clash = await encode(tiny, PROMPTED, ["x"], is_query=True, options={"is_query": False})
    assert_error(clash, 422, "invalid_request", "params.options.is_query")


async def test_dimensions_on_the_native_route_match_the_openai_routes_shortened_vectors(
        shared: Served, tiny: Served) -> None:
    # MiniLM normalizes: its first 96 components, unit again, as /v1/embeddings cuts them
    # (that route's own test checks it against sentence-transformers' truncate_dim).
    texts = ["hello world", "a second, longer sentence about search"]
    native = await encode(shared, MINILM, texts, dimensions=96)
    assert native.status_code == 200, native.text
    dense = [item["dense"] for item in native.json()["items"]]
    assert [d["dims"] for d in dense] == [96, 96]
    openai = await shared.client.post("/v1/embeddings", json={"model": MINILM, "input": texts,
                                                              "dimensions": 96})
    np.testing.assert_allclose([d["values"] for d in dense],
                               [row["embedding"] for row in openai.json()["data"]], atol=1e-6)
    whole = (await encode(shared, MINILM, texts)).json()["items"]
    assert all(len(item["dense"]["values"]) == 384 for item in whole)
    # Unit again where the request normalizes; the plain cut where it does not.
    raw = await encode(tiny, PROMPTED, ["x"], options={"normalize": False})
    cut = await encode(tiny, PROMPTED, ["x"], dimensions=4, options={"normalize": False})
    assert cut.json()["items"][0]["dense"]["values"] == pytest.approx(
        raw.json()["items"][0]["dense"]["values"][:4], abs=1e-6)
    unit = await encode(tiny, PROMPTED, ["x"], dimensions=4, options={"normalize": True})
    assert np.linalg.norm(unit.json()["items"][0]["dense"]["values"]) == pytest.approx(1.0)
    # BGE-M3's dense vectors are cut beside its other outputs, which stay whole; int8
    # scales the shortened vector.
    both = await encode(tiny, M3, ["hello cat"], dimensions=8,
                        output_types=["dense", "sparse"], output_dtype="int8")
    item = both.json()["items"][0]
    assert item["dense"]["dims"] == 8 and len(item["dense"]["values"]) == 8
    assert max(abs(v) for v in item["dense"]["values"]) == 127
    assert item["sparse"]["values"]


@pytest.mark.parametrize(("model", "params", "words"), [
    (MINILM, {"dimensions": 0}, "send 1 to 384"),
    (MINILM, {"dimensions": 385}, "send 1 to 384"),
    (MINILM, {"dimensions": 2**63 - 1}, "send 1 to 384"),
    (MINILM, {"dimensions": "8"}, "valid integer"),
    (MINILM, {"dimensions": 8.0}, "valid integer"),
    (SPARSE, {"dimensions": 8}, "gets sparse from 'tiny/sparse'"),
    (M3, {"dimensions": 8, "output_types": ["sparse"]}, "ask for dense"),
])
async def test_native_dimensions_that_cannot_apply_are_a_422_naming_the_field(
        shared: Served, tiny: Served, model: str, params: dict[str, Any],
        words: str) -> None:
    served = tiny if model.startswith("tiny/") else shared
    error = assert_error(await encode(served, model, ["x"], **params), 422,
                         "invalid_request", "params.dimensions")
    assert words in error["message"], error
