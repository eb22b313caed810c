"""GPU and MIG telemetry read from NVML, for the Prometheus metrics.

Who calls it: ``Server`` builds a :class:`GpuTelemetry` from ``GpuMetricsSettings`` (Triton's
``--allow-gpu-metrics`` and ``--metrics-interval-ms``), starts it once the listeners are bound and
closes it on stop; ``Metrics`` asks it for :meth:`GpuTelemetry.families` at each scrape and writes
them beside its own families (metrics.py). Names and their Triton equivalents: docs/metrics.md.

* Readings (:class:`GpuReading`, :class:`MigReading`) are plain data: what NVML answered, ``None``
  where a call failed (``NVMLError_NotSupported`` and the like), so one unsupported field drops
  that sample only.
* Pure functions turn readings into families: :func:`families`, :func:`mig_profile` (the
  ``1g.10gb`` names nvidia-smi and the k8s device plugin use), :func:`cuda_devices` (which NVML
  GPU or MIG device a CUDA ordinal of an ``instance_group``'s ``gpus`` is, through
  ``CUDA_VISIBLE_DEVICES``).
* The thin NVML layer: :func:`load_nvml` imports ``pynvml`` (the ``nvidia-ml-py`` package of the
  ``gpu`` extra) lazily and initialises it, :func:`read_gpus` calls it, and :class:`GpuTelemetry`
  reads on a background thread every interval into a snapshot, so a scrape never waits for NVML.
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
    power_mw: int | None = None
    power_limit_mw: int | None = None
    temperature_c: int | None = None
    energy_mj: int | None = None
    """Total energy since the driver was loaded, millijoules."""
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
    energy_start_mj: Mapping[str, int]
    """Each GPU's first energy reading: ``nv_energy_consumption`` counts from there (Triton: since start)."""


# -- pure functions ------------------------------------------------------------------------------


def mig_profile(name: str, attributes: Any = None, parent_memory_bytes: int | None = None) -> str:
    """The MIG profile of a MIG device (``1g.10gb``, ``1g.10gb+me``, ``1c.3g.40gb``): from NVML's
    name of a MIG handle ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", as ``nvidia-smi -L`` shows it), else
    from its attributes the way the k8s device plugin names it (slices, and the memory rounded up
    to eighths of the whole GPU); "" when neither is known."""
    _, marker, profile = name.rpartition(" MIG ")
    if marker and profile and " " not in profile:
        return profile
    if attributes is None or not parent_memory_bytes:
        return ""
    gpu_slices = int(attributes.gpuInstanceSliceCount)
    compute_slices = int(attributes.computeInstanceSliceCount)
    memory_mb = int(attributes.memorySizeMB)
    total_mb = parent_memory_bytes / (1024 * 1024)
    eighths = math.ceil(memory_mb / total_mb * 8) / 8
    gb = round(eighths * parent_memory_bytes / 1024**3)
    prefix = f"{compute_slices}c." if compute_slices != gpu_slices else ""
    return f"{prefix}{gpu_slices}g.{gb}gb"


def cuda_devices(gpus: Sequence[GpuReading], visible: str | None) -> dict[int, tuple[str, str]]:
    """CUDA ordinal -> (GPU UUID, MIG UUID or ""), for the ``gpus`` of instance groups.

    CUDA's devices are NVML's GPUs in NVML order with each GPU in MIG mode standing for its MIG
    devices (PCI bus order: CUDA's default order agrees on a node of one GPU model).
    ``CUDA_VISIBLE_DEVICES`` picks and orders them by index, by ``GPU-`` UUID (a unique prefix will
    do, as CUDA allows) or by ``MIG-`` UUID; as in CUDA, an entry that names nothing ends the list."""
    if visible is None:
        return dict(enumerate(device for gpu in gpus for device in _devices_of(gpu)))
    chosen: list[tuple[str, str]] = []
    for entry in (part.strip() for part in visible.split(",")):
        found = _visible_entry(gpus, entry)
        if found is None:
            break
        chosen.extend(found)
    return dict(enumerate(chosen))


def _devices_of(gpu: GpuReading) -> list[tuple[str, str]]:
    """A GPU in MIG mode is its MIG devices to CUDA (none while no instance is made), else itself."""
    if gpu.mig_enabled:
        return [(gpu.uuid, mig.uuid) for mig in gpu.migs]
    return [(gpu.uuid, "")]


def _visible_entry(gpus: Sequence[GpuReading], entry: str) -> list[tuple[str, str]] | None:
    if entry.isdigit():
        index = int(entry)
        return _devices_of(gpus[index]) if index < len(gpus) else None
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


def families(
    snapshot: Snapshot, instances: Iterable[GpuInstance] = (), visible: str | None = None
) -> list[Family]:
    """The GPU families of one snapshot: Triton's ``nv_gpu_*`` and ``nv_energy_consumption`` per GPU
    (label ``gpu_uuid``, as Triton), Sluice's temperature and MIG families, and the model instances on
    each GPU. A field NVML did not answer has no sample; a family without samples is left out."""
    gauges: dict[str, list[Sample]] = {}

    def add(name: str, labels: Labels, value: float | None, scale: float = 1.0) -> None:
        if value is not None:
            gauges.setdefault(name, []).append(Sample(labels, value * scale))

    for gpu in snapshot.gpus:
        labels: Labels = (("gpu_uuid", gpu.uuid),)
        mig_mode = "" if gpu.mig_enabled is None else ("enabled" if gpu.mig_enabled else "disabled")
        info = (("gpu_uuid", gpu.uuid), ("gpu_index", str(gpu.index)), ("name", gpu.name), ("mig_mode", mig_mode))
        add("sluice_gpu_info", info, 1)
        add("nv_gpu_utilization", labels, gpu.utilization_percent, 0.01)
        add("nv_gpu_memory_total_bytes", labels, gpu.memory_total_bytes)
        add("nv_gpu_memory_used_bytes", labels, gpu.memory_used_bytes)
        add("nv_gpu_power_usage", labels, gpu.power_mw, 0.001)
        add("nv_gpu_power_limit", labels, gpu.power_limit_mw, 0.001)
        start = snapshot.energy_start_mj.get(gpu.uuid)
        if gpu.energy_mj is not None and start is not None:
            add("nv_energy_consumption", labels, max(gpu.energy_mj - start, 0), 0.001)
        add("sluice_gpu_memory_utilization", labels, gpu.memory_utilization_percent, 0.01)
        add("sluice_gpu_temperature_celsius", labels, gpu.temperature_c)
        for mig in gpu.migs:
            ids = (mig.gpu_instance_id, mig.compute_instance_id)
            values = (gpu.uuid, mig.uuid, *("" if i is None else str(i) for i in ids), mig.profile)
            mig_labels: Labels = tuple(zip(MIG_LABELS, values, strict=True))
            add("sluice_mig_device_info", mig_labels, 1)
            add("sluice_mig_memory_total_bytes", mig_labels, mig.memory_total_bytes)
            add("sluice_mig_memory_used_bytes", mig_labels, mig.memory_used_bytes)
    devices = cuda_devices(snapshot.gpus, visible)
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
        "1 for each GPU NVML sees: its index, name and MIG mode (enabled, disabled, '': no MIG)",
    ),
    ("nv_gpu_utilization", "gauge", "GPU utilization rate [0.0 - 1.0) (NVML; none for a GPU in MIG mode)"),
    ("nv_gpu_memory_total_bytes", "gauge", "GPU total memory, in bytes"),
    ("nv_gpu_memory_used_bytes", "gauge", "GPU used memory, in bytes"),
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


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


class _Reader:
    """Calls NVML one field at a time: a failed call is ``None`` (logged once per call and error)."""

    def __init__(self, nvml: Any, reported: set[tuple[str, str]]) -> None:
        self.nvml = nvml
        self._reported = reported

    def get(self, call: str, *args: Any) -> Any:
        try:
            return getattr(self.nvml, call)(*args)
        except self.nvml.NVMLError as exc:
            if (call, type(exc).__name__) not in self._reported:
                self._reported.add((call, type(exc).__name__))
                log.debug("GPU metrics: %s: %s; that sample is left out", call, exc)
            return None


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
        memory = read.get("nvmlDeviceGetMemoryInfo", handle)
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
                temperature_c=read.get("nvmlDeviceGetTemperature", handle, nvml.NVML_TEMPERATURE_GPU),
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
        memory = read.get("nvmlDeviceGetMemoryInfo", handle)
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
    the snapshot. ``start`` blocks for the first reading (run it off the event loop)."""

    def __init__(self, settings: GpuMetricsSettings, *, load: Callable[[], Any] = load_nvml) -> None:
        self._settings = settings
        self._load = load
        self._nvml: Any = None
        self._snapshot: Snapshot | None = None
        self._energy_start: dict[str, int] = {}
        self._reported: set[tuple[str, str]] = set()
        self._failure = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if not self._settings.enabled:
            log.info("GPU metrics off: --allow-gpu-metrics false")
            return
        try:
            self._nvml = self._load()
        except NvmlUnavailable as exc:
            log.info("GPU metrics off: %s", exc)
            return
        if not self._read():
            log.info("GPU metrics off: %s", self._failure or "NVML sees no GPU")
            self._shutdown()
            return
        assert self._snapshot is not None
        gpus = self._snapshot.gpus
        migs = sum(len(gpu.migs) for gpu in gpus)
        log.info(
            "GPU metrics on: %d GPU(s)%s read from NVML every %d ms",
            len(gpus),
            f" with {migs} MIG device(s)" if migs else "",
            self._settings.interval_ms,
        )
        self._thread = threading.Thread(target=self._run, name="sluice-gpu-telemetry", daemon=True)
        self._thread.start()

    def _read(self) -> bool:
        """Take one reading into the snapshot; False when NVML could not count the GPUs or saw none."""
        try:
            gpus = read_gpus(self._nvml, self._reported)
        except self._nvml.NVMLError as exc:
            if str(exc) != self._failure:
                log.warning("GPU metrics: NVML could not list the GPUs: %s; no GPU samples until it can", exc)
            self._failure = str(exc)
            self._snapshot = Snapshot((), {})
            return False
        if self._failure:
            log.info("GPU metrics: NVML lists the GPUs again")
            self._failure = ""
        for gpu in gpus:
            if gpu.energy_mj is not None:
                self._energy_start.setdefault(gpu.uuid, gpu.energy_mj)
        self._snapshot = Snapshot(gpus, dict(self._energy_start))
        return bool(gpus)

    def _run(self) -> None:
        while not self._stop.wait(self._settings.interval_ms / 1000):
            try:
                self._read()
            except Exception:  # a bug here must not end the thread silently with stale samples
                log.exception("GPU metrics: reading NVML failed")
                self._snapshot = Snapshot((), {})

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
        if self._thread is not None:
            self._thread.join(timeout=5.0)  # an NVML call stuck on a lost GPU must not hold the stop up
            self._thread = None
        self._shutdown()

    def _shutdown(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass
            self._nvml = None
