"""How a model's GPU need becomes a pod spec, per node strategy: planner (pure) + builders (pure).

Table-driven over Node objects shaped as GPU feature discovery and NVIDIA's device plugin publish them;
every rendered object is validated against the Kubernetes schema (``kubernetes_validate``, 1.34 for DRA).
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate  # a test dependency: these checks must run, never skip
import pytest

from sluice.operator import api, builders, inventory, placement
from sluice.operator.settings import Settings

OWNER = builders.Owner(kind="InferenceModel", name="m", namespace="models", uid="u-1")
TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def node(name: str, labels: dict[str, str], allocatable: dict[str, str], *, taints: Any = ()) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels},
            "spec": {"taints": list(taints)}, "status": {"allocatable": {"cpu": "32", **allocatable}}}


A100_MIXED = node("a100-0", {
    "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.count": "1", "nvidia.com/gpu.memory": "81920",
    "nvidia.com/mig.strategy": "mixed", "nvidia.com/mig.capable": "true", "nvidia.com/mig.config": "all-balanced",
    "nvidia.com/mig-1g.10gb.memory": "9728", "cloud.google.com/gke-nodepool": "a100",
}, {"nvidia.com/mig-1g.10gb": "2", "nvidia.com/mig-2g.20gb": "1", "nvidia.com/mig-3g.40gb": "1"}, taints=[TAINT])
A100_ME = node("a100-me", {
    "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.count": "2", "nvidia.com/mig.strategy": "mixed",
}, {"nvidia.com/mig-1g.10gb.me": "1", "nvidia.com/mig-3g.40gb": "3"})
H100_SINGLE = node("h100-0", {
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb", "nvidia.com/gpu.count": "7",
    "nvidia.com/gpu.memory": "9984", "nvidia.com/mig.strategy": "single", "nvidia.com/mig.capable": "true",
    "karpenter.sh/nodepool": "h100",
}, {"nvidia.com/gpu": "7"})
T4_SHARED = node("t4-0", {
    "nvidia.com/gpu.product": "Tesla-T4-SHARED", "nvidia.com/gpu.count": "1", "nvidia.com/gpu.replicas": "4",
    "nvidia.com/gpu.memory": "15360",
}, {"nvidia.com/gpu": "4"})
L4_WHOLE = node("l4-0", {
    "nvidia.com/gpu.product": "NVIDIA-L4", "nvidia.com/gpu.count": "2", "nvidia.com/gpu.memory": "23034",
}, {"nvidia.com/gpu": "2"})
H100_WHOLE = node("h100-w", {
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.count": "8", "nvidia.com/gpu.memory": "81559",
    "nvidia.com/mig.capable": "true", "nvidia.com/mig.strategy": "none",
}, {"nvidia.com/gpu": "8"})
CLUSTER = [A100_MIXED, H100_SINGLE, T4_SHARED, L4_WHOLE]


def gpu(**fields: Any) -> api.Gpu:
    spec = api.parse_inference_model("m", {"model": {"storageUri": "s3://b/m", "format": "onnx"},
                                           "resources": {"gpu": fields}})
    assert spec.resources.gpu is not None
    return spec.resources.gpu


def place(nodes: list[dict[str, Any]], need: api.Gpu, replicas: int = 1) -> placement.Verdict:
    request = placement.Request(key="InferenceModel/models/m", replicas=replicas, count=need.count or 0,
                                profile=need.mig_profile or "", memory_mib=need.memory_mib(),
                                compute_percent=need.compute_percent or 0, shared=need.shared)
    return placement.plan(inventory.from_nodes(nodes), [request]).verdicts[request.key]


def pod_of(need: api.Gpu, shape: placement.Shape | None, *, dra: bool = False) -> tuple[dict[str, Any], list[Any]]:
    settings = Settings(gpu_allocation="dra" if dra else "extended-resources")
    spec = api.parse_inference_model("m", {"model": {"storageUri": "s3://b/m", "format": "onnx"},
                                           "resources": {"gpu": {k: v for k, v in {
                                               "count": need.count, "migProfile": need.mig_profile,
                                               "memory": need.memory, "computePercent": need.compute_percent,
                                               "shared": need.shared or None}.items() if v is not None}}})
    desired = builders.inference_model(OWNER, spec, settings, shape=shape)
    [deployment] = [o for o in desired.objects if o["kind"] == "Deployment"]
    return deployment["spec"]["template"]["spec"], list(desired.objects)


def product_terms(pod: dict[str, Any]) -> list[str] | None:
    affinity = pod.get("affinity")
    if not affinity:
        return None
    [term] = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    [expression] = term["matchExpressions"]
    assert expression["key"] == "nvidia.com/gpu.product" and expression["operator"] == "In"
    return list(expression["values"])


@pytest.mark.parametrize(("nodes", "need", "limits", "products", "device"), [
    # mixed: the slice is named by its resource; any node with it will do
    (CLUSTER, {"migProfile": "1g.10gb"}, {"nvidia.com/mig-1g.10gb": "1"}, None, "MIG 1g.10gb (mixed strategy)"),
    # +me is published as .me ('+' is not legal in a resource name)
    ([A100_ME], {"migProfile": "1g.10gb+me"}, {"nvidia.com/mig-1g.10gb.me": "1"}, None,
     "MIG 1g.10gb+me (mixed strategy)"),
    # single: nvidia.com/gpu, pinned to the nodes whose product carries the profile
    ([H100_SINGLE], {"migProfile": "1g.10gb"}, {"nvidia.com/gpu": "1"}, ["NVIDIA-H100-80GB-HBM3-MIG-1g.10gb"],
     "MIG 1g.10gb (single strategy)"),
    # memory: the smallest free slice that fits (1g.10gb has 9.5 GiB)
    (CLUSTER, {"memory": "8Gi"}, {"nvidia.com/mig-1g.10gb": "1"}, None, "MIG 1g.10gb (mixed strategy)"),
    (CLUSTER, {"memory": "12Gi"}, {"nvidia.com/mig-2g.20gb": "1"}, None, "MIG 2g.20gb (mixed strategy)"),
    # compute share: 1g is 14 %, 2g 28 %, 3g 42 %
    (CLUSTER, {"memory": "4Gi", "computePercent": 40}, {"nvidia.com/mig-3g.40gb": "1"}, None,
     "MIG 3g.40gb (mixed strategy)"),
    # no slice is big enough: a whole exclusive GPU, never the time-sliced T4 or a MIG node
    (CLUSTER, {"memory": "20Gi", "computePercent": 60}, {"nvidia.com/gpu": "1"}, ["NVIDIA-L4"], "1 whole GPU"),
    # a time-sliced GPU only when the model allows it (T4 over 4 replicas: 3.75 GiB each)
    ([T4_SHARED, L4_WHOLE], {"memory": "3Gi", "shared": True}, {"nvidia.com/gpu": "1"}, ["Tesla-T4-SHARED"],
     "1 time-sliced GPU share"),
    ([T4_SHARED, L4_WHOLE], {"memory": "3Gi"}, {"nvidia.com/gpu": "1"}, ["NVIDIA-L4"], "1 whole GPU"),
    # whole GPUs: exclusive ones only, even where a MIG-single node advertises nvidia.com/gpu
    (CLUSTER, {"count": 2}, {"nvidia.com/gpu": "2"}, ["NVIDIA-L4"], "2 whole GPUs"),
])
def test_each_strategy_renders_what_its_nodes_advertise(nodes, need, limits, products, device):
    need_gpu = gpu(**need)
    verdict = place(nodes, need_gpu)
    assert verdict.state == placement.PLACED, verdict.reason
    assert verdict.shape is not None and verdict.shape.describe() == device
    pod, objects = pod_of(need_gpu, verdict.shape)
    [container] = pod["containers"]
    assert {k: v for k, v in container["resources"]["limits"].items() if k.startswith("nvidia.com/")} == limits
    assert container["resources"]["requests"]["nvidia.com/" + next(iter(limits))[len("nvidia.com/"):]] == \
        next(iter(limits.values()))
    assert product_terms(pod) == products
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    for obj in objects:
        kubernetes_validate.validate(obj, "1.30.0", strict=True)


def test_a_full_profile_is_pending_and_a_missing_one_unsatisfiable():
    taken = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "other", "namespace": "team-b"},
             "spec": {"nodeName": "a100-0", "containers": [
                 {"name": "c", "resources": {"limits": {"nvidia.com/mig-3g.40gb": "1"}}}]},
             "status": {"phase": "Running"}}
    two_gpus = node("a100-0", {**A100_MIXED["metadata"]["labels"], "nvidia.com/gpu.count": "2"},
                    {"nvidia.com/mig-1g.10gb": "4", "nvidia.com/mig-2g.20gb": "2", "nvidia.com/mig-3g.40gb": "2"})
    inv = inventory.from_nodes([two_gpus], [taken, {**taken, "metadata": {"name": "other-2", "namespace": "team-b"}}])
    full = placement.plan(inv, [placement.Request("IM/x/a", 1, profile="3g.40gb")]).verdicts["IM/x/a"]
    assert full.state == placement.PENDING
    assert "MIG 3g.40gb (mixed strategy): 0 free of 2" in full.reason
    assert full.shape is not None and full.shape.resource == "nvidia.com/mig-3g.40gb"  # runs once it frees
    never = placement.plan(inv, [placement.Request("IM/x/b", 1, profile="7g.80gb")])
    verdict = never.verdicts["IM/x/b"]
    assert verdict.state == placement.UNSATISFIABLE and verdict.shape is None
    assert verdict.reason == "needs 1 x MIG 7g.80gb; no node offers MIG 7g.80gb"
    # Both GPUs hold a 3g.40gb another pod uses, so no GPU can become a 7g.80gb: no advice.
    assert never.advice == ()
    # A 2g.20gb fits beside the held 3g.40gb once the free 1g/2g slices are reshaped: advised, not done.
    [advice] = placement.plan(inv, [placement.Request("IM/x/c", 3, profile="2g.20gb")]).advice
    assert advice.node == "a100-0" and advice.serves == ("IM/x/c",)
    # Two replicas take the free 2g.20gb slices; the third needs one more, so only GPU 0 is reshaped.
    assert advice.layouts == ((("2g.20gb", 0), ("2g.20gb", 2), ("3g.40gb", 4)),
                              (("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3), ("3g.40gb", 4)))
    assert advice.disrupts == (0,)
    assert advice.mig_parted() == {"version": "v1", "mig-configs": {advice.config: [
        {"devices": [0], "mig-enabled": True, "mig-devices": {"2g.20gb": 2, "3g.40gb": 1}},
        {"devices": [1], "mig-enabled": True, "mig-devices": {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}}]}}


def test_taints_of_the_chosen_nodes_are_tolerated():
    taints = [{"key": "nvidia.com/dedicated", "value": "ml", "effect": "NoExecute"},
              {"key": "team", "value": "x", "effect": "NoSchedule"}]
    tainted = node("l4-t", {"nvidia.com/gpu.product": "NVIDIA-L4", "nvidia.com/gpu.count": "1"},
                   {"nvidia.com/gpu": "1"}, taints=taints)
    verdict = place([tainted], gpu(count=1))
    pod, _ = pod_of(gpu(count=1), verdict.shape)
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "nvidia.com/dedicated", "operator": "Exists", "effect": "NoExecute"},
    ]  # a GPU taint is tolerated; someone else's (team=x) is not


@pytest.mark.parametrize(("need", "limits"), [
    ({"migProfile": "1g.10gb+me"}, {"nvidia.com/mig-1g.10gb.me": "1"}),
    ({"count": 2}, {"nvidia.com/gpu": "2"}),
    ({"memory": "16Gi"}, {"nvidia.com/gpu": "1"}),
])
def test_without_inventory_the_spec_alone_renders_legal_names(need, limits):
    pod, _ = pod_of(gpu(**need), None)
    assert {k: v for k, v in pod["containers"][0]["resources"]["limits"].items() if k.startswith("nvidia")} == limits


def test_dra_renders_a_claim_template_per_deployment():
    slices = [{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "a-gpu"},
               "spec": {"driver": "gpu.nvidia.com", "nodeName": "a100-0", "pool": {"name": "a100-0"}, "devices": [
                   {"name": "gpu-0-mig-19-0-1", "attributes": {
                       "type": {"string": "mig"}, "profile": {"string": "1g.10gb"},
                       "productName": {"string": "NVIDIA A100-SXM4-80GB"}},
                    "capacity": {"memory": {"value": "9728Mi"}}},
                   {"name": "gpu-1", "attributes": {
                       "type": {"string": "gpu"}, "productName": {"string": "NVIDIA A100-SXM4-80GB"}},
                    "capacity": {"memory": {"value": "80Gi"}}}]}}]
    inv = inventory.from_resource_slices(slices)
    need = gpu(memory="8Gi")
    request = placement.Request("InferenceModel/models/m", 1, memory_mib=need.memory_mib())
    verdict = placement.plan(inv, [request]).verdicts[request.key]
    assert verdict.state == placement.PLACED and verdict.shape is not None and verdict.shape.profile == "1g.10gb"
    pod, objects = pod_of(need, verdict.shape, dra=True)
    [template] = [o for o in objects if o["kind"] == "ResourceClaimTemplate"]
    assert template["metadata"]["name"] == "m-gpu"
    [req] = template["spec"]["spec"]["devices"]["requests"]
    assert req["exactly"]["deviceClassName"] == "mig.nvidia.com"
    assert [s["cel"]["expression"] for s in req["exactly"]["selectors"]] == [
        "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'",
        "device.attributes['gpu.nvidia.com'].productName in ['NVIDIA A100-SXM4-80GB']",
    ]
    assert pod["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": "m-gpu"}]
    assert pod["containers"][0]["resources"]["claims"] == [{"name": "gpu"}]
    assert not any(k.startswith("nvidia.com/") for k in pod["containers"][0]["resources"]["limits"])
    # Nothing visible to plan on: "a MIG slice with this much, else a GPU", in DRA's own words.
    _, unplanned = pod_of(need, None, dra=True)
    [template] = [o for o in unplanned if o["kind"] == "ResourceClaimTemplate"]
    [req] = template["spec"]["spec"]["devices"]["requests"]
    assert [s["deviceClassName"] for s in req["firstAvailable"]] == ["mig.nvidia.com", "gpu.nvidia.com"]
    for obj in [*objects, *unplanned]:
        kubernetes_validate.validate(obj, "1.34.0", strict=True)


# ---------------------------------------------------------------- time-sliced MIG slices
# GFD under time-slicing (its resource labeler): the replicas label says how many pods share one device, the
# device plugin advertises count x replicas, and the product label gains -SHARED unless the resource is renamed
# (nvidia.com/mig-<p>.shared, nvidia.com/gpu.shared). Each replica is a share of one slice, not a slice.

def a100_time_sliced_mixed(name: str, *, rename: bool) -> dict[str, Any]:
    """An A100 80GB with all-1g.10gb (7 slices), the 1g.10gb type time-sliced 4 ways, mixed strategy."""
    return node(name, {
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.count": "1",
        "nvidia.com/mig.strategy": "mixed", "nvidia.com/mig.capable": "true", "nvidia.com/mig.config": "all-1g.10gb",
        "nvidia.com/mig-1g.10gb.count": "7", "nvidia.com/mig-1g.10gb.memory": "9728",
        "nvidia.com/mig-1g.10gb.replicas": "4",
        "nvidia.com/mig-1g.10gb.product": "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb" + ("" if rename else "-SHARED"),
    }, {"nvidia.com/mig-1g.10gb" + (".shared" if rename else ""): "28"})


def h100_time_sliced_single(name: str, *, rename: bool) -> dict[str, Any]:
    """An H100 with all-1g.10gb under the single strategy, each of the 7 devices time-sliced 2 ways."""
    return node(name, {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb" + ("" if rename else "-SHARED"),
        "nvidia.com/gpu.count": "7", "nvidia.com/gpu.memory": "9984", "nvidia.com/gpu.replicas": "2",
        "nvidia.com/mig.strategy": "single", "nvidia.com/mig.capable": "true",
    }, {"nvidia.com/gpu.shared" if rename else "nvidia.com/gpu": "14"})


@pytest.mark.parametrize(("nodes", "resource", "label", "product", "memory"), [
    ([a100_time_sliced_mixed("a", rename=False)], "nvidia.com/mig-1g.10gb", "nvidia.com/mig-1g.10gb.product",
     "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb-SHARED", 9728 // 4),
    ([a100_time_sliced_mixed("a", rename=True)], "nvidia.com/mig-1g.10gb.shared", "nvidia.com/mig-1g.10gb.product",
     "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb", 9728 // 4),
    ([h100_time_sliced_single("h", rename=False)], "nvidia.com/gpu", "nvidia.com/gpu.product",
     "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb-SHARED", 9984 // 2),
    ([h100_time_sliced_single("h", rename=True)], "nvidia.com/gpu.shared", "nvidia.com/gpu.product",
     "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb", 9984 // 2),
])
def test_a_time_sliced_mig_slice_is_a_share_for_models_that_allow_sharing(nodes, resource, label, product, memory):
    """They were taken for exclusive slices: 28 "1g.10gb slices" on one GPU of 7, each promised 9.5 GiB, and
    handed to models that never allowed sharing (or asked for the profile by name)."""
    inv = inventory.from_nodes(nodes)
    [found] = inv.nodes
    assert found.gpus == 1 and len(found.devices) == (28 if "mig-" in resource else 14)
    assert {(d.kind, d.resource, d.profile, d.memory_mib, d.product) for d in found.devices} == {
        (inventory.SHARED, resource, "1g.10gb", memory, product)}
    assert [[p for p, _ in layout] for layout in found.layouts] == [["1g.10gb"] * 7]  # physical, once per slice

    for need in ({"migProfile": "1g.10gb"}, {"memory": "2Gi"}):  # exclusive, by name or by memory: none here
        verdict = place(nodes, gpu(**need))
        assert verdict.state == placement.UNSATISFIABLE, verdict
    assert "time-sliced GPUs excluded: set gpu.shared to allow them" in place(nodes, gpu(memory="2Gi")).reason
    assert place(nodes, gpu(memory="6Gi", shared=True)).state == placement.UNSATISFIABLE  # a share has less

    need = gpu(memory="2Gi", shared=True)
    verdict = place(nodes, need, replicas=len(found.devices))
    assert verdict.state == placement.PLACED, verdict.reason
    assert verdict.shape is not None and verdict.shape.describe() == "time-sliced MIG 1g.10gb share"
    assert verdict.shape.memory_mib == memory
    assert place(nodes, need, replicas=len(found.devices) + 1).state == placement.UNSATISFIABLE
    pod, objects = pod_of(need, verdict.shape)
    [container] = pod["containers"]
    assert {k: v for k, v in container["resources"]["limits"].items() if k.startswith("nvidia.com/")} == {resource: "1"}
    [term] = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": label, "operator": "In", "values": [product]}]
    for obj in objects:
        kubernetes_validate.validate(obj, "1.30.0", strict=True)


def test_an_exclusive_slice_stays_off_nodes_that_time_slice_its_resource_name():
    """Without renameByDefault an exclusive 1g.10gb and a time-sliced one are both nvidia.com/mig-1g.10gb: the
    pod of a model that asked for the slice must not be schedulable onto the time-sliced node."""
    nodes = [A100_MIXED, a100_time_sliced_mixed("shared-0", rename=False)]
    need = gpu(migProfile="1g.10gb")
    verdict = place(nodes, need, replicas=2)
    assert verdict.state == placement.PLACED and verdict.nodes == ("a100-0", "a100-0")
    assert verdict.shape is not None and verdict.shape.describe() == "MIG 1g.10gb (mixed strategy)"
    assert verdict.shape.avoid == ("NVIDIA-A100-SXM4-80GB-MIG-1g.10gb-SHARED",)
    assert place(nodes, need, replicas=3).state == placement.UNSATISFIABLE  # the A100's two, not 30
    pod, objects = pod_of(need, verdict.shape)
    [term] = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": "nvidia.com/mig-1g.10gb.product", "operator": "NotIn",
                                         "values": ["NVIDIA-A100-SXM4-80GB-MIG-1g.10gb-SHARED"]}]
    for obj in objects:
        kubernetes_validate.validate(obj, "1.30.0", strict=True)
    # renamed, the resource names differ: nothing to avoid
    verdict = place([A100_MIXED, a100_time_sliced_mixed("shared-0", rename=True)], need)
    assert verdict.shape is not None and verdict.shape.avoid == ()
    assert pod_of(need, verdict.shape)[0].get("affinity") is None


def test_a_kept_exclusive_slice_learns_of_time_sliced_nodes_even_cordoned_ones():
    """A placement stored before the operator knew (or while the time-sliced node was cordoned) had no
    avoid: kept as it was, its pods could still be bound to a time-sliced slice once the node was back."""
    sliced = a100_time_sliced_mixed("shared-0", rename=False)
    cordoned = {**sliced, "spec": {**sliced["spec"], "unschedulable": True}}
    need = gpu(migProfile="1g.10gb")
    verdict = place([A100_MIXED, cordoned], need)
    assert verdict.shape is not None and verdict.shape.avoid == ("NVIDIA-A100-SXM4-80GB-MIG-1g.10gb-SHARED",)
    stored = placement.Shape(kind=inventory.MIXED, resource="nvidia.com/mig-1g.10gb", count=1, profile="1g.10gb")
    request = placement.Request(key="InferenceModel/models/m", replicas=1, profile="1g.10gb", pinned=stored,
                                pinned_for="mig=1g.10gb")
    kept = placement.plan(inventory.from_nodes([A100_MIXED, sliced]), [request]).verdicts[request.key]
    assert kept.kept and kept.shape is not None and kept.shape.avoid == ("NVIDIA-A100-SXM4-80GB-MIG-1g.10gb-SHARED",)
    # the node gone again: what was learnt stays (the pods do not roll each time a node comes and goes)
    pinned = placement.Request(key=request.key, replicas=1, profile="1g.10gb", pinned=kept.shape,
                               pinned_for="mig=1g.10gb")
    again = placement.plan(inventory.from_nodes([A100_MIXED]), [pinned]).verdicts[request.key]
    assert again.shape == kept.shape


def test_a_node_time_slicing_some_slices_of_a_type_hands_out_the_rest_exclusively():
    """The device plugin's time-slicing config may share only some devices, renamed: both resources appear,
    and GFD's labels (under the original name) describe the shared ones."""
    labels = {
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.count": "1",
        "nvidia.com/mig.strategy": "mixed", "nvidia.com/mig-1g.10gb.memory": "9728",
        "nvidia.com/mig-1g.10gb.replicas": "2", "nvidia.com/mig-1g.10gb.product": "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb",
    }
    mixed = node("half", labels, {"nvidia.com/mig-1g.10gb": "3", "nvidia.com/mig-1g.10gb.shared": "8"})
    [found] = inventory.from_nodes([mixed]).nodes
    assert [[p for p, _ in layout] for layout in found.layouts] == [["1g.10gb"] * 7]
    kinds = sorted((d.kind, d.resource, d.memory_mib) for d in found.devices)
    assert kinds == [("mixed", "nvidia.com/mig-1g.10gb", 9728)] * 3 + [
        ("shared", "nvidia.com/mig-1g.10gb.shared", 4864)] * 8
    assert place([mixed], gpu(migProfile="1g.10gb"), replicas=3).state == placement.PLACED
    assert place([mixed], gpu(migProfile="1g.10gb"), replicas=4).state == placement.UNSATISFIABLE


def test_a_time_sliced_slice_without_a_product_label_is_named_by_its_resource_alone():
    """No invented label value: GFD published no nvidia.com/mig-<p>.product, so nothing can be pinned on it
    (and a value made from a +me profile would not even be a legal label value)."""
    bare = node("bare", {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.count": "1",
                         "nvidia.com/mig.strategy": "mixed", "nvidia.com/mig-1g.10gb.me.replicas": "3"},
                {"nvidia.com/mig-1g.10gb.me.shared": "3"})
    need = gpu(memory="3000Mi", shared=True)
    verdict = place([bare], need)
    assert verdict.state == placement.PLACED and verdict.shape is not None
    assert (verdict.shape.resource, verdict.shape.products) == ("nvidia.com/mig-1g.10gb.me.shared", ())
    pod, _ = pod_of(need, verdict.shape)
    assert pod.get("affinity") is None


def test_a_profile_offered_only_time_sliced_says_how_to_use_it():
    verdict = place([a100_time_sliced_mixed("a", rename=False)], gpu(migProfile="1g.10gb"))
    assert verdict.state == placement.UNSATISFIABLE
    assert "no node offers MIG 1g.10gb as an exclusive slice (there are time-sliced shares of it" in verdict.reason
