"""Errors that cross layers (model, registry, API); each maps to one HTTP status."""

from __future__ import annotations

import difflib
from collections.abc import Sequence


def closest(word: str, choices: Sequence[str]) -> str | None:
    """The choice a mistyped `word` most likely meant: one equal but for case, one whose
    last path part it is (a Hub id without its organisation), else the nearest spelling."""
    lowered = word.lower()
    for choice in choices:
        if choice.lower() == lowered or choice.lower().rpartition("/")[2] == lowered:
            return choice
    close = difflib.get_close_matches(word, choices, n=1)
    return close[0] if close else None


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """"did you mean 'x'? " for the closest choice, or "" where none is close."""
    match = closest(word, choices)
    return f"did you mean {match!r}? " if match else ""


def json_kind(value: object) -> str:
    """What JSON calls a decoded value's type, with its article (msgpack's bytes count as a
    string), for messages that say what was sent instead."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str | bytes):
        return "a string"
    if isinstance(value, list | tuple):
        return "an array"
    return "an object" if isinstance(value, dict) else type(value).__name__


def shown(text: str, limit: int = 80) -> str:
    """A text as a message quotes it: a client's long one is cut."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def described(value: object, limit: int = 80) -> str:
    """A value as a message quotes it: a short scalar as written, anything else by its
    kind (a file's nested value could be long)."""
    if isinstance(value, str | int | float | bool) or value is None:
        return shown(repr(value), limit)
    return json_kind(value)


class EmberError(Exception):
    """Base of Ember's user-facing errors."""


class InvalidInput(EmberError):
    """The request is well-formed but cannot be served as asked (HTTP 422)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        self.message = message
        self.param = param
        super().__init__(message)


# An over-long input's advice, in the native routes' terms; a compatible route puts its
# own field in its place (api.model_task).
TRUNCATE_ADVICE = "set truncate=true (params.options.truncate on /v1/encode and /v1/score)"


class InputTooLong(InvalidInput):
    """An input over the model's token limit with truncation off (HTTP 400 INPUT_TOO_LONG)."""


class UnsupportedOutput(InvalidInput):
    """An output type the model cannot produce (HTTP 422 UNSUPPORTED_OUTPUT)."""


class ModelNotFound(EmberError):
    """No catalog entry by that name (HTTP 404)."""

    def __init__(self, name: str, available: Sequence[str], why: str | None = None,
                 hint: str = "") -> None:
        self.name = name
        self.available = list(available)
        self.why = why  # where the name was looked for beyond the catalog, and what to do
        self.hint = hint  # how this server would serve it
        super().__init__(why or f"model {name!r} is not in the catalog; "
                                f"{did_you_mean(name, self.available)}{hint}the catalog's models "
                                "(GET /v1/models says which are on this machine): "
                                f"{', '.join(self.available) or 'none'}")


class ModelLoadError(EmberError):
    """A catalog model could not be loaded (HTTP 502 on its routes; the server stays up)."""

    def __init__(self, name: str, cause: str) -> None:
        self.name = name
        self.cause = cause
        super().__init__(f"model {name!r} failed to load: {cause}")


class UnsupportedTask(EmberError):
    """The model does not do what the route asks (HTTP 422)."""

    def __init__(self, model: str, task: str, tasks: Sequence[str]) -> None:
        self.model = model
        self.task = task
        self.tasks = tuple(tasks)
        super().__init__(f"model {model!r} does not support {task!r}; it supports: "
                         f"{', '.join(tasks)}")
