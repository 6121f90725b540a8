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
    ping {}                          -> pong {engine}: answered by the reader at once
    forget {peer}                    (the supervisor) an API process died: drop its work

No reply is dropped: the socket reports a peer it cannot reach (ROUTER_MANDATORY) and a
peer whose queue is full (its send limit); replies to a peer that is slow to read wait
in its own backlog, in order, while every other peer is answered. A reply that cannot
be packed is answered with an error instead, and a bad frame is logged and skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import parent_process
from multiprocessing.connection import Connection
from typing import Any, cast

import zmq
import zmq.asyncio

from ember.config import ServerSettings, load_catalog
from ember.ipc.calls import RegistryCalls
from ember.ipc.lifeline import die_with_parent
from ember.ipc.wire import error_to_wire, pack, unpack
from ember.logs import configure_logging, name_process
from ember.metrics import Metrics
from ember.registry import Registry, preload_models

log = logging.getLogger("ember.engine")
SEND_LIMIT = 1000  # replies ZeroMQ queues for one peer; more wait in that peer's backlog
RETRY_FIRST_S, RETRY_MAX_S = 0.001, 0.05  # a full peer queue is tried again this often


@dataclass(frozen=True)
class Call:
    peer: bytes
    id: int


class EngineServer(RegistryCalls):
    """Serves a `Registry` to the API processes over ZeroMQ."""

    def __init__(self, registry: Registry, address: str, *,
                 send_limit: int | None = None,
                 on_loading: Callable[[str], None] | None = None) -> None:
        super().__init__(registry)
        self.on_loading = on_loading  # told the name of each model a call makes it load
        self.address = address
        self.boot_id = f"{uuid.uuid4().hex[:12]}"  # a new engine process, a new id
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._socket.setsockopt(zmq.SNDHWM, SEND_LIMIT if send_limit is None else send_limit)
        self._socket.bind(address)
        self._calls: dict[Call, asyncio.Task[None]] = {}
        self._backlogs: dict[bytes, deque[bytes]] = {}
        self._flushers: dict[bytes, asyncio.Task[None]] = {}
        self._reader: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._reader = asyncio.get_running_loop().create_task(self._read(), name="engine-ipc")

    async def close(self) -> None:
        """After the registry drained: send what waits, stop reading, close the socket."""
        flushers = list(self._flushers.values())
        if flushers:
            await asyncio.wait(flushers, timeout=5.0)
        if self._reader is not None:
            self._reader.cancel()
        for task in self._flushers.values():
            task.cancel()
        self._socket.close(linger=0)
        self._context.term()

    async def _read(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            try:
                if len(frames) != 2:
                    raise ValueError(f"{len(frames)} frames, not peer and message")
                peer, frame = frames
                message = unpack(frame)
                if not isinstance(message, dict):
                    raise ValueError(f"a message is a map, not {type(message).__name__}")
                self._handle(peer, message)
            except Exception as exc:  # a malformed message must not end the engine
                log.error("bad message from %r: %s: %s", frames[0][:64],
                          type(exc).__name__, exc)

    def _handle(self, peer: bytes, message: dict[str, Any]) -> None:
        op = message["op"]
        if op == "ping":
            self._send(peer, pack({"op": "pong", "engine": self.boot_id}))
            return
        if op == "cancel":
            task = self._calls.get(Call(peer, message["id"]))
            if task is not None:
                task.cancel()
            return
        if op == "forget":
            gone = str(message["peer"]).encode()
            for call, task in list(self._calls.items()):
                if call.peer == gone:
                    task.cancel()
            self._backlogs.pop(gone, None)
            return
        name = message.get("model")
        if (self.on_loading is not None and isinstance(name, str)
                and name in self.registry.catalog and self.registry.state(name) == "available"):
            self.on_loading(name)
        call = Call(peer, message["id"])
        if call in self._calls:
            return  # a copy its sender sent again, after it lost sight of this engine
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
        try:
            data = pack(reply)
        except Exception as exc:  # its caller still gets an answer
            log.error("could not pack the reply to call %d: %s: %s", call.id,
                      type(exc).__name__, exc)
            data = pack({"op": "error", "id": call.id, "error": {
                "type": "ReplyNotSent",
                "message": f"the engine could not send its answer ({type(exc).__name__})"}})
        self._send(call.peer, data)

    # -- sending: never dropped, never blocking another peer -----------------------------

    def _send(self, peer: bytes, data: bytes) -> None:
        backlog = self._backlogs.get(peer)
        if backlog is None and self._try_send(peer, data):
            return
        if backlog is None:
            backlog = self._backlogs[peer] = deque()
        backlog.append(data)
        if peer not in self._flushers:
            self._flushers[peer] = asyncio.get_running_loop().create_task(self._flush(peer))

    def _try_send(self, peer: bytes, data: bytes) -> bool:
        """True once sent (or the peer is gone for good); False if its queue is full.
        Never a waiting send: the asyncio socket would queue every later send, to every
        peer, behind one that has to wait. (Through the asyncio socket, not a shadow of
        it, so that its reader is woken for what arrived meanwhile.)"""
        sent = cast("asyncio.Future[Any]", self._socket.send_multipart(
            [peer, data], flags=zmq.DONTWAIT, copy=False))
        if not sent.done():  # never so while no send waits; it goes when it can
            return True
        error = sent.exception()
        if error is None:
            return True
        if isinstance(error, zmq.Again):
            return False
        if isinstance(error, zmq.ZMQError) and error.errno == errno.EHOSTUNREACH:
            log.warning("a reply to %r is not sent: that process is gone", peer[:64])
            self._backlogs.pop(peer, None)
            return True
        raise error

    async def _flush(self, peer: bytes) -> None:
        """Send `peer`'s backlog in order as its queue makes room."""
        pause = RETRY_FIRST_S
        try:
            while (backlog := self._backlogs.get(peer)):
                if self._try_send(peer, backlog[0]):
                    if self._backlogs.get(peer) is backlog:
                        backlog.popleft()
                    pause = RETRY_FIRST_S
                    continue
                await asyncio.sleep(pause)
                pause = min(pause * 2, RETRY_MAX_S)
        finally:  # in the same step as the last send: a new reply starts a new flusher
            self._backlogs.pop(peer, None)
            self._flushers.pop(peer, None)


class LoadNotes:
    """Tells the supervisor, through the start-up pipe, each model this engine begins to
    load and each it finished loading: if a load kills the process, the supervisor names
    the model."""

    def __init__(self, pipe: Connection, registry: Registry) -> None:
        self.pipe = pipe
        self.loading: set[str] = set()
        registry.on_load.append(lambda model: self._send("loaded", model.spec.name))

    def note(self, name: str) -> None:
        if name not in self.loading:
            self._send("loading", name)

    def _send(self, what: str, name: str) -> None:
        if what == "loading":
            self.loading.add(name)
        else:
            self.loading.discard(name)
        with contextlib.suppress(OSError):  # the supervisor is gone; this process follows it
            self.pipe.send((what, name))


def run_engine(settings: ServerSettings, address: str, ready: Connection) -> None:
    """The engine process's main: serve the registry on `address` until SIGTERM (from the
    supervisor, once every API process has drained), then drain every worker and exit.
    `ready` gets "ready" once the socket is bound, then ("loading", name) as a model starts
    to load, so that the supervisor can say which one an engine died loading. SIGINT is
    the supervisor's."""
    import uvloop

    supervisor = parent_process()
    if supervisor is not None and supervisor.pid is not None:
        die_with_parent(supervisor.pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    name_process("engine")
    configure_logging(settings)
    uvloop.run(_engine(settings, address, ready))


async def _engine(settings: ServerSettings, address: str, ready: Connection) -> None:
    registry = Registry.serving(settings, load_catalog(settings.model_dirs,
                                                       settings.model_paths))
    metrics = Metrics()
    metrics.attach(registry)
    loading = LoadNotes(ready, registry)
    server = EngineServer(registry, address, on_loading=loading.note)
    server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    ready.send("ready")
    preloads = [settings.default_model, *settings.preload]
    for name in preloads:
        loading.note(name)
    preload = loop.create_task(preload_models(registry, preloads))
    await stop.wait()  # a supervisor that dies takes this process with it (lifeline)
    started = time.perf_counter()
    preload.cancel()
    await registry.close()
    await server.close()
    ready.close()
    log.info("engine drained in %.2f s; exiting", time.perf_counter() - started)
