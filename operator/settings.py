"""Operator settings: one explicit object, built once in ``__main__`` and passed down by keyword.

Nothing here reads the environment at import time; :func:`Settings.from_env` is called by ``__main__``
(and by tests that want the production defaults with a few overrides).
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Mapping

FIELD_MANAGER = "sluice-operator"
"""The server-side apply field manager of every object the operator writes. Fixed on purpose: a changing
manager name would leave orphaned field ownership behind on every upgrade."""


@dataclasses.dataclass(frozen=True)
class DefaultResources:
    """Resources a model pod gets when its spec leaves them out."""

    cpu: str = "1"
    """CPU request (and limit) of the runtime container."""
    memory: str = "2Gi"
    """Memory request (and limit) of the runtime container."""
    fetch_cpu: str = "500m"
    """CPU request of the model-fetch init container."""
    fetch_memory: str = "1Gi"
    """Memory request (and limit) of the model-fetch init container."""


@dataclasses.dataclass(frozen=True)
class Webhook:
    """The sidecar-injection admission webhook (docs/operator.md, "Sidecar mode")."""

    port: int = 0
    """HTTPS port of the mutating webhook server; 0: no webhook (Sidecar-mode models are then only rendered)."""
    cert_dir: str = "/tmp/sluice-webhook"
    """Where the serving certificate is read from (``tls.crt``, ``tls.key``): written there by the operator
    (``tls: self-managed``) or mounted from cert-manager's Secret (``tls: cert-manager``)."""
    tls: str = "self-managed"
    """``self-managed``: the operator keeps a CA and serving certificate in ``secret`` and publishes the CA in
    the MutatingWebhookConfiguration's ``caBundle``; ``cert-manager``: the files in ``cert_dir`` are used as
    they are and cert-manager's CA injector fills the caBundle."""
    namespace: str = "sluice-system"
    """Namespace of the operator, its webhook Service and the certificate Secret."""
    service: str = "sluice-webhook"
    """The webhook Service: the serving certificate is issued for its DNS names."""
    secret: str = "sluice-webhook-tls"
    """Secret holding the self-managed CA and serving certificate (shared by replicas, kept across restarts)."""
    configuration: str = "sluice-sidecar-injector"
    """The MutatingWebhookConfiguration whose ``caBundle`` the self-managed mode keeps current."""
    native_sidecars: str = "auto"
    """``true``: inject the runtime as a native sidecar (an init container with ``restartPolicy: Always``,
    Kubernetes >= 1.29); ``false``: as a regular container; ``auto``: ask the API server's ``/version``."""
    shm_size: str = "1Gi"
    """``sizeLimit`` of the memory-backed ``/dev/shm`` shared by the runtime and the application containers."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything the operator needs to know that is not in an InferenceModel or Ensemble."""

    namespaces: tuple[str, ...] = ()
    """Namespaces to watch; empty means cluster-wide."""
    runtime_image: str = "ghcr.io/sluice-ml/sluice-runtime:0.1.0"
    """The CPU runtime image (``Dockerfile.runtime`` built with ``VARIANT=cpu``)."""
    runtime_gpu_image: str = "ghcr.io/sluice-ml/sluice-runtime:0.1.0-cuda"
    """The CUDA runtime image, used when a model asks for a GPU (``VARIANT=cuda``). The runtime images also
    fetch the models: an init container runs ``sluice pull <storageUri> <destination>`` in the pod's image."""
    image_pull_policy: str = "IfNotPresent"
    """Pull policy of the runtime and init containers."""
    default_resources: DefaultResources = dataclasses.field(default_factory=DefaultResources)
    """Resources for models that do not name their own."""
    default_protocol_workers: int | str | None = None
    """``spec.server.protocolWorkers`` of models that do not set it: ``auto`` or a count; ``None`` passes
    nothing (the runtime's one process), so pods rendered before the setting existed do not roll."""
    cluster_domain: str = "cluster.local"
    """DNS suffix used to build the endpoint URLs in status."""
    max_colocated_gpus: int = 1
    """An Ensemble's steps share one pod when their whole GPUs add up to at most this many (and no
    step needs a MIG slice or a GPU-memory class); otherwise the ensemble calls the step Services."""
    resync_seconds: float = 60.0
    """Period of the level-triggered resync that repairs drift even when no watch event arrives."""
    http_port: int = 8000
    """Runtime HTTP port (KServe V2 REST)."""
    grpc_port: int = 8001
    """Runtime gRPC port (KServe V2 gRPC)."""
    metrics_port: int = 8002
    """Runtime Prometheus port; the HPA reads ``sluice_queue_depth`` from it through an adapter."""
    peering_name: str | None = None
    """kopf peering object name for leader election; ``None`` runs standalone (single replica)."""
    peering_priority: int = 0
    """This replica's kopf peering priority: the highest live one reconciles, the others pause. Replicas
    must differ: kopf pauses *every* operator when two of the same priority meet."""
    health_port: int = 8080
    """Port of the operator's own liveness endpoint (``/healthz``)."""
    operator_metrics_port: int = 9090
    """Port of the operator's own Prometheus metrics (``/metrics``); 0 turns them off."""

    prometheus_url: str | None = None
    """Prometheus the canary analysis queries (and KEDA triggers point at); ``None``: the operator
    scrapes the runtime pods' metrics endpoints itself."""
    router: str = "auto"
    """How canary traffic is split: ``gateway-api`` (HTTPRoute + GRPCRoute weights), ``istio``
    (VirtualService weights), ``none`` (the stable pods forward the canary's share themselves), or
    ``auto`` (Gateway API, then Istio, by API discovery; otherwise ``none``)."""
    gateway: str = ""
    """``namespace/name`` of the Gateway the HTTPRoute/GRPCRoute attach to; empty attaches them to
    the model's Service (Gateway API for service mesh, GAMMA)."""

    gpu_allocation: str = "extended-resources"
    """How runtime pods ask for GPUs: ``extended-resources`` (the NVIDIA device plugin's
    ``nvidia.com/gpu`` / ``nvidia.com/mig-<profile>``) or ``dra`` (a ResourceClaimTemplate per Deployment
    for NVIDIA's DRA driver, ``resource.k8s.io/v1``, Kubernetes >= 1.34)."""
    placement_refresh_seconds: float = 30.0
    """How long the GPU inventory (Nodes, Pods, ResourceSlices) read for planning is reused before it is
    listed again."""
    webhook: Webhook = dataclasses.field(default_factory=Webhook)
    """The sidecar-injection webhook."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Build settings from ``SLUICE_*`` variables (the Helm chart sets them); absent ones keep defaults."""
        env = os.environ if env is None else env
        defaults = cls()
        resources = DefaultResources(
            cpu=env.get("SLUICE_DEFAULT_CPU", defaults.default_resources.cpu),
            memory=env.get("SLUICE_DEFAULT_MEMORY", defaults.default_resources.memory),
        )
        namespaces = tuple(ns.strip() for ns in env.get("SLUICE_WATCH_NAMESPACES", "").split(",") if ns.strip())
        peering_name = env.get("SLUICE_PEERING_NAME") or None
        priority = env.get("SLUICE_PEERING_PRIORITY", "")
        if peering_name and not priority:
            # The replicas of one Deployment share their environment: each draws its own priority.
            priority = str(random.SystemRandom().randrange(1, 2**31))
        return cls(
            namespaces=namespaces,
            runtime_image=env.get("SLUICE_RUNTIME_IMAGE", defaults.runtime_image),
            runtime_gpu_image=env.get("SLUICE_RUNTIME_GPU_IMAGE", defaults.runtime_gpu_image),
            image_pull_policy=env.get("SLUICE_IMAGE_PULL_POLICY", defaults.image_pull_policy),
            default_resources=resources,
            default_protocol_workers=_protocol_workers(env.get("SLUICE_PROTOCOL_WORKERS", "")),
            cluster_domain=env.get("SLUICE_CLUSTER_DOMAIN", defaults.cluster_domain),
            max_colocated_gpus=int(env.get("SLUICE_MAX_COLOCATED_GPUS", defaults.max_colocated_gpus)),
            resync_seconds=float(env.get("SLUICE_RESYNC_SECONDS", defaults.resync_seconds)),
            peering_name=peering_name,
            peering_priority=int(priority) if priority else defaults.peering_priority,
            health_port=int(env.get("SLUICE_HEALTH_PORT", defaults.health_port)),
            operator_metrics_port=int(env.get("SLUICE_METRICS_PORT", defaults.operator_metrics_port)),
            prometheus_url=_url(env.get("SLUICE_PROMETHEUS_URL") or None),
            router=_one_of("SLUICE_ROUTER", env.get("SLUICE_ROUTER", defaults.router), ROUTER_CHOICES),
            gateway=_gateway(env.get("SLUICE_GATEWAY", defaults.gateway)),
            gpu_allocation=_one_of("SLUICE_GPU_ALLOCATION", env.get("SLUICE_GPU_ALLOCATION", defaults.gpu_allocation),
                                   GPU_ALLOCATION_CHOICES),
            placement_refresh_seconds=float(
                env.get("SLUICE_PLACEMENT_REFRESH_SECONDS", defaults.placement_refresh_seconds)),
            webhook=_webhook(env, defaults.webhook),
        )


WEBHOOK_TLS_CHOICES = ("self-managed", "cert-manager")
NATIVE_SIDECAR_CHOICES = ("auto", "true", "false")


def _webhook(env: Mapping[str, str], defaults: Webhook) -> Webhook:
    port = env.get("SLUICE_WEBHOOK_PORT", str(defaults.port))
    if not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ValueError(f"SLUICE_WEBHOOK_PORT={port!r} is not allowed; allowed: 0 (no webhook) or a port 1-65535")
    return Webhook(
        port=int(port),
        cert_dir=env.get("SLUICE_WEBHOOK_CERT_DIR", defaults.cert_dir),
        tls=_one_of("SLUICE_WEBHOOK_TLS", env.get("SLUICE_WEBHOOK_TLS", defaults.tls), WEBHOOK_TLS_CHOICES),
        namespace=env.get("SLUICE_WEBHOOK_NAMESPACE") or env.get("POD_NAMESPACE") or defaults.namespace,
        service=env.get("SLUICE_WEBHOOK_SERVICE", defaults.service),
        secret=env.get("SLUICE_WEBHOOK_SECRET", defaults.secret),
        configuration=env.get("SLUICE_WEBHOOK_CONFIGURATION", defaults.configuration),
        native_sidecars=_one_of("SLUICE_NATIVE_SIDECARS", env.get("SLUICE_NATIVE_SIDECARS", defaults.native_sidecars),
                                NATIVE_SIDECAR_CHOICES),
        shm_size=env.get("SLUICE_SIDECAR_SHM_SIZE", defaults.shm_size),
    )


ROUTER_CHOICES = ("auto", "gateway-api", "istio", "none")
GPU_ALLOCATION_CHOICES = ("extended-resources", "dra")


def _one_of(variable: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{variable}={value!r} is not allowed; allowed: {', '.join(allowed)}")
    return value


MAX_PROTOCOL_WORKERS = 64
"""The runtime's bound (``sluice serve --protocol-workers``; api.MAX_PROTOCOL_WORKERS is the same)."""


def _protocol_workers(value: str) -> int | str | None:
    if value in ("", "auto"):
        return value or None
    if value.isascii() and value.isdigit() and int(value) <= MAX_PROTOCOL_WORKERS:
        return int(value)
    raise ValueError(f"SLUICE_PROTOCOL_WORKERS={value!r} is not allowed; allowed: empty (not passed), auto, "
                     f"or a count from 0 to {MAX_PROTOCOL_WORKERS}")


def _url(value: str | None) -> str | None:
    if value is not None and not value.startswith(("http://", "https://")):
        raise ValueError(f"SLUICE_PROMETHEUS_URL={value!r} is not allowed; allowed: an http:// or https:// URL "
                         "of Prometheus' HTTP API, e.g. http://prometheus-operated.monitoring:9090")
    return value


def _gateway(value: str) -> str:
    namespace, _, name = value.rpartition("/")
    if value and (not name or (_ and not namespace) or "/" in namespace):
        raise ValueError(f"SLUICE_GATEWAY={value!r} is not allowed; allowed: <namespace>/<name> or <name> of a "
                         "Gateway, or empty to attach routes to the model's Service")
    return value
