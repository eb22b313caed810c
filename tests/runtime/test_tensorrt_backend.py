"""TensorRT backend (``platform: tensorrt_plan``).

* Pure, on every machine: the datatype map, config completion and the IO check against an engine
  description, the profiles each instance may use, profile selection and batch splitting (tables and
  hypothesis properties).
* Through the real server, on every machine without TensorRT: a ``tensorrt_plan`` model fails its
  load with a 400 that says tensorrt is not installed and how to install it; the server goes on serving.
* With ``tensorrt`` importable and a CUDA GPU (skipped otherwise, saying which is missing): a tiny
  engine built here by TensorRT's builder from an ONNX model made with onnx.helper, served through
  tritonclient over HTTP and gRPC, with auto-complete, two optimization profiles and batch splitting.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import itertools
import shutil

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import text_format
from hypothesis import given
from hypothesis import strategies as st
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from sluice.runtime import cudart
from sluice.runtime.backends import tensorrt as trt_backend
from sluice.runtime.backends.tensorrt import Chunk, EngineInfo, EngineTensor, Range, plan_batches, select_profile
from sluice.runtime.errors import ConfigError, InvalidArgument, ModelError, Unsupported
from sluice.runtime.types import CONFIG_TYPE_BY_DATATYPE, InferRequest, InferResponse, Tensor

from .conftest import BUILDERS, EXPLICIT, write_model  # type: ignore[import-not-found]

K = mc.ModelInstanceGroup


def cfg(text: str = "") -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig(name="m", platform="tensorrt_plan"))


def engine(*profiles: tuple[tuple[int, int], tuple[int, int], tuple[int, int]], width: int = 4) -> EngineInfo:
    """x [-1, width] FLOAT -> y [-1, width] FLOAT, with the given (min, opt, max) batch dims per profile."""
    return EngineInfo(
        (EngineTensor("x", True, "FLOAT", (-1, width)), EngineTensor("y", False, "FLOAT", (-1, width))),
        tuple({"x": Range((lo, width), (opt, width), (hi, width))} for (lo, _), (opt, _), (hi, _) in profiles),
    )


def batch_profile(lo: int, opt: int, hi: int) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    return (lo, 0), (opt, 0), (hi, 0)


# -- datatypes ---------------------------------------------------------------------------------------


def test_every_mapped_tensorrt_type_has_a_config_type():
    assert {v: CONFIG_TYPE_BY_DATATYPE[v] for v in trt_backend.V2_BY_TRT.values()} == {
        "FP32": "TYPE_FP32", "FP16": "TYPE_FP16", "BF16": "TYPE_BF16", "INT8": "TYPE_INT8", "INT32": "TYPE_INT32",
        "INT64": "TYPE_INT64", "BOOL": "TYPE_BOOL", "UINT8": "TYPE_UINT8",
    }  # fmt: skip


@pytest.mark.parametrize("dtype", ["FP8", "INT4", "FP4"])
def test_an_engine_tensor_without_a_v2_type_is_refused_by_name(dtype):
    info = EngineInfo((EngineTensor("q", True, dtype, (4,)), EngineTensor("y", False, "FLOAT", (4,))), ())
    with pytest.raises(ConfigError, match=rf"input 'q' has TensorRT type {dtype}.*allowed: FLOAT, HALF"):
        trt_backend.complete_config(cfg(), info)


def test_shape_tensors_are_refused():
    info = EngineInfo((EngineTensor("s", True, "INT32", (2,), shape_tensor=True),), ())
    with pytest.raises(Unsupported, match="'s' is a shape tensor"):
        trt_backend.complete_config(cfg(), info)


# -- config completion and the IO check ---------------------------------------------------------------


def test_an_empty_config_is_completed_from_the_engine_like_triton():
    config = cfg()
    notes = trt_backend.complete_config(config, engine(batch_profile(1, 4, 8), batch_profile(1, 16, 32)))
    assert config.max_batch_size == 8  # instances use profile 0 only when no group lists profiles
    assert config.HasField("dynamic_batching")
    assert [(t.name, mc.DataType.Name(t.data_type), list(t.dims)) for t in [*config.input, *config.output]] == [
        ("x", "TYPE_FP32", [4]),
        ("y", "TYPE_FP32", [4]),
    ]
    assert any("max_batch_size set to 8" in n for n in notes)


def test_listed_profiles_raise_the_completed_max_batch_size():
    config = cfg('instance_group [ { kind: KIND_GPU profile: [ "0" ] }, { kind: KIND_GPU profile: [ "1" ] } ]')
    trt_backend.complete_config(config, engine(batch_profile(1, 4, 8), batch_profile(1, 16, 32)))
    assert config.max_batch_size == 32


def test_max_batch_size_above_the_profiles_is_refused_like_triton():
    with pytest.raises(ConfigError, match=r"max_batch_size is 16 but .*profiles \[0\] admit at most a batch of 8"):
        trt_backend.complete_config(cfg("max_batch_size: 16"), engine(batch_profile(1, 4, 8)))


def test_a_non_batching_engine_keeps_max_batch_size_zero_and_refuses_more():
    static = EngineInfo((EngineTensor("x", True, "HALF", (3, 4)), EngineTensor("y", False, "HALF", (3,))), ())
    config = cfg()
    trt_backend.complete_config(config, static)
    assert config.max_batch_size == 0 and not config.HasField("dynamic_batching")
    assert [list(t.dims) for t in [*config.input, *config.output]] == [[3, 4], [3]]
    with pytest.raises(ConfigError, match=r"engine cannot batch: 'x' has shape \[3, 4\]"):
        trt_backend.complete_config(cfg("max_batch_size: 2"), static)


def test_full_rank_config_dims_hint_that_the_model_does_not_batch():
    config = cfg('input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]')
    trt_backend.complete_config(config, engine(batch_profile(1, 4, 8)))
    assert config.max_batch_size == 0
    assert [list(t.dims) for t in config.output] == [[-1, 4]]


@pytest.mark.parametrize(
    ("io", "field", "message"),
    [
        (
            'input [ { name: "x" data_type: TYPE_FP16 dims: [ 4 ] } ]',
            "input[0].data_type",
            r"input 'x': datatypes differ: the config has TYPE_FP16 dims \[4\] but the engine declares FLOAT "
            r"\(TYPE_FP32\) shape \[-1, 4\] \(\[4\] after the batch dim\)",
        ),
        (
            'output [ { name: "y" data_type: TYPE_FP32 dims: [ 5 ] } ]',
            "output[0].dims",
            r"output 'y': shapes are not compatible: the config has TYPE_FP32 dims \[5\] but the engine declares "
            r"FLOAT \(TYPE_FP32\) shape \[-1, 4\]",
        ),
        (
            'input [ { name: "x" data_type: TYPE_FP32 dims: [ 2, 2 ] reshape { shape: [ 3 ] } } ]',
            "input[0].reshape",
            r"config has TYPE_FP32 dims \[2, 2\] \(reshape \[3\]\)",
        ),
        (
            'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]',
            "input[0].name",
            r"input 'INPUT0' is not an input of the TensorRT engine; the engine's inputs: 'x'",
        ),
        ('output [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]', "output[0].name", "the engine's outputs: 'y'"),
    ],
)
def test_a_config_that_disagrees_with_the_engine_names_the_tensor_and_both_sides(io, field, message):
    with pytest.raises(ConfigError, match=message) as caught:
        trt_backend.complete_config(cfg(f"max_batch_size: 8\n{io}"), engine(batch_profile(1, 4, 8)))
    assert caught.value.field == field


def test_config_dims_may_narrow_a_dynamic_engine_dim():
    info = EngineInfo((EngineTensor("x", True, "INT64", (-1, -1)), EngineTensor("y", False, "FLOAT", (-1, 8))),
                      ({"x": Range((1, 1), (4, 16), (8, 128))},))  # fmt: skip
    config = cfg('max_batch_size: 8 input [ { name: "x" data_type: TYPE_INT64 dims: [ 32 ] } ]')
    trt_backend.complete_config(config, info)
    assert [list(t.dims) for t in config.output] == [[8]]


@pytest.mark.parametrize("kind", ["KIND_CPU", "KIND_MODEL"])
def test_tensorrt_instances_run_on_gpus_only(kind):
    with pytest.raises(ConfigError, match=f"kind {kind}: TensorRT engines run on GPUs only") as caught:
        trt_backend.complete_config(cfg(f"instance_group [ {{ kind: {kind} }} ]"), engine(batch_profile(1, 4, 8)))
    assert caught.value.field == "instance_group[0].kind"


# -- profiles per instance ----------------------------------------------------------------------------


def test_instance_profiles_follow_the_groups_in_instance_order():
    config = cfg('instance_group [ { count: 2 profile: [ "1", "0", "1" ] }, { count: 1 } ]')
    assert trt_backend.instance_profiles(config, 2) == [(1, 0), (1, 0), (0,)]
    assert trt_backend.instance_profiles(cfg(), 3) == [(0,)]


@pytest.mark.parametrize(("is_input", "section"), [(True, "input"), (False, "output")])
def test_a_vectorized_io_format_is_refused_naming_the_tensor(is_input, section):
    """Buffers are sized and read as numpy's row-major layout; CHW16/HWC8 IO would be overrun."""
    tensors = [EngineTensor("x", True, "HALF", (-1, 3, 8, 8)), EngineTensor("y", False, "HALF", (-1, 3, 8, 8))]
    tensors[0 if is_input else 1] = dataclasses.replace(tensors[0 if is_input else 1], format="CHW16")
    info = EngineInfo(tuple(tensors), ({"x": Range((1, 3, 8, 8), (4, 3, 8, 8), (8, 3, 8, 8))},))
    name = "x" if is_input else "y"
    with pytest.raises(Unsupported, match=rf"{section} '{name}' has the vectorized IO format CHW16.*LINEAR IO"):
        trt_backend.complete_config(cfg(), info)


@pytest.mark.parametrize("gpu_count", [1, 2, 4])
@pytest.mark.parametrize("groups", [
    "",
    'instance_group [ { kind: KIND_GPU count: 2 } ]',
    'instance_group [ { kind: KIND_GPU gpus: [ 0 ] count: 1 profile: [ "1" ] }, { kind: KIND_GPU count: 2 } ]',
    'instance_group [ { count: 1 profile: [ "0" ] }, { kind: KIND_GPU gpus: [ 0 ] count: 3 profile: [ "1" ] } ]',
])
def test_instance_profiles_are_numbered_as_the_repository_numbers_instances(groups, gpu_count):
    """The repository makes ``count`` instances on every GPU of a group; the profiles must line up."""
    from sluice.runtime.repository import instance_plan

    config = cfg(groups)
    plan = instance_plan(config, gpu_count)
    profiles = trt_backend.instance_profiles(config, 2, gpu_count)
    assert len(profiles) == len(plan)
    expected = []
    for group in config.instance_group or [K(count=1)]:
        per_instance = tuple(int(p) for p in group.profile) or (0,)
        expected += [per_instance] * ((len(group.gpus) or gpu_count) * max(group.count, 1))
    assert profiles == expected


@pytest.mark.parametrize("name", ["2", "-1", "one", ""])
def test_a_profile_the_engine_lacks_is_a_config_error(name):
    with pytest.raises(ConfigError, match=rf"profile {name!r} is not an optimization profile.*allowed: 0, 1") as c:
        trt_backend.instance_profiles(cfg(f'instance_group [ {{ count: 1 }}, {{ profile: [ "{name}" ] }} ]'), 2)
    assert c.value.field == "instance_group[1].profile"


# -- profile selection and batch splitting ------------------------------------------------------------

SMALL, LARGE = batch_profile(1, 4, 8), batch_profile(1, 24, 32)


@pytest.mark.parametrize(
    ("allowed", "rows", "expected"),
    [
        ((0, 1), 3, 0),  # both admit: nearer opt 4
        ((0, 1), 8, 0),  # |4-8| = 4 < |24-8| = 16
        ((0, 1), 20, 1),  # only the large admits
        ((1,), 3, 1),  # the instance may not use profile 0
        ((1, 0), 14, 1),  # both admit? no: 14 > 8
    ],
)
def test_select_profile_picks_the_admitting_profile_nearest_opt(allowed, rows, expected):
    profiles = engine(SMALL, LARGE).profiles
    assert select_profile(profiles, allowed, {"x": (rows, 4)}) == expected


def test_a_batch_that_fits_no_allowed_profile_names_its_shapes_and_the_ranges():
    profiles = engine(SMALL, LARGE).profiles
    with pytest.raises(InvalidArgument) as caught:
        select_profile(profiles, (0,), {"x": (9, 4)})
    assert str(caught.value) == (
        "input shapes x [9, 4] fit no optimization profile this instance may use; allowed: profile 0: x [1, 4]..[8, 4]"
    )


def test_a_batch_beyond_the_allowed_profiles_is_split_into_their_largest_batches():
    profiles = engine(SMALL, LARGE).profiles
    assert plan_batches(profiles, (0,), {"x": (20, 4)}, batched=True) == [
        Chunk(0, 8, 0), Chunk(8, 16, 0), Chunk(16, 20, 0)
    ]  # fmt: skip
    assert plan_batches(profiles, (0, 1), {"x": (20, 4)}, batched=True) == [Chunk(0, 20, 1)]


def test_a_remainder_below_every_minimum_batch_is_refused():
    profiles = engine(batch_profile(4, 4, 8)).profiles
    with pytest.raises(InvalidArgument, match=r"x \[2, 4\] fit no optimization profile"):
        plan_batches(profiles, (0,), {"x": (10, 4)}, batched=True)


def test_other_dims_outside_every_profile_are_not_split():
    profiles = engine(SMALL).profiles
    with pytest.raises(InvalidArgument, match=r"x \[20, 5\] fit no optimization profile"):
        plan_batches(profiles, (0,), {"x": (20, 5)}, batched=True)


def test_a_non_batching_model_is_never_split():
    profiles = engine(SMALL).profiles
    with pytest.raises(InvalidArgument):
        plan_batches(profiles, (0,), {"x": (20, 4)}, batched=False)


def test_an_engine_without_profiles_runs_with_profile_zero():
    assert plan_batches((), (0,), {"x": (3, 4)}, batched=True) == [Chunk(0, 3, 0)]


ranges = st.tuples(st.integers(1, 40), st.integers(0, 40), st.integers(0, 40)).map(
    lambda t: (t[0], t[0] + min(t[1], t[2]), t[0] + max(t[1], t[2]))
)


@st.composite
def problems(draw):
    """Profiles over x [batch, width] and y [batch]; a subset the instance may use; a batch's shapes."""
    count = draw(st.integers(1, 4))
    profiles = []
    for _ in range(count):
        (b_lo, b_opt, b_hi), (w_lo, w_opt, w_hi) = draw(ranges), draw(ranges)
        profiles.append({
            "x": Range((b_lo, w_lo), (b_opt, w_opt), (b_hi, w_hi)),
            "y": Range((b_lo,), (b_opt,), (b_hi,)),
        })  # fmt: skip
    allowed = tuple(draw(st.lists(st.integers(0, count - 1), min_size=1, max_size=count, unique=True)))
    rows, width = draw(st.integers(1, 200)), draw(st.integers(1, 90))
    return profiles, allowed, {"x": (rows, width), "y": (rows,)}


def _admits(profile, shapes):
    return all(profile[n].admits(s) for n, s in shapes.items())


@given(problems())
def test_select_profile_properties(problem):
    profiles, allowed, shapes = problem
    admitting = [i for i in allowed if _admits(profiles[i], shapes)]
    if not admitting:
        with pytest.raises(InvalidArgument, match="fit no optimization profile"):
            select_profile(profiles, allowed, shapes)
        return
    chosen = select_profile(profiles, allowed, shapes)
    assert chosen in admitting

    def distance(i):
        return sum(profiles[i][n].distance(s) for n, s in shapes.items())

    assert distance(chosen) == min(distance(i) for i in admitting)
    assert chosen == min(i for i in admitting if distance(i) == distance(chosen))


@given(problems())
def test_plan_batches_covers_the_rows_with_chunks_each_profile_admits(problem):
    profiles, allowed, shapes = problem
    rows = shapes["x"][0]
    try:
        chunks = plan_batches(profiles, allowed, shapes, batched=True)
    except InvalidArgument:
        # no split helps: no allowed profile takes these other dims at any batch up to its max,
        # or a remainder is below every minimum
        assert not any(_admits(profiles[i], shapes) for i in allowed)
        return
    assert chunks[0].start == 0 and chunks[-1].stop == rows
    assert all(a.stop == b.start for a, b in itertools.pairwise(chunks))
    for chunk in chunks:
        assert chunk.profile in allowed
        part = {n: (chunk.stop - chunk.start, *s[1:]) for n, s in shapes.items()}
        assert _admits(profiles[chunk.profile], part)
    if any(_admits(profiles[i], shapes) for i in allowed):
        assert len(chunks) == 1


# -- the instance's call sequence, through its seams ----------------------------------------------------
# TrtInstance takes its engine and its CUDA runtime as arguments. These doubles implement the calls it
# makes (TensorRT 10's context API; cudart.Runtime's buffers and streams over host memory) for
# y = 2x + 1, so chunking, buffer growth, profile switches and error answers run on CPU. They check
# Sluice's side of the contract only; TensorRT itself runs in the GPU tests below.


class HostCuda:
    """cudart.Runtime's buffer and stream calls over host memory; ``oom`` mallocs fail first."""

    def __init__(self, oom: int = 0) -> None:
        self.buffers: dict[int, ctypes.Array] = {}
        self.oom = oom
        self.streams = 0

    def use(self, device_id):
        assert device_id == 0

    def stream_create(self, device_id):
        self.streams += 1
        return 7

    def stream_destroy(self, stream):
        self.streams -= 1

    def stream_synchronize(self, stream):
        assert stream == 7

    def malloc(self, byte_size, device_id):
        if self.oom:
            self.oom -= 1
            raise cudart.CudaError("cudaMalloc", cudart.MEMORY_ALLOCATION, "cudaErrorMemoryAllocation", "out of memory")
        buffer = (ctypes.c_char * max(byte_size, 1))()
        self.buffers[ctypes.addressof(buffer)] = buffer
        return ctypes.addressof(buffer)

    def free(self, pointer, device_id):
        del self.buffers[pointer]

    def to_device_async(self, pointer, host, byte_size, stream):
        assert pointer in self.buffers and len(self.buffers[pointer]) >= byte_size
        ctypes.memmove(pointer, host, byte_size)

    def to_host_async(self, host, pointer, byte_size, stream):
        ctypes.memmove(host, pointer, byte_size)


class AffineContext:
    """An execution context computing y = 2x + 1 on [batch, 4] FP32 that holds to its profile's ranges."""

    def __init__(self, info: EngineInfo) -> None:
        self.info, self.profile, self.fail, self.refuse_profiles = info, 0, False, False
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.runs: list[tuple[int, tuple[int, ...]]] = []

    def set_optimization_profile_async(self, index, stream):
        if self.refuse_profiles:  # TensorRT's binding raises where the C++ call returns false
            raise RuntimeError("Error in set optimization profile async.")
        self.profile = index
        return True

    def set_input_shape(self, name, shape):
        self.shapes[name] = tuple(shape)
        return self.info.profiles[self.profile][name].admits(shape)

    def get_tensor_shape(self, name):
        return self.shapes["x"]

    def set_tensor_address(self, name, pointer):
        self.addresses[name] = pointer

    def execute_async_v3(self, stream):
        if self.fail:
            return False
        count = int(np.prod(self.shapes["x"]))
        x = np.ctypeslib.as_array((ctypes.c_float * count).from_address(self.addresses["x"]))
        y = np.ctypeslib.as_array((ctypes.c_float * count).from_address(self.addresses["y"]))
        y[:] = 2 * x + 1
        self.runs.append((self.profile, self.shapes["x"]))
        return True


class OneContext:
    def __init__(self, context: AffineContext) -> None:
        self.context = context

    def create_execution_context(self):
        return self.context


def instance_for(profiles, allowed, cuda):
    info = engine(*profiles)
    config = cfg(f"instance_group [ {{ profile: {[str(p) for p in range(len(profiles))]} }} ]".replace("'", '"'))
    trt_backend.complete_config(config, info)
    context = AffineContext(info)
    return trt_backend.TrtInstance(OneContext(context), info, config, allowed, cuda, 0), context


def requests(*rows: int) -> tuple[list[InferRequest], list[np.ndarray]]:
    rng = np.random.default_rng(sum(rows))
    arrays = [rng.standard_normal((n, 4)).astype(np.float32) for n in rows]
    return [InferRequest("m", "1", [Tensor("x", "FP32", a)], batch_size=len(a)) for a in arrays], arrays


def test_a_batch_larger_than_the_instances_profiles_runs_in_chunks_and_is_cut_back_per_request():
    cuda = HostCuda()
    instance, context = instance_for([SMALL, LARGE], (0,), cuda)
    batch, arrays = requests(12, 8)
    results = instance.execute(batch)
    assert context.runs == [(0, (8, 4)), (0, (8, 4)), (0, (4, 4))]
    for result, x in zip(results, arrays, strict=True):
        assert isinstance(result, InferResponse)
        np.testing.assert_array_equal(result.outputs[0].data, 2 * x + 1)
    instance.close()
    assert cuda.buffers == {} and cuda.streams == 0


def test_the_instance_switches_profiles_between_batches():
    instance, context = instance_for([SMALL, LARGE], (0, 1), HostCuda())
    for rows in (3, 20, 2):
        batch, arrays = requests(rows)
        np.testing.assert_array_equal(instance.execute(batch)[0].outputs[0].data, 2 * arrays[0] + 1)
    assert context.runs == [(0, (3, 4)), (1, (20, 4)), (0, (2, 4))]


def test_a_refused_profile_switch_answers_the_batch_and_the_instance_goes_on_serving():
    instance, context = instance_for([SMALL, LARGE], (0, 1), HostCuda())
    context.refuse_profiles = True
    batch, _ = requests(20)
    refused = instance.execute(batch)[0]
    assert isinstance(refused, ModelError)
    assert "refused optimization profile 1" in refused.message
    assert "Error in set optimization profile" in refused.message
    context.refuse_profiles = False
    batch, arrays = requests(20)
    np.testing.assert_array_equal(instance.execute(batch)[0].outputs[0].data, 2 * arrays[0] + 1)
    assert context.runs == [(1, (20, 4))]


def test_an_engine_with_a_scalar_per_item_takes_the_configs_dims_1_reshaped_to_it():
    """Auto-complete gives a 0-d item ``dims: [1]`` with an empty ``reshape`` (Triton's convention): the
    client sends [rows, 1], the engine gets [rows] (the reshape is the engine's shape), and the output
    goes back as [rows, 1]."""
    info = EngineInfo(
        (EngineTensor("x", True, "FLOAT", (-1,)), EngineTensor("y", False, "FLOAT", (-1,))),
        ({"x": Range((1,), (4,), (8,))},),
    )
    config = cfg()
    trt_backend.complete_config(config, info)
    assert list(config.input[0].dims) == [1] and config.input[0].HasField("reshape")
    context = AffineContext(info)
    instance = trt_backend.TrtInstance(OneContext(context), info, config, (0,), HostCuda(), 0)
    arrays = [np.array([[1.0], [2.0], [3.0]], np.float32), np.array([[5.0]], np.float32)]
    batch = [InferRequest("m", "1", [Tensor("x", "FP32", a)], batch_size=len(a)) for a in arrays]
    results = instance.execute(batch)
    assert context.runs == [(0, (4,))]
    for result, x in zip(results, arrays, strict=True):
        assert isinstance(result, InferResponse), result
        assert result.outputs[0].data.shape == x.shape
        np.testing.assert_array_equal(result.outputs[0].data, 2 * x + 1)


def test_out_of_gpu_memory_answers_the_batch_and_the_instance_goes_on_serving():
    instance, _context = instance_for([SMALL], (0,), HostCuda(oom=1))
    batch, arrays = requests(2, 3)
    failed = instance.execute(batch)
    assert [type(r) for r in failed] == [ModelError, ModelError]
    assert "out of GPU memory on GPU 0" in failed[0].message and "goes on serving" in failed[0].message
    np.testing.assert_array_equal(instance.execute(batch)[1].outputs[0].data, 2 * arrays[1] + 1)


def test_a_failed_execution_answers_the_batch_and_the_next_one_runs():
    instance, context = instance_for([SMALL], (0,), HostCuda())
    batch, arrays = requests(4)
    context.fail = True
    assert "execute_async_v3 returned false" in instance.execute(batch)[0].message
    context.fail = False
    np.testing.assert_array_equal(instance.execute(batch)[0].outputs[0].data, 2 * arrays[0] + 1)


def test_a_batch_no_profile_admits_is_an_invalid_argument_for_each_request():
    instance, context = instance_for([batch_profile(2, 4, 8)], (0,), HostCuda())
    results = instance.execute(requests(1)[0])
    assert isinstance(results[0], InvalidArgument) and "x [1, 4] fit no optimization profile" in results[0].message
    assert context.runs == []


# -- through the real server, without TensorRT ----------------------------------------------------------

TRT_INSTALLED = importlib.util.find_spec("tensorrt") is not None


@pytest.mark.skipif(TRT_INSTALLED, reason="tensorrt is installed here: the not-installed answer cannot be seen")
def test_a_plan_without_tensorrt_fails_its_load_with_the_install_hint(tmp_path, serve):
    repo = tmp_path / "repo"
    write_model(repo, "plan", 'platform: "tensorrt_plan"\nmax_batch_size: 8\n', {"model.plan": b"not an engine"})
    write_model(repo, "mlp", 'backend: "onnxruntime"\nmax_batch_size: 8\n', {"model.onnx": BUILDERS.mlp_model()})
    server = serve(repo, **EXPLICIT)
    client = httpclient.InferenceServerClient(server.http)
    with pytest.raises(InferenceServerException) as caught:
        client.load_model("plan")
    assert caught.value.status() == "400"
    message = caught.value.message()
    assert message.startswith("failed to load 'plan': backend 'tensorrt' needs the Python package 'tensorrt'")
    assert "not installed" in message and "pip install 'sluice[tensorrt]'" in message
    assert str(tmp_path) not in message
    grpc = grpcclient.InferenceServerClient(server.grpc)
    with pytest.raises(InferenceServerException, match="not installed") as by_grpc:
        grpc.load_model("plan")
    assert by_grpc.value.status() == "StatusCode.UNIMPLEMENTED"
    row = {r["name"]: r for r in client.get_model_repository_index()}["plan"]
    assert row["state"] == "UNAVAILABLE" and "sluice[tensorrt]" in row["reason"]
    assert client.is_server_live() and client.is_model_ready("mlp")  # the server goes on serving


def test_a_plan_without_its_file_names_default_model_filename(tmp_path, serve):
    repo = tmp_path / "repo"
    write_model(repo, "plan", 'platform: "tensorrt_plan"\n', {"other.bin": b""})
    server = serve(repo, **EXPLICIT)
    with pytest.raises(InferenceServerException, match=r"model file not found: plan/1/model.plan.*default_model_file"):
        httpclient.InferenceServerClient(server.http).load_model("plan")


# -- on a GPU with TensorRT ---------------------------------------------------------------------------


def _gpu_reason() -> str | None:
    if not TRT_INSTALLED:
        return "needs the tensorrt package (pip install 'sluice[tensorrt]'), not installed here"
    if shutil.which("nvidia-smi") is None:
        return "needs a CUDA GPU: no nvidia-smi on this machine"
    from sluice.runtime import cudart

    if not cudart.Loader().usable():
        return "needs a CUDA GPU: libcudart sees none"
    return None


GPU_REASON = _gpu_reason()
needs_trt_gpu = pytest.mark.skipif(GPU_REASON is not None, reason=GPU_REASON or "")


def affine_onnx(width: int = 4) -> bytes:
    """OUTPUT0 = INPUT0 * 2 + 1, FP32 [batch, width]."""
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Mul", ["INPUT0", "two"], ["t"]), helper.make_node("Add", ["t", "one"], ["OUTPUT0"])],
        "affine",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", width])],
        [numpy_helper.from_array(np.float32([2.0]), "two"), numpy_helper.from_array(np.float32([1.0]), "one")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


def build_plan(onnx_bytes: bytes, batch_ranges: list[tuple[int, int, int]], width: int = 4) -> bytes:
    """A serialized engine with one optimization profile per (min, opt, max) batch range."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    assert parser.parse(onnx_bytes), [str(parser.get_error(i)) for i in range(parser.num_errors)]
    config = builder.create_builder_config()
    for low, opt, high in batch_ranges:
        profile = builder.create_optimization_profile()
        profile.set_shape("INPUT0", (low, width), (opt, width), (high, width))
        config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    assert plan is not None
    return bytes(plan)


@needs_trt_gpu
def test_a_built_engine_serves_with_auto_complete_over_http_and_grpc(tmp_path, serve):
    repo = tmp_path / "repo"
    write_model(repo, "affine", 'platform: "tensorrt_plan"\n', {"model.plan": build_plan(affine_onnx(), [(1, 4, 8)])})
    server = serve(repo)
    http = httpclient.InferenceServerClient(server.http)
    config = http.get_model_config("affine")
    assert config["max_batch_size"] == 8 and [int(d) for d in config["input"][0]["dims"]] == [4]
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    inputs = [httpclient.InferInput("INPUT0", [3, 4], "FP32")]
    inputs[0].set_data_from_numpy(x)
    np.testing.assert_allclose(http.infer("affine", inputs).as_numpy("OUTPUT0"), x * 2 + 1)
    grpc = grpcclient.InferenceServerClient(server.grpc)
    ginputs = [grpcclient.InferInput("INPUT0", [3, 4], "FP32")]
    ginputs[0].set_data_from_numpy(x)
    np.testing.assert_allclose(grpc.infer("affine", ginputs).as_numpy("OUTPUT0"), x * 2 + 1)


@needs_trt_gpu
def test_instances_keep_to_their_profiles_and_split_larger_batches(tmp_path, serve):
    repo = tmp_path / "repo"
    plan = build_plan(affine_onnx(), [(1, 4, 8), (1, 16, 32)])
    write_model(
        repo, "affine", 'platform: "tensorrt_plan"\n'
        'instance_group [ { kind: KIND_GPU profile: [ "0" ] }, { kind: KIND_GPU profile: [ "1" ] } ]\n',
        {"model.plan": plan},
    )  # fmt: skip
    server = serve(repo)
    http = httpclient.InferenceServerClient(server.http)
    assert http.get_model_config("affine")["max_batch_size"] == 32
    rng = np.random.default_rng(0)
    for _ in range(8):  # both instances take some: the profile-0 one runs 20 rows as 8 + 8 + 4
        x = rng.standard_normal((20, 4)).astype(np.float32)
        inputs = [httpclient.InferInput("INPUT0", [20, 4], "FP32")]
        inputs[0].set_data_from_numpy(x)
        np.testing.assert_allclose(http.infer("affine", inputs).as_numpy("OUTPUT0"), x * 2 + 1, rtol=1e-6)


@needs_trt_gpu
def test_a_config_that_disagrees_with_a_real_engine_fails_its_load_only(tmp_path, serve):
    repo = tmp_path / "repo"
    write_model(
        repo, "affine", 'platform: "tensorrt_plan"\nmax_batch_size: 8\n'
        'input [ { name: "INPUT0" data_type: TYPE_FP16 dims: [ 4 ] } ]\n',
        {"model.plan": build_plan(affine_onnx(), [(1, 4, 8)])},
    )  # fmt: skip
    server = serve(repo, **EXPLICIT)
    with pytest.raises(InferenceServerException, match=r"input 'INPUT0': datatypes differ.*TYPE_FP16.*FLOAT"):
        httpclient.InferenceServerClient(server.http).load_model("affine")
