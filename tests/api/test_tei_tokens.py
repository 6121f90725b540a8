"""TEI's /tokenize, /decode and /embed_sparse on the default model, against the model's own
tokenizer (transformers) and Ember's native route on the same weights."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from transformers import AutoTokenizer

from ember.adapters import transformer
from ember.adapters.base import EncodeOptions, Runtime
from ember.config import ServerSettings
from tests.adapters.tiny_models import build_bi_encoder, build_sparse_encoder, spec_for
from tests.api.conftest import MINILM, AppFactory, Served, assert_error, serving
from tests.hub_standin import minilm_folder

SPARSE = "tiny/sparse"
TEXTS = ["Hello, world!", "héllo wörld 🙂 naïve café", "a"]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def minilm(apps: AppFactory) -> AsyncIterator[Served]:
    async with apps.serve(default_model=MINILM) as served:
        yield served


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def sparse(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Served]:
    """A tiny SPLADE model with a query prompt, the server's default model."""
    root = tmp_path_factory.mktemp("tei-sparse")
    folder = build_sparse_encoder(root / "sparse")
    (root / "sparse.yaml").write_text(
        f"name: {SPARSE}\nadapter: sparse\nsource: {{path: {folder}}}\ntasks: [encode]\n"
        'prompts: {query: "query: "}\n', encoding="utf-8")
    async with serving(ServerSettings(default_model=SPARSE, model_dirs=(root,))) as served:
        yield served


async def post(served: Served, route: str, body: dict[str, Any]) -> Any:
    response = await served.client.post(route, json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def test_tokenize_gives_the_models_tokens_and_their_utf8_places(minilm: Served) -> None:
    reference = AutoTokenizer.from_pretrained(str(minilm_folder()))
    got = await post(minilm, "/tokenize", {"inputs": TEXTS})
    assert len(got) == len(TEXTS)
    for text, tokens in zip(TEXTS, got, strict=True):
        want = reference(text, return_offsets_mapping=True)
        assert [t["id"] for t in tokens] == want["input_ids"]
        assert tokens[0] == {"id": reference.cls_token_id, "text": "[CLS]", "special": True,
                             "start": None, "stop": None}
        raw = text.encode("utf-8")
        for token, (start, stop) in zip(tokens[1:-1], want["offset_mapping"][1:-1],
                                        strict=True):
            assert not token["special"] and token["text"] == text[start:stop] != ""
            # the places count UTF-8 bytes, as TEI's do
            assert raw[token["start"]:token["stop"]].decode("utf-8") == token["text"]
    bare = await post(minilm, "/tokenize", {"inputs": TEXTS[0], "add_special_tokens": False})
    assert [t["id"] for t in bare[0]] == reference(TEXTS[0], add_special_tokens=False)[
        "input_ids"]
    assert not any(t["special"] for t in bare[0])


async def test_decode_is_the_models_decode(minilm: Served) -> None:
    reference = AutoTokenizer.from_pretrained(str(minilm_folder()))
    rows = [reference(text)["input_ids"] for text in TEXTS]
    assert await post(minilm, "/decode", {"ids": rows}) == [
        reference.decode(row, skip_special_tokens=True) for row in rows]
    assert await post(minilm, "/decode", {"ids": rows[0], "skip_special_tokens": False}) == [
        reference.decode(rows[0], skip_special_tokens=False)]


@pytest.mark.parametrize(("ids", "param"), [
    ([101, 7592, -1], "ids[2]"),
    ([[101], [101, 30522]], "ids[1][1]"),
])
async def test_decode_refuses_ids_outside_the_vocabulary(minilm: Served, ids: list[Any],
                                                         param: str) -> None:
    error = assert_error(await minilm.client.post("/decode", json={"ids": ids}), 422,
                         "invalid_request", param)
    assert "outside the model's vocabulary" in error["message"]


@pytest.mark.parametrize("body", [{"ids": [[[1]]]}, {"ids": ["a"]}, {"ids": [True]},
                                  {"ids": [101, 2**70]}])
async def test_decode_refuses_what_is_not_ids(minilm: Served, body: dict[str, Any]) -> None:
    assert_error(await minilm.client.post("/decode", json=body), 422, "invalid_request")


async def test_a_model_without_a_tokenizer_to_show_is_a_422(shared: Served) -> None:
    for route, body in (("/tokenize", {"inputs": "x"}), ("/decode", {"ids": [1]})):
        error = assert_error(await shared.client.post(route, json=body), 422,
                             "invalid_request", "model")
        assert "no tokenizer" in error["message"]


async def test_embed_sparse_is_the_native_sparse_vector(sparse: Served) -> None:
    texts = ["the river and the mountain", "a cup of tea"]
    for prompt, is_query in ((None, False), ("query", True)):
        body: dict[str, Any] = {"inputs": texts}
        if prompt:
            body["prompt_name"] = prompt
        got = await post(sparse, "/embed_sparse", body)
        native = await post(sparse, f"/v1/encode/{SPARSE}", {
            "items": [{"text": t} for t in texts], "params": {"options": {"is_query": is_query}}})
        for weights, item in zip(got, native["items"], strict=True):
            assert [w["index"] for w in weights] == item["sparse"]["indices"]
            assert [w["value"] for w in weights] == pytest.approx(item["sparse"]["values"],
                                                                  abs=1e-6)
    query = await post(sparse, "/embed_sparse", {"inputs": "tea", "prompt_name": "query"})
    document = await post(sparse, "/embed_sparse", {"inputs": "tea"})
    assert query != document  # the prompt went before the text


async def test_only_the_prompts_the_model_has_are_taken(sparse: Served) -> None:
    for route in ("/embed_sparse", "/tokenize"):
        error = assert_error(await sparse.client.post(route, json={
            "inputs": "tea", "prompt_name": "document"}), 422, "invalid_request", "prompt_name")
        assert "has no document prompt" in error["message"] and "send query" in error["message"]


async def test_tokenize_puts_the_prompt_before_the_text(sparse: Served) -> None:
    [plain] = await post(sparse, "/tokenize", {"inputs": "tea", "add_special_tokens": False})
    [prompted] = await post(sparse, "/tokenize", {"inputs": "tea", "prompt_name": "query",
                                                  "add_special_tokens": False})
    assert prompted[-len(plain):] == [{**t, "start": t["start"] + len("query: "),
                                       "stop": t["stop"] + len("query: ")} for t in plain]
    assert "".join(t["text"] for t in prompted[:-len(plain)]) == "query:"


async def test_embed_sparse_on_a_dense_model_is_a_422(minilm: Served) -> None:
    error = assert_error(await minilm.client.post("/embed_sparse", json={"inputs": "x"}), 422,
                         "unsupported_output", "model")
    assert "sparse" in error["message"]


async def test_tokenize_refuses_more_than_it_can_show_at_once(minilm: Served) -> None:
    """Found by a code review: 16 MB of punctuation, a token a character, held the event
    loop for about 100 s."""
    error = assert_error(await minilm.client.post("/tokenize", json={
        "inputs": ["!" * 150_000, "?" * 60_000]}), 422, "invalid_request", "inputs")
    assert "at most 200,000 characters" in error["message"]


async def test_a_lowered_text_is_shown_in_its_own_characters(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """A do_lower_case model reads "İ" as two characters: the tokens still name slices
    of the text sent, at its own bytes (found by a code review)."""
    folder = build_bi_encoder(tmp_path_factory.mktemp("lowered") / "bi")
    adapter = transformer.load(spec_for(folder, "transformer", ("encode",)), Runtime())
    adapter.lower_case = True
    text = "İstanbul and Ünye"
    [spans] = await adapter.token_spans([text], False, EncodeOptions())
    raw = text.encode("utf-8")
    assert "".join(s["text"] for s in spans).replace(" ", "") == text.replace(" ", "")
    for span in spans:
        assert raw[span["start"]:span["stop"]].decode("utf-8") == span["text"]
