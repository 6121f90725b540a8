"""schemathesis over the real server's OpenAPI document, every operation, positive and
negative generation: no 5xx, no crash, each refusal a 4xx with the documented error body.

Bounded: EMBER_FUZZ_EXAMPLES (default 25) examples per operation and mode, derandomized
(the same cases every run), no shrinking. Model routes run on the synthetic TEST model
(encode, score) and spaCy (extract); a third pass lets schemathesis pick the model name.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import Case, GenerationMode

from tests.reliability.support import (
    SPACY,
    SYNTH,
    Record,
    ServerProcess,
    check_error_body,
)

# The schema's validation is the same app in every API process, and what passes it to the
# engine crosses the wire in the rerun's end-to-end and hand-made bad-input tests: fuzzing
# it once keeps the suite within its time.
pytestmark = pytest.mark.one_mode

EXAMPLES = int(os.environ.get("EMBER_FUZZ_EXAMPLES", "25"))
# Every operation the app documents; a new route fails test_every_operation_is_fuzzed
# until it is listed here.
OPERATIONS = [
    ("POST", "/v1/encode/{model}"), ("POST", "/v1/score/{model}"),
    ("POST", "/v1/extract/{model}"), ("POST", "/v1/embeddings"), ("POST", "/v1/rerank"),
    ("POST", "/embed"), ("POST", "/"), ("POST", "/rerank"), ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/v1/models"), ("GET", "/metrics"),
    ("POST", "/v2/embed"), ("POST", "/v2/rerank"), ("POST", "/similarity"),
    ("GET", "/health"), ("GET", "/info"), ("GET", "/v1/models/{model}"),
    ("POST", "/embed_sparse"), ("POST", "/tokenize"), ("POST", "/decode"),
    ("POST", "/v1/embed"),
]
MODEL_FOR = {"/v1/encode/{model}": SYNTH, "/v1/score/{model}": SYNTH,
             "/v1/models/{model}": SYNTH,
             "/v1/extract/{model}": SPACY}


@pytest.fixture(scope="module")
def api_schema(input_server: ServerProcess) -> Any:
    return schemathesis.openapi.from_url(f"{input_server.url}/openapi.json")


@pytest.fixture(scope="module")
def fuzzed() -> Iterator[dict[str, Any]]:
    yield {}


def test_every_operation_is_fuzzed(api_schema: Any) -> None:
    documented = {(op.ok().method.upper(), op.ok().path) for op in
                  api_schema.get_all_operations()}
    assert documented == set(OPERATIONS)


def check_response(case: Case[Any], status: int, content_type: str, content: bytes) -> None:
    where = f"{case.method} {case.formatted_path} -> {status}: {content[:300]!r}"
    assert status < 500, where
    if status >= 400:
        try:
            check_error_body(content_type, content)
        except AssertionError as exc:
            raise AssertionError(f"{where}: {exc}") from None


def fuzz(operation: Any, mode: GenerationMode, url: str, path_parameters: dict[str, str] | None,
         seen: Counter[int]) -> int:
    """Run up to EXAMPLES generated cases; returns how many ran."""
    ran = 0

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    @given(case=operation.as_strategy(generation_mode=mode, path_parameters=path_parameters))
    def run(case: Case[Any]) -> None:
        nonlocal ran
        response = case.call(base_url=url, timeout=60)
        ran += 1
        seen[response.status_code] += 1
        content_type = response.headers.get("content-type", [""])
        check_response(case, response.status_code,
                       content_type[0] if isinstance(content_type, list) else content_type,
                       response.content)

    try:
        run()
    except Unsatisfiable:
        # An operation without parameters or body has no invalid form to generate.
        assert mode == GenerationMode.NEGATIVE and ran == 0
    return ran


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_fuzz_operation(method: str, path: str, api_schema: Any, input_server: ServerProcess,
                        fuzzed: dict[str, Any]) -> None:
    operation = api_schema[path][method]
    passes: list[tuple[str, GenerationMode, dict[str, str] | None]] = [
        ("positive", GenerationMode.POSITIVE, None), ("negative", GenerationMode.NEGATIVE, None)]
    if path in MODEL_FOR:
        fixed = {"model": MODEL_FOR[path]}
        passes = [("positive", GenerationMode.POSITIVE, fixed),
                  ("negative", GenerationMode.NEGATIVE, fixed),
                  ("any-model", GenerationMode.POSITIVE, None)]
    seen: Counter[int] = Counter()
    started = time.monotonic()
    counts = {name: fuzz(operation, mode, input_server.url, params, seen)
              for name, mode, params in passes}
    fuzzed[f"{method} {path}"] = {"examples": counts, "statuses": dict(sorted(seen.items())),
                                  "seconds": round(time.monotonic() - started, 1)}
    assert input_server.alive()
    with httpx.Client() as client:
        assert client.get(f"{input_server.url}/healthz").status_code == 200


def test_fuzz_figures(fuzzed: dict[str, Any], input_server: ServerProcess,
                      figures: Record) -> None:
    total = sum(sum(entry["examples"].values()) for entry in fuzzed.values())
    statuses: Counter[str] = Counter()
    for entry in fuzzed.values():
        statuses.update({str(k): v for k, v in entry["statuses"].items()})
    figures("schemathesis", {"schemathesis": schemathesis.__version__,
                             "examples_per_operation_and_mode": EXAMPLES,
                             "operations": len(fuzzed), "requests": total,
                             "statuses": dict(sorted(statuses.items())),
                             "per_operation": fuzzed, "server_alive": input_server.alive()})
    assert input_server.alive()
    assert "Traceback" not in input_server.log_text()
