"""The ingress side of the engine replicas: `RayEngineClient` answers `RemoteModels`'
calls (`submit`, `load`, `status`) through a Ray Serve deployment handle, so the routes of
an ingress replica see the models exactly as an API process of `ember serve --workers N`
does: front halves here, forwards on the engine replicas."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponse

from ember.engine import QueueFull, WorkerFailed
from ember.ipc.wire import error_from_wire

log = logging.getLogger("ember.cluster")
ATTEMPTS = 2  # a call whose replica died is sent once more, to another replica


class ReplicaLost(Exception):
    """The engine replica died (or could not be reached) before it answered."""


class ReplicasFull(QueueFull):
    """Every engine replica holds its cap of requests, and Ray's router its bounded queue:
    answered as Ember's own full queue is (429, Retry-After)."""

    def __init__(self, requested: int) -> None:
        self.pending, self.requested, self.limit = -1, requested, -1
        Exception.__init__(self, "queue full: every engine replica is at its request cap "
                           "(--max-ongoing-requests) and Ray's router queue "
                           "(--max-queued-requests) is full; retry shortly")


def replica_lost(exc: BaseException) -> bool:
    """Whether `exc` says the replica itself is gone, not that the call failed there."""
    if isinstance(exc, ActorDiedError | ActorUnavailableError):
        return True
    return isinstance(exc, RayTaskError) and isinstance(
        getattr(exc, "cause", None), ActorDiedError | ActorUnavailableError)


def cancel(response: DeploymentResponse[Any] | None) -> None:
    """Cancel a call's response, if it was made; a refusal of the router's met on the way
    must not replace what the caller is raising (it surfaced as a 500)."""
    if response is not None:
        with contextlib.suppress(Exception):
            response.cancel()  # type: ignore[no-untyped-call]


class RayEngineClient:
    """`EngineCalls` over the engine deployment's handle.

    A call about one model carries its name as the multiplexed model id, so Ray routes it
    to a replica that holds the model. Embedding, scoring and extraction are idempotent,
    so a call whose replica died before answering is sent once more: Ray's router has by
    then marked that replica dead and picks another. Cancelling the caller (the client
    went away) cancels the call on the replica, whose worker drops the queued items (R9).
    """

    one_queue = False  # each engine replica has its own: one's depth is not the pool's

    def __init__(self, handle: DeploymentHandle[Any]) -> None:
        self.handle = handle
        # The status calls Ray's router has not yet given a replica, by when each was made.
        self._routing: dict[int, float] = {}

    def queued_since(self) -> float | None:
        """Since when a status call has waited in Ray's router for a replica with room,
        every engine replica holding its cap of requests; None: none waits."""
        return min(self._routing.values(), default=None)

    async def call(self, op: str, **fields: Any) -> dict[str, Any]:
        handle = self.handle
        if "model" in fields:
            handle = handle.options(multiplexed_model_id=fields["model"])
        method = getattr(handle, op)
        for attempt in range(1, ATTEMPTS + 1):
            response: DeploymentResponse[dict[str, Any]] | None = None
            try:
                response = method.remote(fields)
                if op == "status":
                    await self._routed(response)
                reply: dict[str, Any] = await response
                break
            except asyncio.CancelledError:
                cancel(response)  # awaiting a response does not cancel it by itself
                raise
            except BackPressureError:
                # Every replica is at its cap and the router's bounded queue is full: the
                # same answer as Ember's own full queue, a 429 with Retry-After.
                raise ReplicasFull(len(fields.get("items", ()))) from None
            except DeploymentUnavailableError:
                # No engine replica runs, nor will (the engine application failed to
                # deploy, or was deleted): a 503 to retry, not a 500.
                raise WorkerFailed(str(fields.get("model", "engine")), ReplicaLost(
                    f"{op}: no engine replica is running (the engine application failed to "
                    "deploy or was deleted)")) from None
            except Exception as exc:
                if not replica_lost(exc):
                    raise
                cancel(response)  # an unreachable replica may still run it: not twice
                if attempt == ATTEMPTS:
                    raise WorkerFailed(str(fields.get("model", "engine")),
                                       ReplicaLost(f"{op}: two engine replicas died or "
                                                   "could not be reached before answering")
                                       ) from None
                log.warning("an engine replica died before answering %s (%s); sending it "
                            "to another replica", op, type(exc).__name__)
        if reply["op"] == "error":
            raise error_from_wire(reply["error"])
        return reply

    async def _routed(self, response: DeploymentResponse[Any]) -> None:
        """Until Ray's router has given the call a replica (it waits while every replica
        is at its cap), noted in `_routing` meanwhile."""
        self._routing[id(response)] = time.monotonic()
        try:
            await response._to_object_ref()  # Ray's developer API: resolves on assignment
        finally:
            del self._routing[id(response)]

    def close(self) -> None:
        """Nothing to release: the handle belongs to Ray."""
