"""Triton compatibility of the request path, through tritonclient over HTTP and gRPC.

The models mirror the ones Triton's own QA tests use (``simple``: two INT32 [16] inputs, batching;
``input_all_required`` / ``input_optional`` / ``input_all_optional``: required and optional inputs),
and the expected messages are Triton's words, which clients and tests match on.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from .conftest import IDENTITY_PY, start_server, write_model  # type: ignore[import-not-found]

PROTOCOLS = ["http", "grpc"]

CONSTANT_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            given = [n for n in ("INPUT0", "INPUT1", "INPUT2", "INPUT3")
                     if pb_utils.get_input_tensor_by_name(request, n) is not None]
            value = np.array([float(len(given))], dtype=np.float32)
            out.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT0", value)]))
        return out
"""


RAW_BYTES_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        raw = np.array([b"text", b"\\xff\\xfe not utf-8"], dtype=np.object_)
        text = np.array([b"caf\\xc3\\xa9", b"ok"], dtype=np.object_)
        return [
            pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("RAW", raw), pb_utils.Tensor("TEXT", text)])
            for _ in requests
        ]
"""


def io_config(name: str, optional: list[bool]) -> str:
    inputs = ",\n".join(
        f'  {{ name: "INPUT{i}", data_type: TYPE_FP32, dims: [ 1 ], optional: {str(o).lower()} }}'
        for i, o in enumerate(optional)
    )
    return f"""
name: "{name}"
backend: "python"
max_batch_size: 0
input [
{inputs}
]
output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 1 ] }} ]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    repo: Path = tmp_path_factory.mktemp("compat") / "repo"
    write_model(
        repo,
        "simple",
        """
        name: "simple"
        backend: "python"
        max_batch_size: 8
        input [
          { name: "INPUT0", data_type: TYPE_INT32, dims: [ 16 ] },
          { name: "INPUT1", data_type: TYPE_INT32, dims: [ 16 ] }
        ]
        output [
          { name: "OUTPUT0", data_type: TYPE_INT32, dims: [ 16 ] },
          { name: "OUTPUT1", data_type: TYPE_INT32, dims: [ 16 ] }
        ]
        """,
        {"model.py": IDENTITY_PY},
    )
    write_model(
        repo,
        "simple_identity",
        """
        name: "simple_identity"
        backend: "python"
        max_batch_size: 8
        input [ { name: "INPUT0", data_type: TYPE_STRING, dims: [ -1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_STRING, dims: [ -1 ] } ]
        """,
        {"model.py": IDENTITY_PY},
    )
    write_model(
        repo,
        "raw_bytes",
        """
        name: "raw_bytes"
        backend: "python"
        max_batch_size: 0
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
        output [
          { name: "RAW", data_type: TYPE_STRING, dims: [ 2 ] },
          { name: "TEXT", data_type: TYPE_STRING, dims: [ 2 ] }
        ]
        """,
        {"model.py": RAW_BYTES_PY},
    )
    for name, optional in [
        ("input_all_required", [False] * 3),
        ("input_optional", [False, False, False, True]),
        ("input_all_optional", [True] * 3),
    ]:
        write_model(repo, name, io_config(name, optional), {"model.py": CONSTANT_PY})
    handle = start_server(repo)
    yield handle
    handle.stop()


def client_for(server, protocol: str):
    if protocol == "http":
        return httpclient, httpclient.InferenceServerClient(server.http)
    return grpcclient, grpcclient.InferenceServerClient(server.grpc)


def fp32_inputs(mod, names: list[str]) -> list:
    inputs = []
    for name in names:
        tensor = mod.InferInput(name, [1], "FP32")
        tensor.set_data_from_numpy(np.ones(1, np.float32))
        inputs.append(tensor)
    return inputs


def simple_inputs(mod, shape: list[int] | None = None, datatype: str = "INT32") -> list:
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = mod.InferInput(name, [1, 16], datatype)
        tensor.set_data_from_numpy(np.arange(16, dtype=np.int32 if datatype == "INT32" else np.float32)[None])
        if shape is not None:
            tensor.set_shape(shape)
        inputs.append(tensor)
    return inputs


def error_of(client, *args, **kwargs) -> str:
    with pytest.raises(InferenceServerException) as info:
        client.infer(*args, **kwargs)
    return str(info.value)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_duplicate_output_names_are_refused(server, protocol):
    mod, client = client_for(server, protocol)
    outputs = [mod.InferRequestedOutput("OUTPUT0"), mod.InferRequestedOutput("OUTPUT0")]
    message = error_of(client, "simple", simple_inputs(mod), outputs=outputs)
    assert "output 'OUTPUT0' already exists in request for model 'simple'" in message
    # a request asking for each output once still works
    result = client.infer("simple", simple_inputs(mod), outputs=[mod.InferRequestedOutput("OUTPUT0")])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.arange(16, dtype=np.int32)[None])


@pytest.mark.parametrize(
    ("model", "given", "expected"),
    [
        (
            "input_all_required",
            [],
            "expected 3 inputs but got 0 inputs for model 'input_all_required'. Got input(s) [], but missing "
            "required input(s) ['INPUT0','INPUT1','INPUT2']. Please provide all required input(s).",
        ),
        (
            "input_optional",
            [],
            "expected number of inputs between 3 and 4 but got 0 inputs for model 'input_optional'. Got input(s) [], "
            "but missing required input(s) ['INPUT0','INPUT1','INPUT2']. Please provide all required input(s).",
        ),
        (
            "input_all_required",
            ["INPUT0"],
            "expected 3 inputs but got 1 inputs for model 'input_all_required'. Got input(s) ['INPUT0'], but missing "
            "required input(s) ['INPUT1','INPUT2']. Please provide all required input(s).",
        ),
        (
            "input_optional",
            ["INPUT0"],
            "expected number of inputs between 3 and 4 but got 1 inputs for model 'input_optional'. Got input(s) "
            "['INPUT0'], but missing required input(s) ['INPUT1','INPUT2']. Please provide all required input(s).",
        ),
        (
            "input_optional",
            ["INPUT0", "INPUT1", "INPUT3"],  # the right count, but the optional input took a required one's place
            "expected number of inputs between 3 and 4 but got 3 inputs for model 'input_optional'. Got input(s) "
            "['INPUT0','INPUT1','INPUT3'], but missing required input(s) ['INPUT2']. Please provide all required "
            "input(s).",
        ),
    ],
    ids=["all-required-empty", "optional-empty", "all-required-missing", "optional-missing", "optional-in-place"],
)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_input_count_errors_use_tritons_words(server, protocol, model, given, expected):
    mod, client = client_for(server, protocol)
    assert expected in error_of(client, model, fp32_inputs(mod, given))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_unexpected_input_uses_tritons_words(server, protocol):
    mod, client = client_for(server, protocol)
    message = error_of(client, "input_all_required", fp32_inputs(mod, ["INPUT0", "INPUT1", "INPUT9"]))
    assert "unexpected inference input 'INPUT9' for model 'input_all_required'" in message
    too_many = fp32_inputs(mod, ["INPUT0", "INPUT1", "INPUT2", "INPUT3"])
    assert "expected 3 inputs but got 4 inputs for model 'input_all_required'" in error_of(
        client, "input_all_required", too_many
    )


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_no_inputs_accepted_when_every_input_is_optional(server, protocol):
    mod, client = client_for(server, protocol)
    result = client.infer("input_all_optional", [])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [0.0])
    result = client.infer("input_all_optional", fp32_inputs(mod, ["INPUT1"]))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [1.0])


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_shape_and_datatype_errors_use_tritons_words(server, protocol):
    mod, client = client_for(server, protocol)
    message = error_of(client, "simple", simple_inputs(mod, shape=[2, 8]))
    assert "unexpected shape for input 'INPUT0' for model 'simple'. Expected [-1,16], got [2,8]" in message
    assert "max_batch_size" in message  # Triton's note on the batch dimension
    message = error_of(client, "simple", simple_inputs(mod, datatype="FP32"))
    assert "inference input 'INPUT0' data-type is 'FP32', but model 'simple' expects 'INT32'" in message
    message = error_of(client, "simple", [*simple_inputs(mod)[:1], *simple_inputs(mod)[:1]])
    assert "input 'INPUT0' already exists in request" in message


@pytest.mark.parametrize(
    ("protocol", "binary"), [("http", True), ("http", False), ("grpc", True)], ids=["http-binary", "http-json", "grpc"]
)
def test_element_count_errors_use_tritons_words(server, protocol, binary):
    """Data for 16 elements sent with a shape of 8 (Triton's QA: fixed-size and BYTES inputs)."""
    mod, client = client_for(server, protocol)
    ints = simple_inputs(mod)
    for tensor in ints:
        if protocol == "http":
            tensor.set_data_from_numpy(np.arange(16, dtype=np.int32)[None], binary_data=binary)
        tensor.set_shape([1, 8])
    if protocol == "http":  # the gRPC codec's raw-content message is the gRPC side's
        assert "input 'INPUT0' got unexpected elements count 16, expected 8" in error_of(client, "simple", ints)
    for data in ([b"he\x00llo"] * 16, [b"\x00\x01\x02\x03"] * 16):
        tensor = mod.InferInput("INPUT0", [1, 16], "BYTES")
        array = np.array(data, dtype=np.object_).reshape(1, 16)
        if protocol == "http":
            tensor.set_data_from_numpy(array, binary_data=binary)
        else:
            tensor.set_data_from_numpy(array)
        tensor.set_shape([2, 8])  # the same 16 elements in another shape: fine
        result = client.infer("simple_identity", [tensor], outputs=[mod.InferRequestedOutput("OUTPUT0")])
        assert result.as_numpy("OUTPUT0").reshape(-1).tolist() == data
        tensor.set_shape([1, 8])
        message = error_of(client, "simple_identity", [tensor])
        assert "input 'INPUT0' got unexpected elements count 16, expected 8" in message


def test_non_utf8_bytes_asked_for_as_json_are_an_error_not_altered(server):
    client = httpclient.InferenceServerClient(server.http)
    inputs = fp32_inputs(httpclient, ["INPUT0"])
    as_json = [httpclient.InferRequestedOutput("RAW", binary_data=False)]
    message = error_of(client, "raw_bytes", inputs, outputs=as_json)
    assert "output 'RAW'" in message and "not valid UTF-8" in message and "binary_data" in message
    # asked for in binary form, the bytes come back exactly; valid text still comes back as JSON
    outputs = [
        httpclient.InferRequestedOutput("RAW", binary_data=True),
        httpclient.InferRequestedOutput("TEXT", binary_data=False),
    ]
    result = client.infer("raw_bytes", inputs, outputs=outputs)
    assert result.as_numpy("RAW").tolist() == [b"text", b"\xff\xfe not utf-8"]
    assert result.get_output("TEXT")["data"] == ["caf\u00e9", "ok"]
