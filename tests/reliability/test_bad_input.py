"""Hand-made hostile input against a real `ember serve` process: every refusal is a 4xx
with the documented error body (no stack trace, no internal path), every edge case that is
valid is served, and the server stays healthy throughout.

The default model is the synthetic TEST model (fast, no weights); the real
all-MiniLM-L6-v2 and spaCy models answer the cases that need a tokenizer, LoRAs or labels.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import msgpack
import pytest

from tests.reliability.support import (
    MINILM,
    SPACY,
    SYNTH,
    Record,
    ServerPool,
    ServerProcess,
    assert_error,
    dense,
    encode_body,
)

BODY_LIMIT = 1_000_000  # the input server's --max-body-bytes
JSON = "application/json"
MSGPACK = "application/msgpack"


@dataclass(frozen=True)
class Bad:
    """One hostile request and the refusal it must get."""

    id: str
    path: str
    body: Any = None  # sent as JSON unless `raw` is set
    raw: bytes | None = None
    content_type: str = JSON
    status: tuple[int, ...] = (422,)
    kind: str | None = "invalid_request"
    param: str | None = None

    def content(self) -> bytes:
        return self.raw if self.raw is not None else json.dumps(self.body).encode()


ENC = f"/v1/encode/{SYNTH}"
ENC_MINILM = f"/v1/encode/{MINILM}"
ONE = {"items": [{"text": "hello"}]}
DEEP = 10_000

CASES = [
    # empty items, on every route that takes a list
    Bad("empty-items-encode", ENC, {"items": []}, param="items"),
    Bad("empty-items-score", f"/v1/score/{SYNTH}", {"query": {"text": "q"}, "items": []},
        param="items"),
    Bad("empty-items-extract", f"/v1/extract/{SPACY}", {"items": []}, param="items"),
    Bad("empty-input-openai", "/v1/embeddings", {"input": []}, param="input"),
    Bad("empty-documents-rerank", "/v1/rerank", {"query": "q", "documents": []},
        param="documents"),
    Bad("empty-inputs-tei-embed", "/embed", {"inputs": []}, param="inputs"),
    Bad("empty-texts-tei-rerank", "/rerank", {"query": "q", "texts": []}, param="texts"),
    # 10k items: over the 512 per request
    Bad("10k-items-encode", ENC, {"items": [{"text": "x"}] * 10_000}, status=(413,),
        kind="payload_too_large", param="items"),
    Bad("10k-items-openai", "/v1/embeddings", {"input": ["x"] * 10_000}, status=(413,),
        kind="payload_too_large", param="input"),
    Bad("10k-documents-rerank", "/v1/rerank", {"query": "q", "documents": ["x"] * 10_000},
        status=(413,), kind="payload_too_large", param="documents"),
    # deeply nested JSON
    Bad("deep-json-items", ENC, raw=b'{"items": ' + b"[" * DEEP + b"]" * DEEP + b"}",
        param="body"),
    Bad("deep-json-bare", ENC, raw=b"[" * 200_000 + b"]" * 200_000, param="body"),
    Bad("deep-json-objects", ENC, raw=b'{"a":' * DEEP + b"1" + b"}" * DEEP, param="body"),
    # invalid UTF-8, not JSON, not Unicode
    Bad("invalid-utf8", ENC, raw=b'{"items": [{"text": "\xff\xfe\xc3"}]}', param="body"),
    Bad("not-json", ENC, raw=b"items=hello", param="body"),
    Bad("truncated-json", ENC, raw=b'{"items": [{"text": "hel', param="body"),
    Bad("lone-surrogate-encode", ENC, raw=b'{"items": [{"text": "a\\ud800"}]}',
        param="items[0].text"),
    Bad("lone-surrogate-minilm", ENC_MINILM, raw=b'{"items": [{"text": "\\udfff b"}]}',
        param="items[0].text"),
    Bad("lone-surrogate-query", f"/v1/score/{SYNTH}",
        raw=b'{"query": {"text": "\\ud800"}, "items": [{"text": "a"}]}', param="query.text"),
    Bad("lone-surrogate-openai", "/v1/embeddings", raw=b'{"input": ["ok", "\\ud83d"]}',
        param="input[1]"),
    # ... in any other field, where it failed writing the answer after the forward (500)
    Bad("lone-surrogate-id", ENC, raw=b'{"items": [{"id": "\\ud800", "text": "a"}]}',
        param="items[0].id"),
    Bad("lone-surrogate-id-score", f"/v1/score/{SYNTH}",
        raw=b'{"query": {"text": "q"}, "items": [{"id": "ok", "text": "b"}, '
            b'{"id": "\\udfff", "text": "a"}]}',
        param="items[1].id"),
    Bad("lone-surrogate-label", f"/v1/extract/{SPACY}",
        raw=b'{"items": [{"text": "Obama"}], "params": {"labels": ["person", "\\ud800"]}}',
        param="params.labels[1]"),
    Bad("lone-surrogate-key", ENC, raw=b'{"items": [{"text": "a", "\\ud800": 1}]}',
        param="items[0]"),
    # wrong types
    Bad("items-a-string", ENC, {"items": "abc"}, param="items"),
    Bad("text-a-number", ENC, {"items": [{"text": 5}]}, param="items[0].text"),
    Bad("text-missing", ENC, {"items": [{"id": "a"}]}, param="items[0].text"),
    Bad("body-a-list", ENC, [1, 2, 3], param="body"),
    Bad("body-null", ENC, None, param="body"),
    Bad("is-query-not-bool", ENC, {**ONE, "params": {"is_query": "maybe"}},
        param="params.is_query"),
    Bad("output-types-a-string", ENC, {**ONE, "params": {"output_types": "dense"}},
        param="params.output_types"),
    Bad("options-a-list", ENC, {**ONE, "params": {"options": [1]}}, param="params.options"),
    Bad("query-a-string", f"/v1/score/{SYNTH}", {"query": "q", "items": [{"text": "a"}]},
        param="query"),
    Bad("input-an-object", "/v1/embeddings", {"input": {"a": 1}}),
    Bad("input-numbers", "/v1/embeddings", {"input": [1, 2, 3]}),
    Bad("encoding-format-unknown", "/v1/embeddings", {"input": "a", "encoding_format": "hex"},
        param="encoding_format"),
    Bad("documents-numbers", "/v1/rerank", {"query": "q", "documents": [5]}),
    Bad("top-n-zero", "/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0},
        param="top_n"),
    Bad("top-n-string", "/v1/rerank", {"query": "q", "documents": ["a"], "top_n": "x"},
        param="top_n"),
    # Found by a black-box review: true read as 1.0, "0.3" as 0.3; an empty label list
    # on spaCy found nothing in every item, where GLiNER refuses it.
    Bad("threshold-a-bool", f"/v1/extract/{SPACY}", {**ONE, "params": {"threshold": True}},
        param="params.threshold"),
    Bad("threshold-text", f"/v1/extract/{SPACY}", {**ONE, "params": {"threshold": "0.3"}},
        param="params.threshold"),
    Bad("labels-empty", f"/v1/extract/{SPACY}", {**ONE, "params": {"labels": []}},
        param="params.labels"),
    Bad("labels-a-string", f"/v1/extract/{SPACY}", {**ONE, "params": {"labels": "PERSON"}},
        param="params.labels"),
    # NaN and infinities (Python's JSON reader accepts them; the schema must not)
    Bad("nan-text", ENC, raw=b'{"items": [{"text": NaN}]}', param="items[0].text"),
    Bad("nan-dimensions", "/v1/embeddings", raw=b'{"input": "a", "dimensions": NaN}',
        param="dimensions"),
    Bad("infinity-top-n", "/v1/rerank", raw=b'{"query": "q", "documents": ["a"], '
        b'"top_n": Infinity}', param="top_n"),
    Bad("nan-is-query", ENC, raw=b'{"items": [{"text": "a"}], "params": {"is_query": NaN}}',
        param="params.is_query"),
    # a body over the byte limit (declared length)
    Bad("body-over-limit", ENC, encode_body("x" * (BODY_LIMIT + 10)), status=(413,),
        kind="payload_too_large", param="body"),
    Bad("msgpack-over-limit", ENC, raw=msgpack.packb(encode_body("x" * (BODY_LIMIT + 10))),
        content_type=MSGPACK, status=(413,), kind="payload_too_large", param="body"),
    # msgpack that does not decode
    Bad("truncated-msgpack", ENC, raw=msgpack.packb(encode_body("hello", "world"))[:-4],
        content_type=MSGPACK, param="body"),
    Bad("msgpack-garbage", ENC, raw=b"\xc1\xc1\xc1", content_type=MSGPACK, param="body"),
    Bad("msgpack-invalid-utf8", ENC, raw=b"\x81\xa5items\x91\x81\xa4text\xa2\xff\xfe",
        content_type=MSGPACK, param="body"),
    Bad("msgpack-deep", ENC, raw=b"\x91" * 200_000 + b"\xc0", content_type=MSGPACK,
        status=(413, 422), kind=None),
    Bad("msgpack-wrong-type", ENC, raw=msgpack.packb({"items": 7}), content_type=MSGPACK,
        param="items"),
    # unknown names
    Bad("unknown-model", "/v1/encode/no/such-model", ONE, status=(404,),
        kind="model_not_found", param="model"),
    Bad("unknown-model-openai", "/v1/embeddings", {"input": "a", "model": "no/such"},
        status=(404,), kind="model_not_found", param="model"),
    Bad("unknown-lora-synthetic", ENC, {**ONE, "params": {"options": {"lora": "nope"}}},
        param="params.options.lora"),
    Bad("unknown-lora-minilm", ENC_MINILM, {**ONE, "params": {"options": {"lora": "nope"}}},
        param="params.options.lora"),
    Bad("unknown-lora-minilm-score", f"/v1/score/{MINILM}",
        {"query": {"text": "q"}, "items": [{"text": "a"}],
         "params": {"options": {"lora": "nope"}}}, param="params.options.lora"),
    # Score weights: nested or a bool where a number goes, and on a model that scores by one
    # output, through msgpack (an M3 model's NaN: tests/api/test_encode_outputs.py).
    Bad("score-weights-nested", f"/v1/score/{MINILM}",
        {"query": {"text": "q"}, "items": [{"text": "a"}],
         "params": {"options": {"score_weights": {"dense": {"dense": [1.0] * 50}}}}},
        param="params.options.score_weights.dense"),
    Bad("score-weights-a-bool", f"/v1/score/{MINILM}",
        {"query": {"text": "q"}, "items": [{"text": "a"}],
         "params": {"options": {"score_weights": {"dense": True}}}},
        param="params.options.score_weights.dense"),
    Bad("score-weights-one-output-model-msgpack", f"/v1/score/{MINILM}", raw=msgpack.packb(
        {"query": {"text": "q"}, "items": [{"text": "a"}],
         "options": {"score_weights": {"dense": 1.0}}}), content_type=MSGPACK,
        param="options.score_weights"),
    Bad("unknown-label", f"/v1/extract/{SPACY}",
        {"items": [{"text": "Ada Lovelace lived in London."}],
         "params": {"labels": ["NOT_A_LABEL"]}}, param="params.labels[0]"),
    Bad("unknown-output-type", ENC_MINILM, {**ONE, "params": {"output_types": ["colbert"]}},
        kind="unsupported_output", param="params.output_types"),
    Bad("task-not-supported", f"/v1/extract/{SYNTH}", ONE, kind="unsupported_task",
        param="model"),
    Bad("too-long-without-truncation", ENC_MINILM,
        {"items": [{"text": "word " * 400}], "params": {"options": {"truncate": False}}},
        status=(400,), kind="input_too_long", param="items[0].text"),  # SIE's INPUT_TOO_LONG
    Bad("text-over-char-limit", ENC, {"items": [{"text": "x" * 200_001}]},
        param="items[0].text"),
    # empty or blank text: nothing to embed, score or search (OpenAI and TEI refuse it too)
    Bad("empty-text-encode", ENC, {"items": [{"text": "a"}, {"text": ""}]},
        param="items[1].text"),
    Bad("blank-text-encode", ENC_MINILM, {"items": [{"text": " \n\t\u3000"}]},
        param="items[0].text"),
    Bad("empty-text-extract", f"/v1/extract/{SPACY}", {"items": [{"text": ""}]},
        param="items[0].text"),
    # no visible character: the tokenizer drops them all, leaving the special tokens alone
    Bad("zero-width-and-bom-encode", ENC_MINILM, {"items": [{"text": "a"},
                                                           {"text": "\u200b\ufeff"}]},
        param="items[1].text"),
    Bad("nul-and-controls-openai", "/v1/embeddings", {"input": ["a", "\x00\x01 \x02"]},
        param="input[1]"),
    Bad("lone-combining-mark-score", f"/v1/score/{MINILM}",
        {"query": {"text": "\u0301"}, "items": [{"text": "a"}]}, param="query.text"),
    Bad("empty-query-score", f"/v1/score/{MINILM}",
        {"query": {"text": ""}, "items": [{"text": "a"}]}, param="query.text"),
    Bad("empty-input-string-openai", "/v1/embeddings", {"input": ""}, param="input[0]"),
    Bad("blank-input-in-list-openai", "/v1/embeddings", {"input": ["a", "  "]},
        param="input[1]"),
    Bad("empty-texts-cohere", "/v2/embed",
        {"model": SYNTH, "texts": [""], "input_type": "search_document"}, param="texts[0]"),
    Bad("empty-inputs-tei-embed-string", "/embed", {"inputs": ""}, param="inputs[0]"),
    Bad("empty-query-rerank", "/v1/rerank", {"query": "", "documents": ["a"]}, param="query"),
    Bad("blank-query-tei-rerank", "/rerank", {"query": " ", "texts": ["a"]}, param="query"),
    Bad("empty-query-cohere-rerank", "/v2/rerank",
        {"model": SYNTH, "query": "", "documents": ["a"]}, param="query"),
    # booleans are not token ids, and token ids name no vocabulary (refused by default)
    Bad("booleans-as-token-ids", "/v1/embeddings", {"model": MINILM, "input": [True, False]}),
    Bad("token-ids-by-default", "/v1/embeddings", {"model": MINILM, "input": [101, 102]},
        param="input"),
    # a named model must name one; only an omitted one means the default model
    Bad("empty-model-openai", "/v1/embeddings", {"input": "a", "model": ""}, param="model"),
    Bad("null-model-openai", "/v1/embeddings", {"input": "a", "model": None}, param="model"),
    Bad("blank-model-rerank", "/v1/rerank", {"query": "q", "documents": ["a"], "model": " "},
        param="model"),
]


@pytest.fixture(scope="module")
def client(input_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=input_server.url, timeout=120) as http:
        yield http


@pytest.fixture(scope="module")
def tried() -> Iterator[list[dict[str, Any]]]:
    """What each case got, written as figures when the module ends."""
    yield []


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_request_is_refused_with_a_4xx(case: Bad, client: httpx.Client,
                                               input_server: ServerProcess,
                                               tried: list[dict[str, Any]]) -> None:
    log_from = input_server.log_size()
    response = client.post(case.path, content=case.content(),
                           headers={"content-type": case.content_type})
    tried.append({"case": case.id, "status": response.status_code,
                  "type": response.json().get("error", {}).get("type")
                  if response.headers.get("content-type", "").startswith(JSON) else None})
    assert_error(response, case.status, case.kind, case.param)
    assert input_server.alive()
    assert "Traceback" not in input_server.log_text(log_from)


def test_chunked_body_over_the_limit_is_413(client: httpx.Client) -> None:
    """No declared length: the limit applies while the body streams in."""

    def chunks() -> Iterator[bytes]:
        yield b'{"items": [{"text": "'
        for _ in range(110):
            yield b"x" * 10_000
        yield b'"}]}'

    response = client.post(ENC, content=chunks(), headers={"content-type": JSON})
    assert_error(response, 413, "payload_too_large", "body")
    assert client.get("/healthz").status_code == 200


@dataclass(frozen=True)
class Edge:
    """A strange but valid request: it must be served."""

    id: str
    model: str
    texts: tuple[str, ...]
    dims: int


EDGES = [
    Edge("100k-chars-synthetic", SYNTH, ("word " * 20_000,), 64),
    Edge("100k-chars-minilm", MINILM, ("word " * 20_000,), 384),
    Edge("100k-chars-no-spaces-minilm", MINILM, ("x" * 100_000,), 384),
    Edge("nul-control-and-emoji", MINILM, ("a\x00b\x07c", "🙂 مرحبا שלום \u202e"), 384),
    Edge("512-items-at-the-limit", SYNTH, tuple(f"item {i}" for i in range(512)), 64),
]


@pytest.mark.parametrize("edge", EDGES, ids=[e.id for e in EDGES])
def test_valid_edge_case_is_served(edge: Edge, client: httpx.Client,
                                   tried: list[dict[str, Any]]) -> None:
    response = client.post(f"/v1/encode/{edge.model}", json=encode_body(*edge.texts))
    tried.append({"case": edge.id, "status": response.status_code, "type": None})
    assert response.status_code == 200, response.text[:500]
    vectors = dense(response.json())
    assert len(vectors) == len(edge.texts) and all(len(v) == edge.dims for v in vectors)


def test_an_omitted_model_is_the_default_model(client: httpx.Client) -> None:
    """The one documented rule: no `model` field means --default-model."""
    response = client.post("/v1/embeddings", json={"input": "hello"})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == SYNTH


def test_langchain_defaults_get_a_4xx_not_wrong_vectors(client: httpx.Client,
                                                        input_server: ServerProcess) -> None:
    """LangChain's OpenAIEmbeddings, as constructed by default, tokenizes with tiktoken and
    sends ids. Read as all-MiniLM-L6-v2's ids they gave a 200 with vectors of cosine
    0.06-0.17 to the text's. Offline, tiktoken cannot fetch cl100k_base's rank file, so the
    encoding LangChain looks up is a real tiktoken Encoding over single bytes (ids 0-255,
    every one inside MiniLM's vocabulary: the case that was silently wrong)."""
    import tiktoken
    import tiktoken.registry
    from langchain_openai import OpenAIEmbeddings

    byte_level = tiktoken.Encoding(name="cl100k_base", pat_str=r"\S+|\s+",
                                   mergeable_ranks={bytes([b]): b for b in range(256)},
                                   special_tokens={})
    saved = dict(tiktoken.registry.ENCODINGS)
    tiktoken.registry.ENCODINGS["cl100k_base"] = byte_level
    try:
        embedder = OpenAIEmbeddings(model=MINILM, base_url=f"{input_server.url}/v1",
                                    api_key="unused", max_retries=0)
        assert embedder.check_embedding_ctx_length  # the default: ids, not text
        import openai

        with pytest.raises(openai.UnprocessableEntityError) as caught:
            embedder.embed_documents(["first document", "hello world"])
        assert "check_embedding_ctx_length=False" in str(caught.value)
    finally:
        tiktoken.registry.ENCODINGS.clear()
        tiktoken.registry.ENCODINGS.update(saved)
    # The fix the error names gives the text's own vectors.
    fixed = OpenAIEmbeddings(model=MINILM, base_url=f"{input_server.url}/v1",
                             api_key="unused", check_embedding_ctx_length=False)
    [vector] = fixed.embed_documents(["hello world"])
    native = client.post(ENC_MINILM, json=encode_body("hello world")).json()
    assert dense(native)[0] == pytest.approx(vector, abs=1e-5)


@pytest.mark.parametrize("raw", [b'{"items": [{"text": "\xff"}]}',
                                 b'{"items": ' + b"[" * DEEP + b"]" * DEEP + b"}",
                                 b"{", b'{"items": [{"text": "hel', b"items=hello"],
                         ids=["invalid-utf8", "deep-nesting", "brace", "truncated",
                              "form-encoded"])
def test_undecodable_body_is_a_422_naming_the_body(raw: bytes, client: httpx.Client) -> None:
    """Found by these tests (fixed in 7f33662): a body that was not UTF-8 or nested too deep
    got FastAPI's 400 'There was an error parsing the body', and invalid JSON named a
    character offset ('[1]') as the field."""
    response = client.post(ENC, content=raw, headers={"content-type": JSON})
    error = assert_error(response, 422, "invalid_request", "body")
    assert "[" not in error["message"].split(":")[0]


@pytest.mark.parametrize(("raw", "says"), [
    (b'{"items": [{"text": "\xff"}]}', "body: invalid JSON (not UTF-8)"),
    (b'{"items": [{"text": "x", "id": ' + b"9" * 5000 + b"}]}",
     "body: invalid JSON (a number of over 4300 digits)"),
    # Found by a black-box review: the reason came without a place to look.
    (b'{"items": [{"text": "x"}\n  {"text": "y"}]}',
     "body: invalid JSON (Expecting ',' delimiter at line 2, column 3)"),
], ids=["not-utf8", "huge-number", "where"])
def test_an_undecodable_body_says_why(raw: bytes, says: str, client: httpx.Client) -> None:
    """Found by a black-box review: a 5,000-digit number was called "not UTF-8"."""
    response = client.post(ENC, content=raw, headers={"content-type": JSON})
    assert assert_error(response, 422, "invalid_request", "body")["message"] == says


@pytest.mark.parametrize(("route", "sent"), [(ENC, encode_body("hello")),
                                             ("/v1/embeddings", {"input": "hello"})])
def test_a_compressed_body_is_a_415_naming_its_encoding(route: str, sent: dict[str, Any],
                                                         client: httpx.Client) -> None:
    """Found by a black-box review: a gzip body was read as it came and called invalid
    JSON (not UTF-8); Ember takes bodies uncompressed and says so."""
    body = gzip.compress(json.dumps(sent).encode())
    response = client.post(route, content=body,
                           headers={"content-type": JSON, "content-encoding": "gzip"})
    error = assert_error(response, 415, "unsupported_media_type", "body")
    assert "gzip" in error["message"] and "uncompressed" in error["message"]
    plain = client.post(ENC, json=encode_body("hello"),
                        headers={"content-encoding": "identity"})
    assert plain.status_code == 200, plain.text


@pytest.mark.parametrize(("kind", "origin"), [
    ("text/plain;charset=UTF-8", None), ("application/x-www-form-urlencoded", None),
    ("multipart/form-data; boundary=x", None), (None, "https://page.example")])
def test_a_body_a_page_of_another_origin_could_send_is_never_read(
        kind: str | None, origin: str | None, client: httpx.Client) -> None:
    """Found by a fresh-clone walkthrough: any Content-Type was read as JSON, so a web page
    could make a browser post to a server on the user's machine without a CORS preflight
    (loading and evicting models, or downloading with --allow-hub-models)."""
    headers = {key: value for key, value in (("content-type", kind), ("origin", origin))
               if value is not None}
    raw = json.dumps(encode_body("hello")).encode()
    response = client.post(ENC, content=raw, headers=headers)
    error = assert_error(response, 415, "unsupported_media_type", "body")
    assert "send Content-Type: application/json" in error["message"], error
    # A script's bare body (no Origin) and a JSON body are read as ever.
    assert client.post(ENC, content=raw).status_code == 200
    assert client.post(ENC, content=raw, headers={"content-type": JSON,
                                                  "origin": "https://page.example"}
                       ).status_code == 200


@pytest.mark.parametrize("model", [SYNTH, MINILM])
def test_lone_surrogate_is_a_422(model: str, client: httpx.Client) -> None:
    """Found by these tests (fixed in 7f33662): a lone UTF-16 surrogate (valid JSON
    '\\ud800') passed validation and failed in the model with a 500."""
    response = client.post(f"/v1/encode/{model}", content=b'{"items": [{"text": "a"}, '
                           b'{"text": "b\\ud800"}]}', headers={"content-type": JSON})
    assert_error(response, 422, "invalid_request", "items[1].text")


def test_chunked_msgpack_over_the_limit_is_a_clean_413(servers: ServerPool) -> None:
    """Found by these tests (fixed in 4ecc6be): the 413 was sent, but BodyTooLarge escaped
    the msgpack middleware and the server logged 'Exception in ASGI application' with a
    traceback."""
    server = servers.start("--default-model", SYNTH, "--max-body-bytes", "100000",
                           name="chunked-msgpack")

    def chunks() -> Iterator[bytes]:
        payload = msgpack.packb(encode_body("x" * 300_000))
        for start in range(0, len(payload), 10_000):
            yield payload[start:start + 10_000]

    with httpx.Client(base_url=server.url, timeout=30) as http:
        response = http.post(ENC, content=chunks(), headers={"content-type": MSGPACK})
        assert_error(response, 413, "payload_too_large", "body")
        assert http.get("/healthz").status_code == 200
    assert "Traceback" not in server.log_text(), server.log_text()[-2000:]


def test_server_is_healthy_after_the_hostile_input(client: httpx.Client,
                                                   input_server: ServerProcess,
                                                   tried: list[dict[str, Any]],
                                                   figures: Record) -> None:
    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").status_code == 200
    response = client.post(ENC, json=encode_body("still fine"))
    assert response.status_code == 200
    statuses: dict[str, int] = {}
    for entry in tried:
        statuses[str(entry["status"])] = statuses.get(str(entry["status"]), 0) + 1
    figures("bad_input", {"cases": len(tried), "statuses": statuses, "results": tried,
                          "server_alive": input_server.alive()})
