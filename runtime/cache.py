"""Response cache: keyed by the request's input tensors, bounded in bytes (LRU).

Enabled by ``response_cache { enable: true }`` in a model's config. Without server-level setup each
model version has a cache of its own (``--response-cache-bytes``); with Triton's ``--cache-config
local,size=N`` (or ``--response-cache-byte-size N``) every such version takes a part of one cache of
N bytes shared by all (:meth:`ResponseCache.part`), as in Triton. The key is the inputs (name,
datatype, shape and bytes); the requested outputs are not
part of it, so a gRPC request hits an entry an HTTP request stored, as in Triton. Only complete
responses (every output) of successful executions are stored; a hit is cut down to the outputs
the request asked for. Used by the data plane on the event loop only (no locks).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable, Iterable, Sequence
from typing import Protocol

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
    size = sum(_output_size(t) + 64 for t in response.outputs) + 128
    for _, _, _, raw in key:  # type: ignore[attr-defined]
        if isinstance(raw, bytes):
            size += len(raw) + 64
        else:  # BYTES elements
            size += _elements_size(raw) + 64
    return size


def _output_size(tensor: Tensor) -> int:
    """An output's bytes: a BYTES tensor's ``nbytes`` counts only its pointers, not the elements."""
    if tensor.data.dtype == object:
        return int(tensor.data.nbytes) + _elements_size(tensor.data.ravel().tolist())
    return int(tensor.data.nbytes)


def _elements_size(items: Iterable[object]) -> int:
    return sum(len(item) + 40 if isinstance(item, bytes | str) else 40 for item in items)


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


def cache_config_bytes(entries: Sequence[str]) -> int:
    """The shared cache's size from Triton's ``--cache-config <cache>,<key>=<value>`` entries (pure).
    Only the ``local`` cache and its ``size`` (bytes) exist here; ValueError names what is wrong."""
    size: int | None = None
    for entry in entries:
        cache, _, setting = entry.partition(",")
        key, equals, value = setting.partition("=")
        if cache.strip() != "local":
            raise ValueError(f"{entry!r}: cache {cache.strip()!r} is not available; allowed: local,size=<bytes>")
        if not equals or key.strip() != "size":
            raise ValueError(f"{entry!r}: allowed: local,size=<bytes> (the local cache has no setting {key.strip()!r})")
        if not (value.strip().isascii() and value.strip().isdigit()) or int(value) <= 0:
            raise ValueError(f"{entry!r}: size {value.strip()!r} is not a positive number of bytes")
        size = int(value)
    if size is None:
        raise ValueError("no size: allowed: local,size=<bytes>")
    return size


class ModelCache(Protocol):
    """What the data plane uses of a model version's cache."""

    def get(self, key: Hashable, request: InferRequest) -> InferResponse | None: ...

    def put(self, key: Hashable, response: InferResponse, all_outputs: int) -> None: ...


class CachePart:
    """One model version's part of a shared :class:`ResponseCache`: its keys carry the version's
    owner token, so versions never read each other's entries."""

    def __init__(self, shared: ResponseCache, owner: Hashable) -> None:
        self.shared = shared
        self.owner = owner

    def get(self, key: Hashable, request: InferRequest) -> InferResponse | None:
        return self.shared.get((self.owner, key), request)

    def put(self, key: Hashable, response: InferResponse, all_outputs: int) -> None:
        self.shared.put((self.owner, key), response, all_outputs, size_of=key)

    def drop(self) -> None:
        """Forget this part's entries (its version closed: a reload of the same version number must
        not answer from the old one's)."""
        self.shared.drop(self.owner)


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

    def part(self, owner: Hashable) -> CachePart:
        return CachePart(self, owner)

    def drop(self, owner: Hashable) -> None:
        """Remove the entries of a :class:`CachePart` (keys ``(owner, key)``)."""
        gone = [key for key in self._entries if isinstance(key, tuple) and len(key) == 2 and key[0] == owner]
        for key in gone:
            _, size = self._entries.pop(key)
            self.bytes -= size

    def put(self, key: Hashable, response: InferResponse, all_outputs: int, *, size_of: Hashable = None) -> None:
        """Store ``response`` under ``key``; ``size_of``: the input key its size is counted from (a
        part's key wraps it)."""
        if len(response.outputs) != all_outputs or key in self._entries:
            return
        size = _size(key if size_of is None else size_of, response)
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
