"""The FastAPI application: routes, middleware, error handling, model lifecycle."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import BaseRoute
from starlette.types import ASGIApp

from ember import __version__, heap
from ember.api import cohere, errors, health, native, openai, rerank, tei
from ember.api.middleware import (
    GateMiddleware,
    RequestContextMiddleware,
    draining,
    missing_key,
    wrong_host,
)
from ember.api.routing import InferenceDispatcher
from ember.api.state import Models, ServerState
from ember.config import ServerSettings
from ember.metrics import Metrics, ReportedDepths
from ember.registry import Registry, preload_models

log = logging.getLogger("ember.api")
# What a page's script may read of an answer under --cors-allow-origin. It may send any
# header: the SDKs add their own (x-stainless-*, x-fern-*), and no cookie is allowed.
CORS_RESPONSE_HEADERS = ["x-request-id", "x-sie-request-id", "x-queue-time-ms",
                         "x-inference-time-ms", "x-total-time-ms", "retry-after"]


class EmberAPI(FastAPI):
    """FastAPI with Ember's layers outside its own middleware stack. A request meets:
    headers and accounting, the Host check, CORS (if asked for), the API key, the drain,
    the body limit;
    then the inference routes are served at once (`InferenceDispatcher`) and the rest go
    through FastAPI."""

    def __init__(self, state: ServerState, **options: Any) -> None:
        super().__init__(**options)
        self.state.ember = state
        self.inference_routes: list[BaseRoute] = []

    def include_inference_router(self, router: APIRouter) -> None:
        self.include_router(router)
        self.inference_routes += router.routes

    def build_middleware_stack(self) -> ASGIApp:
        app: ASGIApp = InferenceDispatcher(super().build_middleware_stack(),
                                           self.inference_routes)
        state = self.state.ember
        checks = [missing_key, draining]
        origins = state.settings.cors_origins
        if origins:  # outside the key: a browser's preflight carries none
            app = GateMiddleware(app, lambda: state, checks, limit_body=True)
            app = CORSMiddleware(app, allow_origins=list(origins), allow_methods=["GET", "POST"],
                                 allow_headers=["*"],
                                 expose_headers=CORS_RESPONSE_HEADERS, max_age=600)
            app = GateMiddleware(app, lambda: state, [wrong_host])
        else:
            app = GateMiddleware(app, lambda: state, [wrong_host, *checks], limit_body=True)
        return RequestContextMiddleware(app, lambda: state)


def create_app(settings: ServerSettings, registry: Models) -> EmberAPI:
    """An app serving `registry` (a local `Registry`, or the engine process's models in an
    API process of several); the default model and the preload list load at startup in
    the background, so /healthz answers while they load and /readyz says when done."""
    metrics = Metrics(process=isinstance(registry, Registry))  # the whole server is here
    state = ServerState(settings, registry, metrics)
    if isinstance(registry, Registry):
        metrics.attach(registry)
        metrics.process_starts.labels("server").inc()
    elif isinstance(registry, ReportedDepths):
        metrics.report(registry)
        metrics.process_starts.labels("api").inc()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        heap.settle()  # what start-up made lives as long as the process
        preload = asyncio.create_task(preload_models(registry, [settings.default_model,
                                                                 *settings.preload]))
        yield
        preload.cancel()
        await registry.close()

    # Ember reports through /metrics and its logs; FastAPI's own OpenTelemetry hooks
    # would look up the tracer and meter providers on every request.
    app = EmberAPI(state, title="Ember", version=__version__, lifespan=lifespan,
                   telemetry={"tracing": False, "metrics": False, "logs": False},
                   description="Embeddings, reranking and entity extraction with dynamic "
                   "batching.")
    errors.install(app)
    for family in (native, openai, rerank, cohere, tei):
        app.include_inference_router(family.router)
    app.include_router(health.router)
    return app

