"""The inference routes, served without FastAPI's per-request machinery.

FastAPI keeps what it is good at: the routes are declared on its routers, so the
OpenAPI schema and /docs describe them, and it serves everything else (health,
models, metrics, docs). The requests of the routes declared with `InferenceRoute`
are taken before FastAPI's router sees them: the body is decoded once (JSON by orjson, or
msgpack), validated by the route's pydantic model, and handed to the endpoint.
That skips FastAPI's dependency solving and its own middleware stack, which the
profile showed cost more than the rest of a request (docs/bench/notes.md).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember.api import codec
from ember.api.errors import (
    INFERENCE_ERRORS,
    ApiError,
    as_api_error,
    error_response,
    validation_error,
)
from ember.api.state import ServerState, server_state

Endpoint = Callable[..., Awaitable[Response]]


class InferenceRoute(APIRoute):
    """A POST route whose requests the `InferenceDispatcher` serves (FastAPI documents it,
    with Ember's error body for each refusal in place of FastAPI's own 422)."""

    def __init__(self, path: str, endpoint: Callable[..., Any], *,
                 responses: dict[int | str, dict[str, Any]] | None = None,
                 **options: Any) -> None:
        super().__init__(path, endpoint, responses={**INFERENCE_ERRORS, **(responses or {})},
                         **options)


@dataclass(frozen=True)
class _Handler:
    """How to call one endpoint: its body model, and the names of its arguments."""

    route: InferenceRoute
    body_model: type[BaseModel]
    body_arg: str
    request_arg: str | None

    @classmethod
    def of(cls, route: InferenceRoute) -> _Handler:
        body_arg, body_model, request_arg = None, None, None
        hints = inspect.get_annotations(route.endpoint, eval_str=True)
        for name, hint in hints.items():
            if inspect.isclass(hint) and issubclass(hint, BaseModel):
                body_arg, body_model = name, hint
            elif hint is Request:
                request_arg = name
        if body_arg is None or body_model is None:
            raise TypeError(f"inference route {route.path} needs a pydantic body argument")
        return cls(route, body_model, body_arg, request_arg)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = scope.setdefault("state", {})
        state["route"] = self.route.path  # metrics and access log
        request = Request(scope, receive)
        server = server_state(request)
        named = scope.get("path_params", {}).get("model")
        if named is not None:  # counted under its model even if the body is refused
            state["model"] = server.model_label(named)
        try:
            codec.check_body_type(request.headers)  # from its headers: none of it is read
            body_bytes = await read_body(receive, server, body_idle_s(server))
            data = codec.decode(body_bytes, request.headers)
            if (crowded := codec.crowded_object(data, len(body_bytes))) is not None:
                place, fields = crowded
                raise ApiError(422, "invalid_request", f"an object of {fields:,} fields is over "
                               f"the limit of {codec.MAX_FIELDS}: a request's objects hold a "
                               "few named fields; send only those", place)
            try:
                body = self.body_model.model_validate(data)
            except ValidationError as exc:
                raise validation_error(exc.errors(include_url=False), self.body_model) from None
            arguments: dict[str, Any] = {**scope.get("path_params", {}), self.body_arg: body}
            if self.request_arg is not None:
                arguments[self.request_arg] = request
            endpoint: Endpoint = self.route.endpoint
            response = await endpoint(**arguments)
        except Exception as exc:
            # Built in a call of its own, so that no local of this frame (which the error's
            # traceback holds) names the error: no cycle keeps the body past the answer.
            response = refusal(request, exc)
        await response(scope, receive, send)


def refusal(request: Request, exc: Exception) -> Response:
    """The error answer of an inference route, counted where the request was refused."""
    if isinstance(exc, ClientDisconnect):  # gone mid-upload: a 499, as after it
        server_state(request).metrics.rejected("client_disconnected")
    error = as_api_error(exc)
    if error.status == 408:
        server_state(request).metrics.rejected(error.kind)
    return error_response(error.status, error.kind, error.message, error.param,
                          error.headers)


# A client that stops sending its body for this long, or takes this long to send all of
# it (16 MB at 140 KB/s), is answered 408 and its connection closed, so a half-sent or
# trickling body cannot hold a connection (and its memory) for ever.
BODY_IDLE_S = 30.0
BODY_WHOLE_S = 120.0
# In a drain, a body still arriving gets this long from the drain's start: a slow client
# must not hold the process's exit for as long as it pleases.
DRAIN_BODY_S = 10.0
WAIT_SLICE_S = 1.0  # how often a wait for the body looks whether a drain began


def body_idle_s(state: ServerState) -> float:
    """How long a body may pause. Behind Ray's proxy, which holds the client's connection,
    each part comes through a call to the proxy that a busy cluster delays (30 s and more
    under overload, which read as the client's silence): only the whole-body bound applies."""
    return BODY_WHOLE_S if state.settings.ray is not None else BODY_IDLE_S


async def read_body(receive: Receive, state: ServerState | None = None,
                    idle_s: float = BODY_IDLE_S, whole_s: float = BODY_WHOLE_S) -> bytes:
    """The whole request body, read straight from the ASGI messages (most bodies come in
    one), without Starlette's streaming generator; the next message is the disconnect."""
    chunks: list[bytes] = []
    started = time.monotonic()
    while True:
        message = await next_part(receive, state, started, idle_s, whole_s)
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def next_part(receive: Receive, state: ServerState | None, started: float,
                    idle_s: float, whole_s: float) -> Message:
    """The next ASGI message of a body begun at `started`, within its limits."""
    waited_from = time.monotonic()
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    cancels = task.cancelling()  # a slice's own cancel is counted from here
    while True:
        now = time.monotonic()
        drain_end = (state.drain_started + DRAIN_BODY_S if state is not None
                     and state.drain_started is not None else float("inf"))
        deadline = min(waited_from + idle_s, started + whole_s, drain_end)
        if deadline <= now:
            why = (f"no part of the request body came for {idle_s:g} s"
                   if deadline == waited_from + idle_s else
                   "the server is draining before shutdown, and the request body did not "
                   f"arrive whole within {DRAIN_BODY_S:g} s of it" if deadline == drain_end
                   else f"the request body did not arrive whole within {whole_s:g} s")
            raise ApiError(408, "request_timeout", f"{why}; send it whole", "body",
                           headers={"Connection": "close"})
        # In slices, so that a drain that begins meanwhile is seen (ASGI's receive is safe
        # to cancel: what arrives waits for the next call). A plain timer that cancels the
        # task costs a third of asyncio.timeout's set-up and tear-down on uvloop.
        sliced: list[bool] = []
        timer = loop.call_later(min(deadline - now, WAIT_SLICE_S), _end_slice, task, sliced)
        try:
            return await receive()
        except asyncio.CancelledError:
            if not sliced or task.uncancel() > cancels:  # cancelled for another reason too
                raise
        finally:
            timer.cancel()


def _end_slice(task: asyncio.Task[Any], sliced: list[bool]) -> None:
    sliced.append(True)
    task.cancel()


class InferenceDispatcher:
    """Serves the `InferenceRoute`s among `routes` directly and passes every other
    request on to FastAPI."""

    def __init__(self, app: ASGIApp, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        # Each route under the fixed part of its path: one string test rules out most.
        self.handlers = [(r.path.split("{", 1)[0], _Handler.of(r))
                         for r in routes if isinstance(r, InferenceRoute)]
        # The paths served so far (a path names a route and a model: a few of them), so
        # the routes' regular expressions run once per path, not once per request.
        self._matched: dict[str, tuple[_Handler, Scope] | None] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path: str = scope["path"]
            found = self._matched.get(path, _UNSEEN)
            if found is _UNSEEN:
                found = self._match(scope)
                if len(self._matched) >= MATCH_CACHE_SIZE:  # paths from arbitrary clients
                    self._matched.clear()
                self._matched[path] = found
            if found is not None:
                handler, child = found
                params = dict(child.get("path_params", {}))  # each request its own copy
                await handler({**scope, **child, "path_params": params}, receive, send)
                return
        await self.app(scope, receive, send)

    def _match(self, scope: Scope) -> tuple[_Handler, Scope] | None:
        path: str = scope["path"]
        for prefix, handler in self.handlers:
            if path.startswith(prefix):
                match, child = handler.route.matches(scope)
                if match is Match.FULL:
                    return handler, child
        return None


MATCH_CACHE_SIZE = 1024
_UNSEEN: Any = object()

