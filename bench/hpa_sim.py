"""Closed-loop simulation: a fleet of runtime pods under a load trace, scaled by the Kubernetes HPA
arithmetic (``sluice.operator.hpa``) on a per-pod metric; prints how each behaviour does, so the
rendered defaults are chosen on evidence.

    python -P bench/hpa_sim.py [--metric queue|inflight|latency] [--trace surge|bursts] [--target N]
                               [--behavior scaleDownStabilizationSeconds=600,...] [--paths]
                               [--capacity 100] [--startup-s 60] [--lag-s 30] [--seed 7]

The fleet is a fluid model, one second a step: each ready pod serves ``--capacity`` requests/s;
what it cannot serve waits in the queue (bounded by max_queue_size 1024 per pod; the excess is
rejected); a new pod is ready ``--startup-s`` after the HPA asks for it (image pull, model load);
the HPA reads, ``--lag-s`` late (Prometheus scrape plus the adapter) every 15 s, the queue depth per
pod (``--metric queue``), the in-flight requests per pod (``inflight``: queued plus executing, by
Little's law served/s x ``--latency-s``) or the queue wait in ms (``latency``: what a request arriving
now waits, queue / capacity; in a fluid model every percentile of it is the same). Targets default to
the operator's (8, 8 and 50 ms).

Traces, with +-10 % seeded noise: ``surge`` (30 min): 200 req/s, a surge to 1,200 req/s at 5 min,
400 req/s at 15 min, 200 req/s at 25 min. ``bursts`` (60 min): 300 req/s with a 2-minute burst to
900 req/s every 10 minutes, the pattern a scale-down window has to bridge.

Behaviours: Kubernetes' default, what the operator renders (``builders.scaling_behavior``, parsed back
by ``hpa.Behavior.from_kubernetes``, so the simulated object is the rendered one) with its defaults and
with other windows, and two strawmen. ``--behavior`` adds rows of the operator's rendering with
``spec.scaling`` fields set (repeatable). Pure arithmetic: no cluster, no clock.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys

from sluice.operator import api, builders, hpa

TARGETS = {"queue": api.DEFAULT_TARGET_QUEUE_DEPTH, "inflight": api.DEFAULT_TARGET_INFLIGHT,
           "latency": api.DEFAULT_TARGET_QUEUE_WAIT_MILLISECONDS}
SECONDS = {"surge": 1800, "bursts": 3600}
FIELDS = {"scaleUpStabilizationSeconds": "scale_up_stabilization_seconds",
          "scaleDownStabilizationSeconds": "scale_down_stabilization_seconds"}


def rendered(**scaling: int) -> hpa.Behavior:
    """The behaviour the operator renders for ``spec.scaling`` with these fields (snake_case)."""
    spec = api.Scaling(min_replicas=1, max_replicas=50, **scaling)
    return hpa.Behavior.from_kubernetes(builders.scaling_behavior(spec))


BEHAVIOURS = {
    "kubernetes default": hpa.Behavior(),
    "sluice default": rendered(),
    "sluice, scaleDownStabilizationSeconds 600": rendered(scale_down_stabilization_seconds=600),
    "sluice, scaleDownStabilizationSeconds 0": rendered(scale_down_stabilization_seconds=0),
    "sluice, scaleUpStabilizationSeconds 60": rendered(scale_up_stabilization_seconds=60),
    "no scale-down window, 100 %/15 s": hpa.Behavior(scale_down=hpa.Rules(0.0, hpa.DEFAULT_SCALE_DOWN.policies)),
    "slow scale-up (1 pod/min)": hpa.Behavior(scale_up=hpa.Rules(0.0, (hpa.Policy("Pods", 1, 60.0),))),
}


def trace(name: str, seconds: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    out = []
    for t in range(seconds):
        if name == "surge":
            base = 200.0 if t < 300 else 1200.0 if t < 900 else 400.0 if t < 1500 else 200.0
        else:
            base = 900.0 if 420 <= t % 600 < 540 else 300.0
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
    seen_values: list[float] = []
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
        value = {
            "queue": depth,
            "inflight": depth + served / max(ready, 1) * args.latency_s,
            "latency": depth / args.capacity * 1000,
        }[args.metric]
        seen_values.append(value)
        out.peak_depth = max(out.peak_depth, depth)
        out.seconds_over_2x += value > 2 * args.target
        out.replica_seconds += wanted  # pods asked for cost from the moment they are scheduled
        if t % int(hpa.SYNC_PERIOD_S) == 0 and t >= args.lag_s:
            seen = seen_values[t - int(args.lag_s)]
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


def parse_behavior(text: str) -> tuple[str, hpa.Behavior]:
    """``scaleDownStabilizationSeconds=600,scaleUpStabilizationSeconds=30`` -> a row of the rendered kind."""
    fields = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key not in FIELDS or not value.isdigit():
            raise argparse.ArgumentTypeError(
                f"{item!r}: give spec.scaling fields as name=seconds, names: {', '.join(FIELDS)}")
        fields[FIELDS[key]] = int(value)
    return "sluice, " + text.replace("=", " ").replace(",", ", "), rendered(**fields)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--metric", choices=("queue", "inflight", "latency"), default="queue",
                   help="the per-pod metric scaled on")
    p.add_argument("--trace", choices=tuple(SECONDS), default="surge", help="the load over time")
    p.add_argument("--target", type=float, default=None, help="per-pod target (default: the operator's)")
    p.add_argument("--behavior", type=parse_behavior, action="append", default=[],
                   help="add the operator's rendering with these spec.scaling fields, e.g. "
                        "scaleDownStabilizationSeconds=900")
    p.add_argument("--capacity", type=float, default=100.0, help="requests/s one pod serves")
    p.add_argument("--startup-s", type=float, default=60.0, help="from scale-up to a ready pod")
    p.add_argument("--lag-s", type=float, default=30.0, help="age of the metric the HPA reads")
    p.add_argument("--seconds", type=int, default=None, help="length of the trace (default: the trace's)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--latency-s", type=float, default=0.1, help="time a request executes (inflight metric)")
    p.add_argument("--paths", action="store_true", help="also print the replicas asked for, each minute")
    args = p.parse_args(argv)
    args.target = TARGETS[args.metric] if args.target is None else args.target
    seconds = args.seconds or SECONDS[args.trace]
    arrivals = trace(args.trace, seconds, args.seed)
    offered = sum(arrivals)
    unit = " ms" if args.metric == "latency" else ""
    print(
        f"trace {args.trace}, capacity {args.capacity:g}/s per pod, startup {args.startup_s:g} s, metric lag "
        f"{args.lag_s:g} s, metric {args.metric}, target {args.target:g}{unit} per pod, {seconds} s, "
        f"{offered:,.0f} requests offered"
    )
    print()
    print("| behaviour | peak queue/pod | s over 2x target | rejected | pod-minutes | changes | max pods |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    paths = {}
    for name, behavior in [*BEHAVIOURS.items(), *args.behavior]:
        r = simulate(arrivals, behavior, args)
        paths[name] = r.path
        print(
            f"| {name} | {r.peak_depth:,.0f} | {r.seconds_over_2x} | {r.rejected:,.0f} "
            f"({r.rejected / offered:.1%}) | {r.replica_seconds / 60:,.0f} | {r.changes} | {r.max_replicas} |"
        )
    if args.paths:
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
