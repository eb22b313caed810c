"""Writes the ONNX models of examples/model_repository (needs the `onnx` package: the test extra).

    python examples/make_models.py [REPOSITORY_DIR]

The files are committed (a few KB each), so serving the examples needs no onnx install; run this
again only to change them. The same builders are used by the tests.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np


def add_sub_model(size: int = 16) -> bytes:
    """INPUT0, INPUT1 (FP32 [size]) -> OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1."""
    from onnx import TensorProto, helper

    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [size]) for n in ("INPUT0", "INPUT1")]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [size]) for n in ("OUTPUT0", "OUTPUT1")]
    nodes = [
        helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
        helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
    ]
    graph = helper.make_graph(nodes, "add_sub", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


def mlp_model(sizes: tuple[int, ...] = (16, 64, 64, 4), seed: int = 0) -> bytes:
    """INPUT0 (FP32 [-1, sizes[0]]) -> OUTPUT0 (FP32 [-1, sizes[-1]]): Gemm+Relu layers, fixed seed."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes = []
    initializers = []
    current = "INPUT0"
    for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
        w = (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)
        b = (rng.standard_normal(n_out) * 0.1).astype(np.float32)
        initializers += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        last = i == len(sizes) - 2
        out = "OUTPUT0" if last else f"h{i}"
        gemm_out = out if last else f"g{i}"
        nodes.append(helper.make_node("Gemm", [current, f"w{i}", f"b{i}"], [gemm_out]))
        if not last:
            nodes.append(helper.make_node("Relu", [gemm_out], [out]))
        current = out
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", sizes[0]])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", sizes[-1]])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).parent / "model_repository"
    for name, blob in (("add_sub", add_sub_model()), ("mlp", mlp_model())):
        path = root / name / "1" / "model.onnx"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(blob)
        print(f"wrote {path} ({len(blob)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
