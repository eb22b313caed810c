"""Model configuration: read, check and complete a Triton ``ModelConfig`` for one model directory.

The repository calls :func:`load_model_config` when it loads a model (with the JSON ``override`` of
Triton's ``load_model(name, config=...)`` when the client sent one), then :func:`select_versions` to
pick the version directories to load, and the backend calls :func:`complete_io` with the tensors
the model file declares (Triton's auto-complete). The HTTP and gRPC model-config endpoints serve
:func:`config_to_json` / the message itself.

Configs are Triton's own protobuf message (``model_config_pb2.ModelConfig``), read from
``config.pbtxt``, ``config.yaml``/``config.yml`` or ``config.json``. Every problem is a
:class:`~sluice.runtime.errors.ConfigError` naming the file, line and column where they are known,
the field path (``input[1].dims``) and what is allowed. Fields that parse but that Sluice does not
implement yet are named in warnings (table :data:`UNIMPLEMENTED_FIELDS`), never silently ignored.

Where Sluice differs from Triton, on purpose:

* inputs/outputs missing from a config that lists some are added from the model (Triton's ONNX
  backend completes a section only when it is empty, then fails on the missing tensor);
* ``instance_group.count`` below 0 is an error (Triton silently uses its default), and so are more
  than 256 instances in a group or more than 1024 ``priority_levels`` (Triton takes any number, and
  a value near 2^64 would stall the loader building its queues);
* ``dynamic_batching`` with ``max_batch_size: 0`` is an error (Triton accepts and never batches).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml
from google.protobuf import json_format, text_encoding, text_format
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from google.protobuf.message import Message
from tritonclient.grpc import model_config_pb2 as mc

from sluice.runtime import names
from sluice.runtime.backends.base import TensorSpec
from sluice.runtime.config_json import config_to_json as config_to_json  # the config endpoint's form
from sluice.runtime.errors import ConfigError, SluiceError
from sluice.runtime.types import CONFIG_TYPE_BY_DATATYPE

KNOWN_BACKENDS: tuple[str, ...] = ("onnxruntime", "python", "pytorch", "tensorrt")

# Triton platform names and the backend that serves each; the Python backend has no platform.
BACKEND_BY_PLATFORM: dict[str, str] = {
    "onnxruntime_onnx": "onnxruntime",
    "pytorch_libtorch": "pytorch",
    "tensorrt_plan": "tensorrt",
}
PLATFORM_BY_BACKEND: dict[str, str] = {v: k for k, v in BACKEND_BY_PLATFORM.items()}
PYTHON_PLATFORM_HANDLER = "pytorch"
"""``backend: "python"`` with this platform runs Triton's PyTorch platform handler (torch_platform.py)."""

# Triton's ensemble platform: no backend and no model file; ``ensemble_scheduling`` names the steps.
# :func:`backend_of` answers this name for it.
ENSEMBLE = "ensemble"

# ``parameters { key: "sluice.remote.<model>" value { string_value: "<host>:<port>" } }`` in an
# ensemble config: the step model <model> is called over gRPC at that address instead of locally
# (the operator writes these for steps it cannot colocate).
REMOTE_STEP_PREFIX = "sluice.remote."

CONFIG_FORMATS: tuple[str, ...] = ("pbtxt", "yaml", "json")

# Looked up in this order; more than one present is an error.
CONFIG_FILE_NAMES: tuple[str, ...] = ("config.pbtxt", "config.yaml", "config.yml", "config.json")

# Triton's ``--backend-config=default-max-batch-size`` default, used by auto-complete.
DEFAULT_MAX_BATCH_SIZE = 4

# A model directory without a config file is auto-completed from the first version directory
# holding one of these files (Triton auto-completes ONNX and Python models only; Sluice also
# completes a torch.export program, model.pt2, from its signature).
AUTO_COMPLETE_FILES: dict[str, str] = {"model.onnx": "onnxruntime", "model.py": "python", "model.pt2": "pytorch"}
# With a config that names neither backend nor platform, the backend also follows these files.
_MODEL_FILES: dict[str, str] = {**AUTO_COMPLETE_FILES, "model.pt": "pytorch", "model.plan": "tensorrt"}

_NOT_YET = "not implemented yet; this model will be served without it"
_DIRECT_AT_ONCE = "Direct dispatches as soon as an instance is free; ignored"

# Fields that parse but that Sluice does not implement yet: field pattern ("[]" marks a repeated
# field's elements) -> what happens instead. Shrink this table as features land.
UNIMPLEMENTED_FIELDS: dict[str, str] = {
    "runtime": "custom backend runtimes are not supported; ignored",
    "input[].format": "ignored (only FORMAT_NONE is meaningful; Triton deprecated input formats)",
    "input[].is_shape_tensor": "shape tensors are not implemented yet; ignored",
    "input[].allow_ragged_batch": "ragged batching is not implemented yet; ignored",
    "input[].is_non_linear_format_io": "non-linear I/O formats are not implemented yet; ignored",
    "output[].is_shape_tensor": "shape tensors are not implemented yet; ignored",
    "output[].is_non_linear_format_io": "non-linear I/O formats are not implemented yet; ignored",
    "batch_input": _NOT_YET,
    "batch_output": _NOT_YET,
    "optimization.cuda.busy_wait_events": "ignored (Triton's TensorRT backend setting)",
    "optimization.cuda.output_copy_stream": "ignored (Triton's TensorRT backend setting)",
    "sequence_batching.direct.max_queue_delay_microseconds": _DIRECT_AT_ONCE,
    "sequence_batching.direct.minimum_slot_utilization": _DIRECT_AT_ONCE,
    "sequence_batching.state[].use_same_buffer_for_input_output": "ignored (the state is handed over between requests)",
    "sequence_batching.state[].use_growable_memory": "ignored (the state is handed over between requests)",
    "ensemble_scheduling.max_inflight_requests": "not implemented yet; in-flight steps are not limited",
    "ensemble_scheduling.step[].model_namespace": "model namespaces are not implemented yet; ignored",
    "instance_group[].rate_limiter": "rate limiting is not implemented yet; ignored",
    "instance_group[].secondary_devices": "secondary devices are not implemented yet; ignored",
    "instance_group[].passive": "passive instances are not implemented yet; the instances are active",
    "instance_group[].host_policy": "host policies are not implemented yet; ignored",
    "cc_model_filenames": "per-compute-capability model files are not implemented yet; ignored",
    "metric_tags": "metric tags are not implemented yet; ignored",
    "model_operations": "custom operation libraries are not implemented yet; ignored",
    "model_repository_agents": "repository agents are not implemented yet; ignored",
    "model_metrics": "custom model metrics are not implemented yet; ignored",
}
# Unimplemented message fields that change nothing while empty (``optimization {}``).
_HARMLESS_WHEN_EMPTY: frozenset[str] = frozenset({"model_transaction_policy"})

# Fields Sluice implements. A message field listed here is walked into when some pattern below it
# is listed too; otherwise it is implemented as a whole. A set field in neither table is warned
# about as well, so fields of a newer model_config.proto are never silently ignored.
_IMPLEMENTED_FIELDS: frozenset[str] = frozenset({
    "name", "platform", "backend", "max_batch_size", "parameters", "default_model_filename",
    "response_cache",
    "ensemble_scheduling", "ensemble_scheduling.step", "ensemble_scheduling.step[].model_name",
    "ensemble_scheduling.step[].model_version", "ensemble_scheduling.step[].input_map",
    "ensemble_scheduling.step[].output_map",
    "version_policy", "version_policy.latest", "version_policy.latest.num_versions",
    "version_policy.all", "version_policy.specific", "version_policy.specific.versions",
    "input", "input[].name", "input[].data_type", "input[].dims", "input[].reshape",
    "input[].reshape.shape", "input[].optional",
    "output", "output[].name", "output[].data_type", "output[].dims", "output[].reshape",
    "output[].reshape.shape", "output[].label_filename",
    "dynamic_batching", "dynamic_batching.preferred_batch_size",
    "dynamic_batching.max_queue_delay_microseconds", "dynamic_batching.preserve_ordering",
    "dynamic_batching.priority_levels", "dynamic_batching.default_priority_level",
    "dynamic_batching.default_queue_policy", "dynamic_batching.priority_queue_policy",
    "instance_group", "instance_group[].name", "instance_group[].count", "instance_group[].kind",
    "instance_group[].gpus", "instance_group[].profile",
    "optimization", "optimization.execution_accelerators",
    "model_transaction_policy",
    "optimization.cuda", "optimization.cuda.graphs", "optimization.cuda.graph_spec",
    "optimization.graph", "optimization.graph.level",
    "sequence_batching", "sequence_batching.direct", "sequence_batching.oldest",
    "sequence_batching.max_sequence_idle_microseconds", "sequence_batching.control_input",
    "sequence_batching.state", "sequence_batching.state[].input_name", "sequence_batching.state[].output_name",
    "sequence_batching.state[].data_type", "sequence_batching.state[].dims", "sequence_batching.state[].initial_state",
    "model_warmup",
})  # fmt: skip

_INT64_MAX = 2**63 - 1
_INT_RANGES: dict[int, tuple[int, int, str]] = {
    FieldDescriptor.CPPTYPE_INT32: (-(2**31), 2**31 - 1, "int32"),
    FieldDescriptor.CPPTYPE_INT64: (-(2**63), _INT64_MAX, "int64"),
    FieldDescriptor.CPPTYPE_UINT32: (0, 2**32 - 1, "uint32"),
    FieldDescriptor.CPPTYPE_UINT64: (0, 2**64 - 1, "uint64"),
}


_Fail = Callable[[str, str], ConfigError]


@dataclasses.dataclass(frozen=True)
class LoadedConfig:
    """A parsed, normalized and validated model configuration."""

    config: mc.ModelConfig
    source: str
    """Where it came from: the config file's path, or a description of the override."""
    warnings: list[str]
    """Fields that parsed but that Sluice does not implement yet, one sentence each."""
    text: str = ""
    """The source text (empty for an auto-completed model), to place later errors in it."""
    fmt: str = "pbtxt"

    def placed(self, exc: ConfigError) -> ConfigError:
        """``exc`` (a later step's complaint about a field of this config) with this config's file,
        and the line and column of its field when the text has it."""
        if exc.line is not None or exc.field is None or exc.file not in (None, self.source):
            return exc  # placed already, about no field of the config, or about another file
        line, column = _locate(self.text, self.fmt, exc.field)
        return ConfigError(exc.detail, file=self.source, line=line, column=column, field=exc.field)


# --- parsing -------------------------------------------------------------------------------------


def parse_config(text: str, *, path: str, fmt: str) -> mc.ModelConfig:
    """Parse ``text`` in ``fmt`` (pbtxt, yaml or json) into a ``ModelConfig``; ``path`` names it in errors."""
    if fmt == "pbtxt":
        return _parse_pbtxt(text, path)
    if fmt in ("yaml", "json"):
        data = _load_document(text, path, fmt)
        normalized = _check_message(data, mc.ModelConfig.DESCRIPTOR, "", text, path, fmt)
        config = mc.ModelConfig()
        try:
            json_format.ParseDict(normalized, config)
        except Exception as exc:  # protobuf raises assorted types; whatever slipped past the check
            raise ConfigError(_strip_protobuf_noise(str(exc)), file=path) from exc
        return config
    raise ConfigError(f"unknown config format '{fmt}'; allowed: {', '.join(CONFIG_FORMATS)}", file=path)


def _parse_pbtxt(text: str, path: str) -> mc.ModelConfig:
    config = mc.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        line, column = exc.GetLine(), exc.GetColumn()
        raw = _strip_pbtxt_prefix(str(exc), text, line, column)
        field, fd = _pbtxt_field_at(text, line, column)
        message = _friendly_pbtxt_error(raw, fd)
        if message is None:
            message, field = f"syntax error: {raw}", None
        raise ConfigError(message, file=path, line=line, column=column, field=field) from exc
    except Exception as exc:  # e.g. an invalid escape in a string: protobuf raises plain errors
        raise ConfigError(f"cannot parse: {exc}", file=path) from exc
    if (unknown := _unknown_enum(config)) is not None:
        # proto3 text format takes any number for an enum (data_type: 99); JSON and YAML are checked
        field, enum, number = unknown
        line, column = _locate(text, "pbtxt", field)
        raise ConfigError(_bad_enum_message(enum, enum.full_name, str(number)), file=path, line=line,
                          column=column, field=field)
    return config


def _unknown_enum(message: Message, prefix: str = "") -> tuple[str, EnumDescriptor, int] | None:
    """The first enum field of ``message`` (nested ones included) holding a number its enum does not
    name: (field path as errors name it, the enum, the number); None when there is none."""

    def check(fd: FieldDescriptor, value: Any, field: str) -> tuple[str, EnumDescriptor, int] | None:
        if fd.message_type is not None:
            return _unknown_enum(value, field + ".")
        if fd.enum_type is not None and value not in fd.enum_type.values_by_number:
            return field, fd.enum_type, int(value)
        return None

    for fd, value in message.ListFields():
        name = prefix + fd.name
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            value_fd = fd.message_type.fields_by_name["value"]
            found = next((f for key in value if (f := check(value_fd, value[key], f"{name}[{key}]"))), None)
        elif _is_repeated(fd):
            found = next((f for i, item in enumerate(value) if (f := check(fd, item, f"{name}[{i}]"))), None)
        else:
            found = check(fd, value, name)
        if found is not None:
            return found
    return None


def _strip_pbtxt_prefix(message: str, text: str, line: int | None, column: int | None = None) -> str:
    """Drop ``"3:9 : "`` and the echoed source line protobuf puts in front of its message."""
    message = re.sub(r"^\d+:\d+ : ", "", message)
    if line is not None and message.startswith("'"):
        lines = text.split("\n")  # as protobuf's tokenizer counts lines
        if message.startswith("'': ") and text[_offset(lines, line, column or 1) :].strip() == "":
            # protobuf echoes the empty token past the last one: the text ended before the message did
            return "the file ends early: " + message[4:].removesuffix(" but found: ''")
        if 0 < line <= len(lines):
            for echoed in (lines[line - 1], lines[line - 1].strip()):
                if message.startswith(f"'{echoed}': "):
                    return message[len(echoed) + 4 :]
    return message


def _friendly_pbtxt_error(raw: str, fd: FieldDescriptor | None) -> str | None:
    """Rewrite protobuf's text-format messages; None for plain syntax errors."""
    if m := re.search(r'Message type "([\w.]+)" has no field named "([^"]*)"', raw):
        desc = _MESSAGES.get(m.group(1))
        return _unknown_field_message(desc, m.group(1), m.group(2), json_names=False)
    if m := re.search(r'Enum type "([\w.]+)" has no value (?:named|with number) (.*?)\.?$', raw):
        enum = _ENUMS.get(m.group(1))
        return _bad_enum_message(enum, m.group(1), m.group(2))
    if m := re.search(r'Message type "([\w.]+)" should not have multiple "(\w+)" fields', raw):
        return f"field '{m.group(2)}' is given more than once; allowed: once (it is not a repeated field)"
    if m := re.search(r"(?:Couldn't parse (?:unsigned |)(?:integer|number|float)|Value out of range): (.*)$", raw):
        return _bad_scalar_message(fd, m.group(1))
    if re.search(r'Expected "true" or "false"|Invalid value for boolean', raw):
        return "expected a boolean; allowed: true, false"
    return None


def _load_document(text: str, path: str, fmt: str) -> Any:
    if fmt == "json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"invalid JSON: {exc.msg}", file=path, line=exc.lineno, column=exc.colno) from exc
        except (ValueError, RecursionError) as exc:  # e.g. an integer of thousands of digits
            raise ConfigError(f"invalid JSON: {exc}", file=path) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "syntax error"
        raise ConfigError(
            f"invalid YAML: {problem}",
            file=path,
            line=mark.line + 1 if mark else None,
            column=mark.column + 1 if mark else None,
        ) from exc
    except Exception as exc:  # YAMLError without a mark, bad timestamps (ValueError), deep nesting
        raise ConfigError(f"invalid YAML: {exc}", file=path) from exc
    return {} if data is None else data


class _DocumentError(Exception):
    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


def _check_message(data: Any, desc: Descriptor, prefix: str, text: str, path: str, fmt: str) -> dict:
    """Check a YAML/JSON document against the message type with friendly errors, return it ready
    for ``ParseDict`` (map keys as strings)."""
    try:
        return _checked_message(data, desc, prefix)
    except _DocumentError as exc:
        line, column = _locate(text, fmt, exc.field)
        raise ConfigError(exc.message, file=path, line=line, column=column, field=exc.field or None) from None
    except RecursionError as exc:
        raise ConfigError("the document is nested too deeply", file=path) from exc


def _checked_message(data: Any, desc: Descriptor, prefix: str) -> dict:
    if not isinstance(data, dict):
        where = prefix.rstrip(".")
        raise _DocumentError(f"expected a mapping for {desc.name}, got {_kind(data)}", where)
    result: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key)
        fd = _field_by_any_name(desc, name)
        if fd is None:
            raise _DocumentError(_unknown_field_message(desc, desc.full_name, name, json_names=True), prefix + name)
        field = prefix + fd.name
        if value is None:  # ParseDict treats null as "not set"
            continue
        if _is_map(fd):
            if not isinstance(value, dict):
                raise _DocumentError(f"expected a mapping, got {_kind(value)}", field)
            key_fd = _message_type(fd).fields_by_name["key"]
            value_fd = _message_type(fd).fields_by_name["value"]
            entries: dict[str, Any] = {}
            for map_key, map_value in value.items():
                entry = f"{field}[{map_key}]"
                if key_fd.cpp_type in _INT_RANGES:
                    _checked_scalar(map_key, key_fd, entry)
                entries[str(map_key)] = _checked_single(map_value, value_fd, entry)
            result[fd.name] = entries
        elif _is_repeated(fd):
            if not isinstance(value, list):
                raise _DocumentError(f"expected a list, got {_kind(value)}", field)
            result[fd.name] = [_checked_single(v, fd, f"{field}[{i}]") for i, v in enumerate(value)]
        else:
            result[fd.name] = _checked_single(value, fd, field)
    return result


def _checked_single(value: Any, fd: FieldDescriptor, field: str) -> Any:
    if fd.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
        return _checked_message({} if value is None else value, _message_type(fd), field + ".")
    _checked_scalar(value, fd, field)
    return value


def _checked_scalar(value: Any, fd: FieldDescriptor, field: str) -> None:
    cpp = fd.cpp_type
    if cpp == FieldDescriptor.CPPTYPE_ENUM:
        enum = fd.enum_type
        if enum is None:
            raise TypeError(f"{fd.full_name} is an enum field without an enum type")
        if isinstance(value, str) and value in enum.values_by_name:
            return
        if isinstance(value, int) and not isinstance(value, bool) and value in enum.values_by_number:
            return
        raise _DocumentError(_bad_enum_message(enum, enum.full_name, str(value)), field)
    if cpp in _INT_RANGES:
        number: int | None = None
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif (isinstance(value, float) and value.is_integer()) or (
            isinstance(value, str) and re.fullmatch(r"-?\d{1,25}", value)
        ):
            number = int(value)
        low, high, _ = _INT_RANGES[cpp]
        if number is None or not low <= number <= high:
            raise _DocumentError(_bad_scalar_message(fd, _short(value)), field)
    elif cpp == FieldDescriptor.CPPTYPE_BOOL:
        if not isinstance(value, bool):
            raise _DocumentError(f"expected a boolean, got {_short(value)}; allowed: true, false", field)
    elif cpp == FieldDescriptor.CPPTYPE_STRING:
        if not isinstance(value, str):
            raise _DocumentError(f"expected a string, got {_kind(value)} {_short(value)}; quote it", field)
    elif cpp in (FieldDescriptor.CPPTYPE_FLOAT, FieldDescriptor.CPPTYPE_DOUBLE):
        finite = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not finite and value not in ("NaN", "Infinity", "-Infinity"):
            raise _DocumentError(f"expected a number, got {_short(value)}", field)


def _kind(value: Any) -> str:
    kinds = {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return kinds.get(type(value), type(value).__name__)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _unknown_field_message(desc: Descriptor | None, full_name: str, name: str, *, json_names: bool) -> str:
    type_name = desc.name if desc is not None else full_name.rsplit(".", 1)[-1]
    message = f"Message type '{type_name}' has no field '{name}'"
    if desc is None:
        return message
    names = [f.name for f in desc.fields]
    candidates = names + ([f.json_name for f in desc.fields] if json_names else [])
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    if close:
        return f"{message}; did you mean '{close[0]}'?"
    return f"{message}; allowed: {', '.join(names)}"


def _bad_enum_message(enum: EnumDescriptor | None, full_name: str, value: str) -> str:
    type_name = enum.name if enum is not None else full_name.rsplit(".", 1)[-1]
    message = f"'{value}' is not a valid {type_name} value"
    if enum is None:
        return message
    allowed = [v.name for v in enum.values if not v.name.endswith("_INVALID")]
    close = difflib.get_close_matches(value, allowed, n=1, cutoff=0.6)
    if close:
        message += f"; did you mean '{close[0]}'?"
    return f"{message} Allowed: {', '.join(allowed)}" if close else f"{message}; allowed: {', '.join(allowed)}"


def _bad_scalar_message(fd: FieldDescriptor | None, value: str) -> str:
    if fd is not None and fd.cpp_type in _INT_RANGES:
        low, high, type_name = _INT_RANGES[fd.cpp_type]
        return f"{value} is not a valid {type_name}; allowed: an integer from {low} to {high}"
    if fd is not None and fd.cpp_type in (FieldDescriptor.CPPTYPE_FLOAT, FieldDescriptor.CPPTYPE_DOUBLE):
        return f"{value} is not a valid number; allowed: a decimal number"
    return f"{value} is not a valid value for this field"


def _strip_protobuf_noise(message: str) -> str:
    message = message.replace("\n", " ")
    return re.sub(r"\s+", " ", message).strip() or "cannot parse the config"


def _walk_descriptors(desc: Descriptor) -> Iterator[Descriptor]:
    seen: set[str] = set()
    stack = [desc]
    while stack:
        current = stack.pop()
        if current.full_name in seen:
            continue
        seen.add(current.full_name)
        yield current
        stack.extend(f.message_type for f in current.fields if f.message_type is not None)


_MESSAGES: dict[str, Descriptor] = {d.full_name: d for d in _walk_descriptors(mc.ModelConfig.DESCRIPTOR)}
_ENUMS: dict[str, EnumDescriptor] = {
    f.enum_type.full_name: f.enum_type for d in _MESSAGES.values() for f in d.fields if f.enum_type is not None
}


def _is_repeated(fd: FieldDescriptor) -> bool:
    repeated = getattr(fd, "is_repeated", None)  # protobuf >= 5.29; ``label`` is deprecated there
    if repeated is None:
        return bool(getattr(fd, "label", None) == FieldDescriptor.LABEL_REPEATED)
    return bool(repeated)


def _message_type(fd: FieldDescriptor) -> Descriptor:
    """The message type of a message (or map) field."""
    desc = fd.message_type
    if desc is None:
        raise TypeError(f"{fd.full_name} is not a message field")
    return desc


def _is_map(fd: FieldDescriptor) -> bool:
    return fd.message_type is not None and fd.message_type.GetOptions().map_entry


def _field_by_any_name(desc: Descriptor, name: str) -> FieldDescriptor | None:
    fd = desc.fields_by_name.get(name)
    if fd is None:
        fd = next((f for f in desc.fields if f.json_name == name), None)
    return fd


# --- locating fields in the source text ----------------------------------------------------------

_PBTXT_TOKEN = re.compile(
    r"""(?P<nl>\n)|(?P<skip>[ \t\r\f\v]+|\#[^\n]*)
    |(?P<string>"(?:[^"\\\n]|\\.)*"?|'(?:[^'\\\n]|\\.)*'?)
    |(?P<word>[A-Za-z0-9_.+\-]+)|(?P<punct>[{}\[\]<>:,;])|(?P<other>.)""",
    re.VERBOSE,
)


@dataclasses.dataclass
class _Frame:
    desc: Descriptor | None
    prefix: str
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    list_of: tuple[str, FieldDescriptor | None, _Frame] | None = None


def _pbtxt_fields(text: str) -> list[tuple[int, int, str, FieldDescriptor | None]]:
    """(line, column, field path, descriptor) of every field name in a pbtxt document, in order.

    A forgiving scan (it never raises): used to name the field at a parse error and to find the
    line of a field that failed validation.
    """
    tokens: list[tuple[str, str, int, int]] = []
    line, line_start = 1, 0
    for m in _PBTXT_TOKEN.finditer(text):
        kind = m.lastgroup or "other"
        if kind == "nl":
            line, line_start = line + 1, m.end()
        elif kind in ("string", "word", "punct"):
            tokens.append((kind, m.group(), line, m.start() - line_start + 1))
    events: list[tuple[int, int, str, FieldDescriptor | None]] = []
    frames = [_Frame(mc.ModelConfig.DESCRIPTOR, "")]
    i = 0
    while i < len(tokens):
        kind, value, tok_line, tok_col = tokens[i]
        top = frames[-1]
        i += 1
        if top.list_of is not None:
            name, fd, parent = top.list_of
            if value in ("{", "<"):
                index = parent.counts.get(name, 0)
                parent.counts[name] = index + 1
                field = f"{parent.prefix}{name}[{index}]"
                events.append((tok_line, tok_col, field, fd))
                frames.append(_Frame(fd.message_type if fd is not None else None, field + "."))
            elif value in ("]", "}", ">"):
                frames.pop()
            continue
        if kind == "word":
            fd = top.desc.fields_by_name.get(value) if top.desc is not None else None
            field = top.prefix + value
            events.append((tok_line, tok_col, field, fd))
            if i < len(tokens) and tokens[i][1] == ":":
                i += 1
            following = tokens[i][1] if i < len(tokens) else ""
            if following in ("{", "<"):
                if fd is None or _is_repeated(fd):
                    index = top.counts.get(value, 0)
                    top.counts[value] = index + 1
                    field = f"{field}[{index}]"
                    events.append((tok_line, tok_col, field, fd))
                frames.append(_Frame(fd.message_type if fd is not None else None, field + "."))
                i += 1
            elif following == "[":
                frames.append(_Frame(None, top.prefix, list_of=(value, fd, top)))
                i += 1
            else:
                i += 1  # the value
                while i < len(tokens) and tokens[i][0] == "string":  # "a" "b" concatenates
                    i += 1
        elif value in ("}", ">") and len(frames) > 1:
            frames.pop()
    return events


def _pbtxt_field_at(text: str, line: int | None, column: int | None) -> tuple[str | None, FieldDescriptor | None]:
    """The field being parsed at ``line:column``: the last field name at or before it."""
    if line is None:
        return None, None
    try:
        events = _pbtxt_fields(text)
    except Exception:  # locating is best effort; the error itself is what matters
        return None, None
    found: tuple[str | None, FieldDescriptor | None] = (None, None)
    for ev_line, ev_col, field, fd in events:
        if (ev_line, ev_col) > (line, column or 0):
            break
        if not field.endswith("]"):  # the field, not its "[i]" occurrence at the same spot
            found = (field, fd)
    return found


def _document_fields(text: str) -> dict[str, tuple[int, int]]:
    """Field path -> (line, column) of its key in a YAML or JSON document (JSON is read as YAML)."""
    try:
        root = yaml.compose(text)
    except Exception:
        return {}
    positions: dict[str, tuple[int, int]] = {}

    def mark(node: yaml.Node) -> tuple[int, int]:
        return node.start_mark.line + 1, node.start_mark.column + 1

    def walk(node: yaml.Node, desc: Descriptor, prefix: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            return
        for key_node, value_node in node.value:
            name = str(key_node.value)
            fd = _field_by_any_name(desc, name)
            field = prefix + (fd.name if fd is not None else name)
            positions.setdefault(field, mark(key_node))
            if fd is None:
                continue
            if _is_map(fd) and isinstance(value_node, yaml.MappingNode):
                value_desc = _message_type(fd).fields_by_name["value"].message_type
                for map_key, map_value in value_node.value:
                    entry = f"{field}[{map_key.value}]"
                    positions.setdefault(entry, mark(map_key))
                    if value_desc is not None:
                        walk(map_value, value_desc, entry + ".")
            elif _is_repeated(fd) and isinstance(value_node, yaml.SequenceNode):
                for index, item in enumerate(value_node.value):
                    entry = f"{field}[{index}]"
                    positions.setdefault(entry, mark(item))
                    if fd.message_type is not None:
                        walk(item, fd.message_type, entry + ".")
            elif fd.message_type is not None:
                walk(value_node, fd.message_type, field + ".")

    if root is None:  # an empty document
        return positions
    try:
        walk(root, mc.ModelConfig.DESCRIPTOR, "")
    except Exception:
        return positions
    return positions


_MAP_KEY = re.compile(r"""key\s*:?\s*(?:"((?:[^"\\\n]|\\.)*)"|'((?:[^'\\\n]|\\.)*)'|(-?\d+)\b)""")


def _offset(lines: list[str], line: int, column: int) -> int:
    """Index into the text (split on newlines, as ``lines``) of a 1-based line and column."""
    return sum(len(text) + 1 for text in lines[: line - 1]) + column - 1


def _locate(text: str, fmt: str, field: str | None) -> tuple[int | None, int | None]:
    """Line and column of ``field`` (or of its nearest enclosing field) in the source text."""
    if not field:
        return None, None
    if fmt == "pbtxt":
        try:
            positions: dict[str, tuple[int, int]] = {}
            lines = text.split("\n")  # as protobuf's tokenizer counts lines
            for ev_line, ev_col, ev_field, _ in _pbtxt_fields(text):
                positions.setdefault(ev_field, (ev_line, ev_col))
                if ev_field.endswith("].key"):  # a map entry: also findable by its key, as JSON/YAML are
                    found = _MAP_KEY.match(text, _offset(lines, ev_line, ev_col))
                    entry = ev_field[: -len(".key")]
                    if found is not None:
                        quoted = found.group(1) if found.group(1) is not None else found.group(2)
                        key = found.group(3)
                        if quoted is not None:
                            key = text_encoding.CUnescape(quoted).decode(errors="replace")
                        # errors name map entries by key (an integer key replaces the entry's index);
                        # the last entry of a key is the one protobuf keeps
                        positions[entry[: entry.rfind("[")] + f"[{key}]"] = positions[entry]
        except Exception:
            return None, None
    else:
        positions = _document_fields(text)
    candidate = field
    while candidate:
        if candidate in positions:
            return positions[candidate]
        cut = max(candidate.rfind("."), candidate.rfind("["))
        candidate = candidate[:cut] if cut > 0 else ""
    return None, None


# --- finding and loading -------------------------------------------------------------------------


def find_config_file(model_dir: Path) -> Path | None:
    """The model's config file, or None when it has none; more than one is an error."""
    present = [model_dir / name for name in CONFIG_FILE_NAMES if (model_dir / name).is_file()]
    if len(present) > 1:
        names = ", ".join(p.name for p in present)
        raise ConfigError(
            f"more than one model configuration file: {names}; it is ambiguous which one is used. "
            f"Keep exactly one of {', '.join(CONFIG_FILE_NAMES)}",
            file=str(model_dir),
        )
    return present[0] if present else None


def _format_of(config_file: Path) -> str:
    return {".pbtxt": "pbtxt", ".yaml": "yaml", ".yml": "yaml", ".json": "json"}[config_file.suffix]


def local_step_models(config: mc.ModelConfig) -> list[str]:
    """The step models of ensemble ``config`` served by this repository (not remote), in step order."""
    remote = remote_steps(config)
    return list(dict.fromkeys(s.model_name for s in config.ensemble_scheduling.step if s.model_name not in remote))


def ensemble_steps_on_disk(model_dir: Path) -> list[str]:
    """The local step models the config file in ``model_dir`` names when it is an ensemble's; [] for
    any other model, and for a config that cannot be read or parsed (its own load says why). Blocking."""
    try:
        config_file = find_config_file(model_dir)
        if config_file is None:
            return []
        text = config_file.read_text(encoding="utf-8")
        config = parse_config(text, path=str(config_file), fmt=_format_of(config_file))
    except (SluiceError, OSError, UnicodeDecodeError):
        return []
    return local_step_models(config) if config.platform == ENSEMBLE else []


def ensemble_cycle(start: str, steps_of: Callable[[str], Sequence[str]]) -> list[str]:
    """A cycle of ensembles through ``start`` (``[start, ..., start]``), or [] when following the step
    models from ``start`` never comes back to it. ``steps_of(name)``: the local step models of
    ``name`` ([] for a model that is not an ensemble). Pure; cycles not through ``start`` are
    another ensemble's to report, and each name is expanded once."""
    path: list[str] = []
    done: set[str] = set()

    def visit(name: str) -> list[str]:
        path.append(name)
        for step in steps_of(name):
            if step == start:
                return [*path, start]
            if step not in done and step not in path and (found := visit(step)):
                return found
        path.pop()
        done.add(name)
        return []

    return visit(start)


def load_model_config(model_dir: Path, *, override: str | None = None) -> LoadedConfig:
    """Read, normalize and validate the configuration of the model in ``model_dir``.

    ``override`` is the JSON config of a repository load request; it is used instead of the file.
    Without a config file the model must be one Triton can auto-complete (see
    :data:`AUTO_COMPLETE_FILES`); its inputs and outputs come later from :func:`complete_io`.
    """
    model_dir = Path(model_dir)
    model_name = model_dir.name
    if override is not None:
        source, text, fmt = f"{model_dir} (config override of the load request)", override, "json"
        config = parse_config(text, path=source, fmt=fmt)
    else:
        config_file = find_config_file(model_dir)
        if config_file is None:
            source, text, fmt = f"{model_dir} (no config file; auto-completed)", "", "pbtxt"
            backend = _infer_backend(model_dir, AUTO_COMPLETE_FILES)
            if backend is None:
                raise ConfigError(
                    f"model '{model_name}' has no config file and cannot be auto-completed; allowed: "
                    f"one of {', '.join(CONFIG_FILE_NAMES)}, or a version directory (such as 1/) "
                    f"holding {' or '.join(AUTO_COMPLETE_FILES)}",
                    file=str(model_dir),
                )
            config = mc.ModelConfig(name=model_name, backend=backend)
        else:
            source, fmt = str(config_file), _format_of(config_file)
            try:
                text = config_file.read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(f"not valid UTF-8 text: {exc.reason}", file=source) from exc
            except OSError as exc:
                raise ConfigError(f"cannot read the file: {exc.strerror or exc}", file=source) from exc
            config = parse_config(text, path=source, fmt=fmt)
    try:
        _normalize(config, model_dir)
        warnings = validate(config, source=source)
        if config.platform == ENSEMBLE:
            _check_step_models_exist(config, model_dir.parent)
    except ConfigError as exc:
        if exc.line is not None:
            raise
        line, column = _locate(text, fmt, exc.field)
        raise ConfigError(exc.detail, file=exc.file or source, line=line, column=column, field=exc.field) from exc
    return LoadedConfig(config=config, source=source, warnings=warnings, text=text, fmt=fmt)


def _normalize(config: mc.ModelConfig, model_dir: Path) -> None:
    """Fill what Triton fills before validation: the name, backend and platform, the version policy,
    instance group names and counts."""
    problem = names.file_name_problem(config.default_model_filename) if config.default_model_filename else None
    if problem is not None:
        raise ConfigError(
            f"default_model_filename {names.shown(config.default_model_filename)!r}: {problem}; "
            "allowed: the name of a file in the version directory, such as model.onnx",
            field="default_model_filename",
        )
    if not config.name:
        config.name = model_dir.name
    elif config.name != model_dir.name:
        raise ConfigError(
            f"the config names the model '{config.name}' but its directory is '{model_dir.name}'; "
            f"allowed: '{model_dir.name}' or no name",
            field="name",
        )
    if not config.backend and not config.platform:
        inferred = _infer_backend(model_dir, _MODEL_FILES, config.default_model_filename)
        if inferred is None:
            raise ConfigError(
                f"the config names neither backend nor platform and no model file tells it; "
                f"allowed backends: {', '.join(KNOWN_BACKENDS)}",
                field="backend",
            )
        config.backend = inferred
    if config.version_policy.WhichOneof("policy_choice") is None:  # Triton shows its default
        config.version_policy.latest.num_versions = 1
    backend = backend_of(config)
    if backend == ENSEMBLE:
        return  # no backend, no instances: its steps run the requests
    config.backend = backend
    if not config.platform and backend in PLATFORM_BY_BACKEND:
        config.platform = PLATFORM_BY_BACKEND[backend]
    for index, group in enumerate(config.instance_group):
        if not group.name:  # Triton: <model>_<group index>, the prefix of its instances' names
            group.name = f"{config.name}_{index}"
        if group.count == 0:  # Triton: an unset count means one instance (per device)
            group.count = 1


def _infer_backend(model_dir: Path, files: dict[str, str], default_filename: str = "") -> str | None:
    """The backend of the model files in the version directories, None if none is recognized."""
    if default_filename:
        suffix = Path(default_filename).suffix
        by_suffix = {Path(name).suffix: backend for name, backend in files.items()}
        if suffix in by_suffix:
            return by_suffix[suffix]
    try:
        version_dirs = sorted(p for p in model_dir.iterdir() if p.is_dir() and names.version_number(p.name) is not None)
    except OSError:
        return None
    for version_dir in version_dirs:
        found = {backend for name, backend in files.items() if (version_dir / name).exists()}
        if len(found) == 1:
            return found.pop()
    return None


def backend_of(config: mc.ModelConfig) -> str:
    """The backend serving the model, from ``backend`` or else ``platform``; unknown ones are errors."""
    if config.backend:
        if config.backend not in KNOWN_BACKENDS:
            raise ConfigError(
                f"unknown backend '{config.backend}'; allowed: {', '.join(KNOWN_BACKENDS)}", field="backend"
            )
        handled = config.backend == "python" and config.platform == PYTHON_PLATFORM_HANDLER
        if config.platform and BACKEND_BY_PLATFORM.get(config.platform) != config.backend and not handled:
            expected = PLATFORM_BY_BACKEND.get(config.backend)
            if config.backend == "python":
                allowed = f"'{PYTHON_PLATFORM_HANDLER}' (Triton's PyTorch platform handler) or no platform"
            else:
                allowed = f"'{expected}' or no platform" if expected else "no platform"
            raise ConfigError(
                f"platform '{config.platform}' does not match backend '{config.backend}'; allowed: {allowed}",
                field="platform",
            )
        return config.backend
    if config.platform:
        if config.platform == ENSEMBLE:
            return ENSEMBLE
        if config.platform not in BACKEND_BY_PLATFORM:
            raise ConfigError(
                f"unknown platform '{config.platform}'; allowed: {', '.join(BACKEND_BY_PLATFORM)}, {ENSEMBLE} "
                f"(or backend: {', '.join(KNOWN_BACKENDS)})",
                field="platform",
            )
        return BACKEND_BY_PLATFORM[config.platform]
    raise ConfigError(
        f"neither backend nor platform is set; allowed backends: {', '.join(KNOWN_BACKENDS)}", field="backend"
    )


# --- validation ----------------------------------------------------------------------------------


def validate(config: mc.ModelConfig, *, source: str) -> list[str]:
    """Check the config's meaning; raise ConfigError for the first problem, return the warnings."""

    def fail(message: str, field: str) -> ConfigError:
        return ConfigError(message, file=source, field=field)

    try:
        backend = backend_of(config)
    except ConfigError as exc:
        raise fail(exc.detail, exc.field or "backend") from None
    max_batch = config.max_batch_size
    if max_batch < 0:
        raise fail(f"max_batch_size is {max_batch}; allowed: 0 (no batching) or more", "max_batch_size")
    for section, tensors in (("input", config.input), ("output", config.output)):
        seen: dict[str, int] = {}
        for index, tensor in enumerate(tensors):
            where = f"{section}[{index}]"
            if not tensor.name:
                raise fail(f"{section} has no name; allowed: a non-empty name", f"{where}.name")
            if tensor.name in seen:
                raise fail(
                    f"{section} name '{tensor.name}' is used twice (also by {section}[{seen[tensor.name]}]); "
                    f"allowed: unique names",
                    f"{where}.name",
                )
            seen[tensor.name] = index
            if tensor.data_type == mc.TYPE_INVALID:
                allowed = ", ".join(v.name for v in mc.DataType.DESCRIPTOR.values if v.number)
                raise fail(f"{section} '{tensor.name}' has no data_type; allowed: {allowed}", f"{where}.data_type")
            _check_dims(list(tensor.dims), f"{where}.dims", fail, allow_empty=False)
            if tensor.HasField("reshape"):
                shape = list(tensor.reshape.shape)
                _check_dims(shape, f"{where}.reshape.shape", fail, allow_empty=True)
                fixed = all(d > 0 for d in tensor.dims) and all(d > 0 for d in shape)
                if fixed and math.prod(tensor.dims) != math.prod(shape):
                    raise fail(
                        f"reshape {shape} has {math.prod(shape)} elements but dims {list(tensor.dims)} "
                        f"have {math.prod(tensor.dims)}; allowed: a shape with the same element count",
                        f"{where}.reshape",
                    )
    _check_version_policy(config, fail)
    if config.HasField("dynamic_batching"):
        _check_dynamic_batching(config, fail)
    if config.HasField("sequence_batching"):
        _check_sequence_batching(config, fail)
    for index, group in enumerate(config.instance_group):
        where = f"instance_group[{index}]"
        if not 0 <= group.count <= MAX_INSTANCES_PER_GROUP:
            raise fail(
                f"count is {group.count}; allowed: 1 to {MAX_INSTANCES_PER_GROUP} (0 means 1)", f"{where}.count"
            )
        for gpu in group.gpus:
            if gpu < 0:
                raise fail(f"GPU id {gpu} is negative; allowed: 0 or more", f"{where}.gpus")
        if group.gpus and group.kind not in (mc.ModelInstanceGroup.KIND_GPU, mc.ModelInstanceGroup.KIND_AUTO):
            kind = mc.ModelInstanceGroup.Kind.Name(group.kind)
            raise fail(f"gpus are listed for kind {kind}; allowed: gpus only with KIND_GPU", f"{where}.gpus")
    warnings: list[str] = []
    if backend == ENSEMBLE:
        warnings += _check_ensemble(config, fail)
    elif config.HasField("ensemble_scheduling"):
        raise fail(
            f"ensemble_scheduling is set but the model's platform is '{config.platform or config.backend}'; "
            f'allowed: ensemble_scheduling only with platform: "{ENSEMBLE}"',
            "ensemble_scheduling",
        )
    if config.optimization.cuda.graphs and backend != "pytorch":
        warnings.append(
            f"optimization.cuda.graphs: only the pytorch backend captures CUDA graphs; ignored for '{backend}'"
        )
    if config.optimization.HasField("graph") and backend != "onnxruntime":
        warnings.append(
            f"optimization.graph: only the onnxruntime backend applies graph optimization levels; ignored for "
            f"'{backend}'"
        )
    _collect_unimplemented(config, "", "", warnings)
    return warnings


def remote_steps(config: mc.ModelConfig) -> dict[str, str]:
    """Step model name -> ``host:port`` for the steps an ensemble calls over gRPC."""
    return {
        key[len(REMOTE_STEP_PREFIX) :]: value.string_value
        for key, value in config.parameters.items()
        if key.startswith(REMOTE_STEP_PREFIX)
    }


def _check_ensemble(config: mc.ModelConfig, fail: _Fail) -> list[str]:
    """Triton's ensemble rules: the steps form a DAG over tensor names from the ensemble inputs to
    every ensemble output (``dynamic_batching`` cannot be set with it: they share a oneof). Step
    models themselves are checked when the ensemble loads."""
    steps = config.ensemble_scheduling.step
    if not steps:
        raise fail(
            "an ensemble needs at least one step; allowed: ensemble_scheduling { step [ { model_name, "
            "model_version, input_map, output_map } ] }",
            "ensemble_scheduling.step",
        )
    for section in ("input", "output"):
        if not getattr(config, section):
            raise fail(f"an ensemble must list its {section}s (it has no model file to complete them from)", section)
    inputs = [t.name for t in config.input]
    # Every ensemble tensor has exactly one producer: the request (an ensemble input) or one step.
    producer: dict[str, int | None] = dict.fromkeys(inputs)
    for index, step in enumerate(steps):
        where = f"ensemble_scheduling.step[{index}]"
        if not step.model_name:
            raise fail("the step names no model; allowed: the name of a model to run", f"{where}.model_name")
        if step.model_name == config.name:
            raise fail(f"the ensemble '{config.name}' cannot be a step of itself", f"{where}.model_name")
        if step.model_version < -1:
            raise fail(
                f"model_version is {step.model_version}; allowed: -1 (the latest, also when unset) or a version",
                f"{where}.model_version",
            )
        for section in ("input_map", "output_map"):
            if not getattr(step, section):
                raise fail(
                    f"step '{step.model_name}' has no {section}; allowed: a map from the step model's "
                    f"{section.split('_')[0]} names to ensemble tensor names",
                    f"{where}.{section}",
                )
        for key, tensor in sorted(step.output_map.items()):
            if not tensor:
                raise fail(f"output '{key}' maps to an empty tensor name", f"{where}.output_map[{key}]")
            if tensor in producer:
                other = producer[tensor]
                by = "an ensemble input" if other is None else f"step[{other}] ({steps[other].model_name})"
                raise fail(
                    f"ensemble tensor '{tensor}' is already produced by {by}; allowed: one producer per tensor",
                    f"{where}.output_map[{key}]",
                )
            producer[tensor] = index
    for index, step in enumerate(steps):
        for key, tensor in sorted(step.input_map.items()):
            if tensor not in producer:
                known = ", ".join(f"'{name}'" for name in producer) or "none"
                raise fail(
                    f"ensemble tensor '{tensor}' (input '{key}' of step model '{step.model_name}') is produced "
                    f"by no ensemble input and no step output; allowed: {known}",
                    f"ensemble_scheduling.step[{index}].input_map[{key}]",
                )
    for index, output in enumerate(config.output):
        if producer.get(output.name) is None:
            raise fail(
                f"ensemble output '{output.name}' is produced by no step; allowed: map a step output to it "
                "in a step's output_map",
                f"output[{index}].name",
            )
    cycle = _step_cycle(steps, producer)
    if cycle:
        names = " -> ".join(f"step[{i}] ({steps[i].model_name})" for i in cycle)
        raise fail(f"the steps form a cycle: {names}; allowed: steps that form a DAG", "ensemble_scheduling.step")
    step_models = {step.model_name for step in steps}
    for model in sorted(remote_steps(config)):
        key = f"parameters[{REMOTE_STEP_PREFIX}{model}]"
        target = config.parameters[REMOTE_STEP_PREFIX + model].string_value
        if model not in step_models:
            raise fail(
                f"'{model}' is not a step model of this ensemble; allowed: {', '.join(sorted(step_models))}", key
            )
        host, _, port = target.rpartition(":")
        if not host or not (port.isascii() and port.isdigit()):
            raise fail(f"remote step target is {target!r}; allowed: 'host:port' of a gRPC endpoint", key)
    used = {tensor for step in steps for tensor in step.input_map.values()}
    return [
        f"input '{name}': no step reads this ensemble input; it is accepted and ignored"
        for name in inputs
        if name not in used
    ]


def _step_cycle(steps: Sequence[mc.ModelEnsembling.Step], producer: dict[str, int | None]) -> list[int]:
    """The steps of one cycle (first repeated at the end), or [] when the steps form a DAG."""
    after = [sorted({p for t in step.input_map.values() if (p := producer.get(t)) is not None}) for step in steps]
    state = [0] * len(steps)  # 0 unvisited, 1 on the path, 2 done
    path: list[int] = []

    def visit(node: int) -> list[int]:
        state[node] = 1
        path.append(node)
        for dep in after[node]:
            if state[dep] == 1:
                return [*path[path.index(dep) :], dep]
            if state[dep] == 0 and (found := visit(dep)):
                return found
        path.pop()
        state[node] = 2
        return []

    for start in range(len(steps)):
        if state[start] == 0 and (found := visit(start)):
            return found
    return []


def _check_step_models_exist(config: mc.ModelConfig, repository: Path) -> None:
    remote = remote_steps(config)
    for index, step in enumerate(config.ensemble_scheduling.step):
        if step.model_name in remote:
            continue
        problem = names.name_problem(step.model_name)
        if problem is not None:
            raise ConfigError(
                f"step model '{names.shown(step.model_name)}' is not a valid model name: {problem}; "
                f"allowed: {names.ALLOWED}",
                field=f"ensemble_scheduling.step[{index}].model_name",
            )
        if names.model_directory(repository, step.model_name) is not None and (repository / step.model_name).is_dir():
            continue
        raise ConfigError(
            f"step model '{step.model_name}' is not in the model repository; allowed: a model "
            f"of the repository, or a remote step named by parameter '{REMOTE_STEP_PREFIX}{step.model_name}'",
            field=f"ensemble_scheduling.step[{index}].model_name",
        )


def _check_dims(dims: list[int], field: str, fail: _Fail, *, allow_empty: bool) -> None:
    if not dims and not allow_empty:
        raise fail(
            "dims is empty; allowed: at least one dim (for a scalar: dims: [ 1 ] with reshape: { shape: [ ] })",
            field,
        )
    for dim in dims:
        if dim == 0 or dim < -1:
            raise fail(f"dims {dims} contain {dim}; allowed: -1 (any size) or 1 or more", field)
    if math.prod(d for d in dims if d > 0) > _INT64_MAX:
        raise fail(f"dims {dims} have more elements than an int64 can count; allowed: a smaller shape", field)


def _check_version_policy(config: mc.ModelConfig, fail: _Fail) -> None:
    policy = config.version_policy
    kind = policy.WhichOneof("policy_choice")
    if kind == "latest" and policy.latest.num_versions < 1:
        raise fail(
            f"num_versions is {policy.latest.num_versions}; allowed: 1 or more",
            "version_policy.latest.num_versions",
        )
    if kind == "specific":
        negative = [v for v in policy.specific.versions if v < 0]
        if negative:
            raise fail(
                f"versions {negative} are negative; allowed: version numbers 0 or more",
                "version_policy.specific.versions",
            )


def _check_dynamic_batching(config: mc.ModelConfig, fail: _Fail) -> None:
    batching = config.dynamic_batching
    max_batch = config.max_batch_size
    if max_batch <= 0:
        raise fail(
            "dynamic_batching needs max_batch_size > 0 (it is 0: the model does not batch); "
            "allowed: set max_batch_size, or remove dynamic_batching",
            "dynamic_batching",
        )
    for size in batching.preferred_batch_size:
        if not 1 <= size <= max_batch:
            raise fail(
                f"preferred batch size {size} is out of range; allowed: 1 to max_batch_size ({max_batch})",
                "dynamic_batching.preferred_batch_size",
            )
    levels = batching.priority_levels
    if levels > MAX_PRIORITY_LEVELS:
        raise fail(
            f"priority_levels is {levels}; allowed: 0 (none) to {MAX_PRIORITY_LEVELS}",
            "dynamic_batching.priority_levels",
        )
    level_range = f"1 to priority_levels ({levels})" if levels else "none while priority_levels is 0"
    if levels and not 1 <= batching.default_priority_level <= levels:
        raise fail(
            f"default_priority_level is {batching.default_priority_level}; allowed: {level_range}",
            "dynamic_batching.default_priority_level",
        )
    for level in sorted(batching.priority_queue_policy):
        if not 1 <= level <= levels:
            raise fail(
                f"priority level {level} is out of range; allowed: {level_range}",
                f"dynamic_batching.priority_queue_policy[{level}]",
            )


MAX_PRIORITY_LEVELS = 1024
"""Each level is a queue the scheduler keeps (built at load); a value near 2^64 would stall the loader."""
MAX_INSTANCES_PER_GROUP = 256
"""Instances of one instance_group (per device): each is a thread and a session of the model."""


# Control kinds -> the false/true fields each may use (CORRID takes data_type instead).
_BOOLEAN_CONTROL_FIELDS = ("int32_false_true", "fp32_false_true", "bool_false_true")
CORRID_TYPES: tuple[str, ...] = ("TYPE_UINT64", "TYPE_INT64", "TYPE_UINT32", "TYPE_INT32", "TYPE_STRING")


def sequence_tensor_names(config: mc.ModelConfig) -> set[str]:
    """The model tensors the sequence batcher feeds or takes itself (control inputs, state inputs and
    outputs): never part of the inputs and outputs clients see, so auto-complete leaves them out."""
    if not config.HasField("sequence_batching"):
        return set()
    batching = config.sequence_batching
    names = {control.name for control in batching.control_input}
    listed = {output.name for output in config.output}
    for state in batching.state:
        names.add(state.input_name)
        if state.output_name not in listed:
            names.add(state.output_name)
    return names


def _check_sequence_batching(config: mc.ModelConfig, fail: _Fail) -> None:
    """Triton's rules for ``sequence_batching`` (model_config.proto ModelSequenceBatching)."""
    batching = config.sequence_batching
    max_batch = config.max_batch_size
    if batching.iterative_sequence:
        raise fail(
            "iterative_sequence is not supported by Sluice; allowed: the Direct or Oldest strategy "
            "(remove iterative_sequence)",
            "sequence_batching.iterative_sequence",
        )
    if config.response_cache.enable:
        raise fail(
            "response_cache is enabled on a sequence model: a cached answer would skip the sequence's state "
            "and order; allowed: response_cache only without sequence_batching",
            "response_cache.enable",
        )
    if batching.HasField("oldest"):
        oldest = batching.oldest
        if oldest.max_candidate_sequences < 0:
            raise fail(
                f"max_candidate_sequences is {oldest.max_candidate_sequences}; allowed: 1 or more (0 means "
                "max_batch_size)",
                "sequence_batching.oldest.max_candidate_sequences",
            )
        for size in oldest.preferred_batch_size:
            if not 1 <= size <= max(max_batch, 1):
                raise fail(
                    f"preferred batch size {size} is out of range; allowed: 1 to max_batch_size ({max_batch})",
                    "sequence_batching.oldest.preferred_batch_size",
                )
    io_names = {t.name for t in config.input} | {t.name for t in config.output}
    seen_kinds: dict[int, str] = {}
    seen_names: set[str] = set()
    kinds = mc.ModelSequenceBatching.Control.Kind
    for index, control_input in enumerate(batching.control_input):
        where = f"sequence_batching.control_input[{index}]"
        name = control_input.name
        if not name:
            raise fail("the control input has no name; allowed: the name of a model input", f"{where}.name")
        if name in seen_names or name in io_names:
            also = "another control input" if name in seen_names else "an input or output of the config"
            raise fail(
                f"control input '{name}' is also {also}; allowed: a model input fed by the sequence batcher "
                "alone (not listed under input)",
                f"{where}.name",
            )
        seen_names.add(name)
        if len(control_input.control) != 1:
            raise fail(
                f"control input '{name}' has {len(control_input.control)} controls; allowed: exactly one",
                f"{where}.control",
            )
        control = control_input.control[0]
        kind = kinds.Name(control.kind)
        if control.kind in seen_kinds:
            raise fail(
                f"{kind} is given twice (also by control input '{seen_kinds[control.kind]}'); allowed: each kind once",
                f"{where}.control[0].kind",
            )
        seen_kinds[control.kind] = name
        set_fields = [f for f in _BOOLEAN_CONTROL_FIELDS if len(getattr(control, f))]
        if control.kind == mc.ModelSequenceBatching.Control.CONTROL_SEQUENCE_CORRID:
            type_name = mc.DataType.Name(control.data_type)
            if type_name not in CORRID_TYPES or set_fields:
                raise fail(
                    f"{kind} control '{name}' has data_type {type_name}"
                    + (f" and {set_fields[0]}" if set_fields else "")
                    + f"; allowed: data_type one of {', '.join(CORRID_TYPES)} and no false/true values",
                    f"{where}.control[0].data_type",
                )
            continue
        if len(set_fields) != 1 or len(getattr(control, set_fields[0])) != 2:
            raise fail(
                f"{kind} control '{name}' must give its false and true values in exactly one of "
                f"{', '.join(_BOOLEAN_CONTROL_FIELDS)}, as two values [false, true]",
                f"{where}.control[0]",
            )
        if control.data_type != mc.TYPE_INVALID:
            raise fail(
                f"{kind} control '{name}' sets data_type; allowed: data_type only for CONTROL_SEQUENCE_CORRID "
                f"(the type follows {set_fields[0]})",
                f"{where}.control[0].data_type",
            )
    state_inputs: set[str] = set()
    state_outputs: set[str] = set()
    for index, state in enumerate(batching.state):
        where = f"sequence_batching.state[{index}]"
        # The state output may be listed under output (Triton: clients may then ask for it, to debug).
        for field, taken in (("input_name", io_names), ("output_name", {t.name for t in config.input})):
            value = getattr(state, field)
            if not value:
                raise fail(f"the state has no {field}; allowed: the name of a model tensor", f"{where}.{field}")
            if value in taken or value in seen_names:
                raise fail(
                    f"state tensor '{value}' is also an input or control input of the config; allowed: a "
                    "model tensor the server alone feeds (input_name) or takes (output_name)",
                    f"{where}.{field}",
                )
        for value, seen, field in ((state.input_name, state_inputs, "input_name"),
                                   (state.output_name, state_outputs, "output_name")):  # fmt: skip
            if value in seen:
                raise fail(f"state {field} '{value}' is used twice; allowed: one state per name", f"{where}.{field}")
            seen.add(value)
        if state.data_type == mc.TYPE_INVALID:
            allowed = ", ".join(v.name for v in mc.DataType.DESCRIPTOR.values if v.number)
            raise fail(f"state '{state.input_name}' has no data_type; allowed: {allowed}", f"{where}.data_type")
        _check_dims(list(state.dims), f"{where}.dims", fail, allow_empty=False)
        if len(state.initial_state) > 1:
            raise fail(
                f"state '{state.input_name}' has {len(state.initial_state)} initial_state entries; "
                "allowed: at most one",
                f"{where}.initial_state",
            )
        if not state.initial_state:
            continue  # zeros, variable dims as 1 (Triton)
        initial = state.initial_state[0]
        iwhere = f"{where}.initial_state[0]"
        if initial.data_type != state.data_type:
            raise fail(
                f"initial_state data_type {mc.DataType.Name(initial.data_type)} does not match the state's "
                f"{mc.DataType.Name(state.data_type)}; allowed: {mc.DataType.Name(state.data_type)}",
                f"{iwhere}.data_type",
            )
        if not initial.name:
            raise fail("initial_state has no name; allowed: a non-empty name", f"{iwhere}.name")
        dims, wanted = list(initial.dims), list(state.dims)
        if len(dims) != len(wanted) or any(d < 1 or (w != -1 and d != w) for d, w in zip(dims, wanted, strict=False)):
            raise fail(
                f"initial_state dims {dims} do not match the state dims {wanted}; allowed: the same rank, fixed "
                "dims equal to the state's where it fixes them",
                f"{iwhere}.dims",
            )
        which = initial.WhichOneof("state_data")
        if which is None:
            raise fail("initial_state gives no data; allowed: zero_data: true or data_file", iwhere)
        if which == "data_file":
            problem = names.file_name_problem(initial.data_file)
            if problem is not None:
                raise fail(
                    f"data_file {names.shown(initial.data_file)!r}: {problem}; allowed: the name of a file in the "
                    "model's initial_state/ directory",
                    f"{iwhere}.data_file",
                )


def _collect_unimplemented(message: Message, pattern_prefix: str, path_prefix: str, warnings: list[str]) -> None:
    for fd, value in message.ListFields():
        pattern, path = pattern_prefix + fd.name, path_prefix + fd.name
        if pattern in UNIMPLEMENTED_FIELDS:
            if pattern in _HARMLESS_WHEN_EMPTY and not value.ListFields():
                continue
            warnings.append(f"{path}: {UNIMPLEMENTED_FIELDS[pattern]}")
            continue
        if pattern not in _IMPLEMENTED_FIELDS:
            warnings.append(f"{path}: not implemented yet; ignored")
            continue
        if fd.message_type is None or _is_map(fd):
            continue
        if _is_repeated(fd):
            if any(p.startswith(pattern + "[].") for p in _IMPLEMENTED_FIELDS):
                for index, item in enumerate(value):
                    _collect_unimplemented(item, pattern + "[].", f"{path}[{index}].", warnings)
        elif any(p.startswith(pattern + ".") for p in (*_IMPLEMENTED_FIELDS, *UNIMPLEMENTED_FIELDS)):
            _collect_unimplemented(value, pattern + ".", path + ".", warnings)


# --- auto-complete -------------------------------------------------------------------------------


def complete_io(
    config: mc.ModelConfig,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    *,
    source: str | None = None,
) -> list[str]:
    """Complete ``config`` from the tensors the model file declares (Triton's auto-complete); return notes.

    Like Triton's ONNX backend: when the config lacks inputs or outputs, every model tensor has a
    dynamic first dim and ``max_batch_size`` is 0, it becomes :data:`DEFAULT_MAX_BATCH_SIZE` and
    ``dynamic_batching`` is turned on (an explicit ``max_batch_size: 0`` cannot be told from an
    unset one in proto3; list the inputs and outputs to keep 0). Tensors missing from the config are
    added; tensors in both must agree. ``source`` names the config in errors.
    """
    where = source or f"model '{config.name}'"
    notes: list[str] = []
    fed_by_server = sequence_tensor_names(config)
    if fed_by_server:
        inputs = [spec for spec in inputs if spec.name not in fed_by_server]
        outputs = [spec for spec in outputs if spec.name not in fed_by_server]
    model_inputs = {spec.name: spec for spec in inputs}
    model_outputs = {spec.name: spec for spec in outputs}
    for section, entries, declared in (
        ("input", config.input, model_inputs),
        ("output", config.output, model_outputs),
    ):
        for index, entry in enumerate(entries):
            if entry.name not in declared:
                names = ", ".join(f"'{n}'" for n in declared) or "none"
                raise ConfigError(
                    f"{section} '{entry.name}' is not an {section} of the model; the model's {section}s: {names}",
                    file=where,
                    field=f"{section}[{index}].name",
                )
    if not config.input or not config.output:
        _complete_max_batch_size(config, [*inputs, *outputs], where, notes)
    max_batch = config.max_batch_size
    for section, entries, specs in (("input", config.input, inputs), ("output", config.output, outputs)):
        by_name = {entry.name: index for index, entry in enumerate(entries)}
        for spec in specs:
            if spec.name in by_name:
                index = by_name[spec.name]
                _check_against_model(section, index, entries[index], spec, max_batch, where)
                continue
            entry = entries.add(name=spec.name, data_type=_config_type(spec, section, where))
            dims = _batchless_shape(spec, section, max_batch, where)
            if not dims:  # the API needs a non-empty shape; the model gets a scalar per item
                dims = [1]
                if max_batch > 0:
                    entry.reshape.SetInParent()
            entry.dims.extend(dims)
            notes.append(
                f"{section} '{spec.name}' added from the model: "
                f"{mc.DataType.Name(entry.data_type)} dims {list(entry.dims)}"
            )
    return notes


def _complete_max_batch_size(config: mc.ModelConfig, specs: list[TensorSpec], where: str, notes: list[str]) -> None:
    not_batching = next((s for s in specs if not s.shape or s.shape[0] != -1), None)
    if not_batching is None and specs:
        if config.max_batch_size == 0:
            config.max_batch_size = DEFAULT_MAX_BATCH_SIZE
            notes.append(
                f"max_batch_size set to {DEFAULT_MAX_BATCH_SIZE}: every model input and output has a "
                f"dynamic first dim (set max_batch_size to choose another limit)"
            )
        if (
            config.max_batch_size > 1
            and not config.HasField("dynamic_batching")
            and not config.HasField("sequence_batching")
        ):
            config.dynamic_batching.SetInParent()
            notes.append("dynamic_batching enabled: the model batches and no scheduler is configured")
    elif not_batching is not None and config.max_batch_size != 0:
        raise ConfigError(
            f"max_batch_size is {config.max_batch_size} but the model cannot batch: '{not_batching.name}' "
            f"has shape {list(not_batching.shape)}, whose first dim is not dynamic; allowed: max_batch_size: 0",
            file=where,
            field="max_batch_size",
        )


def _config_type(spec: TensorSpec, section: str, where: str) -> int:
    name = CONFIG_TYPE_BY_DATATYPE.get(spec.datatype)
    if name is None:
        raise ConfigError(
            f"the model's {section} '{spec.name}' has datatype {spec.datatype}, which Sluice cannot serve; "
            f"allowed: {', '.join(CONFIG_TYPE_BY_DATATYPE)}",
            file=where,
        )
    return mc.DataType.Value(name)


def _batchless_shape(spec: TensorSpec, section: str, max_batch: int, where: str) -> list[int]:
    shape = list(spec.shape)
    if max_batch <= 0:
        return shape
    if not shape or shape[0] != -1:
        raise ConfigError(
            f"max_batch_size is {max_batch} but the model's {section} '{spec.name}' has shape {shape}, "
            f"whose first dim is not dynamic; allowed: max_batch_size: 0 for this model",
            file=where,
            field="max_batch_size",
        )
    return shape[1:]


def _check_against_model(
    section: str, index: int, entry: mc.ModelInput | mc.ModelOutput, spec: TensorSpec, max_batch: int, where: str
) -> None:
    field = f"{section}[{index}]"
    expected = _config_type(spec, section, where)
    if entry.data_type != expected:
        raise ConfigError(
            f"{section} '{entry.name}' has data_type {mc.DataType.Name(entry.data_type)} in the config but "
            f"the model declares {mc.DataType.Name(expected)} ({spec.datatype})",
            file=where,
            field=f"{field}.data_type",
        )
    if not spec.rank_known:
        return  # the file declares no shape (or a scalar, ORT cannot tell): the config's dims stand
    model_shape = _batchless_shape(spec, section, max_batch, where)
    config_shape = list(entry.reshape.shape) if entry.HasField("reshape") else list(entry.dims)
    shown = f"dims {list(entry.dims)}" + (f" (reshape {config_shape})" if entry.HasField("reshape") else "")
    batch = " after the batch dim" if max_batch > 0 else ""
    if max_batch <= 0 and not model_shape and config_shape == [1]:
        return  # Triton's convention for a scalar of a non-batching model
    compatible = len(model_shape) == len(config_shape) and all(
        m == -1 or m == c for m, c in zip(model_shape, config_shape, strict=True)
    )
    if not compatible:
        raise ConfigError(
            f"{section} '{entry.name}' has {shown} in the config but the model declares shape "
            f"{list(spec.shape)} ({model_shape}{batch}); allowed: the model's rank, each dim equal to the "
            f"model's or any where the model's is -1",
            file=where,
            field=f"{field}.reshape" if entry.HasField("reshape") else f"{field}.dims",
        )


# --- versions and JSON ---------------------------------------------------------------------------


def missing_versions(config: mc.ModelConfig, available: Sequence[int]) -> list[int]:
    """Versions a ``specific`` policy names that have no directory (Triton logs each and serves the rest)."""
    policy = config.version_policy
    if policy.WhichOneof("policy_choice") != "specific":
        return []
    return sorted(set(policy.specific.versions) - set(available))


def select_versions(config: mc.ModelConfig, available: Sequence[int], *, source: str | None = None) -> list[int]:
    """The versions to serve out of ``available`` under the config's version policy, ascending. A
    ``specific`` policy serves the versions it names that are present and fails only when none is, as
    Triton does (:func:`missing_versions` says which are absent)."""
    versions = sorted(set(available))
    if not versions:
        return []
    policy = config.version_policy
    kind = policy.WhichOneof("policy_choice")
    if kind == "all":
        return versions
    if kind == "specific":
        wanted = sorted(set(policy.specific.versions))
        present = [v for v in wanted if v in versions]
        if not present:  # as Triton: at least one version must be available under the policy
            raise ConfigError(
                f"none of versions {wanted} is in the repository; available versions: {versions}",
                file=source or f"model '{config.name}'",
                field="version_policy.specific.versions",
            )
        return present  # the missing ones are warned about (missing_versions), as Triton logs them
    count = policy.latest.num_versions if kind == "latest" else 1
    return versions[-max(count, 1) :]
