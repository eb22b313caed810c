"""Prometheus metrics on the metrics port: every family of docs/metrics.md, per model and version."""

from __future__ import annotations

import gzip
import itertools
import re
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from .conftest import write_model  # type: ignore[import-not-found]

DOCUMENTED = [
    "sluice_request_success_total",
    "sluice_request_failure_total",
    "sluice_request_server_failure_total",
    "sluice_inference_count_total",
    "sluice_execution_count_total",
    "sluice_request_duration_us_total",
    "sluice_queue_duration_us_total",
    "sluice_compute_infer_duration_us_total",
    "sluice_rejected_total",
    "sluice_cache_hit_count_total",
    "sluice_cache_miss_count_total",
    "sluice_queue_depth",
    "sluice_inflight_requests",
    "sluice_queue_duration_seconds_bucket",
    "sluice_compute_duration_seconds_bucket",
    "sluice_batch_size_bucket",
    "sluice_request_duration_seconds_bucket",
]


def scrape(server) -> str:
    with urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=5) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        return response.read().decode()


def value(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{wanted}}} not in the exposition")


def test_every_documented_family_is_exported_and_counts_traffic(example_repo, serve):
    server = serve(example_repo)
    before = scrape(server)
    client = httpclient.InferenceServerClient(server.http)
    for batch in (1, 3):
        inp = httpclient.InferInput("INPUT0", [batch, 16], "FP32")
        inp.set_data_from_numpy(np.ones((batch, 16), np.float32))
        client.infer("mlp", [inp])
    bad = httpclient.InferInput("INPUT0", [1, 3], "FP32")
    bad.set_data_from_numpy(np.ones((1, 3), np.float32))
    with pytest.raises(InferenceServerException):
        client.infer("mlp", [bad])
    text = scrape(server)
    for family in DOCUMENTED:
        assert re.search(rf"^{family}{{[^}}]*model=\"mlp\"", text, re.M), f"{family} missing for mlp"
    labels = {"model": "mlp", "version": "1"}
    assert (
        value(text, "sluice_request_success_total", **labels) - value(before, "sluice_request_success_total", **labels)
        == 2
    )
    assert (
        value(text, "sluice_request_failure_total", **labels)
        == value(before, "sluice_request_failure_total", **labels) + 1
    )
    assert value(text, "sluice_inference_count_total", **labels) == 4  # rows, not requests
    assert value(text, "sluice_queue_depth", **labels) == 0
    assert value(text, "sluice_batch_size_count", **labels) == value(text, "sluice_execution_count_total", **labels)
    assert value(text, "sluice_rejected_total", reason="queue_full", **labels) == 0
    # the statistics endpoint and the metrics read the same counters
    stats = client.get_inference_statistics("mlp")["model_stats"][0]
    assert stats["inference_count"] == value(text, "sluice_inference_count_total", **labels)
    assert stats["execution_count"] == value(text, "sluice_execution_count_total", **labels)
    client.close()


def test_two_servers_in_one_process_keep_their_own_registries(example_repo, serve):
    first = serve(example_repo)
    second = serve(example_repo)
    client = httpclient.InferenceServerClient(first.http)
    inp = httpclient.InferInput("INPUT0", [2, 16], "FP32")
    inp.set_data_from_numpy(np.ones((2, 16), np.float32))
    client.infer("mlp", [inp])
    client.close()
    assert value(scrape(first), "sluice_inference_count_total", model="mlp", version="1") == 2
    assert value(scrape(second), "sluice_inference_count_total", model="mlp", version="1") == 0


def test_a_scrape_that_accepts_gzip_gets_the_same_families_gzipped(example_repo, serve):
    """Prometheus sends ``Accept-Encoding: gzip`` on every scrape; the exposition is ~10x smaller."""
    server = serve(example_repo)
    client = httpclient.InferenceServerClient(server.http)
    client.get_model_metadata("add_sub")
    plain = scrape(server)
    request = urllib.request.Request(f"http://{server.metrics}/metrics", headers={"Accept-Encoding": "gzip"})
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.headers["Content-Encoding"] == "gzip"
        assert response.headers["Vary"] == "accept-encoding"
        raw = response.read()
    text = gzip.decompress(raw).decode()
    assert len(raw) * 4 < len(text)
    deflate = urllib.request.Request(f"http://{server.metrics}/metrics", headers={"Accept-Encoding": "deflate"})
    with urllib.request.urlopen(deflate, timeout=5) as response:  # gzip is the one coding offered here
        assert response.headers["Content-Encoding"] is None and response.read().startswith(b"# HELP")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(families) == {f.name for f in text_string_to_metric_families(plain)}
    assert "sluice_queue_depth" in families


def test_metrics_port_answers_only_metrics(example_repo, serve):
    server = serve(example_repo)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"http://{server.metrics}/v2/models", timeout=5)
    assert info.value.code == 404


# Sleeps SLEEP_S per request; an input of -1 is the model's own client error (INVALID_ARG), -2 its failure.
SLOW_PY = """
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if x[0] == -1:
                error = pb_utils.TritonError("IN must not be -1", pb_utils.TritonError.INVALID_ARG)
                out.append(pb_utils.InferenceResponse(error=error))
            elif x[0] == -2:
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("the model broke")))
            elif x[0] == -3:
                error = pb_utils.TritonError("no such mode", pb_utils.TritonError.UNSUPPORTED)
                out.append(pb_utils.InferenceResponse(error=error))
            else:
                time.sleep(SLEEP_S)
                out.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUT", x)]))
        return out
"""
SLOW_CONFIG = """
name: "slow"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]
"""


def buckets(text: str, name: str, **labels: str) -> dict[float, float]:
    """``le`` -> cumulative count of one histogram series."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "_bucket{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[float(le)] = float(line.rsplit(" ", 1)[1])
    return out


def slow_infer(client, x: float) -> None:
    inp = httpclient.InferInput("IN", [1], "FP32")
    inp.set_data_from_numpy(np.array([x], np.float32))
    client.infer("slow", [inp])


def test_request_duration_histogram_counts_every_answer_and_places_a_slow_model_in_its_bucket(tmp_path, serve):
    repo = tmp_path / "repo"
    write_model(repo, "slow", SLOW_CONFIG, {"model.py": SLOW_PY.replace("SLEEP_S", "0.06")})
    server = serve(repo)
    client = httpclient.InferenceServerClient(server.http)
    for _ in range(5):
        slow_infer(client, 1.0)
    for x in (-1.0, -2.0):
        with pytest.raises(InferenceServerException):
            slow_infer(client, x)
    text = scrape(server)
    client.close()
    labels = {"model": "slow", "version": "1"}
    hist = buckets(text, "sluice_request_duration_seconds", **labels)
    assert hist[float("inf")] == value(text, "sluice_request_duration_seconds_count", **labels) == 7
    # the two errors answer at once; the five slow requests take at least the model's 60 ms
    assert hist[0.05] == 2
    assert hist[30.0] == 7
    assert value(text, "sluice_request_duration_seconds_sum", **labels) >= 5 * 0.06
    bounds = sorted(hist)
    assert bounds[0] == 0.0005 and bounds[-2] == 30.0  # 0.5 ms .. 30 s, then +Inf
    assert all(hist[a] <= hist[b] for a, b in itertools.pairwise(bounds))


def test_server_failures_count_what_the_server_is_to_blame_for_not_bad_input(tmp_path, serve):
    """sluice_request_failure keeps Triton's meaning (every error); sluice_request_server_failure counts
    only 5xx answers the server is to blame for (not a 501 for what it does not support), which is what a
    canary is judged on."""
    repo = tmp_path / "repo"
    write_model(repo, "slow", SLOW_CONFIG, {"model.py": SLOW_PY.replace("SLEEP_S", "0")})
    server = serve(repo)
    client = httpclient.InferenceServerClient(server.http)
    wrong_shape = httpclient.InferInput("IN", [2], "FP32")
    wrong_shape.set_data_from_numpy(np.ones(2, np.float32))
    with pytest.raises(InferenceServerException, match="shape"):
        client.infer("slow", [wrong_shape])
    with pytest.raises(InferenceServerException, match="must not be -1"):
        slow_infer(client, -1.0)  # the model's own INVALID_ARG: the client's fault
    with pytest.raises(InferenceServerException, match="no such mode") as unsupported:
        slow_infer(client, -3.0)  # UNSUPPORTED: 501 as in Triton, but asked for by the client, not a fault
    assert unsupported.value.status() == "501"
    for _ in range(3):
        with pytest.raises(InferenceServerException, match="the model broke"):
            slow_infer(client, -2.0)
    slow_infer(client, 1.0)
    text = scrape(server)
    client.close()
    labels = {"model": "slow", "version": "1"}
    assert value(text, "sluice_request_failure_total", **labels) == 6
    assert value(text, "sluice_request_server_failure_total", **labels) == 3
    assert value(text, "sluice_request_success_total", **labels) == 1
    assert value(text, "sluice_request_duration_seconds_count", **labels) == 7
