"""The gRPC status of each runtime error: the gRPC layer's half of ``runtime/errors.py``'s table.

``errors.py`` is the bottom layer and knows nothing of grpcio; this table maps a :class:`SluiceError`
class to a ``grpc.StatusCode``. A class not in the table maps through its nearest base that is (its
MRO), so a new subclass answers like its parent until it is given a row here.
"""

from __future__ import annotations

import grpc

from sluice.runtime.errors import (
    AlreadyExists,
    Cancelled,
    Internal,
    InvalidArgument,
    ModelError,
    NotFound,
    PayloadTooLarge,
    SluiceError,
    Unavailable,
    Unknown,
    Unsupported,
)

GRPC_CODES: dict[type[SluiceError], grpc.StatusCode] = {
    SluiceError: grpc.StatusCode.INTERNAL,
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    PayloadTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unsupported: grpc.StatusCode.UNIMPLEMENTED,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    Unknown: grpc.StatusCode.UNKNOWN,
    NotFound: grpc.StatusCode.NOT_FOUND,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    Cancelled: grpc.StatusCode.CANCELLED,
    ModelError: grpc.StatusCode.INTERNAL,
    Internal: grpc.StatusCode.INTERNAL,
}

_resolved: dict[type, grpc.StatusCode] = dict(GRPC_CODES)  # each class's MRO walked once


def grpc_code(exc: SluiceError) -> grpc.StatusCode:
    """The status a client sees for ``exc``."""
    cls = type(exc)
    code = _resolved.get(cls)
    if code is None:
        code = next((GRPC_CODES[base] for base in cls.__mro__ if base in GRPC_CODES), grpc.StatusCode.INTERNAL)
        _resolved[cls] = code
    return code


MAX_MESSAGE_BYTES = 4096
"""Longest grpc-message (as sent: percent-encoded) either gRPC server sends, so error trailers stay
within clients' metadata limits (grpcio's hard limit is 16 KiB for the whole block)."""


def clipped(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """``message`` cut at a character boundary so that its grpc-message encoding (UTF-8, then ``%XX``
    for every byte outside printable ASCII and for ``%``) has at most ``limit`` bytes: cutting the
    encoded bytes split an escape or a character, and clients then decoded the whole text as latin-1."""
    if len(message) * 12 <= limit:  # even all 4-byte characters, each escaped, fit
        return message
    size = 0
    for index, char in enumerate(message):
        cost = sum(1 if 0x20 <= byte <= 0x7E and byte != 0x25 else 3 for byte in char.encode("utf-8", "replace"))
        if size + cost > limit:
            return message[:index]
        size += cost
    return message
