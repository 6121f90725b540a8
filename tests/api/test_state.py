"""The server's own state as API processes of one server read it from their engine."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from pathlib import Path

from ember.adapters.base import Runtime
from ember.api.state import ServerState
from ember.config import ServerSettings, load_catalog
from ember.engine import WorkerConfig
from ember.ipc.client import EngineClient
from ember.ipc.models import RemoteModels
from ember.metrics import Metrics
from tests.ipc.test_engine_process import start_engine, stop

SLOW_LOAD = "test/slow-load"
MODEL = f"""
name: {SLOW_LOAD}
description: synthetic test model whose weights take 0.6 s to load (not a real model)
adapter: synthetic
tasks: [encode]
options: {{dims: 8, load_ms: 600}}
"""


def api_process_state(settings: ServerSettings, address: str, name: str) -> ServerState:
    """What one API process of a server of several holds: its own view of the engine."""
    models = RemoteModels(load_catalog(settings.model_dirs), Runtime.from_settings(settings),
                          EngineClient(address, name), worker=WorkerConfig(max_queue_items=8))
    return ServerState(settings, models, Metrics())


async def test_a_not_loaded_read_earlier_is_read_again_before_saying_not_ready(
        tmp_path: Path) -> None:
    """Found in CI: one API process answered /readyz 200, the next 503 from a status read
    less than a second before, when the default model was still loading."""
    address, engine = start_engine(tmp_path, MODEL)  # it loads its default model at once
    settings = ServerSettings(default_model=SLOW_LOAD, model_dirs=(tmp_path,))
    first, second = (api_process_state(settings, address, f"api-{i}") for i in range(2))
    try:
        assert await second.unready() == (
            "not_ready", f"default model {SLOW_LOAD!r} is not loaded (state: loading)")
        read_at = asyncio.get_running_loop().time()
        deadline = time.monotonic() + 30
        while first.registry.state(SLOW_LOAD) != "loaded":
            assert time.monotonic() < deadline, "the engine did not load the model"
            assert await first.fresh_status()
            await asyncio.sleep(0.02)
        assert await first.unready() is None
        # The second's "loading" is still recent enough to be answered from, unread again:
        assert asyncio.get_running_loop().time() - read_at < 1.0
        assert await second.unready() is None
    finally:
        for state in (first, second):
            await state.registry.close()
        stop(engine)


async def test_a_status_read_that_fails_after_its_callers_gave_up_is_not_logged(
        tmp_path: Path) -> None:
    """Found by a fault-injection review: with the engine stopped (SIGSTOP), each API
    process logged "Task exception was never retrieved" with a traceback once the status
    read that /readyz had stopped waiting for failed."""
    address, engine = start_engine(tmp_path, MODEL)
    settings = ServerSettings(default_model=SLOW_LOAD, model_dirs=(tmp_path,))
    state = api_process_state(settings, address, "api-0")
    loop = asyncio.get_running_loop()
    logged: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: logged.append(context))
    assert engine.pid is not None
    try:
        assert await state.fresh_status()
        os.kill(engine.pid, signal.SIGSTOP)
        state.status_at = float("-inf")
        assert not await state.recent_status()  # it gave up; the read goes on alone
        state.registry.client.engine_gone("the engine is gone")  # type: ignore[attr-defined]
        await asyncio.sleep(0.05)
        state._refreshing = None  # the failed read is dropped, as the next one replaces it
        gc.collect()
        assert logged == []
    finally:
        loop.set_exception_handler(None)
        os.kill(engine.pid, signal.SIGCONT)
        await state.registry.close()
        stop(engine)
