"""Pool admission (``sluice.operator.pools``): capacity per device form, stable admission, reasons.

Pure functions, no I/O: tables of cases, then properties over random pools (hypothesis).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.operator import api, pools

GIB = 1024


def member(name: str, gib: float, compute: int = 0, created: str = "", model: str = "",
           account: str | None = None) -> pools.Member:
    return pools.Member(name=name, memory_mib=round(gib * GIB), compute_percent=compute,
                        created=created or f"2025-01-01T00:00:{ord(name[0]) % 60:02d}Z", model=model or name,
                        service_account=account)


def names(members: tuple[pools.Member, ...]) -> list[str]:
    return [m.name for m in members]


def reasons(admission: pools.Admission) -> dict[str, str]:
    return {w.member.name: w.reason for w in admission.waiting}


# ---------------------------------------------------------------- capacity

@pytest.mark.parametrize(("gpu", "known", "memory", "compute"), [
    (api.Gpu(memory="40Gi"), None, 40 * GIB, 100),
    (api.Gpu(memory="16G"), None, 15258, 100),  # decimal gigabytes round down to whole MiB
    # The smallest nominal memory of the profile on any catalogued GPU (A100-80GB and H100-80GB: 40 GB x 0.95).
    (api.Gpu(mig_profile="3g.40gb"), None, 38912, 100),
    (api.Gpu(mig_profile="1g.10gb"), None, 9728, 100),
    (api.Gpu(mig_profile="7g.99gb"), None, None, 100),  # not in the catalogue: unknown
    # every member runs on every GPU of the pod (KIND_GPU without gpus): one GPU's room to share
    (api.Gpu(count=2), 81559, 81559, 100),  # the caller knows the GPUs' memory (placement)
    (api.Gpu(count=2), None, None, 100),
], ids=["memory", "decimal-memory", "mig-3g", "mig-1g", "mig-unknown", "count-known", "count-unknown"])
def test_capacity_of_each_device_form(gpu, known, memory, compute):
    capacity = pools.capacity("small", gpu, gpu_memory_mib=known)
    assert (capacity.memory_mib, capacity.compute_percent) == (memory, compute)
    assert bool(capacity.note) == (memory is None)


def test_an_unknown_capacity_says_why_and_admits_on_compute_alone():
    capacity = pools.capacity("big", api.Gpu(count=1))
    assert "admitted on gpu.computePercent alone" in capacity.note
    admission = pools.admit(capacity, [member("a", 500, 60), member("b", 500, 30), member("c", 1, 20)])
    assert names(admission.admitted) == ["a", "b"]
    assert reasons(admission) == {"c": "needs 20% compute, pool big has 10% compute free of 100%"}
    capacity = pools.status_to(admission)["capacity"]
    # unknown quantities are left out (a null would be deleted by the merge patch, and the status
    # never compare equal to what is stored: written again on every reconcile)
    assert "freeMiB" not in capacity and "memoryMiB" not in capacity and None not in capacity.values()


def test_quantities_round_shares_up_and_capacities_down():
    assert pools.mib("1G", round_up=True) == 954
    assert pools.mib("1G", round_up=False) == 953
    assert pools.mib("6Gi", round_up=True) == 6 * GIB


@pytest.mark.parametrize(("mib", "text"), [(6 * GIB, "6 GiB"), (1536, "1.5 GiB"), (512, "512 MiB"),
                                           (38912, "38 GiB"), (9728, "9.5 GiB"), (0, "0 MiB")])
def test_format_mib(mib, text):
    assert pools.format_mib(mib) == text


# ---------------------------------------------------------------- admission, case by case

POOL = pools.Capacity("small", 40 * GIB)
A, B, C = member("a", 16), member("b", 20), member("c", 10)
T1, T2 = "2025-01-01T00:00:01Z", "2025-01-01T00:00:02Z"

CASES = [
    # (id, members, previously admitted, admitted, {waiting: reason})
    ("empty", [], [], [], {}),
    ("both-fit", [A, B], [], ["a", "b"], {}),
    ("third-waits", [A, B, C], [], ["a", "b"],
     {"c": "needs 10 GiB, pool small has 4 GiB free of 40 GiB"}),
    ("oldest-first", [member("y", 30, created=T1), member("x", 30, created=T2)],
     [], ["y"], {"x": "needs 30 GiB, pool small has 10 GiB free of 40 GiB"}),
    ("same-age-by-name", [member("y", 30, created=T1), member("x", 30, created=T1)],
     [], ["x"], {"y": "needs 30 GiB, pool small has 10 GiB free of 40 GiB"}),
    ("a-misfit-does-not-block-a-younger-fit", [A, B, C, member("d", 3)], [], ["a", "b", "d"],
     {"c": "needs 10 GiB, pool small has 1 GiB free of 40 GiB"}),
    ("deleting-a-member-admits-the-waiting-one", [B, C], [A, B], ["b", "c"], {}),
    ("admitted-stay-though-older-arrive", [member("old", 30, created="2024-01-01T00:00:00Z"), A, B], [A, B],
     ["a", "b"], {"old": "needs 30 GiB, pool small has 4 GiB free of 40 GiB"}),
    ("growth-that-fits-stays", [A, member("b", 24)], [A, B], ["a", "b"], {}),
    ("growth-beyond-free-waits-the-other-stays", [A, member("b", 30)], [A, B], ["a"],
     {"b": "needs 30 GiB, pool small has 24 GiB free of 40 GiB"}),
    ("an-older-member-that-grew-waits-not-the-younger", [member("a", 30), B], [A, B], ["b"],
     {"a": "needs 30 GiB, pool small has 20 GiB free of 40 GiB"}),
    ("shrinking-frees-room", [member("a", 6), B, C], [A, B], ["a", "b", "c"], {}),
    ("larger-than-the-pool", [member("huge", 50)], [], [],
     {"huge": "needs 50 GiB, pool small has 40 GiB in all: it can never fit; lower its share or give the pool a "
              "larger spec.gpu"}),
    ("compute-full", [member("a", 1, 60), member("b", 1, 50)], [], ["a"],
     {"b": "needs 50% compute, pool small has 40% compute free of 100%"}),
    ("memory-and-compute-missing", [member("a", 36, 80), member("b", 6, 30)], [], ["a"],
     {"b": "needs 6 GiB and 30% compute, pool small has 4 GiB free of 40 GiB and 20% compute free of 100%"}),
    ("compute-growth", [member("a", 1, 95), member("b", 1, 10)], [member("a", 1, 50), member("b", 1, 10)], ["b"],
     {"a": "needs 95% compute, pool small has 90% compute free of 100%"}),
    ("exactly-full", [member("a", 20, 50), member("b", 20, 50)], [], ["a", "b"], {}),
]


@pytest.mark.parametrize(("members", "before", "admitted", "waiting"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_admission(members, before, admitted, waiting):
    admission = pools.admit(POOL, members, before)
    assert names(admission.admitted) == admitted
    assert reasons(admission) == waiting
    assert all(w.cause == pools.POOL_FULL for w in admission.waiting)


def test_two_members_cannot_serve_the_same_model_name():
    admission = pools.admit(POOL, [member("a", 1, model="bert"), member("b", 1, model="bert")])
    assert names(admission.admitted) == ["a"]
    [waiting] = admission.waiting
    assert waiting.cause == pools.POOL_CONFLICT
    assert waiting.reason.startswith("serves model 'bert', which member a already serves in pool small")


def test_members_share_the_pods_service_account():
    admission = pools.admit(POOL, [member("a", 1), member("b", 1, account="reader"), member("c", 1, account="other"),
                                   member("d", 1, account="reader")])
    assert names(admission.admitted) == ["a", "b", "d"]
    assert admission.service_account == "reader"
    [waiting] = admission.waiting
    assert (waiting.member.name, waiting.cause) == ("c", pools.POOL_CONFLICT)
    assert "pool small's pods run as 'reader' (for member b)" in waiting.reason


def test_a_pool_that_shrank_keeps_its_oldest_members():
    admission = pools.admit(pools.Capacity("small", 20 * GIB), [A, B], [A, B])
    assert names(admission.admitted) == ["a"]
    assert reasons(admission) == {"b": "needs 20 GiB, pool small has 4 GiB free of 20 GiB"}


def test_a_member_whose_spec_rules_it_out_waits_named_with_its_problems():
    """It is no candidate (the pool renders members from their specs), but it is not forgotten either: the
    pool lists it among the waiting, oldest first with the others, and its verdict says why."""
    broken = pools.refused("b", B.created, pools.INVALID_SPEC, ["spec.canary: a member of pool 'small' cannot "
                                                               "have a canary", "spec.server: ..."])
    unserved = pools.refused("z", "2025-01-01T00:00:00Z", pools.NOT_SERVED, ["spec.model.format: tensorrt ..."])
    admission = pools.admit(POOL, [A, C], [A, B], [broken, unserved])
    assert names(admission.admitted) == ["a", "c"]  # b's room went to c, which fits now
    assert [(w.member.name, w.cause) for w in admission.waiting] == [
        ("z", pools.NOT_SERVED), ("b", pools.INVALID_SPEC)]
    assert reasons(admission)["b"] == ("its spec is invalid (spec.canary: a member of pool 'small' cannot have a "
                                       "canary; spec.server: ...); the pool admits it again once that is fixed")
    assert reasons(admission)["z"].startswith("its spec cannot be served yet (spec.model.format: tensorrt")
    status = pools.status_to(admission)
    assert status["membersSummary"] == "2 admitted, 2 waiting"
    assert status["capacity"]["usedMiB"] == 26 * GIB  # a refused member holds no share
    assert pools.verdict_from(status, "b") == pools.Verdict(pools.WAITING, pools.INVALID_SPEC, reasons(admission)["b"])
    assert pools.named_in(status) == {"a", "b", "c", "z"}
    # a name that is a candidate is never also refused (one InferenceModel, one verdict)
    assert [w.member.name for w in pools.admit(POOL, [A, B], [], [pools.refused("b", "", pools.INVALID_SPEC, [])]
                                               ).waiting] == []


# ---------------------------------------------------------------- status round trip

def test_status_round_trip_and_verdicts():
    admission = pools.admit(POOL, [A, B, C])
    status = pools.status_to(admission)
    assert status["members"] == [{"name": "a", "memoryMiB": 16 * GIB, "computePercent": 0},
                                 {"name": "b", "memoryMiB": 20 * GIB, "computePercent": 0}]
    assert status["waiting"] == [{"name": "c", "cause": "PoolFull",
                                  "reason": "needs 10 GiB, pool small has 4 GiB free of 40 GiB"}]
    assert status["capacity"] == {"memoryMiB": 40 * GIB, "usedMiB": 36 * GIB, "freeMiB": 4 * GIB,
                                  "computePercent": 100, "computePercentUsed": 0, "summary": "4 GiB of 40 GiB"}
    assert status["membersSummary"] == "2 admitted, 1 waiting"
    assert [(m.name, m.memory_mib) for m in pools.admitted_from(status)] == [("a", 16 * GIB), ("b", 20 * GIB)]
    assert pools.verdict_from(status, "a") == pools.Verdict(pools.ADMITTED)
    assert pools.verdict_from(status, "c") == pools.Verdict(pools.WAITING, pools.POOL_FULL,
                                                            "needs 10 GiB, pool small has 4 GiB free of 40 GiB")
    assert pools.verdict_from(status, "new") == pools.Verdict(pools.JOINING)
    assert pools.verdict_from(None, "a") == pools.Verdict(pools.JOINING)
    assert pools.named_in(status) == {"a", "b", "c"}
    # Re-admitting from its own status changes nothing (a reconcile is idempotent).
    assert pools.admit(POOL, [A, B, C], pools.admitted_from(status)) == admission


def test_unreadable_status_entries_are_skipped():
    status = {"members": [{"name": "a", "memoryMiB": "lots"}, "junk", {"memoryMiB": 3}, {"name": "b", "memoryMiB": 3}]}
    assert [m.name for m in pools.admitted_from(status)] == ["b"]


# ---------------------------------------------------------------- properties

def members_strategy() -> st.SearchStrategy[list[pools.Member]]:
    # now and then two members serve one model name or fetch as different service accounts (conflicts)
    one = st.builds(
        lambda i, gib, compute, second, shared, account: pools.Member(
            name=f"m{i}", memory_mib=gib * 512, compute_percent=compute, created=f"2025-01-01T00:00:{second:02d}Z",
            model="shared" if shared else f"m{i}", service_account=account),
        st.integers(0, 30), st.integers(1, 40), st.sampled_from([0, 0, 10, 25, 40, 70]), st.integers(0, 59),
        st.sampled_from([False, False, False, True]), st.sampled_from([None, None, "sa-a", "sa-b"]))
    return st.lists(one, max_size=12, unique_by=lambda m: m.name)


CAPACITIES = st.builds(lambda gib, compute: pools.Capacity("p", gib * GIB if gib else None, compute),
                       st.sampled_from([0, 10, 20, 40, 80]), st.sampled_from([100, 200]))


@settings(max_examples=300, deadline=None)
@given(CAPACITIES, members_strategy(), members_strategy())
def test_never_over_capacity(capacity, members, before):
    admission = pools.admit(capacity, members, before)
    if capacity.memory_mib is not None:
        assert admission.used_mib <= capacity.memory_mib
    assert admission.compute_used <= capacity.compute_percent
    # Everyone is either admitted or waiting, once, with a reason.
    assert sorted(names(admission.admitted) + [w.member.name for w in admission.waiting]) == \
        sorted(m.name for m in members)
    assert all(w.reason for w in admission.waiting)


@settings(max_examples=300, deadline=None)
@given(CAPACITIES, members_strategy(), members_strategy())
def test_stable_under_additions(capacity, members, extra):
    """Adding members (of any age) never evicts an admitted one; removing waiting ones changes nothing."""
    first = pools.admit(capacity, members, ())
    known = {m.name for m in members}
    more = [m for m in extra if m.name not in known]
    second = pools.admit(capacity, [*members, *more], first.admitted)
    assert set(names(first.admitted)) <= set(names(second.admitted))
    kept = [m for m in members if m in first.admitted]
    assert pools.admit(capacity, kept, first.admitted).admitted == first.admitted


@settings(max_examples=300, deadline=None)
@given(CAPACITIES, members_strategy(), members_strategy(), st.randoms(use_true_random=False))
def test_deterministic_whatever_the_order(capacity, members, before, rng: random.Random):
    shuffled = list(members)
    rng.shuffle(shuffled)
    assert pools.admit(capacity, shuffled, before) == pools.admit(capacity, members, before)
    admission = pools.admit(capacity, members, before)
    assert pools.admit(capacity, members, admission.admitted) == admission  # a fixed point: no flapping


def test_a_member_moved_to_another_pool_is_not_ready_on_the_old_pools_word():
    """Ready carried over a rollout only within one pool: a member that moved is ready once the new
    pool's pods serve it, not because it was ready in the pool it left."""
    from sluice.operator import reconcile

    body = {"metadata": {"name": "a"}, "status": {
        "pool": {"name": "p1", "state": "Admitted", "reason": ""},
        "conditions": [{"type": "Ready", "status": "True", "reason": "ServedByPool"}]}}
    rolling = {"metadata": {"generation": 5}, "spec": {"replicas": 2, "template": {"metadata": {"labels": {
        "member.sluice.dev/a": "true"}}}},
        "status": {"observedGeneration": 5, "replicas": 3, "updatedReplicas": 1, "availableReplicas": 2}}
    found, _, _ = reconcile._member_conditions(body, reconcile._Membership("p2", pools.Verdict("Admitted"), rolling))
    assert next(c for c in found if c.type == "Ready").status == "False"
    stayed = {**body, "status": {**body["status"], "pool": {"name": "p2", "state": "Admitted", "reason": ""}}}
    found, _, _ = reconcile._member_conditions(stayed, reconcile._Membership("p2", pools.Verdict("Admitted"), rolling))
    assert next(c for c in found if c.type == "Ready").status == "True"  # within one pool: kept through the rollout
