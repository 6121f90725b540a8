"""The engine deployment: one replica per device, each holding Ember's engine.

A replica owns a `Registry` (lazy loads, LRU eviction, one `ModelWorker` per model) and
answers the calls an engine process answers (`ember.ipc.calls.RegistryCalls`), so a
request reaches it as prepared items and joins that model's batcher there.

Multiplexing: every call about one model carries the model's name as Ray's multiplexed
model id, so Ray's router sends it to a replica that already holds the model. The
registry stays the cache that matters: Ray's bookkeeping (`_resident`) only records what
the registry loaded and is capped at the same count (`max_loaded_models`), while eviction
itself is the registry's, which knows which models are in use and drains a model's queue
before it lets the model go.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from ray import serve

from ember.config import ServerSettings, load_catalog
from ember.hub import let_requests_download
from ember.ipc.calls import RegistryCalls
from ember.ipc.wire import error_to_wire
from ember.logs import configure_logging
from ember.registry import Registry

log = logging.getLogger("ember.cluster")
Reply = dict[str, Any]
ENGINE = "EmberEngine"  # the deployment's name, in its own application


class EmberEngine:
    """An engine replica: `submit`, `load` and `status`, each answered as a reply dict
    (`op` = result | error; an error travels as its fields, `ember.ipc.wire`, so it is the
    same HTTP answer as in one process)."""

    async def __init__(self, settings: ServerSettings) -> None:  # type: ignore[misc]
        # Serve awaits an async constructor: the replica is running once this returns.
        configure_logging(settings)
        if settings.allow_hub_models:  # a replica on another node has not inherited it
            let_requests_download(True, settings.max_download_gb)
        self.settings = settings
        self.replica = uuid.uuid4().hex
        self.registry = Registry.serving(settings, load_catalog(settings.model_dirs,
                                                                settings.model_paths))
        self.calls = RegistryCalls(self.registry)
        registry = self.registry

        async def load(name: str) -> str:
            await registry.get(name)  # the registry loads (in a thread) and may evict
            return name

        # Built per replica so its cap follows the settings (a decorator would fix it),
        # over a plain function: Ray keeps its bookkeeping on the function object.
        self._resident: Callable[[str], Awaitable[str]] = serve.multiplexed(
            max_num_models_per_replica=settings.max_loaded_models)(load)
        # The default model loads before the replica counts as running, so /readyz, which
        # asks any replica, sees it loaded; a failure is logged, and its routes say why.
        for name in dict.fromkeys([settings.default_model, *settings.preload]):
            try:
                await registry.get(name)
                await self._resident(name)
            except Exception as exc:
                log.error("could not preload %s: %s", name, exc)

    async def submit(self, message: dict[str, Any]) -> Reply:
        return await self._answer(message, self.calls.submit)

    async def load(self, message: dict[str, Any]) -> Reply:
        return await self._answer(message, self.calls.load)

    async def status(self, message: dict[str, Any]) -> Reply:
        # Which replica speaks: the ingress merges the replicas' views (`RemoteModels`).
        return {**(await self._answer(message, self.calls.status)), "replica": self.replica}

    async def _answer(self, message: dict[str, Any],
                      call: Callable[[dict[str, Any]], Awaitable[Reply]]) -> Reply:
        try:
            if (model := message.get("model")) is not None:
                # A model the registry lacks goes to it first: it answers a failed one at
                # once, where Ray's multiplexer loads one at a time (under a lock), so a
                # call would wait out another model's load there. A loaded one: no hop.
                if self.registry.ready(model) is None:
                    await self.calls.await_model(model, len(message.get("items", ())))
                await self._resident(model)
            return {"op": "result", **(await call(message))}
        except Exception as exc:  # cancellation (the caller went away) propagates
            return {"op": "error", "error": error_to_wire(exc)}

    async def __del__(self) -> None:
        """Ray calls this once no request is ongoing (or its graceful timeout passed):
        every worker drains, so nothing accepted is dropped, then the models go."""
        await self.registry.close()
