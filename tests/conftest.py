"""Shared by every test."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def collectable_heap() -> Iterator[None]:
    """A model load freezes the heap (ember.heap); one test's leftovers must not stay
    frozen, uncollectable, through the rest of the suite."""
    yield
    gc.unfreeze()
