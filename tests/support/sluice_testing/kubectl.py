"""A minimal kubectl for scenarios that run against the emulator or a real cluster (``e2e/``)."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import kopf

from sluice.operator.kube import path


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
