"""What prometheus-adapter does with one discovery rule of its config, as plain functions, for tests.

    from sluice_testing import adapter

    rule = yaml.safe_load(config_map["data"]["config.yaml"])["rules"][0]
    adapter.metrics(rule, [adapter.Series("sluice_queue_depth", {"namespace": "models", "pod": "a"})])
    # {'sluice_queue_depth': 'sluice_queue_depth'}: custom metric name -> the series name it reads
    adapter.expand_rule(rule, "sluice_queue_depth", "models", ["a", "b"])
    # 'sum by (pod) (sluice_queue_depth{namespace="models",pod=~"a|b"})'

:func:`metrics` is discovery: which series the rule turns into which custom metrics (``seriesQuery``,
``seriesFilters``, ``name.matches``/``as``, and the series must carry the namespace and pod labels
of ``resources``). :func:`expand_rule` is the query the adapter sends Prometheus when the HPA asks
for ``metric`` on pods ``pods`` in ``namespace`` (``GET /apis/custom.metrics.k8s.io/v1beta1/
namespaces/<ns>/pods/*/<metric>``): ``metricsQuery`` with ``<<.Series>>``, ``<<.LabelMatchers>>``
(the namespace label ``=`` the namespace, then the pod label ``=`` one pod or ``=~`` ``a|b``, values
quoted as Go's ``%q`` does) and ``<<.GroupBy>>`` (the pod label) filled in. The result is plain PromQL,
so a test can run it against a real Prometheus.

Follows kubernetes-sigs/prometheus-adapter: ``pkg/naming/metric_namer.go`` (discovery and naming),
``pkg/naming/metrics_query.go`` (``Build``), ``pkg/client`` (``LabelEq``, ``LabelMatches``). Only
what Sluice's rules use: Pods metrics, ``resources.overrides`` or ``resources.template``, the three
template fields; anything else raises ``ValueError`` instead of guessing.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Rule = Mapping[str, Any]

_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
_SELECTOR = re.compile(r"^\s*([a-zA-Z_:][a-zA-Z0-9_:]*)?\s*(?:\{(.*)\})?\s*$", re.DOTALL)
_FIELD = re.compile(r"<<\s*(.*?)\s*>>")


@dataclasses.dataclass(frozen=True)
class Series:
    """One series as Prometheus's ``/api/v1/series`` lists it: its name and labels."""

    name: str
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)


def selector_matches(selector: str, series: Series) -> bool:
    """Whether the PromQL series selector (``name{label!="",other=~"re"}``) selects ``series``."""
    parsed = _SELECTOR.match(selector)
    if parsed is None:
        raise ValueError(f"not a series selector: {selector!r}")
    name, body = parsed.group(1), parsed.group(2) or ""
    if name is not None and name != series.name:
        return False
    labels = {"__name__": series.name, **series.labels}
    position = 0
    while position < len(body.rstrip()):
        matcher = _MATCHER.match(body, position)
        if matcher is None:
            raise ValueError(f"cannot parse the label matchers of {selector!r} at {body[position:]!r}")
        label, op, value = matcher.group(1), matcher.group(2), json.loads(f'"{matcher.group(3)}"')
        actual = labels.get(label, "")
        ok = {"=": actual == value, "!=": actual != value,
              "=~": re.fullmatch(value, actual) is not None, "!~": re.fullmatch(value, actual) is None}[op]
        if not ok:
            return False
        position = matcher.end()
    return True


def resource_labels(rule: Rule) -> dict[str, str]:
    """Kubernetes resource (``namespace``, ``pod``) -> the series label naming it, per ``resources``."""
    resources = rule.get("resources") or {}
    if "overrides" in resources:
        return {str(target["resource"]): str(label) for label, target in resources["overrides"].items()}
    if resources.get("template") == "<<.Resource>>":
        return {"namespace": "namespace", "pod": "pod"}
    raise ValueError(f"resources {resources!r}: only overrides and the template <<.Resource>> are supported")


def _name_pattern(rule: Rule) -> tuple[re.Pattern[str], str]:
    name = rule.get("name") or {}
    pattern = re.compile(name.get("matches") or ".*")
    alias = name.get("as") or ("$0" if pattern.groups == 0 else "$1" if pattern.groups == 1 else "")
    if not alias:
        raise ValueError(f"name.matches {pattern.pattern!r} has several groups: the rule needs name.as")
    return pattern, alias


def _expand(alias: str, match: re.Match[str]) -> str:
    """Go's ``Regexp.ExpandString``: ``$1``, ``${1}``, ``$name``, ``${name}`` from the match."""

    def group(found: re.Match[str]) -> str:
        key = found.group(1) or found.group(2)
        return match.group(int(key) if key.isdigit() else key) or ""

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", group, alias)


def _passes(series_filter: Mapping[str, str], name: str) -> bool:
    if "is" in series_filter:
        return re.search(series_filter["is"], name) is not None
    return re.search(series_filter["isNot"], name) is None


def metrics(rule: Rule, series: Iterable[Series]) -> dict[str, str]:
    """The Pods custom metrics the rule makes of ``series``: metric name -> series name."""
    labels = resource_labels(rule)
    pattern, alias = _name_pattern(rule)
    found: dict[str, str] = {}
    for one in series:
        if not selector_matches(str(rule["seriesQuery"]), one):
            continue
        if not all(_passes(f, one.name) for f in rule.get("seriesFilters") or []):
            continue
        match = pattern.search(one.name)
        if match is None or not all(one.labels.get(labels[r]) for r in ("namespace", "pod")):
            continue
        found[_expand(alias, match)] = one.name
    return found


def _go_quote(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)  # Go's %q for the names Kubernetes allows


def expand_rule(rule: Rule, metric: str, namespace: str, pods: Sequence[str], *, series: str | None = None) -> str:
    """The PromQL prometheus-adapter runs for ``metric`` on ``pods`` in ``namespace``.

    ``series`` is the series name the metric reads (from :func:`metrics`); by default it is read off a
    literal ``name.matches`` such as ``^sluice_queue_depth$``. ``ValueError`` if the rule does not
    serve ``metric`` from that series.
    """
    if not pods:
        raise ValueError("the adapter asks for at least one pod")
    pattern, alias = _name_pattern(rule)
    if series is None:
        literal = re.fullmatch(r"\^([a-zA-Z_:][a-zA-Z0-9_:]*)\$", pattern.pattern)
        if literal is None:
            raise ValueError(f"name.matches {pattern.pattern!r} is not one literal name: pass series=")
        series = literal.group(1)
    match = pattern.search(series)
    if match is None or _expand(alias, match) != metric:
        raise ValueError(f"the rule does not serve {metric!r} from series {series!r}")
    labels = resource_labels(rule)
    pod_matcher = "=~" if len(pods) > 1 else "="
    matchers = [f"{labels['namespace']}={_go_quote(namespace)}",
                f"{labels['pod']}{pod_matcher}{_go_quote('|'.join(pods))}"]
    values = {".Series": series, ".LabelMatchers": ",".join(matchers), ".GroupBy": labels["pod"]}

    def field(found: re.Match[str]) -> str:
        if found.group(1) not in values:
            raise ValueError(f"template action <<{found.group(1)}>> is not supported here (only {', '.join(values)})")
        return values[found.group(1)]

    return _FIELD.sub(field, str(rule["metricsQuery"]))
