"""Settings come from SLUICE_* variables once, in __main__; metrics live on their own registry."""

from __future__ import annotations

import prometheus_client
import pytest

from sluice.operator import __main__ as entry
from sluice.operator.metrics import OperatorMetrics
from sluice.operator.settings import Settings


def test_from_env_reads_every_documented_variable():
    settings = Settings.from_env({
        "SLUICE_WATCH_NAMESPACES": "models, research,", "SLUICE_RUNTIME_IMAGE": "r:1",
        "SLUICE_RUNTIME_GPU_IMAGE": "r:1-cuda", "SLUICE_DEFAULT_CPU": "2", "SLUICE_DEFAULT_MEMORY": "8Gi",
        "SLUICE_MAX_COLOCATED_GPUS": "2", "SLUICE_RESYNC_SECONDS": "30", "SLUICE_PEERING_NAME": "",
        "SLUICE_METRICS_PORT": "0", "SLUICE_PROMETHEUS_URL": "http://prometheus-operated.monitoring:9090",
        "SLUICE_ROUTER": "istio", "SLUICE_GATEWAY": "infra/public", "SLUICE_PROTOCOL_WORKERS": "auto",
    })
    assert settings.namespaces == ("models", "research")
    assert (settings.runtime_image, settings.runtime_gpu_image) == ("r:1", "r:1-cuda")
    assert (settings.default_resources.cpu, settings.default_resources.memory) == ("2", "8Gi")
    assert settings.max_colocated_gpus == 2
    assert settings.resync_seconds == 30.0
    assert settings.peering_name is None
    assert settings.operator_metrics_port == 0
    assert settings.prometheus_url == "http://prometheus-operated.monitoring:9090"
    assert (settings.router, settings.gateway) == ("istio", "infra/public")
    assert settings.default_protocol_workers == "auto"
    assert Settings.from_env({"SLUICE_PROTOCOL_WORKERS": "4"}).default_protocol_workers == 4
    assert Settings.from_env({"SLUICE_PROTOCOL_WORKERS": ""}).default_protocol_workers is None


@pytest.mark.parametrize(("variable", "value", "allowed"), [
    ("SLUICE_ROUTER", "linkerd", "allowed: auto, gateway-api, istio, none"),
    ("SLUICE_PROMETHEUS_URL", "prometheus:9090", "allowed: an http:// or https:// URL"),
    ("SLUICE_GATEWAY", "infra/", "allowed: <namespace>/<name> or <name>"),
    ("SLUICE_GATEWAY", "/public", "allowed: <namespace>/<name> or <name>"),
    ("SLUICE_GATEWAY", "a/b/c", "allowed: <namespace>/<name> or <name>"),
    ("SLUICE_PROTOCOL_WORKERS", "65", "allowed: empty (not passed), auto, or a count from 0 to 64"),
    ("SLUICE_PROTOCOL_WORKERS", "-1", "allowed: empty (not passed), auto"),
    ("SLUICE_PROTOCOL_WORKERS", "Auto", "allowed: empty (not passed), auto"),
])
def test_a_bad_canary_setting_names_the_variable_and_what_is_allowed(variable, value, allowed):
    with pytest.raises(ValueError, match=f"{variable}={value!r} is not allowed") as caught:
        Settings.from_env({variable: value})
    assert allowed in str(caught.value)


def test_peering_replicas_draw_distinct_priorities_unless_one_is_given():
    # kopf pauses every operator when two of the same priority meet: replicas sharing one environment
    # (one Deployment) must still differ.
    drawn = {Settings.from_env({"SLUICE_PEERING_NAME": "sluice"}).peering_priority for _ in range(20)}
    assert len(drawn) == 20 and min(drawn) > 0
    given = Settings.from_env({"SLUICE_PEERING_NAME": "sluice", "SLUICE_PEERING_PRIORITY": "7"})
    assert (given.peering_name, given.peering_priority) == ("sluice", 7)


def test_defaults_without_environment():
    assert Settings.from_env({}) == Settings()


def test_two_metrics_objects_do_not_collide():
    first, second = OperatorMetrics(), OperatorMetrics()
    first.reconciles.labels("InferenceModel", "ok").inc()
    assert first.registry.get_sample_value("sluice_operator_reconciles_total",
                                           {"kind": "InferenceModel", "result": "ok"}) == 1
    assert second.registry.get_sample_value("sluice_operator_reconciles_total",
                                            {"kind": "InferenceModel", "result": "ok"}) is None
    assert prometheus_client.REGISTRY.get_sample_value("sluice_operator_reconciles_total") is None


def test_cli_help_describes_the_settings(capsys):
    with pytest.raises(SystemExit) as info:
        entry.main(["--help"])
    assert info.value.code == 0
    assert "SLUICE_" in capsys.readouterr().out
