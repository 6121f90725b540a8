"""The collector's settings: loaded models leave its generations, evicted ones are freed."""

from __future__ import annotations

import gc
import weakref

from ember.config import ModelSpec, parse_spec
from ember.registry import Registry, RegistryLimits


def synthetic(name: str) -> ModelSpec:
    return parse_spec({"name": name, "adapter": "synthetic", "tasks": ["encode"],
                       "options": {"dims": 8}}, "test")


def collected(thing: object) -> bool:
    """Whether the collector walks `thing` (frozen objects are out of its generations)."""
    return any(candidate is thing for candidate in gc.get_objects())


async def test_a_loaded_model_is_out_of_the_collectors_generations() -> None:
    registry = Registry({"a": synthetic("a")})
    model = await registry.get("a")
    assert not collected(model.adapter)
    await registry.close()


async def test_an_evicted_model_in_a_reference_cycle_is_freed() -> None:
    registry = Registry({"a": synthetic("a"), "b": synthetic("b")},
                        limits=RegistryLimits(max_loaded_models=1))
    model = await registry.get("a")
    model.adapter.cycle = model.adapter  # type: ignore[attr-defined]
    gone = weakref.ref(model.adapter)
    del model
    await registry.get("b")  # evicts a
    assert gone() is None
    await registry.close()
