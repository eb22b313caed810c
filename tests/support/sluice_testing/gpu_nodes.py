"""Simulated GPU clusters: Node, Pod and ResourceSlice objects as NVIDIA's components publish them.

Small functions build one object each, written from NVIDIA's documented output rather than from the
operator's catalogue (``sluice.operator.gpus``), so a test compares the operator against the real
contract and not against itself:

* GPU feature discovery's labels (``nvidia.com/gpu.product``, ``gpu.count``, ``gpu.memory``,
  ``gpu.replicas``, ``gpu.sharing-strategy``, ``mig.strategy``, ``mig.capable``, per MIG type
  ``nvidia.com/mig-<profile>.count`` / ``.memory`` / ``.product`` / ...), MIG manager's
  ``nvidia.com/mig.config`` / ``mig.config.state``, and the device plugin's allocatable extended
  resources (``nvidia.com/gpu``, ``nvidia.com/gpu.shared``, ``nvidia.com/mig-<profile>``);
* GKE's node labels and its ``nvidia.com/gpu=present:NoSchedule`` taint on GPU node pools;
* NVIDIA's DRA driver (``gpu.nvidia.com``): one ResourceSlice per node, devices ``gpu-<minor>`` and
  ``gpu-<minor>-mig-<profile id>-<start>-<size>``, and its DeviceClasses.

:func:`load` writes them into an :class:`~sluice_testing.ApiServer`::

    async with ApiServer(simulate_scheduling=True) as server, kmock.Server(server):
        nodes, pods = gpu_nodes.fragmented_a100()
        await gpu_nodes.load(server, [*nodes, gpu_nodes.l4("l4-0")], pods)

Numbers (MIG memory in MiB, multiprocessors, engines) are those GFD reports for the A100 80GB and
H100 80GB HBM3; CPU and memory are plausible for the GKE machine types named, not exact.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sluice_testing.apiserver import ApiServer

Obj = dict[str, Any]

GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
"""What GKE puts on every GPU node pool."""
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
POOL_LABEL = "cloud.google.com/gke-nodepool"
DRA_DRIVER = "gpu.nvidia.com"
_DRIVER = {"nvidia.com/cuda.driver.major": "550", "nvidia.com/cuda.driver.minor": "54",
           "nvidia.com/cuda.driver.rev": "15", "nvidia.com/cuda.runtime.major": "12",
           "nvidia.com/cuda.runtime.minor": "4", "nvidia.com/gpu.present": "true",
           "nvidia.com/gpu.machine": "Google-Compute-Engine"}


@dataclasses.dataclass(frozen=True)
class MigType:
    """One MIG profile of one GPU, as GFD labels it and NVML describes it."""

    name: str
    profile_id: int
    """The GPU-instance profile ID (``nvidia-smi mig -lgip``), part of a DRA device's name."""
    slices: int
    """Compute slices (GFD's ``slices.gi`` / ``slices.ci``)."""
    size: int
    """Memory slices it occupies (the DRA device name's ``<size>``)."""
    memory_mib: int
    multiprocessors: int
    copy: int
    decoder: int
    jpeg: int


A100_80GB = {t.name: t for t in (
    MigType("1g.10gb", 19, 1, 1, 9728, 14, 1, 0, 0),
    MigType("2g.20gb", 14, 2, 2, 19968, 28, 2, 1, 0),
    MigType("3g.40gb", 9, 3, 4, 40192, 42, 3, 2, 0),
)}
H100_80GB = {t.name: t for t in (
    MigType("1g.10gb", 19, 1, 1, 9984, 16, 1, 1, 1),
)}
A100_80GB_CONFIGS: dict[str, tuple[tuple[str, int], ...]] = {
    # MIG manager's named configurations: per GPU, (profile, start memory slice).
    "all-1g.10gb": tuple(("1g.10gb", start) for start in range(7)),
    "all-2g.20gb": (("2g.20gb", 0), ("2g.20gb", 2), ("2g.20gb", 4)),
    "all-3g.40gb": (("3g.40gb", 0), ("3g.40gb", 4)),
    "all-balanced": (("3g.40gb", 4), ("2g.20gb", 2), ("1g.10gb", 0), ("1g.10gb", 1)),
}


def node(
    name: str, *, labels: Mapping[str, str] | None = None, allocatable: Mapping[str, str] | None = None,
    taints: Sequence[Mapping[str, str]] = (), cpu: str = "7910m", memory: str = "26Gi", pods: int = 110,
    ready: bool = True, unschedulable: bool = False,
) -> Obj:
    """A Node as its kubelet registers it (labels, capacity and allocatable, the Ready condition)."""
    resources = {"cpu": cpu, "memory": memory, "pods": str(pods), "ephemeral-storage": "95551679124",
                 "hugepages-1Gi": "0", "hugepages-2Mi": "0", **(allocatable or {})}
    spec: Obj = {"podCIDR": "10.8.0.0/24", "providerID": f"gce://sluice-test/us-central1-c/{name}"}
    if taints:
        spec["taints"] = [dict(t) for t in taints]
    if unschedulable:
        spec["unschedulable"] = True
    condition = {"type": "Ready", "status": "True", "reason": "KubeletReady",
                 "message": "kubelet is posting ready status"} if ready else \
        {"type": "Ready", "status": "False", "reason": "KubeletNotReady",
         "message": "container runtime network not ready: NetworkReady=false"}
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {
            "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
            "topology.kubernetes.io/region": "us-central1", "topology.kubernetes.io/zone": "us-central1-c",
            **(labels or {})}},
        "spec": spec,
        "status": {"capacity": dict(resources), "allocatable": dict(resources), "conditions": [condition]},
    }


def _gpu_labels(product: str, count: int, memory_mib: int, family: str, compute: tuple[int, int],
                replicas: int = 1, sharing: str = "none") -> dict[str, str]:
    """GFD's labels for full GPUs (replicas 0: the MIG-enabled GPUs, labelled without a sharing config)."""
    return {**_DRIVER, "nvidia.com/gpu.product": product, "nvidia.com/gpu.count": str(count),
            "nvidia.com/gpu.memory": str(memory_mib), "nvidia.com/gpu.replicas": str(replicas),
            "nvidia.com/gpu.sharing-strategy": sharing, "nvidia.com/gpu.family": family,
            "nvidia.com/gpu.compute.major": str(compute[0]), "nvidia.com/gpu.compute.minor": str(compute[1])}


def _mig_labels(prefix: str, mig: MigType, count: int, product: str, *, replicas: int = 1,
                rename: bool = False) -> dict[str, str]:
    """GFD's labels for one MIG type (``prefix``: ``nvidia.com/mig-<profile>`` mixed, ``nvidia.com/gpu`` single);
    time-sliced (``replicas`` > 1) the product gains ``-SHARED`` unless the device plugin renames the resource."""
    shared = "-SHARED" if replicas > 1 and not rename else ""
    return {f"{prefix}.{key}": str(value) for key, value in {
        "count": count, "memory": mig.memory_mib, "multiprocessors": mig.multiprocessors,
        "product": f"{product}-MIG-{mig.name}{shared}", "replicas": replicas,
        "sharing-strategy": "time-slicing" if replicas > 1 else "none",
        "slices.gi": mig.slices, "slices.ci": mig.slices, "engines.copy": mig.copy,
        "engines.decoder": mig.decoder, "engines.encoder": 0, "engines.jpeg": mig.jpeg, "engines.ofa": 0,
    }.items()}


def _gke(pool: str, accelerator: str, machine: str) -> dict[str, str]:
    return {POOL_LABEL: pool, "cloud.google.com/gke-accelerator": accelerator,
            "node.kubernetes.io/instance-type": machine}


def a100_mixed(name: str, *, gpus: int = 1, config: str = "all-balanced", pool: str = "a100-mixed",
               replicas: int = 1, rename: bool = False, **kw: Any) -> Obj:
    """An ``a2-ultragpu-<gpus>g`` node (A100 SXM4 80GB) partitioned by MIG manager's ``config``
    (``all-balanced``: 2x 1g.10gb, 1x 2g.20gb, 1x 3g.40gb per GPU), published under the mixed strategy;
    with ``replicas`` > 1 every slice is time-sliced that many ways (advertised ``replicas`` times, as
    ``nvidia.com/mig-<p>.shared`` with ``rename``)."""
    product = "NVIDIA-A100-SXM4-80GB"
    counts: dict[str, int] = {}
    for profile, _start in A100_80GB_CONFIGS[config]:
        counts[profile] = counts.get(profile, 0) + gpus
    labels = {**_gke(pool, "nvidia-a100-80gb", f"a2-ultragpu-{gpus}g"),
              **_gpu_labels(product, gpus, 81920, "ampere", (8, 0), replicas=0),
              "nvidia.com/mig.capable": "true", "nvidia.com/mig.strategy": "mixed",
              "nvidia.com/mig.config": config, "nvidia.com/mig.config.state": "success"}
    for profile, count in counts.items():
        labels.update(_mig_labels(f"nvidia.com/mig-{profile}", A100_80GB[profile], count, product,
                                  replicas=replicas, rename=rename))
    kw.setdefault("taints", [GPU_TAINT])
    suffix = ".shared" if replicas > 1 and rename else ""
    return node(name, labels=labels,
                allocatable={f"nvidia.com/mig-{p}{suffix}": str(n * replicas) for p, n in counts.items()},
                cpu=f"{12000 * gpus - 400}m", memory=f"{155 * gpus}Gi", **kw)


def h100_single(name: str, *, gpus: int = 1, pool: str = "h100-mig", **kw: Any) -> Obj:
    """An ``a3-highgpu-<gpus>g`` node (H100 80GB HBM3) with ``all-1g.10gb`` under the single strategy:
    GFD's ``gpu.product``/``count``/``memory`` describe the 7 MIG devices per GPU, and the device plugin
    advertises them as ``nvidia.com/gpu``."""
    product = "NVIDIA-H100-80GB-HBM3"
    devices = 7 * gpus
    labels = {**_gke(pool, "nvidia-h100-80gb", f"a3-highgpu-{gpus}g"),
              **_gpu_labels(product, gpus, 81559, "hopper", (9, 0), replicas=0),
              **_mig_labels("nvidia.com/gpu", H100_80GB["1g.10gb"], devices, product),
              "nvidia.com/mig.capable": "true", "nvidia.com/mig.strategy": "single",
              "nvidia.com/mig.config": "all-1g.10gb", "nvidia.com/mig.config.state": "success"}
    kw.setdefault("taints", [GPU_TAINT])
    return node(name, labels=labels, allocatable={"nvidia.com/gpu": str(devices)},
                cpu=f"{26000 * gpus - 400}m", memory=f"{220 * gpus}Gi", **kw)


def t4_time_sliced(name: str, *, gpus: int = 1, replicas: int = 4, rename: bool = False, pool: str = "t4-shared",
                   **kw: Any) -> Obj:
    """An ``n1-standard-8`` node with Tesla T4s shared by time-slicing: ``replicas`` per GPU, advertised
    as ``nvidia.com/gpu`` with the product suffixed ``-SHARED``, or with ``renameByDefault`` (``rename``)
    as ``nvidia.com/gpu.shared`` and the product unchanged."""
    labels = {**_gke(pool, "nvidia-tesla-t4", "n1-standard-8"),
              **_gpu_labels("Tesla-T4" if rename else "Tesla-T4-SHARED", gpus, 15360, "turing", (7, 5),
                            replicas=replicas, sharing="time-slicing"),
              "nvidia.com/mig.capable": "false"}
    resource = "nvidia.com/gpu.shared" if rename else "nvidia.com/gpu"
    kw.setdefault("taints", [GPU_TAINT])
    return node(name, labels=labels, allocatable={resource: str(gpus * replicas)}, **kw)


_G2 = {1: 8, 2: 24, 4: 48, 8: 96}  # L4s -> vCPUs of the g2-standard machine type that has them


def l4(name: str, *, gpus: int = 1, pool: str = "l4", **kw: Any) -> Obj:
    """A ``g2-standard`` node with whole NVIDIA L4s (no MIG, no sharing)."""
    vcpus = _G2[gpus]
    labels = {**_gke(pool, "nvidia-l4", f"g2-standard-{vcpus}"),
              **_gpu_labels("NVIDIA-L4", gpus, 23034, "ada-lovelace", (8, 9)), "nvidia.com/mig.capable": "false"}
    kw.setdefault("taints", [GPU_TAINT])
    return node(name, labels=labels, allocatable={"nvidia.com/gpu": str(gpus)},
                cpu=f"{vcpus * 1000 - 200}m", memory=f"{vcpus * 4 - 4}Gi", **kw)


def h100(name: str, *, gpus: int = 8, pool: str = "h100", **kw: Any) -> Obj:
    """An ``a3-highgpu-<gpus>g`` node with whole H100 80GB HBM3s (MIG-capable, MIG disabled)."""
    labels = {**_gke(pool, "nvidia-h100-80gb", f"a3-highgpu-{gpus}g"),
              **_gpu_labels("NVIDIA-H100-80GB-HBM3", gpus, 81559, "hopper", (9, 0)), "nvidia.com/mig.capable": "true"}
    kw.setdefault("taints", [GPU_TAINT])
    return node(name, labels=labels, allocatable={"nvidia.com/gpu": str(gpus)},
                cpu=f"{26000 * gpus - 400}m", memory=f"{220 * gpus}Gi", **kw)


def pod_holding(name: str, node_name: str, resources: Mapping[str, int], *, namespace: str = "tenants") -> Obj:
    """Someone else's running pod, bound to ``node_name``, holding ``resources`` (e.g. a MIG slice)."""
    limits = {resource: str(amount) for resource, amount in resources.items()}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app": name}},
        "spec": {"nodeName": node_name, "tolerations": [GPU_TOLERATION], "containers": [{
            "name": "train", "image": "nvcr.io/nvidia/pytorch:24.05-py3",
            "resources": {"requests": {"cpu": "1", "memory": "4Gi"}, "limits": limits}}]},
        "status": {"phase": "Running", "conditions": [
            {"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}]},
    }


def fragmented_a100(nodes: int = 3) -> tuple[list[Obj], list[Obj]]:
    """A100 mixed ``all-balanced`` nodes (1 GPU each) that other teams' pods mostly fill.

    Held: every 1g.10gb slice (the profile exists on every node and is full everywhere), the 2g.20gb
    on all nodes but the last, and the 3g.40gb on the first. Free: one 2g.20gb (last node) and
    ``nodes - 1`` 3g.40gb. Returns (nodes, pods)."""
    built = [a100_mixed(f"a100-{i}") for i in range(nodes)]
    pods = []
    for i in range(nodes):
        holders = [("1g.10gb", 0), ("1g.10gb", 1)] + ([("2g.20gb", 0)] if i < nodes - 1 else []) \
            + ([("3g.40gb", 0)] if i == 0 else [])
        pods += [pod_holding(f"job-{profile.replace('.', '-')}-{i}-{n}", f"a100-{i}", {f"nvidia.com/mig-{profile}": 1})
                 for profile, n in holders]
    return built, pods


# ---------------------------------------------------------------- Dynamic Resource Allocation

def _uuid(prefix: str, *parts: object) -> str:
    return f"{prefix}-{uuid.uuid5(uuid.NAMESPACE_DNS, '/'.join(map(str, parts)))}"


def _memory(mib: int) -> str:
    """A byte count as a BinarySI quantity, as the driver's ``resource.NewQuantity`` serializes it."""
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"


_A100_ATTRIBUTES = {"productName": {"string": "NVIDIA A100-SXM4-80GB"}, "brand": {"string": "Nvidia"},
                    "architecture": {"string": "Ampere"}, "cudaComputeCapability": {"version": "8.0.0"},
                    "driverVersion": {"version": "550.54.15"}, "cudaDriverVersion": {"version": "12.4.0"}}


def resource_slice(node_name: str, devices: Sequence[Obj]) -> Obj:
    """The one ResourceSlice NVIDIA's DRA kubelet plugin publishes for ``node_name``'s devices."""
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": f"{node_name}-{DRA_DRIVER}-{uuid.uuid5(uuid.NAMESPACE_DNS, node_name).hex[:5]}"},
        "spec": {"driver": DRA_DRIVER, "nodeName": node_name,
                 "pool": {"name": node_name, "generation": 1, "resourceSliceCount": 1},
                 "devices": list(devices)},
    }


def dra_a100(name: str, *, gpus: int = 1, mig: str | None = None, pool: str = "a100-dra",
             **kw: Any) -> tuple[Obj, Obj]:
    """An A100 SXM4 80GB node whose GPUs NVIDIA's DRA driver publishes instead of the device plugin:
    the Node (no ``nvidia.com/*`` allocatable) and its ResourceSlice, with ``gpu-<minor>`` per GPU or,
    with ``mig`` (a MIG manager config such as ``all-balanced``), that partition's MIG devices."""
    devices: list[Obj] = []
    for minor in range(gpus):
        parent = _uuid("GPU", name, minor)
        bus = {"pcieBusID": {"string": f"0000:{minor + 4:02x}:00.0"}}
        if mig is None:
            devices.append({"name": f"gpu-{minor}", "attributes": {
                "type": {"string": "gpu"}, "uuid": {"string": parent}, **_A100_ATTRIBUTES, **bus},
                "capacity": {"memory": {"value": _memory(81920)}}})
            continue
        for profile, start in A100_80GB_CONFIGS[mig]:
            kind = A100_80GB[profile]
            capacity = {"multiprocessors": kind.multiprocessors, "copyEngines": kind.copy, "decoders": kind.decoder,
                        "encoders": 0, "jpegEngines": kind.jpeg, "ofaEngines": 0}
            devices.append({
                "name": f"gpu-{minor}-mig-{kind.profile_id}-{start}-{kind.size}",
                "attributes": {"type": {"string": "mig"}, "uuid": {"string": _uuid("MIG", name, minor, start)},
                               "parentUUID": {"string": parent}, "profile": {"string": profile},
                               **_A100_ATTRIBUTES, **bus},
                "capacity": {**{k: {"value": str(v)} for k, v in capacity.items()},
                             "memory": {"value": _memory(kind.memory_mib)},
                             **{f"memorySlice{i}": {"value": "1"} for i in range(start, start + kind.size)}},
            })
    kw.setdefault("taints", [GPU_TAINT])
    built = node(name, labels={**_gke(pool, "nvidia-a100-80gb", f"a2-ultragpu-{gpus}g"),
                               "nvidia.com/gpu.present": "true"},
                 cpu=f"{12000 * gpus - 400}m", memory=f"{155 * gpus}Gi", **kw)
    return built, resource_slice(name, devices)


def device_classes() -> list[Obj]:
    """The DeviceClasses NVIDIA's DRA driver installs: ``gpu.nvidia.com`` and ``mig.nvidia.com``."""
    return [{"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": f"{kind}.nvidia.com"},
             "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRA_DRIVER}' && "
                                                           f"device.attributes['{DRA_DRIVER}'].type == '{kind}'"}}]}}
            for kind in ("gpu", "mig")]


async def load(server: ApiServer, nodes: Iterable[Obj], pods: Iterable[Obj] = (), objects: Iterable[Obj] = ()) -> None:
    """Create ``nodes``, then ``objects`` (ResourceSlices, DeviceClasses: ``ApiServer(serve_dra=True)``),
    then ``pods`` with the status they carry, as their kubelets would report it."""
    for obj in [*nodes, *objects]:
        await server.create(obj, manager="kubelet" if obj["kind"] == "Node" else "unknown")
    for pod in pods:
        await server.create(pod)
        if pod.get("status"):
            meta = pod["metadata"]
            await server.write_status("v1/pods", meta.get("namespace", "default"), meta["name"], pod["status"])
