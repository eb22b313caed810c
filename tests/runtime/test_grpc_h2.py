"""The HTTP/2 gRPC front end (runtime/protocol/grpc_h2.py) frame by frame, over a raw socket.

A small client written here sends exactly the frames a test needs (hyperframe serialises them, hpack
codes the headers: both come with the ``h2`` test dependency) and reads back every frame the server
sends, so flow control, cancellation, deadlines, limits and connection errors are seen on the wire.
The last tests run tritonclient against both front ends ("h2" and "grpcio").
"""

from __future__ import annotations

import gzip
import itertools
import random
import re
import socket
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import hpack
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb

from sluice.runtime.settings import Limits, SchedulingDefaults

from .conftest import ADD_SUB_CONFIG, BUILDERS, write_model  # type: ignore[import-not-found]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SERVICE = "/inference.GRPCInferenceService/"
OK, CANCELLED, INVALID_ARGUMENT, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, UNIMPLEMENTED = 0, 1, 3, 4, 8, 12
NO_ERROR, PROTOCOL_ERROR, FRAME_SIZE_ERROR, CANCEL = 0x0, 0x1, 0x6, 0x8
INITIAL_WINDOW_SIZE, MAX_CONCURRENT_STREAMS, MAX_HEADER_LIST_SIZE = 0x4, 0x3, 0x6

SLOW_PY = """
import os
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.log = __file__ + ".log"
        self.gate = __file__ + ".release"  # each call waits for the test to create it

    def execute(self, requests):
        with open(self.log, "a") as f:
            for r in requests:
                f.write(r.request_id() + "\\n")
        give_up = time.monotonic() + 60
        while not os.path.exists(self.gate) and time.monotonic() < give_up:
            time.sleep(0.005)
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
            for r in requests
        ]
"""  # noqa: E501

SLOW_CONFIG = """
name: "slow"
backend: "python"
max_batch_size: 1
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
dynamic_batching { }
"""

IDENTITY_PY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
            for r in requests
        ]
"""  # noqa: E501

IDENTITY_CONFIG = """
name: "identity"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
"""

NO_SHEDDING = SchedulingDefaults(overload_control=False)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "repo"
    write_model(path, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    write_model(path, "slow", SLOW_CONFIG, {"model.py": SLOW_PY})
    write_model(path, "identity", IDENTITY_CONFIG, {"model.py": IDENTITY_PY})
    return path


def release(repo: Path) -> None:
    """Let the slow model's calls (this one and every later one) finish."""
    (repo / "slow" / "1" / "model.py.release").touch()


def executed(repo: Path) -> list[str]:
    log = repo / "slow" / "1" / "model.py.log"
    return log.read_text().split() if log.exists() else []


def wait_until(predicate: Any, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(0.005)


def queue_depth(server: Any, model: str) -> float:
    text = urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=5).read().decode()
    match = re.search(rf'^sluice_queue_depth\{{model="{model}",version="1"\}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


# -- messages ---------------------------------------------------------------------------------------


def raw_frame(ftype: int, flags: int, sid: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([ftype, flags]) + sid.to_bytes(4, "big") + payload


def grpc_frame(message: bytes, compressed: bool = False) -> bytes:
    return bytes([compressed]) + len(message).to_bytes(4, "big") + message


def add_sub_request(rid: str = "") -> bytes:
    message = pb.ModelInferRequest(model_name="add_sub", id=rid)
    for name in ("INPUT0", "INPUT1"):
        message.inputs.add(name=name, datatype="FP32", shape=[16])
        message.raw_input_contents.append(np.arange(16, dtype=np.float32).tobytes())
    return message.SerializeToString()


def one_value_request(model: str, rid: str, value: float = 1.0) -> bytes:
    message = pb.ModelInferRequest(model_name=model, id=rid)
    message.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 1])
    message.raw_input_contents.append(np.array([value], np.float32).tobytes())
    return message.SerializeToString()


def vector_request(values: np.ndarray) -> bytes:
    message = pb.ModelInferRequest(model_name="identity")
    message.inputs.add(name="INPUT0", datatype="FP32", shape=[len(values)])
    message.raw_input_contents.append(values.astype(np.float32).tobytes())
    return message.SerializeToString()


# -- a raw HTTP/2 client ---------------------------------------------------------------------------


class Response:
    def __init__(self) -> None:
        self.headers: list[tuple[str, str]] | None = None
        self.trailers: list[tuple[str, str]] | None = None
        self.data = b""
        self.reset: int | None = None
        self.ended = False

    def header(self, name: str) -> str | None:
        for block in (self.trailers or [], self.headers or []):
            for key, value in block:
                if key == name:
                    return value
        return None

    @property
    def status(self) -> int | None:
        value = self.header("grpc-status")
        return None if value is None else int(value)

    @property
    def message(self) -> str:
        return unquote(self.header("grpc-message") or "")

    def messages(self) -> list[bytes]:
        out, data = [], self.data
        while data:
            assert data[0] == 0
            n = int.from_bytes(data[1:5], "big")
            out.append(data[5 : 5 + n])
            data = data[5 + n :]
        return out


class Client:
    """Speaks just enough HTTP/2 to drive the server frame by frame; records what comes back."""

    def __init__(
        self, address: str, settings: dict[int, int] | None = None, auto_window: bool = True, sock: Any = None
    ) -> None:
        if sock is None:
            host, port = address.rsplit(":", 1)
            sock = socket.create_connection((host, int(port)), timeout=5)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock  # a socket, or what stands in for one (test_grpc_h2_reads.py)
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.buf = bytearray()
        self.auto_window = auto_window
        self.received: list[Frame] = []
        self.responses: dict[int, Response] = {}
        self.server_settings: dict[int, int] = {}
        self.send_window = 65_535
        self.stream_windows: dict[int, int] = {}
        self.peer_initial = 65_535
        self.goaway: GoAwayFrame | None = None
        self.closed = False
        self._block: tuple[int, bytes, bool] | None = None
        if settings is not None:
            self.start(settings)

    def start(self, settings: dict[int, int]) -> None:
        self.sock.sendall(PREFACE + SettingsFrame(0, settings).serialize())
        while not self.server_settings:
            assert self.read_frame() is not None, "connection closed before the server's SETTINGS"

    def close(self) -> None:
        self.sock.close()

    def send(self, *frames: Frame) -> None:
        self.sock.sendall(b"".join(f.serialize() for f in frames))

    def block(self, path: str, extra: list[tuple[str, str]] = (), content_type: str = "application/grpc") -> bytes:
        headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "localhost")]
        headers += [("te", "trailers"), ("content-type", content_type), *extra]
        return self.encoder.encode(headers)

    def request(self, sid: int, path: str, message: bytes | None, extra: list[tuple[str, str]] = (), **kw: Any) -> None:
        self.send(HeadersFrame(sid, self.block(path, extra, **kw), flags=["END_HEADERS"]))
        if message is not None:
            self.send_data(sid, grpc_frame(message))

    def send_data(self, sid: int, data: bytes, end_stream: bool = True, frame_size: int = 16_384) -> None:
        """DATA within the server's windows, waiting for its WINDOW_UPDATEs as a real client does."""
        self.stream_windows.setdefault(sid, self.peer_initial)
        view = memoryview(data)
        while True:
            room = min(self.send_window, self.stream_windows[sid], frame_size)
            if view and room <= 0:
                assert self.read_frame() is not None, "connection closed while waiting for window"
                continue
            chunk, view = view[:room], view[room:]
            last = not view
            self.send(DataFrame(sid, bytes(chunk), flags=["END_STREAM"] if last and end_stream else []))
            self.send_window -= len(chunk)
            self.stream_windows[sid] -= len(chunk)
            if last:
                return

    def read_frame(self, timeout: float = 5.0) -> Frame | None:
        self.sock.settimeout(timeout)
        try:
            while len(self.buf) < 9 or len(self.buf) < 9 + int.from_bytes(self.buf[:3], "big"):
                chunk = self.sock.recv(1 << 16)
                if not chunk:
                    self.closed = True
                    return None
                self.buf += chunk
        except TimeoutError:
            return None
        except ConnectionResetError:
            self.closed = True
            return None
        frame, length = Frame.parse_frame_header(memoryview(bytes(self.buf[:9])))
        frame.parse_body(memoryview(bytes(self.buf[9 : 9 + length])))
        del self.buf[: 9 + length]
        self.received.append(frame)
        self._track(frame)
        return frame

    def _track(self, frame: Frame) -> None:
        if isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
            self.server_settings.update(frame.settings)
            if INITIAL_WINDOW_SIZE in frame.settings:
                delta = frame.settings[INITIAL_WINDOW_SIZE] - self.peer_initial
                self.peer_initial = frame.settings[INITIAL_WINDOW_SIZE]
                for sid in self.stream_windows:
                    self.stream_windows[sid] += delta
            self.send(SettingsFrame(0, flags=["ACK"]))
        elif isinstance(frame, WindowUpdateFrame):
            if frame.stream_id == 0:
                self.send_window += frame.window_increment
            else:
                self.stream_windows[frame.stream_id] = self.stream_windows.get(frame.stream_id, 0) + (
                    frame.window_increment
                )
        elif isinstance(frame, GoAwayFrame):
            self.goaway = frame
        elif isinstance(frame, HeadersFrame | ContinuationFrame):
            if isinstance(frame, HeadersFrame):
                self._block = (frame.stream_id, frame.data, "END_STREAM" in frame.flags)
            else:
                assert self._block is not None and self._block[0] == frame.stream_id
                self._block = (frame.stream_id, self._block[1] + frame.data, self._block[2])
            if "END_HEADERS" in frame.flags:
                sid, data, end = self._block
                self._block = None
                headers = [(k, v) for k, v in self.decoder.decode(data)]
                response = self.responses.setdefault(sid, Response())
                if response.headers is None:
                    response.headers = headers
                else:
                    response.trailers = headers
                response.ended = response.ended or end
        elif isinstance(frame, DataFrame):
            response = self.responses.setdefault(frame.stream_id, Response())
            response.data += frame.data
            response.ended = response.ended or "END_STREAM" in frame.flags
            if self.auto_window and frame.flow_controlled_length:
                self.send(
                    WindowUpdateFrame(0, frame.flow_controlled_length),
                    WindowUpdateFrame(frame.stream_id, frame.flow_controlled_length),
                )
        elif isinstance(frame, RstStreamFrame):
            self.responses.setdefault(frame.stream_id, Response()).reset = frame.error_code

    def response(self, sid: int, timeout: float = 10.0) -> Response:
        deadline = time.monotonic() + timeout
        while True:
            response = self.responses.get(sid)
            if response is not None and (response.ended or response.reset is not None):
                return response
            assert time.monotonic() < deadline, f"no complete response on stream {sid}"
            assert self.read_frame(timeout=max(0.01, deadline - time.monotonic())) is not None or not self.closed, (
                f"connection closed before stream {sid} ended"
            )

    def read_until(self, predicate: Any, limit_s: float = 10.0) -> None:
        """Read frames until ``predicate()`` holds; the limit only keeps a broken server from hanging
        the test (a wait for something to arrive, whatever the machine's speed)."""
        deadline = time.monotonic() + limit_s
        while not predicate():
            assert time.monotonic() < deadline, f"not reached in {limit_s} s"
            self.read_frame(timeout=0.1)

    def drain(self, seconds: float) -> list[Frame]:
        """Every frame that arrives within ``seconds``."""
        frames = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            frame = self.read_frame(timeout=max(0.01, deadline - time.monotonic()))
            if frame is not None:
                frames.append(frame)
            elif self.closed:
                break
        return frames


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


def assert_add_sub_ok(response: Response) -> None:
    assert response.status == OK, response.message
    (message,) = response.messages()
    reply = pb.ModelInferResponse.FromString(message)
    values = np.arange(16, dtype=np.float32)
    np.testing.assert_array_equal(np.frombuffer(reply.raw_output_contents[0], np.float32), values + values)


# -- connection --------------------------------------------------------------------------------------


def test_preface_and_settings_exchange(serve, repo, connect):
    server = serve(repo)
    client = connect(server.grpc, settings={INITIAL_WINDOW_SIZE: 1 << 20})
    client.read_until(
        lambda: any(isinstance(f, SettingsFrame) and "ACK" in f.flags for f in client.received)
        and any(isinstance(f, WindowUpdateFrame) and f.stream_id == 0 for f in client.received)
    )
    settings = client.server_settings
    assert settings[INITIAL_WINDOW_SIZE] > 65_535
    assert settings[MAX_CONCURRENT_STREAMS] >= 100
    assert settings[MAX_HEADER_LIST_SIZE] == Limits().max_header_bytes
    received = client.received
    assert isinstance(received[0], SettingsFrame) and "ACK" not in received[0].flags  # the server's preface
    assert any(isinstance(f, SettingsFrame) and "ACK" in f.flags for f in received)  # ours acknowledged
    updates = [f for f in received if isinstance(f, WindowUpdateFrame) and f.stream_id == 0]
    assert updates and client.send_window > 1 << 20  # a large connection window up front
    client.request(1, SERVICE + "ModelInfer", add_sub_request())
    assert_add_sub_ok(client.response(1))


def test_ping_is_acknowledged_with_its_payload(serve, repo, connect):
    client = connect(serve(repo).grpc)
    client.send(PingFrame(0, b"sluice!!"))
    client.read_until(lambda: any(isinstance(f, PingFrame) for f in client.received))
    client.drain(0.2)  # and no second one
    acks = [f for f in client.received if isinstance(f, PingFrame)]
    assert len(acks) == 1 and "ACK" in acks[0].flags and acks[0].opaque_data == b"sluice!!"


def test_large_request_over_many_data_frames_and_continuation_headers(serve, repo, connect):
    """12 MB each way: more than the server's stream window (it must replenish it), more than the
    client's 64 KiB default windows (the server must wait for WINDOW_UPDATE), in 16 KiB frames,
    with the headers split over HEADERS + CONTINUATION frames, padding, priority and an unknown frame."""
    client = connect(serve(repo, scheduling=NO_SHEDDING).grpc)
    values = np.random.default_rng(0).standard_normal(3 << 20).astype(np.float32)
    message = grpc_frame(vector_request(values))
    assert len(message) > client.server_settings[INITIAL_WINDOW_SIZE]
    block = client.block(SERVICE + "ModelInfer", extra=[("x-padding", "p" * 300)])
    pieces = [block[i : i + 50] for i in range(0, len(block), 50)]
    assert len(pieces) >= 4
    client.sock.sendall(raw_frame(0xFA, 0, 0, b"an unknown frame type is ignored"))
    client.send(
        HeadersFrame(1, pieces[0], flags=["PADDED", "PRIORITY"], pad_length=7, depends_on=0, stream_weight=16),
        *[ContinuationFrame(1, p) for p in pieces[1:-1]],
        ContinuationFrame(1, pieces[-1], flags=["END_HEADERS"]),
        DataFrame(1, message[:1000], flags=["PADDED"], pad_length=20),
    )
    client.stream_windows[1] = client.peer_initial - 1021
    client.send_window -= 1021
    client.send_data(1, message[1000:])
    response = client.response(1, timeout=60)
    assert response.status == OK, response.message
    (reply,) = response.messages()
    out = pb.ModelInferResponse.FromString(reply)
    np.testing.assert_array_equal(np.frombuffer(out.raw_output_contents[0], np.float32), values)
    data_frames = [f for f in client.received if isinstance(f, DataFrame) and f.stream_id == 1]
    assert len(data_frames) > 700 and max(len(f.data) for f in data_frames) <= 16_384


def test_tiny_client_window_holds_the_response_until_window_update(serve, repo, connect):
    client = connect(serve(repo).grpc, settings={INITIAL_WINDOW_SIZE: 10}, auto_window=False)
    client.request(1, SERVICE + "ModelInfer", add_sub_request())
    client.read_until(lambda: 1 in client.responses and len(client.responses[1].data) >= 10)
    client.drain(0.2)  # and nothing beyond the window follows
    response = client.responses[1]
    assert response.headers is not None and (":status", "200") in response.headers
    assert len(response.data) == 10 and not response.ended  # the rest waits for window
    client.send(WindowUpdateFrame(1, 100), WindowUpdateFrame(0, 100))
    client.read_until(lambda: len(response.data) >= 110)
    client.drain(0.2)
    assert len(response.data) == 110 and not response.ended  # 100 more bytes of window, 100 more bytes
    client.send(WindowUpdateFrame(1, 1 << 20), WindowUpdateFrame(0, 1 << 20))
    assert_add_sub_ok(client.response(1))


def test_client_setting_a_smaller_window_later_is_respected(serve, repo, connect):
    client = connect(serve(repo).grpc, settings={INITIAL_WINDOW_SIZE: 1 << 20}, auto_window=False)
    client.send(SettingsFrame(0, {INITIAL_WINDOW_SIZE: 0}))
    client.request(1, SERVICE + "ModelInfer", add_sub_request())
    client.read_until(lambda: 1 in client.responses and client.responses[1].headers is not None)
    client.drain(0.2)  # and no DATA follows while the window is 0
    assert client.responses[1].data == b"" and not client.responses[1].ended
    client.send(SettingsFrame(0, {INITIAL_WINDOW_SIZE: 1 << 20}))
    assert_add_sub_ok(client.response(1))


# -- cancellation and deadlines ---------------------------------------------------------------------


def test_rst_stream_cancels_a_queued_request(serve, repo, connect):
    server = serve(repo, scheduling=NO_SHEDDING)
    client = connect(server.grpc)
    client.request(1, SERVICE + "ModelInfer", one_value_request("slow", "blocker"))
    wait_until(lambda: executed(repo) == ["blocker"], what="blocker running")
    client.request(3, SERVICE + "ModelInfer", one_value_request("slow", "cancelled"))
    wait_until(lambda: queue_depth(server, "slow") == 1, what="second request queued")
    client.send(RstStreamFrame(3, CANCEL))
    # (had the blocker finished first and the request run, `executed` below would name it)
    wait_until(lambda: queue_depth(server, "slow") == 0, what="queue emptied by RST_STREAM")
    assert 1 not in client.responses
    release(repo)
    assert client.response(1).status == OK
    time.sleep(0.1)
    assert executed(repo) == ["blocker"]
    assert 3 not in client.responses  # nothing is sent on a stream the client reset


def test_grpc_timeout_cancels_and_answers_deadline_exceeded(serve, repo, connect):
    server = serve(repo, scheduling=NO_SHEDDING)
    client = connect(server.grpc)
    client.request(1, SERVICE + "ModelInfer", one_value_request("slow", "blocker"))
    wait_until(lambda: executed(repo) == ["blocker"], what="blocker running")
    client.request(3, SERVICE + "ModelInfer", one_value_request("slow", "late"), extra=[("grpc-timeout", "150m")])
    late = client.response(3)
    assert late.status == DEADLINE_EXCEEDED
    assert 1 not in client.responses  # answered at its deadline, while the blocker still ran
    release(repo)
    assert client.response(1).status == OK
    time.sleep(0.1)
    assert executed(repo) == ["blocker"]
    assert queue_depth(server, "slow") == 0


# -- limits and client mistakes --------------------------------------------------------------------


def test_oversize_message_is_resource_exhausted_before_it_is_read(serve, repo, connect):
    server = serve(repo, limits=Limits(max_grpc_message_bytes=64 * 1024))
    client = connect(server.grpc)
    client.send(HeadersFrame(1, client.block(SERVICE + "ModelInfer"), flags=["END_HEADERS"]))
    client.send_data(1, (1 << 20).to_bytes(5, "big") + bytes(1000), end_stream=False)  # claims 1 MiB
    response = client.response(1)
    assert response.status == RESOURCE_EXHAUSTED
    assert "larger than max" in response.message and str(64 * 1024) in response.message
    client.read_until(lambda: client.responses[1].reset is not None)
    assert client.responses[1].reset == NO_ERROR  # asks the client to stop sending the rest
    client.send_data(1, bytes(1000))  # late DATA on the finished stream is ignored
    client.request(3, SERVICE + "ModelInfer", add_sub_request())
    assert_add_sub_ok(client.response(3))


def test_unknown_method_is_unimplemented(serve, repo, connect):
    client = connect(serve(repo).grpc)
    client.request(1, SERVICE + "Explain", b"")
    client.request(3, "/other.Service/Call", b"")
    for sid in (1, 3):
        response = client.response(sid)
        assert response.status == UNIMPLEMENTED
        assert response.trailers is None  # trailers-only
    assert "Explain" in client.responses[1].message


def test_wrong_content_type_is_http_415(serve, repo, connect):
    client = connect(serve(repo).grpc)
    client.request(1, SERVICE + "ModelInfer", add_sub_request(), content_type="application/json")
    response = client.response(1)
    assert response.headers is not None and (":status", "415") in response.headers
    assert b"application/grpc" in response.data


def test_input_after_an_answer_waiting_for_window_is_ignored(serve, repo, connect):
    client = connect(serve(repo).grpc, settings={INITIAL_WINDOW_SIZE: 0}, auto_window=False)
    client.send(HeadersFrame(1, client.block(SERVICE + "ModelInfer", content_type="text/plain"), flags=["END_HEADERS"]))
    client.send(DataFrame(1, grpc_frame(add_sub_request())), DataFrame(1, b"", flags=["END_STREAM"]))
    client.read_until(lambda: 1 in client.responses and client.responses[1].headers is not None)
    client.drain(0.2)  # and nothing more while the window is 0
    assert (":status", "415") in client.responses[1].headers and not client.responses[1].ended
    client.send(SettingsFrame(0, {INITIAL_WINDOW_SIZE: 1 << 16}))
    assert b"application/grpc" in client.response(1).data
    client.request(3, SERVICE + "ModelInfer", add_sub_request())
    assert_add_sub_ok(client.response(3))


def test_unparsable_protobuf_is_invalid_argument(serve, repo, connect):
    client = connect(serve(repo).grpc)
    client.request(1, SERVICE + "ModelInfer", b"\xff\xff\xff")
    response = client.response(1)
    assert response.status == INVALID_ARGUMENT and "not a valid protobuf" in response.message


def test_header_list_over_the_limit_is_resource_exhausted(serve, repo, connect):
    server = serve(repo, limits=Limits(max_header_bytes=2048))
    client = connect(server.grpc)
    assert client.server_settings[MAX_HEADER_LIST_SIZE] == 2048
    client.request(1, SERVICE + "ModelInfer", add_sub_request(), extra=[("x-big", "b" * 3000)])
    response = client.response(1)
    assert response.status == RESOURCE_EXHAUSTED and "--max-header-bytes" in response.message
    client.request(3, SERVICE + "ModelInfer", add_sub_request())
    assert_add_sub_ok(client.response(3))


def test_gzip_compressed_request(serve, repo, connect):
    client = connect(serve(repo).grpc)
    for sid, encoding, payload in [(1, "gzip", gzip.compress(add_sub_request())), (3, "snappy", b"whatever")]:
        block = client.block(SERVICE + "ModelInfer", extra=[("grpc-encoding", encoding)])
        client.send(HeadersFrame(sid, block, flags=["END_HEADERS"]))
        client.send_data(sid, grpc_frame(payload, compressed=True))
    assert_add_sub_ok(client.response(1))
    response = client.response(3)
    assert response.status == UNIMPLEMENTED and "snappy" in response.message


def test_a_compressed_message_with_bytes_after_its_stream_is_refused(serve, repo, connect):
    """Two gzip members (or one and junk) in one message: grpcio refuses them; the first member alone
    was taken (the request read with the first's id and version, the rest dropped)."""
    client = connect(serve(repo).grpc)
    for sid, tail in [(1, gzip.compress(b"\x00")), (3, b"junk after it")]:
        block = client.block(SERVICE + "ModelInfer", extra=[("grpc-encoding", "gzip")])
        client.send(HeadersFrame(sid, block, flags=["END_HEADERS"]))
        client.send_data(sid, grpc_frame(gzip.compress(add_sub_request()) + tail, compressed=True))
        response = client.response(sid)
        assert response.status == INVALID_ARGUMENT and "after the end of its compressed data" in response.message
    client.request(5, SERVICE + "ModelInfer", add_sub_request())
    assert_add_sub_ok(client.response(5))


@pytest.mark.parametrize(
    ("garbage", "code"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", PROTOCOL_ERROR),
        (PREFACE + SettingsFrame(0, {}).serialize() + b"\x10\x00\x01\x00\x00\x00\x00\x00\x01", None),  # 1 MiB + 1
        (PREFACE + PingFrame(0, b"12345678").serialize(), PROTOCOL_ERROR),  # SETTINGS must come first
        (PREFACE + SettingsFrame(0, {}).serialize() + DataFrame(1, b"x").serialize(), PROTOCOL_ERROR),  # idle stream
    ],
    ids=["http1", "oversized-frame", "no-settings", "data-on-idle-stream"],
)
def test_garbage_gets_goaway_and_close_and_the_server_serves_others(serve, repo, connect, garbage, code):
    server = serve(repo)
    bad = Client(server.grpc)
    try:
        bad.sock.sendall(garbage)
        frames = bad.drain(10.0)  # ends when the server closes
        assert bad.closed
        goaways = [f for f in frames if isinstance(f, GoAwayFrame)]
        assert len(goaways) == 1
        assert goaways[0].error_code == (FRAME_SIZE_ERROR if code is None else code)
    finally:
        bad.close()
    good = connect(server.grpc)
    good.request(1, SERVICE + "ModelInfer", add_sub_request())
    assert_add_sub_ok(good.response(1))


def test_many_concurrent_streams_on_one_connection(serve, repo, connect):
    client = connect(serve(repo, scheduling=NO_SHEDDING).grpc)
    sids = list(range(1, 400, 2))
    for sid in sids:
        client.request(sid, SERVICE + "ModelInfer", add_sub_request(str(sid)))
    for sid in sids:
        response = client.response(sid)
        assert_add_sub_ok(response)
        assert pb.ModelInferResponse.FromString(response.messages()[0]).id == str(sid)


def test_stop_sends_goaway_and_finishes_the_call_in_flight(serve, repo, connect):
    server = serve(repo, scheduling=NO_SHEDDING)
    client = connect(server.grpc)
    client.request(1, SERVICE + "ModelInfer", one_value_request("slow", "in-flight", 3.0))
    wait_until(lambda: executed(repo) == ["in-flight"], what="call running")
    stopper = threading.Thread(target=server.stop, kwargs={"grace_s": 10.0})
    stopper.start()
    try:
        client.read_until(lambda: client.goaway is not None)  # sent while the call still runs
        release(repo)
        response = client.response(1)
        assert response.status == OK
        reply = pb.ModelInferResponse.FromString(response.messages()[0])
        assert np.frombuffer(reply.raw_output_contents[0], np.float32).tolist() == [3.0]
        assert client.goaway is not None and client.goaway.error_code == NO_ERROR
        assert client.goaway.last_stream_id == 1
        client.drain(10.0)  # ends when the server closes
        assert client.closed
    finally:
        stopper.join(30)


# -- both front ends through tritonclient ----------------------------------------------------------


@pytest.mark.parametrize("grpc_server", ["h2", "grpcio"])
def test_tritonclient_smoke_on_both_front_ends(serve, repo, grpc_server):
    server = serve(repo, grpc_server=grpc_server)
    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("add_sub")
        a = np.arange(16, dtype=np.float32)
        inputs = [grpcclient.InferInput("INPUT0", [16], "FP32"), grpcclient.InferInput("INPUT1", [16], "FP32")]
        for tensor in inputs:
            tensor.set_data_from_numpy(a)
        result = client.infer("add_sub", inputs, request_id="smoke")
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)
        assert result.get_response().id == "smoke"
        stats = client.get_inference_statistics("add_sub", as_json=True)
        assert int(stats["model_stats"][0]["inference_stats"]["success"]["count"]) == 1
    finally:
        client.close()


def test_stream_infer_answers_each_message_then_ok_trailers_after_half_close(serve, repo, connect):
    server = serve(repo, limits=Limits(max_grpc_message_bytes=64 * 1024))
    client = connect(server.grpc)
    client.send(HeadersFrame(1, client.block(SERVICE + "ModelStreamInfer"), flags=["END_HEADERS"]))
    client.send_data(1, grpc_frame(add_sub_request("a")) + grpc_frame(b"\xff\xff"), end_stream=False)
    client.read_until(lambda: 1 in client.responses and len(client.responses[1].messages()) >= 2)
    response = client.responses[1]
    assert not response.ended and len(response.messages()) == 2  # answered before the client half-closes
    client.send_data(1, grpc_frame(add_sub_request("b")))
    response = client.response(1)
    assert response.status == OK
    replies = [pb.ModelStreamInferResponse.FromString(m) for m in response.messages()]
    assert sorted(r.infer_response.id for r in replies if not r.error_message) == ["a", "b"]
    assert ["not a valid protobuf" in r.error_message for r in replies].count(True) == 1
    assert not any(isinstance(f, RstStreamFrame) for f in client.received)
    # A message over the limit ends the stream with RESOURCE_EXHAUSTED; the connection goes on.
    client.send(HeadersFrame(3, client.block(SERVICE + "ModelStreamInfer"), flags=["END_HEADERS"]))
    client.send_data(3, (1 << 20).to_bytes(5, "big"), end_stream=False)
    assert client.response(3).status == RESOURCE_EXHAUSTED
    client.request(5, SERVICE + "ModelInfer", add_sub_request())
    assert_add_sub_ok(client.response(5))


def test_messages_cut_into_data_frames_anywhere_are_read_whole(serve, repo, connect):
    """gRPC messages arrive in DATA frames cut wherever the client cuts them: inside the 5-byte
    prefix, several messages in one frame, one message over many frames. 40 seeded cuttings of one to
    three ModelStreamInfer messages, each answered with its own id and right sums."""
    server = serve(repo)
    client = connect(server.grpc)
    rng = random.Random(20261127)
    for case in range(40):
        sid = 1 + 2 * case
        ids = [f"c{case}m{m}" for m in range(rng.randint(1, 3))]
        body = b"".join(grpc_frame(add_sub_request(rid)) for rid in ids)
        cuts = sorted(rng.sample(range(1, len(body)), rng.randint(0, min(12, len(body) - 1))))
        client.send(HeadersFrame(sid, client.block(SERVICE + "ModelStreamInfer"), flags=["END_HEADERS"]))
        edges = [0, *cuts, len(body)]
        for begin, end in itertools.pairwise(edges):
            client.send_data(sid, body[begin:end], end_stream=end == len(body))
        response = client.response(sid)
        assert response.status == OK, (cuts, response.message)
        replies = [pb.ModelStreamInferResponse.FromString(m) for m in response.messages()]
        assert [r.error_message for r in replies] == [""] * len(ids), cuts
        assert sorted(r.infer_response.id for r in replies) == sorted(ids), cuts
        for reply in replies:
            sums = np.frombuffer(reply.infer_response.raw_output_contents[0], np.float32)
            np.testing.assert_array_equal(sums, 2 * np.arange(16, dtype=np.float32))


def test_pieces_of_many_reads_keep_only_their_own_bytes_alive():
    """One byte of a message in each of many 256 KiB reads (a client padding its reads with other
    frames) must not keep every read alive: what is held stays within twice the message's bytes plus
    KEPT_SLACK and one read, and the bytes come out in order."""
    from sluice.runtime.protocol.grpc_h2 import KEPT_SLACK, _Pieces

    pieces = _Pieces()
    expected = bytearray()
    for i in range(400):
        read = bytes([i % 251]) + bytes(256 * 1024 - 1)
        pieces.add(memoryview(read)[:1])
        expected += read[:1]
        held = sum(len(view.obj) for view in {id(v.obj): v for v in pieces.parts}.values())
        assert held <= 2 * pieces.size + KEPT_SLACK + 256 * 1024, (i, held)
    assert pieces.size == 400
    assert pieces.take(5) + pieces.take(395) == bytes(expected)
    assert pieces.size == 0 and not pieces.parts


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=6),
    cuts=st.lists(st.integers(1, 4000), max_size=30),
    read=st.integers(1, 5000),
    seed=st.integers(0, 2**16),
)
def test_pieces_give_back_the_bytes_in_order_whatever_the_cuts(sizes, cuts, read, seed):
    """Views of reads of any size, cut into pieces anywhere, then taken out in messages of any size:
    the same bytes in the same order, and size/started/received say what is held."""
    from sluice.runtime.protocol.grpc_h2 import _Pieces

    rng = np.random.default_rng(seed)
    stream = rng.integers(0, 256, sum(sizes), dtype=np.uint8).tobytes()
    pieces, offset, edges = _Pieces(), 0, sorted({c % (len(stream) + 1) for c in cuts} | {len(stream)})
    for edge in edges:  # each piece a view of a read that holds it and other bytes around it
        carrier = bytes(read) + stream[offset:edge] + bytes(read)
        pieces.add(memoryview(carrier)[read : read + edge - offset])
        offset = edge
    assert pieces.size == len(stream)
    taken, at = [], 0
    for n in sizes:
        pieces.need = n  # a body: its prefix was read
        assert pieces.started
        taken.append(pieces.take(n))
        pieces.need = -1
        at += n
        assert pieces.size == len(stream) - at and pieces.received == pieces.size
    assert taken == [stream[sum(sizes[:i]) : sum(sizes[: i + 1])] for i in range(len(sizes))]
    assert not pieces.started and not pieces.parts


@pytest.mark.parametrize("sent", [3, 5, 40])
def test_a_request_that_ends_inside_a_message_says_how_much_came(serve, repo, connect, sent):
    """Cut inside the prefix (3 bytes), right after it (5) or inside the body (40), over two frames."""
    server = serve(repo)
    client = connect(server.grpc)
    body = grpc_frame(add_sub_request())[:sent]
    client.send(HeadersFrame(1, client.block(SERVICE + "ModelInfer"), flags=["END_HEADERS"]))
    client.send_data(1, body[:2], end_stream=False)
    client.send_data(1, body[2:])
    response = client.response(1)
    assert response.status == INVALID_ARGUMENT
    assert response.message == f"request ended inside a gRPC message ({sent} bytes of it came)"
    client.request(3, SERVICE + "ModelInfer", add_sub_request())
    assert_add_sub_ok(client.response(3))


def test_idle_connection_gets_goaway_and_is_closed(serve, repo, connect):
    server = serve(repo, limits=Limits(idle_timeout_s=0.5))
    idle = connect(server.grpc)
    busy = connect(server.grpc)
    busy.request(1, SERVICE + "ModelInfer", add_sub_request())
    assert_add_sub_ok(busy.response(1))
    frames = idle.drain(15.0)  # the sweeper runs every 0.5 s; ends when the server closes
    assert any(isinstance(f, GoAwayFrame) for f in frames)
    assert idle.closed
