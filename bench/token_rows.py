#!/usr/bin/env python
"""A request's token ids on their way to a forward: this tree against a landed one.

Each repetition runs one child process on the landed tree (`--landed-src`), then one on
this tree, and each child measures on all-MiniLM-L6-v2's request half (its tokenizer, no
weights), the best of 5 timings of many calls:

- `prepare_1_us`: one text of ~75 characters prepared (tokenized, its row made);
- `prepare_2048_us`: 2,048 such texts in one request;
- `pad_in_process_us`: 64 prepared rows padded for a forward, as in one process;
- `pad_engine_us`: the same rows after the IPC wire, as an engine process pads them;
- `to_wire_2048_us`: the 2,048 items packed into one message, as an API process sends;
- `pairs_to_wire_us`, `pairs_from_wire_us`: one message of 1,000 reranker pairs (a query
  with each text, tokenized as pairs), packed, then unpacked and rebuilt, as each tree
  makes pairs (lists of ids before the trees that keep them as arrays).

    python bench/token_rows.py --landed-src /tmp/ember-landed/src   # ~1 min on 2 cores
    python bench/token_rows.py --quick --landed-src src             # smoke run
    python bench/token_rows.py --report docs/bench/token_rows.json   # tables only
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import benchlib

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "bench" / "token_rows.json"
METRICS = ("prepare_1_us", "prepare_2048_us", "pad_in_process_us", "pad_engine_us",
           "to_wire_2048_us", "pairs_to_wire_us", "pairs_from_wire_us")
TREES = ("landed", "this")
Json = dict[str, Any]


def best_us(call: Callable[[], object], calls: int) -> float:
    """The fastest of 5 timings of `calls` calls, in microseconds a call."""
    call()
    timings = []
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(calls):
            call()
        timings.append((time.perf_counter() - began) / calls * 1e6)
    return min(timings)


def child(scale: float) -> Json:
    """The figures of the tree on sys.path (imported here, so each child has its own)."""
    from ember.adapters import _arrays as arrays
    from ember.adapters import transformer
    from ember.adapters.base import EncodeOptions, Runtime
    from ember.config import DEFAULT_MODEL, load_catalog
    from ember.ipc.batch import items_from_wire, items_to_wire
    from ember.ipc.wire import pack, unpack

    adapter = transformer.load(load_catalog()[DEFAULT_MODEL], Runtime(), weights=False)
    texts = [f"text number {i} about search engines and vectors in a long enough sentence"
             for i in range(2048)]
    options = EncodeOptions()
    bulk, _ = adapter.prepare(texts, options)
    rows = [item.payload for item in bulk[:64]]
    engine_rows = [item.payload for item in items_from_wire(unpack(pack(
        items_to_wire(bulk[:64]))))]

    pairs = reranker_pairs(adapter.tokenizer, texts[:1000])
    pairs_message = pack(items_to_wire(pairs))

    def calls(count: int) -> int:
        return max(1, int(count * scale))

    return {
        "prepare_1_us": best_us(lambda: adapter.prepare(texts[:1], options), calls(2000)),
        "prepare_2048_us": best_us(lambda: adapter.prepare(texts, options), calls(5)),
        "pad_in_process_us": best_us(lambda: arrays.padded(rows, 0), calls(2000)),
        "pad_engine_us": best_us(lambda: arrays.padded(engine_rows, 0), calls(2000)),
        "to_wire_2048_us": best_us(lambda: pack(items_to_wire(bulk)), calls(20)),
        "pairs_to_wire_us": best_us(lambda: pack(items_to_wire(pairs)), calls(20)),
        "pairs_from_wire_us": best_us(lambda: items_from_wire(unpack(pairs_message)),
                                      calls(20)),
    }


def reranker_pairs(wrapper: Any, docs: list[str]) -> list[Any]:
    """Prepared items of (query, doc) pairs as the tree's reranker makes them: views of
    one block where the tree has `id_rows`, lists of ids before it."""
    from ember.adapters import _tokenize
    from ember.adapters.cross_encoder import Pair
    from ember.engine import PreparedItem

    query = "how do search engines rank documents"
    if "pairs" in inspect.signature(_tokenize.TextTokenizer).parameters:  # an older tree
        older: Any = _tokenize.TextTokenizer
        encodings = older(wrapper, 256, pairs=True).encode_pairs(query, docs, "only_second")
    else:
        encodings = _tokenize.TextTokenizer(wrapper, 256).encode_pairs(query, docs, True)
    if hasattr(_tokenize, "id_rows"):
        rows = zip(_tokenize.id_rows(encodings), _tokenize.id_rows(encodings, "type_ids"),
                   strict=True)
    else:
        rows = ((e.ids, e.type_ids) for e in encodings)
    return [PreparedItem(Pair(ids, types), len(ids), i) for i, (ids, types) in enumerate(rows)]


def run_child(src: Path, scale: float) -> Json:
    env = {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, __file__, "--child", "--scale", str(scale)],
                          env=env, capture_output=True, text=True, timeout=600, check=True)
    figures: Json = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def commit_of(src: Path) -> str:
    """The commit a tree's checkout is at ("" when it is not a git checkout)."""
    done = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False)
    return done.stdout.strip()


def measure(landed: Path, reps: int, scale: float) -> Json:
    runs = []
    for rep in range(reps):
        figures = {tree: run_child(src, scale)
                   for tree, src in (("landed", landed), ("this", REPO / "src"))}
        runs.append(figures)
        print(f"[token_rows] rep {rep + 1}/{reps}", file=sys.stderr)
    ratios = {m: benchlib.spread([r["this"][m] / r["landed"][m] for r in runs])
              for m in METRICS}
    medians = {tree: {m: benchlib.median(r[tree][m] for r in runs) for m in METRICS}
               for tree in TREES}
    return {"reps": runs, "median": medians, "this_over_landed": ratios}


def report(data: Json) -> str:
    result = data["result"]
    rows = [[m, result["median"]["landed"][m], result["median"]["this"][m],
             benchlib.fmt_spread(result["this_over_landed"][m])] for m in METRICS]
    return ("Token-id rows: the landed tree against this one (us, median of the "
            "repetitions; the ratio's median and min-max)\n\n"
            + benchlib.table(["measure", "landed", "this", "this / landed"], rows))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_common_args(parser, OUT, full_reps=5,
                             quick_help="1 repetition of few calls (a smoke run)")
    parser.add_argument("--landed-src", type=Path, help="the landed tree's src directory")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--scale", type=float, default=1.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.scale)))
        return 0
    if args.report:
        print(report(benchlib.read_json(args.report)))
        return 0
    if args.landed_src is None:
        parser.error("--landed-src is required for a run")
    benchlib.resolve_reps(args, full_reps=5)
    began = time.perf_counter()
    data: Json = {"meta": benchlib.meta(sys.argv),
                  "landed_src": str(args.landed_src),
                  "commits": {"landed": commit_of(args.landed_src),
                              "this": commit_of(REPO / "src")},
                  "result": measure(args.landed_src.resolve(), args.reps,
                                    0.02 if args.quick else 1.0)}
    return benchlib.finish(args.out, data, began, report(data), "token_rows")


if __name__ == "__main__":
    raise SystemExit(main())
