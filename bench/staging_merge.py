"""Merging a batch of request tensors into one buffer while another thread runs Python.

    python -P bench/staging_merge.py [--parts 8,32,128] [--shape 3,224,224] [--dtype float16] [--reps 40]

A served batch is merged on the model instance's thread while the event loop thread decodes the
next requests. numpy's ``concatenate`` (``runtime/backends/tensor.py: merge_into``) releases the GIL
around each part's copy and must take it back after, which waits for the loop thread to give it up
(``sys.setswitchinterval``, 100 us in ``sluice serve``); torch's ``cat`` (``runtime/backends/
pytorch.py: merge_rows``, what the CUDA instances use for their pinned buffers) releases it once for
the whole batch; ``tensor.concat_rows`` (what the CPU instances use) copies each part with the GIL
held, so a waiting thread gets its turn at the switch interval, not after every part. This prints
ms per batch and us per part, alone and beside a thread spinning in Python (standing for the busy
event loop), with the server's switch interval; then what any torch call (a slice or view) costs
alone and beside that thread: the reason the CUDA path makes its views of the pinned buffers once
per shape. Needs torch (CPU is enough). Figures depend on the machine: compare rows of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def timed(fn: Callable[[], object], reps: int) -> float:
    """Mean seconds of ``fn`` over ``reps`` calls after one warm-up call."""
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


@contextlib.contextmanager
def beside(what: str) -> Iterator[None]:
    """Run the body alone (``nothing``) or beside a thread spinning in Python (standing for the busy
    event loop)."""
    stop = threading.Event()
    spinner = None
    if what != "nothing":

        def spin() -> None:
            n = 0
            while not stop.is_set():
                n += 1

        spinner = threading.Thread(target=spin, daemon=True)
        spinner.start()
    try:
        yield
    finally:
        stop.set()
        if spinner is not None:
            spinner.join()


def main() -> int:
    import torch

    from sluice.runtime.backends.pytorch import merge_rows
    from sluice.runtime.backends.tensor import concat_rows, merge_into

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--parts", type=_ints, default=(8, 32, 128), help="parts (requests) per batch")
    parser.add_argument("--shape", type=_ints, default=(3, 224, 224), help="one request's row shape")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--torch-threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    args = parser.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    sys.setswitchinterval(0.0001)  # as sluice serve sets it
    dtype = np.dtype(args.dtype)
    row_bytes = int(np.prod(args.shape)) * dtype.itemsize
    print(f"parts of 1 x {list(args.shape)} {dtype} ({row_bytes / 1024:.0f} KiB), switch interval 100 us; "
          f"torch {torch.__version__} with {torch.get_num_threads()} thread(s)\n")
    print("| parts | beside | numpy concatenate ms | us a part | torch.cat ms | us a part "
          "| concat_rows ms | us a part |")
    print("|---|---|---|---|---|---|---|---|")
    for count in args.parts:
        rng = np.random.default_rng(count)
        parts = [
            np.frombuffer(rng.standard_normal((1, *args.shape)).astype(dtype).tobytes(), dtype).reshape(1, *args.shape)
            for _ in range(count)
        ]  # read-only arrays over bytes, as requests arrive
        out = torch.empty(count * row_bytes, dtype=torch.uint8)
        typed = out.numpy().view(dtype).reshape(count, *args.shape)
        for what in ("nothing", "a busy thread"):
            with beside(what):
                numpy_s = timed(lambda parts=parts, typed=typed: merge_into(parts, typed), args.reps)
                torch_s = timed(lambda parts=parts, out=out: merge_rows(torch, parts, out), args.reps)
                join_s = timed(lambda parts=parts: concat_rows(parts), args.reps)
            print(f"| {count} | {what} | {numpy_s * 1e3:.2f} | {numpy_s / count * 1e6:.0f} "
                  f"| {torch_s * 1e3:.2f} | {torch_s / count * 1e6:.0f} "
                  f"| {join_s * 1e3:.2f} | {join_s / count * 1e6:.0f} |")
    # Any torch call gives up the GIL: what one costs beside a thread running Python (the per-batch
    # calls of a CUDA execution: slices and views of the pinned buffers, copies, replay, sync)
    buffer = torch.empty(1 << 20, dtype=torch.uint8)

    def calls() -> None:
        for _ in range(20):
            buffer[:4096].view(torch.float16).view(8, 256)

    print("\n| beside | us per torch call (slice, view, view) |")
    print("|---|---|")
    for what in ("nothing", "a busy thread"):
        with beside(what):
            per_call = timed(calls, args.reps * 5) / 60
        print(f"| {what} | {per_call * 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
