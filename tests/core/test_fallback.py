from vllm_saguaro.core.fallback import ngram_draft


def test_ngram_draft_continues_the_latest_match():
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    assert ngram_draft(tokens, 2) == [9, 2]          # "6 7" last seen at 5-6, then 9 2
    assert ngram_draft([1, 2, 3, 1, 2], 3) == [3, 1, 2]
    assert ngram_draft([4, 4], 3) == [4, 4, 4]       # a match at the end continues into itself
    assert ngram_draft([1, 2, 3], 2) == [3, 3]       # no match: repeat the last token
    assert ngram_draft([9], 2) == [9, 9]
