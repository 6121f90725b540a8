"""text-embeddings-inference compatible routes on the default model: POST /embed,
/embed_sparse, /rerank, /similarity, /tokenize and /decode, and POST / which, like TEI's,
reads an embed, rerank or similarity body (huggingface_hub's InferenceClient posts there
when given only the server's URL)."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    RootModel,
    StrictBool,
    StrictInt,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)
from pydantic_core import PydanticCustomError

from ember.adapters.base import (
    DOCUMENT_PROMPTS,
    Encoded,
    EncodeOptions,
    ScoreOptions,
    ShowsTokens,
    TaskModel,
    TaskOutput,
    TokenSpan,
)
from ember.api.codec import render
from ember.api.errors import ApiError, validation_error
from ember.api.model_task import (
    CUT_HELP,
    ParamNames,
    check_count,
    check_inputs,
    check_query,
    cut_dense,
    ranked,
    require_dense,
    require_output,
    run_task,
)
from ember.api.routing import InferenceRoute
from ember.api.state import ServedModel, server_state

router = APIRouter(tags=["tei"], route_class=InferenceRoute)
Direction = Literal["right", "Right", "left", "Left"]


class Strict(BaseModel):
    """A TEI body has TEI's fields only: any other is a 422 naming it, never ignored."""

    model_config = ConfigDict(extra="forbid")


class NoParameters(Strict):
    """A body whose options TEI reads at the top level."""

    # huggingface_hub's InferenceClient sends an empty one beside the inputs.
    parameters: dict[str, Any] | None = Field(None, description="empty, if sent: the "
                                              "options go at the top level, as TEI reads them")

    @field_validator("parameters")
    @classmethod
    def nothing_in_parameters(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value:
            raise ValueError(f"{sorted(value)} would be ignored here: send them at the top "
                             "level of the body, as TEI reads them")
        return value


def is_token_ids(value: object) -> bool:
    """A list of ints, or of lists of ints: TEI's other form of `inputs`."""
    rows = value if isinstance(value, list) and value and isinstance(value[0], list) \
        else [value]
    return all(isinstance(row, list) and row and all(type(token) is int for token in row)
               for row in rows)


class TextInputs(NoParameters):
    """`inputs` as text: TEI's token ids are refused by what they are."""

    inputs: str | list[str]

    @field_validator("inputs", mode="wrap")
    @classmethod
    def no_token_ids(cls, value: object, handler: ValidatorFunctionWrapHandler) -> object:
        try:
            return handler(value)
        except ValidationError:
            if not is_token_ids(value):
                raise
        raise PydanticCustomError(
            "token_ids", "inputs holds token ids, and TEI's routes here take text: send "
            "strings (POST /v1/embeddings reads ids of the model's own tokenizer on a server "
            "started with --token-ids model)", {"param": "inputs"})


class EmbedRequest(TextInputs):
    normalize: StrictBool = True
    truncate: StrictBool = True
    truncation_direction: Direction | None = None
    prompt_name: str | None = Field(None, description="query, or document (passage, corpus): "
                                    "the side of an asymmetric model")
    dimensions: StrictInt | None = Field(None, description=CUT_HELP)


class TeiRerankRequest(NoParameters):
    query: str
    texts: list[str]
    truncate: StrictBool = True
    truncation_direction: Direction | None = None
    return_text: StrictBool = False
    raw_scores: StrictBool = Field(False, description="a cross-encoder's logits, before its "
                             "activation (a similarity has none: the same scores)")


class EmbedSparseRequest(TextInputs):
    truncate: StrictBool = True
    truncation_direction: Direction | None = None
    prompt_name: str | None = Field(None, description="query, or document (passage, corpus)")


class TokenizeRequest(NoParameters):
    inputs: str | list[str]
    add_special_tokens: StrictBool = True
    prompt_name: str | None = Field(None, description="query, or document (passage, corpus): "
                                    "its prompt is tokenized before the text, as TEI does")


class DecodeRequest(NoParameters):
    ids: list[StrictInt] | list[list[StrictInt]] = Field(
        description="token ids of the model's vocabulary: one list, or a list of lists")
    skip_special_tokens: StrictBool = True


class SimilarityInputs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source_sentence: str
    sentences: list[str]


class SimilarityParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    truncate: StrictBool | None = None
    truncation_direction: Direction | None = None
    prompt_name: str | None = None


class SimilarityRequest(Strict):
    """TEI reads /similarity's options under `parameters`; Ember also at the top level."""

    inputs: SimilarityInputs
    parameters: SimilarityParameters | None = None
    truncate: StrictBool | None = None
    truncation_direction: Direction | None = None
    prompt_name: str | None = None

    def option(self, name: str) -> Any:
        """An option from `parameters` or the top level; given at both is a 422."""
        top = getattr(self, name)
        nested = getattr(self.parameters, name) if self.parameters is not None else None
        if top is not None and nested is not None:
            raise ApiError(422, "invalid_request", f"{name} given both at the top level and "
                           "under parameters; send it once", f"parameters.{name}")
        return nested if nested is not None else top


class AnyTeiBody(RootModel[dict[str, Any]]):
    """An embed, rerank or similarity body, told apart by its fields."""


def encode_options(truncate: bool, direction: str | None, prompt_name: str | None,
                   normalize: bool = True) -> EncodeOptions:
    if direction is not None and direction.lower() == "left":
        raise ApiError(422, "invalid_request", "truncation_direction 'Left' is not supported: "
                       "Ember cuts the end of a long text; send 'Right' or leave it out",
                       "truncation_direction")
    if prompt_name is not None and prompt_name not in ("query", *DOCUMENT_PROMPTS):
        raise ApiError(422, "invalid_request", f"prompt_name {prompt_name!r} is not one Ember "
                       f"serves: query, or {', '.join(DOCUMENT_PROMPTS)} for the document side",
                       "prompt_name")
    return EncodeOptions(normalize=normalize, truncate=truncate,
                         is_query=prompt_name == "query")


def check_prompt(model: ServedModel, prompt_name: str | None) -> None:
    """TEI refuses a prompt_name the model's configuration lacks; so does Ember, for a model
    that lists its prompts: `query` needs a query prompt, a document name (document,
    passage, corpus: one side, the first of them the model has) a document prompt. An
    empty prompt counts, as in TEI."""
    prompts = model.adapter.info.extra.get("prompts")
    if prompt_name is None or not isinstance(prompts, dict):
        return
    sides = {"query": "query" in prompts,
             "document": any(name in prompts for name in DOCUMENT_PROMPTS)}
    if sides["query" if prompt_name == "query" else "document"]:
        return
    usable = [names for side, names in (("query", "query"), ("document", "document, "
              "passage or corpus")) if sides[side]]
    raise ApiError(422, "invalid_request", f"model {model.spec.name!r} has no "
                   f"{'query' if prompt_name == 'query' else 'document'} prompt for "
                   f"prompt_name {prompt_name!r}; "
                   + (f"send {' or '.join(usable)}, or leave prompt_name out" if usable
                      else "it has no prompts: leave prompt_name out"), "prompt_name")


async def dense_vectors(request: Request, texts: list[str], options: EncodeOptions,
                        field: str, dimensions: int | None = None, query: bool = False,
                        names: ParamNames | None = None, prompt_name: str | None = None
                        ) -> TaskOutput[list[Encoded]]:
    """The default model's dense vectors for `texts` (`query`: the first is a query beside
    the request's inputs), cut to `dimensions` if given; a model without them is a 422."""
    model = server_state(request).settings.default_model

    async def encode(m: ServedModel, adapter: TaskModel) -> TaskOutput[list[Encoded]]:
        require_dense(m, request.url.path, dimensions)
        check_prompt(m, prompt_name)
        return cut_dense(m, await adapter.encode(m.submit, texts, options), dimensions,
                         options)

    return await run_task(request, model, "encode", encode, len(texts) - query, field,
                          query=query, names=names)


@router.post("/embed", summary="TEI-compatible embeddings on the default model")
async def embed(body: EmbedRequest, request: Request) -> Response:
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    check_inputs(request, texts, "inputs")
    options = encode_options(body.truncate, body.truncation_direction, body.prompt_name,
                             body.normalize)
    output = await dense_vectors(request, texts, options, "inputs", body.dimensions,
                                 prompt_name=body.prompt_name)
    return render(request.headers, [encoded.dense for encoded in output.values])


def similarity_param(param: str) -> str:
    """`inputs[i]` of the texts encoded for /similarity, as the body names it: the source
    sentence first, then `inputs.sentences`."""
    match = re.fullmatch(r"inputs\[(\d+)\](.*)", param)
    if match is None:
        return param
    index, rest = int(match.group(1)), match.group(2)
    return f"inputs.source_sentence{rest}" if index == 0 else \
        f"inputs.sentences[{index - 1}]{rest}"


@router.post("/similarity", summary="TEI-compatible sentence similarity on the default "
             "model: the cosine of each sentence to the source sentence")
async def similarity(body: SimilarityRequest, request: Request) -> Response:
    source, sentences = body.inputs.source_sentence, body.inputs.sentences
    check_inputs(request, sentences, "inputs.sentences")
    check_query(request, source, "inputs.source_sentence")
    truncate, prompt_name = body.option("truncate"), body.option("prompt_name")
    nested = body.parameters.model_fields_set if body.parameters is not None else set()

    def names(param: str) -> str:  # an option's error names it where the body put it
        return f"parameters.{param}" if param in nested else similarity_param(param)

    try:
        options = encode_options(truncate is not False, body.option("truncation_direction"),
                                 prompt_name)
    except ApiError as error:
        error.param = names(error.param or "")
        raise
    output = await dense_vectors(request, [source, *sentences], options, "inputs",
                                 query=True, names=names, prompt_name=prompt_name)
    vectors = np.stack([e.dense for e in output.values if e.dense is not None]).astype(float)
    vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    return render(request.headers, (vectors[1:] @ vectors[0]).tolist())


@router.post("/rerank", summary="TEI-compatible rerank on the default model")
async def tei_rerank(body: TeiRerankRequest, request: Request) -> Response:
    model = server_state(request).settings.default_model
    check_inputs(request, body.texts, "texts")
    check_query(request, body.query)
    encode_options(body.truncate, body.truncation_direction, None)  # refuses Left
    options = ScoreOptions(truncate=body.truncate, raw=body.raw_scores)
    output = await run_task(request, model, "score",
                            lambda m, a: a.score(m.submit, body.query, body.texts, options),
                            len(body.texts), "texts", query=True)
    results = []
    for index in ranked(output.values):
        result: dict[str, object] = {"index": index, "score": output.values[index]}
        if body.return_text:
            result["text"] = body.texts[index]
        results.append(result)
    return render(request.headers, results)


@router.post("/embed_sparse", summary="TEI-compatible sparse embeddings on the default model "
             "(a SPLADE model): each text's non-zero weights by vocabulary index")
async def embed_sparse(body: EmbedSparseRequest, request: Request) -> Response:
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    check_inputs(request, texts, "inputs")
    options = replace(encode_options(body.truncate, body.truncation_direction,
                                     body.prompt_name), normalize=None, output_types=("sparse",))
    model = server_state(request).settings.default_model

    async def encode(m: ServedModel, adapter: TaskModel) -> TaskOutput[list[Encoded]]:
        require_output(m, request.url.path, "sparse")
        check_prompt(m, body.prompt_name)
        return await adapter.encode(m.submit, texts, options)

    output = await run_task(request, model, "encode", encode, len(texts), "inputs")
    return render(request.headers, [
        [{"index": index, "value": value} for index, value in zip(
            encoded.sparse.indices.tolist(), encoded.sparse.values.tolist(), strict=True)]
        for encoded in output.values if encoded.sparse is not None])


TOKENIZE_CHARS = 200_000  # one longest text's worth: ~200,000 tokens at most, ~0.3 s


def shows_tokens(model: ServedModel) -> ShowsTokens:
    if not isinstance(model.adapter, ShowsTokens):
        raise ApiError(422, "invalid_request", f"model {model.spec.name!r} (the default model) "
                       "has no tokenizer these routes can show; they read a transformers "
                       "model's", "model")
    return model.adapter


@router.post("/tokenize", summary="TEI-compatible: the default model's tokens for each text, "
             "with their places in its UTF-8 bytes")
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    check_inputs(request, texts, "inputs")
    chars = sum(map(len, texts))
    if chars > TOKENIZE_CHARS:  # a token each, as punctuation is: an answer of that many
        raise ApiError(422, "invalid_request", f"/tokenize shows at most {TOKENIZE_CHARS:,} "
                       f"characters a request, and these texts hold {chars:,}; split them",
                       "inputs")
    options = encode_options(False, None, body.prompt_name)
    model = server_state(request).settings.default_model

    async def split(m: ServedModel, _: TaskModel) -> TaskOutput[list[list[TokenSpan]]]:
        check_prompt(m, body.prompt_name)
        spans = await shows_tokens(m).token_spans(texts, body.add_special_tokens, options)
        return TaskOutput(spans, 0.0, 0.0, sum(map(len, spans)))

    output = await run_task(request, model, None, split, len(texts), "inputs")
    return render(request.headers, output.values)


@router.post("/decode", summary="TEI-compatible: the text of token ids of the default model")
async def decode(body: DecodeRequest, request: Request) -> Response:
    ids: list[Any] = body.ids
    rows: list[list[int]] = ids if ids and isinstance(ids[0], list) else [ids]
    check_count(request, len(rows), "ids")
    model = server_state(request).settings.default_model

    async def text(m: ServedModel, _: TaskModel) -> TaskOutput[list[str]]:
        texts = await shows_tokens(m).decode_ids(rows, body.skip_special_tokens)
        return TaskOutput(texts, 0.0, 0.0, sum(map(len, rows)))

    flat = rows is not ids  # one list of ids: its places are `ids[i]`
    output = await run_task(request, model, None, text, len(rows), "ids", names=(
        (lambda param: param.replace("ids[0]", "ids", 1)) if flat else None))
    return render(request.headers, output.values)


@router.post("/", summary="TEI's root route: an embed, rerank or similarity body, answered "
             "as its own route would (`{inputs: {source_sentence, sentences}}` is similarity, "
             "`{query, texts}` rerank, `{inputs}` embed)")
async def root(body: AnyTeiBody, request: Request) -> Response:
    data = body.root
    kind: type[Strict] = EmbedRequest
    if "inputs" in data and ("query" in data or "texts" in data):  # no route takes both
        shape = "query" if "query" in data else "texts"
        raise ApiError(422, "invalid_request", f"the body holds both inputs (an embed or a "
                       f"similarity) and {shape} (a rerank): send one route's fields, or post "
                       "to /embed, /similarity or /rerank", "body")
    if "query" in data or "texts" in data:
        kind = TeiRerankRequest
    elif isinstance(data.get("inputs"), dict):
        kind = SimilarityRequest
    try:
        parsed = kind.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False), kind) from None
    if isinstance(parsed, TeiRerankRequest):
        return await tei_rerank(parsed, request)
    if isinstance(parsed, SimilarityRequest):
        return await similarity(parsed, request)
    assert isinstance(parsed, EmbedRequest)
    return await embed(parsed, request)
