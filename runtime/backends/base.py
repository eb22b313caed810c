"""The contract between the scheduler and a backend.

A backend turns one model version directory plus its parsed ``ModelConfig`` into a
:class:`ModelBackend`; the scheduler asks it for one :class:`ModelInstance` per instance-group slot
and calls ``execute`` on a worker thread (never on the event loop) with a batch of validated
requests. ``execute`` returns one result per request, in order: an ``InferResponse`` or a
``SluiceError`` for that request alone, so one bad request never fails its batch neighbours.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from sluice.runtime.errors import SluiceError
from sluice.runtime.types import InferRequest, InferResponse

Result = InferResponse | SluiceError


def client_shape(
    produced: Sequence[int], dims: Sequence[int], reshape: Sequence[int], batched: bool
) -> tuple[int, ...] | None:
    """An output's shape as clients see it, Triton's output ``reshape``: the model produced ``produced``
    in the ``reshape`` form (after the batch dim when ``batched``); clients see ``dims``. Each -1 of
    ``dims`` takes, in order, the size the model gave a -1 of ``reshape``. None when ``produced`` does
    not fit ``reshape`` or the element counts differ."""
    lead = tuple(produced[:1]) if batched else ()
    body = tuple(produced[1:]) if batched else tuple(produced)
    if len(body) != len(reshape) or any(r != -1 and r != b for r, b in zip(reshape, body, strict=True)):
        return None
    fills = iter([b for r, b in zip(reshape, body, strict=True) if r == -1])
    shown = [next(fills, -1) if d == -1 else d for d in dims]
    count = 1
    for size in body:
        count *= size
    known = 1
    for size in shown:
        known *= size if size != -1 else 1
    if shown.count(-1) == 1 and known:
        shown[shown.index(-1)] = count // known
    total = 1
    for size in shown:
        total *= size
    if -1 in shown or total != count:
        return None
    return lead + tuple(shown)


def reshape_problem(model: str, name: str, produced: Sequence[int], dims: Sequence[int], reshape: Sequence[int]) -> str:
    return (f"model '{model}' produced output '{name}' of shape {list(produced)}, which does not fit its config's "
            f"reshape {list(reshape)} (clients see dims {list(dims)})")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """An input or output as the model file declares it (used to complete the config)."""

    name: str
    datatype: str  # V2 name, e.g. "FP32"
    shape: tuple[int, ...]  # -1 for dynamic dims, including the batch dim if the model has one
    rank_known: bool = True
    """False when the file declares no shape at all (not even a rank): the config's dims decide."""


Dispatch = Callable[[InferRequest, Callable[[Result], None]], None]
"""The data plane's entry for calls made by models (BLS): raises for immediate rejections, else
calls ``done`` once; both on the server's event loop."""


@dataclasses.dataclass
class BackendServices:
    """What the server lends backends: the Python backend's BLS calls and custom metrics.

    One object per server, built by the server and filled in as its parts start (the data plane
    sets ``dispatch``, the server sets ``loop`` once it runs). Empty fields mean the feature is
    off (unit tests that build a repository alone)."""

    dispatch: Dispatch | None = None
    """Where BLS requests go: the data plane (queue, batching, cache and timeouts of the target)."""
    loop: asyncio.AbstractEventLoop | None = None
    """The server's event loop, on which ``dispatch`` must be called."""
    model_metrics: Any = None
    """``triton_python_backend_utils.MetricRegistry`` of ``pb_utils.MetricFamily`` objects, exported
    on the metrics port (metrics.py); None: custom metrics are refused."""
    auto_complete_config: bool = True
    """False with ``--disable-auto-complete-config``: ``TritonPythonModel.auto_complete_config`` is
    not called."""


@dataclasses.dataclass(frozen=True)
class LoadContext:
    model_name: str
    version: int
    model_dir: Path  # <repository>/<model>
    version_dir: Path  # <repository>/<model>/<version>
    repository: Path
    services: BackendServices | None = None
    instance_names: tuple[str, ...] = ()
    """Triton's name of each instance the repository will make, by index (repository.instance_names);
    empty where a test builds a backend alone (:func:`instance_name_of` then names them)."""


def instance_name_of(config: mc.ModelConfig, model_name: str, index: int, ctx: LoadContext | None = None) -> str:
    """Triton's name for the ``index``-th instance the instance groups ask for: ``ctx.instance_names``
    when the repository gave them, else counted from the config alone (one device per group): the
    group's name (``<model>_<group index>`` when unnamed) for a group of one instance, else
    ``<group name>_<c>``; a model with no ``instance_group`` has one instance ``<model>_0``."""
    if ctx is not None and index < len(ctx.instance_names):
        return ctx.instance_names[index]
    groups = list(config.instance_group) or [mc.ModelInstanceGroup(count=1)]
    remaining = index
    for group_index, group in enumerate(groups):
        count = max(group.count, 1)
        last = group_index == len(groups) - 1
        if remaining < count or last:
            return group_instance_names(group, config.name or model_name, group_index)[remaining % count]
        remaining -= count
    raise AssertionError("unreachable: the last group takes any index")


def group_instance_names(group: mc.ModelInstanceGroup, model_name: str, group_index: int) -> list[str]:
    """Triton's names of one device's instances of ``group`` (backend_model.cc): the group's name
    (``<model>_<group index>`` when unnamed) for a count of one, else ``<group name>_<c>``."""
    base = group.name or f"{model_name}_{group_index}"
    count = max(group.count, 1)
    return [base] if count == 1 else [f"{base}_{c}" for c in range(count)]


class ModelInstance(abc.ABC):
    """One executor of a model: owns its session/interpreter; used by one thread at a time."""

    last_phases_ns: tuple[int, int] = (0, 0)
    """(input preparation, output extraction) nanoseconds of the last ``execute``, for the statistics'
    ``compute_input`` / ``compute_output`` (the rest of the execution is ``compute_infer``). Set by
    backends that can tell them apart; read by the scheduler's worker right after ``execute``."""

    @abc.abstractmethod
    def execute(self, requests: Sequence[InferRequest]) -> list[Result]: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the instance holds; called once, after its last execute."""


class ModelBackend(abc.ABC):
    """A loaded model version; creates instances."""

    config: mc.ModelConfig

    @abc.abstractmethod
    def new_instance(self, index: int, kind: int, device_id: int) -> ModelInstance:
        """``kind`` is a ``ModelInstanceGroup.Kind`` value (KIND_CPU, KIND_GPU, ...)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Called after every instance was closed."""
