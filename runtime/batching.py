"""Batch formation (pure) and the per-model-version scheduler that applies it.

``decide`` is the whole batching policy as a plain function of the queue and the time; the
:class:`Scheduler` is the thin stateful layer around it: bounded priority queues, deadlines from an
injected monotonic clock, cancellation, and dispatch of batches to model instances on worker threads.

Policy (see docs/batching.md):

* ``work_conserving`` (default): when an instance is idle and requests are queued, dispatch at once
  with as many compatible requests as fit in ``max_batch_size``. While every instance is busy the
  queue grows, so the next batch is naturally larger; ``max_queue_delay_microseconds`` is only an
  upper bound that never has to be waited for.
* ``fixed_wait``: Triton's behaviour. Dispatch when a preferred batch size (or ``max_batch_size``)
  is reached, or when the oldest request has waited ``max_queue_delay_microseconds``.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import dataclasses
import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from sluice.runtime.backends.base import ModelInstance, Result
from sluice.runtime.errors import (
    Cancelled,
    Internal,
    InvalidArgument,
    QueueFull,
    QueueTimeout,
    Shed,
    SluiceError,
    Unavailable,
)
from sluice.runtime.types import InferRequest

log = logging.getLogger("sluice.runtime.batching")

WORK_CONSERVING = "work_conserving"
FIXED_WAIT = "fixed_wait"
BATCH_POLICIES = (WORK_CONSERVING, FIXED_WAIT)

Clock = Callable[[], int]
"""Monotonic nanoseconds. The scheduler arms loop timers computed from it; a clock that can jump
(a manual clock in tests) may also offer ``watch(callback) -> unwatch``: the scheduler then asks to
be told of every jump (the callback may come from any thread) and re-checks its deadlines at once."""


@dataclasses.dataclass(frozen=True)
class BatchPolicy:
    max_batch_size: int = 0
    """0: the model does not batch; every request runs alone."""
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_ns: int = 0
    mode: str = WORK_CONSERVING
    dynamic: bool = True
    """False when the config has no dynamic_batching: requests still run one at a time."""


@dataclasses.dataclass(frozen=True)
class Pending:
    """What ``decide`` needs to know of a queued request."""

    batch_size: int
    shape_key: tuple
    enqueued_ns: int


@dataclasses.dataclass(frozen=True)
class Dispatch:
    count: int  # take this many requests from the head of the queue


@dataclasses.dataclass(frozen=True)
class Wait:
    until_ns: int | None  # None: nothing to do until something is queued


def decide(queue: Sequence[Pending], now_ns: int, policy: BatchPolicy) -> Dispatch | Wait:
    """Decide what an idle instance should do with the queue (head first, highest priority first)."""
    if not queue:
        return Wait(None)
    if policy.max_batch_size <= 0 or not policy.dynamic:
        return Dispatch(1)
    head = queue[0]
    total = 0
    count = 0
    totals: list[int] = []
    full = False
    for item in queue:
        if item.shape_key != head.shape_key or total + item.batch_size > policy.max_batch_size:
            full = True
            break
        total += item.batch_size
        count += 1
        totals.append(total)
    if count == 0:  # a single request larger than max_batch_size is rejected before queueing
        return Dispatch(1)
    full = full or total >= policy.max_batch_size
    if policy.mode == WORK_CONSERVING:
        return Dispatch(count)
    # fixed_wait, as Triton's dynamic batcher: before the delay has passed, a prefix that reaches a
    # preferred size goes at once (the largest such); a queue past the largest preferred size sends
    # what fits under it; once the delay has passed (or with no delay) everything that fits goes.
    # The delay runs from the oldest request of the batch being formed (Triton's
    # pending_batch_oldest_enqueue_time), not from the head: a higher-priority request that arrives
    # late, or one moved back by a DELAY timeout, must not hold older requests past their delay.
    delay = policy.max_queue_delay_ns
    deadline = min(item.enqueued_ns for item in queue[:count]) + delay
    if delay == 0 or now_ns < deadline:
        preferred = policy.preferred_batch_sizes
        if preferred:
            for i in range(count - 1, -1, -1):
                if totals[i] in preferred:
                    return Dispatch(i + 1)
            cap = max(preferred)
            if total >= cap:
                return Dispatch(max(bisect.bisect_right(totals, cap), 1))
        if delay and not full:
            return Wait(deadline)
    return Dispatch(count)


@dataclasses.dataclass(frozen=True)
class QueuePolicy:
    """Triton's ModelQueuePolicy for one priority level, with Sluice's default timeout."""

    timeout_ns: int = 0  # 0: no timeout
    allow_timeout_override: bool = True
    delay_on_timeout: bool = False  # timeout_action DELAY instead of REJECT
    max_queue_size: int = 0  # 0: unbounded


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    batch: BatchPolicy
    priority_levels: int = 0  # 0: one level
    default_priority: int = 0
    default_queue: QueuePolicy = QueuePolicy()
    queue_by_priority: dict[int, QueuePolicy] = dataclasses.field(default_factory=dict)
    model_label: str = ""
    overload: OverloadPolicy | None = None
    """None turns overload shedding off."""
    worker_spin_us: int = 0
    """How long an instance's worker polls for the next batch before it sleeps (see _Worker)."""


@dataclasses.dataclass(frozen=True)
class OverloadPolicy:
    """CoDel-style shedding: keeps latency bounded when arrivals outpace the model.

    The queue counts as overloaded when it holds more than one full batch per instance and has
    not been empty, with every instance busy, for ``interval_ns`` (an idle instance means requests
    wait by the batching policy's choice). While it is,
    a request that has waited longer than ``max(target_ns, exec_multiple * recent execution
    time)`` is answered at once with UNAVAILABLE instead of being run late for a client that
    has most likely given up. Outside overload only the queue timeout applies.
    """

    interval_ns: int = 100_000_000
    target_ns: int = 5_000_000
    exec_multiple: float = 2.0


def shed_limit(policy: OverloadPolicy, exec_ewma_ns: float) -> int:
    """How long a request may wait while the queue is overloaded (pure)."""
    return max(policy.target_ns, int(policy.exec_multiple * exec_ewma_ns))


class Observer:
    """Hooks the scheduler calls on the event-loop thread (statistics, metrics)."""

    def on_rejected(self, reason: str) -> None:  # reason: "queue_full", "timeout", "cancelled", "shed"
        pass

    def on_batch(
        self,
        requests: Sequence[InferRequest],
        queue_ns: Sequence[int],
        compute_ns: int,
        results: list[Result],
        phases_ns: tuple[int, int] = (0, 0),
    ) -> None:
        """``phases_ns``: the input preparation and output extraction within ``compute_ns``, as the
        instance measured them (``ModelInstance.last_phases_ns``)."""


_QUEUED, _RUNNING, _DONE = 0, 1, 2
# What an answered entry holds instead of its request: answered entries leave the lanes and the
# deadline heap lazily, and must not keep their inputs (memory, or a protocol worker's arena range
# lent to them: worker_wire.Lease) until then.
_ANSWERED = InferRequest("", "", [])


Done = Callable[[Result], None]


def _ignore(outcome: Result) -> None:
    """An answered entry's callback: it is never called twice."""


class _Entry:
    __slots__ = ("deadline", "done", "enqueued", "level", "request", "state")

    def __init__(self, request: InferRequest, done: Done, enqueued: int, deadline: int, level: int):
        self.request = request
        self.done = done
        self.enqueued = enqueued
        self.deadline = deadline
        self.level = level
        self.state = _QUEUED


class _Worker:
    """One thread bound to one model instance (an instance is used by one thread at a time).

    Cheaper than a thread pool plus futures: a SimpleQueue hand-off in, one call_soon_threadsafe out.
    """

    def __init__(
        self,
        instance: ModelInstance,
        name: str,
        loop: asyncio.AbstractEventLoop,
        done: Callable[..., None],
        clock: Clock,
        spin_s: float = 0.0,
    ) -> None:
        self.instance = instance
        self.jobs: queue.SimpleQueue[tuple[list[_Entry], list[int]] | None] = queue.SimpleQueue()
        self.batch: list[_Entry] | None = None  # what it runs now (set and cleared on the loop)
        self._loop = loop
        self._done = done
        self._clock = clock
        self._spin_s = spin_s
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()

    def _next_job(self, spin: bool) -> tuple[list[_Entry], list[int]] | None:
        """Wait for work, polling for ``spin_s`` first when ``spin``: a core that stays busy between
        requests does not drop into an idle state, which cost ~60 us per bs1 onnxruntime call
        (measured), and no futex wake is needed. Polling yields the GIL every turn (``sleep(0)``).
        Only after single-request batches: under load batches grow and the CPU is better spent
        on the event loop."""
        jobs = self.jobs
        if spin and self._spin_s > 0:
            until = time.perf_counter() + self._spin_s
            while True:
                try:
                    return jobs.get_nowait()
                except queue.Empty:
                    if time.perf_counter() > until:
                        break
                    time.sleep(0)
        return jobs.get()

    def _main(self) -> None:
        spin = False
        while True:
            job = self._next_job(spin)
            if job is None:
                return
            batch, queue_ns = job
            spin = len(batch) == 1
            requests = [entry.request for entry in batch]
            start = self._clock()
            try:
                results = self.instance.execute(requests)
            except SluiceError as exc:
                results = [exc] * len(requests)
            except BaseException as exc:  # a backend bug (even SystemExit from model code) must reach
                # the clients, not kill the worker and strand the batch
                results = [Internal(f"backend failed: {type(exc).__name__}: {exc}")] * len(requests)
            if len(results) != len(requests):
                results = [Internal(f"backend returned {len(results)} results for {len(requests)} requests")] * len(
                    requests
                )
            compute_ns = self._clock() - start
            phases_ns = self.instance.last_phases_ns
            try:
                self._loop.call_soon_threadsafe(
                    self._done, self, batch, requests, queue_ns, results, compute_ns, start, phases_ns
                )
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                return
            # not kept while waiting for the next job: the batch's requests (and the arena ranges
            # protocol workers lent them, worker_wire.Lease) go when the loop has answered them
            del job, batch, requests, results

    def stop(self) -> None:
        self.jobs.put(None)


def _join_all(workers: list[_Worker], stuck: list[_Worker], timeout_s: float) -> None:
    """Join idle workers (they exit at once) and busy ones for at most ``timeout_s`` in all."""
    end = time.monotonic() + timeout_s
    for worker in workers:
        worker.thread.join(max(end - time.monotonic(), 0.0) if worker in stuck else None)


def _close_all(instances: Sequence[ModelInstance], label: str) -> None:
    for instance in instances:
        try:
            instance.close()
        except Exception:  # a failing finalize must not stop the others
            log.exception("model '%s': closing an instance failed", label)


async def wait_idle(idle: asyncio.Event | None, busy: bool, deadline: float) -> None:
    """Wait until a scheduler that is ``busy`` sets ``idle``, or the loop's clock reaches ``deadline``."""
    if idle is None or not busy:
        return
    loop = asyncio.get_running_loop()
    try:
        await asyncio.wait_for(idle.wait(), max(deadline - loop.time(), 0.0))
    except TimeoutError:
        pass


async def retire(
    workers: list[_Worker], stuck: list[_Worker], instances: Sequence[ModelInstance], deadline: float, label: str
) -> None:
    """Stop a closing scheduler's workers, join them (the ``stuck`` ones, still executing, until ``deadline``
    of the loop's clock) and close every instance no thread still runs; one still executing is left to its
    thread, never closed under it."""
    loop = asyncio.get_running_loop()
    for worker in workers:
        worker.stop()
    if workers:
        await loop.run_in_executor(None, _join_all, workers, stuck, max(deadline - loop.time(), 0.0))
    running = [worker.instance for worker in workers if worker.thread.is_alive()]
    closing = []
    for instance in instances:
        if any(instance is other for other in running):
            log.warning(
                "model '%s': an instance is still executing after the grace period; left running, not closed", label
            )
            continue
        closing.append(instance)
    if closing:  # off the loop: a Python model's finalize may block
        await loop.run_in_executor(None, _close_all, closing, label)


class Scheduler:
    """Queues requests for one model version and runs them in batches on its instances."""

    def __init__(
        self,
        config: SchedulerConfig,
        instances: Sequence[ModelInstance],
        *,
        clock: Clock = time.monotonic_ns,
        observer: Observer | None = None,
    ) -> None:
        if not instances:
            raise ValueError("a scheduler needs at least one instance")
        self._config = config
        self._instances = list(instances)
        self._free: list[_Worker] = []  # filled by start()
        self._clock = clock
        self._observer = observer or Observer()
        levels = max(config.priority_levels, 1)
        # One FIFO per priority level, then one lane for DELAYed (timed-out) requests.
        self._lanes: list[collections.deque[_Entry]] = [collections.deque() for _ in range(levels + 1)]
        self._policies = [config.queue_by_priority.get(level + 1, config.default_queue) for level in range(levels)]
        self._pending = 0
        self._queued = [0] * levels  # per priority level, DELAYed requests included (as Triton counts)
        self._last_empty = clock()
        # Never shed below one full batch per instance: a backlog that small drains in one round,
        # and bounded closed-loop clients (concurrency <= max_batch_size) cannot overload at all.
        self._backlog_floor = max(config.batch.max_batch_size, 1) * len(self._instances)
        batch = config.batch
        self._dispatch_alone = batch.mode == WORK_CONSERVING or not batch.dynamic or batch.max_batch_size <= 0
        self._exec_ewma_ns = 0.0
        self._running = 0
        self._deadlines: list[tuple[int, int, _Entry]] = []
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: int | None = None
        self._workers: list[_Worker] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._unwatch: Callable[[], None] | None = None
        self._idle: asyncio.Event | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        label = self._config.model_label or "model"
        self._workers = [
            _Worker(
                instance,
                f"sluice-{label}-{index}",
                self._loop,
                self._done,
                self._clock,
                self._config.worker_spin_us / 1e6,
            )
            for index, instance in enumerate(self._instances)
        ]
        self._free = list(self._workers)
        self._idle = asyncio.Event()
        self._idle.set()
        watch = getattr(self._clock, "watch", None)
        if watch is not None:
            loop = self._loop
            self._unwatch = watch(lambda: loop.call_soon_threadsafe(self._on_clock_jump))

    async def aclose(self, grace_s: float = 30.0) -> None:
        """Stop taking requests, let queued and running ones finish within ``grace_s``, close.

        Returns within about ``grace_s`` even when a model hangs in ``execute``: what is still
        queued or running then is answered UNAVAILABLE (running requests are also cancelled, for a
        model that checks), and an instance still executing is left to its thread, never closed
        under it.
        """
        self._closing = True
        if self._unwatch is not None:
            self._unwatch()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(grace_s, 0.0)
        await wait_idle(self._idle, bool(self._pending or self._running), deadline)
        workers, self._workers = self._workers, []
        stuck = [worker for worker in workers if worker.batch is not None]
        for worker in stuck:
            for entry in worker.batch or ():
                if entry.state == _DONE:
                    continue
                entry.request.cancel.cancel()
                self._finish(
                    entry,
                    Unavailable(
                        f"model '{self._config.model_label}' was unloaded while this request was still executing: "
                        f"it did not finish within the {grace_s:g} s grace period"
                    ),
                )
        for lane in self._lanes:
            while lane:
                self._finish(lane.popleft(), Unavailable("the model is being unloaded"))
        self._pending = 0
        self._queued = [0] * len(self._queued)
        if self._timer is not None:
            self._timer.cancel()
        await retire(workers, stuck, self._instances, deadline, self._config.model_label)

    @property
    def queue_depth(self) -> int:
        return self._pending

    @property
    def in_flight(self) -> int:
        return self._pending + self._running

    # -- submission --------------------------------------------------------------------------
    async def submit(self, request: InferRequest, priority: int = 0, timeout_us: int | None = None) -> Result:
        """Queue ``request`` and wait for its result; raises SluiceError subclasses."""
        future = self.enqueue(request, priority, timeout_us)
        try:
            return await future
        except asyncio.CancelledError:
            request.cancel.cancel()
            raise

    def enqueue(self, request: InferRequest, priority: int = 0, timeout_us: int | None = None) -> asyncio.Future:
        """Queue ``request``; the returned future resolves to its result or a SluiceError.

        The caller cancels through ``request.cancel`` when its client goes away.
        """
        future = asyncio.get_running_loop().create_future()

        def done(outcome: Result) -> None:
            if not future.done():
                if isinstance(outcome, SluiceError):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)

        self.enqueue_callback(request, done, priority, timeout_us)
        return future

    def enqueue_callback(
        self, request: InferRequest, done: Done, priority: int = 0, timeout_us: int | None = None
    ) -> None:
        """Queue ``request``; ``done`` is called once, on the event loop, with its result or a
        SluiceError. Raises for immediate rejections (queue full, bad priority, unloading).

        The form for protocol layers that avoid a task and a future per request; the caller
        cancels through ``request.cancel`` when its client goes away.
        """
        if self._closing or self._loop is None:
            raise Unavailable(f"model '{self._config.model_label}' is not accepting requests (unloading)")
        level = self._level(priority)
        policy = self._policies[level]
        if policy.max_queue_size and self._queued[level] >= policy.max_queue_size:
            self._observer.on_rejected("queue_full")
            where = f" at priority {level + 1}" if self._config.priority_levels > 1 else ""
            raise QueueFull(
                f"model '{self._config.model_label}' queue is full: {self._queued[level]} requests queued{where}, "
                f"max_queue_size is {policy.max_queue_size}"
            )
        now = self._clock()
        if self._free and self._pending == 0 and self._dispatch_alone and not request.cancel.cancelled:
            # Idle instance, empty queue, a policy that would dispatch at once: skip the queue.
            entry = _Entry(request, done, now, 0, level)
            entry.state = _RUNNING
            self._running += 1
            self._last_empty = now
            if self._idle is not None:
                self._idle.clear()
            self._run(self._free.pop(), [entry], now)
            return
        timeout_ns = policy.timeout_ns
        if timeout_us is not None:
            if not policy.allow_timeout_override:
                pass  # Triton ignores the override silently; we keep the model's timeout
            elif timeout_us > 0:
                timeout_ns = timeout_us * 1000 if timeout_ns == 0 else min(timeout_ns, timeout_us * 1000)
        deadline = now + timeout_ns if timeout_ns > 0 else 0
        entry = _Entry(request, done, now, deadline, level)
        self._lanes[level].append(entry)
        if self._pending == 0:
            self._last_empty = now  # the queue was empty until this request
        self._pending += 1
        self._queued[level] += 1
        if self._idle is not None:
            self._idle.clear()
        if deadline:
            heapq.heappush(self._deadlines, (deadline, next(self._seq), entry))
            if self._timer_at is None or deadline < self._timer_at:
                self._arm(deadline)
        request.cancel.on_cancel(lambda: self._cancel(entry))
        if self._free:
            self._pump()

    def _level(self, priority: int) -> int:
        levels = max(self._config.priority_levels, 1)
        if priority == 0:
            priority = self._config.default_priority or 1
        if self._config.priority_levels == 0:
            return 0
        if not 1 <= priority <= levels:
            raise InvalidArgument(
                f"priority {priority} is out of range for model '{self._config.model_label}': "
                f"allowed 1..{levels} (1 is highest), or 0 for the default"
            )
        return priority - 1

    # -- internals ---------------------------------------------------------------------------
    def _cancel(self, entry: _Entry) -> None:
        if entry.state == _QUEUED:
            self._pending -= 1
            self._queued[entry.level] -= 1
            self._observer.on_rejected("cancelled")
            self._finish(entry, Cancelled("the request was cancelled by the client before it ran"))
            self._drop_dead()
            self._maybe_idle()

    def _drop_dead(self) -> None:
        """Answered entries leave the lanes and the deadline heap lazily, at their heads, when an
        instance takes work. While every instance is busy they pile up behind a live one as clients
        give up and retry (without their requests: ``_finish`` lets go of those); past twice the
        live queue, sweep them out (amortized O(1) per request)."""
        bound = 2 * self._pending + 64
        for lane in self._lanes:
            if len(lane) > bound:
                live = [entry for entry in lane if entry.state == _QUEUED]
                lane.clear()
                lane.extend(live)
        if len(self._deadlines) > bound:
            self._deadlines = [item for item in self._deadlines if item[2].state == _QUEUED]
            heapq.heapify(self._deadlines)

    def _finish(self, entry: _Entry, outcome: Result) -> None:
        if entry.state == _DONE:
            return
        entry.state = _DONE
        entry.request.cancel.clear()
        done, entry.done, entry.request = entry.done, _ignore, _ANSWERED
        try:
            done(outcome)
        except Exception:  # a failing caller must not leave the rest of its batch unanswered
            log.exception("completion callback failed for a request of model '%s'", self._config.model_label)

    def _maybe_idle(self) -> None:
        if self._pending == 0 and self._running == 0 and self._idle is not None:
            self._idle.set()

    def _arm(self, at_ns: int) -> None:
        assert self._loop is not None
        if self._timer is not None:
            self._timer.cancel()
        delay = max(at_ns - self._clock(), 0) / 1e9
        self._timer_at = at_ns
        self._timer = self._loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self._pump()

    def _on_clock_jump(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._on_timer()

    def _expire(self, now: int) -> None:
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, _, entry = heapq.heappop(heap)
            if entry.state != _QUEUED:
                continue
            if self._policies[entry.level].delay_on_timeout:
                # behind every request that has not timed out; it keeps its level for the queue bound
                self._lanes[entry.level].remove(entry)
                self._lanes[-1].append(entry)
                continue
            self._pending -= 1
            self._queued[entry.level] -= 1
            self._observer.on_rejected("timeout")
            waited_us = (now - entry.enqueued) // 1000
            self._finish(
                entry,
                QueueTimeout(
                    f"Request timeout expired: request for model '{self._config.model_label}' timed out in the "
                    "queue after "
                    f"{waited_us} us (queue timeout {(entry.deadline - entry.enqueued) // 1000} us); "
                    "it was not executed"
                ),
            )
        self._drop_dead()

    def _shed(self, now: int, max_wait_ns: int) -> None:
        """Answer queued requests older than ``max_wait_ns`` with UNAVAILABLE (oldest are at lane heads)."""
        for lane in self._lanes:
            while lane:
                entry = lane[0]
                if entry.state != _QUEUED:
                    lane.popleft()
                    continue
                waited = now - entry.enqueued
                if waited <= max_wait_ns or self._pending <= self._backlog_floor:
                    break
                lane.popleft()
                self._pending -= 1
                self._queued[entry.level] -= 1
                self._observer.on_rejected("shed")
                self._finish(
                    entry,
                    Shed(
                        f"model '{self._config.model_label}' is overloaded: the request waited {waited // 1000} us "
                        f"while the queue has not drained for over {(now - self._last_empty) // 1_000_000} ms; "
                        f"requests waiting over {max_wait_ns // 1000} us are shed so served latency stays bounded "
                        "(it was not executed; retry later or add instances)"
                    ),
                )
        if self._pending == 0:
            self._last_empty = now

    def _snapshot(self, limit: int) -> list[_Entry]:
        """Live entries in dispatch order, dropping dead ones from the lane heads."""
        out: list[_Entry] = []
        for lane in self._lanes:
            while lane and lane[0].state != _QUEUED:
                lane.popleft()
            for entry in lane:
                if entry.state == _QUEUED:
                    out.append(entry)
                    if len(out) >= limit:
                        return out
        return out

    def _pump(self, freed: bool = False) -> None:
        """Dispatch batches to idle instances while the policy says so.

        ``freed``: called because an execution just finished (that instance was busy until now).
        """
        now = self._clock()
        if len(self._free) > freed:
            # An instance sat idle: whatever waits does so by the batching policy, not overload.
            self._last_empty = now
        if self._deadlines and self._deadlines[0][0] <= now:
            self._expire(now)
            self._maybe_idle()
        overload = self._config.overload
        if (
            overload is not None
            and self._pending
            and self._exec_ewma_ns  # no execution seen yet: nothing to judge lateness by
            and now - self._last_empty > overload.interval_ns
            and self._pending > self._backlog_floor
        ):
            self._shed(now, shed_limit(overload, self._exec_ewma_ns))
        batch_policy = self._config.batch
        limit = max(batch_policy.max_batch_size, 1)
        while self._free and self._pending:
            entries = self._snapshot(limit)
            if not entries:
                break
            decision = decide(
                [Pending(e.request.batch_size, e.request.shape_key, e.enqueued) for e in entries],
                now,
                batch_policy,
            )
            if isinstance(decision, Wait):
                if decision.until_ns is not None and (self._timer_at is None or decision.until_ns < self._timer_at):
                    self._arm(decision.until_ns)
                break
            batch = entries[: decision.count]
            for entry in batch:
                entry.state = _RUNNING  # left in its lane; _snapshot drops non-queued heads lazily
                self._queued[entry.level] -= 1
            self._pending -= len(batch)
            self._running += len(batch)
            if self._pending == 0:
                self._last_empty = now
            self._run(self._free.pop(), batch, now)
        if self._free:
            # An instance is idle: whatever still waits does so by the batching policy, not overload.
            self._last_empty = now
        if len(self._deadlines) > 2 * self._pending + 64:
            # Dispatched entries leave the deadline heap lazily; compact it so it (and the requests
            # it references) stays proportional to the queue, not to the traffic of the last timeout.
            self._drop_dead()
        if self._deadlines and (self._timer_at is None or self._deadlines[0][0] < self._timer_at):
            # lazily drop dead heads so the timer tracks a live deadline
            while self._deadlines and self._deadlines[0][2].state != _QUEUED:
                heapq.heappop(self._deadlines)
            if self._deadlines and (self._timer_at is None or self._deadlines[0][0] < self._timer_at):
                self._arm(self._deadlines[0][0])

    def _run(self, worker: _Worker, batch: list[_Entry], now: int) -> None:
        worker.batch = batch
        worker.jobs.put((batch, [now - entry.enqueued for entry in batch]))

    def _done(
        self,
        worker: _Worker,
        batch: list[_Entry],
        requests: list[InferRequest],
        queue_ns: list[int],
        results: list[Result],
        compute_ns: int,
        start_ns: int = 0,
        phases_ns: tuple[int, int] = (0, 0),
    ) -> None:
        """Called on the loop (call_soon_threadsafe) when a worker finished a batch."""
        worker.batch = None
        self._free.append(worker)
        self._running -= len(batch)
        # the requests as the worker ran them: an answered entry has let go of its own (a batch that
        # outlived an unload's grace period was answered then)
        for entry, request, result, waited in zip(batch, requests, results, queue_ns, strict=True):
            trace = request.trace
            if trace is not None:  # sampled (tracing.py): the timestamps taken anyway, before it is answered
                rows = sum(r.batch_size for r in requests)
                trace.executed(entry.enqueued, waited, start_ns, compute_ns, rows, len(batch))
            self._finish(entry, result)
        self._exec_ewma_ns = compute_ns if not self._exec_ewma_ns else 0.8 * self._exec_ewma_ns + 0.2 * compute_ns
        # as Triton counts it, a request's queue time runs until its compute starts (the hand-off to
        # the instance's thread included); the trace above shows the hand-off as its own span
        waited_ns = [start_ns - entry.enqueued for entry in batch] if start_ns else queue_ns
        self._observer.on_batch(requests, waited_ns, compute_ns, results, phases_ns=phases_ns)
        self._maybe_idle()
        if self._pending:
            self._pump(freed=True)
