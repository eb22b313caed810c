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


def _check(request: InferRequest, sig: Signature) -> None:
    inputs = sig.inputs
    seen = 0
    batch: int | None = None
    key = []
    for tensor in request.inputs:
        spec = inputs.get(tensor.name)
        if spec is None:
            raise InvalidArgument(
                f"unexpected inference input '{tensor.name}' for model '{sig.model}'; "
                f"expected inputs: {', '.join(inputs) or '(none)'}"
            )
        seen += 1
        if tensor.datatype != spec.datatype:
            raise InvalidArgument(
                f"inference input '{tensor.name}' data-type is '{tensor.datatype}', "
                f"but model '{sig.model}' expects '{spec.datatype}'"
            )
        shape = tensor.data.shape
        dims = spec.dims
        if sig.batched:
            if len(shape) != len(dims) + 1 or shape[0] < 1:
                raise InvalidArgument(
                    f"unexpected shape for input '{tensor.name}' for model '{sig.model}'. "
                    f"Expected {spec.shape_text(True)} (first dim is the batch, 1..{sig.max_batch_size}), "
                    f"got {list(shape)}"
                )
            if batch is None:
                batch = shape[0]
                if batch > sig.max_batch_size:
                    raise InvalidArgument(
                        f"inference request batch-size must be <= {sig.max_batch_size} for '{sig.model}', "
                        f"got {batch} (input '{tensor.name}')"
                    )
            elif shape[0] != batch:
                raise InvalidArgument(
                    f"inputs of one request must share the batch size: '{tensor.name}' has {shape[0]}, "
                    f"an earlier input has {batch}"
                )
            inner = shape[1:]
        else:
            inner = shape
            if len(inner) != len(dims):
                raise InvalidArgument(
                    f"unexpected shape for input '{tensor.name}' for model '{sig.model}'. "
                    f"Expected {spec.shape_text(False)}, got {list(shape)}"
                )
        for want, got in zip(dims, inner, strict=True):
            if want != -1 and want != got:
                raise InvalidArgument(
                    f"unexpected shape for input '{tensor.name}' for model '{sig.model}'. "
                    f"Expected {spec.shape_text(sig.batched)}, got {list(shape)}"
                )
        if spec.reshape is not None:
            target = (shape[0], *spec.reshape) if sig.batched else spec.reshape
            try:
                tensor.data = tensor.data.reshape(target)
            except ValueError:
                raise InvalidArgument(
                    f"input '{tensor.name}' of shape {list(shape)} cannot be reshaped to {list(target)} "
                    f"as model '{sig.model}' config asks"
                ) from None
        key.append((tensor.name, inner))
    if seen != len(request.inputs) or len({t.name for t in request.inputs}) != len(request.inputs):
        raise InvalidArgument(f"an input is given more than once in a request for model '{sig.model}'")
    if seen < len(inputs):
        given = {t.name for t in request.inputs}
        missing = [name for name, spec in inputs.items() if name not in given and not spec.optional]
        if missing:
            raise InvalidArgument(
                f"expected {len(inputs)} inputs but got {len(request.inputs)} inputs for model '{sig.model}'. "
                f"Got input(s) {sorted(given)}, but missing required input(s) {missing}. "
                "Please provide all required input(s)."
            )
    if request.outputs:
        for out in request.outputs:
            if out.name not in sig.outputs:
                raise InvalidArgument(
                    f"unexpected inference output '{out.name}' for model '{sig.model}'; "
                    f"known outputs: {', '.join(sig.outputs) or '(none)'}"
                )
    request.batch_size = batch or 1
    key.sort()
    request.shape_key = tuple(key)
