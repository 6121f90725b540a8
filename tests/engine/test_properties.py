"""Scenario 14: random arrival schedules against the invariants of the worker."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.adapters.synthetic import CostModel
from ember.engine import PreparedItem, WorkerConfig
from tests.engine.helpers import LoggingSynthetic, PausableWorker


@dataclass(frozen=True)
class Arrival:
    delay_ms: float
    costs: tuple[int, ...]
    lora: str | None
    params: str
    cancel: bool


arrivals = st.lists(
    st.builds(
        Arrival,
        delay_ms=st.sampled_from([0.0, 0.0, 0.5, 2.0]),
        costs=st.lists(st.integers(1, 300), min_size=1, max_size=12).map(tuple),
        lora=st.sampled_from([None, "a", "b"]),
        params=st.sampled_from(["p", "q"]),
        cancel=st.sampled_from([False, False, False, True]),
    ),
    min_size=1,
    max_size=25,
)
configs = st.builds(
    WorkerConfig,
    max_batch_tokens=st.integers(64, 1024),
    max_batch_items=st.integers(1, 8),
    idle_coalesce_ms=st.sampled_from([0.0, 1.0, 3.0]),
    max_batch_wait_ms=st.sampled_from([2.0, 5.0]),
)


async def drive(config: WorkerConfig, schedule: list[Arrival]) -> None:
    adapter = LoggingSynthetic(dims=4, cost=CostModel(0.2, 0.0, "sleep"))
    worker = PausableWorker(adapter, config)
    await worker.start()
    submitted = []
    for number, arrival in enumerate(schedule):
        if arrival.delay_ms:
            await asyncio.sleep(arrival.delay_ms / 1000)
        texts = [f"{arrival.lora}|{arrival.params}|{c}|{number}.{i}"
                 for i, c in enumerate(arrival.costs)]
        pairs = zip(texts, arrival.costs, strict=True)
        prepared = [PreparedItem(t, c, i) for i, (t, c) in enumerate(pairs)]
        future = await worker.submit(prepared, arrival.params, lora=arrival.lora)
        if arrival.cancel:
            future.cancel()
        submitted.append((arrival, texts, future))
    await asyncio.gather(*(f for _, _, f in submitted), return_exceptions=True)
    await worker.stop()

    # Every accepted request resolved and recorded exactly once, in its input order; a
    # cancelled one as cancelled, with inference only where a forward had taken it.
    live = [(a, texts, f) for a, texts, f in submitted if not f.cancelled()]
    records = worker.stats.recent_requests
    assert sum(not r.cancelled for r in records) == len(live)
    ran = {p for call in adapter.forward_log for p in call.payloads}
    cancelled = [texts for _, texts, f in submitted if f.cancelled()]
    assert sum(r.cancelled for r in records) == len(cancelled)
    assert (sum(r.cancelled and r.inference_ms > 0 for r in records)
            <= sum(bool(ran & set(t)) for t in cancelled))
    for arrival, texts, future in live:
        values = future.result().values
        assert [v.tolist() for v in values] == [adapter.vector(t, arrival.lora).tolist()
                                               for t in texts]
    # No forward breaks the limits (but a lone oversize item), or mixes LoRAs or groups.
    for call in adapter.forward_log:
        loras = {p.split("|")[0] for p in call.payloads}
        groups = {p.split("|")[1] for p in call.payloads}
        assert loras == {str(call.lora)} and groups == {call.params}
        widest = max(int(p.split("|")[2]) for p in call.payloads)
        assert len(call.payloads) <= config.max_batch_items
        assert len(call.payloads) == 1 or len(call.payloads) * widest <= config.max_batch_tokens
    # The queue is empty.
    assert worker.pending_items == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, schedule=arrivals)
def test_random_schedules_keep_every_invariant(config: WorkerConfig,
                                               schedule: list[Arrival]) -> None:
    asyncio.run(drive(config, schedule))
