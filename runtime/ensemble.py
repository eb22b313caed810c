"""Triton ensembles: a DAG of step models run as one model.

The repository builds an :class:`Ensemble` (the plan) for a ``platform: "ensemble"`` config and an
:class:`EnsembleScheduler` in place of a batching scheduler, so the data plane runs an ensemble like
any model version (``enqueue_callback`` / ``aclose``) and pays nothing extra for other models.

Planning is pure (:func:`plan_of`, :func:`runnable`, :func:`step_request`, :func:`ensemble_outputs`,
:func:`missing_local_step`) and tested without I/O. Execution is thin: each local step is an inner
``InferRequest`` sent through the data plane's ``infer_nowait`` (the *dispatch* the repository was
given), so steps get their own batching, queue policies and statistics, as in Triton; a step runs
as soon as all its input tensors exist, so independent steps run concurrently. Steps named by a
``sluice.remote.<model>`` parameter are called over gRPC through remote.py (one channel per target,
reused, closed when the ensemble unloads).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping

from tritonclient.grpc import model_config_pb2 as mc

from sluice.runtime import config as model_config
from sluice.runtime import remote
from sluice.runtime.backends.base import ModelBackend, ModelInstance, Result
from sluice.runtime.batching import Observer
from sluice.runtime.errors import (
    Cancelled,
    Internal,
    InvalidArgument,
    ModelError,
    NotFound,
    SluiceError,
    Unavailable,
)
from sluice.runtime.types import DATATYPE_BY_CONFIG_TYPE, InferRequest, InferResponse, RequestedOutput, Tensor

log = logging.getLogger("sluice.runtime.ensemble")

Done = Callable[[Result], None]
Dispatch = Callable[[InferRequest, Done], None]
"""The data plane's ``infer_nowait``: raises for immediate rejections, else calls ``done`` once."""
StepConfig = Callable[[str, str], "mc.ModelConfig | None"]
"""The config of a ready step model (name, version; "" for the latest), or None."""


# --- the plan (pure) -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Step:
    index: int
    model: str
    version: str  # "" for the latest (model_version -1, or unset)
    inputs: tuple[tuple[str, str], ...]  # (step model input, ensemble tensor)
    outputs: tuple[tuple[str, str], ...]  # (step model output, ensemble tensor)
    remote: str | None = None  # "host:port" when the step is called over gRPC

    @property
    def label(self) -> str:
        return f"step model '{self.model}'" + (f" (remote, at {self.remote})" if self.remote else "")


@dataclasses.dataclass(frozen=True)
class Plan:
    name: str
    outputs: tuple[str, ...]  # the ensemble's outputs, in config order
    output_types: Mapping[str, str]  # ensemble output -> V2 datatype the config declares
    steps: tuple[Step, ...]
    producer: Mapping[str, int]  # ensemble tensor -> index of the step that produces it
    batched: bool = False  # the ensemble's max_batch_size > 0
    output_dims: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # without batch dim


def plan_of(config: mc.ModelConfig) -> Plan:
    """The execution plan of a validated ensemble config (``config.validate`` checked the DAG)."""
    remote = model_config.remote_steps(config)
    steps = tuple(
        Step(
            index,
            step.model_name,
            "" if step.model_version <= 0 else str(step.model_version),  # -1 or unset: the latest
            tuple(sorted(step.input_map.items())),
            tuple(sorted(step.output_map.items())),
            remote.get(step.model_name),
        )
        for index, step in enumerate(config.ensemble_scheduling.step)
    )
    return Plan(
        config.name,
        tuple(o.name for o in config.output),
        {o.name: DATATYPE_BY_CONFIG_TYPE.get(mc.DataType.Name(o.data_type), "BYTES") for o in config.output},
        steps,
        {tensor: step.index for step in steps for _, tensor in step.outputs},
        config.max_batch_size > 0,
        {o.name: tuple(o.reshape.shape if o.HasField("reshape") else o.dims) for o in config.output},
    )


def _dims_match(config_dims: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    if len(config_dims) != len(shape):
        return False
    return all(c == d or c == -1 or d == -1 for c, d in zip(config_dims, shape, strict=True))


def reshape_dims(
    config_dims: tuple[int, ...], batching: bool, tensor_batch: int, shape: tuple[int, ...]
) -> tuple[int, ...]:
    """The shape an ensemble tensor takes where a model (a step input, or the ensemble's own output)
    wants it, as Triton's ensemble scheduler reshapes between batching and non-batching models.

    ``tensor_batch`` is the batch size of the request that produced the tensor (0 when that model,
    or the ensemble for its inputs, does not batch). Towards a batching model, an unbatched tensor
    that matches the dims gets a batch dim of 1 (one that does not match is taken as batched
    already); towards a non-batching model, a batch-of-1 tensor that does not match loses its batch
    dim. Anything else is left alone.
    """
    if batching == (tensor_batch != 0):
        return shape
    if batching:
        return (1, *shape) if _dims_match(config_dims, shape) else shape
    if tensor_batch == 1 and not _dims_match(config_dims, shape):
        return shape[1:]
    return shape


def _batch_of(batching: bool, inputs: Iterable[Tensor]) -> int:
    """Triton's request batch size: the first dim of the inputs for a batching model, else 0."""
    if not batching:
        return 0
    for tensor in inputs:
        if tensor.data.ndim:
            return int(tensor.data.shape[0])
    return 0


def _reshaped(tensor: Tensor, shape: tuple[int, ...]) -> Tensor:
    if shape == tensor.data.shape:
        return tensor
    return Tensor(tensor.name, tensor.datatype, tensor.data.reshape(shape), tensor.parameters)


def runnable(plan: Plan, available: Collection[str], started: Collection[int]) -> list[Step]:
    """Steps not started yet whose input tensors all exist."""
    return [
        step
        for step in plan.steps
        if step.index not in started and all(tensor in available for _, tensor in step.inputs)
    ]


def step_request(
    step: Step,
    tensors: Mapping[str, Tensor],
    outer: InferRequest,
    batches: Mapping[str, int] | None = None,
    config: mc.ModelConfig | None = None,
) -> InferRequest:
    """The inner request of ``step``: its inputs renamed from the ensemble tensors, only the outputs
    the ensemble maps, and the caller's id, parameters (priority, timeout) and caller name passed on.

    With the step model's ``config`` and the tensors' ``batches`` (see :func:`reshape_dims`), each
    input is reshaped (a view, no copy) where the step's batching differs from its producer's."""
    inputs = []
    wanted = {i.name: tuple(i.dims) for i in config.input} if config is not None else {}
    batching = config is not None and config.max_batch_size > 0
    for name, tensor in step.inputs:
        source = tensors[tensor]
        data = source.data
        if config is not None and batches is not None and name in wanted:
            shape = reshape_dims(wanted[name], batching, batches.get(tensor, 0), data.shape)
            if shape != data.shape:
                data = data.reshape(shape)
        if data.flags.writeable:  # a step gets its inputs read-only, as a client's: one that writes into
            data = data.view()  # its input must not change the tensor other steps, the answer or the
            data.flags.writeable = False  # response cache see
        inputs.append(Tensor(name, source.datatype, data))
    return InferRequest(
        step.model,
        step.version,
        inputs,
        [RequestedOutput(name) for name, _ in step.outputs],
        outer.id,
        dict(outer.parameters) if outer.parameters else {},
        caller=outer.caller,
        on_parked=outer.on_parked,  # a step waiting in a sequence backlog: the ensemble's request waits too
    )


def step_outputs(step: Step, response: InferResponse) -> list[Tensor]:
    """The step's response as ensemble tensors; raises ModelError when a mapped output is missing."""
    by_name = {t.name: t for t in response.outputs}
    tensors = []
    for name, tensor in step.outputs:
        produced = by_name.get(name)
        if produced is None:
            raise ModelError(
                f"{step.label} returned no output '{name}' (mapped to ensemble tensor '{tensor}'); "
                f"it returned: {', '.join(by_name) or 'none'}"
            )
        tensors.append(Tensor(tensor, produced.datatype, produced.data))
    return tensors


def ensemble_outputs(plan: Plan, tensors: Mapping[str, Tensor], requested: Iterable[str] | None) -> list[Tensor]:
    """The response tensors: the requested outputs (all outputs when none were named)."""
    out = []
    for name in plan.outputs if requested is None else requested:
        tensor = tensors[name]
        declared = plan.output_types[name]
        if tensor.datatype != declared:
            step = plan.steps[plan.producer[name]]
            raise ModelError(
                f"ensemble '{plan.name}' declares output '{name}' as {declared} but {step.label} produced it "
                f"as {tensor.datatype}; allowed: the step model's datatype in the ensemble config"
            )
        out.append(tensor)
    return out


def ensemble_outputs_reshaped(plan: Plan, outputs: list[Tensor], batches: Mapping[str, int]) -> list[Tensor]:
    """The response tensors in the shape the ensemble declares (see :func:`reshape_dims`)."""
    return [
        _reshaped(t, reshape_dims(plan.output_dims.get(t.name, ()), plan.batched, batches.get(t.name, 0), t.data.shape))
        if t.name in plan.output_dims
        else t
        for t in outputs
    ]


def missing_local_step(plan: Plan, ready: Callable[[str, str], bool]) -> Step | None:
    """The first local step whose model (version) is not ready, or None; remote steps are not checked."""
    for step in plan.steps:
        if step.remote is None and not ready(step.model, step.version):
            return step
    return None


def step_error(plan: Plan, step: Step, error: SluiceError) -> SluiceError:
    """``error`` of a step as the ensemble's client sees it: same status, the step named."""
    if isinstance(error, NotFound) and step.remote is None:
        # The step was unloaded while the ensemble ran: the ensemble is unavailable, not unknown.
        error = Unavailable(error.message)
    wrapped = copy.copy(error)
    wrapped.message = f"ensemble '{plan.name}' {step.label}: {error.message}"
    wrapped.args = (wrapped.message,)
    return wrapped


# --- execution -----------------------------------------------------------------------------------


class Ensemble(ModelBackend):
    """What the repository holds as an ensemble version's backend: its plan. It has no instances."""

    def __init__(self, config: mc.ModelConfig) -> None:
        self.config = config
        self.plan = plan_of(config)

    def new_instance(self, index: int, kind: int, device_id: int) -> ModelInstance:
        raise Internal(f"ensemble '{self.plan.name}' has no instances; its steps run the requests")


class _Run:
    """One ensemble request in flight, or a branch of one.

    A decoupled step model answers with any number of responses: each one continues the rest of the
    ensemble in a branch of its own (a copy of the tensors so far plus that response's outputs), as in
    Triton, once the steps running beside it have finished. Every branch that completes is one response
    of the ensemble: streamed for a decoupled ensemble, the only answer otherwise (a second is an error).
    The request (the root run) ends when nothing runs any more and every decoupled step sent its final flag.
    """

    def __init__(self, scheduler: EnsembleScheduler, request: InferRequest, done: Done, root: _Run | None = None):
        self.scheduler = scheduler
        self.plan = scheduler.plan
        self.request = request
        self.done = done
        self.root: _Run = root or self
        self.tensors: dict[str, Tensor] = {t.name: t for t in request.inputs}
        # ensemble tensor -> batch size of the request that produced it (0: not batched)
        self.batches: dict[str, int] = dict.fromkeys(self.tensors, _batch_of(self.plan.batched, request.inputs))
        self.started: set[int] = set()
        self.pending: dict[int, InferRequest] = {}
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.streaming: set[int] = set()  # decoupled steps that have not sent their final flag
        # their responses, per step in the order they started, until the steps beside them end
        self.queued: dict[int, list[tuple[Step, InferResponse]]] = {}
        self.forked = False  # a decoupled step's responses continue in branches, not here
        self.closed = False  # this run (not the request) has nothing left to do
        # the root only: the request's branches still running, and its single answer (not decoupled)
        self.branches: set[_Run] = set()
        self.answer: InferResponse | None = None
        self.failure: SluiceError | None = None  # a decoupled step's error: answered once the branches end
        self.finished = False
        self.start_ns = time.monotonic_ns()

    def branch(self) -> _Run:
        """A copy of this run's progress, for one response of a decoupled step."""
        branch = _Run(self.scheduler, self.request, self.done, self.root)
        branch.tensors, branch.batches, branch.started = dict(self.tensors), dict(self.batches), set(self.started)
        self.root.branches.add(branch)
        return branch

    def advance(self) -> None:
        """Start every step whose inputs exist; close the run when nothing is left to run."""
        batch = []
        for step in runnable(self.plan, self.tensors, self.started):
            # All of them are pending before any is sent: a step may answer at once (a cache hit).
            self.started.add(step.index)
            config = None if step.remote is not None else self.scheduler.step_config(step.model, step.version)
            inner = self.pending[step.index] = step_request(step, self.tensors, self.request, self.batches, config)
            batch_size = _batch_of(config is not None and config.max_batch_size > 0, inner.inputs)
            for _, tensor in step.outputs:
                self.batches[tensor] = batch_size
            if config is not None and config.model_transaction_policy.decoupled:
                inner.responder = functools.partial(self.step_response, step)
                self.streaming.add(step.index)
                self.queued[step.index] = []
                self.forked = True
            batch.append((step, inner))
        for step, inner in batch:
            if self.root.finished:
                return
            if step.remote is not None:
                trace = self.request.trace  # sampled (tracing.py): a client span, the trace sent along
                traced = None if trace is None else trace.forward(step.model, step.remote)
                call = self.scheduler.remote.call(step, inner, self.step_done, traced)
                self.tasks[step.index] = asyncio.ensure_future(call)
                continue
            done: Done = functools.partial(self.step_done, step)
            if self.request.trace is not None:  # sampled (tracing.py): the step is a child span
                done = self.request.trace.child(inner, "ensemble_step", done)
            try:
                self.scheduler.dispatch(inner, done)
            except SluiceError as exc:
                done(exc)
        self.drain()

    def step_done(self, step: Step, outcome: Result) -> None:
        """A step answered; for a decoupled step, only an error that ended it before it streamed."""
        if self.root.finished:
            return
        if isinstance(outcome, SluiceError) and step.index in self.streaming:
            self.stream_failed(step, outcome)
            return
        self.pending.pop(step.index, None)
        self.tasks.pop(step.index, None)
        if isinstance(outcome, SluiceError):
            self.root.finish(step_error(self.plan, step, outcome))
            return
        if step.index in self.streaming:
            return  # a decoupled step's responses come through step_response
        if self.take(step, outcome):
            self.advance()

    def take(self, step: Step, response: InferResponse) -> bool:
        """The step's outputs into this run's tensors; False (the request answered with the error)
        when the response does not hold them as the plan says."""
        try:
            for tensor in step_outputs(step, response):
                self.tensors[tensor.name] = tensor
        except SluiceError as exc:
            self.root.finish(step_error(self.plan, step, exc))
            return False
        return True

    def step_response(self, step: Step, item: object, final: bool) -> None:
        """One response (or error, or bare final flag) of a decoupled step, on the event loop."""
        if self.root.finished:
            return
        if isinstance(item, SluiceError):
            self.stream_failed(step, item)
            return
        if isinstance(item, InferResponse):
            self.queued[step.index].append((step, item))
        if final:
            self.streaming.discard(step.index)
            self.pending.pop(step.index, None)
        self.drain()

    def stream_failed(self, step: Step, error: SluiceError) -> None:
        """A decoupled step ended with an error: the responses it sent before it still go through the
        steps after it (as they would from the step model itself), then the request ends with the error."""
        if self.root.failure is None:
            self.root.failure = step_error(self.plan, step, error)
        self.streaming.discard(step.index)
        self.pending.pop(step.index, None)
        self.drain()

    def drain(self) -> None:
        """Continue the queued responses of decoupled steps, each in a branch, once the other steps of
        this run have ended (a branch takes their outputs along); close the run when all is done.

        Several decoupled steps of one run are combined as Triton's ensemble scheduler pairs their
        tensors: the n-th response of each goes into the n-th branch, which starts once every one of
        them has sent its n-th; responses of a step beyond what the others sent are never combined (as
        in Triton, where the steps after them never become ready)."""
        if self.root.finished or any(index not in self.streaming for index in self.pending):
            return
        while self.queued and all(self.queued.values()) and not self.root.finished:
            branch = self.branch()
            for responses in self.queued.values():
                step, response = responses.pop(0)
                if not branch.take(step, response):
                    return
            branch.advance()
        if self.root.finished or self.pending or self.closed:
            return
        left = {index: len(responses) for index, responses in self.queued.items() if responses}
        if left:
            log.debug("ensemble '%s': %s response(s) of decoupled steps %s had no counterpart from the steps "
                      "beside them; not continued", self.plan.name, sum(left.values()), sorted(left))
            self.queued = {index: [] for index in self.queued}
        self.closed = True
        if not self.forked:
            self.emit()
        if self is not self.root:
            self.root.branches.discard(self)
        self.root.settle()

    def emit(self) -> None:
        """This run produced the ensemble's outputs: one response of the request."""
        requested = [o.name for o in self.request.outputs] if self.request.outputs else None  # none: all
        try:
            outputs = ensemble_outputs_reshaped(
                self.plan, ensemble_outputs(self.plan, self.tensors, requested), self.batches
            )
        except KeyError as exc:  # a step input was optional and not sent: nothing produced the output
            self.root.finish(InvalidArgument(f"ensemble '{self.plan.name}' produced no output {exc}"))
            return
        except SluiceError as exc:
            self.root.finish(exc)
            return
        response = InferResponse(self.plan.name, "", outputs, self.request.id)
        root = self.root
        if root.request.responder is not None:  # a decoupled ensemble: each response is streamed
            root.request.responder(response, False)
        elif root.answer is not None:
            root.finish(ModelError(
                f"ensemble '{self.plan.name}' is not decoupled but its decoupled steps produced more than one "
                "response; set model_transaction_policy { decoupled: true } on the ensemble and send its "
                "requests on the gRPC ModelStreamInfer stream"
            ))
        else:
            root.answer = response

    def settle(self) -> None:
        """The root: answer the request once it and every branch are closed."""
        if self.finished or not self.closed or self.branches:
            return
        if self.failure is not None:
            self.finish(self.failure)
            return
        elapsed = time.monotonic_ns() - self.start_ns
        if self.request.responder is not None:
            self.request.responder(None, True)
            response = InferResponse(self.plan.name, "", [], self.request.id)
        elif self.answer is None:
            self.finish(ModelError(f"ensemble '{self.plan.name}' produced no response: its decoupled steps sent none"))
            return
        else:
            response = self.answer
        self.scheduler.observer.on_batch([self.request], [0], elapsed, [response])
        self.finish(response)

    def finish(self, outcome: Result) -> None:
        """The root: answer once; steps still in flight, in every branch, are cancelled (not needed)."""
        if self.finished:
            return
        self.finished = True
        self.scheduler.on_finished(self)
        for run in (self, *self.branches):
            for inner in run.pending.values():
                inner.cancel.cancel()
            for task in run.tasks.values():
                task.cancel()
            run.tensors, run.pending, run.queued = {}, {}, {}
        self.branches = set()
        # no cycle (token -> its callback -> this run -> the request -> token) keeps the request and
        # every step's tensors alive until the next full collection
        self.request.cancel.clear()
        self.answer = None
        if self.request.responder is not None and isinstance(outcome, SluiceError):
            # a streamed ensemble's responses reach the client through the event loop's queue: its error
            # goes after them, not ahead (the stream would end and drop them)
            asyncio.get_running_loop().call_soon(self.done, outcome)
            return
        self.done(outcome)


class EnsembleScheduler:
    """Runs requests of one ensemble version; the data plane calls it like a batching scheduler."""

    def __init__(
        self,
        ensemble: Ensemble,
        dispatch: Dispatch,
        *,
        observer: Observer | None = None,
        step_config: StepConfig | None = None,
    ) -> None:
        self.plan = ensemble.plan
        self.dispatch = dispatch
        # Without it (or for remote steps) tensors pass between steps in the shape they have.
        self.step_config: StepConfig = step_config or (lambda model, version: None)
        self.observer = observer or Observer()
        self.remote = RemoteSteps()
        self._runs: set[_Run] = set()
        self._closing = False
        self._idle: asyncio.Event | None = None

    def start(self) -> None:
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def queue_depth(self) -> int:
        return 0  # an ensemble queues nothing itself; its steps do

    @property
    def in_flight(self) -> int:
        return len(self._runs)

    def enqueue_callback(
        self, request: InferRequest, done: Done, priority: int = 0, timeout_us: int | None = None
    ) -> None:
        """Start ``request``; ``done`` is called once with the ensemble's response or error. Priority
        and timeout travel to the steps in the request's parameters."""
        if self._closing or self._idle is None:
            raise Unavailable(f"ensemble '{self.plan.name}' is not accepting requests (unloading)")
        run = _Run(self, request, done)
        self._runs.add(run)
        self._idle.clear()
        request.cancel.on_cancel(lambda: self._cancelled(run))
        run.advance()

    def _cancelled(self, run: _Run) -> None:
        if not run.finished:
            self.observer.on_rejected("cancelled")
            run.finish(Cancelled(f"the request to ensemble '{self.plan.name}' was cancelled by the client"))

    def on_finished(self, run: _Run) -> None:
        self._runs.discard(run)
        if not self._runs and self._idle is not None:
            self._idle.set()

    async def aclose(self, grace_s: float = 30.0) -> None:
        """Stop taking requests, let running ones finish within ``grace_s``, close remote clients."""
        self._closing = True
        if self._idle is not None and self._runs:
            try:
                await asyncio.wait_for(self._idle.wait(), grace_s)
            except TimeoutError:
                pass
        for run in list(self._runs):
            run.finish(Unavailable(f"ensemble '{self.plan.name}' is being unloaded"))
        await self.remote.aclose()


# --- remote steps --------------------------------------------------------------------------------


class RemoteSteps:
    """The remote steps' gRPC clients (remote.py: one channel per target, opened on first use)."""

    def __init__(self) -> None:
        self._clients = remote.RemoteClients()

    async def call(
        self,
        step: Step,
        request: InferRequest,
        done: Callable[[Step, Result], None],
        traced: tuple[Callable[[object], None], str] | None = None,
    ) -> None:
        """Run ``request`` on the remote step and report to ``done`` (not called when cancelled).
        ``traced``: a sampled request's client span (its end, and the traceparent sent along)."""
        end, traceparent = traced if traced is not None else (None, None)
        outcome: Result
        try:
            outcome = await self.infer(step, request, traceparent)
        except SluiceError as exc:
            outcome = exc
        except asyncio.CancelledError:
            if end is not None:
                end(Cancelled(f"the call of remote step '{step.model}' was cancelled"))
            raise
        except Exception as exc:  # whatever the client raises, the ensemble request must be answered
            outcome = Internal(f"calling {step.remote}: {type(exc).__name__}: {exc}")
        if end is not None:
            end(outcome)
        done(step, outcome)

    async def infer(self, step: Step, request: InferRequest, traceparent: str | None = None) -> InferResponse:
        response = await self._clients.infer(step.remote or "", step.model, step.version, request, traceparent)
        return InferResponse(step.model, step.version, response.outputs, request.id)

    async def aclose(self) -> None:
        await self._clients.aclose()
