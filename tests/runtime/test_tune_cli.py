"""``sluice tune`` end to end on a tiny ONNX model: a real in-process server, real load, short budgets.

The budget is checked with the clock the run is given (every reading it takes stays within the
budget), not with wall-clock assertions on the machine's speed.
"""

from __future__ import annotations

import asyncio
import io
import json
import time

import pytest
import tritonclient.grpc as grpcclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from sluice.runtime import tune
from sluice.runtime import tune_plan as plan
from sluice.runtime.__main__ import main

from .conftest import ADD_SUB_CONFIG, BUILDERS, start_server, write_model  # type: ignore[import-not-found]

# A deliberately poor starting point: fixed wait for a batch of 8 that 1-4 clients never fill, so
# every request waits the whole 20 ms delay; any other candidate beats it.
SLOW_MLP = """# tuned by the test
name: "mlp"
platform: "onnxruntime_onnx"
max_batch_size: 8
dynamic_batching {
  preferred_batch_size: [ 8 ]
  max_queue_delay_microseconds: 20000
}
parameters { key: "batch_policy" value { string_value: "fixed_wait" } }
"""


class RecordingClock:
    def __init__(self) -> None:
        self.readings: list[float] = []

    def __call__(self) -> float:
        now = time.monotonic()
        self.readings.append(now)
        return now


def run(settings: tune.TuneSettings, clock=time.monotonic) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = asyncio.run(tune.run(settings, out=out, err=err, clock=clock))
    return code, out.getvalue(), err.getvalue()


def test_tune_finds_a_better_config_within_budget_and_apply_writes_one_the_server_loads(tmp_path):
    repo = tmp_path / "repo"
    model_dir = write_model(repo, "mlp", SLOW_MLP, {"model.onnx": BUILDERS.mlp_model()})
    clock = RecordingClock()
    budget = 12.0
    settings = tune.TuneSettings(
        model_repository=repo, model="mlp", latency_budget_ms=1000, time_budget_s=budget, concurrency=(1, 4),
        space=plan.SearchSpace(max_instances=2, delays_us=(500,)),
        durations=plan.Durations(cost_s=0.2, warmup_s=0.1, point_s=0.4), apply=True,
        json_path=tmp_path / "result.json",
    )
    code, out, err = run(settings, clock)
    assert code == tune.EXIT_OK, out + err
    assert clock.readings[-1] - clock.readings[0] <= budget
    # progress on stderr: the cost curve, the measured points, each with the time used of the budget
    assert "cost curve 1/4: batch 1:" in err and "/12s] measuring" in err
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("config "))
    assert lines[header].split() == ["config", "conc", "inf/s", "p50", "ms", "p99", "ms", "batch", "errors", "within"]
    result = json.loads((tmp_path / "result.json").read_text())
    best = result["best"]
    assert best["config"] != {"policy": "fixed_wait", "instances": 1, "preferred": [8], "delay_us": 20000}
    assert f"best (p99 <= 1000 ms): {best['label']} at concurrency {best['concurrency']}" in out
    assert len(result["measured"]) >= 2
    assert "--- mlp/config.pbtxt\n+++ mlp/config.pbtxt (tuned)\n" in out
    assert "wrote mlp/config.pbtxt (the old one is config.pbtxt.bak)" in out
    assert (model_dir / "config.pbtxt.bak").read_text() == SLOW_MLP
    written = (model_dir / "config.pbtxt").read_text()
    assert written.startswith("# tuned by the test\n")
    on_disk = text_format.Parse(written, mc.ModelConfig())
    want = best["config"]
    assert plan.batching_of(on_disk, "work_conserving") == plan.BatchingConfig(
        want["policy"], want["instances"],
        tuple(want["preferred"]) if want["policy"] == "fixed_wait" else (8,),
        want["delay_us"] if want["policy"] == "fixed_wait" else 20000,
    )
    # the written file is what a server started on the repository now serves
    running = start_server(repo)
    try:
        client = grpcclient.InferenceServerClient(running.grpc)
        served = client.get_model_config("mlp").config
        assert plan.batching_of(served, "work_conserving") == plan.batching_of(on_disk, "work_conserving")
        assert client.is_model_ready("mlp")
    finally:
        running.stop()


def test_a_model_that_does_not_batch_and_a_latency_budget_nothing_meets(tmp_path):
    repo = tmp_path / "repo"
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    settings = tune.TuneSettings(
        model_repository=repo, model="add_sub", latency_budget_ms=0.001, time_budget_s=8, concurrency=(1, 2),
        space=plan.SearchSpace(max_instances=2), durations=plan.Durations(cost_s=0.2, warmup_s=0.1, point_s=0.3),
    )
    code, out, err = run(settings)
    assert code == tune.EXIT_LATENCY, out + err
    assert "max_batch_size 0 (it does not batch): only the instance count is tuned" in err
    assert "no measured config met the latency budget (p99 <= 0.001 ms); closest: " in out
    assert "instance" in out.split("closest: ")[1]


def test_unknown_model_names_the_models_there(tmp_path, capsys):
    repo = tmp_path / "repo"
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    code = main(["tune", "--model-repository", str(repo), "--model", "nope", "--time-budget", "30s"])
    assert code == tune.EXIT_MODEL
    err = capsys.readouterr().err
    assert "unknown model 'nope'" in err and "models there: add_sub" in err
    assert str(tmp_path) not in err.replace(str(repo), "")  # no other server path


def test_a_time_budget_too_small_is_refused_at_once(tmp_path, capsys):
    repo = tmp_path / "repo"
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    started = time.monotonic()
    code = main(["tune", "--model-repository", str(repo), "--model", "add_sub", "--time-budget", "2s"])
    assert code == tune.EXIT_BUDGET
    assert time.monotonic() - started < 2
    assert "--time-budget 2s is too small to measure anything; allowed: at least" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--time-budget", "5x", "is not a duration; allowed"),
    ("--concurrency", "0,4", "allowed: comma-separated integers >= 1"),
    ("--latency-budget-ms", "-3", "is negative"),
    ("--protocol", "udp", "invalid choice"),
    ("--max-instances", "0", "allowed: int > 0"),
    ("--point-s", "nan", "is not finite"),
    ("--latency-budget-ms", "nan", "is not finite"),
    ("--cost-s", "inf", "is not finite"),
])
def test_bad_arguments_exit_2_naming_what_is_allowed(tmp_path, capsys, flag, value, message):
    with pytest.raises(SystemExit) as caught:
        main(["tune", "--model-repository", str(tmp_path), "--model", "m", flag, value])
    assert caught.value.code == 2
    assert message in capsys.readouterr().err
