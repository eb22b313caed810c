"""GPU and MIG telemetry read from NVML, for the Prometheus metrics.

Who calls it: ``Server`` builds a :class:`GpuTelemetry` from ``GpuMetricsSettings`` (Triton's
``--allow-gpu-metrics`` and ``--metrics-interval-ms``), starts it once the listeners are bound and
closes it on stop; ``Metrics`` asks it for :meth:`GpuTelemetry.families` at each scrape and writes
them beside its own families (metrics.py). Names and their Triton equivalents: docs/metrics.md.

* Readings (:class:`GpuReading`, :class:`MigReading`) are plain data: what NVML answered, ``None``
  where a call failed (``NVMLError_NotSupported``, ``NVMLError_NoPermission`` and the like), so one
  unsupported field drops that sample only.
* Pure functions turn readings into families: :func:`families`, :func:`mig_profile` (the
  ``1g.10gb`` names nvidia-smi and the k8s device plugin use, computed as NVIDIA's go-nvlib does),
  :func:`cuda_devices` (which NVML GPU or MIG device a CUDA ordinal of an ``instance_group``'s
  ``gpus`` is, through ``CUDA_VISIBLE_DEVICES``, with CUDA's one-MIG-device rule),
  :func:`exported_devices` (only the GPUs ``CUDA_VISIBLE_DEVICES`` resolves to are exported, as
  Triton does) and :func:`count_energy` (``nv_energy_consumption`` survives a counter reset).
* The thin NVML layer: :func:`load_nvml` imports ``pynvml`` (the ``nvidia-ml-py`` package of the
  ``gpu`` extra) lazily and initialises it, :func:`read_gpus` calls it (the versioned
  ``nvmlDeviceGetMemoryInfo`` v2 and ``nvmlDeviceGetTemperatureV`` where pynvml and the driver have
  them, else the older calls), and :class:`GpuTelemetry` reads on a background thread every
  interval into a snapshot, so a scrape never waits for NVML.
  No ``nvidia-ml-py``, no driver library or no GPU: no GPU families and one log line at start.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from sluice.runtime.settings import GpuMetricsSettings

log = logging.getLogger("sluice.runtime.gpu_telemetry")

Labels = tuple[tuple[str, str], ...]
GpuInstance = tuple[str, int, int]
"""(model, version, CUDA device ordinal) of one model instance of kind GPU."""

MIG_LABELS = ("gpu_uuid", "mig_uuid", "gpu_instance_id", "compute_instance_id", "profile")
MIB = 1024**2
GIB = 1024**3
MIG_MEMORY_SLICES = 8
"""A MIG-capable GPU's memory is cut in eighths (go-nvlib's ``fracDenominator``)."""


@dataclasses.dataclass(frozen=True)
class MigReading:
    """One MIG device (a GPU instance and compute instance of a GPU in MIG mode). NVML answers
    memory for a MIG device; utilization, power and temperature are the whole GPU's and NVML
    answers NOT_SUPPORTED for a MIG handle, so they are not read."""

    uuid: str
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    profile: str = ""
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class GpuReading:
    """One physical GPU as NVML answered at one reading; ``None``: that call failed."""

    index: int
    uuid: str
    name: str = ""
    mig_enabled: bool | None = None
    """Current MIG mode; None where the GPU has no MIG (NOT_SUPPORTED)."""
    utilization_percent: int | None = None
    memory_utilization_percent: int | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    """Allocated memory (nvmlMemory_v2's ``used``, as nvidia-smi and DCGM show it); with a driver
    or pynvml without v2, v1's ``used``, which also counts the memory the driver reserves."""
    power_mw: int | None = None
    power_limit_mw: int | None = None
    temperature_c: int | None = None
    energy_mj: int | None = None
    """Total energy since the driver was loaded (or the GPU last reset), millijoules."""
    migs: tuple[MigReading, ...] = ()


@dataclasses.dataclass(frozen=True)
class Sample:
    labels: Labels
    value: float


@dataclasses.dataclass(frozen=True)
class Family:
    """One Prometheus family, its name exported exactly as written (Triton's ``nv_energy_consumption``
    is a counter without ``_total``)."""

    name: str
    description: str
    kind: str
    samples: tuple[Sample, ...]


@dataclasses.dataclass(frozen=True)
class Snapshot:
    gpus: tuple[GpuReading, ...]
    energy_mj: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Each GPU's energy counted since the server started, millijoules (``nv_energy_consumption``):
    the readings' increases summed by :func:`count_energy`."""


# -- pure functions ------------------------------------------------------------------------------


def go_round(value: float) -> int:
    """Go's ``math.Round``: the nearest integer, halves away from zero (Python's ``round`` takes
    halves to the even integer: ``round(70.5) == 70``)."""
    whole = math.trunc(value)
    if abs(value - whole) >= 0.5:
        whole += 1 if value > 0 else -1
    return whole


def mig_memory_gb(mig_memory_mb: int, gpu_memory_bytes: int) -> int:
    """The ``<n>gb`` of a MIG profile as NVIDIA's go-nvlib computes it (``getMigMemorySizeGB`` in
    pkg/nvlib/device/mig_profile.go, which the k8s device plugin, GFD and mig-parted use): the slice's
    share of the GPU's memory rounded up to eighths, times the GPU's memory rounded up to whole GiB,
    rounded half away from zero. An H200 (143771 MiB: 141 GiB rounded up) gives 3g.71gb (4/8 of 141 =
    70.5, rounded up), an H100 NVL (95830 MiB: 94 GiB) 2g.24gb (2/8 of 94 = 23.5)."""
    fraction = float(mig_memory_mb) * MIB / float(gpu_memory_bytes)
    fraction = math.ceil(fraction * MIG_MEMORY_SLICES) / MIG_MEMORY_SLICES
    total_gb = float((gpu_memory_bytes + GIB - 1) // GIB)
    return go_round(fraction * total_gb)


def mig_profile(name: str, attributes: Any = None, parent_memory_bytes: int | None = None) -> str:
    """The MIG profile of a MIG device (``1g.10gb``, ``1g.10gb+me``, ``1c.3g.40gb``): from NVML's
    name of a MIG handle ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", as ``nvidia-smi -L`` shows it), else
    from its attributes as go-nvlib names it (slices, and :func:`mig_memory_gb`; ``+me`` is not in
    the attributes). Without the parent GPU's memory (NVML answers NO_PERMISSION for it to an
    unprivileged process in MIG mode) the memory part is unknown and the profile is the slices only
    (``3g``, ``1c.3g``); "" when neither name nor attributes are known."""
    _, marker, profile = name.rpartition(" MIG ")
    if marker and profile and " " not in profile:
        return profile
    if attributes is None:
        return ""
    gpu_slices = int(attributes.gpuInstanceSliceCount)
    compute_slices = int(attributes.computeInstanceSliceCount)
    slices = f"{compute_slices}c.{gpu_slices}g" if compute_slices != gpu_slices else f"{gpu_slices}g"
    if not parent_memory_bytes:
        return slices
    return f"{slices}.{mig_memory_gb(int(attributes.memorySizeMB), parent_memory_bytes)}gb"


def cuda_devices(gpus: Sequence[GpuReading], visible: str | None) -> dict[int, tuple[str, str]]:
    """CUDA ordinal -> (GPU UUID, MIG UUID or ""), for the ``gpus`` of instance groups.

    CUDA's candidates are NVML's GPUs in NVML order with each GPU in MIG mode standing for its MIG
    devices (PCI bus order: CUDA's default order agrees on a node of one GPU model).
    ``CUDA_VISIBLE_DEVICES`` picks and orders them by index, by ``GPU-`` UUID (a unique prefix will
    do, as CUDA allows), by ``MIG-`` UUID or by the pre-R470 ``MIG-GPU-<uuid>/<gi>/<ci>``; as in
    CUDA, an entry that names nothing ends the list. Then CUDA's MIG rule (:func:`cuda_enumerated`):
    one MIG device at most, and no whole GPU beside it."""
    if visible is None:
        candidates = [device for gpu in gpus for device in _devices_of(gpu)]
    else:
        candidates = []
        for entry in (part.strip() for part in visible.split(",")):
            found = _visible_entry(gpus, entry)
            if found is None:
                break
            candidates.extend(found)
    return dict(enumerate(cuda_enumerated(candidates)))


def cuda_enumerated(candidates: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The devices CUDA enumerates from its visible candidates (GPU UUID, MIG UUID or ""). The MIG
    user guide (CUDA Device Enumeration): "CUDA can only enumerate a single compute instance" and
    "will pick the first one available if several of them are visible"; "CUDA will not enumerate
    non-MIG GPU if any compute instance is enumerated on any other GPU". So: the first MIG device
    alone where there is one, else every whole GPU."""
    first_mig = next((device for device in candidates if device[1]), None)
    return [first_mig] if first_mig is not None else list(candidates)


def exported_devices(devices: Mapping[int, tuple[str, str]]) -> frozenset[str]:
    """The GPU and MIG UUIDs whose families are exported when ``CUDA_VISIBLE_DEVICES`` is set: those
    of the server's CUDA devices (:func:`cuda_devices`), a MIG device's parent GPU included. Triton
    likewise exports only the GPUs whose PCI bus id a CUDA device has (core src/metrics.cc)."""
    return frozenset(uuid for device in devices.values() for uuid in device if uuid)


def _devices_of(gpu: GpuReading) -> list[tuple[str, str]]:
    """A GPU in MIG mode is its MIG devices to CUDA (none while no instance is made), else itself."""
    if gpu.mig_enabled:
        return [(gpu.uuid, mig.uuid) for mig in gpu.migs]
    return [(gpu.uuid, "")]


def _visible_entry(gpus: Sequence[GpuReading], entry: str) -> list[tuple[str, str]] | None:
    if entry.isascii() and entry.isdigit():
        index = int(entry)
        return _devices_of(gpus[index]) if index < len(gpus) else None
    if entry.startswith("MIG-GPU-"):  # before R470: MIG-<GPU UUID>/<GPU instance id>/<compute instance id>
        return _legacy_mig_entry(gpus, entry.removeprefix("MIG-"))
    if entry.startswith("MIG-"):
        for gpu in gpus:
            for mig in gpu.migs:
                if mig.uuid == entry:
                    return [(gpu.uuid, mig.uuid)]
        return None
    if entry.startswith("GPU-"):
        matches = [gpu for gpu in gpus if gpu.uuid.startswith(entry)]
        return _devices_of(matches[0]) if len(matches) == 1 else None
    return None


def _legacy_mig_entry(gpus: Sequence[GpuReading], entry: str) -> list[tuple[str, str]] | None:
    parent, *ids = entry.split("/")
    if len(ids) != 2 or not all(part.isascii() and part.isdigit() for part in ids):
        return None
    gpu_instance, compute_instance = (int(part) for part in ids)
    for gpu in gpus:
        if gpu.uuid != parent:
            continue
        for mig in gpu.migs:
            if (mig.gpu_instance_id, mig.compute_instance_id) == (gpu_instance, compute_instance):
                return [(gpu.uuid, mig.uuid)]
    return None


def count_energy(counted_mj: int, last_mj: int | None, reading_mj: int) -> int:
    """``nv_energy_consumption``'s next count (mJ since the server started) from the previous count,
    the previous reading (None: this is the first) and this reading of NVML's energy counter. Each
    increase is added, as Triton adds the difference of each reading; a reading below the previous one
    is a counter reset (GPU reset, driver reload), counted from zero: the count never goes down."""
    if last_mj is None:
        return counted_mj
    return counted_mj + (reading_mj - last_mj if reading_mj >= last_mj else reading_mj)


def families(snapshot: Snapshot, instances: Iterable[GpuInstance] = (), visible: str | None = None) -> list[Family]:
    """The GPU families of one snapshot: Triton's ``nv_gpu_*`` and ``nv_energy_consumption`` per GPU
    (label ``gpu_uuid``, as Triton), Sluice's temperature and MIG families, and the model instances on
    each GPU. With ``visible`` (``CUDA_VISIBLE_DEVICES``) set, only the GPUs and MIG devices it
    resolves to (:func:`exported_devices`); unset, every one NVML sees. A field NVML did not answer
    has no sample; a family without samples is left out."""
    gauges: dict[str, list[Sample]] = {}

    def add(name: str, labels: Labels, value: float | None, scale: float = 1.0) -> None:
        if value is not None:
            gauges.setdefault(name, []).append(Sample(labels, value * scale))

    devices = cuda_devices(snapshot.gpus, visible)
    exported = None if visible is None else exported_devices(devices)
    for gpu in snapshot.gpus:
        if exported is not None and gpu.uuid not in exported:
            continue
        labels: Labels = (("gpu_uuid", gpu.uuid),)
        mig_mode = "" if gpu.mig_enabled is None else ("enabled" if gpu.mig_enabled else "disabled")
        info = (("gpu_uuid", gpu.uuid), ("gpu_index", str(gpu.index)), ("name", gpu.name), ("mig_mode", mig_mode))
        add("sluice_gpu_info", info, 1)
        add("nv_gpu_utilization", labels, gpu.utilization_percent, 0.01)
        add("nv_gpu_memory_total_bytes", labels, gpu.memory_total_bytes)
        add("nv_gpu_memory_used_bytes", labels, gpu.memory_used_bytes)
        add("nv_gpu_power_usage", labels, gpu.power_mw, 0.001)
        add("nv_gpu_power_limit", labels, gpu.power_limit_mw, 0.001)
        if gpu.energy_mj is not None:
            add("nv_energy_consumption", labels, snapshot.energy_mj.get(gpu.uuid), 0.001)
        add("sluice_gpu_memory_utilization", labels, gpu.memory_utilization_percent, 0.01)
        add("sluice_gpu_temperature_celsius", labels, gpu.temperature_c)
        for mig in gpu.migs:
            if exported is not None and mig.uuid not in exported:
                continue
            ids = (mig.gpu_instance_id, mig.compute_instance_id)
            values = (gpu.uuid, mig.uuid, *("" if i is None else str(i) for i in ids), mig.profile)
            mig_labels: Labels = tuple(zip(MIG_LABELS, values, strict=True))
            add("sluice_mig_device_info", mig_labels, 1)
            add("sluice_mig_memory_total_bytes", mig_labels, mig.memory_total_bytes)
            add("sluice_mig_memory_used_bytes", mig_labels, mig.memory_used_bytes)
    for (model, version, device), count in sorted(Counter(instances).items()):
        gpu_uuid, mig_uuid = devices.get(device, ("", ""))
        where = (("gpu_uuid", gpu_uuid), ("mig_uuid", mig_uuid), ("device", str(device)))
        add("sluice_gpu_model_instances", (*where, ("model", model), ("version", str(version))), count)
    return [
        Family(name, description, kind, tuple(gauges[name]))
        for name, kind, description in _FAMILIES
        if gauges.get(name)
    ]


_FAMILIES = (
    (
        "sluice_gpu_info",
        "gauge",
        "1 for each GPU exported (every GPU NVML sees, or those CUDA_VISIBLE_DEVICES resolves to): its index, "
        "name and MIG mode (enabled, disabled, '': no MIG)",
    ),
    ("nv_gpu_utilization", "gauge", "GPU utilization rate [0.0 - 1.0) (NVML; none for a GPU in MIG mode)"),
    ("nv_gpu_memory_total_bytes", "gauge", "GPU total memory, in bytes"),
    ("nv_gpu_memory_used_bytes", "gauge", "GPU used memory, in bytes (allocated; driver-reserved memory not counted)"),
    ("nv_gpu_power_usage", "gauge", "GPU power usage in watts"),
    ("nv_gpu_power_limit", "gauge", "GPU power management limit in watts"),
    ("nv_energy_consumption", "counter", "GPU energy consumption in joules since the server started"),
    (
        "sluice_gpu_memory_utilization",
        "gauge",
        "Share of time GPU memory was read or written [0.0 - 1.0) (NVML's memory utilization)",
    ),
    ("sluice_gpu_temperature_celsius", "gauge", "GPU core temperature, degrees Celsius"),
    ("sluice_mig_device_info", "gauge", "1 for each MIG device: its GPU, UUID, GPU and compute instance ids, profile"),
    ("sluice_mig_memory_total_bytes", "gauge", "MIG device total memory, in bytes"),
    ("sluice_mig_memory_used_bytes", "gauge", "MIG device used memory, in bytes"),
    (
        "sluice_gpu_model_instances",
        "gauge",
        "Model instances of kind GPU per device (CUDA ordinal of instance_group gpus) and the GPU or MIG device it is",
    ),
)


# -- the NVML layer ------------------------------------------------------------------------------


class NvmlUnavailable(Exception):
    """NVML cannot be used here; the message says why (for the one log line at start)."""


def load_nvml() -> Any:
    """``pynvml``, initialised. Raises :class:`NvmlUnavailable` without nvidia-ml-py or the driver."""
    try:
        import pynvml
    except ImportError:
        raise NvmlUnavailable("nvidia-ml-py is not installed (pip install 'sluice[gpu]')") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise NvmlUnavailable(f"NVML did not start: {exc}") from None
    return pynvml


def _shutdown(nvml: Any) -> None:
    if nvml is None:
        return
    try:
        nvml.nvmlShutdown()
    except nvml.NVMLError:
        pass


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


_OLDER_CALL_MAY_ANSWER = (
    "NVML_ERROR_FUNCTION_NOT_FOUND",
    "NVML_ERROR_NOT_SUPPORTED",
    "NVML_ERROR_ARGUMENT_VERSION_MISMATCH",
)
"""Errors of a newer, versioned NVML call after which the older call is tried: the driver lacks the
entry point, or does not support it (or that struct version) for this device."""


def older_call_may_answer(nvml: Any, error: Exception) -> bool:
    codes = {getattr(nvml, name) for name in _OLDER_CALL_MAY_ANSWER if hasattr(nvml, name)}
    return getattr(error, "value", None) in codes


class _Reader:
    """Calls NVML one field at a time: a failed call is ``None`` (logged once per call and error)."""

    def __init__(self, nvml: Any, reported: set[tuple[str, str]]) -> None:
        self.nvml = nvml
        self._reported = reported

    def get(self, call: str, *args: Any) -> Any:
        try:
            return getattr(self.nvml, call)(*args)
        except self.nvml.NVMLError as exc:
            self.note(call, exc, "that sample is left out")
            return None

    def note(self, call: str, exc: Exception, outcome: str) -> None:
        if (call, type(exc).__name__) not in self._reported:
            self._reported.add((call, type(exc).__name__))
            log.debug("GPU metrics: %s: %s; %s", call, exc, outcome)

    def preferring(
        self,
        newer: str,
        attempt: Callable[[], Any] | None,
        older: str,
        *args: Any,
        unusable: tuple[type[Exception], ...] = (),
    ) -> Any:
        """``attempt()``, the newer, versioned call ``newer``; where pynvml has no such call (``attempt``
        None), its signature is older (``unusable``) or the driver cannot answer it
        (:func:`older_call_may_answer`), the older call ``older(*args)``. None when the call that
        answers fails."""
        if attempt is not None:
            try:
                return attempt()
            except unusable as exc:
                self.note(newer, exc, f"reading {older} instead")
            except self.nvml.NVMLError as exc:
                if not older_call_may_answer(self.nvml, exc):
                    self.note(newer, exc, "that sample is left out")
                    return None
                self.note(newer, exc, f"reading {older} instead")
        return self.get(older, *args)


def _memory(read: _Reader, handle: Any) -> Any:
    """``nvmlMemory_v2`` (``used``: allocated, ``reserved`` apart, as nvidia-smi and DCGM count), else
    v1 (``used``: reserved and allocated) on a pynvml or driver without v2."""
    nvml = read.nvml
    version = getattr(nvml, "nvmlMemory_v2", None)
    attempt = None if version is None else (lambda: nvml.nvmlDeviceGetMemoryInfo(handle, version=version))
    return read.preferring(
        "nvmlDeviceGetMemoryInfo_v2", attempt, "nvmlDeviceGetMemoryInfo", handle, unusable=(TypeError,)
    )


def _temperature(read: _Reader, handle: Any) -> int | None:
    """``nvmlDeviceGetTemperatureV`` (nvmlTemperature_v1_t), else the deprecated
    ``nvmlDeviceGetTemperature`` on a pynvml or driver without it; the GPU core sensor either way."""
    nvml = read.nvml
    sensor = nvml.NVML_TEMPERATURE_GPU
    newer = hasattr(nvml, "nvmlDeviceGetTemperatureV")
    attempt = (lambda: nvml.nvmlDeviceGetTemperatureV(handle, sensor)) if newer else None
    value = read.preferring("nvmlDeviceGetTemperatureV", attempt, "nvmlDeviceGetTemperature", handle, sensor)
    return None if value is None else int(value)


def read_gpus(nvml: Any, reported: set[tuple[str, str]] | None = None) -> tuple[GpuReading, ...]:
    """One reading of every GPU and MIG device NVML sees. Raises ``NVMLError`` only when the GPUs
    cannot be counted; a GPU whose handle or UUID fails is skipped."""
    read = _Reader(nvml, set() if reported is None else reported)
    gpus = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = read.get("nvmlDeviceGetHandleByIndex", index)
        uuid = None if handle is None else read.get("nvmlDeviceGetUUID", handle)
        if uuid is None:
            continue
        mode = read.get("nvmlDeviceGetMigMode", handle)
        mig_enabled = None if mode is None else mode[0] == nvml.NVML_DEVICE_MIG_ENABLE
        # in MIG mode NVML answers the whole GPU's memory only to a privileged caller (NO_PERMISSION in
        # an unprivileged pod): then no memory samples for the GPU, and MIG profiles from names
        memory = _memory(read, handle)
        utilization = read.get("nvmlDeviceGetUtilizationRates", handle)
        name = read.get("nvmlDeviceGetName", handle)
        gpus.append(
            GpuReading(
                index=index,
                uuid=_text(uuid),
                name="" if name is None else _text(name),
                mig_enabled=mig_enabled,
                utilization_percent=None if utilization is None else utilization.gpu,
                memory_utilization_percent=None if utilization is None else utilization.memory,
                memory_total_bytes=None if memory is None else memory.total,
                memory_used_bytes=None if memory is None else memory.used,
                power_mw=read.get("nvmlDeviceGetPowerUsage", handle),
                power_limit_mw=read.get("nvmlDeviceGetPowerManagementLimit", handle),
                temperature_c=_temperature(read, handle),
                energy_mj=read.get("nvmlDeviceGetTotalEnergyConsumption", handle),
                migs=_read_migs(read, handle, None if memory is None else memory.total) if mig_enabled else (),
            )
        )
    return tuple(gpus)


def _read_migs(read: _Reader, gpu: Any, gpu_memory_bytes: int | None) -> tuple[MigReading, ...]:
    migs = []
    for slot in range(read.get("nvmlDeviceGetMaxMigDeviceCount", gpu) or 0):
        try:
            handle = read.nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, slot)
        except read.nvml.NVMLError:  # NOT_FOUND: no MIG device in this slot
            continue
        uuid = read.get("nvmlDeviceGetUUID", handle)
        if uuid is None:
            continue
        name = read.get("nvmlDeviceGetName", handle)
        attributes = None if name and " MIG " in _text(name) else read.get("nvmlDeviceGetAttributes", handle)
        memory = _memory(read, handle)
        migs.append(
            MigReading(
                uuid=_text(uuid),
                gpu_instance_id=read.get("nvmlDeviceGetGpuInstanceId", handle),
                compute_instance_id=read.get("nvmlDeviceGetComputeInstanceId", handle),
                profile=mig_profile("" if name is None else _text(name), attributes, gpu_memory_bytes),
                memory_total_bytes=None if memory is None else memory.total,
                memory_used_bytes=None if memory is None else memory.used,
            )
        )
    return tuple(migs)


class GpuTelemetry:
    """Reads NVML every ``interval_ms`` on a daemon thread into a :class:`Snapshot`; scrapes read
    the snapshot. ``start`` blocks for the first reading (run it off the event loop). ``close`` waits
    ``stop_timeout_s`` for the thread; an NVML call stuck longer (a lost GPU) leaves NVML to the
    thread, which shuts it down once the call returns (never under a call in flight)."""

    def __init__(
        self, settings: GpuMetricsSettings, *, load: Callable[[], Any] = load_nvml, stop_timeout_s: float = 5.0
    ) -> None:
        self._settings = settings
        self._load = load
        self._stop_timeout_s = stop_timeout_s
        self._nvml: Any = None
        self._snapshot: Snapshot | None = None
        self._energy_last: dict[str, int] = {}
        self._energy_counted: dict[str, int] = {}
        self._reported: set[tuple[str, str]] = set()
        self._failure = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handover = threading.Lock()
        self._reader_done = False
        self._reader_owns_nvml = False

    @property
    def active(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if not self._settings.enabled:
            log.info("GPU metrics off: --allow-gpu-metrics false")
            return
        try:
            nvml = self._load()
        except NvmlUnavailable as exc:
            log.info("GPU metrics off: %s", exc)
            return
        if not self._read(nvml):
            log.info("GPU metrics off: %s", self._failure or "NVML sees no GPU")
            _shutdown(nvml)
            return
        self._nvml = nvml
        assert self._snapshot is not None
        log.info("GPU metrics on: %s read from NVML every %d ms%s", *self._found(self._snapshot.gpus))
        self._thread = threading.Thread(target=self._run, args=(nvml,), name="sluice-gpu-telemetry", daemon=True)
        self._thread.start()

    def _found(self, gpus: Sequence[GpuReading]) -> tuple[str, int, str]:
        """The start line's parts: what NVML sees, the interval, and what CUDA_VISIBLE_DEVICES exports."""

        def count(shown: Sequence[GpuReading], migs: int) -> str:
            return f"{len(shown)} GPU(s)" + (f" with {migs} MIG device(s)" if migs else "")

        seen = count(gpus, sum(len(gpu.migs) for gpu in gpus))
        visible = self._settings.cuda_visible_devices
        if visible is None:
            return seen, self._settings.interval_ms, ""
        exported = exported_devices(cuda_devices(gpus, visible))
        shown = [gpu for gpu in gpus if gpu.uuid in exported]
        migs = sum(mig.uuid in exported for gpu in shown for mig in gpu.migs)
        return seen, self._settings.interval_ms, f"; exported: {count(shown, migs)} (CUDA_VISIBLE_DEVICES={visible})"

    def _read(self, nvml: Any) -> bool:
        """Take one reading into the snapshot; False when NVML could not count the GPUs or saw none."""
        try:
            gpus = read_gpus(nvml, self._reported)
        except nvml.NVMLError as exc:
            if str(exc) != self._failure:
                log.warning("GPU metrics: NVML could not list the GPUs: %s; no GPU samples until it can", exc)
            self._failure = str(exc)
            self._snapshot = Snapshot(())
            return False
        if self._failure:
            log.info("GPU metrics: NVML lists the GPUs again")
            self._failure = ""
        for gpu in gpus:
            if gpu.energy_mj is not None:
                counted = self._energy_counted.get(gpu.uuid, 0)
                self._energy_counted[gpu.uuid] = count_energy(counted, self._energy_last.get(gpu.uuid), gpu.energy_mj)
                self._energy_last[gpu.uuid] = gpu.energy_mj
        self._snapshot = Snapshot(gpus, dict(self._energy_counted))
        return bool(gpus)

    def _run(self, nvml: Any) -> None:
        try:
            while not self._stop.wait(self._settings.interval_ms / 1000):
                try:
                    self._read(nvml)
                except Exception:  # a bug here must not end the thread silently with stale samples
                    log.exception("GPU metrics: reading NVML failed")
                    self._snapshot = Snapshot(())
        finally:
            with self._handover:
                self._reader_done = True
                owns_nvml = self._reader_owns_nvml
            if owns_nvml:  # close() gave up waiting: the call it waited for has returned now
                _shutdown(nvml)
                log.info("GPU metrics: the stuck NVML call returned; NVML shut down")

    def snapshot(self) -> Snapshot | None:
        """The last reading; None when GPU metrics are off."""
        return self._snapshot if self.active else None

    def families(self, instances: Iterable[GpuInstance] = ()) -> list[Family]:
        snapshot = self.snapshot()
        if snapshot is None:
            return []
        return families(snapshot, instances, self._settings.cuda_visible_devices)

    def close(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        nvml, self._nvml = self._nvml, None
        if thread is not None:
            thread.join(timeout=self._stop_timeout_s)  # an NVML call stuck on a lost GPU must not hold the stop up
            with self._handover:
                self._reader_owns_nvml = not self._reader_done
            if self._reader_owns_nvml:  # shutting NVML down under the call in flight is not safe
                log.warning(
                    "GPU metrics: an NVML call has not returned in %g s; NVML is shut down when it does",
                    self._stop_timeout_s,
                )
                return
        _shutdown(nvml)
