"""Triton's raw binary request: ``Inference-Header-Content-Length: 0`` and the body is the tensor itself.

For a model with one input, the datatype and shape come from the model config (batch size 1 for a
batching model, one variable dimension deduced from the body size; a BYTES input of shape [1] takes
the whole body as its one element), and every output comes back in binary form.
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from .conftest import ADD_SUB_CONFIG, BUILDERS, IDENTITY_PY, start_server, write_model  # type: ignore[import-not-found]


def python_model(repo: Path, name: str, datatype: str, dims: str, max_batch: int) -> None:
    config = f"""
    name: "{name}"
    backend: "python"
    max_batch_size: {max_batch}
    input [ {{ name: "INPUT0", data_type: {datatype}, dims: [ {dims} ] }} ]
    output [ {{ name: "OUTPUT0", data_type: {datatype}, dims: [ {dims} ] }} ]
    """
    write_model(repo, name, config, {"model.py": IDENTITY_PY})


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    repo = tmp_path_factory.mktemp("raw") / "repo"
    python_model(repo, "batched_fp32", "TYPE_FP32", "-1", 8)
    python_model(repo, "fixed_int16", "TYPE_INT16", "2, 3", 0)
    python_model(repo, "one_string", "TYPE_STRING", "1", 0)
    python_model(repo, "many_strings", "TYPE_STRING", "-1", 0)
    python_model(repo, "two_variable", "TYPE_FP32", "-1, -1", 0)
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    handle = start_server(repo)
    yield handle
    handle.stop()


def raw_infer(server, model: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    host, port = server.http.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(
            "POST",
            f"/v2/models/{model}/infer",
            body,
            {"Inference-Header-Content-Length": "0", "Content-Type": "application/octet-stream"},
        )
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def result_of(status: int, headers: dict[str, str], body: bytes) -> httpclient.InferResult:
    assert status == 200, body
    header_length = int(headers["inference-header-content-length"])  # every output comes back binary
    return httpclient.InferResult.from_response_body(body, header_length=header_length)


def error_of(status: int, body: bytes) -> str:
    assert status == 400, (status, body)
    return json.loads(body)["error"]


def test_fixed_size_input_takes_its_shape_from_the_config(server):
    data = np.arange(6, dtype=np.int16).reshape(2, 3)
    result = result_of(*raw_infer(server, "fixed_int16", data.tobytes()))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data)
    message = error_of(*raw_infer(server, "fixed_int16", data.tobytes()[:10])[::2])
    assert "raw input 'INPUT0' got unexpected byte size 10, expected 12" in message


def test_variable_dimension_is_deduced_and_the_batch_is_one(server):
    data = np.linspace(0, 1, 12, dtype=np.float32)
    result = result_of(*raw_infer(server, "batched_fp32", data.tobytes()))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data[None])
    message = error_of(*raw_infer(server, "batched_fp32", data.tobytes()[:7])[::2])
    assert "raw input 'INPUT0' got unexpected byte size 7, expected a multiple of 4" in message


def test_bytes_input_of_shape_one_takes_the_whole_body(server):
    body = b"\xff\x00 any bytes at all \x01"
    result = result_of(*raw_infer(server, "one_string", body))
    assert result.as_numpy("OUTPUT0").tolist() == [body]


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("many_strings", "For BYTE datatype raw input, the model must have input shape [1]"),
        (
            "two_variable",
            "The shape of the raw input 'INPUT0' can not be deduced because there are more than one "
            "variable-sized dimension",
        ),
        (
            "add_sub",
            "Raw request must only have 1 input (found 1) to be deduced but got 2 inputs in 'add_sub' model "
            "configuration",
        ),
    ],
)
def test_models_a_raw_request_cannot_describe_are_refused(server, model, expected):
    assert expected in error_of(*raw_infer(server, model, b"\0" * 16)[::2])


def test_unknown_model_is_404(server):
    status, _, body = raw_infer(server, "missing", b"\0" * 4)
    assert status == 404 and "missing" in json.loads(body)["error"]
