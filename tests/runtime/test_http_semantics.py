"""HTTP/1.1 message semantics on a raw socket: HEAD and ``Expect: 100-continue``.

A keep-alive client reads responses by their framing, so a HEAD answer that carried a body, or a
body sent before the server agreed to read it, desynchronises everything after it on the connection.
Each test runs the real server on loopback and checks the bytes on the wire.
"""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest

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
