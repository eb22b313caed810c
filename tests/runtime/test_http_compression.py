"""HTTP compression both ways, as tritonclient asks for it: ``request_compression_algorithm`` sends a
gzip/deflate body, ``response_compression_algorithm`` sends ``Accept-Encoding`` and Sluice answers the
inference compressed (Triton's behaviour), through one process and through protocol workers."""

from __future__ import annotations

import gzip
import http.client
import json
import zlib

import numpy as np
import pytest
import tritonclient.http as httpclient

from sluice.runtime.protocol.http_codec import COMPRESS_MIN_BYTES, accepted_coding, worth_compressing
from sluice.runtime.settings import Limits


@pytest.mark.parametrize(
    ("header", "coding"),
    [
        (None, None),
        (b"", None),
        (b"identity", None),
        (b"gzip", b"gzip"),
        (b"deflate", b"deflate"),
        (b"deflate, GZIP", b"gzip"),  # equal weights: the server's order
        (b"gzip;q=0.5, deflate", b"deflate"),
        (b"x-gzip", b"gzip"),
        (b"gzip;q=0", None),
        (b"gzip;q=0, deflate;q=0", None),
        (b"*", b"gzip"),
        (b"*;q=1, gzip;q=0", b"deflate"),
        (b"br;q=1.0, *;q=0.1", b"gzip"),
        (b"gzip;q=abc", None),
        (b"x-gzip;q=0, gzip", b"gzip"),  # one coding under two names: either will do
    ],
)
def test_accepted_coding_reads_accept_encoding_as_rfc_9110_does(header, coding):
    assert accepted_coding(header) == coding


@pytest.mark.parametrize("workers", [0, 2], ids=["one-process", "protocol-workers"])
@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_compression_both_ways(serve, example_repo, workers, algorithm, binary):
    server = serve(example_repo, protocol_workers=workers)
    client = httpclient.InferenceServerClient(server.http)
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)]
    plain = client.infer("mlp", [inp], outputs=outputs).as_numpy("OUTPUT0")
    result = client.infer(
        "mlp", [inp], outputs=outputs,
        request_compression_algorithm=algorithm, response_compression_algorithm=algorithm,
    )  # fmt: skip
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), plain)
    client.close()


def raw_infer(address: str, accept: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v2/models/mlp/infer", body, {"Accept-Encoding": accept})
    response = conn.getresponse()
    answer = response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    conn.close()
    return answer


def mlp_body(rows: int, binary_output: bool = False) -> bytes:
    data = np.ones((rows, 16), np.float32).tolist()
    body: dict = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [rows, 16], "data": data}]}
    if binary_output:
        body["outputs"] = [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]
    return json.dumps(body).encode()


def answer(outputs: list[tuple[str, int]], spaced: bool = False) -> tuple[bytes, int]:
    """A binary answer: (datatype, bytes of binary data) per output -> (body, JSON header length)."""
    entries = [
        {"name": f"OUT{i}", "datatype": t, "shape": [n], "parameters": {"binary_data_size": n}}
        for i, (t, n) in enumerate(outputs)
    ]
    head = json.dumps({"outputs": entries}, separators=(", ", ": ") if spaced else (",", ":")).encode()
    return head + bytes(sum(n for _, n in outputs)), len(head)


@pytest.mark.parametrize(
    ("outputs", "spaced", "worth"),
    [
        ([("FP16", 2000)], False, False),  # ResNet's logits: 4-6 % smaller for ~50 us of the loop
        ([("FP32", 4096)], True, False),
        ([("FP32", 2048), ("BF16", 2048), ("FP64", 800)], False, False),
        ([("INT64", 4096)], False, True),  # token ids, class indices: small integers shrink a lot
        ([("FP32", 4096), ("INT32", 64)], False, True),
        ([("BOOL", 2048)], False, True),
        ([("BYTES", 2048)], False, True),
        ([("FP32", 40)] * 12, False, True),  # mostly JSON header: it compresses
    ],
)
def test_binary_floating_point_answers_are_not_worth_compressing(outputs, spaced, worth):
    body, header_length = answer(outputs, spaced)
    assert worth_compressing(body, header_length) is worth


def test_an_answer_whose_header_names_no_datatype_is_compressed() -> None:
    head = b'{"model_name":"m","outputs":[]}'
    assert worth_compressing(head + bytes(4096), len(head))


@pytest.mark.parametrize("workers", [0, 2], ids=["one-process", "protocol-workers"])
@pytest.mark.parametrize("offload", [256 * 1024, 64], ids=["on-the-loop", "on-a-worker-thread"])
def test_the_answer_is_compressed_only_when_accepted_and_errors_stay_plain(serve, example_repo, offload, workers):
    server = serve(example_repo, limits=Limits(json_offload_bytes=offload), protocol_workers=workers)
    status, headers, plain = raw_infer(server.http, "identity", mlp_body(16))
    assert status == 200 and "content-encoding" not in headers and len(plain) >= COMPRESS_MIN_BYTES
    status, headers, body = raw_infer(server.http, "br, gzip;q=0.8", mlp_body(16))
    assert (status, headers["content-encoding"], headers["vary"]) == (200, "gzip", "accept-encoding")
    assert json.loads(gzip.decompress(body)) == json.loads(plain)
    status, headers, body = raw_infer(server.http, "deflate", mlp_body(16))
    assert headers["content-encoding"] == "deflate" and json.loads(zlib.decompress(body)) == json.loads(plain)
    # a short answer goes as it is, whatever the client accepts (and says that it depends on the header)
    status, headers, small = raw_infer(server.http, "gzip", mlp_body(1))
    assert status == 200 and len(small) < COMPRESS_MIN_BYTES
    assert "content-encoding" not in headers and headers["vary"] == "accept-encoding"
    assert json.loads(small)["outputs"][0]["shape"][0] == 1
    # binary floating point data goes as it is: it would come out 4-6 % smaller for the loop's time
    status, headers, raw = raw_infer(server.http, "gzip", mlp_body(64, binary_output=True))
    assert status == 200 and "content-encoding" not in headers and headers["vary"] == "accept-encoding"
    assert len(raw) >= COMPRESS_MIN_BYTES and int(headers["inference-header-content-length"]) < len(raw) / 2
    status, headers, body = raw_infer(server.http, "gzip", b'{"inputs": 5}')  # a client error: plain JSON
    assert status == 400 and "content-encoding" not in headers and json.loads(body)["error"]
