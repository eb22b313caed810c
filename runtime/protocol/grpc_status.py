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
