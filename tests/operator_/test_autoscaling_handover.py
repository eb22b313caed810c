"""Switching between fixed and autoscaled replicas: the HPA takes ``spec.replicas`` over without a reset.

A real API server resets a field to its default when its only server-side-apply owner stops applying
it; for ``Deployment.spec.replicas`` that is 1 replica, before the HPA has acted. The emulator does
the same (managedFields tracking), so these tests fail if the operator simply drops the field.
"""

from __future__ import annotations

import copy

from sluice.operator import api, builders

DEPLOY = "apps/v1/deployments"
HPA = "autoscaling/v2/horizontalpodautoscalers"


def _live(replicas: int, *managers: tuple[str, str]) -> dict:
    fields = {"fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:replicas": {}}}}
    return {"metadata": {"managedFields": [{"manager": m, "operation": op, **fields} for m, op in managers]},
            "spec": {"replicas": replicas}}


AUTO = api.Scaling(min_replicas=2, max_replicas=8)


def test_fixed_scaling_applies_its_count_whatever_is_live():
    fixed = api.Scaling(min_replicas=3, max_replicas=3)
    assert builders.deployment_replicas(fixed, None) == 3
    assert builders.deployment_replicas(fixed, _live(7, ("kube-controller-manager", "Update"))) == 3


def test_autoscaled_keeps_the_live_count_clamped_while_the_operator_owns_it():
    ours = ("sluice-operator", "Apply")
    assert builders.deployment_replicas(AUTO, _live(3, ours)) == 3
    assert builders.deployment_replicas(AUTO, _live(1, ours)) == 2
    assert builders.deployment_replicas(AUTO, _live(20, ours)) == 8
    # Co-owned (rare: an update only takes fields whose value it changes): re-applying the live value is
    # harmless, and the HPA's next scale makes it the only owner.
    assert builders.deployment_replicas(AUTO, _live(5, ours, ("kube-controller-manager", "Update"))) == 5


def test_autoscaled_leaves_the_count_to_the_hpa_once_it_owns_it_or_on_creation():
    assert builders.deployment_replicas(AUTO, None) is None
    assert builders.deployment_replicas(AUTO, _live(5, ("kube-controller-manager", "Update"))) is None
    assert builders.deployment_replicas(AUTO, _live(5, ("sluice-operator", "Update"))) is None
    assert builders.deployment_replicas(AUTO, {"spec": {"replicas": 5}}) is None


def _replica_owners(deployment: dict) -> set[str]:
    return {entry["manager"] for entry in deployment["metadata"].get("managedFields", [])
            if "f:replicas" in entry["fieldsV1"].get("f:spec", {})}


async def _fixed_model(client, replicas: int) -> None:
    await client.create(client.IM, client.model(scaling={"minReplicas": replicas, "maxReplicas": replicas}))
    await client.wait(lambda: client.read(DEPLOY, "resnet")["spec"]["replicas"] == replicas)
    await client.settle()


async def test_fixed_to_autoscaled_keeps_the_live_count_until_the_hpa_takes_it(client, operator, apiserver):
    await _fixed_model(client, 3)
    await client.patch(client.IM, "resnet", {"spec": {"scaling": {"minReplicas": 2, "maxReplicas": 8}}})
    await client.wait(lambda: client.read(HPA, "resnet"))
    await client.settle()
    deployment = client.read(DEPLOY, "resnet")
    assert deployment["spec"]["replicas"] == 3  # not reset to the default 1
    assert _replica_owners(deployment) == {"sluice-operator"}
    # The HPA scales (an update through /scale): it owns the field now, and the operator lets go.
    await apiserver.scale("models", "resnet", 6)
    await client.settle()
    assert _replica_owners(client.read(DEPLOY, "resnet")) == {"kube-controller-manager"}
    await client.patch(client.IM, "resnet", {"spec": {"scaling": {"targetQueueDepth": 4}}})
    await client.wait(lambda: client.read(HPA, "resnet")["spec"]["metrics"][0]["pods"]["target"]["averageValue"]
                      == "4")
    await client.settle()
    deployment = client.read(DEPLOY, "resnet")
    assert deployment["spec"]["replicas"] == 6
    assert _replica_owners(deployment) == {"kube-controller-manager"}


async def test_fixed_to_autoscaled_clamps_the_live_count_into_the_new_range(client, operator, apiserver):
    await _fixed_model(client, 3)
    await client.patch(client.IM, "resnet", {"spec": {"scaling": {"minReplicas": 1, "maxReplicas": 2}}})
    await client.wait(lambda: client.read(HPA, "resnet"))
    await client.settle()
    assert client.read(DEPLOY, "resnet")["spec"]["replicas"] == 2


async def test_autoscaled_to_fixed_sets_the_fixed_count(client, operator, apiserver):
    await client.create(client.IM, client.model(scaling={"minReplicas": 2, "maxReplicas": 8}))
    await client.wait(lambda: client.read(HPA, "resnet"))
    await client.settle()
    await apiserver.scale("models", "resnet", 6)
    await client.settle()
    await client.patch(client.IM, "resnet", {"spec": {"scaling": {"minReplicas": 3, "maxReplicas": 3}}})
    await client.wait(lambda: client.read(HPA, "resnet") is None)
    await client.settle()
    deployment = client.read(DEPLOY, "resnet")
    assert deployment["spec"]["replicas"] == 3
    assert _replica_owners(deployment) == {"sluice-operator"}


async def _apply(apiserver, body: dict, manager: str = "sluice-operator") -> dict:
    url = f"/apis/apps/v1/namespaces/models/deployments/{body['metadata']['name']}"
    async with apiserver.request("PATCH", url, params={"fieldManager": manager, "force": "true"},
                                 json=body, headers={"Content-Type": "application/apply-patch+yaml"}) as resp:
        assert resp.status in (200, 201), await resp.text()
        return await resp.json()


async def test_the_emulator_resets_a_field_dropped_by_its_only_manager(apiserver):
    body = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "namespace": "models"},
            "spec": {"replicas": 3, "selector": {"matchLabels": {"a": "b"}}}}
    await _apply(apiserver, body)
    dropped = copy.deepcopy(body)
    del dropped["spec"]["replicas"]
    assert (await _apply(apiserver, dropped))["spec"]["replicas"] == 1  # removed, then defaulted
    # Once another manager (the HPA's scale) owns it, dropping it from the apply keeps the value.
    await _apply(apiserver, body)
    await apiserver.scale("models", "d", 5)
    kept = await _apply(apiserver, dropped)
    assert kept["spec"]["replicas"] == 5
    assert _replica_owners(kept) == {"kube-controller-manager"}


async def test_keda_without_a_prometheus_url_is_degraded_and_says_how_to_set_it(client, operator):
    await client.create(client.IM, client.model(scaling={"minReplicas": 2, "maxReplicas": 8, "engine": "keda"}))
    degraded = await client.wait(lambda: (c := client.condition(client.read(client.IM, "resnet"), "Degraded"))
                                 and c["status"] == "True" and c)
    assert degraded["reason"] == "Unsatisfiable"
    assert "SLUICE_PROMETHEUS_URL" in degraded["message"] and "engine hpa" in degraded["message"]
    assert client.read(HPA, "resnet") is None
