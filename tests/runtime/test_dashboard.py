"""The Grafana dashboard the chart ships (helm/sluice/dashboards/sluice.json): every PromQL expression
names only metric families the runtime exports, read from a real server's /metrics, so renaming a
family without the dashboard fails here. The GPU row is read against ``sluice serve`` started over
the fake NVML library (sluice_testing/fake_nvml.py, compiled with gcc): a whole GPU and an H100 in
MIG mode, with a KIND_GPU model on each."""

from __future__ import annotations

import json
import re
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient

from sluice_testing import fake_nvml

from .conftest import BUILDERS, IDENTITY_PY, MLP_CONFIG, write_model  # type: ignore[import-not-found]
from .test_gpu_telemetry import (  # type: ignore[import-not-found]
    GPU_MODEL_PY,
    MIG_GPU,
    TWO_GPUS,
    gpu_model_config,
    sluice,
)
from .test_response_cache import COUNTING_PY  # type: ignore[import-not-found]
from .test_response_cache import config as cached_config  # type: ignore[import-not-found]

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "sluice" / "dashboards" / "sluice.json"
GPU_ROW = "GPU (sluice serve --allow-gpu-metrics)"
"""The row whose panels read the NVML families, exported only where the server reads NVML."""
WORKERS_ROW = "Protocol workers (sluice serve --protocol-workers)"
"""The row whose panels read the protocol worker families, exported only by a server with workers."""
PER_POD_ROWS = {GPU_ROW, WORKERS_ROW}
"""Rows of per-device or per-pod panels: filtered by namespace, with no model labels to filter by."""

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


def expressions(dashboard: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(row, where, PromQL) of every panel target and templating query, rows' panels included. A
    panel belongs to the row it is nested in (collapsed) or else to the last row above it in the
    list, as Grafana places them; variables belong to no row (``""``)."""

    def panels(items: list[dict[str, Any]], row: str) -> Iterator[tuple[str, dict[str, Any]]]:
        for item in items:
            if item["type"] == "row":
                row = item["title"]
            yield row, item
            yield from panels(item.get("panels", []), row)

    for row, panel in panels(dashboard["panels"], ""):
        for target in panel.get("targets", []):
            yield row, panel["title"], target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            yield "", f"variable {variable['name']}", query["query"] if isinstance(query, dict) else query


def families_read(rows: set[str] | None = None, *, outside: bool = False) -> dict[str, set[str]]:
    """Family -> where the dashboard reads it, in the rows named (``outside``: in every other row)."""
    used: dict[str, set[str]] = {}
    for row, where, expr in expressions(json.loads(DASHBOARD.read_text())):
        if rows is None or (row in rows) != outside:
            for name in metric_names(expr):
                used.setdefault(name, set()).add(where)
    return used


def exported(text: str) -> set[str]:
    """Sample names (``_total``, ``_bucket``, ``_sum``, ``_count`` as exposed) and family names."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def label_names(text: str) -> dict[str, set[str]]:
    """Sample name -> the label names its samples carry, as the text writes them."""
    found: dict[str, set[str]] = {}
    for line in text.splitlines():
        match = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})? ", line)
        if match and not line.startswith("#"):
            found.setdefault(match.group(1), set()).update(re.findall(r'(\w+)="', match.group(2) or ""))
    return found


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


@pytest.fixture(scope="module")
def gpu_metrics(tmp_path_factory: pytest.TempPathFactory) -> str:
    """/metrics of ``sluice serve`` over the fake NVML library: one whole GPU and an H100 in MIG mode,
    a KIND_GPU model with an instance on each of the fake CUDA runtime's two devices (CUDA enumerates
    one MIG device alone when one is visible: device 0 is the first slice, device 1 maps to none)."""
    if shutil.which("gcc") is None:
        pytest.skip("the fake NVML library is compiled with gcc")
    tmp = tmp_path_factory.mktemp("dashboard_gpu")
    library = fake_nvml.build(tmp / "nvml", [TWO_GPUS[0], MIG_GPU])
    write_model(tmp / "repo", "on_gpus", gpu_model_config("on_gpus", 1, [0, 1]), {"model.py": GPU_MODEL_PY})
    with sluice(tmp, library, "--allow-gpu-metrics", "true", "--metrics-interval-ms", "3600000") as server:
        return server.scrape()


def test_every_expression_names_a_family_the_runtime_exports(runtime_families):
    used = families_read(PER_POD_ROWS, outside=True)
    assert used, "no PromQL found in the dashboard"
    unknown = {name: sorted(where) for name, where in used.items() if name not in runtime_families}
    assert unknown == {}, f"the dashboard reads families the runtime does not export: {unknown}"


def test_the_gpu_row_reads_families_a_server_reading_nvml_exports(runtime_families, gpu_metrics):
    used = families_read({GPU_ROW})
    exported_with_gpus = exported(gpu_metrics)
    unknown = {name: sorted(where) for name, where in used.items() if name not in exported_with_gpus}
    assert unknown == {}, f"the GPU row reads families a server reading NVML does not export: {unknown}"
    # every family of the row is one only NVML telemetry exports, and has samples (not a TYPE line only)
    assert set(used) >= {
        *("nv_gpu_utilization", "nv_gpu_memory_used_bytes", "nv_gpu_memory_total_bytes", "nv_gpu_power_usage"),
        *("sluice_mig_memory_used_bytes", "sluice_gpu_model_instances"),
    }
    assert not set(used) & runtime_families, "the GPU row reads a family a server without GPUs exports"
    labels = label_names(gpu_metrics)
    assert set(used) <= set(labels), f"no samples for {sorted(set(used) - set(labels))}"
    # a panel filters by model and version exactly where its families carry those labels, and
    # groups only by labels its families carry (namespace and pod: Prometheus's, from the PodMonitor)
    for row, where, expr in expressions(json.loads(DASHBOARD.read_text())):
        if row != GPU_ROW:
            continue
        carried = set.intersection(*(labels[name] for name in metric_names(expr)))
        per_model = {"model", "version"} <= carried
        assert ('model=~"$model"' in expr) == per_model and ('version=~"$version"' in expr) == per_model, where
        for grouping in re.findall(r"\bby \(([^)]*)\)", expr):
            grouped = {label.strip() for label in grouping.split(",")}
            assert grouped - {"namespace", "pod"} <= carried, (where, grouped - {"namespace", "pod"} - carried)


def test_the_protocol_workers_row_reads_families_a_server_with_workers_exports(tmp_path, runtime_families):
    from .conftest import start_server  # type: ignore[import-not-found]

    write_model(tmp_path / "repo", "mlp", MLP_CONFIG, {"model.onnx": BUILDERS.mlp_model()})
    server = start_server(tmp_path / "repo", protocol_workers=1)
    try:
        with urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=5) as response:
            text = response.read().decode()
    finally:
        server.stop()
    used = families_read({WORKERS_ROW})
    assert set(used) == {"sluice_protocol_workers", "sluice_protocol_workers_serving",
                         "sluice_protocol_worker_restarts_total"}
    assert set(used) <= exported(text), sorted(set(used) - exported(text))
    assert set(label_names(text)) >= set(used), "each family has a sample"
    assert not set(used) & runtime_families, "the row reads a family a server without workers exports"


def test_the_dashboard_is_importable_grafana_json():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 38
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert {"namespace", "model", "version"} <= set(variables)
    ids = []
    row = ""
    for panel in dashboard["panels"]:
        ids.append(panel["id"])
        if panel["type"] == "row":
            row = panel["title"]
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}"
            # the per-device and per-pod rows have no model labels to filter by (checked above)
            for label in ("namespace",) if row in PER_POD_ROWS else ("namespace", "model", "version"):
                assert f'{label}=~"${label}"' in target["expr"], (panel["title"], label)
    assert len(ids) == len(set(ids))
    cells = [
        (x, y, panel["title"])
        for panel in dashboard["panels"]
        for x in range(panel["gridPos"]["x"], panel["gridPos"]["x"] + panel["gridPos"]["w"])
        for y in range(panel["gridPos"]["y"], panel["gridPos"]["y"] + panel["gridPos"]["h"])
    ]
    assert all(x < 24 for x, _, _ in cells), "Grafana's grid is 24 columns wide"
    assert len({(x, y) for x, y, _ in cells}) == len(cells), "panels overlap"
    titles = [p["title"] for p in dashboard["panels"]]
    # the seed lesson: queue depth and the cache hit rate side by side on one row
    depth, hits = (
        next(p for p in dashboard["panels"] if p["title"] == t) for t in ("Queue depth", "Response cache hit rate")
    )
    assert (
        depth["gridPos"]["y"] == hits["gridPos"]["y"]
        and depth["gridPos"]["x"] + depth["gridPos"]["w"] == hits["gridPos"]["x"]
    )
    assert GPU_ROW in titles and WORKERS_ROW in titles
