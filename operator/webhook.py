"""The sidecar-injection webhook's I/O: its HTTPS server for kopf, its TLS, and what it asks the API once.

``handlers`` registers the mutating handler and hands kopf an :class:`InjectorServer` (a
``kopf.WebhookServer``) as ``settings.admission.server``. Before it listens, the server:

* waits for the operator's login and resolves ``native_sidecars: auto`` from the API server's ``/version``;
* with ``tls: self-managed``, keeps the CA and serving certificate in a Secret (created by the first replica,
  read by the others, renewed before expiry: ``certificates.decide``), writes them to ``cert_dir`` and sets
  the ``caBundle`` of the MutatingWebhookConfiguration the chart (or ``manifests/``) installed; then it
  checks again every ``RENEW_CHECK_SECONDS`` (kopf restarts its listener when the files change);
* with ``tls: cert-manager``, serves the files cert-manager's Secret mounts into ``cert_dir`` as they are.

The injection itself is pure (``sidecar.admit``); models come from a kopf index, so an admission makes no
API call.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import logging
import pathlib
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, cast

import kopf

from sluice.operator import api, certificates, sidecar
from sluice.operator.kube import Kube
from sluice.operator.reconcile import ApiError
from sluice.operator.settings import Settings

Obj = dict[str, Any]
HANDLER_ID = "sidecar-injector"
"""kopf serves the handler at ``/<id>``: the path in the MutatingWebhookConfiguration's clientConfig."""
RENEW_CHECK_SECONDS = 6 * 3600.0
PREPARE_RETRY_SECONDS = 10.0
log = logging.getLogger("sluice.operator.webhook")


LOOKUP_TIMEOUT_S = 3.0
"""How long admission waits to read an InferenceModel its index lacks."""


class Injector:
    """The webhook's state: settings, whether sidecars are native here, and the admission decision."""

    def __init__(self, settings: Settings, kube: Kube,
                 clock: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC)) -> None:
        self.settings = settings
        self.kube = kube
        self.clock = clock
        self.native: bool | None = None if settings.webhook.native_sidecars == "auto" else \
            settings.webhook.native_sidecars == "true"
        self.ca_pem: str | None = None  # the self-managed CA, once ensure_certificates has run

    async def prepare(self, publish: bool = True) -> None:
        """Everything that needs the API before the first admission: the version, the certificates
        (the CA published in the caBundle unless ``publish`` is False: the server does that once it
        listens, so the API server never calls a webhook that is not there yet)."""
        await self.kube.connected()
        if self.native is None:
            try:
                version = await self.kube.version()
            except (ApiError, OSError) as exc:
                log.warning("Cannot read the API server's /version (%s): injecting regular containers", exc)
                version = {}
            self.native = sidecar.native_sidecars("auto", version)
            log.info("Kubernetes %s: injecting the runtime as a %s", version.get("gitVersion", "?"),
                     "native sidecar" if self.native else "regular container (no native sidecars before 1.29)")
        if self.settings.webhook.tls == "self-managed":
            await self.ensure_certificates(publish=publish)

    async def review(self, pod: Mapping[str, Any], index: Mapping[Any, Any]) -> list[Obj]:
        """The JSON patch for ``pod``, its models looked up in the kopf index ((namespace, name) -> models).
        A model the index lacks is read from the API before the pod is refused: the index is empty until
        kopf has listed the InferenceModels (a replica starting, or one standing by for the leader, also
        answers the webhook's Service)."""
        namespace = str((pod.get("metadata") or {}).get("namespace") or "")
        known = {}
        for name in sidecar.requested(pod):
            for model in index.get((namespace, name), ()):
                known[name] = model
            if name not in known and namespace:
                try:  # well inside the webhook's own timeout (10 s): a slow API gets a clear denial
                    found = await asyncio.wait_for(self.kube.get(api.INFERENCE_MODEL_KIND, namespace, name),
                                                   LOOKUP_TIMEOUT_S)
                except Exception as exc:
                    log.warning("InferenceModel %s/%s is not indexed and could not be read: %r", namespace, name, exc)
                    raise sidecar.Denied(
                        f"{sidecar.INJECT_ANNOTATION}: InferenceModel {name!r} could not be read from the API "
                        "(the operator is starting or the API is slow); the pod's controller retries") from None
                if found is not None and not (found.get("metadata") or {}).get("deletionTimestamp"):
                    known[name] = sidecar.indexed(name, found.get("spec") or {}, found.get("status"),
                                                  found["metadata"].get("generation"))
        return sidecar.admit(pod, known, self.settings, native=bool(self.native))

    # ------------------------------------------------------------ self-managed TLS

    async def ensure_certificates(self, publish: bool = True) -> None:
        """Make the Secret hold a valid bundle, write it to ``cert_dir``, publish the CA in the caBundle
        (``publish``; ``ca_pem`` holds it either way)."""
        hook = self.settings.webhook
        names = certificates.dns_names(hook.service, hook.namespace, self.settings.cluster_domain)
        for _ in range(5):  # another replica may write between our read and our write: read again
            secret = await self.kube.get("Secret", hook.namespace, hook.secret)
            data = {k: base64.b64decode(v).decode() for k, v in ((secret or {}).get("data") or {}).items()}
            bundle = certificates.Bundle.from_data(data)
            action = certificates.decide(bundle, names, self.clock())
            if action == certificates.KEEP and bundle is not None:
                break
            bundle = certificates.issue(bundle, action, names, self.clock())
            encoded = {k: base64.b64encode(v.encode()).decode() for k, v in bundle.as_data().items()}
            try:
                if secret is None:
                    await self.kube.create({
                        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                        "metadata": {"name": hook.secret, "namespace": hook.namespace,
                                     "labels": {"app.kubernetes.io/managed-by": "sluice-operator"}},
                        "data": encoded,
                    })
                else:
                    await self.kube.json_patch("Secret", hook.namespace, hook.secret, [
                        {"op": "test", "path": "/metadata/resourceVersion",
                         "value": secret["metadata"]["resourceVersion"]},
                        {"op": "replace" if secret.get("data") else "add", "path": "/data", "value": encoded},
                    ])
                log.info("Webhook certificate %s (Secret %s/%s), valid until %s", action, hook.namespace,
                         hook.secret, certificates.expiry(bundle.cert).isoformat())
                break
            except ApiError as exc:
                if exc.status not in (409, 422):
                    raise
        else:
            raise RuntimeError(f"Secret {hook.namespace}/{hook.secret} kept changing while the webhook "
                               "certificate was renewed")
        directory = pathlib.Path(hook.cert_dir)
        directory.mkdir(parents=True, exist_ok=True)
        for key, text in ((certificates.TLS_KEY, bundle.key), (certificates.TLS_CERT, bundle.cert),
                          (certificates.CA_CERT, bundle.ca_cert)):
            target = directory / key
            if not target.exists() or target.read_text() != text:
                partial = directory / f".{key}.new"
                partial.write_text(text)
                partial.chmod(0o600)
                partial.replace(target)  # atomic: kopf never loads a half-written file
        self.ca_pem = bundle.trusted(self.clock())
        if publish:
            await self.publish_ca(self.ca_pem)

    async def publish_ca(self, ca_pem: str) -> None:
        """Set every webhook's ``clientConfig.caBundle`` of the configuration to ``ca_pem``."""
        hook = self.settings.webhook
        wanted = base64.b64encode(ca_pem.encode()).decode()
        found = await self.kube.get("MutatingWebhookConfiguration", "", hook.configuration)
        if found is None:
            log.warning("MutatingWebhookConfiguration %s does not exist: the API server will not call the sidecar "
                        "webhook (install the chart with webhook.enabled=true)", hook.configuration)
            return
        ops: list[Obj] = [{"op": "test", "path": "/metadata/resourceVersion",
                           "value": found["metadata"]["resourceVersion"]}]
        for index, entry in enumerate(found.get("webhooks") or []):
            if (entry.get("clientConfig") or {}).get("caBundle") != wanted:
                ops.append({"op": "add", "path": f"/webhooks/{index}/clientConfig/caBundle", "value": wanted})
        if len(ops) > 1:
            await self.kube.json_patch("MutatingWebhookConfiguration", "", hook.configuration, ops)
            log.info("Published the webhook CA in MutatingWebhookConfiguration %s", hook.configuration)


class InjectorServer(kopf.WebhookServer):
    """kopf's HTTPS webhook server, started once the injector is prepared, with the request's namespace
    put into the pod (a pod made by a controller has none of its own at admission time)."""

    def __init__(self, injector: Injector, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.injector = injector

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:
        while True:  # no listener before there is a certificate to serve with
            try:
                await self.injector.prepare(publish=False)
                break
            except Exception:  # RBAC, an API server not reachable yet: the log says which; try again
                log.exception("Preparing the sidecar webhook failed; retrying in %g s", PREPARE_RETRY_SECONDS)
                await asyncio.sleep(PREPARE_RETRY_SECONDS)

        async def with_namespace(request: Obj, **kwargs: Any) -> Any:
            payload = request.get("request") or {}
            obj, namespace = payload.get("object"), payload.get("namespace")
            if isinstance(obj, dict) and namespace:
                obj.setdefault("metadata", {}).setdefault("namespace", namespace)
            return await fn(request, **kwargs)

        renewing = None
        if self.injector.settings.webhook.tls == "self-managed":
            renewing = asyncio.get_running_loop().create_task(self._renew())
        try:
            unpublished = self.injector.ca_pem
            async for config in super().__call__(cast(Any, with_namespace)):
                if unpublished is not None:  # listening now: the API server may call us
                    await self._publish(unpublished)
                    unpublished = None
                yield config
        finally:
            if renewing is not None:
                renewing.cancel()

    async def _publish(self, ca_pem: str) -> None:
        while True:
            try:
                await self.injector.publish_ca(ca_pem)
                return
            except Exception:  # RBAC, an API server not reachable: the log says which; try again
                log.exception("Publishing the webhook CA failed; retrying in %g s", PREPARE_RETRY_SECONDS)
                await asyncio.sleep(PREPARE_RETRY_SECONDS)

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(RENEW_CHECK_SECONDS)
            try:
                await self.injector.ensure_certificates()
            except Exception:  # the next check retries; the current certificate is valid for weeks
                log.exception("Checking the webhook certificate failed")


def server(injector: Injector) -> InjectorServer:
    """The server for ``settings.admission.server``: HTTPS on the webhook port with the files in cert_dir."""
    hook = injector.settings.webhook
    directory = pathlib.Path(hook.cert_dir)
    return InjectorServer(injector, addr="0.0.0.0", port=hook.port, host=f"{hook.service}.{hook.namespace}.svc",
                          certfile=str(directory / certificates.TLS_CERT),
                          pkeyfile=str(directory / certificates.TLS_KEY))
