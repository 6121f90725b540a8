"""A model directory's JSON files (config.json, modules.json, ...), read with checks:
they come from a download or a folder someone else wrote, so size, syntax, depth and the
top-level type are checked before any field is read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ember.errors import ModelLoadError, json_kind


class ModelFileError(ValueError):
    """A model directory's JSON file cannot be read as one; the message names it."""


MAX_MODEL_JSON_BYTES = 16 << 20  # configs are kilobytes; a vocabulary's JSON a few MB


def read_model_json(path: Path, expect: type[dict[str, Any]] | type[list[Any]] | type[object]
                    = dict) -> Any:
    """A JSON file of a model directory (config.json, modules.json...), checked for size,
    syntax, depth and its top-level type (`expect`; `object`: any) before anything reads a
    field."""
    size = path.stat().st_size
    if size > MAX_MODEL_JSON_BYTES:
        raise ModelFileError(f"{path.name} is {size:,} bytes, over the {MAX_MODEL_JSON_BYTES:,} "
                             "a model's JSON file may have")
    try:
        data = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise ModelFileError(f"{path.name} is not valid JSON ({reason})") from None
    if not isinstance(data, expect):
        raise ModelFileError(f"{path.name} holds {json_kind(data)}, where "
                             f"{json_kind(expect())} is expected")
    return data


def read_model_file(path: Path, model: str,
                    expect: type[dict[str, Any]] | type[list[Any]] = dict) -> Any:
    """`read_model_json` for a model family's loader: a bad file fails the load of
    `model`, naming the file."""
    try:
        return read_model_json(path, expect)
    except ModelFileError as exc:
        raise ModelLoadError(model, str(exc)) from None


# Vocabularies: megabytes of tokens, never where a class is mapped to code.
VOCABULARY_FILES = ("tokenizer.json", "vocab.json")


def maps_to_code(folder: Path) -> str | None:
    """Which JSON file of `folder` maps a class to the repository's own code (an
    `auto_map` at any depth: config.json's, tokenizer_config.json's, a GLiNER config's
    encoder_config), as a phrase naming it, or None. Libraries that load with
    trust_remote_code on (gliner does, always) would run that code; so a model runs it
    only where its YAML trusts it. A file that cannot be read through is counted as one
    (transformers reads a 17 MB config.json that this check would skip)."""
    for path in sorted(folder.glob("*.json")):
        if path.name in VOCABULARY_FILES or not path.is_file():
            continue
        try:
            data = read_model_json(path, object)  # modules.json is an array
        except (ModelFileError, OSError) as exc:
            return f"{path.name} cannot be checked for code ({exc})"
        pending: list[Any] = [data]
        while pending:
            value = pending.pop()
            if isinstance(value, dict):
                if "auto_map" in value:
                    return f"{path.name} maps a class to code (auto_map)"
                pending.extend(value.values())
            elif isinstance(value, list):
                pending.extend(value)
    return None
