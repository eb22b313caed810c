"""The pure parts of bench/gpu_resnet.py and bench/gpu_memory.py: formed batches from the statistics,
the raw reference for a batch mix, the ratio and the tables (no timing), and a CPU smoke run."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"sluice_bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


resnet = _load("gpu_resnet")
memory = _load("gpu_memory")

STATS = {
    "name": "resnet50",
    "batch_stats": [
        {"batch_size": 4, "compute_infer": {"count": "10", "ns": "1000"}},
        {"batch_size": 16, "compute_infer": {"count": 5, "ns": 1000}},
        {"batch_size": 7, "compute_infer": {"count": 0, "ns": 0}},
    ],
}


def test_batch_counts_read_the_v2_statistics_and_skip_empty_sizes():
    assert resnet.batch_counts(STATS) == {4: 10, 16: 5}
    assert resnet.batch_counts({"name": "m"}) == {}


def test_counts_delta_and_mean_formed_batch():
    delta = resnet.counts_delta({4: 10, 16: 5}, {4: 12, 16: 5, 32: 3})
    assert delta == {4: 2, 32: 3}
    assert resnet.mean_batch(delta) == pytest.approx((4 * 2 + 32 * 3) / 5)
    assert resnet.mean_batch({}) == 0.0


def test_raw_rate_for_a_mix_pads_each_batch_to_its_graph():
    graph_ms = {1: 1.0, 4: 2.0, 16: 4.0}
    # 10 batches of 3 rows run on the 4-row graph (2 ms each), 5 of 16 on the 16-row graph (4 ms each)
    expected = (10 * 3 + 5 * 16) / ((10 * 2.0 + 5 * 4.0) / 1e3)
    assert resnet.raw_rate_for_mix({3: 10, 16: 5}, graph_ms) == pytest.approx(expected)
    assert resnet.raw_rate_for_mix({17: 1}, graph_ms) is None  # no graph that large
    assert resnet.raw_rate_for_mix({}, graph_ms) is None


def test_ratio_budget_and_sizes():
    assert resnet.ratio(850.0, 1000.0) == pytest.approx(0.85)
    assert resnet.ratio(1.0, None) is None
    assert resnet.p99_budget_ms({16: 3.0, 256: 20.0}, (16, 128), 500) == pytest.approx(2 * 20.0 + 0.5)
    assert resnet.p99_budget_ms({16: 3.0}, (), 500) is None
    assert resnet.capture_sizes(24, (6, 16)) == (1, 2, 4, 6, 8, 16, 24)
    assert resnet.parse_ints("1, 4,16") == (1, 4, 16)
    with pytest.raises(Exception, match="integers >= 1"):
        resnet.parse_ints("0,2")


@pytest.mark.parametrize(("values", "q", "expected"), [([5, 1, 3, 2, 4], 50, 3), (list(range(1, 101)), 99, 99)])
def test_percentile_by_nearest_rank(values, q, expected):
    assert resnet.percentile(values, q) == expected


def test_served_table_marks_the_target_and_the_p99_budget():
    rows = [
        resnet.ServedRow("grpc", 64, 900.0, 10.0, 30.0, {16: 10, 32: 10}, 1000.0),
        resnet.ServedRow("http", 64, 700.0, 12.0, 50.0, {16: 20}, 1000.0),
        resnet.ServedRow("http", 1, 100.0, 1.0, 2.0, {}, None),
    ]
    lines = resnet.served_table(rows, 41.0).splitlines()
    assert "p99 <= 41.00 ms" in lines[0]
    assert lines[2] == "| grpc | 64 | 900 | 10.00 | 30.00 | 24.0 | 1000 | 0.90 ok | yes |"
    assert lines[3] == "| http | 64 | 700 | 12.00 | 50.00 | 16.0 | 1000 | 0.70 low | no |"
    assert lines[4].endswith("| n/a | n/a | yes |")


def _model_stats(requests: int, executions: int, scale: int) -> dict:
    """Statistics after ``requests`` requests in ``executions`` batches of 4, each stage ``scale`` us."""
    stage = {"count": requests, "ns": requests * scale * 1000}
    per_batch = {"count": executions, "ns": executions * scale * 1000}
    return {
        "inference_stats": {name: dict(stage) for name in resnet.STAGES},
        "batch_stats": [
            {"batch_size": 4, "compute_input": per_batch, "compute_infer": per_batch, "compute_output": per_batch}
        ],
    }


def test_the_breakdown_is_per_request_means_and_execution_seconds_between_two_reads():
    spent = resnet.breakdown(_model_stats(40, 10, 100), _model_stats(80, 20, 100))
    assert spent.request_us == {name: pytest.approx(100.0) for name in resnet.STAGES}
    assert spent.executions == 10
    assert spent.exec_s == pytest.approx(10 * 3 * 100e-6)  # input + infer + output, 100 us each
    assert spent.exec_ms() == pytest.approx(0.3)
    assert spent.busy(0.003, 2) == pytest.approx(0.5)
    idle = resnet.breakdown(_model_stats(40, 10, 100), _model_stats(40, 10, 100))
    assert idle.executions == 0 and idle.exec_ms() is None
    assert all(v != v for v in idle.request_us.values())  # nan: no request in the window
    assert resnet.breakdown({}, {"name": "m"}).executions == 0  # a model not yet run has no stats


def test_time_table_sets_each_execution_against_the_raw_graph_time():
    spent = resnet.breakdown(_model_stats(0, 0, 100), _model_stats(40, 10, 100))
    row = resnet.ServedRow("grpc", 32, 900.0, 10.0, 30.0, {4: 10}, 4000.0, spent, 0.25)
    lines = resnet.time_table([row, resnet.ServedRow("http", 1, 1.0, 1.0, 1.0, {}, None)]).splitlines()
    assert len(lines) == 3  # the row without a breakdown is left out
    assert lines[2] == "| grpc | 32 | 100 | 100 | 100 | 100 | 0.30 | 1.00 | 25% |"


def test_profile_summary_shares_by_thread_and_by_sluices_innermost_frame():
    collapsed = "\n".join([
        "MainThread;run (asyncio/runners.py:118);_feed (sluice/runtime/protocol/grpc_h2.py:973);memmove 30",
        "MainThread;run (asyncio/runners.py:118);epoll_wait 10",
        "Thread-1;_main (sluice/runtime/batching.py:256);execute (sluice/runtime/backends/pytorch.py:640) 60",
        "not a sample line",
    ])
    lines = resnet.profile_summary(collapsed).splitlines()
    assert lines[0] == "100 samples"
    assert "| Thread-1 | 60% |" in lines and "| MainThread | 40% |" in lines
    assert "| execute (sluice/runtime/backends/pytorch.py:640) | 60.0% |" in lines
    assert "| _feed (sluice/runtime/protocol/grpc_h2.py:973) | 30.0% |" in lines
    assert "| epoll_wait | 10.0% |" in lines  # no Sluice frame: the innermost one
    assert resnet.profile_summary("") == "(no samples)"


def test_raw_table_and_perf_analyzer_csv():
    assert resnet.raw_table({2: 1.0, 8: 2.0}).splitlines()[2:] == ["| 2 | 1.000 | 2000 |", "| 8 | 2.000 | 4000 |"]
    csv_text = "Concurrency,Inferences/Second,p50 latency,p99 latency\n8,1234.5,2500,7000\n"
    assert resnet.parse_perf_analyzer_csv(csv_text) == (1234.5, 2.5, 7.0)


def test_the_served_config_is_a_valid_graphed_pytorch_config():
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    from sluice.runtime import config as model_config
    from sluice.runtime.backends.torch_graphs import graph_plan

    setup = resnet.Setup("cuda:0", 224, "FP16", 256, (16, 32, 64, 128, 256), 500)
    config = text_format.Parse(resnet.config_text(setup), mc.ModelConfig())
    assert model_config.validate(config, source="bench") == []
    plan = graph_plan(config)
    assert plan is not None and plan.batch_sizes == (16, 32, 64, 128, 256)
    assert config.instance_group[0].count == 1
    two = resnet.Setup("cuda:0", 224, "FP16", 256, (16, 32), 500, instances=2)
    assert text_format.Parse(resnet.config_text(two), mc.ModelConfig()).instance_group[0].count == 2
    cpu = text_format.Parse(resnet.config_text(resnet.Setup("cpu", 32, "FP32", 16, (4, 8), 500)), mc.ModelConfig())
    assert graph_plan(cpu) is None and cpu.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU


def test_per_instance_memory_is_the_slope_over_instance_counts():
    assert memory.per_instance({1: 1000, 2: 1600}) == pytest.approx(600)
    assert memory.per_instance({1: 1000, 2: 1600, 3: 2200}) == pytest.approx(600)
    assert memory.per_instance({1: 1000}) is None
    table = memory.memory_table([("weights", 100 * 2**20, None)]).splitlines()
    assert table[2] == "| weights | 100 | n/a |"


def test_process_memory_falls_back_on_the_devices_use_when_nvml_does_not_list_the_pid():
    assert memory.process_bytes((300, 5000), 1000) == 300  # NVML lists the pid: its figure
    assert memory.process_bytes((None, 5000), 1000) == 4000  # a container's pid: the device's growth
    assert memory.process_bytes((None, 900), 1000) == 0
    assert memory.process_bytes((None, 5000), None) is None
    assert memory.process_bytes(None, 1000) is None  # no NVML


def test_resnet50_is_resnet50():
    model = resnet.resnet50()
    assert sum(p.numel() for p in model.parameters()) == 25_557_032  # torchvision's resnet50 count


def test_the_bench_runs_on_the_cpu():
    """The smoke run (--device cpu --small): the raw table, then served rows or the reason they were skipped."""
    out = subprocess.run(
        [sys.executable, "-P", str(ROOT / "bench" / "gpu_resnet.py"), "--device", "cpu", "--small",
         "--mode", "raw", "--raw-s", "0.05"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| batch | ms per call | img/s |" in out.stdout
    assert [line.split("|")[1].strip() for line in out.stdout.splitlines() if line.startswith("| ")][1:] == [
        "1", "2", "4", "8", "16",
    ]  # fmt: skip
