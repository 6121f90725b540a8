"""What every route reaches through `request.app.state.ember`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fastapi import Request

from ember.api.metrics import Metrics
from ember.config import ServerSettings
from ember.registry import Registry


@dataclass
class ServerState:
    settings: ServerSettings
    registry: Registry
    metrics: Metrics
    draining: bool = False
    in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def enter(self) -> None:
        self.in_flight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()

    async def wait_idle(self) -> None:
        """Until every accepted HTTP request has had its response."""
        if self.in_flight:
            await self.idle.wait()


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.ember
    return state
