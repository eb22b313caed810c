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
    args = p.parse_args()
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
            rows.append((model, pick, seen, best, runs, tune_wall, len(grid["measured"]), grid_wall))
    print(f"latency budget p99 <= {args.latency_budget_ms:g} ms; concurrency {args.concurrency}; "
          f"{args.point_s:g} s per point after {args.warmup_s:g} s warm-up; instances up to {args.max_instances}; "
          f"delays {args.delays_us} us; {os.cpu_count()} CPUs; load average (1, 5, 15 min) "
          f"{' '.join(f'{x:.2f}' for x in load_before)} before, "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} after\n")
    print("| model | tune's choice | grid's choice | tune's choice as the grid measured it | grid's best "
          "| of grid's best | tune: runs, wall | grid: runs, wall | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model, pick, seen, best, n_tune, t_tune, n_grid, t_grid in rows:
        def cell(r: dict | None) -> str:
            return "-" if r is None else f"{r['throughput']:.0f} inf/s, p99 {r['p99_ms']:.2f} ms"

        def name(r: dict | None) -> str:
            return "-" if r is None else f"{r['label']} @c{r['concurrency']}"

        share = f"{seen['throughput'] / best['throughput']:.0%}" if seen and best else "-"
        print(f"| {model} | {name(pick)} | {name(best)} | {cell(seen)} | {cell(best)} | {share} "
              f"| {n_tune}, {t_tune:.0f} s "
              f"| {n_grid}, {t_grid:.0f} s | {t_grid / t_tune:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
