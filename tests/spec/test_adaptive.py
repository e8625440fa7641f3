"""Adaptive speculation: the acceptance estimator, the choice of drafts, and the engine under "auto"."""
import math
import random

import pytest

from tandem.plan import ScheduledReq, StepPlan, StepResult
from tandem.spec.adaptive import AcceptanceEstimator, AdaptiveDrafts, StepCosts


def _rounds(rng, conditional, num_drafts, n):
    """n rounds of num_drafts drafts, draft j accepted with probability conditional[j] after j accepted."""
    out = []
    for _ in range(n):
        a = 0
        while a < num_drafts and rng.random() < conditional[a]:
            a += 1
        out.append((num_drafts, a))
    return out


def test_estimator_learns_the_survival_of_each_position():
    rng = random.Random(0)
    c = [0.9, 0.7, 0.5, 0.3]
    est = AcceptanceEstimator(4, window=4000)
    assert est.survival() == [1.0] * 4  # the optimistic prior
    for _ in range(400):
        est.observe(_rounds(rng, c, 4, 16))
    truth = [math.prod(c[: j + 1]) for j in range(4)]
    assert est.survival() == pytest.approx(truth, abs=0.03)


def test_a_round_observes_only_the_positions_it_verified():
    est = AcceptanceEstimator(4)
    for _ in range(50):
        est.observe([(2, 0), (2, 1)])  # two drafts verified: positions 0 and 1 only
    s = est.survival()
    assert s[0] == pytest.approx(0.5, abs=0.02) and s[1] < 0.05
    assert est.weight[2:] == [2.0, 2.0] and est.steps_unseen(2) == 50 and est.steps_unseen(0) == 0
    assert s[2] <= s[1] and s[3] <= s[2]  # non-increasing, though position 2 still holds its prior


def test_estimator_forgets_at_the_window():
    est = AcceptanceEstimator(1, window=100)
    for _ in range(500):
        est.observe([(1, 1)])
    for _ in range(300):  # three windows after the draft stopped agreeing
        est.observe([(1, 0)])
    assert est.survival()[0] < 0.06


def test_estimator_forgets_per_observation_not_per_step():
    """Fifty rounds a step (fifty requests) are fifty observations: the estimate decays once for each,
    about as one round a step would, so ten steps of rejections outweigh ten steps of acceptances."""
    many, one = AcceptanceEstimator(1, window=100), AcceptanceEstimator(1, window=100)
    for outcome in (1, 0):
        for _ in range(10):
            many.observe([(1, outcome)] * 50)
            for _ in range(50):
                one.observe([(1, outcome)])
    assert many.survival()[0] == pytest.approx(one.survival()[0], rel=1e-3)
    assert many.survival()[0] < 0.01


def costs(k=4, verify_per_token=0.02, draft=0.3, base=4.0, sizes=(1, 8, 64)):
    """A GPU-like table: a step reads the weights (base), then each token verified adds compute;
    each draft step costs `draft` plus its own compute."""
    return StepCosts(sizes, tuple(tuple(base + n * (1 + K) * verify_per_token + K * (draft + n * 0.004)
                                        for K in range(k + 1)) for n in sizes))


def brute_force(survival, row):
    rates = [(1 + sum(survival[:K])) / row[K] for K in range(len(row))]
    return rates.index(max(rates))


def test_policy_picks_the_most_tokens_per_millisecond():
    table = costs()
    for c in (0.0, 0.3, 0.6, 0.8, 0.95):
        est = AcceptanceEstimator(4)
        for _ in range(200):
            est.observe(_rounds(random.Random(1), [c] * 4, 4, 8))
        policy = AdaptiveDrafts(4, table, est)
        for n in (1, 5, 8, 40, 64, 100):
            assert policy(n) == brute_force(est.survival(), table.at(n))
    low = AdaptiveDrafts(4, table, AcceptanceEstimator(4))
    for _ in range(20):
        low.estimator.observe([(4, 0)] * 8)
    assert low(1) == 0 and low(64) == 0  # a draft that never agrees is switched off
    high = AdaptiveDrafts(4, table, AcceptanceEstimator(4))
    for _ in range(20):
        high.estimator.observe(_rounds(random.Random(2), [0.6] * 4, 4, 8))
    assert high(1) == 4 and high(64) < 4  # fewer drafts where verification costs compute


def test_probes_a_stale_position_then_returns():
    policy = AdaptiveDrafts(4, costs(), probe_interval=10)
    for _ in range(5):
        policy.estimator.observe([(4, 0)] * 8)  # K = 0 from here on: position 0 goes unobserved
    for _ in range(10):
        policy.estimator.observe([])
        assert policy(1) == 0
    policy.estimator.observe([])
    assert policy(1) == 1 and policy(1) == 1  # a probe, the same however often the scheduler asks
    policy.estimator.observe([(1, 0)])  # the probe's observation
    assert policy(1) == 0


def test_a_size_that_cannot_verify_k_is_never_chosen():
    table = StepCosts((1, 8), ((4.0, 4.1, 4.2), (5.0, 5.5, math.inf)))
    policy = AdaptiveDrafts(2, table)
    assert policy(1) == 2 and policy(8) == 1
    assert table.at(1) == table.ms[0] and table.at(2) == table.at(8) == table.ms[1]
    assert math.isinf(table.at(100)[2]) and policy(100) < 2


def test_costs_between_and_past_the_measured_sizes():
    """A CUDA graph pads a batch to the next size, so it costs that size's step; an eager step
    costs the line between the two sizes around it. Past the last size the line through the last
    two goes on (verification grows with its rows: holding the last size's cost would price a
    batch of 64 as one of 8 and draft too much there); a single size stands for every batch."""
    rows = ((4.0, 5.0, 6.0), (5.0, 7.0, 9.0), (7.0, 10.0, 13.0))
    graphs, eager = StepCosts((1, 4, 8), rows), StepCosts((1, 4, 8), rows, padded=False)
    assert graphs.at(2) == graphs.at(4) == rows[1] and graphs.at(5) == rows[2]
    assert eager.at(4) == rows[1] and eager.at(2) == pytest.approx((4 + 1 / 3, 5 + 2 / 3, 7.0))
    assert eager.at(6) == pytest.approx((6.0, 8.5, 11.0))
    for table in (graphs, eager):
        assert table.at(16) == pytest.approx((11.0, 16.0, 21.0)) and table.at(1) == rows[0]
    one = StepCosts((1,), ((4.0, 5.0),), padded=False)
    assert one.at(1) == one.at(64) == (4.0, 5.0)
    # a bend that would cross along K stays monotone: K = 1 never costs less than K = 0
    bent = StepCosts((1, 2), ((4.0, 4.1), (6.0, 4.2)), padded=False)
    assert bent.at(4)[1] >= bent.at(4)[0] == pytest.approx(10.0)
    assert StepCosts.from_measured([1, 2], [[1.0], [2.0]], padded=False).padded is False
    # the policy prices a large eager batch by the line: fewer drafts than the last size's costs would give
    table = StepCosts((1, 8), ((4.0, 4.4, 4.8, 5.2, 5.6), (4.2, 5.0, 5.8, 6.6, 7.4)), padded=False)
    policy = AdaptiveDrafts(4, table)
    rng = random.Random(3)
    for _ in range(200):
        policy.estimator.observe(_rounds(rng, [0.8] * 4, 4, 8))
    assert policy(8) == 4 and policy(64) == 1  # (at batch 8's costs, 64 would draft 4 too)
    assert policy(64) == brute_force(policy.estimator.survival(), table.at(64))


def test_a_switched_off_draft_comes_back_within_a_few_probes():
    """After a long run the first position holds a window's weight of evidence; once K = 0 only the
    probes observe it. A probe after a stale spell meets at most stale_weight observations of the
    old estimate, so a draft that agrees again is used after a few probes, not thousands of steps."""
    table = costs()
    for batch in (1, 8):
        rng = random.Random(batch)
        policy = AdaptiveDrafts(4, table, probe_interval=64)
        step, k_now = 0, 4
        def run(accept, steps):
            nonlocal step, k_now
            for _ in range(steps):
                step += 1
                k_now = policy(batch)
                policy.estimator.observe(_rounds(rng, [accept] * 4, k_now, batch) if k_now else [])
        run(0.9, 2000)
        assert k_now == 4
        run(0.02, 3000)
        assert k_now == 0
        run(0.9, 400)
        assert k_now == 4, (batch, policy.estimator.survival())
    # a draft that stays poor is not brought back by the probes
    policy = AdaptiveDrafts(4, table, probe_interval=64)
    rng = random.Random(5)
    drafted = 0
    for _ in range(3000):
        K = policy(1)
        drafted += K > 0
        policy.estimator.observe(_rounds(rng, [0.02] * 4, K, 1) if K else [])
    assert drafted < 3000 * 0.05


def test_measured_costs_are_made_monotone():
    t = StepCosts.from_measured([1, 2], [[5.0, 4.0, 7.0], [4.5, 9.0, math.inf]])
    assert t.ms == ((5.0, 5.0, 7.0), (5.0, 9.0, math.inf))
    assert t.table() == "1: 5.00 5.00 7.00; 2: 5.00 9.00 -"


def test_observe_counts_the_steps_by_drafts_proposed():
    policy = AdaptiveDrafts(2, costs(k=2))
    item = ScheduledReq(0, 0, 5, [1], 2, [0], True, 0, num_next_drafts=1)
    policy.observe(StepPlan([], [item]), StepResult([[3, 4]], [None], [1]))
    assert policy.num_steps_by_k == [0, 1, 0]
    assert policy.estimator.weight == pytest.approx([3, 3], abs=0.01)  # prior 2 + one round
    assert policy.estimator.hits == pytest.approx([3, 2], abs=0.01)  # accepted 1 of 2 drafts
    assert "steps by drafts proposed {1: 1}" in policy.log_line()
    # A step of prefill chunks alone (none samples) chose no K: it is not counted as K = 0.
    chunk = ScheduledReq(1, 1, 0, [1, 2, 3], 0, [0], False, 0)
    policy.observe(StepPlan([], [chunk]), StepResult([[]], [None], [0]))
    assert policy.num_steps_by_k == [0, 1, 0]


def test_a_round_cut_by_the_confidence_stop_counts_its_unproposed_drafts_as_rejected():
    policy = AdaptiveDrafts(4, costs(k=4))
    # Step 1 plans 4 drafts for request 7 and 4 for request 8; the stop lets 7 propose only 2 (its
    # third draft was unsure: the step that drew it ran, 3 steps in all).
    step1 = [ScheduledReq(7, 0, 5, [1], 0, [0], True, 0, num_next_drafts=4),
             ScheduledReq(8, 1, 5, [1], 0, [0], True, 0, num_next_drafts=4)]
    policy.observe(StepPlan([], step1), StepResult([[3], [3]], [None, None], [2, 4], draft_steps={0: 3}))
    assert policy.planned_by_req == {7: (4, 3)}
    # Step 2 verifies them: 7 accepts both of its 2 drafts, 8 accepts 2 of its 4.
    step2 = [ScheduledReq(7, 0, 6, [3], 2, [0], True, 1, num_next_drafts=4),
             ScheduledReq(8, 1, 6, [3], 4, [0], True, 1, num_next_drafts=4)]
    before = list(policy.estimator.weight)
    policy.observe(StepPlan([], step2), StepResult([[4, 5, 6], [4, 5, 6]], [None, None], [4, 4]))
    # Every position 0..3 saw both rounds (7's positions 2 and 3 as rejections, not as unobserved).
    assert [w - b for w, b in zip(policy.estimator.weight, before)] == pytest.approx([2, 2, 2, 2], abs=0.01)
    assert policy.estimator.hits == pytest.approx([4, 4, 2, 2], abs=0.01)  # the prior 2 each, then 2, 2, 0, 0
    assert policy.planned_by_req == {}
    # How far the chains ran: request 7 planned 4 and ran 3 draft steps (position 3 cut), 8 all 4.
    assert policy.proposals.hits == pytest.approx([4, 4, 4, 3], abs=0.01)


def test_without_the_stop_a_plan_costs_what_was_measured():
    policy = AdaptiveDrafts(4, costs(k=4))
    for _ in range(50):
        policy.observe(StepPlan([], [ScheduledReq(1, 0, 9, [1], 4, [0], True, 1, num_next_drafts=4)]),
                       StepResult([[1, 2]], [None], [4]))
    for n in (1, 8, 64):
        assert policy.expected_costs(n) == pytest.approx(list(policy.costs.at(n)))


def test_under_the_stop_a_plan_costs_the_draft_steps_its_chains_run():
    table = StepCosts((1, 8), ((4.0, 5.0, 6.0, 7.0), (4.0, 6.0, 8.0, math.inf)))
    policy = AdaptiveDrafts(3, table, estimator=AcceptanceEstimator(3), probe_interval=10**9)
    policy.proposals = AcceptanceEstimator(3, prior_weight=1e-9)
    policy.proposals.observe([(3, 1), (3, 3)])  # half the chains stop after one draft: R = 1, 0.5, 0.5
    assert policy.expected_costs(1) == pytest.approx([4.0, 5.0, 5.5, 6.0])
    p8 = 1 - 0.5**8  # P(one of 8 chains still drafts)
    assert policy.expected_costs(8) == pytest.approx([4.0, 6.0, 6.0 + 2 * p8, math.inf])
    # Survival 0.9 / 0.3 / 0.2: at the measured costs one draft pays best (1.9 / 5 tokens a ms
    # against 2.2 / 6 and 2.4 / 7); with chains that mostly stop after one, the deepest plan does.
    policy.estimator = AcceptanceEstimator(3, prior_weight=1e-9)
    policy.estimator.observe([(3, 3)] * 2 + [(3, 2)] + [(3, 1)] * 6 + [(3, 0)])
    assert policy.estimator.survival() == pytest.approx([0.9, 0.3, 0.2])
    policy.proposals = AcceptanceEstimator(3, prior_weight=1e-9)
    assert policy(1) == 1
    policy.proposals.observe([(3, 1)] * 9 + [(3, 3)])  # R = 1, 0.1, 0.1
    assert policy.expected_costs(1) == pytest.approx([4.0, 5.0, 5.1, 5.2])
    assert policy(1) == 3
    # Chains that all stop after one draft: a deeper plan costs nothing more.
    policy.proposals = AcceptanceEstimator(3, prior_weight=1e-9)
    policy.proposals.observe([(3, 1)])
    assert policy.expected_costs(1) == pytest.approx([4.0, 5.0, 5.0, 5.0])
