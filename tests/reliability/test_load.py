"""Load and overload against a real `ember serve` process.

Soak: the default model (sentence-transformers/all-MiniLM-L6-v2 on CPU) at 32 and at 128
requests in flight for EMBER_SOAK_S seconds each (5 in CI; the long form is
`EMBER_SOAK_S=60`, see docs/reliability.md). No error but deliberate 429s, every vector
equal (within 1e-5) to the vector of its text sent alone, server RSS growth bounded.

Overload: a synthetic TEST model behind a queue of 16 items takes a burst of 200
requests: the excess gets 429 with Retry-After, every accepted request is answered
correctly, and full service resumes once the burst is over.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import pytest

from tests.reliability.support import (
    MINILM,
    Record,
    ServerPool,
    ServerProcess,
    assert_error,
    busy_cpu_seconds,
    dense,
    encode_body,
    metric,
    percentile,
    references,
    scrape,
    soak_seconds,
    synthetic_model,
    text_pool,
    wait_for_benchmarks,
    wait_until,
)

TOLERANCE = 1e-5  # max |difference| of a component, batched vs alone
RSS_GROWTH_BOUND = 384 * 1024 * 1024  # generous: allocator arenas and torch caches settle
@dataclass
class Tally:
    """What a run of clients saw."""

    statuses: Counter[int] = field(default_factory=Counter)
    latencies_ms: list[float] = field(default_factory=list)
    items_ok: int = 0
    wrong: int = 0
    worst_diff: float = 0.0
    retry_after: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)

    def check(self, response: httpx.Response, texts: Sequence[str],
              refs: Mapping[str, np.ndarray], route: str) -> None:
        self.statuses[response.status_code] += 1
        if response.status_code == 200:
            body = response.json()
            if route == "openai":
                got = [d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])]
            else:
                got = dense(body)
            if len(got) != len(texts):
                self.wrong += 1
                return
            for text, vector in zip(texts, got, strict=True):
                diff = float(np.max(np.abs(np.asarray(vector) - refs[text])))
                self.worst_diff = max(self.worst_diff, diff)
                if diff > TOLERANCE:
                    self.wrong += 1
            self.items_ok += len(texts)
        elif response.status_code == 429:
            assert_error(response, 429, "queue_full")
            self.retry_after.add(response.headers.get("retry-after", "<missing>"))
        else:
            self.errors.append(f"{response.status_code}: {response.text[:200]}")
ENCODE_ROUTE = "/v1/encode/{model:path}"  # the route label of the metrics


async def post_texts(client: httpx.AsyncClient, model: str, texts: Sequence[str],
                     route: str) -> httpx.Response:
    if route == "openai":
        return await client.post("/v1/embeddings", json={"model": model, "input": list(texts)})
    return await client.post(f"/v1/encode/{model}", json=encode_body(*texts))


async def soak(url: str, model: str, refs: Mapping[str, np.ndarray], concurrency: int,
               seconds: float, seed: int) -> tuple[Tally, float]:
    """`concurrency` closed-loop clients for `seconds`: 1-4 texts a request, a quarter on
    the OpenAI route. Returns the tally and the wall time."""
    tally = Tally()
    pool = list(refs)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        started = time.perf_counter()
        deadline = started + seconds

        async def client_loop(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            while time.perf_counter() < deadline:
                texts = rng.sample(pool, rng.randint(1, 4))
                route = "openai" if rng.random() < 0.25 else "native"
                sent = time.perf_counter()
                try:
                    response = await post_texts(client, model, texts, route)
                except httpx.HTTPError as exc:
                    tally.errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                tally.latencies_ms.append((time.perf_counter() - sent) * 1e3)
                tally.check(response, texts, refs, route)

        await asyncio.gather(*(client_loop(i) for i in range(concurrency)))
        return tally, time.perf_counter() - started


# -- the soak on the default model ---------------------------------------------------------


@pytest.fixture(scope="module")
def minilm_server(module_servers: ServerPool) -> ServerProcess:
    """The real server on its default model, as a user starts it (no model flags)."""
    waited = wait_for_benchmarks()
    server = module_servers.start(name="minilm")
    server.notes["waited_for_benchmark_s"] = round(waited, 1)
    return server


@pytest.fixture(scope="module")
def minilm_refs(minilm_server: ServerProcess) -> dict[str, np.ndarray]:
    return references(minilm_server.url, MINILM, text_pool(36))


# The mode rerun soaks at 128 in flight alone: the same path, harder.
@pytest.mark.parametrize("concurrency", [pytest.param(32, marks=pytest.mark.one_mode), 128])
async def test_soak_default_model(minilm_server: ServerProcess,
                                  minilm_refs: dict[str, np.ndarray], concurrency: int,
                                  figures: Record) -> None:
    seconds = soak_seconds()
    with httpx.Client() as client:
        before = scrape(client, minilm_server.url)
    rss_start = minilm_server.rss_bytes()
    cpu_start = minilm_server.cpu_seconds()
    busy_start, mine_start = busy_cpu_seconds()
    load_start = os.getloadavg()[0]
    samples: list[int] = []

    async def sample_rss() -> None:
        while True:
            samples.append(minilm_server.rss_bytes())
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample_rss())
    tally, wall = await soak(minilm_server.url, MINILM, minilm_refs, concurrency, seconds,
                             seed=concurrency)
    sampler.cancel()
    rss_end = minilm_server.rss_bytes()
    server_cpu = minilm_server.cpu_seconds() - cpu_start
    busy_end, mine_end = busy_cpu_seconds()
    other_cores = (busy_end - busy_start - server_cpu - (mine_end - mine_start)) / wall
    load_end = os.getloadavg()[0]
    with httpx.Client() as client:
        after = scrape(client, minilm_server.url)
        assert client.get(f"{minilm_server.url}/healthz").status_code == 200
    forwards = (metric(after, "ember_batch_items_count", model=MINILM)
                - metric(before, "ember_batch_items_count", model=MINILM))
    items_forwarded = (metric(after, "ember_batch_items_sum", model=MINILM)
                       - metric(before, "ember_batch_items_sum", model=MINILM))
    requests = sum(tally.statuses.values())
    data: dict[str, Any] = {
        "model": MINILM, "concurrency": concurrency, "seconds": round(wall, 1),
        "requests": requests, "statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
        "transport_or_other_errors": len(tally.errors), "wrong_vectors": tally.wrong,
        "worst_abs_diff_vs_alone": tally.worst_diff, "tolerance": TOLERANCE,
        "items_ok": tally.items_ok, "items_per_s": round(tally.items_ok / wall, 1),
        "requests_per_s": round(requests / wall, 1),
        "latency_ms": {"p50": round(percentile(tally.latencies_ms, 0.5), 1),
                       "p95": round(percentile(tally.latencies_ms, 0.95), 1),
                       "p99": round(percentile(tally.latencies_ms, 0.99), 1),
                       "max": round(max(tally.latencies_ms, default=0.0), 1)},
        "forwards": int(forwards),
        "mean_items_per_forward": round(items_forwarded / forwards, 1) if forwards else 0,
        "rss_mb_start": round(rss_start / 2**20, 1), "rss_mb_end": round(rss_end / 2**20, 1),
        "rss_mb_peak": round(max([rss_end, *samples]) / 2**20, 1),
        "rss_growth_mb": round((rss_end - rss_start) / 2**20, 1),
        "rss_growth_bound_mb": RSS_GROWTH_BOUND / 2**20,
        "waited_for_benchmark_s": minilm_server.notes.get("waited_for_benchmark_s", 0.0),
        "server_cpu_cores": round(server_cpu / wall, 2), "machine_cores": os.cpu_count(),
        "client_cpu_cores": round((mine_end - mine_start) / wall, 2),
        "other_processes_cpu_cores": round(max(0.0, other_cores), 2),
        "loadavg_1m": [round(load_start, 2), round(load_end, 2)],
    }
    figures(f"load_soak_{concurrency}", data)
    assert tally.errors == [], tally.errors[:5]
    assert set(tally.statuses) <= {200, 429}, tally.statuses
    assert tally.wrong == 0, data
    assert tally.statuses[200] > 0
    assert tally.items_ok == int(items_forwarded), "every forwarded item reached a client"
    assert rss_end - rss_start < RSS_GROWTH_BOUND, data
    assert metric(after, "ember_pending_items", model=MINILM) == 0


# -- overload past the queue limit ---------------------------------------------------------


async def test_overload_gets_429_then_full_service(servers: ServerPool,
                                                   figures: Record) -> None:
    model = "test/busy"
    server = servers.start(
        "--default-model", model, "--max-queue-items", "16",
        models={"busy.yaml": synthetic_model(model, overhead_ms=40, max_batch_items=8)},
        name="overload")
    refs = references(server.url, model, text_pool(12, seed=3))
    pool = list(refs)
    burst_size = 200
    with httpx.Client() as sync:
        before = scrape(sync, server.url)
    limits = httpx.Limits(max_connections=burst_size, max_keepalive_connections=burst_size)
    async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
        rng = random.Random(11)
        bodies = [rng.sample(pool, 2) for _ in range(burst_size)]
        started = time.perf_counter()
        burst = Tally()
        results = await asyncio.gather(
            *(post_texts(client, model, texts, "native") for texts in bodies),
            return_exceptions=True)
        burst_s = time.perf_counter() - started
        for texts, result in zip(bodies, results, strict=True):
            if isinstance(result, BaseException):
                burst.errors.append(f"{type(result).__name__}: {result}")
            else:
                burst.check(result, texts, refs, "native")

        with httpx.Client() as sync:
            wait_until(lambda: metric(scrape(sync, server.url), "ember_pending_items",
                                      model=model) == 0, 10, "queue empty after the burst")
        # Full service again: waves within the limit (6 requests x 2 items < 16) all pass.
        recovered = Tally()
        recover_started = time.perf_counter()
        for _ in range(5):
            wave = [rng.sample(pool, 2) for _ in range(6)]
            answers = await asyncio.gather(*(post_texts(client, model, t, "native")
                                             for t in wave))
            for texts, response in zip(wave, answers, strict=True):
                recovered.check(response, texts, refs, "native")
        recover_s = time.perf_counter() - recover_started

    with httpx.Client() as sync:
        after = scrape(sync, server.url)
    rejected = (metric(after, "ember_rejections_total", reason="queue_full")
                - metric(before, "ember_rejections_total", reason="queue_full"))
    served = (metric(after, "ember_requests_total", route=ENCODE_ROUTE, status="200")
              - metric(before, "ember_requests_total", route=ENCODE_ROUTE, status="200"))
    accepted = burst_size - burst.statuses[429]
    data = {
        "model": f"{model} (synthetic test model, 40 ms forwards, 8 items per forward)",
        "max_queue_items": 16, "burst_requests": burst_size, "items_per_request": 2,
        "burst_seconds": round(burst_s, 2),
        "burst_statuses": {str(k): v for k, v in sorted(burst.statuses.items())},
        "accepted": accepted, "answered_correctly": burst.statuses[200] - burst.wrong,
        "retry_after_values": sorted(burst.retry_after),
        "server_counted_queue_full": int(rejected),
        "after_burst_requests": sum(recovered.statuses.values()),
        "after_burst_statuses": {str(k): v for k, v in sorted(recovered.statuses.items())},
        "after_burst_seconds": round(recover_s, 2),
        "transport_errors": len(burst.errors) + len(recovered.errors),
    }
    figures("load_overload", data)
    assert burst.errors == [] and recovered.errors == [], (burst.errors + recovered.errors)[:5]
    assert set(burst.statuses) <= {200, 429}, burst.statuses
    assert burst.statuses[429] > 0, "the burst never passed the queue limit"
    assert burst.statuses[200] > 0
    assert all(value.isdigit() and int(value) > 0 for value in burst.retry_after), data
    assert burst.wrong == 0 and recovered.wrong == 0
    assert int(rejected) == burst.statuses[429]
    # Nothing accepted was lost: every request not refused with 429 got its vectors.
    assert burst.statuses[200] == accepted
    assert recovered.statuses == Counter({200: 30})
    assert int(served) == burst.statuses[200] + 30
