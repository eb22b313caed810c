"""Assembles the runtime: repository, data plane, HTTP, gRPC and metrics listeners, and shutdown.

``Server`` is used by ``__main__`` and by the tests (which start it on free ports on 127.0.0.1).
Start: bind every listener first (a port in use fails at once, before models load), then load the
models; the server is ready once they are (with strict readiness, only when all of them are).
With ``--split-file`` it also watches that file and forwards the canary's share of split models'
requests (forwarding.py). Model control (watcher.py): which models load at start, the repository
API's gate, and in poll mode the periodic rescan; a cloud repository is mirrored first (mirror.py).
Shutdown: report not-ready and keep serving for the drain period (load
balancers and Kubernetes endpoints stop sending meanwhile), stop listening, let in-flight requests
finish within the grace period, then unload models (calling Python models' ``finalize``) and return.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import os
import socket
import time
from pathlib import Path

import grpc

from sluice.runtime import cudart, frontend_workers, logs, names, pull, shm, tracing
from sluice.runtime.backends.base import BackendServices
from sluice.runtime.backends.triton_python_backend_utils import MetricRegistry
from sluice.runtime.batching import Clock
from sluice.runtime.callers import CallerLabels, DuplicateWindow
from sluice.runtime.dataplane import DataPlane
from sluice.runtime.errors import NotFound, SluiceError
from sluice.runtime.forwarding import Forwarder, SplitFileWatcher
from sluice.runtime.gpu_telemetry import GpuTelemetry
from sluice.runtime.metrics import Metrics, ProtocolWorkerCollector
from sluice.runtime.mirror import RepositoryMirror
from sluice.runtime.protocol.grpc import start_grpc
from sluice.runtime.protocol.grpc_h2 import GrpcServer
from sluice.runtime.protocol.http import HttpServer, Request, Response, V2Routes
from sluice.runtime.protocol.http_codec import accepted_coding, compress
from sluice.runtime.protocol.listener import (
    BACKLOG,
    UNIX_SOCKET_MODE,
    Listener,
    backlog_note,
    read_somaxconn,
    remove_unix_socket,
    unix_path_problem,
)
from sluice.runtime.repository import Repository
from sluice.runtime.settings import MODEL_CONTROL_MODES, ServerSettings
from sluice.runtime.snapshot import Change
from sluice.runtime.watcher import ModelControl, startup_models

log = logging.getLogger("sluice.runtime.server")


@dataclasses.dataclass
class Ports:
    http: int = -1
    grpc: int = -1
    metrics: int = -1


class StartupError(Exception):
    """The server cannot start (a port in use, no repository): the message is one line for the user."""


class Server:
    def __init__(
        self,
        settings: ServerSettings,
        *,
        clock: Clock | None = None,
        cuda: cudart.Provider | None = None,
        span_exporter: object = None,
    ) -> None:
        """``cuda``: where CUDA shared memory finds its runtime (tests pass a stand-in); ``span_exporter``:
        an OpenTelemetry ``SpanExporter`` to send spans to instead of OTLP (tests pass the SDK's in-memory
        exporter)."""
        self.settings = settings
        self.tracing = tracing.Tracer(settings.tracing, clock or time.monotonic_ns, span_exporter)
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
        self.control = ModelControl(
            self.repository,
            settings.model_control_mode,
            poll_s=settings.repository_poll_s,
            only=settings.models or None,
            clock=clock,
        )
        self.shared_memory = shm.Registry(cuda=cuda)  # cuda: where the CUDA runtime is looked for (None: everywhere)
        self.log_control = logs.LogControl(settings.log)
        """The logging extension's settings; ``__main__`` hands it the stderr handler to govern."""
        self.dataplane = DataPlane(
            self.repository,
            strict_readiness=settings.strict_readiness,
            server_name=settings.server_name,
            forwarder=self.forwarder,
            shared_memory=self.shared_memory,
            tracing=self.tracing,
            caller_labels=CallerLabels(settings.caller_label_limit),
            duplicates=(
                DuplicateWindow(settings.duplicate_window_s, clock or time.monotonic_ns)
                if settings.duplicate_window_s > 0
                else None
            ),
            control=self.control,
            log_control=self.log_control,
        )
        self.gpu_telemetry = GpuTelemetry(settings.gpu_metrics)
        """NVML GPU and MIG telemetry for the metrics; started with the listeners, closed on stop."""
        self.metrics = Metrics(
            self.repository.all_versions,
            self.forwarder,
            self.dataplane.caller_labels,
            model_metrics=self.backend_services.model_metrics,
            repository=self.repository,
            polls=self.control.counts,
            gpu=self.gpu_telemetry if settings.metrics_port >= 0 else None,
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
        self.workers: frontend_workers.WorkerPool | None = None
        """The protocol workers (``--protocol-workers`` >= 1), which accept on ``_worker_sockets``."""
        self._worker_sockets: dict[str, list[socket.socket]] = {}

    async def start(self) -> Ports:
        loop = asyncio.get_running_loop()
        self.backend_services.loop = loop
        self.log_control.apply()
        settings = self.settings
        self._check_model_control()
        if settings.repository_url is not None:
            try:
                self.control.mirror = RepositoryMirror(
                    settings.repository_url,
                    settings.model_repository,
                    env=settings.storage_env,
                    retries=settings.storage_retries,
                    timeout_s=settings.storage_timeout_s,
                )
            except pull.PullError as exc:
                raise StartupError(f"--model-repository: {exc}") from None
        elif not settings.model_repository.is_dir():
            raise StartupError(f"--model-repository {settings.model_repository} is not a directory")
        for flag, listed in (("--model", settings.models), ("--load-model", settings.load_models)):
            for name in listed:
                problem = names.name_problem(name) if name != "*" or flag == "--model" else None
                if problem is not None:
                    raise StartupError(f"{flag} {names.shown(name)!r}: {problem}; allowed: {names.ALLOWED}")
        try:
            self.tracing.start()
        except RuntimeError as exc:
            raise StartupError(f"--trace-config: {exc}") from None
        problem = frontend_workers.protocol_workers_problem(settings.protocol_workers)
        if problem is not None:
            raise StartupError(f"--protocol-workers {problem}")
        if settings.protocol_workers_auto is not None:
            log.info("--protocol-workers %s", settings.protocol_workers_auto)
        if settings.protocol_workers and settings.grpc_server != "h2" and settings.grpc_port >= 0:
            raise StartupError("--protocol-workers needs --grpc-server h2 (the grpcio server runs in one process)")
        try:
            await self._listen(loop)
            if settings.protocol_workers:
                await self._start_workers()
        except BaseException:
            await self._close_listeners()
            raise
        if self._split_watcher is not None:
            self._split_watcher.start()  # before any request is read: the split holds from the first one
        if settings.metrics_port >= 0:
            await asyncio.to_thread(self.gpu_telemetry.start)  # NVML's first reading, before the first scrape
        try:
            await self.control.prepare()  # a cloud repository's mirror; poll mode's first snapshot
        except pull.PullError as exc:
            await self._close_listeners()
            raise StartupError(f"--model-repository: cannot read the model repository: {exc}") from None
        except OSError as exc:
            await self._close_listeners()
            raise StartupError(f"--model-repository: cannot read the model repository: {exc.strerror or exc}") from None
        names_ = startup_models(
            settings.model_control_mode, settings.models, settings.load_models, self.repository.names_on_disk()
        )
        self.repository.expect(names_)
        results = await asyncio.gather(*(self.repository.load(name) for name in names_), return_exceptions=True)
        for name, result in zip(names_, results, strict=True):
            if isinstance(result, BaseException):
                self.failed_models[name] = result.message if isinstance(result, SluiceError) else repr(result)
        for name in names_:  # an ensemble's composing models load with it (explicit mode, or --model lists)
            if name in self.failed_models:
                continue
            try:
                await self.repository.load_steps(name, tried=names_)
            except SluiceError as exc:
                self.failed_models[name] = exc.message
        self.dataplane.set_started()
        self.control.start()
        serving = len(names_) - len(self.failed_models)
        log.info(
            "sluice serving %d of %d model(s) from %s: HTTP %s, gRPC %s, metrics %s%s",
            serving,
            len(names_),
            settings.repository_url or settings.model_repository,
            self.ports.http,
            self.ports.grpc,
            self.ports.metrics,
            "" if self.dataplane.ready() else " (NOT READY: strict readiness needs every model)",
        )
        backlog = backlog_note(BACKLOG, read_somaxconn())
        if backlog is not None:
            log.warning("%s", backlog)
        if self.failed_models:
            log.error(
                "%d model(s) failed to load: %s",
                len(self.failed_models),
                "; ".join(why for _, why in sorted(self.failed_models.items())),
            )
        return self.ports

    def _check_model_control(self) -> None:
        settings = self.settings
        if settings.model_control_mode not in MODEL_CONTROL_MODES:
            raise StartupError(
                f"--model-control-mode {settings.model_control_mode!r}: allowed values are "
                + ", ".join(MODEL_CONTROL_MODES)
            )
        if settings.load_models and settings.model_control_mode != "explicit":
            raise StartupError(
                "--load-model needs --model-control-mode explicit (in none and poll mode every model, or those "
                "named with --model, loads at start)"
            )
        if "*" in settings.load_models and len(set(settings.load_models)) > 1:
            others = ", ".join(sorted(set(settings.load_models) - {"*"}))
            raise StartupError(
                f"--load-model '*' loads every model: it cannot be combined with other --load-model names "
                f"({others}); allowed: '*' alone, or model names (Triton refuses the mix too)"
            )
        if settings.model_control_mode == "poll" and settings.repository_poll_s <= 0:
            raise StartupError(
                f"--repository-poll-secs {settings.repository_poll_s:g}: poll mode needs a positive interval"
            )

    async def poll_repository(self) -> dict[str, Change]:
        """Poll mode: scan the repository now and apply what changed (as each poll does); the changes."""
        return await self.control.poll_now()

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
                if settings.http_port >= 0 and settings.protocol_workers:
                    self.ports.http = self._worker_socket("http", settings.host, settings.http_port)
                elif settings.http_port >= 0:
                    self.ports.http = await self._http.start(settings.host, settings.http_port)
                if settings.http_uds is not None:
                    await _start_unix(self._http, settings.http_uds, "--http-uds")
            if settings.grpc_port >= 0 or settings.grpc_uds is not None:
                if settings.grpc_server == "h2":
                    self._grpc_h2 = GrpcServer(self.dataplane, settings.limits, loop)
                    if settings.grpc_port >= 0 and settings.protocol_workers:
                        self.ports.grpc = self._worker_socket("grpc", settings.host, settings.grpc_port)
                    elif settings.grpc_port >= 0:
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

    def _worker_socket(self, kind: str, host: str, port: int) -> int:
        """The listening sockets of a port the protocol workers serve, made and kept here (a port in use
        fails at once, port 0 is picked once for all workers): one per worker or one shared
        (frontend_workers.listeners_for_workers); the bound port."""
        family, kind_, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind_, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            socks = frontend_workers.listeners_for_workers(sock, self.settings.protocol_workers, BACKLOG)
        except BaseException:
            sock.close()
            raise
        sock.setblocking(False)
        self._worker_sockets[kind] = socks
        return int(sock.getsockname()[1])

    async def _start_workers(self) -> None:
        self.workers = frontend_workers.WorkerPool(
            self.settings.protocol_workers,
            self.settings,
            self.dataplane,
            None if self._http is None else self._http.route,  # type: ignore[arg-type]
            None if self._grpc_h2 is None else self._grpc_h2.service,
            self.log_control,
        )
        try:
            await self.workers.start(self._worker_sockets)
        except RuntimeError as exc:
            raise StartupError(f"--protocol-workers: {exc}") from None
        self.metrics.registry.register(ProtocolWorkerCollector(self.workers.counts))

    async def _stop_workers(self, deadline: float) -> None:
        if self.workers is not None:
            await self.workers.stop(deadline)
            self.workers = None
        for socks in self._worker_sockets.values():
            for sock in socks:
                sock.close()
        self._worker_sockets.clear()

    async def _close_listeners(self) -> None:
        await self._stop_workers(time.monotonic())
        for listener in (self._http, self._grpc_h2, self._metrics_http):
            if listener is not None:
                await listener.stop_listening()
                await listener.drain(time.monotonic())
        if self._grpc is not None:
            await self._grpc.stop(0)
        self._remove_grpc_unix()
        self.shared_memory.close()
        self.gpu_telemetry.close()

    def _remove_grpc_unix(self) -> None:
        if self._grpc_unix is not None:
            remove_unix_socket(*self._grpc_unix)
            self._grpc_unix = None

    def _metrics_route(self, request: Request) -> Response:
        path = request.path
        if path == b"/metrics":
            body, extra = self.metrics.exposition(), [(b"vary", b"accept-encoding")]
            if accepted_coding(request.headers.get(b"accept-encoding"), (b"gzip",)):  # Prometheus asks, each scrape
                body = compress(body, b"gzip")  # level 1: the least event-loop time
                extra.append((b"content-encoding", b"gzip"))
            return Response(200, body, b"text/plain; version=0.0.4; charset=utf-8", extra)
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
        # Protocol workers stop accepting and finish their requests; the engine serves them meanwhile.
        await self._stop_workers(deadline)
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
        await self.control.stop()
        if self.forwarder is not None:
            await self.forwarder.aclose()
        await self.repository.aclose(max(deadline - time.monotonic(), 0.0))  # one grace for the whole stop
        if self._metrics_http is not None:
            await self._metrics_http.stop_listening()
            await self._metrics_http.drain(time.monotonic())
        await asyncio.to_thread(self.gpu_telemetry.close)
        await self.tracing.aclose()
        self.shared_memory.close()  # regions still held by a request are unmapped when it is answered
        self.log_control.close()


async def _start_unix(listener: Listener, path: Path, flag: str) -> None:
    try:
        await listener.start_unix(path)
    except OSError as exc:
        raise StartupError(f"cannot listen on {flag} {path}: {exc.strerror or exc}") from exc
