"""The classification extension: ``classification: k`` on a requested output returns its top k.

The ranking is checked as a plain function (tables and a property against a naive reference);
the wiring through the real server with tritonclient over HTTP and gRPC, labels from the model's
``label_filename``, and the errors a client gets for what cannot be classified.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import text_format
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from sluice.runtime import classification
from sluice.runtime.errors import ConfigError, InvalidArgument

from .conftest import EXPLICIT, start_server, write_model  # type: ignore[import-not-found]

# -- the ranking, without I/O -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "datatype", "k", "batched", "labels", "expected"),
    [
        # FP32 scores are written as C++ std::to_string writes them (%f)
        ([0.1, 0.7, 0.2], "FP32", 2, False, (), [b"0.700000:1", b"0.200000:2"]),
        ([0.1, 0.7, 0.2], "FP32", 2, False, ("cat", "dog", "eel"), [b"0.700000:1:dog", b"0.200000:2:eel"]),
        # an empty label, or an index past the label file, gives no label part
        ([0.1, 0.7, 0.2], "FP32", 3, False, ("cat", ""), [b"0.700000:1", b"0.200000:2", b"0.100000:0:cat"]),
        # k past the number of classes returns them all
        ([3, 1], "INT32", 10, False, (), [b"3:0", b"1:1"]),
        # ties keep the lower index first
        ([5, 9, 9, 5], "UINT8", 4, False, (), [b"9:1", b"9:2", b"5:0", b"5:3"]),
        ([1.5, -2.0], "FP64", 1, False, (), [b"1.500000:0"]),
        # batched: one row per batch entry, ranked on its own
        ([[1, 3, 2], [9, 7, 8]], "INT64", 2, True, (), [[b"3:1", b"2:2"], [b"9:0", b"8:2"]]),
        # not batched: the whole tensor is one row, indexes are flat
        ([[1, 3, 2], [9, 7, 8]], "INT64", 2, False, (), [b"9:3", b"8:5"]),
        # batched with more dims: each batch row is flattened
        ([[[1, 4], [3, 2]]], "INT16", 2, True, (), [[b"4:1", b"3:2"]]),
        ([float("nan"), 1.0], "FP32", 2, False, (), [b"1.000000:1", b"nan:0"]),  # NaN last
        (np.zeros((0, 3)), "FP32", 2, True, (), []),
    ],
)
def test_top_k_table(data, datatype, k, batched, labels, expected) -> None:
    array = np.asarray(data).astype({"FP32": np.float32, "FP64": np.float64, "INT32": np.int32,
                                     "INT64": np.int64, "UINT8": np.uint8, "INT16": np.int16}[datatype])  # fmt: skip
    result = classification.top_k(array, datatype, k, batched=batched, labels=labels)

    assert result.dtype == np.object_
    assert result.tolist() == expected


@pytest.mark.parametrize("datatype", ["BYTES", "BOOL", "FP16", "BF16"])
def test_top_k_refuses_what_triton_cannot_rank(datatype: str) -> None:
    with pytest.raises(InvalidArgument, match=f"unsupported type '{datatype}'; allowed: UINT8-64, INT8-64, FP32"):
        classification.top_k(np.zeros(3, np.uint16), datatype, 1, batched=False)


def _reference(row: list[int], k: int) -> list[bytes]:
    order = sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]
    return [f"{row[i]}:{i}".encode() for i in order]


@given(
    hnp.arrays(np.int32, hnp.array_shapes(min_dims=2, max_dims=3, min_side=0, max_side=6), elements=st.integers(-5, 5)),
    st.integers(1, 40),
)
def test_top_k_matches_a_naive_ranking(array: np.ndarray, k: int) -> None:
    result = classification.top_k(array, "INT32", k, batched=True)

    width = int(np.prod(array.shape[1:]))
    assert result.shape == (array.shape[0], min(k, width))
    for row, classes in zip(array.reshape(array.shape[0], width).tolist(), result.tolist(), strict=True):
        assert classes == _reference(row, k)


@pytest.mark.parametrize("value", [-1, "3", 1.5, True, None])
def test_requested_count_must_be_a_non_negative_integer(value: object) -> None:
    with pytest.raises(InvalidArgument, match="output 'P': parameter 'classification' must be"):
        classification.requested_count("P", value)


def _config(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


def test_read_labels_reads_one_label_per_line(tmp_path: Path) -> None:
    (tmp_path / "labels.txt").write_text("cat\r\ndog\n\neel\n")
    config = _config('name: "m" output [ { name: "P" label_filename: "labels.txt" }, { name: "Q" } ]')

    assert classification.read_labels(config, tmp_path) == {"P": ("cat", "dog", "", "eel", "")}


@pytest.mark.parametrize(
    ("filename", "message"),
    [
        ("missing.txt", "label file 'missing.txt' does not exist in the model directory 'm/'"),
        ("../labels.txt", "label_filename '../labels.txt': it must be a file name in the model directory"),
    ],
)
def test_read_labels_refuses_naming_the_file_not_the_server_path(tmp_path: Path, filename: str, message: str) -> None:
    (tmp_path.parent / "labels.txt").write_text("x\n")
    config = _config(f'name: "m" output [ {{ name: "P" label_filename: "{filename}" }} ]')

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")) as caught:
        classification.read_labels(config, tmp_path)
    assert str(tmp_path) not in str(caught.value)
    assert caught.value.file is None  # the config's: the repository places it (file, line) in config.pbtxt


# -- through the server -------------------------------------------------------------------------

# Echoes its input as every output, cast to the output's datatype: the test picks the scores.
ECHO_PY = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.outputs = [(o["name"], pb_utils.triton_string_to_numpy(o["data_type"])) for o in config["output"]]

    def execute(self, requests):
        responses = []
        for request in requests:
            scores = pb_utils.get_input_tensor_by_name(request, "SCORES").as_numpy()
            tensors = [pb_utils.Tensor(name, scores.astype(dtype)) for name, dtype in self.outputs]
            responses.append(pb_utils.InferenceResponse(tensors))
        return responses
"""

LABELS = "cat\ndog\neel\nfox\ngnu\n"


def _model_config(name: str, max_batch_size: int, labels: bool = True) -> str:
    label_filename = ', label_filename: "labels.txt"' if labels else ""
    return f"""
    name: "{name}"
    backend: "python"
    max_batch_size: {max_batch_size}
    input [ {{ name: "SCORES", data_type: TYPE_FP32, dims: [ 5 ] }} ]
    output [
      {{ name: "PROB", data_type: TYPE_FP32, dims: [ 5 ]{label_filename} }},
      {{ name: "RANK", data_type: TYPE_INT32, dims: [ 5 ] }},
      {{ name: "HALF", data_type: TYPE_FP16, dims: [ 5 ] }}
    ]
    """


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    repo = tmp_path_factory.mktemp("classification") / "repo"
    for name, max_batch_size in (("batched", 4), ("single", 0)):
        model_dir = write_model(repo, name, _model_config(name, max_batch_size), {"model.py": ECHO_PY})
        (model_dir / "labels.txt").write_text(LABELS)
    write_model(repo, "unlabelled", _model_config("unlabelled", 0, labels=False), {"model.py": ECHO_PY})
    cached = _model_config("cached", 0, labels=False) + "response_cache { enable: true }"
    write_model(repo, "cached", cached, {"model.py": ECHO_PY})
    handle = start_server(repo)
    yield handle
    handle.stop()


CLIENTS = {"http": httpclient, "grpc": grpcclient}
SCORES = np.array([[0.1, 0.6, 0.05, 0.2, 0.05], [0.3, 0.0, 0.5, 0.1, 0.1]], np.float32)


def _client(server, protocol: str):
    module = CLIENTS[protocol]
    return module, module.InferenceServerClient(server.http if protocol == "http" else server.grpc)


def _scores(module, data: np.ndarray):
    tensor = module.InferInput("SCORES", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    return tensor


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_batched_model_returns_top_k_per_row_with_labels(server, protocol: str) -> None:
    module, client = _client(server, protocol)
    outputs = [module.InferRequestedOutput("PROB", class_count=3), module.InferRequestedOutput("RANK")]

    for _ in range(2):  # the second request is the same prefix: the protocol's request-plan path
        result = client.infer("batched", [_scores(module, SCORES)], outputs=outputs)

    output = result.get_output("PROB")
    assert (output["datatype"] if protocol == "http" else output.datatype) == "BYTES"
    assert result.as_numpy("PROB").tolist() == [
        [b"0.600000:1:dog", b"0.200000:3:fox", b"0.100000:0:cat"],
        [b"0.500000:2:eel", b"0.300000:0:cat", b"0.100000:3:fox"],
    ]
    assert result.as_numpy("RANK").tolist() == [[0, 0, 0, 0, 0], [0, 0, 0, 0, 0]]  # untouched


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_unbatched_model_ranks_the_whole_tensor_and_k_is_capped(server, protocol: str) -> None:
    module, client = _client(server, protocol)
    outputs = [module.InferRequestedOutput("RANK", class_count=9)]

    result = client.infer("single", [_scores(module, SCORES[0] * 100)], outputs=outputs)

    assert result.as_numpy("RANK").tolist() == [b"60:1", b"20:3", b"10:0", b"5:2", b"5:4"]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_without_a_label_file_entries_have_no_label(server, protocol: str) -> None:
    module, client = _client(server, protocol)

    result = client.infer(
        "unlabelled", [_scores(module, SCORES[0])], outputs=[module.InferRequestedOutput("PROB", class_count=1)]
    )

    assert result.as_numpy("PROB").tolist() == [b"0.600000:1"]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_classifying_an_fp16_output_is_a_400_naming_it(server, protocol: str) -> None:
    module, client = _client(server, protocol)

    with pytest.raises(InferenceServerException) as caught:
        half = module.InferRequestedOutput("HALF", class_count=1)
        client.infer("single", [_scores(module, SCORES[0])], outputs=[half])

    assert caught.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    assert "output 'HALF': class result not available for output due to unsupported type 'FP16'" in str(caught.value)


def test_image_client_style_reading(server) -> None:
    """How NVIDIA's image_client reads the answer: each entry split on ':' into score, index, label."""
    _, client = _client(server, "http")
    output = httpclient.InferRequestedOutput("PROB", binary_data=True, class_count=2)

    response = client.infer("batched", [_scores(httpclient, SCORES)], outputs=[output])

    printed = []
    for results in response.as_numpy("PROB"):
        for result in results:
            cls = "".join(chr(x) for x in result).split(":")
            printed.append(f"{cls[0]} ({cls[1]}) = {cls[2]}")
    assert printed == ["0.600000 (1) = dog", "0.200000 (3) = fox", "0.500000 (2) = eel", "0.300000 (0) = cat"]


def test_bad_classification_count_is_refused_before_the_model_runs(server) -> None:
    body = {
        "inputs": [{"name": "SCORES", "datatype": "FP32", "shape": [5], "data": [0.0] * 5}],
        "outputs": [{"name": "PROB", "parameters": {"classification": "three"}}],
    }
    request = urllib.request.Request(
        f"http://{server.http}/v2/models/single/infer", data=json.dumps(body).encode(), method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)

    assert caught.value.code == 400
    assert "parameter 'classification' must be an integer" in json.loads(caught.value.read())["error"]


def test_server_metadata_lists_the_extension(server) -> None:
    extensions = httpclient.InferenceServerClient(server.http).get_server_metadata()["extensions"]
    assert "classification" in extensions
    # what Triton lists for what Sluice serves too: sequence batching, request/response parameters
    assert {"sequence", "parameters", "model_repository", "binary_tensor_data"} <= set(extensions)


def test_missing_label_file_fails_the_load_naming_the_file(tmp_path: Path, serve) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "nolabels", _model_config("nolabels", 0), {"model.py": ECHO_PY})
    running = serve(repo, **EXPLICIT)
    client = httpclient.InferenceServerClient(running.http)

    with pytest.raises(InferenceServerException) as caught:
        client.load_model("nolabels")

    assert "label file 'labels.txt' does not exist in the model directory 'nolabels/'" in str(caught.value)
    assert str(tmp_path) not in str(caught.value)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_one_cached_response_serves_raw_and_classified_requests(server, protocol: str) -> None:
    module, client = _client(server, protocol)
    scores = SCORES[1] + (0.25 if protocol == "http" else 0.5)  # one cache entry per protocol's test
    raw = client.infer("cached", [_scores(module, scores)])  # all outputs: the response is cached

    top = client.infer(
        "cached", [_scores(module, scores)], outputs=[module.InferRequestedOutput("PROB", class_count=1)]
    )
    again = client.infer("cached", [_scores(module, scores)], outputs=[module.InferRequestedOutput("PROB")])

    assert raw.as_numpy("PROB").tolist() == again.as_numpy("PROB").tolist() == scores.tolist()
    assert top.as_numpy("PROB").tolist() == [f"{scores[2]:f}:2".encode()]
    stats = httpclient.InferenceServerClient(server.http).get_inference_statistics("cached")["model_stats"][0]
    assert stats["inference_stats"]["cache_hit"]["count"] >= 2


def test_json_response_carries_the_strings(server) -> None:
    body = {
        "inputs": [{"name": "SCORES", "datatype": "FP32", "shape": [5], "data": SCORES[0].tolist()}],
        "outputs": [{"name": "PROB", "parameters": {"classification": 2}}],
    }
    request = urllib.request.Request(
        f"http://{server.http}/v2/models/single/infer", data=json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        output = json.loads(answer.read())["outputs"][0]

    assert output == {"name": "PROB", "datatype": "BYTES", "shape": [2], "data": ["0.600000:1:dog", "0.200000:3:fox"]}
