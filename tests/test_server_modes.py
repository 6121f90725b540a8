"""The end-to-end and reliability suites once more, against `ember serve --workers 2`:
the multi-process server must pass what one process passes."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.live_server import REPO, TEST_WORKERS

SUITES = ["tests/api/test_server_e2e.py", "tests/reliability"]

# The suite's longest test (about 2 minutes): tests/conftest.py runs it first.
pytestmark = pytest.mark.first


def test_the_server_suites_pass_against_api_processes() -> None:
    """Every server those suites start gets `--workers 2` (tests/live_server.py reads
    EMBER_TEST_WORKERS), less the tests marked own_mode or one_mode (pyproject.toml says
    why each is left out). One pytest process: this one shares the machine already."""
    env = {**os.environ, TEST_WORKERS: "2"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "-p", "no:xdist", "-m", "not own_mode and not one_mode",
                             *SUITES],
                            capture_output=True, text=True, env=env, cwd=REPO, timeout=1500)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert re.search(r"\d+ passed", summary) and "failed" not in summary, summary
