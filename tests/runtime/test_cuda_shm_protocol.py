"""Triton's CUDA shared-memory extension, everything of it that runs without a GPU.

* Pure: the checks of a registration (HTTP body, gRPC values), the order libcudart files are tried in,
  the "no GPU" wording.
* The real loader (``cudart.Loader``): with nothing to find it says "no CUDA runtime found"; on this
  machine's own libraries, whatever they are, it says why there is no GPU (skipped where one is visible).
* The real server through tritonclient HTTP and gRPC, without CUDA: register answers why (HTTP 400 /
  gRPC INVALID_ARGUMENT, Triton's "GPUs not supported"), status lists nothing, unregister is no error
  (as Triton), malformed bodies are refused naming the field before CUDA is consulted.
* The real server with :class:`HostGpu` in place of the ctypes layer (``Server(cuda=...)``, the
  seam the registry takes its device from): registration, status, inputs and outputs in regions,
  the regions' lifetime (the IPC handle is closed only when the last request using it is answered),
  and every bad value. The ctypes layer itself is tested on a GPU by test_cuda_shared_memory.py.
"""

from __future__ import annotations

import base64
import ctypes
import http.client
import json
import shutil
import threading
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as system_shm
from tritonclient.utils import InferenceServerException

from sluice.runtime import cudart, shm
from sluice.runtime.errors import InvalidArgument

from .conftest import (  # type: ignore[import-not-found]
    ADD_SUB_CONFIG,
    BUILDERS,
    GATED_CONFIG,
    Running,
    gated_py,
    start_server,
    write_model,
)
from .conftest import gate as held_gate  # type: ignore[import-not-found]

PROTOCOLS = ["http", "grpc"]
HANDLE = bytes(range(64))


# -- pure -----------------------------------------------------------------------------------------


def body(**fields: Any) -> dict[str, Any]:
    values: dict[str, Any] = {"raw_handle": {"b64": base64.b64encode(HANDLE).decode()}, "device_id": 0, "byte_size": 64}
    values.update(fields)
    return {k: v for k, v in values.items() if v is not ...}


def test_a_good_body_is_read() -> None:
    registration = shm.parse_cuda_body("r", body(device_id=1, byte_size=4096))
    assert registration == shm.CudaRegistration("r", HANDLE, 1, 4096)


@pytest.mark.parametrize(
    "value, words",
    [
        ([], 'the body must be a JSON object {"raw_handle": {"b64"'),
        (None, "the body must be a JSON object"),
        (body(raw_handle=...), "the body has no 'raw_handle'"),
        (body(device_id=...), "the body has no 'device_id'"),
        (body(byte_size=...), "the body has no 'byte_size'"),
        (body(raw_handle="abc"), "'raw_handle' must be an object {\"b64\": \"<base64>\"}, got 'abc'"),
        (body(raw_handle={"b64": 7}), "'raw_handle' must be an object"),
        (body(raw_handle={"b64": "not base64!"}), "'raw_handle.b64' is not valid base64"),
        (body(raw_handle={"b64": base64.b64encode(b"x" * 63).decode()}), "of 64 bytes (as cudaIpcGetMemHandle"),
        (body(raw_handle={"b64": base64.b64encode(b"x" * 65).decode()}), "got 65 bytes"),
        (body(device_id=-1), "'device_id' must be an integer >= 0 (the GPU's index), got -1"),
        (body(device_id="0"), "'device_id' must be an integer >= 0"),
        (body(device_id=True), "'device_id' must be an integer >= 0"),
        (body(byte_size=0), "'byte_size' must be an integer > 0, got 0"),
        (body(byte_size=-5), "got -5"),
        (body(byte_size=1.5), "'byte_size' must be an integer > 0, got 1.5"),
    ],
)
def test_bad_bodies_name_the_field(value: Any, words: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        shm.parse_cuda_body("reg", value)
    assert "failed to register CUDA shared memory region 'reg'" in caught.value.message
    assert words in caught.value.message


def test_registration_values_as_grpc_gives_them() -> None:
    assert shm.cuda_registration("r", HANDLE, 0, 1) == shm.CudaRegistration("r", HANDLE, 0, 1)
    for name, handle, device_id, byte_size, words in [
        ("", HANDLE, 0, 1, "a region needs a non-empty name"),
        ("r", b"", 0, 1, "got 0 bytes"),
        ("r", "text", 0, 1, "got str"),
        ("r", HANDLE, -3, 1, "got -3"),
        ("r", HANDLE, 0, 0, "'byte_size' must be an integer > 0"),
    ]:
        with pytest.raises(InvalidArgument) as caught:
            shm.cuda_registration(name, handle, device_id, byte_size)
        assert words in caught.value.message


def test_library_order_prefers_the_newest() -> None:
    names = ["/a/libcudart.so", "/b/libcudart.so.11.0", "/c/libcudart.so.12", "/c/libcudart.so.12.4.127"]
    paths = [Path(p) for p in [*names, "/d/libcudnn.so.9", "/e/libcudart_static.a"]]
    assert [str(p) for p in cudart.library_order(paths)] == [
        "/c/libcudart.so.12.4.127", "/c/libcudart.so.12", "/b/libcudart.so.11.0", "/a/libcudart.so"
    ]  # fmt: skip


def test_search_directories_include_the_cuda_12_and_13_wheels(tmp_path: Path) -> None:
    """torch's cu130 wheels bring libcudart.so.13 in nvidia/cu13/lib, the CUDA 12 wheel in
    nvidia/cuda_runtime/lib: a server that has not imported torch finds either."""
    for major in ("cu12", "cu13", "cudnn"):
        (tmp_path / "site" / "nvidia" / major / "lib").mkdir(parents=True)
    (tmp_path / "site" / "nvidia" / "cu13" / "lib" / "libcudart.so.13").touch()
    found = cudart.search_directories([str(tmp_path / "site"), "", str(tmp_path / "missing")])
    site_dirs = [path.relative_to(tmp_path) for path in found if path.is_relative_to(tmp_path)]
    assert [str(path) for path in site_dirs] == [
        "site/nvidia/cuda_runtime/lib", "site/nvidia/cu13/lib", "site/nvidia/cu12/lib",
        "missing/nvidia/cuda_runtime/lib",
    ]  # fmt: skip
    assert found[-2:] == [Path("/usr/local/cuda/lib64"), Path("/usr/local/cuda/lib")]
    loader = cudart.Loader(names=(), directories=found)
    with pytest.raises(cudart.NoCuda):  # the empty file is tried (and is no library), not missed
        loader.get()
    assert str(tmp_path / "site" / "nvidia" / "cu13" / "lib" / "libcudart.so.13") in loader._files()


def test_no_gpu_wording() -> None:
    assert cudart.no_gpu_reason(0, "cudaSuccess", "no error", 0, "") == (
        "no GPU visible (cudaGetDeviceCount found 0 devices; CUDA_VISIBLE_DEVICES is '')"
    )
    reason = cudart.no_gpu_reason(35, "cudaErrorInsufficientDriver", "driver too old", -1, None)
    assert reason.startswith("no GPU visible (cudaGetDeviceCount: cudaErrorInsufficientDriver: driver too old")
    assert "no NVIDIA driver is loaded" in reason and "CUDA_VISIBLE_DEVICES" not in reason


# -- the real loader --------------------------------------------------------------------------------


def test_loader_without_a_runtime(tmp_path: Path) -> None:
    (tmp_path / "libcudart.so.99").write_bytes(b"not a shared library")  # tried, fails to load, skipped
    loader = cudart.Loader(names=(), directories=[tmp_path, tmp_path / "missing"])
    assert not loader.usable()
    with pytest.raises(cudart.NoCuda) as caught:
        loader.get()
    assert str(caught.value).startswith("no CUDA runtime found")
    assert str(tmp_path) not in str(caught.value)


def test_asking_a_loader_without_a_runtime_again_and_again_holds_no_more_memory(tmp_path: Path) -> None:
    """A CPU server asks on every metadata request: the remembered answer must not pile up tracebacks."""
    loader = cudart.Loader(names=(), directories=[tmp_path])
    depths = []
    for _ in range(5):
        with pytest.raises(cudart.NoCuda) as caught:
            loader.get()
        depths.append(len(traceback.extract_tb(caught.value.__traceback__)))
        assert caught.value.__context__ is None and caught.value.__cause__ is None
    assert len(set(depths)) == 1, depths
    assert not loader.usable()


def gpu_visible() -> bool:
    return shutil.which("nvidia-smi") is not None or Path("/dev/nvidia0").exists()


@pytest.mark.skipif(gpu_visible(), reason="a GPU is visible here: test_cuda_shared_memory.py covers this machine")
def test_loader_on_this_machine_says_why_not() -> None:
    loader = cudart.Loader()
    with pytest.raises(cudart.NoCuda) as caught:
        loader.get()
    assert str(caught.value).startswith(("no GPU visible (", "no CUDA runtime found ("))


# -- the real server without CUDA -------------------------------------------------------------------


def make_repo(repo: Path) -> Path:
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    write_model(repo, "gated", GATED_CONFIG, {"model.py": gated_py("sluice_cuda_gate")})
    return repo


@pytest.fixture(scope="module")
def no_cuda(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    base = tmp_path_factory.mktemp("nocuda")
    handle = start_server(make_repo(base / "repo"), cuda=cudart.Loader(names=(), directories=()))
    yield handle
    handle.stop()


def client_for(server: Running, protocol: str) -> Any:
    if protocol == "http":
        return httpclient.InferenceServerClient(server.http)
    return grpcclient.InferenceServerClient(server.grpc)


def module_for(protocol: str) -> Any:
    return httpclient if protocol == "http" else grpcclient


def _error(call: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value


def cuda_regions(client: Any) -> dict[str, dict[str, int | str]]:
    status = client.get_cuda_shared_memory_status()
    if isinstance(status, list):
        return {r["name"]: r for r in status}
    return {n: {"name": r.name, "device_id": r.device_id, "byte_size": r.byte_size} for n, r in status.regions.items()}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_without_cuda_register_says_why(no_cuda: Running, protocol: str) -> None:
    client = client_for(no_cuda, protocol)
    raw = base64.b64encode(HANDLE)
    error = _error(lambda: client.register_cuda_shared_memory("r", raw, 0, 64))
    assert "failed to register CUDA shared memory region 'r': GPUs not supported: no CUDA runtime found" in (
        error.message()
    )
    assert "use system shared memory (register_system_shared_memory)" in error.message()
    if protocol == "grpc":
        assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert cuda_regions(client) == {}  # status and unregister answer as Triton does without GPUs
    client.unregister_cuda_shared_memory()
    client.unregister_cuda_shared_memory("r")
    error = _error(lambda: client.get_cuda_shared_memory_status("r"))
    assert "Unable to find cuda shared memory region: 'r'" in error.message()
    if protocol == "grpc":
        assert error.status() == "StatusCode.NOT_FOUND"
    metadata = client.get_server_metadata()
    extensions = metadata["extensions"] if protocol == "http" else list(metadata.extensions)
    assert "system_shared_memory" in extensions and "cuda_shared_memory" not in extensions
    # Values are checked before CUDA is consulted.
    error = _error(lambda: client.register_cuda_shared_memory("r", base64.b64encode(b"short"), 0, 64))
    assert "'raw_handle' must be a cudaIpcMemHandle_t of 64 bytes" in error.message()
    error = _error(lambda: client.register_cuda_shared_memory("r", raw, 0, 0))
    assert "'byte_size' must be an integer > 0, got 0" in error.message()


@pytest.mark.parametrize(
    "payload, words",
    [
        (b"", "the body must be a JSON object"),
        (b"{not json", "register request body"),
        (json.dumps({"device_id": 0, "byte_size": 8}).encode(), "the body has no 'raw_handle'"),
        (json.dumps(body(raw_handle={"b64": "%%%"})).encode(), "'raw_handle.b64' is not valid base64"),
        (json.dumps(body(device_id="gpu0")).encode(), "'device_id' must be an integer >= 0"),
    ],
)
def test_malformed_register_bodies_over_http(no_cuda: Running, payload: bytes, words: str) -> None:
    conn = http.client.HTTPConnection(*no_cuda.http.split(":"))
    conn.request("POST", "/v2/cudasharedmemory/region/r/register", body=payload)
    answer = conn.getresponse()
    error = json.loads(answer.read())["error"]
    conn.close()
    assert answer.status == 400 and words in error, error


def test_cuda_routes_take_the_right_methods(no_cuda: Running) -> None:
    conn = http.client.HTTPConnection(*no_cuda.http.split(":"))
    for method, path, status in [
        ("GET", "/v2/cudasharedmemory/region/r/register", 405),
        ("GET", "/v2/cudasharedmemory/unregister", 405),
        ("POST", "/v2/cudasharedmemory/region/r/nothing", 404),
        ("GET", "/v2/cudasharedmemory/status", 200),
    ]:
        conn.request(method, path)
        answer = conn.getresponse()
        answer.read()
        assert answer.status == status, (method, path)
    conn.close()


# -- the real server, HostGpu in place of the ctypes layer -----------------------------------------


class HostGpu:
    """Stands in for ``cudart.Runtime`` (the seam ``Server(cuda=...)``): "device memory" is host memory,
    a handle is a 64-byte key of an allocation. Every copy is checked to stay inside one allocation,
    so a read or write the registry let through out of range fails the test."""

    def __init__(self, devices: int = 2) -> None:
        self.devices = devices
        self.memory: dict[bytes, tuple[int, np.ndarray]] = {}  # handle -> (device, bytes)
        self.opened: dict[int, bytes] = {}  # pointer -> handle, while open
        self.closed: list[bytes] = []
        self.copies = 0
        self._lock = threading.Lock()

    def allocate(self, byte_size: int, device_id: int = 0) -> tuple[bytes, np.ndarray]:
        handle = uuid.uuid4().bytes * 4
        self.memory[handle] = (device_id, np.zeros(byte_size, dtype=np.uint8))
        return handle, self.memory[handle][1]

    # cudart.Provider
    def get(self) -> HostGpu:
        return self

    def usable(self) -> bool:
        return True

    # cudart.Device
    def device_count(self) -> int:
        return self.devices

    def open_ipc(self, handle: bytes, device_id: int) -> int:
        found = self.memory.get(handle)
        if found is None or found[0] != device_id:
            raise cudart.CudaError("cudaIpcOpenMemHandle", 400, "cudaErrorInvalidResourceHandle", "invalid handle")
        pointer = found[1].ctypes.data
        self.opened[pointer] = handle
        return pointer

    def allocation_size(self, pointer: int, device_id: int) -> int | None:
        return int(self.memory[self.opened[pointer]][1].size)

    def close_ipc(self, pointer: int, device_id: int) -> None:
        with self._lock:
            self.closed.append(self.opened.pop(pointer))

    def _inside(self, pointer: int, byte_size: int, device_id: int) -> None:
        for base, handle in self.opened.items():
            device, array = self.memory[handle]
            if base <= pointer and pointer + byte_size <= base + array.size and device == device_id:
                return
        raise AssertionError(f"copy of {byte_size} bytes outside every open allocation")

    def to_host(self, host: int, pointer: int, byte_size: int, device_id: int) -> None:
        self._inside(pointer, byte_size, device_id)
        ctypes.memmove(host, pointer, byte_size)
        self.copies += 1

    def to_device(self, pointer: int, host: int, byte_size: int, device_id: int) -> None:
        self._inside(pointer, byte_size, device_id)
        ctypes.memmove(pointer, host, byte_size)
        self.copies += 1


class UnsizableGpu(HostGpu):
    """A GPU whose allocations cannot be sized: the driver call fails, or there is no driver library."""

    def __init__(self, failing: bool) -> None:
        super().__init__()
        self.failing = failing

    def allocation_size(self, pointer: int, device_id: int) -> int | None:
        if self.failing:
            raise cudart.CudaError("cuMemGetAddressRange", 1, "CUresult 1", "cannot size the allocation")
        return None


@pytest.mark.parametrize("failing", [True, False], ids=["sizing-fails", "no-driver-library"])
def test_a_region_whose_size_cannot_be_checked_is_refused(tmp_path: Path, failing: bool) -> None:
    """Triton refuses a region it cannot size: a byte_size past the allocation would let requests read or
    write past the client's memory."""
    gpu = UnsizableGpu(failing)
    handle = start_server(make_repo(tmp_path / "repo"), cuda=gpu)
    try:
        memory, _ = gpu.allocate(256)
        client = httpclient.InferenceServerClient(handle.http)
        refused = _error(lambda: client.register_cuda_shared_memory("r", raw(memory), 0, 2**40))
        assert refused.status() == "400" and "cannot be checked" in refused.message()
        assert gpu.opened == {} and gpu.closed == [memory]  # the handle opened to size it was closed again
        assert cuda_regions(client) == {}
    finally:
        handle.stop()


@pytest.fixture(scope="module")
def gate() -> Iterator[Any]:
    with held_gate("sluice_cuda_gate") as module:
        yield module


@pytest.fixture(scope="module")
def gpu() -> HostGpu:
    return HostGpu()


@pytest.fixture(scope="module")
def hosted(tmp_path_factory: pytest.TempPathFactory, gpu: HostGpu, gate: Any) -> Iterator[Running]:
    base = tmp_path_factory.mktemp("hostgpu")
    handle = start_server(make_repo(base / "repo"), cuda=gpu)
    yield handle
    handle.stop()


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def raw(handle: bytes) -> bytes:
    return base64.b64encode(handle)  # what tritonclient.utils.cuda_shared_memory.get_raw_handle gives


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_inputs_and_outputs_in_cuda_regions(hosted: Running, gpu: HostGpu, protocol: str) -> None:
    client, mod = client_for(hosted, protocol), module_for(protocol)
    metadata = client.get_server_metadata()
    assert "cuda_shared_memory" in (metadata["extensions"] if protocol == "http" else metadata.extensions)
    a, b = np.arange(16, dtype=np.float32), np.full(16, 0.5, dtype=np.float32)
    in_handle, in_memory = gpu.allocate(128, device_id=1)
    out_handle, out_memory = gpu.allocate(4096 + 128)
    in_memory[:] = np.concatenate([a, b]).view(np.uint8)
    ins, outs = unique("in"), unique("out")
    client.register_cuda_shared_memory(ins, raw(in_handle), 1, 128)
    client.register_cuda_shared_memory(outs, raw(out_handle), 0, 4096 + 128)
    assert cuda_regions(client) == {
        ins: {"name": ins, "device_id": 1, "byte_size": 128},
        outs: {"name": outs, "device_id": 0, "byte_size": 4096 + 128},
    }
    inputs = [mod.InferInput("INPUT0", [16], "FP32"), mod.InferInput("INPUT1", [16], "FP32")]
    inputs[0].set_shared_memory(ins, 64)
    inputs[1].set_shared_memory(ins, 64, offset=64)
    outputs = [mod.InferRequestedOutput("OUTPUT0"), mod.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory(outs, 64, offset=4096)
    outputs[1].set_shared_memory(outs, 64, offset=4096 + 64)
    result = client.infer("add_sub", inputs, outputs=outputs)
    answer = result.get_output("OUTPUT0")
    parameters = answer["parameters"] if protocol == "http" else answer.parameters
    size = parameters["shared_memory_byte_size"]
    assert (size if protocol == "http" else size.int64_param) == 64
    np.testing.assert_array_equal(out_memory[4096 : 4096 + 64].view(np.float32), a + b)
    np.testing.assert_array_equal(out_memory[4096 + 64 :].view(np.float32), a - b)
    assert not out_memory[:4096].any()  # nothing written before the offset
    client.unregister_cuda_shared_memory(ins)
    assert in_handle in gpu.closed and out_handle not in gpu.closed
    client.unregister_cuda_shared_memory()
    assert out_handle in gpu.closed and cuda_regions(client) == {}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_bad_registrations(hosted: Running, gpu: HostGpu, protocol: str) -> None:
    client = client_for(hosted, protocol)
    handle, _ = gpu.allocate(256)

    def error(name: str, handle: bytes = handle, device_id: int = 0, byte_size: int = 256) -> InferenceServerException:
        return _error(lambda: client.register_cuda_shared_memory(name, raw(handle), device_id, byte_size))

    wrong = error("r", device_id=2)
    assert "region 'r': device_id 2 is out of range: this server sees 2 GPU(s)" in wrong.message()
    assert "allowed: 0 to 1" in wrong.message()
    too_big = error("r", byte_size=257).message()
    assert "byte_size 257 is larger than the CUDA allocation behind the handle (256 bytes)" in too_big
    assert gpu.opened == {}  # the handle opened to size it was closed again
    unknown = error("r", handle=b"\x07" * 64).message()
    assert "cannot open its IPC handle on GPU 0 (cudaIpcOpenMemHandle: cudaErrorInvalidResourceHandle" in unknown
    assert "another process on this host" in unknown
    if protocol == "grpc":
        assert error("r", device_id=5).status() == "StatusCode.INVALID_ARGUMENT"
    name = unique("dup")
    client.register_cuda_shared_memory(name, raw(handle), 0, 256)
    duplicate = error(name)
    assert f"shared memory region '{name}' already in manager" in duplicate.message()
    if protocol == "grpc":
        assert duplicate.status() == "StatusCode.ALREADY_EXISTS"
    wrong_kind = _error(lambda: client.get_system_shared_memory_status(name)).message()
    assert f"The region named '{name}' is registered as CUDA shared memory, not system shared memory" in wrong_kind
    client.unregister_system_shared_memory()  # all system regions: a CUDA region is not one
    assert name in cuda_regions(client)
    client.unregister_cuda_shared_memory(name)


def test_one_namespace_with_system_regions(hosted: Running, gpu: HostGpu) -> None:
    client = grpcclient.InferenceServerClient(hosted.grpc)
    key = f"/sluice_cuda_{uuid.uuid4().hex[:8]}"
    region = system_shm.create_shared_memory_region(key.lstrip("/"), key, 64)
    try:
        name = unique("both")
        client.register_system_shared_memory(name, key, 64)
        handle, _ = gpu.allocate(64)
        error = _error(lambda: client.register_cuda_shared_memory(name, raw(handle), 0, 64))
        assert error.status() == "StatusCode.ALREADY_EXISTS"
        client.unregister_cuda_shared_memory()  # leaves the system region
        assert len(client.get_system_shared_memory_status().regions) == 1
        client.unregister_system_shared_memory(name)
    finally:
        system_shm.destroy_shared_memory_region(region)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_bad_inference_references(hosted: Running, gpu: HostGpu, protocol: str) -> None:
    client, mod = client_for(hosted, protocol), module_for(protocol)
    handle, _ = gpu.allocate(64)
    name = unique("ref")
    client.register_cuda_shared_memory(name, raw(handle), 0, 64)

    def infer(byte_size: int, offset: int = 0, region: str = name, out: tuple[int, int] | None = None) -> str:
        inputs = [mod.InferInput("INPUT0", [16], "FP32"), mod.InferInput("INPUT1", [16], "FP32")]
        inputs[0].set_shared_memory(region, byte_size, offset)
        inputs[1].set_data_from_numpy(np.zeros(16, dtype=np.float32))
        outputs = None
        if out is not None:
            outputs = [mod.InferRequestedOutput("OUTPUT0")]
            outputs[0].set_shared_memory(name, out[0], out[1])
        return _error(lambda: client.infer("add_sub", inputs, outputs=outputs)).message()

    copies = gpu.copies
    assert "offset 8 + byte_size 64 runs past the end of shared memory region" in infer(64, 8)
    assert "offset 64 + byte_size 4 runs past the end" in infer(4, 64)
    assert "Unable to find shared memory region: 'elsewhere'" in infer(64, region="elsewhere")
    assert "offset 40 + byte_size 32 runs past the end" in infer(64, out=(32, 40))
    assert gpu.copies == copies  # refused before any copy
    assert "shared_memory_byte_size is 32 but shape [16] of FP32 needs 64 bytes" in infer(32)
    assert "should be at least 64 bytes to hold the results" in infer(64, out=(32, 0))
    client.unregister_cuda_shared_memory(name)


def test_unregister_while_in_flight_closes_after_the_request(hosted: Running, gpu: HostGpu, gate: Any) -> None:
    client = grpcclient.InferenceServerClient(hosted.grpc)
    handle, memory = gpu.allocate(32)
    x = np.array([1, 2, 3, 4], dtype=np.float32)
    memory[:16] = x.view(np.uint8)
    client.register_cuda_shared_memory("busy", raw(handle), 0, 32)
    inp = grpcclient.InferInput("INPUT0", [4], "FP32")
    inp.set_shared_memory("busy", 16)
    out = grpcclient.InferRequestedOutput("OUTPUT0")
    out.set_shared_memory("busy", 16, offset=16)
    answers: list[Any] = []
    finished = threading.Event()

    def callback(result: Any, error: Any) -> None:
        answers.append((result, error))
        finished.set()

    gate.entered.clear()
    gate.release.clear()
    client.async_infer("gated", [inp], callback, outputs=[out])
    try:
        assert gate.entered.wait(30)
        client.unregister_cuda_shared_memory("busy")
        assert cuda_regions(client) == {}  # the name is free at once...
        assert handle not in gpu.closed  # ...the handle stays open for the request using it
        client.register_cuda_shared_memory("busy", raw(gpu.allocate(8)[0]), 0, 8)  # the name can be taken again
    finally:
        gate.release.set()
    assert finished.wait(30)
    assert answers[0][1] is None
    np.testing.assert_array_equal(memory[16:].view(np.float32), x * 2)  # the output was written before closing
    assert gpu.closed.count(handle) == 1
    client.unregister_cuda_shared_memory("busy")
