"""Triton's system and CUDA shared-memory extensions: the regions clients registered, and the binding
of an inference request's inputs and outputs to them.

Who calls it: ``server.Server`` owns one :class:`Registry` (closed on stop) and hands it to the data
plane; the HTTP routes and gRPC handlers register, unregister and list regions through it; the
codecs give an input that names a region a :func:`placeholder` of its shape (no data yet); and
``DataPlane.infer_nowait`` calls :func:`bind` before the request goes anywhere, and the
:class:`Binding`'s ``finish`` when it is answered.

Pure parts: :func:`key_problem`, :func:`name_problem`, :func:`parse_ref`, :func:`span_problem`,
:func:`cuda_registration`, :func:`parse_cuda_body`. The I/O is one thin function for system regions,
:func:`_map` (``os.open`` of ``/dev/shm/<key>`` + ``mmap``, read-write, since outputs are written
there), and ``cudart`` for CUDA regions.

CUDA regions (:class:`CudaRegion`): a client's ``cudaIpcMemHandle_t``, opened with
``cudaIpcOpenMemHandle`` on the device it names. System and CUDA regions share one namespace (as in
Triton: a name is registered once, whichever the kind) and the same holding scheme below; the IPC
handle is closed when the last holder lets go. The backends run on the CPU, so an input in a CUDA
region is copied to host memory when the request is bound (one ``cudaMemcpy``), and an output is
copied into its region when the request is answered. CUDA is loaded lazily (``cudart.Loader``), on
the first CUDA registration or server metadata read; without it, registering answers why.

Lifetime. Inputs are handed on as read-only numpy *views* of the region, not copies: a 4 MB
tensor is not copied once more on its way to the model (dynamic batching still concatenates a
batch of several into a new array: that is its one copy). A view is only safe while the region
stays mapped, so every region a request names is *held* from ``bind`` until the request is
answered (``Binding.finish``, also for errors, cancellations and cache hits). Unregistering a held
region frees its name at once (a new region may take it) but unmaps the memory only when its last
holder lets go. As a second line, Python's ``mmap`` refuses to close while any buffer of it is
exported (a view a model kept past its request): then the mapping is left to go with the last view.

Not prevented (as in Triton): a client that shrinks the shared-memory object after registering it
makes reads past the new end fault. The size is checked again each time a request takes the region,
which narrows that to a race with the client's own ``ftruncate``.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import errno
import mmap
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from sluice.runtime import cudart
from sluice.runtime.errors import AlreadyExists, Internal, InvalidArgument, NotFound, SluiceError
from sluice.runtime.tensor_bytes import bytes_elements, encode_bytes_elements
from sluice.runtime.types import (
    ELEMENT_SIZE,
    SHM_BYTE_SIZE,
    SHM_OFFSET,
    SHM_REGION,
    WIRE_DTYPE,
    InferResponse,
    Tensor,
)
from sluice.runtime.types import names_region as names_region  # the codecs call shm.names_region
from sluice.runtime.types import placeholder as placeholder

REGION, BYTE_SIZE, OFFSET = SHM_REGION, SHM_BYTE_SIZE, SHM_OFFSET
PARAMETERS = (REGION, BYTE_SIZE, OFFSET)
"""Tensor parameters of Triton's shared-memory extension (inputs and requested outputs)."""

SHM_DIRECTORY = Path("/dev/shm")
"""Where Linux keeps POSIX shared-memory objects (``shm_open(key)`` is ``/dev/shm/<key>``)."""

KEY_ALLOWED = "a POSIX shared-memory name: '/name' (one leading '/', no other '/'), at most 255 bytes, not '.' or '..'"

SYSTEM, CUDA = "system", "CUDA"
"""The two kinds of region (Triton's TRITONSERVER_MEMORY_CPU and _GPU); as written in messages."""

CUDA_BODY = (
    '{"raw_handle": {"b64": "<base64 of the 64-byte cudaIpcMemHandle_t>"}, "device_id": <GPU index>, '
    '"byte_size": <bytes>}'
)
"""The body of ``POST /v2/cudasharedmemory/region/<name>/register`` (what tritonclient sends)."""


# -- pure checks ----------------------------------------------------------------------------------


def key_problem(key: object) -> str | None:
    """What is wrong with a client's shared-memory key, or None."""
    if not isinstance(key, str):
        return f"must be a string, got {type(key).__name__}"
    name = key.lstrip("/")
    if not name:
        return "is empty"
    if "/" in name:
        return "holds a '/' after the leading one"
    if name == ".":
        return "is '.'"
    if ".." in name:
        return "holds '..'"
    if any(ord(c) < 0x20 or c == "\x7f" for c in name):
        return "holds control characters"
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid UTF-8 (it holds a lone surrogate)"
    if len(encoded) > 255:
        return "is longer than 255 bytes"
    return None


def name_problem(name: object) -> str | None:
    """What is wrong with a region name, or None (any text of 1 to 255 characters, no control characters)."""
    if not isinstance(name, str) or not name:
        return "a region needs a non-empty name"
    if len(name) > 255:
        return "a region name is at most 255 characters"
    if any(ord(c) < 0x20 or c == "\x7f" for c in name):
        return "a region name may not hold control characters"
    return None


def _count(value: object, field: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{where}: {field} must be an integer, got {value!r}")
    if value < 0:
        raise InvalidArgument(f"{where}: {field} must be >= 0, got {value}")
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class Ref:
    """Where a tensor lives: ``byte_size`` bytes at ``offset`` in the region named ``region``."""

    region: str
    byte_size: int
    offset: int = 0


def parse_ref(parameters: dict[str, Any], where: str) -> Ref | None:
    """The shared-memory reference in a tensor's parameters, or None when it names no region."""
    if not names_region(parameters):
        return None
    region = parameters.get(REGION)
    if region is None:
        raise InvalidArgument(f"{where}: {BYTE_SIZE} or {OFFSET} given without {REGION}; give all, or none")
    problem = name_problem(region)
    if problem is not None:
        raise InvalidArgument(f"{where}: {REGION}: {problem}")
    if BYTE_SIZE not in parameters:
        raise InvalidArgument(f"{where}: {REGION} '{region}' needs {BYTE_SIZE} (the tensor's size in bytes)")
    byte_size = _count(parameters[BYTE_SIZE], BYTE_SIZE, where)
    offset = _count(parameters.get(OFFSET, 0), OFFSET, where)
    return Ref(region, byte_size, offset)


def span_problem(ref: Ref, region_size: int) -> str | None:
    """Whether ``ref`` lies inside a region of ``region_size`` bytes (None) or what is wrong."""
    if ref.offset + ref.byte_size <= region_size:
        return None
    return (
        f"offset {ref.offset} + byte_size {ref.byte_size} runs past the end of shared memory region "
        f"'{ref.region}' ({region_size} bytes); allowed: offset + byte_size <= {region_size}"
    )


def strip(parameters: dict[str, Any]) -> dict[str, Any]:
    """Parameters without the shared-memory ones (they are not forwarded, cached or shown to models)."""
    return {k: v for k, v in parameters.items() if k not in PARAMETERS}


@dataclasses.dataclass(frozen=True, slots=True)
class CudaRegistration:
    """A checked request to register a CUDA region: ``byte_size`` bytes of the allocation behind
    ``raw_handle`` (a ``cudaIpcMemHandle_t``) on GPU ``device_id``."""

    name: str
    raw_handle: bytes
    device_id: int
    byte_size: int


def cuda_registration(name: object, raw_handle: object, device_id: object, byte_size: object) -> CudaRegistration:
    """Check the values of a CUDA registration (gRPC gives them as they are; HTTP through
    :func:`parse_cuda_body`). Raises InvalidArgument naming the region, the field and what is allowed."""
    problem = name_problem(name)
    if problem is not None:
        raise InvalidArgument(f"failed to register CUDA shared memory region: {problem}")
    assert isinstance(name, str)
    fail = f"failed to register CUDA shared memory region '{name}'"
    if not isinstance(raw_handle, bytes) or len(raw_handle) != cudart.IPC_HANDLE_SIZE:
        got = f"{len(raw_handle)} bytes" if isinstance(raw_handle, bytes) else type(raw_handle).__name__
        raise InvalidArgument(
            f"{fail}: 'raw_handle' must be a cudaIpcMemHandle_t of {cudart.IPC_HANDLE_SIZE} bytes (as "
            f"cudaIpcGetMemHandle makes it; over HTTP base64-encoded), got {got}"
        )
    if isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 0:
        raise InvalidArgument(f"{fail}: 'device_id' must be an integer >= 0 (the GPU's index), got {device_id!r}")
    if isinstance(byte_size, bool) or not isinstance(byte_size, int) or byte_size <= 0:
        raise InvalidArgument(f"{fail}: 'byte_size' must be an integer > 0, got {byte_size!r}")
    return CudaRegistration(name, raw_handle, device_id, byte_size)


def parse_cuda_body(name: str, body: object) -> CudaRegistration:
    """The JSON body of an HTTP CUDA registration, checked (before CUDA is consulted)."""
    fail = f"failed to register CUDA shared memory region '{name}'"
    if not isinstance(body, dict):
        raise InvalidArgument(f"{fail}: the body must be a JSON object {CUDA_BODY}")
    for field in ("raw_handle", "device_id", "byte_size"):
        if field not in body:
            raise InvalidArgument(f"{fail}: the body has no '{field}'; allowed: {CUDA_BODY}")
    raw = body["raw_handle"]
    if not isinstance(raw, dict) or not isinstance(raw.get("b64"), str):
        raise InvalidArgument(f'{fail}: \'raw_handle\' must be an object {{"b64": "<base64>"}}, got {_shown(raw)}')
    try:
        handle = base64.b64decode(raw["b64"], validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument(f"{fail}: 'raw_handle.b64' is not valid base64") from None
    return cuda_registration(name, handle, body["device_id"], body["byte_size"])


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# -- mapping (the only I/O) -----------------------------------------------------------------------


def _map(path: Path, key: str, name: str, offset: int, byte_size: int) -> tuple[int, mmap.mmap, int]:
    """Open and map ``byte_size`` bytes at ``offset`` of the object at ``path``, read-write:
    (fd kept for later size checks, the mapping, where the window starts in it)."""
    fail = f"failed to register shared memory region '{name}'"
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InvalidArgument(
            f"{fail}: no shared memory object with key '{key}' (create it first, e.g. with "
            "tritonclient.utils.shared_memory.create_shared_memory_region, on the server's host or pod)"
        ) from None
    except PermissionError:
        raise InvalidArgument(f"{fail}: the server may not read and write the object with key '{key}'") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InvalidArgument(f"{fail}: key '{key}' is a symbolic link; allowed: a shared memory object") from None
        raise InvalidArgument(f"{fail}: cannot open key '{key}': {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidArgument(f"{fail}: key '{key}' is not a shared memory object")
        problem = span_problem(Ref(name, byte_size, offset), info.st_size)
        if problem is not None:
            raise InvalidArgument(f"{fail}: {problem} (the object with key '{key}' is {info.st_size} bytes)")
        if byte_size == 0:
            raise InvalidArgument(f"{fail}: byte_size must be > 0")
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(
            fd, offset + byte_size - start, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=start
        )
    except BaseException:
        os.close(fd)
        raise
    return fd, mapping, offset - start


class Region:
    """One registered system region; held by the requests using it (``holders``)."""

    __slots__ = ("_fd", "_mapping", "_start", "byte_size", "holders", "key", "name", "offset", "unregistered")
    kind = SYSTEM

    def __init__(self, name: str, key: str, offset: int, byte_size: int, fd: int, mapping: mmap.mmap, start: int):
        self.name = name
        self.key = key
        self.offset = offset
        self.byte_size = byte_size
        self._fd = fd
        self._mapping: mmap.mmap | None = mapping
        self._start = start
        self.holders = 0
        self.unregistered = False

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    def still_whole(self) -> bool:
        """The object still covers the registered window (a client may have shrunk it since)."""
        try:
            return os.fstat(self._fd).st_size >= self.offset + self.byte_size
        except OSError:
            return False

    def window(self, ref: Ref) -> memoryview:
        """The bytes ``ref`` names; the caller checked ``span_problem`` against ``byte_size``."""
        assert self._mapping is not None
        begin = self._start + ref.offset
        return memoryview(self._mapping)[begin : begin + ref.byte_size]

    def read(self, ref: Ref, where: str) -> memoryview:
        """An input's bytes: a view of the mapping (no copy)."""
        return self.window(ref)

    def write(self, ref: Ref, blob: np.ndarray) -> None:
        """Put an output's bytes (``blob``, uint8, at most ``ref.byte_size``) at ``ref``."""
        window = self.window(ref)
        np.frombuffer(window, dtype=np.uint8, count=blob.size)[:] = blob
        window.release()

    def close(self) -> None:
        mapping, self._mapping = self._mapping, None
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                pass  # a view outlived its request: the mapping goes when the last view does
            os.close(self._fd)


class CudaRegion:
    """One registered CUDA region: a client's allocation opened through its IPC handle."""

    __slots__ = ("_device", "_pointer", "byte_size", "device_id", "holders", "name", "unregistered")
    kind = CUDA

    def __init__(self, name: str, device_id: int, byte_size: int, device: cudart.Device, pointer: int) -> None:
        self.name = name
        self.device_id = device_id
        self.byte_size = byte_size
        self._device = device
        self._pointer: int | None = pointer
        self.holders = 0
        self.unregistered = False

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}

    def read(self, ref: Ref, where: str) -> memoryview:
        """An input's bytes, copied to host memory (the backends run on the CPU)."""
        assert self._pointer is not None
        host = np.empty(ref.byte_size, dtype=np.uint8)
        if ref.byte_size:
            try:
                self._device.to_host(host.ctypes.data, self._pointer + ref.offset, ref.byte_size, self.device_id)
            except cudart.CudaError as exc:
                raise Internal(f"{where}: reading CUDA shared memory region '{self.name}' failed: {exc}") from None
        return host.data

    def write(self, ref: Ref, blob: np.ndarray) -> None:
        assert self._pointer is not None
        blob = np.ascontiguousarray(blob)
        try:
            self._device.to_device(self._pointer + ref.offset, blob.ctypes.data, int(blob.size), self.device_id)
        except cudart.CudaError as exc:
            raise Internal(f"writing CUDA shared memory region '{self.name}' failed: {exc}") from None

    def close(self) -> None:
        pointer, self._pointer = self._pointer, None
        if pointer is not None:
            try:
                self._device.close_ipc(pointer, self.device_id)
            except cudart.CudaError:
                pass  # nothing a client can do about it; the handle goes with the process


AnyRegion = Region | CudaRegion


class Registry:
    """The regions of one server, by name (system and CUDA in one namespace, as in Triton).
    Registration and binding run on the event loop; the lock keeps the bookkeeping whole should a
    worker thread ever release a region. ``cuda`` loads the CUDA runtime when first needed."""

    def __init__(self, directory: Path = SHM_DIRECTORY, cuda: cudart.Provider | None = None) -> None:
        self._directory = directory
        self._cuda = cuda if cuda is not None else cudart.Loader()
        self._regions: dict[str, AnyRegion] = {}
        self._lock = threading.Lock()

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        problem = name_problem(name)
        if problem is not None:
            raise InvalidArgument(f"failed to register shared memory region: {problem}")
        problem = key_problem(key)
        if problem is not None:
            raise InvalidArgument(
                f"failed to register shared memory region '{name}': key {problem}; allowed: {KEY_ALLOWED}"
            )
        where = f"failed to register shared memory region '{name}'"
        _count(offset, "offset", where)
        _count(byte_size, "byte_size", where)
        self._check_free(name)
        fd, mapping, start = _map(self._directory / key.lstrip("/"), key, name, offset, byte_size)
        self._add(Region(name, key, offset, byte_size, fd, mapping, start))

    def cuda_usable(self) -> bool:
        """Whether CUDA regions can be registered here (loads the CUDA runtime the first time)."""
        return self._cuda.usable()

    def register_cuda(self, registration: CudaRegistration) -> None:
        """Open the client's IPC handle on its device as region ``registration.name``."""
        name, device_id = registration.name, registration.device_id
        fail = f"failed to register CUDA shared memory region '{name}'"
        try:
            device = self._cuda.get()
        except cudart.NoCuda as exc:
            raise InvalidArgument(
                f"{fail}: GPUs not supported: {exc}; use system shared memory (register_system_shared_memory)"
            ) from None
        count = device.device_count()
        if device_id >= count:
            raise InvalidArgument(
                f"{fail}: device_id {device_id} is out of range: this server sees {count} GPU(s); "
                f"allowed: 0 to {count - 1}"
            )
        self._check_free(name)
        try:
            pointer = device.open_ipc(registration.raw_handle, device_id)
        except cudart.CudaError as exc:
            raise InvalidArgument(
                f"{fail}: cannot open its IPC handle on GPU {device_id} ({exc}); the handle must come from "
                "cudaIpcGetMemHandle in another process on this host, for memory still allocated on that GPU"
            ) from None
        try:
            size = device.allocation_size(pointer, device_id)
        except cudart.CudaError as exc:
            device.close_ipc(pointer, device_id)
            raise InvalidArgument(
                f"{fail}: cannot size the CUDA allocation behind the handle ({exc}), so byte_size "
                f"{registration.byte_size} cannot be checked against it"
            ) from None
        if size is None:  # no driver library to ask: a region that cannot be checked is not taken (Triton)
            device.close_ipc(pointer, device_id)
            raise InvalidArgument(
                f"{fail}: the CUDA driver library (libcuda.so.1) cannot be loaded to size the allocation behind "
                "the handle, so byte_size cannot be checked against it"
            )
        if registration.byte_size > size:
            device.close_ipc(pointer, device_id)
            raise InvalidArgument(
                f"{fail}: byte_size {registration.byte_size} is larger than the CUDA allocation behind the "
                f"handle ({size} bytes); allowed: byte_size <= {size}"
            )
        self._add(CudaRegion(name, device_id, registration.byte_size, device, pointer))

    def _check_free(self, name: str) -> None:
        if name in self._regions:
            raise AlreadyExists(
                f"shared memory region '{name}' already in manager; unregister it first or pick another name"
            )

    def _add(self, region: AnyRegion) -> None:
        with self._lock:
            if region.name in self._regions:  # pragma: no cover - registration runs on the event loop only
                region.close()
                raise AlreadyExists(f"shared memory region '{region.name}' already in manager")
            self._regions[region.name] = region

    def unregister(self, name: str = "", kind: str = SYSTEM) -> None:
        """Forget ``name`` (every region of ``kind`` for ""); an unknown name, or one of the other kind,
        is no error, as in Triton. A region requests still hold is let go when the last of them is
        answered."""
        with self._lock:
            if name:
                names = [name] if name in self._regions and self._regions[name].kind == kind else []
            else:
                names = [each for each, region in self._regions.items() if region.kind == kind]
            for each in names:
                region = self._regions.pop(each)
                region.unregistered = True
                if region.holders == 0:
                    region.close()

    def status(self, name: str = "", kind: str = SYSTEM) -> list[dict[str, Any]]:
        with self._lock:
            if not name:
                return [region.status() for region in self._regions.values() if region.kind == kind]
            region = self._regions.get(name)
        if region is None:
            raise NotFound(f"Unable to find {kind.lower()} shared memory region: '{name}'")
        if region.kind != kind:
            raise NotFound(
                f"The region named '{name}' is registered as {region.kind} shared memory, not {kind} shared memory"
            )
        return [region.status()]

    def hold(self, ref: Ref, where: str) -> AnyRegion:
        """Take the region ``ref`` names for a request, after checking ``ref`` lies inside it."""
        with self._lock:
            region = self._regions.get(ref.region)
            if region is None:
                raise NotFound(
                    f"{where}: Unable to find shared memory region: '{ref.region}'; register it first "
                    f"(registered: {len(self._regions)})"
                )
            problem = span_problem(ref, region.byte_size)
            if problem is not None:
                raise InvalidArgument(f"{where}: {problem}")
            if isinstance(region, Region) and not region.still_whole():
                raise InvalidArgument(
                    f"{where}: shared memory region '{ref.region}' was shrunk below its registered size "
                    f"({region.offset + region.byte_size} bytes); unregister it and register it again"
                )
            region.holders += 1
            return region

    def let_go(self, region: AnyRegion) -> None:
        with self._lock:
            region.holders -= 1
            if region.holders == 0 and region.unregistered:
                region.close()

    def close(self) -> None:
        """Let go of every region no request holds (the server stops)."""
        self.unregister(kind=SYSTEM)
        self.unregister(kind=CUDA)


# -- binding a request ------------------------------------------------------------------------------


class Binding:
    """The regions one request holds, and where its outputs go."""

    __slots__ = ("_held", "_registry", "inputs", "outputs")

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._held: list[AnyRegion] = []
        self.inputs: list[Tensor] = []  # tensors whose data is a view of a held region
        self.outputs: dict[str, tuple[Ref, AnyRegion]] = {}

    def hold(self, ref: Ref, where: str) -> AnyRegion:
        region = self._registry.hold(ref, where)
        self._held.append(region)
        return region

    def release(self) -> None:
        # The request is answered: its views go now (not when the request object is collected), so
        # an unregistered region is unmapped at once. A view a model kept is the mmap's to guard.
        for tensor in self.inputs:
            tensor.data = placeholder(tensor.datatype, tensor.data.shape)
        self.inputs = []
        held, self._held = self._held, []
        for region in held:
            self._registry.let_go(region)

    def finish(self, outcome: InferResponse | SluiceError) -> InferResponse | SluiceError:
        """Write the outputs asked for in shared memory (a new response; a cached one is never
        changed) and let the regions go. Called once, when the request is answered."""
        try:
            return self.written(outcome)
        finally:
            self.release()

    def written(self, outcome: InferResponse | SluiceError) -> InferResponse | SluiceError:
        """``outcome`` with the outputs asked for written in shared memory, the regions still held: one
        of a decoupled model's responses (each one is written over the last, as in Triton)."""
        if isinstance(outcome, SluiceError) or not self.outputs or not self._held:
            return outcome
        return self._write(outcome)

    def _write(self, response: InferResponse) -> InferResponse | SluiceError:
        outputs = []
        for tensor in response.outputs:
            target = self.outputs.get(tensor.name)
            if target is None:
                outputs.append(tensor)
                continue
            ref, region = target
            if tensor.datatype == "BYTES":
                blob = np.frombuffer(encode_bytes_elements(tensor.data), dtype=np.uint8)
            else:
                blob = np.ascontiguousarray(tensor.data, dtype=WIRE_DTYPE[tensor.datatype]).reshape(-1).view(np.uint8)
            size = int(blob.size)
            if size > ref.byte_size:
                shape = "[" + ",".join(str(d) for d in tensor.data.shape) + "]"
                return InvalidArgument(
                    f"shared memory size specified with the request for output '{tensor.name}' ({ref.byte_size} "
                    f"bytes) should be at least {size} bytes to hold the results (shape {shape} of "
                    f"{tensor.datatype}); region '{ref.region}'"
                )
            if size:
                try:
                    region.write(ref, blob)
                except SluiceError as exc:
                    return exc
            parameters: dict[str, Any] = {REGION: ref.region, BYTE_SIZE: size}
            if ref.offset:
                parameters[OFFSET] = ref.offset
            outputs.append(
                Tensor(tensor.name, tensor.datatype, placeholder(tensor.datatype, tensor.data.shape), parameters)
            )
        return InferResponse(response.model_name, response.model_version, outputs, response.id, response.parameters)


def _size_problem(tensor: Tensor, ref: Ref) -> str | None:
    """Whether a fixed-size input's ``shared_memory_byte_size`` is its size (BYTES: checked on reading)."""
    if tensor.datatype == "BYTES":
        return None
    needed = int(tensor.data.size) * ELEMENT_SIZE[tensor.datatype]
    if ref.byte_size == needed:
        return None
    dims = "[" + ",".join(str(d) for d in tensor.data.shape) + "]"
    return (
        f"input '{tensor.name}': {BYTE_SIZE} is {ref.byte_size} but shape {dims} of {tensor.datatype} needs "
        f"{needed} bytes (region '{ref.region}')"
    )


def _input_array(tensor: Tensor, window: memoryview) -> np.ndarray:
    shape = tensor.data.shape
    if tensor.datatype == "BYTES":
        return bytes_elements(tensor.name, window, int(tensor.data.size)).reshape(shape)
    return np.frombuffer(window.toreadonly(), dtype=WIRE_DTYPE[tensor.datatype]).reshape(shape)


def bind(
    registry: Registry, inputs: list[Tensor], outputs: list[Any] | None, refuse: Callable[[Any], str | None]
) -> Binding:
    """Read the inputs that name a region (views, see the module docstring), note where the outputs
    go, and hold every region named until ``Binding.finish``. ``refuse(output)`` says why an output
    cannot go to shared memory (e.g. classification), or None. Raises SluiceError, holding nothing.
    Every reference is checked before any input is read (a CUDA input is a copy: none for a request
    refused anyway)."""
    binding = Binding(registry)
    try:
        reads: list[tuple[Tensor, Ref, AnyRegion, str]] = []
        for tensor in inputs:
            where = f"input '{tensor.name}'"
            ref = parse_ref(tensor.parameters, where)
            if ref is None:
                continue
            region = binding.hold(ref, where)
            problem = _size_problem(tensor, ref)
            if problem is not None:
                raise InvalidArgument(problem)
            reads.append((tensor, ref, region, where))
        for output in outputs or ():
            where = f"output '{output.name}'"
            ref = parse_ref(output.parameters, where)
            if ref is None:
                continue
            why = refuse(output)
            if why is not None:
                raise InvalidArgument(f"{where}: {why}")
            binding.outputs[output.name] = (ref, binding.hold(ref, where))
        for tensor, ref, region, where in reads:
            tensor.data = _input_array(tensor, region.read(ref, where))
            binding.inputs.append(tensor)
            tensor.parameters = strip(tensor.parameters)
        for output in outputs or ():
            if output.name in binding.outputs:
                output.parameters = strip(output.parameters)
    except BaseException:
        binding.release()
        raise
    return binding
