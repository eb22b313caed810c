"""``sluice pull`` against real servers on loopback: an S3-compatible store (moto's server mode, spoken to
by s3fs exactly as in a pod) and a local HTTP server scripted per test. Retries use a recorded fake
sleep, never a real one. The pure decisions (schedule, error classes, archive safety, digests) are
tables at the end."""

from __future__ import annotations

import hashlib
import http.server
import io
import logging
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from sluice.runtime import pull, puller
from sluice.runtime.pull import PullSettings

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(s3_endpoint, monkeypatch, tmp_path):
    """A boto3 client of the moto server (the "other client"), with the pod-like environment set."""
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    return boto3.client("s3", endpoint_url=s3_endpoint)


def bucket(client, name: str, objects: dict[str, bytes]) -> None:
    client.create_bucket(Bucket=name)
    for key, body in objects.items():
        client.put_object(Bucket=name, Key=key, Body=body)


def delete_bucket(client, name: str) -> None:
    for entry in client.list_objects_v2(Bucket=name).get("Contents", []):
        client.delete_object(Bucket=name, Key=entry["Key"])
    client.delete_bucket(Bucket=name)


class Sleeps(list):
    def __call__(self, seconds: float) -> None:
        self.append(seconds)


def settings(source: str, destination: Path, endpoint: str | None = None, **extra) -> PullSettings:
    env = {"AWS_ENDPOINT_URL": endpoint} if endpoint else {}
    return PullSettings(source=source, destination=destination, env=env, retries=2, **extra)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest(files: dict[str, bytes]) -> str:
    lines = sorted(f"{path}\t{sha(body)}\n" for path, body in files.items())
    return sha("".join(lines).encode())


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".sluice-pull" in p.name) if parent.exists() else []


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != pull.MARKER_NAME}


MODEL = {"model.onnx": b"\x08\x07onnx-bytes" * 1000, "sub/vocab.txt": b"a\nb\nc\n", "config.extra": b"{}"}


# ---------------------------------------------------------------- S3 (moto)

def test_a_prefix_is_pulled_recursively_and_placed_with_its_manifest_digest(s3, s3_endpoint, tmp_path):
    bucket(s3, "models-prefix", {**{f"resnet/1/{k}": v for k, v in MODEL.items()},
                                 "resnet/10/model.onnx": b"another version", "resnet/1.txt": b"a sibling"})
    destination = tmp_path / "repo" / "resnet" / "1"
    result = puller.pull_model(settings("s3://models-prefix/resnet/1", destination, s3_endpoint))
    assert tree(destination) == MODEL
    assert result.digest == manifest(MODEL)
    assert (result.files, result.size, result.skipped) == (3, sum(map(len, MODEL.values())), False)
    assert leftovers(destination.parent) == []


def test_a_single_object_keeps_its_name_and_its_digest_is_the_files(s3, s3_endpoint, tmp_path):
    body = b"onnx" * 5000
    bucket(s3, "models-file", {"exports/resnet.onnx": body})
    destination = tmp_path / "resnet" / "1"
    result = puller.pull_model(settings("s3://models-file/exports/resnet.onnx", destination, s3_endpoint))
    assert tree(destination) == {"resnet.onnx": body}
    assert result.digest == sha(body)


def tar_gz(files: dict[str, bytes], *, extra: list[tarfile.TarInfo] = ()) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, body in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(body)
            archive.addfile(info, io.BytesIO(body))
        for info in extra:
            archive.addfile(info)
    return buffer.getvalue()


def test_an_archive_is_unpacked_and_verified_against_the_archive_digest(s3, s3_endpoint, tmp_path):
    archive = tar_gz(MODEL)
    bucket(s3, "models-archive", {"resnet/model.tar.gz": archive})
    destination = tmp_path / "resnet" / "1"
    result = puller.pull_model(settings("s3://models-archive/resnet/model.tar.gz", destination, s3_endpoint,
                                        sha256=f"sha256:{sha(archive)}"))
    assert tree(destination) == MODEL
    assert result.digest == sha(archive)
    assert leftovers(destination.parent) == []


def test_a_prefix_holding_one_file_is_still_a_prefix(s3, s3_endpoint, tmp_path):
    bucket(s3, "models-one", {"m/1/model.tar.gz": b"not unpacked"})
    result = puller.pull_model(settings("s3://models-one/m/1", tmp_path / "m" / "1", s3_endpoint))
    assert tree(tmp_path / "m" / "1") == {"model.tar.gz": b"not unpacked"}
    assert result.digest == manifest({"model.tar.gz": b"not unpacked"})


def test_a_zip_archive_is_unpacked(s3, s3_endpoint, tmp_path):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, body in MODEL.items():
            archive.writestr(name, body)
    bucket(s3, "models-zip", {"m.zip": buffer.getvalue()})
    destination = tmp_path / "m" / "1"
    puller.pull_model(settings("s3://models-zip/m.zip", destination, s3_endpoint))
    assert tree(destination) == MODEL


def test_an_archive_that_escapes_is_refused_and_nothing_is_written(s3, s3_endpoint, tmp_path):
    link = tarfile.TarInfo("model/weights")
    link.type, link.linkname = tarfile.SYMTYPE, "../../../etc/passwd"
    bucket(s3, "models-evil", {"a.tgz": tar_gz({"model.onnx": b"x"}, extra=[link]),
                               "b.tgz": tar_gz({"../outside.txt": b"x"})})
    for key in ("a.tgz", "b.tgz"):
        destination = tmp_path / key / "1"
        with pytest.raises(pull.ArchiveError, match=r"outside the model directory|leaves the model directory") as err:
            puller.pull_model(settings(f"s3://models-evil/{key}", destination, s3_endpoint))
        assert err.value.exit_code == 6
        assert not destination.exists() and leftovers(destination.parent) == []
    assert not (tmp_path / "outside.txt").exists()


def test_a_rerun_finds_the_complete_model_and_does_not_download_again(s3, s3_endpoint, tmp_path):
    bucket(s3, "models-rerun", {f"m/1/{k}": v for k, v in MODEL.items()})
    destination = tmp_path / "m" / "1"
    first = puller.pull_model(settings("s3://models-rerun/m/1", destination, s3_endpoint))
    delete_bucket(s3, "models-rerun")  # a second download could only fail now
    again = puller.pull_model(settings("s3://models-rerun/m/1", destination, s3_endpoint, sha256=first.digest))
    assert again.skipped and again.digest == first.digest
    assert tree(destination) == MODEL
    # Another expected digest is not "complete": it is pulled again (and here fails: the bucket is gone).
    with pytest.raises(pull.SourceError):
        puller.pull_model(settings("s3://models-rerun/m/1", destination, s3_endpoint, sha256="0" * 64))
    assert tree(destination) == MODEL  # the failed re-pull left the previous complete model alone


def test_a_wrong_checksum_places_nothing_and_names_expected_and_got(s3, s3_endpoint, tmp_path):
    bucket(s3, "models-checksum", {f"m/1/{k}": v for k, v in MODEL.items()})
    destination = tmp_path / "m" / "1"
    with pytest.raises(pull.ChecksumMismatch) as err:
        puller.pull_model(settings("s3://models-checksum/m/1", destination, s3_endpoint, sha256="ab" * 32))
    assert f"expected sha256:{'ab' * 32}, got sha256:{manifest(MODEL)}" in str(err.value)
    assert err.value.exit_code == 4
    assert not destination.exists() and leftovers(destination.parent) == []


@pytest.mark.parametrize(("uri", "missing"), [
    ("s3://models-missing/nope/1", "s3://models-missing/nope/1"),
    ("s3://no-such-bucket-here/m/1", "s3://no-such-bucket-here/m/1"),
])
def test_a_missing_key_or_bucket_is_not_retried(s3, s3_endpoint, tmp_path, uri, missing):
    bucket(s3, "models-missing", {"other/1/model.onnx": b"x"})
    sleeps = Sleeps()
    destination = tmp_path / "m" / "1"
    with pytest.raises(pull.SourceError) as err:
        puller.pull_model(settings(uri, destination, s3_endpoint), sleep=sleeps)
    assert sleeps == []
    assert err.value.exit_code == 3
    assert missing in str(err.value) and ("does not exist" in str(err.value) or "holds no files" in str(err.value))
    assert not destination.exists()


class DeleteBucketAfterFirstFile(puller.Observer):
    def __init__(self, client, name: str) -> None:
        self.client, self.name, self.files = client, name, 0

    def file_done(self, file):
        self.files += 1
        if self.files == 1:
            delete_bucket(self.client, self.name)


def test_a_bucket_deleted_mid_download_fails_cleanly_with_nothing_placed(s3, s3_endpoint, tmp_path):
    bucket(s3, "models-vanishing", {f"m/1/{k}": v for k, v in MODEL.items()})
    destination = tmp_path / "m" / "1"
    observer = DeleteBucketAfterFirstFile(s3, "models-vanishing")
    sleeps = Sleeps()
    with pytest.raises(pull.SourceError, match="does not exist") as err:
        puller.pull_model(settings("s3://models-vanishing/m/1", destination, s3_endpoint), observer=observer,
                          sleep=sleeps)
    assert observer.files == 1 and sleeps == []
    assert "models-vanishing" in str(err.value)
    assert not destination.exists() and leftovers(destination.parent) == []


def test_a_model_over_the_size_limit_is_refused_before_download(s3, s3_endpoint, tmp_path):
    bucket(s3, "models-big", {f"m/1/{k}": v for k, v in MODEL.items()})
    destination = tmp_path / "m" / "1"
    with pytest.raises(pull.DestinationError, match="over --size-limit") as err:
        puller.pull_model(settings("s3://models-big/m/1", destination, s3_endpoint, size_limit=1000))
    assert err.value.exit_code == 7 and not destination.exists()


def test_the_command_pulls_from_an_s3_compatible_store_named_by_the_environment(s3, s3_endpoint, tmp_path):
    bucket(s3, "bucket", {f"model/1/{k}": v for k, v in MODEL.items()})
    executable = shutil.which("sluice", path=os.path.dirname(sys.executable))
    assert executable, "the sluice command is not installed next to the interpreter"
    env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": s3_endpoint,
           "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}
    destination = tmp_path / "models" / "model" / "1"
    done = subprocess.run([executable, "pull", "s3://bucket/model/1", str(destination)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"sha256:{manifest(MODEL)}" in done.stdout
    assert tree(destination) == MODEL
    assert CREDENTIALS["AWS_SECRET_ACCESS_KEY"] not in done.stdout + done.stderr
    missing = subprocess.run([executable, "pull", "s3://bucket/model/2", str(tmp_path / "x")], env=env,
                             cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 3
    assert "sluice pull: error: s3://bucket/model/2" in missing.stderr
    assert "Traceback" not in missing.stderr


# ---------------------------------------------------------------- HTTP

class Script:
    """What the HTTP server answers, request by request: a status, or "truncate" (announce the whole body,
    send half, close); the last entry repeats."""

    def __init__(self, body: bytes, answers: list[int | str]) -> None:
        self.body, self.answers, self.requests = body, answers, 0

    def next(self) -> int | str:
        answer = self.answers[min(self.requests, len(self.answers) - 1)]
        self.requests += 1
        return answer


@pytest.fixture
def http_server() -> Iterator[tuple[str, Script]]:
    script = Script(b"", [200])

    class Handler(http.server.BaseHTTPRequestHandler):
        disable_nagle_algorithm = True  # headers and body are two writes: no wait for a delayed ACK

        def do_GET(self):
            answer = script.next()
            if answer == "truncate":
                self.send_response(200)
                self.send_header("Content-Length", str(len(script.body)))
                self.end_headers()
                self.wfile.write(script.body[: len(script.body) // 2])
                self.close_connection = True
                return
            assert isinstance(answer, int)
            body = script.body if answer == 200 else b"busy"
            self.send_response(answer)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", script
    server.shutdown()
    server.server_close()


def http_settings(url: str, destination: Path, **extra) -> PullSettings:
    return PullSettings(source=url, destination=destination, allow_insecure_http=True, **{"retries": 3, **extra})


def test_two_503s_are_retried_with_backoff_and_logged_then_it_succeeds(http_server, tmp_path, caplog):
    base, script = http_server
    script.body, script.answers = b"weights" * 100, [503, 503, 200]
    sleeps = Sleeps()
    destination = tmp_path / "m" / "1"
    with caplog.at_level(logging.WARNING, logger="sluice.runtime.pull"):
        result = puller.pull_model(http_settings(f"{base}/files/model.onnx?token=secret", destination),
                                   sleep=sleeps, rand=lambda: 1.0)
    assert tree(destination) == {"model.onnx": script.body} and result.digest == sha(script.body)
    assert script.requests == 3
    assert sleeps == [1.0, 2.0]  # the schedule at full jitter: base, then twice base
    retries = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) == 2 and all("503" in m for m in retries)
    assert "attempt 1 of 4" in retries[0] and "attempt 2 of 4" in retries[1]
    assert not any("secret" in r.getMessage() for r in caplog.records)


def test_a_server_that_always_503s_is_given_up_after_bounded_attempts(http_server, tmp_path):
    base, script = http_server
    script.body, script.answers = b"x", [503]
    sleeps = Sleeps()
    destination = tmp_path / "m" / "1"
    with pytest.raises(pull.GaveUp) as err:
        puller.pull_model(http_settings(f"{base}/model.onnx", destination), sleep=sleeps, rand=lambda: 0.0)
    assert script.requests == 4 and len(sleeps) == 3
    assert sleeps == [0.5, 1.0, 2.0]  # half of each ceiling at the least jitter
    assert "gave up after 4 attempts" in str(err.value) and "503" in str(err.value)
    assert err.value.exit_code == 5
    assert not destination.exists() and leftovers(destination.parent) == []


def test_a_truncated_body_is_detected_and_retried(http_server, tmp_path):
    base, script = http_server
    script.body, script.answers = bytes(range(256)) * 64, ["truncate", 200]
    destination = tmp_path / "m" / "1"
    result = puller.pull_model(http_settings(f"{base}/model.onnx", destination), sleep=Sleeps())
    assert script.requests == 2 and result.digest == sha(script.body)

    script.answers, script.requests = ["truncate"], 0
    with pytest.raises(pull.GaveUp, match=rf"truncated: got {len(script.body) // 2} of {len(script.body)} bytes"):
        puller.pull_model(http_settings(f"{base}/other.onnx", tmp_path / "o" / "1"), sleep=Sleeps())
    assert script.requests == 4


def test_an_http_404_is_not_retried(http_server, tmp_path):
    base, script = http_server
    script.answers = [404]
    with pytest.raises(pull.SourceError, match="does not exist"):
        puller.pull_model(http_settings(f"{base}/model.onnx", tmp_path / "m" / "1"), sleep=Sleeps())
    assert script.requests == 1


def test_a_connection_refused_is_transient(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    sleeps = Sleeps()
    with pytest.raises(pull.GaveUp, match="gave up after 2 attempts"):
        puller.pull_model(PullSettings(source=f"http://127.0.0.1:{port}/m.onnx", destination=tmp_path / "m",
                                       allow_insecure_http=True, retries=1), sleep=sleeps)
    assert len(sleeps) == 1


class FakeClock:
    """Time that moves ``step`` seconds at each reading (and by each fake sleep); each reading also lets the
    trickling server below send its next piece, so a body arrives one piece per reading, however fast the
    machine is."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step
        self.go = threading.Semaphore(0)
        """The latest request's: a handler whose client gave up must not take the next one's pieces."""

    def __call__(self) -> float:
        self.now += self.step
        self.go.release()
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture()
def trickle() -> Iterator[tuple[str, Script, list[FakeClock]]]:
    """An HTTP server that sends the body (announced in full) in ``script.answers[0]``-byte pieces: the first
    at once, then one each time the test's clock is read."""
    script = Script(b"", [64])
    clocks: list[FakeClock] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            piece = script.next()
            assert isinstance(piece, int)
            go = clocks[0].go = threading.Semaphore(0)
            self.send_response(200)
            self.send_header("Content-Length", str(len(script.body)))
            self.end_headers()
            try:
                for start in range(0, len(script.body), piece):  # the first at once, then one per reading
                    if start and not go.acquire(timeout=5):
                        return  # the client stopped reading the clock: it is gone
                    self.wfile.write(script.body[start:start + piece])
            except OSError:
                pass  # the client dropped the connection

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", script, clocks
    server.shutdown()
    server.server_close()


def test_a_body_that_trickles_under_the_low_speed_limit_is_dropped_retried_then_given_up(trickle, tmp_path):
    """64 bytes every 10 s arrive well within any read timeout, for ever: each attempt is dropped once its
    60 s window averaged under 1 KiB/s, and retried like any transient failure."""
    base, script, clocks = trickle
    script.body, script.answers = bytes(range(256)) * 256, [64]
    clocks.append(clock := FakeClock(step=10))
    destination = tmp_path / "m" / "1"
    with pytest.raises(pull.GaveUp) as err:
        puller.pull_model(http_settings(f"{base}/model.onnx", destination, retries=1), sleep=clock.sleep,
                          clock=clock, rand=lambda: 0.0)
    assert script.requests == 2
    assert "gave up after 2 attempts; last error: the body came slower than --low-speed-limit 1024 B/s: " \
        in str(err.value)
    assert err.value.exit_code == 5
    assert not destination.exists() and leftovers(destination.parent) == []


def test_a_slow_body_above_the_low_speed_limit_completes(trickle, tmp_path):
    base, script, clocks = trickle
    script.body, script.answers = bytes(range(256)) * 1024, [16 << 10]  # 16 KiB every 10 s: 1.6 KiB/s
    clocks.append(clock := FakeClock(step=10))
    destination = tmp_path / "m" / "1"
    result = puller.pull_model(http_settings(f"{base}/model.onnx", destination), sleep=clock.sleep, clock=clock)
    assert result.digest == sha(script.body) and script.requests == 1
    assert clock.now >= 160  # the body took 16 readings of the clock: it was seen as it came


def test_a_pull_past_its_deadline_gives_up_at_once_with_nothing_placed(trickle, tmp_path):
    base, script, clocks = trickle
    script.body, script.answers = bytes(range(256)) * 4096, [16 << 10]  # 1 MiB at 1.6 KiB/s: 640 s
    clocks.append(clock := FakeClock(step=10))
    destination = tmp_path / "m" / "1"
    with pytest.raises(pull.DeadlineExceeded) as err:
        puller.pull_model(http_settings(f"{base}/model.onnx", destination, deadline_s=100), sleep=clock.sleep,
                          clock=clock)
    assert str(err.value).endswith("gave up: the pull did not finish within --deadline-s 100s; nothing was placed")
    assert err.value.exit_code == 5 and script.requests == 1  # not retried: no time is left
    assert 100 <= clock.now <= 130
    assert not destination.exists() and leftovers(destination.parent) == []


def test_no_retry_is_waited_for_that_would_end_past_the_deadline(http_server, tmp_path):
    base, script = http_server
    script.body, script.answers = b"x", [503]
    clock = FakeClock(step=0)
    sleeps = Sleeps()

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        clock.sleep(seconds)

    with pytest.raises(pull.DeadlineExceeded) as err:
        puller.pull_model(http_settings(f"{base}/model.onnx", tmp_path / "m" / "1", deadline_s=5, retries=10),
                          sleep=sleep, clock=clock, rand=lambda: 1.0)
    assert sleeps == [1.0, 2.0] and script.requests == 3  # the next wait (4 s) would pass the deadline
    assert "within --deadline-s 5s; last error: " in str(err.value) and "503" in str(err.value)


@pytest.mark.parametrize(("flags", "message"), [
    (["--deadline-s", "0"], "--deadline-s must be > 0, got 0 (leave it out for no bound)"),
    (["--low-speed-limit", "-1"], "--low-speed-limit and --low-speed-time-s must be >= 0 (0 turns the check off), "
     "got -1 and 60"),
    (["--low-speed-time-s", "-5"], "got 1024 and -5"),
])
def test_bad_deadline_and_low_speed_flags_are_usage_errors(tmp_path, flags, message):
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-P", "-m", "sluice.runtime", "pull", "https://example.invalid/m.onnx",
                           str(tmp_path / "m"), *flags], env={**os.environ, "PYTHONSAFEPATH": "1"}, cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == 2 and message in done.stderr, done.stderr


# ---------------------------------------------------------------- local and pvc://

def test_a_pvc_path_is_copied_from_under_the_pvc_root(tmp_path):
    for name, body in MODEL.items():
        (tmp_path / "claims" / "store" / "llm" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "claims" / "store" / "llm" / name).write_bytes(body)
    destination = tmp_path / "models" / "llm" / "1"
    result = puller.pull_model(PullSettings(source="pvc://store/llm", destination=destination,
                                            pvc_root=tmp_path / "claims", sha256=manifest(MODEL)))
    assert tree(destination) == MODEL and result.digest == manifest(MODEL)


def test_a_destination_not_placed_by_pull_is_never_replaced(tmp_path):
    (tmp_path / "src.onnx").write_bytes(b"x")
    destination = tmp_path / "mine"
    destination.mkdir()
    (destination / "precious").write_text("keep")
    with pytest.raises(pull.DestinationError, match="not placed by sluice pull"):
        puller.pull_model(PullSettings(source=str(tmp_path / "src.onnx"), destination=destination))
    assert (destination / "precious").read_text() == "keep"


def test_a_changed_source_replaces_the_previous_pull(tmp_path):
    (tmp_path / "a.onnx").write_bytes(b"a")
    (tmp_path / "b.onnx").write_bytes(b"b")
    destination = tmp_path / "m" / "1"
    puller.pull_model(PullSettings(source=str(tmp_path / "a.onnx"), destination=destination))
    puller.pull_model(PullSettings(source=str(tmp_path / "b.onnx"), destination=destination))
    assert tree(destination) == {"b.onnx": b"b"} and leftovers(destination.parent) == []


# ---------------------------------------------------------------- pure decisions

@pytest.mark.parametrize(("retry", "random01", "expected"), [
    (1, 0.0, 0.5), (1, 1.0, 1.0), (2, 0.0, 1.0), (3, 1.0, 4.0), (6, 1.0, 30.0), (20, 0.0, 15.0),
])
def test_backoff_is_exponential_capped_and_jittered_in_the_upper_half(retry, random01, expected):
    assert pull.backoff_delay(retry, base_s=1.0, cap_s=30.0, random01=random01) == expected


class ClientError(Exception):
    def __init__(self, code: str, status: int) -> None:
        super().__init__(f"An error occurred ({code})")
        self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}


def _caused(outer: Exception, cause: Exception) -> Exception:
    outer.__cause__ = cause
    return outer


@pytest.mark.parametrize(("exc", "transient"), [
    (ConnectionResetError(104, "reset"), True),
    (TimeoutError("read timed out"), True),
    (pull.Truncated("short"), True),
    (ClientError("SlowDown", 503), True),
    (ClientError("InternalError", 500), True),
    (ClientError("NoSuchKey", 404), False),
    (ClientError("AccessDenied", 403), False),
    (FileNotFoundError("bucket/key"), False),
    (PermissionError("denied"), False),
    (_caused(OSError(5, "Input/output error"), ClientError("ServiceUnavailable", 503)), True),
    (_caused(FileNotFoundError("x"), ClientError("NoSuchBucket", 404)), False),
    (pull.ChecksumMismatch("bad"), False),
    (ValueError("a bug"), False),
    (type("ReadTimeoutError", (Exception,), {})("botocore read timeout"), True),
])
def test_transient_and_permanent_errors(exc, transient):
    assert pull.is_transient(exc) is transient


def _azure(cls: type, status: int | None, code: str | None) -> Exception:
    error = cls(message=f"{code}: the store said so")
    error.status_code, error.error_code = status, code
    return error


def cloud_errors() -> list[tuple[Exception, bool, str | None]]:
    """The exceptions gcsfs, adlfs and the libraries under them raise, as they raise them: whether another
    attempt may succeed, and what a permanent one is reported as."""
    import aiohttp
    import requests.exceptions
    from azure.core import exceptions as azure
    from gcsfs.retry import HttpError
    from google.auth.exceptions import DefaultCredentialsError

    return [
        (HttpError({"code": 503, "message": "Backend Error"}), True, None),
        (HttpError({"code": 429, "message": "rateLimitExceeded"}), True, None),
        (HttpError({"code": 401, "message": "Invalid Credentials"}), False, "was denied"),
        (OSError("Forbidden: b/models/o/m%2F1\nno storage.objects.get access"), False, "was denied"),  # gcsfs's 403
        (requests.exceptions.ProxyError(), True, None),  # gcsfs's 502
        (aiohttp.ClientPayloadError("Response payload is not completed"), True, None),
        (aiohttp.ServerDisconnectedError(), True, None),
        (DefaultCredentialsError("Your default credentials were not found"), False, "was denied"),
        (azure.ServiceRequestError("Cannot connect to host"), True, None),
        (azure.ServiceResponseError("Connection broken"), True, None),
        (_caused(azure.HttpResponseError("Incomplete download"), azure.IncompleteReadError("short")), True, None),
        (_azure(azure.HttpResponseError, 503, "ServerBusy"), True, None),
        (_azure(azure.HttpResponseError, 500, "OperationTimedOut"), True, None),
        (_azure(azure.ResourceNotFoundError, 404, "ContainerNotFound"), False, "does not exist"),
        (_azure(azure.ClientAuthenticationError, 403, "AuthenticationFailed"), False, "was denied"),
        (_azure(azure.HttpResponseError, 403, "AuthorizationPermissionMismatch"), False, "was denied"),
        (azure.ClientAuthenticationError("DefaultAzureCredential failed to retrieve a token"), False, "was denied"),
    ]


def test_gcs_and_azure_errors_are_classified():
    for exc, transient, reported in cloud_errors():
        assert pull.is_transient(exc) is transient, repr(exc)
        if not transient:
            error = pull.permanent_error(exc, "az://c/m")
            assert isinstance(error, pull.SourceError) and error.exit_code == 3, repr(exc)
            assert reported in str(error) and str(error).startswith(("az://c/m", "access to az://c/m")), str(error)


@pytest.mark.parametrize(("name", "kind", "target", "problem"), [
    ("model.onnx", "file", None, None),
    ("1/model.onnx", "file", None, None),
    ("./a/b", "dir", None, None),
    ("/etc/passwd", "file", None, "absolute"),
    ("a/../../x", "file", None, "leaves"),
    ("..", "dir", None, "leaves"),
    ("C:\\x", "file", None, "absolute"),
    ("a/link", "symlink", "../b", None),
    ("a/link", "symlink", "../../b", "outside"),
    ("link", "symlink", "/etc/passwd", "absolute"),
    ("hard", "hardlink", "a/b", None),
    ("hard", "hardlink", "../b", "outside"),
    ("dev", "other", None, "special"),
    (pull.MARKER_NAME, "file", None, "reserved"),
])
def test_archive_members_that_would_leave_the_model_are_refused(name, kind, target, problem):
    found = pull.member_problem(name, kind=kind, link_target=target)
    assert (found is None) if problem is None else (found is not None and problem in found)


def test_the_manifest_digest_is_independent_of_listing_order():
    entries = [("b/x", "1" * 64), ("a", "2" * 64)]
    assert pull.manifest_digest(entries) == pull.manifest_digest(reversed(entries))
    assert pull.manifest_digest(entries) == sha(f"a\t{'2' * 64}\nb/x\t{'1' * 64}\n".encode())
    assert pull.manifest_digest(entries) != pull.manifest_digest([("b/x", "1" * 64), ("a", "3" * 64)])


@pytest.mark.parametrize(("uri", "shown"), [
    ("https://user:pw@host.example/m.onnx?X-Amz-Signature=abc", "https://host.example/m.onnx"),
    ("s3://bucket/path", "s3://bucket/path"),
    ("/local/path", "/local/path"),
    ("https://user:s3cr3t/x@host.example/m.onnx", "https://<redacted>"),  # the password read as a port
])
def test_secrets_in_uris_are_never_shown(uri, shown):
    assert pull.redact(uri) == shown
    assert "abc" not in pull.redact_text(f"GET {uri} failed") and "pw" not in pull.redact_text(f"GET {uri}")


@pytest.mark.parametrize(("uri", "scheme", "location"), [
    ("s3://bucket/a/b/", "s3", "bucket/a/b"),
    ("gs://bucket/a", "gs", "bucket/a"),
    ("az://container/a", "az", "container/a"),
    ("https://h/m.onnx", "https", "https://h/m.onnx"),
    ("pvc://claim/llm/1", "pvc", "/mnt/pvc/claim/llm/1"),
    ("file:///tmp/m", "file", "/tmp/m"),
    ("relative/dir", "file", "relative/dir"),
])
def test_sources_parse(uri, scheme, location):
    source = pull.parse_source(uri)
    assert (source.scheme, source.location) == (scheme, location)


@pytest.mark.parametrize(("uri", "message"), [
    ("ftp://h/x", "not supported"),
    ("http://h/x", "--allow-insecure-http"),
    ("s3:///key", "no bucket"),
    ("s3://b/../x", "'..'"),
    ("s3://b/a b", "not a URI"),
])
def test_bad_sources_say_what_is_allowed(uri, message):
    with pytest.raises(pull.UsageError, match=message) as err:
        pull.parse_source(uri)
    assert err.value.exit_code == 2


def test_checksums_and_sizes_parse():
    assert pull.parse_sha256("sha256:" + "AB" * 32) == "ab" * 32
    with pytest.raises(pull.UsageError, match="64 hex"):
        pull.parse_sha256("abc")
    assert pull.parse_size("20Gi") == 20 * 2**30 and pull.parse_size("1.5G") == 1_500_000_000
    assert pull.parse_size("1024") == 1024
    with pytest.raises(pull.UsageError, match="quantity"):
        pull.parse_size("20GB")


def test_storage_options_use_the_s3_endpoint_path_style_and_no_library_retries():
    options = pull.storage_options("s3", {"AWS_ENDPOINT_URL_S3": "http://minio:9000",
                                          "AWS_ENDPOINT_URL": "http://other"}, timeout_s=5)
    assert options["endpoint_url"] == "http://minio:9000"
    assert options["config_kwargs"] == {"retries": {"max_attempts": 1}, "connect_timeout": 5, "read_timeout": 5,
                                        "s3": {"addressing_style": "path"}}
    assert "endpoint_url" not in pull.storage_options("s3", {}, timeout_s=5)


def test_gcs_and_azure_options_carry_the_timeout_and_no_credentials():
    # Credentials and endpoints stay with each library's own chain (STORAGE_EMULATOR_HOST, the connection
    # string's BlobEndpoint); anon is not forced, so AZURE_STORAGE_ANON still works for a public container.
    assert pull.storage_options("gs", {"STORAGE_EMULATOR_HOST": "http://x"}, timeout_s=5) == {"requests_timeout": 5}
    assert pull.storage_options("az", {"AZURE_STORAGE_CONNECTION_STRING": "x"}, timeout_s=5) == {
        "connection_timeout": 5, "read_timeout": 5}


@pytest.mark.parametrize(("env", "problem"), [
    ({}, True),
    ({"AZURE_STORAGE_ACCOUNT_KEY": "k"}, True),
    ({"AZURE_CLIENT_ID": "c", "AZURE_TENANT_ID": "t", "AZURE_FEDERATED_TOKEN_FILE": "/var/run/token"}, True),
    ({"AZURE_STORAGE_ACCOUNT_NAME": "acct"}, False),  # DefaultAzureCredential: workload identity
    ({"AZURE_STORAGE_CONNECTION_STRING": "AccountName=a;AccountKey=k"}, False),
])
def test_azure_needs_an_account_from_the_environment(env, problem):
    found = pull.storage_problem("az", env)
    assert (found is not None) is problem
    if found:
        assert "AZURE_STORAGE_ACCOUNT_NAME" in found and "AZURE_STORAGE_CONNECTION_STRING" in found
    assert pull.storage_problem("gs", {}) is None and pull.storage_problem("s3", {}) is None


def test_progress_is_logged_periodically_without_a_terminal(caplog):
    now = [0.0]
    progress = puller.Progress(stream=io.StringIO(), interval_s=10, clock=lambda: now[0])
    files = [puller.RemoteFile("k", "a", 600), puller.RemoteFile("k2", "b", 400)]
    with caplog.at_level(logging.INFO, logger="sluice.runtime.pull"):
        progress.started(files)
        for _ in range(6):
            now[0] += 4
            progress.chunk(100)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress")]
    assert lines == ["progress: 300 B of 1000 B (30%), 0/2 files, 25 B/s",
                     "progress: 600 B of 1000 B (60%), 0/2 files, 25 B/s"]


@pytest.mark.parametrize(
    ("listed", "kept"),
    [
        # adlfs lists the folder object "m/1/" as an empty file "m/1" beside "m/1/model.onnx"
        ([("m", 0), ("m/1", 0), ("m/1/model.onnx", 3), ("m/config.pbtxt", 5)], ["m/1/model.onnx", "m/config.pbtxt"]),
        ([("m/empty.txt", 0), ("m/1/model.onnx", 3)], ["m/empty.txt", "m/1/model.onnx"]),  # an empty file stays
        ([("m/1", 4), ("m/1/model.onnx", 3)], ["m/1", "m/1/model.onnx"]),  # not empty: not a marker, kept
    ],
)
def test_folder_markers_are_dropped_from_a_listing(listed, kept):
    files = [puller.RemoteFile(f"bucket/{path}", path, size) for path, size in listed]
    assert [f.relative for f in puller.without_folder_markers(files)] == kept


@pytest.mark.parametrize(("members", "problem"), [
    ([("sub/x", "symlink", ".."), ("esc", "symlink", "sub/x/..")], "links through the symlink member 'sub/x'"),
    ([("a", "symlink", "d"), ("a/f", "file", None)], "lies under the symlink member 'a'"),
    ([("d", "dir", None), ("model.onnx", "symlink", "d/model.onnx"), ("d/model.onnx", "file", None)], None),
    ([("link", "symlink", "target"), ("other", "hardlink", "target")], None),
])
def test_members_that_escape_through_another_member_s_symlink_are_refused(members, problem):
    """Each member alone stays inside; together a symlink member makes another leave (CVE-2025-4517's
    shape, which tarfile's own data filter misses before Python 3.12.11 / 3.11.13)."""
    found = pull.through_symlink_problem(members)
    assert (found is None) if problem is None else (found is not None and problem in found), found


def test_a_tar_escaping_through_its_own_symlinks_writes_nothing(tmp_path):
    import io
    import os
    import subprocess
    import sys

    archive = tmp_path / "evil.tar"
    with tarfile.open(archive, "w") as tar:
        for name, target in (("sub/x", ".."), ("esc", "sub/x/..")):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
        body = b"outside\n"
        info = tarfile.TarInfo("esc/PWNED.txt")
        info.size = len(body)
        tar.addfile(info, io.BytesIO(body))
    destination = tmp_path / "models" / "m" / "1"
    done = subprocess.run([sys.executable, "-P", "-m", "sluice.runtime", "pull", str(archive), str(destination)],
                          env={**os.environ, "PYTHONSAFEPATH": "1"}, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 6, done.stderr
    assert "symlink member" in done.stderr
    assert not list((tmp_path / "models").rglob("PWNED.txt")) if (tmp_path / "models").exists() else True


@pytest.mark.parametrize(("target", "allow_http", "refused"), [
    ("ftp://host.example/m.onnx", True, "redirects to ftp://"),
    ("file:///etc/passwd", True, "redirects to file://"),
    ("http://host.example/m.onnx", False, "redirects to plain http"),
    ("http://host.example/m.onnx", True, None),
    ("https://other.example/m.onnx", False, None),
])
def test_https_redirects_are_followed_to_https_only(target, allow_http, refused):
    import urllib.request

    from sluice.runtime import puller

    handler = puller._NoDowngrade(allow_http)
    request = urllib.request.Request("https://host.example/m.onnx")
    if refused is None:
        assert handler.redirect_request(request, None, 302, "Found", {}, target) is not None
    else:
        with pytest.raises(pull.SourceError, match=refused):
            handler.redirect_request(request, None, 302, "Found", {}, target)


def test_size_limit_bounds_an_http_download_as_it_streams(tmp_path):
    """An https/http file lists no size, and may announce none: the limit stops the download itself
    (exit 7), instead of filling the pod's volume and placing it."""
    import http.server
    import os
    import subprocess
    import sys
    import threading

    body = b"x" * (3 << 20)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()  # no Content-Length: the body ends when the connection closes
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        done = subprocess.run(
            [sys.executable, "-P", "-m", "sluice.runtime", "pull", f"http://127.0.0.1:{server.server_address[1]}/m.onnx",
             str(tmp_path / "m" / "1"), "--allow-insecure-http", "--size-limit", "1Mi"],
            env={**os.environ, "PYTHONSAFEPATH": "1"}, cwd=tmp_path, capture_output=True, text=True)
    finally:
        server.shutdown()
    assert done.returncode == 7, done.stderr
    assert "over --size-limit" in done.stderr and not (tmp_path / "m" / "1").exists()


def test_a_destination_that_is_a_file_is_refused(tmp_path):
    import os
    import subprocess
    import sys

    (tmp_path / "source.onnx").write_bytes(b"model")
    (tmp_path / "dest").write_text("someone's file")
    done = subprocess.run([sys.executable, "-P", "-m", "sluice.runtime", "pull", str(tmp_path / "source.onnx"),
                           str(tmp_path / "dest")], env={**os.environ, "PYTHONSAFEPATH": "1"}, cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == 7 and "is not a directory" in done.stderr, done.stderr
    assert (tmp_path / "dest").read_text() == "someone's file"
    assert not list(tmp_path.glob(".dest.*"))
