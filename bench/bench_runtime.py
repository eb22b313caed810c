"""Served throughput and latency of an ONNX MLP against calling onnxruntime directly.

    python bench/bench_runtime.py [--duration 6] [--concurrency 1,8,32,64] [--perf-analyzer PATH]

Starts ``sluice serve`` on free loopback ports with an MLP (256 -> 1024 -> 1024 -> 16, fp32,
dynamic batch up to 64), drives it over HTTP (binary tensor extension) and gRPC at each
concurrency with perf_analyzer (Triton's C++ load generator; PyPI ``perf-analyzer``) when it is
found, else with a closed-loop asyncio tritonclient generator, and prints a markdown table:
throughput, p50, p99, the mean batch size the server formed (from its statistics endpoint), and
the ratio of served throughput to onnxruntime called in-process at that batch size.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
LAYERS = (256, 1024, 1024, 16)


def _builders():
    spec = importlib.util.spec_from_file_location("make_models", ROOT / "examples" / "make_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_repo(root: Path, queue_delay_us: int) -> bytes:
    blob = _builders().mlp_model(LAYERS, seed=0)
    (root / "mlp" / "1").mkdir(parents=True)
    (root / "mlp" / "1" / "model.onnx").write_bytes(blob)
    (root / "mlp" / "config.pbtxt").write_text(
        'name: "mlp"\nbackend: "onnxruntime"\nmax_batch_size: 64\n'
        f"dynamic_batching {{ preferred_batch_size: [16, 32, 64] max_queue_delay_microseconds: {queue_delay_us} }}\n"
        "instance_group [ { kind: KIND_CPU, count: 1 } ]\n"
    )
    return blob


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raw_ort(blob: bytes, batch: int, seconds: float = 1.5) -> tuple[float, float]:
    """(rows/s, median ms per call) of onnxruntime called directly with one intra-op thread."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(blob, options, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((batch, LAYERS[0])).astype(np.float32)
    for _ in range(20):
        session.run(None, {"INPUT0": x})
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        session.run(None, {"INPUT0": x})
        times.append(time.perf_counter() - t)
    times.sort()
    return batch * len(times) / sum(times), times[len(times) // 2] * 1e3


def stats(http: str) -> tuple[int, int]:
    with urllib.request.urlopen(f"http://{http}/v2/models/mlp/stats", timeout=5) as r:
        doc = json.loads(r.read())["model_stats"][0]
    return int(doc["inference_count"]), int(doc["execution_count"])


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc), to report server CPU per request."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def perf_analyzer(pa: str, url: str, protocol: str, c: int, duration: float) -> tuple[float, float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        csv = Path(tmp) / "pa.csv"
        cmd = [
            pa, "-m", "mlp", "-u", url, "-i", protocol, "--concurrency-range", str(c),
            "--measurement-interval", str(int(duration * 1000 / 3)), "--stability-percentage", "999",
            "--max-trials", "3", "-f", str(csv),
        ]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration * 4 + 60, check=False)
        if out.returncode != 0 or not csv.exists():
            raise RuntimeError((out.stdout + out.stderr).strip()[-300:])
        header, values = csv.read_text().splitlines()[:2]
        row = dict(zip(header.split(","), values.split(","), strict=False))
        return float(row["Inferences/Second"]), float(row["p50 latency"]) / 1e3, float(row["p99 latency"]) / 1e3


def python_loadgen(url: str, protocol: str, c: int, duration: float) -> tuple[float, float, float]:
    async def run() -> list[float]:
        if protocol == "http":
            import tritonclient.http.aio as client_mod
        else:
            import tritonclient.grpc.aio as client_mod
        client = client_mod.InferenceServerClient(url)
        x = np.random.default_rng(1).standard_normal((1, LAYERS[0])).astype(np.float32)
        latencies: list[float] = []
        stop = time.perf_counter() + duration

        async def worker() -> None:
            inp = client_mod.InferInput("INPUT0", [1, LAYERS[0]], "FP32")
            inp.set_data_from_numpy(x)
            while time.perf_counter() < stop:
                t = time.perf_counter()
                await client.infer("mlp", [inp])
                latencies.append(time.perf_counter() - t)

        await asyncio.gather(*(worker() for _ in range(c)))
        await client.close()
        return latencies

    lat = sorted(asyncio.run(run()))
    return len(lat) / duration, lat[len(lat) // 2] * 1e3, lat[int(len(lat) * 0.99)] * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=6.0, help="seconds per point")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--protocols", default="http,grpc")
    p.add_argument("--perf-analyzer", default=shutil.which("perf_analyzer"), help="path of perf_analyzer")
    p.add_argument("--queue-delay-us", type=int, default=500)
    p.add_argument("--server-args", default="", help="extra arguments for sluice serve")
    a = p.parse_args()
    levels = [int(c) for c in a.concurrency.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        blob = write_repo(repo, a.queue_delay_us)
        http, grpc_port, metrics = free_port(), free_port(), free_port()
        cmd = [
            sys.executable, "-m", "sluice.runtime", "serve", "--model-repository", str(repo),
            "--http-port", str(http), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics),
            "--log-level", "WARNING", *a.server_args.split(),
        ]  # fmt: skip
        # cwd outside the checkout: `python -m` puts the cwd on sys.path, where ./operator would
        # shadow the standard library's operator module.
        server = subprocess.Popen(cmd, start_new_session=True, cwd=tmp)
        try:
            for _ in range(200):
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=1):
                        break
                except OSError:
                    time.sleep(0.1)
            loadgen = "perf_analyzer" if a.perf_analyzer else "python (tritonclient aio)"
            print(f"load generator: {loadgen}; {os.cpu_count()} CPUs; {a.duration:.0f} s per point", file=sys.stderr)
            rows = []
            raw_cache: dict[int, tuple[float, float]] = {}
            for protocol in a.protocols.split(","):
                url = f"127.0.0.1:{http if protocol == 'http' else grpc_port}"
                for c in levels:
                    before = stats(f"127.0.0.1:{http}")
                    cpu_before = cpu_seconds(server.pid)
                    if a.perf_analyzer:
                        tput, p50, p99 = perf_analyzer(a.perf_analyzer, url, protocol, c, a.duration)
                    else:
                        tput, p50, p99 = python_loadgen(url, protocol, c, a.duration)
                    after = stats(f"127.0.0.1:{http}")
                    cpu = cpu_seconds(server.pid) - cpu_before
                    rows_done, execs = after[0] - before[0], after[1] - before[1]
                    cpu_us = cpu / rows_done * 1e6 if rows_done else 0.0
                    mean_batch = rows_done / execs if execs else 0.0
                    bs = max(1, round(mean_batch))
                    if bs not in raw_cache:
                        raw_cache[bs] = raw_ort(blob, bs)
                    raw_tput, _raw_ms = raw_cache[bs]
                    rows.append((protocol, c, tput, p50, p99, mean_batch, raw_tput, cpu_us))
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(30)
    print(f"\nload generator: {loadgen}\n")
    print(
        "| protocol | concurrency | inf/s | p50 ms | p99 ms | mean batch | server CPU us/inf "
        "| raw ORT rows/s at that batch | ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for protocol, c, tput, p50, p99, mean_batch, raw_tput, cpu_us in rows:
        print(
            f"| {protocol} | {c} | {tput:,.0f} | {p50:.2f} | {p99:.2f} | {mean_batch:.1f} | {cpu_us:.0f} "
            f"| {raw_tput:,.0f} | {tput / raw_tput:.2f} |"
        )
    raw1 = raw_ort(blob, 1)
    print(f"\nraw onnxruntime bs1: {raw1[0]:,.0f} calls/s, p50 {raw1[1]:.3f} ms per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
