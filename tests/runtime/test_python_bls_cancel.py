"""BLS requests keep the data plane's cancellation and queue timeout, end to end.

A Python BLS model (``outer``, two instances) calls a gated Python model (``target``, one instance,
batches of one, a queue policy that rejects after 1 s). The server runs in this process, so both model files reach
a gate the test holds through ``sys.modules``: the target waits on it (a bounded wait on an event)
and records what it ran and whether it saw its request cancelled; the outer model records what its
BLS call answered and whether its own request was cancelled. The client is tritonclient's gRPC
``async_infer``, whose handle's ``cancel()`` resets the call. The queue timeout runs on the
server's injected clock (``ManualClock``): the test moves it, nothing sleeps.
"""

from __future__ import annotations

import re
import sys
import threading
import time
import types
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from .conftest import ManualClock, Running, start_server, write_model  # type: ignore[import-not-found]

GATE = "sluice_test_bls_cancel_gate"

IO = """
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

TARGET_CONFIG = f"""
name: "target"
backend: "python"
max_batch_size: 1
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
dynamic_batching {{
  default_queue_policy {{ default_timeout_microseconds: 1000000 timeout_action: REJECT allow_timeout_override: true }}
}}
{IO}
"""

# Runs one request at a time; holds it until the gate opens or its request is cancelled.
TARGET_PY = """
import sys
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        gate = sys.modules["GATE"]
        out = []
        for request in requests:
            value = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().flat[0])
            gate.ran.append(value)
            gate.started[value].set()
            while not gate.release.wait(0.01):
                if request.is_cancelled():
                    gate.saw_cancel.append(value)
                    break
            echo = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", echo)]))
        return out
""".replace("GATE", GATE)

OUTER_CONFIG = f"""
name: "outer"
backend: "python"
instance_group [ {{ count: 2 kind: KIND_CPU }} ]
{IO}
"""

# BLS-calls target with its input (and the request parameter bls_timeout_us as the BLS timeout);
# records the answer and whether its own request was cancelled, then passes the answer on.
OUTER_PY = """
import json
import sys
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        gate = sys.modules["GATE"]
        out = []
        for request in requests:
            value = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            timeout = int(json.loads(request.parameters()).get("bls_timeout_us", 0))
            row = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().reshape(1, 1)  # a batch of one
            inner = pb_utils.InferenceRequest(
                model_name="target", requested_output_names=["OUT"], inputs=[pb_utils.Tensor("IN", row)],
                timeout=timeout)
            answer = inner.exec()
            error = answer.error()
            gate.outer[value] = {
                "error": None if error is None else (error.code(), error.message()),
                "cancelled": request.is_cancelled(),
            }
            gate.outer_done[value].set()
            if answer.has_error():
                out.append(pb_utils.InferenceResponse(error=error))
            else:
                echo = pb_utils.get_output_tensor_by_name(answer, "OUT").as_numpy().reshape(1)
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", echo)]))
        return out
""".replace("GATE", GATE)


def _gate_state() -> dict[str, Any]:
    return {
        "release": threading.Event(),
        "ran": [],
        "saw_cancel": [],
        "outer": {},
        "started": {value: threading.Event() for value in range(1, 5)},
        "outer_done": {value: threading.Event() for value in range(1, 5)},
    }


@pytest.fixture(scope="module")
def gate_module() -> Iterator[types.ModuleType]:
    module = types.ModuleType(GATE)
    module.__dict__.update(_gate_state())
    sys.modules[GATE] = module
    yield module
    module.release.set()
    sys.modules.pop(GATE, None)


@pytest.fixture(scope="module")
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture(scope="module", params=["h2", "grpcio"])
def server(
    request: pytest.FixtureRequest,
    gate_module: types.ModuleType,
    clock: ManualClock,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Running]:
    """The server on each gRPC front end (their cancellation paths differ)."""
    repo: Path = tmp_path_factory.mktemp("bls_cancel") / "repo"
    write_model(repo, "target", TARGET_CONFIG, {"model.py": TARGET_PY})
    write_model(repo, "outer", OUTER_CONFIG, {"model.py": OUTER_PY})
    handle = start_server(repo, clock=clock, grpc_server=request.param)
    yield handle
    gate_module.release.set()
    handle.stop()


@pytest.fixture
def gate(gate_module: types.ModuleType, server: Running) -> Iterator[types.ModuleType]:
    """The gate, fresh for each test; opened at the end so nothing stays blocked."""
    gate_module.release.set()  # a previous test's requests finish
    wait_until(lambda: queue_depth(server, "target") == 0, "the target's queue to drain")
    gate_module.__dict__.update(_gate_state())
    yield gate_module
    gate_module.release.set()


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.005)


def queue_depth(server: Running, model: str) -> float:
    text = urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=5).read().decode()
    match = re.search(rf'^sluice_queue_depth\{{model="{model}",version="1"\}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


class Call:
    """One gRPC ``async_infer`` of ``outer``: its handle (``cancel()``) and its outcome."""

    def __init__(self, client: grpcclient.InferenceServerClient, value: int, **parameters: Any) -> None:
        self.done = threading.Event()
        self.result: Any = None
        self.error: Any = None
        tensor = grpcclient.InferInput("IN", [1], "INT32")
        tensor.set_data_from_numpy(np.array([value], dtype=np.int32))

        def callback(result: Any, error: Any) -> None:
            self.result, self.error = result, error
            self.done.set()

        self.handle = client.async_infer("outer", [tensor], callback, parameters=parameters or None)

    def outcome(self) -> Any:
        assert self.done.wait(10), "no answer"
        return self.result if self.error is None else self.error

    def value(self) -> list[int]:
        outcome = self.outcome()
        assert self.error is None, str(outcome)
        return outcome.as_numpy("OUT").tolist()


@pytest.fixture
def client(server: Running) -> Iterator[grpcclient.InferenceServerClient]:
    grpc = grpcclient.InferenceServerClient(server.grpc)
    yield grpc
    grpc.close()


def test_cancelling_the_outer_request_cancels_its_running_bls_request(server, gate, client):
    call = Call(client, 1)
    assert gate.started[1].wait(10), f"the BLS request never reached the target: {call.error}"

    call.handle.cancel()

    assert "CANCELLED" in str(call.outcome().status())
    assert gate.outer_done[1].wait(10), "the outer model's BLS call never returned"
    assert gate.saw_cancel == [1]  # the running target read is_cancelled() as true
    assert gate.outer[1]["cancelled"] is True  # and so did the outer model, of its own request


def test_cancelling_the_outer_request_drops_its_queued_bls_request(server, gate, client):
    busy = Call(client, 1)
    assert gate.started[1].wait(10)
    queued = Call(client, 2)
    wait_until(lambda: queue_depth(server, "target") == 1, "the second BLS request queued in the target")

    queued.handle.cancel()

    assert gate.outer_done[2].wait(10), "the queued BLS request was not answered when its caller went away"
    code, message = gate.outer[2]["error"]
    assert code == 7  # pb_utils.TritonError.CANCELLED
    assert "cancelled" in message
    assert gate.outer[2]["cancelled"] is True
    assert queue_depth(server, "target") == 0
    gate.release.set()
    assert busy.value() == [1]
    assert gate.ran == [1]  # the cancelled BLS request never ran


@pytest.mark.parametrize(
    ("parameters", "advance_s"),
    [
        ({}, 1.5),  # the target's default_timeout_microseconds (1 s)
        ({"bls_timeout_us": 100_000}, 0.5),  # the BLS request's own timeout (microseconds), shorter than 1 s
    ],
)
def test_a_queued_bls_request_gets_the_queue_timeout_error(server, gate, client, clock, parameters, advance_s):
    busy = Call(client, 1)
    assert gate.started[1].wait(10)
    late = Call(client, 2, **parameters)
    wait_until(lambda: queue_depth(server, "target") == 1, "the second BLS request queued in the target")

    clock.advance(advance_s)

    error = late.outcome()
    assert isinstance(error, Exception), error
    assert "Request timeout expired" in error.message()
    assert "StatusCode.UNAVAILABLE" in str(error.status())
    code, message = gate.outer[2]["error"]
    assert code == 4 and message == error.message()  # UNAVAILABLE, inside the BLS response
    assert gate.outer[2]["cancelled"] is False
    gate.release.set()
    assert busy.value() == [1]
    assert gate.ran == [1]


def test_a_bls_timeout_longer_than_the_wait_lets_the_request_run(server, gate, client, clock):
    busy = Call(client, 1)
    assert gate.started[1].wait(10)
    patient = Call(client, 2, bls_timeout_us=900_000)
    wait_until(lambda: queue_depth(server, "target") == 1, "the second BLS request queued in the target")

    clock.advance(0.5)
    gate.release.set()

    assert busy.value() == [1]
    assert patient.value() == [2]
    assert gate.ran == [1, 2]
