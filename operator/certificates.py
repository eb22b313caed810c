"""The sidecar webhook's self-managed TLS: a CA and a serving certificate, and when to renew them.

Pure apart from the randomness of key generation; the clock is passed in. ``webhook`` (the I/O) keeps
the result in a Secret shared by every operator replica and publishes the CA as the
MutatingWebhookConfiguration's ``caBundle``. The serving certificate is renewed with the same CA, so the
published ``caBundle`` stays valid across renewals and replicas still serving the previous certificate
are trusted too; only a CA close to its end is replaced (and the caBundle with it).

``cryptography`` comes with the ``operator`` extra and is imported only when a certificate is made or read.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

CA_DAYS = 3650
SERVING_DAYS = 365
RENEW_SERVING_BEFORE = datetime.timedelta(days=30)
RENEW_CA_BEFORE = datetime.timedelta(days=400)
"""A CA with less left than this is replaced: more than a serving certificate's life, so no serving
certificate outlives the CA that signed it."""
CA_CERT, CA_KEY, TLS_CERT, TLS_KEY = "ca.crt", "ca.key", "tls.crt", "tls.key"
PREVIOUS_CA_CERT = "ca.previous.crt"
"""The CA a new one replaced, still trusted (published beside it) until it expires: a replica still
serving a certificate it signed is not refused while it picks the new one up."""
"""Keys of the Secret (``tls.crt``/``tls.key`` as in a ``kubernetes.io/tls`` Secret)."""

KEEP, RENEW_SERVING, NEW_CA = "keep", "renew-serving", "new-ca"


@dataclasses.dataclass(frozen=True)
class Bundle:
    """PEM texts of the CA and the serving certificate with their keys."""

    ca_cert: str
    ca_key: str
    cert: str
    key: str
    previous_ca_cert: str = ""

    def as_data(self) -> dict[str, str]:
        data = {CA_CERT: self.ca_cert, CA_KEY: self.ca_key, TLS_CERT: self.cert, TLS_KEY: self.key}
        if self.previous_ca_cert:
            data[PREVIOUS_CA_CERT] = self.previous_ca_cert
        return data

    @classmethod
    def from_data(cls, data: Mapping[str, str]) -> Bundle | None:
        if not all(data.get(k) for k in (CA_CERT, CA_KEY, TLS_CERT, TLS_KEY)):
            return None
        return cls(data[CA_CERT], data[CA_KEY], data[TLS_CERT], data[TLS_KEY], data.get(PREVIOUS_CA_CERT, ""))

    def trusted(self, now: datetime.datetime) -> str:
        """The caBundle: the CA, and the one it replaced while that is still valid."""
        previous = self.previous_ca_cert
        if previous:
            try:
                if _load(previous).not_valid_after_utc <= now:
                    previous = ""
            except ValueError:
                previous = ""
        return self.ca_cert + (previous if previous.startswith("-----") else "")


def dns_names(service: str, namespace: str, cluster_domain: str) -> list[str]:
    """The names the API server may call the webhook Service by."""
    svc = f"{service}.{namespace}.svc"
    return [service, f"{service}.{namespace}", svc, f"{svc}.{cluster_domain}"]


def decide(bundle: Bundle | None, names: Sequence[str], now: datetime.datetime) -> str:
    """``keep``, ``renew-serving`` (expiring within 30 days, or issued for other names) or ``new-ca``
    (none yet, unreadable, or the CA expires within 400 days)."""
    if bundle is None:
        return NEW_CA
    try:
        ca, serving = _load(bundle.ca_cert), _load(bundle.cert)
    except ValueError:
        return NEW_CA
    if ca.not_valid_after_utc - now < RENEW_CA_BEFORE:
        return NEW_CA
    if serving.not_valid_after_utc - now < RENEW_SERVING_BEFORE or sorted(_names(serving)) != sorted(names):
        return RENEW_SERVING
    if serving.issuer != ca.subject:
        return RENEW_SERVING
    return KEEP


def issue(bundle: Bundle | None, action: str, names: Sequence[str], now: datetime.datetime) -> Bundle:
    """A bundle after ``action``: a new CA and serving certificate, or a serving certificate from the CA."""
    from cryptography.hazmat.primitives import serialization

    if action == KEEP and bundle is not None:
        return bundle
    previous = bundle.previous_ca_cert if bundle is not None else ""
    if action == NEW_CA or bundle is None:
        if bundle is not None:
            previous = bundle.ca_cert  # still trusted until it expires (Bundle.trusted)
        ca_key = _key()
        ca_cert = _certificate("sluice-webhook-ca", ca_key.public_key(), ca_key, None, now, CA_DAYS, names=(),
                               ca=True)
        ca_cert_pem = ca_cert.public_bytes(serialization.Encoding.PEM).decode()
        ca_key_pem = _pem(ca_key)
    else:
        ca_cert_pem, ca_key_pem = bundle.ca_cert, bundle.ca_key
    ca_key = serialization.load_pem_private_key(ca_key_pem.encode(), password=None)
    key = _key()
    cert = _certificate(names[0], key.public_key(), ca_key, _load(ca_cert_pem), now, SERVING_DAYS, names=names,
                        ca=False)
    return Bundle(ca_cert_pem, ca_key_pem, cert.public_bytes(serialization.Encoding.PEM).decode(), _pem(key),
                  previous)


def _load(pem: str) -> Any:  # cryptography's Certificate (imported lazily, hence Any)
    from cryptography import x509

    return x509.load_pem_x509_certificate(pem.encode())


def _names(cert: Any) -> list[str]:
    from cryptography import x509

    try:
        extension = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    return list(extension.value.get_values_for_type(x509.DNSName))


def _key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _pem(key: Any) -> str:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


def _certificate(
    common_name: str, public_key: Any, signing_key: Any, issuer_cert: Any, now: datetime.datetime, days: int, *,
    names: Sequence[str], ca: bool,
) -> Any:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_cert.subject if issuer_cert is not None else subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # clock skew between replicas and API server
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
    )
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
    else:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]),
                                        critical=False)
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    return builder.sign(signing_key, hashes.SHA256())


def expiry(pem: str) -> datetime.datetime:
    """When the certificate in ``pem`` expires."""
    result: datetime.datetime = _load(pem).not_valid_after_utc
    return result
