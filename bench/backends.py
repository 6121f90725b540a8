#!/usr/bin/env python
"""The forward backends side by side: torch, ONNX Runtime fp32 and ONNX Runtime int8,
on the default model, in one run, interleaved (A B C, A B C ...).

Variants: `torch-main` (torch with main's defaults: torch's own thread count, every
core), `torch` (torch with this branch's default threads, all cores but one), `onnx`
(ONNX Runtime float32, the default backend) and `onnx-int8` (`quantize: int8`).

Each repetition measures, variant after variant, never two at once:
1. the in-process limit (a child process: the adapter's tokenize + forward called
   directly): one-text p50, items/s at batch 8 and 32;
2. Ember over HTTP (one `ember serve` per variant on 127.0.0.1, all started up front,
   stopped at the end): sequential p50, requests/s at 8 and 32 in flight;
3. the same over HTTP with a competing process spinning on one core.
Plus int8's parity with float32 on the fixed retrieval set (bench/retrieval.py).

    flock /tmp/ember-bench.lock python bench/backends.py          # ~5 min on 2 cores
    python bench/backends.py --quick                              # smoke run
    python bench/backends.py --report docs/bench/backends.json    # tables only
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path += [str(HERE), str(HERE.parent)]  # its siblings, and `bench.retrieval`

import benchlib  # noqa: E402
import loadgen  # noqa: E402
from benchlib import Json, fmt_spread, median, percentile, spread, table  # noqa: E402
from model_http import MODEL  # noqa: E402

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


@dataclass(frozen=True)
class Variant:
    label: str
    backend: str
    quantize: str | None = None
    torch_threads: int | None = None  # None: Ember's default
    onnx_threads: int | None = None  # None: Ember's default
    onnx_spinning: str = "forward"  # off, forward (Ember's default) or on

    def env(self) -> dict[str, str]:
        """The EMBER_* variables that give `ember serve` this variant's threads."""
        env = {"EMBER_ONNX_SPINNING": self.onnx_spinning}
        for name, value in (("TORCH", self.torch_threads), ("ONNX", self.onnx_threads)):
            if value:
                env[f"EMBER_{name}_THREADS"] = str(value)
        return env


VARIANTS = {
    "torch-main": Variant(f"torch, main's defaults ({CORES} threads)", "torch",
                          torch_threads=CORES),
    "torch": Variant("torch, default threads", "torch"),
    "onnx": Variant("ONNX Runtime fp32 (default)", "onnx"),
    "onnx-int8": Variant("ONNX Runtime int8", "onnx", quantize="int8"),
    # Not run by default: the thread settings the defaults were chosen against.
    "onnx-all-cores": Variant(f"ONNX Runtime fp32, {CORES} threads", "onnx",
                              onnx_threads=CORES),
    "onnx-spinning": Variant("ONNX Runtime fp32, spinning on", "onnx", onnx_spinning="on"),
}
DEFAULT_VARIANTS = ("torch-main", "torch", "onnx", "onnx-int8")
BASELINES = ("torch-main", "torch")
DEFAULT = "onnx"


@dataclass(frozen=True)
class Plan:
    reps: int
    limit_single: int
    limit_budget_s: float
    sequential: int
    warmup_s: float
    closed_s: float


FULL = Plan(reps=3, limit_single=40, limit_budget_s=1.5, sequential=40, warmup_s=0.3,
            closed_s=2.5)
QUICK = Plan(reps=1, limit_single=5, limit_budget_s=0.3, sequential=5, warmup_s=0.1,
             closed_s=1.0)


def spec_for(variant: Variant) -> Any:
    from ember.config import load_catalog

    return dataclasses.replace(load_catalog()[MODEL], backend=variant.backend,
                               quantize=variant.quantize)


# -- the in-process limit (a child process) --------------------------------------------

def limit_measure(names: Sequence[str], plan: Plan, batch_sizes: Sequence[int]) -> Json:
    """Every variant's adapter in this process, measured one after the other: torch's
    thread count is process-wide, so it is set before each torch variant."""
    import torch

    from ember.adapters import transformer
    from ember.adapters.base import EncodeOptions, Runtime, default_threads
    from ember.config import spinning_mode

    adapters = {n: transformer.load(spec_for(VARIANTS[n]), Runtime(
        onnx_threads=VARIANTS[n].onnx_threads,
        onnx_spinning=spinning_mode(VARIANTS[n].onnx_spinning)))
        for n in names}
    short = loadgen.texts("short", 256)
    options = EncodeOptions()

    def run(adapter: Any, batch: Sequence[str]) -> None:
        items, params = adapter.prepare(batch, options)
        adapter.forward(items, params)

    out: Json = {}
    for name in names:
        adapter = adapters[name]
        torch.set_num_threads(VARIANTS[name].torch_threads or default_threads())
        for _ in range(3):
            run(adapter, short[:8])
        single = []
        for text in short[:plan.limit_single]:
            t0 = time.perf_counter()
            run(adapter, [text])
            single.append((time.perf_counter() - t0) * 1000)
        rates = {}
        for size in batch_sizes:
            done, t0 = 0, time.perf_counter()
            for i in range(0, len(short), size):
                run(adapter, short[i:i + size])
                done += size
                if time.perf_counter() - t0 > plan.limit_budget_s:
                    break
            rates[str(size)] = done / (time.perf_counter() - t0)
        out[name] = {"single_p50_ms": percentile(single, 50),
                     "single_p99_ms": percentile(single, 99), "items_per_s": rates,
                     "torch_threads": torch.get_num_threads()}
    return out


def run_limit(args: argparse.Namespace) -> Json:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "limit.json"
        command = [sys.executable, __file__, "--limit-only", str(out),
                   "--variants", ",".join(args.variants)]
        if args.quick:
            command.append("--quick")
        subprocess.run(command, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        result: Json = json.loads(out.read_text(encoding="utf-8"))
        return result


# -- parity of int8 against fp32 ---------------------------------------------------------

def int8_parity() -> Json:
    import numpy as np

    from bench.retrieval import cosines, retrieval_set, top_k_overlap
    from ember.adapters import transformer
    from ember.adapters.base import EncodeOptions, Runtime

    texts = retrieval_set()
    vectors: dict[str, Any] = {}
    for name in ("onnx", "onnx-int8"):
        adapter = transformer.load(spec_for(VARIANTS[name]), Runtime())
        for side, batch in (("queries", texts.queries), ("documents", texts.documents)):
            items, params = adapter.prepare(batch, EncodeOptions())
            vectors[f"{name}/{side}"] = np.stack(adapter.forward(items, params))
    fp32 = np.vstack([vectors["onnx/queries"], vectors["onnx/documents"]])
    int8 = np.vstack([vectors["onnx-int8/queries"], vectors["onnx-int8/documents"]])
    cos = cosines(fp32, int8)
    overlap = top_k_overlap(vectors["onnx/queries"], vectors["onnx/documents"],
                            vectors["onnx-int8/queries"], vectors["onnx-int8/documents"])
    return {"queries": len(texts.queries), "documents": len(texts.documents),
            "cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()),
            "top10_overlap_mean": float(overlap.mean()),
            "top10_overlap_min": float(overlap.min())}


# -- the servers and the load -------------------------------------------------------------

def start_servers(names: Sequence[str], root: Path, servers: dict[str, Any]) -> None:
    """One `ember serve` per variant into `servers`, each serving the default model
    under that variant's backend (a catalog entry of the same name overrides the
    built-in one)."""
    import yaml

    from ember.config import BUILTIN_CATALOG

    source = next(p for p in sorted(BUILTIN_CATALOG.glob("*.yaml"))
                  if yaml.safe_load(p.read_text(encoding="utf-8")).get("name") == MODEL)
    for name in names:
        variant = VARIANTS[name]
        folder = root / name
        folder.mkdir()
        entry = {**yaml.safe_load(source.read_text(encoding="utf-8")),
                 "backend": variant.backend}
        if variant.quantize:
            entry["quantize"] = variant.quantize
        (folder / "model.yaml").write_text(yaml.safe_dump(entry), encoding="utf-8")
        servers[name] = loadgen.Server(["--model-dir", str(folder)], folder / "server.log",
                                       env=variant.env()).start()
    for name, server in servers.items():
        print(f"[backends] {name}: {' '.join(server.command)}", file=sys.stderr, flush=True)
        server.wait_ready(timeout_s=300)


@contextlib.contextmanager
def competing_load() -> Iterator[subprocess.Popen[bytes]]:
    """A process spinning on one core for as long as the block runs."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # let it take its core
        yield spinner
    finally:
        spinner.kill()
        spinner.wait()


async def measure_server(session: Any, base: str, pid: int, payloads: Sequence[bytes],
                         plan: Plan, concurrency: Sequence[int]) -> Json:
    url = f"{base}/v1/encode/{MODEL}"
    out: Json = {"sequential": await loadgen.sequential(session, url, payloads,
                                                        plan.sequential)}

    async def cpu() -> Json:
        return {"cpu": sum(s for _, s in loadgen.tree_cpu(pid).values())}

    for clients in concurrency:
        loop = await loadgen.closed_loop(session, url, payloads, clients, plan.warmup_s,
                                         plan.closed_s, snapshot=cpu)
        summary = loop.summary()
        summary["server_cpu_cores"] = ((loop.marks["end"]["cpu"] - loop.marks["begin"]["cpu"])
                                       / plan.closed_s)
        out[f"c{clients}"] = summary
    return out


async def load_phase(args: argparse.Namespace, servers: dict[str, Any], plan: Plan,
                     limits: list[Json]) -> Json:
    payloads = loadgen.encode_bodies("short", 256)
    most = max(args.concurrency)
    out: Json = {"quiet": {n: [] for n in servers}, "contended": {n: [] for n in servers}}
    async with loadgen.client_session(most + 4) as client:
        for server in servers.values():  # warm every path up
            for body in payloads[:8]:
                await loadgen.post(client, f"{server.url}/v1/encode/{MODEL}", body)
        for rep in range(plan.reps):
            limits.append(run_limit(args))
            for name, server in servers.items():
                out["quiet"][name].append(await measure_server(
                    client, server.url, server.pid, payloads, plan, args.concurrency))
            with competing_load():
                for name, server in servers.items():
                    out["contended"][name].append(await measure_server(
                        client, server.url, server.pid, payloads, plan,
                        args.concurrency))
            out.setdefault("loadavg_per_rep", []).append(benchlib.loadavg())
            print(f"[backends] repetition {rep + 1}/{plan.reps} done", file=sys.stderr,
                  flush=True)
    return out


# -- summary and report ---------------------------------------------------------------------

def case_keys(concurrency: Sequence[int]) -> list[tuple[str, str, str]]:
    """(label, case, field) of every HTTP figure the summary keeps."""
    keys = [("sequential p50 ms", "sequential", "latency_p50_ms")]
    for c in concurrency:
        keys += [(f"{c} in flight req/s", f"c{c}", "requests_per_s"),
                 (f"{c} in flight p50 ms", f"c{c}", "latency_p50_ms")]
    return keys


def summarize(data: Json) -> Json:
    concurrency = data["settings"]["concurrency"]
    load = data["load"]
    names = list(load["quiet"])
    out: Json = {"limit": {}, "quiet": {}, "contended": {}, "vs": {}, "contention": {}}
    for name in names:
        per_rep = [lim[name] for lim in data["limit"]]
        out["limit"][name] = {
            "single_p50_ms": median(r["single_p50_ms"] for r in per_rep),
            **{f"b{b}_items_per_s": median(r["items_per_s"][str(b)] for r in per_rep)
               for b in data["settings"]["limit_batch_sizes"]}}
        for phase in ("quiet", "contended"):
            out[phase][name] = {label: median(r[case][field] for r in load[phase][name])
                                for label, case, field in case_keys(concurrency)}
        # Contended over quiet, per repetition (the two ran minutes apart at most).
        out["contention"][name] = {
            label: spread([benchlib.ratio(c[case][field], q[case][field]) for q, c in
                           zip(load["quiet"][name], load["contended"][name], strict=True)])
            for label, case, field in case_keys(concurrency)}
    for base in (b for b in BASELINES if b in names):
        out["vs"][base] = {}
        for name in names:
            out["vs"][base][name] = {
                label: spread([benchlib.ratio(r[case][field], b[case][field])
                               for r, b in zip(load["quiet"][name], load["quiet"][base],
                                               strict=True)])
                for label, case, field in case_keys(concurrency)}
            limits = [(lim[name], lim[base]) for lim in data["limit"]]
            out["vs"][base][name]["limit one text p50"] = spread(
                [benchlib.ratio(a["single_p50_ms"], b["single_p50_ms"]) for a, b in limits])
            for b in data["settings"]["limit_batch_sizes"]:
                out["vs"][base][name][f"limit b{b} items/s"] = spread(
                    [benchlib.ratio(x["items_per_s"][str(b)], y["items_per_s"][str(b)])
                     for x, y in limits])
    return out


def done_when(data: Json) -> list[list[object]]:
    """The issue's targets against this run's figures."""
    s = data["summary"]
    rows: list[list[object]] = []
    for base in (b for b in BASELINES if b in s["vs"]):
        ratios = s["vs"][base][DEFAULT]
        for label, target, better in (("8 in flight req/s", 1.6, "ge"),
                                      ("32 in flight req/s", 1.4, "ge"),
                                      ("sequential p50 ms", 0.5, "le")):
            got = ratios.get(label)
            if not got:
                continue
            ok = got["median"] >= target if better == "ge" else got["median"] <= target
            rows.append([f"{DEFAULT} / {base}: {label}", ("at least " if better == "ge"
                                                          else "at most ") + f"{target}",
                         fmt_spread(got), "yes" if ok else "NO"])
    for name, entry in s["contention"].items():
        got = entry.get("8 in flight p50 ms")
        if got:
            rows.append([f"{name}: 8 in flight p50, contended / quiet", "at most 3",
                         fmt_spread(got), "yes" if got["median"] <= 3 else "NO"])
    return rows


def markdown(data: Json) -> str:
    s = data["summary"]
    names = list(s["quiet"])
    concurrency = data["settings"]["concurrency"]
    sizes = data["settings"]["limit_batch_sizes"]
    out = [f"Model {MODEL}, short texts (~13 tokens), one text per request; "
           f"{data['settings']['reps']} repetitions, variants interleaved; ratios are per "
           f"repetition, median (min-max).\n"]
    out.append("Targets (issue 13):\n")
    out.append(table(["measure", "target", "this run", "met"], done_when(data)))
    out.append("\nIn-process limit (tokenize + forward, the adapter called directly), "
               "medians:\n")
    out.append(table(["variant", "one text p50 ms", *(f"batch {b} items/s" for b in sizes)],
                     [[VARIANTS[n].label, s["limit"][n]["single_p50_ms"],
                       *(s["limit"][n][f"b{b}_items_per_s"] for b in sizes)] for n in names]))
    labels = [label for label, _, _ in case_keys(concurrency)]
    for phase, title in (("quiet", "Ember over HTTP"),
                         ("contended", "Ember over HTTP, a competing process spinning on "
                                       "one core")):
        out.append(f"\n{title}, medians:\n")
        out.append(table(["variant", *labels],
                         [[VARIANTS[n].label, *(s[phase][n][k] for k in labels)]
                          for n in names]))
    out.append("\nContended / quiet, per repetition:\n")
    out.append(table(["variant", *labels],
                     [[VARIANTS[n].label, *(fmt_spread(s["contention"][n][k]) for k in labels)]
                      for n in names]))
    for base, by_name in s["vs"].items():
        keys = list(next(iter(by_name.values())))
        out.append(f"\nEach variant / {VARIANTS[base].label} (quiet):\n")
        out.append(table(["variant", *keys],
                         [[VARIANTS[n].label, *(fmt_spread(by_name[n][k]) for k in keys)]
                          for n in names if n != base]))
    parity = data.get("int8_parity")
    if parity:
        out.append(f"\nint8 against fp32 on the fixed retrieval set ({parity['queries']} "
                   f"queries, {parity['documents']} documents, bench/retrieval.py):\n")
        keys = ("cosine_mean", "cosine_min", "top10_overlap_mean", "top10_overlap_min")
        out.append(table([k.replace("_", " ").replace("top10", "top-10") for k in keys],
                         [[f"{parity[k]:.4f}" for k in keys]]))
    return "\n".join(out) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run")
    parser.add_argument("--out", type=Path, default=Path("docs/bench/backends.json"))
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated, of {list(VARIANTS)}")
    parser.add_argument("--concurrency", default="8,32", help="closed-loop in-flight counts")
    parser.add_argument("--report", type=Path, default=None,
                        help="print the markdown tables of an earlier JSON result and exit")
    parser.add_argument("--limit-only", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.variants = [v for v in str(args.variants).split(",") if v]
    if set(args.variants) - set(VARIANTS) or DEFAULT not in args.variants:
        parser.error(f"--variants needs {DEFAULT!r} and only names of {list(VARIANTS)}")
    args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c]
    return args


LIMIT_BATCH_SIZES = (8, 32)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.report is not None:  # the tables of an earlier run
        print(markdown(json.loads(args.report.read_text(encoding="utf-8"))))
    elif args.limit_only is not None:  # the child process of run_limit
        measured = limit_measure(args.variants, plan, LIMIT_BATCH_SIZES)
        args.limit_only.write_text(json.dumps(measured), encoding="utf-8")
    else:
        run(args, plan)
    return 0


def run(args: argparse.Namespace, plan: Plan) -> None:
    """The whole benchmark: servers, load, limits and parity; JSON and tables out."""
    import uvloop

    began = time.perf_counter()
    data: Json = {"meta": benchlib.meta(sys.argv), "settings": {
        "model": MODEL, "reps": plan.reps, "quick": args.quick,
        "variants": {n: dataclasses.asdict(VARIANTS[n]) for n in args.variants},
        "concurrency": args.concurrency, "plan": dataclasses.asdict(plan),
        "limit_batch_sizes": list(LIMIT_BATCH_SIZES), "cores": CORES,
        "competing_load": "one Python process spinning (while True: pass), unpinned"}}
    with tempfile.TemporaryDirectory(prefix="ember-backends-") as tmp:
        print("[backends] starting one server per variant ...", file=sys.stderr, flush=True)
        servers: dict[str, Any] = {}
        try:
            start_servers(args.variants, Path(tmp), servers)
            data["limit"] = []
            data["load"] = uvloop.run(load_phase(args, servers, plan, data["limit"]))
        finally:
            for server in servers.values():
                server.stop()
    if "onnx-int8" in args.variants:
        data["int8_parity"] = int8_parity()
    data["summary"] = summarize(data)
    data["meta"].update(duration_s=round(time.perf_counter() - began, 1),
                        loadavg_at_end=benchlib.loadavg())
    benchlib.write_json(args.out, data)
    print(f"{markdown(data)}\n[backends] wrote {args.out} in {data['meta']['duration_s']} s")


if __name__ == "__main__":
    sys.exit(main())
