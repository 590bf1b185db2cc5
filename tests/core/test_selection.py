"""The 'probable' outcome selection: probabilities, calibration and the batch's budget."""
import itertools
import math
import random

import pytest

from vllm_saguaro.core.selection import (AcceptanceCalibration, accepted_length_probs,
                                         allocate_budget, hit_probability, rank_outcomes,
                                         select_outcomes)


def test_accepted_length_probs_is_the_capped_law_and_sums_to_one():
    p = accepted_length_probs([0.9, 0.5, 0.2])
    assert p == pytest.approx([0.1, 0.9 * 0.5, 0.9 * 0.5 * 0.8, 0.9 * 0.5 * 0.2])
    assert sum(p) == pytest.approx(1.0)
    assert accepted_length_probs([]) == [1.0]


def test_rank_outcomes_orders_by_joint_probability():
    ranked = rank_outcomes([0.5, 0.5], [[(7, 0.9), (8, 0.1)], [(9, 0.6), (10, 0.4)]])
    assert [(j, x) for _, j, x in ranked] == [(0, 7), (1, 9), (1, 10), (0, 8)]
    assert ranked[0][0] == pytest.approx(0.45)


def test_a_certain_sequence_gets_one_branch_an_uncertain_one_the_rest():
    certain = [(0.97, 3, 1), (0.01, 0, 2), (0.01, 1, 3), (0.01, 2, 4)]
    uncertain = [(0.2, 0, 5), (0.2, 1, 6), (0.15, 2, 7), (0.15, 3, 8), (0.1, 0, 9)]
    assert allocate_budget([certain, uncertain], 6) == [1, 5]


def _brute_force(ranked, total):
    best, arg = -math.inf, None
    for counts in itertools.product(*[range(len(r) + 1) for r in ranked]):
        if sum(counts) != total:
            continue
        value = sum(math.log(sum(p for p, _, _ in r[:c])) if c else -math.inf
                    for r, c in zip(ranked, counts))
        if value > best:
            best, arg = value, counts
    return best


@pytest.mark.parametrize("seed", range(20))
def test_allocation_maximises_the_chance_that_the_whole_batch_hits(seed):
    rng = random.Random(seed)
    ranked = []
    for _ in range(3):
        ps = sorted((rng.random() ** 3 for _ in range(5)), reverse=True)
        ranked.append([(p / (sum(ps) * 1.2), j, j) for j, p in enumerate(ps)])
    total = rng.randrange(3, 12)
    counts = allocate_budget(ranked, total)
    assert sum(counts) == total
    got = sum(math.log(sum(p for p, _, _ in r[:c])) for r, c in zip(ranked, counts))
    assert got == pytest.approx(_brute_force(ranked, total))


def test_allocation_stops_when_every_outcome_is_taken():
    assert allocate_budget([[(0.5, 0, 1)], [(0.3, 0, 2), (0.2, 1, 3)], []], 10) == [1, 2, 0]


def test_select_outcomes_and_its_hit_probability():
    k_probs = [accepted_length_probs([0.9]), accepted_length_probs([0.1])]
    bonus = [[[(11, 0.7), (12, 0.3)], [(13, 1.0)]], [[(21, 0.5), (22, 0.5)], [(23, 1.0)]]]
    chosen = select_outcomes(k_probs, bonus, 3)
    assert chosen[0] == [(1, 13)]            # k = 1 with 0.9: one branch
    assert chosen[1] == [(0, 21), (0, 22)]   # k = 0 with 0.9: both of its candidates
    assert hit_probability(k_probs[0], bonus[0], chosen[0]) == pytest.approx(0.9)
    assert hit_probability(k_probs[1], bonus[1], chosen[1]) == pytest.approx(0.9)


def test_calibration_learns_an_overconfident_draft():
    cal = AcceptanceCalibration(bins=10, prior_weight=4.0, decay=1.0)
    assert cal.rate(0.95) == pytest.approx(0.95)      # the prior: a calibrated draft
    for _ in range(200):  # the draft is 95% sure, the target accepts half the time
        cal.observe([0.95], 1)
        cal.observe([0.95], 0)
    assert cal.rate(0.95) == pytest.approx(0.5, abs=0.02)
    assert cal.rate(0.15) == pytest.approx(0.15)      # other bins untouched


def test_calibration_counts_only_the_judged_tokens():
    cal = AcceptanceCalibration(bins=2, prior_weight=1.0, decay=1.0)
    cal.observe([0.9, 0.9, 0.1, 0.1], 1)  # token 0 accepted, token 1 rejected, 2-3 unjudged
    assert cal.seen == [1.0, 3.0]
    assert cal.accepted == [0.25, 0.75 + 1.0]
