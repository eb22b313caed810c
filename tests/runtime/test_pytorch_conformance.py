"""PyTorch backend conformance: what a user moving a Triton ``pytorch_libtorch`` repository expects.

Every case goes through the real server with tritonclient (HTTP and gRPC): Triton's naming
conventions (``INPUT__0``, ``input__0``, any ``<name>__<index>``, forward() argument names),
results as a tensor / tuple / list, outputs declared in another order or fewer than returned,
every data type the backend serves, the ``parameters`` Triton documents, bad requests and
models that fail (the server keeps serving), and the load errors a broken repository gets
(the model file named relative to the repository). Models are built here with torch.jit.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from sluice.runtime.backends import torch_plan
from sluice.runtime.errors import ConfigError

from .conftest import EXPLICIT, start_server, write_model  # type: ignore[import-not-found]
from .test_pytorch_backend import infer, load_error, scripted  # type: ignore[import-not-found]

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")


# --- models ---------------------------------------------------------------------------------------


class WeightedSub(torch.nn.Module):
    """Not symmetric in its arguments, so a wrong binding shows in the result."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a - 10 * b, a + b


class Three(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return x + 1, x + 2, x + 3


class ListOut(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x * 2, x * 3]


class Single(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 5


class Twice(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + x


class Negate(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.logical_not(x)


class ToLong(torch.nn.Module):
    """Returns int64 whatever it is fed: a model whose output type disagrees with an FP32 config."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.long()


class Raises(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x.min() < 0):
            raise RuntimeError("negative input")
        return x.sqrt()


class RowSum(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=-1, keepdim=True)


def io(name: str, data_type: str, dims: str) -> str:
    return f'{{ name: "{name}", data_type: {data_type}, dims: [ {dims} ] }}'


def config(inputs: list[str], outputs: list[str], max_batch_size: int = 0, extra: str = "") -> str:
    return (
        f'platform: "pytorch_libtorch"\nmax_batch_size: {max_batch_size}\n'
        f"input [ {', '.join(inputs)} ]\noutput [ {', '.join(outputs)} ]\n{extra}\n"
    )


# --- clients --------------------------------------------------------------------------------------


def status_of(error: InferenceServerException) -> str:
    return str(error.status())


BOTH = pytest.mark.parametrize("protocol", ["http", "grpc"])


# --- one server, many models ----------------------------------------------------------------------


FP = "TYPE_FP32"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("conformance")
    repo = tmp / "repo"
    sub = scripted(WeightedSub(), tmp / "sub.pt")
    models: dict[str, tuple[str, bytes]] = {
        # Triton's documented convention, lower case
        "lower_index": (config([io("input__0", FP, "4"), io("input__1", FP, "4")],
                               [io("output__0", FP, "4"), io("output__1", FP, "4")]), sub),
        # any <name>__<index>, listed out of order: bound by index, not by config position
        "any_index": (config([io("mask__1", FP, "4"), io("image__0", FP, "4")],
                             [io("diff__0", FP, "4")], 4), sub),
        # outputs declared in another order than returned
        "outputs_swapped": (config([io("INPUT__0", FP, "4"), io("INPUT__1", FP, "4")],
                                   [io("OUTPUT__1", FP, "4"), io("OUTPUT__0", FP, "4")], 4), sub),
        # forward() names bind whatever the config order
        "by_argument": (config([io("b", FP, "4"), io("a", FP, "4")], [io("OUT__0", FP, "4")]), sub),
        # neither convention: the config's order
        "config_order": (config([io("first", FP, "4"), io("second", FP, "4")],
                                [io("x", FP, "4"), io("y", FP, "4")]), sub),
        # the model returns three, the config takes the last one only
        "fewer_declared": (config([io("INPUT__0", FP, "4")], [io("OUTPUT__2", FP, "4")], 4),
                           scripted(Three(), tmp / "three.pt")),
        "list_result": (config([io("INPUT__0", FP, "4")], [io("OUTPUT__0", FP, "4"), io("OUTPUT__1", FP, "4")], 4),
                        scripted(ListOut(), tmp / "list.pt")),
        # declares an output the model does not return
        "missing_output": (config([io("INPUT__0", FP, "4")], [io("OUTPUT__0", FP, "4"), io("OUTPUT__1", FP, "4")]),
                           scripted(Single(), tmp / "single.pt")),
        "wrong_type_out": (config([io("INPUT__0", FP, "4")], [io("OUTPUT__0", FP, "4")]),
                           scripted(ToLong(), tmp / "long.pt")),
        "raises": (config([io("INPUT__0", FP, "4")], [io("OUTPUT__0", FP, "4")], 4),
                   scripted(Raises(), tmp / "raises.pt")),
        # a dynamic non-batch dim, batched
        "row_sum": (config([io("INPUT__0", FP, "-1")], [io("OUTPUT__0", FP, "1")], 8, "dynamic_batching { }"),
                    scripted(RowSum(), tmp / "rowsum.pt")),
        # reshape: clients send [6], the model sees [2, 3] and answers [2, 1], clients get [2]
        "reshaped": (config([io("INPUT__0", FP, "6") + " ", ],
                            [io("OUTPUT__0", FP, "2")], 4).replace(
                                'dims: [ 6 ] }', 'dims: [ 6 ], reshape: { shape: [ 2, 3 ] } }').replace(
                                'dims: [ 2 ] }', 'dims: [ 2 ], reshape: { shape: [ 2, 1 ] } }'),
                     scripted(RowSum(), tmp / "rowsum2.pt")),
    }  # fmt: skip
    twice = scripted(Twice(), tmp / "twice.pt")
    for type_name in ("FP16", "BF16", "FP64", "INT8", "UINT8", "INT16", "INT32", "INT64"):
        models[f"twice_{type_name.lower()}"] = (
            config([io("INPUT__0", f"TYPE_{type_name}", "3")], [io("OUTPUT__0", f"TYPE_{type_name}", "3")], 4),
            twice,
        )
    models["negate_bool"] = (
        config([io("INPUT__0", "TYPE_BOOL", "3")], [io("OUTPUT__0", "TYPE_BOOL", "3")], 4),
        scripted(Negate(), tmp / "negate.pt"),
    )
    for name, (text, model) in models.items():
        write_model(repo, name, text, {"model.pt": model})
    handle = start_server(repo)
    yield handle
    handle.stop()


def rows(n: int, width: int = 4, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)


# --- 1. naming conventions and result shapes ----------------------------------------------------------


@BOTH
def test_lower_case_index_names_bind_by_index(server, protocol):
    a, b = rows(1)[0], rows(1, seed=1)[0]
    result = infer(protocol, server, "lower_index", {"input__0": a, "input__1": b})
    np.testing.assert_allclose(result.as_numpy("output__0"), a - 10 * b, rtol=1e-6)
    np.testing.assert_allclose(result.as_numpy("output__1"), a + b, rtol=1e-6)


@BOTH
def test_any_name_with_an_index_suffix_binds_by_the_index_not_the_config_position(server, protocol):
    image, mask = rows(2), rows(2, seed=1)
    result = infer(protocol, server, "any_index", {"mask__1": mask, "image__0": image})
    np.testing.assert_allclose(result.as_numpy("diff__0"), image - 10 * mask, rtol=1e-6)


@BOTH
def test_outputs_declared_in_another_order_are_picked_by_index(server, protocol):
    a, b = rows(3), rows(3, seed=1)
    result = infer(protocol, server, "outputs_swapped", {"INPUT__0": a, "INPUT__1": b})
    np.testing.assert_allclose(result.as_numpy("OUTPUT__0"), a - 10 * b, rtol=1e-6)
    np.testing.assert_allclose(result.as_numpy("OUTPUT__1"), a + b, rtol=1e-6)


@BOTH
def test_forward_argument_names_and_config_order(server, protocol):
    a, b = rows(1)[0], rows(1, seed=1)[0]
    by_name = infer(protocol, server, "by_argument", {"a": a, "b": b})
    np.testing.assert_allclose(by_name.as_numpy("OUT__0"), a - 10 * b, rtol=1e-6)
    ordered = infer(protocol, server, "config_order", {"first": a, "second": b})
    np.testing.assert_allclose(ordered.as_numpy("x"), a - 10 * b, rtol=1e-6)
    np.testing.assert_allclose(ordered.as_numpy("y"), a + b, rtol=1e-6)


@BOTH
def test_a_model_returning_more_outputs_than_declared_serves_the_declared_ones(server, protocol):
    x = rows(2)
    result = infer(protocol, server, "fewer_declared", {"INPUT__0": x})
    np.testing.assert_allclose(result.as_numpy("OUTPUT__2"), x + 3, rtol=1e-6)
    assert result.as_numpy("OUTPUT__0") is None


@BOTH
def test_a_list_of_tensors_is_served_like_a_tuple(server, protocol):
    x = rows(2)
    result = infer(protocol, server, "list_result", {"INPUT__0": x})
    np.testing.assert_allclose(result.as_numpy("OUTPUT__0"), x * 2, rtol=1e-6)
    np.testing.assert_allclose(result.as_numpy("OUTPUT__1"), x * 3, rtol=1e-6)


@BOTH
def test_an_output_the_model_does_not_return_is_a_clear_error_and_the_model_keeps_serving(server, protocol):
    x = rows(1)[0]
    with pytest.raises(InferenceServerException) as info:
        infer(protocol, server, "missing_output", {"INPUT__0": x})
    assert "output 'OUTPUT__1' refers to output index 1, but the model returned 1 output" in str(info.value)
    assert status_of(info.value) in ("500", "StatusCode.INTERNAL")
    with pytest.raises(InferenceServerException):  # every call: the config asks for what the model lacks
        infer(protocol, server, "missing_output", {"INPUT__0": x})
    result = infer(protocol, server, "lower_index", {"input__0": x, "input__1": x})
    np.testing.assert_allclose(result.as_numpy("output__1"), 2 * x, rtol=1e-6)


# --- 2. data types -----------------------------------------------------------------------------------


NUMPY_OF = {
    "FP16": np.float16, "FP64": np.float64, "INT8": np.int8, "UINT8": np.uint8,
    "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
}  # fmt: skip


@BOTH
@pytest.mark.parametrize("type_name", sorted(NUMPY_OF))
def test_numeric_types_round_trip(server, protocol, type_name):
    x = np.array([[1, 2, 3], [4, 5, 60]], dtype=NUMPY_OF[type_name])
    result = infer(protocol, server, f"twice_{type_name.lower()}", {"INPUT__0": x}, {"INPUT__0": type_name})
    got = result.as_numpy("OUTPUT__0")
    assert got.dtype == np.dtype(NUMPY_OF[type_name])
    np.testing.assert_array_equal(got, x + x)


@BOTH
def test_bf16_round_trips(server, protocol):
    x = np.array([[1.5, -2.25, 3.0]], dtype=ml_dtypes.bfloat16)
    result = infer(protocol, server, "twice_bf16", {"INPUT__0": x}, {"INPUT__0": "BF16"})
    got = np.asarray(result.as_numpy("OUTPUT__0")).astype(np.float32)
    np.testing.assert_array_equal(got, np.array([[3.0, -4.5, 6.0]], dtype=np.float32))


@BOTH
def test_bool_round_trips(server, protocol):
    x = np.array([[True, False, True]])
    result = infer(protocol, server, "negate_bool", {"INPUT__0": x}, {"INPUT__0": "BOOL"})
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__0"), ~x)


@BOTH
def test_an_output_of_another_type_than_the_config_says_is_refused_per_request(server, protocol):
    x = np.array([1.5, 2.0, 3.0, 4.0], dtype=np.float32)
    with pytest.raises(InferenceServerException) as info:
        infer(protocol, server, "wrong_type_out", {"INPUT__0": x})
    message = str(info.value)
    assert "configuration expects datatype TYPE_FP32 for output 'OUTPUT__0', model provides TYPE_INT64" in message
    assert status_of(info.value) in ("500", "StatusCode.INTERNAL")


# --- 4. bad requests, failing models -------------------------------------------------------------------


@BOTH
def test_bad_requests_are_refused_and_the_model_keeps_serving(server, protocol):
    good = rows(2)
    cases = [
        ({"INPUT__0": rows(2, width=5)}, None, r"unexpected shape for input 'INPUT__0'"),
        ({"INPUT__0": good.astype(np.float64)}, {"INPUT__0": "FP64"}, r"is 'FP64', but model 'raises' expects 'FP32'"),
        ({"INPUT__0": rows(5)}, None, r"(?i)batch.size|max"),
        ({"WRONG": good}, None, r"WRONG"),
    ]
    for arrays, datatypes, pattern in cases:
        with pytest.raises(InferenceServerException, match=pattern) as info:
            infer(protocol, server, "raises", arrays, datatypes)
        assert status_of(info.value) in ("400", "StatusCode.INVALID_ARGUMENT"), info.value
    result = infer(protocol, server, "raises", {"INPUT__0": np.abs(good)})
    np.testing.assert_allclose(result.as_numpy("OUTPUT__0"), np.sqrt(np.abs(good)), rtol=1e-6)


@BOTH
def test_an_exception_inside_forward_is_500_with_the_models_text_and_the_next_request_works(server, protocol):
    with pytest.raises(InferenceServerException) as info:
        infer(protocol, server, "raises", {"INPUT__0": -np.ones((1, 4), np.float32)})
    message = str(info.value)
    assert "PyTorch failed to run model 'raises:1': RuntimeError: negative input" in message
    assert "Traceback" not in message and ".py" not in message
    assert status_of(info.value) in ("500", "StatusCode.INTERNAL")
    result = infer(protocol, server, "raises", {"INPUT__0": np.full((1, 4), 4, np.float32)})
    np.testing.assert_allclose(result.as_numpy("OUTPUT__0"), np.full((1, 4), 2, np.float32))


# --- 5. batching, dynamic dims, reshape ----------------------------------------------------------------


@BOTH
def test_dynamic_non_batch_dims_and_reshape(server, protocol):
    for width in (2, 7):
        x = rows(3, width=width)
        result = infer(protocol, server, "row_sum", {"INPUT__0": x})
        np.testing.assert_allclose(result.as_numpy("OUTPUT__0"), x.sum(axis=1, keepdims=True), rtol=1e-5)
    x = rows(2, width=6)
    result = infer(protocol, server, "reshaped", {"INPUT__0": x})
    got = result.as_numpy("OUTPUT__0")
    assert got.shape == (2, 2)
    np.testing.assert_allclose(got, x.reshape(2, 2, 3).sum(axis=-1), rtol=1e-5)


def test_requests_of_different_widths_are_not_merged_into_one_batch(server):
    from concurrent.futures import ThreadPoolExecutor

    def call(i: int) -> tuple[int, np.ndarray]:
        x = rows(1 + i % 3, width=2 + i % 4, seed=i)
        return i, infer("http" if i % 2 else "grpc", server, "row_sum", {"INPUT__0": x}).as_numpy("OUTPUT__0")

    with ThreadPoolExecutor(8) as pool:
        for i, got in pool.map(call, range(16)):
            x = rows(1 + i % 3, width=2 + i % 4, seed=i)
            np.testing.assert_allclose(got, x.sum(axis=1, keepdims=True), rtol=1e-5)


# --- 3. parameters and load errors (explicit model control) --------------------------------------------


def parameter(key: str, value: str) -> str:
    return f'parameters {{ key: "{key}" value {{ string_value: "{value}" }} }}'


SIMPLE = config([io("INPUT__0", FP, "4")], [io("OUTPUT__0", FP, "4")], 4)


@pytest.mark.parametrize(
    "parameters",
    [
        [("DISABLE_OPTIMIZED_EXECUTION", "true"), ("INFERENCE_MODE", "false"), ("DISABLE_CUDNN", "true")],
        [("ENABLE_WEIGHT_SHARING", "true"), ("ENABLE_CACHE_CLEANING", "true"), ("ENABLE_NVFUSER", "false")],
        [("ENABLE_JIT_EXECUTOR", "false"), ("ENABLE_JIT_PROFILING", "false"), ("ENABLE_TENSOR_FUSER", "false")],
    ],
    ids=["modes", "sharing-cache-nvfuser", "jit-switches"],
)
def test_tritons_parameters_are_accepted_and_the_model_serves(tmp_path, serve, parameters):
    repo = tmp_path / "repo"
    extra = "\n".join(parameter(k, v) for k, v in parameters) + "\ninstance_group [ { kind: KIND_CPU count: 2 } ]"
    write_model(repo, "m", SIMPLE + extra, {"model.pt": scripted(Single(), tmp_path / "s.pt")})
    running = serve(repo)
    x = rows(2)
    for protocol in ("http", "grpc"):
        np.testing.assert_allclose(infer(protocol, running, "m", {"INPUT__0": x}).as_numpy("OUTPUT__0"), x * 5)
    # the server runs in this process: a CPU instance leaves the process-wide cuDNN switch alone
    assert torch.backends.cudnn.enabled


def with_bad_pickle(archive: bytes) -> bytes:
    """The TorchScript archive with its data.pkl replaced: a zip torch recognizes but cannot read."""
    import io as bytes_io
    import zipfile

    source, out = zipfile.ZipFile(bytes_io.BytesIO(archive)), bytes_io.BytesIO()
    with zipfile.ZipFile(out, "w") as target:
        for name in source.namelist():
            target.writestr(name, b"junk" if name.endswith("/data.pkl") else source.read(name))
    return out.getvalue()


@pytest.mark.parametrize(
    ("extra", "files", "message"),
    [
        (parameter("ENABLE_WEIGHT_SHARING", "maybe"), "ok",
         r"config.pbtxt:6:1: field 'parameters\[ENABLE_WEIGHT_SHARING\]': must be 'true' or 'false', got 'maybe'"),
        (parameter("INTER_OP_THREAD_COUNT", "-2"), "ok",
         r"config.pbtxt:6:1: field 'parameters\[INTER_OP_THREAD_COUNT\]': must be a positive integer string, got '-2'"),
        ("", "garbage", r"bad/1/model.pt: field 'default_model_filename': 'model.pt' is not a model torch can load"),
        ("", "truncated", r"bad/1/model.pt"),
        ("", "bad-pickle", r"bad/1/model.pt: torch.jit.load cannot load the model: Expected PROTO opcode"),
        ("", "none", r"model file not found: bad/1/model.pt \(allowed: model.pt or model.pt2"),
        ('default_model_filename: "net.pt"', "ok", r"model file not found: bad/1/net.pt"),
    ],
    ids=["bad-bool", "bad-threads", "garbage-file", "truncated-file", "bad-pickle", "no-file", "named-file-missing"],
)  # fmt: skip
def test_broken_models_fail_the_load_with_the_file_relative_to_the_repository(tmp_path, serve, extra, files, message):
    repo = tmp_path / "repo"
    good = scripted(Single(), tmp_path / "s.pt")
    content = {"ok": {"model.pt": good}, "garbage": {"model.pt": b"\x00garbage"},
               "truncated": {"model.pt": good[: len(good) // 2]}, "none": {},
               "bad-pickle": {"model.pt": with_bad_pickle(good)}}[files]  # fmt: skip
    write_model(repo, "bad", SIMPLE + extra, content)
    write_model(repo, "good", SIMPLE, {"model.pt": good})
    running = serve(repo, model_control_mode="explicit", load_models=("good",))
    error = load_error(running, "bad")
    assert "failed to load 'bad'" in error
    assert str(tmp_path) not in error and str(repo.resolve()) not in error
    assert re.search(message, error), error
    x = rows(1)
    np.testing.assert_allclose(infer("grpc", running, "good", {"INPUT__0": x}).as_numpy("OUTPUT__0"), x * 5)


# --- 2. strings: TorchScript List[str], one dimension ---------------------------------------------------


class Lengths(torch.nn.Module):
    def forward(self, words: list[str]) -> torch.Tensor:
        return torch.tensor([len(w) for w in words], dtype=torch.int64)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (config([io("INPUT__0", "TYPE_STRING", "2, 3")], [io("OUTPUT__0", "TYPE_INT64", "-1")]),
         r"config.pbtxt:\d+:\d+: field 'input\[0\].dims': input 'INPUT__0' is TYPE_STRING with 2 dimensions"),
        (config([io("INPUT__0", "TYPE_STRING", "-1")], [io("OUTPUT__0", "TYPE_INT64", "-1")], 4),
         r"field 'input\[0\].dims': .*allowed: one dimension in all \(with max_batch_size > 0: dims \[1\] and "
         r"reshape \{ shape: \[\] \}\)"),
    ],
    ids=["two-dims", "batched-without-reshape"],
)  # fmt: skip
def test_string_inputs_with_more_than_one_dimension_fail_the_load(tmp_path, serve, text, message):
    repo = tmp_path / "repo"
    write_model(repo, "bad", text, {"model.pt": scripted(Lengths(), tmp_path / "l.pt")})
    error = load_error(serve(repo, **EXPLICIT), "bad")
    assert re.search(message, error), error


@BOTH
def test_batched_string_input_with_reshape_serves(tmp_path_factory, protocol):
    tmp = tmp_path_factory.mktemp("strings")
    repo = tmp / "repo"
    text = config(
        [io("INPUT__0", "TYPE_STRING", "1").replace("] }", "], reshape: { shape: [ ] } }")],
        [io("OUTPUT__0", "TYPE_INT64", "1").replace("] }", "], reshape: { shape: [ ] } }")],
        4,
    )
    write_model(repo, "lengths", text, {"model.pt": scripted(Lengths(), tmp / "l.pt")})
    running = start_server(repo)
    try:
        words = np.array([[b"a"], [b"abc"], [b"abcde"]], dtype=object)
        result = infer(protocol, running, "lengths", {"INPUT__0": words}, {"INPUT__0": "BYTES"})
        np.testing.assert_array_equal(result.as_numpy("OUTPUT__0"), np.array([[1], [3], [5]], dtype=np.int64))
    finally:
        running.stop()


# --- pure decisions ------------------------------------------------------------------------------------


def test_output_dtype_problem_is_decided_without_torch():
    assert torch_plan.output_dtype_problem("o", "float32", 11, None) is None  # TYPE_FP32
    assert torch_plan.output_dtype_problem("o", "float16", 11, "float16") is None  # ran in fp16: cast back
    assert torch_plan.output_dtype_problem("o", "int64", 11, None) == (
        "configuration expects datatype TYPE_FP32 for output 'o', model provides TYPE_INT64"
    )
    assert torch_plan.output_dtype_problem("o", "int64", 11, "float16") is not None  # precision casts floats only
    assert "model provides torch.complex64" in (torch_plan.output_dtype_problem("o", "complex64", 11, None) or "")
    assert torch_plan.output_dtype_problem("o", torch_plan.STRING_LIST, 13, None) is None  # TYPE_STRING
    assert torch_plan.output_dtype_problem("o", torch_plan.STRING_LIST, 11, None) == (
        "configuration expects datatype TYPE_FP32 for output 'o', model provides TYPE_STRING (a List[str])"
    )
    assert "expects datatype TYPE_STRING for output 'o', model provides TYPE_INT64" in (
        torch_plan.output_dtype_problem("o", "int64", 13, None) or ""
    )


def test_a_load_error_shows_the_first_line_of_torchs_text():
    backtrace = RuntimeError("PytorchStreamReader failed locating file constants.pkl: file not found\n"
                             "Exception raised from getRecordID at /srv/venv/lib/libtorch_cpu.so")  # fmt: skip
    assert torch_plan.first_line(backtrace) == "PytorchStreamReader failed locating file constants.pkl: file not found"
    assert torch_plan.first_line(RuntimeError("")) == "RuntimeError"


def test_index_names_follow_triton_the_first_double_underscore_and_digits_only():
    assert torch_plan.input_binding(["a__b__1", "c__0"], None).convention == torch_plan.CONFIG_ORDER
    with pytest.raises(ConfigError):
        torch_plan.input_binding(["x__0", "y__0"], ["p", "q"])


# --- sequence batching: controls and implicit state passed by index, as Triton does -----------------


class Accumulate(torch.nn.Module):
    """A running sum over the sequence: START resets, the implicit state carries the sum."""

    def forward(self, x: torch.Tensor, start: torch.Tensor, acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total = x + acc * (1 - start.float())
        return total, total


SEQUENCE = """
platform: "pytorch_libtorch"
max_batch_size: 0
input [ { name: "x", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 1 ] } ]
sequence_batching {
  control_input [ { name: "START__1" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ]
  state [ { input_name: "ACC__2" output_name: "ACC__1" data_type: TYPE_FP32 dims: [ 1 ] } ]
}
"""


def test_sequence_controls_and_state_are_passed_by_index(tmp_path, serve):
    repo = tmp_path / "repo"
    write_model(repo, "acc", SEQUENCE, {"model.pt": scripted(Accumulate(), tmp_path / "acc.pt")})
    running = serve(repo)
    http = httpclient.InferenceServerClient(running.http)
    grpc = grpcclient.InferenceServerClient(running.grpc)
    try:
        totals = []
        for step, value in enumerate([1.0, 2.0, 4.0]):
            client, module = (http, httpclient) if step % 2 == 0 else (grpc, grpcclient)
            tensor = module.InferInput("x", [1], "FP32")
            tensor.set_data_from_numpy(np.array([value], np.float32))
            result = client.infer(
                "acc", [tensor], sequence_id=7, sequence_start=step == 0, sequence_end=step == 2,
                outputs=[module.InferRequestedOutput("OUTPUT__0")],
            )  # fmt: skip
            totals.append(float(result.as_numpy("OUTPUT__0")[0]))
        assert totals == [1.0, 3.0, 7.0]
    finally:
        http.close()
        grpc.close()


@pytest.mark.parametrize(
    ("replace", "message"),
    [
        (('name: "START__1"', 'name: "START"'),
         r"field 'sequence_batching.control_input\[0\].name': sequence input 'START' does not follow the "
         r"<name>__<index> convention"),
        (("ACC__2", "ACC__1"), r"'sequence_batching': sequence input 'ACC__1' names index 1 but 'START__1' has it"),
        (("dims: [ 1 ] } ]\noutput", 'dims: [ 1 ] }, { name: "EXTRA__3", data_type: TYPE_FP32, dims: [ 1 ] } ]\nout'
          "put"),
         r"field 'input': the config lists 2 inputs and 2 sequence control/state inputs but the model's forward\(\) "
         r"takes 3 \(x, start, acc\)"),
    ],
    ids=["control-without-index", "index-taken", "too-many-inputs"],
)  # fmt: skip
def test_sequence_inputs_that_cannot_be_bound_fail_the_load(tmp_path, serve, replace, message):
    repo = tmp_path / "repo"
    assert replace[0] in SEQUENCE
    write_model(repo, "acc", SEQUENCE.replace(*replace), {"model.pt": scripted(Accumulate(), tmp_path / "acc.pt")})
    error = load_error(serve(repo, **EXPLICIT), "acc")
    assert re.search(message, error), error


def test_sequence_io_is_decided_without_torch():
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    parsed = text_format.Parse(
        SEQUENCE.replace(
            "control_input [",
            'control_input [ { name: "CORRID__3" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] '
            "},",
        ),
        mc.ModelConfig(),
    )
    inputs, outputs = torch_plan.sequence_io(parsed)
    assert [(where, t.name, t.data_type, list(t.dims)) for where, t in inputs] == [
        ("sequence_batching.control_input[0]", "CORRID__3", mc.TYPE_UINT64, [1]),
        ("sequence_batching.control_input[1]", "START__1", mc.TYPE_INT32, [1]),
        ("sequence_batching.state[0]", "ACC__2", mc.TYPE_FP32, [1]),
    ]
    assert [o.name for o in outputs] == ["ACC__1"]
    with pytest.raises(ConfigError, match=r"sequence input 'CORRID__3' has data_type TYPE_UINT64") as info:
        torch_plan.check_io(parsed, torch_plan.TORCHSCRIPT)
    assert info.value.field == "sequence_batching.control_input[0].data_type"
