"""Triton's ``model_warmup``: samples run on every instance of a model version before it is ready.

A version is marked ready only after each of its instances ran each sample ``count`` times (at least
once) without an error, so the first client requests do not pay for lazy initialisation (allocator
growth, kernel selection, JIT compilation, first CUDA launches). As in Triton:

* a sample is ``batch_size`` requests of one row each (``[1, *dims]`` when the model batches, ``dims``
  when it does not), executed together as one batch on the instance (one request at a time for a model
  that does not batch, as Sluice's scheduler gives them), bypassing the scheduler, so it counts in no
  statistics; ``batch_size: 0`` skips the sample;
* inputs are ``zero_data`` (zeros; empty strings for ``TYPE_STRING``), ``random_data`` (random bytes,
  as Triton fills them; zeros for ``TYPE_STRING``) or ``input_data_file`` (a file under the model's
  ``warmup/`` directory: raw little-endian values, of which the first ``dims`` worth are used, or
  for ``TYPE_STRING`` the whole file in Triton's length-prefixed form);
* names that are not model inputs may be the sequence batcher's control or state inputs (``START``,
  ``READY``, ...), which a sample sets itself;
* any error fails the load: ``failed to run warmup sample '<name>': ...``.

What Sluice adds: a sample that cannot be built (a variable dimension left in ``dims``, an input the
model does not have, a file missing, outside ``warmup/`` or too short, a batch size the model cannot
take) is a config error naming the field and what is allowed, before any instance runs it. The
requests go through the same validation and ``reshape`` as a client's (``signature.check_request``).

:func:`build` is pure apart from reading the sample files; :func:`run` calls the instance.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from sluice.runtime.backends.base import ModelInstance
from sluice.runtime.errors import ConfigError, InvalidArgument, SluiceError
from sluice.runtime.signature import Signature, check_request
from sluice.runtime.tensor_bytes import bytes_elements
from sluice.runtime.types import DATATYPE_BY_CONFIG_TYPE, WIRE_DTYPE, InferRequest, InferResponse, Tensor

MAX_INPUT_BYTES = 1 << 30
"""The largest warmup input of one request (1 GiB): dims beyond it are a config error, not a failed
allocation."""
RESPONSE_TIMEOUT_S = 600.0
"""How long a decoupled model's warmup waits for each request's final response."""
WARMUP_DIR = "warmup"
"""Where ``input_data_file`` names lie, inside the model's directory (Triton's ``kWarmupDataFolder``)."""


@dataclasses.dataclass(frozen=True)
class Sample:
    name: str
    count: int
    """Runs on each instance (Triton's ``count``, at least 1)."""
    rows: int
    """Requests executed together (``batch_size``)."""
    inputs: tuple[Tensor, ...]
    """One request's model inputs, before validation."""
    controls: tuple[Tensor, ...]
    """Sequence control/state inputs the sample sets, added after validation."""


def build(config: mc.ModelConfig, model_dir: Path, source: str) -> list[Sample]:
    """The config's warmup samples, checked and with their data; raises ConfigError (file ``source``)."""
    inputs = {i.name: i for i in config.input}
    controls = _control_names(config)
    samples: list[Sample] = []
    for index, setting in enumerate(config.model_warmup):
        field = f"model_warmup[{index}]"
        name = setting.name or f"#{index}"
        if setting.batch_size == 0:
            continue  # as Triton: skipped
        if config.max_batch_size > 0 and setting.batch_size > config.max_batch_size:
            raise ConfigError(
                f"warmup sample '{name}' has batch_size {setting.batch_size}; allowed: 0 (skip the sample) to "
                f"{config.max_batch_size} (max_batch_size)",
                file=source,
                field=f"{field}.batch_size",
            )
        built: list[Tensor] = []
        set_controls: list[Tensor] = []
        for input_name in sorted(setting.inputs):
            meta = setting.inputs[input_name]
            where = f"{field}.inputs[{input_name}]"
            if input_name not in inputs and input_name not in controls:
                allowed = ", ".join(sorted([*inputs, *controls])) or "none"
                raise ConfigError(
                    f"warmup sample '{name}' sets input '{input_name}', which the model does not have; "
                    f"allowed: {allowed}",
                    file=source,
                    field=where,
                )
            tensor = _tensor(input_name, meta, config.max_batch_size > 0, model_dir, source, where, name)
            (built if input_name in inputs else set_controls).append(tensor)
        samples.append(Sample(name, max(setting.count, 1), setting.batch_size, tuple(built), tuple(set_controls)))
    return samples


def _control_names(config: mc.ModelConfig) -> set[str]:
    if not config.HasField("sequence_batching"):
        return set()
    batching = config.sequence_batching
    return {c.name for c in batching.control_input} | {s.input_name for s in batching.state}


def _tensor(
    name: str, meta: mc.ModelWarmup.Input, batched: bool, model_dir: Path, source: str, where: str, sample: str
) -> Tensor:
    type_name = mc.DataType.Name(meta.data_type)
    datatype = DATATYPE_BY_CONFIG_TYPE.get(type_name)
    if datatype is None:
        raise ConfigError(
            f"warmup sample '{sample}' input '{name}' has data_type {type_name}; allowed: "
            + ", ".join(sorted(DATATYPE_BY_CONFIG_TYPE)),
            file=source,
            field=f"{where}.data_type",
        )
    dims = tuple(int(d) for d in meta.dims)
    if any(d < 0 for d in dims):
        raise ConfigError(
            f"warmup setting expects all variable-size dimensions are specified for input '{name}' "
            f"(sample '{sample}', dims {list(dims)}); give each dimension its size",
            file=source,
            field=f"{where}.dims",
        )
    shape = (1, *dims) if batched else dims
    count = math.prod(shape)  # Python ints: no overflow
    size = count * (4 if datatype == "BYTES" else WIRE_DTYPE[datatype].itemsize)
    if size > MAX_INPUT_BYTES:
        raise ConfigError(
            f"warmup sample '{sample}' input '{name}' of dims {list(dims)} is {size} bytes; allowed: at most "
            f"{MAX_INPUT_BYTES} bytes a request",
            file=source,
            field=f"{where}.dims",
        )
    kind = meta.WhichOneof("input_data_type")
    if kind is None:
        raise ConfigError(
            f"warmup setting expects input '{name}' to have input_data_type set (sample '{sample}'); "
            "allowed: zero_data, random_data, input_data_file",
            file=source,
            field=where,
        )
    if kind == "input_data_file":
        raw = _read(model_dir, meta.input_data_file, source, f"{where}.input_data_file", sample, name)
        if datatype == "BYTES":
            try:
                data = bytes_elements(name, memoryview(raw), count).reshape(shape)
            except InvalidArgument as exc:
                raise ConfigError(
                    f"warmup sample '{sample}': {WARMUP_DIR}/{meta.input_data_file} is not {count} length-prefixed "
                    f"strings: {exc.message}",
                    file=source,
                    field=f"{where}.input_data_file",
                ) from None
            return Tensor(name, datatype, data)
        dtype = WIRE_DTYPE[datatype]
        needed = count * dtype.itemsize
        if len(raw) < needed:
            raise ConfigError(
                f"warmup setting expects {needed} bytes, but the data provided from "
                f"{WARMUP_DIR}/{meta.input_data_file} only has {len(raw)} bytes (sample '{sample}', input '{name}')",
                file=source,
                field=f"{where}.input_data_file",
            )
        values = np.frombuffer(raw, dtype=dtype, count=count).reshape(shape)
        return Tensor(name, datatype, _native(values, datatype))
    if datatype == "BYTES":  # zeros, also for random_data (Triton: a zero length per element)
        return Tensor(name, datatype, np.full(shape, b"", dtype=object))
    dtype = WIRE_DTYPE[datatype]
    if kind == "zero_data":
        return Tensor(name, datatype, np.zeros(shape, dtype=dtype.newbyteorder("=")))
    random = np.random.default_rng(0).bytes(count * dtype.itemsize)  # reproducible, as Triton's rand() bytes
    return Tensor(name, datatype, _native(np.frombuffer(random, dtype=dtype).reshape(shape), datatype))


def _native(values: np.ndarray, datatype: str) -> np.ndarray:
    if datatype == "BOOL":
        return values != 0
    return values.astype(values.dtype.newbyteorder("="), copy=True)  # writable, native order


def _read(model_dir: Path, relative: str, source: str, field: str, sample: str, name: str) -> bytes:
    base = model_dir / WARMUP_DIR
    shown = f"{WARMUP_DIR}/{relative}"
    path = Path(relative)
    if not relative or path.is_absolute() or ".." in path.parts:
        raise ConfigError(
            f"warmup sample '{sample}' input '{name}': input_data_file {relative!r} must be a relative path "
            f"inside the model's {WARMUP_DIR}/ directory",
            file=source,
            field=field,
        )
    target = base / path
    try:
        if not target.resolve().is_relative_to(base.resolve()):
            raise ConfigError(
                f"warmup sample '{sample}' input '{name}': {shown} leads outside the model's {WARMUP_DIR}/ directory",
                file=source,
                field=field,
            )
        return target.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"warmup sample '{sample}' input '{name}': cannot read {shown}: {exc.strerror or type(exc).__name__}",
            file=source,
            field=field,
        ) from None


def requests(sample: Sample, model_name: str, version: int, sig: Signature) -> list[InferRequest]:
    """Fresh requests for one run of ``sample`` (a backend may keep or change what it is given),
    validated and reshaped as a client's are; raises InvalidArgument as for a client."""
    out = []
    for row in range(sample.rows):
        request = InferRequest(
            model_name,
            str(version),
            [Tensor(t.name, t.datatype, t.data.copy()) for t in sample.inputs],
            id=f"warmup:{sample.name}:{row}",
        )
        check_request(request, sig)
        request.inputs.extend(Tensor(t.name, t.datatype, t.data.copy()) for t in sample.controls)
        out.append(request)
    return out


class _Responses:
    """A decoupled model's responses to one warmup request: their errors, and whether the last came."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.done = threading.Event()

    def __call__(self, outcome: InferResponse | Exception | None, final: bool) -> None:
        if isinstance(outcome, SluiceError):
            self.errors.append(outcome.message)
        elif isinstance(outcome, Exception):
            self.errors.append(f"{type(outcome).__name__}: {outcome}")
        if final:
            self.done.set()


def run(
    instance: ModelInstance,
    instance_name: str,
    samples: Sequence[Sample],
    model_name: str,
    version: int,
    sig: Signature,
    *,
    decoupled: bool = False,
    timeout_s: float = RESPONSE_TIMEOUT_S,
) -> None:
    """Run every sample ``count`` times on ``instance``; raises InvalidArgument (Triton's words) when
    one cannot run or any of its requests fails. A ``decoupled`` model's responses are waited for, each
    request's up to its final flag (``timeout_s`` at most), and their errors count, as Triton's do."""
    for sample in samples:
        for _ in range(sample.count):
            streams: list[_Responses] = []
            try:
                batch = requests(sample, model_name, version, sig)
                if decoupled:
                    for request in batch:
                        streams.append(_Responses())
                        request.responder = streams[-1]
                # a model that does not batch gets its requests one at a time, as Sluice's scheduler gives them
                groups = [batch] if sig.batched else [[request] for request in batch]
                results = [result for group in groups for result in instance.execute(group)]
            except SluiceError as exc:
                raise _failed(sample, instance_name, [exc.message]) from None
            except Exception as exc:  # a backend's own failure: the load says which sample met it
                raise _failed(sample, instance_name, [f"{type(exc).__name__}: {exc}"]) from exc
            errors = [r.message for r in results if not isinstance(r, InferResponse)]
            if errors:
                raise _failed(sample, instance_name, errors)
            for stream in streams:
                if not stream.done.wait(timeout_s):
                    raise _failed(sample, instance_name, [f"no final response within {timeout_s:g} s"])
                if stream.errors:
                    raise _failed(sample, instance_name, stream.errors)


def _failed(sample: Sample, instance_name: str, errors: Sequence[str]) -> InvalidArgument:
    why = "; ".join(dict.fromkeys(errors))
    return InvalidArgument(f"failed to run warmup sample '{sample.name}' on instance '{instance_name}': {why}")
