"""Metrics: many observations written at once read the same as one at a time."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ember.engine import WorkerConfig
from ember.engine.policy import DispatchPolicy
from ember.metrics import dispatch_metrics, observe_all

BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 1.0)


def exposition(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    text = generate_latest(registry).decode()
    return {(sample.name, sample.labels.get("le", "")): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples if not sample.name.endswith("_created")}


def test_observe_all_matches_observe_one_by_one_bounds_included() -> None:
    rng = random.Random(7)
    values = [rng.choice([0.0, *BUCKETS, 2.0]) for _ in range(40)]  # every bound exactly
    values += [rng.uniform(0, 1.5) for _ in range(200)]
    one, many = CollectorRegistry(), CollectorRegistry()
    one_by_one = Histogram("wait", "w", ["model"], buckets=BUCKETS, registry=one)
    at_once = Histogram("wait", "w", ["model"], buckets=BUCKETS, registry=many)
    for value in values:
        one_by_one.labels("m").observe(value)
    observe_all(at_once.labels("m"), values[:1])  # one value: plain observe
    observe_all(at_once.labels("m"), values[1:])
    observe_all(at_once.labels("m"), [])
    expected, got = exposition(one), exposition(many)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert abs(got[key] - value) < 1e-9, key
    assert got[("wait_count", "")] == len(values)


def test_the_token_cost_gauge_is_absent_while_the_cost_per_token_is_unmeasured() -> None:
    """The policy reports an unmeasured cost per token as None: no gauge, not a crash."""
    policy = DispatchPolicy(WorkerConfig())
    for _ in range(50):  # one size: no slope can be measured
        policy.observe(None, 416, 416, 32, 0.0025)
    families = {family.name: family for family in dispatch_metrics({"m": policy.describe()})}
    assert families["ember_dispatch_token_cost_seconds"].samples == []
    assert [sample.value for sample in families["ember_dispatch_fixed_cost_seconds"].samples] \
        == [pytest.approx(0.0025)]
