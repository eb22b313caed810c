"""Prometheus metrics on the metrics port: every family of docs/metrics.md, per model and version."""

from __future__ import annotations

import re
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

DOCUMENTED = [
    "sluice_request_success_total",
    "sluice_request_failure_total",
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


def test_metrics_port_answers_only_metrics(example_repo, serve):
    server = serve(example_repo)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"http://{server.metrics}/v2/models", timeout=5)
    assert info.value.code == 404
