#!/usr/bin/env python
"""End-to-end benchmark: a load generator against `ember serve`, beside the limit
of the same model called directly, in one run.

The script starts `ember serve` itself on 127.0.0.1 (a free port) with the real
default model, unless `--url` names a running server. The same model is also
served under two more names that differ only in their batching settings (the
catalog's `batching:` field), so the dispatch policies run against one server,
interleaved: `default`, `earlier` (hold_lone_idle_requests) and `idle0`
(idle_coalesce_ms=0).

Phases run one after another, never at once (they would share the cores):
1. the in-process limit, in a child process: the model loaded through
   `ember.config.load_catalog()` and `ember.registry.adapter_loader`, tokenize +
   forward on the same texts: single-text latency; throughput over batch sizes;
2. the server: a sequential client (latency and the server's X-Queue-Time-Ms),
   then closed loops at 8 and 32 in flight with short texts and with mixed
   lengths (5-120 words, fixed seed), policies interleaved per repetition;
3. the limit again, to bracket the machine's drift.

    python bench/http.py                  # full run, ~5 min on 2 cores
    python bench/http.py --quick          # smoke run, ~20 s (two model loads)
    python bench/http.py --device cuda    # the CUDA fp16 path (see bench/gpu.sh)
    python bench/http.py --report docs/bench/http.json   # tables only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# This file is named http.py: keep its folder off the front of the path, or it would
# shadow the standard library's `http` for httpx and everything else.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE] + [str(HERE)]

import benchlib  # noqa: E402
from benchlib import Json, fmt_spread, median, percentile, spread, table  # noqa: E402

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
POLICY_BATCHING: dict[str, dict[str, Any]] = {
    "default": {},
    "earlier": {"hold_lone_idle_requests": True},
    "idle0": {"idle_coalesce_ms": 0.0},
    "returning": {"hold_for_returning_senders": True},
    "merge": {"hold_for_returning_senders": True, "drain_hold_ms": 2.0},
    "merge10": {"hold_for_returning_senders": True, "drain_hold_ms": 10.0},
}
POLICY_LABELS = {
    "default": "default (R3)",
    "earlier": "earlier rule (hold_lone_idle_requests)",
    "idle0": "idle_coalesce_ms=0",
    "returning": "R3d (hold_for_returning_senders)",
    "merge": "R3d + R4b (drain_hold_ms=2)",
    "merge10": "R3d + R4b (drain_hold_ms=10)",
}
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


@dataclass(frozen=True)
class Plan:
    sequential: int
    warmup_s: float
    short_s: float
    mixed_s: float
    limit_single: int
    limit_short: int
    limit_mixed: int
    limit_mixed_single: int
    limit_warmup: int
    limit_budget_s: float  # the most one limit measure may take


FULL = Plan(sequential=60, warmup_s=0.3, short_s=3.0, mixed_s=4.0, limit_single=60,
            limit_short=256, limit_mixed=128, limit_mixed_single=32, limit_warmup=3,
            limit_budget_s=4.0)
QUICK = Plan(sequential=5, warmup_s=0.1, short_s=0.4, mixed_s=0.4, limit_single=4,
             limit_short=16, limit_mixed=8, limit_mixed_single=2, limit_warmup=1,
             limit_budget_s=1.0)


def texts(kind: str, count: int, seed: int = 7) -> list[str]:
    """Short texts (10 words, ~13 tokens) or mixed lengths (5-120 words), seeded."""
    rng = random.Random(f"{kind}/{seed}")
    out = []
    for _ in range(count):
        n = 10 if kind == "short" else rng.randint(5, 120)
        out.append(" ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + ".")
    return out


# -- the in-process limit (a child process, so the bench never holds torch) ---------------

def limit_measure(device: str, torch_threads: int | None, plan: Plan,
                  batch_sizes: Sequence[int]) -> Json:
    """The model called directly: tokenize + forward, the adapter's own code. Each
    measure stops at its text count or its time budget, whichever comes first, so a
    machine slowed down by its neighbours cannot stretch the run."""
    import torch

    from ember.adapters.base import EncodeOptions, Runtime
    from ember.config import load_catalog
    from ember.registry import adapter_loader

    torch_default = torch.get_num_threads()
    started = time.perf_counter()
    spec = load_catalog()[MODEL]
    adapter: Any = adapter_loader(spec.adapter)(spec, Runtime(device, torch_threads))
    load_s = time.perf_counter() - started
    options = EncodeOptions()

    def run(batch: Sequence[str]) -> None:
        items, params = adapter.prepare(batch, options)
        adapter.forward(items, params)

    def tokens(text: str) -> int:
        return len(adapter.prepare([text], options)[0][0].payload)

    def latencies(seq: Sequence[str]) -> list[float]:
        out: list[float] = []
        deadline = time.perf_counter() + plan.limit_budget_s
        for text in seq:
            t0 = time.perf_counter()
            run([text])
            out.append((time.perf_counter() - t0) * 1000)
            if t0 > deadline:
                break
        return out

    def rate(seq: Sequence[str], size: int) -> float:
        done = 0
        t0 = time.perf_counter()
        for i in range(0, len(seq), size):
            run(seq[i:i + size])
            done += len(seq[i:i + size])
            if time.perf_counter() - t0 > plan.limit_budget_s:
                break
        return done / (time.perf_counter() - t0)

    short = texts("short", plan.limit_short)
    mixed = texts("mixed", plan.limit_mixed)
    for _ in range(plan.limit_warmup):
        run(short[:8])
        run(mixed[:8])
    single = latencies(short[:plan.limit_single])
    single_mixed = latencies(mixed[:plan.limit_mixed_single])
    by_length = sorted(mixed, key=tokens)
    throughput: Json = {"short": {}, "mixed_arrival": {}, "mixed_sorted": {}}
    for size in batch_sizes:
        throughput["short"][str(size)] = rate(short, size)
        throughput["mixed_arrival"][str(size)] = rate(mixed, size)
        # One text per forward is the same in either order.
        throughput["mixed_sorted"][str(size)] = (throughput["mixed_arrival"][str(size)]
                                                 if size == 1 else rate(by_length, size))
    result: Json = {
        "device": device, "load_s": load_s, "torch_threads": torch.get_num_threads(),
        "torch_default_threads": torch_default,
        "single_short_p50_ms": percentile(single, 50),
        "single_short_p99_ms": percentile(single, 99),
        "single_mixed_p50_ms": percentile(single_mixed, 50),
        "short_tokens_mean": sum(map(tokens, short)) / len(short),
        "mixed_tokens_mean": sum(map(tokens, mixed)) / len(mixed),
        "items_per_s": throughput,
        "best_items_per_s": {k: max(v.values()) for k, v in throughput.items()}}
    if device == "cpu" and torch.get_num_threads() != torch_default:
        # The same two measures with torch's own thread count, for comparison.
        pinned = torch.get_num_threads()
        torch.set_num_threads(torch_default)
        probe = latencies(short[:plan.limit_single])
        result["default_threads_probe"] = {
            "torch_threads": torch_default,
            "single_short_p50_ms": percentile(probe, 50),
            "single_short_p99_ms": percentile(probe, 99),
            "short_b8_items_per_s": rate(short, 8)}
        torch.set_num_threads(pinned)
    return result


def run_limit(args: argparse.Namespace) -> Json:
    """The limit in a child process; its JSON comes back through a file."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "limit.json"
        command = [sys.executable, __file__, "--limit-only", str(out), "--device", args.device,
                   "--limit-batch-sizes", ",".join(map(str, args.limit_batch_sizes))]
        if args.torch_threads:
            command += ["--torch-threads", str(args.torch_threads)]
        else:
            command += ["--torch-threads", "0"]
        if args.quick:
            command.append("--quick")
        t0 = time.perf_counter()
        subprocess.run(command, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        result: Json = json.loads(out.read_text(encoding="utf-8"))
        result["wall_s"] = time.perf_counter() - t0
        return result


# -- the server ------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def policy_models(folder: Path, policies: Sequence[str]) -> dict[str, str]:
    """Catalog entries serving the default model under each policy's batching."""
    import yaml

    from ember.config import BUILTIN_CATALOG

    source = next(p for p in sorted(BUILTIN_CATALOG.glob("*.yaml"))
                  if yaml.safe_load(p.read_text(encoding="utf-8")).get("name") == MODEL)
    base = yaml.safe_load(source.read_text(encoding="utf-8"))
    names = {}
    for policy in policies:
        if not POLICY_BATCHING[policy]:
            names[policy] = MODEL
            continue
        name = f"bench/{policy}/{MODEL.rsplit('/', 1)[-1]}"
        entry = {**base, "name": name, "batching": POLICY_BATCHING[policy],
                 "description": f"{MODEL} under the {policy} dispatch policy (benchmark)"}
        (folder / f"{policy}.yaml").write_text(yaml.safe_dump(entry), encoding="utf-8")
        names[policy] = name
    return names


class Server:
    """`ember serve` in a child process, on loopback."""

    def __init__(self, args: argparse.Namespace, folder: Path, names: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = folder / "server.log"
        command = [sys.executable, "-m", "ember.cli", "serve", "--host", "127.0.0.1",
                   "--port", str(self.port), "--device", args.device, "--log-level", "warning",
                   "--model-dir", str(folder)]
        for name in names.values():
            if name != MODEL:
                command += ["--preload", name]
        if args.torch_threads:
            command += ["--torch-threads", str(args.torch_threads)]
        self.command = command
        self._log_file = self.log.open("wb")
        self.process = subprocess.Popen(command, stdout=self._log_file,
                                        stderr=subprocess.STDOUT,
                                        env={**os.environ, "HF_HUB_OFFLINE": "1"})

    def wait_ready(self, timeout_s: float = 180.0) -> float:
        import httpx

        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(f"ember serve exited with {self.process.returncode}:\n"
                                   f"{self.log.read_text(errors='replace')[-3000:]}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"ember serve not ready after {timeout_s} s:\n"
                           f"{self.log.read_text(errors='replace')[-3000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # drains, then exits
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log_file.close()


def cpu_seconds(pid: int | None) -> float:
    """CPU time (user + system, all threads) of a process, from /proc (Linux)."""
    if pid is None:
        return float("nan")
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


METRIC = re.compile(r'^(ember_batch_(?:items|requests)_(?:count|sum))\{model="([^"]*)"\} (\S+)$')


async def batch_counters(client: Any, url: str, model: str) -> dict[str, float]:
    """Forwards, items and requests the server's worker has counted (GET /metrics)."""
    text = (await client.get(f"{url}/metrics")).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = METRIC.match(line)
        if m and m.group(2) == model:
            out[m.group(1)] = float(m.group(3))
    return out


# -- load ------------------------------------------------------------------------------------

def bodies(kind: str, count: int) -> list[bytes]:
    return [json.dumps({"items": [{"text": t}]}).encode() for t in texts(kind, count)]


async def post(client: Any, url: str, body: bytes) -> tuple[float, float, float]:
    """One encode; returns client latency, server queue time and inference time, in ms."""
    t0 = time.perf_counter()
    response = await client.post(url, content=body,
                                 headers={"content-type": "application/json"})
    latency = (time.perf_counter() - t0) * 1000
    if response.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.text[:300]}")
    return (latency, float(response.headers.get("x-queue-time-ms", "nan")),
            float(response.headers.get("x-inference-time-ms", "nan")))


async def sequential(client: Any, url: str, payloads: Sequence[bytes], n: int) -> Json:
    lat, queue, infer = [], [], []
    for i in range(n + 5):
        result = await post(client, url, payloads[i % len(payloads)])
        if i >= 5:
            lat.append(result[0])
            queue.append(result[1])
            infer.append(result[2])
    return {"requests": n, "latency_p50_ms": percentile(lat, 50),
            "latency_p99_ms": percentile(lat, 99), "queue_p50_ms": percentile(queue, 50),
            "queue_p99_ms": percentile(queue, 99), "inference_p50_ms": percentile(infer, 50)}


async def closed_loop(client: Any, base: str, model: str, payloads: Sequence[bytes],
                      clients: int, warmup_s: float, duration_s: float,
                      server_pid: int | None) -> Json:
    url = f"{base}/v1/encode/{model}"
    lat: list[float] = []
    queue: list[float] = []
    counter = iter(range(10**9))
    begin = time.perf_counter() + warmup_s
    end = begin + duration_s
    marks: dict[str, tuple[float, float, dict[str, float]]] = {}

    async def mark(key: str, at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        marks[key] = (time.process_time(), cpu_seconds(server_pid),
                      await batch_counters(client, base, model))

    cycles: list[list[float]] = []  # per client: send-to-next-send times in the window

    async def one() -> None:
        mine: list[float] = []
        cycles.append(mine)
        while (sent := time.perf_counter()) < end:
            latency, queue_ms, _ = await post(client, url, payloads[next(counter) % len(payloads)])
            if begin <= time.perf_counter() <= end:
                lat.append(latency)
                queue.append(queue_ms)
            if begin <= sent and time.perf_counter() < end:
                mine.append(time.perf_counter() - sent)

    marker = asyncio.gather(mark("begin", begin), mark("end", end))
    await asyncio.gather(*(one() for _ in range(clients)))
    # Throughput by Little's law, client by client (1 / mean cycle time): a forward's
    # requests finish together, so counting completions in a window would move in steps
    # of a whole batch.
    rate = sum(len(c) / sum(c) for c in cycles if c)
    await marker
    (c0, s0, m0), (c1, s1, m1) = marks["begin"], marks["end"]

    def delta(key: str) -> float:
        return m1.get(key, float("nan")) - m0.get(key, float("nan"))

    forwards = delta("ember_batch_items_count")
    return {"requests": len(lat), "requests_per_s": rate,
            "items_per_s": rate,  # one item per request
            "completed_per_s": len(lat) / duration_s,
            "latency_p50_ms": percentile(lat, 50), "latency_p99_ms": percentile(lat, 99),
            "queue_p50_ms": percentile(queue, 50),
            "forwards_per_request": forwards / delta("ember_batch_requests_sum")
            if forwards else float("nan"),
            "items_per_forward": delta("ember_batch_items_sum") / forwards
            if forwards else float("nan"),
            "client_cpu_cores": (c1 - c0) / duration_s,
            "server_cpu_cores": (s1 - s0) / duration_s}


async def load_phase(args: argparse.Namespace, base: str, names: dict[str, str],
                     server_pid: int | None, plan: Plan) -> Json:
    import httpx

    payloads = {"short": bodies("short", 256), "mixed": bodies("mixed", 128)}
    most = max(args.concurrency)
    limits = httpx.Limits(max_connections=most + 4, max_keepalive_connections=most + 4)
    policies = list(names)
    out: Json = {"sequential": {p: [] for p in policies}, "closed": {}}
    cases = [(kind, c) for kind in ("short", "mixed") for c in args.concurrency]
    for kind, c in cases:
        out["closed"][f"{kind}_c{c}"] = {"texts": kind, "clients": c,
                                         "reps": {p: [] for p in policies}}
    async with httpx.AsyncClient(limits=limits, timeout=120.0) as client:
        for model in names.values():  # warm every model's path up
            for body in payloads["short"][:4] + payloads["mixed"][:4]:
                await post(client, f"{base}/v1/encode/{model}", body)
        for rep in range(args.reps):
            for policy in policies:
                out["sequential"][policy].append(await sequential(
                    client, f"{base}/v1/encode/{names[policy]}", payloads["short"],
                    plan.sequential))
            for kind, c in cases:
                duration = plan.short_s if kind == "short" else plan.mixed_s
                for policy in policies:  # interleaved: A B C, then the next case
                    result = await closed_loop(client, base, names[policy], payloads[kind], c,
                                               plan.warmup_s, duration, server_pid)
                    out["closed"][f"{kind}_c{c}"]["reps"][policy].append(result)
            out.setdefault("loadavg_per_rep", []).append(benchlib.loadavg())
            print(f"[http] repetition {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    return out


# -- summary and report ---------------------------------------------------------------------

def summarize(reps: dict[str, list[Json]]) -> Json:
    base = reps["default"]
    out: Json = {}
    for policy, runs in reps.items():
        keys = [k for k, v in runs[0].items() if isinstance(v, int | float)]
        out[policy] = {
            "median": {k: median(r[k] for r in runs) for k in keys},
            "ratio_to_default": {k: spread([benchlib.ratio(r[k], b[k])
                                            for r, b in zip(runs, base, strict=True)])
                                 for k in keys},
        }
    return out


def limit_of(data: Json) -> Json:
    """The limit the ratios use: the median of the phases (before and after the load)."""
    phases = data["limit"]
    return {
        "single_short_p50_ms": median(p["single_short_p50_ms"] for p in phases),
        "best_items_per_s": {k: median(p["best_items_per_s"][k] for p in phases)
                             for k in phases[0]["best_items_per_s"]},
    }


def ember_vs_limit(data: Json) -> Json:
    limit = limit_of(data)
    out: Json = {"sequential_latency_p50_over_limit_single": benchlib.ratio(
        data["summary"]["sequential"]["default"]["median"]["latency_p50_ms"],
        limit["single_short_p50_ms"])}
    for name, case in data["summary"]["closed"].items():
        got = case["default"]["median"]["items_per_s"]
        best = limit["best_items_per_s"]
        if name.startswith("short"):
            out[name] = {"over_best": benchlib.ratio(got, best["short"])}
        else:
            out[name] = {"over_best_arrival_order": benchlib.ratio(got, best["mixed_arrival"]),
                         "over_best_length_sorted": benchlib.ratio(got, best["mixed_sorted"])}
    return out


def markdown(data: Json) -> str:
    out: list[str] = []
    s = data["settings"]
    out.append(f"Model {MODEL} on {s['device']}; {s['reps']} repetitions; one text per "
               f"request, so requests/s = items/s. Ratios are per repetition, median "
               f"(min-max).\n")
    phases = data["limit"]
    sizes = list(phases[0]["items_per_s"]["short"])
    out.append("In-process limit (tokenize + forward, the adapter called directly), "
               "items/s by batch size:\n")
    rows = []
    for i, p in enumerate(phases):
        when = ("before the load", "after the load")[min(i, 1)]
        rows.append([when, p["single_short_p50_ms"], p["single_short_p99_ms"],
                     p["single_mixed_p50_ms"],
                     *(p["items_per_s"]["short"][b] for b in sizes),
                     *(p["items_per_s"]["mixed_arrival"][b] for b in sizes),
                     *(p["items_per_s"]["mixed_sorted"][b] for b in sizes)])
    out.append(table(["phase", "1 short text p50 ms", "p99 ms", "1 mixed text p50 ms",
                      *(f"short b{b}" for b in sizes), *(f"mixed b{b}" for b in sizes),
                      *(f"mixed sorted b{b}" for b in sizes)], rows))
    out.append(f"\nTokens per text: short {phases[0]['short_tokens_mean']:.1f}, mixed "
               f"{phases[0]['mixed_tokens_mean']:.1f} on average; torch threads "
               f"{phases[0]['torch_threads']} (server and limit alike).\n")
    probes = [p["default_threads_probe"] for p in phases if "default_threads_probe" in p]
    if probes:
        out.append(f"The same model with torch's own thread count "
                   f"({probes[0]['torch_threads']}), measured right after each limit phase:\n")
        out.append(table(["phase", "1 short text p50 ms", "p99 ms", "short b8 items/s"],
                         [[("before the load", "after the load")[min(i, 1)],
                           p["single_short_p50_ms"], p["single_short_p99_ms"],
                           p["short_b8_items_per_s"]] for i, p in enumerate(probes)]))
        out.append("")
    seq = data["summary"]["sequential"]
    limit = limit_of(data)
    out.append("Sequential client over HTTP (short texts):\n")
    out.append(table(["policy", "latency p50 ms", "latency p99 ms", "X-Queue-Time p50 ms",
                      "X-Queue-Time p99 ms", "X-Inference-Time p50 ms", "p50 / limit",
                      "p50 / default"],
                     [[POLICY_LABELS[p], seq[p]["median"]["latency_p50_ms"],
                       seq[p]["median"]["latency_p99_ms"], seq[p]["median"]["queue_p50_ms"],
                       seq[p]["median"]["queue_p99_ms"], seq[p]["median"]["inference_p50_ms"],
                       benchlib.ratio(seq[p]["median"]["latency_p50_ms"],
                                      limit["single_short_p50_ms"]),
                       fmt_spread(seq[p]["ratio_to_default"]["latency_p50_ms"])]
                      for p in seq]))
    out.append("\nClosed loop over HTTP:\n")
    rows = []
    for name, case in data["summary"]["closed"].items():
        kind = "short" if name.startswith("short") else "mixed"
        clients = data["load"]["closed"][name]["clients"]
        for p, entry in case.items():
            m = entry["median"]
            best = limit["best_items_per_s"]["short" if kind == "short" else "mixed_arrival"]
            rows.append([kind, clients, POLICY_LABELS[p], m["requests_per_s"],
                         m["latency_p50_ms"], m["latency_p99_ms"], m["queue_p50_ms"],
                         m["items_per_forward"], m["client_cpu_cores"], m["server_cpu_cores"],
                         benchlib.ratio(m["items_per_s"], best),
                         fmt_spread(entry["ratio_to_default"]["requests_per_s"])])
    out.append(table(["texts", "in flight", "policy", "req/s = items/s", "p50 ms", "p99 ms",
                      "queue p50 ms", "items/forward", "client CPU cores", "server CPU cores",
                      "items/s / limit", "req/s / default"], rows))
    ratios = ember_vs_limit(data)
    out.append("\nEmber (default policy) against the limit:\n")
    rows = [["sequential latency p50 / single-text limit p50",
             ratios["sequential_latency_p50_over_limit_single"]]]
    for name, r in ratios.items():
        if isinstance(r, dict):
            for k, v in r.items():
                rows.append([f"{name} items/s / limit ({k.replace('_', ' ')})", v])
    out.append(table(["measure", "ratio"], rows))
    return "\n".join(out) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run (~20 s)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 3)")
    parser.add_argument("--out", type=Path, default=Path("docs/bench/http.json"))
    parser.add_argument("--url", default=None,
                        help="a running server to load (default: start one here); only its "
                        "default policy is measured then")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch intra-op threads of the server and the limit alike; 0: "
                        "torch's choice (on 2 shared cores that collapses whenever a "
                        "neighbour takes a core; see docs/benchmarks.md)")
    parser.add_argument("--concurrency", default="8,32", help="closed-loop in-flight counts")
    parser.add_argument("--policies", default="default,earlier,idle0",
                        help="dispatch policies to serve side by side, of "
                        + ",".join(POLICY_BATCHING))
    parser.add_argument("--limit-batch-sizes", default="1,8,32")
    parser.add_argument("--report", type=Path, default=None,
                        help="print the markdown tables of an earlier JSON result and exit")
    parser.add_argument("--limit-only", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c]
    args.limit_batch_sizes = [int(b) for b in str(args.limit_batch_sizes).split(",") if b]
    args.policies = [p for p in str(args.policies).split(",") if p]
    if "default" not in args.policies or set(args.policies) - set(POLICY_BATCHING):
        parser.error(f"--policies needs 'default' and only names of {list(POLICY_BATCHING)}")
    if args.url:
        args.policies = ["default"]
    if args.reps is None:
        args.reps = 1 if args.quick else 4
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.report is not None:
        print(markdown(json.loads(args.report.read_text(encoding="utf-8"))))
        return 0
    if args.limit_only is not None:
        result = limit_measure(args.device, args.torch_threads or None, plan,
                               args.limit_batch_sizes)
        args.limit_only.write_text(json.dumps(result), encoding="utf-8")
        return 0

    import uvloop

    began = time.perf_counter()
    data: Json = {"meta": benchlib.meta(sys.argv), "settings": {
        "model": MODEL, "device": args.device, "reps": args.reps, "quick": args.quick,
        "concurrency": args.concurrency, "policies": {p: POLICY_BATCHING[p]
                                                      for p in args.policies},
        "plan": plan.__dict__, "limit_batch_sizes": args.limit_batch_sizes,
        "torch_threads": args.torch_threads, "url": args.url}}
    print("[http] in-process limit ...", file=sys.stderr, flush=True)
    data["limit"] = [run_limit(args)]
    with tempfile.TemporaryDirectory(prefix="ember-bench-") as tmp:
        folder = Path(tmp)
        if args.url:
            names, server, base, pid = {"default": MODEL}, None, args.url.rstrip("/"), None
        else:
            names = policy_models(folder, args.policies)
            server = Server(args, folder, names)
            base, pid = server.url, server.process.pid
        try:
            if server is not None:
                print(f"[http] starting {' '.join(server.command)}", file=sys.stderr, flush=True)
                data["server_ready_s"] = server.wait_ready()
            t0 = time.perf_counter()
            data["load"] = uvloop.run(load_phase(args, base, names, pid, plan))
            data["load_s"] = time.perf_counter() - t0
        finally:
            if server is not None:
                server.stop()
    if not args.quick:  # the limit again: the two bracket the machine's drift
        print("[http] in-process limit again ...", file=sys.stderr, flush=True)
        data["limit"].append(run_limit(args))
    data["summary"] = {
        "sequential": summarize(data["load"]["sequential"]),
        "closed": {name: summarize(case["reps"])
                   for name, case in data["load"]["closed"].items()},
    }
    data["ember_vs_limit"] = ember_vs_limit(data)
    data["meta"]["duration_s"] = round(time.perf_counter() - began, 1)
    data["meta"]["loadavg_at_end"] = benchlib.loadavg()
    benchlib.write_json(args.out, data)
    print(markdown(data))
    print(f"[http] wrote {args.out} in {data['meta']['duration_s']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
