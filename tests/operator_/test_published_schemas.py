"""``sluice_testing.schemas``: third-party custom resources against their published schemas.

Valid examples of every kind Sluice renders or ships pass; each kind of mistake is reported with where
it is. Skips with a reason where ``.ci/tools.sh`` could not install the schemas (no npm or node).
"""

from __future__ import annotations

import copy

import pytest

from sluice_testing import schemas

META = {"name": "resnet", "namespace": "models"}
VALID = {
    "ScaledObject": {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": META,
        "spec": {"scaleTargetRef": {"name": "resnet"}, "minReplicaCount": 1, "maxReplicaCount": 4,
                 "fallback": {"failureThreshold": 3, "replicas": 4},
                 "triggers": [{"type": "prometheus", "metricType": "AverageValue",
                               "metadata": {"serverAddress": "http://prometheus:9090", "query": "sum(up)",
                                            "threshold": "8"}}]},
    },
    "PodMonitor": {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": META,
        "spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": "sluice-runtime"}},
                 "namespaceSelector": {"any": True}, "podTargetLabels": ["app.kubernetes.io/instance"],
                 "podMetricsEndpoints": [{"port": "metrics", "interval": "15s"}]},
    },
    "ServiceMonitor": {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": META,
        "spec": {"selector": {"matchLabels": {"app": "x"}}, "endpoints": [{"port": "metrics", "interval": "30s"}]},
    },
    "HTTPRoute": {
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": META,
        "spec": {"parentRefs": [{"name": "gateway", "namespace": "infra"}], "rules": [{"backendRefs": [
            {"name": "resnet", "port": 8000, "weight": 90}, {"name": "resnet-canary", "port": 8000, "weight": 10}]}]},
    },
    "GRPCRoute": {
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "GRPCRoute", "metadata": META,
        "spec": {"parentRefs": [{"name": "gateway"}], "rules": [{"backendRefs": [
            {"name": "resnet", "port": 8001, "weight": 90}, {"name": "resnet-canary", "port": 8001, "weight": 10}]}]},
    },
    "VirtualService": {
        "apiVersion": "networking.istio.io/v1", "kind": "VirtualService", "metadata": META,
        "spec": {"hosts": ["resnet"], "http": [{"route": [
            {"destination": {"host": "resnet"}, "weight": 90},
            {"destination": {"host": "resnet-canary"}, "weight": 10}]}]},
    },
}


@pytest.mark.parametrize("kind", sorted(VALID))
def test_valid_objects_pass(kind):
    assert schemas.validate(VALID[kind]) == []


def test_mistakes_are_reported_with_where_they_are():
    route = copy.deepcopy(VALID["HTTPRoute"])
    route["spec"]["rules"][0]["backendRefs"][1]["weight"] = "ten"
    route["spec"]["rules"][0]["backendRefs"][0]["wieght"] = 90  # misspelt: a server would drop it silently
    scaled = copy.deepcopy(VALID["ScaledObject"])
    del scaled["spec"]["fallback"]["replicas"]
    monitor = copy.deepcopy(VALID["PodMonitor"])
    monitor["spec"]["podMetricsEndpoints"][0]["scheme"] = "gopher"
    unknown = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": META}
    route_problems, scaled_problems, monitor_problems, unknown_problems = schemas.validate_all(
        [route, scaled, monitor, unknown])
    assert route_problems == [
        "/spec/rules/0/backendRefs/1/weight: must be integer",
        "/spec/rules/0/backendRefs/0/wieght: unknown field (not in the published schema; the API server would "
        "prune it)",
    ]
    assert scaled_problems == ["/spec/fallback: must have required property replicas"]
    [problem] = monitor_problems
    assert problem.startswith("/spec/podMetricsEndpoints/0/scheme: must be equal to one of the allowed values (")
    assert "https" in problem
    [problem] = unknown_problems
    assert problem.startswith("no published schema for apiVersion example.com/v1 kind Widget")


def test_free_form_fields_are_not_unknown():
    """Maps (labels, KEDA trigger metadata) and preserve-unknown-fields objects take any key."""
    scaled = copy.deepcopy(VALID["ScaledObject"])
    scaled["metadata"] = {**META, "labels": {"any": "label"}, "annotations": {"any/annotation": "x"}}
    scaled["spec"]["triggers"][0]["metadata"]["customHeaders"] = "X-Scope-OrgID=models"
    assert schemas.validate(scaled) == []


def test_skip_reason_names_what_is_missing():
    reason = schemas.skip_reason()
    assert reason is None or "tools.sh" in reason or "node" in reason


def test_without_the_schemas_validate_skips_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(schemas, "SCHEMAS", tmp_path)
    reason = schemas.skip_reason()
    assert reason is not None and ("bash .ci/tools.sh" in reason or "node" in reason)
    with pytest.raises(pytest.skip.Exception, match=r"published CRD schemas|node"):
        schemas.validate(VALID["PodMonitor"])
