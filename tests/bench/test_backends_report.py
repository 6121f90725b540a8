"""bench/backends.py's report, from the committed run: the summary is what its raw
figures give, and the tables name every target. The run itself takes minutes and
starts four servers, so CI does not make one (docs/benchmarks.md has the command)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULT = ROOT / "docs" / "bench" / "backends.json"


def load_bench() -> Any:
    spec = importlib.util.spec_from_file_location("ember_bench_backends",
                                                  ROOT / "bench" / "backends.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_summary_follows_from_the_raw_figures() -> None:
    bench = load_bench()
    data = json.loads(RESULT.read_text(encoding="utf-8"))
    recomputed = json.loads(json.dumps(bench.summarize(data)))  # NaN-free, as stored
    assert recomputed == data["summary"]
    rows = bench.done_when(data)
    measures = [row[0] for row in rows]
    assert "onnx / torch-main: 8 in flight req/s" in measures
    assert "onnx / torch: sequential p50 ms" in measures
    assert {f"{n}: 8 in flight p50, contended / quiet" for n in data["load"]["quiet"]} <= set(
        measures)


def test_report_prints_the_tables() -> None:
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "backends.py"), "--report",
                          str(RESULT)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    for heading in ("Targets (issue 13)", "In-process limit", "a competing process",
                    "int8 against fp32"):
        assert heading in run.stdout
