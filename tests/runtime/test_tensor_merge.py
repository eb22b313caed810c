"""Merging a batch's inputs: ``concat_rows`` (runtime/backends/tensor.py, what the CPU instances
use), numpy's ``merge_into`` straight into a staging buffer, and the CUDA instances' ``merge_rows``
and pinned-buffer views (runtime/backends/pytorch.py), checked here on plain memory."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.runtime.backends.tensor import concat_rows, input_parts, merge_inputs, merge_into, merged_shape
from sluice.runtime.types import InferRequest, Tensor

DTYPES = [np.float32, np.float16, np.uint16, np.int64, np.int8, np.bool_]


def staging_view(parts: list[np.ndarray], capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """A byte buffer larger than needed and the typed view of its head, as a staging buffer is used."""
    shape = merged_shape(parts)
    nbytes = int(np.prod(shape, dtype=np.int64)) * parts[0].dtype.itemsize
    buffer = np.full(max(capacity, nbytes), 0xAB, dtype=np.uint8)
    return buffer, buffer[:nbytes].view(parts[0].dtype).reshape(shape)


BATCHES = {  # a batch: its dtype, each request's rows, the row shape, spare buffer bytes, a seed
    "dtype": st.sampled_from(DTYPES),
    "row_shape": st.lists(st.integers(1, 4), min_size=0, max_size=3),
    "spare": st.integers(0, 64),
    "seed": st.integers(0, 2**16),
}


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.integers(1, 5), min_size=1, max_size=6), **BATCHES)
def test_merge_into_a_staging_view_equals_concatenation_and_leaves_the_rest(dtype, rows, row_shape, spare, seed):
    rng = np.random.default_rng(seed)
    parts = [(rng.random((n, *row_shape)) * 100).astype(dtype) for n in rows]
    needed = sum(rows) * int(np.prod(row_shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    buffer, out = staging_view(parts, needed + spare)
    merged = merge_into(parts, out)
    assert merged is out
    np.testing.assert_array_equal(out, np.concatenate(parts, axis=0))
    assert (buffer[needed:] == 0xAB).all()  # nothing written past the batch


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(st.integers(0, 5), min_size=1, max_size=6),
    layout=st.sampled_from(["wire", "owned", "strided", "mixed-dtype", "big-endian"]),
    wide=st.booleans(),
    **BATCHES,
)
def test_concat_rows_equals_numpy_concatenate(dtype, rows, row_shape, spare, seed, layout, wide):
    """Every dtype, zero-row parts, read-only parts over bytes (the wire), strided parts, parts numpy
    must cast, parts small enough for numpy and ``wide`` ones (over 500 elements a row: copied part by
    part): the same values, dtype and shape as np.concatenate, in a new writable array."""
    rng = np.random.default_rng(seed)
    if wide:
        row_shape = [*row_shape, 501]
    parts = [(rng.random((n, *row_shape)) * 100).astype(dtype) for n in rows]
    if layout == "wire":
        parts = [np.frombuffer(p.tobytes(), dtype=p.dtype).reshape(p.shape) for p in parts]
    elif layout == "strided" and row_shape:
        parts = [np.repeat(p, 2, axis=-1)[..., ::2] for p in parts]
    elif layout == "mixed-dtype":
        parts[-1] = parts[-1].astype(np.float64)
    elif layout == "big-endian":
        parts = [p.astype(p.dtype.newbyteorder(">")) for p in parts]
    expected = np.concatenate(parts, axis=0)
    merged = concat_rows(parts)
    assert merged.dtype == expected.dtype and merged.shape == expected.shape
    np.testing.assert_array_equal(merged, expected)
    assert merged.flags.writeable and merged.flags.c_contiguous
    assert not any(np.shares_memory(merged, p) for p in parts)


def test_concat_rows_of_strings_and_of_rows_that_differ():
    strings = [np.array([b"a", b"bc"], dtype=object), np.array([b""], dtype=object)]
    assert concat_rows(strings).tolist() == [b"a", b"bc", b""]
    with pytest.raises(ValueError):  # numpy's own message for rows of different shapes
        concat_rows([np.zeros((1, 3), np.float32), np.zeros((1, 4), np.float32)])
    with pytest.raises(ValueError):  # and for parts of different rank (a 0-d one)
        concat_rows([np.zeros(2, np.float32), np.zeros((), np.float32)])


def test_a_single_part_is_copied_not_aliased():
    part = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = np.zeros((2, 3), dtype=np.float32)
    merge_into([part], out)
    part[0, 0] = 99.0
    assert out[0, 0] == 0.0


def test_shapes_and_dtypes_that_do_not_fit_are_refused():
    parts = [np.zeros((2, 3), np.float32), np.zeros((1, 3), np.float32)]
    assert merged_shape(parts) == (3, 3)
    with pytest.raises(ValueError, match=r"cannot merge parts of shapes \[\(2, 3\), \(1, 3\)\] into \(2, 3\)"):
        merge_into(parts, np.zeros((2, 3), np.float32))
    with pytest.raises(TypeError):  # no silent casting into a buffer of another type
        merge_into(parts, np.zeros((3, 3), np.float16))
    with pytest.raises(ValueError):  # rows of different shapes
        merge_into([np.zeros((1, 3), np.float32), np.zeros((1, 4), np.float32)], np.zeros((2, 3), np.float32))


def test_input_parts_group_by_name_in_request_order_and_merge_inputs_agrees():
    def request(i: int) -> InferRequest:
        return InferRequest(
            "m",
            "",
            [
                Tensor("A", "FP32", np.full((1, 2), i, np.float32)),
                Tensor("B", "INT64", np.full((2, 1), i, np.int64)),
            ],
        )

    requests = [request(i) for i in range(3)]
    parts = input_parts(requests)
    assert list(parts) == ["A", "B"]
    assert [int(p[0, 0]) for p in parts["B"]] == [0, 1, 2]
    merged = merge_inputs(requests)
    for name, arrays in parts.items():
        out = np.empty(merged_shape(arrays), arrays[0].dtype)
        np.testing.assert_array_equal(merge_into(arrays, out), merged[name])


# -- the CUDA instances' merge: one torch call into the pinned buffer's bytes (checked on the CPU) ---------


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.integers(0, 5), min_size=1, max_size=6), read_only=st.booleans(), **BATCHES)
def test_merge_rows_writes_the_concatenation_bytes_into_the_buffer_head(dtype, rows, row_shape, spare, seed, read_only):
    torch = pytest.importorskip("torch")
    from sluice.runtime.backends.pytorch import merge_rows

    rng = np.random.default_rng(seed)
    parts = [(rng.random((n, *row_shape)) * 100).astype(dtype) for n in rows]
    if read_only:  # what the wire gives: arrays over bytes
        parts = [np.frombuffer(p.tobytes(), dtype=p.dtype).reshape(p.shape) for p in parts]
    expected = np.concatenate(parts, axis=0)
    buffer = torch.full((expected.nbytes + spare,), 0xAB, dtype=torch.uint8)
    head = buffer[: expected.nbytes]
    assert merge_rows(torch, parts, head) is head
    np.testing.assert_array_equal(head.numpy().view(expected.dtype).reshape(expected.shape), expected)
    assert (buffer[expected.nbytes :] == 0xAB).all()  # nothing written past the batch


def test_merge_rows_takes_strided_parts_and_refuses_parts_that_do_not_fit():
    torch = pytest.importorskip("torch")
    from sluice.runtime.backends.pytorch import merge_rows

    bytes_ = torch.uint8
    wide = np.arange(24, dtype=np.float32).reshape(4, 6)
    parts = [wide[:, ::2], wide[:2, 1::2]]  # not contiguous
    out = torch.empty(6 * 3 * 4, dtype=torch.uint8)
    merge_rows(torch, parts, out)
    np.testing.assert_array_equal(out.numpy().view(np.float32).reshape(6, 3), np.concatenate(parts))
    with pytest.raises(ValueError, match="rows differ"):
        merge_rows(torch, [np.zeros((1, 3), np.float32), np.zeros((1, 4), np.float32)], torch.empty(28, dtype=bytes_))
    with pytest.raises(ValueError, match="rows differ"):  # no silent reinterpretation of another type
        merge_rows(torch, [np.zeros((1, 2), np.float32), np.zeros((1, 2), np.int32)], torch.empty(16, dtype=bytes_))
    with pytest.raises(ValueError, match=r"into 12 bytes"):
        merge_rows(torch, [np.zeros((2, 3), np.float32)], torch.empty(12, dtype=bytes_))


def test_the_staging_buffers_views_are_made_once_per_shape_and_dropped_with_their_buffer():
    """_CudaStaging on plain memory (``pin=False``): a batch shape seen again gets the same typed view
    (no torch call), the bytes are the batch's; a larger batch grows the buffer and the old buffer's
    views go with it; outputs come back contiguous with their values."""
    torch = pytest.importorskip("torch")
    from sluice.runtime.backends.pytorch import _CudaStaging

    staging = _CudaStaging(torch, torch.device("cpu"), None, pin=False)
    rows = [np.full((1, 3, 4), i, np.float16) for i in range(4)]
    first = staging.stage("x", rows[:2], torch.float16)
    again = staging.stage("x", rows[2:], torch.float16)
    assert again is first and tuple(again.shape) == (2, 3, 4)
    np.testing.assert_array_equal(again.numpy(), np.concatenate(rows[2:]))
    three = staging.stage("x", rows[:3], torch.float16)
    assert tuple(three.shape) == (3, 3, 4) and three is not first
    old = staging._buffers[("in", "x")]
    big = [np.full((40000, 3, 4), 7, np.float16)]  # past the buffer: it grows
    np.testing.assert_array_equal(staging.stage("x", big, torch.float16).numpy(), big[0])
    assert staging._buffers[("in", "x")] is not old
    assert all(entry[0] is not old for entry in staging._views.values())  # nothing keeps the old buffer
    out = torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, ::2]  # not contiguous
    host = staging.to_host("y", out)
    assert host.is_contiguous() and torch.equal(host, out)
    assert staging.to_host("y", out * 2) is host  # same shape: the same view, new values
    assert torch.equal(host, out * 2)
    for n in range(1, staging.VIEWS + 5):  # bounded whatever the shapes
        staging.stage("z", [np.zeros((1, n), np.float32)], torch.float32)
    assert len(staging._views) <= staging.VIEWS
