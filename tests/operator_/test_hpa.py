"""The HPA arithmetic (``sluice.operator.hpa``) against the examples of Kubernetes' documentation
("Horizontal Pod Autoscaling": algorithm details, default behaviour, scaling policies)."""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys

import pytest

from sluice.operator import api, builders, hpa


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


def test_behaviour_from_kubernetes_fills_in_kubernetes_defaults():
    assert hpa.Behavior.from_kubernetes(None) == hpa.Behavior()
    assert hpa.Behavior.from_kubernetes({"scaleDown": {"stabilizationWindowSeconds": 60}}) == hpa.Behavior(
        scale_down=hpa.Rules(60.0, hpa.DEFAULT_SCALE_DOWN.policies))
    parsed = hpa.Behavior.from_kubernetes({"scaleUp": {
        "stabilizationWindowSeconds": 30, "selectPolicy": "Min",
        "policies": [{"type": "Pods", "value": 2, "periodSeconds": 60}]}})
    assert parsed.scale_up == hpa.Rules(30.0, (hpa.Policy("Pods", 2, 60.0),), "Min")
    assert parsed.scale_down == hpa.DEFAULT_SCALE_DOWN


def test_the_rendered_behaviour_scales_down_ten_percent_or_a_pod_a_minute_after_its_window():
    behavior = hpa.Behavior.from_kubernetes(builders.scaling_behavior(api.Scaling(min_replicas=1, max_replicas=50)))
    history = hpa.History()
    replicas = hpa.decide(40, 100, 100, 1, 50, behavior, history, now=0.0)  # steady at 40
    path = []
    for sync in range(1, 33):
        replicas = hpa.decide(replicas, 0, 100, 1, 50, behavior, history, now=sync * 15.0)
        path.append(replicas)
    assert path[:19] == [40] * 19  # the window (300 s) holds the steady recommendation
    assert path[19:] == [36] * 4 + [32] * 4 + [28] * 4 + [25]  # then 10 % (at least a pod) per minute


def _simulation():
    path = pathlib.Path(__file__).resolve().parents[2] / "bench" / "hpa_sim.py"
    spec = importlib.util.spec_from_file_location("hpa_sim", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("hpa_sim", module)  # dataclasses look their module up there
    spec.loader.exec_module(sys.modules["hpa_sim"])
    return sys.modules["hpa_sim"]


@pytest.mark.parametrize("trace", ["surge", "bursts"])
@pytest.mark.parametrize("metric", ["queue", "latency"])
def test_the_simulation_backs_the_rendered_defaults(metric, trace):
    """docs/operator.md quotes bench/hpa_sim.py: the operator's behaviour, simulated as rendered, keeps
    rejections low where Kubernetes' default drops a sixth of the requests."""
    sim = _simulation()
    assert sim.BEHAVIOURS["sluice default"] == hpa.Behavior.from_kubernetes(builders.scaling_behavior(api.Scaling()))
    args = argparse.Namespace(capacity=100.0, startup_s=60.0, lag_s=30.0, latency_s=0.1, metric=metric,
                              target=sim.TARGETS[metric])
    arrivals = sim.trace(trace, sim.SECONDS[trace], 7)
    ours = sim.simulate(arrivals, sim.BEHAVIOURS["sluice default"], args)
    theirs = sim.simulate(arrivals, sim.BEHAVIOURS["kubernetes default"], args)
    assert ours.rejected < 0.02 * sum(arrivals) < 0.15 * sum(arrivals) < theirs.rejected
    assert ours.replica_seconds < theirs.replica_seconds


# -- against pkg/controller/podautoscaler/horizontal.go, beyond the documentation's examples --------


def test_a_policy_period_counts_the_changes_of_both_directions():
    """``periodStartReplicas = current - added + deleted``: right after 4 -> 8, a scale down starts from 4."""
    behavior = hpa.Behavior(scale_down=hpa.Rules(0.0, (hpa.Policy("Percent", 10, 60.0),)))
    history = hpa.History(events=[(0.0, +4)], seen=True)
    assert hpa.decide(8, 1.0, 8, 1, 50, behavior, history, now=30.0) == 3  # floor(4 * 0.9), not floor(8 * 0.9)


def test_a_new_hpa_holds_the_current_count_for_the_scale_down_window():
    """``recordInitialRecommendation``: an HPA created over 10 idle pods does not drop them at once."""
    history = hpa.History()
    assert hpa.decide(10, 0.0, 8, 1, 50, hpa.Behavior(), history, now=0.0) == 10
    assert hpa.decide(10, 0.0, 8, 1, 50, hpa.Behavior(), history, now=299.0) == 10
    assert hpa.decide(10, 0.0, 8, 1, 50, hpa.Behavior(), history, now=301.0) == 1


def test_a_target_scaled_to_zero_by_hand_is_left_alone():
    assert hpa.decide(0, 100.0, 8, 1, 5, hpa.Behavior(), hpa.History(), now=0.0) == 0


def test_a_scale_up_limit_below_the_current_count_holds_it_rather_than_scaling_down():
    behavior = hpa.Behavior(scale_up=hpa.Rules(0.0, (hpa.Policy("Pods", 1, 60.0), hpa.Policy("Percent", 100, 15.0)),
                                               "Min"))
    history = hpa.History(events=[(0.0, +4)], seen=True)  # 1 -> 5 a moment ago
    assert hpa.decide(5, 16.0, 8, 1, 50, behavior, history, now=15.0) == 5  # load 2x: up, but not yet allowed
