"""CUDA shared memory on a real GPU: tensors in CUDA IPC regions, through tritonclient HTTP and gRPC.

Skipped, saying why, where no GPU is visible (no ``nvidia-smi``, or ``torch.cuda.is_available()``
false). On a GPU machine::

    PYTHONSAFEPATH=1 .venv/bin/python -m pytest -q -p no:cacheprovider -rs tests/runtime/test_cuda_shared_memory.py

The server is ``sluice serve`` in a subprocess: ``cudaIpcOpenMemHandle`` refuses a handle made by its
own process, so the client (this test) and the server must be two processes, as they are in use.
Regions are made with tritonclient's own ``tritonclient.utils.cuda_shared_memory`` when its
dependency (cuda-python) is installed, else with torch (a CUDA tensor and the IPC handle of its
storage, ``untyped_storage()._share_cuda_()``); either way they are registered with tritonclient's
``register_cuda_shared_memory(name, raw_handle, device_id, byte_size)``.
"""

from __future__ import annotations

import base64
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from sluice.client import cuda_ipc_handle, torch_ipc_memhandle

from .conftest import ADD_SUB_CONFIG, BUILDERS, write_model  # type: ignore[import-not-found]


def _why_no_gpu() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return "no GPU here: nvidia-smi is not on PATH"
    try:
        import torch
    except ImportError:
        return "torch is not installed (it makes the CUDA regions when cuda-python is absent)"
    if not torch.cuda.is_available():
        return f"no GPU here: torch.cuda.is_available() is false (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return None


WHY_NO_GPU = _why_no_gpu()
pytestmark = pytest.mark.skipif(WHY_NO_GPU is not None, reason=WHY_NO_GPU or "")
PROTOCOLS = ["http", "grpc"]


# -- regions, made the way a client makes them ------------------------------------------------------


class Region:
    """A CUDA allocation of this (client) process that the server can open: ``raw_handle`` (base64, as
    ``cuda_shared_memory.get_raw_handle`` gives it), ``byte_size`` to register, and ``base``: where
    the bytes this test writes and reads start in the registered region (torch's caching allocator
    hands out blocks inside a larger allocation; the handle is the allocation's)."""

    raw_handle: bytes
    byte_size: int
    base: int
    device_id: int

    def write(self, array: np.ndarray, offset: int = 0) -> None:
        raise NotImplementedError

    def read(self, dtype: Any, count: int, offset: int = 0) -> np.ndarray:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TritonclientRegion(Region):
    def __init__(self, byte_size: int, device_id: int) -> None:
        import tritonclient.utils.cuda_shared_memory as cudashm

        self._cudashm = cudashm
        self._handle = cudashm.create_shared_memory_region(f"sluice_{uuid.uuid4().hex[:8]}", byte_size, device_id)
        self.raw_handle = cudashm.get_raw_handle(self._handle)
        self.byte_size, self.base, self.device_id = byte_size, 0, device_id

    def write(self, array: np.ndarray, offset: int = 0) -> None:
        assert offset == 0, "tritonclient's helper writes at the start of the region"
        self._cudashm.set_shared_memory_region(self._handle, [array])

    def read(self, dtype: Any, count: int, offset: int = 0) -> np.ndarray:
        whole = self._cudashm.get_contents_as_numpy(self._handle, np.uint8, [self.byte_size])
        return whole[offset : offset + count * np.dtype(dtype).itemsize].view(dtype)

    def close(self) -> None:
        self._cudashm.destroy_shared_memory_region(self._handle)


class TorchRegion(Region):
    def __init__(self, byte_size: int, device_id: int) -> None:
        import torch

        self._torch = torch
        self.tensor = torch.zeros(byte_size, dtype=torch.uint8, device=f"cuda:{device_id}")
        handle, storage_offset = cuda_ipc_handle(self.tensor)
        self.raw_handle = base64.b64encode(handle)
        self.base, self.device_id = int(storage_offset), device_id
        self.byte_size = self.base + byte_size

    def write(self, array: np.ndarray, offset: int = 0) -> None:
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        self.tensor[offset : offset + data.size].copy_(self._torch.from_numpy(data.copy()))
        self._torch.cuda.synchronize()

    def read(self, dtype: Any, count: int, offset: int = 0) -> np.ndarray:
        size = count * np.dtype(dtype).itemsize
        return self.tensor[offset : offset + size].cpu().numpy().view(dtype)


def make_region(byte_size: int, device_id: int = 0) -> Region:
    try:
        import tritonclient.utils.cuda_shared_memory  # noqa: F401  (needs cuda-python)
    except (ImportError, RuntimeError):
        return TorchRegion(byte_size, device_id)
    return TritonclientRegion(byte_size, device_id)


@pytest.fixture
def regions() -> Iterator[Any]:
    made: list[Region] = []

    def make(byte_size: int, device_id: int = 0) -> Region:
        made.append(make_region(byte_size, device_id))
        return made[-1]

    yield make
    for region in made:
        region.close()


# -- the server, in its own process -----------------------------------------------------------------

GATED_PY = """
import os
import triton_python_backend_utils as pb_utils

GATE = os.environ["SLUICE_TEST_GATE"]


class TritonPythonModel:
    def execute(self, requests):
        with open(os.path.join(GATE, "entered"), "w"):  # blocks until the test opens it: it knows we are in
            pass
        with open(os.path.join(GATE, "release")):  # blocks until the test lets us go
            pass
        return [
            pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() * 2)
            ])
            for r in requests
        ]
"""

GATED_CONFIG = """
name: "gated"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""


TORCH_ADD_SUB_CONFIG = ADD_SUB_CONFIG.replace('name: "add_sub"', 'name: "add_sub_gpu"').replace(
    'backend: "onnxruntime"', 'platform: "pytorch_libtorch"\ninstance_group [ { kind: KIND_GPU } ]'
)
"""The same add_sub as a TorchScript model on the GPU: the regions' bytes feed a CUDA instance."""


def _scripted_add_sub(path: Path) -> bytes:
    import torch

    class AddSub(torch.nn.Module):
        def forward(self, INPUT0: torch.Tensor, INPUT1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return INPUT0 + INPUT1, INPUT0 - INPUT1

    torch.jit.script(AddSub()).save(str(path))
    return path.read_bytes()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    def __init__(self, http: str, grpc: str, gate: Path) -> None:
        self.http, self.grpc, self.gate = http, grpc, gate


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    base = tmp_path_factory.mktemp("cudashm")
    repo = base / "repo"
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    write_model(repo, "add_sub_gpu", TORCH_ADD_SUB_CONFIG, {"model.pt": _scripted_add_sub(base / "add_sub.pt")})
    write_model(repo, "gated", GATED_CONFIG, {"model.py": GATED_PY})
    gate = base / "gate"
    gate.mkdir()
    os.mkfifo(gate / "entered")
    os.mkfifo(gate / "release")
    http_port, grpc_port = _free_port(), _free_port()
    cmd = [
        sys.executable, "-P", "-m", "sluice.runtime", "serve", "--model-repository", str(repo),
        "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", "-1",
        "--drain-period-s", "0",
    ]  # fmt: skip
    env = {**os.environ, "SLUICE_TEST_GATE": str(gate)}
    proc = subprocess.Popen(cmd, cwd=base, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("sluice ready:"):
            break
    else:
        raise AssertionError("sluice serve did not start:\n" + "".join(seen[-20:]))
    drain = threading.Thread(target=lambda: [None for _ in proc.stdout or ()], daemon=True)
    drain.start()
    yield Served(f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", gate)
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)


def client_for(served: Served, protocol: str) -> Any:
    if protocol == "http":
        return httpclient.InferenceServerClient(served.http)
    return grpcclient.InferenceServerClient(served.grpc)


def module_for(protocol: str) -> Any:
    return httpclient if protocol == "http" else grpcclient


def _error(call: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


# -- tests ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["add_sub", "add_sub_gpu"])  # onnxruntime (KIND_AUTO), torch on the GPU
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_add_sub_with_inputs_and_outputs_in_cuda_regions(
    served: Served, regions: Any, protocol: str, model: str
) -> None:
    client, mod = client_for(served, protocol), module_for(protocol)
    metadata = client.get_server_metadata()
    assert "cuda_shared_memory" in (metadata["extensions"] if protocol == "http" else metadata.extensions)
    a = np.arange(16, dtype=np.float32)
    b = np.linspace(-1, 1, 16, dtype=np.float32)
    ins, outs = regions(128), regions(128)
    ins.write(np.concatenate([a, b]))
    in_name, out_name = unique("in"), unique("out")
    client.register_cuda_shared_memory(in_name, ins.raw_handle, ins.device_id, ins.byte_size)
    client.register_cuda_shared_memory(out_name, outs.raw_handle, outs.device_id, outs.byte_size)
    status = client.get_cuda_shared_memory_status(in_name)
    row = status[0] if protocol == "http" else status.regions[in_name]
    assert (row["byte_size"] if protocol == "http" else row.byte_size) == ins.byte_size
    inputs = [mod.InferInput("INPUT0", [16], "FP32"), mod.InferInput("INPUT1", [16], "FP32")]
    inputs[0].set_shared_memory(in_name, 64, offset=ins.base)
    inputs[1].set_shared_memory(in_name, 64, offset=ins.base + 64)
    outputs = [mod.InferRequestedOutput("OUTPUT0"), mod.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory(out_name, 64, offset=outs.base)
    outputs[1].set_shared_memory(out_name, 64, offset=outs.base + 64)
    for _ in range(3):  # the same regions, request after request
        client.infer(model, inputs, outputs=outputs)
        np.testing.assert_allclose(outs.read(np.float32, 16), a + b)
        np.testing.assert_allclose(outs.read(np.float32, 16, offset=64), a - b)
        a = a + 1
        ins.write(np.concatenate([a, b]))
    client.unregister_cuda_shared_memory(in_name)
    client.unregister_cuda_shared_memory(out_name)
    status = client.get_cuda_shared_memory_status()
    names = [row["name"] for row in status] if protocol == "http" else list(status.regions)
    assert in_name not in names and out_name not in names


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_bad_registrations_and_references(served: Served, regions: Any, protocol: str) -> None:
    client, mod = client_for(served, protocol), module_for(protocol)
    region = regions(64)
    message = _error(lambda: client.register_cuda_shared_memory("bad", base64.b64encode(b"\x01" * 64), 0, 64)).message()
    assert "failed to register CUDA shared memory region 'bad': cannot open its IPC handle on GPU 0" in message
    message = _error(lambda: client.register_cuda_shared_memory("bad", region.raw_handle, 4096, 64)).message()
    assert "device_id 4096 is out of range: this server sees" in message
    message = _error(lambda: client.register_cuda_shared_memory("bad", region.raw_handle, 0, 1 << 40)).message()
    assert "is larger than the CUDA allocation behind the handle" in message
    name = unique("ref")
    client.register_cuda_shared_memory(name, region.raw_handle, 0, region.byte_size)
    assert (
        "already in manager"
        in _error(lambda: client.register_cuda_shared_memory(name, region.raw_handle, 0, region.byte_size)).message()
    )

    def infer(byte_size: int, offset: int, out: tuple[int, int] | None = None) -> str:
        inputs = [mod.InferInput("INPUT0", [16], "FP32"), mod.InferInput("INPUT1", [16], "FP32")]
        inputs[0].set_shared_memory(name, byte_size, offset)
        inputs[1].set_data_from_numpy(np.zeros(16, dtype=np.float32))
        outputs = None
        if out is not None:
            outputs = [mod.InferRequestedOutput("OUTPUT0")]
            outputs[0].set_shared_memory(name, out[0], out[1])
        return _error(lambda: client.infer("add_sub", inputs, outputs=outputs)).message()

    past = region.byte_size - 32
    assert f"offset {past} + byte_size 64 runs past the end of shared memory region '{name}'" in infer(64, past)
    assert "should be at least 64 bytes to hold the results" in infer(64, region.base, out=(32, region.base))
    client.unregister_cuda_shared_memory(name)


def test_unregister_while_in_flight(served: Served, regions: Any) -> None:
    """The region is unregistered while the model runs: the request still reads and writes it (the
    IPC handle stays open until it is answered), and the name can be registered again at once."""
    client = grpcclient.InferenceServerClient(served.grpc)
    region = regions(32)
    x = np.array([1, 2, 3, 4], dtype=np.float32)
    region.write(x)
    client.register_cuda_shared_memory("busy", region.raw_handle, 0, region.byte_size)
    inp = grpcclient.InferInput("INPUT0", [4], "FP32")
    inp.set_shared_memory("busy", 16, offset=region.base)
    out = grpcclient.InferRequestedOutput("OUTPUT0")
    out.set_shared_memory("busy", 16, offset=region.base + 16)
    answers: list[Any] = []
    finished = threading.Event()

    def callback(result: Any, error: Any) -> None:
        answers.append(error)
        finished.set()

    client.async_infer("gated", [inp], callback, outputs=[out])
    entered = _open_within(served.gate / "entered", os.O_RDONLY, 60)  # the model is running
    os.close(entered)
    client.unregister_cuda_shared_memory("busy")
    assert "busy" not in client.get_cuda_shared_memory_status().regions
    client.register_cuda_shared_memory("busy", region.raw_handle, 0, region.byte_size)  # the name is free again
    os.close(_open_within(served.gate / "release", os.O_WRONLY, 60))
    assert finished.wait(60)
    assert answers == [None]
    np.testing.assert_array_equal(region.read(np.float32, 4, offset=16), x * 2)
    client.unregister_cuda_shared_memory("busy")


def _open_within(path: Path, flags: int, timeout_s: float) -> int:
    """Open a FIFO (blocks until the other end opens it), failing the test after ``timeout_s``."""
    opened: list[int] = []
    opener = threading.Thread(target=lambda: opened.append(os.open(path, flags)), daemon=True)
    opener.start()
    opener.join(timeout_s)
    assert opened, f"the model did not reach {path.name} within {timeout_s}s"
    return opened[0]


# -- torch's shared handle (pure; runs everywhere) ---------------------------------------------------


def test_the_64_byte_handle_is_taken_out_of_torchs_versioned_one():
    handle = bytes(range(64))
    assert torch_ipc_memhandle(handle) == handle  # torch before 2.2
    assert torch_ipc_memhandle(b"\x02c" + handle) == handle  # version 2, cudaMalloc block
    assert torch_ipc_memhandle(b"\x03c" + handle) == handle
    with pytest.raises(ValueError, match="expandable segment, which has no cudaIpcMemHandle_t; allowed: memory from"):
        torch_ipc_memhandle(b"\x02e" + bytes(40))
    with pytest.raises(ValueError, match=r"not a CUDA IPC handle torch shares \(65 bytes, type byte b'x'\)"):
        torch_ipc_memhandle(b"\x02x" + bytes(63))

