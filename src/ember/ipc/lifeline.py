"""A child of the supervisor never outlives it: on Linux the kernel kills the child when
its parent dies (PR_SET_PDEATHSIG); elsewhere a thread watches the parent's pid. So a
killed supervisor leaves no API process holding the port and no engine holding a device.

And a child drains on its supervisor's order alone (DRAIN_ORDER). A terminal's Ctrl-C or
hang-up, `kill` of a process group, and systemd's default stop signal every process of
the service at once; a child that drained on those would stop while the others still
need it (the engine before the API processes have sent it what they hold). So children
ignore them, and the supervisor, signalled too, drains them in order."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing import resource_tracker
from types import FrameType

log = logging.getLogger("ember.supervisor")
DRAIN_ORDER = signal.SIGUSR1  # the supervisor to a child: finish what you accepted, exit
# The supervisor to an API process that serves: it gave up on the engine (a crash loop as
# it loads), so what waits on one fails now, with a 503, rather than with a reset.
ENGINE_GONE_ORDER = signal.SIGUSR2
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # what a server drains on
PR_SET_PDEATHSIG = 1  # linux/prctl.h
WATCH_S = 0.2  # how often the fallback watch looks at the parent


def die_with_parent(parent: int) -> None:
    """End this process as soon as `parent` (its supervisor's pid) is gone."""
    if sys.platform.startswith("linux") and _pdeathsig():
        if os.getppid() != parent:  # it died before the kernel took the request
            os._exit(1)
        return
    threading.Thread(target=_watch, args=(parent,), name="ember-parent-watch",
                     daemon=True).start()


def takes_hangup() -> bool:
    """Whether a server acts on SIGHUP: not when it was started ignoring it (nohup)."""
    return signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN


def drain_on_stop_signals(handler: Callable[[int, FrameType | None], None]) -> None:
    """`handler` for SIGTERM, SIGINT and SIGHUP: a process that drains them all (a
    supervisor, `--ray`'s driver); SIGHUP not when it was started ignoring it (nohup)."""
    for sig in STOP_SIGNALS:
        if sig != signal.SIGHUP or takes_hangup():
            signal.signal(sig, handler)


def repeated_hangup(sig: int, stopping: bool) -> bool:
    """A hang-up while already stopping: a closing terminal sends two (the shell, then the
    terminal), so it is no second signal."""
    return stopping and sig == signal.SIGHUP


def ignore_stop_signals() -> None:
    """For a child: the stop signals are the supervisor's to act on (DRAIN_ORDER). Any that
    came while it started (held, see `held_for_child`) are dropped now."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def take_drain_orders() -> None:
    """For a child, once its DRAIN_ORDER handler is set: an order that came while it
    started is acted on now."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {DRAIN_ORDER})


@contextlib.contextmanager
def held_for_child() -> Iterator[None]:
    """Around starting a child: it inherits these signals blocked, so none reaches it
    before it has chosen what each does (a signal to the whole group, as it imports,
    would end it by default)."""
    # A spawn starts the resource tracker the first time, and unblocks SIGINT and SIGTERM
    # after it: started first, it leaves the mask alone. The tracker ignores those two
    # but not a hang-up: started with it blocked, it keeps it blocked.
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, {*STOP_SIGNALS, DRAIN_ORDER})
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _pdeathsig() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_S)
    log.error("the supervisor process died; exiting")
    os._exit(1)


def exit_leaving_unfinished(unfinished: Sequence[str]) -> None:
    """Exit 0 now, once a drain has answered everything accepted, where a model load or
    download that no request awaits any more still runs: its thread is one the
    interpreter's exit would wait for (minutes, for a large model). Otherwise return."""
    if not unfinished:
        return
    logging.getLogger("ember").info(
        "exiting without waiting for %s: still loading, and no request waits for it",
        ", ".join(unfinished))
    logging.shutdown()
    os._exit(0)
