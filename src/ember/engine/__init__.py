"""The scheduling core: no HTTP, no model libraries. See DESIGN.md R1-R10."""

from ember.engine.batcher import BatchFormer, PendingItem
from ember.engine.config import WorkerConfig
from ember.engine.errors import EngineError, QueueFull, ShuttingDown
from ember.engine.stats import BatchRecord, RequestRecord, WorkerStats
from ember.engine.types import Adapter, PreparedItem, RequestResult
from ember.engine.worker import ModelWorker

__all__ = [
    "Adapter",
    "BatchFormer",
    "BatchRecord",
    "EngineError",
    "ModelWorker",
    "PendingItem",
    "PreparedItem",
    "QueueFull",
    "RequestRecord",
    "RequestResult",
    "ShuttingDown",
    "WorkerConfig",
    "WorkerStats",
]
