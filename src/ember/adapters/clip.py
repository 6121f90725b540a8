"""Vision-language dual encoders: transformers' CLIPModel and SiglipModel checkpoints.

Texts and images are embedded into one space: a text through the text tower
(`get_text_features`), an image through the vision tower (`get_image_features`). An
item is a text or one image. `score` is the cosine of the query's vector (a text or an
image) and each item's.

Images are decoded and preprocessed on the request path, in the tokenizing pool, as
the checkpoint's own image processor would (`_images`); their pixels cross to the
engine as float32 arrays. An image costs the vision tower's sequence length (patches,
plus the class token on CLIP), so texts and images batch under the same token limits;
one forward may carry both, each tower runs over its own part.

SigLIP's text tower pools the last position and was trained on texts padded to its
full length without a mask, as its processor pads them: its texts are padded so too.

ONNX: the family runs on torch; where ONNX is asked for, the log says it falls back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from ember.adapters import _torch as common
from ember.adapters._backend import ForwardElsewhere, choose_backend
from ember.adapters._images import ItemInput, Preprocessor, decode, is_image_data_uri
from ember.adapters._similarity import cosine
from ember.adapters._tokenize import TextTokenizer, id_rows, off_loop, pool
from ember.adapters.base import (
    Encoded,
    EncodeOptions,
    ModelInfo,
    Runtime,
    ScoreOptions,
    Submit,
    Task,
    TaskOutput,
    check_lora,
    combine,
)
from ember.config import ModelSpec, resolve_source
from ember.engine.types import PreparedItem
from ember.errors import InvalidInput, ModelLoadError, UnsupportedTask

log = logging.getLogger("ember.clip")
TASKS: tuple[Task, ...] = ("encode", "score")
KINDS = ("clip", "siglip")
OUTPUT_TYPES = ("dense",)
ONNX_REFUSED = ("the clip family has no ONNX export (two towers, two graphs); it runs "
                "on torch")
Vector = npt.NDArray[np.float32]


@dataclass(frozen=True)
class ClipParams:
    """The parameter group of one forward (R6); texts and images may share it."""

    normalize: bool


def image_tokens(vision: Any, kind: str) -> int:
    """The vision tower's sequence length: its patches, plus CLIP's class token."""
    patches = (int(vision.image_size) // int(vision.patch_size)) ** 2
    return patches + 1 if kind == "clip" else patches


class ClipAdapter(common.TorchModel):
    """One CLIP or SigLIP model. Task methods run on the event loop (decoding and large
    tokenizing in the tokenizing pool); forward in the worker's thread."""

    takes_images = True

    def __init__(self, spec: ModelSpec, model: Any, config: Any, tokenizer: Any,
                 preprocess: Preprocessor, runtime: Runtime) -> None:
        unknown = [t for t in spec.tasks if t not in TASKS]
        if unknown:
            raise ModelLoadError(spec.name, f"the clip family does not do {unknown}; it "
                                            f"does {TASKS}")
        common.refuse_loras(spec, "clip")
        super().__init__(spec, tokenizer, runtime, model)
        self.kind = str(config.model_type)
        text = config.text_config
        self.max_seq_length = int(spec.max_seq_length or text.max_position_embeddings)
        if self.max_seq_length > int(text.max_position_embeddings):
            raise ModelLoadError(spec.name, f"max_seq_length {self.max_seq_length} exceeds "
                                            f"the text tower's {text.max_position_embeddings}"
                                            " positions")
        self.tokens = TextTokenizer(tokenizer, self.max_seq_length)
        # SigLIP pads every text to its full length, as its processor does.
        self.pad_to = self.max_seq_length if self.kind == "siglip" else None
        self.preprocess = preprocess
        self.image_cost = image_tokens(config.vision_config, self.kind)
        self.normalize = True if spec.normalize is None else spec.normalize
        dims = int(getattr(config, "projection_dim", 0) or text.hidden_size)
        self.info = ModelInfo(
            name=spec.name, tasks=tuple(t for t in TASKS if t in spec.tasks), dims=dims,
            max_seq_length=self.max_seq_length, output_types=OUTPUT_TYPES,
            extra={"backend": model.backend, "architecture": self.kind,
                   "inputs": ["text", "image"], "image_tokens": self.image_cost,
                   "normalize": self.normalize})

    # -- the worker thread --------------------------------------------------------

    def forward(self, items: Sequence[PreparedItem], params: Hashable) -> list[Vector]:
        assert isinstance(params, ClipParams)
        # Pixels are a 3-D array; token ids a list, or a 1-D array once they crossed the IPC
        # wire in a batch's id block.
        images = [i for i, item in enumerate(items) if is_pixels(item.payload)]
        texts = [i for i, item in enumerate(items) if not is_pixels(item.payload)]
        towers: torch.nn.Module = self.model.model  # type: ignore[attr-defined]
        out: list[Vector] = [np.empty(0, np.float32)] * len(items)
        with torch.inference_mode():
            for rows, vectors in ((texts, self._texts(towers, [items[i] for i in texts])),
                                  (images, self._images(towers, [items[i] for i in images]))):
                if vectors is None:
                    continue
                if params.normalize:
                    vectors = F.normalize(vectors.float(), p=2, dim=1)
                array = vectors.float().cpu().numpy().astype(np.float32)
                for row, vector in zip(rows, array, strict=True):
                    out[row] = vector
        return out

    def _texts(self, towers: Any, items: Sequence[PreparedItem]) -> torch.Tensor | None:
        if not items:
            return None
        rows = [item.payload for item in items]
        if self.pad_to is not None:
            ids = torch.full((len(rows), self.pad_to), self.pad_id, dtype=torch.long)
            for i, row in enumerate(rows):
                ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            return features(towers.get_text_features(input_ids=ids.to(self.device)))
        ids, mask = common.pad_with_mask(rows, self.pad_id, self.device)
        return features(towers.get_text_features(input_ids=ids, attention_mask=mask))

    def _images(self, towers: Any, items: Sequence[PreparedItem]) -> torch.Tensor | None:
        if not items:
            return None
        stacked = np.stack([item.payload for item in items])  # a copy: the wire's are read-only
        dtype = next(towers.parameters()).dtype
        pixels = torch.from_numpy(stacked).to(self.device, dtype=dtype)
        return features(towers.get_image_features(pixel_values=pixels))

    # -- the request path (event loop) ----------------------------------------------

    def params(self, options: EncodeOptions) -> ClipParams:
        common.check_output_types(options.output_types, OUTPUT_TYPES)
        if options.instruction:
            raise InvalidInput(f"model {self.spec.name!r} takes no instruction; drop "
                               "params.instruction", "params.instruction")
        return ClipParams(self.normalize if options.normalize is None else options.normalize)

    def prepare(self, inputs: Sequence[ItemInput], truncate: bool,
                where: Sequence[str]) -> list[PreparedItem]:
        """One prepared item per input: token ids (cost: tokens) or pixels (cost: the
        vision tower's length). Any thread may call it."""
        texts = [(i, item.text) for i, item in enumerate(inputs) if not item.images]
        prepared: list[PreparedItem | None] = [None] * len(inputs)
        if texts:
            encodings = self.tokens.encode([t or "" for _, t in texts], truncate,
                                           [f"{where[i]}.text" for i, _ in texts])
            for (i, _), row in zip(texts, id_rows(encodings), strict=True):
                prepared[i] = PreparedItem(row, self.pad_to or len(row), i)
        for i, item in enumerate(inputs):
            if item.images:
                prepared[i] = self.prepare_image(item, i, where[i])
        return [p for p in prepared if p is not None]

    def prepare_image(self, item: ItemInput, index: int, where: str) -> PreparedItem:
        """An item's image, decoded and preprocessed: pixels at the vision tower's cost."""
        image = decode(item.images[0], f"{where}.images[0]")
        return PreparedItem(self.preprocess(image, f"{where}.images[0]"), self.image_cost,
                            index)

    def check(self, inputs: Sequence[ItemInput], where: Sequence[str]) -> None:
        """One vector an item: a text, or one image (never both)."""
        for item, param in zip(inputs, where, strict=True):
            if item.images and item.text is not None:
                raise InvalidInput(f"model {self.spec.name!r} embeds a text or an image per "
                                   "item, not both; send them as two items", f"{param}.text")
            if len(item.images) > 1:
                raise InvalidInput(f"model {self.spec.name!r} embeds one image per item; "
                                   f"this item has {len(item.images)}: send one item an "
                                   "image", f"{param}.images")
            if not item.images and item.text is None:
                raise InvalidInput("an item needs text or an image", f"{param}.text")
            if not item.images and is_image_data_uri(item.text or ""):
                raise InvalidInput(  # else the vector of a string of base64
                    f"this text is an image's data URI, which model {self.spec.name!r} "
                    "would embed as the text it is; send the image as an image: "
                    f"POST /v1/encode/{self.spec.name} with items[].images, or /v2/embed "
                    "with Cohere's images", f"{param}.text")

    async def _prepare(self, inputs: Sequence[ItemInput], truncate: bool,
                       where: Sequence[str]) -> list[PreparedItem]:
        self.check(inputs, where)
        if not any(item.images for item in inputs):
            chars = sum(len(item.text or "") for item in inputs)
            return await off_loop(chars, lambda: self.prepare(inputs, truncate, where))
        # Decoding an image never runs on the event loop, and each image is its own turn in
        # the pool: a request of 30 images held a text behind it for 2 s on one thread.
        loop = asyncio.get_running_loop()
        texts = [i for i, item in enumerate(inputs) if not item.images]
        prepared: dict[int, PreparedItem] = {}
        if texts:
            chars = sum(len(inputs[i].text or "") for i in texts)
            encoded = await off_loop(chars, lambda: self.prepare(
                [inputs[i] for i in texts], truncate, [where[i] for i in texts]))
            prepared = {i: PreparedItem(p.payload, p.cost, i)  # its place in the request
                        for i, p in zip(texts, encoded, strict=True)}
        for i, item in enumerate(inputs):
            if item.images:
                prepared[i] = await loop.run_in_executor(pool(), self.prepare_image, item, i,
                                                         where[i])
        return [prepared[i] for i in range(len(inputs))]

    def _require(self, task: Task) -> None:
        if task not in self.info.tasks:
            raise UnsupportedTask(self.spec.name, task, self.info.tasks)

    async def encode_items(self, submit: Submit, inputs: Sequence[ItemInput],
                           options: EncodeOptions) -> TaskOutput[list[Encoded]]:
        self._require("encode")
        common.require_items(len(inputs))
        params = self.params(options)
        where = [f"items[{i}]" for i in range(len(inputs))]
        items = await self._prepare(inputs, options.truncate, where)
        result = await submit(items, params, None)
        return TaskOutput([Encoded(dense=v) for v in result.values], result.queue_ms,
                          result.inference_ms, sum(item.cost for item in items))

    async def score_items(self, submit: Submit, query: ItemInput, inputs: Sequence[ItemInput],
                          options: ScoreOptions) -> TaskOutput[list[float]]:
        self._require("score")
        common.require_items(len(inputs))
        check_lora(options.lora, ())
        where = ["query", *(f"items[{i}]" for i in range(len(inputs)))]
        items = await self._prepare([query, *inputs], options.truncate, where)
        result = await submit(items, ClipParams(True), None)
        values = list(result.values)
        queue_ms, inference_ms = combine([result])
        return TaskOutput(cosine(values[0], values[1:]), queue_ms, inference_ms,
                          sum(item.cost for item in items))

    async def encode(self, submit: Submit, texts: Sequence[str],
                     options: EncodeOptions) -> TaskOutput[list[Encoded]]:
        check_lora(options.lora, ())
        return await self.encode_items(submit, [ItemInput(text) for text in texts], options)

    async def score(self, submit: Submit, query: str, docs: Sequence[str],
                    options: ScoreOptions) -> TaskOutput[list[float]]:
        return await self.score_items(submit, ItemInput(query),
                                      [ItemInput(doc) for doc in docs], options)


def features(output: Any) -> torch.Tensor:
    """get_*_features' vectors: a tensor (transformers 4) or its pooler_output (5)."""
    tensor: torch.Tensor = output if isinstance(output, torch.Tensor) else output.pooler_output
    return tensor


def _config(spec: ModelSpec, model_dir: Path) -> Any:
    config = common.load_config(spec, model_dir)
    if config.model_type not in KINDS:
        raise ModelLoadError(spec.name, f"the clip family loads CLIP and SigLIP checkpoints; "
                                        f"this one is {config.model_type!r}")
    return config


def say_onnx_is_refused(spec: ModelSpec, runtime: Runtime) -> None:
    """Where onnx would have run this model, the log says it runs on torch, and why (a
    warning when its YAML asked for onnx by name)."""
    try:
        wanted = choose_backend(spec, runtime)
    except ModelLoadError:  # onnx asked for beside LoRAs or quantize: still onnx wanted
        wanted = "onnx"
    if wanted == "onnx":
        level = logging.WARNING if (spec.backend == "onnx" or spec.quantize) else logging.INFO
        log.log(level, "%s: onnx refused: %s", spec.name, ONNX_REFUSED)


def load(spec: ModelSpec, runtime: Runtime, weights: bool = True) -> ClipAdapter:
    """Load a CLIP or SigLIP directory (config, weights, fast tokenizer,
    preprocessor_config.json), offline."""
    from transformers import AutoModel

    model_dir = resolve_source(spec)
    config = _config(spec, model_dir)
    tokenizer = common.load_tokenizer(spec, model_dir)
    preprocess = Preprocessor.from_directory(model_dir, str(config.model_type))
    say_onnx_is_refused(spec, runtime)
    forward: Any
    if weights:
        common.apply_runtime(runtime)
        model = AutoModel.from_pretrained(str(model_dir), **common.load_kwargs(spec))
        forward = common.TorchForward(model, {}, runtime, "pooler_output")
    else:
        forward = ForwardElsewhere("torch", ())
    return ClipAdapter(spec, forward, config, tokenizer, preprocess, runtime)


def load_front(spec: ModelSpec, runtime: Runtime) -> ClipAdapter:
    """The request path alone (tokenizer, image preprocessing), without weights."""
    return load(spec, runtime, weights=False)


def is_pixels(payload: object) -> bool:
    return isinstance(payload, np.ndarray) and payload.ndim == 3
