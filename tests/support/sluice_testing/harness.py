"""Run the real operator (kopf, handlers, reconciler, kube client) in-process against any API server.

``OperatorHarness`` is an async context manager: on enter it starts ``kopf.operator`` as a task with
the production registry, logging in to ``server`` without credentials, and waits until kopf reports
ready; on exit it stops kopf and re-raises anything the operator task raised.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
from types import TracebackType
from typing import Any

import kopf

from sluice.operator import handlers
from sluice.operator.kube import Kube
from sluice.operator.metrics import OperatorMetrics
from sluice.operator.reconcile import Reconciler
from sluice.operator.settings import Settings


@dataclasses.dataclass
class FakeClock:
    """A clock that only moves when told to."""

    now: datetime.datetime = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)

    def __call__(self) -> datetime.datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += datetime.timedelta(seconds=seconds)


class _Ignored(set[asyncio.Task[Any]]):
    """Tasks kopf must not treat as its own hung tasks: those it found, ours, and in-process servers'."""

    def __contains__(self, task: object) -> bool:
        if super().__contains__(task):
            return True
        coro = task.get_coro() if isinstance(task, asyncio.Task) else None
        code = getattr(coro, "cr_code", None)
        # An in-process API server's request handlers (e.g. open watch streams) belong to the server.
        return code is not None and code.co_filename.endswith("web_protocol.py")


def _timer_runners() -> set[asyncio.Task[Any]]:
    return {task for task in asyncio.all_tasks() if task.get_name().startswith("runner of ") and not task.done()}


async def _sweep_respawned_timers(stop: asyncio.Event, root_tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel the timers kopf spawned after it stopped its daemons, as soon as its root tasks are done.

    On stop, kopf stops every timer, then its workers process the events still queued, and an event
    spawns the object's timer again (nothing stops that one). kopf cancels it as a hung task, but only
    after waiting 5 s for it to end on its own: seconds per test with a resync timer. This cancels the
    same tasks the same way, without the wait. Timers alive when the stop began are left to kopf: this
    operator's are stopped by it, and another operator's in the same loop must go on."""
    await stop.wait()
    before = _timer_runners()
    await asyncio.wait(root_tasks)
    for task in _timer_runners() - before:
        task.cancel()


class OperatorHarness:
    def __init__(
        self, *, settings: Settings, connection: kopf.ConnectionInfo | None = None,
        clock: FakeClock | None = None, events: Any = None, metrics: Any = None, gate: Any = None,
    ) -> None:
        self.settings = settings
        self.clock = clock or FakeClock()
        self.metrics = OperatorMetrics()
        self.kube = Kube()
        self.reconciler = Reconciler(kube=self.kube, settings=settings, clock=self.clock,
                                     events=events or handlers.kopf_event, metrics=metrics, gate=gate)
        self.registry = kopf.OperatorRegistry()
        self._connection = connection

        async def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
            return self._connection or await handlers.default_login(**kwargs)

        handlers.register(self.registry, settings=settings, kube=self.kube, reconciler=self.reconciler,
                          metrics=self.metrics, login=login)
        self._stop = asyncio.Event()
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._ignored = _Ignored()

    async def __aenter__(self) -> OperatorHarness:
        kopf_settings = kopf.OperatorSettings()
        kopf_settings.scanning.disabled = True  # the RBAC-limited operator does not scan for CRDs
        kopf_settings.watching.reconnect_backoff = 0.1
        # on stop kopf gives each object's idle worker this long to take one more event before it
        # cancels it (2 s by default, several in a row): the tests stop a settled operator
        kopf_settings.batching.exit_timeout = 0.1
        self._task = asyncio.create_task(self._run(kopf_settings))
        ready = asyncio.create_task(self._ready.wait())
        done, _ = await asyncio.wait({ready, self._task}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        if self._task in done:
            ready.cancel()
            await self._task  # raises what broke the start
        if ready not in done:
            raise TimeoutError("the operator did not become ready in 30 s")
        return self

    async def _run(self, kopf_settings: kopf.OperatorSettings) -> None:
        # kopf.operator() cancels every task created while it ran, the test's own teardown included;
        # spawn_tasks/run_tasks with a live "ignored" set spare the tasks that are not kopf's.
        self._ignored.update(asyncio.all_tasks())
        tasks = await kopf.spawn_tasks(
            registry=self.registry, settings=kopf_settings, standalone=True,
            clusterwide=not self.settings.namespaces, namespaces=self.settings.namespaces,
            stop_flag=self._stop, ready_flag=self._ready,
        )
        sweeper = asyncio.create_task(_sweep_respawned_timers(self._stop, tasks))
        self._ignored.add(sweeper)
        try:
            await kopf.run_tasks(tasks, ignored=self._ignored)
        finally:
            sweeper.cancel()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None,
    ) -> None:
        current = asyncio.current_task()
        if current is not None:
            self._ignored.add(current)
        self._stop.set()
        if self._task is not None:
            await asyncio.wait_for(self._task, timeout=30)
