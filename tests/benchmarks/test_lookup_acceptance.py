from benchmarks.lookup_acceptance import accepted, by_match_length


def test_lookup_drafts_are_counted_by_their_match_length():
    """Each output position's lookup draft, judged against the continuation: a repeated
    phrase is a 3-token match accepted whole, a fresh token no match."""
    assert accepted([1, 2, 3], [1, 2, 9]) == 2 and accepted([1], [1, 2]) == 1
    tokens = [7, 1, 2, 3, 4, 5, 8, 1, 2, 3, 4, 5, 6]
    rows = by_match_length([(tokens, 9)], k=2)
    # t = 9: "8 1 2" unseen, "1 2" at 1-2: "3 4", right; t = 10: "1 2 3" -> "4 5", right;
    # t = 11: "2 3 4" -> "5 8" against "5 6": one accepted
    assert rows == {2: {"positions": 1, "accepted": 2, "whole": 1},
                    3: {"positions": 2, "accepted": 3, "whole": 1}}
    rows = by_match_length([([1, 2, 3, 4, 5], 2)], k=1)
    assert rows == {0: {"positions": 3, "accepted": 0, "whole": 0}}


def test_the_per_token_rate_is_what_a_fit_learns():
    """accepted / (accepted + rejections): a draft accepted whole ends in no rejection."""
    from benchmarks.lookup_acceptance import per_token_rate

    assert per_token_rate({"positions": 4, "accepted": 6, "whole": 2}) == 6 / 8
    assert per_token_rate({"positions": 3, "accepted": 0, "whole": 0}) == 0.0
    assert per_token_rate({"positions": 0, "accepted": 0, "whole": 0}) == 0.0
