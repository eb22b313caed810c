"""The Python backend runs Triton ``model.py`` files: load, instances, execute, errors, close.

Model files are written into ``tmp_path``; the backend is driven through its public contract
(``load`` -> ``new_instance`` -> ``execute`` -> ``close``) with requests from ``runtime/types``.
"""

from __future__ import annotations

import asyncio
import json
import re
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from sluice.runtime.backends import python as python_backend
from sluice.runtime.backends import triton_python_backend_utils as pb_utils
from sluice.runtime.backends.base import LoadContext, ModelInstance
from sluice.runtime.errors import ConfigError, InvalidArgument, ModelError, SluiceError
from sluice.runtime.types import InferRequest, InferResponse, RequestedOutput, Tensor

ADD_SUB_CONFIG = """
name: "add_sub"
backend: "python"
max_batch_size: 0
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
parameters { key: "greeting" value { string_value: "hi" } }
"""

ADD_SUB_MODEL = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.args = args
        config = json.loads(args["model_config"])
        self.out_dtype = pb_utils.triton_string_to_numpy(
            pb_utils.get_output_config_by_name(config, "OUTPUT0")["data_type"]
        )

    def execute(self, requests):
        responses = []
        for request in requests:
            in0 = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            in1 = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor("OUTPUT0", (in0 + in1).astype(self.out_dtype)),
                        pb_utils.Tensor("OUTPUT1", (in0 - in1).astype(self.out_dtype)),
                    ]
                )
            )
        return responses
"""

ECHO_CONFIG_TEMPLATE = """
name: "{name}"
backend: "python"
input [ {{ name: "IN" data_type: {dtype} dims: [ -1 ] }} ]
output [ {{ name: "OUT" data_type: {dtype} dims: [ -1 ] }} ]
"""


def write_model(tmp_path: Path, name: str, source: str, config_text: str, version: int = 1) -> LoadContext:
    model_dir = tmp_path / name
    version_dir = model_dir / str(version)
    version_dir.mkdir(parents=True, exist_ok=True)
    (version_dir / "model.py").write_text(textwrap.dedent(source))
    (model_dir / "config.pbtxt").write_text(config_text)
    return LoadContext(name, version, model_dir, version_dir, tmp_path)


def parse_config(config_text: str) -> mc.ModelConfig:
    return text_format.Parse(config_text, mc.ModelConfig())


def request(model: str, *inputs: Tensor, outputs: list[str] | None = None, **parameters) -> InferRequest:
    return InferRequest(
        model_name=model,
        model_version="1",
        inputs=list(inputs),
        outputs=[RequestedOutput(name) for name in outputs] if outputs is not None else None,
        id="req-1",
        parameters=dict(parameters),
    )


def fp32(name: str, values: list[float]) -> Tensor:
    return Tensor(name, "FP32", np.array(values, dtype=np.float32))


def start(tmp_path: Path, name: str, source: str, config_text: str, version: int = 1) -> ModelInstance:
    ctx = write_model(tmp_path, name, source, config_text, version)
    backend = python_backend.load(parse_config(config_text), ctx)
    return backend.new_instance(0, mc.ModelInstanceGroup.KIND_CPU, 0)


def only(results: list) -> InferResponse:
    assert len(results) == 1
    assert isinstance(results[0], InferResponse), results[0]
    return results[0]


def outputs_by_name(response: InferResponse) -> dict[str, Tensor]:
    return {tensor.name: tensor for tensor in response.outputs}


# ---------------------------------------------------------------------------------------------
# Happy path
# ---------------------------------------------------------------------------------------------


def test_add_sub_batch_of_requests(tmp_path):
    instance = start(tmp_path, "add_sub", ADD_SUB_MODEL, ADD_SUB_CONFIG)
    first = request("add_sub", fp32("INPUT0", [1, 2, 3, 4]), fp32("INPUT1", [1, 1, 1, 1]))
    second = request("add_sub", fp32("INPUT0", [0, 0, 0, 0]), fp32("INPUT1", [2, 2, 2, 2]))

    results = instance.execute([first, second])

    assert [type(r) for r in results] == [InferResponse, InferResponse]
    out = outputs_by_name(results[0])
    assert out["OUTPUT0"].datatype == "FP32"
    np.testing.assert_array_equal(out["OUTPUT0"].data, [2, 3, 4, 5])
    np.testing.assert_array_equal(out["OUTPUT1"].data, [0, 1, 2, 3])
    np.testing.assert_array_equal(outputs_by_name(results[1])["OUTPUT1"].data, [-2, -2, -2, -2])
    assert results[0].id == "req-1"
    assert results[0].model_name == "add_sub"
    assert results[0].model_version == "1"
    instance.close()


def test_only_requested_outputs_are_returned(tmp_path):
    instance = start(tmp_path, "add_sub", ADD_SUB_MODEL, ADD_SUB_CONFIG)
    req = request("add_sub", fp32("INPUT0", [1, 2, 3, 4]), fp32("INPUT1", [1, 1, 1, 1]), outputs=["OUTPUT1"])

    response = only(instance.execute([req]))

    assert [t.name for t in response.outputs] == ["OUTPUT1"]


def test_initialize_receives_triton_args(tmp_path):
    source = """
    import json
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            self.args = args

        def execute(self, requests):
            blob = json.dumps(self.args).encode()
            return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np_array(blob))]) for _ in requests]

    def np_array(blob):
        import numpy as np
        return np.array([blob], dtype=np.object_)
    """
    config_text = ECHO_CONFIG_TEMPLATE.format(name="args_model", dtype="TYPE_STRING") + (
        "instance_group [ { count: 2, kind: KIND_CPU }, { count: 1, kind: KIND_GPU, gpus: [ 1 ] } ]"
    )
    ctx = write_model(tmp_path, "args_model", source, config_text, version=3)
    backend = python_backend.load(parse_config(config_text), ctx)
    instance = backend.new_instance(2, mc.ModelInstanceGroup.KIND_GPU, 1)

    response = only(instance.execute([request("args_model", Tensor("IN", "BYTES", np.array([b"x"], dtype=object)))]))
    args = json.loads(response.outputs[0].data[0])

    assert args["model_instance_kind"] == "GPU"
    assert args["model_instance_name"] == "args_model_1"  # second group (of one instance: its own name)
    assert args["model_instance_device_id"] == "1"
    assert args["model_repository"] == str(tmp_path / "args_model")
    assert args["model_version"] == "3"
    assert args["model_name"] == "args_model"
    config = json.loads(args["model_config"])
    assert config["name"] == "args_model"
    assert config["max_batch_size"] == 0  # defaults are present, as in Triton
    assert config["input"][0]["dims"] == [-1]  # int64 as numbers, not strings
    assert config["output"][0]["data_type"] == "TYPE_STRING"


def test_bytes_echo_converts_str_and_bytes_to_bytes(tmp_path):
    source = """
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            responses = []
            for request in requests:
                data = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
                words = np.array([item.decode().upper() for item in data])  # a numpy str_ array
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", words)]))
            return responses
    """
    config_text = ECHO_CONFIG_TEMPLATE.format(name="echo", dtype="TYPE_STRING")
    instance = start(tmp_path, "echo", source, config_text)
    data = np.array([b"hello", "wörld".encode()], dtype=np.object_)

    response = only(instance.execute([request("echo", Tensor("IN", "BYTES", data))]))

    out = response.outputs[0]
    assert out.datatype == "BYTES"
    assert out.data.dtype == np.object_
    assert out.data.tolist() == [b"HELLO", "WÖRLD".encode()]


def test_output_is_cast_to_the_declared_datatype(tmp_path):
    source = """
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([1.5, 2.5]))]) for _ in requests]
    """
    config_text = ECHO_CONFIG_TEMPLATE.format(name="cast", dtype="TYPE_FP32")
    instance = start(tmp_path, "cast", source, config_text)

    out = only(instance.execute([request("cast", fp32("IN", [0]))])).outputs[0]

    assert (out.datatype, out.data.dtype) == ("FP32", np.float32)
    np.testing.assert_array_equal(out.data, [1.5, 2.5])


def test_requests_see_parameters_cancellation_and_sequence_fields(tmp_path):
    source = """
    import json
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            responses = []
            for request in requests:
                report = {
                    "cancelled": request.is_cancelled(),
                    "parameters": json.loads(request.parameters()),
                    "correlation_id": request.correlation_id(),
                    "flags": request.flags(),
                    "request_id": request.request_id(),
                    "requested": request.requested_output_names(),
                }
                blob = np.array([json.dumps(report).encode()], dtype=np.object_)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", blob)]))
            return responses
    """
    config_text = ECHO_CONFIG_TEMPLATE.format(name="report", dtype="TYPE_STRING")
    instance = start(tmp_path, "report", source, config_text)
    plain = request("report", Tensor("IN", "BYTES", np.array([b""], dtype=object)), temperature=0.5, tag="x")
    cancelled = request(
        "report",
        Tensor("IN", "BYTES", np.array([b""], dtype=object)),
        sequence_id=42,
        sequence_start=True,
        sequence_end=True,
    )
    cancelled.cancel.cancel()

    first, second = (json.loads(r.outputs[0].data[0]) for r in instance.execute([plain, cancelled]))

    assert first == {
        "cancelled": False,
        "parameters": {"temperature": 0.5, "tag": "x"},
        "correlation_id": 0,
        "flags": 0,
        "request_id": "req-1",
        "requested": ["OUT"],
    }
    assert second["cancelled"] is True
    assert second["parameters"] == {}
    assert second["correlation_id"] == 42
    assert second["flags"] == (
        pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START | pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
    )


def test_is_cancelled_is_read_live(tmp_path):
    source = """
    import time
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            before = requests[0].is_cancelled()
            deadline = time.monotonic() + 10
            while not requests[0].is_cancelled() and time.monotonic() < deadline:
                time.sleep(0.001)
            after = requests[0].is_cancelled()
            return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([before, after]))])]
    """
    config_text = ECHO_CONFIG_TEMPLATE.format(name="live", dtype="TYPE_BOOL")
    instance = start(tmp_path, "live", source, config_text)
    req = request("live", Tensor("IN", "BOOL", np.array([True])))
    canceller = threading.Timer(0.02, req.cancel.cancel)  # the client goes away while execute runs
    canceller.start()

    out = only(instance.execute([req])).outputs[0]
    canceller.join()

    assert out.data.tolist() == [False, True]


def test_async_execute_is_awaited(tmp_path):
    source = """
    import asyncio
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        async def execute(self, requests):
            await asyncio.sleep(0)
            return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([7], np.int32))]) for _ in requests]
    """
    config_text = ECHO_CONFIG_TEMPLATE.format(name="async_model", dtype="TYPE_INT32")
    instance = start(tmp_path, "async_model", source, config_text)

    out = only(instance.execute([request("async_model", Tensor("IN", "INT32", np.array([1], np.int32)))])).outputs[0]

    assert out.data.tolist() == [7]
    instance.close()


# ---------------------------------------------------------------------------------------------
# Errors, and serving on afterwards
# ---------------------------------------------------------------------------------------------

CHECKING_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if (data < 0).any():
                error = pb_utils.TritonError("negative input: " + str(data[0]))
                responses.append(pb_utils.InferenceResponse(error=error))
            elif (data > 100).any():
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("too large", pb_utils.TritonError.INVALID_ARG)))
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", data * 2)]))
        return responses
"""


def test_triton_error_fails_only_its_request_and_model_keeps_serving(tmp_path):
    config_text = ECHO_CONFIG_TEMPLATE.format(name="checker", dtype="TYPE_FP32")
    instance = start(tmp_path, "checker", CHECKING_MODEL, config_text)

    bad, good = instance.execute([request("checker", fp32("IN", [-1])), request("checker", fp32("IN", [3]))])

    assert type(bad) is ModelError
    assert bad.message == "negative input: -1.0"
    assert isinstance(good, InferResponse)
    np.testing.assert_array_equal(good.outputs[0].data, [6])
    again = only(instance.execute([request("checker", fp32("IN", [4]))]))
    np.testing.assert_array_equal(again.outputs[0].data, [8])


def test_triton_error_code_picks_the_client_status(tmp_path):
    config_text = ECHO_CONFIG_TEMPLATE.format(name="checker", dtype="TYPE_FP32")
    instance = start(tmp_path, "checker", CHECKING_MODEL, config_text)

    (error,) = instance.execute([request("checker", fp32("IN", [1000]))])

    assert isinstance(error, InvalidArgument)
    assert error.message == "too large"


def test_exception_in_execute_fails_the_whole_batch_in_triton_words(tmp_path):
    source = """
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            data = pb_utils.get_input_tensor_by_name(requests[0], "IN").as_numpy()
            if data[0] < 0:
                raise ValueError("cannot handle negatives")
            return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", data)]) for _ in requests]
    """
    config_text = ECHO_CONFIG_TEMPLATE.format(name="raiser", dtype="TYPE_FP32")
    instance = start(tmp_path, "raiser", source, config_text)

    results = instance.execute([request("raiser", fp32("IN", [-1])), request("raiser", fp32("IN", [1]))])

    expected = (
        "Failed to process the request(s) for model instance 'raiser_0', message: ValueError: cannot handle negatives"
    )
    assert [(type(r), r.message) for r in results] == [(ModelError, expected)] * 2
    assert isinstance(only(instance.execute([request("raiser", fp32("IN", [1]))])), InferResponse)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("return responses[:-1]", "InferenceRequest(s) size is:2, and InferenceResponse(s) size is:1"),
        ("return None", "only models with model_transaction_policy { decoupled: true } may"),
        ("return 'nope'", "must return a list of InferenceResponse, got str"),
    ],
)
def test_wrong_response_list_fails_every_request(tmp_path, body, expected):
    source = f"""
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            responses = [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.ones(1, np.float32))]) for _ in requests]
            {body}
    """
    config_text = ECHO_CONFIG_TEMPLATE.format(name="wrong", dtype="TYPE_FP32")
    instance = start(tmp_path, "wrong", source, config_text)

    results = instance.execute([request("wrong", fp32("IN", [1])), request("wrong", fp32("IN", [2]))])

    assert len(results) == 2
    for result in results:
        assert isinstance(result, ModelError)
        assert expected in result.message


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("None", "returned NoneType at position 0; expected a triton_python_backend_utils.InferenceResponse"),
        (
            "pb_utils.InferenceResponse([pb_utils.Tensor('EXTRA', np.ones(1, np.float32))])",
            "model 'odd' returned output 'EXTRA', which its configuration does not declare (declared outputs: 'OUT')",
        ),
        (
            "pb_utils.InferenceResponse([pb_utils.Tensor('OUT', np.array([1.5]))])",
            "configuration expects datatype TYPE_INT32 for output 'OUT', model provides TYPE_FP64",
        ),
        (
            "pb_utils.InferenceResponse([np.ones(1, np.int32)])",
            "holds a ndarray where a triton_python_backend_utils.Tensor was expected",
        ),
    ],
)
def test_malformed_response_fails_its_request_only(tmp_path, response, expected):
    source = f"""
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            good = pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.ones(1, np.int32))])
            return [{response}, good]
    """
    config_text = ECHO_CONFIG_TEMPLATE.format(name="odd", dtype="TYPE_INT32")
    instance = start(tmp_path, "odd", source, config_text)
    in_tensor = Tensor("IN", "INT32", np.ones(1, np.int32))

    bad, good = instance.execute([request("odd", in_tensor), request("odd", in_tensor)])

    assert isinstance(bad, ModelError)
    assert expected in bad.message
    assert isinstance(good, InferResponse)


def test_get_response_sender_needs_a_decoupled_model(tmp_path):
    source = """
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            requests[0].get_response_sender()
    """
    config_text = ECHO_CONFIG_TEMPLATE.format(name="sender", dtype="TYPE_FP32")
    instance = start(tmp_path, "sender", source, config_text)

    (error,) = instance.execute([request("sender", fp32("IN", [1]))])

    assert isinstance(error, ModelError)
    assert "TritonModelException: get_response_sender() is only available to models with" in error.message
    assert "decoupled: true" in error.message


def test_bls_exec_without_a_server_says_so(tmp_path):
    source = """
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            inner = pb_utils.InferenceRequest(
                model_name="other", inputs=requests[0].inputs(), requested_output_names=["OUT"])
            return [inner.exec()]
    """
    config_text = ECHO_CONFIG_TEMPLATE.format(name="bls", dtype="TYPE_FP32")
    instance = start(tmp_path, "bls", source, config_text)

    (error,) = instance.execute([request("bls", fp32("IN", [1]))])

    assert error.message == (
        "Failed to process the request(s) for model instance 'bls_0', message: "
        "TritonModelException: BLS requests need a running server; none is attached to this model"
    )


# ---------------------------------------------------------------------------------------------
# Loading and lifecycle
# ---------------------------------------------------------------------------------------------

LIFECYCLE_MODEL = """
import triton_python_backend_utils as pb_utils

from helper import LOG_FILE_NAME, VALUE


class TritonPythonModel:
    def initialize(self, args):
        self.log = args["model_repository"] + "/" + LOG_FILE_NAME

    def execute(self, requests):
        import numpy as np
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([VALUE], np.int32))]) for _ in requests]

    def finalize(self):
        with open(self.log, "a") as f:
            f.write("finalized\\n")
"""


def write_helper(ctx: LoadContext, value: int) -> None:
    (ctx.version_dir / "helper.py").write_text(f"LOG_FILE_NAME = 'events.log'\nVALUE = {value}\n")


def test_finalize_is_called_on_close(tmp_path):
    config_text = ECHO_CONFIG_TEMPLATE.format(name="life", dtype="TYPE_INT32")
    ctx = write_model(tmp_path, "life", LIFECYCLE_MODEL, config_text)
    write_helper(ctx, 1)
    backend = python_backend.load(parse_config(config_text), ctx)
    instances = [backend.new_instance(i, mc.ModelInstanceGroup.KIND_CPU, 0) for i in range(2)]

    for instance in instances:
        instance.close()
    backend.close()

    assert (ctx.model_dir / "events.log").read_text() == "finalized\nfinalized\n"


ASYNC_FINALIZE_MODEL = """
import asyncio

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.log = args["model_repository"] + "/events.log"

    async def execute(self, requests):
        return [pb_utils.InferenceResponse([]) for _ in requests]

    async def finalize(self):
        asyncio.get_running_loop().create_task(asyncio.sleep(3600))  # left behind: cancelled on close
        await asyncio.sleep(0)
        with open(self.log, "a") as f:
            f.write("finalized\\n")
"""


@pytest.mark.parametrize("caller", ["worker thread", "running event loop"])
def test_async_finalize_is_awaited_whoever_closes(tmp_path, caller):
    config_text = ECHO_CONFIG_TEMPLATE.format(name="afin", dtype="TYPE_INT32")
    ctx = write_model(tmp_path, "afin", ASYNC_FINALIZE_MODEL, config_text)
    instance = python_backend.load(parse_config(config_text), ctx).new_instance(0, mc.ModelInstanceGroup.KIND_CPU, 0)
    only(instance.execute([request("afin")]))  # the instance's own loop now exists

    if caller == "worker thread":
        closer = threading.Thread(target=instance.close)
        closer.start()
        closer.join(30)
    else:

        async def close_on_the_loop() -> None:
            instance.close()

        asyncio.run(close_on_the_loop())

    assert (ctx.model_dir / "events.log").read_text() == "finalized\n"


def test_two_models_with_model_py_and_same_sibling_names_do_not_collide(tmp_path):
    config_a = ECHO_CONFIG_TEMPLATE.format(name="a", dtype="TYPE_INT32")
    config_b = ECHO_CONFIG_TEMPLATE.format(name="b", dtype="TYPE_INT32")
    ctx_a = write_model(tmp_path, "a", LIFECYCLE_MODEL, config_a)
    ctx_b = write_model(tmp_path, "b", LIFECYCLE_MODEL, config_b)
    ctx_b2 = write_model(tmp_path, "b", LIFECYCLE_MODEL, config_b, version=2)
    for ctx, value in ((ctx_a, 10), (ctx_b, 20), (ctx_b2, 30)):
        write_helper(ctx, value)
    instances = [
        python_backend.load(parse_config(text), ctx).new_instance(0, mc.ModelInstanceGroup.KIND_CPU, 0)
        for ctx, text in ((ctx_a, config_a), (ctx_b, config_b), (ctx_b2, config_b))
    ]
    in_tensor = Tensor("IN", "INT32", np.ones(1, np.int32))

    values = [only(i.execute([request("x", in_tensor)])).outputs[0].data.tolist() for i in instances]

    assert values == [[10], [20], [30]]


def test_default_model_filename_is_honoured(tmp_path):
    config_text = ECHO_CONFIG_TEMPLATE.format(name="custom", dtype="TYPE_FP32") + 'default_model_filename: "m.py"\n'
    ctx = write_model(tmp_path, "custom", CHECKING_MODEL, config_text)
    (ctx.version_dir / "model.py").rename(ctx.version_dir / "m.py")

    instance = python_backend.load(parse_config(config_text), ctx).new_instance(0, mc.ModelInstanceGroup.KIND_CPU, 0)

    assert isinstance(only(instance.execute([request("custom", fp32("IN", [1]))])), InferResponse)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("class SomethingElse:\n    pass\n", "does not define a class named 'TritonPythonModel'"),
        ("import no_such_module_for_sluice_tests\n", "raised ModuleNotFoundError: No module named"),
        ("class TritonPythonModel:\n    pass\n", "has no execute(self, requests) method"),
        ("def broken(:\n", "raised SyntaxError"),
    ],
)
def test_bad_model_file_fails_load_naming_the_file(tmp_path, source, expected):
    config_text = ECHO_CONFIG_TEMPLATE.format(name="bad", dtype="TYPE_FP32")
    ctx = write_model(tmp_path, "bad", source, config_text)

    with pytest.raises(ModelError) as caught:
        python_backend.load(parse_config(config_text), ctx)

    assert expected in caught.value.message
    assert "failed to load 'bad' version 1" in caught.value.message
    assert "bad/1/model.py" in caught.value.message
    assert str(tmp_path) not in caught.value.message  # no server paths, not even in a SyntaxError


def test_missing_model_file_fails_load(tmp_path):
    config_text = ECHO_CONFIG_TEMPLATE.format(name="absent", dtype="TYPE_FP32")
    ctx = write_model(tmp_path, "absent", "", config_text)
    (ctx.version_dir / "model.py").unlink()

    with pytest.raises(ModelError, match=r"model file .*absent/1/model\.py does not exist"):
        python_backend.load(parse_config(config_text), ctx)


def test_decoupled_model_with_response_cache_is_refused_at_load(tmp_path):
    config_text = (
        ECHO_CONFIG_TEMPLATE.format(name="dec", dtype="TYPE_FP32")
        + "model_transaction_policy { decoupled: true }\nresponse_cache { enable: true }\n"
    )
    ctx = write_model(tmp_path, "dec", CHECKING_MODEL, config_text)

    with pytest.raises(ConfigError, match=r"field 'response_cache.enable': the response cache does not") as caught:
        python_backend.load(parse_config(config_text), ctx)
    assert caught.value.field == "response_cache.enable"


def test_initialize_error_fails_new_instance(tmp_path):
    source = """
    class TritonPythonModel:
        def initialize(self, args):
            raise RuntimeError("weights missing")

        def execute(self, requests):
            return []
    """
    config_text = ECHO_CONFIG_TEMPLATE.format(name="noinit", dtype="TYPE_FP32")
    ctx = write_model(tmp_path, "noinit", source, config_text)
    backend = python_backend.load(parse_config(config_text), ctx)

    with pytest.raises(SluiceError, match=r"model instance 'noinit_0' .* RuntimeError: weights missing") as caught:
        backend.new_instance(0, mc.ModelInstanceGroup.KIND_CPU, 0)
    # where in the model's file, as Triton's "At:" trace, relative to the repository
    assert re.search(r"; At: noinit/1/model\.py\(4\): initialize$", str(caught.value)), str(caught.value)
    assert str(tmp_path) not in str(caught.value)


def test_an_import_error_says_where_in_the_model_file(tmp_path):
    source = """
    def helper():
        raise ValueError("bad weights path")

    helper()
    """
    config_text = ECHO_CONFIG_TEMPLATE.format(name="badimport", dtype="TYPE_FP32")
    ctx = write_model(tmp_path, "badimport", source, config_text)
    with pytest.raises(SluiceError, match=r"ValueError: bad weights path") as caught:
        python_backend.load(parse_config(config_text), ctx)
    assert "At: badimport/1/model.py(5): <module>, badimport/1/model.py(3): helper" in str(caught.value)


# ---------------------------------------------------------------------------------------------
# pb_utils helpers
# ---------------------------------------------------------------------------------------------


def test_byte_tensor_serialization_round_trips():
    data = np.array([b"a", b"", "é".encode(), b"\x00\x01"], dtype=np.object_)

    encoded = pb_utils.serialize_byte_tensor(data)

    assert encoded[:5] == b"\x01\x00\x00\x00a"
    assert pb_utils.deserialize_bytes_tensor(encoded).tolist() == data.tolist()


@pytest.mark.parametrize(
    ("groups", "names"),
    [
        ("", ["m_0"]),  # a group of one instance: the group's name (Triton's backend_model.cc)
        ("instance_group [ { count: 2 } ]", ["m_0_0", "m_0_1"]),
        ("instance_group [ { count: 1 }, { count: 2, kind: KIND_CPU } ]", ["m_0", "m_1_0", "m_1_1"]),
        ('instance_group [ { name: "fast", count: 2 }, { count: 1 } ]', ["fast_0", "fast_1", "m_1"]),
        ("instance_group [ { count: 0 } ]", ["m_0"]),  # the repository creates one instance
    ],
)
def test_instance_names_follow_triton(groups, names):
    config = parse_config(f'name: "m" backend: "python" {groups}')

    assert [python_backend.instance_name_of(config, "m", index) for index in range(len(names))] == names


@pytest.mark.parametrize(
    ("groups", "names"),
    [
        # instances of a group on several GPUs share their names, as in Triton
        ("instance_group [ { kind: KIND_GPU, gpus: [ 0, 1 ] }, { kind: KIND_CPU } ]", ["m_0", "m_0", "m_1"]),
        ("instance_group [ { kind: KIND_GPU, count: 2, gpus: [ 0, 1 ] } ]", ["m_0_0", "m_0_1", "m_0_0", "m_0_1"]),
        ("instance_group [ { kind: KIND_GPU, count: 2 } ]", ["m_0_0", "m_0_1"] * 2),  # both visible GPUs
    ],
)
def test_instance_names_on_several_gpus_follow_triton(groups, names):
    from sluice.runtime.repository import instance_names, instance_plan

    config = parse_config(f'name: "m" backend: "python" {groups}')
    assert instance_names(config, 2) == names
    assert len(instance_plan(config, 2)) == len(names)


BASE_CONFIG = {
    "name": "m",
    "max_batch_size": 4,
    "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [2]}],
    "output": [{"name": "Y", "data_type": "TYPE_INVALID", "dims": []}],
    "sequence_batching": {},
    "model_transaction_policy": {"decoupled": False},
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.set_max_batch_size(2), "configuration specified max_batch_size 4, but in auto-complete-config"),
        (lambda c: c.set_dynamic_batching(), "Configuration specified scheduling_choice as 'sequence_batching'"),
        (lambda c: c.add_input({"name": "X", "data_type": "TYPE_INT8", "dims": [2]}), "expects datatype TYPE_FP32"),
        (lambda c: c.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [3]}), "the model expects dims [3]"),
        (lambda c: c.add_input({"name": "Z", "data_type": "TYPE_FP32"}), "input 'Z' in auto-complete-config function"),
        (lambda c: c.add_output({"name": "Z", "dims": [1], "data_type": "TYPE_FP32", "optional": True}), "other than"),
        (lambda c: c.add_output({"dims": [1], "data_type": "TYPE_FP32"}), "is missing 'name' property"),
        (lambda c: c.set_model_transaction_policy({"decoupled": True}), "trying to change decoupled property"),
        (lambda c: c.set_model_transaction_policy({"sticky": True}), "contains property other than 'decoupled'"),
    ],
)
def test_model_config_refuses_what_triton_refuses(change, message):
    config = pb_utils.ModelConfig(json.dumps(BASE_CONFIG))

    with pytest.raises(ValueError, match=re.escape(message)):
        change(config)


def test_model_config_fills_in_and_appends():
    config = pb_utils.ModelConfig(json.dumps(BASE_CONFIG))

    config.set_max_batch_size(8)
    config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [2], "optional": True})
    config.add_output({"name": "Y", "data_type": "TYPE_INT32", "dims": [1]})  # TYPE_INVALID: filled in
    config.add_output({"name": "Z", "data_type": "TYPE_FP32", "dims": [-1]})

    result = config.as_dict()
    assert result["max_batch_size"] == 8
    assert result["input"] == [{"name": "X", "data_type": "TYPE_FP32", "dims": [2], "optional": True}]
    assert [(o["name"], o["data_type"], o["dims"]) for o in result["output"]] == [
        ("Y", "TYPE_INT32", [1]),
        ("Z", "TYPE_FP32", [-1]),
    ]


def test_type_helpers_match_triton():
    assert pb_utils.triton_string_to_numpy("TYPE_FP32") is np.float32
    assert pb_utils.triton_string_to_numpy("TYPE_STRING") is np.object_
    assert pb_utils.numpy_to_triton_type(np.float32) == pb_utils.TRITONSERVER_TYPE_FP32
    assert pb_utils.numpy_to_triton_type(np.object_) == pb_utils.TRITONSERVER_TYPE_BYTES
    assert pb_utils.triton_to_numpy_type(pb_utils.TRITONSERVER_TYPE_INT64) is np.int64
    config = {"input": [{"name": "A", "data_type": "TYPE_FP32"}], "output": [{"name": "B"}]}
    assert pb_utils.get_input_config_by_name(config, "A") == {"name": "A", "data_type": "TYPE_FP32"}
    assert pb_utils.get_output_config_by_name(config, "B") == {"name": "B"}
    assert pb_utils.get_output_config_by_name(config, "Z") is None


def test_tensor_dlpack_round_trip_and_lookups():
    tensor = pb_utils.Tensor("X", np.arange(6, dtype=np.float32).reshape(2, 3))
    copy = pb_utils.Tensor.from_dlpack("Y", tensor.to_dlpack())
    response = pb_utils.InferenceResponse([tensor, copy])

    assert copy.is_cpu()
    np.testing.assert_array_equal(copy.as_numpy(), tensor.as_numpy())
    # the DLPack protocol on the Tensor itself (torch.from_dlpack(tensor) in Triton's examples)
    assert tensor.__dlpack_device__() == (1, 0)
    np.testing.assert_array_equal(np.from_dlpack(tensor), tensor.as_numpy())
    assert pb_utils.get_output_tensor_by_name(response, "Y") is copy
    assert pb_utils.get_output_tensor_by_name(response, "Z") is None
    assert not response.has_error()


def test_triton_error_codes_and_logger(caplog):
    error = pb_utils.TritonError("gone", pb_utils.TritonError.NOT_FOUND)
    assert (error.message(), error.code(), str(error)) == ("gone", pb_utils.TritonError.NOT_FOUND, "gone")
    assert pb_utils.TritonError("x").code() == pb_utils.TritonError.INTERNAL

    with caplog.at_level("DEBUG", logger="sluice.python_model"):
        pb_utils.Logger.log_info("info line")
        pb_utils.Logger.log_warn("warn line")
        pb_utils.Logger.log_error("error line")
        pb_utils.Logger.log_verbose("verbose line")
        logger = pb_utils.Logger  # Triton's README form
        logger.log("level line", logger.WARNING)
        logger.log("enum line", pb_utils.Logger.LogLevel.ERROR)

    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "info line"),
        ("WARNING", "warn line"),
        ("ERROR", "error line"),
        ("DEBUG", "verbose line"),
        ("WARNING", "level line"),
        ("ERROR", "enum line"),
    ]
