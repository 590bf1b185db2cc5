import pytest

from vllm_saguaro.core.fallback import (LookupWatch, MatchAcceptance, ngram_match,
                                        recent_matches)


def test_ngram_match_continues_the_latest_match():
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    assert ngram_match(tokens, 2).tokens == [9, 2]          # "6 7" last seen at 5-6, then 9 2
    assert ngram_match([1, 2, 3, 1, 2], 3).tokens == [3, 1, 2]
    assert ngram_match([4, 4], 3).tokens == [4, 4, 4]       # a match at the end continues into itself
    assert ngram_match([1, 2, 3], 2).tokens == [3, 3]       # no match: repeat the last token
    assert ngram_match([9], 2).tokens == [9, 9]


def test_ngram_match_says_how_long_a_match_its_draft_continues():
    assert ngram_match([1, 2, 3, 1, 2], 3) == ([3, 1, 2], 2, 5)
    assert ngram_match([5, 1, 2, 3, 9, 1, 2, 3], 2) == ([9, 1], 3, 8)  # the longest first
    assert ngram_match([1, 2, 3], 2) == ([3, 3], 0, 3)                 # no match
    assert ngram_match([7, 8, 7], 1, max_n=1) == ([8], 1, 3)


def test_match_acceptance_by_match_length():
    """One fit per match length, from its own drafts; the shares count the drafts made."""
    m = MatchAcceptance(priors=(0.1, 0.3), sampled_priors=(0.1, 0.3), decay=1.0)
    assert m.shares() == [1.0, 0.0] and m.overall == pytest.approx(m.rate(0))
    for _ in range(40):
        m.note(1)
        m.observe(1, 3, 3)      # long matches: every token accepted
        m.note(0)
        m.observe(0, 0, 1)      # none: the first token rejected
    assert m.rate(1) > 0.9 and m.rate(0) < 0.05
    assert m.shares() == [0.5, 0.5]
    assert m.overall == pytest.approx((m.rate(0) + m.rate(1)) / 2)
    m.note(1)
    m.note(1)
    assert m.shares()[1] == pytest.approx(42 / 82)


def _reference_ngram_draft(tokens, k, max_n=3):
    """The plain form: every n from max_n down, every start from the end."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), 0, -1):
        tail = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                seq = list(tokens)
                for i in range(k):
                    seq.append(seq[start + n + i])
                return seq[length:], n
    return [tokens[-1]] * k, 0


def test_ngram_match_agrees_with_the_plain_search():
    import random

    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.randrange(rng.choice([2, 4, 30])) for _ in range(rng.randrange(1, 40))]
        k, max_n = rng.randrange(1, 5), rng.randrange(1, 5)
        got = ngram_match(tokens, k, max_n)
        assert (got.tokens, got.n) == _reference_ngram_draft(tokens, k, max_n), (tokens, k, max_n)


def test_greedy_and_sampled_requests_have_fits_of_their_own():
    """A sampled request accepts a lookup token with the target's probability of it: its
    fits start from their own priors and learn from its outcomes alone; the batch's rate
    is the mix of its rows' (sampled_share)."""
    m = MatchAcceptance(priors=(0.1, 0.5), sampled_priors=(0.05, 0.2), decay=1.0)
    assert m.rates(greedy=True) == (0.1, 0.5) and m.rates(greedy=False) == (0.05, 0.2)
    assert m.rates() == m.rates(greedy=True)  # no sampled row yet
    for _ in range(40):
        m.observe(1, 3, 3)                  # greedy: accepted whole
        m.observe(1, 0, 1, greedy=False)    # sampled: rejected at once
    assert m.rate(1, greedy=True) > 0.9 and m.rate(1, greedy=False) < 0.1
    m.sampled_share = 0.25
    assert m.rate(1) == pytest.approx(0.75 * m.rate(1, True) + 0.25 * m.rate(1, False))
    with pytest.raises(ValueError, match="one prior per match length"):
        MatchAcceptance(priors=(0.1, 0.5), sampled_priors=(0.1,))


def test_the_text_now_replaces_the_match_lengths_that_came_up():
    code = [1, 2, 3, 4] * 10
    assert recent_matches(code, window=5) == [3] * 5
    assert recent_matches(list(range(50)), window=4) == [0] * 4
    assert recent_matches([1, 1, 2], window=8) == [0, 1]   # positions 1 and 2 only
    m = MatchAcceptance(decay=1.0)
    for _ in range(30):
        m.note(0)
    m.seen_in(recent_matches(code, window=6) + [0, 0])
    assert m.shares() == [0.25, 0.0, 0.0, 0.75]
    m.seen_in([])  # nothing resynced: the counts stay
    assert m.shares() == [0.25, 0.0, 0.0, 0.75]


def test_lookup_watch_shows_the_share_of_long_matches_after_enough_positions():
    w = LookupWatch(window=8, min_positions=4)
    code = [1, 2, 3, 4] * 4
    for _ in range(3):
        w.observe(code)
    assert not w.shows(0.5)       # three positions: too few to say
    w.observe(code)
    assert w.shows(1.0)
    for _ in range(8):
        w.observe(list(range(20)))  # no match
    assert not w.shows(0.5) and w.shows(0.15)  # 4 of 12 positions, the older weighing less
