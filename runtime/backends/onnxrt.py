"""ONNX Runtime backend: one ``InferenceSession`` per instance.

Instances of kind GPU (or AUTO on a machine with CUDA) use the CUDA execution provider, with
TensorRT first when ``parameters { key: "execution_accelerator" value { string_value: "tensorrt" } }``
or an ``optimization.execution_accelerators.gpu_execution_accelerator`` named ``tensorrt`` asks for
it. Threads per session come from the config parameters ``intra_op_thread_count`` /
``inter_op_thread_count`` (Triton's names); Sluice defaults to one intra-op thread per instance
so instances, not threads, carry the parallelism and nothing spins against the event loop.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from sluice.runtime.backends.base import LoadContext, ModelBackend, ModelInstance, Result, TensorSpec
from sluice.runtime.backends.tensor import merge_inputs, split_outputs
from sluice.runtime.errors import ConfigError, InvalidArgument, ModelError, Unavailable, Unsupported
from sluice.runtime.types import DATATYPE_BY_CONFIG_TYPE, InferRequest

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
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"must be an integer string, got {raw!r}", field=f"parameters[{key}]") from None
    if value < 0:
        raise ConfigError(f"must be >= 0, got {value}", field=f"parameters[{key}]")
    return value


def _wants_tensorrt(config: mc.ModelConfig) -> bool:
    if (_param(config, "execution_accelerator") or "").lower() == "tensorrt":
        return True
    accelerators = config.optimization.execution_accelerators.gpu_execution_accelerator
    return any(a.name.lower() == "tensorrt" for a in accelerators)


def providers_for(kind: int, device_id: int, config: mc.ModelConfig, available: Sequence[str]) -> list[Any]:
    """Execution providers for an instance kind, given what this onnxruntime build offers (pure)."""
    gpu_ok = "CUDAExecutionProvider" in available
    if kind == mc.ModelInstanceGroup.KIND_GPU and not gpu_ok:
        raise Unavailable(
            "instance_group kind KIND_GPU needs onnxruntime with the CUDA execution provider "
            f"(this build offers {', '.join(available)}); install the 'gpu' extra or use KIND_CPU"
        )
    if kind in (mc.ModelInstanceGroup.KIND_GPU, mc.ModelInstanceGroup.KIND_AUTO) and gpu_ok:
        providers: list[Any] = []
        if _wants_tensorrt(config) and "TensorrtExecutionProvider" in available:
            providers.append(("TensorrtExecutionProvider", {"device_id": device_id}))
        providers.append(("CUDAExecutionProvider", {"device_id": device_id}))
        providers.append("CPUExecutionProvider")
        return providers
    return ["CPUExecutionProvider"]


class OnnxInstance(ModelInstance):
    def __init__(self, session: Any, config: mc.ModelConfig, model_label: str) -> None:
        self._session = session
        self._label = model_label
        self._batched = config.max_batch_size > 0
        self._outputs = [o.name for o in config.output]
        self._datatypes = {o.name: DATATYPE_BY_CONFIG_TYPE[mc.DataType.Name(o.data_type)] for o in config.output}
        # ``reshape`` names the shape the model produces; clients see ``dims`` (plus the batch dim).
        self._reshape = {
            o.name: (-1, *o.dims) if self._batched else tuple(o.dims) for o in config.output if o.HasField("reshape")
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
            arrays = self._session.run(self._outputs, feeds)
        except Exception as exc:
            error = ModelError(f"onnxruntime failed to run model '{self._label}': {type(exc).__name__}: {exc}")
            if "INVALID_ARGUMENT" in str(exc):
                error = InvalidArgument(f"model '{self._label}' rejected the inputs: {exc}")
            return [error] * len(requests)
        outputs_start = time.monotonic_ns()
        outputs = {}
        for name, array in zip(self._outputs, arrays, strict=True):
            if name in self._reshape:
                array = array.reshape(self._reshape[name])
            if array.dtype == np.object_ or array.dtype.kind == "U":
                items = [s.encode() if isinstance(s, str) else s for s in array.ravel()]
                array = np.array(items, dtype=object).reshape(array.shape)
            outputs[name] = (self._datatypes[name], array)
        results: list[Result] = list(split_outputs(requests, outputs, batched=self._batched))
        done = time.monotonic_ns()
        self.last_phases_ns = (inputs_done - start, done - outputs_start)
        for request in requests:
            if request.trace is not None:  # sampled (tracing.py)
                request.trace.compute_split(inputs_done - start, outputs_start - inputs_done, done - outputs_start)
        return results


class OnnxBackend(ModelBackend):
    def __init__(self, config: mc.ModelConfig, ctx: LoadContext, path: Path) -> None:
        self.config = config
        self._ctx = ctx
        self._path = path

    def new_instance(self, index: int, kind: int, device_id: int) -> ModelInstance:
        ort = _ort()
        options = ort.SessionOptions()
        intra = _int_param(self.config, "intra_op_thread_count", 1)
        inter = _int_param(self.config, "inter_op_thread_count", 1)
        options.intra_op_num_threads = intra
        options.inter_op_num_threads = inter
        if intra != 1:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = providers_for(kind, device_id, self.config, ort.get_available_providers())
        try:
            session = ort.InferenceSession(str(self._path), options, providers=providers)
        except Exception as exc:
            raise ConfigError(f"ONNX Runtime cannot load the model: {exc}", file=str(self._path)) from exc
        return OnnxInstance(session, self.config, f"{self._ctx.model_name}:{self._ctx.version}")


def load(config: mc.ModelConfig, ctx: LoadContext) -> OnnxBackend:
    """Open the model file; ``config`` must already be completed (see config.complete_io)."""
    if config.model_transaction_policy.decoupled:
        raise Unsupported(
            f"failed to load '{ctx.model_name}' version {ctx.version}: the onnxruntime backend does not support "
            "model_transaction_policy { decoupled: true }; only Python-backend models may be decoupled"
        )
    return OnnxBackend(config, ctx, model_path(config, ctx))
