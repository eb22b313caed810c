"""The ``sluice-operator`` command as the chart runs it: settings from SLUICE_* variables, login from a
kubeconfig, its own liveness endpoint and Prometheus metrics, reconciling, stopping on SIGTERM.

The operator runs as a subprocess against the emulator (served from this test's event loop), so
everything ``__main__`` wires - not a test harness - is what answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import pathlib
import shutil
import signal
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import yaml

from sluice_testing import ApiServer


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def sample(exposition: str, name: str, labels: dict[str, str]) -> float | None:
    """The value of one sample in Prometheus text format, or ``None``."""
    for line in exposition.splitlines():
        if not line.startswith(name + "{"):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{key}="{val}"' in head for key, val in labels.items()):
            return float(value)
    return None


class Operator:
    def __init__(self, process: asyncio.subprocess.Process, health: int, metrics: int) -> None:
        self.process = process
        self.health_port = health
        self.metrics_port = metrics
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))

    async def reconciles(self) -> float:
        _, exposition = await self.wait_get(self.metrics_port, "/metrics")
        return sample(exposition, "sluice_operator_reconciles_total", {"kind": "InferenceModel", "result": "ok"}) or 0

    async def get(self, port: int, path: str) -> tuple[int, str]:
        async with self.session.get(f"http://127.0.0.1:{port}{path}") as resp:
            return resp.status, await resp.text()

    async def wait_get(self, port: int, path: str, timeout: float = 20.0) -> tuple[int, str]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if self.process.returncode is not None:
                raise AssertionError(f"the operator exited with {self.process.returncode}")
            try:
                return await self.get(port, path)
            except aiohttp.ClientConnectionError:
                if loop.time() > deadline:
                    raise
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def launched(apiserver: ApiServer, directory: pathlib.Path, **env: str) -> AsyncIterator[Operator]:
    """Run ``sluice-operator`` with a kubeconfig for ``apiserver`` and ``SLUICE_*`` variables ``env``."""
    directory.mkdir(parents=True, exist_ok=True)
    kubeconfig = directory / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": str(apiserver.url).rstrip("/"),
                                                      "insecure-skip-tls-verify": True}}],
        "users": [{"name": "anonymous", "user": {}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "anonymous"}}],
    }))
    health, metrics = free_port(), free_port()
    executable = shutil.which("sluice-operator", path=os.path.dirname(sys.executable))
    assert executable, f"sluice-operator is not installed next to {sys.executable}"
    environment = {
        "PATH": os.environ.get("PATH", ""), "HOME": str(directory), "KUBECONFIG": str(kubeconfig),
        "SLUICE_HEALTH_PORT": str(health), "SLUICE_METRICS_PORT": str(metrics),
        "SLUICE_RUNTIME_IMAGE": "sluice-runtime:entrypoint-test", "SLUICE_RESYNC_SECONDS": "3600", **env,
    }
    process = await asyncio.create_subprocess_exec(
        executable, cwd=directory, env=environment, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    operator = Operator(process, health, metrics)
    try:
        yield operator
    finally:
        await operator.session.close()
        if process.returncode is None:
            process.kill()
        await process.communicate()


@pytest.fixture()
async def operator_process(apiserver: ApiServer, tmp_path: pathlib.Path) -> AsyncIterator[Operator]:
    async with launched(apiserver, tmp_path) as operator:
        yield operator


async def test_health_metrics_reconcile_and_sigterm(client: Any, operator_process: Operator) -> None:
    status, body = await operator_process.wait_get(operator_process.health_port, "/healthz")
    assert status == 200, body

    _, before = await operator_process.wait_get(operator_process.metrics_port, "/metrics")
    ok = {"kind": "InferenceModel", "result": "ok"}
    assert sample(before, "sluice_operator_reconciles_total", ok) is None

    await client.create(client.IM, client.model())
    deployment = await client.wait(lambda: client.read("apps/v1/deployments", "resnet"), timeout=20)
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "sluice-runtime:entrypoint-test"
    await client.wait(lambda: (client.read(client.IM, "resnet") or {}).get("status", {}).get("conditions"))
    await client.settle()

    _, after = await operator_process.get(operator_process.metrics_port, "/metrics")
    assert (sample(after, "sluice_operator_reconciles_total", ok) or 0) >= 1, after
    assert (sample(after, "sluice_operator_status_writes_total", {"kind": "InferenceModel"}) or 0) >= 1
    assert (sample(after, "sluice_operator_reconcile_seconds_count", {"kind": "InferenceModel"}) or 0) >= 1

    operator_process.process.send_signal(signal.SIGTERM)
    output, _ = await asyncio.wait_for(operator_process.process.communicate(), timeout=20)
    assert operator_process.process.returncode == 0, output.decode()[-3000:]


def peering_crd(kind: str, plural: str, scope: str) -> dict[str, Any]:
    """kopf's peering CRD as the chart installs it (manifests/generate.py) when leaderElection.enabled."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.kopf.dev"},
        "spec": {"group": "kopf.dev", "scope": scope, "names": {"kind": kind, "plural": plural},
                 "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                     "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]},
    }


PEERING_CRD = peering_crd("ClusterKopfPeering", "clusterkopfpeerings", "Cluster")
NAMESPACED_PEERING_CRD = peering_crd("KopfPeering", "kopfpeerings", "Namespaced")
CLUSTER_PEERINGS = "kopf.dev/v1/clusterkopfpeerings"
NAMESPACED_PEERINGS = "kopf.dev/v1/kopfpeerings"


async def test_two_replicas_elect_one_leader_and_fail_over(client: Any, apiserver: ApiServer,
                                                           tmp_path: pathlib.Path) -> None:
    apiserver.register_crd(PEERING_CRD)  # no peering object: the first replica to start creates it

    def peers() -> dict[str, Any]:
        return (apiserver.read("kopf.dev/v1/clusterkopfpeerings", None, "sluice") or {}).get("status") or {}

    # Without SLUICE_PEERING_PRIORITY each replica draws its own; fixed here to know which one leads.
    async with launched(apiserver, tmp_path / "a", SLUICE_PEERING_NAME="sluice", SLUICE_PEERING_PRIORITY="200") \
            as leader, launched(apiserver, tmp_path / "b", SLUICE_PEERING_NAME="sluice",
                                SLUICE_PEERING_PRIORITY="100") as follower:
        await client.wait(lambda: sorted(p["priority"] for p in peers().values()) == [100, 200], timeout=20)
        await client.create(client.IM, client.model())
        await client.wait(lambda: client.read("apps/v1/deployments", "resnet"), timeout=20)
        await client.wait(lambda: client.read(client.IM, "resnet").get("status", {}).get("conditions"))
        await client.settle()
        assert await leader.reconciles() >= 1
        assert await follower.reconciles() == 0  # paused in favour of the leader

        leader.process.send_signal(signal.SIGTERM)  # the leader leaves the peering on a clean stop
        await asyncio.wait_for(leader.process.wait(), timeout=20)
        await client.wait(lambda: [p["priority"] for p in peers().values()] == [100], timeout=20)
        await client.patch(client.IM, "resnet", {"spec": {"runtime": {"maxBatchSize": 32}}})
        await client.wait(lambda: client.read("apps/v1/deployments", "resnet")["metadata"]["generation"] == 2,
                          timeout=20)
        assert await follower.reconciles() >= 1


# ---------------------------------------------------------------- the peering object is the operator's to create
# kopf with a peering name stays paused for as long as its peering object does not exist; the operator
# creates a missing one at start-up (before kopf's peering starts) and never replaces an existing one.


async def wait_output(operator: Operator, text: str, timeout: float = 20.0) -> str:
    """Read the operator's output until a line contains ``text``; what was read."""
    assert operator.process.stdout is not None
    seen: list[str] = []

    async def read() -> str:
        while True:
            line = (await operator.process.stdout.readline()).decode()
            if not line:
                raise AssertionError(f"the operator exited without logging {text!r}:\n{''.join(seen)[-3000:]}")
            seen.append(line)
            if text in line:
                return "".join(seen)

    try:
        return await asyncio.wait_for(read(), timeout)
    except TimeoutError:
        raise AssertionError(f"no {text!r} in the operator's output in {timeout} s:\n{''.join(seen)[-3000:]}") from None


@pytest.fixture()
def namespaces_served(monkeypatch: pytest.MonkeyPatch) -> None:
    """kmock parses ``/api/v1/namespaces`` (and ``.../namespaces/<name>``) as a namespace prefix with no
    resource, and answers 500: serve the Namespace kind itself, as kopf lists and watches it when it
    watches named namespaces (it reconciles only in those that exist)."""
    from kmock._internal import parsing
    parse = parsing.parse_path

    def parse_path(path: str) -> Any:
        parts = path.strip("/").split("/")
        if parts[:3] == ["api", "v1", "namespaces"] and len(parts) <= 4:
            return parsing.ParsedPath("", "v1", "namespaces", None, parts[3] if len(parts) == 4 else None, None)
        return parse(path)

    monkeypatch.setattr(parsing, "parse_path", parse_path)


@pytest.mark.parametrize("namespaced", [False, True], ids=["cluster", "namespaced"])
async def test_missing_peering_objects_are_created_and_the_operator_reconciles(
        client: Any, apiserver: ApiServer, tmp_path: pathlib.Path, namespaced: bool, namespaces_served: None) -> None:
    env: dict[str, str] = {}
    where: list[tuple[str, str | None]] = [(CLUSTER_PEERINGS, None)]
    apiserver.register_crd(PEERING_CRD)
    if namespaced:
        apiserver.register_crd(NAMESPACED_PEERING_CRD)
        env = {"SLUICE_WATCH_NAMESPACES": f"{client.NAMESPACE},research"}
        where = [(NAMESPACED_PEERINGS, ns) for ns in (client.NAMESPACE, "research")]
        for ns in (client.NAMESPACE, "research"):
            await client.post("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    assert not [resource for resource, ns in where if apiserver.read(resource, ns, "sluice")]

    async with launched(apiserver, tmp_path, SLUICE_PEERING_NAME="sluice", SLUICE_PEERING_PRIORITY="100", **env) \
            as operator:
        await client.create(client.IM, client.model())
        # Not paused for ever: with no peering object, kopf would wait for one and never reconcile this.
        await client.wait(lambda: client.read("apps/v1/deployments", "resnet"), timeout=20)
        await client.wait(lambda: (client.read(client.IM, "resnet") or {}).get("status", {}).get("conditions"))
        assert await operator.reconciles() >= 1
        for resource, ns in where:
            peering = apiserver.read(resource, ns, "sluice")
            assert peering is not None, (resource, ns)
            assert peering["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "sluice-operator"}

            def priorities(resource: str = resource, ns: str | None = ns) -> list[int]:
                peers = (apiserver.read(resource, ns, "sluice") or {}).get("status", {})
                return [p["priority"] for p in peers.values()]

            # kopf's keepalives land in the created object: this replica is a live peer there
            await client.wait(lambda: priorities() == [100], timeout=20)
        if namespaced:
            assert apiserver.read(CLUSTER_PEERINGS, None, "sluice") is None
        await client.settle()


async def test_an_existing_peering_object_is_kept_with_its_leader(client: Any, apiserver: ApiServer,
                                                                 tmp_path: pathlib.Path) -> None:
    """An upgrade's new replica finds the leader's peering object: it is not replaced, so the replica
    sees the live leader at once and stays paused instead of reconciling next to it."""
    apiserver.register_crd(PEERING_CRD)
    now = datetime.datetime.now(datetime.UTC).isoformat()
    leader = {"priority": 1000, "lifetime": 60, "lastseen": now}
    await client.post(f"/apis/{CLUSTER_PEERINGS}", {
        "apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "sluice"},
        "status": {"the-leader": leader}})
    before = apiserver.read(CLUSTER_PEERINGS, None, "sluice")
    assert before is not None and before["status"] == {"the-leader": leader}

    def peers() -> dict[str, Any]:
        return (apiserver.read(CLUSTER_PEERINGS, None, "sluice") or {}).get("status") or {}

    async with launched(apiserver, tmp_path, SLUICE_PEERING_NAME="sluice", SLUICE_PEERING_PRIORITY="100") \
            as follower:
        # its own keepalive arrived next to the leader's: the object was written, not recreated
        await client.wait(lambda: sorted(p["priority"] for p in peers().values()) == [100, 1000], timeout=20)
        after = apiserver.read(CLUSTER_PEERINGS, None, "sluice")
        assert after is not None
        assert (after["metadata"]["uid"], after["metadata"]["creationTimestamp"]) == \
            (before["metadata"]["uid"], before["metadata"]["creationTimestamp"])
        assert after["status"]["the-leader"] == leader
        assert "labels" not in after["metadata"]  # not taken over either

        await client.create(client.IM, client.model())
        await asyncio.sleep(1.5)
        assert client.read("apps/v1/deployments", "resnet") is None, "the follower reconciled next to a live leader"
        assert await follower.reconciles() == 0

        # the leader leaves (as kopf does on a clean stop): the follower takes over
        await client._call("PATCH", f"/apis/{CLUSTER_PEERINGS}/sluice", data=json.dumps(
            {"status": {"the-leader": None}}), headers={"Content-Type": "application/merge-patch+json"})
        await client.wait(lambda: client.read("apps/v1/deployments", "resnet"), timeout=20)
        await client.settle()


async def test_a_forbidden_peering_object_stops_the_operator_with_the_reason(
        client: Any, apiserver: ApiServer, tmp_path: pathlib.Path) -> None:
    """Without the permission to create its peering object the operator would be paused for ever: it
    exits instead, naming what it needs."""
    apiserver.register_crd(PEERING_CRD)
    apiserver.reject_writes(CLUSTER_PEERINGS, 403, 'clusterkopfpeerings.kopf.dev is forbidden: cannot create')
    async with launched(apiserver, tmp_path, SLUICE_PEERING_NAME="sluice") as operator:
        output, _ = await asyncio.wait_for(operator.process.communicate(), timeout=20)
        text = output.decode()
        assert operator.process.returncode != 0, text[-3000:]
        assert "ClusterKopfPeering 'sluice' (cluster-wide)" in text, text[-3000:]
        assert "needs get and create on clusterkopfpeerings.kopf.dev" in text, text[-3000:]
        assert "sluice-operator: cannot start: leader election needs" in text and "Traceback" not in text, text[-3000:]
    assert apiserver.read(CLUSTER_PEERINGS, None, "sluice") is None


async def test_a_peering_object_that_cannot_be_created_yet_is_retried(
        client: Any, apiserver: ApiServer, tmp_path: pathlib.Path, namespaces_served: None) -> None:
    """An API server that fails for a while (here 503 on create): the operator tries again until the
    object exists, and starts reconciling then."""
    apiserver.register_crd(NAMESPACED_PEERING_CRD)
    await client.post("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                             "metadata": {"name": client.NAMESPACE}})
    apiserver.reject_writes(NAMESPACED_PEERINGS, 503, "etcdserver: leader changed")
    async with launched(apiserver, tmp_path, SLUICE_PEERING_NAME="sluice",
                        SLUICE_WATCH_NAMESPACES=client.NAMESPACE) as operator:
        await client.create(client.IM, client.model())
        logged = await wait_output(operator, "trying again in")
        assert "KopfPeering 'sluice' in namespace 'models'" in logged and "503" in logged, logged[-3000:]
        assert client.read("apps/v1/deployments", "resnet") is None  # kopf has not started yet
        apiserver.allow_writes(NAMESPACED_PEERINGS)
        await client.wait(lambda: apiserver.read(NAMESPACED_PEERINGS, client.NAMESPACE, "sluice"), timeout=20)
        await client.wait(lambda: client.read("apps/v1/deployments", "resnet"), timeout=20)
        await client.settle()


async def test_namespace_patterns_get_no_peering_object_and_kopf_takes_one_made_later(
        client: Any, apiserver: ApiServer, tmp_path: pathlib.Path, namespaces_served: None) -> None:
    """A watched-namespace pattern names no namespace in advance: the operator creates nothing for it and
    says so; kopf stays paused in a matching namespace until a peering object appears there, and takes
    one made after its peering watch started (ADDED)."""
    apiserver.register_crd(NAMESPACED_PEERING_CRD)
    await client.post("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                             "metadata": {"name": client.NAMESPACE}})
    async with launched(apiserver, tmp_path, SLUICE_PEERING_NAME="sluice", SLUICE_WATCH_NAMESPACES="model*") \
            as operator:
        logged = await wait_output(operator, "no KopfPeering 'sluice' is created in the namespaces matching 'model*'")
        await wait_output(operator, "Activity 'peering' succeeded")
        await client.create(client.IM, client.model())
        await asyncio.sleep(1.5)
        assert client.read("apps/v1/deployments", "resnet") is None, logged[-3000:]  # paused: no peering object
        assert apiserver.read(NAMESPACED_PEERINGS, client.NAMESPACE, "sluice") is None
        await client.post(f"/apis/kopf.dev/v1/namespaces/{client.NAMESPACE}/kopfpeerings", {
            "apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "sluice"}})
        await client.wait(lambda: client.read("apps/v1/deployments", "resnet"), timeout=20)
        await client.settle()
