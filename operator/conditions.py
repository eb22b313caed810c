"""``metav1.Condition``-style status conditions, merged so that ``lastTransitionTime`` only moves on a flip.

Pure functions over plain dicts (the wire shape) so the reconciler can compare old and new status
and write only when something changed. The clock is passed in by the caller.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
ORDER = (READY, PROGRESSING, DEGRADED)

TRUE = "True"
FALSE = "False"
UNKNOWN = "Unknown"


@dataclasses.dataclass(frozen=True)
class Condition:
    """One observation: ``reason`` is CamelCase for machines, ``message`` a sentence for humans."""

    type: str
    status: str
    reason: str
    message: str


def format_time(moment: datetime.datetime) -> str:
    """RFC 3339 with second precision, as the API server stores ``metav1.Time``."""
    return moment.astimezone(datetime.UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge(
    existing: Sequence[Mapping[str, Any]] | None,
    new: Iterable[Condition],
    *,
    generation: int | None,
    now: datetime.datetime,
) -> list[dict[str, Any]]:
    """Return the condition list for ``new``; ``lastTransitionTime`` is kept unless ``status`` flipped.

    Conditions of types not in ``new`` are kept as they are (another writer may own them).
    """
    by_type = {str(c.get("type")): dict(c) for c in existing or ()}
    for condition in new:
        old = by_type.get(condition.type)
        flipped = old is None or old.get("status") != condition.status
        by_type[condition.type] = {
            "type": condition.type,
            "status": condition.status,
            "reason": condition.reason,
            "message": condition.message,
            "lastTransitionTime": format_time(now) if flipped or old is None else old.get("lastTransitionTime"),
            **({"observedGeneration": generation} if generation is not None else {}),
        }
    rank = {name: index for index, name in enumerate(ORDER)}
    return sorted(by_type.values(), key=lambda c: (rank.get(c["type"], len(ORDER)), c["type"]))


def find(conditions: Sequence[Mapping[str, Any]] | None, type_: str) -> Mapping[str, Any] | None:
    """The condition of ``type_`` in a wire-shaped list, or ``None``."""
    return next((c for c in conditions or () if c.get("type") == type_), None)


_INSUFFICIENT = re.compile(r"Insufficient ([\w./+-]*\w)")


def unschedulable(pods: Iterable[Mapping[str, Any]]) -> Condition | None:
    """Degraded/Unschedulable when runtime pods wait for the scheduler, naming what is missing
    (from the scheduler's ``PodScheduled`` message: ``0/3 nodes are available: 3 Insufficient
    nvidia.com/gpu``); None when every pod was placed."""
    waiting: list[str] = []
    for pod in pods:
        if (pod.get("status") or {}).get("phase", "Pending") != "Pending":
            continue
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False" \
                    and cond.get("reason") == "Unschedulable":
                waiting.append(str(cond.get("message") or "no reason given"))
    if not waiting:
        return None
    missing = sorted({name for message in waiting for name in _INSUFFICIENT.findall(message)})
    what = f"not enough {', '.join(missing)} on any node" if missing else "no node fits the pod"
    return Condition(
        DEGRADED,
        TRUE,
        "Unschedulable",
        f"{len(waiting)} runtime pod(s) cannot be scheduled: {what}. The scheduler says: "
        f"{waiting[0].rstrip('.')}. Free or add that capacity, or lower spec.resources / spec.scaling.",
    )
