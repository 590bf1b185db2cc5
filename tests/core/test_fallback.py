import pytest

from vllm_saguaro.core.fallback import RunningMean, ngram_draft, use_neural_fallback
from vllm_saguaro.core.theory import fallback_crossover


def test_ngram_draft_continues_the_latest_match():
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    assert ngram_draft(tokens, 2) == [9, 2]          # "6 7" last seen at 5-6, then 9 2
    assert ngram_draft([1, 2, 3, 1, 2], 3) == [3, 1, 2]
    assert ngram_draft([4, 4], 3) == [4, 4, 4]       # a match at the end continues into itself
    assert ngram_draft([1, 2, 3], 2) == [3, 3]       # no match: repeat the last token
    assert ngram_draft([9], 2) == [9, 9]


def test_neural_fallback_pays_at_small_batch_only():
    # round 100 ms, neural backup 36 ms, 2 tokens a round after it, 1.2 after prompt lookup
    kw = dict(tokens_neural=2.0, tokens_fast=1.2, t_round=0.1, t_neural=0.036)
    assert use_neural_fallback(1, 1, **kw)
    assert not use_neural_fallback(1, 16, **kw)
    assert use_neural_fallback(16, 16, **kw)         # every sequence missed: worth it again
    assert not use_neural_fallback(1, 1, **dict(kw, tokens_fast=2.0))  # no gain, only cost


def test_per_step_rule_crosses_where_the_papers_b_star_does():
    """With every sequence equally likely to miss, the step rule's expected choice flips
    near the batch size where Corollary 16's two speedup curves cross."""
    p, e_n, e_f, t_n = 0.7, 2.5, 1.3, 0.4    # t relative to the verify time (1.0)
    b_star = fallback_crossover(p, e_n, e_n, e_f, 1.0, t_n, 0.0)
    assert b_star is not None and 1 < b_star < 64
    assert use_neural_fallback(1, 1, e_n, e_f, 1.0, t_n)
    assert not use_neural_fallback(1, 4 * b_star, e_n, e_f, 1.0, t_n)


def test_running_mean_moves_from_prior_to_data():
    m = RunningMean(1.0, weight=4.0, decay=1.0)
    assert m.value == 1.0
    for _ in range(396):
        m.add(3.0)
    assert m.value == pytest.approx(2.98)
