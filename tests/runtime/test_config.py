"""Tests of sluice.runtime.config through its public functions: parsing in three formats, loading
a model directory, validation, warnings for unimplemented fields, auto-complete, version policies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from google.protobuf import text_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import model_config_pb2 as mc

from sluice.runtime import config as model_config
from sluice.runtime.backends.base import TensorSpec
from sluice.runtime.errors import ConfigError

FULL_PBTXT = """\
name: "resnet"
platform: "onnxruntime_onnx"
max_batch_size: 8
version_policy { latest { num_versions: 2 } }
input [
  {
    name: "image"
    data_type: TYPE_FP32
    dims: [ 3, -1, -1 ]
  },
  {
    name: "scale"
    data_type: TYPE_FP32
    dims: [ 1 ]
    reshape { shape: [ ] }
    optional: true
  }
]
output [ { name: "probs", data_type: TYPE_FP16, dims: [ 1000 ] } ]
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 100
  priority_levels: 2
  default_priority_level: 1
  default_queue_policy { timeout_action: DELAY, default_timeout_microseconds: 5000, max_queue_size: 16 }
  priority_queue_policy { key: 2 value { max_queue_size: 4 } }
}
instance_group [ { count: 2, kind: KIND_GPU, gpus: [ 0, 1 ] } ]
parameters { key: "threads" value { string_value: "4" } }
response_cache { enable: true }
"""

FULL_YAML = """\
name: resnet
platform: onnxruntime_onnx
max_batch_size: 8
version_policy: {latest: {num_versions: 2}}
input:
  - name: image
    data_type: TYPE_FP32
    dims: [3, -1, -1]
  - name: scale
    dataType: TYPE_FP32          # camelCase is accepted too
    dims: [1]
    reshape: {shape: []}
    optional: true
output:
  - {name: probs, data_type: TYPE_FP16, dims: [1000]}
dynamic_batching:
  preferred_batch_size: [4, 8]
  maxQueueDelayMicroseconds: 100
  priority_levels: 2
  default_priority_level: 1
  default_queue_policy: {timeout_action: DELAY, default_timeout_microseconds: 5000, max_queue_size: 16}
  priority_queue_policy: {2: {max_queue_size: 4}}
instance_group:
  - {count: 2, kind: KIND_GPU, gpus: [0, 1]}
parameters: {threads: {string_value: "4"}}
response_cache: {enable: true}
"""

FULL_JSON = json.dumps(
    {
        "name": "resnet",
        "platform": "onnxruntime_onnx",
        "maxBatchSize": 8,
        "versionPolicy": {"latest": {"numVersions": 2}},
        "input": [
            {"name": "image", "dataType": "TYPE_FP32", "dims": [3, -1, -1]},
            {"name": "scale", "data_type": "TYPE_FP32", "dims": ["1"], "reshape": {"shape": []}, "optional": True},
        ],
        "output": [{"name": "probs", "data_type": "TYPE_FP16", "dims": [1000]}],
        "dynamic_batching": {
            "preferred_batch_size": [4, 8],
            "max_queue_delay_microseconds": "100",
            "priority_levels": 2,
            "default_priority_level": 1,
            "default_queue_policy": {
                "timeout_action": "DELAY",
                "default_timeout_microseconds": 5000,
                "max_queue_size": 16,
            },
            "priority_queue_policy": {"2": {"max_queue_size": 4}},
        },
        "instance_group": [{"count": 2, "kind": "KIND_GPU", "gpus": [0, 1]}],
        "parameters": {"threads": {"string_value": "4"}},
        "response_cache": {"enable": True},
    },
    indent=2,
)

EXTENSIONS = {"pbtxt": "pbtxt", "yaml": "yaml", "json": "json"}


def make_model(root: Path, files: dict[str, str], name: str = "resnet") -> Path:
    """A model directory under ``root`` holding ``files`` (relative path -> text)."""
    model_dir = root / name
    model_dir.mkdir(parents=True, exist_ok=True)
    for relative, text in files.items():
        target = model_dir / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return model_dir


def pbtxt(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


def assert_mentions(message: str, *parts: str) -> None:
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"


# --- parsing -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "text"), [("yaml", FULL_YAML), ("json", FULL_JSON)])
def test_yaml_and_json_parse_to_the_same_config_as_pbtxt(fmt: str, text: str) -> None:
    expected = model_config.parse_config(FULL_PBTXT, path="config.pbtxt", fmt="pbtxt")
    parsed = model_config.parse_config(text, path=f"config.{fmt}", fmt=fmt)
    assert parsed == expected
    assert parsed.dynamic_batching.priority_queue_policy[2].max_queue_size == 4


def test_empty_documents_are_empty_configs() -> None:
    assert model_config.parse_config("", path="c", fmt="pbtxt") == mc.ModelConfig()
    assert model_config.parse_config("# nothing\n", path="c", fmt="yaml") == mc.ModelConfig()
    assert model_config.parse_config("{}", path="c", fmt="json") == mc.ModelConfig()


PARSE_ERRORS = [
    pytest.param(
        "pbtxt",
        'name: "m"\ninput [\n  { name: "x" data_tpye: TYPE_FP32 }\n]\n',
        [
            ":3:15",
            "input[0].data_tpye",
            "Message type 'ModelInput' has no field 'data_tpye'; did you mean 'data_type'?",
        ],
        id="pbtxt-unknown-field",
    ),
    pytest.param(
        "pbtxt",
        'name: "m"\nmax_batch_size: 4\ninput [ { name: "x" data_type: TYPE_FP33 dims: [ 1 ] } ]\n',
        [
            ":3:32",
            "input[0].data_type",
            "'TYPE_FP33' is not a valid DataType",
            "'TYPE_FP32'",
            "TYPE_BOOL",
            "TYPE_STRING",
        ],
        id="pbtxt-bad-enum",
    ),
    pytest.param(
        "pbtxt",
        "instance_group [ { kind: KIND_TPU } ]\n",
        [":1:26", "instance_group[0].kind", "KIND_AUTO, KIND_GPU, KIND_CPU, KIND_MODEL"],
        id="pbtxt-bad-kind",
    ),
    pytest.param(
        "pbtxt",
        "\nmax_batch_size: lots\n",
        [":2:17", "max_batch_size", "lots is not a valid int32", "-2147483648 to 2147483647"],
        id="pbtxt-not-an-integer",
    ),
    pytest.param(
        "pbtxt",
        "dynamic_batching {\n  max_queue_delay_microseconds: -1\n}\n",
        [":2:", "dynamic_batching.max_queue_delay_microseconds", "-1 is not a valid uint64", "from 0 to"],
        id="pbtxt-negative-queue-delay",
    ),
    pytest.param(
        "pbtxt",
        'name: "a"\nname: "b"\n',
        [":2:", "field 'name'", "more than once"],
        id="pbtxt-duplicate-field",
    ),
    pytest.param(
        "pbtxt",
        'input [ { name: "x" optional: maybe } ]',
        [":1:", "input[0].optional", "allowed: true, false"],
        id="pbtxt-bad-bool",
    ),
    pytest.param(
        "pbtxt",
        'input [ { name: "x" ',
        [":1:", "syntax error"],
        id="pbtxt-unclosed",
    ),
    pytest.param(
        "pbtxt",
        'parameters { key: "a" value { strin_value: "x" } }',
        [":1:31", "parameters[0].value.strin_value", "did you mean 'string_value'?"],
        id="pbtxt-unknown-field-in-map-value",
    ),
    pytest.param(  # proto3 text format takes any number for an enum: it failed later, as a raw ValueError
        "pbtxt",
        'name: "m"\ninput [ { name: "x" data_type: 99 dims: [ 1 ] } ]',
        [":2:21", "field 'input[0].data_type'", "'99' is not a valid DataType value; allowed: TYPE_BOOL"],
        id="pbtxt-enum-number-unknown",
    ),
    pytest.param(  # it loaded as READY with an instance kind no backend knows
        "pbtxt",
        'instance_group [ { count: 1 }, { kind: 17 } ]',
        [":1:", "field 'instance_group[1].kind'", "'17' is not a valid Kind value"],
        id="pbtxt-enum-number-nested",
    ),
    pytest.param(
        "pbtxt",
        "colour: 3",
        [":1:1", "Message type 'ModelConfig' has no field 'colour'; allowed: name, platform, backend"],
        id="pbtxt-unknown-field-no-close-match",
    ),
    pytest.param(
        "yaml",
        "name: m\ninput:\n  - name: x\n    data_tpye: TYPE_FP32\n",
        [":4:5", "input[0].data_tpye", "has no field 'data_tpye'; did you mean 'data_type'?"],
        id="yaml-unknown-field",
    ),
    pytest.param(
        "yaml",
        "input:\n  - name: x\n    dataType: TYPE_FP33\n",
        [":3:5", "input[0].data_type", "'TYPE_FP33' is not a valid DataType", "TYPE_FP32"],
        id="yaml-bad-enum-camel-case",
    ),
    pytest.param(
        "yaml",
        "maxBatchSzie: 4\n",
        [":1:1", "maxBatchSzie", "did you mean 'maxBatchSize'?"],
        id="yaml-camel-case-suggestion",
    ),
    pytest.param(
        "yaml",
        "name: m\nmax_batch_size: true\n",
        [":2:1", "max_batch_size", "True is not a valid int32"],
        id="yaml-bool-for-int",
    ),
    pytest.param(
        "yaml",
        "name: m\ninput: [\n",
        [":3:1", "invalid YAML"],
        id="yaml-syntax",
    ),
    pytest.param(
        "yaml",
        "name: m\nparameters:\n  threads: {string_value: 4}\n",
        [":3:", "parameters[threads].string_value", "expected a string", "quote it"],
        id="yaml-number-for-string",
    ),
    pytest.param(
        "pbtxt",
        'name: "m"\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] }\n',
        [":3:1", "syntax error: the file ends early: Expected"],
        id="pbtxt-unclosed-list",
    ),
    pytest.param(
        "pbtxt",
        'name: "m"\ninput [ { name: "x" }',
        [":2:22", "syntax error: the file ends early: Expected"],
        id="pbtxt-unclosed-list-no-newline",
    ),
    pytest.param("pbtxt", "name:", [":1:6", "the file ends early: Expected string"], id="pbtxt-ends-after-colon"),
    pytest.param("yaml", "- a\n", ["expected a mapping for ModelConfig, got a list"], id="yaml-not-a-mapping"),
    pytest.param(
        "json",
        '{\n  "input": [\n    {"name": "x",\n     "dims": [1, "a"]}]}',
        [":4:18", "input[0].dims[1]", "'a' is not a valid int64"],
        id="json-bad-dim",
    ),
    pytest.param(
        "json",
        '{\n  "name": "m",\n  "input": [{"name": "x", "data_type": "FP32"}]\n}',
        [":3:27", "input[0].data_type", "'FP32' is not a valid DataType", "TYPE_FP32"],
        id="json-bad-enum",
    ),
    pytest.param(
        "json",
        '{"name": "m",\n "maxBatchSize": 1.5}',
        [":2:2", "max_batch_size", "1.5 is not a valid int32"],
        id="json-fraction",
    ),
    pytest.param("json", '{"input": 5}', [":1:2", "field 'input'", "expected a list"], id="json-not-a-list"),
    pytest.param("json", '{"name": "x",\n}', [":2:1", "invalid JSON"], id="json-syntax"),
    pytest.param(
        "json",
        '{"dynamic_batching": {"priority_queue_policy": {"high": {}}}}',
        ["dynamic_batching.priority_queue_policy[high]", "'high' is not a valid uint64"],
        id="json-bad-map-key",
    ),
]


@pytest.mark.parametrize(("fmt", "text", "expected"), PARSE_ERRORS)
def test_parse_errors_name_file_line_field_and_what_is_allowed(fmt: str, text: str, expected: list[str]) -> None:
    path = f"models/m/config.{fmt}"
    with pytest.raises(ConfigError) as caught:
        model_config.parse_config(text, path=path, fmt=fmt)
    message = caught.value.message
    assert message.startswith(path)
    assert_mentions(message, *expected)
    assert "inference." not in message  # protobuf's internal names stay out of user messages


def test_parse_error_carries_structured_location() -> None:
    with pytest.raises(ConfigError) as caught:
        model_config.parse_config('name: "m"\nbackend: 3x\n', path="c.pbtxt", fmt="pbtxt")
    assert (caught.value.file, caught.value.line) == ("c.pbtxt", 2)


def test_unknown_format_is_rejected() -> None:
    with pytest.raises(ConfigError, match="allowed: pbtxt, yaml, json"):
        model_config.parse_config("", path="c.toml", fmt="toml")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(max_size=200), fmt=st.sampled_from(model_config.CONFIG_FORMATS))
def test_parse_config_raises_nothing_but_config_error(text: str, fmt: str) -> None:
    try:
        model_config.parse_config(text, path="fuzz", fmt=fmt)
    except ConfigError:
        pass


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
_config_keys = st.sampled_from(
    ["name", "input", "output", "dims", "data_type", "max_batch_size", "dynamic_batching", "parameters",
     "priority_queue_policy", "instance_group", "kind", "reshape", "shape", "version_policy"]
)  # fmt: skip
_config_like = st.recursive(
    st.none() | st.booleans() | st.integers() | st.sampled_from(["TYPE_FP32", "KIND_GPU", "x", "-1"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_config_keys, inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(document=st.dictionaries(_config_keys | st.text(max_size=8), _config_like | _json_values, max_size=5))
def test_json_documents_of_any_shape_raise_nothing_but_config_error(document: dict) -> None:
    try:
        model_config.parse_config(json.dumps(document), path="fuzz.json", fmt="json")
    except ConfigError:
        pass


# --- finding and loading -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["config.pbtxt", "config.yaml", "config.yml", "config.json"])
def test_find_config_file_finds_each_name(tmp_path: Path, name: str) -> None:
    model_dir = make_model(tmp_path, {name: ""})
    assert model_config.find_config_file(model_dir) == model_dir / name


def test_find_config_file_without_a_file(tmp_path: Path) -> None:
    assert model_config.find_config_file(make_model(tmp_path, {"1/model.onnx": ""})) is None


def test_two_config_files_are_ambiguous(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path, {"config.pbtxt": "", "config.json": "{}"})
    with pytest.raises(ConfigError) as caught:
        model_config.find_config_file(model_dir)
    assert_mentions(caught.value.message, str(model_dir), "config.pbtxt, config.json", "ambiguous")


@pytest.mark.parametrize(("fmt", "text"), [("pbtxt", FULL_PBTXT), ("yaml", FULL_YAML), ("json", FULL_JSON)])
def test_load_model_config_in_each_format(tmp_path: Path, fmt: str, text: str) -> None:
    model_dir = make_model(tmp_path, {f"config.{fmt}": text})
    loaded = model_config.load_model_config(model_dir)
    assert loaded.source == str(model_dir / f"config.{fmt}")
    assert loaded.config.backend == "onnxruntime"
    assert loaded.config.platform == "onnxruntime_onnx"
    assert loaded.warnings == []


def test_empty_name_becomes_the_directory_name(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path, {"config.pbtxt": 'backend: "onnxruntime"'}, name="detector")
    assert model_config.load_model_config(model_dir).config.name == "detector"


def test_name_that_differs_from_the_directory_is_an_error(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path, {"config.pbtxt": 'backend: "python"\nname: "other"\n'}, name="detector")
    with pytest.raises(ConfigError) as caught:
        model_config.load_model_config(model_dir)
    assert_mentions(caught.value.message, "config.pbtxt:2:1", "field 'name'", "'other'", "'detector'")


def test_override_is_used_instead_of_the_file(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path, {"config.pbtxt": 'backend: "onnxruntime"\nmax_batch_size: 2\n'})
    override = json.dumps({"backend": "onnxruntime", "max_batch_size": 16, "dynamic_batching": {}})
    loaded = model_config.load_model_config(model_dir, override=override)
    assert loaded.config.max_batch_size == 16
    assert loaded.config.name == "resnet"
    assert "override" in loaded.source
    assert model_config.load_model_config(model_dir).config.max_batch_size == 2


def test_override_errors_name_the_override_and_line(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path, {"config.pbtxt": 'backend: "onnxruntime"'})
    override = '{\n  "backend": "onnxruntime",\n  "max_batch_size": -3\n}'
    with pytest.raises(ConfigError) as caught:
        model_config.load_model_config(model_dir, override=override)
    assert_mentions(caught.value.message, "override", ":3:3", "max_batch_size", "allowed: 0")


def test_override_works_without_a_config_file(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path, {"1/model.bin": ""})
    loaded = model_config.load_model_config(model_dir, override='{"backend": "python"}')
    assert model_config.backend_of(loaded.config) == "python"


@pytest.mark.parametrize(
    ("file", "backend", "platform"),
    [("1/model.onnx", "onnxruntime", "onnxruntime_onnx"), ("3/model.py", "python", "")],
)
def test_model_without_config_is_auto_completed(tmp_path: Path, file: str, backend: str, platform: str) -> None:
    model_dir = make_model(tmp_path, {file: ""})
    loaded = model_config.load_model_config(model_dir)
    assert (loaded.config.name, loaded.config.backend, loaded.config.platform) == ("resnet", backend, platform)
    assert "auto-complete" in loaded.source


@pytest.mark.parametrize("files", [{}, {"1/model.pt": ""}, {"model.onnx": ""}], ids=["empty", "torch", "no-version"])
def test_model_without_config_that_cannot_be_auto_completed(tmp_path: Path, files: dict[str, str]) -> None:
    model_dir = make_model(tmp_path, {"README": "", **files})
    with pytest.raises(ConfigError) as caught:
        model_config.load_model_config(model_dir)
    assert_mentions(caught.value.message, str(model_dir), "config.pbtxt", "model.onnx or model.py")


@pytest.mark.parametrize(
    ("config_text", "files", "backend", "platform"),
    [
        ('platform: "onnxruntime_onnx"', {}, "onnxruntime", "onnxruntime_onnx"),
        ('backend: "onnxruntime"', {}, "onnxruntime", "onnxruntime_onnx"),
        ('platform: "pytorch_libtorch"', {}, "pytorch", "pytorch_libtorch"),
        ('backend: "pytorch"', {}, "pytorch", "pytorch_libtorch"),
        ('platform: "tensorrt_plan"', {}, "tensorrt", "tensorrt_plan"),
        ('backend: "tensorrt"', {}, "tensorrt", "tensorrt_plan"),
        ('backend: "python"', {}, "python", ""),
        ("max_batch_size: 0", {"1/model.onnx": ""}, "onnxruntime", "onnxruntime_onnx"),
        ("max_batch_size: 0", {"2/model.pt": ""}, "pytorch", "pytorch_libtorch"),
        ('default_model_filename: "net.plan"', {}, "tensorrt", "tensorrt_plan"),
    ],
)
def test_backend_and_platform_are_normalized(
    tmp_path: Path, config_text: str, files: dict[str, str], backend: str, platform: str
) -> None:
    model_dir = make_model(tmp_path, {"config.pbtxt": config_text, **files})
    config = model_config.load_model_config(model_dir).config
    assert (config.backend, config.platform) == (backend, platform)
    assert model_config.backend_of(config) == backend


BACKEND_ERRORS = [
    ('name: "resnet"\nbackend: "tensorflow"\n', [":2:1", "'backend'", "onnxruntime, python, pytorch, tensorrt"]),
    ('name: "resnet"\nplatform: "tensorflow_savedmodel"\n',
     [":2:1", "'platform'", "onnxruntime_onnx, pytorch_libtorch", "ensemble"]),
    ('name: "resnet"\nplatform: "ensemble"\n', ["'ensemble_scheduling.step'", "an ensemble needs at least one step"]),
    ('backend: "python"\nplatform: "onnxruntime_onnx"\n', [":2:1", "'platform'", "does not match", "no platform"]),
    ('backend: "pytorch"\nplatform: "tensorrt_plan"\n', [":2:1", "'pytorch_libtorch' or no platform"]),
    ("max_batch_size: 0\n", ["field 'backend'", "neither backend nor platform", "onnxruntime, python"]),
]  # fmt: skip


@pytest.mark.parametrize(("config_text", "expected"), BACKEND_ERRORS)
def test_unknown_or_conflicting_backends(tmp_path: Path, config_text: str, expected: list[str]) -> None:
    model_dir = make_model(tmp_path, {"config.pbtxt": config_text})
    with pytest.raises(ConfigError) as caught:
        model_config.load_model_config(model_dir)
    assert_mentions(caught.value.message, str(model_dir / "config.pbtxt"), *expected)


def test_backend_of_without_backend_or_platform() -> None:
    with pytest.raises(ConfigError, match="allowed backends: onnxruntime, python, pytorch, tensorrt"):
        model_config.backend_of(mc.ModelConfig())


def test_file_that_is_not_utf8(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path, {})
    (model_dir / "config.pbtxt").write_bytes(b'name: "\xff"')
    with pytest.raises(ConfigError, match="UTF-8"):
        model_config.load_model_config(model_dir)


def test_instance_count_zero_means_one(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path, {"config.pbtxt": 'backend: "python"\ninstance_group [ { kind: KIND_CPU } ]'})
    assert model_config.load_model_config(model_dir).config.instance_group[0].count == 1


# --- validation ----------------------------------------------------------------------------------

_IO = 'backend: "onnxruntime"\nmax_batch_size: 8\n'

VALIDATION_ERRORS = [
    pytest.param(
        'backend: "onnxruntime"\nmax_batch_size: -1\n',
        [":2:1", "max_batch_size", "allowed: 0"],
        id="negative-max-batch-size",
    ),
    pytest.param(
        _IO + "input [ { data_type: TYPE_FP32 dims: [ 1 ] } ]",
        [":3:", "input[0].name", "non-empty name"],
        id="input-without-name",
    ),
    pytest.param(
        _IO
        + 'input [\n { name: "a" data_type: TYPE_FP32 dims: [ 1 ] },\n { name: "a" data_type: TYPE_BOOL dims: [ 1 ] }]',
        [":5:4", "input[1].name", "'a' is used twice", "input[0]", "unique names"],
        id="duplicate-input",
    ),
    pytest.param(
        _IO
        + 'output [\n { name: "o" data_type: TYPE_FP32 dims: [ 1 ] },\n { name: "o" data_type: TYPE_BOOL dims: [1] }]',
        [":5:4", "output[1].name", "unique names"],
        id="duplicate-output",
    ),
    pytest.param(
        _IO + 'input [ { name: "a" dims: [ 1 ] } ]',
        [":3:", "input[0].data_type", "no data_type", "TYPE_FP32", "TYPE_STRING"],
        id="missing-data-type",
    ),
    pytest.param(
        _IO + 'input [ { name: "a" data_type: TYPE_FP32\n dims: [ 3, 0 ] } ]',
        [":4:2", "input[0].dims", "contain 0", "-1 (any size) or 1 or more"],
        id="zero-dim",
    ),
    pytest.param(
        _IO + 'output [ { name: "a" data_type: TYPE_FP32\n dims: [ -2 ] } ]',
        [":4:2", "output[0].dims", "contain -2", "-1 (any size) or 1 or more"],
        id="dim-below-minus-one",
    ),
    pytest.param(
        _IO + 'input [ { name: "a" data_type: TYPE_FP32 } ]',
        [":3:", "input[0].dims", "dims is empty", "reshape"],
        id="empty-dims",
    ),
    pytest.param(
        _IO + 'input [ { name: "a" data_type: TYPE_FP32\n dims: [ 4294967296, 4294967296 ] } ]',
        [":4:2", "input[0].dims", "int64"],
        id="dims-overflow-int64",
    ),
    pytest.param(
        _IO + 'input [ { name: "a" data_type: TYPE_FP32 dims: [ 2, 3 ]\n reshape { shape: [ 5 ] } } ]',
        [":4:2", "input[0].reshape", "5 elements", "have 6", "same element count"],
        id="reshape-count",
    ),
    pytest.param(
        _IO + 'input [ { name: "a" data_type: TYPE_FP32 dims: [ 2 ]\n reshape { shape: [ 0 ] } } ]',
        [":4:", "input[0].reshape.shape", "contain 0"],
        id="reshape-zero",
    ),
    pytest.param(
        'backend: "onnxruntime"\n\ndynamic_batching { }\n',
        [":3:1", "dynamic_batching", "max_batch_size > 0", "allowed"],
        id="dynamic-batching-without-batching",
    ),
    pytest.param(
        _IO + "dynamic_batching {\n  preferred_batch_size: [ 4, 16 ]\n}\n",
        [":4:3", "dynamic_batching.preferred_batch_size", "16", "allowed: 1 to max_batch_size (8)"],
        id="preferred-batch-too-big",
    ),
    pytest.param(
        _IO + "dynamic_batching {\n  preferred_batch_size: [ 0 ]\n}\n",
        [":4:3", "dynamic_batching.preferred_batch_size", "allowed: 1 to max_batch_size (8)"],
        id="preferred-batch-zero",
    ),
    pytest.param(
        _IO + "dynamic_batching {\n  priority_levels: 3\n  default_priority_level: 4\n}\n",
        [":5:3", "dynamic_batching.default_priority_level", "is 4", "allowed: 1 to priority_levels (3)"],
        id="default-priority-out-of-range",
    ),
    pytest.param(
        _IO + "dynamic_batching {\n  priority_levels: 3\n}\n",
        [":3:", "dynamic_batching.default_priority_level", "is 0", "allowed: 1 to priority_levels (3)"],
        id="default-priority-missing",
    ),
    pytest.param(
        _IO + "dynamic_batching {\n  priority_levels: 2\n  default_priority_level: 1\n"
        "  priority_queue_policy { key: 3 value { } }\n}\n",
        [":6:3", "dynamic_batching.priority_queue_policy[3]", "allowed: 1 to priority_levels (2)"],
        id="priority-policy-out-of-range",
    ),
    pytest.param(
        _IO + "dynamic_batching {\n  priority_queue_policy { key: 1 value { } }\n}\n",
        [":4:3", "priority_queue_policy[1]", "none while priority_levels is 0"],
        id="priority-policy-without-levels",
    ),
    pytest.param(
        _IO + "instance_group [ {\n count: -2 } ]",
        [":4:2", "instance_group[0].count", "allowed: 1 to 256 (0 means 1)"],
        id="negative-count",
    ),
    pytest.param(
        _IO + "instance_group [ {\n count: 2147483647 } ]",
        [":4:2", "instance_group[0].count", "is 2147483647", "allowed: 1 to 256 (0 means 1)"],
        id="huge-count",
    ),
    pytest.param(
        _IO + "dynamic_batching {\n  priority_levels: 18446744073709551615\n  default_priority_level: 1\n}\n",
        [":4:3", "dynamic_batching.priority_levels", "allowed: 0 (none) to 1024"],
        id="huge-priority-levels",
    ),
    pytest.param(
        _IO + "instance_group [ { kind: KIND_GPU\n gpus: [ -1 ] } ]",
        [":4:2", "instance_group[0].gpus", "allowed: 0 or more"],
        id="negative-gpu",
    ),
    pytest.param(
        _IO + "instance_group [ { kind: KIND_CPU\n gpus: [ 0 ] } ]",
        [":4:2", "instance_group[0].gpus", "KIND_CPU", "only with KIND_GPU"],
        id="gpus-on-cpu",
    ),
    pytest.param(
        _IO + "version_policy {\n latest { num_versions: 0 } }",
        [":4:", "version_policy.latest.num_versions", "allowed: 1 or more"],
        id="latest-zero",
    ),
    pytest.param(
        _IO + "version_policy {\n specific { versions: [ 1, -2 ] } }",
        [":4:", "version_policy.specific.versions", "[-2]", "0 or more"],
        id="negative-version",
    ),
]


@pytest.mark.parametrize(("config_text", "expected"), VALIDATION_ERRORS)
def test_validation_errors_name_file_line_field_and_what_is_allowed(
    tmp_path: Path, config_text: str, expected: list[str]
) -> None:
    model_dir = make_model(tmp_path, {"config.pbtxt": config_text})
    with pytest.raises(ConfigError) as caught:
        model_config.load_model_config(model_dir)
    assert caught.value.message.startswith(str(model_dir / "config.pbtxt"))
    assert_mentions(caught.value.message, *expected)


@pytest.mark.parametrize(
    ("fmt", "text", "location"),
    [
        ("yaml", "backend: python\ninput:\n  - name: a\n    data_type: TYPE_FP32\n    dims: [0]\n", ":5:5"),
        ("json", '{"backend": "python",\n "input": [{"name": "a", "dataType": "TYPE_FP32",\n  "dims": [0]}]}', ":3:3"),
    ],
)  # fmt: skip
def test_validation_errors_locate_the_key_in_yaml_and_json(tmp_path: Path, fmt: str, text: str, location: str) -> None:
    model_dir = make_model(tmp_path, {f"config.{fmt}": text})
    with pytest.raises(ConfigError) as caught:
        model_config.load_model_config(model_dir)
    assert_mentions(caught.value.message, f"config.{fmt}{location}", "input[0].dims")


@pytest.mark.parametrize(
    ("fmt", "text", "location"),
    [
        ("pbtxt", 'backend: "python"\nparameters { key: "a" value { string_value: "1" } }\n'
                  "parameters {\n  key: 'b'\n  value { string_value: \"x\" } }\n", ":3:1"),
        ("yaml", "backend: python\nparameters:\n  a: {string_value: '1'}\n  b: {string_value: x}\n", ":4:3"),
        ("json", '{"backend": "python", "parameters": {\n "a": {"string_value": "1"},\n "b": {"string_value": "x"}}}',
         ":3:2"),
    ],
)  # fmt: skip
def test_a_later_complaint_about_a_parameter_is_placed_at_its_entry(
    tmp_path: Path, fmt: str, text: str, location: str
) -> None:
    """A backend reads its parameters after validation; ``placed`` finds the entry by its key."""
    model_dir = make_model(tmp_path, {f"config.{fmt}": text})
    loaded = model_config.load_model_config(model_dir)
    placed = loaded.placed(ConfigError("'x' is not an integer", field="parameters[b]"))
    assert placed.message.startswith(f"{model_dir / f'config.{fmt}'}{location}: field 'parameters[b]': 'x' is not")
    elsewhere = ConfigError("cannot load", file=str(model_dir / "1" / "model.onnx"))
    assert loaded.placed(elsewhere) is elsewhere  # about another file: left as it is


_TWO = 'parameters { key: "a" value { string_value: "1" } }\n'


@pytest.mark.parametrize(
    ("text", "field", "location"),
    [
        ('backend: "python"\n' + _TWO + 'parameters {\n key:\n  "b"\n value { } }\n', "parameters[b]", (3, 1)),
        ('backend: "python"\n' + _TWO + 'parameters { key: "b\\"c" value { } }\n', 'parameters[b"c]', (3, 1)),
        ('backend: "python"\n' + _TWO + 'parameters { key: "a" value { } }\n', "parameters[a]", (3, 1)),  # last wins
        ('# a \u2028 in a comment\nbackend: "python"\n' + _TWO + 'parameters { key: "b" }\n', "parameters[b]", (4, 1)),
        (
            'backend: "python"\nmax_batch_size: 4\ndynamic_batching { priority_levels: 2 default_priority_level: 1\n'
            " priority_queue_policy { key: 2 value { } }\n priority_queue_policy { key: 1 value { } } }\n",
            "dynamic_batching.priority_queue_policy[1]",
            (5, 2),
        ),
    ],
    ids=["key-on-a-later-line", "escaped-quote", "repeated-key", "unicode-line-separator", "integer-keys"],
)
def test_map_entries_are_located_by_key_in_pbtxt(tmp_path: Path, text: str, field: str, location: tuple) -> None:
    model_dir = make_model(tmp_path, {"config.pbtxt": text})
    loaded = model_config.load_model_config(model_dir)
    placed = loaded.placed(ConfigError("bad", field=field))
    assert (placed.line, placed.column) == location
    unplaced = ConfigError("tensor 'y' has ONNX type seq(tensor(float))")  # about no field of the config
    assert loaded.placed(unplaced) is unplaced


def test_validate_directly_names_the_source_and_field() -> None:
    config = pbtxt('backend: "python" max_batch_size: 2 input [ { name: "a" data_type: TYPE_FP32 dims: [ 0 ] } ]')
    with pytest.raises(ConfigError) as caught:
        model_config.validate(config, source="repo/a/config.pbtxt")
    assert (caught.value.file, caught.value.field) == ("repo/a/config.pbtxt", "input[0].dims")


def test_a_full_config_validates_without_warnings() -> None:
    config = model_config.parse_config(FULL_PBTXT, path="c", fmt="pbtxt")
    assert model_config.validate(config, source="c") == []


# --- warnings for fields Sluice does not implement yet -------------------------------------------

WARNINGS = [
    (
        "sequence_batching { direct { minimum_slot_utilization: 0.5 } }",
        ["sequence_batching.direct.minimum_slot_utilization: Direct dispatches as soon as an instance is free"],
    ),
    ('model_warmup [ { name: "w" batch_size: 1 } ]', []),  # implemented (warmup.py)
    ("optimization { priority: PRIORITY_MAX }", ["optimization.priority: not implemented yet"]),
    ("optimization { execution_accelerators { gpu_execution_accelerator [ { name: 'cuda' } ] } }", []),  # implemented
    ('instance_group [ { kind: KIND_GPU profile: [ "0", "1" ] } ]', []),  # implemented (tensorrt)
    ("optimization { cuda { graphs: true busy_wait_events: true } }",
     ["optimization.cuda.graphs: only the pytorch backend captures CUDA graphs; ignored for 'python'",
      "optimization.cuda.busy_wait_events: ignored"]),
    ("optimization { graph { level: 1 } }",
     ["optimization.graph: only the onnxruntime backend applies graph optimization levels; ignored for 'python'"]),
    ('input [ { name: "a" data_type: TYPE_FP32 dims: [ 1 ] format: FORMAT_NCHW } ]', ["input[0].format: ignored"]),
    (
        'input [ { name: "a" data_type: TYPE_INT32 dims: [ 1 ] },'
        ' { name: "s" data_type: TYPE_INT32 dims: [ 1 ] is_shape_tensor: true allow_ragged_batch: true } ]',
        ["input[1].is_shape_tensor: shape tensors", "input[1].allow_ragged_batch: ragged"],
    ),
    ('output [ { name: "o" data_type: TYPE_FP32 dims: [ 2 ] label_filename: "l.txt" } ]', []),  # implemented
    ("instance_group [ { count: 1 }, { count: 1 passive: true rate_limiter { priority: 2 } } ]",
     ["instance_group[1].rate_limiter", "instance_group[1].passive"]),
    ('batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "n" } ]', ["batch_input: not implemented yet"]),
    ('cc_model_filenames { key: "8.0" value: "a.plan" }', ["cc_model_filenames"]),
    ('metric_tags { key: "team" value: "x" }', ["metric_tags"]),
    ('model_repository_agents { agents [ { name: "checksum" } ] }', ["model_repository_agents"]),
    ('runtime: "libtorch.so"', ["runtime: custom backend runtimes"]),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "expected"), WARNINGS)
def test_unimplemented_fields_are_named_in_warnings(extra: str, expected: list[str]) -> None:
    config = pbtxt(f'backend: "python"\nmax_batch_size: 4\n{extra}')
    warnings = model_config.validate(config, source="c")
    assert len(warnings) == len(expected), warnings
    for warning, start in zip(warnings, expected, strict=True):
        assert warning.startswith(start), (warning, start)


def test_cuda_graphs_of_a_pytorch_model_give_no_warning() -> None:
    config = pbtxt(
        'platform: "pytorch_libtorch" max_batch_size: 8 optimization { cuda { graphs: true '
        'graph_spec [ { batch_size: 4 input { key: "x" value { dim: [ 3 ] } } } ] } }'
    )
    assert model_config.validate(config, source="c") == []


def test_the_loaded_config_shows_what_triton_fills_in(tmp_path: Path) -> None:
    """The config clients read back (GET .../config) has Triton's defaults written in: the version
    policy, each instance group's name (the prefix of its instances' names) and count."""
    text = 'backend: "python"\ninstance_group [ { kind: KIND_CPU }, { name: "mine", count: 2 } ]\n'
    config = model_config.load_model_config(make_model(tmp_path, {"config.pbtxt": text})).config
    assert model_config.config_to_json(config)["version_policy"] == {"latest": {"num_versions": 1}}
    assert [(g.name, g.count) for g in config.instance_group] == [("resnet_0", 1), ("mine", 2)]
    policy = 'backend: "python"\nversion_policy { all { } }\n'
    kept = model_config.load_model_config(make_model(tmp_path, {"config.pbtxt": policy}, name="other")).config
    assert kept.version_policy.WhichOneof("policy_choice") == "all"  # a policy given is kept


def test_warnings_reach_the_loaded_config(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path, {"config.yaml": "backend: python\nmetric_tags: {team: x}\n"})
    assert model_config.load_model_config(model_dir).warnings == [
        "metric_tags: metric tags are not implemented yet; ignored"
    ]


@pytest.mark.parametrize(
    "extra",
    [
        "optimization { }",
        "model_transaction_policy { decoupled: false }",
        'input [ { name: "a" data_type: TYPE_FP32 dims: [ 1 ] format: FORMAT_NONE } ]',
        "response_cache { enable: true }",
        'parameters { key: "k" value { string_value: "v" } }',
        'default_model_filename: "net.onnx"',
        "version_policy { all { } }",
    ],
)
def test_implemented_or_empty_fields_give_no_warning(extra: str) -> None:
    assert model_config.validate(pbtxt(f'backend: "python"\n{extra}'), source="c") == []


def test_the_unimplemented_table_names_real_fields() -> None:
    for pattern in model_config.UNIMPLEMENTED_FIELDS:
        desc = mc.ModelConfig.DESCRIPTOR
        *parents, leaf = pattern.replace("[]", "").split(".")
        for part in parents:
            desc = desc.fields_by_name[part].message_type
        assert leaf in desc.fields_by_name, pattern


def test_every_top_level_field_is_implemented_or_in_the_table() -> None:
    """A field added to model_config.proto must be decided on: implemented, or listed as not yet."""
    config = model_config.parse_config(FULL_PBTXT, path="c", fmt="pbtxt")
    # ensemble_scheduling and sequence_batching share a oneof with dynamic_batching: FULL_PBTXT cannot hold them.
    implemented = {fd.name for fd, _ in config.ListFields()}
    implemented |= {"backend", "default_model_filename", "ensemble_scheduling", "model_transaction_policy",
                    "sequence_batching", "optimization", "model_warmup"}  # optimization: onnxrt.py
    for fd in mc.ModelConfig.DESCRIPTOR.fields:
        assert (
            fd.name in implemented
            or fd.name in model_config.UNIMPLEMENTED_FIELDS
            or any(key.startswith(fd.name + "[]") for key in model_config.UNIMPLEMENTED_FIELDS)
        ), fd.name


# --- auto-complete from the model's tensors ------------------------------------------------------

BATCHING_INPUTS = [TensorSpec("image", "FP32", (-1, 3, 224, 224)), TensorSpec("ids", "BYTES", (-1,))]
BATCHING_OUTPUTS = [TensorSpec("probs", "FP16", (-1, 1000))]


def test_complete_io_fills_a_batching_model_like_triton() -> None:
    config = mc.ModelConfig(name="m", backend="onnxruntime")
    notes = model_config.complete_io(config, BATCHING_INPUTS, BATCHING_OUTPUTS)
    assert config == pbtxt(
        """name: "m" backend: "onnxruntime" max_batch_size: 4 dynamic_batching { }
        input [ { name: "image" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] },
                { name: "ids" data_type: TYPE_STRING dims: [ 1 ] reshape { shape: [ ] } } ]
        output [ { name: "probs" data_type: TYPE_FP16 dims: [ 1000 ] } ]"""
    )
    assert any("max_batch_size set to 4" in note for note in notes)
    assert any("dynamic_batching enabled" in note for note in notes)
    assert any("input 'image' added" in note for note in notes)
    assert model_config.validate(config, source="c") == []


def test_complete_io_keeps_an_explicit_max_batch_size_and_scheduler() -> None:
    config = pbtxt('backend: "onnxruntime" max_batch_size: 16 sequence_batching { }')
    model_config.complete_io(config, BATCHING_INPUTS, BATCHING_OUTPUTS)
    assert config.max_batch_size == 16
    assert not config.HasField("dynamic_batching")
    assert list(config.input[0].dims) == [3, 224, 224]


def test_complete_io_max_batch_size_one_does_not_enable_dynamic_batching() -> None:
    config = pbtxt('backend: "onnxruntime" max_batch_size: 1')
    model_config.complete_io(config, BATCHING_INPUTS, BATCHING_OUTPUTS)
    assert not config.HasField("dynamic_batching")


def test_complete_io_for_a_model_that_cannot_batch() -> None:
    config = mc.ModelConfig(name="m", backend="onnxruntime")
    inputs = [TensorSpec("x", "INT64", (2, -1))]
    outputs = [TensorSpec("y", "FP32", ())]
    model_config.complete_io(config, inputs, outputs)
    assert config == pbtxt(
        """name: "m" backend: "onnxruntime"
        input [ { name: "x" data_type: TYPE_INT64 dims: [ 2, -1 ] } ]
        output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]"""
    )
    model_config.complete_io(config, inputs, outputs)  # a completed config agrees with its model


def test_complete_io_keeps_max_batch_size_zero_when_the_config_lists_inputs_and_outputs() -> None:
    config = pbtxt(
        """backend: "onnxruntime"
        input [ { name: "image" data_type: TYPE_FP32 dims: [ -1, 3, 224, 224 ] },
                { name: "ids" data_type: TYPE_STRING dims: [ -1 ] } ]
        output [ { name: "probs" data_type: TYPE_FP16 dims: [ -1, 1000 ] } ]"""
    )
    assert model_config.complete_io(config, BATCHING_INPUTS, BATCHING_OUTPUTS) == []
    assert config.max_batch_size == 0
    assert not config.HasField("dynamic_batching")


def test_complete_io_adds_only_what_is_missing() -> None:
    config = pbtxt(
        """backend: "onnxruntime" max_batch_size: 2
        input [ { name: "image" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] } ]
        output [ { name: "probs" data_type: TYPE_FP16 dims: [ 1000 ] } ]"""
    )
    notes = model_config.complete_io(config, BATCHING_INPUTS, BATCHING_OUTPUTS)
    assert [i.name for i in config.input] == ["image", "ids"]
    assert config.input[0] == pbtxt('input { name: "image" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] }').input[0]
    assert notes == ["input 'ids' added from the model: TYPE_STRING dims [1]"]


COMPLETION_ERRORS = [
    pytest.param(
        'max_batch_size: 4 input [ { name: "image" data_type: TYPE_FP16 dims: [ 3, 224, 224 ] } ]',
        ["input[0].data_type", "TYPE_FP16 in the config", "TYPE_FP32 (FP32)"],
        id="datatype",
    ),
    pytest.param(
        'max_batch_size: 4 input [ { name: "image" data_type: TYPE_FP32 dims: [ 3, 224 ] } ]',
        ["input[0].dims", "dims [3, 224]", "[-1, 3, 224, 224]"],
        id="rank",
    ),
    pytest.param(
        'max_batch_size: 4 output [ { name: "probs" data_type: TYPE_FP16 dims: [ 10 ] } ]',
        ["output[0].dims", "dims [10]", "[-1, 1000]"],
        id="dim",
    ),
    pytest.param(
        'input [ { name: "image" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] } ]'
        ' output [ { name: "probs" data_type: TYPE_FP16 dims: [ -1, 1000 ] } ]',
        ["input[0].dims", "[-1, 3, 224, 224]"],
        id="batch-dim-missing-with-max-batch-size-zero",
    ),
    pytest.param(
        'max_batch_size: 4 input [ { name: "image" data_type: TYPE_FP32 dims: [ 3, -1, 224 ] } ]',
        ["input[0].dims", "dims [3, -1, 224]", "any where the model's is -1"],
        id="config-dynamic-where-model-is-fixed",
    ),
    pytest.param(
        'input [ { name: "pixels" data_type: TYPE_FP32 dims: [ 1 ] } ]',
        ["input[0].name", "'pixels' is not an input of the model", "'image', 'ids'"],
        id="unknown-input",
    ),
    pytest.param(
        'output [ { name: "logits" data_type: TYPE_FP32 dims: [ 1 ] } ]',
        ["output[0].name", "'logits'", "'probs'"],
        id="unknown-output",
    ),
]


@pytest.mark.parametrize(("config_text", "expected"), COMPLETION_ERRORS)
def test_complete_io_rejects_configs_that_disagree_with_the_model(config_text: str, expected: list[str]) -> None:
    config = pbtxt('name: "m" backend: "onnxruntime" ' + config_text)
    with pytest.raises(ConfigError) as caught:
        model_config.complete_io(config, BATCHING_INPUTS, BATCHING_OUTPUTS, source="repo/m/config.pbtxt")
    assert_mentions(caught.value.message, "repo/m/config.pbtxt", *expected)


def test_complete_io_rejects_batching_for_a_model_that_cannot_batch() -> None:
    config = pbtxt('name: "m" backend: "onnxruntime" max_batch_size: 8')
    with pytest.raises(ConfigError) as caught:
        model_config.complete_io(config, [TensorSpec("x", "FP32", (1, 3))], [TensorSpec("y", "FP32", (-1,))])
    assert_mentions(caught.value.message, "model 'm'", "max_batch_size", "'x'", "[1, 3]", "allowed: max_batch_size: 0")


def test_complete_io_rejects_a_datatype_sluice_cannot_serve() -> None:
    with pytest.raises(ConfigError, match="COMPLEX64"):
        model_config.complete_io(mc.ModelConfig(name="m"), [TensorSpec("x", "COMPLEX64", (2,))], [])


# --- versions and JSON ---------------------------------------------------------------------------

VERSION_CASES = [
    ("", [1, 2, 3], [3]),
    ("version_policy { latest { num_versions: 2 } }", [3, 1, 2], [2, 3]),
    ("version_policy { latest { num_versions: 5 } }", [1, 2], [1, 2]),
    ("version_policy { all { } }", [10, 2, 2, 7], [2, 7, 10]),
    ("version_policy { specific { versions: [ 3, 1 ] } }", [1, 2, 3], [1, 3]),
    ("", [], []),
    ("version_policy { specific { versions: [ 3 ] } }", [], []),
    ("version_policy { specific { versions: [ 1, 4, 5 ] } }", [1, 2, 3], [1]),  # Triton serves those present
]


@pytest.mark.parametrize(("policy", "available", "expected"), VERSION_CASES)
def test_select_versions(policy: str, available: list[int], expected: list[int]) -> None:
    assert model_config.select_versions(pbtxt(policy), available) == expected


def test_specific_versions_that_are_missing() -> None:
    config = pbtxt('name: "m" version_policy { specific { versions: [ 1, 4, 5 ] } }')
    assert model_config.missing_versions(config, [1, 2, 3]) == [4, 5]
    assert model_config.missing_versions(pbtxt('name: "m"'), [1]) == []
    none = pbtxt('name: "m" version_policy { specific { versions: [ 5, 4 ] } }')
    with pytest.raises(ConfigError) as caught:
        model_config.select_versions(none, [1, 2, 3], source="repo/m/config.pbtxt")
    assert_mentions(
        caught.value.message, "repo/m/config.pbtxt", "version_policy.specific.versions", "[4, 5]", "[1, 2, 3]"
    )


def test_config_to_json_is_tritons_form_and_round_trips() -> None:
    config = model_config.parse_config(FULL_PBTXT, path="c", fmt="pbtxt")
    data = model_config.config_to_json(config)
    assert data["input"][0]["dims"] == [3, -1, -1]  # numbers, not protobuf's int64 strings
    assert data["input"][0]["data_type"] == "TYPE_FP32"
    assert data["dynamic_batching"]["max_queue_delay_microseconds"] == 100
    assert data["dynamic_batching"]["priority_queue_policy"]["2"]["max_queue_size"] == 4
    assert data["version_policy"] == {"latest": {"num_versions": 2}}
    assert data["backend"] == ""  # fields at their defaults are present, as in Triton's output
    assert model_config.parse_config(json.dumps(data), path="c.json", fmt="json") == config
