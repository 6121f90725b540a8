"""A real `ember serve` process for tests: started on 127.0.0.1 at a free port, ready
once /readyz answers 200, stopped with SIGTERM. Every wait is bounded."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx
import psutil  # type: ignore[import-untyped]

REPO = Path(__file__).resolve().parents[1]
TEST_WORKERS = "EMBER_TEST_WORKERS"  # API processes of every server the tests start
T = TypeVar("T")


def free_port() -> int:
    """A port no socket holds now, below the kernel's ephemeral range: there no outgoing
    connection, nor a bind to port 0, takes it before the server binds it (a Ray server
    binds seconds later, while other tests open hundreds of connections). Above Ray's
    worker ports (10002-19999) too; the kernel's own choice where no room is left."""
    below = lowest_ephemeral_port()
    candidates = [random.randrange(20000, below) for _ in range(200)] if below > 21000 else []
    for port in [*candidates, 0]:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # held: another
            chosen: int = sock.getsockname()[1]
            return chosen
    raise AssertionError("no free port")


def lowest_ephemeral_port() -> int:
    """The lowest port the kernel picks itself (Linux; else IANA's)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def mode_args(args: Sequence[str]) -> tuple[str, ...]:
    """`--workers N` from EMBER_TEST_WORKERS, so a suite runs against the multi-process
    server too (tests/test_server_modes.py), unless the test chose its own mode."""
    workers = os.environ.get(TEST_WORKERS)
    return ("--workers", workers) if workers and "--workers" not in args else ()


def server_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test's environment without EMBER_* settings but the run's cache folder
    (tests/conftest.py), offline, unbuffered."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("EMBER_") or k == "EMBER_CACHE_DIR"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


@dataclass
class ServerProcess:
    """One `python -m ember.cli serve` on 127.0.0.1; its stdout and stderr go to `log`."""

    port: int
    process: subprocess.Popen[bytes]
    log: Path
    args: tuple[str, ...]
    notes: dict[str, Any] = field(default_factory=dict)  # what a fixture measured

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_loaded(self, model: str, timeout: float = 120) -> None:
        """Until `model` is loaded: /readyz waits for the default model only, and a preload
        still loading (an ONNX export, say) would take the cores from what a test times."""
        deadline = time.monotonic() + timeout
        while True:
            state = httpx.get(f"{self.url}/v1/models/{model}", timeout=10).json().get("state")
            if state == "loaded":
                return
            assert state in ("loading", "available") and time.monotonic() < deadline, state
            time.sleep(0.2)

    def log_text(self, since: int = 0) -> str:
        return self.log.read_text(errors="replace")[since:]

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_text()[-chars:]

    def log_size(self) -> int:
        return len(self.log_text())

    def descendants(self) -> list[psutil.Process]:
        """With --workers, the API and engine processes (and whatever they started)."""
        children: list[psutil.Process] = psutil.Process(self.pid).children(recursive=True)
        return children

    def processes(self) -> list[psutil.Process]:
        """The server's process and its descendants."""
        return [psutil.Process(self.pid), *self.descendants()]

    def rss_bytes(self) -> int:
        """Resident memory of every process of the server, summed."""
        return sum(_each(self.processes(), lambda p: p.memory_info().rss))

    def cpu_seconds(self) -> float:
        """User and system CPU time of every process of the server and their threads."""
        return sum(_each(self.processes(), lambda p: sum(p.cpu_times()[:2])))

    def alive(self) -> bool:
        return self.process.poll() is None

    def terminate(self) -> None:
        if self.alive():
            self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout)

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM and wait; killed if it hangs (then None). Safe to call twice."""
        if not self.alive():
            return self.process.returncode
        self.terminate()
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return None


def _each(processes: Sequence[psutil.Process], read: Callable[[psutil.Process], T]) -> list[T]:
    """`read(process)` for each process still there (one may end while it is read)."""
    values = []
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            values.append(read(process))
    return values


def start_server(log: Path, args: Sequence[str], *, env: Mapping[str, str] | None = None,
                 ready_timeout: float = 180, attempts: int = 3,
                 until: Literal["ready", "listening"] = "ready") -> ServerProcess:
    """Start the server on a free port and return once /readyz answers 200, or with
    `until="listening"` once it says it listens, its models perhaps still loading (another
    port if the chosen one was taken in the meantime)."""
    for attempt in range(attempts):
        try:
            return _start_once(log, args, env, ready_timeout, until)
        except PortTaken:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


class PortTaken(AssertionError):
    """The free port was taken between choosing it and binding it."""


def _start_once(log: Path, args: Sequence[str], env: Mapping[str, str] | None,
                ready_timeout: float, until: Literal["ready", "listening"]) -> ServerProcess:
    port = free_port()
    argv = (sys.executable, "-m", "ember.cli", "serve", "--host", "127.0.0.1", "--port",
            str(port), *mode_args(args), *args)
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                   env=server_env(env), cwd=REPO)
    server = ServerProcess(port, process, log, tuple(args))
    deadline = time.monotonic() + ready_timeout
    try:
        while True:
            if not server.alive():
                text = server.log_text()
                if "address already in use" in text.lower():
                    raise PortTaken(f"port {port} taken")
                raise AssertionError(f"server exited with {process.returncode}\n"
                                     f"{text[-4000:]}")
            if until == "listening":
                if "Ember listening on" in server.log_text():
                    return server
            else:
                try:
                    if httpx.get(f"{server.url}/readyz", timeout=5).status_code == 200:
                        return server
                except httpx.TransportError:
                    pass
            if time.monotonic() > deadline:
                raise AssertionError(f"server not ready in {ready_timeout} s\n"
                                     f"{server.log_text()[-4000:]}")
            time.sleep(0.05)
    except BaseException:
        if server.alive():
            process.kill()
            process.wait()
        raise


def children_titled(server: ServerProcess, title: str) -> list[psutil.Process]:
    """The server's child processes whose process title starts with `title`."""
    found = []
    for child in psutil.Process(server.pid).children():
        try:
            if child.cmdline()[:1] and child.cmdline()[0].startswith(title):
                found.append(child)
        except psutil.Error:
            pass  # gone meanwhile
    return found
