"""The protocol-neutral gRPC service (runtime/protocol/grpc_service.py): one method table behind both
front ends, so each method is answered the same way by ``h2`` and ``grpcio``."""

from __future__ import annotations

import grpc
import pytest
from tritonclient.grpc import service_pb2 as pb

from sluice.runtime import tracing
from sluice.runtime.protocol.grpc_service import INFER, STREAM, UNARY, UNIMPLEMENTED, Service
from sluice.runtime.settings import Limits

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
    assert set(kinds) == set(ALL)
    assert {n for n, k in kinds.items() if k != UNIMPLEMENTED} == SERVED
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
