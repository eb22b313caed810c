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
import json
import os
import pathlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import kmock
import kopf
import pytest

from sluice.operator.crd import all_crds
from sluice.operator.kube import path
from sluice.operator.settings import Settings
from sluice_testing import ApiServer, OperatorHarness

ROOT = pathlib.Path(__file__).resolve().parent.parent


class Cluster:
    """A minimal kubectl: create, server-side apply (as manager ``sluice-e2e``), get, delete, wait."""

    kind = "emulator"

    @staticmethod
    def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
        return next((c for c in (obj or {}).get("status", {}).get("conditions", []) if c["type"] == type_), {})

    def __init__(self, info: kopf.ConnectionInfo, namespace: str, *, timeout: float) -> None:
        self.info = info
        self.namespace = namespace
        self.timeout = timeout
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()), headers=info.as_http_headers())

    async def call(self, method: str, url: str, body: Any = None, content_type: str = "application/json",
                   params: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        async with self.session.request(method, self.info.server.rstrip("/") + url, params=params,
                                        data=None if body is None else json.dumps(body),
                                        headers={"Content-Type": content_type}) as resp:
            return resp.status, await resp.json(content_type=None) or {}

    async def create(self, obj: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        obj = copy.deepcopy(obj)
        obj["metadata"]["namespace"] = self.namespace
        return await self.call("POST", path(obj["kind"], self.namespace), obj)

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(obj)
        obj["metadata"]["namespace"] = self.namespace
        status, body = await self.call("PATCH", path(obj["kind"], self.namespace, obj["metadata"]["name"]), obj,
                                       "application/apply-patch+yaml", {"fieldManager": "sluice-e2e", "force": "true"})
        assert status < 300, body
        return body

    async def get(self, kind: str, name: str) -> dict[str, Any] | None:
        status, body = await self.call("GET", path(kind, self.namespace, name))
        return body if status == 200 else None

    async def delete(self, kind: str, name: str) -> None:
        status, body = await self.call("DELETE", path(kind, self.namespace, name),
                                       {"propagationPolicy": "Background"})
        assert status < 300, body

    async def wait(self, check: Callable[[], Awaitable[Any]], what: str) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while True:
            result = await check()
            if result:
                return result
            if loop.time() > deadline:
                raise AssertionError(f"not within {self.timeout} s: {what}")
            await asyncio.sleep(0.05 if self.timeout < 60 else 1.0)


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

