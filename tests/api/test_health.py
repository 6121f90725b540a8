"""/healthz, /readyz, /v1/models, /metrics and the OpenAPI page."""

from __future__ import annotations

import asyncio
import re
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ember.adapters.base import ModelAdapter, Runtime
from ember.config import ModelSpec
from ember.registry import LoadFunction, adapter_loader
from tests.api.conftest import (
    BROKEN,
    BROKEN_DIR,
    MINILM,
    SPACY,
    SYNTH,
    AppFactory,
    Served,
    assert_error,
    encode_body,
    gated_loader,
    wait_for,
)


async def test_healthz_and_readyz_when_ready(shared: Served) -> None:
    health = await shared.client.get("/healthz")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    ready = await shared.client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ready", "default_model": SYNTH}
    for probe in ("/healthz", "/readyz", "/health"):  # uptime checkers probe with HEAD too
        assert (await shared.client.head(probe)).status_code == 200, probe


async def test_readyz_is_503_until_the_default_model_is_loaded(apps: AppFactory) -> None:
    gate = threading.Event()
    try:
        async with apps.serve(wait=False, loader=gated_loader(gate)) as served:
            await wait_for(lambda: served.registry.state(SYNTH) == "loading")
            assert (await served.client.get("/healthz")).status_code == 200  # alive meanwhile
            error = assert_error(await served.client.get("/readyz"), 503, "not_ready")
            assert SYNTH in error["message"] and "loading" in error["message"]
            gate.set()
            await served.registry.get(SYNTH)
            ready = await served.client.get("/readyz")
            assert ready.status_code == 200, ready.text
    finally:
        gate.set()


async def test_readyz_is_503_when_the_default_model_failed_to_load(apps: AppFactory) -> None:
    async with apps.serve(wait=False, default_model=BROKEN) as served:
        response = await served.client.post(f"/v1/encode/{BROKEN}", json=encode_body("x"))
        error = assert_error(response, 502, "model_load_failed", "model")
        assert BROKEN in error["message"]
        assert BROKEN_DIR not in error["message"]  # no file paths reach a client
        assert "secret-weights" not in error["message"]
        error = assert_error(await served.client.get("/readyz"), 503, "not_ready")
        assert "failed" in error["message"]
        assert (await served.client.get("/healthz")).status_code == 200
        # Found by a review: a failed load left no trace in the metrics but a 502's count.
        found = samples(await served.metrics())
        assert value(found, "ember_model_load_failures_total", model=BROKEN) == 1


async def test_readyz_recovers_by_itself_once_the_default_model_can_load(
        apps: AppFactory) -> None:
    """Found by a black-box review: after one failed load of the default model (a volume
    mounted late), /readyz stayed 503 until an inference request tried the load again,
    and no load balancer sends one to a server that is not ready."""
    failures = [OSError("the volume was not mounted yet")]

    def loader(family: str) -> LoadFunction:
        load = adapter_loader(family)

        def once_failing(spec: ModelSpec, runtime: Runtime) -> ModelAdapter:
            if failures:
                raise failures.pop()
            return load(spec, runtime)

        return once_failing

    async with apps.serve(wait=False, loader=loader) as served:
        served.registry.limits = replace(served.registry.limits, failure_retry_s=0.2)
        await wait_for(lambda: served.registry.state(SYNTH) == "failed")
        error = assert_error(await served.client.get("/readyz"), 503, "not_ready")
        assert "failed" in error["message"]
        for _ in range(100):  # probes alone, as a load balancer sends
            if (await served.client.get("/readyz")).status_code == 200:
                break
            await asyncio.sleep(0.05)
        assert (await served.client.get("/readyz")).status_code == 200
        assert not failures


async def test_readyz_is_503_while_draining(synthetic_app: Served) -> None:
    assert (await synthetic_app.client.get("/readyz")).status_code == 200
    synthetic_app.state.draining = True
    error = assert_error(await synthetic_app.client.get("/readyz"), 503, "unavailable")
    assert "draining" in error["message"]
    assert (await synthetic_app.client.get("/healthz")).status_code == 200
    # Found by a review: an operator could not watch a drain, nor scrape its last counts.
    for path in ("/metrics", "/v1/models", f"/v1/models/{SYNTH}", "/info"):
        assert (await synthetic_app.client.get(path)).status_code == 200, path
    assert_error(await synthetic_app.client.post("/v1/models"), 503, "unavailable")


async def test_models_lists_the_catalog_with_states(shared: Served) -> None:
    response = await shared.client.get("/v1/models")
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["object"] == "list"
    models = {m["id"]: m for m in data["data"]}
    assert {SYNTH, MINILM, SPACY, BROKEN} <= set(models)
    assert list(models) == sorted(models)
    minilm = models[MINILM]
    assert minilm["state"] == "loaded"
    assert minilm["tasks"] == ["encode", "score"]
    assert minilm["dims"] == 384 and minilm["adapter"] == "transformer"
    assert models[SYNTH]["state"] == "loaded" and models[SYNTH]["dims"] == 64
    assert models[BROKEN]["state"] in ("available", "failed")
    assert models[BROKEN]["dims"] is None  # known once loaded
    # Found by a black-box review: `dims` is a number in OpenAI's list and SIE's map for one
    # model; `dimensions` is the number in every shape.
    one = (await shared.client.get(f"/v1/models/{MINILM}")).json()
    assert minilm["dimensions"] == one["dimensions"] == 384 and one["dims"] == {"dense": 384}
    assert all(m["dimensions"] == m["dims"] for m in data["data"])
    # A catalog entry's declared dims before its load (found by a review: `ember models
    # --url` showed none where `ember models` showed them): the model's first output's.
    sie = {m["name"]: m for m in data["models"]}
    assert models["BAAI/bge-base-en-v1.5"]["state"] == "available"
    assert models["BAAI/bge-base-en-v1.5"]["dims"] == 768
    assert sie["BAAI/bge-base-en-v1.5"]["dims"] == {"dense": 768}
    assert models["BAAI/bge-m3"]["dims"] == 1024
    assert sie["BAAI/bge-m3"]["dims"] == {"dense": 1024}
    # Whether a model's files are here (found by a black-box review: offline, every Hub
    # model read "available" with nothing to load it from).
    assert minilm["cached"] is True and models[SPACY]["cached"] is True  # packages
    assert models[SYNTH]["cached"] is None  # no files at all
    for model in models.values():
        assert model["object"] == "model"
        assert {"id", "tasks", "state", "description", "adapter"} <= set(model)


async def test_models_shows_labels_of_a_loaded_extractor(shared: Served) -> None:
    await shared.registry.get(SPACY)
    models = {m["id"]: m for m in (await shared.client.get("/v1/models")).json()["data"]}
    assert "PERSON" in models[SPACY]["labels"]


async def test_openapi_documents_every_route(shared: Served) -> None:
    docs = await shared.client.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    schema = (await shared.client.get("/openapi.json")).json()
    paths = set(schema["paths"])
    assert {"/v1/encode/{model}", "/v1/score/{model}", "/v1/extract/{model}",
            "/v1/embeddings", "/v1/rerank", "/embed", "/rerank", "/v1/models", "/healthz",
            "/readyz", "/metrics"} <= paths
    # Found by a black-box review: every refusal was documented as FastAPI's
    # `{"detail": [...]}`, which the server never sends, and the metrics as JSON.
    error = {"$ref": "#/components/schemas/ErrorBody"}
    for path, methods in schema["paths"].items():
        for method, operation in methods.items():
            if method == "post":
                answers = operation["responses"]
                assert {"400", "404", "413", "415", "422", "429", "503", "504"} <= set(answers)
                assert answers["422"]["content"]["application/json"]["schema"] == error, path
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    assert set(schema["components"]["schemas"]["ErrorDetail"]["required"]) == {
        "type", "message", "code"}
    assert schema["paths"]["/readyz"]["get"]["responses"]["503"]["content"][
        "application/json"]["schema"] == error
    assert list(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == [
        "text/plain"]


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Metric samples by sample name, from the Prometheus text format."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def value(found: dict[str, list[tuple[dict[str, str], float]]], name: str,
          **labels: str) -> float:
    return sum(v for sample_labels, v in found.get(name, [])
               if all(sample_labels.get(k) == want for k, want in labels.items()))


async def test_metrics_after_traffic(apps: AppFactory) -> None:
    async with apps.serve() as served:
        client = served.client
        for _ in range(3):
            assert (await client.post(f"/v1/encode/{SYNTH}",
                                      json=encode_body("a b", "c"))).status_code == 200
        assert (await client.post("/v1/embeddings", json={"input": "x"})).status_code == 200
        assert (await client.post("/v1/encode/not/here", json=encode_body("x"))
                ).status_code == 404
        assert (await client.post(f"/v1/encode/{SYNTH}", json=encode_body("__fail__"))
                ).status_code == 500
        served.state.draining = True
        assert (await client.post(f"/v1/encode/{SYNTH}", json=encode_body("x"))
                ).status_code == 503
        served.state.draining = False

        response = await client.get("/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
        found = samples(response.text)
        total = "ember_requests_total"
        encode = "/v1/encode/{model:path}"
        assert value(found, total, route=encode, model=SYNTH, status="200") == 3
        assert value(found, total, route="/v1/embeddings", model=SYNTH, status="200") == 1
        assert value(found, total, route=encode, model="unknown", status="404") == 1
        assert value(found, total, route=encode, model=SYNTH, status="500") == 1
        # a refusal before routing is counted too, with its status
        assert value(found, total, route="unrouted", status="503") == 1
        assert value(found, "ember_request_duration_seconds_count", route=encode) == 5
        requests = 3 + 1 + 1  # the failed forward is a request too
        assert value(found, "ember_queue_duration_seconds_count", model=SYNTH) == requests
        assert value(found, "ember_inference_duration_seconds_count", model=SYNTH) == requests
        assert value(found, "ember_batch_inference_duration_seconds_count",
                     model=SYNTH) == requests
        assert value(found, "ember_request_input_tokens_count", route=encode,
                     model=SYNTH) == 3
        assert value(found, "ember_request_input_tokens_sum", route=encode, model=SYNTH) > 0
        assert value(found, "ember_batch_tokens_count", model=SYNTH) == requests
        assert value(found, "ember_batch_items_count", model=SYNTH) == requests
        assert value(found, "ember_batch_items_sum", model=SYNTH) == 3 * 2 + 1 + 1
        assert value(found, "ember_batch_padded_tokens_count", model=SYNTH) == requests
        assert value(found, "ember_batch_requests_count", model=SYNTH) == requests
        assert value(found, "ember_forward_failures_total", model=SYNTH) == 1
        assert value(found, "ember_pending_items", model=SYNTH) == 0
        assert value(found, "ember_running_items", model=SYNTH) == 0
        assert value(found, "ember_model_loaded", model=SYNTH) == 1
        assert value(found, "ember_model_loads_total", model=SYNTH) == 1
        assert value(found, "ember_model_load_duration_seconds_count", model=SYNTH) == 1
        assert value(found, "ember_rejections_total", reason="draining") == 1
        assert "ember_model_load_failures_total" not in found
        assert value(found, "ember_process_starts_total", role="server") == 1
        assert "ember_model_evictions_total" in response.text or \
            "ember_model_evictions" in response.text


async def test_metrics_export_the_device_idle_gaps_by_cause(apps: AppFactory) -> None:
    async with apps.serve() as served:
        for _ in range(3):
            assert (await served.client.post(f"/v1/encode/{SYNTH}",
                                             json=encode_body("x"))).status_code == 200
        found = samples(await served.metrics())
        name = "ember_device_idle_gap_seconds_total"
        causes = {labels["cause"] for labels, _ in found.get(name, [])
                  if labels.get("model") == SYNTH}
        assert causes == {"hold", "formation", "wakeup"}
        # each forward starts a little after its release: the thread's wake-up
        assert value(found, name, model=SYNTH, cause="wakeup") > 0
        assert value(found, name, model=SYNTH, cause="hold") == 0  # lone requests: no hold
        assert "ember_device_idle_gaps_total" in found


async def test_model_and_metrics_show_the_learned_cost_and_windows(apps: AppFactory) -> None:
    async with apps.serve() as served:
        client = served.client
        before = (await client.get(f"/v1/models/{SYNTH}")).json()["dispatch"]
        assert before["dispatch"] == "auto" and before["cost"] is None  # nothing run yet
        assert before["windows"]["learned"] is False
        for i in range(12):  # one forward each: enough for a first fit
            assert (await client.post(f"/v1/encode/{SYNTH}", json=encode_body(
                "word " * (1 + 3 * i)))).status_code == 200
        dispatch = (await client.get(f"/v1/models/{SYNTH}")).json()["dispatch"]
        cost, windows = dispatch["cost"], dispatch["windows"]
        assert cost is not None and cost["forwards"] >= 8 and cost["fixed_ms"] > 0
        assert windows["learned"] is True
        found = samples(await served.metrics())
        assert value(found, "ember_dispatch_fixed_cost_seconds", model=SYNTH,
                     lora="") == pytest.approx(cost["fixed_ms"] / 1e3)
        assert value(found, "ember_dispatch_window_seconds", model=SYNTH, lora="",
                     window="max_batch_wait") == pytest.approx(
                         windows["max_batch_wait_ms"] / 1e3)
        assert value(found, "ember_dispatch_max_padding", model=SYNTH,
                     lora="") == windows["max_padding"]
        assert value(found, "ember_dispatch_max_batch_tokens", model=SYNTH,
                     lora="") == windows["max_batch_tokens"] > 0
        assert value(found, "ember_dispatch_learned", model=SYNTH, lora="") == 1


async def test_metrics_count_evictions(apps: AppFactory) -> None:
    async with apps.serve(max_loaded_models=1) as served:
        response = await served.client.post("/v1/encode/test/busy-synthetic",
                                            json=encode_body("x"))
        assert response.status_code == 200, response.text
        found = samples(await served.metrics())
        assert value(found, "ember_model_evictions_total", model=SYNTH) == 1
        assert value(found, "ember_model_loaded", model=SYNTH) == 0
        assert value(found, "ember_model_loads_total") == 2


def test_metric_names_are_prometheus_safe() -> None:
    from ember.metrics import Metrics

    text = Metrics(process=True).registry
    names = [m.name for m in text.collect()]
    assert all(re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", n) for n in names)
    # Ember's own, and the process's standard ones (found by an operator's review: an
    # operator had to read memory and open files from /proc).
    assert all(n.startswith(("ember_", "process_")) for n in names)
    assert {"process_resident_memory_bytes", "process_open_fds",
            "process_cpu_seconds"} <= set(names)
    # An API process or a Ray ingress replica is not the server: its own would mislead.
    assert not [m.name for m in Metrics().registry.collect() if m.name.startswith("process_")]


async def test_models_say_whether_a_hub_models_files_are_here(
        shared: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # an empty Hub cache
    models = {m["id"]: m for m in (await shared.client.get("/v1/models")).json()["data"]}
    hub_models = [m for m in models.values() if m["adapter"] not in ("synthetic",)
                  and m["id"] not in (MINILM, SPACY, BROKEN)]
    assert hub_models and all(m["cached"] is False for m in hub_models)
    assert models["BAAI/bge-small-en-v1.5"]["state"] == "available"
