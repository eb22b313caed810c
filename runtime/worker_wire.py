"""What crosses between a protocol worker process and the engine (frontend_workers.py), as plain data.

Messages are tuples, pickled (both ends are this server's own processes, started from the same
installation) and framed by a 4-byte big-endian length. Inference requests and responses travel as
tuples of their fields, never as the domain objects, so the engine rebuilds them with one
constructor call each. A tensor's data is its numpy array pickled in the frame (small tensors:
the common case where the protocol binds) or, from ``ARENA_MIN_BYTES`` on, a reference into the
sender's shared-memory arena (:class:`Arena`), copied out by the receiver.

Pure: no sockets here; ``Framer`` splits a byte stream into messages and ``frame`` makes one.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np

from sluice.runtime import errors
from sluice.runtime.errors import SluiceError
from sluice.runtime.types import InferRequest, InferResponse, RequestedOutput, Tensor

_LENGTH = struct.Struct(">I")
MAX_FRAME = 1 << 31
"""Largest message: a frame's length field is 4 bytes (tensors this large go through the arena)."""

ARENA_MIN_BYTES = 64 * 1024
"""Tensors this large cross through the shared-memory arena when it has room (docs/frontend-workers.md
has the measurement); smaller ones are pickled in the frame, which costs less than an allocation."""


def frame(message: tuple) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(payload)) + payload


class Framer:
    """Splits received bytes into messages (``feed`` yields each complete one)."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> Iterator[Any]:
        buffer = self._buffer
        if not buffer and len(data) >= 4:
            # the usual case: whole messages in one read, no copy into the buffer
            (n,) = _LENGTH.unpack_from(data, 0)
            if n + 4 == len(data):
                yield pickle.loads(memoryview(data)[4:])
                return
        buffer += data
        start = 0
        end = len(buffer)
        with memoryview(buffer) as view:
            while end - start >= 4:
                (n,) = _LENGTH.unpack_from(view, start)
                if end - start - 4 < n:
                    break
                yield pickle.loads(view[start + 4 : start + 4 + n])
                start += 4 + n
        del buffer[:start]


# -- the arena: large tensors in shared memory ------------------------------------------------------


class Allocator:
    """First-fit allocation of byte ranges of an arena of ``size`` bytes (pure bookkeeping).

    ``allocate`` returns an offset or None when no free range is large enough (the caller then
    sends the tensor in the frame); ``free`` returns a range. Ranges are 64-byte aligned."""

    __slots__ = ("_free", "_used", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, length), sorted, coalesced
        self._used: dict[int, int] = {}

    def allocate(self, nbytes: int) -> int | None:
        need = max(64, (nbytes + 63) & ~63)
        for i, (offset, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (offset + need, length - need)
                self._used[offset] = need
                return offset
        return None

    def free(self, offset: int) -> None:
        length = self._used.pop(offset)
        free = self._free
        lo, hi = 0, len(free)
        while lo < hi:
            mid = (lo + hi) // 2
            if free[mid][0] < offset:
                lo = mid + 1
            else:
                hi = mid
        free.insert(lo, (offset, length))
        # coalesce with the next, then with the previous range
        if lo + 1 < len(free) and offset + length == free[lo + 1][0]:
            free[lo] = (offset, length + free[lo + 1][1])
            del free[lo + 1]
        if lo > 0 and free[lo - 1][0] + free[lo - 1][1] == offset:
            free[lo - 1] = (free[lo - 1][0], free[lo - 1][1] + free[lo][1])
            del free[lo]

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())


class Arena:
    """A sender's shared-memory arena: ``put`` copies an array in and returns its reference (or
    None: too small, an object array, or no room); the receiver's ``take`` copies it out; the
    sender ``release``s the range once the receiver said it took it."""

    def __init__(self, buffer: memoryview, min_bytes: int = ARENA_MIN_BYTES) -> None:
        self._buffer = buffer
        self._allocator = Allocator(len(buffer))
        self._min = min_bytes

    def put(self, array: np.ndarray) -> tuple | None:
        nbytes = array.nbytes
        if nbytes < self._min or array.dtype.hasobject:
            return None
        offset = self._allocator.allocate(nbytes)
        if offset is None:
            return None
        target = np.ndarray(array.shape, array.dtype, buffer=self._buffer, offset=offset)
        target[...] = array
        return (offset, array.dtype.str, array.shape)

    def release(self, offset: int) -> None:
        self._allocator.free(offset)

    @property
    def used_bytes(self) -> int:
        return self._allocator.used_bytes


def take(buffer: memoryview, ref: tuple) -> np.ndarray:
    """The array ``ref`` names in the peer's arena ``buffer``, copied out (the peer reuses the range)."""
    offset, dtype, shape = ref
    return np.ndarray(shape, np.dtype(dtype), buffer=buffer, offset=offset).copy()


# -- inference requests and responses ----------------------------------------------------------------


def _data(array: np.ndarray, arena: Arena | None, refs: list[int]) -> Any:
    if arena is not None:
        ref = arena.put(array)
        if ref is not None:
            refs.append(ref[0])
            return ref
    return array


def _array(data: Any, peer: memoryview | None, taken: list[int] | None = None) -> np.ndarray:
    if type(data) is tuple:
        assert peer is not None, "an arena reference from a peer without an arena"
        if taken is not None:
            taken.append(data[0])
        return take(peer, data)
    return data


def request_state(request: InferRequest, arena: Arena | None = None, refs: list[int] | None = None) -> tuple:
    """``request`` as a tuple (its inputs' data inline or in ``arena``; the offsets used are
    appended to ``refs``). The cancel token, responder and trace stay behind."""
    used = refs if refs is not None else []
    outputs = request.outputs
    return (
        request.model_name,
        request.model_version,
        [(t.name, t.datatype, _data(t.data, arena, used), t.parameters) for t in request.inputs],
        None if outputs is None else [(o.name, o.binary, o.parameters) for o in outputs],
        request.id,
        request.parameters,
        request.caller,
    )


def request_from_state(state: tuple, peer: memoryview | None = None) -> InferRequest:
    """The request ``state`` describes (arena data copied out of ``peer``: the sender frees those
    ranges when the request is answered)."""
    name, version, inputs, outputs, id_, parameters, caller = state
    return InferRequest(
        name,
        version,
        [Tensor(n, d, _array(data, peer), p) for n, d, data, p in inputs],
        None if outputs is None else [RequestedOutput(n, b, p) for n, b, p in outputs],
        id=id_,
        parameters=parameters,
        caller=caller,
    )


def outcome_state(
    outcome: InferResponse | SluiceError, arena: Arena | None = None, refs: list[int] | None = None
) -> tuple:
    """A response (``("ok", ...)``) or a client-facing error (``("error", ...)``) as a tuple."""
    if isinstance(outcome, SluiceError):
        return error_state(outcome)
    used = refs if refs is not None else []
    return (
        "ok",
        outcome.model_name,
        outcome.model_version,
        [(t.name, t.datatype, _data(t.data, arena, used), t.parameters) for t in outcome.outputs],
        outcome.id,
        outcome.parameters,
    )


def outcome_from_state(
    state: tuple, peer: memoryview | None = None, taken: list[int] | None = None
) -> InferResponse | SluiceError:
    """The outcome ``state`` describes; the offsets of arena data copied out of ``peer`` are
    appended to ``taken`` (for the sender to release)."""
    if state[0] == "error":
        return error_from_state(state)
    _, name, version, outputs, id_, parameters = state
    return InferResponse(
        name, version, [Tensor(n, d, _array(data, peer, taken), p) for n, d, data, p in outputs], id_, parameters
    )


def error_state(exc: SluiceError) -> tuple:
    """An error as its class name, message and HTTP status: the same class (and so the same gRPC
    code) and the same words on the other side, whatever its constructor takes."""
    return ("error", type(exc).__name__, exc.message, exc.http_status)


def error_from_state(state: tuple) -> SluiceError:
    _, kind, message, status = state
    cls = getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, SluiceError)):
        cls = SluiceError
    exc = cls.__new__(cls)
    SluiceError.__init__(exc, message)
    if exc.http_status != status:
        exc.http_status = status
    return exc
