"""The engine's answers to `submit`, `load` and `status` over a `Registry`, without any
transport: the engine process serves them over ZeroMQ (`ember.ipc.engine`), the engine
replicas on Ray through their deployment (`ember.cluster`), which so never imports ZeroMQ."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from ember.engine import PreparedItem, RequestResult
from ember.registry import LoadWaiters, Registry, get_within_room


class RegistryCalls:
    """The engine's answers to `submit`, `load` and `status`, each a reply's fields."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.load_waiters = LoadWaiters()  # every API process's requests, in one count

    async def submit(self, message: dict[str, Any]) -> dict[str, Any]:
        items = [item if isinstance(item, PreparedItem) else PreparedItem(*item)
                 for item in message["items"]]
        result, pending = await self.submit_items(message["model"], items, message["params"],
                                                  message["lora"])
        return {"values": result.values, "queue_ms": result.queue_ms,
                "inference_ms": result.inference_ms, "forwards": result.forwards,
                "pending": pending}

    async def submit_items(self, name: str, items: Sequence[PreparedItem], params: Hashable,
                           lora: str | None) -> tuple[RequestResult, int]:
        """A request's result, and the model's queue depth after it."""
        if self.registry.ready(name) is None:
            await self.await_model(name, len(items))
        async with self.registry.use(name) as model:
            result = await model.submit(items, params, lora)
            return result, model.worker.pending_items

    async def await_model(self, name: str, items: int) -> None:
        """The model's load, awaited within its queue's room by every API process's
        requests in one count."""
        await get_within_room(self.registry, name, items, self.load_waiters)

    async def load(self, message: dict[str, Any]) -> dict[str, Any]:
        await self.registry.get(message["model"])
        return {}

    async def status(self, message: dict[str, Any]) -> dict[str, Any]:
        registry = self.registry
        loaded = registry.loaded
        return {"states": {name: registry.state(name) for name in registry.names},
                "pending": self.pending(),
                "running": {name: m.worker.running_items for name, m in loaded.items()},
                "info": {name: m.adapter.info for name, m in loaded.items()},
                "forwards": {name: [m.worker.stats.batches, m.worker.stats.items]
                             for name, m in loaded.items()},
                "dispatch": {name: m.worker.policy.describe() for name, m in loaded.items()}}

    def pending(self) -> dict[str, int]:
        """Each loaded model's queue depth now."""
        return {name: m.worker.pending_items for name, m in self.registry.loaded.items()}
