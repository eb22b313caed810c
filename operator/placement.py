"""The GPU planner: (inventory, requests) -> a placement and an explanation per request.

A pure, deterministic function (:func:`plan`); the reconciler feeds it the cluster's inventory and every
model's GPU need, keeps its own model's answer, renders it (``builders``) and shows it in status.

Rules, in the order they apply:

* A request whose current placement (``Request.pinned``, read back from its status) still answers the
  same need and still exists in the cluster keeps it: adding a model never moves a running one. It
  moves only when its GPU need changes, when its placement no longer exists, or when asked (the
  ``sluice.dev/replan`` annotation changes).
* Pinned requests book their capacity first, then the others in the order they were created.
* A MIG profile request takes that profile (mixed strategy: ``nvidia.com/mig-<p>``; single strategy:
  ``nvidia.com/gpu`` on nodes whose product is ``...-MIG-<p>``). A memory request (with an optional
  compute share) takes the smallest MIG profile that fits and is free, then - only when the model
  allows sharing - a time-sliced GPU whose share of memory fits, then a whole GPU with enough memory.
  A whole-GPU request takes exclusive whole GPUs, never a MIG slice or a time-sliced GPU.
* Capacity is counted per device: a node's slices and GPUs minus what other pods hold minus what the
  plan booked. Each replica of a request books one device (``count`` devices on one node for a
  multi-GPU request), first fit over nodes in name order, lowest GPU first, which packs.
* A request that fits nowhere now is ``Pending`` when the cluster has enough such devices that are
  only held (it runs once they free up) and ``Unsatisfiable`` when it does not; either way its
  explanation names what is missing, and the MIG repartitioning that would fit it is advised.

The plan never writes anything; :func:`repartition` is advice (``nvidia.com/mig.config`` layouts in
MIG manager's config format) that is only ever applied by a person, or by the operator when opted in.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sluice.operator import gpus, inventory
from sluice.operator.inventory import DRA, MIXED, SHARED, SINGLE, WHOLE

PLACED = "Placed"
PENDING = "Pending"
UNSATISFIABLE = "Unsatisfiable"
UNPLANNED = "Unplanned"
"""No GPU inventory is visible (no GPU nodes, or no RBAC to read them): rendered from the spec alone."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """What a pod asks for, rendered the same way on every node it may land on."""

    kind: str
    """One of ``inventory.KINDS``."""
    resource: str
    """The extended resource (a DRA shape: ``gpu`` or ``mig``)."""
    count: int
    """Devices per replica."""
    profile: str = ""
    products: tuple[str, ...] = ()
    """Values of :attr:`product_label` (``nvidia.com/gpu.product``, or ``nvidia.com/mig-<profile>.product``
    for a time-sliced MIG slice under the mixed strategy) it may land on; empty: any node with the resource."""
    memory_mib: int = 0
    """The least memory a device of this shape has (what the pod can count on)."""
    tolerations: tuple[Mapping[str, str], ...] = ()
    avoid: tuple[str, ...] = ()
    """``nvidia.com/mig-<profile>.product`` values the pods must not land on: an exclusive MIG slice shares
    its resource name with the time-sliced slices of nodes whose device plugin does not rename them."""

    @property
    def product_label(self) -> str:
        """The node label :attr:`products` are values of."""
        return inventory.product_label(self.kind, self.resource, self.profile)

    def key(self) -> tuple[str, str, int, str, tuple[str, ...]]:
        return (self.kind, self.resource, self.count, self.profile, self.products)

    def describe(self) -> str:
        if self.kind in (MIXED, SINGLE) or (self.kind == DRA and self.profile):
            how = {MIXED: "mixed strategy", SINGLE: "single strategy", DRA: "DRA"}[self.kind]
            return f"MIG {self.profile} ({how})"
        if self.kind == SHARED and self.profile:
            return f"time-sliced MIG {self.profile} share"
        noun = "time-sliced GPU share" if self.kind == SHARED else "whole GPU"
        plural = "s" if self.count > 1 else ""
        return f"{self.count} {noun}{plural}" + (" (DRA)" if self.kind == DRA else "")


@dataclasses.dataclass(frozen=True)
class Request:
    """One workload's GPU need (an InferenceModel, or a ModelPool the members of which share it)."""

    key: str
    """``<Kind>/<namespace>/<name>``: unique, and the order of equals."""
    replicas: int
    count: int = 0
    """Whole GPUs per replica."""
    profile: str = ""
    memory_mib: int = 0
    compute_percent: int = 0
    shared: bool = False
    """May take a time-sliced GPU (no memory isolation)."""
    created: str = ""
    """``creationTimestamp``: unpinned requests are planned oldest first."""
    pinned: Shape | None = None
    pinned_for: str = ""
    """The :meth:`signature` the pin answered; a pin for another need is dropped."""

    def signature(self) -> str:
        """The need, as text; stored beside the pin so a changed need replans."""
        if self.count:
            need = f"gpus={self.count}"
        elif self.profile:
            need = f"mig={self.profile}"
        else:
            need = f"memory={self.memory_mib}Mi,compute={self.compute_percent}%,shared={str(self.shared).lower()}"
        return need


@dataclasses.dataclass(frozen=True)
class Verdict:
    key: str
    state: str
    """PLACED, PENDING, UNSATISFIABLE or UNPLANNED."""
    shape: Shape | None
    """What to render; None only when UNPLANNED or when no shape exists at all."""
    reason: str
    """Why this shape (PLACED), or what capacity is missing."""
    nodes: tuple[str, ...] = ()
    """Where the plan counted its replicas (the scheduler picks among the shape's nodes)."""
    pools: tuple[str, ...] = ()
    """The node pools of the shape's nodes."""
    booked: int = 0
    kept: bool = False
    """The pinned placement was kept."""


@dataclasses.dataclass(frozen=True)
class Advice:
    """A MIG layout for one node that would fit pending requests (never applied by the plan)."""

    node: str
    model: str
    """The node's GPU (catalogue key)."""
    config: str
    """The ``nvidia.com/mig.config`` label value to set."""
    layouts: tuple[gpus.Layout, ...]
    """Per GPU."""
    serves: tuple[str, ...]
    """Request keys it makes room for."""
    disrupts: tuple[int, ...]
    """GPUs whose partition changes (their pods restart)."""

    def mig_parted(self) -> dict[str, Any]:
        """MIG manager's (mig-parted) config document for this layout."""
        groups: dict[str, list[int]] = {}
        for index, layout in enumerate(self.layouts):
            groups.setdefault(json.dumps(_counts(layout), sort_keys=True), []).append(index)
        entries = []
        for counts, devices in sorted(groups.items(), key=lambda item: item[1]):
            parsed = json.loads(counts)
            entries.append({"devices": devices, "mig-enabled": bool(parsed), "mig-devices": parsed})
        return {"version": "v1", "mig-configs": {self.config: entries}}


@dataclasses.dataclass(frozen=True)
class Plan:
    verdicts: Mapping[str, Verdict]
    advice: tuple[Advice, ...] = ()
    gpus: frozenset[tuple[str, int]] = frozenset()
    """(node, GPU index) of every physical GPU holding a device the plan booked."""


def _counts(layout: gpus.Layout) -> dict[str, int]:
    counts: dict[str, int] = {}
    for profile, _ in layout:
        counts[profile] = counts.get(profile, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: gpus.profile_sort_key(item[0])))


Base = tuple[str, str, str]
"""(kind, shape resource, profile): what a device is, short of its product."""


class _Offer:
    """What the inventory offers, summarised once per plan: per device base and product the least memory
    and compute share, and the tolerations the nodes of each (kind, product) need."""

    def __init__(self, inv: inventory.Inventory) -> None:
        self.by_base: dict[Base, dict[str, tuple[int, float]]] = {}
        """Base -> product -> (least memory, least compute share) of such a device: a shape names products,
        and the scheduler may pick any node of them (time-sliced nodes of one product may have different
        replica counts)."""
        self.taints: dict[tuple[str, str], dict[str, Mapping[str, str]]] = {}
        for node in inv.nodes:
            for device in node.devices:
                products = self.by_base.setdefault((device.kind, _shape_resource(device), device.profile), {})
                mib, share = products.get(device.product, (device.memory_mib, device.compute))
                products[device.product] = (min(mib, device.memory_mib), min(share, device.compute))
                found = self.taints.setdefault((device.kind, device.product), {})
                for taint in node.taints:
                    toleration = {"key": taint["key"], "operator": "Exists", "effect": taint["effect"]}
                    found[json.dumps(toleration, sort_keys=True)] = toleration

    def tolerations(self, products: Iterable[str], kind: str) -> tuple[Mapping[str, str], ...]:
        found: dict[str, Mapping[str, str]] = {}
        for product in products:
            found.update(self.taints.get((kind, product), {}))
        return tuple(found[k] for k in sorted(found))


class _Book:
    """Free devices by shape, with first-fit booking; the only mutable part of a plan.

    Devices are indexed by base, node and product, free ones kept in GPU order, and each shape asked about
    gets its nodes, its capacity (kept up to date as devices are booked) and a first-fit cursor, so a plan
    costs about the same per request however large the cluster."""

    def __init__(self, inv: inventory.Inventory) -> None:
        self.inv = inv
        self.offer = _Offer(inv)
        self.free: list[set[int]] = [set(node.free) for node in inv.nodes]
        self.touched: set[tuple[str, int]] = set()
        # Base -> node index -> product -> free device indices, lowest GPU first; and the totals.
        self.lists: dict[Base, dict[int, dict[str, list[int]]]] = {}
        self.totals: dict[Base, dict[int, dict[str, int]]] = {}
        for n, node in enumerate(inv.nodes):
            order = sorted(range(len(node.devices)), key=lambda d: (node.devices[d].gpu, d))
            for d in order:
                device = node.devices[d]
                base = (device.kind, _shape_resource(device), device.profile)
                products = self.totals.setdefault(base, {}).setdefault(n, {})
                products[device.product] = products.get(device.product, 0) + 1
                free = self.lists.setdefault(base, {}).setdefault(n, {}).setdefault(device.product, [])
                if d in self.free[n]:
                    free.append(d)
        self._shapes: dict[tuple[Any, ...], _Tracked] = {}
        self._by_base: dict[Base, list[_Tracked]] = {}

    def _tracked(self, shape: Shape) -> _Tracked:
        key = shape.key()
        tracked = self._shapes.get(key)
        if tracked is None:
            base = (shape.kind, shape.resource, shape.profile)
            wanted = set(shape.products)
            nodes = []
            total = 0
            for n, products in self.totals.get(base, {}).items():
                matching = [p for p in products if not wanted or p in wanted]
                if matching:
                    nodes.append((n, tuple(matching)))
                    total += sum(products[p] for p in matching) // shape.count
            tracked = _Tracked(base, shape.count, nodes, {n for n, _ in nodes}, total, 0,
                               tuple(sorted({self.inv.nodes[n].pool for n, _ in nodes} - {""})))
            tracked.free = sum(self._units(tracked, i) for i in range(len(nodes)))
            self._shapes[key] = tracked
            self._by_base.setdefault(base, []).append(tracked)
        return tracked

    def _units(self, tracked: _Tracked, i: int) -> int:
        n, products = tracked.nodes[i]
        lists = self.lists[tracked.base][n]
        return sum(len(lists[p]) for p in products) // tracked.count

    def capacity(self, shape: Shape, *, free: bool) -> int:
        """Replicas of ``shape`` the cluster could hold (``free``: now, else if nothing else held any)."""
        tracked = self._tracked(shape)
        return tracked.free if free else tracked.total

    def book(self, shape: Shape, replicas: int) -> tuple[int, tuple[str, ...]]:
        """Book up to ``replicas`` replicas of ``shape``, first fit; (booked, node names)."""
        tracked = self._tracked(shape)
        booked = 0
        nodes: list[str] = []
        i = tracked.cursor
        while booked < replicas and i < len(tracked.nodes):
            units = self._units(tracked, i)
            if units == 0:
                if i == tracked.cursor:
                    tracked.cursor += 1  # free devices only ever go: a node passed empty stays empty
                i += 1
                continue
            n, products = tracked.nodes[i]
            node = self.inv.nodes[n]
            lists = self.lists[tracked.base][n]
            devices = (sorted((d for p in products for d in lists[p]), key=lambda d: (node.devices[d].gpu, d))
                       if len(products) > 1 else lists[products[0]])
            take = min(units, replicas - booked) * tracked.count
            taken = devices[:take]
            before = [(other, other.index(n)) for other in self._by_base[tracked.base] if n in other.members]
            counts = [self._units(other, j) for other, j in before]
            for d in taken:
                lists[node.devices[d].product].remove(d)
                self.free[n].discard(d)
                self.touched.add((node.name, node.devices[d].gpu))
            for (other, j), count in zip(before, counts, strict=True):
                other.free -= count - self._units(other, j)
            booked += take // tracked.count
            nodes.extend([node.name] * (take // tracked.count))
            i += 1
        return booked, tuple(nodes)

    def pools(self, shape: Shape) -> tuple[str, ...]:
        return self._tracked(shape).pools


@dataclasses.dataclass
class _Tracked:
    """One shape's view of the book."""

    base: Base
    count: int
    nodes: list[tuple[int, tuple[str, ...]]]
    """(node index, its products in the shape), nodes in name order."""
    members: set[int]
    total: int
    free: int
    pools: tuple[str, ...]
    cursor: int = 0
    """Nodes before it have no free replica of the shape left."""
    _positions: dict[int, int] = dataclasses.field(default_factory=dict)

    def index(self, n: int) -> int:
        if not self._positions:
            self._positions.update((node, i) for i, (node, _) in enumerate(self.nodes))
        return self._positions[n]


def _shape_resource(device: inventory.Device) -> str:
    if device.kind == DRA:
        return "mig" if device.profile else "gpu"
    return device.resource


def shapes(request: Request, inv: inventory.Inventory, offer: _Offer | None = None) -> list[Shape]:
    """The shapes that answer ``request`` in this inventory, most preferred first."""
    offer = offer or _Offer(inv)
    need_mib = request.memory_mib
    need_compute = 0.0 if request.count or request.profile else request.compute_percent / 100
    result: list[tuple[tuple[Any, ...], Shape]] = []
    for (kind, resource, profile), products in offer.by_base.items():
        fitting = sorted(p for p, (mib, share) in products.items() if mib >= need_mib and share + 1e-9 >= need_compute)
        if not fitting:
            continue
        memory = min(products[p][0] for p in fitting)
        is_mig = bool(profile)
        if request.count:
            if kind not in (WHOLE, DRA) or is_mig:
                continue
            rank: tuple[Any, ...] = (0, memory)
        elif request.profile:
            if profile != request.profile or kind == SHARED:
                continue  # a MIG profile asked for by name is an exclusive slice
            rank = (0, 0)
        else:
            if kind == SHARED and not request.shared:
                continue
            tier = 1 if kind == SHARED else 0 if is_mig else 2
            rank = (tier, memory, gpus.profile_sort_key(profile) if profile else ())
        # Rendering: a mixed slice is named by its resource alone; every other shape is pinned to the
        # products that qualify, so a whole-GPU pod never lands on a MIG or time-sliced node.
        pinned_products = () if kind == MIXED else tuple(fitting)
        if kind == MIXED and len(fitting) != len(products):
            pinned_products = tuple(fitting)
        if "" in fitting:
            # a node GPU feature discovery labelled no product for (GKE's own device plugin): an affinity on
            # nvidia.com/gpu.product would match no such node, so the resource alone names the shape
            pinned_products = ()
        avoid = _avoid(inv, kind, resource)
        shape = Shape(kind=kind, resource=resource, count=max(request.count, 1), profile=profile,
                      products=pinned_products, memory_mib=memory,
                      tolerations=offer.tolerations(fitting, kind), avoid=avoid)
        result.append(((*rank, ("mixed", "single", "dra", "shared", "whole").index(kind)
                        if kind in ("mixed", "single", "dra", "shared", "whole") else 9, resource), shape))
    result.sort(key=lambda item: item[0])
    return [shape for _, shape in result]


def _avoid(inv: inventory.Inventory, kind: str, resource: str) -> tuple[str, ...]:
    """What an exclusive slice's pods stay off: the products of time-sliced slices advertised under its name."""
    if kind != MIXED:
        return ()
    return tuple(sorted(product for name, product in inv.time_sliced_mig if name == resource))


def _need(request: Request) -> str:
    if request.count:
        return f"{request.replicas} x {request.count} whole GPU(s)"
    if request.profile:
        return f"{request.replicas} x MIG {request.profile}"
    text = f"{request.replicas} x a GPU or MIG slice with >= {_gib(request.memory_mib)} memory"
    if request.compute_percent:
        text += f" and >= {request.compute_percent}% compute"
    return text


def _gib(mib: int) -> str:
    return f"{mib / 1024:.3g} GiB" if mib >= 1024 else f"{mib} MiB"


def plan(inv: inventory.Inventory, requests: Sequence[Request], *, advise: bool = True) -> Plan:
    """Place every request; see the module docstring for the rules. Deterministic in its inputs."""
    book = _Book(inv)
    verdicts: dict[str, Verdict] = {}
    pending: list[Request] = []
    pinned = [r for r in requests if r.pinned is not None and r.pinned_for == r.signature()]
    rest = [r for r in requests if not (r.pinned is not None and r.pinned_for == r.signature())]
    pinned.sort(key=lambda r: (r.created, r.key))
    rest.sort(key=lambda r: (r.created, r.key))
    for request in pinned:
        shape = request.pinned
        assert shape is not None
        if shape.kind == MIXED:
            # a kept slice stays off time-sliced nodes seen since (or before this was stored): added, never
            # dropped, so a node that comes and goes does not roll the pods each time
            avoid = tuple(sorted(set(shape.avoid) | set(_avoid(inv, shape.kind, shape.resource))))
            if avoid != shape.avoid:
                shape = dataclasses.replace(shape, avoid=avoid)
        if book.capacity(shape, free=False) == 0:
            rest.append(request)  # its placement is gone from the cluster: plan it again
            continue
        booked, nodes = book.book(shape, request.replicas)
        state = PLACED if booked >= request.replicas else PENDING
        reason = "kept where it runs" if state == PLACED else (
            f"kept {shape.describe()}, but only {booked} of {request.replicas} replica(s) fit now")
        verdicts[request.key] = Verdict(request.key, state, shape, reason, nodes, book.pools(shape), booked,
                                        kept=True)
        if state != PLACED:
            pending.append(request)
    rest.sort(key=lambda r: (r.created, r.key))
    if inv.empty:
        for request in rest:
            verdicts[request.key] = Verdict(request.key, UNPLANNED, None, "no GPU nodes are visible")
        return Plan(verdicts=verdicts)
    for request in rest:
        candidates = shapes(request, inv, book.offer)
        chosen = next((s for s in candidates if book.capacity(s, free=True) >= request.replicas), None)
        if chosen is not None:
            booked, nodes = book.book(chosen, request.replicas)
            verdicts[request.key] = Verdict(request.key, PLACED, chosen, _why(request, chosen, candidates),
                                            nodes, book.pools(chosen), booked)
            continue
        total = next((s for s in candidates if book.capacity(s, free=False) >= request.replicas), None)
        shape = total or (candidates[0] if candidates else None)
        missing = _missing(request, candidates, book)  # before its own booking: what others left free
        booked, nodes = book.book(shape, request.replicas) if shape is not None else (0, ())
        state = PENDING if total is not None else UNSATISFIABLE
        verdicts[request.key] = Verdict(request.key, state, shape, missing, nodes,
                                        book.pools(shape) if shape else (), booked)
        pending.append(request)
    fitting = {key: verdict.booked for key, verdict in verdicts.items()}
    advice = repartition(inv, book, pending, fitting) if advise and pending else ()
    return Plan(verdicts=verdicts, advice=advice, gpus=frozenset(book.touched))


def _why(request: Request, shape: Shape, candidates: Sequence[Shape]) -> str:
    if request.count:
        return f"{shape.describe()} per replica on exclusive GPUs ({', '.join(shape.products)})"
    if request.profile:
        return f"the requested MIG profile {request.profile}"
    first = candidates[0] if candidates else shape
    text = f"the smallest free device with >= {_gib(request.memory_mib)}"
    if request.compute_percent:
        text += f" and >= {request.compute_percent}% compute"
    text += f": {shape.describe()} ({_gib(shape.memory_mib)})"
    if first.key() != shape.key():
        text += f"; {first.describe()} would fit but has no free capacity"
    return text


def _missing(request: Request, candidates: Sequence[Shape], book: _Book) -> str:
    need = _need(request)
    if not candidates:
        return f"needs {need}; no node offers {_what_is_missing(request, book)}"
    parts = [f"{s.describe()}: {book.capacity(s, free=True)} free of {book.capacity(s, free=False)}"
             for s in candidates[:4]]
    return f"needs {need}; the cluster has {'; '.join(parts)} (replicas counted per shape)"


def _what_is_missing(request: Request, book: _Book) -> str:
    if request.count:
        return "whole exclusive GPUs"
    if request.profile:
        if any(kind == SHARED and profile == request.profile for kind, _, profile in book.offer.by_base):
            return (f"MIG {request.profile} as an exclusive slice (there are time-sliced shares of it, which a "
                    "migProfile never takes: ask for gpu.memory with shared: true to use them)")
        return f"MIG {request.profile}"
    what = f"a GPU or MIG slice with >= {_gib(request.memory_mib)}"
    return what if request.shared else what + " (time-sliced GPUs excluded: set gpu.shared to allow them)"


def repartition(
    inv: inventory.Inventory, book: _Book, pending: Sequence[Request], booked: Mapping[str, int] | None = None,
) -> tuple[Advice, ...]:
    """MIG layouts that would fit ``pending``, per node: held and booked slices stay where they are,
    free ones may be replaced. Nodes in name order; each node's first GPU with room first. Only the
    replicas not ``booked`` yet are made room for, and a GPU no replica needs keeps its partition."""
    # Nodes that may be repartitioned, by GPU model, in name order; each node's GPUs are read when first
    # tried. Partitions only grow while replicas are added, so a profile that does not fit a GPU never
    # will: per (model, profile) a cursor passes the nodes with no room left, per node the GPUs are noted.
    by_model: dict[str, list[int]] = {}
    for n, node in enumerate(inv.nodes):
        model = gpus.CATALOGUE_BY_KEY.get(node.model)
        if model is None or not model.mig_capable or node.dra or any(d.kind == SHARED for d in node.devices):
            continue  # time-sliced nodes are shared as a whole: not partitioned
        if node.strategy != MIXED:
            # single: one profile for every GPU of the node (GPU Feature Discovery labels a node with two
            # -MIG-INVALID, and it then offers nothing): a layout grown GPU by GPU cannot serve there.
            # none (or no strategy label): the device plugin advertises whole GPUs, never MIG slices.
            continue
        by_model.setdefault(node.model, []).append(n)
    layouts: dict[int, list[gpus.Layout]] = {}
    keep: dict[int, list[gpus.Layout]] = {}
    serves: dict[int, list[str]] = {}
    grown: dict[int, set[int]] = {}
    cursor: dict[tuple[str, str], int] = {}
    no_room: dict[tuple[int, str], set[int]] = {}

    def per_gpu(n: int) -> list[gpus.Layout]:
        if n not in layouts:
            layouts[n] = _kept_instances(inv.nodes[n], book.free[n])
            keep[n] = list(layouts[n])
        return layouts[n]

    def room(n: int, model: gpus.GpuModel, profile: str) -> bool:
        """Add one ``profile`` instance to node ``n``'s first GPU with room; whether there was one."""
        tried = no_room.setdefault((n, profile), set())
        partitions = per_gpu(n)
        for index, layout in enumerate(partitions):
            if index in tried or (layout and layout[0][0] == ".busy"):
                continue
            bigger = gpus.pack(model, [profile], layout)
            if bigger is not None:
                partitions[index] = bigger
                grown.setdefault(n, set()).add(index)
                return True
            tried.add(index)
        return False

    for request in pending:
        for _ in range(max(request.replicas - (booked or {}).get(request.key, 0), 0)):
            while True:
                best: tuple[int, str, str] | None = None
                for key, positions in by_model.items():
                    profile = request.profile or _smallest(gpus.CATALOGUE_BY_KEY[key], request)
                    at = cursor.get((key, profile), 0)
                    if profile and at < len(positions) and (best is None or positions[at] < best[0]):
                        best = (positions[at], key, profile)
                if best is None:
                    break  # no node has room for this replica
                n, key, profile = best
                if room(n, gpus.CATALOGUE_BY_KEY[key], profile):
                    serves.setdefault(n, []).append(request.key)
                    break
                cursor[(key, profile)] = cursor.get((key, profile), 0) + 1
    advice = []
    for n in sorted(serves):
        node = inv.nodes[n]
        model = gpus.CATALOGUE_BY_KEY[node.model]
        current = [node.layouts[i] if i < len(node.layouts) else () for i in range(len(layouts[n]))]
        final_layouts = []
        for index, layout in enumerate(layouts[n]):
            if index not in grown[n]:
                final_layouts.append(current[index])  # no replica needs it: left as it is
                continue
            # Repartitioned anyway: the free instances it had come back where they still fit.
            for profile in _dropped(current[index], keep[n][index]):
                layout = gpus.pack(model, [profile], layout) or layout
            final_layouts.append(layout)
        final = tuple(final_layouts)
        changed = tuple(i for i, layout in enumerate(final) if layout != current[i])
        digest = hashlib.sha256(json.dumps(final).encode()).hexdigest()[:8]
        advice.append(Advice(node=node.name, model=node.model, config=f"sluice-{digest}", layouts=final,
                             serves=tuple(dict.fromkeys(serves[n])), disrupts=changed))
    return tuple(advice)


def _kept_instances(node: inventory.Node, free: set[int]) -> list[gpus.Layout]:
    """Per GPU, what a repartition keeps: the MIG instances in use (held or booked); ``.busy`` for a GPU
    handed out whole or time-sliced that is in use, which cannot be partitioned at all."""
    on_gpu: dict[int, list[int]] = {}
    for d, device in enumerate(node.devices):
        on_gpu.setdefault(device.gpu, []).append(d)
    result: list[gpus.Layout] = []
    for index in range(max(node.gpus, 1)):
        held = [(d, node.devices[d]) for d in on_gpu.get(index, [])]
        if any(dev.kind != MIXED and d not in free for d, dev in held):
            result.append(((".busy", 0),))
            continue
        layout = node.layouts[index] if index < len(node.layouts) and node.strategy == MIXED else ()
        result.append(_used_instances(layout, [(dev.profile, d in free) for d, dev in held if dev.kind == MIXED]))
    return result


def _dropped(current: gpus.Layout, kept: gpus.Layout) -> list[str]:
    """The profiles of ``current`` not in ``kept``, largest first."""
    rest = list(current)
    for instance in kept:
        if instance in rest:
            rest.remove(instance)
    return sorted((profile for profile, _ in rest), key=gpus.profile_sort_key, reverse=True)


def _used_instances(layout: gpus.Layout, devices: Sequence[tuple[str, bool]]) -> gpus.Layout:
    """The instances of ``layout`` that stay: as many of each profile as are held or booked."""
    busy: dict[str, int] = {}
    for profile, free in devices:
        if not free:
            busy[profile] = busy.get(profile, 0) + 1
    kept = []
    for profile, start in layout:
        if busy.get(profile, 0) > 0:
            busy[profile] -= 1
            kept.append((profile, start))
    return tuple(kept)


def _smallest(model: gpus.GpuModel, request: Request) -> str:
    """The smallest profile of ``model`` with the request's memory and compute, media-less."""
    if request.count:
        return ""
    return _smallest_for(model, request.memory_mib, request.compute_percent)


@functools.lru_cache(maxsize=4096)
def _smallest_for(model: gpus.GpuModel, memory_mib: int, compute_percent: int) -> str:
    fitting = [p for p in model.profiles if not p.media and p.memory_mib >= memory_mib
               and p.compute / model.compute_slices * 100 + 1e-9 >= compute_percent]
    fitting.sort(key=lambda p: (p.memory_mib, p.compute, p.name))
    return fitting[0].name if fitting else ""
