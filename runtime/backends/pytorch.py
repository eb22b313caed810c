"""PyTorch backend (``backend: "pytorch"`` / ``platform: "pytorch_libtorch"``): one module per instance.

Loads, by what the file holds (:func:`torch_plan.model_kind`), a TorchScript archive (Triton's
``model.pt``, ``torch.jit.load``), or, as a Sluice extension, a ``torch.export`` program
(``torch.export.load``) or an AOTInductor package (``torch._inductor.aoti_load_package``), usually
``model.pt2``. Inputs bind by forward() argument name, ``<name>__<index>`` or the config's order;
outputs by ``<name>__<index>`` or order (a dict result by name), as in Triton's PyTorch backend.

Instances of kind KIND_GPU run on ``cuda:<device_id>`` with a CUDA stream of their own (made through
``runtime/cudart.py``: torch's pool of 32 per device would give two instances one stream, past 32,
and a CUDA graph captured on it would record the other's work); inputs go host -> device through
pinned host buffers kept per instance (:class:`_CudaStaging`), outputs come back the same way, and
CUDA graphs (``optimization { cuda { graphs: true } }``) come from ``torch_graphs``, imported only
on that path. Every decision sits in ``torch_plan`` (pure); this
module is the thin layer around torch, imported lazily by the repository.

Who calls it: the repository (``probe``, ``check_config``, ``load``, ``cuda_device_count``), then the
scheduler's worker threads (``TorchInstance.execute``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from sluice.runtime import cudart
from sluice.runtime.backends import torch_plan
from sluice.runtime.backends.base import (
    LoadContext,
    ModelBackend,
    ModelInstance,
    Result,
    TensorSpec,
    client_shape,
    reshape_problem,
)
from sluice.runtime.backends.tensor import input_parts, merge_inputs, merged_shape, split_timed
from sluice.runtime.errors import ConfigError, ModelError, SluiceError, Unavailable, Unsupported
from sluice.runtime.types import DATATYPE_BY_CONFIG_TYPE, InferRequest

log = logging.getLogger("sluice.runtime.backends.pytorch")

_KIND_GPU = mc.ModelInstanceGroup.KIND_GPU

_CUDA_ALLOCATOR = threading.Lock()
"""Held while an instance captures CUDA graphs and around ``torch.cuda.empty_cache``: a capture
empties the cache itself and routes allocations into its pool, so two captures at once (two graphed
models loading together) or an emptying during one (another instance's out-of-memory answer, whose
``cudaFree`` synchronizes the device) would meet inside PyTorch's allocator. Serving (replays, eager
calls) never takes it, so nothing outside it may synchronize the whole device (``torch.cuda.synchronize``)
either: CUDA refuses that while any stream of the device captures, and the capture fails with it. The
backend synchronizes single streams only (the loading thread's, an instance's)."""

_EXPORT_LOAD = threading.Lock()
"""Held around ``torch.export.load``: its deserializer is a global of torch's (``_CURRENT_DESERIALIZER``),
so two programs loading at once (models load in parallel) fail one of them ("already set")."""

_CUDART = cudart.Loader()
"""Where instances get their own CUDA streams (``cudaStreamCreateWithFlags``, non-blocking)."""


def _emptying(torch: Any) -> Callable[[], None]:
    def empty_cache() -> None:
        with _CUDA_ALLOCATOR:
            torch.cuda.empty_cache()

    return empty_cache


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise Unavailable(
            "the PyTorch backend needs torch, which is not installed; install the 'torch' extra "
            "(pip install 'sluice[torch]')"
        ) from None
    return torch


def cuda_device_count() -> int | None:
    """torch's count of visible GPUs; None when torch is missing or has no usable CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.device_count())


def model_path(config: mc.ModelConfig, ctx: LoadContext) -> Path:
    present = [p.name for p in ctx.version_dir.iterdir()] if ctx.version_dir.is_dir() else []
    path = ctx.version_dir / torch_plan.model_filename(config.default_model_filename, present)
    if not path.is_file():
        raise ConfigError(
            f"model file not found: {path} (allowed: {' or '.join(torch_plan.DEFAULT_FILENAMES)}, "
            "or set default_model_filename)",
            file=str(path),
            field="default_model_filename",
        )
    return path


def kind_of(path: Path) -> str:
    """TORCHSCRIPT, EXPORT or AOTI for the file at ``path``; ConfigError for anything else."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError):
        raise ConfigError(
            f"'{path.name}' is not a model torch can load (not a zip archive); allowed: a TorchScript archive "
            "(torch.jit.save), a torch.export program (torch.export.save) or an AOTInductor package",
            file=str(path),
            field="default_model_filename",
        ) from None
    try:
        return torch_plan.model_kind(names, path.name)
    except ConfigError as exc:
        raise ConfigError(exc.detail, file=str(path), field=exc.field) from None


_DATATYPE_BY_TORCH = {
    name: DATATYPE_BY_CONFIG_TYPE[mc.DataType.Name(t)] for t, name in torch_plan.TORCH_DTYPE_BY_CONFIG.items()
}


def package_device(path: Path) -> str | None:
    """The device an AOTInductor package at ``path`` was compiled for (its metadata); None when it
    does not say or cannot be read (loading it then tells)."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith("_metadata.json") and "/data/aotinductor/" in f"/{n}"]
            model = [n for n in names if "/data/aotinductor/model/" in f"/{n}"]  # what aoti_load_package loads
            texts = [archive.read(name).decode("utf-8", "replace") for name in model or names]
    except Exception:  # unreadable in any way (bad zip, compression, encryption): the load says so
        return None
    return torch_plan.aoti_device(texts)


def why_no_gpu(config: mc.ModelConfig, ctx: LoadContext) -> str | None:
    """Why instance_group kind KIND_AUTO cannot place this model on a visible GPU: a torch without
    CUDA, or an AOTInductor package compiled for the CPU; None when it can (or when the load will say
    what is wrong anyway: no torch, no model file)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        why = "has no CUDA build" if torch.version.cuda is None else "sees no GPU"
        return f"this torch {torch.__version__} {why}"
    try:
        path = model_path(config, ctx)
        kind = kind_of(path)
    except ConfigError:
        return None
    if kind == torch_plan.AOTI:
        device = package_device(path)
        if device is not None and device != "cuda":
            return (
                f"the AOTInductor package '{path.name}' was compiled for {device} "
                "(compile it for cuda to run it on a GPU)"
            )
    return None


def probe_export(path: Path) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Inputs and outputs a ``torch.export`` program declares (for completing the config): inputs
    named after forward()'s arguments, outputs ``OUTPUT__<index>``; symbolic dims are -1."""
    torch = _torch()
    with _EXPORT_LOAD:
        program = torch.export.load(str(path))
    placeholders = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}

    def spec(name: str, value: Any) -> TensorSpec:
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"the exported program's '{name}' is not a tensor ({type(value).__name__})")
        datatype = _DATATYPE_BY_TORCH.get(str(value.dtype).removeprefix("torch."), str(value.dtype))
        shape = tuple(d if isinstance(d, int) else -1 for d in value.shape)
        return TensorSpec(name, datatype, shape)

    args = program.module_call_graph[0].signature.forward_arg_names or list(program.graph_signature.user_inputs)
    users = list(program.graph_signature.user_inputs)
    inputs = [spec(arg, placeholders[node].meta.get("val")) for arg, node in zip(args, users, strict=False)]
    output_node = next(node for node in program.graph.nodes if node.op == "output")
    results = output_node.args[0]
    values = [r.meta.get("val") for r in (results if isinstance(results, list | tuple) else [results])]
    user_outputs = len(program.graph_signature.user_outputs)
    outputs = [spec(f"OUTPUT__{i}", value) for i, value in enumerate(values[-user_outputs:])]
    return inputs, outputs


def probe(config: mc.ModelConfig, ctx: LoadContext) -> tuple[list[TensorSpec], list[TensorSpec]] | None:
    """What to complete the config from (Triton's auto-complete): a ``torch.export`` program's
    signature when the config lacks inputs or outputs; None otherwise. Triton does not complete
    TorchScript configs (forward() declares no shapes), so those must list their inputs and outputs."""
    path = model_path(config, ctx)
    if (config.input and config.output) or kind_of(path) != torch_plan.EXPORT:
        return None
    try:
        return probe_export(path)
    except ConfigError as exc:
        raise ConfigError(exc.detail, file=str(path), field=exc.field) from None


def check_config(config: mc.ModelConfig, ctx: LoadContext, *, source: str) -> list[str]:
    """After validation: the parameters and IO types this backend accepts; return load warnings."""
    kind = kind_of(model_path(config, ctx))
    try:
        settings, warnings = torch_plan.torch_settings(_parameters(config))
        torch_plan.check_io(config, kind)
        torch_plan.check_kind_settings(settings, kind)
    except ConfigError as exc:
        raise ConfigError(exc.detail, file=exc.file or source, field=exc.field) from None
    return warnings


def _parameters(config: mc.ModelConfig) -> dict[str, str]:
    return {key: value.string_value for key, value in config.parameters.items()}


# --- loading -------------------------------------------------------------------------------------


class _Loaded:
    """A module ready to call on one device, and what the naming conventions need of it."""

    def __init__(self, module: Callable[..., Any], forward_args: list[str] | None, dict_input: bool) -> None:
        self.module = module
        self.forward_args = forward_args
        self.dict_input = dict_input


def _load_torchscript(torch: Any, path: Path, device: Any, settings: torch_plan.TorchSettings) -> _Loaded:
    try:
        module = torch.jit.load(str(path), map_location=device)
    except Exception as exc:
        raise ConfigError(
            f"torch.jit.load cannot load the model: {torch_plan.first_line(exc)}", file=str(path)
        ) from exc
    module.eval()
    if settings.precision is not None:
        module.to(getattr(torch, settings.precision))
        _cast_script_attributes(torch, module, settings.precision)
    if settings.channels_last:
        module.to(memory_format=torch.channels_last)
    arguments = list(module.forward.schema.arguments)
    if arguments and arguments[0].name == "self":
        arguments = arguments[1:]
    kinds = [str(a.type.kind()) for a in arguments]
    if len(arguments) == 1 and kinds[0] == "DictType":
        return _Loaded(module, None, dict_input=True)
    for argument, kind in zip(arguments, kinds, strict=True):
        if kind not in ("TensorType", "ListType"):
            raise ConfigError(
                f"forward() argument '{argument.name}' has type {argument.type}; allowed: Tensor, List[str], or one "
                "Dict[str, Tensor] argument",
                file=str(path),
            )
    return _Loaded(module, [a.name for a in arguments], dict_input=False)


def _cast_script_attributes(torch: Any, module: Any, precision: str) -> None:
    """Cast the floating tensors a TorchScript module keeps as plain attributes (``self.w =
    torch.randn(...)`` in ``__init__``) to ``precision``: ``Module.to(dtype)`` casts parameters and
    buffers only. torch lists a script module's attributes only through a debugging call; without it
    the check call at load tells whether the model runs anyway. A traced constant (``CONSTANTS.c0``)
    is part of the code, not an attribute, and stays as it is."""
    attributes = getattr(torch._C, "_jit_debug_module_iterators", None)
    if attributes is None:
        return
    dtype = getattr(torch, precision)
    for submodule in module.modules():
        script = getattr(submodule, "_c", None)
        if script is None:
            continue
        for name, value in attributes(script)["named_attributes"]:
            if isinstance(value, torch.Tensor) and torch_plan.casts_to_precision(_dtype_name(value), precision):
                script.setattr(name, value.to(dtype))


def _dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _load_export(torch: Any, path: Path, device: Any, settings: torch_plan.TorchSettings) -> _Loaded:
    try:
        with _EXPORT_LOAD:
            program = torch.export.load(str(path))
    except Exception as exc:
        raise ConfigError(
            f"torch.export.load cannot load the program: {torch_plan.first_line(exc)}", file=str(path)
        ) from exc
    from torch.export.passes import move_to_device_pass

    try:
        # constants the trace recorded with a device (torch.arange, torch.zeros, ... made on the
        # machine that exported) move with the weights; Module.to moves only the weights
        program = move_to_device_pass(program, device)
    except Exception as exc:
        raise ConfigError(
            f"cannot move the exported program to {device}: {torch_plan.first_line(exc)}", file=str(path)
        ) from exc
    precision = settings.precision
    if precision is not None:
        # tensors the program holds outside its parameters and buffers (a plain tensor attribute of
        # the exported module, lifted as a constant) are attributes of .module(), which Module.to
        # leaves alone; cast them here, as the weights are below
        constants = program.constants
        for name, value in list(constants.items()):
            if isinstance(value, torch.Tensor) and torch_plan.casts_to_precision(_dtype_name(value), precision):
                constants[name] = value.to(getattr(torch, precision))
    module = program.module().to(device)
    if precision is not None:
        module.to(getattr(torch, precision))
    args = list(program.module_call_graph[0].signature.forward_arg_names or program.graph_signature.user_inputs)
    return _Loaded(module, args, dict_input=False)


def _load_aoti(torch: Any, path: Path, device: Any, device_id: int) -> _Loaded:
    from torch._inductor import aoti_load_package

    compiled_for = package_device(path)
    if compiled_for is not None and compiled_for != device.type:  # refused before torch's own, terser error
        raise _wrong_device(torch, compiled_for, device, path)
    try:
        compiled = aoti_load_package(str(path), device_index=device_id if device.type == "cuda" else -1)
    except Exception as exc:
        raise ConfigError(
            f"aoti_load_package cannot load the package: {torch_plan.first_line(exc)}", file=str(path)
        ) from exc
    built_for = str(compiled.get_metadata().get("AOTI_DEVICE_KEY", "cpu"))
    if built_for != device.type:
        raise _wrong_device(torch, built_for, device, path)
    return _Loaded(compiled, None, dict_input=False)


def _wrong_device(torch: Any, built_for: str, device: Any, path: Path) -> ConfigError:
    # KIND_AUTO helps where it would pick the package's device: the CPU always, a GPU only with CUDA
    auto = built_for == "cpu" or (built_for == "cuda" and torch.cuda.is_available())
    return ConfigError(
        f"the AOTInductor package was compiled for {built_for} but the instance runs on {device.type}; "
        f"allowed: instance_group kind {'KIND_GPU' if built_for == 'cuda' else 'KIND_CPU'} for this package"
        + (" (or KIND_AUTO)" if auto else "")
        + ", or a package compiled for the instance's device",
        file=str(path),
        field="instance_group",
    )


# --- CUDA staging --------------------------------------------------------------------------------

_READ_ONLY_WARNED = threading.Lock()
_read_only_warned = False


def _quiet_read_only_warning(torch: Any) -> None:
    """Request tensors decoded from the wire are read-only numpy arrays; torch.from_numpy warns once
    per process that it cannot protect them (merge_rows only reads them). Take that one warning here,
    silenced, so it reaches no log and no test that turns warnings into errors."""
    global _read_only_warned
    with _READ_ONLY_WARNED:
        if _read_only_warned:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.from_numpy(np.frombuffer(bytes(1), dtype=np.uint8))
        _read_only_warned = True


def merge_rows(torch: Any, parts: Sequence[np.ndarray], out: Any) -> Any:
    """``parts`` (same dtype and row shape) concatenated along the batch dimension into ``out``, a
    1-D uint8 tensor of exactly their bytes (the head of a pinned buffer), in one torch call; returns
    ``out``. torch copies the whole batch with the GIL released once, where numpy's concatenate
    releases and retakes it for every part, and each retake waits for the event loop thread to give
    it up (bench/staging_merge.py, 294 KiB parts beside a busy thread: numpy 199-255 us a part, torch
    67-146; the served ResNet-50 spent ~0.25 ms an image so). ValueError when the parts do not fit."""
    first = parts[0]
    if any(p.dtype != first.dtype or p.shape[1:] != first.shape[1:] for p in parts):
        raise ValueError(f"cannot merge parts of {[(str(p.dtype), p.shape) for p in parts]}: rows differ")
    if not _read_only_warned:
        _quiet_read_only_warning(torch)
    sources = [torch.from_numpy(np.ascontiguousarray(p).reshape(-1).view(np.uint8)) for p in parts]
    if sum(int(s.numel()) for s in sources) != int(out.numel()):
        raise ValueError(f"cannot merge parts of shapes {[p.shape for p in parts]} into {int(out.numel())} bytes")
    if len(sources) == 1:
        out.copy_(sources[0])
    else:
        torch.cat(sources, out=out)
    return out


class _CudaStaging:
    """Pinned host buffers of one instance, one per tensor name and direction, grown as needed
    (:func:`torch_plan.pinned_capacity`). A batch's inputs are merged straight into them
    (:meth:`stage`: one host copy per byte, in one torch call, :func:`merge_rows`); copies to and
    from the device are asynchronous on the instance's stream, which the instance synchronizes
    before it answers, so a buffer is free again on the next call."""

    VIEWS = 256
    """Views kept per instance (a model with dynamic dims would otherwise make one per shape)."""

    def __init__(self, torch: Any, device: Any, stream: Any, *, pin: bool = True) -> None:
        self._torch = torch
        self._device = device
        self._stream = stream
        self._pin = pin  # False only where a test checks the buffers on a machine without CUDA
        self._buffers: dict[tuple[str, str], Any] = {}
        self._views: dict[tuple[tuple[str, str], Any, tuple[int, ...], int], tuple[Any, Any, Any]] = {}

    def _buffer(self, key: tuple[str, str], nbytes: int) -> Any:
        current = self._buffers.get(key)
        size = 0 if current is None else int(current.numel())
        capacity = torch_plan.pinned_capacity(nbytes, size)
        if current is None or capacity != size:
            current = self._torch.empty(capacity, dtype=self._torch.uint8, pin_memory=self._pin)
            self._buffers[key] = current
            # views of the old buffer would keep its pinned memory alive
            self._views = {k: v for k, v in self._views.items() if k[0] != key}
        return current

    def _typed(self, key: tuple[str, str], nbytes: int, dtype: Any, shape: tuple[int, ...]) -> tuple[Any, Any]:
        """(the buffer's first ``nbytes`` as uint8, the same bytes as ``dtype`` in ``shape``), kept
        per shape while the buffer stays: every torch call gives up the GIL and waits to take it back
        from the busy event loop (tens of us each, bench/staging_merge.py's neighbour), and a batch
        size comes back again and again. The same tensor objects come back for every batch of a
        shape: callers read and copy them, and never change them in place (no ``resize_``,
        ``squeeze_``, ``as_strided_``)."""
        buffer = self._buffer(key, nbytes)
        cached = self._views.get((key, dtype, shape, nbytes))
        if cached is not None and cached[0] is buffer:
            return cached[1], cached[2]
        head = buffer[:nbytes]
        typed = head.view(dtype).view(shape)
        if len(self._views) >= self.VIEWS:
            self._views.clear()
        self._views[(key, dtype, shape, nbytes)] = (buffer, head, typed)
        return head, typed

    def stage(self, name: str, parts: Sequence[np.ndarray], dtype: Any) -> Any:
        """``parts`` (one array per request) merged along the batch dimension into this input's pinned
        buffer; returned as a host tensor of ``dtype`` (same item size as the arrays: bfloat16 for
        BF16's uint16) over that buffer, ready for a non-blocking copy to the device."""
        shape = merged_shape(parts)
        itemsize = parts[0].dtype.itemsize
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        head, typed = self._typed(("in", name), nbytes, dtype, tuple(shape))
        merge_rows(self._torch, parts, head)
        return typed

    def to_host(self, name: str, value: Any) -> Any:
        """A non-blocking copy of device tensor ``value`` into this output's pinned buffer: a
        contiguous host tensor of its dtype and shape, valid once the stream is synchronized."""
        value = value.contiguous()
        nbytes = value.numel() * value.element_size()
        _, staged = self._typed(("out", name), nbytes, value.dtype, tuple(value.shape))
        staged.copy_(value, non_blocking=True)
        return staged


# --- instances -----------------------------------------------------------------------------------


def _instance_stream(torch: Any, device: Any) -> tuple[Any, Callable[[], None]]:
    """A CUDA stream for one instance alone, and the call that gives it back (once its work is done).

    ``torch.cuda.Stream`` takes streams round-robin from a pool of 32 per device (pytorch/pytorch#9938):
    past 32 (instances, or any other user of the pool in the process) two instances share one, and a
    CUDA graph captured on it records the other instance's work. So the stream is created through the
    CUDA runtime (``cudaStreamCreateWithFlags``, non-blocking like torch's) and wrapped for torch;
    where no runtime can be loaded, a pooled stream serves, with a warning."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        runtime = _CUDART.get()
    except cudart.NoCuda as exc:
        log.warning(
            "the CUDA runtime for dedicated instance streams cannot be loaded (%s); instances on %s take torch's "
            "pooled streams, which two instances share past 32 of them",
            exc,
            device,
        )
        return torch.cuda.Stream(device=device), lambda: None
    assert isinstance(runtime, cudart.Runtime)
    with torch.cuda.device(index):  # stream_create sets the thread's current device: torch restores it
        handle = runtime.stream_create(index)
    try:
        stream = torch.cuda.ExternalStream(handle, device=device)
    except BaseException:
        runtime.stream_destroy(handle)
        raise

    def release() -> None:
        try:
            runtime.stream_synchronize(handle)
        finally:
            with _CUDA_ALLOCATOR:  # destroying a stream may synchronize the device (pytorch/pytorch#9646)
                runtime.stream_destroy(handle)

    return stream, release


class TorchInstance(ModelInstance):
    """Runs one module. ``module`` is what torch loaded (any callable taking tensors); ``empty_cache``
    frees the CUDA caching allocator after an out-of-memory error (a no-op on CPU instances)."""

    def __init__(
        self,
        module: Callable[..., Any],
        config: mc.ModelConfig,
        label: str,
        *,
        forward_args: Sequence[str] | None = None,
        dict_input: bool = False,
        settings: torch_plan.TorchSettings | None = None,
        device: str = "cpu",
        empty_cache: Callable[[], None] = lambda: None,
    ) -> None:
        self._torch = _torch()
        self._module = module
        self._label = label
        self._settings = settings or torch_plan.TorchSettings()
        self._device = self._torch.device(device)
        self._empty_cache = empty_cache
        self._batched = config.max_batch_size > 0
        sequence_inputs, state_outputs = torch_plan.sequence_io(config)  # passed by index, as in Triton
        self._inputs = [*config.input, *(tensor for _, tensor in sequence_inputs)]
        self._outputs = [*config.output, *state_outputs]
        self._in_binding = torch_plan.input_binding(
            [i.name for i in config.input],
            forward_args,
            dict_input=dict_input,
            sequence_names=[tensor.name for _, tensor in sequence_inputs],
        )
        if self._in_binding.warning:
            log.warning("model '%s': %s", label, self._in_binding.warning)
        self._out_binding = torch_plan.output_binding([o.name for o in self._outputs])
        self._datatypes = {o.name: DATATYPE_BY_CONFIG_TYPE[mc.DataType.Name(o.data_type)] for o in self._outputs}
        self._channels_last = set(torch_plan.channels_last_inputs(config)) if self._settings.channels_last else set()
        self._run_dtypes = {i.name: torch_plan.run_dtype(i.data_type, self._settings.precision) for i in self._inputs}
        self._cuda = self._device.type == "cuda"
        self._stream: Any = None
        self._release_stream: Callable[[], None] = lambda: None
        self._staging: _CudaStaging | None = None
        self._synced = False  # the stream was synchronized after this batch's last enqueued work
        self._graphed: Any = None
        if not self._cuda:
            self._check_precision()
            return
        self._stream, self._release_stream = _instance_stream(self._torch, self._device)
        try:
            self._staging = _CudaStaging(self._torch, self._device, self._stream)
            if torch_plan.graphs_requested(config):
                # the capture's warm-up runs the model on zeros anyway: check the precision first, where a
                # mismatch names the parameter. Without graphs a GPU instance is not run at load: zeros in an
                # integer input (a length, a 1-based id) can trip a device-side assert, which loses the GPU for
                # the whole process, on every start.
                self._check_precision()
            self._graphed = self._capture_graphs(config)
        except BaseException:
            self._give_back_stream()
            raise

    def _give_back_stream(self) -> None:
        release, self._release_stream = self._release_stream, lambda: None
        try:
            release()
        except Exception as exc:  # a lost CUDA context fails every call: nothing more to give back
            log.warning("model '%s': giving back the CUDA stream on %s failed: %s", self._label, self._device, exc)

    def _example(self, spec: mc.ModelInput, batch: int) -> Any:
        """Zeros in ``spec``'s model shape (dynamic dims 1, ``batch`` rows first for a batching model),
        run dtype and memory format, on the instance's device; empty strings for a TYPE_STRING input."""
        torch = self._torch
        shape = torch_plan.example_shape(torch_plan.model_dims(spec), batch if self._batched else None)
        if spec.data_type == mc.TYPE_STRING:
            return [""] * int(np.prod(shape, dtype=np.int64))
        tensor = torch.zeros(shape, dtype=getattr(torch, self._run_dtypes[spec.name] or "float32"), device=self._device)
        if spec.name in self._channels_last:
            tensor = tensor.contiguous(memory_format=torch.channels_last)
        return tensor

    def _check_precision(self) -> None:
        """With a ``precision`` parameter: one call at load on zeros of the config's shapes (one row) in
        that dtype. A model that keeps or makes a floating tensor in another type (a constant a trace
        recorded, a tensor made in forward()) then fails its load naming the parameter, where it would
        fail every batch; a failure for another reason is logged and left to the batches."""
        precision = self._settings.precision
        if precision is None:
            return
        try:
            if self._cuda:
                try:
                    # the examples are made on the instance's stream, which does not wait for the default one
                    with self._torch.cuda.stream(self._stream), self._modes():
                        examples = [self._example(spec, 1) for spec in self._inputs]
                        self._forward(examples)
                finally:
                    with contextlib.suppress(Exception):
                        self._stream.synchronize()
            else:
                with self._modes():
                    self._forward([self._example(spec, 1) for spec in self._inputs])
        except Exception as exc:
            problem = torch_plan.precision_problem(str(exc), precision)
            if problem is not None:
                raise ConfigError(problem, field="parameters[precision]") from None
            log.warning(
                "model '%s': the check call in %s at load (zeros of the config's shapes) failed, so whether the "
                "model runs in that precision is left to its batches: %s",
                self._label,
                precision,
                torch_plan.failure(exc, self._label, str(self._device), 1).message,
            )

    # The CUDA-graph hook: torch_graphs (imported only here) captures ``_forward`` per batch size.
    def _capture_graphs(self, config: mc.ModelConfig) -> Any:
        if not torch_plan.graphs_requested(config):
            return None
        from sluice.runtime.backends import torch_graphs  # only here: CPU-only servers never load it

        plan = torch_graphs.graph_plan(config)
        if plan is None:
            return None

        def example_inputs(batch: int) -> list[Any]:
            # the static input buffers take these tensors' dtype and memory format: the model's
            # run dtype, and channels_last where the config asks for it (the graph's kernels are
            # then the channels_last ones, and the copy into the buffer converts the layout)
            return [self._example(spec, batch) for spec in self._inputs]

        with _CUDA_ALLOCATOR, self._torch.cuda.stream(self._stream), self._modes():
            graphed = torch_graphs.GraphedModel(self._forward, plan, example_inputs, self._device, self._stream)
        log.info("model '%s' on %s: %s", self._label, self._device, graphed.describe())
        return graphed

    @contextlib.contextmanager
    def _modes(self) -> Iterator[None]:
        """The execution modes the parameters ask for, around one call."""
        torch, settings = self._torch, self._settings
        for setting, setter in (
            (settings.enable_jit_executor, torch._C._jit_set_profiling_executor),
            (settings.enable_jit_profiling, torch._C._jit_set_profiling_mode),
            (settings.enable_tensor_fuser, torch._C._jit_set_texpr_fuser_enabled),
        ):
            if setting is not None:  # process-wide switches, set before each call as Triton does
                setter(setting)
        if self._cuda:
            # process-wide too, and set (not saved and restored) before each call as Triton does:
            # a save/restore context around calls that overlap on other threads can leave cuDNN off
            # for every model once the calls finish in another order than they began
            torch.backends.cudnn.enabled = not settings.disable_cudnn
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode() if settings.inference_mode else torch.no_grad())
            if settings.disable_optimized_execution:
                stack.enter_context(torch.jit.optimized_execution(False))
            yield

    def _forward(self, tensors: list[Any]) -> list[Any]:
        """Run the module on inputs in config order; its results in config output order."""
        names = [i.name for i in self._inputs]
        if self._in_binding.convention == torch_plan.DICT_INPUT:
            result = self._module(dict(zip(names, tensors, strict=True)))
        else:
            args: list[Any] = [None] * self._in_binding.arity
            for name, tensor in zip(names, tensors, strict=True):
                args[self._in_binding.index[name]] = tensor
            result = self._module(*args)
        if isinstance(result, self._torch.Tensor):
            result = [result]
        elif isinstance(result, list) and result and all(isinstance(r, str) for r in result):
            result = [result]  # one List[str] output
        elif not isinstance(result, list | tuple | dict):
            raise ModelError(
                f"model '{self._label}' returned a {type(result).__name__}; allowed: a Tensor, a List[str], "
                "or a tuple, list or dict of them"
            )
        return torch_plan.pick_outputs(result, self._out_binding, self._label)

    def _reshaped(self, spec: mc.ModelInput, value: Any) -> Any:
        """``value`` (numpy array or host tensor) in the model's shape (the config's ``reshape``)."""
        if not spec.HasField("reshape"):
            return value
        shape = tuple(spec.reshape.shape)
        return value.reshape((value.shape[0], *shape) if self._batched else shape)

    def _to_model(self, spec: mc.ModelInput, array: np.ndarray) -> Any:
        torch = self._torch
        array = self._reshaped(spec, array)
        if spec.data_type == mc.TYPE_STRING:
            return [b.decode("utf-8", "replace") if isinstance(b, bytes) else str(b) for b in array.ravel()]
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array, copy=True, order="C")  # torch shares memory only with writable arrays
        if spec.data_type == mc.TYPE_BF16:
            tensor = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        else:
            tensor = torch.from_numpy(array)
        return self._on_device(spec, tensor)

    def _staged(self, spec: mc.ModelInput, parts: list[np.ndarray]) -> Any:
        """A CUDA instance's input: the requests' arrays merged into its pinned buffer (a host tensor
        in the model's shape; strings as a list)."""
        if spec.data_type == mc.TYPE_STRING:
            return self._to_model(spec, parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0))
        assert self._staging is not None
        dtype = getattr(self._torch, torch_plan.TORCH_DTYPE_BY_CONFIG[spec.data_type])
        return self._reshaped(spec, self._staging.stage(spec.name, parts, dtype))

    def _on_device(self, spec: mc.ModelInput, tensor: Any) -> Any:
        """A host tensor on the instance's device (CUDA instances get theirs from :meth:`_staged`, in
        the pinned buffer, so the copy is asynchronous on the instance's stream), in the run dtype and
        memory format the config asks for. Strings pass through."""
        torch = self._torch
        if not isinstance(tensor, torch.Tensor):
            return tensor
        if self._staging is not None and not tensor.is_cuda:
            tensor = tensor.to(self._device, non_blocking=True)
        run_dtype = self._run_dtypes[spec.name]
        if run_dtype is not None and str(tensor.dtype) != f"torch.{run_dtype}":
            tensor = tensor.to(getattr(torch, run_dtype))
        if spec.name in self._channels_last:
            tensor = tensor.contiguous(memory_format=torch.channels_last)
        return tensor

    def _to_numpy(self, spec: mc.ModelOutput, value: Any, rows: int) -> np.ndarray:
        torch = self._torch
        is_strings = isinstance(value, list) and all(isinstance(v, str) for v in value)
        if is_strings or isinstance(value, torch.Tensor):
            produced = torch_plan.STRING_LIST if is_strings else str(value.dtype).removeprefix("torch.")
            problem = torch_plan.output_dtype_problem(spec.name, produced, spec.data_type, self._settings.precision)
            if problem is not None:
                raise ModelError(f"model '{self._label}': {problem}")
        if is_strings:
            array = np.array([v.encode() for v in value], dtype=object)
        elif isinstance(value, torch.Tensor):
            wanted = getattr(torch, torch_plan.TORCH_DTYPE_BY_CONFIG[spec.data_type])
            if value.dtype != wanted:
                value = value.to(wanted)  # the model ran in the ``precision`` parameter's type
            if value.requires_grad:  # not under inference mode; a torch call saved where it is not needed
                value = value.detach()
            if self._staging is not None and value.is_cuda and value.device == self._device:
                value = self._staging.to_host(spec.name, value)  # contiguous
                self._stream.synchronize()
                self._synced = True
            elif value.is_cuda:  # another GPU's (a model split over GPUs): a blocking copy waits for it
                value = value.cpu().contiguous()
            else:
                value = value.contiguous()
            if value.dtype == torch.bfloat16:
                array = value.view(torch.int16).numpy().view(np.uint16).copy()
            else:
                array = value.numpy().copy() if self._staging is not None else value.numpy()
        else:
            raise ModelError(
                f"model '{self._label}': output '{spec.name}' is a {type(value).__name__}; "
                "allowed: a Tensor or List[str]"
            )
        dims = torch_plan.model_dims(spec)
        problem = torch_plan.output_shape_problem(spec.name, array.shape, dims, batched=self._batched, rows=rows)
        if problem is not None:
            raise ModelError(f"model '{self._label}': {problem}")
        if spec.HasField("reshape"):
            shape = client_shape(array.shape, spec.dims, spec.reshape.shape, self._batched)
            if shape is None:
                raise ModelError(reshape_problem(self._label, spec.name, array.shape, spec.dims, spec.reshape.shape))
            array = array.reshape(shape)
        return array

    def execute(self, requests: Sequence[InferRequest]) -> list[Result]:
        start = time.monotonic_ns()
        rows = sum(r.batch_size for r in requests) if self._batched else 1
        inputs_done = outputs_start = start
        try:
            if self._cuda:
                with self._torch.cuda.stream(self._stream), self._modes():
                    arrays, inputs_done, outputs_start = self._execute_cuda(requests, rows)
                if self._settings.enable_cache_cleaning:
                    self._empty_cache()
            else:
                feeds = merge_inputs(requests)
                with self._modes():
                    tensors = [self._to_model(spec, feeds[spec.name]) for spec in self._inputs]
                    inputs_done = time.monotonic_ns()
                    results = self._forward(tensors)
                    outputs_start = time.monotonic_ns()
                    arrays = self._outputs_of(results, rows)
        except Exception as exc:
            error = torch_plan.failure(exc, self._label, str(self._device), rows)
            if self._cuda:  # copies still queued read the pinned buffers the next batch rewrites
                with contextlib.suppress(Exception):
                    self._stream.synchronize()
            out_of_memory = torch_plan.is_out_of_memory(exc)
            if out_of_memory:
                log.warning("%s", error.message)
            elif not isinstance(exc, SluiceError):
                log.info("model '%s' failed: %s", self._label, error.message)
        else:
            responses, self.last_phases_ns = split_timed(
                requests, arrays, batched=self._batched, start_ns=start, inputs_done_ns=inputs_done,
                outputs_start_ns=outputs_start,
            )  # fmt: skip
            return list[Result](responses)
        if out_of_memory:
            # here, past the except clause: the exception's traceback held the failed call's frames
            # and with them its device tensors, which the cache could not have given back
            self._empty_cache()
        return [error] * len(requests)

    def _outputs_of(self, results: Sequence[Any], rows: int) -> dict[str, tuple[str, np.ndarray]]:
        return {
            spec.name: (self._datatypes[spec.name], self._to_numpy(spec, value, rows))
            for spec, value in zip(self._outputs, results, strict=True)
        }

    def _execute_cuda(self, requests: Sequence[InferRequest], rows: int) -> tuple[dict[str, Any], int, int]:
        """One batch on the GPU, on the instance's stream: the requests' inputs merged into pinned host
        buffers, copied (with the dtype and layout conversions) straight into the CUDA graph's static
        buffers, or to the device for an eager call when no graph fits; the outputs copied back through
        pinned buffers. Returns the outputs and the two phase boundaries (monotonic ns)."""
        self._synced = False
        parts = input_parts(requests)
        host = [self._staged(spec, parts[spec.name]) for spec in self._inputs]
        results = self._graphed.run(host) if self._graphed is not None else None
        inputs_done = time.monotonic_ns()
        if results is None:
            tensors = [self._on_device(spec, value) for spec, value in zip(self._inputs, host, strict=True)]
            inputs_done = time.monotonic_ns()
            results = self._forward(tensors)
        outputs_start = time.monotonic_ns()
        arrays = self._outputs_of(results, rows)
        if not self._synced:  # an output's copy synchronized the stream after all this batch's work
            self._stream.synchronize()  # the pinned input buffers are rewritten by the next batch
        return arrays, inputs_done, outputs_start

    def close(self) -> None:
        graphed, self._graphed = self._graphed, None
        if graphed is not None:
            graphed.close()
        self._module = None  # type: ignore[assignment]
        self._staging = None
        if self._cuda:
            self._give_back_stream()  # synchronized first: no work of this instance is left on it
            self._stream = None
            self._empty_cache()


class TorchBackend(ModelBackend):
    def __init__(self, config: mc.ModelConfig, ctx: LoadContext, path: Path, kind: str) -> None:
        self.config = config
        self._ctx = ctx
        self._path = path
        self._kind = kind
        self._settings, _ = torch_plan.torch_settings(_parameters(config))
        self._shared: dict[str, _Loaded] = {}  # ENABLE_WEIGHT_SHARING: device -> module
        self._lock = threading.Lock()
        _apply_thread_counts(_torch(), self._settings, ctx.model_name)

    def _load(self, device: Any, device_id: int) -> _Loaded:
        torch = _torch()
        if self._kind == torch_plan.TORCHSCRIPT:
            return _load_torchscript(torch, self._path, device, self._settings)
        if self._kind == torch_plan.EXPORT:
            return _load_export(torch, self._path, device, self._settings)
        return _load_aoti(torch, self._path, device, device_id)

    def new_instance(self, index: int, kind: int, device_id: int) -> ModelInstance:
        torch = _torch()
        if kind == _KIND_GPU:
            if not torch.cuda.is_available():
                why = "has no CUDA build" if torch.version.cuda is None else "sees no GPU"
                raise Unavailable(
                    f"instance_group kind KIND_GPU needs torch with CUDA and a visible GPU (this torch "
                    f"{torch.__version__} {why}); use KIND_CPU, or a CUDA build of torch on a GPU machine"
                )
            device = torch.device("cuda", device_id)
        else:
            device = torch.device("cpu")
        with self._lock:
            key = str(device)
            if self._settings.enable_weight_sharing and key in self._shared:
                loaded = self._shared[key]
            else:
                loaded = self._load(device, device_id)
                if device.type == "cuda":
                    # the weights' moves and casts ran on this thread's current (default) stream; the
                    # instance runs on its own non-blocking one, which does not wait for it. That
                    # stream only: a device-wide synchronize while another thread captures a CUDA
                    # graph (models load in parallel) is refused by CUDA and fails both loads
                    torch.cuda.current_stream(device).synchronize()
                if self._settings.enable_weight_sharing:
                    self._shared[key] = loaded
        try:
            return TorchInstance(
                loaded.module,
                self.config,
                f"{self._ctx.model_name}:{self._ctx.version}",
                forward_args=loaded.forward_args,
                dict_input=loaded.dict_input,
                settings=self._settings,
                device=str(device),
                empty_cache=_emptying(torch) if device.type == "cuda" else (lambda: None),
            )
        except ConfigError as exc:
            raise ConfigError(exc.detail, file=exc.file or str(self._path), field=exc.field) from None

    def close(self) -> None:
        self._shared.clear()


def _apply_thread_counts(torch: Any, settings: torch_plan.TorchSettings, model: str) -> None:
    """INTRA/INTER_OP_THREAD_COUNT are process-wide in torch (as in Triton, the last value set stands
    for intra-op; inter-op can be set only once, before torch's first parallel work)."""
    if settings.intra_op_thread_count is not None and torch.get_num_threads() != settings.intra_op_thread_count:
        torch.set_num_threads(settings.intra_op_thread_count)
    if settings.inter_op_thread_count is not None and torch.get_num_interop_threads() != settings.inter_op_thread_count:
        try:
            torch.set_num_interop_threads(settings.inter_op_thread_count)
        except RuntimeError:
            log.warning(
                "model '%s': INTER_OP_THREAD_COUNT %d not applied: torch's inter-op pool already runs with %d threads "
                "(process-wide; only the first setting before any parallel work takes effect)",
                model,
                settings.inter_op_thread_count,
                torch.get_num_interop_threads(),
            )


def load(config: mc.ModelConfig, ctx: LoadContext) -> TorchBackend:
    """Find and classify the model file; ``config`` is already completed and validated."""
    if config.model_transaction_policy.decoupled:
        raise Unsupported(
            f"failed to load '{ctx.model_name}' version {ctx.version}: the pytorch backend does not support "
            "model_transaction_policy { decoupled: true }; only Python-backend models may be decoupled"
        )
    path = model_path(config, ctx)
    return TorchBackend(config, ctx, path, kind_of(path))
