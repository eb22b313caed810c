"""``sluice.client``: a deliberately small helper over Triton's own ``tritonclient``.

    from sluice.client import Client

    with Client("localhost:8001", caller="billing-api") as client:      # protocol="http" for :8000
        out = client.infer("mlp", {"INPUT0": np.ones((4, 256), np.float32)})
        out["OUTPUT0"]                                                    # a numpy array

What it does, and all it does: builds the request from numpy arrays by the model's metadata
(fetched once per model and version, then cached), checks each array's dtype and shape against that
metadata before anything is sent (an error names the input, the expected and the given
dtype/shape), names the caller on every call (the ``Sluice-Caller`` header, gRPC metadata
``sluice-caller``, so the server's per-caller metrics can tell this client's traffic and its
duplicates apart), and returns the outputs as a dict of arrays. Server errors come through as
``tritonclient``'s ``InferenceServerException``, unchanged.

Why it stays this small: client libraries that retry, hedge, fail over or batch behind the caller's
back are what made duplicate and retry traffic invisible when we ran Triton in production: one slow
model turned into a retry storm nobody had written. Only the caller knows whether a request is
idempotent and how long it is worth waiting, so retries, deadlines and fan-out belong in the
calling code, where they can be read. This helper adds no retries, no background threads, no
connection pools of its own and no caching of results; anything it cannot do is one
``tritonclient`` call away (``Client.triton`` is the underlying client).

It imports only ``numpy`` and ``tritonclient`` (an import contract in pyproject.toml keeps it from
the server's and the operator's code), so it installs wherever ``tritonclient`` does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["Client", "InputError", "cuda_ipc_handle", "torch_ipc_memhandle"]

PROTOCOLS = ("grpc", "http")
_CALLER = re.compile(r"[A-Za-z0-9._:/@-]{1,64}")
_RESERVED = ("other", "unknown")


class InputError(ValueError):
    """The arrays given do not fit the model's inputs (raised before anything is sent)."""


def _expected_dtype(datatype: str) -> np.dtype | None:
    """The numpy dtype of a V2 datatype; None for BYTES (object, bytes or str arrays)."""
    if datatype == "BYTES":
        return None
    from tritonclient.utils import triton_to_np_dtype

    return np.dtype(triton_to_np_dtype(datatype))


def _shape_fits(expected: Sequence[int], given: tuple[int, ...]) -> bool:
    return len(expected) == len(given) and all(e < 0 or e == g for e, g in zip(expected, given, strict=True))


class Client:
    """One model server, one caller name. ``url`` is ``host:port`` (gRPC by default, 8001; HTTP 8000)."""

    def __init__(self, url: str, *, caller: str, protocol: str = "grpc") -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol {protocol!r} is not supported; allowed: {', '.join(PROTOCOLS)}")
        if not _CALLER.fullmatch(caller) or caller in _RESERVED:
            raise ValueError(
                f"caller {caller!r} is not allowed; allowed: 1 to 64 characters of A-Z a-z 0-9 . _ : / @ - "
                "(not 'other' or 'unknown')"
            )
        self.url = url
        self.caller = caller
        self.protocol = protocol
        if protocol == "grpc":
            import tritonclient.grpc as module

            self._headers = {"sluice-caller": caller}
        else:
            import tritonclient.http as module  # type: ignore[no-redef]

            self._headers = {"Sluice-Caller": caller}
        self._module: Any = module
        self.triton: Any = module.InferenceServerClient(url)
        self._metadata: dict[tuple[str, str], dict[str, Any]] = {}

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.triton.close()

    def metadata(self, model: str, version: str = "") -> dict[str, Any]:
        """The model's metadata (``name``, ``inputs``, ``outputs`` with ``datatype`` and ``shape``),
        fetched on first use and kept for the life of this client."""
        key = (model, version)
        meta = self._metadata.get(key)
        if meta is None:
            if self.protocol == "grpc":
                meta = self.triton.get_model_metadata(model, version, headers=self._headers, as_json=True)
                for spec in (*meta.get("inputs", ()), *meta.get("outputs", ())):
                    spec["shape"] = [int(d) for d in spec.get("shape", ())]  # int64 comes as strings in JSON
            else:
                meta = self.triton.get_model_metadata(model, version, headers=self._headers)
            self._metadata[key] = meta
        return meta

    def infer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray] | Sequence[np.ndarray],
        outputs: Sequence[str] | None = None,
        version: str = "",
    ) -> dict[str, np.ndarray]:
        """Run ``model`` once. ``inputs``: arrays by input name, or a sequence of arrays in the order
        the model's metadata lists its inputs. ``outputs``: the names wanted (default: all). Raises
        InputError when the arrays do not fit the metadata, InferenceServerException when the server
        answers with an error; never retries."""
        meta = self.metadata(model, version)
        specs = meta.get("inputs", [])
        arrays = self._by_name(model, specs, inputs)
        module = self._module
        request = []
        for spec in specs:
            name = spec["name"]
            array = arrays[name]
            tensor = module.InferInput(name, list(array.shape), spec["datatype"])
            if self.protocol == "http":
                tensor.set_data_from_numpy(array, binary_data=True)
            else:
                tensor.set_data_from_numpy(array)
            request.append(tensor)
        names = list(outputs) if outputs is not None else [spec["name"] for spec in meta.get("outputs", [])]
        wanted = [
            module.InferRequestedOutput(name, binary_data=True)
            if self.protocol == "http"
            else module.InferRequestedOutput(name)
            for name in names
        ]
        result = self.triton.infer(model, request, model_version=version, outputs=wanted, headers=self._headers)
        return {name: result.as_numpy(name) for name in names}

    def _by_name(
        self, model: str, specs: list[dict[str, Any]], inputs: Mapping[str, np.ndarray] | Sequence[np.ndarray]
    ) -> dict[str, np.ndarray]:
        """The arrays by input name, each checked against its input's datatype and shape."""
        declared = [spec["name"] for spec in specs]
        if isinstance(inputs, Mapping):
            unknown = [name for name in inputs if name not in declared]
            if unknown:
                shown = ", ".join(map(repr, unknown))
                raise InputError(f"model '{model}' has no input {shown}; its inputs: {declared}")
            missing = [name for name in declared if name not in inputs]
            if missing:
                shown = ", ".join(map(repr, missing))
                raise InputError(f"model '{model}' needs input {shown}; its inputs: {declared}")
            given = {name: np.asarray(array) for name, array in inputs.items()}
        else:
            if len(inputs) != len(declared):
                raise InputError(
                    f"model '{model}' takes {len(declared)} input(s) {declared} in this order, "
                    f"got {len(inputs)} array(s)"
                )
            given = {name: np.asarray(array) for name, array in zip(declared, inputs, strict=True)}
        for spec in specs:
            name = spec["name"]
            array = given[name]
            datatype, shape = spec["datatype"], spec["shape"]
            dtype = _expected_dtype(datatype)
            dtype_ok = array.dtype.kind in "OSU" if dtype is None else array.dtype == dtype
            if not dtype_ok or not _shape_fits(shape, array.shape):
                expected = "object/bytes/str" if dtype is None else str(dtype)
                raise InputError(
                    f"input '{name}' of model '{model}': expected {datatype} ({expected}) with shape {shape} "
                    f"(-1: any size), got {array.dtype} with shape {list(array.shape)}"
                )
        return given


# -- CUDA shared memory from torch tensors ------------------------------------------------------------

CUDA_IPC_HANDLE_BYTES = 64
"""``sizeof(cudaIpcMemHandle_t)``: what Triton's CUDA shared-memory registration takes (base64)."""


def torch_ipc_memhandle(handle: bytes) -> bytes:
    """The 64-byte ``cudaIpcMemHandle_t`` inside the handle torch's caching allocator shares
    (``untyped_storage()._share_cuda_()[1]``): since torch 2.2 it is prefixed with a version byte
    and a type byte, ``c`` for a block from ``cudaMalloc``. ValueError for anything else: an
    expandable segment (``e``) has no ``cudaIpcMemHandle_t`` at all."""
    if len(handle) == CUDA_IPC_HANDLE_BYTES:
        return handle  # torch before 2.2: the bare handle
    kind = handle[1:2]
    if len(handle) == CUDA_IPC_HANDLE_BYTES + 2 and kind == b"c":
        return handle[2:]
    if kind == b"e":
        raise ValueError(
            "the tensor lives in an expandable segment, which has no cudaIpcMemHandle_t; allowed: memory from "
            "cudaMalloc (unset expandable_segments in PYTORCH_CUDA_ALLOC_CONF)"
        )
    raise ValueError(
        f"not a CUDA IPC handle torch shares ({len(handle)} bytes, type byte {kind!r}); allowed: 64 bytes, or 66 "
        "starting with a version byte and b'c'"
    )


def cuda_ipc_handle(tensor: Any) -> tuple[bytes, int]:
    """For a torch CUDA tensor: the ``cudaIpcMemHandle_t`` of the allocation holding it and the byte
    offset of its storage there. Register ``offset + nbytes`` bytes under the handle (base64) and
    pass ``offset`` as the input's shared-memory offset: torch's allocator hands out parts of larger
    blocks, and the handle names the block."""
    shared = tensor.untyped_storage()._share_cuda_()
    return torch_ipc_memhandle(bytes(shared[1])), int(shared[3])

