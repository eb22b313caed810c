"""The inference-sidecar transports: Unix domain sockets (``--http-uds``, ``--grpc-uds``) and Triton's
system shared-memory extension, through the real clients.

gRPC over UDS is tritonclient's own ``InferenceServerClient("unix:///path")``. tritonclient.http
(geventhttpclient) cannot dial a Unix socket, so HTTP over UDS is checked with the standard
library's ``http.client`` on an AF_UNIX socket (``UnixHTTPConnection``). Shared memory is
``tritonclient.utils.shared_memory`` as users call it, over tritonclient HTTP and gRPC.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import stat
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
import tritonclient.utils.shared_memory as shm
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tritonclient.utils import InferenceServerException

from sluice.runtime import shm as sluice_shm
from sluice.runtime.server import Server, StartupError
from sluice.runtime.settings import ServerSettings

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


class UnixHTTPConnection(http.client.HTTPConnection):
    """``http.client`` over a Unix domain socket (the Host header is just a name)."""

    def __init__(self, path: str, timeout: float = 30.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


def identity_model() -> bytes:
    """INPUT0 (FP32 [batch, n]) -> OUTPUT0, the same values (ONNX Identity)."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
        "identity",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", "n"])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", "n"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


IDENTITY_CONFIG = """
name: "identity"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
dynamic_batching { max_queue_delay_microseconds: 2000 }
"""

CACHED_CONFIG = ADD_SUB_CONFIG.replace('name: "add_sub"', 'name: "cached"') + "response_cache { enable: true }\n"

ECHO_PY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        # Hands its input back as is: with shared memory, a view of the client's region.
        return [
            pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())
            ])
            for r in requests
        ]
"""

ECHO_CONFIG = """
name: "echo"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 16 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 16 ] } ]
response_cache { enable: true }
"""


def make_repo(repo: Path) -> Path:
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    write_model(repo, "echo", ECHO_CONFIG, {"model.py": ECHO_PY})
    write_model(repo, "identity", IDENTITY_CONFIG, {"model.onnx": identity_model()})
    write_model(repo, "cached", CACHED_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    base = tmp_path_factory.mktemp("sidecar")
    handle = start_server(make_repo(base / "repo"), http_uds=base / "http.sock", grpc_uds=base / "grpc.sock")
    yield handle
    handle.stop()


class Regions:
    """POSIX shared-memory regions made with tritonclient's helpers; destroyed at the end."""

    def __init__(self) -> None:
        self.handles: list[Any] = []

    def create(self, byte_size: int) -> tuple[Any, str]:
        key = f"/sluice_test_{uuid.uuid4().hex[:12]}"
        handle = shm.create_shared_memory_region(key.lstrip("/"), key, byte_size)
        self.handles.append(handle)
        return handle, key

    def close(self) -> None:
        for handle in self.handles:
            shm.destroy_shared_memory_region(handle)


@pytest.fixture
def regions() -> Iterator[Regions]:
    made = Regions()
    yield made
    made.close()


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def mapped(key: str) -> int:
    """How many times this process maps the shared-memory object ``key`` (the in-process server's view)."""
    target = "/dev/shm/" + key.lstrip("/")
    return sum(1 for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(target))


# -- Unix domain sockets ---------------------------------------------------------------------------


def test_grpc_and_http_over_unix_sockets(server: Running) -> None:
    grpc_path = str(server.server.settings.grpc_uds)
    http_path = str(server.server.settings.http_uds)
    assert stat.S_IMODE(os.stat(grpc_path).st_mode) == 0o660
    assert stat.S_IMODE(os.stat(http_path).st_mode) == 0o660
    client = grpcclient.InferenceServerClient(f"unix://{grpc_path}")
    assert client.is_server_ready()
    x = np.arange(16, dtype=np.float32)
    inputs = [grpcclient.InferInput("INPUT0", [16], "FP32"), grpcclient.InferInput("INPUT1", [16], "FP32")]
    inputs[0].set_data_from_numpy(x)
    inputs[1].set_data_from_numpy(np.ones(16, dtype=np.float32))
    np.testing.assert_array_equal(client.infer("add_sub", inputs).as_numpy("OUTPUT0"), x + 1)
    client.close()

    conn = UnixHTTPConnection(http_path)
    conn.request("GET", "/v2/health/ready")
    ready = conn.getresponse()
    assert ready.status == 200 and ready.read() == b""
    body = json.dumps(
        {"inputs": [{"name": n, "shape": [16], "datatype": "FP32", "data": x.tolist()} for n in ("INPUT0", "INPUT1")]}
    )
    conn.request("POST", "/v2/models/add_sub/infer", body=body)
    answer = conn.getresponse()
    assert answer.status == 200
    outputs = {o["name"]: o["data"] for o in json.loads(answer.read())["outputs"]}
    assert outputs["OUTPUT0"] == (x * 2).tolist()
    conn.close()


@pytest.mark.parametrize("grpc_server", ["h2", "grpcio"])
def test_grpc_over_unix_socket_only(tmp_path: Path, grpc_server: str) -> None:
    """--grpc-port -1 with --grpc-uds: no TCP at all; the socket is removed on stop."""
    path = tmp_path / "g.sock"
    handle = start_server(make_repo(tmp_path / "repo"), grpc_port=-1, grpc_uds=path, grpc_server=grpc_server)
    try:
        assert handle.server.ports.grpc == -1
        client = grpcclient.InferenceServerClient(f"unix://{path}")
        assert client.is_server_ready()
        assert "system_shared_memory" in client.get_server_metadata().extensions
        client.close()
    finally:
        handle.stop()
    assert not path.exists()


def test_stale_socket_file_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(str(path))
    left.close()  # a crash leaves the file; nobody listens
    handle = start_server(make_repo(tmp_path / "repo"), http_port=-1, http_uds=path)
    try:
        conn = UnixHTTPConnection(str(path))
        conn.request("GET", "/v2/health/live")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        handle.stop()
    assert not path.exists()


def _startup_error(tmp_path: Path, **overrides: Any) -> str:
    settings = ServerSettings(model_repository=make_repo(tmp_path / "repo"), http_port=0, grpc_port=0, **overrides)
    import asyncio

    async def start() -> str:
        server = Server(settings)
        with pytest.raises(StartupError) as caught:
            await server.start()
        return str(caught.value)

    return asyncio.run(start())


def test_unusable_socket_paths_are_one_line_startup_errors(tmp_path: Path, server: Running) -> None:
    missing = _startup_error(tmp_path, http_uds=tmp_path / "no" / "such" / "http.sock")
    assert missing.startswith("--http-uds ") and "does not exist" in missing and "\n" not in missing
    regular = tmp_path / "file.sock"
    regular.write_text("mine")
    assert "is not a socket" in _startup_error(tmp_path, grpc_uds=regular)
    assert regular.read_text() == "mine"  # left alone
    in_use = _startup_error(tmp_path, grpc_uds=server.server.settings.grpc_uds)
    assert in_use.startswith("--grpc-uds ") and "in use" in in_use
    too_long = _startup_error(tmp_path, http_uds=tmp_path / ("x" * 120))
    assert "at most 107" in too_long


def test_sidecar_command_line(tmp_path: Path, regions: Regions) -> None:
    """``sluice serve`` as the injected sidecar runs it: no TCP, both sockets; SIGTERM removes them."""
    repo = make_repo(tmp_path / "repo")
    http_sock, grpc_sock = tmp_path / "http.sock", tmp_path / "grpc.sock"
    cmd = [
        sys.executable, "-P", "-m", "sluice.runtime", "serve", "--model-repository", str(repo),
        "--http-port", "-1", "--grpc-port", "-1", "--metrics-port", "-1",
        "--http-uds", str(http_sock), "--grpc-uds", str(grpc_sock), "--drain-period-s", "0",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("sluice ready:"):
                break
        else:
            raise AssertionError("no ready line")
        assert re.search(rf"HTTP unix:{re.escape(str(http_sock))}\s+gRPC unix:{re.escape(str(grpc_sock))}", line)
        client = grpcclient.InferenceServerClient(f"unix://{grpc_sock}")
        handle, key = regions.create(64)
        x = np.arange(16, dtype=np.float32)
        shm.set_shared_memory_region(handle, [x])
        client.register_system_shared_memory("in", key, 64)
        inp = [grpcclient.InferInput("INPUT0", [16], "FP32"), grpcclient.InferInput("INPUT1", [16], "FP32")]
        inp[0].set_shared_memory("in", 64)
        inp[1].set_data_from_numpy(x)
        np.testing.assert_array_equal(client.infer("add_sub", inp).as_numpy("OUTPUT0"), x * 2)
        client.close()
        conn = UnixHTTPConnection(str(http_sock))
        conn.request("GET", "/v2/systemsharedmemory/status")
        assert json.loads(conn.getresponse().read()) == [{"name": "in", "key": key, "offset": 0, "byte_size": 64}]
        conn.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert not http_sock.exists() and not grpc_sock.exists()


# -- system shared memory --------------------------------------------------------------------------

PROTOCOLS = ["http", "grpc"]


def client_for(server: Running, protocol: str) -> Any:
    if protocol == "http":
        return httpclient.InferenceServerClient(server.http)
    return grpcclient.InferenceServerClient(server.grpc)


def module_for(protocol: str) -> Any:
    return httpclient if protocol == "http" else grpcclient


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_shared_memory_inputs_and_outputs(server: Running, regions: Regions, protocol: str) -> None:
    client, mod = client_for(server, protocol), module_for(protocol)
    x = np.arange(16, dtype=np.float32)
    y = np.full(16, 0.5, dtype=np.float32)
    in_handle, in_key = regions.create(128)
    out_handle, out_key = regions.create(256)
    shm.set_shared_memory_region(in_handle, [x, y])
    name_in, name_out = unique("in"), unique("out")
    client.register_system_shared_memory(name_in, in_key, 128)
    client.register_system_shared_memory(name_out, out_key, 256)
    inputs = [mod.InferInput("INPUT0", [16], "FP32"), mod.InferInput("INPUT1", [16], "FP32")]
    inputs[0].set_shared_memory(name_in, 64)
    inputs[1].set_shared_memory(name_in, 64, offset=64)
    outputs = [mod.InferRequestedOutput("OUTPUT0"), mod.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory(name_out, 64, offset=128)
    outputs[1].set_shared_memory(name_out, 64)
    result = client.infer("add_sub", inputs, outputs=outputs)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.float32, [16], offset=128), x + y)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.float32, [16]), x - y)
    out0 = result.get_output("OUTPUT0")
    if protocol == "http":
        assert out0["parameters"] == {
            "shared_memory_region": name_out,
            "shared_memory_byte_size": 64,
            "shared_memory_offset": 128,
        }
        assert "data" not in out0
    else:
        params = {k: v.WhichOneof("parameter_choice") and getattr(v, v.WhichOneof("parameter_choice"))
                  for k, v in out0.parameters.items()}  # fmt: skip
        assert params == {"shared_memory_region": name_out, "shared_memory_byte_size": 64, "shared_memory_offset": 128}
        assert result.get_response().raw_output_contents[0] == b""  # one empty entry per output, as Triton
    status = client.get_system_shared_memory_status(name_out)
    if protocol == "http":
        assert status == [{"name": name_out, "key": out_key, "offset": 0, "byte_size": 256}]
    else:
        assert status.regions[name_out].key == out_key and status.regions[name_out].byte_size == 256
    client.unregister_system_shared_memory(name_in)
    client.unregister_system_shared_memory(name_out)
    client.unregister_system_shared_memory("never-registered")  # no error, as Triton
    with pytest.raises(InferenceServerException, match="Unable to find shared memory region"):
        client.infer("add_sub", inputs)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_shared_memory_beside_inline_inputs(server: Running, regions: Regions, protocol: str) -> None:
    """One input in a region, the other in the request body (gRPC: raw contents of the other inputs only)."""
    client, mod = client_for(server, protocol), module_for(protocol)
    x = np.linspace(-1, 1, 16, dtype=np.float32)
    handle, key = regions.create(64)
    shm.set_shared_memory_region(handle, [x])
    name = unique("mixed")
    client.register_system_shared_memory(name, key, 64)
    inputs = [mod.InferInput("INPUT0", [16], "FP32"), mod.InferInput("INPUT1", [16], "FP32")]
    inputs[0].set_data_from_numpy(np.ones(16, dtype=np.float32))
    inputs[1].set_shared_memory(name, 64)
    result = client.infer("add_sub", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), 1 - x)
    client.unregister_system_shared_memory(name)


def test_batching_and_cache_with_shared_memory(server: Running, regions: Regions) -> None:
    """Concurrent shm requests are batched (each reads its own slice); the response cache keys on the
    region's contents at request time and writes hits into the output region too."""
    client = grpcclient.InferenceServerClient(server.grpc)
    n = 8
    data = np.arange(n * 32, dtype=np.float32).reshape(n, 1, 32)
    in_handle, in_key = regions.create(data.nbytes)
    out_handle, out_key = regions.create(data.nbytes)
    shm.set_shared_memory_region(in_handle, [data])
    client.register_system_shared_memory("batch_in", in_key, data.nbytes)
    client.register_system_shared_memory("batch_out", out_key, data.nbytes)
    done = threading.Event()
    errors: list[Any] = []

    def callback(result: Any, error: Any) -> None:
        errors.append(error)
        if len(errors) == n:
            done.set()

    for i in range(n):
        inp = grpcclient.InferInput("INPUT0", [1, 32], "FP32")
        inp.set_shared_memory("batch_in", 128, offset=128 * i)
        out = grpcclient.InferRequestedOutput("OUTPUT0")
        out.set_shared_memory("batch_out", 128, offset=128 * i)
        client.async_infer("identity", [inp], callback, outputs=[out])
    assert done.wait(30)
    assert errors == [None] * n
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.float32, [n, 1, 32]), data)
    client.unregister_system_shared_memory()

    cached_in, cached_key = regions.create(128)
    cached_out, cached_out_key = regions.create(128)
    client.register_system_shared_memory("c_in", cached_key, 128)
    client.register_system_shared_memory("c_out", cached_out_key, 128)

    def run(x: np.ndarray) -> np.ndarray:
        shm.set_shared_memory_region(cached_in, [x, np.ones(16, dtype=np.float32)])
        inputs = [grpcclient.InferInput("INPUT0", [16], "FP32"), grpcclient.InferInput("INPUT1", [16], "FP32")]
        inputs[0].set_shared_memory("c_in", 64)
        inputs[1].set_shared_memory("c_in", 64, offset=64)
        outputs = [grpcclient.InferRequestedOutput("OUTPUT0"), grpcclient.InferRequestedOutput("OUTPUT1")]
        outputs[0].set_shared_memory("c_out", 64)
        outputs[1].set_shared_memory("c_out", 64, offset=64)  # every output: the cache stores whole responses
        client.infer("cached", inputs, outputs=outputs)
        return shm.get_contents_as_numpy(cached_out, np.float32, [16]).copy()

    a, b = np.arange(16, dtype=np.float32), np.arange(16, dtype=np.float32) * 3
    np.testing.assert_array_equal(run(a), a + 1)
    shm.set_shared_memory_region(cached_out, [np.zeros(32, dtype=np.float32)])
    np.testing.assert_array_equal(run(a), a + 1)  # a hit, written to the region
    np.testing.assert_array_equal(run(b), b + 1)  # new contents: a miss
    stats = client.get_inference_statistics("cached").model_stats[0]
    assert (stats.inference_stats.cache_hit.count, stats.inference_stats.cache_miss.count) == (1, 2)
    client.unregister_system_shared_memory()


def test_cached_response_does_not_follow_the_region(server: Running, regions: Regions) -> None:
    """A model that answers with its shared-memory input unchanged: the cached response keeps the values
    answered, not a view of the client's region that the client then overwrites."""
    client = grpcclient.InferenceServerClient(server.grpc)
    a, b = np.arange(16, dtype=np.float32), np.full(16, -7, dtype=np.float32)
    handle, key = regions.create(64)
    shm.set_shared_memory_region(handle, [a])
    name = unique("echo")
    client.register_system_shared_memory(name, key, 64)
    via_region = grpcclient.InferInput("INPUT0", [16], "FP32")
    via_region.set_shared_memory(name, 64)
    np.testing.assert_array_equal(client.infer("echo", [via_region]).as_numpy("OUTPUT0"), a)
    shm.set_shared_memory_region(handle, [b])  # the client reuses its region for the next request
    inline = grpcclient.InferInput("INPUT0", [16], "FP32")
    inline.set_data_from_numpy(a)
    np.testing.assert_array_equal(client.infer("echo", [inline]).as_numpy("OUTPUT0"), a)  # a hit: a, not b
    stats = client.get_inference_statistics("echo").model_stats[0].inference_stats
    assert (stats.cache_hit.count, stats.cache_miss.count) == (1, 1)
    client.unregister_system_shared_memory(name)


def test_unregister_while_in_use_unmaps_after_the_request(tmp_path: Path, regions: Regions) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "gated", GATED_CONFIG, {"model.py": gated_py("sluice_test_gate")})
    with held_gate("sluice_test_gate") as gate:
        handle = start_server(repo)
        try:
            client = grpcclient.InferenceServerClient(handle.grpc)
            region, key = regions.create(32)
            x = np.array([1, 2, 3, 4], dtype=np.float32)
            shm.set_shared_memory_region(region, [x])
            ours = mapped(key)  # this process is the client too: its own mapping
            client.register_system_shared_memory("busy", key, 32)
            assert mapped(key) == ours + 1
            inp = grpcclient.InferInput("INPUT0", [4], "FP32")
            inp.set_shared_memory("busy", 16)
            out = grpcclient.InferRequestedOutput("OUTPUT0")
            out.set_shared_memory("busy", 16, offset=16)
            answers: list[Any] = []
            finished = threading.Event()

            def callback(result: Any, error: Any) -> None:
                answers.append((result, error))
                finished.set()

            client.async_infer("gated", [inp], callback, outputs=[out])
            assert gate.entered.wait(30)  # type: ignore[attr-defined]
            client.unregister_system_shared_memory("busy")
            assert len(client.get_system_shared_memory_status().regions) == 0  # the name is free at once...
            assert mapped(key) == ours + 1  # ...the memory stays mapped for the request using it
            gate.release.set()  # type: ignore[attr-defined]
            assert finished.wait(30)
            assert answers[0][1] is None
            np.testing.assert_array_equal(shm.get_contents_as_numpy(region, np.float32, [4], offset=16), x * 2)
            assert mapped(key) == ours
        finally:
            gate.release.set()  # type: ignore[attr-defined]
            handle.stop()


# -- bad input, through the real clients ----------------------------------------------------------


def _error(call: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_bad_registrations(server: Running, regions: Regions, protocol: str) -> None:
    client = client_for(server, protocol)
    _, key = regions.create(64)
    for bad_key, words in [
        ("/sluice_no_such_object", "no shared memory object with key '/sluice_no_such_object'"),
        ("/a/b", "holds a '/' after the leading one"),
        ("/..", "holds '..'"),
        ("/.", "is '.'"),
        ("", "is empty"),
    ]:
        error = _error(lambda bad_key=bad_key: client.register_system_shared_memory("r", bad_key, 8))
        assert words in error.message() and "/dev/shm" not in error.message()
        if protocol == "grpc":
            assert error.status() == "StatusCode.INVALID_ARGUMENT"
    error = _error(lambda: client.register_system_shared_memory("r", key, 64, offset=8))
    assert "offset 8 + byte_size 64 runs past the end" in error.message() and "allowed: offset + byte_size <= 64" in (
        error.message()
    )
    assert "byte_size must be > 0" in _error(lambda: client.register_system_shared_memory("r", key, 0)).message()
    name = unique("dup")
    client.register_system_shared_memory(name, key, 64)
    error = _error(lambda: client.register_system_shared_memory(name, key, 64))
    assert f"shared memory region '{name}' already in manager" in error.message()
    if protocol == "grpc":
        assert error.status() == "StatusCode.ALREADY_EXISTS"
    error = _error(lambda: client.get_system_shared_memory_status("nope"))
    assert "Unable to find system shared memory region: 'nope'" in error.message()
    client.unregister_system_shared_memory(name)
    # A name is registered once, whichever the kind (as in Triton); CUDA regions: test_cuda_shm_protocol.py
    client.register_system_shared_memory(name, key, 64)
    error = _error(lambda: client.get_cuda_shared_memory_status(name))
    assert f"The region named '{name}' is registered as system shared memory, not CUDA shared memory" in (
        error.message()
    )
    client.unregister_cuda_shared_memory(name)  # not a CUDA region: left alone, no error (as Triton)
    assert [r["name"] if protocol == "http" else r.name for r in _regions(client)] == [name]
    client.unregister_system_shared_memory(name)


def _regions(client: Any) -> list[Any]:
    status = client.get_system_shared_memory_status()
    return status if isinstance(status, list) else list(status.regions.values())


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_bad_inference_references(server: Running, regions: Regions, protocol: str) -> None:
    client, mod = client_for(server, protocol), module_for(protocol)
    _, key = regions.create(64)
    name = unique("ref")
    client.register_system_shared_memory(name, key, 64)

    def infer(byte_size: int, offset: int = 0, region: str = name, out: tuple[int, int] | None = None) -> str:
        inputs = [mod.InferInput("INPUT0", [16], "FP32"), mod.InferInput("INPUT1", [16], "FP32")]
        inputs[0].set_shared_memory(region, byte_size, offset)
        inputs[1].set_data_from_numpy(np.zeros(16, dtype=np.float32))
        outputs = None
        if out is not None:
            outputs = [mod.InferRequestedOutput("OUTPUT0")]
            outputs[0].set_shared_memory(name, out[0], out[1])
        return _error(lambda: client.infer("add_sub", inputs, outputs=outputs)).message()

    assert "shared_memory_byte_size is 32 but shape [16] of FP32 needs 64 bytes" in infer(32)
    assert "offset 8 + byte_size 64 runs past the end of shared memory region" in infer(64, 8)
    assert "Unable to find shared memory region: 'elsewhere'" in infer(64, region="elsewhere")
    assert "should be at least 64 bytes to hold the results" in infer(64, out=(32, 0))
    assert "offset 40 + byte_size 32 runs past the end" in infer(64, out=(32, 40))
    client.unregister_system_shared_memory(name)


@pytest.mark.parametrize(
    "parameters, words",
    [
        ({"shared_memory_region": "r"}, "needs shared_memory_byte_size"),
        ({"shared_memory_byte_size": 64}, "given without shared_memory_region"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": -1}, "must be >= 0, got -1"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": "64"}, "must be an integer"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": 64, "shared_memory_offset": -8}, ">= 0, got -8"),
        ({"shared_memory_region": 7, "shared_memory_byte_size": 64}, "non-empty name"),
    ],
)
def test_malformed_parameters_over_http(server: Running, parameters: dict[str, Any], words: str) -> None:
    body = {
        "inputs": [
            {"name": "INPUT0", "shape": [16], "datatype": "FP32", "parameters": parameters},
            {"name": "INPUT1", "shape": [16], "datatype": "FP32", "data": [0.0] * 16},
        ]
    }
    conn = http.client.HTTPConnection(*server.http.split(":"))
    conn.request("POST", "/v2/models/add_sub/infer", body=json.dumps(body))
    answer = conn.getresponse()
    assert answer.status == 400
    assert words in json.loads(answer.read())["error"]
    conn.close()


# -- no read outside the region -------------------------------------------------------------------

REGION_BYTES = 256


@pytest.fixture(scope="module")
def sweep_region(server: Running) -> Iterator[tuple[Any, str]]:
    """A region of 256 bytes whose every byte is known, inside a larger object whose bytes around it
    are a marker: a read outside the registered window would show the marker."""
    key = f"/sluice_sweep_{uuid.uuid4().hex[:8]}"
    handle = shm.create_shared_memory_region("sweep", key, 4096 + REGION_BYTES + 4096)
    shm.set_shared_memory_region(handle, [np.full(4096 + REGION_BYTES + 4096, 0xEE, dtype=np.uint8)])
    window = np.arange(REGION_BYTES, dtype=np.uint8)
    shm.set_shared_memory_region(handle, [window], offset=4096)
    client = httpclient.InferenceServerClient(server.http)
    client.register_system_shared_memory("sweep", key, REGION_BYTES, offset=4096)
    yield handle, key
    client.unregister_system_shared_memory("sweep")
    shm.destroy_shared_memory_region(handle)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    offset=st.one_of(st.integers(0, REGION_BYTES + 16), st.integers(-(2**40), 2**62)),
    count=st.one_of(st.integers(0, 80), st.integers(-4, 2**40)),
)
@example(offset=100, count=39)  # ends on the window's last FP32, a NaN with a payload
def test_sweep_offsets_and_sizes_never_read_outside(
    server: Running, sweep_region: tuple[Any, str], offset: int, count: int
) -> None:
    """Any offset and FP32 element count (byte_size = 4 * count): in range, the model sees exactly
    the bytes of the window; out of range, a 400 naming the region; never the marker around it."""
    shape = [max(count, 0)]
    body = {
        "inputs": [
            {
                "name": "INPUT0",
                "shape": shape,
                "datatype": "FP32",
                "parameters": {"shared_memory_region": "sweep", "shared_memory_byte_size": count * 4,
                               "shared_memory_offset": offset},
            }
        ]
    }  # fmt: skip
    body["inputs"][0]["shape"] = [1, *shape]
    conn = http.client.HTTPConnection(*server.http.split(":"))
    conn.request("POST", "/v2/models/identity/infer", body=json.dumps(body))
    answer = conn.getresponse()
    payload = json.loads(answer.read())
    conn.close()
    inside = offset >= 0 and count >= 0 and offset + count * 4 <= REGION_BYTES
    if count > (1 << 24):
        assert answer.status in (400, 413)
    elif inside:
        assert answer.status == 200, payload
        got = np.array(payload["outputs"][0]["data"], dtype=np.float32)
        window = np.arange(REGION_BYTES, dtype=np.uint8)[offset : offset + count * 4].tobytes()
        expected = np.frombuffer(window, dtype=np.float32)
        # JSON writes every NaN as NaN, so a NaN's payload bits (bytes fc fd fe ff read as FP32) do
        # not come back: NaN where the window holds one, every other element bit for bit.
        nan = np.isnan(expected)
        assert (np.isnan(got) == nan).all()
        assert got[~nan].tobytes() == expected[~nan].tobytes()
    else:
        assert answer.status == 400, payload
        error = payload["error"]
        assert "region 'sweep'" in error or "must be >= 0" in error, error  # names the region, or the bad value


@given(offset=st.integers(0, 2**64), byte_size=st.integers(0, 2**64), size=st.integers(0, 2**40))
def test_span_check_is_exact(offset: int, byte_size: int, size: int) -> None:
    problem = sluice_shm.span_problem(sluice_shm.Ref("r", byte_size, offset), size)
    assert (problem is None) == (offset + byte_size <= size)


def test_a_key_with_a_lone_surrogate_is_a_400(server: Running) -> None:
    """JSON can carry a lone surrogate (\\ud800); the key is refused, not a 500 from os.open."""
    import json
    import urllib.error
    import urllib.request

    body = json.dumps({"key": "/\ud800", "offset": 0, "byte_size": 8}).encode()
    request = urllib.request.Request(f"http://{server.http}/v2/systemsharedmemory/region/r/register", data=body,
                                     method="POST")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request)
    assert caught.value.code == 400 and b"lone surrogate" in caught.value.read()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_repeated_request_writes_its_outputs_to_the_region_every_time(
    server: Running, regions: Regions, protocol: str
) -> None:
    """Identical requests (inline inputs, outputs to a region) hit the servers' request-plan caches
    from the second on: each must still write into the region, not answer in the body."""
    client, mod = client_for(server, protocol), module_for(protocol)
    handle, key = regions.create(128)
    name = unique("again")
    client.register_system_shared_memory(name, key, 128)
    x = np.arange(16, dtype=np.float32)
    for attempt in range(4):
        shm.set_shared_memory_region(handle, [np.zeros(32, np.float32)])
        inputs = [mod.InferInput("INPUT0", [16], "FP32"), mod.InferInput("INPUT1", [16], "FP32")]
        for tensor in inputs:
            tensor.set_data_from_numpy(x)
        outputs = [mod.InferRequestedOutput("OUTPUT0")]
        outputs[0].set_shared_memory(name, 64)
        result = client.infer("add_sub", inputs, outputs=outputs)
        np.testing.assert_array_equal(
            shm.get_contents_as_numpy(handle, np.float32, [16]), x + x, err_msg=f"attempt {attempt}"
        )
        if protocol == "http":
            assert result.get_output("OUTPUT0")["parameters"]["shared_memory_region"] == name
        else:
            assert "shared_memory_region" in result.get_output("OUTPUT0").parameters
            assert result.get_response().raw_output_contents[0] == b""
    client.unregister_system_shared_memory(name)


DECOUPLED_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            sender = request.get_response_sender()
            for k in range(1, 4):  # x, 2x, 3x: each response written over the last in the region
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", (x * k).astype(np.float32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

DECOUPLED_CONFIG = """
name: "triple"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
model_transaction_policy { decoupled: true }
"""


def test_a_decoupled_model_writes_each_response_to_the_region_and_lets_go_at_the_final_one(
    tmp_path: Path, regions: Regions
) -> None:
    """ModelStreamInfer to a decoupled model with inputs and outputs in shared memory: every response
    writes its outputs into the region (as in Triton, each over the last: the region holds the final
    one's) and answers with the region's parameters, not the data; the regions are let go once the
    final response is sent (they stayed held, so an unregistered region stayed mapped for good, and
    the outputs came back inline, ignoring the region). A region too small fails each response."""
    repo = tmp_path / "repo"
    write_model(repo, "triple", DECOUPLED_CONFIG, {"model.py": DECOUPLED_PY})
    handle = start_server(repo)
    client = grpcclient.InferenceServerClient(handle.grpc)
    answers: list[tuple[Any, Any]] = []
    done = threading.Condition()

    def callback(result: Any, error: Any) -> None:
        with done:
            answers.append((result, error))
            done.notify_all()

    try:
        region, key = regions.create(32)
        x = np.array([1, 2, 3, 4], dtype=np.float32)
        shm.set_shared_memory_region(region, [x, np.zeros(4, np.float32)])
        ours = mapped(key)
        client.register_system_shared_memory("io", key, 32)
        inp = grpcclient.InferInput("INPUT0", [4], "FP32")
        inp.set_shared_memory("io", 16)
        out = grpcclient.InferRequestedOutput("OUTPUT0")
        out.set_shared_memory("io", 16, offset=16)
        client.start_stream(callback)
        client.async_stream_infer("triple", [inp], outputs=[out], request_id="r1", enable_empty_final_response=True)
        with done:
            assert done.wait_for(lambda: len(answers) >= 4, timeout=30), answers
        assert [error for _, error in answers] == [None] * 4
        for result, _ in answers[:3]:
            response = result.get_response()
            assert response.id == "r1" and response.raw_output_contents[0] == b""
            assert response.outputs[0].parameters["shared_memory_region"].string_param == "io"
            assert response.outputs[0].parameters["shared_memory_offset"].int64_param == 16
        assert answers[3][0].get_response().parameters["triton_final_response"].bool_param
        np.testing.assert_array_equal(shm.get_contents_as_numpy(region, np.float32, [4], offset=16), x * 3)
        client.unregister_system_shared_memory("io")
        assert mapped(key) == ours  # nothing holds it any more: unmapped at once

        _, small_key = regions.create(8)
        ours = mapped(small_key)
        client.register_system_shared_memory("small", small_key, 8)
        inline = grpcclient.InferInput("INPUT0", [4], "FP32")
        inline.set_data_from_numpy(x)
        tiny = grpcclient.InferRequestedOutput("OUTPUT0")
        tiny.set_shared_memory("small", 8)
        answers.clear()
        client.async_stream_infer("triple", [inline], outputs=[tiny], request_id="r2", enable_empty_final_response=True)
        with done:
            assert done.wait_for(lambda: len(answers) >= 4, timeout=30), answers
        errors = [error for _, error in answers[:3]]
        assert all(e is not None and "should be at least 16 bytes to hold the results" in e.message() for e in errors)
        assert answers[3][1] is None and answers[3][0].get_response().parameters["triton_final_response"].bool_param
        # the statistics count what the client got: r1's three responses succeeded, r2's failed (they
        # were counted as successes, the region written after the count)
        stats = client.get_inference_statistics("triple", as_json=True)["model_stats"][0]["response_stats"]
        counted = {index: (entry["success"].get("count", "0"), entry["fail"].get("count", "0"))
                   for index, entry in stats.items() if index in ("0", "1", "2")}
        assert counted == {"0": ("1", "1"), "1": ("1", "1"), "2": ("1", "1")}
        client.unregister_system_shared_memory("small")
        assert mapped(small_key) == ours
    finally:
        client.stop_stream()
        client.close()
        handle.stop()
