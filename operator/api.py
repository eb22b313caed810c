"""The ``sluice.dev/v1alpha1`` API as typed Python values, and the parsing that validates a spec.

The CRD schema (``crd.py``) makes the API server reject most bad specs, but CEL rules are not enforced
by every server (older clusters, test emulators) and some problems only show once a spec meets the
operator. :func:`parse_inference_model`, :func:`parse_ensemble` and :func:`parse_model_pool` re-check every
rule and raise
:class:`SpecError` listing each problem with what to change; the reconciler turns it into a Degraded
condition instead of crashing. Defaults live here once and ``crd.py`` publishes the same values.

Callers: ``crd`` (constants), ``builders`` (the dataclasses), ``reconcile`` (parsing).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Mapping, Sequence
from typing import Any

from sluice.operator import gpus

GROUP = "sluice.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
INFERENCE_MODEL_KIND = "InferenceModel"
INFERENCE_MODEL_PLURAL = "inferencemodels"
ENSEMBLE_KIND = "Ensemble"
ENSEMBLE_PLURAL = "ensembles"
MODEL_POOL_KIND = "ModelPool"
MODEL_POOL_PLURAL = "modelpools"
OWNER_KINDS = (INFERENCE_MODEL_KIND, ENSEMBLE_KIND, MODEL_POOL_KIND)
"""The kinds that own runtime objects (Deployments, Services, ConfigMaps...)."""

FORMATS = ("onnx", "torchscript", "tensorrt", "python")
"""Model formats, mapped to the Triton backend the runtime loads them with (see ``BACKEND_BY_FORMAT``)."""
BACKEND_BY_FORMAT = {"onnx": "onnxruntime", "torchscript": "pytorch", "tensorrt": "tensorrt", "python": "python"}
SERVED_FORMATS = ("onnx", "torchscript", "python")
"""Formats the runtime images load. The API accepts the others (``tensorrt``) so specs written for them
stay valid; until the images carry that backend such a model is Degraded (NotImplemented), not deployed."""
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")
MODEL_FILE_SUFFIXES = (".onnx", ".pt", ".pt2", ".plan", ".py")
"""Suffixes that make an object-store URI one model file rather than a prefix of files."""
DEFAULT_MODEL_FILES = {"onnx": ("model.onnx",), "torchscript": ("model.pt", "model.pt2"),
                       "tensorrt": ("model.plan",), "python": ("model.py",)}
"""The files the runtime looks for in a version directory when the config names none."""
TORCH_EXPORT_SUFFIX = ".pt2"
"""A ``torchscript``-format file with this suffix is a ``torch.export`` program, whose config the runtime
completes from its signature; TorchScript itself needs the config inline (and so does an AOTInductor
package, also a ``.pt2``, which keeps no signature: its load fails without inputs and outputs)."""
STORAGE_SCHEMES = ("s3", "gs", "az", "https", "pvc")
"""Where model files come from; all but ``pvc`` (mounted) are fetched by ``sluice pull`` in an init container."""
CONFIG_FORMATS = ("pbtxt", "yaml", "json")
TIMEOUT_ACTIONS = ("REJECT", "DELAY")
DATA_TYPES = (
    "TYPE_BOOL", "TYPE_UINT8", "TYPE_UINT16", "TYPE_UINT32", "TYPE_UINT64", "TYPE_INT8", "TYPE_INT16",
    "TYPE_INT32", "TYPE_INT64", "TYPE_FP16", "TYPE_FP32", "TYPE_FP64", "TYPE_STRING", "TYPE_BF16",
)
PLACEMENTS = ("Auto", "Colocated", "Remote")
DEPLOYMENT_MODE, SIDECAR_MODE = "Deployment", "Sidecar"
MODES = (DEPLOYMENT_MODE, SIDECAR_MODE)
"""``spec.mode``: runtime pods of its own, or injected into application pods (``sidecar``)."""
SCALING_METRICS = ("queueDepth", "inflight", "latency")
"""What an autoscaled model scales on, per pod: queued requests (``sluice_queue_depth``), requests queued
or executing (``sluice_inflight_requests``), or the p90 time requests wait in the queue
(``sluice_queue_duration_seconds``). docs/operator.md ("Autoscaling") compares them."""
SCALING_ENGINES = ("hpa", "keda")
"""Who scales: a HorizontalPodAutoscaler on a custom metric (served by prometheus-adapter), or a KEDA
ScaledObject querying Prometheus itself."""

DEFAULT_MODEL_VERSION = 1
DEFAULT_MIN_REPLICAS = 1
DEFAULT_MAX_REPLICAS = 1
DEFAULT_TARGET_QUEUE_DEPTH = 8
DEFAULT_TARGET_INFLIGHT = 8
DEFAULT_TARGET_QUEUE_WAIT_MILLISECONDS = 50
DEFAULT_SCALING_METRIC = "queueDepth"
DEFAULT_SCALING_ENGINE = "hpa"
DEFAULT_SCALE_UP_STABILIZATION_SECONDS = 0
DEFAULT_SCALE_DOWN_STABILIZATION_SECONDS = 300
MAX_STABILIZATION_SECONDS = 3600
"""The HPA's own bound on ``stabilizationWindowSeconds``."""
MAX_SCALING_TARGET = 100_000
MAX_QUEUE_WAIT_MILLISECONDS = 600_000
DEFAULT_CANARY_PERCENT = 10
DEFAULT_STEP_WEIGHTS = (5, 25, 50, 100)
GATE_URL_PATTERN = r"^https?://[^\s]+$"
DEFAULT_DRAIN_SECONDS = 5
DEFAULT_SHUTDOWN_GRACE_SECONDS = 30
MAX_DRAIN_SECONDS = 600
MAX_SHUTDOWN_GRACE_SECONDS = 3600
MAX_REPLICAS = 100
MAX_BATCH_SIZE = 4096
MAX_INSTANCES = 64
MAX_GPUS = 16
PROTOCOL_WORKERS_AUTO = "auto"
MAX_PROTOCOL_WORKERS = 64
"""The runtime's bound on ``sluice serve --protocol-workers`` (a contract test holds the two equal)."""

NAME_PATTERN = r"^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,62}$"
MAX_LABEL_VALUE = 63
"""Kubernetes' limit on a label value."""
MAX_OBJECT_NAME = 253
"""Kubernetes' limit on an object name (a DNS subdomain), a ConfigMap's included."""
SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
"""A DNS subdomain (RFC 1123), of at most :data:`MAX_OBJECT_NAME` characters: a Secret's or ServiceAccount's name."""
_SUBDOMAIN_HINT = (" (a Kubernetes object name: lower-case letters, digits, '-' and '.', starting and ending "
                   f"with a letter or digit, at most {MAX_OBJECT_NAME} characters)")
STORAGE_URI_PATTERN = r"^(s3|gs|az|https|pvc)://[^\s]+$"
CHECKSUM_PATTERN = r"^sha256:[0-9a-f]{64}$"
"""``spec.model.checksum``: what ``sluice pull`` prints; of the file for one file or archive, else of the
manifest of the prefix (docs/runtime.md, "sluice pull")."""
MIG_PROFILE_PATTERN = r"^[1-7]g\.[0-9]+gb(\+me)?$"
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"
POOL_NAME_PATTERN = r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$"
"""A ModelPool's or InferenceModel's name: it names their Deployment and Service, so a DNS-1035 label."""
MAX_NAME_WITH_CANARY = 63 - len("-canary")
"""An InferenceModel with ``spec.canary``: its canary objects are ``<name>-canary``."""

_BINARY_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL_SUFFIXES = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}


class ProblemsError(ValueError):
    """Base of the operator's spec errors: ``problems`` lists each as ``field: what is wrong, what to do``."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        super().__init__("; ".join(self.problems))


class SpecError(ProblemsError):
    """A spec the operator cannot serve."""


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a model's files come from and how the runtime should load them."""

    name: str
    storage_uri: str
    format: str
    version: int = DEFAULT_MODEL_VERSION
    config: str | None = None
    """Inline model configuration, used verbatim instead of the one rendered from ``RuntimeConfig``."""
    config_format: str = "pbtxt"
    checksum: str | None = None
    """``sha256:<hex>`` the fetched files must match (``sluice pull --sha256``); ``None``: not checked."""
    size_limit: str | None = None
    """A quantity: the most room the model's files take in the pod (the model-repository emptyDir's
    ``sizeLimit`` and the pod's ``ephemeral-storage`` request add these up); ``None``: unbounded."""


@dataclasses.dataclass(frozen=True)
class DynamicBatching:
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_microseconds: int = 100


@dataclasses.dataclass(frozen=True)
class QueuePolicy:
    max_queue_size: int = 0
    timeout_microseconds: int = 0
    timeout_action: str = "REJECT"


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """The subset of a Triton model config the spec exposes; rendered into the model's config file."""

    max_batch_size: int = 0
    dynamic_batching: DynamicBatching | None = None
    queue_policy: QueuePolicy | None = None
    instances: int = 1
    response_cache: bool = False
    cuda_graphs: bool = False
    """``optimization { cuda { graphs: true } }``: the PyTorch backend captures a CUDA graph per batch size
    at load (docs/cuda-graphs.md)."""


@dataclasses.dataclass(frozen=True)
class Gpu:
    """Exactly one of ``count``, ``mig_profile`` and ``memory`` is set."""

    count: int | None = None
    mig_profile: str | None = None
    memory: str | None = None
    compute_percent: int | None = None
    """With ``memory``: the least share of one GPU's compute (a MIG slice of 2 of 7 compute slices is 28 %).
    A ModelPool admits members while their shares add up to at most 100 per device."""
    shared: bool = False
    """With ``memory``: a time-sliced GPU (no memory isolation between its pods) may be used."""

    def memory_mib(self) -> int:
        return int(quantity_to_float(self.memory) / 2**20) if self.memory else 0


@dataclasses.dataclass(frozen=True)
class Resources:
    cpu: str | None = None
    memory: str | None = None
    gpu: Gpu | None = None


@dataclasses.dataclass(frozen=True)
class Scaling:
    """Replica bounds and, when they differ, what the autoscaler aims for (``spec.scaling``)."""

    min_replicas: int = DEFAULT_MIN_REPLICAS
    max_replicas: int = DEFAULT_MAX_REPLICAS
    target_queue_depth: int = DEFAULT_TARGET_QUEUE_DEPTH
    """``metric: queueDepth``: average queued requests per pod."""
    metric: str = DEFAULT_SCALING_METRIC
    """One of :data:`SCALING_METRICS`."""
    engine: str = DEFAULT_SCALING_ENGINE
    """One of :data:`SCALING_ENGINES`."""
    target_inflight: int = DEFAULT_TARGET_INFLIGHT
    """``metric: inflight``: average requests queued or executing per pod."""
    target_queue_wait_ms: int = DEFAULT_TARGET_QUEUE_WAIT_MILLISECONDS
    """``metric: latency``: average over pods of each pod's p90 queue wait, in milliseconds."""
    scale_up_stabilization_seconds: int = DEFAULT_SCALE_UP_STABILIZATION_SECONDS
    """Scale up only to the lowest recommendation of this window (0: at once)."""
    scale_down_stabilization_seconds: int = DEFAULT_SCALE_DOWN_STABILIZATION_SECONDS
    """Scale down only to the highest recommendation of this window."""
    fallback_replicas: int | None = None
    """``engine: keda``: replicas while Prometheus cannot be read; ``None`` means ``max_replicas``."""

    @property
    def autoscaled(self) -> bool:
        return self.max_replicas > self.min_replicas

    @property
    def target(self) -> int:
        """The target of the chosen metric, in its unit (requests, or milliseconds for latency)."""
        return {"queueDepth": self.target_queue_depth, "inflight": self.target_inflight,
                "latency": self.target_queue_wait_ms}[self.metric]


@dataclasses.dataclass(frozen=True)
class Shutdown:
    """How a runtime pod stops: serve on while endpoints drop it, then let in-flight requests finish."""

    drain_seconds: int = DEFAULT_DRAIN_SECONDS
    """The preStop hook sleeps this long: the pod keeps serving while it leaves the Service's endpoints."""
    grace_seconds: int = DEFAULT_SHUTDOWN_GRACE_SECONDS
    """After SIGTERM the runtime stops accepting and gives in-flight requests this long
    (``--shutdown-grace-s``)."""


@dataclasses.dataclass(frozen=True)
class Server:
    """Settings of the runtime process itself rather than of a model (``spec.server``)."""

    protocol_workers: int | str | None = None
    """``--protocol-workers``: a count of protocol worker processes, ``"auto"`` (from the pod's CPU limit),
    or ``None``: not passed, so the runtime's default (one process) and unchanged pods on an upgrade."""


@dataclasses.dataclass(frozen=True)
class CanaryAnalysis:
    """How a candidate is judged (``spec.canary.analysis``); see docs/operator.md."""

    step_weights: tuple[int, ...] = DEFAULT_STEP_WEIGHTS
    interval_seconds: int = 60
    progress_deadline_seconds: int = 600
    """A candidate whose pods are not ready this long after it was deployed is rolled back."""
    min_requests: int = 50
    """Fewer canary requests in an interval make it inconclusive, never a pass."""
    max_error_rate_percent: float = 1.0
    max_latency_p99_ms: int | None = None
    max_latency_p99_ratio: float | None = None
    """Canary p99 over this multiple of the stable p99 fails the interval."""
    failure_limit: int = 0
    inconclusive_limit: int = 2
    gate_url: str | None = None
    """An HTTP(S) URL that must answer 2xx before a step or promotion (as asked below)."""
    gate_before_step: bool = False
    gate_before_promotion: bool = False


@dataclasses.dataclass(frozen=True)
class Canary:
    storage_uri: str
    version: int
    traffic_percent: int = DEFAULT_CANARY_PERCENT
    config: str | None = None
    analysis: CanaryAnalysis | None = None
    """None: a fixed ``traffic_percent`` split, promoted and aborted by hand."""
    runtime: RuntimeConfig | None = None
    """Runtime settings of the candidate instead of ``spec.runtime``."""
    checksum: str | None = None
    """Of the candidate's files; never inherited from ``spec.model``."""
    size_limit: str | None = None
    """``None``: ``spec.model.sizeLimit``."""


@dataclasses.dataclass(frozen=True)
class Storage:
    """Credentials for the model fetch: references only, never the secrets themselves."""

    service_account_name: str | None = None
    secret_name: str | None = None


@dataclasses.dataclass(frozen=True)
class InferenceModelSpec:
    model: ModelSource
    runtime: RuntimeConfig = RuntimeConfig()
    resources: Resources = Resources()
    scaling: Scaling = Scaling()
    canary: Canary | None = None
    storage: Storage = Storage()
    shutdown: Shutdown = Shutdown()
    server: Server = Server()
    pool: str | None = None
    """The ModelPool (same namespace) whose pods serve this model; ``None``: its own Deployment."""
    mode: str = DEPLOYMENT_MODE
    """``Sidecar``: no Deployment; the admission webhook injects the runtime into the pods asking for it."""


@dataclasses.dataclass(frozen=True)
class ModelPoolSpec:
    """A runtime Deployment that several InferenceModels join (``spec.pool``) to share one device."""

    gpu: Gpu
    """The device every pool replica gets; members declare shares of it."""
    resources: Resources = Resources()
    """cpu and memory of the runtime container (``gpu`` is always ``None`` here)."""
    scaling: Scaling = Scaling()
    shutdown: Shutdown = Shutdown()
    server: Server = Server()


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    data_type: str
    dims: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class EnsembleStep:
    name: str
    model_ref: str | None
    """Name of an InferenceModel in the Ensemble's namespace; ``None`` when the step is inline."""
    model: ModelSource | None
    resources: Resources = Resources()
    version: int = -1
    input_map: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Step model input tensor -> ensemble tensor it reads."""
    output_map: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Step model output tensor -> ensemble tensor it writes."""


@dataclasses.dataclass(frozen=True)
class EnsembleSpec:
    steps: tuple[EnsembleStep, ...]
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    max_batch_size: int = 0
    placement: str = "Auto"
    resources: Resources = Resources()
    scaling: Scaling = Scaling()
    storage: Storage = Storage()
    shutdown: Shutdown = Shutdown()
    server: Server = Server()


def single_file(uri: str) -> str | None:
    """The name one model file at ``uri`` is fetched under (``sluice pull`` keeps it), else None: any
    https:// file but an archive; an s3/gs/az object whose name ends in a model file's suffix (a prefix,
    and a path ending in ``/``, keeps the names inside it); never a mounted ``pvc://`` directory."""
    path = uri.split("?", 1)[0]
    last = path.rstrip("/").rsplit("/", 1)[-1]
    if uri.startswith("https://"):
        return None if "." not in last or last.endswith(ARCHIVE_SUFFIXES) else last
    if uri.startswith(("s3://", "gs://", "az://")) and not path.endswith("/") and last.endswith(MODEL_FILE_SUFFIXES):
        return last
    return None


def is_torch_export(uri: str) -> bool:
    """Whether a storage URI names one fetched ``.pt2`` file."""
    name = single_file(uri)
    return name is not None and name.endswith(TORCH_EXPORT_SUFFIX)


def quantity_to_float(text: str) -> float:
    """Parse a Kubernetes quantity (``500m``, ``2Gi``, ``1.5``) into its value in base units."""
    match = re.fullmatch(QUANTITY_PATTERN, text)
    if not match:
        raise ValueError(f"{text!r} is not a Kubernetes quantity such as 500m, 2Gi or 16G")
    number = re.match(r"[0-9.]+", text)
    assert number is not None
    suffix = text[number.end():]
    factor = _BINARY_SUFFIXES.get(suffix) or _DECIMAL_SUFFIXES[suffix]
    return float(number.group()) * factor


class _Reader:
    """Reads typed fields out of an untrusted dict and collects every problem instead of stopping at one."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def problem(self, path: str, text: str) -> None:
        self.problems.append(f"{path}: {text}")

    def obj(self, data: Mapping[str, Any], key: str, path: str) -> Mapping[str, Any] | None:
        value = data.get(key)
        if value is None:
            return None
        if not isinstance(value, Mapping):
            self.problem(f"{path}.{key}", "must be an object")
            return None
        return value

    def integer(self, data: Mapping[str, Any], key: str, path: str, default: int, lo: int, hi: int) -> int:
        value = data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            self.problem(f"{path}.{key}", f"must be an integer from {lo} to {hi}, got {value!r}")
            return default
        if not lo <= value <= hi:
            self.problem(f"{path}.{key}", f"must be from {lo} to {hi}, got {value}")
        return value

    def string(
        self, data: Mapping[str, Any], key: str, path: str, *, required: bool = False,
        pattern: str | None = None, choices: Sequence[str] = (), hint: str = "",
    ) -> str | None:
        value = data.get(key)
        if value is None:
            if required:
                self.problem(f"{path}.{key}", f"is required{hint}")
            return None
        if isinstance(value, int) and not isinstance(value, bool) and pattern == QUANTITY_PATTERN:
            value = str(value)
        if not isinstance(value, str):
            self.problem(f"{path}.{key}", f"must be a string, got {value!r}")
            return None
        if choices and value not in choices:
            self.problem(f"{path}.{key}", f"must be one of {', '.join(choices)}, got {value!r}")
        elif pattern and not re.fullmatch(pattern, value):
            self.problem(f"{path}.{key}", f"{value!r} does not match {pattern}{hint}")
        return value

    def number(
        self, data: Mapping[str, Any], key: str, path: str, default: float | None, lo: float, hi: float
    ) -> float | None:
        value = data.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            self.problem(f"{path}.{key}", f"must be a number from {lo:g} to {hi:g}, got {value!r}")
            return default
        if not lo <= value <= hi:
            self.problem(f"{path}.{key}", f"must be from {lo:g} to {hi:g}, got {value:g}")
        return float(value)

    def boolean(self, data: Mapping[str, Any], key: str, path: str) -> bool:
        value = data.get(key, False)
        if not isinstance(value, bool):
            self.problem(f"{path}.{key}", f"must be true or false, got {value!r}")
            return False
        return value

    def analysis(self, data: Mapping[str, Any] | None, path: str) -> CanaryAnalysis | None:
        if data is None:
            return None
        weights = data.get("stepWeights", list(DEFAULT_STEP_WEIGHTS))
        if (
            not isinstance(weights, list)
            or not weights
            or not all(isinstance(w, int) and not isinstance(w, bool) and 1 <= w <= 100 for w in weights)
            or any(b <= a for a, b in itertools.pairwise(weights))
        ):
            self.problem(
                f"{path}.stepWeights",
                f"must be a rising list of traffic percents from 1 to 100, such as [5, 25, 50, 100]; got {weights!r}",
            )
            weights = list(DEFAULT_STEP_WEIGHTS)
        gates = self.obj(data, "gates", path) or {}
        gate_url = self.string(gates, "url", f"{path}.gates", pattern=GATE_URL_PATTERN)
        before_step = self.boolean(gates, "beforeStep", f"{path}.gates")
        before_promotion = self.boolean(gates, "beforePromotion", f"{path}.gates")
        if (before_step or before_promotion) and not gate_url:
            self.problem(f"{path}.gates.url", "is required when beforeStep or beforePromotion is true")
        latency = self.number(data, "maxLatencyP99Milliseconds", path, None, 1, 600_000)
        ratio = self.number(data, "maxLatencyP99RatioToStable", path, None, 1, 100)
        if ratio is not None and weights[0] >= 100:
            self.problem(f"{path}.maxLatencyP99RatioToStable",
                         f"needs a first step below 100 in stepWeights (got {weights!r}): at 100% the stable "
                         "version serves nothing, so no interval would have a stable p99 to compare with; add a "
                         "step such as 50, or use maxLatencyP99Milliseconds")
        return CanaryAnalysis(
            step_weights=tuple(weights),
            interval_seconds=self.integer(data, "intervalSeconds", path, 60, 10, 86_400),
            progress_deadline_seconds=self.integer(data, "progressDeadlineSeconds", path, 600, 60, 86_400),
            min_requests=self.integer(data, "minRequests", path, 50, 1, 1_000_000_000),
            max_error_rate_percent=self.number(data, "maxErrorRatePercent", path, 1.0, 0, 100) or 0.0,
            max_latency_p99_ms=None if latency is None else int(latency),
            max_latency_p99_ratio=ratio,
            failure_limit=self.integer(data, "failureLimit", path, 0, 0, 100),
            inconclusive_limit=self.integer(data, "inconclusiveLimit", path, 2, 0, 100),
            gate_url=gate_url,
            gate_before_step=before_step,
            gate_before_promotion=before_promotion,
        )

    def model_source(self, data: Mapping[str, Any], path: str, default_name: str) -> ModelSource:
        name = self.string(data, "name", path, pattern=NAME_PATTERN) or default_name
        uri = self.string(
            data, "storageUri", path, required=True, pattern=STORAGE_URI_PATTERN,
            hint=" (use s3://bucket/path, gs://bucket/path, az://container/path, https://host/path or "
            "pvc://claim/path)",
        )
        fmt = self.string(data, "format", path, required=True, choices=FORMATS)
        config = self.string(data, "config", path)
        config_format = self.string(data, "configFormat", path, choices=CONFIG_FORMATS) or "pbtxt"
        version = self.integer(data, "version", path, DEFAULT_MODEL_VERSION, 1, 2**31 - 1)
        checksum, size_limit = self.fetch_checks(data, path, uri)
        return ModelSource(
            name=name, storage_uri=uri or "", format=fmt or "onnx", version=version,
            config=config, config_format=config_format, checksum=checksum, size_limit=size_limit,
        )

    def config_needed(self, source: ModelSource, path: str, config: str | None) -> None:
        """A TorchScript model declares no input or output shapes: its config must come inline, unless the
        file is a ``.pt2`` program (the runtime completes that config from the program's signature). An
        inline config for one fetched file that keeps a name the runtime does not look for must name it."""
        if source.format == "torchscript" and config is None and not is_torch_export(source.storage_uri):
            self.problem(f"{path}.config", "is required for a torchscript model: TorchScript declares no input "
                         "or output shapes, so the config must list them (as Triton's pytorch_libtorch needs). "
                         "Give config.pbtxt text with input and output here, or serve a torch.export program "
                         f"(a storageUri naming one {TORCH_EXPORT_SUFFIX} file), whose config is completed from "
                         "its signature")
        name = single_file(source.storage_uri)
        defaults = DEFAULT_MODEL_FILES.get(source.format, ())
        if config is not None and name is not None and name not in defaults and "default_model_filename" not in config:
            self.problem(f"{path}.config", f"does not name the model file: the storageUri is fetched as {name!r} "
                         f"(one file keeps its name) and the runtime looks for {' or '.join(defaults)}; add "
                         f"default_model_filename: \"{name}\" to the config, or name the file {defaults[0]}")

    def fetch_checks(self, data: Mapping[str, Any], path: str, uri: str | None) -> tuple[str | None, str | None]:
        """``checksum`` and ``sizeLimit`` of a model source; neither goes with a mounted ``pvc://`` one."""
        checksum = self.string(data, "checksum", path, pattern=CHECKSUM_PATTERN,
                               hint=" (sha256: and 64 lower-case hex digits, as sluice pull prints it)")
        size_limit = self.string(data, "sizeLimit", path, pattern=QUANTITY_PATTERN, hint=" (e.g. 20Gi)")
        if size_limit is not None and re.fullmatch(QUANTITY_PATTERN, size_limit) and \
                quantity_to_float(size_limit) < 1:
            self.problem(f"{path}.sizeLimit", f"must be at least 1 byte, got {size_limit!r}")
        if uri is not None and uri.startswith("pvc://"):
            for key, value in (("checksum", checksum), ("sizeLimit", size_limit)):
                if value is not None:
                    self.problem(f"{path}.{key}", "does not go with a pvc:// storageUri: the claim is mounted, "
                                 "not copied into the pod; remove it")
        return checksum, size_limit

    def runtime(self, data: Mapping[str, Any] | None, path: str) -> RuntimeConfig:
        if data is None:
            return RuntimeConfig()
        max_batch = self.integer(data, "maxBatchSize", path, 0, 0, MAX_BATCH_SIZE)
        batching = None
        if (raw := self.obj(data, "dynamicBatching", path)) is not None:
            sizes = raw.get("preferredBatchSizes", [])
            if not isinstance(sizes, list) or not all(isinstance(s, int) and s >= 1 for s in sizes):
                self.problem(f"{path}.dynamicBatching.preferredBatchSizes", "must be a list of integers >= 1")
                sizes = []
            if max_batch == 0:
                self.problem(
                    f"{path}.dynamicBatching",
                    "needs maxBatchSize > 0; set spec.runtime.maxBatchSize or remove dynamicBatching",
                )
            elif any(s > max_batch for s in sizes):
                self.problem(
                    f"{path}.dynamicBatching.preferredBatchSizes",
                    f"every size must be <= maxBatchSize ({max_batch}), got {sizes}",
                )
            batching = DynamicBatching(
                preferred_batch_sizes=tuple(sizes),
                max_queue_delay_microseconds=self.integer(
                    raw, "maxQueueDelayMicroseconds", f"{path}.dynamicBatching", 100, 0, 10_000_000
                ),
            )
        policy = None
        if (raw := self.obj(data, "queuePolicy", path)) is not None:
            sub = f"{path}.queuePolicy"
            policy = QueuePolicy(
                max_queue_size=self.integer(raw, "maxQueueSize", sub, 0, 0, 1_000_000),
                timeout_microseconds=self.integer(raw, "timeoutMicroseconds", sub, 0, 0, 3_600_000_000),
                timeout_action=self.string(raw, "timeoutAction", sub, choices=TIMEOUT_ACTIONS) or "REJECT",
            )
        cache = data.get("responseCache", False)
        if not isinstance(cache, bool):
            self.problem(f"{path}.responseCache", f"must be true or false, got {cache!r}")
            cache = False
        graphs = data.get("cudaGraphs", False)
        if not isinstance(graphs, bool):
            self.problem(f"{path}.cudaGraphs", f"must be true or false, got {graphs!r}")
            graphs = False
        return RuntimeConfig(
            max_batch_size=max_batch, dynamic_batching=batching, queue_policy=policy,
            instances=self.integer(data, "instances", path, 1, 1, MAX_INSTANCES), response_cache=cache,
            cuda_graphs=graphs,
        )

    def graphs_possible(self, runtime: RuntimeConfig | None, path: str, fmt: str, gpu: Gpu | None) -> None:
        """CUDA graphs are the PyTorch backend's, captured on a GPU: say so rather than render a setting the
        runtime would ignore (other backends) or run eagerly (CPU instances)."""
        if runtime is None or not runtime.cuda_graphs:
            return
        if fmt != "torchscript":
            self.problem(f"{path}.cudaGraphs", f"CUDA graphs are captured by the PyTorch backend only (format "
                         f"torchscript), not for format {fmt}; remove cudaGraphs")
        elif gpu is None:
            self.problem(f"{path}.cudaGraphs", "needs a GPU (spec.resources.gpu): graphs are captured on the "
                         "device, and CPU instances run eagerly; add resources.gpu or remove cudaGraphs")

    def resources(self, data: Mapping[str, Any] | None, path: str) -> Resources:
        if data is None:
            return Resources()
        cpu = self.string(data, "cpu", path, pattern=QUANTITY_PATTERN)
        memory = self.string(data, "memory", path, pattern=QUANTITY_PATTERN)
        gpu = None
        gpu = self.gpu(self.obj(data, "gpu", path), f"{path}.gpu")
        return Resources(cpu=cpu, memory=memory, gpu=gpu)

    def gpu(self, raw: Mapping[str, Any] | None, path: str) -> Gpu | None:
        if raw is None:
            return None
        forms = [key for key in ("count", "migProfile", "memory") if raw.get(key) is not None]
        if len(forms) != 1:
            self.problem(
                path,
                "set exactly one of count (whole GPUs), migProfile (e.g. 1g.10gb) or memory (e.g. 16Gi)"
                + (f", got {', '.join(forms)}" if forms else ", got none"),
            )
        profile = self.string(raw, "migProfile", path, pattern=MIG_PROFILE_PATTERN)
        if profile is not None and re.fullmatch(MIG_PROFILE_PATTERN, profile) and not gpus.models_with(profile):
            self.problem(f"{path}.migProfile", f"{profile!r} is not a MIG profile of any GPU Sluice knows; "
                         f"known: {', '.join(gpus.known_profiles())}")
        compute = None
        if raw.get("computePercent") is not None:
            compute = self.integer(raw, "computePercent", path, 100, 1, 100)
            if raw.get("memory") is None:
                self.problem(f"{path}.computePercent", "only goes with gpu.memory (a MIG profile or whole GPUs "
                             "already fix the compute); remove one of them")
        shared = raw.get("shared", False)
        if not isinstance(shared, bool):
            self.problem(f"{path}.shared", f"must be true or false, got {shared!r}")
            shared = False
        elif shared and raw.get("memory") is None:
            self.problem(f"{path}.shared", "only goes with gpu.memory (how much of a shared GPU the model needs)")
        return Gpu(
            count=self.integer(raw, "count", path, 1, 1, MAX_GPUS) if raw.get("count") is not None else None,
            mig_profile=profile,
            memory=self.string(raw, "memory", path, pattern=QUANTITY_PATTERN),
            compute_percent=compute,
            shared=shared,
        )

    def scaling(self, data: Mapping[str, Any] | None, path: str) -> Scaling:
        if data is None:
            return Scaling()
        lo = self.integer(data, "minReplicas", path, DEFAULT_MIN_REPLICAS, 1, MAX_REPLICAS)
        hi = self.integer(data, "maxReplicas", path, max(lo, DEFAULT_MAX_REPLICAS), 1, MAX_REPLICAS)
        if lo > hi:
            self.problem(
                path, f"minReplicas ({lo}) must be <= maxReplicas ({hi}); raise maxReplicas or lower minReplicas"
            )
        fallback = None
        if data.get("fallbackReplicas") is not None:
            fallback = self.integer(data, "fallbackReplicas", path, hi, 1, MAX_REPLICAS)
            if not lo <= fallback <= hi:
                self.problem(
                    f"{path}.fallbackReplicas",
                    f"must be from minReplicas ({lo}) to maxReplicas ({hi}), got {fallback}",
                )
        windows = {
            key: self.integer(data, key, path, default, 0, MAX_STABILIZATION_SECONDS)
            for key, default in (("scaleUpStabilizationSeconds", DEFAULT_SCALE_UP_STABILIZATION_SECONDS),
                                 ("scaleDownStabilizationSeconds", DEFAULT_SCALE_DOWN_STABILIZATION_SECONDS))
        }
        return Scaling(
            min_replicas=lo, max_replicas=hi,
            target_queue_depth=self.integer(
                data, "targetQueueDepth", path, DEFAULT_TARGET_QUEUE_DEPTH, 1, MAX_SCALING_TARGET),
            metric=self.string(data, "metric", path, choices=SCALING_METRICS) or DEFAULT_SCALING_METRIC,
            engine=self.string(data, "engine", path, choices=SCALING_ENGINES) or DEFAULT_SCALING_ENGINE,
            target_inflight=self.integer(data, "targetInflight", path, DEFAULT_TARGET_INFLIGHT, 1, MAX_SCALING_TARGET),
            target_queue_wait_ms=self.integer(
                data, "targetQueueWaitMilliseconds", path, DEFAULT_TARGET_QUEUE_WAIT_MILLISECONDS, 1,
                MAX_QUEUE_WAIT_MILLISECONDS,
            ),
            scale_up_stabilization_seconds=windows["scaleUpStabilizationSeconds"],
            scale_down_stabilization_seconds=windows["scaleDownStabilizationSeconds"],
            fallback_replicas=fallback,
        )

    def shutdown(self, data: Mapping[str, Any] | None, path: str) -> Shutdown:
        if data is None:
            return Shutdown()
        return Shutdown(
            drain_seconds=self.integer(data, "drainSeconds", path, DEFAULT_DRAIN_SECONDS, 0, MAX_DRAIN_SECONDS),
            grace_seconds=self.integer(
                data, "graceSeconds", path, DEFAULT_SHUTDOWN_GRACE_SECONDS, 1, MAX_SHUTDOWN_GRACE_SECONDS,
            ),
        )

    def server(self, data: Mapping[str, Any] | None, path: str) -> Server:
        if data is None:
            return Server()
        value = data.get("protocolWorkers")
        if value is None or value == PROTOCOL_WORKERS_AUTO:
            return Server(protocol_workers=value)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PROTOCOL_WORKERS:
            self.problem(f"{path}.protocolWorkers", f"must be {PROTOCOL_WORKERS_AUTO} (one worker per CPU of the "
                         f"pod's limit past two, at most 8) or an integer from 0 to {MAX_PROTOCOL_WORKERS}, "
                         f"got {value!r}")
            return Server()
        return Server(protocol_workers=value)

    def storage(self, data: Mapping[str, Any] | None, path: str) -> Storage:
        if data is None:
            return Storage()
        secret = self.obj(data, "secretRef", path)
        account = self.object_name(data, "serviceAccountName", path)
        return Storage(
            service_account_name=account,
            secret_name=self.object_name(secret, "name", f"{path}.secretRef", required=True)
            if secret is not None else None,
        )

    def object_name(self, data: Mapping[str, Any], key: str, path: str, *, required: bool = False) -> str | None:
        """The name of another Kubernetes object (a Secret, a ServiceAccount): a DNS subdomain."""
        value = self.string(data, key, path, required=required, pattern=SUBDOMAIN_PATTERN, hint=_SUBDOMAIN_HINT)
        if value is not None and len(value) > MAX_OBJECT_NAME and re.fullmatch(SUBDOMAIN_PATTERN, value):
            self.problem(f"{path}.{key}", f"is {len(value)} characters{_SUBDOMAIN_HINT}")
        return value

    def tensors(self, data: Any, path: str) -> tuple[Tensor, ...]:
        if not isinstance(data, list) or not data:
            self.problem(path, "must list at least one tensor with name, dataType and dims")
            return ()
        result = []
        for index, raw in enumerate(data):
            sub = f"{path}[{index}]"
            if not isinstance(raw, Mapping):
                self.problem(sub, "must be an object")
                continue
            dims = raw.get("dims", [])
            if not isinstance(dims, list) or not all(isinstance(d, int) and d >= -1 and d != 0 for d in dims):
                self.problem(f"{sub}.dims", "must be a list of positive integers or -1 for a variable size")
                dims = []
            result.append(Tensor(
                name=self.string(raw, "name", sub, required=True) or "",
                data_type=self.string(raw, "dataType", sub, required=True, choices=DATA_TYPES) or "TYPE_FP32",
                dims=tuple(dims),
            ))
        return tuple(result)

    def string_map(self, data: Mapping[str, Any], key: str, path: str) -> dict[str, str]:
        value = data.get(key, {})
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            self.problem(f"{path}.{key}", "must map tensor names to tensor names")
            return {}
        return dict(value)


def candidate_model(spec: InferenceModelSpec) -> ModelSource:
    """The model source the candidate serves: spec.model with the canary's files, version and config."""
    assert spec.canary is not None
    canary = spec.canary
    config = canary.config if canary.config is not None else spec.model.config
    return dataclasses.replace(spec.model, storage_uri=canary.storage_uri, version=canary.version, config=config,
                               checksum=canary.checksum, size_limit=canary.size_limit or spec.model.size_limit)


def parse_inference_model(name: str, spec: Mapping[str, Any]) -> InferenceModelSpec:
    """Validate an InferenceModel ``spec`` (``name`` is ``metadata.name``) or raise :class:`SpecError`."""
    read = _Reader()
    model_data = read.obj(spec, "model", "spec")
    if model_data is None:
        read.problem("spec.model", "is required: give at least storageUri and format")
        model_data = {}
    model = read.model_source(model_data, "spec.model", default_name=name)
    if "storageUri" in model_data:
        read.config_needed(model, "spec.model", model.config)
    runtime_data = read.obj(spec, "runtime", "spec")
    if model.config is not None and runtime_data:
        read.problem(
            "spec.runtime", "cannot be combined with spec.model.config; put these settings into the inline config"
        )
    canary = None
    if (raw := read.obj(spec, "canary", "spec")) is not None:
        uri = read.string(raw, "storageUri", "spec.canary", required=True, pattern=STORAGE_URI_PATTERN)
        checksum, size_limit = read.fetch_checks(raw, "spec.canary", uri)
        canary = Canary(
            storage_uri=uri or "",
            version=read.integer(raw, "version", "spec.canary", model.version + 1, 1, 2**31 - 1),
            traffic_percent=read.integer(raw, "trafficPercent", "spec.canary", DEFAULT_CANARY_PERCENT, 0, 100),
            config=read.string(raw, "config", "spec.canary"),
            analysis=read.analysis(read.obj(raw, "analysis", "spec.canary"), "spec.canary.analysis"),
            runtime=(None if (canary_runtime := read.obj(raw, "runtime", "spec.canary")) is None
                     else read.runtime(canary_runtime, "spec.canary.runtime")),
            checksum=checksum,
            size_limit=size_limit,
        )
        if uri is not None:
            # The candidate runs with its own config, else the stable one (candidate_model).
            read.config_needed(dataclasses.replace(model, storage_uri=uri), "spec.canary",
                               canary.config if canary.config is not None else model.config)
        if canary.runtime is not None and model.config is not None and canary.config is None:
            read.problem("spec.canary.runtime", "cannot be combined with spec.model.config; give the canary its "
                         "own spec.canary.config instead")
        if (canary.version == model.version and canary.storage_uri == model.storage_uri
                and canary.runtime is None and canary.config is None):
            read.problem("spec.canary", "is identical to spec.model; change its version, storageUri, config or "
                         "runtime")
    result = InferenceModelSpec(
        model=model,
        runtime=read.runtime(runtime_data, "spec.runtime"),
        resources=read.resources(read.obj(spec, "resources", "spec"), "spec.resources"),
        scaling=read.scaling(read.obj(spec, "scaling", "spec"), "spec.scaling"),
        canary=canary,
        storage=read.storage(read.obj(spec, "storage", "spec"), "spec.storage"),
        shutdown=read.shutdown(read.obj(spec, "shutdown", "spec"), "spec.shutdown"),
        server=read.server(read.obj(spec, "server", "spec"), "spec.server"),
        pool=read.string(spec, "pool", "spec", pattern=POOL_NAME_PATTERN),
        mode=read.string(spec, "mode", "spec", choices=MODES) or DEPLOYMENT_MODE,
    )
    if result.mode == SIDECAR_MODE:
        # no Deployment or Service of its own: only '<name>-config' (a DNS subdomain like the name), whose
        # labels carry the name, and a label value has at most 63 characters (dots are allowed in it)
        if len(name) > MAX_LABEL_VALUE:
            read.problem("metadata.name", f"{name!r} is {len(name)} characters; in Sidecar mode it may have at most "
                         f"{MAX_LABEL_VALUE}, since its ConfigMap '<name>-config' carries it in labels (a label value "
                         f"has at most {MAX_LABEL_VALUE})")
    elif not re.fullmatch(POOL_NAME_PATTERN, name):
        read.problem("metadata.name", f"{name!r} names the model's Deployment and Service, so it must be a DNS "
                     "label: lower-case letters, digits and '-', starting with a letter, at most 63 characters")
    elif canary is not None and len(name) > MAX_NAME_WITH_CANARY:
        read.problem("metadata.name", f"{name!r} is {len(name)} characters; with spec.canary it may have at most "
                     f"{MAX_NAME_WITH_CANARY}, since the canary's Deployment and Service are '<name>-canary' "
                     "(a DNS label: at most 63)")
    read.graphs_possible(result.runtime, "spec.runtime", model.format, result.resources.gpu)
    if canary is not None:
        read.graphs_possible(canary.runtime, "spec.canary.runtime", model.format, result.resources.gpu)
    if result.pool is not None:
        _check_member(read, name, result)
    if result.mode == SIDECAR_MODE:
        _check_sidecar(read, result)
    if read.problems:
        raise SpecError(read.problems)
    return result


def _check_member(read: _Reader, name: str, spec: InferenceModelSpec) -> None:
    """The rules for an InferenceModel with ``spec.pool``: it declares a share of the pool's device and
    leaves devices, canaries and replica counts to the pool."""
    gpu = spec.resources.gpu
    leave = "or remove spec.pool to serve the model on its own"
    if gpu is None or gpu.memory is None:
        read.problem("spec.resources.gpu.memory", f"is required for a member of pool {spec.pool!r}: declare the "
                     f"model's share of the pool's GPU memory, e.g. 6Gi ({leave})")
    elif quantity_to_float(gpu.memory) < 2**20:
        read.problem("spec.resources.gpu.memory", f"must be at least 1Mi for a pool member, got {gpu.memory!r}")
    if gpu is not None:
        for key, value in (("count", gpu.count), ("migProfile", gpu.mig_profile)):
            if value is not None:
                read.problem(f"spec.resources.gpu.{key}", f"cannot be set on a member of pool {spec.pool!r}: "
                             "the pool's spec.gpu is the device; declare the model's share with gpu.memory (and "
                             f"gpu.computePercent) instead, {leave}")
    if spec.canary is not None:
        read.problem("spec.canary", f"a member of pool {spec.pool!r} cannot have a canary: move the model out "
                     "of the pool first (remove spec.pool), or run the candidate as its own InferenceModel")
    if (spec.scaling.min_replicas, spec.scaling.max_replicas) != (DEFAULT_MIN_REPLICAS, DEFAULT_MAX_REPLICAS):
        read.problem("spec.scaling", f"a member of pool {spec.pool!r} is scaled with the pool (ModelPool "
                     f"{spec.pool} spec.scaling); remove minReplicas/maxReplicas here ({spec.scaling.min_replicas}/"
                     f"{spec.scaling.max_replicas}), {leave}")
    if spec.server != Server():
        read.problem("spec.server", f"a member of pool {spec.pool!r} runs in the pool's pods: set it on ModelPool "
                     f"{spec.pool} spec.server instead, {leave}")
    if spec.pool == name:
        read.problem("spec.pool", f"a member cannot have its pool's name ({name!r}): both would own the Service "
                     f"{name!r}; rename the pool or the model")


def _check_sidecar(read: _Reader, spec: InferenceModelSpec) -> None:
    """A Sidecar model runs in each application pod that asks for it: nothing to pool, split or scale."""
    why = "a Sidecar model runs inside its application's pods"
    if spec.pool is not None:
        read.problem("spec.pool", f"{why}, not in a pool: remove spec.pool or spec.mode")
    if spec.canary is not None:
        read.problem("spec.canary", f"{why}: roll a new version out by changing spec.model and restarting the "
                     "application's pods; remove spec.canary")
    if (spec.scaling.min_replicas, spec.scaling.max_replicas) != (DEFAULT_MIN_REPLICAS, DEFAULT_MAX_REPLICAS):
        read.problem("spec.scaling", f"{why}, so it scales with them: remove minReplicas/maxReplicas "
                     f"({spec.scaling.min_replicas}/{spec.scaling.max_replicas})")
    if spec.server != Server():
        read.problem("spec.server", f"{why} and serves them in one process (its Unix sockets are not handed to "
                     "protocol workers): remove spec.server")


def parse_model_pool(name: str, spec: Mapping[str, Any]) -> ModelPoolSpec:
    """Validate a ModelPool ``spec`` or raise :class:`SpecError`."""
    read = _Reader()
    raw_gpu = read.obj(spec, "gpu", "spec")
    gpu = read.gpu(raw_gpu, "spec.gpu")
    if gpu is None:
        read.problem("spec.gpu", "is required: the device every pool replica gets, as count (whole GPUs), "
                     "migProfile (e.g. 3g.40gb) or memory (e.g. 40Gi)")
        gpu = Gpu(memory="0")
    elif gpu.compute_percent is not None:
        read.problem("spec.gpu.computePercent", "is a member's share; a pool gets whole devices: remove it")
    resources = read.resources(read.obj(spec, "resources", "spec"), "spec.resources")
    if resources.gpu is not None:
        read.problem("spec.resources.gpu", "the pool's device is spec.gpu: move it there")
    if not re.fullmatch(POOL_NAME_PATTERN, name):
        read.problem("metadata.name", f"{name!r} names the pool's Deployment and Service, so it must be a DNS "
                     "label: lower-case letters, digits and '-', starting with a letter, at most 63 characters")
    result = ModelPoolSpec(
        gpu=gpu,
        resources=dataclasses.replace(resources, gpu=None),
        scaling=read.scaling(read.obj(spec, "scaling", "spec"), "spec.scaling"),
        shutdown=read.shutdown(read.obj(spec, "shutdown", "spec"), "spec.shutdown"),
        server=read.server(read.obj(spec, "server", "spec"), "spec.server"),
    )
    if read.problems:
        raise SpecError(read.problems)
    return result


def parse_ensemble(name: str, spec: Mapping[str, Any]) -> EnsembleSpec:
    """Validate an Ensemble ``spec`` (wiring included) or raise :class:`SpecError`."""
    read = _Reader()
    inputs = read.tensors(spec.get("inputs"), "spec.inputs")
    outputs = read.tensors(spec.get("outputs"), "spec.outputs")
    raw_steps = spec.get("steps")
    if not isinstance(raw_steps, list) or not raw_steps:
        read.problem("spec.steps", "must list at least one step")
        raw_steps = []
    steps: list[EnsembleStep] = []
    for index, raw in enumerate(raw_steps):
        path = f"spec.steps[{index}]"
        if not isinstance(raw, Mapping):
            read.problem(path, "must be an object")
            continue
        step_name = read.string(raw, "name", path, required=True, pattern=NAME_PATTERN) or f"step{index}"
        ref = read.obj(raw, "modelRef", path)
        inline = read.obj(raw, "model", path)
        if (ref is None) == (inline is None):
            read.problem(path, "set exactly one of modelRef (an InferenceModel's name) or model (inline)")
        steps.append(EnsembleStep(
            name=step_name,
            model_ref=read.string(ref, "name", f"{path}.modelRef", required=True) if ref is not None else None,
            model=read.model_source(inline, f"{path}.model", default_name=step_name) if inline else None,
            resources=read.resources(read.obj(raw, "resources", path), f"{path}.resources"),
            version=read.integer(raw, "version", path, -1, -1, 2**31 - 1),
            input_map=read.string_map(raw, "inputMap", path),
            output_map=read.string_map(raw, "outputMap", path),
        ))
        if (source := steps[-1].model) is not None and inline is not None and "storageUri" in inline:
            read.config_needed(source, f"{path}.model", source.config)
    names = [step.name for step in steps]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        read.problem("spec.steps", f"step name {dup!r} is used more than once; give each step its own name")
    # Wiring: every tensor a step reads is an ensemble input or written by an earlier step.
    available = {tensor.name for tensor in inputs}
    for index, step in enumerate(steps):
        for model_input, tensor in step.input_map.items():
            if tensor not in available:
                read.problem(
                    f"spec.steps[{index}].inputMap.{model_input}",
                    f"reads {tensor!r}, which is neither an ensemble input nor an output of an earlier step "
                    f"(known: {', '.join(sorted(available)) or 'none'})",
                )
        available |= set(step.output_map.values())
    for output in outputs:
        if output.name not in available:
            read.problem(
                "spec.outputs", f"{output.name!r} is not written by any step; map it in a step's outputMap"
            )
    placement = read.string(spec, "placement", "spec", choices=PLACEMENTS) or "Auto"
    result = EnsembleSpec(
        steps=tuple(steps), inputs=inputs, outputs=outputs,
        max_batch_size=read.integer(spec, "maxBatchSize", "spec", 0, 0, MAX_BATCH_SIZE),
        placement=placement,
        resources=read.resources(read.obj(spec, "resources", "spec"), "spec.resources"),
        scaling=read.scaling(read.obj(spec, "scaling", "spec"), "spec.scaling"),
        storage=read.storage(read.obj(spec, "storage", "spec"), "spec.storage"),
        shutdown=read.shutdown(read.obj(spec, "shutdown", "spec"), "spec.shutdown"),
        server=read.server(read.obj(spec, "server", "spec"), "spec.server"),
    )
    if not re.fullmatch(POOL_NAME_PATTERN, name):
        read.problem("metadata.name", f"{name!r} names the ensemble's Deployment and Service, so it must be a DNS "
                     "label: lower-case letters, digits and '-', starting with a letter, at most 63 characters")
    if read.problems:
        raise SpecError(read.problems)
    return result
