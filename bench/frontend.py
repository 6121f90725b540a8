#!/usr/bin/env python
"""Front-end benchmark: `ember serve` over HTTP, loaded by aiohttp clients, with a
model fast enough that the request path (HTTP, validation, tokenization, encoding)
is what limits it.

By default the server serves the SYNTHETIC GPU-like model `ember/synthetic` (a
benchmark model: its vectors mean nothing; a forward sleeps 2 ms + 0.5 us per
padded token, so the CPU stays free for the front end). Items/s are set against the
modelled device's capacity, computed from that cost model and the batch limits.

Each variant is a named list of `ember serve` arguments; every variant's server is
started once (127.0.0.1, a free port), and every repetition runs the variants
interleaved (A B C, A B C): a sequential client (one text), then closed loops at each
in-flight level with 1 and with 16 texts per request. Ratios to the first variant are
per repetition, median (min-max). CPU is measured over each server's whole process
tree (psutil: the server and all its descendants), per process, and for the client.

    python bench/frontend.py                                  # full run, ~4 min on 2 cores
    python bench/frontend.py --landed-src ../wt-landed/src    # + the landed code, same sitting
    python bench/frontend.py --variant w2="--workers 2"       # any serve arguments, named
    python bench/frontend.py --tree before=../wt-before/src   # another source tree, named
    python bench/frontend.py --quick                          # smoke run, seconds
    python bench/frontend.py --model sentence-transformers/all-MiniLM-L6-v2 --device cuda
    python bench/frontend.py --report docs/bench/frontend.json   # tables only
"""

from __future__ import annotations

import argparse
import gc
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import benchlib
import loadgen
from benchlib import Json, fmt_spread, median, summarize, table
from loadgen import Plan

SYNTHETIC = "ember/synthetic"
BASE_VARIANT = "single"
LANDED = "landed"
GRANIAN = "granian"
FULL_REPS = 3
FULL = Plan(sequential=200, warmup_s=0.4, closed_s=2.0)
QUICK = Plan(sequential=10, warmup_s=0.1, closed_s=0.5)
BODIES_PER_SIZE = 256
TARGET_LEVEL = 32  # the reference level


# -- the modelled device ---------------------------------------------------------------------

@dataclass(frozen=True)
class Device:
    """The synthetic model's cost model and the batch limits it is served under."""

    overhead_ms: float
    per_token_us: float
    max_batch_items: int
    max_batch_tokens: int
    item_tokens: int  # the synthetic model's cost of one short text (its word count)

    def forward_ms(self, items: int) -> float:
        return self.overhead_ms + self.per_token_us * items * self.item_tokens / 1000

    @property
    def full_batch(self) -> int:
        return max(1, min(self.max_batch_items, self.max_batch_tokens // self.item_tokens))

    def items_per_s(self, items_in_flight: int | None = None) -> float:
        """Items/s with every forward as full as the limits, or the items in flight, allow."""
        batch = self.full_batch if items_in_flight is None else min(self.full_batch,
                                                                    items_in_flight)
        return batch / self.forward_ms(batch) * 1000


def modelled_device(model: str) -> Device | None:
    """The cost model of a synthetic catalog model under its batching (None otherwise)."""
    from ember.config import load_catalog
    from ember.engine import WorkerConfig

    spec = load_catalog().get(model)
    if spec is None or spec.adapter != "synthetic":
        return None
    config = spec.worker_config(WorkerConfig())
    options = spec.options
    return Device(overhead_ms=float(options.get("overhead_ms", 2.0)),
                  per_token_us=float(options.get("per_token_us", 0.5)),
                  max_batch_items=config.max_batch_items,
                  max_batch_tokens=config.batch_tokens,
                  item_tokens=max(1, len(loadgen.texts("short", 1)[0].split())))


# -- one server per variant --------------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    name: str
    serve_args: tuple[str, ...]
    pythonpath: str | None = None
    program: tuple[str, ...] = ("-m", "ember.cli", "serve")  # what serves it


def variants_of(args: argparse.Namespace) -> list[Variant]:
    """`single` (no extra arguments) first, then each --variant and --tree, then `landed`."""
    found: dict[str, Variant] = {BASE_VARIANT: Variant(BASE_VARIANT, ())}
    for spec in args.variant:
        name, _, serve_args = spec.partition("=")
        found[name.strip()] = Variant(name.strip(), tuple(shlex.split(serve_args)))
    for spec in args.tree:
        name, _, src = spec.partition("=")
        found[name.strip()] = Variant(name.strip(), (), str(Path(src).resolve()))
    if args.granian:  # the same app and settings under granian instead of uvicorn
        found[GRANIAN] = Variant(GRANIAN, (), None, (str(Path(__file__).with_name(
            "granian_serve.py")),))
    if args.landed_src is not None:
        found[LANDED] = Variant(LANDED, tuple(shlex.split(args.landed_args)),
                                str(Path(args.landed_src).resolve()))
    return list(found.values())


def start_servers(variants: Sequence[Variant], args: argparse.Namespace,
                  folder: Path) -> dict[str, loadgen.Server]:
    base_args = ["--default-model", args.model, "--device", args.device, *args.serve_arg]
    servers = {}
    for v in variants:
        server = loadgen.Server([*base_args, *v.serve_args], folder / f"{v.name}.log",
                                pythonpath=v.pythonpath, program=v.program)
        print(f"[frontend] {v.name}: {' '.join(server.command)}"
              + (f" (PYTHONPATH={v.pythonpath})" if v.pythonpath else ""),
              file=sys.stderr, flush=True)
        servers[v.name] = server.start()
    return servers


# -- the measures ----------------------------------------------------------------------------

def per_process(cpu_s: dict[str, float], requests: float, forwards: float) -> Json:
    return {label: {"cpu_s": s, "cpu_ms_per_request": 1000 * benchlib.ratio(s, requests),
                    "cpu_ms_per_forward": 1000 * benchlib.ratio(s, forwards)}
            for label, s in cpu_s.items()}


async def measure_closed(session: Any, server: loadgen.Server, model: str,
                         payloads: Sequence[bytes], texts_per_request: int, clients: int,
                         plan: Plan, device: Device | None) -> Json:
    """One closed loop: rates, latency, batches, and CPU of the server tree and client."""
    async def snapshot() -> Json:
        return {"tree": loadgen.tree_cpu(server.pid),
                "counters": await loadgen.batch_counters(session, server.url, model)}

    run = await loadgen.closed_loop(session, f"{server.url}/v1/encode/{model}", payloads,
                                    clients, plan.warmup_s, plan.closed_s, snapshot)
    begin, end = run.marks["begin"], run.marks["end"]
    cpu = loadgen.tree_cpu_delta(begin["tree"], end["tree"])
    batches = loadgen.batch_deltas(begin["counters"], end["counters"])
    requests = run.requests_per_s * plan.closed_s
    server_cpu = sum(cpu.values())
    items_per_s = run.requests_per_s * texts_per_request
    summary = run.summary()
    result: Json = {
        **summary, "items_per_s": items_per_s,
        "p99_over_p50": benchlib.ratio(summary["latency_p99_ms"], summary["latency_p50_ms"]),
        "server_cpu_cores": server_cpu / plan.closed_s,
        "server_cpu_ms_per_request": 1000 * benchlib.ratio(server_cpu, requests),
        "server_cpu_ms_per_item": 1000 * benchlib.ratio(server_cpu,
                                                        requests * texts_per_request),
        "client_cpu_ms_per_request": 1000 * benchlib.ratio(run.client_cpu_s, requests),
        "forwards_per_s": batches["forwards"] / plan.closed_s,
        "items_per_forward": batches["items_per_forward"],
        "processes": len(cpu),
        "per_process": per_process(cpu, requests, batches["forwards"]),
    }
    if device is not None:
        result["capacity_items_per_s"] = device.items_per_s()
        result["capacity_at_level_items_per_s"] = device.items_per_s(clients * texts_per_request)
        result["items_over_capacity"] = items_per_s / device.items_per_s()
        result["items_over_capacity_at_level"] = items_per_s / result[
            "capacity_at_level_items_per_s"]
    return result


def case_name(texts_per_request: int, clients: int) -> str:
    return f"t{texts_per_request}_c{clients}"


async def warm_up(session: Any, servers: dict[str, loadgen.Server], model: str,
                  payloads: dict[int, list[bytes]]) -> None:
    for server in servers.values():
        for bodies in payloads.values():
            for body in bodies[:8]:
                await loadgen.post(session, f"{server.url}/v1/encode/{model}", body)


async def load(args: argparse.Namespace, servers: dict[str, loadgen.Server],
               device: Device | None, plan: Plan) -> Json:
    payloads = {t: loadgen.encode_bodies("short", BODIES_PER_SIZE, t)
                for t in args.texts_per_request}
    names = list(servers)
    cases = [(t, c) for t in args.texts_per_request for c in args.levels]
    out: Json = {"sequential": {n: [] for n in names}, "closed": {
        case_name(t, c): {"texts_per_request": t, "clients": c, "reps": {n: [] for n in names}}
        for t, c in cases}, "loadavg_per_rep": []}
    began = time.perf_counter()
    async with loadgen.client_session(max(args.levels) + 8) as session:
        await warm_up(session, servers, args.model, payloads)
        for rep in range(args.reps):
            for name in names:  # interleaved: A B C
                out["sequential"][name].append(await loadgen.sequential(
                    session, f"{servers[name].url}/v1/encode/{args.model}", payloads[1],
                    plan.sequential))
            for t, c in cases:
                for name in names:  # interleaved: A B C, then the next case
                    gc.collect()
                    result = await measure_closed(session, servers[name], args.model,
                                                  payloads[t], t, c, plan, device)
                    out["closed"][case_name(t, c)]["reps"][name].append(result)
            out["loadavg_per_rep"].append(benchlib.loadavg())
            print(f"[frontend] repetition {rep + 1}/{args.reps} done "
                  f"({time.perf_counter() - began:.0f} s)", file=sys.stderr, flush=True)
    return out


def per_process_medians(runs: Sequence[Json]) -> Json:
    """Per process label: the median over repetitions of its CPU per request and forward."""
    labels = dict.fromkeys(label for r in runs for label in r["per_process"])
    return {label: {key: median(r["per_process"][label][key] for r in runs
                                if label in r["per_process"])
                    for key in ("cpu_ms_per_request", "cpu_ms_per_forward")}
            for label in labels}


def summarize_load(loaded: Json) -> Json:
    return {
        "sequential": summarize(loaded["sequential"], BASE_VARIANT),
        "closed": {name: {**summarize(case["reps"], BASE_VARIANT),
                          "per_process": {v: per_process_medians(runs)
                                          for v, runs in case["reps"].items()}}
                   for name, case in loaded["closed"].items()},
    }


# -- the targets ---------------------------------------------------------------------

def targets(data: Json) -> Json:
    """The figures issue 10 asks for, from the single-text runs of each variant."""
    closed = data["summary"]["closed"]
    levels = data["settings"]["levels"]
    out: Json = {}
    for name in data["settings"]["variants"]:
        if 1 not in data["settings"]["texts_per_request"]:
            break
        rps = {str(c): closed[case_name(1, c)][name]["median"]["requests_per_s"]
               for c in levels}
        entry: Json = {
            "cpu_ms_per_request": {str(c): closed[case_name(1, c)][name]["median"][
                "server_cpu_ms_per_request"] for c in levels},
            "requests_per_s": rps,
            "max_p99_over_p50": max(closed[case_name(t, c)][name]["median"]["p99_over_p50"]
                                    for t in data["settings"]["texts_per_request"]
                                    for c in levels),
        }
        if TARGET_LEVEL in levels:
            entry["rps_over_c32"] = {str(c): benchlib.ratio(rps[str(c)], rps[str(TARGET_LEVEL)])
                                     for c in levels if c > TARGET_LEVEL}
        out[name] = entry
    if LANDED in out and TARGET_LEVEL in levels:
        reps = data["load"]["closed"][case_name(1, TARGET_LEVEL)]["reps"]
        out["rps_c32_over_landed"] = {
            name: benchlib.spread([benchlib.ratio(a["requests_per_s"], b["requests_per_s"])
                                   for a, b in zip(reps[name], reps[LANDED], strict=True)])
            for name in reps if name != LANDED}
    return out


# -- the report ------------------------------------------------------------------------------

def header(data: Json) -> list[str]:
    s, out = data["settings"], []
    device = s["device_model"]
    if device is not None:
        dev = Device(**device)
        out.append(f"Model `{s['model']}` (SYNTHETIC, a benchmark model: a forward sleeps "
                   f"{dev.overhead_ms:g} ms + {dev.per_token_us:g} us per padded token); "
                   f"short texts of {dev.item_tokens} tokens; batches of at most "
                   f"{dev.max_batch_items} items and {dev.max_batch_tokens} padded tokens, so "
                   f"the modelled device does {dev.full_batch} items per "
                   f"{dev.forward_ms(dev.full_batch):.2f} ms forward = "
                   f"{dev.items_per_s():,.0f} items/s (capacity). \"cap. at level\" is "
                   f"min(items in flight, full batch) per forward.")
    else:
        out.append(f"Model `{s['model']}` on {s['device']}; short texts (10 words).")
    out.append(f"\n{s['reps']} repetitions, variants interleaved in each; ratios to "
               f"`{BASE_VARIANT}` per repetition, median (min-max). Variants: "
               + "; ".join(f"`{n}` = `{' '.join(v['serve_args']) or '(no extra args)'}`"
                           + (f" from {v['pythonpath']}" if v["pythonpath"] else "")
                           for n, v in s["variants"].items())
               + f". Load average per repetition: {data['load']['loadavg_per_rep']}.\n")
    return out


def closed_table(data: Json) -> str:
    rows = []
    for name, case in data["summary"]["closed"].items():
        meta = data["load"]["closed"][name]
        for variant in data["settings"]["variants"]:
            m = case[variant]["median"]
            rows.append([meta["texts_per_request"], meta["clients"], variant,
                         m["requests_per_s"], m["items_per_s"],
                         m.get("items_over_capacity_at_level"), m.get("items_over_capacity"),
                         m["latency_p50_ms"], m["latency_p99_ms"], m["p99_over_p50"],
                         m["items_per_forward"], m["server_cpu_ms_per_request"],
                         m["server_cpu_cores"], m["client_cpu_cores"],
                         fmt_spread(case[variant][f"ratio_to_{BASE_VARIANT}"]
                                    ["requests_per_s"])])
    return table(["texts/req", "in flight", "variant", "req/s", "items/s",
                  "items/s / cap. at level", "items/s / capacity", "p50 ms", "p99 ms",
                  "p99/p50", "items/forward", "server CPU ms/req", "server cores",
                  "client cores", f"req/s / {BASE_VARIANT}"], rows)


def process_table(data: Json) -> str:
    """CPU ms per request of every server process, single-text requests, by level."""
    levels = data["settings"]["levels"]
    rows = []
    for variant in data["settings"]["variants"]:
        labels = dict.fromkeys(label for c in levels for label in data["summary"]["closed"]
                               [case_name(1, c)]["per_process"][variant])
        for label in labels:
            cells = [data["summary"]["closed"][case_name(1, c)]["per_process"][variant]
                     .get(label, {}).get("cpu_ms_per_request") for c in levels]
            rows.append([variant, f"`{label}`", *cells])
    return table(["variant", "process", *(f"{c} in flight" for c in levels)], rows)


def joined(values: Any) -> str:
    return " / ".join(benchlib.fmt(v) for v in values)


def targets_table(data: Json) -> str:
    t, rows = data["targets"], []
    levels = ", ".join(map(str, data["settings"]["levels"]))
    for name in data["settings"]["variants"]:
        if name not in t:
            continue
        e = t[name]
        rows.append([f"{name}: server CPU ms per single-text request ({levels} in flight)",
                     joined(e["cpu_ms_per_request"].values())])
        if e.get("rps_over_c32"):
            rows.append([f"{name}: single-text req/s at {', '.join(e['rps_over_c32'])} in "
                         f"flight / at {TARGET_LEVEL}", joined(e["rps_over_c32"].values())])
        rows.append([f"{name}: largest p99/p50 over all levels", e["max_p99_over_p50"]])
    for name, s in t.get("rps_c32_over_landed", {}).items():
        rows.append([f"{name} / {LANDED}: single-text req/s at {TARGET_LEVEL} in flight",
                     fmt_spread(s)])
    return table(["measure", "value"], rows)


def markdown(data: Json) -> str:
    out = header(data)
    seq = data["summary"]["sequential"]
    out.append("Sequential client (one text per request):\n")
    out.append(table(["variant", "p50 ms", "p99 ms", "X-Queue-Time p50 ms",
                      "X-Inference-Time p50 ms", f"p50 / {BASE_VARIANT}"],
                     [benchlib.summary_row(seq[v], v, ["latency_p50_ms", "latency_p99_ms",
                                                       "queue_p50_ms", "inference_p50_ms"],
                                           ["latency_p50_ms"], BASE_VARIANT) for v in seq]))
    out.append("\nClosed loop (medians over repetitions):\n")
    out.append(closed_table(data))
    out.append("\nServer CPU per single-text request by process (ms, medians):\n")
    out.append(process_table(data))
    out.append("\nIssue 10's figures:\n")
    out.append(targets_table(data))
    return "\n".join(out) + "\n"


# -- the command -----------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    benchlib.add_common_args(parser, Path("docs/bench/frontend.json"), FULL_REPS,
                             "smoke run (seconds)")
    parser.add_argument("--levels", default="1,8,32,128,256", help="requests in flight")
    parser.add_argument("--texts-per-request", default="1,16")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                        help="a server variant: a name and its extra `ember serve` arguments "
                        "(repeatable), e.g. w2=\"--workers 2\"; `single` (no extra "
                        "arguments) always runs first and is the ratios' base")
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=SRC",
                        help="a server variant run from another source tree (PYTHONPATH), "
                        "with no extra arguments (repeatable), e.g. before=../wt/src")
    parser.add_argument("--landed-src", type=Path, default=None,
                        help="add the variant `landed`: the same server run from this "
                        "source tree (PYTHONPATH), for a same-sitting comparison")
    parser.add_argument("--landed-args", default="",
                        help="extra `ember serve` arguments of the `landed` variant")
    parser.add_argument("--granian", action="store_true",
                        help="add the variant `granian`: one process, the same ASGI app "
                        "served by granian instead of uvicorn (bench/granian_serve.py)")
    parser.add_argument("--model", default=SYNTHETIC,
                        help="the model served as the default and loaded")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="an argument passed to every variant's server (repeatable)")
    parser.add_argument("--closed-s", type=float, default=None,
                        help="measured window of each closed loop (overrides the plan)")
    args = parser.parse_args(argv)
    args.levels = benchlib.int_list(args.levels)
    args.texts_per_request = benchlib.int_list(args.texts_per_request)
    for spec in args.variant:
        if "=" not in spec or not spec.partition("=")[0].strip():
            parser.error(f"--variant {spec!r}: use NAME=ARGS")
    benchlib.resolve_reps(args, FULL_REPS)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report is not None:
        print(markdown(benchlib.read_json(args.report)))
        return 0
    import uvloop

    plan = QUICK if args.quick else FULL
    if args.closed_s is not None:
        plan = Plan(plan.sequential, plan.warmup_s, args.closed_s)
    device = modelled_device(args.model)
    variants = variants_of(args)
    began = time.perf_counter()
    data: Json = {"meta": benchlib.meta(sys.argv), "settings": {
        "model": args.model, "device": args.device, "reps": args.reps, "quick": args.quick,
        "levels": args.levels, "texts_per_request": args.texts_per_request,
        "plan": asdict(plan), "serve_args": args.serve_arg,
        "variants": {v.name: {"serve_args": list(v.serve_args), "pythonpath": v.pythonpath}
                     for v in variants},
        "device_model": asdict(device) if device else None}}
    with tempfile.TemporaryDirectory(prefix="ember-frontend-") as tmp:
        servers = start_servers(variants, args, Path(tmp))
        try:
            data["server_ready_s"] = {n: s.wait_ready() for n, s in servers.items()}
            data["load"] = uvloop.run(load(args, servers, device, plan))
        finally:
            data["server_exit_codes"] = {n: s.stop() for n, s in servers.items()}
    data["summary"] = summarize_load(data["load"])
    data["targets"] = targets(data)
    return benchlib.finish(args.out, data, began, markdown(data), "frontend")


if __name__ == "__main__":
    sys.exit(main())
