"""Requests whose clients went away while every instance was busy do not stay in memory."""

from __future__ import annotations

import gc
import socket
import time
import tracemalloc
import urllib.request
from pathlib import Path

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


def binary_request(shape: list[int]) -> bytes:
    """An HTTP/1.1 infer request for ``busy`` with a zero FP32 input of ``shape`` as binary data."""
    elements = int(np.prod(shape))
    header = b'{"inputs":[{"name":"IN","shape":%s,"datatype":"FP32","parameters":{"binary_data_size":%d}}]}' % (
        str(shape).replace(" ", "").encode(),
        elements * 4,
    )
    body = header + np.zeros(elements, np.float32).tobytes()
    return (
        b"POST /v2/models/busy/infer HTTP/1.1\r\nHost: t\r\nContent-Type: application/octet-stream\r\n"
        b"Inference-Header-Content-Length: %d\r\nContent-Length: %d\r\n\r\n%s" % (len(header), len(body), body)
    )


def wait_entered(version_dir: Path) -> None:
    """Until the busy model has started executing (it writes ``entered``)."""
    deadline = time.monotonic() + 10
    while not (version_dir / "entered").exists():
        assert time.monotonic() < deadline, "the model did not start executing"
        time.sleep(0.01)


def test_cancelled_requests_behind_a_busy_instance_are_released(tmp_path, serve):
    repo = tmp_path / "repo"
    version_dir = write_model(repo, "busy", BUSY_CONFIG, {"model.py": BUSY_PY}) / "1"
    server = serve(repo)
    host, port = server.http.split(":")
    request = binary_request([ELEMENTS])
    first = socket.create_connection((host, int(port)))
    try:
        first.sendall(request)  # occupies the only instance
        wait_entered(version_dir)
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


def test_a_batch_taken_from_the_queue_keeps_none_of_its_inputs_once_answered(tmp_path, serve):
    """Requests dispatched from the queue stay in their lane until the next dispatch looks at it: an
    answered one must not keep its input (nor a protocol worker's arena range) until then."""
    repo = tmp_path / "repo"
    config = BUSY_CONFIG.replace("max_batch_size: 0", "max_batch_size: 8")
    version_dir = write_model(repo, "busy", config + "dynamic_batching { }\n", {"model.py": BUSY_PY}) / "1"
    server = serve(repo)
    host, port = server.http.split(":")
    request = binary_request([1, 256 * 1024])  # 1 MiB a request
    tracemalloc.start()
    sockets = []
    try:
        before = live_bytes()
        first = socket.create_connection((host, int(port)))
        sockets.append(first)
        first.sendall(request)  # occupies the only instance
        wait_entered(version_dir)
        for _ in range(8):  # queued behind it: one batch of 8 when it is released
            sock = socket.create_connection((host, int(port)))
            sockets.append(sock)
            sock.sendall(request)
        client = httpclient.InferenceServerClient(server.http)
        deadline = time.monotonic() + 10  # all 8 queued before the instance is let go
        while _queue_depth(server.metrics, "busy") < 8:
            assert time.monotonic() < deadline, "the 8 requests did not reach the queue"
            time.sleep(0.01)
        (version_dir / "release").touch()
        for sock in sockets:
            sock.settimeout(10)
            assert sock.recv(12) == b"HTTP/1.1 200"
            sock.close()
        stats = client.get_inference_statistics("busy")["model_stats"][0]
        assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]] == [(1, 1), (8, 1)]
        client.close()
        grown = live_bytes() - before
        assert grown < 3 * 1024 * 1024, f"{grown >> 20} MiB still held for 9 answered requests"
    finally:
        tracemalloc.stop()
        for sock in sockets:
            sock.close()


def _queue_depth(metrics: str, model: str) -> float:
    """Requests waiting in ``model``'s queue now: the server's own gauge."""
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith("sluice_queue_depth{") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0
