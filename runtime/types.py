"""Protocol-neutral domain types: datatypes, tensors, requests and responses.

Nothing here knows JSON or protobuf; the codecs beside each protocol convert to and from these.
BYTES tensors are numpy ``object`` arrays of ``bytes``; BF16 tensors are ``uint16`` arrays holding the
raw bfloat16 bit patterns (numpy has no bfloat16).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

# V2 datatype name -> numpy dtype used in memory (little-endian on the wire).
_NUMPY_BY_DATATYPE: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BF16": np.dtype(np.uint16),
    "BYTES": np.dtype(np.object_),
}

DATATYPES: tuple[str, ...] = tuple(_NUMPY_BY_DATATYPE)

# Triton config enum name (model_config.proto DataType) -> V2 datatype name.
DATATYPE_BY_CONFIG_TYPE: dict[str, str] = {
    "TYPE_BOOL": "BOOL",
    "TYPE_UINT8": "UINT8",
    "TYPE_UINT16": "UINT16",
    "TYPE_UINT32": "UINT32",
    "TYPE_UINT64": "UINT64",
    "TYPE_INT8": "INT8",
    "TYPE_INT16": "INT16",
    "TYPE_INT32": "INT32",
    "TYPE_INT64": "INT64",
    "TYPE_FP16": "FP16",
    "TYPE_FP32": "FP32",
    "TYPE_FP64": "FP64",
    "TYPE_BF16": "BF16",
    "TYPE_STRING": "BYTES",
}
CONFIG_TYPE_BY_DATATYPE: dict[str, str] = {v: k for k, v in DATATYPE_BY_CONFIG_TYPE.items()}

# Bytes per element on the wire for fixed-size types.
ELEMENT_SIZE: dict[str, int] = {k: v.itemsize for k, v in _NUMPY_BY_DATATYPE.items() if k != "BYTES"}

# Fixed-size datatypes as laid out on the wire (binary extension, raw gRPC contents): little-endian.
WIRE_DTYPE: dict[str, np.dtype] = {k: _NUMPY_BY_DATATYPE[k].newbyteorder("<") for k in ELEMENT_SIZE}


def numpy_dtype(datatype: str) -> np.dtype:
    """The in-memory numpy dtype of a V2 datatype (KeyError for unknown names)."""
    return _NUMPY_BY_DATATYPE[datatype]


def datatype_of(array: np.ndarray) -> str:
    """The V2 datatype of a numpy array produced by a backend."""
    kind = array.dtype
    if kind == np.object_ or kind.kind in ("S", "U"):
        return "BYTES"
    for name, dtype in _NUMPY_BY_DATATYPE.items():
        if dtype == kind and name != "BF16":
            return name
    raise ValueError(f"numpy dtype {kind} has no V2 datatype")


@dataclasses.dataclass(slots=True)
class Tensor:
    """A named tensor with its V2 datatype and data; ``data.shape`` is the tensor's shape."""

    name: str
    datatype: str
    data: np.ndarray
    parameters: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)


@dataclasses.dataclass(slots=True)
class RequestedOutput:
    """An output the client asked for; ``binary`` is the HTTP binary-data extension flag."""

    name: str
    binary: bool | None = None
    parameters: dict[str, Any] = dataclasses.field(default_factory=dict)


def copied_outputs(outputs: list[RequestedOutput] | None) -> list[RequestedOutput] | None:
    """Outputs with parameters of their own: what a request-plan cache keeps, as binding shared memory
    replaces the parameters of a request's outputs (each later request wraps the kept ones anew)."""
    return None if outputs is None else [RequestedOutput(o.name, o.binary, dict(o.parameters)) for o in outputs]


class CancelToken:
    """Set by the protocol layer when the client goes away; read by the scheduler and by models."""

    __slots__ = ("_callbacks", "cancelled")

    def __init__(self) -> None:
        self.cancelled = False
        self._callbacks: list[Callable[[], None]] | None = None

    def cancel(self) -> None:
        if self.cancelled:
            return
        self.cancelled = True
        callbacks, self._callbacks = self._callbacks, None
        for callback in callbacks or ():
            callback()

    def clear(self) -> None:
        """Forget the callbacks once the request is answered: they reference what references this
        token, and the cycle would leave every request for the cyclic garbage collector."""
        self._callbacks = None

    def on_cancel(self, callback: Callable[[], None]) -> None:
        if self.cancelled:
            callback()
        elif self._callbacks is None:
            self._callbacks = [callback]
        else:
            self._callbacks.append(callback)


Responder = Callable[["InferResponse | Exception | None", bool], None]
"""``(response or error or None, final)``; the error is a ``SluiceError`` (errors.py)."""


@dataclasses.dataclass(slots=True)
class InferRequest:
    """One inference request after decoding, before validation against the model."""

    model_name: str
    model_version: str
    inputs: list[Tensor]
    outputs: list[RequestedOutput] | None = None
    id: str = ""
    parameters: dict[str, Any] = dataclasses.field(default_factory=dict)
    cancel: CancelToken = dataclasses.field(default_factory=CancelToken)
    # Filled by the dataplane: the request's batch size (first dim when the model batches) and
    # a key that equal-shaped requests share, so only compatible requests are batched together.
    batch_size: int = 1
    shape_key: tuple = ()
    # Who sent it (callers.py): the Sluice-Caller header, gRPC metadata or the sluice_caller
    # parameter, checked by the front end; "" when the request names no caller.
    caller: str = ""
    # Where a decoupled model's responses go (ModelStreamInfer, BLS ``exec(decoupled=True)``):
    # called with each response or error and whether it is the last one (``None`` with ``True``: a
    # bare final flag). None: the caller takes exactly one response (HTTP, unary gRPC).
    responder: Responder | None = None
    # The request's trace (tracing.py) when it was sampled; None otherwise (the hot path's only check).
    trace: TraceHook | None = None
    # Called (once, on the event loop) when the request waits for what only other requests can end: a
    # sequence's request while its sequence waits for a slot held by sequences whose END has not come.
    # A stream then stops counting it against its in-flight bound, so that it keeps reading (the ENDs
    # may be on that very stream). None: nobody asks.
    on_parked: Callable[[], None] | None = None
    # What a decoupled model's response becomes before it is counted and sent: the shared-memory binding
    # writing its outputs to the client's regions (an error when one is too small). None: nothing.
    rewrite: Callable[[InferResponse], InferResponse | Exception] | None = None


class TraceHook(Protocol):
    """What the scheduler, backends, ensembles and BLS tell a sampled request's trace (tracing.Trace)."""

    trace_id: str

    def executed(self, enqueued_ns: int, queue_ns: int, start_ns: int, compute_ns: int, rows: int, size: int) -> None:
        """The request ran: queued at ``enqueued_ns`` for ``queue_ns``, computed from ``start_ns`` for
        ``compute_ns`` (scheduler clock), in a batch of ``rows`` rows from ``size`` requests."""

    def compute_split(self, input_ns: int, infer_ns: int, output_ns: int) -> None:
        """How the backend's compute time divides: input preparation, model run, output split."""

    def child(self, request: InferRequest, kind: str, done: Callable[[Any], None]) -> Callable[[Any], None]:
        """Trace ``request`` (an ensemble step, ``kind`` "ensemble_step", or a BLS call, "bls") as a
        child of this one: sets ``request.trace`` and returns ``done`` wrapped to end its span."""

    def responses(self, responder: Responder) -> Responder:
        """A decoupled request's ``responder`` wrapped to record each response and end the span at
        the final one."""

    def forward(self, model: str, target: str) -> tuple[Callable[[Any], None], str]:
        """Start a client span for a call to another server; returns the function that ends it (with
        the call's outcome) and the W3C ``traceparent`` to send with the call."""


@dataclasses.dataclass(slots=True)
class InferResponse:
    model_name: str
    model_version: str
    outputs: list[Tensor]
    id: str = ""
    parameters: dict[str, Any] = dataclasses.field(default_factory=dict)


GRPC_CONTENTS_FIELD: dict[str, str] = {
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
"""The typed ``InferTensorContents`` field of each datatype in KServe V2 gRPC (FP16/BF16 have none)."""


SHM_REGION = "shared_memory_region"
SHM_BYTE_SIZE = "shared_memory_byte_size"
SHM_OFFSET = "shared_memory_offset"
"""Tensor parameters of Triton's shared-memory extension (shm.py reads the regions)."""


def names_region(parameters: dict[str, Any]) -> bool:
    """Whether a tensor's parameters use the shared-memory extension (cheap; for the hot path)."""
    return bool(parameters) and (SHM_REGION in parameters or SHM_BYTE_SIZE in parameters or SHM_OFFSET in parameters)


def placeholder(datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    """A read-only array of ``shape`` that allocates nothing: stands for a tensor whose data is in a
    shared-memory region until ``shm.bind`` reads it (the checks in between look at shapes only)."""
    return np.broadcast_to(np.zeros((), dtype=numpy_dtype(datatype)), shape)
