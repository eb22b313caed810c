"""Test support for the Sluice operator: a realistic API-server emulator and an in-process operator.

Also, as modules of their own: ``sluice_testing.schemas`` (third-party custom resources against their
published schemas), ``sluice_testing.adapter`` (prometheus-adapter's query templating),
``sluice_testing.scheduler`` (kube-scheduler's filters, which ``ApiServer(simulate_scheduling=True)``
runs) and ``sluice_testing.gpu_nodes`` (GPU clusters as NVIDIA's GFD, device plugin and DRA driver
publish them, with ``load()`` to put them into an ``ApiServer``).

Needs the ``test`` extra (kmock, jsonschema). Used by ``tests/operator_`` and ``e2e/``; never imported
by the operator itself, and not shipped: it lives in ``tests/support`` (on sys.path through pytest's
``pythonpath`` setting), outside the ``sluice`` packages that the wheel and the images install.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sluice_testing.apiserver import ApiServer
    from sluice_testing.harness import FakeClock, OperatorHarness
    from sluice_testing.kubectl import Cluster

__all__ = ["ApiServer", "Cluster", "FakeClock", "OperatorHarness"]
_HOME = {"ApiServer": "apiserver", "Cluster": "kubectl", "FakeClock": "harness", "OperatorHarness": "harness"}


def __getattr__(name: str) -> Any:
    """The operator-side names, imported on first use: runtime tests import ``sluice_testing``'s
    other modules on machines without kopf or kmock (the GPU machine)."""
    if name in _HOME:
        return getattr(importlib.import_module(f"sluice_testing.{_HOME[name]}"), name)
    raise AttributeError(f"module 'sluice_testing' has no attribute {name!r}")
