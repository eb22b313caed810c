"""Protocol worker processes (``sluice serve --protocol-workers N``): a front end that uses every core.

The main process, the *engine*, loads the repository and runs the data plane (schedulers and
batchers, response cache, statistics, metrics, model control) as in single-process mode. It also
makes the HTTP and gRPC listening sockets and hands them to N worker processes (:class:`WorkerPool`),
each running the ordinary HTTP and gRPC front ends. On Linux with two workers or more each worker
accepts on a listening socket of its own, all bound to the port with ``SO_REUSEPORT``
(:func:`listeners_for_workers`): the kernel spreads new connections over the workers by a hash of their
addresses. Elsewhere the workers share one socket and the kernel gives each new connection to
whichever worker accepts first. A worker decodes
inference requests itself (the CPU that binds one process) and sends each to the engine over its own
socketpair (:class:`Link`, messages of worker_wire.py), so requests from every connection meet in the engine's
one batcher per model. Responses come back the same way and the worker encodes them.

Everything else a worker receives it forwards whole to the engine, which answers it with its own
front ends' routes (:class:`EngineSide`): HTTP requests other than JSON/binary inference (health,
metadata, config, statistics, repository, shared memory, trace, logging, and raw binary inference),
and every gRPC method but ``ModelInfer`` (``ModelStreamInfer`` included, message by message). The
answers are therefore those of single-process mode by construction.

A client that goes away, or a gRPC deadline, cancels the request in the engine (a ``cancel``
message). SIGTERM: the engine drains as before, then tells the workers to stop; each stops accepting,
lets its in-flight requests finish and exits, and then the engine stops. A worker that dies is
restarted (logged). Workers die with the engine: ``PR_SET_PDEATHSIG``, and a worker exits when its
link closes.

Called by server.py (the engine side) and run as ``python -m sluice.runtime.frontend_workers`` (the
worker side; started only by :class:`WorkerPool`).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import dataclasses
import gc
import itertools
import logging
import math
import mmap
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

from sluice.runtime import host_memory, logs, tracing, worker_wire
from sluice.runtime.dataplane import DataPlane, awaited
from sluice.runtime.errors import Internal, SluiceError
from sluice.runtime.protocol import grpc_service
from sluice.runtime.protocol.grpc_h2 import GrpcServer
from sluice.runtime.protocol.grpc_service import Call, Method, Service
from sluice.runtime.protocol.http import (
    DEFERRED,
    Connection,
    HttpServer,
    Request,
    Response,
    V2Routes,
    _model_path,
    answer_of,
    error_response,
    json_response,
)
from sluice.runtime.settings import LogSettings, ServerSettings
from sluice.runtime.types import CancelToken, InferRequest, InferResponse

log = logging.getLogger("sluice.runtime.workers")

MAX_PROTOCOL_WORKERS = 64
ARENA_BYTES = 32 * 1024 * 1024
"""Each worker has two shared-memory arenas of this size (requests' large inputs, responses' large
outputs); tensors that do not fit go in the frame."""
START_TIMEOUT_S = 60.0
WORKER_HEADER = b"sluice-worker"
"""Response header naming the protocol worker (its index) that served an HTTP request."""


def own_listeners(workers: int, platform: str = sys.platform) -> bool:
    """Whether each protocol worker accepts on a listening socket of its own (``SO_REUSEPORT``, the kernel
    spreading new connections over them by a hash of their addresses) rather than all on one shared
    socket, where whichever worker wakes first takes a whole burst (libuv accepts until the backlog is
    empty) and keeps those connections. Only Linux balances ``SO_REUSEPORT`` listeners (BSD and macOS
    give every connection to one of them); one worker has nothing to spread over."""
    return workers >= 2 and platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


def listeners_for_workers(sock: socket.socket, workers: int, backlog: int) -> list[socket.socket]:
    """The listening sockets of a port the workers serve: ``sock`` (bound, not listening) and, where
    :func:`own_listeners`, one more per worker beyond the first, all in one ``SO_REUSEPORT`` group;
    worker *i* accepts on socket *i*. The engine makes and keeps them all, listening from the start:

    * ``sock`` is bound without ``SO_REUSEPORT`` and given it after the bind, so the start fails when
      anything has the port already (another server's ``SO_REUSEPORT`` listeners included), and the
      port is never held by a bound socket that does not listen (which would not keep a foreign
      ``SO_REUSEADDR`` socket off it); the same port asked for twice (HTTP and gRPC) fails too;
    * a socket outlives the worker using it: connections that arrive while a worker restarts wait in
      its backlog for the next one, and the drain closes them all at once (server.py).

    A kernel that refuses the group (logged) gets one shared socket."""
    if own_listeners(workers):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.listen(backlog)
        extra: list[socket.socket] = []
        try:
            for _ in range(workers - 1):
                extra.append(_reuse_port_socket(sock))
                extra[-1].bind(sock.getsockname())
                extra[-1].listen(backlog)
        except OSError as exc:
            for other in extra:
                other.close()
            log.warning("SO_REUSEPORT not usable here (%s): the protocol workers share one listening socket", exc)
            return [sock]
        return [sock, *extra]
    sock.listen(backlog)
    return [sock]


def _reuse_port_socket(like: socket.socket) -> socket.socket:
    sock = socket.socket(like.family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if like.family == socket.AF_INET6:
            v6only = like.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, v6only)
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def protocol_workers_problem(value: object) -> str | None:
    """Why ``value`` is not a valid ``--protocol-workers`` (None when it is)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"must be an integer from 0 to {MAX_PROTOCOL_WORKERS}, got {value!r}"
    if not 0 <= value <= MAX_PROTOCOL_WORKERS:
        return f"must be from 0 (no workers: one process decodes every request) to {MAX_PROTOCOL_WORKERS}, got {value}"
    return None


AUTO_MAX_WORKERS = 8
"""``--protocol-workers auto`` starts at most this many: on the H100 machine (16 cores) 8 workers fed
ResNet-50 with the instances busy ~87 % of the time, and the encoder gained nothing from 4 to 16
(docs/performance.md)."""


def auto_protocol_workers(cpus: float) -> int:
    """``--protocol-workers auto``: a core for the engine (batchers, the link) and one for the models'
    threads, the rest for workers, up to AUTO_MAX_WORKERS; 0 (one process) below 4 usable CPUs,
    where a worker would take a core from the engine or the models."""
    count = math.floor(cpus + 1e-9) - 2
    return 0 if count < 2 else min(count, AUTO_MAX_WORKERS)


def cgroup_cpu_limit(cpu_max: str | None, quota_us: str | None = None, period_us: str | None = None) -> float | None:
    """The CPUs a cgroup's quota allows (a Kubernetes CPU limit), from cgroup v2's ``cpu.max``
    ("200000 100000": 2 CPUs; "max 100000": none) or v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``
    (-1: none); None when there is no limit or the text is not one."""
    try:
        if cpu_max is not None:
            quota, _, period = cpu_max.strip().partition(" ")
            if quota == "max":
                return None
            value, per = int(quota), int(period or 100000)
        elif quota_us is not None and period_us is not None:
            value, per = int(quota_us), int(period_us)
        else:
            return None
    except ValueError:
        return None
    return value / per if value > 0 and per > 0 else None


def usable_cpus() -> tuple[float, str]:
    """The CPUs this process may use (its affinity, and its cgroup's quota when lower), and how that
    was found, for the log."""
    affinity = len(os.sched_getaffinity(0))

    def read(path: str) -> str | None:
        try:
            with open(path) as file:
                return file.read()
        except OSError:
            return None

    limit = cgroup_cpu_limit(read("/sys/fs/cgroup/cpu.max"))
    if limit is None:
        limit = cgroup_cpu_limit(
            None, read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), read("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
        )
    if limit is not None and limit < affinity:
        return limit, f"the cgroup's CPU quota ({limit:g}; {affinity} CPUs in the affinity mask)"
    return float(affinity), f"{affinity} CPUs in the affinity mask" + (
        "" if limit is None else f" (cgroup quota {limit:g})"
    )


def restart_delay(lifetime_s: float) -> float:
    """How long to wait before restarting a worker that ran ``lifetime_s``: at once unless it died
    young (a crash at start would otherwise spin)."""
    return 0.0 if lifetime_s >= 5.0 else 1.0


# -- the link: framed messages over a socketpair ------------------------------------------------------


class Link(asyncio.Protocol):
    """One end of a worker's socketpair. Frames go out coalesced: one write per loop turn. A frame
    that cannot be decoded closes the link (the engine then restarts the worker)."""

    def __init__(
        self, on_message: Callable[[Any], None], on_lost: Callable[[], None], framer: worker_wire.Framer
    ) -> None:
        self._on_message = on_message
        self._on_lost = on_lost
        self._framer = framer
        self._transport: asyncio.Transport | None = None
        self._out: list[Any] = []
        self._loop = asyncio.get_running_loop()
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            messages = self._framer.feed(data)
        except worker_wire.WireError as exc:
            self._corrupt(exc)
            return
        on_message = self._on_message
        for message in messages:
            try:
                on_message(message)
            except worker_wire.WireError as exc:
                self._corrupt(exc)
                return
            except Exception:
                log.exception("protocol worker link: cannot handle message %r", message[:1])

    def _corrupt(self, exc: worker_wire.WireError) -> None:
        log.error("protocol worker link: %s; closing the link", exc)
        self._out.clear()
        if self._transport is not None:
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._on_lost()

    def send(self, message: tuple) -> None:
        self.send_frame(worker_wire.encode(message))

    def send_frame(self, pieces: list[Any]) -> None:
        """Send a frame made by worker_wire (its pieces), with the others of this loop turn."""
        if self.closed:
            return
        out = self._out
        if not out:
            self._loop.call_soon(self._flush)
        out += pieces

    def _flush(self) -> None:
        out, self._out = self._out, []
        if out and self._transport is not None and not self.closed:
            self._transport.write(b"".join(out))

    def close(self) -> None:
        self._flush()
        if self._transport is not None:
            self._transport.close()


def _arena_fd(name: str, size: int) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd


def _map(fd: int, size: int) -> memoryview:
    return memoryview(mmap.mmap(fd, size))


# -- the engine side ----------------------------------------------------------------------------------


class _ForwardedConnection:
    """What a V2 route that answers later (raw binary inference) needs of a connection."""

    __slots__ = ("answer", "inflight")

    def __init__(self) -> None:
        self.inflight: InferRequest | None = None
        self.answer: asyncio.Future[Response] = asyncio.get_running_loop().create_future()

    def complete(self, request: Request, response: Response) -> None:
        self.inflight = None
        if not self.answer.done():
            self.answer.set_result(response)


class EngineSide:
    """The engine's end of one worker's link: runs what the worker sends and answers it."""

    def __init__(
        self,
        dataplane: DataPlane,
        routes: V2Routes | None,
        service: Service | None,
        requests_arena: memoryview,
        responses_arena: memoryview,
    ) -> None:
        self.dp = dataplane
        self.routes = routes
        self.service = service
        self.link: Link | None = None
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.stopped: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.peer = requests_arena  # the worker's arena: large inputs, lent to their requests (Lease)
        # offsets of the worker's arena no request refers to any more: appended by a Lease when its
        # last array goes (in any thread), sent to the worker (``freed``) from the loop
        self.freed: list[int] = []
        self.lent = worker_wire.LentRanges()  # what the worker sent that is not freed yet (on the loop)
        self._free_due = False
        self._arena = worker_wire.Arena(responses_arena)  # ours: large outputs, until the worker took them
        self._cancels: dict[int, Callable[[], object]] = {}  # rid -> cancels that request
        self._outbox: list[tuple[int, InferResponse | SluiceError]] = []  # answered, to send this turn
        self._loop = asyncio.get_running_loop()
        self._tasks: dict[int, asyncio.Task] = {}
        self._streams: dict[int, asyncio.Queue[bytes | None]] = {}
        self._handlers: dict[str, Callable[..., None]] = {
            "infer": self._infer,
            "cancel": self._cancel,
            "http": self._http,
            "grpc": self._grpc,
            "stream_open": self._stream_open,
            "stream_msg": self._stream_msg,
            "release": self._release,
            "ready": self._ready,
        }

    def on_message(self, message: tuple) -> None:
        handler = self._handlers.get(message[0])
        if handler is None:
            raise worker_wire.WireError(f"a protocol worker sent an unknown message {message[0]!r}")
        handler(*message[1:])

    def on_lost(self) -> None:
        """The worker is gone: its requests' clients are too."""
        for cancel in list(self._cancels.values()):
            cancel()
        self._cancels.clear()
        self._outbox.clear()
        for task in list(self._tasks.values()):
            task.cancel()
        if not self.stopped.done():
            self.stopped.set_result(None)
        if not self.ready.done():
            self.ready.set_exception(ConnectionError("the protocol worker exited before it was ready"))
        # No cycle (this side -> its handlers / link -> this side) may keep it, and with it the worker's
        # two arena mappings, alive: the engine freezes its startup objects and collects cycles rarely,
        # so a crash-looping worker would grow the engine's shared memory by two arenas each time. The
        # worker's arena goes once the last request lent a range of it (Lease) is answered.
        self._handlers = {}
        self._streams.clear()
        self.link = None

    def _send(self, message: tuple) -> None:
        if self.link is not None:
            self.link.send(message)

    def _ready(self) -> None:
        if not self.ready.done():
            self.ready.set_result(None)

    # -- inference: the hot path ----------------------------------------------------------------------
    def _infer(self, rid: int, request: InferRequest) -> None:
        cancels = self._cancels
        cancels[rid] = request.cancel.cancel
        outbox = self._outbox
        if self.freed and not self._free_due:  # ranges let go of since the last answers (a model kept them)
            self._free_due = True
            self._loop.call_soon(self._send_freed)

        def done(outcome: InferResponse | SluiceError) -> None:
            if cancels.pop(rid, None) is None:
                return  # the worker is gone
            if not outbox:
                self._loop.call_soon(self._send_outcomes)
            outbox.append((rid, outcome))

        try:
            self.dp.infer_nowait(request, done)
        except SluiceError as exc:
            done(exc)
        except Exception:
            log.exception("unhandled error in a protocol worker's inference request")
            done(Internal("internal server error (see server log)"))

    def _send_outcomes(self) -> None:
        """Every outcome of this loop turn (a batch's responses, typically) in one frame."""
        items = self._outbox[:]
        self._outbox.clear()
        if self.link is None or not items:
            return
        self._send_freed()  # what the requests answered last turn let go of (their batch has ended)
        refs: list[int] = []
        try:
            self.link.send_frame(worker_wire.encode_outcomes(items, self._arena, refs))
        except Exception:  # one response that cannot be sent must not take its batch's with it
            self._release(refs)  # put in our arena for the frame that was not sent
            for rid, outcome in items:
                refs.clear()
                try:
                    self.link.send_frame(worker_wire.encode_outcome(rid, outcome, self._arena, refs))
                except Exception:
                    self._release(refs)
                    log.exception("cannot send the response to a protocol worker's request")
                    failed = Internal("internal server error: the response cannot be sent (see server log)")
                    self.link.send_frame(worker_wire.encode_outcome(rid, failed))

    def _cancel(self, rid: int) -> None:
        cancel = self._cancels.get(rid)
        if cancel is not None:
            cancel()

    def _release(self, offsets: list[int]) -> None:
        for offset in offsets:
            self._arena.release(offset)

    def _send_freed(self) -> None:
        """Tell the worker which ranges of its arena it may reuse (those whose Lease has gone)."""
        self._free_due = False
        freed = self.freed
        count = len(freed)  # Leases may append meanwhile (other threads): those stay for the next time
        if count:
            offsets = freed[:count]
            del freed[:count]
            for offset in offsets:
                self.lent.remove(offset)
            if self.link is not None:
                self.link.send(("freed", offsets))

    # -- forwarded HTTP requests ----------------------------------------------------------------------
    def _http(self, rid: int, method: bytes, url: bytes, headers: dict[bytes, bytes], body: bytes) -> None:
        routes = self.routes
        if routes is None:
            self._send(("http_done", rid, (404, b'{"error":"HTTP is off"}', b"application/json", None)))
            return
        conn = _ForwardedConnection()
        request = Request(conn, method, url, headers, body)  # type: ignore[arg-type]
        try:
            result = routes(request)
        except SluiceError as exc:
            result = error_response(exc)
        except Exception:
            log.exception("unhandled error on %s", request.path)
            result = json_response({"error": "internal server error (see server log)"}, 500)
        if isinstance(result, Response):
            self._http_answer(rid, result)
            return

        def cancel() -> None:
            if conn.inflight is not None:
                conn.inflight.cancel.cancel()
            task = self._tasks.get(rid)
            if task is not None:
                task.cancel()

        self._cancels[rid] = cancel
        pending = conn.answer if result is DEFERRED else result
        self._tasks[rid] = asyncio.get_running_loop().create_task(self._http_later(rid, request, pending))

    async def _http_later(self, rid: int, request: Request, pending: Any) -> None:
        try:
            response = await answer_of(request, pending)
        finally:
            self._tasks.pop(rid, None)
            self._cancels.pop(rid, None)
        if response is not None:
            self._http_answer(rid, response)

    def _http_answer(self, rid: int, response: Response) -> None:
        self._send(("http_done", rid, (response.status, response.body, response.content_type, response.extra)))

    # -- forwarded gRPC calls -------------------------------------------------------------------------
    def _grpc(self, rid: int, name: str, message: bytes, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        task = asyncio.get_running_loop().create_task(self._grpc_call(rid, name, message, deadline))
        self._tasks[rid] = task
        self._cancels[rid] = task.cancel

    async def _grpc_call(self, rid: int, name: str, message: bytes, deadline: float | None) -> None:
        try:
            assert self.service is not None
            method = self.service.methods[name]
            request = message if method.parse is None else method.parse(message)
            response = await method.handler(request, Call(deadline))
            payload = response if type(response) is bytes else response.SerializeToString()
            outcome: tuple = ("ok", payload)
        except SluiceError as exc:
            outcome = worker_wire.error_state(exc)
        except asyncio.CancelledError:
            return
        except Exception:
            log.exception("unhandled error in %s", name)
            outcome = worker_wire.error_state(Internal("internal server error (see server log)"))
        finally:
            self._tasks.pop(rid, None)
            self._cancels.pop(rid, None)
        self._send(("grpc_done", rid, outcome))

    def _stream_open(self, rid: int, caller: str, traceparent: bytes | None, timeout: float | None) -> None:
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._streams[rid] = queue
        deadline = None if timeout is None else time.monotonic() + timeout
        task = asyncio.get_running_loop().create_task(self._stream(rid, queue, Call(deadline, caller, traceparent)))
        self._tasks[rid] = task
        self._cancels[rid] = task.cancel

    def _stream_msg(self, rid: int, message: bytes | None) -> None:
        queue = self._streams.get(rid)
        if queue is not None:
            queue.put_nowait(message)

    async def _stream(self, rid: int, queue: asyncio.Queue[bytes | None], call: Call) -> None:
        assert self.service is not None
        method = self.service.methods["ModelStreamInfer"]
        parse = method.parse
        assert parse is not None

        async def messages() -> AsyncIterator[Any]:
            while True:
                message = await queue.get()
                if message is None:
                    return
                self._send(("stream_taken", rid))  # the worker sends the next one only now
                yield parse(message)

        outcome: tuple | None = None
        try:
            async for reply in method.handler(messages(), call):
                self._send(("stream_reply", rid, reply.SerializeToString()))
        except SluiceError as exc:
            outcome = worker_wire.error_state(exc)
        except asyncio.CancelledError:
            return
        except Exception:
            log.exception("unhandled error in ModelStreamInfer")
            outcome = worker_wire.error_state(Internal("internal server error (see server log)"))
        finally:
            self._streams.pop(rid, None)
            self._tasks.pop(rid, None)
            self._cancels.pop(rid, None)
        self._send(("stream_done", rid, outcome))


@dataclasses.dataclass
class _Worker:
    index: int
    side: EngineSide
    process: subprocess.Popen
    started: float
    fds: tuple[int, int]


class WorkerPool:
    """The engine's protocol workers: started on its listening sockets, restarted when one dies,
    stopped (drained) on shutdown."""

    def __init__(
        self,
        count: int,
        settings: ServerSettings,
        dataplane: DataPlane,
        routes: V2Routes | None,
        service: Service | None,
        log_control: logs.LogControl | None = None,
    ) -> None:
        """``log_control``: the engine's log settings, which the workers follow (at start and each change)."""
        self.count = count
        self.settings = settings
        self._log_control = log_control
        self._unwatch: Callable[[], None] | None = None
        self.dp = dataplane
        self.routes = routes
        self.service = service
        self.restarts = 0
        self._sockets: dict[str, list[socket.socket]] = {}
        self._workers: dict[int, _Worker] = {}
        self._stopping = False
        self._restarting: set[asyncio.Task] = set()

    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers.values()]

    def counts(self) -> tuple[int, int, int]:
        """(workers asked for, workers serving now, restarts so far), for the metrics."""
        serving = sum(
            1
            for w in self._workers.values()
            if w.side.ready.done()
            and not w.side.ready.cancelled()
            and w.side.ready.exception() is None
            and not w.side.stopped.done()
        )
        return self.count, serving, self.restarts

    async def start(self, sockets: dict[str, list[socket.socket]]) -> None:
        """Start the workers on ``sockets`` (``http``/``grpc``: listening sockets, one per worker or one
        shared: :func:`listeners_for_workers`) and wait until each is accepting; raises RuntimeError when
        one cannot start."""
        self._sockets = sockets
        if self._log_control is not None:
            self._unwatch = self._log_control.watch(self._log_changed)
        for index in range(self.count):
            await self._spawn(index)
        try:
            await asyncio.wait_for(asyncio.gather(*(w.side.ready for w in self._workers.values())), START_TIMEOUT_S)
        except (ConnectionError, TimeoutError) as exc:
            await self.stop(time.monotonic())
            raise RuntimeError(f"a protocol worker did not start: {exc or 'timed out'}; see its log above") from None
        log.info("%d protocol worker(s) serving: pids %s", self.count, ", ".join(map(str, self.pids())))

    async def _spawn(self, index: int) -> None:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        requests_fd = _arena_fd(f"sluice-worker{index}-requests", ARENA_BYTES)
        responses_fd = _arena_fd(f"sluice-worker{index}-responses", ARENA_BYTES)
        listening = {kind: socks[index % len(socks)].fileno() for kind, socks in self._sockets.items()}
        fds = (theirs.fileno(), requests_fd, responses_fd, *listening.values())
        command = [
            sys.executable,
            *(["-P"] if sys.flags.safe_path else []),
            "-m",
            "sluice.runtime.frontend_workers",
            "--index", str(index),
            "--link-fd", str(theirs.fileno()),
            "--arena-fds", f"{requests_fd},{responses_fd}",
            "--http-fd", str(listening.get("http", -1)),
            "--grpc-fd", str(listening.get("grpc", -1)),
            "--engine-pid", str(os.getpid()),
        ]  # fmt: skip
        try:
            process = subprocess.Popen(command, pass_fds=fds, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        side = EngineSide(
            self.dp, self.routes, self.service, _map(requests_fd, ARENA_BYTES), _map(responses_fd, ARENA_BYTES)
        )
        worker = _Worker(index, side, process, time.monotonic(), (requests_fd, responses_fd))
        self._workers[index] = worker
        framer = worker_wire.Framer(side.peer, freed=side.freed.append, lent=side.lent)  # inputs lent, not copied
        _, link = await loop.create_unix_connection(
            lambda: Link(side.on_message, lambda: self._lost(worker), framer), sock=ours
        )
        side.link = link
        log_settings = self.settings.log if self._log_control is None else self._log_control.settings
        link.send(("start", dataclasses.replace(self.settings, log=log_settings), index))

    def _log_changed(self, settings: LogSettings) -> None:
        for worker in self._workers.values():
            if worker.side.link is not None and not worker.side.stopped.done():
                worker.side.link.send(("log", settings))

    def _lost(self, worker: _Worker) -> None:
        worker.side.on_lost()
        for fd in worker.fds:
            os.close(fd)
        task = asyncio.get_running_loop().create_task(self._reap(worker))
        self._restarting.add(task)
        task.add_done_callback(self._restarting.discard)

    async def _reap(self, worker: _Worker) -> None:
        loop = asyncio.get_running_loop()
        code = await loop.run_in_executor(None, worker.process.wait)
        if self._stopping or self._workers.get(worker.index) is not worker:
            return
        lifetime = time.monotonic() - worker.started
        delay = restart_delay(lifetime)
        log.warning(
            "protocol worker %d (pid %d) exited with %s after %.1f s; restarting it%s",
            worker.index,
            worker.process.pid,
            f"signal {-code}" if code < 0 else f"code {code}",
            lifetime,
            f" in {delay:g} s" if delay else "",
        )
        if delay:
            await asyncio.sleep(delay)
        if self._stopping:
            return
        self.restarts += 1
        await self._spawn(worker.index)
        try:
            await asyncio.wait_for(self._workers[worker.index].side.ready, START_TIMEOUT_S)
        except (ConnectionError, TimeoutError):
            return  # it died again: its own _lost restarts it
        log.info("protocol worker %d restarted: pid %d", worker.index, self._workers[worker.index].process.pid)

    async def stop(self, deadline: float) -> None:
        """Tell every worker to stop accepting, finish its in-flight requests (until the monotonic
        ``deadline``) and exit; kill those still running at the deadline."""
        self._stopping = True
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        for task in list(self._restarting):
            task.cancel()
        workers = list(self._workers.values())
        for worker in workers:
            if worker.side.link is not None:
                worker.side.link.send(("stop", max(deadline - time.monotonic(), 0.0)))
        # The engine's copies of the listening sockets go now, not once the workers exited: while any copy
        # is open the kernel keeps completing handshakes nobody accepts (clients hang, then are reset),
        # where a closed port refuses them at once and they go to another pod.
        for socks in self._sockets.values():
            for sock in socks:
                sock.close()
        waits = [worker.side.stopped for worker in workers]
        if waits:
            await asyncio.wait(waits, timeout=max(deadline - time.monotonic(), 0.0) + 1.0)
        loop = asyncio.get_running_loop()
        for worker in workers:
            if worker.process.poll() is None:
                try:
                    await asyncio.wait_for(loop.run_in_executor(None, worker.process.wait), 2.0)
                except TimeoutError:
                    log.warning("protocol worker %d (pid %d) did not stop: killed", worker.index, worker.process.pid)
                    worker.process.kill()
                    await loop.run_in_executor(None, worker.process.wait)
            if worker.side.link is not None:
                worker.side.link.close()
        self._workers.clear()


# -- the worker side ----------------------------------------------------------------------------------


class RemotePlane:
    """What the front ends of a worker call instead of the data plane: inference goes to the engine.
    Only the attributes the inference path reads are here; everything else is forwarded whole."""

    def __init__(self, requests_arena: memoryview, responses_arena: memoryview) -> None:
        self.link: Link | None = None
        self.tracing = tracing.disabled()  # requests are traced by the engine's front ends only
        self.shared_memory = None
        self._arena = worker_wire.Arena(requests_arena)
        self.peer = responses_arena  # the engine's arena: large outputs, copied out on receipt
        self._ids = itertools.count()
        self._outbox: list[tuple[int, InferRequest, list[int]]] = []  # requests to send this loop turn
        self._loop = asyncio.get_running_loop()
        self._pending: dict[int, tuple[Callable[[Any], None], list[int], CancelToken | None]] = {}
        self._handlers: dict[str, Callable[..., None]] = {
            "done": self._done,
            "http_done": self._answered,
            "grpc_done": self._answered,
            "stream_reply": self._stream_event,
            "stream_taken": self._stream_event,
            "stream_done": self._stream_event,
            "freed": self._freed,
        }
        self._streams: dict[int, asyncio.Queue[tuple]] = {}
        self.on_stop: Callable[[float], None] = lambda grace: None
        self.on_log: Callable[[LogSettings], object] = lambda settings: None

    def on_message(self, message: tuple) -> None:
        kind = message[0]
        if kind == "stop":
            self.on_stop(message[1])
            return
        if kind == "log":
            self.on_log(message[1])
            return
        self._handlers[kind](*message[1:])

    def model_config(self, name: str, version: str = "") -> None:
        """The head check of HTTP inference (``check_head``) asks the engine nothing: the body is
        read and the engine answers for an unknown model."""
        return None

    def _send(self, message: tuple) -> None:
        assert self.link is not None
        self.link.send(message)

    # -- inference ------------------------------------------------------------------------------------
    def infer_nowait(self, request: InferRequest, done: Callable[[InferResponse | SluiceError], None]) -> None:
        """``DataPlane.infer_nowait`` through the engine: every outcome, refusals included, comes to
        ``done`` (on this loop, never before this returns)."""
        rid = next(self._ids)
        refs: list[int] = []  # filled when the request is encoded
        token = request.cancel
        self._pending[rid] = (done, refs, token)
        outbox = self._outbox
        if not outbox:
            self._loop.call_soon(self._send_requests)
        outbox.append((rid, request, refs))
        token.on_cancel(lambda: self._cancel(rid))

    def _send_requests(self) -> None:
        """Every request of this loop turn in one frame (before any later message: a cancel)."""
        items = self._outbox[:]
        self._outbox.clear()
        if not items:
            return
        assert self.link is not None
        try:
            self.link.send_frame(worker_wire.encode_requests(items, self._arena))
        except Exception:  # one request that cannot be sent must not take the others with it
            for _, _, refs in items:  # the frame was not sent: what it put in the arena is ours again
                self._free_refs(refs)
            for item in items:
                try:
                    self.link.send_frame(worker_wire.encode_requests([item], self._arena))
                except Exception:
                    log.exception("cannot send an inference request to the engine")
                    self._done(item[0], Internal("internal server error: the request cannot be sent"), None, sent=False)

    def _free_refs(self, refs: list[int]) -> None:
        for offset in refs:
            self._arena.release(offset)
        refs.clear()

    def _cancel(self, rid: int) -> None:
        if rid in self._pending and self.link is not None:
            self._send_requests()  # the engine hears of the request before its cancel
            self.link.send(("cancel", rid))

    def _done(
        self, rid: int, outcome: InferResponse | SluiceError, taken: list[int] | None, sent: bool = True
    ) -> None:
        """An outcome: the engine's, or (``sent`` False) this worker's for a request it could not send,
        whose arena ranges are its own to free; the engine says when it has let go of the others."""
        entry = self._pending.pop(rid, None)
        if entry is None:
            if taken:
                self._send(("release", taken))
            return
        done, refs, token = entry
        if not sent:
            self._free_refs(refs)
        if token is not None:
            token.clear()
        if taken:
            self._send(("release", taken))
        done(outcome)

    @property
    def arena_used_bytes(self) -> int:
        """Bytes of this worker's requests' arena in use: sent inputs the engine has not let go of."""
        return self._arena.used_bytes

    def _freed(self, offsets: list[int]) -> None:
        """The engine let go of these ranges of the requests' arena: they may be reused."""
        for offset in offsets:
            try:
                self._arena.release(offset)
            except KeyError:  # not one of ours: the engine's bookkeeping is wrong, the range stays held
                log.error("the engine freed an arena range at %r that is not in use; ignored", offset)

    async def infer(self, request: InferRequest) -> InferResponse:
        return await awaited(self.infer_nowait, request)

    def lost(self) -> None:
        """The engine is gone: answer what is pending (the process exits next)."""
        self._outbox.clear()
        for done, _, token in list(self._pending.values()):
            if token is not None:  # an inference request (a forwarded call's caller goes with the process)
                done(worker_wire.error_from_state(("error", "Unavailable", "server is shutting down", 503)))
        self._pending.clear()

    # -- forwarded calls ------------------------------------------------------------------------------
    async def call(self, message: tuple) -> Any:
        """Send a forwarded HTTP request or gRPC call (``message`` without its id) and return the
        engine's answer; cancelling the caller cancels it in the engine."""
        rid = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[rid] = (future.set_result, [], None)
        self._send((message[0], rid, *message[1:]))
        try:
            return await future
        except asyncio.CancelledError:
            if self._pending.pop(rid, None) is not None:
                self._send(("cancel", rid))
            raise

    def _answered(self, rid: int, outcome: Any) -> None:
        entry = self._pending.pop(rid, None)
        if entry is not None:
            entry[0](outcome)

    def open_stream(self, caller: str, traceparent: bytes | str | None, timeout: float | None) -> tuple[int, Any]:
        rid = next(self._ids)
        queue: asyncio.Queue[tuple] = asyncio.Queue()
        self._streams[rid] = queue
        self._send(("stream_open", rid, caller, traceparent, timeout))
        return rid, queue

    def close_stream(self, rid: int, cancel: bool) -> None:
        self._streams.pop(rid, None)
        if cancel:
            self._send(("cancel", rid))

    def _stream_event(self, rid: int, *rest: Any) -> None:
        queue = self._streams.get(rid)
        if queue is not None:
            queue.put_nowait(rest)


class WorkerRoutes(V2Routes):
    """A worker's HTTP routes: JSON and binary inference decoded here and run through the engine,
    every other request forwarded to the engine whole."""

    def __init__(self, plane: RemotePlane, settings: ServerSettings) -> None:
        super().__init__(cast(DataPlane, plane), settings.limits)
        self.plane = plane

    def __call__(self, request: Request) -> Response | Any:
        if request.method == b"POST" and request.path.endswith(b"/infer"):
            parts = request.path.split(b"/")
            length = request.headers.get(b"inference-header-content-length")
            if len(parts) > 4 and parts[1] == b"v2" and parts[2] == b"models" and (length is None or _positive(length)):
                try:
                    name, version, tail = _model_path(parts[3:])
                except SluiceError:
                    tail = []
                if tail == [b"infer"]:
                    return self._infer(request, name, version)
        return self._forward(request)

    async def _forward(self, request: Request) -> Response:
        url = request.path + (b"?" + request.query if request.query else b"")
        status, body, content_type, extra = await self.plane.call(
            ("http", request.method, url, request.headers, request.body)
        )
        return Response(status, body, content_type, extra)


def _positive(header: bytes) -> bool:
    try:
        return int(header) > 0
    except ValueError:
        return False


class _WorkerConnection(Connection):
    """Names the worker in each response (``sluice-worker``), so tests and operators can see the spread."""

    def _write(self, response: Response, close: bool, head_only: bool = False, announce: bool = False) -> None:
        tag = (WORKER_HEADER, self._server.worker_tag)  # type: ignore[attr-defined]
        response.extra = [*response.extra, tag] if response.extra else [tag]
        super()._write(response, close, head_only, announce)


class _WorkerHttpServer(HttpServer):
    def __init__(self, routes: WorkerRoutes, settings: ServerSettings, loop: asyncio.AbstractEventLoop, index: int):
        super().__init__(routes, settings.limits, loop)
        self.worker_tag = b"%d" % index

    def make_connection(self) -> Connection:
        return _WorkerConnection(self)


class _Raw:
    """A reply message already serialized by the engine."""

    __slots__ = ("payload",)

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def SerializeToString(self) -> bytes:
        return self.payload


def worker_service(plane: RemotePlane, settings: ServerSettings) -> Service:
    """gRPC's method table for a worker: ``ModelInfer`` decoded here, the rest forwarded."""
    service = Service(cast(DataPlane, plane), settings.limits)
    for key, method in list(service.methods.items()):  # forwarded by key: the engine's table has the same
        if method.kind == grpc_service.UNARY:
            forward = _forward_unary(plane, key)
            service.methods[key] = Method(method.name, grpc_service.UNARY, forward, None, service=method.service)
        elif method.kind == grpc_service.STREAM:
            streamed = _forward_stream(plane)
            service.methods[key] = Method(method.name, grpc_service.STREAM, streamed, bytes, service=method.service)
    return service


def _forward_unary(plane: RemotePlane, name: str) -> Callable[[bytes, Call], Any]:
    async def forward(message: bytes, call: Call) -> bytes:
        timeout = None if call.deadline is None else max(call.deadline - time.monotonic(), 0.0)
        outcome = await plane.call(("grpc", name, message, timeout))
        if outcome[0] == "ok":
            return cast(bytes, outcome[1])
        raise worker_wire.error_from_state(outcome)

    return forward


def _forward_stream(plane: RemotePlane) -> Callable[[AsyncIterator[bytes], Call], AsyncIterator[_Raw]]:
    async def forward(messages: AsyncIterator[bytes], call: Call) -> AsyncIterator[_Raw]:
        timeout = None if call.deadline is None else max(call.deadline - time.monotonic(), 0.0)
        rid, events = plane.open_stream(call.caller, call.traceparent, timeout)
        taken = asyncio.Event()

        async def pump() -> None:
            async for message in messages:
                taken.clear()
                plane._send(("stream_msg", rid, message))
                await taken.wait()
            plane._send(("stream_msg", rid, None))

        sender = asyncio.get_running_loop().create_task(pump())
        finished = False
        try:
            while True:
                event = await events.get()
                if len(event) == 0:  # stream_taken
                    taken.set()
                elif len(event) == 1 and isinstance(event[0], bytes):
                    yield _Raw(event[0])
                else:  # stream_done: (None,) or (error state,)
                    finished = True
                    if event[0] is not None:
                        raise worker_wire.error_from_state(event[0])
                    return
        finally:
            sender.cancel()
            plane.close_stream(rid, cancel=not finished)

    return forward


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG: the kernel kills this process when the engine dies (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the link's end-of-file still stops the worker
        pass


async def _serve_worker(args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    requests_fd, responses_fd = (int(fd) for fd in args.arena_fds.split(","))
    plane = RemotePlane(_map(requests_fd, ARENA_BYTES), _map(responses_fd, ARENA_BYTES))
    started: asyncio.Future[tuple] = loop.create_future()
    stopping: asyncio.Future[float] = loop.create_future()

    def first(message: tuple) -> None:
        if message[0] == "start":
            started.set_result(message)
        else:
            plane.on_message(message)

    def lost() -> None:
        plane.lost()
        if not stopping.done():
            stopping.set_result(-1.0)  # the engine is gone

    link_sock = socket.socket(fileno=args.link_fd)
    _, link = await loop.create_unix_connection(
        lambda: Link(first, lost, worker_wire.Framer(plane.peer, trusted=True)), sock=link_sock
    )
    plane.link = link
    plane.on_stop = lambda grace: None if stopping.done() else stopping.set_result(grace)
    _, settings, index = await started
    # The engine's log settings, as they are now and each time a client changes them (/v2/logging).
    log_control = logs.LogControl(settings.log, tag=f"worker {index}")
    for handler in logging.getLogger().handlers:
        log_control.govern(handler)
    log_control.apply()
    plane.on_log = log_control.apply
    # Other libraries' loggers: DEBUG records made only when verbose at the start (the gate still filters).
    logging.getLogger().setLevel(logging.DEBUG if settings.log.verbose_level else logging.INFO)
    applied = host_memory.apply(settings.malloc_tuning)  # as in the engine (logged there)
    if applied is not None:
        log.debug("protocol worker %d: %s", index, applied)
    listeners: list[HttpServer | GrpcServer] = []
    if args.http_fd >= 0:
        http = _WorkerHttpServer(WorkerRoutes(plane, settings), settings, loop, index)
        http.check_head = None  # unknown models are the engine's to answer, after the body
        await http.start_socket(socket.socket(fileno=args.http_fd))
        listeners.append(http)
    if args.grpc_fd >= 0:
        grpc_server = GrpcServer(cast(DataPlane, plane), settings.limits, loop, worker_service(plane, settings))
        await grpc_server.start_socket(socket.socket(fileno=args.grpc_fd))
        listeners.append(grpc_server)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: None)  # the engine decides when workers stop
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    link.send(("ready",))
    grace = await stopping
    if grace < 0:
        return 0  # the engine is gone: nothing can be answered
    deadline = time.monotonic() + grace
    for listener in listeners:
        await listener.stop_listening()
    await asyncio.gather(*(listener.drain(deadline) for listener in listeners))
    link.close()
    return 0


def orphaned(parent_pid: int, engine_pid: int) -> bool:
    """Whether a starting worker's engine is gone: the worker was re-parented. The engine may itself be
    PID 1 (a container's entrypoint: the runtime image, the operator's pods), so the parent is compared
    with the engine's pid; without it (an older engine) PID 1 is taken as re-parented."""
    if engine_pid:
        return parent_pid != engine_pid
    return parent_pid == 1


def main(argv: list[str] | None = None) -> int:
    _die_with_parent()
    parser = argparse.ArgumentParser(prog="sluice-protocol-worker", description="started by sluice serve only")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--link-fd", type=int, required=True)
    parser.add_argument("--arena-fds", required=True)
    parser.add_argument("--http-fd", type=int, default=-1)
    parser.add_argument("--grpc-fd", type=int, default=-1)
    parser.add_argument("--engine-pid", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=logs.line_format(f"worker {args.index}"))  # until the start
    if orphaned(os.getppid(), args.engine_pid):  # the engine died before prctl took effect
        return 1
    try:
        import uvloop

        return uvloop.run(_serve_worker(args))
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(_serve_worker(args))


if __name__ == "__main__":
    sys.exit(main())
