"""ONNX Runtime backend: execution-provider choice (pure), thread parameters, batching through a real server."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from sluice.runtime.backends.onnxrt import providers_for
from sluice.runtime.errors import Unavailable

from .conftest import BUILDERS, EXPLICIT, write_model  # type: ignore[import-not-found]

CPU = ["CPUExecutionProvider"]
CUDA = ["CUDAExecutionProvider", "CPUExecutionProvider"]
TRT = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
K = mc.ModelInstanceGroup
CPU_EP = ("CPUExecutionProvider", {})


def cfg(text: str = "") -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


@pytest.mark.parametrize(
    ("kind", "available", "config", "expected"),
    [
        (K.KIND_CPU, CUDA, "", [CPU_EP]),
        (K.KIND_AUTO, CPU, "", [CPU_EP]),
        (K.KIND_AUTO, CUDA, "", [("CUDAExecutionProvider", {"device_id": "1"}), CPU_EP]),
        (K.KIND_GPU, CUDA, "", [("CUDAExecutionProvider", {"device_id": "1"}), CPU_EP]),
        (
            K.KIND_GPU,
            TRT,
            'parameters { key: "execution_accelerator" value { string_value: "tensorrt" } }',
            [
                ("TensorrtExecutionProvider", {"device_id": "1"}),
                ("CUDAExecutionProvider", {"device_id": "1"}),
                CPU_EP,
            ],
        ),
        (
            K.KIND_GPU,
            TRT,
            "optimization { execution_accelerators { gpu_execution_accelerator { name: 'tensorrt' } } }",
            [
                ("TensorrtExecutionProvider", {"device_id": "1"}),
                ("CUDAExecutionProvider", {"device_id": "1"}),
                CPU_EP,
            ],
        ),
        # TensorRT asked for on a CPU instance: ignored, as in Triton
        (
            K.KIND_CPU,
            TRT,
            'parameters { key: "execution_accelerator" value { string_value: "tensorrt" } }',
            [CPU_EP],
        ),
    ],
)
def test_providers_for_instance_kinds(kind, available, config, expected):
    assert providers_for(kind, 1, cfg(config), available) == expected


@pytest.mark.parametrize(
    "config",
    [
        'parameters { key: "execution_accelerator" value { string_value: "tensorrt" } }',
        "optimization { execution_accelerators { gpu_execution_accelerator { name: 'tensorrt' } } }",
    ],
)
@pytest.mark.parametrize("kind", [K.KIND_GPU, K.KIND_AUTO])
def test_tensorrt_asked_for_without_the_tensorrt_provider_fails_the_load_like_triton(config, kind):
    """It used to run on CUDA alone, silently; Triton fails the load when it cannot add the TensorRT provider."""
    with pytest.raises(Unavailable, match=r"needs onnxruntime with the TensorRT execution provider.*remove the acc"):
        providers_for(kind, 1, cfg(config), CUDA)


def test_gpu_instance_without_cuda_build_is_a_clear_error():
    with pytest.raises(Unavailable, match=r"KIND_GPU needs onnxruntime with the CUDA execution provider.*gpu"):
        providers_for(K.KIND_GPU, 0, cfg(), CPU)


def test_gpu_model_without_cuda_fails_its_load_only(tmp_path, serve):
    repo = tmp_path / "repo"
    write_model(
        repo, "gpu_mlp", 'name: "gpu_mlp"\nbackend: "onnxruntime"\nmax_batch_size: 8\n'
        "instance_group [ { kind: KIND_GPU } ]\n", {"model.onnx": BUILDERS.mlp_model()},
    )  # fmt: skip
    write_model(
        repo, "mlp", 'name: "mlp"\nbackend: "onnxruntime"\nmax_batch_size: 8\n', {"model.onnx": BUILDERS.mlp_model()}
    )
    server = serve(repo)
    client = httpclient.InferenceServerClient(server.http)
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this machine's onnxruntime has CUDA; the GPU model loads")
    assert client.is_model_ready("mlp")
    assert not client.is_model_ready("gpu_mlp")
    row = {r["name"]: r for r in client.get_model_repository_index()}["gpu_mlp"]
    assert "CUDA execution provider" in row["reason"]


def mlp_load_error(tmp_path, serve, config_tail: str) -> str:
    """The message of an explicit load of the MLP whose config.pbtxt ends with ``config_tail`` (line 4 on)."""
    repo = tmp_path / "repo"
    write_model(repo, "mlp", 'name: "mlp"\nbackend: "onnxruntime"\nmax_batch_size: 8\n' + config_tail,
                {"model.onnx": BUILDERS.mlp_model()})
    server = serve(repo, **EXPLICIT)
    with pytest.raises(InferenceServerException) as info:
        httpclient.InferenceServerClient(server.http).load_model("mlp")
    return str(info.value)


def test_bad_thread_parameter_names_file_line_field_and_what_is_allowed(tmp_path, serve):
    """The parameter is read when the session opens, after the config was validated; the error
    still points at the entry's line in config.pbtxt (found by its key, not the first entry's)."""
    message = mlp_load_error(
        tmp_path, serve, 'parameters { key: "inter_op_thread_count" value { string_value: "1" } }\n'
        "parameters { key: 'intra_op_thread_count' value { string_value: \"many\" } }\n",
    )
    assert "mlp/config.pbtxt:5:1: field 'parameters[intra_op_thread_count]': 'many' is not an integer" in message
    assert 'allowed: a whole number as its string_value, such as "4"' in message
    assert str(tmp_path) not in message  # the server's paths stay with the server


def test_a_config_that_contradicts_the_model_file_names_the_config_line(tmp_path, serve):
    """The ONNX file's own tensors check the config after it is read: the error still points at the
    field's line (it named only "model 'mlp'"), as config errors do."""
    message = mlp_load_error(tmp_path, serve, 'input [ { name: "INPUT0", data_type: TYPE_INT32, dims: [ 4 ] } ]\n')
    assert "mlp/config.pbtxt:4:" in message and "field 'input[0].data_type'" in message, message
    assert "TYPE_INT32 in the config but the model declares TYPE_FP32" in message


@pytest.mark.parametrize(("key", "value", "words"), [
    ("intra_op_thread_count", "99999999999", "99999999999 is more than 1024"),  # onnxruntime's own TypeError
    ("inter_op_thread_count", "\u00b2", "'\u00b2' is not an integer"),
])
def test_out_of_range_thread_counts_are_config_errors(tmp_path, serve, key, value, words):
    message = mlp_load_error(tmp_path, serve, f'parameters {{ key: "{key}" value {{ string_value: "{value}" }} }}\n')
    assert f"mlp/config.pbtxt:4:1: field 'parameters[{key}]': {words}" in message, message
    assert "0x" not in message and "SessionOptions" not in message


def test_output_reshape_serves_the_config_dims(tmp_path, serve, mlp_session):
    """The model produces [-1, 4]; the config serves it as [-1, 2, 2] via reshape."""
    repo = tmp_path / "repo"
    write_model(
        repo, "mlp", 'name: "mlp"\nbackend: "onnxruntime"\nmax_batch_size: 8\n'
        'input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 16 ] } ]\n'
        'output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 2, 2 ], reshape: { shape: [ 4 ] } } ]\n',
        {"model.onnx": BUILDERS.mlp_model()},
    )  # fmt: skip
    server = serve(repo)
    client = httpclient.InferenceServerClient(server.http)
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    inp = httpclient.InferInput("INPUT0", [3, 16], "FP32")
    inp.set_data_from_numpy(x)
    out = client.infer("mlp", [inp]).as_numpy("OUTPUT0")
    assert out.shape == (3, 2, 2)
    np.testing.assert_allclose(out.reshape(3, 4), mlp_session.run(None, {"INPUT0": x})[0], rtol=1e-5, atol=1e-6)


def _shapeless_identity() -> bytes:
    """An ONNX Identity whose input and output declare a type but no shape at all."""
    import onnx
    from onnx import helper

    x = helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, None)
    y = helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, None)
    graph = helper.make_graph([helper.make_node("Identity", ["X"], ["Y"])], "shapeless", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


@pytest.mark.parametrize(("max_batch_size", "dims", "shape"), [(8, [4], [3, 4]), (0, [2, 3], [2, 3])])
def test_an_onnx_tensor_without_a_declared_shape_takes_the_configs_dims(tmp_path, serve, max_batch_size, dims, shape):
    """It used to be read as a scalar, so a config with dims (and batching) failed to load."""
    repo = tmp_path / "repo"
    write_model(
        repo,
        "shapeless",
        f"""
        backend: "onnxruntime"
        max_batch_size: {max_batch_size}
        input [ {{ name: "X", data_type: TYPE_FP32, dims: {dims} }} ]
        output [ {{ name: "Y", data_type: TYPE_FP32, dims: {dims} }} ]
        """,
        {"model.onnx": _shapeless_identity()},
    )
    server = serve(repo)
    client = httpclient.InferenceServerClient(server.http)
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    inp = httpclient.InferInput("X", shape, "FP32")
    inp.set_data_from_numpy(x)
    np.testing.assert_array_equal(client.infer("shapeless", [inp]).as_numpy("Y"), x)
    # the config's dims are enforced like any other model's
    bad = httpclient.InferInput("X", [*shape[:-1], 5], "FP32")
    bad.set_data_from_numpy(np.zeros([*shape[:-1], 5], dtype=np.float32))
    with pytest.raises(InferenceServerException) as info:
        client.infer("shapeless", [bad])
    assert info.value.status() == "400"
