"""Cohere compatible POST /v2/embed and POST /v2/rerank (what `cohere.ClientV2` calls), and
POST /v1/embed (what `cohere.Client` calls; Cohere's v1 rerank is `/v1/rerank`).

`input_type` "search_query" encodes the query side; the others the document side;
"image" embeds `images`, data URIs, on a model that takes images. What Ember cannot
honour (mixed `inputs`, a token cap, another output size, cutting the start of a text)
is refused with a 422 naming the field, never ignored."""

from __future__ import annotations

import base64
import os
import re
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from ember.adapters._images import ItemInput
from ember.adapters.base import Encoded, EncodeOptions, ScoreOptions, TaskModel, TaskOutput
from ember.api.codec import render
from ember.api.errors import ApiError
from ember.api.images import check_image_count, data_uri, image_model, takes_images
from ember.api.model_task import (
    CUT_HELP,
    check_count,
    check_inputs,
    check_query,
    cut_dense,
    ranked,
    requested_model,
    require_dense,
    run_task,
)
from ember.api.routing import InferenceRoute
from ember.api.state import ServedModel
from ember.outputs import quantize, quantize_unit

router = APIRouter(tags=["cohere"], route_class=InferenceRoute)
PRIORITY_HELP = "accepted and not used: Ember schedules requests by its own rules"

EmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]
InputType = Literal["search_document", "search_query", "classification", "clustering",
                    "image"]


class Strict(BaseModel):
    """Cohere's fields only: an unknown one is a 422 naming it, never ignored."""

    model_config = ConfigDict(extra="forbid")


class CohereEmbedRequest(Strict):
    model: str
    texts: list[str] | None = None
    images: list[str] | None = Field(None, description="data URIs, with input_type image")
    inputs: list[Any] | None = None
    input_type: InputType = "search_document"
    embedding_types: list[EmbeddingType] | None = Field(None, description="default: float")
    truncate: Literal["NONE", "START", "END"] = "END"
    max_tokens: int | None = None
    output_dimension: StrictInt | None = Field(None, description=CUT_HELP)
    priority: int | None = Field(None, description=PRIORITY_HELP)


class CohereV1EmbedRequest(CohereEmbedRequest):
    model: str = Field("", description="catalog name; default: the server's model")


class CohereRerankRequest(Strict):
    model: str
    query: str
    documents: list[str]
    top_n: StrictInt | None = Field(None, ge=1)
    max_tokens_per_doc: int | None = None
    relevant_spans: StrictBool | None = None
    priority: int | None = Field(None, description=PRIORITY_HELP)


# Why each field Ember cannot honour is refused, in the words of that field.
UNSUPPORTED = {
    "inputs": "Ember embeds each text or image on its own, not a content list fused into "
              "one embedding; send texts, or images with input_type image",
    "max_tokens": "texts are embedded whole, up to the model's own token limit (truncate END "
                  "cuts there)",
    "max_tokens_per_doc": "documents are scored whole, up to the model's own token limit",
    "max_chunks_per_doc": "documents are scored whole, not in chunks, up to the model's own "
                          "token limit",
    "relevant_spans": "scores are for whole documents, without spans",
}


def refuse_unsupported(fields: dict[str, object]) -> None:
    for name, value in fields.items():
        if value is not None:
            raise ApiError(422, "invalid_request", f"{name} is not supported: "
                           f"{UNSUPPORTED[name]}; remove it", name)


def meta(version: str = "2", **billed: int) -> dict[str, Any]:
    return {"api_version": {"version": version}, "billed_units": billed}


def by_type(vectors: list[np.ndarray], kind: str) -> list[Any]:
    """Cohere's embedding types: binary is the packed sign bits as signed bytes (the
    unsigned bytes minus 128), ubinary the unsigned bytes, base64 the float32 bytes;
    int8 and uint8 have one scale a model (Cohere's shape has no field for a vector's
    own), so their dot products rank as the floats do."""
    if kind == "float":
        return [vector.astype(np.float32) for vector in vectors]
    if kind == "base64":
        return [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in vectors]
    if kind == "binary":
        return [(quantize(v, "ubinary").values.astype(np.int16) - 128).astype(np.int8)
                for v in vectors]
    if kind in ("int8", "uint8"):
        return [quantize_unit(vector, kind) for vector in vectors]
    return [quantize(vector, kind).values for vector in vectors]


@router.post("/v2/embed", summary="Cohere v2 compatible embeddings")
async def embed(body: CohereEmbedRequest, request: Request) -> Response:
    return render(request.headers, await embedded(body, request, body.model))


@router.post("/v1/embed", summary="Cohere v1 compatible embeddings (cohere.Client)")
async def embed_v1(body: CohereV1EmbedRequest, request: Request) -> Response:
    answer = await embedded(body, request, requested_model(request, body), version="1")
    if body.embedding_types is None:  # v1's own shape: the float vectors alone
        answer.update(response_type="embeddings_floats",
                      embeddings=answer["embeddings"]["float"])
    return render(request.headers, answer)


async def embedded(body: CohereEmbedRequest, request: Request, model: str,
                   version: str = "2") -> dict[str, Any]:
    """Cohere's embed answer (`embeddings_by_type`) for the texts or images of `body`."""
    refuse_unsupported({"inputs": body.inputs, "max_tokens": body.max_tokens})
    if body.input_type == "image" or body.images is not None:
        return await embed_images(body, request, model, version)
    if body.texts is None:
        raise ApiError(422, "invalid_request", "texts is required (or images with "
                       "input_type image)", "texts")
    if body.truncate == "START":
        raise ApiError(422, "invalid_request", "truncate START is not supported: Ember cuts "
                       "the end of a long text; send END or NONE", "truncate")
    texts = body.texts
    check_inputs(request, texts, "texts")
    options = EncodeOptions(is_query=body.input_type == "search_query",
                            truncate=body.truncate != "NONE")

    async def encode(m: ServedModel, adapter: TaskModel) -> TaskOutput[list[Encoded]]:
        require_dense(m, request.url.path, body.output_dimension, "output_dimension")
        return cut_dense(m, await adapter.encode(m.submit, texts, options),
                         body.output_dimension, options)

    output = await run_task(request, model, "encode", encode, len(texts), "texts",
                            truncate="truncate to END")
    return answer(body, output, texts, meta(version, input_tokens=output.tokens))


def answer(body: CohereEmbedRequest, output: TaskOutput[list[Encoded]], texts: list[str],
           billed: dict[str, Any]) -> dict[str, Any]:
    vectors = [encoded.dense for encoded in output.values if encoded.dense is not None]
    embeddings = {kind: by_type(vectors, kind)
                  for kind in dict.fromkeys(body.embedding_types or ["float"])}
    return {"id": os.urandom(16).hex(), "response_type": "embeddings_by_type",
            "embeddings": embeddings, "texts": texts, "meta": billed}


async def embed_images(body: CohereEmbedRequest, request: Request, model: str,
                       version: str) -> dict[str, Any]:
    """input_type image: one vector a data URI."""
    if body.images is None:
        raise ApiError(422, "invalid_request", "input_type image needs images (data URIs)",
                       "images")
    if body.input_type != "image":
        raise ApiError(422, "invalid_request", "images need input_type image", "input_type")
    if body.texts is not None:
        raise ApiError(422, "invalid_request", "send texts and images in separate requests",
                       "texts")
    check_count(request, len(body.images), "images")
    check_image_count(request, len(body.images), "images")
    takes_images(request, model, "images")
    inputs = [ItemInput(images=(data_uri(uri, f"images[{i}]"),))
              for i, uri in enumerate(body.images)]

    async def encode(m: ServedModel, adapter: TaskModel) -> TaskOutput[list[Encoded]]:
        require_dense(m, request.url.path, body.output_dimension, "output_dimension")
        output = await image_model(adapter, model, "images").encode_items(
            m.submit, inputs, EncodeOptions())
        return cut_dense(m, output, body.output_dimension, EncodeOptions())

    try:
        output = await run_task(request, model, "encode", encode, len(inputs), "images")
    except ApiError as error:  # the adapter names items[3].images[0].data: here images[3]
        found = re.match(r"items(\[\d+\])\.images", error.param or "")
        if found:
            error.param = f"images{found.group(1)}"
        raise
    return answer(body, output, [], meta(version, images=len(inputs)))


@router.post("/v2/rerank", summary="Cohere v2 compatible rerank")
async def rerank(body: CohereRerankRequest, request: Request) -> Response:
    refuse_unsupported({"max_tokens_per_doc": body.max_tokens_per_doc,
                        "relevant_spans": body.relevant_spans or None})
    check_inputs(request, body.documents, "documents")
    check_query(request, body.query)
    output = await run_task(request, body.model, "score",
                            lambda m, a: a.score(m.submit, body.query, body.documents,
                                                 ScoreOptions()),
                            len(body.documents), "documents", query=True)
    results = [{"index": index, "relevance_score": output.values[index]}
               for index in ranked(output.values, body.top_n)]
    return render(request.headers, {"id": os.urandom(16).hex(), "results": results,
                                    "meta": meta(search_units=1)})
