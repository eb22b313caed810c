"""c64 throughput with tracing off (this checkout) against the commit before tracing, and with tracing on.

    python bench/tracing_overhead.py [--baseline-rev main] [--rounds 3] [--duration 8] [--concurrency 64]

Builds the baseline from ``git archive <rev> runtime`` into a temporary ``sluice/runtime`` (put first
on PYTHONPATH of that server), and serves bench_runtime.py's MLP (dynamic batching up to 64) with:
the baseline; this checkout with tracing off (the default); this checkout with ``--trace-config
level=TIMESTAMPS --trace-config rate=1`` exporting over OTLP/HTTP to a sink in this process that
answers 200 (for information: every request traced). Each point is driven over HTTP and gRPC by
bench_runtime.py's load generator (perf_analyzer when found, else closed-loop tritonclient aio).
Rounds interleave the points, so drift hits each alike; prints median and min-max of inf/s and p99.
"""

from __future__ import annotations

import argparse
import http.server
import importlib.util
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench_runtime():
    spec = importlib.util.spec_from_file_location("bench_runtime", ROOT / "bench" / "bench_runtime.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BR = _bench_runtime()


class _Sink(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def otlp_sink() -> int:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server.server_address[1]


def baseline(rev: str, into: Path) -> str:
    (into / "sluice").mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "runtime"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into / "sluice")], input=archive.stdout, check=True)
    return str(into)


def start(repo: Path, tmp: str, extra: list[str], pythonpath: str | None) -> tuple[subprocess.Popen, int, int]:
    http, grpc = BR.free_port(), BR.free_port()
    cmd = [
        sys.executable, "-m", "sluice.runtime", "serve", "--model-repository", str(repo), "--http-port", str(http),
        "--grpc-port", str(grpc), "--metrics-port", "-1", "--log-level", "WARNING", *extra,
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-rev", default="main", help="git revision without tracing")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=8.0, help="seconds per point")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--perf-analyzer", default=None, help="path of perf_analyzer (default: the Python generator)")
    a = p.parse_args()
    sink = otlp_sink()
    traced = ["--trace-config", "level=TIMESTAMPS", "--trace-config", "rate=1",
              "--trace-config", f"opentelemetry,url=http://127.0.0.1:{sink}/v1/traces"]  # fmt: skip
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        BR.write_repo(repo, 500)
        points = [
            (f"{a.baseline_rev} (before tracing)", [], baseline(a.baseline_rev, Path(tmp) / "base")),
            ("this checkout, tracing off", [], None),
            ("this checkout, tracing on, rate 1", traced, None),
        ]
        for _ in range(a.rounds):
            for label, extra, path in points:
                server, http, grpc = start(repo, tmp, extra, path)
                try:
                    for protocol, port in (("http", http), ("grpc", grpc)):
                        url = f"127.0.0.1:{port}"
                        if a.perf_analyzer:
                            tput, _p50, p99 = BR.perf_analyzer(
                                a.perf_analyzer, url, protocol, a.concurrency, a.duration
                            )
                        else:
                            BR.python_loadgen(url, protocol, a.concurrency, 1.0)  # warm-up
                            tput, _p50, p99 = BR.python_loadgen(url, protocol, a.concurrency, a.duration)
                        results.setdefault((label, protocol), []).append((tput, p99))
                        print(f"{label} {protocol}: {tput:,.0f} inf/s, p99 {p99:.1f} ms", file=sys.stderr)
                finally:
                    os.killpg(server.pid, signal.SIGTERM)
                    server.wait(30)
    generator = "perf_analyzer" if a.perf_analyzer else "Python generator (tritonclient aio, closed loop)"
    print(f"\n{os.cpu_count()} CPUs; c{a.concurrency}; {generator}; {a.duration:g} s per point; {a.rounds} rounds\n")
    print("| server | protocol | inf/s median (min-max) | p99 ms median (min-max) |")
    print("|---|---|---:|---:|")
    for label, *_ in points:
        for protocol in ("http", "grpc"):
            runs = results[(label, protocol)]
            tputs, p99s = [r[0] for r in runs], [r[1] for r in runs]
            print(
                f"| {label} | {protocol} | {statistics.median(tputs):,.0f} ({min(tputs):,.0f}-{max(tputs):,.0f}) "
                f"| {statistics.median(p99s):.1f} ({min(p99s):.1f}-{max(p99s):.1f}) |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
