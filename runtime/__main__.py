"""Command line: ``sluice serve --model-repository DIR`` (also ``python -m sluice.runtime serve``),
``sluice pull SOURCE DESTINATION`` (the model puller the operator runs as an init container) and
``sluice tune --model-repository DIR --model NAME`` (batching settings search, runtime/tune.py).

Settings are parsed here, once, into ``ServerSettings`` and passed down; nothing else reads
the command line or the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import math
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice.runtime import __version__
from sluice.runtime.batching import BATCH_POLICIES
from sluice.runtime.pull import PullSettings
from sluice.runtime.settings import (
    GRPC_SERVERS,
    MODEL_CONTROL_MODES,
    GpuMetricsSettings,
    Limits,
    LogSettings,
    MallocTuning,
    SchedulingDefaults,
    ServerSettings,
)
from sluice.runtime.tracing import TraceConfigError, parse_trace_config

if TYPE_CHECKING:
    from sluice.runtime.tune import TuneSettings


def _bool(value: str) -> bool:
    lowered = value.lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{value!r} is not a boolean; allowed: true, false")


def _finite(value: str) -> float:
    """A float flag: nan and inf are refused (a nan deadline never passes; an inf one overflows)."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number; allowed: a finite number") from None
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"{value!r} is not finite; allowed: a finite number")
    return number


def _non_negative(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    def parse(value: str) -> int | float:
        try:
            number = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a number; allowed: {kind.__name__} >= 0") from None
        if not math.isfinite(number):
            raise argparse.ArgumentTypeError(f"{value!r} is not finite; allowed: {kind.__name__} >= 0")
        if number < 0:
            raise argparse.ArgumentTypeError(f"{value!r} is negative; allowed: {kind.__name__} >= 0")
        return number

    return parse


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every flag's default, except for required flags (which have none)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required:
            return action.help
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="Sluice inference server")
    parser.add_argument("--version", action="version", version=f"sluice {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve a Triton-style model repository over KServe V2 HTTP and gRPC",
        description="Serve a Triton-style model repository over KServe V2 HTTP and gRPC.",
        formatter_class=_HelpFormatter,
    )
    defaults = ServerSettings(model_repository=Path())
    serve.add_argument(
        "--model-repository",
        required=True,
        help="directory of <model>/config.pbtxt, or a cloud repository: s3://bucket/prefix, gs://bucket/prefix, "
        "az://container/prefix (mirrored into the cache directory below; credentials from the storage "
        "libraries' standard chains)",
    )
    serve.add_argument(
        "--model-repository-cache-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "sluice-model-repository",
        metavar="DIR",
        help="where a cloud model repository is mirrored (one subdirectory per repository URL)",
    )
    serve.add_argument(
        "--model-control-mode",
        choices=MODEL_CONTROL_MODES,
        default=defaults.model_control_mode,
        help="Triton's: none loads the models at start and refuses the repository load/unload API; poll also "
        "rescans the repository at the poll interval (added, changed and removed models and versions); "
        "explicit loads only the models named to load at start and allows the load/unload API",
    )
    serve.add_argument(
        "--load-model",
        action="append",
        default=[],
        metavar="NAME",
        help="explicit mode: load this model at start (repeatable; '*' loads every model)",
    )
    serve.add_argument(
        "--repository-poll-secs",
        type=_finite,
        default=defaults.repository_poll_s,
        help="poll mode: seconds between two scans of the model repository",
    )
    serve.add_argument("--host", default=defaults.host, help="address to listen on (0.0.0.0 for all)")
    serve.add_argument(
        "--metrics-host",
        default=None,
        help="address of the metrics listener (which also answers /v2/health/live and /v2/health/ready, for "
        "probes); None: the address HTTP and gRPC listen on",
    )
    ports = (
        ("http", "HTTP", defaults.http_port),
        ("grpc", "gRPC", defaults.grpc_port),
        ("metrics", "Prometheus metrics", defaults.metrics_port),
    )
    for flag, what, default in ports:
        serve.add_argument(
            f"--{flag}-port", type=int, default=default, help=f"{what} port; 0 picks a free one, -1 disables"
        )
    gpu = GpuMetricsSettings()
    serve.add_argument(
        "--allow-gpu-metrics",
        type=_bool,
        default=gpu.enabled,
        metavar="{true,false}",
        help="Triton's flag: export GPU and MIG telemetry read from NVML (the 'gpu' extra's nvidia-ml-py and the "
        "driver's libnvidia-ml); without them or without a GPU there are no GPU families (one log line says why)",
    )
    serve.add_argument(
        "--metrics-interval-ms",
        type=_positive(int),
        default=gpu.interval_ms,
        help="Triton's flag: how often NVML is read (on a background thread); a scrape reports the last reading",
    )
    for flag, what in (("http", "HTTP"), ("grpc", "gRPC")):
        serve.add_argument(
            f"--{flag}-uds",
            type=Path,
            default=None,
            metavar="PATH",
            help=f"also serve {what} on this Unix domain socket (mode 0660; a stale socket file is replaced, "
            "removed on stop); with that protocol's port -1, only there",
        )
    serve.add_argument("--model", action="append", default=[], help="load only this model (repeatable); default: all")
    serve.add_argument(
        "--disable-auto-complete-config",
        action="store_true",
        help="do not let Python models' auto_complete_config complete their configs (Triton's flag)",
    )
    serve.add_argument(
        "--strict-model-config",
        type=_bool,
        default=False,
        metavar="{true,false}",
        help="Triton's older flag: true turns Python models' auto_complete_config off (as the flag above does), "
        "false lets it run",
    )
    serve.add_argument(
        "--strict-readiness",
        type=_bool,
        default=defaults.strict_readiness,
        metavar="{true,false}",
        help="ready only when every model asked for (or found at start) is ready; false: ready once startup "
        "loads are done",
    )
    serve.add_argument(
        "--drain-period-s",
        type=_finite,
        default=defaults.drain_period_s,
        help="on SIGTERM, report not-ready but keep serving this long before closing the listeners (Ctrl-C and a "
        "second signal skip it)",
    )
    serve.add_argument(
        "--shutdown-grace-s",
        type=_finite,
        default=defaults.shutdown_grace_s,
        help="time in-flight requests get to finish once the listeners are closed",
    )
    serve.add_argument(
        "--server-name",
        default=defaults.server_name,
        help="name reported in the server metadata (GET /v2); 'triton' for tools that check for Triton",
    )
    serve.add_argument(
        "--grpc-server",
        choices=GRPC_SERVERS,
        default=ServerSettings.grpc_server,
        help="gRPC front end: h2 (Sluice's own HTTP/2 server, default) or grpcio (grpc.aio fallback)",
    )
    serve.add_argument(
        "--protocol-workers",
        type=_protocol_workers,
        default=defaults.protocol_workers,
        metavar="N",
        help="protocol worker processes that accept connections and decode requests, sending them to this "
        "process's batchers (0 to 64; 0: one process does everything, for small pods; auto: the usable CPUs "
        "(affinity, cgroup quota) less 2, at most 8, and 0 under 4 CPUs; see docs/frontend-workers.md)",
    )
    serve.add_argument(
        "--malloc-tuning",
        choices=("on", "off"),
        default="on",
        help="on (default): glibc's allocator keeps freed blocks under 32 MiB in its heap and up to 256 MiB of "
        "free heap, so large tensors reuse memory instead of faulting in new pages; off: glibc's defaults",
    )
    serve.add_argument(
        "--split-file",
        type=Path,
        default=defaults.split_file,
        metavar="PATH",
        help='no-mesh canary split: JSON {"models": {"<model>": {"target": "<host>:<port>", "percent": 0-100}}} '
        "(the operator mounts it from a ConfigMap); that percent of each model's requests without an explicit "
        "version is forwarded to the target over gRPC. Re-read when it changes (polled every second); a missing "
        "file means no split, an invalid one keeps the split in force (logged)",
    )
    serve.add_argument(
        "--caller-label-limit",
        type=_non_negative(int),
        default=defaults.caller_label_limit,
        help="callers (Sluice-Caller header, sluice-caller gRPC metadata or sluice_caller parameter) that get a "
        "label of their own in the per-caller metrics, the busiest first; the rest are counted as 'other'",
    )
    serve.add_argument(
        "--duplicate-window-s",
        type=_non_negative(float),
        default=defaults.duplicate_window_s,
        help="a request with the same inputs from the same caller within this many seconds of the last counts as a "
        "duplicate in the per-caller metrics; 0 disables (no hashing)",
    )
    serve.add_argument(
        "--trace-config",
        action="append",
        default=[],
        metavar="[opentelemetry,]SETTING=VALUE",
        help="OpenTelemetry tracing in Triton's syntax (repeatable; needs the 'tracing' extra): level=TIMESTAMPS "
        "turns it on, rate=N traces 1 of N requests (0: only those with a sampled traceparent), count=N stops after "
        "N traces, mode=opentelemetry; opentelemetry,url=<OTLP/HTTP endpoint>, opentelemetry,resource=<key>=<value> "
        "(e.g. service.name=...), opentelemetry,bsp_max_queue_size= / bsp_schedule_delay= / "
        "bsp_max_export_batch_size=. Default: off, rate 1000, url http://localhost:4318/v1/traces",
    )
    serve.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log verbosity"
    )
    serve.add_argument(
        "--log-verbose",
        type=_non_negative(int),
        default=0,
        help="Triton's flag: 1 or more also writes verbose (DEBUG) records; changeable at run time (/v2/logging)",
    )
    serve.add_argument(
        "--log-format",
        choices=["default", "ISO8601"],
        default="default",
        help="Triton's flag: timestamps in local time (default) or ISO 8601 UTC; changeable at run time",
    )
    sched = SchedulingDefaults()
    serve.add_argument(
        "--queue-timeout-us",
        type=int,
        default=sched.queue_timeout_us,
        help="server-side queue timeout for models whose config names none (0 disables)",
    )
    serve.add_argument(
        "--max-queue-size", type=int, default=sched.max_queue_size, help="default queue bound per model (0: unbounded)"
    )
    serve.add_argument(
        "--batch-policy",
        choices=BATCH_POLICIES,
        default=sched.batch_policy,
        help="work_conserving: dispatch as soon as an instance is idle; fixed_wait: Triton's, wait up to the queue "
        "delay for a preferred batch size",
    )
    serve.add_argument(
        "--overload-control",
        choices=["on", "off"],
        default="on" if sched.overload_control else "off",
        help="shed requests that waited too long while the queue cannot drain",
    )
    serve.add_argument(
        "--response-cache-bytes",
        type=int,
        default=sched.response_cache_bytes,
        help="size bound of each cached model version's response cache (when no server cache is set)",
    )
    serve.add_argument(
        "--cache-config",
        action="append",
        type=_cache_entry,
        default=None,
        metavar="local,size=BYTES",
        help="Triton's server response cache: one LRU bound shared by every model with response_cache enabled; "
        "unset, each model version has a cache of its own, bounded by the flag above",
    )
    serve.add_argument(
        "--response-cache-byte-size",
        type=_positive(int),
        default=None,
        help="Triton's older form of the server cache's size, in bytes",
    )
    serve.add_argument(
        "--worker-spin-us",
        type=int,
        default=sched.worker_spin_us,
        help="how long a model worker polls for the next batch before sleeping (0 = never poll)",
    )
    serve.add_argument(
        "--overload-interval-ms",
        type=_finite,
        default=sched.overload_interval_ms,
        help="how long the queue must stay non-empty before it counts as overloaded",
    )
    serve.add_argument(
        "--overload-target-ms",
        type=_finite,
        default=sched.overload_target_ms,
        help="least queue wait that is shed while overloaded (at least 2x the recent execution time)",
    )
    for field in dataclasses.fields(Limits):
        flag = "--" + field.name.replace("_", "-")
        serve.add_argument(
            flag,
            type=type(field.default),
            default=field.default,
            help=field.metadata["help"],
        )
    _pull_parser(sub)
    _tune_parser(sub)
    return parser


def _protocol_workers(value: str) -> int | str:
    from sluice.runtime.frontend_workers import protocol_workers_problem

    if value == "auto":
        return value
    try:
        count: object = int(value)
    except ValueError:
        count = value
    problem = protocol_workers_problem(count)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{problem}, or auto")
    return int(value)


def _resolve_protocol_workers(
    value: int | str, grpc_server: str, grpc_port: int, tracing: bool
) -> tuple[int, str | None]:
    """``--protocol-workers``: the count, and how ``auto`` chose it (None when given). ``auto`` never
    takes away what was asked for: with the grpcio server, or tracing on at start (spans are recorded
    by the engine's front ends only), it is 0."""
    if value != "auto":
        return int(value), None
    from sluice.runtime.frontend_workers import auto_protocol_workers, usable_cpus

    if grpc_server != "h2" and grpc_port >= 0:
        return 0, "auto: 0 (the grpcio gRPC server runs in one process)"
    if tracing:
        return 0, "auto: 0 (tracing is on: requests decoded by protocol workers are not traced)"
    cpus, found = usable_cpus()
    count = auto_protocol_workers(cpus)
    return count, f"auto: {count} for {found}"


def _positive_ints(value: str) -> tuple[int, ...]:
    try:
        numbers = tuple(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: allowed: comma-separated integers, such as 1,8,32") from None
    if not numbers or any(n < 1 for n in numbers):
        raise argparse.ArgumentTypeError(f"{value!r}: allowed: comma-separated integers >= 1, such as 1,8,32")
    return tuple(dict.fromkeys(numbers))


def _non_negative_ints(value: str) -> tuple[int, ...]:
    try:
        numbers = tuple(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: allowed: comma-separated integers, such as 250,1000") from None
    if not numbers or any(n < 0 for n in numbers):
        raise argparse.ArgumentTypeError(f"{value!r}: allowed: comma-separated integers >= 0, such as 250,1000")
    return tuple(dict.fromkeys(numbers))


def _duration(value: str) -> float:
    from sluice.runtime import tune_plan

    try:
        return tune_plan.parse_duration(value)
    except tune_plan.PlanError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    def parse(value: str) -> int | float:
        number = _non_negative(kind)(value)
        if number <= 0:
            raise argparse.ArgumentTypeError(f"{value!r}: allowed: {kind.__name__} > 0")
        return number

    return parse


def _tune_parser(sub: argparse._SubParsersAction) -> None:
    from sluice.runtime.tune_plan import Durations, SearchSpace

    durations, space = Durations(), SearchSpace()
    tune = sub.add_parser(
        "tune",
        help="find the batching settings with the most throughput under a latency budget",
        description="Start a server with one model, measure its batch-size cost curve, predict throughput and "
        "latency of batching configs (batch policy, preferred batch size, max queue delay, instance count) at "
        "each --concurrency, confirm the most promising by measurement (each applied to the live model through "
        "the repository load API with a config override), and print the table, the best config and the "
        "config.pbtxt diff. Progress goes to stderr. Exit codes: 0 done, 1 unexpected failure, 2 bad arguments, "
        "3 unknown model or one tune cannot change, 4 time budget too small, 5 no config met the latency budget "
        "(the closest is named), 130 interrupted (the best so far is printed).",
        formatter_class=_HelpFormatter,
    )
    tune.add_argument("--model-repository", required=True, type=Path, help="directory of <model>/config.pbtxt")
    tune.add_argument("--model", required=True, help="the model to tune")
    tune.add_argument("--latency-budget-ms", type=_positive(float), default=None,
                      help="p99 latency a config must keep to count; None: the most throughput, whatever the latency")
    tune.add_argument("--time-budget", type=_duration, default=300.0, metavar="DURATION",
                      help="the whole run stays within this: seconds (300) or 90s, 5m, 1m30s")
    tune.add_argument("--concurrency", type=_positive_ints, default=(1, 8, 32), metavar="N[,N...]",
                      help="closed-loop clients of each measured point")
    tune.add_argument("--protocol", choices=["grpc", "http"], default="grpc", help="protocol of the load generator")
    tune.add_argument("--search", choices=["model", "grid"], default="model",
                      help="model: predict from the cost curve, measure the best few; grid: measure every point")
    tune.add_argument("--max-instances", type=_positive(int), default=space.max_instances,
                      help="instance counts tried: 1, 2, 4, ... up to this")
    tune.add_argument("--delays-us", type=_non_negative_ints, default=space.delays_us, metavar="US[,US...]",
                      help="max_queue_delay_microseconds values tried with fixed_wait")
    tune.add_argument("--point-s", type=_positive(float), default=durations.point_s,
                      help="seconds each point is measured (shortened when the time budget is tight)")
    tune.add_argument("--warmup-s", type=_non_negative(float), default=durations.warmup_s,
                      help="seconds of load before each point that are not counted")
    tune.add_argument("--cost-s", type=_positive(float), default=durations.cost_s,
                      help="seconds each batch size of the cost curve is measured")
    tune.add_argument("--max-points", type=_positive(int), default=30,
                      help="most measurements the model search makes (it usually stops before)")
    tune.add_argument("--cpus", type=_non_negative(int), default=0,
                      help="cores the prediction assumes; 0: this process's CPU affinity")
    tune.add_argument("--apply", action="store_true",
                      help="write the tuned config.pbtxt (atomically; the old one is kept as config.pbtxt.bak)")
    tune.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the result as JSON")
    tune.add_argument(
        "--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="server log verbosity"
    )


def tune_settings_from_args(args: argparse.Namespace) -> TuneSettings:
    from sluice.runtime.tune import TuneSettings
    from sluice.runtime.tune_plan import Durations, SearchSpace

    return TuneSettings(
        model_repository=args.model_repository,
        model=args.model,
        latency_budget_ms=args.latency_budget_ms,
        time_budget_s=args.time_budget,
        concurrency=tuple(args.concurrency),
        protocol=args.protocol,
        search=args.search,
        space=SearchSpace(max_instances=args.max_instances, delays_us=tuple(args.delays_us)),
        durations=Durations(cost_s=args.cost_s, warmup_s=args.warmup_s, point_s=args.point_s),
        max_points=args.max_points,
        apply=args.apply,
        json_path=args.json,
        cpus=args.cpus,
    )


def _pull_parser(sub: argparse._SubParsersAction) -> None:
    defaults = PullSettings(source="", destination=Path())
    pull = sub.add_parser(
        "pull",
        help="download a model version into a directory (verified, placed atomically)",
        description="Download SOURCE into DESTINATION: a prefix recursively, a single file under its own name, "
        "a .tar.gz/.tgz/.tar/.zip archive unpacked. Written next to DESTINATION first, verified, then renamed "
        "into place; a DESTINATION already pulled from SOURCE (with that checksum) is left as it is. "
        "Credentials come from the environment (AWS_*, IRSA, GOOGLE_APPLICATION_CREDENTIALS, GKE Workload "
        "Identity, AZURE_STORAGE_*, AKS workload identity); AWS_ENDPOINT_URL[_S3] points s3:// at an "
        "S3-compatible store. Exit codes: 0 done, 1 unexpected failure, 2 bad arguments, 3 source missing or "
        "access denied, 4 checksum mismatch, 5 transient errors outlasted the retries (or --deadline-s "
        "passed), 6 unsafe or broken archive, 7 the destination cannot take the model.",
        formatter_class=_HelpFormatter,
    )
    pull.add_argument("source", help="s3://bucket/path, gs://bucket/path, az://container/path, https://host/file, "
                      "pvc://claim/path or a local path")
    pull.add_argument("destination", type=Path, help="directory the model's files end up in")
    pull.add_argument("--sha256", default=None, metavar="HEX",
                      help="expected SHA-256 (optionally sha256:HEX): of the file for a single file or archive; "
                      "for a prefix, of the manifest of sorted '<relative path>\\t<sha256>\\n' lines. Printed "
                      "after every pull")
    pull.add_argument("--retries", type=int, default=defaults.retries,
                      help="retries of each request on transient errors (throttling, 5xx, timeouts, resets)")
    pull.add_argument("--backoff-base-s", type=_finite, default=defaults.backoff_base_s,
                      help="first retry waits about this long; each next one twice as long (with jitter)")
    pull.add_argument("--backoff-cap-s", type=_finite, default=defaults.backoff_cap_s,
                      help="longest wait between two attempts")
    pull.add_argument("--timeout-s", type=_finite, default=defaults.timeout_s,
                      help="connect and read timeout of each request")
    pull.add_argument("--deadline-s", type=_finite, default=None,
                      help="give up (exit 5, nothing placed) when the whole pull, retries and their waits "
                      "included, takes longer than this; unset: no bound")
    pull.add_argument("--low-speed-limit", type=int, default=defaults.low_speed_limit, metavar="BYTES_PER_S",
                      help="an attempt whose body averages fewer bytes a second than this over "
                      "--low-speed-time-s is dropped and retried (a server trickling bytes within the read "
                      "timeout); 0: off")
    pull.add_argument("--low-speed-time-s", type=_finite, default=defaults.low_speed_time_s,
                      help="the window of --low-speed-limit; 0: off")
    pull.add_argument("--size-limit", default=None, metavar="QUANTITY",
                      help="refuse a model larger than this (bytes or a quantity such as 20Gi), before writing it")
    pull.add_argument("--allow-insecure-http", action="store_true",
                      help="allow http:// sources and redirects (trusted local servers only)")
    pull.add_argument("--pvc-root", type=Path, default=defaults.pvc_root,
                      help="pvc://claim/path is read from PVC_ROOT/claim/path")
    pull.add_argument("--progress-interval-s", type=_finite, default=defaults.progress_interval_s,
                      help="progress log line period when stderr is not a terminal")
    pull.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log verbosity"
    )


def pull_settings_from_args(args: argparse.Namespace, env: dict[str, str]) -> PullSettings:
    from sluice.runtime import pull

    if args.retries < 0 or args.timeout_s <= 0 or args.backoff_base_s < 0 or args.backoff_cap_s < 0:
        raise pull.UsageError("--retries, --backoff-base-s and --backoff-cap-s must be >= 0 and --timeout-s > 0")
    if args.deadline_s is not None and args.deadline_s <= 0:
        raise pull.UsageError(f"--deadline-s must be > 0, got {args.deadline_s:g} (leave it out for no bound)")
    if args.low_speed_limit < 0 or args.low_speed_time_s < 0:
        raise pull.UsageError("--low-speed-limit and --low-speed-time-s must be >= 0 (0 turns the check off), got "
                              f"{args.low_speed_limit} and {args.low_speed_time_s:g}")
    return PullSettings(
        source=args.source, destination=args.destination,
        sha256=pull.parse_sha256(args.sha256) if args.sha256 else None,
        retries=args.retries, backoff_base_s=args.backoff_base_s, backoff_cap_s=args.backoff_cap_s,
        timeout_s=args.timeout_s, allow_insecure_http=args.allow_insecure_http, pvc_root=args.pvc_root,
        size_limit=pull.parse_size(args.size_limit) if args.size_limit else None,
        progress_interval_s=args.progress_interval_s, env=env, deadline_s=args.deadline_s,
        low_speed_limit=args.low_speed_limit, low_speed_time_s=args.low_speed_time_s,
    )


def _cache_entry(value: str) -> int:
    """One ``--cache-config`` entry (Triton's ``local,size=BYTES``) -> its size."""
    from sluice.runtime.cache import cache_config_bytes

    try:
        return cache_config_bytes([value])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _shared_cache_bytes(args: argparse.Namespace) -> int:
    if args.cache_config and args.response_cache_byte_size is not None:
        print("sluice: error: --cache-config and --response-cache-byte-size both set the server cache; allowed: "
              "one of them", file=sys.stderr)
        raise SystemExit(2)
    if args.response_cache_byte_size is not None:
        return int(args.response_cache_byte_size)
    return int(args.cache_config[-1]) if args.cache_config else 0


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    limits = Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)})
    scheduling = SchedulingDefaults(
        queue_timeout_us=args.queue_timeout_us,
        max_queue_size=args.max_queue_size,
        batch_policy=args.batch_policy,
        overload_control=args.overload_control == "on",
        overload_interval_ms=args.overload_interval_ms,
        overload_target_ms=args.overload_target_ms,
        response_cache_bytes=args.response_cache_bytes,
        response_cache_shared_bytes=_shared_cache_bytes(args),
        worker_spin_us=args.worker_spin_us,
    )
    from sluice.runtime import mirror

    repository_url = args.model_repository if mirror.is_remote(args.model_repository) else None
    tracing = parse_trace_config(args.trace_config)
    workers, workers_auto = _resolve_protocol_workers(
        args.protocol_workers, args.grpc_server, args.grpc_port, tracing.levels.level != ("OFF",)
    )
    return ServerSettings(
        model_repository=(
            mirror.cache_root(args.model_repository_cache_dir, repository_url)
            if repository_url is not None
            else Path(args.model_repository)
        ),
        repository_url=repository_url,
        storage_env=dict(os.environ),
        model_control_mode=args.model_control_mode,
        load_models=tuple(args.load_model),
        repository_poll_s=args.repository_poll_secs,
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        http_uds=args.http_uds,
        grpc_uds=args.grpc_uds,
        limits=limits,
        scheduling=scheduling,
        shutdown_grace_s=args.shutdown_grace_s,
        models=tuple(args.model),
        strict_readiness=args.strict_readiness,
        auto_complete_config=not (args.disable_auto_complete_config or args.strict_model_config),
        drain_period_s=args.drain_period_s,
        server_name=args.server_name,
        grpc_server=args.grpc_server,
        split_file=args.split_file,
        caller_label_limit=args.caller_label_limit,
        duplicate_window_s=args.duplicate_window_s,
        tracing=tracing,
        log=log_settings_from_args(args),
        protocol_workers=workers,
        protocol_workers_auto=workers_auto,
        malloc_tuning=MallocTuning() if args.malloc_tuning == "on" else None,
        gpu_metrics=GpuMetricsSettings(
            enabled=args.allow_gpu_metrics,
            interval_ms=args.metrics_interval_ms,
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        ),
    )


def log_settings_from_args(args: argparse.Namespace) -> LogSettings:
    """The start log settings: ``--log-level`` is the least severity written, ``--log-verbose``
    (or ``--log-level DEBUG``) turns verbose records on."""
    level = args.log_level
    return LogSettings(
        info=level in ("DEBUG", "INFO"),
        warning=level != "ERROR",
        error=True,
        verbose_level=max(args.log_verbose, 1 if level == "DEBUG" else 0),
        format=args.log_format,
    )


async def serve(settings: ServerSettings) -> int:
    from sluice.runtime import host_memory
    from sluice.runtime.server import Server, StartupError

    applied = host_memory.apply(settings.malloc_tuning)  # before models and buffers are allocated
    server = Server(settings)
    for handler in logging.getLogger().handlers:  # the stderr handler main() made
        server.log_control.govern(handler)
    try:
        await server.start()
    except StartupError as exc:
        print(f"sluice: error: {exc}", file=sys.stderr, flush=True)
        return 1
    if applied is not None:
        logging.getLogger("sluice.runtime").info("%s", applied)
    # The request path allocates many short-lived objects that reference counting frees; the
    # cyclic collector scanning every loaded module, model and session each 700 allocations was
    # ~10% of server CPU (perf). Freeze what startup made and collect young objects less often.
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    # A model worker that finished its native call waits for the GIL while the event loop runs
    # Python; the default 5 ms switch interval let that wait stretch every batch's completion.
    sys.setswitchinterval(0.0001)
    loop = asyncio.get_running_loop()
    stop = loop.create_future()

    def on_signal(sig: signal.Signals) -> None:
        if stop.done():
            server.cut_drain()  # a second signal: stop draining now
        else:
            stop.set_result(sig)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    failed = f"  ({len(server.failed_models)} model(s) failed to load)" if server.failed_models else ""
    print(
        f"sluice ready: HTTP {settings.host}:{server.ports.http}  gRPC {settings.host}:{server.ports.grpc}  "
        f"metrics {settings.metrics_host or settings.host}:{server.ports.metrics}{_unix_sockets(settings)}{failed}",
        flush=True,
    )
    received = await stop
    # SIGTERM comes from an orchestrator: drain. Ctrl-C comes from a person: stop now.
    drain = settings.drain_period_s if received == signal.SIGTERM else 0.0
    logging.getLogger("sluice.runtime").info("stopping on %s: finishing in-flight requests", received.name)
    await server.stop(drain_s=drain)
    return 0


def _unix_sockets(settings: ServerSettings) -> str:
    """The ready line's part for the Unix domain sockets (empty without them)."""
    sockets = (("HTTP", settings.http_uds), ("gRPC", settings.grpc_uds))
    return "".join(f"  {what} unix:{path}" for what, path in sockets if path is not None)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "pull":
        return _pull(args)
    runner: Callable[..., Any]
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.run
    if args.command == "tune":
        from sluice.runtime import tune

        return runner(tune.run(tune_settings_from_args(args)))
    try:
        settings = settings_from_args(args)
    except TraceConfigError as exc:
        print(f"sluice: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return runner(serve(settings))


def _pull(args: argparse.Namespace) -> int:
    from sluice.runtime import pull, puller

    if args.log_level != "DEBUG":  # the storage libraries' chatter ("found credentials in ...") is not progress
        for name in ("botocore", "aiobotocore", "s3fs", "gcsfs", "adlfs", "azure", "fsspec", "google"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        settings = pull_settings_from_args(args, dict(os.environ))
    except pull.UsageError as exc:
        print(f"sluice pull: error: {exc}", file=sys.stderr, flush=True)
        return int(exc.exit_code)
    return puller.run(settings)


if __name__ == "__main__":
    sys.exit(main())
