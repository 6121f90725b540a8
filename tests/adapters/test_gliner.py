"""GLiNER, zero-shot extraction: a tiny model built here with random weights, and Ember's
extract against the gliner package's own `predict_entities` on the same weights."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from ember.adapters.base import Entity, ExtractOptions, Runtime
from ember.adapters.gliner import GlinerParams, load, load_front
from ember.config import ModelSpec, Source, spec_from_directory
from ember.engine import WorkerConfig
from ember.errors import InvalidInput, ModelLoadError
from tests.adapters.serving import ServeFactory
from tests.adapters.tiny_models import build_bi_encoder

TEXTS = ["the cat is in paris and london", "apple and banana bread with coffee",
         "a big dog ran to the river in france", "", "   "]
LABELS = ["city", "animal", "food"]
THRESHOLD = 0.5


def build_gliner(directory: Path, seed: int = 0) -> Path:
    """A GLiNER span model over a tiny BERT backbone, random weights, in the layout the
    gliner package reads (gliner_config.json, model.safetensors, the tokenizer)."""
    from gliner import GLiNERConfig
    from gliner.model import UniEncoderSpanGLiNER
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    backbone = build_bi_encoder(directory.parent / f"{directory.name}-backbone", seed=seed,
                                max_seq_length=128)
    torch.manual_seed(seed)
    fields: dict[str, Any] = {"model_name": str(backbone), "hidden_size": 32, "max_width": 4,
                              "max_len": 64, "dropout": 0.0, "span_mode": "markerV0"}
    config = GLiNERConfig(**fields)
    tokenizer = AutoTokenizer.from_pretrained(str(backbone))
    model = UniEncoderSpanGLiNER(config, tokenizer=tokenizer, backbone_from_pretrained=True)
    UniEncoderSpanGLiNER._resize_token_embeddings(model, config, tokenizer)  # its markers
    directory.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.model.state_dict().items()},
              str(directory / "model.safetensors"))
    fields.update(class_token_index=model.config.class_token_index,
                  vocab_size=model.config.vocab_size, model_type="gliner_uni_encoder_span")
    (directory / "gliner_config.json").write_text(json.dumps(fields))
    tokenizer.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def gliner_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gliner(tmp_path_factory.mktemp("gliner") / "model")


@pytest.fixture(scope="module")
def reference(gliner_dir: Path) -> Any:
    from gliner import GLiNER

    return GLiNER.from_pretrained(str(gliner_dir), local_files_only=True)


def spec_for(path: Path, **extra: Any) -> ModelSpec:
    return ModelSpec(name="test/gliner", adapter="gliner", source=Source(path=path),
                     tasks=("extract",), **extra)


def same(got: list[Entity], want: list[dict[str, Any]]) -> None:
    assert [(e.start, e.end, e.text, e.label) for e in got] == [
        (w["start"], w["end"], w["text"], w["label"]) for w in want]
    for entity, expected in zip(got, want, strict=True):
        assert entity.score == pytest.approx(expected["score"], abs=1e-5)


def expected(reference: Any, text: str, labels: list[str]) -> list[dict[str, Any]]:
    if not text.strip():
        return []
    found: list[dict[str, Any]] = reference.predict_entities(text, labels,
                                                             threshold=THRESHOLD)
    return found


async def test_extract_matches_predict_entities_alone_and_batched(
        serve: ServeFactory, gliner_dir: Path, reference: Any) -> None:
    adapter = load(spec_for(gliner_dir), Runtime(backend="torch"))
    options = ExtractOptions(labels=tuple(LABELS), threshold=THRESHOLD)
    wants = [expected(reference, text, LABELS) for text in TEXTS]
    assert any(wants), "the random model finds something at this threshold"
    # A window long enough that concurrent requests share forwards.
    async with serve(adapter, WorkerConfig(idle_coalesce_ms=50)) as served:
        for text, want in zip(TEXTS, wants, strict=True):  # alone: one text a forward
            alone = await adapter.extract(served.submit, [text], options)
            same(alone.values[0], want)
        whole = await adapter.extract(served.submit, TEXTS, options)  # one padded batch
        for got, want in zip(whole.values, wants, strict=True):
            same(got, want)
        other = ["food", "city"]
        together = await asyncio.gather(
            *(adapter.extract(served.submit, [text], options) for text in TEXTS),
            adapter.extract(served.submit, TEXTS[:3], ExtractOptions(labels=tuple(other),
                                                                     threshold=THRESHOLD)))
        for output, want in zip(together[:-1], wants, strict=True):
            same(output.values[0], want)
        for got, text in zip(together[-1].values, TEXTS[:3], strict=True):
            same(got, expected(reference, text, other))
        # Texts of different requests shared forwards (batched), and parity held there.
        assert max(served.worker.stats.batch_requests) >= 2


def test_an_items_cost_is_its_tokens(gliner_dir: Path) -> None:
    front = load_front(spec_for(gliner_dir), Runtime(backend="torch"))
    params = front.params(ExtractOptions(labels=("city",)))
    short, long = front.prepare(["the cat", "the cat is in paris and london"], params)
    tokenizer = front.tokenizer
    prompt = 1 + 1 + len(tokenizer.tokenize("city"))
    assert short.cost == len(tokenizer(["the", "cat"], is_split_into_words=True)["input_ids"]) \
        + prompt
    assert long.cost > short.cost
    assert params == GlinerParams(("city",), 0.5)
    assert front.info.tasks == ("extract",) and front.info.extra["zero_shot"] is True


@pytest.mark.parametrize(("labels", "param"), [
    ((), "params.labels"), (("",), "params.labels[0]"), (("x" * 201,), "params.labels[0]"),
    (tuple(f"l{i}" for i in range(65)), "params.labels")])
def test_bad_labels_are_refused_by_name(gliner_dir: Path, labels: tuple[str, ...],
                                        param: str) -> None:
    front = load_front(spec_for(gliner_dir), Runtime(backend="torch"))
    with pytest.raises(InvalidInput) as caught:
        front.params(ExtractOptions(labels=labels))
    assert caught.value.param == param


def test_a_threshold_out_of_range_is_refused(gliner_dir: Path) -> None:
    front = load_front(spec_for(gliner_dir), Runtime(backend="torch"))
    with pytest.raises(InvalidInput, match="threshold"):
        front.params(ExtractOptions(labels=("city",), threshold=1.5))


def test_pickle_weights_load_only_when_allowed(gliner_dir: Path, tmp_path: Path) -> None:
    pickled = tmp_path / "pickled"
    shutil.copytree(gliner_dir, pickled)
    from safetensors.torch import load_file

    torch.save(load_file(str(pickled / "model.safetensors")), str(pickled / "pytorch_model.bin"))
    (pickled / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="allow_pickle"):
        load(spec_for(pickled), Runtime(backend="torch"))
    allowed = load(spec_for(pickled, allow_pickle=True), Runtime(backend="torch"))
    assert allowed.info.tasks == ("extract",)


def test_a_gliner_folder_is_recognised(gliner_dir: Path) -> None:
    spec = spec_from_directory(gliner_dir)
    assert spec.adapter == "gliner" and spec.tasks == ("extract",)


async def test_the_native_extract_route_answers_any_labels(gliner_dir: Path,
                                                           reference: Any) -> None:
    from ember.config import ServerSettings
    from tests.api.conftest import SYNTH, serving

    settings = ServerSettings(default_model=SYNTH, model_paths=(gliner_dir,), backend="torch")
    async with serving(settings) as served:
        response = await served.client.post("/v1/extract/local/model", json={
            "items": [{"id": "a", "text": TEXTS[0]}, {"text": TEXTS[2]}],
            "params": {"labels": LABELS}})
        assert response.status_code == 200, response.text
        items = response.json()["items"]
        assert items[0]["id"] == "a"
        for item, text in zip(items, (TEXTS[0], TEXTS[2]), strict=True):
            got = [Entity(**e) for e in item["entities"]]
            same(got, expected(reference, text, LABELS))
        strict = await served.client.post("/v1/extract/local/model", json={
            "items": [{"text": TEXTS[0]}], "params": {"labels": LABELS, "threshold": 0.9}})
        assert strict.status_code == 200, strict.text
        want = reference.predict_entities(TEXTS[0], LABELS, threshold=0.9)
        same([Entity(**e) for e in strict.json()["items"][0]["entities"]], want)
        assert len(want) < len(expected(reference, TEXTS[0], LABELS))  # it did filter
        out_of_range = await served.client.post("/v1/extract/local/model", json={
            "items": [{"text": "x"}], "params": {"labels": LABELS, "threshold": 2}})
        assert out_of_range.status_code == 422 and "params.threshold" in out_of_range.text
        refused = await served.client.post("/v1/extract/local/model",
                                           json={"items": [{"text": "x"}]})
        assert refused.status_code == 422 and "params.labels" in refused.text
        listed = (await served.client.get("/v1/models/local/model")).json()
        assert listed["adapter"] == "gliner" and listed["tasks"] == ["extract"]
