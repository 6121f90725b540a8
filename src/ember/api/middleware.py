"""Cross-cutting HTTP concerns (outermost first): the request's context and accounting,
then the gate's checks: Host, API key, draining, body size (`api/app.py` puts Starlette's
CORS, when asked for, between the Host and the API key)."""

from __future__ import annotations

import asyncio
import hmac
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember.api.errors import CLIENT_CLOSED_REQUEST, BodyTooLarge, error_response
from ember.api.state import SERVER_KEY, ServerState
from ember.errors import described
from ember.logs import REQUEST_ID, access_log, handling
from ember.metrics import labelled

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/health"})
# Read while a drain runs, so an operator can watch it finish (and scrape its last counts).
WATCHED_PATHS = frozenset({"/metrics", "/v1/models", "/info"})


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
    """X-Request-Id (the client's, or a new one; also as X-SIE-Request-ID, where sie-sdk
    reads it) and the timing headers on every response; counts requests in flight so a
    drain knows when all have been answered. While the server drains, every response says
    `Connection: close`, so no client sends another request on a connection that is about
    to close. Every request, refusals included, is counted with its status and written to
    the access log once its response has started."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        ids = headers_named(scope, REQUEST_ID_HEADERS)
        request_id = (usable_id(ids.get(b"x-request-id", ""))
                      or usable_id(ids.get(b"x-sie-request-id", "")) or new_request_id())
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        logged_as = handling(request_id)
        started = time.perf_counter()
        server = self.state()
        scope[SERVER_KEY] = server  # what server_state reads
        status: int | None = None  # until the response starts

        async def send_with_headers(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                queue_ms, inference_ms = state.get("timing", (0.0, 0.0))
                encoded_id = request_id.encode("latin-1", "replace")
                headers = [
                    *message.get("headers", ()),
                    (b"x-request-id", encoded_id),
                    (b"x-sie-request-id", encoded_id),
                    (b"x-queue-time-ms", b"%.2f" % queue_ms),
                    (b"x-inference-time-ms", b"%.2f" % inference_ms),
                    (b"x-total-time-ms", b"%.2f" % ((time.perf_counter() - started) * 1e3)),
                ]
                if server.draining:
                    headers.append((b"connection", b"close"))
                message = {**message, "headers": headers}
            elif status is not None and status >= 400 and "error" not in state:
                state["error"] = refusal(message.get("body", b""))  # for the access log
            await send(message)

        server.enter()
        try:
            await self.app(scope, receive, send_with_headers)
        except asyncio.CancelledError:
            if status is None:  # not answered: Ray Serve cancels a request its client left
                status = CLIENT_CLOSED_REQUEST
                server.metrics.rejected("client_disconnected")
            raise
        finally:
            try:  # logged before it stops counting as in flight: a drain's count holds it
                # 500: what the client sees if the app failed before it answered
                self.account(scope, state, status or 500, time.perf_counter() - started)
            finally:
                server.leave()
                REQUEST_ID.reset(logged_as)

    def account(self, scope: Scope, state: dict[str, Any], status: int,
                seconds: float) -> None:
        route = state.get("route") or _route_template(scope)
        model = state.get("model", "")
        metrics = self.state().metrics
        labelled(metrics.requests, route, model, str(status)).inc()
        labelled(metrics.request_seconds, route).observe(seconds)
        queue_ms, inference_ms = state.get("timing", (0.0, 0.0))
        error, param = state.get("error", (None, None))
        access_log(scope["method"], scope["path"], route, model, status,
                   state.get("items", 0), queue_ms, inference_ms, seconds * 1e3,
                   state["request_id"], scope.get("client"), error, param,
                   draining=self.state().draining)


def refusal(body: bytes) -> tuple[str | None, str | None]:
    """An error body's type and field (`{"error": {"type", "param"}}`), or Nones for a
    body of another shape."""
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return None, None
    if not isinstance(error, dict):
        return None, None
    kind, param = error.get("type"), error.get("param")
    return (kind if isinstance(kind, str) else None,
            param if isinstance(param, str) else None)


# A client's request id is echoed in two headers and every log line of its request.
MAX_REQUEST_ID = 200
REQUEST_ID_HEADERS = frozenset({b"x-request-id", b"x-sie-request-id"})


def usable_id(value: str) -> str:
    """The client's request id when it is one: visible ASCII (no space, which would let it
    write fields of its own into a text log line), at most MAX_REQUEST_ID characters; ""
    otherwise, and the server makes its own."""
    if len(value) <= MAX_REQUEST_ID and value.isascii() and value.isprintable() \
            and " " not in value:
        return value
    return ""


def new_request_id() -> str:
    """128 random bits in hex. An id needs to be unique, not secret: Python's generator
    (reseeded in a forked child) costs 0.3 us, where os.urandom's system call measured
    7.6 us on average under load (21 us at p90)."""
    return f"{random.getrandbits(128):032x}"


def _route_template(scope: Scope) -> str:
    """The matched route's path template (`/v1/models/{model:path}`), never the raw path,
    so the metric's label values stay few; `unrouted` for a request refused before routing
    (401, 413, draining) or matching no route (404)."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    if isinstance(path, str):
        return path
    # FastAPI's own pages (/docs, /openapi.json) are Starlette routes without parameters:
    # matched, they set an endpoint and no route, and their path is their template.
    return str(scope["path"]) if "endpoint" in scope else "unrouted"


def watched(scope: Scope) -> bool:
    path: str = scope["path"]
    return path in OPEN_PATHS or (scope["method"] == "GET" and (
        path in WATCHED_PATHS or path.startswith("/v1/models/")))


@dataclass(frozen=True)
class Refusal:
    """An answer given before any work, counted under `reason`."""

    reason: str
    status: int
    kind: str
    message: str
    param: str | None = None
    headers: dict[str, str] | None = None


# A check reads the request's scope, its headers of GATE_HEADERS (first value each, by
# lower-case name) and the server; it answers a refusal or None.
Check = Callable[[Scope, dict[bytes, str], ServerState], Refusal | None]
GATE_HEADERS = frozenset({b"host", b"authorization", b"content-length", b"transfer-encoding"})


class GateMiddleware(HttpMiddleware):
    """The checks a request passes before any work, in order, in one layer (a layer each
    cost a coroutine a request); the first that refuses answers. With `limit_body`, last,
    the body's size: a declared length over the limit is refused at once, and a body no
    valid length frames is counted as it streams in."""

    def __init__(self, app: ASGIApp, state: Callable[[], ServerState],
                 checks: Sequence[Check], limit_body: bool = False) -> None:
        super().__init__(app, state)
        self.checks = tuple(checks)
        self.limit_body = limit_body

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = self.state()
        sent = headers_named(scope, GATE_HEADERS)
        refused = None
        for check in self.checks:
            if (refused := check(scope, sent, server)) is not None:
                break
        if refused is None and self.limit_body:
            limit = server.settings.max_body_bytes
            declared = declared_length(sent)
            if declared is not None and declared > limit:
                refused = Refusal("body_too_large", 413, "payload_too_large",
                                  f"{over_the_limit(limit)}; send fewer or shorter items "
                                  "per request", "body")
            # HTTP/1.1 frames a body by its Content-Length (and refuses one sent with
            # Transfer-Encoding too): only a body without a valid one can run past it.
            elif declared is None or b"transfer-encoding" in sent:
                receive = self._capped(receive, limit)
        if refused is not None:
            server.metrics.rejected(refused.reason)
            await error_response(refused.status, refused.kind, refused.message, refused.param,
                                 refused.headers)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _capped(self, receive: Receive, limit: int) -> Receive:
        seen = 0

        async def capped() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                self.state().metrics.rejected("body_too_large")
                raise BodyTooLarge(over_the_limit(limit))
            return message

        return capped


def over_the_limit(limit: int) -> str:
    return f"request body is over the limit of {limit} bytes (--max-body-bytes)"


def wrong_host(scope: Scope, sent: dict[bytes, str], server: ServerState) -> Refusal | None:
    """400 for a Host header this server does not answer to (`answered_hosts`): a page
    that rebinds its own DNS name to a loopback server sends its own name."""
    answered = server.settings.answered_hosts
    if answered is None:
        return None
    host = sent.get(b"host", "")
    if not host or host_name(host) in answered:
        return None
    # Which names it answers to is not said: after a rebinding the page reads this.
    return Refusal("invalid_host", 400, "invalid_request",
                   f"the Host header names {described(host)}, which this server does not "
                   "answer to: start it with --allowed-host for the name clients use", "Host")


def host_name(header: str) -> str:
    """A Host header's name, without its port (`[::1]:8080` -> `[::1]`)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[:header.find("]") + 1] if "]" in header else header
    return header.partition(":")[0].rstrip(".")  # `localhost.` is `localhost`


def missing_key(scope: Scope, sent: dict[bytes, str], server: ServerState) -> Refusal | None:
    """401 unless `Authorization: Bearer <key>` matches, when a key is set."""
    key = server.settings.api_key
    if not key or scope["path"] in OPEN_PATHS or _authorized(
            sent.get(b"authorization", ""), key):
        return None
    return Refusal("unauthorized", 401, "unauthorized",
                   "missing or wrong API key: send 'Authorization: Bearer <key>'",
                   headers={"WWW-Authenticate": "Bearer"})


def draining(scope: Scope, sent: dict[bytes, str], server: ServerState) -> Refusal | None:
    """503 for new work once a drain has begun (health checks, metrics and the model list
    still answer)."""
    if not server.draining or watched(scope):
        return None
    return Refusal("draining", 503, "unavailable", "the server is draining before shutdown; "
                   "retry on another instance", headers={"Retry-After": "5"})


def declared_length(sent: dict[bytes, str]) -> int | None:
    """The body's length as its Content-Length declares it; None without a valid one."""
    value = sent.get(b"content-length", "")
    if not (value.isascii() and value.isdigit()):
        return None
    value = value.lstrip("0") or "0"  # HTTP's parser takes leading zeros
    # 19 digits and more are past any limit (and int() refuses 4,301 of them).
    return int(value) if len(value) <= 18 else 2**63


def _authorized(header: str, key: str) -> bool:
    scheme, _, token = header.partition(" ")
    # compare_digest takes constant time whatever the token, so it leaks nothing.
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              key.encode())


def headers_named(scope: Scope, names: frozenset[bytes]) -> dict[bytes, str]:
    """The first value of each header of `names` the request sent, in one pass."""
    found: dict[bytes, str] = {}
    for key, value in scope["headers"]:
        if key in names and key not in found:
            found[key] = value.decode("latin-1")
    return found
