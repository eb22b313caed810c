"""Sidecar mode: the runtime injected into application pods by the operator's mutating admission webhook.

Pure, like ``builders``: no I/O, no clock. ``handlers`` calls :func:`admit` with the pod under admission
and the InferenceModels of its namespace (a kopf index, so admission makes no API call) and answers with
the JSON patch (RFC 6902) it returns, or denies the pod with :class:`Denied`'s message. ``reconcile``
calls :func:`children` for a model with ``spec.mode: Sidecar``: its model-config ConfigMap, nothing else.

What a pod gets (docs/operator.md, "Sidecar mode"): the model fetch init containers (``builders._fetch``),
then the runtime as a native sidecar (an init container with ``restartPolicy: Always``, Kubernetes >= 1.29)
placed before the application's own init containers, so those already find the models loaded; below 1.29
(``native=False``) the runtime is a regular container appended to ``containers``. The runtime listens on
the pod's loopback and on Unix sockets in a shared ``/var/run/sluice``; a memory-backed ``/dev/shm`` is
shared with the application containers for Triton's system shared memory.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from sluice.operator import api, builders
from sluice.operator.settings import Settings

Obj = dict[str, Any]
Op = dict[str, Any]
"""One RFC 6902 operation: ``{"op": "add", "path": "/spec/volumes/-", "value": ...}``."""

INJECT_ANNOTATION = "sluice.dev/inject"
"""On a pod: the InferenceModel(s) (same namespace, comma-separated) whose runtime it wants; ``false`` opts out."""
INJECTED_ANNOTATION = "sluice.dev/injected"
"""Set by the injection: ``<model>@<config hash>`` per model; a pod carrying it is never injected again."""
NAMESPACE_LABEL = "sluice.dev/injection"
"""The webhook's namespaceSelector: only namespaces labelled ``sluice.dev/injection: enabled`` are asked."""
CONTAINER = "sluice-runtime"
PREFIX = "sluice-"
"""Every container and volume the injection adds is named with it, so a clash with the app is unlikely."""
LOOPBACK = "127.0.0.1"
SOCKET_DIRECTORY = "/var/run/sluice"
HTTP_SOCKET = f"{SOCKET_DIRECTORY}/http.sock"
GRPC_SOCKET = f"{SOCKET_DIRECTORY}/grpc.sock"
SHM = "/dev/shm"
METRICS_PORT_NAME = "sluice-metrics"
MODELS_VOLUME, TMP_VOLUME, SHM_VOLUME, SOCKETS_VOLUME = "sluice-models", "sluice-tmp", "sluice-shm", "sluice-sockets"
NATIVE_SIDECARS_SINCE = (1, 29)
"""``restartPolicy: Always`` on init containers (SidecarContainers) is on by default from Kubernetes 1.29."""


def _probe(path: str) -> Obj:
    # The kubelet's probes reach the pod IP, never its loopback: they go to the metrics listener, the one
    # the runtime opens to the pod IP (``--metrics-host``), which answers the health paths too.
    return {"httpGet": {"path": path, "port": METRICS_PORT_NAME}, "timeoutSeconds": 5}


class Denied(ValueError):
    """The pod asks for an injection that cannot be done; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Model:
    """An InferenceModel as the webhook's index keeps it: its spec, or why it cannot be injected."""

    name: str
    spec: api.InferenceModelSpec | None
    problem: str = ""


READY_TO_INJECT = "ReadyToInject"
"""The Ready reason of a Sidecar model whose config the operator rendered for its current spec; only such
a model is injected (an injected pod mounts that ConfigMap and would not start without it)."""


def rendered(generation: int) -> Obj:
    """The status the operator writes once a Sidecar model's config of ``generation`` is rendered (the
    part :func:`indexed` reads)."""
    return {"observedGeneration": generation,
            "conditions": [{"type": "Ready", "status": "True", "reason": READY_TO_INJECT}]}


def indexed(name: str, raw_spec: Mapping[str, Any], status: Mapping[str, Any] | None,
            generation: int | None) -> Model:
    """What the webhook needs to know of InferenceModel ``name`` (called by the kopf index on every
    change, status writes included): its spec once ``status`` says the config of this ``generation``
    is rendered (Ready, :data:`READY_TO_INJECT`), else why it cannot be injected now."""
    try:
        spec = api.parse_inference_model(name, raw_spec)
    except api.SpecError as exc:
        return Model(name, None, f"its spec is invalid ({exc}); see its Degraded condition")
    if spec.mode != api.SIDECAR_MODE:
        return Model(name, None, f"its spec.mode is {spec.mode}, not {api.SIDECAR_MODE}: it runs in its own pods; "
                                 f"call its Service, or set spec.mode: {api.SIDECAR_MODE}")
    if problems := builders.unserved_formats([("spec.model", spec.model)]):
        return Model(name, None, "; ".join(problems))
    status = status or {}
    ready = next((c for c in status.get("conditions") or () if isinstance(c, Mapping) and c.get("type") == "Ready"),
                 None)
    config = f"ConfigMap {config_map_name(name)!r}"
    if generation is not None and status.get("observedGeneration") != generation:
        return Model(name, None, f"the operator has not rendered its config ({config}) for generation {generation} "
                                 "of its spec yet; the pod's controller retries")
    if ready is None or ready.get("status") != "True" or ready.get("reason") != READY_TO_INJECT:
        degraded = next((c for c in status.get("conditions") or ()
                         if isinstance(c, Mapping) and c.get("type") == "Degraded" and c.get("status") == "True"), None)
        said = degraded or ready  # the Degraded condition says what went wrong, where there is one
        why = "" if said is None else f" ({said.get('reason')}" + (
            f": {said['message']})" if said.get("message") else ")")
        return Model(name, None, f"its config ({config}) is not rendered{why}; see its conditions")
    return Model(name, spec)


def requested(pod: Mapping[str, Any]) -> tuple[str, ...]:
    """The models ``pod`` asks for in its ``sluice.dev/inject`` annotation; empty when absent or ``false``."""
    value = str(((pod.get("metadata") or {}).get("annotations") or {}).get(INJECT_ANNOTATION, "")).strip()
    if value.lower() in ("", "false"):
        return ()
    names = [part.strip() for part in value.split(",") if part.strip()]
    return tuple(dict.fromkeys(names))


def native_sidecars(setting: str, version: Mapping[str, Any] | None) -> bool:
    """Whether to inject a native sidecar: ``true``/``false`` as set, ``auto`` from the API server's
    ``/version`` (``minor`` may read ``29+`` on managed clusters); an unreadable version is taken as old."""
    if setting != "auto":
        return setting == "true"
    try:
        major = int(re.sub(r"\D", "", str((version or {}).get("major", ""))))
        minor = int(re.sub(r"\D", "", str((version or {}).get("minor", ""))))
    except ValueError:
        return False
    return (major, minor) >= NATIVE_SIDECARS_SINCE


def _served(spec: api.InferenceModelSpec) -> builders.ServedModel:
    return builders.served_model(spec.model, spec.runtime, gpu=spec.resources.gpu is not None)


def config_files(spec: api.InferenceModelSpec) -> dict[str, str]:
    """The model's config file(s), keyed as in its ConfigMap (the same as an own Deployment's)."""
    served = _served(spec)
    return {builders._config_key(served): served.config_text}


def config_map_name(model: str) -> str:
    return f"{model}-config"


def children(owner: builders.Owner, spec: api.InferenceModelSpec, settings: Settings) -> builders.Desired:
    """Children of a Sidecar-mode InferenceModel: its model-config ConfigMap, which injected pods mount.
    Everything a Deployment-mode model owns is named absent, so switching modes gives those up."""
    if problems := builders.unserved_formats([("spec.model", spec.model)]):
        raise builders.NotServedError(problems)
    if spec.resources.gpu is not None and settings.gpu_allocation == "dra":
        raise builders.UnsatisfiableError([
            "spec.resources.gpu: a Sidecar model's GPU is asked for with extended resources only; with "
            "gpus.allocation dra (SLUICE_GPU_ALLOCATION) use spec.mode Deployment"])
    name = config_map_name(owner.name)
    keep = ("v1", "ConfigMap", name)
    absent = [a for a in builders._track_names(owner, builders.STABLE) if a != keep]
    absent += builders._track_names(owner, builders.CANARY) + builders._route_names(owner)
    http_url = f"http://localhost:{settings.http_port}"
    return builders.Desired(
        objects=(builders.config_map(owner, name, config_files(spec)),), absent=tuple(absent), selector="",
        http_url=http_url, grpc_target=f"localhost:{settings.grpc_port}",
        model_url=f"{http_url}/v2/models/{spec.model.name}",
        traffic=({"revision": builders.STABLE, "version": spec.model.version, "percent": 100},),
    )


def injected(pod: Mapping[str, Any]) -> bool:
    """Whether ``pod`` already carries the runtime (the annotation, or the container under our name)."""
    if INJECTED_ANNOTATION in ((pod.get("metadata") or {}).get("annotations") or {}):
        return True
    spec = pod.get("spec") or {}
    return any(c.get("name") == CONTAINER for c in [*(spec.get("initContainers") or []),
                                                     *(spec.get("containers") or [])])


def admit(pod: Mapping[str, Any], known: Mapping[str, Model], settings: Settings, *, native: bool) -> list[Op]:
    """The JSON patch for a pod under admission: empty when it asks for nothing, opted out or already
    carries the runtime; :class:`Denied` when a model it names cannot be injected (unknown, not in Sidecar
    mode, invalid) or the injection clashes with the pod."""
    names = requested(pod)
    if not names or injected(pod):
        return []
    namespace = (pod.get("metadata") or {}).get("namespace") or "<the pod's namespace>"
    problems = []
    for name in names:
        model = known.get(name)
        if model is None:
            problems.append(f"InferenceModel {name!r} does not exist in namespace {namespace!r}")
        elif model.spec is None:
            problems.append(f"InferenceModel {name!r} cannot be injected: {model.problem}")
    if problems:
        raise Denied(f"{INJECT_ANNOTATION}: " + "; ".join(problems) + ". Fix the annotation (or set it to "
                     "\"false\" to start the pod without the runtime)")
    specs = [(name, known[name].spec) for name in names]
    return inject(pod, [(name, spec) for name, spec in specs if spec is not None], settings, native=native)


def apply(document: dict[str, Any], ops: Sequence[Op]) -> None:
    """Apply the ``add`` operations :func:`inject` makes to ``document`` in place (RFC 6902 semantics: into
    an object a member is set, into an array an element is inserted at the index, ``-`` appends)."""
    for op in ops:
        if op["op"] != "add":
            raise ValueError(f"only 'add' operations are applied here, got {op['op']!r}")
        *parents, last = [part.replace("~1", "/").replace("~0", "~") for part in op["path"].split("/")[1:]]
        target: Any = document
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if isinstance(target, list):
            target.insert(len(target) if last == "-" else int(last), op["value"])
        else:
            target[last] = op["value"]


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _prefixed(name: str) -> str:
    return name if name.startswith(PREFIX) else builders.dns_label(PREFIX + name)


def _container_security_context() -> Obj:
    # The app's pod-level securityContext is the app's: the injected containers carry their own.
    return {**builders._restricted_security_context(), "runAsUser": builders.RUNTIME_UID,
            "runAsGroup": builders.RUNTIME_UID, "seccompProfile": {"type": "RuntimeDefault"}}


def _list_ops(path: str, existing: Sequence[Any] | None, items: Sequence[Any], *, at_front: bool = False) -> list[Op]:
    """Ops that add ``items`` to the list at ``path`` (created when absent), at its end or front, in order."""
    if not items:
        return []
    if not existing:
        return [{"op": "add", "path": path, "value": list(items)}]
    if at_front:
        return [{"op": "add", "path": f"{path}/{index}", "value": item} for index, item in enumerate(items)]
    return [{"op": "add", "path": f"{path}/-", "value": item} for item in items]


def inject(
    pod: Mapping[str, Any], models: Sequence[tuple[str, api.InferenceModelSpec]], settings: Settings, *,
    native: bool,
) -> list[Op]:
    """The JSON patch that adds the runtime serving ``models`` ((InferenceModel name, spec)) to ``pod``;
    :class:`Denied` naming the clash when a name, port or mount path it needs is the app's already."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    containers: list[Obj] = list(spec.get("containers") or [])
    app_inits: list[Obj] = list(spec.get("initContainers") or [])
    http, grpc, metrics = settings.http_port, settings.grpc_port, settings.metrics_port
    repository = builders.MODEL_REPOSITORY

    gpus = [m.resources.gpu for _, m in models if m.resources.gpu is not None]
    rendering = builders.gpu_rendering(gpus)
    image = settings.runtime_gpu_image if rendering.gpu else settings.runtime_image
    storage_request, repository_limit = builders.model_storage([_served(m) for _, m in models])

    # ---- what the runtime needs: fetches, volumes, mounts (builders' fetch, our names)
    fetches: list[Obj] = []
    volumes: list[Obj] = [
        {"name": MODELS_VOLUME, "emptyDir": {"sizeLimit": repository_limit} if repository_limit else {}},
        {"name": TMP_VOLUME, "emptyDir": {}},
        {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": settings.webhook.shm_size}},
        {"name": SOCKETS_VOLUME, "emptyDir": {}},
    ]
    mounts: list[Obj] = [{"name": MODELS_VOLUME, "mountPath": repository}, {"name": TMP_VOLUME, "mountPath": "/tmp"}]
    stamps: list[str] = []
    for index, (name, model) in enumerate(models):
        renamed = {"model-repository": MODELS_VOLUME, "tmp": TMP_VOLUME}
        init, volume, mount = builders._fetch(model.model, index, model.storage, settings, image=image)
        if init is not None:
            init = {**init, "name": _prefixed(init["name"]), "securityContext": _container_security_context(),
                    "volumeMounts": [{**m, "name": renamed.get(m["name"], _prefixed(m["name"]))}
                                     for m in init.get("volumeMounts", [])]}
            fetches.append(init)
        # A volume may come without a runtime mount: a storage Secret is the fetch's alone.
        if volume is not None:
            if "secret" in volume:
                # readable by the fetch's uid: the app's pod sets no fsGroup for it (a Deployment of
                # Sluice's does), so 0440 files owned by root would be unreadable; only the fetch mounts it
                volume = {**volume, "secret": {**volume["secret"], "defaultMode": 0o444}}
            volumes.append({**volume, "name": _prefixed(volume["name"])})
        if mount is not None:
            mounts.append({**mount, "name": _prefixed(mount["name"])})
        served = _served(model)
        files = config_files(model)
        config_volume = f"{PREFIX}config-{index}"
        volumes.append({"name": config_volume, "configMap": {"name": config_map_name(name)}})
        mounts.append({"name": config_volume, "readOnly": True, "subPath": builders._config_key(served),
                       "mountPath": f"{repository}/{model.model.name}/{served.config_name}"})
        stamps.append(f"{name}@{builders.config_hash(files)}")
    shared_mounts = [{"name": SHM_VOLUME, "mountPath": SHM}, {"name": SOCKETS_VOLUME, "mountPath": SOCKET_DIRECTORY}]
    mounts += shared_mounts

    # ---- the runtime container
    defaults = settings.default_resources
    cpu = builders.resource_sum([m.resources.cpu or defaults.cpu for _, m in models], "cpu")
    memory = builders.resource_sum([m.resources.memory or defaults.memory for _, m in models], "memory")
    grace = max(m.shutdown.grace_seconds for _, m in models)
    runtime: Obj = {
        "name": CONTAINER,
        "image": image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["sluice"],
        "args": ["serve", "--model-repository", repository, "--host", LOOPBACK, "--http-port", str(http),
                 "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--metrics-host", "0.0.0.0",
                 "--http-uds", HTTP_SOCKET,
                 "--grpc-uds", GRPC_SOCKET, "--strict-readiness", "true",
                 # Nothing routes to a sidecar through endpoints: no drain, only the in-flight grace.
                 "--drain-period-s", "0", "--shutdown-grace-s", str(grace)],
        "ports": [
            {"name": "sluice-http", "containerPort": http, "protocol": "TCP"},
            {"name": "sluice-grpc", "containerPort": grpc, "protocol": "TCP"},
            {"name": METRICS_PORT_NAME, "containerPort": metrics, "protocol": "TCP"},
        ],
        # A native sidecar's startup probe holds back the containers after it until the models are loaded.
        # Up to 30 minutes to fetch and load the models.
        "startupProbe": {**_probe("/v2/health/ready"), "periodSeconds": 2, "failureThreshold": 900},
        "readinessProbe": {**_probe("/v2/health/ready"), "periodSeconds": 10, "failureThreshold": 3},
        "livenessProbe": {**_probe("/v2/health/live"), "periodSeconds": 10, "failureThreshold": 3},
        "resources": {"requests": {"cpu": cpu, "memory": memory, **rendering.limits,
                                   **({"ephemeral-storage": storage_request} if storage_request else {})},
                      "limits": {"cpu": cpu, "memory": memory, **rendering.limits}},
        "securityContext": _container_security_context(),
        "volumeMounts": mounts,
    }
    if native:
        runtime = {"name": CONTAINER, "restartPolicy": "Always", **{k: v for k, v in runtime.items() if k != "name"}}

    # ---- clashes with what the app already uses
    app_all = [*app_inits, *containers]
    problems: list[str] = []
    taken_names = {c.get("name") for c in app_all}
    problems += [f"container name {c['name']!r} is already used by the pod" for c in [*fetches, runtime]
                 if c["name"] in taken_names]
    taken_volumes = {v.get("name") for v in spec.get("volumes") or []}
    problems += [f"volume name {v['name']!r} is already used by the pod" for v in volumes if v["name"] in taken_volumes]
    for container in app_all:
        for port in container.get("ports") or []:
            if port.get("containerPort") in (http, grpc, metrics):
                problems.append(f"port {port['containerPort']} is taken by container {container.get('name')!r} "
                                f"(the runtime listens on {http}, {grpc} and {metrics} on the pod's loopback)")
    receivers = [*app_inits, *containers] if native else containers
    for container in receivers:
        for mount in container.get("volumeMounts") or []:
            if mount.get("mountPath", "").rstrip("/") in (SHM, SOCKET_DIRECTORY):
                problems.append(f"container {container.get('name')!r} already mounts {mount['mountPath']} (volume "
                                f"{mount.get('name')!r}); the runtime shares its own {SHM} and {SOCKET_DIRECTORY}")
    if spec.get("hostNetwork"):
        problems.append(f"the pod uses hostNetwork, so the runtime's ports {http}, {grpc} and {metrics} would be the "
                        "node's (reachable by anything on the node, and taken by a second such pod there)")
    serving: dict[str, str] = {}  # model name -> the InferenceModel serving it
    for name, model in models:
        other = serving.setdefault(model.model.name, name)
        if other != name:
            problems.append(f"InferenceModels {other!r} and {name!r} both serve model {model.model.name!r} "
                            "(spec.model.name); one runtime holds each model name once: give one another name")
    pod_account = spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"
    for name, model in models:
        wanted = model.storage.service_account_name
        if wanted is not None and wanted != pod_account:
            problems.append(f"InferenceModel {name!r} fetches as service account {wanted!r} (spec.storage."
                            f"serviceAccountName) but the pod runs as {pod_account!r}: the fetch runs in the pod")
    if problems:
        raise Denied("cannot inject the Sluice runtime: " + "; ".join(problems)
                     + f". Rename or remove those in the pod, or set {INJECT_ANNOTATION}: \"false\"")

    # ---- the patch: app containers first (their indexes do not move yet), then additions
    ops: list[Op] = []
    env = [{"name": "SLUICE_HTTP_URL", "value": f"localhost:{http}"},
           {"name": "SLUICE_GRPC_URL", "value": f"localhost:{grpc}"},
           {"name": "SLUICE_GRPC_UDS", "value": f"unix://{GRPC_SOCKET}"}]
    for field, group in (("initContainers", app_inits if native else []), ("containers", containers)):
        for index, container in enumerate(group):
            base = f"/spec/{field}/{index}"
            ops += _list_ops(f"{base}/volumeMounts", container.get("volumeMounts"), shared_mounts)
            names = {e.get("name") for e in container.get("env") or []}
            ops += _list_ops(f"{base}/env", container.get("env"), [e for e in env if e["name"] not in names])
    ops += _list_ops("/spec/volumes", spec.get("volumes"), volumes)
    if native:
        ops += _list_ops("/spec/initContainers", app_inits, [*fetches, runtime], at_front=True)
    else:
        ops += _list_ops("/spec/initContainers", app_inits, fetches, at_front=True)
        ops += [{"op": "add", "path": "/spec/containers/-", "value": runtime}]
    present = list(spec.get("tolerations") or [])
    ops += _list_ops("/spec/tolerations", spec.get("tolerations"),
                     [dict(t) for t in rendering.tolerations if dict(t) not in present])
    ops += _affinity_ops(spec.get("affinity"), rendering.affinity)
    annotations = {INJECTED_ANNOTATION: ",".join(stamps)}
    present_annotations = meta.get("annotations") or {}
    if not any(key.startswith("prometheus.io/") for key in present_annotations):
        # The runtime's metrics listener is on the pod IP; an app that already annotates keeps its own.
        annotations |= {"prometheus.io/scrape": "true", "prometheus.io/port": str(metrics)}
    if meta.get("annotations"):
        ops += [{"op": "add", "path": f"/metadata/annotations/{_escape(k)}", "value": v}
                for k, v in annotations.items()]
    else:
        ops.append({"op": "add", "path": "/metadata/annotations", "value": annotations})
    return ops


def _affinity_ops(existing: Mapping[str, Any] | None, wanted: Obj | None) -> list[Op]:
    """Ops that AND the GPU's required node affinity into the pod's own (each of its terms gets ours)."""
    if not wanted:
        return []
    if not existing:
        return [{"op": "add", "path": "/spec/affinity", "value": wanted}]
    node = existing.get("nodeAffinity")
    if not node:
        return [{"op": "add", "path": "/spec/affinity/nodeAffinity", "value": wanted["nodeAffinity"]}]
    key = "requiredDuringSchedulingIgnoredDuringExecution"
    required = wanted["nodeAffinity"][key]
    if not node.get(key):
        return [{"op": "add", "path": f"/spec/affinity/nodeAffinity/{key}", "value": required}]
    expressions = [e for term in required["nodeSelectorTerms"] for e in term.get("matchExpressions", [])]
    ops: list[Op] = []
    for index, term in enumerate(node[key].get("nodeSelectorTerms") or []):
        ops += _list_ops(f"/spec/affinity/nodeAffinity/{key}/nodeSelectorTerms/{index}/matchExpressions",
                         term.get("matchExpressions"), expressions)
    return ops
