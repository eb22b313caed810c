"""The protocol-neutral gRPC service (runtime/protocol/grpc_service.py): one method table behind both
front ends, so each method is answered the same way by ``h2`` and ``grpcio``."""

from __future__ import annotations

import grpc
import pytest
from tritonclient.grpc import service_pb2 as pb

from sluice.runtime import tracing
from sluice.runtime.protocol import grpc_health
from sluice.runtime.protocol.grpc_service import HEALTH_CHECK, INFER, STREAM, UNARY, UNIMPLEMENTED, Service
from sluice.runtime.settings import Limits

from .conftest import write_model  # type: ignore[import-not-found]

SERVICE = "/inference.GRPCInferenceService/"
SERVED = {
    "ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer", "ModelStreamInfer",
    "ModelConfig", "ModelStatistics", "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload",
    "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
    "CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister",  # without a GPU: why not
    "TraceSetting",
    "LogSettings",
}  # fmt: skip
ALL = [m.name for m in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods]


class NoDataPlane:
    """The table needs no data plane until a call comes."""

    tracing = tracing.disabled()

    def infer_nowait(self, request, done):
        raise AssertionError("not called")


def test_the_table_covers_every_method_of_the_proto():
    table = Service(NoDataPlane(), Limits()).methods  # type: ignore[arg-type]
    kinds = {name: method.kind for name, method in table.items()}
    assert set(kinds) == {*ALL, HEALTH_CHECK}
    assert table[HEALTH_CHECK].path == "/grpc.health.v1.Health/Check" and kinds[HEALTH_CHECK] == UNARY
    assert {n for n, k in kinds.items() if k != UNIMPLEMENTED} == {*SERVED, HEALTH_CHECK}
    assert kinds["ModelInfer"] == INFER and kinds["ModelStreamInfer"] == STREAM and kinds["ServerLive"] == UNARY


@pytest.mark.parametrize("front_end", ["h2", "grpcio"])
def test_both_front_ends_serve_the_table(serve, example_repo, front_end):
    server = serve(example_repo, grpc_server=front_end)
    with grpc.insecure_channel(server.grpc) as chan:
        for name in sorted(set(ALL) - SERVED):
            with pytest.raises(grpc.RpcError) as info:
                chan.unary_unary(SERVICE + name)(b"", timeout=10)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED, name
            assert f"{name} is not implemented by Sluice" in info.value.details()
        live = pb.ServerLiveResponse.FromString(chan.unary_unary(SERVICE + "ServerLive")(b"", timeout=10))
        assert live.live
        request = pb.ModelMetadataRequest(name="nope").SerializeToString()
        with pytest.raises(grpc.RpcError) as info:
            chan.unary_unary(SERVICE + "ModelMetadata")(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in info.value.details()


# -- gRPC's standard health check (grpc.health.v1.Health/Check) ---------------------------------------

BROKEN_CONFIG = 'name: "broken"\nbackend: "onnxruntime"\n'  # no model file: the load fails


def health(channel: grpc.Channel, service: str) -> int:
    check = channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=grpc_health.HealthCheckRequest.SerializeToString,
        response_deserializer=grpc_health.HealthCheckResponse.FromString,
    )
    return check(grpc_health.HealthCheckRequest(service=service), timeout=10).status


@pytest.mark.parametrize("front_end", ["h2", "grpcio", "protocol-workers"])
def test_standard_health_check_answers_for_the_server_and_each_model(serve, example_repo, front_end):
    """What Kubernetes' ``grpc`` probes and grpc_health_probe call: the server (``""``) is SERVING when
    ready, a model when it has a ready version; an unknown name is NOT_FOUND; Watch is not served."""
    overrides = {"protocol_workers": 2} if front_end == "protocol-workers" else {"grpc_server": front_end}
    server = serve(example_repo, **overrides)
    with grpc.insecure_channel(server.grpc) as channel:
        for service in ("", "inference.GRPCInferenceService", "add_sub", "mlp"):
            assert health(channel, service) == grpc_health.SERVING, service
        with pytest.raises(grpc.RpcError) as info:
            health(channel, "nope")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert "unknown service 'nope'" in info.value.details() and "the name of a model" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_stream("/grpc.health.v1.Health/Watch")(b"", timeout=10).next()
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("front_end", ["h2", "grpcio"])
def test_standard_health_check_says_not_serving_while_the_server_is_not_ready(serve, example_repo, front_end):
    write_model(example_repo, "broken", BROKEN_CONFIG, {})
    server = serve(example_repo, grpc_server=front_end)  # strict readiness: a model failed, not ready
    with grpc.insecure_channel(server.grpc) as channel:
        assert health(channel, "") == grpc_health.NOT_SERVING
        assert health(channel, "broken") == grpc_health.NOT_SERVING  # in the repository, no ready version
        assert health(channel, "add_sub") == grpc_health.SERVING


def test_serving_status_decides_from_readiness_alone():
    def status(service, ready=True, models=("m",), known=("m", "failed")):
        return grpc_health.serving_status(
            service, "inference.GRPCInferenceService", lambda: ready, lambda n: n in models, lambda n: n in known
        )

    assert status("") == status("inference.GRPCInferenceService") == grpc_health.SERVING
    assert status("", ready=False) == grpc_health.NOT_SERVING
    assert status("m", ready=False) == grpc_health.SERVING  # a model's own readiness
    assert status("failed") == grpc_health.NOT_SERVING
    assert status("other") is None
