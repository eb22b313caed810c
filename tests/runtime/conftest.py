"""Fixtures for runtime tests: model repositories built in the test, and a real server on loopback.

``serve(repo, **settings)`` starts ``sluice.runtime.server.Server`` on free 127.0.0.1 ports in a
background thread with its own event loop and returns a handle with the URLs; tests then talk
to it with tritonclient over HTTP and gRPC exactly as a user would. ``store`` is an emulated
Google Cloud Storage, then Azure Blob Storage (each started once per module that uses it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import sys
import textwrap
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sluice.runtime.server import Server
from sluice.runtime.settings import Limits, SchedulingDefaults, ServerSettings
from sluice_testing import storage_emulators
from sluice_testing.storage_emulators import Store

ROOT = Path(__file__).resolve().parents[2]


def _load_builders() -> Any:
    spec = importlib.util.spec_from_file_location("sluice_example_models", ROOT / "examples" / "make_models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BUILDERS = _load_builders()

ADD_SUB_CONFIG = """
name: "add_sub"
backend: "onnxruntime"
max_batch_size: 0
input [
  { name: "INPUT0", data_type: TYPE_FP32, dims: [ 16 ] },
  { name: "INPUT1", data_type: TYPE_FP32, dims: [ 16 ] }
]
output [
  { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 16 ] },
  { name: "OUTPUT1", data_type: TYPE_FP32, dims: [ 16 ] }
]
"""

MLP_CONFIG = """
name: "mlp"
platform: "onnxruntime_onnx"
max_batch_size: 64
dynamic_batching { max_queue_delay_microseconds: 500 }
"""

IDENTITY_PY = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.config = json.loads(args["model_config"])

    def execute(self, requests):
        out = []
        for request in requests:
            tensors = []
            for cfg in self.config["input"]:
                t = pb_utils.get_input_tensor_by_name(request, cfg["name"])
                if t is not None:
                    tensors.append(pb_utils.Tensor(cfg["name"].replace("IN", "OUT"), t.as_numpy()))
            out.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return out
"""


EXPLICIT: dict[str, Any] = {"model_control_mode": "explicit", "load_models": ("*",)}
"""Server settings of tests that call the repository load/unload API: Triton's explicit model control,
every model loaded at start (the default mode, ``none``, refuses the API)."""


GATED_CONFIG = """
name: "gated"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""


def gated_py(gate_module: str) -> str:
    """A Python model (OUTPUT0 = INPUT0 * 2) that sets ``entered`` of the in-process module
    ``gate_module`` and waits for its ``release`` before answering (see :func:`gate`)."""
    return f"""
import sys
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        gate = sys.modules["{gate_module}"]
        gate.entered.set()
        gate.release.wait(30)
        return [
            pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() * 2)
            ])
            for r in requests
        ]
"""


@contextlib.contextmanager
def gate(gate_module: str) -> Iterator[Any]:
    """The module :func:`gated_py` models wait on: ``entered`` and ``release`` events; released and
    removed on exit, so a model still waiting never hangs the test run."""
    module = types.ModuleType(gate_module)
    module.entered, module.release = threading.Event(), threading.Event()  # type: ignore[attr-defined]
    sys.modules[gate_module] = module
    try:
        yield module
    finally:
        module.release.set()  # type: ignore[attr-defined]
        del sys.modules[gate_module]


def write_model(repo: Path, name: str, config: str, files: dict[str, bytes | str], version: int = 1) -> Path:
    """Write ``<repo>/<name>/config.pbtxt`` and ``<repo>/<name>/<version>/<file>``."""
    model_dir = repo / name
    (model_dir / str(version)).mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(textwrap.dedent(config))
    for filename, content in files.items():
        path = model_dir / str(version) / filename
        if isinstance(content, str):
            path.write_text(textwrap.dedent(content))
        else:
            path.write_bytes(content)
    return model_dir


class ManualClock:
    """A monotonic clock that moves only when a test says so: ``Server(..., clock=...)`` passes it
    to every model's scheduler, whose queue delays and timeouts then follow it, not the wall.
    ``advance`` tells the schedulers (``watch``), so a deadline it passes is acted on at once."""

    def __init__(self) -> None:
        self._now = 1_000_000_000
        self._lock = threading.Lock()
        self._watchers: list[Callable[[], None]] = []

    def __call__(self) -> int:
        return self._now

    def watch(self, callback: Callable[[], None]) -> Callable[[], None]:
        with self._lock:
            self._watchers.append(callback)
        return lambda: self._unwatch(callback)

    def _unwatch(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if callback in self._watchers:
                self._watchers.remove(callback)

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += int(seconds * 1e9)
            watchers = list(self._watchers)
        for callback in watchers:
            callback()


@dataclasses.dataclass
class Running:
    server: Server
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.server.ports.http}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.server.ports.grpc}"

    @property
    def metrics(self) -> str:
        return f"127.0.0.1:{self.server.ports.metrics}"

    def call(self, coro: Any, timeout: float = 30) -> Any:
        """Run a coroutine on the server's loop (e.g. to inspect it) and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def settle(self) -> None:
        """Return once the server's loop has run what was handed to it before (a clock jump)."""
        self.call(asyncio.sleep(0))

    def stop(self, grace_s: float = 5.0) -> None:
        if self.thread.is_alive():
            self.call(self.server.stop(grace_s), timeout=grace_s + 30)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


def start_server(repo: Path, **overrides: Any) -> Running:
    limits = overrides.pop("limits", Limits())
    scheduling = overrides.pop("scheduling", SchedulingDefaults())
    clock = overrides.pop("clock", None)
    cuda = overrides.pop("cuda", None)  # a cudart.Provider: where CUDA shared memory gets its device
    span_exporter = overrides.pop("span_exporter", None)
    settings = ServerSettings(
        model_repository=repo,
        http_port=overrides.pop("http_port", 0),
        grpc_port=overrides.pop("grpc_port", 0),
        metrics_port=overrides.pop("metrics_port", 0),
        limits=limits,
        scheduling=scheduling,
        **overrides,
    )
    server = Server(settings, clock=clock, cuda=cuda, span_exporter=span_exporter)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        asyncio.set_event_loop(loop)

        async def boot() -> None:
            try:
                await server.start()
            except BaseException as exc:
                errors.append(exc)
            finally:
                started.set()

        loop.run_until_complete(boot())
        if not errors:
            loop.run_forever()
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()

    thread = threading.Thread(target=run, name="sluice-test-server", daemon=True)
    thread.start()
    started.wait(60)
    if errors:
        raise errors[0]
    return Running(server, loop, thread)


@pytest.fixture
def serve() -> Iterator[Callable[..., Running]]:
    running: list[Running] = []

    def factory(repo: Path, **overrides: Any) -> Running:
        handle = start_server(repo, **overrides)
        running.append(handle)
        return handle

    yield factory
    for handle in running:
        handle.stop()


@pytest.fixture
def example_repo(tmp_path: Path) -> Path:
    """add_sub (no batching), mlp (dynamic batching) and an identity Python model."""
    repo = tmp_path / "repo"
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    write_model(repo, "mlp", MLP_CONFIG, {"model.onnx": BUILDERS.mlp_model()})
    return repo


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """One server for read-only tests of a module (faster than one per test)."""
    repo = tmp_path_factory.mktemp("shared") / "repo"
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    write_model(repo, "mlp", MLP_CONFIG, {"model.onnx": BUILDERS.mlp_model()})
    write_model(
        repo,
        "identity_bytes",
        """
        name: "identity_bytes"
        backend: "python"
        max_batch_size: 8
        input [ { name: "INPUT0", data_type: TYPE_STRING, dims: [ -1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_STRING, dims: [ -1 ] } ]
        dynamic_batching { }
        """,
        {"model.py": IDENTITY_PY},
    )
    handle = start_server(repo)
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def mlp_session() -> Any:
    """The example MLP in onnxruntime directly: the reference served results are compared with."""
    import onnxruntime as ort

    return ort.InferenceSession(BUILDERS.mlp_model(), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module", params=["gs", "az"])
def emulated(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """Google Cloud Storage's emulator, then Azurite: each started once for the module that uses it."""
    tmp = tmp_path_factory.mktemp(f"store-{request.param}")
    with (storage_emulators.gcs_store if request.param == "gs" else storage_emulators.azure_store)(tmp) as store:
        yield store


@pytest.fixture
def store(emulated: Store, monkeypatch: pytest.MonkeyPatch) -> Store:
    """The module's emulated store, with the pod-like environment set and the proxy's record cleared."""
    for key in storage_emulators.CLEARED:
        monkeypatch.delenv(key, raising=False)
    for key, value in emulated.env.items():
        monkeypatch.setenv(key, value)
    emulated.proxy.reset()
    return emulated
