"""``sluice pull`` from gs:// and az:// against emulators started on loopback, read through gcsfs and adlfs
exactly as in a pod: gcp-storage-emulator (PyPI) stands in for Google Cloud Storage, Azurite (npm) for Azure
Blob Storage (tests/support/sluice_testing/storage_emulators.py; the ``store`` fixture of conftest.py starts
each once for the module). Between the puller and each emulator sits a small loopback proxy that records
every request (so a test can count what reached the store and see the credentials sent) and answers scripted
faults in place of the store (a status with the store's error body, or a body cut short). Credentials come
from the environment only, as in a pod: for GCS a GOOGLE_APPLICATION_CREDENTIALS file whose token endpoint is
a loopback server of the test, for Azure Azurite's well-known development account in
AZURE_STORAGE_CONNECTION_STRING. Retries use a recorded fake sleep."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from sluice.runtime import pull, puller
from sluice.runtime.pull import PullSettings
from sluice_testing.storage_emulators import AZURITE_KEY, CLEARED, TOKEN, Fault, Store

MODEL = {"model.onnx": b"\x08\x07onnx-bytes" * 1000, "sub/vocab.txt": b"a\nb\nc\n", "config.extra": b"{}"}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest(files: dict[str, bytes]) -> str:
    return sha("".join(sorted(f"{path}\t{sha(body)}\n" for path, body in files.items())).encode())


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != pull.MARKER_NAME}


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".sluice-pull" in p.name) if parent.exists() else []


def tar_gz(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, body in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(body)
            archive.addfile(info, io.BytesIO(body))
    return buffer.getvalue()


class Sleeps(list):
    def __call__(self, seconds: float) -> None:
        self.append(seconds)


_buckets = iter(range(10**6))


def bucket(store: Store, objects: dict[str, bytes]) -> str:
    """A new bucket (container) holding ``objects``; its name."""
    name = f"models-{next(_buckets)}"
    store.put(name, objects)
    return name


def settings(store: Store, path: str, destination: Path, **extra) -> PullSettings:
    return PullSettings(source=f"{store.scheme}://{path}", destination=destination, env=dict(os.environ),
                        retries=2, **extra)


# ---------------------------------------------------------------- pulls

def test_a_prefix_is_pulled_recursively_with_the_pods_credentials(store, tmp_path):
    name = bucket(store, {**{f"resnet/1/{k}": v for k, v in MODEL.items()},
                          "resnet/10/model.onnx": b"another version", "resnet/1.txt": b"a sibling"})
    destination = tmp_path / "repo" / "resnet" / "1"
    result = puller.pull_model(settings(store, f"{name}/resnet/1", destination))
    assert tree(destination) == MODEL
    assert result.digest == manifest(MODEL)
    assert (result.files, result.size) == (3, sum(map(len, MODEL.values())))
    assert leftovers(destination.parent) == []
    assert len(store.proxy.reads()) == 3
    assert store.proxy.requests and all(auth.startswith(store.authorization) for _, _, auth in store.proxy.requests)


def test_a_single_object_keeps_its_name_and_is_checked_against_its_own_digest(store, tmp_path):
    body = b"onnx" * 5000
    name = bucket(store, {"exports/resnet.onnx": body})
    destination = tmp_path / "resnet" / "1"
    result = puller.pull_model(settings(store, f"{name}/exports/resnet.onnx", destination,
                                        sha256=f"sha256:{sha(body)}"))
    assert tree(destination) == {"resnet.onnx": body} and result.digest == sha(body)


def test_an_archive_object_is_unpacked(store, tmp_path):
    archive = tar_gz(MODEL)
    name = bucket(store, {"m/model.tar.gz": archive})
    destination = tmp_path / "m" / "1"
    assert puller.pull_model(settings(store, f"{name}/m/model.tar.gz", destination)).digest == sha(archive)
    assert tree(destination) == MODEL


def test_a_wrong_checksum_places_nothing(store, tmp_path):
    name = bucket(store, {f"m/1/{k}": v for k, v in MODEL.items()})
    destination = tmp_path / "m" / "1"
    with pytest.raises(pull.ChecksumMismatch) as err:
        puller.pull_model(settings(store, f"{name}/m/1", destination, sha256="ab" * 32))
    assert f"expected sha256:{'ab' * 32}, got sha256:{manifest(MODEL)}" in str(err.value)
    assert err.value.exit_code == 4
    assert not destination.exists() and leftovers(destination.parent) == []


@pytest.mark.parametrize("missing", ["an object", "a bucket"])
def test_a_missing_object_or_bucket_fails_at_once(store, tmp_path, missing):
    name = bucket(store, {"other/1/model.onnx": b"x"})
    path = f"{name}/nope/1" if missing == "an object" else f"no-such-{name}/m/1"
    sleeps = Sleeps()
    destination = tmp_path / "m" / "1"
    with pytest.raises(pull.SourceError, match="does not exist") as err:
        puller.pull_model(settings(store, path, destination), sleep=sleeps)
    assert err.value.exit_code == 3 and sleeps == []
    assert f"{store.scheme}://{path}" in str(err.value)
    assert not destination.exists()


def test_denied_reads_fail_at_once_as_denied(store, tmp_path):
    name = bucket(store, {"m/1/model.onnx": b"weights"})
    store.proxy.faults = [store.denied] * 3
    sleeps = Sleeps()
    with pytest.raises(pull.SourceError, match="was denied") as err:
        puller.pull_model(settings(store, f"{name}/m/1", tmp_path / "m" / "1"), sleep=sleeps)
    assert err.value.exit_code == 3 and sleeps == []
    assert len(store.proxy.reads()) == 1  # neither the library nor the puller asked again


def test_throttling_is_retried_by_the_puller_alone(store, tmp_path, caplog):
    body = bytes(range(256)) * 64
    name = bucket(store, {"m/1/model.onnx": body})
    store.proxy.faults = [store.throttled, store.throttled]
    sleeps = Sleeps()
    destination = tmp_path / "m" / "1"
    with caplog.at_level(logging.WARNING, logger="sluice.runtime.pull"):
        result = puller.pull_model(settings(store, f"{name}/m/1", destination), sleep=sleeps, rand=lambda: 1.0)
    assert tree(destination) == {"model.onnx": body} and result.digest == manifest({"model.onnx": body})
    assert len(store.proxy.reads()) == 3  # one per attempt: the library's own retries are off
    assert sleeps == [1.0, 2.0]
    retries = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) == 2 and all(str(store.throttled.status) in message for message in retries)


def test_a_body_cut_short_is_read_again(store, tmp_path):
    body = bytes(range(256)) * 64
    name = bucket(store, {"m/1/model.onnx": body})
    store.proxy.faults = [Fault(None)]
    sleeps = Sleeps()
    destination = tmp_path / "m" / "1"
    result = puller.pull_model(settings(store, f"{name}/m/1", destination), sleep=sleeps, rand=lambda: 1.0)
    assert tree(destination) == {"model.onnx": body} and result.digest == manifest({"model.onnx": body})
    assert len(store.proxy.reads()) == 2
    # gcsfs reports it (aiohttp's ClientPayloadError) and the puller retries; azure-storage-blob's downloader
    # reads a cut body again itself (up to 3 times, 1 s apart: fixed in the SDK) before the puller sees it.
    assert sleeps == ([1.0] if store.scheme == "gs" else [])


def test_a_store_that_keeps_failing_is_given_up_after_the_bounded_attempts(store, tmp_path):
    name = bucket(store, {"m/1/model.onnx": b"weights"})
    store.proxy.faults = [store.throttled] * 10
    sleeps = Sleeps()
    destination = tmp_path / "m" / "1"
    with pytest.raises(pull.GaveUp, match="gave up after 3 attempts") as err:
        puller.pull_model(settings(store, f"{name}/m/1", destination), sleep=sleeps)
    assert err.value.exit_code == 5 and len(sleeps) == 2
    assert len(store.proxy.reads()) == 3
    assert not destination.exists() and leftovers(destination.parent) == []


def test_the_command_pulls_with_credentials_from_its_environment(store, tmp_path):
    name = bucket(store, {f"model/1/{k}": v for k, v in MODEL.items()})
    executable = shutil.which("sluice", path=os.path.dirname(sys.executable))
    assert executable, "the sluice command is not installed next to the interpreter"
    destination = tmp_path / "models" / "model" / "1"
    done = subprocess.run([executable, "pull", f"{store.scheme}://{name}/model/1", str(destination)],
                          env=dict(os.environ), cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"sha256:{manifest(MODEL)}" in done.stdout
    assert tree(destination) == MODEL
    assert AZURITE_KEY not in done.stdout + done.stderr and TOKEN not in done.stdout + done.stderr
    missing = subprocess.run([executable, "pull", f"{store.scheme}://{name}/model/2", str(tmp_path / "x")],
                             env=dict(os.environ), cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 3, missing.stderr
    assert f"sluice pull: error: {store.scheme}://{name}/model/2 does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_azure_without_an_account_is_a_usage_error_naming_the_variables(tmp_path, monkeypatch):
    for key in CLEARED:
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(pull.UsageError, match="AZURE_STORAGE_ACCOUNT_NAME") as err:
        puller.pull_model(PullSettings(source="az://models/m/1", destination=tmp_path / "m", env=dict(os.environ)))
    assert err.value.exit_code == 2 and "AZURE_STORAGE_CONNECTION_STRING" in str(err.value)
