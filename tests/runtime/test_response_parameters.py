"""Response parameters a model sends, through tritonclient over gRPC (unary, stream, decoupled) and HTTP.

gRPC's InferParameter holds int64 or uint64: an integer from 2**63 to 2**64 - 1 goes as uint64_param
(as Triton sends one); one outside both fails its request with words naming the parameter, and a
stream carrying it answers that request with an error and goes on (its in-flight slot freed).
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from .conftest import Running, start_server, write_model  # type: ignore[import-not-found]

PARAMS_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

VALUES = {0: 7, 1: 2**63 + 1, 2: 2**64, 3: -(2**63) - 1, 4: 2**64 - 1, 5: -(2**63)}


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            pick = int(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()[0])
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", np.array([pick], np.int32))],
                parameters={"value": VALUES[pick], "flag": True, "word": "x"},
            ))
        return out
"""

PARAMS_CONFIG = """
name: "params"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
"""

DECOUPLED_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            sender.send(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", np.array([1], np.int32))], parameters={"value": 2**64}
            ))
            sender.send(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", np.array([2], np.int32))], parameters={"value": 2**63}
            ), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

DECOUPLED_CONFIG = """
name: "decoupled_params"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
"""

TOO_BIG = "parameter 'value' is 18446744073709551616, which no gRPC parameter holds"
TOO_SMALL = "parameter 'value' is -9223372036854775809, which no gRPC parameter holds"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    repo = tmp_path_factory.mktemp("params") / "repo"
    write_model(repo, "params", PARAMS_CONFIG, {"model.py": PARAMS_PY})
    write_model(repo, "decoupled_params", DECOUPLED_CONFIG, {"model.py": DECOUPLED_PY})
    handle = start_server(repo)
    yield handle
    handle.stop()


def pick(mod: Any, value: int) -> list[Any]:
    tensor = mod.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([value], np.int32))
    return [tensor]


def chosen(parameter: Any) -> tuple[str, Any]:
    which = parameter.WhichOneof("parameter_choice")
    return which, getattr(parameter, which)


@pytest.mark.parametrize(
    ("index", "expected"),
    [(0, ("int64_param", 7)), (1, ("uint64_param", 2**63 + 1)), (4, ("uint64_param", 2**64 - 1)),
     (5, ("int64_param", -(2**63)))],
)  # fmt: skip
def test_integer_parameters_take_the_grpc_type_that_holds_them(
    server: Running, index: int, expected: tuple[str, int]
) -> None:
    client = grpcclient.InferenceServerClient(server.grpc)
    response = client.infer("params", pick(grpcclient, index)).get_response()
    assert chosen(response.parameters["value"]) == expected
    assert chosen(response.parameters["flag"]) == ("bool_param", True)
    assert chosen(response.parameters["word"]) == ("string_param", "x")


@pytest.mark.parametrize(("index", "words"), [(2, TOO_BIG), (3, TOO_SMALL)])
def test_an_integer_no_grpc_parameter_holds_fails_its_request_naming_it(
    server: Running, index: int, words: str
) -> None:
    client = grpcclient.InferenceServerClient(server.grpc)
    with pytest.raises(InferenceServerException, match="integers must lie in") as caught:
        client.infer("params", pick(grpcclient, index))
    assert words in caught.value.message()
    assert client.infer("params", pick(grpcclient, 0)).as_numpy("OUT").tolist() == [0]  # still serving
    # HTTP's JSON carries any integer
    http = httpclient.InferenceServerClient(server.http)
    assert http.infer("params", pick(httpclient, index)).get_response()["parameters"]["value"] == [2**64, -(2**63) - 1][
        index - 2
    ]


def test_a_stream_answers_the_bad_request_with_an_error_and_goes_on(server: Running) -> None:
    """More bad requests than a stream holds in flight (64): each answered, none holding its slot."""
    client = grpcclient.InferenceServerClient(server.grpc)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for n in range(100):
            client.async_stream_infer("params", pick(grpcclient, 2), request_id=f"bad{n}")
        client.async_stream_infer("params", pick(grpcclient, 1), request_id="good")
        errors, good = 0, None
        for _ in range(101):
            result, error = answers.get(timeout=30)
            if error is not None:
                assert TOO_BIG in str(error)
                errors += 1
            else:
                good = result
        assert errors == 100
        assert good is not None and good.get_response().id == "good"
        assert chosen(good.get_response().parameters["value"]) == ("uint64_param", 2**63 + 1)
    finally:
        client.stop_stream()


def test_a_decoupled_response_that_cannot_be_encoded_still_lets_the_request_end(server: Running) -> None:
    client = grpcclient.InferenceServerClient(server.grpc)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer("decoupled_params", pick(grpcclient, 0), request_id="d1")
        first_result, first_error = answers.get(timeout=30)
        assert first_result is None and TOO_BIG in str(first_error)
        last, error = answers.get(timeout=30)
        assert error is None
        response = last.get_response()
        assert response.id == "d1" and last.as_numpy("OUT").tolist() == [2]
        assert chosen(response.parameters["value"]) == ("uint64_param", 2**63)
        assert chosen(response.parameters["triton_final_response"]) == ("bool_param", True)
    finally:
        client.stop_stream()
