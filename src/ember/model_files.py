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


def read_model_json(path: Path, expect: type[dict[str, Any]] | type[list[Any]] = dict) -> Any:
    """A JSON file of a model directory (config.json, modules.json...), checked for size,
    syntax, depth and its top-level type (`expect`) before anything reads a field."""
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
