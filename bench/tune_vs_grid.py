"""``sluice tune`` (model search) against a full grid search with the same load generator.

    python bench/tune_vs_grid.py [--point-s 1.0] [--warmup-s 0.3] [--concurrency 1,8,32]
                                 [--latency-budget-ms 20] [--max-instances 2] [--models mlp,add_sub,mlp_heavy]

For each model it runs ``sluice tune --search model`` and ``sluice tune --search grid`` (same candidate
space, same concurrency levels, same measurement duration per point, same in-process load
generator), each as its own process, and prints a markdown table: the config each picked, its
throughput and p99 as the grid measured it (so both choices are compared on the same
measurements), the points each measured and the wall time of each. Models: the example
repository's ``mlp`` and ``add_sub`` (max_batch_size 0), and ``mlp_heavy``, an MLP generated here
(256 -> 1024 -> 1024 -> 16, fp32, max_batch_size 64) whose execution time grows with the batch.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _builders():
    spec = importlib.util.spec_from_file_location("make_models", ROOT / "examples" / "make_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_repo(root: Path) -> None:
    shutil.copytree(ROOT / "examples" / "model_repository", root)
    heavy = root / "mlp_heavy"
    (heavy / "1").mkdir(parents=True)
    (heavy / "1" / "model.onnx").write_bytes(_builders().mlp_model((256, 1024, 1024, 16), seed=0))
    (heavy / "config.pbtxt").write_text(
        'name: "mlp_heavy"\nbackend: "onnxruntime"\nmax_batch_size: 64\n'
        "dynamic_batching { max_queue_delay_microseconds: 500 }\ninstance_group [ { kind: KIND_CPU, count: 1 } ]\n"
    )


def tune(repo: Path, model: str, search: str, args, out: Path) -> tuple[dict, float]:
    command = [
        sys.executable, "-P", "-m", "sluice.runtime", "tune", "--model-repository", str(repo), "--model", model,
        "--search", search, "--time-budget", args.time_budget if search == "model" else "3h",
        "--concurrency", args.concurrency, "--max-instances", str(args.max_instances),
        "--delays-us", args.delays_us, "--point-s", str(args.point_s), "--warmup-s", str(args.warmup_s),
        "--json", str(out), "--latency-budget-ms", str(args.latency_budget_ms),
    ]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=tempfile.gettempdir())
    wall = time.monotonic() - started
    if done.returncode not in (0, 5):
        raise SystemExit(f"sluice tune --search {search} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    sys.stderr.write(done.stderr[-1500:])
    return json.loads(out.read_text()), wall


def judge(repo: Path, model: str, picks: list[dict], args, out: Path) -> tuple[list[list[dict]], float]:
    """Each of ``picks`` (--json rows) measured ``--rounds`` times, interleaved (A B A B ...), in a fresh
    process with the same load generator, concurrency, warm-up and duration as the grid's points."""
    command = [sys.executable, "-P", str(Path(__file__).resolve()), "--judge-worker", json.dumps({
        "repo": str(repo), "model": model, "picks": picks, "rounds": args.rounds, "point_s": args.point_s,
        "warmup_s": args.warmup_s, "out": str(out),
    })]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=tempfile.gettempdir())
    if done.returncode != 0:
        raise SystemExit(f"judging failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text()), time.monotonic() - started


def judge_worker(spec: dict) -> int:
    import asyncio

    from sluice.runtime import tune
    from sluice.runtime import tune_plan as plan
    from sluice.runtime.server import Server
    from sluice.runtime.settings import SchedulingDefaults

    points = [plan.Point(plan.BatchingConfig(r["config"]["policy"], r["config"]["instances"],
                                             tuple(r["config"]["preferred"]), r["config"]["delay_us"]),
                         r["concurrency"]) for r in spec["picks"]]
    settings = tune.TuneSettings(Path(spec["repo"]), spec["model"], concurrency=tuple(p.concurrency for p in points))
    durations = plan.Durations(warmup_s=spec["warmup_s"], point_s=spec["point_s"])

    async def go() -> list[list[dict]]:
        server = Server(tune._server_settings(settings))
        await server.start()
        try:
            clients = tune._Clients(f"127.0.0.1:{server.ports.grpc}", f"127.0.0.1:{server.ports.http}", "grpc",
                                    max(settings.concurrency))
            try:
                served = (await clients.control.get_model_config(spec["model"])).config
                session = tune.Session(settings, clients, served, SchedulingDefaults().batch_policy, asyncio.Event())
                await session.measure(points[0], durations)  # warm-up of the process (not counted)
                runs: list[list[dict]] = [[] for _ in points]
                for _ in range(spec["rounds"]):
                    for i, point in enumerate(points):
                        runs[i].append(tune._to_dict(await session.measure(point, durations)))
                return runs
            finally:
                await clients.aclose()
        finally:
            await server.stop(grace_s=1.0)

    Path(spec["out"]).write_text(json.dumps(asyncio.run(go())))
    return 0


def key(row: dict) -> tuple:
    c = row["config"]
    return (c["policy"], c["instances"], tuple(c["preferred"]), c["delay_us"], row["concurrency"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--point-s", type=float, default=1.0)
    p.add_argument("--warmup-s", type=float, default=0.3)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--latency-budget-ms", type=float, default=20.0)
    p.add_argument("--max-instances", type=int, default=2)
    p.add_argument("--delays-us", default="250,1000,4000")
    p.add_argument("--time-budget", default="5m", help="of the model search (the grid gets all the time it needs)")
    p.add_argument("--models", default="mlp,add_sub,mlp_heavy")
    p.add_argument("--keep", type=Path, default=None, metavar="DIR", help="copy each run's --json result here")
    p.add_argument("--rounds", type=int, default=5, help="judging rounds (each choice measured once per round)")
    p.add_argument("--judge-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.judge_worker is not None:
        return judge_worker(json.loads(args.judge_worker))
    rows = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        write_repo(repo)
        for model in args.models.split(","):
            tuned, tune_wall = tune(repo, model, "model", args, Path(tmp) / f"{model}-model.json")
            grid, grid_wall = tune(repo, model, "grid", args, Path(tmp) / f"{model}-grid.json")
            if args.keep is not None:
                args.keep.mkdir(parents=True, exist_ok=True)
                for search in ("model", "grid"):
                    shutil.copy(Path(tmp) / f"{model}-{search}.json", args.keep / f"{model}-{search}.json")
            by_point = {key(r): r for r in grid["measured"]}
            pick = tuned["best"] or tuned["closest"]
            best = grid["best"] or grid["closest"]
            seen = by_point.get(key(pick)) if pick else None
            runs = tuned.get("measurements", len(tuned["measured"]))
            picks = [best] if key(pick) == key(best) else [best, pick]
            judged, judge_wall = judge(repo, model, picks, args, Path(tmp) / f"{model}-judge.json")
            judged = judged if len(judged) == 2 else judged * 2
            rows.append((model, pick, seen, best, runs, tune_wall, len(grid["measured"]), grid_wall,
                         judged, judge_wall))
    print(f"latency budget p99 <= {args.latency_budget_ms:g} ms; concurrency {args.concurrency}; "
          f"{args.point_s:g} s per point after {args.warmup_s:g} s warm-up; instances up to {args.max_instances}; "
          f"delays {args.delays_us} us; {os.cpu_count()} CPUs; load average (1, 5, 15 min) "
          f"{' '.join(f'{x:.2f}' for x in load_before)} before, "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} after\n")
    def median(runs: list[dict], field: str) -> float:
        return statistics.median(r[field] for r in runs)

    def spread(runs: list[dict]) -> str:
        xs = [r["throughput"] for r in runs]
        return (f"{median(runs, 'throughput'):.0f} [{min(xs):.0f}-{max(xs):.0f}] inf/s, "
                f"p99 {median(runs, 'p99_ms'):.2f} ms")

    def name(r: dict | None) -> str:
        return "-" if r is None else f"{r['label']} @c{r['concurrency']}"

    print(f"judged: {args.rounds} interleaved rounds (grid's choice, tune's choice, ...) after one warm-up run; "
          "median [min-max] of the rounds; 'same or better': tune's median >= 0.95 x grid's and its median p99 "
          "within the budget\n")
    print("| model | grid's choice (its single run) | tune's choice | grid's choice, judged | tune's choice, judged "
          "| tune/grid | same or better | tune: runs, wall | grid: runs, wall | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    budget = args.latency_budget_ms
    for model, pick, _seen, best, n_tune, t_tune, n_grid, t_grid, judged, _judge_wall in rows:
        g, t = judged
        ratio = median(t, "throughput") / median(g, "throughput")
        ok = ratio >= 0.95 and median(t, "p99_ms") <= budget
        same = " (same)" if key(pick) == key(best) else ""
        print(f"| {model} | {name(best)} ({best['throughput']:.0f} inf/s) | {name(pick)}{same} | {spread(g)} "
              f"| {spread(t)} | {ratio:.2f} | {'yes' if ok else 'no'} | {n_tune}, {t_tune:.0f} s "
              f"| {n_grid}, {t_grid:.0f} s | {t_grid / t_tune:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
