"""Triton ``model.py`` idioms served through the real server and called with tritonclient.

Each model here is written the way Triton's python_backend examples write them (DLPack to torch,
``auto_complete_config``); the test checks what a client gets back over HTTP and gRPC.
"""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from .conftest import write_model  # type: ignore[import-not-found]

CLIENTS = {"http": httpclient, "grpc": grpcclient}

DLPACK_TORCH_PY = """
import torch
import torch.utils.dlpack
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            source = pb_utils.get_input_tensor_by_name(request, "IN")
            as_torch = torch.utils.dlpack.from_dlpack(source.to_dlpack())
            as_torch.mul_(2)  # in place: must not write through into the request's bytes
            out = pb_utils.Tensor.from_dlpack("OUT", torch.utils.dlpack.to_dlpack(as_torch + 1))
            responses.append(pb_utils.InferenceResponse([out]))
        return responses
"""

DLPACK_CONFIG = """
name: "dlpack_torch"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]
"""


def url(server, protocol: str) -> str:
    return server.http if protocol == "http" else server.grpc


@pytest.fixture(scope="module")
def models_server(tmp_path_factory: pytest.TempPathFactory):
    from .conftest import start_server  # type: ignore[import-not-found]

    repo = tmp_path_factory.mktemp("python_models") / "repo"
    write_model(repo, "dlpack_torch", DLPACK_CONFIG, {"model.py": DLPACK_TORCH_PY})
    handle = start_server(repo)
    yield handle
    handle.stop()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_input_to_dlpack_reaches_torch(models_server, protocol: str) -> None:
    client_module = CLIENTS[protocol]
    client = client_module.InferenceServerClient(url(models_server, protocol))
    data = np.arange(6, dtype=np.float32)
    tensor = client_module.InferInput("IN", [6], "FP32")
    tensor.set_data_from_numpy(data)

    for _ in range(2):  # the same request twice: the first one must not have changed anything shared
        result = client.infer("dlpack_torch", [tensor])
        assert result.as_numpy("OUT").tolist() == (data * 2 + 1).tolist()
