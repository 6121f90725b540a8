"""Run the reliability tests (tests/reliability) and print their figures as markdown.

The tests write what they measured as JSON into EMBER_RELIABILITY_OUT; this script sets
it, runs them (the long form by default: 60 s soaks), then renders the figures for
docs/reliability.md:

    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 .venv/bin/python bench/reliability_report.py \
        --soak-s 60 --out /tmp/ember-reliability > /tmp/reliability-figures.md

`--no-run` renders an existing folder; `--soak-s 5` is the CI form.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
Figures = Mapping[str, Any]


def run_tests(out: Path, soak_s: float, extra: list[str]) -> int:
    env = {**os.environ, "EMBER_RELIABILITY_OUT": str(out), "EMBER_SOAK_S": str(soak_s),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    command = [sys.executable, "-m", "pytest", "tests/reliability", "-q", *extra]
    print(f"running: EMBER_SOAK_S={soak_s} {' '.join(command)}", file=sys.stderr)
    return subprocess.call(command, cwd=REPO, env=env, stdout=sys.stderr)


def load(out: Path) -> dict[str, Figures]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(out.glob("*.json"))}


def statuses(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in counts.items()) or "-"


def soak(figures: Mapping[str, Figures]) -> list[str]:
    rows = [figures[k] for k in ("load_soak_32", "load_soak_128") if k in figures]
    if not rows:
        return []
    lines = ["### Load: the default model under sustained concurrency", "",
             f"Model {rows[0]['model']} on CPU, real `ember serve` process, 1-4 texts a "
             "request (a quarter on /v1/embeddings), closed loop.", "",
             "| in flight | seconds | requests | statuses | items/s | p50 ms | p99 ms | "
             "items/forward | wrong vectors | worst diff vs alone | RSS start -> end (MB) | "
             "RSS peak (MB) | CPU cores: server / test client / other processes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lat = r["latency_ms"]
        lines.append(
            f"| {r['concurrency']} | {r['seconds']} | {r['requests']} | "
            f"{statuses(r['statuses'])} | {r['items_per_s']} | {lat['p50']} | {lat['p99']} | "
            f"{r['mean_items_per_forward']} | {r['wrong_vectors']} | "
            f"{r['worst_abs_diff_vs_alone']:.1e} | {r['rss_mb_start']} -> {r['rss_mb_end']} "
            f"({r['rss_growth_mb']:+}) | {r.get('rss_mb_peak', '-')} | "
            f"{r.get('server_cpu_cores', '-')} / {r.get('client_cpu_cores', '-')} / "
            f"{r.get('other_processes_cpu_cores', '-')} of {r.get('machine_cores', '-')} |")
    lines += ["", f"Errors other than 429: {sum(r['transport_or_other_errors'] for r in rows)}."
              f" Tolerance {rows[0]['tolerance']}; RSS growth bound "
              f"{rows[0]['rss_growth_bound_mb']:.0f} MB per soak. RSS and server CPU count "
              "every process of the server (with --workers, its API and engine processes).",
              ""]
    return lines


def bullets(title: str, data: Figures, skip: tuple[str, ...] = ("name",)) -> list[str]:
    lines = [f"### {title}", ""]
    for key, value in data.items():
        if key in skip:
            continue
        if isinstance(value, Mapping):
            value = ", ".join(f"{k}: {v}" for k, v in value.items())
        elif isinstance(value, list):
            value = ", ".join(str(v) for v in value)
        text = " ".join(str(value).split())  # one line per bullet
        lines.append(f"- {key.replace('_', ' ')}: {text}")
    return [*lines, ""]


def fuzz(data: Figures) -> list[str]:
    lines = ["### Bad input: schemathesis over the OpenAPI document", "",
             f"schemathesis {data['schemathesis']}, {data['examples_per_operation_and_mode']} "
             f"examples per operation and mode, derandomized: {data['requests']} requests "
             f"over {data['operations']} operations; statuses {statuses(data['statuses'])}.", "",
             "| operation | examples (mode: n) | statuses | seconds |", "|---|---|---|---|"]
    for name, entry in data["per_operation"].items():
        lines.append(f"| {name} | {statuses(entry['examples'])} | "
                     f"{statuses(entry['statuses'])} | {entry['seconds']} |")
    return [*lines, ""]


def bad_input(data: Figures) -> list[str]:
    lines = ["### Bad input: hand-made cases", "",
             f"{data['cases']} cases; statuses {statuses(data['statuses'])}; server alive "
             f"after: {data['server_alive']}.", "", "| case | status | error type |",
             "|---|---|---|"]
    lines += [f"| {r['case']} | {r['status']} | {r['type'] or '-'} |" for r in data["results"]]
    return [*lines, ""]


def session(data: Figures) -> list[str]:
    files: dict[str, dict[str, Any]] = {}
    slow = []
    for name, entry in data["tests"].items():
        short = name.split("tests/reliability/")[-1]
        row = files.setdefault(short.split("::")[0], {"tests": 0, "seconds": 0.0,
                                                      "outcomes": {}})
        row["tests"] += 1
        row["seconds"] += entry["seconds"]
        row["outcomes"][entry["outcome"]] = row["outcomes"].get(entry["outcome"], 0) + 1
        if entry["seconds"] >= 1.0:
            slow.append((entry["seconds"], short))
    lines = ["### Run time", "", f"Whole run: {data['total_s']} s, exit status "
             f"{data['exit_status']}. Seconds include each test's share of server starts.",
             "", "| file | tests | outcomes | seconds |", "|---|---|---|---|"]
    for file, entry in files.items():
        lines.append(f"| {file} | {entry['tests']} | {statuses(entry['outcomes'])} | "
                     f"{entry['seconds']:.1f} |")
    lines += ["", "Tests of a second or more: " + "; ".join(
        f"{name} {seconds:.1f} s" for seconds, name in sorted(slow, reverse=True)) + ".", ""]
    return lines


SECTIONS: list[tuple[str, str, Callable[[Figures], list[str]] | None]] = [
    ("load_overload", "Overload past the queue limit", None),
    ("fault_sigterm", "Fault: SIGTERM under load", None),
    ("fault_forward_raises", "Fault: a forward that raises", None),
    ("fault_client_disconnect", "Fault: a client that disconnects while queued", None),
    ("fault_model_load", "Fault: a model that fails to load", None),
    ("fault_request_timeout", "Fault: a slow forward under --request-timeout-s", None),
    ("bad_input", "", bad_input),
    ("schemathesis", "", fuzz),
    ("security_api_key", "Security: API key", None),
    ("security_model_names", "Security: model names are not paths", None),
    ("security_pickle", "Security: pickled weights", None),
    ("security_remote_code", "Security: remote code", None),
    ("security_error_bodies", "Security: error bodies", None),
    ("_session", "", session),
]


def render(figures: Mapping[str, Figures]) -> str:
    lines = soak(figures)
    for key, title, renderer in SECTIONS:
        if key not in figures:
            continue
        data = figures[key]
        if key == "security_error_bodies":
            data = {"cases": data["cases"], "messages": {k: v["message"]
                                                        for k, v in data["bodies"].items()}}
        lines += renderer(data) if renderer else bullets(title, data)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--soak-s", type=float, default=60.0, help="seconds of each soak")
    parser.add_argument("--out", type=Path, default=Path("/tmp/ember-reliability"))
    parser.add_argument("--no-run", action="store_true", help="render an existing --out")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args()
    code = 0
    if not args.no_run:
        args.out.mkdir(parents=True, exist_ok=True)
        for old in args.out.glob("*.json"):
            old.unlink()
        code = run_tests(args.out, args.soak_s, args.pytest_args)
    print(render(load(args.out)))
    return code


if __name__ == "__main__":
    sys.exit(main())
