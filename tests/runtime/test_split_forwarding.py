"""The no-mesh canary split (``--split-file``): two real servers on loopback, a stable one serving
version 1 of ``add_sub`` and a canary serving version 2 of the same name, called with tritonclient
over HTTP and gRPC. Which server answered shows in the response's model version. The split file is
re-read on the server's clock: the tests move a manual clock instead of sleeping.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from sluice.runtime.split import Route, SplitFileError, parse_split_file

from .conftest import ADD_SUB_CONFIG, BUILDERS, IDENTITY_PY, MLP_CONFIG, ManualClock, Running, write_model
from .test_cli_shutdown import start_ports

A = np.arange(16, dtype=np.float32)
B = np.full(16, 2.0, dtype=np.float32)


# --- helpers -------------------------------------------------------------------------------------


def add_sub_repo(root: Path, version: int) -> Path:
    repo = root / f"repo-v{version}"
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()}, version=version)
    return repo


def write_split(path: Path, target: str, percent: int, model: str = "add_sub") -> None:
    path.write_text(json.dumps({"models": {model: {"target": target, "percent": percent}}}))


def reload(stable: Running, clock: ManualClock) -> None:
    """One poll period of the server's clock: the split file is read again."""
    clock.advance(1.0)
    stable.settle()


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_infer(server: Running, version: str = "", request_id: str = "") -> httpclient.InferResult:
    inputs = [httpclient.InferInput("INPUT0", [16], "FP32"), httpclient.InferInput("INPUT1", [16], "FP32")]
    inputs[0].set_data_from_numpy(A, binary_data=True)
    inputs[1].set_data_from_numpy(B, binary_data=False)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)]
    client = httpclient.InferenceServerClient(server.http)
    return client.infer("add_sub", inputs, model_version=version, outputs=outputs, request_id=request_id)


def grpc_infer(server: Running, version: str = "", request_id: str = "") -> grpcclient.InferResult:
    inputs = [grpcclient.InferInput("INPUT0", [16], "FP32"), grpcclient.InferInput("INPUT1", [16], "FP32")]
    inputs[0].set_data_from_numpy(A)
    inputs[1].set_data_from_numpy(B)
    client = grpcclient.InferenceServerClient(server.grpc)
    return client.infer("add_sub", inputs, model_version=version, request_id=request_id)


def http_versions(server: Running, n: int, version: str = "") -> list[str]:
    answered = []
    for _ in range(n):
        result = http_infer(server, version)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)  # right answer, whoever gave it
        answered.append(result.get_response()["model_version"])
    return answered


def grpc_versions(server: Running, n: int, version: str = "") -> list[str]:
    answered = []
    for _ in range(n):
        result = grpc_infer(server, version)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)
        answered.append(result.get_response().model_version)
    return answered


def successes(server: Running, model: str = "add_sub") -> int:
    stats = httpclient.InferenceServerClient(server.http).get_inference_statistics(model)
    return sum(entry["inference_stats"]["success"]["count"] for entry in stats["model_stats"])


def failures(server: Running, model: str = "add_sub") -> int:
    stats = httpclient.InferenceServerClient(server.http).get_inference_statistics(model)
    return sum(entry["inference_stats"]["fail"]["count"] for entry in stats["model_stats"])


def samples(server: Running) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith(("sluice_split_percent", "sluice_forwarded_requests"))
    }


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Wait for an effect in another server (a cancellation crossing the wire), not for time to pass."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.005)


def metric(server: Running, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=5) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0




def split_percent(target: str, model: str = "add_sub") -> tuple[str, tuple[tuple[str, str], ...]]:
    return ("sluice_split_percent", (("model", model), ("target", target)))


def forwarded(target: str, outcome: str, model: str = "add_sub") -> tuple[str, tuple[tuple[str, str], ...]]:
    return ("sluice_forwarded_requests_total", (("model", model), ("outcome", outcome), ("target", target)))


@pytest.fixture
def canary(tmp_path: Path, serve) -> Running:
    return serve(add_sub_repo(tmp_path, 2))


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def split_file(tmp_path: Path) -> Path:
    return tmp_path / "split" / "split.json"


@pytest.fixture
def stable_repo(tmp_path: Path) -> Path:
    return add_sub_repo(tmp_path, 1)


# --- the split over the wire ---------------------------------------------------------------------


def test_a_quarter_goes_to_the_canary_exactly_and_only_the_canary_counts_it(
    stable_repo, canary, serve, split_file, clock
):
    split_file.parent.mkdir()
    write_split(split_file, canary.grpc, 25)
    stable = serve(stable_repo, split_file=split_file, clock=clock)

    over_http = http_versions(stable, 100)
    assert over_http.count("2") == 25 and over_http.count("1") == 75
    assert [i for i, v in enumerate(over_http) if v == "2"] == list(range(3, 100, 4))  # spread, no burst
    over_grpc = grpc_versions(stable, 100)
    assert over_grpc.count("2") == 25 and over_grpc.count("1") == 75

    assert successes(canary) == 50  # the canary counts what it served
    assert successes(stable) == 150  # the stable pod does not count what it forwarded
    metrics = samples(stable)
    assert metrics[split_percent(canary.grpc)] == 25
    assert metrics[forwarded(canary.grpc, "success")] == 50
    assert metrics[forwarded(canary.grpc, "failure")] == 0


def test_requests_decoded_by_protocol_workers_are_split_the_same(stable_repo, canary, serve, split_file, clock):
    # The operator runs stable pods with --split-file always and --protocol-workers when asked: a request a
    # worker decodes reaches the engine's split like one the engine decodes itself.
    split_file.parent.mkdir()
    write_split(split_file, canary.grpc, 25)
    stable = serve(stable_repo, split_file=split_file, clock=clock, protocol_workers=2)

    over_http = http_versions(stable, 40)
    over_grpc = grpc_versions(stable, 40)
    assert over_http.count("2") == 10 and over_grpc.count("2") == 10
    assert successes(canary) == 20 and successes(stable) == 60
    assert samples(stable)[forwarded(canary.grpc, "success")] == 20


def test_the_request_id_and_raw_contents_pass_through(stable_repo, canary, serve, split_file, clock):
    split_file.parent.mkdir()
    write_split(split_file, canary.grpc, 100)
    stable = serve(stable_repo, split_file=split_file, clock=clock)

    result = http_infer(stable, request_id="req-h")
    assert result.get_response()["id"] == "req-h" and result.get_response()["model_version"] == "2"
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)
    assert result.as_numpy("OUTPUT1") is None  # only the requested output came back
    answer = grpc_infer(stable, request_id="req-g")
    assert answer.get_response().id == "req-g" and answer.get_response().model_version == "2"
    np.testing.assert_array_equal(answer.as_numpy("OUTPUT0"), A + B)


def test_bytes_tensors_are_forwarded_as_they_are(tmp_path: Path, serve, split_file, clock):
    config = """
    name: "echo"
    backend: "python"
    max_batch_size: 0
    input [ { name: "INPUT0", data_type: TYPE_STRING, dims: [ -1 ] } ]
    output [ { name: "OUTPUT0", data_type: TYPE_STRING, dims: [ -1 ] } ]
    """
    write_model(tmp_path / "c", "echo", config, {"model.py": IDENTITY_PY}, version=2)
    write_model(tmp_path / "s", "echo", config, {"model.py": IDENTITY_PY}, version=1)
    canary = serve(tmp_path / "c")
    split_file.parent.mkdir()
    write_split(split_file, canary.grpc, 100, model="echo")
    stable = serve(tmp_path / "s", split_file=split_file, clock=clock)
    data = np.array([b"", b"\x00\xff binary", "é".encode()], dtype=object)

    inp = httpclient.InferInput("INPUT0", [3], "BYTES")
    inp.set_data_from_numpy(data, binary_data=True)
    result = httpclient.InferenceServerClient(stable.http).infer("echo", [inp])
    assert result.get_response()["model_version"] == "2"
    assert list(result.as_numpy("OUTPUT0")) == list(data)
    ginp = grpcclient.InferInput("INPUT0", [3], "BYTES")
    ginp.set_data_from_numpy(data)
    answer = grpcclient.InferenceServerClient(stable.grpc).infer("echo", [ginp])
    assert answer.get_response().model_version == "2" and list(answer.as_numpy("OUTPUT0")) == list(data)


def test_percent_zero_forwards_nothing(stable_repo, canary, serve, split_file, clock):
    split_file.parent.mkdir()
    write_split(split_file, canary.grpc, 0)
    stable = serve(stable_repo, split_file=split_file, clock=clock)

    assert set(http_versions(stable, 50)) == {"1"}
    assert set(grpc_versions(stable, 50)) == {"1"}
    assert successes(canary) == 0
    assert samples(stable)[split_percent(canary.grpc)] == 0


def test_a_request_naming_a_version_is_never_forwarded(stable_repo, canary, serve, split_file, clock):
    split_file.parent.mkdir()
    write_split(split_file, canary.grpc, 100)
    stable = serve(stable_repo, split_file=split_file, clock=clock)

    assert set(http_versions(stable, 20, version="1")) == {"1"}
    assert set(grpc_versions(stable, 20, version="1")) == {"1"}
    # The client asked for version 2 of this server, which does not have it: not the canary's to answer.
    with pytest.raises(InferenceServerException) as caught:
        http_infer(stable, version="2")
    assert caught.value.status() == "404"
    with pytest.raises(InferenceServerException) as caught:
        grpc_infer(stable, version="2")
    assert caught.value.status() == "StatusCode.NOT_FOUND"
    assert successes(canary) == 0
    assert set(http_versions(stable, 4)) == {"2"}  # without a version, 100 % go to the canary


def test_a_new_percent_applies_at_the_next_poll(stable_repo, canary, serve, split_file, clock):
    split_file.parent.mkdir()
    write_split(split_file, canary.grpc, 25)
    stable = serve(stable_repo, split_file=split_file, clock=clock)
    assert http_versions(stable, 100).count("2") == 25

    write_split(split_file, canary.grpc, 50)
    assert http_versions(stable, 20).count("2") == 5  # not read yet: still 25 %
    clock.advance(0.5)
    stable.settle()
    assert http_versions(stable, 20).count("2") == 5  # half a poll period: still 25 %
    reload(stable, clock)
    assert grpc_versions(stable, 100).count("2") == 50
    assert samples(stable)[split_percent(canary.grpc)] == 50

    split_file.unlink()  # a removed file: no split
    reload(stable, clock)
    assert set(http_versions(stable, 10)) == {"1"}
    assert split_percent(canary.grpc) not in samples(stable)
    assert samples(stable)[forwarded(canary.grpc, "success")] == 25 + 5 + 5 + 50  # counters stay


def test_a_missing_file_at_start_is_no_split_until_it_appears(stable_repo, canary, serve, split_file, clock):
    stable = serve(stable_repo, split_file=split_file, clock=clock)
    assert set(http_versions(stable, 10)) == {"1"}

    split_file.parent.mkdir()
    write_split(split_file, canary.grpc, 100)
    reload(stable, clock)
    assert set(grpc_versions(stable, 5)) == {"2"}


def test_an_invalid_file_keeps_the_split_in_force_and_is_logged_once(
    stable_repo, canary, serve, split_file, clock, caplog
):
    split_file.parent.mkdir()
    write_split(split_file, canary.grpc, 25)
    stable = serve(stable_repo, split_file=split_file, clock=clock)
    assert http_versions(stable, 100).count("2") == 25

    caplog.set_level(logging.ERROR, logger="sluice.runtime.forwarding")
    split_file.write_text(json.dumps({"models": {"add_sub": {"target": canary.grpc, "percent": 150}}}))
    reload(stable, clock)
    reload(stable, clock)  # the same bad content again: not logged again
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors
    assert str(split_file) in errors[0] and "'models.add_sub.percent'" in errors[0] and "0 to 100" in errors[0]
    assert http_versions(stable, 100).count("2") == 25
    assert samples(stable)[split_percent(canary.grpc)] == 25

    split_file.write_text("{not json")
    reload(stable, clock)
    assert grpc_versions(stable, 100).count("2") == 25
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 2


def test_a_canary_that_cannot_be_reached_is_served_here_and_counted_as_fallback(
        stable_repo, serve, split_file, clock):
    # The split file still names a canary whose Service is gone (kubelet has not caught up with a
    # rollback yet): nothing reached it, so the stable pod serves the request instead of failing it.
    target = f"127.0.0.1:{closed_port()}"
    split_file.parent.mkdir()
    write_split(split_file, target, 100)
    stable = serve(stable_repo, split_file=split_file, clock=clock)

    assert http_versions(stable, 2) == ["1", "1"]
    assert grpc_versions(stable, 2) == ["1", "1"]
    assert successes(stable) == 4 and failures(stable) == 0  # served (and counted) here
    metrics = samples(stable)
    assert metrics[forwarded(target, "fallback")] == 4
    assert metrics[forwarded(target, "failure")] == 0 and metrics[forwarded(target, "success")] == 0


def test_a_canary_error_keeps_its_status(stable_repo, tmp_path: Path, serve, split_file, clock):
    other = tmp_path / "other"
    write_model(other, "mlp", MLP_CONFIG, {"model.onnx": BUILDERS.mlp_model()})
    canary = serve(other)  # serves no add_sub at all
    split_file.parent.mkdir()
    write_split(split_file, canary.grpc, 100)
    stable = serve(stable_repo, split_file=split_file, clock=clock)

    with pytest.raises(InferenceServerException) as caught:
        http_infer(stable)
    assert caught.value.status() == "404"
    assert "Request for unknown model: 'add_sub'" in caught.value.message() and canary.grpc in caught.value.message()
    with pytest.raises(InferenceServerException) as caught:
        grpc_infer(stable)
    assert caught.value.status() == "StatusCode.NOT_FOUND"
    assert samples(stable)[forwarded(canary.grpc, "failure")] == 2


def test_a_client_that_goes_away_cancels_the_forwarded_call(tmp_path: Path, serve, split_file, clock):
    # The canary's model waits for a fuller batch for 10 s of the canary's own (manual) clock, so the
    # forwarded request sits in its queue until the client cancels it.
    fixed_wait = 'parameters { key: "batch_policy" value { string_value: "fixed_wait" } }'
    waits = MLP_CONFIG.replace("500 }", "10000000 }\n" + fixed_wait)
    write_model(tmp_path / "c", "mlp", waits, {"model.onnx": BUILDERS.mlp_model()}, version=2)
    write_model(tmp_path / "s", "mlp", MLP_CONFIG, {"model.onnx": BUILDERS.mlp_model()}, version=1)
    canary_clock = ManualClock()
    canary = serve(tmp_path / "c", clock=canary_clock)
    split_file.parent.mkdir()
    write_split(split_file, canary.grpc, 100, model="mlp")
    stable = serve(tmp_path / "s", split_file=split_file, clock=clock)

    inp = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(np.ones((1, 16), np.float32))
    answers: list[object] = []
    client = grpcclient.InferenceServerClient(stable.grpc)
    call = client.async_infer("mlp", [inp], lambda result, error: answers.append(error or result))
    wait_until(lambda: metric(canary, "sluice_queue_depth", model="mlp") == 1, "the request queued at the canary")
    call.cancel()
    wait_until(lambda: metric(canary, "sluice_rejected_total", model="mlp", reason="cancelled") == 1,
               "the canary saw the cancellation")
    assert metric(canary, "sluice_queue_depth", model="mlp") == 0
    canary_clock.advance(10.0)
    canary.settle()
    assert successes(canary, "mlp") == 0  # never executed
    assert samples(stable)[forwarded(canary.grpc, "failure", model="mlp")] == 1
    assert successes(stable, "mlp") == 0 and failures(stable, "mlp") == 0
    client.close()


def test_the_command_line_flag_splits(stable_repo, canary, tmp_path: Path, split_file):
    split_file.parent.mkdir()
    write_split(split_file, canary.grpc, 50)
    proc, ports = start_ports(stable_repo, tmp_path, "--split-file", str(split_file))
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{ports['grpc']}")
        inputs = [grpcclient.InferInput(n, [16], "FP32") for n in ("INPUT0", "INPUT1")]
        for tensor in inputs:
            tensor.set_data_from_numpy(A)
        answered = [client.infer("add_sub", inputs).get_response().model_version for _ in range(10)]
        assert answered == ["1", "2"] * 5
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0


def test_no_split_file_exports_no_split_metrics(stable_repo, serve):
    stable = serve(stable_repo)
    assert set(http_versions(stable, 3)) == {"1"}
    assert samples(stable) == {}


# --- the file format -----------------------------------------------------------------------------


def test_a_valid_file_names_each_models_route():
    text = json.dumps(
        {
            "models": {
                "mnist": {"target": "mnist-canary.ns.svc.cluster.local:8001", "percent": 25},
                "bert": {"percent": 0, "target": "[fd00::1]:9001"},
            }
        }
    )
    assert parse_split_file(text, "/etc/split.json") == {
        "mnist": Route("mnist-canary.ns.svc.cluster.local:8001", 25),
        "bert": Route("[fd00::1]:9001", 0),
    }
    assert parse_split_file(b'{"models": {}}', "f") == {}


GOOD = {"target": "c:8001", "percent": 10}


@pytest.mark.parametrize(
    ("document", "field", "says"),
    [
        ("{", None, "not valid JSON"),
        (b"\xff\xfe", None, "not valid JSON"),
        ("[]", None, "expected a JSON object"),
        ({}, "models", "missing"),
        ({"models": [], "extra": 1}, "extra", "unknown key; allowed: 'models'"),
        ({"models": []}, "models", "a list; expected an object"),
        ({"models": {"a/b": GOOD}}, "models.a/b", "path separator"),
        ({"models": {"m": 25}}, "models.m", "expected an object"),
        ({"models": {"m": {**GOOD, "weight": 5}}}, "models.m.weight", "unknown key; allowed: 'target', 'percent'"),
        ({"models": {"m": {"percent": 5}}}, "models.m.target", "missing; expected '<host>:<port>'"),
        ({"models": {"m": {**GOOD, "target": 8001}}}, "models.m.target", "8001 is not a string"),
        ({"models": {"m": {**GOOD, "target": "canary"}}}, "models.m.target", "it has no port"),
        ({"models": {"m": {**GOOD, "target": ":8001"}}}, "models.m.target", "it has no port"),
        ({"models": {"m": {**GOOD, "target": "grpc://c:8001"}}}, "models.m.target", "no scheme, path or spaces"),
        ({"models": {"m": {**GOOD, "target": "c:8001/v2"}}}, "models.m.target", "is not a number from 1 to 65535"),
        ({"models": {"m": {**GOOD, "target": "c:0"}}}, "models.m.target", "'0' is not a number from 1 to 65535"),
        ({"models": {"m": {**GOOD, "target": "c:70000"}}}, "models.m.target", "is not a number from 1 to 65535"),
        ({"models": {"m": {**GOOD, "target": "[::1:8001"}}}, "models.m.target", "must be written [address]"),
        ({"models": {"m": {"target": "c:1"}}}, "models.m.percent", "missing; allowed: an integer from 0 to 100"),
        ({"models": {"m": {**GOOD, "percent": 101}}}, "models.m.percent", "101 is not allowed"),
        ({"models": {"m": {**GOOD, "percent": -1}}}, "models.m.percent", "-1 is not allowed"),
        ({"models": {"m": {**GOOD, "percent": 25.0}}}, "models.m.percent", "25.0 is not allowed"),
        ({"models": {"m": {**GOOD, "percent": "25"}}}, "models.m.percent", "'25' is not allowed"),
        ({"models": {"m": {**GOOD, "percent": True}}}, "models.m.percent", "True is not allowed"),
    ],
)
def test_an_invalid_file_names_the_file_and_the_field(document, field, says):
    text = document if isinstance(document, str | bytes) else json.dumps(document)
    with pytest.raises(SplitFileError) as caught:
        parse_split_file(text, "/etc/sluice/split.json")
    message = str(caught.value)
    assert message.startswith("split file /etc/sluice/split.json: ")
    assert caught.value.field == field
    if field is not None:
        assert f"field '{field}': " in message
    assert says in message, message


# --- requests the split must keep together or here ------------------------------------------------

STREAM_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.version = int(args["model_version"])

    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            sender = request.get_response_sender()
            for _ in range(n):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([self.version], np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""
STREAM_CONFIG = """
name: "stream"
backend: "python"
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""


def test_every_request_of_a_sequence_goes_to_the_same_server(tmp_path: Path, serve, split_file, clock):
    """A sequence's state lives in one server: its requests are routed by the sequence's bucket, the
    same way by every stable replica, so half the sequences run whole on the canary, half here."""
    from sluice.runtime.split import sequence_bucket
    from sluice_testing import sequence_models as sm

    repos = {}
    for version in (1, 2):
        repos[version] = tmp_path / f"acc-v{version}"
        write_model(repos[version], "acc", sm.accumulator_config("acc"), {"model.onnx": sm.accumulator_onnx()},
                    version=version)
    canary = serve(repos[2])
    split_file.parent.mkdir()
    write_split(split_file, canary.grpc, 50, model="acc")
    stable = serve(repos[1], split_file=split_file, clock=clock)

    client = grpcclient.InferenceServerClient(stable.grpc)
    where = {}
    for sequence in range(1, 21):
        totals, versions = [], set()
        for step, value in enumerate((1, 2, 3, 4)):
            tensor = grpcclient.InferInput("INPUT", [1, 1], "INT32")
            tensor.set_data_from_numpy(np.array([[value]], np.int32))
            result = client.infer("acc", [tensor], sequence_id=sequence, sequence_start=step == 0,
                                  sequence_end=step == 3)
            totals.append(int(result.as_numpy("OUTPUT")[0][0]))
            versions.add(result.get_response().model_version)
        assert totals == [1, 3, 6, 10], (sequence, totals)
        [where[sequence]] = versions
        assert where[sequence] == ("2" if sequence_bucket(sequence) < 50 else "1")
    assert set(where.values()) == {"1", "2"}


def test_a_decoupled_models_stream_is_served_here_not_forwarded(tmp_path: Path, serve, split_file, clock):
    """The forward is one ModelInfer call, which a decoupled model refuses: its streams stay here."""
    repos = {}
    for version in (1, 2):
        repos[version] = tmp_path / f"stream-v{version}"
        write_model(repos[version], "stream", STREAM_CONFIG, {"model.py": STREAM_PY}, version=version)
    canary = serve(repos[2])
    split_file.parent.mkdir()
    write_split(split_file, canary.grpc, 100, model="stream")
    stable = serve(repos[1], split_file=split_file, clock=clock)

    import queue

    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(stable.grpc)
    client.start_stream(callback=lambda result, error: answers.put(error or result))
    try:
        tensor = grpcclient.InferInput("IN", [1], "INT32")
        tensor.set_data_from_numpy(np.array([3], np.int32))
        client.async_stream_infer("stream", [tensor])
        got = [answers.get(timeout=30) for _ in range(3)]
    finally:
        client.stop_stream()
    assert all(not isinstance(item, InferenceServerException) for item in got), got
    assert [int(item.as_numpy("OUT")[0]) for item in got] == [1, 1, 1]
    assert samples(stable).get(forwarded(canary.grpc, "success", model="stream"), 0) == 0


def test_a_request_refused_here_after_an_unreachable_canary_is_still_answered(
        stable_repo, serve, split_file, clock):
    """The fallback to this server can refuse at once (a wrong shape): the client gets that answer."""
    split_file.parent.mkdir()
    write_split(split_file, f"127.0.0.1:{closed_port()}", 100)
    stable = serve(stable_repo, split_file=split_file, clock=clock)
    inputs = [grpcclient.InferInput("INPUT0", [2], "FP32"), grpcclient.InferInput("INPUT1", [2], "FP32")]
    for tensor in inputs:
        tensor.set_data_from_numpy(np.zeros(2, np.float32))
    with pytest.raises(InferenceServerException) as caught:
        grpcclient.InferenceServerClient(stable.grpc).infer("add_sub", inputs, client_timeout=20)
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT", caught.value
    assert "[16]" in caught.value.message()


def test_an_integer_parameter_grpc_cannot_carry_is_served_here(stable_repo, canary, serve, split_file, clock):
    """JSON integers are unbounded; gRPC's are 64-bit: such a request is not sent to the canary (it
    would be the canary's failure), it is served here as an unsplit server serves it."""
    split_file.parent.mkdir()
    write_split(split_file, canary.grpc, 100)
    stable = serve(stable_repo, split_file=split_file, clock=clock)
    body = {"inputs": [{"name": "INPUT0", "shape": [16], "datatype": "FP32", "data": A.tolist()},
                       {"name": "INPUT1", "shape": [16], "datatype": "FP32", "data": B.tolist()}],
            "parameters": {"custom": 2**64}}
    request = urllib.request.Request(f"http://{stable.http}/v2/models/add_sub/infer", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=20) as response:
        answer = json.loads(response.read())
    assert answer["model_version"] == "1"
    assert not any(key[0] == "sluice_forwarded_requests_total" and value for key, value in samples(stable).items())


CODED_ADD_SUB_PY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(error=pb_utils.TritonError("{word}", pb_utils.TritonError.{code}))
                for _ in requests]
"""


@pytest.mark.parametrize(
    ("code", "http_status", "grpc_status"),
    [("UNKNOWN", "400", "StatusCode.UNKNOWN"), ("ALREADY_EXISTS", "400", "StatusCode.ALREADY_EXISTS")],
)
def test_a_canary_model_error_code_answers_as_it_would_locally(
    stable_repo, tmp_path: Path, serve, split_file, clock, code, http_status, grpc_status
):
    other = tmp_path / "other"
    config = ADD_SUB_CONFIG.replace('backend: "onnxruntime"', 'backend: "python"')
    write_model(other, "add_sub", config, {"model.py": CODED_ADD_SUB_PY.format(word=code.lower(), code=code)})
    canary = serve(other)
    split_file.parent.mkdir()
    write_split(split_file, canary.grpc, 100)
    stable = serve(stable_repo, split_file=split_file, clock=clock)
    with pytest.raises(InferenceServerException) as caught:
        http_infer(stable)
    assert caught.value.status() == http_status and code.lower() in caught.value.message()
    with pytest.raises(InferenceServerException) as caught:
        grpc_infer(stable)
    assert caught.value.status() == grpc_status
