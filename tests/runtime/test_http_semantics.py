"""HTTP/1.1 message semantics on a raw socket: HEAD, ``Expect: 100-continue`` and request targets.

A keep-alive client reads responses by their framing, so a HEAD answer that carried a body, or a
body sent before the server agreed to read it, desynchronises everything after it on the connection.
Each test runs the real server on loopback and checks the bytes on the wire.
"""

from __future__ import annotations

import json
import socket
import subprocess

import numpy as np
import pytest

from sluice.runtime.protocol.http import origin_form

ONES = [1.0] * 16
GOOD = json.dumps(
    {
        "inputs": [
            {"name": "INPUT0", "datatype": "FP32", "shape": [16], "data": ONES},
            {"name": "INPUT1", "datatype": "FP32", "shape": [16], "data": ONES},
        ]
    }
).encode()


class Wire:
    """A client socket that reads one response at a time, by its framing, with nothing discarded."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.buffer = b""

    def __enter__(self) -> Wire:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, raw: bytes) -> None:
        self.sock.sendall(raw)

    def head(self) -> tuple[int, dict[str, str]]:
        """Read one response head (status line and headers), leaving what follows it buffered."""
        while b"\r\n\r\n" not in self.buffer:
            chunk = self.sock.recv(65536)
            assert chunk, f"connection closed mid-response (got {self.buffer[:200]!r})"
            self.buffer += chunk
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        version, status, *_ = lines[0].split(" ", 2)
        assert version == "HTTP/1.1", lines[0]
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        return int(status), headers

    def response(self) -> tuple[int, dict[str, str], bytes]:
        status, headers = self.head()
        length = int(headers["content-length"])
        while len(self.buffer) < length:
            chunk = self.sock.recv(65536)
            assert chunk, "connection closed mid-body"
            self.buffer += chunk
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return status, headers, body

    def closed(self) -> bool:
        """True when the server closed the connection with nothing more sent."""
        self.sock.settimeout(5)
        try:
            return not self.buffer and self.sock.recv(1) == b""
        except ConnectionResetError:
            return True


def get(method: str, path: str) -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode()


@pytest.mark.parametrize(
    "path",
    ["/v2", "/v2/models/add_sub", "/v2/models/add_sub/config", "/v2/health/ready", "/v2/models/missing", "/nope"],
)
def test_head_has_get_headers_and_no_body(shared_server, path):
    with Wire(shared_server.http) as wire:
        wire.send(get("GET", path))
        get_status, get_headers, get_body = wire.response()
        # HEAD then GET in one write: the GET answer must start right after the HEAD answer's head
        wire.send(get("HEAD", path) + get("GET", path))
        status, headers = wire.head()
        assert status == get_status
        assert headers["content-type"] == get_headers["content-type"]
        assert int(headers["content-length"]) == len(get_body)
        status, _, body = wire.response()
        assert (status, body) == (get_status, get_body)


def test_head_then_infer_on_one_keep_alive_connection(shared_server):
    with Wire(shared_server.http) as wire:
        wire.send(get("HEAD", "/v2/models/add_sub"))
        assert wire.head()[0] == 200
        wire.send(b"POST /v2/models/add_sub/infer HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(GOOD), GOOD))
        status, _, body = wire.response()
        assert status == 200
        outputs = {o["name"]: o["data"] for o in json.loads(body)["outputs"]}
        np.testing.assert_allclose(outputs["OUTPUT0"], [2.0] * 16)


@pytest.mark.parametrize(
    ("target", "path"),
    [
        (b"/v2/models/add_sub?x=1", b"/v2/models/add_sub?x=1"),
        (b"http://svc:8000/v2/models/add_sub", b"/v2/models/add_sub"),
        (b"HTTPS://svc/v2?x=/y", b"/v2?x=/y"),
        (b"http://svc?x=1", b"/?x=1"),
        (b"http://svc", b"/"),
        (b"*", b"*"),
        (b"ftp://svc/v2", b"ftp://svc/v2"),
    ],
)
def test_origin_form_of_a_request_target(target, path):
    assert origin_form(target) == path


def test_absolute_form_targets_are_served_as_their_path(shared_server):
    """RFC 9112 3.2.2: a server accepts ``POST http://host/path``, as a forward proxy sends it."""
    with Wire(shared_server.http) as wire:
        target = f"http://{shared_server.http}/v2/models/add_sub/infer"
        wire.send(b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (target.encode(), len(GOOD), GOOD))
        status, _, body = wire.response()
        assert status == 200, body
        outputs = {o["name"]: o["data"] for o in json.loads(body)["outputs"]}
        np.testing.assert_allclose(outputs["OUTPUT0"], [2.0] * 16)
        wire.send(get("GET", f"http://{shared_server.http}/v2/health/ready"))
        assert wire.response()[0] == 200
        wire.send(get("GET", "http://t/v3"))
        status, _, body = wire.response()
        assert status == 404 and "no route for /v3" in json.loads(body)["error"]


def test_http_1_0_keep_alive_is_announced_and_kept(shared_server):
    """An HTTP/1.0 client keeps its connection only when the answer says ``connection: keep-alive``
    (ApacheBench ``-k``); without the request header HTTP/1.0 closes after each answer."""
    with Wire(shared_server.http) as wire:
        for _ in range(2):
            wire.send(b"GET /v2/health/ready HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n")
            status, headers, _ = wire.response()
            assert (status, headers.get("connection")) == (200, "keep-alive")
        wire.send(b"POST /v2/models/add_sub/infer HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: %d\r\n\r\n%s"
                  % (len(GOOD), GOOD))  # fmt: skip
        status, headers, body = wire.response()
        assert (status, headers.get("connection")) == (200, "keep-alive"), body
        wire.send(b"GET /v2/health/ready HTTP/1.0\r\n\r\n")
        status, headers, _ = wire.response()
        assert (status, headers.get("connection")) == (200, "close")
        assert wire.closed()
    with Wire(shared_server.http) as wire:  # HTTP/1.1 keeps alive without saying so
        wire.send(get("GET", "/v2/health/ready"))
        status, headers, _ = wire.response()
        assert status == 200 and "connection" not in headers


@pytest.mark.parametrize(
    ("headers", "kept"),
    [
        (b"Proxy-Connection: keep-alive\r\n", True),  # httptools honours it as Connection
        (b"Connection: keep-alive, close\r\n", False),
        (b"Connection: keep-alive\r\nConnection: close\r\n", False),
        (b"Connection: close\r\n", False),
    ],
)
def test_http_1_0_keep_alive_is_announced_exactly_when_the_connection_stays(shared_server, headers, kept):
    with Wire(shared_server.http) as wire:
        wire.send(b"GET /v2/health/ready HTTP/1.0\r\n" + headers + b"\r\n")
        status, response_headers, _ = wire.response()
        assert (status, response_headers.get("connection")) == (200, "keep-alive" if kept else "close")
        if kept:
            wire.send(get("GET", "/v2/health/ready"))
            assert wire.response()[0] == 200
        else:
            assert wire.closed()


UPGRADE = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"


def test_an_upgrade_request_s_body_is_read_after_its_100_continue(shared_server):
    """``curl --http2 -d ...`` on http:// asks to upgrade and sends a body; the parser stops at the head,
    so the server reads the body itself (here after 100 Continue, in a later read) and answers over
    HTTP/1.1, then closes: what would follow is HTTP/2."""
    with Wire(shared_server.http) as wire:
        wire.send(
            b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\n" + UPGRADE
            + b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(GOOD)
        )  # fmt: skip
        assert wire.head()[0] == 100
        wire.send(GOOD[:10])
        wire.send(GOOD[10:])
        status, headers, body = wire.response()
        assert (status, headers.get("connection")) == (200, "close"), body
        outputs = {o["name"]: o["data"] for o in json.loads(body)["outputs"]}
        np.testing.assert_allclose(outputs["OUTPUT0"], [2.0] * 16)
        assert wire.closed()


MLP = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [2, 16], "data": [1.0] * 32}]}).encode()


def post(path: str, body: bytes, extra: bytes = b"", length: bool = True) -> bytes:
    size = b"Content-Length: %d\r\n" % len(body) if length else b""
    return b"POST %s HTTP/1.1\r\nHost: t\r\n%s%s\r\n" % (path.encode(), extra, size)


def test_an_upgrade_asked_over_two_connection_lines_still_has_its_body_read(shared_server):
    with Wire(shared_server.http) as wire:
        extra = b"Connection: Upgrade\r\nConnection: HTTP2-Settings\r\nUpgrade: h2c\r\n"
        wire.send(post("/v2/models/add_sub/infer", GOOD, extra) + GOOD)
        status, headers, body = wire.response()
        assert (status, headers.get("connection")) == (200, "close"), body
        assert wire.closed()


def test_an_upgrade_request_behind_a_full_burst_is_answered(shared_server):
    """64 pipelined requests fill a read's burst; the upgrade request behind them, whose body comes
    later, is still answered."""
    with Wire(shared_server.http) as wire:
        wire.send(get("GET", "/v2/health/ready") * 64 + post("/v2/models/add_sub/infer", GOOD, UPGRADE))
        assert [wire.response()[0] for _ in range(64)] == [200] * 64
        wire.send(GOOD)
        status, headers, body = wire.response()
        assert (status, headers.get("connection")) == (200, "close"), body


def test_what_follows_an_upgrade_request_answered_later_is_never_parsed(shared_server):
    """An inference and an upgrade inference behind it (both answered later), then the HTTP/2 preface
    curl would send: both requests are answered, the preface is never read as a request (no 400)."""
    with Wire(shared_server.http) as wire:
        wire.send(post("/v2/models/mlp/infer", MLP) + MLP + post("/v2/models/mlp/infer", MLP, UPGRADE) + MLP)
        wire.send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        first, second = wire.response(), wire.response()
        assert (first[0], second[0], second[1].get("connection")) == (200, 200, "close"), (first, second)
        assert wire.closed()


def test_an_upgrade_request_behind_another_gets_its_100_continue_after_that_answer(shared_server):
    with Wire(shared_server.http) as wire:
        expect = UPGRADE + b"Expect: 100-continue\r\n"
        wire.send(post("/v2/models/mlp/infer", MLP) + MLP + post("/v2/models/add_sub/infer", GOOD, expect))
        assert wire.response()[0] == 200
        assert wire.head()[0] == 100
        wire.send(GOOD)
        status, headers, body = wire.response()
        assert (status, headers.get("connection")) == (200, "close"), body


def test_an_upgrade_request_with_a_chunked_body_is_refused(shared_server):
    with Wire(shared_server.http) as wire:
        wire.send(
            b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\n" + UPGRADE
            + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(GOOD), GOOD)
        )  # fmt: skip
        status, _, body = wire.response()
        assert status == 400 and "allowed: Content-Length" in json.loads(body)["error"]
        assert wire.closed()


def test_http_1_0_with_a_transfer_coding_is_answered_then_closed(shared_server):
    """RFC 9112 6.1: HTTP/1.0 framing with Transfer-Encoding is suspect; the server answers and closes,
    so nothing after the body is read as another request (even when the client asked to keep alive)."""
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(GOOD), GOOD)
    with Wire(shared_server.http) as wire:
        wire.send(
            b"POST /v2/models/add_sub/infer HTTP/1.0\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n"
            + chunked
            + get("GET", "/v2/health/ready")
        )
        status, headers, body = wire.response()
        assert status == 200, body
        assert headers.get("connection") == "close"
        assert wire.closed()


def test_transfer_coding_lines_count_once_against_the_head_limit(shared_server):
    """300 short Transfer-Encoding lines (7 KB of head) are refused for their coding, not their size."""
    head = b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\n" + b"Transfer-Encoding: gzip\r\n" * 300
    with Wire(shared_server.http) as wire:
        wire.send(head + b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
        status, _, body = wire.response()
        assert status == 501 and "unsupported Transfer-Encoding 'gzip, gzip," in json.loads(body)["error"]


def expect_head(
    path: str, length: int, expect: str = "100-continue", version: str = "1.1", method: str = "POST"
) -> bytes:
    head = f"{method} {path} HTTP/{version}\r\nHost: t\r\nContent-Length: {length}\r\nExpect: {expect}\r\n\r\n"
    return head.encode()


def test_expect_100_continue_is_answered_before_the_body(shared_server):
    with Wire(shared_server.http) as wire:
        wire.send(expect_head("/v2/models/add_sub/infer", len(GOOD)))
        wire.sock.settimeout(5)  # before the fix nothing came until the body was sent
        assert wire.head() == (100, {})
        wire.sock.settimeout(10)
        wire.send(GOOD)
        status, _, body = wire.response()
        assert status == 200, body
        # keep-alive still works, and a second Expect on the connection gets its own 100
        wire.send(expect_head("/v2/models/add_sub/infer", len(GOOD)))
        assert wire.head() == (100, {})
        wire.send(GOOD)
        assert wire.response()[0] == 200


def test_expect_100_continue_after_a_pipelined_request_keeps_order(shared_server):
    with Wire(shared_server.http) as wire:
        wire.send(get("GET", "/v2/health/ready") + expect_head("/v2/models/add_sub/infer", len(GOOD)))
        assert wire.response()[0] == 200
        assert wire.head() == (100, {})
        wire.send(GOOD)
        assert wire.response()[0] == 200


@pytest.mark.parametrize(
    ("head", "status", "words"),
    [
        (expect_head("/nope", 10), 404, ["/nope", "/v2"]),
        (expect_head("/v2/nothing/here", 10), 404, ["/v2/nothing/here"]),
        (expect_head("/v2/models/missing/infer", 10), 404, ["missing"]),
        (expect_head("/v2/models/add_sub/versions/7/infer", 10), 404, ["add_sub", "7"]),
        (expect_head("/v2/models/add_sub/infer", 10, method="PUT"), 405, ["POST"]),
        (expect_head("/v2/repository/models/add_sub/explode", 10), 404, ["explode"]),
        (expect_head("/v2/repository/index", 10, method="GET"), 405, ["POST"]),
        (expect_head("/v2/models/add_sub/infer", 65 * 1024 * 1024), 413, ["67108864", "--max-body-bytes"]),
        (expect_head("/v2/models/add_sub/infer", 10, expect="200-ok"), 417, ["200-ok", "100-continue"]),
    ],
    ids=["outside-v2", "unknown-route", "unknown-model", "unknown-version", "wrong-method", "unknown-repo-action",
         "repo-get", "too-large", "unknown-expectation"],
)
def test_expect_refused_from_the_head_gets_the_final_answer_at_once(shared_server, head, status, words):
    with Wire(shared_server.http) as wire:
        wire.send(head)  # and no body: the client waits for the server's word
        wire.sock.settimeout(5)
        got, headers, body = wire.response()
        assert got == status, body
        message = json.loads(body)["error"]
        for word in words:
            assert word in message
        assert headers.get("connection") == "close"  # the body was never sent: the framing is lost
        assert wire.closed()


def test_expect_ignored_for_http_1_0(shared_server):
    with Wire(shared_server.http) as wire:
        wire.send(expect_head("/v2/models/add_sub/infer", len(GOOD), version="1.0") + GOOD)
        raw = b""
        while True:
            chunk = wire.sock.recv(65536)
            if not chunk:
                break
            raw += chunk
        assert raw.startswith(b"HTTP/1.1 200 "), raw[:100]
        assert b"100 Continue" not in raw


def test_curl_large_body_gets_100_continue(shared_server):
    """curl sends ``Expect: 100-continue`` for bodies over 1 MiB and waits for the answer."""
    text = "x" * (2 * 1024 * 1024)
    doc = {"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1, 1], "data": [text]}]}
    body = json.dumps(doc).encode()
    result = subprocess.run(
        ["curl", "-sS", "-v", "--data-binary", "@-", "-H", "Content-Type: application/json",
         f"http://{shared_server.http}/v2/models/identity_bytes/infer"],
        input=body, capture_output=True, timeout=60, check=True,
    )
    trace = result.stderr.decode(errors="replace")
    assert "> Expect: 100-continue" in trace
    assert "< HTTP/1.1 100 Continue" in trace
    assert "< HTTP/1.1 200 OK" in trace
    (output,) = json.loads(result.stdout)["outputs"]
    assert output["data"] == [text]


def test_expect_behind_a_pending_request_gets_its_100_after_that_response(shared_server):
    infer = b"POST /v2/models/add_sub/infer HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(GOOD), GOOD)
    with Wire(shared_server.http) as wire:
        # one write: the infer is still being answered when the server reads the Expect head
        wire.send(infer + expect_head("/v2/models/add_sub/infer", len(GOOD)))
        status, _, body = wire.response()
        assert status == 200, body  # the first request's answer comes first, then the 100
        assert wire.head() == (100, {})
        wire.send(GOOD)
        assert wire.response()[0] == 200
