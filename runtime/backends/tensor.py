"""Shared batch plumbing for backends that run one function on whole tensors (ONNX Runtime, torch).

``merge_inputs`` concatenates the requests of a batch along the batch dimension and
``split_outputs`` cuts the results back per request; both are pure and run on a worker thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sluice.runtime.types import InferRequest, InferResponse, Tensor


def merge_inputs(requests: Sequence[InferRequest]) -> dict[str, np.ndarray]:
    """One array per input name; a single request is passed through without a copy."""
    if len(requests) == 1:
        return {t.name: t.data for t in requests[0].inputs}
    merged: dict[str, list[np.ndarray]] = {}
    for request in requests:
        for tensor in request.inputs:
            merged.setdefault(tensor.name, []).append(tensor.data)
    return {name: np.concatenate(parts, axis=0) for name, parts in merged.items()}


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
