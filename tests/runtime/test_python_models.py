"""Triton ``model.py`` idioms served through the real server and called with tritonclient.

Each model here is written the way Triton's python_backend examples write them (DLPack to torch,
``auto_complete_config``); the test checks what a client gets back over HTTP and gRPC.
"""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from .conftest import EXPLICIT, write_model  # type: ignore[import-not-found]

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


# -- auto_complete_config -----------------------------------------------------------------------

AUTO_COMPLETE_PY = """
import json

import triton_python_backend_utils as pb_utils

TENSORS = {
    "input": [
        {"name": "A", "data_type": "TYPE_FP32", "dims": [3]},
        {"name": "B", "data_type": "TYPE_FP32", "dims": [3]},
    ],
    "output": [{"name": "SUM", "data_type": "TYPE_FP32", "dims": [3]}],
}


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        config = auto_complete_model_config
        present = config.as_dict()
        for section, add in (("input", config.add_input), ("output", config.add_output)):
            known = {entry["name"] for entry in present[section]}
            for tensor in TENSORS[section]:
                if tensor["name"] not in known:
                    add(tensor)
        auto_complete_model_config.set_max_batch_size(8)
        auto_complete_model_config.set_dynamic_batching()
        auto_complete_model_config.set_model_transaction_policy({"decoupled": False})
        return auto_complete_model_config

    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.dtype = pb_utils.triton_string_to_numpy(pb_utils.get_output_config_by_name(config, "SUM")["data_type"])

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "A").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "B").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("SUM", (a + b).astype(self.dtype))]))
        return responses
"""

CONFLICTING_PY = """
class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        auto_complete_model_config.add_input({"name": "A", "data_type": "TYPE_INT32", "dims": [3]})
        return auto_complete_model_config

    def execute(self, requests):
        return []
"""


@pytest.fixture(scope="module")
def auto_server(tmp_path_factory: pytest.TempPathFactory):
    from .conftest import start_server  # type: ignore[import-not-found]

    repo = tmp_path_factory.mktemp("auto_complete") / "repo"
    # a config with nothing but the backend, as in Triton's auto_complete example
    write_model(repo, "auto", 'name: "auto"\nbackend: "python"\n', {"model.py": AUTO_COMPLETE_PY})
    write_model(
        repo,
        "conflict",
        'name: "conflict"\nbackend: "python"\ninput [ { name: "A", data_type: TYPE_FP32, dims: [ 3 ] } ]\n',
        {"model.py": CONFLICTING_PY},
    )
    handle = start_server(repo, **EXPLICIT)
    yield handle
    handle.stop()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_auto_complete_config_completes_the_served_config(auto_server, protocol: str) -> None:
    client_module = CLIENTS[protocol]
    client = client_module.InferenceServerClient(url(auto_server, protocol))
    if protocol == "grpc":
        config = client.get_model_config("auto", as_json=True)["config"]
    else:
        config = client.get_model_config("auto")

    assert int(config["max_batch_size"]) == 8
    assert "dynamic_batching" in config
    assert [(t["name"], t["data_type"], [int(d) for d in t["dims"]]) for t in config["input"]] == [
        ("A", "TYPE_FP32", [3]),
        ("B", "TYPE_FP32", [3]),
    ]
    assert [t["name"] for t in config["output"]] == ["SUM"]
    a = client_module.InferInput("A", [2, 3], "FP32")
    a.set_data_from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
    b = client_module.InferInput("B", [2, 3], "FP32")
    b.set_data_from_numpy(np.ones((2, 3), np.float32))

    result = client.infer("auto", [a, b])  # a batch of 2: the completed max_batch_size is in force

    assert result.as_numpy("SUM").tolist() == (np.arange(6).reshape(2, 3) + 1).tolist()


def test_auto_complete_config_conflict_fails_the_load_in_tritons_words(auto_server) -> None:
    client = httpclient.InferenceServerClient(auto_server.http)
    with pytest.raises(InferenceServerException) as caught:
        client.load_model("conflict")

    message = str(caught.value)
    assert (
        "unable to load model 'conflict', configuration expects datatype TYPE_FP32 for input 'A', "
        "model provides TYPE_INT32"
    ) in message
    assert "auto_complete_config raised ValueError" in message
    assert str(auto_server.server.settings.model_repository) not in message
