"""A Python model's lifecycle through the real server: ``finalize`` on unload, instance names.

The server runs in this process, so a model file can reach a gate the test holds
(``sys.modules[GATE]``): a slow ``finalize`` waits on it, which shows what else the server does
meanwhile without any sleep or timing window.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from .conftest import ADD_SUB_CONFIG, BUILDERS, EXPLICIT, write_model  # type: ignore[import-not-found]

GATE = "sluice_test_finalize_gate"

ASYNC_FINALIZE_PY = """
import asyncio
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.marker = os.path.join(args["model_repository"], "FINALIZED")

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([1.0], np.float32))]) for _ in requests]

    async def finalize(self):
        await asyncio.sleep(0)  # a real suspension: the coroutine must be driven, not just created
        with open(self.marker, "a") as f:
            f.write("async finalize ran\\n")
"""

SLOW_FINALIZE_PY = """
import sys

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([1.0], np.float32))]) for _ in requests]

    def finalize(self):
        gate = sys.modules["GATE_NAME"]
        gate.started.set()
        gate.release.wait(60)
""".replace("GATE_NAME", GATE)

ONE_OUTPUT_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "IN", data_type: TYPE_FP32, dims: [ 1 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] }} ]
"""


@pytest.fixture
def gate() -> Iterator[types.SimpleNamespace]:
    namespace = types.SimpleNamespace(started=threading.Event(), release=threading.Event())
    module = types.ModuleType(GATE)
    module.__dict__.update(vars(namespace))
    sys.modules[GATE] = module
    try:
        yield namespace
    finally:
        namespace.release.set()
        sys.modules.pop(GATE, None)


def add_sub_inputs(module: types.ModuleType) -> list:
    inputs = [module.InferInput("INPUT0", [16], "FP32"), module.InferInput("INPUT1", [16], "FP32")]
    for tensor in inputs:
        tensor.set_data_from_numpy(np.arange(16, dtype=np.float32))
    return inputs


def test_async_finalize_runs_to_completion_on_unload(tmp_path: Path, serve) -> None:
    repo = tmp_path / "repo"
    model_dir = write_model(repo, "afin", ONE_OUTPUT_CONFIG.format(name="afin"), {"model.py": ASYNC_FINALIZE_PY})
    server = serve(repo, **EXPLICIT)
    client = httpclient.InferenceServerClient(server.http)

    client.unload_model("afin")

    assert not client.is_model_ready("afin")
    assert (model_dir / "FINALIZED").read_text() == "async finalize ran\n"


def test_slow_finalize_does_not_block_other_models(tmp_path: Path, serve, gate) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "slowfin", ONE_OUTPUT_CONFIG.format(name="slowfin"), {"model.py": SLOW_FINALIZE_PY})
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    server = serve(repo, **EXPLICIT)
    unloading = threading.Thread(target=httpclient.InferenceServerClient(server.http).unload_model, args=("slowfin",))
    unloading.start()
    try:
        assert gate.started.wait(30), "finalize() was never called"
        # finalize() is blocked right now; the server still answers, over both protocols
        http = httpclient.InferenceServerClient(server.http)
        answer = http.infer("add_sub", add_sub_inputs(httpclient))
        assert answer.as_numpy("OUTPUT0").tolist() == (2 * np.arange(16)).tolist()
        grpc = grpcclient.InferenceServerClient(server.grpc)
        answer = grpc.infer("add_sub", add_sub_inputs(grpcclient))
        assert answer.as_numpy("OUTPUT1").tolist() == [0.0] * 16
        assert unloading.is_alive()  # the unload waits for finalize()
    finally:
        gate.release.set()
        unloading.join(30)
    assert not unloading.is_alive()
    assert not httpclient.InferenceServerClient(server.http).is_model_ready("slowfin")


WHOAMI_PY = """
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_instance_name"]
        with open(os.path.join(args["model_repository"], "INSTANCES"), "a") as f:
            f.write(self.name + "\\n")

    def execute(self, requests):
        name = np.array([self.name.encode()], dtype=np.object_)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("NAME", name)]) for _ in requests]
"""

WHOAMI_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "IN", data_type: TYPE_FP32, dims: [ 1 ] }} ]
output [ {{ name: "NAME", data_type: TYPE_STRING, dims: [ 1 ] }} ]
{groups}
"""


@pytest.mark.parametrize("client_module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_instance_name_is_tritons(tmp_path: Path, serve, client_module) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "whoami", WHOAMI_CONFIG.format(name="whoami", groups=""), {"model.py": WHOAMI_PY})
    grouped = write_model(
        repo,
        "grouped",
        WHOAMI_CONFIG.format(
            name="grouped", groups='instance_group [ { count: 2, kind: KIND_CPU }, { name: "solo", count: 1 } ]'
        ),
        {"model.py": WHOAMI_PY},
    )
    server = serve(repo)
    client = client_module.InferenceServerClient(server.http if client_module is httpclient else server.grpc)
    tensor = client_module.InferInput("IN", [1], "FP32")
    tensor.set_data_from_numpy(np.zeros(1, np.float32))

    assert client.infer("whoami", [tensor]).as_numpy("NAME").tolist() == [b"whoami_0"]
    assert sorted((grouped / "INSTANCES").read_text().split()) == ["grouped_0_0", "grouped_0_1", "solo"]


ONE_OUTPUT_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([1.0], np.float32))]) for _ in requests]
"""

EXITS = {
    "exit_import": "import sys\nsys.exit(7)\n" + ONE_OUTPUT_PY,
    "exit_autocomplete": ONE_OUTPUT_PY
    + "\n    @staticmethod\n    def auto_complete_config(config):\n        import sys\n        sys.exit(8)\n",
    "exit_initialize": ONE_OUTPUT_PY + "\n    def initialize(self, args):\n        import sys\n        sys.exit(3)\n",
}


@pytest.mark.parametrize("control", ["startup", "explicit"])
def test_sys_exit_in_model_code_fails_that_load_only(tmp_path: Path, serve, control: str) -> None:
    """``sys.exit()`` at import, in ``auto_complete_config`` or in ``initialize`` is that model's failed
    load (the reason naming SystemExit); ``sys.exit()`` in ``finalize`` still unloads. The server and
    its other models serve on, as an exception there would leave them."""
    repo = tmp_path / "repo"
    write_model(repo, "good", ONE_OUTPUT_CONFIG.format(name="good"), {"model.py": ONE_OUTPUT_PY})
    for name, source in EXITS.items():
        write_model(repo, name, ONE_OUTPUT_CONFIG.format(name=name), {"model.py": source})
    final = ONE_OUTPUT_PY + "\n    def finalize(self):\n        import sys\n        sys.exit(9)\n"
    write_model(repo, "exit_finalize", ONE_OUTPUT_CONFIG.format(name="exit_finalize"), {"model.py": final})
    server = serve(repo, **EXPLICIT) if control == "explicit" else serve(repo)
    client = httpclient.InferenceServerClient(server.http)
    tensor = httpclient.InferInput("IN", [1], "FP32")
    tensor.set_data_from_numpy(np.array([2.0], np.float32))
    if control == "explicit":
        for name in EXITS:
            with pytest.raises(InferenceServerException, match="SystemExit"):
                client.load_model(name)
    rows = {row["name"]: row for row in client.get_model_repository_index()}
    for name in EXITS:
        assert rows[name]["state"] == "UNAVAILABLE"
        assert "SystemExit" in rows[name]["reason"], rows[name]
        assert str(tmp_path) not in rows[name]["reason"]
    assert client.is_server_live()
    assert client.infer("good", [tensor]).as_numpy("OUT").tolist() == [1.0]
    if control == "explicit":
        client.unload_model("exit_finalize")
        assert not client.is_model_ready("exit_finalize")
        client.load_model("exit_finalize")  # loads again after its finalize exited
        assert client.infer("exit_finalize", [tensor]).as_numpy("OUT").tolist() == [1.0]
        assert client.infer("good", [tensor]).as_numpy("OUT").tolist() == [1.0]


OPENS_MISSING_PY = """
import os


class TritonPythonModel:
    def initialize(self, args):
        self.weights = os.path.join(args["model_repository"], args["model_version"], "weights.bin")

    SIGNATURE execute(self, requests):
        open(self.weights)
"""


@pytest.mark.parametrize("decoupled", [False, True], ids=["plain", "decoupled-async"])
def test_execute_errors_show_model_files_relative_to_the_repository(tmp_path: Path, serve, decoupled: bool) -> None:
    repo = tmp_path / "repo"
    config = ONE_OUTPUT_CONFIG.format(name="opens")
    source = OPENS_MISSING_PY.replace("SIGNATURE", "async def" if decoupled else "def")
    if decoupled:
        config += "model_transaction_policy { decoupled: true }\n"
    write_model(repo, "opens", config, {"model.py": source})
    server = serve(repo)
    expected = "No such file or directory: 'opens/1/weights.bin'"
    if decoupled:
        client = grpcclient.InferenceServerClient(server.grpc)
        errors: list[str] = []
        done = threading.Event()

        def callback(result: object, error: object) -> None:
            errors.append(str(error))
            done.set()

        client.start_stream(callback=callback)
        tensor = grpcclient.InferInput("IN", [1], "FP32")
        tensor.set_data_from_numpy(np.array([1.0], np.float32))
        client.async_stream_infer("opens", [tensor])
        assert done.wait(30)
        client.stop_stream()
        messages = errors
    else:
        messages = []
        for module in (httpclient, grpcclient):
            url = server.http if module is httpclient else server.grpc
            tensor = module.InferInput("IN", [1], "FP32")
            tensor.set_data_from_numpy(np.array([1.0], np.float32))
            with pytest.raises(InferenceServerException) as caught:
                module.InferenceServerClient(url).infer("opens", [tensor])
            messages.append(caught.value.message())
    for message in messages:
        assert expected in message, message
        assert str(tmp_path) not in message and str(tmp_path.resolve()) not in message


def test_decoupled_with_response_cache_is_refused_naming_file_line_and_field(tmp_path: Path, serve) -> None:
    repo = tmp_path / "repo"
    config = ONE_OUTPUT_CONFIG.format(name="dec") + (
        "model_transaction_policy { decoupled: true }\nresponse_cache { enable: true }\n"
    )
    write_model(repo, "dec", config, {"model.py": ONE_OUTPUT_PY})
    server = serve(repo)
    rows = {row["name"]: row for row in httpclient.InferenceServerClient(server.http).get_model_repository_index()}
    reason = rows["dec"]["reason"]
    assert rows["dec"]["state"] == "UNAVAILABLE"
    assert "dec/config.pbtxt:8:18:" in reason and "field 'response_cache.enable'" in reason, reason
    assert "allowed: response_cache { enable: false } or decoupled: false" in reason
