"""The real operator with a ModelPool, Deployment controller on demand: a member is Ready only once the
pool's pods serve it, and stays Ready while the pool rolls for another member; what troubles the pool
(pods the scheduler cannot place) shows on its members."""

from __future__ import annotations

from typing import Any

DEPLOY = "apps/v1/deployments"
POOL: dict[str, Any] = {
    "apiVersion": "sluice.dev/v1alpha1", "kind": "ModelPool", "metadata": {"name": "small", "namespace": "models"},
    "spec": {"gpu": {"migProfile": "3g.40gb"}, "scaling": {"minReplicas": 2, "maxReplicas": 2}},
}


def member(client, name: str, memory: str = "8Gi") -> dict[str, Any]:
    body = client.model(name, pool="small", resources={"gpu": {"memory": memory, "computePercent": 20}},
                        scaling={"minReplicas": 1, "maxReplicas": 1})
    body["spec"]["model"] = {"storageUri": f"s3://models/{name}", "format": "onnx"}
    return body


def ready(client, name: str) -> dict[str, Any]:
    return client.condition(client.read(client.IM, name), "Ready") or {}


async def test_a_member_is_ready_once_the_pool_pods_serve_it_and_stays_ready_while_another_joins(
        client, operator, apiserver):
    await client.create(client.POOL, POOL)
    await client.create(client.IM, member(client, "a"))
    await client.wait(lambda: ready(client, "a").get("reason") == "LoadingInPool")
    model = client.read(client.IM, "a")
    assert model["status"]["pool"] == {"name": "small", "state": "Admitted", "reason": ""}
    assert client.condition(model, "Progressing")["status"] == "True"

    await apiserver.complete_rollout("models", "small")
    await client.wait(lambda: ready(client, "a").get("reason") == "ServedByPool")
    model = client.read(client.IM, "a")
    assert model["status"]["readyReplicas"] == 2
    # The selector the scale subresource publishes is the member's Service's: the pool pods that serve it.
    pod_labels = client.read(DEPLOY, "small")["spec"]["template"]["metadata"]["labels"]
    assert all(pod_labels.get(k) == v for k, v in (t.split("=") for t in model["status"]["selector"].split(",")))
    pool = client.read(client.POOL, "small")
    assert pool["status"]["capacity"]["summary"] == "30 GiB of 38 GiB"
    assert pool["status"]["capacity"]["computePercentUsed"] == 20

    # b joins: the pool rolls; a keeps being served by the pods that had it, b waits for the new ones.
    await client.create(client.IM, member(client, "b"))
    await client.wait(lambda: ready(client, "b").get("reason") == "LoadingInPool")
    deployment = client.read(DEPLOY, "small")
    assert deployment["spec"]["template"]["metadata"]["labels"]["member.sluice.dev/b"] == "true"
    assert deployment["metadata"]["generation"] != deployment["status"].get("observedGeneration")
    await client.settle()
    assert ready(client, "a")["status"] == "True"
    await apiserver.complete_rollout("models", "small")
    await client.wait(lambda: ready(client, "b").get("reason") == "ServedByPool")


async def test_pool_pods_the_scheduler_cannot_place_degrade_the_pool_and_its_members(client, operator, apiserver):
    await client.create(client.POOL, POOL)
    await client.create(client.IM, member(client, "a"))
    deployment = await client.wait(lambda: client.read(DEPLOY, "small"))
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    await client.post("/api/v1/namespaces/models/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "small-5f6d-abcde", "namespace": "models",
                                                        "labels": labels},
        "spec": {"containers": [{"name": "runtime", "image": "sluice-runtime:test-cuda"}]}})
    message = "0/3 nodes are available: 3 Insufficient nvidia.com/mig-3g.40gb."
    await apiserver.write_status("v1/pods", "models", "small-5f6d-abcde", {
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}]})
    await apiserver.write_status(DEPLOY, "models", "small", {
        "observedGeneration": deployment["metadata"]["generation"], "replicas": 2, "unavailableReplicas": 2})
    degraded = await client.wait(lambda: (c := client.condition(client.read(client.IM, "a"), "Degraded"))
                                 and c["reason"] == "Unschedulable" and c)
    assert degraded["message"].startswith("Pool small: 1 runtime pod(s) cannot be scheduled: not enough "
                                          "nvidia.com/mig-3g.40gb on any node")
    assert client.condition(client.read(client.POOL, "small"), "Degraded")["reason"] == "Unschedulable"


def _pool(gpu: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "sluice.dev/v1alpha1", "kind": "ModelPool", "metadata": {"name": "p", "namespace": "models"},
            "spec": {"gpu": gpu, "scaling": {"minReplicas": 1, "maxReplicas": 1}}}


def _member(client, name: str, gpu: dict[str, Any]) -> dict[str, Any]:
    body = client.model(name, pool="p", resources={"gpu": gpu})
    body["spec"].pop("scaling")
    body["spec"]["model"] = {"storageUri": f"s3://models/{name}", "format": "onnx"}
    return body


async def test_a_pool_of_unknown_capacity_writes_its_status_once(client, operator, apiserver):
    """With no GPU inventory the pool's memory is unknown: its status used to carry nulls, which a merge
    patch deletes, so it never equalled what was stored, was written on every reconcile, and each write
    reconciled every member again."""
    await client.create(client.POOL, _pool({"count": 1}))
    for name in "abc":
        await client.create(client.IM, _member(client, name, {"memory": "4Gi", "computePercent": 10}))
    # the operator may take a while to start (seen in a full run): settle() on an idle store returns early
    await client.wait(lambda: [m["name"] for m in client.read(client.POOL, "p")["status"]["members"]] == list("abc"))
    await client.wait(lambda: all(client.read(client.IM, n).get("status", {}).get("pool", {}).get("state")
                                  == "Admitted" for n in "abc"))
    writes = operator.metrics.status_writes.labels("ModelPool")
    members = operator.metrics.reconciles.labels("InferenceModel", "ok")

    async def counts() -> tuple[float, float]:
        # a reconcile that writes nothing does not change the store, so settle() alone can return while
        # one is still running (seen on a loaded machine): wait until the counters hold still too
        while True:
            seen = (writes._value.get(), members._value.get())
            await client.settle()
            if (writes._value.get(), members._value.get()) == seen:
                return seen

    before = await counts()
    for touch in range(3):  # reconciles of the pool that change nothing
        await client.patch(client.POOL, "p", {"metadata": {"annotations": {"example.com/touch": str(touch)}}})
        await client.settle()
    assert await counts() == before
    assert "freeMiB" not in client.read(client.POOL, "p")["status"]["capacity"]


async def test_members_of_a_pool_that_cannot_reconcile_say_so(client, operator, apiserver):
    """A pool whose spec the cluster cannot satisfy admits no one: its members show its Degraded
    instead of "joining" for ever."""
    from sluice_testing import gpu_nodes

    await gpu_nodes.load(apiserver, [gpu_nodes.l4("l4-0")])
    await client.create(client.POOL, _pool({"migProfile": "3g.40gb"}))
    await client.create(client.IM, _member(client, "a", {"memory": "8Gi"}))
    degraded = await client.wait(
        lambda: (c := client.condition(client.read(client.IM, "a"), "Degraded")) and c["status"] == "True" and c)
    assert degraded["message"].startswith("Pool p: ") and "3g.40gb" in degraded["message"]
    assert client.condition(client.read(client.IM, "a"), "Ready")["reason"] == "JoiningPool"


async def test_a_pools_gpus_out_of_sight_for_a_while_evict_no_one(client, operator, apiserver, clock):
    """A gpu.count pool learns its GPUs' memory from the nodes. While they are gone (spot preemption), the
    memory last seen holds: otherwise everyone was admitted on compute alone meanwhile and, once the GPUs
    were back, the oldest kept its place, evicting a member that never grew for one that had."""
    from sluice_testing import gpu_nodes

    def admitted() -> tuple[list[str], list[str]]:
        status = (client.read(client.POOL, "p") or {}).get("status") or {}
        return [m["name"] for m in status.get("members") or []], [w["name"] for w in status.get("waiting") or []]

    async def touch(value: int) -> None:
        await client.patch(client.POOL, "p", {"metadata": {"annotations": {"example.com/touch": str(value)}}})
        await client.settle()

    await gpu_nodes.load(apiserver, [gpu_nodes.l4("l4-0")])  # one L4: 22.5 GiB
    await client.create(client.POOL, _pool({"count": 1}))
    await client.create(client.IM, _member(client, "a", {"memory": "15Gi"}))
    await client.wait(lambda: admitted()[0] == ["a"])
    await client.settle()
    clock.advance(1)
    await client.create(client.IM, _member(client, "b", {"memory": "5Gi"}))
    await client.wait(lambda: admitted()[0] == ["a", "b"])
    await client.settle()
    await client.patch(client.IM, "a", {"spec": {"resources": {"gpu": {"memory": "20Gi"}}}})  # grows: waits
    await client.wait(lambda: admitted() == (["b"], ["a"]))
    await client.settle()
    async with apiserver.request("DELETE", "/api/v1/nodes/l4-0") as response:
        assert response.status < 300
    clock.advance(60)
    await touch(1)
    assert admitted() == (["b"], ["a"])  # the memory last seen still counts
    await gpu_nodes.load(apiserver, [gpu_nodes.l4("l4-0")])
    clock.advance(60)
    await touch(2)
    assert admitted() == (["b"], ["a"])


async def test_a_member_whose_spec_turns_invalid_is_told_it_is_dropped_and_comes_back_when_fixed(
        client, operator, apiserver):
    """The pool renders members from their specs, so one it cannot read is dropped from its pods. Its
    status used to keep ``pool.state: Admitted`` (the last good spec's) while the pool no longer named it
    at all: now the pool lists it as waiting with the problem, and the member says Waiting, not Ready."""
    await client.create(client.POOL, POOL)
    for name in "ab":
        await client.create(client.IM, member(client, name))
    await client.wait(lambda: client.read(client.IM, "b").get("status", {}).get("pool", {}).get("state") == "Admitted")
    await apiserver.complete_rollout("models", "small")
    await client.wait(lambda: ready(client, "b").get("reason") == "ServedByPool")

    # The CRD's schema takes replica bounds (standalone models have them); the operator refuses them on a member.
    await client.patch(client.IM, "b", {"spec": {"scaling": {"minReplicas": 1, "maxReplicas": 3}}})
    model = await client.wait(lambda: (m := client.read(client.IM, "b"))["status"]["pool"]["state"] == "Waiting" and m)
    assert model["status"]["pool"]["name"] == "small"
    assert model["status"]["pool"]["reason"].startswith("its spec is invalid (spec.scaling: a member of pool 'small' "
                                                        "is scaled with the pool")
    condition = client.condition(model, "Ready")
    assert (condition["status"], condition["reason"], condition["message"]) == (
        "False", "InvalidSpec", "Not served by pool small: it serves no spec it cannot read.")
    assert client.condition(model, "Degraded")["reason"] == "InvalidSpec"
    pool = client.read(client.POOL, "small")
    assert [m["name"] for m in pool["status"]["members"]] == ["a"]
    assert [(w["name"], w["cause"]) for w in pool["status"]["waiting"]] == [("b", "InvalidSpec")]
    assert pool["status"]["membersSummary"] == "1 admitted, 1 waiting"
    degraded = client.condition(pool, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("False", "MembersWaiting")
    assert degraded["message"].startswith("1 member(s) are not served: b: its spec is invalid (spec.scaling:")
    labels = client.read(DEPLOY, "small")["spec"]["template"]["metadata"]["labels"]
    assert "member.sluice.dev/b" not in labels and labels["member.sluice.dev/a"] == "true"
    await client.settle()
    assert ready(client, "a")["status"] == "True"  # the other member is untouched

    # Fixed: admitted again (it fits), and Ready once the pool's new pods serve it.
    await client.patch(client.IM, "b", {"spec": {"scaling": None}})
    await client.wait(lambda: client.read(client.IM, "b")["status"]["pool"] == {
        "name": "small", "state": "Admitted", "reason": ""})
    assert client.read(DEPLOY, "small")["spec"]["template"]["metadata"]["labels"]["member.sluice.dev/b"] == "true"
    assert client.read(client.POOL, "small")["status"]["waiting"] == []
    await apiserver.complete_rollout("models", "small")
    await client.wait(lambda: ready(client, "b").get("reason") == "ServedByPool")


async def test_a_member_whose_invalid_spec_leaves_the_pool_no_longer_names_it(client, operator, apiserver):
    await client.create(client.POOL, POOL)
    await client.create(client.IM, member(client, "a"))
    await client.wait(lambda: client.read(client.IM, "a").get("status", {}).get("pool", {}).get("state") == "Admitted")
    # spec.pool removed and the spec invalid at once: the status names no pool, and the pool drops it.
    await client.patch(client.IM, "a", {"spec": {"pool": None, "resources": {"gpu": {"count": 1, "memory": "8Gi"}}}})
    model = await client.wait(lambda: (m := client.read(client.IM, "a")) and
                              (client.condition(m, "Degraded") or {}).get("reason") == "InvalidSpec" and m)
    assert "pool" not in model["status"]
    await client.wait(lambda: client.read(client.POOL, "small")["status"]["members"] == [])
    assert client.read(client.POOL, "small")["status"]["waiting"] == []
