"""Where the e2e scenarios run: the realistic emulator (always), or the cluster in KUBECONFIG.

``target`` is parametrized: ``emulator`` runs kmock's Kubernetes emulator with API-server semantics
(see README.md) plus the real operator in-process and a simulated Deployment controller; ``cluster``
talks to whatever API server KUBECONFIG points at, where the operator is installed with Helm (or run
in-process with SLUICE_E2E_OPERATOR=inprocess), and skips with the reason when there is none.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import pathlib
import secrets
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import kmock
import kopf
import pytest

from sluice.operator.crd import all_crds
from sluice.operator.settings import Settings
from sluice_testing import ApiServer, Cluster, OperatorHarness

ROOT = pathlib.Path(__file__).resolve().parent.parent


@contextlib.asynccontextmanager
async def emulator_target() -> AsyncIterator[Cluster]:
    async with ApiServer(simulate_rollouts=True) as server, kmock.Server(server):
        for definition in all_crds():
            server.register_crd(copy.deepcopy(definition))
        info = kopf.ConnectionInfo(server=str(server.url).rstrip("/"), insecure=True)
        settings = Settings(resync_seconds=3600)
        async with OperatorHarness(settings=settings, connection=info):
            cluster = Cluster(info, "e2e", timeout=15)
            try:
                yield cluster
            finally:
                await cluster.session.close()


@contextlib.asynccontextmanager
async def cluster_target() -> AsyncIterator[Cluster]:
    config = os.environ.get("KUBECONFIG") or str(pathlib.Path.home() / ".kube" / "config")
    if not pathlib.Path(config.split(os.pathsep)[0]).exists():
        pytest.skip("no cluster: KUBECONFIG is unset and ~/.kube/config is missing (see e2e/README.md for kind)")
    info = kopf.login_with_kubeconfig()
    if info is None:
        pytest.skip(f"no usable context in {config}")
    namespace = f"sluice-e2e-{secrets.token_hex(3)}"
    cluster = Cluster(info, namespace, timeout=float(os.environ.get("SLUICE_E2E_TIMEOUT", "300")))
    try:
        try:
            status, _ = await asyncio.wait_for(cluster.call("GET", "/apis/sluice.dev/v1alpha1"), timeout=5)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            pytest.skip(f"the cluster in {config} is not reachable: {exc!r}")
        if status != 200:
            pytest.skip("the sluice.dev CRDs are not installed: helm install sluice helm/sluice (e2e/README.md)")
        status, body = await cluster.call("POST", "/api/v1/namespaces",
                                          {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        assert status < 300, body
        operator: Any = contextlib.nullcontext()
        if os.environ.get("SLUICE_E2E_OPERATOR") == "inprocess":
            operator = OperatorHarness(settings=Settings.from_env({"SLUICE_WATCH_NAMESPACES": namespace}),
                                       connection=info)
        async with operator:
            yield cluster
    finally:
        await cluster.call("DELETE", f"/api/v1/namespaces/{namespace}")
        await cluster.session.close()


@pytest.fixture(params=["emulator", "cluster"])
async def cluster(request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    factory = emulator_target if request.param == "emulator" else cluster_target
    async with factory() as target:
        target.kind = request.param
        yield target

