"""Object stores on loopback for tests: gcp-storage-emulator (PyPI) for Google Cloud Storage and Azurite
(npm) for Azure Blob Storage, each behind a small recording, fault-injecting proxy.

``gcs_store(tmp)`` and ``azure_store(tmp)`` are context managers yielding a :class:`Store`: the environment a
pod would hold to reach it (credentials from the environment only: for GCS a GOOGLE_APPLICATION_CREDENTIALS
file whose token endpoint is a loopback server, for Azure Azurite's well-known development account), the
store's own client to create, write and delete objects, and the proxy, which records every request (so a
test can count what reached the store and see the credentials sent), answers scripted faults in place of
the store (a status with the store's error body, or a body cut short) and can be switched ``down`` (every
connection closed unanswered). Used by tests/runtime (``sluice pull`` and cloud model repositories); the
pytest fixtures that start them once per module are in tests/runtime/conftest.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import http.server
import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
AZURITE_PACKAGE = "azurite@3.35.0"  # as .ci/tools.sh installs it
AZURITE_DIR = ROOT / ".tools" / "azurite"
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
"""Azurite's published development account (the same in every Azurite): not a secret."""
TOKEN = "sluice-test-access-token"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_http(handler: type[http.server.BaseHTTPRequestHandler]) -> http.server.ThreadingHTTPServer:
    """``handler`` served on a loopback port. Its headers and body go out in two writes: TCP_NODELAY keeps
    Nagle from holding the body until the client's delayed ACK (~40 ms a response); shutdown() returns
    within the 50 ms poll."""
    handler.disable_nagle_algorithm = True
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


@dataclasses.dataclass
class Fault:
    status: int | None = None
    """Answer this status (with ``body`` and ``headers``) instead of the store; ``None``: cut the store's
    body short (the whole length announced, half sent, the connection closed)."""
    body: bytes = b""
    headers: dict[str, str] = dataclasses.field(default_factory=dict)


class Proxy:
    """Forwards each request to ``upstream`` as it came; ``faults`` are used up, in order, by the requests that
    ``is_read`` says fetch an object's bytes."""

    def __init__(self, upstream_port: int, is_read: Callable[[str, str], bool]) -> None:
        self.upstream_port, self.is_read = upstream_port, is_read
        self.requests: list[tuple[str, str, str]] = []  # method, path, Authorization
        self.faults: list[Fault] = []
        self.down = False
        """While true, every connection is closed without an answer: the store cannot be reached."""
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def handle_one(self) -> None:
                if proxy.down:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                with proxy.lock:
                    proxy.requests.append((self.command, self.path, self.headers.get("Authorization", "")))
                    fault = proxy.faults.pop(0) if proxy.faults and proxy.is_read(self.command, self.path) else None
                if fault is not None and fault.status is not None:
                    self.send_response(fault.status)
                    for key, value in fault.headers.items():
                        self.send_header(key, value)
                    self.send_header("Content-Length", str(len(fault.body)))
                    self.end_headers()
                    self.wfile.write(fault.body)
                    return
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "keep-alive")}
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    data = response.read()
                finally:
                    upstream.close()
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in ("connection", "keep-alive", "transfer-encoding", "content-length"):
                        self.send_header(key, value)
                if self.command == "HEAD":
                    self.send_header("Content-Length", response.getheader("Content-Length") or "0")
                    self.end_headers()
                    return
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if fault is not None:  # cut short
                    self.wfile.write(data[: len(data) // 2])
                    self.close_connection = True
                    return
                self.wfile.write(data)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = handle_one

            def log_message(self, *args: object) -> None:
                pass

        self.server = serve_http(Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def reads(self) -> list[str]:
        with self.lock:
            return [path for method, path, _ in self.requests if self.is_read(method, path)]

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()
            self.faults.clear()
            self.down = False

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclasses.dataclass
class Store:
    scheme: str
    proxy: Proxy
    env: dict[str, str]
    """What a pod's environment would hold to reach the store (set in os.environ by the fixture, too)."""
    put: Callable[[str, dict[str, bytes]], None]
    """Create a bucket/container holding these objects, with the store's own client (not the puller's)."""
    add: Callable[[str, dict[str, bytes]], None]
    """Write these objects (new, or over existing ones) into an existing bucket/container."""
    delete: Callable[[str, str], None]
    """Delete one object of a bucket/container."""
    authorization: str
    """How every request the puller sends must start its Authorization header."""
    denied: Fault
    """The store's own answer when the credentials may not read an object."""
    throttled: Fault


class TokenHandler(http.server.BaseHTTPRequestHandler):
    """An OAuth token endpoint: where google-auth trades the service account's signed assertion for a token."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"access_token": TOKEN, "expires_in": 3600, "token_type": "Bearer"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def gcs_store(tmp: Path) -> Iterator[Store]:
    from gcp_storage_emulator.server import create_server

    port = free_port()
    emulator = create_server("127.0.0.1", port, in_memory=True)
    emulator.start()
    tokens = serve_http(TokenHandler)
    proxy = Proxy(port, lambda method, path: method == "GET" and "alt=media" in path)
    credentials = tmp / "service-account.json"
    from cryptography.hazmat.primitives import serialization  # only GCS needs a key: not imported on GPU runs
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    credentials.write_text(json.dumps({  # a key file as the console gives it, its token endpoint the test's
        "type": "service_account", "project_id": "sluice-test", "private_key_id": "1", "private_key": key.decode(),
        "client_email": "puller@sluice-test.iam.gserviceaccount.com", "client_id": "1",
        "token_uri": f"http://127.0.0.1:{tokens.server_address[1]}/token"}))
    closed = f"127.0.0.1:{free_port()}"  # nothing listens: a metadata server lookup would stay on loopback
    env = {"STORAGE_EMULATOR_HOST": proxy.url, "GOOGLE_APPLICATION_CREDENTIALS": str(credentials),
           "CLOUDSDK_CONFIG": str(tmp / "gcloud"), "NO_GCE_CHECK": "true", "GCE_METADATA_HOST": closed,
           "GCE_METADATA_IP": closed}
    api = f"http://127.0.0.1:{port}"

    def call(url: str, data: bytes | None, content_type: str, method: str = "POST") -> None:
        request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": content_type})
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()

    def add(bucket: str, objects: dict[str, bytes]) -> None:
        for key, body in objects.items():
            name = urllib.parse.quote(key, safe="")
            if body:
                call(f"{api}/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}", body,
                     "application/octet-stream")
                continue
            # An empty object (a console's "folder"): the emulator's media upload needs a body; multipart works.
            boundary = "sluice-test-boundary"
            multipart = (f"--{boundary}\r\nContent-Type: application/json\r\n\r\n{json.dumps({'name': key})}\r\n"
                         f"--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n\r\n--{boundary}--\r\n")
            call(f"{api}/upload/storage/v1/b/{bucket}/o?uploadType=multipart", multipart.encode(),
                 f"multipart/related; boundary={boundary}")

    def put(bucket: str, objects: dict[str, bytes]) -> None:
        call(f"{api}/storage/v1/b?project=sluice-test", json.dumps({"name": bucket}).encode(), "application/json")
        add(bucket, objects)

    def delete(bucket: str, key: str) -> None:
        call(f"{api}/storage/v1/b/{bucket}/o/{urllib.parse.quote(key, safe='')}", None, "application/json", "DELETE")

    def error(status: int, reason: str, message: str) -> Fault:
        body = json.dumps({"error": {"code": status, "message": message,
                                     "errors": [{"reason": reason, "message": message}]}}).encode()
        return Fault(status, body, {"Content-Type": "application/json"})

    try:
        yield Store("gs", proxy, env, put, add, delete, f"Bearer {TOKEN}",
                    error(403, "forbidden", "sluice-test@example.iam does not have storage.objects.get access"),
                    error(429, "rateLimitExceeded", "The rate of requests is too high"))
    finally:
        proxy.close()
        tokens.shutdown()
        tokens.server_close()
        emulator.stop()


def azurite_command() -> Path:
    """Azurite's blob server, installed under .tools by .ci/tools.sh, or here when that has not run yet."""
    executable = AZURITE_DIR / "node_modules" / ".bin" / "azurite-blob"
    if executable.exists():
        return executable
    if not (shutil.which("node") and shutil.which("npm")):
        pytest.skip("Azurite (the Azure Storage emulator) needs node and npm, which this machine lacks")
    AZURITE_DIR.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["npm", "install", "--prefix", str(AZURITE_DIR), "--silent", "--no-audit", "--no-fund",
                           "--omit=dev", "--no-package-lock", AZURITE_PACKAGE],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and executable.exists(), f"npm install {AZURITE_PACKAGE} failed: {done.stderr}"
    (AZURITE_DIR / "installed").write_text(f"{AZURITE_PACKAGE}\n")
    return executable


@contextlib.contextmanager
def azure_store(tmp: Path) -> Iterator[Store]:
    from azure.storage.blob import BlobServiceClient

    executable = azurite_command()
    port = free_port()
    process = subprocess.Popen(
        [str(executable), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(tmp / "azurite"),
         "--skipApiVersionCheck", "--loose", "--silent"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if process.poll() is not None:
                    output = process.stdout.read().decode() if process.stdout else ""
                    pytest.fail(f"azurite exited with {process.returncode}: {output}")
                assert time.monotonic() < deadline, "azurite did not listen within 30 s"
                time.sleep(0.05)

        def is_read(method: str, path: str) -> bool:  # a blob's bytes: no listing, no properties
            return method == "GET" and "comp=" not in path and "restype=" not in path

        proxy = Proxy(port, is_read)

        def connection_string(endpoint: str) -> str:
            return (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
                    f"BlobEndpoint={endpoint}/{AZURITE_ACCOUNT};")

        client = BlobServiceClient.from_connection_string(connection_string(f"http://127.0.0.1:{port}"))

        def add(container: str, objects: dict[str, bytes]) -> None:
            for key, body in objects.items():
                client.get_container_client(container).upload_blob(key, body, overwrite=True)

        def put(container: str, objects: dict[str, bytes]) -> None:
            client.create_container(container)
            add(container, objects)

        def delete(container: str, key: str) -> None:
            client.get_container_client(container).delete_blob(key)

        def error(status: int, code: str, message: str) -> Fault:
            body = (f'<?xml version="1.0" encoding="utf-8"?><Error><Code>{code}</Code><Message>{message}'
                    "</Message></Error>").encode()
            return Fault(status, body, {"Content-Type": "application/xml", "x-ms-error-code": code})

        try:
            env = {"AZURE_STORAGE_CONNECTION_STRING": connection_string(proxy.url)}
            yield Store("az", proxy, env, put, add, delete,
                        f"SharedKey {AZURITE_ACCOUNT}:",
                        error(403, "AuthorizationPermissionMismatch",
                              "This request is not authorized to perform this operation using this permission."),
                        error(503, "ServerBusy", "The server is busy."))
        finally:
            proxy.close()
            client.close()
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


CLEARED = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST",
           "AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY",
           "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_CLIENT_ID", "AZURE_STORAGE_CLIENT_SECRET", "AZURE_STORAGE_ANON",
           "AZURE_CLIENT_ID", "AZURE_TENANT_ID", "AZURE_FEDERATED_TOKEN_FILE")
"""Variables that point a client at a store or carry its credentials: cleared before a store's own are set."""
