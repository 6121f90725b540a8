#!/usr/bin/env python
"""Search queries beside a bulk indexing job, in one worker: what a query waits.

The real `ModelWorker` on the synthetic device (a forward sleeps what its cost model
says). Bulk clients send requests of 64 documents of 16-256 tokens each, in a closed loop
(the next as soon as one is answered), while queries of one 8-24 token text arrive as a
Poisson stream in their own parameter group (`is_query`, as an asymmetric model's queries
have). Each repetition runs the default (a request with at most a quarter of the items of
the largest queued leads the next forward) and `lead_ratio=0` (every batch is the sweep's,
as before), interleaved A B A B on the same seeds.

Reported per variant (median over repetitions, and the ratio to the default's run of the
same repetition): the queries' wait in the queue (submit to dispatch) and latency (submit
to answer), p50 / p99 / longest; the bulk requests' latency and the documents served per
second; the forwards' padding.

With `--http`, the same over HTTP on the default model (all-MiniLM-L6-v2): `ember serve`
with its defaults and with `--lead-ratio 0` (or the `--variants` named), one at a time,
alternating; bulk clients post 64 texts of 5-120 words (`--documents long`: 300-400, cut
to the model's 256 tokens) to /v1/encode, queries one 10-word text with `is_query`. The
documents a second are the items the server's forwards held in the window (its
/metrics), less the queries.

    python bench/bulk_queries.py                 # ~2 min on 2 cores
    python bench/bulk_queries.py --quick         # ~20 s
    python bench/bulk_queries.py --http          # ~4 min on 2 cores
    python bench/bulk_queries.py --http --documents long \
        --variants default,max_batch_tokens=16384 --reps 3 --seconds 40   # ~6 min
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import benchlib
import loadgen
import numpy as np
from benchlib import Json, table
from scheduler import BenchAdapter, Forwards

from ember import heap
from ember.adapters.synthetic import CostModel
from ember.engine import ModelWorker, PreparedItem, WorkerConfig

OUT = Path(__file__).resolve().parents[1] / "docs" / "bench" / "bulk_queries.json"
COSTS = {
    # a GPU-like device: a fixed 2 ms and 0.5 us a padded token (bench/scheduler.py's)
    "gpu": CostModel(overhead_ms=2.0, per_token_us=0.5, mode="sleep"),
    # a slower one, where a full forward of long documents lasts a few hundred ms
    "slow": CostModel(overhead_ms=2.0, per_token_us=20.0, mode="sleep"),
}
VARIANTS = {"default": WorkerConfig(), "lead_ratio=0": WorkerConfig(lead_ratio=0.0)}
DOCUMENTS = 64  # a bulk request, as indexing clients send them
DOC_TOKENS = (16, 256)
QUERY_TOKENS = (8, 24)
BULK_CLIENTS = 4
QUERIES_PER_S = 20.0


def prepared(costs: Sequence[int], tag: str) -> list[PreparedItem]:
    return [PreparedItem(f"{tag}{i}:{c}", int(c), i) for i, c in enumerate(costs)]


async def one_run(config: WorkerConfig, cost: CostModel, seconds: float, seed: int) -> Json:
    worker = ModelWorker(BenchAdapter(cost), config, name="bench")
    await worker.start()
    forwards = Forwards(worker)
    rng = np.random.default_rng(seed)
    begin = time.perf_counter() + 0.5  # the bulk clients' queue has filled by then
    end = begin + seconds
    query_wait: list[float] = []
    query_latency: list[float] = []
    bulk_latency: list[float] = []

    async def bulk(client: int) -> None:
        own = np.random.default_rng(seed * 100 + client)
        while time.perf_counter() < end:
            costs = own.integers(DOC_TOKENS[0], DOC_TOKENS[1] + 1, DOCUMENTS)
            sent = time.perf_counter()
            await (await worker.submit(prepared(costs, f"d{client}-"), "document"))
            if sent >= begin:
                bulk_latency.append((time.perf_counter() - sent) * 1000)

    async def query(tokens: int) -> None:
        sent = time.perf_counter()
        result = await (await worker.submit(prepared([tokens], "q"), "query"))
        query_wait.append(result.queue_ms)
        query_latency.append((time.perf_counter() - sent) * 1000)

    async def queries() -> None:  # open loop: each query is sent at its time
        at, sent = begin, []
        while (at := at + float(rng.exponential(1 / QUERIES_PER_S))) < end:
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            tokens = int(rng.integers(QUERY_TOKENS[0], QUERY_TOKENS[1] + 1))
            sent.append(asyncio.create_task(query(tokens)))
        await asyncio.gather(*sent)

    await asyncio.gather(*(bulk(c) for c in range(BULK_CLIENTS)), queries())
    await worker.stop()
    done = time.perf_counter()
    return {
        **benchlib.percentiles("query_wait", query_wait),
        "query_wait_max_ms": max(query_wait),
        **benchlib.percentiles("query_latency", query_latency),
        "queries": len(query_latency),
        **benchlib.percentiles("bulk_latency", bulk_latency),
        "documents_per_s": forwards.rate(begin, done) - len(query_latency) / (done - begin),
        "padded_per_real": forwards.padding(begin, done),
        "forwards_per_s": forwards.between(begin, done)[0] / (done - begin),
        "device_idle_share": sum(forwards.gaps_ms(begin, done)) / 1000 / (done - begin),
    }


HTTP_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
HTTP_QUERIES_PER_S = 2.0
HTTP_SERVE_ARGS = {"default": [], "lead_ratio=0": ["--lead-ratio", "0"],
                   # the token budget before it was learned, and budgets set by hand
                   **{f"max_batch_tokens={n}": ["--max-batch-tokens", str(n)]
                      for n in (1024, 2048, 4096, 16384)}}



async def one_http_run(server: loadgen.Server, seconds: float, seed: int,
                       documents_kind: str) -> Json:
    url = f"{server.url}/v1/encode/{HTTP_MODEL}"
    rng = np.random.default_rng(seed)
    documents = loadgen.encode_bodies(documents_kind, 32, per_request=DOCUMENTS)
    queries = [json.dumps({"items": [{"text": text}], "params": {"is_query": True}}).encode()
               for text in loadgen.texts("short", 64, seed)]
    query_latency: list[float] = []
    query_wait: list[float] = []
    bulk_latency: list[float] = []
    begin = time.perf_counter() + 2.0  # the bulk clients' queue has filled by then
    end = begin + seconds
    counted: list[float] = []  # items forwarded at begin and at end

    async def forwarded_items() -> float:
        counters = await loadgen.batch_counters(session, server.url, HTTP_MODEL)
        return counters.get("ember_batch_items_sum", 0.0)

    async with loadgen.client_session(BULK_CLIENTS + 16, timeout_s=300.0) as session:
        async def bulk(client: int) -> None:
            sent = 0
            while time.perf_counter() < end:
                sample = await loadgen.post(session, url, documents[(client * 7 + sent)
                                                                    % len(documents)])
                sent += 1
                if time.perf_counter() - sample.latency_ms / 1000 >= begin:
                    bulk_latency.append(sample.latency_ms)

        async def query(body: bytes) -> None:
            sample = await loadgen.post(session, url, body)
            query_latency.append(sample.latency_ms)
            query_wait.append(sample.queue_ms)

        async def stream() -> None:
            at, sent = begin, []
            await asyncio.sleep(max(0.0, begin - time.perf_counter()))
            counted.append(await forwarded_items())
            while (at := at + float(rng.exponential(1 / HTTP_QUERIES_PER_S))) < end:
                await asyncio.sleep(max(0.0, at - time.perf_counter()))
                sent.append(asyncio.create_task(query(queries[len(sent) % len(queries)])))
            await asyncio.sleep(max(0.0, end - time.perf_counter()))
            counted.append(await forwarded_items())
            await asyncio.gather(*sent)

        await asyncio.gather(*(bulk(c) for c in range(BULK_CLIENTS)), stream())
        async with session.get(f"{server.url}/v1/models/{HTTP_MODEL}") as response:
            dispatch = (await response.json())["dispatch"]
    return {
        **benchlib.percentiles("query_wait", query_wait),
        "query_wait_max_ms": max(query_wait),
        **benchlib.percentiles("query_latency", query_latency),
        "queries": len(query_latency),
        **benchlib.percentiles("bulk_latency", bulk_latency),
        # Forwarded in the window, less the queries: a bulk request outlasts a few
        # seconds, so counting those answered in it would be coarse.
        "documents_per_s": (counted[1] - counted[0] - len(query_latency)) / seconds,
        "max_batch_tokens": dispatch["windows"]["max_batch_tokens"],  # at the end
        "dispatch": dispatch,  # the learned cost and windows at the end
    }


def run_http(reps: int, seconds: float, logs: Path, variants: Sequence[str],
             documents_kind: str) -> Json:
    runs: dict[str, list[Json]] = {name: [] for name in variants}
    for rep in range(reps):
        order = list(variants) if rep % 2 == 0 else list(reversed(variants))
        for name in order:
            with loadgen.Server(HTTP_SERVE_ARGS[name], logs / f"{rep}-{name}.log") as server:
                server.wait_ready()
                runs[name].append(asyncio.run(one_http_run(server, seconds, seed=rep + 1,
                                                           documents_kind=documents_kind)))
            print(f"  http rep {rep + 1} {name}: query latency p50 "
                  f"{runs[name][-1]['query_latency_p50_ms']:.0f} ms", file=sys.stderr)
    return {"http": {"runs": runs, "summary": benchlib.summarize(runs)}}


async def run(costs: Sequence[str], reps: int, seconds: float) -> Json:
    heap.settle()  # the collector as a server sets it
    results: Json = {}
    for cost_name in costs:
        runs: dict[str, list[Json]] = {name: [] for name in VARIANTS}
        for rep in range(reps):
            order = list(VARIANTS) if rep % 2 == 0 else list(reversed(VARIANTS))
            for name in order:  # A B, then B A: neither always runs on a warmer machine
                gc.collect()
                runs[name].append(await one_run(VARIANTS[name], COSTS[cost_name], seconds,
                                                seed=rep + 1))
                print(f"  {cost_name} rep {rep + 1} {name}: query wait p50 "
                      f"{runs[name][-1]['query_wait_p50_ms']:.1f} ms", file=sys.stderr)
        results[cost_name] = {"runs": runs, "summary": benchlib.summarize(runs)}
    return results


METRICS = ["query_wait_p50_ms", "query_wait_p99_ms", "query_wait_max_ms",
           "query_latency_p50_ms", "bulk_latency_p50_ms", "documents_per_s",
           "padded_per_real", "forwards_per_s", "device_idle_share"]


HTTP_METRICS = ["query_latency_p50_ms", "query_latency_p99_ms", "query_wait_p50_ms",
                "bulk_latency_p50_ms", "documents_per_s"]


def section(title: str, result: Json, names: Sequence[str], metrics: Sequence[str],
            ratios: Sequence[str], headers: Sequence[str]) -> str:
    """One table: a row a variant, the medians of `metrics`, then `ratios` to the default."""
    rows = [benchlib.summary_row(result["summary"][name], name, metrics, ratios)
            for name in names]
    return (f"### {title}; median of {len(result['runs']['default'])} repetitions\n\n"
            + table([*headers, *(f"{header} / default" for header in ratio_headers(ratios))],
                    rows))


def ratio_headers(ratios: Sequence[str]) -> list[str]:
    return [name.removesuffix("_ms").replace("_", " ") for name in ratios]


def report(data: Json) -> str:
    out = []
    for cost_name, result in data["results"].items():
        if cost_name == "http":
            out.append(section(
                f"over HTTP, {HTTP_MODEL} on ONNX Runtime, "
                f"{data['scenario'].get('documents_kind', 'mixed')} documents", result,
                list(result["runs"]),
                HTTP_METRICS, ["query_latency_p50_ms", "query_latency_p99_ms",
                               "documents_per_s"],
                ["server", "query latency p50 ms", "p99", "query wait p50 ms",
                 "bulk request p50 ms", "documents/s"]))
            continue
        cost = data["cost_models"][cost_name]
        out.append(section(
            f"{cost_name}: {cost['overhead_ms']} ms + {cost['per_token_us']} us a padded token",
            result, list(VARIANTS), METRICS,
            ["query_wait_p50_ms", "query_wait_p99_ms", "documents_per_s"],
            ["variant", "query wait p50 ms", "p99", "longest", "query latency p50 ms",
             "bulk request p50 ms", "documents/s", "padded/real", "forwards/s",
             "device idle"]))
    return "\n\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    benchlib.add_common_args(parser, OUT, 4, "one repetition of 3 s a variant")
    parser.add_argument("--costs", default="gpu,slow", help="cost models, of "
                        f"{sorted(COSTS)}")
    parser.add_argument("--seconds", type=float, default=None,
                        help="measured seconds a run (default 8, 30 with --http; 3 with "
                        "--quick)")
    parser.add_argument("--http", action="store_true",
                        help="over HTTP on the default model instead of in process")
    parser.add_argument("--documents", choices=("mixed", "long"), default="mixed",
                        help="--http: the bulk requests' texts, 5-120 words or 300-400 "
                        "(cut to the model's 256 tokens)")
    parser.add_argument("--variants", default="default,lead_ratio=0",
                        help=f"--http: the servers, of {sorted(HTTP_SERVE_ARGS)}")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/ember-bench-bulk-queries"),
                        help="where the servers' logs go (--http)")
    args = parser.parse_args(argv)
    if args.report:
        print(report(benchlib.read_json(args.report)))
        return 0
    benchlib.resolve_reps(args, 4)
    seconds = args.seconds or (3.0 if args.quick else 30.0 if args.http else 8.0)
    costs = [c for c in args.costs.split(",") if c]
    if unknown := [c for c in costs if c not in COSTS]:
        parser.error(f"unknown cost models {unknown}; known: {sorted(COSTS)}")
    began = time.perf_counter()
    data: Json = {
        "meta": benchlib.meta(sys.argv if argv is None else ["bulk_queries.py", *argv]),
        "scenario": {"bulk_clients": BULK_CLIENTS, "documents": DOCUMENTS,
                     "document_tokens": DOC_TOKENS, "query_tokens": QUERY_TOKENS,
                     "queries_per_s": QUERIES_PER_S, "seconds": seconds},
        "variants": {name: asdict(config) for name, config in VARIANTS.items()},
        "cost_models": {} if args.http else {name: asdict(COSTS[name]) for name in costs},
    }
    variants = [v for v in args.variants.split(",") if v]
    if unknown := [v for v in variants if v not in HTTP_SERVE_ARGS]:
        parser.error(f"unknown variants {unknown}; known: {sorted(HTTP_SERVE_ARGS)}")
    if args.http:
        data["scenario"].update(queries_per_s=HTTP_QUERIES_PER_S,
                                documents_kind=args.documents)
        data["variants"] = {name: HTTP_SERVE_ARGS[name] for name in variants}
        data["results"] = run_http(args.reps, seconds, args.logs, variants, args.documents)
    else:
        data["results"] = asyncio.run(run(costs, args.reps, seconds))
    return benchlib.finish(args.out, data, began, report(data), "bulk_queries")


if __name__ == "__main__":
    sys.exit(main())
