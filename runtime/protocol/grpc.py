"""gRPC front end on ``grpc.aio`` (``--grpc-server grpcio``), the fallback to ``grpc_h2``: the method
table of ``grpc_service`` adapted to grpcio's handlers, SluiceErrors turned into statuses."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from sluice.runtime import callers
from sluice.runtime.dataplane import DataPlane
from sluice.runtime.errors import SluiceError
from sluice.runtime.protocol.grpc_service import INFER, STREAM, Call, Method, Service, stream_payload
from sluice.runtime.protocol.grpc_status import clipped, grpc_code
from sluice.runtime.settings import Limits


def _call(context: grpc.aio.ServicerContext) -> Call:
    remaining = context.time_remaining()
    caller = ""
    traceparent = None
    for key, value in context.invocation_metadata() or ():
        if key == callers.METADATA_KEY and value:
            text = value if isinstance(value, str) else value.decode("latin-1")
            caller = callers.checked(text, f"metadata {callers.METADATA_KEY}")
        elif key == "traceparent":
            traceparent = value if isinstance(value, str) else value.decode("latin-1")
    return Call(None if remaining is None else time.monotonic() + remaining, caller, traceparent)


def _serialize(response: Any) -> bytes:
    return response if type(response) is bytes else response.SerializeToString()


def _unary(method: Method) -> Callable[..., Any]:
    handler = method.handler

    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(request, _call(context))
        except SluiceError as exc:
            await context.abort(grpc_code(exc), clipped(exc.message))

    return handle


def _stream(method: Method, limit: int) -> Callable[..., Any]:
    handler = method.handler

    async def handle(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for reply in handler(requests, _call(context)):
                yield stream_payload(reply, limit)  # an oversized one: its request's error, not the call's end
        except SluiceError as exc:
            await context.abort(grpc_code(exc), clipped(exc.message))

    return handle


def method_handlers(service: Service) -> dict[str, dict[str, grpc.RpcMethodHandler]]:
    """Every method of the table by gRPC service and method name, with lenient request parsing
    (handlers answer unparsable bytes)."""
    handlers: dict[str, dict[str, grpc.RpcMethodHandler]] = {}
    for method in service.methods.values():
        if method.kind == STREAM:
            handler = grpc.stream_stream_rpc_method_handler(
                _stream(method, service.limits.max_grpc_message_bytes), method.parse, _serialize
            )
        else:
            parse = None if method.kind == INFER else method.parse  # ModelInfer takes the bytes (plan cache)
            handler = grpc.unary_unary_rpc_method_handler(_unary(method), parse, _serialize)
        handlers.setdefault(method.service, {})[method.name] = handler
    return handlers


async def start_grpc(
    dataplane: DataPlane, limits: Limits, host: str, port: int, unix_path: str | None = None
) -> tuple[grpc.aio.Server, int]:
    """Serve on ``host:port`` (port -1: no TCP) and on the Unix socket ``unix_path`` if given;
    returns the server and the bound TCP port (-1 without TCP)."""
    options = [
        ("grpc.max_receive_message_length", limits.max_grpc_message_bytes),
        ("grpc.max_send_message_length", limits.max_grpc_message_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    server = grpc.aio.server(options=options)
    for service_name, handlers in method_handlers(Service(dataplane, limits)).items():
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_name, handlers),))
        server.add_registered_method_handlers(service_name, handlers)
    bound = -1
    if port >= 0:
        bound = server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"cannot bind gRPC to {host}:{port}")
    if unix_path is not None and server.add_insecure_port(f"unix:{unix_path}") == 0:
        raise OSError(f"cannot bind gRPC to the Unix socket {unix_path}")
    await server.start()
    return server, bound
