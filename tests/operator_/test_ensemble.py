"""The real operator reconciling an Ensemble into one runtime Deployment holding the ensemble config."""

from __future__ import annotations

import json

ENSEMBLE = {
    "apiVersion": "sluice.dev/v1alpha1", "kind": "Ensemble",
    "metadata": {"name": "classifier", "namespace": "models"},
    "spec": {
        "inputs": [{"name": "IMAGE", "dataType": "TYPE_UINT8", "dims": [-1]}],
        "outputs": [{"name": "LABEL", "dataType": "TYPE_STRING", "dims": [1]}],
        "steps": [
            {"name": "preprocess", "model": {"storageUri": "s3://models/pre", "format": "python"},
             "inputMap": {"RAW": "IMAGE"}, "outputMap": {"PIXELS": "pixels"}},
            {"name": "classify", "modelRef": {"name": "resnet"},
             "inputMap": {"input": "pixels"}, "outputMap": {"label": "LABEL"}},
        ],
    },
}


async def test_ensemble_waits_for_its_model_then_colocates_the_steps(client, operator, apiserver):
    await client.create(client.ENS, ENSEMBLE)
    degraded = await client.wait(lambda: client.condition(client.read(client.ENS, "classifier"), "Degraded"))
    assert degraded["reason"] == "Unsatisfiable"
    assert "spec.steps[1].modelRef: InferenceModel 'resnet' does not exist" in degraded["message"]

    await client.create(client.IM, client.model())  # the operator notices and re-reconciles the Ensemble
    deployment = await client.wait(lambda: client.read("apps/v1/deployments", "classifier"))
    assert deployment["metadata"]["ownerReferences"][0]["kind"] == "Ensemble"
    config_map = client.read("v1/configmaps", "classifier-config")
    ensemble_config = json.loads(config_map["data"]["classifier.config.json"])
    assert ensemble_config["platform"] == "ensemble"
    assert [s["model_name"] for s in ensemble_config["ensemble_scheduling"]["step"]] == ["preprocess", "resnet"]
    assert set(config_map["data"]) == {"classifier.config.json", "preprocess.config.json", "resnet.config.json"}
    fetched = [c["args"][1] for c in deployment["spec"]["template"]["spec"]["initContainers"]]  # pull URI DEST
    assert fetched == ["s3://models/pre", "s3://models/resnet50"]
    status = await client.wait(lambda: client.read(client.ENS, "classifier")["status"].get("placement") and
                               client.read(client.ENS, "classifier")["status"])
    assert status["placement"] == "Colocated"
    assert status["url"] == "http://classifier.models.svc.cluster.local:8000/v2/models/classifier"
    assert client.condition(client.read(client.ENS, "classifier"), "Degraded")["status"] == "False"


async def test_deleting_the_ensemble_keeps_the_referenced_model(client, operator):
    await client.create(client.IM, client.model())
    await client.create(client.ENS, ENSEMBLE)
    await client.wait(lambda: client.read("apps/v1/deployments", "classifier"))
    await client.wait(lambda: client.read("apps/v1/deployments", "resnet"))  # reconciled concurrently
    await client.delete(client.ENS, "classifier")
    await client.wait(lambda: client.read("apps/v1/deployments", "classifier") is None)
    assert client.read("apps/v1/deployments", "resnet") is not None


async def test_an_ensemble_step_in_a_format_without_a_backend_is_not_deployed(client, operator):
    await client.create(client.IM, client.model(model={"storageUri": "s3://models/r", "format": "tensorrt"}))
    await client.create(client.ENS, ENSEMBLE)
    degraded = await client.wait(
        lambda: (c := client.condition(client.read(client.ENS, "classifier"), "Degraded"))
        and c["reason"] == "NotImplemented" and c)
    assert "InferenceModel 'resnet' spec.model.format: tensorrt models are not served" in degraded["message"]
    await client.settle()
    assert client.read("apps/v1/deployments", "classifier") is None


async def test_an_ensemble_named_like_a_model_does_not_take_its_objects(client, operator, apiserver):
    """Children are named after their owner: an Ensemble 'resnet' beside InferenceModel 'resnet' would
    take its Deployment (one field manager applies both), and deleting either would take the other's
    pods. The second one reports the clash and touches nothing (once the first is gone, its next pass
    takes the names)."""
    model = await client.create(client.IM, client.model())
    await client.wait(lambda: client.read("apps/v1/deployments", "resnet"))
    await client.settle()
    clashing = json.loads(json.dumps(ENSEMBLE))
    clashing["metadata"]["name"] = "resnet"
    clashing["spec"]["steps"][1]["model"] = {"storageUri": "s3://models/other", "format": "onnx"}
    del clashing["spec"]["steps"][1]["modelRef"]
    await client.create(client.ENS, clashing)
    degraded = await client.wait(
        lambda: (c := client.condition(client.read(client.ENS, "resnet"), "Degraded")) and c["status"] == "True" and c)
    assert degraded["reason"] == "NameConflict"
    assert "belongs to InferenceModel 'resnet'" in degraded["message"] and "rename one" in degraded["message"]
    # the Deployment of that name is the model's: the blocked Ensemble owns no pods, and is not Ready on its word
    await apiserver.complete_rollout("models", "resnet")  # the model's pods are all ready
    await client.patch(client.ENS, "resnet", {"metadata": {"annotations": {"example.com/touch": "1"}}})
    await client.settle()
    blocked = client.read(client.ENS, "resnet")
    assert client.condition(blocked, "Ready")["status"] == "False"
    assert blocked["status"].get("readyReplicas", 0) == 0
    await client.settle()
    for resource in ("apps/v1/deployments", "v1/services"):
        [ref] = client.read(resource, "resnet")["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["uid"]) == ("InferenceModel", model["metadata"]["uid"]), resource
