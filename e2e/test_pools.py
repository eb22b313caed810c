"""Model pools end to end: several InferenceModels served by one ModelPool's Deployment.

The real operator against the emulator (and a cluster with a GPU node when ``SLUICE_E2E_GPU=1``: a pool
replica needs a GPU to become ready). Assertions read what a user sees: ``kubectl get`` of the pool, the
members and their children.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
from typing import Any

import pytest

POOL: dict[str, Any] = {
    "apiVersion": "sluice.dev/v1alpha1", "kind": "ModelPool", "metadata": {"name": "small"},
    "spec": {"gpu": {"memory": "40Gi"}, "resources": {"cpu": "2", "memory": "8Gi"}},
}


def member(name: str, memory: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "sluice.dev/v1alpha1", "kind": "InferenceModel", "metadata": {"name": name},
        "spec": {"pool": "small", "model": {"storageUri": f"s3://models/{name}", "format": "onnx"},
                 "resources": {"gpu": {"memory": memory}}, **spec},
    }


@pytest.fixture(autouse=True)
async def _needs_gpus_and_settles(cluster):
    if cluster.kind == "cluster" and not os.environ.get("SLUICE_E2E_GPU"):
        pytest.skip("a pool replica needs a GPU with 40Gi: set SLUICE_E2E_GPU=1 on a cluster that has one")
    yield
    if cluster.kind == "emulator":
        # Let the operator finish what the last change set off (members follow their pool): stopping kopf in
        # the middle of it leaves a timer it waits 5 s for.
        await _settled(cluster)


async def _settled(cluster, quiet: float = 0.5) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + cluster.timeout
    last, since = None, loop.time()
    while loop.time() < deadline:
        _, listing = await cluster.call("GET", f"/api/v1/namespaces/{cluster.namespace}/configmaps")
        version = listing.get("metadata", {}).get("resourceVersion")  # the emulator's: moves on any change
        if version != last:
            last, since = version, loop.time()
        elif loop.time() - since >= quiet:
            return
        await asyncio.sleep(0.05)


async def _pool_status(cluster) -> dict[str, Any]:
    return ((await cluster.get("ModelPool", "small")) or {}).get("status") or {}


async def _members(cluster) -> list[str]:
    return [m["name"] for m in (await _pool_status(cluster)).get("members") or []]


async def _condition(cluster, name: str, type_: str) -> dict[str, Any]:
    return cluster.condition(await cluster.get("InferenceModel", name), type_)


async def _ready(cluster, *names: str) -> bool:
    return all([(await _condition(cluster, name, "Ready")).get("status") == "True" for name in names])


async def _configs(cluster) -> set[str]:
    config_map = await cluster.get("ConfigMap", "small-config")
    return set((config_map or {}).get("data") or {})


async def _waiting(cluster, name: str, cause: str = "PoolFull") -> dict[str, Any] | None:
    degraded = await _condition(cluster, name, "Degraded")
    return degraded if degraded.get("status") == "True" and degraded.get("reason") == cause else None


async def test_members_share_one_deployment_a_third_waits_and_is_admitted_when_room_frees(cluster):
    await cluster.apply(POOL)
    await cluster.apply(member("a", "16Gi"))
    await cluster.apply(member("b", "20Gi"))
    await cluster.wait(lambda: _ready(cluster, "a", "b"), "both members Ready")
    assert await _members(cluster) == ["a", "b"]

    # One Deployment serves both: its ConfigMap has both configs; the members render no workload.
    deployment = await cluster.get("Deployment", "small")
    assert deployment["metadata"]["ownerReferences"][0]["kind"] == "ModelPool"
    assert await _configs(cluster) == {"a.config.json", "b.config.json"}
    for name in ("a", "b"):
        assert await cluster.get("Deployment", name) is None
        assert await cluster.get("ConfigMap", f"{name}-config") is None
        # Its own Service (the name clients use) selects the pool's pods that serve it.
        service = await cluster.get("Service", name)
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pod_labels.items()
        assert service["spec"]["selector"]["app.kubernetes.io/instance"] == "small"
        model = await cluster.get("InferenceModel", name)
        assert model["status"]["pool"] == {"name": "small", "state": "Admitted", "reason": ""}
        assert model["status"]["url"] == f"http://{name}.{cluster.namespace}.svc.cluster.local:8000/v2/models/{name}"
    status = await _pool_status(cluster)
    assert status["capacity"]["freeMiB"] == 4 * 1024
    assert status["membersSummary"] == "2 admitted, 0 waiting"

    # A third member does not fit: it waits, saying what is missing; the others are untouched.
    await cluster.apply(member("c", "10Gi"))
    degraded = await cluster.wait(lambda: _waiting(cluster, "c"), "c Degraded PoolFull")
    assert "needs 10 GiB, pool small has 4 GiB free of 40 GiB" in degraded["message"]
    c = await cluster.get("InferenceModel", "c")
    assert c["status"]["pool"] == {"name": "small", "state": "Waiting",
                                   "reason": "needs 10 GiB, pool small has 4 GiB free of 40 GiB"}
    assert (await _condition(cluster, "c", "Ready"))["status"] == "False"
    assert await _configs(cluster) == {"a.config.json", "b.config.json"}
    assert await cluster.get("Deployment", "c") is None
    status = await _pool_status(cluster)
    assert status["membersSummary"] == "2 admitted, 1 waiting"
    assert status["waiting"] == [{"name": "c", "cause": "PoolFull",
                                  "reason": "needs 10 GiB, pool small has 4 GiB free of 40 GiB"}]

    # Deleting a member frees its share: the waiting one is admitted and served.
    await cluster.delete("InferenceModel", "a")

    async def admitted() -> bool:
        return await _members(cluster) == ["b", "c"] and await _ready(cluster, "b", "c")
    await cluster.wait(admitted, "c admitted and Ready once a is gone")
    assert await _configs(cluster) == {"b.config.json", "c.config.json"}
    assert (await _pool_status(cluster))["capacity"]["freeMiB"] == 10 * 1024


async def test_a_member_that_grows_beyond_the_free_memory_waits_and_the_other_stays(cluster):
    await cluster.apply(POOL)
    await cluster.apply(member("a", "16Gi"))
    await cluster.apply(member("b", "20Gi"))
    await cluster.wait(lambda: _ready(cluster, "a", "b"), "both members Ready")

    await cluster.apply(member("b", "30Gi"))
    degraded = await cluster.wait(lambda: _waiting(cluster, "b"), "b Degraded PoolFull after growing")
    assert "needs 30 GiB, pool small has 24 GiB free of 40 GiB" in degraded["message"]
    assert await _members(cluster) == ["a"]
    assert await _ready(cluster, "a")
    assert (await cluster.get("InferenceModel", "a"))["status"]["pool"]["state"] == "Admitted"

    async def rolled() -> bool:
        return await _configs(cluster) == {"a.config.json"}
    await cluster.wait(rolled, "the pool serves a alone")
    deployment = await cluster.get("Deployment", "small")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert "member.sluice.dev/a" in labels and "member.sluice.dev/b" not in labels

    # Shrinking back fits again.
    await cluster.apply(member("b", "20Gi"))
    await cluster.wait(lambda: _ready(cluster, "a", "b"), "b admitted again")


async def test_a_model_joins_and_leaves_a_pool(cluster):
    standalone = member("solo", "8Gi")
    del standalone["spec"]["pool"]
    await cluster.apply(standalone)
    await cluster.wait(lambda: cluster.get("Deployment", "solo"), "solo's own Deployment")

    # Naming a pool that does not exist: Degraded PoolNotFound, and its own pods keep serving meanwhile.
    await cluster.apply(member("solo", "8Gi"))
    degraded = await cluster.wait(lambda: _waiting(cluster, "solo", "PoolNotFound"), "solo PoolNotFound")
    assert "ModelPool 'small' does not exist" in degraded["message"]
    assert await cluster.get("Deployment", "solo") is not None

    # Once the pool exists the model joins it: the pool serves it and its own Deployment goes.
    await cluster.apply(POOL)

    async def joined() -> bool:  # its own objects are deleted one after another: wait for the last
        return await _members(cluster) == ["solo"] and await _ready(cluster, "solo") \
            and await cluster.get("Deployment", "solo") is None \
            and await cluster.get("ConfigMap", "solo-config") is None
    await cluster.wait(joined, "solo served by the pool, its own Deployment and ConfigMap deleted")

    # Leaving (spec.pool removed): its own Deployment again, and the pool drops it.
    await cluster.apply(standalone)

    async def left() -> bool:
        own = await cluster.get("Deployment", "solo")
        model = await cluster.get("InferenceModel", "solo")
        return (own is not None and await _members(cluster) == [] and "pool" not in model["status"]
                and await _ready(cluster, "solo"))
    await cluster.wait(left, "solo on its own Deployment, out of the pool")
    service = await cluster.get("Service", "solo")
    assert service["spec"]["selector"] == {"app.kubernetes.io/instance": "solo", "sluice.dev/inferencemodel": "solo"}
    assert await _configs(cluster) == set()


async def test_an_invalid_member_is_rejected_or_degraded(cluster):
    bad = member("bad", "8Gi")
    bad["spec"]["resources"]["gpu"] = {"count": 1}
    status, body = await cluster.create(bad)
    if status == 422:  # a real API server enforces the CRD's CEL rules at admission
        assert "must declare spec.resources.gpu.memory" in body["message"]
        return
    assert status < 300, body
    await cluster.apply(POOL)

    async def degraded() -> dict[str, Any] | None:
        return await _waiting(cluster, "bad", "InvalidSpec")
    condition = await cluster.wait(degraded, "bad Degraded InvalidSpec")
    assert "spec.resources.gpu.count: cannot be set on a member of pool 'small'" in condition["message"]
    assert "spec.resources.gpu.memory: is required for a member of pool 'small'" in condition["message"]
    # The pool admits no spec it cannot read, and says so: the member waits, named with its problem.
    async def listed() -> dict[str, Any] | None:
        pool = await _pool_status(cluster)
        return pool if (pool or {}).get("membersSummary") == "0 admitted, 1 waiting" else None
    pool = await cluster.wait(listed, "the pool listing bad as waiting")
    assert [(w["name"], w["cause"]) for w in pool["waiting"]] == [("bad", "InvalidSpec")]


async def test_the_pool_config_carries_each_member_s_own_runtime_settings(cluster):
    await cluster.apply(POOL)
    await cluster.apply(member("a", "4Gi", runtime={"maxBatchSize": 8}))
    await cluster.wait(lambda: _ready(cluster, "a"), "a Ready")
    config_map = await cluster.get("ConfigMap", "small-config")
    assert json.loads(config_map["data"]["a.config.json"])["max_batch_size"] == 8
    changed = copy.deepcopy(member("a", "4Gi", runtime={"maxBatchSize": 16}))
    await cluster.apply(changed)

    async def updated() -> bool:
        current = await cluster.get("ConfigMap", "small-config")
        return json.loads(current["data"]["a.config.json"])["max_batch_size"] == 16
    await cluster.wait(updated, "the pool's ConfigMap follows the member's spec")


async def test_deleting_the_pool_leaves_its_members_pool_not_found(cluster):
    await cluster.apply(POOL)
    await cluster.apply(member("a", "4Gi"))
    await cluster.wait(lambda: _ready(cluster, "a"), "a Ready")
    await cluster.delete("ModelPool", "small")
    degraded = await cluster.wait(lambda: _waiting(cluster, "a", "PoolNotFound"), "a PoolNotFound")
    assert "ModelPool 'small' does not exist" in degraded["message"]

    async def gone() -> bool:
        return await cluster.get("Deployment", "small") is None
    await cluster.wait(gone, "the pool's Deployment garbage-collected")
    model = await cluster.get("InferenceModel", "a")
    assert model["status"]["pool"]["state"] == "Waiting"
    assert (await _condition(cluster, "a", "Ready"))["status"] == "False"
