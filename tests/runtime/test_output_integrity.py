"""What a client gets is what the model answered for its request, whatever models do with their
arrays afterwards: a Python model refilling one output buffer on every execute, an ensemble step
writing into its input, both behind the response cache; an empty list of requested outputs; output
``reshape`` in every backend (Triton applies it in the core). Real server, tritonclient."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from .conftest import write_model  # type: ignore[import-not-found]

REUSE_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.buffer = np.zeros(2, np.float32)  # one output buffer, refilled by every execute

    def execute(self, requests):
        out = []
        for r in requests:
            np.multiply(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy(), 10, out=self.buffer)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", self.buffer)]))
        return out
"""

PLUS_ONE_PY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() + 1)]) for r in requests]
"""

IN_PLACE_PY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            if not x.flags.writeable:  # inputs come read-only: a model that scales in place copies first
                x = x.copy()
            x *= 100
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
        return out
"""

HALF_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().astype(np.float16))]) for r in requests]
"""

RESHAPE_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.arange(4, dtype=np.float32).reshape(2, 2))])
                for r in requests]
"""


def python_config(name: str, *, cache: bool = False, out_dims: str = "[ 2 ]", extra: str = "") -> str:
    return f"""
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "IN", data_type: TYPE_FP32, dims: [ 2 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_FP32, dims: {out_dims} {extra} }} ]
{"response_cache { enable: true }" if cache else ""}
"""


CHAIN = """
name: "chain"
platform: "ensemble"
max_batch_size: 0
input [ { name: "X", data_type: TYPE_FP32, dims: [ 2 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 2 ] }, { name: "MID", data_type: TYPE_FP32, dims: [ 2 ] } ]
ensemble_scheduling { step [
  { model_name: "plus_one" input_map { key: "IN" value: "X" } output_map { key: "OUT" value: "MID" } },
  { model_name: "in_place" input_map { key: "IN" value: "MID" } output_map { key: "OUT" value: "Y" } }
] }
"""


def onnx_identity_3x4() -> bytes:
    """OUT = IN reshaped to [batch, n, 2, 2] (IN is [batch, n, 4]): the model's own output shape."""
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["IN", "shape"], ["OUT"])],
        "reshaped",
        [helper.make_tensor_value_info("IN", TensorProto.FLOAT, ["b", "n", 4])],
        [helper.make_tensor_value_info("OUT", TensorProto.FLOAT, ["b", "n", 2, 2])],
        [helper.make_tensor("shape", TensorProto.INT64, [4], [0, 0, 2, 2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString() if not hasattr(onnx, "_serialize") else onnx._serialize(model)


ONNX_RESHAPE = """
name: "onnx_reshape"
backend: "onnxruntime"
max_batch_size: 4
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1, 4 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1, 4 ] reshape { shape: [ -1, 2, 2 ] } } ]
"""


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    write_model(root, "reuse", python_config("reuse", cache=True), {"model.py": REUSE_PY})
    write_model(root, "plus_one", python_config("plus_one", cache=True), {"model.py": PLUS_ONE_PY})
    write_model(root, "in_place", python_config("in_place"), {"model.py": IN_PLACE_PY})
    half = python_config("half", cache=True).replace('"OUT", data_type: TYPE_FP32', '"OUT", data_type: TYPE_FP16')
    write_model(root, "half", half, {"model.py": HALF_PY})
    write_model(root, "chain", CHAIN, {})
    write_model(root, "py_reshape", python_config("py_reshape", out_dims="[ 4 ]", extra="reshape { shape: [ 2, 2 ] }"),
                {"model.py": RESHAPE_PY})
    write_model(root, "onnx_reshape", ONNX_RESHAPE, {"model.onnx": onnx_identity_3x4()})
    return root


def infer(client: httpclient.InferenceServerClient, model: str, values: list[float], outputs=None):
    tensor = httpclient.InferInput("X" if model == "chain" else "IN", [2], "FP32")
    tensor.set_data_from_numpy(np.array(values, np.float32))
    return client.infer(model, [tensor], outputs=outputs)


def test_a_model_refilling_its_output_buffer_does_not_change_cached_answers(serve, repo):
    client = httpclient.InferenceServerClient(serve(repo).http)
    assert infer(client, "reuse", [1, 2]).as_numpy("OUT").tolist() == [10, 20]
    assert infer(client, "reuse", [3, 4]).as_numpy("OUT").tolist() == [30, 40]
    assert infer(client, "reuse", [1, 2]).as_numpy("OUT").tolist() == [10, 20]  # a hit: its own answer
    client.close()


def test_an_ensemble_step_writing_into_its_input_changes_neither_the_answer_nor_the_cache(serve, repo):
    client = httpclient.InferenceServerClient(serve(repo).http)
    for _ in range(2):  # the second time plus_one's answer comes from its cache
        result = infer(client, "chain", [1, 2])
        assert result.as_numpy("MID").tolist() == [2, 3] and result.as_numpy("Y").tolist() == [200, 300]
    assert infer(client, "plus_one", [1, 2]).as_numpy("OUT").tolist() == [2, 3]
    client.close()


def test_an_empty_list_of_requested_outputs_means_every_output_also_on_a_hit_and_for_ensembles(serve, repo):
    server = serve(repo)
    client = httpclient.InferenceServerClient(server.http)
    for model, names in (("plus_one", {"OUT"}), ("plus_one", {"OUT"}), ("chain", {"Y", "MID"})):  # miss, hit
        body = json.dumps({"inputs": [{"name": "X" if model == "chain" else "IN", "datatype": "FP32", "shape": [2],
                                       "data": [1, 2]}], "outputs": []}).encode()
        request = urllib.request.Request(f"http://{server.http}/v2/models/{model}/infer", data=body, method="POST")
        with urllib.request.urlopen(request) as response:
            answer = json.loads(response.read())
        assert {o["name"] for o in answer["outputs"]} == names, answer
    client.close()


def test_output_reshape_is_applied_in_every_backend(serve, repo):
    server = serve(repo)
    client = httpclient.InferenceServerClient(server.http)
    assert infer(client, "py_reshape", [0, 0]).as_numpy("OUT").shape == (4,)  # dims, not the model's [2, 2]
    grpc = grpcclient.InferenceServerClient(server.grpc)
    tensor = grpcclient.InferInput("IN", [1, 3, 4], "FP32")
    data = np.arange(12, dtype=np.float32).reshape(1, 3, 4)
    tensor.set_data_from_numpy(data)
    out = grpc.infer("onnx_reshape", [tensor]).as_numpy("OUT")
    assert out.shape == (1, 3, 4) and out.tolist() == data.tolist()  # the -1 of dims from the model's -1
    grpc.close()
    client.close()


def test_a_bad_classification_request_on_a_cache_hit_is_counted_as_a_failure(serve, repo):
    client = httpclient.InferenceServerClient(serve(repo).http)
    infer(client, "half", [1, 2])  # stored
    before = client.get_inference_statistics("half")["model_stats"][0]["inference_stats"]
    asked = [httpclient.InferRequestedOutput("OUT", class_count=1)]  # FP16 cannot be ranked
    with pytest.raises(InferenceServerException, match="unsupported type 'FP16'"):
        infer(client, "half", [1, 2], outputs=asked)
    after = client.get_inference_statistics("half")["model_stats"][0]["inference_stats"]
    assert after["fail"]["count"] == before["fail"]["count"] + 1
    assert after["success"]["count"] == before["success"]["count"]
    assert after["cache_hit"]["count"] == before["cache_hit"]["count"]
    client.close()


@pytest.mark.parametrize(
    ("produced", "dims", "reshape", "batched", "expected"),
    [
        ((2, 3, 2, 2), (-1, 4), (-1, 2, 2), True, (2, 3, 4)),  # the -1 of dims from the model's -1
        ((2, 2), (4,), (2, 2), False, (4,)),
        ((5, 4), (2, 2), (4,), True, (5, 2, 2)),
        ((1, 6), (-1, 2), (6,), True, (1, 3, 2)),  # no -1 in reshape: the element count decides
        ((1, 3, 2), (-1, 4), (-1, 2, 2), True, None),  # not the reshape's rank
        ((1, 3, 3, 2), (-1, 4), (-1, 2, 2), True, None),  # a fixed dim differs
    ],
)
def test_client_shape_follows_triton_s_output_reshape(produced, dims, reshape, batched, expected):
    from sluice.runtime.backends.base import client_shape

    assert client_shape(produced, dims, reshape, batched) == expected
