"""What GPU capacity the cluster has: Node, Pod and ResourceSlice objects -> :class:`Inventory`.

Pure functions over the objects as the API returns them (the reconciler lists them, read-only).
Each node's GPUs become :class:`Device` units, one per thing the scheduler hands out: a whole GPU, a
MIG slice, or one time-slicing replica of a GPU. The facts come from what NVIDIA's components publish:

* the device plugin's allocatable extended resources (``nvidia.com/gpu``, ``nvidia.com/gpu.shared``,
  ``nvidia.com/mig-<profile>``, ``+me`` published as ``.me``);
* GPU feature discovery's labels: ``nvidia.com/gpu.product`` (``-MIG-<profile>`` appended under the
  single MIG strategy, ``-SHARED`` under time-slicing), ``gpu.memory`` (MiB), ``gpu.count``,
  ``gpu.replicas``, ``mig.capable``, ``mig.strategy``, ``mig-<profile>.count`` / ``.memory``, and MIG
  manager's ``mig.config`` / ``mig.config.state``;
* with Dynamic Resource Allocation, NVIDIA DRA driver ResourceSlices (``gpu.nvidia.com``), one device
  per GPU or MIG slice with its ``type``, ``productName``, ``profile`` and ``memory``.

What running pods already hold (requests of pods bound to a node and not finished) is subtracted,
except the pods of the workloads being planned, whose capacity the plan books itself.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from sluice.operator import api, gpus

Obj = Mapping[str, Any]
Layout = gpus.Layout
"""Re-exported: inside :class:`Node` the field ``gpus`` hides the module of that name."""

POOL_LABELS = (
    "sluice.dev/node-pool",
    "cloud.google.com/gke-nodepool",
    "eks.amazonaws.com/nodegroup",
    "karpenter.sh/nodepool",
    "kubernetes.azure.com/agentpool",
    "node.kubernetes.io/instance-type",
)
"""Where a node's pool name is read from, first found wins (``sluice.dev/node-pool`` lets a team say)."""
PRODUCT_LABEL = "nvidia.com/gpu.product"
MEMORY_LABEL = "nvidia.com/gpu.memory"
COUNT_LABEL = "nvidia.com/gpu.count"
REPLICAS_LABEL = "nvidia.com/gpu.replicas"
MIG_CAPABLE_LABEL = "nvidia.com/mig.capable"
MIG_STRATEGY_LABEL = "nvidia.com/mig.strategy"
MIG_CONFIG_LABEL = "nvidia.com/mig.config"
MIG_STATE_LABEL = "nvidia.com/mig.config.state"
DRA_DRIVER = "gpu.nvidia.com"

WHOLE = "whole"
MIXED = "mixed"
SINGLE = "single"
SHARED = "shared"
DRA = "dra"
KINDS = (MIXED, SINGLE, SHARED, WHOLE, DRA)
"""How a device is handed out: a MIG slice under the mixed strategy, a MIG slice under the single
strategy (advertised as ``nvidia.com/gpu``), one replica of a time-sliced GPU, a whole GPU, or a DRA
device (whole or MIG)."""


@dataclasses.dataclass(frozen=True)
class Device:
    """One unit the scheduler hands out."""

    node: str
    gpu: int
    """The physical GPU it lives on, by index on the node."""
    kind: str
    """One of :data:`KINDS`."""
    resource: str
    """The extended resource a pod asks for (a DRA device: its device name)."""
    profile: str
    """MIG profile; empty for a whole or time-sliced GPU (a time-sliced MIG slice keeps its profile)."""
    memory_mib: int
    """Memory it gives its pod: the slice's, the GPU's, or time-sliced the GPU's or slice's over its replicas."""
    compute: float
    """Share of one GPU's compute it gives (slices / compute slices; divided by the replicas time-sliced)."""
    product: str
    """What a node selector matches: the node's ``nvidia.com/gpu.product`` as published, or for a time-sliced
    MIG slice under the mixed strategy its ``nvidia.com/mig-<profile>.product`` (:func:`product_label`),
    empty when GFD published none (then nothing is pinned on it)."""


@dataclasses.dataclass(frozen=True)
class Node:
    name: str
    pool: str
    product: str
    """``nvidia.com/gpu.product`` as published (with any ``-MIG-``/``-SHARED`` suffix)."""
    model: str
    """The catalogue key (``A100-80GB``), or empty for a GPU the catalogue does not list."""
    strategy: str
    """``none``, ``single`` or ``mixed`` (``mig.strategy``; ``none`` when absent)."""
    gpus: int
    memory_mib: int
    """Per GPU."""
    replicas: int
    """Time-slicing replicas per GPU (1: exclusive)."""
    mig_capable: bool
    mig_config: str
    mig_state: str
    layouts: tuple[Layout, ...]
    """Per GPU, its MIG partition as far as the published counts tell (empty: not partitioned)."""
    taints: tuple[Mapping[str, str], ...]
    """``nvidia.com/*`` NoSchedule/NoExecute taints, which GPU pods tolerate."""
    devices: tuple[Device, ...]
    free: frozenset[int]
    """Indices into ``devices`` no pod outside the plan holds."""
    dra: bool = False


@dataclasses.dataclass(frozen=True)
class Inventory:
    nodes: tuple[Node, ...]
    dra: bool = False
    """Built from ResourceSlices (Dynamic Resource Allocation) instead of extended resources."""
    time_sliced_mig: frozenset[tuple[str, str]] = frozenset()
    """(resource, ``nvidia.com/mig-<profile>.product``) of every time-sliced MIG type advertised under the
    name an exclusive slice has (no ``renameByDefault``), on any GPU node, cordoned or NotReady ones too:
    an exclusive slice's pods are kept off them (they come back; a kept placement must already say so)."""

    def node(self, name: str) -> Node | None:
        return next((n for n in self.nodes if n.name == name), None)

    @property
    def empty(self) -> bool:
        return not any(n.devices for n in self.nodes)


def product_label(kind: str, resource: str, profile: str) -> str:
    """The node label whose value :attr:`Device.product` is for devices of this kind, resource and profile:
    ``nvidia.com/mig-<profile>.product`` for a time-sliced MIG slice under the mixed strategy (GFD labels
    each MIG type apart there), ``nvidia.com/gpu.product`` for everything else."""
    if kind == SHARED and profile and resource.startswith(gpus.MIG_PREFIX):
        return gpus.mig_label(profile, "product")
    return PRODUCT_LABEL


def _int(value: Any, default: int = 0) -> int:
    """A count label or an allocatable quantity as an integer: the API server writes an allocatable of
    1000 as ``1k``."""
    try:
        return int(str(value))
    except (TypeError, ValueError):
        pass
    try:
        return int(api.quantity_to_float(str(value)))
    except (TypeError, ValueError):
        return default


def _quantity_mib(value: Any) -> int:
    """A DRA capacity quantity (``80Gi``, ``85899345920``) in MiB; 0 when it is not one."""
    try:
        return int(api.quantity_to_float(str(value)) / 2**20)
    except ValueError:
        return 0


def _schedulable(node: Obj) -> bool:
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    for condition in (node.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return True  # no conditions published (an emulator): take it as ready


def _pool(labels: Mapping[str, str]) -> str:
    return next((labels[key] for key in POOL_LABELS if labels.get(key)), "")


def _gpu_taints(node: Obj) -> tuple[Mapping[str, str], ...]:
    taints = []
    for taint in (node.get("spec") or {}).get("taints") or []:
        if str(taint.get("key", "")).startswith("nvidia.com/") and taint.get("effect") in ("NoSchedule",
                                                                                               "NoExecute"):
            taints.append({k: str(taint[k]) for k in ("key", "value", "effect") if taint.get(k) is not None})
    return tuple(sorted(taints, key=lambda t: (t.get("key", ""), t.get("value", ""), t.get("effect", ""))))


def mixed_layouts(model: gpus.GpuModel, counts: Mapping[str, int], gpu_count: int) -> tuple[gpus.Layout, ...]:
    """Spread a node's published MIG slice counts over its GPUs as valid partitions.

    The labels say how many slices of each profile a node has, not which GPU holds them. MIG manager
    partitions every GPU of a node alike in its named layouts, so an even split is tried first; else
    each slice, largest first, goes to the GPU with the most free memory slices where it fits, and when
    that drops one a search for an assignment holding them all follows. Slices that fit on no GPU in any
    assignment are dropped (the published counts were not a valid partition)."""
    wanted = {name: n for name, n in counts.items() if n > 0 and model.profile(name) is not None}
    gpu_count = max(gpu_count, 1)
    if all(n % gpu_count == 0 for n in wanted.values()):
        one = [name for name, n in sorted(wanted.items()) for _ in range(n // gpu_count)]
        even = gpus.pack(model, one)
        if even is not None:
            return (even,) * gpu_count
    layouts: list[gpus.Layout] = [() for _ in range(gpu_count)]
    order = sorted((name for name, n in wanted.items() for _ in range(n)),
                   key=lambda name: gpus.profile_sort_key(name), reverse=True)
    for name in order:
        ranked = sorted(range(gpu_count), key=lambda i: (gpus.used_slices(model, layouts[i])[1], i))
        for index in ranked:
            grown = gpus.pack(model, [name], layouts[index])
            if grown is not None:
                layouts[index] = grown
                break
    if sum(len(layout) for layout in layouts) < len(order):
        # the greedy spread dropped a slice: look for an assignment that holds every advertised one
        # (e.g. 2 x 3g.40gb on one GPU and 7 x 1g.10gb on the other, which the spread split up)
        every = _assignment(model, tuple(order), gpu_count)
        if every is not None:
            return every
    return tuple(layouts)


_ASSIGNMENT_BUDGET = 5_000
"""Search states :func:`_assignment` tries before it gives up (a few milliseconds' worth)."""


def _assignment(model: gpus.GpuModel, order: tuple[str, ...], gpu_count: int) -> tuple[gpus.Layout, ...] | None:
    """Every slice of ``order`` (largest first) on one of ``gpu_count`` GPUs as valid partitions, or None:
    a depth-first search, GPUs that look alike tried once, states already seen not again."""
    seen: set[tuple[int, tuple[gpus.Layout, ...]]] = set()
    layouts: list[gpus.Layout] = [() for _ in range(gpu_count)]

    def place(i: int) -> bool:
        if i == len(order):
            return True
        state = (i, tuple(sorted(layouts)))
        if state in seen or len(seen) >= _ASSIGNMENT_BUDGET:
            return False  # seen, or too many tried: the counts are likely no valid partition at all
        seen.add(state)
        tried: set[gpus.Layout] = set()
        for g in range(gpu_count):
            before = layouts[g]
            if before in tried:
                continue
            tried.add(before)
            grown = gpus.pack(model, [order[i]], before)
            if grown is None:
                continue
            layouts[g] = grown
            if place(i + 1):
                return True
            layouts[g] = before
        return False

    return tuple(layouts) if place(0) else None


def _devices_of(
    name: str, labels: Mapping[str, str], allocatable: Mapping[str, Any],
) -> tuple[str, int, int, gpus.GpuModel | None, tuple[gpus.Layout, ...], list[Device]]:
    """(strategy, gpu count, memory per GPU, model, layouts, devices) of one node."""
    product = labels.get(PRODUCT_LABEL, "")
    model = gpus.model_for_product(product) if product else None
    strategy = labels.get(MIG_STRATEGY_LABEL, "none") or "none"
    gpu_count = _int(labels.get(COUNT_LABEL), 0)
    memory = _int(labels.get(MEMORY_LABEL), 0) or (model.memory_mib if model else 0)
    replicas = max(_int(labels.get(REPLICAS_LABEL), 1), 1)
    devices: list[Device] = []
    mig: dict[str, int] = {}
    """profile -> physical slices on the node (a time-sliced slice counted once)"""
    sliced: dict[str, list[tuple[str, int, str, int]]] = {}
    """time-sliced profiles: profile -> (advertised resource, replicas per slice, its product label value or
    "" when GFD published none, physical slices) per resource: a node may time-slice some of a type's
    devices (``nvidia.com/mig-<p>.shared``) and hand out the rest exclusively (``nvidia.com/mig-<p>``)"""
    for resource, amount in sorted(allocatable.items()):
        units = _int(amount)
        profile = gpus.profile_of_resource(resource)
        renamed = profile is None and (profile := gpus.profile_of_shared_resource(resource)) is not None
        if profile is None or units <= 0:
            continue
        # Time-slicing a MIG type multiplies what the device plugin advertises by its replicas, and GFD says so
        # in nvidia.com/mig-<p>.replicas (and suffixes .product with -SHARED unless the resource is renamed).
        # A renamed type's labels are the original name's: they describe the shared devices.
        if not renamed and _int(allocatable.get(gpus.resource_name(profile) + gpus.SHARED_SUFFIX), 0) > 0:
            per_slice = 1  # the exclusive ones beside renamed shared ones: the labels are the shared ones'
        else:
            per_slice = _replicas(labels, gpus.mig_label(profile, "replicas"), gpus.mig_label(profile, "count"),
                                  units, time_sliced=renamed)
        physical = max(units // per_slice, 1)
        mig[profile] = mig.get(profile, 0) + physical
        if per_slice > 1:
            sliced.setdefault(profile, []).append(
                (resource, per_slice, labels.get(gpus.mig_label(profile, "product"), ""), physical))
    layouts: tuple[gpus.Layout, ...] = ()
    whole = _int(allocatable.get(gpus.GPU_RESOURCE), 0)
    shared = _int(allocatable.get(gpus.SHARED_GPU_RESOURCE), 0)
    single = gpus.single_profile(product)

    def profile_memory(profile: str) -> int:
        labelled = _int(labels.get(f"nvidia.com/mig-{gpus.label_name(profile)}.memory"), 0)
        if labelled:
            return labelled
        found = model.profile(profile) if model else None
        return found.memory_mib if found else 0

    def compute_of(profile: str) -> float:
        found = model.profile(profile) if model else None
        return found.compute / model.compute_slices if model and found else 0.0

    if mig and model is not None:
        strategy = MIXED
        # gpu.count counts physical GPUs here; those still advertised as nvidia.com/gpu have MIG disabled,
        # so the slices lie on the others (GPUs 0.. hold slices, the whole ones come after them).
        slices = sum(found.memory * n for p, n in mig.items() if (found := model.profile(p)) is not None)
        mig_gpus = max(gpu_count - whole, 1) if gpu_count else max(-(-slices // model.memory_slices), 1)
        gpu_count = mig_gpus + whole
        layouts = mixed_layouts(model, mig, mig_gpus)
        left = {profile: [entry[3] for entry in entries] for profile, entries in sliced.items()}
        for index, layout in enumerate(layouts):
            for profile, _start in layout:
                counts = left.get(profile, [])
                which = next((i for i, n in enumerate(counts) if n > 0), None)
                if which is not None:
                    # one replica of a time-sliced slice: its share of the slice, no memory isolation
                    resource, per_slice, shared_product, _ = sliced[profile][which]
                    counts[which] -= 1
                    devices.extend(Device(name, index, SHARED, resource, profile, profile_memory(profile) // per_slice,
                                          compute_of(profile) / per_slice, shared_product) for _ in range(per_slice))
                    continue
                devices.append(Device(name, index, MIXED, gpus.resource_name(profile), profile,
                                      profile_memory(profile), compute_of(profile), product))
        for i in range(whole):
            devices.append(Device(name, mig_gpus + i, WHOLE, gpus.GPU_RESOURCE, "", memory, 1.0, product))
        layouts += ((),) * whole
    elif product.endswith("-MIG-INVALID"):
        strategy = SINGLE  # GFD could not label it (mixed profiles under the single strategy): nothing to use
    elif single is not None and (whole > 0 or shared > 0):
        # Under the single strategy GFD's gpu.count and gpu.memory describe the MIG devices, not the GPUs;
        # time-sliced, each device is advertised gpu.replicas times (product -SHARED, or nvidia.com/gpu.shared).
        strategy = SINGLE
        units = whole or shared
        resource = gpus.GPU_RESOURCE if whole else gpus.SHARED_GPU_RESOURCE
        per_slice = _replicas(labels, REPLICAS_LABEL, COUNT_LABEL, units,
                              time_sliced=not whole or product.endswith("-SHARED"))
        physical = max(units // per_slice, 1)
        found = model.profile(single) if model else None
        per_gpu = (gpus.max_instances(model, single) if model and found else 0) or physical
        gpu_count = -(-physical // per_gpu)
        if model is not None and found is not None:
            layouts = tuple(gpus.pack(model, [single] * per_gpu) or () for _ in range(gpu_count))
        slice_memory = _int(labels.get(MEMORY_LABEL), 0) or profile_memory(single)
        memory = model.memory_mib if model else slice_memory
        for i in range(physical):
            if per_slice > 1:
                devices.extend(Device(name, i // per_gpu, SHARED, resource, single, slice_memory // per_slice,
                                      compute_of(single) / per_slice, product) for _ in range(per_slice))
            else:
                devices.append(Device(name, i // per_gpu, SINGLE, resource, single, slice_memory,
                                      compute_of(single), product))
    elif replicas > 1 or product.endswith("-SHARED") or shared:
        total = shared or whole
        resource = gpus.SHARED_GPU_RESOURCE if shared else gpus.GPU_RESOURCE
        gpu_count = gpu_count or max(1, total // replicas)
        for i in range(total):
            devices.append(Device(name, i // replicas, SHARED, resource, "", memory // replicas,
                                  1.0 / replicas, product))
    else:
        gpu_count = gpu_count or whole
        for i in range(whole):
            devices.append(Device(name, i, WHOLE, gpus.GPU_RESOURCE, "", memory, 1.0, product))
    if strategy == "none" and labels.get(MIG_STRATEGY_LABEL) in (MIXED, SINGLE):
        strategy = labels[MIG_STRATEGY_LABEL]
    return strategy, gpu_count, memory, model, layouts, devices


def _replicas(labels: Mapping[str, str], replicas_label: str, count_label: str, units: int, *,
              time_sliced: bool) -> int:
    """How many of ``units`` advertised devices share one physical device: GFD's replicas label when it
    says more than 1; else, for a device known to be time-sliced (renamed, or a -SHARED product), the
    advertised units over GFD's device count, or all of them on one device when that is missing too
    (the least memory each could have)."""
    replicas = _int(labels.get(replicas_label), 1)
    if replicas > 1:
        return replicas
    if not time_sliced:
        return 1
    count = _int(labels.get(count_label), 0)
    return max(units // count, 2) if count else max(units, 2)


def _held(pods: Iterable[Obj], skip: Callable[[Obj], bool]) -> dict[str, dict[str, int]]:
    """node -> extended resource -> amount held by bound, unfinished pods that ``skip`` does not exclude."""
    held: dict[str, dict[str, int]] = {}
    for pod in pods:
        spec = pod.get("spec") or {}
        node = spec.get("nodeName")
        phase = (pod.get("status") or {}).get("phase")
        if not node or phase in ("Succeeded", "Failed") or skip(pod):
            continue
        # As the scheduler counts a pod: its containers and sidecars (restartable init containers) together,
        # or its largest plain init container if that is more (the kubelet hands init containers' devices
        # on to the containers, so the two are not added).
        running: dict[str, int] = {}
        init: dict[str, int] = {}
        for container in spec.get("containers") or []:
            _add(running, container)
        for container in spec.get("initContainers") or []:
            if container.get("restartPolicy") == "Always":
                _add(running, container)
            else:
                for resource, amount in _add({}, container).items():
                    init[resource] = max(init.get(resource, 0), amount)
        for resource in sorted(set(running) | set(init)):
            per_node = held.setdefault(node, {})
            per_node[resource] = per_node.get(resource, 0) + max(running.get(resource, 0), init.get(resource, 0))
    return held


def _add(total: dict[str, int], container: Obj) -> dict[str, int]:
    """Add a container's ``nvidia.com/*`` requests (limits, for extended resources the same) to ``total``."""
    resources = container.get("resources") or {}
    wanted = {**(resources.get("requests") or {}), **(resources.get("limits") or {})}
    for resource, amount in wanted.items():
        if resource.startswith("nvidia.com/"):
            total[resource] = total.get(resource, 0) + _int(amount)
    return total


def from_nodes(
    nodes: Sequence[Obj], pods: Sequence[Obj] = (), *, planned: Callable[[Obj], bool] = lambda pod: False,
) -> Inventory:
    """The inventory of the nodes' extended resources; ``planned`` says which pods the plan books itself."""
    held = _held(pods, planned)
    result = []
    time_sliced: set[tuple[str, str]] = set()
    for obj in sorted(nodes, key=lambda n: str(n["metadata"]["name"])):
        meta = obj["metadata"]
        name = str(meta["name"])
        labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
        allocatable = (obj.get("status") or {}).get("allocatable") or {}
        strategy, gpu_count, memory, model, layouts, devices = _devices_of(name, labels, allocatable)
        time_sliced.update((d.resource, d.product) for d in devices if d.kind == SHARED and d.product
                           and gpus.profile_of_resource(d.resource) is not None)
        if not _schedulable(obj):
            continue
        if not devices and labels.get(MIG_CAPABLE_LABEL) != "true":
            continue
        taken: set[int] = set()
        for resource, amount in sorted((held.get(name) or {}).items()):
            # Lowest GPU first: what a pod holds is counted where the device plugin hands out first.
            for index, device in enumerate(devices):
                if amount <= 0:
                    break
                if device.resource == resource and index not in taken:
                    taken.add(index)
                    amount -= 1
        result.append(Node(
            name=name, pool=_pool(labels), product=labels.get(PRODUCT_LABEL, ""),
            model=model.key if model else "", strategy=strategy, gpus=gpu_count, memory_mib=memory,
            replicas=max(_int(labels.get(REPLICAS_LABEL), 1), 1),
            mig_capable=labels.get(MIG_CAPABLE_LABEL) == "true" or strategy in (MIXED, SINGLE),
            mig_config=labels.get(MIG_CONFIG_LABEL, ""), mig_state=labels.get(MIG_STATE_LABEL, ""),
            layouts=layouts, taints=_gpu_taints(obj), devices=tuple(devices),
            free=frozenset(range(len(devices))) - taken,
        ))
    return Inventory(nodes=tuple(result), time_sliced_mig=frozenset(time_sliced))


def _attribute(device: Obj, name: str) -> Any:
    attributes = device.get("attributes") or (device.get("basic") or {}).get("attributes") or {}
    value = attributes.get(name) or attributes.get(f"{DRA_DRIVER}/{name}") or {}
    if isinstance(value, Mapping):
        for key in ("string", "int", "bool", "version"):
            if key in value:
                return value[key]
        return None
    return value


def _capacity(device: Obj, name: str) -> Any:
    capacity = device.get("capacity") or (device.get("basic") or {}).get("capacity") or {}
    value = capacity.get(name) or capacity.get(f"{DRA_DRIVER}/{name}")
    if isinstance(value, Mapping):
        return value.get("value")
    return value


def from_resource_slices(
    slices: Sequence[Obj], claims: Sequence[Obj] = (), nodes: Sequence[Obj] = (),
    *, planned: Callable[[Obj], bool] = lambda claim: False,
) -> Inventory:
    """The inventory NVIDIA's DRA driver publishes: one device per GPU or MIG slice.

    A device allocated to a ResourceClaim that ``planned`` does not exclude is held."""
    held: set[tuple[str, str, str]] = set()
    for claim in claims:
        if planned(claim):
            continue
        allocation = ((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}
        for result in allocation.get("results") or []:
            held.add((str(result.get("driver")), str(result.get("pool")), str(result.get("device"))))
    labels_of = {str(n["metadata"]["name"]): (n["metadata"].get("labels") or {}) for n in nodes}
    taints_of = {str(n["metadata"]["name"]): _gpu_taints(n) for n in nodes}
    per_node: dict[str, list[tuple[Device, bool]]] = {}
    for obj in sorted(slices, key=lambda s: str(s["metadata"]["name"])):
        spec = obj.get("spec") or {}
        if spec.get("driver") != DRA_DRIVER or not spec.get("nodeName"):
            continue
        node = str(spec["nodeName"])
        pool = str((spec.get("pool") or {}).get("name", node))
        for device in spec.get("devices") or []:
            kind = str(_attribute(device, "type") or "gpu")
            product = str(_attribute(device, "productName") or "")
            profile = str(_attribute(device, "profile") or "") if kind == "mig" else ""
            model = gpus.model_for_product(product.replace(" ", "-")) if product else None
            memory = _quantity_mib(_capacity(device, "memory") or 0)
            if not memory and model is not None:
                found = model.profile(profile) if profile else None
                memory = found.memory_mib if found else model.memory_mib
            found = model.profile(profile) if model and profile else None
            compute = found.compute / model.compute_slices if model and found else 1.0
            name = str(device.get("name"))
            # Device names are gpu-<minor> and gpu-<minor>-mig-<profile id>-<start>-<size>.
            minor = re.match(r"gpu-([0-9]+)", name)
            index = _int(minor.group(1) if minor else _attribute(device, "index"))
            taken = (DRA_DRIVER, pool, name) in held
            per_node.setdefault(node, []).append(
                (Device(node, index, DRA, name, profile, memory, compute, product), taken))
    result = []
    for node, entries in sorted(per_node.items()):
        entries.sort(key=lambda e: (e[0].gpu, e[0].profile != "", e[0].resource))
        devices = tuple(e[0] for e in entries)
        labels = labels_of.get(node, {})
        product = devices[0].product if devices else ""
        model = gpus.model_for_product(product.replace(" ", "-")) if product else None
        result.append(Node(
            name=node, pool=_pool(labels), product=product, model=model.key if model else "", strategy=DRA,
            gpus=len({d.gpu for d in devices}), memory_mib=max((d.memory_mib for d in devices), default=0),
            replicas=1, mig_capable=model is not None and model.mig_capable, mig_config="", mig_state="",
            layouts=(), taints=taints_of.get(node, ()), devices=devices,
            free=frozenset(i for i, e in enumerate(entries) if not e[1]), dra=True,
        ))
    return Inventory(nodes=tuple(result), dra=True)
