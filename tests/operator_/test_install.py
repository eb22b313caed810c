"""Install artefacts: CRDs, Helm chart, generated manifests, examples - all checked against real schemas.

Tests that need the helm binary (``.tools/bin/helm`` from ``.ci/tools.sh``, or ``$HELM``) skip with a
reason when it is missing.
"""

from __future__ import annotations

import copy
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jsonschema
import pytest
import yaml

from sluice.operator import api, crd
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
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for doc in docs:
        if doc["apiVersion"].startswith(("monitoring.coreos.com", "kopf.dev")):
            continue  # prometheus-operator's and kopf's custom resources, not Kubernetes built-ins
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
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Ready", "Replicas", "Traffic", "URL", "Age"]
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
        parse = api.parse_inference_model if doc["kind"] == "InferenceModel" else api.parse_ensemble
        parse(doc["metadata"]["name"], pruned["spec"])  # the CEL-equivalent rules


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


def test_examples_cover_both_kinds():
    kinds = {doc["kind"] for path in EXAMPLES for doc in yaml.safe_load_all(path.read_text())}
    assert kinds == {"InferenceModel", "Ensemble"}


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
], ids=["defaults", "namespaced-ha", "minimal"])
def test_helm_template_renders_valid_manifests(values):
    validate(template(*values))


def test_crds_toggle_and_keep():
    kept = [d for d in template() if d["kind"] == "CustomResourceDefinition"]
    assert {d["metadata"]["name"] for d in kept} == {"inferencemodels.sluice.dev", "ensembles.sluice.dev"}
    assert all(d["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep" for d in kept)
    dropped = [d for d in template("--set", "crds.keep=false") if d["kind"] == "CustomResourceDefinition"]
    assert all("annotations" not in d["metadata"] for d in dropped)
    assert not [d for d in template("--set", "crds.enabled=false") if d["kind"] == "CustomResourceDefinition"]
    peering = [d["metadata"]["name"] for d in template("--set", "leaderElection.enabled=true")
               if d["kind"] == "CustomResourceDefinition"]
    assert "kopfpeerings.kopf.dev" in peering
    elections = [d for d in template("--set", "leaderElection.enabled=true", "--set", "replicaCount=2")
                 if d["kind"] == "ClusterKopfPeering"]
    assert [d["metadata"]["annotations"]["helm.sh/hook"] for d in elections] == ["post-install,post-upgrade"]


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


@pytest.mark.parametrize(("args", "message"), [
    (["--set", "replicsCount=2"], "additional properties 'replicsCount' not allowed"),
    (["--set", "image.pullPolicy=Sometimes"], "pullPolicy"),
    (["--set", "replicaCount=2"], "replicaCount > 1 needs leaderElection.enabled=true"),
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
