"""The CUDA runtime (``libcudart``) through ctypes: the few calls Triton's CUDA shared-memory
extension needs, and nothing else (no torch, no cuda-python in the runtime).

Who calls it: ``shm.Registry`` holds a :class:`Loader` and asks it for a :class:`Device` the first
time a CUDA region is registered or the server metadata is read. Nothing is loaded at import.

* :class:`Loader` finds ``libcudart.so*`` (the dynamic loader's path first, then the
  ``nvidia-cuda-runtime`` wheel that torch ships under ``site-packages/nvidia/cuda_runtime/lib``, then
  ``/usr/local/cuda``), loads it once and remembers the outcome: a :class:`Runtime`, or
  :class:`NoCuda` saying why not ("no CUDA runtime found" or "no GPU visible").
* :class:`Runtime` is the thin layer: ``cudaGetDeviceCount``, ``cudaSetDevice``,
  ``cudaIpcOpenMemHandle`` (``cudaIpcMemLazyEnablePeerAccess``), ``cudaIpcCloseMemHandle``,
  ``cudaMemcpy`` (device to host for inputs, host to device for outputs: the backends are CPU), error
  text from ``cudaGetErrorName`` / ``cudaGetErrorString``; and the driver's ``cuMemGetAddressRange``
  (as Triton) to check a registered size against the allocation behind a handle.
* :class:`Device` is what ``shm`` uses of it (a protocol, so tests of the region bookkeeping can run
  without a GPU).
* For the TensorRT backend (``backends/tensorrt.py``), which needs device buffers and a stream per
  instance: ``cudaMalloc`` / ``cudaFree``, ``cudaStreamCreateWithFlags`` (non-blocking) /
  ``cudaStreamSynchronize`` / ``cudaStreamDestroy``, ``cudaMemcpyAsync`` on a stream. An
  out-of-memory answer is a :class:`CudaError` whose ``code`` is :data:`MEMORY_ALLOCATION`.

Pure parts: :func:`library_order`, :func:`no_gpu_reason`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import site
import sys
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

IPC_HANDLE_SIZE = 64
"""``sizeof(cudaIpcMemHandle_t)`` (``CUDA_IPC_HANDLE_SIZE``)."""

_SUCCESS = 0
MEMORY_ALLOCATION = 2
"""``cudaErrorMemoryAllocation``: the device is out of memory."""
_STREAM_NON_BLOCKING = 1
_INSUFFICIENT_DRIVER = 35
_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
_MEMCPY_HOST_TO_DEVICE = 1
_MEMCPY_DEVICE_TO_HOST = 2

LOADER_NAMES = ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0")
"""Names handed to the dynamic loader (``LD_LIBRARY_PATH``, the ldconfig cache) before any directory."""

_UNSET = object()
_NAME = re.compile(r"^libcudart\.so(?:\.(\d+(?:\.\d+)*))?$")


class NoCuda(Exception):
    """CUDA cannot be used here; the message says why, without paths of the server."""


class CudaError(Exception):
    """A CUDA call failed: ``call: cudaErrorX: text``."""

    def __init__(self, call: str, code: int, name: str, text: str) -> None:
        super().__init__(f"{call}: {name}: {text}")
        self.code = code


class Device(Protocol):
    """What the shared-memory registry uses of a CUDA runtime. Pointers and host addresses are ints."""

    def device_count(self) -> int: ...

    def open_ipc(self, handle: bytes, device_id: int) -> int: ...

    def allocation_size(self, pointer: int, device_id: int) -> int | None: ...

    def close_ipc(self, pointer: int, device_id: int) -> None: ...

    def to_host(self, host: int, pointer: int, byte_size: int, device_id: int) -> None: ...

    def to_device(self, pointer: int, host: int, byte_size: int, device_id: int) -> None: ...


class Provider(Protocol):
    """Where the registry gets its Device: a :class:`Loader` (tests of the bookkeeping give their own)."""

    def get(self) -> Device:
        """The usable CUDA runtime, or raises NoCuda saying why there is none."""
        ...

    def usable(self) -> bool: ...


# -- pure -------------------------------------------------------------------------------------------


def library_order(paths: Iterable[Path]) -> list[Path]:
    """The ``libcudart.so[.N[.M]]`` among ``paths``, highest version first (unversioned last)."""

    def version(path: Path) -> tuple[int, ...]:
        found = _NAME.match(path.name)
        assert found is not None
        return tuple(int(part) for part in found.group(1).split(".")) if found.group(1) else ()

    matching = [path for path in paths if _NAME.match(path.name)]
    return sorted(matching, key=version, reverse=True)


def no_gpu_reason(code: int, name: str, text: str, count: int, visible: str | None) -> str:
    """Why a loaded CUDA runtime offers no GPU: ``cudaGetDeviceCount`` answered ``code`` (0: success
    with ``count`` devices); ``visible`` is ``CUDA_VISIBLE_DEVICES`` (None: unset)."""
    why = f"cudaGetDeviceCount found {count} devices" if code == _SUCCESS else f"cudaGetDeviceCount: {name}: {text}"
    if code == _INSUFFICIENT_DRIVER:
        why += "; no NVIDIA driver is loaded, or it is older than this CUDA runtime"
    if visible is not None:
        why += f"; CUDA_VISIBLE_DEVICES is {visible!r}"
    return f"no GPU visible ({why})"


def search_directories(roots: Sequence[str] | None = None) -> list[Path]:
    """Where libcudart may lie besides the dynamic loader's path: NVIDIA's runtime wheels in each
    site-packages directory (``roots``; None: this interpreter's), then a system CUDA toolkit.

    The CUDA 12 wheel (nvidia-cuda-runtime-cu12) puts it in ``nvidia/cuda_runtime/lib``; the CUDA 13
    ones, which torch's cu130 builds install, in ``nvidia/cu13/lib`` (newest major first)."""
    if roots is None:
        roots = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    directories: list[Path] = []
    for root in dict.fromkeys(roots):
        if not root:
            continue
        nvidia = Path(root) / "nvidia"
        directories.append(nvidia / "cuda_runtime" / "lib")
        try:
            majors = [path for path in nvidia.glob("cu[0-9]*") if path.name[2:].isdigit()]
        except OSError:
            majors = []
        directories.extend(path / "lib" for path in sorted(majors, key=lambda path: -int(path.name[2:])))
    return [*directories, Path("/usr/local/cuda/lib64"), Path("/usr/local/cuda/lib")]


# -- the ctypes layer -------------------------------------------------------------------------------


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_SIZE)]


class Runtime:
    """A loaded ``libcudart`` (and, for allocation sizes, the driver it loaded)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._lib = library
        c_int, c_void_p, c_size_t = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
        for function, argtypes in (
            ("cudaGetDeviceCount", [ctypes.POINTER(c_int)]),
            ("cudaSetDevice", [c_int]),
            ("cudaIpcOpenMemHandle", [ctypes.POINTER(c_void_p), _IpcHandle, ctypes.c_uint]),
            ("cudaIpcCloseMemHandle", [c_void_p]),
            ("cudaMemcpy", [c_void_p, c_void_p, c_size_t, c_int]),
            ("cudaMalloc", [ctypes.POINTER(c_void_p), c_size_t]),
            ("cudaFree", [c_void_p]),
            ("cudaMemcpyAsync", [c_void_p, c_void_p, c_size_t, c_int, c_void_p]),
            ("cudaStreamCreateWithFlags", [ctypes.POINTER(c_void_p), ctypes.c_uint]),
            ("cudaStreamSynchronize", [c_void_p]),
            ("cudaStreamDestroy", [c_void_p]),
        ):
            getattr(library, function).argtypes = argtypes
            getattr(library, function).restype = c_int
        for function in ("cudaGetErrorName", "cudaGetErrorString"):
            getattr(library, function).argtypes = [c_int]
            getattr(library, function).restype = ctypes.c_char_p
        self._count: int | None = None
        self._address_range: Any = _UNSET  # the driver's cuMemGetAddressRange_v2, None if absent

    def error_text(self, code: int) -> tuple[str, str]:
        name = self._lib.cudaGetErrorName(code) or b"cudaError"
        text = self._lib.cudaGetErrorString(code) or b"unknown error"
        return name.decode(errors="replace"), text.decode(errors="replace")

    def _check(self, call: str, code: int) -> None:
        if code != _SUCCESS:
            raise CudaError(call, code, *self.error_text(code))

    def probe(self) -> tuple[int, int]:
        """``cudaGetDeviceCount``: (error code, count)."""
        count = ctypes.c_int(0)
        code = self._lib.cudaGetDeviceCount(ctypes.byref(count))
        return code, count.value

    def device_count(self) -> int:
        if self._count is None:
            code, count = self.probe()
            self._check("cudaGetDeviceCount", code)
            self._count = count
        return self._count

    def _use(self, device_id: int) -> None:
        self._check("cudaSetDevice", self._lib.cudaSetDevice(device_id))  # the current device is per thread

    def open_ipc(self, handle: bytes, device_id: int) -> int:
        self._use(device_id)
        pointer = ctypes.c_void_p()
        raw = _IpcHandle()
        ctypes.memmove(ctypes.addressof(raw), handle, IPC_HANDLE_SIZE)
        self._check(
            "cudaIpcOpenMemHandle",
            self._lib.cudaIpcOpenMemHandle(ctypes.byref(pointer), raw, _IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
        )
        return int(pointer.value or 0)

    def allocation_size(self, pointer: int, device_id: int) -> int | None:
        """Bytes of the allocation starting at ``pointer`` on (``cuMemGetAddressRange``); None when the
        driver library cannot be opened (the region cannot be checked: the caller refuses it)."""
        if self._address_range is _UNSET:
            try:
                function = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
            except (OSError, AttributeError):
                self._address_range = None
            else:
                function.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
                function.restype = ctypes.c_int
                self._address_range = function
        function = self._address_range
        if function is None:
            return None
        self._use(device_id)
        base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
        code = function(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(pointer))
        if code != _SUCCESS:
            raise CudaError("cuMemGetAddressRange", code, f"CUresult {code}", "cannot size the allocation")
        return int(base.value) + int(size.value) - pointer

    def close_ipc(self, pointer: int, device_id: int) -> None:
        self._use(device_id)
        self._check("cudaIpcCloseMemHandle", self._lib.cudaIpcCloseMemHandle(ctypes.c_void_p(pointer)))

    def to_host(self, host: int, pointer: int, byte_size: int, device_id: int) -> None:
        self._use(device_id)
        code = self._lib.cudaMemcpy(host, pointer, byte_size, _MEMCPY_DEVICE_TO_HOST)
        self._check("cudaMemcpy (device to host)", code)

    def to_device(self, pointer: int, host: int, byte_size: int, device_id: int) -> None:
        """Copy host memory into device memory and wait until it is there: from pageable memory
        ``cudaMemcpy`` returns once the bytes are staged, before the DMA lands, and the client reads
        its region once it has the response (on its own stream, in another process)."""
        self._use(device_id)
        code = self._lib.cudaMemcpy(pointer, host, byte_size, _MEMCPY_HOST_TO_DEVICE)
        self._check("cudaMemcpy (host to device)", code)
        self._check("cudaStreamSynchronize", self._lib.cudaStreamSynchronize(ctypes.c_void_p(0)))

    # -- device buffers and streams (the TensorRT backend) -----------------------------------------

    def malloc(self, byte_size: int, device_id: int) -> int:
        """A device allocation of ``byte_size`` bytes; CudaError (code MEMORY_ALLOCATION) when full."""
        self._use(device_id)
        pointer = ctypes.c_void_p()
        self._check("cudaMalloc", self._lib.cudaMalloc(ctypes.byref(pointer), max(byte_size, 1)))
        return int(pointer.value or 0)

    def free(self, pointer: int, device_id: int) -> None:
        self._use(device_id)
        self._check("cudaFree", self._lib.cudaFree(ctypes.c_void_p(pointer)))

    def stream_create(self, device_id: int) -> int:
        """A non-blocking stream (it does not wait on the legacy default stream); its handle as an int."""
        self._use(device_id)
        stream = ctypes.c_void_p()
        code = self._lib.cudaStreamCreateWithFlags(ctypes.byref(stream), _STREAM_NON_BLOCKING)
        self._check("cudaStreamCreateWithFlags", code)
        return int(stream.value or 0)

    def stream_synchronize(self, stream: int) -> None:
        self._check("cudaStreamSynchronize", self._lib.cudaStreamSynchronize(ctypes.c_void_p(stream)))

    def stream_destroy(self, stream: int) -> None:
        self._check("cudaStreamDestroy", self._lib.cudaStreamDestroy(ctypes.c_void_p(stream)))

    def to_device_async(self, pointer: int, host: int, byte_size: int, stream: int) -> None:
        code = self._lib.cudaMemcpyAsync(pointer, host, byte_size, _MEMCPY_HOST_TO_DEVICE, ctypes.c_void_p(stream))
        self._check("cudaMemcpyAsync (host to device)", code)

    def to_host_async(self, host: int, pointer: int, byte_size: int, stream: int) -> None:
        code = self._lib.cudaMemcpyAsync(host, pointer, byte_size, _MEMCPY_DEVICE_TO_HOST, ctypes.c_void_p(stream))
        self._check("cudaMemcpyAsync (device to host)", code)

    def use(self, device_id: int) -> None:
        """Make ``device_id`` the calling thread's current device (TensorRT calls run on it)."""
        self._use(device_id)


class Loader:
    """Finds and loads the CUDA runtime on first use, once; remembers the Runtime or why there is none.

    ``names`` go to the dynamic loader, ``directories`` are searched for ``libcudart.so*`` after them
    (None: :func:`search_directories`). Tests give empty ones to see the "no runtime" answer."""

    def __init__(self, names: Sequence[str] = LOADER_NAMES, directories: Sequence[Path] | None = None) -> None:
        self._names = names
        self._directories = directories
        self._lock = threading.Lock()
        self._outcome: Device | NoCuda | None = None

    def get(self) -> Device:
        """The usable CUDA runtime, or NoCuda with the reason."""
        with self._lock:
            if self._outcome is None:
                self._outcome = self._load()
            outcome = self._outcome
        if isinstance(outcome, NoCuda):
            # a new exception each time: re-raising the remembered one would chain every caller's frames
            # onto its traceback (a CPU server asks on each metadata request: memory grew without bound)
            raise NoCuda(str(outcome)) from None
        return outcome

    def usable(self) -> bool:
        with self._lock:
            if self._outcome is None:
                self._outcome = self._load()
            return not isinstance(self._outcome, NoCuda)

    def _candidates(self) -> list[str]:
        names = list(self._names)
        if names:  # ldconfig may know it under another soname
            library = ctypes.util.find_library("cudart")
            if library:
                names.append(library)
        return [*names, *self._files()]

    def _files(self) -> list[str]:
        directories = search_directories() if self._directories is None else self._directories
        paths: list[Path] = []
        for directory in directories:
            try:
                paths.extend(directory.glob("libcudart.so*"))
            except OSError:
                continue
        return [str(path) for path in library_order(paths)]

    def _load(self) -> Device | NoCuda:
        """The first runtime that sees a GPU. Every candidate is tried: a CUDA 13 toolkit's runtime may
        need a newer driver than the machine has while the CUDA 12 one of torch's wheel works."""
        first_reason: NoCuda | None = None
        for candidate in dict.fromkeys(self._candidates()):
            try:
                library = ctypes.CDLL(candidate)
            except OSError:
                continue
            try:
                runtime = Runtime(library)
            except AttributeError:  # not a CUDA runtime after all
                continue
            code, count = runtime.probe()
            if code == _SUCCESS and count > 0:
                runtime._count = count
                return runtime
            if first_reason is None:
                name, text = runtime.error_text(code)
                first_reason = NoCuda(no_gpu_reason(code, name, text, count, os.environ.get("CUDA_VISIBLE_DEVICES")))
        if first_reason is not None:
            return first_reason
        return NoCuda(
            "no CUDA runtime found (libcudart.so: neither on the dynamic loader's path nor from the "
            "nvidia-cuda-runtime package)"
        )
