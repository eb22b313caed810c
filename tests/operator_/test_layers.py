"""The operator's layers import in one direction only, and never the runtime (checked from the source)."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "operator"
# Each module may import only modules of a lower layer (later in this list).
LAYERS = [
    {"__main__", "testing"},
    {"handlers"},
    {"kube"},
    {"reconcile"},
    {"builders", "crd"},
    {"api", "conditions", "settings", "metrics"},
]
RANK = {name: index for index, layer in enumerate(LAYERS) for name in layer}


def imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found.update(names)
    return found


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_down_the_layers(path):
    relative = path.relative_to(PACKAGE)
    own = relative.parts[0] if len(relative.parts) > 1 else path.stem
    for name in imports(path):
        assert not name.startswith("sluice.runtime"), f"{relative} imports the runtime ({name})"
        if name.startswith("sluice.operator."):
            target = name.split(".")[2]
            if target in RANK and target != own:
                assert RANK[target] > RANK[own], f"{relative} ({own}) must not import {target}"
