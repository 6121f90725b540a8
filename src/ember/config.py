"""Model catalog: one YAML file per model, shipped in the package or dropped in a folder."""

from __future__ import annotations

import importlib.util
import ipaddress
import logging
import math
import re
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, cast
from urllib.parse import urlsplit

import yaml

from ember.engine.config import SettingError, WorkerConfig
from ember.errors import closest, described, json_kind
from ember.hub import HubRef, Wanted, parse_hub_id
from ember.model_files import ModelFileError, maps_to_code, read_model_json

log = logging.getLogger("ember.config")
BUILTIN_CATALOG = Path(__file__).parent / "catalog"
# Adapter family named in a model YAML -> its module under ember.adapters.
ADAPTERS = {"transformer": "transformer", "cross_encoder": "cross_encoder",
            "gliner": "gliner", "clip": "clip", "spacy": "spacy_ner", "sparse": "sparse",
            "multivector": "multivector", "m3": "m3", "synthetic": "synthetic"}
# What each family's encode returns (before it is loaded; after, its ModelInfo says).
FAMILY_OUTPUTS: dict[str, tuple[str, ...]] = {
    "transformer": ("dense",), "sparse": ("sparse",), "multivector": ("multivector",),
    "m3": ("dense", "sparse", "multivector"),
    "clip": ("dense",), "gliner": (), "synthetic": ("dense",), "cross_encoder": (),
    "spacy": ()}
# The tasks each family can serve: a YAML's `tasks` may name no other.
FAMILY_TASKS: dict[str, tuple[str, ...]] = {
    "transformer": ("encode", "score"), "cross_encoder": ("score",), "gliner": ("extract",),
    "clip": ("encode", "score"), "spacy": ("extract",), "sparse": ("encode", "score"),
    "multivector": ("encode", "score"), "m3": ("encode", "score"),
    "synthetic": ("encode", "score")}
# `prompts` a model takes: the query's, then the document's by any of its names (in
# sentence-transformers' order).
PROMPT_NAMES = ("query", "document", "passage", "corpus")
MAX_CATALOG_FILE_BYTES = 1 << 20  # a model's YAML is a few hundred bytes
# The `options` each family reads; another would be ignored, so a misspelt one is refused.
# `dims` is what `ember models` shows before a load; `embeddings_side: query` puts
# /v1/embeddings on the query side.
_ENCODING = ("dims", "embeddings_side")
FAMILY_OPTIONS: dict[str, tuple[str, ...]] = {
    "transformer": _ENCODING, "clip": _ENCODING, "m3": ("score_weights", *_ENCODING),
    "sparse": ("top_k", "threshold", *_ENCODING),
    "multivector": ("projection", "projection_key", *_ENCODING),
    "cross_encoder": ("activation",), "gliner": ("threshold", "labels", "flat_ner",
                                                 "multi_label"),
    "spacy": ("ner_only",),
    "synthetic": ("overhead_ms", "per_token_us", "mode", "load_ms", "fault_marker",
                  "test_crash_marker", *_ENCODING)}
# What each option's value must be, checked at the start (a quoted "false" read by
# bool() is True; a string of labels iterates by letter): None when the value is right,
# else what is wrong with it.
OptionCheck = Callable[[object], str | None]


def _whole_at_least_1(value: object) -> str | None:
    return None if type(value) is int and value >= 1 else "must be a whole number >= 1"


def _number_in(low: float, high: float = math.inf) -> OptionCheck:
    def check(value: object) -> str | None:
        fits = (type(value) in (int, float) and _finite(value)  # type: ignore[arg-type]
                and low <= value <= high)  # type: ignore[operator]
        return None if fits else (f"must be a number from {low:g} to {high:g}"
                                  if high < math.inf else f"must be a number >= {low:g}")
    return check


def _true_or_false(value: object) -> str | None:
    return None if isinstance(value, bool) else "must be true or false"


def _text(value: object) -> str | None:
    return None if isinstance(value, str) and value.strip() else "must be a non-empty text"


def _one_of(*choices: str, any_case: bool = False) -> OptionCheck:
    def check(value: object) -> str | None:
        read = value.lower() if any_case and isinstance(value, str) else value
        return None if read in choices else f"must be one of {', '.join(choices)}"
    return check


def _texts(value: object) -> str | None:
    return None if isinstance(value, list) and all(
        isinstance(v, str) and v.strip() for v in value) else "must be a list of texts"


CROSS_ENCODER_ACTIVATIONS: tuple[Literal["sigmoid", "none"], ...] = ("sigmoid", "none")
OPTION_CHECKS: dict[str, dict[str, OptionCheck]] = {
    family: {"dims": _whole_at_least_1, "embeddings_side": _one_of(*PROMPT_NAMES),
             "top_k": _whole_at_least_1, "threshold": _number_in(0.0),
             "projection": _text, "projection_key": _text,
             "activation": _one_of(*CROSS_ENCODER_ACTIVATIONS, any_case=True),
             "labels": _texts, "flat_ner": _true_or_false, "multi_label": _true_or_false,
             "ner_only": _true_or_false, "overhead_ms": _number_in(0.0),
             "per_token_us": _number_in(0.0), "load_ms": _number_in(0.0),
             "mode": _one_of("sleep", "compute"), "fault_marker": _text,
             "test_crash_marker": _text}
    for family in FAMILY_OPTIONS}
OPTION_CHECKS["gliner"]["threshold"] = _number_in(0.0, 1.0)  # a probability


# An M3 model's two heads beside its encoder (FlagEmbedding's file names, less the suffix).
M3_HEADS = ("sparse_linear", "colbert_linear")
M3_WEIGHTS_EXAMPLE = "{dense: 0.4, sparse: 0.2, multivector: 0.4}"
# Families the ONNX backend runs (a Hub download then includes onnx/model.onnx).
ONNX_FAMILIES = frozenset({"transformer", "cross_encoder", "sparse", "multivector", "m3"})
TASKS = ("encode", "score", "extract")
DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
Backend = Literal["torch", "onnx"]
BACKENDS: tuple[Backend, ...] = ("torch", "onnx")
QUANTIZE = ("int8",)  # dynamic quantization, onnx backend only
# The transformer family's poolings; here, not in the adapter, so the catalog checks a
# YAML's `pooling` at start without importing torch.
POOLING_MODES = ("mean", "cls", "max", "lasttoken")
# Every top-level field a model YAML may hold; any other is refused, since a misspelt one
# (`normalise:`) would otherwise be ignored and silently change what the model serves.
SPEC_FIELDS = ("name", "description", "adapter", "source", "tasks", "max_seq_length",
               "pooling", "normalize", "prompts", "loras", "batching", "options",
               "backend", "quantize", "trust_remote_code", "allow_pickle")
SOURCE_FIELDS = ("package", "subdir", "path", "hub", "revision")
WEIGHTS_FROM = ("package", "path", "hub")  # a source names exactly one of these
# When ONNX Runtime's threads spin-wait: never, within a forward only, or also between
# forwards (ONNX Runtime's own default).
Spinning = Literal["off", "forward", "on"]
SPINNING: tuple[Spinning, ...] = ("off", "forward", "on")


def spinning_mode(value: str | bool) -> Spinning:
    """A spinning mode from a flag or a variable; yes/no words read as on/off."""
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return "on"
    if text in ("0", "false", "no", "off"):
        return "off"
    if text == "forward":
        return "forward"
    raise ValueError(f"--onnx-spinning (or EMBER_ONNX_SPINNING) {value!r} is not one of "
                     f"{list(SPINNING)}")


class CatalogError(ValueError):
    """A model YAML file is invalid; the message names the file and the field."""


def m3_score_weights(named: object) -> dict[str, float]:
    """An M3 model's score weights by output type, those above 0, scaled to sum to 1 (so a
    huge or tiny weight cannot overflow or vanish in the mean); ValueError says why not."""
    outputs = FAMILY_OUTPUTS["m3"]
    wrong = (f"must map output types ({', '.join(outputs)}) to finite weights >= 0, at "
             f"least one above 0, e.g. {M3_WEIGHTS_EXAMPLE}; got {named!r}")
    if not isinstance(named, Mapping) or not named or set(named) - set(outputs):
        raise ValueError(wrong)
    for weight in named.values():
        if isinstance(weight, str) and re.fullmatch(r"[-+]?[\d.]+e[-+]?\d+", weight.strip(),
                                                     re.IGNORECASE):
            # YAML 1.1 reads a number in e-notation as text unless it has both.
            raise ValueError(f"{wrong} ({weight!r} was read as text: write it as 0.1, or "
                             "with a dot and a signed exponent, as 1.0e-1 or 1.0e+5)")
        if isinstance(weight, bool) or not isinstance(weight, int | float) \
                or not weight >= 0 or not _finite(weight):
            raise ValueError(wrong)
    largest = max(float(w) for w in named.values())
    if not largest > 0:
        raise ValueError(wrong)
    scaled = {kind: float(named[kind]) / largest for kind in outputs if named.get(kind, 0) > 0}
    total = sum(scaled.values())
    return {kind: weight / total for kind, weight in scaled.items() if weight / total > 0}


def _finite(number: float) -> bool:
    try:
        return math.isfinite(float(number))
    except OverflowError:  # an int past float's range
        return False


def _model_json(path: Path) -> dict[str, Any]:
    """`read_model_json` for the catalog: a bad file is a CatalogError."""
    try:
        data: dict[str, Any] = read_model_json(path)
    except ModelFileError as exc:
        raise CatalogError(f"{path.parent}: {exc}") from None
    return data


@dataclass(frozen=True)
class Source:
    """Where weights come from: an installed package, a local path, or a Hugging Face
    Hub id (`hub`, at `revision`: a commit sha, a branch or a tag), read from the Hub's
    cache or downloaded into it (ember.hub)."""

    package: str | None = None
    subdir: str | None = None
    path: Path | None = None
    hub: str | None = None
    revision: str | None = None


@dataclass(frozen=True)
class ModelSpec:
    name: str
    adapter: str
    source: Source
    tasks: tuple[str, ...]
    max_seq_length: int | None = None
    pooling: str | None = None  # mean | cls | max | lasttoken; None: the directory's own
    normalize: bool | None = None
    loras: Mapping[str, Path] = field(default_factory=dict)
    batching: Mapping[str, Any] = field(default_factory=dict)
    trust_remote_code: bool = False
    allow_pickle: bool = False  # safetensors only unless a config says otherwise
    options: Mapping[str, Any] = field(default_factory=dict)  # family-specific settings
    prompts: Mapping[str, str] = field(default_factory=dict)  # query/document prefixes
    description: str = ""
    origin: Path | None = None  # the YAML file it came from
    backend: Backend | None = None  # None: the server's --backend
    quantize: str | None = None  # int8: dynamic quantization (onnx backend)

    def worker_config(self, base: WorkerConfig) -> WorkerConfig:
        """The server-wide batching settings with this model's overrides applied."""
        return replace(base, **self.batching) if self.batching else base


def _require(data: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in data:
        raise CatalogError(f"{where}: missing required field {key!r}")
    value = data[key]
    if not isinstance(value, kind):
        raise CatalogError(f"{where}: field {key!r} must be a {kind.__name__}")
    return value


# Batching settings older model files may carry: they still load (with a warning), but the
# engine no longer has them (a hold ends when its senders are back; R5 sweeps).
UNREAD_BATCHING = frozenset({"coalesce_ms", "starvation_ms"})


def parse_spec(data: Mapping[str, Any], where: str, base_dir: Path | None = None) -> ModelSpec:
    """Build a ModelSpec from a YAML mapping; relative paths are taken from `base_dir`."""
    if not isinstance(data, Mapping):
        raise CatalogError(f"{where}: expected a mapping at the top level")
    _refuse_unknown(data, SPEC_FIELDS, where)
    name = _require(data, "name", str, where)
    # A request names it in a path or a field, and logs and metrics carry it.
    if not name or name != name.strip() or not name.isprintable():
        raise CatalogError(f"{where}: name {described(name)} must be printable text without "
                           "spaces at its ends")
    adapter = _require(data, "adapter", str, where)
    if adapter not in ADAPTERS:
        raise CatalogError(f"{where}: adapter {adapter!r} is unknown; use one of "
                           f"{', '.join(ADAPTERS)}")
    tasks = tuple(_require(data, "tasks", list, where))
    unknown = [t for t in tasks if t not in TASKS]
    if not tasks or unknown:
        raise CatalogError(f"{where}: tasks must be a non-empty list of {TASKS}, got {tasks}")
    if beyond := [t for t in tasks if t not in FAMILY_TASKS[adapter]]:
        raise CatalogError(f"{where}: the {adapter} family cannot {', '.join(beyond)}; its "
                           f"tasks are {', '.join(FAMILY_TASKS[adapter])}")
    description = data.get("description", "")
    if not isinstance(description, str):  # str() of a nested alias bomb took gigabytes
        raise CatalogError(f"{where}: description must be text, got {json_kind(description)}")
    source = _parse_source(data, adapter, where, base_dir)
    loras = data.get("loras") or {}
    if not isinstance(loras, Mapping):
        raise CatalogError(f"{where}: 'loras' must map adapter names to directories")
    batching = _parse_batching(data, where)
    backend = _choice(data, "backend", BACKENDS, where)
    quantize = _choice(data, "quantize", QUANTIZE, where, " (or leave it out for float32)")
    if backend == "torch" and quantize:
        raise CatalogError(f"{where}: quantize applies to the onnx backend; remove it or set "
                           "backend: onnx")
    if loras and (backend == "onnx" or quantize):
        raise CatalogError(f"{where}: loras need backend: torch (the onnx backend, which "
                           "quantize implies, runs the base model only)")
    max_seq_length = data.get("max_seq_length")
    if max_seq_length is not None and not _positive_int(max_seq_length):
        raise CatalogError(f"{where}: max_seq_length must be a positive integer (tokens), "
                           f"got {max_seq_length!r}")
    pooling = _choice(data, "pooling", POOLING_MODES, where,
                      " (or leave it out for the folder's own)")
    _check_switches_and_tables(data, adapter, where)
    return ModelSpec(
        name=name,
        adapter=adapter,
        source=source,
        tasks=tasks,
        max_seq_length=max_seq_length,
        pooling=pooling,
        normalize=data.get("normalize"),
        loras={str(k): _local(v, base_dir) for k, v in loras.items()},
        batching=batching,
        trust_remote_code=bool(data.get("trust_remote_code", False)),
        allow_pickle=bool(data.get("allow_pickle", False)),
        options=dict(data.get("options") or {}),
        prompts=dict(data.get("prompts") or {}),
        description=description,
        origin=base_dir,
        backend=cast(Backend | None, backend),
        quantize=quantize,
    )


def _local(value: object, base_dir: Path | None) -> Path:
    """A path the YAML gives, relative ones taken from the YAML's folder."""
    path = Path(str(value)).expanduser()
    return path if path.is_absolute() or base_dir is None else (base_dir / path)


def _parse_source(data: Mapping[str, Any], adapter: str, where: str,
                  base_dir: Path | None) -> Source:
    """`source:`, exactly one of package, path or hub (none for the synthetic family)."""
    raw_source = data.get("source") or {}
    if not isinstance(raw_source, Mapping):
        raise CatalogError(f"{where}: 'source' must be a mapping (package, path or hub)")
    _refuse_unknown(raw_source, SOURCE_FIELDS, where, "source.")
    named = [key for key in WEIGHTS_FROM if raw_source.get(key)]
    if adapter != "synthetic" and not named:
        raise CatalogError(f"{where}: 'source' needs one of package, path or hub")
    if len(named) > 1:  # which one would win is not what the file says: refuse
        raise CatalogError(f"{where}: 'source' names {' and '.join(named)}; give exactly "
                           "one of package, path or hub")
    for key in SOURCE_FIELDS:  # a revision written 1.0 is a number to YAML
        if raw_source.get(key) is not None and not isinstance(raw_source[key], str):
            raise CatalogError(f"{where}: source.{key} must be text, got "
                               f"{raw_source[key]!r}; quote it")
    for key, needs in (("subdir", "package"), ("revision", "hub")):
        if raw_source.get(key) is not None and not raw_source.get(needs):
            raise CatalogError(f"{where}: source.{key} applies to source.{needs} only")
    return Source(
        package=raw_source.get("package"),
        subdir=raw_source.get("subdir"),
        path=_local(raw_source["path"], base_dir) if raw_source.get("path") else None,
        hub=raw_source.get("hub"),
        revision=raw_source.get("revision"),
    )


def _parse_batching(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`batching:`, the WorkerConfig settings a model overrides (settings the engine no
    longer reads are accepted and dropped; `say_unread_batching` warns of them)."""
    batching = data.get("batching") or {}
    # forward_fills_cores is the registry's to set, from the model it loaded.
    allowed = set(WorkerConfig.__dataclass_fields__) - {"forward_fills_cores"}
    if not isinstance(batching, Mapping):
        raise CatalogError(f"{where}: 'batching' must map settings to values")
    unknown = sorted(map(str, set(batching) - allowed - UNREAD_BATCHING))
    if unknown:
        raise CatalogError(f"{where}: batching.{', batching.'.join(unknown)} is not a setting; "
                           f"'batching' accepts only {sorted(allowed)}")
    kept = {key: value for key, value in batching.items() if key in allowed}
    _check_batching(kept, where)
    return kept


def _check_switches_and_tables(data: Mapping[str, Any], adapter: str, where: str) -> None:
    """The safety switches are booleans; options and prompts are mappings, the options
    the family's own."""
    for flag in ("normalize", "trust_remote_code", "allow_pickle"):
        # bool("false") is True: a quoted word must not turn a safety switch on.
        if data.get(flag) is not None and (problem := _true_or_false(data[flag])):
            raise CatalogError(f"{where}: {flag} {problem}, got {described(data[flag])}")
    for table in ("options", "prompts"):
        if not isinstance(data.get(table) or {}, Mapping):
            raise CatalogError(f"{where}: {table!r} must be a mapping")
    prompts = data.get("prompts") or {}
    _refuse_unknown(prompts, PROMPT_NAMES, where, "prompts.")
    for table, values in (("prompts", prompts), ("loras", data.get("loras") or {})):
        for key, value in values.items():
            if not isinstance(value, str):
                raise CatalogError(f"{where}: {table}.{key} must be text, got "
                                   f"{json_kind(value)}")
    _refuse_unknown(data.get("options") or {}, FAMILY_OPTIONS[adapter], where, "options.")
    for name, value in (data.get("options") or {}).items():
        check = OPTION_CHECKS[adapter].get(name)
        # None: the family's default (no pruning for top_k, the model's own dims).
        if check is not None and value is not None and (problem := check(value)) is not None:
            raise CatalogError(f"{where}: options.{name} {problem}, got {described(value)}")
    if adapter == "m3" and "score_weights" in (data.get("options") or {}):
        try:
            m3_score_weights(data["options"]["score_weights"])
        except ValueError as exc:
            raise CatalogError(f"{where}: options.score_weights {exc}") from None


def yaml_failure(exc: yaml.YAMLError) -> str:
    """The reader's complaint in one line, with its place (its own text quotes the file)."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem:
        mark = exc.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        return f"{exc.problem}{where}"
    return " ".join(str(exc).split())


class ModelYamlLoader(yaml.SafeLoader):
    """YAML's safe subset without aliases (`*name`): a kilobyte of nested aliases expands
    into gigabytes wherever the value is copied or printed."""

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, "an alias (*name): write the value out, a model's YAML takes none",
                self.peek_event().start_mark)  # type: ignore[no-untyped-call]
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode,
                          deep: bool = False) -> dict[Any, Any]:
        # YAML takes a repeated key's last value without a word: `name` twice is a mistake.
        seen: set[tuple[str, str]] = set()
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode) and key.value != "<<":
                if (key.tag, key.value) in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {key.value!r} appears twice", key.start_mark)
                seen.add((key.tag, key.value))
        return super().construct_mapping(node, deep)


def load_spec_file(path: Path, check_paths: bool = False) -> ModelSpec:
    """One YAML file's entry; with `check_paths` (the server's start), a `source.path`
    that does not exist, or a LoRA folder without its adapter, is refused too, and unread
    batching settings are named in a warning. Not in every
    process that reads the catalog: a folder gone since the start fails its model's load
    (502), not a new engine's start."""
    try:
        if not path.is_file():  # a FIFO would hang the start, /dev/zero fill the memory
            raise CatalogError(f"{path}: not a regular file")
        with path.open("rb") as file:  # its size as read: a device or /proc file says 0
            raw = file.read(MAX_CATALOG_FILE_BYTES + 1)
        if len(raw) > MAX_CATALOG_FILE_BYTES:
            raise CatalogError(f"{path}: over the {MAX_CATALOG_FILE_BYTES:,} bytes a model's "
                               "YAML may have")
        data = yaml.load(raw.decode("utf-8"), Loader=ModelYamlLoader)  # a SafeLoader
    except yaml.YAMLError as exc:
        raise CatalogError(f"{path}: not valid YAML ({yaml_failure(exc)})") from None
    except RecursionError:
        raise CatalogError(f"{path}: not valid YAML (nested too deeply)") from None
    except UnicodeDecodeError:
        raise CatalogError(f"{path}: not UTF-8 text; save it as UTF-8") from None
    except CatalogError:
        raise
    except ValueError as exc:  # an integer of over 4,300 digits (Python's guard)
        raise CatalogError(f"{path}: not valid YAML ({exc})") from None
    except OSError as exc:  # a broken link, a folder named *.yaml, no permission
        raise CatalogError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    spec = parse_spec(data, str(path), path.parent)
    if check_paths:
        say_unread_batching(data, str(path))
    if check_paths and spec.source.path is not None and not spec.source.path.exists():
        raise CatalogError(f"{path}: source.path {spec.source.path} does not exist")
    for lora, folder in spec.loras.items() if check_paths else ():
        if not (folder / "adapter_config.json").is_file():
            raise CatalogError(f"{path}: loras.{lora} {folder} is not a PEFT adapter folder "
                               "(no adapter_config.json)")
    return spec


def say_unread_batching(data: Mapping[str, Any], where: str) -> None:
    """Warn of the batching settings the engine no longer reads. Only with the start's
    check: every later read of the catalog (the start's own, each process's) said it again."""
    for unread in sorted(set(data.get("batching") or {}) & UNREAD_BATCHING):
        log.warning("%s: batching.%s is accepted but no longer used by the engine; "
                    "remove it (docs/architecture.md, settings)", where, unread)


def _refuse_unknown(data: Mapping[Any, Any], accepted: tuple[str, ...], where: str,
                    prefix: str = "") -> None:
    """A field the parser would not read is an error, with the closest accepted name."""
    unknown = [str(key) for key in data if key not in accepted]
    if not unknown:
        return
    named = []
    for key in unknown:
        close = closest(key, accepted)
        hint = f" (did you mean {prefix}{close}?)" if close else ""
        named.append(f"{prefix}{key}{hint}")
    raise CatalogError(f"{where}: unknown field{'s' if len(named) > 1 else ''} "
                       f"{', '.join(named)}; {prefix.rstrip('.') or 'a model YAML'} accepts "
                       f"{', '.join(accepted)}")


def _choice(data: Mapping[str, Any], key: str, allowed: tuple[str, ...], where: str,
            otherwise: str = "") -> Any:
    """The field's value, None or one of `allowed`."""
    value = data.get(key)
    if value is not None and value not in allowed:
        raise CatalogError(f"{where}: {key} {value!r} is unknown; use one of "
                           f"{', '.join(allowed)}{otherwise}")
    return value


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# WorkerConfig's field types, to check a YAML's batching values before the engine uses them.
_BATCHING_TYPES = typing.get_type_hints(WorkerConfig)


def _check_batching(batching: Mapping[str, Any], where: str) -> None:
    """Each override through WorkerConfig's own checks, so a bad value stops the start
    as the same flag does, instead of failing every request once the model loads."""
    for key, value in batching.items():
        wanted = _BATCHING_TYPES[key]
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        wants_number = wanted is float or float in typing.get_args(wanted)  # float | None
        wants_int = wanted is int or int in typing.get_args(wanted)  # int | None
        unset = value is None and wanted is not int  # None: learned (dispatch auto)
        if wants_int and not unset and not (numeric and isinstance(value, int)):
            problem = f"must be an integer, got {value!r}"
        elif wanted is bool and not isinstance(value, bool):
            problem = f"must be true or false, got {value!r}"
        elif wants_number and value is not None and not numeric:
            problem = f"must be a number, got {value!r}"
        else:
            try:
                WorkerConfig(**{key: value})
                continue
            except SettingError as exc:
                problem = exc.problem
            except TypeError as exc:
                problem = str(exc)
        raise CatalogError(f"{where}: batching.{key} {problem}")
    try:
        WorkerConfig(**batching)  # the values together, should a check span fields
    except (TypeError, ValueError) as exc:
        raise CatalogError(f"{where}: batching: {exc}") from None


def load_catalog(extra_dirs: Iterable[Path] = (), model_paths: Iterable[Path | str] = (),
                 check_paths: bool = False) -> dict[str, ModelSpec]:
    """The built-in catalog, then each extra folder's *.yaml, then each model named
    directly: a local directory, or a Hub id `org/name[@revision]` (a later entry of the
    same name replaces an earlier one, so a user can override a default). A Hub id the
    catalog has keeps its curated settings; another is read from its files, which this
    downloads when they are not in the cache."""
    catalog: dict[str, ModelSpec] = {}
    read_from: dict[str, Path] = {}
    for folder in (BUILTIN_CATALOG, *(Path(d).expanduser() for d in extra_dirs)):
        if not folder.is_dir():
            raise CatalogError(f"model directory {folder} "
                               f"{'is a file' if folder.exists() else 'does not exist'}")
        from_here: dict[str, Path] = {}  # a later folder may replace a model; one folder not
        paths = sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")])
        for path in paths:
            spec = load_spec_file(path, check_paths)
            if (first := from_here.setdefault(spec.name, path)) != path:
                raise CatalogError(f"{first} and {path} both name the model {spec.name!r}; "
                                   "keep one")
            if check_paths and spec.name in read_from:  # said once, at the start's read
                log.info("%s replaces the model %s of %s", path, spec.name,
                         read_from[spec.name])
            catalog[spec.name], read_from[spec.name] = spec, path
        if check_paths and folder != BUILTIN_CATALOG:
            say_what_was_read(folder, paths)
    model_paths = list(model_paths)
    named_by: dict[str, Path | str] = {}  # a catalog name -> the --model that gave it
    for named in model_paths:  # the Hub ids first, before anything downloads
        ref = None if Path(named).expanduser().is_dir() else hub_id(named)
        if ref is not None:
            _named_once(ref.repo, named, named_by)
    for named in model_paths:
        spec = spec_for_model(named, catalog)
        _named_once(spec.name, named, named_by)
        catalog[spec.name] = spec
    return catalog


def say_what_was_read(folder: Path, paths: list[Path]) -> None:
    """A line for a --model-dir's files, and a warning for a file it skips by its name's
    case (`*.YAML`: the names are matched exactly)."""
    log.info("model directory %s: %d model file%s", folder, len(paths),
             "" if len(paths) == 1 else "s")
    for skipped in sorted(set(folder.glob("*.[yY][aA][mM][lL]"))
                          | set(folder.glob("*.[yY][mM][lL]"))):
        if skipped not in paths:
            log.warning("%s is not read: model files end in .yaml or .yml", skipped)


def _named_once(name: str, named: Path | str, named_by: dict[str, Path | str]) -> None:
    """Two models named for one catalog name (one repository at two revisions, two
    folders of one name): which one would serve is not what the flags say; refuse."""
    first = named_by.setdefault(name, named)
    if first != named and ((folder := _folder(first)) is None or folder != _folder(named)):
        hint = " (a folder is served as local/<its name>)" if name.startswith(LOCAL_PREFIX) else ""
        raise CatalogError(f"{first} and {named} both name the model {name!r}{hint}; keep one")


def _folder(named: Path | str) -> Path | None:
    path = Path(named).expanduser()
    return path.resolve() if path.is_dir() else None


def spec_for_model(named: Path | str, catalog: Mapping[str, ModelSpec]) -> ModelSpec:
    """What `--model` names: an existing directory, else a Hub id."""
    path = Path(named).expanduser()
    if path.is_dir():
        return spec_from_directory(path)
    ref = hub_id(named)
    if ref is None:
        raise CatalogError(f"model directory {path.resolve()} does not exist, and "
                           f"{str(named)!r} is not a Hub id (org/name[@revision])")
    try:
        return spec_from_hub(ref, base=catalog.get(ref.repo))
    except FileNotFoundError as exc:  # HubError: one line that says what to do
        raise CatalogError(str(exc)) from None


LOCAL_PREFIX = "local/"  # the catalog names of model folders given without a YAML


def local_name(path: Path | str) -> str:
    """The catalog name of a model directory named without a YAML file."""
    return f"{LOCAL_PREFIX}{Path(path).expanduser().resolve().name}"


def hub_id(named: Path | str) -> HubRef | None:
    """`org/name[@revision]` as a Hub id, unless it is one of the catalog's `local/` names."""
    return None if str(named).startswith(LOCAL_PREFIX) else parse_hub_id(str(named))


def with_hub_models(settings: ServerSettings,
                    known: Mapping[str, ModelSpec]) -> ServerSettings:
    """--default-model and --preload as a user means them: a folder given there is served
    as if named by --model, under its catalog name (`local/<folder>`); a Hub id no YAML
    describes is served as if named by --model; and a `local/` name is never a Hub id. So
    every process of the server finds each in its catalog."""
    given = {Path(p).expanduser().resolve() for p in settings.model_paths
             if Path(p).expanduser().is_dir()}
    named = {str(p) for p in settings.model_paths}

    def folder(name: str) -> Path | None:
        path = Path(name).expanduser()
        return path if name not in known and path.is_dir() else None

    def to_serve(name: str) -> Path | None:
        """What --model would be given for `name`, where no --model or YAML gives it."""
        if (path := folder(name)) is not None:
            return None if path.resolve() in given else path
        if name in known or name in named or hub_id(name) is None:
            return None
        return Path(name)

    extra = [path for name in dict.fromkeys((settings.default_model, *settings.preload))
             if (path := to_serve(name)) is not None]

    def catalog_name(name: str) -> str:
        return local_name(name) if folder(name) is not None else name

    return replace(settings, default_model=catalog_name(settings.default_model),
                   preload=tuple(catalog_name(name) for name in settings.preload),
                   model_paths=(*settings.model_paths, *extra))


def spec_from_directory(path: Path) -> ModelSpec:
    """A catalog entry for a model directory named without a YAML file: `local/<name>`,
    its family read from the files it holds."""
    path = path.expanduser().resolve()
    if not path.is_dir():
        raise CatalogError(f"model directory {path} does not exist")
    family, tasks = _detect_family(path)
    return ModelSpec(name=local_name(path), adapter=family, source=Source(path=path),
                     tasks=tasks, description=f"{family} model from {path.name}/",
                     origin=path, **_pickled_m3_dense(path, family))


def _pickled_m3_dense(path: Path, family: str) -> dict[str, Any]:
    """An M3 folder served as a dense encoder (its heads pickled, no YAML) gives BGE-M3's
    dense output, the normalized CLS vector, where no sentence-transformers files say how
    it pools."""
    if family != "transformer" or not all((path / f"{head}.pt").is_file()
                                          for head in M3_HEADS):
        return {}
    # Pickles are read only where a YAML allows them; the encoder alone serves here.
    log.warning("%s has an M3 model's heads as pickles (.pt): served as a dense encoder; "
                "for its sparse and multivector outputs give it a YAML with adapter: m3 and "
                "allow_pickle: true", path)
    return {} if _sentence_transformers_folder(path) else {"pooling": "cls", "normalize": True}


def _sentence_transformers_folder(path: Path) -> bool:
    return (path / "modules.json").is_file() or (path / "sentence_bert_config.json").is_file()


def _detect_family(path: Path) -> tuple[str, tuple[str, ...]]:
    if (path / "meta.json").is_file() and (path / "config.cfg").is_file():
        return "spacy", ("extract",)
    if (path / "gliner_config.json").is_file():
        return "gliner", ("extract",)
    if all((path / f"{head}.safetensors").is_file() for head in M3_HEADS):
        return "m3", ("encode", "score")
    if (path / "colbert_linear.safetensors").is_file():  # the multivector family's layout
        return "multivector", ("encode", "score")
    st_config = path / "config_sentence_transformers.json"
    # sentence-transformers 4+ saves its rerankers and sparse encoders with a modules.json
    # too, and names the kind here.
    st_json = _model_json(st_config) if st_config.is_file() else {}
    kind = st_json.get("model_type")
    if kind == "CrossEncoder":
        return "cross_encoder", ("score",)
    if kind == "SparseEncoder":
        return "sparse", ("encode", "score")
    if kind in ("MultiVectorEncoder", "ColBERT") or "query_prefix" in st_json:
        return "multivector", ("encode", "score")  # sentence-transformers' or PyLate's ColBERT
    if _sentence_transformers_folder(path):
        return "transformer", ("encode", "score")
    if (path / "config.json").is_file():
        return _family_of_architectures(path / "config.json")
    raise CatalogError(f"{path} holds no model Ember recognises (a sentence-transformers, "
                       "transformers, ColBERT, CLIP/SigLIP, GLiNER or spaCy directory); "
                       "describe it in a YAML file in a --model-dir instead")


def _family_of_architectures(config: Path) -> tuple[str, tuple[str, ...]]:
    """A plain transformers folder's family, by the architectures its config names."""
    architectures = " ".join(str(a) for a in _model_json(config).get("architectures") or [])
    if "HF_ColBERT" in architectures:  # Stanford-NLP's ColBERT
        return "multivector", ("encode", "score")
    if "ForSequenceClassification" in architectures:
        return "cross_encoder", ("score",)
    if architectures in ("CLIPModel", "SiglipModel"):
        return "clip", ("encode", "score")
    if "ForMaskedLM" in architectures:
        return "sparse", ("encode", "score")
    return "transformer", ("encode", "score")


def resolve_source(spec: ModelSpec, download: bool | None = None) -> Path:
    """The local directory holding the model's files. A Hub model comes from the Hub's
    cache, or is downloaded when `download` (default: this process's policy, see
    ember.hub) allows it."""
    source = spec.source
    if source.path is not None:
        path = source.path.resolve()
        if not path.exists():
            raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
        return path
    if source.package is not None:
        found = importlib.util.find_spec(source.package)
        if found is None or not found.submodule_search_locations:
            raise FileNotFoundError(f"package {source.package!r} is not installed; "
                                    f"pip install it (its name with '-' for '_')")
        root = Path(next(iter(found.submodule_search_locations)))
        return root / source.subdir if source.subdir else root
    if source.hub is not None:
        from ember import hub

        # Complete without onnx/model.onnx: the ONNX backend exports one when it is missing.
        return hub.snapshot(hub_ref(spec), hub_wanted(spec), download, exact=False)
    raise FileNotFoundError(f"model {spec.name!r} names no source")


def files_here(spec: ModelSpec) -> Path | None:
    """The model's folder when its files are on this machine (a Hub model in the Hub's
    cache, an installed package, a folder), without downloading; None when they are not."""
    try:
        return resolve_source(spec, download=False)
    except (FileNotFoundError, OSError):
        return None


def hub_ref(spec: ModelSpec) -> HubRef:
    assert spec.source.hub is not None
    return HubRef(spec.source.hub, spec.source.revision)


def hub_wanted(spec: ModelSpec, backend: Backend | None = None, device: str = "cpu") -> Wanted:
    """What a Hub model needs downloaded; `onnx/model.onnx` when the ONNX backend would
    run it (the spec's backend, else the server's `backend` on CPU without LoRAs)."""
    runs_onnx = (spec.adapter in ONNX_FAMILIES and not spec.loras
                 and (spec.backend or backend or "onnx") == "onnx"
                 and device.startswith("cpu"))
    heads = (tuple((f"{head}.pt", f"{head}.safetensors") for head in M3_HEADS)
             if spec.adapter == "m3" and spec.allow_pickle else ())
    return Wanted(allow_pickle=spec.allow_pickle, trust_remote_code=spec.trust_remote_code,
                  onnx=runs_onnx, extra_files=heads)


def spec_from_hub(ref: HubRef, download: bool | None = None,
                  base: ModelSpec | None = None, limit: int | None = None) -> ModelSpec:
    """A catalog entry for a Hub id: a curated entry (`base`) at the revision asked for,
    or a plain one named after the repository, its family read from the downloaded files
    (as for a local directory; what the load needs besides comes with it: hub_wanted)."""
    if base is not None:  # from the Hub, whatever else the curated entry names
        pinned = base.source.revision if base.source.hub == ref.repo else None
        return replace(base, source=Source(hub=ref.repo, revision=ref.revision or pinned))
    from ember import hub

    folder = hub.snapshot(ref, Wanted(), download, limit=limit)
    family, tasks = _detect_family(folder)
    _refuse_remote_code(folder, str(ref))
    return ModelSpec(name=ref.repo, adapter=family, source=Source(hub=ref.repo,
                                                                  revision=ref.revision),
                     tasks=tasks, description=f"{family} model {ref} from the Hub",
                     **_pickled_m3_dense(folder, family))


def _refuse_remote_code(folder: Path, name: str) -> None:
    """A model whose files map its classes to the repository's own code needs a YAML
    that says trust_remote_code: true; a bare Hub id never runs remote code."""
    if (found := maps_to_code(folder)) is not None:
        raise CatalogError(f"model {name} may run its own code: {found}; Ember runs remote "
                           "code only for a model whose YAML says trust_remote_code: true "
                           "(a file in a --model-dir)")


def hub_spec_on_request(name: str) -> ModelSpec | None:
    """The entry for a Hub id a request named, when the server allows requests to fetch
    models (--allow-hub-models); None otherwise. Blocking: it may download."""
    from ember import hub

    ref = hub_id(name)
    if ref is None or ref.revision is not None or not hub.requests_may_download():
        return None
    return spec_from_hub(ref, download=True, limit=hub.request_download_limit())


def check_proxy(entry: str) -> None:
    """One entry of --forwarded-allow-ips: `*`, an address or a network; anything else
    would match no proxy, and their clients would all seem to be the proxy."""
    if entry in ("", "*"):
        return
    try:
        ipaddress.ip_network(entry, strict=True)
    except ValueError:
        try:
            suggestion = f"; did you mean {ipaddress.ip_network(entry, strict=False)}?"
        except ValueError:
            suggestion = ""
        raise ValueError(f"--forwarded-allow-ips {entry!r} is not an IP address or network "
                         f"(10.0.0.5, 10.0.0.0/8, or * for any){suggestion}") from None


@dataclass(frozen=True)
class RaySettings:
    """`ember serve --ray`: the engine as Ray Serve replicas (`ember.cluster`). A fixed
    `replicas` count, or autoscaling between `min_replicas` and `max_replicas` when either
    bound is set. The two request settings follow measurements (docs/scaling.md): a
    replica's batches are full once two batches' worth of items are ongoing on it (the
    autoscaling target), and Ray's router must never be the queue (the cap stays above
    any load a replica holds; Ember's own queue limit answers 429 before it, and what
passes every replica's cap waits in the router only up to a bound, then gets 429)."""

    address: str | None = None  # None: start a local Ray instance; else join this cluster
    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    # Requests one engine replica holds at once; None: the model's --max-queue-items, so
    # a replica is full when Ember's own queue is, and Ember answers 429 (R7).
    max_ongoing_requests: int | None = None
    # Requests Ray's router holds while every replica is full, before it pushes back (an
    # ingress answers 429 with Retry-After); None: one batch, --max-batch-items.
    max_queued_requests: int | None = None
    target_ongoing_requests: float | None = None  # None: 2 x max_batch_items (one-text requests)
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 120.0
    num_cpus: int | None = None  # logical CPUs of a local instance (None: enough slots)

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    def problem(self, device: str = "cpu") -> str | None:
        """What is wrong with these settings, and with `device` on Ray, if anything."""
        low, high = self.min_replicas, self.max_replicas
        if self.replicas < 1 or (low is not None and low < 1) or (high is not None and high < 1):
            return "--replicas, --min-replicas and --max-replicas must be 1 or more"
        if self.replicas != 1 and self.autoscaling:
            return (f"--replicas {self.replicas} fixes the count of engine replicas, and "
                    "--min-replicas/--max-replicas autoscale it: give one or the other")
        if device.startswith("cuda:") and device != "cuda:0":
            # Ray gives each engine replica a GPU of its own, which the replica sees alone.
            return (f"--device {device}: on Ray each engine replica sees the GPU it was "
                    "given as cuda:0; use --device cuda")
        if low is not None and high is not None and low > high:
            return f"--min-replicas {low} is over --max-replicas {high}"
        counts = (self.max_ongoing_requests, self.max_queued_requests,
                  self.target_ongoing_requests)
        if any(count is not None and count <= 0 for count in counts):
            return ("--max-ongoing-requests, --max-queued-requests and "
                    "--target-ongoing-requests must be positive")
        return None

    def ongoing(self, max_queue_items: int) -> int:
        return self.max_ongoing_requests or max_queue_items

    def queued(self, max_batch_items: int) -> int:
        return self.max_queued_requests or max_batch_items

    def target(self, max_batch_items: int) -> float:
        """Ongoing requests per replica that autoscaling aims at: two full batches of
        one-text requests unless set (divide by the texts your requests carry)."""
        if self.target_ongoing_requests is not None:
            return self.target_ongoing_requests
        return float(2 * max_batch_items)


DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def check_api_key(key: str) -> None:
    """A key every client sends alike: a header loses the spaces at its ends (a secret's
    trailing newline then never matches), and clients encode non-ASCII differently."""
    if not key.strip():
        raise ValueError("--api-key (or EMBER_API_KEY) is empty, which would serve without "
                         "a key: set the key, or leave both unset to serve without one")
    if not all("!" <= char <= "~" for char in key):
        raise ValueError("--api-key (or EMBER_API_KEY) holds a space, line break or "
                         "non-ASCII character, which an Authorization header does not carry "
                         "as typed: use printable ASCII only (a secret read from a file: "
                         "strip its newline)")


# What a browser sends as `Origin`: scheme, host and port, no path.
ORIGIN = re.compile(r"https?://[^/\s?#*]+", re.IGNORECASE)
DEFAULT_PORTS = {"http": 80, "https": 443}


def browser_origin(origin: str) -> str:
    """`origin` as a browser sends it (lower case, no default port), which is what a CORS
    check compares with; ValueError for what is no origin."""
    if origin == "*":
        return origin
    if not ORIGIN.fullmatch(origin):
        raise ValueError("not scheme://host[:port]")
    parts = urlsplit(origin)
    host, port = parts.hostname or "", parts.port  # a port that is no number raises
    host = f"[{host}]" if ":" in host else host
    kept = f":{port}" if port is not None and port != DEFAULT_PORTS[parts.scheme] else ""
    return f"{parts.scheme.lower()}://{host}{kept}"


# A Host header's name (a DNS name, an IPv4 address, or an IPv6 one in brackets).
HOST_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?\.?|\[[0-9A-Fa-f:.]+\]")
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})


def is_loopback(host: str) -> bool:
    """Whether a bind address reaches this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerSettings:
    """Everything `ember serve` is configured with (flags and EMBER_* variables)."""

    host: str = "127.0.0.1"
    port: int = 8080
    workers: int = 0  # API processes beside one engine process; 0: everything in one
    model_dirs: tuple[Path, ...] = ()
    model_paths: tuple[Path, ...] = ()  # --model: local directories or Hub ids
    allow_hub_models: bool = False  # may a request name a Hub model to download
    max_download_gb: float = 20.0  # the largest download a request may start
    preload: tuple[str, ...] = ()
    default_model: str = DEFAULT_MODEL
    device: str = "cpu"
    torch_threads: int | None = None  # None: all cores but one
    backend: Backend = "onnx"
    cache_dir: Path | None = None  # None: $EMBER_CACHE_DIR, else the user cache (_onnx)
    onnx_threads: int | None = None  # None: every core
    onnx_spinning: Spinning = "forward"
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    max_items_per_request: int = 2048  # OpenAI's own limit; the engine splits into forwards
    max_body_bytes: int = 16 * 1024 * 1024
    max_text_chars: int = 200_000
    max_images_per_request: int = 32
    request_timeout_s: float | None = None
    max_loaded_models: int = 4
    memory_budget_mb: int | None = None
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call (CORS); "*": any
    allowed_hosts: tuple[str, ...] = ()  # Host header names answered; (): `answered_hosts`
    forwarded_allow_ips: str | None = None  # proxies whose X-Forwarded-For is believed
    token_ids: str = "refuse"  # refuse | model: how /v1/embeddings reads token-id input
    log_level: str = "info"
    log_format: str = "text"  # text | json (one JSON object a line, for log shippers)
    ray: RaySettings | None = None  # set: serve on Ray Serve (`ember serve --ray`)

    def __post_init__(self) -> None:
        # A value that would make every request fail is refused at start, not served.
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be 0-65535, got {self.port}")
        if not self.host.strip():  # an empty host binds every interface, not loopback
            raise ValueError("--host is empty (an unset EMBER_HOST?); give an address: "
                             "127.0.0.1 for this machine only, 0.0.0.0 for every interface")
        if not 0 < self.max_download_gb < math.inf:
            raise ValueError(f"--max-download-gb must be over 0, got {self.max_download_gb}")
        if not self.default_model.strip():  # read as a folder, it was the current one
            raise ValueError("--default-model is empty (an unset EMBER_DEFAULT_MODEL?); "
                             "name a model, or leave it out for the default")
        if not DEVICE.fullmatch(self.device):
            raise ValueError(f"--device must be cpu, cuda or cuda:N, got {self.device!r}")
        for flag, value in (("--max-body-bytes", self.max_body_bytes),
                            ("--max-items-per-request", self.max_items_per_request),
                            ("--max-text-chars", self.max_text_chars),
                            ("--max-images-per-request", self.max_images_per_request),
                            ("--max-loaded-models", self.max_loaded_models)):
            if value < 1:
                raise ValueError(f"{flag} must be 1 or more, got {value}")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError("--request-timeout-s must be over 0 (leave it out for no "
                             f"timeout), got {self.request_timeout_s:g}")
        if self.memory_budget_mb is not None and self.memory_budget_mb < 1:
            raise ValueError(f"--memory-budget-mb must be 1 or more, got {self.memory_budget_mb}")
        if self.api_key is not None:
            check_api_key(self.api_key)
        if self.forwarded_allow_ips is not None and self.ray is not None:
            raise ValueError("--forwarded-allow-ips sets Ember's own HTTP server; under --ray "
                             "Ray's proxy takes the connections: leave it out")
        for proxy in (self.forwarded_allow_ips or "").split(","):
            check_proxy(proxy.strip())
        for origin in self.cors_origins:
            try:
                sent = browser_origin(origin)
            except ValueError:
                raise ValueError(f"--cors-allow-origin {origin!r} is not an origin: give "
                                 "scheme://host[:port] as the browser's address bar shows "
                                 "it, without a path, a trailing slash or a wildcard, or * "
                                 "for any") from None
            if sent != origin:  # it could never match: say what a browser sends
                raise ValueError(f"--cors-allow-origin {origin!r} is never what a browser "
                                 f"sends; give {sent!r}")
        for name in self.allowed_hosts:
            if name != "*" and not HOST_NAME.fullmatch(name):
                raise ValueError(f"--allowed-host {name!r} is not a host name: give it as a "
                                 "Host header names it, without a scheme, port or path "
                                 "(api.example.com, 10.0.0.5, [::1]), or * for any")
        kept = dict.fromkeys((self.default_model, *self.preload))
        if len(kept) > self.max_loaded_models:  # the first preloads would be evicted at once
            raise ValueError(f"--preload and the default model name {len(kept)} models, and "
                             f"--max-loaded-models keeps {self.max_loaded_models}; raise it "
                             "or preload fewer")
        for flag, threads in (("--torch-threads", self.torch_threads),
                              ("--onnx-threads", self.onnx_threads)):
            if threads is not None and threads < 1:
                raise ValueError(f"{flag} must be 1 or more (leave it out for the default), "
                                 f"got {threads}")

    @cached_property
    def answered_hosts(self) -> frozenset[str] | None:
        """The names a request's Host header may give (None: any). Bound to loopback, or
        given --allowed-host, the server answers to the loopback names, its bind address
        and the names given: a web page that points its own DNS name at 127.0.0.1 (DNS
        rebinding) is then refused, not served, while a local health check still is."""
        if "*" in self.allowed_hosts or not (self.allowed_hosts or is_loopback(self.host)):
            return None
        bind = f"[{self.host}]" if ":" in self.host else self.host
        return LOOPBACK_NAMES | {name.lower().rstrip(".")
                                 for name in (bind, *self.allowed_hosts)}
