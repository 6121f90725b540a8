#!/usr/bin/env python
"""The plots of docs/benchmarks.md, drawn from the JSON beside it (no benchmark runs here).

    python bench/plots.py   # writes docs/bench/{headline,cpu_limit,frontend,idle_rule,peers}.png
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from benchlib import Json, read_json

DOCS = Path(__file__).resolve().parent.parent / "docs" / "bench"


def headline(http: Json, out: Path) -> None:
    """Ember over HTTP against the model's own limit (all-MiniLM-L6-v2, CPU)."""
    cases = [("short", "short_c8", "8 in flight\nshort texts"),
             ("short", "short_c32", "32 in flight\nshort texts"),
             ("mixed_sorted", "mixed_c8", "8 in flight\nmixed lengths"),
             ("mixed_sorted", "mixed_c32", "32 in flight\nmixed lengths")]
    limits = [[run["best_items_per_s"][kind] for run in http["limit"]] for kind, _, _ in cases]
    ember = [http["summary"]["closed"][case]["default"]["median"]["items_per_s"]
             for _, case, _ in cases]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    xs = range(len(cases))
    low = [min(v) for v in limits]
    high = [max(v) for v in limits]
    mid = [(a + b) / 2 for a, b in zip(low, high, strict=True)]
    ax.bar([x - 0.2 for x in xs], mid, 0.4, label="the model alone, best batch (two runs)",
           yerr=[[m - a for m, a in zip(mid, low, strict=True)],
                 [b - m for m, b in zip(mid, high, strict=True)]], color="#bbbbbb", capsize=4)
    ax.bar([x + 0.2 for x in xs], ember, 0.4, label="Ember over HTTP", color="#d9534f")
    ax.set_xticks(list(xs), [label for _, _, label in cases])
    ax.set_ylabel("items/s")
    ax.set_title("all-MiniLM-L6-v2 on 2 CPU cores: Ember against its model's limit")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


# Every recorded run of bench/cpu_limit.py: (label of its sitting, the files that hold it).
CPU_LIMIT_SITTINGS = (("Xeon", ("cpu_limit.json", "cpu_limit_other_run.json")),
                      ("EPYC", ("cpu_limit_epyc.json", "cpu_limit_series.json",
                                "cpu_limit_series2.json", "cpu_limit_series3.json")))
CPU_LIMIT_TARGETS = (("sequential_p50_over_single", "one text at a time:\nlatency / limit's",
                      1.5), ("c8_over_b8", "8 in flight:\nreq/s / batch-8 limit", 0.8),
                     ("c32_over_b32", "32 in flight:\nreq/s / batch-32 limit", 0.85))


def cpu_limit_runs(docs: Path) -> list[tuple[str, Json]]:
    """Each recorded run's summary with its host; a series file holds several runs."""
    runs: list[tuple[str, Json]] = []
    for host, files in CPU_LIMIT_SITTINGS:
        for name in files:
            data = read_json(docs / name)
            runs += [(host, run["summary"]["default"]) for run in data.get("runs", [data])]
    return runs


def cpu_limit(runs: Sequence[tuple[str, Json]], out: Path) -> None:
    """Ember over HTTP against its graph's own limit, every recorded run: each dot a run's
    median of two rounds, whiskers the two rounds, dashed the target."""
    colors = {"Xeon": "#5b8bd9", "EPYC": "#d9534f"}
    fig, axes = plt.subplots(1, len(CPU_LIMIT_TARGETS), figsize=(10, 3.4))
    for ax, (key, title, target) in zip(axes, CPU_LIMIT_TARGETS, strict=True):
        for i, (host, summary) in enumerate(runs):
            ratio = summary["ratios"][key]
            ax.errorbar([i], [ratio["median"]], yerr=[[ratio["median"] - ratio["min"]],
                                                      [ratio["max"] - ratio["median"]]],
                        fmt="o", color=colors[host], capsize=2,
                        label=host if i == 0 or runs[i - 1][0] != host else None)
        ax.axhline(target, color="#333333", linestyle="--", linewidth=1, label="target")
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(len(runs)), [str(i + 1) for i in range(len(runs))], fontsize=7)
        ax.set_xlabel("run, in order", fontsize=8)
    axes[0].legend(fontsize=7)
    fig.suptitle("all-MiniLM-L6-v2 on 2 CPU cores: Ember over HTTP against its model alone",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def frontend(data: Json, extra: Json | None, out: Path) -> None:
    """Requests/s against requests in flight, one text a request, synthetic GPU-like model."""
    closed = data["summary"]["closed"]
    labels = {"single": "one process", "w2": "--workers 2", "granian": "granian, one process",
              "landed": "--workers 2, before batched messages"}
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for variant in ("single", "w2"):
        levels = sorted(int(k.split("_c")[1]) for k in closed if k.startswith("t1_"))
        rates = [closed[f"t1_c{n}"][variant]["median"]["requests_per_s"] for n in levels]
        ax.plot(levels, rates, marker="o", label=f"{labels[variant]} (earlier round)")
    if extra is not None:
        later = extra["summary"]["closed"]
        for variant, style in (("single", "s"), ("w2", "D"), ("granian", "^"), ("landed", "x")):
            levels = sorted(int(k.split("_c")[1]) for k in later if variant in later[k])
            if levels:
                ax.scatter(levels, [later[f"t1_c{n}"][variant]["median"]["requests_per_s"]
                                    for n in levels], marker=style,
                           label=f"{labels[variant]} (this round)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests in flight (one text each)")
    ax.set_ylabel("requests/s")
    ax.set_title("The front end's ceiling on 2 cores (synthetic GPU-like model)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def idle_rule(scheduler: Json, out: Path) -> None:
    """Sequential latency p50: the earlier idle rule (a lone request waits the window)
    against the default (it goes at once)."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = {"gpu": "GPU-like model\n(2 ms forward)", "cpu": "CPU-like model\n(~MiniLM, 13 ms)"}
    for i, cost in enumerate(("gpu", "cpu")):
        summary = scheduler["results"][cost]["sequential"]["summary"]
        before = summary["earlier"]["median"]["latency_p50_ms"]
        after = summary["default"]["median"]["latency_p50_ms"]
        ax.bar(i - 0.2, before, 0.4, color="#bbbbbb", label="before" if i == 0 else None)
        ax.bar(i + 0.2, after, 0.4, color="#d9534f", label="after" if i == 0 else None)
    ax.set_xticks([0, 1], [names["gpu"], names["cpu"]])
    ax.set_ylabel("latency p50, ms (one request at a time)")
    ax.set_title("The idle rule: a lone request no longer waits 3 ms")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def peers(data: Json, out: Path) -> None:
    """Ember beside peer servers (same model, same texts, interleaved): items/s and client
    latency p50 by load, each bar the median of the repetitions, whiskers their min-max;
    the bands are the model alone (best batch, no HTTP; ONNX and torch) before and after
    the load."""
    cases = [("sequential", "1 at a time"), ("c8", "8 in flight"), ("c32", "32 in flight"),
             ("batch32_c4", "32 texts a request,\n4 in flight")]
    names = list(data["servers"])
    colors = ["#d9534f", "#5b8bd9", "#5cb85c", "#f0ad4e", "#8e6cc0", "#777777"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [c + (i - (len(names) - 1) / 2) * width for c in range(len(cases))]
        for ax, metric in ((left, "items_per_s"), (right, "latency_p50_ms")):
            runs = [[r[metric] for r in data["load"]["cases"][case]["reps"][name]]
                    for case, _ in cases]
            mid = [data["summary"][case][name]["median"][metric] for case, _ in cases]
            ax.bar(xs, mid, width, label=name, color=colors[i % len(colors)],
                   yerr=[[m - min(r) for m, r in zip(mid, runs, strict=True)],
                         [max(r) - m for m, r in zip(mid, runs, strict=True)]], capsize=2, zorder=2)
    for key, color, label in (("limit", "#bbbbbb", "the model alone, ONNX (Ember's backend)"),
                              ("limit_torch", "#d8c8ea", "the model alone, torch")):
        limits = [phase["best_items_per_s"]["short"] for phase in data.get(key, [])]
        if limits:
            left.axhspan(min(limits), max(limits), color=color, alpha=0.6, label=label,
                         zorder=0)
    for ax, label in ((left, "items/s (higher is better)"),
                      (right, "latency p50 at the client, ms (lower is better)")):
        ax.set_xticks(range(len(cases)), [text for _, text in cases], fontsize=8)
        ax.set_ylabel(label, fontsize=9)
    right.set_yscale("log")
    handles, labels = left.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle("all-MiniLM-L6-v2 on 2 CPU cores, short texts: Ember beside peer servers",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(out, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    headline(read_json(DOCS / "http.json"), DOCS / "headline.png")
    cpu_limit(cpu_limit_runs(DOCS), DOCS / "cpu_limit.png")
    extra = DOCS / "request_path.json"
    frontend(read_json(DOCS / "frontend.json"), read_json(extra) if extra.exists() else None,
             DOCS / "frontend.png")
    idle_rule(read_json(DOCS / "scheduler.json"), DOCS / "idle_rule.png")
    if (DOCS / "peers.json").exists():
        peers(read_json(DOCS / "peers.json"), DOCS / "peers.png")
    print(f"[plots] wrote {DOCS}/headline.png, cpu_limit.png, frontend.png, idle_rule.png, "
          "peers.png",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
