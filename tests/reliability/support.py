"""Helpers of the reliability tests: a real `ember serve` process, the error body of
the documented error body, Prometheus samples, model YAMLs and the figures each test writes.

Everything runs on 127.0.0.1 and every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil  # type: ignore[import-untyped]
import yaml

from tests.live_server import ServerProcess, start_server

SYNTH = "ember/synthetic"  # the catalog's TEST model: deterministic vectors, no weights
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
SPACY = "spacy/en_core_web_sm"
# What must never reach a client: a stack trace or a path inside the installation.
LEAKS = ("Traceback", 'File "', "site-packages", "/work/", ".py\"", "/usr/lib", "/root/")
ERROR_KEYS = {"type", "message", "param", "code"}  # code: SIE's name of the type
Record = Callable[[str, dict[str, Any]], Path]  # the `figures` fixture: (name, data) -> file


# -- the server process: tests/live_server.py ------------------------------------------

@dataclass
class ServerPool:
    """Servers a fixture started; `close()` stops every one of them."""

    folder: Path
    servers: list[ServerProcess] = field(default_factory=list)

    def start(self, *args: str, models: Mapping[str, Mapping[str, Any]] | None = None,
              env: Mapping[str, str] | None = None, name: str = "server",
              ready_timeout: float = 180) -> ServerProcess:
        """`models` maps YAML file names to catalog entries, served with --model-dir."""
        index = len(self.servers)
        flags = list(args)
        if models:
            model_dir = self.folder / f"{name}-{index}-models"
            write_models(model_dir, models)
            flags += ["--model-dir", str(model_dir)]
        server = start_server(self.folder / f"{name}-{index}.log", flags, env=env,
                              ready_timeout=ready_timeout)
        self.servers.append(server)
        return server

    def close(self) -> None:
        for server in self.servers:
            server.stop()


def write_models(folder: Path, models: Mapping[str, Mapping[str, Any]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for file_name, entry in models.items():
        (folder / file_name).write_text(yaml.safe_dump(dict(entry), sort_keys=False),
                                        encoding="utf-8")
    return folder


def synthetic_model(name: str, *, dims: int = 16, overhead_ms: float = 2.0,
                    per_token_us: float = 0.0, max_batch_items: int | None = None,
                    tasks: Sequence[str] = ("encode", "score")) -> dict[str, Any]:
    """A catalog entry for the synthetic TEST model (not a real model) with a forward time
    of `overhead_ms + per_token_us x padded words`."""
    entry: dict[str, Any] = {
        "name": name, "description": "synthetic test model (not a real model)",
        "adapter": "synthetic", "tasks": list(tasks),
        "options": {"dims": dims, "overhead_ms": overhead_ms, "per_token_us": per_token_us},
    }
    if max_batch_items is not None:
        entry["batching"] = {"max_batch_items": max_batch_items}
    return entry


# -- what the server answers --------------------------------------------------------------


def assert_no_leak(text: str, extra: Iterable[str] = ()) -> None:
    """No stack trace and no internal path in `text`."""
    for leak in (*LEAKS, *extra):
        assert leak not in text, f"{leak!r} leaked in {text[:500]!r}"


def assert_error(response: httpx.Response, status: int | Sequence[int],
                 kind: str | None = None, param: str | None = None,
                 leaks: Iterable[str] = ()) -> dict[str, Any]:
    """The error body `{"error": {"type", "message", "param"?, "code"}}` with this status,
    no stack trace and no internal path; returns the error object."""
    statuses = (status,) if isinstance(status, int) else tuple(status)
    assert response.status_code in statuses, (response.status_code, response.text[:500])
    return check_error_body(response.headers.get("content-type", ""), response.content,
                            kind, param, leaks)


def check_error_body(content_type: str, content: bytes, kind: str | None = None,
                     param: str | None = None, leaks: Iterable[str] = ()) -> dict[str, Any]:
    assert content_type.startswith("application/json"), content_type
    body = json.loads(content)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) <= ERROR_KEYS, error
    assert {"type", "message"} <= set(error), error
    assert isinstance(error["type"], str) and error["type"], error
    assert isinstance(error["message"], str) and error["message"], error
    assert error.get("param") is None or isinstance(error["param"], str), error
    if kind is not None:
        assert error["type"] == kind, error
    if param is not None:
        assert error.get("param") == param, error
    assert_no_leak(content.decode("utf-8", "replace"), leaks)
    return dict(error)


def dense(body: Mapping[str, Any]) -> list[list[float]]:
    """The vectors of a native encode response."""
    return [item["dense"]["values"] for item in body["items"]]


def encode_body(*texts: str, **params: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"items": [{"text": t} for t in texts]}
    if params:
        body["params"] = params
    return body


WORD_LIST = """search engine query document vector index rank token batch model river
mountain city country paris london music film book coffee weather ocean forest library
garden science history market kitchen bridge station letter window"""
WORDS = WORD_LIST.split()


def text_pool(count: int, seed: int = 7) -> list[str]:
    """Distinct sentences of 2 to 45 words, so batches mix short and long items."""
    rng = random.Random(seed)
    lengths = [2, 3, 5, 8, 12, 20, 30, 45]
    return [f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(lengths[i % len(lengths)]))
            for i in range(count)]


def references(url: str, model: str, texts: Sequence[str]) -> dict[str, np.ndarray]:
    """Each text's vector when sent alone, one sequential request each."""
    refs: dict[str, np.ndarray] = {}
    with httpx.Client(base_url=url, timeout=60) as client:
        for text in texts:
            response = client.post(f"/v1/encode/{model}", json=encode_body(text))
            assert response.status_code == 200, response.text
            refs[text] = np.asarray(dense(response.json())[0], dtype=np.float64)
    return refs


_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels` (0 if none)."""
    total = 0.0
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match.group(1) != name:
            continue
        found = dict(_LABEL.findall(match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(3))
    return total


def scrape(client: httpx.Client, url: str) -> str:
    response = client.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200, response.text
    return response.text


def wait_until(condition: Any, timeout: float, what: str, interval: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached in {timeout} s")
        time.sleep(interval)


def busy_cpu_seconds() -> tuple[float, float]:
    """(CPU seconds the whole machine spent busy, CPU seconds of this test process): with
    the server's own, they tell how much of the machine other processes took."""
    times = psutil.cpu_times()
    busy = sum(times) - times.idle - getattr(times, "iowait", 0.0)
    mine = psutil.Process().cpu_times()
    return float(busy), float(mine.user + mine.system)


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# -- figures ---------------------------------------------------------------------------------


def figures_dir() -> Path | None:
    raw = os.environ.get("EMBER_RELIABILITY_OUT")
    return Path(raw) if raw else None


def write_figures(folder: Path, name: str, data: Mapping[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    payload = {"name": name, **data}
    path.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n",
                    encoding="utf-8")
    return path


def soak_seconds() -> float:
    """Seconds of each load soak: short in CI, EMBER_SOAK_S=60 for the long form."""
    return float(os.environ.get("EMBER_SOAK_S", "5"))


def benchmarks_running() -> list[str]:
    """Command lines of running `bench/` processes other than this one's ancestors (the
    report script runs these tests from bench/ itself) and this test run's own (the
    benchmarks' smoke tests, in the other pytest-xdist process)."""
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    session = _session_root()
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info.get("cmdline") or [])
        if "bench/" in cmdline and proc.info["pid"] not in mine:
            with contextlib.suppress(psutil.Error):
                if session not in {parent.pid for parent in proc.parents()}:
                    found.append(cmdline)
    return found


def _session_root() -> int:
    """The pid of the outermost pytest process above this one (pytest-xdist's controller;
    with the suite's nested rerun, the outer run's), else this process's."""
    root = os.getpid()
    for parent in psutil.Process().parents():
        with contextlib.suppress(psutil.Error):
            if "pytest" in " ".join(parent.cmdline()):
                root = parent.pid
    return root


def wait_for_benchmarks(limit_s: float = 600, poll_s: float = 30) -> float:
    """Shared machine: heavy load waits (up to `limit_s`) for a running benchmark to end so
    its figures are not disturbed. Returns the seconds waited."""
    if os.environ.get("EMBER_RELIABILITY_WAIT_BENCH", "1") == "0":
        return 0.0
    started = time.monotonic()
    while benchmarks_running() and time.monotonic() - started < limit_s:
        time.sleep(poll_s)
    return time.monotonic() - started
