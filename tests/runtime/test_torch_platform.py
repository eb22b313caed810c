"""``backend: "python"`` + ``platform: "pytorch"``: Triton's PyTorch platform handler (NVIDIA's
``examples/pytorch_platform_handler`` layout): a plain ``torch.nn.Module`` in ``model.py`` with its
weights in ``model.pt``, or a TorchScript ``model.pt``, served through tritonclient over HTTP and gRPC.
Models are built here; nothing binary is committed."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from sluice.runtime.backends import python as python_backend
from sluice.runtime.backends.base import LoadContext
from sluice.runtime.config import parse_config
from sluice.runtime.types import InferRequest, InferResponse, Tensor

torch = pytest.importorskip("torch", reason="the PyTorch platform handler needs torch (the torch extra)")

MODEL_PY = """
import torch
from torch.nn import Identity  # imported, and first by name: not the model


class Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4))

    def forward(self, x, y):
        return x * self.weight, x + y
"""

CONFIG = """
name: "{name}"
backend: "python"
platform: "pytorch"
max_batch_size: 8
input [ {{ name: "x", data_type: TYPE_FP32, dims: [ 4 ] }}, {{ name: "y", data_type: TYPE_FP32, dims: [ 4 ] }} ]
output [ {{ name: "scaled", data_type: TYPE_FP32, dims: [ 4 ] }}, {{ name: "sum", data_type: TYPE_FP32, dims: [ 4 ] }} ]
parameters {{ key: "TORCH_COMPILE_OPTIONAL_PARAMETERS" value {{ string_value: '{compile}' }} }}
"""

WEIGHT = [1.0, 2.0, 3.0, 4.0]


class Scripted(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 10, x - y


def _model(repo: Path, name: str, files: dict[str, str | bytes | None], compile_options: str = '{"backend": "eager"}'):
    version_dir = repo / name / "1"
    version_dir.mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(textwrap.dedent(CONFIG.format(name=name, compile=compile_options)))
    for file, content in files.items():
        if isinstance(content, str):
            (version_dir / file).write_text(textwrap.dedent(content))
        elif content is None:  # the weights of MODEL_PY's Scale
            torch.save({"weight": torch.tensor(WEIGHT)}, version_dir / file)
        else:
            (version_dir / file).write_bytes(content)
    return LoadContext(name, 1, repo / name, version_dir, repo)


def _infer(module, client, model: str, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    inputs = [module.InferInput("x", list(x.shape), "FP32"), module.InferInput("y", list(y.shape), "FP32")]
    inputs[0].set_data_from_numpy(x)
    inputs[1].set_data_from_numpy(y)
    result = client.infer(model, inputs)
    return result.as_numpy("scaled"), result.as_numpy("sum")


def test_a_module_in_model_py_and_a_torchscript_file_serve_over_http_and_grpc(tmp_path, serve) -> None:
    repo = tmp_path / "repo"
    _model(repo, "module", {"model.py": MODEL_PY, "model.pt": None})
    scripted = repo / "scripted.pt"
    torch.jit.save(torch.jit.script(Scripted()), scripted)
    _model(repo, "script", {"model.pt": scripted.read_bytes()})
    server = serve(repo)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    y = np.ones((2, 4), np.float32)
    for module, url in ((httpclient, server.http), (grpcclient, server.grpc)):
        client = module.InferenceServerClient(url)
        scaled, summed = _infer(module, client, "module", x, y)
        np.testing.assert_array_equal(scaled, x * np.array(WEIGHT, np.float32))  # the weights of model.pt
        np.testing.assert_array_equal(summed, x + y)
        scaled, diff = _infer(module, client, "script", x, y)
        np.testing.assert_array_equal(scaled, x * 10)
        np.testing.assert_array_equal(diff, x - y)


def test_a_batch_of_requests_gives_each_its_own_rows(tmp_path) -> None:
    ctx = _model(tmp_path, "module", {"model.py": MODEL_PY, "model.pt": None})
    config = parse_config((ctx.model_dir / "config.pbtxt").read_text(), path="c", fmt="pbtxt")
    instance = python_backend.load(config, ctx).new_instance(0, mc.ModelInstanceGroup.KIND_CPU, 0)
    rows = [np.full((n, 4), n, np.float32) for n in (1, 3, 2)]
    requests = [
        InferRequest("module", "1", [Tensor("x", "FP32", r), Tensor("y", "FP32", -r)], batch_size=len(r)) for r in rows
    ]
    results = instance.execute(requests)
    for r, result in zip(rows, results, strict=True):
        assert isinstance(result, InferResponse), result
        outputs = {t.name: t.data for t in result.outputs}
        np.testing.assert_array_equal(outputs["scaled"], r * np.array(WEIGHT, np.float32))
        np.testing.assert_array_equal(outputs["sum"], np.zeros_like(r))
    instance.close()


@pytest.mark.parametrize(
    ("files", "compile_options", "words"),
    [
        ({"model.py": "VALUE = 1\n"}, '{"backend": "eager"}', "Cannot find a subclass of torch.nn.Module"),
        ({"other.py": "x = 1\n"}, '{"backend": "eager"}', "loads one of model.py, model.pt"),
        ({"model.py": MODEL_PY}, '{"model": 1}', "'model' is not an optional parameter for 'torch.compile'"),
        ({"model.py": MODEL_PY}, "[1]", "must be a JSON object of torch.compile arguments"),
    ],
)
def test_what_cannot_load_is_refused_with_the_reason(tmp_path, serve, files, compile_options, words) -> None:
    repo = tmp_path / "repo"
    _model(repo, "broken", files, compile_options)
    server = serve(repo, strict_readiness=False)
    client = httpclient.InferenceServerClient(server.http)
    assert not client.is_model_ready("broken")
    reason = {m["name"]: m for m in client.get_model_repository_index()}["broken"].get("reason", "")
    assert words in reason and str(tmp_path) not in reason, reason


def test_another_platform_under_the_python_backend_names_what_is_allowed(tmp_path, serve) -> None:
    repo = tmp_path / "repo"
    _model(repo, "tf", {"model.py": MODEL_PY})
    config = repo / "tf" / "config.pbtxt"
    config.write_text(config.read_text().replace('platform: "pytorch"', 'platform: "tensorflow_savedmodel"'))
    server = serve(repo, strict_readiness=False)
    client = httpclient.InferenceServerClient(server.http)
    reason = {m["name"]: m for m in client.get_model_repository_index()}["tf"].get("reason", "")
    assert "platform 'tensorflow_savedmodel' does not match backend 'python'" in reason, reason
    assert "allowed: 'pytorch' (Triton's PyTorch platform handler) or no platform" in reason
    with pytest.raises(InferenceServerException):
        _infer(httpclient, client, "tf", np.zeros((1, 4), np.float32), np.zeros((1, 4), np.float32))
