"""The emulator's fast ``request in view`` (sluice_testing.apiserver._contains) answers as kmock's own.

kmock checks every arriving request against each reaction's view by walking the server's whole
history; the test support answers chains of filters over the server from the one request instead.
Here both answer for every recorded request and every reaction, over a mix of discovery, reads,
writes, errors and a reaction kmock's walk still serves (a slice)."""

from __future__ import annotations

from sluice_testing.apiserver import _KMOCK_CONTAINS, _contains

DEPLOYMENT = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "namespace": "models"},
              "spec": {"replicas": 1, "selector": {"matchLabels": {"a": "b"}}}}  # fmt: skip


async def _get(apiserver, url: str, **params: str) -> int:
    async with apiserver.request("GET", url, params=params) as resp:
        await resp.read()
        return resp.status


async def test_fast_membership_agrees_with_kmocks_walk(apiserver):
    once = apiserver["get /custom"][:1] << b"once"  # a sliced view: kmock's own walk answers it
    assert once is not None
    for url in ("/version", "/apis", "/api/v1", "/apis/apps/v1", "/apis/apps/v1/namespaces/models/deployments"):
        assert await _get(apiserver, url) == 200, url
    url = "/apis/apps/v1/namespaces/models/deployments/d"
    async with apiserver.request("PATCH", url, params={"fieldManager": "t", "force": "true"}, json=DEPLOYMENT,
                                 headers={"Content-Type": "application/apply-patch+yaml"}) as resp:  # fmt: skip
        assert resp.status in (200, 201), await resp.text()
    assert await _get(apiserver, url) == 200
    assert await _get(apiserver, url + "-missing") == 404
    assert await _get(apiserver, "/apis/apps/v1/namespaces/models/deployments", labelSelector="a=b") == 200
    assert [await _get(apiserver, "/custom") for _ in range(2)] == [200, 404]  # the slice served once

    requests = list(apiserver._requests)
    payloads = list(apiserver._payloads)
    assert len(requests) == 11 and len(payloads) >= 10
    checked = 0
    for payload in payloads:
        for request in requests:
            assert _contains(payload._source, request) == bool(_KMOCK_CONTAINS(payload._source, request)), (
                payload, request
            )  # fmt: skip
            checked += 1
    # both answers occur: the check compared something
    answers = {_contains(p._source, r) for p in payloads for r in requests}
    assert answers == {True, False}
    assert checked == len(payloads) * len(requests)
