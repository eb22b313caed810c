"""A Python model's TritonError or exception reaches the client with its message; the model keeps serving."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from .conftest import write_model  # type: ignore[import-not-found]

MODEL_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if x[0, 0] < 0:
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("negative input: " + str(x[0, 0]))))
                continue
            if x[0, 0] == 13:
                raise ValueError("unlucky number")
            if x[0, 0] == 99:
                raise SystemExit("model code called exit")
            out.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUT", x * 2)]))
        return out
"""

CONFIG = """
name: "fragile"
backend: "python"
max_batch_size: 4
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from .conftest import start_server  # type: ignore[import-not-found]

    repo = tmp_path_factory.mktemp("errors") / "repo"
    write_model(repo, "fragile", CONFIG, {"model.py": MODEL_PY})
    handle = start_server(repo)
    yield handle
    handle.stop()


def call(server, protocol: str, value: float):
    mod = httpclient if protocol == "http" else grpcclient
    client = mod.InferenceServerClient(server.http if protocol == "http" else server.grpc)
    inp = mod.InferInput("IN", [1, 1], "FP32")
    inp.set_data_from_numpy(np.array([[value]], dtype=np.float32))
    try:
        return client.infer("fragile", [inp]).as_numpy("OUT")
    finally:
        client.close()


@pytest.mark.parametrize(("protocol", "status"), [("http", "500"), ("grpc", "StatusCode.INTERNAL")])
def test_model_errors_reach_the_client_and_the_model_keeps_serving(server, protocol, status):
    with pytest.raises(InferenceServerException) as info:
        call(server, protocol, -2.0)
    assert "negative input: -2.0" in str(info.value)  # the model's text as-is
    assert str(info.value.status()) == status
    with pytest.raises(InferenceServerException) as info:
        call(server, protocol, 13.0)
    assert "Failed to process the request(s) for model instance 'fragile_0_0'" in str(info.value)
    assert "ValueError: unlucky number" in str(info.value)
    with pytest.raises(InferenceServerException, match="SystemExit: model code called exit"):
        call(server, protocol, 99.0)
    np.testing.assert_array_equal(call(server, protocol, 3.0), [[6.0]])
