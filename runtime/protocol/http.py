"""HTTP/1.1 front end: an asyncio protocol on httptools, the KServe V2 routes, and the limits.

Why not an ASGI framework: the request path here is the product. A bare protocol avoids the ASGI
scope/receive/send layers and their per-request allocations (see docs/performance.md for the
measurements that chose it). What a framework would give is written out here: keep-alive,
pipelining (answered in order), request-head and body limits, slow-client and idle timeouts (one
sweeper per server, no timer per request), and cancellation of queued work when a client goes away.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import json
import logging
import zlib
from collections import deque
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any, NoReturn
from urllib.parse import unquote

import httptools

from sluice.runtime import shm
from sluice.runtime.callers import caller_from_header
from sluice.runtime.dataplane import DataPlane
from sluice.runtime.errors import InvalidArgument, NotFound, PayloadTooLarge, SluiceError, Unavailable
from sluice.runtime.protocol import http_codec
from sluice.runtime.protocol.http_plan import InferCodec
from sluice.runtime.protocol.listener import Crowding, Listener
from sluice.runtime.settings import Limits
from sluice.runtime.signature import signature_of
from sluice.runtime.types import InferRequest, InferResponse

log = logging.getLogger("sluice.runtime.http")

_REASONS = {s.value: s.phrase for s in HTTPStatus}
_REASONS[499] = "Client Closed Request"
_JSON = b"application/json"
_OCTETS = b"application/octet-stream"
_IDLE, _HEAD, _BODY, _BUSY = 0, 1, 2, 3
_MAX_READ = 256 * 1024
"""The most one read returns (uvloop's and asyncio's read buffer): a head counts at most this past its limit."""
_BURST = 64  # pipelined requests answered per read or turn before other connections get the loop


def origin_form(target: bytes) -> bytes:
    """The path and query of an absolute-form request target (``http://host:8000/v2?x``, which
    RFC 9112 section 3.2.2 asks a server to accept); any other target as it came."""
    scheme, sep, rest = target.partition(b"://")
    if not sep or scheme.lower() not in (b"http", b"https"):
        return target
    ends = [i for i in (rest.find(b"/"), rest.find(b"?")) if i >= 0]
    if not ends:
        return b"/"
    path = rest[min(ends) :]
    return path if path.startswith(b"/") else b"/" + path


KEEP_ALIVE_ANNOUNCED = 2
"""``Request.keep_alive`` of an HTTP/1.0 request that asked to keep the connection: the answer says
``connection: keep-alive``, without which an HTTP/1.0 client (ApacheBench ``-k``) closes it."""


_SECTIONS = (b"", b"health", b"models", b"repository", b"systemsharedmemory", b"cudasharedmemory", b"logging",
             b"trace")
"""The first path parts under /v2 the router serves (:meth:`check_head` refuses the others before a body)."""

class Request:
    __slots__ = ("body", "conn", "headers", "keep_alive", "method", "path", "query")

    def __init__(self, conn: Connection, method: bytes, url: bytes, headers: dict[bytes, bytes], body: bytes):
        self.conn = conn
        self.method = method
        path, _, query = url.partition(b"?")
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body
        self.keep_alive: bool | int = True  # or KEEP_ALIVE_ANNOUNCED


class Response:
    __slots__ = ("body", "content_type", "extra", "status")

    def __init__(
        self,
        status: int,
        body: bytes = b"",
        content_type: bytes = _JSON,
        extra: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        self.status = status
        self.body = body
        self.content_type = content_type
        self.extra = extra


def json_response(value: Any, status: int = 200) -> Response:
    return Response(status, json.dumps(value, separators=(",", ":")).encode())


async def answer_of(request: Request, pending: Awaitable[Response]) -> Response | None:
    """The response ``pending`` resolves to: a SluiceError as its status, any other exception as a
    500 (logged with the path); None when it was cancelled (the client went away: nothing to send)."""
    try:
        return await pending
    except SluiceError as exc:
        return error_response(exc)
    except asyncio.CancelledError:
        return None
    except Exception:
        log.exception("unhandled error on %s", request.path)
        return json_response({"error": "internal server error (see server log)"}, 500)


def error_response(exc: SluiceError) -> Response:
    return json_response({"error": exc.message}, exc.http_status)


def _head_too_large(limit: int) -> Response:
    error = PayloadTooLarge(f"request head is over {limit} bytes (--max-header-bytes)")
    error.http_status = 431
    return error_response(error)


def _timed_out(part: str, flag: str) -> Response:
    return json_response({"error": f"request {part} not received in time ({flag})"}, 408)


DEFERRED = object()
"""A route returns this when it will answer later through ``Connection.complete``."""

Handler = Callable[[Request], "Response | Awaitable[Response] | object"]


class Connection(asyncio.Protocol):
    """One client connection; requests are answered in the order they arrived."""

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._limits = server.limits
        self._max_head = server.limits.max_header_bytes
        self._loop = server.loop
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._head_bytes = 0
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._header_name = b""
        self._pending: deque[Request] = deque()
        self._current: asyncio.Task | None = None
        self._current_request: Request | None = None
        self._closed = False
        self._write_paused = False
        self._burst = 0
        self._in_drain = False
        self._refusal: Response | None = None  # the answer when the parser is stopped on purpose
        self._owe_continue = False  # a 100 Continue waits for the responses before it to be written
        self._upgrade_owed = 0  # body bytes of an upgrade request, which the parser leaves to us (-1: none)
        self._upgrade_request: Request | None = None  # that request, until its body is read
        self._upgraded = False  # an upgrade request was read: what follows on the wire is not HTTP/1.1
        self._head_raw = 0  # bytes read since a request head's first read (a field line may not end)
        self._parsing: int | None = None  # _HEAD or _BODY while a request is being read, since...
        self._parse_since = 0.0  # ...this time (its timeouts apply even while an earlier one is answered)
        self._final: Response | None = None  # an error answer owed after the answers before it
        self._ended = False  # no more requests are read on this connection
        self.phase = _IDLE
        self.since = self._loop.time()
        self.inflight: InferRequest | None = None  # cancelled if the client goes away

    # -- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._server.connections.add(self)
        if len(self._server.connections) > self._limits.max_connections:
            crowding = self._server.crowding
            self._write_simple(503, crowding.refusal.encode(), close=True)
            crowding.refuse()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        server = self._server
        server.connections.discard(self)
        if server.crowding.refused:  # (checked here: this runs for every connection)
            server.crowding.closed(len(server.connections))
        if self.inflight is not None:
            self.inflight.cancel.cancel()
            self.inflight = None
        if self._current is not None and not self._current.done():
            self._current.cancel()
        self._pending.clear()
        # Break the cycles (parser <-> connection, request <-> connection) so the last request and
        # its body go with the connection, not at the next full collection, which `serve` makes rare.
        self._current_request = None
        self._upgrade_request = None
        self._body = []
        self._headers = {}
        self._parser = None  # type: ignore[assignment]

    def pause_writing(self) -> None:
        # the client is not reading its responses: read no more of its requests until it catches up
        self._write_paused = True
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._transport is not None and not self._closed and not self._ended and len(self._pending) <= 32:
            self._transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self._closed or self._ended:
            return
        if self._upgraded:
            if self._upgrade_request is not None:
                self._take_upgrade_body(data)
            return  # the rest is the other protocol: never parsed as requests
        if self._parsing == _HEAD:
            # httptools joins a field line's pieces until it ends, unchecked: count what comes instead
            self._head_raw += len(data)
            if self._head_raw > self._max_head + _MAX_READ:
                self._end_with(_head_too_large(self._limits.max_header_bytes))
                return
        self._burst = 0
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            # The upgrade request is answered by its route as plain HTTP/1.1 (CONNECT: 405); what follows
            # it on the wire is another protocol: close once it is answered (now, unless it waits for a
            # model or a protocol worker's engine, or behind earlier pipelined requests).
            self._upgraded = True
            if self._upgrade_request is not None:  # its body follows the head: read it first
                self._take_upgrade_body(data[exc.args[0] if exc.args else len(data) :])
                return
            latest = self._pending[-1] if self._pending else self._current_request
            if latest is None:
                self.close()
            else:
                latest.keep_alive = False
                if self._transport is not None:
                    self._transport.pause_reading()
        except httptools.HttpParserError as exc:
            refusal, self._refusal = self._refusal, None
            latest = self._pending[-1] if self._pending else self._current_request
            if refusal is None and latest is not None and not latest.keep_alive:
                # bytes after a request that ends the connection (Connection: close) are not read as
                # requests (RFC 9112 §9.6); the answers owed still go out
                self._ended = True
                if self._transport is not None:
                    self._transport.pause_reading()
            else:
                self._end_with(refusal or json_response({"error": f"malformed HTTP request: {exc}"}, 400))
        if self._pending and self._current_request is None and not self._closed:
            self._loop.call_soon(self._drain_pending)  # requests held back by the burst limit

    # -- httptools callbacks -----------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._head_bytes = 0
        self._body = []
        self._body_bytes = 0
        self._head_raw = 0
        self._parsing = _HEAD
        self._parse_since = self._loop.time()
        if self.phase == _IDLE:
            self.phase = _HEAD
            self.since = self._loop.time()

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.lower()
        self._head_bytes += len(name) + len(value) + 4
        if self._parsing != _HEAD:  # a chunked body's trailer: counted, never a header (RFC 9110 §6.5.1)
            if self._head_bytes > self._max_head:
                self._count_head(0)
            return
        value = value.rstrip(b" \t")  # a field value has no trailing whitespace (RFC 9110 §5.5)
        if key == b"transfer-encoding" and key in self._headers:  # codings listed over several lines
            value = self._headers[key] + b", " + value  # bounded: the head limit counts each line once
        self._headers[key] = value
        if self._head_bytes > self._max_head:
            self._count_head(0)

    def _count_head(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self._limits.max_header_bytes:
            self._refuse(_head_too_large(self._limits.max_header_bytes))

    def on_headers_complete(self) -> None:
        self._parsing = _BODY
        self._parse_since = self._loop.time()
        if self._url[:1] != b"/":
            self._url = origin_form(self._url)
        coding = self._headers.get(b"transfer-encoding")
        if coding is not None and coding.lower() != b"chunked":
            self._check_transfer_coding(coding)
        length = self._headers.get(b"content-length")
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                size = -1
            if size > self._limits.max_body_bytes:
                self._refuse(
                    error_response(
                        PayloadTooLarge(
                            f"request body is {size} bytes, over the {self._limits.max_body_bytes}-byte limit "
                            "(--max-body-bytes)"
                        )
                    )
                )
        if b"upgrade" in self._headers:
            self._upgrade_with_body(coding, length)
        if self.phase == _HEAD:
            self.phase = _BODY
            self.since = self._loop.time()
        expect = self._headers.get(b"expect")
        if expect is not None and self._parser.get_http_version() != "1.0":  # 1.0 clients: ignore it (RFC 9110)
            self._expect(expect, length)

    def _upgrade_with_body(self, coding: bytes | None, length: bytes | None) -> None:
        """A request asking to upgrade (``curl --http2`` sends ``Upgrade: h2c``) is served as HTTP/1.1;
        the parser stops at its head, so a body it declares is read by :meth:`_take_upgrade_body`."""
        if not self._parser.should_upgrade():
            return  # no upgrade asked (Connection: upgrade, on any of its lines): the parser reads the body
        if coding is not None:
            message = "a request that asks to upgrade (Upgrade) cannot have a chunked body; allowed: Content-Length"
            self._refuse(json_response({"error": message}, 400))
        size = int(length) if length is not None and length.strip().isdigit() else 0
        self._upgrade_owed = size if size > 0 else -1  # -1: no body, answered and closed all the same

    def _take_upgrade_body(self, data: bytes) -> None:
        request = self._upgrade_request
        assert request is not None
        self._body.append(data)
        self._body_bytes += len(data)
        if self._body_bytes < self._upgrade_owed:
            return
        request.body = b"".join(self._body)[: self._upgrade_owed]  # what follows is another protocol
        request.keep_alive = False
        self._upgrade_request = None
        self._upgrade_owed = 0
        self._owe_continue = False  # the body came
        self._body = []
        if self._transport is not None:
            self._transport.pause_reading()
        self._burst = 0
        self._accept(request)
        if self._pending and self._current_request is None and not self._closed:
            self._loop.call_soon(self._drain_pending)

    def _check_transfer_coding(self, coding: bytes) -> None:
        """The parser undoes ``chunked`` only: a body under any other transfer coding (``gzip,
        chunked``) would be read as if it had none, so it is refused (501, as RFC 9112 asks)."""
        codings = [c.strip() for c in coding.lower().split(b",") if c.strip()]
        if codings != [b"chunked"]:
            shown = coding[:64].decode(errors="replace")
            message = (
                f"unsupported Transfer-Encoding {shown!r}; allowed: chunked "
                "(a compressed body goes with Content-Encoding: gzip or deflate)"
            )
            self._refuse(json_response({"error": message}, 501))

    def _expect(self, expect: bytes, length: bytes | None) -> None:
        """Answer ``Expect``: a request its head already fails gets its final answer now (and the
        connection closes: the client does not send the body); an acceptable one gets 100 Continue."""
        if expect.lower() != b"100-continue":
            message = f"unsupported Expect {expect[:64].decode(errors='replace')!r}; allowed: 100-continue"
            self._refuse(json_response({"error": message}, 417))
        if self._server.check_head is not None:
            refusal = self._server.check_head(self._parser.get_method(), self._url)
            if refusal is not None:
                self._refuse(refusal)
        if length is not None and length.strip() == b"0":
            return  # no body to wait for
        if self._current_request is None and not self._pending:
            self._write_continue()
        else:
            self._owe_continue = True  # pipelined: after the responses still owed, in order

    def _write_continue(self) -> None:
        self._owe_continue = False
        if self._transport is not None and not self._closed:
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.since = self._parse_since = self._loop.time()  # the body's timeout starts now

    def _refuse(self, response: Response) -> NoReturn:
        """Stop parsing; ``data_received`` answers ``response`` and closes the connection."""
        self._refusal = response
        raise httptools.HttpParserError("request refused")

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self._limits.max_body_bytes:
            limit = self._limits.max_body_bytes
            error = PayloadTooLarge(f"request body is over the {limit}-byte limit (--max-body-bytes)")
            self._refuse(error_response(error))
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._parsing = None
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = Request(self, self._parser.get_method(), self._url, self._headers, body)
        request.keep_alive = self._parser.should_keep_alive()
        if request.keep_alive and (b"connection" in self._headers or b"proxy-connection" in self._headers):
            self._keep_alive_1_0(request)
        if b"transfer-encoding" in self._headers and self._parser.get_http_version() == "1.0":
            request.keep_alive = False  # RFC 9112 6.1: HTTP/1.0 framing with a transfer coding is suspect
        if self._upgrade_owed:
            request.keep_alive = False  # what follows it on the wire is another protocol
            if self._upgrade_owed > 0:
                self._upgrade_request = request  # answered once data_received has its body (a 100 it is
                self._body = []  # owed still goes out after the answers before it)
                self._body_bytes = 0
                return
            self._upgrade_owed = 0
        self._owe_continue = False  # the body came without it
        self._accept(request)

    def _accept(self, request: Request) -> None:
        self._burst += 1
        if self._current_request is None and self._burst <= _BURST:
            self._dispatch(request)
        else:
            self._pending.append(request)
            if len(self._pending) > 32 and self._transport is not None:
                self._transport.pause_reading()

    def _keep_alive_1_0(self, request: Request) -> None:
        """An HTTP/1.0 request kept alive (``Connection`` or ``Proxy-Connection: keep-alive``, which
        httptools honours even beside ``close``) is announced, unless it also says ``close``."""
        if self._parser.get_http_version() != "1.0":
            return
        tokens = b",".join(self._headers.get(name, b"") for name in (b"connection", b"proxy-connection"))
        if b"close" in (token.strip() for token in tokens.lower().split(b",")):
            request.keep_alive = False
        else:
            request.keep_alive = KEEP_ALIVE_ANNOUNCED

    # -- dispatch --------------------------------------------------------------------------------
    def _dispatch(self, request: Request) -> None:
        self.phase = _BUSY
        self._current_request = request
        try:
            result = self._server.route(request)
        except SluiceError as exc:
            result = error_response(exc)
        except Exception:
            log.exception("unhandled error on %s", request.path)
            result = json_response({"error": "internal server error (see server log)"}, 500)
        if isinstance(result, Response):
            self._respond(request, result)
        elif result is not DEFERRED:
            self._current = self._loop.create_task(self._await(request, result))

    def complete(self, request: Request, response: Response) -> None:
        """Answer a request whose route returned DEFERRED (called on the event loop)."""
        self.inflight = None
        self._respond(request, response)

    async def _await(self, request: Request, pending: Awaitable[Response]) -> None:
        response = await answer_of(request, pending)
        if response is None:
            return
        self._current = None
        self._respond(request, response)

    def _respond(self, request: Request, response: Response) -> None:
        if self._closed or self._transport is None:
            return
        close = not request.keep_alive or self._server.draining
        announce = not close and request.keep_alive == KEEP_ALIVE_ANNOUNCED
        self._write(response, close, head_only=request.method == b"HEAD", announce=announce)
        self._current_request = None
        if close:
            return
        if self._pending:
            if not self._in_drain:
                self._drain_pending()
        else:
            self._answered_all()

    def _drain_pending(self) -> None:
        """Answer pipelined requests in order: a loop, not recursion through ``_respond``, and at
        most ``_BURST`` before other connections get a turn."""
        if self._in_drain:
            return
        self._in_drain = True
        try:
            handled = 0
            while self._pending and self._current_request is None and not self._closed:
                if handled >= _BURST:
                    self._loop.call_soon(self._drain_pending)
                    return
                self._dispatch(self._pending.popleft())
                handled += 1
        finally:
            self._in_drain = False
        if not self._pending and self._current_request is None:
            self._answered_all()
        if (
            self._transport is not None
            and len(self._pending) <= 32
            and not self._write_paused
            and not self._closed
            and not self._ended
        ):
            self._transport.resume_reading()

    def _answered_all(self) -> None:
        """Every request read so far is answered: an error owed after them goes now; else the
        connection waits for the next request (or for the rest of one being read, under its timeout)."""
        if self._final is not None:
            final, self._final = self._final, None
            self._write(final, close=True)
            return
        if self._upgrade_request is not None:
            self.phase, self.since = _BODY, self._loop.time()
        elif self._parsing is not None:
            self.phase, self.since = self._parsing, self._parse_since
        else:
            self.phase, self.since = _IDLE, self._loop.time()
        if self._owe_continue:
            self._write_continue()

    def _end_with(self, response: Response) -> None:
        """Read no more requests; answer ``response`` once the requests before it are answered (in order,
        RFC 9112 §9.3.2), then close."""
        self._ended = True
        if self._transport is not None:
            self._transport.pause_reading()
        if self._current_request is None and not self._pending:
            if self._transport is not None and not self._closed:
                self._write(response, close=True)
        else:
            self._final = response

    def _write(self, response: Response, close: bool, head_only: bool = False, announce: bool = False) -> None:
        """Send ``response``; ``head_only`` (a HEAD request) sends its headers, Content-Length
        included, but not its body: a body would be read as the start of the next response."""
        assert self._transport is not None
        status = response.status
        head = [
            b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n"
            % (status, _REASONS.get(status, "Unknown").encode(), response.content_type, len(response.body))
        ]
        if response.extra:
            head.extend(b"%s: %s\r\n" % pair for pair in response.extra)
        if close:
            head.append(b"connection: close\r\n")
        elif announce:
            head.append(b"connection: keep-alive\r\n")
        head.append(b"\r\n")
        if not head_only:
            head.append(response.body)
        self._transport.write(b"".join(head))
        if close:
            self._closed = True
            self.since = self._loop.time()
            self._transport.close()

    def _write_simple(self, status: int, message: bytes, close: bool) -> None:
        if self._transport is None or self._closed:
            return
        self._write(json_response({"error": message.decode()}, status), close)

    # -- sweeper hooks -----------------------------------------------------------------------
    def expire(self, now: float) -> None:
        limits = self._limits
        if self._closed:
            # closed by us, but the client does not read what is left to send: drop it and its buffer
            if now - self.since > limits.idle_timeout_s and self._transport is not None:
                self._transport.abort()
        elif self._ended:
            return  # its last answer waits for the ones before it
        elif self.phase == _IDLE and now - self.since > limits.idle_timeout_s:
            self.close()
        elif self.phase == _HEAD and now - self.since > limits.header_timeout_s:
            self._end_with(_timed_out("head", "--header-timeout-s"))
        elif self.phase == _BODY and now - self.since > limits.body_timeout_s:
            self._end_with(_timed_out("body", "--body-timeout-s"))
        elif self.phase == _BUSY and self._parsing is not None and not self._owe_continue:
            # (a body owed a 100 Continue is not sent before it: its timeout starts with the 100)
            # the next request is being read while earlier ones are answered: its own timeouts apply
            head = self._parsing == _HEAD
            if now - self._parse_since > (limits.header_timeout_s if head else limits.body_timeout_s):
                timed_out = _timed_out("head", "--header-timeout-s") if head else _timed_out("body", "--body-timeout-s")
                self._end_with(timed_out)

    def close(self) -> None:
        if self._transport is not None and not self._closed:
            self._closed = True
            self.since = self._loop.time()
            self._transport.close()

    def abort(self) -> None:
        """Drop the connection and whatever it still had to send (a peer that stopped reading)."""
        if self._transport is not None:
            self._transport.abort()

    @property
    def busy(self) -> bool:
        return self._current_request is not None or bool(self._pending)


class HttpServer(Listener):
    """A listening socket, its HTTP/1.1 connections and a router."""

    def __init__(self, router: Callable[[Request], Any], limits: Limits, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop, Crowding("HTTP", log, limits.max_connections))
        self.route = router
        self.limits = limits
        # ``check_head(method, url)``: the answer a request gets whatever its body, or None (optional)
        self.check_head: Callable[[bytes, bytes], Response | None] | None = getattr(router, "check_head", None)

    def make_connection(self) -> Connection:
        return Connection(self)


# -- KServe V2 routes ---------------------------------------------------------------------------


def _decode_body(request: Request, limits: Limits) -> bytes:
    encoding = request.headers.get(b"content-encoding", b"identity").lower()
    if encoding in (b"identity", b""):
        return request.body
    if encoding == b"x-gzip":  # RFC 9110 §8.4.1.3: the same as gzip
        encoding = b"gzip"
    if encoding not in (b"gzip", b"deflate"):
        raise InvalidArgument(
            f"unsupported Content-Encoding {encoding[:64].decode(errors='replace')!r}; allowed: gzip, deflate"
        )
    wbits = 31 if encoding == b"gzip" else 15
    name = encoding.decode()
    view = memoryview(request.body)
    parts: list[bytes] = []
    size = members = 0
    decompressor = zlib.decompressobj(wbits)
    started = False  # the current member has had input
    # Fed in bounded pieces, so what is left after a member (zlib copies it out) stays small: a body
    # of many tiny members costs linear time, not quadratic.
    for offset in range(0, len(view), _INFLATE_PIECE):
        data: bytes | memoryview = view[offset : offset + _INFLATE_PIECE]
        while data:
            if decompressor.eof:  # the member before ended: a gzip body may hold several (RFC 1952 §2.2)
                if wbits != 31:
                    raise InvalidArgument(f"request body has bytes after the end of its {name} data; allowed: "
                                          "one deflate stream and nothing after it")
                members += 1
                if members >= _MAX_GZIP_MEMBERS:
                    raise InvalidArgument(f"request body has more than {_MAX_GZIP_MEMBERS} gzip members; allowed: "
                                          f"up to {_MAX_GZIP_MEMBERS}, one after another")
                decompressor = zlib.decompressobj(wbits)
            try:
                out = decompressor.decompress(data, limits.max_body_bytes - size + 1)
            except zlib.error as exc:
                what = (f"has bytes after its last gzip member that are not gzip data ({exc}); allowed: whole "
                        "gzip members one after another, nothing after the last" if members
                        else f"is not valid {name} data: {exc}")
                raise InvalidArgument(f"request body {what}") from None
            started = True
            size += len(out)
            if size > limits.max_body_bytes or decompressor.unconsumed_tail:
                raise PayloadTooLarge(f"decompressed request body is over the {limits.max_body_bytes}-byte limit")
            parts.append(out)
            data = decompressor.unused_data if decompressor.eof else b""
    if not started or not decompressor.eof:
        if members:
            raise InvalidArgument("request body has bytes after its last gzip member that are not a whole gzip "
                                  "member; allowed: whole gzip members one after another, nothing after the last")
        raise InvalidArgument(f"request body is truncated {name} data: the compressed stream does not end")
    return parts[0] if len(parts) == 1 else b"".join(parts)


_INFLATE_PIECE = 1 << 16
_MAX_GZIP_MEMBERS = 1024
"""Members of one gzip request body (``cat`` of a few files has a few; many tiny ones only cost time)."""


def _encoded(encoded: tuple[bytes, int | None]) -> Response:
    body, header_length = encoded
    if header_length is None:
        return Response(200, body)
    return Response(200, body, _OCTETS, [(b"inference-header-content-length", b"%d" % header_length)])


def _encode_failure(exc: BaseException, name: str) -> Response:
    if isinstance(exc, SluiceError):
        return error_response(exc)
    # e.g. a model output numpy cannot serialize: answer, never hang
    log.error("cannot encode the response of model '%s'", name, exc_info=exc)
    return json_response({"error": "internal error encoding the response (see the server log)"}, 500)


def _encode_off_loop(
    request: InferRequest, outcome: InferResponse, name: str, respond: Callable[[Response], None]
) -> None:
    """Encode a large JSON response on a worker thread (called on the loop, ``respond`` back on it),
    with the plain codec: the header cache is the event loop's alone."""

    def encoded(future: asyncio.Future[tuple[bytes, int | None]]) -> None:
        exc = future.exception()
        respond(_encode_failure(exc, name) if exc is not None else _encoded(future.result()))

    future = asyncio.get_running_loop().run_in_executor(None, http_codec.encode_infer, request, outcome)
    future.add_done_callback(encoded)


_VARY = (b"vary", b"accept-encoding")


def _compressing(
    respond: Callable[[Response], None], coding: bytes, offload: int, name: str
) -> Callable[[Response], None]:
    """``respond`` for a client that accepts ``coding``: a successful answer of COMPRESS_MIN_BYTES or
    more goes compressed (on a worker thread from ``offload`` bytes on, so one large answer does not
    stall the loop); shorter ones and errors go as they are."""

    def compressed(response: Response) -> None:
        if response.status != 200:
            respond(response)
            return
        if len(response.body) < http_codec.COMPRESS_MIN_BYTES or not http_codec.worth_compressing(
            response.body, _header_length(response)
        ):
            respond(Response(200, response.body, response.content_type, [*(response.extra or ()), _VARY]))
            return
        extra = [*(response.extra or ()), (b"content-encoding", coding), _VARY]
        if len(response.body) < offload:
            respond(Response(200, http_codec.compress(response.body, coding), response.content_type, extra))
            return

        def done(future: asyncio.Future[bytes]) -> None:
            exc = future.exception()
            if exc is not None:
                respond(_encode_failure(exc, name))  # logged with the model's name
            else:
                respond(Response(200, future.result(), response.content_type, extra))

        future = asyncio.get_running_loop().run_in_executor(None, http_codec.compress, response.body, coding)
        future.add_done_callback(done)

    return compressed


def _header_length(response: Response) -> int | None:
    """The JSON header's length of an answer with binary tensor data (None: all JSON)."""
    for name, value in response.extra or ():
        if name == b"inference-header-content-length":
            return int(value)
    return None


def _large_json(request: Request, header_length: int | None, threshold: int) -> bool:
    """Whether decoding this infer body is worth a worker thread: its JSON part is over ``threshold``
    bytes, or it is compressed (its size unknown until inflated) and not tiny."""
    body = len(request.body)
    if request.headers.get(b"content-encoding", b"identity").lower() not in (b"identity", b""):
        return body >= 4096
    return (body if header_length is None else header_length) >= threshold


class V2Routes:
    """Maps V2 paths to the data plane."""

    def __init__(self, dataplane: DataPlane, limits: Limits) -> None:
        self.dp = dataplane
        self.limits = limits
        self.codec = InferCodec(limits)
        self.tracing = dataplane.tracing
        self._infer_paths: dict[bytes, tuple[str, str]] = {}
        self._codings: dict[bytes, bytes | None] = {}  # Accept-Encoding header -> the coding it takes

    def __call__(self, request: Request) -> Response | Awaitable[Response] | object:
        if request.method == b"CONNECT":
            return json_response({"error": "CONNECT is not supported: this is an inference server, not a proxy"}, 405)
        if request.method == b"POST":
            target = self._infer_paths.get(request.path)
            if target is not None:
                return self._infer(request, *target)
        parts = request.path.split(b"/")
        # parts[0] is "" (leading slash)
        if len(parts) < 2 or parts[1] != b"v2":
            raise NotFound(f"no route for {request.path.decode(errors='replace')}; the API lives under /v2")
        method = request.method
        n = len(parts)
        if n == 2 or (n == 3 and parts[2] == b""):
            return self._get(method, lambda: json_response(self.dp.server_metadata()))
        section = parts[2]
        if section == b"health" and n == 4:
            if parts[3] == b"live":
                return self._get(method, lambda: Response(200 if self.dp.live() else 503))
            if parts[3] == b"ready":
                return self._get(method, lambda: Response(200) if self.dp.ready() else _not_ready("server"))
        if section == b"models":
            return self._models(request, parts[3:])
        if section == b"repository":
            return self._repository(request, parts[3:])
        if section == b"systemsharedmemory":
            return self._shared_memory(request, parts[3:], shm.SYSTEM)
        if section == b"trace" and parts[3:] == [b"setting"]:
            return self._trace_setting(request, "")
        if section == b"cudasharedmemory":
            return self._shared_memory(request, parts[3:], shm.CUDA)
        if section == b"logging" and n == 3:
            return self._logging(request)
        raise NotFound(f"no route for {request.path.decode(errors='replace')}")

    @staticmethod
    def _get(method: bytes, make: Callable[[], Response]) -> Response:
        if method not in (b"GET", b"HEAD"):
            return json_response({"error": f"method {method.decode()} not allowed here; use GET"}, 405)
        return make()

    def _models(self, request: Request, rest: list[bytes]) -> Response | Awaitable[Response] | object:
        if not rest or rest == [b""]:
            raise NotFound("a model name is needed: /v2/models/<name>")
        if rest == [b"stats"]:
            return self._get(request.method, lambda: json_response({"model_stats": self.dp.model_statistics()}))
        name, version, tail = _model_path(rest)
        if not tail:
            return self._get(request.method, lambda: json_response(self.dp.model_metadata(name, version)))
        if len(tail) == 1:
            action = tail[0]
            if action == b"infer":
                if request.method != b"POST":
                    return json_response({"error": "use POST for /infer"}, 405)
                if len(self._infer_paths) >= 1024:
                    self._infer_paths.clear()
                self._infer_paths[request.path] = (name, version)  # routing is pure: remember it
                return self._infer(request, name, version)
            if action == b"ready":
                return self._get(
                    request.method,
                    lambda: Response(200) if self.dp.model_ready(name, version) else _not_ready(f"model '{name}'"),
                )
            if action == b"config":
                return self._get(request.method, lambda: json_response(self.dp.model_config_json(name, version)))
            if action == b"stats":
                return self._get(
                    request.method, lambda: json_response({"model_stats": self.dp.model_statistics(name, version)})
                )
        if tail == [b"trace", b"setting"] and not version:
            return self._trace_setting(request, name)
        raise NotFound(f"no route for {request.path.decode(errors='replace')}")

    def check_head(self, method: bytes, url: bytes) -> Response | None:
        """The answer a request gets whatever its body, when its head alone decides it (so
        ``Expect: 100-continue`` is refused before the body is sent); None when the body is needed.
        Only reads: unknown routes, wrong methods and unknown or unready models of the routes that
        take a body."""
        path = url.partition(b"?")[0]
        parts = path.split(b"/")
        if len(parts) < 2 or parts[1] != b"v2":
            return error_response(NotFound(f"no route for {path.decode(errors='replace')}; the API lives under /v2"))
        section = parts[2] if len(parts) > 2 else b""
        if section == b"models" and len(parts) > 3:
            name, version, tail = _model_path(parts[3:])
            if tail == [b"infer"]:
                if method != b"POST":
                    return json_response({"error": "use POST for /infer"}, 405)
                try:
                    self.dp.model_config(name, version)
                except SluiceError as exc:
                    return error_response(exc)
        elif section == b"repository":
            if method != b"POST":
                return json_response({"error": "repository endpoints take POST"}, 405)
            rest = parts[3:]
            if rest != [b"index"] and not (len(rest) == 3 and rest[0] == b"models" and rest[2] in (b"load", b"unload")):
                return error_response(NotFound(f"no route for {path.decode(errors='replace')}"))
        elif section not in _SECTIONS:
            return error_response(NotFound(f"no route for {path.decode(errors='replace')}"))
        return None

    def _infer(self, request: Request, name: str, version: str) -> object:
        raw_caller = request.headers.get(b"sluice-caller")  # callers.py; checked before the body is decoded
        caller = caller_from_header(raw_caller) if raw_caller is not None else ""
        header_length = request.headers.get(b"inference-header-content-length")
        length = None
        if header_length is not None:
            if not header_length.isdigit() or len(header_length) > 19:  # ASCII digits: not "1_0", "+5", "-0"
                raise InvalidArgument(
                    "Inference-Header-Content-Length must be a non-negative integer (ASCII digits), got "
                    f"{header_length[:64].decode(errors='replace')!r}"
                )
            length = int(header_length)
        if length == 0:  # Triton's raw binary request: the body is the only input's tensor
            sig = signature_of(self.dp.model_config(name, version), name)
            infer_request = http_codec.decode_raw(_decode_body(request, self.limits), sig, name, version, self.limits)
        elif len(request.body) >= 4096 and _large_json(request, length, self.limits.json_offload_bytes):
            return self._infer_off_loop(request, name, version, length)
        else:
            infer_request = self.codec.decode(_decode_body(request, self.limits), length, name, version)
        if caller:
            infer_request.caller = caller
        self._submit(request.conn, infer_request, name, functools.partial(request.conn.complete, request), request)
        return DEFERRED

    async def _infer_off_loop(self, request: Request, name: str, version: str, length: int | None) -> Response:
        """A large JSON body: decompressed and decoded on a worker thread, so other connections are
        served meanwhile (CPython's json holds the GIL within one call, but the loop runs between steps)."""
        loop = asyncio.get_running_loop()
        limits = self.limits

        def decode() -> InferRequest:  # the plain codec: the plan cache is the event loop's alone
            return http_codec.decode_infer(_decode_body(request, limits), length, name, version, limits)

        infer_request = await loop.run_in_executor(None, decode)
        raw_caller = request.headers.get(b"sluice-caller")
        if raw_caller is not None:
            infer_request.caller = caller_from_header(raw_caller)
        answered: asyncio.Future[Response] = loop.create_future()
        conn = request.conn

        def respond(response: Response) -> None:
            conn.inflight = None
            if not answered.done():
                answered.set_result(response)

        self._submit(conn, infer_request, name, respond, request)
        return await answered

    def _submit(
        self,
        conn: Connection,
        infer_request: InferRequest,
        name: str,
        respond: Callable[[Response], None],
        request: Request,
    ) -> None:
        """Hand ``infer_request`` to the data plane; ``respond`` gets the HTTP response (on the loop,
        possibly before this returns: a response-cache hit)."""
        codec = self.codec
        offload = self.limits.json_offload_bytes
        accept = request.headers.get(b"accept-encoding")
        if accept is not None:  # tritonclient's response_compression_algorithm; aiohttp's default
            codings = self._codings
            coding = codings.get(accept, b"")
            if coding == b"":
                coding = http_codec.accepted_coding(accept)
                if len(codings) >= 64:  # clients send a handful of distinct headers
                    codings.clear()
                codings[accept] = coding
            if coding is not None:
                respond = _compressing(respond, coding, offload, name)

        def done(outcome: InferResponse | SluiceError) -> None:
            if isinstance(outcome, SluiceError):
                respond(error_response(outcome))
                return
            try:
                encoded = codec.encode(infer_request, outcome, offload)
            except Exception as exc:
                respond(_encode_failure(exc, name))
                return
            if encoded is None:  # a large JSON response
                _encode_off_loop(infer_request, outcome, name, respond)
                return
            respond(_encoded(encoded))

        if self.tracing.on:  # tracing.py: sample it, continuing the caller's W3C trace
            done = self.tracing.attach(infer_request, request.headers.get(b"traceparent"), done, "http")  # type: ignore[assignment]
        conn.inflight = infer_request  # before: ``done`` may run at once and clear it
        try:
            self.dp.infer_nowait(infer_request, done)
        except SluiceError as exc:
            conn.inflight = None  # refused at once: nothing to cancel
            if infer_request.trace is None:
                raise  # the caller answers
            done(exc)  # answered through the trace, which records the refusal
        except BaseException:
            conn.inflight = None  # refused at once (the caller answers): nothing to cancel
            raise

    def _trace_setting(self, request: Request, model: str) -> Response:
        """Triton's trace extension: GET the settings of the server or a model, POST to change them
        (``{"trace_rate": "10"}``; null clears a setting; ``{}`` for a model removes its settings)."""
        if model:
            self.dp.check_known(model)
        if request.method in (b"GET", b"HEAD"):
            return json_response(self.tracing.setting(model))
        if request.method != b"POST":
            return json_response({"error": "use GET or POST for trace/setting"}, 405)
        body = http_codec.parse_json(request.body, "trace setting body") if request.body else {}
        if not isinstance(body, dict):
            raise InvalidArgument('trace setting body must be a JSON object, e.g. {"trace_rate": "10"}')
        changes: dict[str, list[str] | None] = {}
        for key, value in body.items():
            if value is None:
                changes[key] = None
            elif isinstance(value, list) and all(isinstance(v, str) for v in value):
                changes[key] = value
            elif isinstance(value, str | int) and not isinstance(value, bool):
                changes[key] = [str(value)]
            else:
                raise InvalidArgument(f"trace setting '{key}': {value!r} must be a string or a list of strings")
        return json_response(self.tracing.update(model, changes))

    def _logging(self, request: Request) -> Response:
        """Triton's logging extension: GET reads the log settings, POST changes some of them and
        answers with all of them."""
        if request.method == b"POST":
            body = http_codec.parse_json(request.body, "log settings body") if request.body else {}
            if not isinstance(body, dict):
                raise InvalidArgument(
                    'log settings body must be a JSON object, e.g. {"log_verbose_level": 1}; settings: '
                    "log_file, log_info, log_warning, log_error, log_verbose_level, log_format"
                )
            return json_response(self.dp.update_log_settings(body))
        return self._get(request.method, lambda: json_response(self.dp.log_settings()))

    def _repository(self, request: Request, rest: list[bytes]) -> Response | Awaitable[Response]:
        if request.method != b"POST":
            return json_response({"error": "repository endpoints take POST"}, 405)
        if rest == [b"index"]:
            ready_only = False
            if request.body:
                body = http_codec.parse_json(request.body, "repository index body")
                if not isinstance(body, dict):
                    return error_response(InvalidArgument("repository index body must be a JSON object"))
                ready = body.get("ready", False)
                if not isinstance(ready, bool):  # "false" would read as true
                    return error_response(InvalidArgument(
                        f"repository index: 'ready' must be true or false, got {json.dumps(ready)[:40]}"
                    ))
                ready_only = ready
            return json_response(self.dp.repository_index(ready_only))
        if len(rest) == 3 and rest[0] == b"models" and rest[2] in (b"load", b"unload"):
            name = unquote(rest[1].decode("utf-8", "replace"))
            if rest[2] == b"load":
                return self._load(request, name)
            return self._unload(request, name)
        raise NotFound(f"no route for {request.path.decode(errors='replace')}")

    async def _load(self, request: Request, name: str) -> Response:
        params = _repository_parameters(request, "load")
        files: dict[str, bytes] = {}
        for key, value in params.items():
            if key.startswith("file:"):  # tritonclient sends the contents base64-encoded
                if not isinstance(value, str):
                    raise InvalidArgument(f"load parameter '{key}' must be the file's contents in base64")
                try:
                    files[key[len("file:"):]] = base64.b64decode(value, validate=True)
                except binascii.Error:
                    raise InvalidArgument(f"load parameter '{key}' must be the file's contents in base64") from None
        override = params.get("config")
        if override is not None and not isinstance(override, str):
            raise InvalidArgument("load parameter 'config' must be a string holding the model config as JSON")
        await self.dp.load(name, override, files)
        return Response(200)

    async def _unload(self, request: Request, name: str) -> Response:
        dependents = _repository_parameters(request, "unload").get("unload_dependents", False)
        if not isinstance(dependents, bool):
            raise InvalidArgument(f"unload parameter 'unload_dependents' must be true or false, got {dependents!r}")
        await self.dp.unload(name, dependents)
        return Response(200)

    def _shared_memory(self, request: Request, rest: list[bytes], kind: str) -> Response:
        """Triton's system (``kind`` SYSTEM) and CUDA shared-memory extensions: ``status``,
        ``unregister`` (all of the kind), and ``region/<name>/{status,register,unregister}``."""
        registry = self.dp.shared_memory
        if registry is None:
            raise NotFound("shared memory is not enabled on this server")
        if rest == [b"status"]:
            return self._get(request.method, lambda: json_response(registry.status("", kind)))
        action = rest[2] if len(rest) == 3 and rest[0] == b"region" else b""
        if action == b"status":
            name = unquote(rest[1].decode("utf-8", "replace"))
            return self._get(request.method, lambda: json_response(registry.status(name, kind)))
        if rest == [b"unregister"] or action in (b"register", b"unregister"):
            if request.method != b"POST":
                return json_response({"error": "use POST to register or unregister shared memory"}, 405)
            if rest == [b"unregister"]:
                registry.unregister("", kind)
                return Response(200)
            name = unquote(rest[1].decode("utf-8", "replace"))
            if not name:
                raise InvalidArgument(f"a region name is needed: region/<name>/{action.decode()}")
            if action == b"unregister":
                registry.unregister(name, kind)
                return Response(200)
            body = http_codec.parse_json(request.body, "register request body") if request.body else None
            if kind == shm.CUDA:
                registry.register_cuda(shm.parse_cuda_body(name, body))
                return Response(200)
            if not isinstance(body, dict) or "key" not in body or "byte_size" not in body:
                raise InvalidArgument(
                    f"failed to register shared memory region '{name}': the body must be a JSON object "
                    '{"key": "/<shm key>", "offset": <bytes, default 0>, "byte_size": <bytes>}'
                )
            registry.register(name, body["key"], body.get("offset", 0), body["byte_size"])
            return Response(200)
        raise NotFound(f"no route for {request.path.decode(errors='replace')}")


def _repository_parameters(request: Request, action: str) -> dict[str, Any]:
    """The ``parameters`` object of a repository load or unload request body (none: empty)."""
    if not request.body:
        return {}
    body = http_codec.parse_json(request.body, f"{action} request body")
    if not isinstance(body, dict):
        raise InvalidArgument(f"{action} request body must be a JSON object")
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidArgument(f"{action} request 'parameters' must be an object")
    return params


def _model_path(rest: list[bytes]) -> tuple[str, str, list[bytes]]:
    """``<name>[/versions/<v>][/<action>...]`` (the path after ``/v2/models/``) -> name, version, rest."""
    name = unquote(rest[0].decode("utf-8", "replace"))
    version = ""
    tail = rest[1:]
    if len(tail) >= 2 and tail[0] == b"versions":
        version = unquote(tail[1].decode("utf-8", "replace"))
        tail = tail[2:]
    return name, version, tail


def _not_ready(what: str) -> Response:
    return error_response(Unavailable(f"{what} is not ready"))
