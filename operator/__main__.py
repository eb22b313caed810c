"""``sluice-operator``: build settings once, wire the handlers, run kopf until stopped."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import logging
from collections.abc import Sequence

import kopf
import prometheus_client

from sluice.operator import handlers
from sluice.operator.kube import Kube
from sluice.operator.metrics import OperatorMetrics
from sluice.operator.reconcile import Reconciler
from sluice.operator.settings import Settings


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


async def run(settings: Settings, *, stop_flag: asyncio.Event | None = None) -> None:
    registry = kopf.OperatorRegistry()
    kube = Kube()
    metrics = OperatorMetrics()
    reconciler = Reconciler(kube=kube, settings=settings, clock=utc_now, events=handlers.kopf_event)
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
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="sluice-operator",
        description="Reconcile sluice.dev InferenceModels and Ensembles. Settings come from SLUICE_* "
        "environment variables (see docs/operator.md); flags override them.",
    )
    parser.add_argument("--namespace", action="append", default=None,
                        help="Namespace to watch (repeatable); default: SLUICE_WATCH_NAMESPACES or all.")
    parser.add_argument("--verbose", action="store_true", help="Debug logging.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings.from_env()
    if args.namespace:
        settings = dataclasses.replace(settings, namespaces=tuple(args.namespace))
    asyncio.run(run(settings))


if __name__ == "__main__":
    main()
