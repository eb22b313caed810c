"""The status write's JSON merge patch (``reconcile.merge_patch``): applied by RFC 7386's own rules
to the old status it gives the new one exactly, removed nested keys included (a patch carrying only
the new status keeps nested keys the new one dropped, e.g. ``status.canary.gate`` after a gate
approved)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.operator.reconcile import merge_patch

leaves = st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=3) | st.lists(st.integers(0, 2), max_size=2)
values = st.recursive(leaves, lambda inner: st.dictionaries(st.sampled_from("abcd"), inner, max_size=3), max_leaves=8)
statuses = st.dictionaries(st.sampled_from("abcde"), values, max_size=4)


def apply_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 section 2, as written there."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = apply_merge_patch(result.get(key), value)
    return result


def without_nulls(value: Any) -> Any:
    """What a merge patch can express: a null member means 'absent'."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    return value


@settings(max_examples=400, deadline=None)
@given(statuses, statuses)
def test_the_patch_turns_the_old_status_into_the_new(old, new):
    old, new = without_nulls(old), without_nulls(new)
    assert apply_merge_patch(old, merge_patch(old, new)) == new


def test_a_nested_key_the_new_status_drops_is_written_as_null():
    old = {"canary": {"phase": "Initializing", "gate": "did not approve"}, "replicas": 1}
    new = {"canary": {"phase": "Progressing"}, "replicas": 1}
    assert merge_patch(old, new) == {"canary": {"phase": "Progressing", "gate": None}}
    assert merge_patch(new, new) == {}
