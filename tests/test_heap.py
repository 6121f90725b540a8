"""The collector's settings: loaded models leave its generations, evicted ones are freed."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref

from ember.config import ModelSpec, parse_spec
from ember.registry import IDLE_COLLECT_AFTER_S, Registry, RegistryLimits


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
    # Freed by the whole-heap collection once the registry has been idle a moment, not on
    # the spot: that walk would stall every other model's dispatch.
    deadline = time.monotonic() + 10 * IDLE_COLLECT_AFTER_S
    while gone() is not None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert gone() is None
    await registry.close()


async def test_no_whole_heap_collection_while_requests_are_in_flight() -> None:
    """A load or eviction under load leaves the collector alone until the requests stop."""
    registry = Registry({"a": synthetic("a"), "b": synthetic("b")},
                        limits=RegistryLimits(max_loaded_models=1))
    await registry.get("a")
    full: list[float] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(time.monotonic())

    gc.callbacks.append(count)
    try:
        async with registry.use("a"):  # a request in flight ...
            await registry.get("b")  # a load under load
            await asyncio.sleep(3 * IDLE_COLLECT_AFTER_S)
            assert full == []  # ... holds it off
        deadline = time.monotonic() + 10 * IDLE_COLLECT_AFTER_S
        while not full and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert full, "the idle collection never ran"
    finally:
        gc.callbacks.remove(count)
        await registry.close()


def test_a_settled_heap_collects_rarely_but_still_collects() -> None:
    """Python's default ran a young collection every 700 new objects, several per request
    under load; after `settle`, thousands of new objects start none, and the collector
    still runs on its own once a hundred thousand have piled up."""
    from ember import heap

    before = gc.get_threshold()
    runs: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            runs.append(info["generation"])

    try:
        heap.settle()
        gc.callbacks.append(count)
        kept = [[index] for index in range(5_000)]  # 5,000 tracked objects, all alive
        assert runs == []
        kept += [[index] for index in range(heap.THRESHOLDS[0])]
        assert runs, "no collection after a young generation's worth of new objects"
    finally:
        if count in gc.callbacks:
            gc.callbacks.remove(count)
        gc.set_threshold(*before)
