"""gRPC front end on a minimal HTTP/2 server of our own: an asyncio protocol, ``hpack`` for header coding.

Serves Triton's ``inference.GRPCInferenceService`` over cleartext HTTP/2 (RFC 9113) as described in
gRPC's PROTOCOL-HTTP2.md. ``runtime/server.py`` starts ``GrpcServer`` when ``ServerSettings.grpc_server``
is ``"h2"`` (the default); ``grpc.py`` keeps the ``grpc.aio`` front end as the fallback. Both serve the
method table of ``grpc_service``.

Why not grpc.aio: it hands each call to the event loop through several layers and a task, ~730 us of
CPU per call, and the batcher saw batches of ~1.5. Here ``ModelInfer`` goes from bytes to
``DataPlane.infer_nowait`` and back through callbacks: no task per call, a header block decoded once per
distinct bytes (gRPC clients repeat them exactly), response header blocks encoded once, and the frames of
every response finished in one loop iteration written to the socket at once.

HTTP/2 done here: connection preface, SETTINGS both ways (theirs acknowledged and applied), PING
answers, flow control both ways (a large window advertised and credited back as DATA is consumed: a
unary call's message as it arrives, a ModelStreamInfer message when the call takes it; the peer's
windows respected, response DATA held per stream until WINDOW_UPDATE), HEADERS + CONTINUATION, PADDED
and PRIORITY flags, RST_STREAM (cancels the request), GOAWAY (sent with the last stream taken on
shutdown and on connection errors, which carry RFC 9113's error codes), frame-size and header-list-size
limits, unknown frame types ignored.

Defences (docs/runtime.md): a peer that does not read pauses our reading (asyncio write flow control),
so replies to its frames cannot pile up; client resets beyond the calls answered are a rapid-reset
attack (GOAWAY ENHANCE_YOUR_CALM); the header-block cache is bounded in entries and bytes and holds no
rejected block; responses over ``--max-grpc-message-bytes`` are RESOURCE_EXHAUSTED; keepalive PINGs on
connections with calls open close half-open ones; idle connections are closed.

Not done: TLS/ALPN (cleartext with prior knowledge only, which is what gRPC's insecure channels speak),
the HTTP/1.1 Upgrade to h2c, server push, stream priorities (parsed, ignored), response compression
(gzip/deflate requests are accepted), SETTINGS-ack timeouts, the two-step graceful GOAWAY. Frames on
streams that are already closed are ignored rather than treated as errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc
import hpack

from sluice.runtime import callers
from sluice.runtime.dataplane import DataPlane
from sluice.runtime.errors import InvalidArgument, PayloadTooLarge, SluiceError
from sluice.runtime.protocol import grpc_service
from sluice.runtime.protocol.grpc_service import Call, Method, Service
from sluice.runtime.protocol.grpc_status import clipped, grpc_code
from sluice.runtime.protocol.listener import Crowding, Listener
from sluice.runtime.settings import Limits
from sluice.runtime.types import InferRequest, InferResponse

log = logging.getLogger("sluice.runtime.grpc_h2")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types (RFC 9113 §6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
# Flags.
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
# Error codes (RFC 9113 §7).
NO_ERROR = 0x0
PROTOCOL_ERROR = 0x1
INTERNAL_ERROR = 0x2
FLOW_CONTROL_ERROR = 0x3
STREAM_CLOSED = 0x5
FRAME_SIZE_ERROR = 0x6
REFUSED_STREAM = 0x7
CANCEL = 0x8
COMPRESSION_ERROR = 0x9
ENHANCE_YOUR_CALM = 0xB
# Settings identifiers.
SETTINGS_HEADER_TABLE_SIZE = 0x1
SETTINGS_ENABLE_PUSH = 0x2
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
SETTINGS_MAX_FRAME_SIZE = 0x5
SETTINGS_MAX_HEADER_LIST_SIZE = 0x6

MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65_535
DEFAULT_MAX_FRAME = 16_384
"""The protocol's initial SETTINGS_MAX_FRAME_SIZE: the least a peer may set, and what we send in
until a client says it takes more."""
MAX_FRAME_SIZE = 1 << 20
"""The largest frame we accept (our SETTINGS_MAX_FRAME_SIZE). Clients that honour it (grpcio does)
send a large message in a few large DATA frames instead of one per 16 KiB, each handled in Python;
a DATA frame cut by the end of a read is taken in pieces as the reads bring it (:class:`_CutData`),
so a large frame is never buffered whole."""
STREAM_WINDOW = 8 << 20
"""Our SETTINGS_INITIAL_WINDOW_SIZE: what a client may send on one stream before we replenish it."""
CONNECTION_WINDOW = 64 << 20
"""Receive window of the whole connection, advertised at start and replenished as it is consumed."""
EARLY_CREDIT = CONNECTION_WINDOW // 2
"""ModelStreamInfer bytes not yet taken by their call that are credited back to the connection window
at once, so that calls stuck behind a busy model do not close it for every other call on the
connection (their own stream windows still hold them back); past this, they count against it."""
CREDIT_BATCH = CONNECTION_WINDOW // 8
"""Consumed bytes are given back to the connection window in WINDOW_UPDATEs of at least this much."""
KEPT_SLACK = 1 << 20
"""Bytes of the reads a stream's partial message may keep alive beyond twice its own size."""
MAX_CONCURRENT_STREAMS = 1024
"""Open streams per connection; more are refused with RST_STREAM(REFUSED_STREAM)."""
MAX_GRPC_MESSAGE_IN_ERRORS = 4096
"""Longest grpc-message we send, so error trailers stay within clients' metadata limits."""
CONTROL_REPLIES_PER_WRITE = 256
"""Frames collected from one read before they are written (and flow control can pause reading)."""
KEEPALIVE_PING = b"sluiceka"
"""Payload of our keepalive PINGs, to tell their ACKs from those of other PINGs."""
RESET_LIMIT = 1024
"""Client resets of open streams a connection may have beyond the streams it let us finish; one
more is a rapid-reset attack (CVE-2023-44487): reset streams leave the concurrency cap at once, so
they bound nothing. Answered with GOAWAY(ENHANCE_YOUR_CALM)."""
MAX_CONTINUATIONS = 64
"""CONTINUATION frames one header block may take (empty ones would never reach the size limit)."""
ECHOED_CHARS = 200
"""Of a client's own text (a method path, an encoding) at most this much goes back in an error."""
HEAD_CACHE_SIZE = 512
"""Distinct request header blocks remembered per connection..."""
HEAD_CACHE_BYTES = 256 << 10
"""...and their total size; blocks that were rejected are never remembered."""

_FRAME = struct.Struct(">BHBBL")  # length (24 bits as 8 + 16), type, flags, stream id
_PREFIX = struct.Struct(">BL")  # gRPC message prefix: compressed flag, length
_U32 = struct.Struct(">L")
_SETTING = struct.Struct(">HL")
_CONNECTION_SPECIFIC = frozenset((b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"))
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_ENCODINGS = {b"gzip": 31, b"deflate": 15}  # zlib wbits


# -- HPACK encoding of our responses: static-table and literal-without-indexing forms only, so the
# encoder keeps no dynamic state (RFC 7541 §6.1, §6.2.2).


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _hpack_str(value: bytes) -> bytes:
    return _hpack_int(len(value), 7) + value


def _literal(name: bytes, value: bytes) -> bytes:
    """Literal header field without indexing, new name."""
    return b"\x00" + _hpack_str(name) + _hpack_str(value)


def _literal_indexed_name(index: int, value: bytes) -> bytes:
    """Literal header field without indexing, name from the static table."""
    return _hpack_int(index, 4) + _hpack_str(value)


_STATUS_200 = b"\x88"  # static index 8
_CONTENT_TYPE_GRPC = _literal_indexed_name(31, b"application/grpc")
RESPONSE_HEADERS = _STATUS_200 + _CONTENT_TYPE_GRPC
TRAILERS_OK = _literal(b"grpc-status", b"0")
_TABLE_SIZE_ZERO = b"\x20"  # dynamic table size update to 0: we never use one


def percent_encode(message: str) -> bytes:
    """grpc-message encoding: UTF-8, then %XX for bytes outside 0x20-0x7E and for '%'."""
    raw = message.encode("utf-8", "replace")
    if all(0x20 <= b <= 0x7E and b != 0x25 for b in raw):
        return raw
    return b"".join(bytes((b,)) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b for b in raw)


def status_block(code: grpc.StatusCode, message: str) -> bytes:
    block = _literal(b"grpc-status", str(code.value[0]).encode())
    if message:
        block += _literal(b"grpc-message", percent_encode(clipped(message, MAX_GRPC_MESSAGE_IN_ERRORS)))
    return block


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _FRAME.pack(n >> 16, n & 0xFFFF, ftype, flags, sid) + payload


_UNARY_HEAD = struct.Struct(f">BHBBL{len(RESPONSE_HEADERS)}sBHBBLBL")  # HEADERS frame, DATA frame header, prefix
_TRAILER = struct.Struct(f">BHBBL{len(TRAILERS_OK)}s")


# -- request heads ---------------------------------------------------------------------------------

_INFER, _UNARY, _STREAM, _UNIMPLEMENTED = range(4)
_KINDS = {
    grpc_service.INFER: _INFER,
    grpc_service.UNARY: _UNARY,
    grpc_service.STREAM: _STREAM,
    grpc_service.UNIMPLEMENTED: _UNIMPLEMENTED,
}


class _Route:
    """A row of grpc_service's method table, with its kind as a small int for the hot path."""

    __slots__ = ("handler", "kind", "name", "parse")

    def __init__(self, method: Method) -> None:
        self.kind = _KINDS[method.kind]
        self.name = method.name
        self.handler = method.handler
        self.parse = method.parse


class _Head:
    """What a request header block says, once parsed; cached per exact block bytes."""

    __slots__ = ("caller", "encoding", "reject", "route", "timeout", "traceparent")

    def __init__(
        self,
        route: _Route | None = None,
        timeout: float | None = None,
        encoding: int = 0,
        reject: tuple | None = None,
        caller: str = "",
        traceparent: bytes | None = None,
    ) -> None:
        self.route = route
        self.timeout = timeout
        self.encoding = encoding  # zlib wbits, 0 for identity
        self.reject = reject  # ("rst", h2 code) | ("http", status, text) | ("grpc", StatusCode, message)
        self.caller = caller  # the sluice-caller metadata, checked (callers.py); "" when absent
        self.traceparent = traceparent  # the W3C traceparent metadata, unparsed (tracing.py)


def _echo(text: bytes) -> str:
    """A client's own text as it goes back in an error: at most ``ECHOED_CHARS`` of it."""
    shown = text[:ECHOED_CHARS].decode(errors="replace")
    return shown if len(text) <= ECHOED_CHARS else f"{shown}... ({len(text)} bytes)"


def _malformed(why: str) -> _Head:
    return _Head(reject=("rst", PROTOCOL_ERROR, why))


def _grpc_reject(code: grpc.StatusCode, message: str) -> _Head:
    return _Head(reject=("grpc", code, message))


def parse_timeout(value: bytes) -> float | None:
    """Seconds of a grpc-timeout value (``1*8DIGIT unit``), or None when it is malformed."""
    digits, unit = value[:-1], value[-1:]
    if not (1 <= len(digits) <= 8 and digits.isdigit()) or unit not in _TIMEOUT_UNITS:
        return None
    return int(digits) * _TIMEOUT_UNITS[unit]


class _H2Error(Exception):
    """A connection error: answered with GOAWAY(code) and the connection closed."""

    def __init__(self, code: int, debug: str) -> None:
        super().__init__(debug)
        self.code = code
        self.debug = debug


# -- streams -------------------------------------------------------------------------------------


class _Pieces:
    """The bytes of a stream's gRPC messages as they arrive: views of the reads that carried them,
    taken out in order with one copy each (:meth:`take`). ``need``: the length of the message whose
    prefix was read (-1: the next prefix is due); ``flag``: its compressed flag."""

    __slots__ = ("flag", "kept", "last", "need", "parts", "size", "taken")

    def __init__(self) -> None:
        self.parts: deque[memoryview] = deque()
        self.size = 0  # bytes held
        self.kept = 0  # bytes of the reads the views keep alive (an upper bound)
        self.last: object = None  # the read the last view came from
        self.taken = 0  # bytes of the current message (prefix included) taken out so far
        self.need = -1
        self.flag = 0

    def add(self, view: memoryview) -> None:
        if not len(view):
            return
        if view.obj is not self.last:
            self.last = view.obj
            self.kept += len(view.obj)  # type: ignore[arg-type]
        self.parts.append(view)
        self.size += len(view)
        if self.kept > 2 * self.size + KEPT_SLACK:
            # Small pieces of many reads (a client interleaving streams, or padding reads with
            # other frames) would keep every read alive: hold their bytes alone instead.
            joined = b"".join(self.parts)
            self.parts.clear()
            self.parts.append(memoryview(joined))
            self.kept, self.last = len(joined), joined

    def take(self, n: int) -> bytes:
        """The next ``n`` bytes (``n`` <= ``size``), joined into one bytes object."""
        parts = self.parts
        self.size -= n
        self.taken = 0 if self.need >= 0 else self.taken + n  # a message body ends the message
        if not self.size:
            self.kept, self.last = 0, None  # the views still held are dropped below
        if not n:
            return b""
        first = parts[0]
        if len(first) >= n:
            if len(first) == n:
                parts.popleft()
            else:
                parts[0] = first[n:]
            return bytes(first[:n])
        chosen: list[memoryview] = []
        left = n
        while left:
            part = parts[0]
            if len(part) <= left:
                chosen.append(parts.popleft())
                left -= len(part)
            else:
                chosen.append(part[:left])
                parts[0] = part[left:]
                left = 0
        return b"".join(chosen)

    @property
    def started(self) -> bool:
        """Whether part of a message (its prefix or body) came and was not yet taken out whole."""
        return self.size > 0 or self.need >= 0

    @property
    def received(self) -> int:
        """Bytes of the unfinished message that came (prefix included)."""
        return self.taken + self.size


class _CutData:
    """A DATA frame a read ended inside: ``left`` bytes of it still to come, of which ``body`` are
    message bytes for ``stream`` (None: dropped; the rest is padding); ``end_stream``: its flag,
    acted on once the frame is whole. Flow control was settled for the whole frame when it began."""

    __slots__ = ("body", "end_stream", "left", "stream")

    def __init__(self, stream: _Stream | None, left: int, body: int, end_stream: bool) -> None:
        self.stream = stream
        self.left = left
        self.body = body
        self.end_stream = end_stream


class _Stream:
    __slots__ = (
        "caller",
        "conn",
        "credited",
        "drained",
        "finished",
        "headers_sent",
        "held",
        "message",
        "opened",
        "owed",
        "pending",
        "queue",
        "rbuf",
        "recv_window",
        "remote_closed",
        "request",
        "route",
        "send_window",
        "sid",
        "task",
        "timer",
        "traceparent",
        "trailers",
        "unacked",
        "wbits",
    )

    def __init__(self, conn: GrpcConnection, sid: int, route: _Route | None, send_window: int, wbits: int) -> None:
        self.conn = conn
        self.sid = sid
        self.route = route
        self.send_window = send_window
        self.recv_window = STREAM_WINDOW
        self.unacked = 0  # bytes consumed, not yet given back with a WINDOW_UPDATE
        self.held = 0  # ModelStreamInfer: bytes received since the last message was queued
        self.owed = 0  # ModelStreamInfer: bytes received, not yet consumed (held + queued messages)
        self.credited = 0  # of ``owed``, bytes already given back to the connection window (EARLY_CREDIT)
        self.wbits = wbits
        self.remote_closed = False
        self.finished = False  # answered, reset or abandoned: nothing more is sent
        self.headers_sent = False
        self.message: bytes | None = None
        self.rbuf: _Pieces | None = None  # a gRPC message arriving over several DATA frames
        self.pending: deque | None = None  # response DATA waiting for window
        self.trailers: bytes | None = None  # trailer frame(s) to send after pending DATA
        self.request: InferRequest | None = None
        self.task: asyncio.Task | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.opened = 0.0  # loop time the grpc-timeout timer started (with ``timer``)
        self.queue: asyncio.Queue | None = None
        self.drained: asyncio.Future | None = None  # ModelStreamInfer waiting for its DATA to go out
        self.caller = ""  # the head's sluice-caller
        self.traceparent: bytes | None = None  # the head's traceparent

    def done(self, outcome: InferResponse | SluiceError) -> None:
        """``DataPlane.infer_nowait`` callback."""
        self.conn.infer_done(self, outcome)


class GrpcConnection(asyncio.Protocol):
    """One client connection: HTTP/2 framing, streams, and the gRPC calls on them."""

    def __init__(self, server: GrpcServer) -> None:
        self._server = server
        self._limits = server.limits
        self._max_message = server.limits.max_grpc_message_bytes
        self._loop = server.loop
        self._routes = server.routes
        service = server.service
        self._decode_infer = service.decoder.decode
        self._submit = service.submit
        self._tracing = service.tracing
        self._encode_infer = service.encode_infer
        self._transport: asyncio.Transport | None = None
        self._closed = False
        self._buf = b""
        self._cut: _CutData | None = None  # a DATA frame the last read ended inside: the rest comes next
        self._frame_reads: list[bytes] = []  # reads of a frame longer than they are (joined once whole)...
        self._frame_due = 0  # ...and the bytes it still lacks
        self._preface_ok = False
        self._settings_seen = False
        self._preface_timer: asyncio.TimerHandle | None = None
        self._out: list[bytes | memoryview] = []
        self._flush_scheduled = False
        self._streams: dict[int, _Stream] = {}
        self._blocked: dict[int, _Stream] = {}
        self._last_sid = 0
        self._goaway_sid: int | None = None  # set once we sent GOAWAY: streams above it are ignored
        self._peer_goaway = False
        self._refusing: str | None = None  # over --max-connections: the first call is answered this, then GOAWAY
        self._refuse_timer: asyncio.TimerHandle | None = None  # ...or, without a call, GOAWAY at this timer
        self._continuation: tuple[int, list[bytes], int, bool] | None = None
        self._max_block = 4 * server.limits.max_header_bytes + 65_536  # encoded header block bytes
        self._decoder = hpack.Decoder(max_header_list_size=self._max_block)
        self._heads: dict[bytes, _Head] = {}
        self._heads_bytes = 0
        self._table_reset_pending = False
        # Flow control.
        self._send_window = DEFAULT_WINDOW
        self._peer_initial_window = DEFAULT_WINDOW
        self._peer_max_frame = DEFAULT_MAX_FRAME
        self._recv_window = CONNECTION_WINDOW
        self._recv_consumed = 0
        self._early = 0  # bytes of the streams' ``credited``, all together
        self._write_paused = False
        self._reset_debt = 0  # client resets of open streams, less the streams answered since
        self._keepalive_sent: float | None = None  # loop time of our unacknowledged keepalive PING
        self._closed_at: float | None = None  # when we closed it (the transport may still be flushing)
        self._block_started = 0.0  # when the header block waiting for CONTINUATION began
        self.last_activity = self._loop.time()
        self._last_busy = 0.0  # the last sweep that found a call open: idleness counts from its end

    # -- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        server = self._server
        server.connections.add(self)
        settings = b"".join(
            _SETTING.pack(ident, value)
            for ident, value in (
                (SETTINGS_ENABLE_PUSH, 0),
                (SETTINGS_MAX_CONCURRENT_STREAMS, MAX_CONCURRENT_STREAMS),
                (SETTINGS_INITIAL_WINDOW_SIZE, STREAM_WINDOW),
                (SETTINGS_MAX_FRAME_SIZE, MAX_FRAME_SIZE),
                (SETTINGS_MAX_HEADER_LIST_SIZE, self._limits.max_header_bytes),
            )
        )
        self._out.append(frame(SETTINGS, 0, 0, settings))
        self._out.append(frame(WINDOW_UPDATE, 0, 0, _U32.pack(CONNECTION_WINDOW - DEFAULT_WINDOW)))
        if server.draining:
            self._fail(NO_ERROR, "the server is stopping")
            return
        self._flush()
        if len(server.connections) > self._limits.max_connections:
            # Over the limit. A GOAWAY now, before any call, makes gRPC clients retry their pending call
            # transparently on a new connection, refused the same way, at once and for ever (grpcio spins a
            # core and grows without bound). So the first call is answered UNAVAILABLE naming the limit, as
            # HTTP answers 503, and the GOAWAY then covers it; a connection that sends no call is closed after
            # --header-timeout-s.
            self._refusing = server.crowding.refusal
            server.crowding.refuse()
            self._refuse_timer = self._loop.call_later(self._limits.header_timeout_s, self._refuse_idle)
            return
        self._preface_timer = self._loop.call_later(self._limits.header_timeout_s, self._preface_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._out = []
        server = self._server
        server.connections.discard(self)
        if server.crowding.refused:  # (checked here: this runs for every connection)
            server.crowding.closed(len(server.connections))
        if self._preface_timer is not None:
            self._preface_timer.cancel()
        if self._refuse_timer is not None:
            self._refuse_timer.cancel()
        for stream in list(self._streams.values()):
            self._abandon(stream)
        self._streams.clear()
        self._blocked.clear()

    def pause_writing(self) -> None:
        # The peer is not reading what we send (PING/SETTINGS acks, RST_STREAMs, answers): read no
        # more of its frames until it catches up, so replies to them cannot pile up here.
        self._write_paused = True
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._transport is not None and not self._closed:
            self._transport.resume_reading()
            if self._buf:
                self.data_received(b"")  # frames left unread when the pause came

    def data_received(self, data: bytes) -> None:
        if self._closed:
            return
        self.last_activity = self._loop.time()
        # What this read produces (acks, window updates, immediate answers) is written once, below.
        scheduled, self._flush_scheduled = self._flush_scheduled, True
        pos = 0
        try:
            if not self._preface_ok:
                if self._buf:
                    data, self._buf = self._buf + data, b""
                if len(data) < len(PREFACE):
                    if not PREFACE.startswith(data):
                        raise _H2Error(PROTOCOL_ERROR, "expected the HTTP/2 connection preface (h2c, prior knowledge)")
                    self._buf = data
                    return
                if not data.startswith(PREFACE):
                    raise _H2Error(PROTOCOL_ERROR, "expected the HTTP/2 connection preface (h2c, prior knowledge)")
                self._preface_ok = True
                pos = len(PREFACE)
            elif self._buf:
                data, pos = self._after_buf(data)
            if self._cut is not None and not self._stopped:
                pos = self._more_data(data, pos)
            if not self._stopped:
                pos = self._frames(data, pos)
        except _H2Error as exc:
            self._fail(exc.code, exc.debug)
            return
        finally:
            self._flush_scheduled = scheduled
        if pos < len(data) and not self._closed:
            self._buf = data[pos:]  # an incomplete frame, or what a pause left unread
        if self._out:
            self._flush()

    @property
    def _stopped(self) -> bool:
        """Closed, or paused for writing: the rest of a read waits in ``_buf`` for resume_writing."""
        return self._closed or self._write_paused

    def _after_buf(self, data: bytes) -> tuple[bytes, int]:
        """Handle what the last read left (``_buf``: frames a pause left unread, or the start of a frame
        it cut) with the head of ``data``; return the bytes to go on with and where in them. Never
        ``_buf + data`` for a frame it can finish otherwise: that copies the whole read (up to 256 KiB)."""
        if self._frame_due > 0:  # a frame (not DATA) longer than the reads: collected, joined once
            self._frame_reads.append(data)
            self._frame_due -= len(data)
            if self._frame_due > 0:
                return b"", 0  # (``_buf`` keeps its start)
            data = b"".join(self._frame_reads)
            self._frame_reads = []
        buf, self._buf = self._buf, b""
        if self._cut is not None:
            return buf + data, 0  # a pause came inside a cut DATA frame (rare): its rest goes first
        done = self._frames(buf)  # whole frames, and a DATA frame cut by its end (then _cut is set)
        if self._stopped:
            return buf[done:] + data, 0  # paused again before the end (rare): all waits
        tail = buf[done:]
        if not tail:
            return data, 0
        skip = 0
        if len(tail) < 9:  # a frame header cut by the read: complete it from the head of data
            skip = min(9 - len(tail), len(data))
            tail += data[:skip]
            if len(tail) < 9:
                return tail, 0  # still short (tiny reads): kept for the next
            length = int.from_bytes(tail[:3], "big")
            if length > MAX_FRAME_SIZE:  # refused now, as _frames refuses a header that came whole
                raise _H2Error(FRAME_SIZE_ERROR, f"frame of {length} bytes is over SETTINGS_MAX_FRAME_SIZE")
        if tail[3] == DATA and tail[4] & PADDED and len(tail) == 9 and skip < len(data):
            tail += data[skip : skip + 1]  # a padded DATA frame is taken in pieces once its pad length came
            skip += 1
        if tail[3] == DATA and not (tail[4] & PADDED and len(tail) == 9) and self._frames(tail) == len(tail):
            return data, skip  # a DATA frame's start: the rest of its payload is read from data in place
        need = 9 + int.from_bytes(tail[:3], "big") - len(tail)
        if need <= len(data) - skip:
            self._frames(tail + data[skip : skip + need])  # exactly one (small) frame
            return data, skip + need
        # Not tail + data for each read: a 1 MiB frame in small reads would copy what came each time.
        self._buf, self._frame_reads, self._frame_due = tail, [data[skip:]], need - (len(data) - skip)
        return b"", 0

    # -- output ----------------------------------------------------------------------------------
    def _emit(self, data: bytes | memoryview) -> None:
        """Queue ``data`` for the next write. A read full of frames that are answered at once (PINGs,
        calls refused from their headers alone, resets) is written out as it goes, every
        ``CONTROL_REPLIES_PER_WRITE`` pieces, so that a peer that does not read pauses us
        (``pause_writing``) within a bounded amount of replies, not a whole read's worth of them."""
        out = self._out
        out.append(data)
        if len(out) >= CONTROL_REPLIES_PER_WRITE:
            self._flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    _control = _emit

    def _flush(self) -> None:
        self._flush_scheduled = False
        out = self._out
        if not out:
            return
        self._out = []
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        transport.write(out[0] if len(out) == 1 else b"".join(out))
        if (self._goaway_sid is not None or self._peer_goaway) and not self._streams:
            self._close()

    def _close(self) -> None:
        if self._transport is not None and not self._closed:
            self._closed = True
            self._closed_at = self._loop.time()
            self._transport.close()

    def abort(self) -> None:
        """Drop the connection and whatever it still had to send (a peer that stopped reading)."""
        if self._transport is not None:
            self._transport.abort()

    def _fail(self, code: int, debug: str) -> None:
        """Connection error: GOAWAY with ``code``, drop every stream, close."""
        if self._closed:
            return
        self._out.append(frame(GOAWAY, 0, 0, _U32.pack(self._last_sid) + _U32.pack(code) + debug.encode()[:256]))
        self._goaway_sid = self._last_sid
        for stream in list(self._streams.values()):
            self._abandon(stream)
        self._streams.clear()
        self._blocked.clear()
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.write(b"".join(self._out))
        self._out = []
        self._close()

    def _preface_timeout(self) -> None:
        self._preface_timer = None
        if not self._settings_seen:
            self._fail(PROTOCOL_ERROR, "no HTTP/2 preface and SETTINGS in time (--header-timeout-s)")

    def _refuse_idle(self) -> None:
        self._refuse_timer = None
        self._fail(ENHANCE_YOUR_CALM, self._refusing or "")

    def _refuse(self, sid: int) -> None:
        """The first call on a connection over --max-connections: answered UNAVAILABLE, then GOAWAY and close."""
        message = self._refusing or ""
        self._emit_headers(sid, RESPONSE_HEADERS + status_block(grpc.StatusCode.UNAVAILABLE, message), end_stream=True)
        self._fail(ENHANCE_YOUR_CALM, message)

    def goaway(self) -> None:
        """Shutdown: take no new streams, finish the open ones, then close."""
        if self._closed or self._goaway_sid is not None:
            return
        self._goaway_sid = self._last_sid
        self._emit(frame(GOAWAY, 0, 0, _U32.pack(self._last_sid) + _U32.pack(NO_ERROR)))

    def close(self) -> None:
        for stream in list(self._streams.values()):
            self._abandon(stream)
        self._streams.clear()
        if self._out and self._transport is not None and not self._transport.is_closing():
            self._transport.write(b"".join(self._out))
            self._out = []
        self._close()

    @property
    def busy(self) -> bool:
        return bool(self._streams)

    def expire(self, now: float) -> None:
        """Sweeper hook: a connection with no call open and nothing received for
        ``--idle-timeout-s`` is told GOAWAY and closed, so idle clients cannot hold slots. One with
        calls open that received nothing for ``--keepalive-interval-s`` is sent a PING, and closed
        if that is not acknowledged within ``--keepalive-timeout-s`` (a half-open connection, or a
        peer that stopped reading), which cancels its calls."""
        limits = self._limits
        if self._closed:
            # closed by us, but the peer does not read what is left to send (the transport waits to
            # flush it before it lets go): drop it, its buffer and its connection slot
            if self._closed_at is not None and now - self._closed_at > limits.idle_timeout_s:
                self.abort()
            return
        if self._continuation is not None and now - self._block_started > limits.header_timeout_s:
            self._fail(ENHANCE_YOUR_CALM, "header block not finished in time (--header-timeout-s)")
            return
        if not self._streams:
            self._keepalive_sent = None
            # idle since its last bytes, or since its last call ended (a long call sends nothing while it runs)
            if now - max(self.last_activity, self._last_busy) > limits.idle_timeout_s:
                self.goaway()
                self.close()
            return
        self._last_busy = now
        if self._keepalive_sent is not None:
            if now - self._keepalive_sent > limits.keepalive_timeout_s:
                self._fail(NO_ERROR, "keepalive PING not acknowledged in time (--keepalive-timeout-s)")
        elif now - self.last_activity > limits.keepalive_interval_s and not self._closed:
            self._keepalive_sent = now
            self._control(frame(PING, 0, 0, KEEPALIVE_PING))

    # -- frames ----------------------------------------------------------------------------------
    def _frames(self, data: bytes, pos: int = 0) -> int:
        """Handle the whole frames of ``data`` from ``pos``; return where the first incomplete one
        starts (or where handling stopped: closed, or paused for writing)."""
        end = len(data)
        unpack = _FRAME.unpack_from
        while end - pos >= 9:
            hi, lo, ftype, flags, sid = unpack(data, pos)
            length = (hi << 16) | lo
            if length > MAX_FRAME_SIZE:
                raise _H2Error(FRAME_SIZE_ERROR, f"frame of {length} bytes is over SETTINGS_MAX_FRAME_SIZE")
            start = pos + 9
            stop = start + length
            if stop > end:
                # A DATA frame is taken in pieces (when padded, once its pad length came); others wait whole.
                whole_header = not flags & PADDED or end > start
                if ftype == DATA and whole_header and self._settings_seen and self._continuation is None:
                    self._on_data(data, start, end, flags, sid & 0x7FFFFFFF, length)
                    return end
                break
            pos = stop
            sid &= 0x7FFFFFFF
            if self._continuation is not None and ftype != CONTINUATION:
                raise _H2Error(PROTOCOL_ERROR, "a header block was interrupted by another frame")
            if not self._settings_seen and ftype != SETTINGS:
                raise _H2Error(PROTOCOL_ERROR, "the first frame after the preface must be SETTINGS")
            if ftype == DATA:
                self._on_data(data, start, stop, flags, sid, length)
            elif ftype == HEADERS:
                self._on_headers(data, start, stop, flags, sid)
            elif ftype == SETTINGS:
                self._on_settings(data, start, stop, flags, sid)
            elif ftype == WINDOW_UPDATE:
                self._on_window_update(data, start, stop, sid)
            elif ftype == RST_STREAM:
                self._on_rst_stream(data, start, stop, sid)
            elif ftype == PING:
                if sid:
                    raise _H2Error(PROTOCOL_ERROR, "PING on a stream")
                if length != 8:
                    raise _H2Error(FRAME_SIZE_ERROR, "PING payload must be 8 bytes")
                if not flags & ACK:
                    self._control(frame(PING, ACK, 0, data[start:stop]))
                elif data[start:stop] == KEEPALIVE_PING:
                    self._keepalive_sent = None
            elif ftype == CONTINUATION:
                self._on_continuation(data, start, stop, flags, sid)
            elif ftype == PRIORITY:
                if not sid:
                    raise _H2Error(PROTOCOL_ERROR, "PRIORITY on stream 0")
                if length != 5:
                    self._reset_sid(sid, FRAME_SIZE_ERROR)
            elif ftype == GOAWAY:
                if sid:
                    raise _H2Error(PROTOCOL_ERROR, "GOAWAY on a stream")
                self._peer_goaway = True
                if not self._streams:
                    self._emit(b"")  # flush closes the connection
            elif ftype == PUSH_PROMISE:
                raise _H2Error(PROTOCOL_ERROR, "clients must not send PUSH_PROMISE")
            # Unknown frame types are ignored (RFC 9113 §4.1).
            if self._closed or self._write_paused:
                break  # paused: the rest of this read waits in _buf for resume_writing
        return pos

    def _on_settings(self, data: bytes, start: int, stop: int, flags: int, sid: int) -> None:
        if sid:
            raise _H2Error(PROTOCOL_ERROR, "SETTINGS on a stream")
        length = stop - start
        if flags & ACK:
            if length:
                raise _H2Error(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if length % 6:
            raise _H2Error(FRAME_SIZE_ERROR, "SETTINGS payload is not a multiple of 6 bytes")
        if not self._settings_seen:
            self._settings_seen = True
            if self._preface_timer is not None:
                self._preface_timer.cancel()
                self._preface_timer = None
        opened = False
        window: int | None = None
        for offset in range(start, stop, 6):
            ident, value = _SETTING.unpack_from(data, offset)
            if ident == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise _H2Error(FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE over 2^31-1")
                window = value  # applied once, below: a frame may repeat it (thousands of times)
            elif ident == SETTINGS_MAX_FRAME_SIZE:
                if not DEFAULT_MAX_FRAME <= value <= 2**24 - 1:
                    raise _H2Error(PROTOCOL_ERROR, f"SETTINGS_MAX_FRAME_SIZE {value} is outside 16384..2^24-1")
                self._peer_max_frame = value
                opened = True
            elif ident == SETTINGS_ENABLE_PUSH:
                if value > 1:
                    raise _H2Error(PROTOCOL_ERROR, "SETTINGS_ENABLE_PUSH must be 0 or 1")
            elif ident == SETTINGS_HEADER_TABLE_SIZE:
                # Our encoder uses no dynamic table; say so once, as the peer's decoder may expect
                # a size update at the start of our next header block.
                self._table_reset_pending = True
        if window is not None:
            delta = window - self._peer_initial_window
            self._peer_initial_window = window
            for stream in self._streams.values():
                stream.send_window += delta
                if stream.send_window > MAX_WINDOW:
                    raise _H2Error(FLOW_CONTROL_ERROR, "a stream window grew over 2^31-1")
            opened = delta > 0
        self._control(frame(SETTINGS, ACK, 0))
        if opened:
            for stream in list(self._streams.values()):
                if stream.pending:
                    self._pump(stream)

    def _on_window_update(self, data: bytes, start: int, stop: int, sid: int) -> None:
        if stop - start != 4:
            raise _H2Error(FRAME_SIZE_ERROR, "WINDOW_UPDATE payload must be 4 bytes")
        increment = _U32.unpack_from(data, start)[0] & 0x7FFFFFFF
        if sid == 0:
            if not increment:
                raise _H2Error(PROTOCOL_ERROR, "WINDOW_UPDATE with a 0 increment")
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                raise _H2Error(FLOW_CONTROL_ERROR, "connection window grew over 2^31-1")
            if self._blocked:
                for blocked in list(self._blocked.values()):
                    if self._send_window <= 0:
                        break  # the rest stay blocked: one tiny update must not walk them all
                    self._pump(blocked)
            return
        stream = self._streams.get(sid)
        if stream is None:
            if sid > self._last_sid:
                raise _H2Error(PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {sid}")
            return
        if not increment:
            self._reset(stream, PROTOCOL_ERROR)
            return
        stream.send_window += increment
        if stream.send_window > MAX_WINDOW:
            self._reset(stream, FLOW_CONTROL_ERROR)
            return
        if stream.pending or stream.trailers is not None:
            self._pump(stream)

    def _on_rst_stream(self, data: bytes, start: int, stop: int, sid: int) -> None:
        if stop - start != 4:
            raise _H2Error(FRAME_SIZE_ERROR, "RST_STREAM payload must be 4 bytes")
        if not sid:
            raise _H2Error(PROTOCOL_ERROR, "RST_STREAM on stream 0")
        stream = self._streams.pop(sid, None)
        if stream is None:
            if sid > self._last_sid:
                raise _H2Error(PROTOCOL_ERROR, f"RST_STREAM on idle stream {sid}")
            return
        timer = stream.timer
        self._abandon(stream)
        if timer is not None and self._loop.time() - stream.opened >= (timer.when() - stream.opened) / 2:
            # its own deadline has come, or nearly (the client's clock started first): a client cancels
            # a call that timed out, which is no rapid reset (a reset within the first half still counts)
            self._after_stream_closed()
            return
        self._reset_debt += 1
        if self._reset_debt > RESET_LIMIT:
            raise _H2Error(ENHANCE_YOUR_CALM, "too many streams reset by the client (rapid reset)")
        self._after_stream_closed()

    def _on_data(self, data: bytes, start: int, stop: int, flags: int, sid: int, length: int) -> None:
        """A DATA frame of ``length`` payload bytes, of which ``data[start:stop]`` came: all of them,
        or the first (a frame cut by the end of a read: :meth:`_more_data` takes the rest as it comes).
        Flow control and the stream's state are settled for the whole frame here."""
        if not sid:
            raise _H2Error(PROTOCOL_ERROR, "DATA on stream 0")
        # Flow control counts the whole payload, padding included. Credit goes back as it is consumed
        # (_consumed): at once for what is dropped and for the one message of a unary call (bounded
        # by --max-grpc-message-bytes), when the handler takes it for a ModelStreamInfer message.
        self._recv_window -= length
        if self._recv_window < 0:
            raise _H2Error(FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        left = length - (stop - start)  # bytes of this frame still to come
        body = length  # of the payload, the bytes of gRPC messages (the rest is padding)
        if flags & PADDED:
            if not length:
                raise _H2Error(FRAME_SIZE_ERROR, "PADDED DATA without a pad length")
            pad = data[start]
            start += 1
            body = length - 1 - pad
            if body < 0:
                raise _H2Error(PROTOCOL_ERROR, "DATA padding longer than the payload")
        stop = min(stop, start + body)
        rest = body - (stop - start)  # message bytes of this frame still to come
        dropped = _CutData(None, left, rest, False) if left else None  # its rest, when the stream takes none
        end_stream = flags & END_STREAM
        stream = self._streams.get(sid)
        if stream is None:
            if sid > self._last_sid:
                raise _H2Error(PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            self._credit(length)
            self._cut = dropped
            return  # a stream we answered or reset: its late DATA is dropped
        if stream.remote_closed:
            self._credit(length)
            self._reset(stream, STREAM_CLOSED)
            self._cut = dropped
            return
        stream.recv_window -= length
        if stream.recv_window < 0:
            self._credit(length)
            self._reset(stream, FLOW_CONTROL_ERROR)
            self._cut = dropped
            return
        # Input matters only until the answer is decided (trailers set, e.g. a 415 waiting for window).
        answering = not stream.finished and stream.trailers is None
        queue = stream.queue
        if queue is not None and answering:
            stream.held += length
            stream.owed += length
            if self._early + length <= EARLY_CREDIT:
                self._early += length
                stream.credited += length
                self._credit(length)
            if stop > start:
                self._feed(stream, data, start, stop)
            if stream.held and queue.empty():  # the handler waits for this message: it needs the bytes
                self._take_held(stream)
        else:
            if end_stream:
                self._credit(length)  # the stream needs no more window
            else:
                self._consumed(stream, length)
            if stop > start and answering:
                self._feed(stream, data, start, stop)
        if left:
            self._cut = _CutData(stream, left, rest, bool(end_stream))
        elif end_stream:
            self._end_stream(stream, answering)

    def _more_data(self, data: bytes, pos: int) -> int:
        """The next bytes of the DATA frame the last read cut, from ``data[pos:]``; where they end."""
        cut = self._cut
        assert cut is not None
        n = min(cut.left, len(data) - pos)
        body = min(n, cut.body)
        cut.left -= n
        cut.body -= body
        stream = cut.stream
        if stream is not None:
            answering = not stream.finished and stream.trailers is None
            if body and answering:
                self._feed(stream, data, pos, pos + body)
            if not cut.left and cut.end_stream:
                self._end_stream(stream, answering)
        if not cut.left:
            self._cut = None
        return pos + n

    def _end_stream(self, stream: _Stream, answering: bool) -> None:
        stream.remote_closed = True
        if answering and not stream.finished:
            self._end_of_input(stream)

    def _credit(self, n: int) -> None:
        """``n`` bytes of the connection window were consumed: give them back, in large updates."""
        self._recv_consumed += n
        if self._recv_consumed >= CREDIT_BATCH:
            self._emit(frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._recv_consumed)))
            self._recv_window += self._recv_consumed
            self._recv_consumed = 0

    def _consumed(self, stream: _Stream, n: int) -> None:
        """``n`` bytes of ``stream``'s DATA were consumed: credit the connection (what it was not given
        early) and the stream."""
        early = min(stream.credited, n)
        if early:
            stream.credited -= early
            self._early -= early
        self._credit(n - early)
        if stream.remote_closed or stream.finished:
            return
        stream.unacked += n
        if stream.unacked >= STREAM_WINDOW // 2:
            self._emit(frame(WINDOW_UPDATE, 0, stream.sid, _U32.pack(stream.unacked)))
            stream.recv_window += stream.unacked
            stream.unacked = 0

    def _take_held(self, stream: _Stream) -> None:
        held, stream.held = stream.held, 0
        stream.owed -= held
        self._consumed(stream, held)

    def taken(self, stream: _Stream, n: int) -> None:
        """The ModelStreamInfer handler took a message that arrived in ``n`` bytes of DATA."""
        if stream.finished:
            return  # what it owed went back when it closed
        stream.owed -= n
        self._consumed(stream, n)
        if stream.held and stream.queue is not None and stream.queue.empty():
            self._take_held(stream)

    def _release(self, stream: _Stream) -> None:
        """A closed stream's unconsumed bytes go back to the connection window."""
        if stream.owed:
            self._credit(stream.owed - stream.credited)
            self._early -= stream.credited
            stream.owed = stream.held = stream.credited = 0

    def _on_headers(self, data: bytes, start: int, stop: int, flags: int, sid: int) -> None:
        if not sid:
            raise _H2Error(PROTOCOL_ERROR, "HEADERS on stream 0")
        if flags & PADDED:
            if start >= stop:
                raise _H2Error(FRAME_SIZE_ERROR, "PADDED HEADERS without a pad length")
            pad = data[start]
            start += 1
            if pad > stop - start:
                raise _H2Error(PROTOCOL_ERROR, "HEADERS padding longer than the payload")
            stop -= pad
        if flags & PRIORITY_FLAG:
            if stop - start < 5:
                raise _H2Error(FRAME_SIZE_ERROR, "HEADERS with PRIORITY shorter than 5 bytes")
            start += 5
        fragment = data[start:stop]
        if len(fragment) > self._max_block:  # before decoding it (frames may be up to 1 MiB)
            raise _H2Error(ENHANCE_YOUR_CALM, "header block far over SETTINGS_MAX_HEADER_LIST_SIZE")
        if flags & END_HEADERS:
            self._header_block(sid, fragment, bool(flags & END_STREAM))
        else:
            self._continuation = (sid, [fragment], len(fragment), bool(flags & END_STREAM))
            self._block_started = self._loop.time()

    def _on_continuation(self, data: bytes, start: int, stop: int, flags: int, sid: int) -> None:
        pending = self._continuation
        if pending is None or pending[0] != sid:
            raise _H2Error(PROTOCOL_ERROR, "CONTINUATION without a HEADERS frame before it on this stream")
        _, fragments, size, end_stream = pending
        fragments.append(data[start:stop])
        size += stop - start
        if size > self._max_block:
            raise _H2Error(ENHANCE_YOUR_CALM, "header block far over SETTINGS_MAX_HEADER_LIST_SIZE")
        if len(fragments) > MAX_CONTINUATIONS + 1:  # the HEADERS frame's fragment, then the CONTINUATIONs
            raise _H2Error(ENHANCE_YOUR_CALM, f"header block in over {MAX_CONTINUATIONS} CONTINUATION frames")
        if flags & END_HEADERS:
            self._continuation = None
            self._header_block(sid, b"".join(fragments), end_stream)
        else:
            self._continuation = (sid, fragments, size, end_stream)

    def _header_block(self, sid: int, block: bytes, end_stream: bool) -> None:
        head = self._heads.get(block)
        if head is None:
            head = self._decode_head(block)  # always decoded: the HPACK state must follow the peer's
        stream = self._streams.get(sid)
        if stream is not None:  # trailers from the client: only an end of stream is allowed
            if not end_stream:
                self._reset(stream, PROTOCOL_ERROR)
            elif not stream.remote_closed:
                stream.remote_closed = True
                if not stream.finished and stream.trailers is None:
                    self._end_of_input(stream)
            return
        if not sid & 1:
            raise _H2Error(PROTOCOL_ERROR, f"client opened even-numbered stream {sid}")
        if sid <= self._last_sid:
            # a stream closed (answered, reset, or skipped over: opening a higher one closed it,
            # RFC 9113 §5.1.1); its call would wait for ever: refused with STREAM_CLOSED (§5.1)
            self._control(frame(RST_STREAM, 0, sid, _U32.pack(STREAM_CLOSED)))
            return
        self._last_sid = sid
        if (self._goaway_sid is not None and sid > self._goaway_sid) or self._peer_goaway:
            return  # after GOAWAY: not taken; the client retries it elsewhere
        if self._refusing is not None:
            self._refuse(sid)
            return
        if len(self._streams) >= MAX_CONCURRENT_STREAMS:
            self._control(frame(RST_STREAM, 0, sid, _U32.pack(REFUSED_STREAM)))
            return
        stream = _Stream(self, sid, head.route, self._peer_initial_window, head.encoding)
        self._streams[sid] = stream
        stream.remote_closed = end_stream
        stream.caller = head.caller
        stream.traceparent = head.traceparent
        reject = head.reject
        if reject is not None:
            self._reject(stream, reject)
            return
        route = head.route
        assert route is not None
        if head.timeout is not None:
            stream.opened = self._loop.time()
            stream.timer = self._loop.call_later(head.timeout, self._expire, stream)
        if route.kind == _STREAM:
            stream.queue = asyncio.Queue()
            stream.task = self._loop.create_task(self._run_stream(stream, head.timeout))
            if end_stream:
                stream.queue.put_nowait(None)
        elif end_stream:
            self._end_of_input(stream)

    def _decode_head(self, block: bytes) -> _Head:
        decoder = self._decoder
        table = decoder.header_table
        entries = table.dynamic_entries
        count, first, maxsize = len(entries), (entries[0] if entries else None), table.maxsize
        try:
            headers = decoder.decode(block, raw=True)
        except hpack.OversizedHeaderListError:
            raise _H2Error(ENHANCE_YOUR_CALM, "header list far over SETTINGS_MAX_HEADER_LIST_SIZE") from None
        except hpack.HPACKError as exc:
            raise _H2Error(COMPRESSION_ERROR, f"undecodable header block: {exc}") from None
        head = self._server.parse_head(headers)
        # Identical bytes decode to identical headers only while the dynamic table is unchanged: a
        # block that changed it is not cached, and the blocks cached so far may now mean otherwise.
        if len(entries) == count and (entries[0] if entries else None) is first and table.maxsize == maxsize:
            if head.reject is None:
                size = len(block)
                if len(self._heads) >= HEAD_CACHE_SIZE or self._heads_bytes + size > HEAD_CACHE_BYTES:
                    self._heads.clear()
                    self._heads_bytes = 0
                if size <= HEAD_CACHE_BYTES:
                    self._heads[block] = head
                    self._heads_bytes += size
        else:
            self._heads.clear()
            self._heads_bytes = 0
        return head

    # -- gRPC messages ---------------------------------------------------------------------------
    def _feed(self, stream: _Stream, data: bytes, start: int, stop: int) -> None:
        """Split DATA into gRPC messages (5-byte prefix: compressed flag, big-endian length).

        A message over several frames (every request over 16 KiB) is kept as views of the reads
        that brought it and joined once when complete: one copy of its bytes, where appending each
        frame to a growing buffer copied them ~8 times over (a 294 KiB image: 18 frames)."""
        pieces = stream.rbuf
        if pieces is None:
            if stop - start >= 5:
                flag, n = _PREFIX.unpack_from(data, start)
                if n + 5 == stop - start and n <= self._max_message:  # the usual case: one message, one frame
                    self._on_message(stream, flag, data[start + 5 : stop])
                    return
            pieces = stream.rbuf = _Pieces()
        pieces.add(memoryview(data)[start:stop])
        while not stream.finished:
            if pieces.need < 0:
                if pieces.size < 5:
                    return
                flag, n = _PREFIX.unpack_from(pieces.take(5), 0)
                if n > self._max_message:
                    self._respond_error(
                        stream,
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"received message larger than max ({n} vs. {self._max_message} bytes; "
                        "--max-grpc-message-bytes)",
                    )
                    return
                pieces.flag, pieces.need = flag, n
            if pieces.size < pieces.need:
                return
            flag, message = pieces.flag, pieces.take(pieces.need)
            pieces.need = -1
            self._on_message(stream, flag, message)

    def _on_message(self, stream: _Stream, flag: int, message: bytes) -> None:
        if flag:
            try:
                message = self._inflate(stream, message)
            except SluiceError as exc:
                self._respond_error(stream, grpc_code(exc), exc.message)
                return
        route = stream.route
        assert route is not None
        if route.kind == _STREAM:
            assert stream.queue is not None and route.parse is not None
            stream.queue.put_nowait((route.parse(message), stream.held))
            stream.held = 0
        elif stream.message is None:
            stream.message = message
        else:
            self._respond_error(
                stream, grpc.StatusCode.INVALID_ARGUMENT, f"{route.name} takes one request message; a second one came"
            )

    def _inflate(self, stream: _Stream, message: bytes) -> bytes:
        if not stream.wbits:
            raise InvalidArgument("a message is flagged compressed but the call has no grpc-encoding")
        decompressor = zlib.decompressobj(stream.wbits)
        try:
            out = decompressor.decompress(message, self._max_message + 1)
        except zlib.error as exc:
            raise InvalidArgument(f"compressed message does not decompress: {exc}") from None
        if len(out) > self._max_message or decompressor.unconsumed_tail:
            raise PayloadTooLarge(
                f"decompressed message larger than max ({self._max_message} bytes; --max-grpc-message-bytes)"
            )
        if not decompressor.eof:
            raise InvalidArgument("compressed message is truncated")
        if decompressor.unused_data:  # as grpcio: one compressed stream is one message, nothing after it
            raise InvalidArgument(f"compressed message has {len(decompressor.unused_data)} bytes after the end of "
                                  "its compressed data; allowed: one gzip or deflate stream per message")
        return out

    def _end_of_input(self, stream: _Stream) -> None:
        route = stream.route
        assert route is not None
        if stream.rbuf is not None and stream.rbuf.started:
            self._respond_error(
                stream,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request ended inside a gRPC message ({stream.rbuf.received} bytes of it came)",
            )
            return
        if route.kind == _STREAM:
            assert stream.queue is not None
            stream.queue.put_nowait(None)
            return
        message = stream.message
        if message is None:
            self._respond_error(stream, grpc.StatusCode.INVALID_ARGUMENT, f"{route.name} needs a request message")
            return
        stream.message = None
        if route.kind == _INFER:
            self._infer(stream, message)
        else:
            stream.task = self._loop.create_task(self._run_unary(stream, route, message))

    # -- ModelInfer: callbacks, no task ------------------------------------------------------------
    def _infer(self, stream: _Stream, message: bytes) -> None:
        try:
            request = self._decode_infer(message)
            if stream.caller:
                request.caller = stream.caller
            stream.request = request
            done: Callable[[InferResponse | SluiceError], None] = stream.done
            if self._tracing.on:  # tracing.py: sample it, continuing the caller's W3C trace
                done = self._tracing.attach(request, stream.traceparent, done, "grpc")
            self._submit(request, done)
        except SluiceError as exc:
            if stream.request is not None and stream.request.trace is not None:
                done(exc)  # answered through the trace, which records the refusal
                return
            stream.request = None
            self._respond_error(stream, grpc_code(exc), exc.message)
        except Exception:
            log.exception("unhandled error in ModelInfer")
            self._respond_error(stream, grpc.StatusCode.INTERNAL, "internal server error (see server log)")

    def infer_done(self, stream: _Stream, outcome: InferResponse | SluiceError) -> None:
        if stream.finished:
            return
        stream.request = None
        if isinstance(outcome, SluiceError):
            self._respond_error(stream, grpc_code(outcome), outcome.message)
            return
        try:
            payload = self._encode_infer(outcome)  # raises PayloadTooLarge over --max-grpc-message-bytes
        except SluiceError as exc:
            self._respond_error(stream, grpc_code(exc), exc.message)
            return
        except Exception:
            log.exception("unhandled error encoding a ModelInfer response")
            self._respond_error(stream, grpc.StatusCode.INTERNAL, "internal server error (see server log)")
            return
        self._respond(stream, payload)

    def _too_large(self, stream: _Stream, size: int) -> None:
        self._respond_error(stream, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc_service.too_large(size, self._max_message))

    # -- other methods: grpc_service handlers on tasks --------------------------------------------
    async def _run_unary(self, stream: _Stream, route: _Route, message: bytes) -> None:
        request = message if route.parse is None else route.parse(message)
        try:
            deadline = None if stream.timer is None else time.monotonic() + stream.timer.when() - self._loop.time()
            response = await route.handler(request, Call(deadline))
            payload = response if type(response) is bytes else response.SerializeToString()
        except SluiceError as exc:
            self._respond_error(stream, grpc_code(exc), exc.message)
        except asyncio.CancelledError:
            return  # the stream was reset, timed out or its connection lost
        except Exception:
            log.exception("unhandled error in %s", route.name)
            self._respond_error(stream, grpc.StatusCode.INTERNAL, "internal server error (see server log)")
        else:
            if len(payload) > self._max_message:
                self._too_large(stream, len(payload))
            else:
                self._respond(stream, payload)
        finally:
            stream.task = None

    async def _run_stream(self, stream: _Stream, timeout: float | None) -> None:
        """ModelStreamInfer: each message one request, run concurrently, answered as they finish."""
        queue = stream.queue
        assert queue is not None

        async def requests() -> AsyncIterator[Any]:
            while True:
                item = await queue.get()
                if item is None:
                    return
                message, size = item
                self.taken(stream, size)  # its window goes back only now
                yield message

        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            call = Call(deadline, stream.caller, stream.traceparent)
            # the route's handler: the service's model_stream_infer, or in a protocol worker the one that
            # forwards the stream to the engine (the worker's service holds no data plane)
            assert stream.route is not None
            replies = stream.route.handler(requests(), call)
            async with contextlib.aclosing(replies):
                async for reply in replies:
                    if stream.finished:
                        return
                    self._send_message(stream, grpc_service.stream_payload(reply, self._max_message))
                    if stream.pending:
                        # the client's window is full: take no more answers (and so, through the call's
                        # in-flight bound, no more requests) until it reads
                        stream.drained = self._loop.create_future()
                        await stream.drained
            self._finish(stream, TRAILERS_OK)
        except asyncio.CancelledError:
            return
        except Exception:
            log.exception("unhandled error in ModelStreamInfer")
            self._respond_error(stream, grpc.StatusCode.INTERNAL, "internal server error (see server log)")
        finally:
            stream.task = None

    # -- responses -------------------------------------------------------------------------------
    def _respond(self, stream: _Stream, payload: bytes) -> None:
        """A unary answer: HEADERS, the message in DATA, OK trailers; one write when windows allow."""
        if stream.finished:
            return
        n = len(payload)
        total = n + 5
        sid = stream.sid
        if (
            total <= self._send_window
            and total <= stream.send_window
            and total <= self._peer_max_frame
            and not self._table_reset_pending
        ):
            self._send_window -= total
            out = self._out
            # fmt: off
            out.append(_UNARY_HEAD.pack(
                0, len(RESPONSE_HEADERS), HEADERS, END_HEADERS, sid, RESPONSE_HEADERS,
                total >> 16, total & 0xFFFF, DATA, 0, sid, 0, n,
            ))
            # fmt: on
            out.append(payload)
            out.append(_TRAILER.pack(0, len(TRAILERS_OK), HEADERS, END_HEADERS | END_STREAM, sid, TRAILERS_OK))
            self._close_local(stream)
            if not self._flush_scheduled:
                if self._streams:
                    # more calls are open on this connection and likely finish in this same loop
                    # pass (one batch): coalesce their answers into one write
                    self._flush_scheduled = True
                    self._loop.call_soon(self._flush)
                else:
                    self._flush()  # the only call: answer now, not a loop pass later
            return
        self._send_message(stream, payload)
        self._finish(stream, TRAILERS_OK)

    def _send_message(self, stream: _Stream, payload: bytes) -> None:
        if stream.finished:
            return
        if not stream.headers_sent:
            self._emit_headers(stream.sid, RESPONSE_HEADERS, end_stream=False)
            stream.headers_sent = True
        if stream.pending is None:
            stream.pending = deque()
        stream.pending.append(_PREFIX.pack(0, len(payload)))
        stream.pending.append(payload)
        self._pump(stream)

    def _finish(self, stream: _Stream, trailer_block: bytes) -> None:
        """End the stream with trailers, after any DATA still waiting for window."""
        if stream.finished or stream.trailers is not None:
            return
        if not stream.headers_sent:
            stream.headers_sent = True
            trailer_block = RESPONSE_HEADERS + trailer_block  # trailers-only response
        stream.trailers = trailer_block
        self._pump(stream)

    def _respond_error(self, stream: _Stream, code: grpc.StatusCode, message: str) -> None:
        if stream.finished:
            return
        stream.trailers = None  # an error replaces OK trailers still waiting for window
        self._finish(stream, status_block(code, message))

    def _reject(self, stream: _Stream, reject: tuple) -> None:
        kind = reject[0]
        if kind == "grpc":
            self._respond_error(stream, reject[1], reject[2])
        elif kind == "http":
            status, text = reject[1], reject[2]
            block = _literal_indexed_name(8, b"%d" % status) + _literal_indexed_name(31, b"text/plain; charset=utf-8")
            stream.headers_sent = True
            self._emit_headers(stream.sid, block, end_stream=False)
            if stream.pending is None:
                stream.pending = deque()
            stream.pending.append(text.encode())
            stream.trailers = b""  # END_STREAM on an empty DATA frame
            self._pump(stream)
        else:
            self._reset(stream, reject[1])

    def _emit_headers(self, sid: int, block: bytes, end_stream: bool) -> None:
        if self._table_reset_pending:
            self._table_reset_pending = False
            block = _TABLE_SIZE_ZERO + block
        flags = END_STREAM if end_stream else 0
        size = self._peer_max_frame
        if len(block) <= size:
            self._emit(frame(HEADERS, flags | END_HEADERS, sid, block))
            return
        self._emit(frame(HEADERS, flags, sid, block[:size]))
        for offset in range(size, len(block), size):
            last = offset + size >= len(block)
            self._emit(frame(CONTINUATION, END_HEADERS if last else 0, sid, block[offset : offset + size]))

    def _pump(self, stream: _Stream) -> None:
        """Send what the windows allow of the stream's DATA, then its trailers."""
        pending = stream.pending
        sid = stream.sid
        while pending:
            room = min(stream.send_window, self._send_window, self._peer_max_frame)
            if room <= 0:
                self._blocked[sid] = stream
                return
            chunk = pending[0]
            n = len(chunk)
            if n > room:
                view = memoryview(chunk)
                pending[0] = view[room:]
                chunk = view[:room]
                n = room
            else:
                pending.popleft()
            self._emit(_FRAME.pack(n >> 16, n & 0xFFFF, DATA, 0, sid))
            self._emit(chunk)
            stream.send_window -= n
            self._send_window -= n
        self._blocked.pop(sid, None)
        if stream.drained is not None:
            drained, stream.drained = stream.drained, None
            if not drained.done():
                drained.set_result(None)
        trailers = stream.trailers
        if trailers is not None and not stream.finished:
            if trailers:
                self._emit_headers(sid, trailers, end_stream=True)
            else:
                self._emit(frame(DATA, END_STREAM, sid))
            self._close_local(stream)

    def _close_local(self, stream: _Stream) -> None:
        """Our side of the stream is done: forget it (and ask the client to stop if it still sends)."""
        stream.finished = True
        if self._reset_debt:
            self._reset_debt -= 1  # an answered call pays for one reset
        if stream.owed:
            self._release(stream)
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None
        task = stream.task
        if task is not None and task is not asyncio.current_task():
            task.cancel()  # a stream answered from the reading side (an error): its handler stops
        if not stream.remote_closed:
            self._emit(frame(RST_STREAM, 0, stream.sid, _U32.pack(NO_ERROR)))
        self._blocked.pop(stream.sid, None)
        if self._streams.pop(stream.sid, None) is not None:
            self._after_stream_closed()

    def _after_stream_closed(self) -> None:
        if not self._streams and (self._goaway_sid is not None or self._peer_goaway):
            self._emit(b"")  # the flush closes the connection once written

    def _reset(self, stream: _Stream, code: int) -> None:
        self._emit(frame(RST_STREAM, 0, stream.sid, _U32.pack(code)))
        self._streams.pop(stream.sid, None)
        self._abandon(stream)
        self._after_stream_closed()

    def _reset_sid(self, sid: int, code: int) -> None:
        stream = self._streams.get(sid)
        if stream is not None:
            self._reset(stream, code)
        else:
            self._emit(frame(RST_STREAM, 0, sid, _U32.pack(code)))

    def _abandon(self, stream: _Stream) -> None:
        """The client is gone from this stream: cancel its work, send nothing more."""
        stream.finished = True
        if stream.owed:
            self._release(stream)
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None
        if stream.request is not None:
            request, stream.request = stream.request, None
            request.cancel.cancel()
        if stream.task is not None:
            stream.task.cancel()
        self._blocked.pop(stream.sid, None)

    def _expire(self, stream: _Stream) -> None:
        """grpc-timeout reached: cancel the work and answer DEADLINE_EXCEEDED."""
        stream.timer = None
        if stream.finished:
            return
        request, task = stream.request, stream.task
        stream.request = stream.task = None
        self._respond_error(stream, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        if request is not None:
            request.cancel.cancel()
        if task is not None:
            task.cancel()


class GrpcServer(Listener):
    """The listening socket, its connections, and the routes of GRPCInferenceService."""

    def __init__(
        self, dataplane: DataPlane, limits: Limits, loop: asyncio.AbstractEventLoop, service: Service | None = None
    ) -> None:
        """``service``: the method table to serve (a protocol worker's forwards most methods to the
        engine); None: ``Service(dataplane, limits)``."""
        super().__init__(loop, Crowding("gRPC", log, limits.max_connections))
        self.dataplane = dataplane
        self.limits = limits
        self.service = service if service is not None else Service(dataplane, limits)
        self.routes = {method.path.encode(): _Route(method) for method in self.service.methods.values()}

    def make_connection(self) -> GrpcConnection:
        return GrpcConnection(self)

    def on_stop(self, connection: GrpcConnection) -> None:  # type: ignore[override]
        connection.goaway()  # no new streams; the open calls go on

    def parse_head(self, headers: Iterable[tuple[bytes, bytes]]) -> _Head:
        """Check a decoded request header list and resolve its route (pure; the result is cached)."""
        pseudo: dict[bytes, bytes] = {}
        regular = False
        content_type = timeout_value = encoding = caller = traceparent = None
        size = 0
        for name, value in headers:
            size += len(name) + len(value) + 32
            if name[:1] == b":":
                if regular or name in pseudo or name not in (b":method", b":path", b":scheme", b":authority"):
                    return _malformed(f"bad pseudo-header {name!r}")
                pseudo[name] = value
                continue
            regular = True
            if name != name.lower() or name in _CONNECTION_SPECIFIC or (name == b"te" and value != b"trailers"):
                return _malformed(f"header {name!r} is not allowed in HTTP/2")
            if name == b"content-type":
                content_type = value
            elif name == b"grpc-timeout":
                timeout_value = value
            elif name == b"grpc-encoding":
                encoding = value
            elif name == b"sluice-caller":
                caller = value
            elif name == b"traceparent":
                traceparent = value
        if size > self.limits.max_header_bytes:
            return _grpc_reject(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request headers are {size} bytes, over the {self.limits.max_header_bytes}-byte limit "
                "(--max-header-bytes)",
            )
        method, path = pseudo.get(b":method"), pseudo.get(b":path")
        if method is None or path is None or b":scheme" not in pseudo:
            return _malformed("a request needs :method, :scheme and :path")
        if method != b"POST":
            return _Head(reject=("http", 405, f"gRPC calls use POST, not {_echo(method)}"))
        if (
            content_type is None
            or not content_type.startswith(b"application/grpc")
            or content_type[16:17] not in (b"", b"+", b";")
        ):
            shown = "none" if content_type is None else repr(_echo(content_type))
            return _Head(reject=("http", 415, f"content-type must be application/grpc, got {shown}"))
        route = self.routes.get(path)
        if route is None:
            return _grpc_reject(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {_echo(path)}")
        if route.kind == _UNIMPLEMENTED:
            return _grpc_reject(grpc.StatusCode.UNIMPLEMENTED, grpc_service.unimplemented_message(route.name))
        timeout = None
        if timeout_value is not None:
            timeout = parse_timeout(timeout_value)
            if timeout is None:
                return _grpc_reject(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"grpc-timeout {_echo(timeout_value)!r} is malformed; "
                    "expected up to 8 digits and a unit H, M, S, m, u or n",
                )
        wbits = 0
        if encoding is not None and encoding != b"identity":
            wbits = _ENCODINGS.get(encoding, 0)
            if not wbits:
                return _grpc_reject(
                    grpc.StatusCode.UNIMPLEMENTED,
                    f"grpc-encoding {_echo(encoding)!r} is not supported; use identity, gzip or deflate",
                )
        if caller:
            try:
                checked = callers.checked(caller.decode("latin-1"), f"metadata {callers.METADATA_KEY}")
            except InvalidArgument as exc:
                return _grpc_reject(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
            return _Head(route, timeout, wbits, caller=checked, traceparent=traceparent)
        return _Head(route, timeout, wbits, traceparent=traceparent)
