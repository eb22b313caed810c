"""Sequence batching (stateful models): Triton's ``sequence_batching``, Direct and Oldest strategies.

The repository builds a :class:`SequenceScheduler` instead of a ``batching.Scheduler`` for a model
whose config has ``sequence_batching``; the dataplane calls ``enqueue_callback`` as for any
scheduler. Requests carry the ``sequence_id`` / ``sequence_start`` / ``sequence_end`` parameters
(tritonclient's ``infer(..., sequence_id=, sequence_start=, sequence_end=)``, HTTP and gRPC).

The decisions are pure and tested without I/O:

* :func:`sequence_config` reads the config into a :class:`SequenceConfig`;
* :func:`sequence_of` checks a request's correlation id and flags;
* :func:`control_tensors` synthesizes the START/END/READY/CORRID inputs of one batch row;
* :class:`SequenceBook` binds each sequence to a slot (instance, index) for its lifetime, keeps the
  backlog of sequences waiting for a slot, picks each batch (Direct: one row per slot, empty slots
  padded with READY=0; Oldest: the oldest ready sequences first, through ``batching.decide``), and
  releases slots at END or after ``max_sequence_idle_microseconds`` idle, all from an injected clock.

A sequence has at most one request running at a time and its requests run in arrival order: it is
bound to one instance, and only the head of its queue is ever taken, once the previous one finished.
Implicit state (``state`` blocks) is kept per sequence here: the model's state output of one request
is its state input on the next, the initial state (zeros or ``initial_state``) on START.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from sluice.runtime import batching
from sluice.runtime.backends.base import ModelInstance, Result
from sluice.runtime.errors import Cancelled, ConfigError, InvalidArgument, SluiceError, Unavailable
from sluice.runtime.types import (
    DATATYPE_BY_CONFIG_TYPE,
    InferRequest,
    InferResponse,
    RequestedOutput,
    Tensor,
    numpy_dtype,
)

log = logging.getLogger("sluice.runtime.sequence")

DIRECT, OLDEST = "direct", "oldest"
DEFAULT_IDLE_US = 1_000_000
"""Triton's default ``max_sequence_idle_microseconds`` (1 s)."""
INITIAL_STATE_DIR = "initial_state"
"""Where ``initial_state { data_file }`` files live, inside the model directory (as in Triton)."""

START, END, READY, CORRID = "start", "end", "ready", "corrid"
_KIND_BY_ENUM = {
    mc.ModelSequenceBatching.Control.CONTROL_SEQUENCE_START: START,
    mc.ModelSequenceBatching.Control.CONTROL_SEQUENCE_END: END,
    mc.ModelSequenceBatching.Control.CONTROL_SEQUENCE_READY: READY,
    mc.ModelSequenceBatching.Control.CONTROL_SEQUENCE_CORRID: CORRID,
}
_DATATYPE_BY_FIELD = {"int32_false_true": "INT32", "fp32_false_true": "FP32", "bool_false_true": "BOOL"}
_INT_RANGE = {
    "UINT64": (1, 2**64 - 1),
    "INT64": (1, 2**63 - 1),
    "UINT32": (1, 2**32 - 1),
    "INT32": (1, 2**31 - 1),
}

CorrelationId = int | str


# -- configuration (pure) ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Control:
    """One control input the batcher feeds: ``kind`` is start, end, ready or corrid."""

    name: str
    kind: str
    datatype: str  # V2 name: INT32, FP32, BOOL for flags; UINT64/INT64/UINT32/INT32/BYTES for CORRID
    false_true: tuple[Any, Any] = (0, 1)


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """An implicit state: the model's ``output_name`` of one request is its ``input_name`` on the next."""

    input_name: str
    output_name: str
    datatype: str
    initial: np.ndarray
    """The state at START, without the batch dim."""


@dataclasses.dataclass(frozen=True)
class SequenceConfig:
    strategy: str
    controls: tuple[Control, ...]
    states: tuple[StateSpec, ...]
    idle_ns: int
    slots_per_instance: int
    max_batch_size: int
    batch: batching.BatchPolicy
    """Oldest: how the ready sequences of an instance are batched (fixed wait, as Triton)."""
    model_label: str = ""
    listed_outputs: tuple[str, ...] = ()
    """The config's outputs: a state output listed there reaches clients that ask for it."""

    @property
    def batched(self) -> bool:
        return self.max_batch_size > 0

    @property
    def corrid(self) -> Control | None:
        return next((c for c in self.controls if c.kind == CORRID), None)


def sequence_config(config: mc.ModelConfig, model_dir: Path | None, label: str = "") -> SequenceConfig:
    """The sequence batcher's settings from a validated config (``config.validate`` checked the
    fields); reads ``initial_state`` data files from ``<model_dir>/initial_state/``."""
    batching_cfg = config.sequence_batching
    controls = []
    for control_input in batching_cfg.control_input:
        control = control_input.control[0]
        kind = _KIND_BY_ENUM[control.kind]
        if kind == CORRID:
            datatype = DATATYPE_BY_CONFIG_TYPE[mc.DataType.Name(control.data_type)]
            controls.append(Control(control_input.name, kind, datatype))
            continue
        field = next(f for f in _DATATYPE_BY_FIELD if len(getattr(control, f)))
        values = list(getattr(control, field))
        controls.append(Control(control_input.name, kind, _DATATYPE_BY_FIELD[field], (values[0], values[1])))
    states = []
    for index, state in enumerate(batching_cfg.state):
        datatype = DATATYPE_BY_CONFIG_TYPE[mc.DataType.Name(state.data_type)]
        initial = _initial_state(state, datatype, model_dir, f"sequence_batching.state[{index}].initial_state[0]")
        states.append(StateSpec(state.input_name, state.output_name, datatype, initial))
    max_batch = config.max_batch_size
    oldest = batching_cfg.HasField("oldest")
    slots = max(max_batch, 1)
    if oldest and batching_cfg.oldest.max_candidate_sequences > 0:
        slots = batching_cfg.oldest.max_candidate_sequences
    policy = batching.BatchPolicy(
        max_batch_size=max_batch,
        preferred_batch_sizes=tuple(batching_cfg.oldest.preferred_batch_size),
        max_queue_delay_ns=batching_cfg.oldest.max_queue_delay_microseconds * 1000,
        mode=batching.FIXED_WAIT,
        dynamic=True,
    )
    idle_us = batching_cfg.max_sequence_idle_microseconds or DEFAULT_IDLE_US
    return SequenceConfig(
        OLDEST if oldest else DIRECT,
        tuple(controls),
        tuple(states),
        idle_us * 1000,
        slots,
        max_batch,
        policy,
        label,
        tuple(output.name for output in config.output),
    )


def _initial_state(state: Any, datatype: str, model_dir: Path | None, field: str) -> np.ndarray:
    dtype = numpy_dtype(datatype)
    if not state.initial_state:
        return _zeros(tuple(state.dims), datatype)
    initial = state.initial_state[0]
    shape = tuple(initial.dims)
    if initial.WhichOneof("state_data") == "zero_data":
        return _zeros(shape, datatype)
    if model_dir is None:
        raise ConfigError("initial_state data_file needs the model directory", field=field)
    path = model_dir / INITIAL_STATE_DIR / initial.data_file
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"cannot read initial_state data_file '{INITIAL_STATE_DIR}/{initial.data_file}' of the model "
            f"({exc.strerror or type(exc).__name__}); allowed: a file in the model's {INITIAL_STATE_DIR}/ directory",
            field=f"{field}.data_file",
        ) from None
    if datatype == "BYTES":
        return np.full(shape, raw, dtype=object)
    count = int(np.prod(shape, dtype=np.int64))
    needed = count * dtype.itemsize
    if len(raw) < needed:
        raise ConfigError(
            f"initial_state expects {needed} bytes ({count} x {datatype}), but data_file "
            f"'{initial.data_file}' has only {len(raw)} bytes",
            field=f"{field}.data_file",
        )
    return np.frombuffer(raw[:needed], dtype=dtype.newbyteorder("<")).astype(dtype).reshape(shape)


def _zeros(shape: tuple[int, ...], datatype: str) -> np.ndarray:
    shape = tuple(1 if d == -1 else d for d in shape)  # Triton: variable dims are 1 on the first request
    if datatype == "BYTES":
        return np.full(shape, b"", dtype=object)
    return np.zeros(shape, dtype=numpy_dtype(datatype))


# -- requests (pure) -----------------------------------------------------------------------------


def _flag(parameters: dict[str, Any], key: str) -> bool:
    value = parameters.get(key, False)
    if not isinstance(value, bool):
        raise InvalidArgument(f"request parameter '{key}' must be a boolean (true or false), got {value!r}")
    return value


def sequence_of(parameters: dict[str, Any], cfg: SequenceConfig, model: str) -> tuple[CorrelationId, bool, bool]:
    """The request's correlation id, START and END flags, checked against the model; raises
    InvalidArgument in Triton's words where Triton has them."""
    start = _flag(parameters, "sequence_start")
    end = _flag(parameters, "sequence_end")
    raw = parameters.get("sequence_id")
    if raw is None or raw == 0 or raw == "":
        raise InvalidArgument(
            f"inference request to model '{model}' must specify a non-zero or non-empty correlation ID "
            "(request parameter 'sequence_id': an unsigned integer or a string)"
        )
    if isinstance(raw, bool) or not isinstance(raw, (int, str)):
        raise InvalidArgument(f"request parameter 'sequence_id' must be an unsigned integer or a string, got {raw!r}")
    if isinstance(raw, int) and not 0 < raw < 2**64:
        raise InvalidArgument(f"request parameter 'sequence_id' {raw} is out of range; allowed: 1 to 2^64-1")
    corrid = cfg.corrid
    if corrid is not None:
        config_type = f"TYPE_{'STRING' if corrid.datatype == 'BYTES' else corrid.datatype}"
        takes = "string" if corrid.datatype == "BYTES" else f"{corrid.datatype} integer"
        if isinstance(raw, str) != (corrid.datatype == "BYTES"):
            given = f"string {raw!r}" if isinstance(raw, str) else f"integer {raw}"
            raise InvalidArgument(
                f"sequence_id {given} does not fit model '{model}': its CORRID control input '{corrid.name}' "
                f"has data_type {config_type}; send a {takes} sequence_id"
            )
        if isinstance(raw, int) and not raw <= _INT_RANGE[corrid.datatype][1]:
            raise InvalidArgument(
                f"sequence_id {raw} does not fit model '{model}': its CORRID control input '{corrid.name}' has "
                f"data_type {config_type}; allowed: 1 to {_INT_RANGE[corrid.datatype][1]}"
            )
    return raw, start, end


def not_started(cid: CorrelationId, model: str, idle_ns: int) -> InvalidArgument:
    """Triton's error for a request without START on a sequence that is not active."""
    return InvalidArgument(
        f"inference request for sequence {cid} to model '{model}' must specify the START flag on the first "
        f"request of the sequence (sequence {cid} is not active: it was never started, it ended, a request of it was "
        f"cancelled before it ran, or it was released after {idle_ns // 1000} us idle, "
        "max_sequence_idle_microseconds)"
    )


def control_tensors(
    cfg: SequenceConfig, *, start: bool, end: bool, ready: bool, cid: CorrelationId | None
) -> list[Tensor]:
    """The control inputs of one batch row (shape [1], [1, 1] when the model batches)."""
    shape = (1, 1) if cfg.batched else (1,)
    out = []
    for control in cfg.controls:
        if control.kind == CORRID:
            if control.datatype == "BYTES":
                text = b"" if cid is None else str(cid).encode()
                data = np.full(shape, text, dtype=object)
            else:
                data = np.full(shape, cid if isinstance(cid, int) else 0, dtype=numpy_dtype(control.datatype))
        else:
            flag = {START: start, END: end, READY: ready}[control.kind]
            data = np.full(shape, control.false_true[1 if flag else 0], dtype=numpy_dtype(control.datatype))
        out.append(Tensor(control.name, control.datatype, data))
    return out


def state_value(spec: StateSpec, run: SequenceRun | None, start: bool, batched: bool) -> np.ndarray:
    """The value of implicit state ``spec`` a row of ``run`` gets: the output kept from its previous
    request, or the initial state (with the batch dim when the model batches) on START."""
    value = None if start or run is None or run.state is None else run.state.get(spec.input_name)
    if value is None:
        value = spec.initial[np.newaxis] if batched else spec.initial
    return value


# -- slots, backlog and batches (pure) -----------------------------------------------------------

Slot = tuple[int, int]
"""(instance index, slot index within the instance)."""


def pick_slot(free: set[Slot]) -> Slot:
    """The slot a new sequence gets: the lowest slot index first, across instances (as Triton's
    ready-slot queue), so sequences spread over instances before they share one."""
    return min(free, key=lambda slot: (slot[1], slot[0]))


@dataclasses.dataclass(eq=False)
class Job:
    """One request of a sequence, as the book sees it; ``item`` is the scheduler's own record."""

    item: Any
    start: bool
    end: bool
    enqueued_ns: int
    shape_key: tuple = ()
    sequence: SequenceRun | None = None


@dataclasses.dataclass(eq=False)
class SequenceRun:
    """One sequence from its START to its END (or its idle release)."""

    cid: CorrelationId
    last_ns: int
    slot: Slot | None = None
    jobs: collections.deque[Job] = dataclasses.field(default_factory=collections.deque)
    running: bool = False
    ended: bool = False
    state: dict[str, np.ndarray] | None = None
    """Implicit state (state input name -> value), kept by the scheduler."""


@dataclasses.dataclass(frozen=True)
class Batch:
    rows: list[Job | None]
    """One per batch row; None is a padding row (an empty Direct slot below an occupied one)."""


class NotStarted(Exception):
    def __init__(self, cid: CorrelationId) -> None:
        super().__init__(cid)
        self.cid = cid


class SequenceBook:
    """Which sequence holds which slot, what waits, and what runs next. Pure: no I/O, no clock of its
    own (every call gets ``now``), no threads; the scheduler calls it on the event loop."""

    def __init__(self, cfg: SequenceConfig, instances: int) -> None:
        self._cfg = cfg
        self._free: set[Slot] = {(i, s) for i in range(instances) for s in range(cfg.slots_per_instance)}
        self._active: dict[CorrelationId, SequenceRun] = {}
        self._by_slot: dict[Slot, SequenceRun] = {}
        self._backlog: collections.deque[SequenceRun] = collections.deque()

    # -- queries ---------------------------------------------------------------------------------
    def active(self, cid: CorrelationId) -> bool:
        return cid in self._active

    def slot_of(self, cid: CorrelationId) -> Slot | None:
        run = self._active.get(cid)
        return run.slot if run else None

    @property
    def backlog(self) -> int:
        return len(self._backlog)

    def next_expiry(self) -> int | None:
        """When the earliest idle sequence will be released (None: none can be)."""
        times = [run.last_ns + self._cfg.idle_ns for run in self._active.values() if self._idle_candidate(run)]
        return min(times, default=None)

    # -- transitions -----------------------------------------------------------------------------
    def admit(self, cid: CorrelationId, start: bool, end: bool, now: int, item: Any, shape_key: tuple = ()) -> Job:
        """Queue one request on its sequence; raises NotStarted for a non-START request of a sequence
        that is not active. A START for an active sequence continues it (Triton: the earlier one is
        cut short; its queued requests still run, then the model sees START)."""
        run = self._active.get(cid)
        if run is None:
            if not start:
                raise NotStarted(cid)
            run = self._active[cid] = SequenceRun(cid, now)
            if self._free:
                self._bind(run, pick_slot(self._free))
            else:
                self._backlog.append(run)
        elif start:
            log.warning(
                "sequence %s of model '%s' started again before it ended; the earlier sequence ends here",
                cid,
                self._cfg.model_label,
            )
        job = Job(item, start, end, now, shape_key, run)
        run.jobs.append(job)
        run.last_ns = now
        if end:
            run.ended = True
            del self._active[cid]  # a later request with this id starts a new sequence (or is refused)
        return job

    def cancel(self, job: Job) -> list[Job] | None:
        """Drop a queued job (its client went away); None when it is no longer queued. As in Triton,
        a cancelled request ends its sequence: its later queued requests are dropped too (returned,
        for the scheduler to answer), the slot is released once nothing of it runs, and a later
        request without START is refused. Running on would hand the model a sequence with a step
        missing, its state carried past the request that never ran."""
        run = job.sequence
        if run is None or job not in run.jobs:
            return None
        queued = list(run.jobs)
        index = queued.index(job)
        # the sequence's later requests go, up to a START that begins the next sequence of this id
        restart = next((i for i in range(index + 1, len(queued)) if queued[i].start), len(queued))
        dropped = queued[index + 1 : restart]
        run.jobs = collections.deque(queued[:index] + queued[restart:])
        if restart == len(queued):  # no later sequence queued: this one ends here
            if self._active.get(run.cid) is run:
                del self._active[run.cid]
            run.ended = True
            self._maybe_release(run)
        return dropped

    def next_batch(self, instance: int, now: int) -> Batch | batching.Wait:
        """The rows ``instance`` (idle) runs next, marked running; or when to ask again."""
        if self._cfg.strategy == DIRECT:
            return self._next_direct(instance)
        return self._next_oldest(instance, now)

    def _next_direct(self, instance: int) -> Batch | batching.Wait:
        heads: list[Job | None] = []
        for index in range(self._cfg.slots_per_instance):
            run = self._by_slot.get((instance, index))
            heads.append(run.jobs[0] if run is not None and run.jobs and not run.running else None)
        waiting = [job for job in heads if job is not None]
        if not waiting:
            return batching.Wait(None)
        # one shape per batch: rows of another shape wait for the next round (their slots read READY=0).
        # The oldest head sets the shape (Triton takes the lowest slot's, which can starve a sequence whose
        # shape differs from a busy sequence in a lower slot for as long as that one keeps sending).
        first = min(waiting, key=lambda job: job.enqueued_ns)
        key = self.row_key(first)
        rows = [job if job is not None and self.row_key(job) == key else None for job in heads]
        last = max(i for i, job in enumerate(rows) if job is not None)
        rows = rows[: last + 1]
        for job in rows:
            if job is not None:
                self._take(job)
        return Batch(rows)

    def _next_oldest(self, instance: int, now: int) -> Batch | batching.Wait:
        heads = sorted(
            (
                run.jobs[0]
                for slot, run in self._by_slot.items()
                if slot[0] == instance and run.jobs and not run.running
            ),
            key=lambda job: job.enqueued_ns,
        )
        decision = batching.decide(
            [batching.Pending(1, self.row_key(job), job.enqueued_ns) for job in heads], now, self._cfg.batch
        )
        if isinstance(decision, batching.Wait):
            return decision
        rows: list[Job | None] = list(heads[: decision.count])
        for job in rows:
            assert job is not None
            self._take(job)
        return Batch(rows)

    def finished(self, jobs: Sequence[Job], now: int) -> None:
        """The jobs of one batch were answered; their sequences may take their next job."""
        for job in jobs:
            run = job.sequence
            assert run is not None
            run.running = False
            run.last_ns = now
            self._maybe_release(run)

    def expire(self, now: int) -> list[SequenceRun]:
        """Release the slots of sequences idle for ``max_sequence_idle_microseconds`` (nothing queued,
        nothing running); a later request of theirs without START is refused."""
        idle = [
            run for run in self._active.values() if self._idle_candidate(run) and now - run.last_ns >= self._cfg.idle_ns
        ]
        for run in idle:
            del self._active[run.cid]
            run.ended = True
            self._maybe_release(run)
        return idle

    def row_key(self, job: Job) -> tuple:
        """What rows of one batch must share: the request's input shapes and, with implicit state, the
        shapes of the state its row gets (a state with variable dims grows apart between sequences)."""
        states = self._cfg.states
        if not states:
            return job.shape_key
        batched = self._cfg.batched
        return (job.shape_key, tuple(state_value(spec, job.sequence, job.start, batched).shape for spec in states))

    # -- internals -------------------------------------------------------------------------------
    @staticmethod
    def _idle_candidate(run: SequenceRun) -> bool:
        return run.slot is not None and not run.jobs and not run.running

    def _take(self, job: Job) -> None:
        run = job.sequence
        assert run is not None and run.jobs[0] is job and not run.running
        run.jobs.popleft()
        run.running = True

    def _bind(self, run: SequenceRun, slot: Slot) -> None:
        self._free.discard(slot)
        run.slot = slot
        self._by_slot[slot] = run

    def _maybe_release(self, run: SequenceRun) -> None:
        if not run.ended or run.jobs or run.running:
            return
        if run.slot is None:  # ended while still in the backlog (all its requests cancelled)
            if run in self._backlog:
                self._backlog.remove(run)
            return
        slot, run.slot = run.slot, None
        del self._by_slot[slot]
        while self._backlog:
            waiting = self._backlog.popleft()
            if waiting.ended and not waiting.jobs:
                continue
            self._bind(waiting, slot)
            return
        self._free.add(slot)


# -- the scheduler (event loop + worker threads) -------------------------------------------------

_QUEUED, _RUNNING, _DONE = 0, 1, 2


class _Entry:
    __slots__ = ("done", "enqueued", "job", "request", "state")

    def __init__(self, request: InferRequest, done: batching.Done, enqueued: int) -> None:
        self.request = request
        self.done = done
        self.enqueued = enqueued
        self.job: Job | None = None
        self.state = _QUEUED


class _Row:
    """One batch row as the worker runs it: ``request`` has the control and state inputs added."""

    __slots__ = ("entry", "job", "request")

    def __init__(self, request: InferRequest, entry: _Entry | None, job: Job | None) -> None:
        self.request = request
        self.entry = entry
        self.job = job


class SequenceScheduler:
    """Runs one sequence model version: the book decides, this class feeds instances and answers."""

    def __init__(
        self,
        config: SequenceConfig,
        instances: Sequence[ModelInstance],
        *,
        clock: batching.Clock = time.monotonic_ns,
        observer: batching.Observer | None = None,
    ) -> None:
        if not instances:
            raise ValueError("a scheduler needs at least one instance")
        self._config = config
        self._instances = list(instances)
        self._clock = clock
        self._observer = observer or batching.Observer()
        self._book = SequenceBook(config, len(self._instances))
        self._workers: list[batching._Worker] = []
        self._index: dict[batching._Worker, int] = {}
        self._free: list[batching._Worker] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending = 0
        self._running = 0
        self._closing = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: int | None = None
        self._unwatch: Callable[[], None] | None = None
        self._idle: asyncio.Event | None = None
        self._queued: set[_Entry] = set()
        self._listed = frozenset(config.listed_outputs)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        label = self._config.model_label or "model"
        for index, instance in enumerate(self._instances):
            worker = batching._Worker(instance, f"sluice-{label}-{index}", self._loop, self._done, self._clock)
            self._workers.append(worker)
            self._index[worker] = index
        self._free = list(self._workers)
        self._idle = asyncio.Event()
        self._idle.set()
        watch = getattr(self._clock, "watch", None)
        if watch is not None:
            loop = self._loop
            self._unwatch = watch(lambda: loop.call_soon_threadsafe(self._on_timer))

    async def aclose(self, grace_s: float = 30.0) -> None:
        """Stop taking requests; queued and running ones get ``grace_s`` to finish, then the rest is
        answered UNAVAILABLE and the instances are closed (one still executing is left to its thread)."""
        self._closing = True
        if self._unwatch is not None:
            self._unwatch()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(grace_s, 0.0)
        await batching.wait_idle(self._idle, bool(self._pending or self._running), deadline)
        for entry in list(self._queued):
            self._finish(entry, Unavailable("the model is being unloaded"))
        self._pending = 0
        if self._timer is not None:
            self._timer.cancel()
        workers, self._workers = self._workers, []
        stuck = [worker for worker in workers if worker.batch is not None]
        for worker in stuck:
            rows: list[_Row] = worker.batch or []  # type: ignore[assignment]  # this scheduler's rows
            for row in rows:
                if row.entry is not None:
                    row.request.cancel.cancel()
                    self._finish(
                        row.entry,
                        Unavailable(
                            f"model '{self._config.model_label}' was unloaded: the request did not finish within "
                            f"the {grace_s:g} s grace period"
                        ),
                    )
        await batching.retire(workers, stuck, self._instances, deadline, self._config.model_label)

    @property
    def queue_depth(self) -> int:
        return self._pending

    @property
    def in_flight(self) -> int:
        return self._pending + self._running

    # -- submission --------------------------------------------------------------------------
    async def submit(self, request: InferRequest, priority: int = 0, timeout_us: int | None = None) -> Result:
        future = asyncio.get_running_loop().create_future()

        def done(outcome: Result) -> None:
            if not future.done():
                if isinstance(outcome, SluiceError):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)

        self.enqueue_callback(request, done, priority, timeout_us)
        try:
            return await future
        except asyncio.CancelledError:
            request.cancel.cancel()
            raise

    def enqueue_callback(
        self, request: InferRequest, done: batching.Done, priority: int = 0, timeout_us: int | None = None
    ) -> None:
        """Queue ``request`` on its sequence; ``done`` is called once on the loop. Raises for
        immediate rejections (no or bad correlation id, no START, batch size over 1, unloading).
        ``priority`` and ``timeout_us`` do not apply to sequences (requests run in sequence order)."""
        label = self._config.model_label
        model = label.rpartition(":")[0] or label
        if self._closing or self._loop is None:
            raise Unavailable(f"model '{label}' is not accepting requests (unloading)")
        cid, start, end = sequence_of(request.parameters, self._config, model)
        if request.batch_size > 1:
            raise InvalidArgument(
                f"inference request to model '{model}' must specify batch-size 1 due to requirements of sequence "
                f"batcher (got {request.batch_size})"
            )
        now = self._clock()
        entry = _Entry(request, done, now)
        try:
            entry.job = self._book.admit(cid, start, end, now, entry, request.shape_key)
        except NotStarted:
            raise not_started(cid, model, self._config.idle_ns) from None
        self._pending += 1
        self._queued.add(entry)
        if self._idle is not None:
            self._idle.clear()
        request.cancel.on_cancel(lambda: self._cancel(entry))
        self._pump()
        run = entry.job.sequence
        if request.on_parked is not None and run is not None and run.slot is None and entry.state == _QUEUED:
            request.on_parked()  # in the backlog: other sequences' ENDs (or idle releases) let it run

    # -- internals ---------------------------------------------------------------------------
    def _cancel(self, entry: _Entry) -> None:
        if entry.state != _QUEUED or entry.job is None:
            return
        dropped = self._book.cancel(entry.job)
        if dropped is None:
            return
        self._pending -= 1
        self._observer.on_rejected("cancelled")
        self._finish(entry, Cancelled("the request was cancelled by the client before it ran"))
        run = entry.job.sequence
        cid = run.cid if run is not None else "?"
        for job in dropped:
            self._pending -= 1
            self._observer.on_rejected("cancelled")
            self._finish(
                job.item,
                Cancelled(
                    f"an earlier request of sequence {cid} was cancelled before it ran, which ends the sequence "
                    "(as in Triton); start it again with sequence_start"
                ),
            )
        self._maybe_idle()
        self._pump()  # a released slot may go to a sequence in the backlog

    def _finish(self, entry: _Entry, outcome: Result) -> None:
        if entry.state == _DONE:
            return
        entry.state = _DONE
        self._queued.discard(entry)
        entry.request.cancel.clear()
        try:
            entry.done(outcome)
        except Exception:
            log.exception("completion callback failed for a request of model '%s'", self._config.model_label)

    def _maybe_idle(self) -> None:
        if self._pending == 0 and self._running == 0 and self._idle is not None:
            self._idle.set()

    def _on_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._timer_at = None
        self._pump()  # also while closing: queued requests run within the grace period

    def _arm(self, at_ns: int) -> None:
        assert self._loop is not None
        if self._timer_at is not None and self._timer_at <= at_ns:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at_ns
        self._timer = self._loop.call_later(max(at_ns - self._clock(), 0) / 1e9, self._on_timer)

    def _pump(self) -> None:
        if not self._workers:
            return  # closed: the instances are retired, what was queued was answered
        now = self._clock()
        for run in self._book.expire(now):
            log.info("sequence %s of model '%s' released after being idle", run.cid, self._config.model_label)
        wake: int | None = None
        for worker in list(self._free):
            decision = self._book.next_batch(self._index[worker], now)
            if isinstance(decision, batching.Wait):
                if decision.until_ns is not None:
                    wake = decision.until_ns if wake is None else min(wake, decision.until_ns)
                continue
            self._free.remove(worker)
            self._dispatch(worker, decision, now)
        expiry = self._book.next_expiry()
        for at in (wake, expiry):
            if at is not None:
                self._arm(at)

    def _dispatch(self, worker: batching._Worker, batch: Batch, now: int) -> None:
        rows: list[_Row] = []
        template: Job | None = None
        for job in batch.rows:
            if job is None:
                continue
            entry: _Entry = job.item
            entry.state = _RUNNING
            self._queued.discard(entry)
            template = template or job
        assert template is not None
        for job in batch.rows:
            if job is None:
                rows.append(_Row(self._padding_row(template), None, None))
            else:
                entry = job.item
                rows.append(_Row(self._model_row(entry.request, job), entry, job))
        real = sum(1 for row in rows if row.entry is not None)
        self._pending -= real
        self._running += real
        worker.batch = rows  # type: ignore[assignment]
        worker.jobs.put((rows, [now - row.entry.enqueued if row.entry else 0 for row in rows]))  # type: ignore[arg-type]

    def _state_inputs(self, run: SequenceRun | None, start: bool) -> list[Tensor]:
        batched = self._config.batched
        return [
            Tensor(spec.input_name, spec.datatype, state_value(spec, run, start, batched))
            for spec in self._config.states
        ]

    def _requested(self, request: InferRequest) -> list[RequestedOutput] | None:
        if request.outputs is None or not self._config.states:
            return request.outputs
        asked = {output.name for output in request.outputs}
        extra = [RequestedOutput(s.output_name) for s in self._config.states if s.output_name not in asked]
        return [*request.outputs, *extra]

    def _model_row(self, request: InferRequest, job: Job) -> InferRequest:
        run = job.sequence
        assert run is not None
        controls = control_tensors(self._config, start=job.start, end=job.end, ready=True, cid=run.cid)
        return InferRequest(
            request.model_name,
            request.model_version,
            [*request.inputs, *controls, *self._state_inputs(run, job.start)],
            self._requested(request),
            request.id,
            request.parameters,
            request.cancel,
            1,
            request.shape_key,
            request.caller,
            trace=request.trace,  # sampled (tracing.py): the backend reports its compute split to it
        )

    def _padding_row(self, job: Job) -> InferRequest:
        """A READY=0 row for an empty Direct slot: zeros shaped like ``job``'s row, its state included
        (Triton's null request takes its states from the batch's request: a state with variable dims
        has grown past the initial shape)."""
        template: InferRequest = job.item.request
        inputs = [Tensor(t.name, t.datatype, _zeros_like(t)) for t in template.inputs]
        controls = control_tensors(self._config, start=False, end=False, ready=False, cid=None)
        states = [Tensor(t.name, t.datatype, _zeros_like(t)) for t in self._state_inputs(job.sequence, job.start)]
        return InferRequest(
            template.model_name,
            template.model_version,
            [*inputs, *controls, *states],
            self._requested(template),
            "",
            {},
            batch_size=1,
            shape_key=template.shape_key,
        )

    def _done(
        self,
        worker: batching._Worker,
        rows: list[_Row],
        ran: list[InferRequest],  # the rows' requests, as the worker ran them (the rows keep theirs)
        queue_ns: list[int],
        results: list[Result],
        compute_ns: int,
        start_ns: int = 0,
        phases_ns: tuple[int, int] = (0, 0),
    ) -> None:
        """On the loop, when a worker finished a batch."""
        worker.batch = None
        if worker in self._index and worker not in self._free:
            self._free.append(worker)
        now = self._clock()
        jobs, requests, waits, answers = [], [], [], []
        for row, result, waited in zip(rows, results, queue_ns, strict=True):
            if row.entry is None or row.job is None:
                continue
            self._running -= 1
            trace = row.entry.request.trace
            if trace is not None:  # sampled (tracing.py): the timestamps taken anyway, before it is answered
                size = sum(1 for other in rows if other.entry is not None)
                trace.executed(row.entry.enqueued, waited, start_ns, compute_ns, len(rows), size)
            outcome = self._take_state(row.job, row.entry.request, result)
            jobs.append(row.job)
            requests.append(row.entry.request)
            waits.append(start_ns - row.entry.enqueued if start_ns else waited)  # queue time until compute starts
            answers.append(outcome)
            self._finish(row.entry, outcome)
        self._book.finished(jobs, now)
        self._observer.on_batch(requests, waits, compute_ns, answers, phases_ns=phases_ns)
        self._maybe_idle()
        self._pump()  # also while closing: the next request of each sequence runs within the grace period

    def _take_state(self, job: Job, request: InferRequest, result: Result) -> Result:
        """Keep the row's state outputs for the sequence's next request. The client sees a state output
        only when the config lists it under output and the request asked for it (or for every output)."""
        states = self._config.states
        if not states or not isinstance(result, InferResponse):
            return result
        run = job.sequence
        assert run is not None
        names = {spec.output_name: spec.input_name for spec in states}
        asked = None if request.outputs is None else {output.name for output in request.outputs}
        kept = dict(run.state or {})
        outputs = []
        for tensor in result.outputs:
            if tensor.name in names:
                kept[names[tensor.name]] = np.array(tensor.data, copy=True)
                if tensor.name not in self._listed or (asked is not None and tensor.name not in asked):
                    continue
            outputs.append(tensor)
        run.state = kept
        result.outputs = outputs
        return result


def _zeros_like(tensor: Tensor) -> np.ndarray:
    if tensor.datatype == "BYTES":
        return np.full(tensor.data.shape, b"", dtype=object)
    return np.zeros_like(tensor.data)
