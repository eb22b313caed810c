"""KServe V2 JSON and Triton's binary tensor data extension <-> domain types.

``decode_infer`` turns an HTTP request body into an ``InferRequest`` and rejects every malformed
input with ``InvalidArgument`` (or ``PayloadTooLarge``) naming the problem before anything large is
allocated; ``encode_infer`` builds the response body. Pure functions, fuzzed in the tests.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from typing import Any

import numpy as np

from sluice.runtime import classification, shm
from sluice.runtime.errors import InvalidArgument, PayloadTooLarge
from sluice.runtime.settings import Limits
from sluice.runtime.signature import Signature
from sluice.runtime.tensor_bytes import bytes_elements, encode_bytes_elements
from sluice.runtime.types import (
    DATATYPES,
    ELEMENT_SIZE,
    WIRE_DTYPE,
    InferRequest,
    InferResponse,
    RequestedOutput,
    Tensor,
    numpy_dtype,
)

_INT_KINDS = frozenset("iu")
_ACCEPTED_KINDS = {
    "BOOL": frozenset("b"),
    "FP16": frozenset("iuf"),
    "FP32": frozenset("iuf"),
    "FP64": frozenset("iuf"),
    "BF16": frozenset("iuf"),
}


def accepted_coding(accept_encoding: bytes | None, offered: tuple[bytes, ...] = (b"gzip", b"deflate")) -> bytes | None:
    """The first of ``offered`` that an ``Accept-Encoding`` header takes, with the highest q-value
    (RFC 9110 12.5.3: q=0 refuses a coding; ``x-gzip`` is ``gzip``; ``*`` stands for any coding not
    named); None for none (the body goes as it is)."""
    if not accept_encoding:
        return None
    weights: dict[bytes, float] = {}
    for item in accept_encoding.lower().split(b","):
        coding, *params = (part.strip() for part in item.split(b";"))
        weight = 1.0
        for param in params:
            key, _, raw = param.partition(b"=")
            if key.strip() == b"q":
                try:
                    weight = float(raw)
                except ValueError:
                    weight = 0.0
        coding = b"gzip" if coding == b"x-gzip" else coding
        weights[coding] = max(weights.get(coding, 0.0), weight)
    best, best_weight = None, 0.0
    for coding in offered:
        weight = weights.get(coding, weights.get(b"*", 0.0))
        if weight > best_weight:
            best, best_weight = coding, weight
    return best


COMPRESS_MIN_BYTES = 1024
"""Inference answers shorter than this go uncompressed even to a client that accepts gzip or deflate
(with ``Vary: accept-encoding``, as the compressed ones): a few hundred bytes shrink by little, and
gzip costs the event loop ~13 us for a 144-byte answer (54 us for 2 KB) on the 2-core VM, on every
request of an aiohttp-based client (``tritonclient.http.aio``), which asks for gzip by default.
Starlette's GZip middleware draws the line at 500 bytes, Akamai at 860."""


_DATATYPE = re.compile(rb'"datatype"\s*:\s*"([A-Z0-9]+)"')
_FLOATS = frozenset((b"FP16", b"BF16", b"FP32", b"FP64"))


def worth_compressing(body: bytes, header_length: int | None) -> bool:
    """Whether an inference answer is worth gzip or deflate. Not when it is mostly binary tensor data
    and every output is floating point: random-looking mantissas come out 4-6 % smaller, for 46-78 us
    of the event loop per 2-4 KB answer (ResNet's 1000 FP16 logits, 1024 FP32 embeddings; ``timeit``
    on the 2-core VM). ``Accept-Encoding`` lets a server send any answer as it is. JSON answers,
    and binary ones with an integer, boolean or BYTES output, still go compressed."""
    if header_length is None or (len(body) - header_length) * 2 < len(body):
        return True
    datatypes = _DATATYPE.findall(body, 0, header_length)
    return not datatypes or not all(datatype in _FLOATS for datatype in datatypes)


def compress(body: bytes, coding: bytes) -> bytes:
    """``body`` in ``coding`` (``gzip``, or ``deflate``: a zlib stream, as RFC 9110 and Triton's clients mean)."""
    return gzip.compress(body, compresslevel=1) if coding == b"gzip" else zlib.compress(body, 1)


def _bad(message: str) -> InvalidArgument:
    return InvalidArgument(message)


def parse_json(body: bytes | memoryview, what: str) -> Any:
    try:
        return json.loads(bytes(body))
    except RecursionError:
        raise _bad(f"{what} is nested too deeply to parse") from None
    except UnicodeDecodeError as exc:
        raise _bad(f"{what} is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    except ValueError as exc:
        raise _bad(f"{what} is not valid JSON: {exc}") from None


def _element_count(name: str, shape: Any, limits: Limits) -> tuple[tuple[int, ...], int]:
    if not isinstance(shape, list):
        raise _bad(f"input '{name}': 'shape' must be a list of non-negative integers, got {type(shape).__name__}")
    if len(shape) > 32:
        raise _bad(f"input '{name}': shape has {len(shape)} dimensions, at most 32 are allowed")
    count = 1
    span = 1  # product of the non-zero dims: bounded too, or a 0 in the shape would hide 2**80 beside it
    for dim in shape:
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise _bad(f"input '{name}': shape entries must be integers, got {dim!r}")
        if dim < 0:
            raise _bad(f"input '{name}': shape entries must be >= 0, got {dim}")
        count *= dim
        if dim:
            span *= dim
        if span > limits.max_elements:
            raise PayloadTooLarge(
                f"input '{name}': shape {shape} holds more than {limits.max_elements} elements "
                "(the server's --max-elements limit)"
            )
    return tuple(shape), count


def _dims(shape: tuple[int, ...] | list[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _count_mismatch(name: str, given: int, count: int, shape: tuple[int, ...]) -> InvalidArgument:
    """Triton's words for data that does not fill the shape."""
    return _bad(f"input '{name}' got unexpected elements count {given}, expected {count} (shape {_dims(shape)})")


def _bf16_from_float(values: np.ndarray) -> np.ndarray:
    bits = values.astype(np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


def _float_from_bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _from_json_data(
    name: str, datatype: str, data: Any, shape: tuple[int, ...], count: int, limits: Limits
) -> np.ndarray:
    if not isinstance(data, list):
        data = [data]
    if datatype == "BYTES":
        flat = _flatten(name, data, limits.max_json_depth)
        if len(flat) != count:
            raise _count_mismatch(name, len(flat), count, shape)
        out = np.empty(count, dtype=object)
        try:
            for i, item in enumerate(flat):
                if isinstance(item, str):
                    out[i] = item.encode()
                elif isinstance(item, bool | int | float):
                    out[i] = json.dumps(item).encode()
                else:
                    raise _bad(f"input '{name}': BYTES elements must be strings, got {type(item).__name__}")
        except UnicodeEncodeError as exc:  # a lone surrogate such as "\ud800" is valid JSON but not text
            raise _bad(f"input '{name}': BYTES element {i} is not valid Unicode text: {exc.reason}") from None
        return out.reshape(shape)
    try:
        array = np.asarray(data)
    except (ValueError, OverflowError) as exc:
        raise _bad(f"input '{name}': data is not a regular array of numbers: {exc}") from None
    if array.ndim > limits.max_json_depth:
        raise _bad(f"input '{name}': data is nested {array.ndim} deep, at most {limits.max_json_depth} is allowed")
    accepted = _ACCEPTED_KINDS.get(datatype, _INT_KINDS)
    if array.dtype.kind in "fO" and accepted is _INT_KINDS and array.size:
        array = _wide_integers(name, datatype, data, array, limits.max_json_depth)
    if array.size and array.dtype.kind not in accepted:
        kinds = {
            "b": "booleans",
            "i": "integers",
            "u": "integers",
            "f": "numbers",
            "U": "strings",
            "O": "mixed values (or integers beyond 64 bits)",
        }
        raise _bad(
            f"input '{name}': {datatype} data must be "
            f"{'true/false' if datatype == 'BOOL' else ('integers' if accepted == _INT_KINDS else 'numbers')}, "
            f"got {kinds.get(array.dtype.kind, array.dtype.name)}"
        )
    if array.size != count:
        raise _count_mismatch(name, array.size, count, shape)
    if datatype == "BF16":
        with np.errstate(over="ignore"):  # out-of-range numbers become +-inf, as IEEE casts do
            return _bf16_from_float(array).reshape(shape)
    target = numpy_dtype(datatype)
    if target.kind == "f" and array.dtype != target:
        with np.errstate(over="ignore"):  # numbers beyond the type's range become +-inf, as IEEE casts do
            return array.astype(target).reshape(shape)
    if array.dtype.kind in _INT_KINDS and target.kind in _INT_KINDS:
        info = np.iinfo(target)
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise _bad(f"input '{name}': a value is out of range for {datatype} ({info.min}..{info.max})")
    return array.astype(target, copy=False).reshape(shape)


def _wide_integers(name: str, datatype: str, data: list, array: np.ndarray, max_depth: int) -> np.ndarray:
    """numpy infers float64 (or object) for integers past int64, e.g. ``[0, 2**63]``; redo those exactly."""
    flat = _flatten(name, data, max_depth)
    if len(flat) != array.size or not all(type(v) is int for v in flat):
        return array  # really floats or mixed values: the caller reports them
    try:
        return np.array(flat, dtype=np.uint64 if min(flat) >= 0 else np.int64).reshape(array.shape)
    except OverflowError:
        raise _bad(f"input '{name}': a value is out of range for {datatype}") from None


def _flatten(name: str, data: list, max_depth: int) -> list:
    """Nested lists -> flat list in row-major order, refusing nesting deeper than ``max_depth``."""
    out: list = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                if len(stack) >= max_depth:
                    raise _bad(f"input '{name}': data is nested more than {max_depth} deep")
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    return out


def _parameters(obj: dict, where: str) -> dict[str, Any]:
    params = obj.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise _bad(f"{where}: 'parameters' must be an object, got {type(params).__name__}")
    for key, value in params.items():
        if not isinstance(value, bool | int | float | str):  # as Triton (and gRPC's InferParameter): scalars
            kind = "null" if value is None else "an array" if isinstance(value, list) else "an object"
            raise _bad(f"{where}: parameter {key[:64]!r} is {kind}; allowed: a string, a number or a boolean")
    return params


def decode_infer(
    body: bytes | memoryview,
    header_length: int | None,
    model_name: str,
    model_version: str,
    limits: Limits,
) -> InferRequest:
    """Decode a V2 infer request body (JSON, or JSON header + binary tensors)."""
    view = memoryview(body)
    if header_length is None:
        header_bytes, binary = view, view[len(view) :]
    else:
        if header_length < 0 or header_length > len(view):
            raise _bad(f"Inference-Header-Content-Length is {header_length} but the body has only {len(view)} bytes")
        header_bytes, binary = view[:header_length], view[header_length:]
    header = parse_json(header_bytes, "request body")
    if not isinstance(header, dict):
        raise _bad(f"request body must be a JSON object, got {type(header).__name__}")
    request_id = header.get("id", "")
    if not isinstance(request_id, str):
        raise _bad(f"'id' must be a string, got {type(request_id).__name__}")
    params = _parameters(header, "request")
    raw_inputs = header.get("inputs", [])  # none at all is for the model to judge: its inputs may be optional
    if not isinstance(raw_inputs, list):
        raise _bad(f"'inputs' must be a list of input objects, got {type(raw_inputs).__name__}")
    inputs: list[Tensor] = []
    offset = 0
    total = 0
    for index, item in enumerate(raw_inputs):
        if not isinstance(item, dict):
            raise _bad(f"inputs[{index}] must be an object, got {type(item).__name__}")
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"inputs[{index}] needs a non-empty string 'name'")
        datatype = item.get("datatype")
        if datatype not in DATATYPES:
            raise _bad(
                f"input '{name}': unknown datatype {datatype!r}; allowed: BOOL, UINT8, UINT16, UINT32, UINT64, "
                "INT8, INT16, INT32, INT64, FP16, FP32, FP64, BF16, BYTES"
            )
        shape, count = _element_count(name, item.get("shape"), limits)
        total += count
        if total > limits.max_elements:
            raise PayloadTooLarge(f"request holds more than {limits.max_elements} tensor elements (--max-elements)")
        in_params = _parameters(item, f"input '{name}'")
        if shm.names_region(in_params):  # the data is in a shared-memory region: read when the request is bound
            if "data" in item or "binary_data_size" in in_params:
                raise _bad(f"input '{name}' has shared_memory_region and also data or binary_data_size; give one")
            inputs.append(Tensor(name, datatype, shm.placeholder(datatype, shape), in_params))
            continue
        size = in_params.get("binary_data_size")
        if size is not None:
            if "data" in item:
                raise _bad(f"input '{name}' has both 'data' and parameters.binary_data_size; give one")
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise _bad(f"input '{name}': binary_data_size must be a non-negative integer, got {size!r}")
            if offset + size > len(binary):
                raise _bad(
                    f"input '{name}': binary_data_size {size} runs past the end of the body "
                    f"({len(binary) - offset} binary bytes left)"
                )
            raw = binary[offset : offset + size]
            offset += size
            if datatype == "BYTES":
                array = bytes_elements(name, raw, count).reshape(shape)
            else:
                expected = count * ELEMENT_SIZE[datatype]
                if size != expected:
                    if size % ELEMENT_SIZE[datatype] == 0:  # whole elements: say it as Triton's clients do
                        raise _count_mismatch(name, size // ELEMENT_SIZE[datatype], count, shape)
                    raise _bad(
                        f"input '{name}' got unexpected byte size {size}, expected {expected} "
                        f"(binary_data_size for shape {_dims(shape)} of {datatype})"
                    )
                array = np.frombuffer(raw, dtype=WIRE_DTYPE[datatype]).reshape(shape)
        else:
            if "data" not in item:
                raise _bad(f"input '{name}' has neither 'data' nor parameters.binary_data_size")
            array = _from_json_data(name, datatype, item["data"], shape, count, limits)
        in_params = {k: v for k, v in in_params.items() if k != "binary_data_size"}
        inputs.append(Tensor(name, datatype, array, in_params))
    if offset != len(binary):
        raise _bad(
            f"body has {len(binary) - offset} binary bytes that no input claims "
            "(check Inference-Header-Content-Length and binary_data_size)"
        )
    outputs = None
    raw_outputs = header.get("outputs")
    default_binary = params.get("binary_data_output")
    if default_binary is not None and not isinstance(default_binary, bool):
        raise _bad(f"parameter 'binary_data_output' must be true or false, got {default_binary!r}")
    if raw_outputs is not None:
        if not isinstance(raw_outputs, list):
            raise _bad("'outputs' must be a list")
        outputs = []
        for index, item in enumerate(raw_outputs):
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                raise _bad(f"outputs[{index}] must be an object with a string 'name'")
            out_params = _parameters(item, f"output '{item['name']}'")
            if classification.PARAMETER in out_params:
                classification.requested_count(item["name"], out_params[classification.PARAMETER])
            binary_flag = out_params.get("binary_data")
            if binary_flag is not None and not isinstance(binary_flag, bool):
                raise _bad(f"output '{item['name']}': binary_data must be true or false")
            outputs.append(RequestedOutput(item["name"], binary_flag, out_params))
    request = InferRequest(model_name, model_version, inputs, outputs, request_id, params)
    return request


def decode_raw(
    body: bytes | memoryview, sig: Signature, model_name: str, model_version: str, limits: Limits
) -> InferRequest:
    """Triton's raw binary request (``Inference-Header-Content-Length: 0``): no JSON header, the whole body
    is the tensor of the model's only input, its datatype and shape taken from the model config (batch
    size 1 for a batching model; one variable dimension is deduced from the size). A BYTES input must
    have shape [1]: the body is its one element. Every output is answered in binary form."""
    if len(sig.inputs) != 1:
        raise _bad(
            f"Raw request must only have 1 input (found 1) to be deduced but got {len(sig.inputs)} inputs in "
            f"'{sig.name}' model configuration"
        )
    (spec,) = sig.inputs.values()
    shape = [1, *spec.dims] if sig.batched else list(spec.dims)
    if spec.datatype == "BYTES":
        if any(d != 1 for d in spec.dims) or not spec.dims:
            raise _bad("For BYTE datatype raw input, the model must have input shape [1]")
        array = np.empty(1, dtype=object)
        array[0] = bytes(body)
        data = array.reshape(shape)
    else:
        variable = [i for i, d in enumerate(shape) if d == -1]
        if len(variable) > 1:
            raise _bad(
                f"The shape of the raw input '{spec.name}' can not be deduced because there are more than one "
                "variable-sized dimension"
            )
        size = ELEMENT_SIZE[spec.datatype]
        fixed = size
        for d in shape:
            fixed *= d if d != -1 else 1
        if variable:
            shape[variable[0]] = len(body) // fixed if fixed else 0
        count = 1
        for d in shape:
            count *= d
        if count > limits.max_elements:
            raise PayloadTooLarge(
                f"raw input '{spec.name}' holds more than {limits.max_elements} elements (--max-elements)"
            )
        if count * size != len(body):
            allowed = f"a multiple of {fixed}" if variable else str(count * size)
            raise _bad(
                f"raw input '{spec.name}' got unexpected byte size {len(body)}, expected {allowed} "
                f"(shape {_dims(spec.dims)} of {spec.datatype} in the model config)"
            )
        data = np.frombuffer(body, dtype=WIRE_DTYPE[spec.datatype]).reshape(shape)
    tensor = Tensor(spec.name, spec.datatype, data, {})
    return InferRequest(model_name, model_version, [tensor], None, "", {"binary_data_output": True})


def _json_values(tensor: Tensor) -> list:
    data = tensor.data
    if tensor.datatype == "BYTES":
        return _json_strings(tensor.name, data.ravel().tolist())
    if tensor.datatype == "BF16":
        data = _float_from_bf16(data)
    values = data.ravel().tolist()
    return values


def _json_strings(name: str, values: list) -> list[str]:
    """BYTES elements as JSON strings; bytes that are not UTF-8 text cannot be one (replacing them would
    hand the client different data than the model produced), so that is an error naming the way out."""
    out = []
    for index, value in enumerate(values):
        if not isinstance(value, bytes):
            out.append(str(value))
            continue
        try:
            out.append(value.decode())
        except UnicodeDecodeError as exc:
            raise _bad(
                f"output '{name}': BYTES element {index} is not valid UTF-8 ({exc.reason} at byte {exc.start}), "
                "so it cannot be sent as JSON; request this output with binary_data: true "
                "(per output in 'outputs', or the request parameter binary_data_output)"
            ) from None
    return out


def json_elements(request: InferRequest, response: InferResponse) -> int:
    """How many values ``encode_infer`` will write as JSON (what its time grows with); binary outputs cost
    a copy, not this."""
    default = bool(request.parameters.get("binary_data_output", False)) if request.parameters else False
    wanted = {o.name: o.binary for o in request.outputs} if request.outputs is not None else None
    count = 0
    for tensor in response.outputs:
        binary = wanted.get(tensor.name) if wanted is not None else None
        if not (default if binary is None else binary) and shm.REGION not in tensor.parameters:
            count += tensor.data.size
    return count


def encode_infer(request: InferRequest, response: InferResponse) -> tuple[bytes, int | None]:
    """Response body, and the JSON header length when binary data follows (None for pure JSON)."""
    wanted: dict[str, RequestedOutput] | None = None
    if request.outputs is not None:
        wanted = {o.name: o for o in request.outputs}
    default_binary = bool(request.parameters.get("binary_data_output", False)) if request.parameters else False
    outputs_json = []
    blobs: list[bytes] = []
    for tensor in response.outputs:
        requested = wanted.get(tensor.name) if wanted is not None else None
        binary = default_binary if requested is None or requested.binary is None else requested.binary
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.data.shape)}
        if tensor.parameters and shm.REGION in tensor.parameters:  # written to shared memory: no data, as Triton
            entry["parameters"] = tensor.parameters
        elif binary:
            if tensor.datatype == "BYTES":
                blob = encode_bytes_elements(tensor.data)
            else:
                blob = np.ascontiguousarray(tensor.data, dtype=WIRE_DTYPE[tensor.datatype]).tobytes()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = _json_values(tensor)
        outputs_json.append(entry)
    header: dict[str, Any] = {
        "model_name": response.model_name,
        "model_version": response.model_version,
        "outputs": outputs_json,
    }
    if response.id:
        header["id"] = response.id
    if response.parameters:
        header["parameters"] = response.parameters
    head = json.dumps(header, separators=(",", ":")).encode()
    if not blobs:
        return head, None
    return b"".join([head, *blobs]), len(head)
