"""Model pools: how much of a pool's device there is, and which members are admitted to share it.

Pure functions, no I/O, no clock. ``reconcile`` gathers a ModelPool's members (the InferenceModels whose
``spec.pool`` names it) and its last admission (``status.members``), calls :func:`capacity` and
:func:`admit`, has ``builders.model_pool`` render the admitted members into the pool's one Deployment,
and writes :func:`status_to`. Members read their verdict back with :func:`verdict_from`.

The rules (docs/operator.md, "Model pools"):

* Capacity is the memory of the device each pool replica gets: ``gpu.memory`` itself; for a
  ``migProfile`` the smallest nominal memory of that profile on any GPU in the catalogue (``gpus``), so
  the pool fits wherever the slice lands; for ``count`` n, one GPU's memory when the caller knows it
  (each GPU holds every member), learned from placement, otherwise unknown, and then members are
  admitted on compute shares alone (the status says so).
  Compute is 100 % per device.
* Admission is stable: members admitted before stay admitted while they still fit together, so adding
  a member never evicts one. A member that grew is checked against what the others leave free and,
  when it no longer fits, moves to waiting; the others stay. New members are then admitted oldest
  first (creationTimestamp, then name) wherever memory and compute still fit: a member that does not
  fit does not hold back a younger one that does.
* Two members may not serve the same model name (one model repository), and the pods have one
  service account, so members that name different ones cannot share a pool.
* Every waiting member gets a reason naming exactly what is missing, against the final admission:
  ``needs 6 GiB, pool small has 2 GiB free of 40 GiB``.
* A member whose spec is invalid (or names a format the runtime cannot load) is no candidate: it is
  listed among the waiting with its problems (:func:`refused`), so the pool and the member both say it
  is not served.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sluice.operator import api, gpus

ADMITTED = "Admitted"
WAITING = "Waiting"
JOINING = "Joining"
"""A member the pool has not considered yet (its last admission does not name it)."""
POOL_FULL = "PoolFull"
"""Waiting: not enough free memory or compute."""
POOL_CONFLICT = "PoolConflict"
"""Waiting: it cannot share the pods with an admitted member (same model name, other service account)."""
INVALID_SPEC = "InvalidSpec"
"""Not a candidate: its spec is invalid (the pool renders members from their specs and keeps no last good one)."""
NOT_SERVED = "NotImplemented"
"""Not a candidate: its spec names a model format the runtime cannot load yet."""
RULED_OUT = (INVALID_SPEC, NOT_SERVED)
"""The causes of a member that waits for its own spec to change, not for room in the pool."""
COMPUTE_PER_DEVICE = 100


@dataclasses.dataclass(frozen=True)
class Capacity:
    """What one pool replica's device offers."""

    pool: str
    """The pool's name, for the reasons."""
    memory_mib: int | None
    """Device memory in MiB; ``None`` when unknown (then only compute limits admission)."""
    compute_percent: int = COMPUTE_PER_DEVICE
    """Compute shares the members may declare in all: 100 per device."""
    note: str = ""
    """Why the memory is unknown, when it is."""


@dataclasses.dataclass(frozen=True)
class Member:
    """An InferenceModel in the pool, or (from ``status.members``) what it was admitted with."""

    name: str
    """The InferenceModel's name."""
    memory_mib: int
    """Its declared share of device memory (``spec.resources.gpu.memory``, rounded up to MiB)."""
    compute_percent: int = 0
    """Its declared share of compute (``gpu.computePercent``); 0 when it declares none."""
    created: str = ""
    """``metadata.creationTimestamp`` (RFC 3339, UTC: sorts by time)."""
    model: str = ""
    """The model name it serves (``spec.model.name``); one repository holds each name once."""
    service_account: str | None = None
    """``spec.storage.serviceAccountName``: the pool's pods run as it."""


@dataclasses.dataclass(frozen=True)
class Waiting:
    member: Member
    cause: str
    """:data:`POOL_FULL` or :data:`POOL_CONFLICT`; :data:`INVALID_SPEC` or :data:`NOT_SERVED` for a member
    that is not a candidate (:func:`refused`)."""
    reason: str
    """What is missing, in a sentence."""


@dataclasses.dataclass(frozen=True)
class Admission:
    capacity: Capacity
    admitted: tuple[Member, ...]
    """Oldest first."""
    waiting: tuple[Waiting, ...]
    """Oldest first."""

    @property
    def used_mib(self) -> int:
        return sum(m.memory_mib for m in self.admitted)

    @property
    def free_mib(self) -> int | None:
        memory = self.capacity.memory_mib
        return None if memory is None else memory - self.used_mib

    @property
    def compute_used(self) -> int:
        return sum(m.compute_percent for m in self.admitted)

    @property
    def service_account(self) -> str | None:
        """The service account the pool's pods run as: the one its admitted members name, if any."""
        return next((m.service_account for m in self.admitted if m.service_account), None)


def mib(quantity: str, *, round_up: bool) -> int:
    """A memory quantity in whole MiB: shares round up, capacities down, so admission never overbooks."""
    value = api.quantity_to_float(quantity) / 2**20
    return math.ceil(value - 1e-9) if round_up else math.floor(value + 1e-9)


def format_mib(value: int) -> str:
    """``16384`` -> ``16 GiB``, ``1536`` -> ``1.5 GiB``, ``512`` -> ``512 MiB``."""
    if abs(value) < 1024:
        return f"{value} MiB"
    gib = f"{value / 1024:.2f}".rstrip("0").rstrip(".")
    return f"{gib} GiB"


def capacity(pool: str, gpu: api.Gpu, *, gpu_memory_mib: int | None = None) -> Capacity:
    """The capacity of one replica of ``pool`` whose device is ``gpu``; ``gpu_memory_mib`` is the memory
    of one whole GPU where the caller knows it (placement), used for ``gpu.count``. A member's config
    asks for ``KIND_GPU`` without ``gpus``, so the runtime (as Triton) loads it on every GPU of the pod:
    each GPU holds every member, and a ``gpu.count`` pool has one GPU's memory and compute to share
    (more GPUs add instances of each member, not room for more members)."""
    if gpu.memory is not None:
        return Capacity(pool, mib(gpu.memory, round_up=False))
    if gpu.mig_profile is not None:
        sizes = [p.memory_mib for model in gpus.models_with(gpu.mig_profile)
                 if (p := model.profile(gpu.mig_profile)) is not None]
        if sizes:
            return Capacity(pool, min(sizes))
        return Capacity(pool, None, note=f"MIG profile {gpu.mig_profile} is not in the GPU catalogue, so its "
                        "memory is unknown: members are admitted on gpu.computePercent alone")
    count = gpu.count or 1
    if gpu_memory_mib is not None:
        return Capacity(pool, gpu_memory_mib, COMPUTE_PER_DEVICE)
    return Capacity(pool, None, COMPUTE_PER_DEVICE,
                    note=f"gpu.count {count}: the GPUs' memory is not known before they are placed, so members "
                    "are admitted on gpu.computePercent alone; give the pool gpu.memory to admit by memory")


def _age(member: Member) -> tuple[str, str]:
    return (member.created, member.name)


def _grew(member: Member, before: Member) -> bool:
    return member.memory_mib > before.memory_mib or member.compute_percent > before.compute_percent


def _conflict(capacity: Capacity, taken: Sequence[Member], member: Member) -> str | None:
    for other in taken:
        if member.model and other.model == member.model:
            return (f"serves model {member.model!r}, which member {other.name} already serves in pool "
                    f"{capacity.pool}; one repository holds each model name once: give one of them another "
                    "spec.model.name")
    account = next(((m.service_account, m.name) for m in taken if m.service_account), None)
    if member.service_account and account is not None and member.service_account != account[0]:
        return (f"fetches its files as service account {member.service_account!r}, but pool {capacity.pool}'s "
                f"pods run as {account[0]!r} (for member {account[1]}); pods have one service account: use "
                "the same spec.storage.serviceAccountName, or none")
    return None


def _fits(capacity: Capacity, taken: Sequence[Member], member: Member) -> bool:
    if capacity.memory_mib is not None and sum(m.memory_mib for m in taken) + member.memory_mib > capacity.memory_mib:
        return False
    return sum(m.compute_percent for m in taken) + member.compute_percent <= capacity.compute_percent


def _missing(capacity: Capacity, admitted: Sequence[Member], member: Member) -> str:
    """Why ``member`` does not fit next to ``admitted``: what it needs and what the pool has. It names the
    member's size now, never its history, so the next admission (which no longer counts it as admitted)
    gives the same text and the status does not change again."""
    pool = capacity.pool
    needs: list[str] = []
    has: list[str] = []
    memory = capacity.memory_mib
    if memory is not None and member.memory_mib > memory - sum(m.memory_mib for m in admitted):
        needs.append(format_mib(member.memory_mib))
        if member.memory_mib > memory:
            has.append(f"{format_mib(memory)} in all")
        else:
            has.append(f"{format_mib(memory - sum(m.memory_mib for m in admitted))} free of {format_mib(memory)}")
    compute_free = capacity.compute_percent - sum(m.compute_percent for m in admitted)
    if member.compute_percent > compute_free:
        needs.append(f"{member.compute_percent}% compute")
        has.append(f"{capacity.compute_percent}% compute in all" if member.compute_percent > capacity.compute_percent
                   else f"{compute_free}% compute free of {capacity.compute_percent}%")
    text = f"needs {' and '.join(needs)}, pool {pool} has {' and '.join(has)}"
    if any(part.endswith("in all") for part in has):
        return text + ": it can never fit; lower its share or give the pool a larger spec.gpu"
    return text


def refused(name: str, created: str, cause: str, problems: Iterable[str]) -> Waiting:
    """A member whose spec names the pool but that cannot be a candidate (``cause``
    :data:`INVALID_SPEC` or :data:`NOT_SERVED`): it waits, named with its problems, rather than vanish
    from the pool's status while its own still says it is admitted."""
    what = "its spec is invalid" if cause == INVALID_SPEC else "its spec cannot be served yet"
    return Waiting(Member(name=name, memory_mib=0, created=created), cause,
                   f"{what} ({'; '.join(problems)}); the pool admits it again once that is fixed")


def admit(capacity: Capacity, members: Iterable[Member], previously_admitted: Iterable[Member] = (),
          not_candidates: Iterable[Waiting] = ()) -> Admission:
    """Who shares the pool's device. ``previously_admitted`` is the last admission (names and the shares
    they were admitted with); ``members`` are the pool's members now; ``not_candidates`` (:func:`refused`)
    are members whose spec rules them out, listed among the waiting. See the module docstring."""
    before = {m.name: m for m in previously_admitted}
    ordered: list[Member] = []
    for member in sorted(members, key=_age):
        if all(m.name != member.name for m in ordered):
            ordered.append(member)
    names = {m.name for m in ordered}
    ruled_out = [w for w in not_candidates if w.member.name not in names]
    kept = [m for m in ordered if m.name in before and not _grew(m, before[m.name])]
    grown = [m for m in ordered if m.name in before and _grew(m, before[m.name])]
    new = [m for m in ordered if m.name not in before]
    taken: list[Member] = []
    for member in (*kept, *grown, *new):
        if _conflict(capacity, taken, member) is None and _fits(capacity, taken, member):
            taken.append(member)
    admitted = tuple(sorted(taken, key=_age))
    # Each waiting member's cause and reason are against the final admission (not what was taken when
    # it was considered): admitting again from this status then gives the same words.
    waiting = [
        Waiting(m, POOL_CONFLICT, conflict) if (conflict := _conflict(capacity, admitted, m)) is not None
        else Waiting(m, POOL_FULL, _missing(capacity, admitted, m))
        for m in ordered if m not in admitted
    ]
    return Admission(capacity, admitted, tuple(sorted((*waiting, *ruled_out), key=lambda w: _age(w.member))))


# ---------------------------------------------------------------- status (wire shape)

def status_to(admission: Admission) -> dict[str, Any]:
    """The pool's ``status.members``, ``status.waiting``, ``status.capacity`` and ``membersSummary``."""
    cap = admission.capacity
    capacity: dict[str, Any] = {
        "memoryMiB": cap.memory_mib, "usedMiB": admission.used_mib, "freeMiB": admission.free_mib,
        "computePercent": cap.compute_percent, "computePercentUsed": admission.compute_used,
        "summary": (f"{format_mib(admission.free_mib)} of {format_mib(cap.memory_mib)}"
                    if cap.memory_mib is not None and admission.free_mib is not None
                    else f"{cap.compute_percent - admission.compute_used}% compute"),
    }
    if cap.note:
        capacity["note"] = cap.note
    # an unknown quantity is left out, not written as null: a merge patch deletes a null, so the stored
    # status would never equal this one and every reconcile would write it again
    capacity = {key: value for key, value in capacity.items() if value is not None}
    return {
        "members": [{"name": m.name, "memoryMiB": m.memory_mib, "computePercent": m.compute_percent}
                    for m in admission.admitted],
        "waiting": [{"name": w.member.name, "cause": w.cause, "reason": w.reason} for w in admission.waiting],
        "capacity": capacity,
        "membersSummary": f"{len(admission.admitted)} admitted, {len(admission.waiting)} waiting",
    }


def admitted_from(status: Mapping[str, Any] | None) -> list[Member]:
    """The last admission from a pool's ``status`` (tolerant: entries it cannot read are skipped)."""
    result = []
    for entry in (status or {}).get("members") or []:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
            continue
        memory, compute = entry.get("memoryMiB"), entry.get("computePercent", 0)
        if isinstance(memory, int) and isinstance(compute, int):
            result.append(Member(name=entry["name"], memory_mib=memory, compute_percent=compute))
    return result


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a pool's last admission says about one member."""

    state: str
    """:data:`ADMITTED`, :data:`WAITING` or :data:`JOINING`."""
    cause: str = ""
    reason: str = ""


def verdict_from(status: Mapping[str, Any] | None, member: str) -> Verdict:
    """``member``'s place in the pool, per the pool's ``status``."""
    status = status or {}
    if any(isinstance(e, Mapping) and e.get("name") == member for e in status.get("members") or []):
        return Verdict(ADMITTED)
    for entry in status.get("waiting") or []:
        if isinstance(entry, Mapping) and entry.get("name") == member:
            return Verdict(WAITING, str(entry.get("cause") or POOL_FULL), str(entry.get("reason") or ""))
    return Verdict(JOINING)


def named_in(status: Mapping[str, Any] | None) -> set[str]:
    """Every member a pool's ``status`` names, admitted or waiting."""
    status = status or {}
    return {str(e["name"]) for key in ("members", "waiting") for e in status.get(key) or []
            if isinstance(e, Mapping) and "name" in e}
