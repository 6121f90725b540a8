"""The scheduling core: no HTTP, no model libraries. See docs/architecture.md."""

from ember.engine.batcher import Batch, BatchFormer, PendingItem
from ember.engine.config import WorkerConfig
from ember.engine.errors import (
    EngineError,
    QueueFull,
    RequestTooLarge,
    ShuttingDown,
    WorkerFailed,
)
from ember.engine.policy import DispatchPolicy, LastForward, QueueView
from ember.engine.stats import BatchRecord, RequestRecord, WorkerStats
from ember.engine.types import Adapter, PreparedItem, RequestResult
from ember.engine.worker import ModelWorker

__all__ = [
    "Adapter",
    "Batch",
    "BatchFormer",
    "BatchRecord",
    "DispatchPolicy",
    "EngineError",
    "LastForward",
    "ModelWorker",
    "PendingItem",
    "PreparedItem",
    "QueueFull",
    "QueueView",
    "RequestRecord",
    "RequestResult",
    "RequestTooLarge",
    "ShuttingDown",
    "WorkerConfig",
    "WorkerFailed",
    "WorkerStats",
]
