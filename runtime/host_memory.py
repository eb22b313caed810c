"""How the C allocator keeps freed host memory: large tensors reuse it instead of faulting in new pages.

A served request's tensors are short-lived buffers of up to megabytes (an image is 300 KiB in fp16):
decoded from the body, copied out of a protocol worker's arena, merged into a batch, answered. With
glibc's defaults a buffer over the dynamic mmap threshold (128 KiB at start) is its own mapping, and
the heap's free top is given back to the kernel past the trim threshold; the next buffer of that size
then faults its pages in again, zeroed by the kernel, on whatever thread touches it first. On the
2-core VM that was a third of the engine's CPU for 300 KiB images with one protocol worker (docs/
performance.md, "Large tensors and the allocator"): 317-381 us an image with glibc's defaults,
220-262 us with the settings below.

:class:`~sluice.runtime.settings.MallocTuning` (``ServerSettings.malloc_tuning``) says what the process keeps;
:func:`mallopt_calls` (pure) turns it into ``mallopt`` calls; :func:`apply` makes them, once at start, in
the engine and in each protocol worker. glibc only: elsewhere (musl, macOS) it does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from sluice.runtime.settings import MallocTuning

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameters (malloc.h)."""

GLIBC_MMAP_THRESHOLD_MAX = 32 << 20
"""glibc refuses an mmap threshold above HEAP_MAX/2 (32 MiB on 64-bit)."""


def mallopt_calls(tuning: MallocTuning) -> tuple[tuple[int, int], ...]:
    """The ``(parameter, value)`` pairs to pass to ``mallopt``; ValueError for values glibc would refuse."""
    if not 0 < tuning.mmap_threshold_bytes <= GLIBC_MMAP_THRESHOLD_MAX:
        raise ValueError(
            f"mmap threshold {tuning.mmap_threshold_bytes} bytes; allowed: 1 to {GLIBC_MMAP_THRESHOLD_MAX} (32 MiB)"
        )
    if not 0 <= tuning.trim_threshold_bytes < 2**31:
        raise ValueError(f"trim threshold {tuning.trim_threshold_bytes} bytes; allowed: 0 to {2**31 - 1}")
    return (
        (M_MMAP_THRESHOLD, tuning.mmap_threshold_bytes),
        (M_TRIM_THRESHOLD, tuning.trim_threshold_bytes),
    )


def describe(tuning: MallocTuning) -> str:
    """One line for the start log."""
    return (
        f"host memory: blocks under {tuning.mmap_threshold_bytes >> 20} MiB reuse the heap; up to "
        f"{tuning.trim_threshold_bytes >> 20} MiB of freed heap is kept (--malloc-tuning off for glibc's defaults)"
    )


def apply(tuning: MallocTuning | None) -> str | None:
    """Make the ``mallopt`` calls for ``tuning`` in this process; what happened, for the log (None: nothing
    was asked). Never raises: a C library without ``mallopt`` keeps its own behaviour."""
    if tuning is None:
        return None
    calls = mallopt_calls(tuning)
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "host memory: this C library has no mallopt; its allocator's defaults stay"
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    refused = [param for param, value in calls if mallopt(param, value) != 1]
    if refused:
        return f"host memory: mallopt refused parameter(s) {refused}; the allocator's defaults stay for them"
    return describe(tuning)
