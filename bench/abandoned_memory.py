#!/usr/bin/env python
"""Resident memory after bulk requests that clients abandon: does the server keep growing?

`ember serve` (the default model; one process, or `--workers N`), warmed with 20 small
requests, then rounds: `--requests` OpenAI `/v1/embeddings` requests of `--texts` short
texts (10 words, ~65 characters), `--concurrency` at a time, each abandoned by a client
timeout of `--timeout-s` (the server answers 499 to no one and drops what the request had
queued; one refused for a full queue is counted apart), then `--quiet-s` of quiet, then
every process's RSS (psutil), by role: the server (one process), or the supervisor, the
engine process and each API process. With `--landed-src`, a server of that source tree
runs the same rounds after this tree's, in each repetition (A B, A B).

    python bench/abandoned_memory.py                                # 10 rounds, ~2 min
    python bench/abandoned_memory.py --workers 2 --rounds 12
    python bench/abandoned_memory.py --landed-src ../wt-landed/src --reps 2
    python bench/abandoned_memory.py --quick                        # smoke run, seconds
    python bench/abandoned_memory.py --report docs/bench/abandoned_memory.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import benchlib
import httpx
import loadgen
import psutil
from benchlib import Json, fmt, median, table

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
OUT = Path(__file__).resolve().parents[1] / "docs" / "bench" / "abandoned_memory.json"
# Two requests of 2,048 texts at a time fill the default queue (4,096 items) but not past.
FULL = {"rounds": 10, "requests": 40, "texts": 2048, "concurrency": 2, "timeout_s": 0.3,
        "quiet_s": 4.0}
# The smoke run's timeout is short enough to abandon a small request to the synthetic model.
QUICK = {"rounds": 2, "requests": 4, "texts": 128, "concurrency": 4, "timeout_s": 0.002,
         "quiet_s": 0.5}
WARMUP = 20
MB = 1024 * 1024


def roles(server: loadgen.Server) -> dict[int, str]:
    """The server's processes by role, from the pids its log names (at --log-level info)."""
    text = server.log.read_text(errors="replace")
    out = {server.pid: "server"}
    if engine := re.search(r"engine pid (\d+)", text):
        out[server.pid] = "supervisor"
        out[int(engine.group(1))] = "engine"
    for index, pid in re.findall(r"API process (\d+) \(pid (\d+)\) serves", text):
        out[int(pid)] = f"api {index}"
    return out


def await_roles(server: loadgen.Server, workers: int, timeout_s: float = 60.0) -> dict[int, str]:
    """Once every API process has said it serves (they may start after /readyz answers)."""
    deadline = time.monotonic() + timeout_s
    while len(found := roles(server)) < (1 if workers == 0 else workers + 2):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the log named only {sorted(found.values())}")
        time.sleep(0.2)
    return found


def rss_mb(by_pid: dict[int, str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for pid, role in by_pid.items():
        try:
            out[role] = psutil.Process(pid).memory_info().rss / MB
        except psutil.Error:
            out[role] = float("nan")
    return out


async def send_round(url: str, model: str, texts: Sequence[str], requests: int,
                     concurrency: int, timeout_s: float) -> dict[str, int]:
    """`requests` bulk requests, each given up after `timeout_s`; what became of them."""
    body = json.dumps({"model": model, "input": list(texts)}).encode()
    outcome = {"abandoned": 0, "answered": 0, "refused": 0}
    gate = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient) -> None:
        async with gate:
            try:
                response = await client.post(f"{url}/v1/embeddings", content=body,
                                             headers=loadgen.JSON_HEADERS)
                if response.status_code == 429:  # the queue is full: a client retries later
                    outcome["refused"] += 1
                elif response.status_code == 200:
                    outcome["answered"] += 1
                else:
                    raise RuntimeError(f"{response.status_code}: {response.text[:300]}")
            except httpx.TimeoutException:
                outcome["abandoned"] += 1

    async with httpx.AsyncClient(timeout=timeout_s) as client:
        await asyncio.gather(*(one(client) for _ in range(requests)))
    return outcome


def warm(url: str, model: str) -> None:
    with httpx.Client(timeout=60) as client:
        for text in loadgen.texts("short", WARMUP):
            response = client.post(f"{url}/v1/embeddings", json={"model": model, "input": text})
            response.raise_for_status()


def run_server(tree: str, pythonpath: str | None, args: argparse.Namespace, log_dir: Path,
               rep: int) -> Json:
    serve = ["--log-level", "info", "--default-model", args.model,
             *(["--workers", str(args.workers)] if args.workers else [])]
    server = loadgen.Server(serve, log_dir / f"{tree}-{rep}.log", pythonpath=pythonpath)
    texts = loadgen.texts("short", args.texts, seed=rep)
    with server:
        server.wait_ready()
        by_pid = await_roles(server, args.workers)
        warm(server.url, args.model)
        series: dict[str, list[float]] = {role: [v] for role, v in rss_mb(by_pid).items()}
        outcomes = {"abandoned": 0, "answered": 0, "refused": 0}
        for _ in range(args.rounds):
            got = asyncio.run(send_round(server.url, args.model, texts, args.requests,
                                         args.concurrency, args.timeout_s))
            outcomes = {k: outcomes[k] + got[k] for k in outcomes}
            time.sleep(args.quiet_s)
            for role, value in rss_mb(by_pid).items():
                series[role].append(value)
        code = server.stop()
    print(f"[abandoned_memory] {tree} rep {rep}: " + ", ".join(
        f"{role} {s[0]:.0f} -> {s[1]:.0f} -> {s[-1]:.0f} MB" for role, s in series.items()),
        file=sys.stderr)
    return {"tree": tree, "rep": rep, "rss_mb": series, **outcomes, "exit_code": code}


def growth_per_round(series: Sequence[float]) -> float:
    """MB a round after round 0 (which holds the first burst's own allocations)."""
    return (series[-1] - series[1]) / (len(series) - 2) if len(series) > 2 else float("nan")


def summarize(runs: Sequence[Json]) -> Json:
    out: Json = {}
    for tree in dict.fromkeys(run["tree"] for run in runs):
        mine = [run for run in runs if run["tree"] == tree]
        out[tree] = {role: {"first_round_mb": median(r["rss_mb"][role][1] - r["rss_mb"][role][0]
                                                     for r in mine),
                            "growth_per_round_mb": median(growth_per_round(r["rss_mb"][role])
                                                          for r in mine),
                            "last_mb": median(r["rss_mb"][role][-1] for r in mine)}
                     for role in mine[0]["rss_mb"]}
    return out


def report(data: Json) -> str:
    s = data["settings"]
    lines = [f"### Memory after abandoned bulk requests ({s['rounds']} rounds of "
             f"{s['requests']} requests x {s['texts']} texts, workers {s['workers']})\n"]
    rows = [[run["tree"], run["rep"], role, fmt(series[0], 0), fmt(series[1], 0),
             fmt(series[-1], 0), fmt(growth_per_round(series), 2), run["abandoned"],
             run["answered"], run["refused"]]
            for run in data["result"]["runs"] for role, series in run["rss_mb"].items()]
    lines.append(table(["tree", "rep", "process", "warm MB", "after round 0",
                        "after the last", "MB a round after round 0", "abandoned",
                        "answered", "refused (429)"], rows))
    summary = data["result"]["summary"]
    lines.append("\n" + table(["tree", "process", "round 0 adds MB", "MB a round (median)",
                               "last MB (median)"],
                              [[tree, role, fmt(v["first_round_mb"], 1),
                                fmt(v["growth_per_round_mb"], 2), fmt(v["last_mb"], 0)]
                               for tree, by_role in summary.items()
                               for role, v in by_role.items()]))
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    benchlib.add_common_args(parser, OUT, 1, "2 small rounds, for a smoke test")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--workers", type=int, default=0, help="API processes (0: one process)")
    parser.add_argument("--landed-src", default=None, help="another tree's src/, run after")
    for name, value in FULL.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=None)
    args = parser.parse_args(argv)
    if args.report is not None:
        print(report(benchlib.read_json(args.report)))
        return 0
    benchlib.resolve_reps(args, 1)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    began = time.perf_counter()
    trees: list[tuple[str, str | None]] = [("this", str(Path(__file__).resolve().parents[1]
                                                         / "src"))]
    if args.landed_src:
        trees.append(("landed", args.landed_src))
    runs: list[Json] = []
    with tempfile.TemporaryDirectory(prefix="ember-memory-") as logs:
        for rep in range(args.reps):
            for tree, src in trees:
                runs.append(run_server(tree, src, args, Path(logs), rep))
    settings: dict[str, Any] = {name: getattr(args, name) for name in FULL}
    settings.update(model=args.model, workers=args.workers, reps=args.reps)
    data: Json = {"meta": benchlib.meta(sys.argv), "settings": settings,
                  "result": {"runs": runs, "summary": summarize(runs)}}
    return benchlib.finish(args.out, data, began, report(data), "abandoned_memory")


if __name__ == "__main__":
    sys.exit(main())
