"""Throughput and CPU per inference versus the number of protocol workers (``--protocol-workers``).

    python -P bench/frontend_workers.py [--workers 0,1,2,4] [--seconds 8] [--concurrency 64] [--connections 16]
        [--model embed|encoder|image] [--device cpu|cuda:0] [--client-processes N] [--malloc-tuning on,off]
        [--protocol grpc|http]

Models where the protocol binds: token ids in, embeddings out.

* ``embed`` (default): INT64 [16] token ids -> Gather from a 1000x64 embedding table -> a 64x64
  dense layer with ReLU -> FP32 [16, 64]; ONNX (onnx.helper) on the CPU. No attention: the model
  is cheap and the protocol is the cost.
* ``encoder``: the same ids -> a small transformer encoder (embedding 1000x64 with learned
  positions, 2 layers, 4 heads, feed-forward 128) -> FP32 [16, 64]; TorchScript on the PyTorch
  backend, on ``--device`` (``cuda:N``: a KIND_GPU instance with CUDA graphs at the preferred batch
  sizes; needs torch).
* ``image``: where large tensors bind: FP16 [3, 224, 224] (a 294 KiB image, ResNet-50's input) ->
  ReduceMean over H and W -> FP16 [3]; ONNX on the CPU, so the server's cost per image (decode, the
  copy out of a worker's arena, the batch merge, the allocator's pages) is what is measured.
  ``--malloc-tuning on,off`` measures each worker count with and without ``sluice serve``'s allocator
  settings (runtime/host_memory.py).

For each worker count it starts ``sluice serve`` in a subprocess, loads it over ``--protocol`` (gRPC,
or HTTP with binary tensor data) from ``--connections`` connections with ``--concurrency`` requests in
flight (tritonclient's asyncio client, in ``--client-processes`` processes so the load is not bound by
one client core; with SLUICE_PERF_ANALYZER=path, perf_analyzer instead), and reads the CPU time of
the engine and of each worker from /proc before and after the measured window. Prints one row per worker count:
inferences/s, engine CPU us per inference (and of it, the engine's event-loop thread: the rest is
the model's execution thread), total server CPU us per inference (engine + workers), mean batch
size formed (from the model's statistics).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SEQ, VOCAB, DIM = 16, 1000, 64
CONFIG = f"""
name: "embed"
platform: "onnxruntime_onnx"
max_batch_size: 64
input [ {{ name: "TOKENS", data_type: TYPE_INT64, dims: [ {SEQ} ] }} ]
output [ {{ name: "EMBEDDINGS", data_type: TYPE_FP32, dims: [ {SEQ}, {DIM} ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 500 }}
instance_group [ {{ count: 1, kind: KIND_CPU }} ]
"""
GPU_PREFERRED = (8, 16, 32, 64, 128, 256)


def encoder_config(device: str) -> str:
    """The encoder's config: on ``cuda:N`` one KIND_GPU instance on GPU N with CUDA graphs captured at
    the preferred batch sizes (and max_batch_size), else one CPU instance."""
    if device == "cpu":
        placement, graphs, max_batch = "instance_group [ { count: 1, kind: KIND_CPU } ]", "", 64
        preferred = ""
    else:
        gpu = int(device.split(":", 1)[1]) if ":" in device else 0
        placement = f"instance_group [ {{ count: 1, kind: KIND_GPU, gpus: [ {gpu} ] }} ]"
        graphs, max_batch = "optimization { cuda { graphs: true } }", GPU_PREFERRED[-1]
        preferred = f"preferred_batch_size: [ {', '.join(str(b) for b in GPU_PREFERRED)} ] "
    return f"""
name: "embed"
platform: "pytorch_libtorch"
max_batch_size: {max_batch}
input [ {{ name: "TOKENS", data_type: TYPE_INT64, dims: [ {SEQ} ] }} ]
output [ {{ name: "EMBEDDINGS", data_type: TYPE_FP32, dims: [ {SEQ}, {DIM} ] }} ]
dynamic_batching {{ {preferred}max_queue_delay_microseconds: 500 }}
{placement}
{graphs}
"""


def encoder_model(path: Path) -> None:
    """A small transformer encoder as TorchScript (random weights, seeded)."""
    import torch

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = torch.nn.Embedding(VOCAB, DIM)
            self.positions = torch.nn.Parameter(torch.randn(SEQ, DIM) / 8)
            layer = torch.nn.TransformerEncoderLayer(DIM, 4, dim_feedforward=128, dropout=0.0, batch_first=True)
            self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

        def forward(self, TOKENS: torch.Tensor) -> torch.Tensor:
            return self.encoder(self.tokens(TOKENS) + self.positions)

    torch.manual_seed(0)
    module = Encoder().eval()
    with torch.no_grad():
        traced = torch.jit.trace(module, torch.zeros(2, SEQ, dtype=torch.int64))
    traced.save(str(path))
TICKS = os.sysconf("SC_CLK_TCK")


IMAGE_CONFIG = """
name: "image"
platform: "onnxruntime_onnx"
max_batch_size: 64
input [ { name: "IMAGE", data_type: TYPE_FP16, dims: [ 3, 224, 224 ] } ]
output [ { name: "MEANS", data_type: TYPE_FP16, dims: [ 3 ] } ]
dynamic_batching { max_queue_delay_microseconds: 500 }
instance_group [ { count: 1, kind: KIND_CPU } ]
"""


def image_model() -> bytes:
    node = helper.make_node("ReduceMean", ["IMAGE"], ["MEANS"], axes=[2, 3], keepdims=0)
    graph = helper.make_graph(
        [node],
        "image",
        [helper.make_tensor_value_info("IMAGE", TensorProto.FLOAT16, ["batch", 3, 224, 224])],
        [helper.make_tensor_value_info("MEANS", TensorProto.FLOAT16, ["batch", 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


INPUTS = {
    "embed": ("TOKENS", "INT64", (1, SEQ)),
    "encoder": ("TOKENS", "INT64", (1, SEQ)),
    "image": ("IMAGE", "FP16", (1, 3, 224, 224)),
}
"""Per --model: the input's name, datatype and the shape of one request."""


def request_data(model: str) -> np.ndarray:
    _, datatype, shape = INPUTS[model]
    rng = np.random.default_rng(1)
    if datatype == "INT64":
        return rng.integers(0, VOCAB, shape, dtype=np.int64)
    return rng.standard_normal(shape).astype(np.float16)


def served_name(model: str) -> str:
    return "image" if model == "image" else "embed"


def embed_model() -> bytes:
    rng = np.random.default_rng(0)
    table = numpy_helper.from_array(rng.standard_normal((VOCAB, DIM)).astype(np.float32), "table")
    weight = numpy_helper.from_array((rng.standard_normal((DIM, DIM)) / 8).astype(np.float32), "weight")
    bias = numpy_helper.from_array(np.zeros(DIM, np.float32), "bias")
    nodes = [
        helper.make_node("Gather", ["table", "TOKENS"], ["looked_up"]),
        helper.make_node("MatMul", ["looked_up", "weight"], ["projected"]),
        helper.make_node("Add", ["projected", "bias"], ["biased"]),
        helper.make_node("Relu", ["biased"], ["EMBEDDINGS"]),
    ]
    graph = helper.make_graph(
        nodes,
        "embed",
        [helper.make_tensor_value_info("TOKENS", TensorProto.INT64, ["batch", SEQ])],
        [helper.make_tensor_value_info("EMBEDDINGS", TensorProto.FLOAT, ["batch", SEQ, DIM])],
        [table, weight, bias],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def cpu_s(pid: int, tid: int | None = None) -> float:
    """CPU seconds of process ``pid`` (of its thread ``tid`` when given)."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def start(
    repo: Path, workers: int, malloc_tuning: str = "on"
) -> tuple[subprocess.Popen, dict[str, int], list[int]]:
    """The server, its ports ({"HTTP": n, "gRPC": m}) and its protocol workers' pids."""
    cmd = [
        sys.executable, "-P", "-m", "sluice.runtime", "serve", "--model-repository", str(repo), "--http-port", "0",
        "--grpc-port", "0", "--metrics-port", "-1", "--protocol-workers", str(workers), "--log-level", "INFO",
        "--malloc-tuning", malloc_tuning,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=repo.parent)
    assert proc.stdout is not None
    pids: list[int] = []
    for line in proc.stdout:
        if "protocol worker(s) serving" in line:
            pids = [int(p) for p in re.findall(r"\d+", line.split("pids")[1])]
        if "sluice ready" in line:
            ports = {k: int(v) for k, v in re.findall(r"(HTTP|gRPC) \S+:(\d+)", line)}
            # read the rest of its output: an unread pipe would stop the server once it is full
            threading.Thread(target=lambda: [None for _ in proc.stdout or ()], daemon=True).start()
            return proc, ports, pids
    raise RuntimeError("the server did not start")


def load_in_processes(
    model: str, port: int, seconds: float, concurrency: int, connections: int, processes: int, protocol: str = "grpc"
) -> int:
    """``load`` split over ``processes`` client processes (concurrency and connections divided among
    them); the inferences they completed."""
    if processes <= 1:
        return asyncio.run(load(model, port, seconds, concurrency, connections, protocol))
    shares = [
        (model, port, seconds, max(1, concurrency // processes + (i < concurrency % processes)),
         max(1, connections // processes + (i < connections % processes)), protocol)
        for i in range(processes)
    ]  # fmt: skip
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        return sum(pool.starmap(_load_sync, shares))


def _load_sync(model: str, port: int, seconds: float, concurrency: int, connections: int, protocol: str) -> int:
    try:
        return asyncio.run(load(model, port, seconds, concurrency, connections, protocol))
    except Exception as exc:  # tritonclient's exceptions do not unpickle: the pool would hang on one
        raise RuntimeError(f"{type(exc).__name__}: {exc}") from None


async def load(
    model: str, port: int, seconds: float, concurrency: int, connections: int, protocol: str = "grpc"
) -> int:
    import tritonclient.grpc.aio as grpcclient
    import tritonclient.http.aio as httpclient

    if protocol == "grpc":
        clients: list = [
            grpcclient.InferenceServerClient(f"127.0.0.1:{port}", channel_args=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(connections)
        ]
    else:  # one aiohttp session a connection, each allowed its share of the requests in flight
        per = max(1, -(-concurrency // connections))
        clients = [httpclient.InferenceServerClient(f"127.0.0.1:{port}", conn_limit=per) for _ in range(connections)]
    name, datatype, shape = INPUTS[model]
    module = grpcclient if protocol == "grpc" else httpclient
    tensor = module.InferInput(name, list(shape), datatype)
    if protocol == "grpc":
        tensor.set_data_from_numpy(request_data(model))
    else:
        tensor.set_data_from_numpy(request_data(model), binary_data=True)
    served = served_name(model)
    done = 0
    stop_at = 0.0

    async def one(client: grpcclient.InferenceServerClient) -> None:
        nonlocal done
        while time.monotonic() < stop_at:
            await client.infer(served, [tensor])
            done += 1

    stop_at = time.monotonic() + seconds
    await asyncio.gather(*(one(clients[i % connections]) for i in range(concurrency)))
    for client in clients:
        await client.close()
    return done


def perf_analyzer(binary: str, model: str, port: int, seconds: float, concurrency: int) -> float:
    out = subprocess.run(
        [binary, "-m", served_name(model), "-u", f"127.0.0.1:{port}", "-i", "grpc", "-b", "1",
         "--concurrency-range", str(concurrency), "--measurement-interval", str(int(seconds * 1000))],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return float(re.findall(r"Throughput: ([\d.]+) infer/sec", out)[-1])


def batch_mean(model: str, port: int) -> float:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    stats = client.get_inference_statistics(served_name(model), as_json=True)
    model = stats["model_stats"][0]
    return int(model["inference_count"]) / max(int(model["execution_count"]), 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="0,1,2,4")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--model", choices=["embed", "encoder", "image"], default="embed")
    p.add_argument("--device", default="cpu", help="the encoder's device: cpu or cuda:N")
    p.add_argument("--client-processes", type=int, default=1, help="client processes sharing the load")
    p.add_argument("--malloc-tuning", default="on", help="sluice serve's --malloc-tuning: on, off, or on,off (both)")
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc", help="the load's protocol")
    args = p.parse_args()
    if args.model != "encoder" and args.device != "cpu":
        p.error("--device applies to --model encoder (the embed and image models are ONNX on the CPU)")
    tunings = args.malloc_tuning.split(",")
    if not tunings or any(t not in ("on", "off") for t in tunings):
        p.error(f"--malloc-tuning {args.malloc_tuning!r}; allowed: on, off, or both separated by a comma")
    repo = Path(tempfile.mkdtemp()) / "repo"
    (repo / served_name(args.model) / "1").mkdir(parents=True)
    if args.model == "image":
        (repo / "image" / "config.pbtxt").write_text(IMAGE_CONFIG)
        (repo / "image" / "1" / "model.onnx").write_bytes(image_model())
    elif args.model == "embed":
        (repo / "embed" / "config.pbtxt").write_text(CONFIG)
        (repo / "embed" / "1" / "model.onnx").write_bytes(embed_model())
        onnx.checker.check_model(onnx.load(str(repo / "embed" / "1" / "model.onnx")))
    else:
        (repo / "embed" / "config.pbtxt").write_text(encoder_config(args.device))
        encoder_model(repo / "embed" / "1" / "model.pt")
    analyzer = os.environ.get("SLUICE_PERF_ANALYZER")
    if analyzer and args.protocol != "grpc":
        p.error("SLUICE_PERF_ANALYZER drives gRPC only here")
    client = "perf_analyzer" if analyzer else f"tritonclient {args.protocol}.aio x{args.client_processes} process(es)"
    print(f"cpus {os.cpu_count()}, model {args.model} on {args.device}, load: {client}, "
          f"c{args.concurrency} over {args.connections} connection(s), {args.seconds:g} s per point")  # fmt: skip
    heads = ("workers", "malloc", "infer/s", "engine us/inf", "(loop thread)", "total us/inf", "mean batch")
    print(" ".join(f"{h:>{w}}" for h, w in zip(heads, (7, 6, 9, 14, 14, 13, 11), strict=True)))
    points = [(int(w), t) for w in args.workers.split(",") for t in tunings]
    for workers, tuning in points:
        proc, ports, pids = start(repo, workers, tuning)
        port = ports["gRPC" if args.protocol == "grpc" else "HTTP"]
        try:
            target = (args.model, port)
            if args.warmup:
                load_in_processes(
                    *target, args.warmup, args.concurrency, args.connections, args.client_processes, args.protocol
                )
            before = [cpu_s(pid) for pid in (proc.pid, *pids)]
            loop_before = cpu_s(proc.pid, proc.pid)  # the event loop runs on the main thread
            started = time.monotonic()
            if analyzer:
                rate = perf_analyzer(analyzer, args.model, port, args.seconds, args.concurrency)
                elapsed = time.monotonic() - started
                count = rate * elapsed
            else:
                count = load_in_processes(
                    *target, args.seconds, args.concurrency, args.connections, args.client_processes, args.protocol
                )
                elapsed = time.monotonic() - started
                rate = count / elapsed
            after = [cpu_s(pid) for pid in (proc.pid, *pids)]
            loop = (cpu_s(proc.pid, proc.pid) - loop_before) / count * 1e6
            engine = (after[0] - before[0]) / count * 1e6
            total = (sum(after) - sum(before)) / count * 1e6
            print(
                f"{workers:>7} {tuning:>6} {rate:>9.0f} {engine:>14.1f} {loop:>14.1f} {total:>13.1f} "
                f"{batch_mean(args.model, ports['gRPC']):>11.1f}",
                flush=True,
            )
        finally:
            proc.send_signal(signal.SIGINT)  # stop now; SIGTERM would drain for --drain-period-s
            proc.wait(60)


if __name__ == "__main__":
    main()
