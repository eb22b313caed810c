"""callers.py on its own: caller names, the bounded label set, duplicate windows (pure, fake clock)."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.runtime import callers
from sluice.runtime.callers import (
    OTHER,
    UNKNOWN,
    CallerLabels,
    DuplicateWindow,
    SpaceSaving,
    caller_from_header,
    caller_from_parameter,
    caller_problem,
    choose_labels,
    rejection_reason,
)
from sluice.runtime.errors import (
    Cancelled,
    InvalidArgument,
    ModelError,
    PayloadTooLarge,
    QueueFull,
    QueueTimeout,
    Shed,
    Unavailable,
)


@pytest.mark.parametrize(
    "name", ["svc-a", "team/billing@prod", "pod:10.0.0.1", "A.b_c-9", "x" * 64, "spiffe:/ns/a/sa/b"]
)
def test_allowed_caller_names(name):
    assert caller_problem(name) is None
    assert caller_from_header(name.encode()) == name
    assert caller_from_parameter(name) == name


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("x" * 65, "is not allowed"),
        ("has space", "is not allowed"),
        ("ünï", "is not allowed"),
        ("a,b", "is not allowed"),
        ("a\nb", "is not allowed"),
        (OTHER, "is reserved"),
        (UNKNOWN, "is reserved"),
    ],
)
def test_refused_caller_names_say_what_is_allowed(name, problem):
    assert caller_problem(name) == problem
    with pytest.raises(InvalidArgument, match=rf"header Sluice-Caller .* {problem}; allowed: 1 to 64 characters"):
        caller_from_header(name.encode("utf-8"))
    with pytest.raises(InvalidArgument, match=r"request parameter 'sluice_caller' .*; allowed: 1 to 64"):
        caller_from_parameter(name)


def test_empty_names_no_caller_and_a_non_string_parameter_is_refused():
    assert caller_from_header(b"") == ""
    assert caller_from_parameter("") == ""
    with pytest.raises(InvalidArgument, match="'sluice_caller' must be a string, got int"):
        caller_from_parameter(7)


@pytest.mark.parametrize(
    ("error", "queued", "reason"),
    [
        (QueueFull("full"), False, "queue_full"),
        (InvalidArgument("shape"), False, "bad_request"),
        (PayloadTooLarge("big"), False, "bad_request"),
        (Unavailable("draining"), False, None),
        (QueueTimeout("late"), True, "timeout"),
        (Shed("overloaded"), True, "shed"),
        (Cancelled("gone"), True, "cancelled"),
        (ModelError("broke"), True, None),
        (InvalidArgument("the model's own INVALID_ARG"), True, None),
    ],
)
def test_rejection_reasons(error, queued, reason):
    assert rejection_reason(error, queued) == reason


def test_shed_is_a_queue_timeout_to_clients():
    assert isinstance(Shed("x"), QueueTimeout) and Shed.http_status == 503


# -- space-saving ----------------------------------------------------------------------------------

streams = st.lists(st.integers(0, 400).map(lambda i: f"c{i}"), max_size=600)


@settings(max_examples=150, deadline=None)
@given(stream=streams, capacity=st.integers(1, 40))
def test_space_saving_is_bounded_and_keeps_every_heavy_hitter(stream, capacity):
    table = SpaceSaving(capacity)
    for caller in stream:
        table.add(caller)
        assert len(table) <= capacity
    assert sum(table.counts.values()) == len(stream)  # the algorithm's invariant: nothing is lost
    true = collections.Counter(stream)
    for caller, count in true.items():
        if count > len(stream) / capacity:
            assert caller in table.counts
            assert table.counts[caller] >= count  # an overestimate, never an underestimate


def test_decay_halves_and_drops_callers_that_reach_zero():
    table = SpaceSaving(8)
    for caller, n in (("a", 5), ("b", 1)):
        table.add(caller, n)
    table.decay()
    assert table.counts == {"a": 2}


@pytest.mark.parametrize(
    ("counts", "incumbents", "limit", "chosen"),
    [
        ({"a": 5, "b": 3, "c": 1}, set(), 2, {"a", "b"}),
        ({"a": 5, "b": 3, "c": 3}, {"c"}, 2, {"a", "c"}),  # a tie goes to the caller holding a label
        ({"a": 5}, {"x", "y"}, 2, {"a", "x"}),  # room left: incumbents the ranking dropped keep theirs
        ({"a": 5, "b": 3}, {"x"}, 0, set()),
    ],
)
def test_choose_labels(counts, incumbents, limit, chosen):
    assert choose_labels(counts, incumbents, limit) == chosen


@settings(max_examples=100, deadline=None)
@given(
    events=st.lists(
        st.one_of(st.just(None), st.integers(0, 10_000).map(lambda i: f"caller-{i}"), st.just("")), max_size=500
    ),
    limit=st.integers(0, 6),
)
def test_caller_labels_stay_bounded_under_any_stream_of_callers(events, limit):
    """``None`` is a scrape (re-rank); every label is the caller itself, other or unknown; at most
    ``limit`` callers hold labels and the ranking holds at most its capacity, however many callers."""
    labels = CallerLabels(limit, capacity=16)
    for event in events:
        if event is None:
            active = labels.rerank()
            assert len(active) <= limit + 2 and {OTHER, UNKNOWN} <= active
            continue
        label = labels.label(event)
        assert label == (UNKNOWN if not event else event if event in labels.labelled else OTHER)
        assert len(labels.labelled) <= limit
        assert len(labels.ranking) <= 16


def test_the_busiest_callers_take_the_labels_at_a_rerank():
    labels = CallerLabels(2)
    assert [labels.label(c) for c in ("a", "b", "c")] == ["a", "b", OTHER]  # first come while labels are free
    for _ in range(10):
        assert labels.label("c") == OTHER  # until the next scrape
    labels.label("a")
    assert labels.rerank() == {"a", "c", OTHER, UNKNOWN}
    assert labels.label("c") == "c"
    assert labels.label("b") == OTHER


def test_a_caller_that_went_quiet_loses_its_label_to_a_busy_one():
    labels = CallerLabels(1)
    for _ in range(8):
        labels.label("early")
    labels.rerank()
    for _ in range(3):
        assert labels.label("late") == OTHER
    labels.rerank()  # early (8 -> 4 -> 2) still ahead of late (3)
    assert labels.label("early") == "early"
    for _ in range(6):
        labels.label("late")
    labels.rerank()
    assert labels.labelled == {"late"}


# -- duplicate window ------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000_000_000

    def __call__(self) -> int:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += int(seconds * 1e9)


def test_the_same_key_within_the_window_is_a_duplicate_and_not_after_it():
    clock = FakeClock()
    window = DuplicateWindow(10, clock)
    assert not window.seen(("a", 1))
    clock.advance(9.9)
    assert window.seen(("a", 1))  # 9.9 s after the first
    assert not window.seen(("b", 1))  # another caller
    clock.advance(9.9)
    assert window.seen(("a", 1))  # the window runs from the last one
    clock.advance(10)
    assert not window.seen(("a", 1))
    assert len(window) == 1  # the expired keys are gone


@settings(max_examples=50, deadline=None)
@given(keys=st.lists(st.integers(0, 1000), max_size=300), step_ms=st.integers(0, 50))
def test_the_duplicate_window_is_bounded(keys, step_ms):
    clock = FakeClock()
    window = DuplicateWindow(1, clock, max_entries=32)
    last: dict[int, int] = {}
    for key in keys:
        clock.advance(step_ms / 1000)
        duplicate = window.seen(key)
        assert len(window) <= 32
        if duplicate:  # never a false positive
            assert key in last and clock.now - last[key] < 1e9
        last[key] = clock.now


def test_a_window_of_zero_is_no_window():
    with pytest.raises(ValueError, match="0 turns duplicate detection off"):
        DuplicateWindow(0, FakeClock())


def test_reasons_are_the_documented_ones():
    assert callers.REASONS == ("queue_full", "timeout", "shed", "cancelled", "bad_request")
