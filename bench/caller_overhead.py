"""Server CPU per request with and without a caller name (the Sluice-Caller header / sluice-caller metadata).

    python bench/caller_overhead.py [--requests 4000] [--rounds 3] [--baseline-path DIR]

Starts ``sluice serve`` on free loopback ports with the tiny ``add_sub`` ONNX model (16 floats in,
16 out: the model costs little, so the request path dominates), sends ``--requests`` sequential
requests per point with tritonclient over HTTP and gRPC, and reads the server process's CPU time
(utime + stime, /proc) around each point (``--worker-spin-us 0``, so idle polling is not counted):
server CPU microseconds per request is the figure, less noisy on a small machine than throughput.
Points: no caller; a caller (per-caller counts, and the duplicate digest with the default 10 s
window); a caller with ``--duplicate-window-s 0``.
``--baseline-path DIR`` also runs the no-caller point against another checkout's ``sluice``
package (a directory holding ``sluice/runtime``, e.g. ``git archive`` of an older commit) for a
before/after comparison. Prints a markdown table of the median over ``--rounds``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CONFIG = """
name: "add_sub"
backend: "onnxruntime"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 16 ] },
        { name: "INPUT1", data_type: TYPE_FP32, dims: [ 16 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 16 ] },
         { name: "OUTPUT1", data_type: TYPE_FP32, dims: [ 16 ] } ]
"""


def _builders():
    spec = importlib.util.spec_from_file_location("make_models", ROOT / "examples" / "make_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(repo: Path, tmp: str, extra: list[str], pythonpath: str | None) -> tuple[subprocess.Popen, int, int]:
    http, grpc = free_port(), free_port()
    cmd = [
        sys.executable, "-m", "sluice.runtime", "serve", "--model-repository", str(repo), "--http-port", str(http),
        "--grpc-port", str(grpc), "--metrics-port", "-1", "--log-level", "WARNING", "--worker-spin-us", "0", *extra,
    ]  # fmt: skip
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    server = subprocess.Popen(cmd, start_new_session=True, cwd=tmp, env=env)
    for _ in range(300):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=1):
                break
        except OSError:
            time.sleep(0.1)
    return server, http, grpc


def drive(server: subprocess.Popen, protocol: str, port: int, caller: str | None, n: int) -> float:
    """Server CPU us per request over ``n`` sequential requests with distinct inputs."""
    if protocol == "http":
        import tritonclient.http as module
    else:
        import tritonclient.grpc as module
    client = module.InferenceServerClient(f"127.0.0.1:{port}")
    key = "Sluice-Caller" if protocol == "http" else "sluice-caller"
    headers = None if caller is None else {key: caller}
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = module.InferInput(name, [16], "FP32")
        tensor.set_data_from_numpy(np.zeros(16, np.float32), **({"binary_data": True} if protocol == "http" else {}))
        inputs.append(tensor)
    for _ in range(200):  # warm-up: plan caches, connections
        client.infer("add_sub", inputs, headers=headers)
    before = cpu_seconds(server.pid)
    for _ in range(n):
        client.infer("add_sub", inputs, headers=headers)
    used = cpu_seconds(server.pid) - before
    client.close()
    return used / n * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--baseline-path", default=None, help="directory holding an older sluice/runtime to compare with")
    a = p.parse_args()
    points = []
    if a.baseline_path:
        points.append(("baseline checkout, no caller", [], a.baseline_path, None))
    points += [
        ("this checkout, no caller", [], None, None),
        ("this checkout, caller (window 10 s)", [], None, "bench-client"),
        ("this checkout, caller, --duplicate-window-s 0", ["--duplicate-window-s", "0"], None, "bench-client"),
    ]
    results: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        (repo / "add_sub" / "1").mkdir(parents=True)
        (repo / "add_sub" / "config.pbtxt").write_text(CONFIG)
        (repo / "add_sub" / "1" / "model.onnx").write_bytes(_builders().add_sub_model())
        for _ in range(a.rounds):  # rounds interleave the points, so drift hits each alike
            for label, extra, path, caller in points:
                server, http, grpc = start(repo, tmp, extra, path)
                try:
                    for protocol, port in (("http", http), ("grpc", grpc)):
                        used = drive(server, protocol, port, caller, a.requests)
                        results.setdefault((label, protocol), []).append(used)
                finally:
                    os.killpg(server.pid, signal.SIGTERM)
                    server.wait(30)
    print(f"\n{os.cpu_count()} CPUs, {a.requests} sequential requests per point, median of {a.rounds} rounds\n")
    print("| code and caller | HTTP server CPU us/req | gRPC server CPU us/req |")
    print("|---|---:|---:|")
    for label, *_ in points:
        http_us = statistics.median(results[(label, "http")])
        grpc_us = statistics.median(results[(label, "grpc")])
        print(f"| {label} | {http_us:.1f} | {grpc_us:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
