#!/usr/bin/env python
"""Scheduler benchmark: the real ModelWorker over the synthetic adapter, no HTTP.

The synthetic adapter is a BENCHMARK MODEL: its vectors mean nothing; its
forward time comes from a cost model (src/ember/catalog/synthetic.yaml). Two cost models:

- gpu: 2 ms + 0.5 us per padded token, sleeping (the CPU stays free);
- cpu: 13 ms + 240 us per padded token, computing (one core busy). That is
  all-MiniLM-L6-v2 on this machine kind per docs/bench/notes.md: one
  13-token sentence ~16 ms, 8 of them ~38 ms (~210/s), 32 ~113 ms (~280/s).

Four dispatch policies, run interleaved (A B C D A B C D ...) in every
repetition: the default rules; `idle_coalesce_ms=0`; `hold_fraction=0` (no hold
for the senders of a forward: the engine's earlier busy rule); and the earlier
idle rule (every idle request waits the idle window), a policy subclass that
exists only here. Closed-loop scenarios also run the default a second time, an
A/A control whose ratio to the first run is the noise band.

Besides: `closed_c128_immediate` saturates the worker (twice `max_batch_items`
in flight) to measure the gap between consecutive forwards; `open_mixed_120`
offers 120 % of the mixed-length capacity (one item of 5-120 tokens per
request) to measure padding and the longest wait; and the formation
micro-benchmark times `BatchFormer.form` with 4,096 items pending.

Every request carries one 13-token item. Closed-loop clients model the HTTP
layer's turnaround: the requests of one forward come back through one serial
lane, `--turnaround-ms` each (~0.5 ms of event-loop work per request in
docs/bench/notes.md), so they return staggered as they do over HTTP. The
"turnaround2x" variants double that lane time; the "immediate" variants
resubmit at once (all of a forward's requests queue before the worker wakes).
Under uvloop, timers fire on whole milliseconds, so 0.5 ms returns come back
in pairs and 1 ms returns one by one: the two variants bracket what the
default rule's lone-request dispatch (R3b) sees.

    python bench/scheduler.py                 # full run, ~6 min on 2 cores
    python bench/scheduler.py --quick         # smoke run, a few seconds
    python bench/scheduler.py --report docs/bench/scheduler.json   # tables only
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import gc
import sys
import time
import zlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import Any

import benchlib
import loadgen
import numpy as np
from benchlib import Json, fmt_spread, percentile, summary_row, table

from ember import heap
from ember.adapters.synthetic import CostModel, SyntheticAdapter
from ember.engine import (
    Batch,
    BatchFormer,
    DispatchPolicy,
    ModelWorker,
    PendingItem,
    PreparedItem,
    QueueFull,
    QueueView,
    WorkerConfig,
)
from ember.engine.batcher import cost_bucket
from ember.engine.stats import BatchRecord


class EarlierIdleRule(DispatchPolicy):
    """The earlier R3 (benchmark only): every request reaching an idle worker, even a
    lone one, waits for the idle window to go quiet."""

    def idle_release_at(self, queue: QueueView) -> float:
        cfg = self.config
        return min(queue.last_arrival + cfg.coalesce_ms / 1000,
                   queue.oldest_arrival + cfg.batch_wait_ms / 1000)


def starvation_s(config: WorkerConfig) -> float:
    """The earlier R5's starvation bound, its default: 4 x `max_batch_wait_ms`."""
    return 4 * config.batch_wait_ms / 1000


class EarlierFormation(BatchFormer):
    """The earlier R5 (benchmark only): cheapest first, unless the oldest item has waited
    `starvation_ms`; then it leads and the rest packs around its length."""

    def __init__(self, config: WorkerConfig, now: Callable[[], float] = time.perf_counter) -> None:
        super().__init__(config.batch_tokens, config.max_batch_items, config.padding)
        self.starvation_s, self.now = starvation_s(config), now

    def form(self, lora: str | None = None) -> Batch | None:
        head = self.oldest()
        if head is None:
            return None
        group = self._groups[head.group]
        batch = Batch(lora, head.group)
        low, high = -1, 0  # cheapest first
        taken: dict[int, int] = {}
        # `oldest` gives the first request in line; here every request has one item: it.
        if head.queued and self.now() - head.arrival >= self.starvation_s:
            key = cost_bucket(head.item.cost)
            group.head(key)  # drops the tombstones ahead of it: it is the bucket's head
            group.buckets[key].popleft()
            batch.add(head)
            taken[key] = 1
            low = bisect.bisect_left(group.keys, key)
            high = low + 1
        self._pack(batch, group, low, high, taken)
        self._taken(batch, group, taken)
        return batch


POLICIES: dict[str, WorkerConfig] = {
    "default": WorkerConfig(),
    "idle0": WorkerConfig(idle_coalesce_ms=0.0),
    "nohold": WorkerConfig(hold_fraction=0.0),
    "earlier": WorkerConfig(),
}
# Run only where lengths differ (the mixed open loop): the padding bound off.
MIXED_ONLY: dict[str, WorkerConfig] = {"earlyform": WorkerConfig(),
                                        "nopad": WorkerConfig(max_padding=0.0),
                                        "fixed": WorkerConfig(dispatch="fixed")}
POLICY_CLASSES: dict[str, type[DispatchPolicy]] = {"earlier": EarlierIdleRule}
FORMERS: dict[str, Callable[[WorkerConfig], BatchFormer]] = {"earlyform": EarlierFormation}
CONTROL = "default-again"  # the A/A control: the default policy run a second time
POLICY_LABELS = {
    "default": "default",
    "idle0": "idle_coalesce_ms=0",
    "nohold": "hold_fraction=0 (no hold for senders)",
    "earlier": "earlier idle rule (lone requests wait)",
    CONTROL: "default again (A/A control)",
    "earlyform": "earlier formation (cheapest first; a starved item leads)",
    "nopad": "max_padding=0 (no padding bound)",
    "fixed": "dispatch fixed (the windows before self-tuning)",
}
PLOT_LABELS = {"default": "default", "idle0": "idle_coalesce_ms=0", "nohold": "no hold",
               "earlier": "earlier idle rule"}
COSTS: dict[str, CostModel] = {
    "gpu": CostModel(overhead_ms=2.0, per_token_us=0.5, mode="sleep"),
    "cpu": CostModel(overhead_ms=13.0, per_token_us=240.0, mode="compute"),
}
COST_LABELS = {
    "gpu": "GPU-like (sleep; 2 ms + 0.5 us/padded token)",
    "cpu": "CPU-like (compute; 13 ms + 240 us/padded token, ~MiniLM on 2 cores)",
}
# Bench-side times come from perf_counter: uvloop's loop.time() counts whole milliseconds.
clock = time.perf_counter
ITEM_TOKENS = 13
ITEMS = [PreparedItem("a thirteen token sentence standing in for a short query", ITEM_TOKENS, 0)]
MIXED_TOKENS = (5, 120)  # one item per request, its cost drawn uniformly in this range
MIXED_LOAD = 1.2  # the mixed open loop offers 120 % of the mixed capacity
# Mixed lengths run where padding costs device time and the device, not the event loop,
# is the limit: the GPU-like overhead with 10x its per-token cost.
MIXED_COST = CostModel(overhead_ms=2.0, per_token_us=5.0, mode="sleep")
MIXED_SPAN = 3  # the mixed open loop runs this many open-loop windows
WARMUP_SHARE = 0.1  # the first 10 % of an open loop warm up: its waits are not counted
PARAMS = "encode"
LOADS = (25, 50, 75, 90)  # open loop, % of capacity
CAPACITY_CLIENTS = 64  # = max_batch_items: every forward can be full


@dataclass(frozen=True)
class Plan(loadgen.Plan):
    """How long each scenario runs, per cost model (sized so a full run takes ~6-7 min)."""

    bursts: int  # bursts per size
    burst_pause_ms: float
    open_s: float
    capacity_s: float


PLANS = {
    "gpu": Plan(sequential=150, closed_s=0.5, warmup_s=0.1, bursts=15, burst_pause_ms=20,
                open_s=0.6, capacity_s=1.5),
    "cpu": Plan(sequential=40, closed_s=0.9, warmup_s=0.15, bursts=6, burst_pause_ms=60,
                open_s=1.0, capacity_s=2.0),
}
QUICK = {  # a smoke run: every scenario, briefly (the cpu model runs 4x faster there)
    "gpu": Plan(sequential=5, closed_s=0.04, warmup_s=0.01, bursts=1, burst_pause_ms=10,
                open_s=0.04, capacity_s=0.1),
    "cpu": Plan(sequential=3, closed_s=0.06, warmup_s=0.02, bursts=1, burst_pause_ms=15,
                open_s=0.06, capacity_s=0.15),
}
QUICK_SPEEDUP = 4.0


@dataclass(frozen=True)
class Scenario:
    name: str
    kind: str  # sequential | closed | burst | open
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def policies(self) -> list[str]:
        names = list(POLICIES)
        if self.kind == "open_mixed":
            return [*names, *MIXED_ONLY]
        return [*names, CONTROL] if self.kind == "closed" else names


class BenchAdapter(SyntheticAdapter):
    """The synthetic adapter with its result vectors cached, so a forward costs what
    its cost model says and not the hashing of each text besides."""

    def __init__(self, cost: CostModel) -> None:
        super().__init__(dims=8, cost=cost)
        self._vectors: dict[tuple[str, str | None], Any] = {}

    def vector(self, text: str, lora: str | None = None) -> Any:
        key = (text, lora)
        if key not in self._vectors:
            self._vectors[key] = super().vector(text, lora)
        return self._vectors[key]


class Forwards:
    """Forwards and items the worker finished, with the time each ended."""

    def __init__(self, worker: ModelWorker) -> None:
        self.records: list[tuple[float, BatchRecord]] = []
        worker.stats.batch_listeners.append(lambda r: self.records.append((clock(), r)))

    def between(self, begin: float, end: float) -> tuple[int, int]:
        chosen = [r for t, r in self.records if begin <= t <= end]
        return len(chosen), sum(r.items for r in chosen)

    def gaps_ms(self, begin: float, end: float) -> list[float]:
        """Device idle time between consecutive forwards ending in the window."""
        chosen = [r for t, r in self.records if begin <= t <= end]
        return [(b.started - a.ended) * 1000 for a, b in pairwise(chosen)]

    def padding(self, begin: float, end: float) -> float:
        """Padded tokens per real token over the forwards ending in the window."""
        chosen = [r for t, r in self.records if begin <= t <= end]
        real = sum(r.real_tokens for r in chosen)
        return sum(r.padded_tokens for r in chosen) / real if real else float("nan")

    def rate(self, begin: float, end: float) -> float:
        """Items per second from the first to the last forward ending in the window: a
        window edge falling between two forwards does not count a whole round or none."""
        chosen = [(t, r.items) for t, r in self.records if begin <= t <= end]
        if len(chosen) < 2:
            return sum(n for _, n in chosen) / (end - begin)
        return sum(n for _, n in chosen[1:]) / (chosen[-1][0] - chosen[0][0])


async def submit_one(worker: ModelWorker) -> asyncio.Future[Any]:
    return await worker.submit(ITEMS, PARAMS)


# -- scenarios ------------------------------------------------------------------------

async def sequential(worker: ModelWorker, plan: Plan, seed: int) -> Json:
    """One client, one request at a time, back to back. The hand-off is the forward
    thread's wake-up: from dispatch (where queue time ends) to the forward's start."""
    lat: list[float] = []
    queue: list[float] = []
    handoff: list[float] = []
    forwards = 0
    for i in range(plan.sequential + 5):
        sent = clock()
        result = await (await submit_one(worker))
        got = clock()
        if i >= 5:  # the first few warm the loop up
            lat.append((got - sent) * 1000)
            queue.append(result.queue_ms)
            forwards += result.forwards
            record = worker.stats.recent_batches[-1]
            handoff.append((record.started - record.dispatched) * 1000)
    return {"requests": len(lat), **benchlib.percentiles("queue", queue),
            **benchlib.percentiles("handoff", handoff),
            **benchlib.percentiles("latency", lat), "forwards_per_request": forwards / len(lat)}


async def closed_loop(worker: ModelWorker, plan: Plan, seed: int, *, clients: int,
                      turnaround_ms: float) -> Json:
    """`clients` requests always in flight; each returns through the serial turnaround
    lane before it is sent again."""
    forwards = Forwards(worker)
    begin = clock() + plan.warmup_s
    end = begin + plan.closed_s
    lane_free = 0.0
    turnaround = turnaround_ms / 1000
    lat: list[float] = []
    queue: list[float] = []

    async def client() -> None:
        nonlocal lane_free
        while clock() < end:
            sent = clock()
            result = await (await submit_one(worker))
            got = clock()
            if begin <= got <= end:
                lat.append((got - sent) * 1000)
                queue.append(result.queue_ms)
            if turnaround:
                lane_free = max(got, lane_free) + turnaround
                await asyncio.sleep(lane_free - got)

    await asyncio.gather(*(client() for _ in range(clients)))
    batches, items = forwards.between(begin, end)
    done = len(lat)
    return {"requests": done, "throughput_rps": forwards.rate(begin, end),
            "gap_p50_ms": percentile(forwards.gaps_ms(begin, end), 50),
            **benchlib.percentiles("latency", lat), "queue_p50_ms": percentile(queue, 50),
            "forwards_per_request": batches / done if done else float("nan"),
            "items_per_forward": items / batches if batches else float("nan")}


async def bursts(worker: ModelWorker, plan: Plan, seed: int, *, size: int,
                 spread_ms: float) -> Json:
    """`size` requests at random times within `spread_ms` reach an idle worker, then a
    pause long enough for every window to close."""
    rng = np.random.default_rng(seed)
    per_burst: list[int] = []
    finish_ms: list[float] = []
    queue: list[float] = []
    for _ in range(plan.bursts):
        offsets = np.sort(rng.uniform(0, spread_ms / 1000, size))
        offsets -= offsets[0]
        before = worker.stats.batches
        start = clock()
        futures = []
        for offset in offsets:
            delay = start + float(offset) - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            futures.append(await submit_one(worker))
        results = await asyncio.gather(*futures)
        finish_ms.append((clock() - start) * 1000)
        per_burst.append(worker.stats.batches - before)
        queue.extend(r.queue_ms for r in results)
        await asyncio.sleep(plan.burst_pause_ms / 1000)
    return {"bursts": len(per_burst), "forwards_per_burst": float(np.mean(per_burst)),
            "burst_ms_p50": percentile(finish_ms, 50), "burst_ms_mean": float(np.mean(finish_ms)),
            "queue_p50_ms": percentile(queue, 50)}


async def open_loop(worker: ModelWorker, plan: Plan, seed: int, *, rate: float) -> Json:
    """Poisson arrivals at `rate` per second; latency counts from each request's
    scheduled arrival, so a late generator does not hide queueing."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1 / rate, int(rate * plan.open_s * 1.5) + 50)
    arrivals = np.cumsum(gaps)
    arrivals = arrivals[arrivals < plan.open_s]
    skip = WARMUP_SHARE * plan.open_s
    lat: list[float] = []
    queue: list[float] = []
    futures: list[asyncio.Future[Any]] = []
    refused = 0

    def done(at: float, measured: bool, future: asyncio.Future[Any]) -> None:
        if measured and not future.cancelled() and future.exception() is None:
            lat.append((clock() - at) * 1000)
            queue.append(future.result().queue_ms)

    start = clock() + 0.002
    before_b, before_i = worker.stats.batches, worker.stats.items
    i = 0
    while i < len(arrivals):
        now = clock()
        while i < len(arrivals) and start + arrivals[i] <= now:
            try:
                future = await submit_one(worker)
            except QueueFull:
                refused += 1
            else:
                future.add_done_callback(partial(done, start + float(arrivals[i]),
                                                 bool(arrivals[i] >= skip)))
                futures.append(future)
            i += 1
        if i < len(arrivals):
            await asyncio.sleep(max(0.0, start + float(arrivals[i]) - clock()))
    await asyncio.gather(*futures)
    batches = worker.stats.batches - before_b
    items = worker.stats.items - before_i
    return {"requests": len(arrivals), "offered_rps": len(arrivals) / plan.open_s,
            "refused": refused, **benchlib.percentiles("latency", lat),
            "queue_p50_ms": percentile(queue, 50),
            "items_per_forward": items / batches if batches else float("nan")}


def mixed_items(rng: np.random.Generator, count: int) -> list[list[PreparedItem]]:
    costs = rng.integers(MIXED_TOKENS[0], MIXED_TOKENS[1] + 1, count)
    return [[PreparedItem(f"mixed item of {int(c)} tokens", int(c), 0)] for c in costs]


async def mixed_capacity(worker: ModelWorker, plan: Plan, seed: int) -> Json:
    """Closed loop at 64 in flight with mixed lengths: items/s the worker sustains."""
    rng = np.random.default_rng(seed)
    forwards = Forwards(worker)
    begin = clock() + plan.warmup_s
    end = begin + plan.capacity_s
    pool = mixed_items(rng, 4096)

    async def client(offset: int) -> None:
        i = offset
        while clock() < end:
            await (await worker.submit(pool[i % len(pool)], PARAMS))
            i += CAPACITY_CLIENTS

    await asyncio.gather(*(client(k) for k in range(CAPACITY_CLIENTS)))
    return {"throughput_rps": forwards.rate(begin, end)}


def seed_of(cost_name: str, scenario: str, rep: int) -> int:
    """The seed of one repetition of a scenario on a cost model (bench/overload_sim.py
    replays the mixed open loop's arrivals by it)."""
    return zlib.crc32(f"{cost_name}/{scenario}/{rep}".encode())


def mixed_arrivals(seed: int, rate: float,
                   duration: float) -> tuple[np.ndarray, list[list[PreparedItem]]]:
    """The mixed open loop's Poisson arrival times (s) within `duration`, and a request
    of one mixed-length item for each."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, int(rate * duration * 1.5) + 50))
    arrivals = arrivals[arrivals < duration]
    return arrivals, mixed_items(rng, len(arrivals))


def mixed_duration(plan: Plan) -> float:
    return MIXED_SPAN * plan.open_s  # overload needs time to build a queue


def wait_figures(waits: Sequence[float], config: WorkerConfig,
                 handed: Sequence[float] | None = None) -> Json:
    """The waits' percentiles and the longest against the issue's bound: 2 x the median
    wait + 40 ms (4 x the fixed 10 ms batch window, whatever window is learned). Formation
    no longer reads that bound (the sweep bounds waits itself); the figures keep it. With
    `handed` (when each item went to the device, s), also the bound against each item's
    neighbours (over_local_bound)."""
    longest = max(waits, default=float("nan"))
    bound = 2 * percentile(waits, 50) + starvation_s(config) * 1000
    out = {**benchlib.percentiles("wait", waits), "wait_max_ms": longest,
           "wait_bound_ms": bound, "wait_max_over_bound": longest / bound}
    if handed is not None and waits:
        out["over_local_bound"] = over_local_bound(np.asarray(handed), np.asarray(waits),
                                                   config)
    return out


NEIGHBOURS_S = 0.1  # the local bound's neighbourhood: items handed within this of an item


def over_local_bound(handed: np.ndarray, waits_ms: np.ndarray, config: WorkerConfig) -> float:
    """The largest wait / (2 x the median wait of the items handed to the device within
    NEIGHBOURS_S of it + starvation_ms), over every item: the bound against each item's
    own neighbourhood, which a swell of the whole queue raises along with the waits."""
    order = np.argsort(handed, kind="stable")
    at, waits = handed[order], waits_ms[order]
    low = np.searchsorted(at, at - NEIGHBOURS_S)
    high = np.searchsorted(at, at + NEIGHBOURS_S, side="right")
    starvation_ms = starvation_s(config) * 1000
    return max(float(wait / (2 * np.median(waits[a:b]) + starvation_ms))
               for wait, a, b in zip(waits, low, high, strict=True))


async def open_mixed(worker: ModelWorker, plan: Plan, seed: int, *, rate: float) -> Json:
    """Poisson arrivals of mixed-length items above capacity: padding per real token,
    served items/s, and the waits (submit to dispatch) against the starvation bound."""
    duration = mixed_duration(plan)
    arrivals, requests = mixed_arrivals(seed, rate, duration)
    forwards = Forwards(worker)
    waits: list[float] = []
    handed: list[float] = []  # when each measured item went to the device (s)
    futures: list[asyncio.Future[Any]] = []
    refused = 0
    skip = WARMUP_SHARE * duration
    start = clock() + 0.002

    def measured(submitted: float) -> Callable[[asyncio.Future[Any]], None]:
        def record(future: asyncio.Future[Any]) -> None:
            queue_ms = future.result().queue_ms
            waits.append(queue_ms)
            handed.append(submitted + queue_ms / 1000)
        return record

    for at, items in zip(arrivals, requests, strict=True):
        delay = start + float(at) - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        submitted = clock()
        try:
            future = await worker.submit(items, PARAMS)
        except QueueFull:
            refused += 1
            continue
        if at >= skip:
            future.add_done_callback(measured(submitted))
        futures.append(future)
    await asyncio.gather(*futures)
    begin, end = start + skip, clock()
    return {"offered_rps": len(arrivals) / duration, "refused": refused,
            "items_per_s": forwards.rate(begin, end),
            "padded_per_real": forwards.padding(begin, end),
            **wait_figures(waits, worker.config, handed),
            "gap_p50_ms": percentile(forwards.gaps_ms(begin, end), 50)}


FORMATIONS: dict[str, str] = {  # the formation micro-benchmark's rules
    "sweep": "default (sweep)",
    "earlier": "earlier, none starved (cheapest first)",
    "earlier_starved": "earlier, all starved",
}


def formation_ms(pending: int, rule: str, batches: int = 2000, seed: int = 0) -> Json:
    """Time of one `form` with `pending` mixed-length items queued; each formed batch is
    queued again, so the depth stays the same."""
    cfg = WorkerConfig()
    starved = rule == "earlier_starved"
    former = (BatchFormer.for_config(cfg) if rule == "sweep"
              else EarlierFormation(cfg, now=lambda: 1.0 if starved else 0.0))
    rng = np.random.default_rng(seed)
    seq = iter(range(10**9))

    def queue(costs: Sequence[int]) -> None:
        former.add([PendingItem(PreparedItem(c, c, 0), object(), PARAMS, 0.0, next(seq))
                    for c in costs])

    queue([int(c) for c in rng.integers(MIXED_TOKENS[0], MIXED_TOKENS[1] + 1, pending)])
    times: list[float] = []
    for _ in range(batches):
        began = clock()
        batch = former.form()
        times.append((clock() - began) * 1000)
        assert batch is not None
        queue([p.item.cost for p in batch.items])
    return {"pending": pending, "rule": rule, **benchlib.percentiles("", times),
            "mean_ms": float(np.mean(times))}


# -- the run ----------------------------------------------------------------------------

Body = Callable[[ModelWorker, Plan, int], Awaitable[Json]]


async def with_worker(policy: str, cost: CostModel, body: Body, plan: Plan,
                      seed: int) -> Json:
    config = config_of(policy)
    policy_class = POLICY_CLASSES.get(policy, DispatchPolicy)
    worker = ModelWorker(BenchAdapter(cost), config, name="bench",
                         policy=policy_class(config), former=FORMERS.get(policy))
    await worker.start()
    try:
        return await body(worker, plan, seed)
    finally:
        await worker.stop()


def scenarios(capacity: float, mixed: float | None, turnaround_ms: float) -> list[Scenario]:
    out = [Scenario("sequential", "sequential")]
    out += [Scenario(f"closed_c{c}", "closed", {"clients": c, "turnaround_ms": turnaround_ms})
            for c in (1, 8, 32)]
    out += [Scenario(f"closed_c{c}_turnaround2x", "closed",
                     {"clients": c, "turnaround_ms": 2 * turnaround_ms}) for c in (8, 32)]
    out += [Scenario(f"closed_c{c}_immediate", "closed", {"clients": c, "turnaround_ms": 0.0})
            for c in (8, 32)]
    out += [Scenario("closed_c128_immediate", "closed", {"clients": 128, "turnaround_ms": 0.0})]
    if mixed:
        out += [Scenario("open_mixed_120", "open_mixed", {"load_pct": 120,
                                                          "rate": mixed * MIXED_LOAD})]
    out += [Scenario(f"burst_k{k}", "burst", {"size": k, "spread_ms": 4.0}) for k in (8, 32)]
    out += [Scenario(f"open_{p}", "open", {"load_pct": p, "rate": capacity * p / 100})
            for p in LOADS]
    return out


def body_of(scenario: Scenario) -> Body:
    p = scenario.params
    if scenario.kind == "sequential":
        return sequential
    if scenario.kind == "closed":
        return partial(closed_loop, clients=p["clients"], turnaround_ms=p["turnaround_ms"])
    if scenario.kind == "burst":
        return partial(bursts, size=p["size"], spread_ms=p["spread_ms"])
    if scenario.kind == "open_mixed":
        return partial(open_mixed, rate=p["rate"])
    return partial(open_loop, rate=p["rate"])


def config_of(policy: str) -> WorkerConfig:
    return {**POLICIES, **MIXED_ONLY}["default" if policy == CONTROL else policy]


async def measure_capacity(cost: CostModel, plan: Plan) -> tuple[float, float | None]:
    """Requests/s of short items, and items/s of mixed lengths (64 in flight) on a
    sleeping device (a computing one takes seconds per mixed forward: too long here)."""
    body = partial(closed_loop, clients=CAPACITY_CLIENTS, turnaround_ms=0.0)
    short = await with_worker("default", cost, body, plan, 0)
    if cost.mode != "sleep":
        return float(short["throughput_rps"]), None
    mixed = await with_worker("default", MIXED_COST, mixed_capacity, plan, 0)
    return float(short["throughput_rps"]), float(mixed["throughput_rps"])


async def run(args: argparse.Namespace, began: float) -> Json:
    # The collector as a server sets it: with Python's defaults, full collections of this
    # process paused the worker for up to 36 ms in the middle of the overload runs.
    heap.settle()
    plans = QUICK if args.quick else PLANS
    data: Json = {"meta": benchlib.meta(sys.argv), "settings": {
        "reps": args.reps, "quick": args.quick, "turnaround_ms": args.turnaround_ms,
        "item_tokens": ITEM_TOKENS, "loop": args.loop,
        "policies": {k: asdict(v) for k, v in POLICIES.items()},
        "control": CONTROL,
        "cost_models": {k: asdict(COSTS[k]) for k in args.costs},
        "quick_cpu_speedup": QUICK_SPEEDUP if args.quick else None,
        "plans": {k: asdict(plans[k]) for k in args.costs},
    }, "capacity_rps": {}, "mixed_capacity_items_per_s": {}, "results": {}}
    data["formation"] = [formation_ms(n, rule, batches=50 if args.quick else 2000)
                         for n in ((4096,) if args.quick else (512, 4096)) for rule in FORMATIONS]
    for cost_name in args.costs:
        cost, plan = COSTS[cost_name], plans[cost_name]
        if args.quick and cost.mode == "compute":
            cost = replace(cost, overhead_ms=cost.overhead_ms / QUICK_SPEEDUP,
                           per_token_us=cost.per_token_us / QUICK_SPEEDUP)
        capacity, mixed = await measure_capacity(cost, replace(plan, closed_s=plan.capacity_s))
        data["capacity_rps"][cost_name] = capacity
        data["mixed_capacity_items_per_s"][cost_name] = mixed
        chosen = [s for s in scenarios(capacity, mixed, args.turnaround_ms)
                  if not args.scenarios or s.name in args.scenarios]
        reps: dict[str, dict[str, list[Json]]] = {s.name: {p: [] for p in s.policies}
                                                  for s in chosen}
        for rep in range(args.reps):
            for scenario in chosen:
                seed = seed_of(cost_name, scenario.name, rep)
                for policy in scenario.policies:  # interleaved: A B C, then the next
                    gc.collect()
                    device = MIXED_COST if scenario.kind == "open_mixed" else cost
                    result = await with_worker(policy, device, body_of(scenario), plan, seed)
                    reps[scenario.name][policy].append(result)
            data["meta"].setdefault("loadavg_per_rep", []).append(benchlib.loadavg())
            print(f"[scheduler] {cost_name}: repetition {rep + 1}/{args.reps} done "
                  f"({time.perf_counter() - began:.0f} s)", file=sys.stderr, flush=True)
        data["results"][cost_name] = {
            s.name: {"kind": s.kind, "params": s.params, "reps": reps[s.name],
                     "summary": benchlib.summarize(reps[s.name], deltas=True)} for s in chosen}
    return data


# -- the report -------------------------------------------------------------------------

def _row(summary: Json, policy: str, metrics: Sequence[str], ratios: Sequence[str]) -> list[Any]:
    return summary_row(summary[policy], POLICY_LABELS[policy], metrics, ratios)


def markdown(data: Json) -> str:
    """Tables for every scenario, from a result JSON."""
    out: list[str] = []
    settings = data["settings"]
    for cost_name, results in data["results"].items():
        out.append(f"### {COST_LABELS.get(cost_name, cost_name)}\n")
        out.append(f"Capacity (closed loop, {CAPACITY_CLIENTS} in flight, default policy): "
                   f"{data['capacity_rps'][cost_name]:,.0f} requests/s. "
                   f"Medians of {settings['reps']} repetitions; ratios are policy / default "
                   f"per repetition, median (min-max).\n")
        if "sequential" in results:
            seq = results["sequential"]["summary"]
            out.append("Sequential client (one request at a time):\n")
            out.append(table(["policy", "queue p50 ms", "queue p99 ms", "hand-off p50 ms",
                              "latency p50 ms", "latency p99 ms", "latency p50 / default"],
                             [_row(seq, p, ["queue_p50_ms", "queue_p99_ms", "handoff_p50_ms",
                                            "latency_p50_ms", "latency_p99_ms"],
                                   ["latency_p50_ms"])
                              for p in seq]))
            out.append("")
        for res in results.values():
            if res["kind"] != "closed":
                continue
            p = res["params"]
            how = (f"turnaround {p['turnaround_ms']} ms per request through one serial lane"
                   if p["turnaround_ms"] else "immediate resubmission")
            out.append(f"Closed loop, {p['clients']} in flight ({how}):\n")
            s = res["summary"]
            out.append(table(["policy", "requests/s", "latency p50 ms", "latency p99 ms",
                              "forwards/request", "items/forward", "gap p50 ms",
                              "requests/s / default", "p50 / default"],
                             [_row(s, q, ["throughput_rps", "latency_p50_ms", "latency_p99_ms",
                                          "forwards_per_request", "items_per_forward",
                                          "gap_p50_ms"],
                                   ["throughput_rps", "latency_p50_ms"]) for q in s]))
            out.append("")
        for res in results.values():
            if res["kind"] != "burst":
                continue
            p = res["params"]
            out.append(f"Staggered bursts: {p['size']} requests within {p['spread_ms']} ms "
                       f"reach an idle worker, then a pause:\n")
            s = res["summary"]
            out.append(table(["policy", "forwards/burst", "burst done p50 ms", "queue p50 ms",
                              "burst time / default"],
                             [_row(s, q, ["forwards_per_burst", "burst_ms_p50", "queue_p50_ms"],
                                   ["burst_ms_p50"]) for q in s]))
            out.append("")
        for res in results.values():
            if res["kind"] != "open_mixed":
                continue
            out.append(f"Open loop above capacity, mixed lengths ({MIXED_TOKENS[0]}-"
                       f"{MIXED_TOKENS[1]} tokens, one item per request) on a device of "
                       f"{MIXED_COST.overhead_ms:g} ms + {MIXED_COST.per_token_us:g} us per "
                       "padded token (sleep), offered "
                       f"{res['params']['load_pct']} % of "
                       f"{data['mixed_capacity_items_per_s'][cost_name]:,.0f} items/s; waits "
                       "are submit to dispatch, bound = 2 x median wait + starvation_ms:\n")
            s = res["summary"]
            out.append(table(["policy", "offered req/s", "served items/s", "padded / real tokens",
                              "wait p50 ms", "wait p99 ms", "longest wait ms", "bound ms",
                              "longest / bound", "worst / its neighbours' bound",
                              "gap p50 ms", "items/s / default"],
                             [_row(s, q, ["offered_rps", "items_per_s", "padded_per_real",
                                          "wait_p50_ms", "wait_p99_ms", "wait_max_ms",
                                          "wait_bound_ms", "wait_max_over_bound",
                                          "over_local_bound", "gap_p50_ms"],
                                   ["items_per_s"]) for q in s]))
            out.append("")
        opens = [(n, r) for n, r in results.items() if r["kind"] == "open"]
        if opens:
            out.append("Open loop (Poisson arrivals), latency from the scheduled arrival:\n")
            rows = []
            for _, res in opens:
                s = res["summary"]
                for q in s:
                    rows.append([f"{res['params']['load_pct']} %", POLICY_LABELS[q],
                                 s[q]["median"]["offered_rps"],
                                 s[q]["median"]["latency_p50_ms"], s[q]["median"]["latency_p99_ms"],
                                 s[q]["median"]["items_per_forward"],
                                 fmt_spread(s[q]["ratio_to_default"]["latency_p50_ms"]),
                                 fmt_spread(s[q]["ratio_to_default"]["latency_p99_ms"])])
            out.append(table(["load", "policy", "offered req/s", "latency p50 ms",
                              "latency p99 ms", "items/forward", "p50 / default",
                              "p99 / default"], rows))
            out.append("")
    out.append(formation_table(data))
    out.append(done_when(data))
    out.append(verdict(data))
    return "\n".join(out)


def formation_table(data: Json) -> str:
    rows = [[f"{f['pending']:,}", FORMATIONS[f["rule"]], f["p50_ms"], f["p99_ms"], f["mean_ms"]]
            for f in data.get("formation", [])]
    return ("### Formation (`BatchFormer.form`, mixed lengths, one batch of up to 64 items)\n\n"
            + table(["pending items", "rule", "p50 ms", "p99 ms", "mean ms"], rows) + "\n")


def done_when(data: Json) -> str:
    """The issue's scheduler targets, each with its figure from this run."""
    rows: list[list[Any]] = []
    for cost_name, results in data["results"].items():
        for name in ("closed_c8_immediate", "closed_c32_immediate"):
            if name in results:
                ratio = results[name]["summary"]["idle0"]["ratio_to_default"]["throughput_rps"]
                inverse = {k: 1 / v if k != "n" and v else v for k, v in ratio.items()}
                inverse["min"], inverse["max"] = inverse["max"], inverse["min"]
                rows.append([cost_name, f"{name}: default / idle_coalesce_ms=0 requests/s",
                             ">= 0.95", fmt_spread(inverse)])
        if "sequential" in results:
            rows.append([cost_name, "sequential queue p50 ms (default)", "< 0.1",
                         results["sequential"]["summary"]["default"]["median"]["queue_p50_ms"]])
        if "closed_c128_immediate" in results:
            rows.append([cost_name, "gap between forwards p50 ms, 128 in flight (default)",
                         "< 0.2", results["closed_c128_immediate"]["summary"]["default"]
                         ["median"]["gap_p50_ms"]])
        if "open_mixed_120" in results:
            mixed = results["open_mixed_120"]["summary"]["default"]["median"]
            rows.append([cost_name, "open loop 120 %, mixed: padded / real tokens", "<= 1.15",
                         mixed["padded_per_real"]])
            rows.append([cost_name, "open loop 120 %, mixed: longest wait / bound", "<= 1",
                         mixed["wait_max_over_bound"]])
            rows.append([cost_name, "the same, each wait against 2 x the median of the "
                         "waits handed within 100 ms of it + 40 ms (for comparison)", "-",
                         mixed.get("over_local_bound", "-")])
            rows.append([cost_name, "open loop 120 %, mixed: gap between forwards p50 ms",
                         "< 0.2", mixed["gap_p50_ms"]])
    for f in data.get("formation", []):
        if f["pending"] == 4096 and f["rule"] == "sweep":
            rows.append(["-", "formation at 4,096 pending, p50 ms", "<= 0.2", f["p50_ms"]])
    return ("### Done when (issue 11), from this run\n\n"
            + table(["cost model", "measure", "target", "figure"], rows) + "\n")


def verdict(data: Json) -> str:
    """The trade in numbers: sequential queue time gained, closed-loop throughput kept."""
    lines = ["Trade summary (earlier idle rule against the default, per repetition, median "
             "(min-max); the A/A row is the noise band):\n"]
    rows = []
    for cost_name, results in data["results"].items():
        if "sequential" in results:
            seq = results["sequential"]["summary"]["earlier"]["delta_to_default"]
            rows.append([cost_name, "sequential queue p50: earlier - default (ms)",
                         fmt_spread(seq["queue_p50_ms"]), "-"])
            rows.append([cost_name, "sequential latency p50: earlier - default (ms)",
                         fmt_spread(seq["latency_p50_ms"]), "-"])
        for name, res in results.items():
            if res["kind"] != "closed" or res["params"]["clients"] == 1:
                continue
            s = res["summary"]
            rows.append([cost_name, f"{name}: requests/s, earlier / default",
                         fmt_spread(s["earlier"]["ratio_to_default"]["throughput_rps"]),
                         fmt_spread(s[CONTROL]["ratio_to_default"]["throughput_rps"])])
    lines.append(table(["cost model", "measure", "value", "A/A control"], rows))
    return "\n".join(lines) + "\n"


def plot(data: Json, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    costs = list(data["results"])
    fig, axes = plt.subplots(1, len(costs), figsize=(6 * len(costs), 4.5), squeeze=False)
    colors = {"default": "tab:blue", "idle0": "tab:green", "earlier": "tab:red",
              "nohold": "tab:purple"}
    for ax, cost_name in zip(axes[0], costs, strict=True):
        opens = [r for r in data["results"][cost_name].values() if r["kind"] == "open"]
        loads = [r["params"]["load_pct"] for r in opens]
        for policy, color in colors.items():
            p50 = [r["summary"][policy]["median"]["latency_p50_ms"] for r in opens]
            p99 = [r["summary"][policy]["median"]["latency_p99_ms"] for r in opens]
            ax.plot(loads, p50, "o-", color=color, label=f"{PLOT_LABELS[policy]} p50")
            ax.plot(loads, p99, "s--", color=color, alpha=0.7,
                    label=f"{PLOT_LABELS[policy]} p99")
        ax.set_yscale("log")
        ax.set_xlabel(f"offered load, % of capacity "
                      f"({data['capacity_rps'][cost_name]:,.0f} req/s)")
        ax.set_ylabel("latency, ms (log)")
        ax.set_title(COST_LABELS.get(cost_name, cost_name), fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Ember scheduler, open loop (synthetic model), {data['meta']['date']}",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


FULL_REPS = 5


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    benchlib.add_common_args(parser, Path("docs/bench/scheduler.json"), FULL_REPS,
                             "smoke run of a few seconds")
    parser.add_argument("--plot", type=Path, default=None,
                        help="PNG of latency against load, drawn only if given (the page's: "
                        "docs/bench/latency_vs_load.png)")
    parser.add_argument("--costs", default="gpu,cpu", help="cost models to run, of gpu,cpu")
    parser.add_argument("--turnaround-ms", type=float, default=0.5,
                        help="serial per-request turnaround of closed-loop clients")
    parser.add_argument("--scenarios", default="",
                        help="run only these scenarios (comma-separated names, e.g. "
                        "sequential,closed_c8); default: all")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                        help="event loop (the server runs uvloop)")
    args = parser.parse_args(argv)
    args.costs = [c for c in args.costs.split(",") if c]
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    if unknown := [c for c in args.costs if c not in COSTS]:
        parser.error(f"unknown cost models {unknown}; use gpu and/or cpu")
    benchlib.resolve_reps(args, FULL_REPS)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report is not None:
        data = benchlib.read_json(args.report)
        print(markdown(data))
        if args.plot is not None:
            plot(data, args.plot)
        return 0
    began = time.perf_counter()
    if args.loop == "uvloop":
        import uvloop

        data = uvloop.run(run(args, began))
    else:
        data = asyncio.run(run(args, began))
    if args.plot is not None:  # a partial run (--scenarios) must not replace the page's plot
        plot(data, args.plot)
    return benchlib.finish(args.out, data, began, markdown(data), "scheduler")


if __name__ == "__main__":
    sys.exit(main())
