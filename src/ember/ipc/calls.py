"""The engine's answers to `submit`, `load` and `status` over a `Registry`, without any
transport: the engine process serves them over ZeroMQ (`ember.ipc.engine`), the engine
replicas on Ray through their deployment (`ember.cluster`), which so never imports ZeroMQ."""

from __future__ import annotations

from typing import Any

from ember.engine import PreparedItem
from ember.registry import Registry


class RegistryCalls:
    """The engine's answers to `submit`, `load` and `status`, each a reply's fields."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    async def submit(self, message: dict[str, Any]) -> dict[str, Any]:
        name = message["model"]
        items = [PreparedItem(payload, cost, index) for payload, cost, index in message["items"]]
        async with self.registry.use(name) as model:
            result = await model.submit(items, message["params"], message["lora"])
            return {"values": result.values, "queue_ms": result.queue_ms,
                    "inference_ms": result.inference_ms, "forwards": result.forwards,
                    "pending": model.worker.pending_items}

    async def load(self, message: dict[str, Any]) -> dict[str, Any]:
        await self.registry.get(message["model"])
        return {}

    async def status(self, message: dict[str, Any]) -> dict[str, Any]:
        registry = self.registry
        loaded = registry.loaded
        return {"states": {name: registry.state(name) for name in registry.names},
                "pending": self.pending(),
                "info": {name: m.adapter.info for name, m in loaded.items()},
                "forwards": {name: [m.worker.stats.batches, m.worker.stats.items]
                             for name, m in loaded.items()}}

    def pending(self) -> dict[str, int]:
        """Each loaded model's queue depth now."""
        return {name: m.worker.pending_items for name, m in self.registry.loaded.items()}
