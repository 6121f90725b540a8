"""Fixtures of the HTTP tests: in-process apps behind httpx's ASGI transport, and one real
uvicorn process (`ember serve`) for the end-to-end paths.

Every async test under tests/api runs in one session-wide event loop, so apps whose models
take seconds to load (the real all-MiniLM-L6-v2) load once and are shared; tests that change
an app's state (pausing a worker, draining, an API key) build their own small app.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from ember.adapters.base import ModelAdapter, Runtime
from ember.adapters.synthetic import SyntheticModel
from ember.api.app import create_app
from ember.api.state import ServerState
from ember.config import DEFAULT_MODEL, ModelSpec, ServerSettings, load_catalog
from ember.engine import ModelWorker, WorkerConfig
from ember.registry import LoadFunction, Registry, RegistryLimits, adapter_loader
from tests.engine.helpers import PausableWorker, wait_for
from tests.live_server import ServerProcess, start_server

SYNTH = "ember/synthetic"  # the catalog's test model: deterministic vectors, no weights
MINILM = DEFAULT_MODEL
SPACY = "spacy/en_core_web_sm"
SLOW = "test/slow-synthetic"  # 300 ms forwards, one item each: for drain tests
BUSY = "test/busy-synthetic"  # 50 ms forwards: concurrent requests pile up behind one
BROKEN = "test/broken"  # a transformer whose weights directory holds no model
# Beside the YAML files, made by whoever writes them (a missing one is refused at start).
BROKEN_DIR = "secret-weights/minilm"

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]

MODEL_YAMLS = {
    "slow.yaml": f"""
name: {SLOW}
description: synthetic test model with slow forwards (not a real model)
adapter: synthetic
tasks: [encode, score]
options: {{dims: 16, overhead_ms: 300, per_token_us: 0}}
batching: {{max_batch_items: 1}}
""",
    "busy.yaml": f"""
name: {BUSY}
description: synthetic test model, 50 ms per forward (not a real model)
adapter: synthetic
tasks: [encode, score]
options: {{dims: 16, overhead_ms: 50, per_token_us: 0}}
""",
    "broken.yaml": f"""
name: {BROKEN}
description: a model whose folder holds no model files
adapter: transformer
source: {{path: {BROKEN_DIR}}}
tasks: [encode]
""",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Async tests of this folder share the session's event loop (and its loaded apps)."""
    here = HERE.parent
    for item in items:
        if pytest_asyncio.is_async_test(item) and here in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.asyncio(loop_scope="session"), append=False)


# -- helpers --------------------------------------------------------------------------


def assert_error(response: httpx.Response, status: int, kind: str | None = None,
                 param: str | None = None) -> dict[str, Any]:
    """The response is the documented error body with this status; returns the error object."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) <= {"type", "message", "param", "code"}, error
    assert error["code"] == error["type"].upper(), error  # SIE's dialect of the type
    assert isinstance(error["type"], str) and error["type"]
    assert isinstance(error["message"], str) and error["message"]
    if kind is not None:
        assert error["type"] == kind, error
    if param is not None:
        assert error.get("param") == param, error
    for leak in ("Traceback", 'File "', ".py\"", "site-packages"):
        assert leak not in error["message"], error
    return dict(error)


def vectors(body: dict[str, Any]) -> list[list[float]]:
    """The dense vectors of a native encode response."""
    return [item["dense"]["values"] for item in body["items"]]


def encode_body(*texts: str, **params: Any) -> dict[str, Any]:
    return {"items": [{"text": t} for t in texts], "params": params}


# -- in-process apps ------------------------------------------------------------------


@dataclass
class Served:
    """An app with its lifespan running and an httpx client on its ASGI transport."""

    app: Any
    registry: Registry
    client: httpx.AsyncClient
    settings: ServerSettings

    @property
    def state(self) -> ServerState:
        state: ServerState = self.app.state.ember
        return state

    def worker(self, name: str = SYNTH) -> ModelWorker:
        return self.registry.loaded[name].worker

    def synthetic(self, name: str = SYNTH) -> SyntheticModel:
        adapter = self.registry.loaded[name].adapter
        assert isinstance(adapter, SyntheticModel)
        return adapter

    async def metrics(self) -> str:
        response = await self.client.get("/metrics")
        assert response.status_code == 200
        return response.text


def make_registry(settings: ServerSettings,
                  loader: Callable[[str], LoadFunction] = adapter_loader) -> Registry:
    """The registry `ember serve` builds for these settings."""
    return Registry(load_catalog(settings.model_dirs, settings.model_paths),
                    Runtime(settings.device, settings.torch_threads), settings.worker,
                    RegistryLimits(settings.max_loaded_models), loader=loader,
                    worker=PausableWorker)


def gated_loader(gate: threading.Event) -> Callable[[str], LoadFunction]:
    """Model loads that wait for `gate` (so a test sees the server before it is ready)."""

    def loader(family: str) -> LoadFunction:
        load = adapter_loader(family)

        def gated(spec: ModelSpec, runtime: Runtime) -> ModelAdapter:
            if not gate.wait(30):
                raise TimeoutError("the test never opened the load gate")
            return load(spec, runtime)

        return gated

    return loader


@asynccontextmanager
async def serving(settings: ServerSettings, *, wait: bool = True,
                  headers: dict[str, str] | None = None,
                  loader: Callable[[str], LoadFunction] = adapter_loader
                  ) -> AsyncIterator[Served]:
    """Run the app's lifespan (the default model and preloads load in the background);
    with `wait`, return once they are loaded."""
    registry = make_registry(settings, loader)
    app = create_app(settings, registry)
    async with app.router.lifespan_context(app):
        if wait:
            for name in dict.fromkeys([settings.default_model, *settings.preload]):
                await registry.get(name)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost",
                                     headers=headers, timeout=60) as client:
            yield Served(app, registry, client, settings)


@dataclass
class AppFactory:
    """`settings(**changes)`: small settings on the synthetic model with the test catalog."""

    model_dir: Path
    base: ServerSettings = field(init=False)

    def __post_init__(self) -> None:
        self.base = ServerSettings(default_model=SYNTH, model_dirs=(self.model_dir,))

    def settings(self, **changes: Any) -> ServerSettings:
        return replace(self.base, **changes)

    def serve(self, wait: bool = True, headers: dict[str, str] | None = None,
              loader: Callable[[str], LoadFunction] = adapter_loader,
              **changes: Any) -> Any:
        return serving(self.settings(**changes), wait=wait, headers=headers, loader=loader)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("models")
    for name, text in MODEL_YAMLS.items():
        (folder / name).write_text(text, encoding="utf-8")
    (folder / BROKEN_DIR).mkdir(parents=True)
    return folder


@pytest.fixture(scope="session")
def apps(model_dir: Path) -> AppFactory:
    return AppFactory(model_dir)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def shared(apps: AppFactory) -> AsyncIterator[Served]:
    """One app for read-only tests: default model synthetic, the real all-MiniLM-L6-v2
    preloaded, spaCy loaded on first use. Tests must not change its state."""
    async with apps.serve(preload=(MINILM,), worker=WorkerConfig(idle_coalesce_ms=1.0)) as served:
        yield served


@pytest_asyncio.fixture(loop_scope="session")
async def synthetic_app(apps: AppFactory) -> AsyncIterator[Served]:
    """A fresh app of its own on the synthetic model (for tests that change state)."""
    async with apps.serve() as served:
        yield served


# -- one real server process ------------------------------------------------------------


@pytest.fixture(scope="session")
def live_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[ServerProcess]:
    """The real server on the real default model, plus the synthetic ones; stopped with
    SIGTERM at the end of the session, which must exit 0."""
    log = tmp_path_factory.mktemp("live") / "server.log"
    server = start_server(log, ["--model-dir", str(model_dir), "--preload", SYNTH,
                                "--max-items-per-request", "64"])
    yield server
    code = server.stop()
    assert code == 0, f"server exited {code} after SIGTERM\n{server.log_tail()}"


async def fill_queue(served: Served) -> asyncio.Task[httpx.Response]:
    """The synthetic model's worker paused with a request of two texts queued (a full queue
    where max_queue_items is 2); that request's task, answered once the worker resumes."""
    worker = served.worker()
    worker.pause()
    first = asyncio.create_task(served.client.post(f"/v1/encode/{SYNTH}",
                                                   json=encode_body("a", "b")))
    await wait_for(lambda: worker.pending_items == 2)
    return first
