"""The `sluice` command as a user and Kubernetes meet it: drain on SIGTERM without refusing a single
connection, one-line errors, and a ``--help`` that documents every flag and its default."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from sluice.runtime import __version__

from .conftest import ADD_SUB_CONFIG, BUILDERS, write_model  # type: ignore[import-not-found]
from .test_cli_shutdown import start_ports  # type: ignore[import-not-found]

MARKER_PY = """
import os


class TritonPythonModel:
    def initialize(self, args):
        open(os.path.join(os.path.dirname(__file__), "initialized"), "w").close()

    def execute(self, requests):
        return []
"""


def sluice(*args: str, cwd, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sluice.runtime", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def ready(http: int) -> bool | None:
    """True/False from /v2/health/ready; None when the connection itself failed."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=5) as response:
            return response.status == 200
    except urllib.error.HTTPError:
        return False
    except OSError:
        return None


def test_sigterm_drains_a_client_loop_sees_no_connection_error(tmp_path):
    """A load balancer stops sending once readiness fails (plus propagation time); until then every
    request, over HTTP and gRPC, is served: no connection refused, no UNAVAILABLE."""
    repo = tmp_path / "repo"
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    # overload shedding (a 503 on a busy 2-core machine) is not what this test is about
    proc, ports = start_ports(repo, tmp_path, "--drain-period-s", "3", "--overload-control", "off")
    http, grpc_port = ports["http"], ports["grpc"]
    routed = threading.Event()  # the "endpoint": set while the balancer still sends to this pod
    routed.set()
    errors: list[str] = []
    served = {"before": 0, "after": 0}
    term_sent = threading.Event()
    x = np.ones(16, dtype=np.float32)

    def http_loop() -> None:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{http}", network_timeout=10)
        while routed.is_set():
            inputs = [httpclient.InferInput(n, [16], "FP32") for n in ("INPUT0", "INPUT1")]
            for tensor in inputs:
                tensor.set_data_from_numpy(x)
            try:
                client.infer("add_sub", inputs)
                served["after" if term_sent.is_set() else "before"] += 1
            except Exception as exc:  # every failure is a finding
                errors.append(f"http: {exc!r} {exc}")
                return

    def grpc_loop() -> None:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        while routed.is_set():
            inputs = [grpcclient.InferInput(n, [16], "FP32") for n in ("INPUT0", "INPUT1")]
            for tensor in inputs:
                tensor.set_data_from_numpy(x)
            try:
                client.infer("add_sub", inputs, client_timeout=10)
                served["after" if term_sent.is_set() else "before"] += 1
            except Exception as exc:
                errors.append(f"grpc: {exc!r} {exc}")
                return

    def balancer() -> None:
        while ready(http):
            time.sleep(0.02)
        time.sleep(0.3)  # endpoint removal takes a while to reach every client
        routed.clear()

    threads = [threading.Thread(target=f) for f in (http_loop, http_loop, grpc_loop, grpc_loop)]
    for thread in threads:
        thread.start()
    watcher = threading.Thread(target=balancer)
    try:
        deadline = time.monotonic() + 30
        while served["before"] < 50 and not errors:
            assert time.monotonic() < deadline, "clients made no progress"
            time.sleep(0.01)
        watcher.start()
        term_sent.set()
        proc.send_signal(signal.SIGTERM)
        watcher.join(30)
        for thread in threads:
            thread.join(30)
        assert proc.wait(30) == 0
    finally:
        routed.clear()
        if proc.poll() is None:
            proc.kill()
    assert errors == []
    assert served["after"] > 0  # it kept serving while draining


def test_a_port_in_use_is_one_line_and_no_model_is_loaded(tmp_path):
    repo = tmp_path / "repo"
    model_dir = write_model(
        repo,
        "marker",
        'name: "marker"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
        'output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]\n',
        {"model.py": MARKER_PY},
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = sluice(
            "serve", "--model-repository", str(repo), "--http-port", str(port), "--grpc-port", "0",
            "--metrics-port", "0", cwd=tmp_path,
        )  # fmt: skip
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("sluice: error:")]
    assert len(errors) == 1 and "already in use" in errors[0] and f"HTTP {port}" in errors[0], out.stderr
    assert not (model_dir / "1" / "initialized").exists()  # checked before models load


def test_a_missing_repository_is_one_line(tmp_path):
    out = sluice("serve", "--model-repository", str(tmp_path / "nope"), cwd=tmp_path)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().startswith("sluice: error: --model-repository") and "not a directory" in out.stderr


@pytest.mark.parametrize(("flag", "value"), [
    ("--duplicate-window-s", "inf"), ("--drain-period-s", "nan"), ("--shutdown-grace-s", "inf"),
    ("--overload-target-ms", "nan"), ("--repository-poll-secs", "-inf"),
])
def test_a_number_flag_that_is_not_finite_is_one_line(tmp_path, flag, value):
    out = sluice("serve", "--model-repository", str(tmp_path), f"{flag}={value}", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"{flag}: {value!r} is not finite" in out.stderr, out.stderr


def test_help_documents_every_flag_and_its_default(tmp_path):
    out = sluice("serve", "--help", cwd=tmp_path)
    assert out.returncode == 0
    text = re.sub(r"\s+", " ", out.stdout.split("options:", 1)[1])
    flags = re.findall(r"(--[a-z0-9-]+)(?: [A-Z_{},a-z0-9]+)? ", text)
    documented = set(flags) - {"--help"}
    assert len(documented) >= 25, documented
    for flag in documented:
        entry = re.search(re.escape(flag) + r"(?: \S+)? (.*?)(?= --[a-z]|$)", text)
        assert entry is not None, flag
        if flag == "--model-repository":
            continue  # required: no default
        assert "(default:" in entry.group(1), (flag, entry.group(1))


def test_version(tmp_path):
    out = sluice("--version", cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == f"sluice {__version__}"


def test_server_name_is_reported_in_the_metadata(serve, tmp_path):
    repo = tmp_path / "repo"
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    server = serve(repo, server_name="triton")
    assert httpclient.InferenceServerClient(server.http).get_server_metadata()["name"] == "triton"
    assert grpcclient.InferenceServerClient(server.grpc).get_server_metadata().name == "triton"
    default = serve(repo)
    assert httpclient.InferenceServerClient(default.http).get_server_metadata()["name"] == "sluice"


@pytest.mark.parametrize(("flags", "says"), [
    (("--cache-config", "redis,host=cache"), "cache 'redis' is not available; allowed: local,size=<bytes>"),
    (("--cache-config", "local,bytes=10"), "allowed: local,size=<bytes>"),
    (("--cache-config", "local,size=0"), "size '0' is not a positive number of bytes"),
    (("--response-cache-byte-size", "-5"), "is negative"),
    (("--cache-config", "local,size=1048576", "--response-cache-byte-size", "10"), "both set the server cache"),
])
def test_a_bad_server_cache_flag_is_one_line(tmp_path, flags, says):
    out = sluice("serve", "--model-repository", str(tmp_path), *flags, cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert says in out.stderr, out.stderr


@pytest.mark.parametrize(("flags", "shared"), [
    ((), 0),
    (("--cache-config", "local,size=1048576"), 1048576),
    (("--response-cache-byte-size", "4096"), 4096),
])
def test_the_server_cache_flags_set_one_shared_bound(tmp_path, flags, shared):
    from sluice.runtime.__main__ import _parser, settings_from_args

    args = _parser().parse_args(["serve", "--model-repository", str(tmp_path), *flags])
    assert settings_from_args(args).scheduling.response_cache_shared_bytes == shared
