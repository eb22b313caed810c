"""Reconcile one InferenceModel or Ensemble: gather -> decide (pure builders) -> apply -> status.

Level-triggered and idempotent: every call renders the full desired state from the current spec and
applies it, so a repeated call changes nothing, and a call after someone edited or deleted a child
puts it back. Status is computed from what the API returned and written in one patch, only when it
differs from what is stored. A spec the builders cannot satisfy becomes a Degraded condition (and a
Warning event) instead of an exception, and the children of the last good spec are left running.

Callers: ``handlers`` (kopf). I/O goes through the :class:`Api` protocol (``kube.Kube`` implements it),
with an injected clock and event sink.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from sluice.operator import api, builders, conditions
from sluice.operator.conditions import FALSE, TRUE, Condition
from sluice.operator.settings import Settings

Obj = dict[str, Any]
Clock = Callable[[], datetime.datetime]

# Answers to an apply that retrying cannot fix: reported as Degraded with the server's message.
REJECTIONS = {400: "ApplyRejected", 403: "Forbidden", 422: "ApplyRejected"}


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


class EventSink(Protocol):
    def __call__(self, body: Mapping[str, Any], *, type: str, reason: str, message: str) -> None: ...


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one reconcile did; handlers log it and tests assert on the cluster instead."""

    status: Obj
    status_written: bool
    applied: int
    deleted: int


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

    def __init__(self, *, kube: Api, settings: Settings, clock: Clock, events: EventSink) -> None:
        self._kube = kube
        self._settings = settings
        self._clock = clock
        self._events = events
        self._locks: dict[tuple[str, str, str], asyncio.Lock] = {}

    def _lock(self, body: Mapping[str, Any]) -> asyncio.Lock:
        meta = body["metadata"]
        key = (body["kind"], meta["namespace"], meta["name"])
        return self._locks.setdefault(key, asyncio.Lock())

    def forget(self, kind: str, namespace: str, name: str) -> None:
        """Drop per-object state once the object is gone."""
        self._locks.pop((kind, namespace, name), None)

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
                desired = await self._decide(owner, body)
            except (api.SpecError, builders.UnsatisfiableError) as exc:
                reason = ("InvalidSpec" if isinstance(exc, api.SpecError)
                          else "NotImplemented" if isinstance(exc, builders.NotServedError) else "Unsatisfiable")
                return await self._report_problem(owner, body, reason, exc.problems)
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
                    return await self._report_problem(owner, body, REJECTIONS[exc.status], (problem,))
                applied += 1
                if obj["kind"] == "Deployment":
                    deployment = result
            for _, kind, name in desired.absent:
                existing = await self._kube.get(kind, owner.namespace, name)
                if existing is not None and _owned_by(existing, owner):
                    deleted += await self._kube.delete(kind, owner.namespace, name,
                                                       uid=existing["metadata"].get("uid"))
            found, replicas, ready = _rollout(deployment)
            if deployment is not None and ready < int((deployment.get("spec") or {}).get("replicas", 1)):
                waiting = conditions.unschedulable(await self._pods(owner))
                if waiting is not None:  # more telling than a stalled rollout: it names what is missing
                    found = [c for c in found if c.type != conditions.DEGRADED] + [waiting]
            if not any(c.type == conditions.DEGRADED for c in found):
                if desired.notes:
                    found.append(Condition(conditions.DEGRADED, TRUE, "NotImplemented", " ".join(desired.notes)))
                else:
                    found.append(Condition(conditions.DEGRADED, FALSE, "AsExpected", "Nothing needs attention."))
            status: Obj = {
                "replicas": replicas,
                "readyReplicas": ready,
                "selector": desired.selector,
                "url": desired.model_url,
                "endpoints": {"http": desired.http_url, "grpc": desired.grpc_target},
                "traffic": list(desired.traffic),
                "trafficSummary": _traffic_summary(desired.traffic),
            }
            if desired.placement is not None:
                status["placement"] = desired.placement
            outcome = await self._write_status(body, found, status)
            return dataclasses.replace(outcome, applied=applied, deleted=deleted)

    async def _pods(self, owner: builders.Owner) -> list[Obj]:
        """The runtime pods of ``owner`` (its Deployment's selector labels)."""
        labels = builders.selector_labels(owner)
        pods = await self._kube.list("Pod", owner.namespace)
        return [p for p in pods if all((p["metadata"].get("labels") or {}).get(k) == v for k, v in labels.items())]

    async def _decide(self, owner: builders.Owner, body: Mapping[str, Any]) -> builders.Desired:
        spec = body.get("spec") or {}
        # The live Deployment decides the replica count while an HPA takes the field over.
        live = await self._kube.get("Deployment", owner.namespace, owner.name)
        if owner.kind == api.INFERENCE_MODEL_KIND:
            return builders.inference_model(owner, api.parse_inference_model(owner.name, spec), self._settings,
                                            live=live)
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
        return builders.ensemble(owner, parsed, referenced, self._settings, live=live)

    async def _report_problem(
        self, owner: builders.Owner, body: Mapping[str, Any], reason: str, problems: tuple[str, ...],
    ) -> Outcome:
        # Keep whatever the last good spec created running; report on it and on the problem.
        deployment = await self._kube.get("Deployment", owner.namespace, owner.name)
        found, replicas, ready = _rollout(deployment)
        found = [c for c in found if c.type == conditions.READY]
        verb = {"InvalidSpec": "The spec is invalid", "Unsatisfiable": "The spec cannot be served",
                "NotImplemented": "The spec cannot be served yet"}.get(
            reason, "The children could not be applied")
        message = f"{verb}: {'; '.join(problems)}."
        found += [
            Condition(conditions.PROGRESSING, FALSE, reason, "Waiting for a spec that can be served."),
            Condition(conditions.DEGRADED, TRUE, reason, message),
        ]
        old = body.get("status") or {}
        status = {k: old[k] for k in old if k not in ("conditions", "observedGeneration")}
        status.update({"replicas": replicas, "readyReplicas": ready})
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
        patch: Obj = {**{k: None for k in old if k not in new}, **new}
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


def _owned_by(obj: Mapping[str, Any], owner: builders.Owner) -> bool:
    return any(
        ref.get("kind") == owner.kind and ref.get("name") == owner.name and (ref.get("uid") or "") == owner.uid
        for ref in obj.get("metadata", {}).get("ownerReferences", []) or []
    )
