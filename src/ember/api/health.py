"""Liveness, readiness, the model list and the metrics endpoint."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ember import __version__
from ember.api.errors import ErrorBody, as_api_error, error_response
from ember.api.images import IMAGE_FAMILIES
from ember.api.state import Models, server_state
from ember.config import FAMILY_OUTPUTS, ModelSpec, files_here
from ember.errors import ModelNotFound
from ember.outputs import DTYPES

router = APIRouter(tags=["operations"])
NOT_READY = {"model": ErrorBody, "description": "the default model is not loaded yet, its "
             "engine is silent, or the server is draining"}
NOT_IN_CATALOG = {"model": ErrorBody, "description": "no model of that name in the catalog"}
# Any other refusal (a missing API key's 401): in place of the 422 that FastAPI documents
# for a path parameter, which any name passes.
REFUSED = {"model": ErrorBody, "description": "any other refusal, such as a missing API key"}


@router.get("/healthz", summary="The process is alive")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="The default model is loaded and the server is not draining",
            responses={503: NOT_READY})
@router.get("/health", summary="TEI's health check: /readyz by TEI's name",
            responses={503: NOT_READY})
async def readyz(request: Request) -> JSONResponse:
    state = server_state(request)
    if (why := await state.unready()) is not None:
        return error_response(503, *why)
    return JSONResponse({"status": "ready", "default_model": state.settings.default_model})


STARTED = int(time.time())  # OpenAI's model objects carry a `created` time


def inputs(family: str) -> list[str]:
    return ["text", "image"] if family in IMAGE_FAMILIES else ["text"]


def cached(specs: list[ModelSpec]) -> dict[str, bool | None]:
    """Whether each model's files are on this machine (None: a model without files). It
    reads the disk (the Hub's cache, 1-2 ms for the catalog): call it off the loop."""
    return {spec.name: None if spec.adapter == "synthetic" else files_here(spec) is not None
            for spec in specs}


def model_entry(registry: Models, name: str, here: bool | None) -> dict[str, Any]:
    """One model in both dialects at once: OpenAI's model object (`id`, `object`,
    `created`, `owned_by`), SIE's ModelInfo (`name`, `loaded`, `state`, `inputs`,
    `outputs`, `dims` by output type, `max_sequence_length`) and Ember's own fields;
    `here` as `cached` found it."""
    spec = registry.catalog[name]
    state = registry.state(name)
    entry: dict[str, Any] = {
        "id": name, "object": "model", "created": STARTED, "owned_by": "ember",
        "name": name, "loaded": state == "loaded", "state": state, "inputs": inputs(spec.adapter),
        "adapter": spec.adapter, "tasks": list(spec.tasks), "description": spec.description,
        "loras": sorted(spec.loras), "max_seq_length": spec.max_seq_length, "dims": None,
        "output_types": list(FAMILY_OUTPUTS.get(spec.adapter, ())),
        # Whether its files are on this machine (None: a model without files): one that is
        # not loads only where this server may download it.
        "cached": here,
    }
    info = registry.info(name)
    declared = spec.options.get("dims")  # what a catalog entry says before the model loads
    if info is None and isinstance(declared, int) and not isinstance(declared, bool):
        entry["dims"] = declared
        if len(entry["output_types"]) > 1:  # the model's dims are its first output's
            entry["output_dims"] = {entry["output_types"][0]: declared}
    if info is not None:
        entry.update(dims=info.dims, max_seq_length=info.max_seq_length,
                     output_types=list(info.output_types) if "encode" in info.tasks else [])
        if info.labels:
            entry["labels"] = list(info.labels)
        if info.output_dims:
            entry["output_dims"] = dict(info.output_dims)
    entry["dimensions"] = entry["dims"]  # a number in every shape (SIE's `dims` is a map)
    entry["dispatch"] = registry.dispatch(name)  # the learned cost and windows in use
    entry["output_dtypes"] = list(DTYPES) if entry["output_types"] else []
    entry["outputs"] = entry["output_types"]
    entry["max_sequence_length"] = entry["max_seq_length"]
    return entry


def sie_shape(entry: dict[str, Any]) -> dict[str, Any]:
    """`dims` as SIE gives it, by output type (`{"dense": 384}`); Ember's plain number
    stays as `dimensions`."""
    entry = dict(entry)
    dims, by_type = entry["dimensions"], entry.pop("output_dims", None)
    if by_type is None:
        by_type = {kind: dims for kind in entry["output_types"]} if dims is not None else {}
    return {**entry, "dims": by_type}


# HEAD too, outside the API's documentation: uptime checkers often probe with it.
for _path, _probe in (("/healthz", healthz), ("/readyz", readyz), ("/health", readyz)):
    router.add_api_route(_path, _probe, methods=["HEAD"], include_in_schema=False)


@router.get("/v1/models", summary="The catalog: every model, its tasks, outputs and state "
            "(OpenAI's list under `data`, SIE's under `models`)")
async def models(request: Request) -> dict[str, Any]:
    state = server_state(request)
    registry = state.registry
    await state.fresh_status()  # a silent engine: its last known states, within 1 s
    names = list(registry.names)
    here = await asyncio.to_thread(cached, [registry.catalog[name] for name in names])
    entries = [model_entry(registry, name, here[name]) for name in names]
    return {"object": "list", "data": entries,
            "models": [sie_shape(e) for e in entries]}


@router.get("/v1/models/{model:path}", responses={404: NOT_IN_CATALOG, "4XX": REFUSED},
            summary="One model (OpenAI's model object and SIE's "
            "ModelInfo in one)")
async def model(model: str, request: Request) -> JSONResponse:
    state = server_state(request)
    registry = state.registry
    await state.fresh_status()  # first: the engine may hold a model another process added
    if model not in registry.catalog:
        error = as_api_error(ModelNotFound(model, registry.names))
        return error_response(error.status, error.kind, error.message, error.param)
    here = await asyncio.to_thread(cached, [registry.catalog[model]])
    return JSONResponse(sie_shape(model_entry(registry, model, here[model])))


@router.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    state = server_state(request)
    # The engine writes a forward's metrics one turn after its answers (stats.defer):
    # that turn first, so a scrape counts every forward answered before it.
    await asyncio.sleep(0)
    # The engine's live figures (another process's, with --workers), read within 1 s;
    # a silent engine's stay as last read and this process's counters still answer.
    await state.fresh_status()
    return Response(generate_latest(state.metrics.exposition()),
                    media_type=CONTENT_TYPE_LATEST)


@router.get("/info", summary="TEI's /info: the default model and the server's limits")
async def info(request: Request) -> dict[str, Any]:
    state = server_state(request)
    settings, name = state.settings, state.settings.default_model
    await state.fresh_status()
    spec, loaded = state.registry.catalog[name], state.registry.info(name)
    kind = "embedding" if "encode" in spec.tasks else "reranker"
    dispatch = state.registry.dispatch(name)  # the budget in use, learned or set
    batch_tokens = (dispatch["windows"]["max_batch_tokens"] if dispatch is not None
                    else settings.worker.batch_tokens)
    return {
        "model_id": name, "model_sha": None, "model_dtype": "float32",
        "model_type": {kind: {"pooling": spec.pooling} if kind == "embedding" else {}},
        "max_input_length": loaded.max_seq_length if loaded else spec.max_seq_length,
        "max_concurrent_requests": settings.worker.max_queue_items,
        "max_batch_tokens": batch_tokens,
        "max_batch_requests": settings.worker.max_batch_items,
        "max_client_batch_size": settings.max_items_per_request,
        "auto_truncate": True, "tokenization_workers": max(settings.workers, 1),
        "version": __version__, "sha": None, "docker_label": None,
    }
