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
    assert "Failed to process the request(s) for model instance 'fragile_0'" in str(info.value)
    assert "ValueError: unlucky number" in str(info.value)
    with pytest.raises(InferenceServerException, match="SystemExit: model code called exit"):
        call(server, protocol, 99.0)
    np.testing.assert_array_equal(call(server, protocol, 3.0), [[6.0]])


CODED_PY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        codes = [int(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()[0, 0]) for r in requests]
        return [pb_utils.InferenceResponse(error=pb_utils.TritonError(f"code {code}", code)) for code in codes]
"""

CALLER_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN")
            answer = pb_utils.InferenceRequest(
                model_name="coded", requested_output_names=["OUT"], inputs=[pb_utils.Tensor("IN", x.as_numpy())]
            ).exec()
            error = answer.error()
            seen = np.array([[-1 if error is None else error.code()]], dtype=np.float32)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", seen)]))
        return out
"""

TRITON_CODES = [  # TritonError code -> (HTTP status, gRPC code), as Triton's front ends answer them
    (0, "400", "StatusCode.UNKNOWN"),
    (1, "500", "StatusCode.INTERNAL"),
    (2, "404", "StatusCode.NOT_FOUND"),
    (3, "400", "StatusCode.INVALID_ARGUMENT"),
    (4, "503", "StatusCode.UNAVAILABLE"),
    (5, "501", "StatusCode.UNIMPLEMENTED"),
    (6, "400", "StatusCode.ALREADY_EXISTS"),
    (7, "499", "StatusCode.CANCELLED"),
]


@pytest.mark.parametrize(("code", "http_status", "grpc_code"), TRITON_CODES)
def test_every_triton_error_code_keeps_its_status_and_survives_a_bls_call(
    tmp_path, serve, code, http_status, grpc_code
) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "coded", CONFIG.replace('"fragile"', '"coded"'), {"model.py": CODED_PY})
    write_model(repo, "caller", CONFIG.replace('"fragile"', '"caller"'), {"model.py": CALLER_PY})
    server = serve(repo)
    for mod, url, status in ((httpclient, server.http, http_status), (grpcclient, server.grpc, grpc_code)):
        client = mod.InferenceServerClient(url)
        inp = mod.InferInput("IN", [1, 1], "FP32")
        inp.set_data_from_numpy(np.array([[code]], dtype=np.float32))
        with pytest.raises(InferenceServerException) as caught:
            client.infer("coded", [inp])
        assert (str(caught.value.status()), caught.value.message()) == (status, f"code {code}")
        # a BLS caller sees the very code the called model sent (NVIDIA's bls_error_code example)
        assert client.infer("caller", [inp]).as_numpy("OUT")[0, 0] == code
