"""CUDA graphs for the PyTorch backend: which shapes to capture, padding a batch to one, replaying it.

A formed batch of a small model on a GPU costs one kernel launch per operator, a few microseconds
of CPU each: eager PyTorch is launch-bound until batches are large. A CUDA graph replays all of a
forward's launches as one. A graph is fixed to the shapes it was captured with, so the backend
captures one per batch size at load and runs a batch of ``n`` rows on the smallest captured size
``>= n``, with the extra rows zeroed, and slices the outputs back to ``n`` rows.

Turned on per model by Triton's field (Triton itself reads it only in its TensorRT backend)::

    optimization { cuda {
      graphs: true
      graph_spec [ { batch_size: 8  input { key: "x" value { dim: [ 3, 224, 224 ] } } } ]
    } }

The parts, and who calls them (runtime/backends/pytorch.py, on instances placed on a GPU only):

* :func:`graph_plan` (pure): the config -> a :class:`GraphPlan` (the shapes to capture), or None
  when graphs are off; every mistake is a ``ConfigError`` naming the field and what is allowed.
* :func:`select_graph` / :func:`padded_size` (pure): the captured shape a batch runs on.
* :func:`pad_rows`, :func:`slice_rows`, :func:`rows_to_zero` (pure over numpy arrays and torch tensors).
* :class:`GraphedModel`: captures the plan's graphs at construction (the only code here that touches
  CUDA; torch is imported lazily) and replays them in :meth:`GraphedModel.run`.

docs/cuda-graphs.md describes the configuration, the captured sizes, padding and the memory cost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from tritonclient.grpc import model_config_pb2 as mc

from sluice.runtime.backends import torch_plan
from sluice.runtime.errors import ConfigError, ModelError

if TYPE_CHECKING:
    import torch

GRAPH_SPEC = "optimization.cuda.graph_spec"

RowShapes = tuple[tuple[int, ...], ...]
"""One shape per config input, in ``config.input`` order, without the batch dimension."""

ArrayT = TypeVar("ArrayT")


@dataclasses.dataclass(frozen=True)
class CapturedShape:
    """One graph to capture: a batch size and the shape of every input at it."""

    batch_size: int
    """Rows the graph runs; 0 for a model without a batch dimension (``max_batch_size: 0``)."""
    row_shapes: RowShapes
    """Each input's shape without the batch dimension (the full shape when ``batch_size`` is 0)."""

    def input_shapes(self) -> RowShapes:
        """The full shapes of the static input buffers (batch dimension first when batched)."""
        if self.batch_size == 0:
            return self.row_shapes
        return tuple((self.batch_size, *shape) for shape in self.row_shapes)


@dataclasses.dataclass(frozen=True)
class GraphPlan:
    """The CUDA graphs one instance captures; built by :func:`graph_plan` from the model config."""

    input_names: tuple[str, ...]
    """The config's inputs, in ``config.input`` order: the order of tensors ``forward`` and ``run`` take."""
    shapes: tuple[CapturedShape, ...]
    """Sorted by batch size, then row shapes; no two alike."""
    batched: bool
    """False for ``max_batch_size: 0``: graphs match whole shapes, nothing is padded."""
    source: str
    """Where the batch sizes came from: ``graph_spec``, ``preferred_batch_size`` or ``default ladder``."""

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """The distinct captured batch sizes, ascending."""
        return tuple(sorted({s.batch_size for s in self.shapes}))


# -- the plan (pure) -------------------------------------------------------------------------------


def default_ladder(max_batch_size: int) -> tuple[int, ...]:
    """Powers of two below ``max_batch_size``, then ``max_batch_size``: 1, 2, 4, ..., max.

    A batch pads up by less than 2x (at most half of a graph's rows are padding), and the number of
    graphs grows with log2(max): 9 graphs for max_batch_size 256."""
    sizes, size = [], 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    sizes.append(max_batch_size)
    return tuple(sizes)


def graph_plan(config: mc.ModelConfig) -> GraphPlan | None:
    """The graphs to capture for ``config``, or None when ``optimization.cuda.graphs`` is false.

    Batch sizes: the ``graph_spec`` entries when the config lists any (one graph per entry, so one
    batch size may be captured at several input shapes); else ``dynamic_batching``'s
    ``preferred_batch_size`` list plus ``max_batch_size`` (so every batch the scheduler forms has a
    graph); else :func:`default_ladder`. A model without batching (``max_batch_size: 0``) gets one
    graph at its config shape unless ``graph_spec`` entries (``batch_size: 0``) name others.

    Input shapes: the config ``dims``; a ``graph_spec`` entry gives the shape of an input whose dims
    are dynamic (-1), and must agree with the dims the config fixes. An input with a dynamic dim and
    no shape in the entry (or no ``graph_spec`` at all) is a ConfigError: a graph has fixed shapes.
    """
    cuda = config.optimization.cuda
    if not cuda.graphs:
        return None
    sequence = config.sequence_batching
    if sequence.control_input or sequence.state:
        what = "control_input" if sequence.control_input else "state"
        raise ConfigError(
            f"sequence_batching.{what} adds inputs per request that the captured graphs do not take; allowed: "
            "optimization.cuda.graphs only for models without sequence control inputs or implicit state",
            field="optimization.cuda.graphs",
        )
    names = tuple(i.name for i in config.input)
    for index, tensor in enumerate(config.input):
        if tensor.data_type == mc.TYPE_STRING:
            raise ConfigError(
                f"input '{tensor.name}' is TYPE_STRING, which a CUDA graph cannot take; allowed: "
                "optimization.cuda.graphs only for models whose inputs are all numeric tensors",
                field=f"input[{index}].data_type",
            )
    max_batch = config.max_batch_size
    batched = max_batch > 0
    shapes: list[CapturedShape] = []
    first_at: dict[CapturedShape, int] = {}
    if cuda.graph_spec:
        source = "graph_spec"
        for index, spec in enumerate(cuda.graph_spec):
            shape = _spec_shape(config, index, spec)
            if shape in first_at:
                raise ConfigError(
                    f"batch_size {shape.batch_size} with input shapes {_shown(names, shape.row_shapes)} is listed "
                    f"twice (also as {GRAPH_SPEC}[{first_at[shape]}]); allowed: each batch size and shape once",
                    field=f"{GRAPH_SPEC}[{index}]",
                )
            first_at[shape] = index
            shapes.append(shape)
    else:
        rows = _config_row_shapes(config)
        if not batched:
            source, sizes = "default ladder", [0]
        elif config.dynamic_batching.preferred_batch_size:
            source = "preferred_batch_size"
            sizes = sorted({*config.dynamic_batching.preferred_batch_size, max_batch})
            for size in sizes:
                if not 1 <= size <= max_batch:
                    raise ConfigError(
                        f"preferred batch size {size} is out of range; allowed: 1 to max_batch_size ({max_batch})",
                        field="dynamic_batching.preferred_batch_size",
                    )
        else:
            source, sizes = "default ladder", list(default_ladder(max_batch))
        shapes = [CapturedShape(size, rows) for size in sizes]
    return GraphPlan(names, tuple(sorted(shapes, key=lambda s: (s.batch_size, s.row_shapes))), batched, source)


def _config_row_shapes(config: mc.ModelConfig) -> RowShapes:
    rows = []
    for index, tensor in enumerate(config.input):
        dims = torch_plan.model_dims(tensor)
        if any(d < 0 for d in dims):
            raise ConfigError(
                f"input '{tensor.name}' has dynamic dims {dims}; a CUDA graph needs fixed shapes; "
                f"allowed: fixed dims in input[{index}].dims, or {GRAPH_SPEC} entries that give the shape, e.g. "
                f'graph_spec [ {{ batch_size: N input {{ key: "{tensor.name}" value {{ dim: [ ... ] }} }} }} ]',
                field=GRAPH_SPEC,
            )
        rows.append(tuple(dims))
    return tuple(rows)


def _spec_shape(config: mc.ModelConfig, index: int, spec: mc.ModelOptimizationPolicy.Cuda.GraphSpec) -> CapturedShape:
    where = f"{GRAPH_SPEC}[{index}]"
    max_batch = config.max_batch_size
    if max_batch > 0 and not 1 <= spec.batch_size <= max_batch:
        raise ConfigError(
            f"batch_size is {spec.batch_size}; allowed: 1 to max_batch_size ({max_batch})", field=f"{where}.batch_size"
        )
    if max_batch == 0 and spec.batch_size != 0:
        raise ConfigError(
            f"batch_size is {spec.batch_size} but the model does not batch (max_batch_size: 0); allowed: 0",
            field=f"{where}.batch_size",
        )
    if spec.HasField("graph_lower_bound"):
        raise ConfigError(
            "graph_lower_bound is not supported (a graph run on shapes other than its own reads uninitialized "
            "memory); allowed: one graph_spec entry per shape to capture",
            field=f"{where}.graph_lower_bound",
        )
    by_name = {t.name: t for t in config.input}
    for name in sorted(spec.input):
        if name not in by_name:
            raise ConfigError(
                f"unknown input '{name}'; allowed: {', '.join(repr(n) for n in by_name) or 'none (no inputs)'}",
                field=f"{where}.input",
            )
    rows = []
    for tensor in config.input:
        dims = torch_plan.model_dims(tensor)
        if tensor.name in spec.input and tensor.HasField("reshape"):
            raise ConfigError(
                f"input '{tensor.name}' is reshaped to {dims} by the config, and graphs run on that shape; allowed: "
                "no graph_spec shape for a reshaped input (its reshape fixes the shape)",
                field=f"{where}.input[{tensor.name}]",
            )
        if tensor.name not in spec.input:
            if any(d < 0 for d in dims):
                raise ConfigError(
                    f"input '{tensor.name}' has dynamic dims {dims} and this entry gives no shape for it; allowed: "
                    f'input {{ key: "{tensor.name}" value {{ dim: [ ... ] }} }} with {len(dims)} fixed dims',
                    field=f"{where}.input",
                )
            rows.append(tuple(dims))
            continue
        given = list(spec.input[tensor.name].dim)
        field = f"{where}.input[{tensor.name}].dim"
        if len(given) != len(dims):
            raise ConfigError(
                f"input '{tensor.name}' has {len(given)} dims {given} but the config gives it {len(dims)} {dims}; "
                f"allowed: {len(dims)} dims, without the batch dimension",
                field=field,
            )
        for d, want in zip(given, dims, strict=True):
            if d < 1 or (want >= 0 and d != want):
                raise ConfigError(
                    f"input '{tensor.name}' shape {given} does not fit the config dims {dims}; allowed: dims >= 1, "
                    "equal to the config's where it fixes them (-1 there may take any size)",
                    field=field,
                )
        rows.append(tuple(given))
    return CapturedShape(spec.batch_size, tuple(rows))


def _shown(names: Sequence[str], rows: RowShapes) -> str:
    return "{" + ", ".join(f"{n}: {list(s)}" for n, s in zip(names, rows, strict=True)) + "}"


# -- choosing a graph for a batch (pure) ---------------------------------------------------------------


def select_graph(plan: GraphPlan, n: int, row_shapes: RowShapes | None = None) -> CapturedShape | None:
    """The captured shape a batch of ``n`` rows runs on: the smallest batch size ``>= n`` whose
    input shapes equal ``row_shapes`` (None: any shape, for plans whose graphs all share one).
    None: no graph fits, run the model eagerly. Without batching, ``n`` is ignored and only the
    shapes must match."""
    for shape in plan.shapes:  # sorted by batch size: the first fit is the smallest
        if plan.batched and (n < 1 or shape.batch_size < n):
            continue
        if row_shapes is None or shape.row_shapes == row_shapes:
            return shape
    return None


def padded_size(plan: GraphPlan, n: int, row_shapes: RowShapes | None = None) -> int | None:
    """The batch size a batch of ``n`` rows is padded to, or None (no graph fits: eager).

    0 for a plan without batching whose graph matches ``row_shapes`` (see :func:`select_graph`)."""
    shape = select_graph(plan, n, row_shapes)
    return None if shape is None else shape.batch_size


def padding_waste(plan: GraphPlan, n: int) -> float:
    """The share of the padded batch's rows that are padding (0.0 for an exact fit or no graph)."""
    size = padded_size(plan, n)
    return 0.0 if not size else (size - n) / size


def pad_rows(array: ArrayT, rows: int) -> ArrayT:
    """``array`` (numpy array or torch tensor, batch dimension first) with zero rows appended up to
    ``rows`` rows; the array itself when it has that many already. A new array, never a view."""
    data: Any = array
    n = int(data.shape[0])
    if rows < n:
        raise ValueError(f"cannot pad {n} rows to {rows}; allowed: rows >= {n}")
    if rows == n:
        return array
    if hasattr(data, "new_zeros"):  # torch.Tensor: same dtype, device and layout
        padded = data.new_zeros((rows, *data.shape[1:]))
    else:
        import numpy as np

        padded = np.zeros((rows, *data.shape[1:]), dtype=data.dtype)
    padded[:n] = data
    return padded


def slice_rows(array: ArrayT, n: int) -> ArrayT:
    """The first ``n`` rows of ``array`` (numpy array or torch tensor): a view, no copy."""
    data: Any = array
    if not 0 <= n <= int(data.shape[0]):
        raise ValueError(f"cannot take {n} rows of {int(data.shape[0])}")
    return data[:n]


def rows_to_zero(filled: int, n: int) -> tuple[int, int] | None:
    """Rows ``[start, stop)`` of a static input buffer to zero before a run of ``n`` rows, when the
    last run filled ``filled`` rows: only those the last run left behind (None: nothing to zero)."""
    return (n, filled) if filled > n else None


# -- capture and replay (CUDA) ------------------------------------------------------------------------


def _torch() -> Any:
    import torch

    return torch


@dataclasses.dataclass
class _Graph:
    shape: CapturedShape
    graph: Any  # torch.cuda.CUDAGraph
    inputs: list[Any]  # static input buffers (torch.Tensor), in config.input order
    outputs: list[Any]  # static output buffers the graph writes
    filled: int  # rows of ``inputs`` that hold data of the last run (the rest are zero)
    rows: dict[int, tuple[list[Any], list[Any]]] = dataclasses.field(default_factory=dict)
    """Per row count: the first rows of ``inputs`` and of ``outputs`` (views, made once: each torch
    call gives up the GIL, and a busy event loop makes taking it back cost tens of us)."""


class GraphedModel:
    """A model's forward captured as one CUDA graph per planned shape, replayed for each batch.

    ``forward`` runs the model on device tensors ordered as ``config.input`` and returns its outputs
    ordered as the backend expects them; ``example_inputs(batch_size)`` builds device inputs for a
    batch size (0 for a model without batching): their dtypes, devices and memory formats
    (channels_last) are the static buffers'; their shapes too, unless the plan gives other ones
    (dynamic dims fixed by ``graph_spec``), in which case zeros of the plan's shapes are used.

    Construction warms each shape up on a side stream (lazy initialisation that must not happen
    during capture: cuBLAS handles and workspaces, the caching allocator's blocks, kernels loaded;
    nothing is autotuned: cuDNN picks its algorithms by its heuristics, as ``torch.backends.cudnn.benchmark``
    is left as the process has it, off by default), then captures the graphs largest first into one
    shared memory pool (the graphs never run at once, so their intermediate tensors can share memory:
    the pool is about the largest graph's activations plus every graph's static inputs and outputs).
    ``memory_bytes`` is what that took: the growth of ``torch.cuda.memory_reserved`` over the
    construction (PyTorch's cache emptied before and after; approximate when other instances of the
    process allocate meanwhile).

    Construction synchronizes the whole device and empties PyTorch's cache (so does
    ``torch.cuda.graph`` itself), which CUDA refuses while another stream of the device captures:
    callers construct one at a time (the backend holds its ``_CUDA_ALLOCATOR`` lock). ``stream``
    should be the instance's own, not one of torch's pooled streams another instance may also hold.

    One instance belongs to one model instance and is used by one thread at a time.
    """

    def __init__(
        self,
        forward: Callable[[list[torch.Tensor]], list[torch.Tensor]],
        plan: GraphPlan,
        example_inputs: Callable[[int], list[torch.Tensor]],
        device: torch.device | str | int,
        stream: torch.cuda.Stream,
        *,
        warmup_runs: int = 3,
    ) -> None:
        torch = _torch()
        self.plan = plan
        self._device = torch.device(device)
        self._stream = stream
        self._graphs: dict[CapturedShape, _Graph] = {}
        started = time.monotonic()
        torch.cuda.synchronize(self._device)
        # torch.cuda.graph empties PyTorch's cache before each capture anyway; emptying it here and
        # at the end too makes the difference in reserved memory the graphs' alone (their buffers
        # and pool), not cached blocks of whatever ran before.
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved(self._device)
        # Capture needs a stream other than the legacy default one; the instance's own stream is
        # used when it is one, so that replays and captures see the same stream.
        default = torch.cuda.default_stream(self._device)
        capture_stream = stream if stream != default else torch.cuda.Stream(self._device)
        pool = torch.cuda.graph_pool_handle()
        with torch.no_grad(), torch.cuda.device(self._device):
            for shape in sorted(plan.shapes, key=lambda s: s.batch_size, reverse=True):
                static_inputs = self._static_inputs(shape, example_inputs(shape.batch_size))
                capture_stream.wait_stream(torch.cuda.current_stream(self._device))
                with torch.cuda.stream(capture_stream):
                    for _ in range(warmup_runs):
                        forward(static_inputs)
                capture_stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                try:
                    # thread_local: other instances keep serving (and allocating) on their threads
                    # while this one captures; the default (global) mode would fail their CUDA calls.
                    with torch.cuda.graph(graph, pool=pool, stream=capture_stream, capture_error_mode="thread_local"):
                        static_outputs = list(forward(static_inputs))
                except Exception as exc:
                    _end_pool_allocation(torch, self._device, pool)
                    raise ModelError(
                        f"CUDA graph capture failed at batch size {shape.batch_size}: {type(exc).__name__}: "
                        f"{torch_plan.first_line(exc)}; a model that synchronizes with the host (.item(), .cpu(), "
                        "data-dependent shapes) cannot be captured: set optimization.cuda.graphs: false for it"
                    ) from exc
                self._graphs[shape] = _Graph(shape, graph, static_inputs, static_outputs, shape.batch_size)
        torch.cuda.synchronize(self._device)
        torch.cuda.empty_cache()
        self.memory_bytes: int = max(0, int(torch.cuda.memory_reserved(self._device) - reserved_before))
        """GPU memory the capture added to PyTorch's caching allocator (static buffers, the pool)."""
        self.capture_s: float = time.monotonic() - started
        """Seconds the warm-up and capture took (part of the model's load time)."""

    def _static_inputs(self, shape: CapturedShape, examples: Sequence[Any]) -> list[Any]:
        torch = _torch()
        if len(examples) != len(self.plan.input_names):
            raise ModelError(
                f"example_inputs({shape.batch_size}) returned {len(examples)} tensors; the config has "
                f"{len(self.plan.input_names)} inputs ({', '.join(self.plan.input_names)})"
            )
        buffers = []
        for example, wanted in zip(examples, shape.input_shapes(), strict=True):
            if tuple(example.shape) == wanted:
                buffers.append(example.to(self._device).clone())  # clone keeps the memory format
                continue
            buffer = torch.zeros(wanted, dtype=example.dtype, device=self._device)
            if example.dim() == 4 and len(wanted) == 4 and _is_channels_last(example):
                buffer = buffer.contiguous(memory_format=torch.channels_last)
            buffers.append(buffer)
        return buffers

    def describe(self) -> str:
        """One line for the load log: sizes, source, memory and time."""
        sizes = ",".join(str(s) for s in self.plan.batch_sizes)
        return (
            f"captured {len(self._graphs)} CUDA graph(s) at batch sizes {sizes} (from {self.plan.source}) in "
            f"{self.capture_s:.2f} s; {self.memory_bytes / 2**20:.1f} MiB of GPU memory reserved for them"
        )

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """Run a batch on the smallest graph that fits it; None when none does (run eagerly instead).

        ``inputs`` are ordered as ``config.input``, batch dimension first (whole tensors without
        batching), on the GPU or in (pinned) host memory: they are copied into the graph's static
        buffers on the instance's stream, rows past ``n`` are zero, and the graph is replayed there.

        Returns the outputs sliced to ``n`` rows: views of the graph's static output buffers, valid
        until the next ``run`` of this object (copy them, e.g. to the host, before calling it again),
        and ready once the instance's stream reaches this point (read them on that stream, or
        synchronize it). The same view objects come back for every batch of ``n`` rows: read or copy
        them, never change them in place."""
        if len(inputs) != len(self.plan.input_names):
            return None  # an optional input is missing: the graphs were captured with all of them
        n = int(inputs[0].shape[0]) if self.plan.batched else 0
        rows = tuple(tuple(t.shape[1:]) if self.plan.batched else tuple(t.shape) for t in inputs)
        if self.plan.batched and any(int(t.shape[0]) != n for t in inputs):
            return None
        shape = select_graph(self.plan, n, rows)
        if shape is None:
            return None
        entry = self._graphs[shape]
        torch = _torch()
        # The inputs may come from work queued on the caller's current stream.
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        if self.plan.batched:
            views = entry.rows.get(n)
            if views is None:
                views = entry.rows[n] = (
                    [slice_rows(static, n) for static in entry.inputs],
                    [slice_rows(out, n) for out in entry.outputs],
                )
            targets, results = views
        else:
            targets, results = entry.inputs, entry.outputs
        with torch.no_grad(), torch.cuda.stream(self._stream):
            stale = rows_to_zero(entry.filled, n) if self.plan.batched else None
            entry.filled = max(entry.filled, n)  # rows a copy that fails part-way may have written
            for static, target, given in zip(entry.inputs, targets, inputs, strict=True):
                if given.device.type == "cpu" and given.dtype != static.dtype:
                    # convert on the GPU, not on the host (copy_ across devices would cast first)
                    given = given.to(self._device, non_blocking=True)
                target.copy_(given, non_blocking=True)
            if stale is not None:
                for static in entry.inputs:
                    static[stale[0] : stale[1]].zero_()
            entry.filled = n
            entry.graph.replay()
        return list(results)

    def close(self) -> None:
        """Drop the graphs and their buffers (their pool returns to PyTorch's caching allocator)."""
        self._graphs.clear()


def _end_pool_allocation(torch: Any, device: Any, pool: Any) -> None:
    """After a failed capture: stop routing this thread's allocations into the graphs' pool. torch ends
    it in ``capture_end`` only after the CUDA call that failed, so without this the allocator keeps a
    capture listed as under way and ``empty_cache`` frees nothing for the rest of the process."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is None:
        return
    with contextlib.suppress(Exception):  # already ended (the failure came later): nothing to undo
        end(device.index if device.index is not None else torch.cuda.current_device(), pool)


def _is_channels_last(tensor: Any) -> bool:
    torch = _torch()
    return bool(tensor.is_contiguous(memory_format=torch.channels_last) and not tensor.is_contiguous())
