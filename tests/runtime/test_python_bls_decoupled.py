"""BLS, decoupled models, custom metrics and ``--disable-auto-complete-config`` of the Python
backend, through the real server with tritonclient (HTTP, gRPC and the gRPC stream, on both gRPC
front ends)."""

from __future__ import annotations

import queue
import re
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from .conftest import EXPLICIT, start_server, write_model  # type: ignore[import-not-found]

IO4 = """
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""

ADD_SUB_PY = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            a = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(r, "INPUT1").as_numpy()
            outputs = [pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", a - b)]
            out.append(pb_utils.InferenceResponse(outputs))
        return out
"""

# Calls the model named by MODEL_NAME and passes its answer on, errors included (as TritonError).
BLS_PY = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            target = pb_utils.get_input_tensor_by_name(r, "MODEL_NAME").as_numpy().flat[0]
            inner = pb_utils.InferenceRequest(
                model_name=target, requested_output_names=["OUTPUT0", "OUTPUT1"],
                inputs=[pb_utils.get_input_tensor_by_name(r, "INPUT0"), pb_utils.get_input_tensor_by_name(r, "INPUT1")])
            answer = inner.exec()
            if answer.has_error():
                out.append(pb_utils.InferenceResponse(error=answer.error()))
            else:
                out.append(pb_utils.InferenceResponse(answer.output_tensors()))
        return out
"""

BLS_ASYNC_PY = """
import asyncio
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    async def execute(self, requests):
        out = []
        for r in requests:
            inputs = [pb_utils.get_input_tensor_by_name(r, "INPUT0"), pb_utils.get_input_tensor_by_name(r, "INPUT1")]
            calls = [
                pb_utils.InferenceRequest(model_name="add_sub", requested_output_names=[name], inputs=inputs)
                for name in ("OUTPUT0", "OUTPUT1")
            ]
            first, second = await asyncio.gather(*(call.async_exec() for call in calls))
            out.append(pb_utils.InferenceResponse(first.output_tensors() + second.output_tensors()))
        return out
"""

SQUARE_CONFIG = """
name: "square"
backend: "python"
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

# Sends IN responses from a thread of its own, then the bare final flag; after that, a late send
# must be refused (counted in a custom counter the test reads on the metrics port).
SQUARE_PY = """
import threading
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.refused = pb_utils.MetricFamily(
            "square_late_sends_refused", "sends after the final flag", pb_utils.MetricFamily.COUNTER).Metric()

    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            threading.Thread(target=self.respond, args=(request.get_response_sender(), n)).start()
        return None

    def respond(self, sender, n):
        for _ in range(n):
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([n], np.int32))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        try:
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([n], np.int32))]))
        except pb_utils.TritonModelException as exc:
            if "Response sender has been closed" in exc.message():
                self.refused.increment(1)
"""

# Sums what square streams (exec(decoupled=True)); with parameter single=true it calls exec() instead.
BLS_SQUARE_PY = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            inputs = [pb_utils.get_input_tensor_by_name(r, "IN")]
            inner = pb_utils.InferenceRequest(model_name="square", inputs=inputs, requested_output_names=["OUT"])
            if json.loads(r.parameters()).get("single"):
                answer = inner.exec()
                out.append(pb_utils.InferenceResponse(error=answer.error()))
                continue
            total = np.zeros(1, np.int32)
            for answer in inner.exec(decoupled=True):
                total += pb_utils.get_output_tensor_by_name(answer, "OUT").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("SUM", total)]))
        return out
"""

# A decoupled model whose execute raises: the error ends the stream's request.
FAILING_DECOUPLED_PY = """
class TritonPythonModel:
    def execute(self, requests):
        raise ValueError("no responses today")
"""

# Custom metrics of all three kinds; parameters pick a family name/kind to try (bad cases).
METRICS_PY = """
import json
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.counter = pb_utils.MetricFamily("demo_requests", "requests seen", pb_utils.MetricFamily.COUNTER)
        self.gauge = pb_utils.MetricFamily("demo_last_value", "last INPUT0[0]", pb_utils.MetricFamily.GAUGE)
        self.histogram = pb_utils.MetricFamily("demo_value", "INPUT0[0] values", pb_utils.MetricFamily.HISTOGRAM)
        self.requests = self.counter.Metric(labels={"model": "metrics"})
        self.last = self.gauge.Metric(labels={"model": "metrics"})
        self.values = self.histogram.Metric(labels={"model": "metrics"}, buckets=[0.5, 2.0])

    def execute(self, requests):
        out = []
        for r in requests:
            wanted = json.loads(r.parameters())
            if "family" in wanted:
                try:
                    pb_utils.MetricFamily(wanted["family"], "try", wanted.get("kind", pb_utils.MetricFamily.GAUGE))
                except pb_utils.TritonModelException as exc:
                    error = pb_utils.TritonError(exc.message(), pb_utils.TritonError.INVALID_ARG)
                    out.append(pb_utils.InferenceResponse(error=error))
                    continue
            a = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            self.requests.increment(1)
            self.last.set(float(a[0]))
            self.values.observe(float(a[0]))
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", a), pb_utils.Tensor("OUTPUT1", a)]))
        return out
"""


def _repo(root):
    repo = root / "repo"
    write_model(repo, "add_sub", f'name: "add_sub"\nbackend: "python"\n{IO4}', {"model.py": ADD_SUB_PY})
    bls_io = IO4 + 'input [ { name: "MODEL_NAME" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
    write_model(repo, "bls", f'name: "bls"\nbackend: "python"\n{bls_io}', {"model.py": BLS_PY})
    # Calls itself with one instance: its inner request can only be answered by its queue timeout
    # (a queue policy needs dynamic batching, so batches of one; the inner request has no MODEL_NAME).
    selfish = (
        "max_batch_size: 1\n"
        + IO4
        + 'input [ { name: "MODEL_NAME" data_type: TYPE_STRING dims: [ 1 ] optional: true } ]\n'
        "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
        "dynamic_batching { default_queue_policy { default_timeout_microseconds: 200000 } }\n"
    )
    write_model(repo, "selfish", f'name: "selfish"\nbackend: "python"\n{selfish}', {"model.py": BLS_PY})
    write_model(repo, "bls_async", f'name: "bls_async"\nbackend: "python"\n{IO4}', {"model.py": BLS_ASYNC_PY})
    write_model(repo, "square", SQUARE_CONFIG, {"model.py": SQUARE_PY})
    write_model(
        repo,
        "bls_square",
        'name: "bls_square"\nbackend: "python"\ninput [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'output [ { name: "SUM" data_type: TYPE_INT32 dims: [ 1 ] } ]\n',
        {"model.py": BLS_SQUARE_PY},
    )
    write_model(repo, "failing", SQUARE_CONFIG.replace('"square"', '"failing"'), {"model.py": FAILING_DECOUPLED_PY})
    write_model(repo, "metrics", f'name: "metrics"\nbackend: "python"\n{IO4}', {"model.py": METRICS_PY})
    return repo


@pytest.fixture(scope="module", params=["h2", "grpcio"])
def server(request, tmp_path_factory):
    handle = start_server(_repo(tmp_path_factory.mktemp(f"pyb_{request.param}")), grpc_server=request.param)
    yield handle
    handle.stop()


def _add_sub_inputs(module, target=None):
    a = np.arange(4, dtype=np.float32)
    b = np.full(4, 0.5, dtype=np.float32)
    inputs = [module.InferInput("INPUT0", [4], "FP32"), module.InferInput("INPUT1", [4], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    if target is not None:
        name = module.InferInput("MODEL_NAME", [1], "BYTES")
        name.set_data_from_numpy(np.array([target.encode()], dtype=np.object_))
        inputs.append(name)
    return a, b, inputs


def _int_input(module, value):
    tensor = module.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([value], dtype=np.int32))
    return [tensor]


def _metrics_text(server) -> str:
    with urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=10) as response:
        return response.read().decode()


def _stream(server, model, requests, *, empty_final=False, expected=None):
    """Send ``requests`` (request id -> inputs) on one stream; collect (id, result or error) until
    ``expected`` items came."""
    items: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc)
    client.start_stream(callback=lambda result, error: items.put(error if error else result))
    try:
        for request_id, inputs in requests.items():
            client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=empty_final)
        return [items.get(timeout=30) for _ in range(expected)]
    finally:
        client.stop_stream()
        client.close()


# --- BLS ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bls_exec_runs_another_model_through_the_server(server, protocol):
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(server.http if protocol == "http" else server.grpc)
    a, b, inputs = _add_sub_inputs(module, "add_sub")

    result = client.infer("bls", inputs)

    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b)
    stats = httpclient.InferenceServerClient(server.http).get_inference_statistics("add_sub")
    assert int(stats["model_stats"][0]["inference_stats"]["success"]["count"]) >= 1  # add_sub ran it


def test_bls_to_an_unknown_model_is_an_error_response_in_tritons_words(server):
    client = httpclient.InferenceServerClient(server.http)
    _, _, inputs = _add_sub_inputs(httpclient, "no_such_model")

    with pytest.raises(InferenceServerException) as error:
        client.infer("bls", inputs)

    assert error.value.message() == "Failed for execute the inference request. Model 'no_such_model' is not ready."
    assert error.value.status() == "404"  # TritonError.NOT_FOUND, passed on by the model


def test_bls_to_itself_is_answered_by_its_queue_timeout_not_a_hang(server):
    client = httpclient.InferenceServerClient(server.http, network_timeout=60)
    _, _, inputs = _add_sub_inputs(httpclient, "selfish")
    for tensor in inputs:  # a batch of one
        tensor.set_shape([1, *tensor.shape()])

    with pytest.raises(InferenceServerException) as error:
        client.infer("selfish", inputs)

    assert error.value.status() == "503"
    assert error.value.message().startswith("Request timeout expired: request for model 'selfish")


def test_async_exec_gathers_two_bls_calls(server):
    client = grpcclient.InferenceServerClient(server.grpc)
    a, b, inputs = _add_sub_inputs(grpcclient)

    result = client.infer("bls_async", inputs)

    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b)


@pytest.mark.parametrize("n", [0, 1, 3])
def test_bls_exec_decoupled_iterates_every_streamed_response(server, n):
    client = httpclient.InferenceServerClient(server.http)

    result = client.infer("bls_square", _int_input(httpclient, n))

    assert result.as_numpy("SUM").tolist() == [n * n]


def test_bls_exec_of_a_decoupled_model_without_decoupled_true_says_how(server):
    client = httpclient.InferenceServerClient(server.http)

    with pytest.raises(InferenceServerException) as error:
        client.infer("bls_square", _int_input(httpclient, 2), parameters={"single": True})

    assert "Please use 'decoupled=True' argument to the 'exec' or 'async_exec' calls" in error.value.message()


# --- decoupled ---------------------------------------------------------------------------------


def test_decoupled_model_streams_zero_or_many_responses_per_request(server):
    items = _stream(
        server,
        "square",
        {"a": _int_input(grpcclient, 3), "b": _int_input(grpcclient, 0), "c": _int_input(grpcclient, 1)},
        expected=4,
    )

    by_id: dict[str, list[int]] = {}
    for item in items:
        assert not isinstance(item, InferenceServerException), item
        response = item.get_response()
        by_id.setdefault(response.id, []).append(int(item.as_numpy("OUT")[0]))
        assert response.parameters["triton_final_response"].bool_param is False
    assert by_id == {"a": [3, 3, 3], "c": [1]}


def test_empty_final_response_when_the_client_asks_for_it(server):
    items = _stream(
        server, "square", {"x": _int_input(grpcclient, 2), "z": _int_input(grpcclient, 0)}, empty_final=True, expected=4
    )

    finals = [
        item.get_response() for item in items if item.get_response().parameters["triton_final_response"].bool_param
    ]
    assert sorted(response.id for response in finals) == ["x", "z"]
    assert all(len(response.outputs) == 0 for response in finals)


def _sample(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_a_send_after_the_final_flag_is_refused_and_the_server_goes_on(server):
    before = _sample(_metrics_text(server), "square_late_sends_refused")
    _stream(server, "square", {"late": _int_input(grpcclient, 1)}, expected=1)

    # The model's late send raised in its own thread, which counts it; wait for that thread.
    deadline = time.monotonic() + 20
    while _sample(_metrics_text(server), "square_late_sends_refused") < before + 1:
        assert time.monotonic() < deadline, "the late send was never refused"
        time.sleep(0.01)
    result = httpclient.InferenceServerClient(server.http).infer("bls_square", _int_input(httpclient, 2))
    assert result.as_numpy("SUM").tolist() == [4]


def test_execute_raising_in_a_decoupled_model_ends_the_request_with_its_error(server):
    (item,) = _stream(server, "failing", {"f": _int_input(grpcclient, 1)}, expected=1)

    assert isinstance(item, InferenceServerException)
    assert "ValueError: no responses today" in item.message()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_unary_infer_on_a_decoupled_model_is_refused(server, protocol):
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(server.http if protocol == "http" else server.grpc)

    with pytest.raises(InferenceServerException) as error:
        client.infer("square", _int_input(module, 1))

    assert "doesn't support models with decoupled transaction policy" in error.value.message()
    assert error.value.status() == ("501" if protocol == "http" else "StatusCode.UNIMPLEMENTED")  # Triton's


# --- custom metrics ----------------------------------------------------------------------------


def test_custom_metrics_are_exported_beside_sluices(server):
    client = httpclient.InferenceServerClient(server.http)
    _, _, inputs = _add_sub_inputs(httpclient)
    client.infer("metrics", inputs)

    text = _metrics_text(server)

    assert "sluice_request_success" in text
    assert "# HELP demo_requests requests seen\n# TYPE demo_requests counter\n" in text
    assert 'demo_requests{model="metrics"} ' in text
    assert 'demo_last_value{model="metrics"} 0.0' in text
    assert "# TYPE demo_value histogram" in text
    assert (
        'demo_value_bucket{le="0.5",model="metrics"} ' in text or 'demo_value_bucket{model="metrics",le="0.5"} ' in text
    )
    assert 'demo_value_count{model="metrics"} ' in text


@pytest.mark.parametrize(
    ("family", "kind", "expected"),
    [
        ("bad-name", "gauge", "Invalid metric family name 'bad-name'"),
        ("demo_requests", "gauge", "already exists with kind COUNTER"),
        ("sluice_request_success", "gauge", "reserved for the server's own metrics"),
        ("fine_name", "summary", "Invalid metric family kind 'summary'"),
    ],
)
def test_a_bad_metric_family_is_refused_with_a_clear_error(server, family, kind, expected):
    client = httpclient.InferenceServerClient(server.http)
    _, _, inputs = _add_sub_inputs(httpclient)

    with pytest.raises(InferenceServerException) as error:
        client.infer("metrics", inputs, parameters={"family": family, "kind": kind})

    assert expected in error.value.message()
    assert error.value.status() == "400"


def test_families_leave_the_metrics_port_when_their_model_unloads(tmp_path):
    repo = tmp_path / "repo"
    write_model(repo, "metrics", f'name: "metrics"\nbackend: "python"\n{IO4}', {"model.py": METRICS_PY})
    handle = start_server(repo, **EXPLICIT)  # the unload below needs the repository API
    try:
        assert "# TYPE demo_requests counter" in _metrics_text(handle)
        httpclient.InferenceServerClient(handle.http).unload_model("metrics")
        assert "demo_requests" not in _metrics_text(handle)
    finally:
        handle.stop()


# --- auto_complete_config ----------------------------------------------------------------------

AUTO_PY = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [2]})
        config.add_output({"name": "OUT", "data_type": "TYPE_FP32", "dims": [2]})
        return config

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())])
            for r in requests
        ]
"""


def test_auto_complete_fills_the_config_unless_disabled(tmp_path):
    repo = tmp_path / "repo"
    write_model(repo, "auto", 'backend: "python"\n', {"model.py": AUTO_PY})
    handle = start_server(repo)
    try:
        config = httpclient.InferenceServerClient(handle.http).get_model_config("auto")
        assert [entry["name"] for entry in config["input"]] == ["IN"]
    finally:
        handle.stop()
    handle = start_server(repo, auto_complete_config=False)
    try:
        config = httpclient.InferenceServerClient(handle.http).get_model_config("auto")
        assert config.get("input", []) == []
    finally:
        handle.stop()


def test_auto_complete_conflicting_with_the_config_fails_the_load(tmp_path):
    repo = tmp_path / "repo"
    write_model(
        repo,
        "auto",
        'backend: "python"\ninput [ { name: "IN" data_type: TYPE_INT32 dims: [ 2 ] } ]\n',
        {"model.py": AUTO_PY},
    )
    handle = start_server(repo)
    try:
        message = handle.server.failed_models["auto"]
        assert "auto_complete_config raised ValueError" in message
        assert "configuration expects datatype TYPE_INT32 for input 'IN', model provides TYPE_FP32" in message
    finally:
        handle.stop()
