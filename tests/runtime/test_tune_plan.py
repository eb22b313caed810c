"""The planner of ``sluice tune`` (runtime/tune_plan.py): pure functions, no server, no clock."""

from __future__ import annotations

import dataclasses
import math
import statistics

import pytest
from google.protobuf import text_format
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import model_config_pb2 as mc

from sluice.runtime import tune_plan as plan

WC, FW = plan.WORK_CONSERVING, plan.FIXED_WAIT


def facts(max_batch: int = 64, current: plan.BatchingConfig | None = None, **kw) -> plan.ModelFacts:
    return plan.ModelFacts("m", max_batch, current or plan.BatchingConfig(WC, 1), cpus=kw.pop("cpus", 2), **kw)


def linear_curve(fixed_ms: float, per_row_ms: float, overhead_ms: float = 0.5, loop_ms: float = 0.1,
                 batch_ms: float = 0.05, max_batch: int = 64) -> plan.CostCurve:
    points = tuple((b, (fixed_ms + per_row_ms * b) / 1e3) for b in plan.cost_sizes(max_batch))
    return plan.CostCurve(points, overhead_ms / 1e3, loop_ms / 1e3, batch_ms / 1e3)


# -- durations ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "seconds"), [
    ("300", 300), ("90s", 90), ("5m", 300), ("1m30s", 90), ("1.5h", 5400), ("500ms", 0.5), (" 2M ", 120),
])
def test_parse_duration(text, seconds):
    assert plan.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "5x", "-1", "m5", "5m x", "1.2.3", "0", "0s"])
def test_parse_duration_refuses_what_is_not_a_positive_duration(text):
    with pytest.raises(plan.PlanError, match="allowed"):
        plan.parse_duration(text)


# -- candidate space ------------------------------------------------------------------------------


def test_candidate_space_covers_policies_instances_preferred_sizes_and_delays():
    current = plan.BatchingConfig(WC, 1, (), 500)
    space = plan.candidate_space(facts(64, current), plan.SearchSpace(max_instances=4, delays_us=(250, 1000)))
    assert space[0] == current
    assert len(space) == len(set(space))
    assert {c.instances for c in space} == {1, 2, 4}
    assert {c.policy for c in space} == {WC, FW}
    assert {c.preferred for c in space if c.policy == FW} == {(), (2,), (4,), (8,), (16,), (32,), (64,)}
    assert {c.delay_us for c in space if c.policy == FW} == {250, 1000}
    # work-conserving candidates keep the model's preferred sizes and delay (they make no one wait)
    assert {(c.preferred, c.delay_us) for c in space if c.policy == WC} == {((), 500)}


def test_a_model_that_does_not_batch_gets_only_instance_counts():
    current = plan.BatchingConfig(WC, 1)
    space = plan.candidate_space(facts(0, current), plan.SearchSpace(max_instances=3))
    assert [c.instances for c in space] == [1, 2, 3]
    assert {(c.policy, c.preferred, c.delay_us) for c in space} == {(WC, (), 0)}


def test_several_instance_groups_keep_their_count():
    current = plan.BatchingConfig(WC, 3)
    space = plan.candidate_space(facts(8, current, instances_tunable=False), plan.SearchSpace())
    assert {c.instances for c in space} == {3}


def test_candidate_space_refuses_bad_knobs():
    with pytest.raises(plan.PlanError, match="max-instances"):
        plan.candidate_space(facts(), plan.SearchSpace(max_instances=0))
    with pytest.raises(plan.PlanError, match="delays-us"):
        plan.candidate_space(facts(), plan.SearchSpace(delays_us=(-1,)))


@pytest.mark.parametrize(("max_batch", "sizes"), [
    (0, (1,)), (1, (1,)), (8, (1, 2, 4, 8)), (48, (1, 2, 4, 8, 16, 32, 48)), (64, (1, 2, 4, 8, 16, 32, 64)),
])
def test_cost_sizes(max_batch, sizes):
    assert plan.cost_sizes(max_batch) == sizes


# -- cost curve -----------------------------------------------------------------------------------


def test_cost_curve_is_monotone_and_interpolates():
    samples = [plan.CostSample(1, 0.0015, 0.001), plan.CostSample(4, 0.0022, 0.0012),
               plan.CostSample(2, 0.0014, 0.0009), plan.CostSample(8, 0.0031, 0.002)]
    curve = plan.fit_cost_curve(samples)
    times = [t for _, t in curve.exec_points]
    assert times == sorted(times)  # the noisy 2 (0.9 ms < 1 ms at 1) is lifted
    assert curve.exec_s(6) == pytest.approx((0.0012 + 0.002) / 2)
    assert curve.exec_s(16) == pytest.approx(0.002 + 0.0008 / 4 * 8)  # extrapolated from the last two
    assert curve.overhead_s == pytest.approx(statistics.median([0.0005, 0.001, 0.0005, 0.0011]))


def test_loop_and_batch_costs_come_from_two_saturation_probes():
    loop, per_batch = 0.0001, 0.0003
    samples = [plan.CostSample(b, 0.001 + 0.00001 * b, 0.00001 * b) for b in (1, 2, 4, 8, 16)]
    wide = plan.Probe(throughput=1 / (loop + per_batch / 10), mean_batch=10)
    single = plan.Probe(throughput=1 / (loop + per_batch), mean_batch=1)
    curve = plan.fit_cost_curve(samples, wide, single)
    assert curve.loop_s == pytest.approx(loop, rel=1e-6)
    # the per-batch time holds the instance; a share of it also stops the loop
    assert curve.hold_s == pytest.approx(per_batch, rel=1e-6)
    assert curve.batch_s == pytest.approx(per_batch * plan.LOOP_SHARE_OF_BATCH, rel=1e-6)


def test_a_probe_the_model_bounds_does_not_count_as_loop_time():
    samples = [plan.CostSample(b, 0.011 + 0.001 * b, 0.010 + 0.001 * b) for b in (1, 2, 4, 8)]
    curve = plan.fit_cost_curve(samples, plan.Probe(throughput=8 / 0.018, mean_batch=8))
    assert curve.loop_s < 1 / (8 / 0.018)


def test_no_samples_is_an_error():
    with pytest.raises(plan.PlanError):
        plan.fit_cost_curve([])


# -- prediction -----------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    fixed_ms=st.floats(0.05, 5), per_row_ms=st.floats(0.0, 1), loop_ms=st.floats(0.01, 0.5),
    k=st.integers(1, 4), concurrency=st.integers(1, 48), cpus=st.integers(1, 4),
    fixed_wait=st.booleans(), preferred=st.sampled_from([(), (4,), (16,)]), delay_us=st.sampled_from([0, 500, 4000]),
)
def test_predictions_keep_capacity_and_littles_law(fixed_ms, per_row_ms, loop_ms, k, concurrency, cpus, fixed_wait,
                                                   preferred, delay_us):
    curve = linear_curve(fixed_ms, per_row_ms, overhead_ms=loop_ms * 3, loop_ms=loop_ms, batch_ms=0.0, max_batch=16)
    config = plan.BatchingConfig(FW if fixed_wait else WC, k, preferred, delay_us)
    f = facts(16, cpus=cpus)
    p = plan.predict(config, concurrency, curve, f)
    best_batch = min(16, concurrency)
    capacity = min(k, cpus) * best_batch / curve.exec_s(best_batch)
    assert 0 < p.throughput <= capacity / 0.85 * 1.05  # jitter makes batches up to 15 % faster
    assert p.throughput <= 1 / (curve.loop_s * 0.8) * 1.05  # the event loop serves one request at a time
    assert 1 <= p.mean_batch <= 16
    # closed loop: concurrency = throughput x mean latency (Little), here with p50 close to the mean
    assert p.p50_s <= p.p99_s
    assert concurrency / p.throughput <= p.p99_s * 1.05


def test_fixed_wait_for_a_size_the_clients_never_reach_adds_the_delay():
    curve = linear_curve(0.2, 0.01)
    wait = plan.predict(plan.BatchingConfig(FW, 1, (64,), 4000), 8, curve, facts())
    now = plan.predict(plan.BatchingConfig(WC, 1), 8, curve, facts())
    assert wait.p50_s >= 0.004
    assert now.p50_s < 0.002
    assert wait.throughput < now.throughput / 2


def test_a_reachable_preferred_size_fills_batches():
    curve = linear_curve(1.0, 0.02, loop_ms=0.02, batch_ms=0.2)
    filled = plan.predict(plan.BatchingConfig(FW, 1, (16,), 4000), 32, curve, facts())
    assert filled.mean_batch == pytest.approx(16, rel=0.1)


def test_more_instances_than_cores_do_not_add_capacity():
    curve = linear_curve(2.0, 0.0, overhead_ms=0.05, loop_ms=0.01, batch_ms=0.0)
    two = plan.predict(plan.BatchingConfig(FW, 2, (1,), 0), 16, curve, facts(cpus=2))
    four = plan.predict(plan.BatchingConfig(FW, 4, (1,), 0), 16, curve, facts(cpus=2))
    assert four.throughput <= two.throughput * 1.05


def test_a_held_instance_lets_work_conserving_batches_grow():
    # While an instance is held per batch (hand-off, GIL) the loop goes on accepting requests: under
    # a closed loop of 32 clients the next batch is larger, as the server measures (docs/tune.md).
    free = linear_curve(0.03, 0.0005, loop_ms=0.1, batch_ms=0.0)
    held = dataclasses.replace(free, hold_s=0.001)
    config = plan.BatchingConfig(WC, 1)
    assert plan.predict(config, 32, free, facts()).mean_batch < 2
    assert plan.predict(config, 32, held, facts()).mean_batch > 5


def test_with_the_instance_held_a_preferred_size_of_half_the_clients_beats_all_of_them():
    # The grid's finding on mlp (docs/tune.md): at 32 clients, batches of 16 keep the loop and the
    # instance busy in turn; batches of 32 leave each idle while the other works.
    curve = dataclasses.replace(linear_curve(0.035, 0.0002, loop_ms=0.09, batch_ms=0.1), hold_s=0.0015)
    half = plan.predict(plan.BatchingConfig(FW, 1, (16,), 4000), 32, curve, facts())
    whole = plan.predict(plan.BatchingConfig(FW, 1, (32,), 4000), 32, curve, facts())
    assert half.throughput > whole.throughput * 1.1


def test_refit_recovers_the_time_an_instance_is_held():
    truth = dataclasses.replace(linear_curve(0.035, 0.001, loop_ms=0.09, batch_ms=0.1), hold_s=0.001)
    guess = dataclasses.replace(truth, hold_s=0.00025)
    f = facts()
    measured = {}
    for config in (plan.BatchingConfig(WC, 1), plan.BatchingConfig(FW, 1, (16,), 250),
                   plan.BatchingConfig(FW, 1, (32,), 4000), plan.BatchingConfig(FW, 2, (8,), 1000)):
        p = plan.predict(config, 32, truth, f)
        point = plan.Point(config, 32)
        measured[point] = plan.Measurement(point, p.throughput, p.p50_s, p.p99_s, requests=1000, errors=0)
    assert plan.refit_curve(guess, f, measured).hold_s == pytest.approx(0.001)
    assert plan.refit_curve(guess, f, {}) == guess


def test_prediction_is_deterministic():
    curve = linear_curve(0.3, 0.05)
    config = plan.BatchingConfig(FW, 2, (8,), 1000)
    assert plan.predict(config, 16, curve, facts()) == plan.predict(config, 16, curve, facts())


# -- confirmation and the choice ------------------------------------------------------------------


def pt(policy: str, k: int, c: int = 8) -> plan.Point:
    return plan.Point(plan.BatchingConfig(policy, k), c)


def pred(x: float, p99_ms: float) -> plan.Prediction:
    return plan.Prediction(x, p99_ms / 2e3, p99_ms / 1e3, 1.0)


def meas(point: plan.Point, x: float, p99_ms: float, errors: int = 0) -> plan.Measurement:
    return plan.Measurement(point, x, p99_ms / 2e3, p99_ms / 1e3, requests=1000, errors=errors)


def fam(policy: str, preferred: tuple[int, ...], k: int = 1, c: int = 32, delay: int = 1000) -> plan.Point:
    fixed = policy == FW
    return plan.Point(plan.BatchingConfig(policy, k, preferred if fixed else (), delay if fixed else 0), c)


def short(point: plan.Point, x: float, p99_ms: float) -> plan.Measurement:
    return dataclasses.replace(meas(point, x, p99_ms), full=False)


def test_screening_measures_the_predicted_best_of_every_family_short_best_family_first():
    a1, a2 = fam(FW, (32,)), fam(FW, (32,), k=2)
    b1, b2 = fam(FW, (16,)), fam(FW, (16,), c=8)
    w = fam(WC, ())
    predictions = {a1: pred(9000, 4), a2: pred(8800, 5), b1: pred(8000, 4), b2: pred(6000, 2), w: pred(2000, 15)}
    assert plan.next_step(predictions, [], 0.020) == plan.Step(a1, False, "screen")
    done = [short(a1, 6000, 7)]
    assert plan.next_step(predictions, done, 0.020) == plan.Step(b1, False, "screen")
    done.append(short(b1, 9000, 5))
    assert plan.next_step(predictions, done, 0.020) == plan.Step(w, False, "screen")


def test_a_family_the_simulation_overrates_is_calibrated_on_its_own():
    a1, a2 = fam(FW, (32,)), fam(FW, (32,), k=2)
    b1, b2 = fam(FW, (16,)), fam(FW, (16,), k=2)
    predictions = {a1: pred(10000, 4), a2: pred(9500, 4), b1: pred(8000, 4), b2: pred(7900, 4)}
    adjusted = plan.calibrated(predictions, {a1: meas(a1, 5000, 4), b1: meas(b1, 8000, 4)})
    assert adjusted[a2].throughput == pytest.approx(4750)  # by its family's ratio, not the median of both
    assert adjusted[b2].throughput == pytest.approx(7900)
    done = [short(a1, 5000, 4), short(b1, 8000, 4)]
    racing = plan.Racing(refine_groups=1)
    # the leading family is refined (b2 is within 10 % of b1); the overrated family's runner-up is not
    assert plan.next_step(predictions, done, 0.020, racing) == plan.Step(b2, False, "refine")
    done.append(short(b2, 7000, 4))
    assert plan.next_step(predictions, done, 0.020, racing) == plan.Step(b1, True, "confirm")


def test_the_best_few_are_confirmed_full_length_and_pooled_with_their_short_runs():
    a, b, c = fam(FW, (16,)), fam(FW, (8,)), fam(WC, ())
    predictions = {a: pred(8000, 4), b: pred(7000, 4), c: pred(6000, 4)}
    racing = plan.Racing(confirm=2, refine_per_group=0)
    done = [short(a, 9000, 4), short(b, 7000, 25), short(c, 6000, 4)]
    # b's short p99 is over the 20 ms budget but within the slack: still a contender
    assert plan.next_step(predictions, done, 0.020, racing) == plan.Step(a, True, "confirm")
    done.append(meas(a, 6000, 4))  # a was lucky: pooled, it falls behind b
    pooled = plan.pooled(done)[a]
    assert pooled.full and pooled.requests == 2000
    assert pooled.throughput == pytest.approx(2000 / (1000 / 9000 + 1000 / 6000))
    assert plan.next_step(predictions, done, 0.020, racing) == plan.Step(b, True, "confirm")
    done.append(meas(b, 7000, 5))
    assert plan.next_step(predictions, done, 0.020, racing) is None  # the best two (a 7200, b 7000) are full
    assert plan.choose(done, 0.020).best.point == a
    done.append(meas(b, 9000, 5))  # measured again, b (7560 pooled) overtakes a
    assert plan.next_step(predictions, done, 0.020, racing) is None
    assert plan.choose(done, 0.020).best.point == b


def test_the_search_ends_only_when_no_unmeasured_point_is_predicted_above_the_best_measured():
    a, a2 = fam(FW, (16,)), fam(FW, (16,), delay=250)
    predictions = {a: pred(8000, 4), a2: pred(9000, 4)}
    racing = plan.Racing(refine_per_group=0, margin=0.05)
    done = [meas(a, 8000, 4)]
    assert plan.next_step(predictions, done, 0.020, racing) == plan.Step(a2, False, "predicted best")
    assert plan.next_step({a: pred(8000, 4), a2: pred(8300, 4)}, done, 0.020, racing) is None


def test_when_nothing_is_predicted_within_budget_the_fastest_are_measured_to_name_the_closest():
    a, b, c = pt(WC, 1), pt(WC, 2), pt(FW, 1)
    predictions = {a: pred(1000, 10), b: pred(900, 5), c: pred(400, 3)}
    assert plan.next_step(predictions, [], 0.001) == plan.Step(c, True, "closest")
    assert plan.next_step(predictions, [meas(c, 400, 3)], 0.001).point == b
    assert plan.next_step(predictions, [meas(c, 400, 3), meas(b, 900, 5)], 0.001) is None


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    families=st.lists(st.tuples(st.sampled_from([(), (2,), (4,), (8,), (16,), (32,)]), st.floats(0.4, 2.5),
                                st.floats(0.9, 1.1)), min_size=1, max_size=6, unique_by=lambda f: f[0]),
)
def test_when_the_simulation_is_off_by_a_factor_per_family_the_race_finds_the_best_point(data, families):
    """The search's promise: however wrong the simulation is about whole families, if it ranks points
    within each family right, the choice is within the margin of the best point, measured full length."""
    budget = 0.020
    truth: dict[plan.Point, plan.Measurement] = {}
    predictions: dict[plan.Point, plan.Prediction] = {}
    for preferred, x_factor, l_factor in families:
        for k in (1, 2):
            for delay in (250, 4000):
                for c in (1, 8, 32):
                    point = fam(FW, preferred, k=k, c=c, delay=delay)
                    x = data.draw(st.floats(100, 10000))
                    p99_ms = data.draw(st.floats(0.5, 25))
                    predictions[point] = pred(x, p99_ms)
                    truth[point] = meas(point, x * x_factor, p99_ms * l_factor)
    racing = plan.Racing()
    done: list[plan.Measurement] = []
    for _ in range(len(truth) * 2):
        step = plan.next_step(predictions, done, budget, racing)
        if step is None:
            break
        done.append(dataclasses.replace(truth[step.point], full=step.full))
    else:
        pytest.fail("the search did not end")
    within = [m for m in truth.values() if m.within(budget)]
    chosen = plan.choose(done, budget).best
    if not within:
        assert chosen is None
        return
    best = max(m.throughput for m in within)
    assert chosen is not None and chosen.full
    assert chosen.throughput * (1 + racing.margin) >= best
    assert len(plan.pooled(done)) <= len(truth)


def test_screen_durations_are_short():
    d = plan.screen_durations(plan.Durations(0.5, 0.5, 2.0))
    assert d.point_s == pytest.approx(2 / 3) and d.warmup_s == 0.15 and d.cost_s == 0.5
    assert plan.screen_durations(plan.Durations(0.5, 0.1, 0.5)).point_s == 0.25


def test_choose_best_within_budget_or_the_closest():
    a, b, c = pt(WC, 1), pt(WC, 2), pt(FW, 1)
    ms = [meas(a, 1000, 10), meas(b, 2000, 30), meas(c, 3000, 1, errors=500)]
    assert plan.choose(ms, 0.020).best == ms[0]
    assert plan.choose(ms, None).best == ms[1]  # c failed 1/3 of its requests: never chosen
    nothing = plan.choose(ms, 0.005)
    assert nothing.best is None and nothing.closest == ms[0]


def final(point: plan.Point, x: float, p99_ms: float) -> plan.Measurement:
    return dataclasses.replace(meas(point, x, p99_ms), final=True)


def test_finalists_are_the_best_few_within_the_budget_short_ones_within_the_slack():
    a, b, c, d, e = fam(FW, (32,)), fam(FW, (16,)), fam(WC, ()), fam(FW, (8,)), fam(FW, (4,))
    ms = [meas(a, 9000, 25), short(b, 8000, 25), meas(c, 7000, 10), meas(d, 6000, 10), meas(e, 9500, 40)]
    # a is full length and over the budget: out; b is short and within 1.5 x: in; e over even that.
    assert plan.finalists(ms, 0.020, plan.Racing(finalists=3)) == [b, c, d]
    assert plan.finalists(ms, None, plan.Racing(finalists=2)) == [e, a]


def test_final_order_interleaves_the_finalists_round_by_round():
    a, b, c = pt(WC, 1), pt(WC, 2), pt(FW, 1)
    assert plan.final_order([a, b, c], 2) == [a, b, c, a, b, c]
    assert plan.final_order([a], 0) == []


def test_final_rounds_fit_the_time_left_or_none_when_too_few():
    racing = plan.Racing(rounds=5, least_rounds=3)
    assert plan.final_rounds(2.0, 3, 100.0, racing) == 5
    assert plan.final_rounds(2.0, 3, 24.0, racing) == 4
    assert plan.final_rounds(2.0, 3, 17.0, racing) == 0  # two rounds only: the race's choice stands
    assert plan.final_rounds(2.0, 1, 100.0, racing) == 0  # a single finalist: nothing to rank
    # never more final runs than the whole space has points (a grid would be quicker)
    assert plan.final_rounds(2.0, 3, 100.0, racing, max_runs=12) == 4
    assert plan.final_rounds(2.0, 3, 100.0, racing, max_runs=6) == 0


def test_the_choice_ranks_finalists_by_the_median_not_by_one_lucky_run():
    a, b = pt(WC, 1), pt(WC, 2)
    race = [meas(a, 9000, 5), meas(b, 7000, 5)]
    assert plan.choose(race, 0.020).best.point == a
    # a had one lucky run; interleaved and repeated, b is steadily faster.
    finals = [final(a, 12000, 5), final(b, 8000, 5), final(a, 6000, 5), final(b, 7900, 5), final(a, 6100, 5),
              final(b, 8100, 5)]
    chosen = plan.choose(race + finals, 0.020).best
    assert chosen.point == b and chosen.throughput == 8000 and chosen.final
    assert plan.choose(race + finals, None).best.point == b


def test_the_choice_uses_the_median_p99_against_the_budget():
    a, b = pt(WC, 1), pt(WC, 2)
    finals = [final(a, 9000, 25), final(b, 7000, 5), final(a, 9100, 12), final(b, 7100, 5), final(a, 9200, 30)]
    assert plan.choose(finals, 0.020).best.point == b  # a's median p99 is 25 ms
    judged = plan.judged(finals)
    assert judged[a].throughput == 9100 and judged[a].p99_s == pytest.approx(0.025) and judged[a].requests == 3000


# -- budget ---------------------------------------------------------------------------------------


def test_plan_durations_keeps_what_was_asked_when_it_fits():
    wanted = plan.Durations(0.5, 0.5, 2.0)
    assert plan.plan_durations(300, 7, 3, 0.01, wanted) == wanted


def test_plan_durations_refuses_a_budget_that_holds_nothing():
    with pytest.raises(plan.BudgetTooSmall) as caught:
        plan.plan_durations(1.0, 7, 1, 0.01)
    assert caught.value.needed_s == pytest.approx(plan.needed_s(plan.SHORTEST, 7, 1, 0.01))


@settings(max_examples=200, deadline=None)
@given(remaining=st.floats(0, 120), n_cost=st.integers(1, 12), least=st.integers(1, 4),
       reload_s=st.floats(0, 1), point_s=st.floats(0.5, 10), warmup_s=st.floats(0, 2), cost_s=st.floats(0.15, 2))
def test_planned_durations_always_fit_the_budget(remaining, n_cost, least, reload_s, point_s, warmup_s, cost_s):
    wanted = plan.Durations(cost_s, warmup_s, point_s)
    try:
        got = plan.plan_durations(remaining, n_cost, least, reload_s, wanted)
    except plan.BudgetTooSmall as exc:
        assert exc.needed_s > remaining
        return
    assert plan.needed_s(got, n_cost, least, reload_s) <= remaining + 1e-9
    for field in dataclasses.fields(plan.Durations):
        assert getattr(got, field.name) <= getattr(wanted, field.name) + 1e-12


# -- the config change ----------------------------------------------------------------------------

MLP = """# A comment that stays.
name: "mlp"
platform: "onnxruntime_onnx"
max_batch_size: 64
dynamic_batching {
  max_queue_delay_microseconds: 500  # inline comment
  default_queue_policy { timeout_action: REJECT, default_timeout_microseconds: 5000000 }
}
instance_group [ { count: 1, kind: KIND_CPU } ]
parameters { key: "other" value { string_value: "x" } }
# trailing comment
"""


def parse(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


def test_tuned_config_changes_only_the_tuned_fields():
    original = parse(MLP)
    tuned = plan.tuned_model_config(original, plan.BatchingConfig(FW, 2, (16,), 1000), WC)
    assert tuned.parameters["batch_policy"].string_value == FW
    assert list(tuned.dynamic_batching.preferred_batch_size) == [16]
    assert tuned.dynamic_batching.max_queue_delay_microseconds == 1000
    assert tuned.dynamic_batching.default_queue_policy == original.dynamic_batching.default_queue_policy
    assert tuned.instance_group[0].count == 2 and tuned.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU
    assert tuned.parameters["other"].string_value == "x"
    assert plan.batching_of(tuned, WC) == plan.BatchingConfig(FW, 2, (16,), 1000)


def test_the_server_default_policy_is_not_written_when_the_config_names_none():
    tuned = plan.tuned_model_config(parse(MLP), plan.BatchingConfig(WC, 1, (), 500), WC)
    assert tuned == parse(MLP)


@pytest.mark.parametrize("tuned_config", [
    plan.BatchingConfig(FW, 2, (16,), 1000),
    plan.BatchingConfig(WC, 4, (), 500),
    plan.BatchingConfig(FW, 1, (), 250),
])
def test_edit_keeps_comments_and_untouched_lines_and_parses_to_the_tuned_config(tuned_config):
    original = parse(MLP)
    tuned = plan.tuned_model_config(original, tuned_config, WC)
    new = plan.edit_config_text(MLP, original, tuned)
    assert parse(new) == tuned
    for line in ("# A comment that stays.", 'name: "mlp"', "max_batch_size: 64", "# trailing comment",
                 'parameters { key: "other" value { string_value: "x" } }'):
        assert line in new.splitlines()
    diff = plan.config_diff(MLP, new, "mlp/config.pbtxt")
    assert diff.startswith("--- mlp/config.pbtxt\n+++ mlp/config.pbtxt (tuned)\n")


@pytest.mark.parametrize("text", [
    'name: "m"\nmax_batch_size: 8\n',  # no dynamic_batching, no instance_group: both appended
    'max_batch_size: 8 instance_group { count: 1 } instance_group { count: 2 kind: KIND_CPU }',
    'max_batch_size: 8\nparameters: { key: "batch_policy", value: { string_value: "work_conserving" } }\n'
    'dynamic_batching: < preferred_batch_size: [ 2, 4 ] >\n',
    'max_batch_size: 8 # a "quoted" { brace in a comment\ndynamic_batching { }\n',
    "",
])
def test_edit_handles_layouts(text):
    original = parse(text)
    if original.max_batch_size == 0:
        original.max_batch_size = 8
    if len(original.instance_group) > 1:
        del original.instance_group[1:]
        text = 'max_batch_size: 8 instance_group { count: 1 }'
    tuned = plan.tuned_model_config(original, plan.BatchingConfig(FW, 2, (8,), 100), WC)
    assert parse(plan.edit_config_text(text, original, tuned)) == tuned


def test_several_instance_groups_are_not_rewritten():
    original = parse("max_batch_size: 8 dynamic_batching { } instance_group { count: 1 } instance_group { count: 2 }")
    with pytest.raises(plan.PlanError, match="several instance groups"):
        plan.tuned_model_config(original, plan.BatchingConfig(WC, 4), WC)
    same = plan.tuned_model_config(original, plan.BatchingConfig(WC, 3), WC)
    assert same == original


def test_top_level_fields_understand_strings_comments_and_nesting():
    text = 'name: "a}b" # c { d\nx { y: [1, 2] z < w: 1 > }\nlist: [ { a: 1 }, { a: 2 } ];\nv: -1.5e3\n'
    spans = plan.top_level_fields(text)
    assert [s.name for s in spans] == ["name", "x", "list", "v"]
    assert [text[s.start:s.end] for s in spans] == [
        'name: "a}b"', "x { y: [1, 2] z < w: 1 > }", "list: [ { a: 1 }, { a: 2 } ];", "v: -1.5e3",
    ]


def test_no_change_means_no_diff():
    assert plan.config_diff(MLP, MLP, "mlp/config.pbtxt") == ""


def test_labels():
    assert plan.BatchingConfig(FW, 2, (16,), 1000).label() == "fixed_wait pref [16] delay 1000us, 2 instances"
    assert plan.BatchingConfig(WC, 1).label() == "work_conserving, 1 instance"
    assert plan.BatchingConfig(WC, 3).label(batching=False) == "3 instances"
    assert not math.isnan(plan.CostCurve(((1, 0.001),), 0.0005).capacity(1, 1, 2))


@pytest.mark.parametrize(
    ("requested", "space", "expected"),
    [
        ("model", 6, "grid"),  # add_sub: cost curve + probes + race + finals would out-run the 6 points
        ("model", 11, "grid"),
        ("model", 12, "model"),
        ("model", 132, "model"),
        ("grid", 132, "grid"),
    ],
)
def test_a_small_space_is_measured_point_by_point(requested, space, expected):
    assert plan.search_for(requested, space) == expected
