"""The layers import what they need and no more: the Ray deployments never load ZeroMQ or
the engine process's module, the HTTP app never loads the ZeroMQ client, and the engine
process's metrics live outside the HTTP package."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.live_server import REPO, server_env


def loaded_after(*modules: str) -> set[str]:
    """The modules loaded by a fresh interpreter that imports `modules`."""
    probe = (f"import sys, {', '.join(modules)}; "
             "print('\\n'.join(sorted(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", probe], env=server_env(), cwd=REPO,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return set(result.stdout.split())


def test_the_ray_deployments_load_no_zeromq() -> None:
    pytest.importorskip("ray")
    loaded = loaded_after("ember.cluster.engine", "ember.cluster.ingress",
                          "ember.cluster.client")
    assert "ember.ipc.calls" in loaded and "ember.ipc.models" in loaded
    assert not {"zmq", "ember.ipc.engine", "ember.ipc.client"} & loaded


def test_the_http_app_loads_no_ipc_client_and_metrics_leave_the_api_package() -> None:
    loaded = loaded_after("ember.api.app", "ember.server")
    assert not {"zmq", "ember.ipc.client", "ember.ipc.engine"} & loaded
    assert "ember.metrics" in loaded and "ember.api.metrics" not in loaded
