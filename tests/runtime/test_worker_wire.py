"""The link between protocol workers and the engine (runtime/worker_wire.py): frames, round trips,
corrupt input; and the Link (frontend_workers.py) closing on a corrupt frame."""

from __future__ import annotations

import asyncio
import mmap
import pickle
import socket
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from sluice.runtime import errors, worker_wire
from sluice.runtime.frontend_workers import Link
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
    stream = b"".join(joined(worker_wire.encode_request(rid, r, sender, refs)) for rid, r in enumerate(sent))
    got = feed_in_cuts(worker_wire.Framer(memory), stream, cuts)  # the engine's framer: plain values only
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
        for offset in refs:
            sender.release(offset)
        assert sender.used_bytes == 0


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
