"""An API process's side of the IPC: one DEALER socket to the engine process.

Nothing it sends is lost to one engine's death: the engine answers a heartbeat with its
boot id; when a new engine process answers (the supervisor replaced a dead one), every
call still unanswered that the dead one took is sent to it again (encode, score and
extract are idempotent, and the engine ignores a copy of a call it already runs). A call
sent while no engine ran waits in the socket and reaches the new engine itself: the new
engine's first pong names the calls it holds, and the ping it answers tells which calls
were sent behind it, so neither is counted as lost. Once only: a call whose second
engine dies before answering too fails with `EngineDiedTwice` (503), so a request that
crashes the engine (a poison request) ends after two engines, not with every new one, as
the Ray mode's calls are sent once more to another replica. A call waits for a new engine
at most `restart_wait_s` from the moment the engine fell silent, then fails with
`EngineUnavailable` (503 with Retry-After); so does a new call while it stays silent.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import zmq
import zmq.asyncio

from ember.engine import PreparedItem, ShuttingDown, WorkerFailed
from ember.ipc.batch import PARAMS_UNKNOWN, items_to_wire, values_from_wire
from ember.ipc.wire import error_from_wire, pack, unpack

log = logging.getLogger("ember.ipc")
HEARTBEAT_S = 0.5  # a ping this often; the engine's reader answers it at once
RESTART_WAIT_S = 30.0  # how long calls wait for a silent engine (or its replacement)
PARAMS_KEPT = 512  # interned parameter groups (the engine holds more per API process)
PARAMS_TRIES = 3  # times a call is sent again because the engine lacked its group
ENGINE_SENDS = 2  # engine processes a call goes to: the first, and once more to a new one


class EngineUnavailable(WorkerFailed):
    """The engine process did not answer: it died and no new one answered in time, or this
    process's connection to it ended. A 503 with Retry-After, like a failed worker."""

    def __init__(self, reason: str) -> None:
        self.name = "engine"
        self.cause = ConnectionError(reason)
        Exception.__init__(self, f"the engine process is unavailable ({reason}); retry "
                           "shortly")


class EngineDiedTwice(EngineUnavailable):
    """The engine process died while serving the call, and so did the new one it was sent
    to: it is not sent to a third, as it may be what kills them. A 503 with Retry-After."""

    def __init__(self) -> None:
        self.name = "engine"
        self.cause = ConnectionError("the engine process died twice")
        Exception.__init__(self, "the engine process died twice while serving this request, "
                           "so it was not sent again (if the request itself crashes the "
                           "engine, sending it again will not help)")


@dataclass(eq=False)
class _Call:
    id: int
    reply: asyncio.Future[dict[str, Any]]
    engine: str | None  # the boot id of the engine it went to (None: a submit not yet sent)
    message: bytes = b""  # load and status: packed once; sent again as is to a new engine
    submit: _Submit | None = None  # a submit: packed with the others of its turn
    tries: int = 0  # times a submit was sent again for its parameter group
    lost: int = 0  # engines that died before answering it (ENGINE_SENDS bounds the resends)
    new_engine: bool = False  # answered by an engine met after it was sent (it waited for it)
    # The last ping sent before it: a new engine answering that ping or an earlier one
    # gets it behind the ping; one answering a later ping names it (`held`) if it got it.
    after_ping: int = 0


@dataclass(eq=False, slots=True)
class _Submit:
    model: str
    items: list[PreparedItem]
    params: Hashable
    lora: str | None


class EngineClient:
    """One DEALER socket to the engine process; replies find their caller by id."""

    one_queue = True  # the engine process's, which every API process's requests join

    def __init__(self, address: str, identity: str | None = None, *,
                 heartbeat_s: float = HEARTBEAT_S,
                 restart_wait_s: float = RESTART_WAIT_S) -> None:
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self.identity = identity or peer_name(os.getpid())
        self._socket.setsockopt(zmq.IDENTITY, self.identity.encode())
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self.heartbeat_s = heartbeat_s
        self.restart_wait_s = restart_wait_s
        self.engine: str | None = None  # the boot id of the engine last heard
        self._met = asyncio.Event()  # set by the first pong: the engine's id is known
        self.heard_at = time.monotonic()  # when the engine last said anything
        self._ids = itertools.count()
        self._waiting: dict[int, _Call] = {}
        self._reader: asyncio.Task[None] | None = None
        self._heart: asyncio.Task[None] | None = None
        self._sends: set[asyncio.Task[None]] = set()
        self._outbox: list[_Call] = []  # submits of this turn, sent together at its end
        self._params: OrderedDict[Hashable, int] = OrderedDict()  # interned groups, by value
        self._param_ids = itertools.count()
        self._sent_params: set[int] = set()  # the groups the engine `self.engine` was sent
        self._pings = itertools.count(1)
        self._last_ping = 0  # the number of the last ping sent
        self._gone: str | None = None  # why no engine will answer again (`engine_gone`)

    @property
    def silent_s(self) -> float:
        return time.monotonic() - self.heard_at

    async def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request and await its reply; cancelling the caller cancels it in the
        engine too (its queued items are dropped, R9)."""
        if self._socket.closed:  # this process drained and let go of the engine
            raise ShuttingDown()
        if self._gone is not None:
            raise EngineUnavailable(self._gone)
        self._start()
        if self.silent_s > self.restart_wait_s:
            raise EngineUnavailable(f"no answer for {self.silent_s:.0f} s")
        if self.engine is None:  # once: every call goes to an engine known by its id
            try:
                await asyncio.wait_for(self._met.wait(), self.restart_wait_s)
            except TimeoutError:
                raise EngineUnavailable(f"no answer for {self.silent_s:.0f} s") from None
            if self._gone is not None:
                raise EngineUnavailable(self._gone)
            if self._socket.closed or self.engine is None:
                raise ShuttingDown()
        call_id = next(self._ids)
        reply = asyncio.get_running_loop().create_future()
        if op == "submit":  # its engine is set once its turn's message is packed
            call = _Call(call_id, reply, None, submit=_Submit(
                fields["model"], _prepared(fields["items"]), fields["params"], fields["lora"]))
        else:
            call = _Call(call_id, reply, self.engine, pack({"op": op, "id": call_id, **fields}))
        self._waiting[call_id] = call
        try:
            if call.submit is not None:
                self._post(call)
            else:
                call.after_ping = self._last_ping
                await self._socket.send(call.message, copy=False)
            return await call.reply
        except asyncio.CancelledError:
            if call in self._outbox:  # never sent: nothing to cancel in the engine
                self._outbox.remove(call)
            elif not self._socket.closed and (call.reply.cancelled() or not call.reply.done()):
                await asyncio.shield(self._socket.send(pack({"op": "cancel", "id": call_id})))
            raise
        finally:
            self._waiting.pop(call_id, None)
            # An error's traceback holds this frame: let go of the future that holds it.
            del call, reply

    # -- batching: the submits of one turn in one message ----------------------------

    def _post(self, call: _Call) -> None:
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._send_outbox)
        self._outbox.append(call)

    def _send_outbox(self) -> None:
        calls = [call for call in self._outbox if not call.reply.done()]
        self._outbox = []
        if not calls or self._socket.closed:
            return
        try:
            message = self._pack_batch(calls)
        except Exception as exc:  # e.g. a payload that cannot cross: its callers learn why
            for call in calls:
                if not call.reply.done():
                    call.reply.set_exception(exc)
            return
        sent = cast("asyncio.Future[Any]", self._socket.send(message, copy=False))
        sent.add_done_callback(partial(_fail_unsent, calls))

    def _pack_batch(self, calls: list[_Call]) -> bytes:
        groups: dict[int, Hashable] = {}
        entries: list[tuple[int, str, int, str | None, int]] = []
        items: list[PreparedItem] = []
        engine = cast(str, self.engine)
        for call in calls:
            submit = cast(_Submit, call.submit)
            pid = self._param_id(submit.params)
            if pid not in self._sent_params:
                groups[pid] = submit.params
            entries.append((call.id, submit.model, pid, submit.lora, len(submit.items)))
            items.extend(submit.items)
            call.engine, call.after_ping = engine, self._last_ping
        message = pack({"op": "batch", "params": groups, "items": items_to_wire(items),
                        "calls": entries})
        self._sent_params.update(groups)
        return message

    def _param_id(self, params: Hashable) -> int:
        pid = self._params.get(params)
        if pid is None:
            pid = self._params[params] = next(self._param_ids)
            if len(self._params) > PARAMS_KEPT:  # the engine forgets old ones too
                self._sent_params.discard(self._params.popitem(last=False)[1])
        else:
            self._params.move_to_end(params)
        return pid

    async def notify(self, op: str, **fields: Any) -> None:
        """Send a message that has no answer."""
        await self._socket.send(pack({"op": op, **fields}))

    def engine_gone(self, reason: str) -> None:
        """No engine will answer again (the supervisor gave up on it): what waits on one
        fails now, and so does every later call, each a 503 saying `reason`."""
        self._gone = reason
        self._fail_waiting(EngineUnavailable(reason))
        self._met.set()  # a call awaiting the first engine learns it too

    def queued_since(self) -> float | None:
        """None: the engine process reads a status call at once, beside any requests."""
        return None

    def close(self) -> None:
        for task in (self._reader, self._heart, *self._sends):
            if task is not None:
                task.cancel()
        self._socket.close(linger=0)
        self._fail_waiting(ShuttingDown())
        self._met.set()  # a call awaiting the first pong sees the socket closed
        self._context.term()

    # -- reading, heartbeat, resending ------------------------------------------------

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._reader is None or self._reader.done():
            self._reader = loop.create_task(self._read(), name="engine-client-read")
        if self._heart is None or self._heart.done():
            self.heard_at = time.monotonic()  # silence counts from when someone listens
            self._heart = loop.create_task(self._beat(), name="engine-client-heartbeat")

    async def _read(self) -> None:
        try:
            while True:
                frame = await self._socket.recv(copy=True)
                try:
                    self._receive(unpack(frame))
                except Exception as exc:  # one bad frame must not end the reader
                    log.error("bad message from the engine: %s: %s", type(exc).__name__, exc)
        finally:  # nobody would answer them: they fail now, not hang
            if not self._socket.closed:
                self._fail_waiting(EngineUnavailable("its reader in this process ended"))

    def _receive(self, message: Any) -> None:
        if not isinstance(message, dict):
            raise ValueError(f"a message is a map, not {type(message).__name__}")
        op = message.get("op")
        if op == "pong":
            self._heard(str(message["engine"]), message.get("seq"), message.get("held"))
            return
        self.heard_at = time.monotonic()
        if op == "results":
            self._results(message)
            return
        call = self._waiting.get(message["id"])
        if call is None or call.reply.done():
            return  # its caller went away, or a copy of the call answered first
        if op == "error":
            call.reply.set_exception(error_from_wire(message["error"]))
        elif op == "result":
            call.reply.set_result(message)
        else:
            raise ValueError(f"unknown reply op {op!r}")

    def _results(self, message: dict[str, Any]) -> None:
        """One message of results: each call's values are the next `count` of the block."""
        block, start = message["values"], 0
        answers: list[tuple[_Call, dict[str, Any]]] = []
        for call_id, queue_ms, inference_ms, forwards, pending, count in message["ok"]:
            values = values_from_wire(block, start, start + count)
            start += count
            call = self._waiting.get(call_id)
            if call is not None and not call.reply.done():
                answers.append((call, {"values": values, "queue_ms": queue_ms,
                                       "inference_ms": inference_ms, "forwards": forwards,
                                       "pending": pending, "new_engine": call.new_engine}))
        for call, answer in answers:
            call.reply.set_result(answer)
        for call_id, error in message["errors"]:
            call = self._waiting.get(call_id)
            if call is None or call.reply.done():
                continue
            if error.get("type") == PARAMS_UNKNOWN and call.tries < PARAMS_TRIES:
                self._resend_params(call)
            else:
                call.reply.set_exception(error_from_wire(error))

    def _resend_params(self, call: _Call) -> None:
        """The engine does not hold the call's parameter group (it is new, or let the
        group go): send the call again with the group."""
        call.tries += 1
        pid = self._params.get(cast(_Submit, call.submit).params)
        if pid is not None:
            self._sent_params.discard(pid)
        self._post(call)

    def _heard(self, engine: str, seq: Any = None, held: Any = None) -> None:
        self.heard_at = time.monotonic()
        if engine == self.engine:
            return
        first, self.engine = self.engine is None, engine
        self._met.set()
        if first:
            return
        self._sent_params.clear()  # a new engine holds no parameter group yet
        stale = [c for c in self._waiting.values()
                 if c.engine is not None and c.engine != engine and not c.reply.done()]
        # What the new engine took itself: the calls it names, and those sent behind the
        # ping it answers (one socket keeps their order). The rest died with the last one.
        arrived = {i for i in held if isinstance(i, int)} if isinstance(held, tuple) else set()
        behind = seq if isinstance(seq, int) else self._last_ping + 1
        lost = [c for c in stale if c.id not in arrived and c.after_ping < behind]
        for call in stale:
            call.engine, call.new_engine = engine, True
        for call in lost:
            call.lost += 1
        resend = [c for c in lost if c.lost < ENGINE_SENDS]
        dropped = [c for c in lost if c.lost >= ENGINE_SENDS]  # maybe what kills them
        # A warning only where the death cost requests; an idle one's is routine.
        log.log(logging.WARNING if resend else logging.INFO, "a new engine process answers; "
                "sending it the %d requests the last one left unanswered", len(resend))
        if dropped:
            log.error("%d requests fail with 503: the engine process died twice while "
                      "serving each, so they are not sent again", len(dropped))
        for call in dropped:
            call.reply.set_exception(EngineDiedTwice())
        for call in resend:
            call.after_ping = self._last_ping
            if call.submit is not None:
                if call not in self._outbox:  # one sent again for its group is on its way
                    self._post(call)
                continue
            task = asyncio.get_running_loop().create_task(self._send(call.message))
            self._sends.add(task)
            task.add_done_callback(self._sends.discard)

    async def _send(self, message: bytes) -> None:
        await self._socket.send(message, copy=False)

    async def _beat(self) -> None:
        while True:
            # Never a waiting send: a ping that cannot be queued now is not needed.
            self._last_ping = next(self._pings)
            ping = pack({"op": "ping", "seq": self._last_ping})
            sent = cast("asyncio.Future[Any]", self._socket.send(ping, flags=zmq.DONTWAIT))
            sent.add_done_callback(_ignore_outcome)
            if self._waiting and self.silent_s > self.restart_wait_s:
                self._give_up(EngineUnavailable(f"no answer for {self.silent_s:.0f} s"))
            await asyncio.sleep(self.heartbeat_s)

    def _give_up(self, error: Exception) -> None:
        """Fail what waits on a silent engine; an engine that was only stopped would run the
        calls it holds once it wakes, for callers already answered: it is told to drop
        them (R9), a message it reads before anything sent after."""
        for call in self._waiting.values():
            if call.engine is not None and not call.reply.done():  # sent to an engine
                cancel = pack({"op": "cancel", "id": call.id})
                sent = cast("asyncio.Future[Any]", self._socket.send(cancel, flags=zmq.DONTWAIT))
                sent.add_done_callback(_ignore_outcome)
        self._fail_waiting(error)

    def _fail_waiting(self, error: Exception) -> None:
        for call in self._waiting.values():
            if not call.reply.done():
                call.reply.set_exception(error)


def _prepared(items: Any) -> list[PreparedItem]:
    return [item if isinstance(item, PreparedItem) else PreparedItem(*item) for item in items]


def _fail_unsent(calls: list[_Call], sent: asyncio.Future[Any]) -> None:
    """A batch the socket could not take: its callers get the error, not a hang."""
    error = None if sent.cancelled() else sent.exception()
    if error is None:
        return
    for call in calls:
        if not call.reply.done():
            call.reply.set_exception(error)


def _ignore_outcome(sent: asyncio.Future[Any]) -> None:
    if not sent.cancelled():
        sent.exception()  # zmq.Again: the engine is gone and pings pile up; the silence says so


def peer_name(pid: int) -> str:
    """How the engine knows an API process (the supervisor names it when it dies)."""
    return f"api-{pid}"
