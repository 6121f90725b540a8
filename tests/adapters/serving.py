"""A real worker around an adapter, and the `submit` its task methods take (as the API does)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass

from ember.adapters.base import ModelAdapter, Submit
from ember.engine import PreparedItem, RequestResult, WorkerConfig
from tests.engine.helpers import PausableWorker


@dataclass
class Served:
    worker: PausableWorker
    submit: Submit


@asynccontextmanager
async def serving(adapter: ModelAdapter,
                  config: WorkerConfig | None = None) -> AsyncIterator[Served]:
    """A started worker around `adapter` and the `submit` a task method takes."""
    worker = PausableWorker(adapter, config or WorkerConfig(), name=adapter.info.name)
    await worker.start()

    async def submit(items: Sequence[PreparedItem], params: Hashable,
                     lora: str | None) -> RequestResult:
        return await (await worker.submit(items, params, lora=lora))

    try:
        yield Served(worker, submit)
    finally:
        await worker.stop()


ServeFactory = Callable[..., AbstractAsyncContextManager[Served]]
