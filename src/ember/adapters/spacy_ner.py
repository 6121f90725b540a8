"""Named entities with a spaCy pipeline (the default: en_core_web_sm).

Only the components that produce entities, and the embedding layers they
listen to, are loaded; taggers, parsers and lemmatizers do not change the
entities (spec `options: {ner_only: false}` keeps the whole pipeline).

Entity scores: spaCy's greedy transition-based NER has no per-entity
probability, so every entity it returns scores 1.0.

Item cost is an estimate (words and punctuation marks, by a regex) computed
on the event loop, so the shared spaCy vocabulary is only ever touched from
the worker's thread; the forward runs `nlp.pipe` over the whole batch. A long
text is estimated from four spread samples, so the cost of the estimate does
not grow with the text (a 16 MB request took about a second of the loop).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.adapters.base import (
    Encoded,
    EncodeOptions,
    Entity,
    ExtractOptions,
    ModelInfo,
    Runtime,
    ScoreOptions,
    Submit,
    Task,
    TaskOutput,
)
from ember.config import ModelSpec, resolve_source
from ember.engine.types import PreparedItem
from ember.errors import InvalidInput, ModelLoadError, UnsupportedTask
from ember.model_files import read_model_file

TASKS: tuple[Task, ...] = ("extract",)
ENTITY_FACTORIES = frozenset({"ner", "beam_ner", "entity_ruler"})
EMBEDDING_FACTORIES = frozenset({"tok2vec", "transformer", "curated_transformer"})
TOKEN_ESTIMATE = re.compile(r"\w+|[^\w\s]")

# Friendly names (lower case) -> the OntoNotes labels they stand for. A name that
# is also a native label (any case) means that label alone.
FRIENDLY_LABELS: Mapping[str, tuple[str, ...]] = {
    "person": ("PERSON",), "people": ("PERSON",), "per": ("PERSON",),
    "organization": ("ORG",), "organisation": ("ORG",), "org": ("ORG",),
    "company": ("ORG",),
    "location": ("LOC", "GPE"), "place": ("LOC", "GPE"),
    "country": ("GPE",), "city": ("GPE",),
    "facility": ("FAC",), "building": ("FAC",),
    "date": ("DATE",), "time": ("TIME",), "money": ("MONEY",),
    "event": ("EVENT",), "product": ("PRODUCT",),
    "nationality": ("NORP",), "norp": ("NORP",),
    "language": ("LANGUAGE",), "law": ("LAW",),
    "percent": ("PERCENT",), "percentage": ("PERCENT",),
    "quantity": ("QUANTITY",), "ordinal": ("ORDINAL",),
    "cardinal": ("CARDINAL",), "number": ("CARDINAL",),
    "work_of_art": ("WORK_OF_ART",), "work of art": ("WORK_OF_ART",),
}


@dataclass(frozen=True)
class NerParams:
    """One group for every extract request: the label filter is applied after
    the forward, so requests with different filters still batch together."""


NER_PARAMS = NerParams()


def find_pipeline_dir(root: Path) -> Path:
    """The folder holding config.cfg: the root, or the one data folder of a packaged model."""
    if (root / "config.cfg").exists():
        return root
    found = [d for d in sorted(root.iterdir()) if (d / "config.cfg").exists()]
    if len(found) != 1:
        raise FileNotFoundError(f"{root} holds no spaCy pipeline (a config.cfg) or several")
    return found[0]


def _upstreams(node: object) -> Iterator[str]:
    """Names of the embedding components a component's model listens to."""
    if isinstance(node, Mapping):
        for key, value in node.items():
            if key == "upstream":
                yield str(value)
            else:
                yield from _upstreams(value)


def entity_components(config: Mapping[str, Any]) -> set[str]:
    """The components that make entities, with the embedding layers they listen to."""
    components: Mapping[str, Any] = config["components"]
    # A sourced component (no factory) is kept: its role cannot be read here.
    keep = {name for name, c in components.items()
            if c.get("factory", "") in ENTITY_FACTORIES or "factory" not in c}
    for name in list(keep):
        for upstream in _upstreams(components[name]):
            if upstream == "*":
                keep |= {n for n, c in components.items()
                         if c.get("factory") in EMBEDDING_FACTORIES}
            else:
                keep.add(upstream)
    return keep


SAMPLE_CHARS = 4096  # a text longer than this is estimated from samples of this much


def estimate_tokens(text: str) -> int:
    if len(text) <= SAMPLE_CHARS:
        return max(1, len(TOKEN_ESTIMATE.findall(text)))
    window = SAMPLE_CHARS // 4
    step = (len(text) - window) // 3
    sample = " ".join(text[i * step:i * step + window] for i in range(4))
    return max(1, round(len(TOKEN_ESTIMATE.findall(sample)) * len(text) / len(sample)))


class SpacyNerFront:
    """The request path of one spaCy pipeline: label filters, item costs, result
    shaping. `extract` runs on the event loop; the forward is `SpacyNerAdapter`'s."""

    def __init__(self, spec: ModelSpec, labels: Sequence[str], max_chars: int,
                 components: Sequence[str]) -> None:
        if set(spec.tasks) - set(TASKS):
            raise ModelLoadError(spec.name, f"the spacy family does only {TASKS}, the spec "
                                            f"lists {list(spec.tasks)}")
        if not labels:
            raise ModelLoadError(spec.name, "the spaCy pipeline has no entity component "
                                            f"(one of {sorted(ENTITY_FACTORIES)})")
        self.spec = spec
        self.labels: tuple[str, ...] = tuple(sorted(set(labels)))
        self.max_chars = max_chars
        self.info = ModelInfo(name=spec.name, tasks=TASKS, output_types=(),
                              labels=self.labels,
                              extra={"components": list(components),
                                     "friendly_labels": self.friendly_names()})

    # -- the request path (event loop) ----------------------------------------------

    def friendly_names(self) -> list[str]:
        """Friendly names this model can answer (their labels exist in the model)."""
        return sorted(n for n, targets in FRIENDLY_LABELS.items()
                      if set(targets) & set(self.labels))

    def resolve_labels(self, names: Sequence[str] | None) -> frozenset[str] | None:
        """Native labels for a filter of friendly or native names; None: everything."""
        if names is None:
            return None
        if not names:  # an empty filter would find nothing in every item, without a word
            raise InvalidInput("labels is empty: name at least one label, or leave labels "
                               "out for every type the model finds", "params.labels")
        native = {label.upper(): label for label in self.labels}
        wanted: set[str] = set()
        for i, name in enumerate(names):
            key = name.strip()
            if key.upper() in native:
                targets = [native[key.upper()]]
            else:
                targets = [t for t in FRIENDLY_LABELS.get(key.lower(), ()) if t in self.labels]
            if not targets:
                raise InvalidInput(
                    f"unknown label {name!r}; known labels: {', '.join(self.labels)}; "
                    f"or friendly names: {', '.join(self.friendly_names())}",
                    f"params.labels[{i}]")
            wanted.update(targets)
        return frozenset(wanted)

    def prepare(self, texts: Sequence[str]) -> list[PreparedItem]:
        items = []
        for i, text in enumerate(texts):
            if len(text) > self.max_chars:
                raise InvalidInput(f"{len(text)} characters exceeds the limit of "
                                   f"{self.max_chars}; split the text", f"items[{i}].text")
            items.append(PreparedItem(text, estimate_tokens(text), i))
        return items

    async def extract(self, submit: Submit, texts: Sequence[str],
                      options: ExtractOptions) -> TaskOutput[list[list[Entity]]]:
        if not texts:
            raise InvalidInput("at least one item is required; send 1 or more texts", "items")
        if getattr(options, "threshold", None) is not None:  # it would filter nothing
            raise InvalidInput(f"model {self.spec.name!r} takes no threshold: spaCy's NER "
                               "scores no entity (each is 1.0); leave params.threshold out",
                               "params.threshold")
        wanted = self.resolve_labels(options.labels)
        items = self.prepare(texts)
        result = await submit(items, NER_PARAMS, None)
        values: list[list[Entity]] = [
            [e for e in entities if wanted is None or e.label in wanted]
            for entities in result.values]
        return TaskOutput(values, result.queue_ms, result.inference_ms,
                          sum(item.cost for item in items))

    async def encode(self, submit: Submit, texts: Sequence[str],
                     options: EncodeOptions) -> TaskOutput[list[Encoded]]:
        raise UnsupportedTask(self.spec.name, "encode", self.info.tasks)

    async def score(self, submit: Submit, query: str, docs: Sequence[str],
                    options: ScoreOptions) -> TaskOutput[list[float]]:
        raise UnsupportedTask(self.spec.name, "score", self.info.tasks)


class SpacyNerAdapter(SpacyNerFront):
    """One spaCy pipeline: the request path, and the forward in the worker's thread."""

    fills_host_cores = False  # spaCy's pipelines run in one thread

    def __init__(self, spec: ModelSpec, nlp: Any) -> None:
        makers = [name for name, factory in nlp.pipe_factories.items()
                  if factory in ENTITY_FACTORIES and name in nlp.pipe_names]
        labels = [str(label) for name in makers for label in nlp.get_pipe(name).labels]
        super().__init__(spec, labels, int(nlp.max_length), nlp.pipe_names)
        self.nlp = nlp

    def set_lora(self, name: str | None) -> None:
        if name is not None:
            raise KeyError(f"spaCy model {self.spec.name!r} has no LoRA adapters")

    def forward(self, items: Sequence[PreparedItem], params: Hashable) -> list[list[Entity]]:
        texts = [str(item.payload) for item in items]
        docs = self.nlp.pipe(texts, batch_size=max(1, len(texts)))
        return [[Entity(e.text, e.label_, e.start_char, e.end_char, 1.0) for e in doc.ents]
                for doc in docs]

    def memory_bytes(self) -> int:
        """The weights of the loaded components plus any static vectors."""
        total = int(self.nlp.vocab.vectors.data.nbytes)
        for _, pipe in self.nlp.pipeline:
            model = getattr(pipe, "model", None)
            if model is None or not hasattr(model, "walk"):
                continue
            for node in model.walk():
                total += sum(int(node.get_param(p).nbytes)
                             for p in node.param_names if node.has_param(p))
        return total

    def close(self) -> None:
        self.nlp = None


def kept_components(pipeline_dir: Path, spec: ModelSpec) -> tuple[Mapping[str, Any], list[str]]:
    """The pipeline's config, and the components loaded: with `ner_only` (the default)
    those that make entities and what they listen to."""
    import spacy

    config = spacy.util.load_config(pipeline_dir / "config.cfg", interpolate=False)
    names = list(config["components"])
    if not spec.options.get("ner_only", True):
        return config, names
    keep = entity_components(config)
    return config, [name for name in names if name in keep]


def load(spec: ModelSpec, runtime: Runtime) -> SpacyNerAdapter:
    """Load the pipeline from its folder (an installed package's data folder or a path).
    spaCy runs on the CPU here whatever the runtime says."""
    import spacy

    pipeline_dir = find_pipeline_dir(resolve_source(spec))
    config, kept = kept_components(pipeline_dir, spec)
    exclude = [name for name in config["components"] if name not in kept]
    return SpacyNerAdapter(spec, spacy.load(pipeline_dir, exclude=exclude))


def load_front(spec: ModelSpec, runtime: Runtime) -> SpacyNerFront:
    """The request path alone, from the pipeline's config and meta.json: the entity
    labels and the text limit, without loading any weights."""
    from spacy.language import Language

    pipeline_dir = find_pipeline_dir(resolve_source(spec))
    config, kept = kept_components(pipeline_dir, spec)
    meta = read_model_file(pipeline_dir / "meta.json", spec.name)
    components: Mapping[str, Any] = config["components"]
    labels = [str(label) for name in kept
              if components[name].get("factory") in ENTITY_FACTORIES
              for label in meta.get("labels", {}).get(name, ())]
    max_length = config.get("nlp", {}).get("max_length")
    if max_length is None:  # spaCy's own default, as a loaded pipeline would have it
        max_length = inspect.signature(Language.__init__).parameters["max_length"].default
    order = [name for name in meta.get("pipeline", kept) if name in kept]
    return SpacyNerFront(spec, labels, int(max_length), order)
