"""Validate third-party custom resources against their published schemas, for tests.

Kubernetes' own kinds are checked with ``kubernetes_validate``; the custom resources Sluice renders or
ships for other projects (KEDA ``ScaledObject``, prometheus-operator ``PodMonitor`` and
``ServiceMonitor``, Gateway API ``HTTPRoute`` and ``GRPCRoute``, Istio ``VirtualService``, and every
other kind those projects define) are checked here::

    from sluice_testing import schemas

    def test_route_is_valid():
        assert schemas.validate(route) == []        # skips the test when the schemas are not installed

``validate(obj)`` picks the schema by ``obj["apiVersion"]`` and ``obj["kind"]`` and returns one line
per problem, as ``<JSON pointer>: <what is wrong>``, e.g.
``/spec/rules/0/backendRefs/1/weight: must be integer`` or
``/spec/triggers/0/bogus: unknown field (not in the published schema; the API server would prune it)``;
an empty list means valid. Unknown fields are reported because an API server prunes them without a
word, which is how a misspelt field goes unnoticed. A kind without a published schema is one problem
line naming it. :func:`validate_all` checks several objects with one node process.
:func:`skip_reason` says why the schemas are unavailable (``None`` when they are there), for tests
that want to skip before building anything.

Where the schemas come from: ``.ci/tools.sh`` installs the npm packages ``@kubernetes-models/keda``,
``prometheus-operator``, ``gateway-api`` and ``istio`` (pinned) into ``.tools/schemas/``. They ship
the CRDs' OpenAPI schemas compiled by ajv into JavaScript validators, not as JSON Schema documents, so
``schemas_validate.mjs`` runs them under node (one process per call, about 0.2 s).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
SCHEMAS = ROOT / ".tools" / "schemas"
"""Where ``.ci/tools.sh`` installs the packages (``node_modules/@kubernetes-models/...``)."""
PACKAGES = ("keda", "prometheus-operator", "gateway-api", "istio")
_SCRIPT = pathlib.Path(__file__).with_name("schemas_validate.mjs")


def skip_reason() -> str | None:
    """Why the published schemas cannot be used here, or ``None`` when they can."""
    if shutil.which("node") is None:
        return "no node on PATH: the published CRD schemas are JavaScript validators (install Node.js)"
    missing = [p for p in PACKAGES if not (SCHEMAS / "node_modules" / "@kubernetes-models" / p).is_dir()]
    if missing:
        return (f"published CRD schemas not installed ({', '.join(missing)} missing in {SCHEMAS}): "
                "run `bash .ci/tools.sh` (needs npm)")
    return None


def validate_all(objects: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """The problems of each object, in order (see :func:`validate`); skips the test without schemas."""
    if reason := skip_reason():
        pytest.skip(reason)
    node = shutil.which("node")
    assert node is not None
    result = subprocess.run(
        [node, str(_SCRIPT), str(SCHEMAS / "node_modules")], input=json.dumps(list(objects)),
        capture_output=True, text=True, timeout=120, check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"schemas_validate.mjs failed ({result.returncode}): {result.stderr.strip()}")
    problems: list[list[str]] = json.loads(result.stdout)
    return problems


def validate(obj: Mapping[str, Any]) -> list[str]:
    """Problems of ``obj`` against the published schema of its apiVersion and kind; ``[]`` when valid."""
    [problems] = validate_all([obj])
    return problems
