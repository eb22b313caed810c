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
from sluice_testing import ApiServer, Cluster, FakeClock, OperatorHarness, gpu_nodes

NAMESPACE = "e2e"


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
        """Nodes, pods and DRA objects as their kubelets and drivers publish them; models as a user applies."""
        for obj in objects:
            if obj["kind"] in ("InferenceModel", "ModelPool"):
                status, body = await self.cluster.create(obj)
                assert status < 300, body
            else:
                await gpu_nodes.load(self.server, [obj] if obj["kind"] == "Node" else [],
                                     [obj] if obj["kind"] == "Pod" else [],
                                     [obj] if obj["kind"] not in ("Node", "Pod") else [])

    async def bound(self, name: str, replicas: int = 1) -> list[str]:
        """The nodes the scheduler bound ``name``'s runtime pods to, once all ``replicas`` are."""
        async def check() -> list[str] | None:
            pods = [p for p in self.server.read_all("v1/pods", NAMESPACE)
                    if (p["metadata"].get("labels") or {}).get("app.kubernetes.io/instance") == name]
            nodes = sorted(p["spec"].get("nodeName") or "" for p in pods)
            return nodes if len(nodes) == replicas and all(nodes) else None
        return await self.cluster.wait(check, f"{replicas} pod(s) of {name} bound to nodes")

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
async def environment(*, dra: bool = False) -> AsyncIterator[Env]:
    async with ApiServer(simulate_scheduling=True, serve_dra=dra) as server, kmock.Server(server):
        for definition in all_crds():
            server.register_crd(copy.deepcopy(definition))
        info = kopf.ConnectionInfo(server=str(server.url).rstrip("/"), insecure=True)
        clock = FakeClock()
        settings = Settings(resync_seconds=0.1, placement_refresh_seconds=30,
                            gpu_allocation="dra" if dra else "extended-resources")
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
        await env.add(gpu_nodes.a100_mixed("a100-a"), gpu_nodes.l4("l4-a"))
        await env.add(model("small", {"memory": "8Gi"}, replicas=2))
        placed = await env.placement("small", state="Placed")
        assert placed["device"] == "MIG 1g.10gb (mixed strategy)"
        assert placed["resource"] == "nvidia.com/mig-1g.10gb" and placed["nodePools"] == ["a100-mixed"]
        assert await env.bound("small", 2) == ["a100-a", "a100-a"]
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
        assert await env.bound("next") == ["a100-a"]
        env.clock.advance(31)  # a fresh inventory read: still where it was
        assert (await env.placement("small"))["device"] == "MIG 1g.10gb (mixed strategy)"

        # Whole GPUs are exclusive ones only: the L4, never a slice of the MIG node.
        await env.add(model("big", {"count": 1}))
        assert (await env.placement("big", state="Placed"))["products"] == ["NVIDIA-L4"]
        assert await env.bound("big") == ["l4-a"]
        pod = await env.pod_spec("big")
        assert gpu_limits(pod) == {"nvidia.com/gpu": "1"}
        assert pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-L4"]}]}]}


async def test_full_then_freed_and_never_satisfiable_are_told_apart() -> None:
    async with environment() as env:
        await env.add(gpu_nodes.a100_mixed("a100-a"),
                      gpu_nodes.pod_holding("holder", "a100-a", {"nvidia.com/mig-3g.40gb": 1}, namespace="team-b"))
        await env.add(model("wide", {"migProfile": "3g.40gb"}))
        waiting = await env.condition("wide", "GpuPlaced", status="False")
        assert waiting["reason"] == "CapacityFull"
        assert "needs 1 x MIG 3g.40gb; the cluster has MIG 3g.40gb (mixed strategy): 0 free of 1" in waiting["message"]
        degraded = await env.condition("wide", "Degraded", status="True")
        assert degraded["reason"] == "CapacityFull"
        # It is rendered anyway: it runs as soon as the slice frees up.
        assert gpu_limits(await env.pod_spec("wide")) == {"nvidia.com/mig-3g.40gb": "1"}
        assert Cluster.condition(await env.cluster.get("InferenceModel", "wide"), "Ready")["status"] == "False"

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
        assert await env.bound("wide") == ["a100-a"]
        await env.condition("wide", "Ready", status="True")


async def test_a_pending_model_waits_for_any_fitting_slice_not_the_first_it_was_shown() -> None:
    """Every slice is held by another team: the model (8 GiB: a 1g.10gb would do) is Pending. The device a
    Pending plan names is not the model's own: when a bigger slice frees up first, it is placed there,
    and a later reconcile never reports it "kept" on the slice it never held."""
    async with environment() as env:
        held = {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}
        await env.add(gpu_nodes.a100_mixed("a100-a"), *[
            gpu_nodes.pod_holding(f"{profile[:1]}g-{i}", "a100-a", {f"nvidia.com/mig-{profile}": 1}, namespace="team-b")
            for profile, count in held.items() for i in range(count)])
        await env.add(model("m", {"memory": "8Gi"}))
        waiting = await env.placement("m", state="Pending")
        assert waiting["held"] is False and waiting["device"] == "MIG 1g.10gb (mixed strategy)"
        env.clock.advance(1)  # a few reconciles later (resync), still planned afresh, never "kept"
        await env.cluster.call("PATCH", "/apis/sluice.dev/v1alpha1/namespaces/e2e/inferencemodels/m",
                               {"metadata": {"labels": {"touched": "yes"}}}, "application/merge-patch+json")
        again = await env.condition("m", "GpuPlaced", status="False", reason="CapacityFull")
        assert "kept" not in again["message"], again["message"]
        status, _ = await env.cluster.call("DELETE", "/api/v1/namespaces/team-b/pods/3g-0")
        assert status < 300
        env.clock.advance(31)  # the next inventory read finds the 3g.40gb free
        placed = await env.placement("m", state="Placed")
        assert placed["device"] == "MIG 3g.40gb (mixed strategy)" and placed["held"] is True
        assert gpu_limits(await env.pod_spec("m")) == {"nvidia.com/mig-3g.40gb": "1"}


async def test_a_profile_no_gpu_of_the_cluster_has_is_an_invalid_spec() -> None:
    async with environment() as env:
        await env.add(gpu_nodes.a100_mixed("a100-a"))
        await env.add(model("old", {"migProfile": "1g.5gb"}))  # an A100-40GB profile; this cluster has 80GB
        degraded = await env.condition("old", "Degraded", status="True", reason="InvalidSpec")
        assert "'1g.5gb' is not a MIG profile of any GPU in this cluster; its GPUs offer A100-80GB: 1g.10gb, " \
               "1g.10gb+me, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb" in degraded["message"]
        assert await env.cluster.get("Deployment", "old") is None


async def test_replan_annotation_moves_a_model_to_what_fits_best_now() -> None:
    async with environment() as env:
        await env.add(gpu_nodes.a100_mixed("a100-a"),
                      *[gpu_nodes.pod_holding(n, "a100-a", {"nvidia.com/mig-1g.10gb": 1}, namespace="team-b")
                        for n in ("h1", "h2")])
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


async def test_single_strategy_and_whole_gpus_never_mix_up() -> None:
    """Under the single strategy a MIG slice is advertised as nvidia.com/gpu: without the product pin a
    whole-GPU pod would land on it and get a 1g.10gb slice (and a slice pod on a whole GPU)."""
    async with environment() as env:
        await env.add(gpu_nodes.h100_single("h100-mig"), gpu_nodes.l4("l4-a"))
        await env.add(model("slice", {"migProfile": "1g.10gb"}, replicas=3), model("whole", {"count": 1}))
        placed = await env.placement("slice", state="Placed")
        assert placed["device"] == "MIG 1g.10gb (single strategy)"
        assert placed["products"] == ["NVIDIA-H100-80GB-HBM3-MIG-1g.10gb"]
        assert gpu_limits(await env.pod_spec("slice")) == {"nvidia.com/gpu": "1"}
        assert await env.bound("slice", 3) == ["h100-mig"] * 3
        assert await env.bound("whole") == ["l4-a"]  # h100-mig sorts first and has free nvidia.com/gpu


async def test_time_sliced_gpus_only_when_the_model_allows_sharing() -> None:
    async with environment() as env:
        await env.add(gpu_nodes.t4_time_sliced("t4-a"), gpu_nodes.l4("l4-a"))
        await env.add(model("tolerant", {"memory": "3Gi", "shared": True}, replicas=2),
                      model("strict", {"memory": "3Gi"}))
        assert (await env.placement("tolerant", state="Placed"))["device"] == "1 time-sliced GPU share"
        assert await env.bound("tolerant", 2) == ["t4-a", "t4-a"]
        assert (await env.placement("strict", state="Placed"))["products"] == ["NVIDIA-L4"]
        assert await env.bound("strict") == ["l4-a"]
        # A share is the GPU's memory over its replicas (15 GiB / 4): a 6Gi model does not fit one.
        await env.add(model("roomy", {"memory": "6Gi", "shared": True}))
        roomy = await env.condition("roomy", "GpuPlaced", status="False")
        assert roomy["reason"] == "CapacityFull" and "1 whole GPU: 0 free of 1" in roomy["message"]


async def test_a_fragmented_pool_takes_the_next_size_up_and_explains_a_full_profile() -> None:
    async with environment() as env:
        nodes, holders = gpu_nodes.fragmented_a100()
        await env.add(*nodes, *holders)
        await env.add(model("fits", {"memory": "8Gi"}), model("exact", {"migProfile": "1g.10gb"}))
        fits = await env.placement("fits", state="Placed")
        assert fits["device"] == "MIG 2g.20gb (mixed strategy)"  # every 1g.10gb is held
        assert await env.bound("fits") == ["a100-2"]
        exact = await env.condition("exact", "GpuPlaced", status="False")
        assert exact["reason"] == "CapacityFull"
        assert "MIG 1g.10gb (mixed strategy): 0 free of 6" in exact["message"]


async def test_dra_renders_claims_planned_on_the_drivers_resource_slices() -> None:
    async with environment(dra=True) as env:
        node, slice_ = gpu_nodes.dra_a100("a100-dra", mig="all-balanced")
        await env.add(node, slice_, *gpu_nodes.device_classes())
        await env.add(model("claimed", {"memory": "8Gi"}))
        placed = await env.placement("claimed", state="Placed")
        assert placed["kind"] == "dra" and placed["profile"] == "1g.10gb"
        template = await env.cluster.wait(
            lambda: env.cluster.get("ResourceClaimTemplate", "claimed-gpu"), "the ResourceClaimTemplate")
        [request] = template["spec"]["spec"]["devices"]["requests"]
        assert request["exactly"]["deviceClassName"] == "mig.nvidia.com"
        assert "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'" in [
            s["cel"]["expression"] for s in request["exactly"]["selectors"]]
        pod = await env.pod_spec("claimed")
        assert pod["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": "claimed-gpu"}]
        assert gpu_limits(pod) == {}


async def test_a_pool_is_placed_like_a_model_and_its_members_share_that_device() -> None:
    async with environment() as env:
        await env.add(gpu_nodes.a100_mixed("a100-a"))
        await env.add({"apiVersion": "sluice.dev/v1alpha1", "kind": "ModelPool", "metadata": {"name": "small"},
                       "spec": {"gpu": {"memory": "16Gi"}, "scaling": {"minReplicas": 1, "maxReplicas": 1}}})
        member = model("tiny", {"memory": "6Gi", "computePercent": 20})
        member["spec"]["pool"] = "small"
        member["spec"].pop("scaling")
        await env.add(member, model("solo", {"memory": "8Gi"}))

        async def pool_placement() -> dict[str, Any] | None:
            status = ((await env.cluster.get("ModelPool", "small")) or {}).get("status") or {}
            return status.get("placement") if (status.get("placement") or {}).get("state") == "Placed" else None
        placed = await env.cluster.wait(pool_placement, "the pool's placement")
        assert placed["device"] == "MIG 2g.20gb (mixed strategy)"  # the smallest slice with 16 GiB
        pod = await env.pod_spec("small")
        assert gpu_limits(pod) == {"nvidia.com/mig-2g.20gb": "1"}
        assert await env.bound("small") == ["a100-a"]
        # The member's 6Gi is a share of the pool's slice, not a slice of its own: a 1g.10gb is left for solo.
        assert (await env.placement("solo", state="Placed"))["device"] == "MIG 1g.10gb (mixed strategy)"
        tiny = await env.cluster.wait(lambda: env.cluster.get("InferenceModel", "tiny"), "tiny")
        assert "placement" not in (tiny.get("status") or {})
        assert await env.cluster.get("Deployment", "tiny") is None
