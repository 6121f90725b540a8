"""uvicorn server with Ember's graceful drain on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from types import FrameType

import uvicorn

from ember.api.state import ServerState

log = logging.getLogger("ember")


class DrainingServer(uvicorn.Server):
    """The first signal drains: /readyz and new requests answer 503, accepted requests
    finish, the workers drain, then the process exits 0. A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.state.draining:
            log.warning("second signal: exiting now")
            os._exit(1)
        self.state.draining = True
        log.info("%s: draining, %d requests in flight", signal.Signals(sig).name,
                 self.state.in_flight)
        if self._loop is None:
            self.should_exit = True
        else:
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await self.state.wait_idle()
        await self.state.registry.close()
        log.info("drained in %.2f s; exiting", loop.time() - started)
        self.should_exit = True
