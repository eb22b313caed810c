"""Triton's length-prefixed BYTES tensor encoding, shared by the HTTP and gRPC codecs.

Each element is a 4-byte little-endian length followed by that many bytes. Both wire protocols
carry BYTES tensors this way in their binary forms (HTTP binary data extension, gRPC
``raw_input_contents`` / ``raw_output_contents``), so the split and the join live here, below both
front ends and the gRPC client of remote.py.
"""

from __future__ import annotations

import numpy as np

from sluice.runtime.errors import InvalidArgument


def bytes_elements(name: str, raw: memoryview, count: int) -> np.ndarray:
    """Split Triton's length-prefixed BYTES encoding (4-byte little-endian length, then data)."""
    end = len(raw)
    if count * 4 > end:  # every element has a 4-byte length: refuse before allocating ``count`` slots
        raise InvalidArgument(
            f"input '{name}': BYTES data is {end} bytes, too short for {count} elements "
            "(each needs at least a 4-byte length)"
        )
    out = np.empty(count, dtype=object)
    pos = 0
    for i in range(count):
        if pos + 4 > end:
            if pos == end:  # whole elements, just too few of them
                raise InvalidArgument(f"input '{name}' got unexpected elements count {i}, expected {count}")
            raise InvalidArgument(f"input '{name}': BYTES data ends after {i} of {count} elements")
        length = int.from_bytes(raw[pos : pos + 4], "little")
        pos += 4
        if pos + length > end:
            raise InvalidArgument(
                f"input '{name}': BYTES element {i} claims {length} bytes but only {end - pos} remain"
            )
        out[i] = bytes(raw[pos : pos + length])
        pos += length
    if pos != end:
        extra = _whole_elements(raw, pos)
        if extra:  # more whole elements than the shape holds
            raise InvalidArgument(f"input '{name}' got unexpected elements count {count + extra}, expected {count}")
        raise InvalidArgument(f"input '{name}': {end - pos} bytes left over after {count} BYTES elements")
    return out


def _whole_elements(raw: memoryview, pos: int) -> int:
    """How many whole length-prefixed elements ``raw[pos:]`` holds exactly (0 when it is not a run of them)."""
    end = len(raw)
    n = 0
    while pos + 4 <= end:
        if n == 1 << 16:  # only for the message: not worth a long walk
            return 0
        pos += 4 + int.from_bytes(raw[pos : pos + 4], "little")
        n += 1
    return n if pos == end else 0


def encode_bytes_elements(array: np.ndarray) -> bytes:
    """Join ``array``'s elements (bytes, or anything else as its ``str``) in the length-prefixed form."""
    parts = []
    for item in array.ravel():
        data = item if isinstance(item, bytes) else str(item).encode()
        parts.append(len(data).to_bytes(4, "little"))
        parts.append(data)
    return b"".join(parts)
