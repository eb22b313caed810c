"""A model that never returns from execute cannot wedge an unload or a shutdown past the grace period."""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from .conftest import EXPLICIT, write_model  # type: ignore[import-not-found]
from .test_cli_shutdown import start  # type: ignore[import-not-found]

# Hangs until the test creates the release file (so no thread outlives the test run).
STUCK_PY = """
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        release = os.path.join(os.path.dirname(__file__), "release")
        open(os.path.join(os.path.dirname(__file__), "entered"), "w").close()
        while not os.path.exists(release):
            time.sleep(0.01)
        return [pb_utils.InferenceResponse(output_tensors=[]) for _ in requests]
"""

STUCK_CONFIG = """
name: "stuck"
backend: "python"
max_batch_size: 4
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 2 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 2 ] } ]
dynamic_batching { }
"""


def _infer_in_thread(url: str, outcome: dict) -> threading.Thread:
    def call() -> None:
        client = httpclient.InferenceServerClient(url, network_timeout=60)
        inp = httpclient.InferInput("INPUT0", [1, 2], "FP32")
        inp.set_data_from_numpy(np.ones((1, 2), np.float32))
        try:
            client.infer("stuck", [inp])
            outcome["result"] = "answered"
        except Exception as exc:  # asserted on by the test
            outcome["error"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread


def _wait_for(path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


def test_unload_of_a_model_stuck_in_execute_returns_and_answers_the_request(tmp_path, serve):
    repo = tmp_path / "repo"
    version_dir = write_model(repo, "stuck", STUCK_CONFIG, {"model.py": STUCK_PY}) / "1"
    server = serve(repo, shutdown_grace_s=0.5, **EXPLICIT)
    try:
        outcome: dict = {}
        caller = _infer_in_thread(server.http, outcome)
        _wait_for(version_dir / "entered")
        client = httpclient.InferenceServerClient(server.http, network_timeout=10)
        started = time.monotonic()
        client.unload_model("stuck")  # hung forever before: it waited for the worker thread
        assert time.monotonic() - started < 5
        caller.join(10)
        assert not caller.is_alive()
        assert isinstance(outcome.get("error"), InferenceServerException), outcome
        assert outcome["error"].status() == "503"
        assert "grace period" in outcome["error"].message()
        assert not client.is_model_ready("stuck")
    finally:
        (version_dir / "release").touch()


def test_sigterm_with_a_model_stuck_in_execute_exits_within_the_grace_period(tmp_path):
    repo = tmp_path / "repo"
    version_dir = write_model(repo, "stuck", STUCK_CONFIG, {"model.py": STUCK_PY}) / "1"
    proc, http = start(repo, tmp_path, "--shutdown-grace-s", "1", "--drain-period-s", "0")
    try:
        outcome: dict = {}
        _infer_in_thread(f"127.0.0.1:{http}", outcome)
        _wait_for(version_dir / "entered")
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(10)  # hung forever before, joining the stuck worker
        except subprocess.TimeoutExpired:
            pytest.fail("the server did not exit within 10 s of SIGTERM (grace period 1 s)")
        assert code == 0
        assert time.monotonic() - started < 5
    finally:
        (version_dir / "release").touch()
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
