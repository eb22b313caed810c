"""Errors of the runtime and the one table that maps them to HTTP statuses and gRPC codes.

Every error raised towards a client is a :class:`SluiceError` subclass; protocol adapters never
invent statuses of their own: HTTP reads ``http_status`` here, gRPC maps the class to its code in
``protocol/grpc_status.py`` (this layer does not import grpcio; the codes below are what that table
says, a subclass without a row of its own answers like its base).

    SluiceError
    ├── InvalidArgument      400 / INVALID_ARGUMENT   the request is malformed or disagrees with the model
    │   ├── PayloadTooLarge  413 / RESOURCE_EXHAUSTED a body, header or element count over a limit
    │   ├── Unsupported      501 / UNIMPLEMENTED      a feature Sluice (or the model) does not support
    │   │   └── UnsupportedLoad 400 / UNIMPLEMENTED  ... asked for by a model's config: a failed load
    │   ├── AlreadyExists    400 / ALREADY_EXISTS     a shared-memory region name already registered
    │   └── ConfigError      400 / INVALID_ARGUMENT   a model configuration is invalid (file, line, field)
    ├── NotFound             404 / NOT_FOUND          unknown model or version
    ├── Unavailable          503 / UNAVAILABLE        model not ready, server shutting down
    │   ├── DeviceLost       503 / UNAVAILABLE        a sticky CUDA error: the process's GPU context is gone
    │   ├── QueueFull        503 / UNAVAILABLE        the model's queue is at max_queue_size
    │   └── QueueTimeout     503 / UNAVAILABLE        the request waited in the queue past its deadline
    │       └── Shed         503 / UNAVAILABLE        ... or was shed by overload control
    ├── Cancelled            499 / CANCELLED          the client went away before the model ran
    ├── ModelError           500 / INTERNAL           the model's own code failed (message passed through)
    └── Internal             500 / INTERNAL           a bug in Sluice
"""

from __future__ import annotations


class SluiceError(Exception):
    """Base of all client-facing errors; ``message`` is what the client reads."""

    http_status: int = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @property
    def server_fault(self) -> bool:
        """Whether the server is to blame (what ``sluice_request_server_failure`` counts and a canary is
        judged on): a 5xx answer, except a 501 for what Sluice or the model does not support."""
        return self.http_status >= 500 and not isinstance(self, Unsupported)


class InvalidArgument(SluiceError):
    http_status = 400


class PayloadTooLarge(InvalidArgument):
    http_status = 413


class Unsupported(InvalidArgument):
    """A feature Sluice (or the model) does not support: 501 over HTTP and UNIMPLEMENTED over gRPC, as Triton
    answers ``TRITONSERVER_ERROR_UNSUPPORTED``."""

    http_status = 501


class UnsupportedLoad(Unsupported):
    """A load that asked a backend for what it does not support: a failed load, 400 over HTTP like any other
    (gRPC keeps UNIMPLEMENTED)."""

    http_status = 400


class AlreadyExists(InvalidArgument):
    http_status = 400  # Triton answers 400 over HTTP, ALREADY_EXISTS over gRPC


class Unknown(InvalidArgument):
    """A model's ``TritonError.UNKNOWN``: Triton answers 400 over HTTP, UNKNOWN over gRPC."""

    http_status = 400


class NotFound(SluiceError):
    http_status = 404


class Unavailable(SluiceError):
    http_status = 503


class DeviceLost(Unavailable):
    """The model hit a CUDA error that poisons the process's CUDA context (an illegal memory access, a
    device-side assert, ...): every later CUDA call in this process fails too. The data plane reports
    the server not live and not ready when a batch is answered with it, so that the pod is restarted."""


class QueueFull(Unavailable):
    pass


class QueueTimeout(Unavailable):
    pass


class Shed(QueueTimeout):
    """Overload control answered a queued request at once (docs/batching.md); a QueueTimeout to clients."""


class Cancelled(SluiceError):
    http_status = 499


class ModelError(SluiceError):
    http_status = 500


class ConfigError(InvalidArgument):
    """A model configuration problem; the message names file, line/column, field and what is allowed."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        line: int | None = None,
        column: int | None = None,
        field: str | None = None,
    ) -> None:
        where = file or "<config>"
        if line is not None:
            where += f":{line}" + (f":{column}" if column is not None else "")
        prefix = f"{where}: " + (f"field '{field}': " if field else "")
        super().__init__(prefix + message)
        self.file = file
        self.line = line
        self.column = column
        self.field = field
        self.detail = message


class Internal(SluiceError):
    http_status = 500


def unknown_model(name: str, version: str | None = None) -> NotFound:
    """Triton's wording, which clients and dashboards match on."""
    if version:
        return NotFound(f"Request for unknown model: '{name}' version {version} is not found")
    return NotFound(f"Request for unknown model: '{name}' is not found")
