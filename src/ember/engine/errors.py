"""Refusals the engine raises at submit time; messages say what to do."""


class EngineError(Exception):
    """Base class of the engine's own refusals."""


class QueueFull(EngineError):
    """The worker's queue cannot take the whole request now (R7)."""

    def __init__(self, pending: int, requested: int, limit: int) -> None:
        self.pending = pending
        self.requested = requested
        self.limit = limit
        super().__init__(
            f"queue full: {pending} items pending + {requested} requested would exceed "
            f"max_queue_items={limit}; retry shortly or send fewer items per request"
        )


class ShuttingDown(EngineError):
    """The worker is stopping and accepts no new work (R8)."""

    def __init__(self) -> None:
        super().__init__("the model worker is shutting down and accepts no new requests")
