"""BLS (Business Logic Scripting): ``pb_utils.InferenceRequest(...).exec()`` from a Python model.

The Python backend binds a :class:`BlsHost` while it runs a model's code; ``exec`` and
``async_exec`` build a Sluice :class:`~sluice.runtime.types.InferRequest` and hand it to the data
plane (``BackendServices.dispatch``) on the server's event loop, so a BLS request gets the target
model's queue, batching, response cache and timeouts, as a client request would. The model's
thread waits on a future; the event loop never blocks. Errors come back inside the
``InferenceResponse`` (``has_error()``), as in Triton, never raised.

Cancellation: while ``execute`` runs, the cancel tokens of its requests are known (``outer``);
a BLS call made then is cancelled once every one of them is (with one request per batch, when the
client goes away). A model calling itself with one instance waits for its own instance: the inner
request is answered by the queue timeout (``--queue-timeout-us``, 30 s by default) instead of
hanging for ever.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import json
import queue
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import numpy as np

from sluice.runtime.backends import triton_python_backend_utils as pb_utils
from sluice.runtime.backends.base import BackendServices
from sluice.runtime.errors import (
    AlreadyExists,
    Cancelled,
    InvalidArgument,
    NotFound,
    SluiceError,
    Unavailable,
    Unknown,
    Unsupported,
)
from sluice.runtime.types import CancelToken, InferRequest, InferResponse, RequestedOutput, Tensor, datatype_of

outer_requests: contextvars.ContextVar[Sequence[InferRequest]] = contextvars.ContextVar("sluice_bls_outer", default=())
"""The requests the running ``execute`` serves (set by the Python backend): their cancel tokens, and
the trace a BLS call's span is a child of."""

_CODE_BY_ERROR: tuple[tuple[type[SluiceError], int], ...] = (  # subclasses before their bases
    (AlreadyExists, pb_utils.TritonError.ALREADY_EXISTS),
    (Unknown, pb_utils.TritonError.UNKNOWN),
    (NotFound, pb_utils.TritonError.NOT_FOUND),
    (Unsupported, pb_utils.TritonError.UNSUPPORTED),
    (InvalidArgument, pb_utils.TritonError.INVALID_ARG),
    (Unavailable, pb_utils.TritonError.UNAVAILABLE),
    (Cancelled, pb_utils.TritonError.CANCELLED),
)

_END = object()  # a BLS stream ended


def error_code(error: SluiceError) -> int:
    """The ``TritonError`` code of a Sluice error (INTERNAL for what has no closer code)."""
    for error_type, code in _CODE_BY_ERROR:
        if isinstance(error, error_type):
            return code
    return pb_utils.TritonError.INTERNAL


def to_sluice_request(request: pb_utils.InferenceRequest) -> InferRequest:
    """The data plane's request for a BLS ``InferenceRequest`` (raises TritonModelException for
    what cannot be sent)."""
    inputs = []
    for tensor in request.inputs():
        if not isinstance(tensor, pb_utils.Tensor):
            raise pb_utils.TritonModelException(
                f"BLS request inputs must be triton_python_backend_utils.Tensor objects, got {type(tensor).__name__}"
            )
        array = np.asarray(tensor.as_numpy())
        try:
            datatype = datatype_of(array)
        except ValueError as exc:
            raise pb_utils.TritonModelException(f"BLS request input '{tensor.name()}': {exc}") from None
        if datatype == "BYTES" and array.dtype != np.object_:
            array = array.astype(np.object_)
        inputs.append(Tensor(tensor.name(), datatype, array))
    try:
        parameters = json.loads(request.parameters() or "{}")
    except ValueError as exc:
        raise pb_utils.TritonModelException(f"BLS request parameters are not JSON: {exc}") from None
    if not isinstance(parameters, dict):
        raise pb_utils.TritonModelException("BLS request parameters must be a JSON object")
    correlation_id = request.correlation_id()
    if correlation_id:
        parameters["sequence_id"] = correlation_id
    flags = request.flags()
    if flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
        parameters["sequence_start"] = True
    if flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END:
        parameters["sequence_end"] = True
    if request.timeout() > 0:
        parameters["timeout"] = int(request.timeout())  # microseconds, as Triton's BLS timeout
    version = request.model_version()
    names = request.requested_output_names()
    model_name = request.model_name()
    if isinstance(model_name, bytes):  # e.g. a BYTES input's element, as Triton's bindings accept
        model_name = model_name.decode("utf-8", "replace")
    return InferRequest(
        model_name=str(model_name),
        model_version="" if version is None or int(version) <= 0 else str(int(version)),
        inputs=inputs,
        outputs=[RequestedOutput(name.decode() if isinstance(name, bytes) else str(name)) for name in names] or None,
        id=str(request.request_id() or ""),
        parameters=parameters,
    )


def to_model_response(outcome: InferResponse | BaseException | None) -> pb_utils.InferenceResponse:
    """What the model reads: outputs, or an error inside the response."""
    if isinstance(outcome, InferResponse):
        return pb_utils.InferenceResponse(
            [pb_utils.Tensor(tensor.name, tensor.data) for tensor in outcome.outputs],
            parameters=outcome.parameters or None,
        )
    if isinstance(outcome, SluiceError):
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(outcome.message, error_code(outcome)))
    if outcome is None:
        return pb_utils.InferenceResponse([])
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"BLS request failed: {outcome}"))


def unknown_model_message(model: str) -> str:
    """Triton's words for a BLS request to a model that is not loaded."""
    return f"Failed for execute the inference request. Model '{model}' is not ready."


class _Call:
    """One BLS request in flight: started on the loop, its responses collected for the model's thread."""

    def __init__(self, request: InferRequest, decoupled: bool, outer: Sequence[InferRequest]) -> None:
        self.request = request
        self.decoupled = decoupled
        self._outer: tuple[CancelToken, ...] = tuple(r.cancel for r in outer)
        # The first sampled request of the batch: the BLS call is a child span of its trace (tracing.py).
        self._parent = next((r.trace for r in outer if r.trace is not None), None)
        self.responses: queue.SimpleQueue[Any] = queue.SimpleQueue()  # decoupled: responses, then _END
        self.single: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if decoupled:
            request.responder = self._on_response

    def start(self, services: BackendServices) -> None:
        """On the event loop: link cancellation and dispatch."""
        request = self.request
        if self._outer:
            remaining = [len(self._outer)]

            def one_cancelled() -> None:
                remaining[0] -= 1
                if remaining[0] == 0:
                    request.cancel.cancel()

            for token in self._outer:
                token.on_cancel(one_cancelled)
        assert services.dispatch is not None
        done: Callable[[Any], None] = self._done
        if self._parent is not None:  # sampled (tracing.py): the call is a child span of the request's
            done = self._parent.child(request, "bls", done)
            if request.responder is not None and request.trace is not None:
                # decoupled: its span records each response and ends at the final one
                request.responder = request.trace.responses(request.responder)
        try:
            services.dispatch(request, done)
        except SluiceError as exc:
            done(exc)
        except Exception as exc:  # a bug must reach the model as an error response, not hang it
            done(SluiceError(f"BLS request failed: {type(exc).__name__}: {exc}"))

    def _error(self, outcome: SluiceError) -> SluiceError:
        if isinstance(outcome, NotFound) and outcome.message.startswith("Request for unknown model"):
            return NotFound(unknown_model_message(self.request.model_name))
        return outcome

    def _done(self, outcome: Any) -> None:
        if isinstance(outcome, SluiceError):
            outcome = self._error(outcome)
        if not self.decoupled:
            if not self.single.done():
                self.single.set_result(outcome)
        else:
            # An error before a decoupled model streamed anything (the data plane calls ``done``
            # for decoupled models with errors only), or the one response of a model that is not
            # decoupled: either way the whole stream.
            self.responses.put(outcome)
            self.responses.put(_END)

    def _on_response(self, item: InferResponse | Exception | None, final: bool) -> None:
        if item is not None:
            self.responses.put(item)
        if final:
            self.responses.put(_END)

    def iterate(self) -> Iterator[pb_utils.InferenceResponse]:
        """The model's iterator over a decoupled BLS call: blocks for each response; a bare final
        flag ends it without a response."""
        while True:
            item = self.responses.get()
            if item is _END:
                return
            yield to_model_response(item)


class BlsHost(pb_utils.ModelHost):
    """Runs BLS requests of one model version through the server's data plane."""

    def __init__(self, services: BackendServices | None, model_name: str) -> None:
        self._services = services
        self._model_name = model_name

    def _begin(self, request: pb_utils.InferenceRequest, decoupled: bool) -> _Call:
        services = self._services
        if services is None or services.dispatch is None or services.loop is None:
            raise pb_utils.TritonModelException("BLS requests need a running server; none is attached to this model")
        loop = services.loop
        if _running_loop() is loop:
            raise pb_utils.TritonModelException(
                "BLS exec() was called on the server's event loop, where waiting would block every request; "
                "call it from execute()"
            )
        call = _Call(to_sluice_request(request), decoupled, outer_requests.get())
        try:
            loop.call_soon_threadsafe(call.start, services)
        except RuntimeError:  # the loop is closed: the server stopped
            raise pb_utils.TritonModelException("BLS request refused: the server is shutting down") from None
        return call

    def exec(self, request: pb_utils.InferenceRequest, decoupled: bool) -> Any:
        call = self._begin(request, decoupled)
        if decoupled:
            return call.iterate()
        return to_model_response(call.single.result())

    def async_exec(self, request: pb_utils.InferenceRequest, decoupled: bool) -> Awaitable[Any]:
        """Send at once (not when awaited: a call never awaited still runs, as in Triton); the task
        returned resolves to the answer on the model's loop."""
        loop = asyncio.get_running_loop()
        call = self._begin(request, decoupled)
        if not decoupled:
            single = asyncio.wrap_future(call.single, loop=loop)
            return loop.create_task(_converted(single))
        # A decoupled call is awaited whole: the iterator the model gets then never blocks its loop.
        return loop.run_in_executor(None, lambda: iter(list(call.iterate())))


async def _converted(single: Awaitable[Any]) -> Any:
    return to_model_response(await single)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
