"""Refusals and failures the engine raises; messages say what to do."""


class EngineError(Exception):
    """Base class of the engine's own refusals."""


class QueueFull(EngineError):
    """The worker's queue cannot take the whole request now (R7); retrying may succeed."""

    def __init__(self, pending: int, requested: int, limit: int) -> None:
        self.pending = pending
        self.requested = requested
        self.limit = limit
        super().__init__(
            f"queue full: {pending} items pending + {requested} requested would exceed "
            f"max_queue_items={limit}; retry shortly or send fewer items per request"
        )


class RequestTooLarge(EngineError):
    """The request alone has more items than the queue can ever hold (R7): never retry."""

    def __init__(self, requested: int, limit: int) -> None:
        self.requested = requested
        self.limit = limit
        super().__init__(
            f"request too large: {requested} items exceed max_queue_items={limit}; "
            f"split it into requests of at most {limit} items"
        )


class ShuttingDown(EngineError):
    """The worker is stopping and accepts no new work (R8)."""

    def __init__(self) -> None:
        super().__init__("the model worker is shutting down and accepts no new requests")


class WorkerFailed(EngineError):
    """The worker's loop failed: its accepted requests end with this error and it
    refuses new work until it is restarted (R8)."""

    def __init__(self, name: str, cause: BaseException) -> None:
        self.name = name
        self.cause = cause
        super().__init__(f"the worker of model {name!r} failed ({type(cause).__name__}: "
                         f"{cause}) and must be restarted; retry shortly")
