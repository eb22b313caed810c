"""Closed-loop simulation: a fleet of runtime pods under a load trace, scaled by the Kubernetes HPA
arithmetic (``sluice.operator.hpa``) on the per-pod ``sluice_queue_depth``; prints how each
behaviour does, so the rendered defaults are chosen on evidence.

    python -P bench/hpa_sim.py [--capacity 100] [--startup-s 60] [--lag-s 30] [--target 8] [--seed 7]
                               [--metric queue|inflight] [--latency-s 0.1]

The fleet is a fluid model, one second a step: each ready pod serves ``--capacity`` requests/s;
what it cannot serve waits in the queue (bounded by max_queue_size 1024 per pod; the excess is
rejected); a new pod is ready ``--startup-s`` after the HPA asks for it (image pull, model load);
the HPA reads the queue depth per pod (``--metric queue``) or the in-flight requests per pod
(``--metric inflight``: queued plus executing, by Little's law served/s x ``--latency-s``)
``--lag-s`` late (Prometheus scrape plus the adapter) every 15 s. The trace: 200 req/s, a surge
to 1,200 req/s at 5 min, 400 req/s at 15 min, 200 req/s at 25 min, with +-10 % seeded noise.
Pure arithmetic: no cluster, no clock.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys

from sluice.operator import hpa

BEHAVIOURS = {
    "kubernetes default": hpa.Behavior(),
    "no scale-down window": hpa.Behavior(scale_down=hpa.Rules(0.0, hpa.DEFAULT_SCALE_DOWN.policies)),
    "slow scale-down (10%/min)": hpa.Behavior(
        scale_down=hpa.Rules(300.0, (hpa.Policy("Percent", 10, 60.0), hpa.Policy("Pods", 1, 60.0)))
    ),
    "slow scale-up (1 pod/min)": hpa.Behavior(scale_up=hpa.Rules(0.0, (hpa.Policy("Pods", 1, 60.0),))),
}


def trace(seconds: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    out = []
    for t in range(seconds):
        base = 200.0 if t < 300 else 1200.0 if t < 900 else 400.0 if t < 1500 else 200.0
        out.append(base * rng.uniform(0.9, 1.1))
    return out


@dataclasses.dataclass
class Outcome:
    peak_depth: float = 0.0
    seconds_over_2x: int = 0
    rejected: float = 0.0
    replica_seconds: float = 0.0
    changes: int = 0
    max_replicas: int = 0
    path: list[int] = dataclasses.field(default_factory=list)


def simulate(arrivals: list[float], behavior: hpa.Behavior, args: argparse.Namespace) -> Outcome:
    out = Outcome()
    history = hpa.History()
    wanted = ready = 2
    starting: list[tuple[int, int]] = []  # (ready at, pods)
    queue = 0.0
    depths: list[float] = []
    for t, arrival in enumerate(arrivals):
        while starting and starting[0][0] <= t:
            ready += starting.pop(0)[1]
        ready = min(ready, wanted)  # scale-down removes pods at once
        capacity = args.capacity * ready
        served = min(queue + arrival, capacity)
        queue = queue + arrival - served
        bound = 1024 * ready
        if queue > bound:
            out.rejected += queue - bound
            queue = bound
        depth = queue / max(ready, 1)
        inflight = depth + served / max(ready, 1) * args.latency_s
        depths.append(depth if args.metric == "queue" else inflight)
        out.peak_depth = max(out.peak_depth, depth)
        out.seconds_over_2x += depth > 2 * args.target
        out.replica_seconds += wanted  # pods asked for cost from the moment they are scheduled
        if t % int(hpa.SYNC_PERIOD_S) == 0 and t >= args.lag_s:
            seen = depths[t - int(args.lag_s)]
            new = hpa.decide(wanted, seen, args.target, 1, 50, behavior, history, float(t))
            if new != wanted:
                out.changes += 1
                if new > wanted:
                    starting.append((t + int(args.startup_s), new - wanted))
                wanted = new
        out.max_replicas = max(out.max_replicas, wanted)
        if t % 60 == 0:
            out.path.append(wanted)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--capacity", type=float, default=100.0, help="requests/s one pod serves")
    p.add_argument("--startup-s", type=float, default=60.0, help="from scale-up to a ready pod")
    p.add_argument("--lag-s", type=float, default=30.0, help="age of the metric the HPA reads")
    p.add_argument("--target", type=float, default=8.0, help="targetQueueDepth (averageValue)")
    p.add_argument("--seconds", type=int, default=1800)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--metric", choices=("queue", "inflight"), default="queue", help="the per-pod metric scaled on")
    p.add_argument("--latency-s", type=float, default=0.1, help="time a request executes (inflight metric)")
    args = p.parse_args(argv)
    arrivals = trace(args.seconds, args.seed)
    offered = sum(arrivals)
    print(
        f"capacity {args.capacity:g}/s per pod, startup {args.startup_s:g} s, metric lag {args.lag_s:g} s, "
        f"metric {args.metric}, target {args.target:g} per pod, {args.seconds} s, {offered:,.0f} requests offered"
    )
    print()
    print("| behaviour | peak queue/pod | s queue over 2x target | rejected | pod-minutes | changes | max pods |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    paths = {}
    for name, behavior in BEHAVIOURS.items():
        r = simulate(arrivals, behavior, args)
        paths[name] = r.path
        print(
            f"| {name} | {r.peak_depth:,.0f} | {r.seconds_over_2x} | {r.rejected:,.0f} "
            f"({r.rejected / offered:.1%}) | {r.replica_seconds / 60:,.0f} | {r.changes} | {r.max_replicas} |"
        )
    print()
    needed = [math.ceil(a / args.capacity) for a in arrivals[::60]]
    print("Replicas asked for, each minute (needed = load / capacity):")
    print()
    print("| minute | needed | " + " | ".join(paths) + " |")
    print("|---:|---:|" + "---:|" * len(paths))
    for minute, need in enumerate(needed):
        print(f"| {minute} | {need} | " + " | ".join(str(path[minute]) for path in paths.values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
