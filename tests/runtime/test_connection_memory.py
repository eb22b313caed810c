"""A closed HTTP connection leaves no garbage cycle holding its last request.

``sluice serve`` freezes startup objects and collects the oldest generation rarely (see
``__main__``), so memory kept alive only by cycles piles up: with a connection per request, each
large body stayed until a full collection.
"""

from __future__ import annotations

import gc
import socket
import tracemalloc

import numpy as np


def test_closed_connections_do_not_keep_their_requests_alive(shared_server):
    host, port = shared_server.http.split(":")
    data = np.zeros(16, np.float32).tobytes()
    header = (
        b'{"inputs":[{"name":"INPUT0","shape":[16],"datatype":"FP32","parameters":{"binary_data_size":64}},'
        b'{"name":"INPUT1","shape":[16],"datatype":"FP32","parameters":{"binary_data_size":64}}],'
        b'"parameters":{"padding":"' + b"x" * (256 * 1024) + b'"}}'
    )
    body = header + data + data
    request = (
        b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
        b"Inference-Header-Content-Length: %d\r\nContent-Length: %d\r\n\r\n%s" % (len(header), len(body), body)
    )
    gc.collect()
    gc.disable()  # as rare as full collections are in `sluice serve`
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(200):  # 50 MiB of request bodies, one connection each
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(request)
                sock.settimeout(10)
                answer = b""
                while chunk := sock.recv(65536):
                    answer += chunk
                assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        gc.enable()
    assert grown < 16 * 1024 * 1024, f"{grown >> 20} MiB held by closed connections"
