"""Switching a model between the HPA and KEDA through the real operator: one autoscaler at a time, and the
replica count the autoscaler set survives the switch.

KEDA's CRD is registered in the emulator with an open schema (its published schema is checked in
test_builders.py); the operator neither watches it nor needs it unless a model asks for engine keda.
"""

from __future__ import annotations

import dataclasses

import pytest

from sluice.operator.settings import Settings

DEPLOY = "apps/v1/deployments"
HPA = "autoscaling/v2/horizontalpodautoscalers"
SCALED_OBJECT = "keda.sh/v1alpha1/scaledobjects"
PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"
KEDA_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "scaledobjects.keda.sh"},
    "spec": {
        "group": "keda.sh", "scope": "Namespaced",
        "names": {"kind": "ScaledObject", "plural": "scaledobjects", "singular": "scaledobject"},
        "versions": [{"name": "v1alpha1", "served": True, "storage": True, "subresources": {"status": {}},
                      "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}],
    },
}


@pytest.fixture()
def settings(settings: Settings) -> Settings:
    return dataclasses.replace(settings, prometheus_url=PROMETHEUS)


def _replica_owners(deployment: dict) -> set[str]:
    return {entry["manager"] for entry in deployment["metadata"].get("managedFields", [])
            if "f:replicas" in entry["fieldsV1"].get("f:spec", {})}


async def test_hpa_to_keda_and_back_keeps_one_autoscaler_and_the_replica_count(client, operator, apiserver):
    apiserver.register_crd(KEDA_CRD)
    await client.create(client.IM, client.model(scaling={"minReplicas": 2, "maxReplicas": 8}))
    await client.wait(lambda: client.read(HPA, "resnet"))
    await apiserver.scale("models", "resnet", 5)  # the HPA has scaled: it owns spec.replicas
    await client.settle()

    await client.patch(client.IM, "resnet", {"spec": {"scaling": {"engine": "keda", "metric": "inflight"}}})
    scaled = await client.wait(lambda: client.read(SCALED_OBJECT, "resnet"))
    await client.wait(lambda: client.read(HPA, "resnet") is None)
    await client.settle()
    trigger = scaled["spec"]["triggers"][0]
    assert trigger["metadata"]["serverAddress"] == PROMETHEUS
    assert "sluice_inflight_requests" in trigger["metadata"]["query"]
    deployment = client.read(DEPLOY, "resnet")
    assert deployment["spec"]["replicas"] == 5  # untouched: KEDA's HPA takes it from here
    assert _replica_owners(deployment) == {"kube-controller-manager"}
    model = client.read(client.IM, "resnet")
    assert client.condition(model, "Degraded")["status"] == "False"

    await client.patch(client.IM, "resnet", {"spec": {"scaling": {"engine": "hpa"}}})
    await client.wait(lambda: client.read(HPA, "resnet"))
    await client.wait(lambda: client.read(SCALED_OBJECT, "resnet") is None)
    await client.settle()
    assert client.read(DEPLOY, "resnet")["spec"]["replicas"] == 5


async def test_fixed_replicas_remove_the_scaled_object(client, operator, apiserver):
    apiserver.register_crd(KEDA_CRD)
    await client.create(client.IM, client.model(scaling={"minReplicas": 2, "maxReplicas": 8, "engine": "keda"}))
    await client.wait(lambda: client.read(SCALED_OBJECT, "resnet"))
    await client.patch(client.IM, "resnet", {"spec": {"scaling": {"minReplicas": 3, "maxReplicas": 3}}})
    await client.wait(lambda: client.read(SCALED_OBJECT, "resnet") is None)
    await client.wait(lambda: client.read(DEPLOY, "resnet")["spec"]["replicas"] == 3)
    assert client.read(HPA, "resnet") is None


async def test_without_keda_installed_hpa_models_reconcile(client, operator, apiserver):
    """The ScaledObject an HPA model must not have is looked up (404: absent) without KEDA's CRD."""
    await client.create(client.IM, client.model(scaling={"minReplicas": 2, "maxReplicas": 8}))
    await client.wait(lambda: client.read(HPA, "resnet"))
    model = await client.wait(lambda: client.condition(client.read(client.IM, "resnet"), "Degraded"))
    assert model["status"] == "False"
