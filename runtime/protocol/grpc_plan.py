"""Prepared-statement cache for gRPC ModelInfer, the counterpart of http_plan for HTTP.

A ``ModelInferRequest`` serializes its fields in number order, so ``raw_input_contents``
(field 7, the tensor bytes) comes last and everything before it (model, id, parameters, input
names/datatypes/shapes, requested outputs) is a prefix that clients repeat byte for byte. The
prefix of a request that passed full decoding and validation is remembered with its plan; a later
message with the same prefix and raw entries of the planned sizes is turned into an
``InferRequest`` straight from memoryviews of the message, without protobuf parsing. Anything
else (another field order, unknown fields, typed contents, BYTES, a size mismatch) takes the full
path, so errors are unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from sluice.runtime import shm
from sluice.runtime.errors import InvalidArgument
from sluice.runtime.protocol import grpc_codec
from sluice.runtime.settings import Limits
from sluice.runtime.types import ELEMENT_SIZE, WIRE_DTYPE, InferRequest, RequestedOutput, Tensor, copied_outputs

_RAW_FIELD = 7
_MAX_PREFIX = 4096
_MAX_ENTRIES = 512


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """(value, position after it); (-1, pos) for a truncated or over-long varint."""
    value = 0
    shift = 0
    while pos < end and shift <= 35:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    return -1, pos


def split_raw(message: bytes) -> tuple[int, list[tuple[int, int]]] | None:
    """(offset where raw_input_contents starts, (start, end) of each entry), or None when the
    message is not laid out as prefix + raw entries (the full decoder then decides)."""
    pos = 0
    end = len(message)
    raw_start = -1
    spans: list[tuple[int, int]] = []
    while pos < end:
        tag_start = pos
        tag, pos = _varint(message, pos, end)
        field = tag >> 3
        if tag < 0 or tag & 7 != 2 or not 1 <= field <= _RAW_FIELD:  # every field is length-delimited
            return None
        length, pos = _varint(message, pos, end)
        stop = pos + length
        if length < 0 or stop > end:
            return None
        if field == _RAW_FIELD:
            if raw_start < 0:
                raw_start = tag_start
            spans.append((pos, stop))
        elif raw_start >= 0:
            return None  # a field after the raw contents: not the layout we plan for
        pos = stop
    if raw_start < 0 or raw_start > _MAX_PREFIX:
        return None
    return raw_start, spans


class _Plan:
    __slots__ = ("id", "inputs", "model", "outputs", "parameters", "version")

    def __init__(self, request: InferRequest) -> None:
        self.model = request.model_name
        self.version = request.model_version
        self.id = request.id
        self.parameters = request.parameters
        self.outputs = copied_outputs(request.outputs)  # not the first request's: binding rewrites those
        self.inputs = [
            (t.name, t.datatype, t.data.shape, int(t.data.size) * ELEMENT_SIZE[t.datatype], t.parameters)
            for t in request.inputs
        ]


class InferDecoder:
    """ModelInfer bytes -> InferRequest, with the plan cache; one per server."""

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._plans: dict[bytes, _Plan] = {}

    def decode(self, message: bytes) -> InferRequest:
        """Raises SluiceError for bad requests, unparsable bytes included (InvalidArgument)."""
        layout = split_raw(message)
        if layout is not None:
            raw_start, spans = layout
            prefix = message[:raw_start]
            plan = self._plans.get(prefix)
            if plan is not None and len(spans) == len(plan.inputs):
                view = memoryview(message)
                inputs = []
                for (name, datatype, shape, size, params), (start, stop) in zip(plan.inputs, spans, strict=True):
                    if stop - start != size:
                        break
                    array = np.frombuffer(view[start:stop], dtype=WIRE_DTYPE[datatype]).reshape(shape)
                    inputs.append(Tensor(name, datatype, array, dict(params) if params else {}))
                else:
                    return self._request(plan, inputs)
        try:
            parsed = pb.ModelInferRequest.FromString(message)
        except DecodeError as exc:
            raise InvalidArgument(
                f"request is not a valid protobuf inference.ModelInferRequest message ({len(message)} bytes): {exc}"
            ) from None
        request = grpc_codec.decode_infer(parsed, self._limits)
        plannable = all(t.datatype != "BYTES" and not shm.names_region(t.parameters) for t in request.inputs)
        if layout is not None and plannable:
            planned = _Plan(request)
            if [size for _, _, _, size, _ in planned.inputs] == [stop - start for start, stop in layout[1]]:
                if len(self._plans) >= _MAX_ENTRIES:
                    self._plans.clear()
                self._plans[message[: layout[0]]] = planned
        return request

    @staticmethod
    def _request(plan: _Plan, inputs: list[Tensor]) -> InferRequest:
        outputs: list[RequestedOutput] | None = None
        if plan.outputs is not None:
            outputs = [RequestedOutput(o.name, o.binary, o.parameters) for o in plan.outputs]
        params: dict[str, Any] = dict(plan.parameters) if plan.parameters else {}
        return InferRequest(plan.model, plan.version, inputs, outputs, plan.id, params)
