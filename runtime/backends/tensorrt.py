"""TensorRT backend: ``platform: "tensorrt_plan"`` / ``backend: "tensorrt"``, a serialized TensorRT 10
engine in ``<version>/model.plan`` (or ``default_model_filename``).

Who calls it: the repository's ``prepare`` calls :func:`probe` (deserialize the engine, read its IO
tensors and optimization profiles into an :class:`EngineInfo`) and :func:`complete_config` (Triton's
auto-complete and checks for plans), then :func:`load` and ``new_instance`` once per instance slot;
the scheduler calls ``execute`` on a worker thread.

Pure, tested on CPU without tensorrt: the TensorRT -> V2 datatype map (:data:`V2_BY_TRT`), config
completion and the IO check against the engine (:func:`complete_config`), the profiles each instance
may use (:func:`instance_profiles`, ``instance_group { profile: [...] }``), the profile chosen for a
batch (:func:`select_profile`, Triton's rule: the admitting profile nearest the ``opt`` shapes) and
the split of a batch too large for every allowed profile (:func:`plan_batches`).

Thin, needs ``tensorrt`` and a GPU: deserialization (``trt.Runtime(logger).deserialize_cuda_engine``,
one engine per device), one execution context and one CUDA stream per instance, name-based IO
(``set_input_shape`` / ``set_tensor_address`` / ``execute_async_v3``).

Device memory goes through :mod:`sluice.runtime.cudart` (ctypes ``libcudart``), not torch: the
tensorrt wheels bring ``libcudart`` with them (``nvidia-cuda-runtime``), so a TensorRT server needs no
2 GB torch install. Each instance keeps one device buffer per tensor and grows it when a batch needs
more; host copies are pageable (``cudaMemcpyAsync`` on the instance's stream, then one synchronize).
An out-of-memory or failed execution answers that batch with an error naming the model and what
failed; the buffers are dropped so the next batch allocates afresh, and the instance goes on serving.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from sluice.runtime.backends.base import LoadContext, ModelBackend, ModelInstance, Result
from sluice.runtime.backends.tensor import concat_rows, merge_inputs, split_timed
from sluice.runtime.errors import ConfigError, InvalidArgument, ModelError, SluiceError, Unavailable, Unsupported
from sluice.runtime.types import CONFIG_TYPE_BY_DATATYPE, DATATYPE_BY_CONFIG_TYPE, InferRequest, numpy_dtype

_log = logging.getLogger(__name__)

DEFAULT_FILENAME = "model.plan"

INSTALL_HINT = (
    "install the 'tensorrt' extra (pip install 'sluice[tensorrt]', TensorRT 10 for CUDA 12) on a machine with an "
    "NVIDIA GPU, or serve the model's ONNX file with backend 'onnxruntime'"
)

V2_BY_TRT: dict[str, str] = {
    "FLOAT": "FP32",
    "HALF": "FP16",
    "BF16": "BF16",
    "INT8": "INT8",
    "INT32": "INT32",
    "INT64": "INT64",
    "BOOL": "BOOL",
    "UINT8": "UINT8",
}
"""``tensorrt.DataType`` names -> V2 datatypes. FP8, INT4 and FP4 have no V2 datatype: such IO is refused."""


@dataclasses.dataclass(frozen=True)
class EngineTensor:
    """One IO tensor as the engine declares it."""

    name: str
    is_input: bool
    dtype: str
    """``tensorrt.DataType`` name, e.g. ``FLOAT``."""
    shape: tuple[int, ...]
    """The full engine shape (explicit batch: the batch dim is part of it); -1 where dynamic."""
    shape_tensor: bool = False
    """A shape tensor (``is_shape_inference_io``): its values, not its data, feed shape inference."""
    format: str = "LINEAR"
    """``tensorrt.TensorFormat`` name; only LINEAR (row-major, as numpy lays arrays out) is served."""


@dataclasses.dataclass(frozen=True)
class Range:
    """An optimization profile's shapes for one input."""

    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    def admits(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.min) and all(
            lo <= d <= hi for lo, d, hi in zip(self.min, shape, self.max, strict=True)
        )

    def distance(self, shape: Sequence[int]) -> int:
        return sum(abs(o - d) for o, d in zip(self.opt, shape, strict=True))


Profile = Mapping[str, Range]
"""Input name -> its range in one optimization profile."""


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What :func:`complete_config` and the instances need to know of an engine."""

    tensors: tuple[EngineTensor, ...]
    profiles: tuple[Profile, ...]

    @property
    def inputs(self) -> list[EngineTensor]:
        return [t for t in self.tensors if t.is_input]

    @property
    def outputs(self) -> list[EngineTensor]:
        return [t for t in self.tensors if not t.is_input]


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Rows ``start:stop`` of a batch run with optimization profile ``profile``."""

    start: int
    stop: int
    profile: int


# -- pure: config ------------------------------------------------------------------------------------


def _instance_groups(config: mc.ModelConfig, gpu_count: int) -> list[tuple[int, mc.ModelInstanceGroup]]:
    """(group index, group) for every instance, in the order ``repository.instance_plan`` numbers them:
    per group, ``count`` instances on each of its GPUs (``gpus``, else every visible one)."""
    groups = list(config.instance_group) or [mc.ModelInstanceGroup(count=1, kind=mc.ModelInstanceGroup.KIND_AUTO)]
    numbered: list[tuple[int, mc.ModelInstanceGroup]] = []
    for index, group in enumerate(groups):
        devices = len(group.gpus) or gpu_count or 1
        numbered.extend((index, group) for _ in range(devices * max(group.count, 1)))
    return numbered


def instance_profiles(config: mc.ModelConfig, num_profiles: int, gpu_count: int = 1) -> list[tuple[int, ...]]:
    """The optimization profiles each instance may use, by instance index (pure); ``gpu_count``: the
    GPUs this server sees (a group without ``gpus`` has ``count`` instances on each).

    Triton's semantics: ``instance_group { profile: ["1", "2"] }`` restricts the group's instances to
    those profiles; a group that lists none uses profile 0 only."""
    allowed = ", ".join(str(i) for i in range(num_profiles))
    per_group: dict[int, tuple[int, ...]] = {}
    for index, group in enumerate(config.instance_group):
        chosen: list[int] = []
        for name in group.profile:
            if not (name.strip().isascii() and name.strip().isdigit()) or int(name) >= num_profiles:
                raise ConfigError(
                    f"profile {name!r} is not an optimization profile of the engine; allowed: {allowed} "
                    f"(the engine has {num_profiles})",
                    field=f"instance_group[{index}].profile",
                )
            if int(name) not in chosen:
                chosen.append(int(name))
        per_group[index] = tuple(chosen) or (0,)
    return [per_group.get(index, (0,)) for index, _ in _instance_groups(config, gpu_count)]


def _shown_dtype(trt_dtype: str) -> str:
    v2 = V2_BY_TRT.get(trt_dtype)
    return f"{trt_dtype} ({CONFIG_TYPE_BY_DATATYPE[v2]})" if v2 else trt_dtype


def _profile_max_batch(profile: Profile, inputs: Sequence[EngineTensor]) -> int:
    """The largest batch every input of the profile admits (Triton's GetProfileMaxBatchSize)."""
    return min((profile[t.name].max[0] for t in inputs if t.name in profile), default=0)


def _check_engine(info: EngineInfo) -> None:
    for tensor in info.tensors:
        if tensor.shape_tensor:
            raise Unsupported(
                f"the engine's tensor '{tensor.name}' is a shape tensor; Sluice's tensorrt backend serves "
                "execution tensors only (build the engine without shape-tensor inputs)"
            )
        if tensor.format != "LINEAR":
            raise Unsupported(
                f"the engine's {'input' if tensor.is_input else 'output'} '{tensor.name}' has the vectorized IO "
                f"format {tensor.format}; Sluice's tensorrt backend serves LINEAR IO tensors only (build the engine "
                "without --inputIOFormats/--outputIOFormats, or with ':chw' for them)"
            )
        if tensor.dtype not in V2_BY_TRT:
            raise ConfigError(
                f"the engine's {'input' if tensor.is_input else 'output'} '{tensor.name}' has TensorRT type "
                f"{tensor.dtype}, which has no V2 datatype; allowed: {', '.join(V2_BY_TRT)}"
            )
    if not info.profiles and any(-1 in t.shape for t in info.inputs):
        raise ConfigError("the engine has dynamic inputs but no optimization profile")


def complete_config(config: mc.ModelConfig, info: EngineInfo) -> list[str]:
    """Check ``config`` against the engine and complete it as Triton's TensorRT backend does; return notes.

    * instances run on GPUs only (KIND_GPU or KIND_AUTO);
    * ``instance_group[].profile`` must name profiles of the engine (:func:`instance_profiles`);
    * the engine batches when every IO tensor's first dim is -1; ``max_batch_size`` 0 (unset) then
      becomes the largest batch the profiles the instances use admit, unless a listed tensor's dims
      have the engine's full rank (a hint that the model does not batch); a larger configured
      ``max_batch_size`` than that is refused, as in Triton;
    * ``dynamic_batching`` is turned on when ``max_batch_size`` > 1 and no scheduler is configured;
    * config tensors must be engine tensors with the engine's datatype and compatible dims; engine
      tensors the config does not list are added.
    """
    _check_engine(info)
    notes: list[str] = []
    for index, group in enumerate(config.instance_group):
        if group.kind not in (mc.ModelInstanceGroup.KIND_GPU, mc.ModelInstanceGroup.KIND_AUTO):
            kind = mc.ModelInstanceGroup.Kind.Name(group.kind)
            raise ConfigError(
                f"kind {kind}: TensorRT engines run on GPUs only; allowed: KIND_GPU or KIND_AUTO",
                field=f"instance_group[{index}].kind",
            )
    used = sorted({p for profiles in instance_profiles(config, max(len(info.profiles), 1)) for p in profiles})
    engine = {t.name: t for t in info.tensors}
    for section, entries, is_input in (("input", config.input, True), ("output", config.output, False)):
        names = [t.name for t in info.tensors if t.is_input == is_input]
        for index, entry in enumerate(entries):
            tensor = engine.get(entry.name)
            if tensor is None or tensor.is_input != is_input:
                raise ConfigError(
                    f"{section} '{entry.name}' is not an {section} of the TensorRT engine; the engine's {section}s: "
                    f"{', '.join(repr(n) for n in names) or 'none'}",
                    field=f"{section}[{index}].name",
                )
    batching = bool(info.tensors) and all(t.shape[:1] == (-1,) for t in info.tensors) and bool(info.profiles)
    engine_max = max((_profile_max_batch(info.profiles[p], info.inputs) for p in used), default=0) if batching else 0
    if config.max_batch_size == 0 and batching:
        full_rank = [
            entry.name
            for entry in [*config.input, *config.output]
            if len(entry.reshape.shape if entry.HasField("reshape") else entry.dims) == len(engine[entry.name].shape)
        ]
        if not full_rank:
            config.max_batch_size = engine_max
            notes.append(
                f"max_batch_size set to {engine_max}: the largest batch of the engine's optimization profiles "
                f"{used} (every engine tensor has a dynamic first dim)"
            )
    elif config.max_batch_size > 0 and not batching:
        fixed = next(t for t in info.tensors if t.shape[:1] != (-1,)) if info.tensors else None
        why = f"'{fixed.name}' has shape {list(fixed.shape)}, whose first dim is not dynamic" if fixed else "no IO"
        raise ConfigError(
            f"max_batch_size is {config.max_batch_size} but the engine cannot batch: {why}; allowed: max_batch_size: 0",
            field="max_batch_size",
        )
    elif config.max_batch_size > engine_max:
        raise ConfigError(
            f"max_batch_size is {config.max_batch_size} but the engine's optimization profiles {used} admit at most "
            f"a batch of {engine_max}; allowed: 1..{engine_max} (or list more profiles in instance_group.profile)",
            field="max_batch_size",
        )
    if (
        config.max_batch_size > 1
        and not config.HasField("dynamic_batching")
        and not config.HasField("sequence_batching")
    ):
        config.dynamic_batching.SetInParent()
        notes.append("dynamic_batching enabled: the engine batches and no scheduler is configured")
    batched = config.max_batch_size > 0
    for section, entries, is_input in (("input", config.input, True), ("output", config.output, False)):
        listed = {entry.name for entry in entries}
        for index, entry in enumerate(entries):
            _check_tensor(section, index, entry, engine[entry.name], batched)
        for tensor in info.tensors:
            if tensor.is_input != is_input or tensor.name in listed:
                continue
            dims = list(tensor.shape[1:] if batched else tensor.shape)
            added = entries.add(name=tensor.name, data_type=mc.DataType.Value(_config_type(tensor)))
            if not dims:  # the API needs a non-empty shape; the engine gets a scalar per item
                dims = [1]
                added.reshape.SetInParent()
            added.dims.extend(dims)
            notes.append(f"{section} '{tensor.name}' added from the engine: {_config_type(tensor)} dims {dims}")
    return notes


def _config_type(tensor: EngineTensor) -> str:
    return CONFIG_TYPE_BY_DATATYPE[V2_BY_TRT[tensor.dtype]]


def _check_tensor(
    section: str, index: int, entry: mc.ModelInput | mc.ModelOutput, tensor: EngineTensor, batched: bool
) -> None:
    config_shape = list(entry.reshape.shape) if entry.HasField("reshape") else list(entry.dims)
    engine_shape = list(tensor.shape[1:] if batched else tensor.shape)
    config_type = mc.DataType.Name(entry.data_type)
    shown_config = f"{config_type} dims {list(entry.dims)}" + (
        f" (reshape {config_shape})" if entry.HasField("reshape") else ""
    )
    shown_engine = f"{_shown_dtype(tensor.dtype)} shape {list(tensor.shape)}" + (
        f" ({engine_shape} after the batch dim)" if batched else ""
    )
    problem = None
    if config_type != _config_type(tensor):
        problem = "data_type", "datatypes differ"
    elif not batched and not engine_shape and config_shape == [1]:
        return  # Triton's convention for a scalar of a non-batching model
    elif len(config_shape) != len(engine_shape) or any(
        e != -1 and c != e for c, e in zip(config_shape, engine_shape, strict=False)
    ):
        problem = "reshape" if entry.HasField("reshape") else "dims", "shapes are not compatible"
    if problem is not None:
        field, what = problem
        raise ConfigError(
            f"{section} '{entry.name}': {what}: the config has {shown_config} but the engine declares {shown_engine}; "
            "allowed: the engine's datatype, its rank, each dim equal to the engine's or any where the engine's is -1",
            field=f"{section}[{index}].{field}",
        )


# -- pure: profiles and batches ----------------------------------------------------------------------


def _shown_ranges(profiles: Sequence[Profile], allowed: Sequence[int]) -> str:
    parts = []
    for index in allowed:
        ranges = ", ".join(f"{name} {list(r.min)}..{list(r.max)}" for name, r in profiles[index].items())
        parts.append(f"profile {index}: {ranges}")
    return "; ".join(parts)


def select_profile(profiles: Sequence[Profile], allowed: Sequence[int], shapes: Mapping[str, Sequence[int]]) -> int:
    """The profile to run input ``shapes`` (full shapes, batch dim included) with: among ``allowed``,
    the one admitting every shape with the smallest Manhattan distance to its ``opt`` shapes, the
    lowest index on a tie (Triton's GetMostOptimizedProfile). InvalidArgument names the shapes and the
    ranges when none admits them. An engine without profiles (static shapes) runs as profile 0."""
    if not profiles:
        return 0
    best: tuple[int, int] | None = None
    for index in sorted(set(allowed)):
        profile = profiles[index]
        if not all(name not in profile or profile[name].admits(shape) for name, shape in shapes.items()):
            continue
        distance = sum(profile[name].distance(shape) for name, shape in shapes.items() if name in profile)
        if best is None or distance < best[0]:
            best = (distance, index)
    if best is None:
        shown = ", ".join(f"{name} {list(shape)}" for name, shape in shapes.items())
        raise InvalidArgument(
            f"input shapes {shown} fit no optimization profile this instance may use; allowed: "
            f"{_shown_ranges(profiles, sorted(set(allowed)))}"
        )
    return best[1]


def plan_batches(
    profiles: Sequence[Profile], allowed: Sequence[int], shapes: Mapping[str, Sequence[int]], *, batched: bool
) -> list[Chunk]:
    """How to run a batch with input ``shapes`` (pure): one chunk when an allowed profile admits it;
    for a batching model whose batch is larger than every allowed profile admits, chunks of the
    largest admitting batch and a remainder, each with its own profile. InvalidArgument when a chunk
    fits no profile (the other dims, or a remainder below every profile's minimum batch)."""
    rows = next((shape[0] for shape in shapes.values() if shape), 0) if batched else 0
    try:
        return [Chunk(0, rows, select_profile(profiles, allowed, shapes))]
    except InvalidArgument:
        if not batched or not profiles:
            raise
    # The largest batch an allowed profile admits with these other dims.
    step = 0
    for index in sorted(set(allowed)):
        profile = profiles[index]
        limit = min((profile[n].max[0] for n in shapes if n in profile), default=0)
        if (
            limit > 0
            and limit < rows
            and all(n not in profile or profile[n].admits([limit, *s[1:]]) for n, s in shapes.items())
        ):
            step = max(step, limit)
    if step == 0:
        return [Chunk(0, rows, select_profile(profiles, allowed, shapes))]  # raises, naming the ranges
    chunks = []
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        part = {name: [stop - start, *shape[1:]] for name, shape in shapes.items()}
        chunks.append(Chunk(start, stop, select_profile(profiles, allowed, part)))
    return chunks


# -- the thin layer: tensorrt and CUDA ---------------------------------------------------------------


def _trt() -> Any:
    try:
        import tensorrt
    except ImportError as exc:
        raise Unsupported(
            f"backend 'tensorrt' needs the Python package 'tensorrt' (TensorRT 10), which is not installed in "
            f"this server ({exc}); {INSTALL_HINT}"
        ) from None
    if not hasattr(tensorrt.ICudaEngine, "num_io_tensors"):
        raise Unsupported(
            f"backend 'tensorrt' needs TensorRT 10 or newer (name-based IO tensors); this server has "
            f"{getattr(tensorrt, '__version__', 'an older version')}; {INSTALL_HINT}"
        )
    return tensorrt


def _cuda() -> Any:
    from sluice.runtime import cudart

    try:
        device = cudart.Loader().get()
    except cudart.NoCuda as exc:
        raise Unavailable(f"the tensorrt backend needs a CUDA GPU: {exc}") from None
    return device


def model_path(config: mc.ModelConfig, ctx: LoadContext) -> Path:
    path = ctx.version_dir / (config.default_model_filename or DEFAULT_FILENAME)
    if not path.exists():
        raise ConfigError(
            f"model file not found: {path} (set default_model_filename if the file has another name)",
            file=str(path),
            field="default_model_filename",
        )
    return path


_logger_lock = threading.Lock()
_shared_logger: Any = None


def _logger(trt: Any) -> Any:
    """The process's one TensorRT logger: TensorRT keeps a single logger pointer for the process (a
    second runtime's logger is ignored while the first's objects live), so one is made, never freed.
    It forwards TensorRT's warnings and errors to Sluice's log and keeps the last error (TensorRT
    says why a deserialization failed through it: read under :data:`_deserialize_lock`)."""
    global _shared_logger
    with _logger_lock:
        if _shared_logger is None:

            class Logger(trt.ILogger):  # type: ignore[misc, name-defined]
                def __init__(self) -> None:
                    trt.ILogger.__init__(self)
                    self.last_error = ""

                def log(self, severity: Any, msg: str) -> None:
                    if severity in (trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR):
                        self.last_error = msg
                        _log.error("TensorRT: %s", msg)
                    elif severity == trt.ILogger.Severity.WARNING:
                        _log.warning("TensorRT: %s", msg)

            _shared_logger = Logger()
        return _shared_logger


_deserialize_lock = threading.Lock()


def _deserialize(trt: Any, path: Path, cuda: Any, device_id: int) -> tuple[Any, Any, Any]:
    """(runtime, engine, logger) on ``device_id``; the caller keeps the runtime alive while it uses the
    engine (TensorRT wants the runtime to outlive its engines)."""
    logger = _logger(trt)
    with _deserialize_lock:
        cuda.use(device_id)
        logger.last_error = ""
        runtime = trt.Runtime(logger)
        engine = runtime.deserialize_cuda_engine(path.read_bytes())
        error = logger.last_error
    if engine is None:
        raise ConfigError(
            f"TensorRT cannot deserialize the engine: {error or 'no reason given'} (an engine runs only "
            "with the TensorRT version and GPU architecture it was built for)",
            file=str(path),
        )
    return runtime, engine, logger


def engine_info(trt: Any, engine: Any) -> EngineInfo:
    """Read the engine's IO tensors and profiles through TensorRT 10's name-based API."""
    tensors = []
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        tensors.append(
            EngineTensor(
                name=name,
                is_input=engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT,
                dtype=engine.get_tensor_dtype(name).name,
                shape=tuple(int(d) for d in engine.get_tensor_shape(name)),
                shape_tensor=bool(engine.is_shape_inference_io(name)),
                format=engine.get_tensor_format(name).name,
            )
        )
    profiles = []
    for p in range(engine.num_optimization_profiles):
        ranges = {}
        for tensor in tensors:
            if not tensor.is_input or tensor.shape_tensor:
                continue
            if -1 in tensor.shape:
                low, opt, high = engine.get_tensor_profile_shape(tensor.name, p)
                ranges[tensor.name] = Range(*(tuple(int(d) for d in dims) for dims in (low, opt, high)))
            else:  # a static input: its one shape
                ranges[tensor.name] = Range(tensor.shape, tensor.shape, tensor.shape)
        profiles.append(ranges)
    return EngineInfo(tuple(tensors), tuple(profiles))


def probe(path: Path) -> EngineInfo:
    """Deserialize the engine on GPU 0 and read its IO (for :func:`complete_config`)."""
    trt = _trt()
    runtime, engine, logger = _deserialize(trt, path, _cuda(), 0)
    info = engine_info(trt, engine)
    del engine  # before its runtime
    del runtime, logger
    return info


@dataclasses.dataclass
class _Buffer:
    pointer: int
    byte_size: int


class TrtInstance(ModelInstance):
    """One execution context with its own stream and device buffers, on one GPU."""

    def __init__(
        self, engine: Any, info: EngineInfo, config: mc.ModelConfig, profiles: tuple[int, ...], cuda: Any, device: int
    ) -> None:
        self._cuda, self._device, self._info, self._allowed = cuda, device, info, profiles
        self._label = f"{config.name}"
        self._batched = config.max_batch_size > 0
        cuda.use(device)
        self._stream = cuda.stream_create(device)
        self._context = engine.create_execution_context()
        if self._context is None:
            cuda.stream_destroy(self._stream)
            raise Unavailable(f"TensorRT cannot create an execution context for model '{config.name}' on GPU {device}")
        self._profile = 0  # a new context starts on profile 0
        self._buffers: dict[str, _Buffer] = {}
        self._inputs = info.inputs
        self._outputs = [t.name for t in info.outputs if t.name in {o.name for o in config.output}]
        self._dtypes = {t.name: numpy_dtype(V2_BY_TRT[t.dtype]) for t in info.tensors}
        self._datatypes = {o.name: DATATYPE_BY_CONFIG_TYPE[mc.DataType.Name(o.data_type)] for o in config.output}
        self._reshape = {
            o.name: (-1, *o.dims) if self._batched else tuple(o.dims) for o in config.output if o.HasField("reshape")
        }
        # an input's reshape is the engine's shape (Triton's): e.g. dims [1] reshape [] for a 0-d item
        self._input_reshape = {i.name: tuple(i.reshape.shape) for i in config.input if i.HasField("reshape")}

    def _buffer(self, name: str, byte_size: int) -> int:
        buffer = self._buffers.get(name)
        if buffer is None or buffer.byte_size < byte_size:
            if buffer is not None:
                del self._buffers[name]
                self._cuda.free(buffer.pointer, self._device)
            buffer = _Buffer(self._cuda.malloc(byte_size, self._device), max(byte_size, 1))
            self._buffers[name] = buffer
        return buffer.pointer

    def _release_buffers(self) -> None:
        buffers, self._buffers = self._buffers, {}
        for buffer in buffers.values():
            try:
                self._cuda.free(buffer.pointer, self._device)
            except Exception:  # a broken context: nothing more to free
                pass

    def _run(self, feeds: Mapping[str, np.ndarray], chunk: Chunk) -> dict[str, np.ndarray]:
        context, cuda, stream = self._context, self._cuda, self._stream
        if chunk.profile != self._profile:
            try:  # TensorRT's Python binding raises where the C++ call returns false
                switched = context.set_optimization_profile_async(chunk.profile, stream)
            except RuntimeError as exc:
                raise ModelError(
                    f"TensorRT refused optimization profile {chunk.profile} for model '{self._label}': {exc}"
                ) from None
            if not switched:
                raise ModelError(f"TensorRT refused optimization profile {chunk.profile} for model '{self._label}'")
            self._profile = chunk.profile
        keep = []  # host arrays must live until the stream is synchronized
        for tensor in self._inputs:
            array = feeds[tensor.name]
            if self._batched:
                array = array[chunk.start : chunk.stop]
            array = np.ascontiguousarray(array, dtype=self._dtypes[tensor.name])
            keep.append(array)
            if not context.set_input_shape(tensor.name, tuple(array.shape)):
                raise InvalidArgument(f"TensorRT refused shape {list(array.shape)} for input '{tensor.name}'")
            pointer = self._buffer(tensor.name, array.nbytes)
            cuda.to_device_async(pointer, array.ctypes.data, array.nbytes, stream)
            context.set_tensor_address(tensor.name, pointer)
        results = {}
        for tensor in self._info.outputs:
            shape = tuple(int(d) for d in context.get_tensor_shape(tensor.name))
            if any(d < 0 for d in shape):
                raise Unsupported(
                    f"output '{tensor.name}' has a data-dependent shape {list(shape)}; Sluice's tensorrt backend "
                    "serves outputs whose shapes follow from the input shapes"
                )
            array = np.empty(shape, dtype=self._dtypes[tensor.name])
            context.set_tensor_address(tensor.name, self._buffer(tensor.name, array.nbytes))
            results[tensor.name] = array
        if not context.execute_async_v3(stream):
            raise ModelError(f"TensorRT failed to run model '{self._label}' (execute_async_v3 returned false)")
        for name in self._outputs:
            array = results[name]
            cuda.to_host_async(array.ctypes.data, self._buffers[name].pointer, array.nbytes, stream)
        cuda.stream_synchronize(stream)
        del keep
        return {name: results[name] for name in self._outputs}

    def execute(self, requests: Sequence[InferRequest]) -> list[Result]:
        start = time.monotonic_ns()
        feeds = merge_inputs(requests)
        for name, shape in self._input_reshape.items():
            if name in feeds:
                array = feeds[name]
                feeds[name] = array.reshape((array.shape[0], *shape) if self._batched else shape)
        shapes = {name: tuple(array.shape) for name, array in feeds.items()}
        try:
            chunks = plan_batches(self._info.profiles, self._allowed, shapes, batched=self._batched)
        except SluiceError as exc:
            return [exc] * len(requests)
        inputs_done = time.monotonic_ns()
        try:
            self._cuda.use(self._device)
            parts = [self._run(feeds, chunk) for chunk in chunks]
        except SluiceError as exc:
            return [exc] * len(requests)
        except Exception as exc:
            self._release_buffers()  # after an out-of-memory the next batch allocates afresh
            from sluice.runtime import cudart

            if isinstance(exc, cudart.CudaError) and exc.code == cudart.MEMORY_ALLOCATION:
                error = ModelError(
                    f"model '{self._label}': out of GPU memory on GPU {self._device} ({exc}); the batch of "
                    f"{len(requests)} requests was not run, the instance goes on serving"
                )
            else:
                error = ModelError(f"TensorRT failed to run model '{self._label}': {type(exc).__name__}: {exc}")
            return [error] * len(requests)
        outputs_start = time.monotonic_ns()
        outputs = {}
        for name in self._outputs:
            array = parts[0][name] if len(parts) == 1 else concat_rows([p[name] for p in parts])
            if name in self._reshape:
                array = array.reshape(self._reshape[name])
            outputs[name] = (self._datatypes[name], array)
        results, self.last_phases_ns = split_timed(
            requests, outputs, batched=self._batched, start_ns=start, inputs_done_ns=inputs_done,
            outputs_start_ns=outputs_start,
        )  # fmt: skip
        return list[Result](results)

    def close(self) -> None:
        try:
            self._cuda.use(self._device)
            self._cuda.stream_synchronize(self._stream)
        finally:
            self._release_buffers()
            self._context = None
            self._cuda.stream_destroy(self._stream)


class TrtBackend(ModelBackend):
    """A loaded plan: one engine per GPU its instances use (an engine belongs to the device it was
    deserialized on)."""

    def __init__(self, config: mc.ModelConfig, ctx: LoadContext, path: Path) -> None:
        self.config = config
        self._ctx = ctx
        self._path = path
        self._trt = _trt()
        self._cuda = _cuda()
        self._engines: dict[int, tuple[Any, Any, Any, EngineInfo]] = {}
        self._profiles: list[tuple[int, ...]] | None = None

    def new_instance(self, index: int, kind: int, device_id: int) -> ModelInstance:
        if device_id >= self._cuda.device_count():
            raise Unavailable(
                f"instance_group asks for GPU {device_id} but this server sees {self._cuda.device_count()} GPUs"
            )
        if device_id not in self._engines:
            runtime, engine, logger = _deserialize(self._trt, self._path, self._cuda, device_id)
            self._engines[device_id] = (runtime, engine, logger, engine_info(self._trt, engine))
        _runtime, engine, _logger, info = self._engines[device_id]
        if self._profiles is None:
            self._profiles = instance_profiles(self.config, max(len(info.profiles), 1), self._cuda.device_count())
        return TrtInstance(engine, info, self.config, self._profiles[index], self._cuda, device_id)

    def close(self) -> None:
        while self._engines:
            device, (runtime, engine, _logger, _info) = self._engines.popitem()
            try:
                self._cuda.use(device)  # an engine's memory belongs to its device
            except Exception:  # a broken context: release what Python holds anyway
                _log.debug("cannot select GPU %d to release model '%s'", device, self.config.name, exc_info=True)
            del engine  # engines before their runtimes
            del runtime


def load(config: mc.ModelConfig, ctx: LoadContext) -> TrtBackend:
    """Open the plan; ``config`` must already be completed (:func:`complete_config`)."""
    if config.model_transaction_policy.decoupled:
        raise Unsupported(
            f"failed to load '{ctx.model_name}' version {ctx.version}: the tensorrt backend does not support "
            "model_transaction_policy { decoupled: true }; only Python-backend models may be decoupled"
        )
    return TrtBackend(config, ctx, model_path(config, ctx))
