"""Repository load and unload requests finish even when the client that asked hangs up (as in Triton)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import numpy as np
import tritonclient.http as httpclient

from .conftest import EXPLICIT, write_model  # type: ignore[import-not-found]

SLOW_PY = """
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        open(os.path.join(os.path.dirname(__file__), "initializing"), "w").close()
        time.sleep(0.5)

    def execute(self, requests):
        open(os.path.join(os.path.dirname(__file__), "entered"), "w").close()
        time.sleep(0.5)
        return [
            pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]
            )
            for r in requests
        ]

    def finalize(self):
        open(os.path.join(os.path.dirname(__file__), "finalized"), "w").close()
"""

SLOW_CONFIG = """
name: "slow"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]
"""


def send_and_hang_up(address: str, path: bytes, started: Callable[[], bool]) -> None:
    """Send the request, wait until ``started()`` shows the server working on it, then hang up."""
    host, port = address.split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n" % path)
        assert wait_until(started)


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_a_load_goes_on_when_its_client_hangs_up(tmp_path, serve):
    repo = tmp_path / "repo"
    write_model(repo, "slow", SLOW_CONFIG, {"model.py": SLOW_PY})
    server = serve(repo, model_control_mode="explicit")  # start without it
    client = httpclient.InferenceServerClient(server.http)
    assert not client.is_model_ready("slow")
    version_dir = repo / "slow" / "1"
    send_and_hang_up(server.http, b"/v2/repository/models/slow/load", lambda: (version_dir / "initializing").exists())
    # it stayed LOADING, never served, before: the load was cancelled with the connection
    assert wait_until(lambda: client.is_model_ready("slow"))
    inp = httpclient.InferInput("IN", [1], "FP32")
    inp.set_data_from_numpy(np.array([3.0], np.float32))
    assert client.infer("slow", [inp]).as_numpy("OUT").tolist() == [3.0]
    client.close()


def test_an_unload_goes_on_when_its_client_hangs_up(tmp_path, serve):
    repo = tmp_path / "repo"
    version_dir = write_model(repo, "slow", SLOW_CONFIG, {"model.py": SLOW_PY}) / "1"
    server = serve(repo, **EXPLICIT)
    client = httpclient.InferenceServerClient(server.http)
    answered: dict = {}

    def call() -> None:
        inp = httpclient.InferInput("IN", [1], "FP32")
        inp.set_data_from_numpy(np.array([2.0], np.float32))
        answered["out"] = httpclient.InferenceServerClient(server.http).infer("slow", [inp]).as_numpy("OUT")

    caller = threading.Thread(target=call)
    caller.start()
    assert wait_until(lambda: (version_dir / "entered").exists())  # executing: the unload waits for it
    send_and_hang_up(server.http, b"/v2/repository/models/slow/unload", lambda: not client.is_model_ready("slow"))
    caller.join(10)
    assert answered["out"].tolist() == [2.0]
    # cut short with its connection, the unload never stopped the worker nor called finalize()
    assert wait_until(lambda: (version_dir / "finalized").exists())
    assert not client.is_model_ready("slow")
    client.close()
