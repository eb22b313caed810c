"""Shared batch plumbing for backends that run one function on whole tensors (ONNX Runtime, torch).

``merge_inputs`` concatenates the requests of a batch along the batch dimension and
``split_outputs`` cuts the results back per request; both are pure and run on a worker thread.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from sluice.runtime.types import InferRequest, InferResponse, Tensor


def input_parts(requests: Sequence[InferRequest]) -> dict[str, list[np.ndarray]]:
    """Each input name's arrays, one per request that sent it, in request order."""
    parts: dict[str, list[np.ndarray]] = {}
    for request in requests:
        for tensor in request.inputs:
            parts.setdefault(tensor.name, []).append(tensor.data)
    return parts


def merge_inputs(requests: Sequence[InferRequest]) -> dict[str, np.ndarray]:
    """One array per input name; a single request is passed through without a copy."""
    if len(requests) == 1:
        return {t.name: t.data for t in requests[0].inputs}
    return {name: concat_rows(parts) for name, parts in input_parts(requests).items()}


def concat_rows(parts: Sequence[np.ndarray]) -> np.ndarray:
    """``parts`` concatenated along the batch dimension (the first) into a new writable array, as
    ``np.concatenate(parts, axis=0)`` makes it, without giving up the GIL between parts.

    numpy's concatenate releases the GIL around each part's copy and takes it back after; beside a
    busy event loop each retake waits up to the switch interval (100 us in ``sluice serve``), so a
    294 KiB image part cost 100-250 us where the copy alone takes 15-40 (bench/staging_merge.py on
    the 2-core VM). Here each part is one memcpy under the GIL (a memoryview slice assignment), so a
    waiting thread takes its turn at the interpreter's switch interval between parts instead of at
    every part: the loop is never held for more than one part's copy past its turn. Parts of 500
    elements or fewer (numpy keeps the GIL for those, and its loop is faster: the MLP's rows),
    object (BYTES) arrays, a byte order not the machine's, and parts that differ in dtype, rank, row
    shape or layout go through numpy's concatenate (which casts, or says what does not fit)."""
    first = parts[0]
    dtype, row, ndim = first.dtype, first.shape[1:], first.ndim
    if first.size <= _NUMPY_KEEPS_GIL or dtype.hasobject or not dtype.isnative or not ndim or len(parts) < 2:
        # small parts (a batch's parts differ in rows only): numpy copies them keeping the GIL, and faster;
        # and numpy's result is in the native byte order
        return np.concatenate(parts, axis=0)
    for part in parts:
        if part.dtype != dtype or part.ndim != ndim or part.shape[1:] != row or not part.flags.c_contiguous:
            return np.concatenate(parts, axis=0)
    out = np.empty(merged_shape(parts), dtype)
    flat = _byte_view(out)
    at = 0
    for part in parts:
        n = part.nbytes
        if n:  # (a memoryview of no bytes cannot be cast)
            flat[at : at + n] = _byte_view(part)
            at += n
    return out


def _byte_view(array: np.ndarray) -> memoryview:
    """A C-contiguous array's bytes, as a flat memoryview of unsigned bytes (no copy)."""
    exported: Any = array if array.dtype.kind in "biufc" else array.reshape(-1).view(np.uint8)
    return memoryview(exported).cast("B")


_NUMPY_KEEPS_GIL = 500
"""numpy releases the GIL around a copy of more than this many elements (NPY_BEGIN_THREADS_THRESHOLDED)."""


def merged_shape(parts: Sequence[np.ndarray]) -> tuple[int, ...]:
    """The shape of ``parts`` concatenated along the batch dimension (the first)."""
    first = parts[0].shape
    return (sum(int(p.shape[0]) for p in parts), *first[1:]) if first else first


def merge_into(parts: Sequence[np.ndarray], out: np.ndarray) -> np.ndarray:
    """Concatenate ``parts`` along the batch dimension straight into ``out`` (shape
    :func:`merged_shape`): one copy of each byte, not a concatenation and then a second copy.
    Returns ``out``; ValueError when the shapes do not fit. numpy releases the GIL around each part,
    so beside a busy event loop every part waits to retake it: the CUDA instances merge with
    ``pytorch.merge_rows`` (one torch call) instead, and bench/staging_merge.py sets the two side
    by side. No serving path calls this one now."""
    if out.shape != merged_shape(parts):
        raise ValueError(f"cannot merge parts of shapes {[p.shape for p in parts]} into {out.shape}")
    if len(parts) == 1:
        np.copyto(out, parts[0], casting="no")
    else:
        np.concatenate(parts, axis=0, out=out, casting="no")
    return out


def split_outputs(
    requests: Sequence[InferRequest],
    outputs: dict[str, tuple[str, np.ndarray]],
    *,
    batched: bool,
) -> list[InferResponse]:
    """Cut ``outputs`` (name -> (datatype, array)) back into one response per request."""
    responses: list[InferResponse] = []
    offset = 0
    single = len(requests) == 1
    for request in requests:
        size = request.batch_size
        wanted = None if request.outputs is None else {o.name for o in request.outputs}
        tensors = []
        for name, (datatype, array) in outputs.items():
            if wanted is not None and name not in wanted:
                continue
            data = array if single or not batched else array[offset : offset + size]
            tensors.append(Tensor(name, datatype, data))
        offset += size
        responses.append(InferResponse(request.model_name, request.model_version, tensors, request.id))
    return responses


def split_timed(
    requests: Sequence[InferRequest],
    outputs: dict[str, tuple[str, np.ndarray]],
    *,
    batched: bool,
    start_ns: int,
    inputs_done_ns: int,
    outputs_start_ns: int,
) -> tuple[list[InferResponse], tuple[int, int]]:
    """:func:`split_outputs`, then the batch's phases (monotonic ns): each sampled request's trace
    gets its compute split, and the (input, output) phase durations are returned (an instance's
    ``last_phases_ns``)."""
    responses = split_outputs(requests, outputs, batched=batched)
    done = time.monotonic_ns()
    phases = (inputs_done_ns - start_ns, outputs_start_ns - inputs_done_ns, done - outputs_start_ns)
    for request in requests:
        if request.trace is not None:  # sampled (tracing.py)
            request.trace.compute_split(*phases)
    return responses, (phases[0], phases[2])
