"""What only the garbage collector could free: a request's objects left in a reference
cycle stay until the collector's next pass, which a server runs rarely (ember.heap), so
under load they pile up in memory and their collection pauses the process."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def cyclic_garbage() -> Iterator[list[str]]:
    """The types (`module:name`) of the objects that only the collector could free, made
    inside."""
    found: list[str] = []
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield found
        gc.collect()
        found += [f"{type(thing).__module__}:{type(thing).__qualname__}"
                  for thing in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
