"""The sequence scheduler on the event loop over gated instances and a fake clock: unloading while
sequences have work queued, and cancellation of a queued request (which ends its sequence, as in
Triton). The decisions themselves are in test_sequence.py; the real server in test_sequence_server.py.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from sluice.runtime import config as model_config
from sluice.runtime import sequence
from sluice.runtime.backends.base import ModelInstance, Result
from sluice.runtime.errors import Cancelled, InvalidArgument, Unavailable
from sluice.runtime.types import InferRequest, InferResponse, Tensor

CONFIG = """
name: "m" backend: "onnxruntime" max_batch_size: {mbs}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
sequence_batching {{
  max_sequence_idle_microseconds: 60000000
  control_input [ {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }} ]
}}
"""


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000_000

    def __call__(self) -> int:
        return self.now


class GatedInstance(ModelInstance):
    """Echoes INPUT as OUTPUT for each row; every execute waits for ``gate``; records the rows run."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.rows: list[tuple[int, int]] = []  # (INPUT, START) of each real row

    def execute(self, requests: Sequence[InferRequest]) -> list[Result]:
        assert self.gate.wait(5), "the test never opened the gate"
        out: list[Result] = []
        for r in requests:
            inputs = {t.name: t.data for t in r.inputs}
            self.rows.append((int(inputs["INPUT"].ravel()[0]), int(inputs["START"].ravel()[0])))
            out.append(InferResponse("m", "1", [Tensor("OUTPUT", "INT32", inputs["INPUT"].copy())], id=r.id))
        return out

    def close(self) -> None:
        pass


def scheduler(mbs: int = 1) -> tuple[sequence.SequenceScheduler, GatedInstance]:
    config = text_format.Parse(CONFIG.format(mbs=mbs), mc.ModelConfig())
    model_config.validate(config, source="m/config.pbtxt")
    instance = GatedInstance()
    sched = sequence.SequenceScheduler(sequence.sequence_config(config, None, "m:1"), [instance], clock=Clock())
    sched.start()
    return sched, instance


def submit(sched: sequence.SequenceScheduler, cid: int, value: int, start: bool = False, end: bool = False):
    data = np.array([[value]], dtype=np.int32)
    req = InferRequest(
        "m", "1", [Tensor("INPUT", "INT32", data)], id=f"{cid}:{value}",
        parameters={"sequence_id": cid, "sequence_start": start, "sequence_end": end},
    )  # fmt: skip
    task = asyncio.ensure_future(sched.submit(req))
    task.request = req  # type: ignore[attr-defined]
    return task


async def until(predicate, timeout: float = 2.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.001)


def value(result: Result) -> int:
    assert isinstance(result, InferResponse), result
    return int(result.outputs[0].data.ravel()[0])


async def test_unloading_runs_what_sequences_have_queued_within_the_grace_period():
    """A sequence's next request, an END that frees the only slot, and a sequence waiting in the
    backlog for that slot all run after the unload began; the unload ends when they are done, not at
    the end of the grace period (it used to stop dispatching and answer them UNAVAILABLE)."""
    sched, instance = scheduler(mbs=1)  # one slot
    first = submit(sched, 1, 10, start=True)
    await until(lambda: sched.in_flight == 1 and sched.queue_depth == 0)  # running, held by the gate
    queued = [submit(sched, 1, 11), submit(sched, 1, 12, end=True), submit(sched, 2, 20, start=True)]
    await until(lambda: sched.queue_depth == 3)
    closing = asyncio.ensure_future(sched.aclose(grace_s=30))
    await asyncio.sleep(0)
    with pytest.raises(Unavailable, match="unloading"):  # new work is refused at once
        await submit(sched, 3, 30, start=True)
    instance.gate.set()
    results = await asyncio.wait_for(asyncio.gather(first, *queued), 5)
    assert [value(r) for r in results] == [10, 11, 12, 20]
    await asyncio.wait_for(closing, 5)  # well inside the 30 s grace
    assert instance.rows == [(10, 1), (11, 0), (12, 0), (20, 1)]


async def test_a_cancelled_queued_request_ends_its_sequence_and_frees_the_slot():
    sched, instance = scheduler(mbs=1)
    first = submit(sched, 1, 10, start=True)
    await until(lambda: sched.in_flight == 1 and sched.queue_depth == 0)
    second, third = submit(sched, 1, 11), submit(sched, 1, 12)
    other = submit(sched, 2, 20, start=True, end=True)  # backlog: the only slot is sequence 1's
    await until(lambda: sched.queue_depth == 3)
    second.request.cancel.cancel()  # its client went away before it ran
    with pytest.raises(Cancelled, match="cancelled by the client"):
        await asyncio.wait_for(second, 1)
    with pytest.raises(Cancelled, match="an earlier request of sequence 1 was cancelled"):
        await asyncio.wait_for(third, 1)
    assert sched.queue_depth == 1
    instance.gate.set()
    assert value(await asyncio.wait_for(first, 2)) == 10
    assert value(await asyncio.wait_for(other, 2)) == 20  # the released slot went to the backlog
    with pytest.raises(InvalidArgument, match="must specify the START flag"):
        await submit(sched, 1, 13)  # the sequence ended: a step of it never ran
    restarted = await asyncio.wait_for(submit(sched, 1, 14, start=True), 2)
    assert value(restarted) == 14
    assert instance.rows == [(10, 1), (20, 1), (14, 1)]
    await asyncio.wait_for(sched.aclose(grace_s=5), 5)
