"""OpenAI-compatible POST /v1/embeddings."""

from __future__ import annotations

import base64
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from ember.adapters.base import EncodeOptions
from ember.api.codec import render
from ember.api.errors import ApiError
from ember.api.model_task import check_inputs, run_task
from ember.api.routing import InferenceRoute
from ember.api.state import ServedModel, server_state

router = APIRouter(tags=["openai"], route_class=InferenceRoute)


class EmbeddingsRequest(BaseModel):
    input: str | list[str] = Field(description="a text or a list of texts")
    model: str | None = Field(None, description="catalog name; default: the server's model")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, description="must equal the model's dims if given")
    user: str | None = None


def embeddings_side(model: ServedModel) -> EncodeOptions:
    """The document side, unless the model's YAML says `options: {embeddings_side: query}`."""
    return EncodeOptions(is_query=model.spec.options.get("embeddings_side") == "query")


@router.post("/v1/embeddings", summary="OpenAI-compatible embeddings")
async def embeddings(body: EmbeddingsRequest, request: Request) -> Response:
    model = body.model or server_state(request).settings.default_model
    texts = [body.input] if isinstance(body.input, str) else body.input
    check_inputs(request, texts, "input")
    output = await run_task(request, "openai.embeddings", model, "encode",
                            lambda m, a: a.encode(m.submit, texts, embeddings_side(m)),
                            len(texts), "input")
    data = []
    for index, encoded in enumerate(output.values):
        vector = encoded.dense
        assert vector is not None
        if body.dimensions is not None and body.dimensions != vector.shape[-1]:
            raise ApiError(422, "invalid_request", f"dimensions={body.dimensions} is not "
                           f"supported; {model} returns {vector.shape[-1]}", "dimensions")
        value: object = vector
        if body.encoding_format == "base64":
            value = base64.b64encode(vector.astype("<f4", copy=False).tobytes()).decode()
        data.append({"object": "embedding", "index": index, "embedding": value})
    usage = {"prompt_tokens": output.tokens, "total_tokens": output.tokens}
    return render(request.headers, {"object": "list", "data": data, "model": model, "usage": usage})


