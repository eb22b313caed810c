"""Triton's ``inference.GRPCInferenceService``, once, for both gRPC front ends (with gRPC's standard
health check, ``grpc.health.v1.Health/Check``: grpc_health.py).

A method table maps each method name to a handler that takes the parsed request message (or an
async iterator of them, for ``ModelStreamInfer``) and a small :class:`Call`, and returns the response
message (or yields them), raising :class:`SluiceError` for anything a client should hear about.
The front ends only move bytes and map errors to statuses (``grpc_status``): ``grpc.py`` adapts the
table to ``grpc.aio``, ``grpc_h2.py`` serves it on its own HTTP/2 server.

``ModelInfer`` is also offered in pieces for ``grpc_h2``'s callback path (no task, no await per
call): :meth:`Service.decode_infer` (request bytes -> ``InferRequest``, through the plan cache of
``grpc_plan``), ``Service.submit`` (``DataPlane.infer_nowait``) and :meth:`Service.encode_infer`
(response -> bytes, with the size limit). :meth:`Service.model_infer` is the same three in one
coroutine, for grpc.aio.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from sluice.runtime import shm, tracing
from sluice.runtime.dataplane import DataPlane
from sluice.runtime.errors import Internal, InvalidArgument, NotFound, PayloadTooLarge, SluiceError, Unsupported
from sluice.runtime.protocol import grpc_codec, grpc_health
from sluice.runtime.protocol.grpc_plan import InferDecoder
from sluice.runtime.settings import Limits
from sluice.runtime.types import InferRequest, InferResponse

log = logging.getLogger("sluice.runtime.grpc")

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]

STREAM_IN_FLIGHT = 64
"""ModelStreamInfer requests of one stream in flight (running, or answered and not yet sent); the next
message is read only when one finishes, so a stream the model cannot keep up with pushes back on
its client (HTTP/2 flow control) instead of queueing without bound."""
STREAM_PARKED = 1024
"""Requests of one ModelStreamInfer stream that may wait in sequence backlogs (or, once answered, for
their answer to be sent) without holding one of its STREAM_IN_FLIGHT slots; past it, a parked
request keeps its slot."""
_SLOT, _PARKED = "slot", "parked"

UNARY, STREAM, INFER, UNIMPLEMENTED = "unary", "stream", "infer", "unimplemented"
HEALTH_CHECK = f"{grpc_health.HEALTH_SERVICE}/Check"
"""The method table's key for the health check (inference methods are keyed by their bare names)."""


class Call:
    """What a handler may know of its call besides the request."""

    __slots__ = ("caller", "deadline", "traceparent")

    def __init__(
        self, deadline: float | None = None, caller: str = "", traceparent: str | bytes | None = None
    ) -> None:
        self.deadline = deadline  # time.monotonic() value, or None
        self.caller = caller  # the sluice-caller metadata, checked (callers.py); "" when absent
        self.traceparent = traceparent  # the W3C traceparent metadata, unparsed (tracing.py); None when absent


class Unparsable:
    """Stands in for a request whose bytes are not a valid protobuf message, so that handlers (not the
    transport) answer it: INVALID_ARGUMENT, or an error message on a stream."""

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


class Method:
    """One row of the table. ``parse`` turns request bytes into what ``handler`` takes (None: the
    handler takes bytes); responses are serialized with ``SerializeToString`` unless they are bytes.
    ``service``: the gRPC service it belongs to (its path is ``/<service>/<name>``)."""

    __slots__ = ("handler", "kind", "name", "parse", "service")

    def __init__(
        self,
        name: str,
        kind: str,
        handler: Callable[..., Any],
        parse: Callable[[bytes], Any] | None,
        service: str = SERVICE.full_name,
    ) -> None:
        self.name = name
        self.kind = kind
        self.handler = handler
        self.parse = parse
        self.service = service

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.name}"


def _checked(handler: Callable[[Any, Call], Awaitable[Any]]) -> Callable[[Any, Call], Awaitable[Any]]:
    async def handle(request: Any, call: Call) -> Any:
        if type(request) is Unparsable:
            raise InvalidArgument(request.message)
        return await handler(request, call)

    return handle


class Service:
    def __init__(self, dataplane: DataPlane, limits: Limits) -> None:
        self.dp = dataplane
        self.limits = limits
        self.max_message = limits.max_grpc_message_bytes
        self.decoder = InferDecoder(limits)
        self.tracing = dataplane.tracing
        self.submit: Callable[[InferRequest, Callable[[InferResponse | SluiceError], None]], None] = (
            dataplane.infer_nowait
        )
        self.methods: dict[str, Method] = {}
        for method in SERVICE.methods:
            parse = lenient_parser(getattr(pb, method.input_type.name))
            handler = getattr(self, _HANDLERS.get(method.name, ""), None)
            if method.name == "ModelInfer":
                row = Method(method.name, INFER, self.model_infer, None)
            elif method.name == "ModelStreamInfer":
                row = Method(method.name, STREAM, self.model_stream_infer, parse)
            elif handler is None:
                row = Method(method.name, UNIMPLEMENTED, self._unimplemented(method.name), None)
            else:
                row = Method(method.name, UNARY, _checked(handler), parse)
            self.methods[method.name] = row
        # gRPC's standard health check, keyed by its path's tail (the inference methods' names have no "/")
        self.methods[HEALTH_CHECK] = Method(
            "Check", UNARY, _checked(self.health_check), lenient_parser(grpc_health.HealthCheckRequest),
            service=grpc_health.HEALTH_SERVICE,
        )  # fmt: skip

    @staticmethod
    def _unimplemented(name: str) -> Callable[[Any, Call], Awaitable[Any]]:
        async def handle(request: Any, call: Call) -> Any:
            raise Unsupported(unimplemented_message(name))

        return handle

    # -- ModelInfer --------------------------------------------------------------------------------
    def decode_infer(self, message: bytes) -> InferRequest:
        return self.decoder.decode(message)

    def encode_infer(self, response: InferResponse) -> bytes:
        payload = grpc_codec.encode_infer(response).SerializeToString()
        if len(payload) > self.max_message:
            raise PayloadTooLarge(too_large(len(payload), self.max_message))
        return payload

    async def model_infer(self, message: bytes, call: Call) -> bytes:
        request = self.decoder.decode(message)
        if call.caller:
            request.caller = call.caller
        if self.tracing.on:
            trace = self.tracing.begin(request, call.traceparent, "grpc")
            if trace is not None:
                return await self._model_infer_traced(request, trace)
        return self.encode_infer(await self.dp.infer(request))

    async def _model_infer_traced(self, request: InferRequest, trace: tracing.Trace) -> bytes:
        clock = self.tracing.clock
        try:
            response = await self.dp.infer(request)
        except SluiceError as exc:
            now = clock()
            trace.finish(exc, now, now)
            raise
        answered = clock()
        try:
            payload = self.encode_infer(response)
        except SluiceError as exc:
            trace.finish(exc, answered, clock())
            raise
        trace.finish(response, answered, clock())
        return payload

    async def model_stream_infer(self, messages: AsyncIterator[Any], call: Call) -> AsyncGenerator[Any, None]:
        """Requests on one stream run concurrently (up to STREAM_IN_FLIGHT); responses come back as
        they finish, with ids; a bad message gets an error message on the stream, which goes on.
        A decoupled model answers a request with zero or more responses (:meth:`_decoupled`)."""
        # (message or None, what taking it gives back: _SLOT or _PARKED at a request's last answer, else
        # None); None: the end
        results: asyncio.Queue[tuple[pb.ModelStreamInferResponse | None, str | None] | None] = asyncio.Queue()
        tasks: set[asyncio.Task] = set()
        slots = asyncio.Semaphore(STREAM_IN_FLIGHT)  # released when a request's last answer has been taken
        loop = asyncio.get_running_loop()
        parked = 0  # requests whose slot went back (in a sequence backlog), until their last answer is taken

        async def one(message: Any) -> None:
            if type(message) is Unparsable:
                await results.put((pb.ModelStreamInferResponse(error_message=message.message), _SLOT))
                return
            empty_final = False
            holds_slot = True

            def park() -> None:
                # Its sequence waits for a slot that only other sequences' ENDs free, and those may be
                # among the messages not read yet: give its slot back (up to STREAM_PARKED of them).
                nonlocal parked, holds_slot
                if holds_slot and parked < STREAM_PARKED:
                    holds_slot = False
                    parked += 1
                    slots.release()

            def ended() -> str:
                """What taking the request's last answer gives back: its slot, or (parked) its place
                among the parked ones; parked answers not yet sent still count against STREAM_PARKED."""
                return _SLOT if holds_slot else _PARKED

            try:
                infer_request = grpc_codec.decode_infer(message, self.limits)
                infer_request.on_parked = park
                if call.caller:
                    infer_request.caller = call.caller
                if EMPTY_FINAL_PARAMETER in infer_request.parameters:
                    parameters = dict(infer_request.parameters)
                    empty_final = parameters.pop(EMPTY_FINAL_PARAMETER) is True
                    infer_request.parameters = parameters
                if self.dp.decoupled(infer_request.model_name, infer_request.model_version):
                    await self._decoupled(infer_request, message, results, empty_final, call.traceparent, ended)
                    return
                if self.tracing.on:  # tracing.py: sample it; a stream's requests share its traceparent
                    out = await self._stream_infer_traced(infer_request, call.traceparent, empty_final)
                else:
                    out = _stream_response(await self.dp.infer(infer_request), empty_final)
            except SluiceError as exc:
                out = _stream_error(exc, message)
            except Exception:  # a bug must cost this request only: the stream and its slot go on
                log.exception("unhandled error answering a ModelStreamInfer request")
                out = _stream_error(Internal("internal server error (see server log)"), message)
            await results.put((out, ended()))

        async def read() -> None:
            iterator = aiter(messages)
            try:
                while True:
                    await slots.acquire()
                    try:
                        message = await anext(iterator)
                    except StopAsyncIteration:
                        break
                    task = loop.create_task(one(message))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            finally:
                while tasks:
                    await asyncio.gather(*list(tasks), return_exceptions=True)
                await results.put(None)

        reader = loop.create_task(read())
        try:
            while True:
                item = await results.get()
                if item is None:
                    break
                out, gives_back = item
                if out is not None:
                    yield out
                if gives_back is _SLOT:
                    slots.release()
                elif gives_back is _PARKED:
                    parked -= 1
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    async def _stream_infer_traced(
        self, request: InferRequest, traceparent: str | bytes | None, empty_final: bool
    ) -> pb.ModelStreamInferResponse:
        """A ModelStreamInfer request while tracing is on: its span ends once its response is encoded
        and queued on the stream (which writes the responses in order as its client reads them)."""
        trace = self.tracing.begin(request, traceparent, "grpc")
        if trace is None:
            return _stream_response(await self.dp.infer(request), empty_final)
        clock = self.tracing.clock
        try:
            response = await self.dp.infer(request)
        except SluiceError as exc:
            now = clock()
            trace.finish(exc, now, now)
            raise
        answered = clock()
        try:
            out = _stream_response(response, empty_final)
        except SluiceError as exc:
            trace.finish(exc, answered, clock())
            raise
        trace.finish(response, answered, clock())
        return out

    async def _decoupled(
        self,
        request: InferRequest,
        message: Any,
        results: asyncio.Queue[tuple[pb.ModelStreamInferResponse | None, str | None] | None],
        empty_final: bool,
        traceparent: str | bytes | None,
        ended: Callable[[], str],
    ) -> None:
        """One request to a decoupled model: every response the model sends goes on the stream
        with ``triton_final_response`` saying whether it is the last, as Triton does; a bare final
        flag becomes an empty response only when the request asked for one
        (``triton_enable_empty_final_response``, tritonclient's ``enable_empty_final_response``).
        A sampled request's span records each response and ends at the final one (tracing.py)."""
        finished = asyncio.get_running_loop().create_future()

        def respond(item: InferResponse | Exception | None, final: bool) -> None:
            if finished.done():
                return  # the request was answered (an error) or its stream went away
            out: pb.ModelStreamInferResponse | None = None
            if isinstance(item, SluiceError):
                out = _stream_error(item, message)
            elif isinstance(item, InferResponse):
                try:
                    out = pb.ModelStreamInferResponse(infer_response=grpc_codec.encode_infer(item))
                except SluiceError as exc:
                    out = _stream_error(exc, message)
                except Exception:  # a response that cannot be encoded must not lose the request's end
                    log.exception("unhandled error encoding a decoupled model's response")
                    out = _stream_error(Internal("internal server error (see server log)"), message)
            elif final and empty_final:
                out = pb.ModelStreamInferResponse(infer_response=_named_response(message))
            if out is not None:
                out.infer_response.parameters[FINAL_PARAMETER].bool_param = final
            results.put_nowait((out, ended() if final else None))
            if final:
                finished.set_result(None)

        send: Callable[[InferResponse | Exception | None, bool], None] = respond
        if self.tracing.on:
            trace = self.tracing.begin(request, traceparent, "grpc")
            if trace is not None:
                send = trace.responses(respond)

        def done(outcome: InferResponse | SluiceError) -> None:
            if isinstance(outcome, SluiceError):
                send(outcome, True)

        request.responder = send
        try:
            self.dp.infer_nowait(request, done)
        except SluiceError as exc:
            send(exc, True)
        try:
            await finished
        except asyncio.CancelledError:
            request.cancel.cancel()
            raise

    # -- the other methods -------------------------------------------------------------------------
    async def server_live(self, request: pb.ServerLiveRequest, call: Call) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self.dp.live())

    async def health_check(self, request: Any, call: Call) -> Any:
        """``grpc.health.v1.Health/Check`` (grpc_health.py says what each service name means)."""
        status = grpc_health.serving_status(
            request.service, SERVICE.full_name, self.dp.ready, self.dp.model_ready,
            lambda name: any(row["name"] == name for row in self.dp.repository_index()),
        )  # fmt: skip
        if status is None:
            raise NotFound(
                f"unknown service {request.service!r} for health checking; allowed: '' or "
                f"'{SERVICE.full_name}' (the server), or the name of a model in the repository"
            )
        return grpc_health.HealthCheckResponse(status=status)

    async def server_ready(self, request: pb.ServerReadyRequest, call: Call) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.dp.ready())

    async def model_ready(self, request: pb.ModelReadyRequest, call: Call) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=self.dp.model_ready(request.name, request.version))

    async def server_metadata(self, request: Any, call: Call) -> pb.ServerMetadataResponse:
        meta = self.dp.server_metadata()
        return pb.ServerMetadataResponse(name=meta["name"], version=meta["version"], extensions=meta["extensions"])

    async def model_metadata(self, request: pb.ModelMetadataRequest, call: Call) -> pb.ModelMetadataResponse:
        meta = self.dp.model_metadata(request.name, request.version)
        return json_format.ParseDict(meta, pb.ModelMetadataResponse())

    async def model_config(self, request: pb.ModelConfigRequest, call: Call) -> pb.ModelConfigResponse:
        return pb.ModelConfigResponse(config=self.dp.model_config(request.name, request.version))

    async def model_statistics(self, request: pb.ModelStatisticsRequest, call: Call) -> pb.ModelStatisticsResponse:
        stats = self.dp.model_statistics(request.name, request.version)
        return json_format.ParseDict({"model_stats": stats}, pb.ModelStatisticsResponse())

    async def repository_index(self, request: pb.RepositoryIndexRequest, call: Call) -> pb.RepositoryIndexResponse:
        rows = self.dp.repository_index(request.ready)
        return json_format.ParseDict({"models": rows}, pb.RepositoryIndexResponse())

    async def repository_model_load(
        self, request: pb.RepositoryModelLoadRequest, call: Call
    ) -> pb.RepositoryModelLoadResponse:
        override = None
        files: dict[str, bytes] = {}
        for key, value in request.parameters.items():
            if key == "config":
                if value.WhichOneof("parameter_choice") != "string_param":
                    raise InvalidArgument("load parameter 'config' must be a string (JSON config)")
                override = value.string_param
            elif key.startswith("file:"):
                if value.WhichOneof("parameter_choice") != "bytes_param":
                    raise InvalidArgument(f"load parameter '{key}' must be a bytes_param holding the file's contents")
                files[key[len("file:"):]] = value.bytes_param
        await self.dp.load(request.model_name, override, files)
        return pb.RepositoryModelLoadResponse()

    async def repository_model_unload(
        self, request: pb.RepositoryModelUnloadRequest, call: Call
    ) -> pb.RepositoryModelUnloadResponse:
        dependents = False
        if "unload_dependents" in request.parameters:
            parameter = request.parameters["unload_dependents"]
            if parameter.WhichOneof("parameter_choice") != "bool_param":
                raise InvalidArgument("unload parameter 'unload_dependents' must be a bool_param")
            dependents = parameter.bool_param
        await self.dp.unload(request.model_name, dependents)
        return pb.RepositoryModelUnloadResponse()

    # -- logging (Triton's extension) ---------------------------------------------------------------
    async def log_settings(self, request: pb.LogSettingsRequest, call: Call) -> pb.LogSettingsResponse:
        """Read the log settings; the settings the request names (a value without a choice is left
        as it is, as Triton does) are changed first."""
        if request.settings:
            changes: dict[str, Any] = {}
            for name, value in request.settings.items():
                choice = value.WhichOneof("parameter_choice")
                changes[name] = None if choice is None else getattr(value, choice)
            current = self.dp.update_log_settings(changes)
        else:
            current = self.dp.log_settings()
        response = pb.LogSettingsResponse()
        for name, setting in current.items():
            slot = response.settings[name]
            if isinstance(setting, bool):
                slot.bool_param = setting
            elif isinstance(setting, int):
                slot.uint32_param = setting
            else:
                slot.string_param = setting
        return response

    # -- shared memory (Triton's extensions) ---------------------------------------------------------
    def _registry(self) -> shm.Registry:
        if self.dp.shared_memory is None:
            raise NotFound("shared memory is not enabled on this server")
        return self.dp.shared_memory

    async def system_shared_memory_status(
        self, request: pb.SystemSharedMemoryStatusRequest, call: Call
    ) -> pb.SystemSharedMemoryStatusResponse:
        response = pb.SystemSharedMemoryStatusResponse()
        for region in self._registry().status(request.name):
            response.regions[region["name"]].CopyFrom(pb.SystemSharedMemoryStatusResponse.RegionStatus(**region))
        return response

    async def system_shared_memory_register(
        self, request: pb.SystemSharedMemoryRegisterRequest, call: Call
    ) -> pb.SystemSharedMemoryRegisterResponse:
        self._registry().register(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def system_shared_memory_unregister(
        self, request: pb.SystemSharedMemoryUnregisterRequest, call: Call
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        self._registry().unregister(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def cuda_shared_memory_status(
        self, request: pb.CudaSharedMemoryStatusRequest, call: Call
    ) -> pb.CudaSharedMemoryStatusResponse:
        response = pb.CudaSharedMemoryStatusResponse()
        for region in self._registry().status(request.name, shm.CUDA):
            response.regions[region["name"]].CopyFrom(pb.CudaSharedMemoryStatusResponse.RegionStatus(**region))
        return response

    async def cuda_shared_memory_register(
        self, request: pb.CudaSharedMemoryRegisterRequest, call: Call
    ) -> pb.CudaSharedMemoryRegisterResponse:
        registration = shm.cuda_registration(request.name, request.raw_handle, request.device_id, request.byte_size)
        self._registry().register_cuda(registration)
        return pb.CudaSharedMemoryRegisterResponse()

    async def cuda_shared_memory_unregister(
        self, request: pb.CudaSharedMemoryUnregisterRequest, call: Call
    ) -> pb.CudaSharedMemoryUnregisterResponse:
        self._registry().unregister(request.name, shm.CUDA)
        return pb.CudaSharedMemoryUnregisterResponse()

    # -- trace extension (tracing.py) -----------------------------------------------------------------
    async def trace_setting(self, request: pb.TraceSettingRequest, call: Call) -> pb.TraceSettingResponse:
        """Triton's TraceSetting: no settings reads them; a setting with values sets it, one with an empty
        value list clears it (tritonclient's None)."""
        model = request.model_name
        if model:
            self.dp.check_known(model)
        if request.settings:
            changes = {key: (list(value.value) or None) for key, value in request.settings.items()}
            current = self.tracing.update(model, changes)
        else:
            current = self.tracing.setting(model)
        response = pb.TraceSettingResponse()
        for key, value in current.items():
            response.settings[key].value.extend(value if isinstance(value, list) else [value])
        return response


_HANDLERS = {
    "ServerLive": "server_live",
    "ServerReady": "server_ready",
    "ModelReady": "model_ready",
    "ServerMetadata": "server_metadata",
    "ModelMetadata": "model_metadata",
    "ModelConfig": "model_config",
    "ModelStatistics": "model_statistics",
    "RepositoryIndex": "repository_index",
    "RepositoryModelLoad": "repository_model_load",
    "RepositoryModelUnload": "repository_model_unload",
    "LogSettings": "log_settings",
    "SystemSharedMemoryStatus": "system_shared_memory_status",
    "SystemSharedMemoryRegister": "system_shared_memory_register",
    "SystemSharedMemoryUnregister": "system_shared_memory_unregister",
    "CudaSharedMemoryStatus": "cuda_shared_memory_status",
    "CudaSharedMemoryRegister": "cuda_shared_memory_register",
    "CudaSharedMemoryUnregister": "cuda_shared_memory_unregister",
    "TraceSetting": "trace_setting",
}
"""Method name -> Service handler; methods of the proto not named here are answered UNIMPLEMENTED."""


EMPTY_FINAL_PARAMETER = "triton_enable_empty_final_response"
"""Request parameter (tritonclient's ``enable_empty_final_response``): send the final flag of a
decoupled request as an empty response."""
FINAL_PARAMETER = "triton_final_response"
"""Response parameter on ModelStreamInfer: whether this is the request's last response."""


def _named_response(message: Any) -> pb.ModelInferResponse:
    return pb.ModelInferResponse(model_name=message.model_name, model_version=message.model_version, id=message.id)


def _stream_response(response: InferResponse, empty_final: bool) -> pb.ModelStreamInferResponse:
    """The stream message of a (not decoupled) model's one response; final when the request asked
    for the final flag."""
    out = pb.ModelStreamInferResponse(infer_response=grpc_codec.encode_infer(response))
    if empty_final:
        out.infer_response.parameters[FINAL_PARAMETER].bool_param = True
    return out


def _stream_error(exc: SluiceError, message: Any) -> pb.ModelStreamInferResponse:
    return pb.ModelStreamInferResponse(error_message=exc.message, infer_response=_named_response(message))


def unimplemented_message(name: str) -> str:
    return f"{name} is not implemented by Sluice; see docs/runtime.md for the methods served"


def too_large(size: int, limit: int) -> str:
    return f"response is {size} bytes, larger than max ({limit}; --max-grpc-message-bytes)"


def stream_payload(reply: Any, limit: int) -> bytes:
    """``reply`` (a ModelStreamInferResponse, or one already serialized) as the stream sends it: a
    reply larger than ``limit`` becomes an error for its request alone (id, model, version and
    ``triton_final_response`` kept, so the client can match it and a decoupled request still ends)
    and the stream goes on with the others (grpcio would end the whole call)."""
    payload = reply if type(reply) is bytes else reply.SerializeToString()
    if len(payload) <= limit:
        return payload
    full = pb.ModelStreamInferResponse.FromString(payload).infer_response
    out = pb.ModelStreamInferResponse(error_message=too_large(len(payload), limit),
                                      infer_response=_named_response(full))
    if FINAL_PARAMETER in full.parameters:
        out.infer_response.parameters[FINAL_PARAMETER].bool_param = full.parameters[FINAL_PARAMETER].bool_param
    error = out.SerializeToString()
    if len(error) > limit:  # an id (or model name) near the limit itself: the words alone
        error = pb.ModelStreamInferResponse(error_message=too_large(len(payload), limit)).SerializeToString()
    return error
