"""The `sluice serve` command: starts on the example layout, stops gracefully on SIGTERM/SIGINT."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.http as httpclient

from .conftest import write_model  # type: ignore[import-not-found]

SLOW_PY = """
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        open(__file__ + ".entered", "w").close()  # the test signals the server once this exists
        time.sleep(1.0)
        return [
            pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]
            )
            for r in requests
        ]

    def finalize(self):
        open(__file__ + ".finalized", "w").write("yes")
"""

SLOW_CONFIG = """
name: "slow"
backend: "python"
max_batch_size: 4
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 2 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 2 ] } ]
dynamic_batching { }
"""


def start_ports(repo, tmp_path, *extra: str) -> tuple[subprocess.Popen, dict[str, int]]:
    """``sluice serve`` on ports it picks itself (0: no race with other processes for a port
    chosen in advance), read from its ready line; returns once /v2/health/ready answers 200."""
    cmd = [
        sys.executable, "-m", "sluice.runtime", "serve", "--model-repository", str(repo),
        "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", *extra,
    ]  # fmt: skip
    # cwd outside the checkout: `python -m` puts the cwd first on sys.path.
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        match = re.search(r"sluice ready: HTTP \S+:(\d+)\s+gRPC \S+:(-?\d+)\s+metrics \S+:(-?\d+)", line)
        if match:
            ports = dict(zip(("http", "grpc", "metrics"), map(int, match.groups()), strict=True))
            proc.startup_output = "".join(seen)  # type: ignore[attr-defined]  # what the caller did not read
            break
    else:
        raise AssertionError("".join(seen))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{ports['http']}/v2/health/ready", timeout=1) as r:
                if r.status == 200:
                    return proc, ports
        except OSError:
            if proc.poll() is not None:
                raise AssertionError(proc.stdout.read()) from None
            time.sleep(0.05)
    proc.kill()
    raise AssertionError("server did not become ready")


def start(repo, tmp_path, *extra: str) -> tuple[subprocess.Popen, int]:
    proc, ports = start_ports(repo, tmp_path, *extra)
    return proc, ports["http"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_graceful_stop_finishes_in_flight_requests(tmp_path, sig):
    repo = tmp_path / "repo"
    model_dir = write_model(repo, "slow", SLOW_CONFIG, {"model.py": SLOW_PY})
    proc, http = start(repo, tmp_path, "--drain-period-s", "0.2")
    result: dict = {}

    def call() -> None:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{http}", network_timeout=30)
        inp = httpclient.InferInput("INPUT0", [1, 2], "FP32")
        inp.set_data_from_numpy(np.array([[1.0, 2.0]], dtype=np.float32))
        try:
            result["out"] = client.infer("slow", [inp]).as_numpy("OUTPUT0")
        except Exception as exc:  # recorded and asserted below
            result["error"] = exc

    thread = threading.Thread(target=call)
    thread.start()
    entered = model_dir / "1" / "model.py.entered"
    deadline = time.monotonic() + 20
    while not entered.exists():  # the request is executing (the model then sleeps 1 s)
        assert time.monotonic() < deadline, "the request never reached the model"
        time.sleep(0.01)
    os.kill(proc.pid, sig)
    thread.join(20)
    assert proc.wait(20) == 0
    assert "error" not in result, result.get("error")
    np.testing.assert_array_equal(result["out"], [[1.0, 2.0]])
    assert (model_dir / "1" / "model.py.finalized").read_text() == "yes"  # finalize() ran on unload
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/live", timeout=1)


def test_bad_model_does_not_stop_the_others(tmp_path):
    repo = tmp_path / "repo"
    write_model(repo, "slow", SLOW_CONFIG, {"model.py": SLOW_PY})
    write_model(repo, "broken", 'name: "broken"\nbackend: "python"\nmax_batch_size: -1\n', {"model.py": SLOW_PY})
    proc, http = start(repo, tmp_path, "--strict-readiness", "false", "--drain-period-s", "0")
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{http}")
        assert client.is_model_ready("slow")
        assert not client.is_model_ready("broken")
        index = {row["name"]: row for row in client.get_model_repository_index()}
        assert index["broken"]["state"] == "UNAVAILABLE"
        assert "max_batch_size" in index["broken"]["reason"]
        assert "config.pbtxt" in index["broken"]["reason"]
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.startup_output + proc.communicate(timeout=20)[0]
    assert proc.returncode == 0
    assert "broken" in out and "max_batch_size" in out  # the log names the model and the field


def test_missing_repository_is_a_clear_error(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "sluice.runtime", "serve", "--model-repository", str(tmp_path / "nope")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert "not a directory" in out.stderr + out.stdout
