"""Requests whose clients went away while every instance was busy do not stay in memory."""

from __future__ import annotations

import gc
import socket
import time
import tracemalloc

import numpy as np
import tritonclient.http as httpclient

from .conftest import write_model  # type: ignore[import-not-found]

# Busy until the test creates the release file.
BUSY_PY = """
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        here = os.path.dirname(__file__)
        open(os.path.join(here, "entered"), "w").close()
        while not os.path.exists(os.path.join(here, "release")):
            time.sleep(0.01)
        return [pb_utils.InferenceResponse(output_tensors=[]) for _ in requests]
"""

BUSY_CONFIG = """
name: "busy"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]
"""

ELEMENTS = 64 * 1024  # 256 KiB a request


def live_bytes() -> int:
    """Python memory in use now (the server runs in this process), garbage cycles collected."""
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def test_cancelled_requests_behind_a_busy_instance_are_released(tmp_path, serve):
    repo = tmp_path / "repo"
    version_dir = write_model(repo, "busy", BUSY_CONFIG, {"model.py": BUSY_PY}) / "1"
    server = serve(repo)
    host, port = server.http.split(":")
    header = b'{"inputs":[{"name":"IN","shape":[%d],"datatype":"FP32","parameters":{"binary_data_size":%d}}]}' % (
        ELEMENTS,
        ELEMENTS * 4,
    )
    body = header + np.zeros(ELEMENTS, np.float32).tobytes()
    request = (
        b"POST /v2/models/busy/infer HTTP/1.1\r\nHost: t\r\nContent-Type: application/octet-stream\r\n"
        b"Inference-Header-Content-Length: %d\r\nContent-Length: %d\r\n\r\n%s" % (len(header), len(body), body)
    )
    first = socket.create_connection((host, int(port)))
    try:
        first.sendall(request)  # occupies the only instance
        deadline = time.monotonic() + 10
        while not (version_dir / "entered").exists():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        tracemalloc.start()
        before = live_bytes()
        for _ in range(600):  # 150 MiB of requests, each queued then given up on by its client
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(request)
                sock.settimeout(5)
                sock.shutdown(socket.SHUT_WR)
        # wait for the server to see every disconnect
        client = httpclient.InferenceServerClient(server.http)
        deadline = time.monotonic() + 10
        while client.get_inference_statistics("busy")["model_stats"][0]["inference_stats"]["fail"]["count"] < 600:
            assert time.monotonic() < deadline, "the server did not answer the cancelled requests"
            time.sleep(0.05)
        grown = live_bytes() - before
        # it kept every one (with its 256 KiB input) until the busy instance took work again
        assert grown < 32 * 1024 * 1024, f"{grown >> 20} MiB still held for requests nobody waits for"
        client.close()
    finally:
        tracemalloc.stop()
        (version_dir / "release").touch()
        first.close()
