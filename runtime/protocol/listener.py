"""What the HTTP and gRPC front ends share: a listening socket, its connections, a sweeper that
expires slow and idle ones, and a graceful stop. Subclasses say which protocol a connection speaks
(``make_connection``) and what "stop taking work" means for an open connection (``on_stop``)."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class SweptConnection(Protocol):
    @property
    def busy(self) -> bool: ...

    def expire(self, now: float) -> None: ...

    def close(self) -> None: ...


class Listener:
    SWEEP_INTERVAL_S = 0.5

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.connections: set = set()
        self.draining = False
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task | None = None

    def make_connection(self) -> asyncio.Protocol:
        raise NotImplementedError

    def on_stop(self, connection: SweptConnection) -> None:
        """Called for each open connection when the listener stops taking new work."""

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0 picks a free port); returns the bound port."""
        self._server = await self.loop.create_server(self.make_connection, host, port, backlog=2048)
        self._sweeper = self.loop.create_task(self._sweep())
        return self._server.sockets[0].getsockname()[1]

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.SWEEP_INTERVAL_S)
            now = self.loop.time()
            for conn in list(self.connections):
                conn.expire(now)

    async def stop_listening(self) -> None:
        """Refuse new connections; open ones finish what they have (see ``on_stop``)."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            self.on_stop(conn)

    async def drain(self, deadline: float) -> None:
        """Wait until no connection has work in flight (or the monotonic deadline), then close all."""
        while any(c.busy for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            conn.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            await self._server.wait_closed()
