"""The runtime's gRPC client of other KServe V2 servers: remote ensemble steps and the canary split.

:class:`RemoteClients` keeps one ``grpc.aio`` channel per ``host:port`` target, opened on first use
on the event loop and closed by ``aclose``; ``infer`` sends an :class:`InferRequest` as a
``ModelInferRequest`` and returns the answer as an :class:`InferResponse`, or raises the
:class:`SluiceError` of the remote's status (:func:`remote_error`). Callers: ensemble.py (steps
named by ``sluice.remote.<model>``) and forwarding.py (the canary's share of a split model).

The wire conversion is the client-side pair of protocol/grpc_codec.py (encode a request, decode a
response): tensors travel as ``raw_input_contents`` / ``raw_output_contents``, exactly as they
came (BF16 bits and BYTES elements included); request, input and output parameters pass through,
except the HTTP front end's own encoding hints (``binary_data_output``, ``binary_data``), which
its encoder on this side answers. ``priority`` goes as ``uint64_param`` and ``timeout`` as
``int64_param``, the types Triton requires.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from sluice.runtime.callers import PARAMETER as CALLER_PARAMETER
from sluice.runtime.errors import (
    AlreadyExists,
    Cancelled,
    Internal,
    InvalidArgument,
    ModelError,
    NotFound,
    PayloadTooLarge,
    SluiceError,
    Unavailable,
    Unknown,
    Unsupported,
)
from sluice.runtime.tensor_bytes import bytes_elements, encode_bytes_elements
from sluice.runtime.types import (
    DATATYPES,
    ELEMENT_SIZE,
    GRPC_CONTENTS_FIELD,
    WIRE_DTYPE,
    InferRequest,
    InferResponse,
    Tensor,
    numpy_dtype,
)

MAX_MESSAGE_BYTES = 2**31 - 1
"""Channel bound on messages either way: the callers' own limits already bound what they send."""

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A target that was down (a canary rolling out) is tried again within 5 s of coming back, not
    # after gRPC's default backoff of up to 120 s.
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 5000),
)

HTTP_ONLY_PARAMETERS = frozenset({"binary_data_output", "binary_data"})
"""Parameters that only tell the HTTP front end how to encode its response: never sent on."""

_ERRORS_BY_STATUS: dict[str, type[SluiceError]] = {
    "INVALID_ARGUMENT": InvalidArgument,
    "RESOURCE_EXHAUSTED": PayloadTooLarge,
    "UNIMPLEMENTED": Unsupported,
    "NOT_FOUND": NotFound,
    "UNAVAILABLE": Unavailable,
    "DEADLINE_EXCEEDED": Unavailable,
    "CANCELLED": Cancelled,
    "INTERNAL": ModelError,
    "UNKNOWN": Unknown,  # a model's TritonError.UNKNOWN / ALREADY_EXISTS, answered as they were
    "ALREADY_EXISTS": AlreadyExists,
}

_TYPED_FIELD = GRPC_CONTENTS_FIELD


class Unreachable(Unavailable):
    """The target could not be reached at all (no connection: refused, no route, no such host): the
    request never got there, so running it elsewhere runs it once."""


class Unforwardable(InvalidArgument):
    """The request cannot be put on the wire to the target (a parameter out of gRPC's integer
    range): it was not sent, so it can be served elsewhere."""


def remote_error(status: str | None, message: str, target: str) -> SluiceError:
    """A remote gRPC status (``UNAVAILABLE`` or ``StatusCode.UNAVAILABLE``) as a SluiceError of the same code."""
    code = (status or "").rsplit(".", 1)[-1]
    kind = _ERRORS_BY_STATUS.get(code, Internal)
    if kind is Unavailable:
        return Unavailable(f"cannot reach {target} or it cannot serve now: {message}")
    return kind(message)


# --- the wire (pure) -----------------------------------------------------------------------------


def _set_parameters(values: Mapping[str, Any], target: Any) -> None:
    for key, value in values.items():
        if key in HTTP_ONLY_PARAMETERS or value is None:
            continue
        param = target[key]
        if isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, int):
            if 0 <= value < 2**64 and (key == "priority" or value >= 2**63):
                param.uint64_param = value
            elif -(2**63) <= value < 2**63:
                param.int64_param = value
            else:
                raise Unforwardable(
                    f"parameter '{key}': {value} does not fit a KServe V2 gRPC integer parameter; allowed: "
                    f"-2^63 to 2^64-1"
                )
        elif isinstance(value, float):
            param.double_param = value
        else:
            param.string_param = str(value)


def _parameters(params: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in params.items():
        which = value.WhichOneof("parameter_choice")
        out[key] = getattr(value, which) if which else None
    return out


def _raw(tensor: Tensor) -> bytes:
    if tensor.datatype == "BYTES":
        return encode_bytes_elements(tensor.data)
    return np.ascontiguousarray(tensor.data, dtype=WIRE_DTYPE[tensor.datatype]).tobytes()


def request_message(request: InferRequest, model: str, version: str) -> pb.ModelInferRequest:
    """``request`` as the ``ModelInferRequest`` for ``model`` (``version``: "" for the latest)."""
    message = pb.ModelInferRequest(model_name=model, model_version=version, id=request.id)
    raw = message.raw_input_contents
    for tensor in request.inputs:
        entry = message.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.data.shape)
        if tensor.parameters:
            _set_parameters(tensor.parameters, entry.parameters)
        raw.append(_raw(tensor))
    for output in request.outputs or ():
        requested = message.outputs.add(name=output.name)
        if output.parameters:
            _set_parameters(output.parameters, requested.parameters)
    if request.parameters:
        _set_parameters(request.parameters, message.parameters)
    if request.caller:  # the remote counts the request under the same caller (callers.py)
        message.parameters[CALLER_PARAMETER].string_param = request.caller
    return message


def response_of(message: pb.ModelInferResponse, target: str) -> InferResponse:
    """The remote's ``ModelInferResponse`` as an InferResponse; ``Internal`` naming ``target`` when
    it is malformed (a tensor whose contents do not fit its shape)."""
    raw = message.raw_output_contents
    outputs = []
    for index, tensor in enumerate(message.outputs):
        name, datatype, shape = tensor.name, tensor.datatype, tuple(tensor.shape)
        if datatype not in DATATYPES:
            raise Internal(f"{target} answered output '{name}' with unknown datatype {datatype!r}")
        count = int(np.prod(shape, dtype=np.int64))
        if index < len(raw):
            data = memoryview(raw[index])
            if datatype == "BYTES":
                try:
                    array = bytes_elements(name, data, count).reshape(shape)
                except InvalidArgument as exc:
                    raise Internal(f"{target} answered a malformed BYTES output: {exc.message}") from None
            elif len(data) != count * ELEMENT_SIZE[datatype]:
                raise Internal(
                    f"{target} answered output '{name}' with {len(data)} bytes for shape {list(shape)} of {datatype}"
                )
            else:
                array = np.frombuffer(data, dtype=WIRE_DTYPE[datatype]).reshape(shape)
        else:
            field = _TYPED_FIELD.get(datatype)
            values = getattr(tensor.contents, field) if field is not None else ()
            if len(values) != count:
                raise Internal(f"{target} answered output '{name}' without contents for shape {list(shape)}")
            if datatype == "BYTES":
                array = np.empty(count, dtype=object)
                array[:] = list(values)
                array = array.reshape(shape)
            else:
                array = np.asarray(values).astype(numpy_dtype(datatype)).reshape(shape)
        params = _parameters(tensor.parameters) if tensor.parameters else {}
        outputs.append(Tensor(name, datatype, array, params))
    params = _parameters(message.parameters) if message.parameters else {}
    return InferResponse(message.model_name, message.model_version, outputs, message.id, params)


# --- the clients ---------------------------------------------------------------------------------


class RemoteClients:
    """One gRPC channel per target, opened on first use (on the event loop), closed by ``aclose``."""

    def __init__(self) -> None:
        self._channels: dict[str, tuple[grpc.aio.Channel, service_pb2_grpc.GRPCInferenceServiceStub]] = {}

    def _stub(self, target: str) -> service_pb2_grpc.GRPCInferenceServiceStub:
        entry = self._channels.get(target)
        if entry is None:
            channel = grpc.aio.insecure_channel(target, options=list(CHANNEL_OPTIONS))
            entry = self._channels[target] = (channel, service_pb2_grpc.GRPCInferenceServiceStub(channel))
        return entry[1]

    async def infer(
        self, target: str, model: str, version: str, request: InferRequest, traceparent: str | None = None
    ) -> InferResponse:
        """Run ``request`` as ``model`` (``version``: "" for the latest) at ``target``; raises the
        SluiceError of the remote's status. Cancelling the awaiting task cancels the call.
        ``traceparent`` (a traced request, tracing.py) goes as metadata: the target continues the trace."""
        message = request_message(request, model, version)
        metadata = None if traceparent is None else (("traceparent", traceparent),)
        try:
            answer = await self._stub(target).ModelInfer(message, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            error = remote_error(exc.code().name, exc.details() or str(exc.code().name), target)
            channel = self._channels[target][0]
            if (exc.code() == grpc.StatusCode.UNAVAILABLE
                    and channel.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE):
                # No connection at all (an answer from the target would have connected the channel).
                error = Unreachable(error.message)
            raise error from None
        return response_of(answer, target)

    async def aclose(self) -> None:
        channels, self._channels = self._channels, {}
        for channel, _ in channels.values():
            try:
                await channel.close()
            except Exception:  # closing a broken channel must not stop an unload or a shutdown
                pass
