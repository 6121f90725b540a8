"""Errors that cross layers (model, registry, API); each maps to one HTTP status."""

from __future__ import annotations

from collections.abc import Sequence


class EmberError(Exception):
    """Base of Ember's user-facing errors."""


class InvalidInput(EmberError):
    """The request is well-formed but cannot be served as asked (HTTP 422)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        self.message = message
        self.param = param
        super().__init__(message)


class InputTooLong(InvalidInput):
    """An input over the model's token limit with truncation off (HTTP 400 INPUT_TOO_LONG)."""


class ModelNotFound(EmberError):
    """No catalog entry by that name (HTTP 404)."""

    def __init__(self, name: str, available: Sequence[str], why: str | None = None) -> None:
        self.name = name
        self.available = list(available)
        self.why = why  # where the name was looked for beyond the catalog, and what to do
        super().__init__(why or f"model {name!r} is not in the catalog; available: "
                                f"{', '.join(self.available) or 'none'}")


class ModelLoadError(EmberError):
    """A catalog model could not be loaded (HTTP 503 on its routes; the server stays up)."""

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
