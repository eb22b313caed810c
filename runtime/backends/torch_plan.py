"""Pure decisions of the PyTorch backend (``pytorch.py``): no torch import, no I/O, tested alone.

* :func:`model_kind` tells a TorchScript archive, a ``torch.export`` program and an AOTInductor
  package apart from the names inside the zip file (all three are zip archives).
* :func:`torch_settings` reads the ``parameters`` Triton's PyTorch backend documents (and Sluice's
  ``precision`` / ``memory_format``) into a :class:`TorchSettings`, refusing bad values.
* :func:`input_binding` / :func:`output_binding` apply Triton's naming conventions: forward()
  argument names, ``<name>__<index>``, else the config's order; :func:`pick_outputs` maps what the
  model returned (a tensor, tuple, list or dict) to the config's outputs.
* :func:`run_dtype`, :func:`channels_last_inputs`, :func:`pinned_capacity` and
  :func:`example_shape` are the CUDA path's decisions, kept here so they are tested on CPU.
* :func:`check_kind_settings` refuses the parameters a kind of model file cannot honour (an
  AOTInductor package's ``precision`` and ``memory_format`` are fixed when it is compiled).
* :func:`casts_to_precision` and :func:`precision_problem` are the ``precision`` parameter's: which
  tensors are cast, and whether the check call at load failed because the model does not run in it.
* :func:`failure` turns an exception from the model into the error the batch is answered with
  (out of GPU memory: Unavailable; a sticky CUDA error: DeviceLost; the instance keeps serving).

Called by ``pytorch.py`` (load and execute) and by the repository (load warnings).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from sluice.runtime.errors import ConfigError, DeviceLost, ModelError, SluiceError, Unavailable

TORCHSCRIPT, EXPORT, AOTI = "torchscript", "export", "aoti"
"""Model file kinds: ``torch.jit.save`` archive, ``torch.export.save`` program, AOTInductor package."""

DEFAULT_FILENAMES = ("model.pt", "model.pt2")
"""Looked up in this order when ``default_model_filename`` is unset (``model.pt`` is Triton's)."""

# Config data type -> torch dtype attribute name. Triton's PyTorch backend serves these (and strings
# as List[str]); torch has no unsigned types beyond uint8 that its operators support.
TORCH_DTYPE_BY_CONFIG: dict[int, str] = {
    mc.TYPE_BOOL: "bool",
    mc.TYPE_UINT8: "uint8",
    mc.TYPE_INT8: "int8",
    mc.TYPE_INT16: "int16",
    mc.TYPE_INT32: "int32",
    mc.TYPE_INT64: "int64",
    mc.TYPE_FP16: "float16",
    mc.TYPE_FP32: "float32",
    mc.TYPE_FP64: "float64",
    mc.TYPE_BF16: "bfloat16",
}
_FLOATING = frozenset({mc.TYPE_FP16, mc.TYPE_FP32, mc.TYPE_FP64, mc.TYPE_BF16})

PRECISIONS: dict[str, str | None] = {"": None, "fp32": None, "fp16": "float16", "bf16": "bfloat16"}
"""Sluice's ``precision`` parameter -> the dtype the model's floating tensors run in (None: as stored)."""
MEMORY_FORMATS = ("contiguous", "channels_last")

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def model_kind(member_names: Sequence[str], shown_name: str) -> str:
    """The kind of model in a zip archive, from its member names (``zipfile.ZipFile.namelist()``).

    An AOTInductor package holds ``<root>/data/aotinductor/...``; a ``torch.export`` program holds
    ``<root>/models/<name>.json`` and ``archive_format``; a TorchScript archive holds
    ``<root>/data.pkl`` and ``<root>/code/``."""
    tails = {name.split("/", 1)[1] if "/" in name else name for name in member_names}
    if any(tail.startswith("data/aotinductor/") for tail in tails):
        return AOTI
    if "archive_format" in tails and any(t.startswith("models/") and t.endswith(".json") for t in tails):
        return EXPORT
    if "data.pkl" in tails and any(t.startswith("code/") for t in tails):
        return TORCHSCRIPT
    raise ConfigError(
        f"'{shown_name}' is a zip archive but not a model torch can load; allowed: a TorchScript archive "
        "(torch.jit.save), a torch.export program (torch.export.save) or an AOTInductor package "
        "(torch._inductor.aoti_compile_and_package)",
        field="default_model_filename",
    )


def aoti_device(metadata: Sequence[str]) -> str | None:
    """The device an AOTInductor package was compiled for (``AOTI_DEVICE_KEY``: ``cpu``, ``cuda``, ...)
    from the texts of its ``*_metadata.json`` members; None when none says (an unreadable or older
    package: loading it tells). Members that disagree give the first that is not ``cpu``."""
    devices: list[str] = []
    for text in metadata:
        try:
            value = json.loads(text)
        except ValueError:
            continue
        device = value.get("AOTI_DEVICE_KEY") if isinstance(value, dict) else None
        if isinstance(device, str) and device:
            devices.append(device)
    return next((d for d in devices if d != "cpu"), devices[0] if devices else None)


def model_filename(default_model_filename: str, present: Sequence[str]) -> str:
    """The file to load: ``default_model_filename``, else the first of :data:`DEFAULT_FILENAMES` present."""
    if default_model_filename:
        return default_model_filename
    return next((name for name in DEFAULT_FILENAMES if name in present), DEFAULT_FILENAMES[0])


@dataclasses.dataclass(frozen=True)
class TorchSettings:
    """What the config's ``parameters`` ask of the PyTorch backend (Triton's names, upper case)."""

    disable_optimized_execution: bool = False
    """DISABLE_OPTIMIZED_EXECUTION: run TorchScript without the profiling executor's optimizations."""
    inference_mode: bool = True
    """INFERENCE_MODE: run under ``torch.inference_mode()`` (else ``torch.no_grad()``). Triton's
    current default is on."""
    disable_cudnn: bool = False
    """DISABLE_CUDNN: ``torch.backends.cudnn.enabled = False`` before each call of a GPU instance
    (``True`` otherwise), process-wide as in Triton."""
    enable_weight_sharing: bool = False
    """ENABLE_WEIGHT_SHARING: instances on the same device share one loaded module."""
    enable_cache_cleaning: bool = False
    """ENABLE_CACHE_CLEANING: ``torch.cuda.empty_cache()`` after every execution (GPU instances)."""
    enable_jit_executor: bool | None = None
    """ENABLE_JIT_EXECUTOR (None: torch's default)."""
    enable_jit_profiling: bool | None = None
    """ENABLE_JIT_PROFILING (None: torch's default)."""
    enable_tensor_fuser: bool | None = None
    """ENABLE_TENSOR_FUSER (None: torch's default)."""
    intra_op_thread_count: int | None = None
    """INTRA_OP_THREAD_COUNT: ``torch.set_num_threads`` (process-wide; the first model that sets it wins)."""
    inter_op_thread_count: int | None = None
    """INTER_OP_THREAD_COUNT: ``torch.set_num_interop_threads`` (process-wide, settable once)."""
    precision: str | None = None
    """Sluice ``precision`` (fp32, fp16, bf16): dtype the model's floating weights and inputs run in."""
    channels_last: bool = False
    """Sluice ``memory_format: channels_last``: 4-D floating inputs (and the module) in NHWC layout."""


_BOOL_PARAMETERS = {
    "DISABLE_OPTIMIZED_EXECUTION": "disable_optimized_execution",
    "INFERENCE_MODE": "inference_mode",
    "DISABLE_CUDNN": "disable_cudnn",
    "ENABLE_WEIGHT_SHARING": "enable_weight_sharing",
    "ENABLE_CACHE_CLEANING": "enable_cache_cleaning",
    "ENABLE_JIT_EXECUTOR": "enable_jit_executor",
    "ENABLE_JIT_PROFILING": "enable_jit_profiling",
    "ENABLE_TENSOR_FUSER": "enable_tensor_fuser",
}
_INT_PARAMETERS = {"INTRA_OP_THREAD_COUNT": "intra_op_thread_count", "INTER_OP_THREAD_COUNT": "inter_op_thread_count"}
IGNORED_PARAMETERS = {"ENABLE_NVFUSER": "NvFuser was removed from PyTorch; Triton ignores it too"}


def torch_settings(parameters: Mapping[str, str]) -> tuple[TorchSettings, list[str]]:
    """Settings from the config's parameters (key -> string_value); the warnings for ignored ones.

    Keys are Triton's (matched case-insensitively); keys the backend does not know are left to
    other parts of Sluice (``batch_policy``, ...)."""
    values: dict[str, Any] = {}
    warnings: list[str] = []
    for key, raw in parameters.items():
        upper, value = key.upper(), raw.strip().lower()
        field = f"parameters[{key}]"
        if upper in _BOOL_PARAMETERS:
            if value not in (*_TRUE, *_FALSE):
                raise ConfigError(f"must be 'true' or 'false', got {raw!r}", field=field)
            values[_BOOL_PARAMETERS[upper]] = value in _TRUE
        elif upper in _INT_PARAMETERS:
            if not (value.isascii() and value.isdigit()) or int(value) < 1:
                raise ConfigError(f"must be a positive integer string, got {raw!r}", field=field)
            values[_INT_PARAMETERS[upper]] = int(value)
        elif upper in IGNORED_PARAMETERS:
            warnings.append(f"{field}: ignored ({IGNORED_PARAMETERS[upper]})")
        elif key == "precision":
            if value not in PRECISIONS:
                allowed = ", ".join(p for p in PRECISIONS if p)
                raise ConfigError(f"must be one of {allowed}, got {raw!r}", field=field)
            values["precision"] = PRECISIONS[value]
        elif key == "memory_format":
            if value not in MEMORY_FORMATS:
                raise ConfigError(f"must be one of {', '.join(MEMORY_FORMATS)}, got {raw!r}", field=field)
            values["channels_last"] = value == "channels_last"
    return TorchSettings(**values), warnings


def check_kind_settings(settings: TorchSettings, kind: str) -> None:
    """Refuse parameters that ``kind`` of model file cannot honour: an AOTInductor package runs at
    the precision and with the input strides it was compiled for (its kernels do not check the
    strides they are given: a channels_last input to a package compiled from contiguous examples
    gives wrong results, not an error)."""
    if kind != AOTI:
        return
    if settings.precision is not None:
        raise ConfigError(
            "an AOTInductor package runs at the precision it was compiled with; allowed: no precision "
            "parameter (compile the package in fp16/bf16 instead)",
            field="parameters[precision]",
        )
    if settings.channels_last:
        raise ConfigError(
            "an AOTInductor package's kernels assume the input strides it was compiled with, so channels_last "
            "inputs would be read with the wrong layout; allowed: no memory_format parameter, or contiguous "
            "(compile the package from contiguous example inputs: Inductor chooses the layouts inside it)",
            field="parameters[memory_format]",
        )


_FLOATING_TORCH = frozenset({"float16", "float32", "float64", "bfloat16"})
_PRECISION_SPELLINGS = {"float16": ("Half", "float16"), "bfloat16": ("BFloat16", "bfloat16")}
"""How torch's error texts name each precision's dtype (``c10::Half``, ``torch.cuda.HalfTensor``,
``CPUBFloat16Type``, ``torch.bfloat16``, ``expected scalar type BFloat16``)."""


def casts_to_precision(dtype: str, precision: str | None) -> bool:
    """Whether a tensor of torch dtype ``dtype`` (``float32``, ...) the model holds is cast to the
    ``precision`` parameter's dtype: floating tensors (as ``Module.to(dtype)`` casts parameters and
    buffers), not already in it; integer and boolean tensors (indices, masks) keep their type."""
    return precision is not None and dtype in _FLOATING_TORCH and dtype != precision


def precision_problem(text: str, precision: str) -> str | None:
    """The load error when the check call at load (zeros of the config's shapes, in ``precision``)
    failed with ``text`` because the model does not run in ``precision``: a tensor it keeps or makes
    in another floating type meets the cast ones (torch names the two dtypes and a type mismatch).
    None when ``text`` is another failure, which the check cannot judge (the load goes on)."""
    spellings = _PRECISION_SPELLINGS.get(precision, (precision,))
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    named = [line for line in lines if "type" in line.lower() and any(s in line for s in spellings)]
    if not named:
        return None
    shown = "bf16" if precision == "bfloat16" else "fp16" if precision == "float16" else precision
    return (
        f"the model does not run in {shown}: a check call at load failed with '{named[-1].removeprefix('builtins.')}'; "
        "precision casts the module's floating parameters, buffers and tensor attributes (and a torch.export "
        "program's constants), but a tensor the model makes in forward() or a constant a trace recorded keeps its "
        "dtype; allowed: fp32 (or no precision parameter), or a model that makes such tensors in its input's dtype"
    )


_CONTROL_FIELDS = {"int32_false_true": mc.TYPE_INT32, "fp32_false_true": mc.TYPE_FP32, "bool_false_true": mc.TYPE_BOOL}


def model_dims(tensor: mc.ModelInput | mc.ModelOutput) -> list[int]:
    """The shape the model sees for a tensor, without the batch dimension: ``reshape.shape`` when the
    config reshapes it, else ``dims``. Graphs are captured, and batches matched, on these."""
    return list(tensor.reshape.shape) if tensor.HasField("reshape") else list(tensor.dims)


def sequence_io(config: mc.ModelConfig) -> tuple[list[tuple[str, mc.ModelInput]], list[mc.ModelOutput]]:
    """What sequence batching adds to the model's call, as Triton's PyTorch backend passes it: each
    control input (dims [1]) and each implicit state's ``input_name`` as inputs, with the config
    field they come from; each state's ``output_name`` not listed in ``output`` as an output."""
    batching = config.sequence_batching
    inputs: list[tuple[str, mc.ModelInput]] = []
    for index, control_input in enumerate(batching.control_input):
        control = control_input.control[0]
        data_type = control.data_type
        if control.kind != mc.ModelSequenceBatching.Control.CONTROL_SEQUENCE_CORRID:
            data_type = next((t for f, t in _CONTROL_FIELDS.items() if len(getattr(control, f))), mc.TYPE_INT32)
        tensor = mc.ModelInput(name=control_input.name, data_type=data_type, dims=[1])
        inputs.append((f"sequence_batching.control_input[{index}]", tensor))
    listed = {o.name for o in config.output}
    outputs = []
    for index, state in enumerate(batching.state):
        tensor = mc.ModelInput(name=state.input_name, data_type=state.data_type, dims=list(state.dims))
        inputs.append((f"sequence_batching.state[{index}]", tensor))
        if state.output_name not in listed:
            outputs.append(mc.ModelOutput(name=state.output_name, data_type=state.data_type, dims=list(state.dims)))
    return inputs, outputs


def check_io(config: mc.ModelConfig, kind: str) -> None:
    """Refuse data types and string shapes the backend cannot serve (Triton's rules)."""
    if not config.input:
        raise ConfigError(
            "the PyTorch backend needs the inputs listed in the config (TorchScript declares no shapes); "
            "allowed: input [ { name, data_type, dims } ... ]",
            field="input",
        )
    if not config.output:
        raise ConfigError(
            "the PyTorch backend needs the outputs listed in the config; allowed: output [ { name, data_type, dims } ]",
            field="output",
        )
    allowed = ", ".join(mc.DataType.Name(t) for t in (*TORCH_DTYPE_BY_CONFIG, mc.TYPE_STRING))
    batching = 1 if config.max_batch_size > 0 else 0
    for section, tensors in (("input", config.input), ("output", config.output)):
        for index, tensor in enumerate(tensors):
            where = f"{section}[{index}]"
            if section == "input" and tensor.optional:  # type: ignore[union-attr]
                raise ConfigError(
                    f"input '{tensor.name}' is optional, but a PyTorch model takes every argument on each call; "
                    "allowed: optional: false",
                    field=f"{where}.optional",
                )
            if tensor.data_type == mc.TYPE_STRING:
                if kind != TORCHSCRIPT:
                    raise ConfigError(
                        f"{section} '{tensor.name}' is TYPE_STRING, which only TorchScript models (List[str]) take; "
                        f"allowed for {kind} models: {allowed.replace(', TYPE_STRING', '')}",
                        field=f"{where}.data_type",
                    )
                dims = model_dims(tensor)
                if len(dims) + batching > 1:
                    raise ConfigError(
                        f"{section} '{tensor.name}' is TYPE_STRING with {len(dims) + batching} dimensions "
                        f"(dims {dims}{' plus the batch dim' if batching else ''}); the model takes a List[str], so "
                        "allowed: one dimension in all (with max_batch_size > 0: dims [1] and reshape { shape: [] })",
                        field=f"{where}.dims",
                    )
            elif tensor.data_type not in TORCH_DTYPE_BY_CONFIG:
                raise ConfigError(
                    f"{section} '{tensor.name}' has data_type {mc.DataType.Name(tensor.data_type)}, which the "
                    f"PyTorch backend cannot serve; allowed: {allowed}",
                    field=f"{where}.data_type",
                )
    for where, tensor in sequence_io(config)[0]:
        if tensor.data_type not in TORCH_DTYPE_BY_CONFIG and tensor.data_type != mc.TYPE_STRING:
            raise ConfigError(
                f"sequence input '{tensor.name}' has data_type {mc.DataType.Name(tensor.data_type)}, which the "
                f"PyTorch backend cannot pass to a model; allowed: {allowed}",
                field=f"{where}.data_type",
            )
        if named_index(tensor.name) is None:
            raise ConfigError(
                f"sequence input '{tensor.name}' does not follow the <name>__<index> convention; the PyTorch backend "
                "passes control and state inputs by index, as Triton does; allowed: a name like "
                f"'{tensor.name}__<index of its forward() argument>'",
                field=f"{where}.{'input_name' if '.state[' in where else 'name'}",
            )


# --- naming conventions --------------------------------------------------------------------------

FORWARD_ARGUMENT, NAMED_INDEX, CONFIG_ORDER, DICT_INPUT = "forward_argument", "named_index", "config_order", "dict"


@dataclasses.dataclass(frozen=True)
class Binding:
    """How config tensors map to the model's arguments or results.

    ``convention`` is one of FORWARD_ARGUMENT, NAMED_INDEX, CONFIG_ORDER, DICT_INPUT; ``index`` gives each
    config name its position (for DICT_INPUT the names are the dict's keys)."""

    convention: str
    index: dict[str, int]
    warning: str = ""

    @property
    def arity(self) -> int:
        return max(self.index.values(), default=-1) + 1


def named_index(name: str) -> int | None:
    """The index of a ``<name>__<index>`` name, as Triton reads it: the text after the first ``__``,
    all digits (``INPUT__0`` -> 0; ``a__b__1`` follows no convention); None otherwise."""
    _, delimiter, suffix = name.partition("__")
    return int(suffix) if delimiter and suffix.isascii() and suffix.isdigit() else None


def _named_indices(names: Sequence[str]) -> dict[str, int] | None:
    found = {name: named_index(name) for name in names}
    if not names or any(index is None for index in found.values()):
        return None
    return {name: index for name, index in found.items() if index is not None}


def input_binding(
    names: Sequence[str],
    forward_args: Sequence[str] | None,
    *,
    dict_input: bool = False,
    sequence_names: Sequence[str] = (),
) -> Binding:
    """Triton's rules for input names: all of them forward() argument names; else all ``<name>__<index>``;
    else the config's order (with a warning). ``forward_args`` excludes ``self``; None where the model
    does not declare its arguments (AOTInductor: index or order only). ``dict_input``: forward() takes
    one ``Dict[str, Tensor]``, keyed by the config's names. ``sequence_names``: the control and state
    inputs sequence batching adds (:func:`sequence_io`), always bound by their ``__<index>``."""
    if dict_input:
        return Binding(DICT_INPUT, {name: i for i, name in enumerate([*names, *sequence_names])})
    total = len(names) + len(sequence_names)
    if forward_args is not None and len(forward_args) != total:
        added = f" and {len(sequence_names)} sequence control/state inputs" if sequence_names else ""
        raise ConfigError(
            f"the config lists {len(names)} inputs{added} but the model's forward() takes {len(forward_args)} "
            f"({', '.join(forward_args) or 'none'}); allowed: one config input per forward() argument",
            field="input",
        )
    limit = len(forward_args) if forward_args is not None else total
    extra = {name: index for name in sequence_names if (index := named_index(name)) is not None}
    if forward_args is not None and set(names) <= set(forward_args):
        binding = Binding(FORWARD_ARGUMENT, {name: list(forward_args).index(name) for name in names})
    elif (indexed := _named_indices(names)) is not None:
        _check_indices(indexed, "input", limit)
        binding = Binding(NAMED_INDEX, indexed)
    else:
        shown = f" nor forward() arguments ({', '.join(forward_args)})" if forward_args is not None else ""
        binding = Binding(
            CONFIG_ORDER,
            {name: i for i, name in enumerate(names)},
            f"input names ({', '.join(names)}) follow neither the <name>__<index> convention{shown}; "
            "they are passed in the config's order",
        )
    taken = {index: name for name, index in binding.index.items()}
    for name, index in extra.items():
        if index >= limit or index in taken:
            why = f"the model takes {limit} inputs" if index >= limit else f"'{taken[index]}' has it"
            raise ConfigError(
                f"sequence input '{name}' names index {index} but {why}; allowed: a free index from 0 to {limit - 1}",
                field="sequence_batching",
            )
        taken[index] = name
    return dataclasses.replace(binding, index={**binding.index, **extra})


def output_binding(names: Sequence[str]) -> Binding:
    """Outputs: all ``<name>__<index>``, else the config's order. (A dict result is matched by name.)"""
    indexed = _named_indices(names)
    if indexed is not None:
        _check_indices(indexed, "output", None)
        return Binding(NAMED_INDEX, indexed)
    return Binding(CONFIG_ORDER, {name: i for i, name in enumerate(names)})


def _check_indices(indexed: dict[str, int], section: str, limit: int | None) -> None:
    seen: dict[int, str] = {}
    for position, (name, index) in enumerate(indexed.items()):
        if index in seen:
            raise ConfigError(
                f"{section} '{name}' has index {index}, like '{seen[index]}'; allowed: each <name>__<index> once",
                field=f"{section}[{position}].name",
            )
        if limit is not None and index >= limit:
            raise ConfigError(
                f"{section} '{name}' names index {index} but the model takes {limit} inputs; "
                f"allowed: indices 0 to {limit - 1}",
                field=f"{section}[{position}].name",
            )
        seen[index] = name


def pick_outputs(result: Sequence[Any] | Mapping[str, Any], binding: Binding, label: str) -> list[Any]:
    """The model's results in config output order: a sequence by index, a dict by name."""
    names = list(binding.index)  # the config's order
    if isinstance(result, Mapping):
        missing = [name for name in names if name not in result]
        if missing:
            raise ModelError(
                f"model '{label}' returned a dict without {', '.join(repr(m) for m in missing)} "
                f"(its keys: {', '.join(map(repr, result))}); a dict result is matched to the config's outputs by name"
            )
        return [result[name] for name in names]
    picked = []
    for name in names:
        index = binding.index[name]
        if index >= len(result):
            raise ModelError(
                f"model '{label}': output '{name}' refers to output index {index}, but the model returned "
                f"{len(result)} output{'s' if len(result) != 1 else ''}"
            )
        picked.append(result[index])
    return picked


def output_shape_problem(
    name: str, shape: Sequence[int], dims: Sequence[int], *, batched: bool, rows: int
) -> str | None:
    """Why a result of ``shape`` cannot be served as output ``name`` with the config's ``dims`` (the
    reshape shape when set), or None. ``rows``: the batch's total rows (batched models)."""
    expected = [rows, *dims] if batched else list(dims)
    if not batched and not dims and list(shape) in ([], [1]):
        return None
    fits = len(shape) == len(expected) and all(e == -1 or e == s for e, s in zip(expected, shape, strict=True))
    if fits:
        return None
    return (
        f"output '{name}' has shape {list(shape)} but the config expects {expected}"
        f"{' (the batch rows first)' if batched else ''}"
    )


STRING_LIST = "List[str]"
"""What :func:`output_dtype_problem` is told a model returned as a ``List[str]`` (not a tensor)."""
_CONFIG_TYPE_BY_TORCH = {name: config_type for config_type, name in TORCH_DTYPE_BY_CONFIG.items()}


def output_dtype_problem(name: str, produced: str, config_type: int, precision: str | None) -> str | None:
    """Why a result of torch dtype ``produced`` (``float32``..., or :data:`STRING_LIST`) cannot be
    served as output ``name`` of ``config_type``, or None. Triton refuses any mismatch rather than
    convert; the one conversion Sluice makes is back from its own ``precision`` (a floating result
    in the run precision, cast to the config's floating type)."""
    if produced == STRING_LIST:
        provided = "TYPE_STRING (a List[str])"
        if config_type == mc.TYPE_STRING:
            return None
    else:
        if TORCH_DTYPE_BY_CONFIG.get(config_type) == produced:
            return None
        if precision is not None and produced == precision and config_type in _FLOATING:
            return None
        known = _CONFIG_TYPE_BY_TORCH.get(produced)
        provided = mc.DataType.Name(known) if known is not None else f"torch.{produced}"
    return (
        f"configuration expects datatype {mc.DataType.Name(config_type)} for output '{name}', model provides {provided}"
    )


# --- CUDA path decisions -------------------------------------------------------------------------


def run_dtype(config_type: int, precision: str | None) -> str | None:
    """The torch dtype name an input of ``config_type`` is fed to the model in; None: TYPE_STRING.

    With a ``precision`` (fp16/bf16), floating inputs are cast to it; other types are fed as declared."""
    if config_type == mc.TYPE_STRING:
        return None
    declared = TORCH_DTYPE_BY_CONFIG[config_type]
    if precision is not None and config_type in _FLOATING:
        return precision
    return declared


def channels_last_inputs(config: mc.ModelConfig) -> list[str]:
    """Inputs fed in channels_last layout: floating inputs of rank 4 with the batch dim (NCHW)."""
    batching = 1 if config.max_batch_size > 0 else 0
    chosen = []
    for tensor in config.input:
        dims = model_dims(tensor)
        if tensor.data_type in _FLOATING and len(dims) + batching == 4:
            chosen.append(tensor.name)
    return chosen


PINNED_ALIGNMENT = 1 << 16


def pinned_capacity(needed: int, current: int) -> int:
    """Bytes of the pinned host buffer an input needs: the current one when it is large enough, else
    grown to at least twice the current size (fewer re-allocations), rounded to 64 KiB."""
    if needed <= current:
        return current
    target = max(needed, 2 * current)
    return -(-target // PINNED_ALIGNMENT) * PINNED_ALIGNMENT


def example_shape(dims: Sequence[int], batch: int | None) -> list[int]:
    """A concrete input shape for warm-up and graph capture: -1 dims become 1."""
    concrete = [d if d > 0 else 1 for d in dims]
    return [batch, *concrete] if batch is not None else concrete


def graphs_requested(config: mc.ModelConfig) -> bool:
    return config.optimization.cuda.graphs


def cpu_graph_warning(config: mc.ModelConfig, kinds: Sequence[int]) -> str | None:
    """The load warning for CUDA graphs asked for on instances that run on the CPU."""
    if graphs_requested(config) and any(kind != mc.ModelInstanceGroup.KIND_GPU for kind in kinds):
        return (
            "optimization.cuda.graphs is set but some instances run on the CPU; "
            "those run eagerly (CUDA graphs need KIND_GPU instances on a GPU)"
        )
    return None


_OUT_OF_MEMORY_TEXTS = ("CUDA out of memory", "CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED")


def is_out_of_memory(exc: BaseException) -> bool:
    """torch.cuda.OutOfMemoryError, or a RuntimeError with one of CUDA's out-of-memory texts: the caching
    allocator's, the runtime's (``cudaErrorMemoryAllocation``) or cuBLAS's workspace allocation (also
    what a TorchScript model's interpreter raises, wrapped in its own first line)."""
    text = str(exc)
    return type(exc).__name__ == "OutOfMemoryError" or any(t in text for t in _OUT_OF_MEMORY_TEXTS)


_STICKY_ERRORS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    # (runtime API name, driver API name, cudaGetErrorString / cuGetErrorString texts)
    ("cudaErrorIllegalAddress", "CUDA_ERROR_ILLEGAL_ADDRESS", ("an illegal memory access was encountered",)),  # 700
    ("cudaErrorLaunchTimeout", "CUDA_ERROR_LAUNCH_TIMEOUT", ("the launch timed out and was terminated",)),  # 702
    ("cudaErrorAssert", "CUDA_ERROR_ASSERT", ("device-side assert triggered",)),  # 710
    ("cudaErrorHardwareStackError", "CUDA_ERROR_HARDWARE_STACK_ERROR", ("hardware stack error",)),  # 714
    (
        "cudaErrorIllegalInstruction",
        "CUDA_ERROR_ILLEGAL_INSTRUCTION",
        ("an illegal instruction was encountered",),
    ),  # 715
    ("cudaErrorMisalignedAddress", "CUDA_ERROR_MISALIGNED_ADDRESS", ("misaligned address",)),  # 716
    (
        "cudaErrorInvalidAddressSpace",
        "CUDA_ERROR_INVALID_ADDRESS_SPACE",
        ("operation not supported on global/shared address space",),
    ),  # 717
    ("cudaErrorInvalidPc", "CUDA_ERROR_INVALID_PC", ("invalid program counter",)),  # 718
    ("cudaErrorLaunchFailure", "CUDA_ERROR_LAUNCH_FAILED", ("unspecified launch failure",)),  # 719
    (
        "cudaErrorExternalDevice",
        "CUDA_ERROR_EXTERNAL_DEVICE",
        (  # CUDA's own spelling, and the corrected one should a release fix it
            "an async error has occured in external entity outside of CUDA",
            "an async error has occurred in external entity outside of CUDA",
        ),
    ),  # 911
    # 214: the runtime API reference does not call it sticky, but NVIDIA's GPU memory error management
    # guide has the application that met an uncorrectable error restart
    ("cudaErrorECCUncorrectable", "CUDA_ERROR_ECC_UNCORRECTABLE", ("uncorrectable ECC error",)),
)
"""CUDA errors after which the CUDA context of the process is unusable (sticky errors): CUDA returns
the same error to every later call, so no retry or reload inside the process can serve again. The
runtime API reference says so of 700, 702, 710, 714-719 (but not 701 "too many resources requested
for launch" nor 720 "too many blocks in cooperative launch", launch errors that leave the context
usable) and 911. Each is matched by either name, or by its text where the exception also says
"CUDA" (torch's ``CUDA error: <text>``, Triton kernels' ``Triton Error [CUDA]: <text>``)."""

_CONTEXT_LOST_NAMES = tuple(name for runtime, driver, _ in _STICKY_ERRORS for name in (runtime, driver))
_CONTEXT_LOST_TEXTS = tuple(text for _, _, texts in _STICKY_ERRORS for text in texts)
_CONTEXT_LOST_NAME = re.compile(r"(?<![A-Za-z0-9_])(?:" + "|".join(_CONTEXT_LOST_NAMES) + r")(?![A-Za-z0-9_])")


def is_device_lost(exc: BaseException) -> bool:
    """Whether ``exc`` reports one of the sticky CUDA errors (:data:`_STICKY_ERRORS`)."""
    text = str(exc)
    if _CONTEXT_LOST_NAME.search(text):
        return True
    return "CUDA" in text and any(t in text for t in _CONTEXT_LOST_TEXTS)


def _line_with(exc: BaseException, texts: Sequence[str]) -> str:
    """The line of ``exc``'s text that names the error: the last one with one of ``texts`` (TorchScript
    puts its own line first, then the script's source, then the exception it raised)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if any(t in line for t in texts):
            return line.removeprefix("builtins.").removeprefix("torch.OutOfMemoryError: ")
    return lines[0] if lines else type(exc).__name__


def first_line(exc: BaseException) -> str:
    """The first line of torch's text for a file it cannot read: with TORCH_SHOW_CPP_STACKTRACES the
    rest is a C++ backtrace naming the server's library paths, which clients must not see."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def failure(exc: BaseException, label: str, device: str, rows: int) -> SluiceError:
    """The error a batch is answered with when the model raised ``exc``."""
    if isinstance(exc, SluiceError):
        return exc
    if is_out_of_memory(exc):
        first = _line_with(exc, _OUT_OF_MEMORY_TEXTS)
        return Unavailable(
            f"model '{label}' ran out of GPU memory on {device} for a batch of {rows} rows: {first}; "
            "the CUDA cache was emptied and the instance goes on serving (retry, or lower max_batch_size)"
        )
    if is_device_lost(exc):
        line = _line_with(exc, (*_CONTEXT_LOST_TEXTS, *_CONTEXT_LOST_NAMES))
        return DeviceLost(
            f"model '{label}' hit an unrecoverable CUDA error on {device} for a batch of {rows} rows: "
            f"{line}; this process's CUDA context is lost, so the server now reports not live and not ready "
            "to be restarted"
        )
    text = str(exc).strip()
    what = f"{type(exc).__name__}: {text}"
    # TorchScript errors carry the script's traceback (with the paths of the file it was scripted
    # from); the last line is the exception the script raised, as "builtins.RuntimeError: text".
    if "Traceback of TorchScript" in text:
        what = text.splitlines()[-1].strip().removeprefix("builtins.")
    return ModelError(f"PyTorch failed to run model '{label}': {what}")
