"""What crosses between a protocol worker process and the engine (frontend_workers.py), as bytes.

A frame is an 8-byte header (the frame's length, a multiple of 8, and its metadata's length), the
metadata (a pickled tuple of plain values: str, bytes, int, float, bool, None, tuple, list, dict),
then the tensors' data, raw, each at an 8-byte aligned offset::

    <u32 frame bytes> <u32 metadata bytes> <metadata> <pad> <tensor 0 data> <pad> <tensor 1 data> ...

The metadata's first item names the message. An ``infer`` frame holds the inference requests a
worker sent in one event-loop turn, a ``done`` frame the responses (or errors) the engine sent in
one (typically a batch's). Each tensor is described by name, datatype, numpy dtype, shape,
parameters and where its data is: so many bytes in the frame (numbers as they lie in memory, BYTES
in Triton's length-prefixed form), a range of the sender's shared-memory arena (:class:`Arena`,
from ``ARENA_MIN_BYTES`` on), or, for an output no raw form fits (an object array of ``str``,
say), the array pickled in the metadata.
The receiver's tensors are numpy views of the received bytes (no copy). Arena data is copied out by
the worker (the engine's outputs: it tells the engine ``release`` at once); the engine lends the
worker's arena range to the request instead (:class:`Lease`): the range is the request's until the
last array over it is gone, whoever keeps it (a batch, a model that holds its inputs), and only then
does the engine tell the worker it is ``freed``. Pickling numpy arrays (the previous form) cost ~5 us
a tensor; a tuple of plain values ~0.5 us (docs/frontend-workers.md).

The engine reads frames from its workers with an unpickler that refuses every class (workers send
plain values only), so a corrupt frame is a :class:`WireError`, never code run or a crash: the engine
closes that worker's link and restarts the worker. Workers trust the engine (it sends their
settings). The engine trusts a worker not to write into an arena range it sent until it is freed
(the ranges it names are checked: bounds, alignment, no overlap with a range lent now).

Pure: no sockets here; ``Framer`` splits a byte stream into messages and the ``encode_*`` functions
make the frames (lists of bytes-like pieces, written with one ``writelines``/``join``).
"""

from __future__ import annotations

import bisect
import io
import math
import pickle
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from sluice.runtime import errors
from sluice.runtime.errors import SluiceError
from sluice.runtime.tensor_bytes import bytes_elements
from sluice.runtime.types import InferRequest, InferResponse, RequestedOutput, Tensor, names_region, placeholder

_HEAD = struct.Struct("<II")
_PADS = tuple(bytes(n) for n in range(8))
MAX_FRAME = (1 << 32) - 8
"""Largest frame: the length field is 4 bytes (tensors this large go through the arena)."""

ARENA_MIN_BYTES = 64 * 1024
"""Tensors this large cross through the shared-memory arena when it has room (docs/frontend-workers.md
has the measurement); smaller ones go in the frame."""

_RAW_KINDS = frozenset("biufc")  # bool, signed, unsigned, float, complex: their memory is their value
_BYTES = "|O"  # the dtype field of a BYTES tensor sent in the length-prefixed form


class WireError(Exception):
    """A frame that cannot be decoded (or a tensor that cannot be encoded): the link is closed."""


Piece = bytes | memoryview | np.ndarray
"""What a frame is made of: ``b"".join`` and ``transport.writelines`` take each as bytes."""


# -- encoding -------------------------------------------------------------------------------------------


def _frame(meta: tuple, raw: list[Any]) -> list[Any]:
    """``meta`` pickled, then each of ``raw`` (bytes-like) 8-byte aligned: the pieces of one frame."""
    head = pickle.dumps(meta, pickle.HIGHEST_PROTOCOL)
    size = 8 + len(head)
    pieces: list[Any] = [b"", head]
    for data in raw:
        pad = -size & 7
        if pad:
            pieces.append(_PADS[pad])
            size += pad
        pieces.append(data)
        size += data.nbytes if type(data) is np.ndarray else len(data)
    pad = -size & 7
    if pad:
        pieces.append(_PADS[pad])
        size += pad
    if size > MAX_FRAME:
        raise WireError(f"a message of {size} bytes is over the link's limit of {MAX_FRAME} bytes")
    pieces[0] = _HEAD.pack(size, len(head))
    return pieces


def encode(message: tuple) -> list[Any]:
    """A message without tensors (everything but inference requests and responses)."""
    return _frame(message, [])


def _bytes_payload(array: np.ndarray) -> bytes | None:
    """A BYTES array in Triton's length-prefixed form; None when an element is not ``bytes``."""
    parts = []
    for item in array.ravel():
        if type(item) is not bytes:
            return None
        parts.append(len(item).to_bytes(4, "little"))
        parts.append(item)
    return b"".join(parts)


def _tensor(tensor: Tensor, raw: list[Any], arena: Arena | None, refs: list[int] | None, pickled_ok: bool) -> tuple:
    data = tensor.data
    dtype = data.dtype
    if tensor.parameters and names_region(tensor.parameters):
        # its data is in a shared-memory region (a placeholder here): only its description crosses
        return (tensor.name, tensor.datatype, dtype.str, data.shape, tensor.parameters, None)
    if arena is not None and data.nbytes >= arena.min_bytes:
        ref = arena.put(data)
        if ref is not None:
            if refs is not None:
                refs.append(ref[0])
            return (tensor.name, tensor.datatype, ref[1], ref[2], tensor.parameters, (ref[0],))
    if dtype.kind in _RAW_KINDS:
        if not data.flags.c_contiguous:
            data = np.ascontiguousarray(data)
        raw.append(data)
        return (tensor.name, tensor.datatype, dtype.str, data.shape, tensor.parameters, data.nbytes)
    if dtype.hasobject:
        payload = _bytes_payload(data)
        if payload is not None:
            raw.append(payload)
            return (tensor.name, tensor.datatype, _BYTES, data.shape, tensor.parameters, len(payload))
    if not pickled_ok:
        raise WireError(f"tensor '{tensor.name}' ({dtype}) has no raw form to send to the engine")
    return (tensor.name, tensor.datatype, dtype.str, data.shape, tensor.parameters, data)


def encode_requests(items: list[tuple[int, InferRequest, list[int]]], arena: Arena | None = None) -> list[Any]:
    """One ``infer`` frame for ``items``: (request id, request, the list to which the offsets of its
    inputs put in ``arena`` are appended). The cancel token, responder and trace stay behind."""
    raw: list[Any] = []
    entries = []
    for rid, request, refs in items:
        outputs = request.outputs
        entries.append(
            (
                rid,
                request.model_name,
                request.model_version,
                [_tensor(t, raw, arena, refs, False) for t in request.inputs],
                None if outputs is None else [(o.name, o.binary, o.parameters) for o in outputs],
                request.id,
                request.parameters,
                request.caller,
            )
        )
    return _frame(("infer", entries), raw)


def encode_request(
    rid: int, request: InferRequest, arena: Arena | None = None, refs: list[int] | None = None
) -> list[Any]:
    """An ``infer`` frame holding ``request`` alone."""
    return encode_requests([(rid, request, [] if refs is None else refs)], arena)


def encode_outcomes(
    items: list[tuple[int, InferResponse | SluiceError]], arena: Arena | None = None, refs: list[int] | None = None
) -> list[Any]:
    """One ``done`` frame for ``items``: (request id, response or client-facing error); the offsets
    of outputs put in ``arena`` are appended to ``refs``."""
    raw: list[Any] = []
    entries: list[tuple] = []
    for rid, outcome in items:
        if isinstance(outcome, SluiceError):
            entries.append((rid, type(outcome).__name__, outcome.message, outcome.http_status))
            continue
        entries.append(
            (
                rid,
                outcome.model_name,
                outcome.model_version,
                [_tensor(t, raw, arena, refs, True) for t in outcome.outputs],
                outcome.id,
                outcome.parameters,
            )
        )
    return _frame(("done", entries), raw)


def encode_outcome(
    rid: int, outcome: InferResponse | SluiceError, arena: Arena | None = None, refs: list[int] | None = None
) -> list[Any]:
    """A ``done`` frame holding one response or error."""
    return encode_outcomes([(rid, outcome)], arena, refs)


def frame(message: tuple) -> bytes:
    """``encode`` joined into one bytes object (tests, and messages sent once)."""
    return b"".join(encode(message))


# -- decoding -------------------------------------------------------------------------------------------


class _PlainValues(pickle.Unpickler):
    """Unpickles plain values only: a frame that names any class is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"the frame names {module}.{name}; only plain values may cross")


_DTYPES: dict[str, np.dtype] = {}


def _dtype(text: str) -> np.dtype:
    dtype = _DTYPES.get(text)
    if dtype is None:
        dtype = np.dtype(text)
        if dtype.kind not in _RAW_KINDS or dtype.str != text:
            raise WireError(f"dtype {text!r} has no raw form")
        _DTYPES[text] = dtype
    return dtype


class Lease:
    """A range of the peer's arena lent to the arrays made over it (``np.asarray(lease)``): numpy
    keeps the lease as the base of every array, slice and view made from it, so the lease lives
    exactly as long as the last of them. When it goes, ``freed`` gets the range's offset, in
    whichever thread dropped that array (``freed`` must be safe there: ``list.append`` is)."""

    __slots__ = ("__array_interface__", "_freed", "_memory", "_offset")

    def __init__(
        self, memory: memoryview, interface: dict[str, Any], offset: int, freed: Callable[[int], object]
    ) -> None:
        self._memory = memory  # keeps the mapping alive as long as the arrays over it
        self.__array_interface__ = interface
        self._offset = offset
        self._freed = freed

    def __del__(self) -> None:
        self._freed(self._offset)

    def disarm(self) -> None:
        """Never lent after all (no array was made over it): nothing to free."""
        self._freed = _not_lent


def _not_lent(offset: int) -> None:
    return None


ALIGNMENT = 64
"""Arena ranges start at multiples of this (``Allocator``); the engine refuses any other offset."""


class LentRanges:
    """The ranges of a peer's arena lent out now (the engine's side, used on its loop): a range a
    worker names while it, or one it overlaps, is still lent is refused, so a worker's bug cannot
    make two requests share memory. The engine trusts a worker not to write into a range it sent
    until it hears the range is ``freed`` (the worker is this build, started by the engine)."""

    __slots__ = ("_ends", "_starts")

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, offset: int, nbytes: int) -> bool:
        """Lend ``nbytes`` from ``offset``; False when that overlaps a range lent now."""
        end = offset + max(nbytes, 1)
        starts = self._starts
        i = bisect.bisect_right(starts, offset)
        if (i and self._ends[i - 1] > offset) or (i < len(starts) and starts[i] < end):
            return False
        starts.insert(i, offset)
        self._ends.insert(i, end)
        return True

    def remove(self, offset: int) -> None:
        starts = self._starts
        i = bisect.bisect_left(starts, offset)
        if i < len(starts) and starts[i] == offset:
            del starts[i]
            del self._ends[i]

    def __len__(self) -> int:
        return len(self._starts)


class Framer:
    """Splits received bytes into messages: ``feed`` returns every message completed by ``data``.

    Each request of an ``infer`` frame comes out as ``("infer", rid, InferRequest)``, each outcome
    of a ``done`` frame as ``("done", rid, InferResponse | SluiceError, taken)`` (``taken``: the
    offsets of ``peer`` arena data copied out, for the sender to release), everything else as the
    tuple sent. ``peer``: the sender's arena; ``trusted``: allow pickled classes (the worker reading the engine). Raises
    :class:`WireError` for a frame that is not one.

    ``freed`` (the engine's side): a request's inputs in ``peer`` are not copied but lent
    (:class:`Lease`, read-only views of the arena), and ``freed`` gets each range's offset once
    nothing refers to it any more; the sender must not reuse the range before it hears so.
    ``lent``: the ranges lent now (their owner removes a range when it tells the sender it is
    freed); a range overlapping one of them is refused."""

    __slots__ = ("_address", "_freed", "_lent", "_peer", "_pending", "_trusted")

    def __init__(
        self,
        peer: memoryview | None = None,
        trusted: bool = False,
        freed: Callable[[int], object] | None = None,
        lent: LentRanges | None = None,
    ) -> None:
        self._pending = bytearray()  # the start of a frame not yet whole
        self._peer = peer
        self._trusted = trusted
        self._freed = freed if peer is not None else None
        self._lent = lent
        # where the arena starts in this process's memory (views are made by address, so their lease
        # can be their base: numpy would make a buffer's memoryview the base instead)
        self._address = 0 if self._freed is None else np.frombuffer(peer, np.uint8).ctypes.data  # type: ignore[arg-type]

    def feed(self, data: bytes) -> list[tuple]:
        pending = self._pending
        if pending:
            pending += data
            whole = _whole(pending)
            if not whole:
                return []
            chunk = bytes(pending[:whole])  # tensors become views of it: it must never change
            del pending[:whole]
        else:
            chunk = data
        end = len(chunk)
        stream = io.BytesIO(chunk)  # shares ``chunk``; one unpickler a frame (a memo must not carry over)
        unpickler = pickle.Unpickler if self._trusted else _PlainValues
        messages: list[tuple] = []
        pos = 0
        while end - pos >= 8:
            size, meta_size = _HEAD.unpack_from(chunk, pos)
            if size < 8 or size & 7 or meta_size > size - 8:
                raise WireError(f"a frame header says {size} bytes with {meta_size} of metadata: not a frame")
            if pos + size > end:
                break
            self._message(chunk, stream, unpickler, pos, size, meta_size, messages)
            pos += size
        if pos < end:
            pending += memoryview(chunk)[pos:]
        return messages

    def _message(
        self,
        chunk: bytes,
        stream: io.BytesIO,
        unpickler: type[pickle.Unpickler],
        pos: int,
        size: int,
        meta_size: int,
        out: list[tuple],
    ) -> None:
        try:
            stream.seek(pos + 8)
            meta = unpickler(stream).load()
            if stream.tell() != pos + 8 + meta_size:
                raise WireError("the metadata's length is not the header's")
            if type(meta) is not tuple or not meta or type(meta[0]) is not str:
                raise WireError("the metadata is not a message")
            kind = meta[0]
            cursor = pos + 8 + meta_size
            cursor += -cursor & 7  # the first tensor's data
            if kind == "infer":
                self._requests(meta[1], chunk, cursor, pos + size, out)
            elif kind == "done":
                self._responses(meta[1], chunk, cursor, pos + size, out)
            else:
                out.append(meta)
        except WireError:
            raise
        except Exception as exc:
            raise WireError(f"a {size}-byte frame cannot be decoded: {type(exc).__name__}: {exc}") from None

    def _requests(self, entries: list, chunk: bytes, cursor: int, limit: int, out: list[tuple]) -> None:
        for rid, name, version, inputs, outputs, id_, parameters, caller in entries:
            if not (type(name) is type(version) is type(id_) is type(caller) is str and type(parameters) is dict):
                raise WireError("a request's model, version, id and caller are strings and its parameters a dict")
            tensors: list[Tensor] = []
            cursor = self._tensors(inputs, chunk, cursor, limit, None, tensors, self._freed)
            request = InferRequest(
                name,
                version,
                tensors,
                None if outputs is None else [RequestedOutput(n, b, p) for n, b, p in outputs],
                id=id_,
                parameters=parameters,
                caller=caller,
            )
            out.append(("infer", rid, request))

    def _responses(self, entries: list, chunk: bytes, cursor: int, limit: int, out: list[tuple]) -> None:
        for entry in entries:
            if len(entry) == 4:  # an error: class name, message, HTTP status
                out.append(("done", entry[0], error_from_state(("error", *entry[1:])), None))
                continue
            rid, name, version, outputs, id_, parameters = entry
            taken: list[int] = []
            tensors: list[Tensor] = []
            cursor = self._tensors(outputs, chunk, cursor, limit, taken, tensors)
            out.append(("done", rid, InferResponse(name, version, tensors, id_, parameters), taken))

    def _tensors(
        self,
        entries: list,
        chunk: bytes,
        cursor: int,
        limit: int,
        taken: list[int] | None,
        tensors: list[Tensor],
        freed: Callable[[int], object] | None = None,
    ) -> int:
        """Append the tensors ``entries`` describe to ``tensors``; returns where the next one's data is.
        Arena data is lent when ``freed`` is given, else copied out (its offset appended to ``taken``)."""
        for name, datatype, dtype, shape, parameters, where in entries:
            kind = type(where)
            if kind is int:
                end = cursor + where
                if where < 0 or end > limit:
                    raise WireError(f"tensor '{name}' claims {where} bytes, past the end of its frame")
                if dtype == _BYTES:
                    array = bytes_elements(name, memoryview(chunk)[cursor:end], math.prod(shape)).reshape(shape)
                else:
                    numpy_dtype = _dtype(dtype)
                    if math.prod(shape) * numpy_dtype.itemsize != where:
                        raise WireError(f"tensor '{name}' of shape {shape} ({dtype}) is not {where} bytes")
                    array = np.ndarray(shape, numpy_dtype, chunk, cursor)
                cursor = end + (-end & 7)
            elif kind is tuple:
                if self._peer is None:
                    raise WireError(f"tensor '{name}' is in an arena this link does not have")
                if freed is not None:
                    array = self._lend(name, where, dtype, shape, freed)
                else:
                    array = take(self._peer, (where[0], dtype, shape))
                    if taken is not None:
                        taken.append(where[0])
            elif where is None and names_region(parameters):  # in a shared-memory region: bound later
                array = placeholder(datatype, tuple(shape))
            elif self._trusted and kind is np.ndarray:
                array = where
            else:
                raise WireError(f"tensor '{name}' has no data")
            tensors.append(Tensor(name, datatype, array, parameters))
        return cursor

    def _lend(
        self, name: str, where: tuple, dtype: str, shape: Any, freed: Callable[[int], object]
    ) -> np.ndarray:
        """A read-only view of the peer's arena range ``where`` names, lent until it is gone."""
        peer = self._peer
        assert peer is not None
        numpy_dtype = _dtype(dtype)
        offset = where[0] if len(where) == 1 else None
        if type(offset) is not int or type(shape) is not tuple or not all(type(n) is int and n >= 0 for n in shape):
            raise WireError(f"tensor '{name}' names an arena range {where!r} of shape {shape!r}: not one")
        nbytes = math.prod(shape) * numpy_dtype.itemsize
        if offset < 0 or offset + nbytes > len(peer):
            raise WireError(f"tensor '{name}' claims {nbytes} bytes at {offset} of an arena of {len(peer)}")
        if offset % ALIGNMENT:
            raise WireError(f"tensor '{name}' is at arena offset {offset}: not a multiple of {ALIGNMENT}")
        lent = self._lent
        if lent is not None and not lent.add(offset, nbytes):
            raise WireError(f"tensor '{name}' names arena bytes {offset} to {offset + nbytes}, lent to a request now")
        interface = {"data": (self._address + offset, True), "shape": shape, "typestr": dtype, "version": 3}
        lease = Lease(peer, interface, offset, freed)
        try:
            return np.asarray(lease)
        except Exception as exc:  # numpy's own limits (dimensions, sizes): no array, nothing lent
            lease.disarm()
            if lent is not None:
                lent.remove(offset)
            raise WireError(f"tensor '{name}' of shape {shape!r} cannot be made: {exc}") from None


def _whole(buffer: bytearray) -> int:
    """How many bytes of ``buffer`` are whole frames (0: not even the first)."""
    pos = 0
    end = len(buffer)
    while end - pos >= 8:
        (size,) = struct.unpack_from("<I", buffer, pos)
        if size < 8 or size & 7:
            raise WireError(f"a frame header says {size} bytes: not a frame")
        if pos + size > end:
            break
        pos += size
    return pos


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
    None: too small, an object array, or no room); the receiver ``take``s it (a copy) or lends it
    (``Framer``'s ``freed``: a view); the sender ``release``s the range once the receiver said it
    took it or freed it."""

    def __init__(self, buffer: memoryview, min_bytes: int = ARENA_MIN_BYTES) -> None:
        self._buffer = buffer
        self._allocator = Allocator(len(buffer))
        self.min_bytes = min_bytes

    def put(self, array: np.ndarray) -> tuple | None:
        nbytes = array.nbytes
        if nbytes < self.min_bytes or array.dtype.hasobject:
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


# -- errors ---------------------------------------------------------------------------------------------


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
