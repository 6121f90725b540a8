"""GLiNER, zero-shot extraction: a tiny model built here with random weights, and Ember's
extract against the gliner package's own `predict_entities` on the same weights."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from ember.adapters._tokenize import OFFLOAD_CHARS, in_pool
from ember.adapters.base import Entity, ExtractOptions, Runtime
from ember.adapters.gliner import GlinerParams, load, load_front
from ember.config import ModelSpec, Source, spec_from_directory
from ember.engine import RequestTooLarge, WorkerConfig
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


def test_the_front_tokenizes_beside_the_forward(gliner_dir: Path) -> None:
    """One process: the event loop tokenizes the next requests while the worker's thread
    collates a forward. A shared transformers wrapper had its truncation and padding
    re-set under the collator, and one in four forwards failed."""
    adapter = load(spec_for(gliner_dir), Runtime(backend="torch"))
    params = adapter.params(ExtractOptions(labels=tuple(LABELS), threshold=0.0))
    items = adapter.prepare([long_text(SIZE), "the cat sat"], params)
    want = adapter.forward(items, params)
    stop = threading.Event()

    def front() -> None:
        rows = [FILLER * 6, FILLER[:3]]
        while not stop.is_set():
            adapter.token_counts(rows)
            adapter.prompt_tokens(LABELS)

    with ThreadPoolExecutor(2) as threads:
        fronts = [threads.submit(front) for _ in range(2)]
        try:
            got = [adapter.forward(items, params) for _ in range(60)]
        finally:
            stop.set()
        for done in fronts:
            done.result()  # the fronts' own calls did not fail either
    assert all(g == want for g in got)


async def test_a_large_request_is_split_and_tokenized_off_the_loop(
        serve: ServeFactory, gliner_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    adapter = load(spec_for(gliner_dir), Runtime(backend="torch"))
    where: list[bool] = []
    real = adapter.prepare_windows

    def prepare_windows(texts: Any, params: GlinerParams) -> Any:
        where.append(in_pool())
        return real(texts, params)

    monkeypatch.setattr(adapter, "prepare_windows", prepare_windows)
    options = ExtractOptions(labels=tuple(LABELS), threshold=THRESHOLD)
    large = long_text(OFFLOAD_CHARS // 4)  # words of 4+ characters: past the limit
    assert len(large) >= OFFLOAD_CHARS
    async with serve(adapter) as served:
        await adapter.extract(served.submit, ["the cat sat"], options)
        await adapter.extract(served.submit, [large], options)
    assert where == [False, True]


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


# Long texts: the tiny model reads 64 words (max_len) and predicts spans of up to 4
# (max_width); a longer text is read in windows of 64 words, 16 shared by neighbours.
SIZE, OVERLAP = 64, 16
FILLER = " ".join(TEXTS[:3]).split()


def long_text(words: int, tail: str = "") -> str:
    return " ".join((FILLER * (words // len(FILLER) + 1))[:words]) + tail


def windows_of(reference: Any, text: str) -> list[tuple[int, str]]:
    """Each window's offset and text, from the reference's own word splitter."""
    words = list(reference.data_processor.words_splitter(text))
    if len(words) <= SIZE:
        return [(0, text)]
    firsts = [*range(0, len(words) - SIZE, SIZE - OVERLAP), len(words) - SIZE]
    return [(words[f][1], text[words[f][1]:words[f + SIZE - 1][2]]) for f in firsts]


def merged(reference: Any, text: str, labels: list[str], threshold: float = THRESHOLD,
           flat_ner: bool = True, multi_label: bool = False) -> list[dict[str, Any]]:
    """predict_entities on each window alone, shifted into the text; a span found twice
    once, at its higher score; then gliner's own greedy_search over the whole text."""
    windows = windows_of(reference, text)
    if not text.strip():
        return []
    if len(windows) == 1:
        found: list[dict[str, Any]] = reference.predict_entities(
            text, labels, flat_ner=flat_ner, threshold=threshold, multi_label=multi_label)
        return found
    best: dict[tuple[int, int, str], float] = {}
    for offset, part in windows:
        for e in reference.predict_entities(part, labels, flat_ner=flat_ner,
                                            threshold=threshold, multi_label=multi_label):
            key = (e["start"] + offset, e["end"] + offset, e["label"])
            best[key] = max(best.get(key, -1.0), e["score"])
    # gliner's spans end on their last word (inclusive): the last character here.
    spans = [(start, end - 1, label, score) for (start, end, label), score in best.items()]
    kept = reference.decoder.greedy_search(spans, flat_ner=flat_ner, multi_label=multi_label)
    return [{"start": s, "end": e + 1, "text": text[s:e + 1], "label": label, "score": score}
            for s, e, label, score in kept]


def whole(text: str, entities: list[Entity]) -> None:
    """Offsets into the original text, sorted by start, each span once."""
    assert all(text[e.start:e.end] == e.text for e in entities)
    assert [e.start for e in entities] == sorted(e.start for e in entities)
    assert len({(e.start, e.end, e.label) for e in entities}) == len(entities)


async def test_a_long_text_is_read_past_max_len(serve: ServeFactory, gliner_dir: Path,
                                                reference: Any) -> None:
    """The review's repro: the old code kept the first 64 words and found nothing after."""
    adapter = load(spec_for(gliner_dir), Runtime(backend="torch"))
    text = " ".join(f"word{i}" for i in range(100)) + " Barack Obama visited Paris."
    past = adapter.split(text).starts[SIZE]  # the first character the old code dropped
    options = ExtractOptions(labels=("person", "city"), threshold=0.0)
    async with serve(adapter) as served:
        entities = (await adapter.extract(served.submit, [text], options)).values[0]
    whole(text, entities)
    assert any(e.start >= past for e in entities)
    # At threshold 0 every word is in some span; the last window alone holds these.
    assert {"Barack", "Obama", "Paris"} <= {w for e in entities for w in e.text.split()}
    same(entities, merged(reference, text, ["person", "city"], threshold=0.0))


@pytest.mark.parametrize(("flat_ner", "multi_label"),
                         [(True, False), (False, False), (True, True), (False, True)])
async def test_windows_merge_as_the_reference_reads_each_window(
        serve: ServeFactory, gliner_dir: Path, reference: Any, flat_ner: bool,
        multi_label: bool) -> None:
    adapter = load(spec_for(gliner_dir, options={"flat_ner": flat_ner,
                                                 "multi_label": multi_label}),
                   Runtime(backend="torch"))
    assert (adapter.max_words, adapter.overlap) == (SIZE, OVERLAP)
    text = long_text(190)  # windows at words 0, 48, 96 and 126
    assert len(windows_of(reference, text)) == 4
    options = ExtractOptions(labels=tuple(LABELS), threshold=THRESHOLD)
    async with serve(adapter) as served:
        got = (await adapter.extract(served.submit, [text], options)).values[0]
    want = merged(reference, text, LABELS, flat_ner=flat_ner, multi_label=multi_label)
    assert want, "the random model finds something at this threshold"
    whole(text, got)
    same(got, want)


def test_the_merge_keeps_spans_as_gliners_greedy_search(gliner_dir: Path,
                                                         reference: Any) -> None:
    """merge_windows against gliner's own greedy_search, on many random span sets."""
    import random

    from ember.adapters.gliner import merge_windows

    front = load_front(spec_for(gliner_dir), Runtime(backend="torch"))
    text = long_text(60)
    words = front.split(text)
    rng = random.Random(0)
    for trial in range(200):
        flat_ner, multi_label = bool(trial % 2), bool(trial // 2 % 2)
        found = []
        for _ in range(rng.randrange(1, 80)):
            first = rng.randrange(len(words.words))
            last = min(len(words.words) - 1, first + rng.randrange(4))
            start, end = words.starts[first], words.ends[last]
            found.append(Entity(text[start:end], rng.choice(LABELS), start, end, rng.random()))
        best: dict[tuple[int, int, str], float] = {}
        for e in found:
            best[(e.start, e.end, e.label)] = max(best.get((e.start, e.end, e.label), -1.0),
                                                  e.score)
        want = reference.decoder.greedy_search(
            [(s, e - 1, label, score) for (s, e, label), score in best.items()],
            flat_ner=flat_ner, multi_label=multi_label)
        got = merge_windows(found, words, flat_ner, multi_label)
        assert [(e.start, e.end - 1, e.label, e.score) for e in got] == want


async def test_a_span_across_a_window_boundary_is_found_whole(
        serve: ServeFactory, gliner_dir: Path, reference: Any) -> None:
    """Spans over words 63 and 64 lie in the second window alone (words 48 on)."""
    adapter = load(spec_for(gliner_dir, options={"flat_ner": False}), Runtime(backend="torch"))
    options = ExtractOptions(labels=tuple(LABELS), threshold=THRESHOLD)
    across = []
    async with serve(adapter) as served:
        for before in range(56, SIZE):  # the target words, placed over the boundary
            text = long_text(before, " the cat is in paris and london with a big dog ") \
                + long_text(40)
            boundary = adapter.split(text).starts[SIZE]
            got = (await adapter.extract(served.submit, [text], options)).values[0]
            whole(text, got)
            same(got, merged(reference, text, LABELS, flat_ner=False))
            across += [(text, e) for e in got if e.start < boundary < e.end]
    assert across, "the random model puts a span over the boundary"
    for text, entity in across:
        offset, second = windows_of(reference, text)[1]
        assert offset < entity.start and entity.end <= offset + len(second)
        assert len(entity.text.split()) > 1 and text[entity.start:entity.end] == entity.text


async def test_a_span_two_windows_find_is_reported_once(
        serve: ServeFactory, gliner_dir: Path, reference: Any) -> None:
    adapter = load(spec_for(gliner_dir), Runtime(backend="torch"))
    text = long_text(120)
    options = ExtractOptions(labels=tuple(LABELS), threshold=THRESHOLD)
    async with serve(adapter) as served:
        got = (await adapter.extract(served.submit, [text], options)).values[0]
    whole(text, got)
    seen: dict[tuple[int, int, str], list[float]] = {}
    for offset, part in windows_of(reference, text):
        for e in reference.predict_entities(part, LABELS, threshold=THRESHOLD):
            seen.setdefault((e["start"] + offset, e["end"] + offset, e["label"]),
                            []).append(e["score"])
    twice = {key: scores for key, scores in seen.items() if len(scores) == 2}
    reported = [e for e in got if (e.start, e.end, e.label) in twice]
    assert reported, "spans in the shared words are found by both windows"
    for entity in reported:
        assert [(e.start, e.end, e.label) for e in got].count(
            (entity.start, entity.end, entity.label)) == 1
        assert entity.score == pytest.approx(max(twice[entity.start, entity.end,
                                                       entity.label]), abs=1e-5)


async def test_long_and_short_texts_of_one_request_come_back_in_order(
        serve: ServeFactory, gliner_dir: Path, reference: Any) -> None:
    adapter = load(spec_for(gliner_dir), Runtime(backend="torch"))
    texts = [long_text(150), TEXTS[0], long_text(70, " paris"), "", TEXTS[2],
             long_text(300)]
    options = ExtractOptions(labels=tuple(LABELS), threshold=THRESHOLD)
    params = adapter.params(options)
    items = adapter.prepare(texts, params)
    assert [item.index for item in items] == list(range(len(items)))  # the worker's rule
    assert len(items) == 3 + 1 + 2 + 1 + 1 + 6  # windows at words 0, 48, 86 of 150...
    async with serve(adapter, WorkerConfig(idle_coalesce_ms=50)) as served:
        whole_request = await adapter.extract(served.submit, texts, options)
        alone = [await adapter.extract(served.submit, [text], options) for text in texts]
    assert len(whole_request.values) == len(texts)
    assert whole_request.tokens == sum(item.cost for item in items)
    for text, got, one in zip(texts, whole_request.values, alone, strict=True):
        whole(text, got)
        same(got, merged(reference, text, LABELS))
        same(got, [e.__dict__ for e in one.values[0]])


async def test_the_front_windows_and_merges_across_the_process_boundary(
        serve: ServeFactory, gliner_dir: Path, reference: Any) -> None:
    """`load_front` in an API process: windows cross the wire as ordinary items, the
    engine's forward sees nothing else, and the merge follows its answer."""
    from ember.engine import PreparedItem, RequestResult
    from ember.ipc.batch import items_from_wire, items_to_wire, values_from_wire, values_to_wire
    from ember.ipc.wire import pack, unpack

    front = load_front(spec_for(gliner_dir), Runtime(backend="torch"))
    adapter = load(spec_for(gliner_dir), Runtime(backend="torch"))
    texts = [long_text(200), TEXTS[1]]
    options = ExtractOptions(labels=tuple(LABELS), threshold=THRESHOLD)
    async with serve(adapter) as served:

        async def over_the_wire(items: Any, params: Any, lora: str | None) -> RequestResult:
            sent: list[PreparedItem] = items_from_wire(unpack(pack(items_to_wire(items))))
            result = await served.submit(sent, unpack(pack(params)), lora)
            values = values_from_wire(unpack(pack(values_to_wire(result.values))), 0,
                                      len(result.values))
            return RequestResult(values, result.queue_ms, result.inference_ms,
                                 result.forwards)

        got = await front.extract(over_the_wire, texts, options)
    for text, entities in zip(texts, got.values, strict=True):
        whole(text, entities)
        same(entities, merged(reference, text, LABELS))


async def test_a_hostile_text_is_read_in_bounded_windows_or_refused_by_name(
        serve: ServeFactory, gliner_dir: Path) -> None:
    adapter = load(spec_for(gliner_dir), Runtime(backend="torch"))
    text = " ".join(f"w{i}" for i in range(40_000))[:150_000]
    words = len(adapter.split(text).words)
    options = ExtractOptions(labels=tuple(LABELS), threshold=THRESHOLD)
    items = adapter.prepare([text], adapter.params(options))
    # Windows grow with the words, a window's words/(max_len - overlap): bounded, as
    # the text is by --max-text-chars; each window carries its own slice of the text.
    assert len(items) == -(-(words - SIZE) // (SIZE - OVERLAP)) + 1 < 4096
    assert all(len(item.payload.words) == SIZE and len(item.payload.text) < 1000
               for item in items)
    async with serve(adapter) as served:
        output = await adapter.extract(served.submit, ["a cat", text], options)
    found = output.values[1]
    whole(text, found)
    assert found[-1].end > len(text) - 200  # read to its end
    # A queue that can never hold the text's windows: the text is refused by name.
    async with serve(adapter, WorkerConfig(max_queue_items=len(items) - 1)) as served:
        with pytest.raises(InvalidInput) as caught:
            await adapter.extract(served.submit, ["a cat", text], options)
        assert caught.value.param == "items[1].text"
        assert f"max_queue_items={len(items) - 1}" in caught.value.message
        assert served.worker.pending_items == 0
    # Texts that fit one by one, but not together: the request is too large (413).
    async with serve(adapter, WorkerConfig(max_queue_items=len(items))) as served:
        with pytest.raises(RequestTooLarge, match="windows"):
            await adapter.extract(served.submit, [text, text], options)


async def test_the_route_refuses_a_text_the_queue_never_holds_by_name(
        gliner_dir: Path) -> None:
    from ember.config import ServerSettings
    from tests.api.conftest import SYNTH, serving

    settings = ServerSettings(default_model=SYNTH, model_paths=(gliner_dir,), backend="torch",
                              worker=WorkerConfig(max_queue_items=50))
    text = long_text(5000)  # 104 windows
    async with serving(settings) as served:
        refused = await served.client.post("/v1/extract/local/model", json={
            "items": [{"text": TEXTS[0]}, {"text": text}], "params": {"labels": LABELS}})
        assert refused.status_code == 422, refused.text
        error = refused.json()
        assert "items[1].text" in refused.text and "max_queue_items=50" in refused.text, error
        too_large = await served.client.post("/v1/extract/local/model", json={
            "items": [{"text": long_text(1000)}] * 3, "params": {"labels": LABELS}})
        assert too_large.status_code == 413 and "windows" in too_large.text, too_large.text
        fits = await served.client.post("/v1/extract/local/model", json={
            "items": [{"text": long_text(1000)}], "params": {"labels": LABELS}})
        assert fits.status_code == 200, fits.text
