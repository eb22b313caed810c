"""Slow and idle HTTP clients time out and never starve the others.

The server runs with 1-second head/body/idle timeouts (its sweeper looks every 0.5 s), so each case
finishes in about two seconds: a slow-loris head, a stalled or trickled body, idle keep-alive and
silent connections, fifty slow-loris connections beside a normal client, and the connection limit.
"""

from __future__ import annotations

import re
import select
import socket
import threading
import time

import numpy as np
import pytest
import tritonclient.http as httpclient

from sluice.runtime.settings import Limits

TIMEOUTS = {"header_timeout_s": 1.0, "body_timeout_s": 1.0, "idle_timeout_s": 1.0}
READY = b"GET /v2/health/ready HTTP/1.1\r\nHost: t\r\n\r\n"


@pytest.fixture
def server(serve, example_repo):
    return serve(example_repo, limits=Limits(**TIMEOUTS))


def connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def trickle_until_closed(sock: socket.socket, pieces, interval: float, limit: float) -> tuple[bytes, float, int]:
    """Send one piece every ``interval`` s until the server closes; returns what came back, when, pieces sent."""
    started = time.monotonic()
    received = b""
    sent = 0
    while time.monotonic() - started < limit:
        readable, _, _ = select.select([sock], [], [], interval)
        if readable:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            received += chunk
        elif received == b"":
            try:
                sock.sendall(next(pieces))
                sent += 1
            except (OSError, StopIteration):
                pass
    return received, time.monotonic() - started, sent


def read_until_closed(sock: socket.socket, limit: float = 4.0) -> tuple[bytes, float]:
    received, elapsed, _ = trickle_until_closed(sock, iter(()), 0.05, limit)
    return received, elapsed


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def header_lines():
    index = 0
    while True:
        yield b"X-Slow-%d: a\r\n" % index
        index += 1


def test_slow_loris_head_gets_408_and_is_closed(server):
    with connect(server.http) as sock:
        sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\n")
        received, elapsed, sent = trickle_until_closed(sock, header_lines(), 0.3, limit=5)
    assert sent >= 2, "the client was trickling header lines"
    assert status_of(received) == 408
    assert b"--header-timeout-s" in received and b"connection: close" in received
    assert 0.9 <= elapsed <= 2.5, elapsed


def test_stalled_body_gets_408(server):
    with connect(server.http) as sock:
        sock.sendall(b'POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{"inp')
        received, elapsed = read_until_closed(sock)
    assert status_of(received) == 408
    assert b"--body-timeout-s" in received
    assert 0.9 <= elapsed <= 2.5, elapsed


def test_trickled_body_gets_408(server):
    """The body timeout runs from the end of the head, so a byte now and then does not extend it."""
    with connect(server.http) as sock:
        sock.sendall(b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n")
        received, elapsed, sent = trickle_until_closed(sock, iter([b" "] * 100), 0.3, limit=5)
    assert sent >= 2
    assert status_of(received) == 408
    assert b"--body-timeout-s" in received
    assert 0.9 <= elapsed <= 2.5, elapsed


def test_an_upgrade_request_whose_body_never_comes_gets_408_behind_another(server):
    """An upgrade request (``Upgrade: h2c``) declares a body the server reads itself; pipelined behind
    an answered request, a body that never comes still gets the body timeout's 408, not a silent close."""
    upgrade = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"
    with connect(server.http) as sock:
        infer = b'{"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [%s]}]}' % b",".join(
            [b"1"] * 16
        )
        first = b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (len(infer), infer)
        head = b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\n" + upgrade + b"Content-Length: 10\r\n\r\n"
        sock.sendall(first + head)  # the inference is answered later, after the upgrade head was read
        received, elapsed = read_until_closed(sock)
    answers = [status_of(b"HTTP/1.1" + part) for part in received.split(b"HTTP/1.1")[1:]]
    assert answers == [200, 408], received
    assert b"--body-timeout-s" in received
    assert 0.9 <= elapsed <= 2.5, elapsed


def test_idle_keep_alive_connection_is_closed(server):
    with connect(server.http) as sock:
        sock.sendall(READY)
        received, elapsed = read_until_closed(sock)
    assert status_of(received) == 200 and b"connection: close" not in received  # kept alive, then closed idle
    assert 0.9 <= elapsed <= 2.5, elapsed


def test_silent_connection_is_closed(server):
    with connect(server.http) as sock:
        received, elapsed = read_until_closed(sock)
    assert received == b""
    assert 0.9 <= elapsed <= 2.5, elapsed


def test_fifty_slow_loris_connections_do_not_starve_a_normal_client(server):
    lorises = [connect(server.http) for _ in range(50)]
    for sock in lorises:
        sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\n")
    answers: dict[int, bytes] = {}

    def trickle():
        open_ = {sock.fileno(): sock for sock in lorises}
        lines = header_lines()
        deadline = time.monotonic() + 5
        while open_ and time.monotonic() < deadline:
            readable, _, _ = select.select(list(open_.values()), [], [], 0.3)
            for sock in readable:
                try:
                    chunk = sock.recv(65536)
                except ConnectionResetError:
                    chunk = b""
                answers[sock.fileno()] = answers.get(sock.fileno(), b"") + chunk
                if not chunk:
                    del open_[sock.fileno()]
            if not readable:
                line = next(lines)
                for sock in open_.values():
                    try:
                        sock.sendall(line)
                    except OSError:
                        pass

    trickler = threading.Thread(target=trickle, daemon=True)
    trickler.start()
    client = httpclient.InferenceServerClient(server.http)
    try:
        a = np.arange(16, dtype=np.float32)
        inputs = [httpclient.InferInput("INPUT0", [16], "FP32"), httpclient.InferInput("INPUT1", [16], "FP32")]
        for tensor in inputs:
            tensor.set_data_from_numpy(a)
        latencies = []
        started = time.monotonic()
        while time.monotonic() - started < 0.7 and len(latencies) < 200:  # while every slow-loris is still open
            t0 = time.monotonic()
            result = client.infer("add_sub", inputs)
            latencies.append(time.monotonic() - t0)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)
        assert client.is_server_ready()
    finally:
        client.close()
    trickler.join(6)
    for sock in lorises:
        sock.close()
    assert len(latencies) >= 10
    assert max(latencies) < 0.25, f"slowest request took {max(latencies):.3f}s beside 50 slow-loris connections"
    assert len(answers) == 50
    assert all(status_of(answer) == 408 for answer in answers.values() if answer), answers


def test_connections_over_the_limit_get_503(serve, example_repo, caplog):
    server = serve(example_repo, limits=Limits(**{**TIMEOUTS, "idle_timeout_s": 10.0}, max_connections=8))
    held = [connect(server.http) for _ in range(8)]
    try:
        for sock in held:  # each one is accepted and served
            sock.sendall(READY)
            assert status_of(sock.recv(65536)) == 200
        for _ in range(3):
            with connect(server.http) as extra:
                received, elapsed = read_until_closed(extra)
            assert status_of(received) == 503
            assert b"--max-connections" in received and b"8" in received
            assert elapsed < 1
        # one warning when the refusing starts, not one per refused connection
        refusing = [r for r in caplog.records if "the most --max-connections allows" in r.getMessage()]
        assert [(r.levelname, r.getMessage().split(",")[0]) for r in refusing] == [
            ("WARNING", "HTTP: 8 connections are open")
        ]
        assert not [r for r in caplog.records if "accepting connections again" in r.getMessage()]
        held.pop().close()
        for _ in range(50):  # the server notices the close asynchronously
            with connect(server.http) as again:
                again.sendall(READY)
                answer, _ = read_until_closed(again, limit=0.3)
            if status_of(answer) == 200:
                break
            time.sleep(0.02)
        assert status_of(answer) == 200
        again_lines = [r.getMessage() for r in caplog.records if "accepting connections again" in r.getMessage()]
        assert len(again_lines) == 1
        refused = int(re.search(r"; (\d+) were refused at --max-connections 8", again_lines[0]).group(1))
        assert refused >= 3  # and any the server refused before it noticed the close
    finally:
        for sock in held:
            sock.close()


def test_client_that_never_reads_its_responses_is_dropped(serve, example_repo):
    """Pipelined requests whose responses are never read must not hold memory or a connection slot forever."""
    server = serve(example_repo, limits=Limits(**TIMEOUTS, max_connections=1))
    host, port = server.http.rsplit(":", 1)
    hog = socket.socket()
    hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a tiny window: responses pile up server-side
    hog.connect((host, int(port)))
    hog.setblocking(False)
    burst = b"GET /v2/models/add_sub/config HTTP/1.1\r\nHost: t\r\nX-Pad: %s\r\n\r\n" % (b"p" * 900) * 50
    started = last_taken = time.monotonic()
    sent = 0
    # far more responses than socket buffers hold: 4 MB of requests, or fewer if the server stops
    # taking them first (bounded in time)
    while sent < 4_000_000 and time.monotonic() - last_taken < 0.3 and time.monotonic() - started < 3:
        try:
            sent += hog.send(burst)
            last_taken = time.monotonic()
        except BlockingIOError:
            time.sleep(0.01)
    try:
        with connect(server.http) as other:
            assert status_of(read_until_closed(other, limit=2)[0]) == 503  # the hog holds the only slot
        answer = b""
        for _ in range(60):  # bounded: the hog is idle after 1 s and its unread output is dropped soon after
            with connect(server.http) as other:
                other.sendall(READY)
                answer, _ = read_until_closed(other, limit=0.2)
            if answer and status_of(answer) == 200:
                break
            time.sleep(0.1)
        # the loop's ~60 tries of ~0.3 s bound how long the slot may stay taken; no wall-clock bound
        # beyond that (the server first works through ~4,000 queued requests, which takes a slow
        # machine several seconds)
        assert status_of(answer) == 200, answer
    finally:
        hog.close()
