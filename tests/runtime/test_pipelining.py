"""HTTP/1.1 pipelining: many requests in one read are all answered, in order, without starving others."""

from __future__ import annotations

import json
import socket
import time

import numpy as np
import tritonclient.http as httpclient


def read_responses(sock: socket.socket, count: int, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    deadline = time.monotonic() + timeout
    while data.count(b"HTTP/1.1 ") < count and time.monotonic() < deadline:
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        data += chunk
    return data


def test_thousands_of_pipelined_requests_behind_an_infer_are_answered_in_order(shared_server):
    host, port = shared_server.http.split(":")
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]})
    infer = b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (
        len(body),
        body.encode(),
    )
    # alternate two different GETs so the order of answers can be checked
    gets = [b"GET /v2/models/mlp HTTP/1.1\r\nHost: t\r\n\r\n", b"GET /v2/models/add_sub HTTP/1.1\r\nHost: t\r\n\r\n"]
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(infer + b"".join(gets[i % 2] for i in range(3000)))
        data = read_responses(sock, 3001, timeout=30)
    heads = data.split(b"HTTP/1.1 ")[1:]
    assert len(heads) == 3001
    assert all(h.startswith(b"200") for h in heads)
    assert b'"model_name":"mlp"' in heads[0]  # the infer answer comes first
    names = [b'"name":"mlp"' in h for h in heads[1:]]
    assert names == [i % 2 == 0 for i in range(3000)]  # then the GETs, in the order sent
    # and the server still answers a normal client
    client = httpclient.InferenceServerClient(shared_server.http)
    inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 16), np.float32))
    assert client.infer("mlp", [inp]).as_numpy("OUTPUT0").shape == (1, 4)
    client.close()
