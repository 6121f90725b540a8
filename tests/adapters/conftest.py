"""Adapters driven the way the API drives them: task methods submitting to a real worker."""

from __future__ import annotations

import pytest

from tests.adapters.serving import ServeFactory, serving


@pytest.fixture
def serve() -> ServeFactory:
    return serving
