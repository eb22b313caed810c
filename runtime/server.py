"""Assembles the runtime: repository, data plane, HTTP, gRPC and metrics listeners, and shutdown.

``Server`` is used by ``__main__`` and by the tests (which start it on free ports on 127.0.0.1).
Shutdown: stop listening and report not-ready, let in-flight requests finish within the grace
period, then unload models (calling Python models' ``finalize``) and return.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import grpc

from sluice.runtime.dataplane import DataPlane
from sluice.runtime.errors import NotFound, SluiceError
from sluice.runtime.metrics import Metrics
from sluice.runtime.protocol.grpc import start_grpc
from sluice.runtime.protocol.grpc_h2 import GrpcServer
from sluice.runtime.protocol.http import HttpServer, Request, Response, V2Routes
from sluice.runtime.repository import Repository
from sluice.runtime.settings import ServerSettings

log = logging.getLogger("sluice.runtime.server")


@dataclasses.dataclass
class Ports:
    http: int = -1
    grpc: int = -1
    metrics: int = -1


class Server:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.repository = Repository(settings.model_repository, settings.scheduling, grace_s=settings.shutdown_grace_s)
        self.dataplane = DataPlane(self.repository)
        self.metrics = Metrics(self.repository.all_versions)
        self.ports = Ports()
        self.failed_models: dict[str, str] = {}
        self._http: HttpServer | None = None
        self._metrics_http: HttpServer | None = None
        self._grpc: grpc.aio.Server | None = None
        self._grpc_h2: GrpcServer | None = None
        self._stopped = asyncio.Event()

    async def start(self) -> Ports:
        loop = asyncio.get_running_loop()
        settings = self.settings
        if not settings.model_repository.is_dir():
            raise SystemExit(f"--model-repository {settings.model_repository} is not a directory")
        names = list(settings.models) or self.repository.names_on_disk()
        results = await asyncio.gather(*(self.repository.load(name) for name in names), return_exceptions=True)
        for name, result in zip(names, results, strict=True):
            if isinstance(result, BaseException):
                message = result.message if isinstance(result, SluiceError) else repr(result)
                self.failed_models[name] = message
        if settings.http_port >= 0:
            self._http = HttpServer(V2Routes(self.dataplane, settings.limits), settings.limits, loop)
            self.ports.http = await self._http.start(settings.host, settings.http_port)
        if settings.grpc_port >= 0:
            if settings.grpc_server == "h2":
                self._grpc_h2 = GrpcServer(self.dataplane, settings.limits, loop)
                self.ports.grpc = await self._grpc_h2.start(settings.host, settings.grpc_port)
            elif settings.grpc_server == "grpcio":
                self._grpc, self.ports.grpc = await start_grpc(
                    self.dataplane, settings.limits, settings.host, settings.grpc_port
                )
            else:
                raise SystemExit(f"--grpc-server {settings.grpc_server!r}: allowed values are h2, grpcio")
        if settings.metrics_port >= 0:
            self._metrics_http = HttpServer(self._metrics_route, settings.limits, loop)
            self.ports.metrics = await self._metrics_http.start(settings.host, settings.metrics_port)
        self.dataplane.set_ready(not (settings.strict_readiness and settings.models and self.failed_models))
        log.info(
            "sluice serving %d model(s) from %s: HTTP %s, gRPC %s, metrics %s",
            len(self.repository.all_versions()),
            settings.model_repository,
            self.ports.http,
            self.ports.grpc,
            self.ports.metrics,
        )
        return self.ports

    def _metrics_route(self, request: Request) -> Response:
        if request.path != b"/metrics":
            raise NotFound("metrics are served at /metrics")
        return Response(200, self.metrics.exposition(), b"text/plain; version=0.0.4; charset=utf-8")

    async def stop(self, grace_s: float | None = None) -> None:
        """Graceful stop; safe to call twice."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        deadline = time.monotonic() + grace
        self.dataplane.set_ready(False)
        if self._http is not None:
            await self._http.stop_listening()
        if self._grpc_h2 is not None:
            await self._grpc_h2.stop_listening()  # GOAWAY: open calls go on, new ones go elsewhere
        grpc_stop = self._grpc.stop(grace) if self._grpc is not None else None
        # Requests already accepted keep their place; new ones are refused from here on.
        if self._http is not None:
            await self._http.drain(deadline)
        if self._grpc_h2 is not None:
            await self._grpc_h2.drain(deadline)
        if grpc_stop is not None:
            await grpc_stop
        self.dataplane.stop_accepting()
        await self.repository.aclose(max(deadline - time.monotonic(), 0.0))  # one grace for the whole stop
        if self._metrics_http is not None:
            await self._metrics_http.stop_listening()
            await self._metrics_http.drain(time.monotonic())
