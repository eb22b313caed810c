"""Triton's statistics extension through tritonclient (HTTP and gRPC): the fields move as requests
run, as Triton fills them (``get_inference_statistics``, what perf_analyzer's server-side report reads)."""

from __future__ import annotations

import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import json_format
from tritonclient.utils import InferenceServerException

from .conftest import write_model  # type: ignore[import-not-found]
from .test_python_bls_decoupled import SQUARE_CONFIG, SQUARE_PY, _int_input, _stream  # type: ignore[import-not-found]
from .test_response_cache import COUNTING_PY  # type: ignore[import-not-found]
from .test_response_cache import config as cached_config  # type: ignore[import-not-found]
from .test_response_cache import infer as cached_infer  # type: ignore[import-not-found]
from .test_scheduling_server import Model, infer, wait_queued, wait_started  # type: ignore[import-not-found]


def http_stats(server: Any, model: str = "", version: str = "") -> list[dict[str, Any]]:
    client = httpclient.InferenceServerClient(server.http)
    try:
        return client.get_inference_statistics(model, version)["model_stats"]
    finally:
        client.close()


UINT64 = {"count", "ns", "batch_size", "last_inference", "inference_count", "execution_count", "byte_size"}


def grpc_stats(server: Any, model: str = "", version: str = "") -> list[dict[str, Any]]:
    """The gRPC answer as a dict with HTTP's field names and integers (protobuf's JSON writes uint64 as text)."""
    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        message = client.get_inference_statistics(model, version)
    finally:
        client.close()
    doc = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )

    def ints(value: Any, key: str = "") -> Any:
        if isinstance(value, dict):
            return {k: ints(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [ints(v) for v in value]
        return int(value) if key in UINT64 else value

    return [ints(stat) for stat in doc.get("model_stats", [])]


def by_size(stat: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {int(b["batch_size"]): b for b in stat["batch_stats"]}


def test_batch_stats_are_keyed_by_the_batch_sizes_formed_and_both_protocols_agree(tmp_path, serve):
    repo = tmp_path / "repo"
    repo.mkdir()
    batched = Model(repo, "batched", gated=True, dynamic="dynamic_batching { max_queue_delay_microseconds: 0 }")
    server = serve(repo)
    before_ms = int(time.time() * 1000)
    with ThreadPoolExecutor(4) as pool:
        blocker = pool.submit(infer, server, "http", "batched", 1.0, "blocker")
        wait_started(batched, "blocker")  # the only instance is busy: the next three queue up
        queued = [
            pool.submit(infer, server, p, "batched", 2.0, f"{p}{i}") for i, p in enumerate(("http", "grpc", "http"))
        ]
        wait_queued(server, "batched", 3)
        queued_by = time.monotonic()  # the three were queued by now (the model's log uses the same clock)
        batched.release()
        results = [blocker.result(10), *(call.result(10) for call in queued)]
    assert results == [2.0, 4.0, 4.0, 4.0]
    assert [len(batch) for batch in batched.batches()] == [1, 3]
    after_ms = int(time.time() * 1000)

    [stat] = http_stats(server, "batched")
    assert grpc_stats(server, "batched") == [stat]
    assert (stat["name"], stat["version"]) == ("batched", "1")
    assert stat["inference_count"] == 4 and stat["execution_count"] == 2
    assert before_ms <= stat["last_inference"] <= after_ms
    inference = stat["inference_stats"]
    for field in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        assert inference[field]["count"] == 4, field
        assert inference[field]["ns"] > 0, field
    assert inference["fail"] == {"count": 0, "ns": 0}
    assert inference["cache_hit"]["count"] == inference["cache_miss"]["count"] == 0
    # the three queued requests entered the queue after the blocker started (and before queued_by),
    # and left it once the blocker had ended, before their batch started (the model logs its times)
    starts, ends = batched.events("start"), batched.events("end")
    low, high = 3 * (ends[0]["t"] - queued_by), 3 * (starts[1]["t"] - starts[0]["t"])
    assert low * 1e9 <= inference["queue"]["ns"] <= high * 1e9
    batches = by_size(stat)
    assert sorted(batches) == [1, 3]
    for size, batch in batches.items():
        for field in ("compute_input", "compute_infer", "compute_output"):
            assert batch[field]["count"] == 1, (size, field)
            assert batch[field]["ns"] > 0, (size, field)
    for size, start, end in zip((1, 3), starts, ends, strict=True):  # the model's own time is inside compute_infer
        assert batches[size]["compute_infer"]["ns"] >= (end["t"] - start["t"]) * 1e9, size
    # each request adds its whole execution's time: compute_infer.ns / count is the mean a request saw
    for field in ("compute_input", "compute_infer", "compute_output"):
        assert inference[field]["ns"] == batches[1][field]["ns"] + 3 * batches[3][field]["ns"], field
    assert stat["memory_usage"] == [] and stat["response_stats"] == {}


FAILING_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "IN", data_type: TYPE_FP32, dims: [ 1 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] }} ]
version_policy {{ all {{ }} }}
"""
# An input of -2 is the model's failure.
FAILING_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if x[0] == -2:
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("the model broke")))
            else:
                out.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUT", x)]))
        return out
"""


def one(server: Any, model: str, x: float, version: str = "") -> None:
    client = httpclient.InferenceServerClient(server.http)
    try:
        tensor = httpclient.InferInput("IN", [1], "FP32")
        tensor.set_data_from_numpy(np.array([x], np.float32))
        client.infer(model, [tensor], model_version=version)
    finally:
        client.close()


def test_failures_count_only_as_fail_and_every_version_is_reported(tmp_path, serve):
    repo = tmp_path / "repo"
    for version in (1, 2):
        write_model(repo, "flaky", FAILING_CONFIG.format(name="flaky"), {"model.py": FAILING_PY}, version=version)
    server = serve(repo)
    one(server, "flaky", 1.0, "1")
    with pytest.raises(InferenceServerException, match="the model broke"):
        one(server, "flaky", -2.0, "1")
    one(server, "flaky", 1.0, "2")

    stats = http_stats(server, "flaky")  # version "": every ready version
    assert [s["version"] for s in stats] == ["1", "2"]
    assert grpc_stats(server, "flaky") == stats
    first = stats[0]
    inference = first["inference_stats"]
    assert inference["success"]["count"] == 1 and inference["fail"]["count"] == 1 and inference["fail"]["ns"] > 0
    # Triton counts queue, compute and inferences of successful requests only, and executions with at
    # least one (its backends report no batch statistics when every response failed)
    for field in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert inference[field]["count"] == 1, field
    assert first["inference_count"] == 1 and first["execution_count"] == 1
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in first["batch_stats"]] == [(1, 1)]
    assert http_stats(server, "flaky", "2") == [stats[1]]
    everything = http_stats(server)
    assert [(s["name"], s["version"]) for s in everything] == [("flaky", "1"), ("flaky", "2")]


@pytest.mark.parametrize(
    ("model", "version", "message"),
    [
        ("nope", "", "requested model 'nope' is not available"),
        ("flaky", "7", "requested model version is not available for model 'flaky'"),
        ("flaky", "x", "requested model version is not available for model 'flaky'"),
    ],
)
def test_unknown_models_and_versions_are_tritons_invalid_argument(tmp_path, serve, model, version, message):
    repo = tmp_path / "repo"
    write_model(repo, "flaky", FAILING_CONFIG.format(name="flaky"), {"model.py": FAILING_PY})
    server = serve(repo)
    with pytest.raises(InferenceServerException) as http_error:
        http_stats(server, model, version)
    assert http_error.value.status() == "400"
    assert message in str(http_error.value)
    with pytest.raises(InferenceServerException) as grpc_error:
        grpc_stats(server, model, version)
    assert grpc_error.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert message in str(grpc_error.value)


@pytest.mark.parametrize("version", ["\u00b2", "\u2460", "\u0663"])  # digits, not ASCII ones: int() refuses them
def test_a_version_of_other_digits_is_an_unknown_version_not_a_500(tmp_path, serve, version):
    repo = tmp_path / "repo"
    write_model(repo, "flaky", FAILING_CONFIG.format(name="flaky"), {"model.py": FAILING_PY})
    server = serve(repo)
    quoted = urllib.parse.quote(version)
    with pytest.raises(urllib.error.HTTPError) as http_error:
        urllib.request.urlopen(f"http://{server.http}/v2/models/flaky/versions/{quoted}/stats", timeout=30)
    assert http_error.value.code == 400
    assert "requested model version is not available for model 'flaky'" in http_error.value.read().decode()
    with pytest.raises(InferenceServerException) as grpc_error:
        grpc_stats(server, "flaky", version)
    assert grpc_error.value.status() == "StatusCode.INVALID_ARGUMENT"


def test_cache_hits_and_misses_move_their_fields_not_inferences(tmp_path, serve):
    repo = tmp_path / "repo"
    write_model(repo, "cached", cached_config(), {"model.py": COUNTING_PY})
    server = serve(repo)
    cached_infer(server, "http", [1.0, 2.0])  # miss: runs and is stored
    cached_infer(server, "grpc", [1.0, 2.0])  # hit
    cached_infer(server, "http", [1.0, 2.0])  # hit
    [stat] = http_stats(server, "cached")
    assert grpc_stats(server, "cached") == [stat]
    inference = stat["inference_stats"]
    assert inference["cache_miss"]["count"] == 1 and inference["cache_miss"]["ns"] > 0
    assert inference["cache_hit"]["count"] == 2 and inference["cache_hit"]["ns"] > 0
    assert inference["success"]["count"] == 3 and inference["queue"]["count"] == 3
    assert inference["compute_infer"]["count"] == 1
    assert stat["inference_count"] == 1 and stat["execution_count"] == 1


def test_a_decoupled_models_responses_are_counted_by_index(tmp_path, serve):
    repo = tmp_path / "repo"
    write_model(repo, "square", SQUARE_CONFIG, {"model.py": SQUARE_PY})
    server = serve(repo)
    items = _stream(
        server, "square", {"a": _int_input(grpcclient, 2), "b": _int_input(grpcclient, 1)}, empty_final=True, expected=5
    )
    assert not any(isinstance(item, InferenceServerException) for item in items)
    [stat] = http_stats(server, "square")
    assert grpc_stats(server, "square") == [stat]
    responses = stat["response_stats"]
    # a: two responses then the bare final flag; b: one response then the final flag
    assert sorted(responses) == ["0", "1", "2"]
    assert responses["0"]["success"]["count"] == 2 and responses["0"]["success"]["ns"] > 0
    assert responses["1"]["success"]["count"] == 1 and responses["1"]["empty_response"]["count"] == 1
    assert responses["2"]["empty_response"]["count"] == 1 and responses["2"]["success"]["count"] == 0
    for index, response in responses.items():
        counted = sum(response[k]["count"] for k in ("success", "fail", "empty_response"))
        assert response["compute_infer"]["count"] == counted, index
        assert response["fail"]["count"] == response["cancel"]["count"] == 0
