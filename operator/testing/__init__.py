"""Test support for the Sluice operator: a realistic API-server emulator and an in-process operator.

Needs the ``test`` extra (kmock, jsonschema). Used by ``tests/operator_`` and ``e2e/``; never imported
by the operator itself.
"""

from sluice.operator.testing.apiserver import ApiServer
from sluice.operator.testing.harness import FakeClock, OperatorHarness

__all__ = ["ApiServer", "FakeClock", "OperatorHarness"]
