"""gRPC's standard health checking protocol (``grpc.health.v1.Health/Check``), which Kubernetes'
``grpc`` probes, ``grpc_health_probe``, Envoy and cloud load balancers call.

The two messages are built here from a descriptor (protobuf, no generated module and no extra
package); their wire form is that of gRPC's ``health.proto``. What a service name means:

* ``""`` (the server as a whole, the probes' default) and ``inference.GRPCInferenceService``:
  SERVING while the server is ready, as ``/v2/health/ready`` and ``ServerReady`` answer (NOT_SERVING
  while loading, draining or after a lost GPU).
* a model's name: SERVING while the model has a ready version, NOT_SERVING while it is in the
  repository without one; a name the repository does not have is the status NOT_FOUND, as the
  protocol asks for an unknown service.

``Watch`` is not served (UNIMPLEMENTED): Kubernetes and ``grpc_health_probe`` call ``Check`` only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

HEALTH_SERVICE = "grpc.health.v1.Health"
UNKNOWN, SERVING, NOT_SERVING, SERVICE_UNKNOWN = 0, 1, 2, 3


def _messages() -> tuple[Any, Any]:
    proto = descriptor_pb2.FileDescriptorProto(name="sluice/grpc_health_v1.proto", package="grpc.health.v1")
    proto.syntax = "proto3"
    request = proto.message_type.add(name="HealthCheckRequest")
    request.field.add(
        name="service", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
        label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
    )  # fmt: skip
    response = proto.message_type.add(name="HealthCheckResponse")
    status = response.enum_type.add(name="ServingStatus")
    for name, number in (("UNKNOWN", 0), ("SERVING", 1), ("NOT_SERVING", 2), ("SERVICE_UNKNOWN", 3)):
        status.value.add(name=name, number=number)
    response.field.add(
        name="status", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_ENUM,
        type_name=".grpc.health.v1.HealthCheckResponse.ServingStatus",
        label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
    )  # fmt: skip
    pool = descriptor_pool.DescriptorPool()  # its own pool: no clash with grpcio-health-checking's
    pool.Add(proto)
    find = pool.FindMessageTypeByName
    return (
        message_factory.GetMessageClass(find("grpc.health.v1.HealthCheckRequest")),
        message_factory.GetMessageClass(find("grpc.health.v1.HealthCheckResponse")),
    )


HealthCheckRequest, HealthCheckResponse = _messages()


def serving_status(
    service: str,
    inference_service: str,
    server_ready: Callable[[], bool],
    model_ready: Callable[[str], bool],
    model_known: Callable[[str], bool],
) -> int | None:
    """The status ``Check`` answers for ``service``; None for a service (model) this server does not have."""
    if service in ("", inference_service):
        return SERVING if server_ready() else NOT_SERVING
    if model_ready(service):
        return SERVING
    return NOT_SERVING if model_known(service) else None
