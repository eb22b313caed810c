"""Triton's gRPC messages (``tritonclient.grpc.service_pb2``) <-> domain types.

Both raw (``raw_input_contents``) and typed (``contents``) tensors are accepted; responses always
use ``raw_output_contents``, as Triton does. Every malformed message raises ``InvalidArgument``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from sluice.runtime import classification, shm
from sluice.runtime.errors import InvalidArgument, ModelError, PayloadTooLarge
from sluice.runtime.settings import Limits
from sluice.runtime.tensor_bytes import bytes_elements, encode_bytes_elements
from sluice.runtime.types import (
    DATATYPES,
    ELEMENT_SIZE,
    GRPC_CONTENTS_FIELD,
    WIRE_DTYPE,
    InferRequest,
    InferResponse,
    RequestedOutput,
    Tensor,
    numpy_dtype,
)

_TYPED_FIELD = GRPC_CONTENTS_FIELD

_FIELD_DTYPE = {
    "bool_contents": np.dtype(np.bool_),
    "int_contents": np.dtype(np.int32),
    "int64_contents": np.dtype(np.int64),
    "uint_contents": np.dtype(np.uint32),
    "uint64_contents": np.dtype(np.uint64),
    "fp32_contents": np.dtype(np.float32),
    "fp64_contents": np.dtype(np.float64),
}


def parameters_to_dict(params: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in params.items():
        which = value.WhichOneof("parameter_choice")
        out[key] = getattr(value, which) if which else None
    return out


_INT64_MIN, _INT64_MAX, _UINT64_MAX = -(2**63), 2**63 - 1, 2**64 - 1


def dict_to_parameters(values: dict[str, Any], target: Any) -> None:
    """Raises ModelError for an integer outside int64/uint64 (a model's response parameter)."""
    for key, value in values.items():
        param = target[key]
        if isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, int):
            if _INT64_MIN <= value <= _INT64_MAX:
                param.int64_param = value
            elif 0 <= value <= _UINT64_MAX:
                param.uint64_param = value  # as Triton sends an unsigned 64-bit parameter
            else:
                raise ModelError(
                    f"parameter '{key}' is {value}, which no gRPC parameter holds: integers must lie in "
                    f"[{_INT64_MIN}, {_UINT64_MAX}] (int64 or uint64); send larger ones as strings"
                )
        elif isinstance(value, float):
            param.double_param = value
        else:
            param.string_param = str(value)


def decode_infer(message: pb.ModelInferRequest, limits: Limits) -> InferRequest:
    if not message.model_name:
        raise InvalidArgument("model_name is required")
    raw = message.raw_input_contents
    if raw:
        for tensor in message.inputs:
            if tensor.HasField("contents"):  # Triton's check and wording, before the count check
                raise InvalidArgument(
                    f"contents field must not be specified when using raw_input_contents for '{tensor.name}' "
                    f"for model '{message.model_name}'"
                )
    in_shm = [shm.names_region(tensor.parameters) for tensor in message.inputs]
    # raw_input_contents holds the inputs that are not in shared memory, in order (as Triton reads it)
    carried = len(in_shm) - sum(in_shm)
    if raw and len(raw) != carried:
        raise InvalidArgument(
            f"raw_input_contents has {len(raw)} entries for {carried} inputs; give one per input "
            "(inputs in shared memory take none)"
        )
    raw_index = 0
    inputs = []  # none at all is the model's to judge: accepted when every input is optional
    total = 0
    for index, tensor in enumerate(message.inputs):
        name = tensor.name
        if not name:
            raise InvalidArgument(f"inputs[{index}] needs a name")
        datatype = tensor.datatype
        if datatype not in DATATYPES:
            raise InvalidArgument(f"input '{name}': unknown datatype {datatype!r}; allowed: {', '.join(DATATYPES)}")
        shape = tuple(tensor.shape)
        if len(shape) > 32:
            raise InvalidArgument(f"input '{name}': shape has {len(shape)} dimensions, at most 32 are allowed")
        count = 1
        span = 1  # product of the non-zero dims: bounded too, or a 0 in the shape would hide 2**62 beside it
        for dim in shape:
            if dim < 0:
                raise InvalidArgument(f"input '{name}': shape entries must be >= 0, got {list(shape)}")
            count *= dim
            if dim:
                span *= dim
            if span > limits.max_elements:
                raise PayloadTooLarge(
                    f"input '{name}': shape {list(shape)} holds more than {limits.max_elements} elements "
                    "(--max-elements)"
                )
        total += count
        if total > limits.max_elements:
            raise PayloadTooLarge(f"request holds more than {limits.max_elements} tensor elements (--max-elements)")
        if in_shm[index]:
            if tensor.HasField("contents"):
                raise InvalidArgument(
                    f"unexpected 'content' provided when using shared memory for input tensor '{name}' for model "
                    f"'{message.model_name}'"
                )
            params = parameters_to_dict(tensor.parameters)
            inputs.append(Tensor(name, datatype, shm.placeholder(datatype, shape), params))
            continue
        if raw:
            data = memoryview(raw[raw_index])
            raw_index += 1
            if datatype == "BYTES":
                array = bytes_elements(name, data, count).reshape(shape)
            else:
                expected = count * ELEMENT_SIZE[datatype]
                if len(data) != expected:
                    raise InvalidArgument(
                        f"input '{name}': raw content is {len(data)} bytes, but shape {list(shape)} of {datatype} "
                        f"needs {expected}"
                    )
                array = np.frombuffer(data, dtype=WIRE_DTYPE[datatype]).reshape(shape)
        else:
            field = _TYPED_FIELD.get(datatype)
            if field is None:
                raise InvalidArgument(
                    f"input '{name}': {datatype} has no typed contents field; send it in raw_input_contents"
                )
            values = getattr(tensor.contents, field)
            if len(values) != count:
                raise InvalidArgument(
                    f"input '{name}': {len(values)} values in contents.{field}, shape {list(shape)} needs {count}"
                )
            if datatype == "BYTES":
                array = np.empty(count, dtype=object)
                array[:] = list(values)
                array = array.reshape(shape)
            else:
                # the field's own dtype: inferring one would turn uint64 values past 2**63 into float64
                array = np.asarray(values, dtype=_FIELD_DTYPE[field])
                target = numpy_dtype(datatype)
                if array.size and target.kind in "iu":
                    info = np.iinfo(target)
                    if array.min() < info.min or array.max() > info.max:
                        raise InvalidArgument(f"input '{name}': a value is out of range for {datatype}")
                array = array.astype(target, copy=False).reshape(shape)
        inputs.append(Tensor(name, datatype, array, parameters_to_dict(tensor.parameters) if tensor.parameters else {}))
    outputs = None
    if message.outputs:
        outputs = []
        for out in message.outputs:
            params = parameters_to_dict(out.parameters) if out.parameters else {}
            if classification.PARAMETER in params:
                classification.requested_count(out.name, params[classification.PARAMETER])
            outputs.append(RequestedOutput(out.name, None, params))
    params = parameters_to_dict(message.parameters) if message.parameters else {}
    return InferRequest(message.model_name, message.model_version, inputs, outputs, message.id, params)


def encode_infer(response: InferResponse) -> pb.ModelInferResponse:
    message = pb.ModelInferResponse(
        model_name=response.model_name, model_version=response.model_version, id=response.id
    )
    raw = message.raw_output_contents
    for tensor in response.outputs:
        out = message.outputs.add()
        out.name = tensor.name
        out.datatype = tensor.datatype
        out.shape.extend(tensor.data.shape)
        if tensor.parameters and shm.REGION in tensor.parameters:  # written to shared memory: an empty entry, as Triton
            dict_to_parameters(tensor.parameters, out.parameters)
            raw.append(b"")
        elif tensor.datatype == "BYTES":
            raw.append(encode_bytes_elements(tensor.data))
        else:
            raw.append(np.ascontiguousarray(tensor.data, dtype=WIRE_DTYPE[tensor.datatype]).tobytes())
    if response.parameters:
        dict_to_parameters(response.parameters, message.parameters)
    return message
