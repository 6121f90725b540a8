"""Registry: lazy single-flight loads, LRU eviction that drains, load failures."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from ember import registry as registry_module
from ember.adapters.base import (
    EncodeOptions,
    ModelAdapter,
    Runtime,
    import_family,
    usable_cores,
)
from ember.config import ModelSpec, ServerSettings, load_catalog, parse_spec, spec_from_directory
from ember.engine import WorkerConfig
from ember.errors import ModelLoadError, ModelNotFound
from ember.ipc import models as remote_models_module
from ember.ipc.models import RemoteModels, front_loader
from ember.registry import (
    LoadedModel,
    LoadFunction,
    Registry,
    RegistryLimits,
    adapter_loader,
)
from tests.engine.helpers import PausableWorker


def synthetic(name: str, **options: object) -> ModelSpec:
    return parse_spec({"name": name, "adapter": "synthetic", "tasks": ["encode", "score"],
                       "options": {"dims": 8, "overhead_ms": 1.0, **options}}, "test")


def catalog(*specs: ModelSpec) -> dict[str, ModelSpec]:
    return {spec.name: spec for spec in specs}


def forward_threads(*models: str) -> list[threading.Thread]:
    """The live forward threads of these models' workers (other tests' may run beside)."""
    names = {f"ember-forward-{model}" for model in models}
    return [thread for thread in threading.enumerate() if thread.name in names]


async def test_concurrent_first_requests_load_once() -> None:
    registry = Registry(catalog(synthetic("a")))
    loads: list[str] = []
    registry.on_load.append(lambda model: loads.append(model.spec.name))
    models = await asyncio.gather(*(registry.get("a") for _ in range(8)))
    assert loads == ["a"] and all(m is models[0] for m in models)
    await registry.close()


async def test_unknown_model_names_the_available_ones() -> None:
    registry = Registry(catalog(synthetic("a"), synthetic("b")))
    with pytest.raises(ModelNotFound, match="on this machine\\): a, b"):
        await registry.get("../etc/passwd")


@pytest.mark.parametrize(("typed", "meant"), [("org/B", "org/b"), ("b", "org/b"),
                                              ("org/b333", "org/b33")])
async def test_a_mistyped_model_name_is_told_the_closest_one(typed: str, meant: str) -> None:
    """Found by a black-box review: a 404 listing the whole catalog, no suggestion."""
    registry = Registry(catalog(synthetic("org/b"), synthetic("org/b33"), synthetic("x/yz")))
    with pytest.raises(ModelNotFound, match=f"did you mean {meant!r}"):
        await registry.get(typed)


async def test_least_recently_used_idle_model_is_evicted_after_draining(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ember.registry")
    registry = Registry(catalog(synthetic("a"), synthetic("b"), synthetic("c")),
                        limits=RegistryLimits(max_loaded_models=2), worker=PausableWorker)
    evicted: list[str] = []
    registry.on_evict.append(evicted.append)
    a = await registry.get("a")
    await registry.get("b")
    async with registry.use("b"):
        pass  # b is now more recently used than a
    a.worker.pause()  # a holds accepted work when it is chosen for eviction
    accepted = await a.worker.submit(a.adapter.prepare(["kept", "too"]), "p")  # type: ignore[attr-defined]
    await registry.get("c")
    assert evicted == ["a"] and sorted(registry.loaded) == ["b", "c"]
    result = await accepted  # drained, not dropped
    assert len(result.values) == 2
    await registry.close()
    # Found by a review: an eviction's line said neither why nor for what.
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("evicting")]
    assert said[0].startswith("evicting model a: room for c (--max-loaded-models 2); the "
                              "idle model used least recently (")
    assert sorted(said[1:]) == [f"evicting model {name}: the server stops (draining its "
                                "queue first)" for name in "bc"]


async def test_a_model_in_use_is_not_evicted_and_the_limit_holds_again_once_idle() -> None:
    registry = Registry(catalog(synthetic("a"), synthetic("b")),
                        limits=RegistryLimits(max_loaded_models=1))
    evicted: list[str] = []
    registry.on_evict.append(evicted.append)
    async with registry.use("a"):
        async with registry.use("b"):  # a is busy: both stay, over the limit, rather than fail
            assert sorted(registry.loaded) == ["a", "b"]
        assert sorted(registry.loaded) == ["a", "b"]  # b is idle, a still busy: b goes
        for _ in range(100):
            if len(registry.loaded) == 1:
                break
            await asyncio.sleep(0.01)
    # Found by a black-box review: once over, a registry stayed over for good.
    assert sorted(registry.loaded) == ["a"] and evicted == ["b"]
    await registry.close()


async def test_a_model_just_loaded_is_held_by_its_waiters_before_any_eviction() -> None:
    """Found by a black-box review: another load's eviction ran between a load's end and
    its waiting requests taking hold of the model; they got a 503 "shutting down"."""
    registry = Registry(catalog(synthetic("b"), synthetic("c")),
                        limits=RegistryLimits(max_loaded_models=1))
    others: list[asyncio.Task[LoadedModel]] = []

    def start_another(model: LoadedModel) -> None:  # in the same turn as b's load ends
        if model.spec.name == "b":
            others.append(asyncio.get_running_loop().create_task(registry.get("c")))

    registry.on_load.append(start_another)
    async with registry.use("b") as b:
        future = await b.worker.submit(b.adapter.prepare(["x"]), "p")  # type: ignore[attr-defined]
        assert len((await future).values) == 1
    await others[0]
    for _ in range(100):  # both were loaded at once; b goes once idle
        if list(registry.loaded) == ["c"]:
            break
        await asyncio.sleep(0.01)
    assert list(registry.loaded) == ["c"]
    await registry.close()


async def test_a_worker_restarting_after_a_failure_is_not_evicted_meanwhile() -> None:
    """Found by a code review: the restart awaited its old loop's end while the model
    looked idle; another load evicted it (closing its adapter), and the restarted worker
    served on released weights, its thread out of the registry's reach."""
    registry = Registry(catalog(synthetic("a"), synthetic("b"), synthetic("c")),
                        limits=RegistryLimits(max_loaded_models=2))
    a = await registry.get("a")
    await registry.get("b")  # b more recently used than a
    a.worker._task.cancel()  # type: ignore[union-attr]  # its loop fails
    for _ in range(100):
        if a.worker.failure is not None:
            break
        await asyncio.sleep(0.01)
    assert a.worker.failure is not None
    restarted, _ = await asyncio.gather(registry.get("a"), registry.get("c"))
    assert restarted is a and registry.loaded.get("a") is a  # b went instead
    future = await a.worker.submit(a.adapter.prepare(["x"]), "p")  # type: ignore[attr-defined]
    assert len((await future).values) == 1
    await registry.close()
    assert not forward_threads("a", "b", "c")


async def test_a_load_that_fails_after_its_worker_started_leaves_nothing_running() -> None:
    """Found by a code review: the worker's task and forward thread, and the weights they
    held, stayed after the load was reported failed (each retry added a copy)."""
    closed: list[str] = []

    def failing_loader(family: str) -> LoadFunction:
        load = adapter_loader(family)

        def load_then_fail(spec: ModelSpec, runtime: Runtime) -> ModelAdapter:
            adapter = load(spec, runtime)
            real_close = adapter.close

            def close() -> None:
                closed.append(spec.name)
                real_close()

            adapter.close = close  # type: ignore[method-assign]
            return adapter

        return load_then_fail

    registry = Registry(catalog(synthetic("a")), loader=failing_loader)
    registry.on_worker.append(lambda model: (_ for _ in ()).throw(OSError("a hook failed")))
    with pytest.raises(ModelLoadError, match="a hook failed"):
        await registry.get("a")
    assert closed == ["a"] and registry.state("a") == "failed"
    assert not forward_threads("a")
    await registry.close()


async def test_models_asked_for_at_once_count_against_the_limit_before_they_load() -> None:
    """Found by a black-box review: loads that started together each saw room for itself
    alone, and the registry went past --max-loaded-models (or the memory budget)."""
    def slow_loader(family: str) -> LoadFunction:  # loads that overlap, as real ones do
        load = adapter_loader(family)

        def slowly(spec: ModelSpec, runtime: Runtime) -> ModelAdapter:
            time.sleep(0.05)
            return load(spec, runtime)

        return slowly

    registry = Registry(catalog(*(synthetic(name) for name in "axybc")),
                        limits=RegistryLimits(max_loaded_models=3, pinned=frozenset("a")),
                        loader=slow_loader)
    most = 0

    def count(_: LoadedModel) -> None:
        nonlocal most
        most = max(most, len(registry.loaded))  # the new one included

    for name in "axy":
        await registry.get(name)
    registry.on_load.append(count)
    evicted: list[str] = []
    registry.on_evict.append(evicted.append)
    await asyncio.gather(registry.get("b"), registry.get("c"))
    assert sorted(evicted) == ["x", "y"] and sorted(registry.loaded) == ["a", "b", "c"]
    assert most == 3
    await registry.close()


async def test_the_default_model_is_never_evicted() -> None:
    """Found by a black-box review: with --max-loaded-models 1, one request for another
    model evicted the default model and /readyz turned 503 until someone used it again."""
    settings = ServerSettings(default_model="a", max_loaded_models=1)
    registry = Registry.serving(settings, catalog(synthetic("a"), synthetic("b"),
                                                  synthetic("c")))
    evicted: list[str] = []
    registry.on_evict.append(evicted.append)
    await registry.get("a")
    await registry.get("b")  # over the limit: only a pinned model is left to evict
    await registry.get("c")
    assert evicted == ["b"] and sorted(registry.loaded) == ["a", "c"]
    assert registry.state("a") == "loaded"
    await registry.close()


async def test_load_failure_is_clear_and_other_models_still_serve(tmp_path: Path) -> None:
    broken = parse_spec({"name": "broken", "adapter": "transformer", "tasks": ["encode"],
                         "source": {"path": str(tmp_path / "missing")}}, "test")
    registry = Registry(catalog(broken, synthetic("ok")))
    attempts: list[str] = []
    registry.on_load_failure.append(attempts.append)
    with pytest.raises(ModelLoadError, match="'broken' failed to load: FileNotFoundError"):
        await registry.get("broken")
    assert registry.state("broken") == "failed"
    with pytest.raises(ModelLoadError, match="FileNotFoundError"):
        await registry.get("broken")
    assert attempts == ["broken"]  # remembered, not retried on every request
    model = await registry.get("ok")
    output = await model.adapter.encode(model.submit, ["fine"], EncodeOptions())
    assert output.values[0].dense is not None
    await registry.close()


async def test_a_failed_load_says_when_it_is_tried_again_and_then_is() -> None:
    """Found by a black-box review: nothing said that a failed model is tried again."""
    attempts: list[str] = []

    def flaky_loader(family: str) -> LoadFunction:
        load = adapter_loader(family)

        def flaky(spec: ModelSpec, runtime: Runtime) -> ModelAdapter:
            attempts.append(spec.name)
            if len(attempts) == 1:
                raise OSError("the disk was busy")
            return load(spec, runtime)

        return flaky

    registry = Registry(catalog(synthetic("a")), limits=RegistryLimits(failure_retry_s=0.2),
                        loader=flaky_loader)
    said = r"OSError: the disk was busy \(a request tries the load again 0.2 s after it failed\)"
    with pytest.raises(ModelLoadError, match=said):
        await registry.get("a")
    with pytest.raises(ModelLoadError, match=said):  # within the window: remembered
        await registry.get("a")
    assert attempts == ["a"]
    await asyncio.sleep(0.25)
    assert (await registry.get("a")).spec.name == "a" and attempts == ["a", "a"]
    await registry.close()


async def test_memory_budget_evicts_to_fit_real_models() -> None:
    real = load_catalog()
    names = ["sentence-transformers/all-MiniLM-L6-v2", "spacy/en_core_web_sm"]
    registry = Registry({n: real[n] for n in names},
                        limits=RegistryLimits(memory_budget_bytes=95 * 1024 * 1024))
    await registry.get(names[0])  # ~91 MB of weights
    await registry.get(names[1])  # does not fit beside it
    assert list(registry.loaded) == [names[1]]
    await registry.close()


async def test_each_worker_knows_whether_its_forwards_fill_the_cores() -> None:
    name = "sentence-transformers/all-MiniLM-L6-v2"
    spec = load_catalog()[name]
    cases = [(Runtime(), True), (Runtime(backend="torch"), usable_cores() == 1)]
    if usable_cores() > 1:  # a core left to the front end: the hold stays short
        cases.append((Runtime(onnx_threads=usable_cores() - 1), False))
    for runtime, fills in cases:
        registry = Registry({name: spec, "a": synthetic("a")}, runtime)
        assert (await registry.get(name)).worker.config.forward_fills_cores is fills
        assert (await registry.get("a")).worker.config.forward_fills_cores is False
        await registry.close()


async def test_close_drains_every_worker() -> None:
    registry = Registry(catalog(synthetic("a")), worker=PausableWorker)
    model = await registry.get("a")
    model.worker.pause()
    future = await model.worker.submit(model.adapter.prepare(["x"]), "p")  # type: ignore[attr-defined]
    await registry.close()
    assert future.done() and len(future.result().values) == 1
    assert registry.loaded == {}


async def test_a_directory_named_without_yaml_loads_and_serves(tmp_path: Path) -> None:
    from tests.adapters.tiny_models import build_bi_encoder

    spec = spec_from_directory(build_bi_encoder(tmp_path / "mine"))
    registry = Registry({spec.name: spec})
    model = await registry.get("local/mine")
    output = await model.adapter.encode(model.submit, ["hello", "world"], EncodeOptions())
    assert [e.dense.shape for e in output.values if e.dense is not None] == [(32,), (32,)]
    await registry.close()


async def test_a_worker_whose_loop_failed_is_restarted_on_next_use() -> None:
    registry = Registry(catalog(synthetic("a")))
    model = await registry.get("a")
    task = next(t for t in asyncio.all_tasks() if t.get_name() == "ember-worker-a")
    task.cancel()  # the loop dies (as if a listener or the loop itself failed)
    await asyncio.sleep(0.01)
    assert model.worker.failure is not None
    again = await registry.get("a")
    output = await again.adapter.encode(again.submit, ["fine"], EncodeOptions())
    assert output.values[0].dense is not None and again.worker.failure is None
    await registry.close()


async def test_a_cancelled_caller_drops_its_queued_items() -> None:
    registry = Registry(catalog(synthetic("a")), worker=PausableWorker)
    model = await registry.get("a")
    model.worker.pause()
    prepared = model.adapter.prepare(["gone", "too"])  # type: ignore[attr-defined]
    caller = asyncio.create_task(model.submit(prepared, "p", None))
    await asyncio.sleep(0.01)
    assert model.worker.pending_items == 2
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await asyncio.sleep(0)
    assert model.worker.pending_items == 0 and model.worker.stats.dropped_items == 2
    await registry.close()


@pytest.mark.parametrize("loader", [adapter_loader, front_loader])
def test_a_process_that_loads_a_family_runs_numpy_blas_on_one_thread(
        loader: Callable[[str], object]) -> None:
    # OpenBLAS's threads spin after each call on the cores the forwards need.
    threadpool_limits(2, user_api="blas")  # what a fresh process on 2 cores starts with
    assert blas_threads() == {2}
    loader("synthetic")
    assert blas_threads() == {1}


def blas_threads() -> set[int]:
    return {int(lib["num_threads"]) for lib in threadpool_info() if lib["user_api"] == "blas"}


CONCURRENT_LOADS = """
import sys, threading
from pathlib import Path
from ember.adapters.base import Runtime
from ember.config import spec_from_directory
from ember.ipc.models import RemoteModels, front_loader
from ember.registry import adapter_loader

folders = [Path(p) for p in sys.argv[1:]]
loads = [front_loader("transformer"), adapter_loader("sparse"),
         adapter_loader("cross_encoder"), front_loader("transformer")]
errors = []

def load(loader, folder):
    try:
        loader(spec_from_directory(folder), Runtime(backend="torch"))
    except Exception as exc:
        errors.append(repr(exc))

threads = [threading.Thread(target=load, args=pair) for pair in zip(loads, folders)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(errors)
"""


def test_loads_started_together_in_a_fresh_process_all_succeed(tmp_path: Path) -> None:
    # transformers resolves its classes on first use; in a process that has not yet done
    # so (an API process just started), two loads at once got "cannot import name".
    import subprocess
    import sys

    from tests.adapters.tiny_models import (
        build_bi_encoder,
        build_cross_encoder,
        build_sparse_encoder,
    )
    from tests.live_server import REPO, server_env

    folders = [build_bi_encoder(tmp_path / "a"), build_sparse_encoder(tmp_path / "b"),
               build_cross_encoder(tmp_path / "c"), build_bi_encoder(tmp_path / "d", seed=1)]
    done = subprocess.run([sys.executable, "-c", CONCURRENT_LOADS, *map(str, folders)],
                          capture_output=True, text=True, cwd=REPO, env=server_env(None),
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


async def test_an_unknown_hub_id_says_how_this_server_would_serve_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hub id the catalog lacks, on a server whose requests may not fetch models: the 404
    names the start's flags that would serve it; a name that is no Hub id gets no such hint."""
    monkeypatch.delenv("EMBER_ALLOW_HUB_MODELS", raising=False)
    registry = Registry(catalog(synthetic("org/a")))
    with pytest.raises(ModelNotFound) as found:
        await registry.get("someone/model")
    message = str(found.value)
    assert "--model someone/model or --preload someone/model" in message
    assert "--allow-hub-models" in message and message.endswith("on this machine): org/a")
    with pytest.raises(ModelNotFound) as found:  # no request may fetch a revision
        await registry.get("someone/model@v2")
    assert "--model someone/model@v2" in str(found.value)
    assert "--allow-hub-models" not in str(found.value)
    for name in ("no-slash", "local/thing"):
        with pytest.raises(ModelNotFound) as found:
            await registry.get(name)
        assert "--allow-hub-models" not in str(found.value)


async def test_a_familys_module_is_imported_off_the_event_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Found reading the loads for a review of the Ray path: the family's module was
    imported on the event loop, and importing torch (1.6 s here) held every request of a
    process that had not imported it yet (a spaCy default model, say). It is imported in
    a thread now, for the engine's models and an API process's fronts. (numpy's BLAS is
    still limited on the loop's thread: a limit set in a thread does not reliably hold.)"""
    loop_thread = threading.current_thread()
    imported_in: list[threading.Thread] = []

    def recording_import(family: str) -> ModuleType:
        imported_in.append(threading.current_thread())
        return import_family(family)

    monkeypatch.setattr(registry_module, "import_family", recording_import)
    monkeypatch.setattr(remote_models_module, "import_family", recording_import)

    class Loaded:
        """An engine that has the model (the engine's side is the registry's, above)."""

        one_queue = True

        async def call(self, op: str, **fields: object) -> dict[str, object]:
            return {}

    registry = Registry(catalog(synthetic("a")))
    await registry.get("a")
    await registry.close()
    fronts = RemoteModels(catalog(synthetic("a")), Runtime(), Loaded(),  # type: ignore[arg-type]
                          worker=WorkerConfig(max_queue_items=8))
    await fronts.get("a")
    assert len(imported_in) == 2 and loop_thread not in imported_in


async def test_a_remembered_lookup_failure_is_raised_again_without_a_longer_traceback() -> None:
    """A request's Hub id that failed its lookup fails at once for a while; raising the one
    remembered exception again must not grow its traceback with every request."""
    from ember.registry import HubLookups

    def lookup() -> ModelSpec:
        raise ModelNotFound("someone/gone", [])

    lookups, depths = HubLookups(), []
    for _ in range(4):
        with pytest.raises(ModelNotFound) as caught:
            await lookups.run("someone/gone", lookup)
        depth, frame = 0, caught.value.__traceback__
        while frame is not None:
            depth, frame = depth + 1, frame.tb_next
        depths.append(depth)
    assert depths[1] == depths[2] == depths[3], depths
