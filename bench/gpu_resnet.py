"""ResNet-50 (fp16, channels_last, random weights) called directly with CUDA graphs, and served by Sluice.

    python -P bench/gpu_resnet.py [--mode raw|served|both] [--max-batch 256] [--preferred 16,32,64,128,256]
                                  [--concurrency 1,2,4,...,256] [--protocols grpc,http] [--duration-s 10]
                                  [--client-processes 8] [--queue-delay-us 500] [--instances 2]
                                  [--serve-arg=--flag ...]
    python -P bench/gpu_resnet.py --device cpu --small      # smoke run on a machine without a GPU

* raw: the model (defined below in plain torch, no torchvision) captured with
  ``sluice.runtime.backends.torch_graphs.GraphedModel`` at the batch sizes 1, 2, 4, ..., max and the
  preferred sizes, each replayed with device-resident inputs: ms per call and img/s.
* served: writes a model repository into a temporary directory (TorchScript ``model.pt``, Triton's
  ``pytorch_libtorch`` conventions ``INPUT__0``/``OUTPUT__0``, ``--instances`` ``KIND_GPU`` instances on
  the device (default 2: one copies its batch in and out while the other runs), dynamic batching with the
  preferred sizes, ``optimization.cuda.graphs``), starts ``sluice serve`` as a subprocess on free
  ports, and drives it with one-image requests at each concurrency over gRPC and HTTP (binary tensor
  data), from ``--client-processes`` processes of asyncio tritonclient clients, or with Triton's
  ``perf_analyzer`` when SLUICE_PERF_ANALYZER names one. The batch sizes the server formed come from
  its statistics (``batch_stats``, before and after each run); the raw reference for a run is the
  same model with the same graphs executing that mix of batches (each padded to its graph), so
  ``ratio`` = served img/s / raw img/s at the formed batches (target >= 0.85). The p99 budget is
  2x the graph time of the largest preferred batch plus the queue delay.

``--device cpu`` runs eagerly in fp32 (CUDA graphs need a GPU) and ``--small`` shrinks the image to
32x32, the batches to 16 and the run to seconds: a check that the script works, not a figure.
The served mode needs the PyTorch backend (runtime/backends/pytorch.py); without it the server
reports the model unavailable and the served rows are skipped with the reason.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import csv
import dataclasses
import io
import math
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

MODEL = "resnet50"
TARGET_RATIO = 0.85


# -- the model --------------------------------------------------------------------------------------


def resnet50(num_classes: int = 1000) -> Any:
    """ResNet-50 v1.5 (stride in the 3x3 conv), random weights; the last BatchNorm of each block
    starts at a small scale so activations stay finite in fp16 through 16 random blocks."""
    import torch
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, inplanes: int, planes: int, stride: int) -> None:
            super().__init__()
            width, out = planes, planes * 4
            self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.conv3 = nn.Conv2d(width, out, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(out)
            nn.init.constant_(self.bn3.weight, 0.2)
            self.relu = nn.ReLU(inplace=True)
            if stride != 1 or inplanes != out:
                self.downsample: nn.Module = nn.Sequential(
                    nn.Conv2d(inplanes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out)
                )
            else:
                self.downsample = nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.relu(self.bn1(self.conv1(x)))
            y = self.relu(self.bn2(self.conv2(y)))
            y = self.bn3(self.conv3(y))
            return self.relu(y + self.downsample(x))

    class ResNet50(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(
                nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False),
                nn.BatchNorm2d(64),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(3, stride=2, padding=1),
            )
            blocks: list[nn.Module] = []
            inplanes = 64
            for planes, count, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
                for i in range(count):
                    blocks.append(Bottleneck(inplanes, planes, stride if i == 0 else 1))
                    inplanes = planes * 4
            self.blocks = nn.Sequential(*blocks)
            self.fc = nn.Linear(2048, num_classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x.contiguous(memory_format=torch.channels_last)
            x = self.blocks(self.stem(x))
            return self.fc(torch.flatten(torch.mean(x, dim=(2, 3)), 1))

    torch.manual_seed(0)
    return ResNet50().eval()


# -- pure parts: sizes, formed batches, the raw reference, tables (tests/test_bench_gpu.py) -----------


def parse_ints(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(",") if v.strip())
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: allowed: comma-separated integers >= 1")
    return values


def capture_sizes(max_batch: int, preferred: Sequence[int]) -> tuple[int, ...]:
    """Raw-mode batch sizes: 1, 2, 4, ..., max_batch and the preferred sizes."""
    ladder, size = {max_batch, *preferred}, 1
    while size < max_batch:
        ladder.add(size)
        size *= 2
    return tuple(sorted(s for s in ladder if s <= max_batch))


def batch_counts(model_stats: Mapping[str, Any]) -> dict[int, int]:
    """Executions per batch size from one ``model_stats`` entry of the v2 statistics (JSON)."""
    return {
        int(b["batch_size"]): int(b["compute_infer"]["count"])
        for b in model_stats.get("batch_stats", [])
        if int(b["compute_infer"]["count"])
    }


def counts_delta(before: Mapping[int, int], after: Mapping[int, int]) -> dict[int, int]:
    """Executions per batch size between two statistics reads."""
    return {b: after[b] - before.get(b, 0) for b in after if after[b] - before.get(b, 0) > 0}


STAGES = ("queue", "compute_input", "compute_infer", "compute_output")
"""The per-request stages of the v2 statistics, in the order a request goes through them."""


def _count_ns(entry: Any) -> tuple[int, int]:
    entry = entry or {}
    return int(entry.get("count", 0)), int(entry.get("ns", 0))


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """Where the server's time went between two statistics reads: each stage's mean per request (us),
    executions, and the seconds the instances spent executing batches (input + infer + output)."""

    request_us: dict[str, float]
    executions: int
    exec_s: float

    def exec_ms(self) -> float | None:
        """Mean milliseconds of one batch execution (copies in, model, copies out)."""
        return self.exec_s * 1e3 / self.executions if self.executions else None

    def busy(self, seconds: float, instances: int) -> float | None:
        """Share of ``seconds`` x ``instances`` the instances spent executing batches."""
        return self.exec_s / (seconds * instances) if seconds > 0 and instances > 0 else None


def breakdown(before: Mapping[str, Any], after: Mapping[str, Any]) -> Breakdown:
    """The :class:`Breakdown` between two ``model_stats`` entries of the v2 statistics (JSON)."""

    def stage(stats: Mapping[str, Any], name: str) -> tuple[int, int]:
        return _count_ns(stats.get("inference_stats", {}).get(name))

    def batches(stats: Mapping[str, Any]) -> tuple[int, int]:
        executions = ns = 0
        for entry in stats.get("batch_stats", []):
            executions += _count_ns(entry.get("compute_infer"))[0]
            ns += sum(_count_ns(entry.get(name))[1] for name in STAGES[1:])
        return executions, ns

    request_us = {}
    for name in STAGES:
        (c0, n0), (c1, n1) = stage(before, name), stage(after, name)
        request_us[name] = (n1 - n0) / (c1 - c0) / 1e3 if c1 > c0 else math.nan
    (e0, b0), (e1, b1) = batches(before), batches(after)
    return Breakdown(request_us, e1 - e0, (b1 - b0) / 1e9)


def mean_batch(counts: Mapping[int, int]) -> float:
    """The mean formed batch (rows per execution); 0.0 without executions."""
    executions = sum(counts.values())
    return sum(b * c for b, c in counts.items()) / executions if executions else 0.0


def padded(sizes: Sequence[int], n: int) -> int | None:
    fits = [s for s in sizes if s >= n]
    return min(fits) if fits else None


def raw_rate_for_mix(counts: Mapping[int, int], graph_ms: Mapping[int, float]) -> float | None:
    """Rows per second of the model called directly on the same batches as the server formed, each
    padded to its graph like the server pads it; None when a batch has no graph (or no batches)."""
    rows = seconds = 0.0
    for batch, count in counts.items():
        size = padded(sorted(graph_ms), batch)
        if size is None:
            return None
        rows += batch * count
        seconds += count * graph_ms[size] / 1e3
    return rows / seconds if seconds > 0 else None


def p99_budget_ms(graph_ms: Mapping[int, float], preferred: Sequence[int], queue_delay_us: int) -> float | None:
    """The issue's latency target: 2x the graph time of the largest preferred batch plus the queue delay."""
    size = padded(sorted(graph_ms), max(preferred)) if preferred else None
    return None if size is None else 2 * graph_ms[size] + queue_delay_us / 1e3


def ratio(served: float, raw: float | None) -> float | None:
    return served / raw if raw else None


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank; nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


@dataclasses.dataclass(frozen=True)
class ServedRow:
    protocol: str
    concurrency: int
    img_s: float
    p50_ms: float
    p99_ms: float
    counts: dict[int, int]
    raw_img_s: float | None
    spent: Breakdown | None = None
    busy: float | None = None


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def raw_table(graph_ms: Mapping[int, float]) -> str:
    lines = ["| batch | ms per call | img/s |", "|---|---|---|"]
    for size in sorted(graph_ms):
        lines.append(f"| {size} | {graph_ms[size]:.3f} | {size / graph_ms[size] * 1e3:.0f} |")
    return "\n".join(lines)


def served_table(rows: Sequence[ServedRow], p99_budget: float | None) -> str:
    lines = [
        "| protocol | c | served img/s | p50 ms | p99 ms | mean formed batch | raw img/s at those batches | ratio |"
        f" p99 <= {_fmt(p99_budget, '.2f')} ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rate = ratio(r.img_s, r.raw_img_s)
        verdict = "n/a" if rate is None else f"{rate:.2f}" + (" ok" if rate >= TARGET_RATIO else " low")
        within = "n/a" if p99_budget is None else ("yes" if r.p99_ms <= p99_budget else "no")
        lines.append(
            f"| {r.protocol} | {r.concurrency} | {r.img_s:.0f} | {_fmt(r.p50_ms, '.2f')} | {_fmt(r.p99_ms, '.2f')} "
            f"| {mean_batch(r.counts):.1f} | {_fmt(r.raw_img_s, '.0f')} | {verdict} | {within} |"
        )
    return "\n".join(lines)


def profile_summary(collapsed: str, top: int = 12) -> str:
    """A short table of py-spy's collapsed stacks (``-f raw``: ``frame;frame;... count`` per line):
    samples per thread, then the innermost frames of Sluice's code (``runtime/``, ``sluice``) by
    samples, so a run that cannot bring the file back still says where the server's time went."""
    threads: collections.Counter[str] = collections.Counter()
    frames: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        parts = stack.split(";")
        threads[parts[0]] += n
        ours = [f for f in parts[1:] if "runtime/" in f or "sluice" in f]
        frames[ours[-1] if ours else parts[-1]] += n
    if not total:
        return "(no samples)"
    lines = [f"{total} samples", "", "| thread | share |", "|---|---|"]
    lines += [f"| {name[:60]} | {n / total:.0%} |" for name, n in threads.most_common(6)]
    lines += ["", "| innermost Sluice frame (else the innermost) | share |", "|---|---|"]
    lines += [f"| {name[:100]} | {n / total:.1%} |" for name, n in frames.most_common(top)]
    return "\n".join(lines)


def start_profile(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes] | None:
    """py-spy sampling server ``pid`` for ``seconds`` into ``out`` (collapsed stacks, per thread,
    without pausing it); None where py-spy is not installed (SLUICE_PY_SPY or PATH)."""
    binary = os.environ.get("SLUICE_PY_SPY") or shutil.which("py-spy")
    if not binary or not Path(binary).exists():
        print("profile skipped: py-spy not found (SLUICE_PY_SPY or PATH)", file=sys.stderr)
        return None
    cmd = [
        binary, "record", "-p", str(pid), "-d", str(max(1, int(seconds))), "-r", "200", "--nonblocking",
        "--threads", "-f", "raw", "-o", str(out),
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def time_table(rows: Sequence[ServedRow]) -> str:
    """Where the server's time went for each served row: the mean per request of each stage (queue,
    then the batch's input copies, model and output copies, which every request of a batch shares),
    one execution against the raw graph time of the same batches, and how busy the instances were.
    Instances busy well below 100 % while the ratio is low: the front end (decoding, the event loop)
    does not keep them fed; busy near 100 %: the executions themselves are slower than the raw graphs."""
    lines = [
        "| protocol | c | queue us | input us | infer us | output us | ms per execution | raw ms per execution "
        "| instances busy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.spent is None:
            continue
        us = [_fmt(r.spent.request_us[name], ".0f") for name in STAGES]
        executions = sum(r.counts.values())
        raw_ms = None
        if executions and r.raw_img_s:
            raw_ms = sum(b * c for b, c in r.counts.items()) / r.raw_img_s / executions * 1e3
        busy = "n/a" if r.busy is None else f"{r.busy:.0%}"
        lines.append(
            f"| {r.protocol} | {r.concurrency} | {' | '.join(us)} | {_fmt(r.spent.exec_ms(), '.2f')} "
            f"| {_fmt(raw_ms, '.2f')} | {busy} |"
        )
    return "\n".join(lines)


def parse_perf_analyzer_csv(text: str) -> tuple[float, float, float]:
    """(inferences/s, p50 ms, p99 ms) of perf_analyzer's ``-f`` CSV (latencies there are in usec)."""
    row = next(csv.DictReader(io.StringIO(text)))
    return float(row["Inferences/Second"]), float(row["p50 latency"]) / 1e3, float(row["p99 latency"]) / 1e3


# -- raw ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Setup:
    device: str
    image: int
    dtype: str  # "FP16" on CUDA, "FP32" on CPU
    max_batch: int
    preferred: tuple[int, ...]
    queue_delay_us: int
    instances: int = 1
    """KIND_GPU instances on the device: with two, one copies its batch in and out while the other runs."""


def config_text(setup: Setup) -> str:
    gpu = setup.device != "cpu"
    preferred = ", ".join(str(s) for s in setup.preferred)
    kind = (
        f"instance_group [ {{ kind: KIND_GPU count: {setup.instances} gpus: [ 0 ] }} ]"
        if gpu
        else "instance_group [ { kind: KIND_CPU } ]"
    )
    return textwrap.dedent(f"""\
        name: "{MODEL}"
        platform: "pytorch_libtorch"
        max_batch_size: {setup.max_batch}
        input [ {{ name: "INPUT__0" data_type: TYPE_{setup.dtype} dims: [ 3, {setup.image}, {setup.image} ] }} ]
        output [ {{ name: "OUTPUT__0" data_type: TYPE_{setup.dtype} dims: [ 1000 ] }} ]
        {kind}
        dynamic_batching {{ preferred_batch_size: [ {preferred} ]
                            max_queue_delay_microseconds: {setup.queue_delay_us} }}
        """) + ("optimization { cuda { graphs: true } }\n" if gpu else "")


def build_model(setup: Setup) -> Any:
    import torch

    model = resnet50()
    if setup.dtype == "FP16":
        model = model.half()
    return model.to(memory_format=torch.channels_last)


def measure_raw(setup: Setup, sizes: Sequence[int], min_s: float) -> dict[int, float]:
    """ms per call at each batch size: CUDA graphs on a GPU, eager on the CPU."""
    import torch
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    from sluice.runtime.backends import torch_graphs

    dtype = torch.float16 if setup.dtype == "FP16" else torch.float32
    device = torch.device(setup.device)
    model = build_model(setup).to(device)

    def examples(batch: int) -> list[Any]:
        return [torch.randn(batch, 3, setup.image, setup.image, device=device, dtype=dtype)]

    def forward(inputs: list[Any]) -> list[Any]:
        return [model(inputs[0])]

    if device.type == "cuda":
        # cuDNN at its defaults (no cudnn.benchmark), as the server runs the model
        config = text_format.Parse(config_text(setup), mc.ModelConfig())
        del config.dynamic_batching.preferred_batch_size[:]
        config.optimization.cuda.graph_spec.extend(
            mc.ModelOptimizationPolicy.Cuda.GraphSpec(batch_size=s) for s in sizes
        )
        plan = torch_graphs.graph_plan(config)
        assert plan is not None
        graphed = torch_graphs.GraphedModel(forward, plan, examples, device, torch.cuda.Stream(device))
        print(graphed.describe(), file=sys.stderr)

        def call(inputs: list[Any]) -> None:
            assert graphed.run(inputs) is not None

        def sync() -> None:
            torch.cuda.synchronize(device)
    else:
        graphed = None

        def call(inputs: list[Any]) -> None:
            with torch.no_grad():
                forward(inputs)

        def sync() -> None:
            pass

    result = {}
    for size in sizes:
        inputs = examples(size)
        for _ in range(3):
            call(inputs)
        sync()
        calls, start = 0, time.perf_counter()
        while True:
            for _ in range(10):
                call(inputs)
            calls += 10
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= min_s:
                break
        result[size] = elapsed / calls * 1e3
    if graphed is not None:
        graphed.close()
    return result  # the caller empties PyTorch's cache once the model is gone


# -- served ---------------------------------------------------------------------------------------------


def write_repo(root: Path, setup: Setup) -> Path:
    import torch

    repo = root / "repo"
    (repo / MODEL / "1").mkdir(parents=True)
    (repo / MODEL / "config.pbtxt").write_text(config_text(setup))
    scripted = torch.jit.script(build_model(setup))
    torch.jit.save(scripted, str(repo / MODEL / "1" / "model.pt"))
    return repo


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(repo: Path, extra: Sequence[str]) -> tuple[subprocess.Popen[str], int, int]:
    http_port, grpc_port = _free_port(), _free_port()
    cmd = [
        sys.executable, "-P", "-m", "sluice.runtime", "serve", "--model-repository", str(repo),
        "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", "-1",
        "--log-level", "WARNING", *extra,
    ]  # fmt: skip
    server = subprocess.Popen(cmd, cwd=repo.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert server.stdout is not None
    for line in server.stdout:
        if line.startswith("sluice ready:"):
            break
    else:
        raise SystemExit(f"sluice serve did not start: {' '.join(cmd)}")
    threading.Thread(target=lambda: [None for _ in server.stdout or ()], daemon=True).start()
    return server, http_port, grpc_port


def _stats(http_url: str) -> dict[str, Any]:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(http_url)
    try:
        return dict(client.get_inference_statistics(MODEL)["model_stats"][0])
    finally:
        client.close()


async def _drive(protocol: str, url: str, concurrency: int, duration_s: float, shape: list[int], dtype: str) -> Any:
    """``concurrency`` closed-loop clients of one image each; (latencies s, images) of the window."""
    if protocol == "grpc":
        import tritonclient.grpc.aio as aio
    else:
        import tritonclient.http.aio as aio  # type: ignore[no-redef]
    kwargs: dict[str, Any] = {} if protocol == "grpc" else {"conn_limit": concurrency}
    client = aio.InferenceServerClient(url, **kwargs)
    image = np.random.default_rng(0).standard_normal(shape).astype(np.float16 if dtype == "FP16" else np.float32)
    inp = aio.InferInput("INPUT__0", shape, dtype)
    if protocol == "grpc":
        inp.set_data_from_numpy(image)
    else:
        inp.set_data_from_numpy(image, binary_data=True)
    outputs = [aio.InferRequestedOutput("OUTPUT__0", **({} if protocol == "grpc" else {"binary_data": True}))]
    latencies: list[float] = []
    end = time.perf_counter() + duration_s

    async def one() -> None:
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            await client.infer(MODEL, [inp], outputs=outputs)
            t1 = time.perf_counter()
            if t1 <= end:
                latencies.append(t1 - t0)

    try:
        await asyncio.gather(*(one() for _ in range(concurrency)))
    finally:
        await client.close()
    return latencies


def _client_process(protocol: str, url: str, concurrency: int, duration_s: float, shape: list[int], dtype: str) -> Any:
    try:
        return asyncio.run(_drive(protocol, url, concurrency, duration_s, shape, dtype))
    except Exception as exc:  # tritonclient's exceptions do not unpickle across the process pool
        raise RuntimeError(f"{type(exc).__name__}: {exc}") from None


def drive(
    protocol: str, url: str, concurrency: int, duration_s: float, setup: Setup, processes: int
) -> tuple[float, float, float]:
    """(img/s, p50 ms, p99 ms) of ``concurrency`` clients spread over up to ``processes`` processes."""
    shape = [1, 3, setup.image, setup.image]
    procs = max(1, min(processes, concurrency))
    shares = [concurrency // procs + (1 if i < concurrency % procs else 0) for i in range(procs)]
    if procs == 1:
        latencies = _client_process(protocol, url, concurrency, duration_s, shape, setup.dtype)
    else:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(procs, mp_context=ctx) as pool:
            futures = [
                pool.submit(_client_process, protocol, url, share, duration_s, shape, setup.dtype) for share in shares
            ]
            latencies = [lat for f in futures for lat in f.result()]
    ms = [lat * 1e3 for lat in latencies]
    return len(latencies) / duration_s, percentile(ms, 50), percentile(ms, 99)


def drive_perf_analyzer(binary: str, protocol: str, url: str, concurrency: int, duration_s: float) -> Any:
    """One point: perf_analyzer's measurement windows of duration_s / 3 each, at most three, with a
    stability bound so wide (999 %) that it stops at three: a point lasts about as long as our own
    clients' and a device call's caps hold. The figures are perf_analyzer's own report for the point."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "pa.csv"
        window_ms = max(500, int(duration_s * 1000 / 3))
        cmd = [
            binary, "-m", MODEL, "-u", url, "-i", protocol, "--concurrency-range", f"{concurrency}:{concurrency}",
            "--measurement-interval", str(window_ms), "--stability-percentage", "999", "--max-trials", "3",
            "--max-threads", str(max(16, concurrency)), "-f", str(out),
        ]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
        return parse_perf_analyzer_csv(out.read_text())


def model_unavailable(http_url: str) -> str | None:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(http_url)
    try:
        if client.is_model_ready(MODEL):
            return None
        rows = {r["name"]: r for r in client.get_model_repository_index()}
        return rows.get(MODEL, {}).get("reason") or "not ready"
    finally:
        client.close()


def run_served(
    setup: Setup, graph_ms: Mapping[int, float], args: argparse.Namespace
) -> tuple[list[ServedRow], str | None]:
    perf_analyzer = os.environ.get("SLUICE_PERF_ANALYZER")
    rows: list[ServedRow] = []
    profiles: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="sluice-resnet-") as tmp:
        repo = write_repo(Path(tmp), setup)
        server, http_port, grpc_port = start_server(repo, args.serve_arg)
        try:
            http_url, grpc_url = f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
            why = model_unavailable(http_url)
            if why is not None:
                return rows, why
            for protocol in args.protocols:
                url = grpc_url if protocol == "grpc" else http_url
                for concurrency in args.concurrency:
                    if perf_analyzer:
                        warm = min(2.0, args.duration_s)
                        drive_perf_analyzer(perf_analyzer, protocol, url, concurrency, warm)
                    else:
                        drive(protocol, url, concurrency, min(1.0, args.duration_s), setup, args.client_processes)
                    before, began = _stats(http_url), time.perf_counter()
                    profiling, profile_file = None, Path(args.profile_dir)
                    if args.profile_s and (protocol, concurrency) == (args.protocols[0], max(args.concurrency)):
                        profile_file = Path(args.profile_dir) / f"resnet-server-{protocol}-c{concurrency}.pyspy.txt"
                        profiling = start_profile(server.pid, min(args.profile_s, args.duration_s), profile_file)
                    if perf_analyzer:
                        rate, p50, p99 = drive_perf_analyzer(perf_analyzer, protocol, url, concurrency, args.duration_s)
                    else:
                        rate, p50, p99 = drive(
                            protocol, url, concurrency, args.duration_s, setup, args.client_processes
                        )
                    after, span = _stats(http_url), time.perf_counter() - began
                    if profiling is not None:
                        profiling.wait(60)
                        if profile_file.exists():
                            profiles.append((f"{protocol} c{concurrency}", profile_file.read_text()))
                    counts = counts_delta(batch_counts(before), batch_counts(after))
                    spent = breakdown(before, after)
                    # our clients load the server for duration_s (their start-up is idle); perf_analyzer
                    # for several intervals and its warm-up: then the whole span between the reads
                    window = span if perf_analyzer else args.duration_s
                    rows.append(
                        ServedRow(
                            protocol, concurrency, rate, p50, p99, counts, raw_rate_for_mix(counts, graph_ms),
                            spent, spent.busy(window, setup.instances),
                        )
                    )
                    print(served_table(rows[-1:], None).splitlines()[-1], file=sys.stderr, flush=True)
                    print(time_table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
        finally:
            server.send_signal(signal.SIGINT)
            server.wait(60)
    for label, collapsed in profiles:
        print(f"\nthe server under py-spy during {label} ({args.profile_s:.0f} s):\n", file=sys.stderr)
        print(profile_summary(collapsed), file=sys.stderr, flush=True)
    return rows, None


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--mode", choices=["raw", "served", "both"], default="both")
    parser.add_argument("--device", default="cuda:0", help="cuda:N, or cpu (eager fp32, a smoke run)")
    parser.add_argument("--small", action="store_true", help="32x32 images, batches up to 16, short runs")
    parser.add_argument("--max-batch", type=int, default=None, help="max_batch_size (default 256; 16 with --small)")
    parser.add_argument("--preferred", type=parse_ints, default=None, help="preferred batch sizes (default 16..256)")
    parser.add_argument("--concurrency", type=parse_ints, default=None, help="client concurrency levels")
    parser.add_argument("--protocols", type=lambda s: s.split(","), default=["grpc", "http"])
    parser.add_argument("--duration-s", type=float, default=None, help="measured seconds per served point")
    parser.add_argument("--raw-s", type=float, default=None, help="seconds per raw batch size")
    parser.add_argument("--queue-delay-us", type=int, default=500)
    parser.add_argument(
        "--instances", type=int, default=2, help="KIND_GPU instances of the served model on the device (count)"
    )
    parser.add_argument("--client-processes", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `sluice serve` flag (repeatable)")
    parser.add_argument(
        "--profile-s", type=float, default=0.0,
        help="sample the server with py-spy for this long during the first protocol's highest concurrency",
    )
    parser.add_argument("--profile-dir", default=".", help="where the py-spy collapsed stacks are written")
    args = parser.parse_args()
    small = args.small
    max_batch = args.max_batch or (16 if small else 256)
    preferred = args.preferred or tuple(s for s in ((4, 8, 16) if small else (16, 32, 64, 128, 256)) if s <= max_batch)
    args.concurrency = args.concurrency or ((1, 2, 4, 8) if small else (1, 2, 4, 8, 16, 32, 64, 128, 256))
    args.duration_s = args.duration_s or (1.5 if small else 10.0)
    raw_s = args.raw_s or (0.3 if small else 2.0)
    cpu = args.device == "cpu"
    setup = Setup(
        args.device, 32 if small else 224, "FP32" if cpu else "FP16", max_batch, preferred, args.queue_delay_us,
        args.instances,
    )
    sizes = capture_sizes(max_batch, preferred)
    import torch

    gpu_name = torch.cuda.get_device_name(torch.device(args.device)) if not cpu else "none (CPU, eager fp32)"
    print(
        f"ResNet-50, {setup.dtype}, channels_last, {setup.image}x{setup.image}, random weights; device {args.device} "
        f"({gpu_name}); torch {torch.__version__}; {os.cpu_count()} CPUs\n"
    )
    graph_ms = measure_raw(setup, sizes, raw_s)
    if not cpu:
        torch.cuda.empty_cache()  # the raw run's model and graphs are gone: leave the GPU to the server
    print(("CUDA graphs, device-resident inputs" if not cpu else "eager (no CUDA graphs on the CPU)") + "\n")
    print(raw_table(graph_ms) + "\n")
    if args.mode == "raw":
        return 0
    rows, why = run_served(setup, graph_ms, args)
    if why is not None:
        print(f"served rows skipped: the server did not load the model: {why}")
        return 0
    budget = p99_budget_ms(graph_ms, preferred, args.queue_delay_us)
    how = "perf_analyzer" if os.environ.get("SLUICE_PERF_ANALYZER") else f"{args.client_processes} client processes"
    print(
        f"sluice serve, one-image requests, {how}, {args.duration_s:.0f} s per point; preferred "
        f"{','.join(map(str, preferred))}, queue delay {args.queue_delay_us} us; target ratio >= {TARGET_RATIO}\n"
    )
    print(served_table(rows, budget))
    print(
        f"\nwhere the server's time went (its statistics over each point; {setup.instances} instance(s); "
        "busy: batch executions / (point seconds x instances))\n"
    )
    print(time_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
