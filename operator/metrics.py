"""The operator's own Prometheus metrics, on a registry object (never the global one).

Built once in ``__main__`` and passed to ``handlers.register``; tests build their own.
"""

from __future__ import annotations

import prometheus_client


class OperatorMetrics:
    """Reconcile counts and durations, labelled by kind and result (ok, error)."""

    def __init__(self, registry: prometheus_client.CollectorRegistry | None = None) -> None:
        self.registry = registry or prometheus_client.CollectorRegistry(auto_describe=True)
        self.reconciles = prometheus_client.Counter(
            "sluice_operator_reconciles", "Reconciles run, by kind and result.", ["kind", "result"],
            registry=self.registry,
        )
        self.reconcile_seconds = prometheus_client.Histogram(
            "sluice_operator_reconcile_seconds", "Time one reconcile took, by kind.", ["kind"],
            registry=self.registry,
        )
        self.status_writes = prometheus_client.Counter(
            "sluice_operator_status_writes", "Status patches written (only when status changed).", ["kind"],
            registry=self.registry,
        )
