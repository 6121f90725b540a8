"""An autoscaled engine (`--min-replicas 1 --max-replicas 2`, delays of seconds): load
brings a second replica, idleness takes it away; then a hang-up (SIGHUP) drains the
application with requests in flight, every one answered, and the server exits 0. (SIGTERM
takes the same path; tests/cluster/conftest.py's server exits 0 on it.)"""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from ember.adapters.synthetic import SyntheticAdapter
from tests.api.conftest import BUSY, SLOW, encode_body, vectors
from tests.cluster.conftest import (
    engine_replicas,
    start_ray_server,
    stop_ray_server,
    wait_replicas,
)
from tests.live_server import ServerProcess

SLOW_DIMS = 16


@pytest.fixture(scope="module")
def autoscaled(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("autoscaled") / "server.log"
    server = start_ray_server(log, [
        "--model-dir", str(model_dir), "--default-model", BUSY, "--preload", SLOW,
        "--min-replicas", "1", "--max-replicas", "2", "--target-ongoing-requests", "2",
        "--upscale-delay-s", "1", "--downscale-delay-s", "3"])
    try:
        yield server
    finally:
        stop_ray_server(server)


def test_autoscaling_goes_from_1_to_2_replicas_under_load_and_back_when_idle(
        autoscaled: ServerProcess) -> None:
    wait_replicas(autoscaled, 1, 30)
    stop = threading.Event()
    statuses: list[int] = []

    def client() -> None:
        with httpx.Client() as http:
            while not stop.is_set():
                response = http.post(f"{autoscaled.url}/v1/encode/{BUSY}",
                                     json=encode_body("keep busy"), timeout=60)
                statuses.append(response.status_code)

    with ThreadPoolExecutor(12) as pool:
        clients = [pool.submit(client) for _ in range(12)]
        try:  # 12 requests ongoing against a target of 2 a replica: scale up
            wait_replicas(autoscaled, 2, 60)
        finally:
            stop.set()
        for future in clients:
            future.result()
    assert statuses and set(statuses) == {200}, set(statuses)
    wait_replicas(autoscaled, 1, 60)  # idle: back to the minimum
    with httpx.Client() as http:
        assert http.post(f"{autoscaled.url}/v1/encode/{BUSY}", json=encode_body("after"),
                         timeout=60).status_code == 200


def test_sighup_drains_every_accepted_request_then_exits_0(
        autoscaled: ServerProcess) -> None:
    """Eight requests of 300 ms forwards, one item each, are in flight when the signal
    comes: the ingress finishes them on the engine replicas, which stop only after. A
    request that arrives during the drain is served (the ingress still took it) or gets
    503 with Retry-After, never Ray's 404 (found by a review: the ingress's route went
    first)."""
    reference = SyntheticAdapter(dims=SLOW_DIMS)
    # The autoscaling test before this one leaves it scaling down to its one replica.
    wait_replicas(autoscaled, 1, timeout=60)
    since = autoscaled.log_size()
    during: Counter[str] = Counter()

    def arrive_during_the_drain() -> None:
        with httpx.Client() as http:
            while autoscaled.process.poll() is None:
                try:
                    response = http.post(f"{autoscaled.url}/v1/encode/{BUSY}",
                                         json=encode_body("late"), timeout=30)
                except httpx.TransportError:  # the proxy is gone: the server is ending
                    break
                if response.status_code == 503:
                    assert response.headers.get("Retry-After") == "5", response.headers
                    assert response.json()["error"]["type"] == "unavailable", response.text
                during[str(response.status_code)] += 1
                time.sleep(0.1)

    with ThreadPoolExecutor(9) as pool:
        futures = [pool.submit(httpx.post, f"{autoscaled.url}/v1/encode/{SLOW}",
                               json=encode_body(f"in flight {i}"), timeout=120)
                   for i in range(8)]
        time.sleep(0.5)  # all accepted: at most two of them are done by now
        assert sum(future.done() for future in futures) <= 2
        autoscaled.process.send_signal(signal.SIGHUP)
        late = pool.submit(arrive_during_the_drain)
        for i, future in enumerate(futures):
            response = future.result()
            assert response.status_code == 200, response.text
            np.testing.assert_allclose(vectors(response.json())[0],
                                       reference.vector(f"in flight {i}"), atol=1e-6)
        assert autoscaled.wait(90) == 0, autoscaled.log_tail()
        late.result()
    assert set(during) <= {"200", "503"} and during["503"] > 0, during
    log = autoscaled.log_text(since)
    assert "SIGHUP: draining the application" in log and "drained in" in log, log[-4000:]
    assert not engine_replicas(autoscaled)
