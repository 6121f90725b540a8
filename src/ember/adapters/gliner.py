"""Zero-shot entities with GLiNER: any labels a request names, a score per entity.

The `gliner` package does the modelling: its word splitter, collator, span model and
decoder are the ones its own `predict_entities` runs, so Ember's spans and scores are
the package's. Ember batches: the request path splits each text into words and counts
its tokens (the words' sub-words plus the label prompt, the item's cost); the forward
collates one batch of texts that share labels and threshold (a parameter group, R6),
runs the span model once, and decodes.

A text longer than the model's `max_len` words is read whole, in overlapping windows of
`max_len` words, each an item of its own (windows of many texts batch together); the
overlap is at least the longest span the model predicts (`max_width` words), so every
span lies whole inside some window. The request path merges a text's windows as
gliner's decoder resolves spans within one text: a span two windows found once, at its
higher score, then greedy by score over the clashes its flat_ner/multi_label forbid.

Weights load from safetensors only unless the spec sets `allow_pickle` (a
`pytorch_model.bin`, which gliner reads with torch's weights-only unpickler). The
backbone's config and tokenizer, when the model folder lacks them, come from the Hub id
its `gliner_config.json` names (`model_name`), through the Hub's cache.
"""

from __future__ import annotations

import copy
import json
import tempfile
import threading
from bisect import bisect_left
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ember import hub
from ember.adapters import _torch as common
from ember.adapters._tokenize import off_loop
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
    forward_fills_cores,
)
from ember.config import ModelSpec, resolve_source
from ember.engine.errors import RequestTooLarge
from ember.engine.types import PreparedItem
from ember.errors import InvalidInput, ModelLoadError, UnsupportedTask
from ember.model_files import maps_to_code, read_model_file

TASKS: tuple[Task, ...] = ("extract",)
CONFIG_FILE = "gliner_config.json"
DEFAULT_THRESHOLD = 0.5
MAX_LABELS = 64
MAX_LABEL_CHARS = 200


@dataclass(frozen=True)
class GlinerParams:
    """One forward's labels and decoding settings: texts share a forward only with
    texts that ask the same (the labels are part of the model's input)."""

    labels: tuple[str, ...]
    threshold: float
    flat_ner: bool = True
    multi_label: bool = False


@dataclass(frozen=True)
class Words:
    """A text split into words, with each word's character offsets."""

    text: str
    words: tuple[str, ...]
    starts: tuple[int, ...]
    ends: tuple[int, ...]


@dataclass(frozen=True)
class Window:
    """Where an item's words lie: the index of their text in the request, and the
    character offset of the item's text (a window's slice) in it."""

    text: int
    offset: int


class TooManyWindows(RequestTooLarge):
    """A request whose texts, read in windows, are more items than the queue ever holds."""

    def __init__(self, texts: int, windows: int, words: int, limit: int) -> None:
        super().__init__(windows, limit)
        # The engine's message counts items; the client sent texts: say how they grew.
        self.args = (f"request too large: its {texts} texts are read in {windows} windows "
                     f"of up to {words} words (a longer text is read in overlapping "
                     f"windows, one item each), over max_queue_items={limit}; split it "
                     "into smaller requests",)


def window_overlap(max_words: int, max_width: int) -> int:
    """Words two neighbouring windows share: at least the longest span (so every span
    lies whole in one window), a quarter of a window for context, less than a window."""
    return max(0, min(max_words - 1, max(max_width, max_words // 4)))


def window_starts(count: int, size: int, stride: int) -> list[int]:
    """The first word of each window over `count` words: every `stride` words, and the
    last window ends at the text's end (a full window, not a sliver)."""
    if count <= size:
        return [0]
    starts = list(range(0, count - size, stride))
    starts.append(count - size)
    return starts


def clashes(a: Entity, b: Entity, flat_ner: bool, multi_label: bool) -> bool:
    """gliner's has_overlapping (flat) and has_overlapping_nested on character offsets:
    words never share characters, so word spans overlap exactly when these do."""
    if (a.start, a.end) == (b.start, b.end):
        return not multi_label
    apart = a.start >= b.end or b.start >= a.end
    if flat_ner:
        return not apart
    nested = (a.start <= b.start and a.end >= b.end) or (b.start <= a.start and b.end >= a.end)
    return not (apart or nested)


def merge_windows(found: Sequence[Entity], words: Words, flat_ner: bool,
                  multi_label: bool) -> list[Entity]:
    """One text's entities from all its windows, as gliner's greedy_search keeps spans
    within one text: by score, each unless it clashes with one kept; then by start."""
    best: dict[tuple[int, int, str], Entity] = {}
    for entity in found:  # a span two windows found is reported once, its higher score
        key = (entity.start, entity.end, entity.label)
        if key not in best or entity.score > best[key].score:
            best[key] = entity
    spans = list(best.values())
    # Spans are a few words long, so only a kept span starting at most `width` words
    # before this one's end can clash with it: a look at those, not at every kept span.
    first = [bisect_left(words.starts, e.start) for e in spans]
    last = [bisect_left(words.ends, e.end) for e in spans]
    width = max((b - a + 1 for a, b in zip(first, last, strict=True)), default=1)
    kept_at: dict[int, list[Entity]] = {}
    kept: list[Entity] = []
    for i in sorted(range(len(spans)), key=lambda i: -spans[i].score):  # stable, as gliner's
        entity = spans[i]
        near = (other for w in range(first[i] - width + 1, last[i] + 1)
                for other in kept_at.get(w, ()))
        if not any(clashes(entity, other, flat_ner, multi_label) for other in near):
            kept_at.setdefault(first[i], []).append(entity)
            kept.append(entity)
    return sorted(kept, key=lambda e: e.start)


class GlinerFront:
    """The request path: label checks, word splitting, token costs, result shaping."""

    def __init__(self, spec: ModelSpec, config: Any, tokenizer: Any, splitter: Any) -> None:
        if set(spec.tasks) - set(TASKS):
            raise ModelLoadError(spec.name, f"the gliner family does only {TASKS}, the spec "
                                            f"lists {list(spec.tasks)}")
        common.refuse_loras(spec, "gliner")
        self.spec = spec
        # The front's own copy: each call of a transformers wrapper re-sets its backend's
        # truncation and padding, so sharing it with the forward's collator (truncating,
        # padding) broke one in four of the collator's batches under concurrent requests.
        self.tokenizer = copy.deepcopy(tokenizer)
        self._tokenizing = threading.Lock()  # the loop's thread and the pool's call it
        self.splitter = splitter
        self.max_words = int(config.max_len)
        if self.max_words < 1:  # a window must hold a word
            raise ModelLoadError(spec.name, f"gliner_config.json's max_len is "
                                            f"{self.max_words}; it must be at least 1")
        self.overlap = window_overlap(self.max_words, int(config.max_width))
        threshold = spec.options.get("threshold", DEFAULT_THRESHOLD)
        # The YAML's fault, not a request's: refuse the load rather than blame each client.
        if (isinstance(threshold, bool) or not isinstance(threshold, int | float)
                or not 0.0 <= threshold <= 1.0):
            raise ModelLoadError(spec.name, f"options.threshold in the model's YAML must be "
                                            f"a number between 0 and 1, got {threshold!r}")
        self.threshold = float(threshold)
        self.default_labels = tuple(str(x) for x in spec.options.get("labels", ()))
        self.flat_ner = bool(spec.options.get("flat_ner", True))
        self.multi_label = bool(spec.options.get("multi_label", False))
        self.info = ModelInfo(name=spec.name, tasks=TASKS, output_types=(),
                              max_seq_length=self.max_words, labels=self.default_labels,
                              extra={"zero_shot": True, "threshold": self.threshold,
                                     "max_words": self.max_words,
                                     "window_overlap_words": self.overlap})

    def params(self, options: ExtractOptions) -> GlinerParams:
        labels = options.labels if options.labels is not None else self.default_labels
        if not labels:
            raise InvalidInput(f"model {self.spec.name!r} finds the entity types a request "
                               "names: send params.labels, e.g. [\"person\", \"drug\"]",
                               "params.labels")
        if len(labels) > MAX_LABELS:
            raise InvalidInput(f"{len(labels)} labels exceeds the limit of {MAX_LABELS}; "
                               "split the request", "params.labels")
        for i, label in enumerate(labels):
            if not label.strip():
                raise InvalidInput("a label must not be blank", f"params.labels[{i}]")
            if len(label) > MAX_LABEL_CHARS:
                raise InvalidInput(f"a label must be 1 to {MAX_LABEL_CHARS} characters, not "
                                   f"{len(label)}", f"params.labels[{i}]")
        threshold = getattr(options, "threshold", None)
        threshold = self.threshold if threshold is None else float(threshold)
        if not 0.0 <= threshold <= 1.0:
            raise InvalidInput("threshold must be between 0 and 1", "params.threshold")
        return GlinerParams(tuple(dict.fromkeys(labels)), threshold, self.flat_ner,
                            self.multi_label)

    def split(self, text: str) -> Words:
        words, starts, ends = [], [], []
        for word, start, end in self.splitter(text):
            words.append(word)
            starts.append(start)
            ends.append(end)
        return Words(text, tuple(words), tuple(starts), tuple(ends))

    def prompt_tokens(self, labels: Sequence[str]) -> int:
        """The label prompt's tokens: a marker and the label's tokens each, a separator."""
        with self._tokenizing:
            return 1 + sum(1 + len(self.tokenizer.tokenize(label)) for label in labels)

    def windows(self, words: Words) -> Iterator[tuple[int, Words]]:
        """A text's windows of at most `max_words` words, each with its character offset
        in the text: the text itself when it fits, else overlapping slices of it (each
        with its own slice of the text, so no window carries the whole text)."""
        if len(words.words) <= self.max_words:
            yield 0, words
            return
        size = self.max_words
        for first in window_starts(len(words.words), size, size - self.overlap):
            begin, end = words.starts[first], words.ends[first + size - 1]
            yield begin, Words(words.text[begin:end], words.words[first:first + size],
                               tuple(x - begin for x in words.starts[first:first + size]),
                               tuple(x - begin for x in words.ends[first:first + size]))

    def prepare_windows(self, texts: Sequence[str], params: GlinerParams
                        ) -> tuple[list[PreparedItem], list[Window], list[Words]]:
        """The items (windows numbered 0..m-1 across the request), where each lies, and
        each text's words (for the merge)."""
        prompt = self.prompt_tokens(params.labels)
        items: list[PreparedItem] = []
        places: list[Window] = []
        split = [self.split(text) for text in texts]
        for i, words in enumerate(split):
            windows = list(self.windows(words))
            counts = self.token_counts([window.words for _, window in windows])
            for (offset, window), tokens in zip(windows, counts, strict=True):
                items.append(PreparedItem(window, max(1, tokens + prompt), len(items)))
                places.append(Window(i, offset))
        return items, places, split

    def token_counts(self, rows: Sequence[Sequence[str]]) -> list[int]:
        """Each row of words' tokens with the special ones, one tokenizer call (a row of
        no words has none)."""
        full = [list(row) for row in rows if row]
        with self._tokenizing:
            ids = self.tokenizer(full, is_split_into_words=True,
                                 add_special_tokens=True)["input_ids"] if full else []
        lengths = iter(ids)
        return [len(next(lengths)) if row else 0 for row in rows]

    def prepare(self, texts: Sequence[str], params: GlinerParams) -> list[PreparedItem]:
        return self.prepare_windows(texts, params)[0]

    def too_many_windows(self, places: Sequence[Window], split: Sequence[Words],
                         limit: int) -> Exception:
        """A text the queue can never take, as a bad input naming it; else the request."""
        windows = [0] * len(split)
        for place in places:
            windows[place.text] += 1
        for i, count in enumerate(windows):
            if count > limit:
                return InvalidInput(
                    f"text of {len(split[i].words)} words is read in {count} overlapping "
                    f"windows of {self.max_words} words, more than the model's queue ever "
                    f"holds (max_queue_items={limit}); shorten it or split it into "
                    "several items", f"items[{i}].text")
        return TooManyWindows(len(split), len(places), self.max_words, limit)

    def merge(self, places: Sequence[Window], split: Sequence[Words],
              values: Sequence[list[Entity]], params: GlinerParams) -> list[list[Entity]]:
        """Each text's entities, in order: its one item's as they are, or its windows'
        shifted to offsets in the text and merged."""
        found: list[list[Entity]] = [[] for _ in split]
        windows = [0] * len(split)
        for place, entities in zip(places, values, strict=True):
            windows[place.text] += 1
            found[place.text].extend(
                Entity(e.text, e.label, e.start + place.offset, e.end + place.offset, e.score)
                for e in entities)
        return [spans if count == 1 else
                merge_windows(spans, words, params.flat_ner, params.multi_label)
                for spans, count, words in zip(found, windows, split, strict=True)]

    async def extract(self, submit: Submit, texts: Sequence[str],
                      options: ExtractOptions) -> TaskOutput[list[list[Entity]]]:
        common.require_items(len(texts))
        params = self.params(options)
        items, places, split = await off_loop(sum(map(len, texts)),
                                              lambda: self.prepare_windows(texts, params))
        try:
            result = await submit(items, params, None)
        except RequestTooLarge as refused:
            if len(items) == len(texts):  # no text was windowed: the request's own count
                raise
            raise self.too_many_windows(places, split, refused.limit) from None
        return TaskOutput(self.merge(places, split, result.values, params), result.queue_ms,
                          result.inference_ms, sum(item.cost for item in items))

    async def encode(self, submit: Submit, texts: Sequence[str],
                     options: EncodeOptions) -> TaskOutput[list[Encoded]]:
        raise UnsupportedTask(self.spec.name, "encode", self.info.tasks)

    async def score(self, submit: Submit, query: str, docs: Sequence[str],
                    options: ScoreOptions) -> TaskOutput[list[float]]:
        raise UnsupportedTask(self.spec.name, "score", self.info.tasks)


class GlinerAdapter(GlinerFront):
    """The request path and the forward, in the worker's thread, over the gliner model."""

    def __init__(self, spec: ModelSpec, model: Any, runtime: Runtime) -> None:
        processor = model.data_processor
        super().__init__(spec, model.config, processor.transformer_tokenizer,
                         processor.words_splitter)
        self.model = model
        self.device = torch.device(runtime.device)
        self.fills_host_cores = forward_fills_cores(runtime, "torch")
        self.collator = model.data_collator_class(
            model.config, data_processor=processor, return_tokens=True,
            return_entities=True, return_id_to_classes=True, prepare_labels=False)

    def set_lora(self, name: str | None) -> None:
        if name is not None:
            raise KeyError(f"GLiNER model {self.spec.name!r} has no LoRA adapters")

    def forward(self, items: Sequence[PreparedItem], params: Hashable) -> list[list[Entity]]:
        assert isinstance(params, GlinerParams)
        words = [item.payload for item in items]
        assert all(isinstance(w, Words) for w in words)
        results: list[list[Entity]] = [[] for _ in words]
        present = [i for i, w in enumerate(words) if w.words]  # a text of no words has none
        if not present:
            return results
        batch = self.collator([{"tokenized_text": list(words[i].words), "ner": None}
                               for i in present], entity_types=list(params.labels))
        batch = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                 for k, v in batch.items()}
        with torch.inference_mode():
            logits = self.model.model(**batch, threshold=params.threshold)[0]
        decoded = self.model.decoder.decode(batch["tokens"], batch["id_to_classes"], logits,
                                            flat_ner=params.flat_ner,
                                            threshold=params.threshold,
                                            multi_label=params.multi_label)
        for i, spans in zip(present, decoded, strict=True):
            text = words[i]
            results[i] = [Entity(text.text[text.starts[s]:text.ends[e]], str(label),
                                 text.starts[s], text.ends[e], float(score))
                          for s, e, label, score in spans]
        return results

    def memory_bytes(self) -> int:
        return common.module_bytes(self.model)

    def close(self) -> None:
        self.model = None
        common.release(self.device)


def check_weights(spec: ModelSpec, folder: Path) -> None:
    if (folder / "model.safetensors").is_file():
        return
    if (folder / "pytorch_model.bin").is_file():
        if spec.allow_pickle:
            return
        raise ModelLoadError(spec.name, "the model's weights are a pickle (pytorch_model.bin); "
                                        "Ember loads safetensors unless the model's YAML says "
                                        "allow_pickle: true")
    raise ModelLoadError(spec.name, f"{folder} holds no GLiNER weights (model.safetensors)")


# Other models a GLiNER config may name, which gliner loads itself, from the Hub, with
# trust_remote_code on: a bi-encoder's labels encoder, a decoder of labels.
OTHER_MODELS = ("labels_encoder", "labels_decoder")


def checked_config(spec: ModelSpec, folder: Path) -> dict[str, Any]:
    """gliner_config.json, its backbone named by its local folder when it has one, so
    nothing loads from the network; once nothing gliner would load runs code.

    gliner builds its models with trust_remote_code on, whatever the YAML says: a class
    mapped to code in the model's or its backbone's files would run, and so would one in
    any other model its config names. Only a YAML that trusts remote code may load such a
    GLiNER (found by two reviews: a Hub GLiNER ran code each of these ways)."""
    backbone = hub.backbone_folder(folder)
    fields: dict[str, Any] = read_model_file(folder / CONFIG_FILE, spec.name)
    if not spec.trust_remote_code:
        for checked in (folder, *([backbone] if backbone is not None else [])):
            if (found := maps_to_code(checked)) is not None:
                raise ModelLoadError(spec.name, f"{checked.name}/{found}; Ember runs a "
                                                "repository's own code only for a model "
                                                "whose YAML says trust_remote_code: true")
        if named := {key: fields[key] for key in OTHER_MODELS if fields.get(key)}:
            listed = ", ".join(f"{key}: {value}" for key, value in named.items())
            raise ModelLoadError(spec.name, f"its {CONFIG_FILE} names other models ({listed}), "
                                            "which gliner would fetch and load itself, code "
                                            "and all; Ember serves such a GLiNER only where "
                                            "its YAML says trust_remote_code: true")
    if backbone is not None:
        fields["model_name"] = str(backbone)
    return fields


def _load(spec: ModelSpec, runtime: Runtime) -> Any:
    from gliner import GLiNER

    folder = resolve_source(spec)
    if not (folder / CONFIG_FILE).is_file():
        raise ModelLoadError(spec.name, f"{folder} is not a GLiNER model (no {CONFIG_FILE})")
    check_weights(spec, folder)
    fields = checked_config(spec, folder)
    common.apply_runtime(runtime)
    with tempfile.TemporaryDirectory(prefix="ember-gliner-") as staged:
        # gliner reads the backbone's name from the config: a folder that names its
        # local copy, beside links to the model's own files.
        for path in folder.iterdir():
            if path.name != CONFIG_FILE:
                (Path(staged) / path.name).symlink_to(path.resolve())
        (Path(staged) / CONFIG_FILE).write_text(json.dumps(fields), encoding="utf-8")
        model = GLiNER.from_pretrained(staged, local_files_only=True,
                                       map_location=runtime.device)
    add_markers(spec, model.data_processor.transformer_tokenizer, model.config,
                model._get_special_tokens())
    if runtime.half:
        model.model.half()
    model.eval()
    return model


def add_markers(spec: ModelSpec, tokenizer: Any, config: Any, markers: Sequence[str]) -> None:
    """GLiNER's prompt markers in a backbone's tokenizer (a folder without a tokenizer of
    its own has none), at the ids the model was trained with."""
    if config.ent_token not in tokenizer.get_vocab():
        tokenizer.add_tokens(list(markers), special_tokens=True)
    found = tokenizer.convert_tokens_to_ids(config.ent_token)
    if config.class_token_index not in (-1, found):
        raise ModelLoadError(spec.name, f"the tokenizer puts {config.ent_token} at {found}, "
                                        f"the model was trained with "
                                        f"{config.class_token_index}")


def load(spec: ModelSpec, runtime: Runtime) -> GlinerAdapter:
    """Load a GLiNER folder (a Hub snapshot or a local directory) with the gliner package."""
    return GlinerAdapter(spec, _load(spec, runtime), runtime)


def load_front(spec: ModelSpec, runtime: Runtime) -> GlinerFront:
    """The request path alone: the word splitter and the tokenizer, no weights."""
    from gliner import GLiNERConfig
    from gliner.data_processing.tokenizer import WordsSplitter
    from transformers import AutoTokenizer

    folder = resolve_source(spec)
    fields = checked_config(spec, folder)
    fields.pop("model_type", None)
    config = GLiNERConfig(**fields)
    own = (folder / "tokenizer_config.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(str(folder if own else config.model_name),
                                              local_files_only=True)
    # The span models' markers, in gliner's order (its _get_special_tokens).
    add_markers(spec, tokenizer, config, ["[FLERT]", config.ent_token, config.sep_token])
    return GlinerFront(spec, config, tokenizer, WordsSplitter(config.words_splitter_type))
