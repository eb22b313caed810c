"""check_request against a model signature: validation, reshape, and the remembered checks."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from sluice.runtime.errors import InvalidArgument
from sluice.runtime.signature import check_request, signature_of
from sluice.runtime.types import InferRequest, RequestedOutput, Tensor

CONFIG = """
max_batch_size: 8
input [
  { name: "A", data_type: TYPE_FP32, dims: [ 4 ], reshape: { shape: [ 2, 2 ] } },
  { name: "B", data_type: TYPE_INT32, dims: [ -1 ] }
]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""


def sig():
    return signature_of(text_format.Parse(CONFIG, mc.ModelConfig()), "m:1")


def req(batch: int = 2, b_len: int = 3, a_dtype: str = "FP32", outputs=None) -> InferRequest:
    return InferRequest(
        "m",
        "",
        [
            Tensor("A", a_dtype, np.zeros((batch, 4), np.float32)),
            Tensor("B", "INT32", np.zeros((batch, b_len), np.int32)),
        ],
        outputs,
    )


def test_repeated_requests_get_the_same_result_and_reshape_every_time():
    s = sig()
    for _ in range(3):  # the first is checked in full, the rest come from the memo
        r = req()
        check_request(r, s)
        assert r.batch_size == 2
        assert r.inputs[0].data.shape == (2, 2, 2)
        assert r.shape_key == (("A", (4,)), ("B", (3,)))
    other = req(b_len=5)
    check_request(other, s)
    assert other.shape_key == (("A", (4,)), ("B", (5,)))  # a different variable dim: its own key


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: req(a_dtype="FP16"), "inference input 'A' data-type is 'FP16', but model 'm' expects 'FP32'"),
        (lambda: req(batch=9), "batch-size must be <= 8"),
        (lambda: req(outputs=[RequestedOutput("NOPE")]), "unexpected inference output 'NOPE'"),
    ],
)
def test_a_remembered_good_shape_does_not_let_bad_requests_through(make, message):
    s = sig()
    check_request(req(), s)
    with pytest.raises(InvalidArgument, match=message):
        check_request(make(), s)


def test_missing_required_input_is_named():
    s = sig()
    r = InferRequest("m", "", [Tensor("A", "FP32", np.zeros((1, 4), np.float32))])
    with pytest.raises(InvalidArgument, match=r"missing required input\(s\) \['B'\]"):
        check_request(r, s)
