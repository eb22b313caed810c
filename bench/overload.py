"""Overload behaviour: goodput, p99 of served requests, wasted executions and memory at 2x capacity.

    python bench/overload.py [--seconds 10] [--overload 2.0] [--client-timeout-ms 250]

A Python-backend model with a fixed cost (it sleeps ``--batch-ms`` per batch of up to
``--max-batch`` rows, so capacity is known: max_batch / batch_ms) is served by ``sluice serve``
with default settings. An open-loop client sends requests at ``--overload`` times that capacity over
HTTP; each client gives up after ``--client-timeout-ms`` (closing its connection, as a real client
with a deadline does). The model logs which request ids it executed; the client logs when it gave
up on which. A *wasted execution* is a request the model ran after its client had already left.

Printed: offered and served rates, goodput (answered within the client's deadline), rejections,
p50/p99 latency of served requests, executions, wasted executions, and the server's peak RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

MODEL_PY = """
import json, os, time
import numpy as np
import triton_python_backend_utils as pb_utils

LOG = os.environ["SLUICE_BENCH_LOG"]
COST = float(os.environ["SLUICE_BENCH_BATCH_S"])


class TritonPythonModel:
    def initialize(self, args):
        self.executed = []

    def execute(self, requests):
        start = time.time()
        for r in requests:
            self.executed.append((r.request_id(), start))
        time.sleep(COST)
        outputs = [pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() for r in requests]
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUT", x)]) for x in outputs]

    def finalize(self):
        with open(LOG, "w") as f:
            json.dump(self.executed, f)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


async def drive(url: str, rate: float, seconds: float, timeout_s: float) -> tuple[list, dict[str, float]]:
    """Open loop: one request every 1/rate s, each on its own connection with a deadline."""
    import aiohttp

    body_json = {"inputs": [{"name": "IN", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    results: list[tuple[str, str, float]] = []  # (id, outcome, latency)
    gave_up: dict[str, float] = {}
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(i: int) -> None:
            rid = f"r{i}"
            payload = dict(body_json, id=rid)
            start = time.time()
            try:
                async with asyncio.timeout(timeout_s):
                    async with session.post(f"http://{url}/v2/models/costly/infer", json=payload) as resp:
                        await resp.read()
                        outcome = "ok" if resp.status == 200 else f"http{resp.status}"
            except TimeoutError:
                gave_up[rid] = time.time()
                outcome = "gave_up"
            except aiohttp.ClientError as exc:
                outcome = type(exc).__name__
            results.append((rid, outcome, time.time() - start))

        tasks = []
        t0 = time.perf_counter()
        i = 0
        while time.perf_counter() - t0 < seconds:
            target = t0 + i / rate
            delay = target - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
            i += 1
        await asyncio.gather(*tasks)
    return results, gave_up


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--overload", type=float, default=2.0, help="offered load / capacity")
    p.add_argument("--batch-ms", type=float, default=20.0, help="model cost per batch")
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--client-timeout-ms", type=float, default=250.0)
    p.add_argument("--server-args", default="", help="extra arguments for sluice serve")
    a = p.parse_args()
    capacity = a.max_batch / (a.batch_ms / 1000)
    rate = capacity * a.overload
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        (repo / "costly" / "1").mkdir(parents=True)
        (repo / "costly" / "1" / "model.py").write_text(MODEL_PY)
        (repo / "costly" / "config.pbtxt").write_text(
            f'name: "costly"\nbackend: "python"\nmax_batch_size: {a.max_batch}\n'
            'input [ { name: "IN", data_type: TYPE_FP32, dims: [ 4 ] } ]\n'
            'output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] } ]\n'
            "dynamic_batching { }\n"
        )
        log = Path(tmp) / "executed.json"
        http = free_port()
        env = dict(os.environ, SLUICE_BENCH_LOG=str(log), SLUICE_BENCH_BATCH_S=str(a.batch_ms / 1000))
        cmd = [
            sys.executable, "-m", "sluice.runtime", "serve", "--model-repository", str(repo),
            "--http-port", str(http), "--grpc-port", "-1", "--metrics-port", "-1", "--log-level", "WARNING",
            *a.server_args.split(),
        ]  # fmt: skip
        server = subprocess.Popen(cmd, cwd=tmp, env=env, start_new_session=True)
        try:
            for _ in range(300):
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=1):
                        break
                except OSError:
                    time.sleep(0.1)
            peak = [0]

            async def sample() -> None:
                while True:
                    peak[0] = max(peak[0], rss_kib(server.pid))
                    await asyncio.sleep(0.1)

            async def run() -> tuple[list, dict[str, float]]:
                sampler = asyncio.create_task(sample())
                try:
                    return await drive(f"127.0.0.1:{http}", rate, a.seconds, a.client_timeout_ms / 1000)
                finally:
                    sampler.cancel()

            results, gave_up = asyncio.run(run())
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(60)
        executed = json.loads(log.read_text()) if log.exists() else []
    ok = [lat for _, outcome, lat in results if outcome == "ok"]
    good = [lat for lat in ok if lat <= a.client_timeout_ms / 1000]
    outcomes: dict[str, int] = {}
    for _, outcome, _ in results:
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    wasted = sum(1 for rid, started in executed if rid in gave_up and gave_up[rid] < started)
    lat = np.array(ok) * 1000 if ok else np.array([0.0])
    print(f"\nmodel capacity {capacity:.0f} req/s; offered {rate:.0f} req/s for {a.seconds:.0f} s; "
          f"client deadline {a.client_timeout_ms:.0f} ms; server args: {a.server_args or '(defaults)'}\n")  # fmt: skip
    print(
        "| offered | served ok/s | goodput/s | outcomes | p50 ms | p99 ms | executed | wasted executions "
        "| peak RSS MiB |"
    )
    print("|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    print(
        f"| {len(results) / a.seconds:.0f}/s | {len(ok) / a.seconds:.0f} | {len(good) / a.seconds:.0f} | "
        f"{', '.join(f'{k} {v}' for k, v in sorted(outcomes.items()))} | {np.percentile(lat, 50):.1f} | "
        f"{np.percentile(lat, 99):.1f} | {len(executed)} | {wasted} | {peak[0] / 1024:.0f} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
