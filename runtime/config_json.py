"""Triton's JSON form of a model config: what ``/v2/models/<m>/config`` answers and what a Python
model's ``initialize`` receives as ``args["model_config"]``.

Like Triton: proto field names, fields at their defaults included, 64-bit integers as JSON numbers
(protobuf's JSON mapping writes them as strings).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from tritonclient.grpc import model_config_pb2 as mc

_WIDE = (FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64)


def config_to_json(config: mc.ModelConfig) -> dict[str, Any]:
    """Triton's JSON form of ``config`` (see the module's docstring)."""
    try:
        data = json_format.MessageToDict(
            config, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
    except TypeError:  # protobuf < 5.26 names the option differently
        legacy: Any = json_format.MessageToDict  # typed for the installed protobuf, which lacks the old name
        data = legacy(config, preserving_proto_field_name=True, including_default_value_fields=True)
    return _int64_as_numbers(data, mc.ModelConfig.DESCRIPTOR)


def _int64_as_numbers(data: dict[str, Any], desc: Descriptor) -> dict[str, Any]:
    for name, value in data.items():
        fd = desc.fields_by_name.get(name)
        if fd is None:
            continue
        entry = fd.message_type
        if entry is not None and entry.GetOptions().map_entry:
            value_fd = entry.fields_by_name["value"]
            for key, item in value.items():
                value[key] = _convert_one(item, value_fd)
        elif isinstance(value, list):
            data[name] = [_convert_one(item, fd) for item in value]
        else:
            data[name] = _convert_one(value, fd)
    return data


def _convert_one(value: Any, fd: FieldDescriptor) -> Any:
    if fd.message_type is not None and isinstance(value, dict):
        return _int64_as_numbers(value, fd.message_type)
    if fd.cpp_type in _WIDE and isinstance(value, str):
        return int(value)
    return value
