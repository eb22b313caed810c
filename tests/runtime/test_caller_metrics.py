"""Callers end to end: the Sluice-Caller header, sluice-caller metadata and sluice_caller parameter sent by
tritonclient (HTTP and gRPC, both gRPC front ends) to a real server, and the per-caller series scraped
from /metrics: requests, cache hits, duplicates (fake clock), ``other`` past the label limit,
rejections by reason, and bad caller names refused with 400 / INVALID_ARGUMENT."""

from __future__ import annotations

import json
import queue
import re
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from .conftest import ADD_SUB_CONFIG, BUILDERS, ManualClock, write_model  # type: ignore[import-not-found]

CACHED_ADD_SUB = ADD_SUB_CONFIG + "response_cache { enable: true }\n"

# Echoes its request parameters (as JSON) so a test sees what reached the model; waits, before
# answering an input of 1, until the file named by the "gate" parameter exists.
ECHO_PY = """
import json
import os
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.gate = config["parameters"]["gate"]["string_value"]

    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if x.flat[0] == 1:
                open(self.gate + ".started", "w").close()
                end = time.monotonic() + 20
                while not os.path.exists(self.gate) and time.monotonic() < end:
                    time.sleep(0.005)
            params = np.array([[request.parameters().encode()]], dtype=object)
            out.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("PARAMS", params)]))
        return out
"""


def echo_config(gate: Path) -> str:
    return f"""
    name: "echo"
    backend: "python"
    max_batch_size: 1
    input [ {{ name: "IN", data_type: TYPE_FP32, dims: [ 1 ] }} ]
    output [ {{ name: "PARAMS", data_type: TYPE_STRING, dims: [ 1 ] }} ]
    dynamic_batching {{ default_queue_policy {{ max_queue_size: 1 allow_timeout_override: true }} }}
    parameters {{ key: "gate" value {{ string_value: "{gate}" }} }}
    """


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    write_model(repo, "add_sub", CACHED_ADD_SUB, {"model.onnx": BUILDERS.add_sub_model()})
    write_model(repo, "echo", echo_config(tmp_path / "gate"), {"model.py": ECHO_PY})
    return repo


def scrape(server) -> str:
    with urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=5) as response:
        return response.read().decode()


def series(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def caller_labels(text: str) -> set[str]:
    return set(re.findall(r'^sluice_caller_request_success_total\{[^}]*caller="([^"]*)"', text, re.M))


def add_sub_inputs(module, value: float) -> list:
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = module.InferInput(name, [16], "FP32")
        tensor.set_data_from_numpy(np.full(16, value, np.float32))
        inputs.append(tensor)
    return inputs


def echo_input(module, value: float) -> list:
    tensor = module.InferInput("IN", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.array([[value]], np.float32))
    return [tensor]


def test_requests_are_counted_per_caller_over_http_grpc_metadata_and_parameter(repo, serve):
    server = serve(repo)
    http = httpclient.InferenceServerClient(server.http)
    grpc = grpcclient.InferenceServerClient(server.grpc)
    http.infer("add_sub", add_sub_inputs(httpclient, 1), headers={"Sluice-Caller": "svc-a"})
    http.infer("add_sub", add_sub_inputs(httpclient, 2), headers={"Sluice-Caller": "svc-a"})
    grpc.infer("add_sub", add_sub_inputs(grpcclient, 3), headers={"sluice-caller": "team/b@prod"})
    http.infer("add_sub", add_sub_inputs(httpclient, 4), parameters={"sluice_caller": "svc-c"})
    grpc.infer("add_sub", add_sub_inputs(grpcclient, 5), parameters={"sluice_caller": "svc-c"})
    # the header wins over the parameter
    both = {"headers": {"Sluice-Caller": "svc-a"}, "parameters": {"sluice_caller": "svc-c"}}
    http.infer("add_sub", add_sub_inputs(httpclient, 6), **both)
    http.infer("add_sub", add_sub_inputs(httpclient, 7))  # no caller
    # ModelStreamInfer: the stream's metadata names the caller of every request on it
    answers: queue.Queue = queue.Queue()
    grpc.start_stream(lambda result, error: answers.put((result, error)), headers={"sluice-caller": "streamer"})
    for value in (8, 9):
        grpc.async_stream_infer("add_sub", add_sub_inputs(grpcclient, value))
    for _ in range(2):
        _, error = answers.get(timeout=10)
        assert error is None
    grpc.stop_stream()
    bad = httpclient.InferInput("INPUT0", [3], "FP32")
    bad.set_data_from_numpy(np.ones(3, np.float32))
    with pytest.raises(InferenceServerException, match="expected 2 inputs"):
        http.infer("add_sub", [bad], headers={"Sluice-Caller": "svc-a"})
    text = scrape(server)
    labels = {"model": "add_sub", "version": "1"}
    assert series(text, "sluice_caller_request_success_total", caller="svc-a", **labels) == 3
    assert series(text, "sluice_caller_request_failure_total", caller="svc-a", **labels) == 1
    assert series(text, "sluice_caller_rejected_total", caller="svc-a", reason="bad_request", **labels) == 1
    assert series(text, "sluice_caller_request_success_total", caller="team/b@prod", **labels) == 1
    assert series(text, "sluice_caller_request_success_total", caller="svc-c", **labels) == 2
    assert series(text, "sluice_caller_request_success_total", caller="streamer", **labels) == 2
    assert series(text, "sluice_caller_request_success_total", caller="unknown", **labels) == 1
    assert series(text, "sluice_caller_request_success_total", caller="other", **labels) == 0
    # the per-caller counts add up to the model's own
    total = sum(
        series(text, "sluice_caller_request_success_total", caller=c, **labels) or 0 for c in caller_labels(text)
    )
    assert total == series(text, "sluice_request_success_total", **labels) == 9
    http.close()
    grpc.close()


def test_the_caller_parameter_never_reaches_the_model(repo, serve):
    server = serve(repo)
    for module, url in ((httpclient, server.http), (grpcclient, server.grpc)):
        client = module.InferenceServerClient(url)
        result = client.infer("echo", echo_input(module, 0), parameters={"sluice_caller": "svc-p", "note": "kept"})
        seen = json.loads(result.as_numpy("PARAMS").flat[0])
        assert seen.get("note") == "kept"
        assert "sluice_caller" not in seen
        client.close()
    text = scrape(server)
    assert series(text, "sluice_caller_request_success_total", model="echo", caller="svc-p") == 2


def test_the_same_request_twice_from_one_caller_is_a_duplicate_within_the_window(repo, serve):
    clock = ManualClock()
    server = serve(repo, clock=clock, duplicate_window_s=10.0)
    http = httpclient.InferenceServerClient(server.http)
    grpc = grpcclient.InferenceServerClient(server.grpc)
    http.infer("add_sub", add_sub_inputs(httpclient, 1), headers={"Sluice-Caller": "retrier"})
    grpc.infer("add_sub", add_sub_inputs(grpcclient, 1), headers={"sluice-caller": "retrier"})  # same inputs
    grpc.infer("add_sub", add_sub_inputs(grpcclient, 1), headers={"sluice-caller": "someone-else"})
    http.infer("add_sub", add_sub_inputs(httpclient, 2), headers={"Sluice-Caller": "retrier"})  # other inputs
    http.infer("echo", echo_input(httpclient, 0), headers={"Sluice-Caller": "retrier"})  # an uncached model
    http.infer("echo", echo_input(httpclient, 0), headers={"Sluice-Caller": "retrier"})
    clock.advance(10.5)
    http.infer("add_sub", add_sub_inputs(httpclient, 1), headers={"Sluice-Caller": "retrier"})  # window passed
    http.infer("add_sub", add_sub_inputs(httpclient, 1))  # no caller: never hashed
    http.infer("add_sub", add_sub_inputs(httpclient, 1))
    text = scrape(server)
    labels = {"model": "add_sub", "version": "1"}
    assert series(text, "sluice_caller_duplicate_request_total", caller="retrier", **labels) == 1
    assert series(text, "sluice_caller_duplicate_request_total", caller="someone-else", **labels) == 0
    assert series(text, "sluice_caller_duplicate_request_total", caller="unknown", **labels) == 0
    assert series(text, "sluice_caller_duplicate_request_total", model="echo", caller="retrier") == 1
    # response-cache hits per caller: the first request stored the entry, the rest with input 1 hit it
    assert series(text, "sluice_caller_cache_hit_count_total", caller="retrier", **labels) == 2
    assert series(text, "sluice_caller_cache_hit_count_total", caller="someone-else", **labels) == 1
    assert series(text, "sluice_caller_cache_hit_count_total", caller="unknown", **labels) == 2
    http.close()
    grpc.close()


def test_a_duplicate_window_of_zero_counts_no_duplicates(repo, serve):
    server = serve(repo, duplicate_window_s=0.0)
    http = httpclient.InferenceServerClient(server.http)
    for _ in range(2):
        http.infer("add_sub", add_sub_inputs(httpclient, 1), headers={"Sluice-Caller": "retrier"})
    text = scrape(server)
    assert series(text, "sluice_caller_duplicate_request_total", model="add_sub", caller="retrier") == 0
    assert series(text, "sluice_caller_cache_hit_count_total", model="add_sub", caller="retrier") == 1
    http.close()


def test_callers_past_the_label_limit_are_counted_as_other(repo, serve):
    server = serve(repo, caller_label_limit=2)
    http = httpclient.InferenceServerClient(server.http)

    def send(caller: str, n: int) -> None:
        for i in range(n):
            http.infer("add_sub", add_sub_inputs(httpclient, i), headers={"Sluice-Caller": caller})

    send("a", 2)
    send("b", 2)
    send("c", 1)
    text = scrape(server)
    labels = {"model": "add_sub", "version": "1"}
    assert caller_labels(text) == {"a", "b", "other", "unknown"}
    assert series(text, "sluice_caller_request_success_total", caller="other", **labels) == 1
    send("c", 6)  # still counted under other until the next scrape re-ranks
    send("a", 1)
    scrape(server)  # re-rank: c and a are the busiest; b loses its label
    send("c", 1)
    send("b", 1)
    text = scrape(server)
    assert caller_labels(text) == {"a", "c", "other", "unknown"}
    assert series(text, "sluice_caller_request_success_total", caller="c", **labels) == 1  # its own series from now
    assert series(text, "sluice_caller_request_success_total", caller="other", **labels) == 8  # 1 + 6 of c, 1 of b
    assert series(text, "sluice_caller_request_success_total", caller="a", **labels) == 3
    # many distinct callers: the label set stays bounded
    for i in range(50):
        http.infer("add_sub", add_sub_inputs(httpclient, 0), headers={"Sluice-Caller": f"one-off-{i}"})
    text = scrape(server)
    assert len(caller_labels(text)) <= 2 + 2
    http.close()


def test_rejections_are_counted_per_caller_and_reason(repo, serve, tmp_path):
    clock = ManualClock()
    server = serve(repo, clock=clock)
    gate = tmp_path / "gate"
    http = httpclient.InferenceServerClient(server.http, concurrency=2)
    grpc = grpcclient.InferenceServerClient(server.grpc)
    results: dict[str, object] = {}

    def call(name: str, value: float, caller: str, **kwargs: object) -> None:
        try:
            headers = {"Sluice-Caller": caller}
            results[name] = http.infer("echo", echo_input(httpclient, value), headers=headers, **kwargs)
        except InferenceServerException as exc:
            results[name] = exc

    running = threading.Thread(target=call, args=("running", 1, "holder"))
    running.start()
    deadline = time.monotonic() + 10
    while not Path(str(gate) + ".started").exists():
        assert time.monotonic() < deadline, "the first request never started"
        time.sleep(0.01)
    queued = threading.Thread(target=call, args=("queued", 0, "waiter"), kwargs={"timeout": 1000})
    queued.start()
    while series(scrape(server), "sluice_queue_depth", model="echo") != 1:
        assert time.monotonic() < deadline, "the second request never queued"
        time.sleep(0.01)
    with pytest.raises(InferenceServerException, match="queue is full"):
        grpc.infer("echo", echo_input(grpcclient, 0), headers={"sluice-caller": "pusher"})
    clock.advance(1.0)  # past the queued request's 1 ms timeout
    queued.join(10)
    gate.touch()
    running.join(10)
    assert isinstance(results["queued"], InferenceServerException)
    assert "timeout" in str(results["queued"]).lower()
    assert not isinstance(results["running"], Exception)
    text = scrape(server)
    labels = {"model": "echo", "version": "1"}
    assert series(text, "sluice_caller_rejected_total", caller="pusher", reason="queue_full", **labels) == 1
    assert series(text, "sluice_caller_rejected_total", caller="waiter", reason="timeout", **labels) == 1
    assert series(text, "sluice_caller_rejected_total", caller="waiter", reason="queue_full", **labels) == 0
    assert series(text, "sluice_caller_request_failure_total", caller="pusher", **labels) == 1
    assert series(text, "sluice_caller_request_success_total", caller="holder", **labels) == 1
    assert series(text, "sluice_rejected_total", reason="queue_full", **labels) == 1
    http.close()
    grpc.close()


@pytest.mark.parametrize("grpc_server", ["h2", "grpcio"])
@pytest.mark.parametrize("name", ["has space", "x" * 65, "other", "ünï"])
def test_a_bad_caller_name_is_refused_naming_the_header_and_the_form(repo, serve, grpc_server, name):
    server = serve(repo, grpc_server=grpc_server)
    http = httpclient.InferenceServerClient(server.http)
    grpc = grpcclient.InferenceServerClient(server.grpc)
    raw = name.encode("utf-8").decode("latin-1")  # what goes on the wire
    with pytest.raises(InferenceServerException) as info:
        http.infer("add_sub", add_sub_inputs(httpclient, 1), headers={"Sluice-Caller": raw})
    assert info.value.status() == "400"
    assert "header Sluice-Caller" in info.value.message() and "allowed: 1 to 64 characters" in info.value.message()
    if name.isascii():  # gRPC metadata values are ASCII
        with pytest.raises(InferenceServerException) as info:
            grpc.infer("add_sub", add_sub_inputs(grpcclient, 1), headers={"sluice-caller": name})
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "metadata sluice-caller" in info.value.message()
        assert "allowed: 1 to 64 characters" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        grpc.infer("add_sub", add_sub_inputs(grpcclient, 1), parameters={"sluice_caller": name})
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "request parameter 'sluice_caller'" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        http.infer("add_sub", add_sub_inputs(httpclient, 1), parameters={"sluice_caller": 12})
    assert info.value.status() == "400" and "must be a string" in info.value.message()
    # the server goes on serving, and the refused requests named no model traffic
    http.infer("add_sub", add_sub_inputs(httpclient, 1), headers={"Sluice-Caller": "fine"})
    text = scrape(server)
    assert series(text, "sluice_request_success_total", model="add_sub") == 1
    assert series(text, "sluice_caller_request_success_total", model="add_sub", caller="fine") == 1
    http.close()
    grpc.close()


def test_grpcio_front_end_counts_the_caller_metadata(repo, serve):
    server = serve(repo, grpc_server="grpcio")
    grpc = grpcclient.InferenceServerClient(server.grpc)
    grpc.infer("add_sub", add_sub_inputs(grpcclient, 1), headers={"sluice-caller": "via-grpcio"})
    assert series(scrape(server), "sluice_caller_request_success_total", model="add_sub", caller="via-grpcio") == 1
    grpc.close()
