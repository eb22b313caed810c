"""Pure builders against golden files: spec + settings in, Kubernetes objects out.

Regenerate after an intended change with ``SLUICE_UPDATE_GOLDEN=1 pytest tests/operator_/test_builders.py``
and review the diff like code.
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import yaml

from sluice.operator import api, builders
from sluice.operator.settings import Settings

GOLDEN = pathlib.Path(__file__).parent / "golden"
SETTINGS = Settings(runtime_image="sluice-runtime:1", runtime_gpu_image="sluice-runtime:1-cuda")


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


@pytest.mark.parametrize("fmt", ["torchscript", "tensorrt"])
def test_formats_without_a_backend_render_nothing(fmt):
    spec = api.parse_inference_model("resnet", {"model": {"storageUri": "s3://b/m", "format": fmt}})
    with pytest.raises(builders.NotServedError) as caught:
        builders.inference_model(owner(), spec, SETTINGS)
    [problem] = caught.value.problems
    assert problem.startswith(f"spec.model.format: {fmt} models are not served")
    assert "(served: onnx, python)" in problem


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


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("*.yaml")), ids=lambda p: p.stem)
def test_rendered_children_pass_the_kubernetes_schemas(path):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for obj in yaml.safe_load_all(path.read_text()):
        if "kind" in obj:
            kubernetes_validate.validate(obj, "1.30.0", strict=True)
