"""core/span.py: what speculation is worth to a batch that drains."""
from vllm_saguaro.core.idle_lookup import lookup_lengths
from vllm_saguaro.core.span import blocks_the_batch, span_lengths, waited_for

PLAIN = (0.040, 0.0005)  # a plain step: 40 ms + 0.5 ms a row (the 2-core CPU's, batch 4)
MARGIN = 0.05


def plain_s(width: int) -> float:
    return PLAIN[0] + PLAIN[1] * width


def verify_s(width: int) -> float:
    return 0.043 + 0.001 * width  # a verification: a few ms over a plain step, 1 ms a token


def test_the_batch_waits_for_the_rows_that_finish_last_at_their_pace():
    assert waited_for([60, 60, 60, 60], [0.0] * 4) == [True] * 4
    # a row whose text repeats (0.5 tokens a round) finishes in 40 steps, not 60
    assert waited_for([60, 60, 60, 60], [0.5, 0.0, 0.0, 0.0]) == [False, True, True, True]
    assert waited_for([60, 30, 30, 30], [0.5, 0.0, 0.0, 0.0]) == [True, False, False, False]
    # within a step or two of the last, as likely to be the last
    assert waited_for([60, 59, 40], [0.0, 0.0, 0.0]) == [True, True, False]
    assert waited_for([], []) == []


def test_a_repeating_row_among_rows_that_do_not_sends_nothing():
    """The measured case (MT-Bench, batch 4, T = 0): one row continues a match, at a
    pace the others do not have. Tokens per second says send; the batch waits for the
    other three, which have nothing to send."""
    rates = [0.62, 0.01, 0.01, 0.01]
    assert any(lookup_lengths(rates, 3, plain_s, verify_s, margin=MARGIN))
    alphas = [(r,) * 3 for r in rates]
    pace = [0.4, 0.0, 0.0, 0.0]
    assert span_lengths(alphas, [60] * 4, pace, PLAIN, verify_s, MARGIN) == [0] * 4


def test_a_first_match_beside_rows_that_cannot_accept_saves_no_step():
    """All four rows at the same pace and steps left (a batch of prose, no row has
    matched yet): row 0 continues a match for the first time. Rows that have nothing to
    send and expect less than a token before they end finish on their own count, so row
    0's tokens are worth per_token only: nothing is sent. Where the other rows are
    expected to accept a few tokens later (a pace of their own), the k rows share the
    step as before and row 0 sends."""
    alphas = [(0.62,) * 3, (0.01,) * 3, (0.01,) * 3, (0.01,) * 3]
    assert span_lengths(alphas, [60] * 4, [0.0] * 4, PLAIN, verify_s, MARGIN) == [0] * 4
    pace = [0.0, 0.05, 0.05, 0.05]  # 57 steps each: all four still waited for
    assert waited_for([60] * 4, pace) == [True] * 4
    out = span_lengths(alphas, [60] * 4, pace, PLAIN, verify_s, MARGIN)
    assert out[0] > 0 and out[1:] == [0, 0, 0]
    # a waited row that continues a match of its own this round blocks nothing
    both = [(0.62,) * 3, (0.62,) * 3, None, None]
    out = span_lengths(both, [60, 60, 10, 10], [0.0] * 4, PLAIN, verify_s, MARGIN)
    assert sum(out) > 0 and not any(out[2:])


def test_a_blocker_has_nothing_to_send_and_no_token_to_expect():
    assert blocks_the_batch(None, 60, 0.0)
    assert blocks_the_batch((0.01,) * 3, 60, 0.01)  # 0.6 tokens over its 59 steps
    assert not blocks_the_batch((0.5,) * 3, 60, 0.0)  # sends this round
    assert not blocks_the_batch(None, 60, 0.05)  # ~2.9 tokens expected before its end
    assert blocks_the_batch(None, 3, 0.2)  # 0.5 tokens in its last 2.5 steps


def test_rows_alike_value_tokens_as_tokens_per_second_does():
    """Every row at the same pace (text that repeats in every row): the batch waits for
    them all, and a token is worth fixed / batch + per_token, as under tokens per
    second: the same lengths."""
    for rates in ([0.62, 0.01, 0.62, 0.3], [0.8, 0.8, 0.8, 0.8], [0.5, 0.0, 0.0, 0.0]):
        alphas = [(r,) * 3 for r in rates]
        tokens = lookup_lengths(rates, 3, plain_s, verify_s, margin=0.0)
        span = span_lengths(alphas, [60] * 4, [0.3] * 4, PLAIN, verify_s, 0.0)
        assert sum(span) == sum(tokens) and sorted(span) == sorted(tokens), (rates, span, tokens)


def test_the_row_the_batch_waits_for_sends_what_it_would_alone():
    """The same rates, but the matched row is the one the batch waits for: its tokens
    are whole steps, so it sends even a draft that tokens per second would not."""
    alphas = [(0.3,) * 3, (0.01,) * 3, (0.01,) * 3, (0.01,) * 3]
    assert not any(lookup_lengths([0.3, 0.01, 0.01, 0.01], 3, plain_s, verify_s, MARGIN))
    out = span_lengths(alphas, [60, 40, 40, 40], [0.0] * 4, PLAIN, verify_s, MARGIN)
    assert out[0] > 0 and out[1:] == [0, 0, 0]


def test_a_row_still_prefilling_holds_the_batch_and_others_send_nothing():
    """A row that may not send (None: prefilling) with the most left: the batch waits
    for it whatever the others accept."""
    alphas = [None, (0.9,) * 3, (0.9,) * 3]
    assert span_lengths(alphas, [64, 30, 30], [0.0] * 3, PLAIN, verify_s, MARGIN) == [0, 0, 0]


def test_nothing_to_send_sends_nothing():
    assert span_lengths([None, None], [5, 5], [0.0, 0.0], PLAIN, verify_s, MARGIN) == [0, 0]
    assert span_lengths([(), ()], [5, 5], [0.0, 0.0], PLAIN, verify_s, MARGIN) == [0, 0]
    assert span_lengths([], [], [], PLAIN, verify_s, MARGIN) == []
