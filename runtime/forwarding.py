"""The no-mesh canary split inside the runtime: the ``--split-file`` watcher and the forwarding.

The operator runs a canary as a second Deployment behind ``<name>-canary``; without a mesh, the
stable pods' runtime sends the canary's share of each split model's requests there itself. The
server builds one :class:`Forwarder`; the data plane asks its :class:`~split.SplitTable` (a dict
lookup) whether a request without an explicit version goes to the canary, and hands those to
:meth:`Forwarder.forward`, which calls the target over gRPC (remote.py: one channel per target)
and answers with the canary's response or error, the canary named in the error's message.
Forwarded requests count here (:class:`ForwardCounts`, read by metrics.py at scrape time), never in
the stable model's statistics: the canary counts them. A sampled request's forward is a client span
(tracing.py) whose ``traceparent`` goes along as gRPC metadata, so the canary continues the trace.

:class:`SplitFileWatcher` reads the file at start and then every :data:`POLL_S` seconds of the
server's clock (kubelet swaps a symlink when a mounted ConfigMap changes, so the content is
compared, not the mtime). A missing file is no split; an invalid one keeps the split in force and
is logged once with the file and the field. The file is a few hundred bytes on a local volume, so
it is read on the event loop.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Callable
from pathlib import Path

from sluice.runtime import names, remote
from sluice.runtime.batching import Clock
from sluice.runtime.errors import Cancelled, Internal, SluiceError, Unavailable
from sluice.runtime.split import SplitFileError, SplitTable, parse_split_file
from sluice.runtime.types import InferRequest, InferResponse

log = logging.getLogger("sluice.runtime.forwarding")

POLL_S = 1.0
"""How often the split file is read again (seconds of the server's clock)."""

MAX_FILE_BYTES = 1 << 20
"""A split file larger than this is refused (it names a few models; more is a mistake)."""

Done = Callable[[InferResponse | SluiceError], None]


class ForwardCounts:
    """Forwarded requests by (model, target): answered successfully, answered with an error, and
    served here because the canary could not be reached (``fallback``)."""

    def __init__(self) -> None:
        self.by_route: dict[tuple[str, str], list[int]] = {}

    def add(self, model: str, target: str, ok: bool, *, fallback: bool = False) -> None:
        counts = self.by_route.get((model, target))
        if counts is None:
            counts = self.by_route[(model, target)] = [0, 0, 0]
        counts[2 if fallback else 0 if ok else 1] += 1


def canary_error(model: str, target: str, error: SluiceError) -> SluiceError:
    """``error`` of a forwarded request as its client reads it: same status, the canary named."""
    wrapped = copy.copy(error)
    wrapped.message = f"{error.message} (model '{names.shown(model)}' was forwarded to its canary at {target})"
    wrapped.args = (wrapped.message,)
    return wrapped


class Forwarder:
    """Sends the canary's share of split models' requests to the canary, over gRPC."""

    def __init__(self) -> None:
        self.table = SplitTable()
        self.counts = ForwardCounts()
        self._clients = remote.RemoteClients()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False

    def forward(self, target: str, request: InferRequest, done: Done,
                local: Callable[[InferRequest, Done], None] | None = None) -> None:
        """Run ``request`` at ``target`` (the latest version there) and call ``done`` once with its
        answer. Cancelling ``request.cancel`` (the client went away) cancels the call.

        A canary that cannot be reached at all (its Service is gone or has no endpoints: the split
        file still names it while kubelet catches up with a rollback or promotion) never got the
        request: ``local`` serves it here instead, so taking a canary down drops no request."""
        if request.cancel.cancelled:
            self.counts.add(request.model_name, target, False)
            done(self._cancelled(request.model_name))
            return
        traced = None if request.trace is None else request.trace.forward(request.model_name, target)
        task = asyncio.get_running_loop().create_task(self._call(target, request, done, local, traced))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

        def cancel() -> None:
            task.cancel()

        request.cancel.on_cancel(cancel)

    async def _call(
        self,
        target: str,
        request: InferRequest,
        done: Done,
        local: Callable[[InferRequest, Done], None] | None,
        traced: tuple[Callable[[object], None], str] | None = None,
    ) -> None:
        """``traced``: a sampled request's client span (its end, and the traceparent sent along)."""
        model = request.model_name
        end, traceparent = traced if traced is not None else (None, None)
        outcome: InferResponse | SluiceError
        try:
            outcome = await self._clients.infer(target, model, "", request, traceparent)
        except (remote.Unreachable, remote.Unforwardable) as exc:
            if local is not None and not request.cancel.cancelled:
                unsent = isinstance(exc, remote.Unforwardable)  # the request's doing, not the canary's
                if not unsent:
                    self.counts.add(model, target, False, fallback=True)
                if end is not None:  # the span says why it is served here
                    end(exc)
                try:
                    local(request, done)
                except SluiceError as refused:  # refused at once here (bad input, queue full): still answered
                    done(refused)
                return
            outcome = canary_error(model, target, exc)
        except SluiceError as exc:
            outcome = canary_error(model, target, exc)
        except asyncio.CancelledError:
            self.counts.add(model, target, False)
            outcome = self._cancelled(model)
            if end is not None:
                end(outcome)
            done(outcome)
            raise
        except Exception as exc:  # whatever the client raises, the request must be answered
            outcome = canary_error(model, target, Internal(f"{type(exc).__name__}: {exc}"))
        self.counts.add(model, target, not isinstance(outcome, SluiceError))
        if end is not None:
            end(outcome)
        done(outcome)

    def _cancelled(self, model: str) -> SluiceError:
        if self._closing:
            return Unavailable(f"the server stopped before the canary of model '{names.shown(model)}' answered")
        return Cancelled(f"the request to model '{names.shown(model)}' was cancelled by the client")

    async def aclose(self) -> None:
        """Answer what is still in flight as unavailable, and close the channels."""
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._clients.aclose()


class SplitFileWatcher:
    """Applies ``path`` to ``table`` at ``start`` and whenever its content changes."""

    def __init__(self, path: Path, table: SplitTable, clock: Clock | None = None, poll_s: float = POLL_S) -> None:
        self.path = path
        self.table = table
        self._clock: Clock = clock or time.monotonic_ns
        self._poll_ns = int(poll_s * 1e9)
        self._seen: bytes | None = None  # the content last read (None: missing), valid or not
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0
        self._unwatch: Callable[[], None] | None = None

    def start(self) -> None:
        """Read the file now and poll it from here on (on the running loop)."""
        loop = self._loop = asyncio.get_running_loop()
        self.check()
        self._due = self._clock() + self._poll_ns
        self._arm()
        watch = getattr(self._clock, "watch", None)
        if watch is not None:  # a clock that jumps (tests): look again at once when it does
            self._unwatch = watch(lambda: loop.call_soon_threadsafe(self._tick))

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._unwatch is not None:
            self._unwatch()
        self._loop = self._timer = self._unwatch = None

    def _arm(self) -> None:
        if self._loop is None:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(max(self._due - self._clock(), 0) / 1e9, self._tick)

    def _tick(self) -> None:
        if self._loop is None:
            return
        if self._clock() >= self._due:
            self.check()
            self._due = self._clock() + self._poll_ns
        self._arm()

    def check(self) -> None:
        """Read the file; apply it when its content changed and is valid."""
        try:
            with self.path.open("rb") as file:
                content: bytes | None = file.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            content = None
        except OSError as exc:
            log.error("split file %s cannot be read (%s); the split in force stays", self.path, exc.strerror or exc)
            return
        if content == self._seen:
            return
        self._seen = content
        if content is None:
            routes = {}
            log.info("split file %s is absent: no model is split", self.path)
        elif len(content) > MAX_FILE_BYTES:
            log.error("split file %s is over %d bytes; the split in force stays", self.path, MAX_FILE_BYTES)
            return
        else:
            try:
                routes = parse_split_file(content, str(self.path))
            except SplitFileError as exc:
                log.error("%s; the split in force stays", exc)
                return
        for change in self.table.apply(routes):
            log.info("split file %s: %s", self.path, change)
