"""The canary analysis' arithmetic (``sluice.operator.signals``), pure: the PromQL it asks, what it makes
of Prometheus' answers, and the same numbers computed from two scrapes of the runtime pods. Missing
data must reach ``canary.judge`` as missing, so that it is Inconclusive there, never a pass."""

from __future__ import annotations

import math

import pytest

from sluice.operator import canary as c
from sluice.operator import signals as s

TARGET = c.Target(
    namespace="models", name="resnet", model="resnet50", stable_instance="resnet",
    canary_instance="resnet-canary", window_s=60,
)  # fmt: skip
ANALYSIS = c.Analysis(min_requests=10, max_error_rate=0.05, max_p99_ms=100.0)
BOUNDS = (0.001, 0.01, 0.1, 1.0, math.inf)


def vector(value: str | None):
    """A Prometheus instant vector of one sample (``None``: an empty vector)."""
    return [] if value is None else [{"metric": {}, "value": [1700000000.0, value]}]


def hist(*cumulative: float, bounds=BOUNDS) -> s.Buckets:
    return tuple(zip(bounds, cumulative, strict=True))


def counts(requests: float, errors: float = 0, buckets: s.Buckets | None = None) -> s.Counts:
    return s.Counts(requests, errors, buckets if buckets is not None else hist(0, 0, requests, requests, requests))


# -- PromQL ----------------------------------------------------------------------------------------

def test_promql_reads_each_track_by_namespace_instance_and_model_over_the_window():
    queries = s.promql(TARGET)
    selector = '{namespace="models",app_kubernetes_io_instance="resnet-canary",model="resnet50"}'
    assert queries == {
        "canary_requests": f"sum(increase(sluice_request_duration_seconds_count{selector}[60s]))",
        "canary_errors": f"sum(increase(sluice_request_server_failure_total{selector}[60s]))",
        "canary_p99": "histogram_quantile(0.99, sum by (le) "
        f"(rate(sluice_request_duration_seconds_bucket{selector}[60s])))",
        "stable_requests": queries["stable_requests"],
        "stable_errors": queries["stable_errors"],
        "stable_p99": queries["stable_p99"],
    }
    assert 'app_kubernetes_io_instance="resnet"' in queries["stable_requests"]
    assert all("resnet-canary" not in q for key, q in queries.items() if key.startswith("stable"))


@pytest.mark.parametrize(
    ("window_s", "range_"), [(60, "[60s]"), (5.0, "[5s]"), (2.5, "[2500ms]"), (0.0001, "[1ms]")]
)
def test_promql_ranges_are_whole_seconds_or_milliseconds(window_s, range_):
    queries = s.promql(c.Target("ns", "m", "m", "m", "m-canary", window_s))
    assert all(q.count(range_) == 1 for q in queries.values())


def test_promql_escapes_label_values():
    queries = s.promql(c.Target("ns", "m", 'we"ird\\name', "m", "m-canary", 60))
    assert 'model="we\\"ird\\\\name"' in queries["canary_requests"]


# -- Prometheus answers -> VersionMetrics ----------------------------------------------------------

@pytest.mark.parametrize(
    ("requests", "errors", "p99", "expected"),
    [
        pytest.param(vector("120"), vector("3"), vector("0.042"), c.VersionMetrics(120, 3, 42.0), id="all-there"),
        pytest.param(vector("120"), [], vector("0.042"), c.VersionMetrics(120, 0, 42.0), id="no-error-series-is-0"),
        pytest.param([], vector("3"), vector("0.042"), None, id="no-requests-series-is-no-data"),
        pytest.param([], [], [], None, id="all-empty"),
        pytest.param(None, vector("3"), vector("0.042"), None, id="requests-query-failed"),
        pytest.param(vector("120"), None, vector("0.042"), c.VersionMetrics(120, math.nan, 42.0), id="errors-failed"),
        pytest.param(vector("120"), vector("3"), [], c.VersionMetrics(120, 3, None), id="no-latency"),
        pytest.param(vector("0"), [], vector("NaN"), c.VersionMetrics(0, 0, math.nan), id="idle: NaN p99"),
        pytest.param(vector("NaN"), vector("NaN"), vector("NaN"), c.VersionMetrics(math.nan, math.nan, math.nan),
                     id="all-NaN"),
        pytest.param(vector("10"), vector("1"), vector("+Inf"), c.VersionMetrics(10, 1, math.inf), id="+Inf"),
    ],
)
def test_version_metrics_from_vectors(requests, errors, p99, expected):
    got = s.version_metrics(requests, errors, p99)
    if expected is None:
        assert got is None
        return
    assert got is not None
    for field in ("requests", "errors", "p99_ms"):
        want, have = getattr(expected, field), getattr(got, field)
        assert (want is None and have is None) or (math.isnan(want) and math.isnan(have)) or have == pytest.approx(want)


@pytest.mark.parametrize(
    ("results", "verdict"),
    [
        ({"canary_requests": vector("200"), "canary_errors": vector("1"), "canary_p99": vector("0.05")},
         c.SUCCESSFUL),
        ({"canary_requests": vector("200"), "canary_errors": vector("40"), "canary_p99": vector("0.05")}, c.FAILED),
        ({"canary_requests": vector("200"), "canary_errors": [], "canary_p99": vector("0.5")}, c.FAILED),
        ({"canary_requests": [], "canary_errors": [], "canary_p99": []}, c.INCONCLUSIVE),
        ({}, c.INCONCLUSIVE),
        ({"canary_requests": vector("NaN"), "canary_errors": vector("0"), "canary_p99": vector("0.05")},
         c.INCONCLUSIVE),
        ({"canary_requests": vector("200"), "canary_errors": vector("0"), "canary_p99": vector("NaN")},
         c.INCONCLUSIVE),
        ({"canary_requests": vector("200"), "canary_errors": None, "canary_p99": vector("0.05")}, c.INCONCLUSIVE),
        ({"canary_requests": vector("3"), "canary_errors": [], "canary_p99": vector("0.05")}, c.INCONCLUSIVE),
    ],
)
def test_missing_or_nan_answers_are_inconclusive_never_a_pass(results, verdict):
    canary, stable = s.from_vectors(results)
    assert stable is None  # no stable_* keys: not read
    assert c.judge(ANALYSIS, c.Observation(canary=canary, stable=stable, canary_ready=True))[0] == verdict


def test_from_vectors_returns_canary_then_stable():
    results = {
        "canary_requests": vector("10"), "canary_errors": vector("1"), "canary_p99": vector("0.01"),
        "stable_requests": vector("90"), "stable_errors": vector("0"), "stable_p99": vector("0.02"),
    }  # fmt: skip
    assert s.from_vectors(results) == (c.VersionMetrics(10, 1, 10.0), c.VersionMetrics(90, 0, 20.0))


# -- histogram_quantile ----------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("q", "buckets", "expected"),
    [
        # 100 observations, all in (0.01, 0.1]: rank 99 is 99 % of the way through that bucket
        (0.99, hist(0, 0, 100, 100, 100), 0.01 + 0.09 * 0.99),
        (0.5, hist(0, 0, 100, 100, 100), 0.01 + 0.09 * 0.5),
        # in the first bucket: interpolated from 0
        (0.5, hist(10, 10, 10, 10, 10), 0.0005),
        # the rank lands exactly on a bucket's upper count: that bucket's bound
        (0.5, hist(0, 50, 100, 100, 100), 0.01),
        # in the +Inf bucket: the highest finite bound
        (0.99, hist(0, 0, 0, 90, 100), 1.0),
        (0.99, hist(0, 0, 0, 0, 5), 1.0),
        # no observations, no +Inf bucket, a single bucket: NaN
        (0.99, hist(0, 0, 0, 0, 0), math.nan),
        (0.99, hist(1, 2, 3, 4, bounds=(0.001, 0.01, 0.1, 1.0)), math.nan),
        (0.99, ((math.inf, 10.0),), math.nan),
        # buckets scraped apart may dip: made monotonic first, as Prometheus does
        (0.5, hist(0, 60, 50, 100, 100), 0.001 + 0.009 * 50 / 60),
        (math.nan, hist(0, 0, 100, 100, 100), math.nan),
        (1.5, hist(0, 0, 100, 100, 100), math.inf),
        (-0.5, hist(0, 0, 100, 100, 100), -math.inf),
        # a non-positive first bound answers itself
        (0.1, hist(10, 10, 10, 10, 10, bounds=(0.0, 0.01, 0.1, 1.0, math.inf)), 0.0),
    ],
)
def test_quantile_matches_histogram_quantile(q, buckets, expected):
    got = s.quantile(q, buckets)
    assert (math.isnan(expected) and math.isnan(got)) or got == pytest.approx(expected)


# -- scraped deltas --------------------------------------------------------------------------------

EXPOSITION = """\
# HELP sluice_request_duration_seconds End-to-end time of each answered request, errors included
# TYPE sluice_request_duration_seconds histogram
sluice_request_duration_seconds_bucket{le="0.001",model="resnet50",version="1"} 2.0
sluice_request_duration_seconds_bucket{le="0.01",model="resnet50",version="1"} 8.0
sluice_request_duration_seconds_bucket{le="+Inf",model="resnet50",version="1"} 10.0
sluice_request_duration_seconds_count{model="resnet50",version="1"} 10.0
sluice_request_duration_seconds_sum{model="resnet50",version="1"} 0.05
sluice_request_duration_seconds_bucket{le="0.001",model="resnet50",version="2"} 1.0
sluice_request_duration_seconds_bucket{le="0.01",model="resnet50",version="2"} 1.0
sluice_request_duration_seconds_bucket{le="+Inf",model="resnet50",version="2"} 5.0
sluice_request_duration_seconds_count{model="resnet50",version="2"} 5.0
sluice_request_duration_seconds_sum{model="resnet50",version="2"} 3.0
sluice_request_duration_seconds_bucket{le="0.001",model="other",version="1"} 7.0
sluice_request_duration_seconds_bucket{le="0.01",model="other",version="1"} 7.0
sluice_request_duration_seconds_bucket{le="+Inf",model="other",version="1"} 7.0
sluice_request_duration_seconds_count{model="other",version="1"} 7.0
sluice_request_duration_seconds_sum{model="other",version="1"} 0.001
# HELP sluice_request_server_failure_total Requests answered with a server-side error
# TYPE sluice_request_server_failure_total counter
sluice_request_server_failure_total{model="resnet50",version="1"} 1.0
sluice_request_server_failure_total{model="resnet50",version="2"} 2.0
sluice_request_server_failure_total{model="other",version="1"} 7.0
# HELP sluice_request_failure_total Requests answered with an error
# TYPE sluice_request_failure_total counter
sluice_request_failure_total{model="resnet50",version="1"} 100.0
"""


def test_parse_exposition_sums_the_models_versions_and_ignores_other_models():
    assert s.parse_exposition(EXPOSITION, "resnet50") == s.Counts(
        requests=15, errors=3, buckets=((0.001, 3.0), (0.01, 9.0), (math.inf, 15.0))
    )
    assert s.parse_exposition(EXPOSITION, "other") == s.Counts(7, 7, ((0.001, 7.0), (0.01, 7.0), (math.inf, 7.0)))
    assert s.parse_exposition(EXPOSITION, "absent") is None
    assert s.parse_exposition("", "resnet50") is None


def test_parse_exposition_without_an_error_series_counts_0_errors():
    text = "\n".join(line for line in EXPOSITION.splitlines() if "server_failure" not in line) + "\n"
    assert s.parse_exposition(text, "resnet50").errors == 0


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        pytest.param({"a": counts(100, 1)}, {"a": counts(150, 3)}, (50, 2), id="one-pod"),
        pytest.param({"a": counts(100), "b": counts(10)}, {"a": counts(130), "b": counts(40)}, (60, 0),
                     id="summed-over-pods"),
        pytest.param({"a": counts(100, 5)}, {"a": counts(20, 1)}, (20, 1), id="restarted: counts from zero"),
        pytest.param({"a": counts(100, 5)}, {"a": counts(120, 2)}, (120, 2),
                     id="any counter going down is a restart"),
        pytest.param({"a": counts(100)}, {"a": counts(110), "b": counts(30, 3)}, (40, 3),
                     id="a new pod counts from zero"),
        pytest.param({"a": counts(100), "b": counts(50)}, {"a": counts(110)}, (10, 0), id="a vanished pod drops out"),
        pytest.param({}, {"a": counts(7, 1)}, (7, 1), id="no pod before"),
        pytest.param({"a": counts(100)}, {"a": counts(100)}, (0, 0), id="idle"),
        pytest.param({"a": counts(100)}, {}, None, id="no pod after: no data"),
        pytest.param({}, {}, None, id="nothing"),
    ],
)
def test_delta_handles_resets_and_pods_coming_and_going(before, after, expected):
    got = s.delta(before, after)
    if expected is None:
        assert got is None and s.scraped(before, after) is None
    else:
        assert got is not None and (got.requests, got.errors) == expected
        assert got.buckets[-1] == (math.inf, expected[0])  # the buckets move with the count


def test_a_bucket_going_down_is_a_restart_too():
    before = {"a": s.Counts(100, 0, hist(50, 50, 100, 100, 100))}
    after = {"a": s.Counts(100, 0, hist(10, 60, 100, 100, 100))}  # same totals, a different pod's history
    assert s.delta(before, after) == after["a"]


def test_scraped_p99_comes_from_the_delta_histogram_not_the_lifetime_one():
    # 1000 fast requests before; then 100 requests, all in (0.1, 1.0]
    before = {"a": s.Counts(1000, 0, hist(1000, 1000, 1000, 1000, 1000))}
    after = {"a": s.Counts(1100, 4, hist(1000, 1000, 1000, 1100, 1100))}
    got = s.scraped(before, after)
    assert got == c.VersionMetrics(100, 4, pytest.approx((0.1 + 0.9 * 0.99) * 1000))
    # an idle interval: no latency (NaN), which the judge treats as missing
    idle = s.scraped(after, after)
    assert idle is not None and idle.requests == 0 and math.isnan(idle.p99_ms)
    verdict, _ = c.judge(c.Analysis(min_requests=0, max_p99_ms=100.0), c.Observation(canary=idle, canary_ready=True))
    assert verdict == c.INCONCLUSIVE


def scrape(at: float, unread: tuple[str, ...] = (), **pods: float) -> s.Scrape:
    return s.Scrape(at, {pod: counts(n) for pod, n in pods.items()}, frozenset(unread))


@pytest.mark.parametrize(
    ("history", "expected"),
    [
        pytest.param([scrape(100, a=10)], (None, 0.0), id="no-earlier-scrape"),
        pytest.param([], (None, 0.0), id="nothing"),
        pytest.param([scrape(40, a=10), scrape(100, a=70)], (60, 60.0), id="one-window-back"),
        # several earlier scrapes: the one nearest to 60 s back is the baseline
        pytest.param([scrape(20, a=0), scrape(41, a=5), scrape(70, a=40), scrape(100, a=70)], (65, 59.0),
                     id="nearest-to-the-window"),
        pytest.param([scrape(0, a=0), scrape(30, a=5), scrape(100, a=70)], (65, 70.0), id="nearest-may-be-later"),
        # right after an operator restart: what there is, and how long it covers
        pytest.param([scrape(85, a=50), scrape(100, a=70)], (20, 15.0), id="short-history"),
        # b was running but unreadable at the baseline: its first later reading stands in
        pytest.param([scrape(40, unread=("b",), a=10), scrape(70, a=20, b=100), scrape(100, a=70, b=130)],
                     (90, 60.0), id="unread-then-read"),
        # ... and without one it drops out rather than counting its whole life
        pytest.param([scrape(40, unread=("b",), a=10), scrape(100, a=70, b=1000)], (60, 60.0),
                     id="unread-dropped"),
        pytest.param([scrape(40, unread=("a",)), scrape(100, a=1000)], (None, 60.0), id="only-pod-unread"),
        # a pod that did not run at the baseline counts from zero
        pytest.param([scrape(40, a=10), scrape(100, a=70, b=30)], (90, 60.0), id="new-pod"),
        pytest.param([scrape(40, a=10), scrape(100)], (None, 60.0), id="no-pods-now"),
    ],
)
def test_over_window_picks_the_baseline_nearest_to_the_window(history, expected):
    counted, span = s.over_window(history, 60)
    assert ((counted.requests if counted else None), span) == expected
