"""``sluice tune``: find the batching settings that give a model the most throughput under a latency budget.

The thin I/O half of the tuner (the decisions are in ``tune_plan``). It starts one
:class:`~sluice.runtime.server.Server` in this process on free loopback ports, serving only the
model being tuned, and talks to it as any client would, with tritonclient:

* each candidate config is applied to the live model through the repository API,
  ``load_model(name, config=<JSON>)``, Triton's load with a config override (no restart);
* the cost curve comes from requests of b rows sent one at a time and the server's statistics;
* each point is measured by a closed-loop load generator in this process (``tritonclient``'s
  ``grpc.aio`` or ``http.aio``), ``concurrency`` clients each sending its next request as soon
  as the last one is answered; throughput, p50 and p99 are taken after a warm-up.

The time budget is read from an injected monotonic clock; every measurement is planned to end
before it. Ctrl-C ends the search after the current point and reports the best so far. Progress
goes to ``err``, the report (table, best config, diff) to ``out``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from sluice.runtime import config as model_config
from sluice.runtime import names
from sluice.runtime import tune_plan as plan
from sluice.runtime.errors import SluiceError
from sluice.runtime.server import Server, StartupError
from sluice.runtime.settings import SchedulingDefaults, ServerSettings

log = logging.getLogger("sluice.runtime.tune")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_MODEL = 3
"""Unknown model, a model that failed to load, or one tune cannot change (ensemble, sequence batching)."""
EXIT_BUDGET = 4
"""The time budget is too small to measure anything."""
EXIT_LATENCY = 5
"""No measured config met the latency budget (the closest is named)."""
EXIT_INTERRUPTED = 130

PROTOCOLS = ("grpc", "http")
SEARCHES = ("model", "grid")


@dataclasses.dataclass(frozen=True)
class TuneSettings:
    """What ``sluice tune`` was asked to do (built once from the command line)."""

    model_repository: Path
    model: str
    latency_budget_ms: float | None = None
    """p99 bound of a point that counts; None: the best throughput, whatever its latency."""
    time_budget_s: float = 300.0
    concurrency: tuple[int, ...] = (1, 8, 32)
    """Closed-loop clients of the measured points."""
    protocol: str = "grpc"
    search: str = "model"
    """``model``: predict from the cost curve, measure the best few; ``grid``: measure every point."""
    space: plan.SearchSpace = dataclasses.field(default_factory=plan.SearchSpace)
    durations: plan.Durations = dataclasses.field(default_factory=plan.Durations)
    max_points: int = 30
    """Most runs (measurements) the model search makes (it usually stops earlier)."""
    apply: bool = False
    """Write the tuned config.pbtxt (a .bak keeps the old one)."""
    json_path: Path | None = None
    """Also write the result as JSON here."""
    cpus: int = 0
    """Cores the server may use (0: this process's CPU affinity)."""


class TuneError(Exception):
    """Ends the run with ``exit_code``; the message is for the user."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclasses.dataclass
class Report:
    """Everything the run found (also written as JSON with ``--json``)."""

    model: str
    search: str
    latency_budget_ms: float | None
    batching: bool
    max_batch_size: int = 0
    backend: str = ""
    measured: list[plan.Measurement] = dataclasses.field(default_factory=list)
    predicted: dict[plan.Point, plan.Prediction] = dataclasses.field(default_factory=dict)
    curve: plan.CostCurve | None = None
    current: plan.BatchingConfig | None = None
    elapsed_s: float = 0.0
    stopped: str = ""
    diff: str = ""
    applied: str = ""


def _to_dict(m: plan.Measurement) -> dict[str, Any]:
    c = m.point.config
    return {
        "config": {
            "policy": c.policy, "instances": c.instances, "preferred": list(c.preferred), "delay_us": c.delay_us,
        },
        "label": c.label(),
        "concurrency": m.point.concurrency,
        "throughput": m.throughput,
        "p50_ms": m.p50_s * 1e3,
        "p99_ms": m.p99_s * 1e3,
        "requests": m.requests,
        "errors": m.errors,
        "mean_batch": m.mean_batch,
    }


class _Clients:
    """The control client (gRPC: load, config, statistics) and the load-generating one."""

    def __init__(self, grpc_url: str, http_url: str, protocol: str, max_concurrency: int) -> None:
        import tritonclient.grpc.aio as grpc_aio

        self.control = grpc_aio.InferenceServerClient(grpc_url)
        self.protocol = protocol
        self.load: Any
        if protocol == "http":
            try:
                import tritonclient.http.aio as http_aio
            except ImportError as exc:  # aiohttp is in tritonclient's http extra
                raise TuneError(
                    f"--protocol http needs tritonclient's HTTP client ({exc}); install it with "
                    "pip install 'sluice[tune]' (or 'tritonclient[http]'), or use --protocol grpc",
                    EXIT_USAGE,
                ) from None
            self.load = http_aio.InferenceServerClient(http_url, conn_limit=max(max_concurrency, 1))
            self.module: Any = http_aio
        else:
            self.load = self.control
            self.module = grpc_aio

    async def aclose(self) -> None:
        if self.load is not self.control:
            await self.load.close()
        await self.control.close()


def _input_arrays(config: mc.ModelConfig, rows: int) -> list[tuple[str, str, np.ndarray]]:
    """One array per input: ``rows`` rows (no batch dimension for a model that does not batch),
    variable dimensions as 1."""
    from tritonclient.utils import triton_to_np_dtype

    arrays = []
    rng = np.random.default_rng(0)
    for spec in config.input:
        if spec.optional:
            continue
        datatype = mc.DataType.Name(spec.data_type).removeprefix("TYPE_")
        datatype = "BYTES" if datatype == "STRING" else datatype
        shape = [d if d > 0 else 1 for d in spec.dims]
        if config.max_batch_size > 0:
            shape = [rows, *shape]
        data: np.ndarray
        if datatype == "BYTES":
            data = np.full(shape, b"0", dtype=np.object_)
        elif datatype == "BOOL":
            data = rng.random(shape) > 0.5
        else:
            data = (rng.random(shape) * 4).astype(triton_to_np_dtype(datatype))
        arrays.append((spec.name, datatype, data))
    return arrays


@dataclasses.dataclass
class _LoadResult:
    latencies_s: list[float]
    errors: int
    window_s: float


class Session:
    """One tuning run against the in-process server: applying configs and measuring points."""

    def __init__(
        self,
        settings: TuneSettings,
        clients: _Clients,
        base: mc.ModelConfig,
        default_policy: str,
        interrupted: asyncio.Event,
    ) -> None:
        self.settings = settings
        self.clients = clients
        self.base = base
        self.default_policy = default_policy
        self.interrupted = interrupted
        self.loaded: plan.BatchingConfig | None = None
        self.reload_s: list[float] = []

    def _inputs(self, rows: int) -> list[Any]:
        inputs = []
        for name, datatype, data in _input_arrays(self.base, rows):
            tensor = self.clients.module.InferInput(name, list(data.shape), datatype)
            tensor.set_data_from_numpy(data)
            inputs.append(tensor)
        return inputs

    async def configure(self, config: plan.BatchingConfig) -> None:
        """Apply ``config`` to the live model: a repository load with a config override."""
        if config == self.loaded:
            return
        override = plan.tuned_model_config(self.base, config, self.default_policy)
        text = json.dumps(model_config.config_to_json(override))
        started = time.perf_counter()
        from tritonclient.utils import InferenceServerException

        try:
            await self.clients.control.load_model(self.settings.model, config=text)
        except InferenceServerException as exc:
            raise TuneError(
                f"the server refused to load '{self.settings.model}' with {config.label()}: {exc.message()}",
                EXIT_FAILED,
            ) from None
        self.reload_s.append(time.perf_counter() - started)
        self.loaded = config

    def reload_estimate(self) -> float:
        return max(self.reload_s) if self.reload_s else 0.5

    async def _counts(self) -> tuple[int, int, dict[int, tuple[int, int]]]:
        """(inference_count, execution_count, batch size -> (count, compute ns)) of the model."""
        stats = await self.clients.control.get_inference_statistics(self.settings.model)
        inference = execution = 0
        per_batch: dict[int, tuple[int, int]] = {}
        for s in stats.model_stats:
            inference += s.inference_count
            execution += s.execution_count
            for b in s.batch_stats:
                count, ns = per_batch.get(b.batch_size, (0, 0))
                per_batch[b.batch_size] = (count + b.compute_infer.count, ns + b.compute_infer.ns)
        return inference, execution, per_batch

    async def closed_loop(self, concurrency: int, rows: int, warmup_s: float, duration_s: float) -> _LoadResult:
        """``concurrency`` clients, each sending a request of ``rows`` rows as soon as its last one
        is answered; latencies of the requests that started after the warm-up and ended in the window."""
        from tritonclient.utils import InferenceServerException

        client = self.clients.load
        model = self.settings.model
        now = time.perf_counter  # uvloop's loop.time() has millisecond steps
        start = now() + warmup_s
        end = start + duration_s
        latencies: list[float] = []
        errors = 0

        async def worker() -> None:
            nonlocal errors
            inputs = self._inputs(rows)
            while not self.interrupted.is_set():
                sent = now()
                if sent >= end:
                    return
                try:
                    await client.infer(model, inputs)
                except InferenceServerException:
                    if sent >= start:
                        errors += 1
                    continue
                answered = now()
                if sent >= start and answered <= end:
                    latencies.append(answered - sent)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        window = min(now(), end) - start
        return _LoadResult(latencies, errors, max(window, 1e-9))

    async def cost_sample(self, batch: int, duration_s: float) -> plan.CostSample:
        before = (await self._counts())[2].get(batch, (0, 0))
        result = await self.closed_loop(1, batch, min(0.05, duration_s / 4), duration_s)
        after = (await self._counts())[2].get(batch, (0, 0))
        count, ns = after[0] - before[0], after[1] - before[1]
        if not result.latencies_s or count <= 0:
            raise TuneError(
                f"no request of {batch} row(s) to '{self.settings.model}' succeeded while measuring the cost curve "
                f"({result.errors} error(s)); check that the model serves requests", EXIT_FAILED
            )
        return plan.CostSample(batch, statistics.fmean(result.latencies_s), ns / count / 1e9)

    async def measure(self, point: plan.Point, durations: plan.Durations) -> plan.Measurement:
        await self.configure(point.config)
        inference0, execution0, _ = await self._counts()
        result = await self.closed_loop(point.concurrency, 1, durations.warmup_s, durations.point_s)
        inference1, execution1, _ = await self._counts()
        latencies = sorted(result.latencies_s)
        executions = execution1 - execution0
        return plan.Measurement(
            point=point,
            throughput=len(latencies) / result.window_s,
            p50_s=_quantile(latencies, 0.50),
            p99_s=_quantile(latencies, 0.99),
            requests=len(latencies),
            errors=result.errors,
            mean_batch=(inference1 - inference0) / executions if executions else 0.0,
        )


def _quantile(ordered: Sequence[float], q: float) -> float:
    if not ordered:
        return math.inf
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class _Progress:
    """Progress lines on stderr, each with the time used of the budget."""

    def __init__(self, err: TextIO, clock: Callable[[], float], started: float, budget_s: float) -> None:
        self.err, self.clock, self.started, self.budget_s = err, clock, started, budget_s

    def elapsed(self) -> float:
        return self.clock() - self.started

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def __call__(self, message: str) -> None:
        print(f"[{self.elapsed():5.1f}s/{self.budget_s:.0f}s] {message}", file=self.err, flush=True)


def _server_settings(settings: TuneSettings) -> ServerSettings:
    server = ServerSettings(
        model_repository=settings.model_repository,
        http_port=0 if settings.protocol == "http" else -1,
        grpc_port=0,
        metrics_port=-1,
        models=(settings.model,),
        strict_readiness=False,
        drain_period_s=0.0,
        shutdown_grace_s=2.0,
        duplicate_window_s=0.0,
    )
    # The load API must accept loads: with model-control modes (Triton's none | poll | explicit),
    # tune runs its own server in explicit mode, which serves only the model asked for.
    if "model_control_mode" in {f.name for f in dataclasses.fields(ServerSettings)}:
        explicit: dict[str, Any] = {"model_control_mode": "explicit"}
        server = dataclasses.replace(server, **explicit)
    return server


def _model_problem(settings: TuneSettings) -> str | None:
    problem = names.name_problem(settings.model)
    if problem is not None:
        return f"--model {names.shown(settings.model)!r}: {problem}; allowed: {names.ALLOWED}"
    root = settings.model_repository
    if not root.is_dir():
        return f"--model-repository {root} is not a directory"
    if not (root / settings.model).is_dir():
        there = sorted(p.name for p in root.iterdir() if p.is_dir() and names.name_problem(p.name) is None)
        return (
            f"unknown model '{settings.model}': no such directory in the model repository; "
            f"models there: {', '.join(there) or 'none'}"
        )
    return None


@dataclasses.dataclass
class _ConfigFile:
    path: Path | None
    text: str
    config: mc.ModelConfig
    editable: bool
    """A config.pbtxt (or none yet): --apply can write it."""


def _read_config_file(model_dir: Path, served: mc.ModelConfig) -> _ConfigFile:
    found = model_config.find_config_file(model_dir)
    if found is None:  # auto-completed: the tuned file names what it was completed with
        base = mc.ModelConfig(name=served.name, backend=served.backend, max_batch_size=served.max_batch_size)
        return _ConfigFile(model_dir / "config.pbtxt", "", base, True)
    text = found.read_text(encoding="utf-8")
    fmt = {".pbtxt": "pbtxt", ".json": "json"}.get(found.suffix, "yaml")
    config = model_config.parse_config(text, path=found.name, fmt=fmt)
    if config.max_batch_size == 0 and served.max_batch_size > 0:
        config.max_batch_size = served.max_batch_size  # auto-completed from the model file
    return _ConfigFile(found, text, config, fmt == "pbtxt")


async def run(
    settings: TuneSettings,
    *,
    out: TextIO | None = None,
    err: TextIO | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """The whole ``sluice tune`` run; returns the exit code. ``out``/``err``: stdout/stderr by default."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    started = clock()
    progress = _Progress(err, clock, started, settings.time_budget_s)
    problem = _model_problem(settings)
    if problem is not None:
        print(f"sluice tune: error: {problem}", file=err, flush=True)
        return EXIT_MODEL
    least = plan.needed_s(plan.SHORTEST, 1, 1, 0.0) + plan.STARTUP_ESTIMATE_S
    if settings.time_budget_s < least:
        print(
            f"sluice tune: error: --time-budget {settings.time_budget_s:g}s is too small to measure anything; "
            f"allowed: at least {math.ceil(least)}s (start, one cost measurement, one point)",
            file=err, flush=True,
        )
        return EXIT_BUDGET
    interrupted = asyncio.Event()
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread: no Ctrl-C
        loop.add_signal_handler(signal.SIGINT, interrupted.set)
    server = Server(_server_settings(settings))
    report: Report | None = None
    try:
        try:
            await server.start()
        except StartupError as exc:
            print(f"sluice tune: error: {exc}", file=err, flush=True)
            return EXIT_FAILED
        if settings.model in server.failed_models:
            print(f"sluice tune: error: {server.failed_models[settings.model]}", file=err, flush=True)
            return EXIT_MODEL
        progress(f"server started (gRPC 127.0.0.1:{server.ports.grpc}); '{settings.model}' loaded")
        clients = _Clients(
            f"127.0.0.1:{server.ports.grpc}", f"127.0.0.1:{server.ports.http}", settings.protocol,
            max(settings.concurrency),
        )
        try:
            report = Report(settings.model, settings.search, settings.latency_budget_ms, True)
            code = await _search(settings, clients, report, progress, interrupted)
        finally:
            await clients.aclose()
    except TuneError as exc:
        print(f"sluice tune: error: {exc}", file=err, flush=True)
        if report is None or not report.measured:
            return exc.exit_code
        code = exc.exit_code
    finally:
        with contextlib.suppress(Exception):
            loop.remove_signal_handler(signal.SIGINT)
        await server.stop(grace_s=1.0)
    assert report is not None
    report.elapsed_s = clock() - started
    return _finish(settings, report, code, interrupted.is_set(), out, err)


async def _search(
    settings: TuneSettings,
    clients: _Clients,
    report: Report,
    progress: _Progress,
    interrupted: asyncio.Event,
) -> int:
    served = (await clients.control.get_model_config(settings.model)).config
    if served.platform == "ensemble":
        raise TuneError(
            f"'{settings.model}' is an ensemble: it has no batching of its own; tune its step models instead",
            EXIT_MODEL,
        )
    if served.HasField("sequence_batching"):
        raise TuneError(
            f"'{settings.model}' uses sequence batching; sluice tune changes dynamic batching only (allowed: models "
            "with dynamic_batching or none)", EXIT_MODEL,
        )
    default_policy = SchedulingDefaults().batch_policy
    current = plan.batching_of(served, default_policy)
    cpus = settings.cpus or len(os.sched_getaffinity(0))
    facts = plan.ModelFacts(settings.model, served.max_batch_size, current, cpus, len(served.instance_group) <= 1)
    report.current = current
    report.batching = served.max_batch_size > 0
    report.max_batch_size, report.backend = served.max_batch_size, served.backend
    if not report.batching:
        progress(
            f"'{settings.model}' has max_batch_size 0 (it does not batch): only the instance count is tuned; batch "
            "policy, preferred sizes and queue delay change nothing for it"
        )
    if not facts.instances_tunable:
        progress(f"'{settings.model}' has several instance groups: their counts are left as they are")
    try:
        configs = plan.candidate_space(facts, settings.space)
    except plan.PlanError as exc:
        raise TuneError(str(exc), EXIT_USAGE) from None
    all_points = plan.points(configs, settings.concurrency)
    search = plan.search_for(settings.search, len(all_points))
    report.search = search
    if search != settings.search:
        progress(f"{len(all_points)} point(s) only: measuring each once is cheaper than modelling them (grid search)")
    session = Session(settings, clients, served, default_policy, interrupted)
    sizes = plan.cost_sizes(served.max_batch_size) if search == "model" else ()
    # Load the cost-curve config first: its reload time sizes the plan.
    await session.configure(plan.BatchingConfig(plan.WORK_CONSERVING, 1, current.preferred, current.delay_us))
    try:
        n_cost = len(sizes) + (1 if sizes and served.max_batch_size > 1 else 0)  # + the unbatched probe
        durations = plan.plan_durations(progress.left(), n_cost, 1, session.reload_estimate(), settings.durations)
    except plan.BudgetTooSmall as exc:
        raise TuneError(f"--time-budget {settings.time_budget_s:g}s: {exc}", EXIT_BUDGET) from None
    if durations != settings.durations:
        progress(
            f"budget is tight: measuring {durations.point_s:.2f}s per point after {durations.warmup_s:.2f}s warm-up, "
            f"{durations.cost_s:.2f}s per cost-curve size"
        )
    per_point = plan.point_s(durations, session.reload_estimate())
    progress(
        f"{len(configs)} config(s) x {len(settings.concurrency)} concurrency level(s) = {len(all_points)} point(s); "
        f"{search} search, {per_point:.1f}s per measured point"
    )
    if search == "grid":
        return await _grid(session, report, all_points, durations, progress, interrupted)
    samples = []
    for i, batch in enumerate(sizes):
        if interrupted.is_set():
            return EXIT_INTERRUPTED
        sample = await session.cost_sample(batch, durations.cost_s)
        samples.append(sample)
        progress(
            f"cost curve {i + 1}/{len(sizes)}: batch {batch}: {sample.exec_s * 1e3:.3f} ms execution, "
            f"{sample.latency_s * 1e3:.3f} ms round trip"
        )
    # Two saturation probes at the highest concurrency give the event loop's share of the overhead:
    # the work-conserving one is also a candidate point, measured in full.
    widest = max(settings.concurrency)
    first = plan.Point(plan.BatchingConfig(plan.WORK_CONSERVING, 1, current.preferred, current.delay_us), widest)
    batched = await _measure_one(session, report, first, durations, progress, settings.max_points, what="saturation")
    single = None
    if served.max_batch_size > 1 and not interrupted.is_set():
        short = dataclasses.replace(durations, warmup_s=durations.cost_s / 2, point_s=durations.cost_s)
        unbatched = await session.measure(plan.Point(plan.BatchingConfig(plan.FIXED_WAIT, 1, (1,), 0), widest), short)
        single = plan.Probe(unbatched.throughput, max(unbatched.mean_batch, 1.0))
        progress(f"saturation without batching: {unbatched.throughput:.0f} inf/s")
    curve = plan.fit_cost_curve(samples, plan.Probe(batched.throughput, batched.mean_batch), single)
    report.curve = curve
    report.predicted = {p: plan.predict(p.config, p.concurrency, curve, facts) for p in all_points}
    progress(
        f"predicted {len(all_points)} point(s) from the cost curve (per request: {curve.overhead_s * 1e3:.3f} ms "
        f"overhead, {curve.loop_s * 1e3:.3f} ms of it on the event loop; per batch: {curve.batch_s * 1e3:.3f} ms on "
        f"the loop, {curve.hold_s * 1e3:.3f} ms holding the instance)"
    )
    budget_s = None if settings.latency_budget_ms is None else settings.latency_budget_ms / 1e3
    screen = plan.screen_durations(durations)
    per_screen = plan.point_s(screen, session.reload_estimate())
    fitted_at = len(report.measured)

    def refit() -> None:
        nonlocal curve, fitted_at
        fitted_at = len(report.measured)
        new = plan.refit_curve(curve, facts, plan.pooled(report.measured))
        if new != curve:
            curve = report.curve = new
            report.predicted = {p: plan.predict(p.config, p.concurrency, curve, facts) for p in all_points}
            progress(f"refit to {len(plan.pooled(report.measured))} measured point(s): "
                     f"{curve.hold_s * 1e3:.3f} ms per batch holding the instance")

    while len(report.measured) < settings.max_points and not interrupted.is_set():
        step = plan.next_step(report.predicted, report.measured, budget_s)
        if step is not None and step.why != "screen" and len(report.measured) - fitted_at >= REFIT_EVERY:
            refit()
            step = plan.next_step(report.predicted, report.measured, budget_s)
        if step is None and len(report.measured) > fitted_at:
            refit()  # the stop rule asks the model refit to everything measured
            step = plan.next_step(report.predicted, report.measured, budget_s)
        if step is None:
            report.stopped = "the best measured points are confirmed and no unmeasured point is predicted to beat them"
            break
        if progress.left() < (per_point if step.full else per_screen) + plan.RESERVE_S:
            report.stopped = "time budget reached"
            break
        await _measure_one(session, report, step.point, durations if step.full else screen, progress,
                           settings.max_points, what=step.why, full=step.full)
    else:
        report.stopped = "interrupted" if interrupted.is_set() else f"measured --max-points {settings.max_points}"
    if not interrupted.is_set():
        await _final(session, report, durations, progress, budget_s, interrupted, len(all_points))
    # The current config at the chosen concurrency, for "how much better" (when time allows).
    choice = plan.choose(report.measured, budget_s)
    chosen = choice.best or choice.closest
    if chosen is not None and not interrupted.is_set():
        baseline = plan.Point(current, chosen.point.concurrency)
        if baseline not in plan.pooled(report.measured) and progress.left() >= per_point + plan.RESERVE_S:
            await _measure_one(session, report, baseline, durations, progress, 0, what="current config")
    return EXIT_INTERRUPTED if interrupted.is_set() else EXIT_OK


async def _final(
    session: Session,
    report: Report,
    durations: plan.Durations,
    progress: _Progress,
    budget_s: float | None,
    interrupted: asyncio.Event,
    space_points: int,
) -> None:
    """The race's best few measured again, full length, interleaved (A B C A B C ...) and repeated; the
    choice then ranks them by their median (:func:`plan.choose`). One run each leaves time for the
    baseline; with too little time left the race's choice stands."""
    racing = plan.Racing()
    points = plan.finalists(report.measured, budget_s, racing)
    per_point = plan.point_s(durations, session.reload_estimate())
    left = progress.left() - plan.RESERVE_S - per_point  # the current config's run afterwards
    rounds = plan.final_rounds(per_point, len(points), left, racing, max_runs=space_points)
    if not rounds:
        return
    progress(f"final: {len(points)} best point(s), {rounds} interleaved round(s) each, ranked by the median")
    for point in plan.final_order(points, rounds):
        if interrupted.is_set() or progress.left() < per_point + plan.RESERVE_S:
            return
        m = await _measure_one(session, report, point, durations, progress, 0, what="final")
        report.measured[-1] = dataclasses.replace(m, final=True)


REFIT_EVERY = 4
"""Measurements after which the simulation is refit to all measured points (and when the search would end)."""


async def _measure_one(
    session: Session,
    report: Report,
    point: plan.Point,
    durations: plan.Durations,
    progress: _Progress,
    limit: int,
    what: str = "",
    full: bool = True,
) -> plan.Measurement:
    per_point = plan.point_s(durations, session.reload_estimate())
    done = len(report.measured)
    eta = progress.left() if not limit else min(progress.left(), (limit - done) * per_point)
    length = "" if full else f", {durations.point_s:.2f}s"
    progress(f"measuring {done + 1} ({what or 'point'}{length}): {point.config.label(report.batching)} "
             f"@ concurrency {point.concurrency} (at most {eta:.0f}s left)")
    m = dataclasses.replace(await session.measure(point, durations), full=full)
    report.measured.append(m)
    predicted = report.predicted.get(point)
    guess = f" (predicted {predicted.throughput:.0f}/s, p99 {predicted.p99_s * 1e3:.2f} ms)" if predicted else ""
    progress(f"  {m.throughput:.0f} inf/s, p50 {m.p50_s * 1e3:.2f} ms, p99 {m.p99_s * 1e3:.2f} ms, "
             f"{m.errors} error(s){guess}")
    return m


async def _grid(
    session: Session,
    report: Report,
    all_points: list[plan.Point],
    durations: plan.Durations,
    progress: _Progress,
    interrupted: asyncio.Event,
) -> int:
    per_point = plan.point_s(durations, session.reload_estimate())
    for point in all_points:
        if interrupted.is_set():
            report.stopped = "interrupted"
            return EXIT_INTERRUPTED
        if progress.left() < per_point + plan.RESERVE_S:
            report.stopped = f"time budget reached after {len(report.measured)} of {len(all_points)} point(s)"
            break
        await _measure_one(session, report, point, durations, progress, len(all_points))
    else:
        report.stopped = f"measured all {len(all_points)} point(s)"
    return EXIT_OK


def _table(report: Report, budget_s: float | None) -> str:
    rows = [("config", "conc", "inf/s", "p50 ms", "p99 ms", "batch", "errors", "within")]
    for m in sorted(plan.pooled(report.measured).values(), key=lambda m: (-m.throughput, m.p99_s)):
        within = "-" if budget_s is None and m.ok else ("yes" if m.within(budget_s) else "no")
        rows.append((
            m.point.config.label(report.batching), str(m.point.concurrency), f"{m.throughput:.0f}",
            f"{m.p50_s * 1e3:.2f}", f"{m.p99_s * 1e3:.2f}", f"{m.mean_batch:.1f}", str(m.errors), within,
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(r[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _finish(settings: TuneSettings, report: Report, code: int, interrupted: bool, out: TextIO, err: TextIO) -> int:
    budget_s = None if settings.latency_budget_ms is None else settings.latency_budget_ms / 1e3
    choice = plan.choose(report.measured, budget_s)
    if report.stopped:
        print(f"search ended: {report.stopped}", file=err, flush=True)
    runs = len(report.measured)
    print(f"sluice tune: model '{report.model}', {report.search} search, {len(plan.pooled(report.measured))} point(s) "
          f"measured ({runs} run{'s' if runs != 1 else ''}) "
          f"in {report.elapsed_s:.1f}s" + (" (interrupted: best so far)" if interrupted else ""), file=out)
    print(_table(report, budget_s), file=out)
    what = "no latency budget" if budget_s is None else f"p99 <= {settings.latency_budget_ms:g} ms"
    if choice.best is None:
        if choice.closest is None:
            print(f"no point was measured successfully ({what})", file=out, flush=True)
            _write_json(settings, report, None, None)
            return code or EXIT_FAILED
        c = choice.closest
        print(
            f"no measured config met the latency budget ({what}); closest: {c.point.config.label(report.batching)} at "
            f"concurrency {c.point.concurrency}: p99 {c.p99_s * 1e3:.2f} ms, {c.throughput:.0f} inf/s",
            file=out, flush=True,
        )
        _write_json(settings, report, None, c)
        return EXIT_INTERRUPTED if interrupted else EXIT_LATENCY
    best = choice.best
    print(
        f"best ({what}): {best.point.config.label(report.batching)} at concurrency {best.point.concurrency}: "
        f"{best.throughput:.0f} inf/s, p50 {best.p50_s * 1e3:.2f} ms, p99 {best.p99_s * 1e3:.2f} ms"
        + (" (medians of the final runs)" if best.final else ""),
        file=out,
    )
    baseline = next(
        (m for m in plan.pooled(report.measured).values()
         if m.point == plan.Point(report.current, best.point.concurrency)), None
    ) if report.current else None
    if baseline is not None and baseline.throughput > 0 and baseline.point != best.point:
        print(f"current config at concurrency {best.point.concurrency}: {baseline.throughput:.0f} inf/s, p99 "
              f"{baseline.p99_s * 1e3:.2f} ms ({best.throughput / baseline.throughput - 1:+.0%} throughput)", file=out)
    code = _diff_and_apply(settings, report, best.point.config, out, err) or code
    _write_json(settings, report, best, None)
    out.flush()
    return EXIT_INTERRUPTED if interrupted else code


def _diff_and_apply(settings: TuneSettings, report: Report, best: plan.BatchingConfig, out: TextIO, err: TextIO) -> int:
    model_dir = settings.model_repository / settings.model
    try:
        # The served config only fills in what the file leaves to auto-completion (max_batch_size).
        served = mc.ModelConfig(name=settings.model, backend=report.backend, max_batch_size=report.max_batch_size)
        file = _read_config_file(model_dir, served)
        tuned = plan.tuned_model_config(file.config, best, SchedulingDefaults().batch_policy)
    except (SluiceError, plan.PlanError, OSError, UnicodeDecodeError) as exc:
        print(f"sluice tune: cannot compute the config change: {exc}", file=err, flush=True)
        return EXIT_FAILED
    path = f"{settings.model}/{file.path.name if file.path else 'config.pbtxt'}"
    if file.editable:
        new_text = plan.edit_config_text(file.text, file.config, tuned)
    else:  # a YAML or JSON config: show the change as pbtxt, for a person to carry over
        new_text = text_format.MessageToString(tuned)
        file.text = text_format.MessageToString(file.config)
        path += " (shown as pbtxt)"
    report.diff = plan.config_diff(file.text, new_text, path)
    if not report.diff:
        print(f"{path}: already has these settings; nothing to change", file=out)
        return EXIT_OK
    print(report.diff, file=out, end="" if report.diff.endswith("\n") else "\n")
    if not settings.apply:
        print("(run again with --apply to write it, or apply the diff in the model repository)", file=out)
        return EXIT_OK
    if not file.editable or file.path is None:
        print(f"sluice tune: --apply writes config.pbtxt only; change {path} by hand", file=err, flush=True)
        return EXIT_FAILED
    target = file.path
    tmp = target.with_name(f".{target.name}.tune-{os.getpid()}")
    try:
        if target.exists():
            shutil.copy2(target, target.with_name(target.name + ".bak"))
        tmp.write_text(new_text, encoding="utf-8")
        os.replace(tmp, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        print(f"sluice tune: cannot write {path}: {exc.strerror or exc}", file=err, flush=True)
        return EXIT_FAILED
    report.applied = path
    kept = " (the old one is config.pbtxt.bak)" if file.text else ""
    print(f"wrote {path}{kept}", file=out)
    return EXIT_OK


def _write_json(
    settings: TuneSettings, report: Report, best: plan.Measurement | None, closest: plan.Measurement | None
) -> None:
    if settings.json_path is None:
        return
    curve = report.curve
    data = {
        "model": report.model,
        "search": report.search,
        "latency_budget_ms": report.latency_budget_ms,
        "elapsed_s": report.elapsed_s,
        "stopped": report.stopped,
        "best": _to_dict(best) if best else None,
        "closest": _to_dict(closest) if closest else None,
        "measured": [_to_dict(m) for m in plan.pooled(report.measured).values()],
        "measurements": len(report.measured),
        "cost_curve": None if curve is None else {
            "exec_ms": {str(b): t * 1e3 for b, t in curve.exec_points}, "overhead_ms": curve.overhead_s * 1e3,
            "loop_ms": curve.loop_s * 1e3, "batch_ms": curve.batch_s * 1e3, "hold_ms": curve.hold_s * 1e3,
        },
        "diff": report.diff,
        "applied": report.applied,
    }
    settings.json_path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
