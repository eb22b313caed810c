"""The canary analysis' numbers as arithmetic: PromQL to ask, and what to make of the answers.

Pure: no I/O. ``sources`` (the I/O side) sends :func:`promql`'s queries to Prometheus and hands the
answers to :func:`from_vectors`, or scrapes the runtime pods itself (:func:`parse_exposition` per
pod, a :class:`Scrape` per track) and hands its history to :func:`over_window`, which picks the
baseline and subtracts (:func:`delta`, reset-aware as ``increase()``). Either way the result is one
``canary.VersionMetrics`` per track (stable, canary) for ``canary.judge``.

What a version is judged on (docs/metrics.md, "What counts as an error for a canary"):

    requests  every answered request: ``sluice_request_duration_seconds_count``
    errors    answers the server is to blame for (5xx): ``sluice_request_server_failure_total``
    p99_ms    the 0.99 quantile of ``sluice_request_duration_seconds``, interpolated within its
              bucket as Prometheus' ``histogram_quantile`` does

Missing data stays missing: no requests series is ``None`` (no metrics), a NaN stays NaN, and an
empty latency histogram is a NaN p99; ``canary.judge`` makes all of them Inconclusive, never a pass.
An absent error series with a present requests series is 0 errors.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from sluice.operator.canary import Target, VersionMetrics

REQUESTS = "sluice_request_duration_seconds_count"
ERRORS = "sluice_request_server_failure_total"
LATENCY = "sluice_request_duration_seconds"
INSTANCE_LABEL = "app_kubernetes_io_instance"
"""The series label a PodMonitor's ``podTargetLabels: [app.kubernetes.io/instance]`` produces."""

CANARY, STABLE = "canary", "stable"
TRACKS = (CANARY, STABLE)

INF = math.inf
Buckets = tuple[tuple[float, float], ...]
"""A cumulative histogram: (upper bound, observations at or below it), ascending, ``+Inf`` last."""


# -- Prometheus ------------------------------------------------------------------------------------

def promql(target: Target) -> dict[str, str]:
    """The queries per track, keyed ``<track>_<quantity>`` (``canary_requests`` .. ``stable_p99``);
    each answers one sample over the last ``target.window_s``. p99 is in seconds."""
    window = _duration(target.window_s)
    queries = {}
    for track, instance in ((CANARY, target.canary_instance), (STABLE, target.stable_instance)):
        selector = _selector(namespace=target.namespace, **{INSTANCE_LABEL: instance}, model=target.model)
        queries[f"{track}_requests"] = f"sum(increase({REQUESTS}{selector}[{window}]))"
        queries[f"{track}_errors"] = f"sum(increase({ERRORS}{selector}[{window}]))"
        queries[f"{track}_p99"] = (
            f"histogram_quantile(0.99, sum by (le) (rate({LATENCY}_bucket{selector}[{window}])))"
        )
    return queries


def from_vectors(
    results: Mapping[str, Sequence[Mapping[str, Any]] | None],
) -> tuple[VersionMetrics | None, VersionMetrics | None]:
    """(canary, stable) from the ``data.result`` of each :func:`promql` query (an instant vector:
    ``[{"metric": {...}, "value": [time, "1.5"]}]``); a key that is absent or ``None`` could not be
    read. A track whose requests could not be read, or came back empty, is ``None``."""
    canary, stable = (
        version_metrics(
            results.get(f"{track}_requests"),
            results.get(f"{track}_errors"),
            results.get(f"{track}_p99"),
        )
        for track in TRACKS
    )
    return canary, stable


def version_metrics(
    requests: Sequence[Mapping[str, Any]] | None,
    errors: Sequence[Mapping[str, Any]] | None,
    p99_s: Sequence[Mapping[str, Any]] | None,
) -> VersionMetrics | None:
    """One track's metrics from its three vectors (``None``: the query failed). No requests sample
    is no metrics; no errors sample beside a requests sample is 0 errors, a failed errors query is
    NaN errors; no p99 sample is ``None``."""
    count = _value(requests)
    if count is None:
        return None
    failed = math.nan if errors is None else (_value(errors) or 0.0)
    p99 = _value(p99_s, max)
    return VersionMetrics(requests=count, errors=failed, p99_ms=None if p99 is None else p99 * 1000)


def _value(
    vector: Sequence[Mapping[str, Any]] | None, combine: Callable[[list[float]], float] = sum
) -> float | None:
    """The vector's sample value (several samples: combined), ``None`` for an empty or missing vector.
    Prometheus writes values as strings: ``"NaN"`` and ``"+Inf"`` parse as such."""
    if not vector:
        return None
    values = [float(sample["value"][1]) for sample in vector]
    return float(combine(values))


def _selector(**labels: str) -> str:
    def quoted(value: str) -> str:
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'

    return "{" + ",".join(f"{name}={quoted(value)}" for name, value in labels.items()) + "}"


def _duration(seconds: float) -> str:
    """A PromQL range: whole seconds as ``60s``, anything finer in milliseconds."""
    millis = max(1, round(seconds * 1000))
    return f"{millis // 1000}s" if millis % 1000 == 0 else f"{millis}ms"


# -- scraping the pods ourselves -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Counts:
    """Cumulative counters of one model, in one pod (a scrape) or summed over a track (a delta)."""

    requests: float
    errors: float
    buckets: Buckets


Snapshot = Mapping[str, Counts]
"""One track at one time: pod (name or uid) -> its counters. A pod without the model is left out."""


def parse_exposition(text: str, model: str) -> Counts | None:
    """The counters of ``model`` (every version summed) in one pod's ``/metrics`` text; ``None``
    when the pod does not export it (not loaded, or another model's pod)."""
    requests = errors = 0.0
    buckets: dict[float, float] = {}
    seen = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model") != model:
                continue
            if sample.name == REQUESTS:
                requests += sample.value
                seen = True
            elif sample.name == ERRORS:
                errors += sample.value
            elif sample.name == LATENCY + "_bucket":
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
    if not seen:
        return None
    return Counts(requests, errors, tuple(sorted(buckets.items())))


def delta(before: Snapshot, after: Snapshot) -> Counts | None:
    """What a track served between two snapshots, summed over its pods; ``None`` when ``after``
    holds no pod. As Prometheus' ``increase()``: a pod whose counters went down restarted and counts
    from zero, so does a pod that appeared; a pod that vanished drops out (its last counts are lost)."""
    if not after:
        return None
    parts = []
    for pod, now in after.items():
        then = before.get(pod)
        parts.append(now if then is None or _was_reset(then, now) else _minus(now, then))
    return _sum(parts)


@dataclasses.dataclass(frozen=True)
class Scrape:
    """One track as the scraper saw it at ``at`` (the caller's clock)."""

    at: float
    pods: Snapshot
    unread: frozenset[str] = frozenset()
    """Running pods whose ``/metrics`` could not be read: they existed, their counters are unknown."""


def over_window(history: Sequence[Scrape], window_s: float) -> tuple[Counts | None, float]:
    """What a track served from the scrape nearest to ``window_s`` before the last one up to the last
    one, and the seconds that covers (shorter than the window when the history is). ``(None, 0)``
    without an earlier scrape; ``None`` counts when no pod of the last scrape can be counted.

    A pod takes its counters in that earlier scrape as its baseline. One that could not be read then
    takes its first reading after it (as ``increase()`` starts at a series' first sample), and drops
    out when it has none; one that did not run then counts from zero (:func:`delta`)."""
    if len(history) < 2:
        return None, 0.0
    last = history[-1]
    earlier = history[:-1]
    start = min(range(len(earlier)), key=lambda i: abs(earlier[i].at - (last.at - window_s)))
    base = earlier[start]
    before: dict[str, Counts] = dict(base.pods)
    after: dict[str, Counts] = dict(last.pods)
    for pod in base.unread & after.keys():
        later = next((scrape.pods[pod] for scrape in earlier[start + 1:] if pod in scrape.pods), None)
        if later is None:
            del after[pod]
        else:
            before[pod] = later
    return delta(before, after), last.at - base.at


def scraped(before: Snapshot, after: Snapshot) -> VersionMetrics | None:
    """A track's metrics over the time between two snapshots; ``None`` when ``after`` is empty."""
    return metrics_of(delta(before, after))


def metrics_of(counts: Counts | None) -> VersionMetrics | None:
    """``VersionMetrics`` of a delta, p99 from its histogram (NaN without observations)."""
    if counts is None:
        return None
    p99 = quantile(0.99, counts.buckets)
    return VersionMetrics(requests=counts.requests, errors=counts.errors, p99_ms=p99 * 1000)


def quantile(q: float, buckets: Buckets) -> float:
    """``histogram_quantile(q, ...)`` over one cumulative histogram, as Prometheus computes it: linear
    interpolation within the bucket the rank falls in (from 0 in the first, when its bound is positive);
    a rank in the ``+Inf`` bucket answers the highest finite bound. NaN without observations, without
    an ``+Inf`` bucket or with fewer than two buckets."""
    if math.isnan(q):
        return math.nan
    if q < 0:
        return -INF
    if q > 1:
        return INF
    if len(buckets) < 2 or buckets[-1][0] != INF:
        return math.nan
    bounds = [le for le, _ in buckets]
    counts = list(_monotonic(count for _, count in buckets))
    total = counts[-1]
    if total == 0 or math.isnan(total):
        return math.nan
    rank = q * total
    b = next(i for i, count in enumerate(counts) if count >= rank)
    if b == len(buckets) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start, end, count = 0.0, bounds[b], counts[b]
    if b > 0:
        start = bounds[b - 1]
        count -= counts[b - 1]
        rank -= counts[b - 1]
    return start + (end - start) * (rank / count)


def _monotonic(counts: Iterable[float]) -> Iterable[float]:
    """Cumulative counts made non-decreasing (Prometheus does the same for buckets scraped apart)."""
    highest = 0.0
    for count in counts:
        highest = max(highest, count)
        yield highest


def _was_reset(then: Counts, now: Counts) -> bool:
    """A pod restarted between the two scrapes when any of its counters went down."""
    if now.requests < then.requests or now.errors < then.errors:
        return True
    earlier = dict(then.buckets)
    return any(count < earlier.get(le, 0.0) for le, count in now.buckets)


def _minus(now: Counts, then: Counts) -> Counts:
    earlier = dict(then.buckets)
    return Counts(
        requests=now.requests - then.requests,
        errors=now.errors - then.errors,
        buckets=tuple((le, count - earlier.get(le, 0.0)) for le, count in now.buckets),
    )


def _sum(parts: Sequence[Counts]) -> Counts:
    buckets: dict[float, float] = {}
    for part in parts:
        for le, count in part.buckets:
            buckets[le] = buckets.get(le, 0.0) + count
    return Counts(
        requests=sum(part.requests for part in parts),
        errors=sum(part.errors for part in parts),
        buckets=tuple(sorted(buckets.items())),
    )
