"""Sequence batching end to end: a real server on loopback, tritonclient over HTTP, gRPC and the gRPC
stream, with stateful ONNX and Python models generated here (sluice_testing.sequence_models).

Sequences of one model are interleaved across the three transports; idle release runs on a fake
clock (``Server(settings, clock=...)``); the errors are Triton's.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from sluice_testing import sequence_models as sm

from .conftest import ManualClock, write_model  # type: ignore[import-not-found]

PY_OUTPUTS = ', { name: "CORR", data_type: TYPE_STRING, dims: [ 1 ] }'


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    write_model(root, "acc_onnx", sm.accumulator_config("acc_onnx"), {"model.onnx": sm.accumulator_onnx()})
    write_model(
        root,
        "acc_oldest",
        sm.accumulator_config(
            "acc_oldest",
            strategy="oldest { max_candidate_sequences: 4 preferred_batch_size: [ 2 ] }",
            controls=(sm.START, sm.READY, sm.CORRID_UINT64),
            instances=2,
            extra_outputs=', { name: "OUTPUT_ID", data_type: TYPE_UINT64, dims: [ 1 ] }',
        ),
        {"model.onnx": sm.accumulator_onnx(corrid=True)},
    )
    write_model(
        root,
        "acc_py",
        sm.accumulator_config(
            "acc_py", backend="python", controls=(sm.START, sm.READY, sm.CORRID_STRING), extra_outputs=PY_OUTPUTS
        ),
        {"model.py": sm.ACCUMULATOR_PY},
    )
    write_model(
        root,
        "acc_idle",
        sm.accumulator_config("acc_idle", idle_us=5_000_000),
        {"model.onnx": sm.accumulator_onnx()},
    )
    return root


def _input(module: Any, value: int) -> Any:
    tensor = module.InferInput("INPUT", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    return tensor


class Streams:
    """One gRPC stream whose answers are read back in order."""

    def __init__(self, url: str) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.answers: queue.Queue[Any] = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.answers.put(error or result))

    def send(self, model: str, value: int, sequence_id: int | str, start: bool = False, end: bool = False) -> Any:
        self.client.async_stream_infer(
            model, [_input(grpcclient, value)], sequence_id=sequence_id, sequence_start=start, sequence_end=end
        )
        return self.answers.get(timeout=10)

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


@pytest.fixture
def clients(serve: Callable[..., Any], repo: Path) -> Any:
    server = serve(repo)
    http = httpclient.InferenceServerClient(server.http)
    grpc = grpcclient.InferenceServerClient(server.grpc)
    stream = Streams(server.grpc)
    yield http, grpc, stream
    stream.close()
    grpc.close()
    http.close()


def _call(client: Any, model: str, value: int, sequence_id: int | str, **flags: bool) -> Any:
    if isinstance(client, Streams):
        result = client.send(model, value, sequence_id, **flags)
        if isinstance(result, InferenceServerException):
            raise result
        return result
    module = httpclient if isinstance(client, httpclient.InferenceServerClient) else grpcclient
    return client.infer(
        model,
        [_input(module, value)],
        sequence_id=sequence_id,
        sequence_start=flags.get("start", False),
        sequence_end=flags.get("end", False),
    )


@pytest.mark.parametrize("model", ["acc_onnx", "acc_oldest", "acc_py"])
def test_three_sequences_interleaved_across_http_grpc_and_the_stream_keep_their_own_state(clients, model):
    http, grpc, stream = clients
    transports = [http, grpc, stream]
    ids: list[int | str] = [101, 102, 103] if model != "acc_py" else ["alpha", "beta", "gamma"]
    values = {101: [1, 2, 3, 4], 102: [10, 20, 30, 40], 103: [-5, 5, -5, 5]}
    by_id = dict(zip(ids, values.values(), strict=True))
    totals = dict.fromkeys(ids, 0)
    for step in range(4):
        for turn, sid in enumerate(ids):
            # each step moves every sequence to the next transport: one sequence crosses all three
            client = transports[(turn + step) % 3]
            value = by_id[sid][step]
            result = _call(client, model, value, sid, start=step == 0, end=step == 3)
            totals[sid] += value
            assert result.as_numpy("OUTPUT").tolist() == [[totals[sid]]], (model, sid, step)
            assert result.as_numpy("ACC_OUT") is None  # the state output stays on the server
            if model == "acc_oldest":
                assert result.as_numpy("OUTPUT_ID").tolist() == [[sid]]  # CORRID fed as UINT64
            if model == "acc_py":
                assert result.as_numpy("CORR").tolist() == [[str(sid).encode()]]


def test_a_request_without_start_for_an_unknown_sequence_is_refused_in_tritons_words(clients):
    http, grpc, stream = clients
    for client in (http, grpc):
        with pytest.raises(InferenceServerException) as caught:
            _call(client, "acc_onnx", 1, 4242)
        message = caught.value.message()
        assert message.startswith(
            "inference request for sequence 4242 to model 'acc_onnx' must specify the START flag on the first "
            "request of the sequence"
        ), message
        assert caught.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    error = stream.send("acc_onnx", 1, 4242)
    assert isinstance(error, InferenceServerException)
    assert "must specify the START flag" in error.message()
    # the stream goes on after an error
    assert stream.send("acc_onnx", 7, 4242, start=True, end=True).as_numpy("OUTPUT").tolist() == [[7]]


def test_missing_or_zero_sequence_id_is_refused(clients):
    http, grpc, _ = clients
    with pytest.raises(InferenceServerException, match="must specify a non-zero or non-empty correlation ID"):
        http.infer("acc_onnx", [_input(httpclient, 1)])
    with pytest.raises(InferenceServerException, match="must specify a non-zero or non-empty correlation ID"):
        grpc.infer("acc_onnx", [_input(grpcclient, 1)], sequence_id=0, sequence_start=True)


def test_a_sequence_id_of_the_wrong_type_names_both_types(clients):
    http, grpc, _ = clients
    with pytest.raises(InferenceServerException) as caught:
        _call(grpc, "acc_oldest", 1, "text-id", start=True)
    message = caught.value.message()
    assert "string 'text-id'" in message and "TYPE_UINT64" in message and "'CORRID'" in message
    with pytest.raises(InferenceServerException) as caught:
        _call(http, "acc_py", 1, 77, start=True)
    assert "integer 77" in caught.value.message() and "TYPE_STRING" in caught.value.message()


def test_start_on_an_active_sequence_restarts_its_state(clients):
    http, grpc, _ = clients
    assert _call(http, "acc_onnx", 5, 9, start=True).as_numpy("OUTPUT").tolist() == [[5]]
    assert _call(grpc, "acc_onnx", 5, 9).as_numpy("OUTPUT").tolist() == [[10]]
    assert _call(http, "acc_onnx", 3, 9, start=True).as_numpy("OUTPUT").tolist() == [[3]]
    assert _call(grpc, "acc_onnx", 1, 9, end=True).as_numpy("OUTPUT").tolist() == [[4]]
    with pytest.raises(InferenceServerException, match="must specify the START flag"):
        _call(http, "acc_onnx", 1, 9)  # ended


def test_batch_size_over_one_is_refused(clients):
    http, _, _ = clients
    tensor = httpclient.InferInput("INPUT", [2, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[1], [2]], dtype=np.int32))
    with pytest.raises(InferenceServerException, match="must specify batch-size 1"):
        http.infer("acc_onnx", [tensor], sequence_id=5, sequence_start=True)


def test_an_idle_sequence_is_released_on_the_fake_clock(serve, repo):
    clock = ManualClock()
    server = serve(repo, clock=clock)
    client = httpclient.InferenceServerClient(server.http)
    assert _call(client, "acc_idle", 2, 31, start=True).as_numpy("OUTPUT").tolist() == [[2]]
    assert _call(client, "acc_idle", 2, 32, start=True).as_numpy("OUTPUT").tolist() == [[2]]
    clock.advance(4.0)  # below the 5 s idle limit: both stay
    server.settle()
    assert _call(client, "acc_idle", 3, 31).as_numpy("OUTPUT").tolist() == [[5]]
    clock.advance(1.5)  # 32 has now been idle 5.5 s; 31 only 1.5 s
    server.settle()
    with pytest.raises(InferenceServerException) as caught:
        _call(client, "acc_idle", 1, 32)
    assert "sequence 32" in caught.value.message() and "5000000 us idle" in caught.value.message()
    assert _call(client, "acc_idle", 1, 31, end=True).as_numpy("OUTPUT").tolist() == [[6]]
    client.close()


def test_a_state_with_a_variable_dim_grows_apart_between_sequences_in_one_batch(serve, tmp_path):
    """Direct, two slots: sequence 32 (slot 1) runs while slot 0 is empty, so its row is batched with a
    padding row whose state must take the shape of 32's grown state (Triton's null request takes its
    states from the batch's request); then both sequences send at once with states of different sizes."""
    root = tmp_path / "repo"
    write_model(root, "history", sm.HISTORY_CONFIG, {"model.onnx": sm.history_onnx()})
    server = serve(root)
    client = grpcclient.InferenceServerClient(server.grpc)
    assert _call(client, "history", 1, 31, start=True).as_numpy("OUTPUT").tolist() == [[1]]
    assert _call(client, "history", 10, 32, start=True).as_numpy("OUTPUT").tolist() == [[10]]
    assert _call(client, "history", 10, 32).as_numpy("OUTPUT").tolist() == [[20]]  # padded below slot 1
    assert _call(client, "history", 10, 32).as_numpy("OUTPUT").tolist() == [[30]]
    answers: queue.Queue[Any] = queue.Queue()
    for cid, value in ((31, 2), (32, 10)):  # history of 2 and of 4 values: never one batch
        client.async_infer(
            "history",
            [_input(grpcclient, value)],
            callback=lambda result, error, cid=cid: answers.put((cid, error or result)),
            sequence_id=cid,
        )
    got = dict(answers.get(timeout=10) for _ in range(2))
    assert {cid: result.as_numpy("OUTPUT").tolist() for cid, result in got.items()} == {31: [[3]], 32: [[40]]}
    client.close()


def test_sequence_batching_config_errors_name_file_line_field_and_allowed(serve, tmp_path):
    root = tmp_path / "bad"
    config = sm.accumulator_config("bad").replace("int32_false_true: [ 0, 1 ] } ] }", "} ] }", 1)
    write_model(root, "bad", config, {"model.onnx": sm.accumulator_onnx()})
    server = serve(root, strict_readiness=False)
    client = httpclient.InferenceServerClient(server.http)
    with pytest.raises(InferenceServerException) as caught:
        client.infer("bad", [_input(httpclient, 1)], sequence_id=1, sequence_start=True)
    message = caught.value.message()
    assert "config.pbtxt:" in message and "sequence_batching.control_input[0].control[0]" in message
    assert "int32_false_true, fp32_false_true, bool_false_true" in message
    assert str(tmp_path) not in message
    client.close()


ENSEMBLE_OVER_ACC_ONE = """
name: "ens_acc"
platform: "ensemble"
max_batch_size: 1
input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
ensemble_scheduling { step [ { model_name: "acc_one" model_version: -1
  input_map { key: "INPUT" value: "IN" } output_map { key: "OUTPUT" value: "OUT" } } ] }
"""


@pytest.mark.parametrize("through", ["acc_one", "ens_acc"], ids=["model", "ensemble"])
def test_sequences_waiting_for_a_slot_do_not_stop_a_stream_from_reading_the_end_that_frees_it(
    serve, tmp_path, through
):
    """One slot (max_batch_size 1, one instance), one stream: sequence A holds the slot; 70 one-request
    sequences queue for it (more than the stream's 64 requests in flight); then A's END comes on the
    same stream. The waiting requests give their in-flight slots back, so the stream reads A's END, A
    ends and frees the slot, and every waiting sequence runs. Before, the stream stopped reading after
    64 of them: A's END stayed unread until A's idle timeout cut A short (here never: one hour)."""
    root = tmp_path / "repo"
    write_model(root, "acc_one", sm.accumulator_config("acc_one", max_batch_size=1, idle_us=3_600_000_000),
                {"model.onnx": sm.accumulator_onnx()})
    write_model(root, "ens_acc", ENSEMBLE_OVER_ACC_ONE, {})  # its step's wait is the ensemble request's
    server = serve(root)
    tensor_in, tensor_out = ("INPUT", "OUTPUT") if through == "acc_one" else ("IN", "OUT")
    client = grpcclient.InferenceServerClient(server.grpc)
    answers: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put(error or result))
    try:
        def send(value: int, sequence_id: int, request_id: str, **flags: bool) -> None:
            tensor = grpcclient.InferInput(tensor_in, [1, 1], "INT32")
            tensor.set_data_from_numpy(np.array([[value]], dtype=np.int32))
            client.async_stream_infer(through, [tensor], sequence_id=sequence_id,
                                      request_id=request_id, sequence_start=flags.get("start", False),
                                      sequence_end=flags.get("end", False))

        send(1, 1, "a-start", start=True)
        first = answers.get(timeout=30)
        assert not isinstance(first, InferenceServerException), first
        assert first.as_numpy(tensor_out).item() == 1
        waiting = 70
        for k in range(waiting):
            send(10 + k, 100 + k, f"b{k}", start=True, end=True)
        send(2, 1, "a-end", end=True)
        got = {}
        for _ in range(waiting + 1):
            answer = answers.get(timeout=30)
            assert not isinstance(answer, InferenceServerException), answer
            got[answer.get_response().id] = answer.as_numpy(tensor_out).item()
        assert got == {"a-end": 3, **{f"b{k}": 10 + k for k in range(waiting)}}
    finally:
        client.stop_stream()
        client.close()
