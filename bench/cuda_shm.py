"""A 4 MiB tensor over CUDA shared memory, against system shared memory and the request body.

    python -P bench/cuda_shm.py [--requests 200]

Starts ``sluice serve`` (a subprocess: ``cudaIpcOpenMemHandle`` refuses a handle of its own process)
on a generated ONNX ``identity`` model (FP32 [1, 1048576]: 4 MiB in, 4 MiB out; ONNX Runtime on the
CPU, so the server copies a CUDA input to the host and the output back to the GPU). One client, one
request at a time (c1), tritonclient HTTP and gRPC over loopback TCP. Rows:

* body: the tensor in the request and the response (HTTP binary extension, gRPC raw contents);
* system shm: ``tritonclient.utils.shared_memory``; the client copies its input into the region and
  reads the output out of its region each request;
* CUDA shm, host copies: the same with CUDA regions (host to device in, device to host out, by the
  client), i.e. a client whose data is in host memory;
* CUDA shm, resident: the input stays in its CUDA region and the output is left in its region (a
  client whose data is on the GPU already): only the server's own copies remain.

CUDA regions come from ``tritonclient.utils.cuda_shared_memory`` when cuda-python is installed, else
from torch (a CUDA tensor and its storage's IPC handle). Without a GPU the CUDA rows are skipped and
the reason printed.
"""

from __future__ import annotations

import argparse
import base64
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm

from sluice.client import cuda_ipc_handle

ELEMENTS = 1 << 20  # 4 MiB of FP32
NBYTES = ELEMENTS * 4


def _model(repo: Path) -> None:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
        "identity",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, [1, ELEMENTS])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, [1, ELEMENTS])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    (repo / "identity" / "1").mkdir(parents=True)
    (repo / "identity" / "config.pbtxt").write_text(
        textwrap.dedent('name: "identity"\nbackend: "onnxruntime"\nmax_batch_size: 0\n')
    )
    (repo / "identity" / "1" / "model.onnx").write_bytes(model.SerializeToString())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _measure(n: int, call: Callable[[], object]) -> tuple[float, float, float]:
    for _ in range(min(20, n)):
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


# -- CUDA regions, as a client makes them ---------------------------------------------------------


def why_no_gpu() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi is not on PATH"
    try:
        import tritonclient.utils.cuda_shared_memory  # noqa: F401
    except (ImportError, RuntimeError):
        try:
            import torch
        except ImportError:
            return "neither cuda-python (tritonclient's CUDA helpers) nor torch is installed"
        if not torch.cuda.is_available():
            return f"torch.cuda.is_available() is false (torch {torch.__version__})"
    return None


class CudaRegion:
    """``byte_size`` bytes on GPU 0 that the server can open: ``raw_handle`` (base64), ``size`` to
    register, ``base`` (where the bytes start in the registered region)."""

    def __init__(self, byte_size: int) -> None:
        try:
            import tritonclient.utils.cuda_shared_memory as cudashm
        except (ImportError, RuntimeError):
            import torch

            self._torch: Any = torch
            self.tensor = torch.zeros(byte_size, dtype=torch.uint8, device="cuda:0")
            handle, self.base = cuda_ipc_handle(self.tensor)  # the 64-byte handle inside torch's
            self.raw_handle = base64.b64encode(handle)
            self._cudashm: Any = None
        else:
            self._cudashm = cudashm
            self._handle = cudashm.create_shared_memory_region(f"bench_{uuid.uuid4().hex[:6]}", byte_size, 0)
            self.raw_handle, self.base = cudashm.get_raw_handle(self._handle), 0
        self.size = self.base + byte_size

    def write(self, array: np.ndarray) -> None:
        if self._cudashm is not None:
            self._cudashm.set_shared_memory_region(self._handle, [array])
            return
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        self.tensor[: data.size].copy_(self._torch.from_numpy(data))
        self._torch.cuda.synchronize()

    def read(self) -> np.ndarray:
        if self._cudashm is not None:
            return self._cudashm.get_contents_as_numpy(self._handle, np.float32, [1, ELEMENTS])
        return self.tensor.cpu().numpy().view(np.float32).reshape(1, ELEMENTS)

    def close(self) -> None:
        if self._cudashm is not None:
            self._cudashm.destroy_shared_memory_region(self._handle)


# -- rows -------------------------------------------------------------------------------------------


def _body(mod: Any, client: Any, x: np.ndarray) -> Callable[[], object]:
    def call() -> object:
        inp = mod.InferInput("INPUT0", [1, ELEMENTS], "FP32")
        inp.set_data_from_numpy(x)
        return client.infer("identity", [inp]).as_numpy("OUTPUT0")

    return call


def _in_regions(
    mod: Any, client: Any, in_base: int, out_base: int, write: Callable[[], None], read: Callable[[], object]
) -> Callable[[], object]:
    inp = mod.InferInput("INPUT0", [1, ELEMENTS], "FP32")
    inp.set_shared_memory("bench_in", NBYTES, offset=in_base)
    out = mod.InferRequestedOutput("OUTPUT0")
    out.set_shared_memory("bench_out", NBYTES, offset=out_base)

    def call() -> object:
        write()
        client.infer("identity", [inp], outputs=[out])
        return read()

    return call


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="requests per row")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sluice-cudashm-"))
    repo = tmp / "repo"
    _model(repo)
    http_port, grpc_port = _free_port(), _free_port()
    cmd = [
        sys.executable, "-P", "-m", "sluice.runtime", "serve", "--model-repository", str(repo),
        "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", "-1",
        "--log-level", "WARNING", "--max-body-bytes", str(64 << 20),
    ]  # fmt: skip
    server = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert server.stdout is not None
    for line in server.stdout:
        if line.startswith("sluice ready:"):
            break
    else:
        raise SystemExit("sluice serve did not start")
    threading.Thread(target=lambda: [None for _ in server.stdout or ()], daemon=True).start()
    no_gpu = why_no_gpu()
    rows: list[tuple[str, str, float, float, float]] = []
    keys = [f"/sluice_bench_{uuid.uuid4().hex[:8]}" for _ in range(2)]
    system = [shm.create_shared_memory_region(k.lstrip("/"), k, NBYTES) for k in keys]
    cuda: list[CudaRegion] = [] if no_gpu else [CudaRegion(NBYTES), CudaRegion(NBYTES)]
    x = np.random.default_rng(0).random((1, ELEMENTS), dtype=np.float32)
    n = args.requests
    try:
        for name, mod, client in (
            ("HTTP", httpclient, httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")),
            ("gRPC", grpcclient, grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")),
        ):
            rows.append((name, "body", *_measure(n, _body(mod, client, x))))
            client.register_system_shared_memory("bench_in", keys[0], NBYTES)
            client.register_system_shared_memory("bench_out", keys[1], NBYTES)
            copies = _in_regions(
                mod, client, 0, 0,
                lambda: shm.set_shared_memory_region(system[0], [x]),
                lambda: shm.get_contents_as_numpy(system[1], np.float32, [1, ELEMENTS]),
            )  # fmt: skip
            rows.append((name, "system shm, host copies", *_measure(n, copies)))
            client.unregister_system_shared_memory()
            if cuda:
                cin, cout = cuda
                client.register_cuda_shared_memory("bench_in", cin.raw_handle, 0, cin.size)
                client.register_cuda_shared_memory("bench_out", cout.raw_handle, 0, cout.size)
                copies = _in_regions(mod, client, cin.base, cout.base, lambda c=cin: c.write(x), cout.read)
                rows.append((name, "CUDA shm, host copies", *_measure(n, copies)))
                cin.write(x)
                resident = _in_regions(mod, client, cin.base, cout.base, lambda: None, lambda: None)
                rows.append((name, "CUDA shm, resident", *_measure(n, resident)))
                np.testing.assert_array_equal(cout.read(), x)  # the bench measured what it claims
                client.unregister_cuda_shared_memory()
            client.close()
    finally:
        for region in system:
            shm.destroy_shared_memory_region(region)
        for each in cuda:
            each.close()
        server.send_signal(signal.SIGINT)
        server.wait(60)
    print(f"c1, one client, one request at a time, 4 MiB FP32 in + 4 MiB out; {os.cpu_count()} CPUs; "
          "sluice serve as a subprocess, ONNX Runtime CPU\n")  # fmt: skip
    if no_gpu:
        print(f"CUDA rows skipped: {no_gpu}\n")
    print("| protocol | tensors | p50 ms | p99 ms | req/s |")
    print("|---|---|---|---|---|")
    for protocol, tensors, p50, p99, rate in rows:
        print(f"| {protocol} | {tensors} | {p50:.3f} | {p99:.3f} | {rate:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
