"""What the benchmarks share: percentiles, the machine they ran on, and ratio tables.

Benchmarks report ratios measured side by side in one run (DESIGN.md, Tests and
benchmarks): each repetition runs every variant back to back, and a ratio's
spread is the min-max of its per-repetition values.
"""

from __future__ import annotations

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
