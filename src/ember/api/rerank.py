"""Cohere/Jina-style POST /v1/rerank."""

from __future__ import annotations

import math
import os
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from ember.adapters.base import ScoreOptions
from ember.api.codec import json_values, render, spelt
from ember.api.cohere import refuse_unsupported
from ember.api.errors import ApiError
from ember.api.model_task import (
    check_inputs,
    check_query,
    ranked,
    requested_model,
    run_task,
)
from ember.api.routing import InferenceRoute

router = APIRouter(tags=["rerank"], route_class=InferenceRoute)


class Document(BaseModel):
    """A document object: its text is ranked and its other fields come back with it, as
    Cohere's v1 returns a document; a Jina image is refused (these models read text)."""

    model_config = ConfigDict(extra="allow")

    text: str | None = None
    image: Any = Field(None, description="refused: these models rank text")


class RerankRequest(BaseModel):
    """Cohere's v1 and Jina's body; any other field is a 422 naming it, never ignored."""

    model_config = ConfigDict(extra="forbid")

    query: str
    documents: list[str | Document]
    model: str = Field("", description="catalog name; default: the server's model")
    top_n: StrictInt | None = Field(None, ge=1, description="return only the best n")
    return_documents: StrictBool = False
    rank_fields: list[str] | None = Field(None, description='["text"] only: each document\'s '
                                          "text is what is ranked")
    max_chunks_per_doc: int | None = Field(None, description="Cohere v1's; refused: "
                                           "documents are scored whole")


def text_of(document: Document, place: str) -> str:
    """A document object's text; its other fields must be what a JSON answer can hold
    (they come back with it), and an image is refused by name."""
    if document.image is not None:
        raise ApiError(422, "invalid_request", "images are not ranked here (the models rank "
                       "text); send the document's text alone", f"{place}.image")
    if document.text is None:
        raise ApiError(422, "invalid_request", "a document object needs its text", f"{place}.text")
    for name, value in (document.model_extra or {}).items():
        if (where := not_json(value, f"{place}.{name}")) is not None:
            raise ApiError(422, "invalid_request", "a document's fields come back with it, "
                           "so each must be a JSON value (text, a finite number of at most 64 "
                           "bits, true, false, null, a list or a map of them)", where)
    return document.text


def not_json(value: object, place: str) -> str | None:
    """Where in `value` (at `place`) something is that JSON cannot carry back as it was
    sent (`{place}[2].x`), or None."""
    for part, link in json_values(value):
        if isinstance(part, dict):
            if not all(isinstance(key, str) for key in part):
                return spelt(link, place)
        elif isinstance(part, list | str | bool) or part is None:
            continue
        elif isinstance(part, int):
            if not -2**63 <= part < 2**64:
                return spelt(link, place)
        elif not (isinstance(part, float) and math.isfinite(part)):
            return spelt(link, place)
    return None


@router.post("/v1/rerank", summary="Rerank documents for a query (Cohere/Jina shape)")
async def rerank(body: RerankRequest, request: Request) -> Response:
    model = requested_model(request, body)
    if body.rank_fields not in (None, ["text"]):
        raise ApiError(422, "invalid_request", f"rank_fields {body.rank_fields} is not "
                       "supported: each document's text is ranked; put what to rank in "
                       '"text", or leave rank_fields out', "rank_fields")
    refuse_unsupported({"max_chunks_per_doc": body.max_chunks_per_doc})
    texts = [document if isinstance(document, str) else text_of(document, f"documents[{i}]")
             for i, document in enumerate(body.documents)]
    check_inputs(request, texts, "documents")
    check_query(request, body.query)
    output = await run_task(request, model, "score",
                            lambda m, a: a.score(m.submit, body.query, texts, ScoreOptions()),
                            len(texts), "documents", query=True)
    results = []
    for index in ranked(output.values, body.top_n):
        result: dict[str, object] = {"index": index, "relevance_score": output.values[index]}
        if body.return_documents:
            document = body.documents[index]
            result["document"] = {"text": document} if isinstance(document, str) else \
                document.model_dump(exclude={"image"})
        results.append(result)
    # Jina's answer (model, usage) with Cohere v1's (id, meta): both clients read it.
    return render(request.headers, {
        "id": os.urandom(16).hex(), "model": model, "results": results,
        "usage": {"total_tokens": output.tokens},
        "meta": {"api_version": {"version": "1"}, "billed_units": {"search_units": 1}}})
