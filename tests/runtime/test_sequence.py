"""Sequence batching decisions without I/O: config reading, request checks, control tensors, and the
SequenceBook (slots, backlog, Direct/Oldest batches, idle release) on a fake clock, with properties
checked by hypothesis."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import model_config_pb2 as mc

from sluice.runtime import config as model_config
from sluice.runtime import sequence
from sluice.runtime.batching import Wait
from sluice.runtime.errors import ConfigError, InvalidArgument

MS = 1_000_000


def parsed(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


BASE = """
name: "m" backend: "onnxruntime" max_batch_size: 4
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

CONTROLS = """
control_input [
  { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] },
  { name: "END" control [ { kind: CONTROL_SEQUENCE_END bool_false_true: [ false, true ] } ] },
  { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 5, 7 ] } ] },
  { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
]
"""


def cfg(body: str = CONTROLS, base: str = BASE, model_dir=None) -> sequence.SequenceConfig:
    config = parsed(base + f"sequence_batching {{ {body} }}")
    model_config.validate(config, source="m/config.pbtxt")
    return sequence.sequence_config(config, model_dir, "m:1")


# -- config ---------------------------------------------------------------------------------------


def test_config_reads_controls_strategy_and_defaults():
    c = cfg()
    assert c.strategy == sequence.DIRECT
    assert c.idle_ns == 1_000_000 * 1000  # Triton's 1 s default
    assert c.slots_per_instance == 4
    kinds = {control.name: (control.kind, control.datatype, control.false_true) for control in c.controls}
    assert kinds["START"] == ("start", "FP32", (0.0, 1.0))
    assert kinds["END"] == ("end", "BOOL", (False, True))
    assert kinds["READY"] == ("ready", "INT32", (5, 7))
    assert kinds["CORRID"][:2] == ("corrid", "UINT64")


def test_oldest_uses_max_candidate_sequences_as_slots():
    c = cfg(
        CONTROLS
        + "oldest { max_candidate_sequences: 16 preferred_batch_size: [ 2, 4 ] max_queue_delay_microseconds: 300 }"
    )
    assert (c.strategy, c.slots_per_instance) == (sequence.OLDEST, 16)
    assert c.batch.preferred_batch_sizes == (2, 4) and c.batch.max_queue_delay_ns == 300_000


def test_initial_state_from_a_data_file(tmp_path):
    (tmp_path / "initial_state").mkdir()
    (tmp_path / "initial_state" / "s.bin").write_bytes(np.array([3, 4], dtype="<i4").tobytes())
    body = """state [ { input_name: "S_IN" output_name: "S_OUT" data_type: TYPE_INT32 dims: [ 2 ]
      initial_state { data_type: TYPE_INT32 dims: [ 2 ] data_file: "s.bin" name: "init" } } ]"""
    c = cfg(body, model_dir=tmp_path)
    assert c.states[0].initial.tolist() == [3, 4]
    (tmp_path / "initial_state" / "s.bin").write_bytes(b"\0")
    with pytest.raises(ConfigError, match="expects 8 bytes"):
        cfg(body, model_dir=tmp_path)


def test_variable_state_dims_start_as_one_like_triton():
    c = cfg('state [ { input_name: "S_IN" output_name: "S_OUT" data_type: TYPE_FP32 dims: [ -1, 3 ] } ]')
    assert c.states[0].initial.shape == (1, 3) and not c.states[0].initial.any()


BAD_CONFIGS = [
    ("two controls", 'control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [0,1] }, '
     '{ kind: CONTROL_SEQUENCE_END int32_false_true: [0,1] } ] } ]', "control_input[0].control", "exactly one"),
    ("no values", 'control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START } ] } ]',
     "control_input[0].control[0]", "int32_false_true, fp32_false_true, bool_false_true"),
    ("corrid type", 'control_input [ { name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_FP32 } ] } ]',  # noqa: E501
     "control_input[0].control[0].data_type", "TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32, TYPE_STRING"),
    ("control is an input",
     'control_input [ { name: "INPUT" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [0,1] } ] } ]',
     "control_input[0].name", "not listed under input"),
    ("kind twice",
     'control_input [ { name: "A" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [0,1] } ] }, '
     '{ name: "B" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [0,1] } ] } ]',
     "control_input[1].control[0].kind", "each kind once"),
    ("response cache", "} response_cache { enable: true", "response_cache.enable", "only without sequence_batching"),
    ("iterative", "iterative_sequence: true", "sequence_batching.iterative_sequence", "Direct or Oldest"),
    ("candidates", "oldest { max_candidate_sequences: -1 }", "oldest.max_candidate_sequences", "1 or more"),
    ("state dtype", 'state [ { input_name: "A" output_name: "B" initial_state { name: "x" zero_data: true } } ]',
     "state[0].data_type", "TYPE_INT32"),
    ("initial dims", 'state [ { input_name: "A" output_name: "B" data_type: TYPE_INT32 dims: [ 2 ] '
     'initial_state { data_type: TYPE_INT32 dims: [ 3 ] zero_data: true name: "x" } } ]',
     "state[0].initial_state[0].dims", "same rank"),
    ("initial no data", 'state [ { input_name: "A" output_name: "B" data_type: TYPE_INT32 dims: [ 2 ] '
     'initial_state { data_type: TYPE_INT32 dims: [ 2 ] name: "x" } } ]',
     "state[0].initial_state[0]", "zero_data: true or data_file"),
    ("state input is an input", 'state [ { input_name: "INPUT" output_name: "B" data_type: TYPE_INT32 dims: [ 1 ] } ]',
     "state[0].input_name", "server alone feeds"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "field", "allowed"), [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_bad_sequence_batching_names_the_field_and_what_is_allowed(body, field, allowed):
    config = parsed(BASE + f"sequence_batching {{ {body} }}")
    with pytest.raises(ConfigError) as caught:
        model_config.validate(config, source="m/config.pbtxt")
    assert field in (caught.value.field or ""), caught.value
    assert allowed in str(caught.value)
    assert str(caught.value).startswith("m/config.pbtxt: field '")


def test_sequence_batching_is_no_longer_an_unimplemented_warning():
    config = parsed(BASE + "sequence_batching { " + CONTROLS + " direct { max_queue_delay_microseconds: 5 } }")
    warnings = model_config.validate(config, source="m/config.pbtxt")
    assert warnings == ["sequence_batching.direct.max_queue_delay_microseconds: "
                        "Direct dispatches as soon as an instance is free; ignored"]  # fmt: skip


def test_auto_complete_leaves_control_and_state_tensors_out():
    from sluice.runtime.backends.base import TensorSpec

    state = 'state [ { input_name: "S_IN" output_name: "S_OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]'
    config = parsed('name: "m" backend: "onnxruntime" max_batch_size: 4 sequence_batching { ' + CONTROLS + state + " }")
    specs = [TensorSpec(n, "INT32", (-1, 1)) for n in ("INPUT", "START", "READY", "S_IN")]
    model_config.complete_io(
        config, specs, [TensorSpec("OUTPUT", "INT32", (-1, 1)), TensorSpec("S_OUT", "INT32", (-1, 1))]
    )
    assert [t.name for t in config.input] == ["INPUT"]
    assert [t.name for t in config.output] == ["OUTPUT"]


# -- requests and control tensors -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({}, "must specify a non-zero or non-empty correlation ID"),
        ({"sequence_id": 0}, "must specify a non-zero or non-empty correlation ID"),
        ({"sequence_id": ""}, "must specify a non-zero or non-empty correlation ID"),
        ({"sequence_id": True}, "must be an unsigned integer or a string"),
        ({"sequence_id": 1.5}, "must be an unsigned integer or a string"),
        ({"sequence_id": -3}, "out of range"),
        ({"sequence_id": "abc"}, "sequence_id string 'abc' does not fit model 'm': its CORRID control input 'CORRID' "
                                 "has data_type TYPE_UINT64"),
        ({"sequence_id": 5, "sequence_start": "yes"}, "'sequence_start' must be a boolean"),
    ],
)  # fmt: skip
def test_sequence_of_refuses_bad_ids(params, message):
    with pytest.raises(InvalidArgument) as caught:
        sequence.sequence_of(params, cfg(), "m")
    assert message in str(caught.value)


def test_sequence_of_accepts_any_id_type_without_corrid_and_reads_flags():
    no_corrid = cfg(
        'control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [0,1] } ] } ]'
    )
    assert sequence.sequence_of({"sequence_id": "u-1", "sequence_start": True}, no_corrid, "m") == ("u-1", True, False)
    assert sequence.sequence_of({"sequence_id": 2**64 - 1, "sequence_end": True}, no_corrid, "m") == (
        2**64 - 1,
        False,
        True,
    )


def test_control_tensors_use_the_configured_values_and_shapes():
    c = cfg()
    tensors = {t.name: t for t in sequence.control_tensors(c, start=True, end=False, ready=True, cid=77)}
    assert tensors["START"].data.tolist() == [[1.0]] and tensors["START"].data.dtype == np.float32
    assert tensors["END"].data.tolist() == [[False]] and tensors["END"].datatype == "BOOL"
    assert tensors["READY"].data.tolist() == [[7]]
    assert tensors["CORRID"].data.tolist() == [[77]] and tensors["CORRID"].data.dtype == np.uint64
    pad = {t.name: t for t in sequence.control_tensors(c, start=False, end=False, ready=False, cid=None)}
    assert pad["READY"].data.tolist() == [[5]] and pad["CORRID"].data.tolist() == [[0]]
    unbatched = cfg(base=BASE.replace("max_batch_size: 4", "max_batch_size: 0"))
    assert sequence.control_tensors(unbatched, start=True, end=True, ready=True, cid=1)[0].data.shape == (1,)


# -- the book -------------------------------------------------------------------------------------


def book(strategy: str = "", mbs: int = 2, instances: int = 1, idle_us: int = 1000) -> tuple:
    body = CONTROLS + f"max_sequence_idle_microseconds: {idle_us} " + strategy
    c = cfg(body, base=BASE.replace("max_batch_size: 4", f"max_batch_size: {mbs}"))
    return sequence.SequenceBook(c, instances), c


def ids(batch) -> list:
    return [None if job is None else job.item for job in batch.rows]


def test_pick_slot_spreads_over_instances_first():
    assert sequence.pick_slot({(0, 1), (1, 0), (0, 0)}) == (0, 0)
    assert sequence.pick_slot({(0, 1), (1, 0)}) == (1, 0)


def test_direct_binds_slots_pads_empty_slots_and_backlogs_extra_sequences():
    b, _ = book(mbs=2)
    b.admit(1, True, False, 0, "a1")
    b.admit(2, True, False, 0, "b1")
    b.admit(3, True, False, 0, "c1")  # both slots taken: backlog
    assert (b.slot_of(1), b.slot_of(2), b.slot_of(3), b.backlog) == ((0, 0), (0, 1), None, 1)
    batch = b.next_batch(0, 0)
    assert ids(batch) == ["a1", "b1"]
    b.finished(batch.rows, 1)
    b.admit(2, False, False, 2, "b2")
    padded = b.next_batch(0, 2)
    assert ids(padded) == [None, "b2"]  # slot 0 is empty below an occupied slot: padding
    b.admit(1, False, True, 3, "a2-end")
    assert b.slot_of(3) is None and not b.active(1)  # END admitted: 1 takes no more requests
    b.finished([job for job in padded.rows if job], 4)
    a2 = b.next_batch(0, 4)
    assert ids(a2) == ["a2-end"]
    assert b.slot_of(3) is None  # still waiting: the END of 1 is running
    b.finished(a2.rows, 5)
    assert (b.slot_of(3), b.backlog) == ((0, 0), 0)  # the freed slot went to the backlog
    assert ids(b.next_batch(0, 5)) == ["c1"]


def test_direct_takes_the_shape_of_the_oldest_waiting_request():
    """Triton takes the lowest occupied slot's shape, so a sequence in slot 1 whose shape differs from a
    busy sequence in slot 0 waits as long as slot 0 keeps sending; the oldest head sets it here."""
    b, _ = book(mbs=2)
    b.admit(1, True, False, 0, "a1", shape_key=(1,))
    b.admit(2, True, False, 0, "b1", shape_key=(2,))
    first = b.next_batch(0, 0)
    assert ids(first) == ["a1"]  # as old as b1: the lower slot
    b.finished(first.rows, 1)
    b.admit(1, False, False, 1, "a2", shape_key=(1,))  # slot 0 sends again
    assert ids(b.next_batch(0, 1)) == [None, "b1"]  # b1 has waited longer


def test_rows_whose_state_shapes_differ_are_not_batched_together():
    state = (
        'state [ { input_name: "H_IN" output_name: "H_OUT" data_type: TYPE_INT32 dims: [ -1 ] '
        'initial_state: { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true name: "z" } } ]'
    )
    for strategy in ("", "oldest { max_candidate_sequences: 2 }"):
        c = cfg(CONTROLS + state + strategy, base=BASE.replace("max_batch_size: 4", "max_batch_size: 2"))
        b = sequence.SequenceBook(c, 1)
        first = [b.admit(cid, True, False, 0, f"s{cid}") for cid in (1, 2)]
        batch = b.next_batch(0, 10**9)
        assert ids(batch) == ["s1", "s2"]  # both start from the initial state: one batch
        first[0].sequence.state = {"H_IN": np.zeros((1, 2), np.int32)}
        first[1].sequence.state = {"H_IN": np.zeros((1, 3), np.int32)}
        b.finished(first, 1)
        later = [b.admit(cid, False, False, 2, f"t{cid}") for cid in (1, 2)]
        assert b.row_key(later[0]) != b.row_key(later[1])
        assert [job.item for job in b.next_batch(0, 10**9).rows if job] == ["t1"]
        restart = b.admit(2, True, False, 3, "restart")  # START: the initial state again
        assert b.row_key(restart) == b.row_key(first[0])


def test_a_cancelled_request_ends_its_sequence():
    b, _ = book(mbs=1)
    b.admit(1, True, False, 0, "a1")
    running = b.next_batch(0, 0)
    second = b.admit(1, False, False, 1, "a2")
    third = b.admit(1, False, False, 2, "a3")
    b.admit(2, True, False, 3, "b1")  # backlog
    dropped = b.cancel(second)
    assert dropped == [third] and not b.active(1)
    assert b.cancel(second) is None and b.cancel(third) is None  # no longer queued
    with pytest.raises(sequence.NotStarted):
        b.admit(1, False, False, 4, "a4")
    assert b.slot_of(2) is None  # a1 still runs in the only slot
    b.finished(running.rows, 5)
    assert b.slot_of(2) == (0, 0) and ids(b.next_batch(0, 5)) == ["b1"]


def test_oldest_takes_the_oldest_ready_sequences_and_waits_for_the_delay():
    b, _ = book("oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 100 }", mbs=3)
    b.admit(1, True, False, 10, "a")
    b.admit(2, True, False, 5, "b")
    assert b.next_batch(0, 50) == Wait(5 + 100_000)  # the oldest head waits out the delay for a fuller batch
    assert ids(b.next_batch(0, 5 + 100_000)) == ["b", "a"]  # delay over: what is there, oldest first
    b.admit(3, True, False, 1, "c")
    b.admit(4, True, False, 0, "d")
    assert ids(b.next_batch(0, 100_010)) == ["d", "c"]  # 1 and 2 still run: their next requests wait


def test_oldest_sends_a_full_batch_at_once():
    b, _ = book("oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 100 }", mbs=2)
    for cid, at in ((1, 30), (2, 20), (3, 10)):
        b.admit(cid, True, False, at, f"s{cid}")
    assert ids(b.next_batch(0, 40)) == ["s3", "s2"]


def test_non_start_request_of_an_unknown_sequence_is_refused_and_start_restarts():
    b, _ = book()
    with pytest.raises(sequence.NotStarted):
        b.admit(9, False, False, 0, "x")
    b.admit(9, True, False, 0, "x1")
    b.admit(9, True, False, 0, "x2")  # a second START continues in the same slot
    assert b.slot_of(9) == (0, 0)


def test_idle_sequences_are_released_on_the_fake_clock():
    b, c = book(idle_us=1000)
    b.admit(1, True, False, 0, "a")
    batch = b.next_batch(0, 0)
    b.finished(batch.rows, 0)
    assert b.next_expiry() == c.idle_ns
    assert b.expire(c.idle_ns - 1) == []
    assert [run.cid for run in b.expire(c.idle_ns)] == [1]
    assert not b.active(1) and b.next_expiry() is None
    with pytest.raises(sequence.NotStarted):
        b.admit(1, False, False, c.idle_ns + 1, "late")


def test_a_sequence_with_work_queued_or_running_is_never_idle():
    b, c = book(idle_us=1000)
    b.admit(1, True, False, 0, "a")
    batch = b.next_batch(0, 0)  # running for a long time
    assert b.expire(10 * c.idle_ns) == []
    b.finished(batch.rows, 10 * c.idle_ns)
    assert b.expire(10 * c.idle_ns + 1) == []


ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "admit", "admit", "run", "finish", "tick", "cancel"]),
        st.integers(1, 4),  # sequence id
        st.booleans(),  # start
        st.booleans(),  # end
        st.integers(0, 2),  # instance
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops, st.sampled_from(["", "oldest { max_candidate_sequences: 2 }"]), st.integers(0, 3))
def test_requests_of_one_sequence_run_in_order_and_never_concurrently(operations, strategy, mbs):
    b, c = book(strategy, mbs=mbs, instances=2, idle_us=5)
    now = 0
    admitted: dict[int, list[sequence.Job]] = {}  # per sequence run: jobs in admission order
    running: dict[int, list[sequence.Job]] = {}  # instance -> jobs of its batch
    started: list[sequence.Job] = []
    cancelled: set[int] = set()
    for op, cid, start, end, instance in operations:
        now += 1
        if op == "admit":
            try:
                job = b.admit(cid, start, end, now, len(started) + len(admitted))
            except sequence.NotStarted:
                assert not start
                continue
            admitted.setdefault(id(job.sequence), []).append(job)
        elif op == "run" and instance < 2 and instance not in running:
            decision = b.next_batch(instance, now)
            if isinstance(decision, sequence.Batch):
                jobs = [job for job in decision.rows if job is not None]
                assert jobs and len(decision.rows) <= max(mbs, 1) and len(decision.rows) <= c.slots_per_instance
                runs = [id(job.sequence) for job in jobs]
                assert len(runs) == len(set(runs)), "two requests of one sequence in a batch"
                for other in running.values():
                    assert not {id(j.sequence) for j in other} & set(runs), "a sequence runs on two instances"
                running[instance] = jobs
                started.extend(jobs)
        elif op == "finish" and instance in running:
            b.finished(running.pop(instance), now)
        elif op == "tick":
            now += c.idle_ns
            b.expire(now)
        elif op == "cancel":
            for jobs in admitted.values():
                for job in jobs:
                    if id(job) in cancelled or job in started:
                        continue
                    dropped = b.cancel(job)
                    if dropped is not None:  # the sequence ends: its later queued requests go too
                        cancelled.update(id(other) for other in [job, *dropped])
                        assert all(other.sequence is job.sequence and not other.start for other in dropped)
                        break
    for key, jobs in admitted.items():
        order = [job for job in started if id(job.sequence) == key]
        expected = [job for job in jobs if id(job) not in cancelled]
        assert order == expected[: len(order)], "a sequence's requests ran out of order"


def test_a_cancelled_request_drops_only_the_later_requests_of_its_own_sequence():
    b, _ = book(mbs=1)
    b.admit(1, True, False, 0, "a1")
    running = b.next_batch(0, 0)
    _, a3, a4 = (b.admit(1, False, False, t, f"a{t + 1}") for t in (1, 2, 3))
    assert b.cancel(a3) == [a4]  # a2, earlier, still runs
    b.finished(running.rows, 4)
    assert ids(b.next_batch(0, 4)) == ["a2"]
    # a new sequence of the same id queued behind: cancelling the old tail leaves it alone
    c, _ = book(mbs=1)
    c.admit(7, True, False, 0, "x1")
    busy = c.next_batch(0, 0)
    old_tail = c.admit(7, False, False, 1, "x2")
    restart = c.admit(7, True, False, 2, "y1")
    c.admit(7, False, False, 3, "y2")
    assert c.cancel(old_tail) == [] and c.active(7)
    c.finished(busy.rows, 4)
    assert ids(c.next_batch(0, 4)) == ["y1"] and restart.start
