"""The gRPC status of each runtime error (runtime/protocol/grpc_status.py), and the layering rule
behind it: ``runtime/errors.py`` is the bottom layer and does not import grpcio."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from sluice.runtime import errors
from sluice.runtime.protocol.grpc_status import grpc_code

S = grpc.StatusCode


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (errors.SluiceError, S.INTERNAL),
        (errors.InvalidArgument, S.INVALID_ARGUMENT),
        (errors.PayloadTooLarge, S.RESOURCE_EXHAUSTED),
        (errors.Unsupported, S.UNIMPLEMENTED),
        (errors.NotFound, S.NOT_FOUND),
        (errors.Unavailable, S.UNAVAILABLE),
        (errors.QueueFull, S.UNAVAILABLE),
        (errors.QueueTimeout, S.UNAVAILABLE),
        (errors.Cancelled, S.CANCELLED),
        (errors.ModelError, S.INTERNAL),
        (errors.ConfigError, S.INVALID_ARGUMENT),
        (errors.Internal, S.INTERNAL),
    ],
)
def test_each_error_class_has_its_code(error, code):
    assert grpc_code(error("x")) == code


def test_a_new_subclass_maps_through_its_base():
    class TooManyThings(errors.PayloadTooLarge):
        pass

    class Gone(errors.NotFound, errors.Unavailable):
        pass

    assert grpc_code(TooManyThings("x")) == S.RESOURCE_EXHAUSTED
    assert grpc_code(Gone("x")) == S.NOT_FOUND  # the nearest base in the MRO
    assert grpc_code(errors.unknown_model("m")) == S.NOT_FOUND


def test_errors_module_does_not_import_grpc():
    code = "import sys, sluice.runtime.errors; print('grpc' in sys.modules)"
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert not hasattr(errors.SluiceError, "grpc_code")
