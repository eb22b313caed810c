"""Sidecar transports: Unix domain socket against loopback TCP, shared memory against the request body.

    python -P bench/sidecar_transport.py [--requests 2000] [--large-requests 200]

Starts ``sluice serve`` (a subprocess, as an injected sidecar runs) with TCP ports and
``--http-uds`` / ``--grpc-uds``, on two generated ONNX models: ``add_sub`` (two FP32[16] inputs) for
the small-request latency, and ``identity`` (FP32 [1, 1048576]: 4 MiB in, 4 MiB out) for the large one.
One client, one request at a time (c1), so the table shows transport cost per request.

* small: gRPC with tritonclient (``host:port`` against ``unix:///path``), HTTP with the standard
  library's ``http.client`` (TCP, and the same over an AF_UNIX socket; tritonclient.http cannot dial one),
  binary tensor extension, keep-alive.
* 4 MiB: tritonclient over TCP, the tensor in the body (HTTP binary extension, gRPC raw contents) against
  system shared memory (tritonclient.utils.shared_memory; the client copies its input into the region each
  request, as a real one would, and the output is written to an output region and read from there).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm

ELEMENTS = 1 << 20  # 4 MiB of FP32


def _models(repo: Path) -> None:
    from onnx import TensorProto, helper

    def save(name: str, config: str, graph: object) -> None:
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
        model.ir_version = 8
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(textwrap.dedent(config))
        (repo / name / "1" / "model.onnx").write_bytes(model.SerializeToString())

    f32 = TensorProto.FLOAT
    add_sub = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
            helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
        ],
        "add_sub",
        [helper.make_tensor_value_info(n, f32, [16]) for n in ("INPUT0", "INPUT1")],
        [helper.make_tensor_value_info(n, f32, [16]) for n in ("OUTPUT0", "OUTPUT1")],
    )
    save("add_sub", 'name: "add_sub"\nbackend: "onnxruntime"\nmax_batch_size: 0\n', add_sub)
    identity = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
        "identity",
        [helper.make_tensor_value_info("INPUT0", f32, [1, ELEMENTS])],
        [helper.make_tensor_value_info("OUTPUT0", f32, [1, ELEMENTS])],
    )
    save("identity", 'name: "identity"\nbackend: "onnxruntime"\nmax_batch_size: 0\n', identity)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost")
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self._path)


def _measure(n: int, call: Callable[[], object]) -> tuple[float, float, float]:
    for _ in range(min(50, n)):
        call()
    times = []
    start = time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - t0)
    wall = time.perf_counter() - start
    ms = np.array(times) / 1e6
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99)), n / wall


def _http_small(conn: http.client.HTTPConnection) -> Callable[[], object]:
    x = np.arange(16, dtype=np.float32).tobytes()
    head = json.dumps(
        {
            "inputs": [
                {"name": n, "shape": [16], "datatype": "FP32", "parameters": {"binary_data_size": 64}}
                for n in ("INPUT0", "INPUT1")
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    body = head + x + x
    headers = {"Inference-Header-Content-Length": str(len(head)), "Content-Type": "application/octet-stream"}

    def call() -> object:
        conn.request("POST", "/v2/models/add_sub/infer", body=body, headers=headers)
        answer = conn.getresponse()
        data = answer.read()
        assert answer.status == 200, data
        return data

    return call


def _grpc_small(client: grpcclient.InferenceServerClient) -> Callable[[], object]:
    inputs = [grpcclient.InferInput("INPUT0", [16], "FP32"), grpcclient.InferInput("INPUT1", [16], "FP32")]
    for inp in inputs:
        inp.set_data_from_numpy(np.arange(16, dtype=np.float32))
    return lambda: client.infer("add_sub", inputs)


def _large_body(mod: object, client: object, x: np.ndarray) -> Callable[[], object]:
    def call() -> object:
        inp = mod.InferInput("INPUT0", [1, ELEMENTS], "FP32")  # type: ignore[attr-defined]
        inp.set_data_from_numpy(x)
        result = client.infer("identity", [inp])  # type: ignore[attr-defined]
        return result.as_numpy("OUTPUT0")

    return call


def _large_shm(
    mod: object, client: object, x: np.ndarray, in_region: object, out_region: object
) -> Callable[[], object]:
    inp = mod.InferInput("INPUT0", [1, ELEMENTS], "FP32")  # type: ignore[attr-defined]
    inp.set_shared_memory("bench_in", x.nbytes)
    out = mod.InferRequestedOutput("OUTPUT0")  # type: ignore[attr-defined]
    out.set_shared_memory("bench_out", x.nbytes)

    def call() -> object:
        shm.set_shared_memory_region(in_region, [x])
        client.infer("identity", [inp], outputs=[out])  # type: ignore[attr-defined]
        return shm.get_contents_as_numpy(out_region, np.float32, [1, ELEMENTS])

    return call


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="small requests per row")
    parser.add_argument("--large-requests", type=int, default=200, help="4 MiB requests per row")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sluice-sidecar-"))
    repo = tmp / "repo"
    _models(repo)
    http_port, grpc_port = _free_port(), _free_port()
    http_sock, grpc_sock = tmp / "http.sock", tmp / "grpc.sock"
    cmd = [
        sys.executable, "-P", "-m", "sluice.runtime", "serve", "--model-repository", str(repo),
        "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", "-1",
        "--http-uds", str(http_sock), "--grpc-uds", str(grpc_sock), "--log-level", "WARNING",
        "--max-body-bytes", str(64 << 20),
    ]  # fmt: skip
    server = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert server.stdout is not None
    for line in server.stdout:
        if line.startswith("sluice ready:"):
            break
    else:
        raise SystemExit("server did not start")
    rows: list[tuple[str, str, str, float, float, float]] = []
    keys = [f"/sluice_bench_{uuid.uuid4().hex[:8]}" for _ in range(2)]
    regions = [shm.create_shared_memory_region(k.lstrip("/"), k, ELEMENTS * 4) for k in keys]
    try:
        n = args.requests
        for transport, target in (("TCP loopback", f"127.0.0.1:{grpc_port}"), ("UDS", f"unix://{grpc_sock}")):
            client = grpcclient.InferenceServerClient(target)
            rows.append(("gRPC (tritonclient)", transport, "2 x FP32[16]", *_measure(n, _grpc_small(client))))
            client.close()
        for transport, conn in (
            ("TCP loopback", http.client.HTTPConnection("127.0.0.1", http_port)),
            ("UDS", UnixHTTPConnection(str(http_sock))),
        ):
            rows.append(("HTTP (http.client)", transport, "2 x FP32[16]", *_measure(n, _http_small(conn))))
            conn.close()
        x = np.random.default_rng(0).random((1, ELEMENTS), dtype=np.float32)
        large = args.large_requests
        for name, mod, client in (
            ("HTTP (tritonclient)", httpclient, httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")),
            ("gRPC (tritonclient)", grpcclient, grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")),
        ):
            rows.append((name, "TCP, in the body", "4 MiB in + out", *_measure(large, _large_body(mod, client, x))))
            client.register_system_shared_memory("bench_in", keys[0], ELEMENTS * 4)
            client.register_system_shared_memory("bench_out", keys[1], ELEMENTS * 4)
            rows.append(
                (name, "TCP, system shm", "4 MiB in + out", *_measure(large, _large_shm(mod, client, x, *regions)))
            )
            client.unregister_system_shared_memory()
            client.close()
    finally:
        for region in regions:
            shm.destroy_shared_memory_region(region)
        server.send_signal(signal.SIGINT)
        server.wait(60)
    print(f"c1, one client, one request at a time; {os.cpu_count()} CPUs; sluice serve as a subprocess\n")
    print("| protocol | transport | payload | p50 ms | p99 ms | req/s |")
    print("|---|---|---|---|---|---|")
    for protocol, transport, payload, p50, p99, rate in rows:
        print(f"| {protocol} | {transport} | {payload} | {p50:.3f} | {p99:.3f} | {rate:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
