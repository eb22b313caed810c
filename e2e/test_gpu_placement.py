"""GPU placement end to end: the real kopf operator against the emulator, with simulated GPU nodes.

Node objects carry what GPU feature discovery and NVIDIA's device plugin publish (labels, allocatable
extended resources, taints); other teams' pods hold some of the capacity. Each scenario applies
InferenceModels and reads only what a user sees: ``status.placement``, the ``GpuPlaced`` and
``Degraded`` conditions, and the Deployments' pod templates. Emulator only: a real cluster's nodes are
not ours to invent.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import kmock
import kopf

from sluice.operator.crd import all_crds
from sluice.operator.settings import Settings
from sluice_testing import ApiServer, Cluster, FakeClock, OperatorHarness

NAMESPACE = "e2e"
TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def _node(name: str, labels: dict[str, str], allocatable: dict[str, str], taints: Any = ()) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels},
            "spec": {"taints": list(taints)},
            "status": {"allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110", **allocatable},
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def a100_mixed(name: str, gpus: int = 1) -> dict[str, Any]:
    """A100-80GB, mixed strategy, MIG manager's all-balanced: 2x1g.10gb + 2g.20gb + 3g.40gb per GPU."""
    return _node(name, {
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.count": str(gpus),
        "nvidia.com/gpu.memory": "81920", "nvidia.com/mig.capable": "true", "nvidia.com/mig.strategy": "mixed",
        "nvidia.com/mig.config": "all-balanced", "nvidia.com/mig.config.state": "success",
        "nvidia.com/mig-1g.10gb.count": str(2 * gpus), "nvidia.com/mig-1g.10gb.memory": "9728",
        "cloud.google.com/gke-nodepool": "a100",
    }, {"nvidia.com/mig-1g.10gb": str(2 * gpus), "nvidia.com/mig-2g.20gb": str(gpus),
        "nvidia.com/mig-3g.40gb": str(gpus)}, [TAINT])


def l4(name: str) -> dict[str, Any]:
    return _node(name, {"nvidia.com/gpu.product": "NVIDIA-L4", "nvidia.com/gpu.count": "1",
                        "nvidia.com/gpu.memory": "23034", "eks.amazonaws.com/nodegroup": "l4"},
                 {"nvidia.com/gpu": "1"})


def foreign_pod(name: str, node: str, resource: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "team-b"},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x",
                                                       "resources": {"limits": {resource: "1"}}}]},
            "status": {"phase": "Running"}}


def model(name: str, gpu: dict[str, Any], replicas: int = 1) -> dict[str, Any]:
    return {"apiVersion": "sluice.dev/v1alpha1", "kind": "InferenceModel", "metadata": {"name": name},
            "spec": {"model": {"storageUri": f"s3://models/{name}", "format": "onnx"},
                     "resources": {"gpu": gpu}, "scaling": {"minReplicas": replicas, "maxReplicas": replicas}}}


@dataclasses.dataclass
class Env:
    server: ApiServer
    cluster: Cluster
    clock: FakeClock

    async def add(self, *objects: dict[str, Any]) -> None:
        for obj in objects:
            if obj["kind"] == "Node":
                status, body = await self.cluster.call("POST", "/api/v1/nodes", obj)
                assert status < 300, body
                await self.server.write_status("v1/nodes", None, obj["metadata"]["name"], obj["status"])
            elif obj["kind"] == "Pod":
                ns = obj["metadata"]["namespace"]
                status, body = await self.cluster.call("POST", f"/api/v1/namespaces/{ns}/pods", obj)
                assert status < 300, body
                await self.server.write_status("v1/pods", ns, obj["metadata"]["name"], obj["status"])
            else:
                status, body = await self.cluster.create(obj)
                assert status < 300, body

    async def placement(self, name: str, **expected: Any) -> dict[str, Any]:
        async def check() -> dict[str, Any] | None:
            found = ((await self.cluster.get("InferenceModel", name) or {}).get("status") or {}).get("placement")
            return found if found and all(found.get(k) == v for k, v in expected.items()) else None
        return await self.cluster.wait(check, f"{name} status.placement with {expected}")

    async def condition(self, name: str, type_: str, **expected: Any) -> dict[str, Any]:
        async def check() -> dict[str, Any] | None:
            found = Cluster.condition(await self.cluster.get("InferenceModel", name), type_)
            return found if found and all(found.get(k) == v for k, v in expected.items()) else None
        return await self.cluster.wait(check, f"{name} condition {type_} with {expected}")

    async def pod_spec(self, name: str) -> dict[str, Any]:
        deployment = await self.cluster.wait(lambda: self.cluster.get("Deployment", name), f"Deployment {name}")
        return dict(deployment["spec"]["template"]["spec"])


@contextlib.asynccontextmanager
async def environment() -> AsyncIterator[Env]:
    async with ApiServer(simulate_rollouts=True) as server, kmock.Server(server):
        for definition in all_crds():
            server.register_crd(copy.deepcopy(definition))
        info = kopf.ConnectionInfo(server=str(server.url).rstrip("/"), insecure=True)
        clock = FakeClock()
        settings = Settings(resync_seconds=0.1, placement_refresh_seconds=30)
        env = Env(server, Cluster(info, NAMESPACE, timeout=15), clock)
        try:
            async with OperatorHarness(settings=settings, connection=info, clock=clock):
                yield env
        finally:
            await env.cluster.session.close()


def gpu_limits(pod: dict[str, Any]) -> dict[str, str]:
    limits = pod["containers"][0]["resources"]["limits"]
    return {k: v for k, v in limits.items() if k.startswith("nvidia.com/")}


async def test_memory_need_takes_the_smallest_free_slice_and_keeps_it() -> None:
    async with environment() as env:
        await env.add(a100_mixed("a100-a"), l4("l4-a"))
        await env.add(model("small", {"memory": "8Gi"}, replicas=2))
        placed = await env.placement("small", state="Placed")
        assert placed["device"] == "MIG 1g.10gb (mixed strategy)"
        assert placed["resource"] == "nvidia.com/mig-1g.10gb" and placed["nodePools"] == ["a100"]
        assert placed["need"] == "memory=8192Mi,compute=0%,shared=false"
        assert (await env.condition("small", "GpuPlaced", status="True"))["reason"] == "Placed"
        pod = await env.pod_spec("small")
        assert gpu_limits(pod) == {"nvidia.com/mig-1g.10gb": "1"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]

        # Both 1g.10gb slices are booked: the next 8Gi model takes the next size up, and the first stays.
        await env.add(model("next", {"memory": "8Gi"}))
        nxt = await env.placement("next", state="Placed")
        assert nxt["device"] == "MIG 2g.20gb (mixed strategy)"
        assert "MIG 1g.10gb (mixed strategy) would fit but has no free capacity" in nxt["reason"]
        env.clock.advance(31)  # a fresh inventory read: still where it was
        assert (await env.placement("small"))["device"] == "MIG 1g.10gb (mixed strategy)"

        # Whole GPUs are exclusive ones only: the L4, never a slice of the MIG node.
        await env.add(model("big", {"count": 1}))
        assert (await env.placement("big", state="Placed"))["products"] == ["NVIDIA-L4"]
        pod = await env.pod_spec("big")
        assert gpu_limits(pod) == {"nvidia.com/gpu": "1"}
        assert pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-L4"]}]}]}


async def test_full_then_freed_and_never_satisfiable_are_told_apart() -> None:
    async with environment() as env:
        await env.add(a100_mixed("a100-a"), foreign_pod("holder", "a100-a", "nvidia.com/mig-3g.40gb"))
        await env.add(model("wide", {"migProfile": "3g.40gb"}))
        waiting = await env.condition("wide", "GpuPlaced", status="False")
        assert waiting["reason"] == "CapacityFull"
        assert "needs 1 x MIG 3g.40gb; the cluster has MIG 3g.40gb (mixed strategy): 0 free of 1" in waiting["message"]
        degraded = await env.condition("wide", "Degraded", status="True")
        assert degraded["reason"] == "CapacityFull"
        # It is rendered anyway: it runs as soon as the slice frees up.
        assert gpu_limits(await env.pod_spec("wide")) == {"nvidia.com/mig-3g.40gb": "1"}

        # A profile the A100-80GB offers but no node is partitioned into: never, unless repartitioned.
        await env.add(model("huge", {"migProfile": "7g.80gb"}))
        never = await env.condition("huge", "GpuPlaced", status="False")
        assert never["reason"] == "NoMatchingCapacity"
        assert "no node offers MIG 7g.80gb" in never["message"]

        # The other team's pod goes: the next inventory read finds the slice free.
        status, _ = await env.cluster.call("DELETE", "/api/v1/namespaces/team-b/pods/holder")
        assert status < 300
        env.clock.advance(31)
        assert (await env.condition("wide", "GpuPlaced", status="True"))["reason"] == "Placed"
        await env.condition("wide", "Degraded", status="False")


async def test_a_profile_no_gpu_of_the_cluster_has_is_an_invalid_spec() -> None:
    async with environment() as env:
        await env.add(a100_mixed("a100-a"))
        await env.add(model("old", {"migProfile": "1g.5gb"}))  # an A100-40GB profile; this cluster has 80GB
        degraded = await env.condition("old", "Degraded", status="True", reason="InvalidSpec")
        assert "'1g.5gb' is not a MIG profile of any GPU in this cluster; its GPUs offer A100-80GB: 1g.10gb, " \
               "1g.10gb+me, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb" in degraded["message"]
        assert await env.cluster.get("Deployment", "old") is None


async def test_replan_annotation_moves_a_model_to_what_fits_best_now() -> None:
    async with environment() as env:
        await env.add(a100_mixed("a100-a"), foreign_pod("h1", "a100-a", "nvidia.com/mig-1g.10gb"),
                      foreign_pod("h2", "a100-a", "nvidia.com/mig-1g.10gb"))
        await env.add(model("m", {"memory": "8Gi"}))
        assert (await env.placement("m", state="Placed"))["device"] == "MIG 2g.20gb (mixed strategy)"
        for name in ("h1", "h2"):
            status, _ = await env.cluster.call("DELETE", f"/api/v1/namespaces/team-b/pods/{name}")
            assert status < 300
        env.clock.advance(31)
        await env.cluster.call("PATCH", "/apis/sluice.dev/v1alpha1/namespaces/e2e/inferencemodels/m",
                               {"metadata": {"labels": {"touched": "yes"}}}, "application/merge-patch+json")
        # A smaller slice is free now, but a running model is not moved unless asked ...
        assert (await env.placement("m"))["device"] == "MIG 2g.20gb (mixed strategy)"
        await env.cluster.call("PATCH", "/apis/sluice.dev/v1alpha1/namespaces/e2e/inferencemodels/m",
                               {"metadata": {"annotations": {"sluice.dev/replan": "1"}}},
                               "application/merge-patch+json")
        moved = await env.placement("m", device="MIG 1g.10gb (mixed strategy)")
        assert moved["replanToken"] == "1"
        assert gpu_limits(await env.pod_spec("m")) == {"nvidia.com/mig-1g.10gb": "1"}
