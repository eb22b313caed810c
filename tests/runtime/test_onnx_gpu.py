"""ONNX Runtime on the GPU: execution-provider options from the config (Triton's onnxruntime backend
keys, checked), the IO-binding decision, and, where onnxruntime offers the CUDA execution provider,
a model served on the GPU through tritonclient (skipped otherwise, saying so)."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from sluice.runtime.backends.onnxrt import Binding, accelerators, binding_for, providers_for
from sluice.runtime.errors import ConfigError, Unavailable

from .conftest import BUILDERS, EXPLICIT, write_model  # type: ignore[import-not-found]

K = mc.ModelInstanceGroup
CUDA = ["CUDAExecutionProvider", "CPUExecutionProvider"]
TRT = ["TensorrtExecutionProvider", *CUDA]


def cfg(text: str = "") -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


def gpu_accelerator(name: str, **parameters: str) -> str:
    params = " ".join(f'parameters {{ key: "{k}" value: "{v}" }}' for k, v in parameters.items())
    return (
        f'optimization {{ execution_accelerators {{ gpu_execution_accelerator [ {{ name: "{name}" {params} }} ] }} }}'
    )


def test_tensorrt_accelerator_options_map_to_the_tensorrt_provider_like_triton():
    config = cfg(
        gpu_accelerator(
            "tensorrt",
            precision_mode="FP16",
            max_workspace_size_bytes="1073741824",
            trt_engine_cache_enable="true",
            trt_engine_cache_path="/cache",
        )
    )
    assert providers_for(K.KIND_GPU, 0, config, TRT) == [
        (
            "TensorrtExecutionProvider",
            {
                "device_id": "0",
                "trt_fp16_enable": "1",
                "trt_max_workspace_size": "1073741824",
                "trt_engine_cache_enable": "1",
                "trt_engine_cache_path": "/cache",
            },
        ),
        ("CUDAExecutionProvider", {"device_id": "0"}),
        ("CPUExecutionProvider", {}),
    ]


@pytest.mark.parametrize(("mode", "expected"), [("FP32", {}), ("int8", {"trt_int8_enable": "1"})])
def test_precision_mode(mode, expected):
    assert accelerators(cfg(gpu_accelerator("tensorrt", precision_mode=mode))).tensorrt == expected


def test_cuda_options_from_the_accelerator_and_the_deprecated_parameters():
    config = cfg(
        gpu_accelerator("cuda", cudnn_conv_use_max_workspace="0", use_ep_level_unified_stream="1", gpu_mem_limit="1024")
        + '\nparameters { key: "cudnn_conv_algo_search" value { string_value: "1" } }'
        '\nparameters { key: "gpu_mem_limit" value { string_value: "4294967200" } }'
        '\nparameters { key: "arena_extend_strategy" value { string_value: "1" } }'
        '\nparameters { key: "do_copy_in_default_stream" value { string_value: "0" } }'
    )
    assert providers_for(K.KIND_AUTO, 2, config, CUDA)[0] == (
        "CUDAExecutionProvider",
        {
            "device_id": "2",
            "cudnn_conv_algo_search": "HEURISTIC",
            "gpu_mem_limit": "1024",  # the accelerator's value wins over the deprecated parameter
            "arena_extend_strategy": "kSameAsRequested",
            "do_copy_in_default_stream": "0",
            "cudnn_conv_use_max_workspace": "0",
            "use_ep_level_unified_stream": "1",
        },
    )


@pytest.mark.parametrize(
    ("text", "field", "message"),
    [
        (
            gpu_accelerator("tensorrt", precision_mode="FP8"),
            "optimization.execution_accelerators.gpu_execution_accelerator[0].parameters[precision_mode]",
            "precision_mode is 'FP8'; allowed: 'FP32', 'FP16', 'INT8'",
        ),
        (
            gpu_accelerator("tensorrt", trt_fp16_enable="1"),
            "optimization.execution_accelerators.gpu_execution_accelerator[0].parameters[trt_fp16_enable]",
            "unknown TensorRT option 'trt_fp16_enable'; allowed: precision_mode, max_workspace_size_bytes",
        ),
        (
            gpu_accelerator("cuda", gpu_mem_limit="-1"),
            "optimization.execution_accelerators.gpu_execution_accelerator[0].parameters[gpu_mem_limit]",
            "gpu_mem_limit is '-1'; allowed: an integer >= 0",
        ),
        (
            gpu_accelerator("cuda", device_id="1"),
            "optimization.execution_accelerators.gpu_execution_accelerator[0].parameters[device_id]",
            "unknown CUDA option 'device_id'",
        ),
        (
            gpu_accelerator("cuda", enable_cuda_graph="maybe"),
            "optimization.execution_accelerators.gpu_execution_accelerator[0].parameters[enable_cuda_graph]",
            """enable_cuda_graph is 'maybe'; allowed: "1"/"true" or "0"/"false\"""",
        ),
        (
            gpu_accelerator("rocm"),
            "optimization.execution_accelerators.gpu_execution_accelerator[0].name",
            "unknown GPU execution accelerator 'rocm'; allowed: tensorrt, cuda",
        ),
        (
            "optimization { execution_accelerators { cpu_execution_accelerator [ { name: 'dnnl' } ] } }",
            "optimization.execution_accelerators.cpu_execution_accelerator[0].name",
            "unknown CPU execution accelerator 'dnnl'; allowed: openvino",
        ),
        (
            'parameters { key: "cudnn_conv_algo_search" value { string_value: "3" } }',
            "parameters[cudnn_conv_algo_search]",
            "cudnn_conv_algo_search is '3'; allowed: '0', '1', '2', 'EXHAUSTIVE', 'HEURISTIC', 'DEFAULT'",
        ),
    ],
)
def test_a_bad_option_is_a_config_error_naming_the_field_and_what_is_allowed(text, field, message):
    for available in (["CPUExecutionProvider"], TRT):  # checked whatever the machine offers
        with pytest.raises(ConfigError) as caught:
            providers_for(K.KIND_AUTO, 0, cfg(text), available)
        assert caught.value.field == field
        assert message in caught.value.detail


def test_openvino_on_cpu_instances():
    config = cfg("optimization { execution_accelerators { cpu_execution_accelerator [ { name: 'openvino' } ] } }")
    assert providers_for(K.KIND_CPU, 0, config, ["OpenVINOExecutionProvider", "CPUExecutionProvider"]) == [
        ("OpenVINOExecutionProvider", {}),
        ("CPUExecutionProvider", {}),
    ]
    with pytest.raises(Unavailable, match="needs onnxruntime with the OpenVINO execution provider"):
        providers_for(K.KIND_CPU, 0, config, ["CPUExecutionProvider"])


GPU_PROVIDERS = [("CUDAExecutionProvider", {"device_id": "3"}), ("CPUExecutionProvider", {})]


@pytest.mark.parametrize(
    ("providers", "parameters", "datatypes", "expected"),
    [
        (GPU_PROVIDERS, "", ["FP32", "INT64"], Binding("cuda", 3)),
        ([("TensorrtExecutionProvider", {"device_id": "1"}), *GPU_PROVIDERS], "", ["FP16"], Binding("cuda", 1)),
        (GPU_PROVIDERS, 'parameters { key: "io_binding" value { string_value: "off" } }', ["FP32"], None),
        (GPU_PROVIDERS, "", ["FP32", "BYTES"], None),  # strings stay on the host: plain run
        ([("CPUExecutionProvider", {})], "", ["FP32"], None),
    ],
)
def test_binding_decision(providers, parameters, datatypes, expected):
    assert binding_for(providers, cfg(parameters), datatypes) == expected


def test_a_bad_io_binding_parameter_names_the_field():
    with pytest.raises(ConfigError, match="must be 'on' or 'off'") as caught:
        binding_for(GPU_PROVIDERS, cfg('parameters { key: "io_binding" value { string_value: "yes" } }'), ["FP32"])
    assert caught.value.field == "parameters[io_binding]"


def test_a_bad_accelerator_option_fails_the_load_through_the_server(tmp_path, serve):
    repo = tmp_path / "repo"
    write_model(
        repo, "mlp", 'backend: "onnxruntime"\nmax_batch_size: 8\n' + gpu_accelerator("tensorrt", precision_mode="FP9"),
        {"model.onnx": BUILDERS.mlp_model()},
    )  # fmt: skip
    server = serve(repo, **EXPLICIT)
    with pytest.raises(InferenceServerException) as caught:
        httpclient.InferenceServerClient(server.http).load_model("mlp")
    assert caught.value.status() == "400"
    assert "parameters[precision_mode]" in caught.value.message()
    assert "allowed: 'FP32', 'FP16', 'INT8'" in caught.value.message()


# -- on a GPU -----------------------------------------------------------------------------------------

needs_cuda_ep = pytest.mark.skipif(
    "CUDAExecutionProvider" not in onnxruntime.get_available_providers(),
    reason="needs onnxruntime with the CUDA execution provider (onnxruntime-gpu) and a GPU; this build offers "
    + ", ".join(onnxruntime.get_available_providers()),
)


@needs_cuda_ep
@pytest.mark.parametrize("io_binding", ["on", "off"])
def test_a_gpu_instance_with_cuda_options_serves_what_the_cpu_computes(tmp_path, serve, io_binding):
    repo = tmp_path / "repo"
    model = BUILDERS.mlp_model()
    write_model(
        repo, "mlp", 'backend: "onnxruntime"\nmax_batch_size: 8\ninstance_group [ { kind: KIND_GPU } ]\n'
        + gpu_accelerator("cuda", cudnn_conv_algo_search="1", arena_extend_strategy="1")
        + f'\nparameters {{ key: "io_binding" value {{ string_value: "{io_binding}" }} }}\n',
        {"model.onnx": model},
    )  # fmt: skip
    server = serve(repo)
    x = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
    expected = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"INPUT0": x})[0]
    http = httpclient.InferenceServerClient(server.http)
    inputs = [httpclient.InferInput("INPUT0", [5, 16], "FP32")]
    inputs[0].set_data_from_numpy(x)
    np.testing.assert_allclose(http.infer("mlp", inputs).as_numpy("OUTPUT0"), expected, rtol=1e-3, atol=1e-4)
    grpc = grpcclient.InferenceServerClient(server.grpc)
    ginputs = [grpcclient.InferInput("INPUT0", [5, 16], "FP32")]
    ginputs[0].set_data_from_numpy(x)
    np.testing.assert_allclose(grpc.infer("mlp", ginputs).as_numpy("OUTPUT0"), expected, rtol=1e-3, atol=1e-4)


def _batched_add_sub() -> bytes:
    from onnx import TensorProto, helper

    tensors = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 4])
               for n in ("INPUT0", "INPUT1", "OUTPUT0", "OUTPUT1")]  # fmt: skip
    nodes = [helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
             helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])]  # fmt: skip
    model = helper.make_model(helper.make_graph(nodes, "add_sub", tensors[:2], tensors[2:]),
                              opset_imports=[helper.make_opsetid("", 13)])  # fmt: skip
    model.ir_version = 8
    return model.SerializeToString()


@pytest.mark.parametrize("binding", [None, Binding("cpu", 0)], ids=["run", "io-binding"])
def test_the_io_binding_calls_batch_and_split_like_a_plain_run(binding):
    """The IO-binding path (bind host inputs, bind outputs to a device, run, copy back) through the real
    onnxruntime, bound to host memory since no CUDA provider is here: a batch of two requests comes back
    split per request, each output under its own name although the config lists them in another order."""
    from sluice.runtime.backends.onnxrt import OnnxInstance
    from sluice.runtime.types import InferRequest, InferResponse, Tensor

    config = cfg('max_batch_size: 8 input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [4] }, '
                 '{ name: "INPUT1" data_type: TYPE_FP32 dims: [4] } ] '
                 'output [ { name: "OUTPUT1" data_type: TYPE_FP32 dims: [4] }, '
                 '{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [4] } ]')  # fmt: skip
    session = onnxruntime.InferenceSession(_batched_add_sub(), providers=["CPUExecutionProvider"])
    instance = OnnxInstance(session, config, "add_sub:1", [("CPUExecutionProvider", {})], binding=binding)
    rng = np.random.default_rng(1)
    feeds = [(rng.standard_normal((n, 4)).astype(np.float32), rng.standard_normal((n, 4)).astype(np.float32))
             for n in (2, 3)]  # fmt: skip
    requests = [InferRequest("add_sub", "1", [Tensor("INPUT0", "FP32", a), Tensor("INPUT1", "FP32", b)],
                             id=str(i), batch_size=len(a)) for i, (a, b) in enumerate(feeds)]  # fmt: skip
    results = instance.execute(requests)
    assert len(results) == 2
    for result, (a, b) in zip(results, feeds, strict=True):
        assert isinstance(result, InferResponse), result
        outputs = {t.name: t for t in result.outputs}
        assert [t.name for t in result.outputs] == ["OUTPUT1", "OUTPUT0"]
        assert outputs["OUTPUT0"].datatype == outputs["OUTPUT1"].datatype == "FP32"
        np.testing.assert_allclose(outputs["OUTPUT0"].data, a + b, rtol=1e-6)
        np.testing.assert_allclose(outputs["OUTPUT1"].data, a - b, rtol=1e-6)
