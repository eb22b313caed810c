"""The canary rollout as one pure decision: ``step(plan, status, observation, now) -> Decision``.

Called by the reconciler on every pass of an InferenceModel with ``spec.canary``; it does no I/O.
The caller gathers the ``Observation`` (per-version metrics over the last interval, readiness of
both Deployments, the answer of a gate webhook) and applies the ``Decision``'s actions (traffic
weight, canary objects, promotion into the stable Deployment, Events); the returned status is
written to the resource, and a restarted operator resumes from it alone.

Phases (a named state machine, as Flagger's and Argo Rollouts'):

    Initializing  the candidate's Deployment is being created; weight 0 until it has ready pods
    Progressing   weight at ``step_weights[step]``; each interval is judged Successful, Failed or
                  Inconclusive from the observation; only a Successful interval advances
    Manual        a fixed ``traffic_percent`` without analysis: nothing is judged
    Promoting     the candidate is being rolled into the stable Deployment; the canary keeps its
                  weight until the stable one is fully rolled out and ready
    Finalising    weight back to 0 on the (now promoted) stable; the canary objects go next pass
    Succeeded     promoted; the canary objects are gone
    RolledBack    weight 0, canary objects removed; the candidate's hash is remembered and it is
                  not tried again until the spec changes

Rules that make it trustworthy: missing data fails closed (no metrics, fewer than
``min_requests``, NaN: Inconclusive, never Successful); a weight never points at a version without
ready pods; a gate that does not say yes holds the step (it is not a failure); a new candidate,
also mid-rollout, restarts the analysis and first takes the old canary's weight away.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence

from sluice.operator import api

INITIALIZING = "Initializing"
PROGRESSING = "Progressing"
MANUAL = "Manual"
PROMOTING = "Promoting"
FINALISING = "Finalising"
SUCCEEDED = "Succeeded"
ROLLED_BACK = "RolledBack"
IDLE = ""

SUCCESSFUL, FAILED, INCONCLUSIVE = "Successful", "Failed", "Inconclusive"


@dataclasses.dataclass(frozen=True)
class Analysis:
    """How a candidate is judged (``spec.canary.analysis``)."""

    step_weights: tuple[int, ...] = (5, 25, 50, 100)
    """Canary traffic percent per step, rising, each 1..100."""
    interval_s: float = 60.0
    """Length of one judged interval."""
    progress_deadline_s: float = 600.0
    """A candidate whose pods are not ready this long after it was deployed is rolled back."""
    min_requests: int = 50
    """Fewer canary requests in an interval make it Inconclusive."""
    max_error_rate: float = 0.01
    """Canary errors / requests above this fail the interval (a fraction, 0.01 = 1 %)."""
    max_p99_ms: float | None = None
    """Canary p99 latency above this fails the interval."""
    max_p99_ratio: float | None = None
    """Canary p99 above this multiple of the stable p99 fails the interval."""
    failure_limit: int = 0
    """Failed intervals tolerated; one more rolls back (0: the first failure rolls back)."""
    inconclusive_limit: int = 2
    """Inconclusive intervals tolerated; one more rolls back."""
    step_gate: bool = False
    """Ask the gate webhook before each weight increase."""
    promotion_gate: bool = False
    """Ask the gate webhook before promotion."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the spec asks for: the candidate (by the hash of everything that changes its pods) and
    either analysis or a fixed ``traffic_percent`` (manual)."""

    candidate: str
    analysis: Analysis | None = Analysis()
    traffic_percent: int = 0
    legacy: str = ""
    """The same candidate as operators before 2026-11-27 named it (a hash of fewer fields): a status
    written by one is read as this candidate, so an upgrade neither restarts a finished rollout nor
    retries a rolled-back candidate."""
    serves: str = ""
    """A hash of what the candidate serves (model source and runtime settings), as :func:`model_serves`
    hashes ``spec.model``: equal once the candidate is folded into ``spec.model``."""


@dataclasses.dataclass(frozen=True)
class VersionMetrics:
    requests: float
    errors: float
    p99_ms: float | None = None

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests > 0 else math.nan


@dataclasses.dataclass(frozen=True)
class Target:
    """What a metrics source reads for one rollout: the runtime pods of each track, told apart by their
    ``app.kubernetes.io/instance`` label (``<name>`` for stable, ``<name>-canary`` for the candidate;
    a PodMonitor's ``podTargetLabels`` turns it into the series label ``app_kubernetes_io_instance``)."""

    namespace: str
    name: str
    """The InferenceModel."""
    model: str
    """The model's name inside the runtime (the ``model`` label of its metrics)."""
    stable_instance: str
    canary_instance: str
    window_s: float
    """Length of the interval being judged (the PromQL range, the scrape baseline's age)."""


@dataclasses.dataclass(frozen=True)
class Observation:
    """What the caller saw since the last interval began. ``None`` metrics: none could be read."""

    canary: VersionMetrics | None = None
    stable: VersionMetrics | None = None
    canary_ready: bool = False
    """The candidate's Deployment runs it on every pod, one of them at least available (its rollout is
    done): what Initializing waits for."""
    canary_serving: bool = False
    """The candidate's Deployment has an available pod, also while a template change rolls its pods
    (all of them the candidate's: a new candidate restarts the rollout in Initializing)."""
    no_baseline: bool = False
    """The metrics source has no earlier reading to count from (a scraping operator that just started):
    the interval starts again, uncounted."""
    stable_rolled_out: bool = False
    """The stable Deployment runs the candidate on every replica, all ready (after a promotion)."""
    gate: bool | None = None
    """The gate webhook's answer for the pending step or promotion: True for 2xx, None when not asked."""


@dataclasses.dataclass(frozen=True)
class Status:
    """The rollout's state in ``status.canary``: everything the next decision needs."""

    phase: str = IDLE
    candidate: str = ""
    step: int = -1
    weight: int = 0
    interval_started: float = 0.0
    failures: int = 0
    inconclusives: int = 0
    failed_candidate: str = ""
    last_result: str = ""
    message: str = ""
    unready_since: float = 0.0
    """When the canary lost its last available pod during the analysis or the promotion (0: it has one)."""
    awaiting_gate: str = ""
    """``step`` or ``promotion`` while the analysis passed and the gate has not approved the next move
    (``interval_started`` then starts the interval watched meanwhile); "" otherwise."""
    serves: str = ""
    """The candidate's :attr:`Plan.serves` (empty in a status written before it was kept)."""


_STATUS_FIELDS = {
    "phase": "phase", "candidate": "candidate", "step": "step", "weight": "weight",
    "interval_started": "intervalStarted", "failures": "failures", "inconclusives": "inconclusives",
    "failed_candidate": "failedCandidate", "last_result": "lastResult", "message": "message",
    "unready_since": "unreadySince", "awaiting_gate": "awaitingGate", "serves": "serves",
}
ACTIVE = (INITIALIZING, PROGRESSING, MANUAL, PROMOTING, FINALISING)
"""Phases in which the candidate's objects exist."""


def status_from(data: object) -> Status:
    """``status.canary`` as stored (camelCase) -> :class:`Status`; anything unreadable falls back to the
    default of that field, so a hand-edited or older status never crashes the reconciler."""
    if not isinstance(data, dict):
        return Status()
    defaults = Status()
    values: dict[str, object] = {}
    for attr, key in _STATUS_FIELDS.items():
        default = getattr(defaults, attr)
        value = data.get(key, default)
        if isinstance(default, bool) or type(value) is bool:
            value = default
        elif isinstance(default, float):
            value = float(value) if isinstance(value, int | float) else default
        elif not isinstance(value, type(default)):
            value = default
        values[attr] = value
    return Status(**values)  # type: ignore[arg-type]


def status_to(status: Status) -> dict[str, object]:
    """:class:`Status` -> ``status.canary`` (camelCase), the inverse of :func:`status_from`."""
    return {key: getattr(status, attr) for attr, key in _STATUS_FIELDS.items()}


@dataclasses.dataclass(frozen=True)
class SetWeight:
    percent: int


@dataclasses.dataclass(frozen=True)
class EnsureCanary:
    candidate: str


@dataclasses.dataclass(frozen=True)
class RemoveCanary:
    pass


@dataclasses.dataclass(frozen=True)
class Promote:
    """Roll the candidate into the stable Deployment."""

    candidate: str


@dataclasses.dataclass(frozen=True)
class AskGate:
    purpose: str  # "step" or "promotion"


@dataclasses.dataclass(frozen=True)
class Event:
    reason: str
    message: str
    warning: bool = False


Action = SetWeight | EnsureCanary | RemoveCanary | Promote | AskGate | Event


@dataclasses.dataclass(frozen=True)
class Decision:
    status: Status
    actions: tuple[Action, ...] = ()
    requeue_after_s: float | None = None
    judged: bool = False
    """An interval was judged from the observation's metrics (the reconciler shows them as lastMetrics)."""


class NoBaseline(Exception):
    """Raised by a metrics source that has nothing earlier to count an interval's requests from."""


def plan_of(spec: api.InferenceModelSpec) -> Plan | None:
    """The rollout ``spec.canary`` asks for. The candidate is named by a hash of everything in the spec
    that changes its pods (the model source it serves, with what it inherits from ``spec.model``; the
    runtime settings it runs with; resources, storage credentials, shutdown and server settings), so a
    change of analysis thresholds or of the manual split goes on with the same rollout, and any change
    to the pods restarts it (Flagger: a new revision), instead of rolling them mid-analysis."""
    canary = spec.canary
    if canary is None:
        return None
    served = {
        "model": dataclasses.asdict(api.candidate_model(spec)),
        "runtime": dataclasses.asdict(canary.runtime or spec.runtime),
    }
    around = {
        "resources": dataclasses.asdict(spec.resources),
        "storage": dataclasses.asdict(spec.storage),
        "shutdown": dataclasses.asdict(spec.shutdown),
        "server": dataclasses.asdict(spec.server),
    }
    # what it serves (8 hex digits), then the pods around it (4): a change of only the latter after the
    # rollout ended is not a new candidate (see same_model)
    candidate = f"v{canary.version}-{_digest(served)[:8]}{_digest(around)[:4]}"
    config = canary.config if canary.config is not None else spec.model.config
    serves = _serves(canary.storage_uri, canary.version, config, canary.runtime or spec.runtime)
    legacy = "v{}-{}".format(canary.version, _digest({
        "storageUri": canary.storage_uri, "version": canary.version, "config": canary.config,
        "runtime": dataclasses.asdict(canary.runtime or spec.runtime), "resources": dataclasses.asdict(spec.resources),
    })[:12])
    wanted = canary.analysis
    if wanted is None:
        return Plan(candidate, None, canary.traffic_percent, legacy, serves)
    analysis = Analysis(
        step_weights=wanted.step_weights,
        interval_s=float(wanted.interval_seconds),
        progress_deadline_s=float(wanted.progress_deadline_seconds),
        min_requests=wanted.min_requests,
        max_error_rate=wanted.max_error_rate_percent / 100,
        max_p99_ms=None if wanted.max_latency_p99_ms is None else float(wanted.max_latency_p99_ms),
        max_p99_ratio=wanted.max_latency_p99_ratio,
        failure_limit=wanted.failure_limit,
        inconclusive_limit=wanted.inconclusive_limit,
        step_gate=wanted.gate_before_step,
        promotion_gate=wanted.gate_before_promotion,
    )
    return Plan(candidate, analysis, canary.traffic_percent, legacy, serves)


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def _serves(storage_uri: str, version: int, config: str | None, runtime: api.RuntimeConfig) -> str:
    """The files, version and config a model serves (the runtime settings where no inline config
    replaces them): what folding a candidate into ``spec.model`` copies. Checksums and size limits,
    which only guard the fetch, are left out."""
    settings = None if config is not None else dataclasses.asdict(runtime)
    return _digest({"storageUri": storage_uri, "version": version, "config": config, "runtime": settings})[:12]


def model_serves(spec: api.InferenceModelSpec) -> str:
    """What ``spec.model`` serves, hashed as :attr:`Plan.serves` hashes a candidate."""
    return _serves(spec.model.storage_uri, spec.model.version, spec.model.config, spec.runtime)


def unfolded(spec: api.InferenceModelSpec, status: Status) -> str | None:
    """Why ``spec.canary`` may not start its candidate yet, or None. A promoted candidate runs in the
    stable pods only while ``spec.canary`` names it: a next candidate before it is folded into
    ``spec.model`` would roll the stable pods back to the older ``spec.model`` and compare the new
    candidate with that (Flagger keeps the promoted version as the primary)."""
    plan = plan_of(spec)
    if plan is None or status.phase not in (FINALISING, SUCCEEDED) or not status.serves:
        return None  # before the promotion ends, a new candidate restarts the rollout from spec.model
    if status.candidate in (plan.candidate, plan.legacy) or same_model(plan.candidate, status.candidate):
        return None
    if model_serves(spec) == status.serves:
        return None
    return (f"spec.canary: the promoted candidate {status.candidate} is not in spec.model yet, so the stable "
            "pods would roll back to spec.model before the next candidate is compared with them; copy the "
            "promoted storageUri, version and config (and spec.canary.runtime, if it set one, into spec.runtime) "
            "into spec.model in this same change, or fold it and remove spec.canary first, then name the next "
            f"candidate. Until then nothing is changed: the stable pods keep serving {status.candidate}")


def same_model(a: str, b: str) -> bool:
    """Whether candidates ``a`` and ``b`` serve the same model (version, files, config, runtime) and
    differ at most in the pods around it (resources, storage, shutdown, server settings)."""
    return a.rpartition("-")[0] == b.rpartition("-")[0] and a[-12:-4] == b[-12:-4] and len(a) == len(b)


def judge(analysis: Analysis, observation: Observation) -> tuple[str, str]:
    """One interval's verdict and why. Missing or too little data is Inconclusive, never Successful."""
    canary = observation.canary
    if not (observation.canary_serving or observation.canary_ready):
        return FAILED, "the canary has no ready pods"
    if canary is None:
        return INCONCLUSIVE, "no canary metrics could be read"
    if math.isnan(canary.requests) or math.isnan(canary.errors):
        return INCONCLUSIVE, "the canary metrics are NaN"
    if canary.requests < analysis.min_requests:
        return INCONCLUSIVE, f"{canary.requests:g} canary requests, fewer than minRequests {analysis.min_requests}"
    if canary.error_rate > analysis.max_error_rate:
        rate, bound = _percents(canary.error_rate, analysis.max_error_rate)
        return FAILED, f"canary error rate {rate} is over {bound}"
    if analysis.max_p99_ms is not None or analysis.max_p99_ratio is not None:
        if canary.p99_ms is None or math.isnan(canary.p99_ms):
            return INCONCLUSIVE, "no canary p99 latency could be read"
        if analysis.max_p99_ms is not None and canary.p99_ms > analysis.max_p99_ms:
            return FAILED, f"canary p99 {canary.p99_ms:g} ms is over {analysis.max_p99_ms:g} ms"
        if analysis.max_p99_ratio is not None:
            stable = observation.stable
            if stable is None or stable.p99_ms is None or math.isnan(stable.p99_ms) or stable.p99_ms <= 0:
                return INCONCLUSIVE, "no stable p99 latency to compare the canary's with"
            if canary.p99_ms > analysis.max_p99_ratio * stable.p99_ms:
                return FAILED, (
                    f"canary p99 {canary.p99_ms:g} ms is over {analysis.max_p99_ratio:g}x "
                    f"the stable p99 {stable.p99_ms:g} ms"
                )
    return SUCCESSFUL, f"{canary.requests:g} requests, error rate {_percent(canary.error_rate)}"


def _percent(fraction: float) -> str:
    return _percents(fraction, fraction)[0]


def _percents(value: float, bound: float) -> tuple[str, str]:
    """Two rates as percents, with the digits that tell them apart (0.005% over 0.001%, 1.0005% over
    1%, never 0.00% over 0.00%), two decimals where those suffice."""
    def shown(x: float, digits: int) -> str:
        text = f"{x * 100:.{digits}f}"
        return text if digits == 2 else text.rstrip("0").rstrip(".")

    for digits in range(2, 10):
        a, b = shown(value, digits), shown(bound, digits)
        apart = a != b or value == bound
        if apart and (float(a) != 0.0 or value == 0.0) and (float(b) != 0.0 or bound == 0.0):
            return f"{a}%", f"{b}%"
    return f"{value * 100:.10g}%", f"{bound * 100:.10g}%"


def step(plan: Plan | None, status: Status, observation: Observation, now: float) -> Decision:
    """The next status and the actions that get there (pure; ``now`` in seconds on any clock)."""
    if plan is None:
        if status.phase in (IDLE, SUCCEEDED):
            return Decision(Status(failed_candidate=status.failed_candidate, phase=status.phase))
        # spec.canary removed: abort whatever was under way; stable takes all traffic first
        actions: list[Action] = []
        if status.weight:
            actions.append(SetWeight(0))
        actions += [RemoveCanary(), Event("CanaryRemoved", "spec.canary was removed: the canary is taken down")]
        return Decision(Status(failed_candidate=status.failed_candidate), tuple(actions))
    if plan.legacy and plan.legacy in (status.candidate, status.failed_candidate):  # written by an older operator
        status = dataclasses.replace(
            status,
            candidate=plan.candidate if status.candidate == plan.legacy else status.candidate,
            failed_candidate=plan.candidate if status.failed_candidate == plan.legacy else status.failed_candidate,
        )
    if plan.candidate == status.candidate and plan.serves and not status.serves:  # a status from before it was kept
        status = dataclasses.replace(status, serves=plan.serves)
    if plan.candidate == status.failed_candidate:
        return _stay_rolled_back(plan, status)
    adopt = status.phase == SUCCEEDED and same_model(plan.candidate, status.candidate)
    if plan.candidate != status.candidate and adopt:
        # promoted, and only the pods around the model changed (resources, shutdown, ...): the stable
        # Deployment takes the change as it runs the candidate; no new rollout of the same model
        status = dataclasses.replace(status, candidate=plan.candidate)
    if plan.candidate != status.candidate:
        return _restart(plan, status, now)
    handler = {
        INITIALIZING: _initializing,
        PROGRESSING: _progressing,
        MANUAL: _manual,
        PROMOTING: _promoting,
        FINALISING: _finalising,
    }.get(status.phase)
    if handler is None:  # Succeeded or RolledBack for this candidate: nothing left to do
        return Decision(status)
    return handler(plan, status, observation, now)


def _restart(plan: Plan, status: Status, now: float) -> Decision:
    actions: list[Action] = []
    if status.weight:
        actions.append(SetWeight(0))  # the old candidate's route goes before its Deployment changes
    actions += [
        EnsureCanary(plan.candidate),
        Event(
            "CanaryStarted",
            f"candidate {plan.candidate}: deploying"
            + (f" (replaces {status.candidate}, whose analysis is dropped)" if status.candidate else ""),
        ),
    ]
    fresh = Status(
        phase=INITIALIZING,
        candidate=plan.candidate,
        serves=plan.serves,
        failed_candidate=status.failed_candidate,
        interval_started=now,
        message="waiting for the canary's pods to be ready",
    )
    return Decision(fresh, tuple(actions), requeue_after_s=_interval(plan))


def _initializing(plan: Plan, status: Status, observation: Observation, now: float) -> Decision:
    if not observation.canary_ready:
        deadline = plan.analysis.progress_deadline_s if plan.analysis is not None else None
        if deadline is not None and now - status.interval_started >= deadline and status.step < 0:
            return _roll_back(status, f"the canary's pods were not ready within progressDeadlineSeconds "
                                      f"{deadline:g} (check their events and logs: image pull, model fetch, "
                                      "failed load, GPU capacity)")
        held = dataclasses.replace(status, weight=0, message="waiting for the canary's pods to be ready")
        actions: tuple[Action, ...] = (EnsureCanary(plan.candidate),)
        if status.weight:  # e.g. the analysis was removed mid-rollout: no share for a canary without pods
            actions = (SetWeight(0), *actions)
        return Decision(held, actions, requeue_after_s=_interval(plan))
    if plan.analysis is None:
        weight = plan.traffic_percent
        manual = dataclasses.replace(status, phase=MANUAL, weight=weight, unready_since=0.0,
                                     message=f"manual split: {weight}%")
        return Decision(manual, (SetWeight(weight), Event("CanaryWeight", f"manual split: {weight}% to the canary")))
    return _enter_step(plan, plan.analysis, status, 0, observation, now)


def _enter_step(
    plan: Plan, analysis: Analysis, status: Status, index: int, observation: Observation, now: float
) -> Decision:
    """Move to ``step_weights[index]``, asking the gate first when the analysis wants one."""
    weight = analysis.step_weights[index]
    if analysis.step_gate and observation.gate is not True:
        held = dataclasses.replace(
            status,
            message=f"holding at {status.weight}%: the gate has not approved {weight}%"
            + (" (it said no)" if observation.gate is False else ""),
        )
        if status.phase == PROGRESSING and not status.awaiting_gate:  # the interval watched while it waits
            held = dataclasses.replace(held, awaiting_gate="step", interval_started=now)
        return Decision(held, (AskGate("step"),), requeue_after_s=_gate_poll(analysis))
    moved = dataclasses.replace(
        status, phase=PROGRESSING, step=index, weight=weight, interval_started=now, unready_since=0.0,
        awaiting_gate="", message=f"analysing at {weight}%",
    )
    return Decision(
        moved,
        (SetWeight(weight), Event("CanaryWeight", f"step {index + 1}/{len(analysis.step_weights)}: {weight}%")),
        requeue_after_s=analysis.interval_s,
    )


def _progressing(plan: Plan, status: Status, observation: Observation, now: float) -> Decision:
    analysis = plan.analysis
    if analysis is None:  # the spec switched to manual mid-rollout: the split once its pods are ready
        waiting = dataclasses.replace(status, phase=INITIALIZING, step=-1, interval_started=now, awaiting_gate="")
        return _initializing(plan, waiting, observation, now)
    unready = _hold_while_unready(analysis, status, observation, now, _step_weight(analysis, status))
    if unready is not None:
        return unready
    if status.interval_started > now:  # the clock stepped back: the interval starts again from now
        status = dataclasses.replace(status, interval_started=now)
    if status.awaiting_gate:
        return _awaiting_gate(plan, analysis, status, observation, now)
    remaining = status.interval_started + analysis.interval_s - now
    if remaining > 0:
        return Decision(status, requeue_after_s=remaining)
    if observation.no_baseline and observation.canary is None:
        restarted = dataclasses.replace(
            status, interval_started=now,
            message=f"analysing at {status.weight}%: the metrics source had no baseline (the operator started "
                    "since the interval began); the interval starts again",
        )
        return Decision(restarted, requeue_after_s=analysis.interval_s)
    verdict, why = judge(analysis, observation)
    decision = _judged(plan, analysis, status, observation, now, verdict, why)
    return dataclasses.replace(decision, judged=True)


def _judged(
    plan: Plan, analysis: Analysis, status: Status, observation: Observation, now: float, verdict: str, why: str
) -> Decision:
    if verdict == FAILED:
        failures = status.failures + 1
        if failures > analysis.failure_limit:
            return _roll_back(dataclasses.replace(status, failures=failures), f"failed: {why}")
        counted = dataclasses.replace(
            status, failures=failures, interval_started=now, last_result=FAILED, message=f"interval failed: {why}"
        )
        return Decision(counted, (Event("CanaryIntervalFailed", why, warning=True),), analysis.interval_s)
    if verdict == INCONCLUSIVE:
        inconclusives = status.inconclusives + 1
        if inconclusives > analysis.inconclusive_limit:
            return _roll_back(
                dataclasses.replace(status, inconclusives=inconclusives),
                f"{inconclusives} inconclusive intervals, over inconclusiveLimit {analysis.inconclusive_limit}: {why}",
            )
        counted = dataclasses.replace(
            status,
            inconclusives=inconclusives,
            interval_started=now,
            last_result=INCONCLUSIVE,
            message=f"interval inconclusive ({why}); holding at {status.weight}%",
        )
        return Decision(counted, (Event("CanaryIntervalInconclusive", why, warning=True),), analysis.interval_s)
    passed = dataclasses.replace(status, last_result=SUCCESSFUL, unready_since=0.0)  # an outage is over once judged
    if status.step + 1 < len(analysis.step_weights):
        return _enter_step(plan, analysis, passed, status.step + 1, observation, now)
    if analysis.promotion_gate and observation.gate is not True:
        held = dataclasses.replace(passed, awaiting_gate="promotion", interval_started=now,
                                   message=_gate_message(analysis, passed, "promotion", observation))
        return Decision(held, (AskGate("promotion"),), requeue_after_s=_gate_poll(analysis))
    return _promote(plan, passed, now)


def _promote(plan: Plan, status: Status, now: float) -> Decision:
    promoting = dataclasses.replace(status, phase=PROMOTING, interval_started=now,  # the promotion's clock
                                    awaiting_gate="", message="promoting: rolling the candidate into stable")
    return Decision(
        promoting,
        (Promote(plan.candidate), Event("CanaryPromoting", f"candidate {plan.candidate} passed every step")),
        requeue_after_s=_interval(plan),
    )


def _gate_message(analysis: Analysis, status: Status, purpose: str, observation: Observation) -> str:
    said = " (it said no)" if observation.gate is False else ""
    if purpose == "promotion":
        return f"analysis passed; waiting for the gate to approve promotion{said}"
    nxt = status.step + 1
    target = f"{analysis.step_weights[nxt]}%" if nxt < len(analysis.step_weights) else "the next step"
    return f"holding at {status.weight}%: the gate has not approved {target}{said}"


def _awaiting_gate(plan: Plan, analysis: Analysis, status: Status, observation: Observation, now: float) -> Decision:
    """The analysis passed and the gate decides the next move (the next step, or promotion). Asked every
    gate poll; meanwhile the canary is still judged once per interval: a failed interval counts (a
    candidate that goes bad while it waits is rolled back, as Flagger keeps checking during a paused
    promotion), an inconclusive one (a quiet night, a metrics outage) does not count against it."""
    purpose = status.awaiting_gate
    if purpose == "step" and status.step + 1 >= len(analysis.step_weights):
        purpose = "promotion"  # the steps were shortened meanwhile: what comes next is the promotion
    wanted = analysis.promotion_gate if purpose == "promotion" else analysis.step_gate
    if observation.gate is True or not wanted:  # approved, or the gate was turned off meanwhile
        released = dataclasses.replace(status, awaiting_gate="")
        if purpose == "promotion":
            return _promote(plan, released, now)
        return _enter_step(plan, analysis, released, status.step + 1, observation, now)
    status = dataclasses.replace(status, awaiting_gate=purpose)
    held = dataclasses.replace(status, message=_gate_message(analysis, status, purpose, observation))
    remaining = status.interval_started + analysis.interval_s - now
    judged = False
    actions: tuple[Action, ...] = (AskGate(status.awaiting_gate),)
    if remaining <= 0 and not (observation.no_baseline and observation.canary is None):
        verdict, why = judge(analysis, observation)
        judged = True
        if verdict == FAILED:
            failures = status.failures + 1
            if failures > analysis.failure_limit:
                return dataclasses.replace(
                    _roll_back(dataclasses.replace(status, failures=failures), f"failed while the gate held it: {why}"),
                    judged=True)
            held = dataclasses.replace(held, failures=failures, last_result=FAILED,
                                       message=f"interval failed while the gate held it: {why}")
            actions += (Event("CanaryIntervalFailed", why, warning=True),)
        held = dataclasses.replace(held, interval_started=now)
        remaining = analysis.interval_s
    elif remaining <= 0:  # no baseline yet (the operator started): the watched interval starts again
        held = dataclasses.replace(held, interval_started=now)
        remaining = analysis.interval_s
    return Decision(held, actions, requeue_after_s=min(_gate_poll(analysis), remaining), judged=judged)


def _manual(plan: Plan, status: Status, observation: Observation, now: float) -> Decision:
    if plan.analysis is not None:  # the spec switched to analysis: start it from the first step
        if not (observation.canary_serving or observation.canary_ready):  # once its pods are ready
            waiting = dataclasses.replace(status, phase=INITIALIZING, step=-1, interval_started=now, awaiting_gate="")
            return _initializing(plan, waiting, observation, now)
        return _enter_step(plan, plan.analysis, status, 0, observation, now)
    serving = observation.canary_serving or observation.canary_ready
    weight = plan.traffic_percent if serving else 0
    if weight == status.weight:
        return Decision(status)
    why = f"manual split: {weight}%" if serving else "the canary has no ready pods: 0%"
    moved = dataclasses.replace(status, weight=weight, message=why)
    return Decision(moved, (SetWeight(weight), Event("CanaryWeight", why)))


def _hold_while_unready(
    analysis: Analysis, status: Status, observation: Observation, now: float, weight: int
) -> Decision | None:
    """The canary lost its available pods (evicted, crashed, a node drained): its traffic goes back to
    stable and the rollout waits, up to ``progressDeadlineSeconds``, then rolls back (Flagger halts the
    analysis the same way). Once it serves again, its weight comes back and the interval starts over.
    None: it serves, and was serving (nothing to do here)."""
    if not (observation.canary_serving or observation.canary_ready):
        # counted from its first outage since the last interval that passed: a canary that keeps
        # losing its pods (crashing under its traffic) is not given it back for ever
        since = status.unready_since or now
        if now - since >= analysis.progress_deadline_s:
            return _roll_back(
                status,
                f"the canary had no ready pods again and again for progressDeadlineSeconds "
                f"{analysis.progress_deadline_s:g} without an interval passing",
            )
        held = dataclasses.replace(
            status, weight=0, unready_since=since,
            message=f"the canary has no ready pods: its traffic is on stable until they are back (rolled back "
                    f"{analysis.progress_deadline_s - (now - since):.0f} s from now otherwise)",
        )
        actions: list[Action] = []
        if status.weight:
            actions += [SetWeight(0), Event("CanaryUnready", "the canary has no ready pods: 0%", warning=True)]
        return Decision(held, tuple(actions), requeue_after_s=min(analysis.interval_s, 30.0))
    if status.weight or not status.unready_since:
        return None  # serving, and not held
    back = dataclasses.replace(status, weight=weight, interval_started=now,  # unready_since kept: see above
                               message=f"the canary is ready again: back at {weight}%")
    return Decision(back, (SetWeight(weight), Event("CanaryWeight", back.message)), requeue_after_s=analysis.interval_s)


def _promoting(plan: Plan, status: Status, observation: Observation, now: float) -> Decision:
    analysis = plan.analysis
    if analysis is not None and status.step >= 0:
        # the canary keeps its weight while stable rolls, only while it has pods to take it
        unready = _hold_while_unready(analysis, status, observation, now, _step_weight(analysis, status))
        if unready is not None:
            if unready.status.phase == ROLLED_BACK:  # the candidate is already in stable: finish the promotion
                unready = Decision(
                    dataclasses.replace(status, weight=0, unready_since=status.unready_since or now,
                                        message="promoting: the canary has no ready pods; traffic on stable "
                                                "while it rolls out"),
                    (SetWeight(0),) if status.weight else (), requeue_after_s=_interval(plan))
            # the promotion's clock runs on while the canary comes and goes
            held = dataclasses.replace(unready.status, interval_started=status.interval_started)
            if not observation.stable_rolled_out:
                held, stalled = _promotion_stalled(plan, status, held, now)
                return Decision(held, (*unready.actions, *stalled, Promote(plan.candidate)), unready.requeue_after_s)
            status = held
    if not observation.stable_rolled_out:
        held = dataclasses.replace(status, message="promoting: waiting for the stable Deployment to roll out")
        held, stalled = _promotion_stalled(plan, status, held, now)
        return Decision(held, (*stalled, Promote(plan.candidate)), requeue_after_s=_interval(plan))
    done = dataclasses.replace(status, phase=FINALISING, weight=0, unready_since=0.0,
                               message="promoted: traffic back on stable")
    return Decision(done, (SetWeight(0),), requeue_after_s=0.0)


def _promotion_stalled(plan: Plan, before: Status, held: Status, now: float) -> tuple[Status, tuple[Action, ...]]:
    """A stable Deployment that has not rolled out ``progressDeadlineSeconds`` after the promotion began
    (its new pods crash, cannot be scheduled, cannot pull): said in the status and in a warning Event,
    once. Nothing is rolled back, as in Flagger: the candidate passed its analysis and is already in the
    stable Deployment's template, and the canary, which keeps its share, serves it meanwhile."""
    analysis = plan.analysis
    if analysis is None or now - before.interval_started < analysis.progress_deadline_s:
        return held, ()
    message = (f"promoting: the stable Deployment has not rolled out within progressDeadlineSeconds "
               f"{analysis.progress_deadline_s:g}; the canary keeps its share until it does (check the stable "
               "pods' events and logs: scheduling, image pull, model fetch, failed load)")
    stalled = dataclasses.replace(held, message=message)
    if before.message == message:
        return stalled, ()
    return stalled, (Event("CanaryPromotionStalled", message, warning=True),)


def _finalising(plan: Plan, status: Status, observation: Observation, now: float) -> Decision:
    done = dataclasses.replace(status, phase=SUCCEEDED, message=f"candidate {plan.candidate} promoted")
    return Decision(done, (RemoveCanary(), Event("CanaryPromoted", done.message)))


def _roll_back(status: Status, why: str) -> Decision:
    rolled = dataclasses.replace(
        status,
        phase=ROLLED_BACK,
        weight=0,
        unready_since=0.0,
        awaiting_gate="",
        failed_candidate=status.candidate,
        last_result=FAILED,
        message=f"rolled back: {why}; change spec.canary to try another candidate, or remove it",
    )
    actions = (SetWeight(0), RemoveCanary(), Event("CanaryRolledBack", rolled.message, warning=True))
    return Decision(rolled, actions)


def _stay_rolled_back(plan: Plan, status: Status) -> Decision:
    if status.phase == ROLLED_BACK and status.candidate == plan.candidate:
        return Decision(status)
    # a remembered failure (e.g. spec.canary set back to a candidate that failed before)
    rolled = Status(
        phase=ROLLED_BACK,
        candidate=plan.candidate,
        failed_candidate=plan.candidate,
        message=f"candidate {plan.candidate} failed before and is not tried again; change spec.canary",
    )
    actions: Sequence[Action] = (SetWeight(0), RemoveCanary()) if status.weight or status.phase else ()
    return Decision(rolled, tuple(actions))


def _step_weight(analysis: Analysis, status: Status) -> int:
    """The weight of the step the rollout is at (the last one, were the steps shortened meanwhile)."""
    return analysis.step_weights[max(0, min(status.step, len(analysis.step_weights) - 1))]


def _interval(plan: Plan) -> float:
    return plan.analysis.interval_s if plan.analysis is not None else 30.0


def _gate_poll(analysis: Analysis) -> float:
    return min(analysis.interval_s, 30.0)
