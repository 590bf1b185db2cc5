"""Prompt lookup while the draft idles: drafts the proposer makes itself, with no call to
the draft.

Where speculation with the draft does not pay (its round trip, its catch-up of a batch
it left while idle, the verification's width), the draft idles and the target decodes
plainly (on CPU on every core, vllm_glue/lending.py). Text that repeats itself (code,
edits, quoted input) still offers drafts at no cost: the continuation of the most recent
earlier occurrence of its last tokens (core/fallback.py ngram_match). Made where the
tokens already are, in the target's process, such a draft costs only its verification's
extra width. Measured at batch 4 on HumanEval (T = 0, the reference pair, a 2-core EPYC;
docs/measurements.md, issue 19's eighteenth round): the draft's rounds of lookup drafts
gave 5.24 tokens in 52.1 ms, of which the verification took 38.6-38.9 ms and about 13 ms
was the round trip to the draft and its step; plain decoding ran 102-116 tok/s.

Each step the controller's objective picks the lengths (core/controller.py
choose_lengths: a lookup draft's tokens are free, each accepted at its match length's
rate); a round sends anything only where the plan beats plain decoding by
LOOKUP_ENTRY_MARGIN (models run a few % high where the choice is close). The rates and
plain decoding's line start from the draft worker's (IdleLookupAdvice), and so does the
verification's: the same forward at that width on the same cores. Not SD on the lent
cores' verification line, measured after the draft's turn on the target's cores: at
batch 4 on HumanEval (T = 0) it put a verification 10-20 ms above a plain step of its
width, and the lookup drafts never went out (a pessimistic line is never corrected, as
nothing is sent to measure it). All three follow what these rounds measure. Lossless as
any draft is: the target verifies, and a sampled request's lookup draft is verified
with a one-hot q (the proposer's).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from vllm_saguaro.core.controller import (Candidate, StepCost, choose_lengths, expected_tokens,
                                          plain_then_verify)
from vllm_saguaro.core.fallback import MatchAcceptance
from vllm_saguaro.core.span import span_lengths

# What a round of lookup drafts must be expected to gain over plain decoding, as a share,
# to send anything.
LOOKUP_ENTRY_MARGIN = 0.05

# Each round's weight left to a row's pace before it (_keep_pace): about ten rounds.
PACE_DECAY = 0.9


class IdleLookupAdvice(NamedTuple):
    """What the draft worker hands the proposer with an idle (draft/regime.py IdleAdvice):
    the acceptance of a lookup draft's tokens by match length (core/fallback.py
    MatchAcceptance), a greedy request's and a sampled one's, and the line (fixed_s,
    per_token_s) of plain decoding's step by width on the cores the target has while the
    draft idles."""

    rates: tuple[float, ...]
    sampled_rates: tuple[float, ...]
    plain: tuple[float, float]
    forced: bool = False  # testing switch (controller.force_idle_lookup): every row sends


def lookup_lengths(rates: list[float | None], cap: int,
                   plain_s: Callable[[int], float], verify_s: Callable[[int], float],
                   margin: float = LOOKUP_ENTRY_MARGIN) -> list[int]:
    """Tokens each row sends, 0..cap: rates[i] is the acceptance of each token of row i's
    lookup draft (that of its match length, for its kind of request; None: the row may
    send nothing: it is not decoding, or a seeded request, whose drafts must not depend
    on timing). All 0 unless the plan's expected rate beats plain decoding's by
    `margin`."""
    batch = len(rates)
    if not batch or cap <= 0:
        return [0] * batch
    cands = [Candidate() if r is None else Candidate(free=(r,) * cap, cap=cap) for r in rates]
    plan = choose_lengths(cands, plain_then_verify(plain_s, verify_s, batch), lambda rows: 0.0)
    plain = batch / max(plain_s(batch), 1e-9)
    if not sum(plan.lengths) or plan.rate <= (1.0 + margin) * plain:
        return [0] * batch
    return plan.lengths


def idle_lookup_rate(batch: int, share: float, rate: float, k: int,
                     plain_s: Callable[[int], float], verify_s: Callable[[int], float]) -> float:
    """Expected tokens per second of prompt lookup while idle, when `share` of the rows
    continue a match whose tokens are each accepted at `rate` and the rest match nothing
    (they send nothing): the best length 0..k for the matched rows (0: plain decoding)."""
    rows = share * batch
    best = batch / max(plain_s(batch), 1e-9)
    for n in range(1, k + 1):
        width = batch + rows * n
        if width <= batch:
            break
        best = max(best, (batch + rows * expected_tokens((rate,) * n)) / max(verify_s(width), 1e-9))
    return best


class IdleLookup:
    """The proposer's prompt lookup through one idle (vllm_glue/proposer.py): the rates by
    match length (greedy and sampled requests apart: a sampled one accepts a lookup
    token with the target's probability of it) and the two lines, from the advice, then
    from its own rounds; the rows that sent drafts last round, to learn from what was
    accepted.

    The verification's line is kept for a batch with sampled rows apart from an
    all-greedy one (`verify[sampled]`): measured at batch 4 on HumanEval (paired within
    one engine start, issue 19's twenty-second round), a round of lookup drafts cost
    ~15 ms more than a plain step of ~47 ms at T = 0 (1.14x plain decoding) and ~42 ms
    more at T = 1 (0.95x), where one line learnt at T = 0 held on into T = 1.

    `before`, the last idle's: what it measured goes on. Its verification lines (the
    same forward on the same cores, whatever the text) replace the advice's guess,
    and its lookup drafts' judged tokens stay in the acceptance, under the draft's
    newer rates as the prior. Measured without (the same round): every batch of the
    benchmark began a new idle from the draft's rates and plain decoding's line, and
    at batch 4 the idle's lookup drafts ran MT-Bench (T = 0) at 0.95x plain decoding
    in two starts, where without them it ran 1.02x: a round of them cost ~25 ms more
    than a plain step of ~47 ms, for ~0.9 tokens of 4 rows."""

    def __init__(self, advice: IdleLookupAdvice, margin: float = LOOKUP_ENTRY_MARGIN,
                 before: IdleLookup | None = None):
        self.acceptance = MatchAcceptance(advice.rates, advice.sampled_rates)
        self.plain = StepCost(*advice.plain)
        # until measured: a step of that width; by whether a row of the batch samples
        self.verify = {kind: StepCost(*advice.plain) for kind in (False, True)}
        self.verified = {False: 0, True: 0}  # verifications measured (with those before)
        self._sampled = False  # whether a row sampled in the last round that chose lengths
        self.margin = margin
        self.forced = advice.forced
        # request -> (greedy, match length, tokens sent)
        self.sent: dict[str, tuple[bool, int, int]] = {}
        self.pace: dict[str, float] = {}  # request -> tokens a round (_keep_pace)
        if before is not None:
            for kind, n in before.verified.items():
                if n:
                    self.verify[kind], self.verified[kind] = before.verify[kind], n
            for greedy, fits in self.acceptance.fits.items():
                for fit, old in zip(fits, before.acceptance.fits[greedy]):
                    fit.accepted, fit.rejected = old.accepted, old.rejected
            self.pace = dict(before.pace)

    def observe_step(self, width: int, seconds: float, drafted: bool) -> None:
        """The target's last step, as the proposer measured it (a clean decode step): a
        verification of the last round's drafts, or a plain step."""
        if drafted:
            self.verify[self._sampled].observe(width, seconds)
            self.verified[self._sampled] += 1
        else:
            self.plain.observe(width, seconds)

    def observe_outcome(self, rid: str, sampled: list[int]) -> None:
        """What the target accepted of the request's last lookup draft: its tokens this
        step are the accepted ones and one more."""
        made = self.sent.pop(rid, None)
        if made is not None and sampled:
            greedy, n, sent = made
            self.acceptance.observe(n, min(len(sampled) - 1, sent), sent, greedy)

    def lengths(self, rids: list[str], matches: list[int | None], greedy: list[bool],
                cap: int, left: list[int] | None = None) -> list[int]:
        """This step's lengths, remembered per request for its outcome; greedy[i]:
        whether row i's request is greedy. left: the tokens each row has left where the
        batch drains (core/span.py: the lengths that finish it soonest, by the rows'
        paces); None: the most tokens per second (lookup_lengths)."""
        self.sent.clear()
        self._sampled = not all(greedy)
        if self.forced:
            out = [0 if n is None else cap for n in matches]
        else:
            rates = [None if n is None else self.acceptance.rate(n, g)
                     for n, g in zip(matches, greedy)]
            pace = self._keep_pace(rids, rates, cap)
            verify_s = self.verify[self._sampled].predict
            if left is None:
                out = lookup_lengths(rates, cap, self.plain.predict, verify_s, self.margin)
            else:
                out = span_lengths([None if r is None else (r,) * cap for r in rates], left,
                                   pace, self.plain.line(), verify_s, self.margin)
        for rid, n, g, length in zip(rids, matches, greedy, out):
            if length:
                self.sent[rid] = (g, n, length)
        return out

    def _keep_pace(self, rids: list[str], rates: list[float | None], cap: int) -> list[float]:
        """Each row's pace (core/span.py): the tokens its lookup drafts are expected to
        have accepted a round, sent or not, averaged over its recent rounds (from 0, the
        pace of text that does not repeat). Rows that may not send keep theirs."""
        pace = {}
        for rid, rate in zip(rids, rates):
            was = self.pace.get(rid, 0.0)
            if rate is not None:
                was = PACE_DECAY * was + (1.0 - PACE_DECAY) * expected_tokens((rate,) * cap)
            pace[rid] = was
        self.pace = pace  # requests gone from the batch are dropped
        return [pace[rid] for rid in rids]
