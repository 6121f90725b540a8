"""Adapters driven the way the API drives them: task methods submitting to a real worker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.adapters.serving import ServeFactory, serving


@pytest.fixture
def serve() -> ServeFactory:
    return serving


@pytest.fixture(scope="session", autouse=True)
def onnx_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A cache folder of this session's own, so ONNX exports here start from nothing
    and leave the user's cache alone."""
    folder = tmp_path_factory.mktemp("ember-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EMBER_CACHE_DIR", str(folder))
        yield folder
