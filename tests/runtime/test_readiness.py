"""Honest readiness: strict by default, a failed model is not an unknown one, loads are atomic.

Kubernetes reads ``/v2/health/ready``: a pod whose only model failed to load must not receive
traffic, and a client calling that model must learn why (503 with the load error), not 404.
A load refused for a bad config value opens nothing, leaks nothing, and leaves the version that
was serving in place.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from .conftest import ADD_SUB_CONFIG, BUILDERS, EXPLICIT, write_model  # type: ignore[import-not-found]

BROKEN_CONFIG = 'name: "broken"\nbackend: "onnxruntime"\nmax_batch_size: 0\n'

MARKING_PY = """
import os
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.marks = os.path.join(os.path.dirname(__file__), "marks")
        self._mark("initialize " + args["model_version"])

    def _mark(self, what):
        with open(self.marks, "a") as f:
            f.write(what + "\\n")

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([float(self.version)], dtype=np.float32))])
            for _ in requests
        ]

    def finalize(self):
        self._mark("finalize")
"""

MARKING_CONFIG = """
name: "marking"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]
"""


def repo_with_broken(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    write_model(repo, "broken", BROKEN_CONFIG, {"model.onnx": b"this is not an onnx file"})
    return repo


def add_sub_inputs(module):
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = module.InferInput(name, [16], "FP32")
        tensor.set_data_from_numpy(np.ones(16, dtype=np.float32))
        inputs.append(tensor)
    return inputs


def test_strict_readiness_is_the_default_and_follows_every_model_found_at_start(serve, tmp_path):
    repo = repo_with_broken(tmp_path)
    server = serve(repo, **EXPLICIT)
    http = httpclient.InferenceServerClient(server.http)
    grpc = grpcclient.InferenceServerClient(server.grpc)
    assert http.is_server_live() and grpc.is_server_live()
    assert not http.is_server_ready() and not grpc.is_server_ready()
    assert http.is_model_ready("add_sub")  # the others serve
    assert "broken" in server.server.failed_models
    # the model is fixed and loaded: the server becomes ready without a restart
    write_model(repo, "broken", BROKEN_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    (repo / "broken" / "config.pbtxt").write_text(ADD_SUB_CONFIG.replace("add_sub", "broken"))
    http.load_model("broken")
    assert http.is_server_ready() and grpc.is_server_ready()


def test_unloading_the_failed_model_makes_the_server_ready(serve, tmp_path):
    server = serve(repo_with_broken(tmp_path), **EXPLICIT)
    http = httpclient.InferenceServerClient(server.http)
    assert not http.is_server_ready()
    http.unload_model("broken")  # the operator asked to stop serving it: it is no longer expected
    assert http.is_server_ready()


def test_strict_readiness_false_is_ready_once_startup_loads_are_done(serve, tmp_path):
    server = serve(repo_with_broken(tmp_path), strict_readiness=False)
    assert httpclient.InferenceServerClient(server.http).is_server_ready()


def test_a_failed_model_answers_503_with_its_load_error_not_404(serve, tmp_path):
    server = serve(repo_with_broken(tmp_path), strict_readiness=False)
    http = httpclient.InferenceServerClient(server.http)
    grpc = grpcclient.InferenceServerClient(server.grpc)
    for call in (
        lambda: http.infer("broken", add_sub_inputs(httpclient)),
        lambda: http.get_model_metadata("broken"),
        lambda: http.get_model_config("broken"),
    ):
        with pytest.raises(InferenceServerException) as info:
            call()
        assert info.value.status() == "503", info.value
        assert "failed to load 'broken'" in info.value.message()
        assert str(tmp_path) not in info.value.message()
    for call in (
        lambda: grpc.infer("broken", add_sub_inputs(grpcclient)),
        lambda: grpc.get_model_metadata("broken"),
    ):
        with pytest.raises(InferenceServerException) as info:
            call()
        assert info.value.status() == "StatusCode.UNAVAILABLE", info.value
        assert "failed to load 'broken'" in info.value.message()
    # a model that does not exist is still unknown
    with pytest.raises(InferenceServerException) as info:
        http.get_model_metadata("nope")
    assert info.value.status() == "404"
    assert "Request for unknown model: 'nope'" in info.value.message()


def test_a_failed_load_of_a_model_not_in_the_repository_leaves_no_index_row(serve, tmp_path):
    server = serve(repo_with_broken(tmp_path), strict_readiness=False, **EXPLICIT)
    http = httpclient.InferenceServerClient(server.http)
    with pytest.raises(InferenceServerException) as info:
        http.load_model("nope")
    assert "failed to load 'nope'" in info.value.message()
    assert "failed to poll from model repository" in info.value.message()
    assert str(tmp_path) not in info.value.message()
    assert "nope" not in {row["name"] for row in http.get_model_repository_index()}
    with pytest.raises(InferenceServerException) as info:
        http.infer("nope", add_sub_inputs(httpclient))
    assert info.value.status() == "404"


def test_an_invalid_config_override_uses_tritons_load_wording(serve, tmp_path):
    server = serve(repo_with_broken(tmp_path), strict_readiness=False, **EXPLICIT)
    client = grpcclient.InferenceServerClient(server.grpc)
    with pytest.raises(InferenceServerException) as info:
        client.load_model("add_sub", config='{"max_batch_size": "many"}')
    assert info.value.message().startswith("failed to load 'add_sub'"), info.value.message()
    assert client.is_model_ready("add_sub")  # the serving version stays


@pytest.mark.parametrize(
    ("parameter", "value", "allowed"),
    [
        ("batch_policy", "fastest", "work_conserving"),
        ("overload_control", "maybe", "'on' or 'off'"),
        ("response_cache_bytes", "-5", "positive integer"),
    ],
)
def test_a_bad_parameter_is_refused_before_any_side_effect_and_the_old_version_serves(
    serve, tmp_path, parameter, value, allowed
):
    repo = tmp_path / "repo"
    model_dir = write_model(repo, "marking", MARKING_CONFIG, {"model.py": MARKING_PY})
    marks = model_dir / "1" / "marks"
    server = serve(repo, **EXPLICIT)
    client = httpclient.InferenceServerClient(server.http)
    assert marks.read_text().splitlines() == ["initialize 1"]
    def model_threads() -> set[str]:  # the schedulers' workers are named after the model
        return {t.name for t in threading.enumerate() if t.name.startswith("sluice-marking")}

    threads_before = model_threads()
    bad = json.dumps(
        {
            "backend": "python",
            "max_batch_size": 0,
            "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [1]}],
            "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [1]}],
            "response_cache": {"enable": True},
            "parameters": {parameter: {"string_value": value}},
        }
    )
    with pytest.raises(InferenceServerException) as info:
        client.load_model("marking", config=bad)
    assert info.value.status() == "400"
    assert f"parameters[{parameter}]" in info.value.message() and allowed in info.value.message()
    assert info.value.message().startswith("failed to load 'marking'")
    # nothing was initialized, no thread was left behind, the model is READY (not LOADING forever)
    assert marks.read_text().splitlines() == ["initialize 1"]
    assert model_threads() == threads_before and threads_before
    assert client.is_model_ready("marking")
    index = {row["name"]: row for row in client.get_model_repository_index()}
    assert index["marking"]["state"] == "READY"
    assert client.is_server_ready()


def test_a_relative_repository_path_is_not_rewritten_inside_model_names(serve, tmp_path, monkeypatch):
    """Only the server's absolute paths are taken out of messages; 'repo' inside a name stays."""
    write_model(tmp_path / "repo", "repo_model", BROKEN_CONFIG.replace("broken", "repo_model"), {"model.onnx": b"x"})
    monkeypatch.chdir(tmp_path)
    server = serve(Path("repo"), strict_readiness=False, **EXPLICIT)
    message = server.server.failed_models["repo_model"]
    assert message.startswith("failed to load 'repo_model'"), message
    assert "repo_model/1/model.onnx" in message and str(tmp_path) not in message
