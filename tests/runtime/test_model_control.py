"""Model control (none / poll / explicit) and zero-drop reloads, on the real server with tritonclient.

Polls are triggered by the test (``Server.poll_repository``, what each poll runs) or by a manual
clock, never by sleeping. The models are two ONNX graphs that add different constants, so every
answer says which version computed it. The change detection itself is a table of pure cases.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from sluice.runtime.server import StartupError
from sluice.runtime.snapshot import Change, Kind, ModelFiles, changes, ensembles_to_retry
from sluice.runtime.watcher import NOT_ALLOWED, startup_models

from .conftest import ManualClock, write_model  # type: ignore[import-not-found]

CONFIG = """
name: "plus"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "X", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 1 ] } ]
dynamic_batching { }
"""


def plus_model(constant: float) -> bytes:
    """Y = X + constant."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["X", "C"], ["Y"])],
        "plus",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 1])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, 1])],
        [helper.make_tensor("C", TensorProto.FLOAT, [1], [constant])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return onnx._serialize(model) if hasattr(onnx, "_serialize") else model.SerializeToString()


def add_version(repo: Path, version: int, constant: float | None, name: str = "plus") -> None:
    """Place version ``version`` the way a careful operator does: written beside, renamed in."""
    staging = repo / name / f".staging-{version}"
    staging.mkdir(parents=True)
    (staging / "model.onnx").write_bytes(plus_model(constant) if constant is not None else b"not an onnx file")
    os.rename(staging, repo / name / str(version))


def infer_http(address: str, x: float = 1.0, model: str = "plus") -> float:
    client = httpclient.InferenceServerClient(address)
    try:
        tensor = httpclient.InferInput("X", [1, 1], "FP32")
        tensor.set_data_from_numpy(np.array([[x]], np.float32))
        return float(client.infer(model, [tensor]).as_numpy("Y")[0, 0])
    finally:
        client.close()


def index(address: str) -> list[dict]:
    return httpclient.InferenceServerClient(address).get_model_repository_index()


def metric_lines(address: str, prefix: str) -> list[str]:
    import urllib.request

    with urllib.request.urlopen(f"http://{address}/metrics") as response:
        text = response.read().decode()
    return [line for line in text.splitlines() if line.startswith(prefix)]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    write_model(repo, "plus", CONFIG, {"model.onnx": plus_model(1.0)})
    return repo


# ---------------------------------------------------------------- the pure decisions

A = frozenset({("model.onnx", 10, 1)})
B = frozenset({("model.onnx", 10, 2)})


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ({}, {}, {}),
        ({"m": ModelFiles(b"c", versions={1: A})}, {"m": ModelFiles(b"c", versions={1: A})}, {}),
        ({}, {"m": ModelFiles(b"c", versions={1: A})}, {"m": Change(Kind.ADDED)}),
        ({"m": ModelFiles(b"c", versions={1: A})}, {}, {"m": Change(Kind.REMOVED)}),
        (
            {"m": ModelFiles(b"c", versions={1: A})},
            {"m": ModelFiles(b"c", versions={1: A, 2: B})},
            {"m": Change(Kind.CHANGED, versions_added=(2,))},
        ),
        (
            {"m": ModelFiles(b"c", versions={1: A, 2: B})},
            {"m": ModelFiles(b"c", versions={1: A})},
            {"m": Change(Kind.CHANGED, versions_removed=(2,))},
        ),
        (
            {"m": ModelFiles(b"c", versions={1: A})},
            {"m": ModelFiles(b"c", versions={1: B})},
            {"m": Change(Kind.CHANGED, versions_changed=(1,))},
        ),
        (
            {"m": ModelFiles(b"c", versions={1: A})},
            {"m": ModelFiles(b"c2", versions={1: A})},
            {"m": Change(Kind.CHANGED, config_changed=True)},
        ),
        (
            {"m": ModelFiles(b"c", frozenset({("labels.txt", 3, 1)}), {1: A})},
            {"m": ModelFiles(b"c", frozenset({("labels.txt", 4, 2)}), {1: A})},
            {"m": Change(Kind.CHANGED, files_changed=True)},
        ),
        (
            {"m": ModelFiles(None, versions={1: A}), "n": ModelFiles(b"c", versions={1: A})},
            {"m": ModelFiles(b"c", versions={1: A}), "n": ModelFiles(b"c", versions={1: A})},
            {"m": Change(Kind.CHANGED, config_changed=True)},
        ),
    ],
    ids=["empty", "same", "added", "removed", "version-added", "version-removed", "version-files",
         "config-bytes", "model-files", "config-appears"],
)
def test_changes_between_two_snapshots(old, new, expected):
    assert changes(old, new) == expected


@pytest.mark.parametrize(
    ("found", "failed", "steps_of", "expected"),
    [
        ({"step": Change(Kind.ADDED)}, ["ens"], {"ens": ["step"]}, ["ens"]),
        ({"step": Change(Kind.CHANGED, config_changed=True)}, ["ens"], {"ens": ["step"]}, []),
        ({"step": Change(Kind.REMOVED)}, ["ens"], {"ens": ["step"]}, []),
        ({"other": Change(Kind.ADDED)}, ["ens"], {"ens": ["step"]}, []),
        ({"step": Change(Kind.ADDED)}, ["broken"], {"broken": []}, []),  # not an ensemble
        ({"step": Change(Kind.ADDED), "ens": Change(Kind.CHANGED, config_changed=True)}, ["ens"],
         {"ens": ["step"]}, []),  # the poll reloads it anyway
        ({"a": Change(Kind.ADDED), "b": Change(Kind.ADDED)}, ["y", "x", "z"],
         {"x": ["a"], "y": ["c", "b"], "z": ["c"]}, ["x", "y"]),
    ],
    ids=["step-added", "step-changed", "step-removed", "another-added", "not-an-ensemble", "reloaded-anyway",
         "several"],
)
def test_ensembles_retried_after_a_poll(found, failed, steps_of, expected):
    assert ensembles_to_retry(found, failed, steps_of) == expected


@pytest.mark.parametrize(
    ("mode", "models", "load_models", "expected"),
    [
        ("none", (), (), ["a", "b"]),
        ("none", ("b",), (), ["b"]),
        ("poll", (), (), ["a", "b"]),
        ("explicit", (), (), []),
        ("explicit", (), ("*",), ["a", "b"]),
        ("explicit", ("a",), ("b", "a"), ["a", "b"]),
    ],
)
def test_models_loaded_at_start(mode, models, load_models, expected):
    assert startup_models(mode, models, load_models, ["a", "b"]) == expected


# ---------------------------------------------------------------- the API gate

def test_a_default_server_refuses_the_load_and_unload_api_as_triton(repo, serve):
    server = serve(repo)
    http = httpclient.InferenceServerClient(server.http)
    grpc = grpcclient.InferenceServerClient(server.grpc)
    for call in (lambda: http.load_model("plus"), lambda: http.unload_model("plus"),
                 lambda: http.load_model("anything-at-all")):
        with pytest.raises(InferenceServerException) as info:
            call()
        assert info.value.status() == "503" and NOT_ALLOWED in info.value.message()
        assert "--model-control-mode explicit" in info.value.message()
    for call in (lambda: grpc.load_model("plus"), lambda: grpc.unload_model("plus")):
        with pytest.raises(InferenceServerException) as info:
            call()
        assert info.value.status() == "StatusCode.UNAVAILABLE" and NOT_ALLOWED in info.value.message()
    assert http.is_model_ready("plus")  # still serving: nothing was unloaded
    assert infer_http(server.http) == 2.0


def test_poll_mode_refuses_the_api_too(repo, serve):
    server = serve(repo, model_control_mode="poll", repository_poll_s=3600)
    with pytest.raises(InferenceServerException, match="not allowed if polling is enabled"):
        httpclient.InferenceServerClient(server.http).unload_model("plus")


def test_explicit_mode_loads_only_load_model_names_and_allows_the_api(repo, serve):
    write_model(repo, "other", CONFIG.replace('"plus"', '"other"'), {"model.onnx": plus_model(5.0)})
    server = serve(repo, model_control_mode="explicit", load_models=("plus",))
    http = httpclient.InferenceServerClient(server.http)
    assert http.is_model_ready("plus") and not http.is_model_ready("other")
    http.load_model("other")
    assert infer_http(server.http, model="other") == 6.0
    http.unload_model("plus")
    assert not http.is_model_ready("plus")



def test_unloading_a_name_the_repository_never_held_leaves_no_index_row(repo, serve):
    server = serve(repo, model_control_mode="explicit", load_models=("plus",))
    http = httpclient.InferenceServerClient(server.http)
    grpc = grpcclient.InferenceServerClient(server.grpc)
    for client in (http, grpc):
        with pytest.raises(InferenceServerException, match="no directory 'ghost'"):
            client.load_model("ghost")
        client.unload_model("ghost")  # success for an unknown model, as Triton
    client.unload_model("never_asked")
    assert [row["name"] for row in http.get_model_repository_index()] == ["plus"]
    assert [m.name for m in grpc.get_model_repository_index().models] == ["plus"]
    http.unload_model("plus")  # a model that served keeps its row, UNAVAILABLE "unloaded"
    assert http.get_model_repository_index() == [
        {"name": "plus", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}
    ]


def test_loads_of_names_the_repository_never_held_leave_nothing_behind(repo, serve):
    """A client trying random names gets 404 each time and the server keeps no entry for them (memory
    grew by one entry per name), also when loads and unloads of one such name overlap; a name that
    appears in the repository later loads as any other."""
    server = serve(repo, model_control_mode="explicit", load_models=("plus",))
    http = httpclient.InferenceServerClient(server.http)
    grpc = grpcclient.InferenceServerClient(server.grpc)
    for i in range(50):
        with pytest.raises(InferenceServerException, match=f"no directory 'ghost{i}'"):
            (http if i % 2 else grpc).load_model(f"ghost{i}")
    errors: list[BaseException] = []

    def churn(client_kind: str) -> None:
        client = (httpclient.InferenceServerClient(server.http) if client_kind == "http"
                  else grpcclient.InferenceServerClient(server.grpc))
        for _ in range(10):
            try:
                client.load_model("ghost")
            except InferenceServerException as exc:
                if "no directory 'ghost'" not in exc.message():
                    errors.append(exc)
            client.unload_model("ghost")

    threads = [threading.Thread(target=churn, args=(kind,)) for kind in ("http", "grpc", "http", "grpc")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    assert sorted(server.server.repository._models) == ["plus"]  # the memory this is about: no public readout
    assert [row["name"] for row in http.get_model_repository_index()] == ["plus"]
    write_model(repo, "ghost7", CONFIG.replace('"plus"', '"ghost7"'), {"model.onnx": plus_model(7.0)})
    grpc.load_model("ghost7")
    assert infer_http(server.http, model="ghost7") == 8.0

@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"load_models": ("plus",)}, "--load-model needs --model-control-mode explicit"),
        ({"model_control_mode": "sometimes"}, "allowed values are none, poll, explicit"),
        ({"model_control_mode": "explicit", "load_models": ("*", "nosuch")},
         r"--load-model '\*' loads every model: it cannot be combined with other --load-model names \(nosuch\)"),
        ({"model_control_mode": "poll", "repository_poll_s": 0}, "poll mode needs a positive interval"),
    ],
)
def test_bad_model_control_settings_are_one_line_startup_errors(repo, serve, overrides, message):
    with pytest.raises(StartupError, match=message):
        serve(repo, **overrides)


# ---------------------------------------------------------------- version policies

@pytest.mark.parametrize(
    ("policy", "served"),
    [
        ("", [3]),  # Triton's default: latest 1
        ("version_policy { latest { num_versions: 2 } }", [2, 3]),
        ("version_policy { all { } }", [1, 2, 3]),
        ("version_policy { specific { versions: [ 1, 3 ] } }", [1, 3]),
        ("version_policy { specific { versions: [ 1, 3, 5 ] } }", [1, 3]),  # Triton serves those present
    ],
)
def test_every_served_version_is_addressable_and_no_other(tmp_path, serve, policy, served):
    """Versions 1, 2, 3 on disk (Y = X + 10 * version): what the policy serves answers by version over
    HTTP and gRPC; a version on disk it does not serve is not ready and not inferable; no version: the
    newest served."""
    repo = tmp_path / "repo"
    write_model(repo, "plus", CONFIG + policy, {})
    for version in (1, 2, 3):
        add_version(repo, version, 10.0 * version)
    server = serve(repo)
    http, grpc = httpclient.InferenceServerClient(server.http), grpcclient.InferenceServerClient(server.grpc)
    assert http.get_model_metadata("plus")["versions"] == [str(v) for v in served]
    for version in (1, 2, 3):
        for module, client in ((httpclient, http), (grpcclient, grpc)):
            tensor = module.InferInput("X", [1, 1], "FP32")
            tensor.set_data_from_numpy(np.array([[1.0]], np.float32))
            assert client.is_model_ready("plus", str(version)) == (version in served)
            if version in served:
                result = client.infer("plus", [tensor], model_version=str(version)).as_numpy("Y")
                assert float(result[0, 0]) == 1.0 + 10.0 * version
            else:
                with pytest.raises(InferenceServerException):
                    client.infer("plus", [tensor], model_version=str(version))
    assert infer_http(server.http) == 1.0 + 10.0 * max(served)


@pytest.mark.parametrize("version", ["wrong_specification", "-1", "1_0", "+1", " 1", "\u0661"])
def test_a_version_that_is_not_a_number_is_an_invalid_argument_not_an_unknown_model(tmp_path, serve, version):
    """Triton parses the version before looking the model up: INVALID_ARGUMENT with its words (NVIDIA's
    grpc_explicit_int8_content_client matches on them); a number naming no version stays NOT_FOUND."""
    repo = tmp_path / "repo"
    write_model(repo, "plus", CONFIG, {})
    add_version(repo, 1, 10.0)
    server = serve(repo)
    expected = f"failed to get model version from specified version string '{version}'"
    http, grpc = httpclient.InferenceServerClient(server.http), grpcclient.InferenceServerClient(server.grpc)
    clients = [(httpclient, http, "400"), (grpcclient, grpc, "StatusCode.INVALID_ARGUMENT")]
    if not version.isascii() or " " in version:  # tritonclient's HTTP puts the version in the URL as it is
        clients = clients[1:]
    for module, client, code in clients:
        tensor = module.InferInput("X", [1, 1], "FP32")
        tensor.set_data_from_numpy(np.array([[1.0]], np.float32))
        calls = [
            lambda c=client, t=tensor: c.infer("plus", [t], model_version=version),
            lambda c=client: c.get_model_metadata("plus", model_version=version),
            lambda c=client: c.get_model_config("plus", model_version=version),
        ]
        if module is grpcclient:  # tritonclient's HTTP is_model_ready answers False for any non-200
            calls.append(lambda c=client: c.is_model_ready("plus", model_version=version))
        for call in calls:
            with pytest.raises(InferenceServerException) as caught:
                call()
            assert expected in caught.value.message() and str(caught.value.status()) == code, caught.value
        with pytest.raises(InferenceServerException) as unknown:
            client.get_model_metadata("plus", model_version="7")
        assert "Request for unknown model: 'plus' version 7 is not found" in unknown.value.message()
        metadata = client.get_model_metadata("plus", model_version="1")
        assert (metadata["name"] if module is httpclient else metadata.name) == "plus"
    raw = urllib.request.Request(f"http://{server.http}/v2/models/plus/versions/x/ready")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(raw, timeout=10)
    assert refused.value.code == 400 and "version string 'x'" in refused.value.read().decode()


def test_a_specific_policy_missing_a_version_serves_the_rest_and_says_so(tmp_path, serve, caplog):
    repo = tmp_path / "repo"
    write_model(repo, "plus", CONFIG + "version_policy { specific { versions: [ 2, 7 ] } }", {})
    for version in (1, 2):
        add_version(repo, version, 10.0 * version)
    write_model(repo, "none", CONFIG.replace('"plus"', '"none"') + "version_policy { specific { versions: [ 4 ] } }",
                {"model.onnx": plus_model(1.0)})
    with caplog.at_level(logging.WARNING, logger="sluice.runtime"):
        server = serve(repo, strict_readiness=False)
    http = httpclient.InferenceServerClient(server.http)
    assert http.get_model_metadata("plus")["versions"] == ["2"] and infer_http(server.http) == 21.0
    warned = [r.getMessage() for r in caplog.records if "version_policy.specific.versions" in r.getMessage()]
    assert any("model plus:" in w and "[7]" in w and "serving [2]" in w for w in warned), warned
    assert not http.is_model_ready("none")
    index = {m["name"]: m for m in http.get_model_repository_index()}
    reason = index["none"].get("reason", "")
    assert "none of versions [4] is in the repository; available versions: [1]" in reason, index["none"]
    assert str(tmp_path) not in reason  # no server path to clients


# ---------------------------------------------------------------- polling

def test_a_poll_loads_a_new_version_and_unloads_the_old_one(repo, serve):
    server = serve(repo, model_control_mode="poll", repository_poll_s=3600)
    assert infer_http(server.http) == 2.0
    assert server.call(server.server.poll_repository()) == {}  # nothing changed
    add_version(repo, 2, 10.0)
    found = server.call(server.server.poll_repository())
    assert found == {"plus": Change(Kind.CHANGED, versions_added=(2,))}
    assert infer_http(server.http) == 11.0
    http = httpclient.InferenceServerClient(server.http)
    assert http.get_model_metadata("plus")["versions"] == ["2"]  # latest 1, Triton's default policy
    rows = {(row["name"], row.get("version")): row["state"] for row in index(server.http)}
    assert rows == {("plus", "1"): "UNAVAILABLE", ("plus", "2"): "READY"}


def test_a_poll_applies_a_changed_config_removed_versions_and_removed_models(repo, serve):
    add_version(repo, 2, 10.0)
    write_model(repo, "other", CONFIG.replace('"plus"', '"other"'), {"model.onnx": plus_model(5.0)})
    server = serve(repo, model_control_mode="poll", repository_poll_s=3600)
    http = httpclient.InferenceServerClient(server.http)
    assert http.get_model_metadata("plus")["versions"] == ["2"]
    (repo / "plus" / "config.pbtxt").write_text(CONFIG + "version_policy { all { } }\n")
    shutil.rmtree(repo / "other")
    found = server.call(server.server.poll_repository())
    assert found == {"plus": Change(Kind.CHANGED, config_changed=True), "other": Change(Kind.REMOVED)}
    assert http.get_model_metadata("plus")["versions"] == ["1", "2"]
    assert not http.is_model_ready("other")
    shutil.rmtree(repo / "plus" / "2")
    server.call(server.server.poll_repository())
    assert http.get_model_metadata("plus")["versions"] == ["1"] and infer_http(server.http) == 2.0
    assert http.is_server_ready()  # a removed model is no longer expected


def test_the_poll_interval_runs_on_the_servers_clock(repo, serve):
    clock = ManualClock()
    server = serve(repo, model_control_mode="poll", repository_poll_s=15, clock=clock)
    add_version(repo, 2, 10.0)
    clock.advance(14)
    server.settle()
    assert _polls(server) == 0 and infer_http(server.http) == 2.0
    clock.advance(1)
    server.settle()  # the clock's poll has started; a poll asked for now waits for it, then finds nothing new
    assert server.call(server.server.poll_repository()) == {}
    assert _polls(server) == 2 and infer_http(server.http) == 11.0


def _polls(server) -> int:
    return int(float(metric_lines(server.metrics, "sluice_repository_polls_total")[0].split()[-1]))


def test_a_broken_new_version_leaves_the_old_one_serving_and_says_why(repo, serve, caplog):
    server = serve(repo, model_control_mode="poll", repository_poll_s=3600)
    add_version(repo, 2, None)  # not an ONNX file
    server.call(server.server.poll_repository())
    assert infer_http(server.http) == 2.0  # version 1 serves on
    rows = {row.get("version"): row for row in index(server.http)}
    assert rows["1"]["state"] == "READY" and rows["2"]["state"] == "UNAVAILABLE"
    for row in rows.values():
        assert "reload failed, previous versions still serving: failed to load 'plus'" in row["reason"]
        assert str(repo) not in row["reason"]
    assert any("failed to load 'plus'" in r.getMessage() for r in caplog.records if r.levelname == "ERROR")
    assert 'sluice_model_load_failures_total{model="plus"} 1.0' in metric_lines(server.metrics, "sluice_model_load")
    assert 'sluice_model_load_state{model="plus",state="STALE"} 1.0' in metric_lines(server.metrics, "sluice_model")
    # fixed on disk: the next poll serves it and the index is clean again
    shutil.rmtree(repo / "plus" / "2")
    add_version(repo, 2, 10.0)
    server.call(server.server.poll_repository())
    assert infer_http(server.http) == 11.0
    assert all("reason" not in row or not row["reason"] for row in index(server.http) if row["state"] == "READY")


# ---------------------------------------------------------------- zero-drop under load

class Load:
    """Threads of tritonclient HTTP and gRPC clients sending continuously; every answer recorded."""

    def __init__(self, server, threads: int = 4) -> None:
        self.answers: Counter[float] = Counter()
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(server, i % 2 == 0), daemon=True) for i in range(threads)
        ]

    def _run(self, server, use_http: bool) -> None:
        module = httpclient if use_http else grpcclient
        client = module.InferenceServerClient(server.http if use_http else server.grpc)
        tensor = module.InferInput("X", [1, 1], "FP32")
        tensor.set_data_from_numpy(np.array([[1.0]], np.float32))
        while not self._stop.is_set():
            try:
                value = float(client.infer("plus", [tensor]).as_numpy("Y")[0, 0])
            except Exception as exc:  # every failure is a finding
                with self._lock:
                    self.failures.append(f"{'HTTP' if use_http else 'gRPC'}: {exc}")
                continue
            with self._lock:
                self.answers[value] += 1
        client.close()

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def wait_for(self, value: float, count: int = 200) -> None:
        deadline = threading.Event()
        for _ in range(2000):
            with self._lock:
                if self.answers[value] >= count:
                    return
            deadline.wait(0.005)
        raise AssertionError(f"never saw {count} answers of {value}: {dict(self.answers)}, {self.failures[:3]}")

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)


def test_zero_drop_reload_under_load_by_poll_and_by_the_load_api(repo, serve):
    server = serve(repo, model_control_mode="poll", repository_poll_s=3600)
    with Load(server) as load:
        load.wait_for(2.0)
        add_version(repo, 2, 10.0)  # a new version
        server.call(server.server.poll_repository())
        load.wait_for(11.0)
        (repo / "plus" / "config.pbtxt").write_text(CONFIG + "version_policy { specific { versions: [1] } }\n")
        server.call(server.server.poll_repository())  # a changed config: back to version 1
        load.wait_for(2.0, count=load.answers[2.0] + 200)
        add_version(repo, 3, None)  # a broken version under load: nothing fails, version 1 serves on
        (repo / "plus" / "config.pbtxt").write_text(CONFIG)
        server.call(server.server.poll_repository())
        load.wait_for(2.0, count=load.answers[2.0] + 200)
    assert load.failures == []
    assert set(load.answers) == {2.0, 11.0}, load.answers
    print(f"\nreload under load (poll): {sum(load.answers.values())} requests, {len(load.failures)} failures, "
          f"answers by version: {{1: {load.answers[2.0]}, 2: {load.answers[11.0]}}}")


def test_zero_drop_reload_under_load_through_the_load_api(repo, serve):
    server = serve(repo, model_control_mode="explicit", load_models=("*",))
    http = httpclient.InferenceServerClient(server.http)
    grpc = grpcclient.InferenceServerClient(server.grpc)
    with Load(server) as load:
        load.wait_for(2.0)
        add_version(repo, 2, 10.0)
        http.load_model("plus")
        load.wait_for(11.0)
        add_version(repo, 3, 20.0)
        grpc.load_model("plus")
        load.wait_for(21.0)
    assert load.failures == []
    assert set(load.answers) == {2.0, 11.0, 21.0}, load.answers
    print(f"\nreload under load (API): {sum(load.answers.values())} requests, {len(load.failures)} failures, "
          f"answers by version: {{1: {load.answers[2.0]}, 2: {load.answers[11.0]}, 3: {load.answers[21.0]}}}")


SLOW_INIT_PY = """
import sys
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        gate = sys.modules["sluice_slow_init_gate"]
        gate.entered.set()
        gate.release.wait(30)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "INPUT0")]) for r in requests]
"""

SLOW_INIT_CONFIG = """
name: "slow"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
"""


def test_an_unload_sent_during_a_load_takes_effect_after_it_and_readiness_does_not_wait(repo, serve):
    """Calls on one model take effect in order: the unload waits for the load, then unloads, and the
    server is ready (it used to stay 503 for good: the load marked the model expected after the unload
    had dropped it)."""
    from .conftest import gate  # type: ignore[import-not-found]

    write_model(repo, "slow", SLOW_INIT_CONFIG, {"model.py": SLOW_INIT_PY})
    server = serve(repo, model_control_mode="explicit", load_models=("plus",))
    def load() -> None:  # a client per thread: tritonclient's HTTP client is not thread-safe
        other = httpclient.InferenceServerClient(server.http, network_timeout=60)
        other.load_model("slow")
        other.close()

    with gate("sluice_slow_init_gate") as g:
        loading = threading.Thread(target=load)
        loading.start()
        assert g.entered.wait(30)  # the load holds the model's lock in initialize

        async def waiters() -> int:
            model = server.server.repository._models["slow"]
            return len(getattr(model.lock, "_waiters", None) or ())

        unloaded = threading.Thread(target=lambda: server.call(server.server.repository.unload("slow")))
        unloaded.start()
        deadline = time.monotonic() + 10
        while server.call(waiters()) == 0:  # the unload is queued behind the load
            assert time.monotonic() < deadline, "the unload never waited for the model's lock"
        g.release.set()
        loading.join(30)
        unloaded.join(30)
    client = httpclient.InferenceServerClient(server.http)
    assert not client.is_model_ready("slow")
    assert client.is_server_ready()
    client.close()


def test_an_unloaded_model_is_unloading_while_its_requests_drain_then_unavailable(repo, serve):
    """Triton's index: UNLOADING while the model finishes what it runs, then UNAVAILABLE "unloaded"; a
    model whose directory is gone then leaves the index (Triton lists the repository's models)."""
    from .conftest import GATED_CONFIG, gate, gated_py  # type: ignore[import-not-found]

    write_model(repo, "gated", GATED_CONFIG, {"model.py": gated_py("sluice_unloading_gate")})
    server = serve(repo, model_control_mode="explicit", load_models=("gated", "plus"))

    def states() -> list[tuple[str, str, str]]:
        entries = [e for e in index(server.http) if e["name"] == "gated"]
        return [(e["name"], e.get("state", ""), e.get("reason", "")) for e in entries]

    def infer() -> None:
        client = httpclient.InferenceServerClient(server.http, network_timeout=60)
        tensor = httpclient.InferInput("INPUT0", [4], "FP32")
        tensor.set_data_from_numpy(np.ones(4, np.float32))
        client.infer("gated", [tensor])
        client.close()

    with gate("sluice_unloading_gate") as g:
        running = threading.Thread(target=infer)
        running.start()
        assert g.entered.wait(30)
        unloading = threading.Thread(target=lambda: server.call(server.server.repository.unload("gated", 30)))
        unloading.start()
        deadline = time.monotonic() + 10
        while states() != [("gated", "UNLOADING", "")]:
            assert time.monotonic() < deadline, states()
            time.sleep(0.01)
        g.release.set()
        running.join(30)
        unloading.join(30)
    assert states() == [("gated", "UNAVAILABLE", "unloaded")]
    shutil.rmtree(repo / "gated")
    assert states() == [] and [e["name"] for e in index(server.http)] == ["plus"]


def test_a_load_the_backend_refuses_is_a_400_as_in_triton(repo, serve):
    """A model that fails in its backend (a Python model that does not compile) is a failed load: 400 /
    INVALID_ARGUMENT naming it, as Triton answers, not a 5xx a client would retry."""
    write_model(repo, "broken", 'backend: "python"\ninput [ { name: "I" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
                'output [ { name: "O" data_type: TYPE_FP32 dims: [ 1 ] } ]\n', {"model.py": "def oops(:\n"})
    server = serve(repo, model_control_mode="explicit")
    with pytest.raises(InferenceServerException) as over_http:
        httpclient.InferenceServerClient(server.http).load_model("broken")
    assert over_http.value.status() == "400" and "failed to load 'broken'" in over_http.value.message()
    with pytest.raises(InferenceServerException) as over_grpc:
        grpcclient.InferenceServerClient(server.grpc).load_model("broken")
    assert over_grpc.value.status() == "StatusCode.INVALID_ARGUMENT"


def test_a_load_asking_for_what_its_backend_does_not_support_is_a_400_like_any_failed_load(repo, serve):
    """A request for a feature Sluice does not serve answers 501 / UNIMPLEMENTED (Triton's UNSUPPORTED);
    a model whose config asks its backend for one is a failed load, 400 over HTTP like any other."""
    write_model(repo, "streamy", CONFIG.replace('name: "plus"', 'name: "streamy"')
                + "model_transaction_policy { decoupled: true }\n", {"model.onnx": plus_model(1.0)})
    server = serve(repo, model_control_mode="explicit")
    with pytest.raises(InferenceServerException) as over_http:
        httpclient.InferenceServerClient(server.http).load_model("streamy")
    assert over_http.value.status() == "400"
    assert "the onnxruntime backend does not support model_transaction_policy { decoupled: true }" in \
        over_http.value.message()
    with pytest.raises(InferenceServerException) as over_grpc:
        grpcclient.InferenceServerClient(server.grpc).load_model("streamy")
    assert over_grpc.value.status() == "StatusCode.UNIMPLEMENTED"


def ensemble_over_plus(name: str) -> str:
    return f"""
name: "{name}"
platform: "ensemble"
max_batch_size: 8
input [ {{ name: "IN", data_type: TYPE_FP32, dims: [ 1 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] }} ]
ensemble_scheduling {{ step [ {{ model_name: "plus" model_version: -1
  input_map {{ key: "X" value: "IN" }} output_map {{ key: "Y" value: "OUT" }} }} ] }}
"""


@pytest.mark.parametrize("ensemble_at_start", [True, False], ids=["ensemble-at-start", "ensemble-polled"])
def test_an_ensemble_refused_for_a_missing_step_loads_once_a_poll_adds_the_step(repo, serve, ensemble_at_start):
    """Triton's poll mode: an ensemble whose step model is not in the repository fails to load; once a
    poll finds the step added, the step loads and the ensemble is loaded again and serves (it used to
    stay UNAVAILABLE until its own files changed)."""
    over_later = ensemble_over_plus("ens").replace('model_name: "plus"', 'model_name: "later"')
    if ensemble_at_start:
        write_model(repo, "ens", over_later, {})
    server = serve(repo, model_control_mode="poll", repository_poll_s=3600)
    if not ensemble_at_start:
        write_model(repo, "ens", over_later, {})
        assert server.call(server.server.poll_repository()) == {"ens": Change(Kind.ADDED)}
    http = httpclient.InferenceServerClient(server.http)
    [row] = [row for row in index(server.http) if row["name"] == "ens"]
    assert row["state"] == "UNAVAILABLE" and "step model 'later' is not in the model repository" in row["reason"]
    write_model(repo, "later", CONFIG.replace('"plus"', '"later"'), {"model.onnx": plus_model(5.0)})
    assert server.call(server.server.poll_repository()) == {"later": Change(Kind.ADDED)}
    assert http.is_model_ready("ens") and http.is_model_ready("later")
    tensor = httpclient.InferInput("IN", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.array([[1.0]], np.float32))
    assert float(http.infer("ens", [tensor]).as_numpy("OUT")[0, 0]) == 6.0
    grpc = grpcclient.InferenceServerClient(server.grpc)
    assert grpc.is_model_ready("ens")
    assert server.call(server.server.poll_repository()) == {}  # nothing new: nothing loaded again


def test_an_ensemble_whose_reload_waits_for_a_new_step_reloads_once_a_poll_adds_it(repo, serve):
    """A serving ensemble's config gains a step not in the repository yet: the reload is refused and the
    old config serves on (STALE); the poll that adds the step reloads the ensemble with the new config."""
    write_model(repo, "ens", ensemble_over_plus("ens"), {})
    server = serve(repo, model_control_mode="poll", repository_poll_s=3600)
    http = httpclient.InferenceServerClient(server.http)

    def infer_ens() -> float:
        tensor = httpclient.InferInput("IN", [1, 1], "FP32")
        tensor.set_data_from_numpy(np.array([[1.0]], np.float32))
        return float(http.infer("ens", [tensor]).as_numpy("OUT")[0, 0])

    assert infer_ens() == 2.0
    two_steps = ensemble_over_plus("ens").replace(
        'output_map { key: "Y" value: "OUT" } } ] }',
        'output_map { key: "Y" value: "MID" } },\n  { model_name: "later" model_version: -1 '
        'input_map { key: "X" value: "MID" } output_map { key: "Y" value: "OUT" } } ] }')
    assert "later" in two_steps
    (repo / "ens" / "config.pbtxt").write_text(two_steps)
    assert server.call(server.server.poll_repository()) == {"ens": Change(Kind.CHANGED, config_changed=True)}
    [row] = [row for row in index(server.http) if row["name"] == "ens"]
    assert "reload failed, previous versions still serving" in row["reason"] and "'later'" in row["reason"]
    assert infer_ens() == 2.0
    write_model(repo, "later", CONFIG.replace('"plus"', '"later"'), {"model.onnx": plus_model(5.0)})
    assert server.call(server.server.poll_repository()) == {"later": Change(Kind.ADDED)}
    assert infer_ens() == 7.0  # 1 + 1, then + 5: the new config
    [row] = [row for row in index(server.http) if row["name"] == "ens"]
    assert row["state"] == "READY" and not row.get("reason")


def test_unload_dependents_unloads_an_ensemble_s_steps_unless_another_ensemble_uses_them(repo, serve):
    """Triton's repository extension: unload_dependents also unloads the composing models (tritonclient's
    unload_model(..., unload_dependents=True), over HTTP and gRPC) that were loaded along with an ensemble,
    once no loaded ensemble uses them; a model a user loaded stays."""
    for name in ("ens_a", "ens_b"):
        write_model(repo, name, ensemble_over_plus(name), {})
    server = serve(repo, model_control_mode="explicit", load_models=("ens_a", "ens_b"))
    http = httpclient.InferenceServerClient(server.http)
    grpc = grpcclient.InferenceServerClient(server.grpc)
    try:
        assert all(http.is_model_ready(m) for m in ("plus", "ens_a", "ens_b"))  # plus: loaded along with them
        http.unload_model("ens_a", unload_dependents=True)
        assert not http.is_model_ready("ens_a") and http.is_model_ready("plus")  # ens_b still uses it
        grpc.unload_model("ens_b", unload_dependents=True)
        assert not http.is_model_ready("ens_b") and not http.is_model_ready("plus")
        http.load_model("plus")  # loaded by a user now
        http.load_model("ens_a")
        http.unload_model("ens_a", unload_dependents=True)
        assert http.is_model_ready("plus")  # Triton: only models "not explicitly loaded" go with it
        http.load_model("ens_a")
        http.unload_model("ens_a")  # without the parameter: the step stays
        assert http.is_model_ready("plus")
        request = urllib.request.Request(
            f"http://{server.http}/v2/repository/models/plus/unload",
            data=json.dumps({"parameters": {"unload_dependents": "yes"}}).encode(), method="POST",
        )
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request)
        assert caught.value.code == 400 and b"'unload_dependents' must be true or false" in caught.value.read()
        assert http.is_model_ready("plus")
    finally:
        grpc.close()
        http.close()


def test_loading_an_ensemble_loads_its_composing_models(repo, serve):
    """Triton loads an ensemble's steps with it, at start (--load-model) and through the load API; a
    step that cannot load fails the ensemble's load naming the step."""
    write_model(repo, "ens_a", ensemble_over_plus("ens_a"), {})
    write_model(repo, "ens_b", ensemble_over_plus("ens_b"), {})
    write_model(repo, "outer", ensemble_over_plus("outer").replace('model_name: "plus"', 'model_name: "ens_b"'), {})
    write_model(repo, "bad", 'backend: "onnxruntime"\nmax_batch_size: 8\n', {"model.onnx": b"not an onnx model"})
    write_model(repo, "broken", ensemble_over_plus("broken").replace('model_name: "plus"', 'model_name: "bad"'), {})
    server = serve(repo, model_control_mode="explicit", load_models=("ens_a",))
    http = httpclient.InferenceServerClient(server.http)
    try:
        assert http.is_server_ready() and http.is_model_ready("ens_a") and http.is_model_ready("plus")
        tensor = httpclient.InferInput("IN", [1, 1], "FP32")
        tensor.set_data_from_numpy(np.array([[2.0]], np.float32))
        through = float(http.infer("ens_a", [tensor]).as_numpy("OUT")[0][0])
        assert through == infer_http(server.http, 2.0, model="plus")
        http.unload_model("ens_a", unload_dependents=True)
        assert not http.is_model_ready("plus")
        http.load_model("outer")  # an ensemble over an ensemble: both levels of steps
        assert all(http.is_model_ready(m) for m in ("outer", "ens_b", "plus"))
        with pytest.raises(InferenceServerException) as caught:
            http.load_model("broken")
        assert "failed to load 'broken': its ensemble step model 'bad' cannot be loaded" in caught.value.message()
        assert not http.is_model_ready("broken") and http.is_model_ready("plus")
    finally:
        http.close()


@pytest.mark.parametrize("odd", ["01", "0", "\u0662", "1a"])
def test_only_triton_s_version_directory_names_are_versions(repo, serve, odd):
    """Triton ignores subdirectories that are not numeric or start with 0; 'str.isdigit' took '01'
    as version 1 (then failed to find its files) and Arabic-Indic digits as a number."""
    (repo / "plus" / odd).mkdir()
    (repo / "plus" / odd / "model.onnx").write_bytes(b"not a model")
    server = serve(repo)
    assert infer_http(server.http) == 2.0
    assert [(m["name"], m["version"], m["state"]) for m in index(server.http)] == [("plus", "1", "READY")]


def test_a_poll_still_running_when_the_next_is_due_does_not_spin_the_timer(repo, serve):
    """A poll that outlasts the interval (a large version syncing, a slow reload): the timer used to be
    re-armed for the past deadline and fire again at once, for ever (100 % of the event loop)."""
    clock = ManualClock()
    server = serve(repo, model_control_mode="poll", repository_poll_s=15, clock=clock)
    control = server.server.dataplane.control

    async def hold() -> None:
        await control._lock.acquire()  # the next poll waits here, as behind a long one

    async def release() -> None:
        control._lock.release()

    server.call(hold())
    clock.advance(15)  # due: a poll starts and waits for the lock
    server.settle()
    clock.advance(15)  # due again while it still waits
    server.settle()
    assert control._due > clock(), "the next poll is due in the past: the timer fires again at once"
    server.call(release())
    server.settle()


def test_a_reload_keeps_the_versions_that_did_not_change(repo, serve):
    """Triton reloads only what changed: a load with nothing changed leaves the model as it is (its
    statistics and instances), a new version leaves the others serving untouched, and a changed
    version is loaded again."""
    add_version(repo, 2, 20.0)
    write_model(repo, "plus", 'backend: "onnxruntime"\nmax_batch_size: 8\nversion_policy { all { } }\n', {})
    server = serve(repo, model_control_mode="explicit", load_models=("plus",))
    http = httpclient.InferenceServerClient(server.http)

    def served() -> dict[str, int]:
        stats = http.get_inference_statistics("plus")["model_stats"]
        return {s["version"]: s["inference_stats"]["success"]["count"] for s in stats}

    try:
        for version in ("1", "2"):
            inputs = [httpclient.InferInput("X", [1, 1], "FP32")]
            inputs[0].set_data_from_numpy(np.ones((1, 1), np.float32))
            http.infer("plus", inputs, model_version=version)
        assert served() == {"1": 1, "2": 1}
        http.load_model("plus")  # nothing changed
        assert served() == {"1": 1, "2": 1}
        add_version(repo, 3, 30.0)
        http.load_model("plus")  # version 3 added: 1 and 2 serve on as they were
        assert served() == {"1": 1, "2": 1, "3": 0}
        (repo / "plus" / "2" / "model.onnx").write_bytes(plus_model(22.0))
        http.load_model("plus")  # version 2's file changed: it alone is new
        assert served() == {"1": 1, "2": 0, "3": 0}
        assert infer_http(server.http, 1.0) == 31.0
    finally:
        http.close()


def test_a_model_loaded_from_files_in_the_request(repo, serve, tmp_path):
    """Triton's file overrides (tritonclient ``load_model(name, config=..., files=...)``): the model is made
    of the request's files alone, over HTTP (base64) and gRPC (bytes); its temporary directory goes
    when its versions do, and never shows in an answer."""
    import glob
    import tempfile

    def leftovers() -> set[str]:
        return set(glob.glob(os.path.join(tempfile.gettempdir(), "sluice-load-*")))

    before = leftovers()
    server = serve(repo, model_control_mode="explicit")
    http = httpclient.InferenceServerClient(server.http)
    grpc = grpcclient.InferenceServerClient(server.grpc)
    config = json.dumps({"backend": "onnxruntime", "max_batch_size": 8})
    try:
        http.load_model("sent", config=config, files={"file:1/model.onnx": plus_model(5.0)})
        assert infer_http(server.http, 1.0, model="sent") == 6.0
        grpc.load_model("sent", config=config, files={"file:2/model.onnx": plus_model(7.0)})  # replaces version 1
        assert infer_http(server.http, 1.0, model="sent") == 8.0
        assert len(leftovers() - before) == 1  # the first load's directory went with its version
        for files, cfg, says in (
            ({"file:1/model.onnx": b"x"}, None, "need the parameter 'config' too"),
            ({"file:../model.onnx": b"x"}, config, "allowed: a relative path inside the model's directory"),
            ({"file:model.onnx": b"x"}, config, "allowed: <version>/<file>"),
        ):
            with pytest.raises(InferenceServerException) as caught:
                http.load_model("sent", config=cfg, files=files)
            assert caught.value.status() == "400" and says in caught.value.message(), caught.value.message()
        with pytest.raises(InferenceServerException) as caught:
            grpc.load_model("broken_sent", config=config, files={"file:1/model.onnx": b"not an onnx model"})
        assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "sluice-load-" not in caught.value.message() and tempfile.gettempdir() not in caught.value.message()
        assert infer_http(server.http, 1.0, model="sent") == 8.0  # the failed ones changed nothing
        http.unload_model("sent")
        assert leftovers() == before
    finally:
        http.close()
        grpc.close()


def test_a_load_whose_files_cannot_be_written_is_a_400_and_leaves_nothing(repo, serve):
    import glob
    import tempfile

    def leftovers() -> set[str]:
        return set(glob.glob(os.path.join(tempfile.gettempdir(), "sluice-load-*")))

    before = leftovers()
    server = serve(repo, model_control_mode="explicit")
    http = httpclient.InferenceServerClient(server.http)
    config = json.dumps({"backend": "onnxruntime", "max_batch_size": 8})
    try:
        for files in ({"file:1/model.onnx": plus_model(5.0), "file:1/" + "x" * 300: b"y"},  # a name too long
                      {"file:1/a": b"y", "file:1/a/b": b"z"}):  # a path both a file and a directory
            with pytest.raises(InferenceServerException) as caught:
                http.load_model("sent", config=config, files=files)
            assert caught.value.status() == "400" and "cannot be written as a file" in caught.value.message()
            assert tempfile.gettempdir() not in caught.value.message()
        assert leftovers() == before
        assert "LOADING" not in server.server.repository.load_states().values()
        http.load_model("sent", config=config, files={"file:1/model.onnx": plus_model(5.0)})
        assert infer_http(server.http, 1.0, model="sent") == 6.0
    finally:
        http.close()


def test_a_step_that_fails_at_start_is_tried_once_and_an_ensemble_load_failing_in_a_step_is_a_400(repo, serve):
    write_model(repo, "bad", 'backend: "onnxruntime"\nmax_batch_size: 8\n', {"model.onnx": b"not an onnx model"})
    write_model(repo, "broken", ensemble_over_plus("broken").replace('model_name: "plus"', 'model_name: "bad"'), {})
    server = serve(repo)  # none mode: every model at start, the step included
    assert server.server.repository.load_failures.get("bad") == 1
    assert "bad" not in server.server.repository.implicit
    explicit = serve(repo, model_control_mode="explicit")
    with pytest.raises(InferenceServerException) as caught:
        grpcclient.InferenceServerClient(explicit.grpc).load_model("broken")
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "its ensemble step model 'bad' cannot be loaded" in caught.value.message()


def test_a_reload_sees_a_file_replaced_keeping_its_size_and_mtime(repo, serve):
    """tar -x, rsync -a and cp -p put a new file in place with the old size and mtime: the new inode
    tells the version changed, so the load loads it (it kept the old model)."""
    server = serve(repo, model_control_mode="explicit", load_models=("plus",))
    path = repo / "plus" / "1" / "model.onnx"
    st = os.stat(path)
    staged = repo / "plus" / "1" / ".model.onnx.tmp"
    staged.write_bytes(plus_model(5.0))
    os.utime(staged, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(staged, path)
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns
    httpclient.InferenceServerClient(server.http).load_model("plus")
    assert infer_http(server.http, 1.0) == 6.0


def test_a_step_a_user_is_loading_is_not_taken_as_the_ensembles(repo, serve):
    """A user loads a model; meanwhile an ensemble over it loads: the step is the user's, not one loaded
    along with the ensemble, so unload_dependents leaves it (it used to go)."""
    from .conftest import gate  # type: ignore[import-not-found]

    write_model(repo, "slow", SLOW_INIT_CONFIG, {"model.py": SLOW_INIT_PY})
    write_model(repo, "over_slow", 'name: "over_slow"\nplatform: "ensemble"\nmax_batch_size: 0\n'
                'input [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
                'output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
                'ensemble_scheduling { step [ { model_name: "slow" input_map { key: "INPUT0" value: "IN" } '
                'output_map { key: "INPUT0" value: "OUT" } } ] }\n', {})
    server = serve(repo, model_control_mode="explicit")

    def load(name: str) -> None:
        client = httpclient.InferenceServerClient(server.http, network_timeout=60)
        client.load_model(name)
        client.close()

    with gate("sluice_slow_init_gate") as g:
        user = threading.Thread(target=load, args=("slow",))
        user.start()
        assert g.entered.wait(30)  # the user's load is initializing the model
        ensemble = threading.Thread(target=load, args=("over_slow",))
        ensemble.start()
        ensemble.join(10)
        assert not ensemble.is_alive(), "the ensemble's load waited for its step's other load"
        g.release.set()
        user.join(30)
    assert "slow" not in server.server.repository.implicit
    http = httpclient.InferenceServerClient(server.http)
    assert http.is_model_ready("over_slow")
    http.unload_model("over_slow", unload_dependents=True)
    assert http.is_model_ready("slow")
    http.close()
