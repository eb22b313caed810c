"""OpenTelemetry tracing (runtime/tracing.py): the pure parts, then the real server on loopback with
the SDK's in-memory exporter, called with tritonclient over HTTP and gRPC.

Spans are exported when a request's response has been written, which may be just after the client
read it; tests wait for them on a condition (never a sleep). Absence is checked behind a barrier: a
request with a sampled ``traceparent`` (always traced) sent after the others; the server answers
and exports in order on one loop, so once the barrier's span is there, every earlier one is too.
"""

from __future__ import annotations

import itertools
import logging
import queue
import secrets
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from tritonclient.utils import InferenceServerException

from sluice.runtime import tracing
from sluice.runtime.errors import InvalidArgument
from sluice.runtime.settings import TraceLevels, TracingSettings
from sluice_testing import sequence_models as sm

from .conftest import ADD_SUB_CONFIG, BUILDERS, MLP_CONFIG, write_model
from .test_python_bls_decoupled import (  # type: ignore[import-not-found]
    BLS_SQUARE_PY,
    FAILING_DECOUPLED_PY,
    SQUARE_CONFIG,
    SQUARE_PY,
)
from .test_split_forwarding import write_split  # type: ignore[import-not-found]

# --- pure parts ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "check"),
    [
        ([], lambda s: s.levels == TraceLevels() and s.url == "http://localhost:4318/v1/traces"),
        (["level=TIMESTAMPS", "rate=1"], lambda s: s.levels.level == ("TIMESTAMPS",) and s.levels.rate == 1),
        (["mode=opentelemetry", "count=5"], lambda s: s.levels.count == 5),
        (["opentelemetry,url=http://collector:4318/v1/traces"], lambda s: s.url == "http://collector:4318/v1/traces"),
        (
            ["opentelemetry,resource=service.name=edge", "opentelemetry,resource=deployment.environment=prod"],
            lambda s: dict(s.resource) == {"service.name": "edge", "deployment.environment": "prod"},
        ),
        (["opentelemetry,bsp_schedule_delay=200"], lambda s: s.bsp_schedule_delay_ms == 200),
        (["level=TIMESTAMPS", "level=OFF"], lambda s: s.levels.level == ("OFF",)),
    ],
)
def test_trace_config_accepts_tritons_syntax(values, check):
    assert check(tracing.parse_trace_config(values))


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("rate=abc", "trace setting 'trace_rate': 'abc' is not allowed; allowed: an integer >= 0"),
        ("rate=-1", "'trace_rate': '-1' is not allowed"),
        ("count=-2", "'trace_count': '-2' is not allowed; allowed: an integer >= -1"),
        ("level=TENSORS", "'trace_level': ['TENSORS'] is not allowed; allowed: OFF or TIMESTAMPS"),
        ("mode=triton", "mode 'triton' is not supported; allowed: opentelemetry"),
        ("triton,file=/tmp/t.json", "Triton's file trace mode is not supported"),
        ("opentelemetry,url=collector:4318", "allowed: an http:// or https:// URL"),
        ("opentelemetry,resource=novalue", "allowed: resource=<key>=<value>"),
        ("opentelemetry,bsp_max_queue_size=0", "allowed: an integer > 0"),
        ("sample=1", "unknown setting; allowed: level=, rate=, count="),
        ("rate", "expected [<mode>,]<setting>=<value>"),
    ],
)
def test_trace_config_refuses_bad_values_naming_them(value, words):
    with pytest.raises(tracing.TraceConfigError) as caught:
        tracing.parse_trace_config([value])
    message = str(caught.value)
    assert message.startswith(f"--trace-config {value}: ")
    assert words in message
    assert "\n" not in message


def test_trace_config_checks_the_batch_against_the_queue():
    with pytest.raises(tracing.TraceConfigError, match="allowed: at most bsp_max_queue_size"):
        tracing.parse_trace_config(
            ["opentelemetry,bsp_max_queue_size=10", "opentelemetry,bsp_max_export_batch_size=20"]
        )


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN_ID = "00f067aa0ba902b7"


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (f"00-{TRACE_ID}-{SPAN_ID}-01", (int(TRACE_ID, 16), int(SPAN_ID, 16), True)),
        (f"00-{TRACE_ID}-{SPAN_ID}-00".encode(), (int(TRACE_ID, 16), int(SPAN_ID, 16), False)),
        (f"01-{TRACE_ID}-{SPAN_ID}-03-future", (int(TRACE_ID, 16), int(SPAN_ID, 16), True)),  # later versions: read
        (None, None),
        ("", None),
        ("garbage", None),
        (f"00-{TRACE_ID.upper()}-{SPAN_ID}-01", None),  # W3C: lowercase hex only
        (f"00-{'0' * 32}-{SPAN_ID}-01", None),  # all-zero ids are invalid
        (f"00-{TRACE_ID}-{'0' * 16}-01", None),
        (f"ff-{TRACE_ID}-{SPAN_ID}-01", None),
        (f"00-{TRACE_ID}-{SPAN_ID}-01-extra", None),  # version 00 has nothing after the flags
    ],
)
def test_traceparent(header, expected):
    assert tracing.parse_traceparent(header) == expected


def test_sampler_takes_every_rateth_request_while_the_count_lasts():
    sampler = tracing.Sampler(count=2)
    levels = TraceLevels(level=("TIMESTAMPS",), rate=3, count=2)
    taken = [sampler.sample(levels, sampled_parent=False) for _ in range(12)]
    assert taken == [False, False, True, False, False, True] + [False] * 6
    assert sampler.remaining == 0
    assert sampler.sample(levels, sampled_parent=True)  # a caller's sampled trace: always, as Triton


def test_sampler_off_or_rate_zero():
    on_rate_zero = TraceLevels(level=("TIMESTAMPS",), rate=0)
    assert not tracing.Sampler(-1).sample(on_rate_zero, sampled_parent=False)
    assert tracing.Sampler(-1).sample(on_rate_zero, sampled_parent=True)
    assert not tracing.Sampler(-1).sample(TraceLevels(rate=1), sampled_parent=True)  # level OFF: nothing


def test_updated_checks_every_change_before_applying_any():
    with pytest.raises(InvalidArgument, match="'trace_count'"):
        tracing.updated({"rate": 5}, {"trace_rate": ["7"], "trace_count": ["x"]})
    assert tracing.updated({"rate": 5}, {"trace_rate": None, "trace_count": ["3"]}) == {"count": 3}
    with pytest.raises(InvalidArgument, match="unknown trace setting 'rate'; allowed: trace_level, trace_rate"):
        tracing.updated({}, {"rate": ["1"]})


# --- the server ---------------------------------------------------------------------------------------


class Exporter(InMemorySpanExporter):
    """The SDK's in-memory exporter, with a wait for spans to arrive."""

    def __init__(self) -> None:
        super().__init__()
        self._arrived = threading.Condition()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = super().export(spans)
        with self._arrived:
            self._arrived.notify_all()
        return result

    def wait(self, predicate: Callable[[list[ReadableSpan]], bool], timeout: float = 20) -> list[ReadableSpan]:
        with self._arrived:
            assert self._arrived.wait_for(lambda: predicate(list(self.get_finished_spans())), timeout)
        return list(self.get_finished_spans())

    def request_spans(self, count: int) -> list[ReadableSpan]:
        """Wait for ``count`` top-level request spans (SERVER kind) and return them."""
        spans = self.wait(lambda spans: sum(s.kind == SpanKind.SERVER for s in spans) >= count)
        return [s for s in spans if s.kind == SpanKind.SERVER]


def children(spans: list[ReadableSpan], parent: ReadableSpan) -> dict[str, ReadableSpan]:
    return {s.name: s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id}


def traceparent(sampled: bool = True) -> tuple[str, int, int]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}", int(trace_id, 16), int(span_id, 16)


BLS_PY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            inner = pb_utils.InferenceRequest(
                model_name="add_sub",
                inputs=[pb_utils.Tensor("INPUT0", pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()),
                        pb_utils.Tensor("INPUT1", pb_utils.get_input_tensor_by_name(request, "IN").as_numpy())],
                requested_output_names=["OUTPUT0"],
            )
            result = inner.exec()
            if result.has_error():
                raise pb_utils.TritonModelException(result.error().message())
            out = pb_utils.get_output_tensor_by_name(result, "OUTPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)]))
        return responses
"""

BLS_CONFIG = """
name: "bls"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 16 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 16 ] } ]
"""

CHAIN = """
name: "chain"
platform: "ensemble"
max_batch_size: 0
input [ { name: "A", data_type: TYPE_FP32, dims: [ 16 ] }, { name: "B", data_type: TYPE_FP32, dims: [ 16 ] } ]
output [ { name: "SUM", data_type: TYPE_FP32, dims: [ 16 ] } ]
ensemble_scheduling {
  step [
    {
      model_name: "add_sub"
      input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "B" }
      output_map { key: "OUTPUT0" value: "s" } output_map { key: "OUTPUT1" value: "d" }
    },
    {
      model_name: "add_sub"
      input_map { key: "INPUT0" value: "s" } input_map { key: "INPUT1" value: "d" }
      output_map { key: "OUTPUT0" value: "SUM" }
    }
  ]
}
"""


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    write_model(repo, "mlp", MLP_CONFIG, {"model.onnx": BUILDERS.mlp_model()})
    write_model(repo, "bls", BLS_CONFIG, {"model.py": BLS_PY})
    write_model(repo, "chain", CHAIN, {})
    return repo


@pytest.fixture
def kinds_repo(repo: Path) -> Path:
    """``repo`` and models of the other request kinds: decoupled (``square`` streams IN responses,
    ``failing`` raises), a decoupled BLS call (``bls_square``) and a sequence model (``acc``)."""
    write_model(repo, "square", SQUARE_CONFIG, {"model.py": SQUARE_PY})
    write_model(repo, "failing", SQUARE_CONFIG.replace('"square"', '"failing"'), {"model.py": FAILING_DECOUPLED_PY})
    write_model(
        repo,
        "bls_square",
        'name: "bls_square"\nbackend: "python"\ninput [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'output [ { name: "SUM" data_type: TYPE_INT32 dims: [ 1 ] } ]\n',
        {"model.py": BLS_SQUARE_PY},
    )
    write_model(repo, "acc", sm.accumulator_config("acc"), {"model.onnx": sm.accumulator_onnx()})
    return repo


def traced(rate: int = 1, **levels: Any) -> TracingSettings:
    return TracingSettings(levels=TraceLevels(level=("TIMESTAMPS",), rate=rate, **levels))


def add_sub_inputs(module: Any, names: tuple[str, str] = ("INPUT0", "INPUT1")) -> list[Any]:
    inputs = []
    for name in names:
        tensor = module.InferInput(name, [16], "FP32")
        tensor.set_data_from_numpy(np.arange(16, dtype=np.float32))
        inputs.append(tensor)
    return inputs


def mlp_inputs(module: Any) -> list[Any]:
    tensor = module.InferInput("INPUT0", [1, 16], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 16), dtype=np.float32))
    return [tensor]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_callers_trace_continues_into_the_server(serve, repo, protocol):
    exporter = Exporter()
    server = serve(repo, tracing=traced(rate=1000), span_exporter=exporter)
    header, trace_id, parent_span = traceparent(sampled=True)
    if protocol == "http":
        client: Any = httpclient.InferenceServerClient(server.http)
        module: Any = httpclient
    else:
        client = grpcclient.InferenceServerClient(server.grpc)
        module = grpcclient

    client.infer("mlp", mlp_inputs(module), request_id="r-1", headers={"traceparent": header, "sluice-caller": "app"})

    (request,) = exporter.request_spans(1)
    spans = exporter.wait(lambda spans: len(spans) >= 7)
    assert request.name == "infer mlp"
    assert request.context.trace_id == trace_id
    assert request.parent is not None and request.parent.span_id == parent_span and request.parent.is_remote
    assert request.attributes is not None
    assert dict(request.attributes) == {
        "sluice.protocol": protocol,
        "model_name": "mlp",
        "model_version": "1",
        "request_id": "r-1",
        "sluice.caller": "app",
        "sluice.batch_size": 1,
    }
    assert request.status.status_code == StatusCode.UNSET
    parts = children(spans, request)
    assert set(parts) == {"queue", "batch", "compute_input", "compute_infer", "compute_output", "response"}
    assert parts["batch"].attributes == {"sluice.batch_size": 1, "sluice.batch_requests": 1}
    order = ["queue", "batch", "compute_input", "compute_infer", "compute_output", "response"]
    for earlier, later in itertools.pairwise(order):
        assert parts[earlier].end_time <= parts[later].start_time, (earlier, later)
    assert request.start_time <= parts["queue"].start_time and parts["response"].end_time == request.end_time
    assert parts["compute_infer"].end_time > parts["compute_infer"].start_time  # the ONNX run itself was timed


def test_grpcio_front_end_traces_too(serve, repo):
    exporter = Exporter()
    server = serve(repo, tracing=traced(), span_exporter=exporter, grpc_server="grpcio")
    header, trace_id, _ = traceparent()
    grpcclient.InferenceServerClient(server.grpc).infer(
        "add_sub", add_sub_inputs(grpcclient), headers={"traceparent": header}
    )
    (request,) = exporter.request_spans(1)
    assert request.context.trace_id == trace_id
    assert {"queue", "compute_infer", "response"} <= set(children(exporter.wait(lambda s: len(s) >= 7), request))


@pytest.mark.parametrize("header", ["garbage", f"00-{TRACE_ID}-{SPAN_ID}", f"00-{'0' * 32}-{SPAN_ID}-01"])
def test_a_malformed_traceparent_starts_a_new_trace(serve, repo, header):
    exporter = Exporter()
    server = serve(repo, tracing=traced(), span_exporter=exporter)
    result = httpclient.InferenceServerClient(server.http).infer(
        "add_sub", add_sub_inputs(httpclient), headers={"traceparent": header}
    )
    assert result.as_numpy("OUTPUT0") is not None
    (request,) = exporter.request_spans(1)
    assert request.parent is None
    assert request.context.trace_id != int(TRACE_ID, 16)


def test_one_in_rate_requests_is_traced_and_the_count_stops_it(serve, repo):
    exporter = Exporter()
    server = serve(repo, tracing=traced(rate=3), span_exporter=exporter)
    client = httpclient.InferenceServerClient(server.http)
    for _ in range(9):
        client.infer("add_sub", add_sub_inputs(httpclient))
    barrier, barrier_trace, _ = traceparent()
    client.infer("add_sub", add_sub_inputs(httpclient), headers={"traceparent": barrier})
    spans = exporter.request_spans(4)
    assert spans[-1].context.trace_id == barrier_trace
    assert len(spans) == 4  # 3 of 9, then the barrier

    client.update_trace_settings(settings={"trace_count": "1", "trace_rate": "1"})
    for _ in range(3):
        client.infer("add_sub", add_sub_inputs(httpclient))
    barrier, barrier_trace, _ = traceparent()
    client.infer("add_sub", add_sub_inputs(httpclient), headers={"traceparent": barrier})
    spans = exporter.request_spans(6)
    assert spans[-1].context.trace_id == barrier_trace
    assert len(spans) == 6  # one more, then the count ran out
    assert client.get_trace_settings()["trace_count"] == "0"


def test_rate_zero_traces_only_callers_sampled_traces(serve, repo):
    exporter = Exporter()
    server = serve(repo, tracing=traced(rate=0), span_exporter=exporter)
    client = grpcclient.InferenceServerClient(server.grpc)
    unsampled, _, _ = traceparent(sampled=False)
    client.infer("add_sub", add_sub_inputs(grpcclient))
    client.infer("add_sub", add_sub_inputs(grpcclient), headers={"traceparent": unsampled})
    sampled, trace_id, _ = traceparent(sampled=True)
    client.infer("add_sub", add_sub_inputs(grpcclient), headers={"traceparent": sampled})
    spans = exporter.request_spans(1)
    assert [s.context.trace_id for s in spans] == [trace_id]


def test_ensemble_steps_are_children_of_the_ensemble_request(serve, repo):
    exporter = Exporter()
    server = serve(repo, tracing=traced(), span_exporter=exporter)
    header, trace_id, _ = traceparent()
    result = httpclient.InferenceServerClient(server.http).infer(
        "chain", add_sub_inputs(httpclient, ("A", "B")), headers={"traceparent": header}
    )
    np.testing.assert_allclose(result.as_numpy("SUM"), 2 * np.arange(16, dtype=np.float32))
    (request,) = exporter.request_spans(1)
    spans = exporter.wait(lambda spans: sum(s.name == "ensemble step add_sub" for s in spans) == 2)
    assert request.name == "infer chain"
    steps = [s for s in spans if s.name == "ensemble step add_sub"]
    assert all(s.parent is not None and s.parent.span_id == request.context.span_id for s in steps)
    assert all(s.context.trace_id == trace_id and s.kind == SpanKind.INTERNAL for s in steps)
    first, second = sorted(steps, key=lambda s: s.start_time)
    assert first.end_time <= second.start_time  # the second step needs the first one's outputs
    assert {"queue", "batch", "compute_infer"} <= set(children(spans, first))
    assert "response" in children(spans, request)


def test_bls_calls_are_children_of_the_calling_request(serve, repo):
    exporter = Exporter()
    server = serve(repo, tracing=traced(), span_exporter=exporter)
    tensor = grpcclient.InferInput("IN", [16], "FP32")
    tensor.set_data_from_numpy(np.arange(16, dtype=np.float32))
    result = grpcclient.InferenceServerClient(server.grpc).infer("bls", [tensor])
    np.testing.assert_allclose(result.as_numpy("OUT"), 2 * np.arange(16, dtype=np.float32))
    (request,) = exporter.request_spans(1)
    spans = exporter.wait(lambda spans: any(s.name == "BLS add_sub" for s in spans))
    (call,) = [s for s in spans if s.name == "BLS add_sub"]
    assert call.parent is not None and call.parent.span_id == request.context.span_id
    assert call.attributes is not None and call.attributes["sluice.kind"] == "bls"
    compute = children(spans, request)["compute_infer"]
    assert compute.start_time <= call.start_time and call.end_time <= compute.end_time  # made during execute


def test_a_failed_request_has_an_error_span_and_its_trace_id_in_the_log(serve, repo, caplog):
    caplog.set_level(logging.INFO, logger="sluice.runtime.tracing")
    exporter = Exporter()
    server = serve(repo, tracing=traced(), span_exporter=exporter)
    client = httpclient.InferenceServerClient(server.http)
    wrong = httpclient.InferInput("INPUT0", [8], "FP32")
    wrong.set_data_from_numpy(np.zeros(8, dtype=np.float32))
    with pytest.raises(InferenceServerException, match="unexpected shape"):
        client.infer("add_sub", [wrong, *add_sub_inputs(httpclient)[1:]])
    (request,) = exporter.request_spans(1)
    assert request.status.status_code == StatusCode.ERROR
    assert (
        request.status.description is not None and "unexpected shape for input 'INPUT0'" in request.status.description
    )
    trace_id = format(request.context.trace_id, "032x")
    lines = [r.getMessage() for r in caplog.records if r.name == "sluice.runtime.tracing"]
    assert any("model 'add_sub' failed (400)" in line and f"trace_id={trace_id}" in line for line in lines), lines


def test_tracing_off_exports_nothing_until_the_api_turns_it_on(serve, repo):
    exporter = Exporter()
    server = serve(repo, span_exporter=exporter)
    client = httpclient.InferenceServerClient(server.http)
    assert client.get_trace_settings() == {
        "trace_level": ["OFF"],
        "trace_rate": "1000",
        "trace_count": "-1",
        "log_frequency": "0",
        "trace_file": "",
        "trace_mode": "opentelemetry",
    }
    header, _, _ = traceparent()
    client.infer("add_sub", add_sub_inputs(httpclient), headers={"traceparent": header})
    assert not server.server.tracing.on

    updated = client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
    assert updated["trace_level"] == ["TIMESTAMPS"] and updated["trace_rate"] == "1"
    client.infer("add_sub", add_sub_inputs(httpclient))
    (request,) = exporter.request_spans(1)
    assert request.parent is None  # the first request, with its traceparent, was not traced
    assert "trace" in client.get_server_metadata()["extensions"]


def test_settings_round_trip_over_http_and_grpc_per_model(serve, repo):
    exporter = Exporter()
    server = serve(repo, span_exporter=exporter)
    http = httpclient.InferenceServerClient(server.http)
    grpc = grpcclient.InferenceServerClient(server.grpc)

    model = grpc.update_trace_settings("mlp", {"trace_level": ["TIMESTAMPS"], "trace_rate": "1"}, as_json=True)
    assert model["settings"]["trace_level"]["value"] == ["TIMESTAMPS"]
    assert http.get_trace_settings("mlp")["trace_rate"] == "1"
    assert http.get_trace_settings()["trace_level"] == ["OFF"]  # the server-wide settings are unchanged
    http.update_trace_settings(settings={"trace_rate": "50"})
    assert http.get_trace_settings("mlp")["trace_rate"] == "1"  # set for the model: its own
    assert http.get_trace_settings("mlp")["log_frequency"] == "0"

    http.infer("add_sub", add_sub_inputs(httpclient))  # level OFF for add_sub
    http.infer("mlp", mlp_inputs(httpclient))
    (request,) = exporter.request_spans(1)
    assert request.name == "infer mlp"

    cleared = grpc.update_trace_settings("mlp", {"trace_rate": None}, as_json=True)
    assert cleared["settings"]["trace_rate"]["value"] == ["50"]  # back to the server's
    assert http.update_trace_settings("mlp", {}) == http.get_trace_settings()  # the model follows the server again
    assert grpc.get_trace_settings(as_json=True)["settings"]["trace_rate"]["value"] == ["50"]
    assert http.update_trace_settings(settings={"trace_rate": None})["trace_rate"] == "1000"  # the start-up value


def test_a_models_count_it_does_not_set_follows_the_servers(serve, repo):
    """Triton: a model's settings it does not set are the server's, re-derived when the server's change."""
    exporter = Exporter()
    server = serve(repo, span_exporter=exporter)
    http = httpclient.InferenceServerClient(server.http)
    http.update_trace_settings("mlp", {"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
    assert http.get_trace_settings("mlp")["trace_count"] == "-1"
    assert http.update_trace_settings(settings={"trace_count": "2"})["trace_count"] == "2"
    assert http.get_trace_settings("mlp")["trace_count"] == "2"
    for _ in range(5):
        http.infer("mlp", mlp_inputs(httpclient))
    assert len(exporter.request_spans(2)) == 2
    assert http.get_trace_settings("mlp")["trace_count"] == "0"
    http.update_trace_settings(settings={"trace_count": "0"})
    http.update_trace_settings(settings={"trace_count": "1"})
    http.infer("mlp", mlp_inputs(httpclient))
    assert len(exporter.request_spans(3)) == 3
    # a model that sets its own count keeps it
    http.update_trace_settings("mlp", {"trace_count": "7"})
    http.update_trace_settings(settings={"trace_count": "3"})
    assert http.get_trace_settings("mlp")["trace_count"] == "7"


def test_an_update_refused_for_a_missing_sdk_changes_nothing(monkeypatch):
    tracer = tracing.Tracer(TracingSettings())

    def no_sdk() -> None:
        raise RuntimeError("tracing needs the opentelemetry-sdk package")

    monkeypatch.setattr(tracer, "_open", no_sdk)
    before = (tracer.setting(), tracer.setting("m"))
    for model in ("", "m"):
        with pytest.raises(tracing.Unsupported, match="opentelemetry-sdk"):
            tracer.update(model, {"trace_level": ["TIMESTAMPS"], "trace_count": ["5"]})
    assert (tracer.setting(), tracer.setting("m")) == before and not tracer.on


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"trace_rate": "often"}, "trace setting 'trace_rate': 'often' is not allowed; allowed: an integer >= 0"),
        ({"trace_level": ["TENSORS"]}, "'trace_level': ['TENSORS'] is not allowed; allowed: OFF or TIMESTAMPS"),
        ({"trace_file": "/tmp/trace.json"}, "allowed: empty: Sluice exports spans over OTLP"),
        ({"trace_mode": "triton"}, "'trace_mode': 'triton' is not allowed; allowed: opentelemetry"),
        ({"trace_sample": "1"}, "unknown trace setting 'trace_sample'; allowed: trace_level, trace_rate"),
    ],
)
def test_bad_settings_are_refused_naming_the_setting(serve, repo, settings, words):
    server = serve(repo, span_exporter=Exporter())
    http = httpclient.InferenceServerClient(server.http)
    grpc = grpcclient.InferenceServerClient(server.grpc)
    with pytest.raises(InferenceServerException) as caught:
        http.update_trace_settings(settings=settings)
    assert caught.value.status() == "400" and words in caught.value.message()
    with pytest.raises(InferenceServerException) as caught:
        grpc.update_trace_settings("mlp", settings)
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT" and words in caught.value.message()
    assert http.get_trace_settings()["trace_level"] == ["OFF"]


def test_trace_settings_of_an_unknown_model_are_not_found(serve, repo):
    server = serve(repo, span_exporter=Exporter())
    with pytest.raises(InferenceServerException, match="Request for unknown model: 'nope' is not found") as caught:
        httpclient.InferenceServerClient(server.http).get_trace_settings("nope")
    assert caught.value.status() == "404"
    with pytest.raises(InferenceServerException) as caught:
        grpcclient.InferenceServerClient(server.grpc).update_trace_settings("nope", {"trace_rate": "1"})
    assert caught.value.status() == "StatusCode.NOT_FOUND"


def test_a_bad_trace_config_is_one_line_at_start(tmp_path, capsys):
    from sluice.runtime.__main__ import main

    assert main(["serve", "--model-repository", str(tmp_path), "--trace-config", "rate=abc"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "sluice: error: --trace-config rate=abc: trace setting 'trace_rate': 'abc' is not allowed; allowed: an "
        "integer >= 0 (trace 1 of N requests; 0: only requests with a sampled traceparent)\n"
    )


# --- the other request kinds: streams, decoupled models and BLS calls, forwards, sequences ---------


class Stream:
    """A tritonclient gRPC stream opened with a ``traceparent`` header; answers are read back in order."""

    def __init__(self, url: str, header: str) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.answers: queue.Queue[Any] = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.answers.put(error or result),
                                 headers={"traceparent": header})  # fmt: skip

    def take(self, count: int) -> list[Any]:
        return [self.answers.get(timeout=20) for _ in range(count)]

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def int_input(name: str, value: int, shape: tuple[int, ...] = (1,)) -> Any:
    tensor = grpcclient.InferInput(name, list(shape), "INT32")
    tensor.set_data_from_numpy(np.full(shape, value, dtype=np.int32))
    return tensor


@pytest.mark.parametrize("grpc_server", ["h2", "grpcio"])
def test_stream_requests_are_traced_under_the_streams_traceparent(serve, repo, grpc_server):
    exporter = Exporter()
    server = serve(repo, tracing=traced(rate=0), span_exporter=exporter, grpc_server=grpc_server)
    header, trace_id, parent_span = traceparent()
    stream = Stream(server.grpc, header)
    try:
        for request_id in ("s-1", "s-2"):
            stream.client.async_stream_infer("add_sub", add_sub_inputs(grpcclient), request_id=request_id)
        answers = stream.take(2)
    finally:
        stream.close()
    assert all(not isinstance(answer, Exception) for answer in answers), answers
    requests = exporter.request_spans(2)
    spans = exporter.wait(lambda spans: sum(s.name == "response" for s in spans) >= 2)
    assert sorted(s.attributes["request_id"] for s in requests) == ["s-1", "s-2"]  # type: ignore[index]
    for request in requests:
        assert request.name == "infer add_sub" and request.attributes["sluice.protocol"] == "grpc"  # type: ignore[index]
        assert request.context.trace_id == trace_id
        assert request.parent is not None and request.parent.span_id == parent_span
        parts = children(spans, request)
        assert {"queue", "batch", "compute_input", "compute_infer", "compute_output", "response"} == set(parts)
        assert parts["response"].end_time == request.end_time


def test_a_decoupled_request_records_each_response_and_ends_at_the_final_one(serve, kinds_repo):
    exporter = Exporter()
    server = serve(kinds_repo, tracing=traced(rate=0), span_exporter=exporter)
    header, trace_id, _ = traceparent()
    stream = Stream(server.grpc, header)
    try:
        stream.client.async_stream_infer("square", [int_input("IN", 3)], request_id="d-1")
        answers = stream.take(3)
    finally:
        stream.close()
    assert [answer.as_numpy("OUT")[0] for answer in answers] == [3, 3, 3]
    (request,) = exporter.request_spans(1)
    assert request.name == "infer square" and request.context.trace_id == trace_id
    assert request.attributes is not None and request.attributes["sluice.responses"] == 3
    events = list(request.events)
    assert [e.name for e in events] == ["response", "response", "response", "final flag"]
    assert [e.attributes.get("sluice.response_index") for e in events] == [0, 1, 2, None]  # type: ignore[union-attr]
    assert [e.attributes["sluice.final"] for e in events] == [False, False, False, True]  # type: ignore[index]
    assert all(a.timestamp <= b.timestamp for a, b in itertools.pairwise(events))
    assert request.start_time <= events[0].timestamp and events[-1].timestamp <= request.end_time
    parts = children(exporter.wait(lambda spans: len(spans) >= 7), request)
    assert {"queue", "batch", "compute_infer", "response"} <= set(parts)
    assert parts["response"].start_time == events[-1].timestamp  # the span ends once the final one is sent
    assert request.status.status_code == StatusCode.UNSET


def test_a_failed_decoupled_request_has_an_error_span(serve, kinds_repo):
    exporter = Exporter()
    server = serve(kinds_repo, tracing=traced(rate=0), span_exporter=exporter)
    header, _, _ = traceparent()
    stream = Stream(server.grpc, header)
    try:
        stream.client.async_stream_infer("failing", [int_input("IN", 1)])
        (answer,) = stream.take(1)
    finally:
        stream.close()
    assert isinstance(answer, InferenceServerException) and "no responses today" in answer.message()
    (request,) = exporter.request_spans(1)
    assert request.status.status_code == StatusCode.ERROR
    assert request.status.description is not None and "no responses today" in request.status.description
    assert [e.name for e in request.events] == ["error"]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_decoupled_bls_call_is_a_child_that_ends_at_its_final_response(serve, kinds_repo, protocol):
    exporter = Exporter()
    server = serve(kinds_repo, tracing=traced(), span_exporter=exporter)
    module: Any = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(server.http if protocol == "http" else server.grpc)
    tensor = module.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([4], dtype=np.int32))
    assert client.infer("bls_square", [tensor]).as_numpy("SUM")[0] == 16  # 4 responses of 4
    (request,) = exporter.request_spans(1)

    def square_ran(spans: list[ReadableSpan]) -> bool:
        # the call ends at its final response, which a decoupled model may send before its execute
        # returns: square's own compute span can come after the call's
        calls = [s for s in spans if s.name == "BLS square"]
        return bool(calls) and {"queue", "compute_infer"} <= set(children(spans, calls[0]))

    spans = exporter.wait(square_ran)
    (call,) = [s for s in spans if s.name == "BLS square"]
    assert call.parent is not None and call.parent.span_id == request.context.span_id
    assert call.attributes is not None and call.attributes["sluice.kind"] == "bls"
    assert call.attributes["sluice.responses"] == 4
    assert [e.name for e in call.events] == ["response"] * 4 + ["final flag"]
    assert call.end_time == call.events[-1].timestamp
    compute = children(spans, request)["compute_infer"]
    assert compute.start_time <= call.start_time and call.end_time <= compute.end_time  # made during execute
    assert {"queue", "compute_infer"} <= set(children(spans, call))  # square's own queue and compute


def test_sequence_requests_get_queue_and_compute_children(serve, kinds_repo):
    exporter = Exporter()
    server = serve(kinds_repo, tracing=traced(), span_exporter=exporter)
    client = grpcclient.InferenceServerClient(server.grpc)
    for value, start, end in ((2, True, False), (5, False, True)):
        result = client.infer(
            "acc", [int_input("INPUT", value, (1, 1))], sequence_id=7, sequence_start=start, sequence_end=end
        )
    assert result.as_numpy("OUTPUT")[0, 0] == 7  # the state carried from one request to the next
    requests = exporter.request_spans(2)
    spans = exporter.wait(lambda spans: sum(s.name == "response" for s in spans) >= 2)
    for request in requests:
        assert request.name == "infer acc"
        parts = children(spans, request)
        assert set(parts) == {"queue", "batch", "compute_input", "compute_infer", "compute_output", "response"}
        assert parts["batch"].attributes == {"sluice.batch_size": 1, "sluice.batch_requests": 1}
        assert parts["compute_infer"].end_time > parts["compute_infer"].start_time  # ONNX Runtime's own split
        for earlier, later in itertools.pairwise(["queue", "batch", "compute_input", "compute_infer", "response"]):
            assert parts[earlier].end_time <= parts[later].start_time, (earlier, later)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_forwarded_request_is_a_client_span_the_canary_continues(serve, tmp_path, protocol):
    canary_repo = tmp_path / "canary"
    write_model(canary_repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()}, version=2)
    canary_spans = Exporter()
    canary = serve(canary_repo, tracing=traced(rate=0), span_exporter=canary_spans)  # only callers' traces
    stable_repo = tmp_path / "stable"
    write_model(stable_repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    split_file = tmp_path / "split.json"
    write_split(split_file, canary.grpc, 100)
    stable_spans = Exporter()
    stable = serve(stable_repo, tracing=traced(), span_exporter=stable_spans, split_file=split_file)
    header, trace_id, parent_span = traceparent()
    module: Any = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(stable.http if protocol == "http" else stable.grpc)
    result = client.infer("add_sub", add_sub_inputs(module), headers={"traceparent": header})
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * np.arange(16, dtype=np.float32))

    (request,) = stable_spans.request_spans(1)
    spans = stable_spans.wait(lambda spans: any(s.name == "forward add_sub" for s in spans))
    assert request.context.trace_id == trace_id and request.parent is not None
    assert request.parent.span_id == parent_span
    assert request.attributes is not None and request.attributes["model_version"] == "2"  # the canary answered
    parts = children(spans, request)
    assert set(parts) == {"forward add_sub", "response"}  # nothing queued or computed here
    forward = parts["forward add_sub"]
    assert forward.kind == SpanKind.CLIENT and forward.status.status_code == StatusCode.UNSET
    assert forward.attributes is not None and forward.attributes["sluice.target"] == canary.grpc

    (served,) = canary_spans.request_spans(1)  # the canary continues the trace under the forward span
    assert served.context.trace_id == trace_id
    assert served.parent is not None and served.parent.span_id == forward.context.span_id and served.parent.is_remote
    assert {"queue", "compute_infer", "response"} <= set(children(canary_spans.wait(lambda s: len(s) >= 7), served))


def test_a_remote_ensemble_step_passes_the_trace_on(serve, tmp_path):
    remote_repo = tmp_path / "remote"
    write_model(remote_repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    remote_spans = Exporter()
    remote = serve(remote_repo, tracing=traced(rate=0), span_exporter=remote_spans)
    repo = tmp_path / "repo"
    config = CHAIN + f'parameters {{ key: "sluice.remote.add_sub" value {{ string_value: "{remote.grpc}" }} }}\n'
    write_model(repo, "chain", config, {})
    spans_here = Exporter()
    server = serve(repo, tracing=traced(), span_exporter=spans_here)
    result = httpclient.InferenceServerClient(server.http).infer("chain", add_sub_inputs(httpclient, ("A", "B")))
    np.testing.assert_allclose(result.as_numpy("SUM"), 2 * np.arange(16, dtype=np.float32))
    (request,) = spans_here.request_spans(1)
    spans = spans_here.wait(lambda spans: sum(s.name == "forward add_sub" for s in spans) == 2)
    calls = [s for s in spans if s.name == "forward add_sub"]
    assert all(c.kind == SpanKind.CLIENT and c.parent.span_id == request.context.span_id for c in calls)  # type: ignore[union-attr]
    served = remote_spans.request_spans(2)
    assert {s.parent.span_id for s in served} == {c.context.span_id for c in calls}  # type: ignore[union-attr]
    assert all(s.context.trace_id == request.context.trace_id for s in served)


def test_an_update_keeps_what_is_left_of_a_count_it_does_not_change(serve, repo):
    """Triton makes a scope a new setting on every update, its count the update's, else what is left of
    the count the scope set before, else what is left of the server's. A model's update of its rate
    gave it its whole count again (and traced more requests than asked for)."""
    exporter = Exporter()
    server = serve(repo, span_exporter=exporter)
    http = httpclient.InferenceServerClient(server.http)
    http.update_trace_settings("mlp", {"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "5"})
    for _ in range(2):
        http.infer("mlp", mlp_inputs(httpclient))
    assert len(exporter.request_spans(2)) == 2
    assert http.update_trace_settings("mlp", {"log_frequency": "0"})["trace_count"] == "3"  # was reset to 5
    assert http.update_trace_settings("mlp", {"trace_count": "4"})["trace_count"] == "4"  # given: taken

    # The server's count: kept through an update of its rate; a model that does not set its own takes what
    # is left of it when its settings are made (Triton's copy of the server's setting), not the start.
    http.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "4"})
    http.infer("add_sub", add_sub_inputs(httpclient))
    assert len(exporter.request_spans(3)) == 3
    assert http.update_trace_settings(settings={"trace_rate": "1"})["trace_count"] == "3"
    assert http.update_trace_settings("add_sub", {"log_frequency": "0"})["trace_count"] == "3"
    assert http.get_trace_settings("mlp")["trace_count"] == "4"  # its own, untouched by the server's
