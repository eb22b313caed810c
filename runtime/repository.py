"""The model repository: which models and versions are loaded, loading and unloading them.

Called by the dataplane. Reading configs and creating sessions is blocking work, so it runs on a
worker thread; the registry itself is only touched on the event loop. A failed (re)load leaves the
versions that were serving in place and records the reason for the repository index.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Collection, Coroutine, Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from sluice.runtime import classification, cudart, ensemble, names, sequence, warmup
from sluice.runtime import config as model_config
from sluice.runtime.backends.base import (
    BackendServices,
    LoadContext,
    ModelBackend,
    ModelInstance,
    group_instance_names,
)
from sluice.runtime.batching import (
    BATCH_POLICIES,
    BatchPolicy,
    Clock,
    OverloadPolicy,
    QueuePolicy,
    Scheduler,
    SchedulerConfig,
)
from sluice.runtime.cache import CachePart, ModelCache, ResponseCache
from sluice.runtime.errors import (
    ConfigError,
    InvalidArgument,
    NotFound,
    SluiceError,
    Unavailable,
    Unsupported,
    UnsupportedLoad,
    unknown_model,
)
from sluice.runtime.settings import SchedulingDefaults
from sluice.runtime.signature import Signature, signature_of
from sluice.runtime.snapshot import FileStamp
from sluice.runtime.stats import ModelStats

log = logging.getLogger("sluice.runtime.repository")


def version_number(version: str) -> int:
    """A request's model version string as a number: decimal digits only (no sign, spaces or ``_``, which
    ``int`` would take). Anything else is INVALID_ARGUMENT with Triton's words (clients match on them),
    before the model is looked up; a number that names no version is the caller's NOT_FOUND."""
    if version.isascii() and version.isdigit():
        return int(version)
    shown = version if len(version) <= 64 else version[:64] + "..."
    raise InvalidArgument(
        f"failed to get model version from specified version string '{shown}', "
        "version should be an integral value > 0"
    )


READY, UNAVAILABLE, LOADING, UNLOADING = "READY", "UNAVAILABLE", "LOADING", "UNLOADING"


@dataclasses.dataclass
class ModelVersion:
    name: str
    version: int
    config: mc.ModelConfig
    signature: Signature
    backend: ModelBackend
    scheduler: Scheduler | ensemble.EnsembleScheduler | sequence.SequenceScheduler
    stats: ModelStats
    cache: ModelCache | None = None
    labels: classification.Labels = dataclasses.field(default_factory=dict)  # output -> label_filename lines
    gpus: tuple[int, ...] = ()
    """CUDA device of each KIND_GPU instance, as placed at load (the GPU telemetry's instances per GPU)."""

    @property
    def platform(self) -> str:
        return platform_of(self.config)


@dataclasses.dataclass
class IndexEntry:
    name: str
    version: str
    state: str
    reason: str


@dataclasses.dataclass
class _Model:
    versions: dict[int, ModelVersion] = dataclasses.field(default_factory=dict)
    state: str = UNAVAILABLE
    reason: str = ""
    history: dict[int, str] = dataclasses.field(default_factory=dict)  # version -> state, for the index
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    plan: ensemble.Plan | None = None  # set for an ensemble
    # An ensemble's loaded versions while a step model is not ready (Triton: it follows its steps).
    waiting: dict[int, ModelVersion] = dataclasses.field(default_factory=dict)
    # Why the last load failed while nothing serves: requests get 503 with it, not 404 "unknown".
    load_error: str = ""
    # Why the last (re)load failed while older versions go on serving; "" once a load succeeds.
    reload_error: str = ""
    # What each serving version was made from (version_stamp): a reload keeps those unchanged.
    stamps: dict[int, Hashable] = dataclasses.field(default_factory=dict)
    # The temporary repository of a load with file overrides its versions were made from (removed when
    # they are closed); None: the repository's own directory.
    override_root: Path | None = None
    # Loads and unloads holding or waiting for ``lock``: an entry nobody uses that holds nothing is dropped.
    users: int = 0

    def unknown(self) -> bool:
        """Nothing serves, waits, or was ever found for this name: a name no load found (no index row)."""
        return not (self.versions or self.waiting or self.history or self.reason or self.load_error
                    or self.state == LOADING)


_PLATFORM_BY_BACKEND = {"onnxruntime": "onnxruntime_onnx", "pytorch": "pytorch_libtorch", "tensorrt": "tensorrt_plan"}


def directory_stamps(directory: Path) -> frozenset[FileStamp]:
    """Every file under ``directory`` (a version directory; a symbolic link to one is followed), with
    the directory's inode: what tells it changed (repository polls, and reloads keeping unchanged versions)."""
    stamps: set[FileStamp] = set()
    try:
        stamps.add((".", 0, os.stat(directory).st_ino))  # a version directory swapped for another
    except OSError:
        return frozenset()
    for parent, _, files in os.walk(directory):
        for file in files:
            path = os.path.join(parent, file)
            try:
                st = os.stat(path)
            except OSError:  # removed while scanning: the next poll sees the rest
                continue
            stamps.add((os.path.relpath(path, directory), st.st_size, st.st_mtime_ns))
    return frozenset(stamps)


def entry_stamps(entry: Path) -> frozenset[FileStamp]:
    """The stamps of one entry of a model directory beside its versions and config: a file's own, or
    every file under a directory (``tokenizer/vocab.txt``); empty when it vanished meanwhile."""
    if entry.is_dir():
        return frozenset(
            (f"{entry.name}/{rel}", size, mtime) for rel, size, mtime in directory_stamps(entry) if rel != "."
        )
    try:
        st = entry.stat()
    except OSError:
        return frozenset()
    return frozenset({(entry.name, st.st_size, st.st_mtime_ns)})


def version_stamp(config: mc.ModelConfig, model_dir: Path, version: int) -> Hashable:
    """What a loaded version was made from: the completed config, the model directory's files beside
    the versions and config (labels, tokenizers) and the version's own files. Equal stamps: a reload
    keeps the serving version as it is (Triton reloads changed versions only)."""
    outside: set[FileStamp] = set()
    for entry in sorted(model_dir.iterdir()):
        if entry.name.startswith(".") or entry.name in model_config.CONFIG_FILE_NAMES:
            continue
        if names.version_number(entry.name) is not None and entry.is_dir():
            continue
        outside |= entry_stamps(entry)
    version_dir = model_dir / str(version)
    return (
        config.SerializeToString(deterministic=True),
        frozenset(outside),
        directory_stamps(version_dir),
        _identities(version_dir),
    )


def _identities(directory: Path) -> frozenset[tuple[str, str]]:
    """Each file's inode and each symbolic link's target under ``directory``, linked directories followed
    (once each): a file replaced keeping its size and mtime (``tar -x``, ``rsync -a``, ``cp -p`` into a
    new file) or a link pointed elsewhere is a change that sizes and mtimes alone miss."""
    found: set[tuple[str, str]] = set()
    seen: set[tuple[int, int]] = set()
    for parent, dirs, files in os.walk(directory, followlinks=True):
        try:
            st = os.stat(parent)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in seen:  # a link back up: walked already
            dirs.clear()
            continue
        seen.add((st.st_dev, st.st_ino))
        for entry in (*dirs, *files):
            path = os.path.join(parent, entry)
            rel = os.path.relpath(path, directory)
            try:
                if os.path.islink(path):
                    found.add((rel, "-> " + os.readlink(path)))
                if entry in files:
                    found.add((rel, str(os.stat(path).st_ino)))
            except OSError:  # removed meanwhile
                continue
    return frozenset(found)


def _load_error(exc: Exception, reason: str) -> SluiceError:
    """What a failed load answers: its own error (a feature a backend does not support is a failed load, 400
    over HTTP like any other, not the 501 a request for it gets), or 503 with the recorded reason for
    anything else."""
    if isinstance(exc, Unsupported) and not isinstance(exc, UnsupportedLoad):
        return UnsupportedLoad(exc.message)
    return exc if isinstance(exc, SluiceError) else Unavailable(reason)


def override_files(files: Mapping[str, bytes], config: str | None) -> dict[str, bytes]:
    """The files of a load request's ``file:<version>/<name>`` parameters, checked (pure): Triton's
    rule that they come with a ``config``, and paths that stay inside a version directory of the model.
    Returns relative path -> content."""
    if files and config is None:
        raise InvalidArgument(
            "load parameters 'file:...' need the parameter 'config' too (the model's config as JSON): the "
            "files replace the model's directory, config included, as in Triton"
        )
    checked: dict[str, bytes] = {}
    for path, content in files.items():
        parts = path.split("/")
        problem = None
        if not path or path.startswith("/") or any(part in ("", ".", "..") for part in parts):
            problem = "a relative path inside the model's directory, without '.', '..' or empty parts"
        elif len(parts) < 2 or names.version_number(parts[0]) is None:
            problem = "<version>/<file>, the version a number (1/model.onnx)"
        if problem is not None:
            raise InvalidArgument(f"load parameter 'file:{path}': allowed: {problem}")
        checked[path] = content
    return checked


def _write_override(files: Mapping[str, bytes], name: str) -> Path:
    """A temporary repository holding ``name`` made of ``files`` alone (blocking); its root. Files that
    cannot be written (a name too long, a path both a file and a directory) are the request's fault: 400,
    and nothing is left behind."""
    root = Path(tempfile.mkdtemp(prefix="sluice-load-"))
    try:
        model_dir = root / name
        model_dir.mkdir()
        for path, content in files.items():
            target = model_dir / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
    except (OSError, ValueError) as exc:
        shutil.rmtree(root, ignore_errors=True)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise InvalidArgument(f"load parameter 'file:{path}' cannot be written as a file: {reason}") from None
    return root


def platform_of(config: mc.ModelConfig) -> str:
    """What model metadata reports as ``platform`` (Triton reports "python" for Python models)."""
    if config.platform:
        return config.platform
    return _PLATFORM_BY_BACKEND.get(config.backend, config.backend)


def scheduler_config(config: mc.ModelConfig, defaults: SchedulingDefaults, label: str) -> SchedulerConfig:
    """The scheduler settings a model config asks for, with Sluice's server defaults filled in (pure)."""
    dyn = config.dynamic_batching
    dynamic = config.HasField("dynamic_batching")
    mode = defaults.batch_policy
    if "batch_policy" in config.parameters:
        mode = config.parameters["batch_policy"].string_value
        if mode not in BATCH_POLICIES:
            raise ConfigError(
                f"must be one of {', '.join(BATCH_POLICIES)}, got {mode!r}", field="parameters[batch_policy]"
            )
    batch = BatchPolicy(
        max_batch_size=config.max_batch_size,
        preferred_batch_sizes=tuple(dyn.preferred_batch_size),
        max_queue_delay_ns=dyn.max_queue_delay_microseconds * 1000,
        mode=mode,
        dynamic=dynamic,
    )

    def queue(policy: mc.ModelQueuePolicy | None) -> QueuePolicy:
        if policy is None:
            return QueuePolicy(timeout_ns=defaults.queue_timeout_us * 1000, max_queue_size=defaults.max_queue_size)
        timeout_us = policy.default_timeout_microseconds or defaults.queue_timeout_us
        return QueuePolicy(
            timeout_ns=timeout_us * 1000,
            allow_timeout_override=policy.allow_timeout_override or not policy.default_timeout_microseconds,
            delay_on_timeout=policy.timeout_action == mc.ModelQueuePolicy.DELAY,
            max_queue_size=policy.max_queue_size or defaults.max_queue_size,
        )

    # A model that spells out Triton's queue semantics (a queue policy or priority levels) gets
    # exactly those unless it asks for overload control by name.
    explicit_queueing = (
        dyn.HasField("default_queue_policy") or bool(dyn.priority_queue_policy) or dyn.priority_levels > 0
    )
    enabled = defaults.overload_control and not explicit_queueing
    if "overload_control" in config.parameters:
        raw = config.parameters["overload_control"].string_value.lower()
        if raw not in ("on", "off", "true", "false"):
            raise ConfigError(f"must be 'on' or 'off', got {raw!r}", field="parameters[overload_control]")
        enabled = raw in ("on", "true")
    overload = (
        OverloadPolicy(
            interval_ns=int(defaults.overload_interval_ms * 1e6), target_ns=int(defaults.overload_target_ms * 1e6)
        )
        if enabled
        else None
    )
    default_queue = queue(dyn.default_queue_policy if dyn.HasField("default_queue_policy") else None)
    by_priority = {int(level): queue(policy) for level, policy in dyn.priority_queue_policy.items()}
    return SchedulerConfig(
        batch=batch,
        priority_levels=int(dyn.priority_levels),
        default_priority=int(dyn.default_priority_level),
        default_queue=default_queue,
        queue_by_priority=by_priority,
        model_label=label,
        overload=overload,
        worker_spin_us=defaults.worker_spin_us,
    )


def response_cache(config: mc.ModelConfig, defaults: SchedulingDefaults) -> ResponseCache | None:
    if not config.response_cache.enable:
        return None
    size = defaults.response_cache_bytes
    if "response_cache_bytes" in config.parameters:
        raw = config.parameters["response_cache_bytes"].string_value
        if not (raw.isascii() and raw.isdigit()) or int(raw) <= 0:
            raise ConfigError(f"must be a positive integer, got {raw!r}", field="parameters[response_cache_bytes]")
        size = int(raw)
    return ResponseCache(size)


def _backend_loader(backend: str) -> Callable[[mc.ModelConfig, LoadContext], ModelBackend]:
    if backend == "onnxruntime":
        from sluice.runtime.backends import onnxrt

        return onnxrt.load
    if backend == "python":
        from sluice.runtime.backends import python

        return python.load
    if backend == "tensorrt":
        from sluice.runtime.backends import tensorrt

        return tensorrt.load
    if backend == "pytorch":
        from sluice.runtime.backends import pytorch

        return pytorch.load
    raise ConfigError(
        f"backend '{backend}' is not available in this Sluice build; available: onnxruntime, python, pytorch, tensorrt",
        field="backend",
    )


def _available_versions(model_dir: Path) -> list[int]:
    found = ((names.version_number(p.name), p) for p in model_dir.iterdir())
    return sorted(version for version, p in found if version is not None and p.is_dir())


@dataclasses.dataclass
class _Prepared:
    config: mc.ModelConfig
    versions: list[tuple[int, ModelBackend | ensemble.Ensemble, list[ModelInstance]]]
    warnings: list[str]
    scheduling: SchedulerConfig | None  # None for an ensemble
    cache: Callable[[], ResponseCache | None]
    labels: classification.Labels = dataclasses.field(default_factory=dict)
    sequencing: sequence.SequenceConfig | None = None  # set for a model with sequence_batching
    gpus: tuple[int, ...] = ()  # CUDA device of each KIND_GPU instance, in instance order
    stamps: dict[int, Hashable] = dataclasses.field(default_factory=dict)  # every chosen version's
    kept: list[int] = dataclasses.field(default_factory=list)  # serving versions left as they are

    def close(self, started: Collection[int] = ()) -> None:
        """Release what ``prepare`` opened (instances, then backends), except the instances of the
        ``started`` versions, which their schedulers closed; never raises. Blocking: runs on a
        worker thread (a Python model's ``finalize`` runs here)."""
        for version, backend, instances in self.versions:
            if version not in started:
                for instance in instances:
                    _quietly(instance.close)
            _quietly(backend.close)


def _quietly(close: Callable[[], object]) -> None:
    try:
        close()
    except Exception:  # one failing finalize must not stop the others
        log.exception("closing a model instance failed")


def instance_plan(config: mc.ModelConfig, gpu_count: int, auto_gpu: bool = True) -> list[tuple[int, int]]:
    """(kind, device_id) for every instance the instance groups ask for, with Triton's semantics (pure).

    No instance_group means one KIND_AUTO group of one instance. KIND_AUTO is KIND_GPU when
    ``gpu_count`` > 0 and the backend can run this model on a GPU (``auto_gpu``: false for an
    onnxruntime build without the CUDA execution provider, or an AOTInductor package compiled for the
    CPU), or when the group lists GPUs; else KIND_CPU. KIND_GPU places ``count`` instances on each listed GPU, or on
    each of the ``gpu_count`` visible GPUs when none is listed; a listed GPU that is not visible is a
    ConfigError. KIND_GPU without GPUs listed on a machine with none gives ``count`` instances on
    device 0, so the backend says what it lacks (a CUDA build, a visible GPU). KIND_CPU and
    KIND_MODEL: ``count`` instances, device 0.
    """
    return [(kind, device) for kind, device, _ in _planned(config, gpu_count, auto_gpu)]


def instance_names(config: mc.ModelConfig, gpu_count: int, auto_gpu: bool = True) -> list[str]:
    """Triton's name of each instance of :func:`instance_plan` (pure): the group's name (``<model>_<group
    index>`` when unnamed) when the group has one instance per device, else ``<group name>_<c>``, ``c``
    counting within the group's ``count``; instances of one group on several GPUs share their names, as
    Triton's do (Triton loops ``count`` outside the devices: the names are the same, the order differs)."""
    return [name for _, _, name in _planned(config, gpu_count, auto_gpu)]


def _planned(config: mc.ModelConfig, gpu_count: int, auto_gpu: bool) -> list[tuple[int, int, str]]:
    K = mc.ModelInstanceGroup
    groups = list(config.instance_group) or [K(count=1, kind=K.KIND_AUTO)]
    plan: list[tuple[int, int, str]] = []
    for index, group in enumerate(groups):
        names = group_instance_names(group, config.name, index)
        kind = group.kind
        if kind == K.KIND_AUTO:
            kind = K.KIND_GPU if (gpu_count > 0 and auto_gpu) or group.gpus else K.KIND_CPU
        if kind != K.KIND_GPU:
            plan.extend((kind, 0, name) for name in names)
            continue
        for gpu in group.gpus:
            if gpu >= gpu_count:
                visible = f"{gpu_count} GPU{'s' if gpu_count != 1 else ''} visible" + (
                    f" (ids 0 to {gpu_count - 1})" if gpu_count else ""
                )
                raise ConfigError(
                    f"GPU {gpu} is listed but this machine has {visible}; allowed: ids of visible GPUs",
                    field=f"instance_group[{index}].gpus",
                )
        devices = list(group.gpus) or list(range(gpu_count)) or [0]
        plan.extend((kind, device, name) for device in devices for name in names)
    return plan


_AUTO_CHECKED = ("onnxruntime", "pytorch")
"""Backends that can be unable to use a visible GPU (a CPU-only build, a CPU-compiled package)."""


def _has_auto_group(config: mc.ModelConfig) -> bool:
    K = mc.ModelInstanceGroup
    return not config.instance_group or any(g.kind == K.KIND_AUTO and not g.gpus for g in config.instance_group)


def _why_auto_is_not_gpu(backend: str, config: mc.ModelConfig, versions: list[LoadContext]) -> str | None:
    """Why KIND_AUTO cannot place this model (every version it serves: one plan places them all) on
    a visible GPU; None when it can."""
    if backend == "onnxruntime":
        from sluice.runtime.backends import onnxrt

        return onnxrt.why_no_gpu()
    from sluice.runtime.backends import pytorch

    return next((why for ctx in versions if (why := pytorch.why_no_gpu(config, ctx)) is not None), None)


@functools.cache
def _cudart_gpu_count() -> int:
    try:
        return cudart.Loader().get().device_count()
    except (cudart.NoCuda, cudart.CudaError, OSError):
        return 0


def visible_gpu_count(backend: str) -> int:
    """GPUs this process sees: torch's count for PyTorch models (torch is being imported anyway),
    else the CUDA runtime's (ctypes, no framework import), 0 without either."""
    if backend == "pytorch":
        from sluice.runtime.backends import pytorch

        count = pytorch.cuda_device_count()
        if count is not None:
            return count
    return _cudart_gpu_count()


def prepare(
    root: Path,
    name: str,
    override: str | None,
    defaults: SchedulingDefaults,
    services: BackendServices | None = None,
    tried: list[int] | None = None,
    serving: Mapping[int, Hashable] | None = None,
    ensembles: Mapping[str, Sequence[str]] | None = None,
) -> _Prepared:
    """Blocking part of a load: parse, complete, validate, open sessions. Runs on a worker thread.
    ``serving``: the stamps of the versions serving now; a chosen version with the same stamp is
    kept (listed in ``kept``, nothing opened for it). ``ensembles``: the local step models of the
    ensembles loaded now (their plans), which an ensemble's steps must not lead back to it through.

    Everything that can be refused is checked before the first backend or instance is created, so
    a refused load opens nothing; what it opened is closed again if a later step fails. The versions
    the policy chose are appended to ``tried`` as soon as they are known (the index names them when
    the load fails).
    """
    model_dir = names.model_directory(root, name)
    if model_dir is None:
        raise InvalidArgument(
            f"model directory '{name}' is a symbolic link that leads outside the model repository; "
            "allowed: model directories inside the repository"
        )
    if not model_dir.is_dir():
        raise NotFound(f"failed to poll from model repository: no directory '{name}' in the model repository")
    loaded = model_config.load_model_config(model_dir, override=override)
    try:
        return _prepare_loaded(root, name, loaded, model_dir, defaults, services, tried, serving or {}, ensembles or {})
    except ConfigError as exc:  # a backend's or a later check's complaint: placed in the config's text
        placed = loaded.placed(exc)
        if placed is exc:
            raise
        raise placed from exc


def _refuse_ensemble_cycle(
    root: Path, name: str, config: mc.ModelConfig, ensembles: Mapping[str, Sequence[str]]
) -> None:
    """Raises ConfigError when ensemble ``name``'s steps lead back to it through other ensembles,
    loaded (their plans) or on disk (their config files): such requests would recurse without end.
    Triton refuses this load too. Blocking (reads the config files of steps not loaded)."""
    steps = model_config.local_step_models(config)

    def steps_of(model: str) -> Sequence[str]:
        if model == name:
            return steps
        if model in ensembles:
            return ensembles[model]
        model_dir = names.model_directory(root, model)
        return model_config.ensemble_steps_on_disk(model_dir) if model_dir is not None else []

    cycle = model_config.ensemble_cycle(name, steps_of)
    if cycle:
        index = next(i for i, step in enumerate(config.ensemble_scheduling.step) if step.model_name == cycle[1])
        raise ConfigError(
            f"circular dependency between ensembles: {' -> '.join(cycle)}; allowed: ensembles whose step "
            "models (and theirs) never lead back to the ensemble",
            field=f"ensemble_scheduling.step[{index}].model_name",
        )


def _prepare_loaded(
    root: Path,
    name: str,
    loaded: model_config.LoadedConfig,
    model_dir: Path,
    defaults: SchedulingDefaults,
    services: BackendServices | None,
    tried: list[int] | None,
    serving: Mapping[int, Hashable],
    ensembles: Mapping[str, Sequence[str]],
) -> _Prepared:
    config = loaded.config
    warnings = list(loaded.warnings)
    available = _available_versions(model_dir)
    backend = model_config.backend_of(config)
    if backend == model_config.ENSEMBLE:
        _refuse_ensemble_cycle(root, name, config, ensembles)
    if backend == model_config.ENSEMBLE and not available:
        available = [1]  # Triton wants an empty 1/ for an ensemble; Sluice does not
    chosen = model_config.select_versions(config, available, source=loaded.source)
    missing = model_config.missing_versions(config, available) if available else []
    if missing:
        warnings.append(
            f"{loaded.source}: version_policy.specific.versions names {missing}, which have no version directory; "
            f"serving {chosen} (as Triton does)"
        )
    if not chosen:
        raise ConfigError(
            f"no version directories to serve (found {available or 'none'}); "
            "versions are numbered directories like 1/, 2/",
            file=name,
            field="version_policy",
        )
    if tried is not None:
        tried.extend(chosen)
    last = LoadContext(name, chosen[-1], model_dir, model_dir / str(chosen[-1]), root, services)
    if backend == "onnxruntime":
        from sluice.runtime.backends import onnxrt

        inputs, outputs = onnxrt.probe(onnxrt.model_path(config, last))
        warnings += model_config.complete_io(config, inputs, outputs, source=loaded.source)
    if backend == "tensorrt":  # the engine's IO and profiles complete and check the config
        from sluice.runtime.backends import tensorrt

        try:
            warnings += tensorrt.complete_config(config, tensorrt.probe(tensorrt.model_path(config, last)))
        except ConfigError as exc:
            raise ConfigError(exc.detail, file=exc.file or loaded.source, field=exc.field) from None
    if backend == "python":  # TritonPythonModel.auto_complete_config, before validation
        from sluice.runtime.backends import python

        python.auto_complete(config, last)
    if backend == "pytorch":  # a torch.export program completes the config from its signature
        from sluice.runtime.backends import pytorch

        probed = pytorch.probe(config, last)
        if probed is not None:
            warnings += model_config.complete_io(config, *probed, source=loaded.source)
    warnings += model_config.validate(config, source=loaded.source)
    if backend == "pytorch":
        warnings += pytorch.check_config(config, last, source=loaded.source)
    labels = classification.read_labels(config, model_dir)  # raises for a missing label file
    warnings = list(dict.fromkeys(warnings))  # load_model_config validates too; report each once
    try:
        response_cache(config, defaults)  # raises for a bad size parameter
        scheduling = scheduler_config(config, defaults, name) if backend != model_config.ENSEMBLE else None
        sequencing = sequence.sequence_config(config, model_dir) if config.HasField("sequence_batching") else None
    except ConfigError as exc:
        raise ConfigError(exc.detail, file=loaded.source, field=exc.field) from None

    def cache() -> ResponseCache | None:
        return response_cache(config, defaults)

    stamps = {version: version_stamp(config, model_dir, version) for version in chosen}
    kept = [version for version in chosen if version in serving and serving[version] == stamps[version]]
    if backend == model_config.ENSEMBLE:
        if config.model_warmup:
            warnings.append("model_warmup: an ensemble has no instances to warm up; ignored (warm its step models)")
        plans: list[tuple[int, ModelBackend | ensemble.Ensemble, list[ModelInstance]]]
        plans = [(version, ensemble.Ensemble(config), []) for version in chosen if version not in kept]
        return _Prepared(config, plans, warnings, None, cache, labels, stamps=stamps, kept=kept)
    loader = _backend_loader(backend)
    gpu_count = visible_gpu_count(backend)
    why_not_gpu = None
    if gpu_count and backend in _AUTO_CHECKED and _has_auto_group(config):  # only KIND_AUTO is decided here
        versions = [LoadContext(name, v, model_dir, model_dir / str(v), root, services) for v in chosen]
        why_not_gpu = _why_auto_is_not_gpu(backend, config, versions)
    if why_not_gpu is not None:
        warnings.append(
            f"instance_group kind KIND_AUTO runs on the CPU although {gpu_count} GPU(s) are visible: {why_not_gpu}"
        )
    try:
        plan = instance_plan(config, gpu_count, auto_gpu=why_not_gpu is None)
        labels_of_instances = tuple(instance_names(config, gpu_count, auto_gpu=why_not_gpu is None))
    except ConfigError as exc:
        raise ConfigError(exc.detail, file=loaded.source, field=exc.field) from None
    if backend == "pytorch":
        from sluice.runtime.backends import torch_plan

        graph_warning = torch_plan.cpu_graph_warning(config, [kind for kind, _ in plan])
        warnings += [graph_warning] if graph_warning else []
        if torch_plan.graphs_requested(config):
            from sluice.runtime.backends import torch_graphs  # pure here: torch is imported on capture

            try:  # the shapes to capture are refused before any instance is made, on any machine
                torch_graphs.graph_plan(config)
            except ConfigError as exc:
                raise ConfigError(exc.detail, file=loaded.source, field=exc.field) from None
    samples = warmup.build(config, model_dir, loaded.source)  # refused before any instance is made
    gpus = tuple(device for kind, device in plan if kind == mc.ModelInstanceGroup.KIND_GPU)
    prepared = _Prepared(config, [], warnings, scheduling, cache, labels, sequencing, gpus, stamps, kept)
    try:
        for version in chosen:
            if version in kept:
                continue
            ctx = LoadContext(
                name, version, model_dir, model_dir / str(version), root, services, instance_names=labels_of_instances
            )
            instance_backend = loader(config, ctx)
            instances: list[ModelInstance] = []
            prepared.versions.append((version, instance_backend, instances))
            sig = signature_of(config, f"{name}:{version}") if samples else None
            for index, (kind, device) in enumerate(plan):
                instance = instance_backend.new_instance(index, kind, device)
                instances.append(instance)
                if sig is not None:  # ready only once every instance ran every sample (Triton's model_warmup)
                    label = labels_of_instances[index]
                    decoupled = config.model_transaction_policy.decoupled
                    warmup.run(instance, label, samples, name, version, sig, decoupled=decoupled)
    except BaseException:
        prepared.close()
        raise
    return prepared


async def unless_cancelled(work: Coroutine[Any, Any, None]) -> None:
    """Run ``work`` to the end even if the awaiting caller is cancelled (its outcome is then
    only logged)."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(_retrieve)
    await asyncio.shield(task)


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # already logged by the load; keeps asyncio from reporting it again


class Repository:
    """Loaded models of one repository directory."""

    def __init__(
        self,
        root: Path,
        scheduling: SchedulingDefaults,
        *,
        grace_s: float = 30.0,
        clock: Clock | None = None,
        services: BackendServices | None = None,
    ) -> None:
        self.root = root
        self.services = services
        """Lent to backends at load (BLS, custom metrics); None in tests that need neither."""
        self._scheduling = scheduling
        self._grace_s = grace_s
        self._clock = clock
        self._models: dict[str, _Model] = {}
        self._dispatch: ensemble.Dispatch | None = None
        # Models the server is expected to serve (strict readiness): those asked for at start,
        # and those loaded since; an unload removes one.
        self._expected: set[str] = set()
        shared = scheduling.response_cache_shared_bytes
        self._shared_cache = ResponseCache(shared) if shared > 0 else None
        self._cache_parts = itertools.count()
        self.implicit: set[str] = set()
        """Models loaded only because an ensemble being loaded needs them (Triton's composing models
        "loaded along with" it): ``unload_dependents`` unloads these, never a model a user loaded."""
        self.load_failures: dict[str, int] = {}
        """Failed loads and reloads per model since start (``sluice_model_load_failures_total``)."""

    def route_steps(self, dispatch: ensemble.Dispatch) -> None:
        """Where ensembles send their steps' requests: the data plane's ``infer_nowait``."""
        self._dispatch = dispatch

    def names_on_disk(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and names.name_problem(p.name) is None)

    def expect(self, names_: list[str]) -> None:
        """Count ``names_`` as models the server must serve to be ready (called at start)."""
        self._expected.update(names_)

    def expected_ready(self) -> bool:
        """Every expected model has a ready version."""
        return all(self._models.get(name) is not None and self._models[name].versions for name in self._expected)

    def failed(self) -> dict[str, str]:
        """Models with nothing serving because their last load failed: name -> why."""
        return {name: model.load_error for name, model in self._models.items() if model.load_error}

    def serving_stale(self) -> set[str]:
        """Models whose last reload failed, so that older versions (and their files) go on serving."""
        return {name for name, model in self._models.items() if model.reload_error and model.versions}

    def load_states(self) -> dict[str, str]:
        """Every model this repository knows -> ``READY``, ``LOADING``, ``UNLOADING`` (draining),
        ``UNAVAILABLE`` or ``STALE`` (serving older versions after a failed reload)."""
        return {
            name: "STALE" if model.reload_error and model.versions else model.state
            for name, model in self._models.items()
            if model.versions or model.history or model.reason or model.state == LOADING
        }

    def _entry(self, name: str) -> _Model:
        model = self._models.get(name)
        if model is None:
            model = self._models[name] = _Model()
        return model

    @contextlib.asynccontextmanager
    async def _using(self, name: str, model: _Model) -> AsyncIterator[None]:
        """Hold ``model``'s lock; afterwards an entry that holds nothing and that no other load or unload
        waits for is dropped, so that loads of names the repository never held (a client trying
        random names) leave nothing behind."""
        model.users += 1
        try:
            async with model.lock:
                yield
        finally:
            model.users -= 1
            if model.users == 0 and model.unknown() and self._models.get(name) is model:
                del self._models[name]

    def _checked(self, name: str, action: str) -> None:
        problem = names.name_problem(name)
        if problem is not None:
            raise InvalidArgument(
                f"failed to {action} '{names.shown(name)}': invalid model name: {problem}; allowed: {names.ALLOWED}"
            )

    def _client_message(self, name: str, message: str, override_root: Path | None = None) -> str:
        """A load error as clients read it: Triton's "failed to load '<m>'" wording, and no path of
        the server's file system (paths are shown relative to the repository)."""
        roots = {str(self.root.resolve())} | ({str(self.root)} if self.root.is_absolute() else set())
        if override_root is not None:
            roots |= {str(override_root), str(override_root.resolve())}
        for root in sorted(roots, key=len, reverse=True):  # absolute paths only: a relative one is a word
            message = message.replace(root + "/", "").replace(root, "the model repository")
        if not message.startswith(f"failed to load '{name}'"):
            message = f"failed to load '{name}': {message}"
        return message

    async def load(self, name: str, override: str | None = None, files: Mapping[str, bytes] | None = None) -> None:
        """Load (or reload) ``name``. It goes on when the caller is cancelled (a client that timed
        out or hung up), as in Triton: cut short, it left the model LOADING and its new instances
        initialized but never served or finalized. ``files`` (Triton's ``file:<version>/<name>`` load
        parameters, with ``override`` required): the model is made of those files alone, in a
        temporary directory kept while its versions serve."""
        self._checked(name, "load")
        checked = override_files(files or {}, override)
        await unless_cancelled(self._load(name, override, checked))

    async def _load(self, name: str, override: str | None, files: Mapping[str, bytes] | None = None) -> None:
        model = self._entry(name)
        loop = asyncio.get_running_loop()
        old: dict[int, ModelVersion] = {}
        tried: list[int] = []
        async with self._using(name, model):
            model.state = LOADING
            serving = {version: stamp for version, stamp in model.stamps.items() if version in model.versions}
            root = self.root
            try:
                if files:
                    root = await loop.run_in_executor(None, _write_override, files, name)
                ensembles = {
                    other: self.composing_models(other)
                    for other, entry in self._models.items()
                    if other != name and entry.plan is not None and (entry.versions or entry.waiting)
                }
                prepared = await loop.run_in_executor(
                    None, prepare, root, name, override, self._scheduling, self.services, tried, serving, ensembles
                )
            except Exception as exc:
                self._load_failed(name, model, exc, tried, None if root is self.root else root)
                if root is not self.root:
                    await loop.run_in_executor(None, functools.partial(shutil.rmtree, root, ignore_errors=True))
                if (error := _load_error(exc, model.reason)) is exc:
                    raise
                raise error from exc
            new_versions: dict[int, ModelVersion] = {}
            try:
                self._start(name, prepared, new_versions)
            except Exception as exc:
                # Started schedulers close their own instances; the rest is closed here.
                await asyncio.gather(*(v.scheduler.aclose(0.0) for v in new_versions.values()))
                await loop.run_in_executor(None, prepared.close, set(new_versions))
                self._load_failed(name, model, exc, tried, None if root is self.root else root)
                if root is not self.root:
                    await loop.run_in_executor(None, functools.partial(shutil.rmtree, root, ignore_errors=True))
                if (error := _load_error(exc, model.reason)) is exc:
                    raise
                raise error from exc
            if new_versions or not prepared.kept:
                for warning in prepared.warnings:
                    log.warning("model %s: %s", name, warning)
            current = {**model.waiting, **model.versions}  # an unload of a step may have moved them to waiting
            if any(version not in current for version in prepared.kept):  # unloaded meanwhile: load them anew
                await asyncio.gather(*(v.scheduler.aclose(0.0) for v in new_versions.values()))
                await loop.run_in_executor(None, prepared.close, set(new_versions))
                changed = Unavailable(f"model '{name}' was unloaded while it loaded; load it again")
                self._load_failed(name, model, changed, tried)
                raise changed
            kept = {version: current[version] for version in prepared.kept}
            serving_now = dict(sorted({**kept, **new_versions}.items()))
            old = {v: mv for v, mv in {**model.waiting, **model.versions}.items() if kept.get(v) is not mv}
            model.versions, model.waiting = serving_now, {}
            model.stamps = {version: prepared.stamps[version] for version in serving_now}
            made_from = None if root is self.root else root
            retired_root = model.override_root if model.override_root != made_from else None
            model.override_root = made_from
            first = next(iter(serving_now.values()), None)
            model.plan = first.backend.plan if first and isinstance(first.backend, ensemble.Ensemble) else None
            for version in serving_now:
                model.history[version] = READY
            for version in old:
                if version not in serving_now:
                    model.history[version] = UNAVAILABLE
            model.state = READY
            model.reason = model.load_error = model.reload_error = ""
            self._expected.add(name)
            if new_versions or old:
                unchanged = f" ({sorted(kept)} unchanged)" if kept else ""
                log.info("model %s ready, versions %s%s", name, sorted(serving_now), unchanged)
            else:
                log.info("model %s unchanged, versions %s", name, sorted(serving_now))
            self._follow_steps()
        if old:
            await self._close_versions(old.values())
        if retired_root is not None:  # the versions made from an earlier load's files are closed
            await loop.run_in_executor(None, functools.partial(shutil.rmtree, retired_root, ignore_errors=True))

    def _load_failed(
        self, name: str, model: _Model, exc: Exception, tried: Collection[int] = (), override_root: Path | None = None
    ) -> None:
        """Record a failed load: the versions that were serving go on serving; one log line, a count
        for the metrics, and the reason in the index (on the versions it tried and, while older
        versions serve, on theirs)."""
        if isinstance(exc, SluiceError):
            exc.message = self._client_message(name, exc.message, override_root)
            exc.args = (exc.message,)
            message = exc.message
            log.error("%s", message)
        else:  # a bug or an unexpected OSError: keep the traceback in the log
            message = self._client_message(name, f"{type(exc).__name__}: {exc}", override_root)
            log.error("%s", message, exc_info=exc)
        for version in tried:
            if version not in model.versions:
                model.history[version] = UNAVAILABLE
        if model.versions:
            model.state = READY
            model.reason = model.reload_error = f"reload failed, previous versions still serving: {message}"
        elif isinstance(exc, NotFound) and not model.history and not model.waiting:
            # not in the repository and never served: unknown (404), and no index row (see index)
            model.state, model.reason, model.load_error = UNAVAILABLE, "", ""
        else:
            model.state = UNAVAILABLE
            model.reason = model.load_error = message
        if model.reason:  # not for a name the repository does not hold: clients must not mint label values
            self.load_failures[name] = self.load_failures.get(name, 0) + 1

    def _start(self, name: str, prepared: _Prepared, new_versions: dict[int, ModelVersion]) -> None:
        """Start a scheduler for each prepared version, into ``new_versions``; reads no file."""
        for version, backend, instances in prepared.versions:
            label = f"{name}:{version}"
            stats = ModelStats(name, str(version))
            scheduler: Scheduler | ensemble.EnsembleScheduler | sequence.SequenceScheduler
            if prepared.sequencing is not None:
                sequencing = dataclasses.replace(prepared.sequencing, model_label=label)
                scheduler = sequence.SequenceScheduler(
                    sequencing, instances, observer=stats, **({} if self._clock is None else {"clock": self._clock})
                )
            elif isinstance(backend, ensemble.Ensemble):
                if self._dispatch is None:
                    raise Unavailable("ensembles need a data plane to run steps")
                scheduler = ensemble.EnsembleScheduler(
                    backend, self._dispatch, observer=stats, step_config=self._step_config
                )
            else:
                assert prepared.scheduling is not None
                config = dataclasses.replace(prepared.scheduling, model_label=label)
                if self._clock is None:
                    scheduler = Scheduler(config, instances, observer=stats)
                else:
                    scheduler = Scheduler(config, instances, observer=stats, clock=self._clock)
            new_versions[version] = ModelVersion(
                name,
                version,
                prepared.config,
                signature_of(prepared.config, label),
                backend,
                scheduler,
                stats,
                self._cache_of(prepared, name, version),
                prepared.labels,
                prepared.gpus,
            )
            scheduler.start()

    def _cache_of(self, prepared: _Prepared, name: str, version: int) -> ModelCache | None:
        """A version's response cache: its own, or with a server cache (``--cache-config``) a part of
        that one (a model that sets its own size keeps its own), under a token of this version object."""
        cache = prepared.cache()
        if cache is None or self._shared_cache is None or "response_cache_bytes" in prepared.config.parameters:
            return cache
        return self._shared_cache.part((name, version, next(self._cache_parts)))

    async def unload(self, name: str, grace_s: float | None = None) -> None:
        """Unload every version of ``name``; in-flight requests get ``grace_s`` (default: the
        repository's grace) to finish. Like a load, it goes on when the caller is cancelled."""
        self._checked(name, "unload")
        await unless_cancelled(self._unload(name, grace_s))

    async def _unload(self, name: str, grace_s: float | None) -> None:
        model = self._models.get(name)
        if model is None:
            self._expected.discard(name)
            return  # Triton answers success for an unknown model
        async with self._using(name, model):
            # Under the lock, as a load marks the model expected under it: calls on one model take
            # effect in the order they came, so an unload sent during a load leaves it unloaded and
            # not awaited by readiness (discarded before the lock, the load marked it again).
            self._expected.discard(name)
            self.implicit.discard(name)
            retired_root, model.override_root = model.override_root, None
            old, model.versions, model.waiting = {**model.waiting, **model.versions}, {}, {}
            # UNLOADING while its requests drain (Triton), UNAVAILABLE "unloaded" once they are done
            model.state = UNLOADING if old else UNAVAILABLE
            # a name no load ever found (its failed load left no reason) stays unknown: no index row
            unknown = not old and not model.history and not model.reason and not model.load_error
            model.reason = "" if old or unknown else "unloaded"
            model.load_error = model.reload_error = ""
            for version in old:
                model.history[version] = UNLOADING
            self._follow_steps()
        await self._close_versions(old.values(), grace_s)
        if retired_root is not None:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, functools.partial(shutil.rmtree, retired_root, ignore_errors=True))
        if model.state == UNLOADING and not model.versions and not model.waiting:  # no load came meanwhile
            model.state, model.reason = UNAVAILABLE, "unloaded"
        for version in old:  # drained: whatever came meanwhile, these versions are gone
            if model.history.get(version) == UNLOADING and version not in model.versions and \
                    version not in model.waiting:
                model.history[version] = UNAVAILABLE

    def _step_config(self, name: str, version: str) -> mc.ModelConfig | None:
        """The config of a ready step model, for the ensemble's reshaping between steps."""
        try:
            return self.get(name, version).config
        except SluiceError:
            return None

    def _step_ready(self, name: str, version: str) -> bool:
        model = self._models.get(name)
        if model is None or not model.versions:
            return False
        return not version or (version.isascii() and version.isdigit() and int(version) in model.versions)

    async def load_steps(self, name: str, _seen: set[str] | None = None, tried: Collection[str] = ()) -> None:
        """Load the composing models of ensemble ``name`` that are not loaded (Triton loads an
        ensemble's steps with it), theirs in turn; each is marked implicit. Raises an error naming the
        step when one cannot be loaded (the ensemble then waits for it, unserved). ``tried``: models a
        caller loaded (or tried to) itself, not loaded again here; a step loading now is not taken over."""
        seen = _seen if _seen is not None else {name}
        for step in self.composing_models(name):
            if step in seen:
                continue
            seen.add(step)
            model = self._models.get(step)
            if step in tried or (model is not None and model.state == LOADING):
                continue  # its own load says how it went; it is not this ensemble's to unload
            if model is None or not (model.versions or model.waiting):
                self.implicit.add(step)
                try:
                    await self.load(step)
                except SluiceError as exc:
                    exc.message = (f"failed to load '{name}': its ensemble step model '{step}' cannot be loaded: "
                                   f"{exc.message}")
                    exc.args = (exc.message,)
                    raise
            await self.load_steps(step, seen, tried)

    def composing_models(self, name: str) -> list[str]:
        """The local step models of ensemble ``name`` (loaded or waiting), in step order; empty for a
        model that is not an ensemble."""
        model = self._models.get(name)
        if model is None or model.plan is None:
            return []
        return list(dict.fromkeys(step.model for step in model.plan.steps if step.remote is None))

    def used_by_ensembles(self, name: str) -> list[str]:
        """The ensembles with versions (serving or waiting for their steps) that have ``name`` as a local step."""
        return [
            other
            for other, model in self._models.items()
            if model.plan is not None and (model.versions or model.waiting) and name in self.composing_models(other)
        ]

    def _follow_steps(self) -> None:
        """Ensembles follow their steps (Triton): one whose local step model has no ready version
        waits, unserved and not ready, and serves again when the step is back, without a reload.
        Called on the event loop after every load and unload; the request path pays nothing."""
        changed = True
        while changed:  # an ensemble can be the step of another
            changed = False
            for name, model in self._models.items():
                if model.plan is None or not (model.versions or model.waiting):
                    continue
                missing = ensemble.missing_local_step(model.plan, self._step_ready)
                if missing is not None and model.versions:
                    model.waiting, model.versions = model.versions, {}
                    model.state = UNAVAILABLE
                    model.reason = (
                        f"step model '{missing.model}'"
                        + (f" version {missing.version}" if missing.version else "")
                        + " is not ready; the ensemble serves again once it is loaded"
                    )
                    log.warning("ensemble %s is not ready: %s", name, model.reason)
                elif missing is None and model.waiting:
                    model.versions, model.waiting = model.waiting, {}
                    model.state, model.reason = READY, ""
                    log.info("ensemble %s is ready again: its step models are ready", name)
                else:
                    continue
                for version in {**model.versions, **model.waiting}:
                    model.history[version] = model.state
                changed = True

    async def _close_versions(self, versions: Iterable[ModelVersion], grace_s: float | None = None) -> None:
        """Drain and close ``versions``: schedulers first (they close their instances off the
        loop), then each backend on a worker thread (a Python model's ``finalize`` may block)."""
        closing = list(versions)
        grace = self._grace_s if grace_s is None else grace_s
        await asyncio.gather(*(v.scheduler.aclose(grace) for v in closing))
        loop = asyncio.get_running_loop()
        for v in closing:
            if isinstance(v.cache, CachePart):
                v.cache.drop()
            await loop.run_in_executor(None, _quietly, v.backend.close)

    async def aclose(self, grace_s: float | None = None) -> None:
        """Unload everything; in-flight requests get ``grace_s`` (default: the repository's grace)."""
        await asyncio.gather(*(self.unload(name, grace_s) for name in list(self._models)), return_exceptions=True)

    # -- lookups (event loop, hot path) ------------------------------------------------------
    def get(self, name: str, version: str = "") -> ModelVersion:
        model = self._models.get(name)
        if model is None or not model.versions:
            if model is not None and model.state == LOADING:
                raise Unavailable(f"model '{name}' is loading; retry when it is ready")
            if model is not None and model.load_error:
                raise Unavailable(f"model '{name}' is not ready: {model.load_error}")
            if model is not None and model.waiting:
                raise Unavailable(f"Request for unknown model: '{name}' has no available versions: {model.reason}")
            raise unknown_model(name, version or None)
        if not version:
            return model.versions[max(model.versions)]
        try:
            return model.versions[version_number(version)]
        except KeyError:
            raise unknown_model(name, version) from None

    def ready_versions(self, name: str) -> list[int]:
        model = self._models.get(name)
        return sorted(model.versions) if model else []

    def all_versions(self) -> list[ModelVersion]:
        return [v for m in self._models.values() for v in m.versions.values()]

    def gpu_instances(self) -> list[tuple[str, int, int]]:
        """(model, version, CUDA device ordinal) of every loaded instance of kind GPU, as placed at
        load (the GPU telemetry's model instances per GPU)."""
        return [(mv.name, mv.version, device) for mv in self.all_versions() for device in mv.gpus]

    def index(self, ready_only: bool = False) -> list[IndexEntry]:
        entries = []
        try:
            on_disk = set(self.names_on_disk())
        except OSError:
            on_disk = set()
        for name in sorted(on_disk | set(self._models)):
            model = self._models.get(name)
            if model is None or not model.history:
                unknown = model is None or (model.state != LOADING and not model.reason)
                if name not in on_disk and unknown:
                    continue  # a failed load of a name the repository does not hold
                if not ready_only:
                    state = model.state if model else ""
                    entries.append(IndexEntry(name, "", state, model.reason if model else ""))
                continue
            if name not in on_disk and not model.versions and not model.waiting and model.state != UNLOADING:
                continue  # its directory is gone and nothing serves: not in the repository any more (Triton)
            for version, state in sorted(model.history.items()):
                if version in model.versions:
                    state = READY
                if ready_only and state != READY:
                    continue
                reason = model.reload_error if state == READY else model.reason
                entries.append(IndexEntry(name, str(version), state, reason))
        return entries

    def state_of(self, name: str) -> tuple[str, str]:
        model = self._models.get(name)
        if model is None:
            return "", ""
        return model.state, model.reason
