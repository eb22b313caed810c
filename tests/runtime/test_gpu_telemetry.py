"""GPU and MIG telemetry (gpu_telemetry.py) on the metrics port.

On a machine without a GPU the real ``sluice serve`` is started with a fake NVML *C library*
first on ``LD_LIBRARY_PATH`` (sluice_testing/fake_nvml.py, compiled with gcc here): nvidia-ml-py's
own ``pynvml`` loads it as it loads the driver's ``libnvidia-ml.so.1`` and calls its C entry
points, which answer NVML's documented structs and return codes for a fixed inventory (and, per
library, entry points an older or newer driver lacks, an unprivileged caller, a stuck call). The
scraped text is compared with that inventory. The pure parts (MIG profile names, CUDA ordinals,
what is exported, energy counting, readings to families) are tested without I/O.
``test_real_gpu_memory_matches_nvidia_smi`` runs where ``nvidia-smi`` is, against the real driver.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import time
import types
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluice.runtime import gpu_telemetry as gt
from sluice.runtime.settings import GpuMetricsSettings
from sluice_testing import fake_nvml
from sluice_testing.fake_nvml import FakeGpu, FakeMig

from .conftest import write_model  # type: ignore[import-not-found]

H100 = "NVIDIA H100 80GB HBM3"
MIB = 1024**2
GIB = 1024**3
needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="the fake NVML library is compiled with gcc")

TWO_GPUS = [  # memory_used: allocated; memory_reserved: what the driver keeps (v1's used counts both)
    FakeGpu(
        "GPU-0a1b2c3d-0000-4000-8000-000000000001", H100, 80 * GIB, 3 * GIB, utilization_gpu=37,
        utilization_memory=12, power_mw=123_456, power_limit_mw=700_000, temperature_c=41, energy_mj=5_000_000,
        memory_reserved=529 * MIB,
    ),
    FakeGpu(
        "GPU-0a1b2c3d-0000-4000-8000-000000000002", H100, 80 * GIB, 7 * GIB, utilization_gpu=90,
        utilization_memory=55, power_mw=650_000, power_limit_mw=700_000, temperature_c=67, energy_mj=9_000_000,
        not_supported=frozenset({"nvmlDeviceGetPowerUsage", "nvmlDeviceGetTemperature"}), memory_reserved=531 * MIB,
    ),
]  # fmt: skip

SLICE_1G = FakeMig("MIG-11111111-2222-4333-8444-555555555555", f"{H100} MIG 1g.10gb", 9, 0, 10 * GIB, 300 * 2**20)
SLICE_1G_ME = FakeMig("MIG-66666666-2222-4333-8444-555555555555", f"{H100} MIG 1g.10gb+me", 10, 0, 10 * GIB, 0)
SLICE_3G = FakeMig(  # its name is NOT_SUPPORTED here: the profile comes from its attributes
    "MIG-77777777-2222-4333-8444-555555555555", "", 2, 0, 40 * GIB, 5 * GIB, gpu_slices=3, compute_slices=3,
    memory_size_mb=40_192, not_supported=frozenset({"nvmlDeviceGetName"}),
)  # fmt: skip
MIG_GPU = FakeGpu(
    "GPU-0a1b2c3d-0000-4000-8000-0000000000ff", H100, 80 * GIB, 6 * GIB, power_mw=200_000, power_limit_mw=700_000,
    temperature_c=35, energy_mj=1_000, mig_slots=(SLICE_3G, None, SLICE_1G, SLICE_1G_ME, None, None, None),
)  # fmt: skip

GPU_MODEL_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.zeros(1, np.float32))]) for _ in requests]
"""


def gpu_model_config(name: str, count: int, gpus: list[int]) -> str:
    return (
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
        'output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
        f"instance_group [ {{ kind: KIND_GPU, count: {count}, gpus: {gpus} }} ]\n"
    )


# -- the server, started as a user starts it ------------------------------------------------------


class Sluice(types.SimpleNamespace):
    metrics_port: int
    log: Path

    def scrape(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            text = response.read().decode()
        list(text_string_to_metric_families(text))  # what Prometheus would read: it parses
        return text

    def log_lines(self, needle: str) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if needle in line]


@contextlib.contextmanager
def sluice(tmp: Path, library: Path | None, *flags: str, env: dict[str, str] | None = None) -> Iterator[Sluice]:
    """``sluice serve`` with ``library`` (a directory holding libnvidia-ml.so.1) first on the loader's path."""
    repo = tmp / "repo"
    repo.mkdir(exist_ok=True)
    environ = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES")}
    if library is not None:
        environ["LD_LIBRARY_PATH"] = str(library)
    environ.update(env or {})
    log = tmp / "server.log"
    command = [sys.executable, "-m", "sluice.runtime", "serve", "--model-repository", str(repo), "--http-port", "0",
               "--grpc-port", "0", "--metrics-port", "0", "--drain-period-s", "0", *flags]  # fmt: skip
    with log.open("w") as stderr:
        proc = subprocess.Popen(command, cwd=tmp, env=environ, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = re.search(r"metrics [^ ]+:(\d+)", line)
        assert found, f"no ready line: {line!r}\n{log.read_text()}"
        yield Sluice(metrics_port=int(found.group(1)), log=log)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()
    assert "Traceback" not in log.read_text()


def samples(text: str, family: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of one family as the text writes them: labels (sorted) -> value."""
    found = {}
    for line in text.splitlines():
        match = re.fullmatch(rf"{family}(?:\{{(.*)\}})? (\S+)", line)
        if match:
            labels = tuple(sorted(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(1) or "")))
            found[labels] = float(match.group(2))
    return found


def by_gpu(text: str, family: str) -> dict[str, float]:
    return {dict(labels)["gpu_uuid"]: value for labels, value in samples(text, family).items()}


def gpu_families(text: str) -> list[str]:
    names = re.findall(r"^# TYPE (\S+)", text, re.M)
    return sorted(name for name in names if name.startswith(("nv_", "sluice_gpu", "sluice_mig")))


# -- scenarios on the fake NVML library ----------------------------------------------------------


@pytest.fixture(scope="module")
def two_gpus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sluice]:
    if shutil.which("gcc") is None:
        pytest.skip("the fake NVML library is compiled with gcc")
    tmp = tmp_path_factory.mktemp("two_gpus")
    library = fake_nvml.build(tmp / "nvml", TWO_GPUS)
    write_model(tmp / "repo", "on_gpu1", gpu_model_config("on_gpu1", 2, [1]), {"model.py": GPU_MODEL_PY})
    write_model(tmp / "repo", "on_gpu0", gpu_model_config("on_gpu0", 1, [0]), {"model.py": GPU_MODEL_PY})
    with sluice(tmp, library, "--metrics-interval-ms", "3600000") as server:
        yield server


def test_two_gpus_report_tritons_families_with_nvmls_values(two_gpus):
    text = two_gpus.scrape()
    first, second = TWO_GPUS
    assert by_gpu(text, "nv_gpu_memory_total_bytes") == {g.uuid: g.memory_total for g in TWO_GPUS}
    # nvmlMemory_v2's used: allocated only, as nvidia-smi and DCGM show it (v1's would add the reserved memory)
    assert by_gpu(text, "nv_gpu_memory_used_bytes") == {g.uuid: g.memory_used for g in TWO_GPUS}
    assert by_gpu(text, "nv_gpu_utilization") == {g.uuid: g.utilization_gpu / 100 for g in TWO_GPUS}
    assert by_gpu(text, "sluice_gpu_memory_utilization") == {g.uuid: g.utilization_memory / 100 for g in TWO_GPUS}
    assert by_gpu(text, "nv_gpu_power_limit") == {g.uuid: g.power_limit_mw / 1000 for g in TWO_GPUS}
    assert by_gpu(text, "nv_gpu_power_usage")[first.uuid] == first.power_mw / 1000
    assert by_gpu(text, "sluice_gpu_temperature_celsius")[first.uuid] == first.temperature_c
    # energy counts from the server's start (Triton's meaning): one reading so far, so nothing yet
    assert by_gpu(text, "nv_energy_consumption") == {first.uuid: 0.0, second.uuid: 0.0}
    assert "# TYPE nv_energy_consumption counter" in text  # Triton's name, no _total
    info = {dict(k)["gpu_uuid"]: dict(k) for k in samples(text, "sluice_gpu_info")}
    assert info[second.uuid] == {"gpu_uuid": second.uuid, "gpu_index": "1", "name": H100, "mig_mode": "disabled"}
    assert not samples(text, "sluice_mig_device_info")
    assert two_gpus.log_lines("GPU metrics on: 2 GPU(s) read from NVML every 3600000 ms")


def test_a_field_nvml_does_not_support_drops_that_sample_only(two_gpus):
    text = two_gpus.scrape()
    first, second = TWO_GPUS
    assert set(by_gpu(text, "nv_gpu_power_usage")) == {first.uuid}
    assert set(by_gpu(text, "sluice_gpu_temperature_celsius")) == {first.uuid}
    # the same GPU's other fields are there
    assert by_gpu(text, "nv_gpu_power_limit")[second.uuid] == second.power_limit_mw / 1000
    assert by_gpu(text, "nv_gpu_utilization")[second.uuid] == second.utilization_gpu / 100


def test_model_instances_are_counted_on_the_gpu_they_were_placed_on(two_gpus):
    found = samples(two_gpus.scrape(), "sluice_gpu_model_instances")
    first, second = TWO_GPUS
    assert {tuple((k, v) for k, v in labels if k != "mig_uuid"): value for labels, value in found.items()} == {
        (("device", "1"), ("gpu_uuid", second.uuid), ("model", "on_gpu1"), ("version", "1")): 2.0,
        (("device", "0"), ("gpu_uuid", first.uuid), ("model", "on_gpu0"), ("version", "1")): 1.0,
    }


@needs_gcc
def test_a_driver_without_v2_memory_or_temperature_v_is_read_through_the_older_calls(tmp_path):
    old = frozenset({"nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetTemperatureV"})  # pynvml: FunctionNotFound
    library = fake_nvml.build(tmp_path / "nvml", TWO_GPUS, missing=old)
    with sluice(tmp_path, library, "--metrics-interval-ms", "3600000") as server:
        text = server.scrape()
    first = TWO_GPUS[0]
    # v1: what such a driver calls used is reserved + allocated
    assert by_gpu(text, "nv_gpu_memory_used_bytes") == {g.uuid: g.memory_used + g.memory_reserved for g in TWO_GPUS}
    assert by_gpu(text, "nv_gpu_memory_total_bytes") == {g.uuid: g.memory_total for g in TWO_GPUS}
    assert by_gpu(text, "sluice_gpu_temperature_celsius") == {first.uuid: first.temperature_c}


@needs_gcc
def test_a_driver_without_the_deprecated_temperature_call_is_read_through_temperature_v(tmp_path):
    """nvmlDeviceGetTemperature is deprecated ("will be removed in CUDA 14.0", pynvml): a driver with
    nvmlDeviceGetTemperatureV only still gives temperatures. A GPU whose v2 memory answers NOT_SUPPORTED
    is read through v1."""
    first, second = TWO_GPUS
    second = dataclasses.replace(second, not_supported=frozenset({"nvmlDeviceGetMemoryInfo_v2"}))
    library = fake_nvml.build(tmp_path / "nvml", [first, second], missing=frozenset({"nvmlDeviceGetTemperature"}))
    with sluice(tmp_path, library, "--metrics-interval-ms", "3600000") as server:
        text = server.scrape()
    assert by_gpu(text, "sluice_gpu_temperature_celsius") == {g.uuid: g.temperature_c for g in (first, second)}
    assert by_gpu(text, "nv_gpu_memory_used_bytes") == {
        first.uuid: first.memory_used,
        second.uuid: second.memory_used + second.memory_reserved,
    }


@needs_gcc
def test_an_h100_in_mig_mode_reports_each_slice(tmp_path):
    library = fake_nvml.build(tmp_path / "nvml", [MIG_GPU])
    write_model(tmp_path / "repo", "sliced", gpu_model_config("sliced", 1, [0]), {"model.py": GPU_MODEL_PY})
    with sluice(tmp_path, library, "--metrics-interval-ms", "3600000") as server:  # no CUDA_VISIBLE_DEVICES: all
        text = server.scrape()
        log = server.log_lines("GPU metrics on")
    mig = MIG_GPU.uuid
    # the whole GPU: memory, power and temperature; NVML has no utilization for a GPU in MIG mode
    assert by_gpu(text, "nv_gpu_memory_total_bytes") == {mig: MIG_GPU.memory_total}
    assert by_gpu(text, "nv_gpu_power_usage") == {mig: MIG_GPU.power_mw / 1000}
    assert not samples(text, "nv_gpu_utilization")
    assert {dict(k)["mig_mode"] for k in samples(text, "sluice_gpu_info")} == {"enabled"}
    expected = {
        SLICE_3G.uuid: ("2", "0", "3g.40gb", SLICE_3G),
        SLICE_1G.uuid: ("9", "0", "1g.10gb", SLICE_1G),
        SLICE_1G_ME.uuid: ("10", "0", "1g.10gb+me", SLICE_1G_ME),
    }
    memory = (("sluice_mig_memory_total_bytes", "memory_total"), ("sluice_mig_memory_used_bytes", "memory_used"))
    for family, field in memory:
        found = {dict(k)["mig_uuid"]: (dict(k), v) for k, v in samples(text, family).items()}
        assert set(found) == set(expected)
        for uuid, (gi, ci, profile, slice_) in expected.items():
            labels, value = found[uuid]
            assert labels == {"gpu_uuid": mig, "mig_uuid": uuid, "gpu_instance_id": gi,
                              "compute_instance_id": ci, "profile": profile}  # fmt: skip
            assert value == getattr(slice_, field)
    # CUDA enumerates one MIG device only, the first: device 0 is the slice in MIG slot 0
    (labels,) = samples(text, "sluice_gpu_model_instances")
    assert dict(labels)["mig_uuid"] == SLICE_3G.uuid and dict(labels)["gpu_uuid"] == mig
    (line,) = log
    assert line.endswith("GPU metrics on: 1 GPU(s) with 3 MIG device(s) read from NVML every 3600000 ms")


@needs_gcc
def test_cuda_visible_devices_narrows_the_exported_gpus_to_what_it_resolves_to(tmp_path):
    """As the device plugin gives a pod one slice, here in the pre-R470 form MIG-<GPU UUID>/<gi>/<ci>,
    with a whole GPU after it that CUDA does not enumerate beside a MIG device: only the slice and its
    GPU are exported (Triton exports only CUDA-visible GPUs), and CUDA device 0 is the slice."""
    whole = TWO_GPUS[0]
    library = fake_nvml.build(tmp_path / "nvml", [whole, MIG_GPU])
    write_model(tmp_path / "repo", "sliced", gpu_model_config("sliced", 1, [0]), {"model.py": GPU_MODEL_PY})
    legacy = f"MIG-{MIG_GPU.uuid}/{SLICE_1G.gpu_instance_id}/{SLICE_1G.compute_instance_id}"
    env = {"CUDA_VISIBLE_DEVICES": f"{legacy},{whole.uuid}"}
    with sluice(tmp_path, library, "--metrics-interval-ms", "3600000", env=env) as server:
        text = server.scrape()
        (line,) = server.log_lines("GPU metrics on")
    for family in ("nv_gpu_memory_total_bytes", "nv_gpu_power_limit", "nv_energy_consumption", "sluice_gpu_info"):
        assert set(by_gpu(text, family)) == {MIG_GPU.uuid}, family
    for family in ("sluice_mig_device_info", "sluice_mig_memory_used_bytes"):
        assert [dict(labels)["mig_uuid"] for labels in samples(text, family)] == [SLICE_1G.uuid], family
    (labels,) = samples(text, "sluice_gpu_model_instances")
    assert dict(labels) | {"model": "", "version": ""} == {
        "gpu_uuid": MIG_GPU.uuid, "mig_uuid": SLICE_1G.uuid, "device": "0", "model": "", "version": ""
    }  # fmt: skip
    assert line.endswith(f"2 GPU(s) with 3 MIG device(s) read from NVML every 3600000 ms; exported: 1 GPU(s) "
                         f"with 1 MIG device(s) (CUDA_VISIBLE_DEVICES={legacy},{whole.uuid})")  # fmt: skip


@needs_gcc
def test_an_unprivileged_process_in_mig_mode_has_no_gpu_memory_but_its_slices(tmp_path):
    """NVML answers a GPU in MIG mode's aggregate memory "only if the caller has appropriate privileges":
    a non-root pod gets NO_PERMISSION. The GPU then has no memory samples; its slices keep theirs, a
    slice's profile from its name, or from its attributes without the memory part."""
    library = fake_nvml.build(tmp_path / "nvml", [MIG_GPU], privileged=False)
    with sluice(tmp_path, library, "--metrics-interval-ms", "3600000") as server:
        text = server.scrape()
    assert not samples(text, "nv_gpu_memory_total_bytes") and not samples(text, "nv_gpu_memory_used_bytes")
    assert by_gpu(text, "nv_gpu_power_usage") == {MIG_GPU.uuid: MIG_GPU.power_mw / 1000}  # the rest is there
    profiles = {dict(labels)["mig_uuid"]: dict(labels)["profile"] for labels in samples(text, "sluice_mig_device_info")}
    assert profiles == {SLICE_3G.uuid: "3g", SLICE_1G.uuid: "1g.10gb", SLICE_1G_ME.uuid: "1g.10gb+me"}
    used = {dict(labels)["mig_uuid"]: value for labels, value in samples(text, "sluice_mig_memory_used_bytes").items()}
    assert used == {s.uuid: s.memory_used for s in (SLICE_3G, SLICE_1G, SLICE_1G_ME)}


@needs_gcc
def test_nvml_failing_to_start_means_no_gpu_families_and_one_log_line(tmp_path):
    library = fake_nvml.build(tmp_path / "nvml", TWO_GPUS, init_rc=fake_nvml.NVML_ERROR_DRIVER_NOT_LOADED)
    with sluice(tmp_path, library) as server:
        text = server.scrape()
        assert gpu_families(text) == []
        assert "# TYPE sluice_model_load_state gauge" in text  # the rest of the metrics are there
        (line,) = server.log_lines("GPU metrics")
        assert "GPU metrics off: NVML did not start: Driver Not Loaded" in line


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None, reason="a real NVML library is installed")
def test_no_nvml_library_means_no_gpu_families_and_one_log_line(tmp_path):
    (tmp_path / "empty").mkdir()
    with sluice(tmp_path, tmp_path / "empty") as server:
        assert gpu_families(server.scrape()) == []
        (line,) = server.log_lines("GPU metrics")
        assert "GPU metrics off: NVML did not start: NVML Shared Library Not Found" in line


@needs_gcc
def test_allow_gpu_metrics_false_turns_them_off(tmp_path):
    library = fake_nvml.build(tmp_path / "nvml", TWO_GPUS)
    with sluice(tmp_path, library, "--allow-gpu-metrics", "false") as server:
        assert gpu_families(server.scrape()) == []
        assert len(server.log_lines("GPU metrics off: --allow-gpu-metrics false")) == 1


@needs_gcc
def test_nvml_is_read_again_every_interval_and_energy_counts_on_across_a_counter_reset(tmp_path):
    """Energy grows by 1 J at each NVML reading: the scraped count grows without a scrape asking NVML.
    At the 4th reading the GPU's counter starts again from 0 (a GPU reset; 1 kJ counted before it):
    the count neither drops nor stalls, it goes on by each reading's increase."""
    gpu = FakeGpu("GPU-0a1b2c3d-0000-4000-8000-00000000abcd", H100, 80 * GIB, 0, energy_mj=1_000_000,
                  energy_step_mj=1000, energy_reset_at_call=4)  # fmt: skip
    library = fake_nvml.build(tmp_path / "nvml", [gpu])
    with sluice(tmp_path, library, "--metrics-interval-ms", "50") as server:
        deadline = time.monotonic() + 20
        seen: list[float] = []
        while time.monotonic() < deadline and (not seen or seen[-1] < 6):
            seen.append(by_gpu(server.scrape(), "nv_energy_consumption")[gpu.uuid])
            time.sleep(0.05)
    assert seen[-1] >= 6, seen
    assert all(value == int(value) for value in seen), seen  # whole readings, 1 J each
    assert seen == sorted(seen)


CLOSE_WHILE_STUCK = """
import logging, sys, threading, time
from pathlib import Path
import pynvml
from sluice.runtime import gpu_telemetry as gt
from sluice.runtime.settings import GpuMetricsSettings

logging.basicConfig(level=logging.INFO)
stuck = Path(sys.argv[1])
telemetry = gt.GpuTelemetry(GpuMetricsSettings(interval_ms=20), stop_timeout_s=0.2)
telemetry.start()
(reader,) = [thread for thread in threading.enumerate() if thread.name == "sluice-gpu-telemetry"]
stuck.touch()
time.sleep(0.5)  # the reading thread is inside nvmlDeviceGetCount_v2 now, and stays there
telemetry.close()
print(f"closed; reader alive: {reader.is_alive()}; families: {telemetry.families()}")
stuck.unlink()  # the call returns
reader.join(10)
print("reader alive:", reader.is_alive())
try:
    pynvml.nvmlDeviceGetCount()
    print("NVML initialised")
except pynvml.NVMLError_Uninitialized:
    print("NVML shut down")
"""


@needs_gcc
def test_close_while_an_nvml_call_is_stuck_leaves_the_shutdown_to_the_reading_thread(tmp_path):
    """close() waits stop_timeout_s for the reading thread; a call stuck longer (a lost GPU) must not
    see NVML shut down under it, nor the thread fail when it returns: the thread shuts NVML down then."""
    stuck = tmp_path / "stuck"
    library = fake_nvml.build(tmp_path / "nvml", TWO_GPUS[:1], block_while=stuck)
    env = {**os.environ, "LD_LIBRARY_PATH": str(library), "PYTHONSAFEPATH": "1"}
    done = subprocess.run([sys.executable, "-c", CLOSE_WHILE_STUCK, str(stuck)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["closed; reader alive: True; families: []", "reader alive: False",
                                        "NVML shut down"], done.stderr  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr
    assert "GPU metrics: an NVML call has not returned in 0.2 s; NVML is shut down when it does" in done.stderr
    assert "GPU metrics: the stuck NVML call returned; NVML shut down" in done.stderr


# -- the real GPU ----------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs an NVIDIA GPU and driver: no nvidia-smi here")
def test_real_gpu_memory_matches_nvidia_smi(tmp_path):
    """Total memory exactly; used memory (v2: allocated, without the driver's reserve, as nvidia-smi's
    memory.used) within 64 MiB of what nvidia-smi says just before and after the scrape."""
    pytest.importorskip("pynvml", reason="needs nvidia-ml-py (the gpu extra)")

    def smi() -> dict[str, tuple[int, int | None]]:
        query = subprocess.run(
            ["nvidia-smi", "--query-gpu=uuid,memory.total,memory.used", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        rows = (line.split(",") for line in query.stdout.strip().splitlines())
        return {uuid.strip(): (int(total), int(used) if used.strip().isdigit() else None) for uuid, total, used in rows}

    before = smi()
    with sluice(tmp_path, None, env={"LD_LIBRARY_PATH": os.environ.get("LD_LIBRARY_PATH", "")}) as server:
        text = server.scrape()
    after = smi()
    found = {uuid: int(value) // MIB for uuid, value in by_gpu(text, "nv_gpu_memory_total_bytes").items()}
    assert found == {uuid: total for uuid, (total, _) in before.items()}
    assert set(by_gpu(text, "nv_gpu_power_limit")) == set(before)
    for uuid, used in by_gpu(text, "nv_gpu_memory_used_bytes").items():
        seen = [mib for mib in (before[uuid][1], after[uuid][1]) if mib is not None]
        if seen:
            assert min(seen) - 64 <= used // MIB <= max(seen) + 64, (uuid, used // MIB, seen)


# -- pure parts ----------------------------------------------------------------------------------


# GPU memory as nvidia-smi's memory.total shows it; MIG slice memory (nvmlDeviceGetAttributes' memorySizeMB) as
# `nvidia-smi mig -lgip` lists the profile (H200's 3g/4g.71gb: a size within their 4/8 of the GPU)
H100_80GB, A100_40GB, H200, H100_NVL = 81559 * MIB, 40960 * MIB, 143771 * MIB, 95830 * MIB


@pytest.mark.parametrize(
    ("gpu_memory", "name", "attributes", "expected"),
    [
        (H100_80GB, f"{H100} MIG 1g.10gb", None, "1g.10gb"),
        (H100_80GB, f"{H100} MIG 1g.10gb+me", None, "1g.10gb+me"),
        (A100_40GB, "NVIDIA A100-SXM4-40GB MIG 3g.20gb", None, "3g.20gb"),
        (None, f"{H100} MIG 1g.10gb", None, "1g.10gb"),  # the name needs no GPU memory
        # from attributes, as go-nvlib: the share rounded up to eighths of the GPU, times its GiB rounded up
        (H100_80GB, "", (1, 1, 9_856), "1g.10gb"),
        (H100_80GB, "", (3, 3, 40_192), "3g.40gb"),
        (H100_80GB, "", (3, 1, 40_192), "1c.3g.40gb"),  # a compute instance smaller than its GPU instance
        (H100_80GB, "", (7, 7, 80_000), "7g.80gb"),
        (A100_40GB, "", (1, 1, 4_864), "1g.5gb"),
        (A100_40GB, "", (3, 3, 20_096), "3g.20gb"),
        (A100_40GB, "", (7, 7, 40_448), "7g.40gb"),
        (H200, "", (1, 1, 16_384), "1g.18gb"),
        (H200, "", (2, 2, 33_280), "2g.35gb"),
        (H200, "", (3, 3, 68_096), "3g.71gb"),  # 4/8 of 141 GiB = 70.5: rounded away from zero (round(): 70)
        (H200, "", (4, 4, 68_096), "4g.71gb"),
        (H200, "", (7, 7, 143_360), "7g.141gb"),
        (H100_NVL, "", (1, 1, 10_880), "1g.12gb"),
        (H100_NVL, "", (1, 1, 22_016), "1g.24gb"),
        (H100_NVL, "", (2, 2, 22_016), "2g.24gb"),  # 2/8 of 94 GiB (95830 MiB rounded up) = 23.5
        (H100_NVL, "", (3, 3, 47_232), "3g.47gb"),
        (H100_NVL, "", (7, 7, 95_232), "7g.94gb"),
        # no GPU memory (NVML's NO_PERMISSION to an unprivileged caller in MIG mode): the slices only
        (None, "", (3, 3, 40_192), "3g"),
        (None, "", (3, 1, 40_192), "1c.3g"),
        (H100_80GB, "", None, ""),
        (H100_80GB, H100, None, ""),  # a name without a profile, and no attributes
    ],
)
def test_mig_profile(gpu_memory, name, attributes, expected):
    attrs = None
    if attributes is not None:
        gi, ci, mb = attributes
        attrs = types.SimpleNamespace(gpuInstanceSliceCount=gi, computeInstanceSliceCount=ci, memorySizeMB=mb)
    assert gt.mig_profile(name, attrs, gpu_memory) == expected


def test_mig_memory_gb_agrees_with_go_nvlibs_own_table():
    """go-nvlib's TestGetMigMemorySizeGB: on 24, 40 and 80 GiB GPUs, each slice size in steps of 1/32 GiB
    is named by the smallest eighth of the GPU that holds it."""
    for total in (24 * GIB, 40 * GIB, 80 * GIB):
        eighth = total // 8
        for size in range(GIB // 32, total + 1, GIB // 32):
            expected = next(bound for bound in range(eighth, total + 1, eighth) if size <= bound) // GIB
            assert gt.mig_memory_gb(size // MIB, total) == expected, (total, size)


@pytest.mark.parametrize(
    ("value", "expected"), [(70.5, 71), (23.5, 24), (2.5, 3), (-2.5, -3), (0.49999999999999994, 0), (7.4, 7)]
)
def test_go_round_takes_halves_away_from_zero(value, expected):
    assert gt.go_round(value) == expected


PLAIN = [gt.GpuReading(0, "GPU-aaaa-1"), gt.GpuReading(1, "GPU-bbbb-2", mig_enabled=False)]
MIG_X, MIG_Y = gt.MigReading("MIG-x", 1, 0), gt.MigReading("MIG-y", 2, 0)
SLICED = gt.GpuReading(2, "GPU-cccc-3", mig_enabled=True, migs=(MIG_X, MIG_Y))


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        # CUDA enumerates one MIG device, the first one visible, and then no whole GPU beside it
        (None, {0: ("GPU-cccc-3", "MIG-x")}),
        ("1,0", {0: ("GPU-bbbb-2", ""), 1: ("GPU-aaaa-1", "")}),
        ("GPU-bbbb", {0: ("GPU-bbbb-2", "")}),  # a unique prefix, as CUDA accepts
        ("MIG-y", {0: ("GPU-cccc-3", "MIG-y")}),
        ("MIG-y,MIG-x", {0: ("GPU-cccc-3", "MIG-y")}),
        ("0,MIG-y,1", {0: ("GPU-cccc-3", "MIG-y")}),
        ("2", {0: ("GPU-cccc-3", "MIG-x")}),  # a GPU in MIG mode stands for its MIG devices
        ("MIG-GPU-cccc-3/2/0", {0: ("GPU-cccc-3", "MIG-y")}),  # before R470: <GPU UUID>/<gi>/<ci>
        ("MIG-GPU-cccc-3/2/1,0", {}),  # no such compute instance: it names nothing, and ends the list
        ("MIG-GPU-cccc-3/2", {}),
        ("0,7,1", {0: ("GPU-aaaa-1", "")}),  # CUDA stops at the first entry that names nothing
        ("GPU-", {}),  # ambiguous
        ("", {}),
    ],
)
def test_cuda_devices(visible, expected):
    assert gt.cuda_devices([*PLAIN, SLICED], visible) == expected


def test_without_mig_devices_cuda_enumerates_every_whole_gpu():
    assert gt.cuda_devices(PLAIN, None) == {0: ("GPU-aaaa-1", ""), 1: ("GPU-bbbb-2", "")}


def test_a_gpu_in_mig_mode_without_instances_is_no_cuda_device():
    empty = gt.GpuReading(0, "GPU-mig-no-slices", mig_enabled=True)
    assert gt.cuda_devices([empty, PLAIN[0]], None) == {0: ("GPU-aaaa-1", "")}


@pytest.mark.parametrize(
    ("visible", "gpus", "migs"),
    [
        (None, ["GPU-aaaa-1", "GPU-bbbb-2", "GPU-cccc-3"], ["MIG-x", "MIG-y"]),  # unset: all NVML sees
        ("1", ["GPU-bbbb-2"], []),
        ("GPU-bbbb,GPU-aaaa", ["GPU-aaaa-1", "GPU-bbbb-2"], []),
        ("MIG-y", ["GPU-cccc-3"], ["MIG-y"]),  # the slice and its GPU, not the GPU's other slices
        ("0,MIG-y", ["GPU-cccc-3"], ["MIG-y"]),  # CUDA does not see GPU 0 beside a MIG device
        ("", [], []),
    ],
)
def test_cuda_visible_devices_picks_the_gpus_and_mig_devices_exported(visible, gpus, migs):
    found = {f.name: f.samples for f in gt.families(gt.Snapshot((*PLAIN, SLICED)), visible=visible)}
    assert [dict(s.labels)["gpu_uuid"] for s in found.get("sluice_gpu_info", ())] == gpus
    assert [dict(s.labels)["mig_uuid"] for s in found.get("sluice_mig_device_info", ())] == migs


def test_the_older_nvml_call_is_tried_only_where_it_may_answer():
    pynvml = pytest.importorskip("pynvml", reason="needs nvidia-ml-py (the gpu extra)")
    tried = {
        code: gt.older_call_may_answer(pynvml, pynvml.NVMLError(getattr(pynvml, code)))
        for code in ("NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_ERROR_NOT_SUPPORTED",
                     "NVML_ERROR_ARGUMENT_VERSION_MISMATCH", "NVML_ERROR_NO_PERMISSION", "NVML_ERROR_GPU_IS_LOST")
    }  # fmt: skip
    assert tried == {
        "NVML_ERROR_FUNCTION_NOT_FOUND": True,  # a driver older than the call
        "NVML_ERROR_NOT_SUPPORTED": True,
        "NVML_ERROR_ARGUMENT_VERSION_MISMATCH": True,  # a driver that does not know the struct's version
        "NVML_ERROR_NO_PERMISSION": False,  # v1 would be refused the same
        "NVML_ERROR_GPU_IS_LOST": False,
    }


def test_energy_counts_each_increase_and_a_reset_from_zero():
    readings = [9_000, 9_500, 9_500, 9_800, 300, 700, 0, 50]  # the counter reset after 9_800, and after 700
    counted, last, counts = 0, None, []
    for reading in readings:
        counted, last = gt.count_energy(counted, last, reading), reading
        counts.append(counted)
    assert counts == [0, 500, 500, 800, 1_100, 1_500, 1_500, 1_550]


def test_families_convert_units_and_leave_out_what_nvml_did_not_answer():
    gpu = gt.GpuReading(0, "GPU-a", name="G", utilization_percent=50, power_mw=1500, energy_mj=7_500)
    snapshot = gt.Snapshot((gpu,), {"GPU-a": 5_000})  # counted since the server started
    found = {f.name: (f.kind, [(dict(s.labels), s.value) for s in f.samples]) for f in gt.families(snapshot)}
    assert found == {
        "sluice_gpu_info": ("gauge", [({"gpu_uuid": "GPU-a", "gpu_index": "0", "name": "G", "mig_mode": ""}, 1)]),
        "nv_gpu_utilization": ("gauge", [({"gpu_uuid": "GPU-a"}, 0.5)]),
        "nv_gpu_power_usage": ("gauge", [({"gpu_uuid": "GPU-a"}, 1.5)]),
        "nv_energy_consumption": ("counter", [({"gpu_uuid": "GPU-a"}, 5.0)]),
    }


def test_model_instances_on_a_device_nvml_does_not_see_keep_their_count():
    snapshot = gt.Snapshot((gt.GpuReading(0, "GPU-a"),), {})
    (family,) = [f for f in gt.families(snapshot, [("m", 2, 0), ("m", 2, 3), ("m", 2, 3)]) if "instances" in f.name]
    assert {(dict(s.labels)["device"], dict(s.labels)["gpu_uuid"], s.value) for s in family.samples} == {
        ("0", "GPU-a", 1),
        ("3", "", 2),
    }


def test_telemetry_that_cannot_load_nvml_reports_nothing(caplog):
    def unavailable() -> object:
        raise gt.NvmlUnavailable("no driver here")

    telemetry = gt.GpuTelemetry(GpuMetricsSettings(), load=unavailable)
    with caplog.at_level("INFO", logger="sluice.runtime.gpu_telemetry"):
        telemetry.start()
    assert telemetry.families([("m", 1, 0)]) == []
    assert [r.getMessage() for r in caplog.records] == ["GPU metrics off: no driver here"]
    telemetry.close()


def test_telemetry_turned_off_never_loads_nvml():
    def must_not_load() -> object:
        raise AssertionError("NVML loaded with --allow-gpu-metrics false")

    telemetry = gt.GpuTelemetry(GpuMetricsSettings(enabled=False), load=must_not_load)
    telemetry.start()
    assert telemetry.families() == []
    telemetry.close()
