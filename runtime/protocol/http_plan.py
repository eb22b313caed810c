"""Prepared-statement caches for the HTTP infer path.

Clients send the same JSON header over and over (same inputs, shapes and flags; only the binary
tensor bytes change), and get the same response header back. ``InferCodec`` remembers, per exact
header bytes, the decoded *plan* of a binary-only request, and per output signature the encoded
response header, so the hot path skips JSON parsing, validation and encoding. A miss falls back
to ``http_codec`` (which does every check); a hit is only taken when the header bytes are
identical and the binary part has exactly the size the plan expects, so errors are unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sluice.runtime import shm
from sluice.runtime.protocol import http_codec
from sluice.runtime.settings import Limits
from sluice.runtime.types import (
    ELEMENT_SIZE,
    WIRE_DTYPE,
    InferRequest,
    InferResponse,
    RequestedOutput,
    Tensor,
    copied_outputs,
)

_MAX_HEADER = 4096
_MAX_ENTRIES = 512


class _Plan:
    __slots__ = ("id", "inputs", "outputs", "parameters", "total")

    def __init__(self, request: InferRequest, sizes: list[int]) -> None:
        self.id = request.id
        self.parameters = request.parameters
        self.outputs = copied_outputs(request.outputs)  # not the first request's: binding rewrites those
        self.inputs = [
            (t.name, t.datatype, t.data.shape, int(t.data.size), size, t.parameters)
            for t, size in zip(request.inputs, sizes, strict=True)
        ]
        self.total = sum(sizes)


def _binary_sizes(request: InferRequest) -> list[int] | None:
    """Byte size of each input as sent in binary form, or None when a size varies by content."""
    sizes = []
    for tensor in request.inputs:
        if tensor.datatype == "BYTES" or shm.names_region(tensor.parameters):
            return None  # element lengths vary, or the data is in shared memory: not worth a plan
        sizes.append(int(tensor.data.size) * ELEMENT_SIZE[tensor.datatype])
    return sizes


def _output_flags(request: InferRequest) -> tuple:
    """What decides the response header besides the tensors: the binary flags asked for."""
    default = request.parameters.get("binary_data_output") if request.parameters else None
    if request.outputs is None:
        return (default,)
    return (default, *((o.name, o.binary) for o in request.outputs))


class InferCodec:
    """HTTP infer decode/encode with bounded caches; one per server (not shared globally)."""

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._plans: dict[tuple[bytes, str, str], _Plan] = {}
        self._headers: dict[tuple, bytes] = {}

    def decode(self, body: bytes, header_length: int | None, model: str, version: str) -> InferRequest:
        if header_length is not None and 0 < header_length <= _MAX_HEADER and header_length <= len(body):
            key = (body[:header_length], model, version)
            plan = self._plans.get(key)
            if plan is not None and len(body) - header_length == plan.total:
                return self._from_plan(plan, memoryview(body)[header_length:], model, version)
            request = http_codec.decode_infer(body, header_length, model, version, self._limits)
            if b'"data"' not in key[0]:
                sizes = _binary_sizes(request)
                if sizes is not None and sum(sizes) == len(body) - header_length:
                    if len(self._plans) >= _MAX_ENTRIES:
                        self._plans.clear()
                    self._plans[key] = _Plan(request, sizes)
            return request
        return http_codec.decode_infer(body, header_length, model, version, self._limits)

    @staticmethod
    def _from_plan(plan: _Plan, binary: memoryview, model: str, version: str) -> InferRequest:
        inputs = []
        offset = 0
        for name, datatype, shape, _count, size, params in plan.inputs:
            array = np.frombuffer(binary[offset : offset + size], dtype=WIRE_DTYPE[datatype]).reshape(shape)
            offset += size
            inputs.append(Tensor(name, datatype, array, dict(params) if params else {}))
        outputs = None
        if plan.outputs is not None:
            outputs = [RequestedOutput(o.name, o.binary, o.parameters) for o in plan.outputs]
        return InferRequest(model, version, inputs, outputs, plan.id, dict(plan.parameters) if plan.parameters else {})

    def encode(
        self, request: InferRequest, response: InferResponse, json_limit: int | None = None
    ) -> tuple[bytes, int | None] | None:
        """The response body and JSON header length (None for pure JSON); None instead when the
        response holds ``json_limit`` bytes of JSON values or more (about 8 a value): the caller
        encodes those off the event loop. A cached header (binary outputs only) needs no such count."""
        key: tuple[Any, ...] | None = None
        if not (response.id or response.parameters or any(t.parameters for t in response.outputs)):
            key = (
                response.model_name,
                response.model_version,
                _output_flags(request),
                *((t.name, t.datatype, t.data.shape) for t in response.outputs),
            )
            header = self._headers.get(key)
            if header is not None:
                blobs = [np.ascontiguousarray(t.data, dtype=WIRE_DTYPE[t.datatype]).tobytes() for t in response.outputs]
                return b"".join([header, *blobs]), len(header)
        if json_limit is not None and http_codec.json_elements(request, response) * 8 >= json_limit:
            return None
        body, header_length = http_codec.encode_infer(request, response)
        cacheable = header_length is not None and b'"data"' not in body[:header_length]
        if key is not None and cacheable and all(t.datatype != "BYTES" for t in response.outputs):
            if len(self._headers) >= _MAX_ENTRIES:
                self._headers.clear()
            self._headers[key] = body[:header_length]
        return body, header_length
