"""The canary state machine (``sluice.operator.canary.step``), pure: tables of observations on a fake
clock, no I/O. Each case drives ``step`` as the reconciler will: call it, apply nothing, feed the
returned status back with the next observation at the requeue time it asked for."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from sluice.operator import canary as c

HEALTHY = c.VersionMetrics(requests=1000, errors=2, p99_ms=20.0)
STABLE = c.VersionMetrics(requests=9000, errors=9, p99_ms=18.0)
SEEN = c.Observation(canary=HEALTHY, stable=STABLE, canary_ready=True)
ANALYSIS = c.Analysis(step_weights=(5, 25, 50, 100), interval_s=60, min_requests=100, max_error_rate=0.01)
PLAN = c.Plan("cand-a", ANALYSIS)


def drive(plan, observations, status=c.Status(), start=1000.0):
    """Feed ``observations`` one per call, each at the time the previous decision asked for.
    Returns (final status, every action, the phases seen, the times)."""
    now = start
    actions, phases = [], []
    for observation in observations:
        decision = c.step(plan, status, observation, now)
        status = decision.status
        actions.extend(decision.actions)
        phases.append(status.phase)
        now += decision.requeue_after_s if decision.requeue_after_s is not None else 0.0
    return status, actions, phases, now


def weights(actions):
    return [a.percent for a in actions if isinstance(a, c.SetWeight)]


def test_happy_path_steps_through_every_weight_then_promotes_and_cleans_up():
    observations = [SEEN] * 6 + [dataclasses.replace(SEEN, stable_rolled_out=True)] * 2
    status, actions, phases, _ = drive(PLAN, observations)
    assert phases == [
        c.INITIALIZING,  # deploy the candidate
        c.PROGRESSING,  # 5 %
        c.PROGRESSING,  # interval passed: 25 %
        c.PROGRESSING,  # 50 %
        c.PROGRESSING,  # 100 %
        c.PROMOTING,  # the last step passed
        c.FINALISING,  # stable rolled out: weight back to 0
        c.SUCCEEDED,  # canary objects removed
    ]
    assert weights(actions) == [5, 25, 50, 100, 0]
    assert [type(a) for a in actions if not isinstance(a, (c.Event, c.SetWeight))] == [
        c.EnsureCanary,
        c.Promote,
        c.RemoveCanary,
    ]
    # weight goes back to stable before the canary objects go
    kinds = [type(a) for a in actions]
    assert kinds.index(c.RemoveCanary) > len(kinds) - 1 - kinds[::-1].index(c.SetWeight)
    assert status.failed_candidate == ""


def test_no_step_advances_before_its_interval_is_over():
    status, _, _, now = drive(PLAN, [SEEN, SEEN])  # initialize, enter 5 %
    early = c.step(PLAN, status, SEEN, now - 30)  # half an interval later
    assert early.status == status and early.actions == ()
    assert early.requeue_after_s == pytest.approx(30)


@pytest.mark.parametrize("failing_step", [0, 1, 2, 3])
@pytest.mark.parametrize(
    "bad",
    [
        c.VersionMetrics(requests=1000, errors=50, p99_ms=20.0),  # 5 % errors
        c.VersionMetrics(requests=1000, errors=0, p99_ms=900.0),  # p99 over the absolute bound
        c.VersionMetrics(requests=1000, errors=0, p99_ms=60.0),  # p99 over 2x stable
    ],
    ids=["error-rate", "p99-absolute", "p99-relative"],
)
def test_a_breach_at_any_step_rolls_back_within_one_interval(failing_step, bad):
    plan = c.Plan("cand-a", dataclasses.replace(ANALYSIS, max_p99_ms=500, max_p99_ratio=2.0))
    observations = [SEEN] * (2 + failing_step) + [dataclasses.replace(SEEN, canary=bad)]
    status, actions, phases, _ = drive(plan, observations)
    assert phases[-1] == c.ROLLED_BACK
    assert phases[-2] == c.PROGRESSING  # one interval at the failing weight, then back
    assert weights(actions)[-1] == 0 and isinstance(actions[-2], c.RemoveCanary)
    assert status.failed_candidate == "cand-a" and status.weight == 0
    assert "change spec.canary" in status.message
    assert any(isinstance(a, c.Event) and a.reason == "CanaryRolledBack" and a.warning for a in actions)


def test_failure_limit_tolerates_that_many_failed_intervals():
    plan = c.Plan("cand-a", dataclasses.replace(ANALYSIS, failure_limit=1))
    bad = dataclasses.replace(SEEN, canary=c.VersionMetrics(1000, 500))
    status, _actions, phases, _ = drive(plan, [SEEN, SEEN, bad])
    assert phases[-1] == c.PROGRESSING and status.weight == 5 and status.failures == 1  # held, not advanced
    status, _, phases, _ = drive(plan, [bad], status=status, start=5000)
    assert phases == [c.ROLLED_BACK]


@pytest.mark.parametrize(
    "observation",
    [
        dataclasses.replace(SEEN, canary=None),  # a metrics outage
        dataclasses.replace(SEEN, canary=c.VersionMetrics(requests=10, errors=0)),  # under minRequests
        dataclasses.replace(SEEN, canary=c.VersionMetrics(requests=math.nan, errors=0)),  # NaN
        dataclasses.replace(SEEN, canary=c.VersionMetrics(requests=0, errors=0)),  # an empty result
    ],
    ids=["outage", "too-few", "nan", "empty"],
)
def test_missing_data_is_inconclusive_never_advances_and_rolls_back_after_the_limit(observation):
    status, actions, phases, _ = drive(PLAN, [SEEN, SEEN] + [observation] * 3)
    assert phases[2:] == [c.PROGRESSING, c.PROGRESSING, c.ROLLED_BACK]  # limit 2: the third rolls back
    assert weights(actions) == [5, 0]  # never advanced past the first step
    assert status.inconclusives == 3 and "inconclusiveLimit 2" in status.message


def test_p99_relative_to_stable_without_stable_data_is_inconclusive():
    plan = c.Plan("cand-a", dataclasses.replace(ANALYSIS, max_p99_ratio=1.5))
    verdict, why = c.judge(plan.analysis, dataclasses.replace(SEEN, stable=None))
    assert verdict == c.INCONCLUSIVE and "stable p99" in why


def test_a_gate_that_says_no_holds_the_step_without_counting_against_the_candidate():
    plan = c.Plan("cand-a", dataclasses.replace(ANALYSIS, step_gate=True))
    yes = dataclasses.replace(SEEN, gate=True)
    no = dataclasses.replace(SEEN, gate=False)
    status, actions, _, _ = drive(plan, [SEEN, yes])  # gate approves the first step
    assert status.weight == 5
    status, actions, phases, _ = drive(plan, [no, no, no, no], status=status, start=5000)
    assert phases == [c.PROGRESSING] * 4 and status.weight == 5  # held at 5 %
    assert status.failures == 0 and status.inconclusives == 0
    assert all(isinstance(a, c.AskGate) for a in actions) and "gate has not approved 25%" in status.message
    status, actions, _, _ = drive(plan, [yes], status=status, start=9000)
    assert status.weight == 25


def test_the_promotion_gate_holds_promotion():
    plan = c.Plan("cand-a", dataclasses.replace(ANALYSIS, step_weights=(50, 100), promotion_gate=True))
    status, actions, phases, _ = drive(plan, [SEEN] * 5)
    assert phases[-1] == c.PROGRESSING and status.weight == 100
    assert isinstance(actions[-1], c.AskGate) and actions[-1].purpose == "promotion"
    status, _, phases, _ = drive(plan, [dataclasses.replace(SEEN, gate=True)], status=status, start=9000)
    assert phases == [c.PROMOTING]


@pytest.mark.parametrize("gate", ["step", "promotion"])
def test_while_the_gate_holds_quiet_intervals_do_not_count_and_the_canary_is_judged_once_per_interval(gate):
    """A person takes hours to approve; at night the canary sees too few requests (or the metrics are
    briefly unreadable). The gate is asked every 30 s, the canary judged once per interval, and
    inconclusive intervals do not count against it (each gate poll used to re-judge the passed
    interval, and three of them rolled a passed candidate back within 90 s)."""
    analysis = dataclasses.replace(ANALYSIS, step_weights=(5, 25), interval_s=600, inconclusive_limit=2,
                                   step_gate=gate == "step", promotion_gate=gate == "promotion")
    plan = c.Plan("cand-a", analysis)
    yes = dataclasses.replace(SEEN, gate=True)
    if gate == "step":
        status, _, _, now = drive(plan, [SEEN, yes])  # at 5 %, approved
        decision = c.step(plan, status, SEEN, now)  # the interval passed: the gate is asked for 25 %
    else:
        status, _, _, now = drive(plan, [SEEN, SEEN, SEEN])  # 5 % then 25 % passed
        decision = c.step(plan, status, SEEN, now)
    held = decision.status
    assert held.awaiting_gate == gate and held.phase == c.PROGRESSING
    assert any(isinstance(a, c.AskGate) and a.purpose == gate for a in decision.actions)
    quiet = dataclasses.replace(SEEN, canary=c.VersionMetrics(requests=3, errors=0), gate=False)
    now += decision.requeue_after_s
    judged_at = []
    for _ in range(200):  # 100 minutes of gate polls
        decision = c.step(plan, held, quiet, now)
        assert decision.status.phase == c.PROGRESSING, decision.status.message
        assert any(isinstance(a, c.AskGate) for a in decision.actions)
        if decision.judged:
            judged_at.append(now)
        held = decision.status
        assert decision.requeue_after_s <= 30
        now += decision.requeue_after_s
    assert held.inconclusives == 0 and held.failures == 0
    assert ("waiting for the gate to approve promotion (it said no)" if gate == "promotion"
            else "the gate has not approved 25% (it said no)") in held.message
    assert len(judged_at) == 10 and all(b - a == pytest.approx(600) for a, b in itertools.pairwise(judged_at))
    decision = c.step(plan, held, yes, now)
    assert decision.status.phase == (c.PROGRESSING if gate == "step" else c.PROMOTING)
    assert decision.status.awaiting_gate == ""
    assert decision.status.weight == (25 if gate == "step" else held.weight)


def test_a_canary_that_fails_while_the_gate_holds_is_rolled_back():
    plan = c.Plan("cand-a", dataclasses.replace(ANALYSIS, step_weights=(50,), promotion_gate=True))
    status, _, _, now = drive(plan, [SEEN, SEEN])
    decision = c.step(plan, status, SEEN, now)
    assert decision.status.awaiting_gate == "promotion"
    bad = dataclasses.replace(SEEN, canary=c.VersionMetrics(requests=1000, errors=500), gate=False)
    status, actions, phases, _ = drive(plan, [bad] * 30, status=decision.status, start=now + 30)
    assert phases[-1] == c.ROLLED_BACK and "failed while the gate held it" in status.message
    assert status.awaiting_gate == "" and weights(actions)[-1] == 0


def test_switching_between_analysis_and_a_manual_split_never_points_a_weight_at_a_canary_without_pods():
    """Analysis removed at 50 % while the canary has no ready pods: its weight goes to 0 until they are
    ready (it stayed 50 % for ever); a manual split that gets an analysis while its canary has no pods
    waits for them before the first step (it went straight to 5 %)."""
    unready = c.Observation(canary_ready=False, canary_serving=False)
    at_half = c.Status(phase=c.PROGRESSING, candidate="cand-a", step=2, weight=50, interval_started=0.0)
    manual = c.Plan("cand-a", None, traffic_percent=10)
    decision = c.step(manual, at_half, unready, 10.0)
    assert decision.status.weight == 0 and c.SetWeight(0) in decision.actions
    assert decision.status.phase == c.INITIALIZING
    decision = c.step(manual, decision.status, SEEN, 40.0)  # its pods are ready: the manual split
    assert (decision.status.phase, decision.status.weight) == (c.MANUAL, 10)

    parked = c.Status(phase=c.MANUAL, candidate="cand-a", step=-1, weight=0)
    decision = c.step(PLAN, parked, unready, 100.0)
    assert decision.status.phase == c.INITIALIZING and decision.status.weight == 0
    assert not [a for a in decision.actions if isinstance(a, c.SetWeight) and a.percent]
    decision = c.step(PLAN, decision.status, SEEN, 130.0)
    assert (decision.status.phase, decision.status.weight) == (c.PROGRESSING, 5)


def test_a_clock_stepped_back_restarts_the_interval_instead_of_stalling_for_the_step():
    status, _, _, now = drive(PLAN, [SEEN, SEEN])  # at 5 %, the interval began at ``now - 60``
    decision = c.step(PLAN, status, SEEN, now - 7200)  # NTP stepped the clock two hours back
    assert decision.requeue_after_s == pytest.approx(60)  # it asked to wait 7260 s
    assert decision.status.interval_started == now - 7200


def test_a_tiny_error_rate_bound_is_written_so_that_it_can_be_read():
    analysis = dataclasses.replace(ANALYSIS, max_error_rate=0.00001)  # maxErrorRatePercent 0.001
    verdict, why = c.judge(analysis, dataclasses.replace(SEEN, canary=c.VersionMetrics(requests=100000, errors=5)))
    assert verdict == c.FAILED and why == "canary error rate 0.005% is over 0.001%"  # it said 0.00% over 0.00%
    assert c.judge(ANALYSIS, SEEN)[1] == "1000 requests, error rate 0.20%"
    bound = dataclasses.replace(ANALYSIS, max_error_rate=0.01)
    just_over = dataclasses.replace(SEEN, canary=c.VersionMetrics(requests=100000, errors=1001))
    assert c.judge(bound, just_over)[1] == "canary error rate 1.001% is over 1%"  # not 1.00% over 1.00%


def _held_for_the_step_gate(plan):
    yes = dataclasses.replace(SEEN, gate=True)
    status, _, _, now = drive(plan, [SEEN, yes])  # at 5 %, approved
    status, _, _, now = drive(plan, [yes], status=status, start=now)  # at 25 %
    decision = c.step(plan, status, SEEN, now)  # 25 % passed: the gate is asked for the next step
    assert decision.status.awaiting_gate == "step" and decision.status.weight == 25
    return decision.status, now


def test_steps_shortened_while_the_gate_holds_lead_to_the_promotion():
    """Held before 50 % of (5, 25, 50), the steps become (5, 25): the next move is the promotion (an
    approval raised IndexError, and the reconciler failed on every pass)."""
    long = c.Plan("cand-a", dataclasses.replace(ANALYSIS, step_weights=(5, 25, 50), step_gate=True))
    held, now = _held_for_the_step_gate(long)
    short = c.Plan("cand-a", dataclasses.replace(long.analysis, step_weights=(5, 25)))
    decision = c.step(short, held, dataclasses.replace(SEEN, gate=True), now + 30)
    assert decision.status.phase == c.PROMOTING and decision.status.awaiting_gate == ""
    gated = c.Plan("cand-a", dataclasses.replace(short.analysis, promotion_gate=True))
    decision = c.step(gated, held, dataclasses.replace(SEEN, gate=False), now + 30)
    assert decision.status.awaiting_gate == "promotion" and "approve promotion (it said no)" in decision.status.message


def test_turning_the_gate_off_releases_a_held_rollout():
    plan = c.Plan("cand-a", dataclasses.replace(ANALYSIS, step_gate=True))
    held, now = _held_for_the_step_gate(plan)
    off = c.Plan("cand-a", dataclasses.replace(plan.analysis, step_gate=False))
    decision = c.step(off, held, SEEN, now + 30)  # nobody is asked now: it held for ever
    assert (decision.status.phase, decision.status.weight, decision.status.awaiting_gate) == (c.PROGRESSING, 50, "")


def test_a_canary_never_ready_after_a_switch_to_manual_and_back_is_rolled_back_at_the_deadline():
    unready = c.Observation(canary_ready=False, canary_serving=False)
    at_half = c.Status(phase=c.PROGRESSING, candidate="cand-a", step=2, weight=50, interval_started=0.0,
                       awaiting_gate="step")
    decision = c.step(c.Plan("cand-a", None, traffic_percent=10), at_half, unready, 100.0)
    assert (decision.status.step, decision.status.awaiting_gate) == (-1, "")
    status, _, phases, _ = drive(PLAN, [unready] * 30, status=decision.status, start=200.0)
    assert phases[-1] == c.ROLLED_BACK and "progressDeadlineSeconds" in status.message


CONFIG_V2 = 'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n'


def _folding_spec(model: dict, canary: dict | None, runtime: dict | None = None):
    from sluice.operator import api

    spec = {"model": {"format": "onnx", **model}, **({"canary": canary} if canary else {})}
    if runtime:
        spec["runtime"] = runtime
    return api.parse_inference_model("clf", spec)


V1 = {"storageUri": "s3://m/clf/v1", "version": 1}
V2_CANARY = {"storageUri": "s3://m/clf/v2", "version": 2, "config": CONFIG_V2}
V3_CANARY = {"storageUri": "s3://m/clf/v3", "version": 3}


def _promoted(spec, phase=c.SUCCEEDED):
    plan = c.plan_of(spec)
    return c.Status(phase=phase, candidate=plan.candidate, serves=plan.serves)


@pytest.mark.parametrize(("folded", "runtime", "refused"), [
    (V1, {"maxBatchSize": 4}, True),  # not folded: the stable pods would go back to v1
    ({"storageUri": "s3://m/clf/v2", "version": 2, "config": CONFIG_V2}, None, False),  # folded (runtime dropped,
    # as an inline config requires)
    ({"storageUri": "s3://m/clf/v2", "version": 2, "config": CONFIG_V2, "checksum": "sha256:" + "ab" * 32}, None,
     False),  # folded, with a checksum for the same files
    ({"storageUri": "s3://m/clf/v2", "version": 2}, {"maxBatchSize": 4}, True),  # its config left out
])
def test_a_next_candidate_is_refused_only_until_the_promoted_one_is_folded(folded, runtime, refused):
    promoted = _promoted(_folding_spec(V1, V2_CANARY, {"maxBatchSize": 4}))
    why = c.unfolded(_folding_spec(folded, V3_CANARY, runtime), promoted)
    assert (why is not None) == refused, why
    if refused:
        assert "fold it and remove spec.canary first" in why


def test_the_fold_is_also_awaited_while_finalising_and_read_into_older_statuses():
    v2 = _folding_spec(V1, V2_CANARY)
    assert c.unfolded(_folding_spec(V1, V3_CANARY), _promoted(v2, c.FINALISING)) is not None
    assert c.unfolded(_folding_spec(V1, V3_CANARY), _promoted(v2, c.PROGRESSING)) is None  # not promoted: a restart
    older = dataclasses.replace(_promoted(v2, c.FINALISING), serves="")  # written before serves was kept
    decision = c.step(c.plan_of(v2), older, c.Observation(canary_ready=True, stable_rolled_out=True), 100.0)
    assert decision.status.serves == c.plan_of(v2).serves


def test_the_awaited_gate_survives_the_status_round_trip():
    status = c.Status(phase=c.PROGRESSING, candidate="x", step=0, weight=5, awaiting_gate="promotion")
    assert c.status_from(c.status_to(status)) == status


def test_a_new_candidate_mid_rollout_restarts_and_first_takes_the_old_weight_away():
    status, _, _, now = drive(PLAN, [SEEN] * 3)  # at 25 % for cand-a
    assert status.weight == 25
    decision = c.step(c.Plan("cand-b", ANALYSIS), status, SEEN, now)
    assert decision.actions[0] == c.SetWeight(0)  # no stale route to the old canary
    assert decision.actions[1] == c.EnsureCanary("cand-b")
    assert decision.status.phase == c.INITIALIZING and decision.status.candidate == "cand-b"
    assert (decision.status.step, decision.status.failures, decision.status.inconclusives) == (-1, 0, 0)


def test_an_operator_restart_resumes_from_the_status_alone():
    status, _, _, now = drive(PLAN, [SEEN] * 3)
    stored = dataclasses.asdict(status)  # what status.canary holds on the resource
    resumed = c.Status(**stored)
    assert c.step(PLAN, resumed, SEEN, now) == c.step(PLAN, status, SEEN, now)


def test_a_failed_candidate_is_not_retried_until_the_spec_changes():
    bad = dataclasses.replace(SEEN, canary=c.VersionMetrics(1000, 500))
    status, _, _, now = drive(PLAN, [SEEN, SEEN, bad])
    assert status.phase == c.ROLLED_BACK
    again = c.step(PLAN, status, SEEN, now + 3600)
    assert again.status == status and again.actions == ()  # nothing redeployed
    other, _, phases, _ = drive(c.Plan("cand-b", ANALYSIS), [SEEN, SEEN], status=status, start=now)
    assert phases == [c.INITIALIZING, c.PROGRESSING] and other.failed_candidate == "cand-a"
    back = c.step(PLAN, other, SEEN, now + 7200)  # set back to the failed one mid-rollout of cand-b
    assert back.status.phase == c.ROLLED_BACK and back.actions[0] == c.SetWeight(0)


def test_a_canary_losing_its_pods_gets_no_traffic_at_once_then_waits_out_the_progress_deadline():
    """Flagger halts the analysis of an unhealthy canary and rolls back at the progress deadline: its
    weight goes to stable at once (a weight never points at a version without ready pods)."""
    status, _, _, now = drive(PLAN, [SEEN, SEEN, SEEN])  # at 25 %
    gone = dataclasses.replace(SEEN, canary_ready=False)
    lost = c.step(PLAN, status, gone, now - 50)  # mid-interval: an eviction, a crash
    assert lost.status.phase == c.PROGRESSING and lost.status.weight == 0 and c.SetWeight(0) in lost.actions
    assert lost.status.unready_since == now - 50 and lost.status.failures == 0
    still = c.step(PLAN, lost.status, gone, now - 50 + ANALYSIS.progress_deadline_s - 1)
    assert still.status.phase == c.PROGRESSING and still.actions == ()
    back = c.step(PLAN, still.status, SEEN, now + 100)  # ready again within the deadline
    assert back.status.weight == 25 and back.actions[0] == c.SetWeight(25)
    assert back.status.interval_started == now + 100 and back.status.failed_candidate == ""
    assert back.status.unready_since == now - 50  # kept until an interval passes
    over = c.step(PLAN, lost.status, gone, now - 50 + ANALYSIS.progress_deadline_s)
    assert over.status.phase == c.ROLLED_BACK and over.status.failed_candidate == "cand-a"
    assert "progressDeadlineSeconds" in over.status.message
    passed = c.step(PLAN, back.status, SEEN, now + 100 + ANALYSIS.interval_s)  # a whole interval served
    assert passed.judged and passed.status.weight == 50 and passed.status.unready_since == 0


def test_a_canary_that_keeps_losing_its_pods_is_rolled_back_at_the_deadline():
    """Up less than an interval, down again, many times (crashing under its traffic): the deadline runs
    from its first outage until an interval passes, so it does not get its traffic back for ever."""
    status, _, _, now = drive(PLAN, [SEEN, SEEN])
    gone = dataclasses.replace(SEEN, canary_ready=False)
    first_outage = now - 50
    for cycle in range(100):
        at = first_outage + cycle * 45
        decision = c.step(PLAN, status, gone if cycle % 2 == 0 else SEEN, at)
        status = decision.status
        if status.phase == c.ROLLED_BACK:
            break
    assert status.phase == c.ROLLED_BACK and at - first_outage >= ANALYSIS.progress_deadline_s
    assert at - first_outage < ANALYSIS.progress_deadline_s + 2 * 45


def test_a_canary_whose_pods_roll_keeps_its_analysis():
    """A template change that keeps the candidate (an operator upgrade rendering the pods anew) rolls the
    canary's pods: they are all the candidate's and one is available, so nothing is held."""
    status, _, _, now = drive(PLAN, [SEEN, SEEN])
    rolling = dataclasses.replace(SEEN, canary_ready=False, canary_serving=True)
    mid = c.step(PLAN, status, rolling, now - 50)
    assert mid.status == status and mid.actions == ()
    judged = c.step(PLAN, status, rolling, now)
    assert judged.status.weight == 25 and judged.status.last_result == c.SUCCESSFUL


def test_no_baseline_restarts_the_interval_without_counting_it():
    """A scraping operator that restarted has nothing to count the interval from: the interval starts
    again, never Inconclusive (with inconclusiveLimit 0 that would roll a healthy canary back)."""
    plan = c.Plan("cand-a", dataclasses.replace(ANALYSIS, inconclusive_limit=0))
    status, _, _, now = drive(plan, [SEEN, SEEN])
    fresh = c.step(plan, status, dataclasses.replace(SEEN, canary=None, stable=None, no_baseline=True), now)
    assert fresh.status.phase == c.PROGRESSING and fresh.status.inconclusives == 0
    assert fresh.status.interval_started == now and fresh.status.weight == 5 and fresh.actions == ()
    none = c.step(plan, status, dataclasses.replace(SEEN, canary=None, stable=None), now)  # a real outage
    assert none.status.phase == c.ROLLED_BACK


def test_promoting_takes_the_weight_off_a_canary_without_pods():
    status, _, phases, now = drive(PLAN, [SEEN] * 6)
    assert phases[-1] == c.PROMOTING and status.weight == 100
    gone = dataclasses.replace(SEEN, canary_ready=False)
    held = c.step(PLAN, status, gone, now)
    assert held.status.phase == c.PROMOTING and held.status.weight == 0
    assert c.SetWeight(0) in held.actions and c.Promote("cand-a") in held.actions
    late = c.step(PLAN, held.status, gone, now + ANALYSIS.progress_deadline_s + 1)  # the candidate is in stable
    assert late.status.phase == c.PROMOTING and late.status.failed_candidate == ""
    back = c.step(PLAN, late.status, SEEN, now + ANALYSIS.progress_deadline_s + 2)
    assert back.status.weight == 100 and c.SetWeight(100) in back.actions
    done = c.step(PLAN, back.status, dataclasses.replace(gone, stable_rolled_out=True), now + 900)
    assert done.status.phase == c.FINALISING and done.status.weight == 0


def test_no_weight_before_the_canary_has_ready_pods():
    not_ready = dataclasses.replace(SEEN, canary_ready=False)
    _status, actions, phases, _ = drive(PLAN, [not_ready] * 4)
    assert phases == [c.INITIALIZING] * 4 and weights(actions) == []


def test_a_candidate_never_ready_rolls_back_at_the_progress_deadline():
    plan = c.Plan("cand-a", dataclasses.replace(ANALYSIS, progress_deadline_s=600))
    not_ready = dataclasses.replace(SEEN, canary_ready=False)
    started = c.step(plan, c.Status(), not_ready, 1000.0).status
    held = c.step(plan, started, not_ready, 1000.0 + 599)
    assert held.status.phase == c.INITIALIZING and held.status.weight == 0
    rolled = c.step(plan, held.status, not_ready, 1000.0 + 600)
    assert rolled.status.phase == c.ROLLED_BACK and rolled.status.failed_candidate == "cand-a"
    assert "not ready within progressDeadlineSeconds 600" in rolled.status.message
    manual = c.Plan("cand-a", None, 10)  # a manual split has no deadline: it waits for its pods
    waiting = c.step(manual, c.step(manual, c.Status(), not_ready, 0).status, not_ready, 10_000)
    assert waiting.status.phase == c.INITIALIZING


def test_promotion_keeps_the_canary_weight_until_stable_is_rolled_out():
    status, actions, phases, _ = drive(PLAN, [SEEN] * 6 + [SEEN] * 3)  # stable never finishes
    assert phases[-3:] == [c.PROMOTING] * 3 and status.weight == 100
    assert weights(actions)[-1] == 100


def test_a_stable_rollout_past_the_progress_deadline_is_said_once_and_not_rolled_back():
    plan = c.Plan("cand-a", dataclasses.replace(ANALYSIS, progress_deadline_s=600))
    status, _, phases, now = drive(plan, [SEEN] * 6)
    assert phases[-1] == c.PROMOTING and status.interval_started == now - ANALYSIS.interval_s
    promoted_at = status.interval_started
    waiting = c.step(plan, status, SEEN, promoted_at + 599)
    assert waiting.status.message == "promoting: waiting for the stable Deployment to roll out"
    assert not [a for a in waiting.actions if isinstance(a, c.Event)]
    stalled = c.step(plan, waiting.status, SEEN, promoted_at + 600)
    assert stalled.status.phase == c.PROMOTING and stalled.status.weight == 100
    assert "has not rolled out within progressDeadlineSeconds 600" in stalled.status.message
    assert [(a.reason, a.warning) for a in stalled.actions if isinstance(a, c.Event)] == [
        ("CanaryPromotionStalled", True)
    ]
    assert c.Promote("cand-a") in stalled.actions  # still asked for: stable rolls on when it can
    again = c.step(plan, stalled.status, SEEN, promoted_at + 700)
    assert again.status.message == stalled.status.message and not [a for a in again.actions if isinstance(a, c.Event)]
    # the canary losing its pods meanwhile neither restarts the promotion's clock nor repeats the Event
    gone = c.step(plan, again.status, dataclasses.replace(SEEN, canary_ready=False), promoted_at + 800)
    assert gone.status.weight == 0 and gone.status.interval_started == promoted_at
    assert not [a for a in gone.actions if isinstance(a, c.Event) and a.reason == "CanaryPromotionStalled"]
    back = c.step(plan, gone.status, SEEN, promoted_at + 900)
    assert back.status.weight == 100 and back.status.interval_started == promoted_at
    done = c.step(plan, back.status, dataclasses.replace(SEEN, stable_rolled_out=True), promoted_at + 1000)
    assert done.status.phase == c.FINALISING


def test_manual_split_follows_the_spec_and_readiness():
    plan = c.Plan("cand-a", None, traffic_percent=20)
    status, actions, phases, _ = drive(plan, [SEEN, SEEN, SEEN])
    assert phases == [c.INITIALIZING, c.MANUAL, c.MANUAL] and weights(actions) == [20]
    lost = c.step(plan, status, dataclasses.replace(SEEN, canary_ready=False), 5000)
    assert lost.status.weight == 0 and c.SetWeight(0) in lost.actions


def test_removing_spec_canary_aborts_a_rollout():
    status, _, _, now = drive(PLAN, [SEEN] * 3)
    decision = c.step(None, status, SEEN, now)
    assert decision.actions[:2] == (c.SetWeight(0), c.RemoveCanary())
    assert decision.status.phase == c.IDLE
    assert c.step(None, decision.status, SEEN, now).actions == ()


@pytest.mark.parametrize(
    ("metrics", "verdict"),
    [
        (c.VersionMetrics(1000, 10, 20.0), c.SUCCESSFUL),  # exactly at the bound
        (c.VersionMetrics(1000, 11, 20.0), c.FAILED),
        (c.VersionMetrics(100, 0, None), c.SUCCESSFUL),  # exactly minRequests, no latency bound set
        (c.VersionMetrics(99, 0, None), c.INCONCLUSIVE),
        (c.VersionMetrics(1000, math.nan, 20.0), c.INCONCLUSIVE),
        (c.VersionMetrics(1000, 0, math.nan), c.SUCCESSFUL),  # no latency bound: p99 is not judged
    ],
)
def test_judge_table(metrics, verdict):
    assert c.judge(ANALYSIS, dataclasses.replace(SEEN, canary=metrics))[0] == verdict


@pytest.mark.parametrize("p99", [None, math.nan])
def test_a_latency_bound_without_latency_data_is_inconclusive(p99):
    bounded = dataclasses.replace(ANALYSIS, max_p99_ms=100)
    verdict, why = c.judge(bounded, dataclasses.replace(SEEN, canary=c.VersionMetrics(1000, 0, p99)))
    assert verdict == c.INCONCLUSIVE and "p99" in why


def _spec(canary: dict, **extra) -> object:
    from sluice.operator import api

    return api.parse_inference_model(
        "m", {"model": {"storageUri": "s3://b/m", "format": "onnx"}, "canary": canary, **extra}
    )


def test_the_plan_follows_the_spec_and_names_the_candidate_by_what_changes_its_pods():
    base = {"storageUri": "s3://b/m2", "version": 2, "analysis": {"stepWeights": [10, 100], "minRequests": 7}}
    plan = c.plan_of(_spec(base))
    assert plan is not None and plan.analysis is not None
    assert plan.analysis.step_weights == (10, 100) and plan.analysis.min_requests == 7
    assert plan.analysis.max_error_rate == pytest.approx(0.01)  # 1 % as a fraction
    assert plan.candidate.startswith("v2-")
    # thresholds are not the candidate: the same rollout goes on
    stricter = {**base, "analysis": {**base["analysis"], "maxErrorRatePercent": 0.1}}
    assert c.plan_of(_spec(stricter)).candidate == plan.candidate
    # anything that changes the pods is a new candidate
    assert c.plan_of(_spec({**base, "storageUri": "s3://b/m3"})).candidate != plan.candidate
    assert c.plan_of(_spec(base, runtime={"maxBatchSize": 8})).candidate != plan.candidate
    manual = c.plan_of(_spec({"storageUri": "s3://b/m2", "version": 2, "trafficPercent": 30}))
    assert manual is not None and manual.analysis is None and manual.traffic_percent == 30
    assert c.plan_of(api_spec_without_canary()) is None


@pytest.mark.parametrize(
    ("canary_changes", "spec_changes"),
    [
        ({"checksum": "sha256:" + "b" * 64}, {}),
        ({"sizeLimit": "20Gi"}, {}),
        ({}, {"shutdown": {"graceSeconds": 90}}),
        ({}, {"storage": {"serviceAccountName": "reader"}}),
        ({}, {"server": {"protocolWorkers": 2}}),
        ({}, {"model": {"storageUri": "s3://b/m", "format": "onnx", "sizeLimit": "5Gi"}}),  # inherited
    ],
    ids=["canary.checksum", "canary.sizeLimit", "shutdown", "storage", "server", "inherited model.sizeLimit"],
)
def test_every_spec_change_that_rolls_the_canary_pods_is_a_new_candidate(canary_changes, spec_changes):
    """Each of these changes the canary Deployment's pod template: under the same candidate, its pods
    would roll mid-analysis (Flagger: any change of the pod spec is a new revision)."""
    from sluice.operator import builders
    from sluice.operator.settings import Settings

    base = {"storageUri": "s3://b/m2", "version": 2, "checksum": "sha256:" + "a" * 64, "analysis": {}}

    def parsed(canary: dict, **extra: object):
        body = {"model": {"storageUri": "s3://b/m", "format": "onnx"}, "canary": canary, **extra}
        return c.plan_of(_spec(canary, **extra)), body

    def template(body: dict, candidate: str) -> dict:
        from sluice.operator import api

        spec = api.parse_inference_model("m", body)
        rollout = builders.Rollout(candidate=candidate, canary=True, promoted=False, weight=5, router="none",
                                   routed=True)
        owner = builders.Owner("InferenceModel", "m", "ns", "uid")
        objects = builders.inference_model(owner, spec, Settings(), rollout=rollout).objects
        return next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "m-canary")

    before, body = parsed(base)
    after, changed = parsed({**base, **canary_changes}, **spec_changes)
    assert template(changed, "same")["spec"]["template"] != template(body, "same")["spec"]["template"]
    assert after.candidate != before.candidate


def api_spec_without_canary():
    from sluice.operator import api

    return api.parse_inference_model("m", {"model": {"storageUri": "s3://b/m", "format": "onnx"}})


def test_a_promoted_model_whose_pods_change_around_it_stays_promoted():
    """After Succeeded (spec.canary not yet folded into spec.model), a change of resources, storage,
    shutdown or server settings is not a new rollout of the same model: it would put the stable pods
    back on spec.model's version and analyse the promoted one again."""
    def spec(**extra):
        return _spec({"storageUri": "s3://b/m2", "version": 2, "analysis": {}}, **extra)

    before, after = c.plan_of(spec()), c.plan_of(spec(shutdown={"graceSeconds": 90}))
    assert before.candidate != after.candidate and c.same_model(before.candidate, after.candidate)
    done = c.Status(phase=c.SUCCEEDED, candidate=before.candidate)
    decision = c.step(after, done, SEEN, 5000.0)
    assert decision.status.phase == c.SUCCEEDED and decision.status.candidate == after.candidate
    assert decision.actions == ()
    other = c.plan_of(_spec({"storageUri": "s3://b/m3", "version": 2, "analysis": {}}))
    assert not c.same_model(before.candidate, other.candidate)
    assert c.step(other, done, SEEN, 5000.0).status.phase == c.INITIALIZING  # another model: a rollout


def test_a_status_written_by_an_older_operator_keeps_its_rollout():
    """Operators before 2026-11-27 hashed fewer fields: their candidate names are read as today's, so
    an upgrade neither restarts a finished rollout nor retries a rolled-back candidate."""
    plan = c.plan_of(_spec({"storageUri": "s3://b/m2", "version": 2, "analysis": {}}))
    assert plan.legacy and plan.legacy != plan.candidate
    done = c.step(plan, c.Status(phase=c.SUCCEEDED, candidate=plan.legacy), SEEN, 1.0)
    assert done.status.phase == c.SUCCEEDED and done.status.candidate == plan.candidate and done.actions == ()
    failed = c.Status(phase=c.ROLLED_BACK, candidate=plan.legacy, failed_candidate=plan.legacy)
    again = c.step(plan, failed, SEEN, 1.0)
    assert again.status.phase == c.ROLLED_BACK and again.status.failed_candidate == plan.candidate
    assert not any(isinstance(a, c.EnsureCanary) for a in again.actions)


def test_an_outage_remembered_in_progressing_does_not_follow_into_a_new_analysis():
    status, _, _, now = drive(PLAN, [SEEN, SEEN])
    held = c.step(PLAN, status, dataclasses.replace(SEEN, canary_ready=False), now).status
    assert held.unready_since == now
    manual = c.step(c.Plan("cand-a", None, 30), held, SEEN, now + 10).status  # switched to a manual split
    restarted = c.step(PLAN, manual, SEEN, now + 5000)  # analysis back on, hours later
    assert restarted.status.phase == c.PROGRESSING and restarted.status.unready_since == 0
    brief = c.step(PLAN, restarted.status, dataclasses.replace(SEEN, canary_ready=False), now + 5001)
    assert brief.status.phase == c.PROGRESSING  # held, not rolled back for the old outage
