"""Wire formats: JSON by default, msgpack (msgpack-numpy layout for arrays) on request."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import msgpack_numpy
import numpy as np
from fastapi import Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember.api.errors import BodyTooLarge, as_api_error, error_response

MSGPACK = "application/msgpack"
MSGPACK_TYPES = (MSGPACK, "application/x-msgpack")


def _json_default(value: object) -> object:
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def wants_msgpack(request: Request) -> bool:
    accept = request.headers.get("accept", "")
    return any(kind in accept for kind in MSGPACK_TYPES)


def render(request: Request, payload: Any, status: int = 200) -> Response:
    """The payload as msgpack if the client accepts it, else JSON; arrays go as arrays."""
    if wants_msgpack(request):
        body = msgpack.packb(payload, default=msgpack_numpy.encode, use_bin_type=True)
        return Response(body, status_code=status, media_type=MSGPACK)
    body = json.dumps(payload, default=_json_default, separators=(",", ":"),
                      allow_nan=False).encode()
    return Response(body, status_code=status, media_type="application/json")


class MsgpackBodyMiddleware:
    """Turns a msgpack request body into JSON before routing, so every route and the
    OpenAPI schema deal with one shape. A body that does not decode is a 422."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _is_msgpack(scope):
            await self.app(scope, receive, send)
            return
        raw = bytearray()
        try:
            while True:
                message = await receive()
                raw += message.get("body", b"")
                if not message.get("more_body"):
                    break
        except BodyTooLarge as exc:  # raised outside the routes' exception handlers
            error = as_api_error(exc)
            await error_response(error.status, error.kind, error.message,
                                 error.param)(scope, receive, send)
            return
        try:
            decoded = msgpack.unpackb(bytes(raw), object_hook=msgpack_numpy.decode, raw=False,
                                      strict_map_key=False)
            body = json.dumps(decoded, default=_json_default, allow_nan=False).encode()
        except Exception:
            response = error_response(422, "invalid_request",
                                      "the request body is not valid msgpack", "body")
            await response(scope, receive, send)
            return
        headers = [(k, v) for k, v in scope["headers"]
                   if k not in (b"content-type", b"content-length")]
        headers += [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())]
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app({**scope, "headers": headers}, replay, send)


def _is_msgpack(scope: Scope) -> bool:
    for key, value in scope["headers"]:
        if key == b"content-type":
            return value.split(b";")[0].strip().decode("latin-1") in MSGPACK_TYPES
    return False
