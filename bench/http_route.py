"""CPU time of the HTTP infer route alone: routing, decode, hand-off and encode, in-process.

    python -P bench/http_route.py [--repeat 15] [--n 20000]

``V2Routes`` with a data plane that answers at once (a fixed 1x16 FP32 output), fed the request
the c64 benchmark sends (1x256 FP32 in the binary extension, output asked for in binary): no
sockets, no model, no client, so a change in the request path shows up even on a loaded machine
where end-to-end throughput varies by tens of percent. Prints the best of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import numpy as np

from sluice.runtime.protocol import http
from sluice.runtime.settings import Limits
from sluice.runtime.types import InferRequest, InferResponse, Tensor


class _DataPlane:
    def infer_nowait(self, request: InferRequest, done: Any) -> None:
        done(InferResponse("mlp", "1", [Tensor("OUTPUT0", "FP32", np.zeros((1, 16), np.float32))]))


class _Conn:
    inflight = None

    def complete(self, request: http.Request, response: http.Response) -> None:
        self.last = response


async def main(repeat: int, n: int) -> None:
    routes = http.V2Routes(_DataPlane(), Limits())  # type: ignore[arg-type]
    head = json.dumps(
        {
            "inputs": [
                {"name": "INPUT0", "datatype": "FP32", "shape": [1, 256], "parameters": {"binary_data_size": 1024}}
            ],
            "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
        }
    ).encode()
    body = head + np.zeros(256, np.float32).tobytes()
    headers = {b"inference-header-content-length": b"%d" % len(head), b"content-length": b"%d" % len(body)}
    conn = _Conn()

    def one() -> None:
        routes(http.Request(conn, b"POST", b"/v2/models/mlp/infer", headers, body))  # type: ignore[arg-type]

    for _ in range(2000):
        one()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(n):
            one()
        best = min(best, (time.perf_counter() - start) / n * 1e6)
    print(f"HTTP infer route: {best:.2f} us per request (best of {repeat} x {n})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--n", type=int, default=20000)
    args = parser.parse_args()
    asyncio.run(main(args.repeat, args.n))
