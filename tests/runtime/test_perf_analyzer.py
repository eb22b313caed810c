"""Triton's perf_analyzer drives the server over HTTP and gRPC (a short run; correctness, not speed).

perf_analyzer comes from PyPI `perf-analyzer`, whose wheel needs glibc 2.38; point
SLUICE_PERF_ANALYZER at the binary (or put it on PATH) to run this test. Without it the test
skips and says so.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

PERF_ANALYZER = os.environ.get("SLUICE_PERF_ANALYZER") or shutil.which("perf_analyzer")


def _works(binary: str | None) -> bool:
    if not binary:
        return False
    try:
        return subprocess.run([binary, "--version"], capture_output=True, timeout=30, check=False).returncode == 0
    except OSError:
        return False


pytestmark = pytest.mark.skipif(
    not _works(PERF_ANALYZER),
    reason="perf_analyzer not found or not runnable here (set SLUICE_PERF_ANALYZER to the binary of PyPI "
    "perf-analyzer, which needs glibc >= 2.38)",
)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_measures_the_mlp(shared_server, protocol, tmp_path):
    url = shared_server.http if protocol == "http" else shared_server.grpc
    csv = tmp_path / "pa.csv"
    cmd = [
        PERF_ANALYZER, "-m", "mlp", "-u", url, "-i", protocol, "--concurrency-range", "4",
        "--measurement-interval", "500", "--stability-percentage", "999", "--max-trials", "5", "-f", str(csv),
    ]  # fmt: skip
    out = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    header, values = csv.read_text().splitlines()[:2]
    row = dict(zip(header.split(","), values.split(","), strict=False))
    assert float(row["Inferences/Second"]) > 0
