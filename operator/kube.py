"""The one place that talks to the Kubernetes API for the reconciler.

Writes go through server-side apply with the fixed field manager ``sluice-operator`` and ``force``:
the operator owns the fields it renders and takes them back after a manual edit (drift repair),
while fields it never renders (e.g. an HPA-owned ``replicas``) stay with whoever set them.
Status goes to the ``/status`` subresource as one merge patch. Credentials are the same
``kopf.ConnectionInfo`` kopf logs in with, so operator and framework see the same cluster.

Implements ``reconcile.Api`` (the reconciler only sees that protocol); built by ``__main__`` and used
by ``handlers`` too.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
import kopf

from sluice.operator import api
from sluice.operator.reconcile import ApiError
from sluice.operator.settings import FIELD_MANAGER

Obj = dict[str, Any]

# kind -> (apiVersion, plural) for every kind the operator reads or writes.
RESOURCES: dict[str, tuple[str, str]] = {
    "ConfigMap": ("v1", "configmaps"),
    "Pod": ("v1", "pods"),  # read only: why runtime pods wait (Unschedulable)
    "Service": ("v1", "services"),
    "Deployment": ("apps/v1", "deployments"),
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets"),
    "HorizontalPodAutoscaler": ("autoscaling/v2", "horizontalpodautoscalers"),
    # Canary routers; their CRDs may be missing (a GET then answers 404, which reads as "absent").
    "HTTPRoute": ("gateway.networking.k8s.io/v1", "httproutes"),
    "GRPCRoute": ("gateway.networking.k8s.io/v1", "grpcroutes"),
    "VirtualService": ("networking.istio.io/v1beta1", "virtualservices"),
    # KEDA's CRD, installed or not: a GET where it is missing answers 404, which reads as absent.
    "ScaledObject": ("keda.sh/v1alpha1", "scaledobjects"),
    # GPU placement: read only, cluster-wide (Node and ResourceSlice are cluster-scoped).
    "Node": ("v1", "nodes"),
    "ResourceSlice": ("resource.k8s.io/v1", "resourceslices"),
    "ResourceClaim": ("resource.k8s.io/v1", "resourceclaims"),
    # Written with gpus.allocation dra: one per runtime Deployment.
    "ResourceClaimTemplate": ("resource.k8s.io/v1", "resourceclaimtemplates"),
    # The sidecar webhook's self-managed TLS: its Secret, and the caBundle of its configuration.
    "Secret": ("v1", "secrets"),
    "MutatingWebhookConfiguration": ("admissionregistration.k8s.io/v1", "mutatingwebhookconfigurations"),
    api.INFERENCE_MODEL_KIND: (api.API_VERSION, api.INFERENCE_MODEL_PLURAL),
    api.ENSEMBLE_KIND: (api.API_VERSION, api.ENSEMBLE_PLURAL),
    api.MODEL_POOL_KIND: (api.API_VERSION, api.MODEL_POOL_PLURAL),
    # kopf's leader election: the operator creates its peering object where it is missing (get, create);
    # kopf itself watches it and writes the keepalives into its status.
    "KopfPeering": ("kopf.dev/v1", "kopfpeerings"),
    "ClusterKopfPeering": ("kopf.dev/v1", "clusterkopfpeerings"),
}


CLUSTER_SCOPED = frozenset({"Node", "ResourceSlice", "MutatingWebhookConfiguration", "ClusterKopfPeering"})


def path(kind: str, namespace: str, name: str | None = None) -> str:
    """The URL path of a kind's collection or object; an empty ``namespace`` lists across all of them."""
    api_version, plural = RESOURCES[kind]
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    where = f"/namespaces/{namespace}" if namespace and kind not in CLUSTER_SCOPED else ""
    return f"{prefix}{where}/{plural}" + (f"/{name}" if name else "")


class Kube:
    """An aiohttp client bound to one ``kopf.ConnectionInfo``; open it lazily, close it with :meth:`aclose`."""

    def __init__(self, info: kopf.ConnectionInfo | None = None) -> None:
        self._info = info
        self._session: aiohttp.ClientSession | None = None
        self._lock = asyncio.Lock()
        self._connected = asyncio.Event()
        if info is not None:
            self._connected.set()

    def connect(self, info: kopf.ConnectionInfo) -> None:
        """Use ``info`` from now on (called by the login handler, also after a credentials refresh)."""
        self._info = info
        self._connected.set()
        old, self._session = self._session, None
        if old is not None:
            asyncio.get_running_loop().create_task(old.close())

    async def connected(self) -> None:
        """Wait until the login handler gave credentials (work that starts with kopf, before its login)."""
        await self._connected.wait()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _request(
        self, method: str, url_path: str, *, body: Any = None, content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
    ) -> Obj | None:
        async with self._lock:
            if self._session is None:
                if self._info is None:
                    raise RuntimeError("Kube has no credentials yet: the login handler has not run")
                self._session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(ssl=self._info.as_ssl_context()),
                    headers={**self._info.as_http_headers(), "User-Agent": FIELD_MANAGER},
                )
            session = self._session
            server = self._info.server.rstrip("/") if self._info else ""
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        async with session.request(method, server + url_path, data=data, headers=headers, params=params) as resp:
            payload = await resp.json(content_type=None) if resp.content_length != 0 else None
            if resp.status == 404 and (method in ("GET", "DELETE") or url_path.endswith("/status")):
                return None
            if resp.status >= 400:
                payload = payload if isinstance(payload, dict) else {}
                raise ApiError(resp.status, str(payload.get("reason", resp.reason)), str(payload.get("message", "")))
            return payload if isinstance(payload, dict) else {}

    async def apply(self, obj: Mapping[str, Any]) -> Obj:
        meta = obj["metadata"]
        try:
            result = await self._request(
                "PATCH", path(obj["kind"], meta["namespace"], meta["name"]), body=obj,
                content_type="application/apply-patch+yaml", params={"fieldManager": FIELD_MANAGER, "force": "true"},
            )
        except ApiError as exc:
            if exc.status != 404:
                raise
            # An apply creates what is missing, so a 404 means the cluster does not serve the kind at all.
            raise ApiError(404, exc.reason, f"{exc.message} (the cluster does not serve {obj['apiVersion']} "
                           f"{obj['kind']}: is the CRD that defines it installed? KEDA's, for a ScaledObject)") from exc
        return result or {}

    async def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        return await self._request("GET", path(kind, namespace, name))

    async def list(self, kind: str, namespace: str) -> list[Obj]:
        """Every ``kind`` in ``namespace`` (``""``: in all namespaces, or a cluster-scoped kind); a kind the
        cluster does not serve lists as empty."""
        result = await self._request("GET", path(kind, namespace))
        api_version = RESOURCES[kind][0]
        # List items carry no apiVersion/kind; add them so items look like fetched objects.
        return [{"apiVersion": api_version, "kind": kind, **item} for item in (result or {}).get("items", [])]

    async def delete(self, kind: str, namespace: str, name: str, *, uid: str | None = None) -> bool:
        """Delete if it exists (and still has ``uid``, when given); ``False`` if it was already gone."""
        body: Obj = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            return await self._request("DELETE", path(kind, namespace, name), body=body) is not None
        except ApiError as exc:
            if exc.status == 409:  # the uid precondition failed: a newer object took the name
                return False
            raise

    async def create(self, obj: Mapping[str, Any]) -> Obj:
        """POST ``obj``; an :class:`ApiError` 409 when it exists already."""
        meta = obj["metadata"]
        return await self._request("POST", path(obj["kind"], meta.get("namespace", "")), body=obj) or {}

    async def json_patch(self, kind: str, namespace: str, name: str, ops: Sequence[Mapping[str, Any]]) -> Obj:
        """An RFC 6902 patch (a ``test`` op that fails answers 422: someone else changed it first)."""
        return await self._request("PATCH", path(kind, namespace, name), body=[dict(op) for op in ops],
                                   content_type="application/json-patch+json") or {}

    async def version(self) -> Obj:
        """The API server's ``/version`` (``major``, ``minor``, ``gitVersion``)."""
        return await self._request("GET", "/version") or {}

    async def served(self, api_version: str, kind: str) -> bool:
        """Whether the API server serves ``kind`` in ``api_version`` (discovery; a missing group is False)."""
        prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        try:
            found = await self._request("GET", prefix)
        except ApiError:
            return False
        return any(r.get("kind") == kind for r in (found or {}).get("resources", []) if isinstance(r, dict))

    async def patch_status(self, kind: str, namespace: str, name: str, status: Mapping[str, Any]) -> Obj | None:
        """Merge-patch the status subresource; ``None`` if the object is gone."""
        return await self._request(
            "PATCH", path(kind, namespace, name) + "/status", body={"status": dict(status)},
            content_type="application/merge-patch+json",
        )
