"""Batching and scheduling end to end: a real server on loopback, tritonclient over HTTP and gRPC.

The models are Python-backend ``model.py`` files that append what they executed to a JSON-lines
log, so a test can tell which requests ran, in which batches, in which order and whether a running
request saw its client leave (``is_cancelled()``). A gated model holds each batch until the test
creates its release file, so a blocker runs exactly as long as the test needs, whatever the
machine's speed. The test waits for queue states through the public ``sluice_queue_depth`` metric
instead of sleeping.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from sluice.runtime.settings import SchedulingDefaults

from .conftest import ManualClock  # type: ignore[import-not-found]

RECORDING_PY = """
import json
import os
import threading
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.log = params["log"]
        self.sleep = float(params.get("sleep_s", "0"))
        self.gate = params.get("gate", "")
        self.watch = params.get("watch_cancel") == "1"
        self.instance = args["model_instance_name"]

    def _write(self, **event):
        with open(self.log, "a") as f:
            f.write(json.dumps(event) + "\\n")

    def execute(self, requests):
        ids = [r.request_id() for r in requests]
        self._write(
            event="start", ids=ids, t=time.monotonic(), instance=self.instance, thread=threading.current_thread().name
        )
        end = time.monotonic() + self.sleep
        give_up = time.monotonic() + 60  # a gate the test never opens fails the test, not the run
        while time.monotonic() < end or (self.gate and not os.path.exists(self.gate) and time.monotonic() < give_up):
            if self.watch and all(r.is_cancelled() for r in requests):
                break
            time.sleep(0.005)
        self._write(event="end", ids=ids, t=time.monotonic(), cancelled=[r.is_cancelled() for r in requests])
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x * 2)]))
        return out
"""


class Model:
    """A recording model in a repository; ``events`` reads back what it executed."""

    def __init__(
        self,
        repo: Path,
        name: str,
        *,
        sleep_s: float = 0.0,
        max_batch_size: int = 8,
        extra: str = "",
        dynamic: str = "dynamic_batching { }",
        watch_cancel: bool = False,
        gated: bool = False,
    ) -> None:
        self.name = name
        self.log = repo.parent / f"{name}.jsonl"
        self.log.touch()
        self.gate = repo.parent / f"{name}.release"
        model_dir = repo / name / "1"
        model_dir.mkdir(parents=True)
        (model_dir / "model.py").write_text(RECORDING_PY)
        (repo / name / "config.pbtxt").write_text(
            f"""
            name: "{name}"
            backend: "python"
            max_batch_size: {max_batch_size}
            input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ 1 ] }} ]
            output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 1 ] }} ]
            {dynamic}
            parameters {{ key: "log" value {{ string_value: "{self.log}" }} }}
            parameters {{ key: "sleep_s" value {{ string_value: "{sleep_s}" }} }}
            parameters {{ key: "watch_cancel" value {{ string_value: "{int(watch_cancel)}" }} }}
            parameters {{ key: "gate" value {{ string_value: "{self.gate if gated else ''}" }} }}
            {extra}
            """
        )

    def release(self) -> None:
        """Let the batch holding at the gate (and every later one) finish."""
        self.gate.touch()

    def events(self, kind: str = "start") -> list[dict[str, Any]]:
        lines = self.log.read_text().splitlines()
        return [e for e in map(json.loads, lines) if e["event"] == kind]

    def executed(self) -> list[str]:
        return [rid for e in self.events() for rid in e["ids"]]

    def batches(self) -> list[list[str]]:
        return [e["ids"] for e in self.events()]


def wait_until(predicate: Callable[[], bool], timeout: float = 3.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(0.005)


def metric(server: Any, name: str, model: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=5).read().decode()
    want = {"model": model, "version": "1", **labels}
    for line in text.splitlines():
        match = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if match and dict(re.findall(r'(\w+)="([^"]*)"', match.group(1))) == want:
            return float(match.group(2))
    return 0.0


def queue_depth(server: Any, model: str) -> float:
    return metric(server, "sluice_queue_depth", model)


def wait_queued(server: Any, model: str, depth: int) -> None:
    wait_until(lambda: queue_depth(server, model) == depth, what=f"queue depth {depth} of {model}")


def wait_started(model: Model, rid: str) -> None:
    wait_until(lambda: rid in model.executed(), what=f"{rid} running in {model.name}")


def infer(server: Any, protocol: str, model: str, value: float, rid: str, **kw: Any) -> float:
    """One inference with a fresh client (its own connection); returns the model's answer."""
    mod: Any = httpclient if protocol == "http" else grpcclient
    url = server.http if protocol == "http" else server.grpc
    client = mod.InferenceServerClient(url)
    try:
        inp = mod.InferInput("INPUT0", [1, 1], "FP32")
        inp.set_data_from_numpy(np.array([[value]], dtype=np.float32))
        result = client.infer(model, [inp], request_id=rid, **kw)
        return float(result.as_numpy("OUTPUT0")[0, 0])
    finally:
        client.close()


def status_of(exc: InferenceServerException) -> str:
    return {"503": "UNAVAILABLE", "StatusCode.UNAVAILABLE": "UNAVAILABLE"}.get(str(exc.status()), str(exc.status()))


@pytest.fixture
def pool():
    with ThreadPoolExecutor(16) as executor:
        yield executor


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "repo"
    path.mkdir()
    return path


def stats_of(server: Any, model: str) -> dict[str, Any]:
    client = httpclient.InferenceServerClient(server.http)
    try:
        return client.get_inference_statistics(model)["model_stats"][0]
    finally:
        client.close()


# -- batching ------------------------------------------------------------------------------------


def test_http_and_grpc_requests_merge_into_one_batch_and_split_back(serve, repo, pool):
    merge = Model(repo, "merge", gated=True, dynamic="dynamic_batching { max_queue_delay_microseconds: 2000000 }")
    server = serve(repo)
    blocker = pool.submit(infer, server, "http", "merge", 0.5, "blocker")
    wait_started(merge, "blocker")
    calls = {
        f"{p}{i}": pool.submit(infer, server, p, "merge", 10 * i + (p == "grpc"), f"{p}{i}")
        for p in ("http", "grpc")
        for i in range(3)
    }
    wait_queued(server, "merge", 6)
    merge.release()
    assert blocker.result(5) == 1.0
    for rid, call in calls.items():
        i = int(rid[-1])
        assert call.result(5) == 2 * (10 * i + rid.startswith("grpc")), rid
    assert len(merge.batches()) == 2
    assert sorted(merge.batches()[1]) == sorted(calls)
    stats = stats_of(server, "merge")
    assert stats["execution_count"] == 2
    assert stats["inference_count"] == 7
    assert sorted(b["batch_size"] for b in stats["batch_stats"]) == [1, 6]
    assert stats["inference_stats"]["success"]["count"] == 7
    # model code runs on the scheduler's worker threads, never on the server's event loop thread
    assert all(e["thread"].startswith("sluice-merge") for e in merge.events())


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_work_conserving_idle_server_answers_before_the_queue_delay(serve, repo, protocol):
    Model(repo, "quick", dynamic="dynamic_batching { max_queue_delay_microseconds: 2000000 }")
    clock = ManualClock()
    server = serve(repo, clock=clock)
    # the clock never moves: a request that waited for the 2 s delay would never be answered
    assert infer(server, protocol, "quick", 3.0, "one") == 6.0


def waits_exactly(server: Any, clock: ManualClock, model: str, call: Any, delay_s: float) -> None:
    """``call`` (a queued request) is answered once the clock passes ``delay_s``, not before."""
    wait_queued(server, model, 1)
    clock.advance(delay_s - 0.001)
    server.settle()
    assert not call.done() and queue_depth(server, model) == 1
    clock.advance(0.001)


def test_fixed_wait_from_the_model_config_waits_for_the_delay(serve, repo, pool):
    fixed = Model(
        repo,
        "fixed",
        max_batch_size=2,
        dynamic="dynamic_batching { max_queue_delay_microseconds: 300000 }",
        extra='parameters { key: "batch_policy" value { string_value: "fixed_wait" } }',
    )
    clock = ManualClock()
    server = serve(repo, clock=clock)
    alone = pool.submit(infer, server, "http", "fixed", 1.0, "alone")
    waits_exactly(server, clock, "fixed", alone, 0.3)
    assert alone.result(10) == 2.0
    # a full batch (max_batch_size 2) goes at once: the clock does not move
    pair = [pool.submit(infer, server, p, "fixed", 2.0, f"pair-{p}") for p in ("http", "grpc")]
    assert [f.result(10) for f in pair] == [4.0, 4.0]
    assert sorted(fixed.batches()[-1]) == ["pair-grpc", "pair-http"]


def test_server_flags_set_fixed_wait_and_the_default_queue_timeout(serve, repo, pool):
    Model(repo, "waits", dynamic="dynamic_batching { max_queue_delay_microseconds: 150000 }")
    slow = Model(repo, "slow", gated=True)
    clock = ManualClock()
    server = serve(
        repo, clock=clock, scheduling=SchedulingDefaults(batch_policy="fixed_wait", queue_timeout_us=250_000)
    )
    alone = pool.submit(infer, server, "grpc", "waits", 1.0, "alone")
    waits_exactly(server, clock, "waits", alone, 0.15)
    assert alone.result(10) == 2.0
    # the server-wide queue timeout applies to a model whose config names none
    blocker = pool.submit(infer, server, "http", "slow", 1.0, "blocker")
    wait_started(slow, "blocker")
    late = pool.submit(infer, server, "http", "slow", 2.0, "late")
    waits_exactly(server, clock, "slow", late, 0.25)
    with pytest.raises(InferenceServerException, match=r"Request timeout expired: .*timed out in the queue") as info:
        late.result(10)
    assert status_of(info.value) == "UNAVAILABLE"
    assert not blocker.done()
    slow.release()
    blocker.result(5)
    assert slow.executed() == ["blocker"]


# -- queue policy --------------------------------------------------------------------------------


def test_queue_timeout_rejects_waiting_requests_without_running_them(serve, repo, pool):
    slow = Model(
        repo,
        "slow",
        gated=True,
        dynamic="dynamic_batching { default_queue_policy { default_timeout_microseconds: 100000 } }",
    )
    clock = ManualClock()
    server = serve(repo, clock=clock)
    blocker = pool.submit(infer, server, "http", "slow", 1.0, "blocker")
    wait_started(slow, "blocker")
    late = {p: pool.submit(infer, server, p, "slow", 2.0, f"late-{p}") for p in ("http", "grpc")}
    wait_queued(server, "slow", 2)
    clock.advance(0.1)
    for protocol, call in late.items():
        with pytest.raises(InferenceServerException, match=r"timed out in the queue .* not executed") as info:
            call.result(5)
        assert status_of(info.value) == "UNAVAILABLE", protocol
    assert not blocker.done()  # answered while the blocker still runs
    slow.release()
    assert blocker.result(5) == 2.0
    time.sleep(0.05)
    assert slow.executed() == ["blocker"]
    stats = stats_of(server, "slow")
    assert stats["inference_stats"]["fail"]["count"] == 2
    assert stats["inference_stats"]["success"]["count"] == 1
    assert stats["execution_count"] == 1
    assert metric(server, "sluice_rejected_total", "slow", reason="timeout") == 2


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_per_request_timeout_parameter_shortens_the_queue_timeout(serve, repo, pool, protocol):
    slow = Model(
        repo,
        "slow",
        gated=True,
        dynamic="""dynamic_batching {
          default_queue_policy { default_timeout_microseconds: 10000000 allow_timeout_override: true }
        }""",
    )
    server = serve(repo)
    blocker = pool.submit(infer, server, "http", "slow", 1.0, "blocker")
    wait_started(slow, "blocker")
    with pytest.raises(InferenceServerException, match="queue timeout 100000 us") as info:
        infer(server, protocol, "slow", 2.0, "short", timeout=100_000)
    assert status_of(info.value) == "UNAVAILABLE"
    assert not blocker.done()
    slow.release()
    blocker.result(5)
    assert slow.executed() == ["blocker"]


def test_full_queue_answers_at_once_naming_max_queue_size(serve, repo, pool):
    full = Model(repo, "full", gated=True, dynamic="dynamic_batching { default_queue_policy { max_queue_size: 1 } }")
    server = serve(repo)
    blocker = pool.submit(infer, server, "http", "full", 1.0, "blocker")
    wait_started(full, "blocker")
    queued = pool.submit(infer, server, "grpc", "full", 2.0, "queued")
    wait_queued(server, "full", 1)
    for protocol in ("http", "grpc"):
        with pytest.raises(InferenceServerException, match=r"queue is full.*max_queue_size is 1") as info:
            infer(server, protocol, "full", 3.0, f"over-{protocol}")
        assert status_of(info.value) == "UNAVAILABLE"
        assert not blocker.done()  # answered at once, not after the queue moved
    full.release()
    assert blocker.result(5) == 2.0
    assert queued.result(5) == 4.0
    assert sorted(full.executed()) == ["blocker", "queued"]
    assert metric(server, "sluice_rejected_total", "full", reason="queue_full") == 2
    assert stats_of(server, "full")["inference_stats"]["fail"]["count"] == 2


def test_priority_1_queued_after_priority_2_runs_first(serve, repo, pool):
    prio = Model(
        repo,
        "prio",
        gated=True,
        max_batch_size=1,
        dynamic="dynamic_batching { priority_levels: 2 default_priority_level: 2 }",
    )
    server = serve(repo)
    calls = [pool.submit(infer, server, "http", "prio", 1.0, "blocker")]
    wait_started(prio, "blocker")
    calls.append(pool.submit(infer, server, "http", "prio", 2.0, "low-http", priority=2))
    wait_queued(server, "prio", 1)
    calls.append(pool.submit(infer, server, "grpc", "prio", 3.0, "default-grpc"))
    wait_queued(server, "prio", 2)
    calls.append(pool.submit(infer, server, "grpc", "prio", 4.0, "high-grpc", priority=1))
    wait_queued(server, "prio", 3)
    calls.append(pool.submit(infer, server, "http", "prio", 5.0, "high-http", priority=1))
    wait_queued(server, "prio", 4)
    prio.release()
    assert [c.result(5) for c in calls] == [2.0, 4.0, 6.0, 8.0, 10.0]
    assert prio.executed() == ["blocker", "high-grpc", "high-http", "low-http", "default-grpc"]


def test_priority_out_of_range_is_a_client_error(serve, repo):
    Model(repo, "prio", max_batch_size=1, dynamic="dynamic_batching { priority_levels: 2 default_priority_level: 2 }")
    server = serve(repo)
    with pytest.raises(InferenceServerException, match=r"priority 3 is out of range.*allowed 1\.\.2") as info:
        infer(server, "http", "prio", 1.0, "bad", priority=3)
    assert str(info.value.status()) == "400"


# -- cancellation --------------------------------------------------------------------------------


def raw_http_infer(server: Any, model: str, rid: str) -> socket.socket:
    """Send an inference request on a raw socket and leave it open (the caller closes it)."""
    body = json.dumps(
        {"id": rid, "inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]}
    ).encode()
    host, port = server.http.split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.sendall(
        f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {server.http}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def test_http_client_disconnect_drops_the_queued_request(serve, repo, pool):
    slow = Model(repo, "slow", gated=True)
    server = serve(repo)
    blocker = pool.submit(infer, server, "http", "slow", 1.0, "blocker")
    wait_started(slow, "blocker")
    sock = raw_http_infer(server, "slow", "gone")
    wait_queued(server, "slow", 1)
    sock.close()
    wait_queued(server, "slow", 0)  # dropped at once, not when the instance frees up
    assert not blocker.done()
    slow.release()
    assert blocker.result(5) == 2.0
    time.sleep(0.05)
    assert slow.executed() == ["blocker"]
    assert metric(server, "sluice_rejected_total", "slow", reason="cancelled") == 1


def test_grpc_cancel_drops_the_queued_request(serve, repo, pool):
    slow = Model(repo, "slow", gated=True)
    server = serve(repo)
    blocker = pool.submit(infer, server, "http", "slow", 1.0, "blocker")
    wait_started(slow, "blocker")
    client = grpcclient.InferenceServerClient(server.grpc)
    done = threading.Event()
    outcome: list[Any] = []

    def callback(result: Any, error: Any) -> None:
        outcome.append(error)
        done.set()

    inp = grpcclient.InferInput("INPUT0", [1, 1], "FP32")
    inp.set_data_from_numpy(np.array([[1.0]], dtype=np.float32))
    call = client.async_infer("slow", [inp], callback, request_id="cancelled")
    wait_queued(server, "slow", 1)
    call.cancel()
    assert done.wait(5)
    assert "CANCELLED" in str(outcome[0].status())
    wait_queued(server, "slow", 0)
    assert not blocker.done()
    slow.release()
    assert blocker.result(5) == 2.0
    time.sleep(0.05)
    assert slow.executed() == ["blocker"]
    client.close()


def test_grpc_client_deadline_drops_the_queued_request(serve, repo, pool):
    slow = Model(repo, "slow", gated=True)
    server = serve(repo)
    blocker = pool.submit(infer, server, "http", "slow", 1.0, "blocker")
    wait_started(slow, "blocker")
    with pytest.raises(InferenceServerException, match="Deadline") as info:
        infer(server, "grpc", "slow", 2.0, "deadline", client_timeout=0.1)
    assert "DEADLINE_EXCEEDED" in str(info.value.status())
    wait_queued(server, "slow", 0)
    assert not blocker.done()
    slow.release()
    assert blocker.result(5) == 2.0
    time.sleep(0.05)
    assert slow.executed() == ["blocker"]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_running_python_model_sees_is_cancelled(serve, repo, protocol):
    watch = Model(repo, "watch", sleep_s=60.0, watch_cancel=True)  # ends early only if it sees is_cancelled()
    server = serve(repo)
    if protocol == "http":
        sock = raw_http_infer(server, "watch", "leaver")
        wait_started(watch, "leaver")
        sock.close()
    else:
        with pytest.raises(InferenceServerException):
            infer(server, "grpc", "watch", 1.0, "leaver", client_timeout=0.2)
    wait_until(lambda: watch.events("end"), timeout=20, what="model noticing the cancellation")
    assert watch.events("end")[0]["cancelled"] == [True]


# -- instances -----------------------------------------------------------------------------------


def test_two_instances_run_two_batches_concurrently(serve, repo, pool):
    pair = Model(
        repo, "pair", gated=True, max_batch_size=1, dynamic="", extra="instance_group [ { count: 2, kind: KIND_CPU } ]"
    )
    server = serve(repo)
    calls = [pool.submit(infer, server, p, "pair", 1.0, f"r-{p}") for p in ("http", "grpc")]
    # with one instance the second request would wait behind the first, held at the gate
    wait_until(lambda: len(pair.events("start")) == 2, timeout=10, what="both requests running at once")
    pair.release()
    assert [c.result(5) for c in calls] == [2.0, 2.0]
    starts, ends = pair.events("start"), pair.events("end")
    assert len({e["instance"] for e in starts}) == 2
    assert max(e["t"] for e in starts) < min(e["t"] for e in ends)  # the two sleeps overlapped
