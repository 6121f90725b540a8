"""Liveness, readiness, the model list and the metrics endpoint."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ember.api.errors import error_response
from ember.api.state import server_state
from ember.config import FAMILY_OUTPUTS
from ember.outputs import DTYPES

router = APIRouter(tags=["operations"])


@router.get("/healthz", summary="The process is alive")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="The default model is loaded and the server is not draining")
async def readyz(request: Request) -> JSONResponse:
    state = server_state(request)
    default = state.settings.default_model
    if state.draining:
        return error_response(503, "unavailable", "draining before shutdown")
    await state.registry.refresh()
    if state.registry.state(default) != "loaded":
        return error_response(503, "not_ready", f"default model {default!r} is "
                              f"{state.registry.state(default)}")
    return JSONResponse({"status": "ready", "default_model": default})


@router.get("/v1/models", summary="The catalog: every model, its tasks, outputs and state")
async def models(request: Request) -> dict[str, Any]:
    registry = server_state(request).registry
    await registry.refresh()
    data = []
    for name in registry.names:
        spec = registry.catalog[name]
        entry: dict[str, Any] = {
            "id": name, "object": "model", "owned_by": "ember", "adapter": spec.adapter,
            "tasks": list(spec.tasks), "state": registry.state(name),
            "description": spec.description, "loras": sorted(spec.loras),
            "max_seq_length": spec.max_seq_length, "dims": None,
            "output_types": list(FAMILY_OUTPUTS.get(spec.adapter, ())),
        }
        info = registry.info(name)
        if info is not None:
            entry.update(dims=info.dims, max_seq_length=info.max_seq_length,
                         output_types=list(info.output_types) if "encode" in info.tasks
                         else [])
            if info.labels:
                entry["labels"] = list(info.labels)
        entry["output_dtypes"] = list(DTYPES) if entry["output_types"] else []
        data.append(entry)
    return {"object": "list", "data": data}


@router.get("/metrics", summary="Prometheus metrics")
async def metrics(request: Request) -> Response:
    state = server_state(request)
    for gather in state.on_metrics:  # figures that live in another process
        await gather()
    return Response(generate_latest(state.metrics.exposition()),
                    media_type=CONTENT_TYPE_LATEST)
