"""``--model-repository s3://bucket/prefix`` against a real S3-compatible server on loopback (moto's
server mode, spoken to by s3fs exactly as in a pod): the models load from the mirror, a poll
fetches a new version and drops a deleted one, and a store that cannot be reached keeps the loaded
versions serving (logged and counted). Polls are triggered by the test, never waited for."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
import tritonclient.http as httpclient
from moto.server import ThreadedMotoServer

from sluice.runtime import mirror
from sluice.runtime.server import StartupError
from sluice.runtime.snapshot import Change, Kind

from .test_model_control import CONFIG, infer_http, metric_lines, plus_model  # type: ignore[import-not-found]

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


@pytest.fixture
def moto() -> Iterator[ThreadedMotoServer]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    yield server
    server.stop()


def endpoint(server: ThreadedMotoServer) -> str:
    host, port = server.get_host_and_port()
    return f"http://{host}:{port}"


@pytest.fixture
def s3(moto, monkeypatch, tmp_path):
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    client = boto3.client("s3", endpoint_url=endpoint(moto))
    client.create_bucket(Bucket="models")
    client.put_object(Bucket="models", Key="repo/plus/config.pbtxt", Body=CONFIG.encode())
    client.put_object(Bucket="models", Key="repo/plus/1/model.onnx", Body=plus_model(1.0))
    client.put_object(Bucket="models", Key="repo/README.md", Body=b"not a model")
    return client


def cloud(moto: ThreadedMotoServer, tmp_path: Path, **overrides) -> dict:
    url = overrides.pop("url", "s3://models/repo")
    return {
        "model_repository": mirror.cache_root(tmp_path / "cache", url),
        "repository_url": url,
        "storage_env": {"AWS_ENDPOINT_URL": endpoint(moto)},
        "storage_retries": 0,
        "storage_timeout_s": 5.0,
        "model_control_mode": "poll",
        "repository_poll_s": 3600,
        **overrides,
    }


def start(serve, settings: dict):
    repository = settings.pop("model_repository")
    return serve(repository, **settings)


def stored_versions(settings_root: Path) -> list[str]:
    store = settings_root / mirror.STORE / "plus"
    return sorted(p.name.split("-")[0] for p in store.iterdir()) if store.is_dir() else []


def test_a_cloud_repository_loads_and_polls_new_and_deleted_versions(s3, moto, tmp_path, serve):
    settings = cloud(moto, tmp_path)
    root = settings["model_repository"]
    server = start(serve, settings)
    assert infer_http(server.http) == 2.0
    assert server.call(server.server.poll_repository()) == {}  # nothing changed: nothing fetched
    s3.put_object(Bucket="models", Key="repo/plus/2/model.onnx", Body=plus_model(10.0))
    assert server.call(server.server.poll_repository()) == {"plus": Change(Kind.CHANGED, versions_added=(2,))}
    assert infer_http(server.http) == 11.0
    # an object rewritten in place (same key, new content): a new copy beside, the served one untouched
    s3.put_object(Bucket="models", Key="repo/plus/2/model.onnx", Body=plus_model(20.0))
    found = server.call(server.server.poll_repository())
    assert found["plus"].versions_changed == (2,) and infer_http(server.http) == 21.0
    assert stored_versions(root) == ["1", "2"]  # the replaced copy of version 2 is gone once unloaded
    s3.delete_object(Bucket="models", Key="repo/plus/2/model.onnx")  # a deleted object
    found = server.call(server.server.poll_repository())
    assert found == {"plus": Change(Kind.CHANGED, versions_removed=(2,))}
    assert infer_http(server.http) == 2.0
    assert stored_versions(root) == ["1"]
    assert not (root / "README.md").exists()  # not part of a model


def test_an_unreachable_store_keeps_the_loaded_versions_serving(s3, moto, tmp_path, serve, caplog):
    server = start(serve, cloud(moto, tmp_path))
    assert infer_http(server.http) == 2.0
    moto.stop()
    assert server.call(server.server.poll_repository()) == {}
    assert infer_http(server.http) == 2.0
    assert httpclient.InferenceServerClient(server.http).is_server_ready()
    assert "sluice_repository_poll_failures_total 1.0" in metric_lines(server.metrics, "sluice_repository_poll")
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and "poll failed" in r.getMessage()]
    assert errors and "s3://models/repo" in errors[0] and "testing-secret" not in errors[0]
    moto.start()  # moto keeps no state across a restart: the bucket is gone, so is every model
    server.call(server.server.poll_repository())
    assert infer_http(server.http) == 2.0  # a store that lost the bucket is an error, not "delete everything"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_startup_with_an_unreachable_store_is_a_one_line_error_naming_the_url(s3, moto, tmp_path, serve):
    settings = cloud(moto, tmp_path, storage_env={"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"})
    with pytest.raises(StartupError) as info:
        start(serve, settings)
    message = str(info.value)
    assert "s3://models/repo" in message and "\n" not in message and "testing-secret" not in message


def test_startup_with_a_missing_prefix_says_it_does_not_exist(s3, moto, tmp_path, serve):
    with pytest.raises(StartupError, match=r"s3://models/elsewhere does not exist"):
        start(serve, cloud(moto, tmp_path, url="s3://models/elsewhere"))


def test_explicit_mode_fetches_a_model_before_the_load_api_loads_it(s3, moto, tmp_path, serve):
    server = start(serve, cloud(moto, tmp_path, model_control_mode="explicit", load_models=("*",)))
    s3.put_object(Bucket="models", Key="repo/plus/2/model.onnx", Body=plus_model(10.0))
    assert infer_http(server.http) == 2.0  # nothing polls in explicit mode
    httpclient.InferenceServerClient(server.http).load_model("plus")
    assert infer_http(server.http) == 11.0


def test_two_syncs_at_once_do_not_write_over_each_other(s3, moto, tmp_path):
    """Two explicit-mode loads (or a load during a poll) sync the mirror on two worker threads: they
    wrote the same temporary names and renamed onto each other's directories (Directory not empty)."""
    import threading

    s3.put_object(Bucket="models", Key="repo/plus/1/model.onnx", Body=plus_model(1.0) + b"\0" * (4 << 20))
    settings = cloud(moto, tmp_path)
    copy = mirror.RepositoryMirror(settings["repository_url"], settings["model_repository"],
                                   env=settings["storage_env"], retries=0)
    errors: list[str] = []

    def sync() -> None:
        try:
            copy.sync(only=["plus"])
        except Exception as exc:  # the test reports any failure
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=sync) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    placed = settings["model_repository"] / "plus" / "1" / "model.onnx"
    assert placed.stat().st_size == len(plus_model(1.0)) + (4 << 20)


def test_a_file_deleted_from_a_model_s_subdirectory_leaves_the_mirror(s3, moto, tmp_path):
    """Files beside the versions in a subdirectory (labels/, tokenizer/) deleted in the store were kept
    in the mirror for ever (only top-level files and version links were compared)."""
    s3.put_object(Bucket="models", Key="repo/plus/tokenizer/vocab.json", Body=b"{}")
    s3.put_object(Bucket="models", Key="repo/plus/tokenizer/merges.txt", Body=b"a b")
    settings = cloud(moto, tmp_path)
    root = settings["model_repository"]
    copy = mirror.RepositoryMirror(settings["repository_url"], root, env=settings["storage_env"], retries=0)
    copy.sync()
    assert (root / "plus" / "tokenizer" / "vocab.json").is_file()
    s3.delete_object(Bucket="models", Key="repo/plus/tokenizer/vocab.json")
    assert copy.sync() == ["plus"]
    assert not (root / "plus" / "tokenizer" / "vocab.json").exists()
    assert (root / "plus" / "tokenizer" / "merges.txt").is_file()
    s3.delete_object(Bucket="models", Key="repo/plus/tokenizer/merges.txt")
    copy.sync()
    assert not (root / "plus" / "tokenizer").exists()  # left empty: gone too
