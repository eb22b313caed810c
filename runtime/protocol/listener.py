"""What the HTTP and gRPC front ends share: listening sockets (TCP, and a Unix domain socket for a
sidecar's callers), their connections, a sweeper that expires slow and idle ones, and a graceful
stop. Subclasses say which protocol a connection speaks (``make_connection``) and what "stop taking
work" means for an open connection (``on_stop``)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
import time
from pathlib import Path
from typing import Protocol

BACKLOG = 2048
"""Connections the kernel may hold for accept() on each listening socket (capped by net.core.somaxconn)."""
SOMAXCONN = Path("/proc/sys/net/core/somaxconn")


def backlog_note(requested: int, somaxconn: int | None) -> str | None:
    """What to tell an operator when the kernel caps the listen backlog below ``requested``: a burst of
    new connections past the cap is dropped, and each client retries after its SYN timeout (~1 s: a
    p99 near one second). None when it does not (or the cap is unknown)."""
    if somaxconn is None or somaxconn >= requested:
        return None
    return (
        f"the listen backlog is {somaxconn} (net.core.somaxconn), not the {requested} Sluice asks for: "
        "connections opened in a burst past it wait ~1 s for the client's retry; raise net.core.somaxconn "
        "(the pod's securityContext.sysctls where the kubelet allows it, or the node's)"
    )


def read_somaxconn(path: Path = SOMAXCONN) -> int | None:
    """This network namespace's net.core.somaxconn; None where it cannot be read (not Linux)."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


UNIX_SOCKET_MODE = 0o660
"""Mode of the socket files: the server's user and group may connect, others may not."""
_SUN_PATH_MAX = 107  # bytes of a Unix socket path (sockaddr_un.sun_path, less its NUL)


def unix_path_problem(path: Path) -> str | None:
    """Make ``path`` ready for a listening Unix socket, or say what is wrong (one line). A socket file
    nobody listens on (left by a crash) is removed; anything else already there is left alone."""
    size = len(os.fsencode(path))
    if size > _SUN_PATH_MAX:
        return f"is {size} bytes long; a Unix socket path holds at most {_SUN_PATH_MAX}"
    directory = path.parent
    if not directory.is_dir():
        return f"directory {directory} does not exist; create it (or mount a volume there) first"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"directory {directory} is not writable by this user"
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISSOCK(mode):
        return "exists and is not a socket; remove it or pick another path"
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(os.fspath(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)  # stale: its server is gone
        return None
    except OSError as exc:
        return f"cannot be checked ({exc.strerror or exc})"
    finally:
        probe.close()
    return "is in use: another server accepts connections on it; stop it or pick another path"


def remove_unix_socket(path: Path, inode: int) -> None:
    """Remove the socket file we bound, unless something else has replaced it since."""
    try:
        if os.lstat(path).st_ino == inode:
            path.unlink()
    except FileNotFoundError:
        pass


class SweptConnection(Protocol):
    @property
    def busy(self) -> bool: ...

    def expire(self, now: float) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


ABORT_AFTER_S = 1.0
"""How long a shutdown waits for closed connections to flush before it drops them."""


class Crowding:
    """When a listener starts refusing connections at ``--max-connections`` (``limit``), and when it has room
    again: one warning when the refusing starts and one line when it ends, not a line per refused connection
    (a client that reconnects in a loop would flood the log). With protocol workers each worker has its own."""

    def __init__(self, protocol: str, logger: logging.Logger, limit: int) -> None:
        self.protocol, self._log, self.limit = protocol, logger, limit
        self.refused = 0
        """connections refused since the refusing started (0: not refusing)"""

    @property
    def refusal(self) -> str:
        """What a refused connection is told."""
        return f"too many open connections, at most {self.limit} (--max-connections)"

    def refuse(self) -> None:
        """A new connection was refused."""
        if not self.refused:
            self._log.warning("%s: %d connections are open, the most --max-connections allows: new ones are "
                              "answered with an error and closed until one closes", self.protocol, self.limit)
        self.refused += 1

    def closed(self, still_open: int) -> None:
        """A connection closed, ``still_open`` are left: once there is room again, say how many were refused."""
        if self.refused and still_open < self.limit:
            self._log.info("%s: accepting connections again; %d were refused at --max-connections %d",
                           self.protocol, self.refused, self.limit)
            self.refused = 0


class Listener:
    SWEEP_INTERVAL_S = 0.5

    def __init__(self, loop: asyncio.AbstractEventLoop, crowding: Crowding) -> None:
        self.loop = loop
        self.connections: set = set()
        self.crowding = crowding
        self.draining = False
        self._servers: list[asyncio.Server] = []
        self._unix: list[tuple[Path, int]] = []  # socket files we bound: (path, inode)
        self._sweeper: asyncio.Task | None = None

    def make_connection(self) -> asyncio.Protocol:
        raise NotImplementedError

    def on_stop(self, connection: SweptConnection) -> None:
        """Called for each open connection when the listener stops taking new work."""

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0 picks a free port); returns the bound port."""
        server = await self.loop.create_server(self.make_connection, host, port, backlog=BACKLOG)
        self._servers.append(server)
        self._start_sweeper()
        return server.sockets[0].getsockname()[1]

    async def start_socket(self, sock: socket.socket) -> None:
        """Accept on ``sock``, a listening socket made elsewhere (a protocol worker accepts on the
        engine's sockets: frontend_workers.py)."""
        server = await self.loop.create_server(self.make_connection, sock=sock, backlog=BACKLOG)
        self._servers.append(server)
        self._start_sweeper()

    async def start_unix(self, path: Path) -> None:
        """Listen on the Unix socket ``path`` as well (``unix_path_problem`` said it is usable)."""
        server = await self.loop.create_unix_server(self.make_connection, os.fspath(path), backlog=BACKLOG)
        self._servers.append(server)
        os.chmod(path, UNIX_SOCKET_MODE)
        self._unix.append((path, os.lstat(path).st_ino))
        self._start_sweeper()

    def _start_sweeper(self) -> None:
        if self._sweeper is None:
            self._sweeper = self.loop.create_task(self._sweep())

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.SWEEP_INTERVAL_S)
            now = self.loop.time()
            for conn in list(self.connections):
                conn.expire(now)

    async def stop_listening(self) -> None:
        """Refuse new connections; open ones finish what they have (see ``on_stop``)."""
        self.draining = True
        for server in self._servers:
            server.close()
        for path, inode in self._unix:
            remove_unix_socket(path, inode)
        self._unix.clear()
        for conn in list(self.connections):
            self.on_stop(conn)

    async def drain(self, deadline: float) -> None:
        """Wait until no connection has work in flight (or the monotonic deadline), then close all."""
        while any(c.busy for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            conn.close()
        # A peer that does not read keeps its transport open while the answers wait to be flushed:
        # a moment for the writes, then what is left is dropped, so a shutdown cannot hang on it.
        until = time.monotonic() + ABORT_AFTER_S
        while self.connections and time.monotonic() < until:
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            conn.abort()
        if self._sweeper is not None:
            self._sweeper.cancel()
        for server in self._servers:
            await server.wait_closed()
