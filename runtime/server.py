"""Assembles the runtime: repository, data plane, HTTP, gRPC and metrics listeners, and shutdown.

``Server`` is used by ``__main__`` and by the tests (which start it on free ports on 127.0.0.1).
Start: bind every listener first (a port in use fails at once, before models load), then load the
models; the server is ready once they are (with strict readiness, only when all of them are).
With ``--split-file`` it also watches that file and forwards the canary's share of split models'
requests (forwarding.py). Shutdown: report not-ready and keep serving for the drain period (load
balancers and Kubernetes endpoints stop sending meanwhile), stop listening, let in-flight requests
finish within the grace period, then unload models (calling Python models' ``finalize``) and return.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import os
import time
from pathlib import Path

import grpc

from sluice.runtime import logs, names, shm
from sluice.runtime.backends.base import BackendServices
from sluice.runtime.backends.triton_python_backend_utils import MetricRegistry
from sluice.runtime.batching import Clock
from sluice.runtime.callers import CallerLabels, DuplicateWindow
from sluice.runtime.dataplane import DataPlane
from sluice.runtime.errors import NotFound, SluiceError
from sluice.runtime.forwarding import Forwarder, SplitFileWatcher
from sluice.runtime.metrics import Metrics
from sluice.runtime.protocol.grpc import start_grpc
from sluice.runtime.protocol.grpc_h2 import GrpcServer
from sluice.runtime.protocol.http import HttpServer, Request, Response, V2Routes
from sluice.runtime.protocol.listener import UNIX_SOCKET_MODE, Listener, remove_unix_socket, unix_path_problem
from sluice.runtime.repository import Repository
from sluice.runtime.settings import ServerSettings

log = logging.getLogger("sluice.runtime.server")


@dataclasses.dataclass
class Ports:
    http: int = -1
    grpc: int = -1
    metrics: int = -1


class StartupError(Exception):
    """The server cannot start (a port in use, no repository): the message is one line for the user."""


class Server:
    def __init__(self, settings: ServerSettings, *, clock: Clock | None = None) -> None:
        self.settings = settings
        # What backends borrow from the server: BLS dispatch (the data plane fills it in), the loop
        # (start), the registry of Python models' custom metrics (exported beside Sluice's).
        self.backend_services = BackendServices(
            model_metrics=MetricRegistry(), auto_complete_config=settings.auto_complete_config
        )
        self.repository = Repository(
            settings.model_repository,
            settings.scheduling,
            grace_s=settings.shutdown_grace_s,
            clock=clock,
            services=self.backend_services,
        )
        self.forwarder: Forwarder | None = None
        self._split_watcher: SplitFileWatcher | None = None
        if settings.split_file is not None:
            self.forwarder = Forwarder()
            self._split_watcher = SplitFileWatcher(settings.split_file, self.forwarder.table, clock)
        self.shared_memory = shm.Registry()
        self.log_control = logs.LogControl(settings.log)
        """The logging extension's settings; ``__main__`` hands it the stderr handler to govern."""
        self.dataplane = DataPlane(
            self.repository,
            strict_readiness=settings.strict_readiness,
            server_name=settings.server_name,
            forwarder=self.forwarder,
            shared_memory=self.shared_memory,
            caller_labels=CallerLabels(settings.caller_label_limit),
            duplicates=(
                DuplicateWindow(settings.duplicate_window_s, clock or time.monotonic_ns)
                if settings.duplicate_window_s > 0
                else None
            ),
            log_control=self.log_control,
        )
        self.metrics = Metrics(
            self.repository.all_versions,
            self.forwarder,
            self.dataplane.caller_labels,
            model_metrics=self.backend_services.model_metrics,
        )
        self.ports = Ports()
        self.failed_models: dict[str, str] = {}
        self._http: HttpServer | None = None
        self._metrics_http: HttpServer | None = None
        self._grpc: grpc.aio.Server | None = None
        self._grpc_h2: GrpcServer | None = None
        self._grpc_unix: tuple[Path, int] | None = None  # the grpcio server's socket file: (path, inode)
        self._stopped = asyncio.Event()
        self._drain_cut = asyncio.Event()

    async def start(self) -> Ports:
        loop = asyncio.get_running_loop()
        self.backend_services.loop = loop
        self.log_control.apply()
        settings = self.settings
        if not settings.model_repository.is_dir():
            raise StartupError(f"--model-repository {settings.model_repository} is not a directory")
        for name in settings.models:
            problem = names.name_problem(name)
            if problem is not None:
                raise StartupError(f"--model {names.shown(name)!r}: {problem}; allowed: {names.ALLOWED}")
        try:
            await self._listen(loop)
        except BaseException:
            await self._close_listeners()
            raise
        if self._split_watcher is not None:
            self._split_watcher.start()  # before any request is read: the split holds from the first one
        names_ = list(settings.models) or self.repository.names_on_disk()
        self.repository.expect(names_)
        results = await asyncio.gather(*(self.repository.load(name) for name in names_), return_exceptions=True)
        for name, result in zip(names_, results, strict=True):
            if isinstance(result, BaseException):
                self.failed_models[name] = result.message if isinstance(result, SluiceError) else repr(result)
        self.dataplane.set_started()
        serving = len(names_) - len(self.failed_models)
        log.info(
            "sluice serving %d of %d model(s) from %s: HTTP %s, gRPC %s, metrics %s%s",
            serving,
            len(names_),
            settings.model_repository,
            self.ports.http,
            self.ports.grpc,
            self.ports.metrics,
            "" if self.dataplane.ready() else " (NOT READY: strict readiness needs every model)",
        )
        if self.failed_models:
            log.error(
                "%d model(s) failed to load: %s",
                len(self.failed_models),
                "; ".join(why for _, why in sorted(self.failed_models.items())),
            )
        return self.ports

    async def _listen(self, loop: asyncio.AbstractEventLoop) -> None:
        settings = self.settings
        for flag, path in (("--http-uds", settings.http_uds), ("--grpc-uds", settings.grpc_uds)):
            if path is not None:
                problem = unix_path_problem(path)
                if problem is not None:
                    raise StartupError(f"{flag} {path}: {problem}")
        try:
            if settings.http_port >= 0 or settings.http_uds is not None:
                self._http = HttpServer(V2Routes(self.dataplane, settings.limits), settings.limits, loop)
                if settings.http_port >= 0:
                    self.ports.http = await self._http.start(settings.host, settings.http_port)
                if settings.http_uds is not None:
                    await _start_unix(self._http, settings.http_uds, "--http-uds")
            if settings.grpc_port >= 0 or settings.grpc_uds is not None:
                if settings.grpc_server == "h2":
                    self._grpc_h2 = GrpcServer(self.dataplane, settings.limits, loop)
                    if settings.grpc_port >= 0:
                        self.ports.grpc = await self._grpc_h2.start(settings.host, settings.grpc_port)
                    if settings.grpc_uds is not None:
                        await _start_unix(self._grpc_h2, settings.grpc_uds, "--grpc-uds")
                elif settings.grpc_server == "grpcio":
                    uds = None if settings.grpc_uds is None else os.fspath(settings.grpc_uds)
                    self._grpc, self.ports.grpc = await start_grpc(
                        self.dataplane, settings.limits, settings.host, settings.grpc_port, uds
                    )
                    if settings.grpc_uds is not None:
                        os.chmod(settings.grpc_uds, UNIX_SOCKET_MODE)
                        self._grpc_unix = (settings.grpc_uds, os.lstat(settings.grpc_uds).st_ino)
                else:
                    raise StartupError(f"--grpc-server {settings.grpc_server!r}: allowed values are h2, grpcio")
            if settings.metrics_port >= 0:
                self._metrics_http = HttpServer(self._metrics_route, settings.limits, loop)
                self.ports.metrics = await self._metrics_http.start(
                    settings.metrics_host or settings.host, settings.metrics_port
                )
        except OSError as exc:
            ports = {"HTTP": settings.http_port, "gRPC": settings.grpc_port, "metrics": settings.metrics_port}
            which = ", ".join(f"{k} {v}" for k, v in ports.items() if v > 0)
            if exc.errno == errno.EADDRINUSE:
                raise StartupError(
                    f"cannot listen on {settings.host}: a port is already in use ({which}); "
                    "stop the other server or pick other ports (--http-port, --grpc-port, --metrics-port; 0 picks "
                    "a free one, -1 disables)"
                ) from exc
            raise StartupError(f"cannot listen on {settings.host} ({which}): {exc.strerror or exc}") from exc

    async def _close_listeners(self) -> None:
        for listener in (self._http, self._grpc_h2, self._metrics_http):
            if listener is not None:
                await listener.stop_listening()
                await listener.drain(time.monotonic())
        if self._grpc is not None:
            await self._grpc.stop(0)
        self._remove_grpc_unix()
        self.shared_memory.close()

    def _remove_grpc_unix(self) -> None:
        if self._grpc_unix is not None:
            remove_unix_socket(*self._grpc_unix)
            self._grpc_unix = None

    def _metrics_route(self, request: Request) -> Response:
        path = request.path
        if path == b"/metrics":
            return Response(200, self.metrics.exposition(), b"text/plain; version=0.0.4; charset=utf-8")
        # Health here too: probes reach it where the inference listeners are loopback-only (a sidecar).
        if path == b"/v2/health/live":
            return Response(200 if self.dataplane.live() else 503)
        if path == b"/v2/health/ready":
            return Response(200 if self.dataplane.ready() else 503)
        raise NotFound("this listener serves /metrics, /v2/health/live and /v2/health/ready")

    def cut_drain(self) -> None:
        """End the drain period of a ``stop`` in progress now (a second signal)."""
        self._drain_cut.set()

    async def stop(self, grace_s: float | None = None, drain_s: float = 0.0) -> None:
        """Graceful stop; safe to call twice. Not ready at once; for ``drain_s`` seconds everything
        is still served (clients are steered away meanwhile), then listeners close and in-flight
        requests get ``grace_s`` (default: the settings' grace) to finish."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.dataplane.drain()
        if drain_s > 0:
            log.info("draining for %g s: not ready, still serving", drain_s)
            try:
                await asyncio.wait_for(self._drain_cut.wait(), drain_s)
            except TimeoutError:
                pass
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        deadline = time.monotonic() + grace
        if self._http is not None:
            await self._http.stop_listening()
        if self._grpc_h2 is not None:
            await self._grpc_h2.stop_listening()  # GOAWAY: open calls go on, new ones go elsewhere
        grpc_stop = self._grpc.stop(grace) if self._grpc is not None else None
        self._remove_grpc_unix()
        # Requests already accepted keep their place; new ones are refused from here on.
        if self._http is not None:
            await self._http.drain(deadline)
        if self._grpc_h2 is not None:
            await self._grpc_h2.drain(deadline)
        if grpc_stop is not None:
            await grpc_stop
        self.dataplane.stop_accepting()
        if self._split_watcher is not None:
            self._split_watcher.stop()
        if self.forwarder is not None:
            await self.forwarder.aclose()
        await self.repository.aclose(max(deadline - time.monotonic(), 0.0))  # one grace for the whole stop
        if self._metrics_http is not None:
            await self._metrics_http.stop_listening()
            await self._metrics_http.drain(time.monotonic())
        self.shared_memory.close()  # regions still held by a request are unmapped when it is answered
        self.log_control.close()


async def _start_unix(listener: Listener, path: Path, flag: str) -> None:
    try:
        await listener.start_unix(path)
    except OSError as exc:
        raise StartupError(f"cannot listen on {flag} {path}: {exc.strerror or exc}") from exc
