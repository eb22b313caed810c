"""GPU and MIG telemetry (gpu_telemetry.py) on the metrics port.

On a machine without a GPU the real ``sluice serve`` is started with a fake NVML *C library*
first on ``LD_LIBRARY_PATH`` (sluice_testing/fake_nvml.py, compiled with gcc here): nvidia-ml-py's
own ``pynvml`` loads it as it loads the driver's ``libnvidia-ml.so.1`` and calls its C entry
points, which answer NVML's documented structs and return codes for a fixed inventory. The
scraped text is compared with that inventory. The pure parts (MIG profile names, CUDA ordinals,
readings to families) are tested without I/O. ``test_real_gpu_memory_matches_nvidia_smi`` runs
where ``nvidia-smi`` is, against the real driver.
"""

from __future__ import annotations

import contextlib
import ctypes.util
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
GIB = 1024**3
needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="the fake NVML library is compiled with gcc")

TWO_GPUS = [
    FakeGpu(
        "GPU-0a1b2c3d-0000-4000-8000-000000000001", H100, 80 * GIB, 3 * GIB, utilization_gpu=37,
        utilization_memory=12, power_mw=123_456, power_limit_mw=700_000, temperature_c=41, energy_mj=5_000_000,
    ),
    FakeGpu(
        "GPU-0a1b2c3d-0000-4000-8000-000000000002", H100, 80 * GIB, 7 * GIB, utilization_gpu=90,
        utilization_memory=55, power_mw=650_000, power_limit_mw=700_000, temperature_c=67, energy_mj=9_000_000,
        not_supported=frozenset({"nvmlDeviceGetPowerUsage", "nvmlDeviceGetTemperature"}),
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
def test_an_h100_in_mig_mode_reports_each_slice(tmp_path):
    library = fake_nvml.build(tmp_path / "nvml", [MIG_GPU])
    write_model(tmp_path / "repo", "sliced", gpu_model_config("sliced", 1, [0]), {"model.py": GPU_MODEL_PY})
    env = {"CUDA_VISIBLE_DEVICES": SLICE_1G.uuid}  # as the device plugin gives a pod one slice
    with sluice(tmp_path, library, "--metrics-interval-ms", "3600000", env=env) as server:
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
    # CUDA device 0 of this process is the slice CUDA_VISIBLE_DEVICES names
    (labels,) = samples(text, "sluice_gpu_model_instances")
    assert dict(labels)["mig_uuid"] == SLICE_1G.uuid and dict(labels)["gpu_uuid"] == mig
    (line,) = log
    assert "GPU metrics on: 1 GPU(s) with 3 MIG device(s)" in line


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
def test_nvml_is_read_again_every_interval(tmp_path):
    """Energy grows by 1 J at each NVML reading: the scraped count grows without a scrape asking NVML."""
    gpu = FakeGpu("GPU-0a1b2c3d-0000-4000-8000-00000000abcd", H100, 80 * GIB, 0, energy_mj=10_000, energy_step_mj=1000)
    library = fake_nvml.build(tmp_path / "nvml", [gpu])
    with sluice(tmp_path, library, "--metrics-interval-ms", "50") as server:
        deadline = time.monotonic() + 20
        seen: list[float] = []
        while time.monotonic() < deadline and (not seen or seen[-1] < 3):
            seen.append(by_gpu(server.scrape(), "nv_energy_consumption")[gpu.uuid])
            time.sleep(0.05)
    assert seen[-1] >= 3, seen
    assert all(value == int(value) for value in seen), seen  # whole readings, 1 J each
    assert seen == sorted(seen)


# -- the real GPU ----------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs an NVIDIA GPU and driver: no nvidia-smi here")
def test_real_gpu_memory_matches_nvidia_smi(tmp_path):
    pytest.importorskip("pynvml", reason="needs nvidia-ml-py (the gpu extra)")
    query = subprocess.run(
        ["nvidia-smi", "--query-gpu=uuid,memory.total", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    expected = {uuid.strip(): int(mib) for uuid, mib in (line.split(",") for line in query.stdout.strip().splitlines())}
    with sluice(tmp_path, None, env={"LD_LIBRARY_PATH": os.environ.get("LD_LIBRARY_PATH", "")}) as server:
        text = server.scrape()
    found = {uuid: int(value) // 2**20 for uuid, value in by_gpu(text, "nv_gpu_memory_total_bytes").items()}
    assert found == expected
    assert set(by_gpu(text, "nv_gpu_power_limit")) == set(expected)


# -- pure parts ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "attributes", "expected"),
    [
        (f"{H100} MIG 1g.10gb", None, "1g.10gb"),
        (f"{H100} MIG 1g.10gb+me", None, "1g.10gb+me"),
        ("NVIDIA A100-SXM4-40GB MIG 3g.20gb", None, "3g.20gb"),
        ("", (1, 1, 9_856), "1g.10gb"),  # H100 80GB: slice memory rounded up to eighths of the GPU
        ("", (3, 3, 40_192), "3g.40gb"),
        ("", (3, 1, 40_192), "1c.3g.40gb"),  # a compute instance smaller than its GPU instance
        ("", (7, 7, 80_000), "7g.80gb"),
        ("", None, ""),
        (H100, None, ""),  # a name without a profile, and no attributes
    ],
)
def test_mig_profile(name, attributes, expected):
    attrs = None
    if attributes is not None:
        gi, ci, mb = attributes
        attrs = types.SimpleNamespace(gpuInstanceSliceCount=gi, computeInstanceSliceCount=ci, memorySizeMB=mb)
    assert gt.mig_profile(name, attrs, 80 * GIB) == expected


PLAIN = [gt.GpuReading(0, "GPU-aaaa-1"), gt.GpuReading(1, "GPU-bbbb-2", mig_enabled=False)]
SLICED = gt.GpuReading(2, "GPU-cccc-3", mig_enabled=True, migs=(gt.MigReading("MIG-x"), gt.MigReading("MIG-y")))


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        (None, {0: ("GPU-aaaa-1", ""), 1: ("GPU-bbbb-2", ""), 2: ("GPU-cccc-3", "MIG-x"), 3: ("GPU-cccc-3", "MIG-y")}),
        ("1,0", {0: ("GPU-bbbb-2", ""), 1: ("GPU-aaaa-1", "")}),
        ("GPU-bbbb", {0: ("GPU-bbbb-2", "")}),  # a unique prefix, as CUDA accepts
        ("MIG-y", {0: ("GPU-cccc-3", "MIG-y")}),
        ("0,7,1", {0: ("GPU-aaaa-1", "")}),  # CUDA stops at the first entry that names nothing
        ("GPU-", {}),  # ambiguous
        ("", {}),
    ],
)
def test_cuda_devices(visible, expected):
    assert gt.cuda_devices([*PLAIN, SLICED], visible) == expected


def test_a_gpu_in_mig_mode_without_instances_is_no_cuda_device():
    empty = gt.GpuReading(0, "GPU-mig-no-slices", mig_enabled=True)
    assert gt.cuda_devices([empty, PLAIN[0]], None) == {0: ("GPU-aaaa-1", "")}


def test_families_convert_units_and_leave_out_what_nvml_did_not_answer():
    gpu = gt.GpuReading(0, "GPU-a", name="G", utilization_percent=50, power_mw=1500, energy_mj=7_500)
    snapshot = gt.Snapshot((gpu,), {"GPU-a": 2_500})
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
