"""Fixtures for operator tests: the realistic API-server emulator, a client to it, the running operator."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import kmock
import kopf
import pytest

from sluice.operator.crd import all_crds
from sluice.operator.settings import Settings
from sluice_testing import ApiServer, FakeClock, OperatorHarness

NAMESPACE = "models"
IM = "sluice.dev/v1alpha1/inferencemodels"
ENS = "sluice.dev/v1alpha1/ensembles"
POOL = "sluice.dev/v1alpha1/modelpools"
PATHS = {
    IM: "/apis/sluice.dev/v1alpha1/namespaces/{ns}/inferencemodels",
    ENS: "/apis/sluice.dev/v1alpha1/namespaces/{ns}/ensembles",
    POOL: "/apis/sluice.dev/v1alpha1/namespaces/{ns}/modelpools",
    "apps/v1/deployments": "/apis/apps/v1/namespaces/{ns}/deployments",
    "v1/services": "/api/v1/namespaces/{ns}/services",
    "v1/configmaps": "/api/v1/namespaces/{ns}/configmaps",
    "autoscaling/v2/horizontalpodautoscalers": "/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers",
    "policy/v1/poddisruptionbudgets": "/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets",
}


def _inference_model(name: str = "resnet", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": {"storageUri": "s3://models/resnet50", "format": "onnx", "version": 1},
        "runtime": {"maxBatchSize": 8, "dynamicBatching": {"maxQueueDelayMicroseconds": 500}},
        "resources": {"cpu": "2", "memory": "4Gi"},
        "scaling": {"minReplicas": 2, "maxReplicas": 4},
    }
    body.update(spec)
    return {"apiVersion": "sluice.dev/v1alpha1", "kind": "InferenceModel",
            "metadata": {"name": name, "namespace": NAMESPACE}, "spec": body}


def _condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    if not obj:
        return None
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == type_), None)


class Client:
    """Talks to the emulator over HTTP like kubectl; reads its store for assertions."""

    IM = IM
    ENS = ENS
    POOL = POOL
    NAMESPACE = NAMESPACE
    model = staticmethod(_inference_model)
    condition = staticmethod(_condition)

    def __init__(self, server: ApiServer) -> None:
        self.server = server

    async def _call(self, method: str, url: str, **kwargs: Any) -> dict[str, Any]:
        async with self.server.request(method, url, **kwargs) as resp:
            payload = await resp.json(content_type=None)
            if resp.status >= 400:
                raise AssertionError(f"{method} {url} -> {resp.status}: {payload.get('message')}")
            return payload

    async def create(self, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        ns = obj["metadata"]["namespace"]
        return await self._call("POST", PATHS[resource].format(ns=ns), json=obj)

    async def post(self, url: str, obj: dict[str, Any]) -> dict[str, Any]:
        return await self._call("POST", url, json=obj)

    async def create_raw(self, resource: str, obj: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        async with self.server.post(PATHS[resource].format(ns=obj["metadata"]["namespace"]), json=obj) as resp:
            return resp.status, await resp.json(content_type=None)

    async def patch(self, resource: str, name: str, patch: dict[str, Any], ns: str = NAMESPACE) -> dict[str, Any]:
        return await self._call("PATCH", f"{PATHS[resource].format(ns=ns)}/{name}", data=json.dumps(patch),
                                headers={"Content-Type": "application/merge-patch+json"})

    async def delete(self, resource: str, name: str, ns: str = NAMESPACE) -> dict[str, Any]:
        return await self._call("DELETE", f"{PATHS[resource].format(ns=ns)}/{name}")

    def events(self) -> list[dict[str, Any]]:
        """Kubernetes Events stored so far (kopf posts them asynchronously: wait for them)."""
        return [obj.raw for (resource, _, _), obj in self.server.objects.items()
                if resource.plural == "events" and not obj.deleted]

    def read(self, resource: str, name: str, ns: str = NAMESPACE) -> dict[str, Any] | None:
        return self.server.read(resource, ns, name)

    async def settle(self, quiet: float = 0.25, timeout: float = 10.0) -> None:
        """Wait until nothing in the cluster changes for ``quiet`` seconds (the operator converged)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last, since = self.server.version, loop.time()
        while loop.time() - since < quiet:
            if loop.time() > deadline:
                raise AssertionError(f"the cluster kept changing for {timeout} s")
            await asyncio.sleep(0.02)
            if self.server.version != last:
                last, since = self.server.version, loop.time()

    async def wait(self, check: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Poll the store until ``check()`` is truthy (the operator works concurrently)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                result = check()
            except (KeyError, TypeError, IndexError):
                result = None
            if result:
                return result
            if loop.time() > deadline:
                raise AssertionError(f"condition not met in {timeout} s: {check.__doc__ or check}")
            await asyncio.sleep(0.02)


@pytest.fixture()
async def apiserver() -> AsyncIterator[ApiServer]:
    async with ApiServer() as server, kmock.Server(server):
        for crd in all_crds():
            server.register_crd(copy.deepcopy(crd))
        yield server


@pytest.fixture()
def client(apiserver: ApiServer) -> Client:
    return Client(apiserver)


@pytest.fixture()
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture()
def settings() -> Settings:
    return Settings(resync_seconds=3600, runtime_image="sluice-runtime:test",
                    runtime_gpu_image="sluice-runtime:test-cuda")


@pytest.fixture()
async def operator(apiserver: ApiServer, settings: Settings, clock: FakeClock) -> AsyncIterator[OperatorHarness]:
    info = kopf.ConnectionInfo(server=str(apiserver.url).rstrip("/"), insecure=True, default_namespace=NAMESPACE)
    async with OperatorHarness(settings=settings, connection=info, clock=clock) as harness:
        yield harness
        await Client(apiserver).settle()  # stop between reconciles, not in the middle of one
