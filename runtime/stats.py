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
    """Triton's ``InferBatchStatistics`` of one batch size: every count is the executions of that size."""

    compute_input: Duration = dataclasses.field(default_factory=Duration)
    compute_infer: Duration = dataclasses.field(default_factory=Duration)
    compute_output: Duration = dataclasses.field(default_factory=Duration)


RESPONSE_SUCCESS, RESPONSE_FAIL, RESPONSE_EMPTY, RESPONSE_CANCEL = "success", "fail", "empty_response", "cancel"


@dataclasses.dataclass
class ResponseStats:
    """Triton's ``InferResponseStatistics``: the responses of a decoupled model at one index (the
    first response of each request at "0", the second at "1", ...)."""

    compute_infer: Duration = dataclasses.field(default_factory=Duration)
    compute_output: Duration = dataclasses.field(default_factory=Duration)
    success: Duration = dataclasses.field(default_factory=Duration)
    fail: Duration = dataclasses.field(default_factory=Duration)
    empty_response: Duration = dataclasses.field(default_factory=Duration)
    cancel: Duration = dataclasses.field(default_factory=Duration)

    def add(self, kind: str, ns: int) -> None:
        """One response of ``kind`` that took ``ns`` since the request's previous response (or its
        arrival, for the first), as Triton's ``UpdateResponse*`` count them: the whole interval is
        compute_infer (the model's output extraction is not timed apart: compute_output gets 0 ns)."""
        if kind == RESPONSE_CANCEL:
            self.cancel.add(ns)
            return
        self.compute_infer.add(ns)
        if kind == RESPONSE_SUCCESS:
            self.compute_output.add(0)
            self.success.add(ns)
        elif kind == RESPONSE_FAIL:
            self.fail.add(ns)
        else:
            self.empty_response.add(ns)

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {field.name: getattr(self, field.name).as_dict() for field in dataclasses.fields(self)}


def split_compute(compute_ns: int, phases_ns: tuple[int, int]) -> tuple[int, int, int]:
    """(compute_input, compute_infer, compute_output) ns of one execution that took ``compute_ns`` in
    all, of which the backend measured ``phases_ns`` (input preparation, output extraction); pure.
    The phases are capped so the three add up to ``compute_ns`` (the clocks may differ: a test's
    manual clock does not move while the backend's does)."""
    input_ns = min(max(phases_ns[0], 0), compute_ns)
    output_ns = min(max(phases_ns[1], 0), compute_ns - input_ns)
    return input_ns, compute_ns - input_ns - output_ns, output_ns


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
        self.responses: dict[int, ResponseStats] = {}
        """Decoupled models' responses by index (Triton's ``response_stats``)."""
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
        self,
        requests: Sequence[InferRequest],
        queue_ns: Sequence[int],
        compute_ns: int,
        results: list[Result],
        phases_ns: tuple[int, int] = (0, 0),
    ) -> None:
        """One execution. As Triton counts: the queue and compute durations and ``inference_count``
        cover the requests that succeeded, each request adding the whole execution's compute time
        (so ``compute_infer.ns / count`` is the mean execution time a request saw); ``batch_stats``
        and ``execution_count`` count the execution once, under its rows."""
        input_ns, infer_ns, output_ns = split_compute(compute_ns, phases_ns)
        rows = 0
        succeeded = 0
        for request, waited, result in zip(requests, queue_ns, results, strict=True):
            rows += request.batch_size
            self.queue_hist.observe(waited / 1e9)
            if isinstance(result, SluiceError):
                continue
            succeeded += 1
            self.inference_count += request.batch_size
            self.queue.add(waited)
        if not succeeded:  # as Triton's backends report: an execution whose every request failed is
            return  # no execution in the statistics (``execution_count`` counts successful ones)
        self.execution_count += 1
        self.compute_input.add(input_ns * succeeded, succeeded)
        self.compute_infer.add(infer_ns * succeeded, succeeded)
        self.compute_output.add(output_ns * succeeded, succeeded)
        self.compute_hist.observe(compute_ns / 1e9)
        self.batch_hist.observe(rows)
        stats = self.batch.get(rows)
        if stats is None:
            stats = self.batch[rows] = BatchStats()
        stats.compute_input.add(input_ns)
        stats.compute_infer.add(infer_ns)
        stats.compute_output.add(output_ns)
        self.last_inference_ms = int(time.time() * 1000)

    def on_response(self, index: int, kind: str, ns: int) -> None:
        """A decoupled model's response number ``index`` of a request (dataplane, on the loop)."""
        stats = self.responses.get(index)
        if stats is None:
            stats = self.responses[index] = ResponseStats()
        stats.add(kind, ns)

    # -- response cache (dataplane) ------------------------------------------------------
    def on_cache_hit(self, lookup_ns: int) -> None:
        """A hit counts as a success and in the queue, never as an inference or execution, and does not
        move ``last_inference``, which follows executions (Triton)."""
        self.success.add(lookup_ns)
        self.request_hist.observe(lookup_ns / 1e9)
        self.queue.add(0)
        self.cache_hit.add(lookup_ns)

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
            if error.server_fault:
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
                    "compute_input": s.compute_input.as_dict(),
                    "compute_infer": s.compute_infer.as_dict(),
                    "compute_output": s.compute_output.as_dict(),
                }
                for size, s in sorted(self.batch.items())
            ],
            # Triton fills this from backends that report what they allocated (TensorRT, ONNX Runtime
            # on GPU); Sluice's backends do not measure it.
            "memory_usage": [],
            "response_stats": {str(index): r.as_dict() for index, r in sorted(self.responses.items())},
        }
