"""Server settings: one explicit object built once from the command line and passed down."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds on what a client may send; each one has a command-line flag of the same name (its help
    text is the field's ``help`` metadata)."""

    max_body_bytes: int = dataclasses.field(
        default=64 * 1024 * 1024,
        metadata={"help": "Largest HTTP request body (bytes); larger bodies get 413 before they are read."},
    )
    max_header_bytes: int = dataclasses.field(
        default=16 * 1024,
        metadata={"help": "Largest HTTP request head (request line plus headers, bytes); larger heads get 431."},
    )
    max_json_depth: int = dataclasses.field(
        default=16,
        metadata={"help": "Deepest nesting of JSON arrays/objects in an HTTP request body."},
    )
    max_elements: int = dataclasses.field(
        default=16 * 1024 * 1024,
        metadata={"help": "Most tensor elements in one request, summed over its inputs."},
    )
    max_grpc_message_bytes: int = dataclasses.field(
        default=64 * 1024 * 1024,
        metadata={"help": "Largest gRPC message, received or sent."},
    )
    header_timeout_s: float = dataclasses.field(
        default=10.0,
        metadata={"help": "Time a connection has to send a complete request head; slower clients are disconnected."},
    )
    body_timeout_s: float = dataclasses.field(
        default=30.0,
        metadata={"help": "Time a connection has to send the body once the head arrived."},
    )
    idle_timeout_s: float = dataclasses.field(
        default=60.0,
        metadata={"help": "A keep-alive connection with no request in flight is closed after this long."},
    )
    max_connections: int = dataclasses.field(
        default=4096,
        metadata={"help": "Open HTTP connections at once; more are accepted and closed at once with 503."},
    )
    json_offload_bytes: int = dataclasses.field(
        default=256 * 1024,
        metadata={
            "help": "HTTP infer JSON this large (request bodies, bytes; responses, about 8 bytes per value) is "
            "decoded or encoded on a worker thread instead of the event loop; smaller JSON stays inline."
        },
    )
    keepalive_interval_s: float = dataclasses.field(
        default=60.0,
        metadata={"help": "gRPC: a connection with calls open that sent nothing for this long is sent a PING."},
    )
    keepalive_timeout_s: float = dataclasses.field(
        default=20.0,
        metadata={"help": "gRPC: a keepalive PING not acknowledged within this long closes the connection."},
    )


@dataclasses.dataclass(frozen=True)
class SchedulingDefaults:
    """Server-wide defaults a model's config.pbtxt may override."""

    queue_timeout_us: int = 30_000_000
    """Server-side queue timeout when the model config names none (0 turns it off). Unlike Triton,
    on by default: a request that waited this long is answered with a timeout and never executed."""
    max_queue_size: int = 1024
    """Queued requests per model version when the config names no max_queue_size (0 = unbounded)."""
    overload_control: bool = True
    """Shed requests that waited too long while the queue has not drained for ``overload_interval_ms``
    (CoDel-style; see docs/batching.md). Keeps served latency bounded and answers the excess at
    once under overload instead of running requests whose clients have given up."""
    overload_interval_ms: float = 100.0
    """How long the queue must stay non-empty before it counts as overloaded."""
    overload_target_ms: float = 5.0
    """Least queue wait that is shed while overloaded (the limit is at least 2x the recent execution time)."""
    response_cache_bytes: int = 64 * 1024 * 1024
    """Size bound of each model version's response cache (for models with ``response_cache { enable:
    true }``); a model may set ``parameters { key: "response_cache_bytes" ... }``."""
    response_cache_shared_bytes: int = 0
    """Triton's server cache (``--cache-config local,size=N``): one bound of this many bytes shared by
    every model version with ``response_cache { enable: true }`` and no size parameter of its own.
    0: each version has its own ``response_cache_bytes`` cache."""
    worker_spin_us: int = 1000
    """After each batch a model worker polls this long for the next one before sleeping: keeps
    low-concurrency latency down (no wake-up, no idle-state slow-down of the next model call) at
    the cost of up to this much CPU per batch. 0 turns it off."""
    batch_policy: str = "work_conserving"
    """``work_conserving``: dispatch as soon as an instance is idle, the queue delay is only an upper
    bound; ``fixed_wait``: Triton's behaviour, wait up to the delay for a preferred batch size."""


@dataclasses.dataclass(frozen=True)
class TraceLevels:
    """One scope of Triton's trace settings (the server's, or a model's): ``--trace-config`` and the
    ``/v2/trace/setting`` API (tracing.py parses and checks both)."""

    level: tuple[str, ...] = ("OFF",)
    """``OFF``, or ``TIMESTAMPS``: record spans of the sampled requests."""
    rate: int = 1000
    """Trace 1 of every ``rate`` requests (Triton's meaning); 0: only requests carrying a sampled
    W3C ``traceparent`` (those are always traced)."""
    count: int = -1
    """Traces still to take; -1: no limit."""
    log_frequency: int = 0
    """Triton's file-output setting: kept and reported, no effect (spans go to OTLP)."""


@dataclasses.dataclass(frozen=True)
class TracingSettings:
    """OpenTelemetry tracing (the ``tracing`` extra): ``--trace-config`` in Triton's syntax."""

    levels: TraceLevels = dataclasses.field(default_factory=TraceLevels)
    url: str = "http://localhost:4318/v1/traces"
    """OTLP/HTTP endpoint the spans are exported to (Triton's default)."""
    resource: tuple[tuple[str, str], ...] = (("service.name", "sluice"),)
    """Resource attributes of every span (``opentelemetry,resource=key=value``)."""
    bsp_max_queue_size: int = 2048
    bsp_schedule_delay_ms: int = 5000
    bsp_max_export_batch_size: int = 512


GRPC_SERVERS = ("h2", "grpcio")
"""Values of ``ServerSettings.grpc_server``."""

MODEL_CONTROL_MODES = ("none", "poll", "explicit")
"""Values of ``ServerSettings.model_control_mode`` (Triton's ``--model-control-mode``)."""


@dataclasses.dataclass(frozen=True)
class LogSettings:
    """Triton's log settings (its logging extension, ``/v2/logging``): which severities are written
    and how; the server applies them to Python logging (logs.py) and clients may change them while
    it runs. Sluice writes to stderr only: there is no ``log_file``."""

    info: bool = True
    warning: bool = True
    error: bool = True
    verbose_level: int = 0
    """0: no verbose (DEBUG) records; 1 or more: DEBUG records too (Sluice has one verbose level)."""
    format: str = "default"
    """``default`` (local time, as Sluice always wrote) or ``ISO8601`` (UTC, ``2024-05-20T20:03:26Z``)."""


@dataclasses.dataclass(frozen=True)
class MallocTuning:
    """What the C heap keeps of freed memory (``--malloc-tuning``); None in the settings: glibc's defaults."""

    mmap_threshold_bytes: int = 32 << 20
    """Blocks below this come from the heap, where a freed one is reused, rather than from a mapping of
    their own that is unmapped on free (glibc's default starts at 128 KiB)."""
    trim_threshold_bytes: int = 256 << 20
    """Free memory at the heap's top beyond this goes back to the kernel (a pod's resident memory can stay
    this much above its working set)."""
    # glibc's M_TOP_PAD is left at its default: a 64 MiB pad cost small HTTP requests ~5 % of throughput
    # (perf_analyzer c64 on the MLP, five alternating pairs), and the large tensors did not need it.


@dataclasses.dataclass(frozen=True)
class GpuMetricsSettings:
    """NVML GPU and MIG telemetry (gpu_telemetry.py; the ``gpu`` extra): Triton's
    ``--allow-gpu-metrics`` and ``--metrics-interval-ms``."""

    enabled: bool = True
    """Poll NVML and export the ``nv_gpu_*`` and ``sluice_gpu_*`` / ``sluice_mig_*`` families; without
    NVML or a GPU there are none either way (one log line at start says why)."""
    interval_ms: int = 2000
    """How often NVML is read on a background thread; a scrape reports the last reading."""
    cuda_visible_devices: str | None = None
    """``CUDA_VISIBLE_DEVICES`` as the server saw it: maps the CUDA ordinals of ``instance_group``
    ``gpus`` to NVML's GPUs and MIG devices (indices, ``GPU-``/``MIG-`` UUIDs or the pre-R470
    ``MIG-GPU-<uuid>/<gi>/<ci>``), and when set, limits the GPU families to the devices it resolves
    to (as Triton exports CUDA-visible GPUs only). None: unset (every GPU NVML sees is exported)."""


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    model_repository: Path
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    """0 picks a free port; -1 disables that listener."""
    metrics_host: str | None = None
    """Address of the metrics listener, which also answers ``/v2/health/live`` and ``/v2/health/ready``;
    None: ``host``. An inference sidecar keeps inference on the pod's loopback and opens only this one
    to the pod IP, where Prometheus and the kubelet's probes reach."""
    http_uds: Path | None = None
    """Also serve HTTP on this Unix domain socket (an inference sidecar's callers in the same pod);
    with ``http_port`` -1, only there. None: no socket."""
    grpc_uds: Path | None = None
    """Also serve gRPC on this Unix domain socket (``unix:///path`` for gRPC clients); with
    ``grpc_port`` -1, only there. None: no socket."""
    limits: Limits = dataclasses.field(default_factory=Limits)
    scheduling: SchedulingDefaults = dataclasses.field(default_factory=SchedulingDefaults)
    shutdown_grace_s: float = 30.0
    """After SIGTERM/Ctrl-C: how long in-flight requests may take to finish."""
    models: tuple[str, ...] = ()
    """Models to load at start; empty loads every model in the repository."""
    strict_readiness: bool = True
    """Ready only when every model asked for with ``models`` (or, without it, found in the
    repository at start), and every model loaded since, has a ready version (Triton's
    ``--strict-readiness``). False: ready once startup loads are done, whatever their outcome."""
    auto_complete_config: bool = True
    """Call Python models' ``auto_complete_config`` before validating their configs; False with
    ``--disable-auto-complete-config`` (Triton's flag): the written config is used as it is."""
    drain_period_s: float = 5.0
    """On SIGTERM: how long the server reports not-ready while still serving everything, so that
    load balancers and Kubernetes endpoints stop sending before it stops listening."""
    server_name: str = "sluice"
    """``name`` in the server metadata (``GET /v2``); ``triton`` for tools that check for Triton's."""
    grpc_server: str = "h2"
    """gRPC front end: ``h2``, Sluice's own HTTP/2 server (protocol/grpc_h2.py), or ``grpcio``,
    the ``grpc.aio`` server kept as a fallback (protocol/grpc.py)."""
    split_file: Path | None = None
    """The no-mesh canary split: a JSON file naming, per model, a canary gRPC target and the
    percent of requests without an explicit version forwarded there (forwarding.py). Read at start
    and re-read when it changes; a missing file is no split. None: no split, nothing watched."""
    caller_label_limit: int = 20
    """Callers (``Sluice-Caller``) that get a label of their own in the per-caller metrics, the
    busiest by recent volume; the others are counted under ``other`` (callers.py)."""
    duplicate_window_s: float = 10.0
    """A request with the same inputs for the same model version from the same caller within this
    long of the last one counts as a duplicate (``sluice_caller_duplicate_request_total``); 0 turns
    duplicate detection off (nothing is hashed). Requests that name no caller are never hashed."""
    model_control_mode: str = "none"
    """Triton's ``--model-control-mode``. ``none``: load the models at start, never again, refuse the
    repository load/unload API; ``poll``: the same, and rescan the repository every
    ``repository_poll_s`` to load added, reload changed and unload removed models (API refused);
    ``explicit``: load ``load_models`` at start, then only what the load/unload API asks for."""
    load_models: tuple[str, ...] = ()
    """``explicit`` mode: the models loaded at start (``*``: every model in the repository)."""
    repository_poll_s: float = 15.0
    """``poll`` mode: seconds between two scans of the repository (Triton's ``--repository-poll-secs``)."""
    repository_url: str | None = None
    """A cloud model repository (``s3://``, ``gs://``, ``az://``): mirrored into ``model_repository``,
    which is then the local cache, before the models load and before every poll (mirror.py)."""
    storage_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """The environment the storage libraries' credential chains and endpoint settings read."""
    storage_retries: int = 3
    """Retries of each request to a cloud repository on transient errors (after the first attempt)."""
    storage_timeout_s: float = 30.0
    """Connect and read timeout of each request to a cloud repository."""
    tracing: TracingSettings = dataclasses.field(default_factory=TracingSettings)
    """OpenTelemetry traces of sampled requests (tracing.py); off unless a trace level is set."""
    log: LogSettings = dataclasses.field(default_factory=LogSettings)
    """The log settings in force at start (``--log-level``, ``--log-verbose``, ``--log-format``)."""
    protocol_workers: int = 0
    """Protocol worker processes (``--protocol-workers``, 0 to 64): with N >= 1 this process runs the
    data plane and N workers accept the HTTP and gRPC connections, decode requests and send them
    here (frontend_workers.py), so decoding uses N cores and batches still form across every
    connection. 0: this one process does everything (small pods)."""
    protocol_workers_auto: str | None = None
    """How ``--protocol-workers auto`` chose ``protocol_workers`` (for the start log); None when set."""
    gpu_metrics: GpuMetricsSettings = dataclasses.field(default_factory=GpuMetricsSettings)
    """GPU and MIG telemetry from NVML (``--allow-gpu-metrics``, ``--metrics-interval-ms``)."""
    malloc_tuning: MallocTuning | None = dataclasses.field(default_factory=MallocTuning)
    """What the C heap keeps of freed memory, set at start in the engine and each protocol worker
    (host_memory.py; ``--malloc-tuning off``: None, glibc's defaults)."""
