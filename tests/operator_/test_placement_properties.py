"""Properties of the GPU planner (``sluice.operator.placement``), checked with hypothesis over generated clusters.

Clusters mix GPU kinds (A30, A100-40GB, A100-80GB, H100, H200, T4, L4) and how they are handed out (whole,
MIG single and mixed strategies with random valid partitions and MIG-disabled GPUs, time-slicing with and
without ``renameByDefault``), with foreign pods holding some of it and cordoned nodes. Requests ask for whole
GPUs, a MIG profile, or memory with a compute share, time-sliced GPUs allowed or not.

1. Capacity: per node and resource, what the plan books plus what other pods hold never exceeds what the node
   advertises; nothing is booked on a node that is not schedulable; every GPU the plan names exists.
2. Fit: a placed request gets what it asked for on every device its shape may land on (memory, compute,
   profile); time-sliced shapes only when the request allows sharing; whole-GPU requests only whole GPUs.
3. Layouts: every partition the inventory infers and every partition the planner advises is one NVIDIA allows;
   advice changes only GPUs its replicas need, never a time-sliced node or a whole GPU in use.
4. Determinism: the same input, requests and nodes in any order, gives the same plan.
5. Stability: a request created later never moves one already placed, pinned or not.
6. Economy: the plan never touches more physical GPUs than one model replica per whole GPU would.

Examples are derandomized so a run is reproducible.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sluice.operator import gpus, inventory, placement

PROPERTIES = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

KINDS: dict[str, tuple[str, int]] = {
    "A30": ("NVIDIA-A30", 24576),
    "A100-40GB": ("NVIDIA-A100-SXM4-40GB", 40960),
    "A100-80GB": ("NVIDIA-A100-SXM4-80GB", 81920),
    "H100-80GB": ("NVIDIA-H100-80GB-HBM3", 81559),
    "H200-141GB": ("NVIDIA-H200", 143771),
    "T4": ("Tesla-T4", 15360),
    "L4": ("NVIDIA-L4", 23034),
}
"""Catalogue key -> (GFD product label, gpu.memory)."""
PROFILES = sorted({p.name for key in KINDS if (m := gpus.CATALOGUE_BY_KEY[key]).mig_capable for p in m.profiles})
MEMORY_MIB = (500, 4000, 4864, 5000, 9000, 9728, 12000, 15000, 20000, 23000, 30000, 40000, 41000, 70000, 81920,
              100000, 150000)


@dataclasses.dataclass(frozen=True)
class Cluster:
    nodes: tuple[dict[str, Any], ...]
    pods: tuple[dict[str, Any], ...]

    def inventory(self) -> inventory.Inventory:
        return inventory.from_nodes(self.nodes, self.pods)


@st.composite
def _layout(draw: st.DrawFn, model: gpus.GpuModel) -> gpus.Layout:
    """A random valid partition of one GPU: profiles drawn at random, each kept where it still fits."""
    layout: gpus.Layout = ()
    for name in draw(st.lists(st.sampled_from([p.name for p in model.profiles]), min_size=1, max_size=7)):
        layout = gpus.pack(model, [name], layout) or layout
    return layout


@st.composite
def _node(draw: st.DrawFn, index: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    key = draw(st.sampled_from(sorted(KINDS)))
    product, memory = KINDS[key]
    model = gpus.CATALOGUE_BY_KEY[key]
    count = draw(st.integers(1, 4))
    strategies = ["none", "shared"] + (["single", "mixed", "single-shared", "mixed-shared"] if model.mig_capable
                                       else [])
    strategy = draw(st.sampled_from(strategies))
    labels = {"nvidia.com/gpu.product": product, "nvidia.com/gpu.count": str(count),
              "nvidia.com/gpu.memory": str(memory)}
    allocatable: dict[str, int] = {}
    time_sliced: dict[str, tuple[int, int]] = {}
    if model.mig_capable:
        labels["nvidia.com/mig.capable"] = "true"
    if strategy == "none":
        allocatable[gpus.GPU_RESOURCE] = count
    elif strategy == "shared":
        replicas = draw(st.integers(2, 4))
        labels["nvidia.com/gpu.replicas"] = str(replicas)
        if draw(st.booleans()):  # renameByDefault
            allocatable[gpus.SHARED_GPU_RESOURCE] = count * replicas
            time_sliced[gpus.SHARED_GPU_RESOURCE] = (replicas, memory)
        else:
            labels["nvidia.com/gpu.product"] = product + "-SHARED"
            allocatable[gpus.GPU_RESOURCE] = count * replicas
            time_sliced[gpus.GPU_RESOURCE] = (replicas, memory)
    elif strategy in ("single", "single-shared"):
        profile = draw(st.sampled_from([p for p in model.profiles if not p.media]))
        total = count * gpus.max_instances(model, profile.name)
        labels.update({"nvidia.com/gpu.product": f"{product}-MIG-{profile.name}", "nvidia.com/gpu.count": str(total),
                       "nvidia.com/gpu.memory": str(profile.memory_mib), "nvidia.com/mig.strategy": "single"})
        resource, replicas = gpus.GPU_RESOURCE, 1
        if strategy == "single-shared":  # each MIG device time-sliced, as GFD labels it
            replicas = draw(st.integers(2, 4))
            labels["nvidia.com/gpu.replicas"] = str(replicas)
            if draw(st.booleans()):
                resource = gpus.SHARED_GPU_RESOURCE
            else:
                labels["nvidia.com/gpu.product"] += "-SHARED"
            time_sliced[resource] = (replicas, profile.memory_mib)
        allocatable[resource] = total * replicas
    else:
        labels["nvidia.com/mig.strategy"] = "mixed"
        partitioned = draw(st.integers(1, count))
        allocatable[gpus.GPU_RESOURCE] = count - partitioned
        slices: dict[str, int] = {}
        for _ in range(partitioned):
            for name, _start in draw(_layout(model)):
                slices[name] = slices.get(name, 0) + 1
        for name, amount in sorted(slices.items()):
            resource, replicas = gpus.resource_name(name), 1
            memory_mib = gpus.CATALOGUE_BY_KEY[key].profile(name).memory_mib  # type: ignore[union-attr]
            labels.update({gpus.mig_label(name, "count"): str(amount), gpus.mig_label(name, "memory"): str(memory_mib),
                           gpus.mig_label(name, "product"): f"{product}-MIG-{name}"})
            if strategy == "mixed-shared" and draw(st.booleans()):  # this MIG type time-sliced
                replicas = draw(st.integers(2, 4))
                labels[gpus.mig_label(name, "replicas")] = str(replicas)
                if draw(st.booleans()):
                    resource += ".shared"
                else:
                    labels[gpus.mig_label(name, "product")] += "-SHARED"
                time_sliced[resource] = (replicas, memory_mib)
            allocatable[resource] = amount * replicas
    name = f"node-{index}"
    node = {
        # what the generator made time-sliced (resource -> replicas, memory of the device shared): the
        # ground truth the properties check the inventory's reading against
        "time_sliced": time_sliced,
        "metadata": {"name": name, "labels": labels},
        "spec": {"unschedulable": draw(st.integers(0, 9)) == 0},
        "status": {"allocatable": {"cpu": "64", **{k: str(v) for k, v in allocatable.items()}}},
    }
    pods: list[dict[str, Any]] = []
    for resource, amount in sorted(allocatable.items()):
        held = draw(st.integers(0, amount))
        if held:
            phase = draw(st.sampled_from(["Running", "Running", "Pending", "Succeeded"]))
            pods.append({"metadata": {"name": f"{name}-{len(pods)}"},
                         "spec": {"nodeName": name, "containers": [{"resources": {"limits": {resource: str(held)}}}]},
                         "status": {"phase": phase}})
    return node, pods


@st.composite
def clusters(draw: st.DrawFn) -> Cluster:
    nodes: list[dict[str, Any]] = []
    pods: list[dict[str, Any]] = []
    for index in range(draw(st.integers(1, 6))):
        node, held = draw(_node(index))
        nodes.append(node)
        pods.extend(held)
    return Cluster(tuple(nodes), tuple(pods))


def _created(tick: int) -> str:
    return f"2026-01-01T00:{tick // 60:02d}:{tick % 60:02d}Z"


@st.composite
def _request(draw: st.DrawFn, index: int) -> placement.Request:
    key = f"InferenceModel/models/m{index:02d}"
    replicas = draw(st.integers(0, 4))
    created = _created(draw(st.integers(0, 20)))
    how = draw(st.sampled_from(["whole", "profile", "memory", "memory"]))
    if how == "whole":
        return placement.Request(key, replicas, count=draw(st.integers(1, 3)),
                                 memory_mib=draw(st.sampled_from((0, 0, 16000, 40000, 80000))), created=created)
    if how == "profile":
        return placement.Request(key, replicas, profile=draw(st.sampled_from(PROFILES)), created=created)
    return placement.Request(key, replicas, memory_mib=draw(st.sampled_from(MEMORY_MIB)),
                             compute_percent=draw(st.sampled_from((0, 0, 10, 14, 15, 25, 30, 50, 100))),
                             shared=draw(st.booleans()), created=created)


@st.composite
def request_lists(draw: st.DrawFn) -> list[placement.Request]:
    return [draw(_request(i)) for i in range(draw(st.integers(1, 8)))]


# Helpers reading the generated objects themselves, not the inventory, where they can.


def _allocatable(cluster: Cluster) -> dict[tuple[str, str], int]:
    return {(str(n["metadata"]["name"]), resource): int(amount)
            for n in cluster.nodes for resource, amount in n["status"]["allocatable"].items()}


def _held(cluster: Cluster) -> dict[tuple[str, str], int]:
    held: dict[tuple[str, str], int] = {}
    for pod in cluster.pods:
        if pod["status"]["phase"] in ("Succeeded", "Failed"):
            continue
        for container in pod["spec"]["containers"]:
            for resource, amount in container["resources"]["limits"].items():
                where = (pod["spec"]["nodeName"], resource)
                held[where] = held.get(where, 0) + int(amount)
    return held


def _booked(result: placement.Plan) -> dict[tuple[str, str], int]:
    booked: dict[tuple[str, str], int] = {}
    for verdict in result.verdicts.values():
        if verdict.shape is None:
            continue
        for node in verdict.nodes:
            where = (node, verdict.shape.resource)
            booked[where] = booked.get(where, 0) + verdict.shape.count
    return booked


def _devices_of_shape(inv: inventory.Inventory, shape: placement.Shape) -> list[inventory.Device]:
    """Every device a pod of ``shape`` may be given: the scheduler picks among them, not the plan."""
    found = []
    for node in inv.nodes:
        for device in node.devices:
            resource = ("mig" if device.profile else "gpu") if device.kind == inventory.DRA else device.resource
            if (device.kind, resource, device.profile) != (shape.kind, shape.resource, shape.profile):
                continue
            if not shape.products or device.product in shape.products:
                found.append(device)
    return found


def _pinned(requests: Sequence[placement.Request], result: placement.Plan) -> list[placement.Request]:
    """The requests as the reconciler passes them next time: placed ones pinned to their shape."""
    pinned = []
    for request in requests:
        verdict = result.verdicts[request.key]
        if verdict.state == placement.PLACED and verdict.shape is not None:
            request = dataclasses.replace(request, pinned=verdict.shape, pinned_for=request.signature())
        pinned.append(request)
    return pinned


def _later(requests: Sequence[placement.Request], template: placement.Request) -> placement.Request:
    last = max((r.created for r in requests), default=_created(0))
    tick = int(last[-6:-4]) * 60 + int(last[-3:-1]) + 1
    return dataclasses.replace(template, key="InferenceModel/models/zz-new", created=_created(tick))


def _fixed_node(name: str, labels: dict[str, str], allocatable: dict[str, int]) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels}, "spec": {},
            "status": {"allocatable": {k: str(v) for k, v in allocatable.items()}}}


def _renamed_l4(name: str, replicas: int) -> dict[str, Any]:
    labels = {"nvidia.com/gpu.product": "NVIDIA-L4", "nvidia.com/gpu.count": "1", "nvidia.com/gpu.memory": "23034",
              "nvidia.com/gpu.replicas": str(replicas)}
    return _fixed_node(name, labels, {gpus.SHARED_GPU_RESOURCE: replicas})


# Regressions, kept as explicit examples: the first found by hypothesis, the other two in review.
TIME_SLICED_ONE_PRODUCT_TWO_REPLICA_COUNTS = (
    # Two time-sliced L4 nodes, 4 and 2 replicas: a 50 % compute share fits only the second, but the shape
    # named the product NVIDIA-L4 (both nodes) because the planner kept one compute share per device class.
    Cluster((_renamed_l4("node-0", 4), _renamed_l4("node-1", 2)), ()),
    [placement.Request("InferenceModel/models/m00", 1, memory_mib=500, compute_percent=50, shared=True,
                       created=_created(0))],
)

ONE_4G_ON_FOUR_ALL_BALANCED_GPUS = (
    # Advice for one 4g.40gb wiped the free slices of all four GPUs and disrupted each of them.
    Cluster((_fixed_node("node-0", {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.count": "4",
                                    "nvidia.com/mig.strategy": "mixed"},
                         {"nvidia.com/mig-1g.10gb": 8, "nvidia.com/mig-2g.20gb": 4, "nvidia.com/mig-3g.40gb": 4}),),
            ()),
    [placement.Request("InferenceModel/models/m00", 1, profile="4g.40gb", created=_created(0))],
)

TIME_SLICED_A100_IN_USE = (
    # A time-sliced A100 with a replica in use was advised to be partitioned for a MIG request.
    Cluster((_fixed_node("node-0", {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB-SHARED",
                                    "nvidia.com/gpu.count": "1", "nvidia.com/gpu.replicas": "2",
                                    "nvidia.com/mig.capable": "true"},
                         {"nvidia.com/gpu": 2}),),
            ({"metadata": {"name": "user"}, "status": {"phase": "Running"},
              "spec": {"nodeName": "node-0", "containers": [{"resources": {"limits": {"nvidia.com/gpu": "1"}}}]}},)),
    [placement.Request("InferenceModel/models/m00", 1, profile="1g.5gb", created=_created(0))],
)


# The properties.


@PROPERTIES
@given(clusters(), request_lists())
def test_never_over_commits_a_node(cluster, requests):
    inv = cluster.inventory()
    result = placement.plan(inv, requests)
    allocatable, held = _allocatable(cluster), _held(cluster)
    for (node, resource), booked in _booked(result).items():
        assert inv.node(node) is not None, f"booked on {node}, which is not schedulable"
        assert booked + held.get((node, resource), 0) <= allocatable.get((node, resource), 0), (node, resource)
    for verdict in result.verdicts.values():
        assert verdict.booked == len(verdict.nodes)
        if verdict.state == placement.PLACED:
            assert verdict.booked == next(r.replicas for r in requests if r.key == verdict.key)
    for node_name, index in result.gpus:
        node = inv.node(node_name)
        assert node is not None and 0 <= index < node.gpus, (node_name, index)


@PROPERTIES
@given(clusters(), request_lists())
@example(*TIME_SLICED_ONE_PRODUCT_TWO_REPLICA_COUNTS)
def test_placed_requests_get_what_they_asked_for(cluster, requests):
    inv = cluster.inventory()
    result = placement.plan(inv, requests)
    for request in requests:
        verdict = result.verdicts[request.key]
        if verdict.state != placement.PLACED or verdict.shape is None:
            continue
        shape = verdict.shape
        devices = _devices_of_shape(inv, shape)
        assert devices, shape
        assert shape.memory_mib >= request.memory_mib
        assert all(d.memory_mib >= request.memory_mib for d in devices), (request, shape)
        assert shape.memory_mib <= min(d.memory_mib for d in devices)
        if shape.kind == inventory.SHARED:
            assert request.shared and not request.count and not request.profile
        if request.count:
            assert shape.kind in (inventory.WHOLE, inventory.DRA) and not shape.profile
            assert shape.count == request.count
        elif request.profile:
            assert shape.profile == request.profile and shape.count == 1
        else:
            assert shape.count == 1
            assert all(d.compute * 100 + 1e-6 >= request.compute_percent for d in devices), (request, shape)


def _matches(labels: dict[str, str], affinity: dict[str, Any] | None) -> bool:
    """Whether a node with ``labels`` passes a rendered required node affinity (In and NotIn, as rendered)."""
    if not affinity:
        return True
    terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    for term in terms:
        ok = True
        for expression in term["matchExpressions"]:
            value = labels.get(expression["key"])
            if expression["operator"] == "In":
                ok = ok and value in expression["values"]
            elif expression["operator"] == "NotIn":
                ok = ok and value not in expression["values"]
            else:
                raise AssertionError(f"unexpected operator {expression}")
        if ok:
            return True
    return False


CORDONED_TIME_SLICED_NODE = (
    # Found in review: the exclusive slice's avoid list was made from schedulable nodes only, so a cordoned
    # time-sliced node (the scheduler's again once uncordoned) was not avoided.
    Cluster((_fixed_node("node-0", {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.count": "1",
                                    "nvidia.com/mig.strategy": "mixed"}, {"nvidia.com/mig-1g.10gb": 2}),
             {**_fixed_node("node-1", {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.count": "1",
                                       "nvidia.com/mig.strategy": "mixed", "nvidia.com/mig-1g.10gb.replicas": "2",
                                       "nvidia.com/mig-1g.10gb.product": "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb-SHARED"},
                            {"nvidia.com/mig-1g.10gb": 14}),
              "spec": {"unschedulable": True},
              "time_sliced": {"nvidia.com/mig-1g.10gb": (2, 9728)}}),
            ()),
    [placement.Request("InferenceModel/models/m00", 1, profile="1g.10gb", created=_created(0))],
)


@PROPERTIES
@given(clusters(), request_lists())
@example(*CORDONED_TIME_SLICED_NODE)
def test_a_pod_lands_on_a_time_sliced_device_only_when_its_model_allows_sharing(cluster, requests):
    """Judged on the generated nodes themselves (what was made time-sliced), through the pod spec the
    operator renders: a node the pod's resource and affinity admit it to, the scheduler may pick."""
    from sluice.operator import api, builders

    result = placement.plan(cluster.inventory(), requests)
    for request in requests:
        verdict = result.verdicts[request.key]
        if verdict.state != placement.PLACED or verdict.shape is None or verdict.shape.kind == inventory.DRA:
            continue
        rendering = builders.gpu_rendering([api.Gpu(count=1)], verdict.shape)
        [(resource, _)] = rendering.limits.items()
        for node in cluster.nodes:
            if int(node["status"]["allocatable"].get(resource, 0)) == 0 or \
                    not _matches(node["metadata"]["labels"], rendering.affinity):
                continue
            sliced = node.get("time_sliced", {}).get(resource)
            if sliced is None:
                continue
            # the pod may be given one replica of a time-sliced device there
            replicas, memory_mib = sliced
            where = (request.key, node["metadata"]["name"], resource)
            assert request.shared and not request.profile and not request.count, where
            assert memory_mib // replicas >= request.memory_mib, where


@PROPERTIES
@given(clusters(), request_lists())
@example(*ONE_4G_ON_FOUR_ALL_BALANCED_GPUS)
@example(*TIME_SLICED_A100_IN_USE)
def test_inferred_and_advised_layouts_are_valid(cluster, requests):
    inv = cluster.inventory()
    for node in inv.nodes:
        model = gpus.CATALOGUE_BY_KEY.get(node.model)
        for layout in node.layouts:
            assert model is not None and gpus.valid_layout(model, layout), (node.name, layout)
        assert all(0 <= d.gpu < node.gpus for d in node.devices), node.name
    result = placement.plan(inv, requests)
    for advice in result.advice:
        node = inv.node(advice.node)
        assert node is not None
        model = gpus.CATALOGUE_BY_KEY[node.model]
        assert len(advice.layouts) == node.gpus
        for layout in advice.layouts:
            assert gpus.valid_layout(model, layout), (advice.node, layout)
            compute, memory = gpus.used_slices(model, layout)
            assert compute <= model.compute_slices and memory <= model.memory_slices
        assert set(advice.serves) <= {r.key for r in requests}
        # Only GPUs a replica needs change, and those listed as disrupted are exactly the ones that do.
        current = [node.layouts[i] if i < len(node.layouts) else () for i in range(node.gpus)]
        assert advice.disrupts == tuple(i for i in range(node.gpus) if advice.layouts[i] != current[i])
        missing = sum(r.replicas - result.verdicts[r.key].booked for r in requests if r.key in advice.serves)
        assert len(advice.disrupts) <= missing
        # Time-sliced nodes are never partitioned, nor a GPU handed out whole that is in use.
        assert not any(d.kind == inventory.SHARED for d in node.devices), advice.node
        for i in advice.disrupts:
            in_use = [d for j, d in enumerate(node.devices) if d.gpu == i and d.kind != inventory.MIXED
                      and (j not in node.free or (node.name, i) in result.gpus)]
            assert not in_use, (advice.node, i)


@PROPERTIES
@given(clusters(), request_lists(), st.randoms(use_true_random=False))
def test_deterministic_in_any_order(cluster, requests, rng):
    inv = cluster.inventory()
    first = placement.plan(inv, requests)
    assert placement.plan(inv, requests) == first
    shuffled = list(requests)
    rng.shuffle(shuffled)
    assert placement.plan(inv, shuffled) == first
    nodes, pods = list(cluster.nodes), list(cluster.pods)
    rng.shuffle(nodes)
    rng.shuffle(pods)
    assert placement.plan(inventory.from_nodes(nodes, pods), shuffled) == first


@PROPERTIES
@given(clusters(), request_lists(), _request(99))
def test_a_later_request_never_moves_a_placed_one(cluster, requests, template):
    inv = cluster.inventory()
    before = placement.plan(inv, requests)
    new = _later(requests, template)
    after = placement.plan(inv, [*requests, new])
    kept = placement.plan(inv, [*_pinned(requests, before), new])
    for key, verdict in before.verdicts.items():
        if verdict.state != placement.PLACED:
            continue
        for again in (after.verdicts[key], kept.verdicts[key]):
            assert (again.state, again.shape) == (verdict.state, verdict.shape), key
    # Pinned and re-planned alone, nothing changes either.
    for key, verdict in placement.plan(inv, _pinned(requests, before)).verdicts.items():
        if before.verdicts[key].state == placement.PLACED:
            assert (verdict.state, verdict.shape) == (placement.PLACED, before.verdicts[key].shape)


@PROPERTIES
@given(clusters(), request_lists())
def test_never_more_gpus_than_one_replica_per_whole_gpu(cluster, requests):
    result = placement.plan(cluster.inventory(), requests)
    count = {r.key: max(r.count, 1) for r in requests}
    # The naive placement of what the plan booked: one whole GPU per replica and GPU asked for. For placed
    # requests that is replicas x count; a pending request's replicas that fit now book devices too.
    naive = sum(v.booked * count[v.key] for v in result.verdicts.values())
    placed = sum(r.replicas * count[r.key] for r in requests if result.verdicts[r.key].state == placement.PLACED)
    assert len(result.gpus) <= naive
    if all(v.state == placement.PLACED for v in result.verdicts.values()):
        assert naive == placed


def test_properties_run_on_varied_clusters():
    """The generators reach every strategy and GPU kind (a guard against a strategy that stopped drawing)."""
    seen: set[tuple[str, str]] = set()

    @settings(PROPERTIES, max_examples=300)
    @given(clusters())
    def collect(cluster: Cluster) -> None:
        for node in cluster.inventory().nodes:
            seen.add((node.model, node.strategy))
            seen.add(("kind", next((d.kind for d in node.devices), "")))

    collect()
    assert {kind for model, kind in seen if model == "kind"} >= {"whole", "single", "mixed", "shared"}
    assert {model for model, _ in seen} >= set(KINDS)


@pytest.mark.parametrize("count", [0, -1])
def test_a_hand_edited_pin_with_no_devices_is_no_pin(count):
    """status.placement.count below 1 (edited by hand; the schema says minimum 1) must not crash the
    planner for every GPU model (a division by zero) or book devices for another model."""
    from sluice.operator import api, inventory, placement, reconcile

    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "a", "labels": {
        "nvidia.com/gpu.product": "NVIDIA-L4", "nvidia.com/gpu.count": "2"}},
        "spec": {}, "status": {"allocatable": {"nvidia.com/gpu": "2"},
                               "conditions": [{"type": "Ready", "status": "True"}]}}
    found = inventory.from_nodes([node])
    status = {"placement": {"state": "Placed", "held": True, "need": "gpus=1", "kind": "whole",
                            "resource": "nvidia.com/gpu", "count": count, "products": ["NVIDIA-L4"]}}
    meta = {"namespace": "d", "name": "bad", "creationTimestamp": "1"}
    bad = reconcile._request("InferenceModel", meta, status, api.Gpu(count=1), 1, False)
    assert bad.pinned is None
    mine = placement.Request(key="InferenceModel/d/mine", replicas=1, count=1, created="2")
    result = placement.plan(found, [bad, mine])
    assert all(v.state == placement.PLACED for v in result.verdicts.values())


def test_no_mig_advice_for_a_node_under_the_single_strategy():
    """Under mig.strategy=single every GPU of a node must have one profile (GFD labels a node with two
    -MIG-INVALID, and it then offers nothing): a layout grown GPU by GPU is never advised there."""
    from sluice.operator import inventory, placement

    labels = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", "nvidia.com/gpu.count": "14",
              "nvidia.com/gpu.memory": "4864", "nvidia.com/mig.capable": "true", "nvidia.com/mig.strategy": "single",
              "nvidia.com/mig.config": "all-1g.5gb"}
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "a100-single", "labels": labels}, "spec": {},
            "status": {"allocatable": {"nvidia.com/gpu": "14"}, "conditions": [{"type": "Ready", "status": "True"}]}}
    request = placement.Request(key="InferenceModel/d/big", replicas=1, profile="3g.20gb")
    result = placement.plan(inventory.from_nodes([node]), [request])
    assert result.verdicts[request.key].state != placement.PLACED
    assert result.advice == ()


async def test_the_gpus_of_a_model_whose_spec_turned_invalid_stay_held():
    """An InvalidSpec keeps the model's Deployment and pods running: the GPUs they hold are not free
    for another model (they were, while the plan skipped its pods as its own and then dropped its request)."""
    import datetime

    from sluice.operator import api, builders, placement, reconcile
    from sluice.operator.settings import Settings

    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "l4", "labels": {
        "nvidia.com/gpu.product": "NVIDIA-L4", "nvidia.com/gpu.count": "2", "nvidia.com/gpu.memory": "23034"}},
        "spec": {}, "status": {"allocatable": {"nvidia.com/gpu": "2"},
                               "conditions": [{"type": "Ready", "status": "True"}]}}
    labels = {"app.kubernetes.io/managed-by": builders.MANAGED_BY, "sluice.dev/inferencemodel": "old"}
    pods = [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"old-{i}", "namespace": "d", "labels": labels},
             "spec": {"nodeName": "l4", "containers": [{"name": "runtime",
                                                         "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
             "status": {"phase": "Running"}} for i in range(2)]

    def model(name: str, count: int, **extra: object) -> dict:
        spec = {"model": {"storageUri": f"s3://m/{name}", "format": "onnx"}, "resources": {"gpu": {"count": count}},
                **extra}
        return {"apiVersion": "sluice.dev/v1alpha1", "kind": "InferenceModel",
                "metadata": {"name": name, "namespace": "d", "creationTimestamp": "2024-01-01T00:00:00Z"},
                "spec": spec, "status": {}}

    old = model("old", 2, runtime={"maxBatchSize": "x"})  # InvalidSpec now; its two pods still run
    new = model("new", 1)

    class Kube:
        async def list(self, kind: str, namespace: str) -> list:
            return {"Node": [node], "Pod": pods, "InferenceModel": [old, new]}.get(kind, [])

        async def get(self, *args: object) -> None:
            return None

    reconciler = reconcile.Reconciler(kube=Kube(), settings=Settings(),  # type: ignore[arg-type]
                                      clock=lambda: datetime.datetime.now(datetime.UTC), events=lambda *a, **k: None)
    owner = builders.Owner(kind="InferenceModel", namespace="d", name="new", uid="u")
    placed = await reconciler._place(owner, new, api.Gpu(count=1), 1, False)
    assert placed.verdict.state == placement.PENDING and "0 free of 2" in placed.verdict.reason


async def test_dra_a_models_own_claims_made_from_its_template_are_its_own():
    """Kubernetes makes each pod's ResourceClaim from the template's spec (labels from spec.metadata).
    Those claims must read as the model's own: without labels they counted as another workload's, so a
    running DRA model saw its slice as taken (Pending, CapacityFull, devices booked twice)."""
    import datetime

    from sluice.operator import api, builders, placement, reconcile
    from sluice.operator.settings import Settings

    settings = Settings(gpu_allocation="dra")
    spec = {"model": {"storageUri": "s3://b/m", "format": "onnx"}, "resources": {"gpu": {"migProfile": "1g.10gb"}}}
    body = {"apiVersion": "sluice.dev/v1alpha1", "kind": "InferenceModel",
            "metadata": {"name": "m", "namespace": "models", "uid": "u1", "generation": 1,
                         "creationTimestamp": "2026-01-01T00:00:00Z"}, "spec": spec, "status": {}}
    device = {"name": "gpu-0-mig-19-0-1", "attributes": {"type": {"string": "mig"}, "profile": {"string": "1g.10gb"},
              "productName": {"string": "NVIDIA A100-SXM4-80GB"}}, "capacity": {"memory": {"value": "9728Mi"}}}
    slices = [{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "n1-gpu"},
               "spec": {"driver": "gpu.nvidia.com", "nodeName": "n1",
                        "pool": {"name": "n1", "generation": 1, "resourceSliceCount": 1}, "devices": [device]}}]
    claims: list[dict] = []

    class Kube:
        async def list(self, kind: str, namespace: str) -> list:
            return {"InferenceModel": [body], "ResourceSlice": slices, "ResourceClaim": claims}.get(kind, [])

        async def get(self, *args: object) -> None:
            return None

    reconciler = reconcile.Reconciler(kube=Kube(), settings=settings,  # type: ignore[arg-type]
                                      clock=lambda: datetime.datetime(2026, 1, 2, tzinfo=datetime.UTC),
                                      events=lambda *a, **k: None)
    owner = reconcile._owner(body)
    model = api.parse_inference_model("m", spec)
    placed = await reconciler._place(owner, body, model.resources.gpu, 1, False)
    assert placed.verdict.state == placement.PLACED
    body["status"] = {"placement": reconcile._placement_status(placed, body), "replicas": 1}
    desired = builders.inference_model(owner, model, settings, shape=placed.verdict.shape)
    [template] = [o for o in desired.objects if o["kind"] == "ResourceClaimTemplate"]
    [deployment] = [o for o in desired.objects if o["kind"] == "Deployment"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
        deployment["spec"]["template"]["spec"]["tolerations"]  # DRA pods land on the same tainted GPU nodes
    claims.append({  # what the resource-claim controller makes for the model's pod, once allocated
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "m-7d9f-abcde-gpu-x2k4", "namespace": "models",
                     "labels": dict((template["spec"].get("metadata") or {}).get("labels") or {}),
                     "ownerReferences": [{"kind": "Pod", "name": "m-7d9f-abcde", "apiVersion": "v1", "uid": "p"}]},
        "spec": template["spec"]["spec"],
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "n1", "device": device["name"]}]}}}})
    reconciler._gpu_view = None  # read the cluster again
    placed = await reconciler._place(owner, body, model.resources.gpu, 1, False)
    assert placed.verdict.state == placement.PLACED, placed.verdict.reason


def test_a_gpu_node_without_feature_discovery_labels_gets_pods_that_fit_it():
    """GKE's own device plugin advertises nvidia.com/gpu without GPU feature discovery's labels: a
    whole GPU placed there must not be pinned to nvidia.com/gpu.product In [""], which no node matches
    (it was Placed, and its pods Pending for ever)."""
    from sluice.operator import api, builders
    from sluice.operator.settings import Settings
    from sluice_testing import scheduler

    gke = {"apiVersion": "v1", "kind": "Node",
           "metadata": {"name": "gke-l4", "labels": {"cloud.google.com/gke-accelerator": "nvidia-l4"}},
           "spec": {}, "status": {"allocatable": {"cpu": "32", "memory": "128Gi", "nvidia.com/gpu": "1", "pods": "110"},
                                  "conditions": [{"type": "Ready", "status": "True"}]}}
    request = placement.Request(key="InferenceModel/x/m", replicas=1, count=1)
    verdict = placement.plan(inventory.from_nodes([gke]), [request]).verdicts[request.key]
    assert verdict.state == placement.PLACED and verdict.shape is not None
    spec = api.parse_inference_model("m", {"model": {"storageUri": "s3://b/m", "format": "onnx"},
                                           "resources": {"gpu": {"count": 1}}})
    owner = builders.Owner(kind="InferenceModel", name="m", namespace="x", uid="u")
    [deployment] = [o for o in builders.inference_model(owner, spec, Settings(), shape=verdict.shape).objects
                    if o["kind"] == "Deployment"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "m-1", "namespace": "x"},
           "spec": deployment["spec"]["template"]["spec"]}
    assert scheduler.schedule(pod, [gke], []).node == "gke-l4"


def _gpu_node(name: str, labels: dict, allocatable: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}, "spec": {},
            "status": {"allocatable": {"cpu": "32", **allocatable},
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def test_nothing_fits_counts_what_others_left_free_not_the_requests_own_booking():
    a100 = _gpu_node("a100-0", {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.count": "2",
                                "nvidia.com/mig.strategy": "mixed"},
                     {"nvidia.com/mig-1g.10gb": "4", "nvidia.com/mig-2g.20gb": "2", "nvidia.com/mig-3g.40gb": "2"})
    request = placement.Request(key="InferenceModel/x/m", replicas=3, profile="2g.20gb")
    verdict = placement.plan(inventory.from_nodes([a100]), [request]).verdicts[request.key]
    assert verdict.state == placement.UNSATISFIABLE
    assert "MIG 2g.20gb (mixed strategy): 2 free of 2" in verdict.reason  # it said 0 free: its own two booked


@pytest.mark.parametrize("strategy", ["none", None])
def test_no_repartition_advice_for_nodes_whose_device_plugin_advertises_no_slices(strategy):
    """Under MIG strategy none (or no strategy label) the device plugin advertises nvidia.com/gpu and never
    nvidia.com/mig-*: repartitioning such a node (drained for it) would not serve the model."""
    labels = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.count": "8",
              "nvidia.com/gpu.memory": "81559", "nvidia.com/mig.capable": "true",
              **({"nvidia.com/mig.strategy": strategy} if strategy else {})}
    request = placement.Request(key="InferenceModel/x/m", replicas=1, profile="1g.10gb")
    result = placement.plan(inventory.from_nodes([_gpu_node("h100-w", labels, {"nvidia.com/gpu": "8"})]), [request])
    assert result.verdicts[request.key].state != placement.PLACED
    assert result.advice == ()
    mixed = {**labels, "nvidia.com/mig.strategy": "mixed"}
    assert placement.plan(inventory.from_nodes([_gpu_node("h100-w", mixed, {"nvidia.com/gpu": "8"})]),
                          [request]).advice  # a mixed node is advised
