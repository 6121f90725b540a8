"""HTTP load the benchmarks share: `ember serve` on loopback, aiohttp clients (a
sequential client and closed loops), seeded texts, and CPU time over a server's
process tree.

Everything here talks to 127.0.0.1 only, and every server started here is stopped
(SIGTERM, which drains; a kill after 30 s).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from benchlib import Json, percentile

_VOCAB = (
    "the a search engine query returns documents ranked by relevance for each user who "
    "types short questions about weather travel food music science history sports health "
    "money code data model vector index fast slow new old city river mountain book film "
    "price market energy water light small large good better best first last open close "
    "find show read write build test learn teach play work home school office street "
    "garden kitchen window door table chair phone camera screen battery network server "
    "cloud storage memory speed quality review summary answer question example result "
    "between under over during before after because while where when which how why"
)
WORDS = tuple(_VOCAB.split())
SHORT_WORDS = 10  # words in a short text (~13 tokens for MiniLM; 10 for the synthetic model)
JSON_HEADERS = {"content-type": "application/json"}


@dataclass(frozen=True)
class Plan:
    """How much load one measure puts on a server."""

    sequential: int  # requests the sequential client measures (after a few warm-ups)
    warmup_s: float  # closed loop: load before the measured window
    closed_s: float  # closed loop: the measured window


def texts(kind: str, count: int, seed: int = 7) -> list[str]:
    """Short texts (10 words), mixed lengths (5-120 words) or long ones (300-400 words,
    past a 256-token limit: cut to it), seeded."""
    rng = random.Random(f"{kind}/{seed}")
    out = []
    for _ in range(count):
        n = (SHORT_WORDS if kind == "short" else rng.randint(300, 400) if kind == "long"
             else rng.randint(5, 120))
        out.append(" ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + ".")
    return out


def encode_bodies(kind: str, count: int, per_request: int = 1) -> list[bytes]:
    """`count` JSON bodies for /v1/encode, each with `per_request` texts."""
    pool = texts(kind, count * per_request)
    return [json.dumps({"items": [{"text": t} for t in pool[i:i + per_request]]}).encode()
            for i in range(0, len(pool), per_request)]


# -- the server ------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`ember serve` in a child process on 127.0.0.1 at a free port.

    `serve_args` are appended to the serve command; `pythonpath` puts another source
    tree of Ember first (e.g. the landed code, for a same-sitting comparison)."""

    def __init__(self, serve_args: Sequence[str], log: Path, *, pythonpath: str | None = None,
                 env: Mapping[str, str] | None = None,
                 program: Sequence[str] = ("-m", "ember.cli", "serve")) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.command = [sys.executable, *program, "--host", "127.0.0.1",
                        "--port", str(self.port), "--log-level", "warning", *serve_args]
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        if pythonpath:
            self.env["PYTHONPATH"] = os.pathsep.join(
                p for p in (pythonpath, os.environ.get("PYTHONPATH", "")) if p)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError("the server was not started")
        return self.process.pid

    def start(self) -> Server:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            env=self.env)
        return self

    def _log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = 180.0) -> float:
        """Seconds until GET /readyz answered 200; raises if the server exits or is late."""
        waited = poll_ready(f"{self.url}/readyz", self.process, timeout_s)
        if waited is None:
            code = None if self.process is None else self.process.returncode
            raise RuntimeError(f"ember serve exited with {code}:\n{self._log_tail()}")
        return waited

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (the server drains), then a kill if it outlives `timeout_s`."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- CPU over a process tree -------------------------------------------------------------------

def process_label(cmdline: Sequence[str]) -> str:
    """A command line, short: the interpreter's base name, without --host/--port."""
    if not cmdline:
        return "?"
    words = [Path(cmdline[0]).name]
    skip = False
    for word in cmdline[1:]:
        if skip:
            skip = False
        elif word in ("--host", "--port"):
            skip = True
        else:
            words.append(word)
    label = " ".join(words)
    return label if len(label) <= 90 else label[:87] + "..."


def tree_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system, all threads) of `pid` and all its descendants, by pid,
    each with its label (its command line)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return {}
    out: dict[int, tuple[str, float]] = {}
    for proc in procs:
        try:
            with proc.oneshot():
                times = proc.cpu_times()
                out[proc.pid] = (process_label(proc.cmdline()), times.user + times.system)
        except psutil.Error:
            continue
    return out


def tree_cpu_seconds(pid: int | None) -> float:
    """CPU seconds of `pid`'s whole process tree (NaN for a server not started here)."""
    if pid is None:
        return float("nan")
    return sum(cpu for _, cpu in tree_cpu(pid).values())


def tree_cpu_delta(before: Mapping[int, tuple[str, float]],
                   after: Mapping[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each process spent between two `tree_cpu` snapshots, by label (in pid
    order; a label seen twice gets `#2`, `#3`). A process born in between counts from 0;
    one that ended in between is lost (its time is not known)."""
    out: dict[str, float] = {}
    for pid in sorted(after):
        label, cpu = after[pid]
        start = before.get(pid, (label, 0.0))[1]
        key, n = label, 1
        while key in out:
            n += 1
            key = f"{label} #{n}"
        out[key] = cpu - start
    return out


# -- the client --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sample:
    latency_ms: float
    queue_ms: float  # X-Queue-Time-Ms
    inference_ms: float  # X-Inference-Time-Ms


def client_session(connections: int, timeout_s: float = 120.0) -> Any:
    """An aiohttp session with room for `connections` keep-alive connections."""
    import aiohttp

    # Idle connections are let go well before uvicorn closes them (5 s), so no request
    # is written to a connection the server is closing at that moment.
    connector = aiohttp.TCPConnector(limit=connections, limit_per_host=connections,
                                     force_close=False, keepalive_timeout=2.0)
    return aiohttp.ClientSession(connector=connector,
                                 timeout=aiohttp.ClientTimeout(total=timeout_s))


async def post(session: Any, url: str, body: bytes,
               headers: Mapping[str, str] = JSON_HEADERS) -> Sample:
    """One POST; the body is read (not parsed). Anything but 200 raises."""
    t0 = time.perf_counter()
    async with session.post(url, data=body, headers=headers) as response:
        payload = await response.read()
        latency = (time.perf_counter() - t0) * 1000
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {payload[:300]!r}")
        return Sample(latency, float(response.headers.get("x-queue-time-ms", "nan")),
                      float(response.headers.get("x-inference-time-ms", "nan")))


async def sequential(session: Any, url: str, payloads: Sequence[bytes], n: int,
                     warmup: int = 5) -> Json:
    """One client, one request at a time: latency and the server's own times."""
    samples = [await post(session, url, payloads[i % len(payloads)])
               for i in range(n + warmup)][warmup:]
    lat = [s.latency_ms for s in samples]
    queue = [s.queue_ms for s in samples]
    return {"requests": n, "latency_p50_ms": percentile(lat, 50),
            "latency_p99_ms": percentile(lat, 99), "queue_p50_ms": percentile(queue, 50),
            "queue_p99_ms": percentile(queue, 99),
            "inference_p50_ms": percentile([s.inference_ms for s in samples], 50)}


Snapshot = Callable[[], Awaitable[Json]]


@dataclass
class ClosedLoop:
    """What a closed loop measured in its window."""

    clients: int
    duration_s: float
    latencies_ms: list[float]
    queue_ms: list[float]
    requests_per_s: float  # by Little's law, client by client
    client_cpu_s: float  # this process's CPU time in the window
    marks: dict[str, Json] = field(default_factory=dict)  # snapshots at begin and end

    def summary(self) -> Json:
        lat = self.latencies_ms
        return {"requests": len(lat), "requests_per_s": self.requests_per_s,
                "completed_per_s": len(lat) / self.duration_s,
                "latency_p50_ms": percentile(lat, 50), "latency_p99_ms": percentile(lat, 99),
                "queue_p50_ms": percentile(self.queue_ms, 50),
                "client_cpu_cores": self.client_cpu_s / self.duration_s}


async def closed_loop(session: Any, url: str, payloads: Sequence[bytes], clients: int,
                      warmup_s: float, duration_s: float,
                      snapshot: Snapshot | None = None) -> ClosedLoop:
    """`clients` senders, each sending its next request as soon as its last one came
    back, for `warmup_s` then a measured window of `duration_s`. `snapshot` (if given) is
    taken at the window's begin and end (server CPU, counters)."""
    lat: list[float] = []
    queue: list[float] = []
    counter = iter(range(10**12))
    begin = time.perf_counter() + warmup_s
    end = begin + duration_s
    marks: dict[str, Json] = {}
    client_cpu: dict[str, float] = {}

    async def mark(key: str, at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        client_cpu[key] = time.process_time()
        marks[key] = await snapshot() if snapshot is not None else {}

    cycles: list[list[float]] = []  # per client: send-to-next-send times in the window

    async def one() -> None:
        mine: list[float] = []
        cycles.append(mine)
        while (sent := time.perf_counter()) < end:
            sample = await post(session, url, payloads[next(counter) % len(payloads)])
            done = time.perf_counter()
            if begin <= done <= end:
                lat.append(sample.latency_ms)
                queue.append(sample.queue_ms)
            if begin <= sent and done < end:
                mine.append(done - sent)

    markers = asyncio.gather(mark("begin", begin), mark("end", end))
    await asyncio.gather(*(one() for _ in range(clients)))
    await markers
    # Throughput by Little's law, client by client (1 / mean cycle time): a forward's
    # requests finish together, so counting completions in a window moves in whole batches.
    rate = sum(len(c) / sum(c) for c in cycles if c)
    return ClosedLoop(clients, duration_s, lat, queue, rate,
                      client_cpu["end"] - client_cpu["begin"], marks)


# -- the server's counters -----------------------------------------------------------------------

_BATCH_METRIC = re.compile(
    r'^(ember_batch_(?:items|requests)_(?:count|sum))\{model="([^"]*)"\} (\S+)$')


async def batch_counters(session: Any, base: str, model: str) -> dict[str, float]:
    """Forwards, items and requests the server counted for `model` (GET /metrics)."""
    async with session.get(f"{base}/metrics") as response:
        text = await response.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _BATCH_METRIC.match(line)
        if m and m.group(2) == model:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def batch_deltas(before: Mapping[str, float], after: Mapping[str, float]) -> Json:
    """Forwards, items per forward and forwards per request between two counter reads."""
    def delta(key: str) -> float:
        return after.get(key, float("nan")) - before.get(key, float("nan"))

    forwards = delta("ember_batch_items_count")
    ok = forwards == forwards and forwards > 0
    return {"forwards": forwards,
            "items_per_forward": delta("ember_batch_items_sum") / forwards if ok
            else float("nan"),
            "forwards_per_request": forwards / delta("ember_batch_requests_sum") if ok
            else float("nan")}


def poll_ready(url: str, process: subprocess.Popen[bytes] | None, timeout_s: float,
               every_s: float = 0.2) -> float | None:
    """Seconds until GET `url` answered 200; None if `process` exited (or never started)
    first; TimeoutError after `timeout_s`."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if process is None or process.poll() is not None:
            return None
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return time.perf_counter() - t0
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(every_s)
    raise TimeoutError(f"{url} not ready after {timeout_s} s")
