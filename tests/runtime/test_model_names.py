"""Model names are names, not paths: the load API never runs code from outside the repository.

A Python model outside the repository writes a marker file when its ``initialize()`` runs; every
name that tries to reach it, over HTTP (plain and URL-encoded) and gRPC, must be refused before the
file system is touched, and the marker must never appear. The same rule holds where a config
turns a name into a path: ensemble steps and ``default_model_filename`` in a load's override.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from sluice.runtime import names

from .conftest import ADD_SUB_CONFIG, BUILDERS, EXPLICIT, write_model  # type: ignore[import-not-found]

PROBE_PY = """
import os


class TritonPythonModel:
    def initialize(self, args):
        with open(os.path.join(os.path.dirname(__file__), "RAN"), "w") as f:
            f.write(args["model_name"])

    def execute(self, requests):
        return []
"""

PROBE_CONFIG = """
name: "probe"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]
"""


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path]:
    """(repository, marker): a repository with add_sub, and a probe model beside it, outside."""
    repo = tmp_path / "repo"
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    probe = write_model(tmp_path / "outside", "probe", PROBE_CONFIG, {"model.py": PROBE_PY})
    return repo, probe / "1" / "RAN"


def hostile_names(tmp_path: Path) -> list[str]:
    return [
        "../outside/probe",
        str(tmp_path / "outside" / "probe"),  # absolute
        "..",
        ".",
        "",
        "   ",
        ".hidden",
        "a\\b",
        "probe\x00",
        "pro\nbe",
        "x" * 300,
    ]


def http_load(server, name: str, body: dict | None = None) -> tuple[int, str]:
    quoted = urllib.parse.quote(name, safe="")
    request = urllib.request.Request(
        f"http://{server.http}/v2/repository/models/{quoted}/load",
        data=json.dumps(body or {}).encode(),
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_hostile_names_are_refused_over_http_and_grpc_and_no_outside_code_runs(serve, layout, tmp_path):
    repo, marker = layout
    server = serve(repo, **EXPLICIT)
    grpc = grpcclient.InferenceServerClient(server.grpc)
    for name in hostile_names(tmp_path):
        if name:  # an empty name is not a route over HTTP: POST /v2/repository/models//load
            status, body = http_load(server, name)
            assert status == 400, (name, status, body)
            assert "invalid model name" in body and "allowed" in body, body
            assert str(repo) not in body  # the name is echoed (cut), never the server's paths
        with pytest.raises(InferenceServerException) as info:
            grpc.load_model(name)
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT", (name, info.value)
        assert "invalid model name" in info.value.message()
        with pytest.raises(InferenceServerException) as info:
            grpc.unload_model(name)
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert not marker.exists(), "the outside model's initialize() ran"
    # refused names leave no row in the repository index
    assert {row["name"] for row in httpclient.InferenceServerClient(server.http).get_model_repository_index()} == {
        "add_sub"
    }


def test_unencoded_traversal_in_the_url_is_not_a_route(serve, layout):
    repo, marker = layout
    server = serve(repo)
    request = urllib.request.Request(
        f"http://{server.http}/v2/repository/models/../outside/probe/load", data=b"{}", method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code in (400, 404)
    assert not marker.exists()


def test_a_symlink_leading_outside_the_repository_is_refused(serve, layout, tmp_path):
    repo, marker = layout
    (repo / "link").symlink_to(tmp_path / "outside" / "probe", target_is_directory=True)
    server = serve(repo, strict_readiness=False, **EXPLICIT)  # the link is found at start and refused there too
    status, body = http_load(server, "link")
    assert status == 400, body
    assert "symbolic link that leads outside the model repository" in body
    assert not marker.exists()
    index = {row["name"]: row for row in httpclient.InferenceServerClient(server.http).get_model_repository_index()}
    assert index["link"]["state"] == "UNAVAILABLE"


def test_a_symlink_inside_the_repository_is_served(serve, layout):
    repo, _ = layout
    (repo / "alias").symlink_to(repo / "add_sub", target_is_directory=True)
    (repo / "alias" / "config.pbtxt").write_text(ADD_SUB_CONFIG.replace('name: "add_sub"', ""))
    server = serve(repo, models=("alias",))
    assert httpclient.InferenceServerClient(server.http).is_model_ready("alias")


def test_default_model_filename_in_a_config_override_cannot_leave_the_version_directory(serve, layout, tmp_path):
    repo, marker = layout
    victim = write_model(repo, "victim", PROBE_CONFIG.replace("probe", "victim"), {"model.py": PROBE_PY})
    server = serve(repo, models=("add_sub",), model_control_mode="explicit")
    override = {
        "name": "victim",
        "backend": "python",
        "default_model_filename": "../../../outside/probe/1/model.py",
        "max_batch_size": 0,
        "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [1]}],
        "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [1]}],
    }
    client = grpcclient.InferenceServerClient(server.grpc)
    with pytest.raises(InferenceServerException) as info:
        client.load_model("victim", config=json.dumps(override))
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "default_model_filename" in info.value.message() and "not a path" in info.value.message()
    assert "failed to load 'victim'" in info.value.message()
    assert str(tmp_path) not in info.value.message()
    assert not marker.exists()
    assert not (victim / "1" / "RAN").exists()


def test_ensemble_step_names_are_names(serve, layout):
    repo, marker = layout
    write_model(
        repo,
        "ens",
        """
        name: "ens"
        platform: "ensemble"
        max_batch_size: 0
        input [ { name: "A", data_type: TYPE_FP32, dims: [ 1 ] } ]
        output [ { name: "B", data_type: TYPE_FP32, dims: [ 1 ] } ]
        ensemble_scheduling { step [ {
          model_name: "../outside/probe" model_version: -1
          input_map { key: "IN" value: "A" } output_map { key: "OUT" value: "B" }
        } ] }
        """,
        {},
    )
    server = serve(repo, strict_readiness=False)
    assert "ensemble_scheduling.step[0].model_name" in server.server.failed_models["ens"]
    assert "not a valid model name" in server.server.failed_models["ens"]
    assert not marker.exists()


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("resnet50", None),
        ("résumé-v2_1.0", None),
        ("a..b", "'..'"),
        ("a/b", "path separator"),
        ("/abs", "path separator"),
        ("C:\\x", "path separator"),
        (".x", "starts with '.'"),
        ("", "empty"),
        ("\t ", "blank"),
        ("a\x7fb", "control"),
        ("é" * 128, "256 bytes"),
        ("e" * 255, None),
    ],
)
def test_name_rule(name, problem):
    found = names.name_problem(name)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


def test_shown_escapes_and_cuts():
    assert names.shown("a\nb\x00") == "a\\nb\\x00"
    assert names.shown("x" * 100) == "x" * 64 + "..."
