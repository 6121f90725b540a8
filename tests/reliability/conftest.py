"""Fixtures of the reliability tests: real `ember serve` processes on 127.0.0.1 at free
ports, each stopped at the end of its scope however the test ends, and the folder the
tests write their figures to (EMBER_RELIABILITY_OUT, else a temporary folder).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.reliability.support import (
    SYNTH,
    Record,
    ServerPool,
    ServerProcess,
    figures_dir,
    synthetic_model,
    write_figures,
)

_durations: dict[str, float] = {}
_outcomes: dict[str, str] = {}
_LOADED = time.monotonic()  # collection time: close enough to the session start


@pytest.fixture(scope="session")
def figures_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return figures_dir() or tmp_path_factory.mktemp("reliability-figures")


@pytest.fixture
def figures(figures_root: Path) -> Record:
    """`figures(name, data)` writes the test's measured figures as JSON."""

    def record(name: str, data: dict[str, Any]) -> Path:
        return write_figures(figures_root, name, data)

    return record


def _pool(folder: Path) -> Iterator[ServerPool]:
    pool = ServerPool(folder)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[ServerPool]:
    """Start servers with `servers.start(*flags, models=...)`; all stop after the test."""
    yield from _pool(tmp_path)


@pytest.fixture(scope="module")
def module_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerPool]:
    yield from _pool(tmp_path_factory.mktemp("servers"))


@pytest.fixture(scope="session")
def session_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerPool]:
    yield from _pool(tmp_path_factory.mktemp("servers"))


@pytest.fixture(scope="session")
def input_server(session_servers: ServerPool) -> ServerProcess:
    """For hostile input: the synthetic TEST model as the default (fast, no weights), the
    real all-MiniLM-L6-v2 and spaCy models loaded on first use, a 1 MB body limit."""
    models = {"slow.yaml": synthetic_model("test/slow", overhead_ms=50)}
    return session_servers.start("--default-model", SYNTH, "--max-body-bytes", "1000000",
                                 models=models, name="input")


# -- run time per test, written next to the figures when EMBER_RELIABILITY_OUT is set ----------


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration
    if report.when == "call" or report.outcome != "passed":
        outcome: str = "xfailed" if hasattr(report, "wasxfail") else report.outcome
        if report.when == "teardown" and outcome == "failed":
            outcome = "error"
        _outcomes[report.nodeid] = outcome


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    folder = figures_dir()
    if folder is None or not _outcomes:
        return
    folder.mkdir(parents=True, exist_ok=True)
    data = {"total_s": round(time.monotonic() - _LOADED, 1), "exit_status": int(exitstatus),
            "tests": {k: {"seconds": round(_durations.get(k, 0.0), 2), "outcome": v}
                      for k, v in sorted(_outcomes.items())}}
    (folder / "_session.json").write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
