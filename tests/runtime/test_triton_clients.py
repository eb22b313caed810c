"""Acceptance: Triton's own clients (tritonclient.http and tritonclient.grpc) against a real server."""

from __future__ import annotations

import asyncio
import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpaio
from tritonclient.utils import InferenceServerException

from .conftest import EXPLICIT  # type: ignore[import-not-found]

PROTOCOLS = ["http", "grpc"]


def client_for(server, protocol: str):
    if protocol == "http":
        return httpclient, httpclient.InferenceServerClient(server.http)
    return grpcclient, grpcclient.InferenceServerClient(server.grpc)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_health_and_metadata(shared_server, protocol):
    _mod, client = client_for(shared_server, protocol)
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("mlp")
    assert client.is_model_ready("mlp", "1")
    assert not client.is_model_ready("mlp", "2")
    assert not client.is_model_ready("nope")
    meta = client.get_server_metadata()
    name = meta["name"] if protocol == "http" else meta.name
    assert name == "sluice"
    model_meta = client.get_model_metadata("mlp")
    if protocol == "grpc":
        from google.protobuf import json_format

        model_meta = json_format.MessageToDict(model_meta, preserving_proto_field_name=True)
    assert model_meta["versions"] == ["1"]
    assert model_meta["platform"] == "onnxruntime_onnx"
    assert model_meta["inputs"][0]["name"] == "INPUT0"
    assert [int(d) for d in model_meta["inputs"][0]["shape"]] == [-1, 16]
    config = client.get_model_config("mlp")
    if protocol == "grpc":
        assert config.config.max_batch_size == 64
        assert config.config.input[0].name == "INPUT0"
    else:
        assert config["max_batch_size"] == 64
        assert config["input"][0]["name"] == "INPUT0"
    client.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("binary", [True, False])
def test_infer_add_sub(shared_server, protocol, binary):
    mod, client = client_for(shared_server, protocol)
    a = np.arange(16, dtype=np.float32)
    b = np.full(16, 2.5, dtype=np.float32)
    inputs = [mod.InferInput("INPUT0", [16], "FP32"), mod.InferInput("INPUT1", [16], "FP32")]
    if protocol == "http":
        inputs[0].set_data_from_numpy(a, binary_data=binary)
        inputs[1].set_data_from_numpy(b, binary_data=binary)
        outputs = [mod.InferRequestedOutput("OUTPUT1", binary_data=binary)]
    else:
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        outputs = [mod.InferRequestedOutput("OUTPUT1")]
    result = client.infer("add_sub", inputs, outputs=outputs, request_id="req-7")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    assert result.as_numpy("OUTPUT0") is None  # only the requested output comes back
    response = result.get_response()
    rid = response["id"] if protocol == "http" else response.id
    assert rid == "req-7"
    # without requested outputs, all outputs come back
    result = client.infer("add_sub", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    client.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_infer_mlp_matches_onnxruntime(shared_server, protocol, mlp_session):
    mod, client = client_for(shared_server, protocol)
    x = np.random.default_rng(3).standard_normal((5, 16)).astype(np.float32)
    inp = mod.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("mlp", [inp], model_version="1")
    expected = mlp_session.run(None, {"INPUT0": x})[0]
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), expected, rtol=1e-5, atol=1e-6)
    client.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_bytes_roundtrip_python_model(shared_server, protocol):
    mod, client = client_for(shared_server, protocol)
    data = np.array([[b"hello", b"", "naïve".encode(), b"\x00\xffbin"]], dtype=object)
    inp = mod.InferInput("INPUT0", [1, 4], "BYTES")
    inp.set_data_from_numpy(data)
    result = client.infer("identity_bytes", [inp])
    out = result.as_numpy("OUTPUT0")
    assert out.shape == (1, 4)
    assert list(out.ravel()) == list(data.ravel())
    client.close()


def test_http_json_bytes_and_errors(shared_server):
    client = httpclient.InferenceServerClient(shared_server.http)
    data = np.array([[b"a", b"bc"]], dtype=object)
    inp = httpclient.InferInput("INPUT0", [1, 2], "BYTES")
    inp.set_data_from_numpy(data, binary_data=False)
    out = client.infer("identity_bytes", [inp], outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)])
    assert list(out.as_numpy("OUTPUT0").ravel()) == ["a", "bc"]  # tritonclient decodes JSON BYTES to str
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.infer("does_not_exist", [inp])
    client.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_statistics(shared_server, protocol):
    mod, client = client_for(shared_server, protocol)
    x = np.ones((2, 16), dtype=np.float32)
    inp = mod.InferInput("INPUT0", [2, 16], "FP32")
    inp.set_data_from_numpy(x)
    kwargs = {"as_json": True} if protocol == "grpc" else {}
    before = client.get_inference_statistics("mlp", **kwargs)
    client.infer("mlp", [inp])
    client.infer("mlp", [inp])
    after = client.get_inference_statistics("mlp", **kwargs)

    def stat(doc, *path):
        value = doc["model_stats"][0]
        for key in path:
            value = value.get(key, 0) if isinstance(value, dict) else value
        return int(value)

    assert stat(after, "inference_stats", "success", "count") - stat(before, "inference_stats", "success", "count") == 2
    assert stat(after, "inference_count") - stat(before, "inference_count") == 4  # rows
    assert stat(after, "execution_count") - stat(before, "execution_count") in (1, 2)
    with pytest.raises(InferenceServerException):
        client.get_inference_statistics("does_not_exist")
    client.close()


def test_async_clients(shared_server):
    async def go():
        x = np.ones((1, 16), dtype=np.float32)
        http = httpaio.InferenceServerClient(shared_server.http)
        grpc_ = grpcaio.InferenceServerClient(shared_server.grpc)
        try:
            calls = []
            for i in range(20):
                if i % 2:
                    inp = httpaio.InferInput("INPUT0", [1, 16], "FP32")
                    inp.set_data_from_numpy(x * i)
                    calls.append(http.infer("mlp", [inp]))
                else:
                    inp = grpcaio.InferInput("INPUT0", [1, 16], "FP32")
                    inp.set_data_from_numpy(x * i)
                    calls.append(grpc_.infer("mlp", [inp]))
            results = await asyncio.gather(*calls)
            return [r.as_numpy("OUTPUT0") for r in results]
        finally:
            await http.close()
            await grpc_.close()

    outputs = asyncio.run(go())
    assert len(outputs) == 20 and all(o.shape == (1, 4) for o in outputs)
    # different inputs give different outputs: results were not mixed up between requests
    assert len({o.tobytes() for o in outputs}) == 20


def test_http_async_infer(shared_server):
    client = httpclient.InferenceServerClient(shared_server.http, concurrency=4)
    handles = []
    for i in range(8):
        inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
        inp.set_data_from_numpy(np.full((1, 16), i, dtype=np.float32))
        handles.append(client.async_infer("mlp", [inp]))
    outs = [h.get_result().as_numpy("OUTPUT0") for h in handles]
    assert len({o.tobytes() for o in outs}) == 8
    client.close()


def test_grpc_stream(shared_server):
    client = grpcclient.InferenceServerClient(shared_server.grpc)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    for i in range(6):
        inp = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        inp.set_data_from_numpy(np.full((1, 16), i, dtype=np.float32))
        client.async_stream_infer("mlp", [inp], request_id=str(i))
    bad = grpcclient.InferInput("INPUT0", [1, 3], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 3), dtype=np.float32))
    client.async_stream_infer("mlp", [bad], request_id="bad")
    got = [results.get(timeout=10) for _ in range(7)]
    client.stop_stream()
    ok = {r.get_response().id for r, e in got if e is None}
    errors = [e for r, e in got if e is not None]
    assert ok == {str(i) for i in range(6)}
    assert len(errors) == 1 and "unexpected shape" in str(errors[0])
    client.close()


def repository_rows(client, protocol):
    if protocol == "http":
        return client.get_model_repository_index()
    return client.get_model_repository_index(as_json=True)["models"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_repository_index_load_unload(example_repo, serve, protocol):
    server = serve(example_repo, **EXPLICIT)
    _mod, client = client_for(server, protocol)
    rows = repository_rows(client, protocol)
    assert {(r["name"], r.get("state")) for r in rows} == {("add_sub", "READY"), ("mlp", "READY")}
    client.unload_model("mlp")
    assert not client.is_model_ready("mlp")
    rows = repository_rows(client, protocol)
    mlp = next(r for r in rows if r["name"] == "mlp")
    assert mlp["state"] == "UNAVAILABLE" and mlp["reason"] == "unloaded"
    client.unload_model("never_existed")  # Triton answers success
    # load with a config override: a different max_batch_size shows in the config
    client.load_model("mlp", config='{"name": "mlp", "platform": "onnxruntime_onnx", "max_batch_size": 8}')
    assert client.is_model_ready("mlp")
    config = (
        client.get_model_config("mlp", as_json=True)["config"] if protocol == "grpc" else client.get_model_config("mlp")
    )
    assert int(config["max_batch_size"]) == 8
    # a plain load reads config.pbtxt again
    client.load_model("mlp")
    config = (
        client.get_model_config("mlp", as_json=True)["config"] if protocol == "grpc" else client.get_model_config("mlp")
    )
    assert int(config["max_batch_size"]) == 64
    with pytest.raises(InferenceServerException, match="not_here"):
        client.load_model("not_here")
    with pytest.raises(InferenceServerException, match="max_batch_size"):
        client.load_model("mlp", config='{"name": "mlp", "max_batch_size": -3}')
    assert client.is_model_ready("mlp")  # a failed reload leaves the serving version alone
    client.close()
