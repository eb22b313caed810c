"""ONNX Runtime backend: one ``InferenceSession`` per instance.

Instances of kind GPU (or AUTO on a machine with CUDA) use the CUDA execution provider, with
TensorRT first when ``parameters { key: "execution_accelerator" value { string_value: "tensorrt" } }``
or an ``optimization.execution_accelerators.gpu_execution_accelerator`` named ``tensorrt`` asks for
it. Provider options come from the config as in Triton's onnxruntime backend (:func:`accelerators`:
the accelerators' ``parameters``, and the deprecated CUDA keys in the model's ``parameters``), checked
(an unknown TensorRT key or a bad value is a ConfigError naming the field and what is allowed; CUDA
keys Sluice does not know go to onnxruntime as strings, as Triton passes them);
``cpu_execution_accelerator`` ``openvino`` asks for the OpenVINO provider. Once a session is made,
:func:`session_problem` compares the providers it really has (and their ``device_id``) with those
asked for: onnxruntime's Python API otherwise drops a provider it cannot create with only a log line,
and its fallback (turned off here, at creation and at run time) retries without the options. A
session on the GPU binds its IO (:func:`binding_for`): inputs from host arrays, outputs to device
memory, copied back in one step. Session and run options come from Triton's model-config parameters
(:func:`session_settings`: threads, ``execution_mode``, the memory arena and pattern, device
allocation of initializers, arena shrinkage per run) and ``optimization.graph.level``. Sluice
defaults to one intra-op thread per instance so instances, not threads, carry the parallelism and
nothing spins against the event loop.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from sluice.runtime.backends.base import (
    LoadContext,
    ModelBackend,
    ModelInstance,
    Result,
    TensorSpec,
    client_shape,
    reshape_problem,
)
from sluice.runtime.backends.tensor import merge_inputs, split_timed
from sluice.runtime.errors import ConfigError, InvalidArgument, ModelError, SluiceError, Unavailable, Unsupported
from sluice.runtime.types import DATATYPE_BY_CONFIG_TYPE, InferRequest

_log = logging.getLogger(__name__)

# ORT type strings -> V2 datatypes.
_V2_BY_ORT = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(bfloat16)": "BF16",
    "tensor(string)": "BYTES",
}


def _ort() -> Any:
    import onnxruntime

    return onnxruntime


def why_no_gpu() -> str | None:
    """Why instance_group kind KIND_AUTO cannot place a model on a visible GPU: this onnxruntime
    build lacks the CUDA execution provider (the CPU-only ``onnxruntime``); None when it has it."""
    available = list(_ort().get_available_providers())
    if "CUDAExecutionProvider" in available:
        return None
    return f"this onnxruntime build has no CUDA execution provider (it offers {', '.join(available)}); {_INSTALL_GPU}"


_INSTALL_GPU = (
    "to run on a GPU, 'pip uninstall onnxruntime' and then install the 'gpu' extra (onnxruntime-gpu): both packages "
    "write the same onnxruntime/ directory, so with both installed what imports is whichever was installed last"
)


def model_path(config: mc.ModelConfig, ctx: LoadContext) -> Path:
    path = ctx.version_dir / (config.default_model_filename or "model.onnx")
    if not path.exists():
        raise ConfigError(
            f"model file not found: {path} (set default_model_filename if the file has another name)",
            file=str(path),
            field="default_model_filename",
        )
    return path


def _specs(args: Sequence[Any]) -> list[TensorSpec]:
    specs = []
    for arg in args:
        datatype = _V2_BY_ORT.get(arg.type)
        if datatype is None:
            raise ConfigError(f"tensor '{arg.name}' has ONNX type {arg.type}, which Sluice cannot serve")
        shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in (arg.shape or ()))
        # ORT reports [] both for a scalar and for a tensor whose shape the file does not declare;
        # the config's dims (when it lists the tensor) decide which it is, as in Triton.
        specs.append(TensorSpec(arg.name, datatype, shape, rank_known=bool(shape)))
    return specs


def probe(path: Path) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The inputs and outputs the ONNX file declares (for completing the config)."""
    ort = _ort()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise ConfigError(f"ONNX Runtime cannot load the model: {exc}", file=str(path)) from exc
    return _specs(session.get_inputs()), _specs(session.get_outputs())


def _param(config: mc.ModelConfig, key: str) -> str | None:
    if key in config.parameters:
        return config.parameters[key].string_value
    return None


def _int_param(config: mc.ModelConfig, key: str, default: int) -> int:
    raw = _param(config, key)
    if raw is None or raw == "":
        return default
    allowed = f'allowed: a whole number as its string_value, such as "4" ("0": onnxruntime picks; unset: {default})'
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{raw!r} is not an integer; {allowed}", field=f"parameters[{key}]") from None
    if value < 0:
        raise ConfigError(f"{value} is negative; {allowed}", field=f"parameters[{key}]")
    if value > MAX_THREADS:
        raise ConfigError(f"{value} is more than {MAX_THREADS}; {allowed}", field=f"parameters[{key}]")
    return value


MAX_THREADS = 1024
"""The most threads a thread-count parameter may ask for (onnxruntime takes an int32; none needs more)."""


_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")
_BOOLS = '"1"/"true" or "0"/"false"'


def _bool_param(config: mc.ModelConfig, key: str) -> bool | None:
    """A boolean model parameter; None when unset."""
    raw = _param(config, key)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value not in (*_TRUE, *_FALSE):
        raise ConfigError(f"{raw!r} is not a boolean; allowed: {_BOOLS}", field=f"parameters[{key}]")
    return value in _TRUE


# -- session and run options (pure) --------------------------------------------------------------------

GRAPH_LEVELS: dict[int, str] = {
    -1: "ORT_ENABLE_BASIC",
    0: "ORT_ENABLE_ALL",
    1: "ORT_ENABLE_EXTENDED",
    2: "ORT_DISABLE_ALL",
}
"""Triton's ``optimization { graph { level } }`` -> ``onnxruntime.GraphOptimizationLevel`` member (0, unset: all)."""

ARENA_SHRINKAGE = "memory.enable_memory_arena_shrinkage"
"""The run option (and Triton's parameter) naming the memory arenas to shrink after each run."""
_ARENA_ENTRY = re.compile(r"(cpu|gpu):(\d+)")
_GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")


@dataclasses.dataclass(frozen=True)
class SessionSettings:
    """The session and run options a model's config asks for, checked (see :func:`session_settings`)."""

    intra_op_threads: int = 1
    inter_op_threads: int = 1
    parallel: bool = False
    """``ExecutionMode.ORT_PARALLEL`` (Triton's ``execution_mode`` 1); else sequential."""
    graph_level: str = "ORT_ENABLE_ALL"
    """A ``GraphOptimizationLevel`` member name."""
    cpu_mem_arena: bool | None = None
    """``SessionOptions.enable_cpu_mem_arena``; None: onnxruntime's default (on)."""
    mem_pattern: bool | None = None
    """``SessionOptions.enable_mem_pattern``; None: onnxruntime's default (on)."""
    config_entries: tuple[tuple[str, str], ...] = ()
    """``SessionOptions.add_session_config_entry`` keys and values."""
    arena_shrinkage: tuple[str, ...] = ()
    """Arenas to shrink after each run (``"cpu:0"``, ``"gpu:<id>"``); each instance keeps its own
    (:func:`run_config`)."""
    warnings: tuple[str, ...] = ()


def _graph_level(config: mc.ModelConfig, warnings: list[str]) -> str:
    """Triton's mapping; another value is all optimizations, as in Triton (with a warning here)."""
    level = config.optimization.graph.level
    if level not in GRAPH_LEVELS:
        warnings.append(
            f"optimization.graph.level is {level}, which Triton reads as 0 (every optimization); the levels are "
            "-1 (basic), 0 (all, the default), 1 (basic and extended), 2 (none)"
        )
        return GRAPH_LEVELS[0]
    return GRAPH_LEVELS[level]


def _arena_shrinkage(config: mc.ModelConfig, cpu_mem_arena: bool | None) -> tuple[str, ...]:
    raw = _param(config, ARENA_SHRINKAGE)
    if raw is None:
        return ()
    field = f"parameters[{ARENA_SHRINKAGE}]"
    allowed = 'allowed: "cpu:0" and/or "gpu:<id>" joined by ";", such as "cpu:0;gpu:0"'
    entries: list[str] = []
    for entry in (e.strip() for e in raw.split(";")):
        if not entry:
            continue
        match = _ARENA_ENTRY.fullmatch(entry)
        if match is None or (match[1] == "cpu" and int(match[2]) != 0):
            raise ConfigError(f"{entry!r} names no memory arena; {allowed}", field=field)
        entries.append(f"{match[1]}:{int(match[2])}")
    if "cpu:0" in entries and cpu_mem_arena is False:
        raise ConfigError(
            'cpu:0 names the CPU arena, which parameters[enable_mem_arena] "0" turns off; allowed: gpu entries only, '
            "or the CPU arena on",
            field=field,
        )
    return tuple(dict.fromkeys(entries))


def session_settings(config: mc.ModelConfig) -> SessionSettings:
    """Read and check the session options of Triton's onnxruntime backend from the model config (pure).

    ``parameters``: ``intra_op_thread_count``, ``inter_op_thread_count``, ``execution_mode`` (0 sequential,
    1 parallel), ``enable_mem_arena``, ``enable_mem_pattern``, ``session.use_device_allocator_for_initializers``,
    ``memory.enable_memory_arena_shrinkage``; ``optimization.graph.level``. A bad value is a ConfigError naming the
    field and what is allowed. ``share_session_between_instances`` is not supported: set true, it is a warning."""
    intra = _int_param(config, "intra_op_thread_count", 1)
    inter = _int_param(config, "inter_op_thread_count", 1)
    entries: list[tuple[str, str]] = []
    # Spinning threads would compete with the event loop and the other instances.
    if intra != 1:
        entries.append(("session.intra_op.allow_spinning", "0"))
    if inter != 1:
        entries.append(("session.inter_op.allow_spinning", "0"))
    mode = _param(config, "execution_mode")
    if mode is not None and mode.strip() not in ("", "0", "1"):
        raise ConfigError(f"execution_mode is {mode!r}; allowed: \"0\" (sequential, the default) or \"1\" (parallel)",
                          field="parameters[execution_mode]")  # fmt: skip
    parallel = mode is not None and mode.strip() == "1"
    warnings: list[str] = []
    if parallel and inter == 1:
        warnings.append(
            'parameters[execution_mode] is "1" (parallel) but inter_op_thread_count is 1 (Sluice\'s default), so '
            'the nodes still run one at a time; set inter_op_thread_count ("0": onnxruntime picks)'
        )
    on_device = _bool_param(config, "session.use_device_allocator_for_initializers")
    if on_device is not None:
        entries.append(("session.use_device_allocator_for_initializers", "1" if on_device else "0"))
    cpu_mem_arena = _bool_param(config, "enable_mem_arena")
    if _bool_param(config, "share_session_between_instances"):
        warnings.append(
            "parameters[share_session_between_instances]: not supported; each instance has its own onnxruntime "
            "session (and its own copy of the weights)"
        )
    return SessionSettings(
        intra_op_threads=intra,
        inter_op_threads=inter,
        parallel=parallel,
        graph_level=_graph_level(config, warnings),
        cpu_mem_arena=cpu_mem_arena,
        mem_pattern=_bool_param(config, "enable_mem_pattern"),
        config_entries=tuple(entries),
        arena_shrinkage=_arena_shrinkage(config, cpu_mem_arena),
        warnings=tuple(warnings),
    )


def run_config(settings: SessionSettings, providers: Sequence[Provider]) -> dict[str, str]:
    """The ``RunOptions`` config entries of one instance (pure): the arena shrinkage entries that name an
    arena its session has (``cpu:0``; ``gpu:<id>`` when a GPU provider runs on that device). Entries for
    other GPUs belong to the instances there; onnxruntime fails every run that names an arena it lacks."""
    gpus = {f"gpu:{options.get('device_id', '0')}" for name, options in providers if name in _GPU_PROVIDERS}
    kept = [entry for entry in settings.arena_shrinkage if entry == "cpu:0" or entry in gpus]
    return {ARENA_SHRINKAGE: ";".join(kept)} if kept else {}


def session_options(ort: Any, settings: SessionSettings) -> Any:
    """An ``onnxruntime.SessionOptions`` holding ``settings`` (thin)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = settings.intra_op_threads
    options.inter_op_num_threads = settings.inter_op_threads
    options.execution_mode = ort.ExecutionMode.ORT_PARALLEL if settings.parallel else ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, settings.graph_level)
    if settings.cpu_mem_arena is not None:
        options.enable_cpu_mem_arena = settings.cpu_mem_arena
    if settings.mem_pattern is not None:
        options.enable_mem_pattern = settings.mem_pattern
    for key, value in settings.config_entries:
        options.add_session_config_entry(key, value)
    return options


# -- execution providers and their options (pure) ------------------------------------------------------

ProviderOptions = dict[str, str]
Provider = tuple[str, ProviderOptions]

GPU_ACCELERATORS = ("tensorrt", "cuda")
"""Names of ``optimization.execution_accelerators.gpu_execution_accelerator`` (Triton's onnxruntime backend)."""
CPU_ACCELERATORS = ("openvino",)
"""Names of ``optimization.execution_accelerators.cpu_execution_accelerator``."""


@dataclasses.dataclass(frozen=True)
class _Option:
    """One provider option: its ONNX Runtime key, the kind of value and, for choices, the values."""

    ort_key: str
    kind: str  # "bool", "int", "uint" (>= 0), "string" or "choice"
    choices: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """For kind "choice": accepted value (any case) -> the value ONNX Runtime is given."""

    def allowed(self) -> str:
        if self.kind == "bool":
            return _BOOLS
        if self.kind == "choice":
            return ", ".join(repr(c) for c in dict.fromkeys(self.choices))
        return {"int": "an integer", "uint": "an integer >= 0", "string": "a string"}[self.kind]

    def parse(self, raw: str) -> str | None:
        """The value for ONNX Runtime, None when ``raw`` is not allowed."""
        value = raw.strip()
        if self.kind == "bool":
            return "1" if value.lower() in _TRUE else "0" if value.lower() in _FALSE else None
        if self.kind in ("int", "uint"):
            try:
                number = int(value)
            except ValueError:
                return None
            return None if self.kind == "uint" and number < 0 else str(number)
        if self.kind == "choice":
            return {key.lower(): ort for key, ort in self.choices.items()}.get(value.lower())
        return value


def _options(table: Mapping[str, tuple[str, str]]) -> dict[str, _Option]:
    return {key: _Option(ort_key, kind) for key, (ort_key, kind) in table.items()}


PRECISION_FLAGS: dict[str, ProviderOptions] = {
    "FP32": {},
    "FP16": {"trt_fp16_enable": "1"},
    "BF16": {"trt_bf16_enable": "1"},
    "INT8": {"trt_int8_enable": "1"},
}
"""Triton's ``precision_mode`` -> the TensorRT execution provider flags it sets."""

TENSORRT_OPTIONS: dict[str, _Option] = {
    "precision_mode": _Option("precision_mode", "choice", {mode: mode for mode in PRECISION_FLAGS}),
    **_options({
        "max_workspace_size_bytes": ("trt_max_workspace_size", "uint"),
        "trt_max_partition_iterations": ("trt_max_partition_iterations", "uint"),
        "trt_min_subgraph_size": ("trt_min_subgraph_size", "uint"),
        "int8_calibration_table_name": ("trt_int8_calibration_table_name", "string"),
        "int8_use_native_calibration_table": ("trt_int8_use_native_calibration_table", "bool"),
        "trt_dla_enable": ("trt_dla_enable", "bool"),
        "trt_dla_core": ("trt_dla_core", "uint"),
        "trt_engine_cache_enable": ("trt_engine_cache_enable", "bool"),
        "trt_engine_cache_path": ("trt_engine_cache_path", "string"),
        "trt_engine_cache_prefix": ("trt_engine_cache_prefix", "string"),
        "trt_dump_subgraphs": ("trt_dump_subgraphs", "bool"),
        "trt_force_sequential_engine_build": ("trt_force_sequential_engine_build", "bool"),
        "trt_context_memory_sharing_enable": ("trt_context_memory_sharing_enable", "bool"),
        "trt_layer_norm_fp32_fallback": ("trt_layer_norm_fp32_fallback", "bool"),
        "trt_timing_cache_enable": ("trt_timing_cache_enable", "bool"),
        "trt_timing_cache_path": ("trt_timing_cache_path", "string"),
        "trt_force_timing_cache": ("trt_force_timing_cache", "bool"),
        "trt_detailed_build_log": ("trt_detailed_build_log", "bool"),
        "trt_build_heuristics_enable": ("trt_build_heuristics_enable", "bool"),
        "trt_sparsity_enable": ("trt_sparsity_enable", "bool"),
        "trt_builder_optimization_level": ("trt_builder_optimization_level", "uint"),
        "trt_auxiliary_streams": ("trt_auxiliary_streams", "int"),
        "trt_tactic_sources": ("trt_tactic_sources", "string"),
        "trt_extra_plugin_lib_paths": ("trt_extra_plugin_lib_paths", "string"),
        "trt_profile_min_shapes": ("trt_profile_min_shapes", "string"),
        "trt_profile_max_shapes": ("trt_profile_max_shapes", "string"),
        "trt_profile_opt_shapes": ("trt_profile_opt_shapes", "string"),
        "trt_cuda_graph_enable": ("trt_cuda_graph_enable", "bool"),
        "trt_dump_ep_context_model": ("trt_dump_ep_context_model", "bool"),
        "trt_ep_context_file_path": ("trt_ep_context_file_path", "string"),
        "trt_ep_context_embed_mode": ("trt_ep_context_embed_mode", "uint"),
    }),
}  # fmt: skip
"""Triton's TensorRT-accelerator keys (onnxruntime_backend README) -> TensorRT execution provider options."""

CUDA_OPTIONS: dict[str, _Option] = {
    "cudnn_conv_algo_search": _Option(
        "cudnn_conv_algo_search",
        "choice",
        {"0": "EXHAUSTIVE", "1": "HEURISTIC", "2": "DEFAULT", "EXHAUSTIVE": "EXHAUSTIVE", "HEURISTIC": "HEURISTIC",
         "DEFAULT": "DEFAULT"},
    ),
    "arena_extend_strategy": _Option(
        "arena_extend_strategy",
        "choice",
        {"0": "kNextPowerOfTwo", "1": "kSameAsRequested", "kNextPowerOfTwo": "kNextPowerOfTwo",
         "kSameAsRequested": "kSameAsRequested"},
    ),
    **_options({
        "gpu_mem_limit": ("gpu_mem_limit", "uint"),
        "do_copy_in_default_stream": ("do_copy_in_default_stream", "bool"),
        "cudnn_conv_use_max_workspace": ("cudnn_conv_use_max_workspace", "bool"),
        "cudnn_conv1d_pad_to_nc1d": ("cudnn_conv1d_pad_to_nc1d", "bool"),
        "enable_cuda_graph": ("enable_cuda_graph", "bool"),
        "use_ep_level_unified_stream": ("use_ep_level_unified_stream", "bool"),
        "use_tf32": ("use_tf32", "bool"),
        "prefer_nhwc": ("prefer_nhwc", "bool"),
        "enable_skip_layer_norm_strict_mode": ("enable_skip_layer_norm_strict_mode", "bool"),
        "tunable_op_enable": ("tunable_op_enable", "bool"),
        "tunable_op_tuning_enable": ("tunable_op_tuning_enable", "bool"),
        "tunable_op_max_tuning_duration_ms": ("tunable_op_max_tuning_duration_ms", "uint"),
    }),
}  # fmt: skip
"""CUDA execution provider options Sluice checks, under their ONNX Runtime names (Triton passes them through).
Other keys go to onnxruntime as strings, as in Triton; onnxruntime checks them when the session is made."""

CUDA_SERVER_KEYS = (
    "user_compute_stream",
    "has_user_compute_stream",
    "gpu_external_alloc",
    "gpu_external_free",
    "gpu_external_empty_cache",
)
"""CUDA provider options that take a stream or function address: the server's to set, never a config's."""

CUDA_GRAPH_KEYS = ("enable_cuda_graph", "trt_cuda_graph_enable")
"""Provider options that capture and replay CUDA graphs, refused (see :func:`accelerators`)."""

_NO_CUDA_GRAPHS = (
    "CUDA graphs are not supported by Sluice's onnxruntime backend yet: onnxruntime replays the graph it captured "
    "on the device addresses and shapes of the first run, and Sluice binds freshly allocated inputs and outputs for "
    "each batch, whose size varies, so replays would compute on stale buffers; allowed: \"0\"/\"false\" or unset"
)

DEPRECATED_CUDA_PARAMETERS = (
    "cudnn_conv_algo_search",
    "gpu_mem_limit",
    "arena_extend_strategy",
    "do_copy_in_default_stream",
)
"""CUDA options Triton also reads from the model's ``parameters`` (deprecated there; in Sluice the accelerator
wins, in Triton the parameter does: see docs/gpu-backends.md)."""


def _parsed(table: Mapping[str, _Option], key: str, raw: str, field: str, what: str) -> tuple[str, str]:
    option = table.get(key)
    if option is None:
        raise ConfigError(f"unknown {what} option {key!r}; allowed: {', '.join(table)}", field=field)
    value = option.parse(raw)
    if value is None:
        raise ConfigError(f"{key} is {raw!r}; allowed: {option.allowed()}", field=field)
    if option.ort_key in CUDA_GRAPH_KEYS and value == "1":
        raise ConfigError(f"{key} is {raw!r}: {_NO_CUDA_GRAPHS}", field=field)
    return option.ort_key, value


@dataclasses.dataclass(frozen=True)
class Accelerators:
    """What the config asks of the execution providers, checked (see :func:`accelerators`)."""

    tensorrt: ProviderOptions | None
    """TensorRT execution provider options; None: TensorRT not asked for."""
    cuda: ProviderOptions
    openvino: bool
    warnings: tuple[str, ...] = ()


def _cuda_option(key: str, raw: str, field: str) -> tuple[str, str] | None:
    """One ``cuda`` accelerator parameter for the CUDA provider; None: ignored (with a warning from the caller)."""
    if key == "device_id":
        return None
    if key in CUDA_SERVER_KEYS:
        raise ConfigError(
            f"{key} takes a CUDA stream or function address, which the server sets; allowed: any other CUDA "
            "execution provider option",
            field=field,
        )
    if key not in CUDA_OPTIONS:
        return key, raw  # as Triton: onnxruntime checks it when the session is made
    return _parsed(CUDA_OPTIONS, key, raw, field, "CUDA")


def accelerators(config: mc.ModelConfig) -> Accelerators:
    """Read and check ``optimization.execution_accelerators`` and the deprecated CUDA ``parameters`` (pure).

    An unknown accelerator, an unknown TensorRT option, or a value outside what a known option takes, is a
    ConfigError naming the field and what is allowed; so is a CUDA-graph option set on. A CUDA ``device_id``
    is ignored with a warning (the instance's GPU is used, as in Triton)."""
    where = "optimization.execution_accelerators"
    cuda: ProviderOptions = {}
    warnings: list[str] = []
    for key in DEPRECATED_CUDA_PARAMETERS:
        raw = _param(config, key)
        if raw is not None:
            ort_key, value = _parsed(CUDA_OPTIONS, key, raw, f"parameters[{key}]", "CUDA")
            cuda[ort_key] = value
    by_parameter = (_param(config, "execution_accelerator") or "").lower() == "tensorrt"  # Sluice's older switch
    tensorrt: ProviderOptions | None = {} if by_parameter else None
    for index, accelerator in enumerate(config.optimization.execution_accelerators.gpu_execution_accelerator):
        field = f"{where}.gpu_execution_accelerator[{index}]"
        name = accelerator.name.lower()
        if name not in GPU_ACCELERATORS:
            raise ConfigError(
                f"unknown GPU execution accelerator {accelerator.name!r}; allowed: {', '.join(GPU_ACCELERATORS)}",
                field=f"{field}.name",
            )
        options: ProviderOptions = {}
        for key, raw in sorted(accelerator.parameters.items()):
            key_field = f"{field}.parameters[{key}]"
            if name == "cuda":
                parsed = _cuda_option(key, raw, key_field)
                if parsed is None:
                    warnings.append(
                        f"{key_field}: ignored; each instance's CUDA provider runs on the instance's GPU "
                        "(instance_group.gpus), as in Triton"
                    )
                    continue
                ort_key, value = parsed
            else:
                ort_key, value = _parsed(TENSORRT_OPTIONS, key, raw, key_field, "TensorRT")
            if ort_key == "precision_mode":  # Triton's one key for the TensorRT EP's precision flags
                options.update(PRECISION_FLAGS[value])
            else:
                options[ort_key] = value
        if name == "tensorrt":
            tensorrt = {**(tensorrt or {}), **options}
        else:
            cuda.update(options)
    openvino = False
    for index, accelerator in enumerate(config.optimization.execution_accelerators.cpu_execution_accelerator):
        if accelerator.name.lower() not in CPU_ACCELERATORS:
            raise ConfigError(
                f"unknown CPU execution accelerator {accelerator.name!r}; allowed: {', '.join(CPU_ACCELERATORS)}",
                field=f"{where}.cpu_execution_accelerator[{index}].name",
            )
        openvino = True
    return Accelerators(tensorrt, cuda, openvino, tuple(warnings))


def providers_for(kind: int, device_id: int, config: mc.ModelConfig, available: Sequence[str]) -> list[Provider]:
    """Execution providers, each with its options, for an instance kind given what this onnxruntime
    build offers (pure). The config's accelerators are checked whatever the kind, so a bad option
    fails its load on a CPU-only machine too. TensorRT asked for on a GPU instance where the build has
    no TensorRT provider fails the load (Unavailable), as in Triton, rather than run on CUDA alone."""
    asked = accelerators(config)
    gpu_ok = "CUDAExecutionProvider" in available
    if kind == mc.ModelInstanceGroup.KIND_GPU and not gpu_ok:
        raise Unavailable(
            "instance_group kind KIND_GPU needs onnxruntime with the CUDA execution provider "
            f"(this build offers {', '.join(available)}); {_INSTALL_GPU}; or use KIND_CPU"
        )
    if kind in (mc.ModelInstanceGroup.KIND_GPU, mc.ModelInstanceGroup.KIND_AUTO) and gpu_ok:
        device = {"device_id": str(device_id)}
        providers: list[Provider] = []
        if asked.tensorrt is not None:
            if "TensorrtExecutionProvider" not in available:
                raise Unavailable(
                    "the tensorrt execution accelerator needs onnxruntime with the TensorRT execution provider "
                    f"(this build offers {', '.join(available)}); as in Triton the load fails rather than run "
                    "without it: use onnxruntime-gpu with the TensorRT libraries, or remove the accelerator"
                )
            providers.append(("TensorrtExecutionProvider", {**device, **asked.tensorrt}))
        providers.append(("CUDAExecutionProvider", {**device, **asked.cuda}))
        providers.append(("CPUExecutionProvider", {}))
        return providers
    if asked.openvino:
        if "OpenVINOExecutionProvider" not in available:
            raise Unavailable(
                "cpu_execution_accelerator 'openvino' needs onnxruntime with the OpenVINO execution provider "
                f"(this build offers {', '.join(available)}); install onnxruntime-openvino or remove the accelerator"
            )
        return [("OpenVINOExecutionProvider", {}), ("CPUExecutionProvider", {})]
    return [("CPUExecutionProvider", {})]


_WHY_MISSING = {
    "CUDAExecutionProvider": (
        "most likely the CUDA and cuDNN libraries onnxruntime-gpu needs (CUDA 12 and cuDNN 9 for 1.19 and later) "
        "are missing or not on the library path, or the GPU is not usable; onnxruntime's own message "
        "('Failed to create CUDAExecutionProvider ...') is in the server's log"
    ),
    "TensorrtExecutionProvider": (
        "most likely the TensorRT libraries (libnvinfer) onnxruntime-gpu needs are missing or not on the library "
        "path; onnxruntime's own message ('Failed to create TensorrtExecutionProvider ...') is in the server's log. "
        "As in Triton the load fails rather than run without TensorRT; remove the tensorrt accelerator to serve "
        "on CUDA alone"
    ),
    "OpenVINOExecutionProvider": (
        "most likely the OpenVINO libraries onnxruntime-openvino needs are missing; onnxruntime's own message is in "
        "the server's log"
    ),
}


def session_problem(
    asked: Sequence[Provider], providers: Sequence[str], options: Mapping[str, Mapping[str, str]]
) -> Unavailable | None:
    """Whether a session made with the ``asked`` providers got them (pure): ``providers`` and ``options``
    are what it reports (``get_providers()``, ``get_provider_options()``). onnxruntime's Python API leaves
    out a provider it cannot create, logging a warning, and its creation fallback retries without the
    options (so on GPU 0). None: every asked provider is there, on the asked device; else the load's error.
    A missing CUDA provider is named first: TensorRT needs it too."""
    names = [name for name, _ in asked]
    missing = [name for name in names if name != "CPUExecutionProvider" and name not in providers]
    missing.sort(key=lambda name: name != "CUDAExecutionProvider")
    has = ", ".join(providers) or "none"
    if missing:
        name = missing[0]
        device = dict(asked)[name].get("device_id")
        on = f" on GPU {device}" if device is not None else ""
        why = _WHY_MISSING.get(name, "onnxruntime's own message is in the server's log")
        return Unavailable(f"onnxruntime could not create the {name}{on} (the session has {has}): {why}")
    for name, wanted in asked:
        got = options.get(name, {}).get("device_id")
        if "device_id" in wanted and got is not None and got != wanted["device_id"]:
            return Unavailable(
                f"the session's {name} runs on GPU {got} instead of the instance's GPU {wanted['device_id']}: "
                "onnxruntime dropped the provider options (its fallback after a provider error)"
            )
    return None


@dataclasses.dataclass(frozen=True)
class Binding:
    """IO binding of a GPU session: inputs are bound from host arrays (ONNX Runtime copies them to
    the device once), outputs to memory on ``device`` (ONNX Runtime allocates it), copied back after
    the run in one step."""

    device: str
    device_id: int


def binding_for(providers: Sequence[Provider], config: mc.ModelConfig, datatypes: Iterable[str]) -> Binding | None:
    """Whether and where to bind IO (pure): on a session whose first provider runs on the GPU, outputs
    to device memory (``"cuda"``), unless ``parameters { key: "io_binding" value { string_value: "off" } }``
    or a BYTES tensor (strings live on the host) is among the model's ``datatypes``; None: plain ``run``."""
    raw = (_param(config, "io_binding") or "on").lower()
    if raw not in ("on", "off"):
        raise ConfigError(f"must be 'on' or 'off', got {raw!r}", field="parameters[io_binding]")
    name, options = providers[0]
    if raw == "off" or name not in ("CUDAExecutionProvider", "TensorrtExecutionProvider"):
        return None
    if "BYTES" in set(datatypes):
        return None
    return Binding("cuda", int(options.get("device_id", "0")))


class OnnxInstance(ModelInstance):
    def __init__(
        self, session: Any, config: mc.ModelConfig, model_label: str, providers: Sequence[Provider] = (),
        binding: Binding | None = None, run_config: Mapping[str, str] | None = None,
    ) -> None:
        """``binding``: where to bind IO (``binding_for`` decides it from ``providers`` when not given);
        ``run_config``: ``RunOptions`` config entries for every run (:func:`run_config`)."""
        self._session = session
        self._run_options: Any = None
        if run_config:
            self._run_options = _ort().RunOptions()
            for key, value in run_config.items():
                self._run_options.add_run_config_entry(key, value)
        self._label = model_label
        self._batched = config.max_batch_size > 0
        self._outputs = [o.name for o in config.output]
        self._datatypes = {o.name: DATATYPE_BY_CONFIG_TYPE[mc.DataType.Name(o.data_type)] for o in config.output}
        # ``reshape`` names the shape the model produces; clients see ``dims`` (plus the batch dim).
        self._reshape = {
            o.name: (tuple(o.dims), tuple(o.reshape.shape)) for o in config.output if o.HasField("reshape")
        }
        self._string_inputs = {i.name for i in config.input if i.data_type == mc.TYPE_STRING}
        # Sequence batching: the scheduler feeds control and state inputs and takes the state outputs.
        for control_input in config.sequence_batching.control_input:
            if any(c.data_type == mc.TYPE_STRING for c in control_input.control):
                self._string_inputs.add(control_input.name)
        for state in config.sequence_batching.state:
            if state.output_name not in self._outputs:
                self._outputs.append(state.output_name)
            self._datatypes[state.output_name] = DATATYPE_BY_CONFIG_TYPE[mc.DataType.Name(state.data_type)]
            if state.data_type == mc.TYPE_STRING:
                self._string_inputs.add(state.input_name)
        datatypes = [
            *self._datatypes.values(),
            *(DATATYPE_BY_CONFIG_TYPE[mc.DataType.Name(i.data_type)] for i in config.input),
        ]
        if binding is None and providers:
            binding = binding_for(providers, config, datatypes)
        self._binding = binding

    def _run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        if self._binding is None:
            return list(self._session.run(self._outputs, feeds, self._run_options))
        binding = self._session.io_binding()
        for name, array in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
        for name in self._outputs:
            binding.bind_output(name, self._binding.device, self._binding.device_id)
        self._session.run_with_iobinding(binding, self._run_options)
        return list(binding.copy_outputs_to_cpu())

    def execute(self, requests: Sequence[InferRequest]) -> list[Result]:
        # The three parts are timed for every batch: the statistics' compute_input/output (last_phases_ns),
        # and, for a batch with sampled requests (tracing.py), their compute_input/infer/output spans.
        start = time.monotonic_ns()
        feeds = merge_inputs(requests)
        for name in self._string_inputs.intersection(feeds):
            feeds[name] = np.vectorize(lambda b: b.decode("utf-8", "replace"), otypes=[object])(feeds[name])
        inputs_done = time.monotonic_ns()
        self.last_phases_ns = (inputs_done - start, 0)
        try:
            arrays = self._run(feeds)
        except Exception as exc:
            error: SluiceError = ModelError(
                f"onnxruntime failed to run model '{self._label}': {type(exc).__name__}: {exc}"
            )
            if "INVALID_ARGUMENT" in str(exc):
                error = InvalidArgument(f"model '{self._label}' rejected the inputs: {exc}")
            return [error] * len(requests)
        outputs_start = time.monotonic_ns()
        outputs = {}
        for name, array in zip(self._outputs, arrays, strict=True):
            if name in self._reshape:
                dims, model_shape = self._reshape[name]
                shape = client_shape(array.shape, dims, model_shape, self._batched)
                if shape is None:
                    problem = reshape_problem(self._label, name, array.shape, dims, model_shape)
                    return [ModelError(problem)] * len(requests)
                array = array.reshape(shape)
            if array.dtype == np.object_ or array.dtype.kind == "U":
                items = [s.encode() if isinstance(s, str) else s for s in array.ravel()]
                array = np.array(items, dtype=object).reshape(array.shape)
            outputs[name] = (self._datatypes[name], array)
        results, self.last_phases_ns = split_timed(
            requests, outputs, batched=self._batched, start_ns=start, inputs_done_ns=inputs_done,
            outputs_start_ns=outputs_start,
        )  # fmt: skip
        return list[Result](results)


class OnnxBackend(ModelBackend):
    def __init__(
        self, config: mc.ModelConfig, ctx: LoadContext, path: Path, settings: SessionSettings | None = None
    ) -> None:
        self.config = config
        self._ctx = ctx
        self._path = path
        self._settings = settings if settings is not None else session_settings(config)

    def new_instance(self, index: int, kind: int, device_id: int) -> ModelInstance:
        ort = _ort()
        providers = providers_for(kind, device_id, self.config, ort.get_available_providers())
        options = session_options(ort, self._settings)
        try:
            # enable_fallback=0: a provider that fails to start fails the load, instead of onnxruntime
            # retrying on its fallback providers without their options.
            session = ort.InferenceSession(str(self._path), options, providers=providers, enable_fallback=0)
        except Exception as exc:
            raise ConfigError(f"ONNX Runtime cannot load the model: {exc}", file=str(self._path)) from exc
        session.disable_fallback()  # a provider failing in run() is the batch's error, not a rebuild on the CPU
        problem = session_problem(providers, session.get_providers(), session.get_provider_options())
        if problem is not None:
            raise problem
        label = f"{self._ctx.model_name}:{self._ctx.version}"
        return OnnxInstance(session, self.config, label, providers, run_config=run_config(self._settings, providers))


def load(config: mc.ModelConfig, ctx: LoadContext) -> OnnxBackend:
    """Open the model file; ``config`` must already be completed (see config.complete_io). The session
    options and accelerators are checked here, before any instance, and their warnings logged."""
    if config.model_transaction_policy.decoupled:
        raise Unsupported(
            f"failed to load '{ctx.model_name}' version {ctx.version}: the onnxruntime backend does not support "
            "model_transaction_policy { decoupled: true }; only Python-backend models may be decoupled"
        )
    settings = session_settings(config)
    for warning in (*settings.warnings, *accelerators(config).warnings):
        _log.warning("model '%s' version %d: %s", ctx.model_name, ctx.version, warning)
    return OnnxBackend(config, ctx, model_path(config, ctx), settings)
