"""Native routes in SIE's wire shapes: /v1/encode, /v1/score, /v1/extract.

They take what sie-sdk sends, where it sends it: the query side as
`params.options.is_query` (or `params.is_query`), score's `options` and `instruction` at
the top level (or under `params`). Unknown fields are refused with a 422 that names them,
so an option this server does not know is never silently dropped."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from ember.adapters.base import (
    Encoded,
    EncodeOptions,
    ExtractOptions,
    ScoreOptions,
    TaskModel,
    TaskOutput,
)
from ember.api.codec import render
from ember.api.errors import ApiError
from ember.api.images import (
    ImagePart,
    first_images,
    has_images,
    image_model,
    item_inputs,
    takes_images,
    texts_of,
)
from ember.api.model_task import (
    CUT_HELP,
    ParamNames,
    check_inputs,
    check_query,
    cut_dense,
    ranked,
    require_dense,
    run_task,
    unnamed_model,
)
from ember.api.routing import InferenceRoute
from ember.api.state import ServedModel
from ember.config import FAMILY_OPTIONS, ModelSpec
from ember.errors import InvalidInput, described
from ember.outputs import PACKED_BITS, quantize, quantize_sparse

router = APIRouter(tags=["native"], route_class=InferenceRoute)


class Strict(BaseModel):
    """A native body: unknown fields are a 422 naming them, never silently dropped."""

    model_config = ConfigDict(extra="forbid")


class Item(Strict):
    id: str | None = None
    text: str | None = None
    images: list[ImagePart] | None = Field(None, description="[{data, format?}]: bytes in "
                                           "msgpack, base64 in JSON; for models that take "
                                           "images")


class PairOptions(Strict):
    lora: str | None = Field(None, description="LoRA adapter of the model to apply")
    truncate: StrictBool = Field(True, description="cut inputs over the model's max length; "
                           "false refuses them (400, code INPUT_TOO_LONG)")


class Options(PairOptions):
    normalize: StrictBool | None = Field(None, description="L2-normalize dense vectors "
                                   "(default: the model's setting)")
    is_query: StrictBool | None = Field(None, description="the query side of an asymmetric "
                                  "model (where sie-sdk sends it)")


OutputDtype = Literal["float32", "float16", "int8", "uint8", "binary", "ubinary"]


class EncodeParams(Strict):
    output_types: list[str] | None = Field(
        None, description="dense, sparse and/or multivector (default: the model's own)")
    output_dtype: OutputDtype = Field(
        "float32", description="float16 halves; int8 is scaled per output (the wire carries "
        "`scale`, value ~= q * scale); uint8 is int8 shifted by 128 (value ~= (q - 128) * "
        "scale); binary and ubinary pack sign bits, 8 per byte, as uint8 (dense and "
        "multivector only)")
    dimensions: StrictInt | None = Field(None, description=f"dense vectors: {CUT_HELP}")
    instruction: str | None = Field(None, description="task instruction, for models "
                                    "configured with prompts")
    is_query: StrictBool | None = Field(None, description="the query side of an asymmetric "
                                  "model; also read from options.is_query")
    options: Options = Field(default_factory=Options)


class EncodeRequest(Strict):
    items: list[Item]
    params: EncodeParams = Field(default_factory=EncodeParams)


class ScoreOptionsBody(PairOptions):
    score_weights: dict[str, StrictFloat] | None = Field(
        None, description="models that score by several outputs (BGE-M3): this request's "
        "weight of each output's score, e.g. {\"dense\": 0.4, \"sparse\": 0.2, "
        "\"multivector\": 0.4} (default: the model's)")


class ScoreParams(Strict):
    options: ScoreOptionsBody | None = None
    instruction: str | None = None


class ScoreRequest(Strict):
    query: Item
    items: list[Item]
    params: ScoreParams = Field(default_factory=ScoreParams)
    # sie-sdk's placement: beside query and items rather than under params.
    options: ScoreOptionsBody | None = None
    instruction: str | None = None


class ExtractParams(Strict):
    labels: list[str] | None = None
    threshold: StrictFloat | None = Field(None, description="zero-shot models (GLiNER): the "
                                          "least score an entity must reach, 0 to 1 "
                                          "(default: the model's); models with fixed types "
                                          "refuse it")


class ExtractRequest(Strict):
    items: list[Item]
    params: ExtractParams = Field(default_factory=ExtractParams)


def query_side(params: EncodeParams) -> bool:
    """`params.options.is_query` (sie-sdk) or `params.is_query`; both must agree."""
    given = {name: value for name, value in (("params.is_query", params.is_query),
                                             ("params.options.is_query",
                                              params.options.is_query)) if value is not None}
    if len(set(given.values())) > 1:
        raise ApiError(422, "invalid_request", "params.is_query and params.options.is_query "
                       "disagree; send one of them", "params.options.is_query")
    return any(given.values())


# An instruction is a sentence put before every text of the request, each copy
# tokenized: a 1 MB one over 100 texts had cost a minute and 6 GB.
MAX_INSTRUCTION_CHARS = 2000


def encode_options(params: EncodeParams) -> EncodeOptions:
    if params.instruction is not None and len(params.instruction) > MAX_INSTRUCTION_CHARS:
        raise ApiError(422, "invalid_request", f"an instruction of {len(params.instruction):,} "
                       f"characters is over the limit of {MAX_INSTRUCTION_CHARS:,}: it goes "
                       "before every text; send a sentence that says the task",
                       "params.instruction")
    return EncodeOptions(is_query=query_side(params), instruction=params.instruction,
                         truncate=params.options.truncate, normalize=params.options.normalize,
                         lora=params.options.lora,
                         output_types=tuple(params.output_types or ()))


def check_dimensions(model: ServedModel, params: EncodeParams) -> None:
    """`params.dimensions` shortens dense vectors: the model must make them, the request
    must ask for them, and the size must be one they can be cut to."""
    if params.dimensions is None:
        return
    made = model.adapter.info.output_types
    asked = params.output_types
    if "dense" not in made or (asked and "dense" not in asked):
        outputs = ", ".join(asked or made) or "no vectors"
        raise ApiError(422, "invalid_request", f"params.dimensions shortens dense vectors, and "
                       f"this request gets {outputs} from {model.spec.name!r}; ask for dense "
                       "in params.output_types or leave params.dimensions out",
                       "params.dimensions")
    require_dense(model, "/v1/encode", params.dimensions, "params.dimensions")


def score_options(body: ScoreRequest) -> ScoreOptionsBody:
    """The options from the top level (sie-sdk) or from params; given twice is a 422.
    Score models apply their own query and document prompts, so an instruction would be
    ignored: it is refused instead."""
    if body.options is not None and body.params.options is not None:
        raise ApiError(422, "invalid_request", "options given both at the top level and "
                       "under params; send them once", "options")
    for param, instruction in (("instruction", body.instruction),
                               ("params.instruction", body.params.instruction)):
        if instruction is not None:
            raise ApiError(422, "invalid_request", "score takes no instruction: its models "
                           "apply their own query and document prompts; remove it", param)
    return body.options or body.params.options or ScoreOptionsBody()


def score_options_of(body: ScoreRequest) -> ScoreOptions:
    opts = score_options(body)
    return ScoreOptions(truncate=opts.truncate, lora=opts.lora,
                        score_weights=opts.score_weights)


def encoded_wire(encoded: Encoded, dtype: str) -> dict[str, Any]:
    """SIE's shapes: dense `{dims, dtype, values}`, sparse `{dims, dtype, indices, values}`,
    multivector `{token_dims, num_tokens, dtype, values}`; `scale` with int8. Values stay
    arrays until the codec writes them (lists in JSON, numpy arrays in msgpack)."""
    body: dict[str, Any] = {}
    if encoded.dense is not None:
        q = quantize(encoded.dense, dtype)
        body["dense"] = _scaled({"dims": int(encoded.dense.shape[-1]), "dtype": dtype,
                                 "values": q.values}, q.scale)
    if encoded.sparse is not None:
        if dtype in PACKED_BITS:
            raise ApiError(422, "invalid_request", f"output_dtype {dtype!r} applies to dense "
                           "and multivector outputs; sparse takes float32, float16, int8 "
                           "or uint8", "params.output_dtype")
        indices, q = quantize_sparse(encoded.sparse.indices, encoded.sparse.values, dtype)
        body["sparse"] = _scaled({"dims": encoded.sparse.dims, "dtype": dtype,
                                  "indices": indices, "values": q.values}, q.scale)
    if encoded.multivector is not None:
        num_tokens, token_dims = encoded.multivector.shape
        q = quantize(encoded.multivector, dtype)
        body["multivector"] = _scaled({"token_dims": int(token_dims),
                                       "num_tokens": int(num_tokens), "dtype": dtype,
                                       "values": q.values}, q.scale)
    return body


def _scaled(body: dict[str, Any], scale: float | None) -> dict[str, Any]:
    return body if scale is None else {**body, "scale": scale}


def with_id(item: Item, body: dict[str, Any]) -> dict[str, Any]:
    return {"id": item.id, **body} if item.id is not None else body


async def no_model(request: Request) -> Response:
    """Without this, the path would be redirected to its trailing slash, then not found."""
    raise unnamed_model(request, request.url.path.rsplit("/", 1)[-1])


for _task in ("encode", "score", "extract"):  # plain routes: they read no body
    router.add_api_route(f"/v1/{_task}", no_model, methods=["POST"], include_in_schema=False,
                         route_class_override=APIRoute)


@router.post("/v1/encode/{model:path}", summary="Embed items")
async def encode(model: str, body: EncodeRequest, request: Request) -> Response:
    options, dims = encode_options(body.params), body.params.dimensions
    run: Callable[[ServedModel, TaskModel], Awaitable[TaskOutput[list[Encoded]]]]
    if has_images(body.items):
        inputs, where = item_inputs(request, body.items), first_images(body.items)
        takes_images(request, model, where)
        count = len(inputs)
        run = lambda m, a: image_model(a, model, where).encode_items(  # noqa: E731
            m.submit, inputs, options)
    else:
        texts = texts_of(body.items)
        check_inputs(request, texts, suffix=".text")
        count = len(texts)
        run = lambda m, a: a.encode(m.submit, texts, options)  # noqa: E731

    async def forward(m: ServedModel, adapter: TaskModel) -> TaskOutput[list[Encoded]]:
        check_dimensions(m, body.params)
        return cut_dense(m, await run(m, adapter), dims, options)

    output = await run_task(request, model, "encode", forward, count, lora=options.lora)
    dtype = body.params.output_dtype
    items = [with_id(item, encoded_wire(enc, dtype))
             for item, enc in zip(body.items, output.values, strict=True)]
    return render(request.headers, {"model": model, "items": items})


@router.post("/v1/score/{model:path}", summary="Score items against a query")
async def score(model: str, body: ScoreRequest, request: Request) -> Response:
    ids = score_ids(body.items)
    output = await score_output(model, body, request)
    scores = [{"item_id": ids[i], "score": output.values[i], "rank": rank}
              for rank, i in enumerate(ranked(output.values))]
    return render(request.headers, {"model": model, "scores": scores})


def score_ids(items: Sequence[Item]) -> list[str]:
    """Each item's id in a score's answer (one without an id is named by its place): the
    answer is sorted by score, so two items of one id could not be told apart."""
    ids = [item.id if item.id is not None else str(i) for i, item in enumerate(items)]
    first: dict[str, int] = {}
    for i, name in enumerate(ids):
        if (earlier := first.setdefault(name, i)) != i:
            raise ApiError(422, "invalid_request", f"items[{i}] has the id {described(name)} "
                           f"of items[{earlier}] (an item without an id is named by its "
                           "place): scores are sorted, so each item needs its own id",
                           f"items[{i}].id")
    return ids


def options_names(body: ScoreRequest) -> ParamNames | None:
    """Options sent at the top level (sie-sdk's placement) are named there."""
    if body.options is None:
        return None
    return lambda param: param.removeprefix("params.") if param.startswith(
        "params.options.") else param


def weighs(options: ScoreOptions) -> Callable[[ModelSpec], None]:
    """A check that the model weighs its outputs' scores, where the request sends weights
    (the families whose YAML takes `options.score_weights`)."""
    def check(spec: ModelSpec) -> None:
        if options.score_weights is not None and \
                "score_weights" not in FAMILY_OPTIONS.get(spec.adapter, ()):
            raise InvalidInput(f"model {spec.name!r} scores by one output; "
                               "options.score_weights applies to models that score by "
                               "several (the m3 family): remove it",
                               "params.options.score_weights")
    return check


async def score_output(model: str, body: ScoreRequest,
                       request: Request) -> TaskOutput[list[float]]:
    """The scores of a text or image score request, in the items' order."""
    count = len(body.items)
    if has_images([body.query, *body.items]):
        inputs = item_inputs(request, body.items, others=len(body.query.images or ()))
        query = item_inputs(request, [body.query], "query")[0]
        where = first_images([body.query], "query") if body.query.images else \
            first_images(body.items)
        takes_images(request, model, where)
        options = score_options_of(body)
        return await run_task(request, model, "score", lambda m, a: image_model(
            a, model, where).score_items(m.submit, query, inputs, options), count, query=True,
            names=options_names(body), fits=weighs(options), lora=options.lora)
    else:
        texts, query_text = texts_of(body.items), texts_of([body.query], "query")[0]
        check_inputs(request, texts, suffix=".text")
        check_query(request, query_text, "query.text")
        options = score_options_of(body)
        return await run_task(request, model, "score",
                              lambda m, a: a.score(m.submit, query_text, texts, options),
                              count, query=True, names=options_names(body),
                              fits=weighs(options), lora=options.lora)


@router.post("/v1/extract/{model:path}", summary="Extract entities from items")
async def extract(model: str, body: ExtractRequest, request: Request) -> Response:
    texts = texts_of(body.items, why="extract reads text only")
    check_inputs(request, texts, suffix=".text")
    labels = tuple(body.params.labels) if body.params.labels is not None else None
    options = ExtractOptions(labels=labels, threshold=body.params.threshold)
    output = await run_task(request, model, "extract",
                            lambda m, a: a.extract(m.submit, texts, options), len(texts))
    items = [with_id(item, {"entities": [vars(e) for e in entities]})
             for item, entities in zip(body.items, output.values, strict=True)]
    return render(request.headers, {"model": model, "items": items})
