"""``async def execute`` of the Python backend as Triton runs it since 24.04: on an event loop per
instance that keeps running, so tasks a model starts go on after ``execute`` returned, a decoupled
model's executes run at once (not one after the other), and ``async_exec`` sends its BLS request
when called, not when awaited. Real server, tritonclient (gRPC stream and HTTP). No timing: the
models wait on each other, so a serialized or stopped loop shows as a request that never ends."""

from __future__ import annotations

import queue
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from .conftest import write_model  # type: ignore[import-not-found]

DECOUPLED = """
name: "{name}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [ {{ name: "IN", data_type: TYPE_INT32, dims: [ 1 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] }} ]
"""

# Starts a task per request and returns at once: the task sends three responses, one per loop turn.
TASKS_PY = """
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        for r in requests:
            asyncio.get_running_loop().create_task(self.stream(r))
        return None

    async def stream(self, request):
        sender = request.get_response_sender()
        value = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
        for i in range(3):
            await asyncio.sleep(0)
            flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if i == 2 else 0
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([value + i], np.int32))]), flags)
"""

# Request 1 waits until request 2 has run: only concurrent executes finish both.
WAITS_PY = """
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.second_ran = None

    async def execute(self, requests):
        if self.second_ran is None:
            self.second_ran = asyncio.Event()
        for r in requests:
            value = int(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()[0])
            if value == 1:
                await self.second_ran.wait()
            else:
                self.second_ran.set()
            r.get_response_sender().send(
                pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([value], np.int32))]),
                pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

TARGET = """
name: "target"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
instance_group [ { count: 2, kind: KIND_CPU } ]
"""

# The first call waits until the second one has run: two calls in flight at once, as Triton allows.
TARGET_PY = """
import threading
import numpy as np
import triton_python_backend_utils as pb_utils

SECOND = threading.Event()


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            value = int(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()[0])
            if value == 1:
                SECOND.wait(30)
            else:
                SECOND.set()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([value], np.int32))]))
        return out
"""

CALLER = """
name: "caller"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
"""

# Starts both BLS calls before awaiting either, and a third it never awaits (it still runs).
CALLER_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


def call(value):
    tensor = pb_utils.Tensor("IN", np.array([value], np.int32))
    return pb_utils.InferenceRequest(model_name="target", requested_output_names=["OUT"], inputs=[tensor])


class TritonPythonModel:
    async def execute(self, requests):
        out = []
        for r in requests:
            first = call(1).async_exec()
            second = call(2).async_exec()
            call(3).async_exec()  # never awaited
            answers = [await first, await second]
            total = sum(int(a.output_tensors()[0].as_numpy()[0]) for a in answers)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([total], np.int32))]))
        return out
"""


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    write_model(root, "tasks", DECOUPLED.format(name="tasks"), {"model.py": TASKS_PY})
    write_model(root, "waits", DECOUPLED.format(name="waits"), {"model.py": WAITS_PY})
    write_model(root, "target", TARGET, {"model.py": TARGET_PY})
    write_model(root, "caller", CALLER, {"model.py": CALLER_PY})
    return root


def _stream(url: str) -> tuple[grpcclient.InferenceServerClient, queue.Queue[Any]]:
    client = grpcclient.InferenceServerClient(url)
    answers: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put(error or result))
    return client, answers


def _send(client: grpcclient.InferenceServerClient, model: str, value: int) -> None:
    tensor = grpcclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([value], np.int32))
    client.async_stream_infer(model, [tensor], request_id=str(value))


def test_tasks_started_by_async_execute_run_after_it_returned(serve, repo):
    client, answers = _stream(serve(repo).grpc)
    try:
        _send(client, "tasks", 10)  # one request: nothing else comes to turn the loop
        got = [answers.get(timeout=10) for _ in range(3)]
        assert [int(a.as_numpy("OUT")[0]) for a in got] == [10, 11, 12]
    finally:
        client.stop_stream()
        client.close()


def test_async_executes_of_a_decoupled_model_run_at_once(serve, repo):
    client, answers = _stream(serve(repo).grpc)
    try:
        _send(client, "waits", 1)  # waits for request 2
        _send(client, "waits", 2)
        got = [answers.get(timeout=10) for _ in range(2)]
        assert sorted(int(a.as_numpy("OUT")[0]) for a in got) == [1, 2]
    finally:
        client.stop_stream()
        client.close()


def test_async_exec_sends_its_request_when_called(serve, repo):
    server = serve(repo)
    client = httpclient.InferenceServerClient(server.http)
    tensor = httpclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([0], np.int32))
    assert int(client.infer("caller", [tensor]).as_numpy("OUT")[0]) == 3
    deadline = time.monotonic() + 10
    while True:  # the call never awaited ran too
        stats = client.get_inference_statistics("target")["model_stats"][0]["inference_stats"]
        if stats["success"]["count"] == 3:
            break
        assert time.monotonic() < deadline, f"target ran {stats['success']['count']} of 3 calls"
        time.sleep(0.01)
    client.close()


HELD_PY = """
import asyncio
import sys
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        gate = sys.modules["sluice_async_unload_gate"]
        for r in requests:
            gate.entered.set()
            await asyncio.get_running_loop().run_in_executor(None, gate.release.wait, 30)
            gate.order.append("answered")
            r.get_response_sender().send(
                pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([7], np.int32))]),
                pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def finalize(self):
        gate = sys.modules["sluice_async_unload_gate"]
        gate.order.append("finalized")
        gate.finalized.set()
"""


def test_unloading_waits_for_a_decoupled_async_execute_still_running(serve, tmp_path):
    """The scheduler sees a decoupled async execute return at once; the instance's close waits for it
    before finalize, so its client gets its answer (it used to be cancelled at once)."""
    import sys
    import threading
    import types

    root = tmp_path / "repo"
    write_model(root, "held", DECOUPLED.format(name="held"), {"model.py": HELD_PY})
    gate = types.ModuleType("sluice_async_unload_gate")
    gate.entered, gate.release, gate.finalized = threading.Event(), threading.Event(), threading.Event()
    gate.order = []
    sys.modules[gate.__name__] = gate
    try:
        server = serve(root, model_control_mode="explicit", load_models=("*",))
        client, answers = _stream(server.grpc)
        _send(client, "held", 1)
        assert gate.entered.wait(10)
        unloading = threading.Thread(target=lambda: server.call(server.server.repository.unload("held")))
        unloading.start()
        # bounded wait for what must not happen: finalize before the running execute answered
        assert not gate.finalized.wait(1.0), "the instance was closed under a running execute"
        gate.release.set()
        unloading.join(30)
        assert int(answers.get(timeout=10).as_numpy("OUT")[0]) == 7
        assert gate.order == ["answered", "finalized"]
        client.stop_stream()
        client.close()
    finally:
        gate.release.set()
        del sys.modules[gate.__name__]
