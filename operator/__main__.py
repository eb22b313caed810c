"""``sluice-operator``: build settings once, wire the handlers, run kopf until stopped.

Before anything starts it checks, with a one-line error instead of a traceback, that the ``operator``
extra is installed and that kopf's login will find credentials (in-cluster service account or a
kubeconfig). kopf and the modules that need it are imported only after the first check.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence

from sluice.operator.settings import Settings

MISSING_EXTRA = "sluice-operator needs the operator extra: pip install 'sluice[operator]'"
OPERATOR_EXTRA = {"kopf", "kubernetes", "aiohttp"}
"""Top-level modules the operator extra brings (aiohttp comes with kopf)."""
SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def missing_credentials(
    env: Mapping[str, str], exists: Callable[[str], bool] = os.path.exists,
    expanduser: Callable[[str], str] = os.path.expanduser,
) -> str | None:
    """``None`` when kopf's login will find credentials, else a one-line message naming what was looked for.

    Mirrors ``handlers.default_login``: the in-cluster service-account token first, then the kubeconfig
    files in ``KUBECONFIG`` (all must exist, as kopf opens each), else ``~/.kube/config``.
    """
    if exists(SERVICE_ACCOUNT_TOKEN):
        return None
    in_cluster = f"not in a cluster (no service-account token at {SERVICE_ACCOUNT_TOKEN})"
    kubeconfig = env.get("KUBECONFIG", "")
    if kubeconfig:
        paths = [p.strip() for p in kubeconfig.split(os.pathsep) if p.strip()]
        missing = [p for p in paths if not exists(expanduser(p))]
        if paths and not missing:
            return None
        return (f"sluice-operator: no Kubernetes credentials: {in_cluster}, and KUBECONFIG names a kubeconfig "
                f"that does not exist: {', '.join(missing) or repr(kubeconfig)}")
    default = expanduser("~/.kube/config")
    if exists(default):
        return None
    return (f"sluice-operator: no Kubernetes credentials: {in_cluster}, and no kubeconfig (KUBECONFIG is unset "
            f"and {default} does not exist)")


def _environment_help(defaults: Settings) -> str:
    resources = defaults.default_resources
    rows = [
        ("SLUICE_WATCH_NAMESPACES", "all namespaces", "comma-separated namespaces to watch"),
        ("SLUICE_RUNTIME_IMAGE", defaults.runtime_image, "CPU runtime image"),
        ("SLUICE_RUNTIME_GPU_IMAGE", defaults.runtime_gpu_image, "CUDA runtime image"),
        ("SLUICE_IMAGE_PULL_POLICY", defaults.image_pull_policy, "for runtime and fetch containers"),
        ("SLUICE_DEFAULT_CPU", resources.cpu, "CPU of models that name none"),
        ("SLUICE_DEFAULT_MEMORY", resources.memory, "memory of models that name none"),
        ("SLUICE_PROTOCOL_WORKERS", "not passed", "protocol workers of models that set none: auto or a count"),
        ("SLUICE_MAX_COLOCATED_GPUS", str(defaults.max_colocated_gpus), "ensemble colocation bound"),
        ("SLUICE_CLUSTER_DOMAIN", defaults.cluster_domain, "DNS suffix in status URLs"),
        ("SLUICE_RESYNC_SECONDS", f"{defaults.resync_seconds:g}", "period of the resync timer"),
        ("SLUICE_PEERING_NAME", "standalone", "kopf peering object for leader election"),
        ("SLUICE_PEERING_PRIORITY", "random per process", "this replica's peering priority"),
        ("SLUICE_HEALTH_PORT", str(defaults.health_port), "liveness endpoint /healthz"),
        ("SLUICE_METRICS_PORT", str(defaults.operator_metrics_port), "Prometheus /metrics; 0 turns it off"),
        ("SLUICE_PROMETHEUS_URL", "scrape the pods", "Prometheus for canary analysis and KEDA triggers"),
        ("SLUICE_ROUTER", defaults.router, "canary split: auto, gateway-api, istio or none"),
        ("SLUICE_GATEWAY", "the model's Service", "namespace/name of the Gateway routes attach to"),
        ("SLUICE_GPU_ALLOCATION", defaults.gpu_allocation, "GPUs by extended-resources or dra"),
        ("SLUICE_PLACEMENT_REFRESH_SECONDS", f"{defaults.placement_refresh_seconds:g}",
         "how long a GPU inventory read is reused"),
        ("SLUICE_WEBHOOK_PORT", "0 (off)", "HTTPS port of the sidecar-injection webhook"),
        ("SLUICE_WEBHOOK_TLS", defaults.webhook.tls, "self-managed (own CA in a Secret) or cert-manager"),
        ("SLUICE_WEBHOOK_CERT_DIR", defaults.webhook.cert_dir, "tls.crt/tls.key the webhook serves"),
        ("SLUICE_WEBHOOK_NAMESPACE", defaults.webhook.namespace, "namespace of the webhook Service and Secret"),
        ("SLUICE_WEBHOOK_SERVICE", defaults.webhook.service, "webhook Service (the certificate's names)"),
        ("SLUICE_WEBHOOK_SECRET", defaults.webhook.secret, "Secret of the self-managed CA and certificate"),
        ("SLUICE_WEBHOOK_CONFIGURATION", defaults.webhook.configuration, "where the CA is published (caBundle)"),
        ("SLUICE_NATIVE_SIDECARS", defaults.webhook.native_sidecars, "auto (from /version), true or false"),
        ("SLUICE_SIDECAR_SHM_SIZE", defaults.webhook.shm_size, "sizeLimit of the shared /dev/shm"),
    ]
    width = max(len(name) for name, _, _ in rows)
    lines = [f"  {name:<{width}}  {what} (default: {default})" for name, default, what in rows]
    return "environment (see docs/operator.md):\n" + "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    result = argparse.ArgumentParser(
        prog="sluice-operator",
        description="Reconcile sluice.dev InferenceModels and Ensembles. Settings come from SLUICE_* "
        "environment variables (below); flags override them. Credentials: the in-cluster service account, "
        "else the kubeconfig (KUBECONFIG or ~/.kube/config).",
        epilog=_environment_help(Settings()), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    result.add_argument("--namespace", action="append", default=None, metavar="NAME",
                        help="namespace to watch (repeatable) (default: SLUICE_WATCH_NAMESPACES, else all)")
    result.add_argument("--verbose", action="store_true", help="debug logging (default: off, INFO)")
    return result


async def run(settings: Settings, *, stop_flag: asyncio.Event | None = None) -> None:
    import kopf
    import prometheus_client

    from sluice.operator import handlers
    from sluice.operator.kube import Kube
    from sluice.operator.metrics import OperatorMetrics
    from sluice.operator.reconcile import Reconciler
    from sluice.operator.sources import GateClient, PrometheusSource, ScrapeSource

    registry = kopf.OperatorRegistry()
    kube = Kube()
    metrics = OperatorMetrics()
    # The canary analysis reads Prometheus when one is configured, else the runtime pods themselves.
    source = (PrometheusSource(settings.prometheus_url) if settings.prometheus_url
              else ScrapeSource(kube, settings.metrics_port))
    gate = GateClient()
    reconciler = Reconciler(kube=kube, settings=settings, clock=utc_now, events=handlers.kopf_event,
                            metrics=source, gate=gate.ask)
    handlers.register(registry, settings=settings, kube=kube, reconciler=reconciler, metrics=metrics)
    metrics_server = None
    if settings.operator_metrics_port:
        metrics_server, _ = prometheus_client.start_http_server(settings.operator_metrics_port,
                                                                registry=metrics.registry)
    try:
        await kopf.operator(
            registry=registry,
            clusterwide=not settings.namespaces,
            namespaces=settings.namespaces,
            standalone=settings.peering_name is None,
            peering_name=settings.peering_name,
            priority=settings.peering_priority,
            liveness_endpoint=f"http://0.0.0.0:{settings.health_port}/healthz" if settings.health_port else None,
            stop_flag=stop_flag,
        )
    finally:
        await source.aclose()
        await gate.aclose()
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        import kopf  # the operator extra; everything that runs below needs it
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in OPERATOR_EXTRA:
            raise
        sys.exit(MISSING_EXTRA)
    if problem := missing_credentials(os.environ):
        sys.exit(problem)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = Settings.from_env()
    except ValueError as exc:  # a bad SLUICE_* value: one line naming it and what is allowed
        sys.exit(f"sluice-operator: {exc}")
    if args.namespace:
        settings = dataclasses.replace(settings, namespaces=tuple(args.namespace))
    try:
        asyncio.run(run(settings))
    except Exception as exc:
        # A startup handler that failed for good (kopf logged it; e.g. the leader election's peering object
        # cannot be created): one line with its reason, not kopf's "One or more handlers failed." traceback.
        if not isinstance(exc.__cause__, kopf.PermanentError):
            raise
        sys.exit(f"sluice-operator: cannot start: {exc.__cause__}")


if __name__ == "__main__":
    main()
