"""Logging set-up shared by every process of `ember serve`, and the access log.

`--log-format json` writes one JSON object a line (time, level, logger, process,
message, and the access log's fields by name) for log shippers. Then every line on
stderr is JSON: progress bars (transformers', huggingface_hub's) are turned off, the
libraries' own log handlers give way to Ember's, and whatever else writes to the
process's stderr (a C++ library, a stray print) is caught at the file descriptor and
written as a JSON line of the `stderr` logger."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar, Token
from typing import IO, Any

import orjson
import setproctitle

from ember.config import ServerSettings

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"
access = logging.getLogger("ember.access")
# The request whose task writes a line (set by the HTTP middleware). With its task: a task
# started during a request (a model's load, its worker) inherits the variable, and must
# not name that request in every line it writes after.
REQUEST_ID: ContextVar[tuple[asyncio.Task[Any] | None, str] | None] = ContextVar(
    "ember_request_id", default=None)


def handling(request_id: str) -> Token[tuple[asyncio.Task[Any] | None, str] | None]:
    """Name `request_id` in the lines the current task writes (reset with the token)."""
    return REQUEST_ID.set((asyncio.current_task(), request_id))


def request_id_now() -> str | None:
    """The request the current task handles, if any."""
    value = REQUEST_ID.get()
    if value is None:
        return None
    try:
        task = asyncio.current_task()
    except RuntimeError:  # a thread without a loop
        return None
    return value[1] if task is value[0] else None


def outside_requests(write: Callable[..., None], *args: object) -> None:
    """A line about the process, never a request's: a signal's handler runs inside
    whichever request's task the signal met, and would name that request."""
    contextvars.Context().run(write, *args)


class RequestIdFilter(logging.Filter):
    """A line written while a request is handled names it (a field in JSON, at the end of
    a text line), so an error joins its request's access line, which names it itself."""

    def __init__(self, json_lines: bool) -> None:
        super().__init__()
        self.json_lines = json_lines

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = request_id_now()
        if request_id is None or record.name == access.name:
            return True
        if self.json_lines:
            record.fields = {**getattr(record, "fields", {}), "request_id": request_id}
        else:  # a client's id may hold "%", and the message is formatted with its args
            suffix = f" request_id={request_id}"
            record.msg = f"{record.msg}{suffix.replace('%', '%%') if record.args else suffix}"
        return True


class TextFormatter(logging.Formatter):
    """A record's message on its own line: a newline in it (a library's error text, a
    client's input quoted in one) is written as `\\n`, so no event spans lines without
    a time (a traceback still follows on its own lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name,
            "process": record.processName, "message": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


def name_process(role: str) -> None:
    """`ember: <role>` in ps and top, so an operator (or a benchmark) tells the processes
    of one server apart."""
    setproctitle.setproctitle(f"ember: {role}")


# Libraries that install a stderr handler of their own; their records go through Ember's.
LIBRARY_LOGGERS = ("transformers", "huggingface_hub", "sentence_transformers")
# Readiness probes answer 503 until the default model is loaded: that is their job, not
# a server fault, so it is logged at info.
PROBES = frozenset({"/readyz", "/health"})
_captured: list[int] = []  # the stderr this process writes JSON to, once captured


def configure_logging(settings: ServerSettings) -> None:
    json_lines = settings.log_format == "json"
    # No progress bars in a server's log: downloads log their own progress lines, and a
    # load's bar is noise. Set before the libraries are imported; children inherit it.
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    _no_progress_bars()
    if json_lines:
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
        stream = capture_stderr()
    else:
        stream = sys.stderr
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if json_lines else TextFormatter(TEXT_FORMAT))
    handler.addFilter(RequestIdFilter(json_lines))
    logging.basicConfig(level=settings.log_level.upper(), handlers=[handler], force=True)
    logging.captureWarnings(True)  # warnings.warn(...) becomes a record of py.warnings
    for name in LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        library.handlers.clear()
        library.propagate = True
    if json_lines:
        _quiet_libraries()


def _no_progress_bars() -> None:
    """Progress bars off in libraries already imported (those imported later read
    HF_HUB_DISABLE_PROGRESS_BARS)."""
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils.tqdm import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]


def _quiet_libraries() -> None:
    """Handlers routed through ours, in libraries already imported."""
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_default_handler()
        transformers_logging.enable_propagation()


def capture_stderr() -> IO[str]:
    """Point file descriptor 2 at a pipe whose lines are written, as JSON, to the stderr
    the process had; return a stream on that original stderr for Ember's own handler.
    Lines that are JSON already (a child process's) pass through unchanged."""
    if _captured:
        return os.fdopen(os.dup(_captured[0]), "w", buffering=1, encoding="utf-8")
    sys.stderr.flush()
    original = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    _captured.append(original)
    sys.stderr = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8",
                           errors="replace")
    out = os.fdopen(os.dup(original), "w", buffering=1, encoding="utf-8")
    threading.Thread(target=_relay, args=(read_end, out), name="ember-stderr",
                     daemon=True).start()
    return os.fdopen(os.dup(original), "w", buffering=1, encoding="utf-8")


def _relay(read_end: int, out: IO[str]) -> None:
    formatter = JsonFormatter()
    with os.fdopen(read_end, "rb") as pipe:
        for raw in pipe:
            for piece in raw.decode("utf-8", "replace").replace("\r", "\n").split("\n"):
                text = piece.strip()
                if not text:
                    continue
                if text.startswith("{") and text.endswith("}"):
                    with contextlib.suppress(orjson.JSONDecodeError):
                        orjson.loads(text)
                        out.write(text + "\n")
                        continue
                record = logging.LogRecord("stderr", logging.INFO, __file__, 0, text, None,
                                           None)
                out.write(formatter.format(record) + "\n")


def access_log(method: str, path: str, route: str, model: str, status: int, items: int,
               queue_ms: float, inference_ms: float, total_ms: float,
               request_id: str, client: tuple[str, int] | None,
               error: str | None = None, param: str | None = None,
               draining: bool = False) -> None:
    """One line per request at info (warning for a server fault): refusals included, with
    their error type and field. `client` is the ASGI scope's peer (behind a proxy of
    --forwarded-allow-ips, the one in its X-Forwarded-For), None where the server does not
    know it. A 503 while `draining` is the operator's stop at work, not a fault."""
    level = logging.WARNING if status >= 500 and not (
        status == 503 and (draining or path in PROBES)) else logging.INFO
    if not access.isEnabledFor(level):
        return
    fields = {"method": method, "path": path, "route": route, "model": model or None,
              "status": status, "items": items, "queue_ms": round(queue_ms, 2),
              "inference_ms": round(inference_ms, 2), "total_ms": round(total_ms, 2),
              "request_id": request_id, "client": peer(client)}
    refused = ""
    if error is not None:
        fields.update(error=error, param=param)
        refused = f" error={token(error)}" + (f" param={token(param)}" if param else "")
    # The path and model are the client's, percent-decoded: a space must not start a
    # field of the client's making (a newline is the formatter's to escape, as in any line).
    access.log(level, "%s %s %d model=%s items=%d queue_ms=%.1f inference_ms=%.1f "
               "total_ms=%.1f request_id=%s client=%s%s", method, token(path), status,
               token(model or "-"), items, queue_ms, inference_ms, total_ms, request_id,
               fields["client"], refused, extra={"fields": fields})


def peer(address: tuple[str, int | None] | None) -> str:
    """An ASGI scope's `client` as one token: host:port, [v6 host]:port, the host alone
    where the port is unknown (0 or None: an X-Forwarded-For address has none), or "-"."""
    if not address:
        return "-"
    host, port = address
    if not port:
        return host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def token(text: str) -> str:
    """`text` as one field of a text line: its spaces written as %20."""
    return text.replace(" ", "%20")


def printable(text: str) -> str:
    """`text` with each unprintable character (newlines, NUL, other controls) written as
    its Python escape, so that it stays on its line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
