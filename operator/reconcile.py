"""Reconcile one InferenceModel, Ensemble or ModelPool: gather -> decide (pure builders) -> apply -> status.

Level-triggered and idempotent: every call renders the full desired state from the current spec and
applies it, so a repeated call changes nothing, and a call after someone edited or deleted a child
puts it back. Status is computed from what the API returned and written in one patch, only when it
differs from what is stored. A spec the builders cannot satisfy becomes a Degraded condition (and a
Warning event) instead of an exception, and the children of the last good spec are left running.

A ModelPool's reconcile admits its members (``pools.admit``) and renders them into its Deployment; a
member's reconcile reads that verdict from the pool's status and renders only its Service. Each says in
:attr:`Outcome.then` whom a change concerns next (the pool's members; the pool a member left), and the
handlers reconcile those.

Callers: ``handlers`` (kopf). I/O goes through the :class:`Api` protocol (``kube.Kube`` implements it),
with an injected clock and event sink.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

from sluice.operator import api, builders, canary, conditions, gpus, inventory, placement, pools, sidecar
from sluice.operator.conditions import FALSE, TRUE, Condition
from sluice.operator.settings import Settings

Obj = dict[str, Any]
Clock = Callable[[], datetime.datetime]

# Answers to an apply that retrying cannot fix: reported as Degraded with the server's message.
REJECTIONS = {400: "ApplyRejected", 403: "Forbidden", 404: "KindNotServed", 422: "ApplyRejected"}
"""404 on an apply: the cluster does not serve that kind (KEDA or a router's CRDs are not installed)."""


class ApiError(Exception):
    """A non-success answer from the API server; ``status`` is the HTTP status."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        self.status = status
        self.reason = reason
        self.message = message
        super().__init__(f"{status} {reason}: {message}")


class Api(Protocol):
    """What the reconciler needs from the cluster (``kube.Kube`` in production)."""

    async def apply(self, obj: Mapping[str, Any]) -> Obj: ...
    async def get(self, kind: str, namespace: str, name: str) -> Obj | None: ...
    async def list(self, kind: str, namespace: str) -> list[Obj]: ...
    async def delete(self, kind: str, namespace: str, name: str, *, uid: str | None = None) -> bool: ...
    async def patch_status(
        self, kind: str, namespace: str, name: str, status: Mapping[str, Any],
    ) -> Obj | None: ...
    async def served(self, api_version: str, kind: str) -> bool: ...


class MetricsSource(Protocol):
    """Where the canary analysis reads per-track numbers (``sources`` has Prometheus and pod scraping)."""

    async def read(
        self, target: canary.Target, now: float,
    ) -> tuple[canary.VersionMetrics | None, canary.VersionMetrics | None]:
        """(canary, stable) over the last ``target.window_s``; ``None`` where nothing could be read."""
        ...


Gate = Callable[[str, Mapping[str, Any]], Awaitable[bool | None]]
"""Asks a gate webhook (URL, JSON payload): True for 2xx, False for a no, None when it could not be asked."""

log = logging.getLogger("sluice.operator")
ROUTER_DISCOVERY_SECONDS = 300.0
"""How long an ``auto`` router choice (API discovery) is trusted before it is looked up again."""


class EventSink(Protocol):
    def __call__(self, body: Mapping[str, Any], *, type: str, reason: str, message: str) -> None: ...


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one reconcile did; handlers log it and tests assert on the cluster instead."""

    status: Obj
    status_written: bool
    applied: int
    deleted: int
    requeue_after_s: float | None = None
    """Reconcile again after this long (a canary interval ends), sooner than the resync timer."""
    then: tuple[tuple[str, str], ...] = ()
    """(kind, name) in the same namespace to reconcile next, because their status follows from this
    one's: a pool's members after its admission or readiness changed, the pool a member left."""


class PoolNotFoundError(builders.UnsatisfiableError):
    """An InferenceModel's ``spec.pool`` names a ModelPool that does not exist."""

    def __init__(self, pool: str, namespace: str) -> None:
        self.pool = pool
        super().__init__([f"spec.pool: ModelPool {pool!r} does not exist in namespace {namespace!r}; create it "
                          "or fix spec.pool (the model's previous pods, if any, keep serving meanwhile)"])


@dataclasses.dataclass(frozen=True)
class _Membership:
    """A pool member's view of its pool, gathered by its reconcile."""

    pool: str
    verdict: pools.Verdict
    deployment: Obj | None
    """The pool's Deployment as the API has it."""
    degraded: Mapping[str, Any] | None = None
    """The pool's Degraded condition when it is True (its pods cannot be scheduled, its spec is invalid)."""


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What :meth:`Reconciler._decide` decided: objects, and what status needs beyond the Deployment."""

    desired: builders.Desired
    canary: _CanaryPass | None = None
    membership: _Membership | None = None
    """Set for an InferenceModel in a pool: its conditions follow the pool."""
    admission: pools.Admission | None = None
    """Set for a ModelPool."""
    placed: _Placed | None = None
    """Where the GPU planner put it (an InferenceModel with its own GPU need, or a ModelPool)."""
    sidecar: bool = False
    """An InferenceModel in Sidecar mode: only its config is rendered; the webhook injects it into pods."""


REPLAN_ANNOTATION = "sluice.dev/replan"
"""Change its value to have the GPU planner place a model again instead of keeping where it runs."""
GPU_PLACED = "GpuPlaced"
"""Condition type of a model with a GPU need: whether the planner found capacity for it."""
PLACEMENT_REASONS = {
    placement.PLACED: (TRUE, "Placed"), placement.PENDING: (FALSE, "CapacityFull"),
    placement.UNSATISFIABLE: (FALSE, "NoMatchingCapacity"), placement.UNPLANNED: (conditions.UNKNOWN, "NoInventory"),
}


@dataclasses.dataclass(frozen=True)
class _GpuView:
    """The cluster's GPUs as the planner sees them, read at ``read_at`` (reused for
    ``placement_refresh_seconds``); the models themselves are listed fresh on every plan, so a
    placement another model just wrote to its status is always honoured."""

    inventory: inventory.Inventory
    models: tuple[Obj, ...]
    read_at: float
    problem: str = ""


@dataclasses.dataclass(frozen=True)
class _Placed:
    verdict: placement.Verdict
    advice: tuple[placement.Advice, ...]
    request: placement.Request


@dataclasses.dataclass(frozen=True)
class _CanaryPass:
    """One canary decision and what it needs rendered and reported."""

    decision: canary.Decision
    rollout: builders.Rollout
    live_canary: Obj | None
    status: Obj


def _owner(body: Mapping[str, Any]) -> builders.Owner:
    meta = body["metadata"]
    return builders.Owner(kind=body["kind"], name=meta["name"], namespace=meta["namespace"], uid=meta.get("uid", ""))


def _rollout(deployment: Mapping[str, Any] | None) -> tuple[list[Condition], int, int]:
    """Ready/Progressing/Degraded from a Deployment as the API returned it, plus (replicas, ready)."""
    if not deployment:
        return [
            Condition(conditions.READY, FALSE, "DeploymentMissing", "The runtime Deployment does not exist yet."),
            Condition(conditions.PROGRESSING, TRUE, "Creating", "Creating the runtime Deployment."),
        ], 0, 0
    spec = deployment.get("spec", {})
    status = deployment.get("status", {}) or {}
    generation = deployment.get("metadata", {}).get("generation")
    wanted = int(spec.get("replicas", 1))
    replicas = int(status.get("replicas", 0))
    ready = int(status.get("readyReplicas", 0))
    updated = int(status.get("updatedReplicas", 0))
    available = int(status.get("availableReplicas", 0))
    observed = status.get("observedGeneration")
    result: list[Condition] = []
    if available >= 1:
        result.append(Condition(conditions.READY, TRUE, "Available",
                                f"{available} of {wanted} runtime replica(s) available."))
    else:
        result.append(Condition(conditions.READY, FALSE, "NoReplicasAvailable",
                                f"0 of {wanted} runtime replica(s) available; waiting for pods to pass "
                                "/v2/health/ready."))
    current = generation is None or observed == generation
    if current and updated >= wanted and replicas == updated and available >= wanted:
        result.append(Condition(conditions.PROGRESSING, FALSE, "RolloutComplete",
                                f"All {wanted} replica(s) run the current spec."))
    else:
        result.append(Condition(conditions.PROGRESSING, TRUE, "RollingOut",
                                f"{updated} of {wanted} replica(s) updated, {available} available."))
    stalled = next((c for c in status.get("conditions", []) or []
                    if c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"), None)
    if stalled:
        result.append(Condition(conditions.DEGRADED, TRUE, "ProgressDeadlineExceeded",
                                f"The rollout stalled: {stalled.get('message', '')} Check the runtime pods' "
                                "events and logs (image pull, model fetch, GPU capacity)."))
    return result, replicas, ready


def _traffic_summary(traffic: tuple[Obj, ...]) -> str:
    return ",".join(f"v{t['version']}={t['percent']}" for t in traffic)


class Reconciler:
    """Reconciles custom resources; one lock per object so a timer and a watch event never interleave."""

    def __init__(
        self, *, kube: Api, settings: Settings, clock: Clock, events: EventSink,
        metrics: MetricsSource | None = None, gate: Gate | None = None,
    ) -> None:
        self._kube = kube
        self._settings = settings
        self._clock = clock
        self._events = events
        self._metrics = metrics
        self._gate = gate
        self._locks: dict[tuple[str, str, str], asyncio.Lock] = {}
        self._router: tuple[str, float] | None = None
        self._gpu_view: _GpuView | None = None
        # (owner uid, kind, name) of children checked free of another live controller (see _name_clash):
        # once applied they carry this owner's controller reference, which a second owner then respects
        self._controlled: set[tuple[str, str, str]] = set()

    def _lock(self, body: Mapping[str, Any]) -> asyncio.Lock:
        meta = body["metadata"]
        key = (body["kind"], meta["namespace"], meta["name"])
        return self._locks.setdefault(key, asyncio.Lock())

    async def _name_clash(self, owner: builders.Owner, objects: Sequence[Obj]) -> str | None:
        """See :meth:`_name_clash_of`; objects this owner was seen controlling are not read again."""
        unseen = [obj for obj in objects if (owner.uid, obj["kind"], obj["metadata"]["name"]) not in self._controlled]
        if not unseen:
            return None
        clash = await self._name_clash_of(owner, unseen)
        if clash is None:
            self._controlled.update((owner.uid, obj["kind"], obj["metadata"]["name"]) for obj in unseen)
        return clash

    async def _name_clash_of(self, owner: builders.Owner, objects: Sequence[Obj]) -> str | None:
        """What stops ``owner`` from taking its objects: one of them is controlled by another live
        object (an Ensemble and an InferenceModel of the same name want the same Deployment). Applying
        would hand it from one to the other on every pass (one field manager), and deleting either
        would take the other's pods with it. An orphan (its owner gone) is adopted."""
        for obj in objects:
            meta = obj["metadata"]
            live = await self._kube.get(obj["kind"], meta.get("namespace") or owner.namespace, meta["name"])
            if live is None:
                continue
            refs = live.get("metadata", {}).get("ownerReferences") or []
            ref = next((r for r in refs if r.get("controller")), None)
            if ref is None or ((ref.get("uid") or "") == owner.uid and ref.get("kind") == owner.kind):
                continue
            other = None
            if ref.get("apiVersion") == api.API_VERSION and ref.get("kind") in api.OWNER_KINDS:
                other = await self._kube.get(ref["kind"], owner.namespace, ref.get("name", ""))
            elif ref.get("kind") and ref.get("name"):  # another controller's object: never taken
                return (f"{obj['kind']} {meta['name']!r} belongs to {ref['kind']} {ref['name']!r} "
                        f"({ref.get('apiVersion', '')}); rename this {owner.kind} or remove that object")
            if other is None or (other["metadata"].get("uid") or "") != (ref.get("uid") or ""):
                continue  # an orphan of an earlier object: the garbage collector's, or ours to adopt
            if other["metadata"].get("deletionTimestamp"):
                continue
            return (f"{obj['kind']} {meta['name']!r} belongs to {ref['kind']} {ref['name']!r} in this namespace; "
                    f"an {owner.kind} and {ref['kind']} of one name would take each other's objects: rename one")
        return None

    def forget(self, kind: str, namespace: str, name: str) -> None:
        """Drop per-object state once the object is gone (a scraping metrics source's readings too)."""
        self._locks.pop((kind, namespace, name), None)
        self._controlled.clear()  # rare (a delete): simpler than finding the owner's entries by name
        forget = getattr(self._metrics, "forget", None)
        if forget is not None and kind == api.INFERENCE_MODEL_KIND:
            forget(namespace, name)

    async def reconcile(self, body: Mapping[str, Any]) -> Outcome | None:
        """Reconcile the object ``body`` names; ``None`` if it is gone or being deleted."""
        async with self._lock(body):
            # Re-read under the lock: the caller's copy may predate a reconcile that just wrote status,
            # and comparing against stale status would write (and announce) the same change twice.
            meta = body["metadata"]
            fresh = await self._kube.get(body["kind"], meta["namespace"], meta["name"])
            if fresh is None or fresh["metadata"].get("deletionTimestamp"):
                return None
            body = fresh
            owner = _owner(body)
            try:
                plan = await self._decide(owner, body)
            except PoolNotFoundError as exc:
                pool = {"name": exc.pool, "state": pools.WAITING, "reason": "the ModelPool does not exist"}
                outcome = await self._report_problem(owner, body, "PoolNotFound", exc.problems, {"pool": pool})
                return dataclasses.replace(outcome, then=self._left_pool(body, exc.pool))
            except (api.SpecError, builders.UnsatisfiableError) as exc:
                reason = ("InvalidSpec" if isinstance(exc, api.SpecError)
                          else "NotImplemented" if isinstance(exc, builders.NotServedError) else "Unsatisfiable")
                if owner.kind != api.INFERENCE_MODEL_KIND:
                    return await self._report_problem(owner, body, reason, exc.problems)
                # A pool drops a member whose spec it cannot read: the member's status.pool says what the
                # pool says now (not the Admitted of its last good spec), or goes when it names no pool.
                membership = await self._unread_membership(body)
                outcome = await self._report_problem(
                    owner, body, reason, exc.problems, {"pool": membership} if membership else None,
                    drop=() if membership else ("pool",))
                return dataclasses.replace(outcome, then=self._left_pool(body, (membership or {}).get("name")))
            desired, rollout, placed = plan.desired, plan.canary, plan.placed
            clash = await self._name_clash(owner, desired.objects)
            if clash is not None:
                blocked = await self._report_problem(owner, body, "NameConflict", (clash,))
                # the other owner going away frees the names: look again soon (its children's deletion
                # events name that owner, not this one)
                return dataclasses.replace(blocked, requeue_after_s=NAME_CLASH_RETRY_S)
            applied = deleted = 0
            deployment: Obj | None = None
            for obj in desired.objects:
                try:
                    result = await self._kube.apply(obj)
                except ApiError as exc:
                    if exc.status not in REJECTIONS:
                        raise  # transient (5xx, 409, 429): kopf retries with backoff
                    problem = (f"the API server rejected {obj['kind']} {obj['metadata']['name']!r} "
                               f"({exc.status} {exc.reason}): {exc.message}")
                    if exc.status == 404:
                        problem = (f"the cluster does not serve {obj['kind']} ({obj['apiVersion']}), which this "
                                   "spec needs: install its CRDs (KEDA for scaling.engine keda; Gateway API or "
                                   "Istio for SLUICE_ROUTER) or choose another engine or router")
                    return await self._report_problem(owner, body, REJECTIONS[exc.status], (problem,))
                applied += 1
                if obj["kind"] == "Deployment" and obj["metadata"]["name"] == owner.name:
                    deployment = result  # the stable one: a canary's Deployment does not make the model Ready
            for _, kind, name in desired.absent:
                existing = await self._kube.get(kind, owner.namespace, name)
                if existing is not None and _owned_by(existing, owner):
                    deleted += await self._kube.delete(kind, owner.namespace, name,
                                                       uid=existing["metadata"].get("uid"))
            if plan.membership is not None:
                found, replicas, ready = _member_conditions(body, plan.membership)
            elif plan.sidecar:
                found, replicas, ready = _sidecar_conditions(owner, self._settings.webhook.port != 0), 0, 0
            else:
                found, replicas, ready = _rollout(deployment)
                if deployment is not None and ready < int((deployment.get("spec") or {}).get("replicas", 1)):
                    waiting = conditions.unschedulable(await self._pods(owner))
                    if waiting is not None:  # more telling than a stalled rollout: it names what is missing
                        found = [c for c in found if c.type != conditions.DEGRADED] + [waiting]
            if placed is not None:
                found += self._placement_conditions(placed, found)
            if not any(c.type == conditions.DEGRADED for c in found):
                if desired.notes:
                    found.append(Condition(conditions.DEGRADED, TRUE, "NotImplemented", " ".join(desired.notes)))
                elif plan.admission is not None and plan.admission.waiting:
                    found.append(Condition(conditions.DEGRADED, FALSE, "MembersWaiting", _waiting_message(
                        plan.admission)))
                else:
                    found.append(Condition(conditions.DEGRADED, FALSE, "AsExpected", "Nothing needs attention."))
            status: Obj = {
                "replicas": replicas,
                "readyReplicas": ready,
                "selector": desired.selector,
            }
            if plan.admission is not None:
                status["endpoints"] = {"http": desired.http_url, "grpc": desired.grpc_target}
                status.update(pools.status_to(plan.admission))
            else:
                status.update({
                    "url": desired.model_url,
                    "endpoints": {"http": desired.http_url, "grpc": desired.grpc_target},
                    "traffic": list(desired.traffic),
                    "trafficSummary": _traffic_summary(desired.traffic),
                })
            if plan.membership is not None:
                verdict = plan.membership.verdict
                status["pool"] = {"name": plan.membership.pool, "state": verdict.state, "reason": verdict.reason}
            if desired.placement is not None:
                status["placement"] = desired.placement
            requeue = None
            if placed is not None:
                status["placement"] = _placement_status(placed, body)
                if placed.verdict.state != placement.PLACED:
                    requeue = self._settings.placement_refresh_seconds  # capacity may free up
            if rollout is not None:
                status["canary"] = rollout.status
                if rollout.decision.requeue_after_s is not None:
                    requeue = min(requeue or rollout.decision.requeue_after_s, rollout.decision.requeue_after_s)
            outcome = await self._write_status(body, found, status)
            if rollout is not None and outcome.status_written:
                for action in rollout.decision.actions:
                    if isinstance(action, canary.Event):
                        self._events(body, type="Warning" if action.warning else "Normal", reason=action.reason,
                                     message=action.message)
            then: tuple[tuple[str, str], ...] = ()
            if plan.admission is not None and outcome.status_written:
                # The members' status follows the pool's admission and its Deployment: let them catch up.
                named = pools.named_in(body.get("status")) | pools.named_in(outcome.status)
                then = tuple((api.INFERENCE_MODEL_KIND, name) for name in sorted(named))
            elif owner.kind == api.INFERENCE_MODEL_KIND:
                then = self._left_pool(body, plan.membership.pool if plan.membership else None)
            return dataclasses.replace(outcome, applied=applied, deleted=deleted, requeue_after_s=requeue,
                                       then=then)

    @staticmethod
    def _left_pool(body: Mapping[str, Any], pool: str | None) -> tuple[tuple[str, str], ...]:
        """The pool a member's status still names when its spec names another one or none: that pool
        must drop it (the handlers also see the change, but may only see a later copy of the object)."""
        before = ((body.get("status") or {}).get("pool") or {}).get("name")
        return ((api.MODEL_POOL_KIND, before),) if isinstance(before, str) and before != pool else ()

    async def _pods(self, owner: builders.Owner) -> list[Obj]:
        """The runtime pods of ``owner`` (its Deployment's selector labels)."""
        labels = builders.selector_labels(owner)
        pods = await self._kube.list("Pod", owner.namespace)
        return [p for p in pods if all((p["metadata"].get("labels") or {}).get(k) == v for k, v in labels.items())]

    async def _decide(self, owner: builders.Owner, body: Mapping[str, Any]) -> _Plan:
        spec = body.get("spec") or {}
        if owner.kind == api.INFERENCE_MODEL_KIND:
            model = api.parse_inference_model(owner.name, spec)
            if model.pool is not None:
                return await self._member(owner, body, model)
            if model.mode == api.SIDECAR_MODE:
                return _Plan(sidecar.children(owner, model, self._settings), sidecar=True)
        # The live Deployment decides the replica count while an HPA takes the field over.
        live = await self._kube.get("Deployment", owner.namespace, owner.name)
        if owner.kind == api.INFERENCE_MODEL_KIND:
            placed = await self._place(owner, body, model.resources.gpu, model.scaling.min_replicas,
                                       model.canary is not None) if model.resources.gpu is not None else None
            stored = (body.get("status") or {}).get("canary")
            if model.canary is not None and stored and (why := canary.unfolded(model, canary.status_from(stored))):
                raise api.SpecError((why,))
            rollout = None
            if model.canary is not None or stored:
                rollout = await self._canary(owner, model, stored, live)
            desired = builders.inference_model(
                owner, model, self._settings, live=live, live_canary=rollout.live_canary if rollout else None,
                rollout=rollout.rollout if rollout else None, shape=placed.verdict.shape if placed else None)
            return _Plan(desired, canary=rollout, placed=placed)
        if owner.kind == api.MODEL_POOL_KIND:
            return await self._pool(owner, body, live)
        parsed = api.parse_ensemble(owner.name, spec)
        referenced: dict[str, api.InferenceModelSpec] = {}
        problems: list[str] = []
        for step in parsed.steps:
            if step.model_ref is None or step.model_ref in referenced:
                continue
            ref = await self._kube.get(api.INFERENCE_MODEL_KIND, owner.namespace, step.model_ref)
            if ref is None:
                continue  # the builder reports it with the step's path
            try:
                referenced[step.model_ref] = api.parse_inference_model(step.model_ref, ref.get("spec") or {})
            except api.SpecError as exc:
                problems.append(f"InferenceModel {step.model_ref!r} is invalid ({exc}); fix it first")
        if problems:
            raise builders.UnsatisfiableError(problems)
        return _Plan(builders.ensemble(owner, parsed, referenced, self._settings, live=live))

    # ------------------------------------------------------------ model pools

    async def _pool(self, owner: builders.Owner, body: Mapping[str, Any], live: Obj | None) -> _Plan:
        """Admit the pool's members (``pools.admit``, pure) and render the admitted ones."""
        pool = api.parse_model_pool(owner.name, body.get("spec") or {})
        members: list[pools.Member] = []
        refused: list[pools.Waiting] = []
        specs: dict[str, api.InferenceModelSpec] = {}
        for item in await self._kube.list(api.INFERENCE_MODEL_KIND, owner.namespace):
            meta = item.get("metadata") or {}
            if (item.get("spec") or {}).get("pool") != owner.name or meta.get("deletionTimestamp"):
                continue
            created = str(meta.get("creationTimestamp") or "")
            try:
                spec = api.parse_inference_model(meta["name"], item.get("spec") or {})
            except api.SpecError as exc:
                # not a candidate: listed as waiting with its problems (the member says Degraded InvalidSpec)
                refused.append(pools.refused(meta["name"], created, pools.INVALID_SPEC, exc.problems))
                continue
            if unserved := builders.unserved_formats([("spec.model", spec.model)]):
                # likewise (NotImplemented): its pods would never become ready, nor the pool's
                refused.append(pools.refused(meta["name"], created, pools.NOT_SERVED, unserved))
                continue
            if spec.resources.gpu is None or spec.resources.gpu.memory is None:
                continue  # parse_inference_model refuses a member without a memory share
            specs[meta["name"]] = spec
            members.append(pools.Member(
                name=meta["name"], memory_mib=pools.mib(spec.resources.gpu.memory, round_up=True),
                compute_percent=spec.resources.gpu.compute_percent or 0,
                created=created, model=spec.model.name,
                service_account=spec.storage.service_account_name,
            ))
        # The pool's device is placed like a model's; a gpu.count pool learns its GPUs' memory from it.
        placed = await self._place(owner, body, pool.gpu, pool.scaling.min_replicas, False)
        shape = placed.verdict.shape
        gpu_memory = shape.memory_mib if shape is not None and shape.memory_mib and pool.gpu.count else None
        if gpu_memory is None and pool.gpu.count:
            # The GPUs are not visible now (their nodes went away a while: a spot preemption, a node pool
            # replaced): keep the memory last seen for this spec, or the pool would admit on compute alone
            # meanwhile and, once the GPUs are back, keep whoever is oldest, evicting members that never grew.
            gpu_memory = _last_known_memory(body)
        capacity = pools.capacity(owner.name, pool.gpu, gpu_memory_mib=gpu_memory)
        admission = pools.admit(capacity, members, pools.admitted_from(body.get("status")), refused)
        desired = builders.model_pool(
            owner, pool, [(m.name, specs[m.name]) for m in sorted(admission.admitted, key=lambda m: m.name)],
            self._settings, service_account=admission.service_account, live=live, shape=shape)
        return _Plan(desired, admission=admission, placed=placed)

    async def _member(self, owner: builders.Owner, body: Mapping[str, Any], model: api.InferenceModelSpec) -> _Plan:
        """An InferenceModel in a pool: its Service, and its verdict from the pool's last admission."""
        assert model.pool is not None
        found = await self._kube.get(api.MODEL_POOL_KIND, owner.namespace, model.pool)
        if found is None or found["metadata"].get("deletionTimestamp"):
            raise PoolNotFoundError(model.pool, owner.namespace)
        pool = _owner(found)
        had_canary = bool((body.get("status") or {}).get("canary"))
        desired = builders.pool_member(owner, model, pool, self._settings, had_canary=had_canary)
        verdict = pools.verdict_from(found.get("status"), owner.name)
        deployment = await self._kube.get("Deployment", owner.namespace, model.pool)
        degraded = conditions.find((found.get("status") or {}).get("conditions"), conditions.DEGRADED)
        return _Plan(desired, membership=_Membership(
            model.pool, verdict, deployment, degraded if (degraded or {}).get("status") == TRUE else None))

    # ------------------------------------------------------------ GPU placement

    async def _view(self) -> _GpuView:
        """Nodes, pods and DRA objects, reused for ``placement_refresh_seconds``; the InferenceModels and
        ModelPools that need GPUs are listed fresh every time."""
        now = self._clock().timestamp()
        namespaces = self._settings.namespaces or ("",)
        models: list[Obj] = []
        for namespace in namespaces:
            models += await self._kube.list(api.INFERENCE_MODEL_KIND, namespace)
            models += await self._kube.list(api.MODEL_POOL_KIND, namespace)
        view = self._gpu_view
        if view is not None and now - view.read_at < self._settings.placement_refresh_seconds:
            return dataclasses.replace(view, models=tuple(models))
        problem = ""
        try:
            nodes = await self._kube.list("Node", "")
            pods = await self._kube.list("Pod", "")
        except ApiError as exc:
            if exc.status != 403:
                raise
            nodes, pods = [], []
            problem = ("the operator may not list Nodes and Pods cluster-wide (403): grant it the chart's "
                       "discovery ClusterRole")
        # Only the workloads the plan books itself: the pods of one whose spec turned invalid, that is being
        # deleted or lost its GPU still hold their devices (its Deployment keeps running), so they count.
        planned = {(m["metadata"]["namespace"], m["kind"], m["metadata"]["name"]) for m in models if _books_gpu(m)}

        def ours(obj: Mapping[str, Any]) -> bool:
            """A runtime pod (or DRA claim) of a workload the plan books itself."""
            meta = obj.get("metadata") or {}
            labels = meta.get("labels") or {}
            if labels.get("app.kubernetes.io/managed-by") != builders.MANAGED_BY:
                return False
            return any((meta.get("namespace"), kind, labels.get("sluice.dev/" + kind.lower())) in planned
                       for kind in (api.INFERENCE_MODEL_KIND, api.MODEL_POOL_KIND))

        if self._settings.gpu_allocation == "dra":
            slices = await self._kube.list("ResourceSlice", "")
            claims = await self._kube.list("ResourceClaim", "")
            found = inventory.from_resource_slices(slices, claims, nodes, planned=ours)
        else:
            found = inventory.from_nodes(nodes, pods, planned=ours)
        self._gpu_view = _GpuView(inventory=found, models=tuple(models), read_at=now, problem=problem)
        return self._gpu_view

    async def _place(
        self, owner: builders.Owner, body: Mapping[str, Any], gpu: api.Gpu, min_replicas: int, canary_spec: bool,
    ) -> _Placed:
        """Plan every GPU need (InferenceModels with their own, ModelPools) and return ``owner``'s
        (``placement.plan`` is pure; this gathers). Pool members are not planned: they share their pool's."""
        view = await self._view()
        key = _request_key(owner.kind, owner.namespace, owner.name)
        requests: dict[str, placement.Request] = {}
        for other in view.models:
            meta = other["metadata"]
            if (other.get("kind"), meta.get("namespace"), meta.get("name")) == (owner.kind, owner.namespace,
                                                                                 owner.name):
                continue
            if meta.get("deletionTimestamp"):
                continue
            try:
                if other.get("kind") == api.MODEL_POOL_KIND:
                    pool = api.parse_model_pool(meta["name"], other.get("spec") or {})
                    need, replicas, has_canary = pool.gpu, pool.scaling.min_replicas, False
                else:
                    parsed = api.parse_inference_model(meta["name"], other.get("spec") or {})
                    if parsed.pool is not None or parsed.resources.gpu is None or parsed.mode == api.SIDECAR_MODE:
                        continue  # a Sidecar model's GPU is its application pods' (held by them, not planned)
                    need, replicas, has_canary = parsed.resources.gpu, parsed.scaling.min_replicas, \
                        parsed.canary is not None
            except api.SpecError:
                continue  # reported on that object; it holds nothing it was not placed on
            request = _request(str(other.get("kind")), meta, other.get("status") or {}, need, replicas, has_canary)
            requests[request.key] = request
        mine = _request(owner.kind, body["metadata"], body.get("status") or {}, gpu, min_replicas, canary_spec)
        requests[key] = mine
        field = "spec.resources.gpu" if owner.kind == api.INFERENCE_MODEL_KIND else "spec.gpu"
        if gpu.mig_profile and not view.inventory.empty:
            offered = _offered_profiles(view.inventory)
            if gpu.mig_profile not in {p for profiles in offered.values() for p in profiles}:
                listing = "; ".join(f"{model}: {', '.join(profiles)}" for model, profiles in sorted(offered.items()))
                raise api.SpecError([
                    f"{field}.migProfile: {gpu.mig_profile!r} is not a MIG profile of any GPU in this "
                    f"cluster; " + (f"its GPUs offer {listing}" if listing else "it has no MIG-capable GPU")
                    + "; or ask by memory (gpu.memory) to get the smallest profile that fits"])
        result = placement.plan(view.inventory, list(requests.values()))
        verdict = result.verdicts[key]
        if verdict.state == placement.UNPLANNED and view.problem:
            verdict = dataclasses.replace(verdict, reason=view.problem)
        advice = tuple(a for a in result.advice if key in a.serves)
        return _Placed(verdict=verdict, advice=advice, request=mine)

    def _placement_conditions(self, placed: _Placed, found: list[Condition]) -> list[Condition]:
        verdict = placed.verdict
        status, reason = PLACEMENT_REASONS[verdict.state]
        if verdict.state == placement.PLACED:
            where = f" on {', '.join(verdict.pools)}" if verdict.pools else ""
            message = f"{verdict.shape.describe() if verdict.shape else 'GPU'}{where}: {verdict.reason}."
        elif verdict.state == placement.UNPLANNED:
            message = f"Rendered from the spec alone: {verdict.reason}."
        else:
            message = f"No GPU capacity for this model now: {verdict.reason}."
            message += (" It runs once that capacity frees up." if verdict.state == placement.PENDING else
                        " Add nodes with such GPUs, repartition MIG, or ask for less (gpu.memory picks the "
                        "smallest device that fits).")
            if placed.advice:
                message += (f" A MIG repartitioning would fit it (status.placement.advice: "
                            f"{', '.join(a.node for a in placed.advice)}).")
        result = [Condition(GPU_PLACED, status, reason, message)]
        if verdict.state in (placement.PENDING, placement.UNSATISFIABLE):
            # More telling than the scheduler's Unschedulable: it names the capacity that is missing.
            for condition in [c for c in found if c.type == conditions.DEGRADED and c.reason == "Unschedulable"]:
                found.remove(condition)
            if not any(c.type == conditions.DEGRADED for c in found):
                result.append(Condition(conditions.DEGRADED, TRUE, reason, message))
        return result

    # ------------------------------------------------------------ canary rollouts

    async def _canary(
        self, owner: builders.Owner, spec: api.InferenceModelSpec, stored: Any, live: Obj | None,
    ) -> _CanaryPass:
        """Observe, decide (``canary.step``, pure) and say what to render. No writes happen here."""
        plan = canary.plan_of(spec)
        before = canary.status_from(stored)
        now = self._clock().timestamp()
        live_canary = await self._kube.get("Deployment", owner.namespace, builders.instance(owner, builders.CANARY))
        observation = canary.Observation(
            canary_ready=_runs(live_canary, before.candidate, fully=False),
            canary_serving=_canary_serves(live_canary, before.candidate),
            stable_rolled_out=plan is not None and _runs(live, plan.candidate, fully=True),
        )
        metrics: tuple[canary.VersionMetrics | None, canary.VersionMetrics | None] = (None, None)
        analysis = plan.analysis if plan is not None else None
        judging = before.phase == canary.PROGRESSING or (before.phase == canary.INITIALIZING
                                                          and observation.canary_ready)
        if analysis is not None and judging and plan is not None and plan.candidate == before.candidate:
            target = canary.Target(
                namespace=owner.namespace, name=owner.name, model=spec.model.name,
                stable_instance=builders.instance(owner), canary_instance=builders.instance(owner, builders.CANARY),
                window_s=analysis.interval_s)
            if self._metrics is not None:
                try:
                    metrics = await self._metrics.read(target, now)
                except canary.NoBaseline:  # a first reading (the operator started): the interval starts again
                    observation = dataclasses.replace(observation, no_baseline=True)
                except Exception as exc:  # a broken source is an outage: inconclusive, never a pass
                    log.warning("Canary metrics for %s/%s could not be read: %r", owner.namespace, owner.name, exc)
            stable = metrics[1]
            if before.weight >= 100 and (stable is None or stable.p99_ms is None or stable.p99_ms != stable.p99_ms):
                # At 100 % the stable track serves nothing, so it has no p99 of its own: compare the
                # canary with the stable p99 of the last judged interval (no such value: Inconclusive).
                remembered = _remembered_p99(stored)
                stable = canary.VersionMetrics(requests=stable.requests if stable else 0.0,
                                               errors=stable.errors if stable else 0.0, p99_ms=remembered)
            observation = dataclasses.replace(observation, canary=metrics[0], stable=stable)
        decision = canary.step(plan, before, observation, now)
        asks = [a for a in decision.actions if isinstance(a, canary.AskGate)]
        gate_url = spec.canary.analysis.gate_url if spec.canary and spec.canary.analysis else None
        answer: bool | None = None
        if asks and gate_url and self._gate is not None:
            payload = {
                "name": owner.name, "namespace": owner.namespace, "candidate": before.candidate,
                "purpose": asks[0].purpose, "phase": before.phase, "step": before.step, "weight": before.weight,
            }
            answer = await self._gate(gate_url, payload)
            decision = canary.step(plan, before, dataclasses.replace(observation, gate=answer), now)
        after = decision.status
        router = await self._route_via(stored) if after.phase in canary.ACTIVE else ""
        promoted = (plan is not None and after.candidate == plan.candidate
                    and after.phase in (canary.PROMOTING, canary.FINALISING, canary.SUCCEEDED))
        rollout = builders.Rollout(
            candidate=after.candidate, canary=after.phase in canary.ACTIVE, promoted=promoted,
            weight=after.weight if after.phase in canary.ACTIVE else 0, router=router or "none",
            routed=after.phase in canary.ACTIVE)
        status: Obj = {**canary.status_to(after), "router": router}
        old_metrics = stored.get("lastMetrics") if isinstance(stored, dict) else None
        if decision.judged and analysis is not None:  # not when a hold ended or an interval restarted
            status["lastMetrics"] = {"canary": _metrics_status(observation.canary),
                                     "stable": _metrics_status(observation.stable)}
        elif old_metrics and after.phase != canary.INITIALIZING:
            status["lastMetrics"] = old_metrics
        if asks and answer is not True:
            status["gate"] = ("not configured: set spec.canary.analysis.gates.url" if not gate_url
                              else "could not be asked" if answer is None
                              else "did not approve (not a 2xx, a timeout or unreachable; the operator log says which)")
        status["summary"] = _canary_summary(after, analysis)
        status["help"] = _canary_help(after, spec)
        return _CanaryPass(decision=decision, rollout=rollout, live_canary=live_canary, status=status)

    async def _route_via(self, stored: Any) -> str:
        """The router of this rollout: the one it started with (kept in status), else the setting, else
        API discovery (Gateway API, then Istio, else the runtime's own split), cached a while."""
        if isinstance(stored, dict) and stored.get("router") in builders.ROUTERS and stored.get("phase"):
            return str(stored["router"])
        if self._settings.router in builders.ROUTERS:
            return self._settings.router
        now = self._clock().timestamp()
        if self._router is not None and now - self._router[1] < ROUTER_DISCOVERY_SECONDS:
            return self._router[0]
        found = "none"
        if await self._kube.served("gateway.networking.k8s.io/v1", "HTTPRoute"):
            found = "gateway-api"
        elif await self._kube.served("networking.istio.io/v1beta1", "VirtualService"):
            found = "istio"
        self._router = (found, now)
        return found

    async def _unread_membership(self, body: Mapping[str, Any]) -> Obj | None:
        """``status.pool`` of an InferenceModel whose spec could not be rendered: the verdict of the pool its
        spec names, as that pool's status has it; ``None`` when the spec names no pool."""
        name = (body.get("spec") or {}).get("pool")
        if not isinstance(name, str) or not name:
            return None
        found = await self._kube.get(api.MODEL_POOL_KIND, body["metadata"]["namespace"], name)
        if found is None or found["metadata"].get("deletionTimestamp"):
            return {"name": name, "state": pools.WAITING, "reason": "the ModelPool does not exist"}
        verdict = pools.verdict_from(found.get("status"), body["metadata"]["name"])
        return {"name": name, "state": verdict.state, "reason": verdict.reason}

    async def _report_problem(
        self, owner: builders.Owner, body: Mapping[str, Any], reason: str, problems: tuple[str, ...],
        fields: Mapping[str, Any] | None = None, drop: tuple[str, ...] = (),
    ) -> Outcome:
        # Keep whatever the last good spec created running; report on it and on the problem (only on a
        # Deployment this owner controls: under a NameConflict the one of that name is another's).
        deployment = await self._kube.get("Deployment", owner.namespace, owner.name)
        if deployment is not None and not _owned_by(deployment, owner):
            deployment = None
        found, replicas, ready = _rollout(deployment)
        found = [c for c in found if c.type == conditions.READY]
        membership = (fields or {}).get("pool")
        if deployment is None and (body.get("spec") or {}).get("mode") == api.SIDECAR_MODE:
            # no Deployment is expected: what matters is that no pod gets the runtime of this spec
            found = [Condition(conditions.READY, FALSE, reason,
                               "Not injected: the webhook injects a Sidecar model only once its config is rendered.")]
        elif deployment is None and isinstance(membership, Mapping):
            # a pool member: no Deployment of its own is expected, and the pool does not serve this spec
            found = [Condition(conditions.READY, FALSE, reason,
                               f"Not served by pool {membership.get('name')}: it serves no spec it cannot read.")]
        verb = {"InvalidSpec": "The spec is invalid", "Unsatisfiable": "The spec cannot be served",
                "NotImplemented": "The spec cannot be served yet"}.get(
            reason, "The children could not be applied")
        message = f"{verb}: {'; '.join(problems)}."
        found += [
            Condition(conditions.PROGRESSING, FALSE, reason, "Waiting for a spec that can be served."),
            Condition(conditions.DEGRADED, TRUE, reason, message),
        ]
        old = body.get("status") or {}
        status = {k: old[k] for k in old if k not in ("conditions", "observedGeneration", *drop)}
        status.update({"replicas": replicas, "readyReplicas": ready, **(fields or {})})
        return await self._write_status(body, found, status)

    async def _write_status(self, body: Mapping[str, Any], found: list[Condition], fields: Obj) -> Outcome:
        old: Mapping[str, Any] = body.get("status") or {}
        generation = body["metadata"].get("generation")
        merged = conditions.merge(old.get("conditions"), found, generation=generation, now=self._clock())
        new: Obj = {**fields, "conditions": merged}
        if generation is not None:
            new["observedGeneration"] = generation
        if dict(old) == new:
            return Outcome(status=new, status_written=False, applied=0, deleted=0)
        patch = merge_patch(old, new)
        meta = body["metadata"]
        if await self._kube.patch_status(body["kind"], meta["namespace"], meta["name"], patch) is None:
            return Outcome(status=new, status_written=False, applied=0, deleted=0)  # deleted meanwhile
        self._emit_transitions(body, old.get("conditions"), merged)
        return Outcome(status=new, status_written=True, applied=0, deleted=0)

    def _emit_transitions(self, body: Mapping[str, Any], old: Any, new: list[Obj]) -> None:
        """One Kubernetes Event per condition that flipped (or changed reason while Degraded)."""
        for condition in new:
            before = conditions.find(old, condition["type"])
            flipped = before is None or before.get("status") != condition["status"]
            degraded_changed = (
                condition["type"] == conditions.DEGRADED and condition["status"] == TRUE
                and before is not None and before.get("message") != condition["message"]
            )
            if not (flipped or degraded_changed):
                continue
            if condition["type"] == conditions.READY:
                if before is None and condition["status"] != TRUE:
                    continue  # "not ready yet" on creation is no news
                warning = condition["status"] != TRUE
            elif condition["type"] == conditions.DEGRADED:
                warning = condition["status"] == TRUE
                if not warning and before is None:
                    continue  # "not degraded" on creation is no news
            else:
                continue  # Progressing flips on every rollout; the Deployment's own events cover it
            self._events(body, type="Warning" if warning else "Normal", reason=condition["reason"],
                          message=condition["message"])


def _request_key(kind: str, namespace: str, name: str) -> str:
    return f"{kind}/{namespace}/{name}"


def _request(
    kind: str, meta: Mapping[str, Any], status: Mapping[str, Any], gpu: api.Gpu, min_replicas: int,
    canary_spec: bool,
) -> placement.Request:
    """A GPU need as the planner takes it, with the placement it has (its pin) from status."""
    replicas = max(min_replicas, _as_int(status.get("replicas")))
    stored_canary = status.get("canary")
    phase = stored_canary.get("phase") if isinstance(stored_canary, dict) else None
    if canary_spec and phase in canary.ACTIVE:
        replicas += min_replicas  # the candidate's own pods take the same kind of device
    request = placement.Request(
        key=_request_key(kind, str(meta.get("namespace")), str(meta.get("name"))), replicas=replicas,
        count=gpu.count or 0, profile=gpu.mig_profile or "", memory_mib=gpu.memory_mib(),
        compute_percent=gpu.compute_percent or 0, shared=gpu.shared, created=str(meta.get("creationTimestamp", "")),
    )
    stored = status.get("placement")
    token = ((meta.get("annotations") or {}).get(REPLAN_ANNOTATION) or "")
    # Only a device the model holds is its pin: the device a Pending plan waits for is planned afresh each time
    # (pinned to it, the model would wait there while other capacity frees up elsewhere).
    if not isinstance(stored, dict):
        return request
    held = stored.get("held", stored.get("state") == placement.PLACED) is True
    if held and stored.get("kind") and stored.get("replanToken", "") == token:
        try:
            shape = placement.Shape(
                kind=str(stored["kind"]), resource=str(stored["resource"]), count=int(stored.get("count", 1)),
                profile=str(stored.get("profile", "")), products=tuple(str(p) for p in stored.get("products", ())),
                memory_mib=int(stored.get("memoryMiB", 0)),
                tolerations=tuple(dict(t) for t in stored.get("tolerations", ()) if isinstance(t, dict)),
                avoid=tuple(str(p) for p in stored.get("avoidProducts", ())))
        except (KeyError, TypeError, ValueError):
            return request
        if shape.count < 1:  # a hand-edited status: no pin (a count of 0 divided by zero in the planner)
            return request
        request = dataclasses.replace(request, pinned=shape, pinned_for=str(stored.get("need", "")))
    return request


def _as_int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _offered_profiles(found: inventory.Inventory) -> dict[str, tuple[str, ...]]:
    """GPU model (catalogue key, else the product label) -> the MIG profiles its GPUs can be partitioned
    into (the catalogue's for a MIG-capable GPU, plus whatever a node publishes)."""
    result: dict[str, set[str]] = {}
    for node in found.nodes:
        model = gpus.CATALOGUE_BY_KEY.get(node.model)
        offered = result.setdefault(node.model or node.product, set())
        if model is not None and model.mig_capable:
            offered.update(p.name for p in model.profiles)
        offered.update(d.profile for d in node.devices if d.profile)
    return {key: tuple(sorted(names, key=gpus.profile_sort_key)) for key, names in result.items() if names}


def _placement_status(placed: _Placed, body: Mapping[str, Any]) -> Obj:
    """``status.placement``: where the GPU planner put the model and why; its shape is the pin."""
    verdict = placed.verdict
    token = ((body["metadata"].get("annotations") or {}).get(REPLAN_ANNOTATION) or "")
    result: Obj = {"state": verdict.state, "reason": verdict.reason, "need": placed.request.signature()}
    shape = verdict.shape
    if shape is not None:
        result.update({
            "device": shape.describe(), "kind": shape.kind, "resource": shape.resource, "count": shape.count,
            "memoryMiB": shape.memory_mib,
        })
        if shape.profile:
            result["profile"] = shape.profile
        if shape.products:
            result["products"] = list(shape.products)
        if shape.tolerations:
            result["tolerations"] = [dict(t) for t in shape.tolerations]
        if shape.avoid:
            result["avoidProducts"] = list(shape.avoid)
    if verdict.pools:
        result["nodePools"] = list(verdict.pools)
    if verdict.nodes:
        result["nodes"] = sorted(set(verdict.nodes))[:10]
    if token:
        result["replanToken"] = token
    if shape is not None:
        result["held"] = verdict.state == placement.PLACED or verdict.kept
    if placed.advice and verdict.state != placement.PLACED:
        result["advice"] = [{
            "node": a.node, "migConfig": a.config,
            "layout": [_layout_text(layout) for layout in a.layouts],
            "disruptsGpus": list(a.disrupts),
            "howTo": (f"add mig-configs.{a.config} (status.placement.advice[].migParted) to MIG manager's config, "
                      f"drain the GPU pods of node {a.node}, then: kubectl label node {a.node} "
                      f"nvidia.com/mig.config={a.config} --overwrite"),
            "migParted": json.dumps(a.mig_parted(), sort_keys=True),
        } for a in placed.advice[:3]]
    return result


def _layout_text(layout: Any) -> str:
    counts: dict[str, int] = {}
    for profile, _ in layout:
        counts[profile] = counts.get(profile, 0) + 1
    return " + ".join(f"{n}x{p}" for p, n in counts.items()) or "whole GPU (MIG off)"


def _runs(deployment: Mapping[str, Any] | None, candidate: str, *, fully: bool) -> bool:
    """Whether ``deployment`` runs ``candidate`` on every pod it has (no pod of an older template left)
    with at least one available (``fully``: all of its wanted replicas available)."""
    if not deployment or not candidate:
        return False
    meta = deployment.get("metadata") or {}
    if (meta.get("annotations") or {}).get(builders.CANDIDATE_ANNOTATION) != candidate:
        return False
    status = deployment.get("status") or {}
    if meta.get("generation") is not None and status.get("observedGeneration") != meta.get("generation"):
        return False
    replicas = int(status.get("replicas", 0))
    available = int(status.get("availableReplicas", 0))
    if int(status.get("updatedReplicas", 0)) < replicas:
        return False
    wanted = int((deployment.get("spec") or {}).get("replicas", 1))
    return available >= (wanted if fully else 1)


def _books_gpu(obj: Mapping[str, Any]) -> bool:
    """Whether the plan books a GPU for this InferenceModel or ModelPool (as ``_place`` builds its requests)."""
    meta = obj.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return False
    try:
        if obj.get("kind") == api.MODEL_POOL_KIND:
            api.parse_model_pool(meta.get("name", ""), obj.get("spec") or {})
            return True
        parsed = api.parse_inference_model(meta.get("name", ""), obj.get("spec") or {})
    except api.SpecError:
        return False
    return parsed.pool is None and parsed.resources.gpu is not None and parsed.mode != api.SIDECAR_MODE


def merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> Obj:
    """The JSON merge patch (RFC 7386) that turns ``old`` into ``new``: keys gone at any depth are written
    as null (a merge patch that only carries ``new`` keeps nested keys ``new`` dropped)."""
    patch: Obj = {key: None for key in old if key not in new}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            nested = merge_patch(before, value)
            if nested:
                patch[key] = nested
        elif key not in old or before != value:
            patch[key] = value
    return patch


def _canary_serves(deployment: Mapping[str, Any] | None, candidate: str) -> bool:
    """Whether ``deployment`` (annotated with ``candidate``) has an available pod, also while a change of
    its template rolls them: once the candidate's rollout was ready, every pod it has is the candidate's."""
    if not deployment or not candidate:
        return False
    meta = deployment.get("metadata") or {}
    if (meta.get("annotations") or {}).get(builders.CANDIDATE_ANNOTATION) != candidate:
        return False
    return int((deployment.get("status") or {}).get("availableReplicas", 0)) >= 1


def _remembered_p99(stored: Any) -> float | None:
    """The stable p99 of the last judged interval, from ``status.canary.lastMetrics``."""
    try:
        value = stored["lastMetrics"]["stable"]["p99Milliseconds"]
    except (KeyError, TypeError):
        return None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _metrics_status(metrics: canary.VersionMetrics | None) -> Obj | None:
    if metrics is None:
        return None
    result: Obj = {"requests": _finite(metrics.requests), "errors": _finite(metrics.errors)}
    rate = metrics.error_rate
    result["errorRatePercent"] = _finite(rate * 100)
    if metrics.p99_ms is not None:
        result["p99Milliseconds"] = _finite(metrics.p99_ms)
    return result


def _finite(value: float) -> float | None:
    """JSON has no NaN: status shows it as null (the analysis read NaN, and its message says so)."""
    return round(value, 3) if value == value and abs(value) != float("inf") else None


def _canary_summary(status: canary.Status, analysis: canary.Analysis | None) -> str:
    """One word for ``kubectl get im`` (the Canary column), e.g. ``Progressing 2/4``."""
    if status.phase == canary.PROGRESSING and analysis is not None:
        return f"{status.phase} {status.step + 1}/{len(analysis.step_weights)}"
    return status.phase


def _canary_help(status: canary.Status, spec: api.InferenceModelSpec) -> str:
    """What to change in the spec (the operator never writes it) to finish by hand or to abort."""
    if status.phase == canary.SUCCEEDED and spec.canary is None:
        return ""  # folded in (or given up): nothing left to do
    if status.phase == canary.SUCCEEDED:
        return ("Promoted. Copy spec.canary's storageUri, version and config into spec.model (and its runtime, "
                "if it set one, into spec.runtime) and remove spec.canary in one change: the pods will not roll "
                "again. Removing spec.canary alone rolls the stable pods back to spec.model; a next candidate "
                "waits until this one is in spec.model.")
    if status.phase == canary.ROLLED_BACK:
        return "Rolled back. Change spec.canary to try another candidate, or remove it."
    if status.phase in canary.ACTIVE:
        return ("To abort: remove spec.canary (all traffic goes back to stable first). To promote by hand: "
                "copy spec.canary into spec.model and remove spec.canary.")
    return ""


NAME_CLASH_RETRY_S = 30.0
"""How soon an owner blocked by a NameConflict looks again (the other owner may be gone by then)."""


def _last_known_memory(body: Mapping[str, Any]) -> int | None:
    """The GPU memory a pool's status last recorded, while its spec is still the one it was recorded for."""
    status = body.get("status") or {}
    if status.get("observedGeneration") != body.get("metadata", {}).get("generation"):
        return None
    memory = (status.get("capacity") or {}).get("memoryMiB")
    return memory if isinstance(memory, int) and not isinstance(memory, bool) and memory > 0 else None


def _member_conditions(body: Mapping[str, Any], membership: _Membership) -> tuple[list[Condition], int, int]:
    """A pool member's conditions and replica counts: its verdict, then the pool's Deployment."""
    pool, verdict = membership.pool, membership.verdict
    if verdict.state == pools.WAITING and verdict.cause in pools.RULED_OUT:
        # the pool has not seen the fixed spec yet (it reconciles next): no advice about room
        return [
            Condition(conditions.READY, FALSE, verdict.cause, f"Not served: pool {pool} dropped the model."),
            Condition(conditions.PROGRESSING, TRUE, "JoiningPool", f"Waiting for pool {pool} to admit the model."),
        ], 0, 0
    if verdict.state == pools.WAITING:
        return [
            Condition(conditions.READY, FALSE, verdict.cause, f"Not served: waiting for room in pool {pool}."),
            Condition(conditions.PROGRESSING, FALSE, verdict.cause, f"Waiting for room in pool {pool}."),
            Condition(conditions.DEGRADED, TRUE, verdict.cause, f"Pool {pool} cannot take the model: "
                      f"{verdict.reason}. Free room (lower a member's gpu.memory or gpu.computePercent, or move a "
                      "member out of the pool) or give the pool a larger spec.gpu; the model is admitted as soon "
                      "as it fits."),
        ], 0, 0
    if verdict.state == pools.JOINING:
        joining = [
            Condition(conditions.READY, FALSE, "JoiningPool", f"Pool {pool} has not admitted the model yet."),
            Condition(conditions.PROGRESSING, TRUE, "JoiningPool", f"Waiting for pool {pool} to admit the model."),
        ]
        if membership.degraded is not None:  # a pool that cannot reconcile (invalid spec) admits no one
            joining.append(Condition(conditions.DEGRADED, TRUE, str(membership.degraded.get("reason") or
                                                                    "PoolDegraded"),
                                     f"Pool {pool}: {membership.degraded.get('message', '')}"))
        return joining, 0, 0
    deployment = membership.deployment
    found, replicas, ready = _rollout(deployment)
    found = [c for c in found if c.type != conditions.READY]
    for index, condition in enumerate(found):
        if condition.type == conditions.DEGRADED:
            found[index] = dataclasses.replace(condition, message=f"Pool {pool}: {condition.message}")
    if membership.degraded is not None and not any(c.type == conditions.DEGRADED for c in found):
        # What troubles the pool troubles its members (pods that cannot be scheduled, an invalid pool spec).
        found.append(Condition(conditions.DEGRADED, TRUE, str(membership.degraded.get("reason") or "PoolDegraded"),
                               f"Pool {pool}: {membership.degraded.get('message', '')}"))
    previous = (body.get("status") or {}).get("pool") or {}
    was_ready = previous.get("state") == pools.ADMITTED and previous.get("name") == pool and \
        (conditions.find((body.get("status") or {}).get("conditions"), conditions.READY) or {}).get("status") == TRUE
    label = builders.member_label(body["metadata"]["name"])
    if _serves(deployment, label, was_ready=was_ready):
        available = int(((deployment or {}).get("status") or {}).get("availableReplicas", 0))
        found.insert(0, Condition(conditions.READY, TRUE, "ServedByPool",
                                  f"Served by pool {pool}: {available} runtime replica(s) available."))
    elif deployment is None:
        found.insert(0, Condition(conditions.READY, FALSE, "PoolDeploymentMissing",
                                  f"Admitted to pool {pool}, whose Deployment does not exist yet."))
    else:
        found.insert(0, Condition(conditions.READY, FALSE, "LoadingInPool",
                                  f"Admitted to pool {pool}; waiting for its pods to load the model (they roll out "
                                  "with it and must pass /v2/health/ready)."))
    return found, replicas, ready


def _sidecar_conditions(owner: builders.Owner, webhook: bool) -> list[Condition]:
    """A Sidecar model is ready once its config is rendered and this operator serves the injection
    webhook (``webhook``): the webhook injects it from then on (how many pods carry it is not tracked:
    that would mean watching every pod of the namespace)."""
    rendered = f"Config rendered in ConfigMap {sidecar.config_map_name(owner.name)}"
    ready = (
        Condition(conditions.READY, TRUE, sidecar.READY_TO_INJECT,
                  f"{rendered}; pods annotated {sidecar.INJECT_ANNOTATION}: {owner.name} in a namespace labelled "
                  f"{sidecar.NAMESPACE_LABEL}: enabled get the runtime as a sidecar.") if webhook else
        Condition(conditions.READY, FALSE, "NoInjectionWebhook",
                  f"{rendered}, but this operator serves no sidecar-injection webhook (SLUICE_WEBHOOK_PORT is 0; "
                  "the chart's webhook.enabled is false), so no pod gets the runtime: enable the webhook, or use "
                  "spec.mode Deployment.")
    )
    return [
        ready,
        Condition(conditions.PROGRESSING, FALSE, "Rendered", "Nothing to roll out: the runtime runs in the "
                  "application's pods, which pick a changed config up when they are recreated."),
    ]


def _serves(deployment: Mapping[str, Any] | None, label: str, *, was_ready: bool) -> bool:
    """Whether a pool's Deployment has an available pod that serves the member with pod label ``label``:
    its pods carry the label and it has an available pod, and either every pod runs the current template
    or the member was served already (then older pods had it too, and rolling keeps them until new ones
    are available)."""
    if not deployment:
        return False
    template = ((deployment.get("spec") or {}).get("template") or {}).get("metadata") or {}
    if (template.get("labels") or {}).get(label) != "true":
        return False
    status = deployment.get("status") or {}
    if int(status.get("availableReplicas", 0)) < 1:
        return False
    generation = (deployment.get("metadata") or {}).get("generation")
    current = generation is None or status.get("observedGeneration") == generation
    return was_ready or (current and int(status.get("updatedReplicas", 0)) >= int(status.get("replicas", 0)))


def _waiting_message(admission: pools.Admission) -> str:
    waiting = "; ".join(f"{w.member.name}: {w.reason}" for w in admission.waiting)
    if not any(w.cause in pools.RULED_OUT for w in admission.waiting):
        return f"{len(admission.waiting)} member(s) wait for room: {waiting}."
    return f"{len(admission.waiting)} member(s) are not served: {waiting}."


def _owned_by(obj: Mapping[str, Any], owner: builders.Owner) -> bool:
    return any(
        ref.get("kind") == owner.kind and ref.get("name") == owner.name and (ref.get("uid") or "") == owner.uid
        for ref in obj.get("metadata", {}).get("ownerReferences", []) or []
    )
