"""kube-scheduler's filters and the Deployment/ReplicaSet controllers' bookkeeping, as pure functions.

Called by :class:`sluice_testing.ApiServer` when it runs with ``simulate_scheduling=True``; the functions
take and return objects as the API serves them (plain dicts) and do no I/O, so they are tested on
their own (``tests/operator_/test_emulated_scheduler.py``).

What a Pod must pass to be bound to a Node, in the default scheduler profile's filter order (the first
filter that fails decides the node's reasons, as in the scheduling framework):

1. NodeUnschedulable: ``spec.unschedulable`` unless the pod tolerates
   ``node.kubernetes.io/unschedulable:NoSchedule``;
2. TaintToleration: every ``NoSchedule``/``NoExecute`` taint tolerated. A node whose ``Ready`` condition
   is ``False``/``Unknown`` carries the ``node.kubernetes.io/not-ready``/``unreachable`` NoSchedule taint
   the node lifecycle controller would add;
3. NodeAffinity: ``nodeSelector`` and required node affinity (``nodeSelectorTerms`` ORed, expressions
   ANDed; ``In``, ``NotIn``, ``Exists``, ``DoesNotExist``, ``Gt``, ``Lt``; ``matchFields`` on
   ``metadata.name``);
4. NodeResourcesFit: the pod count against ``allocatable.pods`` and every resource the pod requests
   (requests, or limits where a request is missing; init containers and sidecars aggregated as the
   kubelet does; ``spec.overhead`` added) against ``allocatable`` minus what pods bound to the node hold.

A pod that fits nowhere gets kube-scheduler's message: ``0/3 nodes are available: 1 node(s) didn't
match Pod's node affinity/selector, 2 Insufficient nvidia.com/mig-1g.10gb. preemption: 0/3 nodes are
available: 1 Preemption is not helpful for scheduling, 2 No preemption victims found for incoming
pod..`` (reasons counted per node and sorted as strings; the doubled final period is the real one).
No pod is ever preempted: every pod is treated as being of the same priority.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any

Obj = Mapping[str, Any]

UNSCHEDULABLE = "node(s) were unschedulable"
AFFINITY = "node(s) didn't match Pod's node affinity/selector"
TOO_MANY_PODS = "Too many pods"
NOT_HELPFUL = "Preemption is not helpful for scheduling"
NO_VICTIMS = "No preemption victims found for incoming pod"
NO_NODES = "no nodes available to schedule pods"
GATED = "Scheduling is blocked due to non-empty scheduling gates"
TEMPLATE_HASH_LABEL = "pod-template-hash"
_TERMINAL = ("Succeeded", "Failed")

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "k": Fraction(10**3),
            "M": Fraction(10**6), "G": Fraction(10**9), "T": Fraction(10**12), "P": Fraction(10**15),
            "E": Fraction(10**18)}


def quantity(value: Any) -> Fraction:
    """A Kubernetes quantity (``500m``, ``4Gi``, ``1e3``, ``2``) as an exact number."""
    text = str(value).strip()
    for suffix, factor in _BINARY.items():
        if text.endswith(suffix):
            return Fraction(text[: -len(suffix)]) * factor
    if text and text[-1] in _DECIMAL and text[-2:-1].lower() != "e":
        return Fraction(text[:-1]) * _DECIMAL[text[-1]]
    if "e" in text.lower():
        mantissa, exponent = text.lower().split("e", 1)
        return Fraction(mantissa) * Fraction(10) ** int(exponent)
    return Fraction(text)


def _requests(resources: Obj | None) -> dict[str, Fraction]:
    """A container's requests; a resource with only a limit requests its limit (API defaulting)."""
    resources = resources or {}
    wanted = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
    return {name: quantity(amount) for name, amount in wanted.items()}


def _add(into: dict[str, Fraction], other: Mapping[str, Fraction]) -> None:
    for name, amount in other.items():
        into[name] = into.get(name, Fraction(0)) + amount


def _max(into: dict[str, Fraction], other: Mapping[str, Fraction]) -> None:
    for name, amount in other.items():
        into[name] = max(into.get(name, Fraction(0)), amount)


def pod_requests(pod: Obj) -> dict[str, Fraction]:
    """What a pod asks of its node: containers summed, init containers at their peak, sidecars
    (restartable init containers) running alongside both, plus ``spec.overhead``."""
    spec = pod.get("spec") or {}
    total: dict[str, Fraction] = {}
    for container in spec.get("containers") or []:
        _add(total, _requests(container.get("resources")))
    sidecars: dict[str, Fraction] = {}
    peak: dict[str, Fraction] = {}
    for container in spec.get("initContainers") or []:
        wanted = _requests(container.get("resources"))
        if container.get("restartPolicy") == "Always":
            _add(total, wanted)
            _add(sidecars, wanted)
            _max(peak, sidecars)
        else:
            running = dict(sidecars)
            _add(running, wanted)
            _max(peak, running)
    _max(total, peak)
    _add(total, {name: quantity(amount) for name, amount in (spec.get("overhead") or {}).items()})
    return total


def holds_node(pod: Obj) -> bool:
    """Whether ``pod`` is bound and not finished, i.e. counts against its node."""
    return bool((pod.get("spec") or {}).get("nodeName")) and (pod.get("status") or {}).get("phase") not in _TERMINAL


def tolerates(toleration: Obj, taint: Obj) -> bool:
    """``Toleration.ToleratesTaint`` from k8s.io/api/core/v1."""
    effect = toleration.get("effect") or ""
    if effect and effect != taint.get("effect"):
        return False
    key = toleration.get("key") or ""
    if key and key != taint.get("key"):
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return True
    return operator == "Equal" and (toleration.get("value") or "") == (taint.get("value") or "")


def taints(node: Obj) -> list[Obj]:
    """The node's taints, plus the one the node lifecycle controller adds to a node that is not Ready."""
    result = list((node.get("spec") or {}).get("taints") or [])
    for condition in (node.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready" and condition.get("status") != "True":
            key = "node.kubernetes.io/not-ready" if condition.get("status") == "False" else \
                "node.kubernetes.io/unreachable"
            if not any(t.get("key") == key and t.get("effect") == "NoSchedule" for t in result):
                result.append({"key": key, "effect": "NoSchedule"})
    return result


def _expression_matches(expression: Obj, value: str | None) -> bool:
    operator = expression.get("operator")
    values = [str(v) for v in expression.get("values") or []]
    if operator == "In":
        return value is not None and value in values
    if operator == "NotIn":
        return value is None or value not in values
    if operator == "Exists":
        return value is not None
    if operator == "DoesNotExist":
        return value is None
    if operator in ("Gt", "Lt") and value is not None and len(values) == 1:
        try:
            have, bound = int(value), int(values[0])
        except ValueError:
            return False
        return have > bound if operator == "Gt" else have < bound
    return False


def _term_matches(term: Obj, labels: Mapping[str, str], name: str) -> bool:
    expressions = term.get("matchExpressions") or []
    fields = term.get("matchFields") or []
    if not expressions and not fields:
        return False  # an empty term matches no node
    return all(_expression_matches(e, labels.get(str(e.get("key")))) for e in expressions) and all(
        e.get("key") == "metadata.name" and _expression_matches(e, name) for e in fields)


def matches_node(pod: Obj, node: Obj) -> bool:
    """NodeAffinity's filter: ``nodeSelector`` and required node affinity."""
    spec = pod.get("spec") or {}
    meta = node.get("metadata") or {}
    labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
    if any(labels.get(str(k)) != str(v) for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution")
    if required is None:
        return True
    return any(_term_matches(term, labels, str(meta.get("name"))) for term in required.get("nodeSelectorTerms") or [])


@dataclasses.dataclass(frozen=True)
class Rejection:
    """Why one node cannot take the pod."""

    reasons: tuple[str, ...]
    resolvable: bool
    """Whether evicting pods could help (resources), which decides the preemption message."""


def reject(pod: Obj, node: Obj, bound: Sequence[Obj]) -> Rejection | None:
    """Run the filters for ``pod`` on ``node`` (``bound``: the pods already holding it); None: it fits."""
    tolerations = (pod.get("spec") or {}).get("tolerations") or []
    if (node.get("spec") or {}).get("unschedulable") and not any(
            tolerates(t, {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}) for t in tolerations):
        return Rejection((UNSCHEDULABLE,), False)
    for taint in taints(node):
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not any(tolerates(t, taint) for t in tolerations):
            return Rejection((f"node(s) had untolerated taint {{{taint.get('key', '')}: {taint.get('value', '')}}}",),
                             False)
    if not matches_node(pod, node):
        return Rejection((AFFINITY,), False)
    published = (node.get("status") or {}).get("allocatable") or {}
    allocatable = {name: quantity(amount) for name, amount in published.items()}
    reasons = []
    if len(bound) + 1 > allocatable.get("pods", Fraction(0)):
        reasons.append(TOO_MANY_PODS)
    used: dict[str, Fraction] = {}
    for other in bound:
        _add(used, pod_requests(other))
    for name, amount in sorted(pod_requests(pod).items()):
        if amount > 0 and amount > allocatable.get(name, Fraction(0)) - used.get(name, Fraction(0)):
            reasons.append(f"Insufficient {name}")
    return Rejection(tuple(reasons), True) if reasons else None


def _histogram(reasons: Iterable[str]) -> str:
    counts: dict[str, int] = {}
    for reason in reasons:
        counts[reason] = counts.get(reason, 0) + 1
    return ", ".join(sorted(f"{count} {reason}" for reason, count in counts.items()))


def fit_error(pod: Obj, nodes: int, rejections: Iterable[Rejection]) -> str:
    """kube-scheduler's ``FitError`` message, with the default preemption plugin's verdict appended."""
    rejections = list(rejections)
    message = f"0/{nodes} nodes are available: {_histogram(r for x in rejections for r in x.reasons)}."
    if (pod.get("spec") or {}).get("preemptionPolicy") == "Never":
        preemption = "not eligible due to preemptionPolicy=Never."
    else:
        verdicts = (NO_VICTIMS if x.resolvable else NOT_HELPFUL for x in rejections)
        preemption = f"0/{nodes} nodes are available: {_histogram(verdicts)}."
    return f"{message} preemption: {preemption}."


@dataclasses.dataclass(frozen=True)
class Verdict:
    node: str | None
    """Where the pod goes; None: nowhere, see ``message``."""
    message: str = ""


def schedule(pod: Obj, nodes: Sequence[Obj], pods: Iterable[Obj]) -> Verdict:
    """Pick the first node by name that passes every filter (no scoring: the real scheduler would
    spread pods by its scores, this packs them), given the ``pods`` that exist."""
    if not nodes:
        return Verdict(None, NO_NODES)
    bound: dict[str, list[Obj]] = {}
    for other in pods:
        if holds_node(other):
            bound.setdefault(str(other["spec"]["nodeName"]), []).append(other)
    rejections = []
    for node in sorted(nodes, key=lambda n: str(n["metadata"]["name"])):
        name = str(node["metadata"]["name"])
        rejection = reject(pod, node, bound.get(name, []))
        if rejection is None:
            return Verdict(name)
        rejections.append(rejection)
    return Verdict(None, fit_error(pod, len(nodes), rejections))


# ---------------------------------------------------------------- the Deployment and ReplicaSet controllers

_SAFE = "bcdfghjklmnpqrstvwxz2456789"  # k8s.io/apimachinery/pkg/util/rand's alphabet (no vowels)


def template_hash(template: Obj) -> str:
    """A ``pod-template-hash`` as the Deployment controller spells one: FNV-1a (32 bit) of the template,
    its decimal digits mapped onto the apimachinery alphabet (``SafeEncodeString``)."""
    digest = 0x811C9DC5
    for byte in json.dumps(template, sort_keys=True, separators=(",", ":")).encode():
        digest = ((digest ^ byte) * 0x01000193) & 0xFFFFFFFF
    return "".join(_SAFE[ord(c) % len(_SAFE)] for c in str(digest))


def _max_unavailable(spec: Obj, replicas: int) -> int:
    strategy = spec.get("strategy") or {}
    if strategy.get("type", "RollingUpdate") != "RollingUpdate" or replicas == 0:
        return 0
    value = (strategy.get("rollingUpdate") or {}).get("maxUnavailable", "25%")
    if isinstance(value, str) and value.endswith("%"):
        return min(replicas, replicas * int(value[:-1]) // 100)  # rounded down, as the controller does
    return min(replicas, int(value))


def _condition(old: Sequence[Obj], type_: str, status: str, reason: str, message: str, now: str) -> Obj:
    """A Deployment condition; its times move only when its status (transition) or content (update) does."""
    previous: Obj = next((c for c in old if c.get("type") == type_), {})
    same = previous.get("status") == status
    unchanged = same and (previous.get("reason"), previous.get("message")) == (reason, message)
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastUpdateTime": previous.get("lastUpdateTime") if unchanged else now,
            "lastTransitionTime": previous.get("lastTransitionTime") if same else now}


def ready(pod: Obj) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def deployment_status(deployment: Obj, pods: Sequence[Obj], now: str) -> dict[str, Any]:
    """The status the Deployment controller reports for ``deployment`` whose live pods are ``pods``
    (minReadySeconds and the progress deadline are not modelled: a ready pod is available at once)."""
    spec = deployment.get("spec") or {}
    wanted = int(spec.get("replicas", 1))
    current = template_hash(spec.get("template") or {})
    name = f"{deployment['metadata']['name']}-{current}"
    replicas = len(pods)
    updated = sum(1 for p in pods if (p["metadata"].get("labels") or {}).get(TEMPLATE_HASH_LABEL) == current)
    available = sum(1 for p in pods if ready(p))
    old = (deployment.get("status") or {}).get("conditions") or []
    if available >= wanted - _max_unavailable(spec, wanted):
        available_condition = _condition(old, "Available", "True", "MinimumReplicasAvailable",
                                         "Deployment has minimum availability.", now)
    else:
        available_condition = _condition(old, "Available", "False", "MinimumReplicasUnavailable",
                                         "Deployment does not have minimum availability.", now)
    if updated == wanted and replicas == wanted and available == wanted:
        progressing = _condition(old, "Progressing", "True", "NewReplicaSetAvailable",
                                 f'ReplicaSet "{name}" has successfully progressed.', now)
    else:
        progressing = _condition(old, "Progressing", "True", "ReplicaSetUpdated",
                                 f'ReplicaSet "{name}" is progressing.', now)
    status: dict[str, Any] = {
        "observedGeneration": deployment["metadata"].get("generation", 1),
        "replicas": replicas, "updatedReplicas": updated, "readyReplicas": available,
        "availableReplicas": available, "conditions": [available_condition, progressing],
    }
    if replicas - available > 0:
        status["unavailableReplicas"] = replicas - available
    for field in ("readyReplicas", "availableReplicas", "updatedReplicas", "replicas"):
        if not status[field]:
            del status[field]  # the API omits zero counts (omitempty)
    return status
