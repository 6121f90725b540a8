"""Logging set-up shared by every process of `ember serve`."""

from __future__ import annotations

import logging

from ember.config import ServerSettings


def configure_logging(settings: ServerSettings) -> None:
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(processName)s %(name)s: "
                        "%(message)s")
