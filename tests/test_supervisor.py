"""`ember serve --workers N` as a whole: API processes that die are replaced, /metrics
reports every process, a Ctrl-C drains the tree, and the API and reliability suites
pass against it as they do against one process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil  # type: ignore[import-untyped]
import pytest

from tests.live_server import REPO, TEST_WORKERS, ServerProcess, server_env, start_server

SYNTH = "ember/synthetic"


def api_pids(server: ServerProcess) -> set[int]:
    """The supervisor's children that serve HTTP, by their process titles."""
    pids = set()
    for child in psutil.Process(server.pid).children():
        try:
            if child.cmdline()[:1] and child.cmdline()[0].startswith("ember: api"):
                pids.add(child.pid)
        except psutil.Error:
            pass  # gone meanwhile
    return pids


def encode(url: str, text: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/encode/{SYNTH}", json={"items": [{"text": text}]}, timeout=30)


@pytest.fixture
def two_api_processes(tmp_path: Path) -> Iterator[ServerProcess]:
    server = start_server(tmp_path / "server.log", ["--default-model", SYNTH,
                                                    "--workers", "2"])
    deadline = time.monotonic() + 60
    while len(api_pids(server)) < 2:
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.1)
    yield server
    server.stop()


def test_a_dead_api_process_is_replaced_and_service_goes_on(
        two_api_processes: ServerProcess) -> None:
    server = two_api_processes
    before = api_pids(server)
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:
        now = api_pids(server)
        if victim not in now and len(now) == 2:
            break
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.1)
    assert now - before, "no new API process was started"
    for i in range(20):  # served by whichever processes accept now
        assert encode(server.url, f"after the death {i}").status_code == 200
    assert re.search(rf"API process {victim} died \(exit code -9\)", server.log_text())


def test_requests_in_flight_on_a_killed_api_process_fail_cleanly(
        two_api_processes: ServerProcess, tmp_path: Path) -> None:
    server = two_api_processes
    outcomes: list[str] = []

    def one(i: int) -> None:
        try:
            response = encode(server.url, f"in flight {i}")
            outcomes.append(str(response.status_code))
        except httpx.TransportError as exc:  # the connection died with its process
            outcomes.append(type(exc).__name__)

    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(one, i) for i in range(400)]
        time.sleep(0.2)
        os.kill(min(api_pids(server)), signal.SIGKILL)
        for future in futures:
            future.result()
    assert set(outcomes) <= {"200", "ReadError", "RemoteProtocolError", "ConnectError"}, \
        outcomes
    assert outcomes.count("200") > 300
    assert encode(server.url, "still serving").status_code == 200
    assert server.alive()


def test_metrics_report_every_process(two_api_processes: ServerProcess) -> None:
    server = two_api_processes
    for i in range(30):
        assert encode(server.url, f"counted {i}").status_code == 200
    text = httpx.get(f"{server.url}/metrics").text
    requests = re.search(rf'ember_requests_total{{model="{SYNTH}",route="/v1/encode/'
                         r'{model:path}",status="200"} ([\d.]+)', text)
    items = re.search(rf'ember_batch_items_sum{{model="{SYNTH}"}} ([\d.]+)', text)
    assert requests and float(requests.group(1)) >= 30, text  # from the API processes
    assert items and float(items.group(1)) >= 30, text  # from the engine process
    assert re.search(rf'ember_pending_items{{model="{SYNTH}"}} 0\.0', text), text


def test_ctrl_c_drains_every_process_then_exits_0(two_api_processes: ServerProcess) -> None:
    server = two_api_processes
    children = psutil.Process(server.pid).children(recursive=True)
    assert encode(server.url, "before the signal").status_code == 200
    server.process.send_signal(signal.SIGINT)
    assert server.process.wait(60) == 0, server.log_tail()
    assert "engine drained" in server.log_text()
    _, alive = psutil.wait_procs(children, timeout=10)  # helpers leave once it is gone
    assert not [c for c in alive if c.status() != psutil.STATUS_ZOMBIE], alive


def test_a_taken_port_is_one_line_and_exit_1(two_api_processes: ServerProcess) -> None:
    taken = two_api_processes.port
    result = subprocess.run(
        [sys.executable, "-m", "ember.cli", "serve", "--port", str(taken), "--workers", "2",
         "--default-model", SYNTH], capture_output=True, text=True, timeout=60,
        env=server_env(), cwd=REPO)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert re.search(rf"cannot listen on 127\.0\.0\.1:{taken}: Address already in use",
                     result.stderr), result.stderr


SUITES = ["tests/api/test_server_e2e.py", "tests/reliability"]


def test_the_server_suites_pass_against_api_processes() -> None:
    """The end-to-end and reliability suites again, every server they start with
    `--workers 2` (tests/live_server.py reads EMBER_TEST_WORKERS)."""
    env = {**os.environ, TEST_WORKERS: "2"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             *SUITES], capture_output=True, text=True, env=env, cwd=REPO,
                            timeout=1500)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert re.search(r"\d+ passed", summary) and "failed" not in summary, summary


def test_a_dead_engine_stops_the_server_with_exit_1(two_api_processes: ServerProcess) -> None:
    server = two_api_processes
    engine = [c for c in psutil.Process(server.pid).children()
              if c.cmdline()[:1] == ["ember: engine"]]
    assert len(engine) == 1
    engine[0].kill()
    assert server.process.wait(60) == 1, server.log_tail()
    assert "the engine process died" in server.log_text()
