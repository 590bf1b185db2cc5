import pytest

from vllm_saguaro.core.fanout import (AcceptanceFit, BudgetControl, SplitAcceptanceFit,
                                      fanout_for, geometric_fanout, uniform_fanout)
from vllm_saguaro.core.outcome import Outcome, is_consistent, outcome_from_sampled
from vllm_saguaro.core.theory import (expected_tokens_per_round, fallback_crossover, sd_speedup,
                                      ssd_speedup)


def test_geometric_fanout_hand_computed():
    # a=0.64, r=1: weights 0.8^k for k<4, last 0.8^4 / sqrt(0.36) = 0.68267
    # sum = 1 + .8 + .64 + .512 + .68267 = 3.63467; budget 20 -> 5.50, 4.40, 3.52, 2.82, 3.76
    # floors 5,4,3,2,3 (17); the 3 largest remainders (.82, .76, .52) get one more each
    assert geometric_fanout(4, 20, 0.64, 1.0) == [5, 4, 4, 3, 4]
    assert sum(geometric_fanout(7, 21, 0.8, 0.5)) == 21


def test_geometric_fanout_favours_likely_outcomes():
    f = geometric_fanout(6, 30, 0.5, 1.0)
    assert f[0] >= f[1] >= f[2] >= f[5]
    high = geometric_fanout(6, 30, 0.9, 1.0)
    assert high[-1] > f[-1], "a better draft moves budget to 'all accepted'"


def test_fanout_errors():
    with pytest.raises(ValueError):
        geometric_fanout(4, 8, 1.0, 1.0)
    with pytest.raises(ValueError):
        fanout_for("zipf", 4, budget=8, width=2, acceptance_rate=0.5, miss_exponent=1)
    assert uniform_fanout(3, 2) == [2, 2, 2, 2]


def test_outcome():
    assert outcome_from_sampled([4, 9, 11]) == Outcome(2, 11)
    assert is_consistent([4, 9, 11], [4, 9, 3])
    assert not is_consistent([4, 8, 11], [4, 9, 3])
    assert not is_consistent([1, 2, 3, 4, 5], [1, 2, 3])
    with pytest.raises(ValueError):
        outcome_from_sampled([])


def test_theory_hand_computed():
    assert expected_tokens_per_round(0.5, 3) == pytest.approx(1.875)
    assert expected_tokens_per_round(1.0, 3) == 4
    assert sd_speedup(1.875, 0.25) == pytest.approx(1.5)
    # p=0.8, E_hit=3, E_miss=2, T_p=0.5, T_b=0.5: (2.4+0.4) / (0.8*1 + 0.2*1.5) = 2.8/1.1
    assert ssd_speedup(0.8, 3, 2, 0.5, 0.5) == pytest.approx(2.8 / 1.1)
    # batch 2: P(all hit) = 0.64 -> 2.8 / (0.64 + 0.36*1.5)
    assert ssd_speedup(0.8, 3, 2, 0.5, 0.5, batch_size=2) == pytest.approx(2.8 / 1.18)


def test_ssd_never_slower_than_sd_with_same_draft():
    # Corollary 8: same draft as primary and backup, T_p = T_b = T_SD.
    for p in (0.0, 0.3, 0.9):
        e = expected_tokens_per_round(0.7, 4)
        assert ssd_speedup(p, e, e, 0.4, 0.4) >= sd_speedup(e, 0.4) - 1e-12
    assert ssd_speedup(0.5, 3, 3, 0.4, 0.4) > sd_speedup(3, 0.4)


def test_fallback_crossover():
    # a nearly free fast backup with worse tokens wins once misses dominate at large b
    b = fallback_crossover(0.8, 3.0, 2.5, 1.2, 0.5, 0.5, 0.01)
    assert b is not None and b > 1
    assert fallback_crossover(0.8, 3.0, 3.0, 1.0, 0.5, 0.0, 0.5) is None


def test_acceptance_fit_recovers_a_p_from_truncated_rounds():
    """Rounds drawn from the paper's model (accept each of K drafts with a_p until the first
    rejection) must give back a_p, though drafts after a rejection are never seen."""
    import random

    rng = random.Random(0)
    for a_p in (0.2, 0.5, 0.8):
        fit = AcceptanceFit(prior=0.6, decay=1.0)
        for _ in range(4000):
            k = 0
            while k < 4 and rng.random() < a_p:
                k += 1
            fit.observe(k, 4)
        assert abs(fit.rate - a_p) < 0.02, (a_p, fit.rate)


def test_acceptance_fit_starts_at_the_prior_and_forgets():
    fit = AcceptanceFit(prior=0.6, prior_weight=1.0, decay=0.9)
    assert fit.rate == pytest.approx(0.6)
    for _ in range(200):
        fit.observe(4, 4)          # everything accepted ...
    assert fit.rate > 0.95
    for _ in range(200):
        fit.observe(0, 4)          # ... then nothing: the old rounds fade
    assert fit.rate < 0.1


def test_split_acceptance_fit_keeps_greedy_and_sampled_apart():
    """Each kind of request learns its own a_p; the batch's is the mix of its rows'."""
    fit = SplitAcceptanceFit(0.5, prior_weight=1.0, decay=1.0)
    assert fit.rate == fit.rate_of(True) == fit.rate_of(False) == pytest.approx(0.5)
    for _ in range(100):
        fit.observe(3, 3)                 # greedy (the default): accepted whole
        fit.observe(0, 3, greedy=False)   # sampled: rejected at once
    assert fit.rate_of(True) > 0.95 and fit.rate_of(False) < 0.05
    assert fit.rate == pytest.approx(fit.rate_of(True))  # an all-greedy batch
    fit.sampled_share = 0.5
    assert fit.rate == pytest.approx((fit.rate_of(True) + fit.rate_of(False)) / 2)


def test_budget_control_shrinks_on_overrun_and_grows_back():
    c = BudgetControl(8, patience=2, shrink=0.75)
    assert c.budget == 8
    assert c.observe(True) == 6 and c.observe(True) == 4       # the tree decode overran
    assert c.observe(False) == 4 and c.observe(False) == 5     # two clean rounds: +1
    for _ in range(20):
        c.observe(False)
    assert c.budget == 8, "never above the configured budget"
    for _ in range(20):
        c.observe(True)
    assert c.budget == 1, "never below one branch"

def test_rates_from_measured_costs():
    from vllm_saguaro.core.theory import sd_rate, ssd_rate, target_alone_rate

    target = lambda w: 0.05 + 0.004 * w  # noqa: E731
    draft = lambda rows: 0.01  # noqa: E731
    assert target_alone_rate(4, target) == pytest.approx(4 / 0.066)
    e = expected_tokens_per_round(0.6, 3)
    assert sd_rate(0.6, 3, 1, target, draft) == pytest.approx(e / (0.066 + 0.03))
    # every sequence hits: SSD verifies without drafting on the critical path
    assert ssd_rate(0.6, 3, 1.0, 1, target, draft) == pytest.approx(e / 0.066)
    # never a hit: SSD is SD
    assert ssd_rate(0.6, 3, 0.0, 1, target, draft) == pytest.approx(sd_rate(0.6, 3, 1, target, draft))
    # the fast backup: no stall, its own (lower) acceptance on the misses
    fast = ssd_rate(0.6, 3, 0.5, 16, target, draft, a_fast=0.2)
    e_f = expected_tokens_per_round(0.2, 3)
    assert fast == pytest.approx(16 * (0.5 * e + 0.5 * e_f) / target(64))
    assert sd_rate(0.6, 0, 4, target, draft) == target_alone_rate(4, target)
    # a speculating round's own overhead (tune measures it) adds to every round's time
    assert ssd_rate(0.6, 3, 1.0, 1, target, draft, overhead_s=0.02) == pytest.approx(e / 0.086)
    assert sd_rate(0.6, 3, 1, target, draft, overhead_s=0.02) == pytest.approx(e / (0.066 + 0.05))
    assert ssd_rate(0.6, 0, 0.5, 4, target, draft, overhead_s=0.02) == target_alone_rate(4, target)


def test_ssd_rate_with_the_fast_backup_serving_a_share_of_the_misses():
    """ssd_rate's `fast`: the misses the fast backup serves (by match length) draft
    nothing, the rest wait for the neural fallback; the two extremes are the all-neural
    and the all-fast forms."""
    from vllm_saguaro.core.theory import ssd_rate

    target = lambda w: 0.05 + 0.004 * w  # noqa: E731
    draft = lambda rows: 0.01 * rows  # noqa: E731
    e, e9 = expected_tokens_per_round(0.6, 3), expected_tokens_per_round(0.9, 3)
    # batch 1, half the misses with a good match (0.9): a miss waits half the time
    mixed = ssd_rate(0.6, 3, 0.5, 1, target, draft, fast=[(0.5, 0.9), (0.0, 0.1)])
    tokens = 0.5 * e + 0.5 * (0.5 * e9 + 0.5 * e)
    assert mixed == pytest.approx(tokens / (target(4) + 0.25 * 3 * 0.01))
    # batch 4: a row needs the neural one with chance 0.25, the round with 1 - 0.75^4
    mixed4 = ssd_rate(0.6, 3, 0.5, 4, target, draft, fast=[(0.5, 0.9)])
    assert mixed4 == pytest.approx(4 * tokens / (target(16) + (1 - 0.75 ** 4) * 3 * 0.01))
    assert ssd_rate(0.6, 3, 0.5, 4, target, draft, fast=[]) == ssd_rate(0.6, 3, 0.5, 4, target, draft)
    assert ssd_rate(0.6, 3, 0.5, 4, target, draft, fast=[(0.3, 0.9), (0.7, 0.9)]) == pytest.approx(
        ssd_rate(0.6, 3, 0.5, 4, target, draft, a_fast=0.9))
    assert mixed > ssd_rate(0.6, 3, 0.5, 1, target, draft) > ssd_rate(0.6, 3, 0.5, 1, target, draft,
                                                                      a_fast=0.1)


def test_ssd_rate_with_the_misses_no_lookup_serves_sending_nothing():
    """rest_neural False: the misses the fast backup does not serve send nothing (one
    token each, no stall, no width), as the controller plans a miss no draft makes worth
    verifying; at batch 4 with half the positions matching, that beats both waiting for
    the neural fallback and verifying the unmatched positions' lookup drafts."""
    from vllm_saguaro.core.theory import ssd_rate, target_alone_rate

    target = lambda w: 0.03 + 0.008 * w  # noqa: E731
    draft = lambda rows: 0.01 + 0.002 * rows  # noqa: E731
    e9 = expected_tokens_per_round(0.9, 3)
    lookup_only = ssd_rate(0.5, 3, 0.0, 4, target, draft, fast=[(0.5, 0.9)], rest_neural=False)
    assert lookup_only == pytest.approx(4 * (0.5 * e9 + 0.5) / target(4 + 2 * 3))
    # a hit sends its K tokens: the width counts it, the unserved misses not
    with_hits = ssd_rate(0.5, 3, 0.5, 4, target, draft, fast=[(0.5, 0.9)], rest_neural=False)
    e = expected_tokens_per_round(0.5, 3)
    tokens = 4 * (0.5 * e + 0.5 * (0.5 * e9 + 0.5))
    assert with_hits == pytest.approx(tokens / target(4 + 4 * 3 * 0.75))
    plain = target_alone_rate(4, target)
    neural_rest = ssd_rate(0.5, 3, 0.0, 4, target, draft, fast=[(0.5, 0.9)])
    every_lookup = ssd_rate(0.5, 3, 0.0, 4, target, draft, fast=[(0.5, 0.9), (0.5, 0.02)])
    assert lookup_only > plain > max(neural_rest, every_lookup)
    # every miss served: nothing left to send nothing
    assert ssd_rate(0.5, 3, 0.0, 4, target, draft, fast=[(1.0, 0.9)], rest_neural=False) == \
        pytest.approx(ssd_rate(0.5, 3, 0.0, 4, target, draft, a_fast=0.9))
