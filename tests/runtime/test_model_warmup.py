"""Triton's ``model_warmup``: samples run on every instance before the version is ready.

Through the real server and tritonclient: a Python model that records what it executed tells how
many warmup runs it got, of how many rows, with which data (zeros, random bytes, a file under
``warmup/``, sequence control inputs); an ONNX model warms up with random data; a sample that fails
or cannot be built fails the load with Triton's words and a config error naming the field. The
sample builder is also tested alone (BYTES files).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from sluice.runtime import warmup
from sluice.runtime.config import parse_config
from sluice.runtime.errors import ConfigError

from .conftest import ADD_SUB_CONFIG, BUILDERS, write_model  # type: ignore[import-not-found]

PROBE_PY = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.executes = []  # (rows, names of the first request's inputs, sum of X over the batch)

    def execute(self, requests):
        names = sorted(t.name() for t in requests[0].inputs())
        total = float(sum(pb_utils.get_input_tensor_by_name(r, "X").as_numpy().sum() for r in requests))
        self.executes.append((len(requests), names, total))
        seen = np.array([[json.dumps(self.executes)]], dtype=object)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("SEEN", seen)]) for _ in requests]
"""

PROBE_CONFIG = """
name: "probe"
backend: "python"
max_batch_size: 8
input [ { name: "X", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "SEEN", data_type: TYPE_STRING, dims: [ 1 ] } ]
"""


def _seen(url: str, model: str = "probe") -> list:
    client = httpclient.InferenceServerClient(url)
    x = httpclient.InferInput("X", [1, 4], "FP32")
    x.set_data_from_numpy(np.zeros((1, 4), np.float32))
    return json.loads(client.infer(model, [x]).as_numpy("SEEN")[0][0])


def _probe(repo: Path, warmups: str, name: str = "probe", extra: str = "") -> Path:
    config = PROBE_CONFIG.replace('"probe"', f'"{name}"') + extra + warmups
    return write_model(repo, name, config, {"model.py": PROBE_PY})


def test_every_instance_runs_each_sample_count_times_before_the_first_request(tmp_path, serve) -> None:
    repo = tmp_path / "repo"
    model_dir = _probe(
        repo,
        """
        instance_group [ { kind: KIND_CPU, count: 2 } ]
        model_warmup [
          { name: "zeros", batch_size: 2, count: 3,
            inputs { key: "X" value: { data_type: TYPE_FP32, dims: [ 4 ], zero_data: true } } },
          { name: "file", batch_size: 1,
            inputs { key: "X" value: { data_type: TYPE_FP32, dims: [ 4 ], input_data_file: "x.bin" } } },
          { name: "skipped", batch_size: 0,
            inputs { key: "X" value: { data_type: TYPE_FP32, dims: [ 4 ], zero_data: true } } }
        ]
        """,
    )
    (model_dir / "warmup").mkdir()
    # the first 16 bytes are the sample's [1, 4]; Triton ignores the rest
    (model_dir / "warmup" / "x.bin").write_bytes(np.array([1, 2, 3, 4, 99], "<f4").tobytes())
    server = serve(repo)
    seen = _seen(server.http)
    # whichever of the two instances answered: 3 batches of 2 zero rows, one row of the file, then us
    assert seen[:4] == [[2, ["X"], 0.0]] * 3 + [[1, ["X"], 10.0]]
    assert seen[4] == [1, ["X"], 0.0] and len(seen) == 5
    stats = httpclient.InferenceServerClient(server.http).get_inference_statistics("probe")["model_stats"][0]
    assert stats["inference_count"] == 1 and stats["execution_count"] == 1  # warmup is not counted


def test_random_data_warms_an_onnx_model_and_a_count_of_zero_runs_once(tmp_path, serve) -> None:
    # add_sub does not batch: its sample's two requests run together, each of dims, as in Triton
    repo = tmp_path / "repo"
    warmups = """
    model_warmup [ { name: "random", batch_size: 2,
      inputs { key: "INPUT0" value: { data_type: TYPE_FP32, dims: [ 16 ], random_data: true } }
      inputs { key: "INPUT1" value: { data_type: TYPE_FP32, dims: [ 16 ], zero_data: true } } } ]
    """
    write_model(repo, "add_sub", ADD_SUB_CONFIG + warmups, {"model.onnx": BUILDERS.add_sub_model()})
    _probe(repo, 'model_warmup [ { name: "once", batch_size: 1, count: 0, '
           'inputs { key: "X" value: { data_type: TYPE_FP32, dims: [ 4 ], random_data: true } } } ]')
    server = serve(repo)
    client = grpcclient.InferenceServerClient(server.grpc)
    assert client.is_model_ready("add_sub")
    inputs = [grpcclient.InferInput(n, [16], "FP32") for n in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(np.ones(16, np.float32))
    np.testing.assert_array_equal(client.infer("add_sub", inputs).as_numpy("OUTPUT0"), np.full(16, 2.0, np.float32))
    seen = _seen(server.http)
    assert len(seen) == 2 and seen[0][0] == 1  # count 0: used once (Triton)
    assert seen[0][2] != 0.0  # random bytes, not zeros


def test_a_sample_sets_the_sequence_control_inputs(tmp_path, serve) -> None:
    repo = tmp_path / "repo"
    _probe(
        repo,
        """
        model_warmup [ { name: "start", batch_size: 1,
          inputs { key: "X" value: { data_type: TYPE_FP32, dims: [ 4 ], zero_data: true } }
          inputs { key: "START" value: { data_type: TYPE_INT32, dims: [ 1 ], zero_data: true } } } ]
        """,
        name="seq",
        extra="""
        sequence_batching {
          control_input [ { name: "START", control [ { kind: CONTROL_SEQUENCE_START, int32_false_true: [ 0, 1 ] } ] } ]
        }
        """,
    )
    server = serve(repo)
    client = httpclient.InferenceServerClient(server.http)
    x = httpclient.InferInput("X", [1, 4], "FP32")
    x.set_data_from_numpy(np.zeros((1, 4), np.float32))
    seen = json.loads(
        client.infer("seq", [x], sequence_id=7, sequence_start=True, sequence_end=True).as_numpy("SEEN")[0][0]
    )
    assert seen[0] == [1, ["START", "X"], 0.0]


def test_a_failing_sample_fails_the_load_with_tritons_words(tmp_path, serve) -> None:
    repo = tmp_path / "repo"
    failing = PROBE_PY.replace(
        "        names = sorted", "        raise RuntimeError('not warm yet')\n        names = sorted"
    )
    config = PROBE_CONFIG + (
        'model_warmup [ { name: "boom", batch_size: 1, '
        'inputs { key: "X" value: { data_type: TYPE_FP32, dims: [ 4 ], zero_data: true } } } ]'
    )
    write_model(repo, "probe", config, {"model.py": failing})
    server = serve(repo, strict_readiness=False)
    client = httpclient.InferenceServerClient(server.http)
    assert not client.is_model_ready("probe")
    reason = {m["name"]: m for m in client.get_model_repository_index()}["probe"].get("reason", "")
    assert "failed to run warmup sample 'boom' on instance 'probe_0'" in reason, reason
    assert "not warm yet" in reason and str(tmp_path) not in reason


BAD_SAMPLES = [
    ('{ name: "s", batch_size: 1, inputs { key: "X" value: { data_type: TYPE_FP32, dims: [ -1 ], zero_data: true } } }',
     "model_warmup[0].inputs[X].dims", "variable-size dimensions are specified for input 'X'"),
    ('{ name: "s", batch_size: 1, inputs { key: "Y" value: { data_type: TYPE_FP32, dims: [ 4 ], zero_data: true } } }',
     "model_warmup[0].inputs[Y]", "sets input 'Y', which the model does not have; allowed: X"),
    ('{ name: "s", batch_size: 1, inputs { key: "X" value: { data_type: TYPE_FP32, dims: [ 4 ] } } }',
     "model_warmup[0].inputs[X]", "allowed: zero_data, random_data, input_data_file"),
    ('{ name: "s", batch_size: 9, inputs { key: "X" value: { data_type: TYPE_FP32, dims: [ 4 ], zero_data: true } } }',
     "model_warmup[0].batch_size", "allowed: 0 (skip the sample) to 8 (max_batch_size)"),
    ('{ name: "s", batch_size: 1, inputs { key: "X" value: '
     '{ data_type: TYPE_FP32, dims: [ 4 ], input_data_file: "../config.pbtxt" } } }',
     "model_warmup[0].inputs[X].input_data_file", "must be a relative path inside the model's warmup/ directory"),
    ('{ name: "s", batch_size: 1, inputs { key: "X" value: '
     '{ data_type: TYPE_FP32, dims: [ 4 ], input_data_file: "absent.bin" } } }',
     "model_warmup[0].inputs[X].input_data_file", "cannot read warmup/absent.bin"),
    ('{ name: "s", batch_size: 1, inputs { key: "X" value: '
     '{ data_type: TYPE_FP32, dims: [ 4 ], input_data_file: "short.bin" } } }',
     "model_warmup[0].inputs[X].input_data_file",
     "warmup setting expects 16 bytes, but the data provided from warmup/short.bin only has 8 bytes"),
    ('{ name: "s", batch_size: 1, inputs { key: "X" value: '
     '{ data_type: TYPE_FP32, dims: [ 4294967296, 4294967296 ], zero_data: true } } }',
     "model_warmup[0].inputs[X].dims", "bytes; allowed: at most 1073741824 bytes a request"),
    ('{ name: "s", batch_size: 1, inputs { key: "X" value: { data_type: TYPE_INT32, dims: [ 4 ], zero_data: true } } }',
     None, "failed to run warmup sample 's' on instance 'probe_0'"),
    ('{ name: "s", batch_size: 1, inputs { key: "X" value: { data_type: TYPE_FP32, dims: [ 5 ], zero_data: true } } }',
     None, "failed to run warmup sample 's' on instance 'probe_0'"),
]


@pytest.mark.parametrize(("sample", "field", "words"), BAD_SAMPLES)
def test_a_sample_that_cannot_run_is_refused_naming_the_field(tmp_path, serve, sample, field, words) -> None:
    repo = tmp_path / "repo"
    model_dir = _probe(repo, f"model_warmup [ {sample} ]\n")
    (model_dir / "warmup").mkdir()
    (model_dir / "warmup" / "short.bin").write_bytes(b"\0" * 8)
    server = serve(repo, model_control_mode="explicit")  # nothing loaded at start
    client = httpclient.InferenceServerClient(server.http)
    with pytest.raises(InferenceServerException) as caught:
        client.load_model("probe")
    message = caught.value.message()
    assert str(caught.value.status()) == "400" and words in message, message
    if field is not None:
        assert f"field '{field}'" in message and "config.pbtxt" in message, message
    assert str(tmp_path) not in message
    assert not client.is_model_ready("probe")


def test_bytes_from_a_file_are_tritons_length_prefixed_strings(tmp_path) -> None:
    config = parse_config(
        """
        name: "s" backend: "python" max_batch_size: 0
        input [ { name: "T", data_type: TYPE_STRING, dims: [ 2 ] } ]
        output [ { name: "O", data_type: TYPE_STRING, dims: [ 2 ] } ]
        model_warmup [
          { name: "file", batch_size: 1,
            inputs { key: "T" value: { data_type: TYPE_STRING, dims: [ 2 ], input_data_file: "t" } } },
          { name: "zeros", batch_size: 1,
            inputs { key: "T" value: { data_type: TYPE_STRING, dims: [ 2 ], random_data: true } } }
        ]
        """,
        path="s/config.pbtxt",
        fmt="pbtxt",
    )
    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "t").write_bytes(b"".join(struct.pack("<I", len(v)) + v for v in (b"ab", b"")))
    samples = warmup.build(config, tmp_path, "s/config.pbtxt")
    assert [s.name for s in samples] == ["file", "zeros"]
    assert samples[0].inputs[0].data.tolist() == [b"ab", b""]  # not batched: dims as they are
    assert samples[1].inputs[0].data.tolist() == [b"", b""]  # random strings are empty, as Triton's
    (tmp_path / "warmup" / "t").write_bytes(struct.pack("<I", 2) + b"ab")
    with pytest.raises(ConfigError, match="is not 2 length-prefixed strings"):
        warmup.build(config, tmp_path, "s/config.pbtxt")
    assert mc.ModelWarmup.Input.DESCRIPTOR.oneofs_by_name["input_data_type"]  # the field warmup.py reads


DECOUPLED_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sent = 0

    def execute(self, requests):
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            sender = request.get_response_sender()
            self.sent += 1
            if x.sum() == 0 and FAIL:  # the warmup's zeros
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("warm fail")),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            seen = np.array([[str(self.sent)]], dtype=object)
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("SEEN", seen)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


@pytest.mark.parametrize("fail", [False, True])
def test_a_decoupled_models_warmup_waits_for_its_responses_and_their_errors_count(tmp_path, serve, fail) -> None:
    repo = tmp_path / "repo"
    config = PROBE_CONFIG + (
        "model_transaction_policy { decoupled: true }\n"
        'model_warmup [ { name: "streamed", batch_size: 1, '
        'inputs { key: "X" value: { data_type: TYPE_FP32, dims: [ 4 ], zero_data: true } } } ]'
    )
    write_model(repo, "probe", config, {"model.py": DECOUPLED_PY.replace("FAIL", str(fail))})
    server = serve(repo, strict_readiness=False)
    client = httpclient.InferenceServerClient(server.http)
    if fail:  # Triton fails the load on an error response of a warmup request
        assert not client.is_model_ready("probe")
        reason = {m["name"]: m for m in client.get_model_repository_index()}["probe"].get("reason", "")
        assert "failed to run warmup sample 'streamed' on instance" in reason and "warm fail" in reason, reason
        return
    assert client.is_model_ready("probe")
    grpc = grpcclient.InferenceServerClient(server.grpc)
    answers: list = []
    grpc.start_stream(callback=lambda result, error: answers.append((result, error)))
    x = grpcclient.InferInput("X", [1, 4], "FP32")
    x.set_data_from_numpy(np.ones((1, 4), np.float32))
    grpc.async_stream_infer("probe", [x])
    grpc.stop_stream()
    assert [a[1] for a in answers] == [None] and answers[0][0].as_numpy("SEEN")[0][0] == b"2"  # warmup was 1
