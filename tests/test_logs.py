"""Logging: JSON-only stderr under --log-format json, and the access log's levels."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from ember.logs import access_log, peer
from tests.live_server import REPO, server_env

WRITERS = """
import logging, os, sys, warnings
from ember.config import ServerSettings
from ember.logs import configure_logging
configure_logging(ServerSettings(log_format="json"))
logging.getLogger("ember.test").info("from ember")
print("a stray print", file=sys.stderr)
os.write(2, b"a C library writes\\r50%|#####     |\\rdone\\n")
warnings.warn("a library warns")
logging.getLogger("transformers.modeling_utils").warning("from transformers")
from transformers.utils import logging as transformers_logging
transformers_logging.get_logger("transformers.x").warning("after its import")
sys.stderr.flush()
import time; time.sleep(0.3)  # the relay writes what the pipe holds
"""


def test_every_line_on_stderr_is_json_whoever_writes_it() -> None:
    result = subprocess.run([sys.executable, "-c", WRITERS], capture_output=True, text=True,
                            env=server_env(), cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # fails on any line that is not JSON
    messages = [r["message"] for r in records]
    for expected in ("from ember", "a stray print", "a C library writes", "done",
                     "from transformers", "after its import"):
        assert any(expected in m for m in messages), (expected, messages)
    assert any("a library warns" in m for m in messages)


BARS = """
from huggingface_hub.utils import are_progress_bars_disabled
from ember.config import ServerSettings
from ember.logs import configure_logging
configure_logging(ServerSettings(log_format="text"))
from transformers.utils import logging as transformers_logging
print(are_progress_bars_disabled(), transformers_logging.is_progress_bar_enabled())
"""


def test_text_logs_have_no_progress_bars() -> None:
    """Found by a fresh-clone walkthrough: transformers' "Loading weights" bar in the log
    of a first load (the JSON log had none already)."""
    env = {k: v for k, v in server_env().items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    result = subprocess.run([sys.executable, "-c", BARS], capture_output=True, text=True,
                            env=env, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False"]


@pytest.mark.parametrize(("path", "status", "draining", "level"), [
    ("/readyz", 503, False, logging.INFO), ("/health", 503, False, logging.INFO),
    ("/readyz", 500, False, logging.WARNING), ("/v1/encode/x", 503, False, logging.WARNING),
    ("/v1/encode/x", 200, False, logging.INFO),
    # An operator's review: a drain wrote each refusal of new work as a warning.
    ("/v1/encode/x", 503, True, logging.INFO), ("/v1/encode/x", 500, True, logging.WARNING)])
def test_a_probes_503_while_loading_or_a_drains_is_not_a_warning(
        caplog: pytest.LogCaptureFixture, path: str, status: int, draining: bool,
        level: int) -> None:
    with caplog.at_level(logging.INFO, logger="ember.access"):
        access_log("GET", path, path, "", status, 0, 0.0, 0.0, 1.0, "r1", None,
                   draining=draining)
    assert [r.levelno for r in caplog.records] == [level]


def test_the_peer_is_one_token_whatever_its_address() -> None:
    assert peer(("10.0.0.7", 51234)) == "10.0.0.7:51234"
    assert peer(("::1", 8080)) == "[::1]:8080"
    assert peer(None) == "-"
    # Behind a proxy the address comes from X-Forwarded-For, without a port: a review
    # found `client=203.0.113.7:0`.
    assert peer(("203.0.113.7", 0)) == "203.0.113.7"
    assert peer(("2001:db8::7", None)) == "2001:db8::7"


@pytest.mark.parametrize("json_lines", [False, True])
async def test_a_line_written_for_a_request_names_it(json_lines: bool) -> None:
    """Found by a black-box review: "inference failed" lines named no request, so they
    could not be joined to their access lines. A task started meanwhile (a model's load,
    its worker) is not the request's: its lines do not name it (found by a code review)."""
    import asyncio
    import io

    from ember.logs import (
        REQUEST_ID,
        JsonFormatter,
        RequestIdFilter,
        handling,
        outside_requests,
    )

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if json_lines else logging.Formatter("%(message)s"))
    handler.addFilter(RequestIdFilter(json_lines))
    logger = logging.getLogger("ember.test.request-id")
    logger.addHandler(handler)
    logger.propagate = False
    go_on = asyncio.Event()

    async def started_meanwhile() -> None:
        await go_on.wait()
        logger.error("a worker's line")

    try:
        token = handling("id-50%")
        try:
            worker = asyncio.create_task(started_meanwhile())
            logger.error("inference failed: %s", "boom")
            logger.error("no arguments, 100%")
            # A signal's handler runs inside whichever task the signal met (found by an
            # operator's review: the drain's line named a random request).
            outside_requests(logger.error, "SIGTERM: draining, %d requests in flight", 7)
        finally:
            REQUEST_ID.reset(token)
        logger.error("outside any request")
        go_on.set()
        await worker
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
    lines = stream.getvalue().splitlines()
    if json_lines:
        records = [json.loads(line) for line in lines]
        assert [r.get("request_id") for r in records] == ["id-50%", "id-50%", None, None,
                                                          None]
        assert records[0]["message"] == "inference failed: boom"
    else:
        assert lines == ["inference failed: boom request_id=id-50%",
                         "no arguments, 100% request_id=id-50%",
                         "SIGTERM: draining, 7 requests in flight", "outside any request",
                         "a worker's line"]


def test_a_text_line_holds_one_event_whatever_its_message() -> None:
    """Found by a review: a load failure whose library error held newlines wrote five
    lines, four of them without a time; a traceback still follows on lines of its own."""
    import io

    from ember.logs import TEXT_FORMAT, TextFormatter

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(TextFormatter(TEXT_FORMAT))
    logger = logging.getLogger("ember.test.one-line")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.error("model %s failed to load: %s", "m", "first\nsecond\r\nthird")
        try:
            raise ValueError("inside")
        except ValueError:
            logger.exception("with its traceback")
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
    first, *rest = stream.getvalue().splitlines()
    assert first.endswith("model m failed to load: first\\nsecond\\r\\nthird")
    assert rest[0].endswith("with its traceback") and rest[1].startswith("Traceback")
