"""The HTTP/2 gRPC front end (runtime/protocol/grpc_h2.py) against hostile and broken peers: clients
that never read, rapid resets, header-cache stuffing, streams that are not consumed, oversized answers,
half-open connections. Driven frame by frame with the raw client of test_grpc_h2."""

from __future__ import annotations

import contextlib
import re
import select
import socket
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import grpc
import hpack
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    WindowUpdateFrame,
)
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from sluice.runtime.settings import Limits

from .conftest import ADD_SUB_CONFIG, BUILDERS, write_model  # type: ignore[import-not-found]
from .test_grpc_h2 import (  # type: ignore[import-not-found]
    NO_SHEDDING,
    PREFACE,
    SERVICE,
    Client,
    add_sub_request,
    assert_add_sub_ok,
    grpc_frame,
)

OK, RESOURCE_EXHAUSTED, UNAVAILABLE = 0, 8, 14
INITIAL_WINDOW_SIZE = 0x4
NO_ERROR, STREAM_CLOSED, CANCEL, ENHANCE_YOUR_CALM = 0x0, 0x5, 0x8, 0xB


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "repo"
    write_model(path, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    return path


@pytest.fixture
def connect():
    clients: list[Client] = []

    def factory(address: str, settings: dict[int, int] | None = None, **kw: Any) -> Client:
        client = Client(address, {} if settings is None else settings, **kw)
        clients.append(client)
        return client

    yield factory
    for client in clients:
        client.close()


def push_until_blocked(sock: socket.socket, chunk: bytes, cap: int, stall_s: float = 1.0) -> int:
    """Send ``chunk`` over and over without reading; stop when the peer has taken nothing for
    ``stall_s`` (it stopped reading), closed the connection, or ``cap`` bytes went out. Returns the
    bytes sent."""
    sock.setblocking(False)
    sent = 0
    view = memoryview(chunk * 2)
    while sent < cap:
        _, writable, _ = select.select([], [sock], [], stall_s)
        if not writable:
            break
        offset = sent % len(chunk)  # whole frames only: a partial send is continued, not restarted
        try:
            sent += sock.send(view[offset : offset + len(chunk)])
        except BlockingIOError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            break  # the server closed it (on a loaded machine its idle timeout may fire mid-push)
    sock.setblocking(True)
    return sent


# -- 1. write backpressure ----------------------------------------------------------------------------


def test_ping_flood_from_a_client_that_never_reads_is_bounded(serve, repo, connect):
    """Each PING is answered; a client that never reads its answers must make the server stop reading
    (transport flow control), not buffer acks without bound. Other clients are served meanwhile."""
    server = serve(repo)
    host, port = server.grpc.rsplit(":", 1)
    hog = socket.socket()
    hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    hog.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    hog.connect((host, int(port)))
    pings = PingFrame(0, b"floodflo").serialize() * 4096  # 68 KiB of PINGs a send
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        hog.sendall(PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")  # preface + empty SETTINGS
        cap = 48 << 20
        sent = push_until_blocked(hog, pings, cap)
        grown = tracemalloc.get_traced_memory()[0] - before
        assert sent < cap, "the server kept reading PINGs whose answers were never read"
        # what the kernel buffers hold is outside Python's heap; the server's own share stays small
        assert grown < 8 << 20, f"{grown >> 20} MiB held for a client that does not read"
        other = connect(server.grpc)
        other.request(1, SERVICE + "ModelInfer", add_sub_request())
        assert_add_sub_ok(other.response(1))
    finally:
        tracemalloc.stop()
        hog.close()


# -- 2. rapid reset (CVE-2023-44487) -------------------------------------------------------------------


def test_rapid_reset_gets_goaway_enhance_your_calm(serve, repo, connect):
    server = serve(repo, scheduling=NO_SHEDDING)
    attacker = connect(server.grpc)
    block = attacker.block(SERVICE + "ModelInfer")
    body = grpc_frame(add_sub_request())
    burst = []
    for sid in range(1, 2 * 3000, 2):  # 3000 calls, each reset right after it was sent
        burst += [
            HeadersFrame(sid, block, flags=["END_HEADERS"]),
            DataFrame(sid, body, flags=["END_STREAM"]),
            RstStreamFrame(sid, CANCEL),
        ]
    with contextlib.suppress(OSError):  # the server may close before it has read everything
        attacker.send(*burst)
    attacker.drain(5.0)
    assert attacker.goaway is not None and attacker.goaway.error_code == ENHANCE_YOUR_CALM
    assert b"rapid reset" in attacker.goaway.additional_data
    assert attacker.closed
    good = connect(server.grpc)
    good.request(1, SERVICE + "ModelInfer", add_sub_request())
    assert_add_sub_ok(good.response(1))


def test_calls_reset_as_their_own_deadline_comes_are_not_a_rapid_reset(serve, repo, connect, monkeypatch):
    """grpc clients reset a call when its deadline fires, often just before the server's own grpc-timeout
    answers: thousands of timed-out calls on a stuck model tripped the rapid-reset defence and the GOAWAY
    killed every call on the channel. A reset in the second half of a call's timeout is not counted; one
    in its first half still is."""
    from sluice.runtime.protocol import grpc_h2

    monkeypatch.setattr(grpc_h2, "RESET_LIMIT", 8)
    server = serve(repo, scheduling=NO_SHEDDING)
    client = connect(server.grpc)
    late = client.block(SERVICE + "ModelInfer", [("grpc-timeout", "300m")])
    sids = range(1, 2 * 20, 2)
    client.send(*(HeadersFrame(sid, late, flags=["END_HEADERS"]) for sid in sids))  # requests still coming
    time.sleep(0.2)  # past half of the calls' own 300 ms: the client's deadline comes first (its clock started first)
    client.send(*(RstStreamFrame(sid, CANCEL) for sid in sids))
    client.request(101, SERVICE + "ModelInfer", add_sub_request())
    assert_add_sub_ok(client.response(101))
    assert client.goaway is None and not client.closed

    attacker = connect(server.grpc)
    early = attacker.block(SERVICE + "ModelInfer", [("grpc-timeout", "100S")])
    with contextlib.suppress(OSError):
        attacker.send(*(frame for sid in sids for frame in (HeadersFrame(sid, early, flags=["END_HEADERS"]),
                                                          RstStreamFrame(sid, CANCEL))))
    attacker.drain(5.0)
    assert attacker.goaway is not None and attacker.goaway.error_code == ENHANCE_YOUR_CALM


def test_a_client_that_cancels_some_of_its_calls_is_not_cut_off(serve, repo, connect):
    """1,500 resets in all, more than the limit, but no more resets than answered calls."""
    client = connect(serve(repo, scheduling=NO_SHEDDING).grpc)
    block = client.block(SERVICE + "ModelInfer")
    body = grpc_frame(add_sub_request())
    sid = 1
    for _ in range(15):
        answered = []
        frames = []
        for _ in range(100):
            frames += [HeadersFrame(sid, block, flags=["END_HEADERS"]), DataFrame(sid, body, flags=["END_STREAM"])]
            answered.append(sid)
            frames += [HeadersFrame(sid + 2, block, flags=["END_HEADERS"]), RstStreamFrame(sid + 2, CANCEL)]
            sid += 4
        client.send(*frames)
        for done in answered:
            assert_add_sub_ok(client.response(done))
    assert client.goaway is None and not client.closed


# -- 3. the header-block cache -----------------------------------------------------------------------


def test_header_block_cache_is_bounded_and_holds_no_rejected_blocks(serve, repo, connect):
    """Distinct header blocks that leave the HPACK table alone are cacheable: 300 accepted ones of
    14 KB and 150 rejected ones of 100 KB would pin ~19 MB on one connection without bounds."""
    server = serve(repo)
    client = connect(server.grpc)
    body = grpc_frame(add_sub_request())

    def block(pad: str) -> bytes:
        headers = [(":method", "POST"), (":scheme", "http"), (":path", SERVICE + "ModelInfer"), (":authority", "t")]
        headers += [("content-type", "application/grpc"), hpack.NeverIndexedHeaderTuple("x-pad", pad)]
        return client.encoder.encode(headers, huffman=False)

    def send_block(sid: int, data: bytes) -> None:
        pieces = [data[i : i + 16_384] for i in range(0, len(data), 16_384)]
        frames = [HeadersFrame(sid, pieces[0], flags=[] if len(pieces) > 1 else ["END_HEADERS"])]
        for i, piece in enumerate(pieces[1:], start=2):
            frames.append(ContinuationFrame(sid, piece, flags=["END_HEADERS"] if i == len(pieces) else []))
        client.send(*frames, DataFrame(sid, body, flags=["END_STREAM"]))

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        sid = 1
        for n in range(450):
            accepted = n < 300
            send_block(sid, block(f"{n:06d}" + ("a" * 14_000 if accepted else "r" * 100_000)))
            response = client.response(sid)
            assert response.status == (OK if accepted else RESOURCE_EXHAUSTED), response.message
            client.received.clear()
            sid += 2
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 4 << 20, f"{grown >> 20} MiB held by one connection's header cache"
    client.request(sid, SERVICE + "ModelInfer", add_sub_request())
    assert_add_sub_ok(client.response(sid))


# -- 5. the response-size limit -------------------------------------------------------------------------

REPEAT_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", np.tile(pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy(), 8))]
            )
            for r in requests
        ]
"""

REPEAT_CONFIG = """
name: "repeat"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
"""


@pytest.mark.parametrize("grpc_server", ["h2", "grpcio"])
def test_infer_response_over_the_message_limit_is_resource_exhausted(tmp_path, serve, grpc_server):
    repo = tmp_path / "repo"
    write_model(repo, "repeat", REPEAT_CONFIG, {"model.py": REPEAT_PY})
    limit = 64 * 1024
    server = serve(repo, limits=Limits(max_grpc_message_bytes=limit), grpc_server=grpc_server)
    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        small = grpcclient.InferInput("INPUT0", [16], "FP32")
        small.set_data_from_numpy(np.ones(16, np.float32))
        assert client.infer("repeat", [small]).as_numpy("OUTPUT0").shape == (128,)
        big = grpcclient.InferInput("INPUT0", [4096], "FP32")  # 16 KiB in, 128 KiB out
        big.set_data_from_numpy(np.ones(4096, np.float32))
        with pytest.raises(InferenceServerException) as info:
            client.infer("repeat", [big])
        assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        if grpc_server == "h2":  # grpcio words it its own way
            assert re.search(rf"response is 13\d{{4}} bytes, larger than max \({limit};", info.value.message())
        assert client.infer("repeat", [small]).as_numpy("OUTPUT0").shape == (128,)
    finally:
        client.close()


SIZES_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            for n in pb_utils.get_input_tensor_by_name(request, "SIZES").as_numpy():
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", np.ones(int(n), np.float32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

SIZES_CONFIG = """
name: "sizes"
backend: "python"
max_batch_size: 0
input [ { name: "SIZES", data_type: TYPE_INT32, dims: [ -1 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
model_transaction_policy { decoupled: true }
"""


@pytest.mark.parametrize("grpc_server", ["h2", "grpcio"])
def test_a_stream_response_over_the_message_limit_fails_that_request_and_the_stream_goes_on(
    tmp_path, serve, grpc_server
):
    """On ModelStreamInfer an oversized response is an error for its request alone, carrying its id
    (and, from a decoupled model, the final flag); the stream's other requests and later ones are
    answered (the whole call used to end with RESOURCE_EXHAUSTED, losing every request in flight)."""
    repo = tmp_path / "repo"
    write_model(repo, "repeat", REPEAT_CONFIG, {"model.py": REPEAT_PY})
    write_model(repo, "sizes", SIZES_CONFIG, {"model.py": SIZES_PY})
    limit = 64 * 1024
    server = serve(repo, limits=Limits(max_grpc_message_bytes=limit), grpc_server=grpc_server)
    client = grpcclient.InferenceServerClient(server.grpc)
    answers: list[tuple[Any, Any]] = []
    done = threading.Condition()

    def callback(result: Any, error: Any) -> None:
        with done:
            answers.append((result, error))
            done.notify_all()

    def repeat(n: int) -> list[Any]:
        tensor = grpcclient.InferInput("INPUT0", [n], "FP32")
        tensor.set_data_from_numpy(np.ones(n, np.float32))
        return [tensor]

    def sizes(*values: int) -> list[Any]:
        tensor = grpcclient.InferInput("SIZES", [len(values)], "INT32")
        tensor.set_data_from_numpy(np.array(values, np.int32))
        return [tensor]

    def wait_for(count: int) -> None:
        with done:
            assert done.wait_for(lambda: len(answers) >= count, timeout=30), answers

    client.start_stream(callback)
    try:
        client.async_stream_infer("repeat", repeat(16), request_id="small-1")
        client.async_stream_infer("repeat", repeat(4096), request_id="big")  # 128 KiB out
        client.async_stream_infer("repeat", repeat(16), request_id="small-2")
        wait_for(3)
        by_id = {}
        for result, error in answers:
            if error is None:
                by_id[result.get_response().id] = result.as_numpy("OUTPUT0").shape
            else:
                by_id["error"] = error
        assert by_id["small-1"] == by_id["small-2"] == (128,)
        error = by_id["error"]
        assert re.search(rf"response is 13\d{{4}} bytes, larger than max \({limit}; --max-grpc-message-bytes\)",
                         error.message()), error.message()
        answers.clear()
        # a decoupled request: small, too large (its error keeps the id), small, then its final flag
        client.async_stream_infer("sizes", sizes(8, 40000, 8), request_id="d", enable_empty_final_response=True)
        wait_for(4)
        assert [e is None for _, e in answers] == [True, False, True, True]
        assert "larger than max" in answers[1][1].message()
        final = answers[3][0].get_response()
        assert final.id == "d" and final.parameters["triton_final_response"].bool_param
        client.async_stream_infer("repeat", repeat(16), request_id="after")
        wait_for(5)
        assert answers[4][1] is None and answers[4][0].get_response().id == "after"
    finally:
        client.stop_stream()
        client.close()
    # on the wire the error names its request (tritonclient hands its callback the message alone)
    request = pb.ModelInferRequest(model_name="repeat", id="big",
                                   raw_input_contents=[np.ones(4096, np.float32).tobytes()])
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[4096])
    with grpc.insecure_channel(server.grpc) as channel:
        [reply] = list(service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter([request])))
    assert "larger than max" in reply.error_message
    assert (reply.infer_response.model_name, reply.infer_response.id) == ("repeat", "big")


# -- 6. keepalive ------------------------------------------------------------------------------------------

KEEPALIVE = Limits(keepalive_interval_s=0.2, keepalive_timeout_s=0.5)


def open_stream(client: Client, sid: int = 1) -> None:
    """A ModelStreamInfer call left open: the connection has a stream but nothing to say."""
    client.send(HeadersFrame(sid, client.block(SERVICE + "ModelStreamInfer"), flags=["END_HEADERS"]))


def read_until(client: Client, predicate: Any, limit_s: float = 10.0) -> None:
    """Read frames until ``predicate()`` holds; the limit only keeps a broken server from hanging the test."""
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, "not reached"
        client.read_frame(timeout=0.1)


def test_keepalive_closes_a_connection_whose_peer_does_not_answer_pings(serve, repo, connect):
    server = serve(repo, limits=KEEPALIVE)
    silent = connect(server.grpc)
    open_stream(silent)
    read_until(silent, lambda: silent.closed)
    pings = [f for f in silent.received if isinstance(f, PingFrame) and "ACK" not in f.flags]
    assert pings, "no keepalive PING before the close"
    assert silent.goaway is not None and b"keepalive" in silent.goaway.additional_data
    other = connect(server.grpc)
    other.request(1, SERVICE + "ModelInfer", add_sub_request())
    assert_add_sub_ok(other.response(1))


def test_keepalive_keeps_a_connection_whose_peer_answers(serve, repo, connect):
    server = serve(repo, limits=KEEPALIVE)
    alive = connect(server.grpc)
    idle = connect(server.grpc)  # no stream open: the idle timeout, not keepalive, governs it
    open_stream(alive)
    answered = 0

    def ack_pings() -> bool:
        nonlocal answered
        for f in alive.received[answered:]:
            if isinstance(f, PingFrame) and "ACK" not in f.flags:
                alive.send(PingFrame(0, f.opaque_data, flags=["ACK"]))
        pings = sum(isinstance(f, PingFrame) and "ACK" not in f.flags for f in alive.received)
        answered = len(alive.received)
        return pings >= 3 or alive.closed

    read_until(alive, ack_pings)
    assert not alive.closed and alive.goaway is None
    alive.send_data(1, grpc_frame(add_sub_request("still-here")))
    response = alive.response(1)
    assert response.status == OK
    reply = pb.ModelStreamInferResponse.FromString(response.messages()[0])
    assert reply.infer_response.id == "still-here"
    idle.drain(0.1)
    assert not any(isinstance(f, PingFrame) for f in idle.received) and not idle.closed


# -- 4. receive flow control follows consumption -----------------------------------------------------------

GATED_PY = """
import os
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.gate = os.path.join(os.path.dirname(__file__), "open")

    def execute(self, requests):
        while not os.path.exists(self.gate):  # held until the test opens the gate
            time.sleep(0.01)
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()[:1])])
            for r in requests
        ]
"""  # noqa: E501

GATED_CONFIG = """
name: "gated"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
"""


def test_a_stream_whose_requests_are_not_consumed_closes_its_window(tmp_path, serve, connect):
    """ModelStreamInfer messages are credited back (WINDOW_UPDATE) only as the call takes them, and it
    takes no more than a bounded number while the model is stuck: the client's window closes instead
    of the server queueing everything it is sent. Once the model moves, the window opens again."""
    repo = tmp_path / "repo"
    write_model(repo, "gated", GATED_CONFIG, {"model.py": GATED_PY})
    server = serve(repo, scheduling=NO_SHEDDING)
    client = connect(server.grpc)
    client.send(HeadersFrame(1, client.block(SERVICE + "ModelStreamInfer"), flags=["END_HEADERS"]))
    message = pb.ModelInferRequest(model_name="gated")
    message.inputs.add(name="INPUT0", datatype="FP32", shape=[32 * 1024])
    message.raw_input_contents.append(np.ones(32 * 1024, np.float32).tobytes())
    data = grpc_frame(message.SerializeToString())  # 128 KiB
    client.stream_windows.setdefault(1, client.peer_initial)
    cap = 96 << 20
    sent = 0
    view = memoryview(b"")
    while sent < cap:
        room = min(client.send_window, client.stream_windows[1], 16_384)
        if room <= 0:
            if client.read_frame(timeout=1.0) is None:
                break  # no window came back for a second: the server stopped taking
            continue
        if not view:
            view = memoryview(data)
        chunk, view = view[:room], view[room:]
        client.send(DataFrame(1, bytes(chunk)))
        client.send_window -= len(chunk)
        client.stream_windows[1] -= len(chunk)
        sent += len(chunk)
    assert sent < cap, "the server took everything a stuck stream was sent"
    assert not client.closed and not (1 in client.responses and client.responses[1].ended)
    (repo / "gated" / "1" / "open").touch()
    if view:
        client.send_data(1, bytes(view), end_stream=False)  # the window reopens as the model catches up
    client.send_data(1, data)  # one more message, then the half-close
    response = client.response(1, timeout=60)
    assert response.status == OK, response.message
    replies = [pb.ModelStreamInferResponse.FromString(m) for m in response.messages()]
    assert len(replies) == (sent + len(data) - 1) // len(data) + 1
    assert not any(r.error_message for r in replies)


def test_a_stream_whose_answers_are_not_read_stops_taking_requests(tmp_path, serve, connect):
    """The other direction: a client that keeps sending ModelStreamInfer requests but never opens its
    own window for the answers. The answers wait (one beyond the window), the call stops taking
    requests, and so the client's window closes too. Once it reads, everything completes."""
    repo = tmp_path / "repo"
    write_model(repo, "gated", GATED_CONFIG, {"model.py": GATED_PY})
    (repo / "gated" / "1" / "open").touch()  # the model answers at once
    server = serve(repo, scheduling=NO_SHEDDING)
    client = connect(server.grpc, settings={INITIAL_WINDOW_SIZE: 100}, auto_window=False)
    client.send(HeadersFrame(1, client.block(SERVICE + "ModelStreamInfer"), flags=["END_HEADERS"]))
    message = pb.ModelInferRequest(model_name="gated")
    message.inputs.add(name="INPUT0", datatype="FP32", shape=[32 * 1024])
    message.raw_input_contents.append(np.ones(32 * 1024, np.float32).tobytes())
    data = grpc_frame(message.SerializeToString())  # 128 KiB in, ~60 bytes out
    client.stream_windows.setdefault(1, client.peer_initial)
    cap = 96 << 20
    sent = 0
    view = memoryview(b"")
    while sent < cap:
        room = min(client.send_window, client.stream_windows[1], 16_384)
        if room <= 0:
            if client.read_frame(timeout=1.0) is None:
                break
            continue
        if not view:
            view = memoryview(data)
        chunk, view = view[:room], view[room:]
        client.send(DataFrame(1, bytes(chunk)))
        client.send_window -= len(chunk)
        client.stream_windows[1] -= len(chunk)
        sent += len(chunk)
    assert sent < cap, "the server took requests whose answers were never read"
    client.auto_window = True
    client.send(WindowUpdateFrame(0, 1 << 30), WindowUpdateFrame(1, 1 << 30))
    if view:
        client.send_data(1, bytes(view), end_stream=False)
    client.send_data(1, data)
    response = client.response(1, timeout=60)
    assert response.status == OK, response.message
    assert len(response.messages()) == (sent + len(data) - 1) // len(data) + 1


# -- 7. peers that stop reading, floods that cost the server more than the peer ---------------------


def _connections(server: Any) -> int:
    async def count() -> int:
        return len(server.server._grpc_h2.connections)

    return server.call(count())


def test_a_connection_closed_on_a_peer_that_does_not_read_is_dropped(serve, repo):
    """The server closes an idle connection whose peer stopped reading after flooding PINGs; the
    transport would wait for ever to flush the acks (holding their memory and a connection slot):
    after another idle timeout it is dropped."""
    server = serve(repo, limits=Limits(idle_timeout_s=0.5))
    host, port = server.grpc.rsplit(":", 1)
    hog = socket.socket()
    hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    hog.connect((host, int(port)))
    try:
        hog.sendall(PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        push_until_blocked(hog, PingFrame(0, b"floodflo").serialize() * 4096, 48 << 20)
        assert _connections(server) <= 1
        deadline = time.monotonic() + 15  # idle timeout, close, then the second timeout (sweeps at 0.5 s)
        while _connections(server):
            assert time.monotonic() < deadline, "a closed connection whose peer does not read was kept"
            time.sleep(0.1)
    finally:
        hog.close()


def test_calls_refused_from_their_headers_alone_do_not_pile_up_for_a_peer_that_does_not_read(serve, repo):
    """A 3.9 KB method path sent once, then named by its HPACK index in 14-byte HEADERS frames: each call
    is answered UNIMPLEMENTED from its headers alone. Written out as they are made, so the server stops
    reading when its peer does; the echoed path is cut to 200 characters."""
    server = serve(repo)
    host, port = server.grpc.rsplit(":", 1)
    hog = socket.socket()
    hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    hog.connect((host, int(port)))
    encoder = hpack.Encoder()
    path = "/" + "p" * 3900  # with the other headers, within the 4 KiB HPACK table
    headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "t")]
    headers.append(("content-type", "application/grpc"))
    frames = [HeadersFrame(sid, encoder.encode(headers), flags=["END_HEADERS", "END_STREAM"]) for sid in (1, 3)]
    assert len(frames[1].data) < 10  # indexed: a few bytes of input for each answer
    frames += [HeadersFrame(sid, frames[1].data, flags=["END_HEADERS", "END_STREAM"]) for sid in range(5, 80_000, 2)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        hog.sendall(PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        hog.setblocking(False)
        data = memoryview(b"".join(f.serialize() for f in frames))
        sent = 0
        while sent < len(data):
            _, writable, _ = select.select([], [hog], [], 1.0)
            if not writable:
                break  # the server stopped reading
            with contextlib.suppress(BlockingIOError):
                sent += hog.send(data[sent : sent + 65_536])
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak >> 20} MiB of answers held at once for a peer that does not read"
    hog.setblocking(True)
    hog.settimeout(5)
    first = b""
    while len(first) < 8192:
        first += hog.recv(65_536)
    hog.close()
    assert b"Method not found: /ppp" in first and b"p" * 250 not in first and b"(3901 bytes)" in first


def test_an_initial_window_repeated_in_one_settings_frame_takes_the_last(serve, repo, connect):
    client = connect(serve(repo).grpc, settings={INITIAL_WINDOW_SIZE: 1 << 20}, auto_window=False)
    client.request(1, SERVICE + "ModelInfer", add_sub_request())
    assert_add_sub_ok(client.response(1))
    # 20,000 entries (one SETTINGS frame of 120 KB), the last one 10 bytes
    entries = b"".join(INITIAL_WINDOW_SIZE.to_bytes(2, "big") + (n % 7).to_bytes(4, "big") for n in range(19_999))
    entries += INITIAL_WINDOW_SIZE.to_bytes(2, "big") + (10).to_bytes(4, "big")
    client.sock.sendall(len(entries).to_bytes(3, "big") + b"\x04\x00" + b"\x00\x00\x00\x00" + entries)
    client.request(3, SERVICE + "ModelInfer", add_sub_request())
    client.read_until(lambda: 3 in client.responses and len(client.responses[3].data) >= 10)
    client.drain(0.2)
    assert len(client.responses[3].data) == 10 and not client.responses[3].ended


def test_a_header_block_in_endless_empty_continuation_frames_gets_goaway(serve, repo, connect):
    client = connect(serve(repo).grpc)
    block = client.block(SERVICE + "ModelInfer")
    frames = [HeadersFrame(1, block[:3])] + [ContinuationFrame(1, b"") for _ in range(5000)]
    with contextlib.suppress(OSError):
        client.send(*frames)
    client.drain(5.0)
    assert client.goaway is not None and client.goaway.error_code == ENHANCE_YOUR_CALM
    assert b"CONTINUATION" in client.goaway.additional_data


def test_a_header_block_left_unfinished_gets_goaway_after_the_header_timeout(serve, repo, connect):
    client = connect(serve(repo, limits=Limits(header_timeout_s=0.5)).grpc)
    block = client.block(SERVICE + "ModelInfer")
    client.send(HeadersFrame(1, block[:3]), ContinuationFrame(1, block[3:5]))
    client.drain(15.0)  # ends when the server closes: the sweeper runs every 0.5 s
    assert client.goaway is not None and client.goaway.error_code == ENHANCE_YOUR_CALM
    assert b"--header-timeout-s" in client.goaway.additional_data


def test_headers_on_a_stream_that_is_closed_or_was_skipped_get_stream_closed(serve, repo, connect):
    """A client opening stream 5 implicitly closes 3 (RFC 9113 §5.1.1); a call on 3 or again on 5 would
    otherwise wait for ever: each gets RST_STREAM STREAM_CLOSED, and the connection serves on."""
    client = connect(serve(repo).grpc)
    client.request(5, SERVICE + "ModelInfer", add_sub_request())
    assert_add_sub_ok(client.response(5))
    for sid in (3, 5):
        client.request(sid, SERVICE + "ModelInfer", add_sub_request())
        client.read_until(
            lambda sid=sid: any(isinstance(f, RstStreamFrame) and f.stream_id == sid for f in client.received)
        )
        reset = next(f for f in client.received if isinstance(f, RstStreamFrame) and f.stream_id == sid)
        assert reset.error_code == STREAM_CLOSED
    client.request(7, SERVICE + "ModelInfer", add_sub_request())
    assert_add_sub_ok(client.response(7))
    assert client.goaway is None


def test_streams_stuck_behind_a_busy_model_leave_the_connection_open_for_other_calls(tmp_path, serve, connect):
    """Nine ModelStreamInfer calls to a model that does not move, each sent as much as its own window
    allows (72 MiB in all): their untaken bytes are credited back to the connection window up to a
    bound, so a unary call on the same connection (a gRPC channel shares it) still gets through; they
    used to close the 64 MiB connection window for every call on it."""
    repo = tmp_path / "repo"
    write_model(repo, "gated", GATED_CONFIG, {"model.py": GATED_PY})
    server = serve(repo, scheduling=NO_SHEDDING)
    client = connect(server.grpc)
    message = pb.ModelInferRequest(model_name="gated")
    message.inputs.add(name="INPUT0", datatype="FP32", shape=[32 * 1024])
    message.raw_input_contents.append(np.ones(32 * 1024, np.float32).tobytes())
    data = grpc_frame(message.SerializeToString())  # 128 KiB
    streams = list(range(1, 19, 2))
    for sid in streams:
        client.send(HeadersFrame(sid, client.block(SERVICE + "ModelStreamInfer"), flags=["END_HEADERS"]))
        client.stream_windows[sid] = client.peer_initial
    sent = dict.fromkeys(streams, 0)
    while True:
        moved = False
        for sid in streams:
            room = min(client.send_window, client.stream_windows[sid], 16_384)
            if room > 0:
                offset = sent[sid] % len(data)
                chunk = data[offset : offset + room]
                client.send(DataFrame(sid, chunk))
                client.send_window -= len(chunk)
                client.stream_windows[sid] -= len(chunk)
                sent[sid] += len(chunk)
                moved = True
        if not moved and client.read_frame(timeout=1.0) is None:
            break  # no window came back for a second: every stream is full
    assert all(client.stream_windows[sid] <= 0 for sid in streams), "a stream was held back by the connection"
    assert sum(sent.values()) > 64 << 20
    client.request(101, SERVICE + "ServerLive", pb.ServerLiveRequest().SerializeToString())
    response = client.response(101)
    assert response.status == OK and pb.ServerLiveResponse.FromString(response.messages()[0]).live
    (repo / "gated" / "1" / "open").touch()  # let the model go: the stuck calls drain


def test_a_call_over_the_connection_limit_is_answered_unavailable_naming_it(serve, repo, connect, caplog):
    """--max-connections over gRPC: the first call on a connection beyond it is answered UNAVAILABLE naming
    the flag, then GOAWAY covering that call and close (a GOAWAY before any call made grpcio retry the call
    on new connections without end); a connection that sends no call is closed after --header-timeout-s.
    Once a connection closes a new one is served."""
    server = serve(repo, limits=Limits(max_connections=2, header_timeout_s=0.5))
    held = [connect(server.grpc, {}) for _ in range(2)]
    for client in held:
        client.request(1, SERVICE + "ModelInfer", add_sub_request())
        assert_add_sub_ok(client.response(1))
    message = "too many open connections, at most 2 (--max-connections)"
    extra = connect(server.grpc, {})
    extra.request(1, SERVICE + "ServerLive", pb.ServerLiveRequest().SerializeToString())
    answer = extra.response(1)
    assert (answer.status, answer.message, answer.data) == (UNAVAILABLE, message, b"")
    extra.drain(5.0)
    assert extra.closed and extra.goaway is not None
    assert (extra.goaway.error_code, extra.goaway.last_stream_id) == (ENHANCE_YOUR_CALM, 1)
    assert extra.goaway.additional_data == message.encode()
    silent = connect(server.grpc, {})  # a connection that never calls
    started = time.monotonic()
    silent.drain(10.0)
    assert silent.closed and silent.goaway is not None and silent.goaway.error_code == ENHANCE_YOUR_CALM
    assert 0.4 < time.monotonic() - started < 5
    with grpcclient.InferenceServerClient(server.grpc) as client, pytest.raises(
        InferenceServerException, match=re.escape(message)
    ):
        client.is_server_live(client_timeout=10)
    refusing = [r for r in caplog.records if "the most --max-connections allows" in r.getMessage()]
    assert [(r.levelname, r.getMessage().split(",")[0]) for r in refusing] == [
        ("WARNING", "gRPC: 2 connections are open")
    ]
    held.pop().close()
    deadline = time.monotonic() + 10
    while True:  # the server notices the close asynchronously
        with grpcclient.InferenceServerClient(server.grpc) as client:
            try:
                assert client.is_server_live(client_timeout=10)
                break
            except InferenceServerException:
                assert time.monotonic() < deadline, "no room again after a connection closed"
                time.sleep(0.05)
    assert any("gRPC: accepting connections again" in r.getMessage() for r in caplog.records)


def test_the_idle_timeout_counts_from_the_end_of_the_last_call(tmp_path, serve, connect):
    """A call that runs for most of --idle-timeout-s sends nothing while it runs: the connection was
    closed a fraction of a second after the answer (idleness counted from the request's last bytes),
    not an idle timeout after it, as the flag says. The sweeper looks every 0.5 s: closed after 1.8 s
    of idleness at the earliest now, at most 0.7 s after the answer before."""
    from .conftest import GATED_CONFIG, gate, gated_py  # type: ignore[import-not-found]

    repo = tmp_path / "repo"
    write_model(repo, "gated", GATED_CONFIG, {"model.py": gated_py("sluice_test_idle_gate")})
    with gate("sluice_test_idle_gate") as held:
        server = serve(repo, limits=Limits(idle_timeout_s=2.3))
        client = connect(server.grpc, auto_window=False)  # it sends nothing more once the call is sent
        request = pb.ModelInferRequest(model_name="gated", raw_input_contents=[np.ones(4, np.float32).tobytes()])
        request.inputs.add(name="INPUT0", datatype="FP32", shape=[4])
        client.request(1, SERVICE + "ModelInfer", request.SerializeToString())
        assert held.entered.wait(30)  # type: ignore[attr-defined]
        time.sleep(2.1)  # the call runs for most of the idle timeout, the client silent meanwhile
        held.release.set()  # type: ignore[attr-defined]
        assert client.response(1).status == OK
        frames = client.drain(1.2)
        assert not any(isinstance(f, GoAwayFrame) for f in frames) and not client.closed
        frames = client.drain(5.0)  # and then it is closed as idle
        assert any(isinstance(f, GoAwayFrame) for f in frames)
