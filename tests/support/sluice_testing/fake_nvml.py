"""A fake NVML *C library* for GPU telemetry tests on machines without a GPU.

``build(directory, gpus)`` writes a small C source exporting the NVML entry points the server
calls, with NVML's documented C signatures and structs (``nvmlMemory_t``, the versioned
``nvmlMemory_v2_t`` and ``nvmlTemperature_v1_t``, ``nvmlUtilization_t``, ``nvmlDeviceAttributes_t``,
handles as pointers, ``nvmlReturn_t`` codes), compiles it with gcc into ``directory/libnvidia-ml.so.1``
and returns ``directory``. A process started with that directory first on ``LD_LIBRARY_PATH`` loads
it where pynvml (nvidia-ml-py, unchanged) loads the driver's ``libnvidia-ml.so.1``; nothing in
Python is replaced.

The inventory is data: :class:`FakeGpu` (optionally in MIG mode with :class:`FakeMig` devices in
numbered slots) and, per device, the entry points that answer ``NVML_ERROR_NOT_SUPPORTED``. As
NVML documents, a MIG device handle answers memory, UUID, name, GPU/compute instance ids and
attributes; utilization, power, temperature and energy answer NOT_SUPPORTED there, and a GPU in
MIG mode answers NOT_SUPPORTED for its utilization. Memory as the driver counts it: v1's ``used`` is
reserved + allocated, v2 (``nvmlDeviceGetMemoryInfo_v2``, whose struct version is checked) has
``reserved`` apart and ``used`` = allocated (``memory_used`` here). Each call of
``nvmlDeviceGetTotalEnergyConsumption`` returns the counter and then advances it by
``energy_step_mj`` (energy only grows, until ``energy_reset_at_call``: a GPU reset).

Per library (``build``'s keywords): ``missing`` entry points are not exported at all, as an older
driver lacks ``nvmlDeviceGetMemoryInfo_v2`` / ``nvmlDeviceGetTemperatureV`` or a newer one the
deprecated ``nvmlDeviceGetTemperature`` (pynvml raises ``NVMLError_FunctionNotFound``);
``privileged=False`` is a caller without privileges, to whom a GPU in MIG mode answers
``NVML_ERROR_NO_PERMISSION`` for its own (aggregate) memory, as NVML documents; ``block_while``
makes ``nvmlDeviceGetCount_v2`` wait while that file exists (an NVML call stuck on a lost GPU). As
NVML does, every device call answers ``NVML_ERROR_UNINITIALIZED`` unless ``nvmlInit`` was called
more often than ``nvmlShutdown``.

Beside it ``build`` compiles ``libcudart.so.12``, a CUDA runtime that only counts devices (as a GPU
machine has both libraries): ``cudaGetDeviceCount`` answers the number of entries in
``CUDA_VISIBLE_DEVICES`` when it is set, else the number of GPUs; every other entry point answers
``cudaErrorNotSupported``. The server places KIND_GPU instances by that count. (It does not apply
CUDA's one-MIG-device rule: a test that wants CUDA's count on a MIG node sets ``CUDA_VISIBLE_DEVICES``
to one entry.)
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25

CALLS = (
    "nvmlDeviceGetName",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetPowerManagementLimit",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetTotalEnergyConsumption",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetAttributes_v2",
)
"""Entry points whose answer a test may turn into NOT_SUPPORTED per device. ``nvmlDeviceGetMemoryInfo``
and ``nvmlDeviceGetTemperature`` stand for the device's memory and temperature (their versioned
calls answer NOT_SUPPORTED too); ``nvmlDeviceGetMemoryInfo_v2`` for v2 alone."""

OPTIONAL_ENTRY_POINTS = frozenset(
    {"nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"}
)
"""Entry points ``build(missing=...)`` may leave out of the library (drivers older or newer)."""

MIG_UNSUPPORTED = frozenset(
    {
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetPowerManagementLimit",
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetTotalEnergyConsumption",
        "nvmlDeviceGetMigMode",
    }
)


@dataclasses.dataclass(frozen=True)
class FakeMig:
    uuid: str
    name: str
    """NVML's name of a MIG handle: "<GPU name> MIG <profile>"."""
    gpu_instance_id: int
    compute_instance_id: int
    memory_total: int
    memory_used: int
    gpu_slices: int = 1
    compute_slices: int = 1
    memory_size_mb: int = 0
    not_supported: frozenset[str] = frozenset()
    memory_reserved: int = 0


@dataclasses.dataclass(frozen=True)
class FakeGpu:
    uuid: str
    name: str
    memory_total: int
    memory_used: int
    """Allocated memory: v2's ``used`` (v1's ``used`` adds ``memory_reserved``)."""
    utilization_gpu: int = 0
    utilization_memory: int = 0
    power_mw: int = 0
    power_limit_mw: int = 0
    temperature_c: int = 0
    energy_mj: int = 0
    energy_step_mj: int = 0
    mig_slots: tuple[FakeMig | None, ...] | None = None
    """None: MIG mode disabled; else the MIG device in each slot (None: an empty slot)."""
    not_supported: frozenset[str] = frozenset()
    memory_reserved: int = 0
    """Memory the driver reserves: v2's ``reserved``, and part of v1's ``used``."""
    energy_reset_at_call: int = 0
    """0: never; else on that call (1: the first) of ``nvmlDeviceGetTotalEnergyConsumption`` the
    counter starts again from 0, as after a GPU reset."""


def _c(text: str) -> str:
    return json.dumps(text)  # an ASCII JSON string is a C string literal


def _device(
    *, uuid: str, name: str, parent: int, memory: tuple[int, int, int], rcs: frozenset[str], fields: dict[str, int]
) -> str:
    rc = ", ".join(str(NVML_ERROR_NOT_SUPPORTED if call in rcs else NVML_SUCCESS) for call in CALLS)
    values = "".join(f", .{key} = {value}ULL" for key, value in fields.items())
    total, used, reserved = memory
    return (
        f"  {{ .uuid = {_c(uuid)}, .name = {_c(name)}, .parent = {parent}, .mem_total = {total}ULL, "
        f".mem_used = {used}ULL, .mem_reserved = {reserved}ULL, .rc = {{ {rc} }}{values} }},\n"
    )


def source(
    gpus: list[FakeGpu],
    init_rc: int = NVML_SUCCESS,
    *,
    missing: frozenset[str] = frozenset(),
    privileged: bool = True,
    block_while: Path | None = None,
) -> str:
    rows: list[str] = []
    slots: list[list[int]] = []
    migs: list[str] = []
    for index, gpu in enumerate(gpus):
        unsupported = gpu.not_supported | ({"nvmlDeviceGetUtilizationRates"} if gpu.mig_slots is not None else set())
        rows.append(
            _device(
                uuid=gpu.uuid,
                name=gpu.name,
                parent=-1,
                memory=(gpu.memory_total, gpu.memory_used, gpu.memory_reserved),
                rcs=frozenset(unsupported | {"nvmlDeviceGetAttributes_v2"}),
                fields={
                    "util_gpu": gpu.utilization_gpu,
                    "util_mem": gpu.utilization_memory,
                    "power_mw": gpu.power_mw,
                    "limit_mw": gpu.power_limit_mw,
                    "temp": gpu.temperature_c,
                    "energy_mj": gpu.energy_mj,
                    "energy_step": gpu.energy_step_mj,
                    "mig_mode": 0 if gpu.mig_slots is None else 1,
                    "max_mig": 0 if gpu.mig_slots is None else len(gpu.mig_slots),
                    "energy_reset_at": gpu.energy_reset_at_call,
                },
            )
        )
        slots.append([])
        for mig in gpu.mig_slots or ():
            if mig is None:
                slots[index].append(-1)
                continue
            slots[index].append(len(gpus) + len(migs))
            migs.append(
                _device(
                    uuid=mig.uuid,
                    name=mig.name,
                    parent=index,
                    memory=(mig.memory_total, mig.memory_used, mig.memory_reserved),
                    rcs=frozenset(mig.not_supported | MIG_UNSUPPORTED),
                    fields={
                        "gi": mig.gpu_instance_id,
                        "ci": mig.compute_instance_id,
                        "gi_slices": mig.gpu_slices,
                        "ci_slices": mig.compute_slices,
                        "mem_mb": mig.memory_size_mb,
                    },
                )
            )
    slot_rows = "".join("  { " + ", ".join(map(str, s + [-1] * (8 - len(s)))) + " },\n" for s in slots)
    enum = ", ".join(f"FN_{call}" for call in CALLS)
    if missing - OPTIONAL_ENTRY_POINTS:
        raise ValueError(f"only {sorted(OPTIONAL_ENTRY_POINTS)} can be missing, not {sorted(missing)}")
    exported = "".join(f"#define HAVE_{call} 1\n" for call in sorted(OPTIONAL_ENTRY_POINTS - missing))
    return _TEMPLATE % {
        "exported": exported,
        "enum": enum,
        "ncalls": len(CALLS),
        "devices": "".join(rows + migs) or "  { 0 },\n",
        "slots": slot_rows or "  { -1 },\n",
        "gpu_count": len(gpus),
        "init_rc": init_rc,
        "privileged": int(privileged),
        "block_while": _c("" if block_while is None else str(block_while)),
    }


def build(
    directory: Path,
    gpus: list[FakeGpu],
    init_rc: int = NVML_SUCCESS,
    *,
    missing: frozenset[str] = frozenset(),
    privileged: bool = True,
    block_while: Path | None = None,
) -> Path:
    """Compile the fake library into ``directory/libnvidia-ml.so.1``; returns ``directory``. The keywords
    are the library's: entry points ``missing`` from it, a caller without ``privileged`` rights, and
    ``nvmlDeviceGetCount_v2`` blocking while the file ``block_while`` exists."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise RuntimeError("the fake NVML library needs a C compiler (gcc) on PATH")
    directory.mkdir(parents=True, exist_ok=True)
    code = source(gpus, init_rc, missing=missing, privileged=privileged, block_while=block_while)
    (directory / "fake_nvml.c").write_text(code)
    subprocess.run(
        [gcc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", str(directory / "libnvidia-ml.so.1"),
         str(directory / "fake_nvml.c")],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    (directory / "fake_cudart.c").write_text(_CUDART % {"gpu_count": len(gpus)})
    subprocess.run(
        [gcc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", str(directory / "libcudart.so.12"),
         str(directory / "fake_cudart.c")],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    # under every name the runtime's loader tries before .12, so that a real libcudart in the dynamic
    # loader's cache (a GPU machine's) never wins over the fake on LD_LIBRARY_PATH
    for name in ("libcudart.so", "libcudart.so.13"):
        link = directory / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to("libcudart.so.12")
    return directory


_CUDART = r"""
/* Generated by sluice_testing/fake_nvml.py: a CUDA runtime that only counts devices. */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

enum { cudaSuccess = 0, cudaErrorNotSupported = 801 };

int cudaGetDeviceCount(int *count) {
  const char *visible = getenv("CUDA_VISIBLE_DEVICES");
  if (visible == NULL) { *count = %(gpu_count)d; return cudaSuccess; }
  int n = 0;
  for (const char *p = visible; *p; n++) {
    const char *comma = strchr(p, ',');
    if (!comma) { n++; break; }
    p = comma + 1;
  }
  *count = n;
  return cudaSuccess;
}
const char *cudaGetErrorName(int code) { return code ? "cudaErrorNotSupported" : "cudaSuccess"; }
const char *cudaGetErrorString(int code) { return code ? "operation not supported (fake CUDA runtime)" : "no error"; }
int cudaSetDevice(int device) { (void)device; return cudaErrorNotSupported; }
int cudaIpcOpenMemHandle(void **pointer, char handle[64], unsigned flags) {
  (void)pointer; (void)handle; (void)flags; return cudaErrorNotSupported; }
int cudaIpcCloseMemHandle(void *pointer) { (void)pointer; return cudaErrorNotSupported; }
int cudaMemcpy(void *dst, const void *src, size_t n, int kind) {
  (void)dst; (void)src; (void)n; (void)kind; return cudaErrorNotSupported; }
int cudaMalloc(void **pointer, size_t n) { (void)pointer; (void)n; return cudaErrorNotSupported; }
int cudaFree(void *pointer) { (void)pointer; return cudaErrorNotSupported; }
int cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, void *stream) {
  (void)dst; (void)src; (void)n; (void)kind; (void)stream; return cudaErrorNotSupported; }
int cudaStreamCreateWithFlags(void **stream, unsigned flags) {
  (void)stream; (void)flags; return cudaErrorNotSupported; }
int cudaStreamSynchronize(void *stream) { (void)stream; return cudaErrorNotSupported; }
int cudaStreamDestroy(void *stream) { (void)stream; return cudaErrorNotSupported; }
"""


_TEMPLATE = r"""
/* Generated by sluice_testing/fake_nvml.py: NVML's C entry points over a fixed inventory. */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

%(exported)s
typedef int nvmlReturn_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
typedef struct { unsigned int version; int sensorType; int temperature; } nvmlTemperature_v1_t;
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef struct {
  unsigned int multiprocessorCount, sharedCopyEngineCount, sharedDecoderCount, sharedEncoderCount,
      sharedJpegCount, sharedOfaCount, gpuInstanceSliceCount, computeInstanceSliceCount;
  unsigned long long memorySizeMB;
} nvmlDeviceAttributes_t;
/* nvml.h: NVML_STRUCT_VERSION(data, ver) = sizeof(nvml<data>_v<ver>_t) | ver << 24 */
#define NVML_STRUCT_VERSION(data, ver) (unsigned int)(sizeof(nvml##data##_v##ver##_t) | ((ver) << 24U))

enum { %(enum)s };

typedef struct device {
  const char *uuid, *name;
  int parent;
  unsigned long long mem_total, mem_used, mem_reserved;
  nvmlReturn_t rc[%(ncalls)d];
  unsigned long long util_gpu, util_mem, power_mw, limit_mw, temp, energy_mj, energy_step, mig_mode, max_mig;
  unsigned long long energy_reset_at, energy_calls;
  unsigned long long gi, ci, gi_slices, ci_slices, mem_mb;
} device_t;
typedef device_t *nvmlDevice_t;

static device_t devices[] = {
%(devices)s};
static const int mig_slots[][8] = {
%(slots)s};
static const unsigned int gpu_count = %(gpu_count)d;
static const nvmlReturn_t init_rc = %(init_rc)d;
static const int privileged = %(privileged)d;
static const char *const block_while = %(block_while)s;
static int initialized = 0; /* nvmlInit calls less nvmlShutdown calls */

#define CHECK_INIT() do { if (__atomic_load_n(&initialized, __ATOMIC_SEQ_CST) <= 0) return 1; } while (0)
#define CHECK(d, fn) do { CHECK_INIT(); if ((d) == NULL) return 2; if ((d)->rc[FN_##fn]) return (d)->rc[FN_##fn]; \
  } while (0)
/* NVML_ERROR_NO_PERMISSION: a GPU in MIG mode answers its aggregate memory to a privileged caller only */
#define CHECK_MEMORY_PERMISSION(d) do { if (!privileged && (d)->parent < 0 && (d)->mig_mode) return 4; } while (0)

static nvmlReturn_t copy_text(const char *text, char *buf, unsigned int length) {
  if (strlen(text) + 1 > length) return 7; /* NVML_ERROR_INSUFFICIENT_SIZE */
  strcpy(buf, text);
  return 0;
}

static nvmlReturn_t init(void) {
  if (init_rc == 0) __atomic_add_fetch(&initialized, 1, __ATOMIC_SEQ_CST);
  return init_rc;
}
nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { (void)flags; return init(); }
nvmlReturn_t nvmlInit_v2(void) { return init(); }
nvmlReturn_t nvmlShutdown(void) {
  if (__atomic_sub_fetch(&initialized, 1, __ATOMIC_SEQ_CST) < 0) {
    __atomic_add_fetch(&initialized, 1, __ATOMIC_SEQ_CST);
    return 1; /* NVML_ERROR_UNINITIALIZED */
  }
  return 0;
}
const char *nvmlErrorString(nvmlReturn_t result) {
  static char text[64];
  snprintf(text, sizeof text, "fake NVML error %%d", result);
  return text;
}
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
  CHECK_INIT();
  while (block_while[0] && access(block_while, F_OK) == 0) usleep(10000); /* stuck, as on a lost GPU */
  CHECK_INIT();
  *count = gpu_count;
  return 0;
}
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
  CHECK_INIT();
  if (index >= gpu_count) return 2;
  *device = &devices[index];
  return 0;
}
nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int length) {
  CHECK_INIT();
  if (d == NULL) return 2;
  return copy_text(d->uuid, uuid, length);
}
nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int length) {
  CHECK(d, nvmlDeviceGetName);
  return copy_text(d->name, name, length);
}
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *memory) {
  CHECK(d, nvmlDeviceGetMemoryInfo);
  CHECK_MEMORY_PERMISSION(d);
  memory->total = d->mem_total;
  memory->used = d->mem_reserved + d->mem_used; /* v1: reserved and allocated */
  memory->free = d->mem_total - memory->used;
  return 0;
}
#ifdef HAVE_nvmlDeviceGetMemoryInfo_v2
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *memory) {
  CHECK(d, nvmlDeviceGetMemoryInfo);
  CHECK(d, nvmlDeviceGetMemoryInfo_v2);
  if (memory->version != NVML_STRUCT_VERSION(Memory, 2)) return 25; /* NVML_ERROR_ARGUMENT_VERSION_MISMATCH */
  CHECK_MEMORY_PERMISSION(d);
  memory->total = d->mem_total;
  memory->reserved = d->mem_reserved;
  memory->used = d->mem_used; /* v2: allocated */
  memory->free = d->mem_total - d->mem_reserved - d->mem_used;
  return 0;
}
#endif
nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *utilization) {
  CHECK(d, nvmlDeviceGetUtilizationRates);
  utilization->gpu = (unsigned int)d->util_gpu;
  utilization->memory = (unsigned int)d->util_mem;
  return 0;
}
nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned int *power) {
  CHECK(d, nvmlDeviceGetPowerUsage);
  *power = (unsigned int)d->power_mw;
  return 0;
}
nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t d, unsigned int *limit) {
  CHECK(d, nvmlDeviceGetPowerManagementLimit);
  *limit = (unsigned int)d->limit_mw;
  return 0;
}
#ifdef HAVE_nvmlDeviceGetTemperature
nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t d, int sensor, unsigned int *temp) {
  CHECK(d, nvmlDeviceGetTemperature);
  if (sensor != 0) return 2; /* NVML_TEMPERATURE_GPU is the only sensor */
  *temp = (unsigned int)d->temp;
  return 0;
}
#endif
#ifdef HAVE_nvmlDeviceGetTemperatureV
nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t d, nvmlTemperature_v1_t *temperature) {
  CHECK(d, nvmlDeviceGetTemperature);
  if (temperature->version != NVML_STRUCT_VERSION(Temperature, 1)) return 25;
  if (temperature->sensorType != 0) return 2;
  temperature->temperature = (int)d->temp;
  return 0;
}
#endif
nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t d, unsigned long long *energy) {
  CHECK(d, nvmlDeviceGetTotalEnergyConsumption);
  if (++d->energy_calls == d->energy_reset_at) d->energy_mj = 0; /* the GPU was reset */
  *energy = d->energy_mj;
  d->energy_mj += d->energy_step;
  return 0;
}
nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned int *current, unsigned int *pending) {
  CHECK(d, nvmlDeviceGetMigMode);
  *current = *pending = (unsigned int)d->mig_mode;
  return 0;
}
nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t d, unsigned int *count) {
  CHECK_INIT();
  if (d == NULL) return 2;
  if (d->parent >= 0) return 3;
  *count = (unsigned int)d->max_mig;
  return 0;
}
nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t d, unsigned int index, nvmlDevice_t *mig) {
  CHECK_INIT();
  if (d == NULL || d->parent >= 0) return 2;
  if (!d->mig_mode) return 3;
  if (index >= d->max_mig) return 2;
  int slot = mig_slots[d - devices][index];
  if (slot < 0) return 6; /* NVML_ERROR_NOT_FOUND: no MIG device there */
  *mig = &devices[slot];
  return 0;
}
nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t d, unsigned int *id) {
  CHECK_INIT();
  if (d == NULL) return 2;
  if (d->parent < 0) return 3;
  *id = (unsigned int)d->gi;
  return 0;
}
nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t d, unsigned int *id) {
  CHECK_INIT();
  if (d == NULL) return 2;
  if (d->parent < 0) return 3;
  *id = (unsigned int)d->ci;
  return 0;
}
nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t d, nvmlDeviceAttributes_t *attributes) {
  CHECK(d, nvmlDeviceGetAttributes_v2);
  memset(attributes, 0, sizeof *attributes);
  attributes->gpuInstanceSliceCount = (unsigned int)d->gi_slices;
  attributes->computeInstanceSliceCount = (unsigned int)d->ci_slices;
  attributes->memorySizeMB = d->mem_mb;
  return 0;
}
"""
