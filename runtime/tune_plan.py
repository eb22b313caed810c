"""The planning half of ``sluice tune`` (pure: no I/O, no clock, no randomness without a seed).

``runtime/tune.py`` measures; this module decides. The search it supports:

1. **Candidate space** (:func:`candidate_space`): batch policy x instance count x preferred batch
   size x max queue delay, plus the model's current settings.
2. **Cost curve** (:func:`fit_cost_curve`): from pre-batched requests of b rows sent one at a time,
   the model's execution time per batch size c(b) (the server's own statistics) and the per-request
   overhead around it (client and server protocol work, which runs on one event loop).
3. **Prediction** (:func:`predict`): a small discrete-event simulation of the closed loop the load
   generator runs (C clients, the serial event loop, k instances sharing the machine's cores),
   in which batches are formed by the scheduler's own pure decision function
   (:func:`sluice.runtime.batching.decide`), so fixed-wait delays and preferred sizes act as they do
   in the server. Its capacity is about ``min(k, cores) * b / c(b)``; its latency is queueing plus
   the wait for a batch to fill plus c(b) plus the overhead.
4. **A race** (:func:`next_step`): short runs of each family's (policy, preferred size) predicted
   best, then of the runners-up in the families that measured best, full-length runs of the best
   few, each family calibrated on its own points and the simulation refit to all of them
   (:func:`refit_curve`), until no unmeasured point is predicted to beat the best measured.
5. **Budget** (:func:`plan_durations`), **the choice** (:func:`choose`) and **the config change**
   (:func:`tuned_model_config`, :func:`edit_config_text`, :func:`config_diff`).
"""

from __future__ import annotations

import dataclasses
import difflib
import heapq
import itertools
import math
import random
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from sluice.runtime.batching import FIXED_WAIT, WORK_CONSERVING, BatchPolicy, Dispatch, Pending, decide

BATCH_POLICY_PARAMETER = "batch_policy"


class PlanError(Exception):
    """A tuning request that cannot be planned; the message says what was wrong and what is allowed."""


class BudgetTooSmall(PlanError):
    """The time budget cannot hold even the shortest measurements; ``needed_s`` is the least that would."""

    def __init__(self, message: str, needed_s: float) -> None:
        super().__init__(message)
        self.needed_s = needed_s


# -- the knobs ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, order=True)
class BatchingConfig:
    """The settings ``sluice tune`` changes. For ``work_conserving`` the preferred sizes and the delay
    never make anyone wait (docs/batching.md); they are kept as the model had them."""

    policy: str
    instances: int
    preferred: tuple[int, ...] = ()
    delay_us: int = 0

    def label(self, batching: bool = True) -> str:
        count = f"{self.instances} instance{'s' if self.instances != 1 else ''}"
        if not batching:
            return count
        if self.policy == WORK_CONSERVING:
            return f"work_conserving, {count}"
        preferred = "[" + ",".join(str(p) for p in self.preferred) + "]" if self.preferred else "none"
        return f"fixed_wait pref {preferred} delay {self.delay_us}us, {count}"


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the planner needs to know of the model and the machine."""

    name: str
    max_batch_size: int
    """0: the model does not batch; only the instance count is tuned."""
    current: BatchingConfig
    cpus: int
    instances_tunable: bool = True
    """False when the model has several instance groups (their counts are left alone)."""


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """Which values are tried (the command-line flags of ``sluice tune``)."""

    max_instances: int = 4
    """Instance counts tried: 1, 2, 4, ... up to this (and this)."""
    delays_us: tuple[int, ...] = (250, 1000, 4000)
    """``max_queue_delay_microseconds`` values tried with ``fixed_wait``."""


def instance_counts(max_instances: int) -> tuple[int, ...]:
    counts = []
    k = 1
    while k <= max_instances:
        counts.append(k)
        k *= 2
    if max_instances >= 1 and counts[-1] != max_instances:
        counts.append(max_instances)
    return tuple(counts)


def preferred_options(max_batch_size: int) -> tuple[tuple[int, ...], ...]:
    """No preferred size, or one of the powers of two up to ``max_batch_size`` (and it)."""
    options: list[tuple[int, ...]] = [()]
    p = 2
    while p <= max_batch_size:
        options.append((p,))
        p *= 2
    if max_batch_size >= 2 and options[-1] != (max_batch_size,):
        options.append((max_batch_size,))
    return tuple(options)


def candidate_space(facts: ModelFacts, space: SearchSpace) -> tuple[BatchingConfig, ...]:
    """Every config the search may pick, the current one first; no duplicates."""
    if space.max_instances < 1:
        raise PlanError(f"--max-instances {space.max_instances}: allowed: 1 or more")
    if any(d < 0 for d in space.delays_us):
        raise PlanError(f"--delays-us {list(space.delays_us)}: allowed: microseconds >= 0")
    current = facts.current
    counts = instance_counts(space.max_instances) if facts.instances_tunable else (current.instances,)
    configs: list[BatchingConfig] = [current]
    if facts.max_batch_size <= 0:
        configs += [dataclasses.replace(current, instances=k) for k in counts]
    else:
        for k in counts:
            configs.append(BatchingConfig(WORK_CONSERVING, k, current.preferred, current.delay_us))
            for preferred in preferred_options(facts.max_batch_size):
                for delay in space.delays_us:
                    configs.append(BatchingConfig(FIXED_WAIT, k, preferred, delay))
    return tuple(dict.fromkeys(configs))


@dataclasses.dataclass(frozen=True, order=True)
class Point:
    """One measurement: a config under a closed-loop load of ``concurrency`` clients."""

    config: BatchingConfig
    concurrency: int


def points(configs: Iterable[BatchingConfig], concurrencies: Sequence[int]) -> list[Point]:
    return [Point(config, c) for config in configs for c in concurrencies]


# -- the cost curve ----------------------------------------------------------------------------


def cost_sizes(max_batch_size: int) -> tuple[int, ...]:
    """Batch sizes measured for the cost curve: 1, 2, 4, ... up to max_batch_size (and it)."""
    if max_batch_size <= 1:
        return (1,)
    sizes = [1]
    while sizes[-1] * 2 <= max_batch_size:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return tuple(sizes)


@dataclasses.dataclass(frozen=True)
class CostSample:
    batch: int
    latency_s: float
    """Mean client-side latency of a request of ``batch`` rows sent alone (concurrency 1)."""
    exec_s: float
    """Mean execution time of such a batch as the server's statistics report it."""


@dataclasses.dataclass(frozen=True)
class Probe:
    """A saturation measurement: many clients, 1-row requests, one instance."""

    throughput: float
    """Requests per second."""
    mean_batch: float


@dataclasses.dataclass(frozen=True)
class CostCurve:
    exec_points: tuple[tuple[int, float], ...]
    """(batch size, execution seconds), sizes ascending, times non-decreasing."""
    overhead_s: float
    """Per-request time outside the model at concurrency 1 (client, protocol, scheduling, wake-ups)."""
    loop_s: float = 0.0
    """Of that, the event loop's time per request, which requests cannot share (bounds throughput)."""
    batch_s: float = 0.0
    """The event loop's time per batch (dispatch to a worker and back, merging, splitting)."""
    hold_s: float = 0.0
    """Time an instance is held per batch beyond c(b), in parallel with the event loop (the hand-off to
    its worker thread and back, waiting for the GIL): while it passes the queue grows, so batches
    form larger than the loop's pace alone would fill them."""

    def exec_s(self, batch: int) -> float:
        """c(b): interpolated linearly between measured sizes, extrapolated from the last two."""
        pts = self.exec_points
        if len(pts) == 1:
            return pts[0][1] * max(batch, 1) / max(pts[0][0], 1) if batch > pts[0][0] else pts[0][1]
        if batch <= pts[0][0]:
            return pts[0][1]
        for (b0, t0), (b1, t1) in itertools.pairwise(pts):
            if batch <= b1:
                return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)
        (b0, t0), (b1, t1) = pts[-2], pts[-1]
        return t1 + (t1 - t0) * (batch - b1) / (b1 - b0)

    def capacity(self, batch: int, instances: int, cpus: int) -> float:
        """Rows per second that ``instances`` can run at batch size ``batch``: min(k, cores)·b/c(b)."""
        return min(instances, max(cpus, 1)) * batch / self.exec_s(batch)


def fit_cost_curve(
    samples: Sequence[CostSample], batched: Probe | None = None, single: Probe | None = None
) -> CostCurve:
    """The cost curve of measured samples: c(b) made non-decreasing (a larger batch never costs less;
    what looks like it is noise), overhead the median of latency minus execution.

    The event loop's share comes from two saturation probes: ``batched`` (work-conserving, batches
    of ``mean_batch``) and ``single`` (every batch one row). Serial loop time per request is
    ``loop + batch / b``, which is ``1 / throughput`` when the loop is the bottleneck; two batch
    sizes give both terms. A probe the model itself bounded (its throughput near the model's
    capacity) says only that the loop is faster, and the loop time is then taken as half that.
    """
    if not samples:
        raise PlanError("no cost-curve measurement to fit")
    ordered = sorted(samples, key=lambda s: s.batch)
    exec_points: list[tuple[int, float]] = []
    running = 0.0
    for sample in ordered:
        running = max(running, sample.exec_s, 1e-7)
        exec_points.append((sample.batch, running))
    overhead = max(statistics.median(max(s.latency_s - s.exec_s, 0.0) for s in ordered), 1e-6)
    curve = CostCurve(tuple(exec_points), overhead)

    def per_request(probe: Probe) -> float:
        b = max(probe.mean_batch, 1.0)
        seconds = 1 / probe.throughput
        model_bound = probe.throughput >= 0.7 * b / curve.exec_s(round(b))
        return min(seconds / 2 if model_bound else seconds, overhead)

    if batched is None or batched.throughput <= 0:
        return curve
    wide = per_request(batched)
    if single is None or single.throughput <= 0 or batched.mean_batch <= 1.05:
        return dataclasses.replace(curve, loop_s=wide)
    one = max(per_request(single), wide)
    # one = loop + batch; wide = loop + batch / b
    batch = (one - wide) / (1 - 1 / batched.mean_batch)
    loop = max(one - batch, 0.0)
    # Where the per-batch time goes is not visible from outside: compared with the measured points
    # (docs/tune.md), most of it holds the instance while the loop goes on serving requests (so the
    # queue grows meanwhile), a smaller share stops the loop. The split starts as below;
    # :func:`refit_curve` scales the held part to the points measured.
    return dataclasses.replace(curve, loop_s=loop, batch_s=batch * LOOP_SHARE_OF_BATCH, hold_s=batch)


LOOP_SHARE_OF_BATCH = 0.25
"""Of the per-batch time the saturation probes show, the share that stops the event loop."""


# -- prediction --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Prediction:
    throughput: float
    """Rows (inferences) per second."""
    p50_s: float
    p99_s: float
    mean_batch: float


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return math.inf
    index = min(len(sorted_values) - 1, max(0, math.ceil(q / 100 * len(sorted_values)) - 1))
    return sorted_values[index]


def predict(
    config: BatchingConfig,
    concurrency: int,
    curve: CostCurve,
    facts: ModelFacts,
    *,
    completions: int = 0,
    seed: int = 0,
) -> Prediction:
    """Simulate ``concurrency`` closed-loop clients sending 1-row requests to ``config``.

    Each request passes the event loop (half the overhead) on its way in and out; the loop serves
    one thing at a time. Batches form by :func:`batching.decide` whenever an instance is idle (or a
    fixed-wait deadline passes) and run c(b), slowed down when more instances (plus the loop) are
    busy than there are cores. Service times get +-15 % seeded jitter so that the simulated clients
    do not fall into lockstep.
    """
    rng = random.Random(seed)
    policy = BatchPolicy(
        max_batch_size=facts.max_batch_size,
        preferred_batch_sizes=config.preferred,
        max_queue_delay_ns=config.delay_us * 1000,
        mode=config.policy,
        dynamic=facts.max_batch_size > 0,
    )
    total = completions or max(400, 25 * concurrency)
    warm = total // 5
    loop_half_ns = curve.loop_s / 2 * 1e9
    batch_ns = curve.batch_s * 1e9
    delay_half_ns = max(curve.overhead_s - curve.loop_s - curve.batch_s, 0.0) / 2 * 1e9
    cpus = max(facts.cpus, 1)
    # Integer nanoseconds, as the scheduler's clock: a float time could sit a rounding error before
    # a fixed-wait deadline forever.
    events: list[tuple[int, int, str, object]] = []
    seq = 0

    def push(at: int, kind: str, payload: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (at, seq, kind, payload))

    busy = 0
    loop_free = 0
    queue: list[tuple[int, int]] = []  # (enqueued at, client)
    submitted = [0] * concurrency
    latencies: list[int] = []
    batches: list[int] = []
    done = 0
    window_start = 0
    timer_at: int | None = None

    loop_busy = 0  # ns the loop has worked so far: its share of a core competes with the instances

    def slowdown() -> float:
        return max(1.0, (busy + (loop_busy / loop_free if loop_free else 0.0)) / cpus)

    def through_loop(now: int) -> int:
        """A request's way in or out: serial time on the loop, then time that overlaps with others'."""
        nonlocal loop_free, loop_busy
        start = max(now, loop_free)
        work = int(loop_half_ns * rng.uniform(0.8, 1.2) * slowdown())
        loop_free, loop_busy = start + work, loop_busy + work
        return loop_free + max(1, int(delay_half_ns * rng.uniform(0.8, 1.2)))

    def dispatch(now: int) -> None:
        nonlocal busy, timer_at, loop_free, loop_busy
        while busy < config.instances and queue:
            head = queue[: max(facts.max_batch_size, 1) + 1]
            decision = decide([Pending(1, (), t) for t, _ in head], now, policy)
            if isinstance(decision, Dispatch):
                taken, queue[:] = queue[: decision.count], queue[decision.count :]
                busy += 1
                work = int(batch_ns * slowdown())
                loop_free, loop_busy = max(now, loop_free) + work, loop_busy + work
                held = curve.exec_s(len(taken)) + curve.hold_s
                run = max(1, int(held * 1e9 * rng.uniform(0.85, 1.15) * slowdown()))
                push(now + run, "done", [client for _, client in taken])
                batches.append(len(taken))
                continue
            until = decision.until_ns
            if until is not None and until > now and (timer_at is None or until < timer_at):
                timer_at = until
                push(until, "timer", None)
            break

    for client in range(concurrency):
        push(through_loop(0), "arrive", client)
    now = 0
    while events and done < total:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            queue.append((now, int(payload)))  # type: ignore[call-overload]
            dispatch(now)
        elif kind == "done":
            busy -= 1
            for client in payload:  # type: ignore[attr-defined]
                push(through_loop(now), "complete", client)
            dispatch(now)
        elif kind == "timer":
            if timer_at is not None and now >= timer_at:
                timer_at = None
            dispatch(now)
        else:  # complete: the client records its latency and sends the next request at once
            client = int(payload)  # type: ignore[call-overload]
            done += 1
            if done == warm:
                window_start = now
            elif done > warm:
                latencies.append(now - submitted[client])
            submitted[client] = now
            push(through_loop(now), "arrive", client)
    measured = len(latencies)
    elapsed_s = (now - window_start) / 1e9
    seconds = sorted(ns / 1e9 for ns in latencies)
    return Prediction(
        throughput=measured / elapsed_s if elapsed_s > 0 else 0.0,
        p50_s=_percentile(seconds, 50),
        p99_s=_percentile(seconds, 99),
        mean_batch=statistics.fmean(batches) if batches else 0.0,
    )


# -- measurements, calibration and the choice --------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Measurement:
    point: Point
    throughput: float
    """Successful rows per second."""
    p50_s: float
    p99_s: float
    requests: int
    errors: int
    mean_batch: float = 0.0
    full: bool = True
    """Measured for the full ``--point-s`` (False: a short screening run)."""
    final: bool = False
    """One of the interleaved, repeated final runs (:func:`final_order`); the choice ranks by their median."""

    @property
    def ok(self) -> bool:
        """Enough answers, and at most 1 % errors (a shedding or failing config is not a candidate)."""
        return self.requests > 0 and self.errors <= 0.01 * (self.requests + self.errors)

    def within(self, latency_budget_s: float | None) -> bool:
        return self.ok and (latency_budget_s is None or self.p99_s <= latency_budget_s)


def calibration(predictions: Mapping[Point, Prediction], measured: Mapping[Point, Measurement]) -> tuple[float, float]:
    """Median ratio measured/predicted of throughput and of p99 over the measured points (1, 1 before any)."""
    pairs = [(predictions[p], m) for p, m in measured.items() if p in predictions and m.ok]
    xs = [m.throughput / pred.throughput for pred, m in pairs if pred.throughput > 0]
    ls = [m.p99_s / pred.p99_s for pred, m in pairs if pred.p99_s > 0 and math.isfinite(m.p99_s)]
    return (statistics.median(xs) if xs else 1.0, statistics.median(ls) if ls else 1.0)


def group_of(point: Point) -> tuple[str, tuple[int, ...]]:
    """The family a point belongs to: its batch policy and preferred size. Within a family the
    simulation ranks delays, instance counts and concurrency well; across families its errors
    differ (a preferred size that leaves the loop and the instance working in turn, say), so each
    family is calibrated on its own measured points."""
    config = point.config
    return (config.policy, config.preferred if config.policy == FIXED_WAIT else ())


def calibrated(
    predictions: Mapping[Point, Prediction], measured: Mapping[Point, Measurement]
) -> dict[Point, Prediction]:
    """Predictions scaled by how far off the measured points of their family were (all measured
    points where the family has none yet)."""
    overall = calibration(predictions, measured)
    by_group: dict[tuple[str, tuple[int, ...]], dict[Point, Measurement]] = {}
    for p, m in measured.items():
        by_group.setdefault(group_of(p), {})[p] = m
    ratios = {g: calibration(predictions, ms) for g, ms in by_group.items()}
    adjusted: dict[Point, Prediction] = {}
    for p, pred in predictions.items():
        x_ratio, l_ratio = ratios.get(group_of(p), overall)
        adjusted[p] = dataclasses.replace(
            pred, throughput=pred.throughput * x_ratio, p50_s=pred.p50_s * l_ratio, p99_s=pred.p99_s * l_ratio
        )
    return adjusted


def refit_curve(
    curve: CostCurve,
    facts: ModelFacts,
    measured: Mapping[Point, Measurement],
    factors: Sequence[float] = (0.25, 0.5, 1.0, 2.0, 4.0),
) -> CostCurve:
    """The curve whose simulation best matches the measured points: the per-batch time an instance
    is held scaled by each of ``factors`` (the part the probes cannot split), the one with the
    least squared log error of throughput kept. c(b) and the per-request times are measured
    directly and stay."""
    base = curve.hold_s or curve.batch_s
    ok = {p: m for p, m in measured.items() if m.ok and m.throughput > 0}
    if base <= 0 or not ok:
        return curve

    def error(candidate: CostCurve) -> float:
        total = 0.0
        for p, m in ok.items():
            predicted = predict(p.config, p.concurrency, candidate, facts, completions=REFIT_COMPLETIONS)
            total += math.log(m.throughput / max(predicted.throughput, 1e-9)) ** 2
        return total

    candidates = [dataclasses.replace(curve, hold_s=base * f) for f in factors]
    return min(candidates, key=lambda c: (error(c), abs(c.hold_s - curve.hold_s)))


REFIT_COMPLETIONS = 300
"""Simulated requests per point while refitting (fewer than for a prediction: it runs many times)."""


@dataclasses.dataclass(frozen=True)
class Choice:
    best: Measurement | None
    """Highest throughput with p99 within the latency budget; None when nothing met it."""
    closest: Measurement | None
    """When nothing met the budget: the lowest p99 measured."""


def choose(measurements: Iterable[Measurement], latency_budget_s: float | None) -> Choice:
    """Among the measured points (several measurements of one point pooled, :func:`pool`).

    When there are final runs (:func:`final_order`), only their points compete, each by the median
    of its final runs (:func:`judged`): one lucky run among noisy near-ties does not win.
    """
    measurements = list(measurements)
    finals = [m for m in measurements if m.final]
    ms = list(judged(finals).values()) if finals else list(pooled(measurements).values())
    within = [m for m in ms if m.within(latency_budget_s)]
    if within:
        return Choice(max(within, key=lambda m: (m.throughput, -m.p99_s)), None)
    ok = [m for m in ms if m.ok]
    return Choice(None, min(ok, key=lambda m: m.p99_s) if ok else None)


@dataclasses.dataclass(frozen=True)
class Step:
    """What to measure next: ``point``, for the full duration (``full``) or a short screening one."""

    point: Point
    full: bool
    why: str
    """screen | refine | confirm | predicted best | closest (for the progress line)."""


@dataclasses.dataclass(frozen=True)
class Racing:
    """The knobs of the search (:func:`next_step`)."""

    refine_groups: int = 3
    """Families (policy, preferred size) whose runners-up are measured after screening."""
    refine_per_group: int = 2
    """Points measured per refined family besides its first."""
    confirm: int = 3
    """The best measured points that must have a full-length measurement before the search ends."""
    margin: float = 0.05
    """An unmeasured point predicted (refit, calibrated) above the best measured by more than this is measured."""
    refine_margin: float = 0.1
    """A runner-up is measured only when predicted within this of its family's best measured."""
    latency_slack: float = 1.5
    """Points predicted within this multiple of the latency budget count as feasible."""
    least: int = 2
    """When nothing is predicted within the budget: how many of the fastest points are measured."""
    finalists: int = 3
    """The best points of the race measured again, interleaved and repeated, and ranked by their median."""
    rounds: int = 5
    """Rounds of the final runs (each finalist once per round), at most."""
    least_rounds: int = 3
    """Fewer rounds than this do not make a median worth the time: the race's choice stands."""
    grid_below: int = 12
    """A space of fewer points than this is measured point by point: the cost curve, the probes, the
    race and its final runs would take more runs than the space has (add_sub's 6 points: 11 runs)."""


def search_for(requested: str, space_points: int, racing: Racing = Racing()) -> str:
    """The search that runs: ``grid`` when asked for, or when the space is small enough that measuring
    every point once is cheaper than modelling it; else ``model``."""
    if requested == "grid" or space_points < racing.grid_below:
        return "grid"
    return requested


def pool(samples: Sequence[Measurement]) -> Measurement:
    """Several measurements of one point as one: rows over total time; percentiles weighted by requests;
    ``full`` when any of them was full-length."""
    if len(samples) == 1:
        return samples[0]
    ok = [m for m in samples if m.requests > 0 and m.throughput > 0]
    requests = sum(m.requests for m in samples)
    errors = sum(m.errors for m in samples)
    window = sum(m.requests / m.throughput for m in ok)

    def weighted(field: str) -> float:
        return sum(getattr(m, field) * m.requests for m in ok) / requests if requests else math.inf

    return Measurement(
        point=samples[0].point,
        throughput=sum(m.requests for m in ok) / window if window > 0 else 0.0,
        p50_s=weighted("p50_s"),
        p99_s=weighted("p99_s"),
        requests=requests,
        errors=errors,
        mean_batch=weighted("mean_batch") if requests else 0.0,
        full=any(m.full for m in samples),
    )


def pooled(measurements: Iterable[Measurement]) -> dict[Point, Measurement]:
    """One (pooled) measurement per point, in the order the points were first measured."""
    by_point: dict[Point, list[Measurement]] = {}
    for m in measurements:
        by_point.setdefault(m.point, []).append(m)
    return {p: pool(ms) for p, ms in by_point.items()}


def judged(measurements: Iterable[Measurement]) -> dict[Point, Measurement]:
    """One measurement per point: the median throughput, p50 and p99 of its runs (``requests`` and
    ``errors`` summed), robust to a single run the machine disturbed."""
    by_point: dict[Point, list[Measurement]] = {}
    for m in measurements:
        by_point.setdefault(m.point, []).append(m)
    return {
        p: Measurement(
            point=p,
            throughput=statistics.median(m.throughput for m in ms),
            p50_s=statistics.median(m.p50_s for m in ms),
            p99_s=statistics.median(m.p99_s for m in ms),
            requests=sum(m.requests for m in ms),
            errors=sum(m.errors for m in ms),
            mean_batch=statistics.median(m.mean_batch for m in ms),
            full=all(m.full for m in ms),
            final=any(m.final for m in ms),
        )
        for p, ms in by_point.items()
    }


def finalists(
    measurements: Iterable[Measurement], latency_budget_s: float | None, racing: Racing = Racing()
) -> list[Point]:
    """The ``racing.finalists`` best points the race measured (pooled) within the latency budget, or
    within ``latency_slack`` x it when measured only short, best first."""
    slack = None if latency_budget_s is None else latency_budget_s * racing.latency_slack
    contenders = sorted(
        (m for m in pooled(measurements).values() if m.within(latency_budget_s) or (not m.full and m.within(slack))),
        key=lambda m: (-m.throughput, m.p99_s, m.point),
    )
    return [m.point for m in contenders[: racing.finalists]]


def final_rounds(
    per_run_s: float, count: int, left_s: float, racing: Racing = Racing(), max_runs: int | None = None
) -> int:
    """How many interleaved rounds of ``count`` finalists fit in ``left_s`` (runs of ``per_run_s``) and
    in ``max_runs`` runs (the size of the whole space: the finals never measure more than a grid
    would): ``racing.rounds`` at most, 0 when not even ``racing.least_rounds`` fit (the race's
    choice stands)."""
    if count <= 1 or per_run_s <= 0:
        return 0
    fit = int(left_s // (per_run_s * count))
    if max_runs is not None:
        fit = min(fit, max_runs // count)
    return min(racing.rounds, fit) if fit >= racing.least_rounds else 0


def final_order(points_: Sequence[Point], rounds: int) -> list[Point]:
    """A B C A B C ...: each finalist once per round, so that a slow minute of the machine falls on all
    of them alike rather than on one."""
    return [p for _ in range(rounds) for p in points_]


def next_step(
    predictions: Mapping[Point, Prediction],
    measurements: Iterable[Measurement],
    latency_budget_s: float | None,
    racing: Racing = Racing(),
) -> Step | None:
    """The next measurement worth making, or None when the search is done. A race, short runs first:

    1. **screen**: the predicted best point of every family (policy, preferred size) with a point
       predicted within ``latency_slack`` x the budget, short; each family is calibrated on its own
       points from then on (:func:`calibrated`), so one family the simulation gets wrong does not
       hide or promote the others;
    2. **refine**: in the ``refine_groups`` families that measured best, up to ``refine_per_group``
       more points each (their next best predicted delays, instance counts, concurrency), short;
    3. **confirm**: the ``confirm`` best measured points within the budget (a short run's p99 may
       be up to ``latency_slack`` x the budget), full length, pooled with their short runs;
    4. **stop rule**: the search ends only when no unmeasured point is predicted (``predictions``
       refit and calibrated) above the best measured by more than ``margin``; such a point is
       measured, short, and, if it is among the best, confirmed.

    When no point is predicted within the budget, the ``least`` fastest predicted points are
    measured, so that the closest one can be named.
    """
    measured = pooled(measurements)
    adjusted = calibrated(predictions, measured)
    unmeasured = {p: pred for p, pred in adjusted.items() if p not in measured}
    if latency_budget_s is not None:
        limit = latency_budget_s * racing.latency_slack
        feasible = {p: pred for p, pred in adjusted.items() if pred.p99_s <= limit}
    else:
        feasible = dict(adjusted)
    within = sorted(
        (m for m in measured.values() if m.within(latency_budget_s)), key=lambda m: (-m.throughput, m.p99_s, m.point)
    )
    if not within and not any(p not in measured for p in feasible):
        if len(measured) >= racing.least or not unmeasured:
            return None
        return Step(min(unmeasured, key=lambda p: (unmeasured[p].p99_s, p)), True, "closest")

    def rank(ps: Iterable[Point]) -> list[Point]:
        return sorted(ps, key=lambda p: (-adjusted[p].throughput, adjusted[p].p99_s, p))

    families: dict[tuple[str, tuple[int, ...]], list[Point]] = {}
    for p in rank(feasible):
        families.setdefault(group_of(p), []).append(p)
    measured_families = {group_of(p) for p in measured}
    for family, ps in families.items():  # best predicted family first
        if family not in measured_families:
            return Step(ps[0], False, "screen")

    best_in_family: dict[tuple[str, tuple[int, ...]], float] = {}
    for m in within:
        best_in_family.setdefault(group_of(m.point), m.throughput)
    leaders = sorted(best_in_family, key=lambda f: -best_in_family[f])[: racing.refine_groups]
    for family in leaders:
        count = sum(1 for p in measured if group_of(p) == family)
        if count > racing.refine_per_group:
            continue
        floor = best_in_family[family] * (1 - racing.refine_margin)
        for p in families.get(family, []):
            if p not in measured and adjusted[p].throughput >= floor:
                return Step(p, False, "refine")

    # A short run's p99 is noisy: one over the budget but within the slack may still be confirmed.
    contenders = sorted(
        (m for m in measured.values() if m.within(latency_budget_s) or (
            not m.full and m.within(None if latency_budget_s is None else latency_budget_s * racing.latency_slack))),
        key=lambda m: (-m.throughput, m.p99_s, m.point),
    )
    for m in contenders[: racing.confirm]:
        if not m.full:
            return Step(m.point, True, "confirm")

    candidates = rank(p for p in feasible if p not in measured)
    if candidates:
        top = candidates[0]
        best = within[0].throughput if within else 0.0
        if adjusted[top].throughput > best * (1 + racing.margin):
            return Step(top, False, "predicted best")
    return None


# -- time budget -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Durations:
    """How long each measurement runs (seconds)."""

    cost_s: float = 0.5
    """Each batch size of the cost curve (one client, pre-batched requests)."""
    warmup_s: float = 0.5
    """Load before each measured point that is not counted."""
    point_s: float = 2.0
    """Each measured point."""


SHORTEST = Durations(cost_s=0.15, warmup_s=0.15, point_s=0.5)
"""The least that still measures anything; a budget that cannot hold these is refused."""
RESERVE_S = 1.0
"""Kept back from the budget for stopping the server and printing."""
STARTUP_ESTIMATE_S = 2.0
"""Allowed for starting the server and loading the model before the budget is planned."""


def needed_s(d: Durations, n_cost: int, points_: int, reload_s: float) -> float:
    """Seconds a search with ``n_cost`` cost-curve sizes and ``points_`` measured points takes."""
    return n_cost * d.cost_s + reload_s + points_ * (reload_s + d.warmup_s + d.point_s) + RESERVE_S


def point_s(d: Durations, reload_s: float) -> float:
    return reload_s + d.warmup_s + d.point_s


SCREEN_SHARE = 1 / 3
"""A screening run lasts this share of a full one (at least 0.25 s, warm-up at most 0.15 s)."""


def screen_durations(d: Durations) -> Durations:
    """The durations of a short (screening) run."""
    short = min(d.point_s, max(0.25, d.point_s * SCREEN_SHARE))
    return dataclasses.replace(d, warmup_s=min(d.warmup_s, 0.15), point_s=short)


def plan_durations(
    remaining_s: float, n_cost: int, least_points: int, reload_s: float, wanted: Durations = Durations()
) -> Durations:
    """``wanted`` if a cost curve of ``n_cost`` sizes and ``least_points`` points fit in
    ``remaining_s``, else durations shrunk towards :data:`SHORTEST` until they do;
    :class:`BudgetTooSmall` when even those do not fit."""
    if needed_s(wanted, n_cost, least_points, reload_s) <= remaining_s:
        return wanted
    pairs = zip(dataclasses.astuple(SHORTEST), dataclasses.astuple(wanted), strict=True)
    floor = Durations(*(min(a, b) for a, b in pairs))
    least = needed_s(floor, n_cost, least_points, reload_s)
    if least > remaining_s:
        raise BudgetTooSmall(
            f"{remaining_s:.1f}s left is too little to measure anything: a cost curve of {n_cost} batch size(s) and "
            f"{least_points} point(s) need at least {least:.1f}s",
            least,
        )
    lo, hi = 0.0, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        trial = _between(floor, wanted, mid)
        if needed_s(trial, n_cost, least_points, reload_s) <= remaining_s:
            lo = mid
        else:
            hi = mid
    return _between(floor, wanted, lo)


def _between(low: Durations, high: Durations, f: float) -> Durations:
    pairs = zip(dataclasses.astuple(low), dataclasses.astuple(high), strict=True)
    return Durations(*(a + (b - a) * f for a, b in pairs))


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)?")


def parse_duration(text: str) -> float:
    """``300`` (seconds), ``90s``, ``5m``, ``1m30s``, ``1.5h``, ``500ms`` -> seconds (> 0)."""
    raw = text.strip().lower()
    total = 0.0
    pos = 0
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, None: 1.0}
    while pos < len(raw):
        match = _DURATION.match(raw, pos)
        if match is None or (match.group(2) is None and match.end() != len(raw)):
            break
        total += float(match.group(1)) * scale[match.group(2)]
        pos = match.end()
    if not raw or pos != len(raw):
        raise PlanError(
            f"{text!r} is not a duration; allowed: seconds (300) or a number with h, m, s or ms (90s, 5m, 1m30s)"
        )
    if total <= 0:
        raise PlanError(f"{text!r} is not a positive duration; allowed: more than 0 seconds")
    return total


# -- the config change -------------------------------------------------------------------------


def batching_of(config: mc.ModelConfig, default_policy: str) -> BatchingConfig:
    """The batching settings ``config`` has now (the server's ``default_policy`` where it names none)."""
    policy = default_policy
    if BATCH_POLICY_PARAMETER in config.parameters:
        policy = config.parameters[BATCH_POLICY_PARAMETER].string_value or default_policy
    groups = list(config.instance_group)
    instances = sum(max(g.count, 1) for g in groups) if groups else 1
    dyn = config.dynamic_batching
    return BatchingConfig(policy, instances, tuple(dyn.preferred_batch_size), int(dyn.max_queue_delay_microseconds))


def tuned_model_config(config: mc.ModelConfig, tuned: BatchingConfig, default_policy: str) -> mc.ModelConfig:
    """A copy of ``config`` with ``tuned`` applied; fields that already say the same are left as they are
    (so a config that names no policy keeps naming none when the server default is chosen)."""
    new = mc.ModelConfig()
    new.CopyFrom(config)
    current = batching_of(config, default_policy)
    if tuned.policy != current.policy or BATCH_POLICY_PARAMETER in config.parameters:
        new.parameters[BATCH_POLICY_PARAMETER].string_value = tuned.policy
    if config.max_batch_size > 0:
        if not config.HasField("dynamic_batching"):
            new.dynamic_batching.SetInParent()
        if tuned.preferred != current.preferred:
            del new.dynamic_batching.preferred_batch_size[:]
            new.dynamic_batching.preferred_batch_size.extend(tuned.preferred)
        if tuned.delay_us != current.delay_us:
            new.dynamic_batching.max_queue_delay_microseconds = tuned.delay_us
    if tuned.instances != current.instances:
        if len(new.instance_group) > 1:
            raise PlanError("the model has several instance groups; sluice tune leaves their counts alone")
        if not new.instance_group:
            new.instance_group.add()
        new.instance_group[0].count = tuned.instances
    return new


@dataclasses.dataclass(frozen=True)
class FieldSpan:
    """A top-level field of a pbtxt text: ``text[start:end]`` is ``name: value`` or ``name { ... }``."""

    name: str
    start: int
    end: int


_TOKEN = re.compile(
    r"""(?P<ws>\s+)|(?P<comment>\#[^\n]*)|(?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')"""
    r"""|(?P<open>[{\[<])|(?P<close>[}\]>])|(?P<sep>[:,;])|(?P<word>[^\s{}\[\]<>:,;#"']+)"""
)


def top_level_fields(text: str) -> list[FieldSpan]:
    """The top-level fields of a pbtxt text with their spans (comments and strings understood)."""
    tokens = [(m.lastgroup or "", m.start(), m.end()) for m in _TOKEN.finditer(text)]
    tokens = [t for t in tokens if t[0] not in ("ws", "comment")]
    spans: list[FieldSpan] = []
    i = 0
    while i < len(tokens):
        kind, start, end = tokens[i]
        if kind != "word":
            i += 1
            continue
        name = text[start:end]
        i += 1
        if i < len(tokens) and tokens[i][0] == "sep" and text[tokens[i][1]] == ":":
            i += 1
        if i >= len(tokens):
            spans.append(FieldSpan(name, start, end))
            break
        if tokens[i][0] == "open":
            depth = 0
            while i < len(tokens):
                if tokens[i][0] == "open":
                    depth += 1
                elif tokens[i][0] == "close":
                    depth -= 1
                    if depth == 0:
                        break
                i += 1
            last = tokens[min(i, len(tokens) - 1)][2]
            i += 1
        else:  # a scalar: one word, or adjacent strings
            last = tokens[i][2]
            first_kind = tokens[i][0]
            i += 1
            while first_kind == "string" and i < len(tokens) and tokens[i][0] == "string":
                last = tokens[i][2]
                i += 1
        if i < len(tokens) and tokens[i][0] == "sep" and text[tokens[i][1]] in ",;":
            last = tokens[i][2]
            i += 1
        spans.append(FieldSpan(name, start, last))
    return spans


def _render(name: str, message: object) -> str:
    body = text_format.MessageToString(message, indent=2)  # type: ignore[arg-type]
    return f"{name} {{\n{body}}}" if body else f"{name} {{ }}"


def _render_parameter(key: str, value: mc.ModelParameter) -> str:
    return f'parameters {{ key: "{key}" value {{ string_value: "{value.string_value}" }} }}'


def _parameter_key(span_text: str) -> str | None:
    probe = mc.ModelConfig()
    try:
        text_format.Parse(span_text, probe)
    except text_format.ParseError:
        return None
    keys = list(probe.parameters)
    return keys[0] if len(keys) == 1 else None


def _line_extent(text: str, span: FieldSpan) -> tuple[int, int]:
    """The span widened to whole lines when it stands alone on its lines (for a clean deletion)."""
    line_start = text.rfind("\n", 0, span.start) + 1
    line_end = text.find("\n", span.end)
    line_end = len(text) if line_end < 0 else line_end + 1
    if text[line_start : span.start].strip() == "" and text[span.end : line_end].strip() == "":
        return line_start, line_end
    return span.start, span.end


def edit_config_text(text: str, original: mc.ModelConfig, tuned: mc.ModelConfig) -> str:
    """``text`` (a config.pbtxt whose parse is ``original``) changed so that it parses to ``tuned``.

    Only the fields that change are rewritten (``dynamic_batching``, ``instance_group``, the
    ``batch_policy`` parameter); comments and layout elsewhere stay. Should the edit not parse to
    ``tuned`` (an unusual layout), the whole config is written out instead, which always does.
    """
    spans = top_level_fields(text)
    edits: list[tuple[int, int, str]] = []  # (start, end, replacement)
    appended: list[str] = []

    def replace_all(name: str, rendered: str) -> None:
        mine = [s for s in spans if s.name == name]
        if not mine:
            appended.append(rendered)
            return
        edits.append((mine[0].start, mine[0].end, rendered))
        edits.extend((*_line_extent(text, s), "") for s in mine[1:])

    if original.dynamic_batching != tuned.dynamic_batching or (
        original.HasField("dynamic_batching") != tuned.HasField("dynamic_batching")
    ):
        replace_all("dynamic_batching", _render("dynamic_batching", tuned.dynamic_batching))
    if list(original.instance_group) != list(tuned.instance_group):
        replace_all("instance_group", "\n".join(_render("instance_group", g) for g in tuned.instance_group))
    key = BATCH_POLICY_PARAMETER
    # (indexing a protobuf map inserts the key: look before indexing)
    changed = key in tuned.parameters and (
        key not in original.parameters or original.parameters[key] != tuned.parameters[key]
    )
    if changed:
        rendered = _render_parameter(key, tuned.parameters[key])
        mine = [s for s in spans if s.name == "parameters" and _parameter_key(text[s.start : s.end]) == key]
        if mine:
            edits.append((mine[0].start, mine[0].end, rendered))
        else:
            appended.append(rendered)
    new = text
    for start, end, replacement in sorted(edits, reverse=True):
        new = new[:start] + replacement + new[end:]
    if appended:
        new = new.rstrip("\n") + ("\n" if new.strip() else "") + "\n".join(appended) + "\n"
    check = mc.ModelConfig()
    try:
        text_format.Parse(new, check)
    except text_format.ParseError:
        check = mc.ModelConfig()
    if check != tuned:
        return "# written by sluice tune\n" + text_format.MessageToString(tuned, indent=0)
    return new


def config_diff(old_text: str, new_text: str, path: str) -> str:
    """A unified diff (``patch -p0`` applies it in the model repository); empty when nothing changes."""
    return "".join(
        difflib.unified_diff(
            old_text.splitlines(keepends=True), new_text.splitlines(keepends=True), f"{path}", f"{path} (tuned)"
        )
    )
