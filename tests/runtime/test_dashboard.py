"""The Grafana dashboard the chart ships (helm/sluice/dashboards/sluice.json): every PromQL expression
names only metric families the runtime exports, read from a real server's /metrics, so renaming a
family without the dashboard fails here."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient

from .conftest import BUILDERS, IDENTITY_PY, MLP_CONFIG, write_model  # type: ignore[import-not-found]
from .test_response_cache import COUNTING_PY  # type: ignore[import-not-found]
from .test_response_cache import config as cached_config  # type: ignore[import-not-found]

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "sluice" / "dashboards" / "sluice.json"
NOT_SLUICE = {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED"}
"""Families of NVIDIA dcgm-exporter (the dashboard's GPU row, marked as needing it): Sluice exports none."""

KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers followed by ``{`` or ``[`` or used bare,
    not functions (followed by ``(``), keywords, label names in groupings or matchers, or numbers."""
    label_values = re.fullmatch(r"\s*label_values\((.*),\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*", expr)
    if label_values:  # Grafana's variable query: only its first argument is PromQL
        expr = label_values.group(1)
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", "{}", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "[]", text)  # ranges ($__rate_interval)
    text = _GROUPING.sub(" ", text)
    names = set()
    for match in _IDENTIFIER.finditer(text):
        name = match.group()
        before = text[match.start() - 1] if match.start() else ""
        after = text[match.end() :].lstrip()[:1]
        if (
            after == "("
            or name in KEYWORDS
            or before == "$"
            or before.isdigit()
            or re.fullmatch(r"[eE]\d*|inf|nan|NaN|Inf", name)
        ):
            continue
        names.add(name)
    return names


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (model, version) (rate(a_total{model=~"$model"}[$__rate_interval]))', {"a_total"}),
        ("histogram_quantile(0.99, sum by (le) (rate(b_bucket[5m])))", {"b_bucket"}),
        ("c / on(model) group_left(version) d > 0", {"c", "d"}),
        ('label_values(e_total{namespace=~"$namespace"}, model)', {"e_total"}),
        ('f{reason="timeout|by"} offset 5m and bool g', {"f", "g"}),
    ],
)
def test_metric_names_reads_what_promql_reads(expr, names):
    assert metric_names(expr) == names


def expressions(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and templating query, rows' panels included."""

    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for item in items:
            yield item
            yield from panels(item.get("panels", []))

    for panel in panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            yield f"variable {variable['name']}", query["query"] if isinstance(query, dict) else query


def exported(text: str) -> set[str]:
    """Sample names (``_total``, ``_bucket``, ``_sum``, ``_count`` as exposed) and family names."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


@pytest.fixture(scope="module")
def runtime_families(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> set[str]:
    """What a real server exports with a model of each kind: dynamic batching (ONNX), response cache
    and a plain Python model, after a request to each."""
    from .conftest import start_server  # type: ignore[import-not-found]

    repo = tmp_path_factory.mktemp("dashboard") / "repo"
    write_model(repo, "mlp", MLP_CONFIG, {"model.onnx": BUILDERS.mlp_model()})
    write_model(repo, "cached", cached_config(), {"model.py": COUNTING_PY})
    write_model(
        repo,
        "echo",
        """
        name: "echo"
        backend: "python"
        max_batch_size: 0
        input [ { name: "IN0", data_type: TYPE_FP32, dims: [ 1 ] } ]
        output [ { name: "OUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
        """,
        {"model.py": IDENTITY_PY},
    )
    server = start_server(repo)
    try:
        client = httpclient.InferenceServerClient(server.http)
        for model, name, shape in (("mlp", "INPUT0", [1, 16]), ("cached", "IN", [1, 2]), ("echo", "IN0", [1])):
            tensor = httpclient.InferInput(name, shape, "FP32")
            tensor.set_data_from_numpy(np.ones(shape, np.float32))
            client.infer(model, [tensor], headers={"Sluice-Caller": "dashboard-test"})
        client.close()
        with urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=5) as response:
            return exported(response.read().decode())
    finally:
        server.stop()


def test_every_expression_names_a_family_the_runtime_exports(runtime_families):
    dashboard = json.loads(DASHBOARD.read_text())
    used: dict[str, set[str]] = {}
    for where, expr in expressions(dashboard):
        for name in metric_names(expr):
            used.setdefault(name, set()).add(where)
    assert used, "no PromQL found in the dashboard"
    unknown = {name: sorted(where) for name, where in used.items() if name not in runtime_families | NOT_SLUICE}
    assert unknown == {}, f"the dashboard reads families the runtime does not export: {unknown}"
    assert set(used) >= NOT_SLUICE, "the GPU row reads dcgm-exporter's families"
    assert not NOT_SLUICE & runtime_families, "the runtime exports a GPU family now: use it, drop the allowlist"


def test_the_dashboard_is_importable_grafana_json():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 38
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert {"namespace", "model", "version"} <= set(variables)
    ids = []
    for panel in dashboard["panels"]:
        ids.append(panel["id"])
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}"
            if "DCGM" not in target["expr"]:
                for label in ("namespace", "model", "version"):
                    assert f'{label}=~"${label}"' in target["expr"], (panel["title"], label)
    assert len(ids) == len(set(ids))
    titles = [p["title"] for p in dashboard["panels"]]
    # the seed lesson: queue depth and the cache hit rate side by side on one row
    depth, hits = (
        next(p for p in dashboard["panels"] if p["title"] == t) for t in ("Queue depth", "Response cache hit rate")
    )
    assert (
        depth["gridPos"]["y"] == hits["gridPos"]["y"]
        and depth["gridPos"]["x"] + depth["gridPos"]["w"] == hits["gridPos"]["x"]
    )
    assert any("GPU" in t and "dcgm-exporter" in t for t in titles)
