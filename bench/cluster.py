#!/usr/bin/env python
"""Cluster benchmark: Ember on Ray Serve against plain `ember serve`, over HTTP.

The device is SYNTHETIC (a benchmark model: its vectors mean nothing): a forward sleeps
50 ms whatever it holds, at most 8 items, so one replica serves at most 160 items/s and
the CPU stays free for the HTTP path. Requests carry 4 texts (`--texts`), so that the
replicas, not Ray's HTTP path, are the limit on two cores (see TEXTS_PER_REQUEST).

Part 1, the comparison, interleaved (each repetition runs plain, ray-1, ray-2 back to
back, each a fresh server): a sequential client (one request at a time: the latency the
Ray hop adds), then a closed loop of 64 clients. Ratios are per repetition, median
(min-max): ray-2 / ray-1 (scaling out) and ray-1 / plain (the cost of running on Ray).

Part 2, the sizing of `--max-ongoing-requests` and `--target-ongoing-requests`: one
replica, its cap set high, loaded by 2..32 clients (every request is ongoing on the
replica: items/s against ongoing requests), then the cap itself at 2..16 under 64
clients.

    flock /tmp/ember-bench.lock python bench/cluster.py            # ~12 min on 2 cores
    python bench/cluster.py --quick                                 # smoke run
    python bench/cluster.py --texts 1 --no-sizing --reps 1          # one text a request
    python bench/cluster.py --report docs/bench/cluster.json        # tables only
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import benchlib
import loadgen
import psutil
from benchlib import Json, fmt_spread, median, spread, table
from loadgen import Plan

MODEL = "bench/synthetic-50ms"
FORWARD_MS, MAX_ITEMS = 50.0, 8
MODEL_YAML = f"""# FOR BENCHMARKS ONLY: not a real model. A forward sleeps {FORWARD_MS:.0f} ms.
name: {MODEL}
description: synthetic benchmark device, {FORWARD_MS:.0f} ms a forward of at most {MAX_ITEMS} items
adapter: synthetic
tasks: [encode]
options: {{dims: 64, overhead_ms: {FORWARD_MS}, per_token_us: 0}}
batching: {{max_batch_items: {MAX_ITEMS}}}
"""
IN_FLIGHT = 64
# Texts a request carries. Ray's request path costs ~10 ms of CPU a request here (proxy,
# ingress, handle call; measured, docs/scaling.md), so with one text a request two
# replicas (320 requests/s) would need more than two cores for HTTP alone: four texts a
# request keep the replicas the limit, and two requests fill a forward.
TEXTS_PER_REQUEST = 4
VARIANTS = {"plain": (), "ray-1": ("--ray", "--replicas", "1"),
            "ray-2": ("--ray", "--replicas", "2")}
SIZING_LEVELS = (2, 4, 8, 16, 32)
SIZING_CAP = 128  # the cap while the levels are swept: never reached
CAPS = (2, 4, 8, 16)
FULL_REPS = 3
FULL = Plan(sequential=60, warmup_s=3.0, closed_s=8.0)
QUICK = Plan(sequential=10, warmup_s=1.0, closed_s=2.0)
BODIES = 512


def device_items_per_s(replicas: int) -> float:
    return replicas * MAX_ITEMS / FORWARD_MS * 1000


class RayAwareServer(loadgen.Server):
    """`loadgen.Server`, and whatever Ray processes it started are gone after `stop`
    even if it had to be killed."""

    def stop(self, timeout_s: float = 90.0) -> int | None:
        try:
            family = psutil.Process(self.pid).children(recursive=True)
        except (psutil.Error, RuntimeError):
            family = []
        code = super().stop(timeout_s)
        for process in family:
            with contextlib.suppress(psutil.Error):
                process.kill()
        return code


async def measure(server: loadgen.Server, plan: Plan, clients: int, sequential: bool,
                  texts: int) -> Json:
    url = f"{server.url}/v1/encode/{MODEL}"
    payloads = loadgen.encode_bodies("short", BODIES, texts)
    out: Json = {}
    async with loadgen.client_session(clients + 8) as session:
        for body in payloads[:clients]:  # every connection opened and warm
            await loadgen.post(session, url, body)
        if sequential:
            out["sequential"] = await loadgen.sequential(session, url, payloads,
                                                         plan.sequential)
        run = await loadgen.closed_loop(session, url, payloads, clients, plan.warmup_s,
                                        plan.closed_s)
        out["closed"] = {**run.summary(), "items_per_s": run.requests_per_s * texts}
    return out


def run_server(args: Sequence[str], log: Path, plan: Plan, clients: Sequence[int],
               texts: int, sequential: bool = False) -> list[Json]:
    """Start a server, measure each level in `clients` in turn, stop it."""
    server = RayAwareServer(["--default-model", MODEL, *args], log)
    print(f"[cluster] {' '.join(server.command)}", file=sys.stderr, flush=True)
    try:
        server.start()
        ready_s = server.wait_ready(300)
        results = []
        for i, level in enumerate(clients):
            result = asyncio.run(measure(server, plan, level, sequential and i == 0, texts))
            result["clients"], result["ready_s"] = level, ready_s
            results.append(result)
            print(f"[cluster]   {level} in flight: "
                  f"{result['closed']['items_per_s']:.1f} items/s", file=sys.stderr,
                  flush=True)
        return results
    finally:
        server.stop()


def comparison(args: argparse.Namespace, plan: Plan, folder: Path) -> Json:
    reps: dict[str, list[Json]] = {name: [] for name in VARIANTS}
    for rep in range(args.reps):
        for name, extra in VARIANTS.items():
            [result] = run_server([*args.serve, *extra], folder / f"{name}-{rep}.log", plan,
                                  [IN_FLIGHT], args.texts, sequential=True)
            reps[name].append(result)

    def closed(name: str, key: str) -> list[float]:
        return [r["closed"][key] for r in reps[name]]

    def seq(name: str, key: str) -> list[float]:
        return [r["sequential"][key] for r in reps[name]]

    def ratios(a: str, b: str) -> Json:
        return spread([benchlib.ratio(x, y) for x, y in
                       zip(closed(a, "items_per_s"), closed(b, "items_per_s"),
                           strict=True)])

    return {
        "runs": reps,
        "medians": {name: {"items_per_s": median(closed(name, "items_per_s")),
                           "latency_p50_ms": median(closed(name, "latency_p50_ms")),
                           "latency_p99_ms": median(closed(name, "latency_p99_ms")),
                           "sequential_p50_ms": median(seq(name, "latency_p50_ms")),
                           "sequential_p99_ms": median(seq(name, "latency_p99_ms"))}
                    for name in reps},
        "ratios": {"ray-2 / ray-1": ratios("ray-2", "ray-1"),
                   "ray-1 / plain": ratios("ray-1", "plain")},
        "hop_ms": spread([r - p for r, p in zip(seq("ray-1", "latency_p50_ms"),
                                                seq("plain", "latency_p50_ms"),
                                                strict=True)]),
    }


def sizing(args: argparse.Namespace, plan: Plan, folder: Path) -> Json:
    levels = run_server([*args.serve, *VARIANTS["ray-1"], "--max-ongoing-requests",
                         str(SIZING_CAP)], folder / "levels.log", plan, SIZING_LEVELS,
                        args.texts)
    caps = {}
    for cap in CAPS:
        [result] = run_server([*args.serve, *VARIANTS["ray-1"], "--max-ongoing-requests",
                               str(cap)], folder / f"cap-{cap}.log", plan, [IN_FLIGHT],
                              args.texts)
        caps[str(cap)] = result
    return {"levels": {str(r["clients"]): r["closed"] for r in levels},
            "caps": {cap: r["closed"] for cap, r in caps.items()}}


def targets(data: Json) -> Json:
    ratios = data["comparison"]["ratios"]
    return {"ray-2 / ray-1 >= 1.8": ratios["ray-2 / ray-1"]["median"] >= 1.8,
            "ray-1 / plain >= 0.9": ratios["ray-1 / plain"]["median"] >= 0.9}


def report(data: Json) -> str:
    comp = data["comparison"]
    rows = [[name, m["items_per_s"], m["latency_p50_ms"], m["latency_p99_ms"],
             m["sequential_p50_ms"], m["sequential_p99_ms"]]
            for name, m in comp["medians"].items()]
    parts = [
        f"Device: synthetic, {FORWARD_MS:.0f} ms a forward, at most {MAX_ITEMS} items "
        f"({device_items_per_s(1):.0f} items/s a replica); {IN_FLIGHT} clients in flight, "
        f"{data['texts_per_request']} texts a request; medians of "
        f"{len(comp['runs']['plain'])} interleaved repetitions.",
        "",
        table(["server", "items/s", "p50 ms", "p99 ms", "sequential p50 ms",
               "sequential p99 ms"], rows),
        "",
        table(["ratio", "median (min-max)", "target"],
              [["ray-2 / ray-1", fmt_spread(comp["ratios"]["ray-2 / ray-1"]), ">= 1.8"],
               ["ray-1 / plain", fmt_spread(comp["ratios"]["ray-1 / plain"]), ">= 0.9"]]),
        "",
        f"The Ray hop (sequential p50, ray-1 minus plain): {fmt_spread(comp['hop_ms'])} ms.",
    ]
    size = data.get("sizing")
    if size:
        parts += ["", "One replica on Ray, its cap out of the way: items/s against the "
                  "requests ongoing on it.", "",
                  table(["ongoing requests", "items/s", "of the device", "p50 ms"],
                        [[level, r["items_per_s"],
                          r["items_per_s"] / device_items_per_s(1),
                          r["latency_p50_ms"]] for level, r in size["levels"].items()]),
                  "", f"The cap (`--max-ongoing-requests`) under {IN_FLIGHT} clients:", "",
                  table(["max_ongoing_requests", "items/s", "p50 ms", "p99 ms"],
                        [[cap, r["items_per_s"], r["latency_p50_ms"],
                          r["latency_p99_ms"]] for cap, r in size["caps"].items()])]
    parts += ["", "Targets: " + ", ".join(f"{k}: {'met' if v else 'NOT met'}"
                                          for k, v in data["targets"].items())]
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    benchlib.add_common_args(parser, Path("docs/bench/cluster.json"), FULL_REPS,
                             "one repetition, short windows, no sizing")
    parser.add_argument("--no-sizing", action="store_true", help="part 1 only")
    parser.add_argument("--texts", type=int, default=TEXTS_PER_REQUEST,
                        help="texts a request carries")
    parser.add_argument("--serve-arg", dest="serve", action="append", default=[],
                        help="an extra `ember serve` argument for every server")
    args = parser.parse_args(argv)
    if args.report is not None:
        print(report(benchlib.read_json(args.report)))
        return 0
    benchlib.resolve_reps(args, FULL_REPS)
    plan = QUICK if args.quick else FULL
    began = time.perf_counter()
    data: Json = {"meta": benchlib.meta(sys.argv), "device": {
        "forward_ms": FORWARD_MS, "max_batch_items": MAX_ITEMS, "in_flight": IN_FLIGHT,
        "replica_items_per_s": device_items_per_s(1)}, "plan": asdict(plan),
        "texts_per_request": args.texts}
    with tempfile.TemporaryDirectory(prefix="ember-cluster-bench-") as tmp:
        folder = Path(tmp)
        (folder / "models").mkdir()
        (folder / "models" / "bench.yaml").write_text(MODEL_YAML, encoding="utf-8")
        args.serve = ["--model-dir", str(folder / "models"), *args.serve]
        data["comparison"] = comparison(args, plan, folder)
        if not (args.quick or args.no_sizing):
            data["sizing"] = sizing(args, plan, folder)
    data["targets"] = targets(data)
    return benchlib.finish(args.out, data, began, report(data), "cluster")


if __name__ == "__main__":
    sys.exit(main())
