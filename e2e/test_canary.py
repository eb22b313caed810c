"""Canary rollouts end to end: the real kopf operator against the emulator, a fake clock and an
injected metrics source and gate webhook (what a cluster would read from Prometheus or the pods).

Each scenario applies an InferenceModel with ``spec.canary`` and drives time forward interval by
interval; the assertions read only what a user sees: the children in the API, ``status.canary``,
``status.trafficSummary`` and the Events. ``-s`` prints each rollout's timeline (fake seconds, phase,
weight, why).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp.web
import kmock
import kopf
import pytest

from sluice.operator.canary import NoBaseline, VersionMetrics
from sluice.operator.crd import all_crds
from sluice.operator.settings import Settings
from sluice.operator.sources import GateClient
from sluice_testing import ApiServer, Cluster, FakeClock, OperatorHarness

NAMESPACE = "e2e"
MODEL: dict[str, Any] = {
    "apiVersion": "sluice.dev/v1alpha1", "kind": "InferenceModel", "metadata": {"name": "clf"},
    "spec": {
        "model": {"storageUri": "s3://models/clf/v1", "format": "onnx", "version": 1},
        "scaling": {"minReplicas": 1, "maxReplicas": 1},
        "canary": {
            "storageUri": "s3://models/clf/v2", "version": 2,
            "analysis": {"stepWeights": [5, 25, 50, 100], "intervalSeconds": 60, "minRequests": 100,
                         "maxErrorRatePercent": 1, "maxLatencyP99Milliseconds": 250},
        },
    },
}
HEALTHY = VersionMetrics(requests=600, errors=1, p99_ms=42.0)
STABLE = VersionMetrics(requests=6000, errors=6, p99_ms=40.0)
FAILING = VersionMetrics(requests=600, errors=60, p99_ms=45.0)


class Metrics:
    """The metrics source the operator reads: whatever the test says the pods report now."""

    def __init__(self) -> None:
        self.canary: VersionMetrics | None = None
        self.stable: VersionMetrics | None = STABLE
        self.targets: list[Any] = []
        self.forgotten: list[tuple[str, str]] = []

    async def read(self, target: Any, now: float) -> tuple[VersionMetrics | None, VersionMetrics | None]:
        self.targets.append(target)
        if self.no_baseline_from is not None and now >= self.no_baseline_from:
            self.no_baseline_from = None  # as the scraping source's first reading, once the operator started
            raise NoBaseline("first scrape")
        return self.canary, self.stable

    no_baseline_from: float | None = None

    def forget(self, namespace: str, name: str) -> None:  # as ScrapeSource: readings of a deleted model go
        self.forgotten.append((namespace, name))


class Gate:
    """A gate webhook: answers ``answer`` (True: 2xx, False: another status, None: unreachable)."""

    def __init__(self) -> None:
        self.answer: bool | None = True
        self.asked: list[tuple[str, dict[str, Any]]] = []

    async def __call__(self, url: str, payload: Mapping[str, Any]) -> bool | None:
        self.asked.append((url, dict(payload)))
        return self.answer


@dataclasses.dataclass
class Env:
    server: ApiServer
    cluster: Cluster
    clock: FakeClock
    metrics: Metrics
    gate: Gate
    timeline: list[str] = dataclasses.field(default_factory=list)

    async def canary(self) -> dict[str, Any]:
        model = await self.cluster.get("InferenceModel", "clf")
        return ((model or {}).get("status") or {}).get("canary") or {}

    async def until(self, what: str, **expected: Any) -> dict[str, Any]:
        """Wait until status.canary has every ``expected`` field value; log the timeline."""
        async def check() -> dict[str, Any] | None:
            status = await self.canary()
            return status if all(status.get(k) == v for k, v in expected.items()) else None
        status = await self.cluster.wait(check, what)
        model = await self.cluster.get("InferenceModel", "clf")
        elapsed = (self.clock.now - FakeClock().now).total_seconds()
        self.timeline.append(f"t={elapsed:>5.0f}s {status.get('phase', ''):<12} weight={status.get('weight', 0):>3}% "
                             f"traffic={model['status'].get('trafficSummary', '')}: {status.get('message', '')}")
        return status

    async def tick(self, seconds: float = 60) -> None:
        """One interval passes (the operator's resync timer then reconciles on the fake clock)."""
        self.clock.advance(seconds)

    def events(self) -> list[dict[str, Any]]:
        return [obj.raw for (resource, _, _), obj in self.server.objects.items()
                if resource.plural == "events" and not obj.deleted]

    async def event(self, reason: str) -> dict[str, Any]:
        async def check() -> dict[str, Any] | None:
            return next((e for e in self.events() if e.get("reason") == reason), None)
        return await self.cluster.wait(check, f"an Event {reason}")

    async def split(self) -> dict[str, Any] | None:
        import json
        cm = await self.cluster.get("ConfigMap", "clf-split")
        return json.loads(cm["data"]["split.json"])["models"]["clf"] if cm else None


def _crd(group: str, version: str, kind: str, plural: str) -> dict[str, Any]:
    """A third-party CRD as the emulator needs it (discovery and storage; the schemas are checked elsewhere)."""
    return {"spec": {"group": group, "scope": "Namespaced",
                     "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
                     "versions": [{"name": version, "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                         "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}


GATEWAY_API = [_crd("gateway.networking.k8s.io", "v1", "HTTPRoute", "httproutes"),
               _crd("gateway.networking.k8s.io", "v1", "GRPCRoute", "grpcroutes")]
ISTIO = [_crd("networking.istio.io", "v1beta1", "VirtualService", "virtualservices")]


@contextlib.asynccontextmanager
async def environment(*, router: str = "none", crds: list[dict[str, Any]] | None = None,
                      clock: FakeClock | None = None, metrics: Metrics | None = None,
                      server: ApiServer | None = None, gate: Any = None) -> AsyncIterator[Env]:
    async with contextlib.AsyncExitStack() as stack:
        if server is None:
            server = await stack.enter_async_context(ApiServer(simulate_rollouts=True))
            await stack.enter_async_context(kmock.Server(server))
            for definition in [*all_crds(), *(crds or [])]:
                server.register_crd(copy.deepcopy(definition))
        info = kopf.ConnectionInfo(server=str(server.url).rstrip("/"), insecure=True)
        # A short resync: each tick of the fake clock is seen within a fraction of a real second.
        settings = Settings(resync_seconds=0.1, router=router)
        env = Env(server, Cluster(info, NAMESPACE, timeout=15), clock or FakeClock(), metrics or Metrics(), Gate())
        stack.push_async_callback(env.cluster.session.close)
        await stack.enter_async_context(OperatorHarness(settings=settings, connection=info, clock=env.clock,
                                                        metrics=env.metrics, gate=gate or env.gate))
        try:
            yield env
        finally:
            print("\n" + "\n".join(env.timeline))


def _model(**analysis: Any) -> dict[str, Any]:
    model = copy.deepcopy(MODEL)
    model["spec"]["canary"]["analysis"].update(analysis)
    return model


async def _stable_template(env: Env) -> dict[str, Any]:
    deployment = await env.cluster.get("Deployment", "clf")
    return deployment["spec"]["template"]


async def test_a_healthy_canary_goes_5_25_50_100_and_is_promoted():
    async with environment() as env:
        env.metrics.canary = HEALTHY
        await env.cluster.apply(MODEL)
        status = await env.until("the first step", phase="Progressing", weight=5)
        candidate = status["candidate"]
        assert candidate.startswith("v2-")
        assert await env.split() == {"target": f"clf-canary.{NAMESPACE}.svc.cluster.local:8001", "percent": 5}
        canary = await env.cluster.get("Deployment", "clf-canary")
        assert canary["metadata"]["annotations"]["sluice.dev/candidate"] == candidate
        assert "s3://models/clf/v2" in str(canary["spec"]["template"]["spec"]["initContainers"])
        assert canary["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == "clf-canary"
        assert (await env.cluster.get("Service", "clf-canary"))["spec"]["selector"]["app.kubernetes.io/instance"] \
            == "clf-canary"
        stable = await env.cluster.get("Service", "clf")
        assert stable["spec"]["selector"]["app.kubernetes.io/instance"] == "clf"  # never selects canary pods
        model = await env.cluster.get("InferenceModel", "clf")
        assert model["status"]["trafficSummary"] == "v1=95,v2=5"
        stable_deployment = await env.cluster.get("Deployment", "clf")
        assert model["status"]["selector"] == "app.kubernetes.io/instance=clf,sluice.dev/inferencemodel=clf"
        assert model["status"]["readyReplicas"] == stable_deployment["status"]["readyReplicas"]
        assert model["status"]["canary"]["summary"] == "Progressing 1/4"
        target = env.metrics.targets[-1]
        assert (target.canary_instance, target.stable_instance, target.model, target.window_s) == \
            ("clf-canary", "clf", "clf", 60.0)

        for weight in (25, 50, 100):
            await env.tick()
            await env.until(f"the step to {weight}%", phase="Progressing", weight=weight)
            assert (await env.split())["percent"] == weight
        model = await env.cluster.get("InferenceModel", "clf")
        assert model["status"]["canary"]["lastMetrics"]["canary"] == {
            "requests": 600, "errors": 1, "errorRatePercent": 0.167, "p99Milliseconds": 42.0}
        assert model["status"]["canary"]["lastResult"] == "Successful"

        await env.tick()
        status = await env.until("promotion", phase="Succeeded")
        assert status["weight"] == 0
        stable = await env.cluster.get("Deployment", "clf")
        assert stable["metadata"]["annotations"]["sluice.dev/candidate"] == candidate
        assert "s3://models/clf/v2" in str(stable["spec"]["template"]["spec"]["initContainers"])
        for kind, name in [("Deployment", "clf-canary"), ("Service", "clf-canary"),
                           ("ConfigMap", "clf-canary-config"), ("ConfigMap", "clf-split")]:
            await env.cluster.wait(lambda k=kind, n=name: _gone(env, k, n), f"{kind} {name} is removed")
        model = await env.cluster.get("InferenceModel", "clf")
        assert model["status"]["trafficSummary"] == "v2=100"
        assert "Copy spec.canary" in model["status"]["canary"]["help"]
        reasons = [e["reason"] for e in env.events()]
        for reason in ("CanaryStarted", "CanaryWeight", "CanaryPromoting", "CanaryPromoted"):
            await env.event(reason)
        assert "CanaryRolledBack" not in reasons

        # GitOps finishes it: spec.model takes the canary's values and spec.canary goes. Nothing rolls.
        template = await _stable_template(env)
        done = copy.deepcopy(MODEL)
        done["spec"]["model"] = {"storageUri": "s3://models/clf/v2", "format": "onnx", "version": 2}
        del done["spec"]["canary"]
        await env.cluster.apply(done)

        async def settled() -> bool:
            model = await env.cluster.get("InferenceModel", "clf")
            return model["status"].get("observedGeneration") == model["metadata"]["generation"]
        await env.cluster.wait(settled, "the finished spec is reconciled")
        assert await _stable_template(env) == template
        model = await env.cluster.get("InferenceModel", "clf")
        assert not model["status"]["canary"].get("help")  # "Copy spec.canary ..." would say to copy what is gone


async def _gone(env: Env, kind: str, name: str) -> bool:
    return await env.cluster.get(kind, name) is None


async def test_a_next_candidate_waits_until_the_promoted_one_is_in_spec_model():
    """Promoted v2, then spec.canary pointed at v3 with spec.model still v1: the stable pods would roll
    back to v1 and v3 be compared with it. The operator refuses (Degraded, naming what to copy) and
    changes nothing; with v2 folded into spec.model in the same change, v3 starts beside v2."""
    async with environment() as env:
        env.metrics.canary = HEALTHY
        await env.cluster.apply(MODEL)
        await env.until("the first step", phase="Progressing", weight=5)
        for weight in (25, 50, 100):
            await env.tick()
            await env.until(f"the step to {weight}%", phase="Progressing", weight=weight)
        await env.tick()
        status = await env.until("promotion", phase="Succeeded")
        promoted = status["candidate"]
        template = await _stable_template(env)
        assert "s3://models/clf/v2" in str(template["spec"]["initContainers"])

        unfolded = copy.deepcopy(MODEL)
        unfolded["spec"]["canary"].update({"storageUri": "s3://models/clf/v3", "version": 3})
        await env.cluster.apply(unfolded)

        async def refused() -> dict[str, Any] | None:
            model = await env.cluster.get("InferenceModel", "clf")
            degraded = env.cluster.condition(model, "Degraded")
            return degraded if degraded.get("status") == "True" else None
        degraded = await env.cluster.wait(refused, "the next candidate is refused")
        assert degraded["reason"] == "InvalidSpec"
        assert f"the promoted candidate {promoted} is not in spec.model yet" in degraded["message"]
        assert "copy the promoted storageUri, version and config" in degraded["message"]
        await env.tick()
        assert await _stable_template(env) == template  # the stable pods still serve v2
        assert await env.cluster.get("Deployment", "clf-canary") is None
        model = await env.cluster.get("InferenceModel", "clf")
        assert (model["status"]["canary"]["phase"], model["status"]["canary"]["candidate"]) == ("Succeeded", promoted)

        folded = copy.deepcopy(unfolded)
        folded["spec"]["model"] = {"storageUri": "s3://models/clf/v2", "format": "onnx", "version": 2}
        await env.cluster.apply(folded)
        status = await env.until("v3's first step", phase="Progressing", weight=5)
        assert status["candidate"].startswith("v3-")
        assert "s3://models/clf/v2" in str((await _stable_template(env))["spec"]["initContainers"])
        canary = await env.cluster.get("Deployment", "clf-canary")
        assert "s3://models/clf/v3" in str(canary["spec"]["template"]["spec"]["initContainers"])


async def test_an_error_rate_breach_rolls_back_within_one_interval_and_is_not_retried():
    async with environment() as env:
        env.metrics.canary = HEALTHY
        await env.cluster.apply(MODEL)
        await env.until("the first step", phase="Progressing", weight=5)
        await env.tick()
        await env.until("the second step", phase="Progressing", weight=25)
        template = await _stable_template(env)
        env.metrics.canary = FAILING
        await env.tick()
        status = await env.until("the rollback", phase="RolledBack")
        assert status["weight"] == 0
        assert status["failedCandidate"] == status["candidate"]
        assert "error rate 10.00% is over 1.00%" in status["message"]
        assert status["lastMetrics"]["canary"]["errorRatePercent"] == 10.0
        event = await env.event("CanaryRolledBack")
        assert event["type"] == "Warning"
        for kind, name in [("Deployment", "clf-canary"), ("Service", "clf-canary"), ("ConfigMap", "clf-split")]:
            await env.cluster.wait(lambda k=kind, n=name: _gone(env, k, n), f"{kind} {name} is removed")
        assert await _stable_template(env) == template  # stable never ran the candidate
        model = await env.cluster.get("InferenceModel", "clf")
        assert model["status"]["trafficSummary"] == "v1=100"

        # The same candidate is not tried again, however long we wait ...
        env.metrics.canary = HEALTHY
        for _ in range(3):
            await env.tick()
        await env.cluster.wait(lambda: _settled(env), "nothing changes")
        assert await env.cluster.get("Deployment", "clf-canary") is None
        # ... until the spec names another candidate.
        retry = copy.deepcopy(MODEL)
        retry["spec"]["canary"]["storageUri"] = "s3://models/clf/v2-fixed"
        await env.cluster.apply(retry)
        status = await env.until("the new candidate's first step", phase="Progressing", weight=5)
        assert status["failedCandidate"] != status["candidate"]


async def _settled(env: Env) -> bool:
    model = await env.cluster.get("InferenceModel", "clf")
    return bool(model) and model["status"].get("observedGeneration") == model["metadata"]["generation"]


async def test_a_latency_ratio_at_100_percent_compares_with_the_last_stable_p99():
    # At the last step stable serves nothing, so it has no p99 of its own this interval: the canary is
    # compared with the stable p99 of the interval before (40 ms), not left Inconclusive forever.
    async with environment() as env:
        env.metrics.canary = HEALTHY
        await env.cluster.apply(_model(stepWeights=[50, 100], maxLatencyP99RatioToStable=1.5,
                                       inconclusiveLimit=0))
        await env.until("the first step", phase="Progressing", weight=50)
        await env.tick()
        await env.until("the last step", phase="Progressing", weight=100)
        env.metrics.stable = VersionMetrics(requests=0, errors=0, p99_ms=float("nan"))
        env.metrics.canary = VersionMetrics(requests=600, errors=0, p99_ms=55.0)  # 1.375x the last 40 ms
        await env.tick()
        status = await env.until("promotion", phase="Succeeded")
        assert status["lastMetrics"]["stable"]["p99Milliseconds"] == 40.0


async def test_a_latency_ratio_breach_at_100_percent_rolls_back():
    async with environment() as env:
        env.metrics.canary = HEALTHY
        await env.cluster.apply(_model(stepWeights=[50, 100], maxLatencyP99RatioToStable=1.5))
        await env.until("the first step", phase="Progressing", weight=50)
        await env.tick()
        await env.until("the last step", phase="Progressing", weight=100)
        env.metrics.stable = None  # nothing to read for stable at all
        env.metrics.canary = VersionMetrics(requests=600, errors=0, p99_ms=75.0)
        await env.tick()
        status = await env.until("the rollback", phase="RolledBack")
        assert "over 1.5x the stable p99 40 ms" in status["message"]


async def test_no_data_is_inconclusive_never_a_pass_and_rolls_back_after_the_limit():
    async with environment() as env:
        env.metrics.canary = None  # a metrics outage
        await env.cluster.apply(_model(inconclusiveLimit=2))
        await env.until("the first step", phase="Progressing", weight=5)
        for count in (1, 2):
            await env.tick()
            status = await env.until(f"inconclusive interval {count}", inconclusives=count)
            assert status["weight"] == 5 and status["lastResult"] == "Inconclusive"
            assert "no canary metrics could be read" in status["message"]
        env.metrics.canary = VersionMetrics(requests=20, errors=0, p99_ms=30.0)  # fewer than minRequests
        await env.tick()
        status = await env.until("the rollback", phase="RolledBack")
        assert "3 inconclusive intervals, over inconclusiveLimit 2" in status["message"]
        assert "fewer than minRequests 100" in status["message"]


async def test_a_source_without_a_baseline_restarts_the_interval_instead_of_judging_it():
    """A scraping operator that restarted mid-interval reads no delta at first: with inconclusiveLimit 0
    that would roll a healthy canary back; the interval starts again instead, uncounted."""
    async with environment() as env:
        env.metrics.canary = HEALTHY
        await env.cluster.apply(_model(inconclusiveLimit=0))
        await env.until("the first step", phase="Progressing", weight=5)
        # the operator restarted after the interval ended: its first reading is the judging one
        env.metrics.no_baseline_from = env.clock.now.timestamp() + 60
        await env.tick()
        status = await env.until("the interval restarted", phase="Progressing", weight=5, inconclusives=0,
                                 message="analysing at 5%: the metrics source had no baseline (the operator "
                                         "started since the interval began); the interval starts again")
        assert status["failures"] == 0 and env.metrics.no_baseline_from is None
        await env.tick()
        await env.until("the next step", phase="Progressing", weight=25)


async def test_a_deleted_model_s_metrics_readings_are_forgotten():
    async with environment() as env:
        env.metrics.canary = HEALTHY
        await env.cluster.apply(MODEL)
        await env.until("the first step", phase="Progressing", weight=5)
        await env.cluster.delete("InferenceModel", "clf")

        async def forgotten() -> bool | None:
            return (NAMESPACE, "clf") in env.metrics.forgotten or None

        await env.cluster.wait(forgotten, "the source told to forget the model")


async def test_a_gate_that_says_no_holds_the_step_and_a_yes_moves_it():
    async with environment() as env:
        env.metrics.canary = HEALTHY
        env.gate.answer = False
        gated = _model(gates={"url": "https://gate.example/approve", "beforeStep": True})
        await env.cluster.apply(gated)
        status = await env.until("held by the gate", phase="Initializing", gate=(
            "did not approve (not a 2xx, a timeout or unreachable; the operator log says which)"))
        assert "the gate has not approved 5%" in status["message"]
        url, payload = env.gate.asked[-1]
        assert url == "https://gate.example/approve"
        assert payload["purpose"] == "step" and payload["name"] == "clf" and payload["namespace"] == NAMESPACE
        assert await env.split() == {"target": f"clf-canary.{NAMESPACE}.svc.cluster.local:8001", "percent": 0}
        env.gate.answer = True
        status = await env.until("the first step once approved", phase="Progressing", weight=5)
        assert "gate" not in status  # the hold's reason goes with the hold (a nested key: written as null)
        env.gate.answer = None  # unreachable: holds too, and says so
        await env.tick()
        status = await env.until("held again", gate="could not be asked")
        assert status["weight"] == 5 and status["phase"] == "Progressing"


async def test_a_real_gate_webhook_holds_promotion_until_it_answers_2xx():
    # The operator's own GateClient against an HTTP server on loopback: 403 holds, 200 promotes.
    answers = [403]
    payloads: list[dict[str, Any]] = []

    async def approve(request: aiohttp.web.Request) -> aiohttp.web.Response:
        payloads.append(await request.json())
        return aiohttp.web.Response(status=answers[-1])

    app = aiohttp.web.Application()
    app.router.add_post("/approve", approve)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = GateClient(timeout_s=5)
    try:
        async with environment(gate=client.ask) as env:
            env.metrics.canary = HEALTHY
            await env.cluster.apply(_model(stepWeights=[50], gates={"url": f"http://127.0.0.1:{port}/approve",
                                                                    "beforePromotion": True}))
            await env.until("the only step", phase="Progressing", weight=50)
            await env.tick()
            status = await env.until("held before promotion", phase="Progressing", weight=50, gate=(
                "did not approve (not a 2xx, a timeout or unreachable; the operator log says which)"))
            assert "waiting for the gate to approve promotion" in status["message"]
            assert payloads[-1]["purpose"] == "promotion" and payloads[-1]["name"] == "clf"
            answers.append(200)
            await env.until("promotion once approved", phase="Succeeded")
    finally:
        await client.aclose()
        await runner.cleanup()


async def test_a_new_candidate_mid_rollout_restarts_without_stale_objects():
    async with environment() as env:
        env.metrics.canary = HEALTHY
        await env.cluster.apply(MODEL)
        await env.until("the first step", phase="Progressing", weight=5)
        await env.tick()
        first = await env.until("the second step", phase="Progressing", weight=25)
        second = copy.deepcopy(MODEL)
        second["spec"]["canary"].update({"storageUri": "s3://models/clf/v3", "version": 3})
        await env.cluster.apply(second)
        status = await env.until("the new candidate's first step", phase="Progressing", weight=5, step=0)
        assert status["candidate"].startswith("v3-") and status["candidate"] != first["candidate"]
        canary = await env.cluster.get("Deployment", "clf-canary")
        assert canary["metadata"]["annotations"]["sluice.dev/candidate"] == status["candidate"]
        assert "s3://models/clf/v3" in str(canary["spec"]["template"]["spec"]["initContainers"])
        await env.event("CanaryStarted")
        started = [e["message"] for e in env.events() if e.get("reason") == "CanaryStarted"]
        assert any(f"replaces {first['candidate']}" in m for m in started)


async def test_an_operator_restart_resumes_from_status_alone():
    clock, metrics = FakeClock(), Metrics()
    metrics.canary = HEALTHY
    async with ApiServer(simulate_rollouts=True) as server, kmock.Server(server):
        for definition in all_crds():
            server.register_crd(copy.deepcopy(definition))
        async with environment(clock=clock, metrics=metrics, server=server) as env:
            await env.cluster.apply(MODEL)
            await env.until("the first step", phase="Progressing", weight=5)
            await env.tick()
            before = await env.until("the second step", phase="Progressing", weight=25)
        clock.advance(30)  # half an interval passes with no operator running
        async with environment(clock=clock, metrics=metrics, server=server) as env:
            # The new process knows only the status: the same step, the same interval start.
            await env.cluster.wait(lambda: _settled(env), "the new operator reconciled")
            status = await env.canary()
            assert (status["step"], status["weight"], status["intervalStarted"]) == \
                (before["step"], before["weight"], before["intervalStarted"])
            await env.tick(30)  # the rest of the interval
            await env.until("the third step", phase="Progressing", weight=50)


async def test_removing_spec_canary_aborts_and_takes_the_canary_down():
    async with environment() as env:
        env.metrics.canary = HEALTHY
        await env.cluster.apply(MODEL)
        await env.until("the first step", phase="Progressing", weight=5)
        stable = copy.deepcopy(MODEL)
        del stable["spec"]["canary"]
        await env.cluster.apply(stable)
        await env.event("CanaryRemoved")
        for kind, name in [("Deployment", "clf-canary"), ("ConfigMap", "clf-split")]:
            await env.cluster.wait(lambda k=kind, n=name: _gone(env, k, n), f"{kind} {name} is removed")
        model = await env.cluster.get("InferenceModel", "clf")
        assert model["status"]["trafficSummary"] == "v1=100"


async def test_a_manual_split_holds_its_percent_without_judging():
    async with environment() as env:
        manual = copy.deepcopy(MODEL)
        manual["spec"]["canary"] = {"storageUri": "s3://models/clf/v2", "version": 2, "trafficPercent": 20}
        await env.cluster.apply(manual)
        status = await env.until("the manual split", phase="Manual", weight=20)
        assert status["summary"] == "Manual"
        await env.tick(3600)
        await env.cluster.wait(lambda: _settled(env), "nothing changes")
        assert (await env.canary())["weight"] == 20
        assert env.metrics.targets == []  # nothing is judged


@pytest.mark.parametrize(("router", "crds"), [("gateway-api", GATEWAY_API), ("istio", ISTIO),
                                              ("auto", GATEWAY_API), ("auto", ISTIO)],
                         ids=["gateway-api", "istio", "auto-finds-gateway-api", "auto-finds-istio"])
async def test_each_router_carries_the_weights(router, crds):
    async with environment(router=router, crds=crds) as env:
        env.metrics.canary = HEALTHY
        await env.cluster.apply(MODEL)
        status = await env.until("the first step", phase="Progressing", weight=5)
        via = status["router"]
        assert via == ("istio" if crds is ISTIO else "gateway-api")
        assert await env.cluster.get("ConfigMap", "clf-split") is None  # the runtime forwards nothing
        host = "svc.cluster.local"
        if via == "gateway-api":
            http = await env.cluster.get("HTTPRoute", "clf")
            grpc = await env.cluster.get("GRPCRoute", "clf")
            assert http["spec"]["parentRefs"] == [{"group": "", "kind": "Service", "name": "clf", "port": 8000}]
            assert [(b["name"], b["port"], b["weight"]) for b in http["spec"]["rules"][0]["backendRefs"]] == \
                [("clf", 8000, 95), ("clf-canary", 8000, 5)]
            assert [(b["name"], b["port"], b["weight"]) for b in grpc["spec"]["rules"][0]["backendRefs"]] == \
                [("clf", 8001, 95), ("clf-canary", 8001, 5)]
        else:
            vs = await env.cluster.get("VirtualService", "clf")
            assert vs["spec"]["hosts"] == [f"clf.{NAMESPACE}.{host}"]
            assert [[(r["destination"]["host"], r["destination"]["port"]["number"], r["weight"])
                     for r in route["route"]] for route in vs["spec"]["http"]] == [
                [(f"clf.{NAMESPACE}.{host}", 8000, 95), (f"clf-canary.{NAMESPACE}.{host}", 8000, 5)],
                [(f"clf.{NAMESPACE}.{host}", 8001, 95), (f"clf-canary.{NAMESPACE}.{host}", 8001, 5)]]
        env.metrics.canary = FAILING
        await env.tick()
        await env.until("the rollback", phase="RolledBack")
        kinds = ["HTTPRoute", "GRPCRoute"] if via == "gateway-api" else ["VirtualService"]
        for kind in kinds:
            await env.cluster.wait(lambda k=kind: _gone(env, k, "clf"), f"the {kind} is removed")
