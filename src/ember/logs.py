"""Logging set-up shared by every process of `ember serve`."""

from __future__ import annotations

import logging

import setproctitle

from ember.config import ServerSettings


def name_process(role: str) -> None:
    """`ember: <role>` in ps and top, so an operator (or a benchmark) tells the processes
    of one server apart."""
    setproctitle.setproctitle(f"ember: {role}")


def configure_logging(settings: ServerSettings) -> None:
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(processName)s %(name)s: "
                        "%(message)s")
