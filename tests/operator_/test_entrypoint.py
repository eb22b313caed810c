"""The ``sluice-operator`` command as the chart runs it: settings from SLUICE_* variables, login from a
kubeconfig, its own liveness endpoint and Prometheus metrics, reconciling, stopping on SIGTERM.

The operator runs as a subprocess against the emulator (served from this test's event loop), so
everything ``__main__`` wires - not a test harness - is what answers.
"""

from __future__ import annotations

import asyncio
import contextlib
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


PEERING_CRD = {  # as the chart installs it (manifests/generate.py) when leaderElection.enabled
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "clusterkopfpeerings.kopf.dev"},
    "spec": {"group": "kopf.dev", "scope": "Cluster",
             "names": {"kind": "ClusterKopfPeering", "plural": "clusterkopfpeerings"},
             "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                 "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]},
}


async def test_two_replicas_elect_one_leader_and_fail_over(client: Any, apiserver: ApiServer,
                                                           tmp_path: pathlib.Path) -> None:
    apiserver.register_crd(PEERING_CRD)
    await client.post("/apis/kopf.dev/v1/clusterkopfpeerings", {  # the chart's install hook
        "apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "sluice"}})

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
