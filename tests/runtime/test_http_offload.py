"""Large JSON bodies are decoded (and large JSON responses encoded) off the event loop.

A 64 MiB JSON body takes the best part of a second to decode; on the event loop that second is
stolen from every other connection. The order test needs no clock: a large request that fails only
after its whole body is decoded, then, once the server has it, a health check on another connection.
Decoded on the loop, the large request's error is written before the loop even reads the health
check; decoded on a worker thread, the health check is answered first.
"""

from __future__ import annotations

import gzip
import json
import selectors
import socket

import numpy as np
import tritonclient.http as httpclient

from sluice.runtime.settings import Limits

N = 6_000_000  # ~30 MB of JSON numbers (the default body limit is 64 MiB)


def connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=60)
    return sock


def read_response(sock: socket.socket, buffer: bytes = b"") -> tuple[int, bytes]:
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        assert chunk, "closed before a response"
        buffer += chunk
    head, _, rest = buffer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next(int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed mid-body"
        rest += chunk
    return int(lines[0].split(" ")[1]), rest[:length]


def test_other_connections_are_served_while_a_large_json_body_is_decoded(shared_server):
    # valid JSON for add_sub's INPUT0 but with N elements where the model takes 16: refused only after
    # the whole body is decoded. gzip keeps the wire small, so the server has it all in one read.
    doc = b'{"inputs":[{"name":"INPUT0","datatype":"FP32","shape":[%d],"data":[' % N + b"0.5," * (N - 1) + b"0.5]}]}"
    body = gzip.compress(doc, 9)  # ~23 KB: one read
    large, small = connect(shared_server.http), connect(shared_server.http)
    try:
        small.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_response(small)[0] == 200  # both connections are accepted and idle
        # head and body in one write (one read on the server); the 100 Continue the server writes on
        # reading the head is the sign it has the request: it is decoding by the time the client sees it
        large.sendall(
            b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\nContent-Encoding: gzip\r\n"
            b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        interim = b""
        while b"\r\n\r\n" not in interim:
            interim += large.recv(1)
        assert interim.startswith(b"HTTP/1.1 100 "), interim
        small.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")
        with selectors.DefaultSelector() as selector:
            selector.register(large, selectors.EVENT_READ, "large")
            selector.register(small, selectors.EVENT_READ, "small")
            (first, _), *_ = selector.select(timeout=60)
        assert first.data == "small", "the health check waited for the large body's decoding"
        assert read_response(small)[0] == 200
        status, error = read_response(large)
        assert status == 400 and "INPUT0" in json.loads(error)["error"]
    finally:
        large.close()
        small.close()


def test_offloaded_decode_and_encode_give_the_same_answers(serve, example_repo):
    """With a threshold of 1 byte every JSON request and response takes the worker-thread path."""
    server = serve(example_repo, limits=Limits(json_offload_bytes=1))
    client = httpclient.InferenceServerClient(server.http)
    a = np.arange(16, dtype=np.float32)
    b = np.ones(16, dtype=np.float32)
    for binary in (False, True):
        inputs = [httpclient.InferInput("INPUT0", [16], "FP32"), httpclient.InferInput("INPUT1", [16], "FP32")]
        inputs[0].set_data_from_numpy(a, binary_data=binary)
        inputs[1].set_data_from_numpy(b, binary_data=binary)
        outputs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("OUTPUT0", "OUTPUT1")]
        result = client.infer("add_sub", inputs, outputs=outputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    # errors found while decoding on the worker thread are answered as usual, and the connection goes on
    sock = connect(server.http)
    try:
        for doc in (b"{not json", b'{"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [16]}]}'):
            sock.sendall(b"POST /v2/models/add_sub/infer HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(doc), doc))
            status, error = read_response(sock)
            assert status == 400 and json.loads(error)["error"]
    finally:
        sock.close()
