"""The Python backend: runs Triton ``model.py`` files (``class TritonPythonModel``) unchanged.

The repository calls :func:`load` for a model version whose config says ``backend: "python"``; the
scheduler then asks the returned backend for instances and calls ``execute`` on a worker thread.
Unlike Triton, which runs each instance in a stub process, Sluice runs the model in-process: each
instance is one ``TritonPythonModel()`` object, used by one thread at a time.

Conversion happens here, in both directions: Sluice's :class:`~sluice.runtime.types.InferRequest`
becomes a ``pb_utils.InferenceRequest`` for the model, and each ``pb_utils.InferenceResponse``
becomes an ``InferResponse`` or a :class:`~sluice.runtime.errors.SluiceError` for that request
alone. The ``pb_utils`` surface itself is :mod:`.triton_python_backend_utils`; what is and is not
supported is listed in ``docs/python-backend.md``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import importlib.util
import inspect
import itertools
import json
import logging
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc

from sluice.runtime.backends import bls, torch_platform
from sluice.runtime.backends import triton_python_backend_utils as pb_utils
from sluice.runtime.backends.base import (
    LoadContext,
    ModelBackend,
    ModelInstance,
    Result,
    client_shape,
    instance_name_of,
    reshape_problem,
)
from sluice.runtime.config_json import config_to_json
from sluice.runtime.errors import (
    AlreadyExists,
    Cancelled,
    ConfigError,
    InvalidArgument,
    ModelError,
    NotFound,
    SluiceError,
    Unavailable,
    Unknown,
    Unsupported,
)
from sluice.runtime.types import (
    CONFIG_TYPE_BY_DATATYPE,
    DATATYPE_BY_CONFIG_TYPE,
    CancelToken,
    InferRequest,
    InferResponse,
    Tensor,
    datatype_of,
)

_log = logging.getLogger(__name__)

UTILS_MODULE_NAME = "triton_python_backend_utils"
DEFAULT_MODEL_FILENAME = "model.py"

# Request parameters the protocol layer consumes itself; Triton does not show them to the model
# in ``request.parameters()``.
_RESERVED_PARAMETERS = frozenset(
    {
        "sequence_id",
        "sequence_start",
        "sequence_end",
        "priority",
        "timeout",
        "binary_data_output",
        "triton_enable_empty_final_response",
    }
)

# TritonError code -> the Sluice error (and so the HTTP status / gRPC code) the client sees.
_ERROR_BY_TRITON_CODE: dict[int, type[SluiceError]] = {
    pb_utils.TritonError.UNKNOWN: Unknown,
    pb_utils.TritonError.INTERNAL: ModelError,
    pb_utils.TritonError.NOT_FOUND: NotFound,
    pb_utils.TritonError.INVALID_ARG: InvalidArgument,
    pb_utils.TritonError.UNAVAILABLE: Unavailable,
    pb_utils.TritonError.UNSUPPORTED: Unsupported,
    pb_utils.TritonError.ALREADY_EXISTS: AlreadyExists,
    pb_utils.TritonError.CANCELLED: Cancelled,
}

# Unique module names, so two models (or two versions) with a ``model.py`` never share a module.
_module_numbers = itertools.count(1)
# ``sys.path`` and ``sys.modules`` are process-wide: one model import at a time.
_import_lock = threading.Lock()


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def load(config: mc.ModelConfig, ctx: LoadContext) -> ModelBackend:
    """Import ``<version_dir>/model.py`` (or ``default_model_filename``) and check its class."""
    if config.model_transaction_policy.decoupled and config.response_cache.enable:
        raise ConfigError(
            "the response cache does not support models with model_transaction_policy { decoupled: true }; "
            "allowed: response_cache { enable: false } or decoupled: false",
            field="response_cache.enable",
        )
    if config.platform == torch_platform.PLATFORM:
        return _load_torch_platform(config, ctx)
    path = ctx.version_dir / (config.default_model_filename or DEFAULT_MODEL_FILENAME)
    shown = _shown(path, ctx)
    if not path.is_file():
        raise ModelError(
            f"failed to load '{ctx.model_name}' version {ctx.version}: model file {shown} does not exist "
            f"(the Python backend loads '{config.default_model_filename or DEFAULT_MODEL_FILENAME}' "
            "from the version directory; set default_model_filename to use another name)"
        )
    module = _import_model_file(path, ctx)
    model_class = getattr(module, "TritonPythonModel", None)
    if not inspect.isclass(model_class):
        _forget_module(module)
        raise ModelError(
            f"failed to load '{ctx.model_name}' version {ctx.version}: {shown} does not define "
            "a class named 'TritonPythonModel'"
        )
    if not callable(getattr(model_class, "execute", None)):
        _forget_module(module)
        raise ModelError(
            f"failed to load '{ctx.model_name}' version {ctx.version}: class TritonPythonModel in {shown} "
            "has no execute(self, requests) method"
        )
    return PythonBackend(config, ctx, module, model_class)


def _load_torch_platform(config: mc.ModelConfig, ctx: LoadContext) -> ModelBackend:
    """``platform: "pytorch"``: Triton's PyTorch platform handler serves a plain PyTorch model."""
    where = f"failed to load '{ctx.model_name}' version {ctx.version}"
    path = torch_platform.model_file(ctx.version_dir, config.default_model_filename)
    if path is None:
        tried = ", ".join(([config.default_model_filename] if config.default_model_filename else [])
                          + list(torch_platform.MODEL_FILES))
        raise ModelError(
            f"{where}: platform 'pytorch' (Triton's PyTorch platform handler) loads one of {tried} from the "
            "version directory; none is there"
        )
    try:
        import torch  # noqa: F401 - the handler needs it
    except ImportError:
        raise ModelError(f"{where}: platform 'pytorch' needs PyTorch: pip install 'sluice[torch]'") from None
    module = _import_model_file(path, ctx) if path.suffix == ".py" else None
    try:
        model_class = torch_platform.handler(path, module)
    except pb_utils.TritonModelException as exc:
        if module is not None:
            _forget_module(module)
        raise ModelError(f"{where}: {exc.message()}") from None
    return PythonBackend(config, ctx, module or ModuleType(f"sluice_torch_platform_{ctx.model_name}"), model_class)


def auto_complete(config: mc.ModelConfig, ctx: LoadContext) -> None:
    """Let ``TritonPythonModel.auto_complete_config`` complete ``config`` in place, as Triton does
    before it validates the config; nothing happens when the class does not define it.

    The model file is imported for this call alone, as Triton runs it in a stub process of its own
    (so, as there, the file's top level runs twice per load); nothing it creates here reaches
    ``initialize``. The method may come from a base class in another file. Runs before validation,
    so the completed config is checked like a written one.
    """
    if ctx.services is not None and not ctx.services.auto_complete_config:
        return  # --disable-auto-complete-config
    if config.platform == torch_platform.PLATFORM:
        return  # the platform handler completes nothing, as Triton's
    path = ctx.version_dir / (config.default_model_filename or DEFAULT_MODEL_FILENAME)
    if not path.is_file():
        return  # load() reports the missing file
    module = _import_model_file(path, ctx)
    try:
        hook = getattr(getattr(module, "TritonPythonModel", None), "auto_complete_config", None)
        if not callable(hook):
            return
        where = f"failed to load '{ctx.model_name}': auto_complete_config"
        try:
            with _metrics_owned(ctx, f"{ctx.model_name}:auto_complete"):
                completed = hook(pb_utils.ModelConfig(model_config_json(config)))
        except BaseException as exc:  # SystemExit from model code too: a load failure, not the server's exit
            raise ModelError(f"{where} raised {type(exc).__name__}: {_without_repository(str(exc), ctx)}") from exc
        if not isinstance(completed, pb_utils.ModelConfig):
            raise ModelError(
                f"{where} returned {type(completed).__name__}; it must return the "
                "triton_python_backend_utils.ModelConfig it was given"
            )
        try:
            parsed = json_format.ParseDict(completed.as_dict(), mc.ModelConfig())
        except (json_format.ParseError, TypeError, ValueError) as exc:
            raise ModelError(f"{where} produced a config that is not a valid ModelConfig: {exc}") from exc
        config.CopyFrom(parsed)
    finally:
        _forget_module(module)


def _import_model_file(path: Path, ctx: LoadContext) -> ModuleType:
    """Import ``path`` as a fresh module; sibling files of ``path`` are importable while it runs.

    Sibling modules imported by the model file are dropped from ``sys.modules`` afterwards (the
    model keeps its references), so another model's ``utils.py`` is never mistaken for this one's.
    """
    safe_name = re.sub(r"\W", "_", ctx.model_name)
    module_name = f"sluice_python_model_{next(_module_numbers)}_{safe_name}_v{ctx.version}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ModelError(f"failed to load '{ctx.model_name}' version {ctx.version}: cannot import {_shown(path, ctx)}")
    module = importlib.util.module_from_spec(spec)
    sibling_dir = str(path.parent)
    with _import_lock:
        sys.modules[UTILS_MODULE_NAME] = pb_utils
        already_imported = set(sys.modules)
        sys.modules[module_name] = module
        sys.path.insert(0, sibling_dir)
        try:
            spec.loader.exec_module(module)
        except BaseException as exc:  # sys.exit() at import time too: the load fails, the server serves on
            sys.modules.pop(module_name, None)
            raise ModelError(
                f"failed to load '{ctx.model_name}' version {ctx.version}: importing {_shown(path, ctx)} raised "
                f"{type(exc).__name__}: {_without_repository(str(exc), ctx)}{_where(exc, ctx)}"
            ) from exc
        finally:
            with contextlib.suppress(ValueError):
                sys.path.remove(sibling_dir)
            _forget_siblings(path.parent, set(sys.modules) - already_imported - {module_name})
    return module


def _shown(path: Path, ctx: LoadContext) -> str:
    """``path`` as clients may see it: relative to the model repository (``<model>/1/model.py``)."""
    try:
        return str(path.relative_to(ctx.repository))
    except ValueError:
        return path.name


def _without_repository(text: str, ctx: LoadContext) -> str:
    """``text`` (an exception's message, e.g. a SyntaxError naming its file) with the server's
    repository path cut off, so load errors never show clients where the repository lives."""
    for root in {str(ctx.repository), str(ctx.repository.resolve())}:
        text = text.replace(root + os.sep, "")
    return text


def _where(exc: BaseException, ctx: LoadContext) -> str:
    """Where in the model's own files ``exc`` was raised, innermost last, as Triton's load errors
    say it (``At: 1/model.py(12): initialize``), paths relative to the repository; "" when none of
    the traceback is the model's (the error came from a library it called directly)."""
    try:
        root = ctx.model_dir.resolve()
    except OSError:
        return ""
    frames = []
    for frame in traceback.extract_tb(exc.__traceback__):
        path = Path(frame.filename)
        try:
            inside = path.resolve().is_relative_to(root)
        except OSError:
            inside = False
        if inside:
            frames.append(f"{_shown(path, ctx)}({frame.lineno}): {frame.name}")
    return f"; At: {', '.join(frames[-5:])}" if frames else ""


def _forget_siblings(directory: Path, names: set[str]) -> None:
    root = directory.resolve()
    for name in names:
        file = getattr(sys.modules.get(name), "__file__", None)
        if file and Path(file).resolve().is_relative_to(root):
            sys.modules.pop(name, None)


def _forget_module(module: ModuleType) -> None:
    if sys.modules.get(module.__name__) is module:
        del sys.modules[module.__name__]


def model_config_json(config: mc.ModelConfig) -> str:
    """The config as Triton hands it to ``initialize``: field names as in the proto, defaults
    included (``max_batch_size: 0`` is present), and 64-bit integers such as ``dims`` as JSON
    numbers, not the strings protobuf's JSON mapping would use."""
    return json.dumps(config_to_json(config))


# ---------------------------------------------------------------------------------------------
# Backend and instances
# ---------------------------------------------------------------------------------------------


class PythonBackend(ModelBackend):
    """A loaded ``model.py``; every instance gets its own ``TritonPythonModel`` object."""

    def __init__(self, config: mc.ModelConfig, ctx: LoadContext, module: ModuleType, model_class: type) -> None:
        self.config = config
        self._ctx = ctx
        self._module = module
        self._model_class = model_class
        self._config_json = model_config_json(config)
        self._declared_outputs = {
            output.name: DATATYPE_BY_CONFIG_TYPE[mc.DataType.Name(output.data_type)]
            for output in config.output
            if mc.DataType.Name(output.data_type) in DATATYPE_BY_CONFIG_TYPE
        }
        self._all_output_names = [output.name for output in config.output]
        self._reshaped_outputs = {
            output.name: (tuple(output.dims), tuple(output.reshape.shape))
            for output in config.output
            if output.HasField("reshape")
        }
        self._batched = config.max_batch_size > 0
        self.decoupled = config.model_transaction_policy.decoupled
        self.host = bls.BlsHost(ctx.services, ctx.model_name)
        self.metrics_owner = f"{ctx.model_name}:{ctx.version}"
        for state in config.sequence_batching.state:  # implicit state: the model returns it as an output
            self._declared_outputs[state.output_name] = DATATYPE_BY_CONFIG_TYPE[mc.DataType.Name(state.data_type)]

    def new_instance(self, index: int, kind: int, device_id: int) -> ModelInstance:
        name = self._ctx.model_name
        instance_name = instance_name_of(self.config, name, index, self._ctx)
        try:
            kind_name = mc.ModelInstanceGroup.Kind.Name(kind).removeprefix("KIND_")
        except ValueError:
            kind_name = str(kind)
        args = {
            "model_config": self._config_json,
            "model_instance_kind": kind_name,
            "model_instance_name": instance_name,
            "model_instance_device_id": str(device_id),
            "model_repository": str(self._ctx.model_dir),
            "model_version": str(self._ctx.version),
            "model_name": name,
        }
        instance = PythonInstance(self, instance_name)
        try:
            instance.start(args)
        except BaseException as exc:  # SystemExit from initialize too: this load fails, nothing else
            instance.close_loop()
            raise ModelError(
                f"failed to initialize model instance '{instance_name}' of model '{name}' "
                f"version {self._ctx.version}: {type(exc).__name__}: {_without_repository(str(exc), self._ctx)}"
                f"{_where(exc, self._ctx)}"
            ) from exc
        return instance

    @contextlib.contextmanager
    def model_code(self) -> Any:
        """Around every call into the model: BLS calls and new metric families are this model's."""
        with pb_utils.bound_host(self.host), _metrics_owned(self._ctx, self.metrics_owner):
            yield

    def close(self) -> None:
        _forget_module(self._module)
        registry = self._ctx.services.model_metrics if self._ctx.services is not None else None
        if registry is not None:
            registry.release(self.metrics_owner)


@contextlib.contextmanager
def _metrics_owned(ctx: LoadContext, owner: str) -> Any:
    registry = ctx.services.model_metrics if ctx.services is not None else None
    if registry is None:
        yield
        return
    with registry.owned_by(owner):
        yield


class PythonInstance(ModelInstance):
    """One ``TritonPythonModel`` object; ``execute`` converts requests in and responses out."""

    def __init__(self, backend: PythonBackend, instance_name: str) -> None:
        self._backend = backend
        self._instance_name = instance_name
        self._model: Any = None
        self._loop: _InstanceLoop | None = None
        self._in_flight: set[concurrent.futures.Future] = set()  # decoupled async executes still running

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self, args: dict[str, str]) -> None:
        with self._backend.model_code():
            self._model = self._backend._model_class()
            initialize = getattr(self._model, "initialize", None)
            if callable(initialize):
                self._resolve(initialize(args))

    def close(self) -> None:
        """Call ``finalize`` (awaited when it is ``async def``), then drop the model and its loop.

        The repository calls this on a worker thread, so a slow ``finalize`` blocks only that
        thread; :meth:`_resolve` still copes with a caller that has a loop running.
        """
        if self._in_flight:  # a decoupled async execute answers after the scheduler saw it return
            _, running = concurrent.futures.wait(set(self._in_flight), timeout=IN_FLIGHT_GRACE_S)
            for future in running:
                future.cancel()  # its streams end with UNAVAILABLE (_decoupled_done)
        finalize = getattr(self._model, "finalize", None)
        try:
            if callable(finalize):
                with self._backend.model_code():
                    self._resolve(finalize())
        except BaseException:  # SystemExit from finalize too: the unload completes, the server serves on
            _log.exception("finalize() of model instance '%s' raised", self._instance_name)
        finally:
            self._model = None
            self.close_loop()

    def close_loop(self) -> None:
        """Stop the instance's loop as ``asyncio.run`` would end: tasks the model left behind are
        cancelled and async generators closed first, so nothing warns about a destroyed task."""
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.close(self._instance_name)

    def _async_loop(self) -> _InstanceLoop:
        if self._loop is None:
            self._loop = _InstanceLoop(f"sluice-{self._instance_name}-asyncio")
        return self._loop

    def _resolve(self, result: Any) -> Any:
        """Run a coroutine (``async def execute``/``initialize``/``finalize``) to completion on this
        instance's loop, which keeps running between calls (Triton 24.04+): tasks the model starts
        go on after the call that started them returned."""
        if not inspect.isawaitable(result):
            return result
        return self._async_loop().submit(result).result()

    # -- execution ------------------------------------------------------------------------------

    def execute(self, requests: Sequence[InferRequest]) -> list[Result]:
        model_name = self._backend._ctx.model_name
        start = time.monotonic_ns()
        wrapped = [self._to_model_request(request) for request in requests]
        self.last_phases_ns = (time.monotonic_ns() - start, 0)
        outer = bls.outer_requests.set(requests)
        try:
            with self._backend.model_code():
                returned = self._model.execute(wrapped)
                if inspect.isawaitable(returned):
                    if self._backend.decoupled:  # as in Triton: not awaited here, so requests run at once
                        future = self._async_loop().submit(returned)
                        self._in_flight.add(future)
                        future.add_done_callback(functools.partial(self._decoupled_done, wrapped, model_name))
                        return [_accepted(request) for request in requests]
                    returned = self._resolve(returned)
        except BaseException as exc:  # SystemExit from model code too: the instance must keep serving
            message = _execute_failed(self._instance_name, exc, self._backend._ctx)
            _log.debug("execute() of model instance '%s' raised", self._instance_name, exc_info=True)
            if self._backend.decoupled:
                return [self._decoupled_failure(request, message) for request in wrapped]
            return [ModelError(message) for _ in requests]
        finally:
            bls.outer_requests.reset(outer)
        if self._backend.decoupled:
            if returned is not None:
                _log.warning(
                    "execute() of decoupled model '%s' returned %s; decoupled models send responses through "
                    "request.get_response_sender() and return None (the value is ignored)",
                    model_name,
                    type(returned).__name__,
                )
            return [_accepted(request) for request in requests]
        problem = _check_response_list(returned, len(requests))
        if problem is not None:
            message = f"model '{model_name}': {problem}"
            return [ModelError(message) for _ in requests]
        outputs_start = time.monotonic_ns()
        results = [
            self._to_result(position, request, response)
            for position, (request, response) in enumerate(zip(requests, returned, strict=True))
        ]
        self.last_phases_ns = (self.last_phases_ns[0], time.monotonic_ns() - outputs_start)
        return results

    def _to_model_request(self, request: InferRequest) -> ServedRequest:
        parameters = request.parameters
        correlation_id = parameters.get("sequence_id", 0)
        if not isinstance(correlation_id, (int, str)):
            correlation_id = 0
        flags = 0
        if parameters.get("sequence_start"):
            flags |= pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
        if parameters.get("sequence_end"):
            flags |= pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
        if request.outputs:
            requested = [output.name for output in request.outputs]
        else:  # as in Triton: no requested outputs means all of the model's outputs
            requested = list(self._backend._all_output_names)
        version = request.model_version
        return ServedRequest(
            request.cancel,
            _DecoupledStream(self, request) if self._backend.decoupled else None,
            request_id=request.id,
            correlation_id=correlation_id,
            inputs=[pb_utils.Tensor(tensor.name, tensor.data) for tensor in request.inputs],
            requested_output_names=requested,
            model_name=request.model_name,
            model_version=int(version) if version.isascii() and version.isdigit() else self._backend._ctx.version,
            flags=flags,
            parameters={k: v for k, v in parameters.items() if k not in _RESERVED_PARAMETERS},
        )

    def _decoupled_done(
        self, wrapped: Sequence[ServedRequest], model_name: str, future: concurrent.futures.Future
    ) -> None:
        """An ``async def execute`` of a decoupled model ended (on the instance's loop): an exception
        ends each stream it had not ended with the error, as a synchronous execute's would."""
        self._in_flight.discard(future)
        if future.cancelled():  # the instance closed before it finished
            for request in wrapped:
                if request._stream is not None:
                    request._stream.fail(Unavailable(f"model '{model_name}' was unloaded before it answered"))
            return
        exc = future.exception()
        if exc is None:
            return
        message = _execute_failed(self._instance_name, exc, self._backend._ctx)
        _log.debug("execute() of model instance '%s' raised", self._instance_name, exc_info=exc)
        for request in wrapped:
            if request._stream is not None:
                request._stream.fail(ModelError(message))

    def _decoupled_failure(self, request: ServedRequest, message: str) -> Result:
        """``execute`` of a decoupled model raised: the error ends each stream it had not ended."""
        stream = request._stream
        if stream is not None and stream.close_for_error():
            return ModelError(message)
        return InferResponse(request.model_name(), str(request.model_version()), [], id=request.request_id())

    def _to_result(self, position: int, request: InferRequest, response: Any) -> Result:
        model_name = self._backend._ctx.model_name
        if not isinstance(response, pb_utils.InferenceResponse):
            return ModelError(
                f"model '{model_name}': execute() returned {type(response).__name__} at position {position}; "
                "expected a triton_python_backend_utils.InferenceResponse"
            )
        error = response.error()
        if error is not None:
            error_type = _ERROR_BY_TRITON_CODE.get(error.code(), ModelError)
            return error_type(str(error.message()))
        wanted = {output.name for output in request.outputs} if request.outputs else None
        outputs: list[Tensor] = []
        try:
            for tensor in response.output_tensors():
                output = self._to_output(tensor)
                if wanted is None or output.name in wanted:
                    outputs.append(output)
            parameters = json.loads(response.parameters())
        except SluiceError as exc:
            return exc
        except ValueError as exc:
            return ModelError(f"model '{model_name}': response parameters are not a JSON object: {exc}")
        return InferResponse(
            model_name=request.model_name,
            model_version=request.model_version or str(self._backend._ctx.version),
            outputs=outputs,
            id=request.id,
            parameters=parameters if isinstance(parameters, dict) else {},
        )

    def _to_output(self, tensor: Any) -> Tensor:
        model_name = self._backend._ctx.model_name
        if not isinstance(tensor, pb_utils.Tensor):
            raise ModelError(
                f"model '{model_name}': an InferenceResponse holds a {type(tensor).__name__} "
                "where a triton_python_backend_utils.Tensor was expected"
            )
        name = tensor.name()
        declared = self._backend._declared_outputs
        if declared and name not in declared:
            allowed = ", ".join(f"'{n}'" for n in declared)
            raise ModelError(
                f"model '{model_name}' returned output '{name}', which its configuration does not declare "
                f"(declared outputs: {allowed})"
            )
        datatype, data = convert_output(name, np.asarray(tensor.as_numpy()), declared.get(name))
        reshaped = self._backend._reshaped_outputs.get(name)
        if reshaped is not None:  # Triton applies an output's reshape in the core, for every backend
            dims, model_shape = reshaped
            shape = client_shape(data.shape, dims, model_shape, self._backend._batched)
            if shape is None:
                raise ModelError(reshape_problem(model_name, name, data.shape, dims, model_shape))
            data = data.reshape(shape)
        if data.flags.writeable:
            # Triton copies a Python model's outputs out (into shared memory): a model may refill one
            # buffer on every execute while this answer waits to be written or sits in the cache.
            data = data.copy()
            data.flags.writeable = False  # ours alone: the response cache keeps it as it is
        return Tensor(name, datatype, data)


IN_FLIGHT_GRACE_S = 30.0
"""How long closing an instance waits for its decoupled ``async def execute`` calls still running."""


class _InstanceLoop:
    """An event loop on a thread of its own for one model instance's coroutines: ``async def
    execute`` (and ``initialize``/``finalize``) and every task they start run there, and the loop
    keeps running between calls, as Triton's Python backend does since 24.04."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, awaitable: Any) -> concurrent.futures.Future:
        """Run ``awaitable`` on the loop, in the caller's context (the BLS host and metrics owner it bound)."""
        return asyncio.run_coroutine_threadsafe(_awaited(awaitable), self.loop)

    def close(self, instance_name: str) -> None:
        async def shut_down() -> None:
            leftover = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in leftover:
                task.cancel()
            await asyncio.gather(*leftover, return_exceptions=True)
            await self.loop.shutdown_asyncgens()

        if threading.current_thread() is self._thread:  # from the model's own loop: cannot wait on it
            self.loop.call_soon(self.loop.stop)
            return
        try:
            asyncio.run_coroutine_threadsafe(shut_down(), self.loop).result(timeout=30)
        except Exception:
            _log.exception("closing the event loop of model instance '%s' failed", instance_name)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        if not self._thread.is_alive():
            self.loop.close()


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _loop_running_here() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class ServedRequest(pb_utils.InferenceRequest):
    """A request from a client, as the model sees it: cancellation is read live from Sluice."""

    def __init__(self, cancel: CancelToken, stream: _DecoupledStream | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._cancel_token = cancel
        self._stream = stream

    def is_cancelled(self) -> bool:
        return self._cancel_token.cancelled

    def get_response_sender(self) -> pb_utils.InferenceResponseSender:
        if self._stream is None:
            return super().get_response_sender()
        return ResponseSender(self._stream)


def _execute_failed(instance_name: str, exc: BaseException, ctx: LoadContext) -> str:
    """Triton's words for an ``execute`` that raised (python_be.cc), which clients and log rules match on;
    Triton appends the traceback, which names the server's files: Sluice logs it instead, and cuts the
    repository's path out of the message (a file the model failed to open is shown relative to it)."""
    message = f"{type(exc).__name__}: {_without_repository(str(exc), ctx)}"
    return f"Failed to process the request(s) for model instance '{instance_name}', message: {message}"


def _accepted(request: InferRequest) -> InferResponse:
    """What a decoupled model's ``execute`` gives the scheduler for a request it accepted (the
    data plane does not pass it on: the responses go through the request's responder)."""
    return InferResponse(request.model_name, request.model_version, [], id=request.id)


class _DecoupledStream:
    """The responses of one request to a decoupled model, shared by its response senders.

    Sends go to the request's responder (the data plane moves them onto the event loop). Once the
    final flag went out, the stream is closed: another send raises TritonModelException, as in
    Triton, and is logged. When the model drops the request and its senders without a final flag,
    one is sent for it (and a warning logged), so the client's stream is never left waiting.
    """

    def __init__(self, instance: PythonInstance, request: InferRequest) -> None:
        self._instance = instance
        self._request = request
        self._lock = threading.Lock()
        self._closed = False
        self._position = 0

    def cancelled(self) -> bool:
        return self._request.cancel.cancelled

    def close_for_error(self) -> bool:
        """Close the stream so the scheduler's error result is its end; False if already closed."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            return True

    def fail(self, error: SluiceError) -> None:
        """End the stream with ``error`` unless it has ended (an ``async def execute`` that raised)."""
        responder = self._request.responder
        if self.close_for_error() and responder is not None:
            with contextlib.suppress(Exception):  # the client's stream is gone: nothing to deliver to
                responder(error, True)

    def send(self, response: Any, flags: int) -> None:
        final = bool(flags & pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        model_name = self._instance._backend._ctx.model_name
        if response is None and not final:
            raise pb_utils.TritonModelException(
                "Inference Response object is needed when the flags is not TRITONSERVER_RESPONSE_COMPLETE_FINAL"
            )
        with self._lock:
            if self._closed:
                _log.warning(
                    "model '%s' sent a response for request '%s' after its final flag; it was dropped",
                    model_name,
                    self._request.id,
                )
                raise pb_utils.TritonModelException("Unable to send response. Response sender has been closed.")
            self._closed = final
            position = self._position
            self._position += 1
        result: Result | None = None
        if response is not None:
            result = self._instance._to_result(position, self._request, response)
        responder = self._request.responder
        if responder is None:
            return
        if self.cancelled():
            _log.debug("model '%s': response for cancelled request '%s' dropped", model_name, self._request.id)
            if not final:
                return
        try:
            responder(result, final)
        except Exception:  # the client's stream is gone: nothing to deliver to
            _log.debug("model '%s': a response could not be delivered", model_name, exc_info=True)

    def __del__(self) -> None:
        if not self._closed and self._request.responder is not None:
            _log.warning(
                "model '%s' released request '%s' without sending TRITONSERVER_RESPONSE_COMPLETE_FINAL; "
                "the final flag was sent for it",
                self._instance._backend._ctx.model_name,
                self._request.id,
            )
            self._closed = True
            with contextlib.suppress(Exception):
                self._request.responder(None, True)


class ResponseSender(pb_utils.InferenceResponseSender):
    """``request.get_response_sender()`` of a decoupled model."""

    def __init__(self, stream: _DecoupledStream) -> None:
        self._stream = stream

    def send(self, response: pb_utils.InferenceResponse | None = None, flags: int = 0) -> None:
        if response is not None and not isinstance(response, pb_utils.InferenceResponse):
            raise pb_utils.TritonModelException(
                f"send() takes a triton_python_backend_utils.InferenceResponse, got {type(response).__name__}"
            )
        self._stream.send(response, flags)

    def is_cancelled(self) -> bool:
        return self._stream.cancelled()


def _check_response_list(returned: Any, expected: int) -> str | None:
    """Why the value ``execute`` returned cannot be matched to the requests, or None if it can."""
    if returned is None:
        return (
            "execute() returned None; only models with model_transaction_policy { decoupled: true } may, "
            "return a list with one InferenceResponse per request"
        )
    if not isinstance(returned, (list, tuple)):
        return f"execute() must return a list of InferenceResponse, got {type(returned).__name__}"
    if len(returned) != expected:
        return (
            "Number of InferenceResponse objects do not match the number of InferenceRequest objects. "
            f"InferenceRequest(s) size is:{expected}, and InferenceResponse(s) size is:{len(returned)}"
        )
    return None


# ---------------------------------------------------------------------------------------------
# Output conversion
# ---------------------------------------------------------------------------------------------


def convert_output(name: str, array: np.ndarray, declared: str | None) -> tuple[str, np.ndarray]:
    """The V2 datatype and in-memory array for an output the model produced.

    With a declared datatype the data is converted to it when numpy calls that a ``same_kind``
    cast (float64 -> FP32, int64 -> INT32, ...); anything else is a :class:`ModelError` in Triton's
    words. Without one the datatype follows the array. BYTES become object arrays of ``bytes``.
    """
    if declared is None:
        if array.dtype.name == "bfloat16":
            return "BF16", array.view(np.uint16)
        try:
            declared = datatype_of(array)
        except ValueError as exc:
            raise ModelError(f"output '{name}': numpy dtype {array.dtype} has no Triton datatype") from exc
    if declared == "BYTES":
        if array.dtype == np.object_ or array.dtype.kind in ("S", "U"):
            return "BYTES", _to_bytes_array(array)
    elif declared == "BF16":
        bits = _to_bf16_bits(array)
        if bits is not None:
            return "BF16", bits
    else:
        target = np.dtype(pb_utils.triton_string_to_numpy(CONFIG_TYPE_BY_DATATYPE[declared]))
        if array.dtype == target:
            return declared, array
        if array.dtype.kind in "biuf" and np.can_cast(array.dtype, target, casting="same_kind"):
            return declared, array.astype(target)
    raise ModelError(
        f"configuration expects datatype {CONFIG_TYPE_BY_DATATYPE[declared]} for output '{name}', "
        f"model provides {_describe_dtype(array)}"
    )


def _describe_dtype(array: np.ndarray) -> str:
    try:
        return CONFIG_TYPE_BY_DATATYPE[datatype_of(array)]
    except ValueError:
        return f"numpy dtype {array.dtype}"


def _to_bytes_array(array: np.ndarray) -> np.ndarray:
    out = np.empty(array.shape, dtype=np.object_)
    flat = out.reshape(-1)
    for index, item in enumerate(array.flat):
        flat[index] = _as_bytes(item)
    return out


def _as_bytes(item: Any) -> bytes:
    if isinstance(item, bytes):
        return bytes(item)
    if isinstance(item, str):
        return item.encode("utf-8")
    if isinstance(item, (bytearray, memoryview)):
        return bytes(item)
    return str(item).encode("utf-8")


def _to_bf16_bits(array: np.ndarray) -> np.ndarray | None:
    """BF16 as Sluice holds it: uint16 bit patterns (from uint16, ml_dtypes bfloat16 or floats)."""
    if array.dtype == np.uint16:
        return array
    if array.dtype.name == "bfloat16":
        return array.view(np.uint16)
    if array.dtype.kind != "f":
        return None
    as_float = np.ascontiguousarray(array, dtype=np.float32)
    bits = as_float.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.where(np.isnan(as_float), np.uint16(0x7FC0), rounded.astype(np.uint16))
