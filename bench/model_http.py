#!/usr/bin/env python
"""End-to-end benchmark: a load generator against `ember serve`, beside the limit
of the same model called directly, in one run.

The script starts `ember serve` itself on 127.0.0.1 (a free port) with the real
default model, unless `--url` names a running server. The same model is also
served under two more names that differ only in their batching settings (the
catalog's `batching:` field), so the dispatch policies run against one server,
interleaved: `default`, `idle0` (idle_coalesce_ms=0) and `nohold` (hold_fraction=0).

Phases run one after another, never at once (they would share the cores):
1. the in-process limit, in a child process: the model loaded through
   `ember.config.load_catalog()` and `ember.registry.adapter_loader`, tokenize +
   forward on the same texts: single-text latency; throughput over batch sizes;
2. the server: a sequential client (latency and the server's X-Queue-Time-Ms),
   then closed loops at 8 and 32 in flight with short texts and with mixed
   lengths (5-120 words, fixed seed), policies interleaved per repetition;
3. the limit again, to bracket the machine's drift.

    python bench/model_http.py                  # full run, ~5 min on 2 cores
    python bench/model_http.py --quick          # smoke run, ~20 s (two model loads)
    python bench/model_http.py --device cuda    # the CUDA fp16 path (see bench/gpu.sh)
    python bench/model_http.py --report docs/bench/http.json   # tables only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import benchlib
import loadgen
from benchlib import Json, fmt_spread, median, percentile, summarize, table
from loadgen import Plan, texts

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
POLICY_BATCHING: dict[str, dict[str, Any]] = {
    "default": {},
    "idle0": {"idle_coalesce_ms": 0.0},
    "nohold": {"hold_fraction": 0.0},
}
POLICY_LABELS = {
    "default": "default (engine v2)",
    "idle0": "idle_coalesce_ms=0",
    "nohold": "no hold for returning senders (hold_fraction=0)",
}


@dataclass(frozen=True)
class ModelPlan(Plan):
    """The load (`closed_s` is the short-text window) and the in-process limit's sizes."""

    mixed_s: float
    limit_single: int
    limit_short: int
    limit_mixed: int
    limit_mixed_single: int
    limit_warmup: int
    limit_budget_s: float  # the most one limit measure may take


FULL_REPS = 4
FULL = ModelPlan(sequential=60, warmup_s=0.3, closed_s=3.0, mixed_s=4.0, limit_single=60,
                 limit_short=256, limit_mixed=128, limit_mixed_single=32, limit_warmup=3,
                 limit_budget_s=4.0)
QUICK = ModelPlan(sequential=5, warmup_s=0.1, closed_s=0.4, mixed_s=0.4, limit_single=4,
                  limit_short=16, limit_mixed=8, limit_mixed_single=2, limit_warmup=1,
                  limit_budget_s=1.0)


# -- the in-process limit (a child process, so the bench never holds torch) ---------------

def limit_measure(device: str, torch_threads: int | None, plan: ModelPlan,
                  batch_sizes: Sequence[int], backend: str = "onnx",
                  onnx_threads: int | None = None) -> Json:
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
    runtime = Runtime(device, torch_threads, backend,  # type: ignore[arg-type]
                      onnx_threads=onnx_threads)
    adapter: Any = adapter_loader(spec.adapter)(spec, runtime)
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
        "onnx_threads": onnx_threads,
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
                   "--backend", args.backend, "--onnx-threads", str(args.onnx_threads),
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


def serve_args(args: argparse.Namespace, folder: Path, names: dict[str, str]) -> list[str]:
    """`ember serve` flags: the device, the policy catalog folder, every policy preloaded."""
    out = ["--device", args.device, "--backend", args.backend, "--model-dir", str(folder)]
    for name in names.values():
        if name != MODEL:
            out += ["--preload", name]
    if args.torch_threads:
        out += ["--torch-threads", str(args.torch_threads)]
    if args.onnx_threads:
        out += ["--onnx-threads", str(args.onnx_threads)]
    return out


# -- load ------------------------------------------------------------------------------------

async def closed_loop(session: Any, base: str, model: str, payloads: Sequence[bytes],
                      clients: int, plan: Plan, duration_s: float,
                      server_pid: int | None) -> Json:
    """One closed loop on `model`: throughput, latency, batches and CPU (client, server)."""
    async def snapshot() -> Json:
        return {"server_cpu_s": loadgen.tree_cpu_seconds(server_pid),
                "counters": await loadgen.batch_counters(session, base, model)}

    run = await loadgen.closed_loop(session, f"{base}/v1/encode/{model}", payloads, clients,
                                    plan.warmup_s, duration_s, snapshot)
    begin, end = run.marks["begin"], run.marks["end"]
    batches = loadgen.batch_deltas(begin["counters"], end["counters"])
    return {**run.summary(), "items_per_s": run.requests_per_s,  # one item per request
            "forwards_per_request": batches["forwards_per_request"],
            "items_per_forward": batches["items_per_forward"],
            "server_cpu_cores": (end["server_cpu_s"] - begin["server_cpu_s"]) / duration_s}


async def load_phase(args: argparse.Namespace, base: str, names: dict[str, str],
                     server_pid: int | None, plan: ModelPlan) -> Json:
    payloads = {"short": loadgen.encode_bodies("short", 256),
                "mixed": loadgen.encode_bodies("mixed", 128)}
    policies = list(names)
    out: Json = {"sequential": {p: [] for p in policies}, "closed": {}}
    cases = [(kind, c) for kind in ("short", "mixed") for c in args.concurrency]
    for kind, c in cases:
        out["closed"][f"{kind}_c{c}"] = {"texts": kind, "clients": c,
                                         "reps": {p: [] for p in policies}}
    async with loadgen.client_session(max(args.concurrency) + 4) as session:
        for model in names.values():  # warm every model's path up
            for body in payloads["short"][:4] + payloads["mixed"][:4]:
                await loadgen.post(session, f"{base}/v1/encode/{model}", body)
        for rep in range(args.reps):
            for policy in policies:
                out["sequential"][policy].append(await loadgen.sequential(
                    session, f"{base}/v1/encode/{names[policy]}", payloads["short"],
                    plan.sequential))
            for kind, c in cases:
                duration = plan.closed_s if kind == "short" else plan.mixed_s
                for policy in policies:  # interleaved: A B C, then the next case
                    result = await closed_loop(session, base, names[policy], payloads[kind],
                                               c, plan, duration, server_pid)
                    out["closed"][f"{kind}_c{c}"]["reps"][policy].append(result)
            out.setdefault("loadavg_per_rep", []).append(benchlib.loadavg())
            print(f"[model_http] repetition {rep + 1}/{args.reps} done", file=sys.stderr,
                  flush=True)
    return out


# -- summary and report ---------------------------------------------------------------------

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
               f"{phases[0]['torch_threads']}, ONNX Runtime threads "
               f"{phases[0].get('onnx_threads') or 'every core'} (server and limit alike).\n")
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
    benchlib.add_common_args(parser, Path("docs/bench/http.json"), FULL_REPS,
                             "smoke run (~20 s)")
    parser.add_argument("--url", default=None,
                        help="a running server to load (default: start one here); only its "
                        "default policy is measured then")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch intra-op threads of the server and the limit alike; 0: "
                        "torch's choice (on 2 shared cores that collapses whenever a "
                        "neighbour takes a core; see docs/bench/notes.md)")
    parser.add_argument("--backend", default="onnx", choices=("onnx", "torch"),
                        help="forward backend of the server and the limit alike")
    parser.add_argument("--onnx-threads", type=int, default=0,
                        help="ONNX Runtime intra-op threads of the server and the limit "
                        "alike; 0: the server's default (every core)")
    parser.add_argument("--concurrency", default="8,32", help="closed-loop in-flight counts")
    parser.add_argument("--policies", default="default,idle0,nohold",
                        help="dispatch policies to serve side by side, of "
                        + ",".join(POLICY_BATCHING))
    parser.add_argument("--limit-batch-sizes", default="1,8,32")
    parser.add_argument("--limit-only", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.concurrency = benchlib.int_list(args.concurrency)
    args.limit_batch_sizes = benchlib.int_list(args.limit_batch_sizes)
    args.policies = [p for p in str(args.policies).split(",") if p]
    if "default" not in args.policies or set(args.policies) - set(POLICY_BATCHING):
        parser.error(f"--policies needs 'default' and only names of {list(POLICY_BATCHING)}")
    if args.url:
        args.policies = ["default"]
    benchlib.resolve_reps(args, FULL_REPS)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.report is not None:
        print(markdown(benchlib.read_json(args.report)))
        return 0
    if args.limit_only is not None:
        result = limit_measure(args.device, args.torch_threads or None, plan,
                               args.limit_batch_sizes, args.backend, args.onnx_threads or None)
        args.limit_only.write_text(json.dumps(result), encoding="utf-8")
        return 0

    import uvloop

    began = time.perf_counter()
    data: Json = {"meta": benchlib.meta(sys.argv), "settings": {
        "model": MODEL, "device": args.device, "backend": args.backend, "reps": args.reps,
        "quick": args.quick,
        "concurrency": args.concurrency, "policies": {p: POLICY_BATCHING[p]
                                                      for p in args.policies},
        "plan": asdict(plan), "limit_batch_sizes": args.limit_batch_sizes,
        "torch_threads": args.torch_threads, "onnx_threads": args.onnx_threads,
        "url": args.url}}
    print("[model_http] in-process limit ...", file=sys.stderr, flush=True)
    data["limit"] = [run_limit(args)]
    with tempfile.TemporaryDirectory(prefix="ember-bench-") as tmp:
        folder = Path(tmp)
        if args.url:
            names, server, base, pid = {"default": MODEL}, None, args.url.rstrip("/"), None
        else:
            names = policy_models(folder, args.policies)
            server = loadgen.Server(serve_args(args, folder, names), folder / "server.log")
            server.start()
            base, pid = server.url, server.pid
        try:
            if server is not None:
                print(f"[model_http] starting {' '.join(server.command)}", file=sys.stderr,
                      flush=True)
                data["server_ready_s"] = server.wait_ready()
            t0 = time.perf_counter()
            data["load"] = uvloop.run(load_phase(args, base, names, pid, plan))
            data["load_s"] = time.perf_counter() - t0
        finally:
            if server is not None:
                server.stop()
    if not args.quick:  # the limit again: the two bracket the machine's drift
        print("[model_http] in-process limit again ...", file=sys.stderr, flush=True)
        data["limit"].append(run_limit(args))
    data["summary"] = {
        "sequential": summarize(data["load"]["sequential"]),
        "closed": {name: summarize(case["reps"])
                   for name, case in data["load"]["closed"].items()},
    }
    data["ember_vs_limit"] = ember_vs_limit(data)
    return benchlib.finish(args.out, data, began, markdown(data), "model_http")


if __name__ == "__main__":
    sys.exit(main())
