"""A frame fuzzer for the HTTP/2 gRPC front end (runtime/protocol/grpc_h2.py), built on hypothesis
with the ``h2`` test dependency's hpack/hyperframe as the peer.

No recognised HTTP/2 conformance suite installs from the registries this project uses (h2spec is not
packaged for Debian, PyPI or npm), so this checks what such a suite checks, against RFC 9113: random
sequences of valid frames (calls, SETTINGS, PING, WINDOW_UPDATE, PRIORITY, RST_STREAM, unknown
types) mixed with invalid ones. The server must never crash; the first connection error in a
sequence must be answered with GOAWAY carrying that error's code (RFC 9113 §5.4.1, §6) and a close;
a sequence without one must leave the connection working: every call answered, a final PING acked.
Other connections are served throughout.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hyperframe.frame import GoAwayFrame, PingFrame
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb

from sluice.runtime.protocol.grpc_h2 import MAX_FRAME_SIZE

from .conftest import ADD_SUB_CONFIG, BUILDERS, start_server, write_model  # type: ignore[import-not-found]
from .test_grpc_h2 import SERVICE, Client, add_sub_request, assert_add_sub_ok, grpc_frame, raw_frame  # type: ignore[import-not-found]

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, COMPRESSION_ERROR = 0x1, 0x3, 0x6, 0x9
OK = 0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    repo = Path(tmp_path_factory.mktemp("fuzz")) / "repo"
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    running = start_server(repo)
    yield running
    running.stop()


def u32(value: int) -> bytes:
    return struct.pack(">L", value)


def setting(ident: int, value: int) -> bytes:
    return struct.pack(">HL", ident, value)


# Each action is (kind, argument); the state (next stream id, open streams) is applied when sending.
VALID = st.one_of(
    st.tuples(st.just("call"), st.sampled_from(["ModelInfer", "ServerLive"])),
    st.tuples(st.just("open"), st.none()),
    st.tuples(st.just("reset"), st.integers(0, 0xF)),
    st.tuples(st.just("ping"), st.binary(min_size=8, max_size=8)),
    st.tuples(
        st.just("settings"),
        st.lists(
            st.one_of(
                st.tuples(st.just(0x1), st.integers(0, 1 << 16)),  # HEADER_TABLE_SIZE
                st.tuples(st.just(0x2), st.integers(0, 1)),  # ENABLE_PUSH
                st.tuples(st.just(0x3), st.integers(0, 1 << 31)),  # MAX_CONCURRENT_STREAMS
                st.tuples(st.just(0x4), st.integers(65_535, 1 << 20)),  # INITIAL_WINDOW_SIZE
                st.tuples(st.just(0x5), st.integers(16_384, (1 << 24) - 1)),  # MAX_FRAME_SIZE
                st.tuples(st.just(0x6), st.integers(0, 1 << 20)),  # MAX_HEADER_LIST_SIZE
                st.tuples(st.integers(0x7, 0xFFFF), st.integers(0, (1 << 32) - 1)),  # unknown: ignored
            ),
            max_size=4,
        ),
    ),
    st.tuples(st.just("window"), st.integers(1, 1 << 20)),
    st.tuples(st.just("priority"), st.integers(1, 1 << 20)),
    st.tuples(st.just("unknown"), st.tuples(st.integers(0xA, 0xFF), st.binary(max_size=64))),
)

# (name, frame bytes given the last stream id, expected GOAWAY code)
INVALID = st.sampled_from(
    [
        ("data-on-stream-0", lambda last: raw_frame(DATA, 0, 0, b"x"), PROTOCOL_ERROR),
        ("headers-on-stream-0", lambda last: raw_frame(HEADERS, END_HEADERS, 0, b"\x82"), PROTOCOL_ERROR),
        ("even-stream", lambda last: raw_frame(HEADERS, END_HEADERS, last + 3, b"\x83"), PROTOCOL_ERROR),
        ("ping-short", lambda last: raw_frame(PING, 0, 0, b"1234567"), FRAME_SIZE_ERROR),
        ("ping-on-stream", lambda last: raw_frame(PING, 0, 1, b"12345678"), PROTOCOL_ERROR),
        ("settings-on-stream", lambda last: raw_frame(SETTINGS, 0, 1, b""), PROTOCOL_ERROR),
        ("settings-length", lambda last: raw_frame(SETTINGS, 0, 0, b"\x00\x04\x00"), FRAME_SIZE_ERROR),
        ("settings-ack-payload", lambda last: raw_frame(SETTINGS, ACK, 0, setting(0x4, 1)), FRAME_SIZE_ERROR),
        ("enable-push-2", lambda last: raw_frame(SETTINGS, 0, 0, setting(0x2, 2)), PROTOCOL_ERROR),
        ("window-too-big", lambda last: raw_frame(SETTINGS, 0, 0, setting(0x4, 1 << 31)), FLOW_CONTROL_ERROR),
        ("frame-size-small", lambda last: raw_frame(SETTINGS, 0, 0, setting(0x5, 16_383)), PROTOCOL_ERROR),
        ("frame-size-big", lambda last: raw_frame(SETTINGS, 0, 0, setting(0x5, 1 << 24)), PROTOCOL_ERROR),
        ("window-update-0", lambda last: raw_frame(WINDOW_UPDATE, 0, 0, u32(0)), PROTOCOL_ERROR),
        ("window-update-length", lambda last: raw_frame(WINDOW_UPDATE, 0, 0, b"\x00\x01"), FRAME_SIZE_ERROR),
        ("conn-window-overflow", lambda last: raw_frame(WINDOW_UPDATE, 0, 0, u32((1 << 31) - 1)), FLOW_CONTROL_ERROR),
        ("rst-on-stream-0", lambda last: raw_frame(RST_STREAM, 0, 0, u32(8)), PROTOCOL_ERROR),
        ("rst-on-idle", lambda last: raw_frame(RST_STREAM, 0, last + 2, u32(8)), PROTOCOL_ERROR),
        ("rst-length", lambda last: raw_frame(RST_STREAM, 0, max(last, 1), b"\x00"), FRAME_SIZE_ERROR),
        ("push-promise", lambda last: raw_frame(PUSH_PROMISE, END_HEADERS, 1, u32(2) + b"\x82"), PROTOCOL_ERROR),
        ("lone-continuation", lambda last: raw_frame(CONTINUATION, END_HEADERS, 1, b"\x82"), PROTOCOL_ERROR),
        (
            "interrupted-headers",
            lambda last: raw_frame(HEADERS, 0, last + 2, b"\x83") + raw_frame(PING, 0, 0, b"12345678"),
            PROTOCOL_ERROR,
        ),
        ("oversized-frame", lambda last: raw_frame(0xFA, 0, 0, bytes(MAX_FRAME_SIZE + 1)), FRAME_SIZE_ERROR),
        ("bad-hpack-index", lambda last: raw_frame(HEADERS, END_HEADERS, last + 2, b"\xff\xff\x7f"), COMPRESSION_ERROR),
        ("data-on-idle", lambda last: raw_frame(DATA, 0, last + 2, b"x"), PROTOCOL_ERROR),
        ("goaway-on-stream", lambda last: raw_frame(GOAWAY, 0, 1, u32(0) + u32(0)), PROTOCOL_ERROR),
        ("priority-on-stream-0", lambda last: raw_frame(PRIORITY, 0, 0, bytes(5)), PROTOCOL_ERROR),
    ]
)

SEQUENCES = st.lists(st.one_of(VALID, VALID, VALID, st.tuples(st.just("invalid"), INVALID)), min_size=1, max_size=25)


def play(client: Client, actions: list[tuple[str, Any]]) -> tuple[int | None, list[int]]:
    """Send the actions; returns the expected GOAWAY code (None: no connection error) and the calls."""
    sid = -1  # last stream id used
    open_streams: list[int] = []
    calls: list[int] = []
    expected: int | None = None
    out = bytearray()
    for kind, arg in actions:
        if kind == "call":
            sid += 2
            message = add_sub_request() if arg == "ModelInfer" else pb.ServerLiveRequest().SerializeToString()
            out += raw_frame(HEADERS, END_HEADERS, sid, client.block(SERVICE + arg))
            out += raw_frame(DATA, END_STREAM, sid, grpc_frame(message))
            if expected is None:
                calls.append(sid)
        elif kind == "open":
            sid += 2
            out += raw_frame(HEADERS, END_HEADERS, sid, client.block(SERVICE + "ModelStreamInfer"))
            open_streams.append(sid)
        elif kind == "reset" and open_streams:
            out += raw_frame(RST_STREAM, 0, open_streams.pop(), u32(arg))
        elif kind == "ping":
            out += raw_frame(PING, 0, 0, arg)
        elif kind == "settings":
            out += raw_frame(SETTINGS, 0, 0, b"".join(setting(i, v) for i, v in arg))
        elif kind == "window":
            out += raw_frame(WINDOW_UPDATE, 0, max(sid, 0), u32(arg))
        elif kind == "priority":
            out += raw_frame(PRIORITY, 0, max(sid, 1), struct.pack(">LB", arg & 0x7FFFFFFF, 15))
        elif kind == "unknown":
            out += raw_frame(arg[0], 0, max(sid, 0), arg[1])
        elif kind == "invalid":
            _, build, code = arg
            out += build(max(sid, 1))
            if expected is None:
                expected = code
    out += PingFrame(0, b"fuzzsync").serialize()
    try:
        client.sock.sendall(bytes(out))
    except OSError:
        assert expected is not None, "the server closed a connection that did nothing wrong"
    return expected, calls


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=SEQUENCES)
def test_random_frame_sequences(server, actions):
    client = Client(server.grpc, {})
    try:
        client.encoder.header_table_size = 0  # literal blocks only: a dropped block must not desync the table
        expected, calls = play(client, actions)
        if expected is not None:
            while not client.closed:
                assert client.read_frame(timeout=5.0) is not None or client.closed, "no close after an error"
            goaways = [f for f in client.received if isinstance(f, GoAwayFrame)]
            assert len(goaways) == 1, goaways
            assert goaways[0].error_code == expected, (goaways[0].error_code, goaways[0].additional_data)
        else:
            while not any(isinstance(f, PingFrame) and f.opaque_data == b"fuzzsync" for f in client.received):
                assert client.read_frame(timeout=5.0) is not None, "no PING ACK: connection stuck or closed"
            for sid in calls:
                response = client.response(sid)
                assert response.status == OK, (sid, response.message)
            assert client.goaway is None
    finally:
        client.close()
    other = Client(server.grpc, {})
    try:
        other.request(1, SERVICE + "ModelInfer", add_sub_request())
        assert_add_sub_ok(other.response(1))
    finally:
        other.close()


@settings(max_examples=100, deadline=None)
@given(noise=st.binary(min_size=1, max_size=2048))
def test_random_bytes_after_the_preface(server, noise):
    """Arbitrary bytes as frames, then zeros (which complete any frame the noise began and then read as
    DATA on stream 0, a connection error): the server must answer with a GOAWAY whose code RFC 9113
    defines and close, never crash or hang; other connections are served."""
    client = Client(server.grpc, {})
    try:
        with contextlib.suppress(OSError):
            client.sock.sendall(noise + bytes(MAX_FRAME_SIZE + 18))
        while not client.closed:
            assert client.read_frame(timeout=5.0) is not None or client.closed, "no close after garbage"
        goaways = [f for f in client.received if isinstance(f, GoAwayFrame)]
        # none only if the noise itself held a GOAWAY from the client
        assert len(goaways) <= 1 and all(0x0 <= g.error_code <= 0xD for g in goaways), goaways
    finally:
        client.close()
    other = Client(server.grpc, {})
    try:
        other.request(1, SERVICE + "ServerLive", b"")
        assert other.response(1).status == OK
    finally:
        other.close()
