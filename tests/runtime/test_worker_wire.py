"""The link between protocol workers and the engine (runtime/worker_wire.py): frames, round trips,
corrupt input; and the Link (frontend_workers.py) closing on a corrupt frame."""

from __future__ import annotations

import asyncio
import mmap
import pickle
import socket
import struct
import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from sluice.runtime import errors, worker_wire
from sluice.runtime.frontend_workers import EngineSide, Link, RemotePlane
from sluice.runtime.types import DATATYPES, InferRequest, InferResponse, RequestedOutput, Tensor, numpy_dtype

WireError = worker_wire.WireError


def joined(pieces: list[Any]) -> bytes:
    return b"".join(pieces)


def feed_in_cuts(framer: worker_wire.Framer, stream: bytes, cuts: list[int]) -> list[tuple]:
    """Feed ``stream`` cut at ``cuts`` (positions), as reads from a socket would."""
    out: list[tuple] = []
    start = 0
    for cut in [*sorted({c for c in cuts if 0 < c < len(stream)}), len(stream)]:
        out.extend(framer.feed(stream[start:cut]))
        start = cut
    return out


# -- strategies -------------------------------------------------------------------------------------

names = st.text(min_size=1, max_size=12)
plain = st.dictionaries(
    st.text(max_size=8), st.one_of(st.booleans(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=8)), max_size=2
)
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)


@st.composite
def tensors(draw: st.DrawFn) -> Tensor:
    datatype = draw(st.sampled_from(DATATYPES))
    shape = draw(shapes)
    if datatype == "BYTES":
        items = draw(st.lists(st.binary(max_size=10), min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
        data = np.empty(len(items), dtype=object)
        data[:] = items
        data = data.reshape(shape)
    else:  # every bit pattern, NaNs and BF16's included (BF16 is uint16 bit patterns)
        dtype = numpy_dtype(datatype)
        raw = draw(
            st.binary(min_size=int(np.prod(shape)) * dtype.itemsize, max_size=int(np.prod(shape)) * dtype.itemsize)
        )
        data = np.frombuffer(raw, dtype.newbyteorder("=") if dtype != np.bool_ else np.uint8).reshape(shape)
        data = data.astype(np.bool_) if dtype == np.bool_ else data.copy()
    return Tensor(draw(names), datatype, data, draw(plain))


@st.composite
def requests(draw: st.DrawFn) -> InferRequest:
    outputs = draw(
        st.none() | st.lists(st.builds(RequestedOutput, names, st.sampled_from([None, True, False]), plain), max_size=2)
    )
    return InferRequest(
        draw(names),
        draw(st.sampled_from(["", "1", "12"])),
        draw(st.lists(tensors(), max_size=3)),
        outputs,
        id=draw(st.text(max_size=8)),
        parameters=draw(plain),
        caller=draw(st.text(max_size=8)),
    )


def assert_same_tensors(got: list[Tensor], sent: list[Tensor]) -> None:
    assert [(t.name, t.datatype, t.parameters, t.data.shape, t.data.dtype) for t in got] == [
        (t.name, t.datatype, t.parameters, t.data.shape, t.data.dtype) for t in sent
    ]
    for g, s in zip(got, sent, strict=True):
        if s.data.dtype.hasobject:
            assert g.data.tolist() == s.data.tolist()
        else:
            assert g.data.tobytes() == s.data.tobytes()  # bit for bit: NaN payloads, BF16 patterns


def arena(size: int = 1 << 20) -> tuple[worker_wire.Arena, memoryview]:
    memory = memoryview(mmap.mmap(-1, size))
    return worker_wire.Arena(memory, min_bytes=64), memory


# -- round trips ------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sent=st.lists(requests(), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 4000), max_size=6),
    shm=st.booleans(),
)
def test_requests_round_trip_whatever_the_reads(sent: list[InferRequest], cuts: list[int], shm: bool) -> None:
    sender, memory = arena() if shm else (None, None)
    refs: list[int] = []
    freed: list[int] = []
    stream = b"".join(joined(worker_wire.encode_request(rid, r, sender, refs)) for rid, r in enumerate(sent))
    # the engine's framer: plain values only, arena inputs lent
    got = feed_in_cuts(worker_wire.Framer(memory, freed=freed.append), stream, cuts)
    assert [(m[0], m[1]) for m in got] == [("infer", rid) for rid in range(len(sent))]
    for (_, _, back), request in zip(got, sent, strict=True):
        assert (back.model_name, back.model_version, back.id, back.parameters, back.caller) == (
            request.model_name,
            request.model_version,
            request.id,
            request.parameters,
            request.caller,
        )
        assert_same_tensors(back.inputs, request.inputs)
        if request.outputs is None:
            assert back.outputs is None
        else:
            assert back.outputs == request.outputs
    if sender is not None:
        assert freed == []  # lent while the requests live
        del got, back, request
        assert sorted(freed) == sorted(refs)  # each range freed once, when its last array went
        for offset in freed:
            sender.release(offset)
        assert sender.used_bytes == 0


def _lent(shape: tuple[int, ...] = (50, 100)) -> tuple[InferRequest, np.ndarray, list[int], list[int], memoryview]:
    """A request whose input crossed through the arena, as the engine reads it: (request, the input
    sent, the arena offsets used, the list ``freed`` appends to, the arena)."""
    sender, memory = arena()
    sent = np.random.default_rng(3).random(shape, dtype=np.float32)
    refs: list[int] = []
    frame = joined(worker_wire.encode_request(1, InferRequest("m", "", [Tensor("x", "FP32", sent)]), sender, refs))
    freed: list[int] = []
    [(_, _, request)] = worker_wire.Framer(memory, freed=freed.append).feed(frame)
    return request, sent, refs, freed, memory


def test_the_engine_lends_arena_inputs_until_their_last_view_is_gone() -> None:
    request, sent, refs, freed, memory = _lent()
    data = request.inputs[0].data
    assert len(refs) == 1 and data.tobytes() == sent.tobytes()
    assert np.shares_memory(data, np.frombuffer(memory, np.uint8))  # a view of the arena: no copy
    assert not data.flags.writeable and data.flags.c_contiguous and data.flags.aligned
    with pytest.raises(ValueError, match="read-only"):
        data[0, 0] = 1.0
    # whatever a batch or a model makes of it keeps the range: slices, reshapes, dtype views, buffers
    row, every_7th, as_bytes = data[3], data.reshape(-1)[::7], data.view(np.uint8)
    exported = memoryview(data)
    del request, data
    assert freed == []
    del row, every_7th
    assert freed == []
    np.testing.assert_array_equal(np.frombuffer(exported, np.float32), sent.reshape(-1))
    del exported
    assert freed == []
    del as_bytes
    assert freed == refs  # once, when the last went


def test_a_lent_range_dropped_in_another_thread_is_freed_there() -> None:
    request, _, refs, freed, _ = _lent()
    holder = [request]
    del request
    thread = threading.Thread(target=holder.clear)  # as a model's thread drops the batch it ran
    thread.start()
    thread.join()
    assert freed == refs


@pytest.mark.parametrize(
    ("where", "dtype", "shape", "problem"),
    [
        ((1 << 40,), "<f4", (1,), "claims 4 bytes at 1099511627776 of an arena of 1048576"),
        ((-8,), "<f4", (1,), "claims 4 bytes at -8"),
        (((1 << 20) - 4,), "<f4", (2,), "claims 8 bytes at 1048572 of an arena of 1048576"),
        ((0,), "<f4", (2, -1), "names an arena range \\(0,\\) of shape \\(2, -1\\): not one"),
        ((0,), "<f4", [2], "of shape \\[2\\]: not one"),
        ((0, 4), "<f4", (1,), "names an arena range \\(0, 4\\)"),
        (("0",), "<f4", (1,), "names an arena range"),
        ((0,), "|O", (1,), "no raw form"),
        ((0,), "<f8", (1 << 62,), "claims 36893488147419103232 bytes at 0"),
        ((8,), "<f4", (1,), "is at arena offset 8: not a multiple of 64"),
        ((0,), "<f4", (0, 1 << 62, 1 << 62), "of shape \\(0, .*\\) cannot be made"),  # no bytes, too big for numpy
        ((0,), "<f4", (1,) * 65, "cannot be made"),  # more dimensions than numpy has
    ],
)
def test_a_bad_arena_range_from_a_worker_is_refused(where: tuple, dtype: str, shape: Any, problem: str) -> None:
    _, memory = arena()
    freed: list[int] = []
    stream = frame_with(("infer", [(1, "m", "", [("x", "FP32", dtype, shape, {}, where)], None, "", {}, "")]))
    with pytest.raises(WireError, match=problem):
        worker_wire.Framer(memory, freed=freed.append).feed(stream)
    assert freed == []


def test_a_range_lent_now_cannot_be_named_again_until_it_is_freed() -> None:
    sender, memory = arena()
    lent = worker_wire.LentRanges()
    freed: list[int] = []
    framer = worker_wire.Framer(memory, freed=freed.append, lent=lent)
    x = np.ones(1000, np.float32)  # 4000 bytes: ranges 0..4000 and 4032..8032
    first = joined(worker_wire.encode_request(1, InferRequest("m", "", [Tensor("x", "FP32", x)]), sender, []))
    [(_, _, held)] = framer.feed(first)
    for where, shape in (((0,), (1,)), ((3968,), (16,)), ((0,), (2000,))):  # the same range; inside; over it
        bad = frame_with(("infer", [(2, "m", "", [("x", "FP32", "<f4", shape, {}, where)], None, "", {}, "")]))
        with pytest.raises(WireError, match="lent to a request now"):
            framer.feed(bad)
    beside = frame_with(("infer", [(3, "m", "", [("x", "FP32", "<f4", (16,), {}, (4032,))], None, "", {}, "")]))
    [(_, _, next_to_it)] = framer.feed(beside)  # a range next to it is fine
    assert next_to_it.inputs[0].data.shape == (16,) and len(lent) == 2
    del held
    assert freed == [0]
    lent.remove(0)  # as the engine does when it tells the worker
    [(_, _, again)] = framer.feed(first)
    assert again.inputs[0].data.tobytes() == x.tobytes() and len(lent) == 2


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(outputs=st.lists(tensors(), max_size=3), params=plain, shm=st.booleans())
def test_responses_round_trip_and_name_the_arena_ranges_taken(outputs: list[Tensor], params: dict, shm: bool) -> None:
    sender, memory = arena() if shm else (None, None)
    refs: list[int] = []
    response = InferResponse("m", "3", outputs, "id-1", params)
    [(kind, rid, back, taken)] = worker_wire.Framer(memory, trusted=True).feed(
        joined(worker_wire.encode_outcome(7, response, sender, refs))
    )
    assert (kind, rid) == ("done", 7) and isinstance(back, InferResponse)
    assert (back.model_name, back.model_version, back.id, back.parameters) == ("m", "3", "id-1", params)
    assert_same_tensors(back.outputs, outputs)
    assert taken == refs  # the worker tells the engine which ranges it may reuse


def test_outputs_with_no_raw_form_are_pickled_for_the_worker() -> None:
    words = np.array(["text", "more"], dtype=object)  # str elements, not bytes: kept as they are
    fixed = np.array([b"ab", b"c"])  # numpy bytes strings
    response = InferResponse("m", "1", [Tensor("w", "BYTES", words), Tensor("f", "BYTES", fixed)])
    [(_, _, back, _)] = worker_wire.Framer(trusted=True).feed(joined(worker_wire.encode_outcome(1, response)))
    assert back.outputs[0].data.tolist() == ["text", "more"]
    assert back.outputs[1].data.dtype == fixed.dtype and back.outputs[1].data.tolist() == [b"ab", b"c"]


def test_a_request_input_with_no_raw_form_is_refused_by_the_worker() -> None:
    request = InferRequest("m", "", [Tensor("w", "BYTES", np.array(["text"], dtype=object))])
    with pytest.raises(WireError, match=r"tensor 'w' \(object\) has no raw form to send to the engine"):
        worker_wire.encode_request(1, request)


def test_numeric_tensors_are_aligned_views_of_the_frame() -> None:
    request = InferRequest(
        "m",
        "",
        [
            Tensor("a", "INT8", np.arange(3, dtype=np.int8)),
            Tensor("b", "FP64", np.arange(5.0)),
            Tensor("c", "INT64", np.arange(4)),
        ],
    )
    stream = joined(worker_wire.encode_request(1, request)) + joined(worker_wire.encode_request(2, request))
    messages = worker_wire.Framer().feed(stream)
    for _, _, back in messages:
        for tensor in back.inputs:
            assert tensor.data.base is stream  # no copy
            assert tensor.data.flags.aligned and not tensor.data.flags.writeable


@pytest.mark.parametrize(
    "error",
    [
        errors.NotFound("Request for unknown model: 'x' is not found"),
        errors.QueueTimeout("timed out"),
        errors.ConfigError("bad", file="config.pbtxt", field="max_batch_size"),
        errors.Cancelled("cancelled"),
    ],
)
def test_errors_keep_their_class_message_and_status(error: errors.SluiceError) -> None:
    [(kind, rid, back, taken)] = worker_wire.Framer(trusted=True).feed(joined(worker_wire.encode_outcome(3, error)))
    assert (kind, rid, taken) == ("done", 3, None)
    assert type(back) is type(error)
    assert (back.message, back.http_status) == (error.message, error.http_status)


def test_control_messages_split_and_join() -> None:
    stream = b"".join(worker_wire.frame(("m", i, b"x" * i)) for i in range(50))
    framer = worker_wire.Framer()
    got: list[Any] = []
    for start in range(0, len(stream), 7):  # messages cut at every place
        got.extend(framer.feed(stream[start : start + 7]))
    assert got == [("m", i, b"x" * i) for i in range(50)]
    assert framer.feed(worker_wire.frame(("whole",))) == [("whole",)]


# -- corrupt frames -----------------------------------------------------------------------------------

REQUEST = joined(
    worker_wire.encode_request(
        5,
        InferRequest(
            "m", "", [Tensor("x", "FP32", np.ones((2, 3), np.float32)), Tensor("s", "BYTES", np.array([b"ab"], object))]
        ),
    )
)


def frame_with(meta: tuple, raw: bytes = b"") -> bytes:
    head = pickle.dumps(meta, 5)
    body = head + bytes(-(8 + len(head)) & 7) + raw
    body += bytes(-(8 + len(body)) & 7)
    return struct.pack("<II", 8 + len(body), len(head)) + body


@pytest.mark.parametrize(
    ("stream", "problem"),
    [
        (struct.pack("<II", 4, 0), "a frame header says 4 bytes with 0 of metadata: not a frame"),
        (struct.pack("<II", 12, 0) + bytes(4), "a frame header says 12 bytes"),
        (struct.pack("<II", 16, 9) + bytes(8), "with 9 of metadata: not a frame"),
        (frame_with(["not", "a", "tuple"]), "the metadata is not a message"),
        (frame_with(("infer", [(1, "m", "", [("x", "FP32", "<f4", (2,), {}, 8)], None, "", {}, "")])), "past the end"),
        (
            frame_with(("infer", [(1, "m", "", [("x", "FP32", "<f4", (3,), {}, 8)], None, "", {}, "")]), bytes(8)),
            "is not 8 bytes",
        ),
        (
            frame_with(("infer", [(1, "m", "", [("x", "FP32", "|O8", (1,), {}, 8)], None, "", {}, "")]), bytes(8)),
            "no raw form",
        ),
        (
            frame_with(("infer", [(1, "m", "", [("x", "BYTES", "|O", (3,), {}, 8)], None, "", {}, "")]), bytes(8)),
            "too short for 3",
        ),
        (frame_with(("infer", [(1, "m", "", [("x", "FP32", "<f4", (1,), {}, (0,))], None, "", {}, "")])), "an arena"),
        (frame_with(("infer", [(1, 7, "", [], None, "", {}, "")])), "are strings"),
        (frame_with(("infer", [(1, "m", "")])), "cannot be decoded: ValueError"),
        (REQUEST[:8] + REQUEST[9:] + b"\0", "cannot be decoded"),
        (frame_with((np.float32(1.0),)), "only plain values may cross"),  # a class: refused by the engine
    ],
)
def test_corrupt_frames_raise_a_wire_error_naming_the_problem(stream: bytes, problem: str) -> None:
    with pytest.raises(WireError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        worker_wire.Framer().feed(stream)


@settings(max_examples=300, deadline=None)
@given(position=st.integers(0, len(REQUEST) - 1), value=st.integers(0, 255), cut=st.integers(0, len(REQUEST)))
def test_damaged_or_cut_frames_decode_or_raise_a_wire_error_never_anything_else(
    position: int, value: int, cut: int
) -> None:
    damaged = bytearray(REQUEST)
    damaged[position] = value
    try:
        worker_wire.Framer().feed(bytes(damaged[:cut]))
        worker_wire.Framer().feed(bytes(damaged))
    except WireError:
        pass


# -- the link closes on a corrupt frame ---------------------------------------------------------------


async def test_a_corrupt_frame_closes_the_link_and_reports_it_lost() -> None:
    ours, theirs = socket.socketpair()
    received: list[tuple] = []
    lost = asyncio.get_running_loop().create_future()
    transport, link = await asyncio.get_running_loop().create_unix_connection(
        lambda: Link(received.append, lambda: lost.set_result(True), worker_wire.Framer()), sock=ours
    )
    theirs.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(theirs, worker_wire.frame(("ready",)) + struct.pack("<II", 4, 0))
    assert await asyncio.wait_for(lost, 5.0)
    assert received == [] and link.closed  # nothing from the read that held the corrupt frame
    assert await asyncio.wait_for(loop.sock_recv(theirs, 10), 5.0) == b""  # the worker sees the link close
    theirs.close()
    transport.close()


# -- the arena between a worker and the engine ---------------------------------------------------------


class _KeepingPlane:
    """The data plane as EngineSide calls it: answers each request with a copy of its input and keeps
    the input, as a model that holds on to what it was given would (until the test lets it go)."""

    def __init__(self) -> None:
        self.kept: list[np.ndarray] = []
        self.hold = False  # True: answer nothing (a request still running)

    def infer_nowait(self, request: InferRequest, done: Any) -> None:
        if self.hold:
            return
        data = request.inputs[0].data
        self.kept.append(data)
        done(InferResponse(request.model_name, "1", [Tensor("y", "FP32", data.copy())]))


async def test_a_worker_reuses_an_input_range_only_after_the_engine_let_go_of_it() -> None:
    loop = asyncio.get_running_loop()
    requests_arena, responses_arena = (memoryview(mmap.mmap(-1, 1 << 20)) for _ in range(2))
    plane = _KeepingPlane()
    engine = EngineSide(plane, None, None, requests_arena, responses_arena)  # type: ignore[arg-type]
    worker = RemotePlane(requests_arena, responses_arena)
    ours, theirs = socket.socketpair()
    engine_end, engine.link = await loop.create_unix_connection(
        lambda: Link(engine.on_message, lambda: None, worker_wire.Framer(engine.peer, freed=engine.freed.append)),
        sock=ours,
    )
    worker_end, worker.link = await loop.create_unix_connection(
        lambda: Link(worker.on_message, lambda: None, worker_wire.Framer(worker.peer, trusted=True)), sock=theirs
    )
    rng = np.random.default_rng(5)

    async def infer(data: np.ndarray) -> np.ndarray:
        response = await worker.infer(InferRequest("m", "", [Tensor("x", "FP32", data)]))
        return response.outputs[0].data

    first = rng.random(40_000, dtype=np.float32)  # 160 KB: through the arena (from 64 KiB on)
    np.testing.assert_array_equal(await infer(first), first)
    assert worker.arena_used_bytes >= first.nbytes  # answered, but the model still holds it
    for _ in range(20):  # 3.2 MB through a 1 MiB arena: ranges come back and are reused
        sent = rng.random(40_000, dtype=np.float32)
        np.testing.assert_array_equal(await infer(sent), sent)
        plane.kept.pop()  # the model lets this one go
    np.testing.assert_array_equal(plane.kept[0], first)  # never overwritten meanwhile
    small = np.ones(4, np.float32)  # in the frame: the next message carries what was let go of
    np.testing.assert_array_equal(await infer(small), small)
    assert worker.arena_used_bytes == first.nbytes  # only what the model still holds (a multiple of 64)
    plane.kept.clear()
    np.testing.assert_array_equal(await infer(small), small)
    assert worker.arena_used_bytes == 0
    assert len(engine.lent) == 0
    # let go of while no answer is due: the worker's next request brings the news back
    kept = rng.random(40_000, dtype=np.float32)
    np.testing.assert_array_equal(await infer(kept), kept)
    plane.hold = True  # answers nothing from now on
    plane.kept.clear()
    assert worker.arena_used_bytes >= kept.nbytes
    waiting = asyncio.ensure_future(infer(small))
    for _ in range(100):  # loop turns, not time
        if worker.arena_used_bytes == 0:
            break
        await asyncio.sleep(0)
    assert worker.arena_used_bytes == 0 and not waiting.done()
    waiting.cancel()
    engine_end.close()
    worker_end.close()
