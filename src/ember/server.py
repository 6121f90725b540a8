"""The HTTP server: uvicorn with Ember's graceful drain on SIGTERM, SIGINT or SIGHUP (in an
API process of several: on its supervisor's order)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ember.api.state import Models, ServerState
from ember.config import ServerSettings
from ember.ipc.lifeline import (
    DRAIN_ORDER,
    ENGINE_GONE_ORDER,
    exit_leaving_unfinished,
    repeated_hangup,
    takes_hangup,
)
from ember.logs import outside_requests

log = logging.getLogger("ember")

# Long enough for a request on a just-accepted connection to be read and answered.
SETTLE_S = 0.1
# Long enough for the event loop to accept the connections queued on its listener.
QUEUE_SETTLE_S = 0.02
# An idle keep-alive connection stays open longer than clients keep theirs in a pool
# (httpx 5 s, aiohttp 15 s) and than load balancers' idle timeouts (often 60 s): with
# uvicorn's 5 s, a client could send a request on a connection the server was closing.
KEEP_ALIVE_S = 75
# At the end of a drain, a keep-alive connection whose last response came before it (so
# without `Connection: close`) may be carrying a request right now: it stays open this
# long for the client to send (answered 503, `Connection: close`) or to close it.
IDLE_GRACE_S = 1.0
DRAIN_BEAT_S = 1.0  # a managed process's sign of life to its supervisor, while it drains
# A request's head (its line and headers) arrives whole within this, as a body's pauses are
# bounded (30 s): a client sending a header a byte a minute cannot hold a connection.
HEAD_S = 30.0
# At the end of a drain, an answer its client has not read whole after this long is cut
# (as a body not whole 10 s into a drain is refused): a client that does not read cannot
# hold the exit.
UNREAD_ANSWER_S = 10.0


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the two bounds it lacks: a connection that never
    sends a request closes after the keep-alive time (uvicorn counts it from a response
    only), and one whose request head stalls closes after HEAD_S. Opened connections that
    send nothing, or a head a byte at a time, would otherwise be held for good."""

    _head_timer: asyncio.TimerHandle | None = None
    _head_open = False  # a request's head has begun and is not yet whole

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # uvicorn's own keep-alive timer: the first byte received cancels it.
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                            self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # Timed only when a read ends inside a head: most heads come whole in one read,
        # and a timer set and cancelled for each cost a request ~2 us.
        self._time_open_head()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_open = True

    def on_headers_complete(self) -> None:
        self._head_open = False
        self._stop_head_timer()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # uvicorn starts the next pipelined request here
        self._time_open_head()

    def _time_open_head(self) -> None:
        """Start the open head's timer, if not started, once every request before it is
        answered: uvicorn does not read on while it answers one."""
        if self._head_open and self._head_timer is None and (
                self.cycle is None or self.cycle.response_complete):
            self._head_timer = self.loop.call_later(HEAD_S, self._head_too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()


_early_signals: list[int] = []  # stop signals that came before the server could drain
_held_handlers: dict[int, Any] = {}  # the handlers hold_stop_signals replaced


def hold_stop_signals() -> None:
    """From the port's binding until the server serves, a stop signal is kept, not fatal
    (it killed the process, resetting connections already queued on the port): the server
    drains on it as soon as it serves, answering those 503."""
    stops = [signal.SIGTERM, signal.SIGINT, *([signal.SIGHUP] if takes_hangup() else [])]
    for stop in stops:
        _held_handlers[stop] = signal.signal(stop, _hold)


def release_stop_signals() -> None:
    """The handlers from before `hold_stop_signals`, once the server has stopped serving
    (uvicorn puts back the one it found, which would swallow the next signal)."""
    while _held_handlers:
        stop, handler = _held_handlers.popitem()
        signal.signal(stop, handler)


def _hold(sig: int, frame: FrameType | None) -> None:
    if _early_signals:
        log.warning("second signal: exiting now")
        os._exit(1)
    _early_signals.append(sig)


def hold_drain_order() -> None:
    """For an API process of several, until it serves: the supervisor's drain order is
    kept, and acted on once it serves, so that it answers 503 what the kernel queued on
    the shared port (leaving would have reset those connections)."""
    signal.signal(DRAIN_ORDER, _keep_order)


def _keep_order(sig: int, frame: FrameType | None) -> None:
    if not _early_signals:  # the supervisor orders once
        _early_signals.append(sig)


@dataclass(frozen=True)
class Supervised:
    """How an API process of several (`ember.supervisor`) keeps its supervisor informed."""

    on_serving: Callable[[], None]  # once it listens
    on_engine_gone: Callable[[], None]  # ENGINE_GONE_ORDER: no engine will answer again
    on_draining: Callable[[], None]  # every DRAIN_BEAT_S of a drain: it is alive
    # Whether no other API process is still draining: the last one cuts the shared
    # port's queue; one before it would shrink the queue its siblings still accept from.
    last_to_drain: Callable[[], bool]


class DrainingServer(uvicorn.Server):
    """The first signal (SIGTERM, SIGINT or SIGHUP) drains: /readyz and new requests answer
    503, accepted requests finish, the workers drain, then the process exits 0. A second
    signal exits at once.

    An API process of several (`supervised`) drains on its supervisor's order alone
    (DRAIN_ORDER) and ignores the stop signals, which reach every process of a group at
    once (`ember.ipc.lifeline`)."""

    def __init__(self, config: uvicorn.Config, state: ServerState,
                 supervised: Supervised | None = None) -> None:
        super().__init__(config)
        self.state = state
        self.supervised = supervised
        self.managed = supervised is not None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        # uvicorn takes SIGTERM and SIGINT; a hang-up drains too, and a managed process
        # drains on its supervisor's order.
        if threading.current_thread() is threading.main_thread():  # as uvicorn's own
            if self.managed:
                signal.signal(DRAIN_ORDER, self.handle_exit)
                signal.signal(ENGINE_GONE_ORDER, self.handle_engine_gone)
            elif takes_hangup():
                signal.signal(signal.SIGHUP, self.handle_exit)
        if self.should_exit:
            return
        if self.supervised is not None:
            self.supervised.on_serving()
        else:  # a supervisor says it for all
            settings = self.state.settings
            log.info("Ember listening on http://%s:%d (default model %s; /docs for the API)",
                     settings.host, self.bound_port(), settings.default_model)
        if _early_signals:  # held since the port was bound (or the process began): now
            self.handle_exit(_early_signals[0], None)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        # Here, not after `run`: asyncio's own ending waits for every thread it lent.
        exit_leaving_unfinished(self.state.registry.unfinished())

    def bound_port(self) -> int:
        """The port listened on (the one the system chose, for --port 0)."""
        for server in self.servers:
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        return self.state.settings.port

    def handle_engine_gone(self, sig: int, frame: FrameType | None) -> None:
        if self.supervised is not None and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: it has drained
                self._loop.call_soon_threadsafe(self.supervised.on_engine_gone)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.managed and (sig != DRAIN_ORDER or self.state.draining):
            return  # the supervisor's order; once given, it ends this process if it must
        if self._loop is None and not self.managed:  # not serving yet: held till it does
            _hold(sig, frame)
            return
        if repeated_hangup(sig, self.state.draining):
            return
        if self.state.draining:
            outside_requests(log.warning, "second signal: exiting now, %d request%s "
                             "unanswered", self.state.in_flight,
                             "" if self.state.in_flight == 1 else "s")
            os._exit(1)
        self.state.begin_drain()
        why = "the supervisor's order" if self.managed else signal.Signals(sig).name
        count = self.state.in_flight
        outside_requests(log.info, "%s: draining, %d request%s in flight", why, count,
                         "" if count == 1 else "s")
        if self._loop is None:
            self.should_exit = True
        else:
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        if self.supervised is not None:
            self._beat = asyncio.create_task(
                self._beat_while_draining(self.supervised.on_draining))
        await self.state.wait_idle()
        # Closing a listening socket resets the connections still queued on it, and every
        # answer in a drain says `Connection: close`, so its clients reconnect: first the
        # queue is cut to one (the kernel drops further connection attempts, which retry
        # and are refused once it is closed), and the loop accepts what it held. With
        # several API processes the socket is shared: the others, still draining, accept
        # through that queue of one too (a connection may wait for its retry, a second or
        # more, where it would get a 503 at once); a reset after a request was sent is
        # worse, since the client cannot know whether it was served. With several, only
        # the last to drain cuts it: the others would leave their siblings, still
        # draining, a queue of one for seconds, and the connections the kernel held back
        # meanwhile would be reset when the port closes.
        if self.supervised is None or self.supervised.last_to_drain():
            self._queue_no_more()
            await asyncio.sleep(QUEUE_SETTLE_S)
        # Stop accepting before exiting, then answer (503) what was accepted meanwhile: with
        # several API processes on one socket, one that exits straight away would reset
        # connections it had just accepted while the others still drain.
        for server in self.servers:
            server.close()
        await asyncio.sleep(SETTLE_S)
        await self.state.wait_idle()
        await self._let_idle_connections_go(IDLE_GRACE_S)
        await self.state.wait_idle()
        await self.state.registry.close()
        await self._close_connections(UNREAD_ANSWER_S)
        log.info("drained in %.2f s; exiting", loop.time() - started)
        self.should_exit = True

    @staticmethod
    async def _beat_while_draining(beat: Callable[[], None]) -> None:
        """A drain may take long (a large request); the beats tell the supervisor this
        process still acts on it, which one stopped or wedged does not."""
        while True:
            beat()
            await asyncio.sleep(DRAIN_BEAT_S)

    def _queue_no_more(self) -> None:
        """The listening sockets' backlog to 0 (shared with the other API processes, which
        drain too), through a copy of each: the event loop's own take no listen()."""
        for server in self.servers:
            for listener in server.sockets:
                with socket.socket(fileno=os.dup(listener.fileno())) as copy:
                    copy.listen(0)

    async def _close_connections(self, unread_s: float) -> None:
        """Close every connection once its answer is sent; cut one whose client has not
        read its answer whole within `unread_s` (uvicorn's own shutdown would wait for it
        without end)."""
        loop = asyncio.get_running_loop()
        for connection in list(self.server_state.connections):
            connection.shutdown()  # closes once what is written has been sent
        deadline = loop.time() + unread_s
        while self.server_state.connections and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if unread := list(self.server_state.connections):
            log.warning("%d client%s did not read %s answer within %g s of the drain's end: "
                        "cut", len(unread), "" if len(unread) == 1 else "s",
                        "its" if len(unread) == 1 else "their", unread_s)
            for connection in unread:
                connection.transport.abort()

    async def _let_idle_connections_go(self, grace_s: float) -> None:
        """Wait until every connection has closed (each answer in a drain says `Connection:
        close`) or `grace_s` passed; uvicorn's shutdown closes the rest."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.server_state.connections and loop.time() < deadline:
            await asyncio.sleep(0.02)


def run_http(settings: ServerSettings, registry: Models,
             sockets: list[socket.socket] | None = None,
             supervised: Supervised | None = None) -> None:
    """Serve the HTTP API for `registry` until a signal has drained it: on the address of
    the settings, or on `sockets` bound by a supervisor (shared by several processes)."""
    from ember.api.app import create_app

    app = create_app(settings, registry)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, loop="uvloop",
                            http=BoundedHttpProtocol, log_level=settings.log_level,
                            access_log=False,
                            log_config=None,  # uvicorn's lines go through Ember's format
                            proxy_headers=settings.forwarded_allow_ips is not None,
                            forwarded_allow_ips=settings.forwarded_allow_ips,
                            timeout_graceful_shutdown=None,
                            timeout_keep_alive=KEEP_ALIVE_S)
    DrainingServer(config, app.state.ember, supervised).run(sockets=sockets)
    release_stop_signals()
