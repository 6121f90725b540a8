"""bench/peers.py's pure parts: peer command templates, embeddings responses and the
summary, on fixed inputs (no server is started, nothing leaves the process)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.bench.test_bench_parts import bench_module

peers = bench_module("peers")


def test_a_template_is_split_before_filling_so_a_folder_with_spaces_stays_one_word() -> None:
    words = peers.fill_command("/p/bin/serve --model-id {model} --host {host} --port {port}",
                               "/m/my model", 4123)
    assert words == ["/p/bin/serve", "--model-id", "/m/my model", "--host", "127.0.0.1",
                     "--port", "4123"]


def test_quoted_words_stay_whole_and_a_value_inside_a_word_is_filled() -> None:
    words = peers.fill_command("sh -c 'exec serve --port={port}' --name=\"a b\"", "/m", 9)
    assert words == ["sh", "-c", "exec serve --port=9", "--name=a b"]


@pytest.mark.parametrize("template", ["serve --x {other}", "serve {0}", "serve {model", ""])
def test_unknown_placeholders_and_empty_commands_are_refused(template: str) -> None:
    with pytest.raises(ValueError):
        peers.fill_command(template, "/m", 1)


def test_peer_arguments_pair_routes_and_readiness_with_their_peer() -> None:
    specs = peers.peer_specs(["inf=/bin/a --port {port}", "sie=/bin/b x=y"],
                             routes=["inf=/embeddings"], readies=["inf=/health"])
    assert [(s.name, s.command, s.route, s.ready) for s in specs] == [
        ("inf", "/bin/a --port {port}", "/embeddings", "/health"),
        ("sie", "/bin/b x=y", peers.DEFAULT_ROUTE, peers.DEFAULT_READY)]


@pytest.mark.parametrize(("peer_args", "routes"), [
    (["no-equals-sign"], []),
    (["a=/bin/x", "a=/bin/y"], []),  # named twice
    (["ember=/bin/x"], []),  # Ember's own name
    (["a b=/bin/x"], []),
    (["a=/bin/x"], ["b=/v1/embeddings"]),  # a route for no peer
    (["a=/bin/x"], ["a=v1/embeddings"]),  # not a path
])
def test_malformed_peer_arguments_are_refused(peer_args: list[str], routes: list[str]) -> None:
    with pytest.raises(ValueError):
        peers.peer_specs(peer_args, routes=routes)


def test_openai_vectors_come_back_in_index_order_and_sie_vectors_in_item_order() -> None:
    openai = {"data": [{"index": 1, "embedding": [0, 1]}, {"index": 0, "embedding": [1, 0]}]}
    assert peers.parse_embeddings(json.dumps(openai).encode()) == [[1.0, 0.0], [0.0, 1.0]]
    sie = {"items": [{"dense": {"dims": 2, "values": [0.5, 0.5]}},
                     {"dense": {"dims": 2, "values": [1, 2]}}]}
    assert peers.parse_embeddings(sie) == [[0.5, 0.5], [1.0, 2.0]]


@pytest.mark.parametrize("payload", [
    b"[1, 2]", b'{"error": "x"}', b'{"data": [{"embedding": "abc"}]}',
    b'{"data": [{"embedding": []}]}', b'{"data": [{"embedding": [true, 1]}]}',
    b'{"items": [{"dense": {"values": [null]}}]}', b"not json",
])
def test_responses_that_are_not_embeddings_are_refused(payload: bytes) -> None:
    with pytest.raises((ValueError, KeyError, TypeError)):
        peers.parse_embeddings(payload)


def test_agreement_reports_the_worst_text_and_refuses_mismatched_shapes() -> None:
    reference = [[1.0, 0.0], [0.0, 1.0]]
    other = [[2.0, 0.0], [1.0, 1.0]]  # same direction; 45 degrees off
    result = peers.agreement(reference, other)
    assert result["dims"] == 2 and result["texts"] == 2
    assert result["min_cosine"] == pytest.approx(math.sqrt(0.5))
    assert result["mean_cosine"] == pytest.approx((1 + math.sqrt(0.5)) / 2)
    with pytest.raises(ValueError):
        peers.agreement(reference, other[:1])
    with pytest.raises(ValueError):
        peers.cosine([1.0, 0.0], [1.0, 0.0, 0.0])


def test_a_server_whose_vectors_differ_or_are_not_numbers_is_refused() -> None:
    reference = [[1.0, 0.0], [0.0, 1.0]]
    same = peers.agreement(reference, [[3.0, 0.0], [0.0, 0.5]])
    rotated = peers.agreement(reference, [[1.0, 0.0], [0.2, 1.0]])  # cosine 0.98
    not_numbers = peers.agreement(reference, peers.parse_embeddings(
        b'{"data": [{"embedding": [NaN, 0]}, {"embedding": [0, 1]}]}'))
    assert peers.disagreeing({"ember": same, "a": same, "b": rotated, "c": not_numbers}
                             ).keys() == {"b", "c"}


def run(items_per_s: float, p50: float, cpu: float = 1.0) -> dict[str, Any]:
    return {"requests": 10, "requests_per_s": items_per_s, "items_per_s": items_per_s,
            "latency_p50_ms": p50, "latency_p99_ms": 2 * p50, "server_cpu_cores": cpu,
            "idle_servers_cpu_cores": 0.01}


def test_the_summary_gives_ember_over_each_peer_repetition_by_repetition() -> None:
    reps = {"ember": [run(400, 10), run(300, 12)], "inf": [run(200, 20), run(300, 24)]}
    summary = peers.summarize_case(reps)
    ratio = summary["inf"]["ember_over_this"]["items_per_s"]
    assert (ratio["median"], ratio["min"], ratio["max"]) == (1.5, 1.0, 2.0)
    latency = summary["inf"]["ember_over_this"]["latency_p50_ms"]
    assert (latency["min"], latency["max"]) == (0.5, 0.5)
    assert summary["ember"]["ember_over_this"]["items_per_s"]["median"] == 1.0
    assert summary["inf"]["median"]["items_per_s"] == 250
    # 1 core at 250 items/s (the median of 200 and 300 items/s): 4-5 ms of CPU an item.
    assert summary["inf"]["cpu_ms_per_item"] == pytest.approx((5.0 + 1000 / 300) / 2)


def test_the_report_renders_every_server_and_case_from_a_result() -> None:
    reps = {"ember": [run(400, 10)], "inf": [run(200, 20)]}
    load = {"agreement": {"ember": {"min_cosine": 1.0}, "inf": {"min_cosine": 0.99991}},
            "cases": {"c8": {"case": {}, "reps": reps}}}
    data = {"settings": {"reps": 1}, "servers": {"ember": {}, "inf": {}}, "load": load,
            "summary": peers.summarize(load),
            "limit": [{"best_items_per_s": {"short": 450.0}},
                      {"best_items_per_s": {"short": 380.0}}],
            "limit_torch": [{"best_items_per_s": {"short": 210.0}}]}
    text = peers.markdown(data)
    assert "| 8 in flight | inf | 200 |" in text
    assert "2.00 (2.00-2.00)" in text
    assert "with ONNX Runtime, Ember's default (tokenize + forward" in text
    assert "no HTTP): 380-450 items/s over 2 measures" in text
    assert "with torch (tokenize + forward, best batch, no HTTP): 210-210 items/s" in text
    assert "inf min 0.99991" in text


def test_the_published_result_renders_with_every_server_and_load() -> None:
    published = Path(__file__).resolve().parents[2] / "docs" / "bench" / "peers.json"
    data = json.loads(published.read_text(encoding="utf-8"))
    text = peers.markdown(data)
    for name in data["servers"]:
        for case in data["summary"]:
            assert f"| {peers.CASE_LABELS[case]} | {name} |" in text
    assert all(a["min_cosine"] >= peers.MIN_COSINE for a in data["load"]["agreement"].values())
