"""The FastAPI application: routes, middleware, error handling, model lifecycle."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from ember import __version__
from ember.api import errors, health, native, openai, rerank, tei
from ember.api.codec import MsgpackBodyMiddleware
from ember.api.metrics import Metrics
from ember.api.middleware import GateMiddleware, RequestContextMiddleware
from ember.api.state import ServerState
from ember.config import ServerSettings
from ember.registry import Registry

log = logging.getLogger("ember.api")


def create_app(settings: ServerSettings, registry: Registry) -> FastAPI:
    """An app serving `registry`; the default model and the preload list load at startup
    in the background, so /healthz answers while they load and /readyz says when done."""
    metrics = Metrics()
    metrics.attach(registry)
    state = ServerState(settings, registry, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        names = list(dict.fromkeys([settings.default_model, *settings.preload]))
        preload = asyncio.create_task(_preload(registry, names))
        yield
        preload.cancel()
        await registry.close()

    app = FastAPI(title="Ember", version=__version__, lifespan=lifespan,
                  description="Embeddings, reranking and entity extraction with dynamic "
                  "batching.")
    app.state.ember = state
    errors.install(app)
    for family in (native, openai, rerank, tei, health):
        app.include_router(family.router)
    # Outermost first: headers on everything, then refusals, then body decoding.
    app.add_middleware(MsgpackBodyMiddleware)
    app.add_middleware(GateMiddleware, state=lambda: state)
    app.add_middleware(RequestContextMiddleware, state=lambda: state)
    return app


async def _preload(registry: Registry, names: list[str]) -> None:
    for name in names:
        try:
            await registry.get(name)
        except Exception as exc:  # the server stays up; the model's routes say why
            log.error("could not preload %s: %s", name, exc)
