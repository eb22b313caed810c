"""Spec parsing: every CEL rule of the CRD is re-checked, with messages that say what to change."""

from __future__ import annotations

import pytest

from sluice.operator import api

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
    ({"model": MODEL, "shutdown": {"drainSeconds": -1}}, "spec.shutdown.drainSeconds: must be from 0 to 600"),
    ({"model": MODEL, "shutdown": {"graceSeconds": 0}}, "spec.shutdown.graceSeconds: must be from 1 to 3600"),
])
def test_invalid_specs_say_what_to_change(spec, expected):
    assert any(expected in p for p in problems(spec)), problems(spec)


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
