"""How fast the GPU placement planner (``sluice.operator.placement``) is, and how tightly it packs.

    python -P bench/placement.py [--runs 5] [--scales 1,10] [--seed 7] [--profile]

The cluster at scale 1 has 100 nodes, as GPU feature discovery and the device plugin publish them:
40 x A100-80GB, mixed strategy, MIG manager's all-balanced on 8 GPUs; 20 x H100-80GB, single strategy,
all-1g.10gb on 8 GPUs; 20 x H200 whole, 8 GPUs; 10 x T4, time-sliced, 4 GPUs x 4 replicas; 10 x L4 whole,
2 GPUs. That is 700 physical GPUs, 2,740 schedulable devices. Scale N multiplies the nodes and the models.

1,000 models per scale, seeded: 50 % memory only (2-24 GiB, some with a compute share, a third allowing
time-sliced GPUs), 15 % an explicit MIG profile, 8 % whole GPUs (one or two per replica, 16-120 GiB, one or
two replicas), 27 % small models (1-3 GiB) allowing time-sliced GPUs; otherwise 1, 2 or 3 replicas. The
oldest 30 % ran before: they are planned alone first and passed back pinned to their placement, as the
reconciler does.

Reported per scale: the time to build the inventory from the Node objects and the time of one ``plan``
(median of ``--runs``, ``time.perf_counter``, advice included); the placed / pending / unsatisfiable
counts; and packing: physical GPUs the plan touches (``Plan.gpus``) against two lower bounds from memory
and the naive placement. Lower bound per kind: for each GPU kind, the memory the plan's replicas on it
take (the requested memory; a whole GPU's memory per whole GPU asked for) over one GPU's memory, rounded
up, summed over kinds. Global bound: the same memory over the largest GPU's (H200). Naive: one whole GPU
per replica and GPU asked for (replicas x max(count, 1)). ``--profile`` prints cProfile's top functions.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import math
import os
import platform
import pstats
import random
import statistics
import sys
import time
from typing import Any

from sluice.operator import gpus, inventory, placement

GIB = 1024


def _node(name: str, labels: dict[str, str], allocatable: dict[str, int], pool: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {**labels, "sluice.dev/node-pool": pool}},
            "spec": {"taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]},
            "status": {"allocatable": {"cpu": "96", **{k: str(v) for k, v in allocatable.items()}},
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def cluster(scale: int) -> list[dict[str, Any]]:
    nodes = []
    for i in range(40 * scale):
        nodes.append(_node(f"a100-{i:04d}", {
            "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.count": "8",
            "nvidia.com/gpu.memory": "81920", "nvidia.com/mig.capable": "true", "nvidia.com/mig.strategy": "mixed",
            "nvidia.com/mig.config": "all-balanced", "nvidia.com/mig.config.state": "success",
        }, {"nvidia.com/gpu": 0, "nvidia.com/mig-1g.10gb": 16, "nvidia.com/mig-2g.20gb": 8,
            "nvidia.com/mig-3g.40gb": 8}, "a100"))
    for i in range(20 * scale):
        nodes.append(_node(f"h100-{i:04d}", {
            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb", "nvidia.com/gpu.count": "56",
            "nvidia.com/gpu.memory": "9984", "nvidia.com/mig.capable": "true", "nvidia.com/mig.strategy": "single",
            "nvidia.com/mig.config": "all-1g.10gb",
        }, {"nvidia.com/gpu": 56}, "h100"))
    for i in range(20 * scale):
        nodes.append(_node(f"h200-{i:04d}", {
            "nvidia.com/gpu.product": "NVIDIA-H200", "nvidia.com/gpu.count": "8", "nvidia.com/gpu.memory": "143771",
            "nvidia.com/mig.capable": "true",
        }, {"nvidia.com/gpu": 8}, "h200"))
    for i in range(10 * scale):
        nodes.append(_node(f"t4-{i:04d}", {
            "nvidia.com/gpu.product": "Tesla-T4-SHARED", "nvidia.com/gpu.count": "4", "nvidia.com/gpu.memory": "15360",
            "nvidia.com/gpu.replicas": "4",
        }, {"nvidia.com/gpu": 16}, "t4"))
    for i in range(10 * scale):
        nodes.append(_node(f"l4-{i:04d}", {
            "nvidia.com/gpu.product": "NVIDIA-L4", "nvidia.com/gpu.count": "2", "nvidia.com/gpu.memory": "23034",
        }, {"nvidia.com/gpu": 2}, "l4"))
    return nodes


def requests(count: int, seed: int) -> list[placement.Request]:
    rng = random.Random(seed)
    result = []
    for i in range(count):
        key = f"InferenceModel/team-{i % 37:02d}/model-{i:05d}"
        created = f"2026-01-{1 + i * 28 // count:02d}T{i % 24:02d}:{i % 60:02d}:00Z"
        replicas = rng.choice((1, 1, 1, 2, 2, 3))
        roll = rng.random()
        if roll < 0.50:
            result.append(placement.Request(
                key, replicas, memory_mib=rng.randint(2 * GIB, 24 * GIB),
                compute_percent=rng.choice((0, 0, 10, 25, 40)), shared=rng.random() < 1 / 3, created=created))
        elif roll < 0.65:
            profile = rng.choice(("1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"))
            result.append(placement.Request(key, replicas, profile=profile, created=created))
        elif roll < 0.73:
            result.append(placement.Request(key, min(replicas, 2), count=rng.choice((1, 1, 1, 2)),
                                            memory_mib=rng.choice((16, 20, 40, 70, 120)) * GIB, created=created))
        else:
            result.append(placement.Request(key, replicas, memory_mib=rng.randint(1 * GIB, 3 * GIB), shared=True,
                                            created=created))
    return result


def with_pins(inv: inventory.Inventory, wanted: list[placement.Request]) -> list[placement.Request]:
    """The oldest 30 % planned alone, then passed back pinned where they were placed."""
    ordered = sorted(wanted, key=lambda r: (r.created, r.key))
    earlier = ordered[: len(ordered) * 3 // 10]
    before = placement.plan(inv, earlier, advise=False)
    pinned = {}
    for request in earlier:
        verdict = before.verdicts[request.key]
        if verdict.state == placement.PLACED:
            pinned[request.key] = dataclasses.replace(request, pinned=verdict.shape, pinned_for=request.signature())
    return [pinned.get(r.key, r) for r in wanted]


def _request_memory(request: placement.Request, model: gpus.GpuModel | None, node_memory: int) -> int:
    """MiB one replica takes on a GPU of ``model``: a whole GPU per GPU asked for, else what it asked for."""
    if request.count:
        return request.count * node_memory
    if request.profile and model is not None:
        found = model.profile(request.profile)
        return found.memory_mib if found else request.memory_mib
    return request.memory_mib


def packing(inv: inventory.Inventory, wanted: list[placement.Request], result: placement.Plan) -> dict[str, int]:
    nodes = {node.name: node for node in inv.nodes}
    per_kind: dict[str, int] = {}
    gpu_memory: dict[str, int] = {}
    naive = 0
    for request in wanted:
        verdict = result.verdicts[request.key]
        if verdict.state != placement.PLACED:
            continue
        naive += request.replicas * max(request.count, 1)
        for name in verdict.nodes:
            node = nodes[name]
            model = gpus.CATALOGUE_BY_KEY.get(node.model)
            per_kind[node.model] = per_kind.get(node.model, 0) + _request_memory(request, model, node.memory_mib)
            gpu_memory[node.model] = node.memory_mib
    per_kind_bound = sum(math.ceil(mib / gpu_memory[kind]) for kind, mib in per_kind.items())
    largest = max(node.memory_mib for node in inv.nodes)
    return {"gpus": len(result.gpus), "per_kind": per_kind_bound,
            "global": math.ceil(sum(per_kind.values()) / largest), "naive": naive}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()} ({platform.system()})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--scales", default="1,10", help="comma-separated multiples of 100 nodes / 1,000 models")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--profile", action="store_true", help="cProfile one plan per scale")
    args = parser.parse_args(argv)
    print(f"$ python -P bench/placement.py {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    print(f"machine: {machine()}")
    print()
    header = (f"{'models':>7} {'nodes':>6} {'GPUs':>6} {'devices':>8} | {'inventory':>10} {'plan p50':>9} "
              f"{'min':>8} {'max':>8} | {'placed':>7} {'pending':>7} {'unsat':>6} {'pinned':>6} | "
              f"{'GPUs used':>9} {'bound/kind':>10} {'bound/all':>9} {'naive':>6}")
    print(header)
    print("-" * len(header))
    rows = []
    for scale in (int(s) for s in args.scales.split(",")):
        nodes = cluster(scale)
        started = time.perf_counter()
        inv = inventory.from_nodes(nodes)
        built = time.perf_counter() - started
        wanted = with_pins(inv, requests(1000 * scale, args.seed))
        times = []
        result = placement.plan(inv, wanted)
        for _ in range(args.runs):
            started = time.perf_counter()
            again = placement.plan(inv, wanted)
            times.append(time.perf_counter() - started)
            assert again == result, "the plan is not deterministic"
        states = [v.state for v in result.verdicts.values()]
        pinned = sum(1 for v in result.verdicts.values() if v.kept)
        pack = packing(inv, wanted, result)
        physical = sum(node.gpus for node in inv.nodes)
        devices = sum(len(node.devices) for node in inv.nodes)
        median = statistics.median(times)
        rows.append((scale, median))
        print(f"{len(wanted):>7,} {len(inv.nodes):>6,} {physical:>6,} {devices:>8,} | {built * 1000:>8.0f}ms "
              f"{median * 1000:>7.0f}ms {min(times) * 1000:>6.0f}ms {max(times) * 1000:>6.0f}ms | "
              f"{states.count(placement.PLACED):>7,} {states.count(placement.PENDING):>7,} "
              f"{states.count(placement.UNSATISFIABLE):>6,} {pinned:>6,} | {pack['gpus']:>9,} "
              f"{pack['per_kind']:>10,} {pack['global']:>9,} {pack['naive']:>6,}")
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            placement.plan(inv, wanted)
            profiler.disable()
            pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(15)
    if len(rows) > 1:
        (first_scale, first), (last_scale, last) = rows[0], rows[-1]
        growth = last / first
        exponent = math.log(growth) / math.log(last_scale / first_scale)
        print(f"\n{last_scale // first_scale}x models and nodes: plan time x{growth:.1f} "
              f"(~ n^{exponent:.2f} in the cluster size)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
