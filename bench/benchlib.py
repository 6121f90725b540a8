"""What the benchmarks share: percentiles, the machine they ran on, per-repetition
summaries, ratio tables and the common command-line flags. (HTTP load: loadgen.py.)

Benchmarks report ratios measured side by side in one run (docs/benchmarks.md): each
repetition runs every variant back to back, and a ratio's spread is the min-max of its
per-repetition values.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

Json = dict[str, Any]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def percentiles(name: str, values: Sequence[float], qs: Sequence[int] = (50, 99)) -> Json:
    """`{"<name>_p50_ms": ..., "<name>_p99_ms": ...}` (`"p50_ms"` for no name): the
    fields a result reports for one series of times in milliseconds."""
    prefix = f"{name}_" if name else ""
    return {f"{prefix}p{q}_ms": percentile(values, q) for q in qs}


def median(values: Iterable[float]) -> float:
    kept = [v for v in values if v is not None and v == v]  # drop NaN and None
    return statistics.median(kept) if kept else float("nan")


def spread(values: Sequence[float]) -> Json:
    """Median and min-max of per-repetition values (NaN dropped)."""
    kept = [v for v in values if v is not None and v == v]
    if not kept:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": statistics.median(kept), "min": min(kept), "max": max(kept),
            "n": len(kept)}


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _run(command: Sequence[str]) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=10,
                              check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine() -> Json:
    """The machine a run was made on: cores, memory, CPU model, load, Python."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": _run(["nproc"]) or str(os.cpu_count()),
        "free_m": _run(["free", "-m"]),
        "cpu": cpu or platform.processor(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "loadavg_at_start": loadavg(),
    }


def loadavg() -> list[float]:
    """1, 5 and 15 minute load averages (others share this machine: a load well over
    the core count means the figures are noisy)."""
    if not hasattr(os, "getloadavg"):
        return []
    return [round(x, 2) for x in os.getloadavg()]


def meta(argv: Sequence[str]) -> Json:
    now = dt.datetime.now().astimezone()
    return {
        "date": now.strftime("%Y-%m-%d"),
        "started_at": now.isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *argv]),
        "machine": machine(),
    }


def strict(value: Any) -> Any:
    """`value` with NaN and infinities as None, so the file is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict(v) for v in value]
    return value


def write_json(path: Path, data: Json) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(strict(data), indent=1, allow_nan=False) + "\n",
                    encoding="utf-8")


def fmt(value: object, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:
            return "-"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.{digits}f}"
    return str(value)


def fmt_spread(s: Mapping[str, float] | None) -> str:
    """`1.02 (0.97-1.06)`: median and min-max of per-repetition ratios."""
    if not s or not s.get("n"):
        return "-"
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|"]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def summarize(reps: Mapping[str, Sequence[Json]], base: str = "default", *,
              deltas: bool = False) -> Json:
    """Per variant: the median of every numeric field over the repetitions, and its
    per-repetition ratio (and, with `deltas`, difference) to the `base` variant's run of
    the same repetition, as median and min-max."""
    base_runs = reps[base]
    out: Json = {}
    for variant, runs in reps.items():
        keys = [k for k, v in runs[0].items() if isinstance(v, int | float)
                and not isinstance(v, bool)]
        pairs = list(zip(runs, base_runs, strict=True))
        entry: Json = {
            "median": {k: median(r[k] for r in runs) for k in keys},
            f"ratio_to_{base}": {k: spread([ratio(r[k], b[k]) for r, b in pairs])
                                 for k in keys},
        }
        if deltas:
            entry[f"delta_to_{base}"] = {k: spread([r[k] - b[k] for r, b in pairs])
                                         for k in keys}
        out[variant] = entry
    return out


def summary_row(entry: Mapping[str, Any], label: str, metrics: Sequence[str],
                ratios: Sequence[str], base: str = "default") -> list[Any]:
    """A table row: the label, medians of `metrics`, then ratios to the base (spread)."""
    return ([label] + [entry["median"].get(m) for m in metrics]
            + [fmt_spread(entry[f"ratio_to_{base}"].get(m)) for m in ratios])


def add_common_args(parser: argparse.ArgumentParser, out: Path, full_reps: int,
                    quick_help: str) -> None:
    """--quick, --reps, --out and --report, as every benchmark takes them."""
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--reps", type=int, default=None,
                        help=f"repetitions (default {full_reps}; 1 with --quick)")
    parser.add_argument("--out", type=Path, default=out, help="the JSON result")
    parser.add_argument("--report", type=Path, default=None,
                        help="print the markdown tables of an earlier JSON result and exit")


def resolve_reps(args: argparse.Namespace, full_reps: int) -> None:
    if args.reps is None:
        args.reps = 1 if args.quick else full_reps


def int_list(text: str) -> list[int]:
    """`"1,8,32"` -> [1, 8, 32]."""
    return [int(x) for x in str(text).split(",") if x.strip()]


def read_json(path: Path) -> Json:
    data: Json = json.loads(path.read_text(encoding="utf-8"))
    return data


def finish(out: Path, data: Json, began: float, report: str, tag: str) -> int:
    """Close a run: its duration and the load at its end, the JSON written, the tables
    printed."""
    import time

    data["meta"]["duration_s"] = round(time.perf_counter() - began, 1)
    data["meta"]["loadavg_at_end"] = loadavg()
    write_json(out, data)
    print(report)
    print(f"[{tag}] wrote {out} in {data['meta']['duration_s']} s", file=sys.stderr)
    return 0
