"""sie-sdk 0.10.1, unchanged, against a live Ember: is_query, score options, extract,
list_models and get_model, output dtypes, request ids and the SDK's typed errors.

The SDK needs Python 3.12: tests/clients/sie_client.py runs in the environment the
`sie_python` fixture builds (conftest.py); without a Python 3.12 the test skips and
says why."""

from __future__ import annotations

import base64
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.clients.conftest import (
    M3,
    MINILM,
    PROMPTED,
    QUERY_PROMPT,
    SPACY,
    cosine,
    native_vectors,
)
from tests.live_server import ServerProcess, start_server

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


def test_an_m3_models_three_outputs_read_as_the_native_route_gives_them(
        report: dict[str, Any], server: ServerProcess) -> None:
    response = httpx.post(f"{server.url}/v1/encode/{M3}", timeout=60, json={
        "items": [{"text": t} for t in DOCS],
        "params": {"output_types": ["dense", "sparse", "multivector"]}})
    assert response.status_code == 200, response.text
    for got, native in zip(report["m3"], response.json()["items"], strict=True):
        np.testing.assert_allclose(got["dense"], native["dense"]["values"], atol=1e-6)
        assert got["sparse"]["indices"] == native["sparse"]["indices"]
        np.testing.assert_allclose(got["sparse"]["values"], native["sparse"]["values"],
                                   atol=1e-6)
        assert np.array(got["multivector"]).shape == (native["multivector"]["num_tokens"],
                                                      native["multivector"]["token_dims"])
        np.testing.assert_allclose(got["multivector"], native["multivector"]["values"],
                                   atol=1e-6)


def test_an_m3_models_score_weights_travel_in_the_sdks_options(
        report: dict[str, Any], server: ServerProcess) -> None:
    weights = {"dense": 0.4, "sparse": 0.2, "multivector": 0.4}
    pairs = {"query": {"text": QUERY}, "items": [{"id": "p", "text": DOCS[0]},
                                                 {"id": "s", "text": DOCS[1]}]}
    native = httpx.post(f"{server.url}/v1/score/{M3}", timeout=60,
                        json={**pairs, "params": {"options": {"score_weights": weights}}})
    dense = httpx.post(f"{server.url}/v1/score/{M3}", timeout=60, json=pairs)
    assert native.status_code == 200 and dense.status_code == 200, native.text
    got = {s["item_id"]: s["score"] for s in report["m3_scores"]}
    assert got == pytest.approx({s["item_id"]: s["score"] for s in native.json()["scores"]},
                                abs=1e-6)
    assert got != pytest.approx({s["item_id"]: s["score"] for s in dense.json()["scores"]},
                                abs=1e-6)


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


# -- images: sie-sdk's image items against a tiny CLIP model --------------------------------

IMAGES_SCRIPT = Path(__file__).with_name("sie_images.py")
CLIP = "test/tiny-clip"


@pytest.fixture(scope="module")
def image_report(sie_python: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[dict[str, Any], ServerProcess, Path]]:
    """A server of its own (two API processes and the engine) whose default model is a
    tiny CLIP (random weights), and what the SDK's image calls got from it."""
    from tests.adapters.tiny_clip import build_clip, clip_yaml

    root = tmp_path_factory.mktemp("sie-images")
    model = build_clip(root / "clip")
    (root / "catalog").mkdir()
    (root / "catalog" / "clip.yaml").write_text(clip_yaml(CLIP, model), encoding="utf-8")
    images = root / "images"
    images.mkdir()
    for seed in range(2):
        pixels = np.random.default_rng(seed).integers(0, 256, (30 + seed * 10, 40, 3),
                                                      np.uint8)
        Image.fromarray(pixels).save(images / f"{seed}.png")
    # Two API processes: images are decoded there, and their pixels cross the IPC.
    process = start_server(root / "server.log", ["--model-dir", str(root / "catalog"),
                                                 "--default-model", CLIP, "--workers", "2"])
    try:
        out = root / "report.json"
        run = subprocess.run([str(sie_python), str(IMAGES_SCRIPT), process.url, CLIP,
                              str(images), str(out)], capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\n{process.log_tail()}"
        yield json.loads(out.read_text()), process, images
    finally:
        assert process.stop() == 0, process.log_tail()


def native_images(server: ServerProcess, images: list[bytes]) -> np.ndarray:
    items = [{"images": [{"data": base64.b64encode(data).decode()}]} for data in images]
    response = httpx.post(f"{server.url}/v1/encode/{CLIP}", json={"items": items}, timeout=60)
    assert response.status_code == 200, response.text
    return np.array([item["dense"]["values"] for item in response.json()["items"]])


def test_sdk_image_items_encode_as_the_native_route_does(
        image_report: tuple[dict[str, Any], ServerProcess, Path]) -> None:
    report, server, images = image_report
    assert report["ids"] == ["p", None, "t"]
    pngs = [(images / f"{i}.png").read_bytes() for i in range(2)]
    for got, want in zip(report["vectors"][:2], native_images(server, pngs), strict=True):
        assert cosine(got, want) > 0.9999
    text = native_vectors(server, CLIP, ["a cat on a tree"])[0]
    assert cosine(report["vectors"][2], text) > 0.9999
    jpeg = base64.b64decode(report["pil_jpeg"])  # what the SDK made of the PIL image
    assert cosine(report["pil_vector"], native_images(server, [jpeg])[0]) > 0.9999


def test_sdk_scores_image_items(image_report: tuple[dict[str, Any], ServerProcess, Path]
                                ) -> None:
    scores = image_report[0]["scores"]
    assert scores[0]["item_id"] == "same" and scores[0]["score"] == pytest.approx(1, abs=1e-5)
    assert {s["item_id"] for s in scores} == {"same", "other", "text"}


def test_sdk_surfaces_a_bad_image_as_a_request_error(
        image_report: tuple[dict[str, Any], ServerProcess, Path]) -> None:
    assert image_report[0]["truncated"] == {"status": 422, "param": "items[0].images[0].data"}
