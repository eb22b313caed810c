"""Per-model-version statistics: what Triton's statistics extension reports, plus histograms.

Updated on the event-loop thread only (no locks); read by the statistics endpoints and by the
Prometheus collector at scrape time, so the request path pays a few integer additions.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections.abc import Sequence

from sluice.runtime.backends.base import Result
from sluice.runtime.batching import Observer
from sluice.runtime.callers import OTHER, UNKNOWN, CallerCounts
from sluice.runtime.errors import SluiceError
from sluice.runtime.types import InferRequest

QUEUE_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# End-to-end request time, 0.5 ms to 30 s on a 1-2-5 ladder: a quantile read from it (Prometheus'
# histogram_quantile, the canary analysis' p99) is off by at most the width of the bucket it falls in.
REQUEST_BUCKETS_S = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
)  # fmt: skip


class Duration:
    __slots__ = ("count", "ns")

    def __init__(self) -> None:
        self.count = 0
        self.ns = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns

    def as_dict(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


class Histogram:
    """Cumulative-at-read histogram with fixed upper bounds (Prometheus style)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, int]]:
        out = []
        running = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            out.append((repr(float(bound)), running))
        running += self.counts[-1]
        out.append(("+Inf", running))
        return out


@dataclasses.dataclass
class BatchStats:
    compute_infer: Duration = dataclasses.field(default_factory=Duration)


class ModelStats(Observer):
    """Triton-compatible counters for one model version (also the scheduler's observer)."""

    def __init__(self, name: str, version: str) -> None:
        self.name = name
        self.version = version
        self.success = Duration()
        self.fail = Duration()
        self.queue = Duration()
        self.compute_input = Duration()
        self.compute_infer = Duration()
        self.compute_output = Duration()
        self.cache_hit = Duration()
        self.cache_miss = Duration()
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ms = 0
        self.rejected_queue_full = 0
        self.rejected_timeout = 0
        self.cancelled = 0
        self.rejected_shed = 0
        self.server_fail = 0
        self.batch: dict[int, BatchStats] = {}
        self.queue_hist = Histogram(QUEUE_BUCKETS_S)
        self.compute_hist = Histogram(QUEUE_BUCKETS_S)
        self.batch_hist = Histogram(BATCH_BUCKETS)
        self.request_hist = Histogram(REQUEST_BUCKETS_S)
        # Per caller label (callers.py): ``unknown`` and ``other`` always, named callers while they
        # hold a label; the metrics collector drops the counts of labels no longer in use.
        self.unknown_caller = CallerCounts()
        self.callers: dict[str, CallerCounts] = {UNKNOWN: self.unknown_caller, OTHER: CallerCounts()}

    def caller_counts(self, label: str) -> CallerCounts:
        counts = self.callers.get(label)
        if counts is None:
            counts = self.callers[label] = CallerCounts()
        return counts

    def keep_callers(self, labels: frozenset[str]) -> None:
        """Forget the counts of caller labels not in ``labels`` (the metrics collector, at a scrape)."""
        for label in [label for label in self.callers if label not in labels]:
            del self.callers[label]

    # -- Observer ------------------------------------------------------------------------
    def on_rejected(self, reason: str) -> None:
        if reason == "queue_full":
            self.rejected_queue_full += 1
        elif reason == "timeout":
            self.rejected_timeout += 1
        elif reason == "cancelled":
            self.cancelled += 1
        elif reason == "shed":
            self.rejected_shed += 1

    def on_batch(
        self, requests: Sequence[InferRequest], queue_ns: Sequence[int], compute_ns: int, results: list[Result]
    ) -> None:
        rows = 0
        for request, waited in zip(requests, queue_ns, strict=True):
            rows += request.batch_size
            self.queue.add(waited)
            self.queue_hist.observe(waited / 1e9)
        self.execution_count += 1
        self.inference_count += rows
        self.compute_infer.add(compute_ns, len(requests))
        # Input merge and output split run inside the measured execution; Triton's clients
        # (perf_analyzer) require the three compute counts to agree.
        self.compute_input.add(0, len(requests))
        self.compute_output.add(0, len(requests))
        self.compute_hist.observe(compute_ns / 1e9)
        self.batch_hist.observe(rows)
        stats = self.batch.get(rows)
        if stats is None:
            stats = self.batch[rows] = BatchStats()
        stats.compute_infer.add(compute_ns)
        self.last_inference_ms = int(time.time() * 1000)

    # -- response cache (dataplane) ------------------------------------------------------
    def on_cache_hit(self, lookup_ns: int) -> None:
        """A hit counts as a success and in the queue, never as an inference or execution (Triton)."""
        self.success.add(lookup_ns)
        self.request_hist.observe(lookup_ns / 1e9)
        self.queue.add(0)
        self.cache_hit.add(lookup_ns)
        self.last_inference_ms = int(time.time() * 1000)

    def on_cache_miss(self, ns: int) -> None:
        self.cache_miss.add(ns)

    # -- request outcome (dataplane) -----------------------------------------------------
    def on_request(self, ns: int, error: SluiceError | None) -> None:
        """Every answered request, successful or not, lands in ``request_hist``. A failure is a server
        failure too when the server is to blame (5xx: the model failed, the queue was full or timed out),
        not when the client is (4xx: bad input, unknown version; 499: it went away)."""
        self.request_hist.observe(ns / 1e9)
        if error is None:
            self.success.add(ns)
        else:
            self.fail.add(ns)
            if error.http_status >= 500:
                self.server_fail += 1

    def as_triton(self) -> dict:
        return {
            "name": self.name,
            "version": self.version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": self.success.as_dict(),
                "fail": self.fail.as_dict(),
                "queue": self.queue.as_dict(),
                "compute_input": self.compute_input.as_dict(),
                "compute_infer": self.compute_infer.as_dict(),
                "compute_output": self.compute_output.as_dict(),
                "cache_hit": self.cache_hit.as_dict(),
                "cache_miss": self.cache_miss.as_dict(),
            },
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": {"count": s.compute_infer.count, "ns": 0},
                    "compute_infer": s.compute_infer.as_dict(),
                    "compute_output": {"count": s.compute_infer.count, "ns": 0},
                }
                for size, s in sorted(self.batch.items())
            ],
            "memory_usage": [],
        }
