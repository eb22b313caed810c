"""A model's input/output signature from its config, and the check of a request against it.

Pure: :func:`check_request` validates names, datatypes and shapes, applies config ``reshape``, and
fills the request's ``batch_size`` and ``shape_key`` so the scheduler batches only compatible
requests. Called by the dataplane on the event loop for every request, so it stays cheap.
"""

from __future__ import annotations

import dataclasses

from tritonclient.grpc import model_config_pb2 as mc

from sluice.runtime.errors import InvalidArgument
from sluice.runtime.types import DATATYPE_BY_CONFIG_TYPE, InferRequest


@dataclasses.dataclass(frozen=True)
class IOSpec:
    name: str
    datatype: str  # V2 name
    dims: tuple[int, ...]  # as clients see it, without the batch dim; -1 = any
    reshape: tuple[int, ...] | None  # what the model wants instead of dims (without batch dim)
    optional: bool = False

    def shape_text(self, batched: bool) -> str:
        return str([-1, *self.dims] if batched else list(self.dims))


@dataclasses.dataclass(frozen=True)
class Signature:
    model: str  # "name" or "name:version", for messages
    max_batch_size: int
    inputs: dict[str, IOSpec]
    outputs: dict[str, IOSpec]
    memo: dict[tuple, tuple[int, tuple, bool]] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    """Checks already passed, by request shape: (batch size, shape key, needs reshape). Bounded."""

    @property
    def batched(self) -> bool:
        return self.max_batch_size > 0

    @property
    def name(self) -> str:
        """The model's name without the version, as Triton's messages name it."""
        name, _, version = self.model.rpartition(":")
        return name if name and version.isdigit() else self.model


def _spec(io: mc.ModelInput | mc.ModelOutput) -> IOSpec:
    reshape = tuple(io.reshape.shape) if io.HasField("reshape") else None
    return IOSpec(
        io.name,
        DATATYPE_BY_CONFIG_TYPE.get(mc.DataType.Name(io.data_type), "BYTES"),
        tuple(io.dims),
        reshape,
        bool(getattr(io, "optional", False)),
    )


def signature_of(config: mc.ModelConfig, label: str) -> Signature:
    return Signature(
        label,
        config.max_batch_size,
        {i.name: _spec(i) for i in config.input},
        {o.name: _spec(o) for o in config.output},
    )


def check_request(request: InferRequest, sig: Signature) -> None:
    """Validate ``request`` against ``sig`` in place; raises InvalidArgument naming the problem.

    Clients repeat the same shapes, so a passed check is remembered per (inputs, datatypes,
    shapes, requested outputs); a repeat only applies the remembered result.
    """
    outputs = request.outputs
    key = (
        tuple((t.name, t.datatype, t.data.shape) for t in request.inputs),
        None if outputs is None else tuple(o.name for o in outputs),
    )
    known = sig.memo.get(key)
    if known is not None:
        request.batch_size, request.shape_key, reshape = known
        if reshape:
            _apply_reshapes(request, sig)
        return
    _check(request, sig)
    if len(sig.memo) >= 256:
        sig.memo.clear()
    sig.memo[key] = (
        request.batch_size,
        request.shape_key,
        any(sig.inputs[t.name].reshape is not None for t in request.inputs),
    )


def _apply_reshapes(request: InferRequest, sig: Signature) -> None:
    for tensor in request.inputs:
        spec = sig.inputs[tensor.name]
        if spec.reshape is not None:
            shape = tensor.data.shape
            tensor.data = tensor.data.reshape((shape[0], *spec.reshape) if sig.batched else spec.reshape)


def _dims(dims: list[int] | tuple[int, ...]) -> str:
    """A shape as Triton writes it in messages: ``[-1,16]``."""
    return "[" + ",".join(str(d) for d in dims) + "]"


def _quoted(names: list[str]) -> str:
    """Names as Triton lists them in messages: ``['INPUT0','INPUT1']``."""
    return "[" + ",".join(f"'{n}'" for n in names) + "]"


_BATCH_NOTE = (
    "NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension to be prepended "
    "to each input shape. If you want to specify the full shape including the batch dim in your input dims "
    "config, try setting max_batch_size to zero. See the model configuration docs for more info on max_batch_size."
)


def _required(sig: Signature) -> int:
    return sum(1 for spec in sig.inputs.values() if not spec.optional)


def _count_error(request: InferRequest, sig: Signature) -> InvalidArgument:
    """Triton's message for a wrong number of inputs, or a required input left out."""
    inputs = sig.inputs
    given = [t.name for t in request.inputs]
    present = set(given)
    missing = [name for name, spec in inputs.items() if not spec.optional and name not in present]
    required = _required(sig)
    if required == len(inputs):
        expected = f"expected {len(inputs)} inputs"
    else:
        expected = f"expected number of inputs between {required} and {len(inputs)}"
    return InvalidArgument(
        f"{expected} but got {len(given)} inputs for model '{sig.name}'. Got input(s) {_quoted(given)}, "
        f"but missing required input(s) {_quoted(missing)}. Please provide all required input(s)."
    )


def _check(request: InferRequest, sig: Signature) -> None:
    # Triton's order: repeated names, requested outputs, the number of inputs, then each input.
    inputs = sig.inputs
    model = sig.name
    names: set[str] = set()
    for tensor in request.inputs:
        if tensor.name in names:
            raise InvalidArgument(f"input '{tensor.name}' already exists in request for model '{model}'")
        names.add(tensor.name)
    if request.outputs:
        wanted: set[str] = set()
        for out in request.outputs:
            if out.name in wanted:
                raise InvalidArgument(
                    f"output '{out.name}' already exists in request for model '{model}': "
                    "ask for each output at most once"
                )
            wanted.add(out.name)
            if out.name not in sig.outputs:
                raise InvalidArgument(
                    f"unexpected inference output '{out.name}' for model '{model}'; "
                    f"known outputs: {', '.join(sig.outputs) or '(none)'}"
                )
    if not _required(sig) <= len(request.inputs) <= len(inputs):
        raise _count_error(request, sig)
    batch: int | None = None
    key = []
    for tensor in request.inputs:
        spec = inputs.get(tensor.name)
        if spec is None:
            raise InvalidArgument(
                f"unexpected inference input '{tensor.name}' for model '{model}'; "
                f"expected inputs: {', '.join(inputs) or '(none)'}"
            )
        if tensor.datatype != spec.datatype:
            raise InvalidArgument(
                f"inference input '{tensor.name}' data-type is '{tensor.datatype}', "
                f"but model '{model}' expects '{spec.datatype}'"
            )
        shape = tensor.data.shape
        dims = spec.dims
        if sig.batched:
            if not shape:
                raise InvalidArgument(
                    f"input '{tensor.name}' has no shape but model requires batch dimension for '{model}'"
                )
            if batch is None:
                batch = shape[0]
                if batch > sig.max_batch_size:
                    raise InvalidArgument(
                        f"inference request batch-size must be <= {sig.max_batch_size} for '{model}', "
                        f"got {batch} (input '{tensor.name}')"
                    )
            elif shape[0] != batch:
                raise InvalidArgument(
                    f"input '{tensor.name}' batch size does not match other inputs for '{model}': "
                    f"{shape[0]} here, {batch} in an earlier input"
                )
            inner = shape[1:]
        else:
            inner = shape
        if len(inner) != len(dims) or any(want != -1 and want != got for want, got in zip(dims, inner, strict=True)):
            expected = _dims([-1, *dims] if sig.batched else dims)
            raise InvalidArgument(
                f"unexpected shape for input '{tensor.name}' for model '{model}'. Expected {expected}, "
                f"got {_dims(shape)}" + (f". {_BATCH_NOTE}" if sig.batched else "")
            )
        if sig.batched and shape[0] < 1:
            raise InvalidArgument(
                f"input '{tensor.name}' of model '{model}' has batch size 0 (shape {_dims(shape)}); "
                f"the first dimension is the batch size, 1..{sig.max_batch_size}"
            )
        if spec.reshape is not None:
            target = (shape[0], *spec.reshape) if sig.batched else spec.reshape
            try:
                tensor.data = tensor.data.reshape(target)
            except ValueError:
                raise InvalidArgument(
                    f"input '{tensor.name}' of shape {_dims(shape)} cannot be reshaped to {_dims(target)} "
                    f"as model '{model}' config asks"
                ) from None
        key.append((tensor.name, inner))
    if len(names) < len(inputs) and any(not spec.optional and n not in names for n, spec in inputs.items()):
        raise _count_error(request, sig)  # the count was right, but an optional input took a required one's place
    request.batch_size = batch or 1
    key.sort()
    request.shape_key = tuple(key)
