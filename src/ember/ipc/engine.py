"""The engine process: the registry, the model workers and the models, behind one ZeroMQ
ROUTER socket that every API process connects to.

Requests arrive as prepared items (token ids, pairs, texts) with their parameter group,
so every request, from whichever API process, joins the same batcher. Each message is
one msgpack frame (see `wire`):

    submit {id, model, items: [[payload, cost, index], ...], params, lora}
        -> result {id, values, queue_ms, inference_ms, forwards, pending} | error {id, error}
    cancel {id}                      the caller went away: its queued items are dropped (R9)
    load {id, model}                 -> result {id} | error: load the model now
    status {id}                      -> result {id, states, pending, info, forwards}
    forget {peer}                    (the supervisor) an API process died: drop its work
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import zmq
import zmq.asyncio

from ember.api.metrics import Metrics
from ember.config import ServerSettings, load_catalog
from ember.engine import PreparedItem
from ember.ipc.wire import error_to_wire, pack, unpack
from ember.logs import configure_logging, name_process
from ember.registry import Registry, preload_models

log = logging.getLogger("ember.engine")


@dataclass(frozen=True)
class Call:
    peer: bytes
    id: int


class RegistryCalls:
    """The engine's answers to `submit`, `load` and `status`, over a `Registry`: shared by
    the engine process and the engine replicas on Ray (`ember.cluster`)."""

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
                "pending": {name: m.worker.pending_items for name, m in loaded.items()},
                "info": {name: m.adapter.info for name, m in loaded.items()},
                "forwards": {name: [m.worker.stats.batches, m.worker.stats.items]
                             for name, m in loaded.items()}}


class EngineServer(RegistryCalls):
    """Serves a `Registry` to the API processes over ZeroMQ."""

    def __init__(self, registry: Registry, address: str) -> None:
        super().__init__(registry)
        self.address = address
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address)
        self._calls: dict[Call, asyncio.Task[None]] = {}
        self._reader: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._reader = asyncio.get_running_loop().create_task(self._read(), name="engine-ipc")

    async def close(self) -> None:
        """After the registry drained: stop reading and close the socket."""
        if self._reader is not None:
            self._reader.cancel()
        self._socket.close(linger=0)
        self._context.term()

    async def _read(self) -> None:
        while True:
            peer, frame = await self._socket.recv_multipart()
            try:
                message = unpack(frame)
                self._handle(peer, message)
            except Exception as exc:  # a malformed message must not end the engine
                log.error("bad message from %r: %s: %s", peer, type(exc).__name__, exc)

    def _handle(self, peer: bytes, message: dict[str, Any]) -> None:
        op = message["op"]
        if op == "cancel":
            task = self._calls.get(Call(peer, message["id"]))
            if task is not None:
                task.cancel()
            return
        if op == "forget":
            gone = message["peer"].encode()
            for call, task in list(self._calls.items()):
                if call.peer == gone:
                    task.cancel()
            return
        call = Call(peer, message["id"])
        work = {"submit": self.submit, "load": self.load, "status": self.status}[op]
        task = asyncio.get_running_loop().create_task(self._answer(call, work(message)))
        self._calls[call] = task
        task.add_done_callback(lambda _: self._calls.pop(call, None))

    async def _answer(self, call: Call, work: Any) -> None:
        try:
            reply = {"op": "result", "id": call.id, **(await work)}
        except asyncio.CancelledError:
            return  # the caller is gone or asked to drop it: nobody waits for an answer
        except Exception as exc:
            reply = {"op": "error", "id": call.id, "error": error_to_wire(exc)}
        await self._socket.send_multipart([call.peer, pack(reply)])


def run_engine(settings: ServerSettings, address: str, ready: Connection) -> None:
    """The engine process's main: serve the registry on `address` until SIGTERM (from the
    supervisor, once every API process has drained), then drain every worker and exit.
    `ready` gets one message once the socket is bound. SIGINT is the supervisor's."""
    import uvloop

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    name_process("engine")
    configure_logging(settings)
    uvloop.run(_engine(settings, address, ready))


async def _engine(settings: ServerSettings, address: str, ready: Connection) -> None:
    registry = Registry.serving(settings, load_catalog(settings.model_dirs,
                                                       settings.model_paths))
    metrics = Metrics()
    metrics.attach(registry)
    server = EngineServer(registry, address)
    server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    parent = os.getppid()
    ready.send("ready")
    ready.close()
    preload = loop.create_task(preload_models(registry, [settings.default_model,
                                                         *settings.preload]))
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
        if os.getppid() != parent:  # the supervisor is gone: nobody will stop us
            log.error("the supervisor process died; draining and exiting")
            break
    started = time.perf_counter()
    preload.cancel()
    await registry.close()
    await server.close()
    log.info("engine drained in %.2f s; exiting", time.perf_counter() - started)
