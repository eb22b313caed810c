"""ONNX Runtime on the GPU: execution-provider options from the config (Triton's onnxruntime backend
keys, checked), the check that a session got the providers it asked for, session and run options
(Triton's model-config parameters), the IO-binding decision, and, where onnxruntime offers the CUDA
execution provider, a model served on the GPU through tritonclient (skipped otherwise, saying so)."""

from __future__ import annotations

import logging

import numpy as np
import onnxruntime
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from sluice.runtime.backends.base import LoadContext
from sluice.runtime.backends.onnxrt import (
    Binding,
    OnnxInstance,
    SessionSettings,
    accelerators,
    binding_for,
    load,
    providers_for,
    run_config,
    session_options,
    session_problem,
    session_settings,
)
from sluice.runtime.errors import ConfigError, SluiceError, Unavailable
from sluice.runtime.types import InferRequest, InferResponse, Tensor

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


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("FP32", {}), ("FP16", {"trt_fp16_enable": "1"}), ("BF16", {"trt_bf16_enable": "1"}),
     ("bf16", {"trt_bf16_enable": "1"}), ("int8", {"trt_int8_enable": "1"})],
)  # fmt: skip
def test_precision_mode_sets_the_tensorrt_flag_triton_sets(mode, expected):
    """BF16 used to be refused; Triton maps it to trt_bf16_enable."""
    assert accelerators(cfg(gpu_accelerator("tensorrt", precision_mode=mode))).tensorrt == expected


def test_cuda_keys_sluice_does_not_know_go_to_onnxruntime_as_strings_and_device_id_is_the_instances():
    """As Triton: any key of the cuda accelerator is passed on (onnxruntime checks it when the session is made);
    a device_id is replaced by the instance's GPU, with a warning instead of the error it used to be."""
    config = cfg(gpu_accelerator("cuda", sdpa_kernel="2", device_id="3", use_tf32="0"))
    assert providers_for(K.KIND_GPU, 1, config, CUDA)[0] == (
        "CUDAExecutionProvider",
        {"device_id": "1", "sdpa_kernel": "2", "use_tf32": "0"},
    )
    assert accelerators(config).warnings == (
        "optimization.execution_accelerators.gpu_execution_accelerator[0].parameters[device_id]: ignored; each "
        "instance's CUDA provider runs on the instance's GPU (instance_group.gpus), as in Triton",
    )


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
            "precision_mode is 'FP8'; allowed: 'FP32', 'FP16', 'BF16', 'INT8'",
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
            gpu_accelerator("tensorrt", device_id="1"),
            "optimization.execution_accelerators.gpu_execution_accelerator[0].parameters[device_id]",
            "unknown TensorRT option 'device_id'",
        ),
        (
            gpu_accelerator("cuda", user_compute_stream="140000"),
            "optimization.execution_accelerators.gpu_execution_accelerator[0].parameters[user_compute_stream]",
            "user_compute_stream takes a CUDA stream or function address, which the server sets",
        ),
        # CUDA graphs: onnxruntime replays on the first run's buffers, Sluice binds fresh ones per batch
        (
            gpu_accelerator("cuda", enable_cuda_graph="1"),
            "optimization.execution_accelerators.gpu_execution_accelerator[0].parameters[enable_cuda_graph]",
            "enable_cuda_graph is '1': CUDA graphs are not supported by Sluice's onnxruntime backend yet",
        ),
        (
            gpu_accelerator("tensorrt", trt_cuda_graph_enable="true"),
            "optimization.execution_accelerators.gpu_execution_accelerator[0].parameters[trt_cuda_graph_enable]",
            "trt_cuda_graph_enable is 'true': CUDA graphs are not supported by Sluice's onnxruntime backend yet",
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
    assert "allowed: 'FP32', 'FP16', 'BF16', 'INT8'" in caught.value.message()


def test_cuda_graph_options_set_off_are_accepted():
    config = cfg(
        "optimization { execution_accelerators { gpu_execution_accelerator [ "
        '{ name: "tensorrt" parameters { key: "trt_cuda_graph_enable" value: "false" } }, '
        '{ name: "cuda" parameters { key: "enable_cuda_graph" value: "0" } } ] } }'
    )
    assert providers_for(K.KIND_GPU, 0, config, TRT)[:2] == [
        ("TensorrtExecutionProvider", {"device_id": "0", "trt_cuda_graph_enable": "0"}),
        ("CUDAExecutionProvider", {"device_id": "0", "enable_cuda_graph": "0"}),
    ]


# -- the session got what was asked -------------------------------------------------------------------

ASKED_TRT = [("TensorrtExecutionProvider", {"device_id": "1"}), ("CUDAExecutionProvider", {"device_id": "1"}),
             ("CPUExecutionProvider", {})]  # fmt: skip
ASKED_CUDA = ASKED_TRT[1:]


@pytest.mark.parametrize(
    ("asked", "got", "options", "message"),
    [
        (ASKED_CUDA, ["CUDAExecutionProvider", "CPUExecutionProvider"],
         {"CUDAExecutionProvider": {"device_id": "1", "gpu_mem_limit": "4"}, "CPUExecutionProvider": {}}, None),
        (ASKED_TRT, ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
         {"TensorrtExecutionProvider": {"device_id": "1"}, "CUDAExecutionProvider": {"device_id": "1"}}, None),
        ([("CPUExecutionProvider", {})], ["CPUExecutionProvider"], {"CPUExecutionProvider": {}}, None),
        # onnxruntime-gpu without its CUDA/cuDNN libraries: a session on the CPU, one warning in the log
        (ASKED_CUDA, ["CPUExecutionProvider"], {"CPUExecutionProvider": {}},
         "onnxruntime could not create the CUDAExecutionProvider on GPU 1 (the session has CPUExecutionProvider): "
         "most likely the CUDA and cuDNN libraries onnxruntime-gpu needs (CUDA 12 and cuDNN 9"),
        # both missing: CUDA is the cause to fix first
        (ASKED_TRT, ["CPUExecutionProvider"], {}, "could not create the CUDAExecutionProvider on GPU 1"),
        # TensorRT's libraries missing: the load fails, as in Triton
        (ASKED_TRT, ["CUDAExecutionProvider", "CPUExecutionProvider"], {"CUDAExecutionProvider": {"device_id": "1"}},
         "could not create the TensorrtExecutionProvider on GPU 1 (the session has CUDAExecutionProvider, "
         "CPUExecutionProvider): most likely the TensorRT libraries"),
        # onnxruntime's creation fallback: the providers again, without their options (device 0)
        (ASKED_TRT, ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
         {"TensorrtExecutionProvider": {"device_id": "0"}, "CUDAExecutionProvider": {"device_id": "0"}},
         "the session's TensorrtExecutionProvider runs on GPU 0 instead of the instance's GPU 1"),
        ([("OpenVINOExecutionProvider", {}), ("CPUExecutionProvider", {})], ["CPUExecutionProvider"], {},
         "could not create the OpenVINOExecutionProvider (the session has CPUExecutionProvider)"),
    ],
)  # fmt: skip
def test_session_problem(asked, got, options, message):
    problem = session_problem(asked, got, options)
    if message is None:
        assert problem is None
    else:
        assert isinstance(problem, Unavailable)
        assert message in problem.message


def _context(tmp_path, model: bytes, name: str = "mlp") -> LoadContext:
    version_dir = tmp_path / name / "1"
    version_dir.mkdir(parents=True)
    (version_dir / "model.onnx").write_bytes(model)
    return LoadContext(name, 1, tmp_path / name, version_dir, tmp_path)


def test_a_gpu_instance_whose_session_has_no_cuda_provider_fails_its_load(tmp_path, monkeypatch):
    """onnxruntime-gpu lists the CUDA provider even when its libraries cannot load; the session is then made on
    the CPU with only a warning. Reproduced with the real onnxruntime: the CPU build, told to list CUDA, makes a
    CPU session the same way; the instance is refused instead of serving on the CPU."""
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: CUDA)
    backend = load(cfg("max_batch_size: 8"), _context(tmp_path, BUILDERS.mlp_model()))
    with pytest.warns(UserWarning, match="not in available provider names"), pytest.raises(Unavailable) as caught:
        backend.new_instance(0, K.KIND_GPU, 1)
    assert "could not create the CUDAExecutionProvider on GPU 1 (the session has CPUExecutionProvider)" in str(
        caught.value
    )


@pytest.mark.filterwarnings("ignore:Specified provider 'CUDAExecutionProvider' is not in available provider names")
def test_a_gpu_model_whose_session_came_up_on_the_cpu_fails_its_load_through_the_server(tmp_path, serve, monkeypatch):
    """The same, as a client sees it: the load fails naming the provider and the likely cause, instead of the model
    serving from the CPU while its config says KIND_GPU."""
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: CUDA)
    repo = tmp_path / "repo"
    write_model(repo, "mlp", 'backend: "onnxruntime"\nmax_batch_size: 8\ninstance_group [ { kind: KIND_GPU } ]\n',
                {"model.onnx": BUILDERS.mlp_model()})  # fmt: skip
    server = serve(repo, **EXPLICIT)
    client = grpcclient.InferenceServerClient(server.grpc)
    with pytest.raises(InferenceServerException) as caught:
        client.load_model("mlp")
    assert "could not create the CUDAExecutionProvider on GPU 0 (the session has CPUExecutionProvider)" in str(
        caught.value
    )
    assert "CUDA and cuDNN libraries" in str(caught.value)
    assert not client.is_model_ready("mlp")
    with pytest.raises(InferenceServerException) as over_http:
        httpclient.InferenceServerClient(server.http).load_model("mlp")
    assert over_http.value.status() == "400"  # a failed load, as Triton answers it (INVALID_ARG)


def test_the_session_never_falls_back_to_other_providers(tmp_path, capfd):
    """Fallback is off at creation (enable_fallback=0) and at run time (disable_fallback): a provider failure in
    run() answers the batch with an error instead of onnxruntime printing "Falling back" and rebuilding the
    session on the CPU. The failure is injected under the real session's run()."""
    from onnxruntime.capi import _pybind_state

    backend = load(cfg("max_batch_size: 8"), _context(tmp_path, BUILDERS.mlp_model()))
    instance = backend.new_instance(0, K.KIND_CPU, 0)
    session = instance._session
    assert session._enable_fallback is False  # onnxruntime's own flag, read by its run()

    class FailingProvider:
        def __init__(self, inner):
            self._inner = inner

        def run(self, *args):
            raise _pybind_state.EPFail("provider failed")

        def __getattr__(self, name):
            return getattr(self._inner, name)

    session._sess = FailingProvider(session._sess)
    x = np.ones((2, 16), dtype=np.float32)
    results = instance.execute([InferRequest("mlp", "1", [Tensor("INPUT0", "FP32", x)], id="0", batch_size=2)])
    assert isinstance(results[0], SluiceError), results[0]
    assert "provider failed" in results[0].message
    assert isinstance(session._sess, FailingProvider)  # not rebuilt
    assert "Falling back" not in capfd.readouterr().out


# -- session and run options (Triton's model-config parameters) -------------------------------------


SHRINK = "memory.enable_memory_arena_shrinkage"


def param(key: str, value: str) -> str:
    return f'parameters {{ key: "{key}" value {{ string_value: "{value}" }} }}\n'


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", SessionSettings()),
        (param("execution_mode", "1") + param("inter_op_thread_count", "4"),
         SessionSettings(inter_op_threads=4, parallel=True,
                         config_entries=(("session.inter_op.allow_spinning", "0"),))),
        (param("execution_mode", "0"), SessionSettings()),
        (param("intra_op_thread_count", "0"),
         SessionSettings(intra_op_threads=0, config_entries=(("session.intra_op.allow_spinning", "0"),))),
        (param("enable_mem_arena", "0") + param("enable_mem_pattern", "false"),
         SessionSettings(cpu_mem_arena=False, mem_pattern=False)),
        (param("enable_mem_arena", "1") + param("enable_mem_pattern", "on"),
         SessionSettings(cpu_mem_arena=True, mem_pattern=True)),
        (param("session.use_device_allocator_for_initializers", "true"),
         SessionSettings(config_entries=(("session.use_device_allocator_for_initializers", "1"),))),
        (param("memory.enable_memory_arena_shrinkage", "cpu:0; gpu:01;gpu:1;"),
         SessionSettings(arena_shrinkage=("cpu:0", "gpu:1"))),
        (param("memory.enable_memory_arena_shrinkage", "gpu:0") + param("enable_mem_arena", "0"),
         SessionSettings(cpu_mem_arena=False, arena_shrinkage=("gpu:0",))),
        ("optimization { graph { level: -1 } }", SessionSettings(graph_level="ORT_ENABLE_BASIC")),
        ("optimization { graph { level: 0 } }", SessionSettings(graph_level="ORT_ENABLE_ALL")),
        ("optimization { graph { level: 1 } }", SessionSettings(graph_level="ORT_ENABLE_EXTENDED")),
        ("optimization { graph { level: 2 } }", SessionSettings(graph_level="ORT_DISABLE_ALL")),
        (param("share_session_between_instances", "false"), SessionSettings()),
    ],
)  # fmt: skip
def test_session_settings_from_tritons_parameters(text, expected):
    assert session_settings(cfg(text)) == expected


@pytest.mark.parametrize(
    ("text", "warning"),
    [
        (param("share_session_between_instances", "true"),
         "parameters[share_session_between_instances]: not supported; each instance has its own onnxruntime session"),
        (param("execution_mode", "1"),
         'parameters[execution_mode] is "1" (parallel) but inter_op_thread_count is 1 (Sluice\'s default)'),
    ],
)  # fmt: skip
def test_settings_sluice_does_not_carry_out_are_warnings(text, warning):
    (only,) = session_settings(cfg(text)).warnings
    assert only.startswith(warning)


def test_a_graph_level_triton_does_not_know_is_every_optimization_with_a_warning():
    """Triton's onnxruntime backend reads any other level as ORT_ENABLE_ALL: configs that load there load here."""
    settings = session_settings(cfg("optimization { graph { level: 3 } }"))
    assert settings.graph_level == "ORT_ENABLE_ALL"
    assert any("optimization.graph.level is 3" in w for w in settings.warnings)


@pytest.mark.parametrize(
    ("text", "field", "message"),
    [
        (param("execution_mode", "2"), "parameters[execution_mode]",
         """execution_mode is '2'; allowed: "0" (sequential, the default) or "1" (parallel)"""),
        (param("enable_mem_arena", "maybe"), "parameters[enable_mem_arena]",
         """'maybe' is not a boolean; allowed: "1"/"true" or "0"/"false\""""),
        (param("enable_mem_pattern", "2"), "parameters[enable_mem_pattern]", "'2' is not a boolean"),
        (param("session.use_device_allocator_for_initializers", "yes please"),
         "parameters[session.use_device_allocator_for_initializers]", "'yes please' is not a boolean"),
        (param("share_session_between_instances", "sometimes"), "parameters[share_session_between_instances]",
         "'sometimes' is not a boolean"),
        (param(SHRINK, "cpu:0;disk:0"), f"parameters[{SHRINK}]",
         """'disk:0' names no memory arena; allowed: "cpu:0" and/or "gpu:<id>" joined by ";", such as "cpu:0;gpu:0"""),
        (param(SHRINK, "cpu:1"), f"parameters[{SHRINK}]", "'cpu:1' names no memory arena"),
        (param(SHRINK, "cpu:0") + param("enable_mem_arena", "0"), f"parameters[{SHRINK}]",
         'cpu:0 names the CPU arena, which parameters[enable_mem_arena] "0" turns off'),
    ],
)  # fmt: skip
def test_a_bad_session_option_is_a_config_error_naming_the_field_and_what_is_allowed(text, field, message):
    with pytest.raises(ConfigError) as caught:
        session_settings(cfg(text))
    assert caught.value.field == field
    assert message in caught.value.detail


@pytest.mark.parametrize(
    ("providers", "expected"),
    [
        ([("CPUExecutionProvider", {})], {"memory.enable_memory_arena_shrinkage": "cpu:0"}),
        ([("CUDAExecutionProvider", {"device_id": "1"}), ("CPUExecutionProvider", {})],
         {"memory.enable_memory_arena_shrinkage": "cpu:0;gpu:1"}),
        ([("TensorrtExecutionProvider", {"device_id": "2"}), ("CUDAExecutionProvider", {"device_id": "2"})],
         {"memory.enable_memory_arena_shrinkage": "cpu:0"}),
    ],
)  # fmt: skip
def test_each_instance_shrinks_only_the_arenas_its_session_has(providers, expected):
    """onnxruntime fails every run whose shrink list names an arena the session lacks ("gpu:1" on a CPU instance
    or on GPU 0); the entries for other devices belong to the instances there."""
    settings = session_settings(cfg(param("memory.enable_memory_arena_shrinkage", "cpu:0;gpu:1")))
    assert run_config(settings, providers) == expected
    assert run_config(session_settings(cfg(param("memory.enable_memory_arena_shrinkage", "gpu:1"))),
                      [("CPUExecutionProvider", {})]) == {}  # fmt: skip
    assert run_config(SessionSettings(), providers) == {}


def test_session_options_hold_the_settings():
    """The thin builder, on the real onnxruntime.SessionOptions."""
    settings = SessionSettings(
        intra_op_threads=2, inter_op_threads=3, parallel=True, graph_level="ORT_ENABLE_BASIC", cpu_mem_arena=False,
        mem_pattern=False, config_entries=(("session.use_device_allocator_for_initializers", "1"),),
    )  # fmt: skip
    options = session_options(onnxruntime, settings)
    assert (options.intra_op_num_threads, options.inter_op_num_threads) == (2, 3)
    assert options.execution_mode == onnxruntime.ExecutionMode.ORT_PARALLEL
    assert options.graph_optimization_level == onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC
    assert (options.enable_cpu_mem_arena, options.enable_mem_pattern) == (False, False)
    assert options.get_session_config_entry("session.use_device_allocator_for_initializers") == "1"
    defaults = session_options(onnxruntime, SessionSettings())
    assert defaults.execution_mode == onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    assert defaults.graph_optimization_level == onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert (defaults.enable_cpu_mem_arena, defaults.enable_mem_pattern) == (True, True)


@pytest.mark.parametrize("binding", [None, Binding("cpu", 0)], ids=["run", "io-binding"])
def test_the_run_options_reach_onnxruntime(binding):
    """The instance's run config goes to every run: a shrink list onnxruntime accepts on a CPU session ("cpu:0")
    serves; one naming an arena the session lacks is refused by onnxruntime itself, which shows it got there."""
    config = cfg('max_batch_size: 8 input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [4] }, '
                 '{ name: "INPUT1" data_type: TYPE_FP32 dims: [4] } ] '
                 'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [4] } ]')  # fmt: skip
    session = onnxruntime.InferenceSession(_batched_add_sub(), providers=["CPUExecutionProvider"])
    x = np.ones((2, 4), dtype=np.float32)
    request = InferRequest("add_sub", "1", [Tensor("INPUT0", "FP32", x), Tensor("INPUT1", "FP32", x)], id="0",
                           batch_size=2)  # fmt: skip
    cpu = [("CPUExecutionProvider", {})]
    shrink = "memory.enable_memory_arena_shrinkage"
    served = OnnxInstance(session, config, "add_sub:1", cpu, binding=binding, run_config={shrink: "cpu:0"})
    (result,) = served.execute([request])
    assert isinstance(result, InferResponse), result
    np.testing.assert_array_equal(result.outputs[0].data, x + x)
    refused = OnnxInstance(session, config, "add_sub:1", cpu, binding=binding, run_config={shrink: "gpu:0"})
    (error,) = refused.execute([request])
    assert isinstance(error, SluiceError)
    assert "memory arena shrink list: gpu:0" in error.message


def test_session_options_through_the_server(tmp_path, serve, caplog, mlp_session):
    """Triton's onnxruntime parameters on a served model: it serves what onnxruntime computes, the shrink list's
    gpu entry is left out of the CPU instance's runs (onnxruntime would fail each of them), and the option
    Sluice does not carry out is named in a warning."""
    repo = tmp_path / "repo"
    write_model(
        repo, "mlp", 'backend: "onnxruntime"\nmax_batch_size: 8\ninstance_group [ { kind: KIND_CPU count: 2 } ]\n'
        "optimization { graph { level: 1 } }\n"
        + param("execution_mode", "1") + param("inter_op_thread_count", "2") + param("enable_mem_pattern", "0")
        + param("enable_mem_arena", "1") + param("session.use_device_allocator_for_initializers", "1")
        + param("memory.enable_memory_arena_shrinkage", "cpu:0;gpu:0")
        + param("share_session_between_instances", "true"),
        {"model.onnx": BUILDERS.mlp_model()},
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="sluice"):
        server = serve(repo)
    client = httpclient.InferenceServerClient(server.http)
    x = np.random.default_rng(2).standard_normal((3, 16)).astype(np.float32)
    for _ in range(3):
        inputs = [httpclient.InferInput("INPUT0", [3, 16], "FP32")]
        inputs[0].set_data_from_numpy(x)
        np.testing.assert_allclose(
            client.infer("mlp", inputs).as_numpy("OUTPUT0"), mlp_session.run(None, {"INPUT0": x})[0], rtol=1e-5,
            atol=1e-6,
        )  # fmt: skip
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("model 'mlp' version 1: parameters[share_session_between_instances]: not supported" in w
               for w in warnings), warnings  # fmt: skip
    assert not any("optimization.graph" in w for w in warnings), warnings  # applied: no "not implemented" warning


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (param("execution_mode", "2"),
         "field 'parameters[execution_mode]': execution_mode is '2'; allowed: \"0\" (sequential"),
        (param("enable_mem_arena", "maybe"), "field 'parameters[enable_mem_arena]': 'maybe' is not a boolean"),
        (param("memory.enable_memory_arena_shrinkage", "disk:0"),
         "field 'parameters[memory.enable_memory_arena_shrinkage]': 'disk:0' names no memory arena"),
    ],
)  # fmt: skip
def test_a_bad_session_option_fails_the_load_through_the_server(tmp_path, serve, text, expected):
    """These parameters used to be ignored whatever their value."""
    repo = tmp_path / "repo"
    write_model(repo, "mlp", 'backend: "onnxruntime"\nmax_batch_size: 8\n' + text, {"model.onnx": BUILDERS.mlp_model()})
    server = serve(repo, **EXPLICIT)
    client = httpclient.InferenceServerClient(server.http)
    with pytest.raises(InferenceServerException) as caught:
        client.load_model("mlp")
    assert caught.value.status() == "400"
    assert expected in caught.value.message()
    assert not client.is_model_ready("mlp")


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


@needs_cuda_ep
def test_a_cuda_option_onnxruntime_does_not_know_fails_the_load_with_its_message(tmp_path, serve):
    """Unknown cuda keys go to onnxruntime as strings; it refuses them when the session is made, and the load
    fails with its text as a config error."""
    repo = tmp_path / "repo"
    write_model(
        repo, "mlp", 'backend: "onnxruntime"\nmax_batch_size: 8\ninstance_group [ { kind: KIND_GPU } ]\n'
        + gpu_accelerator("cuda", not_a_cuda_option="1"),
        {"model.onnx": BUILDERS.mlp_model()},
    )  # fmt: skip
    server = serve(repo, **EXPLICIT)
    with pytest.raises(InferenceServerException) as caught:
        httpclient.InferenceServerClient(server.http).load_model("mlp")
    assert caught.value.status() == "400"
    assert "not_a_cuda_option" in caught.value.message()


@needs_cuda_ep
def test_a_gpu_instance_shrinks_its_gpu_arena_and_serves(tmp_path, serve, mlp_session):
    repo = tmp_path / "repo"
    write_model(
        repo, "mlp", 'backend: "onnxruntime"\nmax_batch_size: 8\ninstance_group [ { kind: KIND_GPU gpus: [ 0 ] } ]\n'
        + param("memory.enable_memory_arena_shrinkage", "cpu:0;gpu:0"),
        {"model.onnx": BUILDERS.mlp_model()},
    )  # fmt: skip
    server = serve(repo)
    x = np.random.default_rng(3).standard_normal((4, 16)).astype(np.float32)
    client = httpclient.InferenceServerClient(server.http)
    for _ in range(2):
        inputs = [httpclient.InferInput("INPUT0", [4, 16], "FP32")]
        inputs[0].set_data_from_numpy(x)
        np.testing.assert_allclose(client.infer("mlp", inputs).as_numpy("OUTPUT0"),
                                   mlp_session.run(None, {"INPUT0": x})[0], rtol=1e-3, atol=1e-4)  # fmt: skip


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
