"""Triton ensembles: the DAG planning on its own, then ensembles served by real servers on loopback.

The server tests talk to ``sluice.runtime.server.Server`` with tritonclient over HTTP and gRPC:
results equal the steps called by hand, parallel steps run concurrently, config errors name the
file and field, readiness follows the steps, step errors reach the client, remote steps are called
over gRPC on a second server, and the config the operator renders for a colocated ensemble loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from sluice.runtime import config as model_config
from sluice.runtime import ensemble
from sluice.runtime.errors import Cancelled, ConfigError, ModelError, SluiceError, Unavailable
from sluice.runtime.types import InferRequest, InferResponse, Tensor

from .conftest import ADD_SUB_CONFIG, BUILDERS, EXPLICIT, IDENTITY_PY, ROOT, Running, write_model

# --- models --------------------------------------------------------------------------------------

IDENTITY_FP32 = """
name: "identity_fp32"
backend: "python"
max_batch_size: 0
input [
  { name: "INPUT0", data_type: TYPE_FP32, dims: [ 16 ] },
  { name: "INPUT1", data_type: TYPE_FP32, dims: [ 16 ] }
]
output [
  { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 16 ] },
  { name: "OUTPUT1", data_type: TYPE_FP32, dims: [ 16 ] }
]
"""

IDENTITY_BYTES = """
name: "identity_bytes"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_STRING, dims: [ -1 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_STRING, dims: [ -1 ] } ]
"""

SLOW_CONFIG = """
name: "slow"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 16 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 16 ] } ]
instance_group [ { count: 2, kind: KIND_CPU } ]
"""

SLOW_PY = """
import os
import time
import uuid

import triton_python_backend_utils as pb_utils

HERE = os.path.dirname(__file__)


class TritonPythonModel:
    def execute(self, requests):
        # a rendezvous: go on only once the other step has started too (both instances run at once),
        # else fail after 10 s; whatever the machine's speed
        open(os.path.join(HERE, "started-" + uuid.uuid4().hex), "w").close()
        deadline = time.monotonic() + 10
        while sum(name.startswith("started-") for name in os.listdir(HERE)) % 2:
            if time.monotonic() > deadline:
                raise RuntimeError("the other step never started alongside this one")
            time.sleep(0.005)
        out = []
        for r in requests:
            data = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", data)]))
        return out
"""

CHECKER_CONFIG = """
name: "checker"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 16 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 16 ] } ]
"""

CHECKER_PY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            if (data < 0).any():
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("negative sum: " + str(data.min()))))
            else:
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", data)]))
        return out
"""

# add_sub, then identity on the sum: SUM = a + b, DIFF = a - b.
PIPELINE = """
name: "pipeline"
platform: "ensemble"
max_batch_size: 0
input [ { name: "A", data_type: TYPE_FP32, dims: [ 16 ] }, { name: "B", data_type: TYPE_FP32, dims: [ 16 ] } ]
output [ { name: "SUM", data_type: TYPE_FP32, dims: [ 16 ] }, { name: "DIFF", data_type: TYPE_FP32, dims: [ 16 ] } ]
ensemble_scheduling {
  step [
    {
      model_name: "identity_fp32"
      model_version: -1
      input_map { key: "INPUT0" value: "s" }
      input_map { key: "INPUT1" value: "d" }
      output_map { key: "OUTPUT0" value: "SUM" }
      output_map { key: "OUTPUT1" value: "DIFF" }
    },
    {
      model_name: "add_sub"
      model_version: 1
      input_map { key: "INPUT0" value: "A" }
      input_map { key: "INPUT1" value: "B" }
      output_map { key: "OUTPUT0" value: "s" }
      output_map { key: "OUTPUT1" value: "d" }
    }
  ]
}
"""

# x -> slow -> y1 and x -> slow -> y2 in parallel, then add_sub(y1, y2): OUT0 = 2x, OUT1 = 0.
DIAMOND = """
name: "diamond"
platform: "ensemble"
max_batch_size: 0
input [ { name: "X", data_type: TYPE_FP32, dims: [ 16 ] } ]
output [ { name: "OUT0", data_type: TYPE_FP32, dims: [ 16 ] }, { name: "OUT1", data_type: TYPE_FP32, dims: [ 16 ] } ]
ensemble_scheduling {
  step [
    { model_name: "slow" input_map { key: "INPUT0" value: "X" } output_map { key: "OUTPUT0" value: "y1" } },
    { model_name: "slow" input_map { key: "INPUT0" value: "X" } output_map { key: "OUTPUT0" value: "y2" } },
    {
      model_name: "add_sub" model_version: -1
      input_map { key: "INPUT0" value: "y1" } input_map { key: "INPUT1" value: "y2" }
      output_map { key: "OUTPUT0" value: "OUT0" } output_map { key: "OUTPUT1" value: "OUT1" }
    }
  ]
}
"""

TEXT_CHAIN = """
name: "text_chain"
platform: "ensemble"
max_batch_size: 0
input [ { name: "TEXT", data_type: TYPE_STRING, dims: [ -1 ] } ]
output [ { name: "ECHO", data_type: TYPE_STRING, dims: [ -1 ] } ]
ensemble_scheduling {
  step [
    { model_name: "identity_bytes" input_map { key: "INPUT0" value: "TEXT" } output_map { key: "OUTPUT0" value: "m" } },
    { model_name: "identity_bytes" input_map { key: "INPUT0" value: "m" } output_map { key: "OUTPUT0" value: "ECHO" } }
  ]
}
"""

CHECKED = """
name: "checked"
platform: "ensemble"
max_batch_size: 0
input [ { name: "A", data_type: TYPE_FP32, dims: [ 16 ] }, { name: "B", data_type: TYPE_FP32, dims: [ 16 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 16 ] } ]
ensemble_scheduling {
  step [
    {
      model_name: "add_sub" model_version: -1
      input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "B" }
      output_map { key: "OUTPUT0" value: "s" }
    },
    { model_name: "checker" input_map { key: "INPUT0" value: "s" } output_map { key: "OUTPUT0" value: "OUT" } }
  ]
}
"""


def _ensemble(name: str, steps: str, outputs: str = '{ name: "OUT", data_type: TYPE_FP32, dims: [ 16 ] }') -> str:
    return f"""
name: "{name}"
platform: "ensemble"
max_batch_size: 0
input [ {{ name: "A", data_type: TYPE_FP32, dims: [ 16 ] }} ]
output [ {outputs} ]
ensemble_scheduling {{
  step [ {steps} ]
}}
"""


def _step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = " ".join(f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items())
    maps += " " + " ".join(f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items())
    return f'{{ model_name: "{model}" model_version: -1 {maps} }}'


def write_ensemble(repo: Path, name: str, config: str, *, version_dir: bool = True) -> Path:
    model_dir = repo / name
    model_dir.mkdir(parents=True, exist_ok=True)
    if version_dir:
        (model_dir / "1").mkdir(exist_ok=True)  # Triton's convention; Sluice accepts it or none
    (model_dir / "config.pbtxt").write_text(config)
    return model_dir


def base_repo(repo: Path) -> Path:
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    write_model(repo, "identity_fp32", IDENTITY_FP32, {"model.py": IDENTITY_PY})
    write_model(repo, "identity_bytes", IDENTITY_BYTES, {"model.py": IDENTITY_PY})
    return repo


def fp32_inputs(module: object, a: np.ndarray, b: np.ndarray, names: tuple[str, str] = ("A", "B")) -> list:
    inputs = []
    for name, data in zip(names, (a, b), strict=True):
        entry = module.InferInput(name, list(data.shape), "FP32")  # type: ignore[attr-defined]
        entry.set_data_from_numpy(data)
        inputs.append(entry)
    return inputs


A = np.arange(16, dtype=np.float32)
B = np.full(16, 3.0, dtype=np.float32)


# --- planning, without I/O -----------------------------------------------------------------------


def _plan(text: str) -> ensemble.Plan:
    config = model_config.parse_config(text, path="c", fmt="pbtxt")
    model_config.validate(config, source="c")
    return ensemble.plan_of(config)


def test_plan_runs_a_step_when_all_its_inputs_exist() -> None:
    plan = _plan(DIAMOND)
    assert [s.index for s in ensemble.runnable(plan, {"X"}, set())] == [0, 1]
    assert [s.index for s in ensemble.runnable(plan, {"X", "y1"}, {0, 1})] == []
    assert [s.index for s in ensemble.runnable(plan, {"X", "y1", "y2"}, {0, 1})] == [2]
    assert plan.outputs == ("OUT0", "OUT1") and plan.producer["OUT0"] == 2


def test_plan_step_request_renames_tensors_and_passes_parameters() -> None:
    plan = _plan(PIPELINE)
    add_sub = plan.steps[1]
    outer = InferRequest("pipeline", "", [Tensor("A", "FP32", A), Tensor("B", "FP32", B)], id="r1")
    outer.parameters = {"priority": 2}
    inner = ensemble.step_request(add_sub, {t.name: t for t in outer.inputs}, outer)
    assert (inner.model_name, inner.model_version, inner.id) == ("add_sub", "1", "r1")
    assert inner.parameters == {"priority": 2} and inner.parameters is not outer.parameters
    # no copy: a read-only view of the ensemble's tensor, so a step that writes into its input fails
    # instead of changing what other steps, the answer and the response cache see
    assert [(t.name, np.shares_memory(t.data, src), t.data.flags.writeable) for t, src in
            zip(inner.inputs, (A, B), strict=True)] == [("INPUT0", True, False), ("INPUT1", True, False)]
    assert [o.name for o in inner.outputs or ()] == ["OUTPUT0", "OUTPUT1"]


def test_plan_missing_local_step_skips_remote_steps() -> None:
    config = model_config.parse_config(PIPELINE, path="c", fmt="pbtxt")
    config.parameters["sluice.remote.add_sub"].string_value = "10.0.0.1:8001"
    plan = ensemble.plan_of(config)
    ready = {"identity_fp32"}
    assert ensemble.missing_local_step(plan, lambda name, version: name in ready) is None
    assert ensemble.missing_local_step(plan, lambda name, version: False).model == "identity_fp32"


def test_ensemble_outputs_filter_and_check_datatypes() -> None:
    plan = _plan(PIPELINE)
    tensors = {"SUM": Tensor("SUM", "FP32", A), "DIFF": Tensor("DIFF", "FP32", B)}
    assert [t.name for t in ensemble.ensemble_outputs(plan, tensors, None)] == ["SUM", "DIFF"]
    assert [t.name for t in ensemble.ensemble_outputs(plan, tensors, ["DIFF"])] == ["DIFF"]
    with pytest.raises(ModelError, match="declares output 'SUM' as FP32 but step model 'identity_fp32'"):
        ensemble.ensemble_outputs(plan, {**tensors, "SUM": Tensor("SUM", "INT32", A.astype(np.int32))}, None)


async def test_cancelling_the_ensemble_request_cancels_pending_steps() -> None:
    sent: list[InferRequest] = []
    scheduler = ensemble.EnsembleScheduler(
        ensemble.Ensemble(model_config.parse_config(DIAMOND, path="c", fmt="pbtxt")),
        lambda request, done: sent.append(request),  # steps that never answer
    )
    scheduler.start()
    outcomes: list[object] = []
    request = InferRequest("diamond", "", [Tensor("X", "FP32", A)])
    scheduler.enqueue_callback(request, outcomes.append)
    assert [r.model_name for r in sent] == ["slow", "slow"] and scheduler.in_flight == 1
    request.cancel.cancel()
    assert all(r.cancel.cancelled for r in sent)
    assert len(outcomes) == 1 and isinstance(outcomes[0], Cancelled)
    assert scheduler.in_flight == 0
    await scheduler.aclose()


async def test_a_step_that_answers_at_once_does_not_end_the_request_early() -> None:
    def dispatch(request: InferRequest, done: ensemble.Done) -> None:
        done(InferResponse(request.model_name, "1", [Tensor("OUTPUT0", "FP32", A), Tensor("OUTPUT1", "FP32", B)]))

    scheduler = ensemble.EnsembleScheduler(
        ensemble.Ensemble(model_config.parse_config(DIAMOND, path="c", fmt="pbtxt")), dispatch
    )
    scheduler.start()
    outcomes: list[object] = []
    scheduler.enqueue_callback(InferRequest("diamond", "", [Tensor("X", "FP32", A)]), outcomes.append)
    assert len(outcomes) == 1 and isinstance(outcomes[0], InferResponse)
    assert [t.name for t in outcomes[0].outputs] == ["OUT0", "OUT1"]
    await scheduler.aclose()


async def test_a_step_error_names_the_step_and_keeps_its_status() -> None:
    def dispatch(request: InferRequest, done: ensemble.Done) -> None:
        raise Unavailable("queue is full")

    scheduler = ensemble.EnsembleScheduler(
        ensemble.Ensemble(model_config.parse_config(PIPELINE, path="c", fmt="pbtxt")), dispatch
    )
    scheduler.start()
    outcomes: list[SluiceError] = []
    request = InferRequest("pipeline", "", [Tensor("A", "FP32", A), Tensor("B", "FP32", B)])
    scheduler.enqueue_callback(request, outcomes.append)  # type: ignore[arg-type]
    assert isinstance(outcomes[0], Unavailable)
    assert outcomes[0].message == "ensemble 'pipeline' step model 'add_sub': queue is full"
    await scheduler.aclose()


# --- serving -------------------------------------------------------------------------------------


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = base_repo(tmp_path / "repo")
    write_ensemble(repo, "pipeline", PIPELINE, version_dir=False)
    write_ensemble(repo, "text_chain", TEXT_CHAIN)
    return repo


def test_two_steps_give_what_the_steps_give_by_hand(repo: Path, serve) -> None:
    server: Running = serve(repo)
    http = httpclient.InferenceServerClient(server.http)
    by_hand = http.infer("add_sub", fp32_inputs(httpclient, A, B, ("INPUT0", "INPUT1")))
    result = http.infer("pipeline", fp32_inputs(httpclient, A, B))
    np.testing.assert_array_equal(result.as_numpy("SUM"), by_hand.as_numpy("OUTPUT0"))
    np.testing.assert_array_equal(result.as_numpy("DIFF"), by_hand.as_numpy("OUTPUT1"))
    assert result.get_response()["model_name"] == "pipeline"

    grpc = grpcclient.InferenceServerClient(server.grpc)
    over_grpc = grpc.infer("pipeline", fp32_inputs(grpcclient, A, B))
    np.testing.assert_array_equal(over_grpc.as_numpy("SUM"), A + B)
    np.testing.assert_array_equal(over_grpc.as_numpy("DIFF"), A - B)

    assert http.is_model_ready("pipeline") and grpc.is_model_ready("pipeline")
    metadata = http.get_model_metadata("pipeline")
    assert metadata["platform"] == "ensemble"
    assert [i["name"] for i in metadata["inputs"]] == ["A", "B"]
    assert grpc.get_model_config("pipeline").config.platform == "ensemble"
    assert http.get_model_config("pipeline")["ensemble_scheduling"]["step"][1]["model_name"] == "add_sub"
    stats = http.get_inference_statistics("pipeline")["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] == 2
    assert stats["inference_count"] == 2
    # Each step counts its own requests, as in Triton (one by hand plus two through the ensemble).
    step_stats = http.get_inference_statistics("add_sub")["model_stats"][0]
    assert step_stats["inference_stats"]["success"]["count"] == 3


def test_requested_outputs_are_filtered(repo: Path, serve) -> None:
    server: Running = serve(repo)
    http = httpclient.InferenceServerClient(server.http)
    result = http.infer("pipeline", fp32_inputs(httpclient, A, B), outputs=[httpclient.InferRequestedOutput("DIFF")])
    assert [o["name"] for o in result.get_response()["outputs"]] == ["DIFF"]
    np.testing.assert_array_equal(result.as_numpy("DIFF"), A - B)
    grpc = grpcclient.InferenceServerClient(server.grpc)
    result = grpc.infer("pipeline", fp32_inputs(grpcclient, A, B), outputs=[grpcclient.InferRequestedOutput("SUM")])
    assert [o.name for o in result.get_response().outputs] == ["SUM"]
    with pytest.raises(InferenceServerException, match="NOPE"):
        http.infer("pipeline", fp32_inputs(httpclient, A, B), outputs=[httpclient.InferRequestedOutput("NOPE")])


def test_bytes_pass_through_an_ensemble(repo: Path, serve) -> None:
    server: Running = serve(repo)
    text = np.array([b"hello", b"", "zürich".encode()], dtype=object)
    for module, url in ((httpclient, server.http), (grpcclient, server.grpc)):
        client = module.InferenceServerClient(url)
        entry = module.InferInput("TEXT", [3], "BYTES")
        entry.set_data_from_numpy(text)
        result = client.infer("text_chain", [entry])
        assert result.as_numpy("ECHO").tolist() == text.tolist()


def test_parallel_steps_of_a_diamond_run_concurrently(tmp_path: Path, serve) -> None:
    repo = base_repo(tmp_path / "repo")
    write_model(repo, "slow", SLOW_CONFIG, {"model.py": SLOW_PY})
    write_ensemble(repo, "diamond", DIAMOND)
    server: Running = serve(repo)
    client = grpcclient.InferenceServerClient(server.grpc)
    entry = grpcclient.InferInput("X", [16], "FP32")
    entry.set_data_from_numpy(A)
    for _ in range(2):  # each step waits until the other has started: run one after the other, they fail
        result = client.infer("diamond", [entry])
        np.testing.assert_array_equal(result.as_numpy("OUT0"), 2 * A)
        np.testing.assert_array_equal(result.as_numpy("OUT1"), np.zeros(16, np.float32))


CONFIG_ERRORS = [
    pytest.param(
        _ensemble("bad", _step("nope", {"INPUT0": "A"}, {"OUTPUT0": "OUT"})),
        ["ensemble_scheduling.step[0].model_name", "step model 'nope' is not in the model repository"],
        id="unknown-step-model",
    ),
    pytest.param(
        _ensemble("bad", _step("identity_fp32", {"INPUT0": "A", "INPUT1": "ghost"}, {"OUTPUT0": "OUT"})),
        ["ensemble_scheduling.step[0].input_map[INPUT1]", "ensemble tensor 'ghost'", "produced by no"],
        id="input-no-one-produces",
    ),
    pytest.param(
        _ensemble(
            "bad",
            _step("identity_fp32", {"INPUT0": "A", "INPUT1": "y"}, {"OUTPUT0": "x", "OUTPUT1": "OUT"})
            + ","
            + _step("identity_fp32", {"INPUT0": "x", "INPUT1": "A"}, {"OUTPUT0": "y"}),
        ),
        ["field 'ensemble_scheduling.step'", "cycle", "step[0] (identity_fp32) -> step[1] (identity_fp32)"],
        id="cycle",
    ),
    pytest.param(
        _ensemble(
            "bad",
            _step("identity_fp32", {"INPUT0": "A", "INPUT1": "A"}, {"OUTPUT0": "OUT"}),
            '{ name: "OUT", data_type: TYPE_FP32, dims: [ 16 ] }, '
            '{ name: "NEVER", data_type: TYPE_FP32, dims: [ 16 ] }',
        ),
        ["output[1].name", "ensemble output 'NEVER' is produced by no step"],
        id="output-never-produced",
    ),
]


@pytest.mark.parametrize(("config_text", "expected"), CONFIG_ERRORS)
def test_invalid_ensembles_fail_to_load_and_others_serve(tmp_path: Path, serve, config_text: str, expected) -> None:
    repo = base_repo(tmp_path / "repo")
    write_ensemble(repo, "bad", config_text)
    server: Running = serve(repo, **EXPLICIT)
    message = server.server.failed_models["bad"]
    for part in ["bad/config.pbtxt", *expected]:
        assert part in message, (part, message)
    assert str(repo) not in message  # clients never see the server's paths
    http = httpclient.InferenceServerClient(server.http)
    with pytest.raises(InferenceServerException) as caught:
        http.load_model("bad")
    assert expected[0] in str(caught.value)
    index = {row["name"]: row for row in http.get_model_repository_index()}
    assert expected[-1] in index["bad"]["reason"]
    assert not http.is_model_ready("bad")
    assert http.is_model_ready("add_sub")
    result = http.infer("add_sub", fp32_inputs(httpclient, A, B, ("INPUT0", "INPUT1")))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)


def test_readiness_follows_the_steps(repo: Path, serve) -> None:
    server: Running = serve(repo, **EXPLICIT)
    http = httpclient.InferenceServerClient(server.http)
    grpc = grpcclient.InferenceServerClient(server.grpc)
    http.infer("pipeline", fp32_inputs(httpclient, A, B))

    http.unload_model("add_sub")
    assert not http.is_model_ready("pipeline") and not grpc.is_model_ready("pipeline")
    with pytest.raises(InferenceServerException) as caught:
        http.infer("pipeline", fp32_inputs(httpclient, A, B))
    assert caught.value.status() == "503"
    assert "has no available versions" in caught.value.message() and "'add_sub'" in caught.value.message()
    with pytest.raises(InferenceServerException) as caught:
        grpc.infer("pipeline", fp32_inputs(grpcclient, A, B))
    assert caught.value.status() == "StatusCode.UNAVAILABLE" and "'add_sub'" in caught.value.message()
    index = {row["name"]: row for row in http.get_model_repository_index()}
    assert index["pipeline"]["state"] == "UNAVAILABLE" and "add_sub" in index["pipeline"]["reason"]

    http.load_model("add_sub")
    assert http.is_model_ready("pipeline")
    result = grpc.infer("pipeline", fp32_inputs(grpcclient, A, B))
    np.testing.assert_array_equal(result.as_numpy("SUM"), A + B)
    # Not reloaded: the ensemble's statistics go on from before the step left.
    stats = http.get_inference_statistics("pipeline")["model_stats"][0]["inference_stats"]
    assert stats["success"]["count"] == 2


def test_an_ensemble_loads_its_steps_and_follows_them(tmp_path: Path, serve) -> None:
    repo = tmp_path / "repo"
    write_ensemble(repo, "pipeline", PIPELINE)
    base_repo(repo)
    # the ensemble alone: its steps load with it (Triton)
    server: Running = serve(repo, models=("pipeline",), model_control_mode="explicit")
    http = httpclient.InferenceServerClient(server.http)
    assert http.is_model_ready("pipeline") and http.is_model_ready("add_sub") and http.is_model_ready("identity_fp32")
    # a step unloaded: the ensemble waits for it, and serves again when it is back, without a reload
    http.unload_model("identity_fp32")
    assert not http.is_model_ready("pipeline")
    http.load_model("identity_fp32")
    assert http.is_model_ready("pipeline")
    np.testing.assert_array_equal(http.infer("pipeline", fp32_inputs(httpclient, A, B)).as_numpy("DIFF"), A - B)


def test_a_step_error_reaches_the_client(tmp_path: Path, serve) -> None:
    repo = base_repo(tmp_path / "repo")
    write_model(repo, "checker", CHECKER_CONFIG, {"model.py": CHECKER_PY})
    write_ensemble(repo, "checked", CHECKED)
    server: Running = serve(repo)
    for module, url, status in ((httpclient, server.http, "500"), (grpcclient, server.grpc, "StatusCode.INTERNAL")):
        client = module.InferenceServerClient(url)
        with pytest.raises(InferenceServerException) as caught:
            client.infer("checked", fp32_inputs(module, A, -A - 1))
        assert caught.value.status() == status
        assert "step model 'checker'" in caught.value.message()
        assert "negative sum: -1.0" in caught.value.message()
        result = client.infer("checked", fp32_inputs(module, A, B))
        np.testing.assert_array_equal(result.as_numpy("OUT"), A + B)
    stats = httpclient.InferenceServerClient(server.http).get_inference_statistics("checked")["model_stats"][0]
    assert (stats["inference_stats"]["fail"]["count"], stats["inference_stats"]["success"]["count"]) == (2, 2)


def test_remote_steps_are_called_over_grpc(tmp_path: Path, serve) -> None:
    remote_repo = tmp_path / "remote"
    write_model(remote_repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    remote: Running = serve(remote_repo, **EXPLICIT)
    repo = tmp_path / "repo"
    write_model(repo, "identity_fp32", IDENTITY_FP32, {"model.py": IDENTITY_PY})
    config = PIPELINE.replace("model_version: 1", "model_version: -1") + (
        f'parameters {{ key: "sluice.remote.add_sub" value {{ string_value: "{remote.grpc}" }} }}\n'
    )
    write_ensemble(repo, "pipeline", config)
    server: Running = serve(repo, **EXPLICIT)
    http = httpclient.InferenceServerClient(server.http)
    assert http.is_model_ready("pipeline")
    for _ in range(2):  # the second call reuses the client
        result = http.infer("pipeline", fp32_inputs(httpclient, A, B))
        np.testing.assert_array_equal(result.as_numpy("SUM"), A + B)
        np.testing.assert_array_equal(result.as_numpy("DIFF"), A - B)
    remote_stats = httpclient.InferenceServerClient(remote.http).get_inference_statistics("add_sub")
    assert remote_stats["model_stats"][0]["inference_stats"]["success"]["count"] == 2

    remote.stop()
    grpc = grpcclient.InferenceServerClient(server.grpc)
    with pytest.raises(InferenceServerException) as caught:
        grpc.infer("pipeline", fp32_inputs(grpcclient, A, B))
    assert caught.value.status() == "StatusCode.UNAVAILABLE"
    message = caught.value.message()
    assert f"step model 'add_sub' (remote, at {remote.grpc})" in message and "cannot reach" in message
    http.unload_model("pipeline")  # closes the remote client
    assert not http.is_model_ready("pipeline")


def test_the_operator_colocated_ensemble_config_loads(tmp_path: Path, serve) -> None:
    golden = ROOT / "tests" / "operator_" / "golden" / "ensemble-colocated.yaml"
    config_map = next(doc for doc in yaml.safe_load_all(golden.read_text()) if doc["kind"] == "ConfigMap")
    repo = tmp_path / "repo"
    (repo / "classifier" / "1").mkdir(parents=True)  # the operator mounts an empty version directory
    (repo / "classifier" / "config.json").write_text(config_map["data"]["classifier.config.json"])
    rendered = json.loads(config_map["data"]["classifier.config.json"])
    # Step models with the tensors the golden ensemble maps (the golden's own steps need S3 and a GPU).
    write_model(
        repo,
        "preprocess",
        """
        backend: "python"
        input [ { name: "RAW", data_type: TYPE_UINT8, dims: [ -1 ] } ]
        output [ { name: "TENSOR", data_type: TYPE_FP32, dims: [ -1 ] } ]
        """,
        {"model.py": _PREPROCESS_PY},
    )
    write_model(
        repo,
        "resnet50",
        """
        backend: "python"
        input [ { name: "input", data_type: TYPE_FP32, dims: [ -1 ] } ]
        output [ { name: "probs", data_type: TYPE_STRING, dims: [ 1 ] } ]
        """,
        {"model.py": _LABEL_PY},
    )
    server: Running = serve(repo)
    assert "classifier" not in server.server.failed_models
    http = httpclient.InferenceServerClient(server.http)
    assert http.is_model_ready("classifier")
    assert http.get_model_config("classifier")["ensemble_scheduling"]["step"] == [
        {**step, "model_namespace": ""} for step in rendered["ensemble_scheduling"]["step"]
    ]
    image = httpclient.InferInput("IMAGE", [3], "UINT8")
    image.set_data_from_numpy(np.array([1, 2, 250], dtype=np.uint8))
    assert http.infer("classifier", [image]).as_numpy("LABEL").tolist() == [b"max=250"]


_PREPROCESS_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("TENSOR", pb_utils.get_input_tensor_by_name(r, "RAW").as_numpy().astype(np.float32))]
            )
            for r in requests
        ]
"""

_LABEL_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            data = pb_utils.get_input_tensor_by_name(r, "input").as_numpy()
            label = np.array([f"max={int(data.max())}".encode()], dtype=object)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("probs", label)]))
        return out
"""


def test_ensemble_config_validation_directly() -> None:
    with pytest.raises(ConfigError, match=r"dynamic_batching.*oneof"):
        model_config.parse_config(PIPELINE + "dynamic_batching { }", path="c", fmt="pbtxt")
    config = model_config.parse_config(
        PIPELINE + 'parameters { key: "sluice.remote.other" value { string_value: "h:1" } }', path="c", fmt="pbtxt"
    )
    with pytest.raises(ConfigError, match=r"parameters\[sluice.remote.other\].*not a step model"):
        model_config.validate(config, source="c")
    config = model_config.parse_config(
        'backend: "python"\nensemble_scheduling { step [ { model_name: "a" } ] }', path="c", fmt="pbtxt"
    )
    with pytest.raises(ConfigError, match=r"field 'ensemble_scheduling'.*only with platform"):
        model_config.validate(config, source="c")
    config = model_config.parse_config(PIPELINE, path="c", fmt="pbtxt")
    config.ensemble_scheduling.max_inflight_requests = 4
    assert model_config.validate(config, source="c") == [
        "ensemble_scheduling.max_inflight_requests: not implemented yet; in-flight steps are not limited"
    ]
    assert isinstance(config, mc.ModelConfig)


# --- a non-batching ensemble over batching steps (Triton's reshaping between steps) --------------


@pytest.mark.parametrize(
    ("config_dims", "batching", "tensor_batch", "shape", "expected"),
    [
        ((4,), True, 0, (4,), (1, 4)),  # unbatched tensor into a batching model: batch of 1
        ((4,), True, 0, (2, 4), (2, 4)),  # does not match the dims: taken as batched already
        ((-1,), True, 0, (7,), (1, 7)),  # wildcards match
        ((4,), False, 1, (1, 4), (4,)),  # batch of 1 out to a non-batching model: batch dim dropped
        ((1, 4), False, 1, (1, 4), (1, 4)),  # ... unless the shape already matches
        ((4,), False, 2, (2, 4), (2, 4)),  # a real batch is left alone
        ((4,), True, 3, (3, 4), (3, 4)),  # both batch: nothing to do
        ((4,), False, 0, (4,), (4,)),  # neither batches: nothing to do
    ],
)
def test_reshape_dims_follows_triton(config_dims, batching, tensor_batch, shape, expected) -> None:
    assert ensemble.reshape_dims(config_dims, batching, tensor_batch, shape) == expected


def double_onnx() -> bytes:
    """X (FP32 [batch, 4]) -> Y = 2 X."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Add", ["X", "X"], ["Y"])],
        "double",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


DOUBLE_CONFIG = """
name: "double"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "X", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""

# A batching Python step that records the shape it was given next to the model.
PLUS_ONE_CONFIG = """
name: "plus_one"
backend: "python"
max_batch_size: 4
input [ { name: "Y", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "Z", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""

PLUS_ONE_PY = """
import os

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.log = os.path.join(args["model_repository"], "shapes.log")

    def execute(self, requests):
        out = []
        for request in requests:
            y = pb_utils.get_input_tensor_by_name(request, "Y").as_numpy()
            with open(self.log, "a") as f:
                f.write(f"{list(y.shape)}\\n")
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Z", y + 1)]))
        return out
"""


def _unbatched_ensemble(name: str, dims: str) -> str:
    return f"""
name: "{name}"
platform: "ensemble"
max_batch_size: 0
input [ {{ name: "IN", data_type: TYPE_FP32, dims: [ {dims} ] }} ]
output [ {{ name: "OUT", data_type: TYPE_FP32, dims: [ {dims} ] }} ]
ensemble_scheduling {{
  step [
    {_step("double", {"X": "IN"}, {"Y": "DOUBLED"})},
    {_step("plus_one", {"Y": "DOUBLED"}, {"Z": "OUT"})}
  ]
}}
"""


@pytest.fixture
def batching_steps_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    write_model(repo, "double", DOUBLE_CONFIG, {"model.onnx": double_onnx()})
    write_model(repo, "plus_one", PLUS_ONE_CONFIG, {"model.py": PLUS_ONE_PY})
    write_ensemble(repo, "one_row", _unbatched_ensemble("one_row", "4"))
    write_ensemble(repo, "two_rows", _unbatched_ensemble("two_rows", "2, 4"))
    return repo


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_unbatched_ensemble_feeds_batching_steps_as_triton_does(batching_steps_repo: Path, serve, module) -> None:
    server = serve(batching_steps_repo)
    client = module.InferenceServerClient(server.http if module is httpclient else server.grpc)
    row = np.array([1, 2, 3, 4], np.float32)

    # [4] matches the steps' dims: they see a batch of 1, the client gets [4] back
    one = module.InferInput("IN", [4], "FP32")
    one.set_data_from_numpy(row)
    result = client.infer("one_row", [one])
    assert result.as_numpy("OUT").shape == (4,)
    assert result.as_numpy("OUT").tolist() == (row * 2 + 1).tolist()

    # [2, 4] does not match [4]: the steps take it as a batch of 2, and so does the answer
    two = module.InferInput("IN", [2, 4], "FP32")
    two.set_data_from_numpy(np.stack([row, -row]))
    result = client.infer("two_rows", [two])
    assert result.as_numpy("OUT").tolist() == [(row * 2 + 1).tolist(), (-row * 2 + 1).tolist()]

    assert (batching_steps_repo / "plus_one" / "shapes.log").read_text().split("\n")[:2] == ["[1, 4]", "[2, 4]"]


# -- decoupled step models (Triton: each response continues the ensemble) -----------------------------

REPEAT_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            times = int(pb_utils.get_input_tensor_by_name(request, "TIMES").as_numpy()[0])
            sender = request.get_response_sender()
            for k in range(times):
                if times == 99 and k == 1:
                    raise pb_utils.TritonModelException("repeat broke after one response")
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x + k)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""
REPEAT_CONFIG = """
name: "repeat"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] }, { name: "TIMES", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
model_transaction_policy { decoupled: true }
"""
TIMES_TEN_PY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() * 10)]) for r in requests]
"""
TIMES_TEN_CONFIG = """
name: "times_ten"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""


def stream_ensemble(name: str, decoupled: bool) -> str:
    policy = "model_transaction_policy { decoupled: true }" if decoupled else ""
    return f"""
name: "{name}"
platform: "ensemble"
max_batch_size: 0
input [ {{ name: "IN", data_type: TYPE_FP32, dims: [ 4 ] }}, {{ name: "TIMES", data_type: TYPE_INT32, dims: [ 1 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] }}, {{ name: "SCALED", data_type: TYPE_FP32, dims: [ 4 ] }} ]
{policy}
ensemble_scheduling {{ step [
  {{ model_name: "repeat" input_map {{ key: "INPUT0" value: "IN" }} input_map {{ key: "TIMES" value: "TIMES" }}
     output_map {{ key: "OUTPUT0" value: "each" }} }},
  {{ model_name: "times_ten" input_map {{ key: "INPUT0" value: "IN" }}
     output_map {{ key: "OUTPUT0" value: "SCALED" }} }},
  {{ model_name: "times_ten" input_map {{ key: "INPUT0" value: "each" }} output_map {{ key: "OUTPUT0" value: "OUT" }} }}
] }}
"""


@pytest.fixture
def streaming_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    write_model(repo, "repeat", REPEAT_CONFIG, {"model.py": REPEAT_PY})
    write_model(repo, "times_ten", TIMES_TEN_CONFIG, {"model.py": TIMES_TEN_PY})
    write_ensemble(repo, "streamed", stream_ensemble("streamed", True))
    write_ensemble(repo, "single", stream_ensemble("single", False))
    return repo


def stream_inputs(times: int) -> list:
    x = grpcclient.InferInput("IN", [4], "FP32")
    x.set_data_from_numpy(np.arange(4, dtype=np.float32))
    n = grpcclient.InferInput("TIMES", [1], "INT32")
    n.set_data_from_numpy(np.array([times], np.int32))
    return [x, n]


def streamed(server: Running, model: str, times: int) -> list:
    import queue

    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc)
    client.start_stream(callback=lambda result, error: answers.put(error or result))
    try:
        client.async_stream_infer(model, stream_inputs(times), enable_empty_final_response=True)
        got = []
        while True:
            item = answers.get(timeout=30)
            got.append(item)
            if isinstance(item, InferenceServerException):
                return got
            if item.get_response().parameters["triton_final_response"].bool_param:
                return got
    finally:
        client.stop_stream()
        client.close()


def test_each_response_of_a_decoupled_step_continues_the_ensemble(streaming_repo: Path, serve) -> None:
    """Triton's decoupled ensembles: every response of the decoupled step runs the steps after it and
    is one response of the ensemble, which carries the outputs of the steps beside it too."""
    server: Running = serve(streaming_repo)
    got = streamed(server, "streamed", 3)
    responses, final = got[:-1], got[-1]
    x = np.arange(4, dtype=np.float32)
    assert sorted(tuple(r.as_numpy("OUT")) for r in responses) == [tuple((x + k) * 10) for k in range(3)]
    for response in responses:
        np.testing.assert_array_equal(response.as_numpy("SCALED"), x * 10)
        assert response.get_response().model_name == "streamed"
    assert final.as_numpy("OUT") is None  # the bare final flag
    assert streamed(server, "streamed", 0)[0].as_numpy("OUT") is None  # no response: the final flag alone


ADD_PY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", (
            pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            + pb_utils.get_input_tensor_by_name(r, "INPUT1").as_numpy()))]) for r in requests]
"""
ADD_CONFIG = """
name: "add"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] }, { name: "INPUT1", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""
PAIRED_ENSEMBLE = """
name: "paired"
platform: "ensemble"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 4 ] }, { name: "TIMES", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] } ]
model_transaction_policy { decoupled: true }
ensemble_scheduling { step [
  { model_name: "times_ten" input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "tens" } },
  { model_name: "repeat" input_map { key: "INPUT0" value: "IN" } input_map { key: "TIMES" value: "TIMES" }
    output_map { key: "OUTPUT0" value: "a" } },
  { model_name: "repeat" input_map { key: "INPUT0" value: "tens" } input_map { key: "TIMES" value: "TIMES" }
    output_map { key: "OUTPUT0" value: "b" } },
  { model_name: "add" input_map { key: "INPUT0" value: "a" } input_map { key: "INPUT1" value: "b" }
    output_map { key: "OUTPUT0" value: "OUT" } }
] }
"""


def test_two_decoupled_steps_side_by_side_are_paired_response_by_response(streaming_repo: Path, serve) -> None:
    """Triton pairs the tensors of decoupled steps by response: the n-th of each feeds the n-th run of the
    step after them. Each response used to go on alone, so the step needing both never ran and every
    branch failed with "produced no output"."""
    write_model(streaming_repo, "add", ADD_CONFIG, {"model.py": ADD_PY})
    write_ensemble(streaming_repo, "paired", PAIRED_ENSEMBLE)
    server: Running = serve(streaming_repo)
    x = np.arange(4, dtype=np.float32)
    for times in (3, 1):
        got = streamed(server, "paired", times)
        assert not any(isinstance(g, InferenceServerException) for g in got), got
        responses = got[:-1]
        # a_k = x + k and b_k = 10x + k, paired by k
        assert sorted(tuple(r.as_numpy("OUT")) for r in responses) == [tuple(11 * x + 2 * k) for k in range(times)]
    assert streamed(server, "paired", 0)[0].as_numpy("OUT") is None  # none from either: the final flag alone


def test_a_decoupled_step_error_ends_the_streamed_ensemble_naming_the_step(streaming_repo: Path, serve) -> None:
    server: Running = serve(streaming_repo)
    for _ in range(3):
        got = streamed(server, "streamed", 99)
        # the response sent before the error comes first, as from the step model called directly
        assert len(got) == 2 and not isinstance(got[0], InferenceServerException), got
        np.testing.assert_array_equal(got[0].as_numpy("OUT"), np.arange(4, dtype=np.float32) * 10)
        error = got[-1]
        assert isinstance(error, InferenceServerException), got
        assert "step model 'repeat'" in error.message() and "repeat broke after one response" in error.message()


def test_a_non_decoupled_ensemble_takes_one_response_of_a_decoupled_step(streaming_repo: Path, serve) -> None:
    server: Running = serve(streaming_repo)
    http = httpclient.InferenceServerClient(server.http)
    x = httpclient.InferInput("IN", [4], "FP32")
    x.set_data_from_numpy(np.arange(4, dtype=np.float32))
    n = httpclient.InferInput("TIMES", [1], "INT32")
    n.set_data_from_numpy(np.array([1], np.int32))
    np.testing.assert_array_equal(http.infer("single", [x, n]).as_numpy("OUT"), np.arange(4, dtype=np.float32) * 10)
    n.set_data_from_numpy(np.array([3], np.int32))
    with pytest.raises(InferenceServerException) as caught:
        http.infer("single", [x, n])
    assert "is not decoupled but its decoupled steps produced more than one response" in caught.value.message()
    assert "model_transaction_policy { decoupled: true }" in caught.value.message()


def _pointing_at(name: str, step: str) -> str:
    return f"""
name: "{name}"
platform: "ensemble"
max_batch_size: 0
input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] }} ]
ensemble_scheduling {{ step [ {{ model_name: "{step}" model_version: -1
  input_map {{ key: "INPUT0" value: "INPUT0" }} output_map {{ key: "OUTPUT0" value: "OUTPUT0" }} }} ] }}
"""


def test_ensemble_cycle_is_found_through_any_depth() -> None:
    graph = {"a": ["b"], "b": ["c", "x"], "c": ["a"], "x": [], "d": ["d"], "e": ["b"]}
    def steps(name: str) -> list[str]:
        return graph.get(name, [])

    assert model_config.ensemble_cycle("a", steps) == ["a", "b", "c", "a"]
    assert model_config.ensemble_cycle("d", steps) == ["d", "d"]
    assert model_config.ensemble_cycle("x", steps) == []
    assert model_config.ensemble_cycle("e", steps) == []  # a cycle it reaches is the others' to report


def test_ensembles_naming_each_other_are_refused_naming_the_cycle(tmp_path: Path, serve) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "e1", _pointing_at("e1", "e2"), {})
    write_model(repo, "e2", _pointing_at("e2", "e1"), {})
    server = serve(repo)
    client = httpclient.InferenceServerClient(server.http)
    rows = {row["name"]: row for row in client.get_model_repository_index()}
    assert rows["e1"]["state"] == rows["e2"]["state"] == "UNAVAILABLE"
    assert "e1/config.pbtxt:7:" in rows["e1"]["reason"]
    assert "circular dependency between ensembles: e1 -> e2 -> e1" in rows["e1"]["reason"]
    assert "circular dependency between ensembles: e2 -> e1 -> e2" in rows["e2"]["reason"]
    tensor = httpclient.InferInput("INPUT0", [4], "FP32")
    tensor.set_data_from_numpy(np.zeros(4, np.float32))
    with pytest.raises(InferenceServerException, match="circular dependency"):
        client.infer("e1", [tensor])
