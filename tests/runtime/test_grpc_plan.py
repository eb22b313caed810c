"""The gRPC ModelInfer plan cache gives exactly what full decoding gives, and errors unchanged."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb

from sluice.runtime.errors import SluiceError
from sluice.runtime.protocol import grpc_codec
from sluice.runtime.protocol.grpc_plan import InferDecoder, split_raw
from sluice.runtime.settings import Limits

DTYPES = {"FP32": np.float32, "INT64": np.int64, "UINT8": np.uint8, "FP16": np.float16, "BOOL": np.bool_}


def message(arrays: dict[str, np.ndarray], rid: str = "", outputs: tuple[str, ...] = ()) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name="m", id=rid)
    for name, array in arrays.items():
        tensor = msg.inputs.add()
        tensor.name = name
        tensor.datatype = next(k for k, v in DTYPES.items() if np.dtype(v) == array.dtype)
        tensor.shape.extend(array.shape)
        msg.raw_input_contents.append(array.astype(array.dtype.newbyteorder("<")).tobytes())
    for name in outputs:
        msg.outputs.add().name = name
    return msg


def same(a, b) -> None:
    assert (a.model_name, a.model_version, a.id, a.parameters) == (b.model_name, b.model_version, b.id, b.parameters)
    assert [(t.name, t.datatype, t.data.shape, t.data.tobytes()) for t in a.inputs] == [
        (t.name, t.datatype, t.data.shape, t.data.tobytes()) for t in b.inputs
    ]
    assert (None if a.outputs is None else [o.name for o in a.outputs]) == (
        None if b.outputs is None else [o.name for o in b.outputs]
    )


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from(list(DTYPES)), min_size=1, max_size=3),
    st.integers(1, 4),
    st.integers(0, 5),
    st.text(max_size=4),
    st.lists(st.sampled_from(["OUT0", "OUT1"]), max_size=2, unique=True),
)
def test_repeat_requests_decode_exactly_like_the_full_path(dtypes, rows, cols, rid, outputs):
    decoder = InferDecoder(Limits())
    rng = np.random.default_rng(rows * 7 + cols)
    for _ in range(3):  # the first fills the cache, the next ones use it with new tensor bytes
        arrays = {
            f"IN{i}": (rng.integers(0, 100, (rows, cols)) > 50).astype(DTYPES[d])
            if d == "BOOL"
            else rng.integers(0, 100, (rows, cols)).astype(DTYPES[d])
            for i, d in enumerate(dtypes)
        }
        data = message(arrays, rid, tuple(outputs)).SerializeToString()
        same(decoder.decode(data), grpc_codec.decode_infer(pb.ModelInferRequest.FromString(data), Limits()))


def test_a_cached_prefix_with_wrong_raw_sizes_gets_the_full_paths_error():
    decoder = InferDecoder(Limits())
    good = message({"IN": np.zeros((1, 4), np.float32)})
    decoder.decode(good.SerializeToString())
    bad = message({"IN": np.zeros((1, 4), np.float32)})
    bad.raw_input_contents[0] = b"\0" * 12  # 3 floats for a [1, 4] shape
    with pytest.raises(SluiceError, match="raw content is 12 bytes, but shape \\[1, 4\\] of FP32 needs 16"):
        decoder.decode(bad.SerializeToString())
    extra = message({"IN": np.zeros((1, 4), np.float32)})
    extra.raw_input_contents.append(b"\0" * 16)  # an entry no input claims
    with pytest.raises(SluiceError, match="raw_input_contents has 2 entries for 1 inputs"):
        decoder.decode(extra.SerializeToString())


def test_layouts_the_plan_does_not_cover_take_the_full_path():
    msg = message({"IN": np.arange(4, dtype=np.float32).reshape(1, 4)})
    data = msg.SerializeToString()
    raw_start, spans = split_raw(data)
    assert data[spans[0][0] : spans[0][1]] == msg.raw_input_contents[0]
    assert pb.ModelInferRequest.FromString(data[:raw_start]).inputs[0].name == "IN"  # the prefix alone parses
    assert split_raw(data + b"\x0a\x01m") is None  # model_name again after the raw contents
    assert split_raw(data + b"\x40\x01") is None  # a varint field (field 8): not in ModelInferRequest
    assert split_raw(pb.ModelInferRequest(model_name="m").SerializeToString()) is None  # no raw contents
    assert split_raw(data[:-2]) is None  # truncated
