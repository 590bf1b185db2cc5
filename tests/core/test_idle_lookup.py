"""Prompt lookup while the draft idles (core/idle_lookup.py): the lengths by the
controller's objective, the entry margin, and what the rounds teach it."""
import pytest

from vllm_saguaro.core.controller import StepCost, expected_tokens
from vllm_saguaro.core.idle_lookup import (LOOKUP_ENTRY_MARGIN, IdleLookup, IdleLookupAdvice,
                                           idle_lookup_rate, lookup_lengths)

RATES = (0.02, 0.15, 0.35, 0.8)  # by match length 0..3
SAMPLED = (0.01, 0.02, 0.03, 0.04)  # a sampled request's


def rates_of(matches, rates=RATES):
    """Each row's token acceptance by its match length (None: may send nothing)."""
    return [None if n is None else rates[n] for n in matches]


def line(fixed: float, per_token: float):
    return lambda w: fixed + per_token * w


def test_long_matches_send_and_rows_without_one_do_not():
    """A batch of 4 on a CPU-like line (36 ms + 1 ms a token): the rows continuing a
    3-token match send every token they have, the rest nothing; rows that may not send
    (None: prefilling, seeded) never do."""
    cost = line(0.036, 0.001)
    assert lookup_lengths(rates_of([3, 0, 3, None], RATES), 3, cost, cost) == [3, 0, 3, 0]
    assert lookup_lengths(rates_of([3, 3], RATES), 2, cost, cost) == [2, 2]          # the cap
    assert lookup_lengths(rates_of([None, None], RATES), 3, cost, cost) == [0, 0]
    assert lookup_lengths(rates_of([0, 1, 0, 0], RATES), 3, cost, cost) == [0, 0, 0, 0]
    assert lookup_lengths(rates_of([3], RATES), 0, cost, cost) == [0]


def test_nothing_is_sent_where_verifying_costs_more_than_it_gives():
    """A dear verification (a step per token sent: a wide, compute-bound batch), or a
    verification step dearer than a plain one by more than the draft gives: plain."""
    plain = line(0.036, 0.001)
    assert lookup_lengths(rates_of([3] * 4, RATES), 3, plain, line(0.036, 0.036)) == [0] * 4
    assert lookup_lengths(rates_of([3] * 4, RATES), 3, plain, line(0.150, 0.001)) == [0] * 4
    assert sum(lookup_lengths(rates_of([3] * 4, RATES), 3, plain, line(0.040, 0.001))) > 0


def test_the_entry_margin_holds_off_a_gain_smaller_than_it():
    """One row of 4 continuing a match whose tokens are accepted at 0.3: a plan about
    1-3% ahead of plain decoding sends nothing with the margin, and does without."""
    plain = line(0.036, 0.001)
    rates = (0.0, 0.0, 0.0, 0.3)
    tokens = 4 + expected_tokens((0.3,))
    gain = tokens / plain(5) / (4 / plain(4)) - 1.0
    assert 0 < gain < LOOKUP_ENTRY_MARGIN
    assert lookup_lengths(rates_of([3, 0, 0, 0], rates), 3, plain, plain) == [0] * 4
    assert sum(lookup_lengths(rates_of([3, 0, 0, 0], rates), 3, plain, plain, margin=0.0)) > 0


def test_idle_lookup_rate_is_plain_decoding_without_matches_and_grows_with_them():
    plain = verify = line(0.036, 0.001)
    base = 4 / plain(4)
    assert idle_lookup_rate(4, 0.0, 0.8, 3, plain, verify) == pytest.approx(base)
    low, high = (idle_lookup_rate(4, s, 0.8, 3, plain, verify) for s in (0.25, 0.75))
    assert base < low < high
    # the best length: one token where each is as likely rejected as not and dear
    dear = line(0.036, 0.01)
    one = (4 + 4 * 0.5) / dear(8)
    assert idle_lookup_rate(4, 1.0, 0.5, 3, plain, dear) == pytest.approx(max(base, one))


def test_an_idle_lookup_learns_its_rates_and_lines_from_its_rounds():
    """Start from the worker's advice (a verification's line: plain decoding's);
    rejected drafts bring a match length's rate down
    until it sends nothing (and then learns no more of it); a verification measured dear
    stops it as well."""
    advice = IdleLookupAdvice(RATES, RATES, (0.036, 0.001))
    look = IdleLookup(advice)
    assert look.verify[False].predict(7) == pytest.approx(look.plain.predict(7))
    rids, greedy = ["a", "b"], [True, True]
    assert look.lengths(rids, [3, 0], greedy, 3) == [3, 0]
    assert look.sent == {"a": (True, 3, 3)}
    for _ in range(300):  # every draft rejected at its first token
        look.observe_outcome("a", [9])
        look.lengths(rids, [3, 0], greedy, 3)
    stopped = look.acceptance.rate(3, True)
    assert stopped < RATES[3] / 2 and look.lengths(rids, [3, 0], greedy, 3) == [0, 0]
    assert look.sent == {}
    look.observe_outcome("a", [1, 2, 3, 4])  # nothing sent last: nothing learnt
    assert look.acceptance.rate(3, True) == stopped
    assert look.acceptance.rate(3, False) == RATES[3]  # a sampled request's: not taught

    look = IdleLookup(advice)
    for _ in range(60):  # each verification as dear as two plain steps
        look.observe_step(2, 0.036, False)
        look.observe_step(5, 0.075, True)
    assert look.lengths(rids, [3, 0], greedy, 3) == [0, 0]


def test_a_draining_batch_sends_only_what_shortens_it():
    """Given the tokens each row has left (a batch that drains, core/span.py), a row
    continuing a match sends only where the batch waits for it: not tied with three rows
    that match nothing (at its pace it finishes first); with more left than they have,
    it does, until its pace puts it ahead of them."""
    advice = IdleLookupAdvice(RATES, RATES, (0.036, 0.001))
    rids, greedy = ["a", "b", "c", "d"], [True] * 4
    assert IdleLookup(advice).lengths(rids, [3, 0, 0, 0], greedy, 3) == [3, 0, 0, 0]
    look = IdleLookup(advice)
    assert look.lengths(rids, [3, 0, 0, 0], greedy, 3, left=[40] * 4) == [0] * 4
    assert look.sent == {} and look.pace["a"] > 10 * look.pace["b"]
    look = IdleLookup(advice)
    assert look.lengths(rids, [3, 0, 0, 0], greedy, 3, left=[40, 30, 30, 30]) == [3, 0, 0, 0]
    assert look.sent == {"a": (True, 3, 3)}
    for _ in range(10):  # ten rounds more of it: 40 tokens at its pace take fewer than 30 steps
        look.lengths(rids, [3, 0, 0, 0], greedy, 3, left=[40, 30, 30, 30])
    assert 40 / (1 + look.pace["a"]) < 30 and look.sent == {}
    assert IdleLookup(advice, before=look).pace == look.pace  # the next idle goes on


def test_the_next_idle_goes_on_from_what_the_last_one_measured():
    """A new idle (the draft's advice again) keeps the last idle's verification line and
    its judged lookup tokens, under the advice's rates as the prior: an idle that learnt
    its drafts do not pay does not send them again from the draft's rates. Without a
    verification measured, the new advice's line stands."""
    advice = IdleLookupAdvice(RATES, RATES, (0.036, 0.001))
    rids, greedy = ["a", "b"], [True, True]
    first = IdleLookup(advice)
    for _ in range(60):  # verifications as dear as two plain steps
        first.observe_step(2, 0.036, False)
        first.observe_step(5, 0.075, True)
    assert first.lengths(rids, [3, 0], greedy, 3) == [0, 0]
    fresh, goes_on = IdleLookup(advice), IdleLookup(advice, before=first)
    assert fresh.lengths(rids, [3, 0], greedy, 3) == [3, 0]  # the guess sends
    assert goes_on.lengths(rids, [3, 0], greedy, 3) == [0, 0]
    assert goes_on.verify[False] is first.verify[False] and goes_on.verified[False] == 60
    assert goes_on.plain.predict(4) == pytest.approx(fresh.plain.predict(4))  # the advice's

    rejected = IdleLookup(advice)
    for _ in range(20):  # every draft rejected at its first token
        rejected.lengths(rids, [3, 0], greedy, 3)
        rejected.observe_outcome("a", [9])
    newer = IdleLookup(IdleLookupAdvice(RATES, RATES, (0.030, 0.001)), before=rejected)
    assert newer.acceptance.rate(3, True) == pytest.approx(rejected.acceptance.rate(3, True))
    assert newer.acceptance.rate(3, True) < RATES[3] - 0.2
    assert newer.verified[False] == 0 and newer.verify[False].predict(4) == pytest.approx(0.034)


def test_a_batch_with_sampled_rows_verifies_on_a_line_of_its_own():
    """Verifications dear where a row samples (the T > 0 path) stop lookup drafts in such
    batches only: an all-greedy batch's line stays the advice's, and it still sends."""
    look = IdleLookup(IdleLookupAdvice(RATES, RATES, (0.036, 0.001)))
    rids = ["a", "b"]
    for _ in range(60):  # sampled batches: each verification as dear as two plain steps
        look.lengths(rids, [3, 0], [False, True], 3)
        look.observe_step(2, 0.036, False)
        look.observe_step(5, 0.075, True)
    assert look.verified == {False: 0, True: 60}
    assert look.lengths(rids, [3, 0], [False, True], 3) == [0, 0]
    assert look.lengths(rids, [3, 0], [True, True], 3) == [3, 0]
    assert look.verify[False].predict(5) == pytest.approx(0.036 + 0.001 * 5)  # the advice's


def test_greedy_and_sampled_requests_send_by_their_own_rates():
    """The same 3-token match: a greedy row sends at its rate, a sampled one (accepting
    a lookup token with the target's probability of it) by its own, lower, rate; each
    outcome teaches its own kind's fit."""
    look = IdleLookup(IdleLookupAdvice(RATES, SAMPLED, (0.036, 0.001)))
    assert look.lengths(["g", "s"], [3, 3], [True, False], 3) == [3, 0]
    assert look.lengths(["s1", "s2"], [3, 3], [False, False], 3) == [0, 0]
    look = IdleLookup(IdleLookupAdvice(RATES, RATES, (0.036, 0.001)))
    assert look.lengths(["g", "s"], [3, 3], [True, False], 3) == [3, 3]
    for _ in range(100):  # the sampled row's drafts rejected, the greedy one's accepted
        look.observe_outcome("g", [1, 2, 3, 4])
        look.observe_outcome("s", [9])
        look.lengths(["g", "s"], [3, 3], [True, False], 3)
    assert look.acceptance.rate(3, True) > RATES[3] > 0.2 > look.acceptance.rate(3, False)
    greedy_row, sampled_row = look.lengths(["g", "s"], [3, 3], [True, False], 3)
    assert greedy_row == 3 and sampled_row < 3


def test_step_cost_line_is_the_line_it_predicts():
    cost = StepCost()
    for w in (1, 4, 8, 16):
        cost.observe(w, 0.03 + 0.002 * w)
    fixed, slope = cost.line()
    assert fixed == pytest.approx(0.03) and slope == pytest.approx(0.002)
    again = StepCost(fixed, slope)
    assert again.predict(12) == pytest.approx(cost.predict(12))
