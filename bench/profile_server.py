#!/usr/bin/env python
"""Profile the request path: py-spy samples `ember serve` while a closed loop of aiohttp
clients keeps it busy, then the top frames print as markdown tables.

The server serves the SYNTHETIC GPU-like model `ember/synthetic` (a benchmark model;
a forward sleeps, so the samples are the front end's work). py-spy records without
pausing the server (`--nonblocking`), idle threads left out, so the samples are CPU
work; frames are grouped as `function (module path)`, the path relative to
site-packages, the standard library or src/, line numbers dropped. "self" counts the
innermost frame of each sample, "inclusive" every frame on the stack (once a sample)
below the thread's trunk. A frame that calls into C code (uvloop, httptools, a lock)
holds that C work as "self": `Runner.run` is the event loop itself.

    python bench/profile_server.py                                   # the code here
    python bench/profile_server.py --landed-src ../wt-landed/src     # another tree
    python bench/profile_server.py --serve-args "--workers 2" --subprocesses
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shlex
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import benchlib
import loadgen
from benchlib import Json, table

SYNTHETIC = "ember/synthetic"
_FRAME = re.compile(r"^(?P<func>.*) \((?P<path>.*?)(?::\d+)?\)$")
_STDLIB = re.compile(r"/lib/python3\.\d+/")


@dataclass(frozen=True)
class Profile:
    samples: int
    self_counts: Counter[str]
    inclusive_counts: Counter[str]
    processes: Counter[str]  # samples per process (with --subprocesses)


def short_path(path: str) -> str:
    """A module path relative to site-packages, src/ or the standard library."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    if "/src/" in path:
        return path.rsplit("/src/", 1)[1]
    if m := _STDLIB.search(path):
        return path[m.end():]
    return path


def frame_name(frame: str) -> str:
    """`function (module path)`, without the line number."""
    m = _FRAME.match(frame.strip())
    if m is None:
        return frame.strip()
    return f"{m.group('func')} ({short_path(m.group('path'))})"


def trunks(stacks: Sequence[tuple[list[str], int]]) -> dict[str, int]:
    """Per root frame, how many leading frames every stack under that root shares (the
    entry frames a thread always passes through: runpy, cli.main, Runner.run ...)."""
    common: dict[str, list[str]] = {}
    for names, _ in stacks:
        prefix = common.setdefault(names[0], names[:-1])
        n = 0
        while n < len(prefix) and n < len(names) - 1 and prefix[n] == names[n]:
            n += 1
        del prefix[n:]
    return {root: len(prefix) for root, prefix in common.items()}


def parse_raw(lines: Iterable[str]) -> Profile:
    """py-spy's raw (collapsed stacks) output: `frame;frame;... count` per line, root
    first; with --subprocesses the first frame names the process. Inclusive counts leave
    out each thread's trunk (the frames all of its samples share), which would top the
    table at 100 % of that thread and say nothing."""
    processes: Counter[str] = Counter()
    stacks: list[tuple[list[str], int]] = []
    for line in lines:
        stack, _, count_text = line.rstrip("\n").rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        frames = stack.split(";")
        if frames[0].startswith("process "):
            processes[frames.pop(0)] += int(count_text)
        names = [frame_name(f) for f in frames if f]
        if names:
            stacks.append((names, int(count_text)))
    trunk = trunks(stacks)
    self_counts: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for names, count in stacks:
        self_counts[names[-1]] += count
        for name in set(names[trunk[names[0]]:]):
            inclusive[name] += count
    return Profile(sum(c for _, c in stacks), self_counts, inclusive, processes)


def top_rows(counts: Counter[str], samples: int, requests: float, rate: int,
             top: int) -> list[list[object]]:
    """Rows: frame, share of samples, and CPU microseconds per request."""
    return [[f"`{name}`", 100 * n / samples, 1e6 * n / rate / requests if requests else None]
            for name, n in counts.most_common(top)]


def markdown(result: Json, profile: Profile, top: int) -> str:
    s = result["settings"]
    load = result["load"]
    requests = load["requests_per_s"] * s["seconds"]
    out = [f"py-spy {s['rate']} Hz for {s['seconds']} s on `ember serve "
           f"{' '.join(s['serve_args'])}`"
           + (f" (PYTHONPATH={s['pythonpath']})" if s["pythonpath"] else "")
           + f", {s['in_flight']} requests in flight ({s['texts_per_request']} text each): "
           f"{load['requests_per_s']:,.0f} req/s, p50 {load['latency_p50_ms']:.1f} ms; "
           f"{profile.samples} samples = {profile.samples / s['rate'] / s['seconds']:.2f} "
           f"cores of Python work. Load average {result['loadavg']}.\n"]
    for title, counts in (("Self", profile.self_counts),
                          ("Inclusive", profile.inclusive_counts)):
        out.append(f"{title} (top {top}):\n")
        out.append(table(["frame", "% of samples", "us per request"],
                         top_rows(counts, profile.samples, requests, s["rate"], top)))
        out.append("")
    if len(profile.processes) > 1:
        out.append(table(["process", "samples"], profile.processes.most_common()))
    return "\n".join(out) + "\n"


async def profile_under_load(server: loadgen.Server, args: argparse.Namespace,
                             raw: Path) -> Json:
    """A closed loop that covers the whole py-spy recording, which starts after a warm-up."""
    payloads = loadgen.encode_bodies("short", 256, args.texts_per_request)
    url = f"{server.url}/v1/encode/{SYNTHETIC}"
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    command = [py_spy, "record", "-p", str(server.pid), "-d", str(args.seconds), "-r",
               str(args.rate), "-f", "raw", "-o", str(raw), "--nonblocking"]
    if args.subprocesses:
        command.append("--subprocesses")
    warmup_s = 1.0

    async def record() -> int:
        await asyncio.sleep(warmup_s)
        proc = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"py-spy failed ({proc.returncode}): {err.decode()[-2000:]}")
        return proc.returncode

    async with loadgen.client_session(args.in_flight + 4) as session:
        for body in payloads[:16]:
            await loadgen.post(session, url, body)
        # The measured window is the recording's: it starts with py-spy, ends with it
        # (py-spy takes a moment to attach; the load runs on a little after it).
        loop_task = asyncio.create_task(loadgen.closed_loop(
            session, url, payloads, args.in_flight, warmup_s + 0.3, args.seconds))
        await record()
        run = await loop_task
    return run.summary()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--landed-src", type=Path, default=None,
                        help="serve from this source tree (PYTHONPATH)")
    parser.add_argument("--serve-args", default="", help="extra `ember serve` arguments")
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--texts-per-request", type=int, default=1)
    parser.add_argument("--seconds", type=int, default=10, help="py-spy recording time")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--subprocesses", action="store_true",
                        help="sample the server's child processes too")
    parser.add_argument("--raw", type=Path, default=None, help="keep py-spy's raw output here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import uvloop

    serve_args = ["--default-model", SYNTHETIC, *shlex.split(args.serve_args)]
    pythonpath = str(args.landed_src.resolve()) if args.landed_src else None
    with tempfile.TemporaryDirectory(prefix="ember-profile-") as tmp:
        raw = args.raw or Path(tmp) / "profile.txt"
        with loadgen.Server(serve_args, Path(tmp) / "server.log",
                            pythonpath=pythonpath) as server:
            server.wait_ready()
            load = uvloop.run(profile_under_load(server, args, raw))
        profile = parse_raw(raw.read_text(encoding="utf-8").splitlines())
    result: Json = {"settings": {"serve_args": serve_args, "pythonpath": pythonpath,
                                 "in_flight": args.in_flight, "seconds": args.seconds,
                                 "rate": args.rate,
                                 "texts_per_request": args.texts_per_request},
                    "load": load, "loadavg": benchlib.loadavg()}
    print(markdown(result, profile, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
