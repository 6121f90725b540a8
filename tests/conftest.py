"""Shared by every test."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# The run's cache folder for ONNX exports, inherited by nested runs and the servers tests
# start; set it yourself to keep exports from one run to the next.
TEST_CACHE = "EMBER_TEST_CACHE"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked `first` run first. `./run test` spreads whole files over two
    processes in this order (pytest-xdist), so the other process runs the rest meanwhile
    and both end together instead of one running the longest test alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("first") is None)


@pytest.fixture(autouse=True)
def collectable_heap() -> Iterator[None]:
    """A model load freezes the heap (ember.heap); one test's leftovers must not stay
    frozen, uncollectable, through the rest of the suite."""
    yield
    gc.unfreeze()


@pytest.fixture(scope="session", autouse=True)
def onnx_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """ONNX exports go to a folder of this run's, shared by its test processes (writes are
    atomic), never to the user's cache: a stale graph there must not decide a test."""
    given = os.environ.get(TEST_CACHE)
    # Under pytest-xdist each process's base folder sits in the run's shared one.
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    folder = Path(given) if given else shared / "ember-cache"
    folder.mkdir(parents=True, exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(TEST_CACHE, str(folder))
        patch.setenv("EMBER_CACHE_DIR", str(folder))
        yield folder
