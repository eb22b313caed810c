"""The canary analysis' I/O (``sluice.operator.sources``) against real HTTP servers on loopback: a stand-in
for Prometheus' query API where its failures are the point, stand-in runtime pods (each on its own
127.0.0.x address, the same metrics port, as pods are) serving exposition text the test controls, and
a gate webhook. The pods are listed through a small ``Api`` stub. The happy path against a real
Prometheus and real runtimes is ``test_prometheus_analysis.py``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from sluice.operator import canary as c
from sluice.operator import sources
from sluice.operator.reconcile import ApiError

TARGET = c.Target("models", "resnet", "resnet50", "resnet", "resnet-canary", window_s=60)


@contextlib.asynccontextmanager
async def http_server(handler: Callable[[web.Request], Any], hosts=("127.0.0.1",)) -> AsyncIterator[int]:
    """One aiohttp app listening on ``hosts`` at one port; yields the port."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    for _ in range(20):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = probe.getsockname()[1]
        try:
            for host in hosts:
                await web.TCPSite(runner, host, port).start()
            break
        except OSError:  # another process took the port on one of the addresses: try another
            await runner.cleanup()
            await runner.setup()
    else:
        raise AssertionError("no port free on every address")
    try:
        yield port
    finally:
        await runner.cleanup()


def logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "sluice.operator.sources"]


def vector(value: str) -> dict[str, Any]:
    return {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [1.0, value]}]}}


# -- PrometheusSource ------------------------------------------------------------------------------

async def test_prometheus_source_sends_the_promql_and_reads_both_tracks():
    asked: list[str] = []

    async def api(request: web.Request) -> web.Response:
        assert request.path == "/prom/api/v1/query"
        query = request.query["query"]
        asked.append(query)
        canary = "resnet-canary" in query
        if query.startswith("histogram_quantile"):
            return web.json_response(vector("0.025" if canary else "0.02"))
        if "server_failure" in query:
            return web.json_response(vector("3") if canary else {"status": "success",
                                                                  "data": {"resultType": "vector", "result": []}})
        return web.json_response(vector("120" if canary else "880"))

    async with http_server(api) as port:
        source = sources.PrometheusSource(f"http://127.0.0.1:{port}/prom/")
        try:
            canary, stable = await source.read(TARGET, now=0.0)
        finally:
            await source.aclose()
    assert sorted(asked) == sorted(sources.signals.promql(TARGET).values())
    assert canary == c.VersionMetrics(120, 3, 25.0)
    assert stable == c.VersionMetrics(880, 0, 20.0)  # no error series beside a requests series: 0 errors


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (lambda: web.json_response({"status": "error", "errorType": "bad_data", "error": "parse error"}, status=400),
         "HTTP 400 parse error"),
        (lambda: web.json_response({"status": "error", "error": "overloaded"}, status=503), "HTTP 503 overloaded"),
        (lambda: web.Response(text="<html>proxy says hi</html>"), "JSONDecodeError"),
        (lambda: web.json_response({"status": "success", "data": {"resultType": "matrix", "result": []}}),
         "got resultType 'matrix'"),
        (lambda: web.json_response({"status": "success", "data": {"resultType": "vector",
                                                                   "result": [{"metric": {}, "value": [1, "x"]}]}}),
         "of numbers, got resultType 'vector', result [{'metric': {}, 'value': [1, 'x']}]"),
    ],
)
async def test_prometheus_source_turns_bad_answers_into_no_data_logged_once(answer, why, caplog):
    async def api(request: web.Request) -> web.Response:
        return answer()

    caplog.set_level(logging.WARNING, logger="sluice.operator.sources")
    async with http_server(api) as port:
        source = sources.PrometheusSource(f"http://127.0.0.1:{port}")
        try:
            for _ in range(3):
                assert await source.read(TARGET, now=0.0) == (None, None)
        finally:
            await source.aclose()
    warnings = logged(caplog)
    assert len(warnings) == 1 and why in warnings[0], warnings


async def test_prometheus_source_times_out_and_survives_a_refused_connection(caplog):
    release = asyncio.Event()

    async def stuck(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response(vector("1"))

    caplog.set_level(logging.INFO, logger="sluice.operator.sources")
    async with http_server(stuck) as port:
        source = sources.PrometheusSource(f"http://127.0.0.1:{port}", timeout_s=0.2)
        try:
            assert await source.read(TARGET, now=0.0) == (None, None)
            release.set()
            canary, _ = await source.read(TARGET, now=1.0)
            assert canary is not None and canary.requests == 1
        finally:
            await source.aclose()
    refused = sources.PrometheusSource(f"http://127.0.0.1:{port}", timeout_s=1)
    try:
        assert await refused.read(TARGET, now=0.0) == (None, None)
    finally:
        await refused.aclose()
    messages = logged(caplog)
    assert "timed out" in messages[0]
    assert "answering again" in messages[1]
    assert "Connect" in messages[2]  # aiohttp's ClientConnectorError


# -- ScrapeSource ----------------------------------------------------------------------------------

def exposition(requests: float, errors: float, le_0_1: float, model: str = "resnet50") -> str:
    """A runtime's exposition for one model: ``le_0_1`` of ``requests`` took at most 0.1 s, the rest at most 1 s."""
    labels = f'model="{model}",version="1"'
    return (
        "# TYPE sluice_request_duration_seconds histogram\n"
        f'sluice_request_duration_seconds_bucket{{le="0.1",{labels}}} {le_0_1}\n'
        f'sluice_request_duration_seconds_bucket{{le="1.0",{labels}}} {requests}\n'
        f'sluice_request_duration_seconds_bucket{{le="+Inf",{labels}}} {requests}\n'
        f"sluice_request_duration_seconds_count{{{labels}}} {requests}\n"
        f"sluice_request_duration_seconds_sum{{{labels}}} 1.0\n"
        "# TYPE sluice_request_server_failure_total counter\n"
        f"sluice_request_server_failure_total{{{labels}}} {errors}\n"
    )


class Pods:
    """The ``Api`` stub: ``list("Pod", ns)`` answers the pods the test set (or raises what it set)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.error: Exception | None = None

    def add(self, name: str, ip: str, instance: str, *, phase: str = "Running", model: str = "resnet") -> None:
        self.items.append({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "models", "uid": f"uid-{name}",
                         "labels": {"app.kubernetes.io/instance": instance, "sluice.dev/inferencemodel": model,
                                    "app.kubernetes.io/name": "sluice-runtime"}},
            "status": {"phase": phase, "podIP": ip},
        })  # fmt: skip

    async def list(self, kind: str, namespace: str) -> list[dict[str, Any]]:
        assert (kind, namespace) == ("Pod", "models")
        if self.error is not None:
            raise self.error
        return [p for p in self.items if p["metadata"]["namespace"] == namespace]

    async def apply(self, obj: Any) -> dict[str, Any]:
        raise AssertionError("the scraper only lists pods")

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        raise AssertionError("the scraper only lists pods")

    async def delete(self, kind: str, namespace: str, name: str, *, uid: str | None = None) -> bool:
        raise AssertionError("the scraper only lists pods")

    async def patch_status(self, kind: str, namespace: str, name: str, status: Any) -> dict[str, Any] | None:
        raise AssertionError("the scraper only lists pods")


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[dict[str, str | int], int]]:
    """Stand-in runtime pods on 127.0.0.2..6, one metrics port: ``texts[ip]`` is what that pod
    answers (an int: that HTTP status)."""
    texts: dict[str, str | int] = {}

    async def metrics(request: web.Request) -> web.Response:
        assert request.path == "/metrics"
        body = texts.get(request.host.rsplit(":", 1)[0], 404)
        if isinstance(body, int):
            return web.Response(status=body)
        return web.Response(text=body, content_type="text/plain")

    hosts = tuple(f"127.0.0.{n}" for n in range(2, 7))
    async with http_server(metrics, hosts) as port:
        yield texts, port


async def test_scrape_source_needs_a_baseline_then_answers_the_delta_per_track(fleet, caplog):
    texts, port = fleet
    pods = Pods()
    pods.add("stable-a", "127.0.0.2", "resnet")
    pods.add("stable-b", "127.0.0.3", "resnet")
    pods.add("canary-a", "127.0.0.4", "resnet-canary")
    pods.add("pending", "127.0.0.5", "resnet-canary", phase="Pending")  # not Running: not read
    pods.add("other-model", "127.0.0.6", "resnet-canary", model="other")  # another InferenceModel's label
    texts.update({
        "127.0.0.2": exposition(1000, 1, 1000), "127.0.0.3": exposition(500, 0, 500),
        "127.0.0.4": exposition(10, 0, 10), "127.0.0.5": exposition(10**6, 10**6, 0),
        "127.0.0.6": exposition(10**6, 10**6, 0),
    })  # fmt: skip
    caplog.set_level(logging.INFO, logger="sluice.operator.sources")
    source = sources.ScrapeSource(pods, port)
    try:
        with pytest.raises(c.NoBaseline):  # nothing to subtract from yet: the caller restarts its interval
            await source.read(TARGET, now=100.0)
        assert "no baseline yet" in logged(caplog)[-1]
        texts.update({
            "127.0.0.2": exposition(1100, 2, 1100), "127.0.0.3": exposition(600, 0, 600),
            "127.0.0.4": exposition(110, 5, 11),
            "127.0.0.5": exposition(2 * 10**6, 2 * 10**6, 0), "127.0.0.6": exposition(2 * 10**6, 2 * 10**6, 0),
        })  # fmt: skip
        canary, stable = await source.read(TARGET, now=160.0)
    finally:
        await source.aclose()
    assert stable == c.VersionMetrics(200, 1, pytest.approx(99.0))  # all 200 within 0.1 s: rank 198 of 200
    # 100 canary requests, 1 of them fast, 99 in (0.1, 1]: the 99th is 98/99 of the way through that bucket
    assert canary == c.VersionMetrics(100, 5, pytest.approx((0.1 + 0.9 * 98 / 99) * 1000))


async def test_scrape_source_restarted_vanished_and_unreadable_pods(fleet, caplog):
    texts, port = fleet
    pods = Pods()
    pods.add("canary-a", "127.0.0.2", "resnet-canary")
    pods.add("canary-b", "127.0.0.3", "resnet-canary")
    pods.add("canary-c", "127.0.0.4", "resnet-canary")
    pods.add("stable-a", "127.0.0.5", "resnet")
    texts.update({
        "127.0.0.2": exposition(500, 5, 500), "127.0.0.3": exposition(300, 0, 300), "127.0.0.4": 500,
        "127.0.0.5": exposition(0, 0, 0),
    })  # fmt: skip
    caplog.set_level(logging.INFO, logger="sluice.operator.sources")
    source = sources.ScrapeSource(pods, port, timeout_s=1)
    try:
        with pytest.raises(c.NoBaseline):  # a first reading: nothing to count from
            await source.read(TARGET, now=0.0)
        # a restarted (counters back near 0), b gone, c now readable (unknown baseline: left out), d new
        texts.update({"127.0.0.2": exposition(40, 1, 40), "127.0.0.4": exposition(10**6, 0, 10**6),
                      "127.0.0.6": exposition(25, 2, 25)})  # fmt: skip
        pods.items = [p for p in pods.items if p["metadata"]["name"] != "canary-b"]
        pods.add("canary-d", "127.0.0.6", "resnet-canary")
        canary, _ = await source.read(TARGET, now=60.0)
        assert (canary.requests, canary.errors) == (40 + 25, 1 + 2)
        # next window: c has a baseline now and counts
        texts.update({"127.0.0.2": exposition(50, 1, 50), "127.0.0.4": exposition(10**6 + 7, 0, 10**6 + 7),
                      "127.0.0.6": exposition(25, 2, 25)})  # fmt: skip
        canary, stable = await source.read(TARGET, now=120.0)
        assert (canary.requests, canary.errors) == (10 + 7, 0)
        assert stable.requests == 0 and math.isnan(stable.p99_ms)  # idle: no latency to judge
    finally:
        await source.aclose()
    assert any("uid-canary-c" in m and "HTTP 500" in m for m in logged(caplog))


async def test_scrape_source_answers_over_a_short_history_and_says_so(fleet, caplog):
    texts, port = fleet
    pods = Pods()
    pods.add("canary-a", "127.0.0.2", "resnet-canary")
    texts["127.0.0.2"] = exposition(0, 0, 0)
    caplog.set_level(logging.INFO, logger="sluice.operator.sources")
    source = sources.ScrapeSource(pods, port)
    try:
        with pytest.raises(c.NoBaseline):  # a first reading: nothing to count from
            await source.read(TARGET, now=0.0)
        texts["127.0.0.2"] = exposition(30, 0, 30)
        canary, stable = await source.read(TARGET, now=20.0)  # an operator that started 20 s ago
        assert canary.requests == 30 and stable is None  # no stable pods at all: no stable data
        assert "covers 20 s of the 60 s window" in logged(caplog)[-1]
        # many reads within a window: the baseline is the read nearest to one window back
        for now, total in ((40.0, 60), (60.0, 90), (80.0, 120), (100.0, 150)):
            texts["127.0.0.2"] = exposition(total, 0, total)
            canary, _ = await source.read(TARGET, now=now)
        assert canary.requests == 150 - 60  # from the read at 40 s
    finally:
        await source.aclose()


async def test_a_long_window_read_often_is_judged_over_all_of_it(fleet):
    """An hour's interval read every 15 s (each pass of the reconciler reads) keeps 240 reads' worth
    of window in its 64-read history: the reads are thinned over the window, and the baseline stays an
    hour back (the oldest were dropped, so only the last 16 minutes were judged)."""
    texts, port = fleet
    pods = Pods()
    pods.add("canary-a", "127.0.0.2", "resnet-canary")
    window = dataclasses.replace(TARGET, window_s=3600.0)
    source = sources.ScrapeSource(pods, port)
    try:
        canary = None
        for tick in range(241):  # one request a second since 0
            texts["127.0.0.2"] = exposition(15 * tick, 0, 15 * tick)
            try:
                canary, _ = await source.read(window, now=15.0 * tick)
            except c.NoBaseline:
                assert tick == 0
    finally:
        await source.aclose()
    assert canary is not None and canary.requests == 3600


@pytest.mark.parametrize("error", [ApiError(403, "Forbidden", "pods is forbidden"), aiohttp.ClientConnectionError()])
async def test_scrape_source_without_a_pod_list_has_no_data(fleet, error):
    texts, port = fleet
    pods = Pods()
    pods.add("canary-a", "127.0.0.2", "resnet-canary")
    texts["127.0.0.2"] = exposition(0, 0, 0)
    source = sources.ScrapeSource(pods, port)
    try:
        with pytest.raises(c.NoBaseline):  # a first reading: nothing to count from
            await source.read(TARGET, now=0.0)
        pods.error = error
        assert await source.read(TARGET, now=60.0) == (None, None)
    finally:
        await source.aclose()


# -- GateClient ------------------------------------------------------------------------------------

async def test_gate_client_is_yes_only_for_2xx(caplog):
    seen: list[dict[str, Any]] = []
    release = asyncio.Event()

    async def gate(request: web.Request) -> web.Response:
        if request.method == "POST":
            seen.append(await request.json())
        if request.path == "/slow":
            await release.wait()
        status = int(request.path.strip("/")) if request.path != "/slow" else 200
        headers = {"Location": "/200"} if status == 302 else {}
        return web.Response(status=status, text="not during the freeze" if status == 403 else "", headers=headers)

    caplog.set_level(logging.WARNING, logger="sluice.operator.sources")
    client = sources.GateClient(timeout_s=0.3)
    try:
        async with http_server(gate) as port:
            base = f"http://127.0.0.1:{port}"
            payload = {"name": "resnet", "namespace": "models", "phase": "Progressing", "purpose": "step"}
            assert await client.ask(f"{base}/200", payload) is True
            assert await client.ask(f"{base}/204", payload) is True
            assert await client.ask(f"{base}/403", payload) is False
            assert await client.ask(f"{base}/500", payload) is False
            assert await client.ask(f"{base}/302", payload) is False  # a redirect is not a yes
            assert await client.ask(f"{base}/slow", payload) is False
            release.set()
            assert await client.ask(None, payload) is None
        assert await client.ask(f"{base}/200", payload) is False  # nobody listens any more
    finally:
        await client.aclose()
    assert seen[0] == payload
    messages = " | ".join(logged(caplog))
    assert "HTTP 403 not during the freeze" in messages and "HTTP 500" in messages
    assert "timed out" in messages and "no answer" in messages
