"""The error body of docs/architecture.md (HTTP API and wire contract),
`{"error": {"type", "message", "param"?, "code"}}`, and its statuses. `code` is SIE's
dialect: the upper-case codes sie-sdk maps to its typed errors (`INPUT_TOO_LONG` ->
InputTooLongError, `MODEL_LOAD_FAILED` -> ModelLoadFailedError, a 429 -> RateLimitError
after its retries)."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ember.api.fields import suggestion
from ember.engine import (
    EngineError,
    QueueFull,
    RequestTooLarge,
    ShuttingDown,
    WorkerFailed,
)
from ember.errors import (
    EmberError,
    InputTooLong,
    InvalidInput,
    ModelLoadError,
    ModelNotFound,
    UnsupportedOutput,
    UnsupportedTask,
    json_kind,
    shown,
)
from ember.ipc.wire import RemoteFault

log = logging.getLogger("ember.api")
CLIENT_CLOSED_REQUEST = 499  # the status nginx made for a client that left before its answer
_PATH = re.compile(r"(?<![\w.])/(?:[\w.@+-]+/)+[\w.@+-]*")
_QUOTED_PATH = re.compile(r"'/[^'\n]*'|\"/[^\"\n]*\"")  # whole, spaces and all


class ApiError(Exception):
    """An HTTP refusal raised from a route or middleware."""

    def __init__(self, status: int, kind: str, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.kind = kind
        self.message = message
        self.param = param
        self.headers = headers or {}
        super().__init__(message)


class BodyTooLarge(StarletteHTTPException):
    """A streamed request body passed the byte limit. An HTTPException, so FastAPI's body
    parsing lets it through (it turns any other exception into a 400)."""

    def __init__(self, message: str) -> None:
        super().__init__(413, message)


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


class RequestTimeout(TimeoutError):
    """The request ran past the server's --request-timeout-s (`seconds`)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"{seconds:g} s")
        self.seconds = seconds


def scrub(message: str) -> str:
    """Internal file paths never reach a client."""
    return _PATH.sub("<path>", _QUOTED_PATH.sub("<path>", message))


def error_code(kind: str) -> str:
    """SIE's code for an error type: the type in upper case (`queue_full` -> QUEUE_FULL)."""
    return kind.upper()


class ErrorDetail(BaseModel):
    type: str = Field(description="what went wrong, e.g. invalid_request, queue_full")
    message: str = Field(description="what happened, the limit, and what to do")
    param: str | None = Field(None, description="the request field at fault, e.g. "
                              "items[3].text (absent when no one field is)")
    code: str = Field(description="SIE's code: the type in upper case")


class ErrorBody(BaseModel):
    """Every refusal's body, on every route (OpenAI's shape, with SIE's `code`)."""

    error: ErrorDetail


# The refusals an inference route may answer, for the OpenAPI schema (docs/architecture.md).
INFERENCE_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": why} for status, why in (
        (400, "an input over the model's token limit with truncation off, or a Host "
              "header the server does not answer to (--allowed-host)"),
        (401, "a missing or wrong API key (a server started with --api-key)"),
        (404, "an unknown model, or a Hub model this server may not download"),
        (408, "a body that stopped coming"),
        (413, "a body or a request over a limit (bytes, items, the queue's size)"),
        (415, "a body that is neither JSON nor msgpack, or is compressed"),
        (422, "a field missing, unknown, or out of its range: `param` names it"),
        (429, "the model's queue is full: retry after Retry-After"),
        (500, "the forward failed (nothing of the server's internals is shown)"),
        (502, "the model could not be loaded or downloaded"),
        (503, "the server is draining, or the engine is restarting"),
        (504, "the request timed out (--request-timeout-s)"),
    )}


def error_body(kind: str, message: str, param: str | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"type": kind, "message": message}
    if param is not None:
        error["param"] = param
    error["code"] = error_code(kind)
    return {"error": error}


# Other servers' routes a client may call here: a 404 that says what to use instead.
UNSERVED_ROUTES = {
    "/predict": "(TEI's sequence classification) is not served: Ember runs embedding, "
                "reranking and extraction models; a reranker scores pairs on /rerank",
    "/embed_all": "(TEI's unpooled token vectors) is not served; token vectors come from "
                  "a model that makes them (ColBERT, BGE-M3) on POST /v1/encode/{model} with "
                  "params.output_types [\"multivector\"]",
    "/v1/classify": "(Cohere's classify) is not served",
    "/v2/classify": "(Cohere's classify) is not served",
}


def error_response(status: int, kind: str, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(kind, message, param), status_code=status, headers=headers)


def body_loc(loc: Sequence[int | str]) -> tuple[int | str, ...]:
    """pydantic's location of a body field, without FastAPI's leading 'body'."""
    return tuple(loc[1:] if loc and loc[0] == "body" else loc)


def field_path(loc: tuple[int | str, ...]) -> str:
    """('body', 'items', 3, 'text') -> 'items[3].text'"""
    path = ""
    for part in body_loc(loc):
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "body"


def as_api_error(exc: Exception) -> ApiError:
    """Map an exception from any layer to its HTTP status and error type."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ClientGone):
        return ApiError(CLIENT_CLOSED_REQUEST, "client_closed_request",
                        "the client disconnected; what of its work was still queued was "
                        "dropped")
    if isinstance(exc, ClientDisconnect):  # before its body was whole: nothing ran
        return ApiError(CLIENT_CLOSED_REQUEST, "client_closed_request",
                        "the client disconnected before its request body was read")
    if isinstance(exc, BodyTooLarge):
        return ApiError(413, "payload_too_large", f"{exc.detail}; send fewer or shorter items "
                        "per request", "body")
    if isinstance(exc, InputTooLong):
        # 400 with INPUT_TOO_LONG is what sie-sdk turns into its InputTooLongError.
        return ApiError(400, "input_too_long", exc.message, exc.param)
    if isinstance(exc, UnsupportedOutput):
        return ApiError(422, "unsupported_output", exc.message, exc.param)
    if isinstance(exc, InvalidInput):
        return ApiError(422, "invalid_request", exc.message, exc.param)
    if isinstance(exc, UnsupportedTask):
        return ApiError(422, "unsupported_task", str(exc), "model")
    if isinstance(exc, ModelNotFound):
        return ApiError(404, "model_not_found", str(exc), "model")
    if isinstance(exc, ModelLoadError):
        # 502 MODEL_LOAD_FAILED without Retry-After: sie-sdk fails at once instead of
        # retrying for minutes (a failed load is tried again only a while later, if ever).
        return ApiError(502, "model_load_failed", scrub(str(exc)), "model")
    if isinstance(exc, QueueFull):
        return ApiError(429, "queue_full", str(exc), headers={"Retry-After": "1"})
    if isinstance(exc, RequestTooLarge):
        return ApiError(413, "payload_too_large", str(exc), "items")
    if isinstance(exc, WorkerFailed):
        return ApiError(503, "unavailable", scrub(str(exc)), headers={"Retry-After": "1"})
    if isinstance(exc, ShuttingDown):
        return ApiError(503, "unavailable", "the server is shutting down; retry on another "
                        "instance", headers={"Retry-After": "5"})
    if isinstance(exc, TimeoutError):  # here, or in the engine process
        of = f" of {exc.seconds:g} s" if isinstance(exc, RequestTimeout) else ""
        return ApiError(504, "timeout", f"the request did not finish within the server's "
                        f"request timeout{of} (--request-timeout-s); what of it was still "
                        "queued was dropped")
    # A fault from the engine process is already named by its original type.
    what = str(exc) if isinstance(exc, RemoteFault) else f"{type(exc).__name__}: {exc}"
    log.error("inference failed: %s", what)
    return ApiError(500, "inference_error", scrub(f"inference failed: {what}"))


UNKNOWN_NAMED = 5  # unknown fields an error names


def validation_error(errors: Sequence[Any], model: type[BaseModel] | None = None) -> ApiError:
    """A 422 naming the first field pydantic refused (`items[3].text`, or `body`); an
    unknown field of `model`'s body is told the one it most likely stands for."""
    unknown = [body_loc(e.get("loc", ())) for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:
        many = len(unknown) > 1
        listed = unknown[:UNKNOWN_NAMED]
        meant = [suggestion(model, loc) if model is not None else None for loc in listed]
        named = [shown(field_path(loc)) + ("" if where is None else
                                           f" (did you mean {field_path(where)}?)")
                 for loc, where in zip(listed, meant, strict=True)]
        if len(unknown) > UNKNOWN_NAMED:  # a body of many keys makes no long message
            named.append(f"and {len(unknown) - UNKNOWN_NAMED} more")
        told = sum(where is not None for where in meant)
        advice = f" remove {'them' if many else 'it'};" if not told else \
            " remove the others;" if told < len(unknown) else ""
        return ApiError(422, "invalid_request",
                        f"unknown field{'s' if many else ''} {', '.join(named)}:{advice} the "
                        "server refuses what it does not know rather than ignore it "
                        "(/openapi.json and /docs list each route's fields)",
                        shown(field_path(unknown[0])))
    first = errors[0] if errors else {"loc": (), "msg": "invalid body"}
    if first.get("type") == "json_invalid":  # its loc is a character offset, not a field
        context = first.get("ctx")
        reason = context.get("error", "malformed") if isinstance(context, dict) else "malformed"
        return ApiError(422, "invalid_request", f"body: invalid JSON ({reason})", "body")
    context = first.get("ctx")
    if isinstance(context, dict) and isinstance(context.get("param"), str):
        # A validator of ours that names the place itself (`input[1]`) and says it whole.
        return ApiError(422, "invalid_request", str(first.get("msg")), context["param"])
    loc = tuple(first.get("loc", ()))
    tag = next((i for i, part in enumerate(loc) if _is_union_member(part)), None)
    if tag is not None:  # a value no member of a union took: name the field and the forms
        forms = dict.fromkeys(str(e["loc"][tag]) for e in errors
                              if tuple(e.get("loc", ()))[:tag] == loc[:tag]
                              and len(e.get("loc", ())) > tag)
        param = field_path(loc[:tag])
        return ApiError(422, "invalid_request", f"{param}: expected one of "
                        f"{', '.join(forms)}", param)
    param = field_path(loc)
    if first.get("type") == "model_type":  # pydantic's words name our classes: say it plainly
        return ApiError(422, "invalid_request", f"{param}: {object_wanted(first)}", param)
    return ApiError(422, "invalid_request", f"{param}: {first.get('msg', 'invalid value')}",
                    param)


# What an object field looks like, for a body that sent something else in its place.
_OBJECT_EXAMPLES = {"Item": '{"text": "..."}',
                    "ImagePart": '{"data": "<base64 bytes>", "format": "png"}'}


def object_wanted(error: Mapping[str, Any]) -> str:
    context = error.get("ctx")
    name = context.get("class_name", "") if isinstance(context, dict) else ""
    like = f" like {_OBJECT_EXAMPLES[name]}" if name in _OBJECT_EXAMPLES else \
        " with this route's fields (/openapi.json and /docs list them)"
    sent = error.get("input")
    got = "null or no body" if sent is None else json_kind(sent)
    return f"expected a JSON object{like}, got {got}"


# How pydantic names a union's member in an error's location (`input.list[str]`).
_UNION_MEMBER = re.compile(r"(str|int|float|bool|bytes|(list|dict|tuple|set)\[.*\])")


def _is_union_member(part: int | str) -> bool:
    return isinstance(part, str) and _UNION_MEMBER.fullmatch(part) is not None


def install(app: FastAPI) -> None:
    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        error = as_api_error(exc)
        return error_response(error.status, error.kind, error.message, error.param,
                              error.headers)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        error = validation_error(exc.errors())
        return error_response(error.status, error.kind, error.message, error.param)

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 400:  # only FastAPI's body reader raises it: undecodable input
            return error_response(422, "invalid_request", "the request body is not valid "
                                  "UTF-8 JSON (or nests too deep)", "body")
        kinds = {404: "not_found", 405: "method_not_allowed"}
        detail = str(exc.detail)
        if exc.status_code == 404 and request.url.path in UNSERVED_ROUTES:
            detail = f"{detail}: {request.url.path} {UNSERVED_ROUTES[request.url.path]}"
        allowed = (exc.headers or {}).get("Allow")
        if exc.status_code == 405 and allowed:
            detail = f"{detail}: {request.url.path} takes {allowed}, not {request.method}"
        return error_response(exc.status_code, kinds.get(exc.status_code, "http_error"),
                              detail, headers=dict(exc.headers or {}))

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    # Specific classes are handled inside the middleware stack, so error responses still
    # carry the request id and timing headers; `Exception` is the last resort outside it.
    handled = (ApiError, BodyTooLarge, ClientGone, EmberError, EngineError, TimeoutError)
    for kind in (*handled, Exception):
        app.add_exception_handler(kind, on_error)
