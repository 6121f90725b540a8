#!/usr/bin/env python
"""`ember serve` (one process) with granian in place of uvicorn, for bench/frontend.py's
`granian` variant: the same settings, catalog, registry and ASGI app; only the HTTP
server differs. A benchmark harness, not a way to run Ember.

    python bench/granian_serve.py --port 8000 --default-model ember/synthetic
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import uvloop
from granian.constants import Interfaces
from granian.server.embed import Server

from ember.api.app import create_app
from ember.cli import build_parser, settings_from
from ember.config import load_catalog
from ember.logs import configure_logging
from ember.registry import Registry


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    settings = settings_from(args)
    configure_logging(settings)
    catalog = load_catalog(settings.model_dirs, settings.model_paths)
    app = create_app(settings, Registry.serving(settings, catalog))
    server = Server(app, address=settings.host, port=settings.port,
                    interface=Interfaces.ASGI, log_enabled=False)
    uvloop.run(server.serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
