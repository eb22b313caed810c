"""``sluice-operator`` as a user runs it: one-line errors instead of tracebacks, and a --help with defaults."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from sluice.operator import __main__ as entry

BIN = pathlib.Path(sys.executable).parent
SETTINGS_SOURCE = pathlib.Path(entry.__file__).with_name("settings.py")


def run(args: list[str], env: dict[str, str], cwd: pathlib.Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=60, check=False)


def test_without_the_operator_extra_it_says_what_to_install(tmp_path):
    # kopf made unimportable, exactly as in an environment installed without the extra.
    code = "import sys; sys.modules['kopf'] = None; from sluice.operator.__main__ import main; main([])"
    done = run([sys.executable, "-P", "-c", code], {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}, tmp_path)
    assert done.returncode == 1
    assert done.stderr == "sluice-operator needs the operator extra: pip install 'sluice[operator]'\n"


@pytest.mark.skipif(os.path.exists(entry.SERVICE_ACCOUNT_TOKEN), reason="this machine has in-cluster credentials")
def test_without_credentials_it_names_what_it_looked_for(tmp_path):
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    done = run([str(BIN / "sluice-operator")], env, tmp_path)
    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert line.startswith("sluice-operator: no Kubernetes credentials: ")
    assert entry.SERVICE_ACCOUNT_TOKEN in line
    assert f"KUBECONFIG is unset and {tmp_path}/.kube/config does not exist" in line

    done = run([str(BIN / "sluice-operator")], {**env, "KUBECONFIG": str(tmp_path / "nope.yaml")}, tmp_path)
    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert line.endswith(f"KUBECONFIG names a kubeconfig that does not exist: {tmp_path / 'nope.yaml'}")


def test_credentials_are_found_where_kopf_looks():
    def exists_only(*present: str):
        return lambda path: path in present

    home = {"expanduser": lambda p: p.replace("~", "/home/u")}
    assert entry.missing_credentials({}, exists_only(entry.SERVICE_ACCOUNT_TOKEN), **home) is None
    assert entry.missing_credentials({}, exists_only("/home/u/.kube/config"), **home) is None
    assert entry.missing_credentials({"KUBECONFIG": "/a:/b"}, exists_only("/a", "/b"), **home) is None
    assert entry.missing_credentials({"KUBECONFIG": "/a:/b"}, exists_only("/a"), **home).endswith(": /b")
    assert "/home/u/.kube/config does not exist" in entry.missing_credentials({}, exists_only(), **home)


def test_help_shows_every_default(tmp_path):
    done = run([str(BIN / "sluice-operator"), "--help"], {"PATH": os.environ["PATH"]}, tmp_path)
    assert done.returncode == 0, done.stderr
    text = re.sub(r"\n\s+(?=\S)", " ", done.stdout)  # argparse wraps long help lines
    variables = set(re.findall(r'"(SLUICE_[A-Z_]+)"', SETTINGS_SOURCE.read_text()))
    assert variables
    for variable in sorted(variables):
        assert re.search(rf"{variable} .*\(default: [^)]+\)", text), f"{variable} or its default is missing"
    for option in ("--namespace", "--verbose"):
        assert re.search(rf"{option}\b.*\(default: [^)]+\)", text), f"{option} shows no default"
