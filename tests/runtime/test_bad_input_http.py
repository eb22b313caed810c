"""Client mistakes over HTTP: each one is a 4xx whose JSON ``error`` names the problem, never a 5xx or a hang.

Table-driven: every case is a raw HTTP request written to a socket of a live server, the exact status it
must get, and words its message must contain (the input, field or limit at fault). A connection that
was not closed must still serve the next request, and after the table a good request still succeeds.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import socket
import struct
import time
import zlib

import numpy as np
import pytest
import tritonclient.http as httpclient

from sluice.runtime.settings import Limits

MAX_ELEMENTS = 16 * 1024 * 1024  # Limits() defaults: the shared server runs with them
MAX_BODY = 64 * 1024 * 1024
MAX_HEADER = 16 * 1024


@dataclasses.dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    elapsed: float

    @property
    def error(self) -> str:
        doc = json.loads(self.body)
        assert isinstance(doc, dict) and set(doc) == {"error"}, doc
        assert isinstance(doc["error"], str) and doc["error"], doc
        return doc["error"]


class Conn:
    """A client socket with a receive buffer, so pipelined responses are read one at a time."""

    def __init__(self, address: str, timeout: float = 10.0) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.buffer = b""

    def __enter__(self) -> Conn:
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()

    def send(self, raw: bytes) -> None:
        try:
            self.sock.sendall(raw)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may answer and close before it read everything (431, 413); the answer counts

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        assert chunk, f"connection closed without a complete response (got {self.buffer[:200]!r})"
        self.buffer += chunk

    def reply(self) -> Reply:
        started = time.monotonic()
        while b"\r\n\r\n" not in self.buffer:
            self._fill()
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        version, status, *_ = lines[0].split(" ", 2)
        assert version == "HTTP/1.1", lines[0]
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers["content-length"])
        while len(self.buffer) < length:
            self._fill()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return Reply(int(status), headers, body, time.monotonic() - started)

    def closed(self, timeout: float = 2.0) -> bool:
        """True when the server closes the connection within ``timeout`` without sending more."""
        self.sock.settimeout(timeout)
        try:
            return not self.buffer and self.sock.recv(1) == b""
        except ConnectionResetError:
            return True


def request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: test\r\n"
    for name, value in (headers or {}).items():
        head += f"{name}: {value}\r\n"
    if body or method == "POST":
        head += f"Content-Length: {len(body)}\r\n"
    return head.encode("latin-1") + b"\r\n" + body


def infer(model: str, doc: object, headers: dict[str, str] | None = None) -> bytes:
    body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return request("POST", f"/v2/models/{model}/infer", body, headers)


def binary_infer(model: str, doc: dict, blob: bytes, header_length: object = None) -> bytes:
    head = json.dumps(doc).encode()
    length = len(head) if header_length is None else header_length
    return request("POST", f"/v2/models/{model}/infer", head + blob, {"Inference-Header-Content-Length": str(length)})


def fp32(name: str, shape: list, data: object = None, **params) -> dict:
    entry: dict = {"name": name, "datatype": "FP32", "shape": shape}
    if data is not None:
        entry["data"] = data
    if params:
        entry["parameters"] = params
    return entry


ONES = [1.0] * 16
GOOD = {"inputs": [fp32("INPUT0", [16], ONES), fp32("INPUT1", [16], ONES)]}
RAW16 = np.ones(16, np.float32).tobytes()
GOOD_GZIP = gzip.compress(json.dumps(GOOD).encode())


def bytes_blob(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def gzip_bomb(size: int) -> bytes:
    """``size`` zero bytes, gzip-compressed, built in slices so the test itself stays small."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = bytes(1 << 20)
    parts = [packer.compress(zeros) for _ in range(size >> 20)]
    parts.append(packer.flush())
    return b"".join(parts)


@dataclasses.dataclass
class Case:
    id: str
    raw: bytes
    status: int
    words: tuple[str, ...]
    closes: bool = False  # the server must close the connection after answering
    fast: bool = False  # must be answered in well under a second (no allocation behind it)


def case(id, raw, status, *words, closes=False, fast=False) -> Case:
    return Case(id, raw, status, words, closes, fast)


def with_input(index: int, **changes) -> dict:
    doc = json.loads(json.dumps(GOOD))
    doc["inputs"][index].update(changes)
    return doc


CASES = [
    # -- malformed JSON and wrong types --------------------------------------------------------
    case("truncated-json", infer("add_sub", b'{"inputs": [{"name": "INPUT0"'), 400, "not valid JSON"),
    case("not-json", infer("add_sub", b"hello"), 400, "not valid JSON"),
    case("empty-body", infer("add_sub", b""), 400, "not valid JSON"),
    case("deep-lists", infer("add_sub", b"[" * 10000 + b"]" * 10000), 400, "nested too deeply"),
    case("deep-objects", infer("add_sub", b'{"a":' * 10000 + b"1" + b"}" * 10000), 400, "nested too deeply"),
    case(
        "deep-data",
        infer("add_sub", {"inputs": [fp32("INPUT0", [1], [[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]])]}),
        400,
        "INPUT0",
        "nested",
        "16",
    ),
    case("body-is-list", infer("add_sub", [1, 2]), 400, "must be a JSON object", "list"),
    case("body-is-string", infer("add_sub", "inputs"), 400, "must be a JSON object", "str"),
    case("not-utf8", infer("add_sub", b'{"inputs": "\xff\xfe"}'), 400, "UTF-8"),
    case("huge-integer-literal", infer("add_sub", b'{"inputs": [' + b"9" * 5000 + b"]}"), 400, "not valid JSON"),
    case("no-inputs", infer("add_sub", {"outputs": []}), 400, "expected 2 inputs but got 0 inputs", "'INPUT0'"),
    case("inputs-not-list", infer("add_sub", {"inputs": {"INPUT0": 1}}), 400, "'inputs'"),
    case("empty-inputs", infer("add_sub", {"inputs": []}), 400, "expected 2 inputs but got 0 inputs", "'INPUT1'"),
    case("input-not-object", infer("add_sub", {"inputs": [5]}), 400, "inputs[0]", "object"),
    case(
        "input-without-name",
        infer("add_sub", {"inputs": [{"datatype": "FP32", "shape": [1], "data": [1]}]}),
        400,
        "inputs[0]",
        "'name'",
    ),
    case("name-not-string", infer("add_sub", with_input(0, name=7)), 400, "inputs[0]", "'name'"),
    case("id-not-string", infer("add_sub", {**GOOD, "id": 12}), 400, "'id'", "string"),
    case("parameters-not-object", infer("add_sub", {**GOOD, "parameters": [1]}), 400, "'parameters'", "object"),
    case(
        "binary-output-flag-not-bool",
        infer("add_sub", {**GOOD, "parameters": {"binary_data_output": "yes"}}),
        400,
        "binary_data_output",
    ),
    case("outputs-not-list", infer("add_sub", {**GOOD, "outputs": "OUTPUT0"}), 400, "'outputs'"),
    case("output-without-name", infer("add_sub", {**GOOD, "outputs": [{}]}), 400, "outputs[0]", "'name'"),
    case(
        "output-binary-flag-not-bool",
        infer("add_sub", {**GOOD, "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": 1}}]}),
        400,
        "OUTPUT0",
        "binary_data",
    ),
    case("priority-not-int", infer("add_sub", {**GOOD, "parameters": {"priority": "high"}}), 400, "priority"),
    case("timeout-negative", infer("add_sub", {**GOOD, "parameters": {"timeout": -1}}), 400, "timeout"),
    # -- datatypes -----------------------------------------------------------------------------
    case(
        "unknown-datatype",
        infer("add_sub", with_input(0, datatype="FLOAT32")),
        400,
        "INPUT0",
        "unknown datatype 'FLOAT32'",
        "FP32",
    ),
    case(
        "datatype-missing",
        infer("add_sub", {"inputs": [{"name": "INPUT0", "shape": [1], "data": [1]}]}),
        400,
        "INPUT0",
        "datatype",
    ),
    case(
        "wrong-datatype-for-model",
        infer("add_sub", with_input(0, datatype="INT32", data=[1] * 16)),
        400,
        "INPUT0",
        "INT32",
        "FP32",
    ),
    case("strings-for-fp32", infer("add_sub", with_input(0, data=["a"] * 16)), 400, "INPUT0", "FP32", "strings"),
    case("null-for-fp32", infer("add_sub", with_input(0, data=[None] * 16)), 400, "INPUT0", "FP32"),
    case(
        "floats-for-int",
        infer("add_sub", with_input(0, datatype="INT32", data=[0.5] * 16)),
        400,
        "INPUT0",
        "INT32",
        "integers",
    ),
    case(
        "ints-for-bool",
        infer("add_sub", with_input(0, datatype="BOOL", data=[1] * 16)),
        400,
        "INPUT0",
        "BOOL",
        "true/false",
    ),
    case(
        "int8-out-of-range",
        infer("add_sub", with_input(0, datatype="INT8", data=[300] * 16)),
        400,
        "INPUT0",
        "out of range",
        "INT8",
    ),
    case(
        "uint-negative",
        infer("add_sub", with_input(0, datatype="UINT32", data=[-1] * 16)),
        400,
        "INPUT0",
        "out of range",
        "UINT32",
    ),
    case(
        "integer-beyond-64-bits",
        infer("add_sub", with_input(0, datatype="INT64", data=[2**70] * 16)),
        400,
        "INPUT0",
        "INT64",
    ),
    case(
        "bytes-element-object",
        infer(
            "identity_bytes", {"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1, 1], "data": [{"a": 1}]}]}
        ),
        400,
        "INPUT0",
        "BYTES",
        "strings",
    ),
    case(
        "bytes-lone-surrogate",
        infer(
            "identity_bytes",
            b'{"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1, 1], "data": ["\\ud800"]}]}',
        ),
        400,
        "INPUT0",
        "Unicode",
    ),
    # -- unknown / missing inputs and outputs ----------------------------------------------------
    case("unknown-input", infer("add_sub", with_input(0, name="INPUT9")), 400, "INPUT9", "INPUT0, INPUT1"),
    case("missing-input", infer("add_sub", {"inputs": [fp32("INPUT0", [16], ONES)]}), 400, "missing", "INPUT1"),
    case(
        "duplicate-input",
        infer("add_sub", {"inputs": [fp32("INPUT0", [16], ONES)] * 2}),
        400,
        "input 'INPUT0' already exists in request",
    ),
    case(
        "unknown-output",
        infer("add_sub", {**GOOD, "outputs": [{"name": "OUTPUT9"}]}),
        400,
        "OUTPUT9",
        "OUTPUT0, OUTPUT1",
    ),
    case(
        "classification-count",
        infer("add_sub", {**GOOD, "outputs": [{"name": "OUTPUT0", "parameters": {"classification": -3}}]}),
        400,
        "OUTPUT0",
        "classification",
    ),
    # -- shapes ------------------------------------------------------------------------------
    case(
        "shape-missing",
        infer("add_sub", {"inputs": [{"name": "INPUT0", "datatype": "FP32", "data": ONES}]}),
        400,
        "INPUT0",
        "'shape'",
    ),
    case("shape-not-list", infer("add_sub", with_input(0, shape=16)), 400, "INPUT0", "'shape'", "list"),
    case("shape-entry-string", infer("add_sub", with_input(0, shape=["16"])), 400, "INPUT0", "integers", "'16'"),
    case("shape-entry-float", infer("add_sub", with_input(0, shape=[16.0])), 400, "INPUT0", "integers", "16.0"),
    case("negative-dim", infer("add_sub", with_input(0, shape=[-1])), 400, "INPUT0", ">= 0", "-1", fast=True),
    case("too-many-dims", infer("add_sub", with_input(0, shape=[1] * 33)), 400, "INPUT0", "33 dimensions"),
    case(
        "shape-product-overflows-int64",
        infer("add_sub", with_input(0, shape=[2**40, 2**40])),
        413,
        "INPUT0",
        str(MAX_ELEMENTS),
        "--max-elements",
        fast=True,
    ),
    case(
        "shape-product-overflows-uint64",
        infer("add_sub", with_input(0, shape=[2**62, 2**62, 2**62, 2**62])),
        413,
        "INPUT0",
        "--max-elements",
        fast=True,
    ),
    case(
        "zero-dim-hiding-huge-dims",
        infer("add_sub", with_input(0, shape=[0, 2**62, 2**62], data=[])),
        413,
        "INPUT0",
        "--max-elements",
        fast=True,
    ),
    case(
        "elements-over-limit",
        infer("add_sub", with_input(0, shape=[MAX_ELEMENTS + 1])),
        413,
        "INPUT0",
        str(MAX_ELEMENTS),
        fast=True,
    ),
    case(
        "data-shorter-than-shape",
        infer("add_sub", with_input(0, data=ONES[:15])),
        400,
        "input 'INPUT0' got unexpected elements count 15, expected 16",
        "[16]",
    ),
    case(
        "data-longer-than-shape",
        infer("add_sub", with_input(0, data=[*ONES, 1.0])),
        400,
        "input 'INPUT0' got unexpected elements count 17, expected 16",
        "[16]",
    ),
    case(
        "ragged-data",
        infer("add_sub", with_input(0, shape=[2, 2], data=[[1.0, 2.0], [3.0]])),
        400,
        "INPUT0",
        "regular array",
    ),
    case(
        "shape-disagrees-with-model",
        infer("add_sub", with_input(0, shape=[4, 4])),
        400,
        "INPUT0",
        "Expected [16], got [4,4]",
    ),
    case(
        "batch-over-max",
        infer("mlp", {"inputs": [fp32("INPUT0", [65, 16], [[0.0] * 16] * 65)]}),
        400,
        "batch-size",
        "64",
    ),
    case("batch-of-zero", infer("mlp", {"inputs": [fp32("INPUT0", [0, 16], [])]}), 400, "[0,16]", "batch size"),
    case("no-data", infer("add_sub", {"inputs": [fp32("INPUT0", [16])]}), 400, "INPUT0", "neither 'data'"),
    # -- binary tensor extension ----------------------------------------------------------------
    case(
        "header-length-larger-than-body",
        binary_infer("add_sub", GOOD, b"", header_length=99999),
        400,
        "Inference-Header-Content-Length",
        "99999",
    ),
    case(
        "header-length-negative",
        binary_infer("add_sub", GOOD, b"", header_length=-5),
        400,
        "Inference-Header-Content-Length",
        "-5",
    ),
    case(
        "header-length-not-a-number",
        binary_infer("add_sub", GOOD, b"", header_length="12abc"),
        400,
        "Inference-Header-Content-Length",
        "integer",
        "12abc",
    ),
    case(
        "header-length-zero-two-inputs",  # a raw binary request, for a model it cannot describe
        binary_infer("add_sub", GOOD, b"", header_length=0),
        400,
        "Raw request must only have 1 input",
    ),
    case("header-length-splits-json", binary_infer("add_sub", GOOD, b"", header_length=10), 400, "not valid JSON"),
    case(
        "binary-size-past-end",
        binary_infer(
            "add_sub",
            {"inputs": [fp32("INPUT0", [16], binary_data_size=64), fp32("INPUT1", [16], binary_data_size=64)]},
            RAW16,
        ),
        400,
        "INPUT1",
        "binary_data_size 64",
        "past the end",
        "0",
    ),
    case(
        "binary-size-wrong-for-shape",
        binary_infer(
            "add_sub",
            {"inputs": [fp32("INPUT0", [16], binary_data_size=60), fp32("INPUT1", [16], binary_data_size=68)]},
            RAW16 + RAW16,
        ),
        400,
        "input 'INPUT0' got unexpected elements count 15, expected 16",
    ),
    case(
        "binary-size-negative",
        binary_infer("add_sub", {"inputs": [fp32("INPUT0", [16], binary_data_size=-64)]}, RAW16),
        400,
        "INPUT0",
        "binary_data_size",
        "-64",
    ),
    case(
        "binary-size-not-int",
        binary_infer("add_sub", {"inputs": [fp32("INPUT0", [16], binary_data_size="64")]}, RAW16),
        400,
        "INPUT0",
        "binary_data_size",
    ),
    case(
        "binary-leftover-bytes",
        binary_infer(
            "add_sub",
            {"inputs": [fp32("INPUT0", [16], binary_data_size=64), fp32("INPUT1", [16], binary_data_size=64)]},
            RAW16 * 2 + b"xyz",
        ),
        400,
        "3 binary bytes",
        "no input claims",
    ),
    case(
        "binary-and-data",
        binary_infer("add_sub", {"inputs": [fp32("INPUT0", [16], ONES, binary_data_size=64)]}, RAW16),
        400,
        "INPUT0",
        "both",
    ),
    case(
        "bytes-length-prefix-lies",
        binary_infer(
            "identity_bytes",
            {
                "inputs": [
                    {"name": "INPUT0", "datatype": "BYTES", "shape": [1, 1], "parameters": {"binary_data_size": 7}}
                ]
            },
            struct.pack("<I", 100) + b"abc",
        ),
        400,
        "INPUT0",
        "claims 100 bytes",
        "3 remain",
    ),
    case(
        "bytes-fewer-elements-than-shape",
        binary_infer(
            "identity_bytes",
            {
                "inputs": [
                    {"name": "INPUT0", "datatype": "BYTES", "shape": [1, 3], "parameters": {"binary_data_size": 18}}
                ]
            },
            bytes_blob(b"ab", b"cd") + b"\0\0\0\0\0\0\0\0\0\0",
        ),
        400,
        "INPUT0",
        "BYTES",
    ),
    case(
        "bytes-leftover-inside-tensor",
        binary_infer(
            "identity_bytes",
            {
                "inputs": [
                    {"name": "INPUT0", "datatype": "BYTES", "shape": [1, 1], "parameters": {"binary_data_size": 9}}
                ]
            },
            bytes_blob(b"ab") + b"xyz",
        ),
        400,
        "INPUT0",
        "3 bytes left over",
    ),
    case(
        "bytes-count-too-big-for-data",
        binary_infer(
            "identity_bytes",
            {
                "inputs": [
                    {
                        "name": "INPUT0",
                        "datatype": "BYTES",
                        "shape": [1, MAX_ELEMENTS - 1],
                        "parameters": {"binary_data_size": 0},
                    }
                ]
            },
            b"",
        ),
        400,
        "INPUT0",
        "too short",
        fast=True,
    ),
    case(  # a 900-deep object passed as a parameter: --max-json-depth was checked only for tensor data
        "parameter-nested",
        infer("add_sub", {**GOOD, "parameters": {"deep": json.loads("[" * 900 + "]" * 900)}}),
        400,
        "request: parameter 'deep' is an array; allowed: a string, a number or a boolean",
    ),
    case(
        "input-parameter-object",
        infer("add_sub", with_input(0, parameters={"x": {"y": 1}})),
        400,
        "input 'INPUT0': parameter 'x' is an object",
    ),
    case("parameter-null", infer("add_sub", {**GOOD, "parameters": {"priority": None}}), 400, "'priority' is null"),
    # -- content encoding ---------------------------------------------------------------------
    case(
        "gzip-bomb",
        infer("add_sub", gzip_bomb(MAX_BODY + (1 << 20)), {"Content-Encoding": "gzip"}),
        413,
        "decompressed",
        str(MAX_BODY),
    ),
    case("gzip-garbage", infer("add_sub", b"not gzip at all", {"Content-Encoding": "gzip"}), 400, "gzip"),
    case(
        "gzip-truncated",
        infer("add_sub", gzip.compress(json.dumps(GOOD).encode())[:-12], {"Content-Encoding": "gzip"}),
        400,
        "gzip",
        "truncated",
    ),
    case(  # junk after a whole gzip member was ignored: the request ran on what came before it
        "gzip-trailing-junk",
        infer("add_sub", gzip.compress(json.dumps(GOOD).encode()) + b"junk after it", {"Content-Encoding": "gzip"}),
        400,
        "bytes after its last gzip member that are not gzip data",
    ),
    case(
        "gzip-short-trailing-junk",
        infer("add_sub", gzip.compress(json.dumps(GOOD).encode()) + b"\x1f\x8b", {"Content-Encoding": "gzip"}),
        400,
        "bytes after its last gzip member that are not a whole gzip member",
    ),
    case(  # each member costs a pass: a body of a million empty ones took minutes of the event loop
        "gzip-too-many-members",
        infer("add_sub", gzip.compress(json.dumps(GOOD).encode()) + gzip.compress(b"") * 2000,
              {"Content-Encoding": "gzip"}),
        400,
        "more than 1024 gzip members",
    ),
    case(
        "deflate-trailing-bytes",
        infer("add_sub", zlib.compress(json.dumps(GOOD).encode()) + b"x", {"Content-Encoding": "deflate"}),
        400,
        "after the end of its deflate data",
    ),
    case(
        "gzip-members-over-the-limit",  # each member small, together past the limit
        infer("add_sub", b"".join(gzip.compress(b" " * (MAX_BODY // 2)) for _ in range(3)),
              {"Content-Encoding": "gzip"}),
        413,
        "decompressed",
    ),
    case("deflate-garbage", infer("add_sub", b"\x00\x01\x02", {"Content-Encoding": "deflate"}), 400, "deflate"),
    case(
        "unknown-encoding",
        infer("add_sub", json.dumps(GOOD).encode(), {"Content-Encoding": "br"}),
        400,
        "Content-Encoding",
        "'br'",
        "gzip",
    ),
    # -- routes and methods -----------------------------------------------------------------------
    case("unknown-route", request("GET", "/favicon.ico"), 404, "/favicon.ico", "/v2"),
    case("unknown-v2-route", request("GET", "/v2/nothing"), 404, "/v2/nothing"),
    case("unknown-model-action", request("GET", "/v2/models/add_sub/explain"), 404, "/v2/models/add_sub/explain"),
    case("no-model-name", request("GET", "/v2/models/"), 404, "model name"),
    case("infer-with-get", request("GET", "/v2/models/add_sub/infer"), 405, "POST"),
    case("ready-with-put", request("PUT", "/v2/health/ready", b"{}"), 405, "PUT", "GET"),
    case("metadata-with-delete", request("DELETE", "/v2/models/add_sub"), 405, "DELETE", "GET"),
    case("repository-with-get", request("GET", "/v2/repository/index"), 405, "POST"),
    case("index-ready-as-text", request("POST", "/v2/repository/index", b'{"ready": "false"}'), 400,
         "'ready' must be true or false", '"false"'),
    case("index-body-a-list", request("POST", "/v2/repository/index", b"[true]"), 400, "must be a JSON object"),
    case("unknown-model-infer", infer("nope", GOOD), 404, "unknown model", "'nope'"),
    case(
        "unknown-version-infer",
        request("POST", "/v2/models/add_sub/versions/7/infer", json.dumps(GOOD).encode()),
        404,
        "'add_sub'",
        "version 7",
    ),
    case(
        "non-numeric-version",
        request("GET", "/v2/models/add_sub/versions/latest"),
        400,  # Triton parses the version before looking the model up
        "version string 'latest'",
        "integral value",
    ),
    case("unknown-model-metadata", request("GET", "/v2/models/nope"), 404, "'nope'"),
    case("unknown-model-config", request("GET", "/v2/models/nope/config"), 404, "'nope'"),
    case("unknown-model-stats", request("GET", "/v2/models/nope/stats"), 400, "model 'nope' is not available"),
    case("load-bad-json", request("POST", "/v2/repository/models/add_sub/load", b"{"), 400, "load request body"),
    case(
        "load-file-override-not-base64",
        request("POST", "/v2/repository/models/add_sub/load", b'{"parameters": {"file:1/model.onnx": "**"}}'),
        400,
        "file:1/model.onnx",
        "base64",
    ),
    # -- HTTP framing and limits ------------------------------------------------------------------
    case(
        "header-over-limit",
        request("GET", "/v2/health/ready", headers={"X-Big": "a" * (MAX_HEADER + 100)}),
        431,
        "--max-header-bytes",
        str(MAX_HEADER),
        closes=True,
    ),
    case(
        "many-headers-over-limit",
        request("GET", "/v2/health/ready", headers={f"X-H{i}": "v" * 20 for i in range(1000)}),
        431,
        "--max-header-bytes",
        closes=True,
    ),
    case(
        "url-over-limit",
        request("GET", "/v2/models/" + "m" * (MAX_HEADER + 10)),
        431,
        "--max-header-bytes",
        closes=True,
    ),
    case(
        "garbage-request-line",
        b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n",
        400,
        "malformed HTTP",
        closes=True,
    ),
    case(
        "content-length-not-number",
        b"POST /v2/models/add_sub/infer HTTP/1.1\r\nContent-Length: ten\r\n\r\n",
        400,
        "malformed HTTP",
        "Content-Length",
        closes=True,
    ),
    case(
        "content-length-twice",
        b"POST /v2/models/add_sub/infer HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}x",
        400,
        "malformed HTTP",
        closes=True,
    ),
    case(
        "bad-chunk-size",
        b"POST /v2/models/add_sub/infer HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        400,
        "malformed HTTP",
        closes=True,
    ),
    # a transfer coding other than chunked would leave the body encoded: refused, never read as JSON
    case(
        "transfer-encoding-gzip-chunked",
        b"POST /v2/models/add_sub/infer HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
        + b"%x\r\n%s\r\n0\r\n\r\n" % (len(GOOD_GZIP), GOOD_GZIP),
        501,
        "unsupported Transfer-Encoding 'gzip, chunked'",
        "allowed: chunked",
        "Content-Encoding",
        closes=True,
    ),
    case(
        "transfer-encoding-over-two-lines",
        b"POST /v2/models/add_sub/infer HTTP/1.1\r\nTransfer-Encoding: deflate\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\n\r\n",
        501,
        "unsupported Transfer-Encoding 'deflate, chunked'",
        closes=True,
    ),
    case(
        "transfer-encoding-gzip-alone",
        b"POST /v2/models/add_sub/infer HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
        501,
        "unsupported Transfer-Encoding 'gzip'",
        closes=True,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_request(shared_server, case):
    with Conn(shared_server.http) as conn:
        conn.send(case.raw)
        reply = conn.reply()
        assert reply.status == case.status, (reply.status, reply.body[:300])
        assert reply.headers["content-type"] == "application/json"
        message = reply.error
        for word in case.words:
            assert word in message, f"{word!r} not in {message!r}"
        if case.fast:
            assert reply.elapsed < 0.5, f"took {reply.elapsed:.2f}s: something was allocated or scanned"
        if case.closes:
            assert reply.headers.get("connection") == "close"
            assert conn.closed(), "the server must close the connection after this error"
        else:
            # a request-level error leaves the connection usable for the next request
            conn.send(request("GET", "/v2/health/ready"))
            assert conn.reply().status == 200


def test_body_over_limit_rejected_from_content_length(shared_server):
    """413 comes back as soon as the head is read; the body is never sent."""
    with Conn(shared_server.http, timeout=5) as conn:
        conn.send(b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY + 1))
        reply = conn.reply()
        assert reply.status == 413
        assert str(MAX_BODY) in reply.error and "--max-body-bytes" in reply.error
        assert reply.elapsed < 1.0
        assert conn.closed()


def test_elements_summed_over_inputs(serve, example_repo):
    server = serve(example_repo, limits=Limits(max_elements=100))
    with Conn(server.http, timeout=5) as conn:
        conn.send(infer("mlp", {"inputs": [fp32("INPUT0", [4, 16], [[0.0] * 16] * 4)]}))
        assert conn.reply().status == 200
        conn.send(infer("add_sub", {"inputs": [fp32("INPUT0", [60], [0.0] * 60), fp32("INPUT1", [60], [0.0] * 60)]}))
        reply = conn.reply()
        assert reply.status == 413
        assert "more than 100" in reply.error and "--max-elements" in reply.error


def test_chunked_body_over_limit(serve, example_repo):
    """Without Content-Length the limit is applied while the chunks arrive."""
    server = serve(example_repo, limits=Limits(max_body_bytes=1024))
    chunk = b"x" * 800
    with Conn(server.http, timeout=5) as conn:
        conn.send(
            b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
            + (b"%x\r\n%s\r\n" % (len(chunk), chunk)) * 2
        )
        reply = conn.reply()
        assert reply.status == 413
        assert "1024" in reply.error and "--max-body-bytes" in reply.error


def test_chunked_bodies_are_read_plain_and_gzip_encoded(shared_server):
    """Chunked is the one transfer coding the server undoes (any case, any chunk sizes); a body
    compressed end to end rides inside it with Content-Encoding."""
    body = json.dumps(GOOD).encode()

    def chunked(data: bytes, size: int) -> bytes:
        pieces = [data[i : i + size] for i in range(0, len(data), size)]
        return b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"

    head = b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: Chunked\r\n"
    with Conn(shared_server.http) as conn:
        conn.send(head + b"\r\n" + chunked(body, 7))
        conn.send(head + b"Content-Encoding: gzip\r\n\r\n" + chunked(gzip.compress(body), 50))
        for _ in range(2):
            reply = conn.reply()
            assert reply.status == 200, reply.body[:300]
            assert json.loads(reply.body)["outputs"][0]["data"] == [2.0] * 16


def test_a_gzip_body_of_several_members_is_read_whole(shared_server):
    """RFC 1952: a gzip file may be several members one after another (``cat a.gz b.gz``); every one
    is the body (only the first was read: the binary part after it was missing, a 400)."""
    head, blob = json.dumps(GOOD).encode(), b""
    split = len(head) // 2
    body = gzip.compress(head[:split]) + gzip.compress(head[split:]) + gzip.compress(blob)
    request_bytes = (b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\nContent-Encoding: gzip\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body)) + body
    with Conn(shared_server.http) as conn:
        conn.send(request_bytes)
        reply = conn.reply()
    assert reply.status == 200, reply.body[:300]
    assert json.loads(reply.body)["outputs"][0]["data"] == [2.0] * 16


def test_pipelined_errors_answered_in_order(shared_server):
    good = infer("add_sub", GOOD)
    with Conn(shared_server.http) as conn:
        conn.send(good + infer("add_sub", b"{") + infer("nope", GOOD) + request("GET", "/v2/x") + good)
        statuses = [conn.reply().status for _ in range(5)]
    assert statuses == [200, 400, 404, 404, 200]


def test_server_still_answers_after_the_table(shared_server):
    client = httpclient.InferenceServerClient(shared_server.http)
    try:
        assert client.is_server_ready()
        a = np.arange(16, dtype=np.float32)
        inputs = [httpclient.InferInput("INPUT0", [16], "FP32"), httpclient.InferInput("INPUT1", [16], "FP32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(a)
        result = client.infer("add_sub", inputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)
    finally:
        client.close()
