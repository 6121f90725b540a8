"""An API process's side of the IPC: the engine client, and the models as the routes see
them (`RemoteModels`): the catalog read here, each model's request-path half loaded
here (tokenizer, prompts, output shaping; no weights), its forwards run by the engine."""

from __future__ import annotations

import asyncio
import importlib
import itertools
import logging
import os
from collections.abc import AsyncIterator, Callable, Hashable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import zmq
import zmq.asyncio

from ember import heap
from ember.adapters.base import ModelInfo, Runtime, TaskModel
from ember.config import ADAPTERS, ModelSpec
from ember.engine import PreparedItem, RequestResult, ShuttingDown
from ember.errors import ModelLoadError
from ember.ipc.wire import error_from_wire, pack, unpack
from ember.registry import CatalogLookup, check_room

log = logging.getLogger("ember.ipc")
FrontLoader = Callable[[ModelSpec, Runtime], TaskModel]


def front_loader(family: str) -> FrontLoader:
    """Each family module exposes `load_front(spec, runtime)`: its request path alone."""
    module = importlib.import_module(f"ember.adapters.{ADAPTERS[family]}")
    return cast(FrontLoader, module.load_front)


class EngineCalls(Protocol):
    """What the remote models need from their engine: `EngineClient` over ZeroMQ, or
    `ember.cluster`'s client of the engine replicas on Ray."""

    async def call(self, op: str, **fields: Any) -> dict[str, Any]: ...

    def close(self) -> None: ...


class EngineClient:
    """One DEALER socket to the engine process; replies find their caller by id."""

    def __init__(self, address: str, identity: str | None = None) -> None:
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self.identity = identity or peer_name(os.getpid())
        self._socket.setsockopt(zmq.IDENTITY, self.identity.encode())
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request and await its reply; cancelling the caller cancels it in the
        engine too (its queued items are dropped, R9)."""
        if self._socket.closed:  # this process drained and let go of the engine
            raise ShuttingDown()
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read())
        call_id = next(self._ids)
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = reply
        try:
            await self._socket.send(pack({"op": op, "id": call_id, **fields}), copy=False)
            return await reply
        except asyncio.CancelledError:
            if reply.cancelled() or not reply.done():  # cancelling the caller cancels `reply`
                await asyncio.shield(self._socket.send(pack({"op": "cancel", "id": call_id})))
            raise
        finally:
            self._waiting.pop(call_id, None)

    async def notify(self, op: str, **fields: Any) -> None:
        """Send a message that has no answer."""
        await self._socket.send(pack({"op": op, **fields}))

    async def _read(self) -> None:
        while True:
            message = unpack(await self._socket.recv(copy=True))
            reply = self._waiting.get(message["id"])
            if reply is None or reply.done():
                continue  # its caller went away
            if message["op"] == "error":
                reply.set_exception(error_from_wire(message["error"]))
            else:
                reply.set_result(message)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._socket.close(linger=0)
        self._context.term()


def peer_name(pid: int) -> str:
    """How the engine knows an API process (the supervisor names it when it dies)."""
    return f"api-{pid}"


@dataclass(eq=False)
class RemoteModel:
    """A model served by the engine process, as a route uses it."""

    spec: ModelSpec
    adapter: TaskModel
    client: EngineCalls
    pending: int = 0  # the engine's queue depth at its last answer
    max_queue_items: int = 0

    def check_room(self, items: int) -> None:
        """The engine's last known queue depth decides: no round trip before tokenizing."""
        check_room(self.pending, items, self.max_queue_items)

    async def submit(self, items: Sequence[PreparedItem], params: Hashable,
                     lora: str | None) -> RequestResult:
        reply = await self.client.call(
            "submit", model=self.spec.name, params=params, lora=lora,
            items=[[item.payload, item.cost, item.index] for item in items])
        self.pending = reply["pending"]
        return RequestResult(list(reply["values"]), reply["queue_ms"], reply["inference_ms"],
                             reply["forwards"])


@dataclass
class RemoteModels(CatalogLookup):
    """The engine process's models, for the routes of one API process."""

    catalog: Mapping[str, ModelSpec]
    runtime: Runtime
    client: EngineCalls
    max_queue_items: int
    loader: Callable[[str], FrontLoader] = front_loader
    _fronts: dict[str, RemoteModel] = field(default_factory=dict)
    _loading: dict[str, asyncio.Future[RemoteModel]] = field(default_factory=dict)
    _states: dict[str, str] = field(default_factory=dict)
    _info: dict[str, ModelInfo] = field(default_factory=dict)
    _pending: dict[str, int] = field(default_factory=dict)

    def state(self, name: str) -> str:
        return self._states.get(name, "available")

    def info(self, name: str) -> ModelInfo | None:
        return self._info.get(name)

    def pending(self) -> dict[str, int]:
        return dict(self._pending)

    async def refresh(self) -> None:
        status = await self.client.call("status")
        self._states = dict(status["states"])
        self._info = dict(status["info"])
        self._pending = dict(status["pending"])

    async def get(self, name: str) -> RemoteModel:
        """The model's front half, loaded here once (concurrent first requests share the
        load), with the engine holding its weights."""
        spec = self.spec(name)
        await self.client.call("load", model=name)  # raises the engine's ModelLoadError
        if name in self._fronts:
            return self._fronts[name]
        loading = self._loading.get(name)
        if loading is None:
            loading = asyncio.ensure_future(self._load_front(spec))
            self._loading[name] = loading
            loading.add_done_callback(lambda _: self._loading.pop(name, None))
        return await asyncio.shield(loading)

    async def _load_front(self, spec: ModelSpec) -> RemoteModel:
        try:
            adapter = await asyncio.to_thread(self.loader(spec.adapter), spec, self.runtime)
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(spec.name, f"{type(exc).__name__}: {exc}") from None
        model = RemoteModel(spec, adapter, self.client,
                            max_queue_items=self._queue_limit(spec))
        self._fronts[spec.name] = model
        heap.settle()
        return model

    @asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[RemoteModel]:
        model = self._fronts.get(name) or await self.get(name)
        yield model

    async def close(self) -> None:
        """The engine drains on its own; this process only lets go of its socket."""
        self.client.close()

    def _queue_limit(self, spec: ModelSpec) -> int:
        return int(spec.batching.get("max_queue_items", self.max_queue_items))
