"""The engine process: the registry, the model workers and the models, behind one ZeroMQ
ROUTER socket that every API process connects to.

Requests arrive as prepared items (token ids, pairs, texts) with their parameter group,
so every request, from whichever API process, joins the same batcher. Each message is
one msgpack frame (see `wire`); submits travel many to a message (see `batch`):

    batch {params: {pid: group}, items: [payloads, costs, indices],
           calls: [[id, model, pid, lora, count], ...]}
        -> results {ok: [[id, queue_ms, inference_ms, forwards, pending, count], ...],
                    values, errors: [[id, error], ...]}
    cancel {id}                      the caller went away: its queued items are dropped (R9)
    load {id, model}                 -> result {id} | error: load the model now
    status {id}                      -> result {id, states, pending, info, forwards, dispatch}
    ping {seq}                       -> pong {engine, seq, held?}: answered at once; the
                                        first pong to a peer names the calls of it held
    forget {peer}                    (the supervisor) an API process died: drop its work

A call's items are the next `count` of the message's items. A parameter group is sent
once to each engine (`pid` is the sender's name for it, kept per sender, at most
PARAMS_PER_PEER of them); a call naming one this engine does not hold is answered with
the error `ParamsUnknown`, and its sender sends the group again. The replies of one turn
of the loop to one API process (a forward's results, as a rule) go as one message.

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
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Coroutine, Hashable
from functools import partial
from multiprocessing import parent_process
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import zmq

from ember.config import ServerSettings, load_catalog
from ember.engine import PreparedItem, RequestResult
from ember.ipc.batch import PARAMS_UNKNOWN, items_from_wire, values_to_wire
from ember.ipc.calls import RegistryCalls
from ember.ipc.lifeline import (
    DRAIN_ORDER,
    die_with_parent,
    exit_leaving_unfinished,
    ignore_stop_signals,
    take_drain_orders,
)
from ember.ipc.wire import error_to_wire, pack, unpack
from ember.logs import configure_logging, name_process
from ember.metrics import Metrics
from ember.registry import LoadedModel, Registry, preload_models

log = logging.getLogger("ember.engine")
SEND_LIMIT = 1000  # replies ZeroMQ queues for one peer; more wait in that peer's backlog
RETRY_FIRST_S, RETRY_MAX_S = 0.001, 0.05  # a full peer queue is tried again this often
LOAD_CHECK_S = 1.0  # a failed load is told to the supervisor within this (no hook says it)
READ_PER_TURN = 256  # messages read at most in one callback, so a flood cannot hold the loop


PARAMS_PER_PEER = 1024  # parameter groups held per API process; the oldest go first
# What a dead API process sent may be read after the supervisor's `forget` (another
# connection: ZeroMQ orders nothing between the two); it is dropped for this long.
FORGOTTEN_FOR_S = 60.0
# (id, (queue_ms, inference_ms, forwards, pending), values) or (id, None, error)
Reply = tuple[int, tuple[float, float, int, int] | None, Any]


def pack_results(replies: list[Reply]) -> bytes:
    """One message for `replies`; a reply that cannot be packed becomes an error, so its
    caller still gets an answer."""
    try:
        return _pack_results(replies)
    except Exception:
        return _pack_results([_packable(reply) for reply in replies])


def _pack_results(replies: list[Reply]) -> bytes:
    ok = [(call_id, *timings, len(values)) for call_id, timings, values in replies
          if timings is not None]
    errors = [(call_id, error) for call_id, timings, error in replies if timings is None]
    values = [v for _, timings, vs in replies if timings is not None for v in vs]
    return pack({"op": "results", "ok": ok, "values": values_to_wire(values),
                 "errors": errors})


def _packable(reply: Reply) -> Reply:
    try:
        _pack_results([reply])
    except Exception as exc:
        log.error("could not pack the reply to call %d: %s: %s", reply[0],
                  type(exc).__name__, exc)
        return (reply[0], None, {"type": "ReplyNotSent", "message": (
            f"the engine could not send its answer ({type(exc).__name__})")})
    return reply


class Call(NamedTuple):
    """A call of one API process (a tuple: one is made a request, and hashed in C)."""

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
        # A plain socket read from the loop on its descriptor: zmq.asyncio made a future, a
        # poll of the socket and enum values for each message, a quarter of the engine's
        # CPU under load.
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._socket.setsockopt(zmq.SNDHWM, SEND_LIMIT if send_limit is None else send_limit)
        self._socket.bind(address)
        self._calls: dict[Call, asyncio.Future[Any]] = {}  # a task, or a worker's future
        self._params: dict[bytes, OrderedDict[int, Hashable]] = {}  # interned, per peer
        self._replies: dict[bytes, list[Reply]] = {}  # answered this turn, not yet sent
        self._greeted: set[bytes] = set()  # peers this engine has answered a ping of
        self._forgotten: dict[bytes, float] = {}  # dead peers, and when they were forgotten
        self._flush_due = False
        self._backlogs: dict[bytes, deque[bytes]] = {}
        self._flushers: dict[bytes, asyncio.Task[None]] = {}
        self._reading = False  # the socket's descriptor is watched
        self._read_due = False  # a look for messages is scheduled this turn

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(self._socket.fileno(), self._read)
        self._reading = True
        self._look_again()  # what came before the descriptor was watched

    async def close(self) -> None:
        """After the registry drained: send what waits, stop reading, close the socket."""
        flushers = list(self._flushers.values())
        if flushers:
            await asyncio.wait(flushers, timeout=5.0)
        if self._reading:
            asyncio.get_running_loop().remove_reader(self._socket.fileno())
            self._reading = False
        for task in self._flushers.values():
            task.cancel()
        self._socket.close(linger=0)
        self._context.term()

    def _look_again(self) -> None:
        """Read the socket later this turn. ZeroMQ's descriptor signals a change, not each
        message, and any operation on the socket (a send too) may take the signal, so
        after a send, or a read cut short, the socket is looked at again."""
        if not self._read_due:
            self._read_due = True
            asyncio.get_running_loop().call_soon(self._read)

    def _read(self) -> None:
        self._read_due = False
        if not self._reading:
            return
        for _ in range(READ_PER_TURN):
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._take(frames)
        self._look_again()  # more wait: other callbacks get their turn first

    def _take(self, frames: list[bytes]) -> None:
        message: Any = None
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
            if isinstance(message, dict):
                try:  # the only reader: what goes wrong answering must not end it
                    self._refuse(frames[0], message, exc)
                except Exception as failure:
                    log.error("could not answer the bad message: %s: %s",
                              type(failure).__name__, failure)

    def _refuse(self, peer: bytes, message: dict[str, Any], exc: Exception) -> None:
        """An error to each call a refused message carried that can be read (none of them
        started): its request fails now, not when its client gives up waiting."""
        error = {"type": "MessageRefused", "message": "the engine refused the message "
                 f"carrying this call ({type(exc).__name__}: {str(exc)[:200]})"}
        if message.get("op") != "batch":
            if type(message.get("id")) is int and message.get("op") in ("load", "status"):
                self._send(peer, pack({"op": "error", "id": message["id"], "error": error}))
            return
        calls = message.get("calls")
        for call in calls if isinstance(calls, list | tuple) else ():
            call_id = call[0] if isinstance(call, list | tuple) and call else None
            if type(call_id) is int and Call(peer, call_id) not in self._calls:
                self._reply(peer, (call_id, None, error))

    def _handle(self, peer: bytes, message: dict[str, Any]) -> None:
        forgotten = self._forgotten.get(peer)
        if forgotten is not None and time.monotonic() - forgotten < FORGOTTEN_FOR_S:
            return  # sent before its process died, read after: nobody waits for it
        op = message["op"]
        if op == "ping":
            self._send(peer, pack(self._pong(peer, message.get("seq"))))
            return
        if op == "cancel":
            task = self._calls.get(Call(peer, message["id"]))
            if task is not None:
                task.cancel()
            return
        if op == "forget":
            gone = str(message["peer"]).encode()
            dropped = [task for call, task in self._calls.items() if call.peer == gone]
            for task in dropped:
                task.cancel()
            log.info("%s is gone: %d of its calls dropped", gone.decode(errors="replace"),
                     len(dropped))
            self._backlogs.pop(gone, None)
            self._greeted.discard(gone)
            self._params.pop(gone, None)
            self._replies.pop(gone, None)
            now = time.monotonic()
            self._forgotten = {peer: at for peer, at in self._forgotten.items()
                               if now - at < FORGOTTEN_FOR_S}
            self._forgotten[gone] = now
            return
        if op == "batch":
            self._batch(peer, message)
            return
        self._note_loading(message.get("model"))
        call = Call(peer, message["id"])
        if call in self._calls:
            return  # a copy its sender sent again, after it lost sight of this engine
        work = {"load": self.load, "status": self.status}[op]
        self._start(call, self._answer(call, work, message))

    def _pong(self, peer: bytes, seq: Any) -> dict[str, Any]:
        """The answer to a ping, echoing its number. The first to a peer also names the
        peer's calls this engine holds (running, or answered with the reply not yet sent):
        the peer learns which calls it sent before the ping reached this engine and which
        were lost with the one before, so only those count as lost and are sent again."""
        pong: dict[str, Any] = {"op": "pong", "engine": self.boot_id,
                                "seq": seq if isinstance(seq, int) else None}
        if peer not in self._greeted:
            self._greeted.add(peer)
            pong["held"] = [call.id for call in self._calls if call.peer == peer] + [
                reply[0] for reply in self._replies.get(peer, ())]
        return pong

    def _note_loading(self, name: Any) -> None:
        if (self.on_loading is not None and isinstance(name, str)
                and name in self.registry.catalog and self.registry.state(name) == "available"):
            self.on_loading(name)

    def _start(self, call: Call, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._calls[call] = task
        task.add_done_callback(lambda _: self._calls.pop(call, None))

    def _batch(self, peer: bytes, message: dict[str, Any]) -> None:
        """Every submit of one message; the message is checked whole before any starts."""
        table = self._params.setdefault(peer, OrderedDict())
        groups = message["params"]
        if not isinstance(groups, dict):
            raise ValueError("params must be a map of id to parameter group")
        for pid, group in groups.items():
            if not isinstance(pid, int):
                raise ValueError(f"a parameter group's id is an int, not {pid!r}")
            hash(group)  # a group is hashable (R6): a map or list here is refused now
            table[pid] = group
            table.move_to_end(pid)
        while len(table) > PARAMS_PER_PEER:
            table.popitem(last=False)
        block, start = items_from_wire(message["items"]), 0
        submits: list[tuple[Call, str, Hashable, str | None, list[PreparedItem]]] = []
        unknown: list[int] = []
        for call_id, model, pid, lora, count in message["calls"]:
            if not (isinstance(call_id, int) and isinstance(model, str) and isinstance(count, int)
                    and (lora is None or isinstance(lora, str))):
                raise ValueError("a call is [id, model, params id, lora, item count]")
            if not 0 < count <= len(block) - start:
                raise ValueError(f"a call's {count} items are not in the message")
            items = block[start:start + count]
            start += count
            if pid not in table:
                unknown.append(call_id)
            else:
                submits.append((Call(peer, call_id), model, table[pid], lora, items))
        if start != len(block):
            raise ValueError(f"{len(block)} items, but the calls claim {start}")
        for call_id in unknown:
            self._reply(peer, (call_id, None, {"type": PARAMS_UNKNOWN, "message": (
                "this engine does not hold the call's parameter group; send it again")}))
        for call, name, params, lora, items in submits:
            if call in self._calls:
                continue  # a copy its sender sent again, after it lost sight of this engine
            model = self.registry.ready(name)
            if model is None:  # it loads (or its worker restarts) first: a task awaits that
                self._note_loading(name)
                self._start(call, self._answer_submit(call, name, items, params, lora))
                continue
            try:  # the common case: straight into the worker, no task for the request
                future = model.worker.submit_nowait(items, params, lora=lora)
            except Exception as exc:
                self._reply(peer, (call.id, None, error_to_wire(exc)))
                continue
            model.in_use += 1  # held against eviction until it is answered
            model.last_used = time.monotonic()
            self._calls[call] = future
            future.add_done_callback(partial(self._submitted, call, model))

    def _submitted(self, call: Call, model: LoadedModel,
                   future: asyncio.Future[RequestResult]) -> None:
        model.in_use -= 1
        self.registry.released(model)
        self._calls.pop(call, None)
        if future.cancelled():
            return  # the caller is gone or asked to drop it: nobody waits for an answer
        error = future.exception()
        if error is not None:
            self._reply(call.peer, (call.id, None, error_to_wire(error)))
            return
        result = future.result()
        self._reply(call.peer, (call.id, (result.queue_ms, result.inference_ms,
                                          result.forwards, model.worker.pending_items),
                                result.values))

    async def _answer_submit(self, call: Call, model: str, items: list[PreparedItem],
                             params: Hashable, lora: str | None) -> None:
        try:
            result, pending = await self.submit_items(model, items, params, lora)
        except asyncio.CancelledError:
            return  # the caller is gone or asked to drop it: nobody waits for an answer
        except Exception as exc:
            self._reply(call.peer, (call.id, None, error_to_wire(exc)))
            return
        self._reply(call.peer, (call.id, (result.queue_ms, result.inference_ms,
                                          result.forwards, pending), result.values))

    def _reply(self, peer: bytes, reply: Reply) -> None:
        """Gather the replies of this turn; they go to each peer as one message."""
        replies = self._replies.get(peer)
        if replies is None:
            replies = self._replies[peer] = []
        replies.append(reply)
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._send_replies)

    def _send_replies(self) -> None:
        self._flush_due = False
        gathered, self._replies = self._replies, {}
        for peer, replies in gathered.items():
            self._send(peer, pack_results(replies))

    async def _answer(self, call: Call,
                      work: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]],
                      message: dict[str, Any]) -> None:
        # `work` is called here, not by the caller: a call cancelled before it starts
        # would leave its coroutine never awaited.
        try:
            reply = {"op": "result", "id": call.id, **(await work(message))}
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
        Never a waiting send: it would hold every later send, to every peer, behind one
        that has to wait."""
        try:
            self._socket.send_multipart([peer, data], flags=zmq.DONTWAIT, copy=False)
        except zmq.Again:
            return False
        except zmq.ZMQError as error:
            if error.errno != errno.EHOSTUNREACH:
                raise
            log.warning("a reply to %r is not sent: that process is gone", peer[:64])
            self._backlogs.pop(peer, None)
        finally:
            self._look_again()
        return True

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
    load, each it finished loading and each whose load failed, and once the models it
    loads at start are done: if a load kills the process, the supervisor names the model,
    and only a death as the engine loads counts toward its crash-loop guard."""

    def __init__(self, pipe: Connection, registry: Registry) -> None:
        self.pipe = pipe
        self.registry = registry
        self.loading: set[str] = set()
        registry.on_load.append(lambda model: self._send("loaded", model.spec.name))
        registry.on_absent.append(lambda name: self._send("failed", name))  # nothing ran

    def note(self, name: str) -> None:
        if name not in self.loading:
            self._send("loading", name)

    def preloaded(self, names: list[str]) -> None:
        """The start models' loads are over: each that did not load failed (its name may
        not even resolve, so the registry may not say `failed`)."""
        for name in dict.fromkeys(names):
            if name in self.loading and self.registry.state(name) not in ("loading", "loaded"):
                self._send("failed", name)
        with contextlib.suppress(OSError):  # the supervisor is gone; this process follows it
            self.pipe.send(("preloaded", ""))

    async def watch_failures(self) -> None:
        """Tell each failed load soon: a later death must not count as one while loading."""
        while True:
            await asyncio.sleep(LOAD_CHECK_S)
            for name in [n for n in self.loading if self.registry.state(n) == "failed"]:
                self._send("failed", name)

    def _send(self, what: str, name: str) -> None:
        if what == "loading":
            self.loading.add(name)
        else:
            self.loading.discard(name)
        with contextlib.suppress(OSError):  # the supervisor is gone; this process follows it
            self.pipe.send((what, name))


def run_engine(settings: ServerSettings, address: str, ready: Connection,
               managed: bool = False) -> None:
    """The engine process's main: serve the registry on `address` until SIGTERM (`managed`:
    until the supervisor's DRAIN_ORDER, once every API process has drained; the stop
    signals are then ignored), then drain every worker and exit.
    `ready` gets "ready" once the socket is bound, then ("loading", name) as a model starts
    to load, ("loaded", name) or ("failed", name) as its load ends, and ("preloaded", "")
    once the default model and --preload are loaded or failed, so that the supervisor can
    tell a death as the engine loads (and which model) from one after. SIGINT is the
    supervisor's."""
    import uvloop

    supervisor = parent_process()
    if supervisor is not None and supervisor.pid is not None:
        die_with_parent(supervisor.pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if managed:
        ignore_stop_signals()
    name_process("engine")
    configure_logging(settings)
    uvloop.run(_engine(settings, address, ready, DRAIN_ORDER if managed else signal.SIGTERM))


async def _engine(settings: ServerSettings, address: str, ready: Connection,
                  drain_on: int) -> None:
    registry = Registry.serving(settings, load_catalog(settings.model_dirs,
                                                       settings.model_paths))
    metrics = Metrics()
    metrics.attach(registry)
    metrics.process_starts.labels("engine").inc()
    loading = LoadNotes(ready, registry)
    server = EngineServer(registry, address, on_loading=loading.note)
    server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(drain_on, stop.set)
    take_drain_orders()
    ready.send("ready")
    preloads = [settings.default_model, *settings.preload]
    preload = loop.create_task(_preload(registry, preloads, loading))
    failures = loop.create_task(loading.watch_failures())
    await stop.wait()  # a supervisor that dies takes this process with it (lifeline)
    started = time.perf_counter()
    preload.cancel()
    failures.cancel()
    await registry.close()
    await server.close()
    ready.close()
    log.info("engine drained in %.2f s; exiting", time.perf_counter() - started)
    # Here, not after the loop: asyncio's own ending waits for every thread it lent.
    exit_leaving_unfinished(registry.unfinished())


async def _preload(registry: Registry, names: list[str], notes: LoadNotes) -> None:
    """The start models, each noted as its turn comes: a death names the model that was
    loading, not those still to come (a review found them all named)."""
    await preload_models(registry, names, starting=notes.note)
    notes.preloaded(names)
