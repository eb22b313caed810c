"""Sidecar injection as a pure function: pod + models + settings in, RFC 6902 JSON patch out.

Each case's patch is pinned in ``golden/sidecar-<case>.json`` (regenerate after an intended change with
``SLUICE_UPDATE_GOLDEN=1 pytest tests/operator_/test_sidecar.py``), applied with ``jsonpatch`` (the
reference implementation, not the operator's own applier) and the patched pod validated against the
Kubernetes schema of the version it is meant for (1.29 for native sidecars, 1.28 for the fallback).
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import pathlib
import re
from typing import Any

import jsonpatch
import kubernetes_validate  # a test dependency: these checks must run, never skip
import pytest

from sluice.operator import api, builders, certificates, sidecar
from sluice.operator.settings import Settings, Webhook

GOLDEN = pathlib.Path(__file__).parent / "golden"
SETTINGS = Settings()


SIDECAR = {"mode": "Sidecar", "model": {"storageUri": "s3://models/mnist", "format": "onnx"}}


def model(name: str, **spec: Any) -> sidecar.Model:
    raw = {"mode": "Sidecar", "model": {"storageUri": f"s3://models/{name}", "format": "onnx"}, **spec}
    return sidecar.indexed(name, raw, sidecar.rendered(3), 3)


def pod(*, inject: str | None = "mnist", **spec: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "shop-1", "namespace": "apps", "labels": {"app": "shop"}}
    if inject is not None:
        meta["annotations"] = {sidecar.INJECT_ANNOTATION: inject}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [{"name": "shop", "image": "registry.example.com/shop:1.4"}], **spec}}


KNOWN = {
    "mnist": model("mnist", resources={"cpu": "2", "memory": "1Gi"}),
    "ranker": model("ranker", storage={"secretRef": {"name": "s3-credentials"}},
                    runtime={"maxBatchSize": 8, "dynamicBatching": {}}),
    "detector": model("detector", resources={"gpu": {"memory": "8Gi"}}),
    "local": model("local", model={"storageUri": "pvc://models-claim/local", "format": "onnx", "version": 2}),
}

CASES: dict[str, tuple[dict[str, Any], bool]] = {
    "cpu-native": (pod(), True),
    "cpu-pre-1.29": (pod(), False),
    # The app's own init container, env, volumes and annotations are kept; two models in one runtime.
    "two-models-app-init": (
        {**pod(inject="mnist, ranker"), "spec": {
            "initContainers": [{"name": "migrate", "image": "registry.example.com/shop:1.4", "args": ["migrate"]}],
            "containers": [{"name": "shop", "image": "registry.example.com/shop:1.4",
                            "env": [{"name": "SLUICE_GRPC_URL", "value": "localhost:9001"}],
                            "volumeMounts": [{"name": "data", "mountPath": "/data"}]},
                           {"name": "proxy", "image": "registry.example.com/proxy:2"}],
            "volumes": [{"name": "data", "emptyDir": {}}]}},
        True),
    # A GPU model into a pod with its own node affinity and tolerations: the GPU's rules are ANDed in.
    "gpu-into-affinity": (
        {**pod(inject="detector"), "spec": {
            "containers": [{"name": "shop", "image": "registry.example.com/shop:1.4"}],
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "shop", "effect": "NoSchedule"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In",
                                       "values": ["eu-west-1a"]}]}]}}}}},
        True),
    "pvc-model": (pod(inject="local"), True),
}


def check_golden(name: str, ops: list[dict[str, Any]]) -> None:
    path = GOLDEN / f"sidecar-{name}.json"
    rendered = json.dumps(ops, indent=1) + "\n"
    if os.environ.get("SLUICE_UPDATE_GOLDEN"):
        path.write_text(rendered)
    assert path.exists(), f"{path} is missing; run with SLUICE_UPDATE_GOLDEN=1 to create it"
    assert json.loads(path.read_text()) == ops, f"{name} differs from {path}; if intended, regenerate with " \
        "SLUICE_UPDATE_GOLDEN=1"


@pytest.mark.parametrize("case", sorted(CASES))
def test_injection_matches_golden_and_makes_a_valid_pod(case):
    original, native = CASES[case]
    ops = sidecar.admit(original, KNOWN, SETTINGS, native=native)
    check_golden(case, ops)
    patched = jsonpatch.apply_patch(original, ops)
    kubernetes_validate.validate(patched, "1.29.0" if native else "1.28.0", strict=True)
    mine = copy.deepcopy(original)
    sidecar.apply(mine, ops)
    assert mine == patched  # the operator's applier (used under kopf) agrees with the reference one
    # Injected once: a second admission of the result (a re-invocation, a copied pod) changes nothing.
    assert sidecar.admit(patched, KNOWN, SETTINGS, native=native) == []

    spec = patched["spec"]
    runtime_list = spec["initContainers"] if native else spec["containers"]
    [runtime] = [c for c in runtime_list if c["name"] == sidecar.CONTAINER]
    assert runtime.get("restartPolicy") == ("Always" if native else None)
    assert runtime["args"][:21] == [
        "serve", "--model-repository", "/models", "--host", "127.0.0.1", "--http-port", "8000", "--grpc-port",
        "8001", "--metrics-port", "8002", "--metrics-host", "0.0.0.0", "--http-uds", "/var/run/sluice/http.sock",
        "--grpc-uds", "/var/run/sluice/grpc.sock", "--strict-readiness", "true", "--drain-period-s", "0"]
    # Probes dial the pod IP: only the metrics listener is there, and it answers the health paths.
    assert runtime["startupProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "sluice-metrics"}
    names = [c["name"] for c in spec.get("initContainers", [])]
    fetches = [n for n in names if n.startswith("sluice-fetch-")]
    # Fetches first, then (native) the runtime, then the app's own init containers, which see the models.
    assert names[:len(fetches)] == fetches
    if native:
        assert names[len(fetches)] == sidecar.CONTAINER
    app = [c for c in [*spec["containers"], *(spec.get("initContainers", []) if native else [])]
           if not c["name"].startswith("sluice-")]
    for container in app:
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts["/dev/shm"] == "sluice-shm" and mounts["/var/run/sluice"] == "sluice-sockets"
        assert {e["name"] for e in container["env"]} >= {"SLUICE_HTTP_URL", "SLUICE_GRPC_URL", "SLUICE_GRPC_UDS"}
    shm = next(v for v in spec["volumes"] if v["name"] == "sluice-shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}


def test_a_variable_the_app_sets_is_kept():
    original, native = CASES["two-models-app-init"]
    patched = jsonpatch.apply_patch(original, sidecar.admit(original, KNOWN, SETTINGS, native=native))
    shop = next(c for c in patched["spec"]["containers"] if c["name"] == "shop")
    assert [e["value"] for e in shop["env"] if e["name"] == "SLUICE_GRPC_URL"] == ["localhost:9001"]


def test_gpu_model_gets_the_gpu_image_request_and_the_rules_anded_into_the_pods_own():
    original, native = CASES["gpu-into-affinity"]
    patched = jsonpatch.apply_patch(original, sidecar.admit(original, KNOWN, SETTINGS, native=native))
    runtime = next(c for c in patched["spec"]["initContainers"] if c["name"] == sidecar.CONTAINER)
    assert runtime["image"] == SETTINGS.runtime_gpu_image
    assert runtime["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert builders.GPU_TOLERATION in patched["spec"]["tolerations"]
    assert len(patched["spec"]["tolerations"]) == 2
    [term] = patched["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    # Still the app's zone, and a GPU with at least 8 GiB.
    assert [e["key"] for e in term["matchExpressions"]] == ["topology.kubernetes.io/zone", builders.GPU_MEMORY_LABEL]


@pytest.mark.parametrize("annotation", [None, "false", "", " False "])
def test_a_pod_not_asking_or_opting_out_is_never_touched(annotation):
    original = pod(inject=annotation)
    assert sidecar.admit(original, KNOWN, SETTINGS, native=True) == []


def test_an_already_injected_pod_gets_nothing_even_with_another_model_asked():
    original = pod(inject="mnist")
    original["spec"]["initContainers"] = [{"name": sidecar.CONTAINER, "image": "x"}]
    assert sidecar.admit(original, KNOWN, SETTINGS, native=True) == []


@pytest.mark.parametrize(("change", "message"), [
    (lambda p: p["spec"]["containers"].append({"name": "sluice-fetch-0-mnist", "image": "x"}),
     "container name 'sluice-fetch-0-mnist' is already used by the pod"),
    (lambda p: p["spec"].update(volumes=[{"name": "sluice-shm", "emptyDir": {}}]),
     "volume name 'sluice-shm' is already used by the pod"),
    (lambda p: p["spec"]["containers"][0].update(ports=[{"containerPort": 8001}]),
     "port 8001 is taken by container 'shop'"),
    (lambda p: p["spec"]["containers"][0].update(volumeMounts=[{"name": "dshm", "mountPath": "/dev/shm"}]),
     "container 'shop' already mounts /dev/shm (volume 'dshm')"),
])
def test_a_clash_with_the_app_is_denied_naming_it(change, message):
    original = pod()
    change(original)
    with pytest.raises(sidecar.Denied) as caught:
        sidecar.admit(original, KNOWN, SETTINGS, native=True)
    assert message in str(caught.value)
    assert 'sluice.dev/inject: "false"' in str(caught.value)


def test_a_host_network_pod_is_denied():
    with pytest.raises(sidecar.Denied, match=r"hostNetwork, so the runtime's ports 8000, 8001 and 8002 would be"):
        sidecar.admit(pod(hostNetwork=True), KNOWN, SETTINGS, native=True)


def test_two_models_serving_one_model_name_are_denied():
    known = {**KNOWN, "mnist-b": model("mnist-b", model={"storageUri": "s3://models/b", "format": "onnx",
                                                          "name": "mnist"})}
    with pytest.raises(sidecar.Denied, match=r"'mnist' and 'mnist-b' both serve model 'mnist'"):
        sidecar.admit(pod(inject="mnist,mnist-b"), known, SETTINGS, native=True)


@pytest.mark.parametrize("served", ["resnet_", "resnet.", "r" * 50 + "-x", "a" * 63])
def test_fetch_container_names_are_dns_labels_whatever_the_model_name(served):
    known = {"m": model("m", model={"storageUri": "s3://models/m", "format": "onnx", "name": served})}
    ops = sidecar.admit(pod(inject="m"), known, SETTINGS, native=True)
    names = [c["name"] for op in ops for c in (op["value"] if isinstance(op["value"], list) else [op["value"]])
             if isinstance(c, dict) and "image" in c]
    assert names and all(re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", n) for n in names), names


def test_a_model_fetching_as_another_service_account_is_denied():
    known = {"mnist": model("mnist", storage={"serviceAccountName": "model-reader"})}
    with pytest.raises(sidecar.Denied, match=r"fetches as service account 'model-reader'.*runs as 'default'"):
        sidecar.admit(pod(), known, SETTINGS, native=True)
    assert sidecar.admit(pod(serviceAccountName="model-reader"), known, SETTINGS, native=True)


@pytest.mark.parametrize(("known", "message"), [
    ({}, "InferenceModel 'mnist' does not exist in namespace 'apps'"),
    ({"mnist": sidecar.indexed("mnist", {"model": {"storageUri": "s3://m/x", "format": "onnx"}}, None, None)},
     "its spec.mode is Deployment, not Sidecar"),
    ({"mnist": sidecar.indexed("mnist", {"mode": "Sidecar", "model": {"format": "onnx"}}, None, None)},
     "its spec is invalid"),
    ({"mnist": sidecar.indexed("mnist", {"mode": "Sidecar", "model": {"storageUri": "s3://m/x",
                                                                      "format": "tensorrt"}}, None, None)},
     "tensorrt models are not served"),
    ({"mnist": sidecar.indexed("mnist", SIDECAR, None, 1)},
     "the operator has not rendered its config (ConfigMap 'mnist-config') for generation 1 of its spec yet"),
    ({"mnist": sidecar.indexed("mnist", SIDECAR, sidecar.rendered(1), 2)}, "for generation 2 of its spec yet"),
    ({"mnist": sidecar.indexed("mnist", SIDECAR, {"observedGeneration": 2, "conditions": [
        {"type": "Ready", "status": "False", "reason": "Forbidden", "message": "configmaps is forbidden"}]}, 2)},
     "its config (ConfigMap 'mnist-config') is not rendered (Forbidden: configmaps is forbidden)"),
    # Ready from its Deployment-mode days: not an injectable config
    ({"mnist": sidecar.indexed("mnist", SIDECAR, {"observedGeneration": 2, "conditions": [
        {"type": "Ready", "status": "True", "reason": "Available"}]}, 2)},
     "is not rendered (Available); see its conditions"),
])
def test_a_model_that_cannot_be_injected_is_denied_with_the_reason(known, message):
    with pytest.raises(sidecar.Denied) as caught:
        sidecar.admit(pod(), known, SETTINGS, native=True)
    assert message in str(caught.value)


@pytest.mark.parametrize(("setting", "version", "native"), [
    ("auto", {"major": "1", "minor": "29"}, True),
    ("auto", {"major": "1", "minor": "31+"}, True),  # GKE/EKS spell it so
    ("auto", {"major": "1", "minor": "28"}, False),
    ("auto", {}, False),
    ("true", {"major": "1", "minor": "27"}, True),
    ("false", {"major": "1", "minor": "33"}, False),
])
def test_native_sidecars_follow_the_setting_or_the_server_version(setting, version, native):
    assert sidecar.native_sidecars(setting, version) is native


def test_a_sidecar_model_renders_only_its_config():
    owner = builders.Owner(kind="InferenceModel", name="mnist", namespace="apps", uid="u1")
    spec = KNOWN["mnist"].spec
    assert spec is not None
    desired = sidecar.children(owner, spec, SETTINGS)
    assert [(o["kind"], o["metadata"]["name"]) for o in desired.objects] == [("ConfigMap", "mnist-config")]
    assert ("apps/v1", "Deployment", "mnist") in desired.absent and ("v1", "Service", "mnist") in desired.absent
    ops = {op["path"]: op["value"] for op in sidecar.admit(pod(), KNOWN, SETTINGS, native=True)}
    stamp = ops["/metadata/annotations/sluice.dev~1injected"]
    assert stamp == f"mnist@{builders.config_hash(desired.objects[0]['data'])}"
    # Prometheus finds the runtime's metrics listener (the pod IP) unless the app annotates its own.
    assert ops["/metadata/annotations/prometheus.io~1port"] == str(SETTINGS.metrics_port)
    annotated = pod()
    annotated["metadata"]["annotations"]["prometheus.io/port"] = "9100"
    assert not any(op["path"].startswith("/metadata/annotations/prometheus.io")
                   for op in sidecar.admit(annotated, KNOWN, SETTINGS, native=True))


@pytest.mark.parametrize(("spec", "problem"), [
    ({"pool": "small", "resources": {"gpu": {"memory": "4Gi"}}}, "spec.pool"),
    ({"canary": {"storageUri": "s3://m/v2", "version": 2}}, "spec.canary"),
    ({"scaling": {"minReplicas": 2, "maxReplicas": 4}}, "spec.scaling"),
    ({"mode": "Daemon"}, "spec.mode"),
])
def test_sidecar_mode_rejects_what_a_sidecar_cannot_do(spec, problem):
    raw = {"mode": "Sidecar", "model": {"storageUri": "s3://m/x", "format": "onnx"}, **spec}
    with pytest.raises(api.SpecError, match=problem):
        api.parse_inference_model("m", raw)


def test_webhook_settings_from_the_environment():
    settings = Settings.from_env({"SLUICE_WEBHOOK_PORT": "9443", "SLUICE_NATIVE_SIDECARS": "false",
                                  "POD_NAMESPACE": "ops", "SLUICE_SIDECAR_SHM_SIZE": "256Mi"})
    assert settings.webhook == Webhook(port=9443, native_sidecars="false", namespace="ops", shm_size="256Mi")
    with pytest.raises(ValueError, match="SLUICE_NATIVE_SIDECARS='yes' is not allowed; allowed: auto, true, false"):
        Settings.from_env({"SLUICE_NATIVE_SIDECARS": "yes"})
    with pytest.raises(ValueError, match="SLUICE_WEBHOOK_PORT='https'"):
        Settings.from_env({"SLUICE_WEBHOOK_PORT": "https"})


def test_certificates_are_kept_renewed_with_the_same_ca_and_replaced_near_the_cas_end():
    names = certificates.dns_names("sluice-webhook", "sluice-system", "cluster.local")
    start = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)
    assert certificates.decide(None, names, start) == certificates.NEW_CA
    bundle = certificates.issue(None, certificates.NEW_CA, names, start)
    assert certificates.decide(bundle, names, start) == certificates.KEEP
    assert certificates.decide(bundle, [*names, "other"], start) == certificates.RENEW_SERVING
    later = start + datetime.timedelta(days=340)
    assert certificates.decide(bundle, names, later) == certificates.RENEW_SERVING
    renewed = certificates.issue(bundle, certificates.RENEW_SERVING, names, later)
    assert renewed.ca_cert == bundle.ca_cert and renewed.cert != bundle.cert  # the caBundle stays valid
    assert certificates.decide(renewed, names, later) == certificates.KEEP
    near_ca_end = start + datetime.timedelta(days=certificates.CA_DAYS - 100)
    assert certificates.decide(renewed, names, near_ca_end) == certificates.NEW_CA
    assert bundle.trusted(start) == bundle.ca_cert  # one CA: one certificate in the caBundle
    rotated = certificates.issue(renewed, certificates.NEW_CA, names, near_ca_end)
    assert rotated.ca_cert != renewed.ca_cert and rotated.previous_ca_cert == renewed.ca_cert
    # both trusted while replicas still serving a certificate of the old CA pick the new one up
    assert rotated.trusted(near_ca_end) == rotated.ca_cert + renewed.ca_cert
    assert certificates.Bundle.from_data(rotated.as_data()) == rotated  # kept in the Secret
    after_old_ca = start + datetime.timedelta(days=certificates.CA_DAYS + 1)
    assert rotated.trusted(after_old_ca) == rotated.ca_cert
    broken = certificates.Bundle("not a certificate", "x", "y", "z")
    assert certificates.decide(broken, names, start) == certificates.NEW_CA


async def test_a_model_the_index_lacks_and_the_api_does_not_answer_is_denied_in_time(monkeypatch):
    """The webhook's own timeout is 10 s: an API that does not answer gets a clear denial well before."""
    import asyncio

    from sluice.operator import webhook

    class Silent:
        async def get(self, kind: str, namespace: str, name: str) -> None:
            await asyncio.Event().wait()

    monkeypatch.setattr(webhook, "LOOKUP_TIMEOUT_S", 0.05)
    injector = webhook.Injector(SETTINGS, Silent())  # type: ignore[arg-type]
    injector.native = True
    with pytest.raises(sidecar.Denied, match=r"'mnist' could not be read from the API"):
        await asyncio.wait_for(injector.review(pod(), {}), 5)
