"""OpenAI-compatible POST /v1/embeddings.

`input` takes every form of OpenAI's spec: a string, a list of strings, a list of token
ids, or a list of token-id lists. Token ids carry no name of the vocabulary they were made
in, and the common clients (LangChain's OpenAIEmbeddings by default) send OpenAI's
tiktoken ids, which read as another model's ids give wrong vectors with a 200. So token
ids are refused by default with a 422 that says how to send text; `--token-ids model`
reads them as ids of the model's own vocabulary (as vLLM and TEI do), each row inside its
tokenizer's special tokens."""

from __future__ import annotations

import base64
from dataclasses import replace
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)
from pydantic_core import PydanticCustomError

from ember.adapters._tokenize import first_outside_rows
from ember.adapters.base import Encoded, EncodeOptions, TaskModel, TaskOutput
from ember.api.codec import render
from ember.api.errors import ApiError
from ember.api.model_task import (
    CUT_HELP,
    check_count,
    check_inputs,
    cut_dense,
    requested_model,
    require_dense,
    run_task,
)
from ember.api.routing import InferenceRoute
from ember.api.state import ServedModel, server_state

router = APIRouter(tags=["openai"], route_class=InferenceRoute)

TokenIds = list[StrictInt]  # a JSON true is no token id


class EmbeddingsRequest(BaseModel):
    # OpenAI refuses an argument it does not know; so does Ember, naming it.
    model_config = ConfigDict(extra="forbid")

    input: str | list[str] | TokenIds | list[TokenIds] = Field(
        description="a text, a list of texts, a list of token ids, or a list of token-id "
        "lists (ids of the model's own vocabulary)")
    model: str = Field("", description="catalog name; omitted: the server's default "
                              "model")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(None, description=CUT_HELP)
    user: str | None = None
    truncate: StrictBool = Field(True, description="Ember's own field: true cuts an input at the "
                           "model's token limit (usage counts the tokens kept); false refuses "
                           "it with a 400 naming it, as OpenAI's API does")

    @field_validator("input", mode="wrap")
    @classmethod
    def no_objects(cls, value: object, handler: ValidatorFunctionWrapHandler) -> object:
        """Jina's API takes `{"text": ...}` and `{"image": ...}` objects here: say what to
        send instead of listing the union's forms (looked for only once refused)."""
        try:
            return handler(value)
        except ValidationError:
            if not isinstance(value, dict | list):
                raise
        if isinstance(value, dict):
            index, image = None, "image" in value
        elif isinstance(value, list) and any(isinstance(item, dict) for item in value):
            places = [i for i, item in enumerate(value) if isinstance(item, dict)]
            index = next((i for i in places if "image" in value[i]), places[0])
            image = "image" in value[index]
        else:
            return handler(value)  # refused for another reason: say that one
        raise PydanticCustomError(
            "object_input", "{param} is an object ({kind}, Jina's form); /v1/embeddings takes "
            "a string, a list of strings or token ids: {fix}",
            {"param": "input" if index is None else f"input[{index}]",
             "kind": '{"image": ...}' if image else "{...}",
             "fix": images_elsewhere("<model>") if image else "send each text as a string"})


def embeddings_side(model: ServedModel) -> EncodeOptions:
    """The document side, unless the model's YAML says `options: {embeddings_side: query}`."""
    return EncodeOptions(is_query=model.spec.options.get("embeddings_side") == "query")


def token_rows(value: str | list[str] | TokenIds | list[TokenIds]) -> list[TokenIds] | None:
    """The input's token-id lists, or None when it is text."""
    if isinstance(value, str) or not value or isinstance(value[0], str):
        return None
    if isinstance(value[0], int):
        return [[token for token in value if isinstance(token, int)]]
    return [row for row in value if isinstance(row, list)]


LANGCHAIN_FIX = ("LangChain's OpenAIEmbeddings sends OpenAI's tiktoken ids by default: "
                 "create it with check_embedding_ctx_length=False so it sends text")


def refuse_token_ids(request: Request) -> None:
    if server_state(request).settings.token_ids != "model":
        raise ApiError(422, "invalid_request", "input holds token ids, and this server does "
                       "not know which tokenizer made them (ids of another model's "
                       f"vocabulary give wrong vectors): send text instead. {LANGCHAIN_FIX}. "
                       "A server started with --token-ids model reads ids as the model's own.",
                       "input")


def check_tokens(model: ServedModel, rows: list[TokenIds], nested: bool) -> list[TokenIds]:
    """The token-id rows, each id checked against the model's own vocabulary; an id outside
    it is a 422 naming its place (`input[2][7]`, or `input[7]` for one flat list)."""
    tokenizer: Any = getattr(model.adapter, "tokenizer", None)
    name = model.spec.name
    if tokenizer is None:
        raise ApiError(422, "invalid_request", f"model {name!r} takes text only (it has no "
                       "tokenizer to read token ids with); send strings", "input")
    vocabulary = len(tokenizer)
    empty = next((i for i, row in enumerate(rows) if not row), None)
    if empty is not None:
        raise ApiError(422, "invalid_request", "a token-id list must hold at least one id",
                       f"input[{empty}]" if nested else "input")
    if (outside := first_outside_rows(rows, vocabulary)) is not None:
        row, index = outside
        raise ApiError(
            422, "invalid_request",
            f"token id {rows[row][index]} is outside the vocabulary of {name} (ids 0 to "
            f"{vocabulary - 1}): token ids are read as ids of the model's own "
            f"tokenizer, not OpenAI's. {LANGCHAIN_FIX}",
            f"input[{row}][{index}]" if nested else f"input[{index}]")
    return rows


def images_elsewhere(model: str) -> str:
    return f"send images to POST /v1/encode/{model} (items[].images) or to /v2/embed " \
        "(Cohere's images)"


@router.post("/v1/embeddings", summary="OpenAI-compatible embeddings")
async def embeddings(body: EmbeddingsRequest, request: Request) -> Response:
    model = requested_model(request, body)
    rows = token_rows(body.input)
    texts = [body.input] if isinstance(body.input, str) else [
        text for text in body.input if isinstance(text, str)]
    if rows is None:
        check_inputs(request, texts, "input")
        count = len(texts)
    else:
        refuse_token_ids(request)
        count = len(rows)
        check_count(request, count, "input")

    nested = rows is not None and isinstance(body.input[0], list)

    async def encode(m: ServedModel, adapter: TaskModel) -> TaskOutput[list[Encoded]]:
        require_dense(m, "/v1/embeddings", body.dimensions)
        side = replace(embeddings_side(m), truncate=body.truncate)
        if rows is None:
            output = await adapter.encode(m.submit, texts, side)
        else:
            encode_ids = getattr(adapter, "encode_ids", None)
            if encode_ids is None:
                raise ApiError(422, "invalid_request", f"model {m.spec.name!r} takes text "
                               "only; send strings", "input")
            output = await encode_ids(m.submit, check_tokens(m, rows, nested), side)
        return cut_dense(m, output, body.dimensions, side)

    output = await run_task(request, model, "encode", encode, count,
                            "input")
    data = []
    for index, encoded in enumerate(output.values):
        vector = encoded.dense
        assert vector is not None  # require_dense
        value: object = vector
        if body.encoding_format == "base64":
            value = base64.b64encode(vector.astype("<f4", copy=False).tobytes()).decode()
        data.append({"object": "embedding", "index": index, "embedding": value})
    usage = {"prompt_tokens": output.tokens, "total_tokens": output.tokens}
    return render(request.headers, {"object": "list", "data": data, "model": model, "usage": usage})
