"""Cross-cutting HTTP concerns, each a small ASGI middleware."""

from __future__ import annotations

import hmac
import time
import uuid
from collections.abc import Callable

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember.api.errors import BodyTooLarge, error_response
from ember.api.state import ServerState

OPEN_PATHS = frozenset({"/healthz", "/readyz"})


class HttpMiddleware:
    """Passes anything but HTTP (lifespan) straight through; subclasses handle `http`."""

    def __init__(self, app: ASGIApp, state: Callable[[], ServerState]) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class RequestContextMiddleware(HttpMiddleware):
    """X-Request-Id (the client's, or a new one) and the timing headers on every response;
    counts requests in flight so a drain knows when all have been answered."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = time.perf_counter()
        server = self.state()

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                timing = scope["state"].get("timing", (0.0, 0.0))
                headers = list(message.get("headers", []))
                headers += [
                    (b"x-request-id", request_id.encode("latin-1", "replace")),
                    (b"x-queue-time-ms", f"{timing[0]:.2f}".encode()),
                    (b"x-inference-time-ms", f"{timing[1]:.2f}".encode()),
                    (b"x-total-time-ms", f"{(time.perf_counter() - started) * 1e3:.2f}".encode()),
                ]
                message = {**message, "headers": headers}
            await send(message)

        server.enter()
        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            server.leave()


class GateMiddleware(HttpMiddleware):
    """Refusals before any work: draining (503), API key (401), body size (413)."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = self.state()
        settings = server.settings
        path: str = scope["path"]
        headers = Headers(scope=scope)
        refusal = None
        if path not in OPEN_PATHS and settings.api_key and not _authorized(
                headers.get("authorization", ""), settings.api_key):
            refusal = ("unauthorized", error_response(
                401, "unauthorized", "missing or wrong API key: send 'Authorization: Bearer "
                "<key>'", headers={"WWW-Authenticate": "Bearer"}))
        elif server.draining and path not in OPEN_PATHS:
            refusal = ("draining", error_response(
                503, "unavailable", "the server is draining before shutdown; retry on "
                "another instance", headers={"Retry-After": "5"}))
        elif _declared_length(headers) > settings.max_body_bytes:
            refusal = ("body_too_large", _too_large(settings.max_body_bytes))
        if refusal is not None:
            server.metrics.rejected(refusal[0])
            await refusal[1](scope, receive, send)
            return
        await self.app(scope, _capped(receive, settings.max_body_bytes, server), send)


def _authorized(header: str, key: str) -> bool:
    scheme, _, token = header.partition(" ")
    # compare_digest takes constant time whatever the token, so it leaks nothing.
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              key.encode())


def _declared_length(headers: Headers) -> int:
    try:
        return int(headers.get("content-length", "0"))
    except ValueError:
        return 0


def _too_large(limit: int) -> JSONResponse:
    return error_response(413, "payload_too_large",
                          f"request body is over the limit of {limit} bytes; send fewer or "
                          "shorter items per request", "body")


def _capped(receive: Receive, limit: int, server: ServerState) -> Receive:
    """A receive that refuses a chunked body once it passes the limit."""
    seen = 0

    async def capped() -> Message:
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > limit:
            server.metrics.rejected("body_too_large")
            raise BodyTooLarge(f"request body is over the limit of {limit} bytes")
        return message

    return capped
