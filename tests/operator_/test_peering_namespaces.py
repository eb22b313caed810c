"""Leader election in namespaced mode: one watched namespace that cannot take a peering object (not
created yet, or being deleted) does not hold up the others; the real operator against the emulator."""

from __future__ import annotations

import copy
import pathlib
from typing import Any

import attrs
import kmock
import pytest

from sluice.operator.crd import all_crds
from sluice_testing import ApiServer

from .test_entrypoint import NAMESPACED_PEERING_CRD, launched, namespaces_served  # noqa: F401


@attrs.define
class RefusingApiServer(ApiServer):
    """Answers a KopfPeering create in one namespace as a real API server does for a namespace that does
    not exist yet or is being deleted (the emulator keeps no namespace lifecycle)."""

    refuse: dict[str, Any] = attrs.field(factory=dict)

    async def _create(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        if request.resource is not None and request.resource.plural == "kopfpeerings" and \
                request.namespace == self.refuse.get("namespace"):
            raise kmock.KubernetesError(status=self.refuse["status"], reason=self.refuse["reason"],
                                        message=self.refuse["message"])
        return await super()._create(request, *args, **kwargs)


@pytest.fixture()
async def apiserver():
    async with RefusingApiServer() as server, kmock.Server(server):
        for crd in all_crds():
            server.register_crd(copy.deepcopy(crd))
        yield server


@pytest.mark.parametrize(("status", "reason", "message"), [
    (404, "NotFound", 'namespaces "gone" not found'),
    (403, "Forbidden", 'kopfpeerings.kopf.dev "sluice" is forbidden: unable to create new content in namespace '
                       'gone because it is being terminated'),
], ids=["namespace-missing", "namespace-terminating"])
async def test_one_namespace_without_its_peering_object_does_not_stop_the_others(
        client: Any, apiserver: RefusingApiServer, tmp_path: pathlib.Path, namespaces_served: None,  # noqa: F811
        status: int, reason: str, message: str) -> None:
    apiserver.register_crd(NAMESPACED_PEERING_CRD)
    apiserver.refuse.update(namespace="gone", status=status, reason=reason, message=message)
    await client.post("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                             "metadata": {"name": client.NAMESPACE}})
    async with launched(apiserver, tmp_path, SLUICE_PEERING_NAME="sluice",
                        SLUICE_WATCH_NAMESPACES=f"{client.NAMESPACE},gone") as operator:
        await client.create(client.IM, client.model())
        await client.wait(lambda: client.read("apps/v1/deployments", "resnet"), timeout=20)
        assert operator.process.returncode is None
