"""Shared by every test."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


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
