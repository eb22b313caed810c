"""Prometheus metrics: a collector that reads the per-model statistics at scrape time.

Nothing is counted twice and the request path never touches prometheus-client: the collector
turns ``ModelStats`` (which the statistics endpoints also report) into metric families when
Prometheus scrapes, and the forwarding collector does the same for the no-mesh canary split
(forwarding.py's counts and split table). The caller collector reports the per-caller counts of
each model version under the labels callers.py's ``CallerLabels`` chooses, re-ranking them at each
scrape. The registry is an object owned by the server, never the global one.
Names and their Triton equivalents are listed in docs/metrics.md.

GPU and MIG families (Triton's ``nv_gpu_*`` and ``nv_energy_consumption``, Sluice's
``sluice_gpu_*`` / ``sluice_mig_*``) come from gpu_telemetry.py's last NVML reading, written with
their names exactly as given, like the Python models' families below.

Python models' own families (``pb_utils.MetricFamily``, docs/python-backend.md) follow Sluice's,
written by :func:`custom_metrics_text` from the backends' ``MetricRegistry``: their names are
exported exactly as the model gave them (a counter keeps its name, with no ``_total`` added), as
Triton exports them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from sluice.runtime.callers import REASONS, CallerLabels
from sluice.runtime.forwarding import Forwarder
from sluice.runtime.gpu_telemetry import GpuTelemetry
from sluice.runtime.repository import ModelVersion, Repository
from sluice.runtime.snapshot import PollCounts

LABELS = ["model", "version"]


class ModelCollector(Collector):
    def __init__(self, versions: Callable[[], Iterable[ModelVersion]]) -> None:
        self._versions = versions

    def collect(self) -> Iterator[Metric]:
        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=LABELS)

        success = counter(
            "sluice_request_success", "Requests answered successfully (Triton: nv_inference_request_success)"
        )
        failure = counter("sluice_request_failure", "Requests answered with an error (nv_inference_request_failure)")
        server_failure = counter(
            "sluice_request_server_failure",
            "Requests answered with a server-side error (HTTP 5xx: model failure, queue full or timed out); "
            "a subset of sluice_request_failure, what the canary analysis counts as errors",
        )
        inferences = counter("sluice_inference_count", "Inferences performed, batch rows (nv_inference_count)")
        executions = counter("sluice_execution_count", "Model executions, batches (nv_inference_exec_count)")
        queue_us = counter("sluice_queue_duration_us", "Cumulative time requests waited in the queue, us")
        compute_us = counter("sluice_compute_infer_duration_us", "Cumulative model execution time, us")
        request_us = counter("sluice_request_duration_us", "Cumulative end-to-end request time, us")
        rejected = CounterMetricFamily(
            "sluice_rejected", "Requests refused before execution, by reason", labels=[*LABELS, "reason"]
        )
        cache_hits = counter("sluice_cache_hit_count", "Response cache hits (nv_cache_num_hits_per_model)")
        cache_misses = counter("sluice_cache_miss_count", "Response cache misses (nv_cache_num_misses_per_model)")
        depth = GaugeMetricFamily(
            "sluice_queue_depth",
            "Requests waiting in the queue now (nv_inference_pending_request_count)",
            labels=LABELS,
        )
        in_flight = GaugeMetricFamily("sluice_inflight_requests", "Requests queued or executing now", labels=LABELS)
        queue_hist = HistogramMetricFamily("sluice_queue_duration_seconds", "Time each request waited", labels=LABELS)
        compute_hist = HistogramMetricFamily("sluice_compute_duration_seconds", "Time of each execution", labels=LABELS)
        batch_hist = HistogramMetricFamily("sluice_batch_size", "Rows per model execution", labels=LABELS)
        request_hist = HistogramMetricFamily(
            "sluice_request_duration_seconds",
            "End-to-end time of each answered request, errors included",
            labels=LABELS,
        )
        for mv in self._versions():
            s = mv.stats
            labels = [mv.name, str(mv.version)]
            success.add_metric(labels, s.success.count)
            failure.add_metric(labels, s.fail.count)
            server_failure.add_metric(labels, s.server_fail)
            inferences.add_metric(labels, s.inference_count)
            executions.add_metric(labels, s.execution_count)
            queue_us.add_metric(labels, s.queue.ns / 1000)
            compute_us.add_metric(labels, s.compute_infer.ns / 1000)
            request_us.add_metric(labels, (s.success.ns + s.fail.ns) / 1000)
            rejected.add_metric([*labels, "queue_full"], s.rejected_queue_full)
            rejected.add_metric([*labels, "timeout"], s.rejected_timeout)
            rejected.add_metric([*labels, "cancelled"], s.cancelled)
            rejected.add_metric([*labels, "shed"], s.rejected_shed)
            cache_hits.add_metric(labels, s.cache_hit.count)
            cache_misses.add_metric(labels, s.cache_miss.count)
            depth.add_metric(labels, mv.scheduler.queue_depth)
            in_flight.add_metric(labels, mv.scheduler.in_flight)
            queue_hist.add_metric(labels, s.queue_hist.buckets(), s.queue_hist.sum)
            compute_hist.add_metric(labels, s.compute_hist.buckets(), s.compute_hist.sum)
            batch_hist.add_metric(labels, s.batch_hist.buckets(), s.batch_hist.sum)
            request_hist.add_metric(labels, s.request_hist.buckets(), s.request_hist.sum)
        yield from (
            success,
            failure,
            server_failure,
            inferences,
            executions,
            queue_us,
            compute_us,
            request_us,
            rejected,
            cache_hits,
            cache_misses,
            depth,
            in_flight,
            queue_hist,
            compute_hist,
            batch_hist,
            request_hist,
        )


class ForwardingCollector(Collector):
    """The canary split this server applies (``--split-file``) and the requests it forwarded."""

    def __init__(self, forwarder: Forwarder) -> None:
        self._forwarder = forwarder

    def collect(self) -> Iterator[Metric]:
        percent = GaugeMetricFamily(
            "sluice_split_percent",
            "Percent of a model's requests without an explicit version forwarded to its canary (--split-file)",
            labels=["model", "target"],
        )
        for model, split in sorted(self._forwarder.table.models.items()):
            percent.add_metric([model, split.target], split.percent)
        forwarded = CounterMetricFamily(
            "sluice_forwarded_requests",
            "Requests forwarded to a model's canary, by outcome (success, failure: not counted in this server's "
            "model statistics; fallback: the canary could not be reached, served here and counted here)",
            labels=["model", "target", "outcome"],
        )
        for (model, target), (success, failure, fallback) in sorted(self._forwarder.counts.by_route.items()):
            forwarded.add_metric([model, target, "success"], success)
            forwarded.add_metric([model, target, "failure"], failure)
            forwarded.add_metric([model, target, "fallback"], fallback)
        yield from (percent, forwarded)


class CallerCollector(Collector):
    """Per model version and caller label: requests, rejections by reason, cache hits, duplicates.
    Each scrape first re-ranks the labels (the busiest callers keep or get theirs) and drops the
    counts of labels no longer in use, so the series stay bounded by ``--caller-label-limit``."""

    def __init__(self, versions: Callable[[], Iterable[ModelVersion]], labels: CallerLabels) -> None:
        self._versions = versions
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        names = [*LABELS, "caller"]
        success = CounterMetricFamily(
            "sluice_caller_request_success", "Requests answered successfully, per caller", labels=names
        )
        failure = CounterMetricFamily(
            "sluice_caller_request_failure", "Requests answered with an error, per caller", labels=names
        )
        rejected = CounterMetricFamily(
            "sluice_caller_rejected",
            "Requests refused without running, per caller and reason (queue_full, timeout, shed, cancelled, "
            "bad_request)",
            labels=[*names, "reason"],
        )
        cache_hits = CounterMetricFamily(
            "sluice_caller_cache_hit_count", "Response cache hits, per caller", labels=names
        )
        duplicates = CounterMetricFamily(
            "sluice_caller_duplicate_request",
            "Requests with the same inputs as one the same caller sent within --duplicate-window-s",
            labels=names,
        )
        active = self._labels.rerank()
        for mv in self._versions():
            stats = mv.stats
            stats.keep_callers(active)
            for caller, counts in sorted(stats.callers.items()):
                labels = [mv.name, str(mv.version), caller]
                success.add_metric(labels, counts.success)
                failure.add_metric(labels, counts.failure)
                for reason in REASONS:
                    rejected.add_metric([*labels, reason], counts.rejected.get(reason, 0))
                cache_hits.add_metric(labels, counts.cache_hits)
                duplicates.add_metric(labels, counts.duplicates)
        yield from (success, failure, rejected, cache_hits, duplicates)


class RepositoryCollector(Collector):
    """Loads and reloads: failures per model, each model's load state, and repository polls."""

    STATES = ("READY", "LOADING", "UNLOADING", "UNAVAILABLE", "STALE")

    def __init__(self, repository: Repository, polls: PollCounts | None) -> None:
        self._repository = repository
        self._polls = polls

    def collect(self) -> Iterator[Metric]:
        failures = CounterMetricFamily(
            "sluice_model_load_failures",
            "Failed loads and reloads of a model since start (a failed reload leaves the older versions serving)",
            labels=["model"],
        )
        for model, count in sorted(self._repository.load_failures.items()):
            failures.add_metric([model], count)
        state = GaugeMetricFamily(
            "sluice_model_load_state",
            "1 for the load state a model is in: READY, LOADING, UNAVAILABLE, or STALE (its last reload "
            "failed and older versions serve)",
            labels=["model", "state"],
        )
        for model, now in sorted(self._repository.load_states().items()):
            for name in self.STATES:
                state.add_metric([model, name], 1.0 if now == name else 0.0)
        yield from (failures, state)
        if self._polls is not None:
            polls = CounterMetricFamily("sluice_repository_polls", "Model repository polls (--model-control-mode poll)")
            polls.add_metric([], self._polls.polls)
            poll_failures = CounterMetricFamily(
                "sluice_repository_poll_failures",
                "Polls that could not read the model repository (a cloud store unreachable); the loaded models "
                "went on serving",
            )
            poll_failures.add_metric([], self._polls.failures)
            yield from (polls, poll_failures)


class ProtocolWorkerCollector(Collector):
    """The protocol worker processes (``--protocol-workers``): how many were asked for, how many accept
    and decode requests now, and how often one had to be restarted (a worker that keeps dying shows as
    a rising count, which the log alone would hide from an alert)."""

    def __init__(self, counts: Callable[[], tuple[int, int, int]]) -> None:
        self._counts = counts  # () -> (configured, serving, restarts)

    def collect(self) -> Iterator[Metric]:
        configured, serving, restarts = self._counts()
        wanted = GaugeMetricFamily(
            "sluice_protocol_workers", "Protocol worker processes asked for (--protocol-workers)"
        )
        wanted.add_metric([], configured)
        up = GaugeMetricFamily(
            "sluice_protocol_workers_serving", "Protocol worker processes accepting and decoding requests now"
        )
        up.add_metric([], serving)
        restarted = CounterMetricFamily(
            "sluice_protocol_worker_restarts", "Protocol worker processes restarted after one exited unasked"
        )
        restarted.add_metric([], restarts)
        yield from (wanted, up, restarted)


class Metrics:
    """The server's registry and its exposition."""

    def __init__(
        self,
        versions: Callable[[], Iterable[ModelVersion]],
        forwarder: Forwarder | None = None,
        caller_labels: CallerLabels | None = None,
        model_metrics: Any = None,
        *,
        repository: Repository | None = None,
        polls: PollCounts | None = None,
        gpu: GpuTelemetry | None = None,
    ) -> None:
        self._model_metrics = model_metrics  # triton_python_backend_utils.MetricRegistry, or None
        self._repository = repository
        self._gpu = gpu
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ModelCollector(versions))
        if repository is not None:
            self.registry.register(RepositoryCollector(repository, polls))
        if forwarder is not None:
            self.registry.register(ForwardingCollector(forwarder))
        if caller_labels is not None:
            self.registry.register(CallerCollector(versions, caller_labels))

    def exposition(self) -> bytes:
        text = generate_latest(self.registry)
        if self._gpu is not None:
            instances = self._repository.gpu_instances() if self._repository is not None else ()
            gpu_families = self._gpu.families(instances)
            text += custom_metrics_text((f.name, f.description, f.kind, list(f.samples)) for f in gpu_families)
        if self._model_metrics is not None:
            text += custom_metrics_text(self._model_metrics.snapshot())
        return text


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    text = ",".join(f'{key}="{_escape(value)}"' for key, value in pairs)
    return "{" + text + "}" if text else ""


def custom_metrics_text(families: Iterable[tuple[str, str, str, list[Any]]]) -> bytes:
    """Prometheus text format (0.0.4) of Python models' metric families: ``(name, description,
    kind, series)`` as ``MetricRegistry.snapshot`` gives them. Pure."""
    lines: list[str] = []
    for name, description, kind, series in families:
        lines.append(f"# HELP {name} {description.replace(chr(92), chr(92) * 2).replace(chr(10), chr(92) + 'n')}")
        lines.append(f"# TYPE {name} {kind}")
        for state in series:
            if kind != "histogram":
                lines.append(f"{name}{_labels(state.labels)} {floatToGoString(state.value)}")
                continue
            for bound, count in zip(state.buckets or (), state.bucket_counts, strict=True):
                le = (*state.labels, ("le", floatToGoString(bound)))
                lines.append(f"{name}_bucket{_labels(le)} {floatToGoString(count)}")
            lines.append(f"{name}_bucket{_labels((*state.labels, ('le', '+Inf')))} {floatToGoString(state.count)}")
            lines.append(f"{name}_sum{_labels(state.labels)} {floatToGoString(state.sum)}")
            lines.append(f"{name}_count{_labels(state.labels)} {floatToGoString(state.count)}")
    return "".join(line + "\n" for line in lines).encode()
