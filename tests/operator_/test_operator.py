"""The real kopf operator against the emulator: the lifecycle of an InferenceModel.

Each test drives the cluster through the HTTP API as kubectl would and asserts on the stored objects.
"""

from __future__ import annotations

import json
import re

from sluice.operator.crd import inference_model_crd

DEPLOY = "apps/v1/deployments"
HPA = "autoscaling/v2/horizontalpodautoscalers"
PDB = "policy/v1/poddisruptionbudgets"
CHILDREN = [(DEPLOY, "resnet"), ("v1/services", "resnet"), ("v1/configmaps", "resnet-config"), (HPA, "resnet"),
            (PDB, "resnet")]


def status_of(client, name="resnet"):
    return (client.read(client.IM, name) or {}).get("status", {})


async def test_create_makes_children_with_owner_refs_and_status(client, operator, apiserver):
    created = await client.create(client.IM, client.model())
    uid = created["metadata"]["uid"]
    for resource, name in CHILDREN:
        child = await client.wait(lambda r=resource, n=name: client.read(r, n))
        [ref] = child["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": "sluice.dev/v1alpha1", "kind": "InferenceModel", "name": "resnet",
                       "uid": uid, "controller": True, "blockOwnerDeletion": True}
        assert child["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "sluice-operator"
    deployment = client.read(DEPLOY, "resnet")
    # min 2 < max 4: the HPA owns the replica count; the operator applies none (the server defaults 1)
    assert deployment["spec"]["replicas"] == 1
    assert not any("f:replicas" in entry["fieldsV1"].get("f:spec", {})
                   for entry in deployment["metadata"]["managedFields"])
    status = await client.wait(lambda: status_of(client).get("conditions") and status_of(client))
    assert status["observedGeneration"] == 1
    assert status["url"] == "http://resnet.models.svc.cluster.local:8000/v2/models/resnet"
    assert status["endpoints"] == {"http": "http://resnet.models.svc.cluster.local:8000",
                                   "grpc": "resnet.models.svc.cluster.local:8001"}
    assert status["trafficSummary"] == "v1=100"
    assert client.condition(client.read(client.IM, "resnet"), "Ready")["status"] == "False"
    assert client.condition(client.read(client.IM, "resnet"), "Progressing")["status"] == "True"
    assert client.condition(client.read(client.IM, "resnet"), "Degraded")["status"] == "False"


async def test_children_are_listed_and_watched_by_the_operators_label_only(client, operator, apiserver):
    """The API server filters the child kinds for the operator: it does not receive every Deployment,
    Service, ConfigMap, PDB and HPA of the cluster (a large cluster's would fill its memory)."""
    await client.create(client.IM, client.model())
    await client.wait(lambda: client.read(DEPLOY, "resnet"))
    await client.settle()
    children = {"deployments", "services", "configmaps", "poddisruptionbudgets", "horizontalpodautoscalers"}
    seen = {(verb, plural): selector for verb, plural, selector in apiserver.reads if plural in children}
    assert {plural for _, plural in seen} == children
    assert set(seen.values()) == {"app.kubernetes.io/managed-by=sluice-operator"}, seen


async def test_ready_follows_the_deployment(client, operator, apiserver, clock):
    await client.create(client.IM, client.model())
    await client.wait(lambda: status_of(client).get("conditions"))
    not_ready_since = client.condition(client.read(client.IM, "resnet"), "Ready")["lastTransitionTime"]
    clock.advance(90)
    await apiserver.complete_rollout("models", "resnet")  # the Deployment controller reports all pods ready
    await client.wait(lambda: client.condition(client.read(client.IM, "resnet"), "Ready")["status"] == "True")
    model = client.read(client.IM, "resnet")
    ready = client.condition(model, "Ready")
    assert ready["reason"] == "Available"
    assert ready["lastTransitionTime"] == "2025-01-01T00:01:30Z" != not_ready_since
    assert client.condition(model, "Progressing")["reason"] == "RolloutComplete"
    assert model["status"]["readyReplicas"] == 1
    [event] = await client.wait(lambda: [e for e in client.events() if e["reason"] == "Available"])
    assert event["type"] == "Normal"
    assert event["involvedObject"]["name"] == "resnet"


async def test_status_is_not_rewritten_when_nothing_changed(client, operator, apiserver, clock):
    await client.create(client.IM, client.model())
    await client.wait(lambda: status_of(client).get("conditions"))
    await client.settle()
    before = client.read(client.IM, "resnet")
    children = {child: client.read(*child)["metadata"]["resourceVersion"] for child in CHILDREN}
    cluster_version = apiserver.version  # moves on any write anywhere: objects, status, Events
    clock.advance(3600)
    outcome = await operator.reconciler.reconcile(before)
    assert outcome is not None
    assert outcome.status_written is False
    assert outcome.applied == 5
    after = client.read(client.IM, "resnet")
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    for resource, name in CHILDREN:  # a no-op apply leaves every child's resourceVersion alone
        assert client.read(resource, name)["metadata"]["resourceVersion"] == children[resource, name]
    assert apiserver.version == cluster_version


async def test_spec_update_rolls_the_deployment(client, operator, apiserver):
    await client.create(client.IM, client.model())
    first = await client.wait(lambda: client.read(DEPLOY, "resnet"))
    first_hash = first["spec"]["template"]["metadata"]["annotations"]["sluice.dev/config-hash"]
    await client.patch(client.IM, "resnet", {"spec": {"runtime": {"maxBatchSize": 32}}})
    rolled = await client.wait(lambda: (d := client.read(DEPLOY, "resnet"))["metadata"]["generation"] == 2 and d)
    assert rolled["spec"]["template"]["metadata"]["annotations"]["sluice.dev/config-hash"] != first_hash
    config = client.read("v1/configmaps", "resnet-config")["data"]["resnet.config.json"]
    assert '"max_batch_size": 32' in config
    await client.wait(lambda: status_of(client).get("observedGeneration") == 2)


async def test_runtime_pods_drain_in_prestop_with_a_grace_period_that_covers_it(client, operator, apiserver):
    created = await client.create(client.IM, client.model(shutdown={"drainSeconds": 10}))
    assert created["spec"]["shutdown"] == {"drainSeconds": 10, "graceSeconds": 30}  # CRD defaulting
    pod = (await client.wait(lambda: client.read(DEPLOY, "resnet")))["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", "10"]}}
    args = " ".join(container["args"])
    assert "--strict-readiness true --drain-period-s 0 --shutdown-grace-s 30" in args
    assert pod["terminationGracePeriodSeconds"] == 45
    await client.patch(client.IM, "resnet", {"spec": {"shutdown": {"drainSeconds": 0, "graceSeconds": 90}}})
    pod = (await client.wait(lambda: "--shutdown-grace-s 90" in " ".join(
        (d := client.read(DEPLOY, "resnet"))["spec"]["template"]["spec"]["containers"][0]["args"]) and d)
    )["spec"]["template"]["spec"]
    assert "lifecycle" not in pod["containers"][0]
    assert pod["terminationGracePeriodSeconds"] == 95


async def test_protocol_workers_are_passed_to_the_runtime_and_bad_values_refused(client, operator, apiserver):
    def args() -> str:
        return " ".join(client.read(DEPLOY, "resnet")["spec"]["template"]["spec"]["containers"][0]["args"])

    await client.create(client.IM, client.model())
    await client.wait(lambda: client.read(DEPLOY, "resnet"))
    assert "--protocol-workers" not in args()
    await client.patch(client.IM, "resnet", {"spec": {"server": {"protocolWorkers": "auto"}}})
    await client.wait(lambda: "--protocol-workers auto" in args())
    await client.patch(client.IM, "resnet", {"spec": {"server": {"protocolWorkers": 6}}})
    await client.wait(lambda: "--protocol-workers 6" in args())
    for value in (65, "six", -1):  # the API server's schema: int-or-string, 0..64 or "auto"
        status, body = await client.create_raw(client.IM, client.model("other", server={"protocolWorkers": value}))
        assert status == 422, (value, body)
        assert "protocolWorkers" in body["message"], body
    await client.patch(client.IM, "resnet", {"spec": {"server": None}})
    await client.wait(lambda: "--protocol-workers" not in args())


async def test_scaling_change_removes_the_hpa_and_pins_replicas(client, operator, apiserver):
    await client.create(client.IM, client.model())
    await client.wait(lambda: client.read(HPA, "resnet"))
    await client.patch(client.IM, "resnet", {"spec": {"scaling": {"minReplicas": 1, "maxReplicas": 1}}})
    await client.wait(lambda: client.read(HPA, "resnet") is None and client.read(PDB, "resnet") is None)
    assert client.read(DEPLOY, "resnet")["spec"]["replicas"] == 1


async def test_delete_garbage_collects_every_child(client, operator, apiserver):
    await client.create(client.IM, client.model())
    for resource, name in CHILDREN:
        await client.wait(lambda r=resource, n=name: client.read(r, n))
    await client.delete(client.IM, "resnet")
    await client.wait(lambda: client.read(client.IM, "resnet") is None)  # kopf released its finalizer
    for resource, name in CHILDREN:
        assert client.read(resource, name) is None, resource


async def test_a_deleted_child_is_recreated(client, operator, apiserver):
    await client.create(client.IM, client.model())
    old = await client.wait(lambda: client.read("v1/services", "resnet"))
    await client.delete("v1/services", "resnet")
    new = await client.wait(lambda: client.read("v1/services", "resnet"))
    assert new["metadata"]["uid"] != old["metadata"]["uid"]


async def test_an_edited_child_is_restored(client, operator, apiserver):
    await client.create(client.IM, client.model())
    await client.wait(lambda: client.read(DEPLOY, "resnet"))
    await client.patch(DEPLOY, "resnet", {"spec": {"template": {"spec": {"containers": [
        {"name": "runtime", "image": "evil:latest"}]}}}})
    restored = await client.wait(
        lambda: (d := client.read(DEPLOY, "resnet"))["spec"]["template"]["spec"]["containers"][0]["image"]
        == "sluice-runtime:test" and d)
    assert restored["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] == \
        "/v2/health/ready"


async def test_a_status_write_to_the_hpa_does_not_reconcile_the_model_but_an_edit_does(client, operator, apiserver):
    """The HPA controller writes its status every sync: that is no reason to reconcile (the reconcile
    does not read it); an edit of its spec is, and is put back."""
    hpas = "/apis/autoscaling/v2/namespaces/models/horizontalpodautoscalers/resnet"
    await client.create(client.IM, client.model())
    await client.wait(lambda: client.read(HPA, "resnet"))
    reconciles = operator.metrics.reconciles.labels("InferenceModel", "ok")

    async def quiet() -> float:
        # a reconcile that writes nothing leaves the store alone, so settle() can return while one still
        # runs (seen on a loaded machine): wait for the counter to hold still too
        while True:
            seen = reconciles._value.get()
            await client.settle()
            if reconciles._value.get() == seen:
                return seen

    before = await quiet()
    for replicas in (2, 3, 4):
        await client._call("PATCH", f"{hpas}/status", data=json.dumps({"status": {
            "currentReplicas": replicas, "desiredReplicas": replicas}}),
            headers={"Content-Type": "application/merge-patch+json"})
        await client.settle()
    assert client.read(HPA, "resnet")["status"]["currentReplicas"] == 4
    assert await quiet() == before
    await client.patch(HPA, "resnet", {"spec": {"maxReplicas": 40}})
    await client.wait(lambda: client.read(HPA, "resnet")["spec"]["maxReplicas"] == 4)
    # the reconcile that put it back is counted when it returns, after its write
    await client.wait(lambda: reconciles._value.get() > before)


async def test_invalid_spec_is_degraded_and_the_operator_keeps_working(client, operator, apiserver):
    # Passes the OpenAPI schema (the emulator enforces it) but breaks a CEL rule (it does not).
    bad = client.model("broken", scaling={"minReplicas": 5, "maxReplicas": 2},
                       resources={"gpu": {"count": 1, "migProfile": "1g.10gb"}})
    await client.create(client.IM, bad)
    degraded = await client.wait(lambda: client.condition(client.read(client.IM, "broken"), "Degraded"))
    assert degraded["status"] == "True"
    assert degraded["reason"] == "InvalidSpec"
    assert "minReplicas (5) must be <= maxReplicas (2)" in degraded["message"]
    assert "set exactly one of count" in degraded["message"]
    assert client.read(DEPLOY, "broken") is None
    [event] = await client.wait(lambda: [e for e in client.events() if e["reason"] == "InvalidSpec"])
    assert event["type"] == "Warning"
    assert "maxReplicas" in event["message"]

    await client.create(client.IM, client.model())  # another model still reconciles
    await client.wait(lambda: client.read(DEPLOY, "resnet"))
    await client.patch(client.IM, "broken", {"spec": {"scaling": {"minReplicas": 1},
                                                      "resources": {"gpu": {"migProfile": None}}}})
    fixed = await client.wait(
        lambda: client.condition(client.read(client.IM, "broken"), "Degraded")["status"] == "False"
        and client.read(DEPLOY, "broken"))
    assert fixed["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"


async def test_schema_violations_are_rejected_by_the_api(client, operator):
    status, body = await client.create_raw(client.IM, client.model(runtime={"maxBatchSize": -1}))
    assert status == 422
    assert "maxBatchSize" in body["message"]


async def test_a_format_without_a_backend_is_degraded_and_deploys_nothing(client, operator, apiserver):
    await client.create(client.IM, client.model(model={"storageUri": "s3://models/bert", "format": "tensorrt"}))
    degraded = await client.wait(lambda: client.condition(client.read(client.IM, "resnet"), "Degraded"))
    assert degraded["status"] == "True"
    assert degraded["reason"] == "NotImplemented"
    assert "tensorrt models are not served by this runtime version yet (served: onnx, torchscript, python)" in \
        degraded["message"]
    await client.settle()
    for resource, name in CHILDREN:  # no Deployment to crash-loop, nothing else either
        assert client.read(resource, name) is None, resource
    assert client.condition(client.read(client.IM, "resnet"), "Ready")["status"] == "False"
    # Switching to a served format deploys it.
    await client.patch(client.IM, "resnet", {"spec": {"model": {"format": "onnx"}}})
    await client.wait(lambda: client.read(DEPLOY, "resnet"))
    await client.wait(lambda: client.condition(client.read(client.IM, "resnet"), "Degraded")["status"] == "False")


async def test_a_torchscript_model_without_its_config_is_invalid_and_deploys_once_given_one(client, operator,
                                                                                          apiserver):
    await client.create(client.IM, client.model(model={"storageUri": "s3://models/resnet/1", "format": "torchscript"},
                                                resources={"gpu": {"count": 1}}))
    degraded = await client.wait(
        lambda: (c := client.condition(client.read(client.IM, "resnet"), "Degraded")) and c["status"] == "True" and c)
    assert degraded["reason"] == "InvalidSpec"
    assert "spec.model.config: is required for a torchscript model" in degraded["message"]
    assert client.read(DEPLOY, "resnet") is None
    config = ('platform: "pytorch_libtorch"\nmax_batch_size: 8\n'
              'input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
              'output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n')
    # The inline config replaces spec.runtime (the two cannot be combined).
    await client.patch(client.IM, "resnet", {"spec": {"model": {"config": config}, "runtime": None}})
    deployment = await client.wait(lambda: client.read(DEPLOY, "resnet"))
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"].endswith("-cuda"), container["image"]  # the CUDA image carries torch's CUDA build
    assert client.read("v1/configmaps", "resnet-config")["data"] == {"resnet.config.pbtxt": config}
    await client.wait(lambda: client.condition(client.read(client.IM, "resnet"), "Degraded")["status"] == "False")


async def test_a_sidecar_model_is_not_ready_to_inject_when_the_operator_serves_no_webhook(client, operator):
    """This operator runs without the injection webhook (SLUICE_WEBHOOK_PORT 0, the chart's default):
    the config is rendered, but no pod would get the runtime, so the model does not say ReadyToInject."""
    sidecar_model = client.model(mode="Sidecar")
    del sidecar_model["spec"]["scaling"]  # a sidecar has no replicas of its own
    await client.create(client.IM, sidecar_model)
    ready = await client.wait(
        lambda: (c := client.condition(client.read(client.IM, "resnet"), "Ready")) and c.get("reason") and c)
    assert (ready["status"], ready["reason"]) == ("False", "NoInjectionWebhook")
    assert "serves no sidecar-injection webhook" in ready["message"] and "webhook.enabled" in ready["message"]
    assert client.read("v1/configmaps", "resnet-config") is not None
    assert client.read(DEPLOY, "resnet") is None


async def test_a_rejected_apply_is_degraded_then_recovers(client, operator, apiserver):
    apiserver.reject_writes(DEPLOY, 403, 'deployments.apps is forbidden: User "system:serviceaccount:x" cannot patch')
    await client.create(client.IM, client.model())
    degraded = await client.wait(
        lambda: (c := client.condition(client.read(client.IM, "resnet"), "Degraded")) and c["status"] == "True" and c)
    assert degraded["reason"] == "Forbidden"
    assert "rejected Deployment 'resnet' (403 Forbidden): deployments.apps is forbidden" in degraded["message"]
    apiserver.allow_writes(DEPLOY)
    await client.patch(client.IM, "resnet", {"metadata": {"labels": {"team": "vision"}}})  # any change retries
    await client.wait(lambda: client.read(DEPLOY, "resnet"))
    await client.wait(lambda: client.condition(client.read(client.IM, "resnet"), "Degraded")["status"] == "False")


def json_path(obj, expression):
    """The subset of kubectl's JSONPath the CRD uses: ``.a.b`` and ``.a[?(@.k=="v")].b``."""
    value = obj
    for part in re.findall(r'\.([A-Za-z]+)(?:\[\?\(@\.(\w+)=="(\w+)"\)\])?', expression):
        key, filter_key, filter_value = part
        value = value.get(key) if isinstance(value, dict) else None
        if filter_key:
            value = next((item for item in value or [] if item.get(filter_key) == filter_value), None)
    return value


async def test_printer_columns_and_scale_paths_read_what_the_operator_writes(client, operator, apiserver):
    await client.create(client.IM, client.model(scaling={"minReplicas": 2, "maxReplicas": 2}))
    await client.wait(lambda: client.read(DEPLOY, "resnet"))
    await apiserver.complete_rollout("models", "resnet")
    model = await client.wait(
        lambda: (m := client.read(client.IM, "resnet")) and client.condition(m, "Ready")["status"] == "True" and m)
    [version] = inference_model_crd()["spec"]["versions"]
    columns = {c["name"]: json_path(model, c["jsonPath"]) for c in version["additionalPrinterColumns"]}
    assert columns == {
        "Ready": "True", "Replicas": 2, "Traffic": "v1=100", "Canary": None, "GPU": None,
        "URL": "http://resnet.models.svc.cluster.local:8000/v2/models/resnet",
        "Age": model["metadata"]["creationTimestamp"],
    }
    scale = version["subresources"]["scale"]
    assert json_path(model, scale["specReplicasPath"]) == 2
    assert json_path(model, scale["statusReplicasPath"]) == 2
    # The selector the scale subresource publishes (for `kubectl scale`, HPA on the CR, VPA) selects the pods.
    selector = json_path(model, scale["labelSelectorPath"])
    pod_labels = client.read(DEPLOY, "resnet")["spec"]["template"]["metadata"]["labels"]
    assert selector and all(pod_labels.get(k) == v for k, v in (t.split("=") for t in selector.split(",")))


async def test_pods_the_scheduler_cannot_place_give_a_condition_naming_what_is_missing(client, operator, apiserver):
    """No silent plateau: the emulator has no scheduler, so the test writes the pod and its
    PodScheduled condition as the ReplicaSet controller and the scheduler would (e2e/README.md)."""
    await client.create(client.IM, client.model(resources={"gpu": {"count": 1}}))
    deployment = await client.wait(lambda: client.read(DEPLOY, "resnet"))
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "resnet-7d9f-x2k4p", "namespace": "models", "labels": labels},
           "spec": {"containers": [{"name": "runtime", "image": "sluice-runtime:test"}]}}  # fmt: skip
    await client.post("/api/v1/namespaces/models/pods", pod)
    await client.post("/api/v1/namespaces/models/pods",
                      {**pod, "metadata": {**pod["metadata"], "name": "unrelated", "labels": {"app": "other"}}})
    message = "0/3 nodes are available: 1 Insufficient cpu, 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes"
    await apiserver.write_status("v1/pods", "models", "resnet-7d9f-x2k4p", {
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}],
    })  # fmt: skip
    # the Deployment controller reports the pod it created; the operator reconciles on that
    generation = deployment["metadata"]["generation"]
    await apiserver.write_status("apps/v1/deployments", "models", "resnet",
                                 {"observedGeneration": generation, "replicas": 2, "unavailableReplicas": 2})
    degraded = await client.wait(lambda: (c := client.condition(client.read(client.IM, "resnet"), "Degraded"))
                                 and c["reason"] == "Unschedulable" and c)
    assert degraded["status"] == "True"
    assert "1 runtime pod(s) cannot be scheduled: not enough cpu, nvidia.com/gpu on any node" in degraded["message"]
    assert message in degraded["message"]
    # the scheduler places it: the condition clears
    await apiserver.write_status("v1/pods", "models", "resnet-7d9f-x2k4p", {"phase": "Running", "conditions": []})
    await apiserver.complete_rollout("models", "resnet")
    await client.wait(lambda: client.condition(client.read(client.IM, "resnet"), "Degraded")["reason"] == "AsExpected")


async def test_a_canary_that_is_not_ready_leaves_the_model_ready_on_its_stable_pods(client, operator, apiserver):
    await client.create(client.IM, client.model(
        scaling={"minReplicas": 2, "maxReplicas": 2},
        canary={"storageUri": "s3://models/resnet50-v2", "version": 2, "trafficPercent": 20}))
    await client.wait(lambda: client.read(DEPLOY, "resnet") and client.read(DEPLOY, "resnet-canary"))
    await apiserver.complete_rollout("models", "resnet")  # the canary's pods never become ready
    model = await client.wait(
        lambda: (m := client.read(client.IM, "resnet")) and client.condition(m, "Ready")["status"] == "True" and m)
    assert model["status"]["readyReplicas"] == 2
    assert model["status"]["canary"]["phase"] == "Initializing" and model["status"]["canary"]["weight"] == 0
    assert model["status"]["trafficSummary"] == "v1=100,v2=0"


def test_status_churning_children_seen_are_bounded_and_status_writes_are_not_changes():
    """A child deleted while the watch was down sends no DELETED event: its entry would stay for ever. The
    operator keeps at most ``limit``, the least recently changed going first; a forgotten child only
    costs one reconcile at its next write."""
    from sluice.operator.handlers import SeenChildren

    def hpa(name: str, max_replicas: int, current: int = 1) -> dict[str, object]:
        return {"kind": "HorizontalPodAutoscaler", "metadata": {"name": name, "uid": name, "resourceVersion": "7"},
                "spec": {"maxReplicas": max_replicas}, "status": {"currentReplicas": current}}

    seen = SeenChildren(limit=2)
    assert seen.changed("a", hpa("a", 4)) and seen.changed("b", hpa("b", 4))
    assert not seen.changed("a", hpa("a", 4, current=3))  # a status write: no change (and a is now recent)
    assert seen.changed("a", hpa("a", 40))                 # a spec edit is one
    assert seen.changed("c", hpa("c", 4)) and len(seen) == 2  # b, least recently changed, is dropped
    assert seen.changed("b", hpa("b", 4))                     # so it counts as changed once more
    assert not seen.changed("c", hpa("c", 4, current=2))
    seen.forget("c")
    assert seen.changed("c", hpa("c", 4, current=2)) and len(seen) == 2
