"""The HTTP/2 gRPC front end reading frames that its reads cut anywhere.

Over a real socket the kernel decides where one read ends, so a test cannot say where a frame is
cut. Here the server's own connection protocol (``GrpcConnection``, made by the running server's
``GrpcServer`` on its event loop) is fed through asyncio's Protocol interface by a transport that
cuts the client's bytes exactly where a test says, holds them while the server has paused reading
(as a real transport does) and hands what the server writes back to the same raw HTTP/2 client the
socket tests use. Everything behind the protocol (the data plane, the models) is the real server.
"""

from __future__ import annotations

import asyncio
import queue
import random
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hyperframe.frame import GoAwayFrame, HeadersFrame, PingFrame, RstStreamFrame
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb

from sluice.runtime.protocol.grpc_h2 import MAX_FRAME_SIZE

from .conftest import ADD_SUB_CONFIG, BUILDERS, start_server, write_model  # type: ignore[import-not-found]
from .test_grpc_h2 import (  # type: ignore[import-not-found]
    IDENTITY_CONFIG,
    IDENTITY_PY,
    INVALID_ARGUMENT,
    NO_SHEDDING,
    OK,
    SERVICE,
    Client,
    add_sub_request,
    assert_add_sub_ok,
    grpc_frame,
    raw_frame,
    vector_request,
)

DATA, HEADERS, PING = 0x0, 0x1, 0x6
END_STREAM, END_HEADERS, PADDED = 0x1, 0x4, 0x8
STREAM_CLOSED = 0x5


class CutTransport(asyncio.Transport):
    """What the server's connection writes to, and where its reads come from: ``feed`` hands it the
    client's bytes already cut into reads, delivered in order while reading is not paused."""

    def __init__(self, loop: asyncio.AbstractEventLoop, protocol: Any) -> None:
        super().__init__()
        self.loop = loop
        self.protocol = protocol
        self.written: queue.Queue[bytes] = queue.Queue()
        self.pending: deque[bytes] = deque()  # reads not delivered yet (on the loop only)
        self.paused = False
        self.closing = False

    def feed(self, reads: list[bytes]) -> None:  # on the loop
        self.pending.extend(reads)
        self._deliver()

    def _deliver(self) -> None:
        while self.pending and not self.paused and not self.closing:
            self.protocol.data_received(self.pending.popleft())

    def write(self, data: Any) -> None:
        self.written.put(bytes(data))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            self.written.put(b"")  # what the client reads as the end of the connection
            self.loop.call_soon(self.protocol.connection_lost, None)

    def abort(self) -> None:
        self.close()

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False
        self.loop.call_soon(self._deliver)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class CutSocket:
    """The raw client's socket: what it sends goes to the server in reads cut by ``cut(data)``."""

    def __init__(self, running: Any, cut: Any) -> None:
        self.loop = running.loop
        self.cut = cut
        self.timeout = 5.0
        self.spare = b""

        async def connect() -> CutTransport:
            protocol = running.server._grpc_h2.make_connection()
            transport = CutTransport(asyncio.get_running_loop(), protocol)
            protocol.connection_made(transport)
            return transport

        self.transport = running.call(connect())

    def sendall(self, data: bytes) -> None:
        reads = self.cut(bytes(data))
        assert b"".join(reads) == data
        self.loop.call_soon_threadsafe(self.transport.feed, reads)

    def settimeout(self, timeout: float) -> None:
        self.timeout = timeout

    def setsockopt(self, *args: Any) -> None:
        pass

    def recv(self, n: int) -> bytes:
        if not self.spare:
            try:
                self.spare = self.transport.written.get(timeout=self.timeout)
            except queue.Empty:
                raise TimeoutError from None
            if not self.spare:
                return b""
        chunk, self.spare = self.spare[:n], self.spare[n:]
        return chunk

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.transport.close)


def cutter(points: list[float]) -> Any:
    """Cuts at the given fractions of each send (0 < f < 1), so a test states where reads end."""

    def cut(data: bytes) -> list[bytes]:
        edges = sorted({int(f * len(data)) for f in points} - {0, len(data)})
        return [data[a:b] for a, b in zip([0, *edges], [*edges, len(data)], strict=True)]

    return cut


def at(*offsets: int) -> Any:
    """Cuts each send at these byte offsets (those inside it)."""

    def cut(data: bytes) -> list[bytes]:
        edges = sorted({o for o in offsets if 0 < o < len(data)})
        return [data[a:b] for a, b in zip([0, *edges], [*edges, len(data)], strict=True)]

    return cut


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Any:
    repo = Path(tmp_path_factory.mktemp("reads")) / "repo"
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    write_model(repo, "identity", IDENTITY_CONFIG, {"model.py": IDENTITY_PY})
    handle = start_server(repo, scheduling=NO_SHEDDING)  # a slow moment here must not shed a call
    yield handle
    handle.stop()


def client_over(running: Any, cut: Any) -> Client:
    client = Client("", {}, sock=CutSocket(running, cut))
    client.read_until(lambda: client.send_window > 1 << 20)  # the server's connection window came
    return client


def headers(client: Client, sid: int, method: str) -> bytes:
    return HeadersFrame(sid, client.block(SERVICE + method), flags=["END_HEADERS"]).serialize()


def vector(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def assert_vector(response: Any, values: np.ndarray) -> None:
    assert response.status == OK, response.message
    (reply,) = response.messages()
    out = pb.ModelInferResponse.FromString(reply)
    np.testing.assert_array_equal(np.frombuffer(out.raw_output_contents[0], np.float32), values)


def large_calls(client: Client, seed: int) -> tuple[bytes, dict[int, Any]]:
    """One send holding: a ~300 KiB ModelInfer in one DATA frame, another in two padded frames, a
    ModelStreamInfer with three messages in one frame, a small call, and a PING; what each should get."""
    big, other = vector(seed, 75_000), vector(seed + 1, 40_000)
    one = grpc_frame(vector_request(big))
    two = grpc_frame(vector_request(other))
    stream_body = b"".join(grpc_frame(add_sub_request(f"s{i}")) for i in range(3))
    half = len(two) // 2
    wire = b"".join(
        [
            headers(client, 1, "ModelInfer"),
            raw_frame(DATA, END_STREAM, 1, one),
            headers(client, 3, "ModelInfer"),
            raw_frame(DATA, PADDED, 3, bytes([200]) + two[:half] + bytes(200)),
            raw_frame(DATA, PADDED | END_STREAM, 3, bytes([0]) + two[half:]),
            headers(client, 5, "ModelStreamInfer"),
            raw_frame(DATA, END_STREAM, 5, stream_body),
            headers(client, 7, "ModelInfer"),
            raw_frame(DATA, END_STREAM, 7, grpc_frame(add_sub_request())),
            PingFrame(0, b"cut-read").serialize(),
        ]
    )
    assert len(one) + 9 < MAX_FRAME_SIZE and len(wire) < client.send_window
    return wire, {1: big, 3: other}


def check_large_calls(client: Client, expected: dict[int, Any]) -> None:
    for sid, values in expected.items():
        assert_vector(client.response(sid, timeout=30), values)
    replies = [pb.ModelStreamInferResponse.FromString(m) for m in client.response(5).messages()]
    assert sorted(r.infer_response.id for r in replies) == ["s0", "s1", "s2"]
    assert [r.error_message for r in replies] == [""] * 3
    assert_add_sub_ok(client.response(7))
    client.read_until(lambda: any(isinstance(f, PingFrame) and f.opaque_data == b"cut-read" for f in client.received))


@settings(max_examples=60, deadline=None)
@given(points=st.lists(st.floats(0.0, 1.0, exclude_min=True, exclude_max=True), max_size=12), seed=st.integers(0, 99))
def test_frames_cut_by_reads_anywhere_are_read_whole(running, points, seed):
    """Large DATA frames (up to SETTINGS_MAX_FRAME_SIZE, taken in pieces as reads bring them), padded
    ones, several messages in one frame and small frames, with reads ending anywhere: inside a frame
    header, a pad length, a message prefix or a payload. Every call gets its own values back."""
    client = client_over(running, cutter(points))
    try:
        wire, expected = large_calls(client, seed)
        client.sock.sendall(wire)
        check_large_calls(client, expected)
    finally:
        client.close()


@pytest.mark.parametrize("offset", range(0, 40))
def test_reads_cut_around_the_header_of_a_large_data_frame(running, offset):
    """Every cut in the first 40 bytes after the HEADERS frame: inside the DATA frame's 9-byte header,
    right after it, inside the gRPC prefix and the message; then the rest in one read."""
    client = client_over(running, lambda data: [data])
    try:
        wire, expected = large_calls(client, offset)
        head = 9 + int.from_bytes(wire[:3], "big")  # the first frame: HEADERS of stream 1
        client.sock.cut = at(head + offset)
        client.sock.sendall(wire)
        check_large_calls(client, expected)
    finally:
        client.close()


def test_a_call_answered_inside_a_cut_frame_drops_the_rest_and_the_connection_goes_on(running):
    """A unary call given a second message in the same large DATA frame is answered (INVALID_ARGUMENT)
    while the rest of that frame is still to come; the rest is dropped. DATA after END_STREAM, cut by
    a read, resets the stream (STREAM_CLOSED) and the rest of its frame is dropped. The calls after
    both are read right."""
    client = client_over(running, lambda data: [data])
    try:
        first = grpc_frame(add_sub_request("first"))
        filler = grpc_frame(vector_request(vector(7, 60_000)))
        payload = first + first + filler
        wire = headers(client, 1, "ModelInfer") + raw_frame(DATA, END_STREAM, 1, payload)
        cut = len(wire) - len(filler) + 1000  # the second message whole, the filler's first 1000 bytes
        client.sock.cut = at(cut)
        client.sock.sendall(wire)
        response = client.response(1)
        assert response.status == INVALID_ARGUMENT and "a second one came" in response.message
        # (answered before the client ended its side: the server resets stream 1 with NO_ERROR)
        # DATA on a stream the client already ended, cut by reads too: RST_STREAM(STREAM_CLOSED)
        late = headers(client, 3, "ModelInfer") + raw_frame(DATA, END_STREAM, 3, grpc_frame(add_sub_request()))
        late += raw_frame(DATA, 0, 3, filler)
        client.sock.cut = at(len(late) - len(filler) // 2)
        client.sock.sendall(late)
        assert client.response(3).reset == STREAM_CLOSED
        resets = [f.error_code for f in client.received if isinstance(f, RstStreamFrame) and f.stream_id == 3]
        assert resets == [STREAM_CLOSED]  # once: the rest of the frame was dropped without another
        values = vector(8, 50_000)
        after = headers(client, 5, "ModelInfer") + raw_frame(DATA, END_STREAM, 5, grpc_frame(vector_request(values)))
        client.sock.cut = cutter([random.Random(5).random() for _ in range(5)])
        client.sock.sendall(after)
        assert_vector(client.response(5), values)
    finally:
        client.close()


def test_a_frame_over_the_max_frame_size_is_a_connection_error(running):
    client = client_over(running, at(5))
    try:
        client.sock.sendall(headers(client, 1, "ModelInfer") + raw_frame(DATA, 0, 1, bytes(MAX_FRAME_SIZE + 1)))
        frames = client.drain(5.0)
        assert client.closed
        goaways = [f for f in frames if isinstance(f, GoAwayFrame)]
        assert len(goaways) == 1 and goaways[0].error_code == 0x6  # FRAME_SIZE_ERROR
    finally:
        client.close()


def test_the_server_advertises_its_max_frame_size(running):
    client = client_over(running, lambda data: [data])
    try:
        assert client.server_settings[0x5] == MAX_FRAME_SIZE
    finally:
        client.close()


def test_a_long_frame_in_many_small_reads_is_read_once_whole(running):
    """A frame other than DATA is handled whole: one of ~1 MiB (an unknown type, ignored) in 1,000-byte
    reads, then a call and a PING, each read kept until the frame is whole (not copied again with
    every read); the call is answered and the PING acked."""
    client = client_over(running, lambda data: [data])
    try:
        size = MAX_FRAME_SIZE - 100
        wire = raw_frame(0xFA, 0, 0, bytes(size)) + headers(client, 1, "ModelInfer")
        wire += raw_frame(DATA, END_STREAM, 1, grpc_frame(add_sub_request()))
        wire += PingFrame(0, b"afterbig").serialize()
        client.sock.cut = at(*range(1_000, len(wire), 1_000))
        client.sock.sendall(wire)
        assert_add_sub_ok(client.response(1))
        client.read_until(lambda: any(getattr(f, "opaque_data", None) == b"afterbig" for f in client.received))
        assert client.goaway is None
    finally:
        client.close()


def test_a_headers_frame_over_the_block_limit_is_refused_before_it_is_decoded(running):
    """Frames may be 1 MiB, header blocks may not: one HEADERS frame (no CONTINUATION) far over the
    header list limit gets GOAWAY(ENHANCE_YOUR_CALM), as a block grown by CONTINUATION frames does."""
    client = client_over(running, lambda data: [data])
    try:
        block = client.block(SERVICE + "ModelInfer", extra=[("x-big", "v" * 200_000)])
        client.sock.sendall(raw_frame(HEADERS, END_HEADERS, 1, block))
        client.drain(5.0)
        assert client.closed and client.goaway is not None
        assert client.goaway.error_code == 0xB and b"header block" in client.goaway.additional_data
    finally:
        client.close()


@pytest.mark.parametrize("split", [1, 4, 8])
def test_a_frame_header_split_by_reads_is_checked_when_it_is_whole(running, split):
    """A header announcing 16 MiB, cut by a read: refused (FRAME_SIZE_ERROR) as soon as the header is
    whole, not after the frame's bytes were collected."""
    client = client_over(running, lambda data: [data])
    try:
        header = (1 << 24) - 1
        head = header.to_bytes(3, "big") + bytes([HEADERS, END_HEADERS]) + (1).to_bytes(4, "big")
        client.sock.sendall(head[:split])
        client.sock.sendall(head[split:] + bytes(1_000))
        client.drain(5.0)
        assert client.closed and client.goaway is not None and client.goaway.error_code == 0x6
        assert f"frame of {header} bytes".encode() in client.goaway.additional_data
    finally:
        client.close()
