#!/usr/bin/env python
"""The overload scenario of `bench/scheduler.py` (`open_mixed_120`) as a discrete-event
simulation over the real BatchFormer: seconds for dozens of arrival sequences, where the
real worker takes a second of wall time each and adds the machine's noise.

It reproduces the scenario's arrivals exactly (same seeds, same draws) and models the
worker's formation as it is:

- one forward at a time, lasting the synthetic device's cost for its padded tokens;
- the next batch forms from the queue as soon as there is none: at each hand-off to the
  device, and when an arrival finds no next batch;
- an arrival joins that next batch while it fits the batch's limits (the worker's
  `_revise_slot`), else it queues;
- the next batch goes the moment the device frees (under this backlog the measured gap
  between forwards is 0.02 ms, so holds and windows are left out).

Variants of the rule are run on the same arrivals, to see what moves the longest wait
against its bound (2 x the median wait + 40 ms) before trying one in the worker:

- `worker`: as above;
- `queue_first`: an arrival joins the next batch only while nothing is queued, so no item
  overtakes an older one;
- `queue_first_no_cheaper`: besides, a batch never fills its room from below the
  sweep's cursor;
- `worker_aging`: the worker's rule with an aging guard: once the oldest queued item has
  waited 2 x the median of the last 256 waits + 40 ms, less 10 ms, the next batch starts
  at its bucket (a detour: the sweep's cursor stays where it was).

Each row also gives, per sequence, the median of the waits handed to the device within
100 ms of the longest one, over the sequence's median: how much of the longest wait is a
swell of the whole queue rather than one item passed over. And the same bound with each
item's neighbours' median for the sequence's: no item waits longer than 2 x the median
wait of the items handed within 100 ms of it + 40 ms.

    python bench/overload_sim.py                            # ~30 s on 2 cores
    python bench/overload_sim.py --reps 2 --scales 1     # a few seconds
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import benchlib
import numpy as np
import scheduler
from benchlib import Json, table

from ember.engine import Batch, BatchFormer, PendingItem, PreparedItem, WorkerConfig
from ember.engine.batcher import cost_bucket
from ember.engine.config import LEAD_RATIO

SCENARIO = "open_mixed_120"
RECORDED = Path(__file__).resolve().parents[1] / "docs" / "bench" / "overload_engine.json"
SCALES = (1.0, 1.04, 1.08)  # the real worker's waits read like the model's at ~1.04x the rate
REPS = 32
DURATION = scheduler.mixed_duration(scheduler.PLANS["gpu"])


class ModelFormer(BatchFormer):
    """The real BatchFormer, as the model drives it: it is told the model's clock before
    each formation and the waits of each batch handed to the device."""

    def observe(self, now: float, handed_waits: Sequence[float] = ()) -> None:
        """The worker's rule reads neither."""


class NoCheaperFormer(ModelFormer):
    """A BatchFormer whose batches never fill their room from below the sweep's cursor."""

    def _pack(self, batch: Batch, group: Any, low: int, high: int,
              taken: dict[int, int]) -> None:
        if low >= 0 and high == len(group.keys):  # the pass below the cursor
            return
        super()._pack(batch, group, low, high, taken)


class AgingFormer(ModelFormer):
    """The worker's BatchFormer with an aging guard against the recent median wait."""

    MARGIN_S = 0.010  # about a forward: the guard's batch still waits for the device
    RECENT = 256
    ARMED_AFTER = 32  # waits seen before the median is trusted
    STARVATION_S = scheduler.starvation_s(WorkerConfig())

    def __init__(self, max_batch_tokens: int, max_batch_items: int,
                 max_padding: float = 0.0, lead_ratio: float = LEAD_RATIO) -> None:
        super().__init__(max_batch_tokens, max_batch_items, max_padding, lead_ratio)
        self.now = 0.0
        self.recent: deque[float] = deque(maxlen=self.RECENT)

    def observe(self, now: float, handed_waits: Sequence[float] = ()) -> None:
        self.now = now
        self.recent.extend(handed_waits)

    def form(self, lora: str | None = None) -> Batch | None:
        head = self.oldest()
        if head is None or len(self.recent) < self.ARMED_AFTER or self.now - head.arrival <= (
                2 * float(np.median(self.recent)) + self.STARVATION_S - self.MARGIN_S):
            return super().form(lora)
        group = self._groups[head.group]
        cursor, group.cursor = group.cursor, cost_bucket(head.item.cost)
        batch = super().form(lora)
        group.cursor = cursor
        return batch


@dataclass(frozen=True)
class Variant:
    former: type[ModelFormer]
    joins_only_an_empty_queue: bool


VARIANTS: dict[str, Variant] = {
    "worker": Variant(ModelFormer, False),
    "queue_first": Variant(ModelFormer, True),
    "queue_first_no_cheaper": Variant(NoCheaperFormer, True),
    "worker_aging": Variant(AgingFormer, False),
}


class Owner:
    """A request as the batcher sees it: always live here."""

    live = True


def arrivals(rep: int, rate: float) -> tuple[np.ndarray, list[int]]:
    """The arrival times and item costs `bench/scheduler.py` draws for repetition `rep`."""
    times, requests = scheduler.mixed_arrivals(scheduler.seed_of("gpu", SCENARIO, rep), rate,
                                               DURATION)
    return times, [items[0].cost for items in requests]


@dataclass
class Outcome:
    handed_at: np.ndarray  # when each arrival went to the device, in arrival order (s)
    padded_per_real: float


def simulate(times: np.ndarray, costs: Sequence[int], variant: Variant) -> Outcome:
    """Run one arrival sequence through the modelled worker under `variant`."""
    former = variant.former.for_config(WorkerConfig())
    device = scheduler.MIXED_COST
    handed_at = np.full(len(times), np.nan)
    padded = real = 0
    upcoming: Batch | None = None
    device_free = now = 0.0
    i = 0
    while i < len(times) or upcoming is not None:
        arrival = float(times[i]) if i < len(times) else float("inf")
        if upcoming is not None and device_free <= arrival:
            now = max(now, device_free)  # an idle device takes the batch when it forms
            seqs = [p.seq for p in upcoming.items]
            handed_at[seqs] = now
            former.observe(now, (now - times[seqs]).tolist())
            padded += upcoming.padded_tokens
            real += upcoming.real_tokens
            device_free = now + (device.overhead_ms
                                 + device.per_token_us * upcoming.padded_tokens / 1000) / 1000
            upcoming = former.form() if former.pending_items else None
            continue
        now = arrival
        pending = PendingItem(PreparedItem("", costs[i], 0), Owner(), "", arrival, i)
        i += 1
        if upcoming is not None and not (variant.joins_only_an_empty_queue
                                         and former.pending_items):
            if upcoming.fits(pending.item.cost, former.limits):
                upcoming.add(pending)
                continue
            upcoming.full = True
        former.add_request([pending])
        if upcoming is None:
            former.observe(now)
            upcoming = former.form()
    return Outcome(handed_at, padded / real)


def waits(times: np.ndarray, outcome: Outcome) -> Json:
    """The benchmark's figures: waits of the arrivals after its warm-up, and the bound."""
    measured = times >= scheduler.WARMUP_SHARE * DURATION
    kept = (outcome.handed_at - times)[measured] * 1000
    handed = outcome.handed_at[measured]
    near = np.abs(handed - handed[np.argmax(kept)]) <= scheduler.NEIGHBOURS_S
    return {**scheduler.wait_figures(kept.tolist(), WorkerConfig(), handed.tolist()),
            "padded_per_real": outcome.padded_per_real,
            "swell": float(np.median(kept[near]) / np.median(kept))}


def run_sequence(times: np.ndarray, costs: Sequence[int], variant: Variant) -> Json:
    return waits(times, simulate(times, costs, variant))


def summarize(runs: list[Json]) -> Json:
    ratios = np.array([r["wait_max_over_bound"] for r in runs])
    local = np.array([r["over_local_bound"] for r in runs])
    return {"runs": len(runs), "over_bound": int((ratios > 1).sum()),
            "over_local_bound": int((local > 1).sum()), "local_ratio_max": float(local.max()),
            "ratio_median": float(np.median(ratios)),
            "ratio_p90": float(np.percentile(ratios, 90)), "ratio_max": float(ratios.max()),
            **{f"{key}_median": float(np.median([r[key] for r in runs]))
               for key in ("wait_p50_ms", "wait_p99_ms", "wait_max_ms", "padded_per_real",
                           "swell")}}


def recorded(path: Path) -> tuple[float, list[float]]:
    """The offered rate of a recorded `bench/scheduler.py` run and its default's ratios."""
    data = json.loads(path.read_text())
    result = data["results"]["gpu"][SCENARIO]
    return (float(result["params"]["rate"]),
            [float(r["wait_max_over_bound"]) for r in result["reps"]["default"]])


def run(args: argparse.Namespace) -> Json:
    rate, measured = recorded(args.against)
    data: Json = {"meta": benchlib.meta(sys.argv), "settings": {
        "against": str(args.against), "rate": rate, "reps": args.reps,
        "scales": list(args.scales), "variants": list(VARIANTS)}, "results": {}}
    model = [run_sequence(*arrivals(rep, rate), VARIANTS["worker"]) for rep in range(len(measured))]
    data["against_recorded"] = [{"rep": rep, "measured": m, "simulated": s["wait_max_over_bound"]}
                                for rep, (m, s) in enumerate(zip(measured, model, strict=True))]
    for scale in args.scales:
        sequences = [arrivals(rep, rate * scale) for rep in range(args.reps)]
        data["results"][f"{scale:g}"] = {
            name: summarize([run_sequence(times, costs, variant) for times, costs in sequences])
            for name, variant in VARIANTS.items()}
    return data


def report(data: Json) -> str:
    rows = [[f"{scale}x", name, f"{s['ratio_median']:.3f}", f"{s['ratio_p90']:.3f}",
             f"{s['ratio_max']:.3f}", f"{s['over_bound']}/{s['runs']}",
             f"{s['wait_p50_ms_median']:.1f}", f"{s['wait_p99_ms_median']:.1f}",
             f"{s['wait_max_ms_median']:.1f}", f"{s['padded_per_real_median']:.3f}",
             f"{s['swell_median']:.2f}",
             f"{s['over_local_bound']}/{s['runs']} (max {s['local_ratio_max']:.3f})"]
            for scale, by_variant in data["results"].items() for name, s in by_variant.items()]
    out = [f"Simulated {SCENARIO} ({data['settings']['reps']} arrival sequences a row; "
           f"rate {data['settings']['rate']:,.0f}/s x scale)\n",
           table(["scale", "rule", "longest / bound p50", "p90", "max", "over the bound",
                  "wait p50 ms", "p99 ms", "longest ms", "padded / real",
                  "median near the longest / median",
                  "over 2 x the neighbours' median + 40 ms"], rows)]
    pairs = [[str(p["rep"]), f"{p['measured']:.3f}", f"{p['simulated']:.3f}"]
             for p in data["against_recorded"]]
    out += ["\nThe model against the recorded run, same arrivals (longest wait / bound)\n",
            table(["repetition", "measured", "simulated"], pairs)]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", type=Path, default=RECORDED,
                        help="a bench/scheduler.py JSON: its rate, and its runs to compare")
    parser.add_argument("--reps", type=int, default=REPS, help="arrival sequences per row")
    parser.add_argument("--scales", type=lambda s: [float(x) for x in s.split(",")],
                        default=list(SCALES), help="offered rate multipliers, comma-separated")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    data = run(args)
    print(report(data))
    if args.out:
        args.out.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
        print(f"[overload_sim] wrote {args.out} in {time.perf_counter() - began:.0f} s",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
