"""``WeightedSplit``: the no-mesh canary split is exact at every moment, not only on average."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.runtime.split import WeightedSplit


@given(percent=st.integers(0, 100), n=st.integers(0, 2000))
def test_after_any_n_requests_the_canary_had_exactly_its_share(percent, n):
    split = WeightedSplit(percent)
    sent = sum(split.to_canary() for _ in range(n))
    assert sent == math.floor(n * percent / 100)


def test_the_share_is_spread_evenly():
    split = WeightedSplit(5)
    picks = [i for i in range(200) if split.to_canary()]
    assert picks == [19, 39, 59, 79, 99, 119, 139, 159, 179, 199]  # every 20th, no bursts


@given(first=st.integers(0, 100), second=st.integers(0, 100), before=st.integers(0, 500), n=st.integers(0, 500))
def test_a_new_weight_starts_without_a_burst(first, second, before, n):
    split = WeightedSplit(first)
    for _ in range(before):
        split.to_canary()
    split.reweigh(second)
    sent = sum(split.to_canary() for _ in range(n))
    assert math.floor(n * second / 100) <= sent <= math.floor(n * second / 100) + 1


@pytest.mark.parametrize("percent", [-1, 101])
def test_a_weight_outside_0_to_100_is_refused(percent):
    with pytest.raises(ValueError, match="from 0 to 100"):
        WeightedSplit(percent)
    with pytest.raises(ValueError, match="from 0 to 100"):
        WeightedSplit(10).reweigh(percent)
