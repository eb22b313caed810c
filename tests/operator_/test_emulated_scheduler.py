"""The emulator's scheduler (``ApiServer(simulate_scheduling=True)``) and the simulated GPU clusters.

Operator tests lean on these to show a model is Ready only where a real scheduler would place its
pods, so they are checked here first: the filters against Kubernetes' own rules (table-driven, on
``sluice_testing.scheduler``), then the emulator through its HTTP API (pods bound or Pending with
kube-scheduler's message, capacity freed, Deployment status from bound pods), then the real operator.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator
from fractions import Fraction
from typing import Any

import kmock
import pytest

from sluice.operator.crd import all_crds
from sluice_testing import ApiServer, gpu_nodes, scheduler

Obj = dict[str, Any]
DEPLOY = "apps/v1/deployments"
NS = "models"


# ---------------------------------------------------------------- the filters, on their own

@pytest.mark.parametrize(("text", "value"), [
    ("2", Fraction(2)), ("500m", Fraction(1, 2)), ("4Gi", Fraction(4 * 2**30)), ("1e3", Fraction(1000)),
    ("1.5", Fraction(3, 2)), ("10M", Fraction(10**7)), ("128974848", Fraction(128974848)),
])
def test_quantities_parse_as_the_api_writes_them(text: str, value: Fraction) -> None:
    assert scheduler.quantity(text) == value


TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


@pytest.mark.parametrize(("toleration", "tolerated"), [
    ({"operator": "Exists"}, True),  # no key, Exists: everything
    ({"key": "nvidia.com/gpu", "operator": "Exists"}, True),  # any value, any effect
    ({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}, True),
    ({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"}, False),
    ({"key": "nvidia.com/gpu", "value": "present"}, True),  # operator defaults to Equal
    ({"key": "nvidia.com/gpu", "operator": "Equal", "value": "true"}, False),
    ({"key": "nvidia.com/gpu", "operator": "Equal"}, False),  # Equal with no value wants an empty value
    ({"key": "other", "operator": "Exists"}, False),
])
def test_tolerations_follow_kubernetes(toleration: Obj, tolerated: bool) -> None:
    assert scheduler.tolerates(toleration, TAINT) is tolerated


NODE = {"metadata": {"name": "gpu-1", "labels": {"nvidia.com/gpu.product": "NVIDIA-L4", "nvidia.com/gpu.count": "2"}}}


def _expr(key: str, operator: str, *values: str) -> Obj:
    return {"key": key, "operator": operator, **({"values": list(values)} if values else {})}


@pytest.mark.parametrize(("terms", "matches"), [
    ([{"matchExpressions": [_expr("nvidia.com/gpu.product", "In", "NVIDIA-L4", "Tesla-T4")]}], True),
    ([{"matchExpressions": [_expr("nvidia.com/gpu.product", "NotIn", "NVIDIA-L4")]}], False),
    ([{"matchExpressions": [_expr("missing", "NotIn", "x")]}], True),
    ([{"matchExpressions": [_expr("nvidia.com/gpu.count", "Exists")]}], True),
    ([{"matchExpressions": [_expr("nvidia.com/gpu.count", "DoesNotExist")]}], False),
    ([{"matchExpressions": [_expr("nvidia.com/gpu.count", "Gt", "1")]}], True),
    ([{"matchExpressions": [_expr("nvidia.com/gpu.count", "Lt", "2")]}], False),
    ([{"matchExpressions": [_expr("nvidia.com/gpu.product", "Gt", "1")]}], False),  # not an integer
    # expressions in a term are ANDed, terms are ORed, an empty term matches nothing
    ([{"matchExpressions": [_expr("nvidia.com/gpu.count", "Exists"), _expr("missing", "Exists")]}], False),
    ([{"matchExpressions": [_expr("missing", "Exists")]}, {"matchExpressions": [_expr("nvidia.com/gpu.count",
                                                                                       "Exists")]}], True),
    ([{}], False),
    ([], False),
    ([{"matchFields": [_expr("metadata.name", "In", "gpu-1")]}], True),
    ([{"matchFields": [_expr("metadata.name", "NotIn", "gpu-1")]}], False),
])
def test_required_node_affinity_follows_kubernetes(terms: list[Obj], matches: bool) -> None:
    pod = {"spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": terms}}}}}
    assert scheduler.matches_node(pod, NODE) is matches


def test_node_selector_needs_every_label() -> None:
    assert scheduler.matches_node({"spec": {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L4"}}}, NODE)
    assert not scheduler.matches_node(
        {"spec": {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L4", "pool": "x"}}}, NODE)


def test_pod_requests_aggregate_as_the_kubelet_does() -> None:
    pod = {"spec": {
        "containers": [{"resources": {"requests": {"cpu": "1"}, "limits": {"nvidia.com/mig-1g.10gb": "1"}}},
                       {"resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}}],
        "initContainers": [{"resources": {"requests": {"cpu": "4"}}},  # runs alone: its peak counts
                           {"restartPolicy": "Always", "resources": {"requests": {"memory": "1Gi"}}}],  # a sidecar
        "overhead": {"cpu": "100m"},
    }}
    assert scheduler.pod_requests(pod) == {"cpu": Fraction(41, 10), "memory": Fraction(2 * 2**30),
                                           "nvidia.com/mig-1g.10gb": Fraction(1)}


def test_the_message_is_kube_schedulers() -> None:
    message = scheduler.fit_error({"spec": {}}, 4, [
        scheduler.Rejection(("node(s) had untolerated taint {nvidia.com/gpu: present}",), False),
        scheduler.Rejection(("Insufficient nvidia.com/mig-1g.10gb",), True),
        scheduler.Rejection(("Insufficient cpu", "Insufficient nvidia.com/mig-1g.10gb"), True),
        scheduler.Rejection((scheduler.AFFINITY,), False),
    ])
    assert message == (
        "0/4 nodes are available: 1 Insufficient cpu, 1 node(s) didn't match Pod's node affinity/selector, "
        "1 node(s) had untolerated taint {nvidia.com/gpu: present}, 2 Insufficient nvidia.com/mig-1g.10gb. "
        "preemption: 0/4 nodes are available: 2 No preemption victims found for incoming pod, "
        "2 Preemption is not helpful for scheduling..")
    never = scheduler.fit_error({"spec": {"preemptionPolicy": "Never"}}, 1,
                                [scheduler.Rejection(("Insufficient nvidia.com/gpu",), True)])
    assert never == ("0/1 nodes are available: 1 Insufficient nvidia.com/gpu. "
                     "preemption: not eligible due to preemptionPolicy=Never..")


def test_template_hash_is_stable_and_spelled_like_the_controllers() -> None:
    template = {"metadata": {"labels": {"app": "m"}}, "spec": {"containers": [{"name": "c", "image": "i"}]}}
    first = scheduler.template_hash(template)
    assert first == scheduler.template_hash(copy.deepcopy(template))
    assert set(first) <= set("bcdfghjklmnpqrstvwxz2456789") and 1 <= len(first) <= 10
    assert first != scheduler.template_hash({**template, "metadata": {"labels": {"app": "n"}}})


# ---------------------------------------------------------------- the simulated GPU nodes

def test_a100_mixed_publishes_what_gfd_and_the_device_plugin_do() -> None:
    node = gpu_nodes.a100_mixed("a100-0", gpus=2)
    labels, allocatable = node["metadata"]["labels"], node["status"]["allocatable"]
    assert {k: labels[k] for k in ("nvidia.com/mig.strategy", "nvidia.com/mig.capable", "nvidia.com/gpu.product",
                                   "nvidia.com/gpu.count", "nvidia.com/gpu.memory", "nvidia.com/mig.config",
                                   "nvidia.com/mig.config.state", "cloud.google.com/gke-nodepool")} == {
        "nvidia.com/mig.strategy": "mixed", "nvidia.com/mig.capable": "true",
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.count": "2",
        "nvidia.com/gpu.memory": "81920", "nvidia.com/mig.config": "all-balanced",
        "nvidia.com/mig.config.state": "success", "cloud.google.com/gke-nodepool": "a100-mixed"}
    assert labels["nvidia.com/mig-1g.10gb.count"] == "4" and labels["nvidia.com/mig-1g.10gb.memory"] == "9728"
    assert labels["nvidia.com/mig-3g.40gb.product"] == "NVIDIA-A100-SXM4-80GB-MIG-3g.40gb"
    assert {k: v for k, v in allocatable.items() if k.startswith("nvidia.com/")} == {
        "nvidia.com/mig-1g.10gb": "4", "nvidia.com/mig-2g.20gb": "2", "nvidia.com/mig-3g.40gb": "2"}
    assert node["spec"]["taints"] == [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]


def test_single_strategy_and_time_slicing_overload_the_gpu_labels() -> None:
    h100 = gpu_nodes.h100_single("h100-0")
    labels = h100["metadata"]["labels"]
    assert (labels["nvidia.com/gpu.product"], labels["nvidia.com/gpu.count"], labels["nvidia.com/gpu.memory"]) == (
        "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb", "7", "9984")
    assert h100["status"]["allocatable"]["nvidia.com/gpu"] == "7"
    t4 = gpu_nodes.t4_time_sliced("t4-0", gpus=2)
    assert (t4["metadata"]["labels"]["nvidia.com/gpu.product"], t4["metadata"]["labels"]["nvidia.com/gpu.replicas"],
            t4["status"]["allocatable"]["nvidia.com/gpu"]) == ("Tesla-T4-SHARED", "4", "8")
    renamed = gpu_nodes.t4_time_sliced("t4-1", rename=True)
    assert renamed["metadata"]["labels"]["nvidia.com/gpu.product"] == "Tesla-T4"
    assert renamed["status"]["allocatable"]["nvidia.com/gpu.shared"] == "4"
    assert "nvidia.com/gpu" not in renamed["status"]["allocatable"]
    assert "nvidia.com/mig.strategy" not in gpu_nodes.l4("l4-0")["metadata"]["labels"]  # strategy none: no label


def test_dra_slices_name_devices_as_nvidias_driver_does() -> None:
    _, whole = gpu_nodes.dra_a100("dra-0", gpus=2)
    assert whole["spec"]["pool"] == {"name": "dra-0", "generation": 1, "resourceSliceCount": 1}
    assert [d["name"] for d in whole["spec"]["devices"]] == ["gpu-0", "gpu-1"]
    gpu = whole["spec"]["devices"][0]
    assert gpu["attributes"]["productName"] == {"string": "NVIDIA A100-SXM4-80GB"}
    assert gpu["attributes"]["cudaComputeCapability"] == {"version": "8.0.0"}
    assert gpu["capacity"]["memory"] == {"value": "80Gi"}
    _, mig = gpu_nodes.dra_a100("dra-1", mig="all-balanced")
    assert [d["name"] for d in mig["spec"]["devices"]] == [
        "gpu-0-mig-9-4-4", "gpu-0-mig-14-2-2", "gpu-0-mig-19-0-1", "gpu-0-mig-19-1-1"]
    slice_1g = mig["spec"]["devices"][2]
    assert slice_1g["attributes"]["profile"] == {"string": "1g.10gb"}
    assert slice_1g["attributes"]["parentUUID"]["string"].startswith("GPU-")
    assert slice_1g["capacity"]["memory"] == {"value": "9728Mi"}


# ---------------------------------------------------------------- the emulator, through its API

@pytest.fixture()
async def apiserver() -> AsyncIterator[ApiServer]:
    """Overrides conftest's: the same emulator, with the scheduler and controllers running."""
    async with ApiServer(simulate_scheduling=True, serve_dra=True) as server, kmock.Server(server):
        for crd in all_crds():
            server.register_crd(copy.deepcopy(crd))
        yield server


async def _call(server: ApiServer, method: str, url: str, body: Any = None,
                content_type: str = "application/json") -> tuple[int, Any]:
    data = None if body is None else json.dumps(body)
    async with server.request(method, url, data=data, headers={"Content-Type": content_type}) as resp:
        return resp.status, await resp.json(content_type=None)


def _deployment(name: str, replicas: int = 1, *, limits: Obj | None = None, tolerate: bool = True,
                **pod_spec: Any) -> Obj:
    container = {"name": "runtime", "image": "sluice-runtime:test",
                 "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": limits or {}}}
    spec = {"containers": [container], **pod_spec}
    if tolerate:
        spec["tolerations"] = [gpu_nodes.GPU_TOLERATION]
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": NS},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}}, "spec": spec}}}


async def _apply(server: ApiServer, deployment: Obj) -> None:
    name = deployment["metadata"]["name"]
    status, body = await _call(server, "PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/{name}?fieldManager=t",
                               deployment, content_type="application/apply-patch+yaml")
    assert status < 300, body


def _pods(server: ApiServer, app: str) -> list[Obj]:
    return [p for p in server.read_all("v1/pods", NS) if p["metadata"]["labels"].get("app") == app]


def _placement(server: ApiServer, app: str) -> dict[str, str | None]:
    return {p["metadata"]["name"].rsplit("-", 1)[1]: p["spec"].get("nodeName") for p in _pods(server, app)}


def _waiting(pod: Obj) -> str:
    [scheduled] = [c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled"]
    assert (pod["status"]["phase"], scheduled["status"], scheduled["reason"]) == ("Pending", "False", "Unschedulable")
    return str(scheduled["message"])


async def test_pods_bind_while_resources_last_and_the_rest_wait_with_the_schedulers_message(apiserver):
    await gpu_nodes.load(apiserver, [gpu_nodes.l4("l4-a"), gpu_nodes.l4("l4-b")])
    await _apply(apiserver, _deployment("m", 3, limits={"nvidia.com/gpu": "1"}))
    assert _placement(apiserver, "m") == {"0": "l4-a", "1": "l4-b", "2": None}
    pods = _pods(apiserver, "m")
    bound = pods[0]
    assert bound["status"]["phase"] == "Running" and scheduler.ready(bound)
    assert bound["metadata"]["ownerReferences"][0]["kind"] == "Deployment"
    assert bound["metadata"]["name"] == f"m-{bound['metadata']['labels']['pod-template-hash']}-0"
    assert _waiting(pods[2]) == ("0/2 nodes are available: 2 Insufficient nvidia.com/gpu. preemption: 0/2 nodes "
                                 "are available: 2 No preemption victims found for incoming pod..")
    status = apiserver.read(DEPLOY, NS, "m")["status"]
    assert {k: status.get(k) for k in ("observedGeneration", "replicas", "updatedReplicas", "readyReplicas",
                                       "availableReplicas", "unavailableReplicas")} == {
        "observedGeneration": 1, "replicas": 3, "updatedReplicas": 3, "readyReplicas": 2, "availableReplicas": 2,
        "unavailableReplicas": 1}
    progressing = next(c for c in status["conditions"] if c["type"] == "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("True", "ReplicaSetUpdated")

    # a node joins: the waiting pod is placed and the rollout completes
    await gpu_nodes.load(apiserver, [gpu_nodes.l4("l4-c")])
    assert _placement(apiserver, "m")["2"] == "l4-c"
    status = apiserver.read(DEPLOY, NS, "m")["status"]
    assert status["readyReplicas"] == 3 and "unavailableReplicas" not in status
    assert [(c["type"], c["status"], c["reason"]) for c in status["conditions"]] == [
        ("Available", "True", "MinimumReplicasAvailable"), ("Progressing", "True", "NewReplicaSetAvailable")]


async def test_a_profile_that_exists_but_is_full_waits_until_a_slice_is_freed(apiserver):
    nodes, holders = gpu_nodes.fragmented_a100()
    await gpu_nodes.load(apiserver, nodes, holders)
    await _apply(apiserver, _deployment("small", 1, limits={"nvidia.com/mig-1g.10gb": "1"}))
    await _apply(apiserver, _deployment("medium", 2, limits={"nvidia.com/mig-2g.20gb": "1"}))
    await _apply(apiserver, _deployment("large", 1, limits={"nvidia.com/mig-3g.40gb": "1"}))
    assert _placement(apiserver, "small") == {"0": None}
    assert _waiting(_pods(apiserver, "small")[0]) == (
        "0/3 nodes are available: 3 Insufficient nvidia.com/mig-1g.10gb. preemption: 0/3 nodes are available: "
        "3 No preemption victims found for incoming pod..")
    assert _placement(apiserver, "medium") == {"0": "a100-2", "1": None}  # the one free 2g.20gb
    assert _placement(apiserver, "large") == {"0": "a100-1"}  # a100-0's 3g.40gb is held

    # another team's job ends: its slice goes to the pod that waited longest for that profile
    status, _ = await _call(apiserver, "DELETE", "/api/v1/namespaces/tenants/pods/job-1g-10gb-1-1")
    assert status == 200
    assert _placement(apiserver, "small") == {"0": "a100-1"}
    assert _placement(apiserver, "medium") == {"0": "a100-2", "1": None}


async def test_taints_selectors_and_affinity_decide_where_pods_may_go(apiserver):
    await gpu_nodes.load(apiserver, [gpu_nodes.l4("l4-a"), gpu_nodes.h100_single("mig-a"),
                                     gpu_nodes.t4_time_sliced("t4-a")])
    await _apply(apiserver, _deployment("untolerated", 1, limits={"nvidia.com/gpu": "1"}, tolerate=False))
    assert _waiting(_pods(apiserver, "untolerated")[0]) == (
        "0/3 nodes are available: 3 node(s) had untolerated taint {nvidia.com/gpu: present}. preemption: 0/3 nodes "
        "are available: 3 Preemption is not helpful for scheduling..")
    await _apply(apiserver, _deployment("on-t4", 1, limits={"nvidia.com/gpu": "1"},
                                        nodeSelector={"nvidia.com/gpu.product": "Tesla-T4-SHARED"}))
    assert _placement(apiserver, "on-t4") == {"0": "t4-a"}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In",
                               "values": ["NVIDIA-H100-80GB-HBM3-MIG-1g.10gb"]}]}]}}}
    await _apply(apiserver, _deployment("on-mig", 8, limits={"nvidia.com/gpu": "1"}, affinity=affinity))
    placed = _placement(apiserver, "on-mig")
    assert [placed[str(i)] for i in range(7)] == ["mig-a"] * 7 and placed["7"] is None
    assert _waiting(_pods(apiserver, "on-mig")[7]) == (
        "0/3 nodes are available: 1 Insufficient nvidia.com/gpu, 2 node(s) didn't match Pod's node "
        "affinity/selector. preemption: 0/3 nodes are available: 1 No preemption victims found for incoming pod, "
        "2 Preemption is not helpful for scheduling..")


async def test_unschedulable_and_not_ready_nodes_take_no_pods(apiserver):
    await gpu_nodes.load(apiserver, [gpu_nodes.l4("l4-a", unschedulable=True), gpu_nodes.l4("l4-b", ready=False)])
    await _apply(apiserver, _deployment("m", 1, limits={"nvidia.com/gpu": "1"}))
    assert _waiting(_pods(apiserver, "m")[0]).startswith(
        "0/2 nodes are available: 1 node(s) had untolerated taint {node.kubernetes.io/not-ready: }, "
        "1 node(s) were unschedulable.")
    # uncordon: the pod goes there
    status, _ = await _call(apiserver, "PATCH", "/api/v1/nodes/l4-a", {"spec": {"unschedulable": False}},
                            content_type="application/merge-patch+json")
    assert status == 200
    assert _placement(apiserver, "m") == {"0": "l4-a"}


async def test_time_sliced_gpus_take_one_pod_per_replica_under_their_own_resource_name(apiserver):
    await gpu_nodes.load(apiserver, [gpu_nodes.t4_time_sliced("t4-a"), gpu_nodes.t4_time_sliced("t4-b", rename=True)])
    await _apply(apiserver, _deployment("plain", 5, limits={"nvidia.com/gpu": "1"}))
    await _apply(apiserver, _deployment("shared", 1, limits={"nvidia.com/gpu.shared": "1"}))
    assert list(_placement(apiserver, "plain").values()) == ["t4-a"] * 4 + [None]
    assert _placement(apiserver, "shared") == {"0": "t4-b"}


async def test_scaling_and_template_changes_replace_pods_as_the_controllers_do(apiserver):
    await gpu_nodes.load(apiserver, [gpu_nodes.l4("l4-a", gpus=4)])
    await _apply(apiserver, _deployment("m", 3, limits={"nvidia.com/gpu": "1"}))
    first = {p["metadata"]["name"] for p in _pods(apiserver, "m")}
    await apiserver.scale(NS, "m", 1)
    assert {p["metadata"]["name"] for p in _pods(apiserver, "m")} == {n for n in first if n.endswith("-0")}
    await apiserver.scale(NS, "m", 2)
    assert list(_placement(apiserver, "m")) == ["0", "1"]
    changed = _deployment("m", 2, limits={"nvidia.com/gpu": "2"})  # a new template: new pods, new hash
    await _apply(apiserver, changed)
    pods = _pods(apiserver, "m")
    assert not {p["metadata"]["name"] for p in pods} & first
    assert [p["spec"]["nodeName"] for p in pods] == ["l4-a", "l4-a"]  # the old pods' GPUs were freed first
    status = apiserver.read(DEPLOY, NS, "m")["status"]
    assert status["observedGeneration"] == apiserver.read(DEPLOY, NS, "m")["metadata"]["generation"]
    assert status["updatedReplicas"] == status["readyReplicas"] == 2


async def test_a_deleted_node_takes_its_pods_with_it_and_the_deployment_makes_new_ones(apiserver):
    await gpu_nodes.load(apiserver, [gpu_nodes.l4("l4-a")])
    await _apply(apiserver, _deployment("m", 1, limits={"nvidia.com/gpu": "1"}))
    assert _placement(apiserver, "m") == {"0": "l4-a"}
    status, _ = await _call(apiserver, "DELETE", "/api/v1/nodes/l4-a")
    assert status == 200
    assert _waiting(_pods(apiserver, "m")[0]) == "no nodes available to schedule pods"
    assert apiserver.read(DEPLOY, NS, "m")["status"].get("readyReplicas") is None  # zero: omitted
    await gpu_nodes.load(apiserver, [gpu_nodes.l4("l4-b")])
    assert _placement(apiserver, "m") == {"0": "l4-b"}


async def test_deleting_a_deployment_frees_its_capacity(apiserver):
    await gpu_nodes.load(apiserver, [gpu_nodes.l4("l4-a")])
    await _apply(apiserver, _deployment("first", 1, limits={"nvidia.com/gpu": "1"}))
    await _apply(apiserver, _deployment("second", 1, limits={"nvidia.com/gpu": "1"}))
    assert _placement(apiserver, "second") == {"0": None}
    status, _ = await _call(apiserver, "DELETE", f"/apis/apps/v1/namespaces/{NS}/deployments/first")
    assert status == 200
    assert _pods(apiserver, "first") == []
    assert _placement(apiserver, "second") == {"0": "l4-a"}


async def test_pods_with_resource_claims_are_placed_without_allocating_them(apiserver):
    """A documented gap (e2e/README.md): DRA claims are neither allocated nor checked, so a claim that
    no ResourceSlice can satisfy does not keep the pod Pending. The pod's other constraints still hold."""
    node, resource_slice = gpu_nodes.dra_a100("dra-a", mig="all-balanced")
    await gpu_nodes.load(apiserver, [node], objects=[resource_slice, *gpu_nodes.device_classes()])
    claims = [{"name": "gpu", "resourceClaimTemplateName": "m-gpu"}]
    await _apply(apiserver, _deployment("m", 1, resourceClaims=claims))
    await _apply(apiserver, _deployment("untolerated", 1, resourceClaims=claims, tolerate=False))
    assert _placement(apiserver, "m") == {"0": "dra-a"}
    assert _placement(apiserver, "untolerated") == {"0": None}


async def test_dra_resources_pods_and_nodes_are_served_as_a_1_34_cluster_does(apiserver):
    node, resource_slice = gpu_nodes.dra_a100("dra-a", gpus=2)
    await gpu_nodes.load(apiserver, [node, gpu_nodes.l4("l4-a")], [gpu_nodes.pod_holding("job", "l4-a",
                                                                                      {"nvidia.com/gpu": 1})],
                         objects=[resource_slice, *gpu_nodes.device_classes()])
    status, discovery = await _call(apiserver, "GET", "/apis/resource.k8s.io/v1")
    assert status == 200
    scopes = {r["name"]: r["namespaced"] for r in discovery["resources"] if "/" not in r["name"]}
    assert scopes == {"resourceslices": False, "deviceclasses": False, "resourceclaims": True,
                      "resourceclaimtemplates": True}
    status, slices = await _call(apiserver, "GET", "/apis/resource.k8s.io/v1/resourceslices")
    assert [s["spec"]["nodeName"] for s in slices["items"]] == ["dra-a"]
    status, classes = await _call(apiserver, "GET", "/apis/resource.k8s.io/v1/deviceclasses")
    assert sorted(c["metadata"]["name"] for c in classes["items"]) == ["gpu.nvidia.com", "mig.nvidia.com"]

    await _apply(apiserver, _deployment("m", 1))
    status, pods = await _call(apiserver, "GET", "/api/v1/pods")  # every namespace
    assert sorted((p["metadata"]["namespace"], p["spec"]["nodeName"]) for p in pods["items"]) == [
        ("models", "dra-a"), ("tenants", "l4-a")]
    status, on_l4 = await _call(apiserver, "GET", "/api/v1/pods?fieldSelector=spec.nodeName%3Dl4-a")
    assert [p["metadata"]["name"] for p in on_l4["items"]] == ["job"]
    status, running = await _call(apiserver, "GET", "/api/v1/pods?fieldSelector=status.phase%21%3DRunning")
    assert running["items"] == []
    status, error = await _call(apiserver, "GET", "/api/v1/pods?fieldSelector=spec.containers%3Dx")
    assert (status, error["message"]) == (400, "field label not supported: spec.containers")
    status, nodes = await _call(apiserver, "GET", "/api/v1/nodes?labelSelector=cloud.google.com%2Fgke-nodepool%3Dl4")
    assert [n["metadata"]["name"] for n in nodes["items"]] == ["l4-a"]
    assert nodes["items"][0]["status"]["allocatable"]["nvidia.com/gpu"] == "1"  # a kubelet registers with its status


async def test_nodes_are_watched_cluster_wide(apiserver):
    _, listed = await _call(apiserver, "GET", "/api/v1/nodes")
    version = listed["metadata"]["resourceVersion"]
    async with apiserver.request("GET", f"/api/v1/nodes?watch=true&resourceVersion={version}") as stream:
        await gpu_nodes.load(apiserver, [gpu_nodes.l4("l4-a")])
        line = await asyncio.wait_for(stream.content.readline(), timeout=5)
    event = json.loads(line)
    assert (event["type"], event["object"]["metadata"]["name"]) == ("ADDED", "l4-a")


async def test_without_simulate_scheduling_deployments_get_no_pods():
    async with ApiServer(simulate_rollouts=True) as server, kmock.Server(server):
        await gpu_nodes.load(server, [gpu_nodes.l4("l4-a")])
        await _apply(server, _deployment("m", 2, limits={"nvidia.com/gpu": "1"}))
        assert server.read_all("v1/pods") == []
        assert server.read(DEPLOY, NS, "m")["status"]["readyReplicas"] == 2  # the old, scheduler-less rollout


# ---------------------------------------------------------------- the operator against it

async def test_a_gpu_model_is_unschedulable_until_a_node_can_take_it(client, operator, apiserver, clock):
    nodes, holders = gpu_nodes.fragmented_a100()
    await gpu_nodes.load(apiserver, nodes, holders)
    await client.create(client.IM, client.model(resources={"cpu": "2", "memory": "4Gi", "gpu": {"count": 1}},
                                                scaling={"minReplicas": 1, "maxReplicas": 1}))
    # The planner knows before the scheduler does: MIG nodes have no whole GPU to give.
    degraded = await client.wait(lambda: (c := client.condition(client.read(client.IM, "resnet"), "Degraded"))
                                 and c["reason"] == "NoMatchingCapacity" and c)
    assert "needs 1 x 1 whole GPU(s); no node offers whole exclusive GPUs" in degraded["message"]
    assert client.condition(client.read(client.IM, "resnet"), "Ready")["status"] == "False"
    # Rendered from the spec meanwhile: the scheduler leaves it Pending, naming the same thing.
    pending = await client.wait(lambda: [p for p in apiserver.read_all("v1/pods", NS)
                                         if p["status"].get("phase") == "Pending"])
    assert "Insufficient nvidia.com/gpu" in pending[0]["status"]["conditions"][0]["message"]

    await gpu_nodes.load(apiserver, [gpu_nodes.l4("l4-a")])
    clock.advance(31)  # the operator's GPU inventory is read again (placement_refresh_seconds)
    await client.patch(client.IM, "resnet", {"metadata": {"labels": {"nudge": "1"}}})
    await client.wait(lambda: client.condition(client.read(client.IM, "resnet"), "Ready")["status"] == "True")
    await client.wait(lambda: client.condition(client.read(client.IM, "resnet"), "Degraded")["reason"] == "AsExpected")
    assert client.read(client.IM, "resnet")["status"]["placement"]["products"] == ["NVIDIA-L4"]
    [pod] = [p for p in apiserver.read_all("v1/pods", NS)]
    assert pod["spec"]["nodeName"] == "l4-a"


async def test_models_asking_for_a_slice_never_land_on_time_sliced_slices_of_the_same_name(
        client, operator, apiserver):
    """A time-sliced A100 whose device plugin does not rename its resources advertises nvidia.com/mig-1g.10gb
    x4 beside an exclusive node's: the planner counted its 8 replicas as slices, and the scheduler, asked
    for the resource alone, bound the third model there, sharing a slice it had not agreed to share."""
    # named so the emulated scheduler, which tries nodes in name order, would bind to the time-sliced one first
    await gpu_nodes.load(apiserver, [gpu_nodes.a100_mixed("b-exclusive"),
                                     gpu_nodes.a100_mixed("a-sliced", replicas=4, pool="a100-shared")])
    for name in ("a", "b", "c"):
        body = client.model(name, resources={"cpu": "2", "memory": "4Gi", "gpu": {"migProfile": "1g.10gb"}},
                            scaling={"minReplicas": 1, "maxReplicas": 1})
        body["metadata"]["creationTimestamp"] = f"2026-01-01T00:00:0{'abc'.index(name)}Z"
        await client.create(client.IM, body)
    for name in ("a", "b"):
        await client.wait(lambda n=name: client.condition(client.read(client.IM, n), "Ready")["status"] == "True")
    degraded = await client.wait(lambda: (c := client.condition(client.read(client.IM, "c"), "Degraded"))
                                 and c["reason"] != "AsExpected" and c)
    assert "MIG 1g.10gb (mixed strategy): 0 free of 2" in degraded["message"], degraded
    bound = sorted((p["metadata"]["labels"].get("app.kubernetes.io/instance"), p["spec"].get("nodeName"))
                   for p in apiserver.read_all("v1/pods", NS))
    assert bound == [("a", "b-exclusive"), ("b", "b-exclusive"), ("c", None)]
    placed = client.read(client.IM, "a")["status"]["placement"]
    assert placed["avoidProducts"] == ["NVIDIA-A100-SXM4-80GB-MIG-1g.10gb-SHARED"]

    # Allowed to share, a model takes a replica of a time-sliced slice (9.5 GiB over 4) once no exclusive
    # slice is free (those come first: memory isolation).
    for name, profile in (("e", "2g.20gb"), ("f", "3g.40gb")):
        await client.create(client.IM, client.model(name, resources={"cpu": "2", "memory": "4Gi", "gpu": {
            "migProfile": profile}}, scaling={"minReplicas": 1, "maxReplicas": 1}))
        await client.wait(lambda n=name: client.condition(client.read(client.IM, n), "Ready")["status"] == "True")
    body = client.model("d", resources={"cpu": "2", "memory": "4Gi", "gpu": {"memory": "2Gi", "shared": True}},
                        scaling={"minReplicas": 1, "maxReplicas": 1})
    await client.create(client.IM, body)
    await client.wait(lambda: client.condition(client.read(client.IM, "d"), "Ready")["status"] == "True")
    placement = client.read(client.IM, "d")["status"]["placement"]
    assert (placement["device"], placement["memoryMiB"]) == ("time-sliced MIG 1g.10gb share", 9728 // 4)
    [pod] = [p for p in apiserver.read_all("v1/pods", NS) if p["metadata"]["labels"].get(
        "app.kubernetes.io/instance") == "d"]
    assert pod["spec"]["nodeName"] == "a-sliced"
