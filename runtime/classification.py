"""The classification extension: an output requested with ``classification: k`` is answered with
its top ``k`` entries as strings instead of the raw tensor, as Triton does.

Each entry is ``"<score>:<index>"``, or ``"<score>:<index>:<label>"`` when the output's
``label_filename`` (a file in the model directory, one label per line) has a non-empty label for
that index. Scores are written as C++ ``std::to_string`` writes them (``%f`` for FP32/FP64, plain
integers for integer types); only integer, FP32 and FP64 outputs can be classified. For a model
that batches (``max_batch_size > 0``) the first dim is the batch: each row is ranked on its own
and the result has shape ``[batch, min(k, row size)]``; otherwise the whole tensor is one row and
the result has shape ``[min(k, size)]``. Ties keep the lower index first.

The ranking is a plain function (:func:`top_k`); :func:`read_labels` runs at model load and
:func:`apply` finishes a response on the data plane.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from sluice.runtime import names
from sluice.runtime.errors import ConfigError, InvalidArgument, SluiceError
from sluice.runtime.types import InferResponse, RequestedOutput, Tensor

PARAMETER = "classification"

# Output name -> its labels, index by index (from the output's label_filename).
Labels = Mapping[str, Sequence[str]]

NO_LABELS: Labels = MappingProxyType({})

_CLASSIFIABLE = frozenset(
    {"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP32", "FP64"}
)


def requested_count(output: str, value: object) -> int:
    """The ``classification`` parameter of a requested output, checked: an integer >= 0 (0 asks
    for the raw tensor, as in Triton)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(
            f"output '{output}': parameter 'classification' must be an integer (the number of top "
            f"classes to return), got {value!r}"
        )
    if value < 0:
        raise InvalidArgument(f"output '{output}': parameter 'classification' must be >= 0, got {value}")
    return value


def top_k(data: np.ndarray, datatype: str, k: int, *, batched: bool, labels: Sequence[str] = ()) -> np.ndarray:
    """The top ``k`` entries of ``data`` as an object array of ``bytes`` (see the module doc).

    Raises :class:`InvalidArgument` for a datatype that cannot be ranked.
    """
    if datatype not in _CLASSIFIABLE:
        raise InvalidArgument(
            f"class result not available for output due to unsupported type '{datatype}'; "
            "allowed: UINT8-64, INT8-64, FP32 and FP64 outputs"
        )
    by_row = batched and data.ndim > 0
    rows = data.reshape(data.shape[0], int(np.prod(data.shape[1:]))) if by_row else data.reshape(1, data.size)
    width = rows.shape[1]
    count = min(k, width)
    key = rows
    if rows.dtype.kind == "f" and rows.size:
        key = np.where(np.isnan(rows), -np.inf, rows)  # NaN ranks last, not first
    # Descending and stable (lower index first among ties): sort the reversed rows ascending,
    # stably, then read the order backwards.
    order = np.argsort(key[:, ::-1], axis=1, kind="stable")[:, ::-1][:, :count]
    indexes = width - 1 - order
    scores = np.take_along_axis(rows, indexes, axis=1)
    as_text = _score_text(rows.dtype)
    out = np.empty(indexes.shape, dtype=np.object_)
    flat_out = out.reshape(-1)
    for position, (score, index) in enumerate(zip(scores.ravel().tolist(), indexes.ravel().tolist(), strict=True)):
        entry = f"{as_text(score)}:{index}"
        label = labels[index] if index < len(labels) else ""
        flat_out[position] = (f"{entry}:{label}" if label else entry).encode("utf-8")
    return out if by_row else out.reshape(count)


def _score_text(dtype: np.dtype):  # type: ignore[no-untyped-def]
    if dtype.kind == "f":
        return lambda score: "%f" % score  # noqa: UP031 - std::to_string is printf's %f
    return str


def apply(
    response: InferResponse, requested: Sequence[RequestedOutput], *, batched: bool, labels: Labels
) -> InferResponse | SluiceError:
    """``response`` with every output requested with ``classification: k > 0`` replaced by its
    top ``k`` (a new response: the one given may be held by the response cache)."""
    counts = {
        output.name: output.parameters[PARAMETER]
        for output in requested
        if output.parameters and output.parameters.get(PARAMETER)
    }
    if not counts:
        return response
    outputs: list[Tensor] = []
    for tensor in response.outputs:
        k = counts.get(tensor.name)
        if not k:
            outputs.append(tensor)
            continue
        try:
            classes = top_k(tensor.data, tensor.datatype, k, batched=batched, labels=labels.get(tensor.name, ()))
        except InvalidArgument as exc:
            return InvalidArgument(f"output '{tensor.name}': {exc}")
        outputs.append(Tensor(tensor.name, "BYTES", classes))
    return InferResponse(response.model_name, response.model_version, outputs, response.id, response.parameters)


def read_labels(config: mc.ModelConfig, model_dir: Path) -> Labels:
    """The labels of every output with a ``label_filename``, read from the model directory.

    Errors name the file as the config does (relative to the model directory), never the
    server's path.
    """
    labels: dict[str, tuple[str, ...]] = {}
    for index, output in enumerate(config.output):
        filename = output.label_filename
        if not filename:
            continue
        field = f"output[{index}].label_filename"
        problem = names.file_name_problem(filename)
        if problem is not None:
            raise ConfigError(
                f"output '{output.name}': label_filename {names.shown(filename)!r}: "
                f"{problem.replace('version directory', 'model directory')}; "
                "allowed: the name of a file in the model directory, one label per line",
                file=None,  # the config's: placed() adds its path and the field's line
                field=field,
            )
        try:
            text = (model_dir / filename).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(
                f"output '{output.name}': label file '{filename}' does not exist in the model directory "
                f"'{config.name}/'; allowed: a file next to config.pbtxt, one label per line",
                file=None,  # the config's: placed() adds its path and the field's line
                field=field,
            ) from None
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.reason if isinstance(exc, UnicodeDecodeError) else (exc.strerror or type(exc).__name__)
            raise ConfigError(
                f"output '{output.name}': cannot read label file '{filename}' in the model directory: {reason}",
                file=None,  # the config's: placed() adds its path and the field's line
                field=field,
            ) from None
        labels[output.name] = tuple(line.removesuffix("\r") for line in text.split("\n"))
    return labels or NO_LABELS
