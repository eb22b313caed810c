"""Protocol worker processes (``--protocol-workers``): workers decode, the engine batches.

The wire format and the small decisions are tested as pure functions; the rest on the real server
with two workers (the engine in this process where a test needs the in-process gate, ``sluice
serve`` in a subprocess where it needs signals), called with tritonclient and plain HTTP.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import http.client
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, serialize_byte_tensor, serialized_byte_size

from sluice.runtime import worker_wire
from sluice.runtime.frontend_workers import (
    auto_protocol_workers,
    cgroup_cpu_limit,
    own_listeners,
    protocol_workers_problem,
    restart_delay,
    usable_cpus,
)
from sluice.runtime.server import StartupError

from .conftest import (  # type: ignore[import-not-found]
    ADD_SUB_CONFIG,
    BUILDERS,
    MLP_CONFIG,
    Running,
    gate,
    gated_py,
    start_server,
    write_model,
)

# -- pure ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (0, None),
        (1, None),
        (64, None),
        (65, "must be from 0 (no workers: one process decodes every request) to 64, got 65"),
        (-1, "must be from 0 (no workers: one process decodes every request) to 64, got -1"),
        ("two", "must be an integer from 0 to 64, got 'two'"),
        (True, "must be an integer from 0 to 64, got True"),
    ],
)
def test_protocol_workers_values(value: object, problem: str | None) -> None:
    assert protocol_workers_problem(value) == problem


def test_restart_delay_backs_off_only_for_young_deaths() -> None:
    assert restart_delay(0.2) == 1.0
    assert restart_delay(3600.0) == 0.0


def test_allocator_first_fit_and_coalescing() -> None:
    allocator = worker_wire.Allocator(1024)
    a, b, c = allocator.allocate(100), allocator.allocate(200), allocator.allocate(64)
    assert (a, b, c) == (0, 128, 384)
    assert allocator.allocate(1024) is None
    allocator.free(b)
    assert allocator.allocate(150) == 128  # the freed range is reused
    allocator.free(a)
    allocator.free(128)
    allocator.free(c)
    assert allocator.used_bytes == 0
    assert allocator.allocate(1024) == 0  # every range coalesced back into one


# -- the real server ---------------------------------------------------------------------------------

GATE = "sluice_test_worker_gate"
BATCHED_GATED_CONFIG = """
name: "gated"
backend: "python"
max_batch_size: 4
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
dynamic_batching { }
"""
IDENTITY_CONFIG = """
name: "identity"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
"""
IDENTITY_PY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())
            ])
            for r in requests
        ]
"""

REMEMBER_CONFIG = IDENTITY_CONFIG.replace('name: "identity"', 'name: "remember"')
REMEMBER_PY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    \"\"\"Answers each request with the input of the one before it: it keeps its inputs.\"\"\"

    def initialize(self, args):
        self.previous = None

    def execute(self, requests):
        responses = []
        for request in requests:
            now = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            before, self.previous = (now if self.previous is None else self.previous), now
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT0", before)]))
        return responses
"""


def _repo(root: Path) -> Path:
    repo = root / "repo"
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    write_model(repo, "mlp", MLP_CONFIG, {"model.onnx": BUILDERS.mlp_model()})
    write_model(repo, "gated", BATCHED_GATED_CONFIG, {"model.py": gated_py(GATE)})
    write_model(repo, "identity", IDENTITY_CONFIG, {"model.py": IDENTITY_PY})
    bytes_config = IDENTITY_CONFIG.replace('"identity"', '"identity_bytes"').replace("TYPE_FP32", "TYPE_STRING")
    write_model(repo, "identity_bytes", bytes_config, {"model.py": IDENTITY_PY})
    write_model(repo, "remember", REMEMBER_CONFIG, {"model.py": REMEMBER_PY})
    return repo


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Running, Running, Any]]:
    """(two protocol workers, single process) on the same repository, and the models' gate."""
    repo = _repo(tmp_path_factory.mktemp("workers"))
    with gate(GATE) as opened:
        workers = start_server(repo, protocol_workers=2)
        single = start_server(repo)
        try:
            yield workers, single, opened
        finally:
            workers.stop()
            single.stop()


def _add_sub_inputs(module: Any, a: np.ndarray) -> list[Any]:
    inputs = [module.InferInput(f"INPUT{i}", [16], "FP32") for i in range(2)]
    for tensor in inputs:
        tensor.set_data_from_numpy(a)
    return inputs


def test_inference_is_correct_over_http_and_grpc(servers: tuple[Running, Running, Any]) -> None:
    workers, _, _ = servers
    a = np.arange(16, dtype=np.float32)
    http = httpclient.InferenceServerClient(workers.http)
    grpc = grpcclient.InferenceServerClient(workers.grpc)
    for client, module in ((http, httpclient), (grpc, grpcclient)):
        result = client.infer("add_sub", _add_sub_inputs(module, a))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - a)
    # A tensor large enough to cross through the shared-memory arenas, both ways.
    big = np.random.default_rng(1).random(300_000, dtype=np.float32)
    for client, module in ((http, httpclient), (grpc, grpcclient)):
        tensor = module.InferInput("INPUT0", [big.size], "FP32")
        tensor.set_data_from_numpy(big)
        np.testing.assert_array_equal(client.infer("identity", [tensor]).as_numpy("OUTPUT0"), big)


def test_an_input_a_model_keeps_is_never_overwritten_by_later_requests(servers: tuple[Running, Running, Any]) -> None:
    """Large inputs reach the engine as views of the worker's shared-memory arena (no copy): the
    range stays the request's for as long as anything (here the model) refers to it, while ~40 MB of
    later requests go through the 32 MiB arena."""
    workers, _, _ = servers
    rng = np.random.default_rng(11)
    previous: np.ndarray | None = None
    for client, module in (
        (httpclient.InferenceServerClient(workers.http), httpclient),
        (grpcclient.InferenceServerClient(workers.grpc), grpcclient),
    ):
        for _ in range(16):
            sent = rng.random(300_000, dtype=np.float32)  # 1.2 MB
            tensor = module.InferInput("INPUT0", [sent.size], "FP32")
            tensor.set_data_from_numpy(sent)
            got = client.infer("remember", [tensor]).as_numpy("OUTPUT0")
            np.testing.assert_array_equal(got, sent if previous is None else previous)
            previous = sent


def _both(call: Any) -> tuple[Any, Any]:
    """The outcome of ``call(client_module, url_of)`` on both servers: (result or error)."""
    out = []
    for pick in (0, 1):
        try:
            out.append(call(pick))
        except InferenceServerException as exc:
            out.append(("error", exc.status(), exc.message()))
    return out[0], out[1]


def test_metadata_ready_config_stats_identical_to_single_process(servers: tuple[Running, Running, Any]) -> None:
    running = servers[:2]
    http = [httpclient.InferenceServerClient(r.http) for r in running]
    grpc = [grpcclient.InferenceServerClient(r.grpc) for r in running]
    checks = [
        lambda i: http[i].get_server_metadata(),
        lambda i: http[i].is_server_ready(),
        lambda i: http[i].is_server_live(),
        lambda i: http[i].is_model_ready("mlp"),
        lambda i: http[i].is_model_ready("nope"),
        lambda i: http[i].get_model_metadata("mlp"),
        lambda i: http[i].get_model_config("mlp"),
        lambda i: http[i].get_inference_statistics("mlp"),
        lambda i: http[i].get_model_repository_index(),
        lambda i: http[i].get_log_settings(),
        lambda i: http[i].get_model_metadata("nope"),
        lambda i: http[i].get_inference_statistics("nope"),
        lambda i: str(grpc[i].get_server_metadata()),
        lambda i: grpc[i].is_server_ready(),
        lambda i: str(grpc[i].get_model_metadata("mlp")),
        lambda i: str(grpc[i].get_model_config("mlp")),
        lambda i: str(grpc[i].get_inference_statistics("mlp")),
        lambda i: str(grpc[i].get_model_repository_index()),
        lambda i: str(grpc[i].get_model_metadata("nope")),
        lambda i: str(grpc[i].get_system_shared_memory_status()),
    ]
    for check in checks:
        with_workers, single = _both(check)
        assert with_workers == single


def _json_input(name: str, datatype: str, size: int) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": [size], "data": [0] * size}


def _post(address: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(address, timeout=30)
    try:
        conn.request("POST", path, body, headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v2/models/nope/infer", {"inputs": []}),
        ("/v2/models/add_sub/infer", {"inputs": [_json_input("INPUT0", "FP32", 16)]}),
        ("/v2/models/add_sub/infer", {"inputs": [_json_input("INPUT0", "INT8", 16), _json_input("INPUT1", "FP32", 8)]}),
        ("/v2/models/add_sub/infer", {"inputs": [_json_input("INPUT0", "FP32", 4), _json_input("INPUT1", "FP32", 16)]}),
        ("/v2/models/add_sub/infer", "{not json"),
        ("/v2/models/add_sub/versions/x/infer", {"inputs": []}),
        ("/v2/repository/models/mlp/load", {}),
    ],
)  # fmt: skip
def test_bad_input_errors_identical_to_single_process(
    servers: tuple[Running, Running, Any], path: str, body: Any
) -> None:
    raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    answers = [_post(r.http, path, raw) for r in servers[:2]]
    assert answers[0] == answers[1]
    assert answers[0][0] >= 400


def test_bad_grpc_input_errors_identical_to_single_process(servers: tuple[Running, Running, Any]) -> None:
    clients = [grpcclient.InferenceServerClient(r.grpc) for r in servers[:2]]
    wrong_type = grpcclient.InferInput("INPUT0", [16], "INT32")
    wrong_type.set_data_from_numpy(np.zeros(16, dtype=np.int32))
    right = grpcclient.InferInput("INPUT1", [16], "FP32")
    right.set_data_from_numpy(np.zeros(16, dtype=np.float32))
    for model, inputs in (("nope", [right]), ("add_sub", [wrong_type, right]), ("add_sub", [right])):
        with_workers, single = _both(lambda i, m=model, x=inputs: clients[i].infer(m, x))
        assert with_workers == single
        assert with_workers[0] == "error"


def _worker_connections(address: str, count: int) -> dict[str, http.client.HTTPConnection]:
    """One open keep-alive connection per worker (the sluice-worker header says which served it)."""
    found: dict[str, http.client.HTTPConnection] = {}
    # The workers race to accept on one listening socket; under CPU load a warm worker can win
    # hundreds of races in a row, so this bounds the search by time (a failure bound, not a window).
    deadline = time.monotonic() + 60
    for attempt in itertools.count():
        if time.monotonic() > deadline:
            break
        if attempt >= 200:
            time.sleep(0.01)  # past the usual case: at most ~6,000 connections, well within the local ports
        conn = http.client.HTTPConnection(address, timeout=30)
        conn.request("GET", "/v2/health/ready")
        response = conn.getresponse()
        response.read()
        worker = response.getheader("sluice-worker")
        assert worker is not None
        if worker in found:
            conn.close()
        else:
            found[worker] = conn
        if len(found) == count:
            return found
    raise AssertionError(f"connections reached only workers {sorted(found)}")


async def _burst(address: str, count: int) -> collections.Counter[str]:
    """Open ``count`` keep-alive connections at once; how many each worker serves (its header says)."""
    host, port = address.rsplit(":", 1)
    host = host.strip("[]")

    async def one() -> tuple[str, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: sluice\r\n\r\n")
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        found = re.search(r"(?im)^sluice-worker: *(\d+)", head)
        assert found is not None, head
        return found.group(1), writer

    opened = await asyncio.gather(*(one() for _ in range(count)))
    for _, writer in opened:
        writer.close()
    return collections.Counter(worker for worker, _ in opened)


@pytest.mark.skipif(not own_listeners(4), reason="SO_REUSEPORT balances listeners on Linux only")
def test_a_burst_of_connections_spreads_over_the_workers(tmp_path: Path) -> None:
    # One shared listening socket gave one worker most of a burst (libuv accepts until the backlog is
    # empty): 38 of 64 to one of 4 workers, 54 of 64 to one of 2 here. Each worker's own SO_REUSEPORT
    # listener gets its hash share: 128 connections over 4 workers, 32 expected and one over 56 about
    # 2 in a million.
    repo = tmp_path / "repo"
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    running = start_server(repo, protocol_workers=4)
    try:
        spread = asyncio.run(_burst(running.http, 128))
        assert sorted(spread) == ["0", "1", "2", "3"], spread
        assert max(spread.values()) <= 56, spread
        _infer_add_sub(running.http)
    finally:
        running.stop()


def test_a_port_another_servers_reuseport_listeners_hold_is_refused(tmp_path: Path) -> None:
    # The workers' listeners share the port with SO_REUSEPORT; the engine binds the first without it, so
    # a server already listening there that way (another sluice with workers) is refused, not shared.
    other = socket.socket()
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    other.bind(("127.0.0.1", 0))
    other.listen(8)
    repo = tmp_path / "repo"
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    try:
        with pytest.raises(StartupError, match="a port is already in use"):
            start_server(repo, protocol_workers=2, http_port=other.getsockname()[1])
    finally:
        other.close()


def test_the_workers_port_is_held_listening_from_the_start(tmp_path: Path) -> None:
    # The engine makes every worker's listening socket itself, listening at once: a socket bound to the
    # port without listening would not keep a SO_REUSEADDR bind off it (two servers, or HTTP and gRPC
    # asked on one port, came up sharing it: half of the HTTP requests reached a gRPC listener).
    repo = tmp_path / "repo"
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with pytest.raises(StartupError, match="a port is already in use"):
        start_server(repo, protocol_workers=2, http_port=port, grpc_port=port)
    running = start_server(repo, protocol_workers=2)
    try:
        intruder = socket.socket()
        intruder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with intruder, pytest.raises(OSError) as refused:
            intruder.bind(("127.0.0.1", running.server.ports.http))
        assert refused.value.errno == errno.EADDRINUSE
        _infer_add_sub(running.http)
    finally:
        running.stop()


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6 in this Python")
def test_workers_serve_an_ipv6_address(tmp_path: Path) -> None:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    repo = tmp_path / "repo"
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    running = start_server(repo, protocol_workers=2, host="::1")
    try:
        port = running.http.rsplit(":", 1)[1]
        spread = asyncio.run(_burst(f"[::1]:{port}", 32))
        assert sorted(spread) == ["0", "1"], spread
    finally:
        running.stop()


@pytest.mark.parametrize("which", ["workers", "single"])
def test_an_upgrade_request_is_answered_as_http_1_1_then_closed(servers: tuple[Running, Running, Any], which: str):
    """``curl --http2`` on http:// asks to upgrade to h2c; the answer is plain HTTP/1.1, and then the
    connection closes (what would follow is another protocol), also when the answer comes later
    (an inference, or any request a worker forwards to the engine)."""
    server = servers[0] if which == "workers" else servers[1]
    upgrade = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"
    body = json.dumps(
        {"inputs": [{"name": f"INPUT{i}", "datatype": "FP32", "shape": [16], "data": [1.0] * 16} for i in range(2)]}
    ).encode()
    requests = [
        b"GET /v2/health/ready HTTP/1.1\r\nHost: t\r\n" + upgrade + b"\r\n",
        b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\n" + upgrade
        + b"Content-Length: %d\r\n\r\n%s" % (len(body), body),
    ]  # fmt: skip
    for raw in requests:
        host, port = server.http.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(raw)
            received = b""
            while chunk := sock.recv(65536):  # until the server closes
                received += chunk
        head, _, answer = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 "), received[:300]
        assert b"connection: close" in head.lower()
        if raw.startswith(b"POST"):
            assert json.loads(answer)["outputs"][0]["data"] == [2.0] * 16


def _gated_body(value: float) -> bytes:
    return json.dumps(
        {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [value] * 4}]}
    ).encode()


def _queue_depth(running: Running, model: str) -> float:
    with urllib.request.urlopen(f"http://{running.metrics}/metrics", timeout=10) as response:
        text = response.read().decode()
    match = re.search(r'^sluice_queue_depth\{[^}]*model="' + model + r'"[^}]*\} (\S+)$', text, re.M)
    assert match is not None
    return float(match.group(1))


def _wait_for(condition: Any, what: str) -> None:
    for _ in range(1000):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


def _batch_sizes(running: Running, model: str) -> dict[int, int]:
    stats = httpclient.InferenceServerClient(running.http).get_inference_statistics(model)["model_stats"][0]
    return {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats.get("batch_stats", [])}


def test_requests_from_different_workers_form_one_batch(servers: tuple[Running, Running, Any]) -> None:
    workers, _, opened = servers
    opened.entered.clear()
    opened.release.clear()
    before = _batch_sizes(workers, "gated")
    conns = _worker_connections(workers.http, 2)
    answers: dict[str, tuple[int, Any]] = {}

    def send(key: str, conn: http.client.HTTPConnection, value: float) -> None:
        conn.request("POST", "/v2/models/gated/infer", _gated_body(value))
        response = conn.getresponse()
        answers[key] = (response.status, json.loads(response.read()))

    first = threading.Thread(target=send, args=("first", http.client.HTTPConnection(workers.http, timeout=30), 1.0))
    first.start()
    assert opened.entered.wait(30)  # the model's one instance is busy with the first request
    threads = [threading.Thread(target=send, args=(w, conns[w], 2.0 + int(w))) for w in ("0", "1")]
    for thread in threads:
        thread.start()
    _wait_for(lambda: _queue_depth(workers, "gated") == 2, "both workers' requests queued in the engine")
    opened.release.set()
    for thread in (first, *threads):
        thread.join(30)
    assert {k: v[0] for k, v in answers.items()} == {"first": 200, "0": 200, "1": 200}
    assert answers["1"][1]["outputs"][0]["data"] == [6.0] * 4
    after = _batch_sizes(workers, "gated")
    grown = {size: after.get(size, 0) - before.get(size, 0) for size in after}
    assert {size: n for size, n in grown.items() if n} == {1: 1, 2: 1}  # the two queued ones ran as one batch
    for conn in conns.values():
        conn.close()


def test_cancelled_queued_request_never_runs(servers: tuple[Running, Running, Any]) -> None:
    workers, _, opened = servers
    opened.entered.clear()
    opened.release.clear()
    grpc = grpcclient.InferenceServerClient(workers.grpc)
    client = httpclient.InferenceServerClient(workers.http)
    before = client.get_inference_statistics("gated")["model_stats"][0]
    tensor = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
    results: list[Any] = []
    grpc.async_infer("gated", [tensor], lambda result, error: results.append((result, error)))
    assert opened.entered.wait(30)
    # queued behind it: one over HTTP whose client goes away, one over gRPC that the client cancels
    conn = http.client.HTTPConnection(workers.http, timeout=30)
    conn.request("POST", "/v2/models/gated/infer", _gated_body(5.0))
    call = grpc.async_infer("gated", [tensor], lambda result, error: results.append((result, error)))
    _wait_for(lambda: _queue_depth(workers, "gated") == 2, "two requests queued")
    conn.sock.shutdown(2)  # type: ignore[union-attr]
    conn.close()
    call.cancel()
    _wait_for(lambda: _queue_depth(workers, "gated") == 0, "the cancellations reached the engine's queue")
    opened.release.set()
    _wait_for(lambda: len(results) == 2, "both gRPC callbacks")
    after = client.get_inference_statistics("gated")["model_stats"][0]
    assert int(after["execution_count"]) - int(before["execution_count"]) == 1  # only the first one ran
    assert int(after["inference_stats"]["success"]["count"]) - int(before["inference_stats"]["success"]["count"]) == 1


# -- sluice serve --protocol-workers 2 -------------------------------------------------------------------

FIFO_CONFIG = """
name: "held"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""
FIFO_PY = """
import os
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        gate = os.environ["SLUICE_TEST_GATE_DIR"]
        open(os.path.join(gate, "entered"), "w").close()
        with open(os.path.join(gate, "release")) as fifo:  # blocks until the test writes
            fifo.read()
        return [
            pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() + 1)
            ])
            for r in requests
        ]
"""


class Cli:
    """``sluice serve --protocol-workers 2`` on ports it picks; its output lines as they come."""

    def __init__(self, repo: Path, cwd: Path, env: dict[str, str], extra: tuple[str, ...] = ()) -> None:
        cmd = [
            sys.executable, "-m", "sluice.runtime", "serve", "--model-repository", str(repo), "--http-port", "0",
            "--grpc-port", "0", "--metrics-port", "0", "--protocol-workers", "2", "--drain-period-s", "0", *extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **env}
        )
        self.lines: list[str] = []
        line = self.until("sluice ready")
        self.http = "127.0.0.1:" + re.search(r"HTTP \S+:(\d+)", line).group(1)  # type: ignore[union-attr]
        self.metrics = "127.0.0.1:" + re.search(r"metrics \S+:(\d+)", line).group(1)  # type: ignore[union-attr]
        self.grpc = "127.0.0.1:" + re.search(r"gRPC \S+:(\d+)", line).group(1)  # type: ignore[union-attr]
        self.pids = [int(p) for p in re.findall(r"\d+", self.find("protocol worker(s) serving").split("pids")[1])]

    def until(self, text: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if text in line:
                return line
        raise AssertionError(f"the server ended before {text!r}:\n" + "".join(self.lines))

    def find(self, text: str) -> str:
        return next(line for line in self.lines if text in line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def _pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            return not any(line.startswith("State:") and "Z" in line for line in status)
    except FileNotFoundError:
        return False


@pytest.fixture
def cli(tmp_path: Path) -> Iterator[tuple[Cli, Path]]:
    repo = tmp_path / "repo"
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    write_model(repo, "held", FIFO_CONFIG, {"model.py": FIFO_PY})
    gate_dir = tmp_path / "gate"
    gate_dir.mkdir()
    os.mkfifo(gate_dir / "release")
    server = Cli(repo, tmp_path, {"SLUICE_TEST_GATE_DIR": str(gate_dir)})
    try:
        yield server, gate_dir
    finally:
        server.close()


def _infer_add_sub(address: str) -> None:
    a = np.arange(16, dtype=np.float32)
    result = httpclient.InferenceServerClient(address).infer("add_sub", _add_sub_inputs(httpclient, a))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)


def _worker_metrics(metrics: str) -> dict[str, float]:
    """The protocol worker families of the server's Prometheus exposition."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        name: float(value)
        for name, value in (line.split() for line in text.splitlines() if line.startswith("sluice_protocol_worker"))
    }


def test_killed_worker_is_restarted_and_workers_die_with_the_engine(cli: tuple[Cli, Path]) -> None:
    server, _ = cli
    assert len(server.pids) == 2
    assert _worker_metrics(server.metrics) == {
        "sluice_protocol_workers": 2.0, "sluice_protocol_workers_serving": 2.0,
        "sluice_protocol_worker_restarts_total": 0.0,
    }
    arenas = _engine_arenas(server.proc.pid)
    os.kill(server.pids[0], signal.SIGKILL)
    # A new worker takes a Python start (and a second's back-off: it died young) to serve again.
    _wait_for(lambda: _worker_metrics(server.metrics)["sluice_protocol_workers_serving"] == 1,
              "the metrics show one worker serving")
    line = server.until("restarted: pid")
    assert _worker_metrics(server.metrics) == {
        "sluice_protocol_workers": 2.0, "sluice_protocol_workers_serving": 2.0,
        "sluice_protocol_worker_restarts_total": 1.0,
    }
    new_pid = int(line.rsplit("pid", 1)[1])
    assert new_pid not in server.pids
    assert any("exited with signal 9" in seen and "restarting it" in seen for seen in server.lines)
    conns = _worker_connections(server.http, 2)  # both workers take connections again
    for conn in conns.values():
        conn.close()
    for _ in range(4):
        _infer_add_sub(server.http)
    # the dead worker's two arena mappings went (a cycle kept them, and the engine rarely collects cycles)
    assert _engine_arenas(server.proc.pid) == arenas
    workers = [server.pids[1], new_pid]
    server.proc.kill()  # the engine dies without a word: its workers must not outlive it
    server.proc.wait(30)
    _wait_for(lambda: not any(_alive(pid) for pid in workers), "the workers exit with the engine")


def _hold_until(
    address: str, done: Callable[[dict[str, http.client.HTTPConnection], collections.Counter[str]], bool]
) -> tuple[dict[str, http.client.HTTPConnection], collections.Counter[str]]:
    """With --max-connections 1: connect until ``done(held, refused)``: ``held`` one open connection per
    worker that took one, ``refused`` the 503s per worker (its sluice-worker header says which)."""
    held: dict[str, http.client.HTTPConnection] = {}
    refused: collections.Counter[str] = collections.Counter()
    deadline = time.monotonic() + 60
    while not done(held, refused):
        assert time.monotonic() < deadline, f"held {sorted(held)}, refused {refused}"
        conn = http.client.HTTPConnection(address, timeout=30)
        conn.request("GET", "/v2/health/ready")
        response = conn.getresponse()
        body = response.read()
        worker = response.getheader("sluice-worker")
        assert worker is not None
        if response.status == 503:
            assert b"--max-connections" in body
            refused[worker] += 1
            conn.close()
        elif worker in held:
            conn.close()
        else:
            held[worker] = conn
    return held, refused


ISO_LINE = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ "


def test_workers_log_as_the_engine_settings_say_and_follow_changes(tmp_path: Path) -> None:
    """A worker's lines take the engine's log settings at start and when a client changes them
    (/v2/logging), tagged with the worker; a restarted worker starts with the settings in force."""
    repo = tmp_path / "repo"
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    server = Cli(repo, tmp_path, {}, ("--max-connections", "1"))
    try:
        with grpcclient.InferenceServerClient(server.grpc) as client:  # gRPC: its own connection limit
            client.update_log_settings({"log_format": "ISO8601"})
        held, _ = _hold_until(server.http, lambda held, refused: len(held) == 2 and sum(refused.values()) > 0)
        line = server.until("connections are open")  # the worker that refused says so, once
        found = re.match(ISO_LINE + r"WARNING sluice\.runtime\.http\[worker (\d)\]: HTTP: 1 connections are open",
                         line)
        assert found, line
        refusing = found.group(1)
        pid = server.pids[int(refusing)]
        os.kill(pid, signal.SIGKILL)
        held.pop(refusing).close()
        restarted = server.until("restarted: pid")
        assert re.match(ISO_LINE + r"INFO sluice\.runtime\.workers: protocol worker \d restarted", restarted)
        # The other worker is still refusing (its connection is held): a new line comes from the new worker.
        again, _ = _hold_until(server.http, lambda held, refused: refusing in held and refused[refusing] > 0)
        line = server.until(f"http[worker {refusing}]: HTTP: 1 connections are open")
        assert re.match(ISO_LINE + "WARNING ", line), line
        worker_lines = [seen for seen in server.lines if "[worker " in seen]
        assert len(worker_lines) >= 2 and all(re.match(ISO_LINE, seen) for seen in worker_lines), worker_lines
        for conn in [*held.values(), *again.values()]:
            conn.close()
    finally:
        server.close()


def _engine_arenas(pid: int) -> int:
    """The protocol workers' arena mappings in the engine process."""
    with open(f"/proc/{pid}/maps") as maps:
        return sum("memfd:sluice" in line for line in maps)


def test_sigterm_drains_in_flight_requests_then_stops(cli: tuple[Cli, Path]) -> None:
    server, gate_dir = cli
    answer: list[tuple[int, bytes]] = []
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [4], "data": [1, 2, 3, 4]}]})
    sender = threading.Thread(target=lambda: answer.append(_post(server.http, "/v2/models/held/infer", body.encode())))
    sender.start()
    _wait_for(lambda: (gate_dir / "entered").exists(), "the request running in the model")
    server.proc.send_signal(signal.SIGTERM)
    server.until("stopping on SIGTERM")
    # while the in-flight request drains, a new connection is refused at once (it goes to another pod),
    # not accepted into a backlog nobody reads, to hang and be reset at the end
    host, port = server.http.rsplit(":", 1)

    def refused() -> bool:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
        except ConnectionRefusedError:
            return True
        except ConnectionResetError:
            return False  # it reached a listener in the instant it closed (the kernel resets it): ask again
        return False

    _wait_for(refused, "a new connection refused while the server drains")
    assert not answer  # the in-flight request is still running
    with open(gate_dir / "release", "w") as fifo:  # let the in-flight request finish
        fifo.write("go")
    sender.join(30)
    assert answer and answer[0][0] == 200
    assert json.loads(answer[0][1])["outputs"][0]["data"] == [2.0, 3.0, 4.0, 5.0]
    assert server.proc.wait(30) == 0
    assert not any(_alive(pid) for pid in server.pids)


def test_bad_protocol_workers_value_is_refused(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sluice.runtime", "serve", "--model-repository", str(tmp_path),
         "--protocol-workers", "65"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert (
        "--protocol-workers: must be from 0 (no workers: one process decodes every request) to 64, got 65, or auto"
        in result.stderr
    )


@pytest.mark.parametrize(
    ("cpus", "workers"),
    [(1, 0), (2, 0), (3, 0), (3.99, 0), (4, 2), (4.5, 2), (6, 4), (10, 8), (16, 8), (128, 8)],
)
def test_auto_leaves_a_core_to_the_engine_and_one_to_the_models(cpus: float, workers: int) -> None:
    assert auto_protocol_workers(cpus) == workers


@pytest.mark.parametrize(
    ("cpu_max", "v1", "limit"),
    [
        ("max 100000\n", None, None),  # cgroup v2, no limit
        ("200000 100000\n", None, 2.0),  # resources.limits.cpu: 2
        ("150000 100000", None, 1.5),
        ("0 100000", None, None),
        ("two 100000", None, None),
        (None, ("-1\n", "100000\n"), None),  # cgroup v1, no limit
        (None, ("400000\n", "100000\n"), 4.0),
        (None, ("x", "100000"), None),
        (None, None, None),  # neither file
    ],
)
def test_the_cgroup_cpu_limit_is_read_as_kubernetes_writes_it(cpu_max, v1, limit) -> None:
    assert cgroup_cpu_limit(cpu_max, *(v1 or (None, None))) == limit


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ([], None),
        (["--trace-config", "level=TIMESTAMPS"], "auto: 0 (tracing is on: requests decoded by protocol workers"),
        (["--grpc-server", "grpcio"], "auto: 0 (the grpcio gRPC server runs in one process)"),
    ],
    ids=["cpus", "tracing", "grpcio"],
)
def test_auto_chooses_from_the_usable_cpus_and_says_how(tmp_path: Path, extra: list[str], why: str | None) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    cpus, found = usable_cpus()
    expected = auto_protocol_workers(cpus) if why is None else 0
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice.runtime", "serve", "--model-repository", str(repo), "--http-port", "0",
         "--grpc-port", "0", "--metrics-port", "-1", "--protocol-workers", "auto", "--drain-period-s", "0", *extra],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    watchdog = threading.Timer(60, proc.kill)  # a server that never says it is up ends the read below
    watchdog.start()
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "sluice ready" in line or "sluice serving" in line:
                break
        said = "".join(lines)
        assert (f"--protocol-workers auto: {expected} for {found}" if why is None else f"--protocol-workers {why}") in (
            said
        ), said
        assert ("protocol worker(s) serving" in said) == (expected > 0)
    finally:
        watchdog.cancel()
        proc.terminate()
        proc.wait(30)


def test_inputs_and_outputs_in_system_shared_memory_as_in_single_process(servers) -> None:
    """A tensor in a client's shared-memory region crosses to the engine as its description only (it
    used to be a 500 for BYTES, and a full array of zeros copied through the link for others)."""
    import tritonclient.utils.shared_memory as shm

    workers, single, _ = servers
    words = np.array([b"hello", b"world", b"!"], dtype=np.object_)
    packed = serialize_byte_tensor(words)
    text_size = serialized_byte_size(packed)
    floats = np.random.default_rng(3).random(600_000, dtype=np.float32)
    key = f"/sluice-workers-{os.getpid()}"
    handle = shm.create_shared_memory_region("workers_test", key, text_size + 2 * floats.nbytes)
    try:
        shm.set_shared_memory_region(handle, [packed])
        shm.set_shared_memory_region(handle, [floats], offset=text_size)
        for server in (workers, single):
            for module in (httpclient, grpcclient):
                client = module.InferenceServerClient(server.http if module is httpclient else server.grpc)
                client.register_system_shared_memory("workers_test", key, text_size + 2 * floats.nbytes)
                try:
                    text = module.InferInput("INPUT0", [3], "BYTES")
                    text.set_shared_memory("workers_test", text_size)
                    got = client.infer("identity_bytes", [text]).as_numpy("OUTPUT0")
                    assert [bytes(x) for x in got.ravel()] == list(words)
                    big = module.InferInput("INPUT0", [floats.size], "FP32")
                    big.set_shared_memory("workers_test", floats.nbytes, offset=text_size)
                    out = module.InferRequestedOutput("OUTPUT0")
                    out.set_shared_memory("workers_test", floats.nbytes, offset=text_size + floats.nbytes)
                    client.infer("identity", [big], outputs=[out])
                    written = shm.get_contents_as_numpy(
                        handle, np.float32, [floats.size], offset=text_size + floats.nbytes
                    )
                    np.testing.assert_array_equal(written, floats)
                finally:
                    client.unregister_system_shared_memory("workers_test")
                    client.close()
    finally:
        shm.destroy_shared_memory_region(handle)


def _stream_answers(address: str, model: str, inputs: list[Any], count: int) -> list[Any]:
    import queue

    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(address)
    client.start_stream(callback=lambda result, error: answers.put(error or result))
    try:
        client.async_stream_infer(model, inputs)
        return [answers.get(timeout=20) for _ in range(count)]
    finally:
        client.stop_stream()
        client.close()


def test_model_stream_infer_through_workers_answers_as_in_a_single_process(servers) -> None:
    """ModelStreamInfer goes to the engine message by message: it used to run in the worker itself, on a
    service without a data plane, and hang."""
    workers, single, _ = servers
    a = np.arange(16, dtype=np.float32)
    answers = {
        name: _stream_answers(server.grpc, "add_sub", _add_sub_inputs(grpcclient, a), 1)[0]
        for name, server in (("workers", workers), ("single", single))
    }
    for answer in answers.values():
        assert not isinstance(answer, Exception), answer
        np.testing.assert_array_equal(answer.as_numpy("OUTPUT0"), a + a)


def test_a_worker_whose_engine_is_pid_1_starts(tmp_path: Path) -> None:
    """In a container the engine is PID 1 (the image's entrypoint, the operator's pods): a worker's
    check for a dead engine (re-parented to PID 1) must not take that for one."""
    from sluice.runtime.frontend_workers import orphaned

    assert not orphaned(1, 1)  # the engine is PID 1: its child's parent is 1
    assert orphaned(1, 4242)  # the engine was 4242: re-parented, it died
    assert not orphaned(4242, 4242)
    unshare = shutil.which("unshare")
    # --kill-child: the namespace's PID 1 (the engine) dies with unshare, and the kernel then kills every
    # process of the namespace (the workers), so killing unshare leaves nothing behind
    namespace = [unshare, "--pid", "--fork", "--mount-proc", "--kill-child"] if unshare else []
    if not namespace or subprocess.run([*namespace, "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare cannot make a PID namespace here (needs root or user namespaces, util-linux 2.32+)")
    repo = tmp_path / "repo"
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    proc = subprocess.Popen(
        [*namespace, sys.executable, "-m", "sluice.runtime", "serve",
         "--model-repository", str(repo), "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
         "--protocol-workers", "2", "--drain-period-s", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
    )  # fmt: skip
    try:
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "sluice ready" in line or "error" in line:
                break
        assert any("sluice ready" in line for line in lines), "".join(lines)
        assert any("protocol worker(s) serving" in line for line in lines), "".join(lines)
    finally:
        proc.kill()
        proc.wait(30)
    root = str(tmp_path / "repo")

    def ours(cmdline: list[str]) -> bool:  # the engine names the repository; its workers, engine pid 1
        return root in cmdline or ("sluice.runtime.frontend_workers" in cmdline and "--engine-pid" in cmdline
                                   and cmdline[cmdline.index("--engine-pid") + 1] == "1")

    _wait_for(lambda: not any(ours(_cmdline(pid)) for pid in _pids()), "the namespace's processes gone")
