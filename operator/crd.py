"""The CustomResourceDefinitions of ``sluice.dev/v1alpha1``, built as data from the constants in ``api``.

``manifests/generate.py`` writes them to ``crds/`` and into the Helm chart; a test checks those files
have not drifted from this module. Every field has a description; bounds, enums and defaults come from
``api`` so the schema and the operator's own validation cannot disagree; CEL rules carry the
cross-field checks (the operator repeats them for servers that do not enforce CEL).
"""

from __future__ import annotations

from typing import Any

from sluice.operator import api

Schema = dict[str, Any]


def _obj(
    description: str, properties: dict[str, Schema], *, required: tuple[str, ...] = (),
    rules: list[dict[str, str]] | None = None, **extra: Any,
) -> Schema:
    schema: Schema = {"type": "object", "description": description, "properties": properties}
    if required:
        schema["required"] = list(required)
    schema.update(extra)
    if rules:
        schema["x-kubernetes-validations"] = rules
    return schema


def _str(description: str, **extra: Any) -> Schema:
    return {"type": "string", "description": description, **extra}


def _int(description: str, minimum: int, maximum: int, **extra: Any) -> Schema:
    return {"type": "integer", "format": "int32", "description": description,
            "minimum": minimum, "maximum": maximum, **extra}


def _quantity(description: str, **extra: Any) -> Schema:
    return {"type": "string", "description": description, "pattern": api.QUANTITY_PATTERN, **extra}


def _rule(rule: str, message: str, **extra: Any) -> dict[str, str]:
    return {"rule": rule, "message": message, **extra}


def _model_source(description: str) -> Schema:
    return _obj(
        description,
        {
            "name": _str(
                "Model name in the runtime's repository and in /v2/models/<name>. Defaults to the "
                "resource's metadata.name.", pattern=api.NAME_PATTERN, maxLength=63,
            ),
            "storageUri": _str(
                "Where the model version's files are: s3://bucket/path, gs://bucket/path, az://container/path "
                "(a prefix is fetched recursively, a single object keeps its name), https://host/path (an archive "
                "or a file), or pvc://claim/path (mounted read-only). Fetched by sluice pull in an init container.",
                pattern=api.STORAGE_URI_PATTERN, maxLength=2048,
            ),
            **_fetch_checks(),
            "format": _str(
                "Model format; picks the runtime backend (onnx -> onnxruntime, torchscript -> pytorch, "
                "tensorrt -> tensorrt, python -> python).", enum=list(api.FORMATS),
            ),
            "version": _int(
                "Model version number; the files are served as <name>/<version>.", 1, 2**31 - 1,
                default=api.DEFAULT_MODEL_VERSION,
            ),
            "config": _str(
                "Inline model configuration (Triton config.pbtxt text, or YAML/JSON per configFormat). "
                "When set it is used verbatim and spec.runtime must be empty.", maxLength=262144,
            ),
            "configFormat": _str(
                "Format of the inline config.", enum=list(api.CONFIG_FORMATS), default="pbtxt",
            ),
        },
        required=("storageUri", "format"),
        # A torchscript model's config (inline unless a .pt2 file) is checked by the operator only: such
        # specs were accepted before torchscript was deployed, and a new CEL rule would refuse every
        # later update of them (finalizer removal included) where the API server does not ratchet.
        rules=_FETCH_RULES,
    )


def _fetch_checks() -> dict[str, Schema]:
    return {
        "checksum": _str(
            "sha256:<64 hex digits> the fetched files must match, as sluice pull prints it: of the file for a "
            "single file or archive, of the manifest of sorted '<path>\\t<sha256>' lines for a prefix. A "
            "mismatch fails the fetch and nothing is served.", pattern=api.CHECKSUM_PATTERN,
        ),
        "sizeLimit": _quantity(
            "The most room the model's files take, e.g. 20Gi: the pod's model-repository emptyDir gets the sum "
            "over its models as sizeLimit and ephemeral-storage request (scheduling on nodes with that much "
            "disk); the fetch refuses a larger model. Without it the emptyDir is unbounded.",
        ),
    }


_FETCH_RULES = [
    _rule("!(has(self.checksum) || has(self.sizeLimit)) || !self.storageUri.startsWith('pvc://')",
          "checksum and sizeLimit do not go with a pvc:// storageUri (the claim is mounted, not copied)"),
]


def _gpu(description: str, *, share: bool) -> Schema:
    """``gpu`` of an InferenceModel (``share``: memory may be a pool member's share) or of a ModelPool."""
    properties: dict[str, Schema] = {
        "count": _int("Number of whole, exclusive GPUs (never a MIG slice or a time-sliced GPU).", 1,
                      api.MAX_GPUS),
        "migProfile": _str(
            "One MIG slice of this profile, e.g. 1g.10gb, 3g.40gb or 1g.10gb+me; rendered as the node's "
            "MIG strategy needs (mixed: nvidia.com/mig-<profile>; single: nvidia.com/gpu on nodes of "
            "that profile).",
            pattern=api.MIG_PROFILE_PATTERN,
        ),
        "memory": _quantity(
            "The least GPU memory the model needs, e.g. 8Gi: the smallest free MIG slice with that "
            "much, else (with shared) a time-sliced GPU whose share has it, else a whole GPU. In a pool "
            "member (spec.pool): the model's share of the pool's device memory instead."
            if share else
            "The pool's device: the smallest free MIG slice with this much memory, else a whole GPU "
            "with it, e.g. 40Gi; the pool's capacity."
        ),
    }
    rules = [_rule(
        "[has(self.count), has(self.migProfile), has(self.memory)].filter(x, x).size() == 1",
        "set exactly one of gpu.count, gpu.migProfile or gpu.memory",
    )]
    if share:
        properties["computePercent"] = _int(
            "With memory: the least share of one GPU's compute, e.g. 25 (a 2g slice of 7 is 28 %). A ModelPool "
            "admits members while their shares add up to at most 100 per device (declared, not enforced).",
            1, 100)
        properties["shared"] = {"type": "boolean", "description":
                                "With memory: time-sliced GPUs may be used (no memory isolation from their "
                                "other pods). Default false."}
        rules += [
            _rule("!has(self.computePercent) || has(self.memory)", "gpu.computePercent only goes with gpu.memory"),
            _rule("!has(self.shared) || !self.shared || has(self.memory)", "gpu.shared only goes with gpu.memory"),
        ]
    return _obj(description, properties, rules=rules)


def _resources(*, gpu: bool = True) -> Schema:
    properties: dict[str, Schema] = {
        "cpu": _quantity("CPU for the runtime container, e.g. 2 or 500m. Operator default if unset."),
        "memory": _quantity("Memory for the runtime container, e.g. 4Gi. Operator default if unset."),
    }
    if gpu:
        properties["gpu"] = _gpu(
            "GPU need, in exactly one form: whole GPUs, one MIG slice, or a device with at least this much "
            "memory (the operator picks the smallest free MIG profile that fits, else a whole GPU; see "
            "status.placement).",
            share=True,
        )
    return _obj(
        "Compute for each runtime pod. Requests equal limits (Guaranteed QoS) so latency is predictable.",
        properties,
    )


def _scaling() -> Schema:
    stabilization = (
        "Seconds of recommendations the autoscaler looks back over before it scales {direction}: it "
        "{verb} to the {extreme} of them, so a short {blip} does not move the replica count. 0 to "
        f"{api.MAX_STABILIZATION_SECONDS}."
    )
    return _obj(
        "Replica bounds. With maxReplicas > minReplicas the model is autoscaled on a per-pod runtime metric "
        "(metric) by a HorizontalPodAutoscaler or a KEDA ScaledObject (engine); docs/operator.md "
        "(\"Autoscaling\") has the setup and the evidence behind the defaults.",
        {
            "minReplicas": _int(
                "Lowest replica count (also what `kubectl scale` sets).", 1, api.MAX_REPLICAS,
                default=api.DEFAULT_MIN_REPLICAS,
            ),
            "maxReplicas": _int("Highest replica count.", 1, api.MAX_REPLICAS, default=api.DEFAULT_MAX_REPLICAS),
            "metric": _str(
                "What the autoscaler keeps at its target, per pod: queueDepth (requests waiting in the "
                "runtime's queue, sluice_queue_depth; target targetQueueDepth), inflight (requests queued or "
                "executing, sluice_inflight_requests; target targetInflight) or latency (the p90 time "
                "requests wait in the queue before they execute, from sluice_queue_duration_seconds; target "
                "targetQueueWaitMilliseconds). Execution time is left out of latency on purpose: more "
                "replicas cannot shorten it.",
                enum=list(api.SCALING_METRICS), default=api.DEFAULT_SCALING_METRIC,
            ),
            "targetQueueDepth": _int(
                "metric queueDepth: average queued requests per pod the autoscaler aims for.", 1,
                api.MAX_SCALING_TARGET, default=api.DEFAULT_TARGET_QUEUE_DEPTH,
            ),
            "targetInflight": _int(
                "metric inflight: average requests queued or executing per pod the autoscaler aims for; about "
                "80% of what one pod holds at full load (maxBatchSize x instances, plus what may queue).", 1,
                api.MAX_SCALING_TARGET, default=api.DEFAULT_TARGET_INFLIGHT,
            ),
            "targetQueueWaitMilliseconds": _int(
                "metric latency: the p90 queue wait per pod, in milliseconds, the autoscaler aims for "
                "(averaged over pods).", 1, api.MAX_QUEUE_WAIT_MILLISECONDS,
                default=api.DEFAULT_TARGET_QUEUE_WAIT_MILLISECONDS,
            ),
            "engine": _str(
                "hpa: a HorizontalPodAutoscaler reading the metric as a Pods custom metric (needs "
                "prometheus-adapter with the chart's rules). keda: a KEDA ScaledObject whose prometheus "
                "trigger queries Prometheus (needs KEDA, and the operator's SLUICE_PROMETHEUS_URL / the "
                "chart's prometheus.url).",
                enum=list(api.SCALING_ENGINES), default=api.DEFAULT_SCALING_ENGINE,
            ),
            "scaleUpStabilizationSeconds": _int(
                stabilization.format(direction="up", verb="rises", extreme="lowest", blip="spike"),
                0, api.MAX_STABILIZATION_SECONDS, default=api.DEFAULT_SCALE_UP_STABILIZATION_SECONDS,
            ),
            "scaleDownStabilizationSeconds": _int(
                stabilization.format(direction="down", verb="falls", extreme="highest", blip="lull")
                + " Longer than the gaps between your traffic's bursts keeps pods for the next burst.",
                0, api.MAX_STABILIZATION_SECONDS, default=api.DEFAULT_SCALE_DOWN_STABILIZATION_SECONDS,
            ),
            "fallbackReplicas": _int(
                "engine keda: replicas to run while Prometheus cannot be read (3 failed polls); from "
                "minReplicas to maxReplicas. Defaults to maxReplicas.", 1, api.MAX_REPLICAS,
            ),
        },
        default={},
        rules=[
            _rule("self.minReplicas <= self.maxReplicas", "minReplicas must be <= maxReplicas"),
            _rule(
                "!has(self.fallbackReplicas) || "
                "(self.fallbackReplicas >= self.minReplicas && self.fallbackReplicas <= self.maxReplicas)",
                "fallbackReplicas must be from minReplicas to maxReplicas",
            ),
        ],
    )


def _shutdown() -> Schema:
    return _obj(
        "How a runtime pod stops (rollouts, scale-down, node drains). A preStop hook keeps the pod serving "
        "for drainSeconds while it is removed from the Service's endpoints; then the runtime stops accepting "
        "and finishes in-flight requests within graceSeconds. The pod's terminationGracePeriodSeconds is "
        "drainSeconds + graceSeconds + 5.",
        {
            "drainSeconds": _int(
                "Seconds the pod keeps serving after it starts terminating, covering endpoint removal "
                "(kube-proxy and load balancers catching up); 0 turns the preStop hook off.",
                0, api.MAX_DRAIN_SECONDS, default=api.DEFAULT_DRAIN_SECONDS,
            ),
            "graceSeconds": _int(
                "Seconds in-flight requests get to finish once the runtime stops accepting.",
                1, api.MAX_SHUTDOWN_GRACE_SECONDS, default=api.DEFAULT_SHUTDOWN_GRACE_SECONDS,
            ),
        },
        default={},
    )


def _server() -> Schema:
    return _obj(
        "Settings of the runtime process itself (not of the model). Left out, the operator's defaults apply "
        "(the chart's runtime.protocolWorkers; unset there, the runtime's own). A change rolls the pods.",
        {
            "protocolWorkers": {
                "description": (
                    "Protocol worker processes that decode HTTP and gRPC requests beside the one that batches and "
                    "runs the models (sluice serve --protocol-workers; docs/frontend-workers.md): auto (the pod's "
                    "CPU limit less two, at most 8, none under 4 CPUs; the usual choice on GPU nodes, where one "
                    "process cannot decode fast enough to keep the device busy) or a count from 0 (one process) "
                    f"to {api.MAX_PROTOCOL_WORKERS}. Each worker needs memory in resources.memory: up to ~0.4 GiB "
                    "under load with large inputs."
                ),
                "x-kubernetes-int-or-string": True,
                "anyOf": [{"type": "integer"}, {"type": "string"}],
                "minimum": 0,
                "maximum": api.MAX_PROTOCOL_WORKERS,
                "pattern": f"^{api.PROTOCOL_WORKERS_AUTO}$",
                # minimum/maximum bind the integer form and pattern the string form; the rule says both
                # again for validators that skip keywords on a node without a type.
                "x-kubernetes-validations": [_rule(
                    f"type(self) == string ? self == '{api.PROTOCOL_WORKERS_AUTO}' : "
                    f"(self >= 0 && self <= {api.MAX_PROTOCOL_WORKERS})",
                    f"protocolWorkers must be {api.PROTOCOL_WORKERS_AUTO} or a count from 0 to "
                    f"{api.MAX_PROTOCOL_WORKERS}",
                )],
            },
        },
    )


def _storage() -> Schema:
    return _obj(
        "Credentials for fetching model files, by reference only: credentials never go into the spec.",
        {
            "serviceAccountName": _str(
                "Service account of the model pods, e.g. one bound to a cloud IAM role (IRSA, Workload Identity).",
                pattern=api.SUBDOMAIN_PATTERN, maxLength=api.MAX_OBJECT_NAME,
            ),
            "secretRef": _obj(
                "A Secret in the same namespace whose keys become environment variables of the fetch init "
                "container (e.g. AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL).",
                {"name": _str("Secret name.", minLength=1, pattern=api.SUBDOMAIN_PATTERN,
                              maxLength=api.MAX_OBJECT_NAME)}, required=("name",),
            ),
        },
    )


def _runtime() -> Schema:
    return _obj(
        "Runtime settings mirroring the model config (Triton config.pbtxt fields). Leave empty when "
        "spec.model.config is given inline.",
        {
            "maxBatchSize": _int(
                "Largest batch the model accepts (max_batch_size); 0 turns batching off.", 0, api.MAX_BATCH_SIZE,
                default=0,
            ),
            "dynamicBatching": _obj(
                "Server-side dynamic batching (dynamic_batching). Needs maxBatchSize > 0.",
                {
                    "preferredBatchSizes": {
                        "type": "array", "description": "Batch sizes the batcher prefers to form.",
                        "maxItems": 16, "items": {"type": "integer", "minimum": 1, "maximum": api.MAX_BATCH_SIZE,
                                                   "description": "A batch size."},
                    },
                    "maxQueueDelayMicroseconds": _int(
                        "How long a request may wait for a batch to fill.", 0, 10_000_000, default=100,
                    ),
                },
            ),
            "queuePolicy": _obj(
                "Queue bounds (default_queue_policy).",
                {
                    "maxQueueSize": _int("Most queued requests; 0 means unbounded.", 0, 1_000_000, default=0),
                    "timeoutMicroseconds": _int(
                        "Queue timeout per request; 0 means none.", 0, 2**31 - 1, default=0,
                    ),
                    "timeoutAction": _str(
                        "What a timed-out request gets.", enum=list(api.TIMEOUT_ACTIONS), default="REJECT",
                    ),
                },
            ),
            "instances": _int("Model instances per pod (instance_group count).", 1, api.MAX_INSTANCES, default=1),
            "responseCache": {
                "type": "boolean", "default": False,
                "description": "Cache responses keyed by model, version and inputs (response_cache).",
            },
            "cudaGraphs": {
                "type": "boolean",
                "description": "Capture a CUDA graph per batch size at load and replay it for each batch "
                               "(optimization.cuda.graphs; the PyTorch backend, format torchscript, on a GPU): "
                               "the preferred batch sizes and maxBatchSize, a formed batch padded up to the "
                               "nearest. Costs GPU memory (docs/cuda-graphs.md).",
            },
        },
        rules=[
            _rule("!has(self.dynamicBatching) || self.maxBatchSize > 0",
                  "dynamicBatching needs maxBatchSize > 0"),
            _rule(
                "!has(self.dynamicBatching) || !has(self.dynamicBatching.preferredBatchSizes) || "
                "self.dynamicBatching.preferredBatchSizes.all(s, s <= self.maxBatchSize)",
                "every preferredBatchSizes entry must be <= maxBatchSize",
            ),
        ],
    )


def _canary() -> Schema:
    return _obj(
        "A second model version that receives a share of the traffic while it is analysed.",
        {
            "storageUri": _str("Files of the canary version.", pattern=api.STORAGE_URI_PATTERN, maxLength=2048),
            **_fetch_checks(),
            "version": _int("Canary version number.", 1, 2**31 - 1),
            "config": _str("Inline config for the canary; defaults to the stable one.", maxLength=262144),
            "runtime": {**_runtime(), "description": "Runtime settings for the canary instead of spec.runtime "
                        "(a batching or queue change is a candidate too); defaults to spec.runtime."},
            "trafficPercent": _int(
                "Share of requests sent to the canary.", 0, 100, default=api.DEFAULT_CANARY_PERCENT,
            ),
            "analysis": _obj(
                "Progressive rollout: the canary's weight rises step by step while each interval of its metrics "
                "passes; a failure or too many inconclusive intervals roll it back. Without it, trafficPercent "
                "is a fixed split.",
                {
                    "stepWeights": {
                        "type": "array", "minItems": 1, "maxItems": 20,
                        "items": {"type": "integer", "format": "int32", "minimum": 1, "maximum": 100,
                                  "description": "Canary traffic percent of one step."},
                        "default": list(api.DEFAULT_STEP_WEIGHTS),
                        "description": "Rising canary traffic percents; after the last one passes, promotion.",
                    },
                    "intervalSeconds": _int("Length of one judged interval.", 10, 86400, default=60),
                    "progressDeadlineSeconds": _int(
                        "A candidate whose pods are not ready this long after it was deployed is rolled back.",
                        60, 86400, default=600,
                    ),
                    "minRequests": _int(
                        "Fewer canary requests in an interval make it inconclusive (never a pass).", 1, 1_000_000_000,
                        default=50,
                    ),
                    "maxErrorRatePercent": {
                        "type": "number", "minimum": 0, "maximum": 100, "default": 1,
                        "description": "An interval fails when the canary's error rate exceeds this.",
                    },
                    "maxLatencyP99Milliseconds": _int("An interval fails when the canary's p99 exceeds this.", 1,
                                                      600_000),
                    "maxLatencyP99RatioToStable": {
                        "type": "number", "minimum": 1, "maximum": 100,
                        "description": "An interval fails when the canary's p99 exceeds this multiple of stable's.",
                    },
                    "failureLimit": _int("Failed intervals tolerated; one more rolls back.", 0, 100, default=0),
                    "inconclusiveLimit": _int("Inconclusive intervals tolerated; one more rolls back.", 0, 100,
                                              default=2),
                    "gates": _obj(
                        "A webhook that must answer 2xx before a weight increase and/or before promotion.",
                        {
                            "url": _str("HTTP(S) URL called with a POST naming the model, candidate and step.",
                                        pattern=api.GATE_URL_PATTERN, maxLength=2048),
                            "beforeStep": {"type": "boolean", "default": False,
                                           "description": "Ask before every weight increase."},
                            "beforePromotion": {"type": "boolean", "default": False,
                                                "description": "Ask before promotion."},
                        },
                        rules=[_rule("!(self.beforeStep || self.beforePromotion) || has(self.url)",
                                     "gates.url is required when beforeStep or beforePromotion is true")],
                    ),
                },
                rules=[_rule("!has(self.maxLatencyP99RatioToStable) || !has(self.stepWeights) || "
                             "self.stepWeights[0] < 100",
                             "maxLatencyP99RatioToStable needs a first step below 100 in stepWeights: at 100% the "
                             "stable version serves nothing to compare with")],
            ),
        },
        required=("storageUri", "version"),
        rules=_FETCH_RULES,
    )


def _condition() -> Schema:
    return _obj(
        "A metav1.Condition.",
        {
            "type": _str("Ready, Progressing or Degraded."),
            "status": _str("True, False or Unknown.", enum=["True", "False", "Unknown"]),
            "reason": _str("CamelCase reason for machines."),
            "message": _str("Human-readable explanation, saying what to change when something is wrong."),
            "lastTransitionTime": _str("When status last changed.", format="date-time"),
            "observedGeneration": {"type": "integer", "format": "int64",
                                   "description": "metadata.generation the condition was computed for."},
        },
        required=("type", "status"),
    )


def _status(extra: dict[str, Schema] | None = None, *, serves_model: bool = True) -> Schema:
    properties: dict[str, Schema] = {
        "observedGeneration": {"type": "integer", "format": "int64",
                               "description": "metadata.generation the operator last reconciled."},
        "conditions": {
            "type": "array", "description": "Ready, Progressing and Degraded.", "items": _condition(),
            "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"],
        },
        "replicas": {"type": "integer", "format": "int32", "description": "Runtime pods that exist."},
        "readyReplicas": {"type": "integer", "format": "int32", "description": "Runtime pods that are ready."},
        "selector": _str("Label selector of the runtime pods (for the scale subresource)."),
        "url": _str("KServe V2 HTTP URL of the model, e.g. http://<svc>.<ns>.svc.cluster.local:8000/v2/models/<m>."),
        "endpoints": _obj("In-cluster endpoints.", {
            "http": _str("HTTP base URL (KServe V2 REST)."),
            "grpc": _str("gRPC target host:port (KServe V2 gRPC)."),
        }),
        "traffic": {
            "type": "array", "description": "Current traffic split between revisions.",
            "items": _obj("One revision's share.", {
                "revision": _str("stable or canary."),
                "version": {"type": "integer", "format": "int64", "description": "Model version."},
                "percent": _int("Share of requests.", 0, 100),
            }),
        },
        "trafficSummary": _str("The traffic split in one word for `kubectl get`, e.g. v1=100."),
    }
    if not serves_model:  # a pool: its members have the URLs and the traffic
        for key in ("url", "traffic", "trafficSummary"):
            del properties[key]
    properties.update(extra or {})
    return _obj("Observed state, written by the operator only.", properties)


_PRINTER_COLUMNS = [
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
     "description": "Whether the model serves requests."},
    {"name": "Replicas", "type": "integer", "jsonPath": ".status.readyReplicas",
     "description": "Ready runtime pods."},
    {"name": "Traffic", "type": "string", "jsonPath": ".status.trafficSummary",
     "description": "Traffic split between revisions."},
    {"name": "URL", "type": "string", "jsonPath": ".status.url", "description": "KServe V2 HTTP URL."},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _canary_status() -> Schema:
    def number(description: str) -> Schema:
        # JSON has no NaN: a value the analysis read as NaN is written as null.
        return {"type": "number", "nullable": True, "description": description + " null: read as NaN."}

    def version_metrics(description: str) -> Schema:
        return _obj(description, {
            "requests": number("Requests in the interval."),
            "errors": number("Requests answered with an error."),
            "errorRatePercent": number("errors / requests, percent."),
            "p99Milliseconds": number("p99 request latency."),
        }, nullable=True)

    return _obj("The canary rollout: where it stands and why (the operator never writes spec).", {
        "phase": _str("Initializing, Progressing, Manual, Promoting, Finalising, Succeeded or RolledBack."),
        "summary": _str("The phase and step for `kubectl get im`, e.g. Progressing 2/4."),
        "candidate": _str("The candidate: v<version>-<hash of everything that changes its pods>."),
        "step": {"type": "integer", "format": "int32", "description": "Index into stepWeights; -1 before the first."},
        "weight": _int("Percent of requests the canary gets now.", 0, 100),
        "intervalStarted": {"type": "number", "description": "When the interval being judged began (Unix seconds)."},
        "failures": {"type": "integer", "format": "int32", "description": "Failed intervals so far."},
        "inconclusives": {"type": "integer", "format": "int32", "description": "Inconclusive intervals so far."},
        "failedCandidate": _str("A candidate that was rolled back; it is not tried again until spec.canary changes."),
        "lastResult": _str("The last interval's verdict: Successful, Failed or Inconclusive."),
        "message": _str("Why the last decision was made."),
        "unreadySince": {"type": "number", "description": "When the canary lost its last ready pod during the "
                         "analysis or promotion (Unix seconds; 0: it has one). Rolled back progressDeadlineSeconds "
                         "later."},
        "serves": _str("A hash of what the candidate serves (model source and runtime), to tell when it is folded "
                       "into spec.model."),
        "awaitingGate": _str("step or promotion while the analysis passed and the gate has not approved the "
                             "next move (the canary is still judged once per interval meanwhile); empty otherwise."),
        "router": _str("Who applies the weight: gateway-api, istio or none (the stable pods forward)."),
        "gate": _str("Why the gate held the rollout, when it did."),
        "help": _str("What to change in spec to promote by hand or to abort."),
        "lastMetrics": _obj("The numbers the last judged interval saw, per track.", {
            "canary": version_metrics("The candidate's numbers."),
            "stable": version_metrics("The stable version's numbers."),
        }),
    })


def _placement_status() -> Schema:
    strings = {"type": "array", "items": {"type": "string"}}
    return _obj("Where the GPU planner put the model and why (docs/operator.md, \"GPUs and MIG\"). The model "
                "keeps this placement while it still answers the same need: adding models never moves it.", {
        "state": _str("Placed, Pending (the capacity exists but is held), Unsatisfiable (no such capacity) or "
                      "Unplanned (no GPU nodes visible: rendered from the spec alone)."),
        "reason": _str("Why this device, or exactly what capacity is missing."),
        "need": _str("The GPU need this placement answers; a different need is planned again."),
        "device": _str("The device each replica gets, e.g. MIG 1g.10gb (mixed strategy)."),
        "kind": _str("mixed, single, shared, whole or dra."),
        "resource": _str("The extended resource asked for (dra: gpu or mig)."),
        "count": {"type": "integer", "format": "int32", "minimum": 1, "description": "Devices per replica."},
        "profile": _str("The MIG profile, when it is a slice."),
        "memoryMiB": {"type": "integer", "format": "int64", "description": "Least memory of the device."},
        "products": {**strings, "description": "nvidia.com/gpu.product values the pods are pinned to (for a "
                     "time-sliced MIG slice under the mixed strategy, nvidia.com/mig-<profile>.product values)."},
        "avoidProducts": {**strings, "description": "nvidia.com/mig-<profile>.product values an exclusive slice "
                          "stays off: nodes that time-slice the same resource name."},
        "tolerations": {"type": "array", "description": "Taints of those nodes the pods tolerate.",
                        "items": _obj("A toleration.", {"key": _str("Taint key."), "operator": _str("Exists."),
                                                        "effect": _str("NoSchedule or NoExecute.")})},
        "nodePools": {**strings, "description": "Node pools of the nodes it may land on."},
        "nodes": {**strings, "description": "Nodes the plan counted its replicas on (first 10)."},
        "replanToken": _str("The sluice.dev/replan annotation this placement was made for."),
        "held": {"type": "boolean", "description": "Whether the model holds this device (it was placed there): "
                 "only a held placement is kept when models are planned again; a Pending one that was never "
                 "held is planned afresh each time. Absent (older operators): held when state is Placed."},
        "advice": {"type": "array", "description": "MIG repartitionings that would fit the model (advice only).",
                   "items": _obj("One node's new MIG layout.", {
                       "node": _str("The node."),
                       "migConfig": _str("The nvidia.com/mig.config label value."),
                       "layout": {**strings, "description": "Per GPU, its instances."},
                       "disruptsGpus": {"type": "array", "items": {"type": "integer"},
                                        "description": "GPUs whose partition changes (their pods restart)."},
                       "howTo": _str("How to apply it."),
                       "migParted": _str("MIG manager's config document (JSON) for this layout."),
                   })},
    })


def _crd(kind: str, plural: str, short_names: list[str], description: str, spec: Schema,
         status_extra: dict[str, Schema] | None = None,
         columns: list[dict[str, Any]] | None = None, serves_model: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind, "listKind": f"{kind}List", "plural": plural, "singular": kind.lower(),
                "shortNames": short_names, "categories": ["sluice", "all"],
            },
            "versions": [{
                "name": api.VERSION,
                "served": True,
                "storage": True,
                "subresources": {
                    "status": {},
                    "scale": {
                        "specReplicasPath": ".spec.scaling.minReplicas",
                        "statusReplicasPath": ".status.replicas",
                        "labelSelectorPath": ".status.selector",
                    },
                },
                "additionalPrinterColumns": columns or _PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": _obj(
                    description,
                    {
                        "apiVersion": _str("APIVersion of this object."),
                        "kind": _str("Kind of this object."),
                        "metadata": {"type": "object"},
                        "spec": spec,
                        "status": _status(status_extra, serves_model=serves_model),
                    },
                    required=("spec",),
                )},
            }],
        },
    }


def inference_model_crd() -> dict[str, Any]:
    spec = _obj(
        "Desired state: one model served by Sluice runtime pods behind one Service.",
        {
            "model": _model_source("The model to serve (the stable revision)."),
            "runtime": _runtime(),
            "resources": _resources(),
            "scaling": _scaling(),
            "canary": _canary(),
            "storage": _storage(),
            "shutdown": _shutdown(),
            "server": _server(),
            "pool": _str(
                "A ModelPool in the same namespace whose runtime pods serve this model next to other members "
                "on one GPU or MIG slice, instead of a Deployment of its own. A member declares its share in "
                "resources.gpu.memory (and optionally computePercent), and sets no gpu.count or migProfile, "
                "no canary and no replica bounds: the pool scales. Its Service keeps its name.",
                pattern=api.POOL_NAME_PATTERN, maxLength=63,
            ),
            "mode": _str(
                "Deployment (the default): runtime pods of its own behind a Service. Sidecar: no Deployment, "
                "Service or autoscaler; the operator renders the model config and its admission webhook injects "
                "the runtime into application pods annotated sluice.dev/inject: <this name>, in namespaces "
                "labelled sluice.dev/injection: enabled (docs/operator.md, \"Sidecar mode\"). A Sidecar model "
                "has no pool, no canary and no replica bounds.",
                enum=list(api.MODES), default=api.DEPLOYMENT_MODE,
            ),
        },
        required=("model",),
        rules=[
            _rule("!has(self.model.config) || !has(self.runtime)",
                  "spec.runtime cannot be combined with an inline spec.model.config"),
            _rule("!has(self.canary) || self.canary.version != self.model.version || "
                  "self.canary.storageUri != self.model.storageUri || has(self.canary.runtime) || "
                  "has(self.canary.config)",
                  "spec.canary must differ from spec.model in version, storageUri, config or runtime"),
            _rule("!has(self.pool) || (has(self.resources) && has(self.resources.gpu) && "
                  "has(self.resources.gpu.memory))",
                  "a pool member must declare spec.resources.gpu.memory, its share of the pool's GPU memory"),
            _rule("!has(self.pool) || !has(self.canary)",
                  "a pool member cannot have spec.canary: move it out of the pool first, or run the candidate "
                  "as its own InferenceModel"),
            _rule("!has(self.pool) || !has(self.scaling) || "
                  "(self.scaling.minReplicas == 1 && self.scaling.maxReplicas == 1)",
                  "a pool member is scaled with its pool: remove spec.scaling's minReplicas and maxReplicas"),
            _rule("!has(self.pool) || !has(self.server) || !has(self.server.protocolWorkers)",
                  "a pool member runs in its pool's pods: set spec.server on the ModelPool"),
            _rule("!has(self.mode) || self.mode != 'Sidecar' || !has(self.server) || "
                  "!has(self.server.protocolWorkers)",
                  "a Sidecar model's runtime serves its application in one process: remove spec.server"),
            _rule("!has(self.mode) || self.mode != 'Sidecar' || (!has(self.pool) && !has(self.canary) && "
                  "(!has(self.scaling) || (self.scaling.minReplicas == 1 && self.scaling.maxReplicas == 1)))",
                  "a Sidecar model runs in its application's pods: remove spec.pool, spec.canary and spec.scaling"),
        ],
    )
    return _crd(
        api.INFERENCE_MODEL_KIND, api.INFERENCE_MODEL_PLURAL, ["im", "ims"],
        "InferenceModel serves one model (with an optional canary) over KServe V2 HTTP and gRPC.", spec,
        status_extra={"canary": _canary_status(), "placement": _placement_status(), "pool": _obj(
            "Where a pool member stands in its pool (spec.pool).", {
                "name": _str("The ModelPool."),
                "state": _str("Admitted (served by the pool's pods) or Waiting (not served: see reason)."),
                "reason": _str("Why it waits: what is missing, e.g. needs 6 GiB, pool small has 2 GiB free of "
                               "40 GiB."),
            })},
        columns=[*_PRINTER_COLUMNS[:3],
                 {"name": "Canary", "type": "string", "jsonPath": ".status.canary.summary",
                  "description": "The canary rollout's phase and step."},
                 _PRINTER_COLUMNS[3],
                 {"name": "GPU", "type": "string", "jsonPath": ".status.placement.device", "priority": 1,
                  "description": "The GPU device each replica gets."},
                 *_PRINTER_COLUMNS[4:]],
    )


def _tensors(description: str) -> Schema:
    return {
        "type": "array", "description": description, "minItems": 1, "maxItems": 64,
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
        "items": _obj("A tensor.", {
            "name": _str("Tensor name.", minLength=1),
            "dataType": _str("Triton data type.", enum=list(api.DATA_TYPES)),
            "dims": {"type": "array", "description": "Shape without the batch dimension; -1 is variable.",
                     "items": {"type": "integer", "minimum": -1, "description": "One dimension."}},
        }, required=("name", "dataType", "dims")),
    }


def ensemble_crd() -> dict[str, Any]:
    tensor_map = {"type": "object", "additionalProperties": {"type": "string"}}
    step = _obj(
        "One model call in the pipeline.",
        {
            "name": _str("Step name, unique in the ensemble.", pattern=api.NAME_PATTERN),
            "modelRef": _obj("An InferenceModel in the same namespace.", {
                "name": _str("InferenceModel name.", minLength=1),
            }, required=("name",)),
            "model": _model_source("An inline model served inside the ensemble's pods."),
            "resources": {**_resources(), "description": (
                "What the step's model needs when the steps share the ensemble's pods (placement "
                "Colocated, or Auto when they fit): its gpu, else the referenced InferenceModel's; cpu and "
                "memory (else the InferenceModel's) add up over the steps into the runtime container's, "
                "each one the Ensemble's own resources do not set. Not used when the steps are called "
                "remotely (the InferenceModels' pods have their own).")},
            "version": _int("Model version to call; -1 is the latest.", -1, 2**31 - 1, default=-1),
            "inputMap": {**tensor_map, "description": "Step model input -> ensemble tensor it reads."},
            "outputMap": {**tensor_map, "description": "Step model output -> ensemble tensor it writes."},
        },
        required=("name",),
        rules=[_rule(
            "has(self.modelRef) != has(self.model)", "set exactly one of modelRef or model",
        )],
    )
    spec = _obj(
        "Desired state: a pipeline of models served as one model endpoint.",
        {
            "steps": {
                "type": "array", "description": "Pipeline steps, in order.", "minItems": 1, "maxItems": 32,
                "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"], "items": step,
            },
            "inputs": _tensors("Ensemble inputs."),
            "outputs": _tensors("Ensemble outputs."),
            "maxBatchSize": _int("Largest batch the ensemble accepts; 0 turns batching off.", 0,
                                 api.MAX_BATCH_SIZE, default=0),
            "placement": _str(
                "Auto colocates all steps in the ensemble's pods when they fit (see the operator's "
                "maxColocatedGpus), otherwise calls the step InferenceModels' Services over gRPC. Colocated "
                "and Remote force one or the other.", enum=list(api.PLACEMENTS), default="Auto",
            ),
            "resources": _resources(),
            "scaling": _scaling(),
            "storage": _storage(),
            "shutdown": _shutdown(),
            "server": _server(),
        },
        required=("steps", "inputs", "outputs"),
    )
    status_extra = {"placement": _str("Colocated or Remote: where the steps run.")}
    return _crd(
        api.ENSEMBLE_KIND, api.ENSEMBLE_PLURAL, ["ens"],
        "Ensemble serves a pipeline of models as one KServe V2 model.", spec, status_extra,
    )


def model_pool_crd() -> dict[str, Any]:
    spec = _obj(
        "Desired state: one runtime Deployment whose pods each get one device (gpu) and serve every admitted "
        "member, the InferenceModels whose spec.pool names this pool.",
        {
            "gpu": _gpu(
                "The device each pool replica gets, in exactly one form: whole GPUs, one MIG slice, or one GPU "
                "with at least this much memory. Members declare shares of its memory (capacity: gpu.memory; "
                "for migProfile the profile's nominal memory; for count one GPU's memory, learned from the nodes "
                "the pool is placed on, and until then unknown, so members are admitted on computePercent "
                "alone).", share=False,
            ),
            "resources": _resources(gpu=False),
            "scaling": {**_scaling(), "description": "Replica bounds of the pool: it scales as one, on its pods' "
                        "runtime metric summed over every member (members have no autoscaling of their own)."},
            "shutdown": _shutdown(),
            "server": _server(),
        },
        required=("gpu",),
    )
    member = _obj("An admitted member.", {
        "name": _str("The InferenceModel."),
        "memoryMiB": {"type": "integer", "format": "int64", "description": "Its share of device memory, MiB."},
        "computePercent": {"type": "integer", "format": "int32", "description": "Its share of compute, percent."},
    })
    waiting = _obj("A member that is not served.", {
        "name": _str("The InferenceModel."),
        "cause": _str("PoolFull (not enough memory or compute), PoolConflict (it cannot share the pods), or "
                      "InvalidSpec / NotImplemented (its spec rules it out)."),
        "reason": _str("What is missing, e.g. needs 6 GiB, pool small has 2 GiB free of 40 GiB."),
    })
    nullable_int = {"type": "integer", "format": "int64", "nullable": True}
    status_extra = {
        "placement": _placement_status(),
        "members": {"type": "array", "description": "Admitted members, oldest first.", "items": member},
        "waiting": {"type": "array", "description": "Members that wait for room, oldest first.", "items": waiting},
        "membersSummary": _str("Admitted and waiting members for `kubectl get mpool`."),
        "capacity": _obj("The device's memory and compute, and how much the admitted members declared.", {
            "memoryMiB": {**nullable_int, "description": "Device memory in MiB; null when unknown (see note)."},
            "usedMiB": {"type": "integer", "format": "int64", "description": "Declared by admitted members."},
            "freeMiB": {**nullable_int, "description": "memoryMiB - usedMiB; null when unknown."},
            "computePercent": {"type": "integer", "format": "int32",
                               "description": "Compute shares available in all: 100 per device."},
            "computePercentUsed": {"type": "integer", "format": "int32",
                                   "description": "Compute shares declared by admitted members."},
            "summary": _str("Free memory for `kubectl get mpool`, e.g. 4 GiB of 40 GiB."),
            "note": _str("Why the memory is unknown, when it is."),
        }),
    }
    columns = [
        {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
         "description": "Whether a pool replica is available."},
        {"name": "Members", "type": "string", "jsonPath": ".status.membersSummary",
         "description": "Admitted and waiting members."},
        {"name": "Free", "type": "string", "jsonPath": ".status.capacity.summary",
         "description": "Device memory the admitted members leave free."},
        _PRINTER_COLUMNS[1],  # Replicas
        _PRINTER_COLUMNS[-1],  # Age
    ]
    return _crd(
        api.MODEL_POOL_KIND, api.MODEL_POOL_PLURAL, ["mpool", "mpools"],
        "ModelPool serves several small InferenceModels (spec.pool) from one runtime Deployment, each replica "
        "on one GPU or MIG slice, admitting them while their declared memory and compute shares fit.",
        spec, status_extra, columns, serves_model=False,
    )


def all_crds() -> list[dict[str, Any]]:
    return [inference_model_crd(), ensemble_crd(), model_pool_crd()]
