"""Batch formation (``decide``) and the ``Scheduler``, driven by a fake clock and fake instances.

The scheduler arms real loop timers computed from its injected clock, so every timeout here is a
few milliseconds of fake time: a timer fires after that many real milliseconds and then the fake
clock alone decides whether a deadline has passed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from sluice.runtime.backends.base import ModelInstance, Result
from sluice.runtime.batching import (
    FIXED_WAIT,
    WORK_CONSERVING,
    BatchPolicy,
    Dispatch,
    Observer,
    OverloadPolicy,
    Pending,
    QueuePolicy,
    Scheduler,
    SchedulerConfig,
    Wait,
    decide,
    shed_limit,
)
from sluice.runtime.errors import (
    Cancelled,
    ConfigError,
    Internal,
    InvalidArgument,
    ModelError,
    QueueFull,
    QueueTimeout,
    Unavailable,
)
from sluice.runtime.repository import scheduler_config
from sluice.runtime.settings import SchedulingDefaults
from sluice.runtime.types import InferRequest, InferResponse, Tensor

MS = 1_000_000  # ns
US = 1_000  # ns

# -- decide ------------------------------------------------------------------------------------


def q(*sizes: int, shapes: Sequence[tuple] | None = None, enqueued: Sequence[int] | None = None) -> list[Pending]:
    return [Pending(size, shapes[i] if shapes else (), enqueued[i] if enqueued else 0) for i, size in enumerate(sizes)]


WC = BatchPolicy(max_batch_size=8, max_queue_delay_ns=100, mode=WORK_CONSERVING)
FW = BatchPolicy(max_batch_size=8, max_queue_delay_ns=100, mode=FIXED_WAIT)


def fw(**changes: object) -> BatchPolicy:
    return BatchPolicy(**{"max_batch_size": 8, "max_queue_delay_ns": 100, "mode": FIXED_WAIT, **changes})


DECIDE_CASES = [
    # (id, queue, now, policy, expected)
    ("empty queue waits for a request", [], 0, WC, Wait(None)),
    ("empty queue, fixed_wait", [], 0, FW, Wait(None)),
    ("max_batch_size 0 runs requests alone", q(1, 1, 1), 0, BatchPolicy(max_batch_size=0), Dispatch(1)),
    ("no dynamic_batching runs requests alone", q(1, 1), 0, BatchPolicy(max_batch_size=8, dynamic=False), Dispatch(1)),
    ("wc: dispatch everything at once", q(1, 1, 1), 0, WC, Dispatch(3)),
    ("wc: a single request is not delayed", q(1), 0, WC, Dispatch(1)),
    ("wc: capped by max_batch_size", q(*[1] * 10), 0, BatchPolicy(max_batch_size=4), Dispatch(4)),
    ("wc: batch sizes add up", q(2, 2, 2), 0, BatchPolicy(max_batch_size=5), Dispatch(2)),
    ("wc: exact fit", q(3, 5, 1), 0, WC, Dispatch(2)),
    ("wc: shape key stops the batch", q(1, 1, 1, 1, shapes=[(2,), (2,), (3,), (2,)]), 0, WC, Dispatch(2)),
    ("wc: head larger than max_batch_size runs alone", q(10, 1), 0, BatchPolicy(max_batch_size=4), Dispatch(1)),
    ("wc: preferred sizes do not make it wait", q(1), 0, BatchPolicy(8, (4,), 100, WORK_CONSERVING), Dispatch(1)),
    ("fw: lone request waits for the delay", q(1), 0, FW, Wait(100)),
    ("fw: delay counts from the oldest request", q(1, 1, enqueued=[50, 90]), 60, FW, Wait(150)),
    ("fw: dispatch when the delay has passed", q(1, 1), 100, FW, Dispatch(2)),
    # a younger head: a higher-priority request queued later, or an older one moved back by DELAY
    ("fw: delay runs from the batch's oldest, not the head", q(1, 1, enqueued=[90, 0]), 60, FW, Wait(100)),
    ("fw: older request past its delay goes with the head", q(1, 1, enqueued=[90, 0]), 100, FW, Dispatch(2)),
    ("fw: dispatch at once when max_batch_size is reached", q(*[1] * 8), 0, FW, Dispatch(8)),
    ("fw: more than fits dispatches a full batch", q(*[1] * 9), 0, FW, Dispatch(8)),
    ("fw: next request would overflow -> send now", q(4, 3, 2), 0, FW, Dispatch(2)),
    ("fw: incompatible shape -> send now", q(1, 1, 1, shapes=[(1,), (1,), (2,)]), 0, FW, Dispatch(2)),
    ("fw: head larger than max_batch_size runs alone", q(10), 0, fw(max_batch_size=4), Dispatch(1)),
    ("fw: preferred size reached -> at once", q(1, 1), 0, fw(preferred_batch_sizes=(2, 4)), Dispatch(2)),
    ("fw: largest preferred prefix", q(1, 1, 1), 0, fw(preferred_batch_sizes=(2, 4)), Dispatch(2)),
    ("fw: largest preferred prefix of many", q(*[1] * 5), 0, fw(preferred_batch_sizes=(2, 4)), Dispatch(4)),
    ("fw: no preferred size yet -> wait", q(1, 1, 1), 0, fw(preferred_batch_sizes=(4,)), Wait(100)),
    ("fw: delay passed -> send all pending", q(1, 1, 1), 100, fw(preferred_batch_sizes=(4,)), Dispatch(3)),
    ("fw: delay passed sends past preferred", q(*[1] * 6), 100, fw(preferred_batch_sizes=(2, 4)), Dispatch(6)),
    ("fw: past the largest preferred size -> what fits", q(3, 3), 0, fw(preferred_batch_sizes=(4,)), Dispatch(1)),
    ("fw: delay 0 never waits", q(1), 0, fw(max_queue_delay_ns=0), Dispatch(1)),
    ("fw: delay 0 still prefers", q(1, 1, 1), 0, fw(max_queue_delay_ns=0, preferred_batch_sizes=(2,)), Dispatch(2)),
]


@pytest.mark.parametrize(
    ("queue", "now", "policy", "expected"), [c[1:] for c in DECIDE_CASES], ids=[c[0] for c in DECIDE_CASES]
)
def test_decide(queue, now, policy, expected):
    assert decide(queue, now, policy) == expected


def test_decide_never_exceeds_max_batch_size_nor_mixes_shapes():
    """A property over many small queues: a dispatched prefix fits and shares the head's shape."""
    rng = np.random.default_rng(7)
    for _ in range(500):
        n = int(rng.integers(1, 8))
        sizes = [int(s) for s in rng.integers(1, 5, n)]
        shapes = [(int(s),) for s in rng.integers(0, 2, n)]
        mbs = int(rng.integers(1, 9))
        mode = WORK_CONSERVING if rng.integers(0, 2) else FIXED_WAIT
        preferred = tuple(sorted({int(p) for p in rng.integers(1, mbs + 1, int(rng.integers(0, 3)))}))
        policy = BatchPolicy(mbs, preferred, 100, mode)
        decision = decide(q(*sizes, shapes=shapes), int(rng.integers(0, 200)), policy)
        if isinstance(decision, Wait):
            assert mode == FIXED_WAIT and decision.until_ns == 100
            continue
        taken = decision.count
        assert 1 <= taken <= n
        assert all(shape == shapes[0] for shape in shapes[:taken])
        assert taken == 1 or sum(sizes[:taken]) <= mbs


# -- Scheduler test doubles ----------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000 * MS

    def __call__(self) -> int:
        return self.now

    def advance(self, ns: int) -> None:
        self.now += ns


class FakeInstance(ModelInstance):
    """Doubles each request's input; records batches; ``gate`` closed blocks every execute."""

    def __init__(self, gate: threading.Event | None = None, fail: Exception | None = None) -> None:
        self.gate = gate or threading.Event()
        if gate is None:
            self.gate.set()
        self.batches: list[list[str]] = []
        self.running = 0
        self.peak = 0
        self.closed = False
        self.fail = fail
        self.thread_names: list[str] = []
        self._lock = threading.Lock()

    def execute(self, requests: Sequence[InferRequest]) -> list[Result]:
        with self._lock:
            self.batches.append([r.id for r in requests])
            self.running += 1
            self.peak = max(self.peak, self.running)
            self.thread_names.append(threading.current_thread().name)
        try:
            assert self.gate.wait(5), "test never opened the gate"
            if self.fail is not None:
                raise self.fail
            return [InferResponse("m", "1", [Tensor("OUT", "INT32", r.inputs[0].data * 2)], id=r.id) for r in requests]
        finally:
            with self._lock:
                self.running -= 1

    def close(self) -> None:
        self.closed = True

    @property
    def executed(self) -> list[str]:
        return [rid for batch in self.batches for rid in batch]


class Recorder(Observer):
    def __init__(self) -> None:
        self.rejected: list[str] = []
        self.batch_sizes: list[int] = []

    def on_rejected(self, reason: str) -> None:
        self.rejected.append(reason)

    def on_batch(self, requests, queue_ns, compute_ns, results, phases_ns=(0, 0)) -> None:
        self.batch_sizes.append(len(requests))
        self.queue_ns = getattr(self, "queue_ns", []) + list(queue_ns)


def request(rid: str, value: int = 0, batch_size: int = 1, shape_key: tuple = ()) -> InferRequest:
    data = np.full((batch_size, 1), value, dtype=np.int32)
    return InferRequest("m", "1", [Tensor("IN", "INT32", data)], id=rid, batch_size=batch_size, shape_key=shape_key)


async def eventually(predicate: Callable[[], bool], timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.001)


async def settle(ms: float = 20) -> None:
    """Let real timers armed from the fake clock fire (the fake clock decides what they do)."""
    await asyncio.sleep(ms / 1000)


def config(
    max_batch_size: int = 8,
    *,
    mode: str = WORK_CONSERVING,
    delay_ns: int = 0,
    preferred: tuple[int, ...] = (),
    queue: QueuePolicy | None = None,
    levels: int = 0,
    default_priority: int = 0,
    by_priority: dict[int, QueuePolicy] | None = None,
) -> SchedulerConfig:
    return SchedulerConfig(
        batch=BatchPolicy(max_batch_size, preferred, delay_ns, mode),
        priority_levels=levels,
        default_priority=default_priority,
        default_queue=queue or QueuePolicy(),
        queue_by_priority=by_priority or {},
        model_label="m:1",
    )


class Harness:
    """A started scheduler over gated fake instances; closed by the fixture."""

    def __init__(self, cfg: SchedulerConfig, instances: int = 1) -> None:
        self.clock = FakeClock()
        self.gate = threading.Event()
        self.instances = [FakeInstance(self.gate) for _ in range(instances)]
        self.observer = Recorder()
        self.scheduler = Scheduler(cfg, self.instances, clock=self.clock, observer=self.observer)
        self.scheduler.start()
        self.tasks: dict[str, asyncio.Task] = {}
        self.closing: asyncio.Future | None = None

    def aclose(self, grace_s: float = 2.0) -> asyncio.Future:
        self.closing = asyncio.ensure_future(self.scheduler.aclose(grace_s))
        return self.closing

    def submit(self, rid: str, value: int = 0, priority: int = 0, timeout_us: int | None = None, **kw) -> asyncio.Task:
        req = request(rid, value, **kw)
        task = asyncio.ensure_future(self.scheduler.submit(req, priority, timeout_us))
        task.request = req  # type: ignore[attr-defined]
        self.tasks[rid] = task
        return task

    async def put(
        self, rid: str, value: int = 0, priority: int = 0, timeout_us: int | None = None, **kw
    ) -> asyncio.Task:
        """Submit and let the submission reach the queue now (so a later fake-clock step comes after it)."""
        task = self.submit(rid, value, priority, timeout_us, **kw)
        await asyncio.sleep(0)
        return task

    @property
    def batches(self) -> list[list[str]]:
        return [b for inst in self.instances for b in inst.batches]

    @property
    def executed(self) -> list[str]:
        return [rid for inst in self.instances for rid in inst.executed]

    async def started(self, count: int) -> None:
        await eventually(lambda: len(self.batches) >= count)

    async def busy(self) -> None:
        """Occupy the only instance with request 'busy' and wait until it runs."""
        self.submit("busy")
        await self.started(1)


@pytest.fixture
async def harness():
    made: list[Harness] = []

    def make(cfg: SchedulerConfig, instances: int = 1) -> Harness:
        h = Harness(cfg, instances)
        made.append(h)
        return h

    yield make
    for h in made:
        h.gate.set()
        await asyncio.wait_for(h.closing or h.aclose(), 5)
        for task in h.tasks.values():
            if not task.done():
                task.cancel()
        await asyncio.gather(*h.tasks.values(), return_exceptions=True)


def value_of(result: Result) -> int:
    assert isinstance(result, InferResponse), result
    return int(result.outputs[0].data.ravel()[0])


# -- Scheduler: batching -------------------------------------------------------------------------


async def test_idle_instance_dispatches_at_once_despite_large_delay(harness):
    h = harness(config(8, delay_ns=10_000 * MS))
    h.gate.set()
    result = await asyncio.wait_for(h.submit("a", 21), 1)
    assert value_of(result) == 42
    assert h.batches == [["a"]]


async def test_requests_merge_while_the_instance_is_busy_and_results_split_back(harness):
    h = harness(config(8, delay_ns=10_000 * MS))
    await h.busy()
    tasks = [h.submit(f"r{i}", i) for i in range(5)]
    await asyncio.sleep(0.01)
    assert h.batches == [["busy"]]  # queued, not dispatched, while the instance works
    assert h.scheduler.queue_depth == 5
    h.gate.set()
    results = await asyncio.wait_for(asyncio.gather(*tasks), 2)
    assert [value_of(r) for r in results] == [0, 2, 4, 6, 8]
    assert [r.id for r in results] == [f"r{i}" for i in range(5)]
    assert h.batches == [["busy"], ["r0", "r1", "r2", "r3", "r4"]]
    assert h.observer.batch_sizes == [1, 5]


class HandOffClock(FakeClock):
    """The hand-off to an instance's thread takes 3 ms: read from a worker thread, the clock is that late."""

    def __call__(self) -> int:
        late = threading.current_thread() is not threading.main_thread()
        return self.now + (3 * MS if late else 0)


async def test_queue_time_runs_until_compute_starts_as_triton_counts_it(harness):
    h = harness(config(8))
    h.scheduler._clock = h.clock = clock = HandOffClock()
    for worker in h.scheduler._workers:
        worker._clock = clock
    await h.busy()
    task = await h.put("a", 1)
    clock.advance(5 * MS)
    h.gate.set()
    await asyncio.wait_for(task, 2)
    await eventually(lambda: len(h.observer.queue_ns) == 2)
    # "busy" waited for nothing but the hand-off; "a" 5 ms in the queue, then the hand-off
    assert h.observer.queue_ns == [3 * MS, 8 * MS]


async def test_max_batch_size_and_row_counts_split_the_queue(harness):
    h = harness(config(4))
    await h.busy()
    tasks = [h.submit("a", 1, batch_size=2), h.submit("b", 2, batch_size=2), h.submit("c", 3, batch_size=1)]
    tasks += [h.submit(f"d{i}", 4) for i in range(3)]
    await asyncio.sleep(0.005)
    h.gate.set()
    results = await asyncio.wait_for(asyncio.gather(*tasks), 2)
    assert [value_of(r) for r in results] == [2, 4, 6, 8, 8, 8]
    assert results[0].outputs[0].data.shape == (2, 1)
    assert h.batches == [["busy"], ["a", "b"], ["c", "d0", "d1", "d2"]]


async def test_incompatible_shapes_go_in_separate_batches(harness):
    h = harness(config(8))
    await h.busy()
    tasks = [h.submit("x1", shape_key=(1,)), h.submit("y", shape_key=(2,)), h.submit("x2", shape_key=(1,))]
    await asyncio.sleep(0.005)
    h.gate.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 2)
    assert h.batches == [["busy"], ["x1"], ["y", "x2"]] or h.batches == [["busy"], ["x1"], ["y"], ["x2"]]
    assert all(len({r[0] for r in b}) == 1 for b in h.batches[1:])


async def test_model_without_batching_runs_requests_one_by_one(harness):
    h = harness(config(0, delay_ns=10 * MS))
    await h.busy()
    tasks = [h.submit(f"r{i}", i) for i in range(3)]
    await asyncio.sleep(0.005)
    h.gate.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 2)
    assert h.batches == [["busy"], ["r0"], ["r1"], ["r2"]]


async def test_fixed_wait_waits_for_the_delay_on_the_fake_clock(harness):
    h = harness(config(4, mode=FIXED_WAIT, delay_ns=5 * MS))
    h.gate.set()
    first = await h.put("a", 1)
    await settle(20)  # real timers fire, but 0 ns of fake time passed
    assert h.batches == []
    second = await h.put("b", 2)
    await settle(10)
    assert h.batches == []
    h.clock.advance(5 * MS)
    await h.started(1)
    assert h.batches == [["a", "b"]]
    assert [value_of(r) for r in await asyncio.gather(first, second)] == [2, 4]


async def test_fixed_wait_delay_runs_from_the_oldest_request_not_a_later_higher_priority_one(harness):
    """A priority-2 request waits; a priority-1 request arriving 4 ms later goes to the head of the
    queue. The batch of both leaves when the older one's delay (5 ms) has passed, not 5 ms after the
    newer head (Triton's pending_batch_oldest_enqueue_time)."""
    h = harness(config(4, mode=FIXED_WAIT, delay_ns=5 * MS, levels=2))
    h.gate.set()
    low = await h.put("low", 1, priority=2)
    h.clock.advance(4 * MS)
    high = await h.put("high", 2, priority=1)
    await settle(10)
    assert h.batches == []
    h.clock.advance(1 * MS)  # 5 ms after 'low', 1 ms after 'high'
    await h.started(1)
    assert h.batches == [["high", "low"]]
    assert [value_of(r) for r in await asyncio.gather(low, high)] == [2, 4]


async def test_fixed_wait_dispatches_a_full_or_preferred_batch_at_once(harness):
    h = harness(config(4, mode=FIXED_WAIT, delay_ns=10_000 * MS, preferred=(3,)))
    h.gate.set()
    tasks = [h.submit(f"r{i}") for i in range(2)]
    await settle(5)
    assert h.batches == []
    tasks.append(h.submit("r2"))
    await h.started(1)
    assert h.batches == [["r0", "r1", "r2"]]
    await asyncio.wait_for(asyncio.gather(*tasks), 2)


async def test_fixed_wait_timer_is_not_pushed_back_by_a_later_queue_deadline(harness):
    """Regression: dropping finished entries from the deadline heap re-armed the timer at the next
    request's queue deadline (seconds away), cancelling the earlier fixed_wait dispatch."""
    h = harness(config(2, mode=FIXED_WAIT, delay_ns=5 * MS, queue=QueuePolicy(timeout_ns=10_000 * MS)), instances=2)
    h.gate.set()
    pair = [h.submit("a", timeout_us=2_000), h.submit("b")]  # full batch: dispatched at once
    await h.started(1)
    await asyncio.gather(*pair)
    late = await h.put("c")
    await settle(20)  # timers armed for 'a' fire and re-arm while fake time stands still
    assert h.batches == [["a", "b"]]
    h.clock.advance(5 * MS)
    await asyncio.wait_for(late, 0.5)
    assert h.batches == [["a", "b"], ["c"]]


async def test_instances_run_batches_concurrently_off_the_loop(harness):
    h = harness(config(1), instances=2)
    tasks = [h.submit(f"r{i}", i) for i in range(3)]
    await h.started(2)
    assert sorted(h.executed) == ["r0", "r1"]
    assert sum(inst.running for inst in h.instances) == 2
    h.gate.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 2)
    assert sorted(h.executed) == ["r0", "r1", "r2"]
    names = [n for inst in h.instances for n in inst.thread_names]
    assert threading.main_thread().name not in names
    assert all(n.startswith("sluice-m:1") for n in names)


async def test_backend_errors_reach_every_request_of_the_batch(harness):
    clock = FakeClock()
    failing = FakeInstance(fail=RuntimeError("boom"))
    sched = Scheduler(config(4), [failing], clock=clock)
    sched.start()
    try:
        results = await asyncio.gather(*(sched.submit(request(f"r{i}")) for i in range(2)), return_exceptions=True)
        assert all(isinstance(r, Internal) and "RuntimeError: boom" in r.message for r in results), results
        assert failing.executed == ["r0", "r1"]
        failing.fail = ModelError("model says no")
        with pytest.raises(ModelError, match=r"^model says no$"):
            await sched.submit(request("next"))
    finally:
        await sched.aclose()


# -- Scheduler: priorities -----------------------------------------------------------------------


async def test_higher_priority_dispatches_first(harness):
    h = harness(config(1, levels=3, default_priority=2))
    await h.busy()
    tasks = [h.submit("low", priority=3), h.submit("default"), h.submit("high", priority=1)]
    tasks.append(h.submit("high2", priority=1))
    await asyncio.sleep(0.005)
    h.gate.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 2)
    assert h.batches == [["busy"], ["high"], ["high2"], ["default"], ["low"]]


async def test_priorities_share_a_batch_in_priority_order(harness):
    h = harness(config(8, levels=2))
    await h.busy()
    tasks = [h.submit("p2a", 1, priority=2), h.submit("p2b", 2, priority=2), h.submit("p1", 3, priority=1)]
    await asyncio.sleep(0.005)
    h.gate.set()
    results = await asyncio.wait_for(asyncio.gather(*tasks), 2)
    assert [value_of(r) for r in results] == [2, 4, 6]
    assert h.batches == [["busy"], ["p1", "p2a", "p2b"]]


async def test_priority_out_of_range_is_a_clear_error_and_ignored_without_levels(harness):
    h = harness(config(8, levels=2))
    with pytest.raises(InvalidArgument, match=r"priority 3 is out of range .* allowed 1\.\.2"):
        await h.submit("bad", priority=3)
    plain = harness(config(8))
    plain.gate.set()
    assert value_of(await plain.submit("any", 5, priority=7)) == 10


# -- Scheduler: queue bounds ---------------------------------------------------------------------


async def test_full_queue_rejects_at_once_naming_the_limit(harness):
    h = harness(config(8, queue=QueuePolicy(max_queue_size=2)))
    await h.busy()
    queued = [h.submit("q1", 1), h.submit("q2", 2)]
    await asyncio.sleep(0)
    with pytest.raises(QueueFull, match=r"queue is full.*max_queue_size is 2"):
        await asyncio.wait_for(h.submit("over"), 0.5)
    assert h.observer.rejected == ["queue_full"]
    h.gate.set()
    assert [value_of(r) for r in await asyncio.gather(*queued)] == [2, 4]
    assert "over" not in h.executed
    # the bound is on what waits, not on what runs: the queue has room again
    assert value_of(await asyncio.wait_for(h.submit("after", 4), 1)) == 8


async def test_max_queue_size_is_per_priority_level(harness):
    """Triton's ModelQueuePolicy is per priority level: a full level-2 queue does not block level 1."""
    h = harness(
        config(8, levels=2, queue=QueuePolicy(max_queue_size=3), by_priority={1: QueuePolicy(max_queue_size=1)})
    )
    await h.busy()
    low = [h.submit(f"low{i}", priority=2) for i in range(3)]
    await asyncio.sleep(0)
    with pytest.raises(QueueFull, match="max_queue_size is 3"):
        await h.submit("low-over", priority=2)
    high = h.submit("high", priority=1)
    await asyncio.sleep(0)
    with pytest.raises(QueueFull, match="max_queue_size is 1"):
        await h.submit("high-over", priority=1)
    h.gate.set()
    await asyncio.wait_for(asyncio.gather(high, *low), 2)
    assert h.batches == [["busy"], ["high", "low0", "low1", "low2"]]


# -- Scheduler: queue timeouts -------------------------------------------------------------------


async def test_queue_timeout_reject_on_the_fake_clock_never_executes(harness):
    h = harness(config(8, queue=QueuePolicy(timeout_ns=3 * MS)))
    await h.busy()
    late = await h.put("late")
    await settle(20)  # the real timer fired several times; fake time did not move
    assert not late.done()
    h.clock.advance(3 * MS)
    with pytest.raises(QueueTimeout, match=r"timed out in the queue after 3000 us .* not executed"):
        await asyncio.wait_for(late, 0.5)
    assert h.observer.rejected == ["timeout"]
    h.gate.set()
    await asyncio.wait_for(h.tasks["busy"], 1)
    fresh = await asyncio.wait_for(h.submit("fresh", 1), 1)
    assert value_of(fresh) == 2
    assert h.executed == ["busy", "fresh"]


async def test_running_requests_do_not_time_out(harness):
    h = harness(config(8, queue=QueuePolicy(timeout_ns=1 * MS)))
    await h.busy()
    h.clock.advance(100 * MS)
    await settle(5)
    h.gate.set()
    assert isinstance(await asyncio.wait_for(h.tasks["busy"], 1), InferResponse)


async def test_queue_timeout_delay_moves_the_request_behind_others(harness):
    h = harness(config(1, queue=QueuePolicy(timeout_ns=2 * MS, delay_on_timeout=True)))
    await h.busy()
    first = await h.put("first", 1)
    h.clock.advance(3 * MS)  # 'first' is now past its deadline
    second = await h.put("second", 2)
    await asyncio.sleep(0.005)
    h.gate.set()
    results = await asyncio.wait_for(asyncio.gather(first, second), 2)
    assert [value_of(r) for r in results] == [2, 4]  # delayed, still executed
    assert h.batches == [["busy"], ["second"], ["first"]]
    assert h.observer.rejected == []


async def test_delayed_requests_come_after_every_priority_level(harness):
    delay = QueuePolicy(timeout_ns=2 * MS, delay_on_timeout=True)
    h = harness(config(1, levels=2, queue=delay, by_priority={1: delay}))
    await h.busy()
    tasks = [await h.put("old-high", priority=1)]
    h.clock.advance(3 * MS)
    tasks += [h.submit("low", priority=2), h.submit("high", priority=1)]
    await settle(5)
    h.gate.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 2)
    assert h.batches == [["busy"], ["high"], ["low"], ["old-high"]]


TIMEOUT_OVERRIDE_CASES = [
    # (id, policy, per-request timeout_us, fake ms advanced, times out?)
    ("no default, override allowed", QueuePolicy(), 2_000, 2, True),
    ("no default, override in time", QueuePolicy(), 2_000, 1, False),
    ("override may shorten the default", QueuePolicy(timeout_ns=50 * MS), 2_000, 2, True),
    ("override may not extend the default", QueuePolicy(timeout_ns=2 * MS), 50_000, 2, True),
    (
        "override not allowed: default kept",
        QueuePolicy(timeout_ns=50 * MS, allow_timeout_override=False),
        2_000,
        2,
        False,
    ),
    ("override not allowed, no default", QueuePolicy(allow_timeout_override=False), 2_000, 10, False),
    ("timeout 0 means the default", QueuePolicy(timeout_ns=50 * MS), 0, 10, False),
]


@pytest.mark.parametrize(
    ("policy", "timeout_us", "advance_ms", "times_out"),
    [c[1:] for c in TIMEOUT_OVERRIDE_CASES],
    ids=[c[0] for c in TIMEOUT_OVERRIDE_CASES],
)
async def test_per_request_timeout_override(harness, policy, timeout_us, advance_ms, times_out):
    h = harness(config(8, queue=policy))
    await h.busy()
    task = await h.put("r", 1, timeout_us=timeout_us)
    h.clock.advance(advance_ms * MS)
    await settle(10)
    if times_out:
        with pytest.raises(QueueTimeout):
            await asyncio.wait_for(task, 0.5)
    else:
        assert not task.done()
        h.gate.set()
        assert value_of(await asyncio.wait_for(task, 1)) == 2
    h.gate.set()
    await asyncio.wait_for(h.tasks["busy"], 1)
    assert ("r" in h.executed) is not times_out


# -- Scheduler: cancellation ---------------------------------------------------------------------


async def test_cancel_token_before_dispatch_drops_the_request(harness):
    h = harness(config(8))
    await h.busy()
    keep, drop = h.submit("keep", 1), h.submit("drop", 2)
    await asyncio.sleep(0)
    drop.request.cancel.cancel()  # what the protocol layer does when the client goes away
    with pytest.raises(Cancelled, match="cancelled by the client before it ran"):
        await asyncio.wait_for(drop, 0.5)
    assert h.scheduler.queue_depth == 1
    h.gate.set()
    assert value_of(await asyncio.wait_for(keep, 1)) == 2
    assert h.executed == ["busy", "keep"]
    assert h.observer.rejected == ["cancelled"]


async def test_cancelling_the_waiting_task_drops_the_request(harness):
    h = harness(config(8))
    await h.busy()
    task = h.submit("gone")
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.request.cancel.cancelled
    assert h.scheduler.queue_depth == 0
    h.gate.set()
    await asyncio.wait_for(h.tasks["busy"], 1)
    await settle(5)
    assert h.executed == ["busy"]


async def test_already_cancelled_request_never_runs(harness):
    h = harness(config(8))
    h.gate.set()
    req = request("pre")
    req.cancel.cancel()
    with pytest.raises(Cancelled):
        await h.scheduler.submit(req)
    assert h.executed == []


async def test_cancel_while_running_is_visible_to_the_model_and_result_still_delivered(harness):
    h = harness(config(8))
    await h.busy()
    h.tasks["busy"].request.cancel.cancel()
    await asyncio.sleep(0.005)
    assert not h.tasks["busy"].done()  # a running batch is not torn apart
    h.gate.set()
    assert isinstance(await asyncio.wait_for(h.tasks["busy"], 1), InferResponse)


# -- Scheduler: lifecycle ------------------------------------------------------------------------


async def test_aclose_drains_queued_and_running_requests_then_closes_instances(harness):
    h = harness(config(2))
    await h.busy()
    queued = [h.submit(f"q{i}", i) for i in range(3)]
    await asyncio.sleep(0)
    closing = h.aclose(grace_s=2)
    await asyncio.sleep(0.005)
    with pytest.raises(Unavailable, match="not accepting requests"):
        await h.submit("late")
    assert not closing.done()
    h.gate.set()
    await asyncio.wait_for(closing, 2)
    assert [value_of(r) for r in await asyncio.gather(*queued)] == [0, 2, 4]
    assert h.executed == ["busy", "q0", "q1", "q2"]
    assert all(inst.closed for inst in h.instances)


async def test_aclose_grace_expired_fails_what_is_still_queued(harness):
    h = harness(config(1))
    await h.busy()
    queued = h.submit("q")
    await asyncio.sleep(0)
    closing = h.aclose(grace_s=0.01)
    await asyncio.sleep(0.03)
    with pytest.raises(Unavailable, match="unloaded"):
        await asyncio.wait_for(queued, 0.5)
    h.gate.set()
    await asyncio.wait_for(closing, 2)
    assert h.executed == ["busy"]


def test_scheduler_needs_an_instance():
    with pytest.raises(ValueError, match="at least one instance"):
        Scheduler(config(), [])


# -- scheduler_config: Triton config -> scheduler settings ----------------------------------------

DEFAULTS = SchedulingDefaults(queue_timeout_us=30_000_000, max_queue_size=1024, batch_policy=WORK_CONSERVING)
SLUICE_DEFAULT_QUEUE = QueuePolicy(timeout_ns=30_000 * MS, allow_timeout_override=True, max_queue_size=1024)

CONFIG_CASES = [
    # (id, config.pbtxt text, server defaults, check(SchedulerConfig))
    (
        "no dynamic_batching: no batching, Sluice queue defaults",
        "max_batch_size: 8",
        DEFAULTS,
        lambda c: not c.batch.dynamic and c.default_queue == SLUICE_DEFAULT_QUEUE and c.priority_levels == 0,
    ),
    (
        "batch sizes and delay",
        "max_batch_size: 8 dynamic_batching { preferred_batch_size: [2, 4] max_queue_delay_microseconds: 500 }",
        DEFAULTS,
        lambda c: c.batch == BatchPolicy(8, (2, 4), 500 * US, WORK_CONSERVING, True),
    ),
    (
        "fixed_wait from the model config",
        'dynamic_batching { } parameters { key: "batch_policy" value { string_value: "fixed_wait" } }',
        DEFAULTS,
        lambda c: c.batch.mode == FIXED_WAIT,
    ),
    (
        "fixed_wait from the server flag",
        "max_batch_size: 8 dynamic_batching { }",
        SchedulingDefaults(batch_policy=FIXED_WAIT),
        lambda c: c.batch.mode == FIXED_WAIT,
    ),
    (
        "the model config wins over the server flag",
        'dynamic_batching { } parameters { key: "batch_policy" value { string_value: "work_conserving" } }',
        SchedulingDefaults(batch_policy=FIXED_WAIT),
        lambda c: c.batch.mode == WORK_CONSERVING,
    ),
    (
        "queue policy REJECT with everything set",
        """dynamic_batching { default_queue_policy { timeout_action: REJECT
             default_timeout_microseconds: 5000 allow_timeout_override: true max_queue_size: 7 } }""",
        DEFAULTS,
        lambda c: c.default_queue == QueuePolicy(5 * MS, True, False, 7),
    ),
    (
        "queue policy DELAY without override",
        "dynamic_batching { default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 5000 } }",
        DEFAULTS,
        lambda c: c.default_queue == QueuePolicy(5 * MS, False, True, 1024),
    ),
    (
        "queue policy without a timeout keeps Sluice's, which clients may shorten",
        "dynamic_batching { default_queue_policy { max_queue_size: 3 } }",
        DEFAULTS,
        lambda c: c.default_queue == QueuePolicy(30_000 * MS, True, False, 3),
    ),
    (
        "server defaults off: no timeout, unbounded",
        "dynamic_batching { }",
        SchedulingDefaults(queue_timeout_us=0, max_queue_size=0),
        lambda c: c.default_queue == QueuePolicy(0, True, False, 0),
    ),
    (
        "priority levels and per-level queue policies",
        """dynamic_batching { priority_levels: 3 default_priority_level: 2
             priority_queue_policy { key: 1 value { max_queue_size: 2 } }
             priority_queue_policy { key: 3 value { timeout_action: DELAY default_timeout_microseconds: 10 } } }""",
        DEFAULTS,
        lambda c: (
            c.priority_levels == 3
            and c.default_priority == 2
            and c.queue_by_priority
            == {1: QueuePolicy(30_000 * MS, True, False, 2), 3: QueuePolicy(10 * US, False, True, 1024)}
            and c.default_queue == SLUICE_DEFAULT_QUEUE
        ),
    ),
]


@pytest.mark.parametrize(("text", "defaults", "check"), [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_scheduler_config(text, defaults, check):
    cfg = scheduler_config(text_format.Parse(text, mc.ModelConfig()), defaults, "m:1")
    assert check(cfg), cfg
    assert cfg.model_label == "m:1"


def test_scheduler_config_rejects_an_unknown_batch_policy():
    text = 'dynamic_batching { } parameters { key: "batch_policy" value { string_value: "eager" } }'
    with pytest.raises(ConfigError, match=r"parameters\[batch_policy\].*work_conserving, fixed_wait, got 'eager'"):
        scheduler_config(text_format.Parse(text, mc.ModelConfig()), DEFAULTS, "m:1")


# -- overload shedding -------------------------------------------------------------------------

OVERLOAD = OverloadPolicy(interval_ns=100 * MS, target_ns=5 * MS, exec_multiple=2.0)


def overload_config(**kw) -> SchedulerConfig:
    return dataclasses.replace(config(**kw), overload=OVERLOAD)


def test_shed_limit_is_the_larger_of_target_and_a_multiple_of_execution_time():
    assert shed_limit(OVERLOAD, 0) == 5 * MS
    assert shed_limit(OVERLOAD, 1 * MS) == 5 * MS
    assert shed_limit(OVERLOAD, 150 * MS) == 300 * MS


async def test_overload_sheds_requests_that_waited_too_long_and_runs_fresh_ones(harness):
    h = harness(overload_config(max_batch_size=1))  # more than one batch queued counts as a backlog
    warm = await h.put("warm", 1)
    await h.started(1)  # its worker has read the clock: what follows is execution time
    h.clock.advance(150 * MS)  # the first batch takes 150 ms of fake time
    h.gate.set()
    await asyncio.wait_for(warm, 2)
    h.gate.clear()
    await h.busy()
    old = await h.put("old", 1)
    h.clock.advance(600 * MS)
    fresh = await h.put("fresh", 2)
    h.clock.advance(50 * MS)
    # busy ran 650 ms: mean execution 0.8 * 150 + 0.2 * 650 = 250 ms, so the shed limit is 500 ms;
    # old waited 650 ms and the queue has not drained since it came, fresh waited 50 ms
    h.gate.set()
    with pytest.raises(QueueTimeout, match=r"overloaded: the request waited 650000 us.*not executed"):
        await asyncio.wait_for(old, 2)
    assert value_of(await asyncio.wait_for(fresh, 2)) == 4
    assert h.executed == ["warm", "busy", "fresh"]
    assert h.observer.rejected == ["shed"]


async def test_no_shedding_while_the_backlog_fits_one_batch_per_instance(harness):
    h = harness(overload_config(max_batch_size=8))  # bounded clients (<= 8 in flight) cannot overload it
    warm = await h.put("warm", 1)
    await h.started(1)
    h.clock.advance(10 * MS)
    h.gate.set()
    await asyncio.wait_for(warm, 2)
    h.gate.clear()
    await h.busy()
    waiting = [await h.put(f"w{i}", i) for i in range(8)]
    h.clock.advance(500 * MS)  # a long stall (GC pause, CPU steal): far past interval and limit
    h.gate.set()
    results = await asyncio.wait_for(asyncio.gather(*waiting), 2)
    assert [value_of(r) for r in results] == [2 * i for i in range(8)]
    assert h.observer.rejected == []


async def test_no_shedding_before_any_execution_time_is_known(harness):
    h = harness(overload_config(max_batch_size=8))
    await h.busy()  # its execution takes no fake time: nothing to judge lateness by
    late = await h.put("late", 3)
    h.clock.advance(500 * MS)
    h.gate.set()
    assert value_of(await asyncio.wait_for(late, 2)) == 6
    assert h.observer.rejected == []


async def test_no_shedding_while_fixed_wait_holds_requests_on_an_idle_instance(harness):
    h = harness(overload_config(max_batch_size=8, mode=FIXED_WAIT, delay_ns=30 * MS))
    warm = await h.put("warm", 1)  # alone on an idle instance: dispatched after the 30 ms delay
    h.clock.advance(30 * MS)
    await h.started(1)
    h.clock.advance(20 * MS)  # it runs 20 ms of fake time: shedding now has an execution time to go by
    h.gate.set()
    assert value_of(await asyncio.wait_for(warm, 2)) == 2
    waiting = await h.put("waiting", 2)
    h.clock.advance(200 * MS)  # far past the interval and the 40 ms limit, but the instance sat idle
    await settle(40)
    assert value_of(await asyncio.wait_for(waiting, 2)) == 4
    assert h.observer.rejected == []


def test_overload_control_follows_server_default_model_parameter_and_explicit_queue_policy():
    def parse(text: str, defaults: SchedulingDefaults = DEFAULTS) -> SchedulerConfig:
        return scheduler_config(text_format.Parse(text, mc.ModelConfig()), defaults, "m:1")

    assert parse("dynamic_batching { }").overload is not None
    assert parse("dynamic_batching { }", SchedulingDefaults(overload_control=False)).overload is None
    # a model that spells out Triton's queue semantics gets exactly those
    assert parse("dynamic_batching { default_queue_policy { max_queue_size: 3 } }").overload is None
    assert parse("dynamic_batching { priority_levels: 2 }").overload is None
    on = 'dynamic_batching { priority_levels: 2 } parameters { key: "overload_control" value { string_value: "on" } }'
    assert parse(on).overload is not None
    off = 'dynamic_batching { } parameters { key: "overload_control" value { string_value: "off" } }'
    assert parse(off).overload is None
    bad = 'dynamic_batching { } parameters { key: "overload_control" value { string_value: "maybe" } }'
    with pytest.raises(ConfigError, match=r"parameters\[overload_control\].*'on' or 'off'"):
        parse(bad)


async def test_finished_requests_are_not_kept_alive_by_their_queue_deadlines(harness):
    """A dispatched request must not stay referenced until its (30 s) queue deadline passes."""
    import gc
    import weakref

    h = harness(config(8, queue=QueuePolicy(timeout_ns=30_000 * MS)))
    h.gate.set()
    alive = []
    for i in range(1000):
        req = request(f"r{i}", i)
        alive.append(weakref.ref(req.inputs[0].data))  # the tensor a leaked request would pin
        await asyncio.wait_for(h.scheduler.submit(req), 2)
        del req
    gc.collect()
    assert sum(1 for ref in alive if ref() is not None) < 100


async def test_answered_requests_leave_no_reference_cycles(harness):
    """Queued requests must be freed by reference counting: cycles made every request wait for the
    cyclic collector, whose pauses (tens of ms under load) were the latency tail."""
    import gc

    h = harness(config(8))
    await h.busy()
    gc.collect()
    gc.disable()
    try:
        tasks = [h.submit(f"r{i}", i) for i in range(200)]  # queued behind 'busy': cancel callbacks registered
        await asyncio.sleep(0.01)
        h.gate.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        tasks.clear()
        h.tasks.clear()
        unreachable = gc.collect()
    finally:
        gc.enable()
    assert unreachable < 200, f"{unreachable} objects were only reclaimable by the cyclic collector"
