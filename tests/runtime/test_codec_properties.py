"""Properties of the wire codecs (``http_codec``, ``grpc_codec``), checked with hypothesis.

1. Totality: whatever bytes, JSON or protobuf a client sends, ``decode_infer`` returns a request or raises a
   4xx ``SluiceError`` with a message, never anything else (numpy warnings are errors under pytest, so an
   overflowing cast fails here too).
2. Round trips, for every datatype, JSON and binary: what the server encodes, tritonclient decodes to the
   same tensor; what tritonclient encodes, the server decodes to the same tensor.

Examples are derandomized so a run is reproducible; limits are small so that shapes near them are cheap.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import text_format
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import serialize_byte_tensor

from sluice.runtime import remote, tensor_bytes
from sluice.runtime.errors import SluiceError
from sluice.runtime.protocol import grpc_codec, http_codec
from sluice.runtime.settings import Limits
from sluice.runtime.signature import signature_of
from sluice.runtime.types import DATATYPES, InferRequest, InferResponse, RequestedOutput, Tensor, numpy_dtype

LIMITS = Limits(max_elements=4096, max_json_depth=16)
FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
ROUND_TRIP = settings(FUZZ, max_examples=40)

TYPED_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def decoded_or_rejected(decode, *args) -> InferRequest | None:
    """Run a decoder; only a decoded request or a 4xx SluiceError with a message may come out."""
    try:
        request = decode(*args)
    except SluiceError as exc:
        assert 400 <= exc.http_status < 500, f"{type(exc).__name__} ({exc.http_status}): {exc.message}"
        assert exc.message
        return None
    assert isinstance(request, InferRequest)
    total = 0
    for tensor in request.inputs:
        assert tensor.datatype in DATATYPES
        assert tensor.data.dtype == numpy_dtype(tensor.datatype)
        total += tensor.data.size
    assert total <= LIMITS.max_elements
    return request


# -- strategies -----------------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=25,
)
dims = st.one_of(
    st.integers(min_value=0, max_value=6),
    st.integers(min_value=-3, max_value=-1),
    st.sampled_from([0, 2**31, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64, 2**80]),
    scalars,
)
shapes = st.lists(dims, max_size=5) | json_values
numbers = st.one_of(st.integers(min_value=-300, max_value=300), st.floats(width=32), st.booleans())
nested_data = st.recursive(st.lists(numbers, max_size=6), lambda inner: st.lists(inner, max_size=3), max_leaves=40)
datatypes = st.sampled_from([*DATATYPES, "FLOAT", "", "fp32"]) | json_values
input_docs = st.fixed_dictionaries(
    {"name": st.sampled_from(["INPUT0", "INPUT1", ""]) | json_values},
    optional={
        "datatype": datatypes,
        "shape": shapes,
        "data": nested_data | json_values | st.lists(st.text(max_size=4), max_size=6),
        "parameters": st.fixed_dictionaries(
            {}, optional={"binary_data_size": st.integers(min_value=-4, max_value=80) | json_values}
        )
        | json_values,
    },
)
output_docs = st.fixed_dictionaries(
    {"name": st.sampled_from(["OUTPUT0", "x"]) | json_values},
    optional={
        "parameters": st.fixed_dictionaries(
            {}, optional={"binary_data": json_values, "classification": st.integers(0, 3)}
        )
        | json_values
    },
)
request_docs = st.fixed_dictionaries(
    {},
    optional={
        "id": st.text(max_size=5) | json_values,
        "inputs": st.lists(input_docs, max_size=3) | json_values,
        "outputs": st.lists(output_docs, max_size=2) | json_values,
        "parameters": st.dictionaries(st.sampled_from(["binary_data_output", "priority", "timeout"]), json_values)
        | json_values,
    },
)


def http_decode(body: bytes, header_length: int | None) -> InferRequest | None:
    return decoded_or_rejected(http_codec.decode_infer, body, header_length, "m", "", LIMITS)


def grpc_decode(message: pb.ModelInferRequest) -> InferRequest | None:
    return decoded_or_rejected(grpc_codec.decode_infer, message, LIMITS)


def valid_binary_body() -> tuple[bytes, int]:
    """A request as tritonclient writes it: FP32 and BYTES inputs in the binary extension, one in JSON."""
    a = httpclient.InferInput("INPUT0", [2, 3], "FP32").set_data_from_numpy(
        np.arange(6, dtype=np.float32).reshape(2, 3)
    )
    b = httpclient.InferInput("INPUT1", [2], "BYTES").set_data_from_numpy(np.array([b"ab", b"\x00c"], dtype=object))
    c = httpclient.InferInput("INPUT2", [3], "INT8")
    c.set_data_from_numpy(np.array([1, -2, 3], dtype=np.int8), binary_data=False)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)]
    body, json_size = httpclient.InferenceServerClient.generate_request_body([a, b, c], outputs, request_id="r")
    return body, json_size


VALID_BODY, VALID_HEADER_LENGTH = valid_binary_body()


def mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """Apply byte edits: (op, position, value) with op 0 flip, 1 insert, 2 delete, 3 truncate, 4 duplicate."""
    out = bytearray(data)
    for op, position, value in edits:
        if not out:
            break
        at = position % len(out)
        if op == 0:
            out[at] ^= value or 1
        elif op == 1:
            out.insert(at, value)
        elif op == 2:
            del out[at : at + 1 + value % 8]
        elif op == 3:
            del out[at:]
        else:
            out[at:at] = out[at : at + 1 + value % 16]
    return bytes(out)


byte_edits = st.lists(
    st.tuples(st.integers(0, 4), st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=6
)


# -- HTTP decoder: totality ------------------------------------------------------------------------


@FUZZ
@given(body=st.binary(max_size=300), header_length=st.none() | st.integers(min_value=-10, max_value=400))
def test_http_decode_arbitrary_bytes(body, header_length):
    http_decode(body, header_length)


@FUZZ
@given(doc=json_values)
def test_http_decode_arbitrary_json(doc):
    http_decode(json.dumps(doc).encode(), None)


RAW_CONFIGS = {
    "batched-variable": 'max_batch_size: 8 input [{ name: "I", data_type: TYPE_FP32, dims: [ -1 ] }]',
    "fixed": 'input [{ name: "I", data_type: TYPE_INT16, dims: [ 2, 3 ] }]',
    "one-string": 'input [{ name: "I", data_type: TYPE_STRING, dims: [ 1 ] }]',
    "many-strings": 'input [{ name: "I", data_type: TYPE_STRING, dims: [ -1 ] }]',
    "two-variable": 'input [{ name: "I", data_type: TYPE_FP64, dims: [ -1, -1 ] }]',
    "two-inputs": 'input [{ name: "A", data_type: TYPE_BOOL, dims: [ 1 ] }, '
    '{ name: "B", data_type: TYPE_BOOL, dims: [ 1 ] }]',
}
RAW_SIGNATURES = {
    key: signature_of(text_format.Parse(config, mc.ModelConfig()), "m") for key, config in RAW_CONFIGS.items()
}


@pytest.mark.parametrize("config", list(RAW_CONFIGS))
@FUZZ
@given(body=st.binary(max_size=300))
def test_http_decode_raw_binary_request(config, body):
    """Inference-Header-Content-Length: 0: a request for the model's one input holding exactly the body, or a 4xx."""
    request = decoded_or_rejected(http_codec.decode_raw, body, RAW_SIGNATURES[config], "m", "", LIMITS)
    if request is None:
        return
    (tensor,) = request.inputs
    if tensor.datatype == "BYTES":
        assert tensor.data.ravel().tolist() == [body]
    else:
        assert tensor.data.tobytes() == body
    assert request.parameters == {"binary_data_output": True}


@FUZZ
@given(doc=request_docs, blob=st.binary(max_size=80), lie=st.none() | st.integers(min_value=-5, max_value=50))
def test_http_decode_request_shaped_json(doc, blob, lie):
    head = json.dumps(doc).encode()
    if lie is None:
        http_decode(head, None)
    else:
        http_decode(head + blob, len(head) + lie)


@FUZZ
@given(edits=byte_edits, length_shift=st.integers(min_value=-20, max_value=20))
def test_http_decode_mutated_valid_request(edits, length_shift):
    assert http_decode(VALID_BODY, VALID_HEADER_LENGTH) is not None  # the unmutated request decodes
    http_decode(mutate(VALID_BODY, edits), VALID_HEADER_LENGTH + length_shift)


@FUZZ
@given(data=st.data())
def test_http_decode_valid_request_with_one_field_replaced(data):
    head = json.loads(VALID_BODY[:VALID_HEADER_LENGTH])
    node = head
    path = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=4))
    for step in path[:-1]:  # walk down a random path, then replace what is there
        children = list(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []
        if not children:
            break
        key = children[step % len(children)]
        if not isinstance(node[key], dict | list):
            break
        node = node[key]
    children = list(node) if isinstance(node, dict) else list(range(len(node)))
    if children:
        node[children[path[-1] % len(children)]] = data.draw(json_values)
    new_head = json.dumps(head).encode()
    http_decode(new_head + VALID_BODY[VALID_HEADER_LENGTH:], len(new_head))


# -- gRPC decoder: totality ------------------------------------------------------------------------


def decode_if_parsable(data: bytes) -> None:
    try:
        message = pb.ModelInferRequest.FromString(data)
    except DecodeError:  # the transport answers these (INVALID_ARGUMENT, see test_bad_input_grpc)
        return
    grpc_decode(message)


def valid_grpc_message() -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="m", id="r")
    message.inputs.add(name="INPUT0", datatype="FP32", shape=[2, 3])
    message.raw_input_contents.append(np.arange(6, dtype=np.float32).tobytes())
    message.inputs.add(name="INPUT1", datatype="BYTES", shape=[2])
    message.raw_input_contents.append(serialize_byte_tensor(np.array([b"ab", b"c"], dtype=object)).item())
    message.outputs.add(name="OUTPUT0")
    return message


VALID_GRPC = valid_grpc_message().SerializeToString()

int64s = st.integers(min_value=-(2**63), max_value=2**63 - 1)
grpc_dims = st.one_of(st.integers(-2, 6), st.sampled_from([0, 2**32, 2**62, 2**63 - 1, -(2**63)]), int64s)


@st.composite
def grpc_messages(draw) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name=draw(st.sampled_from(["m", ""])), id=draw(st.text(max_size=4)))
    for _ in range(draw(st.integers(0, 3))):
        tensor = message.inputs.add(
            name=draw(st.sampled_from(["INPUT0", "INPUT1", ""])),
            datatype=draw(st.sampled_from([*DATATYPES, "FLOAT", ""])),
            shape=draw(st.lists(grpc_dims, max_size=4)),
        )
        field = draw(st.sampled_from([None, *sorted(set(TYPED_FIELD.values()))]))
        if field is not None:
            values = {
                "bool_contents": st.booleans(),
                "int_contents": st.integers(-(2**31), 2**31 - 1),
                "int64_contents": int64s,
                "uint_contents": st.integers(0, 2**32 - 1),
                "uint64_contents": st.integers(0, 2**64 - 1),
                "fp32_contents": st.floats(width=32),
                "fp64_contents": st.floats(),
                "bytes_contents": st.binary(max_size=6),
            }[field]
            getattr(tensor.contents, field).extend(draw(st.lists(values, max_size=8)))
        if draw(st.booleans()):
            tensor.parameters["p"].int64_param = draw(int64s)
    for _ in range(draw(st.integers(0, 3))):
        message.raw_input_contents.append(draw(st.binary(max_size=48)))
    for _ in range(draw(st.integers(0, 2))):
        out = message.outputs.add(name=draw(st.sampled_from(["OUTPUT0", ""])))
        if draw(st.booleans()):
            out.parameters["classification"].int64_param = draw(st.integers(0, 3))
    if draw(st.booleans()):
        message.parameters["priority"].string_param = draw(st.text(max_size=3))
    return message


@FUZZ
@given(data=st.binary(max_size=300))
def test_grpc_decode_arbitrary_bytes(data):
    decode_if_parsable(data)


@FUZZ
@given(message=grpc_messages())
def test_grpc_decode_arbitrary_messages(message):
    grpc_decode(message)


@FUZZ
@given(edits=byte_edits)
def test_grpc_decode_mutated_valid_request(edits):
    assert grpc_decode(pb.ModelInferRequest.FromString(VALID_GRPC)) is not None
    decode_if_parsable(mutate(VALID_GRPC, edits))


# -- round trips -----------------------------------------------------------------------------------

small_shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)


def arrays_of(datatype: str, text_only: bool = False) -> st.SearchStrategy[np.ndarray]:
    """Arrays as the codecs hold them in memory: BF16 as uint16 bit patterns, BYTES as object arrays."""
    if datatype == "BYTES":
        elements = st.text(max_size=6).map(str.encode) if text_only else st.binary(max_size=6)
        return hnp.arrays(object, small_shapes, elements=elements)
    if datatype == "BF16":
        return hnp.arrays(np.uint16, small_shapes)
    dtype = numpy_dtype(datatype)
    if dtype.kind == "f":
        return hnp.arrays(dtype, small_shapes, elements=st.floats(width=dtype.itemsize * 8))
    return hnp.arrays(dtype, small_shapes)


def is_bf16_nan(bits: np.ndarray) -> np.ndarray:
    return ((bits & 0x7F80) == 0x7F80) & ((bits & 0x007F) != 0)


def assert_same(datatype: str, expected: np.ndarray, got: np.ndarray) -> None:
    """``got`` as a client or the server holds it equals ``expected`` as the codecs hold it."""
    assert tuple(got.shape) == expected.shape
    if datatype == "BYTES":
        assert [g if isinstance(g, bytes) else g.encode() for g in got.ravel()] == list(expected.ravel())
    elif datatype == "BF16":
        bits = got.view(np.uint16) if got.dtype != np.uint16 else got
        nan = is_bf16_nan(expected)
        np.testing.assert_array_equal(is_bf16_nan(bits), nan)
        np.testing.assert_array_equal(bits[~nan], expected[~nan])
    else:
        assert got.dtype == expected.dtype
        np.testing.assert_array_equal(got, expected)  # NaN == NaN here


def response_with(datatype: str, array: np.ndarray) -> InferResponse:
    return InferResponse("m", "1", [Tensor("OUT", datatype, array)], id="r")


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("datatype", DATATYPES)
@ROUND_TRIP
@given(data=st.data())
def test_http_response_round_trip(datatype, binary, data):
    array = data.draw(arrays_of(datatype, text_only=not binary))
    request = InferRequest("m", "1", [], [RequestedOutput("OUT", binary)])
    body, header_length = http_codec.encode_infer(request, response_with(datatype, array))
    result = httpclient.InferResult.from_response_body(body, header_length=header_length)
    assert_same(datatype, array, result.as_numpy("OUT"))


@pytest.mark.parametrize("datatype", DATATYPES)
@ROUND_TRIP
@given(data=st.data())
def test_grpc_response_round_trip(datatype, data):
    array = data.draw(arrays_of(datatype))
    message = pb.ModelInferResponse.FromString(
        grpc_codec.encode_infer(response_with(datatype, array)).SerializeToString()
    )
    assert_same(datatype, array, grpcclient.InferResult(message).as_numpy("OUT"))


def client_array(datatype: str, array: np.ndarray) -> np.ndarray:
    return array.view(ml_dtypes.bfloat16) if datatype == "BF16" else array


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("datatype", DATATYPES)
@ROUND_TRIP
@given(data=st.data())
def test_http_request_round_trip(datatype, binary, data):
    if datatype == "BF16" and not binary:
        pytest.skip("tritonclient sends BF16 only in the binary extension")
    array = data.draw(arrays_of(datatype, text_only=not binary))
    tensor = httpclient.InferInput("IN", list(array.shape), datatype)
    tensor.set_data_from_numpy(client_array(datatype, array), binary_data=binary)
    body, json_size = httpclient.InferenceServerClient.generate_request_body([tensor])
    request = http_codec.decode_infer(body, json_size, "m", "", LIMITS)
    (decoded,) = request.inputs
    assert decoded.name == "IN" and decoded.datatype == datatype
    assert_same(datatype, array, decoded.data)


@pytest.mark.parametrize("typed", [False, True], ids=["raw", "typed"])
@pytest.mark.parametrize("datatype", DATATYPES)
@ROUND_TRIP
@given(data=st.data())
def test_grpc_request_round_trip(datatype, typed, data):
    if typed and datatype not in TYPED_FIELD:
        pytest.skip(f"{datatype} has no typed contents field")
    array = data.draw(arrays_of(datatype))
    message = pb.ModelInferRequest(model_name="m")
    tensor = message.inputs.add(name="IN", datatype=datatype, shape=list(array.shape))
    if typed:
        getattr(tensor.contents, TYPED_FIELD[datatype]).extend(array.ravel().tolist())
    elif datatype == "BYTES":
        message.raw_input_contents.append(serialize_byte_tensor(array).item() if array.size else b"")
    else:
        message.raw_input_contents.append(array.astype(array.dtype.newbyteorder("<")).tobytes())
    request = grpc_codec.decode_infer(pb.ModelInferRequest.FromString(message.SerializeToString()), LIMITS)
    (decoded,) = request.inputs
    assert decoded.name == "IN" and decoded.datatype == datatype
    assert_same(datatype, array, decoded.data)


@ROUND_TRIP
@given(array=arrays_of("BYTES"))
def test_bytes_helpers_match_tritonclient(array):
    """The shared BYTES helpers (used by both codecs) read and write exactly tritonclient's encoding."""
    wire = serialize_byte_tensor(array).item() if array.size else b""
    assert tensor_bytes.encode_bytes_elements(array) == wire
    assert list(tensor_bytes.bytes_elements("IN", memoryview(wire), array.size)) == list(array.ravel())


@pytest.mark.parametrize("datatype", ["UINT64", "INT64"])
def test_64_bit_integers_past_float_precision_are_exact(datatype):
    """numpy infers float64 for ``[0, 2**63 + 1]``; the codecs must keep every bit (or say out of range)."""
    values = [0, 2**63 + 1] if datatype == "UINT64" else [-(2**63), 2**63 - 1]

    def body(values):
        return json.dumps({"inputs": [{"name": "IN", "datatype": datatype, "shape": [2], "data": values}]}).encode()

    assert http_codec.decode_infer(body(values), None, "m", "", LIMITS).inputs[0].data.tolist() == values
    message = pb.ModelInferRequest(model_name="m")
    tensor = message.inputs.add(name="IN", datatype=datatype, shape=[2])
    getattr(tensor.contents, TYPED_FIELD[datatype]).extend(values)
    assert grpc_codec.decode_infer(message, LIMITS).inputs[0].data.tolist() == values
    too_big = [0, 2**64] if datatype == "UINT64" else [0, 2**63]
    with pytest.raises(SluiceError, match=f"out of range for {datatype}"):
        http_codec.decode_infer(body(too_big), None, "m", "", LIMITS)


# -- the runtime's own gRPC client (remote.py): the pair of grpc_codec, round trip through it ------


@pytest.mark.parametrize("datatype", DATATYPES)
@ROUND_TRIP
@given(data=st.data())
def test_remote_request_round_trip_through_the_grpc_decoder(datatype, data):
    array = data.draw(arrays_of(datatype))
    request = InferRequest(
        "stable-name",
        "",
        [Tensor("IN", datatype, array, {"p": 7})],
        [RequestedOutput("OUT", True, {"classification": 2, "binary_data": True})],
        "req-1",
        {"priority": 3, "timeout": 5000, "custom": "x", "ratio": 0.5, "flag": True, "binary_data_output": True},
    )
    message = pb.ModelInferRequest.FromString(remote.request_message(request, "m", "2").SerializeToString())
    assert message.parameters["priority"].WhichOneof("parameter_choice") == "uint64_param"  # Triton's type
    assert message.parameters["timeout"].WhichOneof("parameter_choice") == "int64_param"
    decoded = grpc_codec.decode_infer(message, Limits())
    assert (decoded.model_name, decoded.model_version, decoded.id) == ("m", "2", "req-1")
    assert decoded.parameters == {"priority": 3, "timeout": 5000, "custom": "x", "ratio": 0.5, "flag": True}
    assert [(t.name, t.datatype, t.parameters) for t in decoded.inputs] == [("IN", datatype, {"p": 7})]
    assert_same(datatype, array, decoded.inputs[0].data)
    assert decoded.outputs is not None
    assert [(o.name, o.parameters) for o in decoded.outputs] == [("OUT", {"classification": 2})]


@pytest.mark.parametrize("datatype", DATATYPES)
@ROUND_TRIP
@given(data=st.data())
def test_remote_response_round_trip_through_the_grpc_encoder(datatype, data):
    array = data.draw(arrays_of(datatype))
    response = InferResponse("m", "2", [Tensor("OUT", datatype, array)], "r", {"sequence": "s"})
    message = pb.ModelInferResponse.FromString(grpc_codec.encode_infer(response).SerializeToString())
    got = remote.response_of(message, "canary:8001")
    assert (got.model_name, got.model_version, got.id, got.parameters) == ("m", "2", "r", {"sequence": "s"})
    assert [(t.name, t.datatype) for t in got.outputs] == [("OUT", datatype)]
    assert_same(datatype, array, got.outputs[0].data)


def test_a_malformed_remote_response_is_an_internal_error_naming_the_target():
    message = pb.ModelInferResponse(model_name="m")
    message.outputs.add(name="OUT", datatype="FP32", shape=[4])
    message.raw_output_contents.append(b"\x00" * 8)
    with pytest.raises(SluiceError, match=r"canary:8001 answered output 'OUT' with 8 bytes for shape \[4\] of FP32"):
        remote.response_of(message, "canary:8001")
