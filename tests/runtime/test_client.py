"""``sluice.client`` against the real server on loopback, over gRPC and HTTP: arrays in, arrays out,
the caller named on every call, and clear errors for arrays that do not fit the model."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from sluice.client import Client, InputError

from .conftest import ADD_SUB_CONFIG, BUILDERS, write_model  # type: ignore[import-not-found]


@pytest.fixture
def server(tmp_path, serve):
    repo = tmp_path / "repo"
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    write_model(
        repo,
        "mlp",
        'name: "mlp"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 64\ndynamic_batching { }\n',
        {"model.onnx": BUILDERS.mlp_model()},
    )
    return serve(repo)


def url_of(server, protocol: str) -> str:
    return server.grpc if protocol == "grpc" else server.http


def caller_successes(server, model: str, caller: str) -> float:
    with urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=5) as response:
        text = response.read().decode()
    for line in text.splitlines():
        labelled = f'model="{model}"' in line and f'caller="{caller}"' in line
        if line.startswith("sluice_caller_request_success_total{") and labelled:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_infer_with_arrays_by_name_and_in_order(server, protocol):
    a = np.arange(16, dtype=np.float32)
    b = np.full(16, 2.0, np.float32)
    with Client(url_of(server, protocol), caller=f"tests-{protocol}", protocol=protocol) as client:
        out = client.infer("add_sub", {"INPUT0": a, "INPUT1": b})
        assert set(out) == {"OUTPUT0", "OUTPUT1"}
        np.testing.assert_array_equal(out["OUTPUT0"], a + b)
        np.testing.assert_array_equal(out["OUTPUT1"], a - b)
        ordered = client.infer("add_sub", [b, a], outputs=["OUTPUT1"])  # metadata order: INPUT0, INPUT1
        assert list(ordered) == ["OUTPUT1"]
        np.testing.assert_array_equal(ordered["OUTPUT1"], b - a)
        batch = client.infer("mlp", {"INPUT0": np.ones((3, 16), np.float32)}, version="1")
        assert batch["OUTPUT0"].shape == (3, 4)
    assert caller_successes(server, "add_sub", f"tests-{protocol}") == 2
    assert caller_successes(server, "mlp", f"tests-{protocol}") == 1


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_arrays_that_do_not_fit_are_refused_before_sending(server, protocol):
    ok = np.zeros(16, np.float32)
    with Client(url_of(server, protocol), caller="careless", protocol=protocol) as client:
        with pytest.raises(
            InputError,
            match=r"input 'INPUT1' of model 'add_sub': expected FP32 \(float32\) with shape \[16\] .*got float64 "
            r"with shape \[16\]",
        ):
            client.infer("add_sub", {"INPUT0": ok, "INPUT1": np.zeros(16)})
        with pytest.raises(InputError, match=r"expected FP32 \(float32\) with shape \[-1, 16\].*got float32 with "):
            client.infer("mlp", {"INPUT0": np.zeros((2, 8), np.float32)})
        with pytest.raises(InputError, match=r"'add_sub' has no input 'INPUT9'; its inputs: \['INPUT0', 'INPUT1'\]"):
            client.infer("add_sub", {"INPUT0": ok, "INPUT1": ok, "INPUT9": ok})
        with pytest.raises(InputError, match=r"model 'add_sub' needs input 'INPUT1'"):
            client.infer("add_sub", {"INPUT0": ok})
        with pytest.raises(InputError, match=r"takes 2 input\(s\) \['INPUT0', 'INPUT1'\] in this order, got 1"):
            client.infer("add_sub", [ok])
        with pytest.raises(InferenceServerException, match="unknown model"):
            client.infer("nope", [ok])  # server errors come through unchanged
    assert caller_successes(server, "add_sub", "careless") == 0  # nothing was sent


def test_bad_arguments_are_refused_at_once(server):
    with pytest.raises(ValueError, match="caller 'has space' is not allowed; allowed: 1 to 64 characters"):
        Client(server.grpc, caller="has space")
    with pytest.raises(ValueError, match="protocol 'rest' is not supported; allowed: grpc, http"):
        Client(server.http, caller="ok", protocol="rest")
