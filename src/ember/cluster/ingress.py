"""The ingress deployment: `ember serve`'s HTTP API (`create_app`) in a Serve replica,
over the engine replicas. Ray's HTTP proxy accepts the connections and hands each request
to an ingress replica; the routes parse, validate and tokenize here, and the forwards run
on the engine replicas."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember.adapters.base import Runtime
from ember.api.app import create_app
from ember.cluster.client import RayEngineClient
from ember.cluster.engine import ENGINE
from ember.config import ServerSettings, load_catalog
from ember.hub import let_requests_download
from ember.ipc.models import RemoteModels
from ember.logs import configure_logging


class ProxyRequestId:
    """Ray's proxy adds `X-Request-ID` to every response itself, with the id Ember's
    middleware also used (the client's, or the one the proxy put on the request). Ember's
    own copy is left out, so a client reads one value rather than the two joined."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_once(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ())
                           if k.lower() != b"x-request-id"]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_once)


@serve.ingress()  # the app is built in the replica: `__serve_build_asgi_app__`
class EmberIngress:
    def __init__(self, settings: ServerSettings, engine_app: str) -> None:
        configure_logging(settings)
        if settings.allow_hub_models:  # a replica on another node has not inherited it
            let_requests_download(True, settings.max_download_gb)
        self.settings = settings
        # The engine is an application of its own, so a drain can stop this one first.
        self.engine: DeploymentHandle[Any] = serve.get_deployment_handle(ENGINE, engine_app)

    def __serve_build_asgi_app__(self) -> ASGIApp:
        settings = self.settings
        models = RemoteModels(load_catalog(settings.model_dirs, settings.model_paths),
                              Runtime.from_settings(settings), RayEngineClient(self.engine),
                              settings.worker)
        app = create_app(settings, models)
        # Ray's replica wrapper runs the lifespan of what we return (preload, close); the
        # wrapper passes the lifespan through untouched.
        return ProxyRequestId(app)
