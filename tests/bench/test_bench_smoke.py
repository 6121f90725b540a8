"""Smoke runs of the benchmarks (`--quick`, seconds each): they run, write strict JSON
with the keys later runs are compared on, and render their tables. Figures are never
asserted: benchmarks are not tests (docs/bench/notes.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCHEDULER_SCENARIOS = {
    "sequential", "closed_c1", "closed_c8", "closed_c32", "closed_c8_turnaround2x",
    "closed_c32_turnaround2x", "closed_c8_immediate", "closed_c32_immediate",
    "closed_c128_immediate", "open_mixed_120", "burst_k8",
    "burst_k32", "open_25", "open_50", "open_75", "open_90",
}
SCHEDULER_METRICS = {
    "sequential": {"queue_p50_ms", "queue_p99_ms", "latency_p50_ms", "latency_p99_ms"},
    "closed": {"throughput_rps", "latency_p50_ms", "latency_p99_ms", "forwards_per_request"},
    "burst": {"forwards_per_burst", "burst_ms_p50"},
    "open": {"offered_rps", "latency_p50_ms", "latency_p99_ms"},
    "open_mixed": {"items_per_s", "padded_per_real", "wait_p50_ms", "wait_max_ms",
                   "over_local_bound"},
}


def bench(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True,
                          text=True, timeout=180, check=False)


def strict_json(path: Path) -> Any:
    """The file as JSON, refusing NaN and Infinity (which json.loads would accept)."""
    def refuse(name: str) -> None:
        raise ValueError(f"{path} holds {name}, which is not JSON")

    return json.loads(path.read_text(encoding="utf-8"), parse_constant=refuse)


def check_summary(summary: dict[str, Any], policies: set[str], metrics: set[str],
                  base: str = "default") -> None:
    assert set(summary) == policies
    for entry in summary.values():
        assert metrics <= set(entry["median"])
        assert metrics <= set(entry[f"ratio_to_{base}"])
        for value in entry[f"ratio_to_{base}"].values():
            assert set(value) == {"median", "min", "max", "n"}


def test_scheduler_quick_run_writes_json_plot_and_tables(tmp_path: Path) -> None:
    out, png = tmp_path / "scheduler.json", tmp_path / "plot.png"
    run = bench("scheduler.py", "--quick", "--out", str(out), "--plot", str(png))
    assert run.returncode == 0, run.stderr[-3000:]

    data = strict_json(out)
    assert {"meta", "settings", "capacity_rps", "results"} <= set(data)
    assert {"date", "command", "machine", "duration_s"} <= set(data["meta"])
    assert {"nproc", "free_m", "cpu"} <= set(data["meta"]["machine"])
    assert set(data["capacity_rps"]) == set(data["results"]) == {"gpu", "cpu"}
    for results in data["results"].values():
        mixed = {"open_mixed_120"} if results is data["results"]["gpu"] else set()
        assert set(results) == SCHEDULER_SCENARIOS - {"open_mixed_120"} | mixed
        for scenario in results.values():
            policies = {"default", "idle0", "nohold", "earlier"}
            if scenario["kind"] == "closed":
                policies.add("default-again")
            if scenario["kind"] == "open_mixed":
                # the earlier formation rule and the padding bound off, where lengths differ
                policies |= {"earlyform", "nopad", "fixed"}
            assert set(scenario["reps"]) == policies
            assert all(len(runs) == data["settings"]["reps"] for runs in scenario["reps"].values())
            check_summary(scenario["summary"], policies, SCHEDULER_METRICS[scenario["kind"]])

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| policy |" in run.stdout and "Trade summary" in run.stdout

    report = bench("scheduler.py", "--report", str(out))  # tables again, from the file
    assert report.returncode == 0, report.stderr[-3000:]
    assert report.stdout.strip() == run.stdout.strip()


def test_model_http_quick_run_against_a_real_server_writes_json_and_tables(
        tmp_path: Path) -> None:
    out = tmp_path / "http.json"
    run = bench("model_http.py", "--quick", "--policies", "default,idle0", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]

    data = strict_json(out)
    assert {"meta", "settings", "limit", "load", "summary", "ember_vs_limit"} <= set(data)
    limit = data["limit"][0]
    assert {"single_short_p50_ms", "single_short_p99_ms", "items_per_s",
            "best_items_per_s"} <= set(limit)
    assert set(limit["items_per_s"]) == {"short", "mixed_arrival", "mixed_sorted"}
    assert set(limit["items_per_s"]["short"]) == {"1", "8", "32"}

    policies = {"default", "idle0"}
    check_summary(data["summary"]["sequential"], policies,
                  {"latency_p50_ms", "latency_p99_ms", "queue_p50_ms", "queue_p99_ms"})
    assert set(data["summary"]["closed"]) == {"short_c8", "short_c32", "mixed_c8", "mixed_c32"}
    for case in data["summary"]["closed"].values():
        check_summary(case, policies, {"requests_per_s", "items_per_s", "latency_p50_ms",
                                       "latency_p99_ms"})
    assert {"sequential_latency_p50_over_limit_single", "short_c8",
            "mixed_c32"} <= set(data["ember_vs_limit"])
    assert "Closed loop over HTTP" in run.stdout


def test_cpu_limit_quick_run_alternates_limit_and_server_and_reports_ratios(
        tmp_path: Path) -> None:
    out = tmp_path / "cpu_limit.json"
    run = bench("cpu_limit.py", "--quick", "--variants", "default", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    data = strict_json(out)
    assert len(data["rounds"]) == 1
    limit, ember = data["rounds"][0]["limit"], data["rounds"][0]["ember"]["default"]
    assert {"graph", "single_p50_ms", "b8_items_per_s", "b32_items_per_s"} <= set(limit)
    assert limit["graph"].endswith("model.onnx")
    assert {"sequential", "c8", "c32", "c8_contended", "idle_cpu_cores"} <= set(ember)
    gaps = ember["c8"]["idle_gap_ms_per_s"]
    assert set(gaps) == {"hold", "formation", "wakeup"}  # scraped from /metrics
    ratios = data["summary"]["default"]["ratios"]
    assert set(ratios) == {"sequential_p50_over_single", "c8_over_b8", "c32_over_b32"}
    assert "8 in flight / batch-8 limit" in run.stdout


def test_cpu_limit_committed_summary_follows_from_its_rounds() -> None:
    spec = importlib.util.spec_from_file_location("ember_bench_cpu_limit",
                                                  ROOT / "bench" / "cpu_limit.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    if str(ROOT / "bench") not in sys.path:  # it imports benchlib and loadgen as siblings
        sys.path.append(str(ROOT / "bench"))
    spec.loader.exec_module(module)
    data = strict_json(ROOT / "docs" / "bench" / "cpu_limit.json")
    assert json.loads(json.dumps(module.summarize(data))) == data["summary"]


FRONTEND_METRICS = {"requests_per_s", "items_per_s", "latency_p50_ms", "latency_p99_ms",
                    "p99_over_p50", "server_cpu_ms_per_request", "server_cpu_cores",
                    "client_cpu_cores", "items_over_capacity", "items_over_capacity_at_level",
                    "items_per_forward"}


def test_frontend_quick_run_writes_json_and_tables(tmp_path: Path) -> None:
    out = tmp_path / "frontend.json"
    run = bench("frontend.py", "--quick", "--levels", "8", "--texts-per-request", "1,16",
                "--variant", "again=--log-level warning", "--closed-s", "0.5", "--out",
                str(out))
    assert run.returncode == 0, run.stderr[-3000:]

    data = strict_json(out)
    assert {"meta", "settings", "load", "summary", "targets", "server_exit_codes"} <= set(data)
    assert {"date", "command", "machine", "duration_s", "loadavg_at_end"} <= set(data["meta"])
    assert len(data["load"]["loadavg_per_rep"]) == data["settings"]["reps"] == 1
    assert list(data["settings"]["variants"]) == ["single", "again"]
    assert data["server_exit_codes"] == {"single": 0, "again": 0}  # SIGTERM drains, exits 0
    device = data["settings"]["device_model"]
    assert device["max_batch_items"] > 0 and device["overhead_ms"] > 0

    check_summary(data["summary"]["sequential"], {"single", "again"},
                  {"latency_p50_ms", "latency_p99_ms"}, base="single")
    assert set(data["summary"]["closed"]) == {"t1_c8", "t16_c8"}
    for name, case in data["load"]["closed"].items():
        texts = case["texts_per_request"]
        for runs in case["reps"].values():
            (result,) = runs
            assert set(result) >= FRONTEND_METRICS
            assert result["requests"] > 0
            assert result["items_per_s"] == pytest.approx(result["requests_per_s"] * texts)
            assert 0 < result["items_over_capacity"] <= result["items_over_capacity_at_level"]
            assert result["latency_p99_ms"] >= result["latency_p50_ms"] > 0
            assert 1 <= result["items_per_forward"] <= device["max_batch_items"]
            assert result["server_cpu_ms_per_request"] > 0
            # The server's process tree: each process labelled by its command line.
            assert result["processes"] == len(result["per_process"]) >= 1
            assert any("ember.cli serve" in label for label in result["per_process"])
            total = sum(p["cpu_s"] for p in result["per_process"].values())
            assert result["server_cpu_cores"] == pytest.approx(
                total / data["settings"]["plan"]["closed_s"])
        check_summary({k: v for k, v in data["summary"]["closed"][name].items()
                       if k != "per_process"}, {"single", "again"}, FRONTEND_METRICS,
                      base="single")
    assert {"single", "again"} <= set(data["targets"])
    assert "Closed loop" in run.stdout and "| texts/req |" in run.stdout

    report = bench("frontend.py", "--report", str(out))  # tables again, from the file
    assert report.returncode == 0, report.stderr[-3000:]
    assert report.stdout.strip() == run.stdout.strip()


def test_tokenizing_quick_run_in_process_writes_json_and_tables(tmp_path: Path) -> None:
    out = tmp_path / "tokenize.json"
    run = bench("tokenizing.py", "--quick", "--no-http", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]

    data = strict_json(out)
    assert {"meta", "in_process"} <= set(data) and "http" not in data
    (rep,) = data["in_process"]["reps"]
    assert all(value > 0 for value in rep.values())
    assert set(data["in_process"]["ratios"]) == {"short_new_over_old", "mb_new_over_old",
                                                 "mb_pool_over_old"}
    assert "| one short text |" in run.stdout

    report = bench("tokenizing.py", "--report", str(out))
    assert report.returncode == 0, report.stderr[-3000:]
    assert report.stdout.strip() == run.stdout.strip()


def test_abandoned_memory_quick_run_reads_every_process_of_both_modes(tmp_path: Path) -> None:
    for workers in ("0", "2"):
        out = tmp_path / f"memory-{workers}.json"
        run = bench("abandoned_memory.py", "--quick", "--model", "ember/synthetic",
                    "--workers", workers, "--out", str(out))
        assert run.returncode == 0, run.stderr[-3000:]
        (result,) = strict_json(out)["result"]["runs"]
        roles = {"server"} if workers == "0" else {"supervisor", "engine", "api 0", "api 1"}
        assert set(result["rss_mb"]) == roles
        assert all(len(series) == 3 and all(v > 0 for v in series)
                   for series in result["rss_mb"].values())
        assert result["abandoned"] + result["answered"] + result["refused"] == 8
        assert result["abandoned"] > 0
        report = bench("abandoned_memory.py", "--report", str(out))
        assert report.returncode == 0 and report.stdout.strip() == run.stdout.strip()


def test_m3_outputs_quick_run_times_both_variants_of_each_batch(tmp_path: Path) -> None:
    out = tmp_path / "m3.json"
    run = bench("m3_outputs.py", "--quick", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    result = strict_json(out)["result"]
    assert set(result) == {"1 short", "8 medium"}
    for batch in result.values():
        assert len(batch["times_ms"]["dense"]) == len(batch["times_ms"]["all"]) == 2
        assert batch["dense_ms"] > 0 and batch["all_over_dense"]["n"] == 2
    report = bench("m3_outputs.py", "--report", str(out))
    assert report.returncode == 0 and report.stdout.strip() == run.stdout.strip()


def test_token_rows_quick_run_writes_json_and_its_table(tmp_path: Path) -> None:
    out = tmp_path / "token_rows.json"
    run = bench("token_rows.py", "--quick", "--landed-src", str(ROOT / "src"), "--out",
                str(out))
    assert run.returncode == 0, run.stderr[-3000:]

    result = strict_json(out)["result"]
    (rep,) = result["reps"]
    assert set(rep) == {"landed", "this"}
    assert all(value > 0 for tree in rep.values() for value in tree.values())
    assert set(result["this_over_landed"]) == set(rep["this"])
    assert "| pad_engine_us |" in run.stdout

    report = bench("token_rows.py", "--report", str(out))
    assert report.returncode == 0, report.stderr[-3000:]
    assert report.stdout.strip() == run.stdout.strip()


def test_engine_quick_run_writes_json_and_its_table(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    run = bench("engine.py", "--quick", "--requests", "32", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    data = strict_json(out)
    assert data["queued_items"] == 32 * 16 and set(data["placements"]) == {"one", "split"}
    for placement in data["placements"].values():
        assert len(placement["ms_per_forward"]) == 1 and placement["ms_per_forward"][0] > 0
    assert "engine ms / 64-item forward" in run.stdout
    report = bench("engine.py", "--report", str(out))
    assert report.returncode == 0 and report.stdout == run.stdout


def test_engine_single_run_pins_the_forward_thread_where_its_placement_says(
        tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    for placement in ("one", "split"):
        run = bench("engine.py", "--quick", "--single", "--placement", placement,
                    "--requests", "32", "--out", str(out))
        assert run.returncode == 0, run.stderr[-3000:]
        data = strict_json(out)
        assert data["queued_items"] == 32 * 16 and len(data["runs"]) == 3
        assert data["median"]["forwards"] >= 32 * 16 / 64  # forwards of at most 64 items
        if len(os.sched_getaffinity(0)) < 2:
            assert data["placement"] == "free"
            continue
        assert data["placement"] == placement and len(data["loop_cpus"]) == 1
        assert data["forward_thread_cpus"] == data["thread_cpus"]  # read back from the OS
        apart = data["forward_thread_cpus"] != data["loop_cpus"]
        assert apart == (placement == "split")


def test_the_plots_are_drawn_from_the_json_beside_the_page(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("plots", ROOT / "bench" / "plots.py")
    assert spec is not None and spec.loader is not None
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        plots = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(plots)
        docs = ROOT / "docs" / "bench"
        plots.headline(strict_json(docs / "http.json"), tmp_path / "headline.png")
        runs = plots.cpu_limit_runs(docs)
        plots.cpu_limit(runs, tmp_path / "cpu_limit.png")
        plots.idle_rule(strict_json(docs / "scheduler.json"), tmp_path / "idle.png")
        plots.frontend(strict_json(docs / "frontend.json"),
                       strict_json(docs / "request_path.json"), tmp_path / "frontend.png")
        plots.peers(strict_json(docs / "peers.json"), tmp_path / "peers.png")
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert len(runs) == 16 and {host for host, _ in runs} == {"Xeon", "EPYC"}
    for name in ("headline.png", "cpu_limit.png", "idle.png", "frontend.png", "peers.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_selftune_quick_run_writes_json_and_its_table(tmp_path: Path) -> None:
    out = tmp_path / "selftune.json"
    run = bench("selftune.py", "--quick", "--devices", "fast", "--cells", "closed_c8,mixed",
                "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    data = strict_json(out)
    cells = data["devices"]["fast"]["cells"]
    assert set(cells) == {"closed_c8", "mixed_c32"}
    for cell in cells.values():
        assert len(cell["runs"]) == 16  # the default and 15 grid points
        verdict = cell["verdict"]
        assert verdict["best"] in cell["runs"] and verdict["best"] != "auto"
        assert {"throughput_ratio", "p50_ratio", "met", "windows"} <= set(verdict)
        # The cell is judged on fresh runs of the default and the point the grid chose.
        confirm = cell["confirm"]
        assert set(confirm["runs"]) == {"auto", verdict["best"]}
        assert all(len(runs) == 1 for runs in confirm["runs"].values())
        assert confirm["verdict"]["best"] == verdict["best"]
        assert confirm["verdict"]["throughput_ratio"] > 0
    assert data["devices"]["fast"]["sequential"]["queue_p50_ms"] >= 0
    assert "default / best throughput" in run.stdout and "confirmed: p50" in run.stdout
    report = bench("selftune.py", "--report", str(out))
    assert report.returncode == 0 and report.stdout == run.stdout


def test_overload_sim_quick_run_writes_json_and_its_tables(tmp_path: Path) -> None:
    out = tmp_path / "overload_sim.json"
    run = bench("overload_sim.py", "--reps", "2", "--scales", "1,1.1", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    data = strict_json(out)
    assert set(data["results"]) == {"1", "1.1"}
    for by_rule in data["results"].values():
        assert set(by_rule) == {"worker", "queue_first", "queue_first_no_cheaper",
                                "worker_aging"}
        for summary in by_rule.values():
            assert summary["runs"] == 2 and 0 <= summary["over_bound"] <= 2
            assert 0 < summary["wait_p50_ms_median"] <= summary["wait_max_ms_median"]
    # Each repetition of the recorded run, beside the model's run of the same arrivals.
    recorded = strict_json(ROOT / "docs" / "bench" / "overload_engine.json")
    reps = recorded["results"]["gpu"]["open_mixed_120"]["reps"]["default"]
    assert [pair["rep"] for pair in data["against_recorded"]] == list(range(len(reps)))
    assert [pair["measured"] for pair in data["against_recorded"]] == [
        r["wait_max_over_bound"] for r in reps]
    assert "| 1.1x | worker |" in run.stdout and "| repetition | measured |" in run.stdout


def test_onnx_pooling_quick_run_times_both_paths_and_both_blas_settings(
        tmp_path: Path) -> None:
    out = tmp_path / "onnx_pooling.json"
    run = bench("onnx_pooling.py", "--quick", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    data = strict_json(out)
    assert set(data["pooling"]) == {f"{family} {batch}" for family in ("sparse", "colbert")
                                    for batch in ("1 short", "16 short", "16 long")}
    for entry in data["pooling"].values():
        assert set(entry["ms"]) == {"torch", "numpy"} and all(
            len(times) == 1 and times[0] > 0 for times in entry["ms"].values())
        assert set(entry["numpy_over_torch"]) == {"median", "min", "max", "n"}
    assert set(data["blas"]["maxsim then one-text forward"]["ms"]) == {"started", "one"}
    assert "| sparse 16 long |" in run.stdout and "| one / a core |" in run.stdout


def test_bulk_queries_quick_run_interleaves_both_variants_and_reports_ratios(
        tmp_path: Path) -> None:
    out = tmp_path / "bulk_queries.json"
    run = bench("bulk_queries.py", "--quick", "--seconds", "1", "--costs", "gpu", "--out",
                str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    data = strict_json(out)
    result = data["results"]["gpu"]
    assert set(result["runs"]) == {"default", "lead_ratio=0"}
    check_summary(result["summary"], {"default", "lead_ratio=0"},
                  {"query_wait_p50_ms", "query_wait_p99_ms", "documents_per_s",
                   "bulk_latency_p50_ms", "device_idle_share"})
    for runs in result["runs"].values():
        assert runs[0]["queries"] > 0 and runs[0]["documents_per_s"] > 0
    assert data["variants"]["lead_ratio=0"]["lead_ratio"] == 0
    assert "| lead_ratio=0 |" in run.stdout
