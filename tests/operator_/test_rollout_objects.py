"""What a canary rollout renders (pure builders, no cluster): the candidate's own objects, the
router's objects per kind, and a stable Deployment that never selects the canary's pods."""

from __future__ import annotations

import json

import pytest

from sluice.operator import api, builders, canary
from sluice.operator.settings import Settings

OWNER = builders.Owner(kind="InferenceModel", name="clf", namespace="models", uid="uid-1")
SPEC = {
    "model": {"storageUri": "s3://models/clf/v1", "format": "onnx", "version": 1},
    "runtime": {"maxBatchSize": 8},
    "canary": {"storageUri": "s3://models/clf/v2", "version": 2, "analysis": {"stepWeights": [10, 50]}},
}


def render(spec: dict, *, phase_canary: bool = True, promoted: bool = False, weight: int = 10,
           router: str = "none", settings: Settings | None = None) -> dict[tuple[str, str], dict]:
    parsed = api.parse_inference_model("clf", spec)
    plan = canary.plan_of(parsed)
    assert plan is not None
    rollout = builders.Rollout(candidate=plan.candidate, canary=phase_canary, promoted=promoted, weight=weight,
                               router=router, routed=phase_canary)
    desired = builders.inference_model(OWNER, parsed, settings or Settings(), rollout=rollout)
    return {(o["kind"], o["metadata"]["name"]): o for o in desired.objects}


def test_the_candidate_runs_with_the_stable_server_settings():
    objects = render({**SPEC, "server": {"protocolWorkers": "auto"}})
    for name in ("clf", "clf-canary"):
        args = objects[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--protocol-workers") + 1] == "auto", name


def config_of(objects: dict, name: str) -> dict:
    [text] = objects[("ConfigMap", name)]["data"].values()
    return json.loads(text)


def test_the_candidate_runs_beside_stable_and_neither_selects_the_other():
    objects = render(SPEC)
    stable, cand = objects[("Deployment", "clf")], objects[("Deployment", "clf-canary")]
    stable_sel = stable["spec"]["selector"]["matchLabels"]
    cand_labels = cand["spec"]["template"]["metadata"]["labels"]
    assert not all(cand_labels.get(k) == v for k, v in stable_sel.items())
    assert all(cand_labels.get(k) == v for k, v in cand["spec"]["selector"]["matchLabels"].items())
    assert cand_labels["sluice.dev/track"] == "canary" and "sluice.dev/track" not in stable_sel
    assert objects[("Service", "clf-canary")]["spec"]["selector"] == cand["spec"]["selector"]["matchLabels"]
    assert "s3://models/clf/v2" in str(cand["spec"]["template"]["spec"]["initContainers"])
    assert "s3://models/clf/v1" in str(stable["spec"]["template"]["spec"]["initContainers"])
    assert config_of(objects, "clf-canary-config")["version_policy"] == {"specific": {"versions": [2]}}


def test_a_runtime_only_candidate_changes_the_canary_config_not_the_stable_one():
    spec = {**SPEC, "canary": {"storageUri": "s3://models/clf/v1", "version": 1, "runtime": {"maxBatchSize": 32},
                               "analysis": {"stepWeights": [10, 50]}}}
    objects = render(spec)
    assert config_of(objects, "clf-config")["max_batch_size"] == 8
    assert config_of(objects, "clf-canary-config")["max_batch_size"] == 32
    assert canary.plan_of(api.parse_inference_model("clf", spec)) != canary.plan_of(
        api.parse_inference_model("clf", {**spec, "canary": {**spec["canary"], "runtime": {"maxBatchSize": 16}}}))
    promoted = render(spec, promoted=True)
    assert config_of(promoted, "clf-config")["max_batch_size"] == 32  # promotion carries the settings


def test_a_canary_identical_to_stable_is_refused_naming_what_may_differ():
    with pytest.raises(api.SpecError, match="change its version, storageUri, config or runtime"):
        api.parse_inference_model("clf", {**SPEC, "canary": {"storageUri": "s3://models/clf/v1", "version": 1}})


def test_the_stable_pods_always_mount_the_split_so_a_canary_never_rolls_them():
    without = builders.inference_model(OWNER, api.parse_inference_model("clf", {k: v for k, v in SPEC.items()
                                                                                if k != "canary"}), Settings())
    during = render(SPEC)
    [before] = [o for o in without.objects if o["kind"] == "Deployment"]
    assert before["spec"]["template"] == during[("Deployment", "clf")]["spec"]["template"]
    args = before["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--split-file") + 1] == "/etc/sluice/split/split.json"
    [volume] = [v for v in before["spec"]["template"]["spec"]["volumes"] if v["name"] == "split"]
    assert volume["configMap"] == {"name": "clf-split", "optional": True}
    [mount] = [m for m in before["spec"]["template"]["spec"]["containers"][0]["volumeMounts"] if m["name"] == "split"]
    assert "subPath" not in mount  # a subPath mount never sees a ConfigMap update


def test_no_mesh_split_file_names_the_canary_service_and_the_weight():
    objects = render(SPEC, weight=25)
    data = json.loads(objects[("ConfigMap", "clf-split")]["data"]["split.json"])
    assert data == {"models": {"clf": {"target": "clf-canary.models.svc.cluster.local:8001", "percent": 25}}}


def test_a_gateway_parent_routes_http_by_model_path_and_renders_no_grpc_route():
    objects = render(SPEC, router="gateway-api", weight=50, settings=Settings(gateway="infra/public"))
    route = objects[("HTTPRoute", "clf")]["spec"]
    assert route["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "public",
                                    "namespace": "infra"}]
    assert route["rules"][0]["matches"] == [{"path": {"type": "PathPrefix", "value": "/v2/models/clf"}}]
    assert ("GRPCRoute", "clf") not in objects


def test_after_the_rollout_the_route_and_canary_objects_are_listed_absent():
    parsed = api.parse_inference_model("clf", SPEC)
    rollout = builders.Rollout(candidate="x", canary=False, promoted=False, weight=0, router="none", routed=False)
    desired = builders.inference_model(OWNER, parsed, Settings(), rollout=rollout)
    absent = {(kind, name) for _, kind, name in desired.absent}
    assert {("Deployment", "clf-canary"), ("Service", "clf-canary"), ("ConfigMap", "clf-canary-config"),
            ("ConfigMap", "clf-split"), ("HTTPRoute", "clf"), ("GRPCRoute", "clf"),
            ("VirtualService", "clf")} <= absent
    assert not any(o["metadata"]["name"].startswith("clf-canary") for o in desired.objects)
    assert [t["percent"] for t in desired.traffic] == [100]


@pytest.mark.parametrize(("router", "settings"), [
    ("gateway-api", Settings()), ("gateway-api", Settings(gateway="infra/public")), ("istio", Settings()),
], ids=["gateway-api-gamma", "gateway-api-gateway", "istio"])
def test_router_objects_validate_against_their_published_schemas(router, settings):
    from sluice_testing import schemas
    objects = render(SPEC, router=router, weight=25, settings=settings)
    routes = [o for o in objects.values() if o["kind"] in ("HTTPRoute", "GRPCRoute", "VirtualService")]
    assert routes
    assert schemas.validate_all(routes) == [[] for _ in routes]


def test_a_canary_tracks_own_autoscaler_validates_and_targets_the_canary():
    from sluice_testing import schemas
    spec = {**SPEC, "scaling": {"minReplicas": 1, "maxReplicas": 4, "engine": "keda"}}
    objects = render(spec, settings=Settings(prometheus_url="http://prometheus.monitoring:9090"))
    scaled = objects[("ScaledObject", "clf-canary")]
    assert scaled["spec"]["scaleTargetRef"]["name"] == "clf-canary"
    assert 'app_kubernetes_io_instance="clf-canary"' in scaled["spec"]["triggers"][0]["metadata"]["query"]
    assert schemas.validate(scaled) == []
    hpa = render({**SPEC, "scaling": {"minReplicas": 1, "maxReplicas": 4}})[("HorizontalPodAutoscaler", "clf-canary")]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "clf-canary"
