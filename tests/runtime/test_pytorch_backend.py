"""PyTorch backend: Triton's pytorch_libtorch conventions served through tritonclient (HTTP and gRPC),
torch.export programs and AOTInductor packages, instance placement, and the pure decisions
(naming conventions, parameters, CUDA-path choices) tested without torch where they need none.

Models are built here (torch.jit.script / trace, torch.export); nothing binary is committed.
GPU tests skip with the reason on machines without CUDA.
"""

from __future__ import annotations

import logging
import re
import signal
import threading
import urllib.error
import urllib.request
import warnings
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from sluice.runtime.backends import torch_plan
from sluice.runtime.errors import ConfigError, DeviceLost, ModelError, Unavailable
from sluice.runtime.repository import instance_plan
from sluice.runtime.types import InferRequest, Tensor

from .conftest import EXPLICIT, ManualClock, write_model  # type: ignore[import-not-found]

torch = pytest.importorskip("torch")

K = mc.ModelInstanceGroup
GPU_REASON = "needs a CUDA GPU and a CUDA build of torch (this machine has neither)"
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason=GPU_REASON)


def cfg(text: str = "") -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


# --- models, built in the tests -------------------------------------------------------------------


class AddSub(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a + b, a - b


class Scale(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x * 2 + y


class DictOut(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"doubled": x * 2, "negated": -x}


class Upper(torch.nn.Module):
    def forward(self, words: list[str]) -> list[str]:
        return [w.upper() for w in words]


class Boom(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x.sum() > 100):
            raise ValueError("input sum too large")
        return x + 1


def scripted(module: torch.nn.Module, path: Path) -> bytes:
    torch.jit.script(module).save(str(path))
    return path.read_bytes()


def exported_add_sub(path: Path) -> Any:
    batch = torch.export.Dim("batch", min=1, max=64)
    example = (torch.randn(2, 4), torch.randn(2, 4))
    program = torch.export.export(AddSub(), example, dynamic_shapes=({0: batch}, {0: batch}))
    torch.export.save(program, str(path))
    return program


ADD_SUB_CONFIG = """
platform: "pytorch_libtorch"
max_batch_size: 8
input [
  { name: "INPUT__0", data_type: TYPE_FP32, dims: [ 4 ] },
  { name: "INPUT__1", data_type: TYPE_FP32, dims: [ 4 ] }
]
output [
  { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 4 ] },
  { name: "OUTPUT__1", data_type: TYPE_FP32, dims: [ 4 ] }
]
"""


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 4)).astype(np.float32)


def infer(
    protocol: str, server: Any, model: str, arrays: dict[str, Any], datatypes: dict[str, str] | None = None
) -> Any:
    """One inference through tritonclient over ``protocol`` (http or grpc); inputs FP32 unless ``datatypes``
    names another type."""
    module: Any = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(server.http if protocol == "http" else server.grpc)
    inputs = []
    for name, array in arrays.items():
        tensor = module.InferInput(name, list(np.shape(array)), (datatypes or {}).get(name, "FP32"))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    try:
        return client.infer(model, inputs)
    finally:
        client.close()


def http_infer(server: Any, model: str, arrays: dict[str, np.ndarray], datatype: str = "FP32") -> Any:
    return infer("http", server, model, arrays, dict.fromkeys(arrays, datatype))


def grpc_infer(server: Any, model: str, arrays: dict[str, np.ndarray], datatype: str = "FP32") -> Any:
    return infer("grpc", server, model, arrays, dict.fromkeys(arrays, datatype))


def load_error(server: Any, model: str) -> str:
    client = httpclient.InferenceServerClient(server.http)
    try:
        with pytest.raises(InferenceServerException) as info:
            client.load_model(model)
        return str(info.value)
    finally:
        client.close()


# --- pure: instance placement ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("groups", "gpus", "expected"),
    [
        ("", 0, [(K.KIND_CPU, 0)]),
        ("", 2, [(K.KIND_GPU, 0), (K.KIND_GPU, 1)]),
        ("instance_group [ { kind: KIND_AUTO count: 2 } ]", 0, [(K.KIND_CPU, 0)] * 2),
        ("instance_group [ { kind: KIND_CPU count: 3 } ]", 2, [(K.KIND_CPU, 0)] * 3),
        # KIND_GPU without gpus: count instances on EACH visible GPU
        (
            "instance_group [ { kind: KIND_GPU count: 2 } ]",
            2,
            [(K.KIND_GPU, 0), (K.KIND_GPU, 0), (K.KIND_GPU, 1), (K.KIND_GPU, 1)],
        ),
        # with gpus: count on each listed GPU
        (
            "instance_group [ { kind: KIND_GPU count: 2 gpus: [ 1, 3 ] } ]",
            4,
            [(K.KIND_GPU, 1), (K.KIND_GPU, 1), (K.KIND_GPU, 3), (K.KIND_GPU, 3)],
        ),
        (
            "instance_group [ { kind: KIND_GPU gpus: [ 0 ] }, { kind: KIND_CPU count: 2 } ]",
            1,
            [(K.KIND_GPU, 0), (K.KIND_CPU, 0), (K.KIND_CPU, 0)],
        ),
        # no GPU at all: the backend explains what it lacks
        ("instance_group [ { kind: KIND_GPU } ]", 0, [(K.KIND_GPU, 0)]),
    ],
)
def test_instance_plan_follows_tritons_placement(groups, gpus, expected):
    assert instance_plan(cfg(groups), gpus) == expected


def test_kind_auto_stays_on_the_cpu_when_the_backend_cannot_use_the_gpus():
    """KIND_AUTO with GPUs visible but a backend that cannot use them (a CPU-only onnxruntime, an
    AOTInductor package compiled for the CPU) is KIND_CPU; listed GPUs and KIND_GPU are still GPU."""
    assert instance_plan(cfg(""), 2, auto_gpu=False) == [(K.KIND_CPU, 0)]
    assert instance_plan(cfg("instance_group [ { kind: KIND_AUTO count: 2 } ]"), 1, auto_gpu=False) == [
        (K.KIND_CPU, 0)
    ] * 2
    assert instance_plan(cfg("instance_group [ { kind: KIND_AUTO gpus: [ 1 ] } ]"), 2, auto_gpu=False) == [
        (K.KIND_GPU, 1)
    ]
    assert instance_plan(cfg("instance_group [ { kind: KIND_GPU } ]"), 1, auto_gpu=False) == [(K.KIND_GPU, 0)]


def test_a_listed_gpu_that_is_not_visible_is_a_config_error():
    visible = r"GPU 2 is listed but this machine has 2 GPUs visible \(ids 0 to 1\)"
    with pytest.raises(ConfigError, match=visible) as info:
        instance_plan(cfg("instance_group [ { kind: KIND_CPU count: 1 }, { kind: KIND_GPU gpus: [ 0, 2 ] } ]"), 2)
    assert info.value.field == "instance_group[1].gpus"
    with pytest.raises(ConfigError, match=r"GPU 0 is listed but this machine has 0 GPUs visible"):
        instance_plan(cfg("instance_group [ { kind: KIND_GPU gpus: [ 0 ] } ]"), 0)


# --- pure: file kinds, parameters, conventions ----------------------------------------------------


def test_model_kind_tells_the_three_archives_apart(tmp_path):
    scripted(AddSub(), tmp_path / "model.pt")
    exported_add_sub(tmp_path / "model.pt2")
    names = {p: zipfile.ZipFile(tmp_path / p).namelist() for p in ("model.pt", "model.pt2")}
    assert torch_plan.model_kind(names["model.pt"], "model.pt") == torch_plan.TORCHSCRIPT
    assert torch_plan.model_kind(names["model.pt2"], "model.pt2") == torch_plan.EXPORT
    aoti = ["pkg/data/aotinductor/model/abc.wrapper.so", "pkg/archive_format", "pkg/archive_version"]
    assert torch_plan.model_kind(aoti, "model.pt2") == torch_plan.AOTI
    with pytest.raises(ConfigError, match=r"'weights.zip' is a zip archive but not a model torch can load; allowed"):
        torch_plan.model_kind(["weights/a.npy"], "weights.zip")


def test_the_device_an_aoti_package_was_compiled_for_comes_from_its_metadata():
    def meta(device: str) -> str:
        return f'{{"AOTI_DEVICE_KEY": "{device}", "AOTI_PLATFORM": "linux", "AOTI_COMPUTE_CAPABILITY": ""}}'

    assert torch_plan.aoti_device([meta("cpu"), meta("cpu")]) == "cpu"
    assert torch_plan.aoti_device([meta("cpu"), meta("cuda")]) == "cuda"  # the kernels' device over the wrapper's
    assert torch_plan.aoti_device(["not json", "[]", '{"AOTI_DEVICE_KEY": 3}', meta("cuda")]) == "cuda"
    assert torch_plan.aoti_device([]) is None
    assert torch_plan.aoti_device(['{"AOTI_PLATFORM": "linux"}']) is None


def test_model_filename_prefers_the_config_then_model_pt():
    assert torch_plan.model_filename("", ["model.pt2", "model.pt"]) == "model.pt"
    assert torch_plan.model_filename("", ["model.pt2"]) == "model.pt2"
    assert torch_plan.model_filename("net.pt", ["model.pt"]) == "net.pt"


def test_parameters_are_read_and_bad_values_refused():
    settings, warnings = torch_plan.torch_settings({
        "DISABLE_OPTIMIZED_EXECUTION": "true",
        "INFERENCE_MODE": "false",
        "ENABLE_JIT_PROFILING": "False",
        "INTRA_OP_THREAD_COUNT": "2",
        "ENABLE_NVFUSER": "true",
        "precision": "fp16",
        "memory_format": "channels_last",
        "batch_policy": "fixed_wait",  # someone else's: left alone
    })  # fmt: skip
    assert settings.disable_optimized_execution and not settings.inference_mode
    assert settings.enable_jit_profiling is False and settings.enable_jit_executor is None
    assert settings.intra_op_thread_count == 2
    assert settings.precision == "float16" and settings.channels_last
    assert warnings == ["parameters[ENABLE_NVFUSER]: ignored (NvFuser was removed from PyTorch; Triton ignores it too)"]
    for key, value, message in [
        ("INFERENCE_MODE", "maybe", r"must be 'true' or 'false', got 'maybe'"),
        ("INTRA_OP_THREAD_COUNT", "0", r"must be a positive integer string, got '0'"),
        ("precision", "fp8", r"must be one of fp32, fp16, bf16, got 'fp8'"),
        ("memory_format", "nhwc", r"must be one of contiguous, channels_last, got 'nhwc'"),
    ]:
        with pytest.raises(ConfigError, match=message) as info:
            torch_plan.torch_settings({key: value})
        assert info.value.field == f"parameters[{key}]"


def test_aoti_packages_refuse_precision_and_memory_format():
    """An AOTInductor package runs at the precision and with the input strides it was compiled with: its
    kernels read a channels_last input with the contiguous strides they assume (wrong results, no error)."""
    aoti, script = torch_plan.AOTI, torch_plan.TORCHSCRIPT
    for parameters, field, words in [
        ({"precision": "fp16"}, "parameters[precision]", "runs at the precision it was compiled with"),
        ({"memory_format": "channels_last"}, "parameters[memory_format]", "assume the input strides it was compiled"),
    ]:
        settings, _ = torch_plan.torch_settings(parameters)
        with pytest.raises(ConfigError, match=re.escape(words)) as info:
            torch_plan.check_kind_settings(settings, aoti)
        assert info.value.field == field
        assert "allowed: no " in info.value.detail
        torch_plan.check_kind_settings(settings, script)  # TorchScript and export programs take both
        torch_plan.check_kind_settings(settings, torch_plan.EXPORT)
    for harmless in ({"precision": "fp32"}, {"memory_format": "contiguous"}, {}):
        torch_plan.check_kind_settings(torch_plan.torch_settings(harmless)[0], aoti)


def test_precision_casts_floating_tensors_and_tells_a_dtype_mismatch_from_other_failures():
    assert torch_plan.casts_to_precision("float32", "bfloat16")
    assert torch_plan.casts_to_precision("float64", "float16")
    assert not torch_plan.casts_to_precision("bfloat16", "bfloat16")  # already
    assert not torch_plan.casts_to_precision("int64", "float16")  # indices keep their type
    assert not torch_plan.casts_to_precision("bool", "float16")
    assert not torch_plan.casts_to_precision("float32", None)
    # torch's own texts (torch 2.13, CPU and CUDA) for a cast tensor meeting an fp32 one
    mismatches = {
        "bfloat16": [
            "expected m1 and m2 to have the same dtype, but got: c10::BFloat16 != float",
            "mat1 and mat2 must have the same dtype, but got BFloat16 and Float",
            "Input type (CPUBFloat16Type) and weight type (torch.FloatTensor) should be the same or input should be a "
            "MKLDNN tensor and weight is a dense tensor",
            "expected scalar type BFloat16 but found Float",
            "RNN input dtype (torch.bfloat16) does not match weight dtype (torch.float32).",
            # a TorchScript model's: the interpreter's line first, the exception last
            "The following operation failed in the TorchScript interpreter.\nTraceback of TorchScript (most recent "
            "call last):\n  File \"m.py\", line 3\nRuntimeError: expected m1 and m2 to have the same dtype, but "
            "got: c10::BFloat16 != float",
        ],
        "float16": [
            "Input type (torch.cuda.HalfTensor) and weight type (torch.cuda.FloatTensor) should be the same",
            "expected scalar type Half but found Float",
        ],
    }
    for precision, texts in mismatches.items():
        for text in texts:
            problem = torch_plan.precision_problem(text, precision)
            assert problem is not None, text
            last = text.splitlines()[-1]
            assert f"the model does not run in {'bf16' if precision == 'bfloat16' else 'fp16'}: a check call at " \
                f"load failed with '{last}'" in problem
            assert "allowed: fp32 (or no precision parameter)" in problem
    for other in ("index 7 is out of bounds", "input sum too large", "expected scalar type Long but found Int"):
        assert torch_plan.precision_problem(other, "bfloat16") is None
    assert torch_plan.precision_problem("expected scalar type BFloat16 but found Float", "float16") is None


def test_input_naming_conventions():
    forward = torch_plan.input_binding(["y", "x"], ["x", "y"])
    assert (forward.convention, forward.index) == (torch_plan.FORWARD_ARGUMENT, {"y": 1, "x": 0})
    indexed = torch_plan.input_binding(["B__1", "A__0"], ["a", "b"])
    assert (indexed.convention, indexed.index) == (torch_plan.NAMED_INDEX, {"B__1": 1, "A__0": 0})
    ordered = torch_plan.input_binding(["first", "second"], ["a", "b"])
    assert ordered.convention == torch_plan.CONFIG_ORDER and ordered.index == {"first": 0, "second": 1}
    assert "passed in the config's order" in ordered.warning
    assert torch_plan.input_binding(["k1", "k2"], None, dict_input=True).convention == torch_plan.DICT_INPUT
    with pytest.raises(ConfigError, match=r"lists 1 inputs but the model's forward\(\) takes 2 \(a, b\)"):
        torch_plan.input_binding(["INPUT__0"], ["a", "b"])
    with pytest.raises(ConfigError, match=r"'INPUT__5' names index 5 but the model takes 2 inputs") as info:
        torch_plan.input_binding(["INPUT__0", "INPUT__5"], ["a", "b"])
    assert info.value.field == "input[1].name"
    with pytest.raises(ConfigError, match=r"'B__0' has index 0, like 'A__0'"):
        torch_plan.input_binding(["A__0", "B__0"], None)


def test_outputs_are_picked_by_index_order_or_name():
    indexed = torch_plan.output_binding(["OUTPUT__1", "OUTPUT__0"])
    assert torch_plan.pick_outputs(("a", "b"), indexed, "m") == ["b", "a"]
    ordered = torch_plan.output_binding(["sum", "diff"])
    assert torch_plan.pick_outputs(["s", "d"], ordered, "m") == ["s", "d"]
    assert torch_plan.pick_outputs({"diff": 1, "sum": 2}, ordered, "m") == [2, 1]
    missing = r"output 'OUTPUT__1' refers to output index 1, but the model returned 1 output$"
    with pytest.raises(ModelError, match=missing):
        torch_plan.pick_outputs(["only"], indexed, "m")
    with pytest.raises(ModelError, match=r"returned a dict without 'diff' \(its keys: 'sum'\)"):
        torch_plan.pick_outputs({"sum": 1}, ordered, "m")


def test_output_shape_checks():
    assert torch_plan.output_shape_problem("o", (3, 4), [4], batched=True, rows=3) is None
    assert torch_plan.output_shape_problem("o", (3, 7), [-1], batched=True, rows=3) is None
    assert torch_plan.output_shape_problem("o", (2, 4), [4], batched=True, rows=3) == (
        "output 'o' has shape [2, 4] but the config expects [3, 4] (the batch rows first)"
    )
    assert torch_plan.output_shape_problem("o", (4,), [2, 2], batched=False, rows=1) is not None


def test_config_io_checks_name_the_field():
    refused = r"TYPE_UINT32, which the PyTorch backend cannot serve; allowed: TYPE_BOOL"
    with pytest.raises(ConfigError, match=refused) as info:
        torch_plan.check_io(cfg('input { name: "x" data_type: TYPE_UINT32 dims: 1 } output { name: "y" '
                                'data_type: TYPE_FP32 dims: 1 }'), torch_plan.TORCHSCRIPT)  # fmt: skip
    assert info.value.field == "input[0].data_type"
    two_d = 'max_batch_size: 4 input { name: "s" data_type: TYPE_STRING dims: [ 2 ] } output { name: "y" data_type: TYPE_STRING dims: [ 1 ] reshape { shape: [] } }'  # noqa: E501
    with pytest.raises(ConfigError, match=r"TYPE_STRING with 2 dimensions .* allowed: one dimension in all") as info:
        torch_plan.check_io(cfg(two_d), torch_plan.TORCHSCRIPT)
    assert info.value.field == "input[0].dims"
    with pytest.raises(ConfigError, match=r"needs the inputs listed in the config"):
        torch_plan.check_io(cfg('output { name: "y" data_type: TYPE_FP32 dims: 1 }'), torch_plan.TORCHSCRIPT)


def test_cuda_path_decisions():
    assert torch_plan.run_dtype(mc.TYPE_FP32, "float16") == "float16"
    assert torch_plan.run_dtype(mc.TYPE_INT64, "float16") == "int64"
    assert torch_plan.run_dtype(mc.TYPE_BF16, None) == "bfloat16"
    assert torch_plan.run_dtype(mc.TYPE_STRING, None) is None
    config = cfg(
        'max_batch_size: 8 input [ { name: "image" data_type: TYPE_FP16 dims: [ 3, 224, 224 ] },'
        '{ name: "ids" data_type: TYPE_INT64 dims: [ 3, 4, 4 ] }, { name: "flat" data_type: TYPE_FP32 dims: [ 16 ] } ]'
    )
    assert torch_plan.channels_last_inputs(config) == ["image"]
    assert torch_plan.pinned_capacity(100, 0) == 65536
    assert torch_plan.pinned_capacity(100, 65536) == 65536
    assert torch_plan.pinned_capacity(70000, 65536) == 131072
    assert torch_plan.pinned_capacity(1 << 20, 65536) == 1 << 20
    assert torch_plan.example_shape([3, -1], 4) == [4, 3, 1]
    graphs = cfg("optimization { cuda { graphs: true } }")
    assert "run eagerly" in (torch_plan.cpu_graph_warning(graphs, [K.KIND_CPU]) or "")
    assert torch_plan.cpu_graph_warning(graphs, [K.KIND_GPU]) is None
    assert torch_plan.cpu_graph_warning(cfg(), [K.KIND_CPU]) is None


# --- the out-of-memory seam -----------------------------------------------------------------------


def test_out_of_memory_answers_the_batch_empties_the_cache_and_keeps_serving():
    config = cfg(
        'max_batch_size: 8 input { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] }'
        ' output { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] }'
    )
    calls: list[str] = []

    def module(x: Any) -> Any:
        if x.shape[0] > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return x * 3

    from sluice.runtime.backends.pytorch import TorchInstance

    instance = TorchInstance(module, config, "big:1", forward_args=["x"], empty_cache=lambda: calls.append("emptied"))

    def request(n: int) -> InferRequest:
        return InferRequest("big", "1", [Tensor("INPUT__0", "FP32", rows(n))], batch_size=n)

    results = instance.execute([request(2), request(1)])
    assert all(isinstance(r, Unavailable) for r in results)
    assert "ran out of GPU memory on cpu for a batch of 3 rows: CUDA out of memory. Tried to allocate 20.00 GiB" in (
        results[0].message
    )
    assert calls == ["emptied"]
    (answer,) = instance.execute([request(2)])
    assert np.allclose(answer.outputs[0].data, rows(2) * 3)


@pytest.mark.parametrize(
    ("raised", "line"),
    [
        (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
         "CUDA out of memory. Tried to allocate 2.00 GiB"),
        # what a TorchScript model raises: the interpreter's line first, the allocator's further down
        (RuntimeError("The following operation failed in the TorchScript interpreter.\nTraceback of TorchScript "
                      "(most recent call last):\n  File \"m.py\", line 3\nRuntimeError: CUDA out of memory. "
                      "Tried to allocate 8.00 GiB"), "RuntimeError: CUDA out of memory. Tried to allocate 8.00 GiB"),
        (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
         "CUDA error: out of memory"),
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
         "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    ],
    ids=["allocator", "torchscript", "runtime", "cublas"],
)
def test_every_out_of_memory_form_is_answered_503_with_the_line_that_says_so(raised, line):
    assert torch_plan.is_out_of_memory(raised)
    error = torch_plan.failure(raised, "big:1", "cuda:0", 4)
    assert isinstance(error, Unavailable)
    assert f"ran out of GPU memory on cuda:0 for a batch of 4 rows: {line};" in error.message
    assert not torch_plan.is_out_of_memory(RuntimeError("shape mismatch"))


STICKY = (
    "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously reported "
    "at some other API call, so the stacktrace below might be incorrect."
)


@pytest.mark.parametrize(
    ("text", "lost"),
    [
        (STICKY, True),
        ("CUDA error: device-side assert triggered\nCompile with `TORCH_USE_CUDA_DSA`", True),
        ("CUDA error: unspecified launch failure", True),
        ("CUDA error: misaligned address", True),
        ("CUDA error: hardware stack error", True),  # 714
        ("CUDA error: operation not supported on global/shared address space", True),  # 717
        ("CUDA error: invalid program counter", True),  # 718
        ("CUDA error: an async error has occured in external entity outside of CUDA", True),  # 911, CUDA's spelling
        ("CUDA error: uncorrectable ECC error encountered", True),  # 214
        ("Triton Error [CUDA]: an illegal instruction was encountered", True),  # a Triton kernel's (driver API)
        # by name, with or without CUDA's text: the CUDA runtime through ctypes (runtime/cudart.py), the driver API
        ("cudaStreamSynchronize: cudaErrorHardwareStackError: hardware stack error", True),
        ("cudaErrorInvalidPc", True),
        ("CUDA_ERROR_LAUNCH_FAILED", True),
        ("CUDA_ERROR_EXTERNAL_DEVICE: an async error", True),
        ("CUDA error: out of memory", False),  # not sticky: the OOM path, the instance goes on
        ("CUDA error: too many resources requested for launch", False),  # 701: a launch error, the context lives
        ("CUDA error: too many blocks in cooperative launch", False),  # 720: likewise
        ("cudaErrorLaunchOutOfResources", False),
        ("cudaErrorInvalidPcX", False),  # a longer name is another name
        ("an illegal memory access was encountered", False),  # not CUDA's text: the model's own words
        ("invalid program counter", False),
        ("index 7 is out of bounds", False),
    ],
)
def test_sticky_cuda_errors_are_told_apart(text, lost):
    assert torch_plan.is_device_lost(RuntimeError(text)) == lost
    error = torch_plan.failure(RuntimeError(text), "m:1", "cuda:0", 2)
    assert isinstance(error, DeviceLost) == lost
    if lost:
        assert error.message.startswith(f"model 'm:1' hit an unrecoverable CUDA error on cuda:0 for a batch of 2 rows: "
                                        f"{text.splitlines()[0]}; this process's CUDA context is lost")


class Poisoned(torch.nn.Module):
    """Raises the text torch raises after an illegal memory access when the input sums over 100."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x.sum() > 100):
            raise RuntimeError(
                "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously "
                "reported at some other API call"
            )
        return x + 1


def test_a_lost_cuda_context_fails_liveness_and_readiness_and_says_why(tmp_path, serve, caplog):
    """A sticky CUDA error answers its batch 503 and turns /v2/health/live and ready to 503 (HTTP, gRPC and
    the metrics listener), so Kubernetes restarts the pod; other requests are still answered until then."""
    repo = tmp_path / "repo"
    config = """
        platform: "pytorch_libtorch"
        max_batch_size: 4
        input [ { name: "INPUT__0", data_type: TYPE_FP32, dims: [ 4 ] } ]
        output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 4 ] } ]
        """
    write_model(repo, "poisoned", config, {"model.pt": scripted(Poisoned(), tmp_path / "p.pt")})
    server = serve(repo)
    http = httpclient.InferenceServerClient(server.http)
    grpc = grpcclient.InferenceServerClient(server.grpc)
    try:
        assert http.is_server_live() and http.is_server_ready()
        ok = http_infer(server, "poisoned", {"INPUT__0": np.ones((1, 4), np.float32)})
        np.testing.assert_array_equal(ok.as_numpy("OUTPUT__0"), np.full((1, 4), 2, np.float32))
        with pytest.raises(InferenceServerException) as info:
            http_infer(server, "poisoned", {"INPUT__0": np.full((1, 4), 50, np.float32)})
        assert str(info.value.status()) == "503"
        device = "cuda:0" if torch.cuda.is_available() else "cpu"  # KIND_AUTO: the GPU where there is one
        assert f"hit an unrecoverable CUDA error on {device} for a batch of 1 rows: RuntimeError: CUDA error: an " \
            "illegal memory access was encountered; this process's CUDA context is lost" in str(info.value)
        assert not http.is_server_live() and not http.is_server_ready()
        assert not grpc.is_server_live() and not grpc.is_server_ready()
        with urllib.request.urlopen(f"http://{server.metrics}/metrics") as scrape:
            assert scrape.status == 200  # metrics stay readable for the post-mortem
        for path in ("live", "ready"):
            with pytest.raises(urllib.error.HTTPError) as probe:
                urllib.request.urlopen(f"http://{server.metrics}/v2/health/{path}")
            assert probe.value.code == 503, path
        again = grpc_infer(server, "poisoned", {"INPUT__0": np.ones((2, 4), np.float32)})
        np.testing.assert_array_equal(again.as_numpy("OUTPUT__0"), np.full((2, 4), 2, np.float32))
        assert not http.is_server_live()  # it stays lost
    finally:
        http.close()
        grpc.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("CUDA context is lost" in m and "Liveness and readiness now fail" in m for m in errors), errors



# --- served through tritonclient ------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("pytorch")
    repo = tmp / "repo"
    add_sub = scripted(AddSub(), tmp / "a.pt")
    write_model(repo, "add_sub", ADD_SUB_CONFIG + "dynamic_batching { }", {"model.pt": add_sub})
    write_model(
        repo,
        "named",
        """
        backend: "pytorch"
        max_batch_size: 0
        input [ { name: "y", data_type: TYPE_FP32, dims: [ 4 ] }, { name: "x", data_type: TYPE_FP32, dims: [ 4 ] } ]
        output [ { name: "result", data_type: TYPE_FP32, dims: [ 4 ] } ]
        """,
        {"model.pt": scripted(Scale(), tmp / "s.pt")},
    )
    traced = torch.jit.trace(torch.nn.Linear(4, 2).eval(), torch.randn(1, 4))
    traced.save(str(tmp / "t.pt"))
    write_model(
        repo,
        "linear",
        """
        platform: "pytorch_libtorch"
        max_batch_size: 4
        input [ { name: "INPUT__0", data_type: TYPE_FP32, dims: [ 4 ] } ]
        output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 2 ] } ]
        """,
        {"model.pt": (tmp / "t.pt").read_bytes()},
    )
    write_model(
        repo,
        "dict_out",
        """
        platform: "pytorch_libtorch"
        max_batch_size: 4
        input [ { name: "INPUT__0", data_type: TYPE_FP32, dims: [ 4 ] } ]
        output [ { name: "negated", data_type: TYPE_FP32, dims: [ 4 ] },
                 { name: "doubled", data_type: TYPE_FP32, dims: [ 4 ] } ]
        """,
        {"model.pt": scripted(DictOut(), tmp / "d.pt")},
    )
    write_model(
        repo,
        "upper",
        """
        platform: "pytorch_libtorch"
        max_batch_size: 0
        input [ { name: "INPUT__0", data_type: TYPE_STRING, dims: [ -1 ] } ]
        output [ { name: "OUTPUT__0", data_type: TYPE_STRING, dims: [ -1 ] } ]
        """,
        {"model.pt": scripted(Upper(), tmp / "u.pt")},
    )
    write_model(
        repo,
        "boom",
        """
        platform: "pytorch_libtorch"
        max_batch_size: 0
        input [ { name: "INPUT__0", data_type: TYPE_FP32, dims: [ 4 ] } ]
        output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 4 ] } ]
        """,
        {"model.pt": scripted(Boom(), tmp / "b.pt")},
    )
    (repo / "exported" / "1").mkdir(parents=True)
    exported_add_sub(repo / "exported" / "1" / "model.pt2")  # no config at all: completed from the program
    return repo


@pytest.fixture(scope="module")
def torch_server(torch_repo: Path) -> Any:
    from .conftest import start_server  # type: ignore[import-not-found]

    handle = start_server(torch_repo)
    yield handle
    handle.stop()


@pytest.mark.parametrize("infer", [http_infer, grpc_infer], ids=["http", "grpc"])
def test_index_named_torchscript_serves_over_both_protocols(torch_server, infer):
    a, b = rows(3, 1), rows(3, 2)
    result = infer(torch_server, "add_sub", {"INPUT__0": a, "INPUT__1": b})
    np.testing.assert_allclose(result.as_numpy("OUTPUT__0"), a + b, rtol=1e-6)
    np.testing.assert_allclose(result.as_numpy("OUTPUT__1"), a - b, rtol=1e-6)


@pytest.mark.parametrize("infer", [http_infer, grpc_infer], ids=["http", "grpc"])
def test_forward_argument_names_bind_inputs_whatever_the_config_order(torch_server, infer):
    x, y = rows(1, 3)[0], rows(1, 4)[0]
    result = infer(torch_server, "named", {"x": x, "y": y})
    np.testing.assert_allclose(result.as_numpy("result"), x * 2 + y, rtol=1e-6)


def test_traced_module_and_dict_result(torch_server):
    x = rows(2, 5)
    result = http_infer(torch_server, "linear", {"INPUT__0": x})
    assert result.as_numpy("OUTPUT__0").shape == (2, 2)
    result = grpc_infer(torch_server, "dict_out", {"INPUT__0": x})
    np.testing.assert_array_equal(result.as_numpy("doubled"), x * 2)
    np.testing.assert_array_equal(result.as_numpy("negated"), -x)


@pytest.mark.parametrize("infer", [http_infer, grpc_infer], ids=["http", "grpc"])
def test_strings_go_in_and_out_as_lists(torch_server, infer):
    words = np.array([b"triton", b"sluice", "caf\u00e9".encode()], dtype=object)
    result = infer(torch_server, "upper", {"INPUT__0": words}, "BYTES")
    # TorchScript upper-cases ASCII only; the UTF-8 text goes through intact
    assert list(result.as_numpy("OUTPUT__0")) == [b"TRITON", b"SLUICE", "CAF\u00e9".encode()]


@pytest.mark.parametrize("infer", [http_infer, grpc_infer], ids=["http", "grpc"])
def test_a_model_that_raises_answers_with_its_error_and_keeps_serving(torch_server, infer):
    with pytest.raises(InferenceServerException, match=r"model 'boom:1': ValueError: input sum too large") as info:
        infer(torch_server, "boom", {"INPUT__0": np.full(4, 50, np.float32)})
    assert str(info.value.status()) in ("500", "StatusCode.INTERNAL")
    assert "/" not in str(info.value).split("input sum too large")[0].split("model 'boom:1'")[1]  # no script paths
    result = infer(torch_server, "boom", {"INPUT__0": np.ones(4, np.float32)})
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__0"), np.full(4, 2, np.float32))


def test_bad_inputs_are_refused_before_the_model(torch_server):
    with pytest.raises(InferenceServerException, match=r"INPUT__1") as info:
        http_infer(torch_server, "add_sub", {"INPUT__0": rows(1)})
    assert str(info.value.status()) == "400"
    with pytest.raises(InferenceServerException, match=r"(?i)datatype|FP64") as info:
        wide = rows(1).astype(np.float64)
        grpc_infer(torch_server, "add_sub", {"INPUT__0": wide, "INPUT__1": wide}, "FP64")
    assert str(info.value.status()) == "StatusCode.INVALID_ARGUMENT", info.value


def test_export_program_is_served_with_the_config_completed_from_its_signature(torch_server):
    client = httpclient.InferenceServerClient(torch_server.http)
    config = client.get_model_config("exported")
    client.close()
    assert config["platform"] == "pytorch_libtorch"
    assert [(i["name"], i["data_type"], i["dims"]) for i in config["input"]] == [
        ("a", "TYPE_FP32", [4]),
        ("b", "TYPE_FP32", [4]),
    ]
    assert [o["name"] for o in config["output"]] == ["OUTPUT__0", "OUTPUT__1"]
    assert config["max_batch_size"] == 4
    a, b = rows(3, 7), rows(3, 8)
    result = grpc_infer(torch_server, "exported", {"a": a, "b": b})
    np.testing.assert_allclose(result.as_numpy("OUTPUT__1"), a - b, rtol=1e-6)


def test_dynamic_batching_forms_batches_of_torch_requests(tmp_path, serve):
    repo = tmp_path / "repo"
    write_model(
        repo,
        "add_sub",
        ADD_SUB_CONFIG.replace("max_batch_size: 8", "max_batch_size: 4")
        + "dynamic_batching { max_queue_delay_microseconds: 1000000 }\n"
        + 'parameters { key: "batch_policy" value { string_value: "fixed_wait" } }',
        {"model.pt": scripted(AddSub(), tmp_path / "a.pt")},
    )
    server = serve(repo, clock=ManualClock())  # the clock never moves: only full batches of 4 go

    def call(i: int) -> np.ndarray:
        infer = http_infer if i % 2 else grpc_infer
        return infer(server, "add_sub", {"INPUT__0": rows(1, i), "INPUT__1": rows(1, 100 + i)}).as_numpy("OUTPUT__0")

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(call, range(8)))
    for i, answer in enumerate(answers):
        np.testing.assert_allclose(answer, rows(1, i) + rows(1, 100 + i), rtol=1e-6)
    client = httpclient.InferenceServerClient(server.http)
    stats = client.get_inference_statistics("add_sub")["model_stats"][0]
    client.close()
    assert (stats["inference_count"], stats["execution_count"]) == (8, 2)
    assert [b["batch_size"] for b in stats["batch_stats"]] == [4]


def test_export_programs_load_in_parallel(tmp_path, serve):
    """torch.export.load keeps its deserializer in a global of torch's: programs loading at once (the
    repository loads models in parallel) failed all but one with '_CURRENT_DESERIALIZER is already set'."""
    repo = tmp_path / "repo"
    exported_add_sub(tmp_path / "program.pt2")
    names = [f"exported_{i}" for i in range(6)]
    for name in names:
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.pt2").write_bytes((tmp_path / "program.pt2").read_bytes())
    server = serve(repo)
    a, b = rows(2, 1), rows(2, 2)
    for name in names:
        np.testing.assert_allclose(grpc_infer(server, name, {"a": a, "b": b}).as_numpy("OUTPUT__0"), a + b, rtol=1e-6)


@pytest.mark.parametrize(
    ("config", "files", "message"),
    [
        (
            ADD_SUB_CONFIG.replace(',\n  { name: "INPUT__1", data_type: TYPE_FP32, dims: [ 4 ] }', ""),
            "addsub",
            r"bad/1/model.pt: field 'input': the config lists 1 inputs but the model's forward\(\) takes 2 \(a, b\)",
        ),
        (
            ADD_SUB_CONFIG + 'parameters { key: "INFERENCE_MODE" value { string_value: "sometimes" } }',
            "addsub",
            r"config.pbtxt:12:1: field 'parameters\[INFERENCE_MODE\]': must be 'true' or 'false', got 'sometimes'",
        ),
        (
            ADD_SUB_CONFIG.replace('"INPUT__0", data_type: TYPE_FP32', '"INPUT__0", data_type: TYPE_UINT64'),
            "addsub",
            r"field 'input\[0\].data_type': input 'INPUT__0' has data_type TYPE_UINT64, which the PyTorch backend",
        ),
        (ADD_SUB_CONFIG, "garbage", r"'model.pt' is not a model torch can load \(not a zip archive\)"),
        (ADD_SUB_CONFIG, "none", r"model file not found: .*model.pt .*allowed: model.pt or model.pt2"),
        (
            ADD_SUB_CONFIG + "instance_group [ { kind: KIND_GPU gpus: [ 3 ] } ]",
            "addsub",
            r"config.pbtxt:12:\d+: field 'instance_group\[0\].gpus': "
            r"GPU 3 is listed but this machine has \d+ GPUs? visible",
        ),
        (
            ADD_SUB_CONFIG + 'parameters { key: "memory_format" value { string_value: "nhwc" } }',
            "addsub",
            r"'parameters\[memory_format\]': must be one of contiguous, channels_last, got 'nhwc'",
        ),
        (  # checked on any machine, though only GPU instances capture graphs
            ADD_SUB_CONFIG.replace("dims: [ 4 ] },\n  { name: \"INPUT__1\"", "dims: [ -1 ] },\n  { name: \"INPUT__1\"")
            + "optimization { cuda { graphs: true } }",
            "addsub",
            r"config.pbtxt:12:16: field 'optimization.cuda.graph_spec': input 'INPUT__0' has dynamic dims \[-1\]; "
            r"a CUDA graph needs fixed shapes",
        ),
    ],
    ids=["input-count", "bad-bool", "bad-type", "not-zip", "no-file", "gpu-not-visible", "memory-format", "graph-dims"],
)
def test_bad_configs_fail_the_load_with_file_and_field(tmp_path, serve, config, files, message):
    repo = tmp_path / "repo"
    content = {
        "addsub": {"model.pt": scripted(AddSub(), tmp_path / "a.pt")},
        "garbage": {"model.pt": b"not a model"},
        "none": {},
    }[files]
    write_model(repo, "bad", config, content)
    server = serve(repo, **EXPLICIT)
    error = load_error(server, "bad")
    assert "failed to load 'bad'" in error
    assert str(tmp_path) not in error  # no server paths
    assert re.search(message, error), error


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the KIND_GPU model loads")
def test_gpu_instance_without_cuda_fails_with_the_reason(tmp_path, serve):
    repo = tmp_path / "repo"
    write_model(
        repo,
        "gpu",
        ADD_SUB_CONFIG + "instance_group [ { kind: KIND_GPU } ]",
        {"model.pt": scripted(AddSub(), tmp_path / "a.pt")},
    )
    server = serve(repo, **EXPLICIT)
    assert "KIND_GPU needs torch with CUDA and a visible GPU" in load_error(server, "gpu")


def test_graphs_on_a_cpu_instance_load_with_a_warning_and_run_eagerly(tmp_path, serve, caplog):
    repo = tmp_path / "repo"
    write_model(
        repo,
        "graphs",
        ADD_SUB_CONFIG + "instance_group [ { kind: KIND_CPU } ]\noptimization { cuda { graphs: true } }",
        {"model.pt": scripted(AddSub(), tmp_path / "a.pt")},
    )
    with caplog.at_level("WARNING", logger="sluice"):
        server = serve(repo)
        a = rows(2)
        result = http_infer(server, "graphs", {"INPUT__0": a, "INPUT__1": a})
    np.testing.assert_allclose(result.as_numpy("OUTPUT__0"), 2 * a)
    assert any("optimization.cuda.graphs is set but some instances run on the CPU" in r.message for r in caplog.records)


class Attributes(torch.nn.Module):
    """Plain tensor attributes (neither parameters nor buffers), in a submodule too: ``Module.to(dtype)``
    leaves them alone. TorchScript keeps them as module attributes, torch.export lifts them as constants,
    and torch.jit.trace bakes them into the code as constants."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.w = torch.randn(4, 4)
        self.order = torch.tensor([3, 2, 1, 0])  # an integer attribute: it keeps its type
        self.inner = Offset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.lin(x) @ self.w)[:, self.order]


class Offset(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.offset = torch.randn(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.offset


class MakesOnes(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ torch.ones(4, 4)  # made in forward(): float32, whatever the precision


class RefusesZeros(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x == 0).all()):
            raise ValueError("all zeros")
        return x * 2


BF16_CONFIG = """
platform: "pytorch_libtorch"
max_batch_size: 4
input [ { name: "x", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 4 ] } ]
parameters { key: "precision" value { string_value: "bf16" } }
"""


def test_precision_casts_tensor_attributes_and_constants_and_refuses_models_that_do_not_run_in_it(
    tmp_path, serve, caplog
):
    """bf16 (which runs on the CPU): a scripted module's plain tensor attributes and an exported program's
    lifted constants are cast with the weights, so the models serve (they answered every batch 500 with a
    dtype mismatch before); a traced constant or a tensor made in forward() cannot be cast, and the check
    call at load fails the load naming the parameter and torch's words, instead of every batch. A check
    call that fails for another reason (the model refuses zeros) is logged, and the model serves."""
    torch.manual_seed(0)
    module = Attributes().eval()
    batch = torch.export.Dim("batch", min=1, max=4)
    repo = tmp_path / "repo"
    write_model(repo, "scripted", BF16_CONFIG, {"model.pt": scripted(module, tmp_path / "s.pt")})
    (repo / "exported" / "1").mkdir(parents=True)
    program = torch.export.export(module, (torch.randn(2, 4),), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(repo / "exported" / "1" / "model.pt2"))
    (repo / "exported" / "config.pbtxt").write_text(BF16_CONFIG)
    torch.jit.trace(module, torch.randn(2, 4)).save(str(tmp_path / "t.pt"))
    write_model(repo, "traced", BF16_CONFIG, {"model.pt": (tmp_path / "t.pt").read_bytes()})
    (repo / "makes_ones" / "1").mkdir(parents=True)
    program = torch.export.export(MakesOnes(), (torch.randn(2, 4),), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(repo / "makes_ones" / "1" / "model.pt2"))
    (repo / "makes_ones" / "config.pbtxt").write_text(BF16_CONFIG)
    write_model(repo, "refuses_zeros", BF16_CONFIG, {"model.pt": scripted(RefusesZeros(), tmp_path / "z.pt")})
    with caplog.at_level("WARNING", logger="sluice"):
        server = serve(repo, **EXPLICIT)
    said = [r.getMessage() for r in caplog.records if "refuses_zeros" in r.getMessage()]
    assert any("the check call in bfloat16 at load" in m and "all zeros" in m for m in said), said
    np.testing.assert_array_equal(http_infer(server, "refuses_zeros", {"x": np.ones((2, 4), np.float32)})
                                  .as_numpy("OUTPUT__0"), np.full((2, 4), 2, np.float32))
    x = rows(3, 4)
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    for model in ("scripted", "exported"):
        for infer in (http_infer, grpc_infer):
            got = infer(server, model, {"x": x}).as_numpy("OUTPUT__0")
            assert got.dtype == np.float32
            np.testing.assert_allclose(got, expected, rtol=5e-2, atol=1e-1, err_msg=model)
    mismatch = "expected m1 and m2 to have the same dtype, but got: c10::BFloat16 != float"
    for model, file in (("traced", "model.pt"), ("makes_ones", "model.pt2")):
        error = load_error(server, model)
        assert f"{model}/1/{file}: field 'parameters[precision]': the model does not run in bf16: a check call at " \
            f"load failed with " in error, error
        assert mismatch in error and "allowed: fp32 (or no precision parameter)" in error, error
        assert str(tmp_path) not in error


# --- AOTInductor (compiles C++ with gcc: ~25 s on the 2-core machine) -------------------------------


def aoti_package(program: Any, path: Path) -> Path:
    from torch._inductor import aoti_compile_and_package

    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # torch's own deprecation inside its compile (torch 2.13)
        warnings.simplefilter("ignore", FutureWarning)
        aoti_compile_and_package(program, package_path=str(path))
    return path


def aoti_repo(program: Any, repo: Path, device: str, other: str, other_kind: str) -> None:
    """``program`` compiled into ``repo``/aoti (no instance_group) and, the same package, into
    ``repo``/``other`` with ``other_kind``; the package says it was compiled for ``device``."""
    from sluice.runtime.backends import pytorch

    package = aoti_package(program, repo / "aoti" / "1" / "model.pt2")
    assert pytorch.package_device(package) == device
    write_model(repo, "aoti", ADD_SUB_CONFIG, {})
    (repo / other / "1").mkdir(parents=True)
    (repo / other / "1" / "model.pt2").write_bytes(package.read_bytes())
    write_model(repo, other, ADD_SUB_CONFIG + f"instance_group [ {{ kind: {other_kind} }} ]", {})


def assert_add_sub_served(server: Any, model: str, n: int) -> None:
    a, b = rows(n, 1), rows(n, 2)
    for infer in (http_infer, grpc_infer):
        result = infer(server, model, {"INPUT__0": a, "INPUT__1": b})
        np.testing.assert_allclose(result.as_numpy("OUTPUT__0"), a + b, rtol=1e-5)
        np.testing.assert_allclose(result.as_numpy("OUTPUT__1"), a - b, rtol=1e-5)


def test_aot_inductor_package_is_served(tmp_path, serve, caplog):
    """A package compiled for the CPU: KIND_AUTO serves it on the CPU even where a GPU is visible
    (saying why), and KIND_GPU is refused naming the device it was compiled for (on a machine without
    CUDA: naming what torch lacks). The precision and memory_format parameters are refused: the package
    runs at the precision and with the input strides it was compiled for (a channels_last input gave
    wrong results, with no error)."""
    repo = tmp_path / "repo"
    aoti_repo(exported_add_sub(tmp_path / "program.pt2"), repo, "cpu", "aoti_gpu", "KIND_GPU")
    for name, key, value in (("aoti_nhwc", "memory_format", "channels_last"), ("aoti_fp16", "precision", "fp16")):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.pt2").write_bytes((repo / "aoti" / "1" / "model.pt2").read_bytes())
        parameter = f'parameters {{ key: "{key}" value {{ string_value: "{value}" }} }}'
        write_model(repo, name, ADD_SUB_CONFIG + "instance_group [ { kind: KIND_CPU } ]\n" + parameter, {})
    with caplog.at_level("WARNING", logger="sluice"):
        server = serve(repo, **EXPLICIT)
        httpclient.InferenceServerClient(server.http).load_model("aoti")
    assert_add_sub_served(server, "aoti", 5)
    said = [r.getMessage() for r in caplog.records if "KIND_AUTO runs on the CPU" in r.getMessage()]
    if torch.cuda.is_available():
        assert any("the AOTInductor package 'model.pt2' was compiled for cpu" in m for m in said), said
        message = load_error(server, "aoti_gpu")
        assert "the AOTInductor package was compiled for cpu but the instance runs on cuda; allowed: " \
            "instance_group kind KIND_CPU for this package" in message
        assert "aoti_gpu/1/model.pt2" in message and str(tmp_path) not in message
    else:
        assert said == []  # no GPU visible: nothing to explain
        assert "KIND_GPU needs torch with CUDA and a visible GPU" in load_error(server, "aoti_gpu")
    message = load_error(server, "aoti_nhwc")
    assert "aoti_nhwc/config.pbtxt:13:1: field 'parameters[memory_format]': an AOTInductor package's kernels " \
        "assume the input strides it was compiled with" in message, message
    assert "allowed: no memory_format parameter, or contiguous" in message
    message = load_error(server, "aoti_fp16")
    assert "field 'parameters[precision]': an AOTInductor package runs at the precision it was compiled with" in message


@needs_gpu
def test_a_package_compiled_for_cuda_runs_on_the_gpu_and_is_refused_on_the_cpu(tmp_path, serve):
    batch = torch.export.Dim("batch", min=1, max=64)
    example = (torch.randn(2, 4, device="cuda"), torch.randn(2, 4, device="cuda"))
    program = torch.export.export(AddSub().cuda(), example, dynamic_shapes=({0: batch}, {0: batch}))
    repo = tmp_path / "repo"
    aoti_repo(program, repo, "cuda", "aoti_cpu", "KIND_CPU")
    server = serve(repo, **EXPLICIT)
    httpclient.InferenceServerClient(server.http).load_model("aoti")
    assert_add_sub_served(server, "aoti", 7)
    message = load_error(server, "aoti_cpu")
    assert "the AOTInductor package was compiled for cuda but the instance runs on cpu; allowed: " \
        "instance_group kind KIND_GPU for this package" in message


# --- GPU (skipped here: no CUDA) ------------------------------------------------------------------


def conv_config(input_type: str, kind: str, count: int, extra: str) -> str:
    """The Conv model's config: [3, 8, 8] images in (``input_type``), FP32 [8] out, up to 4 rows a batch."""
    return f"""
        platform: "pytorch_libtorch"
        max_batch_size: 4
        input [ {{ name: "INPUT__0", data_type: {input_type}, dims: [ 3, 8, 8 ] }} ]
        output [ {{ name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 8 ] }} ]
        instance_group [ {{ kind: {kind} count: {count} }} ]
        {extra}
        """


FP16_CHANNELS_LAST = (
    'parameters { key: "precision" value { string_value: "fp16" } }\n'
    'parameters { key: "memory_format" value { string_value: "channels_last" } }\n'
)


class Conv(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).mean(dim=(2, 3))


@needs_gpu
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_gpu_instances_serve_fp16_channels_last(tmp_path, serve, graphs, caplog):
    torch.manual_seed(0)
    module = Conv().eval()
    repo = tmp_path / "repo"
    optimization = (
        "optimization { cuda { graphs: true } }\ndynamic_batching { preferred_batch_size: [ 2, 4 ] }" if graphs else ""
    )
    write_model(
        repo,
        "conv",
        conv_config("TYPE_FP16", "KIND_GPU", 2, FP16_CHANNELS_LAST + optimization),
        {"model.pt": scripted(module, tmp_path / "c.pt")},
    )
    caplog.set_level(logging.INFO, logger="sluice")
    server = serve(repo)
    captured = [r.getMessage() for r in caplog.records if "CUDA graph(s)" in r.getMessage()]
    # each of the 2 instances captured its graphs at the preferred sizes and max_batch_size
    assert len(captured) == (2 if graphs else 0), captured
    assert all("at batch sizes 2,4 " in line for line in captured), captured
    x = np.random.default_rng(0).standard_normal((3, 3, 8, 8)).astype(np.float16)
    expected = module(torch.from_numpy(x).float()).detach().numpy()
    for infer in (http_infer, grpc_infer):
        got = infer(server, "conv", {"INPUT__0": x}, "FP16").as_numpy("OUTPUT__0")
        np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-2)


class WithArange(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.arange(4, dtype=x.dtype)  # the trace records device=cpu for the arange


@needs_gpu
def test_gpu_instances_serve_a_program_exported_with_cpu_constants(tmp_path, serve):
    """A torch.export program traced on a CPU machine carries device=cpu in its arange node; served
    on a GPU the node must follow the weights (Module.to alone leaves it on the CPU)."""
    batch = torch.export.Dim("batch", min=1, max=8)
    program = torch.export.export(WithArange(), (torch.zeros(2, 4),), dynamic_shapes=({0: batch},))
    repo = tmp_path / "repo"
    (repo / "m" / "1").mkdir(parents=True)
    torch.export.save(program, str(repo / "m" / "1" / "model.pt2"))
    (repo / "m" / "config.pbtxt").write_text(
        """
        platform: "pytorch_libtorch"
        max_batch_size: 8
        input [ { name: "x", data_type: TYPE_FP32, dims: [ 4 ] } ]
        output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 4 ] } ]
        instance_group [ { kind: KIND_GPU count: 1 } ]
        """
    )
    server = serve(repo)
    x = np.ones((3, 4), np.float32)
    for infer in (http_infer, grpc_infer):
        np.testing.assert_array_equal(infer(server, "m", {"x": x}).as_numpy("OUTPUT__0"), x + np.arange(4))


@needs_gpu
def test_gpu_out_of_memory_answers_and_the_next_request_is_served(tmp_path, serve):
    class Greedy(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if bool(x[0, 0] > 0):
                return torch.empty(1 << 50, device=x.device).sum().expand(x.shape)  # asks for 4 PiB
            return x + 1

    repo = tmp_path / "repo"
    write_model(
        repo,
        "greedy",
        """
        platform: "pytorch_libtorch"
        max_batch_size: 4
        input [ { name: "INPUT__0", data_type: TYPE_FP32, dims: [ 4 ] } ]
        output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 4 ] } ]
        instance_group [ { kind: KIND_GPU count: 1 } ]
        """,
        {"model.pt": scripted(Greedy(), tmp_path / "g.pt")},
    )
    server = serve(repo)
    with pytest.raises(InferenceServerException, match=r"ran out of GPU memory on cuda:0") as info:
        http_infer(server, "greedy", {"INPUT__0": np.ones((1, 4), np.float32)})
    assert str(info.value.status()) == "503"
    result = http_infer(server, "greedy", {"INPUT__0": -np.ones((1, 4), np.float32)})
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__0"), np.zeros((1, 4), np.float32))


@pytest.mark.parametrize(
    ("kind", "graphs"),
    [
        ("KIND_CPU", False),
        pytest.param("KIND_GPU", False, marks=needs_gpu),
        pytest.param("KIND_GPU", True, marks=needs_gpu),
    ],
    ids=["cpu", "gpu-eager", "gpu-cuda-graphs"],
)
def test_requests_merged_into_one_batch_come_back_each_with_its_own_rows(tmp_path, serve, kind, graphs):
    """Batches of several requests (2+2, 3+1, then one of 4 rows), formed by Triton's fixed_wait
    policy at preferred size 4 on a clock that never moves: on a GPU their rows are merged straight
    into the instance's pinned buffer and (with graphs) copied into the graph's static buffer, cast to
    fp16 and laid out channels_last on the device; every request gets its own rows back."""
    torch.manual_seed(1)
    module = Conv().eval()
    repo = tmp_path / "repo"
    extra = (
        "dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 10000000 }\n"
        'parameters { key: "batch_policy" value { string_value: "fixed_wait" } }\n'
        + (FP16_CHANNELS_LAST if kind == "KIND_GPU" else "")
        + ("optimization { cuda { graphs: true } }" if graphs else "")
    )
    write_model(
        repo, "conv", conv_config("TYPE_FP32", kind, 1, extra), {"model.pt": scripted(module, tmp_path / "c.pt")}
    )
    server = serve(repo, clock=ManualClock())  # the 10 s delay never passes: only size 4 dispatches
    rng = np.random.default_rng(7)
    tolerance = 2e-2 if kind == "KIND_GPU" else 1e-5
    with ThreadPoolExecutor(4) as pool:
        for sizes in ((2, 2), (3, 1), (4,)):
            xs = [rng.standard_normal((n, 3, 8, 8)).astype(np.float32) for n in sizes]
            calls = [
                pool.submit(grpc_infer if i % 2 else http_infer, server, "conv", {"INPUT__0": x})
                for i, x in enumerate(xs)
            ]
            for x, call in zip(xs, calls, strict=True):
                got = call.result(timeout=60).as_numpy("OUTPUT__0")
                expected = module(torch.from_numpy(x)).detach().numpy()
                np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance)
    client = httpclient.InferenceServerClient(server.http)
    try:
        stats = client.get_inference_statistics("conv")["model_stats"][0]
    finally:
        client.close()
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]] == [(4, 3)]
    assert stats["inference_count"] == 12


@needs_gpu
def test_fp16_with_cuda_graphs_casts_attributes_and_refuses_a_traced_constant_before_capture(tmp_path, serve):
    """On a GPU with graphs: the scripted model's attributes are cast and its graphs serve; the traced one
    fails its load at the precision check, naming the parameter (its capture's warm-up would have raised
    torch's bare RuntimeError)."""
    torch.manual_seed(0)
    module = Attributes().eval()
    config = BF16_CONFIG.replace("bf16", "fp16") + (
        "instance_group [ { kind: KIND_GPU count: 1 } ]\noptimization { cuda { graphs: true } }\n"
    )
    repo = tmp_path / "repo"
    write_model(repo, "scripted", config, {"model.pt": scripted(module, tmp_path / "s.pt")})
    torch.jit.trace(module, torch.randn(2, 4)).save(str(tmp_path / "t.pt"))
    write_model(repo, "traced", config, {"model.pt": (tmp_path / "t.pt").read_bytes()})
    server = serve(repo, **EXPLICIT)
    x = rows(3, 4)
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(
        http_infer(server, "scripted", {"x": x}).as_numpy("OUTPUT__0"), expected, rtol=2e-2, atol=5e-2
    )
    error = load_error(server, "traced")
    assert "traced/1/model.pt: field 'parameters[precision]': the model does not run in fp16" in error, error
    assert "CUDA graph" not in error


@needs_gpu
def test_a_model_loads_and_serves_while_another_thread_captures_a_cuda_graph(tmp_path, serve):
    """Models load in parallel, and a graphed one captures while others load and serve. CUDA refuses a
    device-wide synchronize while any stream of the device captures (and invalidates that capture): a
    GPU instance's load synchronizes only its own thread's stream, so both the load and the capture
    (held open here by another thread, in the backend's thread_local mode) succeed."""
    repo = tmp_path / "repo"
    write_model(
        repo,
        "add_sub",
        ADD_SUB_CONFIG + "instance_group [ { kind: KIND_GPU count: 2 } ]",
        {"model.pt": scripted(AddSub(), tmp_path / "a.pt")},
    )
    server = serve(repo, model_control_mode="explicit")
    capturing, loaded = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def capture() -> None:
        x = torch.ones(4, device="cuda:0")
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=torch.cuda.Stream(0), capture_error_mode="thread_local"):
                y = x * 2
                capturing.set()
                loaded.wait(120)
            graph.replay()
            torch.cuda.current_stream(0).synchronize()
            outcome["replayed"] = y.cpu()
        except Exception as exc:
            outcome["error"] = exc
        finally:
            capturing.set()

    thread = threading.Thread(target=capture, name="capturing")
    thread.start()
    try:
        assert capturing.wait(60)
        client = httpclient.InferenceServerClient(server.http)
        try:
            client.load_model("add_sub")
        finally:
            client.close()
        assert_add_sub_served(server, "add_sub", 3)  # serving on the instances' streams meanwhile
    finally:
        loaded.set()
        thread.join(60)
    assert "error" not in outcome, outcome
    torch.testing.assert_close(outcome["replayed"], torch.full((4,), 2.0))


@needs_gpu
def test_every_gpu_instance_has_a_cuda_stream_of_its_own_past_torchs_pool(tmp_path):
    """torch.cuda.Stream hands out a pool of 32 streams per device round-robin, so 33 instances would have
    two sharing one (and a graph captured on it would record the other's work); each instance's stream is
    its own, and each serves its own rows."""
    from sluice.runtime.backends import pytorch
    from sluice.runtime.backends.base import LoadContext

    assert len({torch.cuda.Stream(0).cuda_stream for _ in range(33)}) <= 32  # the pool repeats itself
    version_dir = tmp_path / "m" / "1"
    version_dir.mkdir(parents=True)
    scripted(AddSub(), version_dir / "model.pt")
    backend = pytorch.load(cfg(ADD_SUB_CONFIG), LoadContext("m", 1, tmp_path / "m", version_dir, tmp_path))
    instances = [backend.new_instance(i, K.KIND_GPU, 0) for i in range(40)]
    try:
        assert len({instance._stream.cuda_stream for instance in instances}) == 40
        for n, instance in enumerate(instances, start=1):
            a, b = rows(n % 8 + 1, n), rows(n % 8 + 1, 100 + n)
            request = InferRequest(
                "m", "1", [Tensor("INPUT__0", "FP32", a), Tensor("INPUT__1", "FP32", b)], batch_size=len(a)
            )
            (result,) = instance.execute([request])
            np.testing.assert_allclose(result.outputs[0].data, a + b, rtol=1e-6)
    finally:
        for instance in instances:
            instance.close()
        backend.close()


class Lookup(torch.nn.Module):
    """An embedding lookup: an id past the table is a device-side assert on the GPU (a sticky CUDA error)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(10, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids)


@needs_gpu
def test_a_real_device_side_assert_makes_the_server_not_live(tmp_path):
    """In a server process of its own (its CUDA context is lost for good): an out-of-range id asserts on
    the device; the batch is answered 503 and the server reports not live and not ready."""
    from .test_cli_shutdown import start_ports  # type: ignore[import-not-found]

    repo = tmp_path / "repo"
    config = """
        platform: "pytorch_libtorch"
        max_batch_size: 4
        input [ { name: "INPUT__0", data_type: TYPE_INT64, dims: [ 2 ] } ]
        output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 2, 4 ] } ]
        instance_group [ { kind: KIND_GPU count: 1 } ]
        """
    write_model(repo, "lookup", config, {"model.pt": scripted(Lookup(), tmp_path / "l.pt")})
    proc, ports = start_ports(repo, tmp_path)
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{ports['http']}")

        def lookup(ids: list[int]) -> Any:
            tensor = httpclient.InferInput("INPUT__0", [1, 2], "INT64")
            tensor.set_data_from_numpy(np.array([ids], np.int64))
            return client.infer("lookup", [tensor])

        assert lookup([1, 2]).as_numpy("OUTPUT__0").shape == (1, 2, 4)
        with pytest.raises(InferenceServerException) as info:
            lookup([1, 1000])
        assert str(info.value.status()) == "503", str(info.value)
        assert "hit an unrecoverable CUDA error on cuda:0" in str(info.value)
        assert not client.is_server_live() and not client.is_server_ready()
        client.close()
    finally:
        proc.send_signal(signal.SIGINT)  # stop now: SIGTERM would drain for 5 s
        proc.communicate(timeout=60)

