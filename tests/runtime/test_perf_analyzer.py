"""Triton's perf_analyzer drives the server over HTTP and gRPC (short runs; correctness, not speed),
and its server-side report, which it reads from the statistics extension, is filled and consistent.

perf_analyzer comes from PyPI `perf-analyzer`, whose wheel needs glibc 2.38. ``bash .ci/tools.sh``
puts it in ``.tools/bin`` where the system's glibc runs it; elsewhere point SLUICE_PERF_ANALYZER at
a binary that runs here (or put one on PATH). Without one the tests skip and say so.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import tritonclient.http as httpclient

from .conftest import BUILDERS, MLP_CONFIG, write_model  # type: ignore[import-not-found]

ROOT = Path(__file__).resolve().parents[2]
_TOOLS_BINARY = ROOT / ".tools" / "bin" / "perf_analyzer"
PERF_ANALYZER = (
    os.environ.get("SLUICE_PERF_ANALYZER")
    or (str(_TOOLS_BINARY) if _TOOLS_BINARY.is_file() else None)
    or shutil.which("perf_analyzer")
)


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
    "perf-analyzer, which needs glibc >= 2.38; `bash .ci/tools.sh` installs it where the glibc is recent enough)",
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


# --- the server-side report ---------------------------------------------------------------------

BATCHED = MLP_CONFIG.replace('name: "mlp"', 'name: "batched"').replace(
    "max_queue_delay_microseconds: 500", "max_queue_delay_microseconds: 2000"
)
CACHE_ENTRIES = 12
CACHED = (
    MLP_CONFIG.replace('name: "mlp"', 'name: "cached"')
    + "response_cache { enable: true }\n"
    # About CACHE_ENTRIES entries of the MLP (16 FP32 in, 4 out: 336 bytes each, cache.py's sizing).
    + f'parameters {{ key: "response_cache_bytes" value {{ string_value: "{CACHE_ENTRIES * 336 + 100}" }} }}\n'
)


def input_data(path: Path) -> Path:
    """perf_analyzer's --input-data: one input A between every two of 8x the cache's size in distinct
    inputs, sent in order and cycled. A is asked for every other request, so it stays in the LRU
    cache and hits; each other input comes back only after more distinct inputs than the cache holds,
    so it misses, in every measurement window."""
    steps: list[dict[str, list[float]]] = []
    for i in range(1, 8 * CACHE_ENTRIES + 1):
        steps.append({"INPUT0": [0.0] * 16})
        steps.append({"INPUT0": [float(i)] * 16})
    path.write_text(json.dumps({"data": steps}))
    return path


def parse_server_report(stdout: str) -> tuple[int, dict[str, int], dict[str, int]]:
    """perf_analyzer's report: the client's request count, then the "Server:" section's counts
    ("Inference count: 10") and its times in usec ("queue 235 usec", "Average Cache Hit Latency: 18 usec")."""
    client, _, server = stdout.partition("\n  Server: \n")
    assert server, f"no Server: section in perf_analyzer's report:\n{stdout}"
    server = server.split("\nInferences/Second vs.")[0]
    requests = int(re.search(r"Request count: (\d+)", client).group(1))  # type: ignore[union-attr]
    counts = {name: int(value) for name, value in re.findall(r"^\s+([A-Z][A-Za-z ]+ count): (\d+)$", server, re.M)}
    times = {name: int(value) for name, value in re.findall(r"([A-Za-z][A-Za-z /]*?):? (\d+) usec", server)}
    return requests, counts, times


def perf_analyzer(url: str, protocol: str, model: str, csv: Path, *extra: str) -> str:
    cmd = [
        PERF_ANALYZER, "-m", model, "-u", url, "-i", protocol, "--concurrency-range", "4",
        "--measurement-mode", "count_windows", "--measurement-request-count", "200",
        "--stability-percentage", "999", "--max-trials", "3", "-f", str(csv), "--verbose-csv", *extra,
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def csv_row(csv: Path) -> dict[str, str]:
    header, values = csv.read_text().splitlines()[:2]
    return dict(zip(header.split(","), values.split(","), strict=True))


def near(a: int, b: int) -> bool:
    """Client and server counts of the same windows: they differ by the requests in flight at a
    window's edges (a few per window at concurrency 4)."""
    return abs(a - b) <= max(24, b // 20)


def inference_count(server: Any, model: str) -> int:
    client = httpclient.InferenceServerClient(server.http)
    try:
        return int(client.get_inference_statistics(model)["model_stats"][0]["inference_count"])
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzers_server_side_report_is_filled(serve, tmp_path, protocol):
    repo = tmp_path / "repo"
    write_model(repo, "batched", BATCHED, {"model.onnx": BUILDERS.mlp_model()})
    write_model(repo, "cached", CACHED, {"model.onnx": BUILDERS.mlp_model()})
    server = serve(repo)
    url = server.http if protocol == "http" else server.grpc

    # A dynamic-batching ONNX model: every phase of the compute is timed, requests are batched.
    stdout = perf_analyzer(url, protocol, "batched", tmp_path / "batched.csv")
    requests, counts, times = parse_server_report(stdout)
    assert counts["Successful request count"] == counts["Inference count"] > 0, stdout
    assert near(requests, counts["Inference count"]), stdout
    assert 0 < counts["Execution count"] < counts["Inference count"], stdout  # batches of several requests
    assert "Cache hit count" not in counts  # no cache: perf_analyzer leaves its lines out
    for phase in ("queue", "compute input", "compute infer", "compute output"):
        assert times[phase] > 0, (phase, stdout)
    assert times["Avg request latency"] >= times["queue"] + times["compute infer"], stdout
    row = csv_row(tmp_path / "batched.csv")
    assert [int(row[f"Server {c}"]) for c in ("Queue", "Compute Input", "Compute Infer", "Compute Output")] == [
        times["queue"], times["compute input"], times["compute infer"], times["compute output"]
    ]  # fmt: skip
    assert inference_count(server, "batched") >= counts["Inference count"]  # the same statistics, read by us

    # A response-cache model: about half of the requests hit, the rest miss and run.
    data = input_data(tmp_path / "data.json")
    stdout = perf_analyzer(url, protocol, "cached", tmp_path / "cached.csv", "--input-data", str(data))
    requests, counts, times = parse_server_report(stdout)
    hits, misses = counts["Cache hit count"], counts["Cache miss count"]
    assert hits > 0 and misses > 0, stdout
    assert counts["Successful request count"] == hits + misses, stdout
    assert near(requests, hits + misses), stdout
    assert counts["Inference count"] == misses, stdout  # only misses run the model, as in Triton
    assert 0 < counts["Execution count"] <= misses, stdout
    assert times["Average Cache Hit Latency"] > 0, stdout
    assert times["cache lookup/insertion"] > 0 and times["compute infer"] > 0, stdout  # the misses' breakdown
    row = csv_row(tmp_path / "cached.csv")
    assert int(row["Server Cache Hit"]) == times["Average Cache Hit Latency"], row
    assert int(row["Server Cache Miss"]) == times["cache lookup/insertion"], row
    assert int(row["Server Compute Infer"]) == times["compute infer"], row
