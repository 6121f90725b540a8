"""The fields a request body may hold, read from its pydantic model, to tell a client
which one a field it misspelled or misplaced stands for (`txt` -> `items[0].text`)."""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Iterator
from typing import Any, NamedTuple, get_args, get_origin

from pydantic import BaseModel, RootModel

Path = tuple[str, ...]  # field names from the body down, list indices left out
# Past this, a name is no misspelling of a field (and comparing it would cost seconds).
LONGEST_NAME = 64


class Level(NamedTuple):
    fields: tuple[str, ...]
    in_list: bool  # a path to it passes through a list (its place needs an index)


def _models_in(annotation: Any, in_list: bool = False
               ) -> Iterator[tuple[type[BaseModel], bool]]:
    """The pydantic models a field's type holds (`list[Item] | None` -> Item, in a list)."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        yield annotation, in_list
    listed = in_list or get_origin(annotation) in (list, tuple, set, dict)
    for argument in get_args(annotation):
        yield from _models_in(argument, listed)


@functools.lru_cache(maxsize=64)
def field_levels(model: type[BaseModel]) -> dict[Path, Level]:
    """Each object level of `model`'s bodies, by its path, with the fields it takes."""
    levels: dict[Path, Level] = {}

    def walk(current: type[BaseModel], path: Path, in_list: bool,
             seen: frozenset[type[BaseModel]]) -> None:
        if issubclass(current, RootModel):  # a free-form body: no fields to name
            return
        fields = current.model_fields
        levels[path] = Level(tuple(field.alias or name for name, field in fields.items()),
                             in_list)
        for name, field in fields.items():
            for inner, listed in _models_in(field.annotation):
                if inner not in seen:  # a model that holds itself is walked once a path
                    walk(inner, (*path, field.alias or name), in_list or listed,
                         seen | {inner})

    walk(model, (), False, frozenset({model}))
    return levels


def suggestion(model: type[BaseModel], loc: tuple[int | str, ...]) -> tuple[int | str, ...] | None:
    """Where an unknown field at `loc` (pydantic's location, without "body") most likely
    belongs: a close spelling beside it, else the same name at another level."""
    if not loc or not isinstance(loc[-1], str) or len(loc[-1]) > LONGEST_NAME:
        return None
    levels = field_levels(model)
    parent = tuple(part for part in loc[:-1] if isinstance(part, str))
    unknown = loc[-1]
    beside = levels[parent].fields if parent in levels else ()
    close = difflib.get_close_matches(unknown, beside, n=1, cutoff=0.6)
    if close:
        return (*loc[:-1], close[0])
    elsewhere = sorted((path for path, level in levels.items()
                        if unknown in level.fields and path != parent and not level.in_list),
                       key=len)
    return (*elsewhere[0], unknown) if elsewhere else None
