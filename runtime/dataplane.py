"""The protocol-agnostic data plane both HTTP and gRPC call.

Returns plain Python values and domain types; the protocol adapters encode them. Raises
``SluiceError`` subclasses, which the adapters map through errors.py.

``infer_nowait`` is the one inference entry point of both front ends. With a ``Forwarder`` (the
server's ``--split-file``), a request for a split model that names no version may go to the
model's canary instead (forwarding.py decides and calls it); ensemble steps run through
``_infer_local`` and are never forwarded (one ensemble request runs on one pod's versions).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from sluice.runtime import __version__, callers, classification, logs, shm, tracing
from sluice.runtime import config as model_config
from sluice.runtime.cache import cache_key
from sluice.runtime.callers import CallerLabels, DuplicateWindow
from sluice.runtime.errors import DeviceLost, InvalidArgument, NotFound, SluiceError, Unavailable, Unsupported
from sluice.runtime.forwarding import Forwarder
from sluice.runtime.repository import ModelVersion, Repository, version_number
from sluice.runtime.settings import LogSettings
from sluice.runtime.signature import check_request
from sluice.runtime.stats import RESPONSE_CANCEL, RESPONSE_EMPTY, RESPONSE_FAIL, RESPONSE_SUCCESS
from sluice.runtime.types import InferRequest, InferResponse, Responder
from sluice.runtime.watcher import ModelControl

log = logging.getLogger("sluice.runtime.dataplane")

EXTENSIONS = [
    "classification",
    "binary_tensor_data",
    "model_repository",
    "model_repository(unload_dependents)",
    "schedule_policy",
    "model_configuration",
    "sequence",
    "parameters",
    "statistics",
    "system_shared_memory",
    "trace",
    "logging",
]


def _int_param(parameters: dict[str, Any], key: str) -> int | None:
    value = parameters.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"request parameter '{key}' must be an integer, got {value!r}")
    if value < 0:
        raise InvalidArgument(f"request parameter '{key}' must be >= 0, got {value}")
    return value


async def awaited(
    infer_nowait: Callable[[InferRequest, Callable[[InferResponse | SluiceError], None]], None],
    request: InferRequest,
) -> InferResponse:
    """The awaitable form of a callback-form ``infer_nowait(request, done)``: the response, or its
    SluiceError raised. Cancelling the awaiting task cancels the request (the client went away)."""
    waiter: asyncio.Future[InferResponse | SluiceError] = asyncio.get_running_loop().create_future()

    def done(outcome: InferResponse | SluiceError) -> None:
        if not waiter.done():
            waiter.set_result(outcome)

    infer_nowait(request, done)
    try:
        outcome = await waiter
    except asyncio.CancelledError:
        request.cancel.cancel()
        raise
    if isinstance(outcome, SluiceError):
        raise outcome
    return outcome


class DataPlane:
    def __init__(
        self,
        repository: Repository,
        *,
        strict_readiness: bool = True,
        server_name: str = "sluice",
        forwarder: Forwarder | None = None,
        shared_memory: shm.Registry | None = None,
        tracing: tracing.Tracer | None = None,
        caller_labels: CallerLabels | None = None,
        duplicates: DuplicateWindow | None = None,
        control: ModelControl | None = None,
        log_control: logs.LogControl | None = None,
    ) -> None:
        self.repository = repository
        # Who may load and unload (--model-control-mode); without one, the repository API is refused.
        self.control = control if control is not None else ModelControl(repository, "none")
        self.log_control = log_control if log_control is not None else logs.LogControl(LogSettings())
        """The logging extension's settings (``/v2/logging``, gRPC ``LogSettings``)."""
        self.shared_memory = shared_memory
        """Registered system and CUDA shared-memory regions (None: the extensions are off, as in unit tests)."""
        self.tracing = tracing if tracing is not None else _tracing_off()
        """OpenTelemetry tracing; the front ends sample requests through it behind its ``on`` flag."""
        repository.route_steps(self._infer_local)  # ensembles' steps run through the data plane, never forwarded
        if repository.services is not None:
            repository.services.dispatch = self._infer_bls  # Python models' BLS requests, never forwarded
        self._forwarder = forwarder
        # The split models (empty without a split file): the only cost of the split on the hot path.
        self._splits = forwarder.table.models if forwarder is not None else {}
        # Per-caller accounting (callers.py): the labels callers are counted under, and the window
        # duplicates are looked for in (None: off, nothing is hashed).
        self.caller_labels = caller_labels if caller_labels is not None else CallerLabels(20)
        self._duplicates = duplicates
        self._strict = strict_readiness
        self._server_name = server_name
        self._started = False
        self._draining = False
        self._accepting = True
        self.device_lost: DeviceLost | None = None
        """The first sticky CUDA error a model answered a batch with; from then on not live, not ready."""

    # -- server ------------------------------------------------------------------------------
    def live(self) -> bool:
        """False once a model lost this process's GPU context (:class:`DeviceLost`): only a restart helps."""
        return self.device_lost is None

    def ready(self) -> bool:
        """Started, not draining, the GPU context not lost, and (strict readiness) every expected model
        has a ready version."""
        if not (self._started and self._accepting) or self._draining or self.device_lost is not None:
            return False
        return not self._strict or self.repository.expected_ready()

    def _lose_device(self, error: DeviceLost) -> None:
        self.device_lost = error
        log.error(
            "%s. Liveness and readiness now fail (/v2/health/live and /v2/health/ready answer 503) so that the "
            "pod is restarted; models on the CPU keep serving until then",
            error.message,
        )

    def set_started(self) -> None:
        """Startup loads are done (whatever their outcome)."""
        self._started = True

    def drain(self) -> None:
        """Report not-ready from now on while still serving (the start of a graceful stop)."""
        self._draining = True

    def stop_accepting(self) -> None:
        self._accepting = False

    def server_metadata(self) -> dict[str, Any]:
        extensions = EXTENSIONS
        if self.shared_memory is not None and self.shared_memory.cuda_usable():  # loads CUDA the first time
            extensions = [*EXTENSIONS, "cuda_shared_memory"]
        return {"name": self._server_name, "version": __version__, "extensions": extensions}

    # -- models ------------------------------------------------------------------------------
    def model_ready(self, name: str, version: str = "") -> bool:
        """Whether ``name`` (``version``) is ready; a version that is not a number is INVALID_ARGUMENT, as
        Triton answers it, not "not ready"."""
        if version:
            version_number(version)
        try:
            self.repository.get(name, version)
        except SluiceError:
            return False
        return True

    def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
        mv = self.repository.get(name, version)
        sig = mv.signature

        def io(specs: dict) -> list[dict[str, Any]]:
            return [
                {
                    "name": s.name,
                    "datatype": s.datatype,
                    "shape": [-1, *s.dims] if sig.batched else list(s.dims),
                }
                for s in specs.values()
            ]

        return {
            "name": name,
            "versions": [str(v) for v in self.repository.ready_versions(name)],
            "platform": mv.platform,
            "inputs": io(sig.inputs),
            "outputs": io(sig.outputs),
        }

    def decoupled(self, name: str, version: str = "") -> bool:
        """Whether ``name`` (a ready version of it) uses the decoupled transaction policy: its
        requests go on ModelStreamInfer with a responder; unknown models are not decoupled."""
        try:
            mv = self.repository.get(name, version)
        except SluiceError:
            return False
        return mv.config.model_transaction_policy.decoupled

    def model_config(self, name: str, version: str = "") -> Any:
        return self.repository.get(name, version).config

    def model_config_json(self, name: str, version: str = "") -> dict[str, Any]:
        return model_config.config_to_json(self.model_config(name, version))

    def model_statistics(self, name: str = "", version: str = "") -> list[dict[str, Any]]:
        """Triton's statistics extension: every ready version of every model (no name), of one model
        (no version) or one version. An unknown or not-ready model or version is INVALID_ARGUMENT,
        with Triton's messages."""
        if not name:
            return [v.stats.as_triton() for v in self.repository.all_versions()]
        ready = self.repository.ready_versions(name)
        if not ready:
            raise InvalidArgument(f"requested model '{name}' is not available")
        if version:
            if not (version.isascii() and version.isdigit()) or int(version) not in ready:
                raise InvalidArgument(f"requested model version is not available for model '{name}'")
            ready = [int(version)]
        return [self.repository.get(name, str(v)).stats.as_triton() for v in ready]

    # -- logging -----------------------------------------------------------------------------
    def log_settings(self) -> dict[str, Any]:
        return logs.as_triton(self.log_control.settings)

    def update_log_settings(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Apply ``changes`` (Triton's setting names) at once; returns every setting in force."""
        return logs.as_triton(self.log_control.update(changes))

    def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        out = []
        for entry in self.repository.index(ready_only):
            row = {"name": entry.name}
            if entry.version:
                row["version"] = entry.version
            if entry.state:
                row["state"] = entry.state
            if entry.reason:
                row["reason"] = entry.reason
            out.append(row)
        return out

    async def load(
        self, name: str, config_override: str | None = None, files: Mapping[str, bytes] | None = None
    ) -> None:
        """Load ``name`` (explicit mode); ``files``: Triton's ``file:<version>/<name>`` overrides."""
        if not self._accepting:
            raise Unavailable("server is shutting down")
        await self.control.load(name, config_override, files)

    async def unload(self, name: str, dependents: bool = False) -> None:
        """Unload ``name``; with ``dependents`` (Triton's ``unload_dependents``), an ensemble's composing
        models too, after it, each unless another loaded ensemble still uses it (and theirs in turn)."""
        composing = self.repository.composing_models(name) if dependents else []
        await self.control.unload(name)
        for step in composing:
            # only models loaded along with an ensemble (Triton: "not explicitly loaded and now
            # without downstreams"); one a user loaded stays
            if step != name and step in self.repository.implicit and not self.repository.used_by_ensembles(step):
                await self.unload(step, dependents=True)

    def state_of(self, name: str) -> str:
        return self.repository.state_of(name)[0]

    def check_known(self, name: str) -> None:
        """Raise NotFound unless ``name`` is a model of the repository (loaded or not: the trace
        settings of a model may be set before it loads)."""
        if not self.state_of(name) and name not in self.repository.names_on_disk():
            raise NotFound(f"Request for unknown model: '{name}' is not found")

    # -- inference ---------------------------------------------------------------------------
    def _admit(self, request: InferRequest) -> ModelVersion:
        if not self._accepting:
            raise Unavailable("server is shutting down and takes no new requests")
        return self.repository.get(request.model_name, request.model_version)

    @staticmethod
    def _options(request: InferRequest) -> tuple[int, int | None]:
        params = request.parameters
        if not params:
            return 0, None
        return _int_param(params, "priority") or 0, _int_param(params, "timeout")

    async def infer(self, request: InferRequest) -> InferResponse:
        """Run ``request`` and return its response; raises SluiceError. Cancelling the awaiting
        task cancels the request (the client went away)."""
        return await awaited(self.infer_nowait, request)

    def infer_nowait(self, request: InferRequest, done: Callable[[InferResponse | SluiceError], None]) -> None:
        """Callback form of ``infer``: raises for immediate rejections, else calls ``done`` once
        (at once for a response-cache hit).

        The caller cancels through ``request.cancel`` when its client goes away. A request for a
        split model that names no version may be forwarded to the model's canary (which counts it;
        this server's statistics do not).
        """
        params = request.parameters
        if params and callers.PARAMETER in params:
            _take_caller_parameter(request)
        if self.shared_memory is not None and _names_region(request):
            self._infer_bound(request, done, self.shared_memory)
            return
        splits = self._splits
        if splits and not request.model_version and self._forwarder is not None and self._accepting:
            split = splits.get(request.model_name)
            if (
                split is not None
                # a decoupled model's stream of responses is not forwarded (the forward is one ModelInfer call)
                and (request.responder is None or not self.decoupled(request.model_name))
                and split.routes_to_canary(params.get("sequence_id") if params else None)
            ):
                self._forwarder.forward(split.target, request, done, self._infer_local)
                return
        self._infer_local(request, done)

    def _infer_bound(
        self, request: InferRequest, done: Callable[[InferResponse | SluiceError], None], registry: shm.Registry
    ) -> None:
        """A request naming shared-memory regions: its inputs become views of them and its regions are
        held until it is answered, when its outputs are written there (shm.py says why views)."""
        binding = shm.bind(registry, request.inputs, request.outputs, _shm_refusal)

        def answered(outcome: InferResponse | SluiceError) -> None:
            done(binding.finish(outcome))

        responder = request.responder
        if responder is not None and self.decoupled(request.model_name, request.model_version):
            # A decoupled model answers through the responder (done hears only of an early error): each
            # response has its outputs written to the regions (request.rewrite, before it is counted: a
            # region too small makes it an error), which are held until the final one.
            def respond(item: InferResponse | Exception | None, final: bool) -> None:
                if final:
                    binding.release()
                responder(item, final)

            request.rewrite = binding.written
            request.responder = respond

        try:
            self.infer_nowait(request, answered)  # the shared-memory parameters are gone: no second bind
        except BaseException:
            binding.release()
            raise

    def _infer_bls(self, request: InferRequest, done: Callable[[InferResponse | SluiceError], None]) -> None:
        """A Python model's BLS request: the target's queue, batching and cache, never forwarded."""
        if request.responder is None and self.decoupled(request.model_name, request.model_version):
            raise Unsupported(
                f"Model {request.model_name} is using the decoupled. The current BLS request call doesn't "
                "support models using the decoupled transaction policy. Please use 'decoupled=True' argument "
                "to the 'exec' or 'async_exec' calls for decoupled models."
            )
        self._infer_local(request, done)

    def _infer_local(self, request: InferRequest, done: Callable[[InferResponse | SluiceError], None]) -> None:
        """``infer_nowait`` on this server's own model versions.

        For a decoupled model the responses go to ``request.responder`` (on the event loop, named
        like any response) and ``done`` hears only of errors that end the request before its model
        streamed (refusals, queue timeouts, ``execute`` raising)."""
        start = time.monotonic_ns()
        mv = self._admit(request)
        stats = mv.stats
        cache = mv.cache
        decoupled = mv.config.model_transaction_policy.decoupled
        if decoupled:
            if request.responder is None:
                raise Unsupported(
                    f"model '{mv.name}' is decoupled: this end point (HTTP, or the ModelInfer RPC) doesn't support "
                    "models with decoupled transaction policy; send its requests on the gRPC ModelStreamInfer stream"
                )
            request.responder = _on_loop(request.responder, mv, request)
            cache = None
        key: object = None
        lookup_ns = 0
        caller = request.caller
        counts = stats.caller_counts(self.caller_labels.label(caller)) if caller else stats.unknown_caller

        def finished(result: InferResponse | SluiceError) -> None:
            outcome = result
            if decoupled:
                if isinstance(result, SluiceError):
                    counts.failure += 1
                else:
                    counts.success += 1
                stats.on_request(time.monotonic_ns() - start, result if isinstance(result, SluiceError) else None)
                if isinstance(result, SluiceError):
                    done(result)
                return
            if not isinstance(result, SluiceError):
                outcome = _named(result, mv, request)
                if cache is not None:
                    insert = time.monotonic_ns()
                    cache.put(key, outcome, len(mv.signature.outputs))
                    stats.on_cache_miss(lookup_ns + time.monotonic_ns() - insert)
                outcome = _classified(outcome, mv, request)
            if isinstance(outcome, SluiceError):
                counts.failure += 1
                if type(outcome) is DeviceLost and self.device_lost is None:
                    self._lose_device(outcome)
                reason = callers.rejection_reason(outcome, queued=True)
                if reason is not None:
                    counts.reject(reason)
            else:
                counts.success += 1
            stats.on_request(time.monotonic_ns() - start, outcome if isinstance(outcome, SluiceError) else None)
            done(outcome)

        try:
            check_request(request, mv.signature)
            priority, timeout_us = self._options(request)
            if cache is not None:
                key = cache_key(request)
            if caller and self._duplicates is not None:
                digest = hash((mv.name, mv.version, cache_key(request) if key is None else key))
                if self._duplicates.seen((caller, digest)):
                    counts.duplicates += 1
            if cache is not None:
                hit = cache.get(key, request)
                lookup_ns = time.monotonic_ns() - start
                if hit is not None:
                    answer = _classified(_named(hit, mv, request), mv, request)
                    if isinstance(answer, SluiceError):  # a bad classification request: not a hit served
                        raise answer
                    stats.on_cache_hit(lookup_ns)
                    counts.success += 1
                    counts.cache_hits += 1
                    done(answer)
                    return
            mv.scheduler.enqueue_callback(request, finished, priority, timeout_us)
        except SluiceError as exc:
            stats.on_request(time.monotonic_ns() - start, exc)
            counts.failure += 1
            reason = callers.rejection_reason(exc, queued=False)
            if reason is not None:
                counts.reject(reason)
            raise


def _tracing_off() -> tracing.Tracer:
    return tracing.disabled()


def _on_loop(responder: Responder, mv: ModelVersion, request: InferRequest) -> Responder:
    """A decoupled model's responder callable from any thread: each response reaches
    ``responder`` on the event loop, in the order sent, named like a response of ``mv``, and is
    counted in the version's ``response_stats`` under its index (the time since the request's
    previous response, or since it arrived)."""
    loop = asyncio.get_running_loop()
    stats = mv.stats
    index = 0
    since = time.monotonic_ns()

    def deliver(item: InferResponse | Exception | None, final: bool) -> None:
        nonlocal index, since
        now = time.monotonic_ns()
        if isinstance(item, InferResponse):
            _named(item, mv, request)
            if request.rewrite is not None:  # written where the client asked, before it is counted
                item = request.rewrite(item)
        if isinstance(item, InferResponse):
            kind = RESPONSE_SUCCESS
        else:
            kind = RESPONSE_EMPTY if item is None else RESPONSE_FAIL
        if request.cancel.cancelled:
            kind = RESPONSE_CANCEL
        stats.on_response(index, kind, now - since)
        index += 1
        since = now
        responder(item, final)

    def respond(item: InferResponse | Exception | None, final: bool) -> None:
        try:
            loop.call_soon_threadsafe(deliver, item, final)
        except RuntimeError:  # the loop is closed: the server stopped, nobody is listening
            pass

    return respond


def _take_caller_parameter(request: InferRequest) -> None:
    """Take the ``sluice_caller`` parameter out of ``request`` (models never see it) and make it the
    caller unless a header or metadata named one already. A new dict: the decoders' plan caches
    share the parameters of the request they were made from."""
    params = request.parameters
    caller = callers.caller_from_parameter(params[callers.PARAMETER])
    request.parameters = {k: v for k, v in params.items() if k != callers.PARAMETER}
    if not request.caller:
        request.caller = caller


def _named(result: InferResponse, mv: ModelVersion, request: InferRequest) -> InferResponse:
    result.model_name = mv.name
    result.model_version = str(mv.version)
    result.id = request.id
    return result


def _classified(result: InferResponse, mv: ModelVersion, request: InferRequest) -> InferResponse | SluiceError:
    """Outputs requested with ``classification: k`` become their top k (after the response cache
    stored the raw response, so a cached entry serves both kinds of request)."""
    outputs = request.outputs
    if not outputs or not any(classification.PARAMETER in output.parameters for output in outputs):
        return result
    return classification.apply(result, outputs, batched=mv.config.max_batch_size > 0, labels=mv.labels)


def _names_region(request: InferRequest) -> bool:
    for tensor in request.inputs:
        if tensor.parameters and shm.names_region(tensor.parameters):
            return True
    return any(o.parameters and shm.names_region(o.parameters) for o in request.outputs or ())


def _shm_refusal(output: Any) -> str | None:
    if output.parameters.get(classification.PARAMETER):
        return "shared memory can't be used with classification; ask for the raw output, or no classification"
    return None
