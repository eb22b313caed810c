"""Client mistakes over gRPC: each one is INVALID_ARGUMENT (or NOT_FOUND, RESOURCE_EXHAUSTED, UNIMPLEMENTED)
with a message naming the problem; never INTERNAL/UNKNOWN, a crash or a silently ended stream.

Messages are built by hand and sent as bytes over a raw ``grpc`` channel, so the server sees exactly what
a buggy or hostile client would send; a few cases go through ``tritonclient.grpc`` as users would.
"""

from __future__ import annotations

import dataclasses

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

from sluice.runtime.settings import Limits

SERVICE = "/inference.GRPCInferenceService/"
MAX_ELEMENTS = 16 * 1024 * 1024
RAW16 = np.ones(16, np.float32).tobytes()
UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


@pytest.fixture(scope="module")
def channel(shared_server):
    with grpc.insecure_channel(shared_server.grpc, options=UNLIMITED) as chan:
        yield chan


def call(chan: grpc.Channel, method: str, payload: bytes) -> bytes:
    return chan.unary_unary(SERVICE + method)(payload, timeout=10)


def add_input(message: pb.ModelInferRequest, name: str, datatype: str, shape: list[int], raw: bytes | None = None):
    tensor = message.inputs.add(name=name, datatype=datatype, shape=shape)
    if raw is not None:
        message.raw_input_contents.append(raw)
    return tensor


def good(model: str = "add_sub") -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name=model)
    add_input(message, "INPUT0", "FP32", [16], RAW16)
    add_input(message, "INPUT1", "FP32", [16], RAW16)
    return message


def edit(change) -> bytes:
    message = good()
    change(message)
    return message.SerializeToString()


def typed(datatype: str, field: str, values: list, shape: list[int] | None = None) -> bytes:
    message = pb.ModelInferRequest(model_name="add_sub")
    tensor = add_input(message, "INPUT0", datatype, shape or [len(values)])
    getattr(tensor.contents, field).extend(values)
    return message.SerializeToString()


def set_shape(index: int, shape: list[int], raw: bytes | None = None):
    def change(message):
        del message.inputs[index].shape[:]
        message.inputs[index].shape.extend(shape)
        if raw is not None:
            message.raw_input_contents[index] = raw

    return change


def with_output(name: str, **params):
    def change(message):
        out = message.outputs.add(name=name)
        for key, value in params.items():
            out.parameters[key].int64_param = value

    return change


def with_param(key: str, value: str):
    def change(message):
        message.parameters[key].string_param = value

    return change


def bytes_request(raw: bytes, shape: list[int]) -> bytes:
    message = pb.ModelInferRequest(model_name="identity_bytes")
    add_input(message, "INPUT0", "BYTES", shape, raw)
    return message.SerializeToString()


VALID = good().SerializeToString()


@dataclasses.dataclass
class Case:
    id: str
    payload: bytes
    code: grpc.StatusCode
    words: tuple[str, ...]


INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED

CASES = [
    Case("garbage-bytes", b"\xff\xff\xff\xff", INVALID, ("not a valid protobuf", "inference.ModelInferRequest")),
    Case("truncated-message", good().SerializeToString()[:-7], INVALID, ("not a valid protobuf",)),
    Case("length-prefix-overruns", b"\x0a\x64abc", INVALID, ("not a valid protobuf",)),
    Case("invalid-utf8-in-string", b"\x0a\x02\xff\xfe", INVALID, ("not a valid protobuf",)),
    Case("empty-message", b"", INVALID, ("model_name",)),
    Case("no-inputs", pb.ModelInferRequest(model_name="add_sub").SerializeToString(), INVALID, ("input",)),
    Case(
        "raw-count-mismatch",
        edit(lambda m: m.raw_input_contents.pop()),
        INVALID,
        ("raw_input_contents has 1 entries", "2 inputs"),
    ),
    Case(
        "raw-size-mismatch",
        edit(lambda m: m.raw_input_contents.__setitem__(0, b"abc")),
        INVALID,
        ("INPUT0", "3 bytes", "needs 64"),
    ),
    Case(
        "raw-and-typed-contents",
        edit(lambda m: m.inputs[0].contents.fp32_contents.extend([1.0] * 16)),
        INVALID,
        ("contents field must not be specified when using raw_input_contents for 'INPUT0' for model 'add_sub'",),
    ),
    Case(
        # Triton's case: one input typed, the other raw (so the raw entries are one short as well)
        "raw-and-typed-contents-on-another-input",
        edit(lambda m: (m.raw_input_contents.pop(), m.inputs[1].contents.fp32_contents.extend([1.0] * 16))),
        INVALID,
        ("contents field must not be specified when using raw_input_contents for 'INPUT1' for model 'add_sub'",),
    ),
    Case(
        "typed-count-mismatch",
        typed("FP32", "fp32_contents", [1.0] * 3, shape=[16]),
        INVALID,
        ("INPUT0", "3 values", "fp32_contents", "needs 16"),
    ),
    Case(
        "typed-field-of-another-type",
        typed("FP32", "int_contents", [1] * 16),
        INVALID,
        ("INPUT0", "0 values", "fp32_contents"),
    ),
    Case("typed-fp16", typed("FP16", "fp32_contents", [1.0]), INVALID, ("INPUT0", "FP16", "raw_input_contents")),
    Case("typed-int8-out-of-range", typed("INT8", "int_contents", [1000]), INVALID, ("INPUT0", "out of range", "INT8")),
    Case(
        "unknown-datatype",
        edit(lambda m: setattr(m.inputs[0], "datatype", "FLOAT")),
        INVALID,
        ("INPUT0", "unknown datatype 'FLOAT'", "FP32"),
    ),
    Case(
        "wrong-datatype-for-model",
        edit(lambda m: setattr(m.inputs[0], "datatype", "INT32")),
        INVALID,
        ("INPUT0", "INT32", "FP32"),
    ),
    Case("negative-dim", edit(set_shape(0, [-16])), INVALID, ("INPUT0", ">= 0", "-16")),
    Case("too-many-dims", edit(set_shape(0, [1] * 33)), INVALID, ("INPUT0", "33 dimensions")),
    Case("overflowing-dims", edit(set_shape(0, [2**40, 2**40])), EXHAUSTED, ("INPUT0", "--max-elements")),
    Case("int64-max-dims", edit(set_shape(0, [2**63 - 1, 2**63 - 1])), EXHAUSTED, ("INPUT0", "--max-elements")),
    Case("zero-dim-hiding-huge", edit(set_shape(0, [0, 2**62, 2**62], b"")), EXHAUSTED, ("INPUT0", "--max-elements")),
    Case("elements-over-limit", edit(set_shape(0, [MAX_ELEMENTS + 1])), EXHAUSTED, ("INPUT0", str(MAX_ELEMENTS))),
    Case("shape-disagrees-with-model", edit(set_shape(0, [4, 4])), INVALID, ("INPUT0", "Expected [16], got [4,4]")),
    Case("unknown-input", edit(lambda m: setattr(m.inputs[1], "name", "INPUT9")), INVALID, ("INPUT9",)),
    Case("missing-input", edit(lambda m: (m.inputs.pop(), m.raw_input_contents.pop())), INVALID, ("INPUT1",)),
    Case("input-without-name", edit(lambda m: setattr(m.inputs[0], "name", "")), INVALID, ("inputs[0]", "name")),
    Case("unknown-output", edit(with_output("OUTPUT9")), INVALID, ("OUTPUT9",)),
    Case("bad-priority", edit(with_param("priority", "high")), INVALID, ("priority",)),
    Case(
        "classification-count",
        edit(with_output("OUTPUT0", classification=-3)),
        INVALID,
        ("OUTPUT0", "classification"),
    ),
    Case("unknown-model", edit(lambda m: setattr(m, "model_name", "nope")), grpc.StatusCode.NOT_FOUND, ("'nope'",)),
    Case(
        "unknown-version",
        edit(lambda m: setattr(m, "model_version", "7")),
        grpc.StatusCode.NOT_FOUND,
        ("'add_sub'", "version 7"),
    ),
    Case(
        "bytes-length-prefix-lies",
        bytes_request(b"\x64\x00\x00\x00abc", [1, 1]),
        INVALID,
        ("INPUT0", "claims 100 bytes", "3 remain"),
    ),
    Case("bytes-leftover", bytes_request(b"\x01\x00\x00\x00abc", [1, 1]), INVALID, ("INPUT0", "2 bytes left over")),
    Case(
        "bytes-count-too-big-for-data",
        bytes_request(b"", [1, MAX_ELEMENTS - 1]),
        INVALID,
        ("INPUT0", "too short"),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_infer_request(channel, case):
    with pytest.raises(grpc.RpcError) as info:
        call(channel, "ModelInfer", case.payload)
    assert info.value.code() == case.code, info.value.details()
    for word in case.words:
        assert word in info.value.details(), f"{word!r} not in {info.value.details()!r}"


@pytest.mark.parametrize("method", ["ServerLive", "ModelReady", "ModelMetadata", "ModelConfig", "RepositoryIndex"])
def test_unparsable_message_on_any_method(channel, method):
    with pytest.raises(grpc.RpcError) as info:
        call(channel, method, b"\xff\xff\xff")
    assert info.value.code() == INVALID
    assert "not a valid protobuf" in info.value.details()


def test_unparsable_message_on_a_stream_is_answered_and_the_stream_goes_on(channel):
    stream = channel.stream_stream(SERVICE + "ModelStreamInfer")
    requests = [b"\xff\xff", good().SerializeToString(), edit(set_shape(0, [-1]))]
    replies = [pb.ModelStreamInferResponse.FromString(r) for r in stream(iter(requests), timeout=10)]
    assert len(replies) == 3
    errors = sorted(r.error_message for r in replies if r.error_message)
    assert len(errors) == 2
    assert ">= 0" in errors[0] and "not a valid protobuf" in errors[1]
    (ok,) = [r for r in replies if not r.error_message]
    assert ok.infer_response.model_name == "add_sub"


def test_unknown_method(channel):
    with pytest.raises(grpc.RpcError) as info:
        call(channel, "Explain", b"")
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("front_end", ["h2", "grpcio"])
def test_message_over_max_grpc_message_bytes(serve, example_repo, front_end):
    server = serve(example_repo, limits=Limits(max_grpc_message_bytes=1 << 20), grpc_server=front_end)
    with grpc.insecure_channel(server.grpc, options=UNLIMITED) as chan:
        with pytest.raises(grpc.RpcError) as info:
            call(chan, "ModelInfer", edit(lambda m: m.raw_input_contents.__setitem__(0, bytes(2 << 20))))
        assert info.value.code() == EXHAUSTED
        assert "larger than max" in info.value.details()
        pb.ModelInferResponse.FromString(call(chan, "ModelInfer", good().SerializeToString()))


@pytest.mark.parametrize("front_end", ["h2", "grpcio"])
@pytest.mark.parametrize("name", ["x" * 20000, "x" + "\u00e9" * 1000, "xx" + "\u00e9" * 1000],
                         ids=["long", "accents", "accents-shifted"])
def test_a_long_error_message_is_cut_whole_and_keeps_its_code(serve, example_repo, front_end, name):
    """Errors naming a long model name: the h2 server cut the encoded text inside a %XX escape or a
    character (clients then read it all as latin-1: '\u00a9\u00c3\u00a9\u00c3...'), and grpcio's trailers
    overran the clients' 16 KiB metadata limit (RESOURCE_EXHAUSTED instead of NOT_FOUND)."""
    from sluice.runtime.protocol import grpc_h2, grpc_status

    server = serve(example_repo, grpc_server=front_end)
    client = grpcclient.InferenceServerClient(server.grpc)
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata(name)
    assert info.value.status() == "StatusCode.NOT_FOUND"
    message = info.value.message()
    body = message.removeprefix("Request for unknown model: '")
    assert body != message and name.startswith(body)  # cut within the name, character by character
    assert "\u00c3" not in message and len(grpc_h2.percent_encode(message)) <= grpc_status.MAX_MESSAGE_BYTES
    client.close()


@pytest.mark.parametrize(("text", "limit", "kept"), [
    ("abc", 10, "abc"), ("abcdef", 3, "abc"), ("%%%", 7, "%%"), ("\u00e9\u00e9", 6, "\u00e9"), ("\u00e9\u00e9", 5, ""),
    ("a\U0001f600b", 13, "a\U0001f600"),  # 4 bytes, each escaped: 12
])
def test_clipped_cuts_at_characters_within_the_encoded_budget(text, limit, kept):
    from sluice.runtime.protocol import grpc_status

    assert grpc_status.clipped(text, limit) == kept


def test_tritonclient_sees_the_codes(shared_server):
    client = grpcclient.InferenceServerClient(shared_server.grpc)
    try:
        a = np.ones(16, np.float32)
        inputs = [grpcclient.InferInput("INPUT0", [16], "FP32"), grpcclient.InferInput("INPUT1", [16], "FP32")]
        for tensor in inputs:
            tensor.set_data_from_numpy(a)
        with pytest.raises(InferenceServerException, match="unknown model") as info:
            client.infer("nope", inputs)
        assert info.value.status() == "StatusCode.NOT_FOUND"
        with pytest.raises(InferenceServerException, match="classification") as info:
            client.infer("add_sub", inputs, outputs=[grpcclient.InferRequestedOutput("OUTPUT0", class_count=-2)])
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        wrong = grpcclient.InferInput("INPUT0", [16], "INT32")
        wrong.set_data_from_numpy(np.ones(16, np.int32))
        with pytest.raises(InferenceServerException, match="INT32") as info:
            client.infer("add_sub", [wrong, inputs[1]])
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        # and a good request still works on the same client
        result = client.infer("add_sub", inputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)
    finally:
        client.close()


def test_server_still_answers_after_the_table(channel):
    response = pb.ModelInferResponse.FromString(call(channel, "ModelInfer", good().SerializeToString()))
    assert np.frombuffer(response.raw_output_contents[0], np.float32).tolist() == [2.0] * 16
    assert pb.ServerReadyResponse.FromString(call(channel, "ServerReady", b"")).ready


def test_grpcio_front_end_gives_the_same_codes(serve, example_repo):
    """The fallback front end (``--grpc-server grpcio``) answers the same table the same way."""
    server = serve(example_repo, grpc_server="grpcio")
    with grpc.insecure_channel(server.grpc, options=UNLIMITED) as chan:
        for case in CASES:
            if b"identity_bytes" in case.payload:
                continue  # not in example_repo
            with pytest.raises(grpc.RpcError) as info:
                call(chan, "ModelInfer", case.payload)
            assert info.value.code() == case.code, (case.id, info.value.details())
            assert all(word in info.value.details() for word in case.words), (case.id, info.value.details())
        for method in ("ServerLive", "ModelMetadata"):
            with pytest.raises(grpc.RpcError) as info:
                call(chan, method, b"\xff\xff\xff")
            assert info.value.code() == INVALID
        stream = chan.stream_stream(SERVICE + "ModelStreamInfer")
        replies = [pb.ModelStreamInferResponse.FromString(r) for r in stream(iter([b"\xff", VALID]), timeout=10)]
        assert sorted(bool(r.error_message) for r in replies) == [False, True]
