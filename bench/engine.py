#!/usr/bin/env python
"""Engine benchmark: what the engine itself costs per forward and per item, with a device
that costs nothing.

The real ModelWorker runs a no-op adapter (a forward returns rows of one preallocated
array at once), so every microsecond measured is the engine's own: submit, queueing,
batch formation, the dispatch rules, the hand-off to the forward thread, delivery of the
results and the stats. A burst of `--requests` requests of `--items` items each
(256 x 16 = 4,096 items, the default queue limit) is submitted in one go and awaited;
the process's CPU time over the burst, divided by the forwards it took (64-item
forwards), is the engine time per forward. Each repetition runs the burst several times
and keeps the median.

Where the two threads run decides the figure (on a 2-core VM, 0.12-0.13 ms a forward when
they share a core, 0.20-0.25 ms when they do not: the figure was bimodal as the scheduler
placed them): each forward is a hand-off to the forward thread and one back, two sleeps
and two wake-ups, and across cores each costs tens of microseconds of CPU (the futex
wake's interprocessor interrupt, caches refilled). So each run pins its threads
(`--placement`): `one` puts the event loop and the forward thread on one core (the
engine's own work, hand-offs at their cheapest), `split` puts the forward thread on
another core than the loop (a GPU server's layout: every hand-off crosses cores), and
`free` leaves them to the scheduler (bimodal; for comparison only).

    python bench/engine.py                  # ~20 s
    python bench/engine.py --quick
    python bench/engine.py --landed-src ../wt-landed/src --reps 4   # A B A B beside it

Without `--landed-src`, each repetition runs every placement in a fresh process. With it,
each repetition runs this tree's engine and then the other tree's (each in a fresh
process, for each shape and placement in turn), and the ratios here / landed of the
engine time per forward are reported with their spread.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import benchlib
import numpy as np
from benchlib import Json

from ember import heap
from ember.engine import ModelWorker, PreparedItem, WorkerConfig

OUT = Path("docs/bench/engine.json")


class NoOpDevice:
    """A device that takes no time: each forward returns rows of one array."""

    def __init__(self, dims: int = 384) -> None:
        self.output = np.zeros((4096, dims), dtype=np.float32)

    def forward(self, items: Sequence[PreparedItem], params: Hashable) -> Sequence[Any]:
        return list(self.output[:len(items)])

    def set_lora(self, name: str | None) -> None:
        """No LoRAs here."""


async def burst(worker: ModelWorker, requests: int, items: int) -> Json:
    bodies = [[PreparedItem(np.arange(13, dtype=np.int32), 13, i) for i in range(items)]
              for _ in range(requests)]
    batches_before = worker.stats.batches
    gc.collect()
    cpu, wall = time.process_time(), time.perf_counter()
    futures = [await worker.submit(body, "params") for body in bodies]
    await asyncio.gather(*futures)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    forwards = worker.stats.batches - batches_before
    return {"forwards": forwards, "cpu_ms": cpu * 1000, "wall_ms": wall * 1000,
            "ms_per_forward": cpu * 1000 / forwards,
            "us_per_item": cpu * 1e6 / (requests * items)}


PLACEMENTS = ("one", "split")  # what a run compares; "free" only on request


def cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


async def start_placed(worker: ModelWorker, placement: str) -> Json:
    """Start `worker` with its threads where `placement` says. A thread starts with its
    creator's CPU set, and `sched_setaffinity(0)` sets the calling thread's only, so the
    forward thread is started from the core it is to keep."""
    available = cores()
    if placement == "free" or len(available) < 2:
        await worker.start()
        return {"placement": "free" if len(available) < 2 else placement,
                "loop_cpus": available}
    loop_cpu, thread_cpu = available[0], available[1 if placement == "split" else 0]
    os.sched_setaffinity(0, {thread_cpu})
    await worker.start()
    os.sched_setaffinity(0, {loop_cpu})
    return {"placement": placement, "loop_cpus": [loop_cpu], "thread_cpus": [thread_cpu]}


def cpu_list(text: str) -> list[int]:
    """`"0-2,5"` -> [0, 1, 2, 5] (the kernel's CPU list format)."""
    cpus: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus += range(int(low), int(high or low) + 1)
    return cpus


def thread_cpus(name: str) -> list[int]:
    """The CPUs the thread called `name` may run on (read back: the pinning took)."""
    for thread in threading.enumerate():
        if thread.name == name and thread.native_id is not None:
            status = Path(f"/proc/self/task/{thread.native_id}/status").read_text()
            for line in status.splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    return cpu_list(line.split(":", 1)[1].strip())
    return []


async def run(args: argparse.Namespace) -> Json:
    config = WorkerConfig(max_queue_items=args.requests * args.items, max_batch_items=64)
    worker = ModelWorker(NoOpDevice(), config, name="bench")
    placed = await start_placed(worker, args.placement)
    placed["forward_thread_cpus"] = thread_cpus("ember-forward-bench")
    heap.settle()  # the collector's thresholds as a server runs them
    try:
        await burst(worker, 16, args.items)  # warm-up: the loop and the thread
        await burst(worker, args.requests, args.items)  # and the queue at its depth
        runs = [await burst(worker, args.requests, args.items) for _ in range(args.bursts)]
    finally:
        await worker.stop()
    keys = ("ms_per_forward", "us_per_item", "forwards", "wall_ms")
    return {"requests": args.requests, "items_per_request": args.items,
            "queued_items": args.requests * args.items, **placed, "runs": runs,
            "median": {k: benchlib.median(r[k] for r in runs) for k in keys},
            "spread": {k: benchlib.spread([r[k] for r in runs]) for k in keys[:2]}}


SHAPES = ((256, 16), (4096, 1))  # requests x items: a deep queue, and one item a request


def compare(args: argparse.Namespace) -> Json:
    """Interleaved runs of this tree and `args.landed_src` (A B A B), each shape and
    placement in a fresh process."""
    rows: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.reps):
        for requests, items in SHAPES:
            for placement in args.placements:
                case = f"{requests}x{items} {placement}"
                for variant, src in (("here", None), ("landed", str(args.landed_src))):
                    rows.setdefault(case, {}).setdefault(variant, []).append(
                        one_run(requests, items, args.bursts, placement, src))
    cases = {}
    for case, runs in rows.items():
        ratios = [a / b for a, b in zip(runs["here"], runs["landed"], strict=True)]
        cases[case] = {"ms_per_forward": runs, "ratio": benchlib.median(ratios),
                       "ratio_spread": benchlib.spread(ratios),
                       "median": {k: benchlib.median(v) for k, v in runs.items()},
                       "spread": {k: benchlib.spread(v) for k, v in runs.items()}}
    return {"landed_src": str(args.landed_src), "reps": args.reps, "shapes": cases}


def placements(args: argparse.Namespace) -> Json:
    """This tree alone: each placement of `--requests x --items` in a fresh process,
    repetition by repetition."""
    runs: dict[str, list[float]] = {p: [] for p in args.placements}
    for _ in range(args.reps):
        for placement in args.placements:
            runs[placement].append(one_run(args.requests, args.items, args.bursts, placement,
                                           None))
    return {"requests": args.requests, "items_per_request": args.items,
            "queued_items": args.requests * args.items, "reps": args.reps,
            "placements": {p: {"ms_per_forward": v, "spread": benchlib.spread(v)}
                           for p, v in runs.items()}}


def one_run(requests: int, items: int, bursts: int, placement: str, src: str | None) -> float:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        subprocess.run([sys.executable, __file__, "--requests", str(requests), "--items",
                        str(items), "--bursts", str(bursts), "--placement", placement,
                        "--single", "--out", str(out)],
                       env=env, check=True, capture_output=True, timeout=300)
        return float(json.loads(out.read_text())["median"]["ms_per_forward"])


def compare_markdown(data: Json) -> str:
    rows = [[case, d["median"]["here"], d["median"]["landed"], d["ratio"],
             benchlib.fmt_spread(d["ratio_spread"])] for case, d in data["shapes"].items()]
    return benchlib.table(["requests x items, placement", "engine ms / forward",
                           "landed ms / forward", "here / landed", "spread"], rows)


def placements_markdown(data: Json) -> str:
    rows = [[data["queued_items"], placement, d["spread"]["median"],
             d["spread"]["median"] * 1000 / 64, benchlib.fmt_spread(d["spread"])]
            for placement, d in data["placements"].items()]
    return benchlib.table(["queued items", "placement", "engine ms / 64-item forward",
                           "us / item", "spread (ms/fwd)"], rows)


def markdown(data: Json) -> str:
    if "shapes" in data:
        return compare_markdown(data)
    if "placements" in data:
        return placements_markdown(data)
    med = data["median"]
    return benchlib.table(
        ["queued items", "placement", "forwards", "engine ms / forward", "us / item",
         "spread (ms/fwd)"],
        [[data["queued_items"], data["placement"], med["forwards"], med["ms_per_forward"],
          med["us_per_item"], benchlib.fmt_spread(data["spread"]["ms_per_forward"])]])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    benchlib.add_common_args(parser, OUT, 1, "one short burst")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--items", type=int, default=16)
    parser.add_argument("--bursts", type=int, default=None, help="bursts a run (default 25)")
    parser.add_argument("--placement", choices=("one", "split", "free"), default=None,
                        help="only this placement of the loop and the forward thread "
                        "(default: one and split)")
    parser.add_argument("--single", action="store_true",
                        help="one run in this process (what each repetition starts)")
    parser.add_argument("--landed-src", type=Path, default=None,
                        help="another tree's src/: run it beside this one, interleaved")
    args = parser.parse_args(argv)
    if args.report is not None:
        print(markdown(benchlib.read_json(args.report)))
        return 0
    args.bursts = args.bursts or (3 if args.quick else 25)
    args.placements = [args.placement] if args.placement else list(PLACEMENTS)
    began = time.perf_counter()
    if args.landed_src is not None:
        benchlib.resolve_reps(args, 4)
        data = {"meta": benchlib.meta(sys.argv), **compare(args)}
        return benchlib.finish(args.out, data, began, compare_markdown(data), "engine")
    if not args.single:
        benchlib.resolve_reps(args, 3)
        data = {"meta": benchlib.meta(sys.argv), **placements(args)}
        return benchlib.finish(args.out, data, began, placements_markdown(data), "engine")
    import uvloop

    args.placement = args.placement or "one"
    data = {"meta": benchlib.meta(sys.argv), **uvloop.run(run(args))}
    return benchlib.finish(args.out, data, began, markdown(data), "engine")


if __name__ == "__main__":
    sys.exit(main())
