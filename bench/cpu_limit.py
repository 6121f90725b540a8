#!/usr/bin/env python
"""Ember on CPU against its own graph's limit, alternating in one run (A B A B).

The limit is the exact ONNX graph the server loads (the path its adapter opened),
run in process with ONNX Runtime's own defaults on every core (spin-waiting on),
tokenizing with the model's tokenizer, padding and mean pooling in numpy: nothing
but the model's own work. Ember is `ember serve` over HTTP (aiohttp client, one
text a request): a sequential client, then 8 and 32 in flight in closed loop,
then its process tree's CPU while idle. Each round measures the limit (a child
process), then every server variant; two rounds by default, medians reported, each
ratio against the limit of its own round.

    python bench/cpu_limit.py                      # ~2-3 min on 2 cores
    python bench/cpu_limit.py --variants default,nospin,t1
    python bench/cpu_limit.py --quick              # smoke run
    python bench/cpu_limit.py --report docs/bench/cpu_limit.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import benchlib
import loadgen
from benchlib import Json, fmt_spread, median, percentile, spread, table

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
# Server variants: extra `ember serve` flags. `default` is what a user gets.
VARIANTS: dict[str, list[str]] = {
    "default": [],
    "nospin": ["--onnx-spinning", "off"],
    "spin": ["--onnx-spinning", "on"],
    "t1": ["--onnx-threads", "1"],
}
LABELS = {
    "default": "Ember, defaults",
    "nospin": "threads never spin (the old default)",
    "spin": "threads always spin (ONNX Runtime's own)",
    "t1": "one ONNX Runtime thread",
}
GAP_METRIC = re.compile(r'^ember_device_idle_gap_(seconds)_total\{(.*)\} (\S+)$')


@dataclass(frozen=True)
class Plan:
    sequential: int
    warmup_s: float
    closed_s: float
    idle_delay_s: float  # after the load stops, before the idle window
    idle_s: float
    limit_single: int
    limit_budget_s: float


FULL = Plan(sequential=200, warmup_s=0.5, closed_s=3.0, idle_delay_s=1.0, idle_s=6.0,
            limit_single=200, limit_budget_s=2.5)
QUICK = Plan(sequential=10, warmup_s=0.1, closed_s=0.5, idle_delay_s=0.5, idle_s=0.5,
             limit_single=10, limit_budget_s=0.3)


# -- the limit (a child process) ----------------------------------------------------------

def limit_measure(plan: Plan) -> Json:
    """The graph the server loads, alone: one text's latency, batches of 8 and 32."""
    import numpy as np
    import onnxruntime as ort

    from ember.adapters.base import EncodeOptions, Runtime, usable_cores
    from ember.config import load_catalog
    from ember.registry import adapter_loader

    spec = load_catalog()[MODEL]
    adapter: Any = adapter_loader(spec.adapter)(spec, Runtime())
    forward = adapter.model
    options = ort.SessionOptions()
    options.intra_op_num_threads = usable_cores()  # spinning: ORT's default
    session = ort.InferenceSession(str(forward.path), options,
                                   providers=["CPUExecutionProvider"])
    inputs = {i.name for i in session.get_inputs()}
    encode = EncodeOptions()

    def run(batch: Sequence[str]) -> Any:
        items, _ = adapter.prepare(batch, encode)
        rows = [item.payload for item in items]
        width = max(len(r) for r in rows)
        ids = np.zeros((len(rows), width), dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = row
            mask[i, :len(row)] = 1
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in inputs:
            feeds["token_type_ids"] = np.zeros_like(ids)
        hidden = session.run([forward.output], feeds)[0]
        weights = mask[..., None].astype(np.float32)
        pooled = (hidden * weights).sum(axis=1) / weights.sum(axis=1)
        return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)

    short = loadgen.texts("short", 512)
    for _ in range(5):
        run(short[:8])
    single: list[float] = []
    deadline = time.perf_counter() + plan.limit_budget_s
    for text in short[:plan.limit_single]:
        t0 = time.perf_counter()
        run([text])
        single.append((time.perf_counter() - t0) * 1000)
        if t0 > deadline:
            break

    def rate(size: int) -> float:
        done, i = 0, 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < plan.limit_budget_s:
            batch = [short[(i + k) % len(short)] for k in range(size)]
            run(batch)
            done, i = done + size, i + size
        return done / (time.perf_counter() - t0)

    cpu0 = time.process_time()
    wall0 = time.perf_counter()
    b8 = rate(8)
    b8_cores = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    return {"graph": str(forward.path), "threads": usable_cores(),
            "single_p50_ms": percentile(single, 50), "single_p99_ms": percentile(single, 99),
            "b8_items_per_s": b8, "b8_cpu_cores": b8_cores, "b32_items_per_s": rate(32)}


def run_limit(quick: bool) -> Json:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "limit.json"
        command = [sys.executable, __file__, "--limit-only", str(out)]
        if quick:
            command.append("--quick")
        subprocess.run(command, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        result: Json = json.loads(out.read_text(encoding="utf-8"))
        return result


# -- Ember over HTTP ----------------------------------------------------------------------

async def gap_counters(session: Any, base: str) -> dict[str, float]:
    """The server's device-idle seconds by cause, summed over models."""
    async with session.get(f"{base}/metrics") as response:
        text = await response.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = GAP_METRIC.match(line)
        if m:
            cause = re.search(r'cause="([^"]*)"', m.group(2))
            key = f"{m.group(1)}:{cause.group(1) if cause else ''}"
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


async def measure_server(server: loadgen.Server, plan: Plan) -> Json:
    url = f"{server.url}/v1/encode/{MODEL}"
    short = loadgen.encode_bodies("short", 256)
    out: Json = {}
    async with loadgen.client_session(40) as session:
        out["sequential"] = await loadgen.sequential(session, url, short, plan.sequential)
        for clients in (8, 32):
            async def snapshot() -> Json:
                return {"cpu_s": loadgen.tree_cpu_seconds(server.pid),
                        "gaps": await gap_counters(session, server.url),
                        "batches": await loadgen.batch_counters(session, server.url, MODEL)}

            run = await loadgen.closed_loop(session, url, short, clients, plan.warmup_s,
                                            plan.closed_s, snapshot)
            begin, end = run.marks["begin"], run.marks["end"]
            requests = run.requests_per_s * plan.closed_s
            gaps = {k: end["gaps"].get(k, 0.0) - begin["gaps"].get(k, 0.0)
                    for k in end["gaps"]}
            out[f"c{clients}"] = {
                **run.summary(),
                **loadgen.batch_deltas(begin["batches"], end["batches"]),
                "server_cpu_cores": (end["cpu_s"] - begin["cpu_s"]) / plan.closed_s,
                "server_cpu_ms_per_request": (end["cpu_s"] - begin["cpu_s"]) * 1000
                / max(requests, 1.0),
                "idle_gap_ms_per_s": {k.split(":", 1)[1]: v * 1000 / plan.closed_s
                                      for k, v in gaps.items() if k.startswith("seconds:")},
            }
        with competing_process():  # a neighbour takes one core
            run = await loadgen.closed_loop(session, url, short, 8, plan.warmup_s,
                                            plan.closed_s)
        out["c8_contended"] = run.summary()
    await asyncio.sleep(plan.idle_delay_s)
    cpu0, wall0 = loadgen.tree_cpu_seconds(server.pid), time.perf_counter()
    await asyncio.sleep(plan.idle_s)
    idle_cpu = loadgen.tree_cpu_seconds(server.pid) - cpu0
    out["idle_cpu_cores"] = idle_cpu / (time.perf_counter() - wall0)
    return out


@contextlib.contextmanager
def competing_process() -> Iterator[None]:
    """A Python process spinning (while True: pass) for as long as the block runs."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)  # let it start spinning
        yield
    finally:
        spinner.kill()
        spinner.wait()


def ratios(limit: Json, ember: Json) -> Json:
    return {"sequential_p50_over_single": benchlib.ratio(ember["sequential"]["latency_p50_ms"],
                                                         limit["single_p50_ms"]),
            "c8_over_b8": benchlib.ratio(ember["c8"]["requests_per_s"],
                                         limit["b8_items_per_s"]),
            "c32_over_b32": benchlib.ratio(ember["c32"]["requests_per_s"],
                                           limit["b32_items_per_s"])}


def summarize(data: Json) -> Json:
    out: Json = {}
    for variant in data["settings"]["variants"]:
        rounds = [(r["limit"], r["ember"][variant]) for r in data["rounds"]]
        per_round = [ratios(limit, ember) for limit, ember in rounds]
        out[variant] = {
            "ratios": {k: spread([r[k] for r in per_round]) for k in per_round[0]},
            "idle_cpu_cores": spread([e["idle_cpu_cores"] for _, e in rounds]),
            "sequential_p50_ms": median(e["sequential"]["latency_p50_ms"] for _, e in rounds),
            "c8_contended_requests_per_s": median(e["c8_contended"]["requests_per_s"]
                                                  for _, e in rounds),
            "c8_contended_latency_p50_ms": median(e["c8_contended"]["latency_p50_ms"]
                                                  for _, e in rounds),
            **{f"c{c}_{k}": median(e[f"c{c}"][k] for _, e in rounds)
               for c in (8, 32) for k in ("requests_per_s", "latency_p50_ms",
                                          "server_cpu_cores", "server_cpu_ms_per_request",
                                          "items_per_forward")},
            **{f"c{c}_idle_gap_ms_per_s": {
                cause: median(e[f"c{c}"]["idle_gap_ms_per_s"].get(cause, 0.0)
                              for _, e in rounds)
                for cause in sorted({k for _, e in rounds
                                     for k in e[f"c{c}"]["idle_gap_ms_per_s"]})}
               for c in (8, 32)},
        }
    limits = [r["limit"] for r in data["rounds"]]
    out["limit"] = {k: median(lim[k] for lim in limits)
                    for k in ("single_p50_ms", "b8_items_per_s", "b32_items_per_s",
                              "b8_cpu_cores")}
    return out


TARGETS = (("c8_over_b8", ">=", 0.8, "8 in flight / batch-8 limit"),
           ("c32_over_b32", ">=", 0.85, "32 in flight / batch-32 limit"),
           ("sequential_p50_over_single", "<=", 1.5,
            "sequential p50 at the client / one-text limit"))


def markdown(data: Json) -> str:
    s = data["summary"]
    lines = [f"Model {MODEL}, one short text a request, {len(data['rounds'])} rounds "
             f"(limit, then each server variant, per round); medians, ratios per round "
             f"against that round's limit, median (min-max).\n"]
    rows = [[f"round {i + 1}", r["limit"]["single_p50_ms"], r["limit"]["b8_items_per_s"],
             r["limit"]["b32_items_per_s"], r["limit"]["b8_cpu_cores"]]
            for i, r in enumerate(data["rounds"])]
    lines.append(table(["limit", "one text p50 ms", "batch 8 items/s", "batch 32 items/s",
                        "CPU cores at batch 8"], rows))
    lines.append("")
    rows = []
    for variant in data["settings"]["variants"]:
        v = s[variant]
        rows.append([LABELS.get(variant, variant), v["sequential_p50_ms"],
                     v["c8_requests_per_s"], v["c32_requests_per_s"],
                     fmt_spread(v["ratios"]["sequential_p50_over_single"]),
                     fmt_spread(v["ratios"]["c8_over_b8"]),
                     fmt_spread(v["ratios"]["c32_over_b32"]),
                     v["c8_server_cpu_cores"], v["c8_server_cpu_ms_per_request"],
                     v["c8_contended_requests_per_s"], cores(v["idle_cpu_cores"])])
    lines.append(table(["server", "sequential p50 ms", "8 in flight req/s",
                        "32 in flight req/s", "p50 / one-text limit", "8 / b8 limit",
                        "32 / b32 limit", "CPU cores at 8", "CPU ms a request at 8",
                        "8 in flight req/s, a core taken", "idle CPU cores"], rows))
    lines.append("")
    rows = []
    for variant in data["settings"]["variants"]:
        for c in (8, 32):
            gaps = s[variant][f"c{c}_idle_gap_ms_per_s"]
            rows.append([LABELS.get(variant, variant), c, s[variant][f"c{c}_items_per_forward"],
                         ", ".join(f"{k} {v:.1f}" for k, v in gaps.items()) or "-"])
    lines.append("Device idle while work waited (ms per second of load, by cause):\n")
    lines.append(table(["server", "in flight", "items/forward", "idle gap ms/s"], rows))
    lines.append("")
    default = s.get("default")
    if default is not None:
        rows = [[text, f"{op} {bound}", fmt_spread(default["ratios"][key]),
                 "yes" if _meets(default["ratios"][key]["median"], op, bound) else "NO"]
                for key, op, bound, text in TARGETS]
        idle = default["idle_cpu_cores"]["max"]
        rows.append(["idle CPU after load, cores (worst round)", "<= 0.005", f"{idle:.4f}",
                     "yes" if idle <= 0.005 else "NO"])
        lines.append(table(["Ember, defaults", "target", "this run", "met"], rows))
    return "\n".join(lines) + "\n"


def cores(s: Json) -> str:
    """Idle CPU, fine enough to read one 10 ms clock tick in a few seconds."""
    return f"{s['median']:.4f} ({s['min']:.4f}-{s['max']:.4f})"


def _meets(value: float, op: str, bound: float) -> bool:
    return value >= bound if op == ">=" else value <= bound


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    benchlib.add_common_args(parser, Path("docs/bench/cpu_limit.json"), 2, "smoke run")
    parser.add_argument("--variants", default="default,nospin,spin,t1",
                        help="server variants, of " + ",".join(VARIANTS))
    parser.add_argument("--limit-only", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    benchlib.resolve_reps(args, 2)
    plan = QUICK if args.quick else FULL
    if args.report is not None:
        print(markdown(benchlib.read_json(args.report)))
        return 0
    if args.limit_only is not None:
        args.limit_only.write_text(json.dumps(limit_measure(plan)), encoding="utf-8")
        return 0
    variants = [v for v in str(args.variants).split(",") if v]
    if set(variants) - set(VARIANTS):
        parser.error(f"--variants takes names of {list(VARIANTS)}")

    import uvloop

    began = time.perf_counter()
    data: Json = {"meta": benchlib.meta(sys.argv),
                  "settings": {"model": MODEL, "variants": variants, "reps": args.reps,
                               "flags": {v: VARIANTS[v] for v in variants},
                               "plan": asdict(plan)},
                  "rounds": []}
    with tempfile.TemporaryDirectory(prefix="ember-cpu-limit-") as tmp:
        servers = {v: loadgen.Server(VARIANTS[v], Path(tmp) / f"{v}.log").start()
                   for v in variants}
        try:
            for v, server in servers.items():
                print(f"[cpu_limit] {v}: {' '.join(server.command)}", file=sys.stderr)
                server.wait_ready()
            for rep in range(args.reps):
                entry: Json = {"limit": run_limit(args.quick), "ember": {}}
                for v, server in servers.items():
                    entry["ember"][v] = uvloop.run(measure_server(server, plan))
                entry["loadavg"] = benchlib.loadavg()
                data["rounds"].append(entry)
                print(f"[cpu_limit] round {rep + 1}/{args.reps} done", file=sys.stderr,
                      flush=True)
        finally:
            for server in servers.values():
                server.stop()
    data["summary"] = summarize(data)
    return benchlib.finish(args.out, data, began, markdown(data), "cpu_limit")


if __name__ == "__main__":
    sys.exit(main())

