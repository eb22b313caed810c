"""Sluice's implementation of Triton's ``triton_python_backend_utils`` module (``pb_utils``).

Triton ``model.py`` files ``import triton_python_backend_utils as pb_utils``; the Python backend
(:mod:`sluice.runtime.backends.python`) registers this module in ``sys.modules`` under that exact
name when it loads a Python model, so those files run unchanged. Names and signatures follow
Triton's python_backend; what Sluice does not support (request rescheduling, GPU tensors)
raises :class:`TritonModelException` with a message saying so. See ``docs/python-backend.md``.

Nothing here imports the rest of Sluice: this is the surface user code sees, kept free of
Sluice's own types. What needs the server (BLS calls) goes through a :class:`ModelHost` the
Python backend binds (:func:`bound_host`) while it runs the model's code; custom metrics live in
a :class:`MetricRegistry` the server exports.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import enum
import json
import logging
import math
import re
import struct
import threading
from collections.abc import Awaitable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

# ---------------------------------------------------------------------------------------------
# Constants (values of Triton's C API enums)
# ---------------------------------------------------------------------------------------------

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2
TRITONSERVER_MEMORY_CPU = 0
TRITONSERVER_MEMORY_CPU_PINNED = 1
TRITONSERVER_MEMORY_GPU = 2

# TRITONSERVER_DataType values, as ``Tensor.triton_dtype()`` and ``numpy_to_triton_type`` return them.
TRITONSERVER_TYPE_INVALID = 0
TRITONSERVER_TYPE_BOOL = 1
TRITONSERVER_TYPE_UINT8 = 2
TRITONSERVER_TYPE_UINT16 = 3
TRITONSERVER_TYPE_UINT32 = 4
TRITONSERVER_TYPE_UINT64 = 5
TRITONSERVER_TYPE_INT8 = 6
TRITONSERVER_TYPE_INT16 = 7
TRITONSERVER_TYPE_INT32 = 8
TRITONSERVER_TYPE_INT64 = 9
TRITONSERVER_TYPE_FP16 = 10
TRITONSERVER_TYPE_FP32 = 11
TRITONSERVER_TYPE_FP64 = 12
TRITONSERVER_TYPE_BYTES = 13
TRITONSERVER_TYPE_BF16 = 14

_NUMPY_BY_TRITON_TYPE: dict[int, type] = {
    TRITONSERVER_TYPE_BOOL: np.bool_,
    TRITONSERVER_TYPE_UINT8: np.uint8,
    TRITONSERVER_TYPE_UINT16: np.uint16,
    TRITONSERVER_TYPE_UINT32: np.uint32,
    TRITONSERVER_TYPE_UINT64: np.uint64,
    TRITONSERVER_TYPE_INT8: np.int8,
    TRITONSERVER_TYPE_INT16: np.int16,
    TRITONSERVER_TYPE_INT32: np.int32,
    TRITONSERVER_TYPE_INT64: np.int64,
    TRITONSERVER_TYPE_FP16: np.float16,
    TRITONSERVER_TYPE_FP32: np.float32,
    TRITONSERVER_TYPE_FP64: np.float64,
    TRITONSERVER_TYPE_BYTES: np.object_,
}

TRITON_STRING_TO_NUMPY: dict[str, type] = {
    "TYPE_BOOL": bool,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}


def triton_string_to_numpy(triton_type_string: str) -> type:
    """``"TYPE_FP32"`` -> ``np.float32`` (KeyError for unknown names, as in Triton)."""
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def triton_to_numpy_type(data_type: int) -> type | None:
    """A ``TRITONSERVER_TYPE_*`` value -> numpy type; None when numpy has none (BF16, INVALID)."""
    return _NUMPY_BY_TRITON_TYPE.get(data_type)


def numpy_to_triton_type(data_type: Any) -> int | None:
    """A numpy dtype or type -> ``TRITONSERVER_TYPE_*`` value; None when there is none."""
    try:
        dtype = np.dtype(data_type)
    except TypeError:
        return None
    if dtype.kind == "S":
        return TRITONSERVER_TYPE_BYTES
    for code, numpy_type in _NUMPY_BY_TRITON_TYPE.items():
        if dtype == np.dtype(numpy_type):
            return code
    return None


# ---------------------------------------------------------------------------------------------
# BYTES serialization (4-byte little-endian length, then the bytes, per element in C order)
# ---------------------------------------------------------------------------------------------


def serialize_byte_tensor(input_tensor: np.ndarray) -> bytes | None:
    """Flatten an object/bytes array into length-prefixed bytes; None for non-bytes dtypes."""
    if input_tensor.size == 0:
        return b""
    if input_tensor.dtype != np.object_ and input_tensor.dtype.kind not in ("S", "U"):
        return None
    chunks: list[bytes] = []
    for item in input_tensor.flat:
        if isinstance(item, bytes):
            data = item
        elif isinstance(item, str):
            data = item.encode("utf-8")
        else:
            data = str(item).encode("utf-8")
        chunks.append(struct.pack("<I", len(data)))
        chunks.append(data)
    return b"".join(chunks)


def deserialize_bytes_tensor(encoded_tensor: bytes) -> np.ndarray:
    """Length-prefixed bytes -> 1-D object array of ``bytes``."""
    view = memoryview(encoded_tensor).cast("B")
    items: list[bytes] = []
    offset = 0
    while offset < len(view):
        if offset + 4 > len(view):
            raise TritonModelException("truncated length prefix in serialized BYTES tensor")
        (length,) = struct.unpack_from("<I", view, offset)
        offset += 4
        if offset + length > len(view):
            raise TritonModelException("element runs past the end of the serialized BYTES tensor")
        items.append(bytes(view[offset : offset + length]))
        offset += length
    array = np.empty(len(items), dtype=np.object_)
    array[:] = items
    return array


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------



def _parameters_json(parameters: Any) -> str:
    """Triton keeps request/response parameters as a JSON string; accept a dict or that string."""
    if parameters is None:
        return "{}"
    if isinstance(parameters, str):
        return parameters
    return json.dumps(parameters, default=str)

class TritonError:
    """An error a model puts in an :class:`InferenceResponse`; not an exception, as in Triton."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __str__(self) -> str:
        return self._message

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, code={self._code})"


class TritonModelException(Exception):
    """Raised by models (and by this module) to fail a call; ``message()`` as in Triton."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self._message = message

    def message(self) -> str:
        return self._message


# ---------------------------------------------------------------------------------------------
# Tensors, requests, responses
# ---------------------------------------------------------------------------------------------


class _DLPackCapsuleHolder:
    """Lets ``np.from_dlpack`` consume a bare DLPack capsule (it wants an object with ``__dlpack__``)."""

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, **_: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU


class Tensor:
    """A named tensor held as a numpy array (Sluice keeps every tensor in CPU memory)."""

    def __init__(self, name: str, numpy_array: Any, triton_dtype: int | None = None) -> None:
        if not isinstance(name, str):
            raise TritonModelException(f"Tensor name must be a str, got {type(name).__name__}")
        array = numpy_array if isinstance(numpy_array, np.ndarray) else np.asarray(numpy_array)
        if triton_dtype is not None:
            wanted = triton_to_numpy_type(triton_dtype)
            if wanted is not None and array.dtype != np.dtype(wanted):
                array = array.view(wanted)
        self._name = name
        self._array = array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def triton_dtype(self) -> int | None:
        return numpy_to_triton_type(self._array.dtype)

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> Any:
        """A DLPack capsule of the data (numeric dtypes only; BYTES has no DLPack form).

        Zero-copy for a writeable C-contiguous array. Request inputs are read-only views of the
        request's bytes, and a (legacy, unversioned) DLPack capsule cannot say read-only, so numpy
        refuses to export them: those are exported from a private copy, which the consumer may
        also write to, as it may in Triton.
        """
        array = self._array
        if array.dtype == np.object_ or array.dtype.kind in ("S", "U"):
            raise TritonModelException(f"Tensor '{self._name}': BYTES tensors cannot be converted to DLPack")
        if not (array.flags.writeable and array.flags.c_contiguous):
            array = np.array(array, order="C", copy=True)
        return array.__dlpack__()

    def __dlpack__(self, stream: Any = None) -> Any:
        """The DLPack protocol (``torch.from_dlpack(tensor)``), as Triton's Tensor has it."""
        return self.to_dlpack()

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU, device 0: Sluice's tensors are in host memory

    @staticmethod
    def from_dlpack(name: str, dlpack_tensor: Any) -> Tensor:
        """From an object with ``__dlpack__`` (e.g. a CPU torch tensor) or a bare DLPack capsule."""
        source = dlpack_tensor if hasattr(dlpack_tensor, "__dlpack__") else _DLPackCapsuleHolder(dlpack_tensor)
        try:
            array = np.from_dlpack(source)
        except (TypeError, ValueError, BufferError, RuntimeError) as exc:
            raise TritonModelException(
                f"Tensor '{name}': cannot import DLPack data ({exc}); Sluice supports CPU tensors only"
            ) from exc
        return Tensor(name, array)

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, dtype={self._array.dtype}, shape={self._array.shape})"


class PreferredMemory:
    """Accepted for compatibility with BLS code; Sluice keeps tensors in CPU memory."""

    def __init__(self, preferred_memory_type: int = TRITONSERVER_MEMORY_CPU, preferred_device_id: int = 0) -> None:
        self.preferred_memory_type = preferred_memory_type
        self.preferred_device_id = preferred_device_id


_DECOUPLED_ONLY = (
    "get_response_sender() is only available to models with model_transaction_policy { decoupled: true }; "
    "return one InferenceResponse per request from execute() instead"
)


class ModelHost(abc.ABC):
    """What the server does for model code: BLS calls. Bound by the Python backend while it runs
    ``initialize``/``execute``/``finalize`` (:func:`bound_host`)."""

    @abc.abstractmethod
    def exec(self, request: InferenceRequest, decoupled: bool) -> Any:
        """Run ``request`` on the server, blocking: an InferenceResponse, or (``decoupled``) an
        iterator of them."""

    @abc.abstractmethod
    def async_exec(self, request: InferenceRequest, decoupled: bool) -> Awaitable[Any]:
        """The same, sent at once; an awaitable of the answer on the model's own event loop."""


_host: contextvars.ContextVar[ModelHost | None] = contextvars.ContextVar("sluice_pb_utils_host", default=None)
# The host last bound, for BLS calls from threads the model started itself (a new thread does not
# inherit context variables); with one server per process, that is the right one.
_last_host: list[ModelHost] = []


@contextlib.contextmanager
def bound_host(host: ModelHost) -> Iterator[None]:
    """Make ``host`` the one BLS calls of the model code run inside this block go to."""
    token = _host.set(host)
    _last_host[:] = [host]
    try:
        yield
    finally:
        _host.reset(token)


def _current_host() -> ModelHost:
    host = _host.get() or (_last_host[0] if _last_host else None)
    if host is None:
        raise TritonModelException("BLS requests can only be made by a model the server loaded")
    return host


class InferenceRequest:
    """A request as the model sees it; models may also build one (for BLS, which Sluice lacks)."""

    def __init__(
        self,
        request_id: str = "",
        correlation_id: int | str = 0,
        inputs: Sequence[Tensor] = (),
        requested_output_names: Sequence[str] = (),
        model_name: str = "",
        model_version: int = -1,
        flags: int = 0,
        timeout: int = 0,
        preferred_memory: PreferredMemory | None = None,
        trace: Any = None,
        parameters: dict[str, Any] | str | None = None,
    ) -> None:
        self._request_id = request_id
        self._correlation_id = correlation_id
        self._inputs = list(inputs)
        self._requested_output_names = list(requested_output_names)
        self._model_name = model_name
        self._model_version = model_version
        self._flags = flags
        self._timeout = timeout
        self._preferred_memory = preferred_memory or PreferredMemory()
        self._trace = trace
        self._parameters = _parameters_json(parameters)

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def model_name(self) -> str:
        return self._model_name

    def model_version(self) -> int:
        return self._model_version

    def timeout(self) -> int:
        return self._timeout

    def trace(self) -> Any:
        return self._trace

    def requested_output_names(self) -> list[str]:
        return self._requested_output_names

    def parameters(self) -> str:
        """The request parameters as a JSON object string (``json.loads`` it), as in Triton."""
        return self._parameters

    def is_cancelled(self) -> bool:
        return False

    def get_response_sender(self) -> InferenceResponseSender:
        raise TritonModelException(_DECOUPLED_ONLY)

    def set_release_flags(self, flags: int) -> None:
        if flags != TRITONSERVER_REQUEST_RELEASE_ALL:
            raise TritonModelException("request rescheduling is not supported by Sluice yet")

    def exec(self, decoupled: bool = False) -> Any:
        """BLS: run this request on the server's ``model_name`` and wait. One InferenceResponse (an
        error is inside it, ``has_error()``), or with ``decoupled=True`` an iterator of them."""
        return _current_host().exec(self, decoupled)

    def async_exec(self, decoupled: bool = False) -> Awaitable[Any]:
        """BLS from ``async def execute``: the request is sent at once (as in Triton, several may be in
        flight: ``await asyncio.gather(*(r.async_exec() for r in requests))``); await what it returns
        for the answer (or, with ``decoupled=True``, the iterator of them)."""
        return _current_host().async_exec(self, decoupled)

    def stream_exec(self) -> Any:
        """The name older Triton releases gave ``exec(decoupled=True)``."""
        return self.exec(decoupled=True)


class InferenceResponseSender(abc.ABC):
    """The response sender of a request to a decoupled model: ``send`` zero or more responses,
    the last with ``flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL`` (the response may then be left
    out). Usable from any thread."""

    @abc.abstractmethod
    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None: ...

    @abc.abstractmethod
    def is_cancelled(self) -> bool: ...


class InferenceResponse:
    """One response: output tensors, or an error (then the tensors are ignored)."""

    def __init__(
        self,
        output_tensors: Iterable[Tensor] | None = None,
        error: TritonError | None = None,
        parameters: dict[str, Any] | str | None = None,
    ) -> None:
        if output_tensors is not None and not isinstance(output_tensors, (list, tuple)):
            raise TritonModelException('"output_tensors" must be a list.')
        if error is not None and not isinstance(error, TritonError):
            raise TritonModelException(f'"error" must be a TritonError, got {type(error).__name__}')
        self._output_tensors = list(output_tensors or ())
        self._error = error
        self._parameters = _parameters_json(parameters)

    def output_tensors(self) -> list[Tensor]:
        return self._output_tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return self._parameters


# ---------------------------------------------------------------------------------------------
# auto_complete_config
# ---------------------------------------------------------------------------------------------


class ModelConfig:
    """The config handed to ``TritonPythonModel.auto_complete_config`` and returned from it.

    Holds the config as the dict ``initialize`` sees (JSON field names, defaults included); the
    setters check what Triton's do and raise ``ValueError`` in Triton's words, which fails the load.
    """

    _INPUT_PROPERTIES = ("name", "data_type", "dims", "optional")
    _OUTPUT_PROPERTIES = ("name", "data_type", "dims")

    def __init__(self, model_config: str | dict[str, Any]) -> None:
        self._model_config: dict[str, Any] = (
            json.loads(model_config) if isinstance(model_config, str) else model_config
        )
        self._model_config.setdefault("input", [])
        self._model_config.setdefault("output", [])
        self._model_config.setdefault("max_batch_size", 0)

    @property
    def _model(self) -> str:
        return str(self._model_config.get("name", ""))

    def as_dict(self) -> dict[str, Any]:
        return self._model_config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        configured = self._model_config["max_batch_size"]
        if configured > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {configured}, but in auto-complete-config function "
                f"for model '{self._model}' specified max_batch_size {max_batch_size}"
            )
        self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        for scheduler in ("sequence_batching", "ensemble_scheduling"):
            if scheduler in self._model_config:
                raise ValueError(
                    f"Configuration specified scheduling_choice as '{scheduler}', but auto-complete-config "
                    f"function for model '{self._model}' tries to set scheduling_choice as 'dynamic_batching'"
                )
        self._model_config.setdefault("dynamic_batching", {})

    def add_input(self, input: dict[str, Any]) -> None:  # "input" as in Triton, for keyword callers
        self._add_tensor("input", input, self._INPUT_PROPERTIES)

    def add_output(self, output: dict[str, Any]) -> None:
        self._add_tensor("output", output, self._OUTPUT_PROPERTIES)

    def _add_tensor(self, section: str, tensor: dict[str, Any], allowed: tuple[str, ...]) -> None:
        """Append ``tensor`` to ``input``/``output``, or fill in the entry of the same name; an entry
        the config already gives a datatype or dims for must agree with the model."""
        where = f"in auto-complete-config function for model '{self._model}'"
        label = f"{section} '{tensor.get('name', '')}'"
        unknown = [key for key in tensor if key not in allowed]
        if unknown:
            names = ", ".join(f"'{key}'" for key in allowed[:-1]) + f" and '{allowed[-1]}'"
            raise ValueError(f"{label} {where} contains property other than {names}.")
        if "name" not in tensor:
            raise ValueError(f"{section} {where} is missing 'name' property.")
        for required in ("data_type", "dims"):
            if required not in tensor:
                raise ValueError(f"{label} {where} is missing '{required}' property.")
        for current in self._model_config[section]:
            if current.get("name") != tensor["name"]:
                continue
            configured_type = current.get("data_type", "TYPE_INVALID")
            if configured_type != "TYPE_INVALID" and configured_type != tensor["data_type"]:
                raise ValueError(
                    f"unable to load model '{self._model}', configuration expects datatype {configured_type} "
                    f"for {section} '{tensor['name']}', model provides {tensor['data_type']}"
                )
            if current.get("dims") and list(current["dims"]) != list(tensor["dims"]):
                raise ValueError(
                    f"model '{self._model}', tensor '{tensor['name']}': the model expects dims "
                    f"{list(tensor['dims'])} but the model configuration specifies dims {list(current['dims'])}"
                )
            if "optional" in current and "optional" in tensor and current["optional"] != tensor["optional"]:
                raise ValueError(
                    f"model '{self._model}', tensor '{tensor['name']}': the model expects optional "
                    f"{tensor['optional']} but the model configuration specifies optional {current['optional']}"
                )
            current.update(tensor)
            return
        self._model_config[section].append(dict(tensor))

    def set_model_transaction_policy(self, transaction_policy_dict: dict[str, Any]) -> None:
        if any(key != "decoupled" for key in transaction_policy_dict):
            raise ValueError(
                f"model transaction property in auto-complete-config function for model '{self._model}' "
                "contains property other than 'decoupled'."
            )
        policy = self._model_config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            wanted = transaction_policy_dict["decoupled"]
            if "decoupled" in policy and policy["decoupled"] != wanted:
                raise ValueError(
                    f"trying to change decoupled property in auto-complete-config for model '{self._model}', "
                    f"which is already set to '{policy['decoupled']}'."
                )
            policy["decoupled"] = wanted


# ---------------------------------------------------------------------------------------------
# Lookup helpers
# ---------------------------------------------------------------------------------------------


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    for tensor in inference_request.inputs():
        if tensor.name() == name:
            return tensor
    return None


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    for tensor in inference_response.output_tensors():
        if tensor.name() == name:
            return tensor
    return None


def get_input_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The ``input`` entry named ``name`` of the json-loaded model config, or None."""
    for properties in model_config.get("input", ()):
        if properties.get("name") == name:
            return properties
    return None


def get_output_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The ``output`` entry named ``name`` of the json-loaded model config, or None."""
    for properties in model_config.get("output", ()):
        if properties.get("name") == name:
            return properties
    return None


def using_decoupled_model_transaction_policy(model_config: dict[str, Any]) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


# ---------------------------------------------------------------------------------------------
# Logging
# ---------------------------------------------------------------------------------------------

_LOGGER_NAME = "sluice.python_model"


class LogLevel(enum.IntEnum):
    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3


_LOGGING_LEVEL = {
    LogLevel.INFO: logging.INFO,
    LogLevel.WARNING: logging.WARNING,
    LogLevel.ERROR: logging.ERROR,
    LogLevel.VERBOSE: logging.DEBUG,
}


_Level = LogLevel


class Logger:
    """Triton's model logger, writing to the ``sluice.python_model`` logger of :mod:`logging`.
    ``Logger.LogLevel`` and ``Logger.INFO`` etc. as in Triton (``logger.log("msg", logger.INFO)``)."""

    LogLevel = LogLevel
    INFO = LogLevel.INFO
    WARNING = LogLevel.WARNING
    ERROR = LogLevel.ERROR
    VERBOSE = LogLevel.VERBOSE

    @staticmethod
    def log(message: str, level: _Level = _Level.INFO) -> None:
        logging.getLogger(_LOGGER_NAME).log(_LOGGING_LEVEL[_Level(level)], "%s", message, stacklevel=2)

    @staticmethod
    def log_info(message: str) -> None:
        logging.getLogger(_LOGGER_NAME).info("%s", message, stacklevel=2)

    @staticmethod
    def log_warn(message: str) -> None:
        logging.getLogger(_LOGGER_NAME).warning("%s", message, stacklevel=2)

    @staticmethod
    def log_error(message: str) -> None:
        logging.getLogger(_LOGGER_NAME).error("%s", message, stacklevel=2)

    @staticmethod
    def log_verbose(message: str) -> None:
        logging.getLogger(_LOGGER_NAME).debug("%s", message, stacklevel=2)


# ---------------------------------------------------------------------------------------------
# Custom metrics
# ---------------------------------------------------------------------------------------------

COUNTER = "counter"
GAUGE = "gauge"
HISTOGRAM = "histogram"
_KINDS = (COUNTER, GAUGE, HISTOGRAM)
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_current_owner: contextvars.ContextVar[str] = contextvars.ContextVar("sluice_pb_utils_owner", default="")
_last_registry: list[MetricRegistry] = []


class _MetricState:
    """One labelled series: a value, or a histogram's buckets, sum and count."""

    def __init__(self, labels: tuple[tuple[str, str], ...], buckets: tuple[float, ...] | None) -> None:
        self.labels = labels
        self.value = 0.0
        self.buckets = buckets
        self.bucket_counts = [0] * len(buckets) if buckets is not None else []
        self.sum = 0.0
        self.count = 0
        self.users = 0  # Metric objects alive for this series


class _FamilyState:
    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name = name
        self.description = description
        self.kind = kind
        self.series: dict[tuple[tuple[str, str], ...], _MetricState] = {}
        self.owners: dict[str, int] = {}  # model -> MetricFamily objects it created


class MetricRegistry:
    """The custom metric families of every Python model of one server; thread-safe.

    Families are shared by name (a second ``MetricFamily`` with the same name and kind refers to
    the first one's family, as in Triton); a family and its series leave the registry when the
    last model that created them is unloaded (:meth:`release`). ``reserved`` names (Sluice's
    own families) cannot be taken."""

    def __init__(self, reserved: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._families: dict[str, _FamilyState] = {}
        self._reserved = frozenset(reserved)

    @contextlib.contextmanager
    def owned_by(self, owner: str) -> Iterator[None]:
        """Families and metrics created inside this block belong to ``owner`` (a model version)."""
        token = _current_owner.set(owner)
        _last_registry[:] = [self]
        registry_token = _registry.set(self)
        try:
            yield
        finally:
            _registry.reset(registry_token)
            _current_owner.reset(token)

    def _family(self, name: str, description: str, kind: str, owner: str) -> _FamilyState:
        if not isinstance(name, str) or not _METRIC_NAME.fullmatch(name):
            raise TritonModelException(
                f"Invalid metric family name '{name}': a metric name must match [a-zA-Z_:][a-zA-Z0-9_:]*"
            )
        if kind not in _KINDS:
            raise TritonModelException(
                f"Invalid metric family kind {kind!r} for '{name}': use pb_utils.MetricFamily.COUNTER, "
                "GAUGE or HISTOGRAM"
            )
        if name in self._reserved or any(name.startswith(prefix) for prefix in ("sluice_", "nv_")):
            raise TritonModelException(
                f"Metric family name '{name}' is reserved for the server's own metrics (names starting with "
                "'sluice_' or 'nv_'); choose another name"
            )
        with self._lock:
            family = self._families.get(name)
            if family is None:
                family = self._families[name] = _FamilyState(name, str(description), kind)
            elif family.kind != kind:
                raise TritonModelException(
                    f"Metric family with name '{name}' already exists with kind {family.kind.upper()}; "
                    f"a family of the same name cannot have kind {kind.upper()}"
                )
            family.owners[owner] = family.owners.get(owner, 0) + 1
            return family

    def _series(
        self, family: _FamilyState, labels: dict[str, str] | None, buckets: Sequence[float] | None
    ) -> _MetricState:
        labels = labels or {}
        if not isinstance(labels, dict):
            raise TritonModelException(f"Metric labels must be a dict of str to str, got {type(labels).__name__}")
        for key, value in labels.items():
            if not isinstance(key, str) or not _LABEL_NAME.fullmatch(key) or key.startswith("__"):
                raise TritonModelException(
                    f"Invalid label name '{key}' for metric family '{family.name}': a label name must match "
                    "[a-zA-Z_][a-zA-Z0-9_]* and not start with '__'"
                )
            if not isinstance(value, str):
                raise TritonModelException(
                    f"Label '{key}' of metric family '{family.name}' must be a str, got {type(value).__name__}"
                )
        bucket_tuple: tuple[float, ...] | None = None
        if family.kind == HISTOGRAM:
            if buckets is None:
                raise TritonModelException(
                    f"Missing required buckets for histogram metric family '{family.name}': "
                    "pass buckets=[...] to Metric()"
                )
            bucket_tuple = tuple(float(b) for b in buckets)
            if list(bucket_tuple) != sorted(set(bucket_tuple)):
                raise TritonModelException(
                    f"Buckets of histogram metric family '{family.name}' must be strictly increasing, "
                    f"got {list(bucket_tuple)}"
                )
        elif buckets is not None:
            raise TritonModelException(f"Buckets are only allowed for HISTOGRAM metric families, not '{family.name}'")
        series_key = tuple(sorted(labels.items()))
        with self._lock:
            series = family.series.get(series_key)
            if series is None:
                series = family.series[series_key] = _MetricState(series_key, bucket_tuple)
            elif family.kind == HISTOGRAM and series.buckets != bucket_tuple:
                raise TritonModelException(
                    f"Metric of family '{family.name}' with labels {labels} already exists with buckets "
                    f"{list(series.buckets or ())}"
                )
            series.users += 1
            return series

    def release(self, owner: str) -> None:
        """Drop what ``owner`` created: families no other model created leave the registry."""
        with self._lock:
            for name, family in list(self._families.items()):
                if family.owners.pop(owner, None) is not None and not family.owners:
                    del self._families[name]

    def snapshot(self) -> list[tuple[str, str, str, list[_MetricState]]]:
        """``(name, description, kind, series)`` of every family, for the exporter (copies)."""
        with self._lock:
            out = []
            for family in self._families.values():
                series = []
                for state in family.series.values():
                    copy = _MetricState(state.labels, state.buckets)
                    copy.value, copy.sum, copy.count = state.value, state.sum, state.count
                    copy.bucket_counts = list(state.bucket_counts)
                    series.append(copy)
                out.append((family.name, family.description, family.kind, series))
            return out

    def _update(self, action: Any) -> Any:
        with self._lock:
            return action()


_registry: contextvars.ContextVar[MetricRegistry | None] = contextvars.ContextVar(
    "sluice_pb_utils_registry", default=None
)


class MetricFamily:
    """A family of custom metrics, exported on the server's metrics port as Triton does.

    ``MetricFamily(name, description, kind)`` with ``kind`` one of ``MetricFamily.COUNTER``,
    ``GAUGE``, ``HISTOGRAM`` (also ``pb_utils.COUNTER``...)."""

    COUNTER = COUNTER
    GAUGE = GAUGE
    HISTOGRAM = HISTOGRAM

    def __init__(self, name: str, description: str, kind: str) -> None:
        registry = _registry.get() or (_last_registry[0] if _last_registry else None)
        if registry is None:
            raise TritonModelException("custom metrics are only available to models the server loaded")
        self._registry = registry
        self._owner = _current_owner.get()
        self._state = registry._family(name, description, kind, self._owner)

    def Metric(self, labels: dict[str, str] | None = None, buckets: Sequence[float] | None = None) -> Any:
        return Metric(self, labels, buckets)


class Metric:
    """One series of a :class:`MetricFamily`, picked by its labels."""

    def __init__(
        self, family: MetricFamily, labels: dict[str, str] | None = None, buckets: Sequence[float] | None = None
    ) -> None:
        self._family = family
        self._kind = family._state.kind
        self._name = family._state.name
        self._state = family._registry._series(family._state, labels, buckets)

    def _number(self, value: Any, what: str) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise TritonModelException(f"{what} of metric '{self._name}' needs a number, got {value!r}") from None
        if math.isnan(number):
            raise TritonModelException(f"{what} of metric '{self._name}' got NaN")
        return number

    def increment(self, value: float) -> None:
        number = self._number(value, "increment()")
        if self._kind == HISTOGRAM:
            raise TritonModelException(
                f"increment() is not supported for histogram metric '{self._name}'; use observe()"
            )
        if self._kind == COUNTER and number < 0:
            raise TritonModelException(f"Cannot increment counter '{self._name}' by a negative value ({number})")
        state = self._state

        def add() -> None:
            state.value += number

        self._family._registry._update(add)

    def set(self, value: float) -> None:
        number = self._number(value, "set()")
        if self._kind != GAUGE:
            raise TritonModelException(f"set() is only supported for gauge metrics; '{self._name}' is a {self._kind}")
        state = self._state

        def assign() -> None:
            state.value = number

        self._family._registry._update(assign)

    def observe(self, value: float) -> None:
        number = self._number(value, "observe()")
        if self._kind != HISTOGRAM:
            raise TritonModelException(
                f"observe() is only supported for histogram metrics; '{self._name}' is a {self._kind}"
            )
        state = self._state

        def record() -> None:
            for index, bound in enumerate(state.buckets or ()):
                if number <= bound:
                    state.bucket_counts[index] += 1
            state.sum += number
            state.count += 1

        self._family._registry._update(record)

    def value(self) -> float:
        if self._kind == HISTOGRAM:
            raise TritonModelException(f"value() is not supported for histogram metric '{self._name}'")
        state = self._state
        return float(self._family._registry._update(lambda: state.value))
