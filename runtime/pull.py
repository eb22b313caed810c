"""What ``sluice pull`` decides, as plain functions: source URIs, retry schedule, error classes, sizes,
checksums, archive safety, the completion marker. No I/O here; ``puller`` does the transfers and
calls these. docs/runtime.md ("sluice pull") documents the behaviour they add up to.

Exit codes (``ExitCode``): 0 placed or already complete, 1 unexpected failure, 2 bad arguments,
3 the source does not exist or access is denied, 4 checksum mismatch, 5 transient errors outlasted
every attempt, 6 an unsafe or broken archive, 7 the destination cannot take the model (no space, over
``--size-limit``, not writable).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import posixpath
import re
import urllib.parse
from collections.abc import Iterable, Mapping
from pathlib import Path

MARKER_NAME = ".sluice-pull.json"
"""Written last into a placed model directory: the source and digest it was pulled from. A re-run (an init
container restarted with its pod) that finds a matching marker at the destination does nothing."""
ARCHIVES = (".tar.gz", ".tgz", ".tar", ".zip")
SCHEMES = ("s3", "gs", "az", "https", "http", "pvc", "file")
OBJECT_STORES = ("s3", "gs", "az")
"""Read through fsspec (s3fs, gcsfs, adlfs: the ``storage`` extra), imported only when used."""
TRANSIENT_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed", "InternalError",
    "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequests", "ServerBusy", "OperationTimedOut",
})
"""Error codes of S3 (and S3-compatible stores) and Azure that mean "try again"."""
TRANSIENT_NAMES = ("Timeout", "Connection", "Throttl", "SlowDown", "IncompleteRead", "RemoteDisconnected",
                   "ResponseStreamingError", "ServiceUnavailable", "ServerTimeout", "TransportError",
                   "ClientPayloadError", "ServerDisconnected", "ProxyError", "ServiceRequestError",
                   "ServiceResponseError")
"""Fragments of exception class names (botocore, aiohttp, requests, google-auth, azure-core) that mean a network
or service hiccup rather than a wrong request: aiohttp's ``ClientPayloadError`` is a body cut short (gcsfs,
adlfs), gcsfs raises ``ProxyError`` for a 502, azure-core's ``ServiceRequestError`` /
``ServiceResponseError`` are a failed connection or a response that broke off."""
DENIED_NAMES = ("ClientAuthenticationError", "CredentialUnavailableError", "DefaultCredentialsError",
                "RefreshError")
"""Exception class names (azure-core, azure-identity, google-auth) of credentials that were refused or could
not be found: permanent, and reported as access denied."""
AUTH_CODES = frozenset({"AccessDenied", "AuthorizationFailure", "AuthorizationPermissionMismatch",
                        "AuthenticationFailed", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"})
MISSING_CODES = frozenset({"NoSuchBucket", "NoSuchKey", "ContainerNotFound", "BlobNotFound"})
PERMANENT_CODES = AUTH_CODES | MISSING_CODES | {"AllAccessDisabled", "InvalidBucketName"}

_SIZE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_SIZE_FACTORS = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
                 "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


class ExitCode(enum.IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2
    NOT_FOUND = 3
    CHECKSUM = 4
    GAVE_UP = 5
    BAD_ARCHIVE = 6
    DESTINATION = 7


class PullError(Exception):
    """A pull that cannot succeed; ``str()`` is the one-line message, ``exit_code`` what the process returns.
    Never retried: transient failures are other exceptions until they outlast the attempts (:class:`GaveUp`)."""

    exit_code = ExitCode.FAILED


class UsageError(PullError):
    exit_code = ExitCode.USAGE


class SourceError(PullError):
    """The source does not exist, is empty, or access to it is denied."""

    exit_code = ExitCode.NOT_FOUND


class ChecksumMismatch(PullError):
    exit_code = ExitCode.CHECKSUM


class GaveUp(PullError):
    exit_code = ExitCode.GAVE_UP


class DeadlineExceeded(GaveUp):
    """The whole pull outlasted ``--deadline-s``."""


class Stalled(Exception):
    """A body that came slower than ``--low-speed-limit`` for ``--low-speed-time-s``: transient (another
    connection may be faster), so the attempt is retried."""


class ArchiveError(PullError):
    exit_code = ExitCode.BAD_ARCHIVE


class DestinationError(PullError):
    exit_code = ExitCode.DESTINATION


class Truncated(Exception):
    """A body shorter or longer than announced (Content-Length, the listed object size): transient."""


@dataclasses.dataclass(frozen=True)
class Source:
    """A parsed ``SOURCE``: ``scheme`` and where to read: ``bucket/key`` for object stores, the URL for
    http(s), a local path for ``pvc://`` and ``file://``/plain paths."""

    scheme: str
    location: str
    display: str
    """The URI with any user info and query string removed: what logs and messages show."""

    @property
    def name(self) -> str:
        """The last path segment: the file name a single file keeps."""
        path = urllib.parse.urlsplit(self.location).path if self.scheme in ("http", "https") else self.location
        return posixpath.basename(path.rstrip("/"))


@dataclasses.dataclass(frozen=True)
class PullSettings:
    """Everything one ``sluice pull`` needs; built once by ``__main__`` from the command line."""

    source: str
    destination: Path
    sha256: str | None = None
    """Expected digest, 64 lower-case hex characters (see :func:`manifest_digest` for a prefix)."""
    retries: int = 5
    """Retries after the first attempt of each operation (listing, each file) on transient errors."""
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 30.0
    timeout_s: float = 60.0
    """Connect and read timeout of each request."""
    deadline_s: float | None = None
    """The whole pull (listing, every file, retries and the waits between them); past it, exit 5 with nothing
    placed. ``None``: no bound (a read timeout and the low-speed limit still end a stuck transfer)."""
    low_speed_limit: int = 1024
    """Bytes per second a body must average over each ``low_speed_time_s`` (as curl's ``--speed-limit``): a
    server that trickles bytes just inside the read timeout would otherwise hold the pod's init for ever."""
    low_speed_time_s: float = 60.0
    """The window of ``low_speed_limit``; 0 turns the check off."""
    allow_insecure_http: bool = False
    pvc_root: Path = Path("/mnt/pvc")
    """Where ``pvc://<claim>/<path>`` is read from: ``<pvc_root>/<claim>/<path>``."""
    size_limit: int | None = None
    """Largest model (bytes, unpacked) the destination may take; ``None``: only the free space counts."""
    progress_interval_s: float = 10.0
    """Without a terminal, a progress log line this often."""
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """The environment the credential chains read; :func:`storage_options` looks at the variables it names."""


def redact(uri: str) -> str:
    """``uri`` without user info and query (pre-signed URLs carry their signature there), for messages."""
    try:
        parts = urllib.parse.urlsplit(uri)
    except ValueError:
        return "<unparseable URI>"
    if not parts.scheme or len(parts.scheme) == 1:  # a plain (or Windows) path
        return uri
    try:
        host = parts.hostname or ""
        if parts.port is not None:
            host = f"{host}:{parts.port}"
    except ValueError:  # e.g. a password with '/' in it read as a port: show no part of the authority
        return f"{parts.scheme}://<redacted>"
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))


def redact_text(text: str) -> str:
    """Query strings and user info of any URL inside ``text`` (an exception's message) removed."""
    text = re.sub(r"(\w+://)[^/\s@]+@", r"\1", text)
    return re.sub(r"(https?://[^\s?#'\"]+)\?[^\s'\"]*", r"\1?...", text)


def parse_source(uri: str, *, allow_insecure_http: bool = False, pvc_root: Path = Path("/mnt/pvc")) -> Source:
    """Validate ``SOURCE`` or raise :class:`UsageError` naming what is allowed."""
    allowed = ("s3://bucket/path, gs://bucket/path, az://container/path, https://host/path, pvc://claim/path or "
               "a local path")
    if not uri or any(c.isspace() for c in uri):
        raise UsageError(f"source {uri!r} is not a URI; use {allowed}")
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return Source("file", str(Path(uri)), uri)
    scheme = scheme.lower()
    if scheme not in SCHEMES:
        raise UsageError(f"source scheme {scheme!r} is not supported; use {allowed}")
    display = redact(uri)
    if scheme == "http" and not allow_insecure_http:
        raise UsageError(f"{display}: plain http is refused (no integrity or secrecy in transit); use https://, "
                         "or pass --allow-insecure-http for a trusted local server")
    if scheme in ("http", "https"):
        if not urllib.parse.urlsplit(uri).hostname:
            raise UsageError(f"{display}: no host; use https://host/path")
        return Source(scheme, uri, display)
    if scheme == "file":
        return Source("file", str(Path(rest if rest.startswith("/") else "/" + rest)), display)
    bucket, _, path = rest.partition("/")
    if not bucket:
        raise UsageError(f"{display}: no {'claim' if scheme == 'pvc' else 'bucket'}; use {scheme}://"
                         f"{'claim' if scheme == 'pvc' else 'bucket'}/path")
    parts = [p for p in path.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise UsageError(f"{display}: '.' and '..' path segments are not allowed")
    if scheme == "pvc":
        return Source("pvc", str(pvc_root.joinpath(bucket, *parts)), display)
    return Source(scheme, "/".join([bucket, *parts]), display)


def parse_sha256(text: str) -> str:
    """``HEX`` or ``sha256:HEX`` (the spec's ``checksum`` form) -> 64 lower-case hex characters."""
    digest = text.removeprefix("sha256:").lower()
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise UsageError(f"--sha256 {text!r} is not a SHA-256 digest; give 64 hex characters (optionally "
                         "prefixed sha256:), as printed by a previous sluice pull or sha256sum")
    return digest


def parse_size(text: str) -> int:
    """A Kubernetes quantity of bytes (``20Gi``, ``500M``, ``1048576``) -> bytes."""
    match = _SIZE.fullmatch(text)
    if not match:
        raise UsageError(f"--size-limit {text!r} is not a size; give bytes or a quantity such as 20Gi or 500M")
    return int(float(match.group(1)) * _SIZE_FACTORS[match.group(2)])


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def backoff_delay(retry: int, *, base_s: float, cap_s: float, random01: float) -> float:
    """Seconds to wait before retry ``retry`` (1-based): ``base * 2**(retry-1)`` capped at ``cap``, then
    "equal jitter": a uniform draw from the upper half, so many pods restarted together spread out but
    none retries at once."""
    ceiling = min(cap_s, base_s * 2 ** (retry - 1))
    return ceiling / 2 + ceiling / 2 * random01


def _status(exc: BaseException) -> int | None:
    for attribute in ("code", "status", "status_code"):
        value = getattr(exc, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
            return value
    response = getattr(exc, "response", None)
    if isinstance(response, Mapping):
        value = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(value, int):
            return value
    return None


def _error_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, Mapping):
        code = response.get("Error", {}).get("Code")
        return str(code) if code is not None else None
    code = getattr(exc, "error_code", None)
    return str(code) if code is not None else None


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen and len(seen) < 10:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _denied(exc: BaseException) -> bool:
    """Refused or missing credentials: a 401/403, an authorization error code, a credential library's own
    error, or gcsfs's plain ``OSError("Forbidden: ...")`` for a 403."""
    return (isinstance(exc, PermissionError) or _status(exc) in (401, 403) or _error_code(exc) in AUTH_CODES
            or any(name in type(exc).__name__ for name in DENIED_NAMES)
            or (type(exc) is OSError and str(exc).startswith("Forbidden")))


def is_transient(exc: BaseException) -> bool:
    """Whether another attempt may succeed: throttling, 5xx, timeouts, dropped connections, short bodies.
    Not found, denied, bad requests and our own :class:`PullError` are permanent. The exception and its
    causes are looked at in order; the first that decides, decides."""
    for link in _chain(exc):
        if isinstance(link, PullError):
            return False
        if isinstance(link, Truncated | Stalled | TimeoutError | ConnectionError):
            return True
        if isinstance(link, FileNotFoundError | PermissionError | IsADirectoryError | NotADirectoryError):
            return False
        if _denied(link):
            return False
        code = _error_code(link)
        if code in TRANSIENT_CODES:
            return True
        if code in PERMANENT_CODES:
            return False
        status = _status(link)
        if status is not None:
            return status in TRANSIENT_STATUSES
        if any(fragment in type(link).__name__ for fragment in TRANSIENT_NAMES):
            return True
    # An OSError with no more to say (s3fs's EIO for an unknown service error) is most likely the network.
    return isinstance(exc, OSError) and not isinstance(exc, PullError)


def describe(exc: BaseException) -> str:
    """One line about ``exc`` for logs and the exit message, with URLs' secrets removed."""
    status, code = _status(exc), _error_code(exc)
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if status is not None and not text.startswith(("HTTP", str(status))):
        text = f"HTTP {status}: {text}"
    if code and code not in text:
        text = f"{code}: {text}"
    if isinstance(exc, OSError | TimeoutError) and type(exc).__name__ not in text:
        text = f"{type(exc).__name__}: {text}"
    return redact_text(text)


def permanent_error(exc: BaseException, what: str) -> PullError:
    """The :class:`PullError` a permanent failure of ``what`` (a redacted URI) becomes."""
    if isinstance(exc, PullError):
        return exc
    status, code = _status(exc), _error_code(exc)
    for link in _chain(exc):
        if isinstance(link, FileNotFoundError) or _status(link) == 404 or _error_code(link) in MISSING_CODES:
            return SourceError(f"{what} does not exist ({describe(exc)}); check the bucket, path and region")
        if _denied(link):
            return SourceError(f"access to {what} was denied ({describe(exc)}); check the pod's credentials "
                               "(spec.storage.secretRef, or the service account's workload identity)")
    if (status is not None and 400 <= status < 500) or code:
        return SourceError(f"{what}: the store refused the request ({describe(exc)})")
    return PullError(f"{what}: {describe(exc)}")


def check_length(expected: int | None, got: int, what: str) -> None:
    """A body must be as long as announced; raises :class:`Truncated` (retried) otherwise."""
    if expected is not None and got != expected:
        kind = "truncated" if got < expected else "longer than announced"
        raise Truncated(f"{what}: body {kind}: got {got} of {expected} bytes")


def relative_key(root: str, key: str) -> str:
    """``key`` under prefix ``root`` as a relative POSIX path, refusing anything that would leave it."""
    rel = key[len(root):].lstrip("/") if key.startswith(root) else key
    problem = member_problem(rel)
    if problem:
        raise SourceError(f"object {key!r} {problem}; refusing to write it")
    return rel


def member_problem(name: str, *, kind: str = "file", link_target: str | None = None) -> str | None:
    """Why an archive member (or a listed object) may not be written under the destination, or ``None``.

    ``kind``: ``file``, ``dir``, ``symlink``, ``hardlink`` or ``other`` (devices, fifos). Absolute names,
    ``..`` segments and links whose target leaves the model directory are refused; so are special files.
    """
    if kind == "other":
        return "is a device, fifo or other special file"
    if not name or name.startswith("/") or re.match(r"^[A-Za-z]:[\\/]", name) or "\\" in name:
        return "has an absolute or non-POSIX path"
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts) or not parts:
        return "leaves the model directory ('..' or empty path)"
    if parts[0] == MARKER_NAME:
        return f"uses the reserved name {MARKER_NAME}"
    if kind in ("symlink", "hardlink"):
        if not link_target or link_target.startswith("/"):
            return f"is a link to an absolute path {link_target!r}"
        base = parts[:-1] if kind == "symlink" else []
        depth = len(base)
        for part in link_target.split("/"):
            if part == "..":
                depth -= 1
                if depth < 0:
                    return f"is a link to {link_target!r}, outside the model directory"
            elif part not in ("", "."):
                depth += 1
    return None


def through_symlink_problem(members: list[tuple[str, str, str | None]]) -> str | None:
    """Why a set of archive members ((name, kind, link target)) would write outside the model
    directory through one of its own symlinks, or ``None``. :func:`member_problem` checks each member
    alone; a member under a symlink member (``sub/x -> ..`` then ``sub/x/f``), or a link whose target
    passes through one (``esc -> sub/x/..``), escapes however its own path reads."""
    symlinks = {"/".join(_parts(name)) for name, kind, _ in members if kind == "symlink"}
    if not symlinks:
        return None
    for name, kind, target in members:
        parts = _parts(name)
        for end in range(1, len(parts)):
            if "/".join(parts[:end]) in symlinks:
                return f"member {name!r} lies under the symlink member {'/'.join(parts[:end])!r}"
        if kind in ("symlink", "hardlink") and target:
            path = parts[:-1] if kind == "symlink" else []
            for part in target.split("/"):
                if part == "..":
                    if "/".join(path) in symlinks:
                        return f"member {name!r} links through the symlink member {'/'.join(path)!r}"
                    path = path[:-1]
                elif part not in ("", "."):
                    path = [*path, part]
                    if "/".join(path) in symlinks and path != parts:
                        return f"member {name!r} links through the symlink member {'/'.join(path)!r}"
    return None


def _parts(name: str) -> list[str]:
    return [p for p in name.split("/") if p not in ("", ".")]


def archive_format(name: str) -> str | None:
    """``tar`` or ``zip`` for an archive's file name, else ``None`` (the file is placed as it is)."""
    lowered = name.lower()
    if lowered.endswith(".zip"):
        return "zip"
    if lowered.endswith((".tar.gz", ".tgz", ".tar")):
        return "tar"
    return None


def manifest_digest(files: Iterable[tuple[str, str]]) -> str:
    """The digest of a directory: SHA-256 of the lines ``<relative path>\\t<sha256 of the file>\\n``,
    sorted by path (UTF-8, ``/`` separators). docs/runtime.md shows how to compute it with sha256sum."""
    lines = sorted(files)
    return hashlib.sha256("".join(f"{path}\t{digest}\n" for path, digest in lines).encode()).hexdigest()


def size_problem(needed: int, *, limit: int | None, free: int | None) -> str | None:
    """Why ``needed`` bytes cannot be placed (over ``--size-limit``, more than the free space), or ``None``."""
    if limit is not None and needed > limit:
        return (f"the model is {human_bytes(needed)} ({needed} bytes), over --size-limit {human_bytes(limit)}; "
                "raise the model's sizeLimit")
    if free is not None and needed > free:
        return f"the model is {human_bytes(needed)} but only {human_bytes(free)} is free at the destination"
    return None


def marker_text(source: Source, digest: str, files: int, size: int) -> str:
    return json.dumps({"source": source.display, "sha256": digest, "files": files, "bytes": size},
                      sort_keys=True) + "\n"


def marker_matches(text: str, source: Source, expected: str | None) -> str | None:
    """The recorded digest when a marker says the destination already holds ``source`` (with the
    ``expected`` digest, when one is given), else ``None``."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("source") != source.display:
        return None
    digest = data.get("sha256")
    if not isinstance(digest, str) or (expected is not None and digest != expected):
        return None
    return digest


def storage_options(scheme: str, env: Mapping[str, str], *, timeout_s: float) -> dict[str, object]:
    """fsspec keyword arguments for an object store. Credentials are never passed here: each library's own
    chain finds them in the environment (S3: AWS_* variables, IRSA's AWS_ROLE_ARN +
    AWS_WEB_IDENTITY_TOKEN_FILE, instance roles; GCS: GOOGLE_APPLICATION_CREDENTIALS, else the metadata
    server (GKE Workload Identity), else anonymous; Azure: AZURE_STORAGE_CONNECTION_STRING, or
    AZURE_STORAGE_ACCOUNT_NAME with _KEY, _SAS_TOKEN, a service principal (AZURE_STORAGE_CLIENT_ID,
    _CLIENT_SECRET, _TENANT_ID) or else DefaultAzureCredential (AKS workload identity), AZURE_STORAGE_ANON
    for a public container). Endpoints too: AWS_ENDPOINT_URL(_S3) here; gcsfs reads STORAGE_EMULATOR_HOST
    itself; an Azure connection string may name a BlobEndpoint. The libraries' own retries are turned off
    (``puller``): the puller retries (and logs each retry) itself."""
    if scheme == "s3":
        config: dict[str, object] = {"retries": {"max_attempts": 1}, "connect_timeout": timeout_s,
                                     "read_timeout": timeout_s}
        options: dict[str, object] = {"config_kwargs": config}
        endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
        if endpoint:
            # S3-compatible stores (MinIO, Ceph, R2) address buckets by path.
            options["endpoint_url"] = endpoint
            config["s3"] = {"addressing_style": "path"}
        return options
    if scheme == "gs":
        return {"requests_timeout": timeout_s}  # each HTTP request's (gcsfs's `timeout` is another thing)
    if scheme == "az":
        return {"connection_timeout": timeout_s, "read_timeout": timeout_s}
    raise ValueError(f"{scheme!r} is not an object store; one of {', '.join(OBJECT_STORES)}")


def storage_problem(scheme: str, env: Mapping[str, str]) -> str | None:
    """What the environment lacks for ``scheme`` to be read at all, or ``None``. Azure names no account in an
    ``az://`` URI: it comes from a connection string or AZURE_STORAGE_ACCOUNT_NAME."""
    if scheme == "az" and not (env.get("AZURE_STORAGE_CONNECTION_STRING") or env.get("AZURE_STORAGE_ACCOUNT_NAME")):
        return ("az:// needs the storage account: set AZURE_STORAGE_ACCOUNT_NAME (its credentials from "
                "AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN or workload identity) or "
                "AZURE_STORAGE_CONNECTION_STRING in the pod's environment (spec.storage.secretRef)")
    return None


def progress_line(done: int, total: int | None, files_done: int, files: int, elapsed_s: float) -> str:
    rate = done / elapsed_s if elapsed_s > 0 else 0.0
    amount = f"{human_bytes(done)} of {human_bytes(total)} ({100 * done // total}%)" if total else human_bytes(done)
    return f"{amount}, {files_done}/{files} files, {human_bytes(rate)}/s"
