"""text-embeddings-inference compatible POST /embed and POST /rerank, on the default model."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from ember.adapters.base import EncodeOptions, ScoreOptions
from ember.api.codec import render
from ember.api.model_task import check_inputs, run_task
from ember.api.rerank import ranked
from ember.api.routing import InferenceRoute
from ember.api.state import server_state

router = APIRouter(tags=["tei"], route_class=InferenceRoute)


class EmbedRequest(BaseModel):
    inputs: str | list[str]
    normalize: bool = True
    truncate: bool = True
    prompt_name: str | None = None


class TeiRerankRequest(BaseModel):
    query: str
    texts: list[str]
    truncate: bool = True
    return_text: bool = False
    raw_scores: bool = False


@router.post("/", summary="TEI-compatible embeddings at the root, as TEI answers "
             "clients given only its base URL")
@router.post("/embed", summary="TEI-compatible embeddings on the default model")
async def embed(body: EmbedRequest, request: Request) -> Response:
    model = server_state(request).settings.default_model
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    check_inputs(request, texts, "inputs")
    options = EncodeOptions(normalize=body.normalize, truncate=body.truncate,
                            is_query=body.prompt_name == "query")
    output = await run_task(request, model, "encode",
                            lambda m, a: a.encode(m.submit, texts, options), len(texts),
                            "inputs")
    return render(request.headers, [encoded.dense for encoded in output.values])


@router.post("/rerank", summary="TEI-compatible rerank on the default model")
async def tei_rerank(body: TeiRerankRequest, request: Request) -> Response:
    model = server_state(request).settings.default_model
    check_inputs(request, body.texts, "texts")
    check_inputs(request, [body.query], "query")
    options = ScoreOptions(truncate=body.truncate)
    output = await run_task(request, model, "score",
                            lambda m, a: a.score(m.submit, body.query, body.texts, options),
                            len(body.texts) + 1, "texts")
    results = []
    for index in ranked(output.values, None):
        result: dict[str, object] = {"index": index, "score": output.values[index]}
        if body.return_text:
            result["text"] = body.texts[index]
        results.append(result)
    return render(request.headers, results)
