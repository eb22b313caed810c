"""The HPA arithmetic (``sluice.operator.hpa``) against the examples of Kubernetes' documentation
("Horizontal Pod Autoscaling": algorithm details, default behaviour, scaling policies)."""

from __future__ import annotations

import pytest

from sluice.operator import hpa


@pytest.mark.parametrize(
    ("current", "average", "target", "expected"),
    [
        (1, 200, 100, 2),  # "200m against 100m: the number of replicas doubles"
        (4, 50, 100, 2),  # "50m against 100m: halved"
        (10, 105, 100, 10),  # within the 0.1 tolerance: no change
        (10, 111, 100, 12),  # just outside: ceil(11.1)
        (3, 0, 100, 0),  # no load at all: as low as min/max allow (clamped by decide)
    ],
)
def test_the_formula_and_its_tolerance(current, average, target, expected):
    assert hpa.raw_recommendation(current, average, target) == expected


def test_default_scale_up_doubles_or_adds_four_pods_every_fifteen_seconds():
    history = hpa.History()
    replicas, path = 1, []
    for sync in range(4):
        replicas = hpa.decide(replicas, 10_000, 1, 1, 100, hpa.Behavior(), history, now=sync * 15.0)
        path.append(replicas)
    assert path == [5, 10, 20, 40]  # max(100 %, 4 pods) per 15 s period


def test_default_scale_down_waits_for_the_five_minute_window_then_drops_at_once():
    history = hpa.History()
    replicas = hpa.decide(10, 100, 100, 1, 100, hpa.Behavior(), history, now=0.0)  # steady at 10
    path = []
    for sync in range(1, 23):
        replicas = hpa.decide(replicas, 0, 100, 1, 100, hpa.Behavior(), history, now=sync * 15.0)
        path.append(replicas)
    assert path[:19] == [10] * 19  # the 10-replica recommendation at t=0 holds the window (300 s)
    assert path[20:] == [1, 1]  # then 100 % per period: straight to minReplicas


def test_a_scale_down_policy_of_ten_percent_or_five_pods_per_minute_takes_the_larger_change():
    behavior = hpa.Behavior(
        scale_down=hpa.Rules(0.0, (hpa.Policy("Percent", 10, 60.0), hpa.Policy("Pods", 5, 60.0)))
    )
    history = hpa.History()
    assert hpa.decide(80, 0, 100, 1, 100, behavior, history, now=0.0) == 72  # 10 % of 80 = 8 > 5
    history = hpa.History()
    assert hpa.decide(40, 0, 100, 1, 100, behavior, history, now=0.0) == 35  # 5 pods > 10 % of 40
    # within the same minute nothing more may go
    assert hpa.decide(35, 0, 100, 1, 100, behavior, history, now=30.0) == 35


def test_scale_up_stabilization_takes_the_lowest_recommendation_of_its_window():
    behavior = hpa.Behavior(scale_up=hpa.Rules(60.0, hpa.DEFAULT_SCALE_UP.policies))
    history = hpa.History()
    assert hpa.decide(2, 100, 100, 1, 50, behavior, history, now=0.0) == 2
    assert hpa.decide(2, 400, 100, 1, 50, behavior, history, now=15.0) == 2  # the earlier "2" still counts
    assert hpa.decide(2, 400, 100, 1, 50, behavior, history, now=75.0) == 6  # window passed: 2 + 4 pods


def test_min_and_max_bound_everything():
    history = hpa.History()
    assert hpa.decide(3, 10_000, 1, 2, 4, hpa.Behavior(), history, now=0.0) == 4
    assert hpa.decide(3, 0, 1, 2, 4, hpa.Behavior(scale_down=hpa.Rules(0.0, hpa.DEFAULT_SCALE_DOWN.policies)),
                      hpa.History(), now=0.0) == 2  # fmt: skip
