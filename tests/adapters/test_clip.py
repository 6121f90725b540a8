"""The clip family on tiny CLIP and SigLIP models with random weights, loaded through the
real loader: Ember's text and image vectors equal transformers' own get_text_features and
get_image_features, alone and in mixed batches; score order on cases whose answer is
known; pixels cross the process wire as arrays; ONNX falls back to torch, saying so."""

from __future__ import annotations

import asyncio
import io
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModel, AutoProcessor

from ember.adapters._images import ImageInput, ItemInput
from ember.adapters._tokenize import OFFLOAD_CHARS
from ember.adapters.base import EncodeOptions, Runtime, ScoreOptions
from ember.adapters.clip import ClipAdapter, ClipParams, is_pixels
from ember.config import load_catalog
from ember.engine import WorkerConfig
from ember.errors import InvalidInput
from ember.ipc.batch import items_from_wire, items_to_wire
from ember.ipc.models import front_loader
from ember.ipc.wire import pack, unpack
from ember.registry import adapter_loader
from tests.adapters.serving import serving
from tests.adapters.tiny_clip import TEXT_POSITIONS, build_clip, build_siglip, clip_yaml

TEXTS = ["a cat on a tree", "the river in paris", "what is the weather", "big dog"]


def png(seed: int, size: tuple[int, int] = (40, 30)) -> bytes:
    array = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), np.uint8)
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return out.getvalue()


IMAGES = [png(1), png(2, (64, 64)), png(3, (20, 50))]


@dataclass
class Tiny:
    kind: str
    folder: Path
    adapter: ClipAdapter
    reference: Any
    processor: Any


@pytest.fixture(scope="module", params=["clip", "siglip"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[Tiny]:
    kind = request.param
    root = tmp_path_factory.mktemp(f"tiny-{kind}")
    folder = (build_clip if kind == "clip" else build_siglip)(root / "model")
    yamls = root / "catalog"
    yamls.mkdir()
    (yamls / "m.yaml").write_text(clip_yaml(f"test/{kind}", folder), encoding="utf-8")
    spec = load_catalog([yamls])[f"test/{kind}"]
    adapter = adapter_loader("clip")(spec, Runtime(backend="torch"))
    assert isinstance(adapter, ClipAdapter)
    reference = AutoModel.from_pretrained(str(folder)).eval()
    yield Tiny(kind, folder, adapter, reference, AutoProcessor.from_pretrained(str(folder)))
    adapter.close()


def reference_texts(tiny: Tiny, texts: list[str]) -> np.ndarray:
    if tiny.kind == "siglip":  # its processor's own padding, no mask
        inputs = tiny.processor(text=texts, padding="max_length", max_length=TEXT_POSITIONS,
                                return_tensors="pt")
        inputs.pop("attention_mask", None)
    else:
        inputs = tiny.processor(text=texts, padding=True, return_tensors="pt")
    inputs.pop("token_type_ids", None)
    with torch.inference_mode():
        out = tiny.reference.get_text_features(**inputs)
    return np.asarray((out if isinstance(out, torch.Tensor) else out.pooler_output).numpy())


def reference_images(tiny: Tiny, images: list[bytes]) -> np.ndarray:
    pictures = [Image.open(io.BytesIO(data)) for data in images]
    pixels = tiny.processor(images=pictures, return_tensors="pt")["pixel_values"]
    with torch.inference_mode():
        out = tiny.reference.get_image_features(pixel_values=pixels)
    return np.asarray((out if isinstance(out, torch.Tensor) else out.pooler_output).numpy())


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return np.asarray((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)))


def dense(output: Any) -> np.ndarray:
    return np.stack([encoded.dense for encoded in output.values])


def items(*inputs: str | bytes) -> list[ItemInput]:
    return [ItemInput(images=(ImageInput(x),)) if isinstance(x, bytes) else ItemInput(x)
            for x in inputs]


async def test_text_vectors_equal_get_text_features(tiny: Tiny) -> None:
    async with serving(tiny.adapter) as served:
        output = await tiny.adapter.encode(served.submit, TEXTS, EncodeOptions())
    assert np.all(cosines(dense(output), reference_texts(tiny, TEXTS)) >= 0.9999)
    norms = np.linalg.norm(dense(output), axis=1)
    assert np.allclose(norms, 1.0, atol=1e-5)  # normalized by default


async def test_image_vectors_equal_get_image_features(tiny: Tiny) -> None:
    async with serving(tiny.adapter) as served:
        output = await tiny.adapter.encode_items(served.submit, items(*IMAGES),
                                                 EncodeOptions(normalize=False))
    want = reference_images(tiny, IMAGES)
    assert np.all(cosines(dense(output), want) >= 0.9999)
    assert np.allclose(dense(output), want, atol=1e-4)  # unnormalized: the very features
    image_tokens = (32 // 8) ** 2 + (1 if tiny.kind == "clip" else 0)
    assert output.tokens == image_tokens * len(IMAGES)


async def test_mixed_batches_equal_the_reference(tiny: Tiny,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Texts and images in one forward (one request), and in concurrent requests."""
    mixed = items(IMAGES[0], TEXTS[0], IMAGES[1], TEXTS[1], TEXTS[2], IMAGES[2])
    texts, images = reference_texts(tiny, TEXTS[:3]), reference_images(tiny, IMAGES)
    want = np.stack([images[0], texts[0], images[1], texts[1], texts[2], images[2]])
    batches: list[list[str]] = []
    forward = tiny.adapter.forward

    def recording(prepared: Any, params: Any) -> Any:
        batches.append(["image" if is_pixels(p.payload) else "text"
                        for p in prepared])
        return forward(prepared, params)

    monkeypatch.setattr(tiny.adapter, "forward", recording)
    # Without the padding bound, an image (17 or 16 tokens) and a short text share forwards.
    async with serving(tiny.adapter, WorkerConfig(max_padding=0)) as served:
        one = await tiny.adapter.encode_items(served.submit, mixed, EncodeOptions())
        many = await asyncio.gather(*(tiny.adapter.encode_items(served.submit, [item],
                                                                EncodeOptions())
                                      for item in mixed))
    assert sorted(batches[0]) == ["image"] * 3 + ["text"] * 3  # one forward, both towers
    assert np.all(cosines(dense(one), want) >= 0.9999)
    assert np.all(cosines(np.concatenate([dense(o) for o in many]), want) >= 0.9999)


async def test_a_request_of_many_images_takes_turns_in_the_pool(
        tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a black-box review: a request's images were decoded as one task in the
    tokenizing pool, and a long text sent meanwhile waited for all of them (2 s for 30)."""
    real = tiny.adapter.prepare_image
    decoded: list[float] = []

    def slow_decode(item: ItemInput, index: int, where: str) -> Any:
        time.sleep(0.02)  # what a large JPEG takes
        decoded.append(time.monotonic())
        return real(item, index, where)

    monkeypatch.setattr(tiny.adapter, "prepare_image", slow_decode)
    long_text = " ".join(["word"] * (OFFLOAD_CHARS // 4))  # tokenized in the pool too
    async with serving(tiny.adapter) as served:
        images = asyncio.ensure_future(tiny.adapter.encode_items(
            served.submit, items(*[IMAGES[0]] * 20), EncodeOptions()))
        while not decoded:
            await asyncio.sleep(0.001)
        await tiny.adapter.encode(served.submit, [long_text], EncodeOptions())
        text_done = time.monotonic()
        assert len((await images).values) == 20
    assert text_done < decoded[-1]  # not after the last of the other request's images


async def test_score_ranks_the_known_answer_first(tiny: Tiny) -> None:
    """An image query against texts and images that include the query's own picture and a
    lightly noised copy: the copy ranks first, the noised one second; a text query finds
    its own text among images and texts."""
    base = np.random.default_rng(5).integers(0, 256, (40, 40, 3), np.uint8)
    noisy = np.clip(base.astype(int) + np.random.default_rng(6).integers(-6, 7, base.shape),
                    0, 255).astype(np.uint8)

    def as_png(array: np.ndarray) -> bytes:
        out = io.BytesIO()
        Image.fromarray(array).save(out, format="PNG")
        return out.getvalue()

    query = items(as_png(base))[0]
    docs = items(TEXTS[0], IMAGES[1], as_png(noisy), IMAGES[2], as_png(base), TEXTS[3])
    async with serving(tiny.adapter) as served:
        scores = (await tiny.adapter.score_items(served.submit, query, docs,
                                                 ScoreOptions())).values
        text_scores = (await tiny.adapter.score_items(served.submit, ItemInput(TEXTS[1]),
                                                      items(IMAGES[0], TEXTS[2], TEXTS[1]),
                                                      ScoreOptions())).values
        plain = (await tiny.adapter.score(served.submit, TEXTS[3], TEXTS,
                                          ScoreOptions())).values
    order = sorted(range(len(docs)), key=lambda i: -scores[i])
    assert order[:2] == [4, 2] and scores[4] == pytest.approx(1.0, abs=1e-5)
    assert int(np.argmax(text_scores)) == 2 and text_scores[2] == pytest.approx(1.0, abs=1e-5)
    assert int(np.argmax(plain)) == 3


def test_pixels_cross_the_process_wire_as_arrays(tiny: Tiny) -> None:
    """The request path's half (no weights) prepares; the items go through the IPC wire;
    the engine's forward on them equals the forward on the originals."""
    half = front_loader("clip")(tiny.adapter.spec, Runtime(backend="torch"))
    assert isinstance(half, ClipAdapter) and half.memory_bytes() == 0
    prepared = half.prepare(items(IMAGES[0], TEXTS[0]), True, ["items[0]", "items[1]"])
    assert isinstance(prepared[0].payload, np.ndarray) and prepared[0].payload.dtype == np.float32
    # As an API process sends them: one batch message's item block (texts' ids as one
    # int array with offsets when every item is text; here pixels and ids as a list).
    crossed = items_from_wire(unpack(pack(items_to_wire(prepared))))
    texts_only = half.prepare(items(TEXTS[0], TEXTS[1]), True, ["items[0]", "items[1]"])
    ids_crossed = items_from_wire(unpack(pack(items_to_wire(texts_only))))
    assert isinstance(ids_crossed[0].payload, np.ndarray)  # a view of the id block
    for a, b in zip(tiny.adapter.forward(texts_only, ClipParams(True)),
                    tiny.adapter.forward(ids_crossed, ClipParams(True)), strict=True):
        assert np.allclose(a, b)
    params = unpack(pack(ClipParams(True)))
    here = tiny.adapter.forward(prepared, ClipParams(True))
    there = tiny.adapter.forward(crossed, params)
    for a, b in zip(here, there, strict=True):
        assert np.allclose(a, b)


def test_item_rules_and_limits(tiny: Tiny) -> None:
    adapter = tiny.adapter
    where = ["items[0]"]
    for item, param in ((ItemInput("a cat", (ImageInput(IMAGES[0]),)), "items[0].text"),
                        (ItemInput(None, (ImageInput(IMAGES[0]),) * 2), "items[0].images"),
                        (ItemInput(None), "items[0].text")):
        with pytest.raises(InvalidInput) as caught:
            adapter.check([item], where)
        assert caught.value.param == param
    with pytest.raises(InvalidInput) as caught:
        adapter.prepare(items(b"\x89PNG\r\n\x1a\nbroken"), True, where)
    assert caught.value.param == "items[0].images[0].data"
    with pytest.raises(InvalidInput):
        adapter.params(EncodeOptions(instruction="Represent this"))
    long_text = " ".join(["cat"] * 100)
    cut = adapter.prepare(items(long_text), True, where)[0]
    assert cut.cost == TEXT_POSITIONS
    with pytest.raises(InvalidInput):
        adapter.prepare(items(long_text), False, where)
    assert adapter.info.extra["inputs"] == ["text", "image"]


def test_onnx_is_refused_and_falls_back_to_torch(tiny: Tiny,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    from ember.adapters.clip import load

    with caplog.at_level(logging.INFO, logger="ember.clip"):
        adapter = load(tiny.adapter.spec, Runtime(backend="onnx"), weights=False)
    assert adapter.info.extra["backend"] == "torch"
    assert any("onnx refused" in r.getMessage() and "runs on torch" in r.getMessage()
               for r in caplog.records)
    # A YAML that asks for onnx by name gets a warning, and torch.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ember.clip"):
        adapter = load(replace(tiny.adapter.spec, backend="onnx"), Runtime(backend="torch"),
                       weights=False)
    assert adapter.info.extra["backend"] == "torch"
    assert [r.levelno for r in caplog.records if "onnx refused" in r.getMessage()] == \
        [logging.WARNING]
