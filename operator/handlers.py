"""kopf handlers: thin wiring from watch events and timers to :class:`reconcile.Reconciler`.

:func:`register` puts every handler into a caller-owned ``kopf.OperatorRegistry`` (no global
registry, nothing at import time). Triggers, all level-triggered into the same reconcile:

* the custom resource is resumed, created or updated (kopf's change detection, with retries);
* a child (Deployment, Service, ConfigMap, PDB, HPA carrying our managed-by label) changes or is
  deleted: the owner named in its controller ownerReference is reconciled, which repairs drift
  (a KEDA ScaledObject is not watched, see ``CHILD_KINDS``: the timer repairs it);
* an InferenceModel changes: the Ensembles that reference it are reconciled; when its spec changes (or
  it is created or deleted), so are the ModelPool it names and the one it left (old spec, ``status.pool``);
* a reconcile names others whose status follows from it (``Outcome.then``: a pool's members after its
  admission or readiness changed): they are reconciled next; a deleted ModelPool's members likewise;
* a timer every ``Settings.resync_seconds`` as a backstop for anything the watches missed.

With ``Settings.webhook.port``, also the sidecar-injection admission webhook: a kopf index of the
InferenceModels (``sidecar.indexed``) and a mutating handler on pod creation that answers with
``sidecar.admit``'s patch, served by ``webhook.InjectorServer``.

With ``Settings.peering_name`` (leader election), also a startup handler that creates kopf's peering
object (a KopfPeering in each watched namespace, or the ClusterKopfPeering) where it is missing, before
kopf starts its peering: with a mandatory peering name kopf stays paused for as long as the object does
not exist, and the operator must not depend on anyone else (a Helm hook) to make it. See
:func:`ensure_peering`.

Deletion needs no handler: children carry ownerReferences, so the garbage collector removes them.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, cast

import aiohttp
import kopf

from sluice.operator import api, builders, sidecar, webhook
from sluice.operator.kube import RESOURCES, Kube
from sluice.operator.metrics import OperatorMetrics
from sluice.operator.reconcile import ApiError, Reconciler
from sluice.operator.settings import Settings

LoginFn = Callable[..., Awaitable[kopf.ConnectionInfo | None]]
CHILD_KINDS = ("Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "HorizontalPodAutoscaler")
# Not KEDA's ScaledObject: its CRD is installed only where KEDA is, and kopf watching a resource the
# cluster does not serve fails instead of waiting for it. A ScaledObject edited by hand is put back by
# the resync timer (resyncSeconds) instead of at once.
CUSTOM_PLURALS = (api.INFERENCE_MODEL_PLURAL, api.ENSEMBLE_PLURAL, api.MODEL_POOL_PLURAL)
MANAGED_SELECTOR = f"app.kubernetes.io/managed-by={builders.MANAGED_BY}"


async def default_login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster service account first, then the local kubeconfig."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def kopf_event(body: Mapping[str, Any], *, type: str, reason: str, message: str) -> None:
    """Post a Kubernetes Event through kopf's poster (outside a kopf context, only log it)."""
    try:
        # kopf types ``body`` as its own Body, but any mapping with apiVersion/kind/metadata works.
        kopf.event(cast(kopf.Body, body), type=type, reason=reason, message=message[:1024])
    except LookupError:
        logging.getLogger("sluice.operator").info("%s %s: %s", type, reason, message)


STATUS_CHURNING_KINDS = ("HorizontalPodAutoscaler", "PodDisruptionBudget")
"""Children whose status its controller rewrites often and the reconcile never reads."""


def _without_status(body: Mapping[str, Any]) -> str:
    """A child as the reconcile sees it: all but its status and the server's bookkeeping."""
    meta = body.get("metadata", {}) or {}
    kept = {key: value for key, value in body.items() if key not in ("status", "metadata")}
    kept["metadata"] = {key: meta.get(key) for key in ("labels", "annotations", "ownerReferences", "deletionTimestamp")}
    return json.dumps(kept, sort_keys=True, default=str)


class SeenChildren:
    """What the reconcile acts on of each status-churning child (a digest of :func:`_without_status`), by
    uid, so a status-only write is skipped. Entries go on the child's DELETED event; one whose event was
    missed (deleted while the watch was re-established) would stay for ever, so at most ``limit`` are kept,
    the least recently changed dropped first: a child forgotten costs one reconcile at its next write."""

    def __init__(self, limit: int = 50_000) -> None:
        self.limit = limit
        self._seen: collections.OrderedDict[str, bytes] = collections.OrderedDict()

    def changed(self, uid: str, body: Mapping[str, Any]) -> bool:
        """Whether ``body`` differs from what was last seen of ``uid`` other than in its status (and note it)."""
        digest = hashlib.sha256(_without_status(body).encode()).digest()
        if self._seen.get(uid) == digest:
            self._seen.move_to_end(uid)
            return False
        self._seen[uid] = digest
        self._seen.move_to_end(uid)
        while len(self._seen) > self.limit:
            self._seen.popitem(last=False)
        return True

    def forget(self, uid: str) -> None:
        self._seen.pop(uid, None)

    def __len__(self) -> int:
        return len(self._seen)


def _split(api_version: str) -> tuple[str, str]:
    group, _, version = api_version.rpartition("/")
    return group, version


def register(
    registry: kopf.OperatorRegistry, *, settings: Settings, kube: Kube, reconciler: Reconciler,
    metrics: OperatorMetrics, login: LoginFn = default_login,
) -> None:
    """Register all handlers of the Sluice operator into ``registry``."""
    log = logging.getLogger("sluice.operator")
    resync = settings.resync_seconds
    injector = webhook.Injector(settings, kube) if settings.webhook.port else None

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        prefix = api.GROUP
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=prefix)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=prefix, key="last-handled-configuration",
        )
        settings.posting.level = logging.WARNING  # our own Events are explicit; no "handler succeeded" spam
        for kind in CHILD_KINDS:  # (group, version, plural): kopf reads a "group/version/plural" string as a name
            api_version, plural = RESOURCES[kind]
            settings.watching.label_selectors[(*_split(api_version), plural)] = MANAGED_SELECTOR
        if injector is not None:
            # The chart (or manifests/) installs the MutatingWebhookConfiguration: kopf manages none.
            settings.admission.server = webhook.server(injector)
            settings.admission.managed = None

    @kopf.on.login(registry=registry)
    async def authenticate(**kwargs: Any) -> kopf.ConnectionInfo | None:
        info = await login(**kwargs)
        if info is not None:
            kube.connect(info)
        return info

    @kopf.on.cleanup(registry=registry)
    async def close(**_: Any) -> None:
        stopping.set()  # handlers still finishing start nothing new
        for handle in requeues.values():
            handle.cancel()
        requeues.clear()
        for task in list(tasks):
            task.cancel()
        await kube.aclose()

    if settings.peering_name is not None:
        _register_peering(registry, settings.peering_name, settings.namespaces, login)

    requeues: dict[tuple[str, str, str], asyncio.TimerHandle] = {}
    stopping = asyncio.Event()

    def requeue(body: Mapping[str, Any], delay: float) -> None:
        # A canary interval that ends before the next resync: reconcile again then (one timer per object).
        meta = body["metadata"]
        key = (str(body.get("kind")), meta["namespace"], meta["name"])
        if (old := requeues.pop(key, None)) is not None:
            old.cancel()
        ref = {"kind": body.get("kind"), "apiVersion": body.get("apiVersion"),
               "metadata": {"namespace": meta["namespace"], "name": meta["name"]}}

        async def again() -> None:
            requeues.pop(key, None)
            try:
                await run(ref)
            except Exception:  # the resync timer and watch events retry; this was only an early start
                log.exception("Requeued reconcile of %s %s/%s failed", key[0], key[1], key[2])

        def start() -> None:
            task = asyncio.get_running_loop().create_task(again())
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        requeues[key] = asyncio.get_running_loop().call_later(delay, start)

    tasks: set[asyncio.Task[None]] = set()

    async def run(body: Mapping[str, Any]) -> None:
        kind = str(body.get("kind"))
        started = time.monotonic()
        try:
            outcome = await reconciler.reconcile(body)
        except Exception:
            metrics.reconciles.labels(kind, "error").inc()
            raise
        finally:
            metrics.reconcile_seconds.labels(kind).observe(time.monotonic() - started)
        metrics.reconciles.labels(kind, "ok").inc()
        if outcome is not None and outcome.status_written:
            metrics.status_writes.labels(kind).inc()
        if outcome is not None and outcome.requeue_after_s is not None and outcome.requeue_after_s < resync:
            requeue(body, max(outcome.requeue_after_s, 1.0))
        if outcome is not None:
            namespace = body["metadata"]["namespace"]
            for kind, name in outcome.then:
                follow(kind, namespace, name)

    def follow(kind: str, namespace: str, name: str) -> None:
        # Its own task: a failure there is that object's (logged; its watch events and the timer retry),
        # and a chain of follow-ups (pool -> members -> the pool a member left) never nests.
        if stopping.is_set():
            return
        ref = {"kind": kind, "apiVersion": api.API_VERSION, "metadata": {"namespace": namespace, "name": name}}

        async def reconcile() -> None:
            try:
                await run(ref)
            except Exception:
                log.exception("Follow-up reconcile of %s %s/%s failed", kind, namespace, name)

        task = asyncio.get_running_loop().create_task(reconcile())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def on_change(body: kopf.Body, **_: Any) -> None:
        await run(body)

    async def on_timer(body: kopf.Body, **_: Any) -> None:
        await run(body)

    def on_gone(body: kopf.Body, **_: Any) -> None:
        meta = body["metadata"]
        reconciler.forget(str(body.get("kind")), meta["namespace"], meta["name"])
        if (handle := requeues.pop((str(body.get("kind")), meta["namespace"], meta["name"]), None)) is not None:
            handle.cancel()

    for plural in CUSTOM_PLURALS:
        where = (api.GROUP, api.VERSION, plural)
        kopf.on.resume(*where, registry=registry, id="reconcile", backoff=5)(on_change)
        kopf.on.create(*where, registry=registry, id="reconcile", backoff=5)(on_change)
        kopf.on.update(*where, registry=registry, id="reconcile", backoff=5)(on_change)
        kopf.on.delete(*where, registry=registry, id="forget", optional=True)(on_gone)
        kopf.timer(*where, registry=registry, id="resync", interval=settings.resync_seconds,
                   initial_delay=settings.resync_seconds)(on_timer)

    children_seen = SeenChildren()

    async def on_child(body: kopf.Body, type: str | None = None, **_: Any) -> None:
        if body.get("kind") in STATUS_CHURNING_KINDS:
            # the HPA controller rewrites its status every sync (15 s) and the disruption controller a
            # PDB's on every pod change: neither is read by the reconcile, so a status-only change is skipped
            uid = str(body.get("metadata", {}).get("uid", ""))
            if type == "DELETED":
                children_seen.forget(uid)
            elif not children_seen.changed(uid, body):
                return
        refs = body.get("metadata", {}).get("ownerReferences", []) or []
        ref = next((r for r in refs if r.get("controller") and r.get("apiVersion") == api.API_VERSION), None)
        if ref is None or ref.get("kind") not in (api.INFERENCE_MODEL_KIND, api.ENSEMBLE_KIND, api.MODEL_POOL_KIND):
            return
        namespace = body["metadata"]["namespace"]
        owner = await kube.get(ref["kind"], namespace, ref["name"])
        if owner is None or owner["metadata"].get("deletionTimestamp"):
            return  # being garbage-collected along with its owner
        if ref.get("uid") and owner["metadata"].get("uid") != ref["uid"]:
            return  # an orphan of an earlier object with the same name; the GC takes it
        log.debug("Child %s %s/%s changed; reconciling its %s", body.get("kind"), namespace,
                  body["metadata"]["name"], ref["kind"])
        await run(owner)

    async def on_model_event(body: kopf.Body, **_: Any) -> None:
        # Ensembles render their referenced models' configs (colocated) or Services (remote):
        # re-reconcile those that reference this InferenceModel whenever it changes or goes away.
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        for ensemble in await kube.list(api.ENSEMBLE_KIND, namespace):
            steps = (ensemble.get("spec") or {}).get("steps") or []
            if any((step.get("modelRef") or {}).get("name") == name for step in steps if isinstance(step, dict)):
                await run(ensemble)

    async def on_model_pools(body: kopf.Body, old: Mapping[str, Any] | None = None, **_: Any) -> None:
        # A pool admits its members from their specs (never their status): when a model's spec changes, is
        # created or deleted, the pool it names (joined, grew, left) and the one it named before (the old
        # spec, or its status: it moved to another pool or out) admit again.
        namespace = body["metadata"]["namespace"]
        named = (body.get("spec") or {}).get("pool")
        previous = ((old or {}).get("spec") or {}).get("pool")
        before = ((body.get("status") or {}).get("pool") or {}).get("name")
        for pool in sorted({p for p in (named, previous, before) if isinstance(p, str)}):
            found = await kube.get(api.MODEL_POOL_KIND, namespace, pool)
            if found is not None:
                await run(found)

    async def on_pool_event(body: kopf.Body, type: str | None = None, **_: Any) -> None:
        # A pool that is gone admits no one: its members report PoolNotFound.
        if type != "DELETED":
            return
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        for model in await kube.list(api.INFERENCE_MODEL_KIND, namespace):
            if (model.get("spec") or {}).get("pool") == name:
                follow(api.INFERENCE_MODEL_KIND, namespace, model["metadata"]["name"])

    kopf.on.event(api.GROUP, api.VERSION, api.INFERENCE_MODEL_PLURAL, registry=registry,
                  id="ensembles-of-model")(on_model_event)
    if injector is not None:
        _register_injection(registry, injector)
    # Spec changes only (kopf's change detection ignores status): a member's status writes, which follow
    # its pool, must not make the pool reconcile again.
    model = (api.GROUP, api.VERSION, api.INFERENCE_MODEL_PLURAL)
    kopf.on.resume(*model, registry=registry, id="pools-of-model", backoff=5)(on_model_pools)
    kopf.on.create(*model, registry=registry, id="pools-of-model", backoff=5)(on_model_pools)
    kopf.on.update(*model, registry=registry, id="pools-of-model", backoff=5)(on_model_pools)
    kopf.on.delete(*model, registry=registry, id="pools-of-model", optional=True)(on_model_pools)
    kopf.on.event(api.GROUP, api.VERSION, api.MODEL_POOL_PLURAL, registry=registry,
                  id="members-of-pool")(on_pool_event)

    for kind in CHILD_KINDS:
        group, version = _split(RESOURCES[kind][0])
        kopf.on.event(group, version, RESOURCES[kind][1], registry=registry, id=f"child-{kind.lower()}",
                      labels={"app.kubernetes.io/managed-by": builders.MANAGED_BY})(on_child)


PEERING_API_VERSION = "kopf.dev/v1"
PEERING_GIVE_UP = frozenset({400, 401, 403, 405, 422})
"""Answers to a peering object's get/create that no retry changes: credentials, RBAC, an invalid name."""
PEERING_MAX_DELAY = 30.0
"""The longest wait between tries to create a peering object (1 s, doubling)."""


def is_namespace_pattern(namespace: str) -> bool:
    """Whether kopf reads a watched namespace as a pattern (globs, exclusions, lists), not one name."""
    return any(c in namespace for c in "!*?,")


def peering_objects(name: str, namespaces: Sequence[str]) -> list[dict[str, Any]]:
    """kopf's peering objects for leader election: a KopfPeering ``name`` in each watched namespace,
    or the ClusterKopfPeering ``name`` when all namespaces are watched. Patterns name no namespace."""
    labels = {"app.kubernetes.io/managed-by": builders.MANAGED_BY}
    if not namespaces:
        return [{"apiVersion": PEERING_API_VERSION, "kind": "ClusterKopfPeering",
                 "metadata": {"name": name, "labels": labels}}]
    return [{"apiVersion": PEERING_API_VERSION, "kind": "KopfPeering",
             "metadata": {"name": name, "namespace": namespace, "labels": labels}}
            for namespace in dict.fromkeys(namespaces) if not is_namespace_pattern(namespace)]


def namespace_unavailable(exc: ApiError, obj: Mapping[str, Any]) -> str | None:
    """Why ``obj``'s namespace cannot take it now (it does not exist yet, or is being deleted), else None:
    that namespace is skipped, the others are not held up by it."""
    namespace = obj["metadata"].get("namespace")
    if not namespace:
        return None
    if exc.status == 404 and f'namespaces "{namespace}" not found' in exc.message:
        return "does not exist"
    if exc.status == 403 and "being terminated" in exc.message:
        return "is being deleted"
    return None


def describe_peering(obj: Mapping[str, Any]) -> str:
    meta = obj["metadata"]
    where = f"in namespace {meta['namespace']!r}" if meta.get("namespace") else "(cluster-wide)"
    return f"{obj['kind']} {meta['name']!r} {where}"


async def ensure_peering(kube: Kube, obj: Mapping[str, Any]) -> bool:
    """Create kopf's peering object ``obj`` unless it exists; ``True`` when this call created it.

    An existing one is never replaced or patched: its status holds the live replicas' keepalives, and
    an empty one (recreated) would let a paused replica resume next to the leader until the leader's
    next keepalive. A 409 (another replica created it first) is as good as found.
    """
    meta = obj["metadata"]
    if await kube.get(obj["kind"], meta.get("namespace", ""), meta["name"]) is not None:
        return False
    try:
        await kube.create(obj)
    except ApiError as exc:
        if exc.status == 409:
            return False
        raise
    return True


def _register_peering(registry: kopf.OperatorRegistry, name: str, namespaces: Sequence[str], login: LoginFn) -> None:
    """A startup handler that makes kopf's peering objects exist before kopf starts its peering.

    kopf runs startup handlers before any of its watchers and keepalives, so the objects exist when
    kopf first looks (its own first keepalive then lands in them). The handler logs in itself: kopf's
    login (``authenticate``) runs only after the startup handlers. What a retry can fix (the API server
    unreachable or busy, the peering CRD not served yet, a watched namespace that does not exist yet) is
    retried with a growing delay, and kopf starts nothing meanwhile: a replica that started without its
    peering object would stay paused there. What no retry fixes (no permission to create the object, an
    invalid name) stops the operator with the reason.
    """
    log = logging.getLogger("sluice.operator")
    pending = peering_objects(name, namespaces)
    patterns = [namespace for namespace in namespaces if is_namespace_pattern(namespace)]

    @kopf.on.startup(registry=registry, id="peering", errors=kopf.ErrorsMode.PERMANENT)
    async def ensure_peerings(retry: int = 0, **kwargs: Any) -> None:
        if patterns and retry == 0:
            log.warning("Leader election: no KopfPeering %r is created in the namespaces matching %s (a pattern "
                        "names no namespace in advance); kopf stays paused in each until one exists there",
                        name, ", ".join(repr(p) for p in patterns))
        info = await login(**kwargs)
        if info is None:
            raise kopf.PermanentError("no credentials to create kopf's peering objects with")
        kube = Kube(info)
        try:
            while pending:
                obj = pending[0]
                what = describe_peering(obj)
                delay = min(2.0 ** retry, PEERING_MAX_DELAY)
                try:
                    created = await ensure_peering(kube, obj)
                except ApiError as exc:
                    problem = f"{exc.status} {exc.reason}: {exc.message}".rstrip(": ")
                    if (why := namespace_unavailable(exc, obj)) is not None:
                        log.warning("Leader election: namespace %r %s, so %s cannot be created; kopf stays paused "
                                    "there until it exists (the other namespaces are served)",
                                    obj["metadata"]["namespace"], why, what)
                        pending.pop(0)
                        continue
                    if exc.status in PEERING_GIVE_UP:
                        rbac = (f" (the operator's ServiceAccount needs get and create on "
                                f"{obj['kind'].lower()}s.kopf.dev; the chart grants them with leaderElection.enabled)"
                                if exc.status == 403 else "")
                        raise kopf.PermanentError(
                            f"leader election needs {what} and cannot read or create it: {problem}{rbac}") from exc
                    hint = (" (is kopf's peering CRD installed, and does the namespace exist?)"
                            if exc.status == 404 else "")
                    raise kopf.TemporaryError(f"leader election needs {what}, not created yet: {problem}{hint}; "
                                              f"trying again in {delay:g} s", delay=delay) from exc
                except (aiohttp.ClientError, OSError) as exc:  # OSError: TimeoutError too
                    raise kopf.TemporaryError(f"leader election needs {what}, not created yet: "
                                              f"{type(exc).__name__}: {exc}; trying again in {delay:g} s",
                                              delay=delay) from exc
                if created:
                    log.info("Leader election: created %s", what)
                else:
                    log.info("Leader election: %s exists; left as it is", what)
                pending.pop(0)
        finally:
            await kube.aclose()


def _register_injection(registry: kopf.OperatorRegistry, injector: webhook.Injector) -> None:
    """The sidecar webhook: InferenceModels indexed by (namespace, name), and the mutating pod handler."""

    def sidecar_models(name: str, namespace: str | None, spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta,
                       **_: Any) -> dict[tuple[str, str], Any]:
        return {(namespace or "", name): sidecar.indexed(name, spec, status, meta.get("generation"))}

    kopf.index(api.GROUP, api.VERSION, api.INFERENCE_MODEL_PLURAL, registry=registry,
               id="sidecar_models")(sidecar_models)

    async def inject(body: kopf.Body, patch: kopf.Patch, **kwargs: Any) -> None:
        try:
            ops = await injector.review(body, kwargs["sidecar_models"])  # the index above, by its id
        except sidecar.Denied as exc:
            raise kopf.AdmissionError(str(exc), code=403) from exc
        if ops:
            # kopf diffs the pod before and after its patch functions into the response's JSON patch.
            patch.fns.append(lambda pod: sidecar.apply(cast(dict[str, Any], pod), ops))

    kopf.on.mutate("v1", "pods", registry=registry, id=webhook.HANDLER_ID, operations=["CREATE"],
                   persistent=True, side_effects=False, ignore_failures=False)(inject)

