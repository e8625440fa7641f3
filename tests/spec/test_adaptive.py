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
    assert table.at(1) == table.ms[0] and table.at(2) == table.at(8) == table.at(100) == table.ms[1]


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
