"""Spec parsing: every CEL rule of the CRD is re-checked, with messages that say what to change."""

from __future__ import annotations

import pytest

from sluice.operator import api, builders, sidecar
from sluice.operator.settings import Settings

MODEL = {"storageUri": "s3://bucket/m", "format": "onnx"}


def problems(spec: dict) -> list[str]:
    with pytest.raises(api.SpecError) as info:
        api.parse_inference_model("m", spec)
    return list(info.value.problems)


def test_defaults_match_the_crd():
    spec = api.parse_inference_model("m", {"model": MODEL})
    assert spec.model.name == "m"
    assert spec.model.version == api.DEFAULT_MODEL_VERSION
    assert spec.scaling == api.Scaling(1, 1, api.DEFAULT_TARGET_QUEUE_DEPTH)
    assert spec.runtime == api.RuntimeConfig()
    assert spec.shutdown == api.Shutdown(drain_seconds=5, grace_seconds=30)


@pytest.mark.parametrize(("spec", "expected"), [
    ({}, "spec.model: is required"),
    ({"model": {**MODEL, "storageUri": "ftp://x"}}, "use s3://bucket/path"),
    ({"model": {**MODEL, "format": "keras"}}, "spec.model.format: must be one of onnx, torchscript"),
    ({"model": MODEL, "scaling": {"minReplicas": 3, "maxReplicas": 2}},
     "minReplicas (3) must be <= maxReplicas (2); raise maxReplicas or lower minReplicas"),
    ({"model": MODEL, "resources": {"gpu": {}}}, "set exactly one of count (whole GPUs)"),
    ({"model": MODEL, "resources": {"gpu": {"count": 1, "memory": "16Gi"}}}, "got count, memory"),
    ({"model": MODEL, "resources": {"gpu": {"migProfile": "9g.1tb"}}}, "spec.resources.gpu.migProfile"),
    ({"model": MODEL, "runtime": {"dynamicBatching": {}}}, "needs maxBatchSize > 0"),
    ({"model": MODEL, "runtime": {"maxBatchSize": 4, "dynamicBatching": {"preferredBatchSizes": [8]}}},
     "every size must be <= maxBatchSize (4)"),
    ({"model": {**MODEL, "config": "name: 'm'"}, "runtime": {"maxBatchSize": 4}},
     "cannot be combined with spec.model.config"),
    ({"model": MODEL, "canary": {"storageUri": MODEL["storageUri"], "version": 1}}, "is identical to spec.model"),
    ({"model": MODEL, "storage": {"secretRef": {}}}, "spec.storage.secretRef.name: is required"),
    ({"model": MODEL, "canary": {"storageUri": "s3://b/m2", "version": 2, "analysis": {
        "stepWeights": [100], "maxLatencyP99RatioToStable": 1.5}}},
     "spec.canary.analysis.maxLatencyP99RatioToStable: needs a first step below 100 in stepWeights (got [100])"),
    ({"model": MODEL, "storage": {"secretRef": {"name": "S3_Credentials"}}},
     "spec.storage.secretRef.name: 'S3_Credentials' does not match"),
    ({"model": MODEL, "storage": {"serviceAccountName": "model reader"}},
     "spec.storage.serviceAccountName: 'model reader' does not match ^[a-z0-9]"),
    ({"model": MODEL, "storage": {"serviceAccountName": "-reader"}}, "(a Kubernetes object name: lower-case letters"),
    ({"model": MODEL, "storage": {"secretRef": {"name": "a" * 254}}},
     "spec.storage.secretRef.name: is 254 characters (a Kubernetes object name"),
    ({"model": {**MODEL, "checksum": "md5:abc"}}, "spec.model.checksum: 'md5:abc' does not match"),
    ({"model": {**MODEL, "checksum": "sha256:" + "AB" * 32}}, "64 lower-case hex digits"),
    ({"model": {**MODEL, "sizeLimit": "20GB"}}, "spec.model.sizeLimit: '20GB' does not match"),
    ({"model": {**MODEL, "sizeLimit": "0"}}, "spec.model.sizeLimit: must be at least 1 byte"),
    ({"model": {**MODEL, "storageUri": "pvc://claim/m", "checksum": "sha256:" + "ab" * 32}},
     "spec.model.checksum: does not go with a pvc:// storageUri"),
    ({"model": MODEL, "canary": {"storageUri": "s3://b/m2", "version": 2, "sizeLimit": "x"}},
     "spec.canary.sizeLimit: 'x' does not match"),
    ({"model": MODEL, "shutdown": {"drainSeconds": -1}}, "spec.shutdown.drainSeconds: must be from 0 to 600"),
    ({"model": MODEL, "shutdown": {"graceSeconds": 0}}, "spec.shutdown.graceSeconds: must be from 1 to 3600"),
    ({"model": MODEL, "server": {"protocolWorkers": 65}},
     "spec.server.protocolWorkers: must be auto (one worker per CPU of the pod's limit past two, at most 8) or an "
     "integer from 0 to 64, got 65"),
    ({"model": MODEL, "server": {"protocolWorkers": -1}}, "spec.server.protocolWorkers: must be auto"),
    ({"model": MODEL, "server": {"protocolWorkers": "4"}}, "an integer from 0 to 64, got '4'"),
    ({"model": MODEL, "server": {"protocolWorkers": "Auto"}}, "got 'Auto'"),
    ({"model": MODEL, "server": {"protocolWorkers": True}}, "got True"),
    ({"model": MODEL, "server": {"protocolWorkers": 2.5}}, "got 2.5"),
    ({"model": MODEL, "server": "auto"}, "spec.server: must be an object"),
    ({"model": MODEL, "scaling": {"metric": "cpu"}},
     "spec.scaling.metric: must be one of queueDepth, inflight, latency, got 'cpu'"),
    ({"model": MODEL, "scaling": {"engine": "vpa"}}, "spec.scaling.engine: must be one of hpa, keda, got 'vpa'"),
    ({"model": MODEL, "scaling": {"targetInflight": 0}}, "spec.scaling.targetInflight: must be from 1 to 100000"),
    ({"model": MODEL, "scaling": {"targetQueueWaitMilliseconds": "50ms"}},
     "spec.scaling.targetQueueWaitMilliseconds: must be an integer from 1 to 600000, got '50ms'"),
    ({"model": MODEL, "scaling": {"scaleDownStabilizationSeconds": 7200}},
     "spec.scaling.scaleDownStabilizationSeconds: must be from 0 to 3600, got 7200"),
    ({"model": MODEL, "scaling": {"scaleUpStabilizationSeconds": -1}},
     "spec.scaling.scaleUpStabilizationSeconds: must be from 0 to 3600"),
    ({"model": MODEL, "scaling": {"minReplicas": 2, "maxReplicas": 8, "fallbackReplicas": 9}},
     "spec.scaling.fallbackReplicas: must be from minReplicas (2) to maxReplicas (8), got 9"),
])
def test_invalid_specs_say_what_to_change(spec, expected):
    assert any(expected in p for p in problems(spec)), problems(spec)


@pytest.mark.parametrize("value", ["auto", 0, 1, 8, 64])
def test_protocol_workers_are_auto_or_a_count(value):
    spec = {"model": MODEL, "server": {"protocolWorkers": value}}
    assert api.parse_inference_model("m", spec).server == api.Server(protocol_workers=value)
    assert api.parse_inference_model("m", {"model": MODEL}).server == api.Server(protocol_workers=None)
    assert api.parse_inference_model("m", {"model": MODEL, "server": {}}).server == api.Server()


def test_pools_and_ensembles_take_server_settings_and_sidecars_refuse_them():
    pool = api.parse_model_pool("small", {"gpu": {"count": 1}, "server": {"protocolWorkers": "auto"}})
    assert pool.server.protocol_workers == "auto"
    ensemble = api.parse_ensemble("e", {
        "steps": [{"name": "s", "modelRef": {"name": "m"}, "inputMap": {"x": "IN"}, "outputMap": {"y": "OUT"}}],
        "inputs": [{"name": "IN", "dataType": "TYPE_FP32", "dims": [4]}],
        "outputs": [{"name": "OUT", "dataType": "TYPE_FP32", "dims": [4]}],
        "server": {"protocolWorkers": 3}})
    assert ensemble.server.protocol_workers == 3
    found = problems({"model": MODEL, "mode": "Sidecar", "server": {"protocolWorkers": 2}})
    assert any(p.startswith("spec.server: a Sidecar model runs inside its application's pods") and
               "remove spec.server" in p for p in found), found
    # Leaving it at the default is not a problem.
    assert api.parse_inference_model("m", {"model": MODEL, "mode": "Sidecar", "server": {}}).server == api.Server()


TS_CONFIG = 'backend: "pytorch"\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'


def test_a_torchscript_model_needs_its_config_unless_it_is_a_torch_export_program():
    found = problems({"model": {"storageUri": "s3://b/m/1", "format": "torchscript"}})
    assert any(p.startswith("spec.model.config: is required for a torchscript model: TorchScript declares no "
                            "input or output shapes") and "a storageUri naming one .pt2 file" in p
               for p in found), found
    for model in ({"storageUri": "s3://b/m/1", "format": "torchscript", "config": TS_CONFIG},
                  {"storageUri": "s3://b/m/model.pt2", "format": "torchscript"},
                  {"storageUri": "https://h/m.pt2?X-Amz-Signature=ab", "format": "torchscript"}):
        assert api.parse_inference_model("m", {"model": model}).model.format == "torchscript"
    # Only one fetched .pt2 file is a program: not a query string's, a prefix's or a mounted claim's.
    for uri in ("https://h/m.pt?x=a.pt2", "s3://b/m.pt2/", "pvc://claim/m/model.pt2"):
        assert any("spec.model.config: is required" in p
                   for p in problems({"model": {"storageUri": uri, "format": "torchscript"}})), uri
    # A canary runs with its own config, else the stable one; a .pt2 candidate needs neither.
    stable = {"storageUri": "s3://b/m/model.pt2", "format": "torchscript"}
    found = problems({"model": stable, "canary": {"storageUri": "s3://b/m/2", "version": 2}})
    assert any(p.startswith("spec.canary.config: is required for a torchscript model") for p in found), found
    for canary in ({"storageUri": "s3://b/m/2", "version": 2, "config": TS_CONFIG},
                   {"storageUri": "s3://b/m2/model.pt2", "version": 2}):
        api.parse_inference_model("m", {"model": stable, "canary": canary})
    api.parse_inference_model("m", {"model": {**stable, "storageUri": "s3://b/m/1", "config": TS_CONFIG},
                                    "canary": {"storageUri": "s3://b/m/2", "version": 2}})
    with pytest.raises(api.SpecError, match=r"spec.steps\[0\].model.config: is required for a torchscript"):
        api.parse_ensemble("e", {"steps": [{"name": "s", "model": {"storageUri": "s3://b/m", "format": "torchscript"},
                                            "inputMap": {"x": "IN"}, "outputMap": {"y": "OUT"}}],
                                 "inputs": [{"name": "IN", "dataType": "TYPE_FP32", "dims": [4]}],
                                 "outputs": [{"name": "OUT", "dataType": "TYPE_FP32", "dims": [4]}]})


@pytest.mark.parametrize(("model", "ok"), [
    ({"storageUri": "s3://b/m/resnet50.pt", "format": "torchscript", "config": TS_CONFIG}, False),
    ({"storageUri": "s3://b/m/resnet50.pt", "format": "torchscript",
      "config": TS_CONFIG + 'default_model_filename: "resnet50.pt"\n'}, True),
    ({"storageUri": "s3://b/m/model.pt", "format": "torchscript", "config": TS_CONFIG}, True),
    ({"storageUri": "https://h/r.onnx", "format": "onnx", "config": 'backend: "onnxruntime"\n'}, False),
    ({"storageUri": "s3://b/m/1", "format": "torchscript", "config": TS_CONFIG}, True),  # a prefix
])
def test_an_inline_config_names_a_single_file_the_runtime_would_not_find(model, ok):
    if ok:
        api.parse_inference_model("m", {"model": model})
    else:
        name = model["storageUri"].rsplit("/", 1)[1]
        assert any(p.startswith(f"spec.model.config: does not name the model file: the storageUri is fetched as "
                                f"{name!r}") and f'add default_model_filename: "{name}"' in p
                   for p in problems({"model": model}))


PT2 = {"storageUri": "s3://b/m/model.pt2", "format": "torchscript"}


def test_cuda_graphs_are_asked_for_a_pytorch_model_on_a_gpu():
    gpu = {"gpu": {"count": 1}}
    spec = api.parse_inference_model("m", {"model": PT2, "resources": gpu,
                                           "runtime": {"maxBatchSize": 8, "cudaGraphs": True}})
    assert spec.runtime.cuda_graphs is True
    assert api.parse_inference_model("m", {"model": PT2, "runtime": {"maxBatchSize": 8}}).runtime.cuda_graphs is False
    for spec_data, expected in (
        ({"model": MODEL, "resources": gpu, "runtime": {"cudaGraphs": True}},
         "spec.runtime.cudaGraphs: CUDA graphs are captured by the PyTorch backend only (format torchscript), "
         "not for format onnx"),
        ({"model": PT2, "runtime": {"cudaGraphs": True}}, "spec.runtime.cudaGraphs: needs a GPU (spec.resources.gpu)"),
        ({"model": PT2, "resources": gpu, "runtime": {"cudaGraphs": "yes"}},
         "spec.runtime.cudaGraphs: must be true or false, got 'yes'"),
        ({"model": MODEL, "resources": gpu, "canary": {"storageUri": "s3://b/m2", "version": 2,
                                                      "runtime": {"cudaGraphs": True}}},
         "spec.canary.runtime.cudaGraphs: CUDA graphs are captured by the PyTorch backend only"),
    ):
        assert any(p.startswith(expected) for p in problems(spec_data)), problems(spec_data)


def test_scaling_fields_and_their_defaults():
    default = api.parse_inference_model("m", {"model": MODEL, "scaling": {"minReplicas": 1, "maxReplicas": 4}}).scaling
    assert (default.metric, default.engine, default.target) == ("queueDepth", "hpa", api.DEFAULT_TARGET_QUEUE_DEPTH)
    assert (default.scale_up_stabilization_seconds, default.scale_down_stabilization_seconds) == (0, 300)
    assert default.fallback_replicas is None
    scaling = api.parse_inference_model("m", {"model": MODEL, "scaling": {
        "minReplicas": 2, "maxReplicas": 8, "metric": "latency", "engine": "keda", "targetQueueWaitMilliseconds": 20,
        "targetInflight": 12, "scaleUpStabilizationSeconds": 30, "scaleDownStabilizationSeconds": 600,
        "fallbackReplicas": 4,
    }}).scaling
    assert scaling == api.Scaling(
        min_replicas=2, max_replicas=8, metric="latency", engine="keda", target_queue_wait_ms=20, target_inflight=12,
        scale_up_stabilization_seconds=30, scale_down_stabilization_seconds=600, fallback_replicas=4,
    )
    assert scaling.target == 20
    assert api.Scaling(metric="inflight", target_inflight=12).target == 12


def test_az_sources_checksums_and_size_limits_are_read():
    spec = api.parse_inference_model("m", {"model": {"storageUri": "az://container/m/1", "format": "onnx",
                                                     "checksum": "sha256:" + "ab" * 32, "sizeLimit": "20Gi"},
                                           "canary": {"storageUri": "az://container/m/2", "version": 2,
                                                      "checksum": "sha256:" + "cd" * 32}})
    assert (spec.model.checksum, spec.model.size_limit) == ("sha256:" + "ab" * 32, "20Gi")
    assert spec.canary is not None and spec.canary.checksum == "sha256:" + "cd" * 32


def test_all_problems_are_reported_at_once():
    found = problems({"model": {**MODEL, "format": "x"}, "scaling": {"minReplicas": 0}})
    assert len(found) == 2


def test_ensemble_wiring_is_checked():
    spec = {
        "inputs": [{"name": "IN", "dataType": "TYPE_FP32", "dims": [4]}],
        "outputs": [{"name": "OUT", "dataType": "TYPE_FP32", "dims": [4]}],
        "steps": [
            {"name": "a", "modelRef": {"name": "m"}, "inputMap": {"x": "MISSING"}, "outputMap": {"y": "mid"}},
            {"name": "a", "modelRef": {"name": "m"}, "model": MODEL},
        ],
    }
    with pytest.raises(api.SpecError) as info:
        api.parse_ensemble("e", spec)
    text = str(info.value)
    assert "reads 'MISSING', which is neither an ensemble input nor an output of an earlier step" in text
    assert "step name 'a' is used more than once" in text
    assert "set exactly one of modelRef" in text
    assert "'OUT' is not written by any step" in text


def test_quantities():
    assert api.quantity_to_float("24Gi") == 24 * 2**30
    assert api.quantity_to_float("500m") == 0.5
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        api.quantity_to_float("lots")


CANARY = {"storageUri": "s3://bucket/m2", "version": 2}


def test_canary_analysis_defaults_and_fields():
    spec = api.parse_inference_model("m", {"model": MODEL, "canary": {**CANARY, "analysis": {}}})
    assert spec.canary is not None and spec.canary.analysis == api.CanaryAnalysis()
    assert spec.canary.analysis.step_weights == (5, 25, 50, 100)
    full = {
        "stepWeights": [10, 50],
        "intervalSeconds": 30,
        "minRequests": 200,
        "maxErrorRatePercent": 0.5,
        "maxLatencyP99Milliseconds": 250,
        "maxLatencyP99RatioToStable": 1.5,
        "failureLimit": 1,
        "inconclusiveLimit": 3,
        "gates": {"url": "https://gate.example/approve", "beforePromotion": True},
    }
    analysis = api.parse_inference_model("m", {"model": MODEL, "canary": {**CANARY, "analysis": full}}).canary.analysis
    assert analysis == api.CanaryAnalysis(
        step_weights=(10, 50), interval_seconds=30, min_requests=200, max_error_rate_percent=0.5,
        max_latency_p99_ms=250, max_latency_p99_ratio=1.5, failure_limit=1, inconclusive_limit=3,
        gate_url="https://gate.example/approve", gate_before_step=False, gate_before_promotion=True,
    )  # fmt: skip
    manual = api.parse_inference_model("m", {"model": MODEL, "canary": {**CANARY, "trafficPercent": 20}})
    assert manual.canary is not None and manual.canary.analysis is None


@pytest.mark.parametrize(
    ("analysis", "expected"),
    [
        ({"stepWeights": [50, 25]}, "spec.canary.analysis.stepWeights: must be a rising list"),
        ({"stepWeights": []}, "must be a rising list"),
        ({"stepWeights": [0, 50]}, "must be a rising list"),
        ({"stepWeights": [50, 150]}, "must be a rising list"),
        ({"minRequests": 0}, "spec.canary.analysis.minRequests: must be from 1"),
        ({"maxErrorRatePercent": "low"}, "spec.canary.analysis.maxErrorRatePercent: must be a number"),
        ({"maxLatencyP99RatioToStable": 0.5}, "maxLatencyP99RatioToStable: must be from 1 to 100"),
        ({"failureLimit": -1}, "spec.canary.analysis.failureLimit: must be from 0 to 100"),
        ({"gates": {"beforeStep": True}}, "spec.canary.analysis.gates.url: is required when beforeStep"),
        ({"gates": {"url": "ftp://x", "beforeStep": True}}, "does not match"),
        ({"gates": {"url": "https://g", "beforeStep": "yes"}}, "gates.beforeStep: must be true or false"),
    ],
)
def test_bad_canary_analysis_says_what_to_change(analysis, expected):
    found = problems({"model": MODEL, "canary": {**CANARY, "analysis": analysis}})
    assert any(expected in p for p in found), found


# ---------------------------------------------------------------- model pools

MEMBER = {"model": MODEL, "pool": "small", "resources": {"gpu": {"memory": "6Gi", "computePercent": 30}}}


def test_compute_percent_is_a_share_of_one_gpu():
    spec = api.parse_inference_model("m", {"model": MODEL, "resources": {"gpu": {"memory": "24Gi",
                                                                                 "computePercent": 50}}})
    assert spec.resources.gpu == api.Gpu(memory="24Gi", compute_percent=50)
    assert api.parse_inference_model("m", {"model": MODEL, "resources": {"gpu": {"count": 1}}}).resources.gpu \
        == api.Gpu(count=1)
    assert any("computePercent: must be from 1 to 100, got 0" in p
               for p in problems({"model": MODEL, "resources": {"gpu": {"memory": "1Gi", "computePercent": 0}}}))
    assert any("computePercent: only goes with gpu.memory" in p
               for p in problems({"model": MODEL, "resources": {"gpu": {"count": 1, "computePercent": 50}}}))


def test_a_member_names_its_pool_and_its_share():
    spec = api.parse_inference_model("m", MEMBER)
    assert spec.pool == "small"
    assert spec.resources.gpu == api.Gpu(memory="6Gi", compute_percent=30)
    assert api.parse_inference_model("m", {"model": MODEL}).pool is None


@pytest.mark.parametrize(("change", "field", "advice"), [
    ({"resources": {}}, "spec.resources.gpu.memory: is required for a member of pool 'small'", "e.g. 6Gi"),
    ({"resources": {"gpu": {"memory": "0"}}}, "spec.resources.gpu.memory: must be at least 1Mi", ""),
    ({"resources": {"gpu": {"count": 1}}}, "spec.resources.gpu.count: cannot be set on a member of pool 'small'",
     "declare the model's share with gpu.memory"),
    ({"resources": {"gpu": {"migProfile": "1g.10gb"}}}, "spec.resources.gpu.migProfile: cannot be set", "spec.gpu"),
    ({"canary": {"storageUri": "s3://bucket/m2", "version": 2}}, "spec.canary: a member of pool 'small' cannot",
     "move the model out of the pool first (remove spec.pool), or run the candidate as its own InferenceModel"),
    ({"scaling": {"minReplicas": 1, "maxReplicas": 4}},
     "spec.scaling: a member of pool 'small' is scaled with the pool", "remove minReplicas/maxReplicas here (1/4)"),
    ({"server": {"protocolWorkers": 2}}, "spec.server: a member of pool 'small' runs in the pool's pods",
     "set it on ModelPool small spec.server instead"),
    ({"pool": "m"}, "spec.pool: a member cannot have its pool's name", "rename the pool or the model"),
    ({"pool": "Small_Pool"}, "spec.pool: 'Small_Pool' does not match", ""),
], ids=["no-share", "zero-share", "count", "mig", "canary", "scaling", "server", "own-name", "bad-name"])
def test_invalid_members_say_what_to_do(change, field, advice):
    found = problems({**MEMBER, **change})
    assert any(field in p and advice in p for p in found), found


def test_a_member_may_restate_the_default_replica_bounds():
    scaling = {"minReplicas": 1, "maxReplicas": 1, "metric": "latency"}
    spec = api.parse_inference_model("m", {**MEMBER, "scaling": scaling})
    assert spec.scaling.max_replicas == 1


def test_model_pool_spec():
    pool = api.parse_model_pool("small", {"gpu": {"migProfile": "3g.40gb"}, "resources": {"cpu": "4", "memory": "8Gi"},
                                          "scaling": {"minReplicas": 2, "maxReplicas": 4}})
    assert pool.gpu == api.Gpu(mig_profile="3g.40gb")
    assert pool.resources == api.Resources(cpu="4", memory="8Gi")
    assert (pool.scaling.min_replicas, pool.scaling.max_replicas) == (2, 4)
    assert pool.shutdown == api.Shutdown()


@pytest.mark.parametrize(("name", "spec", "expected"), [
    ("small", {}, "spec.gpu: is required"),
    ("small", {"gpu": {"memory": "40Gi", "count": 1}}, "spec.gpu: set exactly one of count"),
    ("small", {"gpu": {"memory": "40Gi", "computePercent": 50}}, "spec.gpu.computePercent: is a member's share"),
    ("small", {"gpu": {"memory": "40Gi"}, "resources": {"gpu": {"count": 1}}}, "spec.resources.gpu: the pool's "
     "device is spec.gpu"),
    ("small.pool", {"gpu": {"memory": "40Gi"}}, "metadata.name: 'small.pool' names the pool's Deployment"),
    ("small", {"gpu": {"memory": "40Gi"}, "scaling": {"minReplicas": 3, "maxReplicas": 2}}, "minReplicas (3)"),
])
def test_invalid_pools_say_what_to_change(name, spec, expected):
    with pytest.raises(api.SpecError) as info:
        api.parse_model_pool(name, spec)
    assert any(expected in p for p in info.value.problems), info.value.problems


@pytest.mark.parametrize(
    ("name", "canary", "expected"),
    [
        ("resnet.v2", False, "must be a DNS label"),
        ("Resnet", False, "must be a DNS label"),
        ("a" * 64, False, "must be a DNS label"),
        ("a" * 57, True, "with spec.canary it may have at most 56"),
    ],
)
def test_an_inference_model_name_must_name_its_deployment_and_service(name, canary, expected):
    """A real API server refuses a Service named 'resnet.v2' or '<57 characters>-canary'; the children
    would be half applied (a GPU Deployment behind no Service)."""
    spec = {"model": {"storageUri": "s3://b/m", "format": "onnx"}}
    if canary:
        spec["canary"] = {"storageUri": "s3://b/m2", "version": 2}
    with pytest.raises(api.SpecError) as caught:
        api.parse_inference_model(name, spec)
    assert any(p.startswith("metadata.name") and expected in p for p in caught.value.problems), caught.value.problems
    api.parse_inference_model("a" * 56 if canary else "a" * 63, spec)  # the longest that fits


@pytest.mark.parametrize("name", ["classifier.v2", "Classifier", "a" * 64, "3d-pipeline"])
def test_an_ensemble_name_must_name_its_deployment_and_service(name):
    """As for an InferenceModel: the Ensemble's name is its Deployment's and Service's (a real API server
    refuses a Service 'classifier.v2'), so it was half applied."""
    spec = {
        "inputs": [{"name": "IN", "dataType": "TYPE_FP32", "dims": [4]}],
        "outputs": [{"name": "OUT", "dataType": "TYPE_FP32", "dims": [4]}],
        "steps": [{"name": "a", "modelRef": {"name": "m"}, "inputMap": {"x": "IN"}, "outputMap": {"y": "OUT"}}],
    }
    with pytest.raises(api.SpecError) as caught:
        api.parse_ensemble(name, spec)
    assert caught.value.problems == (
        f"metadata.name: {name!r} names the ensemble's Deployment and Service, so it must be a DNS label: "
        "lower-case letters, digits and '-', starting with a letter, at most 63 characters",)
    api.parse_ensemble("a" * 63, spec)


def test_a_sidecar_model_name_fits_the_labels_of_its_config_map():
    """Its ConfigMap carries the name in labels (at most 63 characters): a longer name passed and then
    could never be rendered (the API refused the ConfigMap, and the webhook every pod)."""
    spec = {"mode": "Sidecar", "model": {"name": "m", "storageUri": "s3://b/m", "format": "onnx"}}
    api.parse_inference_model("a.b" + "c" * 60, spec)  # 63 characters, with a dot
    with pytest.raises(api.SpecError) as caught:
        api.parse_inference_model("a" * 64, spec)
    assert caught.value.problems == (
        f"metadata.name: {'a' * 64!r} is 64 characters; in Sidecar mode it may have at most 63, since its "
        "ConfigMap '<name>-config' carries it in labels (a label value has at most 63)",)
    owner = builders.Owner(kind=api.INFERENCE_MODEL_KIND, name="a.b" + "c" * 60, namespace="apps", uid="u")
    [config_map] = sidecar.children(owner, api.parse_inference_model(owner.name, spec), Settings()).objects
    assert all(len(value) <= 63 for value in config_map["metadata"]["labels"].values())


def test_a_sidecar_model_keeps_any_object_name():
    """A Sidecar-mode model owns no Deployment or Service (only '<name>-config'): dots and a leading
    digit, which Kubernetes allows in object names, stay allowed."""
    spec = {"mode": "Sidecar", "model": {"storageUri": "s3://b/m", "format": "onnx"}}
    for name in ("resnet.v2", "3d-unet"):
        assert api.parse_inference_model(name, spec).mode == "Sidecar"
