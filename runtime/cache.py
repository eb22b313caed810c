"""Response cache: per model version, keyed by the request's input tensors, bounded in bytes (LRU).

Enabled by ``response_cache { enable: true }`` in a model's config (no server-level setup, unlike
Triton). The key is the inputs (name, datatype, shape and bytes); the requested outputs are not
part of it, so a gRPC request hits an entry an HTTP request stored, as in Triton. Only complete
responses (every output) of successful executions are stored; a hit is cut down to the outputs
the request asked for. Used by the data plane on the event loop only (no locks).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable

from sluice.runtime.types import InferRequest, InferResponse, Tensor


def cache_key(request: InferRequest) -> Hashable:
    parts = []
    for tensor in sorted(request.inputs, key=lambda t: t.name):
        data = tensor.data
        raw = tuple(data.ravel().tolist()) if tensor.datatype == "BYTES" else data.tobytes()
        parts.append((tensor.name, tensor.datatype, data.shape, raw))
    return tuple(parts)


def _size(key: Hashable, response: InferResponse) -> int:
    """Bytes an entry holds: its outputs and its key, which carries every input's bytes (a large
    input with a small output would otherwise slip past the bound)."""
    size = sum(int(t.data.nbytes) + 64 for t in response.outputs) + 128
    for _, _, _, raw in key:  # type: ignore[attr-defined]
        if isinstance(raw, bytes):
            size += len(raw) + 64
        else:  # BYTES elements
            size += sum(len(item) + 40 if isinstance(item, bytes | str) else 40 for item in raw) + 64
    return size


def _kept(tensor: Tensor) -> Tensor:
    """``tensor`` as the cache keeps it: its own array made read-only in place (a backend's fresh
    output, nobody else writes it), anything else (a view) as a read-only copy."""
    data = tensor.data
    if data.flags.owndata:
        data.flags.writeable = False
        return tensor
    copy = data.copy()
    copy.flags.writeable = False
    return Tensor(tensor.name, tensor.datatype, copy, dict(tensor.parameters))


class ResponseCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: collections.OrderedDict[Hashable, tuple[InferResponse, int]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable, request: InferRequest) -> InferResponse | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        stored = entry[0]
        outputs = stored.outputs
        if request.outputs:  # none listed (absent, or an empty list): every output, as on a miss
            wanted = {o.name for o in request.outputs}
            outputs = [t for t in outputs if t.name in wanted]
        return InferResponse(
            stored.model_name,
            stored.model_version,
            [Tensor(t.name, t.datatype, t.data, dict(t.parameters)) for t in outputs],
            request.id,
        )

    def put(self, key: Hashable, response: InferResponse, all_outputs: int) -> None:
        if len(response.outputs) != all_outputs or key in self._entries:
            return
        size = _size(key, response)
        if size > self.max_bytes:
            return
        # An output that is a view keeps what it views alive and shared: a slice of a whole batch's
        # output, or an input the model handed back, which may be a client's shared-memory region; one
        # that is writable may be written again (a model refilling its buffer, the next step of an
        # ensemble). The entry owns read-only copies: what it holds is what was answered, and stays so.
        response = dataclasses.replace(response, outputs=[_kept(t) for t in response.outputs])
        self._entries[key] = (response, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.bytes -= evicted
