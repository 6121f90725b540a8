"""`ember serve --workers N`: N API processes sharing one listening socket, one engine
process per device, and this process watching over them.

The API processes parse, validate, tokenize and encode the answers; the engine
process batches and runs the forwards (`ember.ipc`). An API process that dies is
replaced (its requests in flight end with their connections; the engine drops their
queued work). An engine process that dies is replaced too, however often, after a pause
that grows while each dies soon after its start: each API process sends the new one the
requests the dead one left unanswered, each request at most once (`ember.ipc.client`: a
request whose second engine dies too gets a 503, so a request that crashes the engine
cannot kill engines for ever). Only a crash loop at load ends the server: an engine that
dies as it loads (a model it was loading, or before it finished loading the default
model and --preload) within ENGINE_QUICK_DEATH_S of its start, ENGINE_QUICK_DEATHS times
in a row, ends it with exit 1 and the model's name; an engine that had loaded its models
and served is no crash loop at load. Every child dies with this process
(`ember.ipc.lifeline`). SIGTERM or SIGINT drains: every API process finishes what it
accepted, then the engine drains its workers, then everything exits 0; so does SIGHUP.
The children ignore those signals, which a terminal or a service manager sends every
process of the group at once, and drain on this process's order (`ember.ipc.lifeline`).
A second signal ends all processes at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType
from typing import IO, Any

import zmq

from ember.config import ServerSettings
from ember.ipc.client import peer_name
from ember.ipc.lifeline import (
    DRAIN_ORDER,
    ENGINE_GONE_ORDER,
    die_with_parent,
    drain_on_stop_signals,
    held_for_child,
    ignore_stop_signals,
    repeated_hangup,
    take_drain_orders,
)
from ember.ipc.wire import pack
from ember.logs import configure_logging, name_process

log = logging.getLogger("ember.supervisor")
ENGINE_START_S = 120.0  # the engine imports torch before it answers
FAILED_STARTS = 5  # API processes in a row that die before they serve: they cannot start
API_QUICK_S = 5.0  # an API process that dies this soon after its start ...
API_BACKOFF_S = (0.0, 0.0, 1.0, 2.0, 4.0)  # ... is replaced after this, by such in a row
ENGINE_QUICK_DEATH_S = 30.0  # an engine that dies as it loads this soon after its start ...
ENGINE_QUICK_DEATHS = 3  # ... this many times in a row cannot load its models: give up
ENGINE_BACKOFF_S = (0.0, 1.0, 4.0)  # pause before a restart, by quick deaths in a row
ENGINE_GONE_GRACE_S = 5.0  # API processes answer what they can once the engine is gone
ENGINE_GONE = ("it keeps dying as it loads its models, so the server is stopping; its log "
               "says why")
# Once the API processes have drained, no client waits on the engine: its own drain is
# given this long, then it is killed, so a wedged engine cannot hold the exit for good.
ENGINE_DRAIN_S = 10.0
# An API process that says nothing this long in its drain (it says it is alive every
# second: ember.server.DRAIN_BEAT_S) is stopped or wedged, and is ended.
API_DRAIN_SILENCE_S = 10.0
# An API process ordered to drain before it served (none did) drains once it serves; one
# that has not within this long is ended.
API_START_S = 60.0


OWNER_FILE = "supervisor.pid"  # in a runtime folder, locked while its supervisor lives


def claim(folder: Path) -> IO[str]:
    """Lock `folder` for this process (the kernel lets go when it ends, however): the
    owner file appears only once locked, so a sweep never takes a folder being set up."""
    pending = folder / f"{OWNER_FILE}.new"
    owner = pending.open("w", encoding="ascii")
    fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
    owner.write(str(os.getpid()))
    owner.flush()
    pending.rename(folder / OWNER_FILE)
    return owner


def sweep_stale_runtime_dirs() -> None:
    """Remove the runtime folders (the engine's socket, the metrics files) of supervisors
    that are gone: one killed outright (-9) could not remove its own. A lock, not a pid:
    pids are reused, and a supervisor in another container sharing /tmp has another."""
    for folder in Path(tempfile.gettempdir()).glob("ember-*"):
        try:
            with (folder / OWNER_FILE).open("r", encoding="ascii") as owner:
                fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its supervisor lives
        except OSError:
            continue  # not a supervisor's, or another user's
        shutil.rmtree(folder, ignore_errors=True)


def run_api(settings: ServerSettings, sock: socket.socket, address: str, index: int,
            serving: Connection, drainers: str) -> None:
    """An API process's main: the HTTP routes on the shared socket, the models remote;
    `serving` is told once it listens; `drainers` lists those still draining."""
    from ember.adapters.base import Runtime
    from ember.config import load_catalog
    from ember.ipc.client import EngineClient
    from ember.ipc.models import RemoteModels
    from ember.server import Supervised, hold_drain_order, run_http

    supervisor = multiprocessing.parent_process()
    if supervisor is not None and supervisor.pid is not None:
        die_with_parent(supervisor.pid)
    ignore_stop_signals()
    hold_drain_order()  # the supervisor orders one only where none of them serves yet
    take_drain_orders()
    name_process(f"api {index}")
    configure_logging(settings)
    client = EngineClient(address)
    models = RemoteModels(load_catalog(settings.model_dirs, settings.model_paths),
                          Runtime.from_settings(settings), client,
                          settings.worker)
    def listening() -> None:
        serving.send(True)  # the pipe stays open: the drain's beats go on it
        log.info("API process %d (pid %d) serves", index, os.getpid())

    def draining() -> None:
        with contextlib.suppress(OSError):  # the supervisor is gone: so is this, soon
            serving.send(True)

    def engine_gone() -> None:
        client.engine_gone(ENGINE_GONE)

    run_http(settings, models, sockets=[sock],
             supervised=Supervised(listening, engine_gone, draining,
                                   lambda: drained(Path(drainers), index)))


def list_drainers(path: Path, indexes: Sequence[int]) -> None:
    """Before the first drain order: the API processes that drain (`drained`). A later
    order (the engine gone during the drain) keeps the list as the drain left it."""
    if path.exists():
        return
    written = path.with_name(path.name + ".tmp")
    written.write_text(" ".join(map(str, indexes)))
    written.replace(path)


def drained(path: Path, index: int) -> bool:
    """API process `index` has drained, or ended (the supervisor says so for one that
    died): it leaves the list; whether none is left. True where the list cannot be read:
    each then cuts the shared port's queue as a lone process would."""
    try:
        with path.open("r+") as listed:
            fcntl.flock(listed, fcntl.LOCK_EX)  # released as it closes
            left = {int(word) for word in listed.read().split()} - {index}
            listed.seek(0)
            listed.truncate()
            listed.write(" ".join(map(str, sorted(left))))
    except (OSError, ValueError):
        return True
    return not left


@dataclass
class ApiProcess:
    process: BaseProcess
    # It says once it listens (a death before is a failed start), then, while it drains,
    # every DRAIN_BEAT_S that it is alive.
    serving: Connection
    index: int  # its slot: a replacement takes the dead one's, so names stay 0..N-1
    started: float = field(default_factory=time.monotonic)
    served: bool = False
    ended_unserved: bool = False  # ended by the drain before it served
    heard: float = 0.0  # when it last said anything
    silent: bool = False  # its end of the pipe is closed: it will say nothing more

    def has_served(self) -> bool:
        self.read_news()
        return self.served

    def read_news(self) -> None:
        """What it said since: each word means it serves, and is alive now."""
        try:
            while not self.silent and self.serving.poll(0):
                self.serving.recv()
                self.served, self.heard = True, time.monotonic()
        except (EOFError, OSError):  # it ended (or its pipe was closed here)
            self.silent = True

    def drain_code(self) -> int:
        """Its exit code, as its drain's outcome: one that never served had nothing to
        finish (a drain order can reach it before its handler is set, and end it), nor
        one the drain ended as it started (even if it said it serves just then)."""
        if self.ended_unserved or not self.has_served():
            return 0
        return self.process.exitcode or 0


class Supervisor:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.context = multiprocessing.get_context("spawn")
        sweep_stale_runtime_dirs()
        self.runtime_dir = Path(tempfile.mkdtemp(prefix="ember-"))  # private: mode 0700
        self._owner = claim(self.runtime_dir)  # held, locked, for this process's life
        self.address = f"ipc://{self.runtime_dir / 'engine.sock'}"
        self.drainers = self.runtime_dir / "draining"  # API processes still draining
        self.apis: list[ApiProcess] = []
        self.signals = 0
        self.failed_starts = 0  # API processes in a row that died before they served
        self._struck: set[int] = set()  # API processes taken off the drain's list
        self.quick_deaths = 0  # API processes in a row that died soon after their start
        self.engine_deaths = 0  # engine deaths in a row, each soon after its start (pauses)
        self.load_deaths = 0  # of those, the ones as it loaded (the crash-loop guard)
        self.engine_started = 0.0
        self.engine_notes: Connection | None = None  # what the engine says it loads
        self.engine_loading: list[str] = []  # the models it is loading now
        self.engine_preloaded = False  # it loaded (or failed) the default model and --preload
        self._api_index = itertools.count()
        self._wake_read, self._wake_write = socket.socketpair()

    def run(self, sock: socket.socket) -> int:
        metrics_dir = self.runtime_dir / "metrics"
        metrics_dir.mkdir()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)  # the children inherit it
        drain_on_stop_signals(self._on_signal)
        name_process("supervisor")
        try:
            engine, ready = self._start_engine(first=True)
            if not ready:
                return 0 if self.signals else 1  # stopped as it started: nothing accepted
            for _ in range(self.settings.workers):
                self._start_api(sock)
            log.info("Ember listening on http://%s:%d: %d API processes, engine pid %s "
                     "(default model %s; /docs for the API)", self.settings.host,
                     sock.getsockname()[1], self.settings.workers, engine.pid,
                     self.settings.default_model)
            return self._watch(engine, sock)
        finally:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)

    def _start_engine(self, first: bool = False) -> tuple[BaseProcess, bool]:
        """A new engine process, and whether it bound its socket (else it is ended; the
        `first` one also if a signal comes before: nothing is accepted yet to finish)."""
        from ember.ipc.engine import run_engine

        ready, ready_send = self.context.Pipe(duplex=False)
        engine = self.context.Process(target=run_engine, name="ember-engine",
                                      args=(self.settings, self.address, ready_send, True))
        with held_for_child():
            engine.start()
        ready_send.close()
        self.engine_started = time.monotonic()
        self.engine_notes, self.engine_loading, self.engine_preloaded = ready, [], False
        return engine, self._engine_ready(engine, ready, first)

    def _engine_ready(self, engine: BaseProcess, ready: multiprocessing.connection.Connection,
                      first: bool) -> bool:
        deadline = time.monotonic() + ENGINE_START_S
        # A replacement is waited for in a drain too: the API processes send it what they
        # hold (a second signal ends everything at once, in _on_signal).
        while time.monotonic() < deadline:
            if ready.poll(0.2) and ready.recv() == "ready":
                return True
            if first and self.signals:
                log.info("stopped before the engine process started")
                engine.kill()
                engine.join(10)
                return False
            if not engine.is_alive():
                break
        log.error("the engine process did not start (%s)", exit_reason(engine.exitcode))
        engine.kill()  # it ignores the stop signals
        engine.join(10)
        return False

    def _read_engine_notes(self) -> None:
        """Take what the engine said so far (its pipe never fills)."""
        notes = self.engine_notes
        try:
            while notes is not None and notes.poll(0):
                note = notes.recv()
                if not isinstance(note, tuple):
                    continue
                if note[0] == "loading":
                    self.engine_loading.append(str(note[1]))
                elif note[0] in ("loaded", "failed") and str(note[1]) in self.engine_loading:
                    self.engine_loading.remove(str(note[1]))  # (a Hub model is not noted)
                elif note[0] == "preloaded":
                    self.engine_preloaded = True
        except (EOFError, OSError):  # the engine is gone: its pipe is read to the end
            self.engine_notes = None

    def _replace_engine(self, engine: BaseProcess) -> BaseProcess | None:
        """A new engine for one that died, after a pause that grows while each dies soon
        after its start. None only for a crash loop at load: ENGINE_QUICK_DEATHS deaths in
        a row, each as the engine loaded (a model, or before it finished the default model
        and --preload) within ENGINE_QUICK_DEATH_S of its start. A drain that began meanwhile
        still gets its engine (at once, with no pause): the API processes finish with it."""
        while True:
            self._read_engine_notes()
            up_s = time.monotonic() - self.engine_started
            quick = up_s < ENGINE_QUICK_DEATH_S
            at_load = quick and (bool(self.engine_loading) or not self.engine_preloaded)
            self.engine_deaths = self.engine_deaths + 1 if quick else 1
            self.load_deaths = self.load_deaths + 1 if at_load else 0  # a served one breaks it
            reason = exit_reason(engine.exitcode)
            if self.engine_loading:
                reason += f" while it loaded {', '.join(self.engine_loading)}"
            if self.load_deaths >= ENGINE_QUICK_DEATHS:
                fix = ("remove or fix that model, or leave it out of --default-model and "
                       "--preload" if self.engine_loading else "it died as it started, "
                       "before it loaded a model")
                log.error("the engine process keeps dying: %d times in a row within %.0f s "
                          "of its start, the last %s; stopping (see the engine's log above; "
                          "%s)", self.load_deaths, ENGINE_QUICK_DEATH_S, reason, fix)
                return None
            pause = ENGINE_BACKOFF_S[min(self.engine_deaths, len(ENGINE_BACKOFF_S)) - 1]
            if at_load:
                why = (f"a death as it loads: {self.load_deaths} of {ENGINE_QUICK_DEATHS} in "
                       f"a row within {ENGINE_QUICK_DEATH_S:.0f} s of the start stop the "
                       "server")
            else:
                why = ("it had finished its start loads and was loading no model: no "
                       "crash loop at load" if quick else
                       f"it had run {up_s:.0f} s") + (
                    ", so it is replaced however often it dies; the engine's log above says "
                    "why it died")
            log.error("the engine process died (%s); starting another in %.0f s; the API "
                      "processes send it the requests it left unanswered, each at most "
                      "once (%s)", reason, pause, why)
            if pause and not self.signals:
                wait([self._wake_read], timeout=pause)
            engine, ready = self._start_engine()
            if ready:
                log.info("a new engine process serves (pid %s)", engine.pid)
                return engine

    def _start_api(self, sock: socket.socket, index: int | None = None) -> None:
        index = next(self._api_index) if index is None else index
        serving, says = self.context.Pipe(duplex=False)  # not an Event: no resource tracker
        process = self.context.Process(target=run_api, name=f"ember-api-{index}",
                                       args=(self.settings, sock, self.address, index, says,
                                             str(self.drainers)))
        with held_for_child():
            process.start()
        says.close()
        log.info("started API process %d (pid %s)", index, process.pid)
        self.apis.append(ApiProcess(process, serving, index))

    def _watch(self, engine: BaseProcess, sock: socket.socket) -> int:
        """Replace API processes that die until a signal comes; then drain in order."""
        while not self.signals:
            sentinels = [api.process.sentinel for api in self.apis]
            notes = [self.engine_notes] if self.engine_notes is not None else []
            wait([engine.sentinel, *notes, *sentinels, self._wake_read], timeout=5.0)
            if self.signals:
                break
            self._read_engine_notes()
            if not engine.is_alive():
                replacement = self._replace_engine(engine)
                if replacement is None:
                    self._stop_apis_engine_gone()
                    return 1
                engine = replacement
            for api in [a for a in self.apis if not a.process.is_alive()]:
                if not self._replace(api, sock):
                    self._stop_apis()
                    self._stop_engine(engine)
                    return 1
        self._read_engine_notes()
        if not engine.is_alive():  # it died as the drain began: what is accepted needs one
            replacement = self._replace_engine(engine)
            if replacement is None:
                self._stop_apis_engine_gone()
                return 1
            engine = replacement
        log.info("draining %d API processes, then the engine", len(self.apis))
        sock.close()  # no process will be started again; the last API process closes it
        drain_started = time.monotonic()
        codes, engine = self._drain_apis(engine)
        codes.append(self._stop_engine(engine))
        names = [api.process.name for api in self.apis] + [engine.name]
        for name, code in zip(names, codes, strict=True):
            if code != 0:  # the server's own exit code says only that one failed
                log.error("%s ended its drain with %s", name, exit_reason(code))
        clean = all(code == 0 for code in codes)
        if clean:  # the operator's last line: every process has ended
            log.info("Ember stopped: drained in %.2f s", time.monotonic() - drain_started)
        return 0 if clean else 1

    def _replace(self, api: ApiProcess, sock: socket.socket) -> bool:
        pid, code = api.process.pid, api.process.exitcode
        self.apis.remove(api)
        # Only deaths before serving count: one that served can start, whatever ended it.
        self.failed_starts = 0 if api.has_served() else self.failed_starts + 1
        api.serving.close()
        if self.failed_starts >= FAILED_STARTS:
            log.error("API processes keep dying before they serve: %d in a row (last exit "
                      "code %s); stopping", self.failed_starts, code)
            return False
        quick = time.monotonic() - api.started < API_QUICK_S
        self.quick_deaths = self.quick_deaths + 1 if quick else 0
        pause = API_BACKOFF_S[min(self.quick_deaths, len(API_BACKOFF_S)) - 1] if quick else 0.0
        log.warning("API process %s died (exit code %s); its requests in flight are lost "
                    "with their connections; starting another in %.0f s", pid, code, pause)
        if pid is not None:
            self._tell_engine({"op": "forget", "peer": peer_name(pid)})
        if pause and not self.signals:  # one that keeps dying as it starts is not spun
            wait([self._wake_read], timeout=pause)
        self._start_api(sock, api.index)
        return True

    def _drain_apis(self, engine: BaseProcess) -> tuple[list[int], BaseProcess]:
        """Order each API process to drain and wait for all, replacing an engine that dies
        meanwhile: what the API processes accepted needs one to finish (they resend it).
        Their exit codes, and the engine that is left."""
        self._order_drain()
        ordered = time.monotonic()
        forgotten: set[int] = set()
        while True:
            draining = [api for api in self.apis if api.process.is_alive()]
            # After that look, so that every death which ends the drain is forgotten first
            # (one seen only by the loop's test was not: its queue ran for no one).
            self._forget_the_killed(forgotten)
            self._strike_the_ended()
            if not draining:
                break
            self._wait_drains(draining, ordered, also=[engine.sentinel])
            if not engine.is_alive() and any(api.process.is_alive() for api in self.apis):
                self._read_engine_notes()
                replacement = self._replace_engine(engine)
                if replacement is None:  # a crash loop at load: nothing left to finish with
                    return self._stop_apis_engine_gone(), engine
                engine = replacement
        return [api.drain_code() for api in self.apis], engine

    def _strike_the_ended(self) -> None:
        """Take each API process that has ended off the drain's list (one that drained
        took itself off): the last one left then cuts the port's queue, not none."""
        for api in self.apis:
            if api.index not in self._struck and not api.process.is_alive():
                self._struck.add(api.index)
                drained(self.drainers, api.index)

    def _forget_the_killed(self, forgotten: set[int]) -> None:
        """Tell the engine to drop what an API process that did not end its drain cleanly
        (killed, or ended as wedged) had queued: no one is left to read its answers."""
        for api in self.apis:
            pid, code = api.process.pid, api.process.exitcode
            if pid is not None and pid not in forgotten and code not in (None, 0):
                forgotten.add(pid)
                self._tell_engine({"op": "forget", "peer": peer_name(pid)})

    def _wait_drains(self, draining: list[ApiProcess], ordered: float,
                     timeout: float | None = None, also: Sequence[Any] = ()) -> None:
        """Until a draining API process ends or says it lives (or `also` is ready), at
        most `timeout`; then end those silent for too long (drained since `ordered`)."""
        step = API_DRAIN_SILENCE_S / 4
        news = [api.serving for api in draining if not api.silent]
        wait([*(api.process.sentinel for api in draining), *news, *also],
             timeout=step if timeout is None else min(timeout, step))
        for api in draining:
            self._end_if_wedged(api, ordered)

    def _end_if_wedged(self, api: ApiProcess, ordered: float) -> None:
        """End an API process that said nothing for API_DRAIN_SILENCE_S of its drain (a
        stopped or wedged one would hold the exit for good); what it holds is lost."""
        if not api.process.is_alive():
            return
        if not api.has_served():  # has_served reads its news; ordered while none served
            if time.monotonic() - ordered > API_START_S:
                log.error("API process %d (pid %s) did not serve within %.0f s of the drain "
                          "order; killing it: connections queued on the port are reset",
                          api.index, api.process.pid, API_START_S)
                api.process.kill()
                api.process.join()
            return
        if time.monotonic() - max(api.heard, ordered) > API_DRAIN_SILENCE_S:
            log.error("API process %d (pid %s) gave no sign of life for %.0f s of its drain "
                      "(stopped or wedged); killing it: the requests it holds are lost with "
                      "their connections", api.index, api.process.pid, API_DRAIN_SILENCE_S)
            api.process.kill()
            api.process.join()

    def _stop_apis_engine_gone(self) -> list[int]:
        """`_stop_apis` once no engine will answer again (a crash loop at load): the API
        processes first fail what waits on one, a 503 each rather than a reset."""
        for api in self.apis:
            if api.process.is_alive() and api.process.pid is not None and api.has_served():
                os.kill(api.process.pid, ENGINE_GONE_ORDER)
        return self._stop_apis(ENGINE_GONE_GRACE_S)

    def _stop_apis(self, grace_s: float | None = None) -> list[int]:
        """Order each API process to drain what it accepted and wait for all; after
        `grace_s`, if given, end the ones still running."""
        self._order_drain(wait_unserved=False)
        ordered = time.monotonic()
        deadline = None if grace_s is None else ordered + grace_s
        while alive := [api for api in self.apis if api.process.is_alive()]:
            self._strike_the_ended()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                for api in alive:
                    api.process.kill()
                    api.process.join()
                break
            self._wait_drains(alive, ordered, left)
        return [api.drain_code() for api in self.apis]

    def _order_drain(self, wait_unserved: bool = True) -> None:
        """DRAIN_ORDER to every API process that serves: it finishes what it accepted. One
        still starting has nothing to finish and is ended now, where another serves: the
        connections the kernel queued on the shared port are that one's to answer. Where
        none serves yet (and `wait_unserved`: not when they keep failing to start, or no
        engine is left), each is ordered and drains once it serves, answering those 503,
        which ending them all would reset; `_end_if_wedged` ends one that never does."""
        alive = [api for api in self.apis
                 if api.process.is_alive() and api.process.pid is not None]
        ordered = [api for api in alive if api.has_served()] or (alive if wait_unserved
                                                                  else [])
        try:
            list_drainers(self.drainers, [api.index for api in ordered])
        except OSError as exc:  # the orders go out all the same: each cuts its own queue
            log.warning("could not write the drain's list (%s); each API process will cut "
                        "the port's queue as it ends", exc)
            with contextlib.suppress(OSError):
                self.drainers.unlink()
        for api in alive:
            assert api.process.pid is not None
            if api in ordered:
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                    os.kill(api.process.pid, DRAIN_ORDER)
            else:
                api.process.kill()
                api.ended_unserved = True
                log.info("API process %d (pid %d) had not served yet: ended", api.index,
                         api.process.pid)

    def _stop_engine(self, engine: BaseProcess) -> int:
        if engine.is_alive() and engine.pid is not None:
            os.kill(engine.pid, DRAIN_ORDER)
        engine.join(ENGINE_DRAIN_S)
        if engine.is_alive():  # wedged (a stopped process, a stuck forward): end it
            log.error("the engine process did not end its drain within %.0f s of the API "
                      "processes' (nothing it holds has a client left); killing it",
                      ENGINE_DRAIN_S)
            engine.kill()
            engine.join()
        return engine.exitcode or 0

    def _tell_engine(self, message: dict[str, object]) -> None:
        context = zmq.Context()
        try:
            control = context.socket(zmq.DEALER)
            control.setsockopt(zmq.LINGER, 1000)
            control.connect(self.address)
            control.send(pack(message))
            control.close()
        finally:
            context.term()

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        if repeated_hangup(sig, bool(self.signals)):
            return
        self.signals += 1
        if self.signals > 1:
            log.warning("second signal: ending every process now")
            for child in multiprocessing.active_children():
                child.kill()
            shutil.rmtree(self.runtime_dir, ignore_errors=True)  # os._exit skips `finally`
            os._exit(1)
        log.info("%s: draining", signal.Signals(sig).name)
        self._wake_write.send(b"\0")


def exit_reason(code: int | None) -> str:
    """`exit code 3`, or `killed by SIGKILL` for a negative multiprocessing exit code."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def bind(host: str, port: int) -> socket.socket:
    """The listening socket every API process accepts on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def listening_socket(settings: ServerSettings) -> socket.socket | None:
    """The socket on --host and --port, bound before anything loads: an address that cannot
    be had is one line in the log and None (the server then exits with code 1)."""
    try:
        return bind(settings.host, settings.port)
    except OSError as exc:
        logging.getLogger("ember").error("cannot listen on %s:%d: %s", settings.host,
                                         settings.port, exc.strerror)
        return None


def serve_processes(settings: ServerSettings) -> int:
    configure_logging(settings)
    if (sock := listening_socket(settings)) is None:
        return 1
    with sock:
        return Supervisor(settings).run(sock)
