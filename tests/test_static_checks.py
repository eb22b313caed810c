"""Static checks that run with the tests: import contracts (import-linter) and the mypy baseline.

The contracts live in pyproject.toml (``[tool.importlinter]``); the mypy baseline in
``tests/mypy_baseline.txt`` (regenerate: ``python -P tests/mypy_baseline.py --update``).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BIN = os.path.dirname(sys.executable)


def test_import_contracts_hold(tmp_path):
    lint_imports = shutil.which("lint-imports", path=BIN)
    if lint_imports is None:
        pytest.fail("lint-imports is missing: install the test extra (pip install -e '.[test]')")
    # Run outside the checkout: import-linter puts its working directory on sys.path, where ./operator
    # would shadow the standard library's operator module.
    done = subprocess.run([lint_imports, "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                          cwd=tmp_path, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[done.stdout.find("Contracts"):] + done.stderr


@pytest.mark.timeout(300)
def test_mypy_finds_no_error_beyond_the_baseline():
    done = subprocess.run([sys.executable, "-P", str(ROOT / "tests" / "mypy_baseline.py")],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
