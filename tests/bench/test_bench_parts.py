"""The benchmarks' own parsing and bookkeeping, on fixed inputs (no servers)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_module(name: str) -> ModuleType:
    """A bench script loaded as a module (bench/ is a folder of scripts, not a package)."""
    if name in sys.modules:
        return sys.modules[name]
    if str(BENCH) not in sys.path:  # the scripts import benchlib and loadgen as siblings
        sys.path.append(str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_profile_frames_are_grouped_by_function_and_module_without_trunks() -> None:
    profile = bench_module("profile_server")
    raw = [
        "main (/v/lib/python3.11/runpy.py:88);serve (/w/src/ember/cli.py:10);"
        "send (/v/lib/python3.11/site-packages/uvicorn/impl.py:5) 6",
        "main (/v/lib/python3.11/runpy.py:88);serve (/w/src/ember/cli.py:10);"
        "send (/v/lib/python3.11/site-packages/uvicorn/impl.py:7) 2",
        "main (/v/lib/python3.11/runpy.py:88);serve (/w/src/ember/cli.py:10);"
        "dumps (/w/src/ember/api/codec.py:3) 2",
        "_worker (/v/lib/python3.11/concurrent/futures/thread.py:1);"
        "_spend (/w/src/ember/adapters/synthetic.py:4) 5",
    ]
    result = profile.parse_raw(raw)
    assert result.samples == 15
    assert result.self_counts == {"send (uvicorn/impl.py)": 8, "dumps (ember/api/codec.py)": 2,
                                  "_spend (ember/adapters/synthetic.py)": 5}
    # main and serve are in every sample of their thread: left out of the inclusive table.
    assert "serve (ember/cli.py)" not in result.inclusive_counts
    assert result.inclusive_counts["send (uvicorn/impl.py)"] == 8


def test_tree_cpu_delta_counts_new_processes_from_zero_and_numbers_repeated_labels() -> None:
    loadgen = bench_module("loadgen")
    before = {10: ("python -m ember.cli serve", 1.0), 11: ("python worker", 0.5)}
    after = {10: ("python -m ember.cli serve", 1.5), 11: ("python worker", 0.75),
             12: ("python worker", 0.25)}
    assert loadgen.tree_cpu_delta(before, after) == {
        "python -m ember.cli serve": 0.5, "python worker": 0.25, "python worker #2": 0.25}


def test_process_labels_drop_the_interpreter_folder_and_the_address() -> None:
    loadgen = bench_module("loadgen")
    label = loadgen.process_label(["/x/.venv/bin/python", "-m", "ember.cli", "serve", "--host",
                                   "127.0.0.1", "--port", "4000", "--workers", "2"])
    assert label == "python -m ember.cli serve --workers 2"


def test_the_modelled_device_fills_batches_up_to_the_limits() -> None:
    frontend = bench_module("frontend")
    device = frontend.Device(overhead_ms=2.0, per_token_us=0.5, max_batch_items=64,
                             max_batch_tokens=16384, item_tokens=10)
    assert device.forward_ms(64) == 2.32
    assert device.items_per_s() == 64 / 2.32 * 1000
    assert device.items_per_s(8) == 8 / device.forward_ms(8) * 1000
    tight = frontend.Device(2.0, 0.5, 64, 100, 10)  # the token budget caps a batch at 10
    assert tight.full_batch == 10


def test_the_overload_model_lets_an_arrival_join_the_next_batch_only_as_the_worker_does() -> None:
    """A (long) runs; B (short) forms the next batch; C (long) does not fit it and queues;
    D (short) fits it. The worker's rule takes D along with B, ahead of the older C; the
    queue-first rule keeps D behind C. Every arrival goes to the device once."""
    sim = bench_module("overload_sim")
    times = np.array([0.0, 0.0005, 0.0010, 0.0015])
    costs = [100, 10, 100, 10]
    first_forward = (2.0 + 5.0 * 100 / 1000) / 1000  # the synthetic device's cost for A

    worker = sim.simulate(times, costs, sim.VARIANTS["worker"]).handed_at
    assert worker[0] == 0.0
    assert worker[1] == worker[3] == first_forward  # D joined B's batch
    assert worker[2] > worker[3]  # and went ahead of C

    queue_first = sim.simulate(times, costs, sim.VARIANTS["queue_first"]).handed_at
    assert queue_first[1] == first_forward
    assert queue_first[1] < queue_first[2] < queue_first[3]  # in line behind C
    assert not np.isnan(queue_first).any() and not np.isnan(worker).any()


def test_the_aging_guard_detours_to_an_item_older_than_twice_the_recent_median() -> None:
    """A (cost 10) went first, so the sweep stands above cost 10; X (cost 10) then waits
    behind B (cost 50). Once X has waited 2 x the recent median + 40 ms - 10 ms, the next
    batch is X's, and the sweep's cursor is where it was."""
    sim = bench_module("overload_sim")
    config = bench_module("scheduler").WorkerConfig()

    def next_batch(now: float, recent_waits: int) -> list[int]:
        former = sim.AgingFormer.for_config(config)
        former.add_request([pending(0, 10, 0.0)])
        assert [p.seq for p in former.form().items] == [0]  # A
        former.add_request([pending(1, 10, 0.001)])  # X
        former.add_request([pending(2, 50, 0.002)])  # B
        former.observe(now, [0.001] * recent_waits)  # a recent median of 1 ms
        first = [p.seq for p in former.form().items]
        return first + [p.seq for p in former.form().items]

    assert next_batch(0.5, 31) == [2, 1]  # fewer than 32 waits seen: no guard yet
    assert next_batch(0.032, 32) == [2, 1]  # X has waited 31 ms: the sweep's B first
    assert next_batch(0.034, 32) == [1, 2]  # 33 ms: X first, then the sweep goes on


def test_the_local_bound_reads_each_wait_against_its_own_neighbours() -> None:
    """A swell (waits rising from 10 to 100 ms and back over a second, among waits of
    10 ms) breaches the run-wide bound, 2 x a median of 10 ms + 40 ms, but not the bound
    against each wait's neighbours; one 200 ms wait among 10 ms ones breaches both."""
    scheduler = bench_module("scheduler")
    config = scheduler.WorkerConfig()
    handed = np.arange(3000) / 1000  # one item a millisecond for 3 s
    waits = 10 + 90 * np.clip(1 - np.abs(handed - 1.5) / 0.5, 0, 1)
    figures = scheduler.wait_figures(waits.tolist(), config, handed.tolist())
    assert figures["wait_max_over_bound"] == pytest.approx(100 / (2 * 10 + 40))
    assert figures["over_local_bound"] < 0.5
    waits[2500] = 200.0
    assert scheduler.over_local_bound(handed, waits, config) == pytest.approx(200 / 60)
    assert "over_local_bound" not in scheduler.wait_figures(waits.tolist(), config)


def pending(seq: int, cost: int, arrival: float) -> object:
    sim = bench_module("overload_sim")
    return sim.PendingItem(sim.PreparedItem("", cost, 0), sim.Owner(), "", arrival, seq)


def test_the_overload_model_replays_the_benchmarks_own_arrivals() -> None:
    sim, scheduler = bench_module("overload_sim"), bench_module("scheduler")
    times, costs = sim.arrivals(0, 2000.0)
    duration = scheduler.MIXED_SPAN * scheduler.PLANS["gpu"].open_s
    assert times[0] > 0 and np.all(np.diff(times) > 0) and times[-1] < duration
    assert len(costs) == len(times) and min(costs) >= 5 and max(costs) <= 120
    again, _ = sim.arrivals(0, 2000.0)
    assert np.array_equal(times, again) and not np.array_equal(times, sim.arrivals(1, 2000.0)[0])
