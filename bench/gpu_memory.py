"""GPU memory of one model instance, with and without CUDA graphs.

    python -P bench/gpu_memory.py [--max-batch 256] [--preferred 16,32,64,128,256] [--image 224] [--served]

The model is bench/gpu_resnet.py's ResNet-50 (fp16, channels_last, random weights).

In-process (default), in the order an instance of the PyTorch backend goes through them, with
``torch.cuda.memory_reserved`` (what PyTorch's caching allocator holds) after each step:

* weights: the model on the GPU;
* eager at the largest batch: plus one eager forward at ``--max-batch`` (the activations an
  instance without graphs needs at its largest batch);
* graphs, <sizes>: ``GraphedModel.memory_bytes`` for the plan of each setting: the default ladder
  (1, 2, 4, ..., max) and the preferred sizes plus max (what ``graph_plan`` captures without a
  ``graph_spec``), each captured alone after the previous one was dropped.

NVML (``nvidia-ml-py``, when installed) adds what PyTorch does not see: this process's GPU memory
with the CUDA context and the cuBLAS/cuDNN workspaces.

``--served`` starts ``sluice serve`` with 1 and then 2 instances (``instance_group.count``), graphs off
and on, and reads the server process's GPU memory from NVML: per instance = used(2) - used(1).
It needs the PyTorch backend (runtime/backends/pytorch.py) and NVML.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _resnet_bench() -> Any:
    spec = importlib.util.spec_from_file_location("sluice_bench_gpu_resnet", HERE / "gpu_resnet.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# -- pure parts (tests/test_bench_gpu.py) --------------------------------------------------------------


def mib(value: int | float | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.0f}"


def per_instance(used_by_count: Mapping[int, int]) -> float | None:
    """Bytes one more instance costs: the slope of used memory over the instance count (least
    squares over the counts measured); None with fewer than two counts."""
    if len(used_by_count) < 2:
        return None
    xs, ys = list(used_by_count), [used_by_count[c] for c in used_by_count]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den


def memory_table(rows: Sequence[tuple[str, int | None, int | None]]) -> str:
    """Markdown rows of (step, bytes reserved by PyTorch, bytes NVML reports for the process)."""
    lines = ["| step | torch reserved MiB | NVML process MiB (*) |", "|---|---|---|"]
    lines += [f"| {step} | {mib(reserved)} | {mib(nvml)} |" for step, reserved, nvml in rows]
    return "\n".join(lines)


# -- NVML ----------------------------------------------------------------------------------------------


def nvml_memory(pid: int, index: int = 0) -> tuple[int | None, int] | None:
    """(GPU memory NVML lists for process ``pid`` on GPU ``index``, or None when it does not list that
    pid; memory used on the whole GPU). None without nvidia-ml-py. In a container NVML lists host
    PIDs, so the container's own pid is usually not found: callers fall back on the device's use."""
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        used = int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == pid:  # usedGpuMemory is None where NVML cannot say (some vGPU and MIG setups)
                return (int(proc.usedGpuMemory) if proc.usedGpuMemory else None), used
        return None, used
    finally:
        pynvml.nvmlShutdown()


def process_bytes(reading: tuple[int | None, int] | None, baseline_used: int | None) -> int | None:
    """The process's GPU memory from an :func:`nvml_memory` reading: NVML's figure for its pid, else
    the device's use above ``baseline_used`` (what the GPU used before the process started), else None."""
    if reading is None:
        return None
    listed, used = reading
    if listed is not None:
        return listed
    return None if baseline_used is None else max(0, used - baseline_used)


METHOD_NOTE = (
    "(*) NVML's figure for the process's pid; where NVML does not list that pid (a container's PID "
    "namespace), the GPU's used memory above what it used before the process started"
)


# -- in-process ----------------------------------------------------------------------------------------


def in_process(args: argparse.Namespace) -> list[tuple[str, int | None, int | None]]:
    import torch
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    from sluice.runtime.backends import torch_graphs

    bench = _resnet_bench()
    device = torch.device(args.device)
    # cuDNN at its defaults (no cudnn.benchmark), as the server runs the model: its workspaces differ
    setup = bench.Setup(args.device, args.image, "FP16", args.max_batch, args.preferred, 500)
    rows: list[tuple[str, int | None, int | None]] = []
    start = nvml_memory(os.getpid(), device.index or 0)  # before this process's CUDA context
    baseline = None if start is None else start[1]

    def nvml_now() -> int | None:
        return process_bytes(nvml_memory(os.getpid(), device.index or 0), baseline)

    def row(step: str) -> None:
        torch.cuda.synchronize(device)
        rows.append((step, torch.cuda.memory_reserved(device), nvml_now()))

    torch.zeros(1, device=device)  # the CUDA context
    row("CUDA context only")
    model = bench.build_model(setup).to(device)
    row("weights")

    def examples(batch: int) -> list[Any]:
        image = torch.randn(batch, 3, args.image, args.image, device=device, dtype=torch.float16)
        return [image.contiguous(memory_format=torch.channels_last)]

    def forward(inputs: list[Any]) -> list[Any]:
        return [model(inputs[0])]

    with torch.no_grad():
        forward(examples(args.max_batch))
    row(f"eager at batch {args.max_batch}")
    config = text_format.Parse(bench.config_text(setup), mc.ModelConfig())
    ladder = mc.ModelConfig()
    ladder.CopyFrom(config)
    ladder.ClearField("dynamic_batching")
    for name, cfg in (("default ladder", ladder), ("preferred sizes + max", config)):
        plan = torch_graphs.graph_plan(cfg)
        assert plan is not None
        graphed = torch_graphs.GraphedModel(forward, plan, examples, device, torch.cuda.Stream(device))
        sizes = ",".join(map(str, plan.batch_sizes))
        torch.cuda.synchronize(device)
        rows.append(
            (
                f"graphs ({name}: {sizes}): GraphedModel.memory_bytes",
                graphed.memory_bytes,
                nvml_now(),
            )
        )
        graphed.close()
        del graphed
        torch.cuda.empty_cache()
    return rows


# -- served --------------------------------------------------------------------------------------------


def served(args: argparse.Namespace) -> list[str]:
    bench = _resnet_bench()
    lines = ["| graphs | instances | NVML server process MiB |", "|---|---|---|"]
    per: dict[str, float | None] = {}
    for graphs in (False, True):
        used: dict[int, int] = {}
        for count in (1, 2):
            setup = bench.Setup(args.device, args.image, "FP16", args.max_batch, args.preferred, 500)
            with tempfile.TemporaryDirectory(prefix="sluice-gpumem-") as tmp:
                repo = bench.write_repo(Path(tmp), setup)
                config = repo / bench.MODEL / "config.pbtxt"
                text = config.read_text().replace("count: 1", f"count: {count}")
                if not graphs:
                    text = text.replace("optimization { cuda { graphs: true } }\n", "")
                config.write_text(text)
                before = nvml_memory(0)
                if before is None:
                    raise SystemExit("--served needs nvidia-ml-py (NVML)")
                server, http_port, _ = bench.start_server(repo, [])
                try:
                    why = bench.model_unavailable(f"127.0.0.1:{http_port}")
                    if why is not None:
                        raise SystemExit(f"the server did not load the model: {why}")
                    time.sleep(1.0)
                    value = process_bytes(nvml_memory(server.pid), before[1])
                    assert value is not None
                    used[count] = value
                finally:
                    server.send_signal(signal.SIGINT)
                    server.wait(60)
            lines.append(f"| {'on' if graphs else 'off'} | {count} | {mib(used[count])} |")
        per["on" if graphs else "off"] = per_instance(used)
    lines.append("")
    lines += [f"per instance, graphs {k}: {mib(v)} MiB" for k, v in per.items()]
    lines += ["", METHOD_NOTE.replace("(*) ", "NVML server process MiB: ")]
    return lines


def main() -> int:
    bench = _resnet_bench()
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--preferred", type=bench.parse_ints, default=(16, 32, 64, 128, 256))
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--served", action="store_true", help="measure sluice serve's process through NVML")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print(f"no CUDA GPU here (torch {torch.__version__}: torch.cuda.is_available() is false); nothing to measure")
        return 0
    print(
        f"ResNet-50 fp16 channels_last {args.image}x{args.image}, max_batch_size {args.max_batch}; "
        f"{torch.cuda.get_device_name(torch.device(args.device))}; torch {torch.__version__}\n"
    )
    if args.served:
        print("\n".join(served(args)))
    else:
        print(memory_table(in_process(args)))
        print("\n" + METHOD_NOTE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
