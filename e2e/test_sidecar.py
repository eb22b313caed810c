"""Sidecar mode end to end: the real operator (kopf, handlers, its webhook server) against the emulator.

The emulator does not call admission webhooks: the test plays the API server's part. It installs the
MutatingWebhookConfiguration as the chart does, waits for the operator to publish its CA in the
``caBundle`` (self-managed TLS), then POSTs an ``admission.k8s.io/v1`` AdmissionReview over HTTPS to the
Service name in the configuration, trusting only that caBundle, as the API server would; it applies the
answer's JSON patch and creates the pod, as the API server does after a mutating webhook.
"""

from __future__ import annotations

import base64
import copy
import json
import socket
import ssl
import uuid
from typing import Any

import aiohttp
import jsonpatch
import kmock
import kopf
import pytest

from sluice.operator import builders, certificates, webhook
from sluice.operator.crd import all_crds
from sluice.operator.kube import Kube, path
from sluice.operator.settings import Settings, Webhook
from sluice_testing import ApiServer, Cluster, OperatorHarness

NAMESPACE = "apps"
SYSTEM = "sluice-system"
MODEL: dict[str, Any] = {
    "apiVersion": "sluice.dev/v1alpha1", "kind": "InferenceModel", "metadata": {"name": "mnist"},
    "spec": {"mode": "Sidecar", "model": {"storageUri": "https://example.com/mnist-12.onnx", "format": "onnx"},
             "resources": {"cpu": "2", "memory": "1Gi"}},
}
CONFIGURATION: dict[str, Any] = {  # as helm/sluice/templates/webhook.yaml renders it (self-managed TLS)
    "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
    "metadata": {"name": "sluice-sidecar-injector"},
    "webhooks": [{
        "name": "sidecar-injector.sluice.dev", "admissionReviewVersions": ["v1"], "sideEffects": "None",
        "failurePolicy": "Fail", "timeoutSeconds": 10, "reinvocationPolicy": "Never",
        "clientConfig": {"service": {"name": "sluice-webhook", "namespace": SYSTEM, "path": "/sidecar-injector",
                                     "port": 443}},
        "namespaceSelector": {"matchLabels": {"sluice.dev/injection": "enabled"}},
        "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"],
                   "scope": "Namespaced"}],
    }],
}


def app_pod() -> dict[str, Any]:
    # As a ReplicaSet makes it: generateName, no name and no namespace of its own at admission time.
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": "shop-7d4b9-", "labels": {"app": "shop"},
                     "annotations": {"sluice.dev/inject": "mnist"}},
        "spec": {"containers": [{"name": "shop", "image": "registry.example.com/shop:1.4",
                                 "ports": [{"containerPort": 8080}]}]},
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Webhooks:
    """The API server's side of admission: call the webhook the configuration names, apply its patch."""

    def __init__(self, cluster: Cluster, port: int) -> None:
        self.cluster, self.port = cluster, port

    async def ca_bundle(self) -> bytes:
        async def published() -> str:
            status, found = await self.cluster.call(
                "GET", "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/sluice-sidecar-injector")
            hooks = found.get("webhooks", [{}]) if status == 200 else [{}]
            return str(hooks[0].get("clientConfig", {}).get("caBundle", ""))

        return base64.b64decode(await self.cluster.wait(published, "the operator publishes its CA in the caBundle"))

    async def review(self, pod: dict[str, Any], namespace: str = NAMESPACE) -> dict[str, Any]:
        hook = CONFIGURATION["webhooks"][0]
        service = hook["clientConfig"]["service"]
        context = ssl.create_default_context(cadata=(await self.ca_bundle()).decode())
        request = {
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {
                "uid": str(uuid.uuid4()), "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
                "requestResource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": namespace, "operation": "CREATE",
                "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
                "object": pod, "oldObject": None, "dryRun": False,
                "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
            },
        }
        # The API server dials <service>.<namespace>.svc and checks the certificate against that name.
        host = f"{service['name']}.{service['namespace']}.svc"
        async with aiohttp.ClientSession() as session, session.post(
            f"https://127.0.0.1:{self.port}{service['path']}", json=request, ssl=context, server_hostname=host,
        ) as resp:
            assert resp.status == 200, await resp.text()
            answer: dict[str, Any] = await resp.json()
        assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
        assert answer["response"]["uid"] == request["request"]["uid"]
        return answer["response"]

    @staticmethod
    def patched(pod: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
        if "patch" not in response:
            return pod
        assert response["patchType"] == "JSONPatch"
        return jsonpatch.apply_patch(pod, json.loads(base64.b64decode(response["patch"])))


@pytest.fixture(params=["1.31.0", "1.28.9"], ids=["native", "pre-1.29"])
async def env(request, tmp_path):
    port = _free_port()
    async with ApiServer(simulate_rollouts=True, kubernetes_version=request.param) as server, kmock.Server(server):
        for definition in all_crds():
            server.register_crd(copy.deepcopy(definition))
        await server.create(copy.deepcopy(CONFIGURATION))
        await server.create({"apiVersion": "v1", "kind": "Namespace",
                             "metadata": {"name": NAMESPACE, "labels": {"sluice.dev/injection": "enabled"}}})
        info = kopf.ConnectionInfo(server=str(server.url).rstrip("/"), insecure=True)
        settings = Settings(resync_seconds=3600, webhook=Webhook(
            port=port, cert_dir=str(tmp_path / "certs"), namespace=SYSTEM))
        async with OperatorHarness(settings=settings, connection=info):
            cluster = Cluster(info, NAMESPACE, timeout=15)
            try:
                yield cluster, Webhooks(cluster, port), server, request.param
            finally:
                await cluster.session.close()


async def test_an_annotated_pod_gets_the_runtime_and_is_created(env):
    cluster, webhooks, server, version = env
    status, body = await cluster.create(MODEL)
    assert status == 201, body
    ready = await cluster.wait(lambda: _condition(cluster, "Ready", "True"), "the Sidecar model is Ready")
    assert ready["reason"] == "ReadyToInject"
    # Only its config: no Deployment, Service, PDB or autoscaler of its own.
    assert await cluster.get("ConfigMap", "mnist-config") is not None
    assert await cluster.get("Deployment", "mnist") is None
    assert await cluster.get("Service", "mnist") is None

    response = await webhooks.review(app_pod())
    assert response["allowed"] is True, response
    pod = webhooks.patched(app_pod(), response)
    native = version == "1.31.0"
    runtimes = [c for c in (pod["spec"].get("initContainers") if native else pod["spec"]["containers"]) or []
                if c["name"] == "sluice-runtime"]
    assert len(runtimes) == 1
    assert (runtimes[0].get("restartPolicy") == "Always") is native
    assert "--grpc-uds" in runtimes[0]["args"]
    # The injected annotation names the model and the hash of the config the ConfigMap holds.
    files = (await cluster.get("ConfigMap", "mnist-config"))["data"]
    assert pod["metadata"]["annotations"]["sluice.dev/injected"] == f"mnist@{builders.config_hash(files)}"
    shop = next(c for c in pod["spec"]["containers"] if c["name"] == "shop")
    assert {"name": "SLUICE_GRPC_UDS", "value": "unix:///var/run/sluice/grpc.sock"} in shop["env"]
    assert {m["mountPath"] for m in shop["volumeMounts"]} == {"/dev/shm", "/var/run/sluice"}

    # The API server then stores the patched pod; it is valid for it.
    pod["metadata"]["name"] = "shop-7d4b9-x1"
    status, created = await cluster.create(pod)
    assert status == 201, created
    stored = server.read("v1/pods", NAMESPACE, "shop-7d4b9-x1")
    assert stored is not None and stored["metadata"]["annotations"]["sluice.dev/injected"].startswith("mnist@")

    # Re-invocation (or a pod copied from an injected one) gets nothing twice.
    again = await webhooks.review(stored)
    assert again["allowed"] is True and "patch" not in again


async def test_unknown_or_deployment_mode_model_is_denied_with_the_reason(env):
    cluster, webhooks, _, _ = env
    pod = app_pod()
    pod["metadata"]["annotations"]["sluice.dev/inject"] = "nope"
    response = await webhooks.review(pod)
    assert response["allowed"] is False
    assert response["status"]["code"] == 403
    assert "InferenceModel 'nope' does not exist in namespace 'apps'" in response["status"]["message"]

    deployment_mode = copy.deepcopy(MODEL)
    deployment_mode["metadata"]["name"] = "served"
    del deployment_mode["spec"]["mode"]
    assert (await cluster.create(deployment_mode))[0] == 201
    pod["metadata"]["annotations"]["sluice.dev/inject"] = "served"

    async def denied_for_mode() -> dict[str, Any] | None:
        answer = await webhooks.review(pod)
        return answer if "spec.mode is Deployment" in answer.get("status", {}).get("message", "") else None

    answer = await cluster.wait(denied_for_mode, "the index has the Deployment-mode model")
    assert answer["allowed"] is False


async def test_a_model_the_index_lacks_is_read_from_the_api_before_a_pod_is_refused(env):
    """A replica that has not listed the InferenceModels yet (starting, or standing by for the leader)
    answers the webhook's Service too: with an empty index it reads the model instead of refusing the pod."""
    cluster, _, server, _ = env
    assert (await cluster.create(copy.deepcopy(MODEL)))[0] == 201
    await cluster.wait(lambda: _condition(cluster, "Ready", "True"), "the Sidecar model is Ready")
    kube = Kube(kopf.ConnectionInfo(server=str(server.url).rstrip("/"), insecure=True))
    try:
        injector = webhook.Injector(Settings(), kube)
        injector.native = True
        pod = app_pod()
        pod["metadata"]["namespace"] = NAMESPACE  # as InjectorServer puts it (from the admission request)
        ops = await injector.review(pod, {})  # an empty index
        assert any(op["path"].startswith("/spec/initContainers") for op in ops)
        missing = copy.deepcopy(pod)
        missing["metadata"]["annotations"]["sluice.dev/inject"] = "nope"
        with pytest.raises(webhook.sidecar.Denied, match="InferenceModel 'nope' does not exist"):
            await injector.review(missing, {})
    finally:
        await kube.aclose()


async def test_a_model_whose_config_is_not_rendered_is_not_injected_until_it_is(env):
    """An injected pod mounts the model's ConfigMap: while the operator cannot write it (here the API
    refuses ConfigMaps, as missing RBAC would) the pod is denied naming the model's condition, instead
    of being created with a mount that keeps it in ContainerCreating; once it is written the same pod is
    injected. A changed spec is injected again only once its generation is rendered."""
    cluster, webhooks, server, _ = env
    server.reject_writes("v1/configmaps", 403, 'configmaps is forbidden: User "x" cannot create')
    assert (await cluster.create(copy.deepcopy(MODEL)))[0] == 201
    degraded = await cluster.wait(lambda: _condition(cluster, "Degraded", "True"), "the model is Degraded")
    assert degraded["reason"] == "Forbidden"
    not_ready = await _condition(cluster, "Ready", "False")
    assert not_ready is not None and not_ready["reason"] == "Forbidden", not_ready  # not "DeploymentMissing"

    async def denied_for_config() -> dict[str, Any] | None:
        answer = await webhooks.review(app_pod())
        return answer if "is not rendered" in answer.get("status", {}).get("message", "") else None

    answer = await cluster.wait(denied_for_config, "the pod is denied for the unrendered config")
    assert answer["allowed"] is False and answer["status"]["code"] == 403
    message = answer["status"]["message"]
    assert "InferenceModel 'mnist' cannot be injected: its config (ConfigMap 'mnist-config') is not rendered" in message
    assert "configmaps is forbidden" in message
    assert await cluster.get("ConfigMap", "mnist-config") is None
    server.allow_writes("v1/configmaps")
    status, _ = await cluster.call("PATCH", path("InferenceModel", NAMESPACE, "mnist"),
                                   {"metadata": {"labels": {"retry": "1"}}}, "application/merge-patch+json")
    assert status == 200  # any change retries (as kubectl label would)
    await cluster.wait(lambda: _condition(cluster, "Ready", "True"), "the Sidecar model is Ready")
    assert await cluster.get("ConfigMap", "mnist-config") is not None

    async def injected() -> dict[str, Any] | None:
        answer = await webhooks.review(app_pod())
        return answer if answer["allowed"] and "patch" in answer else None

    await cluster.wait(injected, "the same pod is injected once the config is rendered")


async def test_pods_not_asking_or_opting_out_are_left_alone(env):
    _, webhooks, _, _ = env
    for value in (None, "false"):
        pod = app_pod()
        if value is None:
            del pod["metadata"]["annotations"]
        else:
            pod["metadata"]["annotations"]["sluice.dev/inject"] = value
        response = await webhooks.review(pod)
        assert response["allowed"] is True and "patch" not in response


async def test_the_secret_is_reused_across_restarts(env, tmp_path):
    cluster, webhooks, server, _ = env
    first = await webhooks.ca_bundle()
    secret = server.read("v1/secrets", SYSTEM, "sluice-webhook-tls")
    assert secret is not None
    assert base64.b64decode(secret["data"][certificates.CA_CERT]) == first
    # A second replica (or a restart) with its own empty cert directory serves the same CA.
    info = kopf.ConnectionInfo(server=str(server.url).rstrip("/"), insecure=True)
    port = _free_port()
    settings = Settings(resync_seconds=3600, webhook=Webhook(port=port, cert_dir=str(tmp_path / "other"),
                                                             namespace=SYSTEM))
    async with OperatorHarness(settings=settings, connection=info):
        other = Webhooks(cluster, port)

        async def answered() -> dict[str, Any] | None:
            try:
                return await other.review(app_pod(), namespace="elsewhere")
            except aiohttp.ClientConnectorError:
                return None  # not listening yet

        response = await cluster.wait(answered, "the second replica serves the webhook")
    assert response["allowed"] is False  # no model there: but it answered over TLS trusted by the same CA
    assert server.read("v1/secrets", SYSTEM, "sluice-webhook-tls")["data"] == secret["data"]


async def _condition(cluster: Cluster, type_: str, status: str) -> dict[str, Any] | None:
    found = cluster.condition(await cluster.get("InferenceModel", "mnist"), type_)
    return found if found.get("status") == status else None
