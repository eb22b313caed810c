"""Sequence (stateful) test models, generated with onnx.helper, and their configs.

* ``accumulator_onnx``: OUTPUT = the running sum of INPUT over the sequence, kept in an implicit
  state (ACC_IN -> ACC_OUT); START resets it, READY=0 rows produce 0. With ``corrid``, also
  OUTPUT_ID = the CORRID control input (UINT64).
* ``start_plus_input_onnx``: OUTPUT = (INPUT + START) * READY, with no state: the behaviour of the
  ``simple_sequence`` model Triton's client examples expect.
* ``dyna_onnx``: OUTPUT = INPUT + START + END * CORRID (the ``simple_dyna_sequence`` behaviour).
* ``history_onnx``: a state with a variable dim (``dims: [ -1 ]``) that grows by one per request:
  HIST_OUT = HIST_IN with INPUT appended, OUTPUT = its sum (``HISTORY_CONFIG``, Direct, batch of 2).
* ``ACCUMULATOR_PY``: the accumulator as a Python-backend model (state through pb_utils), which also
  returns the correlation id it saw as CORR (BYTES).
"""

from __future__ import annotations

import textwrap


def _model(nodes: list, name: str, inputs: list, outputs: list, initializers: list | None = None) -> bytes:
    from onnx import helper

    graph = helper.make_graph(nodes, name, inputs, outputs, initializers or [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


def _int32(name: str, batched: bool = True) -> object:
    from onnx import TensorProto, helper

    return helper.make_tensor_value_info(name, TensorProto.INT32, ["batch", 1] if batched else [1])


def accumulator_onnx(*, corrid: bool = False) -> bytes:
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    inputs = [_int32(n) for n in ("INPUT", "START", "READY", "ACC_IN")]
    outputs = [_int32("OUTPUT"), _int32("ACC_OUT")]
    nodes = [
        helper.make_node("Sub", ["one", "START"], ["keep"]),
        helper.make_node("Mul", ["ACC_IN", "keep"], ["carried"]),
        helper.make_node("Add", ["carried", "INPUT"], ["sum"]),
        helper.make_node("Mul", ["sum", "READY"], ["OUTPUT"]),
        helper.make_node("Identity", ["OUTPUT"], ["ACC_OUT"]),
    ]
    if corrid:
        inputs.append(helper.make_tensor_value_info("CORRID", TensorProto.UINT64, ["batch", 1]))
        outputs.append(helper.make_tensor_value_info("OUTPUT_ID", TensorProto.UINT64, ["batch", 1]))
        nodes.append(helper.make_node("Identity", ["CORRID"], ["OUTPUT_ID"]))
    one = numpy_helper.from_array(np.array([1], dtype=np.int32), "one")
    return _model(nodes, "accumulator", inputs, outputs, [one])


def start_plus_input_onnx() -> bytes:
    from onnx import helper

    nodes = [
        helper.make_node("Add", ["INPUT", "START"], ["sum"]),
        helper.make_node("Mul", ["sum", "READY"], ["OUTPUT"]),
    ]
    return _model(nodes, "simple_sequence", [_int32(n) for n in ("INPUT", "START", "READY")], [_int32("OUTPUT")])


def dyna_onnx() -> bytes:
    from onnx import TensorProto, helper

    inputs = [_int32(n) for n in ("INPUT", "START", "END", "READY")]
    inputs.append(helper.make_tensor_value_info("CORRID", TensorProto.UINT64, ["batch", 1]))
    nodes = [
        helper.make_node("Cast", ["CORRID"], ["corrid32"], to=TensorProto.INT32),
        helper.make_node("Mul", ["END", "corrid32"], ["id_at_end"]),
        helper.make_node("Add", ["INPUT", "START"], ["with_start"]),
        helper.make_node("Add", ["with_start", "id_at_end"], ["sum"]),
        helper.make_node("Mul", ["sum", "READY"], ["OUTPUT"]),
    ]
    return _model(nodes, "simple_dyna_sequence", inputs, [_int32("OUTPUT")])


def history_onnx() -> bytes:
    from onnx import TensorProto, helper

    def tensor(name: str, dims: list) -> object:
        return helper.make_tensor_value_info(name, TensorProto.INT32, dims)

    nodes = [
        helper.make_node("Concat", ["HIST_IN", "INPUT"], ["HIST_OUT"], axis=1),
        helper.make_node("ReduceSum", ["HIST_OUT", "axis1"], ["OUTPUT"], keepdims=1),
    ]
    axis = helper.make_tensor("axis1", TensorProto.INT64, [1], [1])
    inputs = [tensor("INPUT", ["batch", 1]), tensor("START", ["batch", 1]), tensor("HIST_IN", ["batch", "n"])]
    outputs = [tensor("OUTPUT", ["batch", 1]), tensor("HIST_OUT", ["batch", "m"])]
    return _model(nodes, "history", inputs, outputs, [axis])


HISTORY_CONFIG = """
name: "history"
backend: "onnxruntime"
max_batch_size: 2
input [ { name: "INPUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUTPUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
sequence_batching {
  control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ]
  state [ { input_name: "HIST_IN" output_name: "HIST_OUT" data_type: TYPE_INT32 dims: [ -1 ]
            initial_state: { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true name: "zero" } } ]
}
"""


def _controls(*entries: tuple[str, str, str]) -> str:
    rows = []
    for name, kind, values in entries:
        rows.append(f'{{ name: "{name}" control [ {{ kind: {kind} {values} }} ] }}')
    return "control_input [\n    " + ",\n    ".join(rows) + "\n  ]"


START = ("START", "CONTROL_SEQUENCE_START", "int32_false_true: [ 0, 1 ]")
END = ("END", "CONTROL_SEQUENCE_END", "int32_false_true: [ 0, 1 ]")
READY = ("READY", "CONTROL_SEQUENCE_READY", "int32_false_true: [ 0, 1 ]")
CORRID_UINT64 = ("CORRID", "CONTROL_SEQUENCE_CORRID", "data_type: TYPE_UINT64")
CORRID_STRING = ("CORRID", "CONTROL_SEQUENCE_CORRID", "data_type: TYPE_STRING")

ACC_STATE = """state [ {
    input_name: "ACC_IN" output_name: "ACC_OUT" data_type: TYPE_INT32 dims: [ 1 ]
    initial_state: { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true name: "zero" }
  } ]"""


def accumulator_config(
    name: str,
    *,
    backend: str = "onnxruntime",
    strategy: str = "",
    controls: tuple[tuple[str, str, str], ...] = (START, READY),
    idle_us: int = 0,
    max_batch_size: int = 8,
    instances: int = 1,
    extra_outputs: str = "",
) -> str:
    idle = f"max_sequence_idle_microseconds: {idle_us}" if idle_us else ""
    return textwrap.dedent(
        f"""
        name: "{name}"
        backend: "{backend}"
        max_batch_size: {max_batch_size}
        input [ {{ name: "INPUT", data_type: TYPE_INT32, dims: [ 1 ] }} ]
        output [ {{ name: "OUTPUT", data_type: TYPE_INT32, dims: [ 1 ] }}{extra_outputs} ]
        instance_group [ {{ count: {instances}, kind: KIND_CPU }} ]
        sequence_batching {{
          {idle}
          {strategy}
          {_controls(*controls)}
          {ACC_STATE}
        }}
        """
    )


ACCUMULATOR_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            start = pb_utils.get_input_tensor_by_name(request, "START").as_numpy()
            state = pb_utils.get_input_tensor_by_name(request, "ACC_IN").as_numpy()
            total = (np.where(start != 0, 0, state) + value).astype(np.int32)
            seen = np.array([[str(request.correlation_id()).encode()]], dtype=object)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT", total),
                pb_utils.Tensor("ACC_OUT", total),
                pb_utils.Tensor("CORR", seen),
            ]))
        return responses
"""
