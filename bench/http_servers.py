"""Which HTTP server for the V2 request path: the measurement behind runtime/protocol/http.py.

    pip install uvicorn granian        # candidates only; not Sluice dependencies
    python bench/http_servers.py [--perf-analyzer PATH] [--duration 6] [--concurrency 64]

Each candidate serves the same minimal KServe V2 responder (model metadata and config, and an
infer route that reads the body and answers a fixed binary-extension response: no model, so
only the server's own cost per request is measured), one process, one event loop, uvloop where
the server supports it. perf_analyzer drives each over HTTP with the binary extension and the
table shows requests/s, p50/p99 and the server's CPU per request.

Candidates: Sluice's bare asyncio protocol on httptools (runtime/protocol/http.py), uvicorn
(httptools + uvloop, raw ASGI app, no framework), granian (Rust HTTP server, ASGI interface,
one worker), aiohttp (its own server, low-level handler).
"""

from __future__ import annotations

import argparse
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

META = {
    "name": "mlp",
    "versions": ["1"],
    "platform": "onnxruntime_onnx",
    "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 256]}],
    "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, 16]}],
}
CONFIG = {
    "name": "mlp",
    "platform": "onnxruntime_onnx",
    "max_batch_size": 64,
    "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [256]}],
    "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [16]}],
}

# The candidate servers, each a small program run as `python -c`. They share RESPONDER.
RESPONDER = f"""
import json
META = json.dumps({META!r}).encode()
CONFIG = json.dumps({CONFIG!r}).encode()
HEAD = json.dumps({{"model_name": "mlp", "model_version": "1", "outputs": [{{"name": "OUTPUT0",
    "datatype": "FP32", "shape": [1, 16], "parameters": {{"binary_data_size": 64}}}}]}}).encode()
INFER = HEAD + bytes(64)

def answer(path):
    if path.endswith("/infer"):
        return INFER, [("inference-header-content-length", str(len(HEAD)))]
    if path.endswith("/config"):
        return CONFIG, []
    if path.endswith("/stats"):
        return b'{{"model_stats": []}}', []
    return META, []
"""

SLUICE = RESPONDER + """
import asyncio, sys, uvloop
from sluice.runtime.protocol.http import HttpServer, Response
from sluice.runtime.settings import Limits

def route(request):
    body, extra = answer(request.path.decode())
    return Response(200, body, b"application/json", [(k.encode(), v.encode()) for k, v in extra])

async def main():
    server = HttpServer(route, Limits(), asyncio.get_running_loop())
    await server.start("127.0.0.1", int(sys.argv[1]))
    await asyncio.Event().wait()

uvloop.run(main())
"""

ASGI = RESPONDER + """
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    body, extra = answer(scope["path"])
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in extra]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})
"""

UVICORN = ASGI + """
import sys, uvicorn
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), loop="uvloop", http="httptools", log_level="error",
            access_log=False, lifespan="off")
"""

GRANIAN = ASGI + """
import sys
from granian.server import Server
from granian.constants import Interfaces, Loops
Server("__main__:app", address="127.0.0.1", port=int(sys.argv[1]), interface=Interfaces.ASGI, workers=1,
       loop=Loops.uvloop, log_enabled=False).serve()
"""

AIOHTTP = RESPONDER + """
import asyncio, sys
from aiohttp import web

async def handle(request):
    await request.read()
    body, extra = answer(request.path)
    return web.Response(body=body, content_type="application/json", headers=dict(extra))

async def main():
    server = web.Server(handle, access_log=None)
    runner = web.ServerRunner(server)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", int(sys.argv[1])).start()
    await asyncio.Event().wait()

import uvloop
uvloop.run(main())
"""

CANDIDATES = {"sluice (httptools protocol)": SLUICE, "uvicorn": UVICORN, "granian": GRANIAN, "aiohttp": AIOHTTP}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU of the whole server process (all threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--perf-analyzer", default=shutil.which("perf_analyzer"))
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--concurrency", default="1,64")
    p.add_argument("--only", default="", help="comma list of candidate names to run (default all)")
    a = p.parse_args()
    if not a.perf_analyzer:
        print("perf_analyzer is needed (PyPI perf-analyzer; pass --perf-analyzer PATH)", file=sys.stderr)
        return 2
    rows = []
    wanted = {n.strip() for n in a.only.split(",") if n.strip()}
    for name, program in CANDIDATES.items():
        if wanted and not any(w in name for w in wanted):
            continue
        port = free_port()
        with tempfile.TemporaryDirectory() as tmp:
            proc = subprocess.Popen([sys.executable, "-c", program, str(port)], cwd=tmp, start_new_session=True)
            try:
                for _ in range(100):
                    try:
                        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/mlp", timeout=1):
                            break
                    except OSError:
                        time.sleep(0.1)
                for c in [int(x) for x in a.concurrency.split(",")]:
                    csv = Path(tmp) / "pa.csv"
                    before = cpu_seconds(proc.pid)
                    started = time.monotonic()
                    try:
                        out = subprocess.run(
                            [a.perf_analyzer, "-m", "mlp", "-u", f"127.0.0.1:{port}", "-i", "http",
                             "--concurrency-range", str(c), "--measurement-interval", str(int(a.duration * 1000 / 3)),
                             "--stability-percentage", "999", "--max-trials", "3", "-f", str(csv)],
                            capture_output=True, text=True, timeout=a.duration * 4 + 60, check=False,
                        )  # fmt: skip
                    except subprocess.TimeoutExpired:
                        rows.append((name, c, None, None, None, None, "perf_analyzer timed out"))
                        continue
                    cpu = cpu_seconds(proc.pid) - before
                    wall = time.monotonic() - started
                    if out.returncode != 0 or not csv.exists():
                        rows.append((name, c, None, None, None, None, (out.stdout + out.stderr).strip()[-120:]))
                        continue
                    header, values = csv.read_text().splitlines()[:2]
                    row = dict(zip(header.split(","), values.split(","), strict=False))
                    tput = float(row["Inferences/Second"])
                    requests = tput * wall  # approximate: the run's start-up is counted as serving time
                    rows.append((name, c, tput, float(row["p50 latency"]) / 1e3, float(row["p99 latency"]) / 1e3,
                                 cpu / requests * 1e6 if requests else None, ""))  # fmt: skip
            finally:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(10)
    print("\n| server | concurrency | req/s | p50 ms | p99 ms | server CPU us/req (approx.) | note |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, c, tput, p50, p99, cpu, note in rows:
        if tput is None:
            print(f"| {name} | {c} | - | - | - | - | {note} |")
        else:
            print(f"| {name} | {c} | {tput:,.0f} | {p50:.2f} | {p99:.2f} | {cpu:.0f} | {note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
