"""sie-sdk 0.10.1, unchanged, against a live Ember: is_query, score options, extract,
list_models and get_model, output dtypes, request ids and the SDK's typed errors.

The SDK needs Python 3.12: tests/clients/sie_client.py runs in the environment the
`sie_python` fixture builds (conftest.py); without a Python 3.12 the test skips and
says why."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.clients.conftest import (
    MINILM,
    PROMPTED,
    QUERY_PROMPT,
    SPACY,
    cosine,
    native_vectors,
)
from tests.live_server import ServerProcess

SCRIPT = Path(__file__).with_name("sie_client.py")
QUERY = "how do plants make food"
DOCS = ["Photosynthesis turns light into sugar.", "The stock market fell today."]


@pytest.fixture(scope="module")
def report(sie_python: Path, server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("sie") / "report.json"
    run = subprocess.run([str(sie_python), str(SCRIPT), server.url, str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\n{server.log_tail()}"
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_is_query_in_options_gives_the_query_vector(report: dict[str, Any],
                                                    server: ServerProcess) -> None:
    """The SDK sends `params.options.is_query`: the query prompt must be applied."""
    with_prompt = native_vectors(server, MINILM, [QUERY_PROMPT + QUERY])[0]
    assert cosine(report["query_vector"], with_prompt) > 0.999
    native_query = native_vectors(server, PROMPTED, [QUERY], is_query=True)[0]
    assert cosine(report["query_vector"], native_query) > 0.999
    assert cosine(report["query_vector"], report["document_vector"]) < 0.99


def test_batches_keep_ids_and_order(report: dict[str, Any], server: ServerProcess) -> None:
    assert report["batch_ids"] == ["a", None]
    expected = native_vectors(server, MINILM, DOCS)
    for got, want in zip(report["batch_vectors"], expected, strict=True):
        assert cosine(got, want) > 0.9999


def test_output_dtypes(report: dict[str, Any]) -> None:
    dtypes = report["dtypes"]
    assert dtypes["float32"] == {"numpy": "float32", "length": 384}
    assert dtypes["float16"] == {"numpy": "float16", "length": 384}
    assert dtypes["int8"] == {"numpy": "int8", "length": 384}
    assert dtypes["uint8"] == {"numpy": "uint8", "length": 384}
    assert dtypes["binary"] == dtypes["ubinary"] == {"numpy": "uint8", "length": 384 // 8}


def test_score_with_options(report: dict[str, Any]) -> None:
    scores = {entry["item_id"]: entry for entry in report["scores"]}
    assert scores["p"]["rank"] == 0 and scores["s"]["rank"] == 1
    assert scores["p"]["score"] > scores["s"]["score"]
    assert report["score_truncated"] == 1


@pytest.mark.parametrize("case, param", [("score_too_long", "items[0].text"),
                                         ("encode_too_long", "items[0].text")])
def test_truncate_false_is_the_sdks_input_too_long_error(report: dict[str, Any], case: str,
                                                         param: str) -> None:
    error = report[case]
    assert error["class"] == "InputTooLongError", error
    assert (error["status"], error["code"], error["param"]) == (400, "INPUT_TOO_LONG", param)


def test_refusals_carry_codes_and_fields(report: dict[str, Any]) -> None:
    instruction = report["score_instruction"]
    assert (instruction["status"], instruction["code"], instruction["param"]) == (
        422, "INVALID_REQUEST", "instruction")
    unknown = report["unknown_option"]
    assert (unknown["status"], unknown["code"], unknown["param"]) == (
        422, "INVALID_REQUEST", "params.options.profile")
    assert "unknown field" in unknown["message"]
    missing = report["unknown_model"]
    assert (missing["status"], missing["code"]) == (404, "MODEL_NOT_FOUND")
    assert MINILM in missing["message"]  # it names the models there are
    wrong = report["wrong_task"]
    assert (wrong["status"], wrong["code"]) == (422, "UNSUPPORTED_TASK")
    assert report["get_unknown_model"]["status"] == 404


def test_extract(report: dict[str, Any]) -> None:
    [item] = report["entities"]
    assert item["id"] == "e"
    found = {(e["text"], e["label"]) for e in item["entities"]}
    assert ("Barack Obama", "PERSON") in found and ("Paris", "GPE") in found
    assert all(0 <= e["start"] < e["end"] for e in item["entities"])


def test_list_models_and_get_model(report: dict[str, Any]) -> None:
    models = report["models"]
    assert {MINILM, PROMPTED, SPACY} <= set(models)
    assert models[MINILM] == {"dims": {"dense": 384}, "loaded": True, "outputs": ["dense"]}
    info = report["get_model"]
    assert info["name"] == info["id"] == MINILM
    assert info["dims"] == {"dense": 384} and info["max_sequence_length"] == 256
    assert info["state"] == "loaded" and info["inputs"] == ["text"]


def test_request_id_reaches_the_sdk(report: dict[str, Any]) -> None:
    request_id = report["request_id"]
    assert isinstance(request_id, str) and len(request_id) >= 16


def test_get_requests_with_a_msgpack_content_type(server: ServerProcess) -> None:
    """The SDK sends its msgpack Content-Type on GETs too; a GET has no body to read."""
    headers = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}
    for path in ("/healthz", "/readyz", "/v1/models", f"/v1/models/{MINILM}"):
        response = httpx.get(server.url + path, headers=headers, timeout=30)
        assert response.status_code == 200, (path, response.text)
