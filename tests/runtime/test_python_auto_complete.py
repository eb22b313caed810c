"""``auto_complete_config`` of Python models, seen as Triton users see it: through tritonclient's
``get_model_config`` over HTTP and gRPC, then by inference with the completed shapes.

The models here are our own; they use the same calls as NVIDIA's ``examples/auto_complete`` (read
the config with ``as_dict()``, add what is missing with ``add_input`` / ``add_output``, then
``set_max_batch_size`` and ``set_dynamic_batching``), and the repository follows that example's
layout: a model directory with only ``1/model.py`` and no ``config.pbtxt``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from .conftest import Running, start_server, write_model  # type: ignore[import-not-found]

# Completes what the written config lacks (the example's pattern); the batch size and scheduler come
# from the class attributes, so one file serves both the batching and the non-batching model.
COMPLETING_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

INPUTS = [
    {"name": "WORDS", "data_type": "TYPE_INT32", "dims": [3]},
    {"name": "SCALE", "data_type": "TYPE_FP32", "dims": [1]},
]
OUTPUTS = [
    {"name": "SCALED", "data_type": "TYPE_FP32", "dims": [3]},
    {"name": "TOTAL", "data_type": "TYPE_FP32", "dims": [1]},
]


class TritonPythonModel:
    MAX_BATCH = MAX_BATCH_VALUE

    @staticmethod
    def auto_complete_config(config):
        present = config.as_dict()
        have_in = {entry["name"] for entry in present["input"]}
        have_out = {entry["name"] for entry in present["output"]}
        for entry in INPUTS:
            if entry["name"] not in have_in:
                config.add_input(entry)
        for entry in OUTPUTS:
            if entry["name"] not in have_out:
                config.add_output(entry)
        config.set_max_batch_size(TritonPythonModel.MAX_BATCH)
        if TritonPythonModel.MAX_BATCH:
            config.set_dynamic_batching()
        return config

    def execute(self, requests):
        out = []
        for request in requests:
            words = pb_utils.get_input_tensor_by_name(request, "WORDS").as_numpy()
            scale = pb_utils.get_input_tensor_by_name(request, "SCALE").as_numpy()
            scaled = words.astype(np.float32) * scale
            total = scaled.sum(axis=-1, keepdims=True)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("SCALED", scaled), pb_utils.Tensor("TOTAL", total)]))
        return out
"""

# Asks for a smaller batch than its config allows: Triton's set_max_batch_size refuses that.
SHRINKING_PY = """
class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.set_max_batch_size(2)
        return config

    def execute(self, requests):
        return []
"""


def completing(max_batch: int) -> str:
    return COMPLETING_PY.replace("MAX_BATCH_VALUE", str(max_batch))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    repo: Path = tmp_path_factory.mktemp("auto_complete") / "repo"
    for name, max_batch in (("batching", 4), ("single", 0)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(completing(max_batch))  # no config.pbtxt at all
    # A written config with one output and its own settings: completion adds to it, keeps the rest.
    write_model(
        repo,
        "partial",
        """
        backend: "python"
        max_batch_size: 2
        output [ { name: "TOTAL", data_type: TYPE_FP32, dims: [ 1 ] } ]
        dynamic_batching { max_queue_delay_microseconds: 100 }
        """,
        {"model.py": completing(8)},
    )
    write_model(repo, "shrinking", 'backend: "python"\nmax_batch_size: 8\n', {"model.py": SHRINKING_PY})
    handle = start_server(repo)
    yield handle
    handle.stop()


def http_config(server: Running, model: str) -> dict[str, Any]:
    return httpclient.InferenceServerClient(server.http).get_model_config(model)


def grpc_config(server: Running, model: str) -> dict[str, Any]:
    """The gRPC answer in the HTTP form (dims as ints, data types as names)."""
    config = grpcclient.InferenceServerClient(server.grpc).get_model_config(model).config

    def tensors(entries: Any) -> list[dict[str, Any]]:
        return [{"name": e.name, "data_type": _type_name(e.data_type), "dims": list(e.dims)} for e in entries]

    return {
        "name": config.name,
        "max_batch_size": config.max_batch_size,
        "input": tensors(config.input),
        "output": tensors(config.output),
        "dynamic_batching": config.HasField("dynamic_batching"),
        "max_queue_delay_microseconds": config.dynamic_batching.max_queue_delay_microseconds,
    }


def _type_name(number: int) -> str:
    return str(model_config_pb2.DataType.Name(number))


def summary(config: dict[str, Any]) -> dict[str, Any]:
    """What a client checks of a completed config: the HTTP answer reduced to the gRPC summary's keys."""
    return {
        "name": config["name"],
        "max_batch_size": config["max_batch_size"],
        "input": [{k: e[k] for k in ("name", "data_type", "dims")} for e in config.get("input", [])],
        "output": [{k: e[k] for k in ("name", "data_type", "dims")} for e in config.get("output", [])],
        "dynamic_batching": "dynamic_batching" in config,
        "max_queue_delay_microseconds": config.get("dynamic_batching", {}).get("max_queue_delay_microseconds", 0),
    }


WORDS = {"name": "WORDS", "data_type": "TYPE_INT32", "dims": [3]}
SCALE = {"name": "SCALE", "data_type": "TYPE_FP32", "dims": [1]}
SCALED = {"name": "SCALED", "data_type": "TYPE_FP32", "dims": [3]}
TOTAL = {"name": "TOTAL", "data_type": "TYPE_FP32", "dims": [1]}


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("batching", {"max_batch_size": 4, "input": [WORDS, SCALE], "output": [SCALED, TOTAL],
                      "dynamic_batching": True, "max_queue_delay_microseconds": 0}),
        ("single", {"max_batch_size": 0, "input": [WORDS, SCALE], "output": [SCALED, TOTAL],
                    "dynamic_batching": False, "max_queue_delay_microseconds": 0}),
        # the written output stays first, the completed one follows; the model's larger batch size
        # replaces the config's (Triton's set_max_batch_size), the written batching settings stay
        ("partial", {"max_batch_size": 8, "input": [WORDS, SCALE], "output": [TOTAL, SCALED],
                     "dynamic_batching": True, "max_queue_delay_microseconds": 100}),
    ],
)
def test_the_completed_config_is_what_both_protocols_report(server, model, expected):
    from_http = summary(http_config(server, model))
    from_grpc = grpc_config(server, model)

    assert from_http == {"name": model, **expected}
    assert from_grpc == from_http


def test_a_model_without_config_file_is_named_after_its_directory_and_runs_the_python_backend(server):
    config = http_config(server, "batching")

    assert config["name"] == "batching"
    assert config["backend"] == "python"


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_inference_uses_the_completed_shapes(server, protocol):
    module: Any = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(server.http if protocol == "http" else server.grpc)
    words = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int32)
    scale = np.array([[2.0], [0.5]], dtype=np.float32)
    for model, rows in (("batching", slice(None)), ("single", 0)):
        inputs = [module.InferInput("WORDS", list(words[rows].shape), "INT32"),
                  module.InferInput("SCALE", list(scale[rows].shape), "FP32")]
        inputs[0].set_data_from_numpy(words[rows])
        inputs[1].set_data_from_numpy(scale[rows])

        result = client.infer(model, inputs)

        expected = words[rows].astype(np.float32) * scale[rows]
        np.testing.assert_allclose(result.as_numpy("SCALED"), expected)
        np.testing.assert_allclose(result.as_numpy("TOTAL"), expected.sum(axis=-1, keepdims=True))


def test_a_batch_larger_than_the_completed_max_batch_size_is_refused(server):
    client = httpclient.InferenceServerClient(server.http)
    inputs = [httpclient.InferInput("WORDS", [5, 3], "INT32"), httpclient.InferInput("SCALE", [5, 1], "FP32")]
    inputs[0].set_data_from_numpy(np.zeros((5, 3), dtype=np.int32))
    inputs[1].set_data_from_numpy(np.ones((5, 1), dtype=np.float32))

    with pytest.raises(InferenceServerException) as error:
        client.infer("batching", inputs)

    assert error.value.status() == "400"
    assert "inference request batch-size must be <= 4 for 'batching', got 5" in error.value.message()


def test_a_refused_completion_fails_the_load_with_tritons_message(server):
    index = httpclient.InferenceServerClient(server.http).get_model_repository_index()
    row = next(entry for entry in index if entry["name"] == "shrinking")

    assert row["state"] == "UNAVAILABLE"
    assert "auto_complete_config raised ValueError: configuration specified max_batch_size 8, but in " \
        "auto-complete-config function for model 'shrinking' specified max_batch_size 2" in row["reason"]
    assert not httpclient.InferenceServerClient(server.http).is_model_ready("shrinking")


@pytest.mark.parametrize(("strict", "inputs"), [("false", ["WORDS", "SCALE"]), ("true", [])])
def test_tritons_strict_model_config_flag_is_accepted_by_the_command(tmp_path, strict, inputs):
    """``sluice serve ... --strict-model-config=false``, as the example's README starts Triton;
    ``true`` turns completion off, as ``--disable-auto-complete-config`` does."""
    (tmp_path / "repo" / "batching" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "batching" / "1" / "model.py").write_text(completing(4))
    executable = shutil.which("sluice", path=os.path.dirname(sys.executable))
    assert executable, "the sluice command is not installed next to the interpreter"
    process = subprocess.Popen(
        [executable, "serve", "--model-repository", str(tmp_path / "repo"), f"--strict-model-config={strict}",
         "--http-port", "0", "--grpc-port", "-1", "--metrics-port", "-1", "--strict-readiness", "false"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
    )
    try:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:  # ends when the server prints its ready line (or exits)
            lines.append(line)
            if match := re.search(r"sluice ready: HTTP (\S+)", line):
                break
        else:
            pytest.fail(f"sluice serve did not become ready: {''.join(lines)}")
        client = httpclient.InferenceServerClient(match.group(1))
        config = client.get_model_config("batching")
        assert [entry["name"] for entry in config.get("input", [])] == inputs
        assert config["max_batch_size"] == (4 if inputs else 0)
    finally:
        process.send_signal(signal.SIGINT)  # stop now: SIGTERM would drain for 5 s
        process.wait(30)
