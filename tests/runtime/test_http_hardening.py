"""The HTTP/1.1 front end against clients that break the rules or stop halfway, on a raw socket:
a header line that never ends, errors found while parsing behind requests still being answered,
bytes after ``Connection: close``, chunked trailers, timeouts of a request read
while another is answered, and header values with trailing whitespace."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from sluice.runtime.settings import Limits

from .conftest import ADD_SUB_CONFIG, BUILDERS, GATED_CONFIG, gate, gated_py, write_model  # type: ignore[import-not-found]
from .test_http_semantics import GOOD, Wire, post  # type: ignore[import-not-found]

INFER = post("/v2/models/add_sub/infer", GOOD) + GOOD


def sums(body: bytes) -> list[float]:
    outputs = {o["name"]: o["data"] for o in json.loads(body)["outputs"]}
    return outputs["OUTPUT0"]


def test_a_header_line_that_never_ends_is_refused_431_once_past_the_limit(shared_server):
    """httptools joins the pieces of a field line until it ends: without counting the raw bytes the
    server buffered (and re-copied) a line of any length, for as long as the header timeout ran."""
    with Wire(shared_server.http) as wire:
        wire.send(b"GET /v2/health/ready HTTP/1.1\r\nHost: t\r\nX-Big: ")
        sent = 0
        with pytest.raises(OSError):  # the server answers and closes while this is still sending
            for _ in range(256):  # at most 16 MiB
                wire.send(b"a" * 65_536)
                sent += 65_536
        status, _, body = wire.response()
        assert status == 431 and b"--max-header-bytes" in body
        assert sent < 4 << 20, f"{sent >> 20} MiB of one header line read before the refusal"


def test_a_parse_error_behind_a_request_being_answered_is_answered_after_it(shared_server):
    for bad in (
        b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\nContent-Length: abc\r\n\r\n",
        b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\nContent-Length: 999999999999\r\n\r\n",
        b"POST /v2/models/nope/infer HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n",
    ):
        with Wire(shared_server.http) as wire:
            wire.send(INFER + bad)  # the infer is answered from the model's thread, after the parser stopped
            status, _, body = wire.response()
            assert status == 200 and sums(body) == [2.0] * 16
            status, headers, _ = wire.response()
            assert status in (400, 404, 413) and headers["connection"] == "close"
            assert wire.closed()


def test_bytes_after_a_request_that_closes_the_connection_are_not_read(shared_server):
    closing = INFER.replace(b"Host: t\r\n", b"Host: t\r\nConnection: close\r\n", 1)
    assert closing != INFER
    with Wire(shared_server.http) as wire:
        wire.send(closing + b"GET /v2 HTTP/1.1\r\nHost: t\r\n\r\n" + b"\x00garbage")
        status, headers, body = wire.response()
        assert status == 200 and sums(body) == [2.0] * 16 and headers["connection"] == "close"
        assert wire.closed()  # no answer to what followed: not even a 400


def chunked_infer(trailers: bytes) -> bytes:
    return (
        b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n" % len(GOOD)
        + GOOD
        + b"\r\n0\r\n"
        + trailers
        + b"\r\n"
    )


def test_chunked_trailers_are_not_taken_as_headers(shared_server):
    """A trailer must not override the request's header section (RFC 9110 §6.5.1): framing headers,
    Content-Encoding or the caller a gateway checked in the head."""
    with Wire(shared_server.http) as wire:
        wire.send(chunked_infer(b"Inference-Header-Content-Length: 7\r\nContent-Encoding: gzip\r\n"))
        status, _, body = wire.response()
        assert status == 200, body
        assert sums(body) == [2.0] * 16
        wire.send(chunked_infer(b"X-Pad: " + b"a" * 20_000 + b"\r\n"))  # trailers count against the head limit
        status, _, body = wire.response()
        assert status == 431 and b"--max-header-bytes" in body


def test_header_values_lose_trailing_whitespace(shared_server):
    with Wire(shared_server.http) as wire:
        wire.send(post("/v2/models/add_sub/infer", GOOD, b"Expect: 100-continue \r\nSluice-Caller: billing \t\r\n"))
        status, _ = wire.head()
        assert status == 100
        wire.send(GOOD)
        status, _, body = wire.response()
        assert status == 200 and sums(body) == [2.0] * 16


@pytest.mark.parametrize(("path", "body"), [
    ("/v2/trace/setting", b'{"trace_rate": "1000"}'),  # it was a 404 "no route" with Expect, a 200 without
    ("/v2/models/add_sub/trace/setting", b'{"trace_rate": "1000"}'),
    ("/v2/logging", b'{"log_verbose_level": 0}'),
    ("/v2/repository/index", b"{}"),
])
def test_every_route_that_takes_a_body_answers_expect_100_continue(shared_server, path, body):
    with Wire(shared_server.http) as wire:
        wire.send(post(path, body, b"Expect: 100-continue\r\n"))
        status, _ = wire.head()
        assert status == 100, path
        wire.send(body)
        status, _, answer = wire.response()
        assert status == 200, answer


@pytest.mark.parametrize("value", [b"1_0", b"+5", b"-0", b" 7x", b"9" * 5000])
def test_inference_header_content_length_takes_digits_only(shared_server, value):
    with Wire(shared_server.http) as wire:
        wire.send(post("/v2/models/add_sub/infer", GOOD, b"Inference-Header-Content-Length: " + value + b"\r\n") + GOOD)
        status, _, body = wire.response()
    assert status == 400 and b"non-negative integer" in body


@pytest.fixture
def gated_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    write_model(repo, "gated", GATED_CONFIG, {"model.py": gated_py("sluice_http_hardening_gate")})
    return repo


GATED_BODY = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [4], "data": [1, 2, 3, 4]}]})
GATED = post("/v2/models/gated/infer", GATED_BODY.encode()) + GATED_BODY.encode()


@pytest.mark.parametrize(
    ("partial", "words"),
    [
        (b"GET /v2 HTTP/1.1\r\nHost: t\r\n", b"request head not received in time"),
        (b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{", b"request body"),
    ],
)
def test_a_request_read_while_another_is_answered_has_its_own_timeout(serve, gated_repo, partial, words):
    """The next request's head or body, sent in part while the model holds the first one: it is timed
    from when it began, and its 408 follows the first answer (it was only closed at the idle timeout)."""
    limits = Limits(header_timeout_s=0.5, body_timeout_s=0.5, idle_timeout_s=300)
    server = serve(gated_repo, limits=limits)
    with gate("sluice_http_hardening_gate") as g, Wire(server.http) as wire:
        wire.send(GATED + partial)
        assert g.entered.wait(10)
        wire.sock.settimeout(15)  # the 408 comes within a sweep or two of the 0.5 s timeout
        g.release.set()
        status, _, _ = wire.response()
        assert status == 200
        status, _, body = wire.response()
        assert status == 408 and words in body
        assert wire.closed()


def test_a_pipelined_expect_100_behind_a_slow_request_times_its_body_from_the_100(serve, gated_repo):
    """Its client sends the body only after the 100 Continue, which comes after the earlier answer: the
    body timeout must not run from the head (a 408 for a client that did everything right)."""
    limits = Limits(header_timeout_s=0.5, body_timeout_s=0.5, idle_timeout_s=300)
    server = serve(gated_repo, limits=limits)
    with gate("sluice_http_hardening_gate") as g, Wire(server.http) as wire:
        wire.send(GATED + post("/v2/models/add_sub/infer", GOOD, b"Expect: 100-continue\r\n"))
        assert g.entered.wait(10)
        wire.sock.settimeout(15)
        time.sleep(1.2)  # the model holds the first request past the body timeout (two sweeps)
        g.release.set()
        assert wire.response()[0] == 200
        assert wire.head()[0] == 100
        wire.send(GOOD)
        status, _, body = wire.response()
        assert status == 200 and sums(body) == [2.0] * 16


def test_x_gzip_request_bodies_are_gzip(shared_server):
    """RFC 9110 §8.4.1.3: a recipient SHOULD treat x-gzip as gzip (Accept-Encoding already did)."""
    import gzip

    packed = gzip.compress(GOOD)
    with Wire(shared_server.http) as wire:
        wire.send(post("/v2/models/add_sub/infer", packed, b"Content-Encoding: x-gzip\r\n") + packed)
        status, _, body = wire.response()
    assert status == 200 and sums(body) == [2.0] * 16
