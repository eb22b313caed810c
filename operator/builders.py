"""Pure builders: a validated spec + settings -> the Kubernetes objects that should exist.

No I/O, no clock, no randomness: the same input always gives the same objects, so golden files pin
them and re-running a reconcile changes nothing. ``reconcile`` calls :func:`inference_model`,
:func:`ensemble`, :func:`model_pool` and :func:`pool_member`; ``kube`` applies what they return.

Layout of a runtime pod: an emptyDir at ``/models`` is the model repository; each model's files land
in ``/models/<name>/<version>`` (fetched by an init container, or a PVC sub-path mounted read-only),
and its config file is mounted from the ConfigMap at ``/models/<name>/config.<ext>``. A hash of the
ConfigMap goes into a pod-template annotation so a config change rolls the Deployment.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from sluice.operator import api, placement
from sluice.operator import gpus as gpu_catalogue
from sluice.operator.placement import Shape
from sluice.operator.settings import FIELD_MANAGER, Settings

Obj = dict[str, Any]

MANAGED_BY = "sluice-operator"
CONFIG_HASH_ANNOTATION = "sluice.dev/config-hash"
CANDIDATE_ANNOTATION = "sluice.dev/candidate"
"""On a Deployment's metadata (not its pod template, so it rolls nothing): the canary candidate it runs."""
TRACK_LABEL = "sluice.dev/track"
STABLE, CANARY = "stable", "canary"
SPLIT_DIRECTORY = "/etc/sluice/split"
SPLIT_FILE = "split.json"
"""The no-mesh split (``--split-file``): a ConfigMap ``<name>-split`` mounted into the stable pods."""
ROUTERS = ("gateway-api", "istio", "none")
MODEL_REPOSITORY = "/models"
GPU_RESOURCE = "nvidia.com/gpu"
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
RUNTIME_UID = 10001


class UnsatisfiableError(api.ProblemsError):
    """The spec is valid on its own but cannot be rendered (e.g. an ensemble that fits nowhere)."""


class NotServedError(UnsatisfiableError):
    """The spec asks for something the runtime cannot do yet (a model format without a backend)."""


def unserved_formats(sources: Sequence[tuple[str, api.ModelSource]]) -> list[str]:
    """A problem for each ``(field path, model)`` whose format the runtime cannot load yet."""
    return [
        f"{path}.format: {source.format} models are not served by this runtime version yet "
        f"(served: {', '.join(api.SERVED_FORMATS)}); nothing is deployed for it. Convert the model "
        "(e.g. export it to ONNX, or TorchScript with format torchscript)"
        for path, source in sources if source.format not in api.SERVED_FORMATS
    ]


@dataclasses.dataclass(frozen=True)
class Owner:
    """The custom resource the children belong to (their ownerReference)."""

    kind: str
    name: str
    namespace: str
    uid: str

    def reference(self) -> Obj:
        return {
            "apiVersion": api.API_VERSION, "kind": self.kind, "name": self.name, "uid": self.uid,
            "controller": True, "blockOwnerDeletion": True,
        }


@dataclasses.dataclass(frozen=True)
class Desired:
    """What a reconcile should make true: objects to apply, kinds to remove, and facts for status."""

    objects: tuple[Obj, ...]
    absent: tuple[tuple[str, str, str], ...]
    """(apiVersion, kind, name) of optional children that must not exist (e.g. HPA when not autoscaled)."""
    selector: str
    http_url: str
    grpc_target: str
    model_url: str
    traffic: tuple[Obj, ...]
    notes: tuple[str, ...] = ()
    """Things the spec asks for that this operator version does not do yet; reported as Degraded."""
    placement: str | None = None


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """One model inside a runtime pod: its files and its config file."""

    source: api.ModelSource
    config_name: str
    config_text: str
    storage: api.Storage | None = None
    """Credentials of this model's fetch; ``None``: the pod's (a pool's members each bring their own)."""


# ---------------------------------------------------------------- model configs

def model_config(source: api.ModelSource, runtime: api.RuntimeConfig, *, gpu: bool) -> Obj:
    """The Triton model config (proto field names, JSON mapping) for ``source`` and ``runtime``."""
    config: Obj = {
        "name": source.name,
        "backend": api.BACKEND_BY_FORMAT[source.format],
        "max_batch_size": runtime.max_batch_size,
        "version_policy": {"specific": {"versions": [source.version]}},
        "instance_group": [{"count": runtime.instances, "kind": "KIND_GPU" if gpu else "KIND_CPU"}],
    }
    filename = _single_file(source)
    if filename is not None:
        config["default_model_filename"] = filename
    if runtime.dynamic_batching is not None:
        batching: Obj = {"max_queue_delay_microseconds": runtime.dynamic_batching.max_queue_delay_microseconds}
        if runtime.dynamic_batching.preferred_batch_sizes:
            batching["preferred_batch_size"] = list(runtime.dynamic_batching.preferred_batch_sizes)
        config["dynamic_batching"] = batching
    if runtime.queue_policy is not None:
        policy = {
            "max_queue_size": runtime.queue_policy.max_queue_size,
            "default_timeout_microseconds": runtime.queue_policy.timeout_microseconds,
            "timeout_action": runtime.queue_policy.timeout_action,
        }
        config.setdefault("dynamic_batching", {})["default_queue_policy"] = policy
    if runtime.cuda_graphs:
        config["optimization"] = {"cuda": {"graphs": True}}
    if runtime.response_cache:
        config["response_cache"] = {"enable": True}
    return config


def _single_file(source: api.ModelSource) -> str | None:
    """``default_model_filename`` for one fetched file: its own name. An https:// file is always named (as
    it always was); an object-store file only when the runtime would not find it by its default name, so
    configs rendered before object-store files were named stay as they were."""
    name = api.single_file(source.storage_uri)
    if name is None or (not source.storage_uri.startswith("https://")
                        and name in api.DEFAULT_MODEL_FILES.get(source.format, ())):
        return None
    return name


def served_model(
    source: api.ModelSource, runtime: api.RuntimeConfig, *, gpu: bool, storage: api.Storage | None = None,
) -> ServedModel:
    if source.config is not None:
        return ServedModel(source, f"config.{source.config_format}", source.config, storage)
    text = json.dumps(model_config(source, runtime, gpu=gpu), indent=2, sort_keys=True) + "\n"
    return ServedModel(source, "config.json", text, storage)


def ensemble_config(name: str, spec: api.EnsembleSpec, step_models: Mapping[str, str],
                    remote: Mapping[str, str]) -> Obj:
    """Triton ``platform: ensemble`` config; ``remote`` maps model names to gRPC targets to call."""

    def tensor(t: api.Tensor) -> Obj:
        return {"name": t.name, "data_type": t.data_type, "dims": list(t.dims)}

    config: Obj = {
        "name": name,
        "platform": "ensemble",
        "max_batch_size": spec.max_batch_size,
        "input": [tensor(t) for t in spec.inputs],
        "output": [tensor(t) for t in spec.outputs],
        "ensemble_scheduling": {"step": [
            {
                "model_name": step_models[step.name],
                "model_version": step.version,
                # Triton's maps are keyed by the step model's tensor and name the ensemble tensor.
                "input_map": dict(sorted(step.input_map.items())),
                "output_map": dict(sorted(step.output_map.items())),
            }
            for step in spec.steps
        ]},
    }
    if remote:
        # Read by the Sluice runtime: steps named here are called over gRPC instead of loaded locally.
        config["parameters"] = {
            f"sluice.remote.{model}": {"string_value": target} for model, target in sorted(remote.items())
        }
    return config


# ---------------------------------------------------------------- objects

def _meta(owner: Owner, name: str, labels: Mapping[str, str], annotations: Mapping[str, str] | None = None) -> Obj:
    meta: Obj = {
        "name": name, "namespace": owner.namespace, "labels": dict(labels),
        "ownerReferences": [owner.reference()],
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def dns_label(name: str, limit: int = 63) -> str:
    """``name`` as a DNS-1123 label (a container's name): lower case, '_' and '.' as '-', cut to
    ``limit`` characters, with no '-' at either end (a model name may end in one, or a cut leave one)."""
    label = name.lower().replace("_", "-").replace(".", "-")[:limit].strip("-")
    return label or "model"


def instance(owner: Owner, track: str = STABLE) -> str:
    """The ``app.kubernetes.io/instance`` of a track's pods, also the name of its Deployment and Service."""
    return owner.name if track == STABLE else f"{owner.name}-{track}"


def selector_labels(owner: Owner, track: str = STABLE) -> dict[str, str]:
    """Labels that select one track's pods: the stable selector never matches a canary pod."""
    return {"app.kubernetes.io/instance": instance(owner, track), "sluice.dev/" + owner.kind.lower(): owner.name}


def common_labels(owner: Owner, track: str = STABLE) -> dict[str, str]:
    labels = {
        "app.kubernetes.io/name": "sluice-runtime",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "app.kubernetes.io/component": owner.kind.lower(),
        **selector_labels(owner, track),
    }
    if track != STABLE:
        labels[TRACK_LABEL] = track
    return labels


def config_map(owner: Owner, name: str, files: Mapping[str, str], track: str = STABLE) -> Obj:
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": _meta(owner, name, common_labels(owner, track)),
        "data": dict(sorted(files.items())),
    }


def config_hash(files: Mapping[str, str]) -> str:
    digest = hashlib.sha256()
    for key, value in sorted(files.items()):
        digest.update(key.encode() + b"\0" + value.encode() + b"\0")
    return digest.hexdigest()[:16]


def _restricted_security_context(*, read_only_root: bool = True) -> Obj:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": read_only_root,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


@dataclasses.dataclass(frozen=True)
class GpuRendering:
    """How a pod asks for its GPUs: extended resources and node constraints, or a DRA claim."""

    limits: dict[str, str]
    affinity: Obj | None = None
    tolerations: tuple[Obj, ...] = ()
    claim: Obj | None = None
    """DRA: the ``spec`` of the ResourceClaimTemplate the pod's claim is made from."""

    @property
    def gpu(self) -> bool:
        return bool(self.limits) or self.claim is not None


GPU_TOLERATION: Obj = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
DRA_API_VERSION = "resource.k8s.io/v1"
DRA_CLAIM = "gpu"
"""The pod-level name of the GPU claim (``spec.resourceClaims[].name``)."""
DRA_GPU_CLASS = "gpu.nvidia.com"
DRA_MIG_CLASS = "mig.nvidia.com"


def _product_affinity(shape: placement.Shape) -> Obj | None:
    """The nodes a shape may land on: its products (values of :attr:`placement.Shape.product_label`), and
    for an exclusive MIG slice not the nodes that time-slice that resource (``avoid``)."""
    expressions = []
    if shape.products:
        expressions.append({"key": shape.product_label, "operator": "In", "values": sorted(shape.products)})
    if shape.avoid:
        expressions.append({"key": gpu_catalogue.mig_label(shape.profile, "product"), "operator": "NotIn",
                            "values": sorted(shape.avoid)})
    if not expressions:
        return None
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": expressions},
    ]}}}


def _cel_string(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _dra_request(device_class: str, count: int, selectors: Sequence[str]) -> Obj:
    request: Obj = {"deviceClassName": device_class, "count": count}
    if selectors:
        request["selectors"] = [{"cel": {"expression": expression}} for expression in selectors]
    return request


def _dra_claim(gpu: api.Gpu, shape: placement.Shape | None) -> Obj:
    """A ResourceClaimTemplate spec for NVIDIA's DRA driver (``resource.k8s.io/v1``)."""
    attr = "device.attributes['gpu.nvidia.com']"
    memory = gpu.memory_mib()
    memory_cel = f"device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('{memory}Mi')) >= 0"
    products = []
    if shape is not None and shape.products:
        products = [f"{attr}.productName in [{', '.join(_cel_string(p) for p in shape.products)}]"]
    profile = (shape.profile if shape is not None else "") or gpu.mig_profile or ""
    if profile:
        exactly = _dra_request(DRA_MIG_CLASS, 1, [f"{attr}.profile == {_cel_string(profile)}", *products])
        request: Obj = {"name": DRA_CLAIM, "exactly": exactly}
    elif gpu.memory is not None and shape is None:
        # Nothing seen to plan on: the smallest way DRA can say "a MIG slice with this much, else a GPU".
        request = {"name": DRA_CLAIM, "firstAvailable": [
            {"name": "mig", **_dra_request(DRA_MIG_CLASS, 1, [memory_cel])},
            {"name": "gpu", **_dra_request(DRA_GPU_CLASS, 1, [memory_cel])},
        ]}
    else:
        selectors = [*products, *([memory_cel] if memory else [])]
        request = {"name": DRA_CLAIM, "exactly": _dra_request(DRA_GPU_CLASS, gpu.count or 1, selectors)}
    return {"spec": {"devices": {"requests": [request]}}}


def gpu_rendering(
    gpus: Sequence[api.Gpu], shape: placement.Shape | None = None, *, dra: bool = False,
) -> GpuRendering:
    """How a pod asks for ``gpus``: from the planner's ``shape`` when there is one (one GPU need),
    else from the spec alone (no inventory visible, or an Ensemble's colocated steps)."""
    if not gpus:
        return GpuRendering(limits={})
    shape_tolerations = (GPU_TOLERATION,) if shape is None else (
        GPU_TOLERATION, *(dict(t) for t in shape.tolerations if dict(t) != GPU_TOLERATION))
    if dra and len(gpus) == 1:
        # DRA pods land on the same tainted GPU nodes: they tolerate what extended-resource pods do
        return GpuRendering(limits={}, claim=_dra_claim(gpus[0], shape), tolerations=shape_tolerations)
    if shape is not None and len(gpus) == 1:
        tolerations = list(shape_tolerations)
        return GpuRendering(
            limits={shape.resource: str(shape.count)},
            affinity=_product_affinity(shape),
            tolerations=tuple(tolerations),
        )
    limits: dict[str, int] = {}
    min_memory: float | None = None
    for gpu in gpus:
        if gpu.count is not None:
            limits[GPU_RESOURCE] = limits.get(GPU_RESOURCE, 0) + gpu.count
        elif gpu.mig_profile is not None:
            key = gpu_catalogue.resource_name(gpu.mig_profile)  # 1g.10gb+me -> nvidia.com/mig-1g.10gb.me
            limits[key] = limits.get(key, 0) + 1
        elif gpu.memory is not None:
            limits[GPU_RESOURCE] = limits.get(GPU_RESOURCE, 0) + 1
            min_memory = max(min_memory or 0.0, float(gpu.memory_mib()))
    affinity = None
    if min_memory is not None:
        # GPU feature discovery publishes the per-GPU memory in MiB; Gt is strict, hence the -1.
        affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [
                {"key": GPU_MEMORY_LABEL, "operator": "Gt", "values": [str(int(min_memory) - 1)]},
            ]},
        ]}}}
    return GpuRendering(limits={key: str(value) for key, value in sorted(limits.items())}, affinity=affinity,
                        tolerations=(GPU_TOLERATION,))


def claim_template(owner: Owner, name: str, rendering: GpuRendering, track: str = STABLE) -> Obj:
    assert rendering.claim is not None
    return {
        "apiVersion": DRA_API_VERSION, "kind": "ResourceClaimTemplate",
        "metadata": _meta(owner, name, common_labels(owner, track)),
        # spec.metadata is what Kubernetes copies into each claim it makes from the template: the labels
        # let the planner tell this workload's own claims from other workloads' (they held its devices twice)
        "spec": {"metadata": {"labels": common_labels(owner, track)}, **rendering.claim},
    }


STORAGE_SECRET_DIRECTORY = "/var/run/secrets/sluice.dev/storage"
"""Where the fetch init container finds the keys of ``spec.storage.secretRef`` as files (a GCS key file for
``GOOGLE_APPLICATION_CREDENTIALS``); they are its environment variables as well."""


def _fetch(
    model: api.ModelSource, index: int, storage: api.Storage, settings: Settings, *, image: str | None = None,
) -> tuple[Obj | None, Obj | None, Obj | None]:
    """(init container, volume, runtime volume mount) that put ``model``'s files in the repository.

    ``pvc://``: no init container, the claim's volume and its read-only mount at the version directory.
    Otherwise ``sluice pull`` in ``image`` (default: the CPU runtime image; a pod passes its own runtime
    image so a node pulls one image) and, when ``storage`` names a Secret, that Secret's volume (mounted
    in the init container only; no runtime mount)."""
    destination = f"{MODEL_REPOSITORY}/{model.name}/{model.version}"
    if model.storage_uri.startswith("pvc://"):
        claim, _, sub_path = model.storage_uri[len("pvc://"):].partition("/")
        volume_name = f"pvc-{index}"
        volume = {"name": volume_name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        mount: Obj = {"name": volume_name, "mountPath": destination, "readOnly": True}
        if sub_path:
            mount["subPath"] = sub_path
        return None, volume, mount
    args = ["pull", model.storage_uri, destination]
    if model.checksum:
        args += ["--sha256", model.checksum.removeprefix("sha256:")]
    if model.size_limit:
        args += ["--size-limit", model.size_limit]
    requests = {"cpu": settings.default_resources.fetch_cpu, "memory": settings.default_resources.fetch_memory}
    if model.size_limit:
        # This model's room; the runtime container requests the sum over the pod's models.
        requests["ephemeral-storage"] = model.size_limit
    mounts: list[Obj] = [{"name": "model-repository", "mountPath": MODEL_REPOSITORY},
                         {"name": "tmp", "mountPath": "/tmp"}]
    init: Obj = {
        "name": dns_label(f"fetch-{index}-{model.name}"),
        "image": image or settings.runtime_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["sluice"],
        "args": args,
        "resources": {"requests": requests, "limits": {"memory": settings.default_resources.fetch_memory}},
        "securityContext": _restricted_security_context(),
        "volumeMounts": mounts,
    }
    secret_volume: Obj | None = None
    if storage.secret_name:
        init["envFrom"] = [{"secretRef": {"name": storage.secret_name}}]
        secret_volume = {"name": f"storage-{index}",
                         "secret": {"secretName": storage.secret_name, "defaultMode": 0o440}}
        mounts.append({"name": f"storage-{index}", "mountPath": STORAGE_SECRET_DIRECTORY, "readOnly": True})
    return init, secret_volume, None


def _quantity_sum(quantities: Sequence[str]) -> str:
    """``quantities`` added up, as a quantity: one is returned as written, a sum in the largest unit that
    divides it."""
    if len(quantities) == 1:
        return quantities[0]
    total = round(sum(api.quantity_to_float(q) for q in quantities))
    for suffix, factor in (("Ei", 2**60), ("Pi", 2**50), ("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20),
                           ("Ki", 2**10), ("E", 10**18), ("P", 10**15), ("T", 10**12), ("G", 10**9),
                           ("M", 10**6), ("k", 10**3)):
        if total >= factor and total % factor == 0:
            return f"{total // factor}{suffix}"
    return str(total)


def resource_sum(values: Sequence[str], unit: str) -> str:
    """CPU (``unit`` ``cpu``) or memory quantities added up for one container: one is returned as
    written; a sum of CPUs in whole cores or millicores, of memory in GiB or MiB, rounded up."""
    if len(values) == 1:
        return values[0]
    total = sum(api.quantity_to_float(v) for v in values)
    if unit == "cpu":
        millis = math.ceil(round(total * 1000, 6))
        return str(millis // 1000) if millis % 1000 == 0 else f"{millis}m"
    mib = math.ceil(round(total / 2**20, 6))
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"


def model_storage(models: Sequence[ServedModel]) -> tuple[str | None, str | None]:
    """(ephemeral-storage request, emptyDir sizeLimit) of a pod's model repository: the request adds up the
    ``sizeLimit`` of every fetched model that has one; the emptyDir is bounded only when all of them have
    one (a bound that leaves out a model of unknown size would evict the pod)."""
    fetched = [m.source for m in models if m.source.storage_uri and not m.source.storage_uri.startswith("pvc://")]
    limits = [m.size_limit for m in fetched if m.size_limit]
    if not limits:
        return None, None
    total = _quantity_sum(limits)
    return total, total if len(limits) == len(fetched) else None


def deployment(
    owner: Owner, *, name: str, models: Sequence[ServedModel], config_map_name: str, files: Mapping[str, str],
    resources: api.Resources, rendering: GpuRendering, replicas: int | None, storage: api.Storage,
    shutdown: api.Shutdown, server: api.Server, settings: Settings, track: str = STABLE, split: bool = False,
    candidate: str = "", pod_labels: Mapping[str, str] | None = None,
) -> Obj:
    """The runtime Deployment; ``replicas`` ``None`` leaves the count to its owner (the HPA).

    ``split`` mounts the ``<owner>-split`` ConfigMap (optional: absent means no split) and points
    ``--split-file`` at it, so stable pods forward a canary's share without a mesh; it is always on for
    an InferenceModel's stable pods, so starting a canary never rolls them. ``candidate`` is recorded
    in an annotation on the Deployment itself to tell which candidate it runs. ``pod_labels`` go on
    the pods only (never into the selector, which cannot change): a pool's per-member labels.
    """
    labels = common_labels(owner, track)
    init_containers: list[Obj] = []
    storage_request, repository_limit = model_storage(models)
    volumes: list[Obj] = [
        {"name": "model-repository", "emptyDir": {"sizeLimit": repository_limit} if repository_limit else {}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "model-config", "configMap": {"name": config_map_name}},
    ]
    mounts: list[Obj] = [
        # Not readOnly: the config files and pvc:// versions are mounted inside it, and the container
        # runtime must create those mount points in it (EROFS under a read-only parent mount).
        {"name": "model-repository", "mountPath": MODEL_REPOSITORY},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    for index, served in enumerate(models):
        if served.source.storage_uri:
            init, volume, mount = _fetch(served.source, index, served.storage or storage, settings,
                                         image=settings.runtime_gpu_image if rendering.gpu else settings.runtime_image)
        else:
            # A model with nothing to fetch (an ensemble) still needs its version directory.
            init, volume = None, {"name": "empty-version", "emptyDir": {}}
            mount = {"name": "empty-version", "readOnly": True,
                     "mountPath": f"{MODEL_REPOSITORY}/{served.source.name}/{served.source.version}"}
        if init is not None:
            init_containers.append(init)
        if volume is not None:
            volumes.append(volume)
        if mount is not None:
            mounts.append(mount)
        mounts.append({
            "name": "model-config", "readOnly": True,
            "mountPath": f"{MODEL_REPOSITORY}/{served.source.name}/{served.config_name}",
            "subPath": _config_key(served),
        })
    args: list[str] = []
    if split:
        volumes.append({"name": "split", "configMap": {"name": f"{owner.name}-split", "optional": True}})
        mounts.append({"name": "split", "mountPath": SPLIT_DIRECTORY, "readOnly": True})
        args = ["--split-file", f"{SPLIT_DIRECTORY}/{SPLIT_FILE}"]
    workers = server.protocol_workers if server.protocol_workers is not None else settings.default_protocol_workers
    if workers is not None:
        args += ["--protocol-workers", str(workers)]
    gpu_limits, affinity = rendering.limits, rendering.affinity
    cpu = resources.cpu or settings.default_resources.cpu
    memory = resources.memory or settings.default_resources.memory
    http, grpc, metrics = settings.http_port, settings.grpc_port, settings.metrics_port
    container: Obj = {
        "name": "runtime",
        "image": settings.runtime_gpu_image if rendering.gpu else settings.runtime_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["sluice"],
        # The runtime listens on loopback unless told otherwise; probes and the Service reach the pod IP.
        "args": ["serve", "--model-repository", MODEL_REPOSITORY, "--host", "0.0.0.0", "--http-port", str(http),
                 "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                 # Not ready until every model in the repository is: a pod with a failed load gets no traffic.
                 "--strict-readiness", "true",
                 # The preStop hook below already drains; a second drain after SIGTERM would only add time.
                 "--drain-period-s", "0", "--shutdown-grace-s", str(shutdown.grace_seconds), *args],
        "ports": [
            {"name": "http", "containerPort": http, "protocol": "TCP"},
            {"name": "grpc", "containerPort": grpc, "protocol": "TCP"},
            {"name": "metrics", "containerPort": metrics, "protocol": "TCP"},
        ],
        "readinessProbe": {"httpGet": {"path": "/v2/health/ready", "port": "http"},
                           "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/v2/health/live", "port": "http"},
                          "periodSeconds": 10, "failureThreshold": 3},
        # Loading a large model can take minutes; liveness only starts once the server is up.
        "startupProbe": {"httpGet": {"path": "/v2/health/live", "port": "http"},
                         "periodSeconds": 5, "failureThreshold": 120},
        "resources": {
            "requests": {"cpu": cpu, "memory": memory, **gpu_limits,
                         **({"ephemeral-storage": storage_request} if storage_request else {})},
            "limits": {"cpu": cpu, "memory": memory, **gpu_limits},
        },
        "securityContext": _restricted_security_context(),
        "volumeMounts": mounts,
    }
    if shutdown.drain_seconds:
        # The kubelet runs preStop before SIGTERM, and a terminating pod leaves the Endpoints while it
        # runs: the runtime keeps serving until kube-proxy and load balancers have caught up.
        container["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", str(shutdown.drain_seconds)]}}}
    pod_spec: Obj = {
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": RUNTIME_UID, "runAsGroup": RUNTIME_UID, "fsGroup": RUNTIME_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        # Covers the preStop sleep and the runtime's grace, with a margin for finalizing and exit.
        "terminationGracePeriodSeconds": shutdown.drain_seconds + shutdown.grace_seconds + 5,
        "enableServiceLinks": False,
        "containers": [container],
        "volumes": volumes,
    }
    if storage.service_account_name:
        pod_spec["serviceAccountName"] = storage.service_account_name
    else:
        pod_spec["automountServiceAccountToken"] = False
    if init_containers:
        pod_spec["initContainers"] = init_containers
    if rendering.claim is not None:
        container["resources"]["claims"] = [{"name": DRA_CLAIM}]
        pod_spec["resourceClaims"] = [{"name": DRA_CLAIM, "resourceClaimTemplateName": f"{name}-gpu"}]
    if rendering.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in rendering.tolerations]
    if affinity:
        pod_spec["affinity"] = affinity
    spec: Obj = {
        "revisionHistoryLimit": 3,
        "selector": {"matchLabels": selector_labels(owner, track)},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "template": {
            "metadata": {
                "labels": {**labels, **dict(sorted((pod_labels or {}).items()))},
                "annotations": {
                    CONFIG_HASH_ANNOTATION: config_hash(files),
                    "prometheus.io/scrape": "true",
                    "prometheus.io/port": str(metrics),
                },
            },
            "spec": pod_spec,
        },
    }
    if replicas is not None:
        spec["replicas"] = replicas
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _meta(owner, name, labels, {CANDIDATE_ANNOTATION: candidate} if candidate else None),
        "spec": spec,
    }


def service(
    owner: Owner, name: str, settings: Settings, track: str = STABLE, selector: Mapping[str, str] | None = None,
) -> Obj:
    """The Service of ``owner``'s pods (of ``track``), or of the pods ``selector`` names (a pool member's)."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _meta(owner, name, common_labels(owner, track)),
        "spec": {
            "type": "ClusterIP",
            "selector": dict(selector) if selector is not None else selector_labels(owner, track),
            "ports": [
                {"name": "http", "port": settings.http_port, "targetPort": "http", "protocol": "TCP",
                 "appProtocol": "http"},
                {"name": "grpc", "port": settings.grpc_port, "targetPort": "grpc", "protocol": "TCP",
                 "appProtocol": "grpc"},
                {"name": "metrics", "port": settings.metrics_port, "targetPort": "metrics", "protocol": "TCP"},
            ],
        },
    }


def pod_disruption_budget(owner: Owner, name: str, track: str = STABLE) -> Obj:
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": _meta(owner, name, common_labels(owner, track)),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(owner, track)}},
    }


# ---------------------------------------------------------------- autoscaling

HPA_METRICS = {
    "queueDepth": "sluice_queue_depth",
    "inflight": "sluice_inflight_requests",
    "latency": "sluice_queue_duration_seconds_p90",
}
"""``spec.scaling.metric`` -> the Pods custom metric the HPA asks for; the chart's prometheus-adapter
rules serve each under this name (``helm/sluice/templates/autoscaling.yaml``)."""
SCALE_UP_POLICIES = ({"type": "Percent", "value": 100, "periodSeconds": 15},
                     {"type": "Pods", "value": 4, "periodSeconds": 15})
"""Kubernetes' own default: double, or add 4 pods, every 15 s, whichever is more."""
SCALE_DOWN_POLICIES = ({"type": "Percent", "value": 10, "periodSeconds": 60},
                       {"type": "Pods", "value": 1, "periodSeconds": 60})
"""10 % or 1 pod a minute, whichever is more (Kubernetes' default removes everything at once):
bench/hpa_sim.py, docs/operator.md ("Autoscaling")."""
KEDA_POLLING_SECONDS = 15
"""How often KEDA queries Prometheus: the HPA controller's own sync period."""
KEDA_FAILURE_THRESHOLD = 3
"""Failed queries in a row before KEDA runs ``fallbackReplicas``."""
PROMETHEUS_RATE_WINDOW = "1m"
"""Range of the rate() behind the latency metric: four samples at a 15 s scrape interval."""
PROMETHEUS_LABELS = {"namespace": "namespace", "pod": "pod", "instance": "app_kubernetes_io_instance"}
"""Series labels the KEDA queries filter and group on: what the chart's PodMonitor gives (prometheus-operator
adds namespace and pod; podTargetLabels turns the pod label app.kubernetes.io/instance into the last)."""
KEDA_HPA_VALIDATION_ANNOTATION = "validations.keda.sh/hpa-ownership"


def scaling_behavior(scaling: api.Scaling) -> Obj:
    """``spec.behavior`` of the HPA (also KEDA's): fast up, slowly down, windows from the spec."""
    return {
        "scaleUp": {
            "stabilizationWindowSeconds": scaling.scale_up_stabilization_seconds,
            "selectPolicy": "Max",
            "policies": [dict(p) for p in SCALE_UP_POLICIES],
        },
        "scaleDown": {
            "stabilizationWindowSeconds": scaling.scale_down_stabilization_seconds,
            "selectPolicy": "Max",
            "policies": [dict(p) for p in SCALE_DOWN_POLICIES],
        },
    }


def _average_value(scaling: api.Scaling) -> str:
    # The latency metric is served in seconds; a quantity in milli-units is the target in milliseconds.
    return f"{scaling.target}m" if scaling.metric == "latency" else str(scaling.target)


def horizontal_pod_autoscaler(owner: Owner, name: str, scaling: api.Scaling) -> Obj:
    """The HPA of Deployment ``name``: the chosen Pods metric at its per-pod target, with :func:`scaling_behavior`."""
    # KEDA's admission webhook refuses a ScaledObject for a Deployment another HPA scales. Switching a model
    # to engine keda applies the ScaledObject before this HPA is deleted, so this HPA opts out of that check.
    meta = _meta(owner, name, common_labels(owner), {KEDA_HPA_VALIDATION_ANNOTATION: "false"})
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": meta,
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": scaling.min_replicas,
            "maxReplicas": scaling.max_replicas,
            "metrics": [{
                "type": "Pods",
                "pods": {
                    "metric": {"name": HPA_METRICS[scaling.metric]},
                    "target": {"type": "AverageValue", "averageValue": _average_value(scaling)},
                },
            }],
            "behavior": scaling_behavior(scaling),
        },
    }


def prometheus_query(scaling: api.Scaling, namespace: str, name: str) -> str:
    """PromQL for KEDA: the sum over the pods of Deployment ``name`` of each pod's value of the metric.

    KEDA divides it by the per-pod threshold (``AverageValue``), which is the HPA's own arithmetic for a
    Pods metric. Each pod's value is what the chart's prometheus-adapter rule serves for it: queued
    requests summed over the models it serves; in-flight requests of its busiest model (an Ensemble's
    pod counts a request once, not once per step); its p90 queue wait in milliseconds, 0 for an idle pod
    (histogram_quantile of no requests is NaN). An empty answer, e.g. no series because nothing scrapes
    the pods, is an error for KEDA (``ignoreNullValues: false``), so ``fallbackReplicas`` applies.
    """
    labels = PROMETHEUS_LABELS
    selector = f'{labels["namespace"]}="{namespace}",{labels["instance"]}="{name}"'
    pod = labels["pod"]
    if scaling.metric == "queueDepth":
        return f"sum(sluice_queue_depth{{{selector}}})"
    if scaling.metric == "inflight":
        return f"sum(max by ({pod}) (sluice_inflight_requests{{{selector}}}))"
    window = PROMETHEUS_RATE_WINDOW
    p90 = (f"1000 * histogram_quantile(0.9, sum by ({pod}, le) "
           f"(rate(sluice_queue_duration_seconds_bucket{{{selector}}}[{window}])))")
    return (f"sum({p90} >= 0) or "
            f"(0 * sum(rate(sluice_queue_duration_seconds_count{{{selector}}}[{window}])))")


def scaled_object(owner: Owner, name: str, scaling: api.Scaling, settings: Settings) -> Obj:
    """The KEDA ScaledObject of Deployment ``name``: a prometheus trigger on :func:`prometheus_query`."""
    if not settings.prometheus_url:
        raise UnsatisfiableError([
            "spec.scaling.engine: keda scales on a Prometheus query, and the operator does not know where "
            "Prometheus is: set SLUICE_PROMETHEUS_URL on the operator (Helm: --set "
            "prometheus.url=http://<prometheus>.<namespace>.svc:9090) or use engine hpa"
        ])
    return {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
        "metadata": _meta(owner, name, common_labels(owner)),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicaCount": scaling.min_replicas,
            "maxReplicaCount": scaling.max_replicas,
            "pollingInterval": KEDA_POLLING_SECONDS,
            # A Prometheus outage must not drop the model to minReplicas: KEDA runs these replicas instead.
            "fallback": {
                "failureThreshold": KEDA_FAILURE_THRESHOLD,
                "replicas": scaling.fallback_replicas or scaling.max_replicas,
            },
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": scaling_behavior(scaling)}},
            "triggers": [{
                "type": "prometheus",
                "metricType": "AverageValue",  # KEDA's fallback works only with AverageValue
                "metadata": {
                    "serverAddress": settings.prometheus_url,
                    "query": prometheus_query(scaling, owner.namespace, name),
                    "threshold": str(scaling.target),
                    "ignoreNullValues": "false",
                },
            }],
        },
    }


HPA_KIND = ("autoscaling/v2", "HorizontalPodAutoscaler")
SCALED_OBJECT_KIND = ("keda.sh/v1alpha1", "ScaledObject")


def autoscaler(
    owner: Owner, name: str, scaling: api.Scaling, settings: Settings,
) -> tuple[list[Obj], list[tuple[str, str, str]]]:
    """(objects, absent) that autoscale Deployment ``name``: the engine's object, and the other engine's
    (and both, when not autoscaled) named as absent. KEDA owns the HPA it makes (``keda-hpa-<name>``)."""
    objects: list[Obj] = []
    absent = [(*HPA_KIND, name), (*SCALED_OBJECT_KIND, name)]
    if scaling.autoscaled:
        if scaling.engine == "keda":
            objects.append(scaled_object(owner, name, scaling, settings))
            absent.remove((*SCALED_OBJECT_KIND, name))
        else:
            objects.append(horizontal_pod_autoscaler(owner, name, scaling))
            absent.remove((*HPA_KIND, name))
    return objects, absent


def owns_replicas(deployment: Mapping[str, Any], manager: str = FIELD_MANAGER) -> bool:
    """Whether ``manager``'s server-side apply still owns ``spec.replicas`` (per ``managedFields``)."""
    for entry in deployment.get("metadata", {}).get("managedFields") or []:
        if entry.get("manager") == manager and entry.get("operation") == "Apply":
            fields = entry.get("fieldsV1") or {}
            if "f:replicas" in (fields.get("f:spec") or {}):
                return True
    return False


def deployment_replicas(scaling: api.Scaling, live: Mapping[str, Any] | None) -> int | None:
    """The replica count to apply, or ``None`` to leave ``spec.replicas`` to the HPA (KEDA's included).

    Fixed scaling applies its count. Autoscaled, the count is the HPA's, but dropping the field from
    the apply while this operator is still its only owner makes the API server reset it to the
    default, 1 replica, before the HPA acts. So while the live Deployment shows the operator's apply
    owning ``spec.replicas``, keep applying the live count clamped to min..max (what the HPA would
    settle on first); the HPA's first scale is an update that takes the field, and from then on the
    operator leaves it out. A new autoscaled Deployment gets no count (the default, then the HPA).
    """
    if not scaling.autoscaled:
        return scaling.min_replicas
    if live is None or not owns_replicas(live):
        return None
    current = live.get("spec", {}).get("replicas", 1)
    current = current if isinstance(current, int) and not isinstance(current, bool) else 1
    return min(max(current, scaling.min_replicas), scaling.max_replicas)


def _config_key(served: ServedModel) -> str:
    return f"{served.source.name}.{served.config_name}"


def _track(
    owner: Owner, models: Sequence[ServedModel], *, track: str, resources: api.Resources, gpus: Sequence[api.Gpu],
    scaling: api.Scaling, storage: api.Storage, shutdown: api.Shutdown, server: api.Server, settings: Settings,
    live: Mapping[str, Any] | None, split: bool = False, candidate: str = "", shape: placement.Shape | None = None,
    pod_labels: Mapping[str, str] | None = None,
) -> tuple[list[Obj], list[tuple[str, str, str]]]:
    """One track's objects (ConfigMap, Deployment, Service, PDB/HPA, DRA claim template) and the optional
    ones that must go."""
    name = instance(owner, track)
    cm_name = f"{name}-config"
    files = {_config_key(served): served.config_text for served in models}
    rendering = gpu_rendering(gpus, shape, dra=settings.gpu_allocation == "dra")
    objects: list[Obj] = [config_map(owner, cm_name, files, track)]
    absent: list[tuple[str, str, str]] = []
    if rendering.claim is not None:
        objects.append(claim_template(owner, f"{name}-gpu", rendering, track))  # before the pods that use it
    elif settings.gpu_allocation == "dra":
        absent.append((DRA_API_VERSION, "ResourceClaimTemplate", f"{name}-gpu"))
    objects += [
        deployment(owner, name=name, models=models, config_map_name=cm_name, files=files, resources=resources,
                   rendering=rendering, replicas=deployment_replicas(scaling, live), storage=storage,
                   shutdown=shutdown, server=server, settings=settings, track=track, split=split,
                   candidate=candidate, pod_labels=pod_labels),
        service(owner, name, settings, track),
    ]
    if scaling.max_replicas >= 2:
        objects.append(pod_disruption_budget(owner, name, track))
    else:
        absent.append(("policy/v1", "PodDisruptionBudget", name))
    scaler, not_wanted = autoscaler(owner, name, scaling, settings)
    objects += scaler
    absent += not_wanted
    return objects, absent


def _track_names(owner: Owner, track: str) -> list[tuple[str, str, str]]:
    """Every object a track may have, to remove when the track goes."""
    name = instance(owner, track)
    return [
        ("apps/v1", "Deployment", name), ("v1", "Service", name), ("v1", "ConfigMap", f"{name}-config"),
        ("policy/v1", "PodDisruptionBudget", name), ("autoscaling/v2", "HorizontalPodAutoscaler", name),
        ("keda.sh/v1alpha1", "ScaledObject", name), (DRA_API_VERSION, "ResourceClaimTemplate", f"{name}-gpu"),
    ]


def _workload(
    owner: Owner, models: Sequence[ServedModel], *, model_name: str, resources: api.Resources,
    gpus: Sequence[api.Gpu], scaling: api.Scaling, storage: api.Storage, shutdown: api.Shutdown,
    server: api.Server, settings: Settings, traffic: tuple[Obj, ...], notes: tuple[str, ...] = (),
    placement: str | None = None,
    live: Mapping[str, Any] | None = None, split: bool = False, candidate: str = "",
    extra: Sequence[Obj] = (), extra_absent: Sequence[tuple[str, str, str]] = (), shape: Shape | None = None,
    pod_labels: Mapping[str, str] | None = None,
) -> Desired:
    name = owner.name
    objects, absent = _track(owner, models, track=STABLE, resources=resources, gpus=gpus, scaling=scaling,
                             storage=storage, shutdown=shutdown, server=server, settings=settings, live=live,
                             split=split, candidate=candidate, shape=shape, pod_labels=pod_labels)
    host = f"{name}.{owner.namespace}.svc.{settings.cluster_domain}"
    http_url = f"http://{host}:{settings.http_port}"
    return Desired(
        objects=(*objects, *extra), absent=(*absent, *extra_absent),
        selector=",".join(f"{k}={v}" for k, v in sorted(selector_labels(owner).items())),
        http_url=http_url, grpc_target=f"{host}:{settings.grpc_port}",
        model_url=f"{http_url}/v2/models/{model_name}", traffic=traffic, notes=notes, placement=placement,
    )


# ---------------------------------------------------------------- canary rollouts

ROUTE_KINDS = {
    "gateway-api": (("gateway.networking.k8s.io/v1", "HTTPRoute"), ("gateway.networking.k8s.io/v1", "GRPCRoute")),
    "istio": (("networking.istio.io/v1beta1", "VirtualService"),),
    "none": (("v1", "ConfigMap"),),
}


@dataclasses.dataclass(frozen=True)
class Rollout:
    """What the canary decision (``canary.step``) wants rendered; the reconciler builds it from the
    decided status, so the objects follow the status and a restarted operator renders the same."""

    candidate: str
    """The candidate's hash (``canary.plan_of``)."""
    canary: bool
    """The candidate's own Deployment, Service, ConfigMap, PDB and autoscaler exist."""
    promoted: bool
    """The stable Deployment runs the candidate (promotion under way or done)."""
    weight: int
    """Percent of the model's requests the canary gets."""
    router: str
    """One of ``ROUTERS``: who applies the weight."""
    routed: bool
    """The router objects exist (the weight is applied). Off once the rollout is over."""


candidate_model = api.candidate_model


def routes(owner: Owner, model_name: str, router: str, weight: int, settings: Settings) -> list[Obj]:
    """The objects that send ``weight`` percent of the model's requests to the canary Service.

    ``gateway-api``: an HTTPRoute (HTTP port) and a GRPCRoute (gRPC port) with backendRef weights, attached
    to the model's own Service (GAMMA, a mesh that implements Gateway API) or, with ``Settings.gateway``,
    to that Gateway (HTTP only, matched by the model's path: a GRPCRoute cannot tell models apart).
    ``istio``: a VirtualService with one weighted route per port. ``none``: the ``<name>-split`` ConfigMap
    the stable pods read (``--split-file``) and forward the canary's share by themselves.
    """
    stable, canary = instance(owner, STABLE), instance(owner, CANARY)
    labels = common_labels(owner)
    domain = f"{owner.namespace}.svc.{settings.cluster_domain}"
    if router == "none":
        split = {"models": {model_name: {"target": f"{canary}.{domain}:{settings.grpc_port}", "percent": weight}}}
        return [{
            "apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(owner, f"{owner.name}-split", labels),
            "data": {SPLIT_FILE: json.dumps(split, sort_keys=True) + "\n"},
        }]
    if router == "istio":
        def http_route(port: int) -> Obj:
            return {
                "name": f"port-{port}",
                "match": [{"port": port}],
                "route": [
                    {"destination": {"host": f"{stable}.{domain}", "port": {"number": port}}, "weight": 100 - weight},
                    {"destination": {"host": f"{canary}.{domain}", "port": {"number": port}}, "weight": weight},
                ],
            }
        return [{
            "apiVersion": "networking.istio.io/v1beta1", "kind": "VirtualService",
            "metadata": _meta(owner, owner.name, labels),
            "spec": {"hosts": [f"{stable}.{domain}"],
                     "http": [http_route(settings.http_port), http_route(settings.grpc_port)]},
        }]
    if router != "gateway-api":
        raise ValueError(f"unknown router {router!r}; one of {', '.join(ROUTERS)}")

    def backends(port: int) -> list[Obj]:
        return [{"group": "", "kind": "Service", "name": stable, "port": port, "weight": 100 - weight},
                {"group": "", "kind": "Service", "name": canary, "port": port, "weight": weight}]

    def parent(port: int) -> Obj:
        if settings.gateway:
            namespace, _, gateway = settings.gateway.rpartition("/")
            ref: Obj = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gateway}
            if namespace:
                ref["namespace"] = namespace
            return ref
        return {"group": "", "kind": "Service", "name": stable, "port": port}

    http_rule: Obj = {"backendRefs": backends(settings.http_port)}
    if settings.gateway:
        http_rule["matches"] = [{"path": {"type": "PathPrefix", "value": f"/v2/models/{model_name}"}}]
    objects = [{
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
        "metadata": _meta(owner, owner.name, labels),
        "spec": {"parentRefs": [parent(settings.http_port)], "rules": [http_rule]},
    }]
    if not settings.gateway:
        objects.append({
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "GRPCRoute",
            "metadata": _meta(owner, owner.name, labels),
            "spec": {"parentRefs": [parent(settings.grpc_port)],
                     "rules": [{"backendRefs": backends(settings.grpc_port)}]},
        })
    return objects


def _route_names(owner: Owner) -> list[tuple[str, str, str]]:
    return [(api_version, kind, f"{owner.name}-split" if kind == "ConfigMap" else owner.name)
            for kinds in ROUTE_KINDS.values() for api_version, kind in kinds]


def inference_model(
    owner: Owner, spec: api.InferenceModelSpec, settings: Settings, *, live: Mapping[str, Any] | None = None,
    live_canary: Mapping[str, Any] | None = None, rollout: Rollout | None = None,
    shape: placement.Shape | None = None,
) -> Desired:
    """Children of an InferenceModel: ConfigMap, Deployment, Service, and PDB/HPA/ScaledObject when scaling
    asks; during a canary rollout also the candidate's own set (``<name>-canary``) and the router's objects.

    ``live``/``live_canary`` are the Deployments as the API server has them now (``None`` if absent); they
    only decide the replica counts during an HPA handover (:func:`deployment_replicas`). ``rollout`` is
    what the canary decision wants; ``None`` when the model never had a canary (nothing to clean up).
    ``shape`` is where the GPU planner put the model (``placement.plan``); both tracks render it.
    """
    # A runtime that cannot load the model would crash-loop: render nothing instead.
    if problems := unserved_formats([("spec.model", spec.model)]):
        raise NotServedError(problems)
    if spec.canary is not None and (problems := unserved_formats([("spec.canary", candidate_model(spec))])):
        raise NotServedError(problems)
    gpus = [spec.resources.gpu] if spec.resources.gpu else []
    stable_source = spec.model
    candidate = ""
    stable_runtime = spec.runtime
    candidate_runtime = spec.canary.runtime or spec.runtime if spec.canary is not None else spec.runtime
    if rollout is not None and rollout.promoted and spec.canary is not None:
        stable_source, stable_runtime, candidate = candidate_model(spec), candidate_runtime, rollout.candidate
    served = served_model(stable_source, stable_runtime, gpu=bool(gpus))
    traffic: tuple[Obj, ...] = ({"revision": STABLE, "version": stable_source.version, "percent": 100},)
    extra: list[Obj] = []
    extra_absent: list[tuple[str, str, str]] = []
    if rollout is not None:
        # Routes first: a weight going to 0 is applied before the canary's Deployment changes or goes.
        if rollout.routed:
            extra += routes(owner, spec.model.name, rollout.router, rollout.weight, settings)
            kept = {(o["kind"], o["metadata"]["name"]) for o in extra}
            extra_absent += [a for a in _route_names(owner) if (a[1], a[2]) not in kept]
        else:
            extra_absent += _route_names(owner)
        if rollout.canary and spec.canary is not None:
            source = candidate_model(spec)
            objects, absent = _track(
                owner, [served_model(source, candidate_runtime, gpu=bool(gpus))], track=CANARY,
                resources=spec.resources, gpus=gpus, scaling=spec.scaling, storage=spec.storage,
                shutdown=spec.shutdown, server=spec.server, settings=settings, live=live_canary,
                candidate=rollout.candidate, shape=shape)
            extra += objects
            extra_absent += absent
            traffic = (
                {"revision": STABLE, "version": stable_source.version, "percent": 100 - rollout.weight},
                {"revision": CANARY, "version": source.version, "percent": rollout.weight},
            )
        else:
            extra_absent += _track_names(owner, CANARY)
    return _workload(
        owner, [served], model_name=spec.model.name, resources=spec.resources, gpus=gpus,
        scaling=spec.scaling, storage=spec.storage, shutdown=spec.shutdown, server=spec.server, settings=settings,
        traffic=traffic, live=live, split=True, candidate=candidate, extra=extra, extra_absent=extra_absent,
        shape=shape,
    )


def _fits_one_pod(gpus: Sequence[api.Gpu], settings: Settings) -> bool:
    if any(g.mig_profile is not None or g.memory is not None for g in gpus):
        return False
    return sum(g.count or 0 for g in gpus) <= settings.max_colocated_gpus


def ensemble(
    owner: Owner, spec: api.EnsembleSpec, referenced: Mapping[str, api.InferenceModelSpec], settings: Settings,
    *, live: Mapping[str, Any] | None = None,
) -> Desired:
    """Children of an Ensemble: one runtime Deployment serving the ensemble config.

    ``referenced`` maps each ``modelRef`` name to that InferenceModel's spec (the reconciler fetched it).
    Steps are colocated in the ensemble's pods when they fit, otherwise the ensemble calls each
    referenced InferenceModel's Service over gRPC (inline steps can only be colocated).
    """
    problems = [
        f"spec.steps[{i}].modelRef: InferenceModel {step.model_ref!r} does not exist in namespace "
        f"{owner.namespace!r}; create it or fix the name"
        for i, step in enumerate(spec.steps) if step.model_ref is not None and step.model_ref not in referenced
    ]
    if problems:
        raise UnsatisfiableError(problems)
    if problems := unserved_formats(
        [(f"spec.steps[{i}].model", step.model) for i, step in enumerate(spec.steps) if step.model is not None]
        + [(f"InferenceModel {step.model_ref!r} spec.model", referenced[step.model_ref].model)
           for step in spec.steps if step.model_ref is not None]
    ):
        raise NotServedError(problems)
    step_models: dict[str, str] = {}
    model_gpus: dict[str, api.Gpu | None] = {}  # served model -> the first GPU any of its steps states
    sources: dict[str, tuple[int, object]] = {}  # model name -> (first step, what it serves)
    for index, step in enumerate(spec.steps):
        if step.model_ref is not None:
            ref = referenced[step.model_ref]
            step_models[step.name] = ref.model.name
            gpu = step.resources.gpu or ref.resources.gpu
            served: object = ("modelRef", step.model_ref)
        else:
            assert step.model is not None
            step_models[step.name] = step.model.name
            gpu = step.resources.gpu
            served = step.model
        model_name = step_models[step.name]
        if model_gpus.get(model_name) is None:  # a model two steps call is served (and given GPUs) once
            model_gpus[model_name] = gpu
        where = f"spec.steps[{index}]" + (f" (InferenceModel {step.model_ref!r})" if step.model_ref else ".model")
        if model_name == owner.name:
            problems.append(f"{where}: serves a model named {model_name!r}, the ensemble's own name; the runtime "
                            "serves both under one name: rename the model (model.name) or the Ensemble")
        elif model_name in sources and sources[model_name][1] != served:
            problems.append(f"{where}: serves a model named {model_name!r} like spec.steps[{sources[model_name][0]}] "
                            "but from another source; one runtime serves one model per name: rename one")
        sources.setdefault(model_name, (index, served))
    if problems:
        raise UnsatisfiableError(problems)
    step_gpus = [gpu for gpu in model_gpus.values() if gpu is not None]
    fits = _fits_one_pod(step_gpus, settings)
    inline = [i for i, step in enumerate(spec.steps) if step.model is not None]
    if spec.placement == "Remote" and inline:
        raise UnsatisfiableError([
            f"spec.steps[{i}]: an inline model cannot be called remotely; use modelRef or placement Auto"
            for i in inline
        ])
    colocate = spec.placement == "Colocated" or (spec.placement == "Auto" and fits)
    problems = []
    for i, step in enumerate(spec.steps):
        if step.model_ref is None:
            continue
        ref = referenced[step.model_ref]
        if not colocate and ref.mode == api.SIDECAR_MODE:
            problems.append(
                f"spec.steps[{i}].modelRef: InferenceModel {step.model_ref!r} runs in Sidecar mode (no Service to "
                "call), and the steps cannot share one pod; use placement Colocated with fewer GPUs, or a "
                "model in Deployment mode"
            )
    # Colocated steps are fetched in the ensemble's pods, which run as one service account: the Ensemble's
    # when it names one, else the one its referenced models fetch with (workload identity), which must agree.
    storage = spec.storage
    if colocate and not storage.service_account_name:
        accounts = {
            account for s in spec.steps if s.model_ref
            if (account := referenced[s.model_ref].storage.service_account_name)
        }
        if len(accounts) > 1:
            problems.append(
                f"the colocated steps' InferenceModels fetch with service accounts {', '.join(sorted(accounts))}, "
                "but the ensemble's pods run as one; name one in the Ensemble's spec.storage.serviceAccountName, "
                "or use placement Remote"
            )
        elif accounts:
            storage = dataclasses.replace(storage, service_account_name=accounts.pop())
    if problems:
        raise UnsatisfiableError(problems)
    if not colocate and inline:
        raise UnsatisfiableError([
            f"the steps need more than {settings.max_colocated_gpus} whole GPU(s) or a MIG/GPU-memory "
            "class, so they cannot share one pod, and inline steps "
            f"({', '.join(spec.steps[i].name for i in inline)}) have no Service to call; "
            "move them to InferenceModels and use modelRef"
        ])
    ensemble_name = owner.name
    models: list[ServedModel] = []
    remote: dict[str, str] = {}
    seen: set[str] = set()
    gpus: list[api.Gpu] = []
    for step in spec.steps:
        model_name = step_models[step.name]
        if model_name in seen:
            continue
        seen.add(model_name)
        if step.model_ref is not None:
            ref = referenced[step.model_ref]
            if colocate:
                gpu = model_gpus[model_name]
                # fetched with the model's own credentials where it has some (as its own pods fetch it), else
                # with the Ensemble's
                own = ref.storage if (ref.storage.secret_name or ref.storage.service_account_name) else None
                models.append(served_model(ref.model, ref.runtime, gpu=gpu is not None, storage=own))
            else:
                host = f"{step.model_ref}.{owner.namespace}.svc.{settings.cluster_domain}"
                remote[model_name] = f"{host}:{settings.grpc_port}"
        else:
            assert step.model is not None
            models.append(served_model(step.model, api.RuntimeConfig(), gpu=model_gpus[model_name] is not None))
    resources = spec.resources
    if colocate:
        gpus = step_gpus
        resources = colocated_resources(spec, referenced, settings)
    source = api.ModelSource(name=ensemble_name, storage_uri="", format="python", version=1)
    text = json.dumps(ensemble_config(ensemble_name, spec, step_models, remote), indent=2, sort_keys=True) + "\n"
    models.insert(0, ServedModel(source, "config.json", text))
    return _workload(
        owner, models, model_name=ensemble_name, resources=resources, gpus=gpus,
        scaling=spec.scaling, storage=storage, shutdown=spec.shutdown, server=spec.server, settings=settings,
        traffic=({"revision": "stable", "version": 1, "percent": 100},),
        placement="Colocated" if colocate else "Remote", live=live,
    )


def colocated_resources(
    spec: api.EnsembleSpec, referenced: Mapping[str, api.InferenceModelSpec], settings: Settings
) -> api.Resources:
    """The runtime container's CPU and memory when an Ensemble's steps share its pods: each field the
    Ensemble's ``resources`` sets is used as it is; otherwise, once any step states it (in its own
    ``resources`` or, for a ``modelRef``, in that InferenceModel's), the steps' add up (a step stating
    none counts the operator default), one model counted once; else the operator default applies."""
    served: dict[str, tuple[str | None, str | None]] = {}
    for step in spec.steps:
        if step.model_ref is not None:
            ref = referenced[step.model_ref]
            name = ref.model.name
            cpu, memory = step.resources.cpu or ref.resources.cpu, step.resources.memory or ref.resources.memory
        else:
            assert step.model is not None
            name, cpu, memory = step.model.name, step.resources.cpu, step.resources.memory
        known = served.get(name, (None, None))
        served[name] = (known[0] or cpu, known[1] or memory)  # two steps calling one model: one model to budget

    def total(own: str | None, stated: list[str | None], default: str, unit: str) -> str | None:
        if own is not None or not any(stated):
            return own
        return resource_sum([value or default for value in stated], unit)

    cpus, memories = [cpu for cpu, _ in served.values()], [memory for _, memory in served.values()]
    return dataclasses.replace(
        spec.resources,
        cpu=total(spec.resources.cpu, cpus, settings.default_resources.cpu, "cpu"),
        memory=total(spec.resources.memory, memories, settings.default_resources.memory, "memory"),
    )


# ---------------------------------------------------------------- model pools

POOL_MEMBER_LABEL_PREFIX = "member.sluice.dev/"
"""``member.sluice.dev/<member>: "true"`` on a pool's pods that serve that member: the member's Service
selects only pods that load its model, also while the pool rolls out a change of membership."""


def member_label(member: str) -> str:
    """The pod label key saying a pool pod serves InferenceModel ``member`` (a label name holds 63
    characters; a longer member name is cut and made unique with a hash)."""
    if len(member) > 63:
        member = f"{member[:52]}-{hashlib.sha256(member.encode()).hexdigest()[:10]}"
    return POOL_MEMBER_LABEL_PREFIX + member


def model_pool(
    owner: Owner, spec: api.ModelPoolSpec, members: Sequence[tuple[str, api.InferenceModelSpec]],
    settings: Settings, *, service_account: str | None = None, live: Mapping[str, Any] | None = None,
    shape: placement.Shape | None = None,
) -> Desired:
    """Children of a ModelPool: one runtime Deployment (with ConfigMap, Service, PDB and autoscaler, as an
    InferenceModel's) serving the model of every admitted member in ``members`` ((name, spec), the
    reconciler's admission); each member's files are fetched with its own ``storage`` credentials, and the
    pods run as ``service_account`` (the one the members share, ``pools.Admission.service_account``).
    The device is the pool's ``spec.gpu``, rendered where the GPU planner put it (``shape``); the members'
    shares of it are bookkeeping (``pools``)."""
    if problems := unserved_formats([(f"InferenceModel {name!r} spec.model", m.model) for name, m in members]):
        raise NotServedError(problems)
    served = [served_model(m.model, m.runtime, gpu=True, storage=m.storage) for _, m in members]
    return _workload(
        owner, served, model_name="", resources=dataclasses.replace(spec.resources, gpu=spec.gpu),
        gpus=[spec.gpu], scaling=spec.scaling, storage=api.Storage(service_account_name=service_account),
        shutdown=spec.shutdown, server=spec.server, settings=settings, traffic=(), live=live,
        pod_labels={member_label(name): "true" for name, _ in members}, shape=shape,
    )


def pool_member(
    owner: Owner, spec: api.InferenceModelSpec, pool: Owner, settings: Settings, *, had_canary: bool = False,
) -> Desired:
    """Children of an InferenceModel in ``pool``: its own Service only (the name clients already use),
    selecting the pool's pods that serve it. Everything a standalone model owns is named absent, so a
    model that joins a pool gives its Deployment, ConfigMap, PDB and autoscaler up; so is what its
    canary owned when it ``had_canary`` (its status still shows one)."""
    if problems := unserved_formats([("spec.model", spec.model)]):
        raise NotServedError(problems)
    selector = {**selector_labels(pool), member_label(owner.name): "true"}
    own_service = ("v1", "Service", owner.name)
    absent = [a for a in _track_names(owner, STABLE) if a != own_service]
    if had_canary:
        absent += _track_names(owner, CANARY) + _route_names(owner)
    host = f"{owner.name}.{owner.namespace}.svc.{settings.cluster_domain}"
    http_url = f"http://{host}:{settings.http_port}"
    return Desired(
        objects=(service(owner, owner.name, settings, selector=selector),), absent=tuple(absent),
        selector=",".join(f"{k}={v}" for k, v in sorted(selector.items())),
        http_url=http_url, grpc_target=f"{host}:{settings.grpc_port}",
        model_url=f"{http_url}/v2/models/{spec.model.name}",
        traffic=({"revision": STABLE, "version": spec.model.version, "percent": 100},),
    )
