"""Items that carry images, on the routes that take them (native encode and score,
Cohere's /v2/embed): the image part of an item, its checks before any work, and the
model that must take images.

An image is its bytes: raw in msgpack, base64 in JSON (or a data URI on Cohere's
route). A URL is refused, never fetched: fetching would let a request make the server
connect anywhere. Decoding happens later, off the event loop, in the model's request
path (`ember.adapters._images`)."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import Protocol

from fastapi import Request
from pydantic import BaseModel, ConfigDict

from ember.adapters._images import ImageInput, ImageModel, ItemInput
from ember.adapters.base import TaskModel
from ember.api.errors import ApiError
from ember.api.model_task import check_count, check_query, too_many
from ember.api.state import server_state

IMAGE_FAMILIES = ("clip",)  # model families whose items may carry images
NOT_FETCHED = ("URLs are not fetched (the server would connect wherever a request says); "
               "send the image's bytes in data")


class ImagePart(BaseModel):
    """`{data, format?}`: bytes in msgpack, base64 in JSON; format sniffed when absent."""

    model_config = ConfigDict(extra="forbid")
    data: bytes | str | None = None
    format: str | None = None
    url: str | None = None  # accepted by the schema only to be refused with its reason


class ItemFields(Protocol):
    @property
    def text(self) -> str | None: ...

    @property
    def images(self) -> list[ImagePart] | None: ...


def has_images(items: Sequence[ItemFields]) -> bool:
    return any(item.images for item in items)


def first_images(items: Sequence[ItemFields], field: str = "items") -> str:
    """The param of the first item's images, for a model that takes none."""
    index = next(i for i, item in enumerate(items) if item.images)
    return f"{field}[{index}].images" if field != "query" else "query.images"


def texts_of(items: Sequence[ItemFields], field: str = "items",
             why: str = "this route takes text only") -> list[str]:
    """The texts of text-only items; an item with images or without text is a 422."""
    texts = []
    for index, item in enumerate(items):
        param = field if field == "query" else f"{field}[{index}]"
        if item.images:
            raise ApiError(422, "invalid_request", f"{why}; remove the images",
                           f"{param}.images")
        if item.text is None:
            raise ApiError(422, "invalid_request", f"{param}.text is required (or images, "
                           "on a model that takes them)", f"{param}.text")
        texts.append(item.text)
    return texts


def image_bytes(data: bytes | str | None, param: str) -> bytes:
    if data is None:
        raise ApiError(422, "invalid_request", "data is required: the image's bytes "
                       "(base64 in JSON)", param)
    if isinstance(data, bytes):
        return data
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        pass
    try:  # base64 wrapped in lines, as the base64 tool writes it by default
        return base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError):
        hint = (" without the data URI's 'data:...;base64,' head (only Cohere's route takes "
                "data URIs)") if data.startswith("data:") else ""
        raise ApiError(422, "invalid_request", "data is not valid base64; send the image's "
                       f"bytes base64-encoded{hint} (or raw bytes in msgpack)", param) from None


def check_image_count(request: Request, count: int, field: str) -> None:
    limit = server_state(request).settings.max_images_per_request
    if count > limit:
        raise too_many(request, ApiError(
            413, "payload_too_large", f"{count} images is over the limit of {limit} per "
            "request (--max-images-per-request); split the request", field))


def item_inputs(request: Request, items: Sequence[ItemFields],
                field: str = "items", others: int = 0) -> list[ItemInput]:
    """The items as model inputs, checked before any work: the item count, the image
    count (413 over --max-images-per-request, counting `others` the request carries
    elsewhere, such as a query's), URLs, base64 and the texts' limits."""
    check_count(request, len(items), field)
    check_image_count(request, others + sum(len(item.images or ()) for item in items), field)
    inputs = []
    for index, item in enumerate(items):
        param = field if field == "query" else f"{field}[{index}]"
        images = []
        for number, part in enumerate(item.images or ()):
            where = f"{param}.images[{number}]"
            if part.url is not None:
                raise ApiError(422, "invalid_request", NOT_FETCHED, f"{where}.url")
            images.append(ImageInput(image_bytes(part.data, f"{where}.data"), part.format))
        if item.text is not None:
            check_query(request, item.text, f"{param}.text")
        inputs.append(ItemInput(item.text, tuple(images)))
    return inputs


def takes_images(request: Request, name: str, param: str) -> None:
    """A catalog model of a family that takes no images is refused before it loads."""
    spec = server_state(request).registry.catalog.get(name)
    if spec is not None and spec.adapter not in IMAGE_FAMILIES:
        raise refusal(name, param)


def refusal(name: str, param: str) -> ApiError:
    return ApiError(422, "invalid_request", f"model {name!r} takes no images (text only); "
                    "remove them, or use a model that takes images (a CLIP or SigLIP "
                    "model)", param)


def image_model(adapter: TaskModel, name: str, param: str) -> ImageModel:
    """The adapter, when its items may carry images; else a 422 naming `param`."""
    if isinstance(adapter, ImageModel) and adapter.takes_images:
        return adapter
    raise refusal(name, param)


# Cohere's image data URIs: data:image/png;base64,....
def data_uri(value: str, param: str) -> ImageInput:
    head, comma, payload = value.partition(",")
    if not value.startswith("data:") or not comma or not head.endswith(";base64"):
        if value.startswith(("http://", "https://", "ftp://", "file:")):
            raise ApiError(422, "invalid_request", "image URLs are not fetched (the server "
                           "would connect wherever a request says); send a data URI, "
                           "data:image/png;base64,...", param)
        raise ApiError(422, "invalid_request", "an image must be a data URI, "
                       "data:image/<format>;base64,<data>", param)
    mime = head[len("data:"):-len(";base64")]
    return ImageInput(image_bytes(payload, param), mime or None)
