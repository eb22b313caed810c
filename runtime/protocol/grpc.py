"""gRPC front end: Triton's ``inference.GRPCInferenceService`` on ``grpc.aio`` over the data plane."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from sluice.runtime.dataplane import DataPlane
from sluice.runtime.errors import InvalidArgument, SluiceError
from sluice.runtime.protocol import grpc_codec
from sluice.runtime.protocol.grpc_status import grpc_code
from sluice.runtime.settings import Limits

log = logging.getLogger("sluice.runtime.grpc")

_SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]

STREAM_IN_FLIGHT = 64
"""ModelStreamInfer requests of one stream in flight (running, or answered and not yet sent); the next
message is read only when one finishes, so a stream the model cannot keep up with pushes back on
its client (HTTP/2 flow control) instead of queueing without bound."""


class Unparsable:
    """Stands in for a request whose bytes are not a valid protobuf message.

    grpc.aio answers a request deserializer that raises with UNKNOWN ("Unexpected DecodeError"), and
    ends a stream silently; parsing leniently lets the handlers answer INVALID_ARGUMENT instead.
    """

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def lenient_parser(message_type: Any) -> Callable[[bytes], Any]:
    parse = message_type.FromString
    full_name = message_type.DESCRIPTOR.full_name

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:
            return Unparsable(f"request is not a valid protobuf {full_name} message ({len(data)} bytes): {exc}")

    return deserialize


def _guarded(method: Callable[..., Any]) -> Callable[..., Any]:
    """Answer an unparsable request with INVALID_ARGUMENT before ``method`` sees it."""

    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if type(request) is Unparsable:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await method(request, context)

    return handle


class InferenceService(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, dataplane: DataPlane, limits: Limits) -> None:
        self.dp = dataplane
        self.limits = limits

    async def _fail(self, context: grpc.aio.ServicerContext, exc: SluiceError) -> None:
        await context.abort(grpc_code(exc), exc.message)

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self.dp.live())

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.dp.ready())

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=self.dp.model_ready(request.name, request.version))

    async def ServerMetadata(self, request: Any, context: Any) -> pb.ServerMetadataResponse:
        meta = self.dp.server_metadata()
        return pb.ServerMetadataResponse(name=meta["name"], version=meta["version"], extensions=meta["extensions"])

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Any) -> pb.ModelMetadataResponse:
        try:
            meta = self.dp.model_metadata(request.name, request.version)
        except SluiceError as exc:
            await self._fail(context, exc)
        return json_format.ParseDict(meta, pb.ModelMetadataResponse())

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Any) -> pb.ModelConfigResponse:
        try:
            config = self.dp.model_config(request.name, request.version)
        except SluiceError as exc:
            await self._fail(context, exc)
        return pb.ModelConfigResponse(config=config)

    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Any) -> pb.ModelStatisticsResponse:
        try:
            stats = self.dp.model_statistics(request.name, request.version)
        except SluiceError as exc:
            await self._fail(context, exc)
        return json_format.ParseDict({"model_stats": stats}, pb.ModelStatisticsResponse())

    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: Any) -> pb.RepositoryIndexResponse:
        rows = self.dp.repository_index(request.ready)
        return json_format.ParseDict({"models": rows}, pb.RepositoryIndexResponse())

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Any
    ) -> pb.RepositoryModelLoadResponse:
        override = None
        for key, value in request.parameters.items():
            if key == "config":
                if value.WhichOneof("parameter_choice") != "string_param":
                    await self._fail(context, InvalidArgument("load parameter 'config' must be a string (JSON config)"))
                override = value.string_param
            elif key.startswith("file:"):
                await self._fail(
                    context,
                    InvalidArgument(f"load parameter '{key}': file overrides are not supported; use the repository"),
                )
        try:
            await self.dp.load(request.model_name, override)
        except SluiceError as exc:
            await self._fail(context, exc)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Any
    ) -> pb.RepositoryModelUnloadResponse:
        await self.dp.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:
        if type(request) is Unparsable:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            infer_request = grpc_codec.decode_infer(request, self.limits)
            response = await self.dp.infer(infer_request)
        except SluiceError as exc:
            await self._fail(context, exc)
        return grpc_codec.encode_infer(response)

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: Any
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Requests on one stream run concurrently; responses come back as they finish, with ids."""
        results: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
        tasks: set[asyncio.Task] = set()
        slots = asyncio.Semaphore(STREAM_IN_FLIGHT)  # released when the answer has been taken

        async def one(message: pb.ModelInferRequest) -> None:
            if type(message) is Unparsable:
                await results.put(pb.ModelStreamInferResponse(error_message=message.message))
                return
            try:
                infer_request = grpc_codec.decode_infer(message, self.limits)
                response = await self.dp.infer(infer_request)
                out = pb.ModelStreamInferResponse(infer_response=grpc_codec.encode_infer(response))
            except SluiceError as exc:
                out = pb.ModelStreamInferResponse(
                    error_message=exc.message,
                    infer_response=pb.ModelInferResponse(
                        model_name=message.model_name, model_version=message.model_version, id=message.id
                    ),
                )
            await results.put(out)

        async def read() -> None:
            messages = aiter(request_iterator)
            try:
                while True:
                    await slots.acquire()
                    try:
                        message = await anext(messages)
                    except StopAsyncIteration:
                        break
                    task = asyncio.get_running_loop().create_task(one(message))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            finally:
                while tasks:
                    await asyncio.gather(*list(tasks), return_exceptions=True)
                await results.put(None)

        reader = asyncio.get_running_loop().create_task(read())
        try:
            while True:
                item = await results.get()
                if item is None:
                    break
                yield item
                slots.release()
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()


async def start_grpc(dataplane: DataPlane, limits: Limits, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    options = [
        ("grpc.max_receive_message_length", limits.max_grpc_message_bytes),
        ("grpc.max_send_message_length", limits.max_grpc_message_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    server = grpc.aio.server(options=options)
    handlers = method_handlers(InferenceService(dataplane, limits))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(_SERVICE.full_name, handlers)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC to {host}:{port}")
    await server.start()
    return server, bound


def method_handlers(service: InferenceService) -> dict[str, grpc.RpcMethodHandler]:
    """What ``add_GRPCInferenceServiceServicer_to_server`` registers, with lenient request parsing."""
    handlers = {}
    for method in _SERVICE.methods:
        behaviour = getattr(service, method.name)
        parse = lenient_parser(getattr(pb, method.input_type.name))
        serialize = getattr(pb, method.output_type.name).SerializeToString
        if method.client_streaming:
            # ModelStreamInfer answers unparsable messages on the stream itself.
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(behaviour, parse, serialize)
        else:
            if method.name != "ModelInfer" and inspect.iscoroutinefunction(behaviour):
                behaviour = _guarded(behaviour)  # ModelInfer checks inline; unimplemented ones ignore the request
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(behaviour, parse, serialize)
    return handlers
