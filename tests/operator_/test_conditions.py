"""Condition merging: lastTransitionTime moves only when status flips."""

from __future__ import annotations

import datetime

import pytest

from sluice.operator import conditions
from sluice.operator.conditions import Condition

T0 = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)
T1 = T0 + datetime.timedelta(minutes=5)


def test_transition_time_only_moves_on_a_flip():
    first = conditions.merge(None, [Condition("Ready", "False", "NoReplicasAvailable", "0 of 1")],
                             generation=1, now=T0)
    same = conditions.merge(first, [Condition("Ready", "False", "NoReplicasAvailable", "still 0")],
                            generation=2, now=T1)
    assert same[0]["lastTransitionTime"] == "2025-01-01T00:00:00Z"
    assert same[0]["message"] == "still 0"
    assert same[0]["observedGeneration"] == 2
    flipped = conditions.merge(same, [Condition("Ready", "True", "Available", "1 of 1")], generation=2, now=T1)
    assert flipped[0]["lastTransitionTime"] == "2025-01-01T00:05:00Z"


def test_order_is_stable_and_foreign_conditions_are_kept():
    existing = [{"type": "Custom", "status": "True"}]
    merged = conditions.merge(existing, [Condition("Degraded", "False", "AsExpected", "ok"),
                                         Condition("Ready", "True", "Available", "ok")], generation=None, now=T0)
    assert [c["type"] for c in merged] == ["Ready", "Degraded", "Custom"]
    assert "observedGeneration" not in merged[0]


def _pod(phase: str, reason: str | None = None, message: str = "") -> dict:
    conditions_ = [] if reason is None else [
        {"type": "PodScheduled", "status": "False", "reason": reason, "message": message}
    ]
    return {"metadata": {"name": "p"}, "status": {"phase": phase, "conditions": conditions_}}


@pytest.mark.parametrize(
    ("pods", "expected"),
    [
        ([], None),
        ([_pod("Running")], None),
        ([_pod("Pending")], None),  # not looked at by the scheduler yet
        ([_pod("Pending", "SchedulingGated", "gated")], None),
        ([_pod("Pending", "Unschedulable", "0/2 nodes are available: 2 Insufficient nvidia.com/mig-1g.10gb.")],
         "1 runtime pod(s) cannot be scheduled: not enough nvidia.com/mig-1g.10gb on any node."),
        ([_pod("Pending", "Unschedulable", "0/4 nodes are available: 4 node(s) didn't match Pod's node affinity.")] * 2,
         "2 runtime pod(s) cannot be scheduled: no node fits the pod."),
    ],
)
def test_unschedulable_names_what_is_missing(pods, expected):
    found = conditions.unschedulable(pods)
    if expected is None:
        assert found is None
    else:
        assert found is not None and (found.type, found.status, found.reason) == ("Degraded", "True", "Unschedulable")
        assert found.message.startswith(expected), found.message
