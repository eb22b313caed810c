"""How close each no-mesh canary split comes to the weight asked for, over seeded request streams.

    python -P bench/split_accuracy.py [--requests 100000] [--seeds 20] [--stable-pods 4] [--connections 64]

Modes, for canary weights 5, 25 and 50 %:

* **replica-proportional**: stable and canary pods behind one Service; the canary's share is
  ``c / (s + c)`` for the replica counts closest to the weight (``--stable-pods`` stable pods), and
  kube-proxy picks a pod per *connection*, not per request: clients that keep ``--connections``
  keep-alive connections put whole connections' worth of requests on one side.
* **random per request**: as a proxy that flips a weighted coin for each request would.
* **exact (Sluice)**: each stable pod runs ``sluice.runtime.split.WeightedSplit`` over the requests
  kube-proxy gave it (connections spread over the stable pods at random) and forwards the canary's
  share.

Prints, per mode and weight, the canary share over ``--requests`` requests: mean over ``--seeds``
seeds, the worst seed's distance from the weight, and the distance within the first 1,000
requests (what a short analysis interval sees). Pure arithmetic, seeded.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

from sluice.runtime.split import WeightedSplit

WEIGHTS = (5, 25, 50)


def replica_counts(weight: int, stable: int) -> int:
    """Canary replicas whose share c/(stable+c) is closest to ``weight`` (at least 1)."""
    return min(range(1, 10 * stable + 1), key=lambda c: abs(100 * c / (stable + c) - weight))


def shares(to_canary: list[bool]) -> tuple[float, float]:
    """(share over all requests, share over the first 1,000) in percent."""
    return 100 * sum(to_canary) / len(to_canary), 100 * sum(to_canary[:1000]) / min(1000, len(to_canary))


def replica_proportional(weight: int, args: argparse.Namespace, rng: random.Random) -> list[bool]:
    canary = replica_counts(weight, args.stable_pods)
    pods = [False] * args.stable_pods + [True] * canary
    connection_pod = [rng.choice(pods) for _ in range(args.connections)]
    return [connection_pod[rng.randrange(args.connections)] for _ in range(args.requests)]


def random_per_request(weight: int, args: argparse.Namespace, rng: random.Random) -> list[bool]:
    return [rng.random() * 100 < weight for _ in range(args.requests)]


def exact(weight: int, args: argparse.Namespace, rng: random.Random) -> list[bool]:
    splits = [WeightedSplit(weight) for _ in range(args.stable_pods)]
    connection_pod = [rng.randrange(args.stable_pods) for _ in range(args.connections)]
    return [splits[connection_pod[rng.randrange(args.connections)]].to_canary() for _ in range(args.requests)]


MODES = {
    "replica-proportional": replica_proportional,
    "random per request": random_per_request,
    "exact (Sluice)": exact,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--stable-pods", type=int, default=4)
    p.add_argument("--connections", type=int, default=64)
    args = p.parse_args(argv)
    print(
        f"{args.requests:,} requests per run, {args.seeds} seeds, {args.stable_pods} stable pods, "
        f"{args.connections} client keep-alive connections"
    )
    print()
    print("| mode | weight % | canary pods | mean share % | worst seed, off by (points) | first 1,000: worst off by |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, mode in MODES.items():
        for weight in WEIGHTS:
            totals, firsts = [], []
            for seed in range(args.seeds):
                share, first = shares(mode(weight, args, random.Random(seed)))
                totals.append(share)
                firsts.append(first)
            pods = str(replica_counts(weight, args.stable_pods)) if name == "replica-proportional" else "-"
            worst = max(abs(s - weight) for s in totals)
            worst_first = max(abs(s - weight) for s in firsts)
            print(
                f"| {name} | {weight} | {pods} | {statistics.fmean(totals):.2f} | {worst:.2f} | {worst_first:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
