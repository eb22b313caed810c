"""Install artefacts: CRDs, Helm chart, generated manifests, examples - all checked against real schemas.

Tests that need the helm binary (``.tools/bin/helm`` from ``.ci/tools.sh``, or ``$HELM``) skip with a
reason when it is missing.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jsonschema
import pytest
import yaml

from sluice.operator import api, builders, crd
from sluice.operator.settings import Settings
from sluice_testing import adapter, schemas
from sluice_testing.apiserver import _strip_extensions, _structural

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "sluice"
K8S_VERSION = "1.30.0"


def helm() -> str:
    candidate = os.environ.get("HELM") or str(ROOT / ".tools" / "bin" / "helm")
    if os.access(candidate, os.X_OK):
        return candidate
    found = shutil.which("helm")
    if found is None:
        pytest.skip("no helm binary: run `bash .ci/tools.sh` (fetches .tools/bin/helm) or set $HELM")
    return found


def template(*args: str) -> list[dict]:
    result = subprocess.run([helm(), "template", "sluice", str(CHART), "--namespace", "sluice-system", *args],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def template_error(*args: str) -> str:
    result = subprocess.run([helm(), "template", "sluice", str(CHART), *args], capture_output=True, text=True)
    assert result.returncode != 0, "helm template should have failed"
    return result.stderr


def validate(docs: list[dict]) -> None:
    """Kubernetes' kinds against its schemas; prometheus-operator's against their published ones."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for doc in docs:
        if doc["apiVersion"].startswith("kopf.dev"):
            continue  # kopf's peering objects: no published schema
        if doc["apiVersion"].startswith("monitoring.coreos.com"):
            assert schemas.validate(doc) == [], doc["kind"]
            continue
        if doc["apiVersion"].startswith("cert-manager.io"):
            continue  # no published schema installed: test_webhook_with_cert_manager checks their fields
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


# ---------------------------------------------------------------- CRDs

def walk(schema: dict, path: str = ""):
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from walk(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{path}[]")


@pytest.mark.parametrize("definition", crd.all_crds(), ids=lambda d: d["spec"]["names"]["kind"])
def test_crd_schema_is_complete(definition):
    [version] = definition["spec"]["versions"]
    schema = version["schema"]["openAPIV3Schema"]
    undocumented = [p for p, s in walk(schema["properties"]["spec"], "spec") if not s.get("description")]
    assert undocumented == []
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.scaling.minReplicas"
    kind = definition["spec"]["names"]["kind"]
    model = kind == "InferenceModel"
    columns = ["Ready", "Replicas", "Traffic", *(["Canary"] if model else []), "URL", *(["GPU"] if model else []),
               "Age"]
    if kind == "ModelPool":
        columns = ["Ready", "Members", "Free", "Replicas", "Age"]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == columns
    assert definition["spec"]["names"]["shortNames"]
    rules = [r["rule"] for _, s in walk(schema) for r in s.get("x-kubernetes-validations", [])]
    assert rules, "cross-field rules are CEL x-kubernetes-validations"
    validate([definition])


def test_inference_model_cel_rules_cover_the_issue_examples():
    schema = crd.inference_model_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    scaling = schema["properties"]["scaling"]["x-kubernetes-validations"][0]
    gpu = schema["properties"]["resources"]["properties"]["gpu"]["x-kubernetes-validations"][0]
    assert scaling["rule"] == "self.minReplicas <= self.maxReplicas"
    assert "size() == 1" in gpu["rule"]


# ---------------------------------------------------------------- examples

EXAMPLES = sorted((ROOT / "examples" / "k8s").glob("*.yaml"))
SCHEMAS = {d["spec"]["names"]["kind"]: d["spec"]["versions"][0]["schema"]["openAPIV3Schema"] for d in crd.all_crds()}


def unknown_fields(schema: dict, value: object, path: str = ""):
    """Paths in ``value`` the API server would prune (unknown to a structural schema)."""
    if isinstance(value, dict) and "properties" in schema:
        for key, item in value.items():
            if key in schema["properties"]:
                yield from unknown_fields(schema["properties"][key], item, f"{path}.{key}")
            elif not isinstance(schema.get("additionalProperties"), dict):
                yield f"{path}.{key}"
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            yield from unknown_fields(schema["items"], item, f"{path}[{index}]")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_pass_the_crd_schema_and_the_operator_checks(path):
    for doc in yaml.safe_load_all(path.read_text()):
        schema = SCHEMAS[doc["kind"]]
        assert list(unknown_fields(schema, doc)) == []
        pruned = _structural(schema, copy.deepcopy(doc))  # what the API server stores: pruned and defaulted
        jsonschema.Draft7Validator(_strip_extensions(schema)).validate(pruned)
        parse = {"InferenceModel": api.parse_inference_model, "Ensemble": api.parse_ensemble,
                 "ModelPool": api.parse_model_pool}[doc["kind"]]
        parse(doc["metadata"]["name"], pruned["spec"])  # the CEL-equivalent rules
        model = pruned["spec"].get("model", {})
        if "config" in model:  # an inline config is the runtime's to read: it must parse there
            from sluice.runtime.config import parse_config

            parse_config(model["config"], path=f"{path.name}: spec.model.config", fmt=model["configFormat"])


def test_scaling_defaults_of_the_crd_are_the_operators():
    stored = _structural(SCHEMAS["InferenceModel"], {"spec": {
        "model": {"storageUri": "s3://b/m", "format": "onnx"}, "scaling": {"minReplicas": 1, "maxReplicas": 3}}})
    assert stored["spec"]["scaling"] == {
        "minReplicas": 1, "maxReplicas": 3, "metric": "queueDepth", "targetQueueDepth": 8, "targetInflight": 8,
        "targetQueueWaitMilliseconds": 50, "engine": "hpa", "scaleUpStabilizationSeconds": 0,
        "scaleDownStabilizationSeconds": 300,
    }
    assert api.parse_inference_model("m", stored["spec"]).scaling == api.Scaling(max_replicas=3)
    scaling = SCHEMAS["InferenceModel"]["properties"]["spec"]["properties"]["scaling"]
    assert scaling["properties"]["metric"]["enum"] == list(api.SCALING_METRICS)
    assert scaling["properties"]["engine"]["enum"] == list(api.SCALING_ENGINES)
    rules = [r["rule"] for r in scaling["x-kubernetes-validations"]]
    assert any("self.fallbackReplicas <= self.maxReplicas" in r for r in rules)


@pytest.mark.parametrize("value", ["auto", 0, 8, 64, 65, -1, "4", "Auto", "", True, 2.5, None])
def test_the_crd_and_the_operator_agree_on_protocol_workers(value):
    # An API server enforces the schema (int-or-string, with minimum/maximum for the integer and a
    # pattern for the string); the operator re-checks it for servers that do not: both must agree.
    try:
        api.parse_inference_model("m", {"model": {"storageUri": "s3://b/m", "format": "onnx"},
                                        "server": {"protocolWorkers": value}})
        operator_accepts = True
    except api.SpecError:
        operator_accepts = False
    assert operator_accepts == (value is None or value == "auto" or (type(value) is int and 0 <= value <= 64))
    for kind in ("InferenceModel", "ModelPool", "Ensemble"):
        server = SCHEMAS[kind]["properties"]["spec"]["properties"]["server"]
        assert server["properties"]["protocolWorkers"]["x-kubernetes-int-or-string"] is True
        document = {} if value is None else {"protocolWorkers": value}
        assert jsonschema.Draft7Validator(_strip_extensions(server)).is_valid(document) == operator_accepts, kind


def test_examples_cover_every_kind():
    kinds = {doc["kind"] for path in EXAMPLES for doc in yaml.safe_load_all(path.read_text())}
    assert kinds == {"InferenceModel", "Ensemble", "ModelPool"}


# ---------------------------------------------------------------- generated files

def test_generated_files_have_not_drifted():
    """crds/, the chart's CRD templates and manifests/base must be regenerated after a change."""
    env = {**os.environ}
    try:
        env["HELM"] = helm()
    except pytest.skip.Exception:
        env.pop("HELM", None)
    result = subprocess.run([sys.executable, str(ROOT / "manifests" / "generate.py"), "--check"],
                            capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr


def test_manifests_base_is_the_default_chart_and_validates():
    helm()
    docs = [d for d in yaml.safe_load_all((ROOT / "manifests" / "base" / "sluice.yaml").read_text()) if d]
    validate(docs)
    assert {d["kind"] for d in docs} >= {"Namespace", "CustomResourceDefinition", "Deployment", "ServiceAccount"}


def test_example_overlay_patches_the_watch_namespace():
    base = yaml.safe_load_all((ROOT / "manifests" / "base" / "sluice.yaml").read_text())
    [deployment] = [d for d in base if d and d["kind"] == "Deployment"]
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    assert env[0]["name"] == "SLUICE_WATCH_NAMESPACES"  # the overlay's JSON patch replaces env/0
    overlay = yaml.safe_load((ROOT / "manifests" / "overlays" / "example" / "kustomization.yaml").read_text())
    assert overlay["patches"][0]["target"] == {"kind": "Deployment", "name": deployment["metadata"]["name"]}
    for resource in overlay["resources"]:
        assert (ROOT / "manifests" / "overlays" / "example" / resource).exists()


# ---------------------------------------------------------------- Helm chart

def test_helm_lint_is_clean():
    result = subprocess.run([helm(), "lint", "--strict", str(CHART)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("values", [
    [],
    ["--set", "watchNamespaces={models,research}", "--set", "leaderElection.enabled=true",
     "--set", "replicaCount=2", "--set", "metrics.serviceMonitor.enabled=true", "--set", "debug=true"],
    ["--set", "crds.enabled=false", "--set", "metrics.enabled=false", "--set", "serviceAccount.create=false"],
    ["--set", "autoscaling.podMonitor.enabled=true", "--set", "autoscaling.prometheusAdapter.rules.enabled=true",
     "--set", "prometheus.url=http://prometheus-operated.monitoring.svc:9090"],
    ["--set", "webhook.enabled=true"],
    ["--set", "webhook.enabled=true", "--set", "webhook.certManager.enabled=true",
     "--set", "webhook.failurePolicy=Ignore",
     "--set-string", "webhook.objectSelector.matchLabels.sluice\\.dev/sidecar=true"],
    ["--set", "grafana.dashboard.enabled=true", "--set-string", "grafana.dashboard.annotations.grafana_folder=Sluice"],
], ids=["defaults", "namespaced-ha", "minimal", "autoscaling", "webhook", "webhook-cert-manager", "grafana"])
def test_helm_template_renders_valid_manifests(values):
    validate(template(*values))


def test_crds_toggle_and_keep():
    kept = [d for d in template() if d["kind"] == "CustomResourceDefinition"]
    assert {d["metadata"]["name"] for d in kept} == {"inferencemodels.sluice.dev", "ensembles.sluice.dev",
                                                     "modelpools.sluice.dev"}
    assert all(d["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep" for d in kept)
    dropped = [d for d in template("--set", "crds.keep=false") if d["kind"] == "CustomResourceDefinition"]
    assert all("annotations" not in d["metadata"] for d in dropped)
    assert not [d for d in template("--set", "crds.enabled=false") if d["kind"] == "CustomResourceDefinition"]
    peering = [d["metadata"]["name"] for d in template("--set", "leaderElection.enabled=true")
               if d["kind"] == "CustomResourceDefinition"]
    assert "kopfpeerings.kopf.dev" in peering


@pytest.mark.parametrize("values", [[], ["--set", "watchNamespaces={models,research}"]], ids=["cluster", "namespaced"])
def test_leader_election_peering_objects_are_the_operators_not_the_charts(values):
    """The chart renders no peering object (a Helm hook would be deleted and recreated, empty, on every
    upgrade, letting a paused replica resume next to the leader); the operator creates a missing one at
    start-up, so its ServiceAccount may get and create them where it watches, and kopf list/watch/patch."""
    from sluice.operator import handlers
    docs = template("--set", "leaderElection.enabled=true", "--set", "replicaCount=2", *values)
    assert not [d["kind"] for d in docs if d["apiVersion"].startswith("kopf.dev")]
    assert not [d["kind"] for d in docs if "helm.sh/hook" in (d["metadata"].get("annotations") or {})]
    settings = Settings.from_env(_operator_env("--set", "leaderElection.enabled=true", *values))
    assert settings.peering_name == "sluice"
    objects = handlers.peering_objects(settings.peering_name, settings.namespaces)
    assert objects, "the operator ensures at least one peering object"
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterRole"}
    for obj in objects:
        plural = f"{obj['kind'].lower()}s"
        namespace = obj["metadata"].get("namespace")
        # the ClusterRoles bound where this object lives: cluster-wide, or by a RoleBinding in its namespace
        bound = [d["roleRef"]["name"] for d in docs
                 if d["kind"] == "ClusterRoleBinding" or (d["kind"] == "RoleBinding"
                                                          and d["metadata"]["namespace"] == namespace)]
        verbs = {v for name in bound if name in roles for r in roles[name]["rules"]
                 if "kopf.dev" in r["apiGroups"] and plural in r["resources"] for v in r["verbs"]}
        assert {"get", "create", "list", "watch", "patch"} <= verbs, (obj["kind"], namespace, sorted(verbs))
        assert "delete" not in verbs and "update" not in verbs
    assert {o["metadata"].get("namespace") for o in objects} == ({"models", "research"} if values else {None})


def test_namespaced_install_binds_roles_only_in_watched_namespaces():
    docs = template("--set", "watchNamespaces={models}")
    bindings = [d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    reconcile = [b for b in bindings if b["roleRef"]["name"].endswith("-reconcile")]
    assert [(b["kind"], b["metadata"].get("namespace")) for b in reconcile] == [("RoleBinding", "models")]
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    env = {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["SLUICE_WATCH_NAMESPACES"] == "models"


def test_rbac_is_least_privilege():
    rules = [r for d in template() if d["kind"] == "ClusterRole" for r in d["rules"]]
    assert rules
    for rule in rules:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
        assert "secrets" not in rule["resources"], "the operator references Secrets by name, never reads them"
        assert "update" not in rule["verbs"], "server-side apply and merge patches need patch, not update"


def test_canary_values_reach_the_operator_and_its_settings_accept_them():
    env = _operator_env("--set", "canary.router=istio", "--set", "canary.gateway=infra/public")
    assert (env["SLUICE_ROUTER"], env["SLUICE_GATEWAY"]) == ("istio", "infra/public")
    settings = Settings.from_env(_operator_env())  # the chart's defaults are settings the operator takes
    assert (settings.router, settings.gateway, settings.prometheus_url) == ("auto", "", None)


def test_rbac_covers_every_kind_the_operator_writes():
    from sluice.operator.kube import RESOURCES
    rules = [r for d in template() if d["kind"] == "ClusterRole" for r in d["rules"]]
    for kind, (api_version, plural) in RESOURCES.items():
        group = api_version.rpartition("/")[0]
        verbs = {v for r in rules if group in r["apiGroups"] and plural in r["resources"] for v in r["verbs"]}
        if kind in ("Secret", "MutatingWebhookConfiguration"):
            continue  # the webhook's, by name only: test_webhook_rbac_is_by_name
        if group == "kopf.dev":
            continue  # with leaderElection.enabled only: test_leader_election_peering_objects_are_the_operators_...
        wanted = {"get", "list"} if kind in ("Pod", "Node", "ResourceSlice", "ResourceClaim") else \
            {"get", "patch"} if group == "sluice.dev" else {"get", "create", "patch", "delete"}
        assert wanted <= verbs, f"{kind} ({group}/{plural}): the chart grants {sorted(verbs)}"


@pytest.mark.parametrize(("args", "message"), [
    (["--set", "autoscaling.podMonitor.enabeld=true"], "additional properties 'enabeld' not allowed"),
    (["--set", "prometheus.url=prometheus:9090"], "/prometheus/url"),
    (["--set", "autoscaling.prometheusAdapter.rules.podLabel=pod-name"],
     "/autoscaling/prometheusAdapter/rules/podLabel"),
    (["--set", "autoscaling.prometheusAdapter.rules.enabled=true",
      "--set", "autoscaling.prometheusAdapter.rules.podLabel=namespace"],
     "namespaceLabel and podLabel must be different labels"),
    (["--set", "canary.router=linkerd"],
     "/canary/router': value must be one of 'auto', 'gateway-api', 'istio', 'none'"),
    (["--set", "canary.gateway=infra/"], "/canary/gateway': 'infra/' does not match pattern"),
    (["--set", "replicsCount=2"], "additional properties 'replicsCount' not allowed"),
    (["--set", "image.pullPolicy=Sometimes"], "pullPolicy"),
    (["--set", "replicaCount=2"], "replicaCount > 1 needs leaderElection.enabled=true"),
    (["--set", "webhook.failurePolicy=Sometimes"], "/webhook/failurePolicy': value must be one of 'Fail', 'Ignore'"),
    (["--set", "webhook.timeoutSeconds=31"], "/webhook/timeoutSeconds"),
    (["--set", "webhook.nativeSidecars=maybe"], "/webhook/nativeSidecars"),
    (["--set", "grafana.dashboard.enabeld=true"], "additional properties 'enabeld' not allowed"),
    (["--set", "grafana.dashboard.label=grafana dashboard"], "/grafana/dashboard/label"),
    (["--set", "runtime.protocolWorkers=65"], "/runtime/protocolWorkers"),
    (["--set", "runtime.protocolWorkers=many"], "/runtime/protocolWorkers"),
])
def test_bad_values_fail_the_install(args, message):
    assert message in template_error(*args)


def test_every_values_key_is_documented():
    """Each leaf key has a comment line above it; mappings are documented through their keys.

    ``resources`` is documented as a whole: its children are a Kubernetes ResourceRequirements example.
    """
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    free_form_indent: int | None = None
    for index, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z]\w*):(.*)$", line)
        if not match:
            continue
        indent, key, value = len(match.group(1)), match.group(2), match.group(3)
        if free_form_indent is not None and indent > free_form_indent:
            continue
        free_form_indent = indent if key == "resources" else None
        following = next((n for n in lines[index + 1:] if n.strip() and not n.strip().startswith("#")), "")
        nested = not value.strip() and len(following) - len(following.lstrip()) > indent
        if (not nested or key == "resources") and not lines[index - 1].strip().startswith("#"):
            undocumented.append(key)
    assert undocumented == []


def test_values_schema_forbids_unknown_keys_everywhere():
    schema = yaml.safe_load((CHART / "values.schema.json").read_text())

    def objects(node, path="values"):
        if isinstance(node, dict) and node.get("type") == "object" and "properties" in node:
            yield path, node
            for key, sub in node["properties"].items():
                yield from objects(sub, f"{path}.{key}")

    assert all(node.get("additionalProperties") is False for _, node in objects(schema))
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate(values)


# ---------------------------------------------------------------- autoscaling values

PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"
RUNTIME_POD_LABELS = builders.common_labels(builders.Owner("InferenceModel", "resnet", "models", "uid"))


def _rendered(kind: str, *args: str) -> list[dict]:
    return [d for d in template(*args) if d["kind"] == kind]


def _rules_config_map(*args: str) -> dict:
    [config_map] = [d for d in _rendered("ConfigMap", "--set", "autoscaling.prometheusAdapter.rules.enabled=true",
                                         *args) if d["metadata"]["name"].endswith("-prometheus-adapter-rules")]
    return config_map


def _adapter_rules(*args: str) -> list[dict]:
    config_map = _rules_config_map(*args)
    rules = yaml.safe_load(config_map["data"]["config.yaml"])["rules"]
    assert yaml.safe_load(config_map["data"]["values.yaml"]) == {"rules": {"default": False, "custom": rules}}
    return rules


def _operator_env(*args: str) -> dict[str, str]:
    [deployment] = _rendered("Deployment", *args)
    return {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


@pytest.mark.parametrize(("args", "expected"), [
    ((), None), (("--set", "runtime.protocolWorkers=auto"), "auto"), (("--set", "runtime.protocolWorkers=8"), 8),
])
def test_the_protocol_workers_value_reaches_the_operator_settings(args, expected):
    env = _operator_env(*args)
    assert Settings.from_env(env).default_protocol_workers == expected


def test_autoscaling_objects_are_off_by_default():
    docs = template()
    assert not [d for d in docs if d["kind"] == "PodMonitor"]
    assert not [d for d in docs if d["metadata"]["name"].endswith("-prometheus-adapter-rules")]
    assert _operator_env()["SLUICE_PROMETHEUS_URL"] == ""


def test_prometheus_url_reaches_the_operator_settings():
    env = _operator_env("--set", f"prometheus.url={PROMETHEUS}")
    assert Settings.from_env(env).prometheus_url == PROMETHEUS
    assert Settings.from_env(_operator_env()).prometheus_url is None


def test_pod_monitor_scrapes_the_runtime_pods_and_labels_series_with_the_model():
    [monitor] = _rendered("PodMonitor", "--set", "autoscaling.podMonitor.enabled=true")
    spec = monitor["spec"]
    assert spec["selector"]["matchLabels"].items() <= RUNTIME_POD_LABELS.items()
    assert spec["selector"]["matchLabels"]["app.kubernetes.io/name"] == "sluice-runtime"
    [endpoint] = spec["podMetricsEndpoints"]
    assert endpoint == {"port": "metrics", "path": "/metrics", "interval": "15s"}
    assert {"app.kubernetes.io/instance", "sluice.dev/inferencemodel", "sluice.dev/ensemble",
            "sluice.dev/modelpool"} <= set(spec["podTargetLabels"])
    # the label the operator's KEDA queries filter on is what podTargetLabels makes of the pod label
    assert builders.PROMETHEUS_LABELS["instance"] == "app.kubernetes.io/instance".replace(".", "_").replace("/", "_")
    assert spec["namespaceSelector"] == {"any": True}
    assert monitor["metadata"]["namespace"] == "sluice-system"
    assert schemas.validate(monitor) == []


def test_pod_monitor_follows_the_watched_namespaces_and_its_values():
    [monitor] = _rendered(
        "PodMonitor", "--set", "autoscaling.podMonitor.enabled=true", "--set", "watchNamespaces={models,research}",
        "--set", "autoscaling.podMonitor.interval=30s", "--set", "autoscaling.podMonitor.namespace=monitoring",
        "--set", "autoscaling.podMonitor.labels.release=kube-prometheus-stack",
    )
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["models", "research"]}
    assert monitor["spec"]["podMetricsEndpoints"][0]["interval"] == "30s"
    assert monitor["metadata"]["namespace"] == "monitoring"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert schemas.validate(monitor) == []


def test_the_runtime_pod_serves_metrics_on_the_port_the_pod_monitor_names():
    spec = api.parse_inference_model("resnet", {"model": {"storageUri": "s3://b/m", "format": "onnx"}})
    owner = builders.Owner("InferenceModel", "resnet", "models", "uid")
    [deployment] = [o for o in builders.inference_model(owner, spec, Settings()).objects if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]
    assert pod["metadata"]["labels"].items() >= RUNTIME_POD_LABELS.items()
    assert "metrics" in {p["name"] for p in pod["spec"]["containers"][0]["ports"]}


def test_adapter_rules_serve_every_metric_the_hpa_asks_for():
    rules = _adapter_rules()
    served = {rule["name"]["as"] for rule in rules}
    assert served == set(builders.HPA_METRICS.values())
    for rule in rules:
        assert rule["resources"] == {"overrides": {"namespace": {"resource": "namespace"},
                                                   "pod": {"resource": "pod"}}}


def test_adapter_rules_namespace_and_label_overrides():
    args = ["--set", "autoscaling.prometheusAdapter.rules.namespaceLabel=kubernetes_namespace",
            "--set", "autoscaling.prometheusAdapter.rules.podLabel=kubernetes_pod_name",
            "--set", "autoscaling.prometheusAdapter.rules.namespace=monitoring"]
    for rule in _adapter_rules(*args):
        assert rule["resources"] == {"overrides": {"kubernetes_namespace": {"resource": "namespace"},
                                                   "kubernetes_pod_name": {"resource": "pod"}}}
        assert rule["seriesQuery"].endswith('{kubernetes_namespace!="",kubernetes_pod_name!=""}')
    assert _rules_config_map(*args)["metadata"]["namespace"] == "monitoring"


# Series as Prometheus lists them once the PodMonitor scrapes two runtime pods of model resnet, plus
# some that must not become metrics.
def _series(namespace_label: str, pod_label: str) -> list[adapter.Series]:
    def pod(name: str, pod_name: str, **extra: str) -> adapter.Series:
        return adapter.Series(name, {namespace_label: "models", pod_label: pod_name, "model": "resnet",
                                     "version": "1", "app_kubernetes_io_instance": "resnet", **extra})

    return [
        *(pod(metric, p) for metric in ("sluice_queue_depth", "sluice_inflight_requests",
                                        "sluice_queue_duration_seconds_count", "sluice_queue_duration_seconds_sum")
          for p in ("resnet-a", "resnet-b")),
        *(pod("sluice_queue_duration_seconds_bucket", p, le=le) for p in ("resnet-a", "resnet-b")
          for le in ("0.05", "0.1", "+Inf")),
        adapter.Series("sluice_queue_depth", {"instance": "10.0.0.1:8002"}),  # scraped without pod labels
        adapter.Series("up", {namespace_label: "models", pod_label: "resnet-a"}),
    ]


LATENCY = ("(histogram_quantile(0.9, sum by (le, {pod}) (rate(sluice_queue_duration_seconds_bucket{{{m}}}[1m]))) "
           ">= 0) or (0 * sum by ({pod}) (rate(sluice_queue_duration_seconds_count{{{m}}}[1m])))")


@pytest.mark.parametrize(("namespace_label", "pod_label"), [("namespace", "pod"),
                                                            ("kubernetes_namespace", "kubernetes_pod_name")])
def test_adapter_rules_against_sample_series_give_the_promql_the_hpa_gets(namespace_label, pod_label):
    """What prometheus-adapter makes of the rendered rules: which series become which metric, and the
    query it runs when the HPA asks for the metric on two pods (sluice_testing.adapter follows its code)."""
    rules = _adapter_rules("--set", f"autoscaling.prometheusAdapter.rules.namespaceLabel={namespace_label}",
                           "--set", f"autoscaling.prometheusAdapter.rules.podLabel={pod_label}")
    series = _series(namespace_label, pod_label)
    discovered = {}
    for rule in rules:
        discovered.update(adapter.metrics(rule, series))
    assert discovered == {"sluice_queue_depth": "sluice_queue_depth",
                          "sluice_inflight_requests": "sluice_inflight_requests",
                          "sluice_queue_duration_seconds_p90": "sluice_queue_duration_seconds_bucket"}
    assert not adapter.metrics(rules[0], _series("kubernetes_namespace", "kubernetes_pod_name")
                               if namespace_label == "namespace" else _series("namespace", "pod"))
    two = f'{namespace_label}="models",{pod_label}=~"resnet-a|resnet-b"'
    by_metric = {rule["name"]["as"]: rule for rule in rules}
    queries = {metric: adapter.expand_rule(rule, metric, "models", ["resnet-a", "resnet-b"])
               for metric, rule in by_metric.items()}
    assert queries == {
        "sluice_queue_depth": f"sum by ({pod_label}) (sluice_queue_depth{{{two}}})",
        "sluice_inflight_requests": f"max by ({pod_label}) (sluice_inflight_requests{{{two}}})",
        "sluice_queue_duration_seconds_p90": LATENCY.format(pod=pod_label, m=two),
    }
    one = adapter.expand_rule(by_metric["sluice_queue_depth"], "sluice_queue_depth", "models", ["resnet-a"])
    assert one == f'sum by ({pod_label}) (sluice_queue_depth{{{namespace_label}="models",{pod_label}="resnet-a"}})'


def test_adapter_discovery_follows_series_filters_name_captures_and_resource_labels():
    """sluice_testing.adapter on a rule shaped like prometheus-adapter's documented examples."""
    rule = {"seriesQuery": '{__name__=~"^sluice_.*_total$",namespace!="",pod!=""}',
            "seriesFilters": [{"isNot": "^sluice_rejected_total$"}], "resources": {"template": "<<.Resource>>"},
            "name": {"matches": "^sluice_(.*)_total$", "as": "${1}_per_second"},
            "metricsQuery": "sum(rate(<<.Series>>{<<.LabelMatchers>>}[2m])) by (<<.GroupBy>>)"}
    labels = {"namespace": "models", "pod": "a"}
    series = [adapter.Series("sluice_request_success_total", labels), adapter.Series("sluice_rejected_total", labels),
              adapter.Series("sluice_queue_depth", labels),
              adapter.Series("sluice_request_failure_total", {"pod": "a"})]  # no namespace: not served
    assert adapter.metrics(rule, series) == {"request_success_per_second": "sluice_request_success_total"}
    assert adapter.expand_rule(rule, "request_success_per_second", "models", ["a", "b"],
                               series="sluice_request_success_total") == (
        'sum(rate(sluice_request_success_total{namespace="models",pod=~"a|b"}[2m])) by (pod)')
    assert adapter.selector_matches('x{a="1",b!~"2|3"}', adapter.Series("x", {"a": "1", "b": "4"}))
    assert not adapter.selector_matches('x{a="1",b!~"2|3"}', adapter.Series("x", {"a": "1", "b": "3"}))


def test_adapter_expansion_refuses_what_it_does_not_model():
    [rule, *_] = _adapter_rules()
    with pytest.raises(ValueError, match="does not serve 'sluice_inflight_requests'"):
        adapter.expand_rule(rule, "sluice_inflight_requests", "models", ["a"])
    with pytest.raises(ValueError, match=r"<<\.Namespace>> is not supported"):
        adapter.expand_rule({**rule, "metricsQuery": "<<.Namespace>>"}, "sluice_queue_depth", "models", ["a"])


# Distributions only the `test` extra installs: no shipped module may import them (the images lack them).
TEST_ONLY_IMPORTS = {
    "kmock", "jsonschema", "pytest", "hypothesis", "onnx", "h2", "kubernetes_validate", "sluice_testing",
}


def _shipped_modules() -> dict[str, pathlib.Path]:
    """Every module the wheel (and so each image) installs, per pyproject's package list."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    modules: dict[str, pathlib.Path] = {}
    for package in setup["packages"]:
        root = next(p for p in sorted(setup["package-dir"], key=len, reverse=True)
                    if package == p or package.startswith(p + "."))
        directory = ROOT / setup["package-dir"][root] / package[len(root):].lstrip(".").replace(".", "/")
        for source in directory.glob("*.py"):
            modules[f"{package}.{source.stem}"] = source
    return modules


def test_shipped_packages_import_nothing_from_the_test_extra():
    import ast

    modules = _shipped_modules()
    assert "sluice.operator.handlers" in modules and "sluice.runtime.server" in modules
    offenders = []
    for name, source in sorted(modules.items()):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported = [node.module]
            else:
                continue
            offenders += [f"{name} imports {m}" for m in imported if m.split(".")[0] in TEST_ONLY_IMPORTS]
    assert not offenders, "test support belongs in tests/support, not in a shipped package: " + "; ".join(offenders)


def test_the_readme_helm_install_uses_the_images_it_tells_you_to_build():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## On Kubernetes (Helm)"):]
    section = section[:section.index("\n## ", 1)]
    assert "not published yet" in section
    registry = "registry.test/sluice"
    text = section.replace("\\\n", " ").replace("$REGISTRY", registry)
    built = set(re.findall(r"docker build [^\n]*-t (\S+)", text))
    install = next(line for line in text.splitlines() if line.startswith("helm install"))
    values = re.findall(r"--set (\S+)", install)
    docs = template(*[arg for value in values for arg in ("--set", value)])
    images = {c["image"] for d in docs if d["kind"] == "Deployment"
              for c in d["spec"]["template"]["spec"]["containers"]}
    images |= {e["value"] for d in docs if d["kind"] == "Deployment"
               for c in d["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])
               if e["name"] in ("SLUICE_RUNTIME_IMAGE", "SLUICE_RUNTIME_GPU_IMAGE")}
    assert images == built, f"the chart would run {images}, the README builds {built}"


@pytest.mark.parametrize("release", ["a" * 53, "sluice-" + "b" * 46, "x"])
def test_object_names_stay_valid_for_any_release_name(release):
    """Helm allows release names of 53 characters: every Service must still be a DNS label of at most 63
    (with '-metrics' and '-webhook' appended to a 60-character fullname they were 68), every other name
    a DNS subdomain, and the operator, the webhook configuration and the certificate name the webhook
    Service as the chart made it."""
    args = ["--set", "webhook.enabled=true", "--set", "webhook.certManager.enabled=true",
            "--set", "metrics.serviceMonitor.enabled=true"]
    result = subprocess.run([helm(), "template", release, str(CHART), "--namespace", "sluice-system", *args],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    assert len(services) == 2, services
    for name in services:
        assert re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", name), name
    for doc in docs:
        name = doc["metadata"]["name"]
        assert len(name) <= 253 and re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name), (doc["kind"], name)
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    [configuration] = [d for d in docs if d["kind"] == "MutatingWebhookConfiguration"]
    [certificate] = [d for d in docs if d["kind"] == "Certificate"]
    webhook_service = configuration["webhooks"][0]["clientConfig"]["service"]["name"]
    assert webhook_service in services and env["SLUICE_WEBHOOK_SERVICE"] == webhook_service
    assert f"{webhook_service}.sluice-system.svc" in certificate["spec"]["dnsNames"]


def test_a_priority_class_name_is_always_a_string():
    [deployment] = _rendered("Deployment", "--set-string", "priorityClassName=1000")
    assert deployment["spec"]["template"]["spec"]["priorityClassName"] == "1000"  # unquoted it was the int 1000


def test_the_chart_values_docs_and_messages_name_exist():
    """Where the CRDs, the operator's messages or the docs name one of this chart's values ("the chart's
    prometheus.url"), the chart has it (they named an autoscaling.prometheusUrl it never had)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    texts = {p: p.read_text() for p in [*(ROOT / "operator").glob("*.py"), *(ROOT / "docs").glob("*.md")]}
    named = {(path.relative_to(ROOT).as_posix(), key) for path, text in texts.items()
             for key in re.findall(r"(?:chart's|chart value) `?([a-zA-Z]+(?:\.[a-zA-Z]+)+)", text)}
    assert named, "the pattern no longer finds any reference"

    def exists(key: str) -> bool:
        node: object = values
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    removed = {"runtime.storageInitializerImage"}  # named in the upgrade notes as gone
    assert not any(exists(key) for key in removed)
    assert [(path, key) for path, key in sorted(named) if not exists(key) and key not in removed] == []


# ---------------------------------------------------------------- the sidecar webhook

def test_webhook_is_off_by_default():
    assert not [d for d in template() if d["kind"] in ("MutatingWebhookConfiguration", "Role")]
    assert "SLUICE_WEBHOOK_PORT" not in _operator_env()


def test_webhook_configuration_service_and_operator_settings_agree():
    from sluice.operator import certificates, sidecar, webhook
    docs = template("--set", "webhook.enabled=true")
    settings = Settings.from_env(_operator_env("--set", "webhook.enabled=true"))
    hook = settings.webhook
    assert (hook.port, hook.tls, hook.namespace) == (9443, "self-managed", "sluice-system")
    [configuration] = [d for d in docs if d["kind"] == "MutatingWebhookConfiguration"]
    assert configuration["metadata"]["name"] == hook.configuration == "sluice-sidecar-injector"
    [entry] = configuration["webhooks"]
    assert entry["clientConfig"]["service"] == {"name": hook.service, "namespace": hook.namespace,
                                                "path": f"/{webhook.HANDLER_ID}", "port": 443}
    assert "caBundle" not in entry["clientConfig"]  # the operator publishes it; the chart never resets it
    assert entry["failurePolicy"] == "Fail" and entry["timeoutSeconds"] == 10
    assert entry["namespaceSelector"] == {"matchLabels": {sidecar.NAMESPACE_LABEL: "enabled"}}
    assert entry["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                               "resources": ["pods"], "scope": "Namespaced"}]
    [service] = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == hook.service]
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert {"name": "webhook", "containerPort": 9443, "protocol": "TCP"} in pod["containers"][0]["ports"]
    # Self-managed: the operator writes its certificate into a writable emptyDir at the cert dir.
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == hook.cert_dir)
    assert next(v for v in pod["volumes"] if v["name"] == mount["name"]) == {"name": mount["name"], "emptyDir": {}}
    names = certificates.dns_names(hook.service, hook.namespace, settings.cluster_domain)
    assert f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc" in names


def test_webhook_with_cert_manager():
    docs = template("--set", "webhook.enabled=true", "--set", "webhook.certManager.enabled=true")
    settings = Settings.from_env(_operator_env("--set", "webhook.enabled=true", "--set",
                                               "webhook.certManager.enabled=true"))
    assert settings.webhook.tls == "cert-manager"
    [configuration] = [d for d in docs if d["kind"] == "MutatingWebhookConfiguration"]
    [certificate] = [d for d in docs if d["kind"] == "Certificate"]
    [issuer] = [d for d in docs if d["kind"] == "Issuer"]
    assert configuration["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == \
        f"{certificate['metadata']['namespace']}/{certificate['metadata']['name']}"
    assert certificate["spec"]["issuerRef"] == {"name": issuer["metadata"]["name"], "kind": "Issuer"}
    assert issuer["spec"] == {"selfSigned": {}}
    from sluice.operator import certificates
    assert certificate["spec"]["dnsNames"] == certificates.dns_names(
        settings.webhook.service, settings.webhook.namespace, settings.cluster_domain)
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == settings.webhook.cert_dir)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == certificate["spec"]["secretName"]
    assert not [d for d in docs if d["kind"] == "Role"]  # cert-manager owns the Secret: no rights to it


def test_webhook_rbac_is_by_name():
    docs = template("--set", "webhook.enabled=true")
    settings = Settings.from_env(_operator_env("--set", "webhook.enabled=true"))
    [cluster_role] = [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-webhook")]
    assert cluster_role["rules"] == [{"apiGroups": ["admissionregistration.k8s.io"],
                                      "resources": ["mutatingwebhookconfigurations"],
                                      "resourceNames": [settings.webhook.configuration], "verbs": ["get", "patch"]}]
    [role] = [d for d in docs if d["kind"] == "Role"]
    assert role["metadata"]["namespace"] == settings.webhook.namespace
    assert {"apiGroups": [""], "resources": ["secrets"], "resourceNames": [settings.webhook.secret],
            "verbs": ["get", "patch"]} in role["rules"]


# ---------------------------------------------------------------- Grafana dashboard

def test_grafana_dashboard_config_map_holds_the_charts_dashboard_for_the_sidecar():
    assert [d for d in template() if d["metadata"]["name"].endswith("-grafana-dashboard")] == []  # off by default
    [config_map] = [d for d in _rendered("ConfigMap", "--set", "grafana.dashboard.enabled=true")
                    if d["metadata"]["name"].endswith("-grafana-dashboard")]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == "sluice-system"
    dashboard = (CHART / "dashboards" / "sluice.json").read_text()
    assert json.loads(config_map["data"]["sluice.json"]) == json.loads(dashboard)
    [custom] = [d for d in _rendered("ConfigMap", "--set", "grafana.dashboard.enabled=true",
                                     "--set", "grafana.dashboard.label=example.com/dashboard",
                                     "--set-string", "grafana.dashboard.labelValue=sluice",
                                     "--set", "grafana.dashboard.namespace=monitoring")
                if d["metadata"]["name"].endswith("-grafana-dashboard")]
    assert custom["metadata"]["labels"]["example.com/dashboard"] == "sluice"
    assert "grafana_dashboard" not in custom["metadata"]["labels"]
    assert custom["metadata"]["namespace"] == "monitoring"
