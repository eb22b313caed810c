"""``--model-repository gs://bucket/prefix`` and ``az://container/prefix`` against Google Cloud Storage's
emulator and Azurite on loopback (the ``store`` fixture: each started once for this module), read by gcsfs
and adlfs exactly as in a pod: the models load from the mirror, a poll fetches a new version, refetches an
object rewritten in place and drops a deleted one, and a store that cannot be reached keeps the loaded
versions serving (logged and counted). The same cases as test_cloud_repository.py runs on S3; polls are
triggered by the test, never waited for."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from sluice.runtime import mirror
from sluice.runtime.server import StartupError
from sluice.runtime.snapshot import Change, Kind
from sluice_testing.storage_emulators import AZURITE_KEY, TOKEN, Store

from .test_model_control import CONFIG, infer_http, metric_lines, plus_model  # type: ignore[import-not-found]

_buckets = itertools.count()


def bucket(store: Store, objects: dict[str, bytes]) -> str:
    """A new bucket (container) holding ``objects``; its name."""
    name = f"repo-{next(_buckets)}"
    store.put(name, objects)
    return name


def repository(store: Store) -> str:
    """A bucket holding ``<prefix>/plus`` (version 1), a README beside the models, the empty "folder"
    objects consoles and sync tools create (``models/plus/``), and, under a sibling prefix sharing the
    name's start, a model that must not be seen."""
    return bucket(store, {
        "models/": b"",
        "models/plus/": b"",
        "models/plus/1/": b"",
        "models/plus/config.pbtxt": CONFIG.encode(),
        "models/plus/1/model.onnx": plus_model(1.0),
        "models/README.md": b"not a model",
        "models-old/other/config.pbtxt": CONFIG.replace('"plus"', '"other"').encode(),
        "models-old/other/1/model.onnx": plus_model(5.0),
    })


def cloud(store: Store, tmp_path: Path, url: str, **overrides) -> dict:
    return {
        "repository_url": url,
        "storage_env": dict(store.env),
        "storage_retries": 0,
        "storage_timeout_s": 5.0,
        "model_control_mode": "poll",
        "repository_poll_s": 3600,
        **overrides,
    }


def start(serve, tmp_path: Path, settings: dict):
    return serve(mirror.cache_root(tmp_path / "cache", settings["repository_url"]), **settings)


def stored_versions(root: Path) -> list[str]:
    store = root / mirror.STORE / "plus"
    return sorted(p.name.split("-")[0] for p in store.iterdir()) if store.is_dir() else []


def infer_grpc(address: str, x: float = 1.0) -> float:
    import numpy as np

    client = grpcclient.InferenceServerClient(address)
    tensor = grpcclient.InferInput("X", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.array([[x]], dtype=np.float32))
    return float(client.infer("plus", [tensor]).as_numpy("Y")[0][0])


def test_a_repository_loads_and_polls_new_rewritten_and_deleted_versions(store, tmp_path, serve):
    name = repository(store)
    settings = cloud(store, tmp_path, f"{store.scheme}://{name}/models")
    root = mirror.cache_root(tmp_path / "cache", settings["repository_url"])
    server = start(serve, tmp_path, settings)
    assert infer_http(server.http) == 2.0 and infer_grpc(server.grpc) == 2.0
    rows = httpclient.InferenceServerClient(server.http).get_model_repository_index()
    assert [(row["name"], row["version"], row["state"]) for row in rows] == [("plus", "1", "READY")]  # no 'other'
    store.proxy.reset()
    assert server.call(server.server.poll_repository()) == {}
    assert store.proxy.requests and store.proxy.reads() == []  # listed, but nothing changed: nothing fetched

    store.add(name, {"models/plus/2/model.onnx": plus_model(10.0)})
    assert server.call(server.server.poll_repository()) == {"plus": Change(Kind.CHANGED, versions_added=(2,))}
    assert infer_http(server.http) == 11.0

    store.add(name, {"models/plus/2/model.onnx": plus_model(20.0)})  # rewritten in place: a new generation/ETag
    found = server.call(server.server.poll_repository())
    assert found["plus"].versions_changed == (2,) and infer_http(server.http) == 21.0
    assert stored_versions(root) == ["1", "2"]  # the replaced copy of version 2 is gone once unloaded

    store.delete(name, "models/plus/2/model.onnx")
    assert server.call(server.server.poll_repository()) == {"plus": Change(Kind.CHANGED, versions_removed=(2,))}
    assert infer_http(server.http) == 2.0
    assert stored_versions(root) == ["1"]
    assert not (root / "README.md").exists()  # not part of a model
    assert store.proxy.requests and all(auth.startswith(store.authorization) for _, _, auth in store.proxy.requests)


def test_a_prefix_given_with_a_trailing_slash_is_the_same_repository(store, tmp_path, serve):
    name = repository(store)
    server = start(serve, tmp_path, cloud(store, tmp_path, f"{store.scheme}://{name}/models/"))
    assert infer_http(server.http) == 2.0
    assert [row["name"] for row in httpclient.InferenceServerClient(server.http).get_model_repository_index()] == [
        "plus"]


def test_a_repository_at_the_top_of_a_bucket_loads(store, tmp_path, serve):
    name = bucket(store, {"plus/config.pbtxt": CONFIG.encode(), "plus/1/model.onnx": plus_model(3.0)})
    server = start(serve, tmp_path, cloud(store, tmp_path, f"{store.scheme}://{name}"))
    assert infer_http(server.http) == 4.0


def test_an_unreachable_store_keeps_the_loaded_versions_serving(store, tmp_path, serve, caplog):
    name = repository(store)
    server = start(serve, tmp_path, cloud(store, tmp_path, f"{store.scheme}://{name}/models"))
    assert infer_http(server.http) == 2.0
    store.proxy.down = True

    assert server.call(server.server.poll_repository()) == {}

    assert infer_http(server.http) == 2.0
    assert httpclient.InferenceServerClient(server.http).is_server_ready()
    assert "sluice_repository_poll_failures_total 1.0" in metric_lines(server.metrics, "sluice_repository_poll")
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and "poll failed" in r.getMessage()]
    assert errors and f"{store.scheme}://{name}/models" in errors[0]
    assert AZURITE_KEY not in errors[0] and TOKEN not in errors[0]
    store.proxy.down = False
    store.add(name, {"models/plus/2/model.onnx": plus_model(10.0)})
    assert server.call(server.server.poll_repository()) == {"plus": Change(Kind.CHANGED, versions_added=(2,))}
    assert infer_http(server.http) == 11.0  # the next poll that reaches the store catches up


def test_startup_with_a_missing_prefix_says_it_does_not_exist(store, tmp_path, serve):
    name = repository(store)
    url = f"{store.scheme}://{name}/elsewhere"
    with pytest.raises(StartupError, match=f"{url} does not exist"):
        start(serve, tmp_path, cloud(store, tmp_path, url))


def test_startup_with_an_unreachable_store_is_a_one_line_error_naming_the_url(store, tmp_path, serve):
    name = repository(store)
    store.proxy.down = True
    with pytest.raises(StartupError) as info:
        start(serve, tmp_path, cloud(store, tmp_path, f"{store.scheme}://{name}/models"))
    message = str(info.value)
    assert f"{store.scheme}://{name}/models" in message and "\n" not in message
    assert AZURITE_KEY not in message and TOKEN not in message
