"""Logging set-up shared by every process of `ember serve`, and the access log.

`--log-format json` writes one JSON object a line (time, level, logger, process,
message, and the access log's fields by name) for log shippers."""

from __future__ import annotations

import logging
import time

import orjson
import setproctitle

from ember.config import ServerSettings

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"
access = logging.getLogger("ember.access")


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


def configure_logging(settings: ServerSettings) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if settings.log_format == "json"
                         else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=settings.log_level.upper(), handlers=[handler], force=True)


def access_log(method: str, path: str, route: str, model: str, status: int, items: int,
               queue_ms: float, inference_ms: float, total_ms: float,
               request_id: str) -> None:
    """One line per request at info (warning for a server fault): refusals included."""
    level = logging.WARNING if status >= 500 else logging.INFO
    if not access.isEnabledFor(level):
        return
    fields = {"method": method, "path": path, "route": route, "model": model or None,
              "status": status, "items": items, "queue_ms": round(queue_ms, 2),
              "inference_ms": round(inference_ms, 2), "total_ms": round(total_ms, 2),
              "request_id": request_id}
    access.log(level, "%s %s %d model=%s items=%d queue_ms=%.1f inference_ms=%.1f "
               "total_ms=%.1f request_id=%s", method, path, status, model or "-", items,
               queue_ms, inference_ms, total_ms, request_id, extra={"fields": fields})
