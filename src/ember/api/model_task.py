"""Running one model task for a route: the input limits, the model, queue capacity, the
timeout and disconnects, the accounting."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import TypeVar

import regex
from fastapi import Request
from pydantic import BaseModel
from starlette.types import Message

from ember.adapters.base import Encoded, EncodeOptions, TaskModel, TaskOutput, check_lora
from ember.api.errors import ApiError, ClientGone, RequestTimeout, as_api_error
from ember.api.state import ServedModel, server_state
from ember.config import ModelSpec
from ember.engine import RequestTooLarge
from ember.errors import TRUNCATE_ADVICE, InputTooLong, UnsupportedTask
from ember.metrics import labelled
from ember.outputs import shortened
from ember.registry import get_within_room

T = TypeVar("T")
TaskCall = Callable[[ServedModel, TaskModel], Awaitable[TaskOutput[T]]]
# A route's own name for a field the adapters name as the native routes do.
ParamNames = Callable[[str], str]


def ranked(scores: list[float], top_n: int | None = None) -> list[int]:
    """Indices by score, best first (ties in input order), cut to top_n."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return order[:top_n] if top_n is not None else order


def check_count(request: Request, count: int, field: str = "items") -> None:
    """At least one item, at most the server's limit per request (413)."""
    limit = server_state(request).settings.max_items_per_request
    if not count:
        raise ApiError(422, "invalid_request", f"{field} must hold at least one item", field)
    if count > limit:
        request.state.items = count  # for the access log
        raise too_many(request, ApiError(
            413, "payload_too_large", f"{count} items is over the limit of {limit} per "
            "request (--max-items-per-request); split the request", field))


def too_many(request: Request, error: ApiError) -> ApiError:
    """A 413 for too many items or images, counted as a refusal, as the body limit's is."""
    server_state(request).metrics.rejected(error.kind)
    return error


def check_inputs(request: Request, texts: Sequence[str], field: str = "items",
                 suffix: str = "") -> None:
    """Limits a route applies before any work: item count (413), and each text non-blank,
    valid Unicode and within the size limit (422 naming `{field}[i]{suffix}`)."""
    check_count(request, len(texts), field)
    limit = server_state(request).settings.max_text_chars
    for index, text in enumerate(texts):
        if (problem := text_problem(text, limit)) is not None:
            raise ApiError(422, "invalid_request", problem, f"{field}[{index}]{suffix}")


def check_query(request: Request, text: str, param: str = "query") -> None:
    """A rerank or score query: one text under the same rules as the items."""
    if (problem := text_problem(text, server_state(request).settings.max_text_chars)) is not None:
        raise ApiError(422, "invalid_request", problem, param)


# A character a reader sees: not a space, a control or format character (NUL, zero-width
# space, BOM, direction marks) or a combining mark with no letter to sit on.
_VISIBLE = regex.compile(r"[^\s\p{Cc}\p{Cf}\p{Mn}\p{Me}]")
# A visible ASCII character: most texts have one, found by `re` without the Unicode
# tables `_VISIBLE` reads (a cache miss each after a forward: 5 us a text in a server).
_VISIBLE_ASCII = re.compile(r"[!-~]")


def text_problem(text: str, limit: int) -> str | None:
    """Why a text cannot be served (the message of a 422), or None when it can."""
    # An empty text has nothing to embed: OpenAI and TEI refuse it too, and a vector for
    # it would be the model's bias alone, silently wrong for a search index.
    # A lone surrogate (valid JSON `\ud800`, no text) was refused by the body's decoder
    # (codec.decode), in this field as in any other.
    if _VISIBLE_ASCII.search(text) is None and _VISIBLE.search(text) is None:
        return ("text is empty or blank (no visible character: only spaces, control, "
                "zero-width or combining characters, which the tokenizer drops); send text "
                "with at least one visible character")
    if len(text) > limit:
        return f"text of {len(text)} characters is over the limit of {limit} " \
            "(--max-text-chars); shorten it"
    return None


def requested_model(request: Request, body: BaseModel) -> str:
    """A compatible route's `model`: omitted, the server's default model (--default-model);
    given, it must name one (an empty or null name is a client bug, not a choice)."""
    name: str | None = getattr(body, "model", None)
    if "model" not in body.model_fields_set:
        return server_state(request).settings.default_model
    if name is None or not name.strip():
        raise ApiError(422, "invalid_request", "model is empty: name a model (GET /v1/models "
                       "lists them), or leave the field out to use the server's default "
                       "model", "model")
    return name


def unnamed_model(request: Request, task: str) -> ApiError:
    """A native route's path without its model (`/v1/encode`, `/v1/encode/`)."""
    state = server_state(request)
    catalog = state.registry.catalog
    default = state.settings.default_model
    doing = [name for name, spec in catalog.items() if task in spec.tasks]
    example = default if default in doing else min(doing, default=None)
    hint = f", for example /v1/{task}/{example}" if example else ""
    return ApiError(404, "model_not_found", f"the path names no model: POST /v1/{task}/{{model}}"
                    f"{hint} (GET /v1/models lists the models and their tasks)", "model")


# A client's disconnect is watched for only once its request has waited this long: the
# watch is a task per request (its start, wake-up and cancel measured ~0.1 ms of CPU a
# request at 256 in flight), and most requests are answered sooner. A client that left is
# still seen while its items queue: a queue that holds work for longer is what the watch
# is for.
WATCH_AFTER_S = 0.1


async def until_disconnect(request: Request, work: Awaitable[T], timeout: float | None) -> T:
    """Await `work` in this task, but cancel it (dropping its queued items, R9) when the
    client disconnects or the timeout passes. After the body is read, the next ASGI
    message is the disconnect, so watching for it costs nothing while the client stays."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    ended: list[BaseException] = []
    watchers: list[asyncio.Future[Message]] = []
    timer: asyncio.TimerHandle

    def end(reason: BaseException) -> None:
        if not ended:
            ended.append(reason)
            task.cancel()

    def watch() -> None:
        nonlocal timer
        watcher = asyncio.ensure_future(request.receive())
        watcher.add_done_callback(lambda _: end(ClientGone()))
        watchers.append(watcher)
        if timeout is not None:
            timer = loop.call_later(timeout - WATCH_AFTER_S, end, RequestTimeout(timeout))

    # One timer a request (most end before it fires): the watch, which then sets the
    # timeout's timer; or the timeout itself when it comes first.
    if timeout is not None and timeout <= WATCH_AFTER_S:
        timer = loop.call_later(timeout, end, RequestTimeout(timeout))
    else:
        timer = loop.call_later(WATCH_AFTER_S, watch)
    try:
        return await work
    except asyncio.CancelledError:
        if ended and task.uncancel() == 0:
            raise ended[0] from None
        raise
    finally:
        # Too late to end it now. The reason raised above leaves `ended`: its traceback
        # holds this frame, which holds `ended`, a cycle that would keep the request's
        # body and items until the collector's next pass.
        ended[:] = [asyncio.CancelledError()]
        timer.cancel()
        for watcher in watchers:
            watcher.cancel()


def task_error(request: Request, exc: Exception, items: int, field: str, query: bool,
               names: ParamNames | None, truncate: str) -> ApiError:
    """`exc` as the answer of a model's task, in the route's terms, and counted where the
    server refused the request."""
    error = as_api_error(exc)
    error.param = route_param(error.param, field)
    if isinstance(exc, InputTooLong) and field != "items":
        error.message = error.message.replace(TRUNCATE_ADVICE, f"set {truncate}")
    if names is not None and error.param is not None:
        error.param = names(error.param)
    if query and isinstance(exc, RequestTooLarge):  # in the client's terms
        error.message = (f"request too large: {items} {field} and the query take "
                         f"{items + 1} places in the model's queue, over max_queue_items="
                         f"{exc.limit}; split it into requests of at most {exc.limit - 1} "
                         f"{field}")
    if error.status in (413, 429, 503, 504):
        server_state(request).metrics.rejected(error.kind)
    if isinstance(exc, RequestTimeout):  # it waited all along: the headers say so
        request.state.timing = (exc.seconds * 1e3, 0.0)
    return error


_ITEM_PARAM = re.compile(r"items(\[\d+\])?(?:\.text)?")


def route_param(param: str | None, field: str) -> str | None:
    """Adapters name inputs as the native routes do (`items[3].text`, `query.text`); a
    compatible route takes plain strings under its own field (`input[3]`, `query`)."""
    if param is None or field == "items":
        return param
    if param == "query.text":
        return "query"
    match = _ITEM_PARAM.fullmatch(param)
    return field + (match.group(1) or "") if match else param


async def run_task(request: Request, model_name: str, task: str | None, call: TaskCall[T],
                   items: int, field: str = "items", query: bool = False,
                   names: ParamNames | None = None,
                   fits: Callable[[ModelSpec], None] | None = None,
                   truncate: str = "truncate to true", lora: str | None = None
                   ) -> TaskOutput[T]:
    """Run `call` on the named model under the server's timeout; record timing and metrics.
    `items` is how many inputs the request sent under `field` (its name for them, for the
    errors' `param`; `task` None: any model's, as the call checks, and no forward, so no
    room in the queue); `query`: a query is
    queued beside them (score, rerank); `names`: how
    the route names the other fields an error may point at, where its body moves them;
    `fits`: raises where the model's entry cannot serve the request as asked; `truncate`:
    what a compatible route's client sets to have an over-long input cut; `lora`: the
    LoRA the request names, checked against the model's entry before any load."""
    state = server_state(request)
    request.state.items = queued = items + query  # for the access log
    if not model_name:
        raise unnamed_model(request, task or "encode")
    try:
        spec = state.registry.catalog.get(model_name)
        # Refused from the catalog, before a load that could evict a model in use.
        if spec is not None and task is not None and task not in spec.tasks:
            raise UnsupportedTask(model_name, task, spec.tasks)
        if spec is not None and fits is not None:
            fits(spec)
        # A LoRA's name from the entry: a typo must not load the model, nor evict one.
        if spec is not None and lora is not None:
            check_lora(lora, tuple(spec.loras))

        loading_ms = 0.0  # what the request waited for its model's load, a queue wait too

        async def served() -> TaskOutput[T]:
            nonlocal loading_ms
            began = time.perf_counter()
            if task is not None and state.registry.ready(model_name) is None:
                await get_within_room(state.registry, model_name, queued, state.load_waiters)
            async with state.registry.use(model_name) as model:
                loading_ms = (time.perf_counter() - began) * 1e3
                if spec is None and fits is not None:  # a Hub model a request brought
                    fits(model.spec)
                if task is not None:  # (a task of none runs no forward: no queue to fill)
                    model.check_room(queued)
                return await call(model, model.adapter)

        # The timeout and the client's leaving cover a load the request waits for too (it
        # goes on for the next requests: the registry shields it from its waiters).
        output = await until_disconnect(request, served(), state.settings.request_timeout_s)
        request.state.timing = (output.queue_ms + loading_ms, output.inference_ms)
        labelled(state.metrics.input_tokens, request.state.route, model_name).observe(
            output.tokens)
        return output
    except ClientGone:
        state.metrics.rejected("client_disconnected")
        raise
    except Exception as exc:
        # Made in a call of its own: the error raised holds this frame (its traceback), so
        # a local here naming it would be a cycle holding the request until a collection.
        raise task_error(request, exc, items, field, query, names, truncate) from None
    finally:
        # The request is counted, with its status, by RequestContextMiddleware.
        request.state.model = state.model_label(model_name)


def require_output(model: ServedModel, route: str, kind: str) -> None:
    """A route that answers with one kind of vector serves only models that make it."""
    outputs = model.adapter.info.output_types
    if kind not in outputs:
        name = model.spec.name
        raise ApiError(422, "unsupported_output", f"{route} returns {kind} vectors, and model "
                       f"{name!r} makes {', '.join(outputs) or 'no vectors'}; use POST "
                       f"/v1/encode/{name} with params.output_types {list(outputs)}", "model")


# The shorter-vector fields' description (OpenAI and TEI `dimensions`, Cohere's
# `output_dimension`): what `cut_dense` does with them.
CUT_HELP = "keep the first N of the model's dimensions (Matryoshka models); unit again if " \
    "normalized"


def require_dense(model: ServedModel, route: str, dims: int | None = None,
                  param: str = "dimensions") -> None:
    """Routes that answer with plain vectors serve only models that make dense ones; a
    size named in `param` (`dims`) must be one the model's vectors can be cut to."""
    require_output(model, route, "dense")
    made = model.adapter.info.dims
    if dims is not None and made is not None and not 1 <= dims <= made:
        raise ApiError(422, "invalid_request", f"{param}={dims} is out of range: "
                       f"{model.spec.name} returns {made} dimensions; send 1 to {made} to "
                       f"keep that many of them, or leave {param} out", param)


def cut_dense(model: ServedModel, output: TaskOutput[list[Encoded]], dims: int | None,
              options: EncodeOptions) -> TaskOutput[list[Encoded]]:
    """`output`'s dense vectors cut to their first `dims` components (OpenAI's
    `dimensions`, for Matryoshka models), unit again where the request's vectors are
    normalized: by `options.normalize`, else by the model's own setting."""
    if dims is None or dims == model.adapter.info.dims:
        return output
    unit = options.normalize if options.normalize is not None else \
        model.adapter.info.extra.get("normalize") is True
    values = [encoded if encoded.dense is None else
              replace(encoded, dense=shortened(encoded.dense, dims, unit))
              for encoded in output.values]
    return replace(output, values=values)
