"""The Kubernetes HorizontalPodAutoscaler (autoscaling/v2) decision for one Pods metric, as plain
arithmetic, so the autoscaling defaults Sluice renders are chosen on evidence (bench/hpa_sim.py)
rather than guessed.

It follows ``pkg/controller/podautoscaler`` for an ``AverageValue`` Pods metric: the usage ratio
``average / target`` with a 10 % tolerance, ``ceil(ratio * ready pods)``, then the behaviour's
stabilization windows (scale up to the lowest, scale down to the highest recommendation of the
window) and its rate-limiting policies over their periods, then min/max. Left out, on purpose:
the missing-pod and unready-pod heuristics (every pod reports), and container resource metrics.
Pure: the caller keeps the ``History`` and passes the time.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

TOLERANCE = 0.1
"""The controller's default ``--horizontal-pod-autoscaler-tolerance``."""
SYNC_PERIOD_S = 15.0
"""The controller's default ``--horizontal-pod-autoscaler-sync-period``."""


@dataclasses.dataclass(frozen=True)
class Policy:
    kind: str  # "Pods" or "Percent"
    value: int
    period_s: float


@dataclasses.dataclass(frozen=True)
class Rules:
    """One direction of ``spec.behavior`` (scaleUp or scaleDown)."""

    stabilization_s: float
    policies: tuple[Policy, ...]
    select: str = "Max"  # Max, Min or Disabled


DEFAULT_SCALE_UP = Rules(0.0, (Policy("Percent", 100, 15.0), Policy("Pods", 4, 15.0)))
"""Kubernetes' default scaleUp: double or add 4 pods every 15 s, whichever is more; no window."""
DEFAULT_SCALE_DOWN = Rules(300.0, (Policy("Percent", 100, 15.0),))
"""Kubernetes' default scaleDown: the highest recommendation of the last 5 minutes, any step."""


@dataclasses.dataclass(frozen=True)
class Behavior:
    scale_up: Rules = DEFAULT_SCALE_UP
    scale_down: Rules = DEFAULT_SCALE_DOWN

    @classmethod
    def from_kubernetes(cls, behavior: Mapping[str, Any] | None) -> Behavior:
        """An HPA's ``spec.behavior`` (as builders render it) as rules; what it leaves out gets
        Kubernetes' defaults, as the API server fills them in."""
        behavior = behavior or {}

        def rules(raw: Mapping[str, Any] | None, default: Rules) -> Rules:
            if raw is None:
                return default
            policies = tuple(Policy(p["type"], int(p["value"]), float(p["periodSeconds"]))
                             for p in raw.get("policies") or ())
            return Rules(
                stabilization_s=float(raw.get("stabilizationWindowSeconds", default.stabilization_s)),
                policies=policies or default.policies,
                select=raw.get("selectPolicy", "Max"),
            )

        return cls(rules(behavior.get("scaleUp"), DEFAULT_SCALE_UP),
                   rules(behavior.get("scaleDown"), DEFAULT_SCALE_DOWN))


@dataclasses.dataclass
class History:
    """What the controller remembers between syncs: recommendations and scale events."""

    recommendations: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    events: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # (time, replica change)
    seen: bool = False
    """Whether the HPA was synced before: at first sight the controller records the current count
    as a recommendation (``recordInitialRecommendation``), so a new HPA does not scale down at once."""


def raw_recommendation(current: int, average: float, target: float) -> int:
    """``ceil(average / target * current)``, or ``current`` inside the tolerance."""
    if current <= 0:
        return current
    ratio = average / target
    if abs(ratio - 1.0) <= TOLERANCE:
        return current
    return math.ceil(ratio * current)


def _period_start(current: int, history: History, period_s: float, now: float) -> int:
    """The replica count at the start of a policy's period: ``current`` less what was added in it, plus
    what was removed (``periodStartReplicas``: both directions count)."""
    changed = sum(change for at, change in history.events if at > now - period_s)
    return current - changed


def _scale_up_limit(current: int, rules: Rules, history: History, now: float) -> int:
    if rules.select == "Disabled" or not rules.policies:
        return current
    limits = []
    for policy in rules.policies:
        start = _period_start(current, history, policy.period_s, now)
        if policy.kind == "Pods":
            limits.append(start + policy.value)
        else:
            limits.append(math.ceil(start * (1 + policy.value / 100)))
    limit = max(limits) if rules.select == "Max" else min(limits)
    return max(limit, current)  # never a scale down: wait for the period's events to age out


def _scale_down_limit(current: int, rules: Rules, history: History, now: float) -> int:
    if rules.select == "Disabled" or not rules.policies:
        return current
    limits = []
    for policy in rules.policies:
        start = _period_start(current, history, policy.period_s, now)
        if policy.kind == "Pods":
            limits.append(start - policy.value)
        else:
            limits.append(math.floor(start * (1 - policy.value / 100)))
    limit = min(limits) if rules.select == "Max" else max(limits)
    return min(limit, current)  # never a scale up


def decide(
    current: int,
    average: float,
    target: float,
    min_replicas: int,
    max_replicas: int,
    behavior: Behavior,
    history: History,
    now: float,
) -> int:
    """One sync: the replica count the HPA sets; records the recommendation and the change."""
    if current == 0 and min_replicas != 0:
        return 0  # scaled to zero by hand: the controller leaves autoscaling off (ScalingDisabled)
    if not history.seen:
        history.seen = True
        history.recommendations.append((now, current))
    if current > max_replicas or current < min_replicas:  # the controller first brings it into range
        result = min(max(current, min_replicas), max_replicas)
        history.events.append((now, result - current))
        return result
    desired = raw_recommendation(current, average, target)
    window = max(behavior.scale_up.stabilization_s, behavior.scale_down.stabilization_s)
    history.recommendations = [(at, r) for at, r in history.recommendations if at > now - window]
    up = down = desired
    for at, recommendation in history.recommendations:
        if at > now - behavior.scale_up.stabilization_s:
            up = min(up, recommendation)
        if at > now - behavior.scale_down.stabilization_s:
            down = max(down, recommendation)
    history.recommendations.append((now, desired))
    stabilized = min(max(current, up), down)
    if stabilized > current:
        stabilized = min(stabilized, _scale_up_limit(current, behavior.scale_up, history, now), max_replicas)
    elif stabilized < current:
        stabilized = max(stabilized, _scale_down_limit(current, behavior.scale_down, history, now), min_replicas)
    result = stabilized
    if result != current:
        history.events.append((now, result - current))
    history.events = [(at, c) for at, c in history.events if at > now - 3600]
    return result
