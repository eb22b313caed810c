"""A kmock Kubernetes emulator with the API-server semantics the operator's tests rely on.

kmock's ``KubernetesEmulator`` stores objects and streams watch events but treats writes as plain
JSON merges. Operator tests must not pass only because of that, so :class:`ApiServer` fills in what
a real API server does (listed in ``e2e/README.md``):

* ``metadata.uid``, ``resourceVersion`` (bumped only when an object really changes, so a no-op
  apply emits no watch event), ``creationTimestamp``, ``generation`` (bumped on non-metadata,
  non-status changes only);
* the ``status`` subresource: writes to the main resource ignore ``status``; ``/status`` writes
  change nothing else; a Node keeps the status it is created with (a kubelet registers it so);
* server-side apply (``application/apply-patch+yaml``): creates when absent; merges the applied
  configuration; lists are treated as atomic (a real server merges keyed lists such as containers by
  name);
* field ownership (``metadata.managedFields``, ``fieldsV1`` without timestamps): an apply makes its
  manager an owner of every field it applies (``force``: the sole owner of a field whose value it
  changes); any other write (``?fieldManager=``, default ``unknown``) takes the fields it changes.
  A field a manager applied before and no longer applies loses that owner, and is removed when no
  owner is left - then defaulting fills it in again (``Deployment.spec.replicas`` defaults to 1), which
  is the reset the HPA handover has to avoid. :meth:`ApiServer.scale` writes a replica count the way
  the HPA controller does (the ``scale`` subresource, manager ``kube-controller-manager``);
* deletion with finalizers (``deletionTimestamp``) and ``preconditions.uid``; owner-reference
  garbage collection (background cascade) when an owner is deleted;
* CustomResourceDefinitions registered with :meth:`ApiServer.register_crd`: discovery, and on every
  write structural pruning of unknown fields, defaulting and OpenAPI validation (422 Invalid) -
  but not CEL ``x-kubernetes-validations``, which the operator must check itself;
* ``labelSelector`` on list and watch (equality, ``!=``, existence);
* discovery of the built-in groups only: kmock's bundled Gateway API and metrics.k8s.io resources are
  removed (a fresh cluster serves them only once their CRDs or adapter are installed);
* a Deployment "controller" on demand (:meth:`ApiServer.complete_rollout`) or for every rollout
  (``simulate_rollouts=True``) that marks all pods updated and ready;
* with ``simulate_scheduling=True`` instead: the Deployment and ReplicaSet controllers (``spec.replicas``
  Pods named ``<deployment>-<pod-template-hash>-<n>``), kube-scheduler's filters
  (:mod:`sluice_testing.scheduler`: unschedulable and NotReady nodes, taints and tolerations,
  nodeSelector and required node affinity, pods and every requested resource against
  ``allocatable``), binding, a kubelet that reports bound pods Running and Ready, PodGC for a deleted
  Node's pods, and Deployment status counted from the bound pods. Pending pods are retried whenever
  Nodes, Pods or Deployments change;
* ``fieldSelector`` on list and watch (``metadata.name``/``namespace``; for Pods ``spec.nodeName``,
  ``status.phase`` and the other fields the API server indexes; for Nodes ``spec.unschedulable``);
* ``/version`` answering ``kubernetes_version`` (default 1.31.0; kmock's own says 1.26), which the
  operator reads to decide whether sidecars can be native (Kubernetes >= 1.29);
* with ``serve_dra=True``: the ``resource.k8s.io/v1`` resources (Dynamic Resource Allocation, on by
  default from Kubernetes 1.34): ResourceSlice and DeviceClass (cluster-scoped), ResourceClaim
  (with ``/status``) and ResourceClaimTemplate.

Requires the ``test`` extra (kmock, jsonschema). Not imported by the operator itself.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import json
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import jsonschema
import kmock
from kmock._internal import dicts as kmock_dicts  # the emulator's own merge/JSON-patch implementation
from kmock._internal import dsl as kmock_dsl  # the views its reactions are chained from (see _contains)
from kmock._internal import rendering  # the emulator's own request type; no public alias exists

from sluice_testing import scheduler

Obj = dict[str, Any]
APPLY = "application/apply-patch+yaml"


_ADDONS = ("gateway.networking.k8s.io", "metrics.k8s.io")
DEPLOYMENTS = kmock.resource("apps/v1/deployments")
PODS = kmock.resource("v1/pods")
NODES = kmock.resource("v1/nodes")
_CONTROLLED = (DEPLOYMENTS, PODS, NODES)
"""What the emulated controllers and scheduler react to."""
# resource.k8s.io/v1 (GA in Kubernetes 1.34): plural -> (kind, namespaced, subresources).
_DRA = {
    "resourceslices": ("ResourceSlice", False, set()),
    "deviceclasses": ("DeviceClass", False, set()),
    "resourceclaims": ("ResourceClaim", True, {"status"}),
    "resourceclaimtemplates": ("ResourceClaimTemplate", True, set()),
}
# Field labels the API server indexes beyond metadata.name/namespace (pkg/registry/core/*/strategy.go).
_FIELD_LABELS = {
    "pods": {"spec.nodeName", "spec.restartPolicy", "spec.schedulerName", "spec.serviceAccountName",
             "spec.hostNetwork", "status.phase", "status.podIP", "status.nominatedNodeName"},
    "nodes": {"spec.unschedulable"},
}
_BOOLEAN_FIELDS = {"spec.hostNetwork", "spec.unschedulable"}


class Invalid(kmock.KubernetesError):
    pass


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _selector_matches(selector: str, labels: Mapping[str, str]) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "==" in term or "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _field_terms(plural: str, selector: str) -> list[tuple[str, bool, str]]:
    """``(field, equal, value)`` per term of a ``fieldSelector``; 400 for a field the server does not index.

    Only Pods and Nodes are checked for their own field labels; other resources keep answering as
    kmock does (their non-metadata terms are ignored)."""
    terms = []
    for term in filter(None, (t.strip() for t in selector.split(","))):
        equal = "!=" not in term
        field, value = term.replace("!=", "=").replace("==", "=").split("=", 1) if "=" in term else (term, "")
        field = field.strip()
        if field not in ("metadata.name", "metadata.namespace") and field not in _FIELD_LABELS.get(plural, ()):
            if plural not in _FIELD_LABELS:
                continue
            raise kmock.KubernetesError(status=400, reason="BadRequest",
                                        message=f'field label not supported: {field}')
        terms.append((field, equal, value.strip()))
    return terms


def _field_value(obj: Mapping[str, Any], field: str) -> str:
    value: Any = obj
    for key in field.split("."):
        value = value.get(key) if isinstance(value, Mapping) else None
    if field in _BOOLEAN_FIELDS:
        return "true" if value else "false"
    return "" if value is None else str(value)


def _merge(base: Any, patch: Any) -> Any:
    """Apply-style merge: dicts recurse, everything else (lists included) is replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        result = dict(base)
        for key, value in patch.items():
            result[key] = _merge(base.get(key), value) if key in base else copy.deepcopy(value)
        return result
    return copy.deepcopy(patch)


Path = tuple[str, ...]
Owners = dict[Path, set[tuple[str, str]]]
"""Field path -> the (manager, operation) pairs that own it; operation is ``Apply`` or ``Update``."""
# Set by the server, never owned by a manager (the real server leaves them out of managedFields too).
_UNOWNED_META = {"name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp",
                 "deletionTimestamp", "managedFields"}
_MISSING = object()


def _fields(value: Any, prefix: Path = ()) -> set[Path]:
    """The leaf field paths of ``value`` (lists are atomic, as this emulator treats them)."""
    if isinstance(value, dict) and value:
        result: set[Path] = set()
        for key, item in value.items():
            if prefix == () and key in ("apiVersion", "kind", "status"):
                continue
            if prefix == ("metadata",) and key in _UNOWNED_META:
                continue
            result |= _fields(item, (*prefix, key))
        return result
    return {prefix} if prefix else set()


def _maps(value: Any, prefix: Path = ()) -> set[Path]:
    """The paths of the non-empty maps inside ``value`` (below the top level)."""
    result: set[Path] = set()
    if isinstance(value, dict):
        for key, item in value.items():
            if prefix == () and key in ("apiVersion", "kind", "status", "metadata"):
                continue
            if isinstance(item, dict) and item:
                result |= {(*prefix, key)} | _maps(item, (*prefix, key))
    return result


def _at(obj: Any, path: Path) -> Any:
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return _MISSING
        obj = obj[key]
    return obj


def _drop(obj: Obj, path: Path, keep: Any) -> None:
    """Remove ``path`` from ``obj``, then any parent left empty that ``keep`` (the new apply) does not name."""
    parents = [obj]
    for key in path[:-1]:
        child = parents[-1].get(key)
        if not isinstance(child, dict):
            return
        parents.append(child)
    parents[-1].pop(path[-1], None)
    for depth in range(len(path) - 1, 0, -1):
        if parents[depth] or _at(keep, path[:depth]) is not _MISSING:
            break
        parents[depth - 1].pop(path[depth - 1], None)


def _managed_fields(owners: Owners) -> list[Obj]:
    """``metadata.managedFields`` as a real server renders it (``fieldsV1``), minus the timestamps."""
    trees: dict[tuple[str, str], Obj] = {}
    for path, holders in owners.items():
        for holder in holders:
            node = trees.setdefault(holder, {})
            for key in path:
                node = node.setdefault(f"f:{key}", {})
    return [{"manager": manager, "operation": operation, "fieldsType": "FieldsV1", "fieldsV1": tree}
            for (manager, operation), tree in sorted(trees.items())]


def _structural(schema: Mapping[str, Any], value: Any) -> Any:
    """Prune unknown fields and fill defaults, as the API server does for a structural schema."""
    if isinstance(value, dict) and schema.get("type") == "object":
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return value
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        if properties is None and extra is None:
            return value  # e.g. metadata: handled by the server itself
        result: Obj = {}
        for key, item in value.items():
            if properties is not None and key in properties:
                result[key] = _structural(properties[key], item)
            elif isinstance(extra, dict):
                result[key] = _structural(extra, item)
        for key, sub in (properties or {}).items():
            if key not in result and "default" in sub:
                result[key] = _structural(sub, copy.deepcopy(sub["default"]))
        return result
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_structural(schema["items"], item) for item in value]
    return value


def _strip_extensions(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: _strip_extensions(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if isinstance(schema, list):
        return [_strip_extensions(v) for v in schema]
    return schema


_KMOCK_CONTAINS = kmock_dsl.View.__contains__


def _contains(view: Any, item: Any) -> bool:
    """``request in view`` without walking the server's whole history.

    For every request that arrives, kmock asks each reaction (the emulator's fallbacks: list, watch,
    fetch, discovery) whether its view holds the request, and answers by iterating every request the
    server has recorded through the view's filters: each request costs O(requests so far), a test
    O(requests squared). In an operator test of a few thousand requests that was most of the test's
    time (py-spy: 88% of an e2e canary test in kmock's ``Filter.__iter__``). Those views are chains of
    ``Filter`` and ``Priority`` over the server, so the answer is the filters' criteria on this one
    request and whether the server recorded it (searched from the newest). Any other view (slices,
    unions, exclusions, streams) is answered by kmock as before."""
    if not isinstance(item, rendering.Request):
        return bool(_KMOCK_CONTAINS(view, item))
    while True:
        kind = type(view)
        if kind is kmock_dsl.Filter:
            if not view.criteria(item):
                return False
            view = view._source
        elif kind is kmock_dsl.Priority:
            view = view._source
        elif isinstance(view, kmock_dsl.Root) and kind.__iter__ is kmock_dsl.Root.__iter__:
            return any(request is item for request in reversed(view._requests))
        else:
            return bool(_KMOCK_CONTAINS(view, item))


kmock_dsl.View.__contains__ = _contains  # type: ignore[method-assign]


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    """The emulator; use as ``async with ApiServer() as server, kmock.Server(server): ...``."""

    _schemas: dict[Any, Obj] = attrs.field(factory=dict, init=False)
    _applied: dict[tuple[Any, str | None, str, str], Obj] = attrs.field(factory=dict, init=False)
    _owners: dict[tuple[Any, str | None, str], Owners] = attrs.field(factory=dict, init=False)
    _counter: Any = attrs.field(factory=lambda: itertools.count(1), init=False)
    _log: list[tuple[int, Any, Obj]] = attrs.field(factory=list, init=False)
    _last_version: int = attrs.field(default=0, init=False)
    _rejections: dict[Any, kmock.KubernetesError] = attrs.field(factory=dict, init=False)
    _dirty: bool = attrs.field(default=False, init=False)
    reads: list[tuple[str, str, str]] = attrs.field(factory=list, init=False)
    """Every list and watch served: (verb, plural, labelSelector), so tests can check what a client asks for."""
    simulate_rollouts: bool = attrs.field(default=False)
    """Act as the Deployment controller: every new Deployment generation becomes fully ready at once."""
    simulate_scheduling: bool = attrs.field(default=False)
    """Act as the Deployment/ReplicaSet controllers, kube-scheduler and the kubelet (implies a rollout
    simulation): Deployments get Pods, Pods are bound where kube-scheduler's filters allow or stay
    Pending with its message, and Deployment status counts the bound ones."""
    serve_dra: bool = attrs.field(default=False)
    """Serve ``resource.k8s.io/v1`` (Dynamic Resource Allocation), as a Kubernetes 1.34+ cluster does."""
    kubernetes_version: str = attrs.field(default="1.31.0")
    """What ``/version`` reports (``major``, ``minor``, ``gitVersion``), e.g. ``1.28.9`` for a cluster
    without native sidecars."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.resources.load_bundled()
        # kmock bundles Gateway API and metrics.k8s.io, which a bare cluster does not serve until their
        # CRDs (or an adapter) are installed: drop them, so discovery answers as a fresh cluster does.
        for resource in [r for r in self.resources if r.group in _ADDONS]:
            del self.resources[resource]
        if self.serve_dra:
            for plural, (kind, namespaced, subresources) in _DRA.items():
                self.resources[kmock.resource("resource.k8s.io", "v1", plural)] = kmock.ResourceInfo(
                    kind=kind, singular=kind.lower(), namespaced=namespaced, subresources=subresources,
                    verbs={"get", "list", "watch", "create", "patch", "update", "delete", "deletecollection"},
                )

    # ------------------------------------------------------------ setup helpers

    def register_crd(self, crd: Mapping[str, Any]) -> None:
        """Serve the CRD's resources (discovery, schema) as a real server does once it is established."""
        spec = crd["spec"]
        names = spec["names"]
        for version in spec["versions"]:
            resource = kmock.resource(spec["group"], version["name"], names["plural"])
            self.resources[resource] = kmock.ResourceInfo(
                kind=names["kind"], singular=names.get("singular"), namespaced=spec["scope"] == "Namespaced",
                verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
                shortnames=set(names.get("shortNames", [])), categories=set(names.get("categories", [])),
                subresources=set(version.get("subresources", {})),
            )
            self._schemas[resource] = version["schema"]["openAPIV3Schema"]

    def read(self, resource: str, namespace: str | None, name: str) -> Obj | None:
        """The stored object as a plain dict, or ``None``."""
        key = (kmock.resource(resource), namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw)

    def read_all(self, resource: str, namespace: str | None = None) -> list[Obj]:
        """The stored objects of ``resource`` (in ``namespace``, or all), as plain dicts in name order."""
        res = kmock.resource(resource)
        found = [copy.deepcopy(item.raw) for (r, ns, _), item in self.objects.items()
                 if r == res and not item.deleted and (namespace is None or ns == namespace)]
        return sorted(found, key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))

    async def create(self, obj: Mapping[str, Any], manager: str = "unknown") -> Obj:
        """Create ``obj`` as a client's POST would (its resource found from apiVersion and kind)."""
        group, _, version = str(obj["apiVersion"]).rpartition("/")
        resource = next((r for r in self.resources if (r.group, r.version) == (group, version)
                         and self.resources[r].kind == obj["kind"]), None)
        if resource is None:
            raise LookupError(f"the emulator does not serve {obj['apiVersion']} {obj['kind']}"
                              + (" (ApiServer(serve_dra=True) serves resource.k8s.io/v1)" if group == "resource.k8s.io"
                                 else ""))
        meta = obj.get("metadata") or {}
        namespace = meta.get("namespace") if self.resources[resource].namespaced else None
        request = rendering.Request(resource=resource, namespace=namespace, data=copy.deepcopy(dict(obj)),
                                    params={"fieldManager": manager})
        async with self._lock:
            created = await self._create(request)
            await self._settle()
        return created

    def reject_writes(self, resource: str, status: int = 403, message: str = "forbidden by the test") -> None:
        """Answer every write to ``resource`` with ``status`` (e.g. missing RBAC, an admission webhook)."""
        self._rejections[kmock.resource(resource)] = kmock.KubernetesError(
            status=status, reason={403: "Forbidden", 422: "Invalid"}.get(status, "Error"), message=message)

    def allow_writes(self, resource: str) -> None:
        self._rejections.pop(kmock.resource(resource), None)

    async def complete_rollout(self, namespace: str, name: str) -> None:
        """Act as the Deployment controller and kubelet: all desired pods exist, run the spec and are ready.

        Not with ``simulate_scheduling``, whose controllers count the real pods and overwrite this."""
        deployment = self.read("apps/v1/deployments", namespace, name)
        assert deployment is not None, f"no Deployment {namespace}/{name}"
        replicas = deployment["spec"].get("replicas", 1)
        status = {"observedGeneration": deployment["metadata"]["generation"], "replicas": replicas,
                  "updatedReplicas": replicas, "readyReplicas": replicas, "availableReplicas": replicas}
        await self.write_status("apps/v1/deployments", namespace, name, status)

    async def scale(self, namespace: str, name: str, replicas: int,
                    manager: str = "kube-controller-manager") -> None:
        """Set a Deployment's replica count as the HPA controller does: an update through ``/scale``."""
        res = kmock.resource("apps/v1/deployments")
        async with self._lock:
            old = self._current(res, namespace, name)
            new = copy.deepcopy(old)
            new["spec"]["replicas"] = replicas
            self._take_updated((res, namespace, name), old, new, manager)
            await self._store(res, namespace, name, old, new)
            await self._settle()

    async def write_status(self, resource: str, namespace: str | None, name: str, status: Obj) -> None:
        """Write ``status`` as a controller would (through the status subresource semantics)."""
        res = kmock.resource(resource)
        async with self._lock:
            current = self._current(res, namespace, name)
            new = copy.deepcopy(current)
            new["status"] = status
            await self._store(res, namespace, name, current, new)
            await self._settle()

    @property
    def version(self) -> int:
        """The latest resourceVersion handed out: it moves on every real change in the cluster."""
        return self._last_version

    # ------------------------------------------------------------ reads

    async def _serve_server_version(self, request: rendering.Request) -> rendering.Payload:
        major, minor, *_ = self.kubernetes_version.split(".")
        return {"major": major, "minor": minor, "gitVersion": f"v{self.kubernetes_version}",
                "gitTreeState": "clean", "goVersion": "go1.22.0", "compiler": "gc", "platform": "linux/amd64"}

    def _visible(self, request: rendering.Request, obj: Mapping[str, Any]) -> bool:
        meta = obj.get("metadata", {})
        if request.namespace is not None and meta.get("namespace") != request.namespace:
            return False
        assert request.resource is not None
        for field, equal, value in _field_terms(str(request.resource.plural), request.params.get("fieldSelector", "")):
            if (_field_value(obj, field) == value) != equal:
                return False
        selector = request.params.get("labelSelector")
        return not selector or _selector_matches(selector, meta.get("labels", {}) or {})

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        assert request.resource is not None
        self.reads.append(("list", str(request.resource.plural), request.params.get("labelSelector", "")))
        _field_terms(str(request.resource.plural), request.params.get("fieldSelector", ""))  # 400 before anything
        payload = await super()._serve_list(request)
        if isinstance(payload, dict):
            payload["items"] = [item for item in payload["items"] if self._visible(request, item)]
            payload["metadata"] = {"resourceVersion": str(self._last_version)}
        return payload

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        # A watch from a resourceVersion gets the events after it (from the log), not a replay of
        # every object: kopf lists first and then watches from the list's version, as with a real server.
        assert request.resource is not None
        self.reads.append(("watch", str(request.resource.plural), request.params.get("labelSelector", "")))
        _field_terms(str(request.resource.plural), request.params.get("fieldSelector", ""))  # 400 before streaming
        yield b""
        bus = self._buses[request.resource]
        since = request.params.get("resourceVersion", "")
        async with self._lock:
            if since.isdigit():
                backlog = [event for version, resource, event in self._log
                           if resource == request.resource and version > int(since)]
            else:
                backlog = [{"type": "ADDED", "object": item.raw} for (resource, _, _), item in self.objects.items()
                           if resource == request.resource and not item.deleted]
            marker = await bus.mark()
        try:
            for event in backlog:
                if self._visible(request, event["object"]):
                    yield event
            async for event in bus.stream(since=marker):
                if isinstance(event, dict) and self._visible(request, event.get("object", {})):
                    yield event
        finally:
            await bus.unmark(marker)

    # ------------------------------------------------------------ writes

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        writes = (kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE)
        if request.resource is None or request.action not in writes:
            return await super()._handle(request)
        if request.action != kmock.action.CREATE and request.name is None:
            return await super()._handle(request)
        try:
            if request.resource in self._rejections:
                raise self._rejections[request.resource]
            async with self._lock:
                if request.action == kmock.action.CREATE:
                    result = await self._create(request)
                elif request.action == kmock.action.UPDATE:
                    result = await self._update(request)
                else:
                    result = await self._delete(request)
                await self._settle()
        except kmock.KubernetesError as exc:
            return await self._render_error(exc)
        return aiohttp.web.json_response(result, status=201 if request.action == kmock.action.CREATE else 200)

    def _has_status_subresource(self, resource: Any) -> bool:
        return resource in self.resources and "status" in self.resources[resource].subresources

    def _current(self, resource: Any, namespace: str | None, name: str) -> Obj:
        key = (resource, namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            raise kmock.KubernetesObjectNotFoundError(message=f"{resource.plural} {name!r} not found")
        return copy.deepcopy(self.objects[key].raw)

    def _admit(self, resource: Any, obj: Obj) -> Obj:
        schema = self._schemas.get(resource)
        if resource == kmock.resource("apps/v1/deployments") and isinstance(obj.get("spec"), dict):
            obj["spec"].setdefault("replicas", 1)  # the one built-in default the tests rely on
        if schema is None:
            return obj
        obj = _structural(schema, obj)
        validator = jsonschema.Draft7Validator(_strip_extensions(schema))
        errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
        if errors:
            details = "; ".join(f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors)
            raise Invalid(status=422, reason="Invalid", message=f"{obj.get('kind')} is invalid: {details}")
        return obj

    async def _store(self, resource: Any, namespace: str | None, name: str, old: Obj | None, new: Obj) -> Obj:
        """Persist ``new`` if it differs from ``old``: bump resourceVersion/generation, publish the event."""
        if old is not None and new == old:
            return old
        meta = new.setdefault("metadata", {})
        if old is None:
            meta.update({"uid": str(uuid.UUID(int=next(self._counter))), "generation": 1,
                         "creationTimestamp": _now()})
        else:
            unchanged = ("metadata", "status")
            if {k: v for k, v in old.items() if k not in unchanged} != {
                k: v for k, v in new.items() if k not in unchanged
            }:
                meta["generation"] = old["metadata"].get("generation", 1) + 1
        meta["resourceVersion"] = str(next(self._counter))
        key = (resource, namespace, name)
        if key in self.objects:
            self.objects[key].create(new)
        else:
            self.objects[key] = new
        await self._publish(resource, {"type": "ADDED" if old is None else "MODIFIED", "object": new})
        self._dirty = self._dirty or resource in _CONTROLLED
        if old is None and self._orphaned(new):
            # The garbage collector removes dependents whose owners are all gone (e.g. a child applied
            # by a reconcile that raced with the owner's deletion).
            await self._remove(resource, namespace, name)
            return new
        if (self.simulate_rollouts and not self.simulate_scheduling and resource == DEPLOYMENTS
                and (old is None or old["metadata"].get("generation") != meta["generation"])):
            replicas = new.get("spec", {}).get("replicas", 1)
            ready = {"observedGeneration": meta["generation"], "replicas": replicas, "updatedReplicas": replicas,
                     "readyReplicas": replicas, "availableReplicas": replicas}
            return await self._store(resource, namespace, name, new, {**copy.deepcopy(new), "status": ready})
        return new

    def _orphaned(self, obj: Mapping[str, Any]) -> bool:
        refs = obj.get("metadata", {}).get("ownerReferences") or []
        if not refs:
            return False
        alive = {item.raw["metadata"].get("uid") for item in self.objects.values() if not item.deleted}
        return not any(ref.get("uid") in alive for ref in refs)

    async def _publish(self, resource: Any, event: Obj) -> None:
        version = int(event["object"]["metadata"]["resourceVersion"])
        self._last_version = max(self._last_version, version)
        self._log.append((version, resource, copy.deepcopy(event)))
        await self._buses[resource].put(event)

    def _apply_ownership(
        self, key: tuple[Any, str | None, str], old: Obj, patch: Obj, manager: str,
    ) -> tuple[Obj, Owners]:
        """Merge a forced apply by ``manager`` into ``old``: the new object and its field owners, as a real
        server computes them (the caller stores the owners once the object is admitted)."""
        owners = {path: set(holders) for path, holders in self._owners.get(key, {}).items()}
        holder = (manager, "Apply")
        applied = _fields(patch)
        previous = self._applied.get((*key, manager))
        new = copy.deepcopy(old)
        for path in (_fields(previous) - applied) if previous is not None else ():
            holders = owners.get(path, set())
            holders.discard(holder)
            if not holders:
                owners.pop(path, None)
                _drop(new, path, patch)  # no owner left: the field goes (and defaulting may refill it)
        # A map the manager applied and no longer names goes whole when nobody owns a field inside it:
        # the fields defaulting put there (owned by no one) go with it, as on a real server.
        for path in sorted((_maps(previous) - _maps(patch)) if previous is not None else (), key=len):
            if _at(patch, path) is _MISSING and not any(p[:len(path)] == path for p in owners):
                parent = _at(new, path[:-1]) if len(path) > 1 else new
                if isinstance(parent, dict):
                    parent.pop(path[-1], None)
        for path in applied:
            if _at(old, path) != _at(patch, path):
                owners[path] = {holder}  # force: the other owners lose a field whose value changes
            else:
                owners.setdefault(path, set()).add(holder)
        return _merge(new, patch), owners

    def _take_updated(self, key: tuple[Any, str | None, str], old: Obj | None, new: Obj, manager: str) -> None:
        """A non-apply write makes ``manager`` the owner of every field whose value it changed."""
        owners = self._owners.setdefault(key, {})
        for path in _fields(new):
            if old is None or _at(old, path) != _at(new, path):
                owners[path] = {(manager, "Update")}
        for path in [p for p in owners if _at(new, p) is _MISSING]:
            del owners[path]
        new.setdefault("metadata", {})["managedFields"] = _managed_fields(owners)

    async def _create(
        self, request: rendering.Request, body: Obj | None = None, *, manager: str = "",
        operation: str = "Update",
    ) -> Obj:
        assert request.resource is not None
        obj = copy.deepcopy(body if body is not None else request.data or {})
        meta = obj.setdefault("metadata", {})
        namespace = request.namespace or meta.get("namespace")
        name = meta.get("name") or request.name
        if not name and meta.get("generateName"):
            name = f"{meta['generateName']}{next(self._counter):05d}"
        if not name:
            raise Invalid(status=422, reason="Invalid", message="metadata.name is required")
        meta["name"] = name
        if namespace is not None:
            meta["namespace"] = namespace
        key = (request.resource, namespace, name)
        if key in self.objects and not self.objects[key].deleted:
            raise kmock.KubernetesError(status=409, reason="AlreadyExists", message=f"{name!r} already exists")
        for field in ("uid", "resourceVersion", "generation", "creationTimestamp", "deletionTimestamp"):
            meta.pop(field, None)
        if self._has_status_subresource(request.resource) and request.resource != NODES:
            obj.pop("status", None)  # but a kubelet registers its Node with the status it measured
        obj = self._admit(request.resource, obj)
        holder = (manager or request.params.get("fieldManager") or "unknown", operation)
        owners = self._owners[key] = {path: {holder} for path in _fields(obj)
                                      if operation == "Update" or _at(body, path) is not _MISSING}
        obj["metadata"]["managedFields"] = _managed_fields(owners)
        return await self._store(request.resource, namespace, name, None, obj)

    async def _update(self, request: rendering.Request) -> Obj:
        assert request.resource is not None and request.name is not None
        resource, namespace, name = request.resource, request.namespace, request.name
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        patch = request.data if request.data is not None else json.loads(request.text or "{}")
        status_only = request.subresource == "status"
        key = (resource, namespace, name)
        exists = key in self.objects and not self.objects[key].deleted
        manager = request.params.get("fieldManager") or "unknown"
        if content_type == APPLY:
            if not exists:
                created = await self._create(request, body=patch, manager=manager, operation="Apply")
                self._applied[(resource, namespace, name, manager)] = copy.deepcopy(patch)
                return created
            old = self._current(resource, namespace, name)
            new, applied_owners = self._apply_ownership(key, old, patch, manager)
        else:
            old = self._current(resource, namespace, name)
            expected = patch.get("metadata", {}).get("resourceVersion") if isinstance(patch, dict) else None
            if expected is not None and expected != old["metadata"]["resourceVersion"]:
                raise kmock.KubernetesError(status=409, reason="Conflict", message="the object has been modified")
            try:
                new = copy.deepcopy(dict(kmock_dicts.patch_dict(old, patch)))
            except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
                # e.g. kopf's "test /metadata/resourceVersion" against a stale body
                raise Invalid(status=422, reason="Invalid", message=f"the JSON patch failed: {exc}") from exc
        if status_only:
            new = {**old, "status": new.get("status")} if "status" in new else {**old}
        elif self._has_status_subresource(resource):
            new["status"] = old.get("status")
            if new["status"] is None:
                new.pop("status")
        for field in ("uid", "resourceVersion", "generation", "creationTimestamp", "name", "namespace"):
            if field in old["metadata"]:
                new["metadata"][field] = old["metadata"][field]
        if not status_only:
            new = self._admit(resource, new)
            if content_type == APPLY:  # admitted: the apply and its ownership take effect
                self._owners[key] = applied_owners
                self._applied[(resource, namespace, name, manager)] = copy.deepcopy(patch)
            else:
                self._take_updated(key, old, new, manager)
            new["metadata"]["managedFields"] = _managed_fields(self._owners.get(key, {}))
        meta = new["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            await self._store(resource, namespace, name, old, new)
            await self._remove(resource, namespace, name)
            return new
        return await self._store(resource, namespace, name, old, new)

    async def _delete(self, request: rendering.Request) -> Obj:
        assert request.resource is not None and request.name is not None
        resource, namespace, name = request.resource, request.namespace, request.name
        old = self._current(resource, namespace, name)
        options = request.data if isinstance(request.data, dict) else {}
        wanted_uid = (options.get("preconditions") or {}).get("uid")
        if wanted_uid and wanted_uid != old["metadata"].get("uid"):
            raise kmock.KubernetesError(status=409, reason="Conflict", message="precondition failed: uid")
        if old["metadata"].get("finalizers"):
            if not old["metadata"].get("deletionTimestamp"):
                new = copy.deepcopy(old)
                new["metadata"]["deletionTimestamp"] = _now()
                return await self._store(resource, namespace, name, old, new)
            return old
        await self._remove(resource, namespace, name)
        return old

    async def _remove(self, resource: Any, namespace: str | None, name: str) -> None:
        """Hard-delete one object and garbage-collect its dependents (background propagation)."""
        key = (resource, namespace, name)
        obj = self.objects[key].raw
        self.objects[key].delete()
        for manager_key in [k for k in self._applied if k[:3] == key]:
            del self._applied[manager_key]
        self._owners.pop(key, None)
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(next(self._counter))
        await self._publish(resource, {"type": "DELETED", "object": obj})
        self._dirty = self._dirty or resource in _CONTROLLED
        if self.simulate_scheduling and resource == NODES:
            # PodGC deletes the pods bound to a Node that is gone (their controllers make new ones).
            for (res, ns, pod_name), item in list(self.objects.items()):
                if res == PODS and not item.deleted and (item.raw.get("spec") or {}).get("nodeName") == name:
                    await self._remove(PODS, ns, pod_name)
        uid = obj["metadata"].get("uid")
        dependents = [
            (res, ns, nm) for (res, ns, nm), item in list(self.objects.items())
            if not item.deleted and any(
                ref.get("uid") == uid for ref in item.raw.get("metadata", {}).get("ownerReferences", []) or []
            )
        ]
        for dependent in dependents:
            if not self.objects[dependent].deleted:
                await self._remove(*dependent)

    # ------------------------------------------------------------ controllers (simulate_scheduling)

    async def _settle(self) -> None:
        """After a write: run the emulated controllers until they change nothing more."""
        for _ in range(20):
            if not (self._dirty and self.simulate_scheduling):
                self._dirty = False
                return
            self._dirty = False
            await self._sync_deployments()
            await self._schedule()
            await self._report_deployments()
        raise RuntimeError("the emulated controllers kept changing the cluster (a bug in the emulator)")

    def _live(self, resource: Any) -> list[Obj]:
        return [item.raw for (res, _, _), item in self.objects.items() if res == resource and not item.deleted]

    def _pods_of(self, deployment: Obj) -> list[Obj]:
        uid = deployment["metadata"]["uid"]
        return [pod for pod in self._live(PODS) if any(
            ref.get("uid") == uid and ref.get("controller") for ref in pod["metadata"].get("ownerReferences") or [])]

    async def _write(self, resource: Any, namespace: str | None, name: str, new: Obj, manager: str) -> None:
        key = (resource, namespace, name)
        old = self._current(resource, namespace, name) if key in self.objects and not self.objects[key].deleted \
            else None
        self._take_updated(key, old, new, manager)
        await self._store(resource, namespace, name, old, new)

    async def _sync_deployments(self) -> None:
        """The Deployment and ReplicaSet controllers: ``spec.replicas`` pods of the current template.

        A template change replaces every pod at once (no surge: a strategy is not modelled), scaling
        down deletes the highest indices first, and a missing pod is made again under its old name."""
        for deployment in self._live(DEPLOYMENTS):
            meta, spec = deployment["metadata"], deployment.get("spec") or {}
            if meta.get("deletionTimestamp"):
                continue
            template = spec.get("template") or {}
            current = scheduler.template_hash(template)
            prefix = f"{meta['name']}-{current}-"
            indices: dict[int, Obj] = {}
            for pod in self._pods_of(deployment):
                name = pod["metadata"]["name"]
                suffix = name[len(prefix):] if name.startswith(prefix) else ""
                if suffix.isdigit() and int(suffix) not in indices:
                    indices[int(suffix)] = pod
                else:
                    await self._remove(PODS, meta["namespace"], name)  # an older template's pod
            wanted = int(spec.get("replicas", 1))
            for index in sorted(indices, reverse=True)[:max(len(indices) - wanted, 0)]:
                await self._remove(PODS, meta["namespace"], indices.pop(index)["metadata"]["name"])
            free = (i for i in itertools.count() if i not in indices)
            for _ in range(wanted - len(indices)):
                name = f"{prefix}{next(free)}"
                await self._write(PODS, meta["namespace"], name, self._pod_for(deployment, current, name),
                                  "kube-controller-manager")

    @staticmethod
    def _pod_for(deployment: Obj, current: str, name: str) -> Obj:
        """The pod the ReplicaSet controller makes from the template (owned by the Deployment here)."""
        meta = deployment["metadata"]
        template = deployment["spec"].get("template") or {}
        template_meta = template.get("metadata") or {}
        pod_meta: Obj = {
            "name": name, "generateName": f"{meta['name']}-{current}-", "namespace": meta["namespace"],
            "labels": {**(template_meta.get("labels") or {}), scheduler.TEMPLATE_HASH_LABEL: current},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": meta["name"],
                                 "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}],
        }
        if template_meta.get("annotations"):
            pod_meta["annotations"] = copy.deepcopy(template_meta["annotations"])
        return {"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta,
                "spec": copy.deepcopy(template.get("spec") or {}), "status": {"phase": "Pending"}}

    async def _schedule(self) -> None:
        """kube-scheduler, oldest pod first, then the kubelet: bound pods run and are ready.

        Pods with ``spec.resourceClaims`` are placed by their other constraints only: their claims are
        neither allocated nor checked against ResourceSlices (no CEL), a gap ``e2e/README.md`` names."""
        nodes = [node for node in self._live(NODES) if not node["metadata"].get("deletionTimestamp")]
        node_names = {node["metadata"]["name"] for node in nodes}
        pods = {(p["metadata"].get("namespace"), p["metadata"]["name"]): p for p in self._live(PODS)}
        waiting = sorted((p for p in pods.values() if not (p.get("spec") or {}).get("nodeName")
                          and not p["metadata"].get("deletionTimestamp")
                          and (p.get("status") or {}).get("phase", "Pending") == "Pending"
                          and (p.get("spec") or {}).get("schedulerName", "default-scheduler") == "default-scheduler"),
                         key=lambda p: uuid.UUID(p["metadata"]["uid"]).int)
        for pod in waiting:
            key = (pod["metadata"].get("namespace"), pod["metadata"]["name"])
            new = copy.deepcopy(pod)
            if (pod.get("spec") or {}).get("schedulingGates"):
                self._set_scheduled(new, "False", "SchedulingGated", scheduler.GATED)
                await self._write(PODS, *key, new, "kube-scheduler")
                continue
            verdict = scheduler.schedule(pod, nodes, pods.values())
            if verdict.node is None:
                self._set_scheduled(new, "False", "Unschedulable", verdict.message)
                await self._write(PODS, *key, new, "kube-scheduler")
            else:
                new["spec"]["nodeName"] = verdict.node
                self._set_scheduled(new, "True", None, None)
                await self._write(PODS, *key, new, "kube-scheduler")
            pods[key] = self._current(PODS, *key)
        for key, pod in pods.items():
            if (pod.get("spec") or {}).get("nodeName") in node_names \
                    and (pod.get("status") or {}).get("phase", "Pending") == "Pending":
                await self._write(PODS, *key, self._running(pod), "kubelet")

    @staticmethod
    def _set_scheduled(pod: Obj, status: str, reason: str | None, message: str | None) -> None:
        state = pod.setdefault("status", {})
        state.setdefault("phase", "Pending")
        conditions = [c for c in state.get("conditions") or [] if c.get("type") != "PodScheduled"]
        previous: Obj = next((c for c in state.get("conditions") or [] if c.get("type") == "PodScheduled"), {})
        condition: Obj = {"type": "PodScheduled", "status": status, "lastProbeTime": None,
                          "lastTransitionTime": previous.get("lastTransitionTime")
                          if previous.get("status") == status else _now()}
        if reason is not None:
            condition.update(reason=reason, message=message)
        state["conditions"] = [condition, *conditions]

    @staticmethod
    def _running(pod: Obj) -> Obj:
        """What the kubelet reports once the pod's containers run (no probes: ready at once)."""
        new = copy.deepcopy(pod)
        now = _now()
        scheduled = next((c for c in (pod.get("status") or {}).get("conditions") or []
                          if c.get("type") == "PodScheduled"), None) or \
            {"type": "PodScheduled", "status": "True", "lastProbeTime": None, "lastTransitionTime": now}
        conditions = [{"type": type_, "status": "True", "lastProbeTime": None, "lastTransitionTime": now}
                      for type_ in ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady")]
        new["status"] = {
            "phase": "Running", "conditions": [*conditions, scheduled], "startTime": now,
            "containerStatuses": [
                {"name": c.get("name"), "image": c.get("image"), "ready": True, "started": True, "restartCount": 0,
                 "state": {"running": {"startedAt": now}}}
                for c in (pod.get("spec") or {}).get("containers") or []],
        }
        return new

    async def _report_deployments(self) -> None:
        """The Deployment controller's status: counts of the pods that exist, are current and are ready."""
        for deployment in self._live(DEPLOYMENTS):
            meta = deployment["metadata"]
            status = scheduler.deployment_status(deployment, self._pods_of(deployment), _now())
            if status != deployment.get("status"):
                await self._write_deployment_status(meta["namespace"], meta["name"], status)

    async def _write_deployment_status(self, namespace: str, name: str, status: Obj) -> None:
        current = self._current(DEPLOYMENTS, namespace, name)
        await self._store(DEPLOYMENTS, namespace, name, current, {**copy.deepcopy(current), "status": status})
