"""The spaCy NER family on the shipped en_core_web_sm package."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import pytest

from ember.adapters import spacy_ner
from ember.adapters.base import EncodeOptions, Entity, ExtractOptions, Runtime
from ember.adapters.spacy_ner import SpacyNerAdapter
from ember.config import ModelSpec, load_catalog
from ember.errors import InvalidInput, UnsupportedTask
from tests.adapters.serving import ServeFactory

APPLE = "Apple was founded by Steve Jobs in California in 1976."
TEXTS = [APPLE,
         "Angela Merkel met Emmanuel Macron in Paris last Tuesday to discuss a €1.2 trillion "
         "EU budget.",
         "Microsoft acquired GitHub for $7.5 billion in June 2018.",
         "Chinese and Japanese tourists visited the Louvre on Christmas Day at 5 p.m.",
         "no entities here at all"]


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    return load_catalog()["spacy/en_core_web_sm"]


@pytest.fixture(scope="module")
def ner(spec: ModelSpec) -> SpacyNerAdapter:
    return spacy_ner.load(spec, Runtime())


async def extract(adapter: SpacyNerAdapter, serve: ServeFactory, texts: Sequence[str],
                  labels: tuple[str, ...] | None = None) -> list[list[Entity]]:
    async with serve(adapter) as served:
        out = await adapter.extract(served.submit, texts, ExtractOptions(labels=labels))
    return out.values


def spans(entities: list[Entity]) -> set[tuple[str, str]]:
    return {(e.text, e.label) for e in entities}


async def test_finds_the_entities_with_offsets(ner: SpacyNerAdapter, serve: ServeFactory) -> None:
    [found] = await extract(ner, serve, [APPLE])
    assert {("Apple", "ORG"), ("Steve Jobs", "PERSON"), ("California", "GPE"),
            ("1976", "DATE")} <= spans(found)
    for entity in found:
        assert APPLE[entity.start:entity.end] == entity.text
        assert entity.score == 1.0


async def test_friendly_and_native_label_filters(ner: SpacyNerAdapter,
                                                 serve: ServeFactory) -> None:
    [people_orgs] = await extract(ner, serve, [APPLE], ("Person", "company"))
    assert spans(people_orgs) == {("Apple", "ORG"), ("Steve Jobs", "PERSON")}
    [places] = await extract(ner, serve, [APPLE], ("location",))
    assert spans(places) == {("California", "GPE")}
    [native] = await extract(ner, serve, [APPLE], ("gpe", "DATE"))
    assert spans(native) == {("California", "GPE"), ("1976", "DATE")}


async def test_unknown_label_lists_the_known_ones(ner: SpacyNerAdapter,
                                                  serve: ServeFactory) -> None:
    with pytest.raises(InvalidInput) as caught:
        await extract(ner, serve, [APPLE], ("person", "spaceship"))
    assert caught.value.param == "params.labels[1]"
    assert "'spaceship'" in caught.value.message
    for name in ("PERSON", "ORG", "GPE", "organization", "location"):
        assert name in caught.value.message


async def test_a_threshold_is_refused_as_spacy_scores_no_entity(ner: SpacyNerAdapter,
                                                                 serve: ServeFactory) -> None:
    """Found by a black-box review: it was accepted and filtered nothing (every entity
    scores 1.0), so a client thought it had asked for confident entities only."""
    async with serve(ner) as served:
        with pytest.raises(InvalidInput) as caught:
            await ner.extract(served.submit, [APPLE], ExtractOptions(threshold=0.9))
        assert caught.value.param == "params.threshold" and "1.0" in caught.value.message
        out = await ner.extract(served.submit, [APPLE], ExtractOptions())
    assert all(entity.score == 1.0 for entity in out.values[0])


async def test_a_batch_gives_each_text_its_own_entities(ner: SpacyNerAdapter,
                                                        serve: ServeFactory) -> None:
    batched = await extract(ner, serve, TEXTS)
    singles = [(await extract(ner, serve, [text]))[0] for text in TEXTS]
    assert batched == singles
    assert batched[-1] == []
    assert ("GitHub", "ORG") in spans(batched[2])


async def test_only_the_entity_components_run_and_results_match_the_full_pipeline(
        ner: SpacyNerAdapter, spec: ModelSpec, serve: ServeFactory) -> None:
    full = spacy_ner.load(replace(spec, options={"ner_only": False}), Runtime())
    assert ner.info.extra["components"] == ["ner"]
    assert full.info.extra["components"] != ["ner"]
    assert await extract(ner, serve, TEXTS) == await extract(full, serve, TEXTS)


async def test_info_costs_and_refusals(ner: SpacyNerAdapter, serve: ServeFactory) -> None:
    assert {"PERSON", "ORG", "GPE", "LOC", "DATE", "MONEY", "NORP"} <= set(ner.info.labels)
    assert ner.info.tasks == ("extract",)
    assert [i.cost for i in ner.prepare(["Hello, world!", ""])] == [4, 1]
    assert ner.memory_bytes() > 1_000_000
    async with serve(ner) as served:
        out = await ner.extract(served.submit, [APPLE], ExtractOptions())
        assert out.tokens == 11
        with pytest.raises(UnsupportedTask):
            await ner.encode(served.submit, ["text"], EncodeOptions())
        with pytest.raises(InvalidInput, match="at least one"):
            await ner.extract(served.submit, [], ExtractOptions())


def test_the_cost_estimate_of_a_long_text_is_sampled_and_close() -> None:
    from ember.adapters.spacy_ner import SAMPLE_CHARS, TOKEN_ESTIMATE, estimate_tokens

    short = "Ada Lovelace, born 1815, wrote notes."
    assert estimate_tokens(short) == len(TOKEN_ESTIMATE.findall(short)) == 9
    long = ("Charles Babbage met Ada in London. " + "word, " * 5) * 20_000
    exact = len(TOKEN_ESTIMATE.findall(long))
    assert len(long) > 100 * SAMPLE_CHARS
    assert abs(estimate_tokens(long) - exact) / exact < 0.05
    started = time.perf_counter()
    for _ in range(100):
        estimate_tokens(long)
    assert time.perf_counter() - started < 0.5  # 100 samples, not 100 walks of 0.8 MB
