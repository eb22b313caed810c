"""Pure builders against golden files: spec + settings in, Kubernetes objects out.

Regenerate after an intended change with ``SLUICE_UPDATE_GOLDEN=1 pytest tests/operator_/test_builders.py``
and review the diff like code.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import pytest
import yaml

from sluice.operator import api, builders
from sluice.operator.settings import Settings
from sluice_testing import schemas

GOLDEN = pathlib.Path(__file__).parent / "golden"
THIRD_PARTY = {"keda.sh/v1alpha1"}
SETTINGS = Settings(runtime_image="sluice-runtime:1", runtime_gpu_image="sluice-runtime:1-cuda",
                    prometheus_url="http://prometheus-operated.monitoring.svc:9090")


def owner(kind: str = "InferenceModel", name: str = "resnet") -> builders.Owner:
    return builders.Owner(kind=kind, name=name, namespace="models", uid="0000-uid")


MODELS = {
    "cpu-minimal": {"model": {"storageUri": "https://example.com/models/resnet.onnx", "format": "onnx"}},
    "gpu-autoscaled": {
        "model": {"name": "resnet50", "storageUri": "s3://bucket/resnet50", "format": "onnx", "version": 3},
        "runtime": {"maxBatchSize": 16, "instances": 2, "responseCache": True,
                    "dynamicBatching": {"preferredBatchSizes": [4, 8], "maxQueueDelayMicroseconds": 200},
                    "queuePolicy": {"maxQueueSize": 64, "timeoutMicroseconds": 50000}},
        "resources": {"cpu": "4", "memory": "16Gi", "gpu": {"count": 1}},
        "scaling": {"minReplicas": 2, "maxReplicas": 6, "targetQueueDepth": 4},
        "storage": {"serviceAccountName": "model-reader", "secretRef": {"name": "s3-credentials"}},
    },
    "mig-slice": {
        "model": {"storageUri": "gs://bucket/bert", "format": "onnx"},
        "resources": {"gpu": {"migProfile": "1g.10gb"}},
    },
    "keda-latency": {
        "model": {"storageUri": "s3://bucket/resnet50", "format": "onnx"},
        "scaling": {"minReplicas": 2, "maxReplicas": 10, "engine": "keda", "metric": "latency",
                    "targetQueueWaitMilliseconds": 40, "scaleDownStabilizationSeconds": 600},
    },
    "az-checksum-size-limit": {
        "model": {"storageUri": "az://models/resnet/3", "format": "onnx", "checksum": "sha256:" + "ab" * 32,
                  "sizeLimit": "20Gi"},
    },
    "gpu-memory-pvc-inline-config": {
        "model": {"storageUri": "pvc://model-store/llm/1", "format": "python",
                  "config": 'name: "resnet"\nbackend: "python"\nmax_batch_size: 0\n'},
        "resources": {"gpu": {"memory": "24Gi"}},
        "scaling": {"minReplicas": 3, "maxReplicas": 3},
    },
}


def check_golden(name: str, objects: object) -> None:
    path = GOLDEN / f"{name}.yaml"
    rendered = yaml.safe_dump_all(objects if isinstance(objects, list) else [objects], sort_keys=False)
    if os.environ.get("SLUICE_UPDATE_GOLDEN"):
        path.write_text(rendered)
    assert path.exists(), f"{path} is missing; run with SLUICE_UPDATE_GOLDEN=1 to create it"
    assert list(yaml.safe_load_all(path.read_text())) == list(yaml.safe_load_all(rendered)), (
        f"{name} differs from {path}; if intended, regenerate with SLUICE_UPDATE_GOLDEN=1"
    )


@pytest.mark.parametrize("case", sorted(MODELS))
def test_inference_model_children_match_golden(case):
    desired = builders.inference_model(owner(), api.parse_inference_model("resnet", MODELS[case]), SETTINGS)
    check_golden(f"inferencemodel-{case}", [*desired.objects, {"absent": [list(a) for a in desired.absent]}])


@pytest.mark.parametrize("fmt", ["tensorrt"])
def test_formats_without_a_backend_render_nothing(fmt):
    spec = api.parse_inference_model("resnet", {"model": {"storageUri": "s3://b/m", "format": fmt}})
    with pytest.raises(builders.NotServedError) as caught:
        builders.inference_model(owner(), spec, SETTINGS)
    [problem] = caught.value.problems
    assert problem.startswith(f"spec.model.format: {fmt} models are not served")
    assert "(served: onnx, torchscript, python)" in problem


TORCHSCRIPT_CONFIG = """backend: "pytorch"
max_batch_size: 8
input [ { name: "INPUT__0", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 4 ] } ]
instance_group [ { kind: KIND_GPU } ]
"""


def test_torchscript_models_are_deployed_with_their_config_on_the_gpu_image():
    desired = builders.inference_model(owner(), api.parse_inference_model("resnet", {
        "model": {"storageUri": "s3://b/resnet/1", "format": "torchscript", "config": TORCHSCRIPT_CONFIG},
        "resources": {"gpu": {"count": 1}}}), SETTINGS)
    container = _one(desired, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == SETTINGS.runtime_gpu_image
    assert _one(desired, "ConfigMap")["data"] == {"resnet.config.pbtxt": TORCHSCRIPT_CONFIG}  # verbatim


@pytest.mark.parametrize(("uri", "filename"), [
    ("s3://b/models/resnet.pt2", "resnet.pt2"), ("gs://b/resnet/traced.pt", "traced.pt"),
    ("az://c/m/resnet.onnx", "resnet.onnx"), ("https://example.com/m.pt2?sig=abc", "m.pt2"),
    ("s3://b/m/preprocess.py", "preprocess.py"),
    # the runtime finds these by their default names: nothing to add (configs rendered before stay as they were)
    ("az://c/m/model.onnx", None), ("s3://b/m/model.pt2", None), ("https://example.com/model.onnx", "model.onnx"),
    # prefixes, archives, mounted claims: the names inside are kept
    ("s3://b/models/resnet", None), ("s3://b/models/resnet.tar.gz", None), ("gs://b/m/v1.0", None),
    ("s3://b/models/resnet.onnx/", None), ("pvc://claim/m/resnet.onnx", None),
])
def test_one_model_file_from_a_store_is_named_in_the_config(uri, filename):
    # The fetch keeps an object's own name (sluice pull); the runtime would look for model.pt/model.onnx.
    fmt = "torchscript" if ".pt" in uri else "python" if uri.endswith(".py") else "onnx"
    source = api.ModelSource(name="m", storage_uri=uri, format=fmt, version=1)
    config = builders.model_config(source, api.RuntimeConfig(), gpu=False)
    assert config.get("default_model_filename") == filename
    assert config["backend"] == api.BACKEND_BY_FORMAT[fmt]


def test_cuda_graphs_are_rendered_as_tritons_optimization_field():
    spec = api.parse_inference_model("resnet", {
        "model": {"storageUri": "s3://b/resnet/resnet50.pt2", "format": "torchscript"},
        "runtime": {"maxBatchSize": 64, "cudaGraphs": True, "dynamicBatching": {"preferredBatchSizes": [16, 32]}},
        "resources": {"gpu": {"count": 1}}})
    config = builders.model_config(spec.model, spec.runtime, gpu=True)
    assert config["optimization"] == {"cuda": {"graphs": True}}
    assert config["instance_group"] == [{"count": 1, "kind": "KIND_GPU"}]
    assert "optimization" not in builders.model_config(spec.model, api.RuntimeConfig(max_batch_size=64), gpu=True)


def _runtime_pod(spec: dict) -> tuple[dict, dict]:
    desired = builders.inference_model(owner(), api.parse_inference_model("resnet", spec), SETTINGS)
    [deployment] = [o for o in desired.objects if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def _flag(container: dict, name: str) -> str:
    args = container["args"]
    assert args.count(name) == 1, args
    return args[args.index(name) + 1]


def test_shutdown_drains_in_prestop_not_twice_and_the_grace_period_covers_both():
    pod, container = _runtime_pod({**MODELS["cpu-minimal"], "shutdown": {"drainSeconds": 12, "graceSeconds": 40}})
    assert container["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "12"]}}}
    assert _flag(container, "--drain-period-s") == "0"
    assert _flag(container, "--shutdown-grace-s") == "40"
    assert _flag(container, "--strict-readiness") == "true"
    assert pod["terminationGracePeriodSeconds"] == 12 + 40 + 5


def test_shutdown_defaults_and_no_drain():
    pod, container = _runtime_pod(MODELS["cpu-minimal"])
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(api.DEFAULT_DRAIN_SECONDS)]
    assert pod["terminationGracePeriodSeconds"] == 5 + 30 + 5
    pod, container = _runtime_pod({**MODELS["cpu-minimal"], "shutdown": {"drainSeconds": 0}})
    assert "lifecycle" not in container
    assert _flag(container, "--drain-period-s") == "0"
    assert pod["terminationGracePeriodSeconds"] == 0 + 30 + 5


@pytest.mark.parametrize(("server", "expected"), [
    (None, None), ({}, None), ({"protocolWorkers": "auto"}, "auto"), ({"protocolWorkers": 0}, "0"),
    ({"protocolWorkers": 8}, "8"),
])
def test_protocol_workers_reach_the_runtime_only_when_asked(server, expected):
    # Unset, the args are what they were before spec.server existed: an operator upgrade rolls no pod.
    spec = {**MODELS["gpu-autoscaled"], **({} if server is None else {"server": server})}
    _, container = _runtime_pod(spec)
    if expected is None:
        assert "--protocol-workers" not in container["args"]
        assert container == _runtime_pod(MODELS["gpu-autoscaled"])[1]
    else:
        assert _flag(container, "--protocol-workers") == expected


def test_the_operator_default_applies_where_the_spec_sets_no_protocol_workers():
    settings = dataclasses.replace(SETTINGS, default_protocol_workers="auto")

    def workers(spec: dict) -> str | None:
        desired = builders.inference_model(owner(), api.parse_inference_model("resnet", spec), settings)
        args = _one(desired, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
        return args[args.index("--protocol-workers") + 1] if "--protocol-workers" in args else None

    assert workers(MODELS["cpu-minimal"]) == "auto"
    assert workers({**MODELS["cpu-minimal"], "server": {"protocolWorkers": 0}}) == "0"  # the spec wins
    assert workers({**MODELS["cpu-minimal"], "server": {}}) == "auto"


def test_builders_are_deterministic():
    spec = api.parse_inference_model("resnet", MODELS["gpu-autoscaled"])
    assert builders.inference_model(owner(), spec, SETTINGS) == builders.inference_model(owner(), spec, SETTINGS)


def test_config_change_changes_the_pod_template_hash():
    base = MODELS["gpu-autoscaled"]
    changed = {**base, "runtime": {**base["runtime"], "maxBatchSize": 32}}
    hashes = []
    for spec in (base, changed):
        desired = builders.inference_model(owner(), api.parse_inference_model("resnet", spec), SETTINGS)
        [deployment] = [o for o in desired.objects if o["kind"] == "Deployment"]
        hashes.append(deployment["spec"]["template"]["metadata"]["annotations"][builders.CONFIG_HASH_ANNOTATION])
    assert hashes[0] != hashes[1]


def test_model_config_mirrors_the_runtime_spec():
    spec = api.parse_inference_model("resnet", MODELS["gpu-autoscaled"])
    config = builders.model_config(spec.model, spec.runtime, gpu=True)
    assert config == {
        "name": "resnet50", "backend": "onnxruntime", "max_batch_size": 16,
        "version_policy": {"specific": {"versions": [3]}},
        "instance_group": [{"count": 2, "kind": "KIND_GPU"}],
        "dynamic_batching": {
            "preferred_batch_size": [4, 8], "max_queue_delay_microseconds": 200,
            "default_queue_policy": {"max_queue_size": 64, "default_timeout_microseconds": 50000,
                                     "timeout_action": "REJECT"},
        },
        "response_cache": {"enable": True},
    }
    served = builders.served_model(spec.model, spec.runtime, gpu=True)
    assert json.loads(served.config_text) == config


ENSEMBLE = {
    "inputs": [{"name": "IMAGE", "dataType": "TYPE_UINT8", "dims": [-1]}],
    "outputs": [{"name": "LABEL", "dataType": "TYPE_STRING", "dims": [1]}],
    "steps": [
        {"name": "preprocess", "model": {"storageUri": "s3://bucket/pre", "format": "python"},
         "inputMap": {"RAW": "IMAGE"}, "outputMap": {"TENSOR": "pixels"}},
        {"name": "classify", "modelRef": {"name": "resnet"},
         "inputMap": {"input": "pixels"}, "outputMap": {"probs": "LABEL"}},
    ],
}


def test_ensemble_colocated_matches_golden():
    referenced = {"resnet": api.parse_inference_model("resnet", MODELS["gpu-autoscaled"])}
    desired = builders.ensemble(owner("Ensemble", "classifier"), api.parse_ensemble("classifier", ENSEMBLE),
                                referenced, SETTINGS)
    assert desired.placement == "Colocated"
    check_golden("ensemble-colocated", list(desired.objects))


def _step(name: str, ref: str | None = None, **resources: str) -> dict:
    source = {"modelRef": {"name": ref}} if ref else {"model": {"storageUri": f"s3://b/{name}", "format": "python"}}
    return {"name": name, **source, **({"resources": resources} if resources else {}),
            "inputMap": {"IN": "IMAGE"}, "outputMap": {"OUT": f"t_{name}"}}


@pytest.mark.parametrize(("own", "steps", "expected"), [
    ({}, [_step("a"), _step("b")], (None, None)),  # nothing stated: the operator default
    ({}, [_step("a", cpu="500m"), _step("b", cpu="250m", memory="512Mi")], ("750m", "2560Mi")),
    ({"cpu": "8"}, [_step("a", cpu="2", memory="1Gi"), _step("b", memory="1Gi")], ("8", "2Gi")),
    ({}, [_step("a", ref="resnet"), _step("b", cpu="1")], ("5", "18Gi")),  # resnet: 4 CPU, 16Gi
    # one model two steps call: served once, so its CPU, memory and GPU count once (its GPU went in twice)
    ({}, [_step("a", ref="resnet", cpu="2"), _step("b", ref="resnet")], ("2", "16Gi")),
], ids=["defaults", "steps-add-up", "ensemble-wins-per-field", "referenced-model", "one-model-counted-once"])
def test_colocated_steps_size_the_ensembles_pods(own, steps, expected):
    """A colocated Ensemble's pods get what its steps need (its own resources win, field by field);
    the steps' cpu and memory were ignored, so a 4-CPU, 16Gi model ran in a 1-CPU, 2Gi pod."""
    spec = {**ENSEMBLE, "steps": steps, **({"resources": own} if own else {}), "outputs": [
        {"name": f"t_{step['name']}", "dataType": "TYPE_FP32", "dims": [-1]} for step in steps]}
    referenced = {"resnet": api.parse_inference_model("resnet", MODELS["gpu-autoscaled"])}
    parsed = api.parse_ensemble("classifier", spec)
    resources = builders.colocated_resources(parsed, referenced, SETTINGS)
    assert (resources.cpu, resources.memory) == expected
    desired = builders.ensemble(owner("Ensemble", "classifier"), parsed, referenced, SETTINGS)
    assert desired.placement == "Colocated"
    [deployment] = [o for o in desired.objects if o["kind"] == "Deployment"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    defaults = SETTINGS.default_resources
    want = {"cpu": expected[0] or defaults.cpu, "memory": expected[1] or defaults.memory}
    assert {k: container["resources"]["limits"][k] for k in want} == want
    assert {k: container["resources"]["requests"][k] for k in want} == want
    if any("modelRef" in step for step in steps):
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_a_model_two_steps_call_gets_the_gpu_either_step_states():
    """The GPU one of its steps asks for is the model's, wherever that step stands (only the first step's
    was looked at: a GPU asked for by the second was dropped and the model served on CPU)."""
    steps = [_step("a", ref="cpu"), {**_step("b", ref="cpu"), "resources": {"gpu": {"count": 1}}}]
    spec = {**ENSEMBLE, "steps": steps, "outputs": [
        {"name": f"t_{step['name']}", "dataType": "TYPE_FP32", "dims": [-1]} for step in steps]}
    referenced = {"cpu": api.parse_inference_model("cpu", {"model": {"storageUri": "s3://b/cpu", "format": "onnx"}})}
    desired = builders.ensemble(owner("Ensemble", "classifier"), api.parse_ensemble("classifier", spec),
                                referenced, SETTINGS)
    [deployment] = [o for o in desired.objects if o["kind"] == "Deployment"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["image"] == SETTINGS.runtime_gpu_image


def test_remote_steps_leave_the_ensembles_pods_at_their_own_resources():
    big = {**MODELS["gpu-autoscaled"], "resources": {"cpu": "4", "memory": "16Gi", "gpu": {"count": 2}}}
    spec = {**ENSEMBLE, "steps": [_step("a", ref="resnet", cpu="3")],
            "outputs": [{"name": "t_a", "dataType": "TYPE_FP32", "dims": [-1]}]}
    referenced = {"resnet": api.parse_inference_model("resnet", big)}
    desired = builders.ensemble(owner("Ensemble", "classifier"), api.parse_ensemble("classifier", spec),
                                referenced, SETTINGS)
    assert desired.placement == "Remote"  # resnet runs in its own pods, sized by its own spec
    [deployment] = [o for o in desired.objects if o["kind"] == "Deployment"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["cpu"] == SETTINGS.default_resources.cpu


def test_ensemble_remote_when_steps_do_not_fit_one_pod():
    big = {**MODELS["gpu-autoscaled"], "resources": {"gpu": {"count": 2}}}
    spec = {**ENSEMBLE, "steps": [ENSEMBLE["steps"][1]], "inputs": [
        {"name": "pixels", "dataType": "TYPE_FP32", "dims": [3, 224, 224]}]}
    referenced = {"resnet": api.parse_inference_model("resnet", big)}
    desired = builders.ensemble(owner("Ensemble", "classifier"), api.parse_ensemble("classifier", spec),
                                referenced, SETTINGS)
    assert desired.placement == "Remote"
    check_golden("ensemble-remote", list(desired.objects))


def test_ensemble_with_inline_steps_that_cannot_be_colocated_is_unsatisfiable():
    big = {**MODELS["gpu-autoscaled"], "resources": {"gpu": {"count": 2}}}
    referenced = {"resnet": api.parse_inference_model("resnet", big)}
    with pytest.raises(builders.UnsatisfiableError, match="move them to InferenceModels and use modelRef"):
        builders.ensemble(owner("Ensemble", "classifier"), api.parse_ensemble("classifier", ENSEMBLE),
                          referenced, SETTINGS)


def test_ensemble_with_a_missing_reference_names_the_step():
    with pytest.raises(builders.UnsatisfiableError, match=r"spec.steps\[1\].modelRef: InferenceModel 'resnet'"):
        builders.ensemble(owner("Ensemble", "classifier"), api.parse_ensemble("classifier", ENSEMBLE), {},
                          SETTINGS)


def test_an_ensemble_step_named_like_the_ensemble_is_unsatisfiable():
    """The runtime serves the ensemble and its steps' models by name in one repository."""
    referenced = {"resnet": api.parse_inference_model("resnet", MODELS["gpu-autoscaled"])}
    steps = [{**ENSEMBLE["steps"][0], "model": {"storageUri": "s3://bucket/pre", "format": "python",
                                                "name": "classifier"}}, ENSEMBLE["steps"][1]]
    with pytest.raises(builders.UnsatisfiableError, match=r"spec.steps\[0\].model: serves a model named "
                       r"'classifier', the ensemble's own name"):
        builders.ensemble(owner("Ensemble", "classifier"),
                          api.parse_ensemble("classifier", {**ENSEMBLE, "steps": steps}), referenced, SETTINGS)


def test_two_steps_serving_one_model_name_from_two_sources_are_unsatisfiable():
    referenced = {"resnet": api.parse_inference_model("resnet", MODELS["gpu-autoscaled"])}
    second = {"name": "again", "model": {"storageUri": "s3://bucket/other", "format": "python", "name": "preprocess"},
              "inputMap": {"RAW": "IMAGE"}, "outputMap": {"TENSOR": "more"}}
    spec = api.parse_ensemble("classifier", {**ENSEMBLE, "steps": [*ENSEMBLE["steps"], second]})
    with pytest.raises(builders.UnsatisfiableError, match=r"spec.steps\[2\].model: serves a model named "
                       r"'preprocess' like spec.steps\[0\] but from another source"):
        builders.ensemble(owner("Ensemble", "classifier"), spec, referenced, SETTINGS)
    # the same model twice (one source) is fine: it is served once
    same = {**second, "model": {**ENSEMBLE["steps"][0]["model"], "name": "preprocess"}}
    spec = api.parse_ensemble("classifier", {**ENSEMBLE, "steps": [*ENSEMBLE["steps"], same]})
    desired = builders.ensemble(owner("Ensemble", "classifier"), spec, referenced, SETTINGS)
    assert desired.placement == "Colocated"


def test_a_remote_step_to_a_sidecar_mode_model_is_unsatisfiable():
    """A Sidecar-mode InferenceModel has no Service: an ensemble that must call it remotely cannot."""
    sidecar = {**MODELS["gpu-autoscaled"], "mode": "Sidecar", "resources": {"gpu": {"count": 2}}}
    sidecar.pop("scaling", None)
    referenced = {"resnet": api.parse_inference_model("resnet", sidecar)}
    spec = {**ENSEMBLE, "steps": [ENSEMBLE["steps"][1]], "inputs": [
        {"name": "pixels", "dataType": "TYPE_FP32", "dims": [3, 224, 224]}]}
    with pytest.raises(builders.UnsatisfiableError, match=r"spec.steps\[0\].modelRef: InferenceModel 'resnet' "
                       r"runs in Sidecar mode \(no Service to call\)"):
        builders.ensemble(owner("Ensemble", "classifier"), api.parse_ensemble("classifier", spec), referenced, SETTINGS)


def test_colocated_steps_fetch_with_their_models_credentials_under_one_service_account():
    """A referenced model's fetch takes its own secret; the pods run as the service account its models
    fetch with (the Ensemble names none); two different accounts cannot share the pods."""
    referenced = {"resnet": api.parse_inference_model("resnet", MODELS["gpu-autoscaled"])}
    desired = builders.ensemble(owner("Ensemble", "classifier"), api.parse_ensemble("classifier", ENSEMBLE),
                                referenced, SETTINGS)
    pod = next(o for o in desired.objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "model-reader"
    fetch = next(c for c in pod["initContainers"] if "resnet" in c["name"])
    assert fetch["envFrom"] == [{"secretRef": {"name": "s3-credentials"}}]
    # an Ensemble that names its own account runs as it
    named = {**ENSEMBLE, "storage": {"serviceAccountName": "ensemble-reader"}}
    desired = builders.ensemble(owner("Ensemble", "classifier"), api.parse_ensemble("classifier", named),
                                referenced, SETTINGS)
    pod = next(o for o in desired.objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "ensemble-reader"
    # referenced models with different accounts and none named: refused
    cpu_model = {k: v for k, v in MODELS["gpu-autoscaled"].items() if k != "resources"}
    other = api.parse_inference_model("other", {**cpu_model, "storage": {"serviceAccountName": "another-reader"},
                                                "model": {**cpu_model["model"], "name": "other"}})
    two = {**ENSEMBLE, "steps": [*ENSEMBLE["steps"], {
        "name": "again", "modelRef": {"name": "other"}, "inputMap": {"input": "pixels"}, "outputMap": {"probs": "x"}}]}
    with pytest.raises(builders.UnsatisfiableError, match="another-reader, model-reader"):
        builders.ensemble(owner("Ensemble", "classifier"), api.parse_ensemble("classifier", two),
                          {**referenced, "other": other}, SETTINGS)


def test_a_colocated_model_without_credentials_of_its_own_is_fetched_with_the_ensembles():
    bare = {k: v for k, v in MODELS["gpu-autoscaled"].items() if k != "storage"}
    referenced = {"resnet": api.parse_inference_model("resnet", bare)}
    spec = {**ENSEMBLE, "storage": {"secretRef": {"name": "ensemble-creds"}}}
    desired = builders.ensemble(owner("Ensemble", "classifier"), api.parse_ensemble("classifier", spec),
                                referenced, SETTINGS)
    pod = next(o for o in desired.objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    fetch = next(c for c in pod["initContainers"] if "resnet" in c["name"])
    assert fetch["envFrom"] == [{"secretRef": {"name": "ensemble-creds"}}]


# ---------------------------------------------------------------- model pools

POOL = {"gpu": {"migProfile": "3g.40gb"}, "resources": {"cpu": "4", "memory": "16Gi"},
        "scaling": {"minReplicas": 2, "maxReplicas": 4}}
MEMBERS = {
    "intent": {"pool": "small-nlp", "model": {"storageUri": "s3://bucket/intent", "format": "onnx", "version": 4},
               "runtime": {"maxBatchSize": 32, "dynamicBatching": {"maxQueueDelayMicroseconds": 500}},
               "resources": {"gpu": {"memory": "12Gi", "computePercent": 40}},
               "storage": {"secretRef": {"name": "s3-credentials"}, "serviceAccountName": "model-reader"}},
    "sentiment": {"pool": "small-nlp",
                  "model": {"storageUri": "https://example.com/models/sentiment.onnx", "format": "onnx"},
                  "resources": {"gpu": {"memory": "6Gi"}}},
}


def _pool(members: tuple[str, ...] = ("intent", "sentiment"), spec: dict | None = None) -> builders.Desired:
    parsed = [(name, api.parse_inference_model(name, MEMBERS[name])) for name in members]
    return builders.model_pool(owner("ModelPool", "small-nlp"), api.parse_model_pool("small-nlp", spec or POOL),
                               parsed, SETTINGS, service_account="model-reader")


def test_model_pool_matches_golden():
    desired = _pool()
    check_golden("modelpool", [*desired.objects, {"absent": [list(a) for a in desired.absent]}])


def test_a_pool_and_an_ensemble_pass_their_own_server_settings():
    pool = _one(_pool(spec={**POOL, "server": {"protocolWorkers": "auto"}}), "Deployment")
    assert _flag(pool["spec"]["template"]["spec"]["containers"][0], "--protocol-workers") == "auto"
    assert "--protocol-workers" not in _one(_pool(), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    referenced = {"resnet": api.parse_inference_model("resnet", MODELS["gpu-autoscaled"])}
    desired = builders.ensemble(owner("Ensemble", "classifier"),
                                api.parse_ensemble("classifier", {**ENSEMBLE, "server": {"protocolWorkers": 4}}),
                                referenced, SETTINGS)
    assert _flag(_one(desired, "Deployment")["spec"]["template"]["spec"]["containers"][0],
                 "--protocol-workers") == "4"


def test_a_pool_serves_every_admitted_member_from_one_deployment():
    desired = _pool()
    deployment = _one(desired, "Deployment")
    assert deployment["metadata"]["name"] == "small-nlp"
    assert deployment["metadata"]["labels"] == builders.common_labels(owner("ModelPool", "small-nlp"))
    pod = deployment["spec"]["template"]
    assert pod["metadata"]["labels"]["member.sluice.dev/intent"] == "true"
    assert pod["metadata"]["labels"]["member.sluice.dev/sentiment"] == "true"
    assert deployment["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/instance": "small-nlp",
                                                             "sluice.dev/modelpool": "small-nlp"}
    # One fetch per member, each with that member's own credentials; the pods run as the shared account.
    fetches = pod["spec"]["initContainers"]
    assert [f["args"] for f in fetches] == [["pull", "s3://bucket/intent", "/models/intent/4"],
                                            ["pull", "https://example.com/models/sentiment.onnx",
                                             "/models/sentiment/1"]]
    assert {f["image"] for f in fetches} == {SETTINGS.runtime_gpu_image}  # the pod's own image: one pull per node
    assert fetches[0]["envFrom"] == [{"secretRef": {"name": "s3-credentials"}}]
    assert "envFrom" not in fetches[1]
    assert pod["spec"]["serviceAccountName"] == "model-reader"
    container = pod["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/mig-3g.40gb"] == "1"
    assert container["image"] == SETTINGS.runtime_gpu_image
    config_map = _one(desired, "ConfigMap")
    configs = {key: json.loads(text) for key, text in config_map["data"].items()}
    assert set(configs) == {"intent.config.json", "sentiment.config.json"}
    assert configs["intent.config.json"]["instance_group"] == [{"count": 1, "kind": "KIND_GPU"}]
    assert configs["sentiment.config.json"]["default_model_filename"] == "sentiment.onnx"
    assert _one(desired, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]["name"] == "small-nlp"
    assert _one(desired, "PodDisruptionBudget")["metadata"]["name"] == "small-nlp"
    assert _one(desired, "Service")["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def _pod(desired: builders.Desired) -> dict:
    return _one(desired, "Deployment")["spec"]["template"]["spec"]


def _model(spec: dict, name: str = "resnet") -> builders.Desired:
    return builders.inference_model(owner(name=name), api.parse_inference_model(name, spec), SETTINGS)


def test_the_fetch_runs_sluice_pull_in_the_runtime_image_with_the_checksum_and_size_limit():
    pod = _pod(_model({"model": {"storageUri": "s3://bucket/m/3", "format": "onnx", "version": 3,
                                 "checksum": "sha256:" + "0f" * 32, "sizeLimit": "20Gi"}}))
    [fetch] = pod["initContainers"]
    assert fetch["image"] == SETTINGS.runtime_image and fetch["command"] == ["sluice"]
    assert fetch["args"] == ["pull", "s3://bucket/m/3", "/models/resnet/3", "--sha256", "0f" * 32,
                             "--size-limit", "20Gi"]
    assert fetch["resources"]["requests"]["ephemeral-storage"] == "20Gi"
    assert pod["containers"][0]["resources"]["requests"]["ephemeral-storage"] == "20Gi"
    [repository] = [v for v in pod["volumes"] if v["name"] == "model-repository"]
    assert repository["emptyDir"] == {"sizeLimit": "20Gi"}


def test_without_a_size_limit_the_repository_is_unbounded_as_before():
    pod = _pod(_model({"model": {"storageUri": "gs://bucket/m", "format": "onnx"}}))
    [fetch] = pod["initContainers"]
    assert fetch["args"] == ["pull", "gs://bucket/m", "/models/resnet/1"]
    assert "ephemeral-storage" not in fetch["resources"]["requests"]
    assert "ephemeral-storage" not in pod["containers"][0]["resources"]["requests"]
    assert [v for v in pod["volumes"] if v["name"] == "model-repository"] == [
        {"name": "model-repository", "emptyDir": {}}]


def test_a_pools_repository_adds_up_its_members_size_limits():
    members = {
        "a": {"model": {"storageUri": "s3://b/a", "format": "onnx", "sizeLimit": "1Gi"},
              "resources": {"gpu": {"memory": "1Gi"}}, "pool": "small-nlp"},
        "b": {"model": {"storageUri": "s3://b/b", "format": "onnx", "sizeLimit": "512Mi"},
              "resources": {"gpu": {"memory": "1Gi"}}, "pool": "small-nlp"},
        "c": {"model": {"storageUri": "s3://b/c", "format": "onnx"},
              "resources": {"gpu": {"memory": "1Gi"}}, "pool": "small-nlp"},
    }

    def pool(names):
        parsed = [(n, api.parse_inference_model(n, members[n])) for n in names]
        return _pod(builders.model_pool(owner("ModelPool", "small-nlp"), api.parse_model_pool("small-nlp", POOL),
                                        parsed, SETTINGS))

    pod = pool(["a", "b"])
    assert pod["containers"][0]["resources"]["requests"]["ephemeral-storage"] == "1536Mi"
    assert [f["resources"]["requests"]["ephemeral-storage"] for f in pod["initContainers"]] == ["1Gi", "512Mi"]
    assert pod["volumes"][0]["emptyDir"] == {"sizeLimit": "1536Mi"}
    # A member of unknown size: the request is still the known part, but no bound that could evict the pod.
    pod = pool(["a", "b", "c"])
    assert pod["containers"][0]["resources"]["requests"]["ephemeral-storage"] == "1536Mi"
    assert pod["volumes"][0]["emptyDir"] == {}


def test_a_canary_brings_its_own_checksum_and_inherits_the_size_limit():
    spec = api.parse_inference_model("resnet", {
        "model": {"storageUri": "s3://b/m/1", "format": "onnx", "checksum": "sha256:" + "11" * 32,
                  "sizeLimit": "2Gi"},
        "canary": {"storageUri": "s3://b/m/2", "version": 2}})
    candidate = builders.candidate_model(spec)
    assert (candidate.checksum, candidate.size_limit) == (None, "2Gi")


def test_the_storage_secret_is_the_fetchs_environment_and_files():
    pod = _pod(_model({"model": {"storageUri": "gs://bucket/m", "format": "onnx"},
                       "storage": {"secretRef": {"name": "gcs-key"}}}))
    [fetch] = pod["initContainers"]
    assert fetch["envFrom"] == [{"secretRef": {"name": "gcs-key"}}]
    assert {"name": "storage-0", "mountPath": builders.STORAGE_SECRET_DIRECTORY, "readOnly": True} in \
        fetch["volumeMounts"]
    assert {"name": "storage-0", "secret": {"secretName": "gcs-key", "defaultMode": 0o440}} in pod["volumes"]
    assert all(m["name"] != "storage-0" for m in pod["containers"][0]["volumeMounts"])  # never the runtime's


def test_a_pool_without_members_still_holds_its_device():
    desired = _pool(())
    assert _one(desired, "ConfigMap")["data"] == {}
    assert "initContainers" not in _one(desired, "Deployment")["spec"]["template"]["spec"]


def test_a_membership_change_rolls_the_pool():
    hashes = {
        members: _one(_pool(members), "Deployment")["spec"]["template"]["metadata"]["annotations"][
            builders.CONFIG_HASH_ANNOTATION]
        for members in (("intent",), ("intent", "sentiment"))
    }
    assert len(set(hashes.values())) == 2


def test_pool_member_matches_golden():
    spec = api.parse_inference_model("intent", MEMBERS["intent"])
    desired = builders.pool_member(owner(name="intent"), spec, owner("ModelPool", "small-nlp"), SETTINGS,
                                   had_canary=True)
    check_golden("inferencemodel-pool-member", [*desired.objects, {"absent": [list(a) for a in desired.absent]}])
    [service] = desired.objects
    assert service["metadata"]["name"] == "intent"  # the name clients already use
    pool_pods = _one(_pool(), "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pool_pods.items()
    assert ("apps/v1", "Deployment", "intent") in desired.absent
    assert ("v1", "ConfigMap", "intent-config") in desired.absent
    assert ("apps/v1", "Deployment", "intent-canary") in desired.absent
    assert desired.model_url == "http://intent.models.svc.cluster.local:8000/v2/models/intent"
    plain = builders.pool_member(owner(name="intent"), spec, owner("ModelPool", "small-nlp"), SETTINGS)
    assert {name for _, _, name in plain.absent} == {"intent", "intent-config", "intent-gpu"}  # no canary


def test_member_labels_fit_a_label_name():
    assert builders.member_label("bert") == "member.sluice.dev/bert"
    long = builders.member_label("x" * 70)
    assert len(long.split("/", 1)[1]) == 63 and long != builders.member_label("x" * 71)


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("*.yaml")), ids=lambda p: p.stem)
def test_rendered_children_pass_the_kubernetes_schemas(path):
    """Kubernetes' kinds against its OpenAPI schemas, the others (KEDA's ScaledObject) against their own."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for obj in yaml.safe_load_all(path.read_text()):
        if "kind" not in obj:
            continue
        if obj["apiVersion"] in THIRD_PARTY:
            assert schemas.validate(obj) == [], obj["kind"]
        else:
            kubernetes_validate.validate(obj, "1.30.0", strict=True)


# ---------------------------------------------------------------- autoscaling

AUTOSCALED = {"model": {"storageUri": "s3://bucket/resnet50", "format": "onnx"},
              "scaling": {"minReplicas": 2, "maxReplicas": 10}}
SELECTOR = 'namespace="models",app_kubernetes_io_instance="resnet"'


def _autoscaled(settings: Settings = SETTINGS, **scaling: object) -> builders.Desired:
    spec = {**AUTOSCALED, "scaling": {**AUTOSCALED["scaling"], **scaling}}
    return builders.inference_model(owner(), api.parse_inference_model("resnet", spec), settings)


def _one(desired: builders.Desired, kind: str) -> dict:
    [found] = [o for o in desired.objects if o["kind"] == kind]
    return found


@pytest.mark.parametrize(("scaling", "metric", "average_value"), [
    ({}, "sluice_queue_depth", "8"),
    ({"metric": "queueDepth", "targetQueueDepth": 4}, "sluice_queue_depth", "4"),
    ({"metric": "inflight", "targetInflight": 12}, "sluice_inflight_requests", "12"),
    ({"metric": "latency", "targetQueueWaitMilliseconds": 40}, "sluice_queue_duration_seconds_p90", "40m"),
], ids=["default", "queueDepth", "inflight", "latency"])
def test_hpa_scales_on_the_chosen_pods_metric(scaling, metric, average_value):
    desired = _autoscaled(**scaling)
    hpa = _one(desired, "HorizontalPodAutoscaler")
    assert hpa["spec"]["metrics"] == [{"type": "Pods", "pods": {
        "metric": {"name": metric}, "target": {"type": "AverageValue", "averageValue": average_value}}}]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 10)
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "resnet"}
    assert not [o for o in desired.objects if o["kind"] == "ScaledObject"]
    assert ("keda.sh/v1alpha1", "ScaledObject", "resnet") in desired.absent
    assert builders.HPA_METRICS[api.parse_inference_model("m", {**AUTOSCALED, "scaling": scaling}).scaling.metric] \
        == metric


@pytest.mark.parametrize(("scaling", "query", "threshold"), [
    ({"targetQueueDepth": 4}, f"sum(sluice_queue_depth{{{SELECTOR}}})", "4"),
    ({"metric": "inflight", "targetInflight": 12},
     f"sum(max by (pod) (sluice_inflight_requests{{{SELECTOR}}}))", "12"),
    ({"metric": "latency", "targetQueueWaitMilliseconds": 40},
     "sum(1000 * histogram_quantile(0.9, sum by (pod, le) "
     f"(rate(sluice_queue_duration_seconds_bucket{{{SELECTOR}}}[1m]))) >= 0) "
     f"or (0 * sum(rate(sluice_queue_duration_seconds_count{{{SELECTOR}}}[1m])))", "40"),
], ids=["queueDepth", "inflight", "latency"])
def test_keda_scaled_object_queries_prometheus_for_the_chosen_metric(scaling, query, threshold):
    desired = _autoscaled(engine="keda", **scaling)
    scaled = _one(desired, "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["triggers"] == [{"type": "prometheus", "metricType": "AverageValue", "metadata": {
        "serverAddress": SETTINGS.prometheus_url, "query": query, "threshold": threshold,
        "ignoreNullValues": "false"}}]
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "resnet"}
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (2, 10)
    assert scaled["spec"]["fallback"] == {"failureThreshold": 3, "replicas": 10}
    # KEDA makes its own HPA (keda-hpa-resnet): ours must go, and the Deployment's count is left to it.
    assert not [o for o in desired.objects if o["kind"] == "HorizontalPodAutoscaler"]
    assert ("autoscaling/v2", "HorizontalPodAutoscaler", "resnet") in desired.absent
    assert "replicas" not in _one(desired, "Deployment")["spec"]
    assert schemas.validate(scaled) == []


def test_keda_and_the_hpa_get_the_same_behaviour_fast_up_slowly_down():
    hpa = _one(_autoscaled(), "HorizontalPodAutoscaler")
    keda = _one(_autoscaled(engine="keda"), "ScaledObject")
    behavior = hpa["spec"]["behavior"]
    assert keda["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == behavior
    assert behavior == {
        "scaleUp": {"stabilizationWindowSeconds": 0, "selectPolicy": "Max", "policies": [
            {"type": "Percent", "value": 100, "periodSeconds": 15}, {"type": "Pods", "value": 4, "periodSeconds": 15}]},
        "scaleDown": {"stabilizationWindowSeconds": 300, "selectPolicy": "Max", "policies": [
            {"type": "Percent", "value": 10, "periodSeconds": 60}, {"type": "Pods", "value": 1, "periodSeconds": 60}]},
    }
    windows = _one(_autoscaled(scaleUpStabilizationSeconds=30, scaleDownStabilizationSeconds=900),
                   "HorizontalPodAutoscaler")["spec"]["behavior"]
    assert (windows["scaleUp"]["stabilizationWindowSeconds"], windows["scaleDown"]["stabilizationWindowSeconds"]) \
        == (30, 900)


def test_keda_fallback_replicas_from_the_spec():
    scaled = _one(_autoscaled(engine="keda", fallbackReplicas=4), "ScaledObject")
    assert scaled["spec"]["fallback"] == {"failureThreshold": 3, "replicas": 4}


def test_keda_without_a_prometheus_url_is_unsatisfiable_and_says_how_to_set_it():
    with pytest.raises(builders.UnsatisfiableError) as caught:
        _autoscaled(dataclasses.replace(SETTINGS, prometheus_url=None), engine="keda")
    [problem] = caught.value.problems
    assert problem.startswith("spec.scaling.engine: keda scales on a Prometheus query")
    assert "SLUICE_PROMETHEUS_URL" in problem and "--set prometheus.url=" in problem and "engine hpa" in problem
    _autoscaled(dataclasses.replace(SETTINGS, prometheus_url=None))  # engine hpa does not need it


@pytest.mark.parametrize("engine", ["hpa", "keda"])
def test_fixed_scaling_has_neither_autoscaler(engine):
    spec = {**AUTOSCALED, "scaling": {"minReplicas": 3, "maxReplicas": 3, "engine": engine}}
    desired = builders.inference_model(owner(), api.parse_inference_model("resnet", spec), SETTINGS)
    assert not [o for o in desired.objects if o["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")]
    assert {a for a in desired.absent if a[1] != "PodDisruptionBudget"} == {
        ("autoscaling/v2", "HorizontalPodAutoscaler", "resnet"), ("keda.sh/v1alpha1", "ScaledObject", "resnet")}
    assert _one(desired, "Deployment")["spec"]["replicas"] == 3


@pytest.mark.parametrize("engine", ["hpa", "keda"])
def test_an_autoscaler_for_another_deployment_targets_and_selects_that_one(engine):
    """The canary's Deployment ``<name>-canary`` gets its own autoscaler from the same function."""
    scaling = api.Scaling(min_replicas=1, max_replicas=3, engine=engine)
    objects, absent = builders.autoscaler(owner(), "resnet-canary", scaling, SETTINGS)
    [scaler] = objects
    assert scaler["metadata"]["name"] == "resnet-canary"
    assert scaler["spec"]["scaleTargetRef"]["name"] == "resnet-canary"
    assert [name for _, _, name in absent] == ["resnet-canary"]
    if engine == "keda":
        assert 'app_kubernetes_io_instance="resnet-canary"' in scaler["spec"]["triggers"][0]["metadata"]["query"]


def test_the_hpa_opts_out_of_kedas_ownership_check_for_the_switch_to_keda():
    """The reconciler applies the ScaledObject before it deletes the old HPA; KEDA's webhook would refuse it."""
    hpa = _one(_autoscaled(), "HorizontalPodAutoscaler")
    assert hpa["metadata"]["annotations"] == {"validations.keda.sh/hpa-ownership": "false"}


@pytest.mark.parametrize("engine", ["hpa", "keda"])
def test_the_replica_handover_is_the_same_for_both_engines(engine):
    scaling = api.Scaling(min_replicas=2, max_replicas=8, engine=engine)
    ours = {"metadata": {"managedFields": [{"manager": "sluice-operator", "operation": "Apply",
                                            "fieldsV1": {"f:spec": {"f:replicas": {}}}}]}, "spec": {"replicas": 5}}
    theirs = {"metadata": {"managedFields": [{"manager": "kube-controller-manager", "operation": "Update",
                                              "fieldsV1": {"f:spec": {"f:replicas": {}}}}]}, "spec": {"replicas": 5}}
    assert builders.deployment_replicas(scaling, ours) == 5
    assert builders.deployment_replicas(scaling, theirs) is None
    assert builders.deployment_replicas(scaling, None) is None
