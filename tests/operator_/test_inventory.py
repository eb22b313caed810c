"""The GPU inventory (``sluice.operator.inventory``) from Node, Pod, ResourceSlice and ResourceClaim objects as
NVIDIA's components publish them: GPU feature discovery's labels, the device plugin's allocatable resources
(mixed and single MIG strategies, time-slicing with and without ``renameByDefault``) and the DRA driver's
``resource.k8s.io/v1`` ResourceSlices."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.operator import gpus, inventory

A100_80 = "NVIDIA-A100-SXM4-80GB"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def _node(name: str, labels: dict[str, str], allocatable: dict[str, str], *, unschedulable: bool = False,
          ready: str | None = "True", taints: tuple[dict[str, str], ...] = ()) -> dict[str, Any]:
    status: dict[str, Any] = {"allocatable": {"cpu": "96", "memory": "1000Gi", "pods": "110", **allocatable}}
    if ready is not None:
        status["conditions"] = [{"type": "MemoryPressure", "status": "False"}, {"type": "Ready", "status": ready}]
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels},
            "spec": {"unschedulable": unschedulable, "taints": list(taints)}, "status": status}


def _mixed_all_balanced(name: str = "a100-mixed", gpus_: int = 8) -> dict[str, Any]:
    """8 x A100-80GB under the mixed strategy, MIG manager's all-balanced on every GPU."""
    labels = {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": A100_80,
        "nvidia.com/gpu.count": str(gpus_),
        "nvidia.com/gpu.memory": "81920",
        "nvidia.com/gpu.family": "ampere",
        "nvidia.com/mig.capable": "true",
        "nvidia.com/mig.strategy": "mixed",
        "nvidia.com/mig.config": "all-balanced",
        "nvidia.com/mig.config.state": "success",
        "nvidia.com/mig-1g.10gb.count": str(2 * gpus_),
        "nvidia.com/mig-1g.10gb.memory": "9728",
        "nvidia.com/mig-2g.20gb.count": str(gpus_),
        "nvidia.com/mig-2g.20gb.memory": "19968",
        "nvidia.com/mig-3g.40gb.count": str(gpus_),
        "nvidia.com/mig-3g.40gb.memory": "40192",
        "cloud.google.com/gke-nodepool": "a100-pool",
    }
    allocatable = {"nvidia.com/gpu": "0", "nvidia.com/mig-1g.10gb": str(2 * gpus_),
                   "nvidia.com/mig-2g.20gb": str(gpus_), "nvidia.com/mig-3g.40gb": str(gpus_)}
    return _node(name, labels, allocatable, taints=(GPU_TAINT, {"key": "other", "effect": "NoSchedule"}))


def _single(name: str = "a100-single") -> dict[str, Any]:
    """8 x A100-40GB under the single strategy, all-1g.5gb: gpu.count and gpu.memory describe the MIG devices."""
    labels = {
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb",
        "nvidia.com/gpu.count": "56",
        "nvidia.com/gpu.memory": "4864",
        "nvidia.com/gpu.slices.gi": "1",
        "nvidia.com/gpu.slices.ci": "1",
        "nvidia.com/mig.capable": "true",
        "nvidia.com/mig.strategy": "single",
        "nvidia.com/mig.config": "all-1g.5gb",
        "eks.amazonaws.com/nodegroup": "single-pool",
    }
    return _node(name, labels, {"nvidia.com/gpu": "56"})


def _time_sliced(name: str = "t4-shared") -> dict[str, Any]:
    """One T4, four time-slicing replicas, renameByDefault off: GFD appends -SHARED to the product."""
    labels = {"nvidia.com/gpu.product": "Tesla-T4-SHARED", "nvidia.com/gpu.count": "1",
              "nvidia.com/gpu.replicas": "4", "nvidia.com/gpu.memory": "15360", "nvidia.com/gpu.sharing-strategy":
              "time-slicing"}
    return _node(name, labels, {"nvidia.com/gpu": "4"})


def _renamed(name: str = "l4-shared") -> dict[str, Any]:
    """Two L4s, four replicas each, renameByDefault on: advertised as nvidia.com/gpu.shared."""
    labels = {"nvidia.com/gpu.product": "NVIDIA-L4", "nvidia.com/gpu.count": "2", "nvidia.com/gpu.replicas": "4",
              "nvidia.com/gpu.memory": "23034"}
    return _node(name, labels, {"nvidia.com/gpu.shared": "8"})


def _whole(name: str = "h200-whole", count: int = 8, product: str = "NVIDIA-H200", memory: int = 143771,
           **kwargs: Any) -> dict[str, Any]:
    labels = {"nvidia.com/gpu.product": product, "nvidia.com/gpu.count": str(count),
              "nvidia.com/gpu.memory": str(memory), "nvidia.com/mig.capable": "true"}
    return _node(name, labels, {"nvidia.com/gpu": str(count)}, **kwargs)


def _pod(node: str | None, resources: dict[str, str], *, phase: str = "Running", name: str = "p",
         init: dict[str, str] | None = None, sidecar: dict[str, str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "main", "resources": {"limits": resources,
                                                                          "requests": resources}}]}
    if node is not None:
        spec["nodeName"] = node
    inits = []
    if init is not None:
        inits.append({"name": "init", "resources": {"limits": init}})
    if sidecar is not None:
        inits.append({"name": "sidecar", "restartPolicy": "Always", "resources": {"limits": sidecar}})
    if inits:
        spec["initContainers"] = inits
    return {"metadata": {"name": name, "namespace": "models", "labels": {"app": name}}, "spec": spec,
            "status": {"phase": phase}}


def _free(node: inventory.Node) -> list[inventory.Device]:
    return [node.devices[i] for i in sorted(node.free)]


def _check_consistent(node: inventory.Node) -> None:
    """What every node must satisfy: devices on its GPUs, layouts valid, free devices among its devices."""
    assert all(0 <= d.gpu < node.gpus for d in node.devices), node
    assert node.free <= frozenset(range(len(node.devices)))
    model = gpus.CATALOGUE_BY_KEY.get(node.model)
    if node.layouts:
        assert model is not None and len(node.layouts) == node.gpus
        assert all(gpus.valid_layout(model, layout) for layout in node.layouts)


def test_mixed_strategy_all_balanced_on_eight_gpus():
    inv = inventory.from_nodes([_mixed_all_balanced()])
    (node,) = inv.nodes
    _check_consistent(node)
    assert (node.name, node.pool, node.model, node.strategy, node.gpus) == (
        "a100-mixed", "a100-pool", "A100-80GB", "mixed", 8)
    assert node.mig_capable and (node.mig_config, node.mig_state) == ("all-balanced", "success")
    balanced = (("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3), ("3g.40gb", 4))
    assert node.layouts == (balanced,) * 8
    assert len(node.devices) == 32 and len(node.free) == 32
    for index in range(8):
        on_gpu = sorted(d.profile for d in node.devices if d.gpu == index)
        assert on_gpu == ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]
    small = next(d for d in node.devices if d.profile == "1g.10gb")
    assert (small.kind, small.resource, small.memory_mib, small.product) == (
        "mixed", "nvidia.com/mig-1g.10gb", 9728, A100_80)  # the node's mig-1g.10gb.memory label wins
    assert small.compute == pytest.approx(1 / 7)
    assert node.taints == (GPU_TAINT,)  # only nvidia.com/* taints, which GPU pods tolerate


def test_mixed_strategy_without_memory_labels_uses_the_catalogue():
    obj = _mixed_all_balanced(gpus_=1)
    for key in [k for k in obj["metadata"]["labels"] if k.endswith(".memory")]:
        del obj["metadata"]["labels"][key]
    (node,) = inventory.from_nodes([obj]).nodes
    memory = {d.profile: d.memory_mib for d in node.devices}
    model = gpus.CATALOGUE_BY_KEY["A100-80GB"]
    assert memory == {p.name: p.memory_mib for p in model.profiles if p.name in ("1g.10gb", "2g.20gb", "3g.40gb")}
    assert node.memory_mib == 81920


def test_mixed_strategy_with_a_gpu_left_whole():
    """MIG enabled on one of two GPUs: its slices lie on GPU 0, the other GPU is a whole nvidia.com/gpu."""
    obj = _node("mixed-2", {"nvidia.com/gpu.product": A100_80, "nvidia.com/gpu.count": "2",
                            "nvidia.com/mig.strategy": "mixed", "nvidia.com/mig.capable": "true"},
                {"nvidia.com/mig-1g.10gb": "2", "nvidia.com/mig-2g.20gb": "1", "nvidia.com/mig-3g.40gb": "1",
                 "nvidia.com/gpu": "1"})
    (node,) = inventory.from_nodes([obj]).nodes
    _check_consistent(node)
    assert node.gpus == 2
    assert {d.gpu for d in node.devices if d.kind == "mixed"} == {0}
    assert [(d.gpu, d.memory_mib) for d in node.devices if d.kind == "whole"] == [(1, 81920)]
    assert node.layouts[1] == ()


def test_mixed_counts_that_are_no_partition_drop_what_does_not_fit():
    model = gpus.CATALOGUE_BY_KEY["A100-40GB"]
    layouts = inventory.mixed_layouts(model, {"4g.20gb": 2, "3g.20gb": 1, "1g.5gb": 0}, 1)
    assert layouts == ((("4g.20gb", 0), ("3g.20gb", 4)),)
    uneven = inventory.mixed_layouts(model, {"3g.20gb": 3, "1g.5gb": 2}, 2)
    assert all(gpus.valid_layout(model, layout) for layout in uneven)
    assert sorted(p for layout in uneven for p, _ in layout) == ["1g.5gb", "1g.5gb", "3g.20gb", "3g.20gb",
                                                                 "3g.20gb"]


def test_mixed_counts_that_are_a_partition_keep_every_advertised_slice():
    """GPU 0 cut as 2 x 3g.40gb and GPU 1 as 7 x 1g.10gb (mig-parted per GPU): the greedy spread put a
    3g.40gb on each GPU and dropped a 1g.10gb the device plugin advertises (6 counted of 7)."""
    model = gpus.CATALOGUE_BY_KEY["A100-80GB"]
    layouts = inventory.mixed_layouts(model, {"1g.10gb": 7, "3g.40gb": 2}, 2)
    assert all(gpus.valid_layout(model, layout) for layout in layouts)
    assert sorted(p for layout in layouts for p, _ in layout) == ["1g.10gb"] * 7 + ["3g.40gb"] * 2


def test_single_strategy_counts_mig_devices_not_gpus():
    (node,) = inventory.from_nodes([_single()]).nodes
    _check_consistent(node)
    assert (node.strategy, node.gpus, node.model, node.memory_mib, node.pool) == (
        "single", 8, "A100-40GB", 40960, "single-pool")
    assert len(node.devices) == 56
    assert {(d.kind, d.resource, d.profile, d.memory_mib) for d in node.devices} == {
        ("single", "nvidia.com/gpu", "1g.5gb", 4864)}
    assert [sum(1 for d in node.devices if d.gpu == i) for i in range(8)] == [7] * 8
    assert node.layouts == (tuple(("1g.5gb", s) for s in range(7)),) * 8


def test_time_slicing_shares_a_gpu_among_its_replicas():
    (node,) = inventory.from_nodes([_time_sliced()]).nodes
    _check_consistent(node)
    assert (node.gpus, node.replicas, node.model) == (1, 4, "T4")
    assert {(d.kind, d.resource, d.gpu, d.memory_mib, d.compute) for d in node.devices} == {
        ("shared", "nvidia.com/gpu", 0, 3840, 0.25)}
    assert len(node.devices) == 4


def test_time_slicing_renamed_by_default_is_nvidia_com_gpu_shared():
    (node,) = inventory.from_nodes([_renamed()]).nodes
    _check_consistent(node)
    assert node.gpus == 2 and len(node.devices) == 8
    assert {(d.kind, d.resource, d.memory_mib) for d in node.devices} == {("shared", "nvidia.com/gpu.shared",
                                                                           23034 // 4)}
    assert [d.gpu for d in node.devices] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_whole_gpus():
    (node,) = inventory.from_nodes([_whole()]).nodes
    _check_consistent(node)
    assert (node.strategy, node.gpus, node.model, node.layouts) == ("none", 8, "H200-141GB", ())
    assert [(d.gpu, d.kind, d.memory_mib) for d in node.devices] == [(i, "whole", 143771) for i in range(8)]


def test_whole_gpu_memory_from_the_catalogue_when_unlabelled():
    obj = _whole(product="NVIDIA-L4")
    del obj["metadata"]["labels"]["nvidia.com/gpu.memory"]
    (node,) = inventory.from_nodes([obj]).nodes
    assert node.memory_mib == 23034


def test_mig_invalid_offers_nothing_but_is_listed_when_mig_capable():
    labels = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB-MIG-INVALID", "nvidia.com/gpu.count": "8",
              "nvidia.com/mig.strategy": "single"}
    invalid = _node("invalid", {**labels, "nvidia.com/mig.capable": "true"}, {"nvidia.com/gpu": "0"})
    unlabelled = _node("unlabelled", labels, {"nvidia.com/gpu": "0"})
    inv = inventory.from_nodes([invalid, unlabelled])
    assert [n.name for n in inv.nodes] == ["invalid"]
    assert inv.nodes[0].devices == () and inv.nodes[0].model == "A100-40GB"
    assert inv.empty


@pytest.mark.parametrize(
    ("kwargs", "listed"),
    [
        ({}, True),
        ({"ready": None}, True),  # no conditions at all (an emulator): taken as ready
        ({"unschedulable": True}, False),  # cordoned
        ({"ready": "False"}, False),
        ({"ready": "Unknown"}, False),
    ],
)
def test_only_schedulable_ready_nodes_count(kwargs, listed):
    inv = inventory.from_nodes([_whole(**kwargs)])
    assert bool(inv.nodes) is listed


def test_nodes_without_gpus_are_skipped_and_nodes_come_in_name_order():
    cpu = _node("cpu-0", {"kubernetes.io/os": "linux"}, {})
    inv = inventory.from_nodes([_whole("z"), cpu, _time_sliced("b"), _single("a")])
    assert [n.name for n in inv.nodes] == ["a", "b", "z"]
    assert inv.node("b") is not None and inv.node("cpu-0") is None


def test_pods_holding_gpus_take_devices_lowest_gpu_first():
    pods = [
        _pod("a100-mixed", {"nvidia.com/mig-1g.10gb": "3", "cpu": "1"}, name="running"),
        _pod("a100-mixed", {"nvidia.com/mig-3g.40gb": "1"}, phase="Pending", name="bound-starting"),
        _pod("a100-mixed", {"nvidia.com/mig-2g.20gb": "1"}, phase="Succeeded", name="done"),
        _pod("a100-mixed", {"nvidia.com/mig-2g.20gb": "1"}, phase="Failed", name="failed"),
        _pod(None, {"nvidia.com/mig-2g.20gb": "8"}, phase="Pending", name="unscheduled"),
        _pod("other-node", {"nvidia.com/mig-2g.20gb": "1"}, name="elsewhere"),
    ]
    (node,) = inventory.from_nodes([_mixed_all_balanced()], pods).nodes
    held = [node.devices[i] for i in range(len(node.devices)) if i not in node.free]
    assert sorted((d.gpu, d.profile) for d in held) == [(0, "1g.10gb"), (0, "1g.10gb"), (0, "3g.40gb"),
                                                         (1, "1g.10gb")]
    assert sum(1 for d in _free(node) if d.profile == "2g.20gb") == 8


def test_pods_being_planned_are_not_held():
    pods = [_pod("h200-whole", {"nvidia.com/gpu": "2"}, name="mine"),
            _pod("h200-whole", {"nvidia.com/gpu": "1"}, name="theirs")]
    (node,) = inventory.from_nodes([_whole()], pods, planned=lambda pod: pod["metadata"]["name"] == "mine").nodes
    assert len(node.free) == 7
    assert [node.devices[i].gpu for i in range(8) if i not in node.free] == [0]


@pytest.mark.parametrize(
    ("init", "sidecar", "held"),
    [
        ({"nvidia.com/gpu": "1"}, None, 1),  # an init container's GPU is handed on to the container
        ({"nvidia.com/gpu": "3"}, None, 3),  # ... and a larger init container is what the pod holds
        (None, {"nvidia.com/gpu": "1"}, 2),  # a sidecar runs beside the container: added
        ({"nvidia.com/gpu": "2"}, {"nvidia.com/gpu": "1"}, 2),
    ],
)
def test_pods_hold_what_the_scheduler_counts_for_init_containers(init, sidecar, held):
    pod = _pod("h200-whole", {"nvidia.com/gpu": "1"}, init=init, sidecar=sidecar)
    (node,) = inventory.from_nodes([_whole()], [pod]).nodes
    assert len(node.devices) - len(node.free) == held


def test_time_sliced_replicas_held_by_pods():
    pods = [_pod("t4-shared", {"nvidia.com/gpu": "3"}), _pod("l4-shared", {"nvidia.com/gpu.shared": "5"})]
    inv = inventory.from_nodes([_time_sliced(), _renamed()], pods)
    assert {n.name: len(n.free) for n in inv.nodes} == {"t4-shared": 1, "l4-shared": 3}
    l4 = inv.node("l4-shared")
    assert l4 is not None and [d.gpu for d in _free(l4)] == [1, 1, 1]


def test_single_strategy_devices_held_by_pods():
    (node,) = inventory.from_nodes([_single()], [_pod("a100-single", {"nvidia.com/gpu": "8"})]).nodes
    assert len(node.free) == 48
    assert sorted({node.devices[i].gpu for i in range(56) if i not in node.free}) == [0, 1]


# Dynamic Resource Allocation: NVIDIA's DRA driver (gpu.nvidia.com), resource.k8s.io/v1.


def _device(name: str, kind: str, memory: str, *, profile: str = "", index: int = 0,
            product: str = "NVIDIA A100-SXM4-80GB") -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "type": {"string": kind},
        "productName": {"string": product},
        "uuid": {"string": f"GPU-{index:08d}-0000"},
        "driverVersion": {"version": "570.124.6"},
        "cudaComputeCapability": {"version": "8.0.0"},
        "architecture": {"string": "Ampere"},
        "brand": {"string": "Nvidia"},
    }
    if kind == "gpu":
        attributes.update({"index": {"int": index}, "minor": {"int": index}})
    else:
        attributes.update({"profile": {"string": profile}, "parentIndex": {"int": index},
                           "parentMinor": {"int": index}})
    return {"name": name, "attributes": attributes, "capacity": {"memory": {"value": memory}}}


def _slice(node: str, devices: list[dict[str, Any]], *, driver: str = "gpu.nvidia.com") -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{driver}-x7k2p"},
            "spec": {"driver": driver, "nodeName": node,
                     "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}, "devices": devices}}


def _claim(name: str, node: str, device: str) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "models"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": "gpu.nvidia.com", "pool": node, "device": device}]}}}}


def _dra_slices() -> list[dict[str, Any]]:
    return [
        _slice("dra-a", [
            _device("gpu-0", "gpu", "80Gi", index=0),
            _device("gpu-1-mig-19-0-1", "mig", "9728Mi", profile="1g.10gb", index=1),
            _device("gpu-1-mig-19-1-1", "mig", "9728Mi", profile="1g.10gb", index=1),
            _device("gpu-1-mig-9-4-4", "mig", "40192Mi", profile="3g.40gb", index=1),
        ]),
        _slice("dra-a", [{"name": "nic-0"}], driver="rdma.example.com"),  # another driver's devices: ignored
    ]


def test_dra_resource_slices_become_devices():
    labels = {"cloud.google.com/gke-nodepool": "dra-pool"}
    node_obj = _node("dra-a", labels, {}, taints=(GPU_TAINT,))
    inv = inventory.from_resource_slices(_dra_slices(), nodes=[node_obj])
    assert inv.dra
    (node,) = inv.nodes
    _check_consistent(node)
    assert (node.name, node.strategy, node.gpus, node.model, node.pool, node.dra) == (
        "dra-a", "dra", 2, "A100-80GB", "dra-pool", True)
    assert node.taints == (GPU_TAINT,)
    assert [(d.gpu, d.kind, d.resource, d.profile, d.memory_mib) for d in node.devices] == [
        (0, "dra", "gpu-0", "", 81920),
        (1, "dra", "gpu-1-mig-19-0-1", "1g.10gb", 9728),
        (1, "dra", "gpu-1-mig-19-1-1", "1g.10gb", 9728),
        (1, "dra", "gpu-1-mig-9-4-4", "3g.40gb", 40192),
    ]
    assert node.devices[0].compute == 1.0 and node.devices[1].compute == pytest.approx(1 / 7)
    assert node.devices[0].product == "NVIDIA A100-SXM4-80GB"
    assert len(node.free) == 4


def test_dra_allocated_claims_hold_their_devices():
    claims = [_claim("theirs", "dra-a", "gpu-0"), _claim("mine", "dra-a", "gpu-1-mig-9-4-4"),
              _claim("elsewhere", "dra-b", "gpu-1-mig-19-0-1")]
    inv = inventory.from_resource_slices(_dra_slices(), claims,
                                         planned=lambda claim: claim["metadata"]["name"] == "mine")
    (node,) = inv.nodes
    assert sorted(node.devices[i].resource for i in node.free) == ["gpu-1-mig-19-0-1", "gpu-1-mig-19-1-1",
                                                                   "gpu-1-mig-9-4-4"]


def test_dra_memory_in_bytes_and_without_capacity():
    devices = [_device("gpu-0", "gpu", "85899345920", index=0, product="NVIDIA H100 80GB HBM3"),
               {**_device("gpu-1", "gpu", "0", index=1, product="NVIDIA H100 80GB HBM3"), "capacity": {}}]
    (node,) = inventory.from_resource_slices([_slice("dra-h", devices)]).nodes
    assert node.model == "H100-80GB"
    assert [d.memory_mib for d in node.devices] == [81920, 81559]  # the catalogue's when not published


def test_an_allocatable_of_a_thousand_written_as_1k_counts():
    """The API server serializes quantities canonically: 1000 time-sliced replicas are "1k"."""
    labels = {"nvidia.com/gpu.product": "NVIDIA-L4-SHARED", "nvidia.com/gpu.count": "8",
              "nvidia.com/gpu.replicas": "125", "nvidia.com/gpu.memory": "23034"}
    found = inventory.from_nodes([_node("l4-ts", labels, {"nvidia.com/gpu": "1k"})])
    assert len(found.nodes[0].devices) == 1000
