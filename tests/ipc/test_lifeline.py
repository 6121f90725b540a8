"""A child of the supervisor takes its stop from the supervisor alone: a stop signal sent
while it starts (before it set what each signal does) neither ends it nor is lost when it
is the supervisor's drain order."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection

import pytest

from ember.ipc.lifeline import DRAIN_ORDER, held_for_child, ignore_stop_signals, take_drain_orders


def slow_starting_child(started: Connection, go_on: Connection) -> None:
    """Says it runs, waits for the word (the test signals it meanwhile), then takes the
    signals as a child of the supervisor does; exits 3 if no drain order reached it."""
    started.send("running")
    go_on.recv()
    ignore_stop_signals()
    signal.signal(DRAIN_ORDER, lambda *_: sys.exit(0))
    take_drain_orders()
    time.sleep(2)
    sys.exit(3)


@pytest.mark.parametrize("held", [True, False])
def test_a_signal_that_comes_while_a_child_starts_waits_for_its_choice(held: bool) -> None:
    context = multiprocessing.get_context("spawn")
    started, started_send = context.Pipe(duplex=False)
    go_on_recv, go_on = context.Pipe(duplex=False)
    child = context.Process(target=slow_starting_child, args=(started_send, go_on_recv))
    if held:
        with held_for_child():
            child.start()
    else:
        child.start()
    try:
        assert started.poll(60), "the child did not start"
        started.recv()
        assert child.pid is not None
        for sig in (signal.SIGTERM, signal.SIGHUP, DRAIN_ORDER):  # a group's stop, as it starts
            os.kill(child.pid, sig)
        time.sleep(0.2)
        if not held:  # the first signal's default action ended it
            child.join(10)
            assert child.exitcode == -signal.SIGTERM
            return
        assert child.is_alive()
        go_on.send("go")
        child.join(10)
        assert child.exitcode == 0  # the drain order, held until it could act on it
    finally:
        if child.is_alive():
            child.kill()
            child.join()


TRACKER_PROBE = """
import os, signal, time
from multiprocessing import resource_tracker
from ember.ipc.lifeline import held_for_child
with held_for_child():
    pass
pid = resource_tracker._resource_tracker._pid
os.kill(pid, signal.SIGHUP)
time.sleep(0.5)
print("alive" if os.waitpid(pid, os.WNOHANG) == (0, 0) else "ended")
"""


def test_the_resource_tracker_outlives_a_hang_up_to_the_group() -> None:
    """Found by a code review: multiprocessing's resource tracker ignores SIGINT and
    SIGTERM but not SIGHUP, so a hang-up to the whole group ended it, and the next
    child started after it warned that it had died."""
    probe = subprocess.run([sys.executable, "-c", TRACKER_PROBE], capture_output=True,
                           text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "alive"
