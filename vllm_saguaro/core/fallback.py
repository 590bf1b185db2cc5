"""The fast backup for a cache miss (paper sec. 4.3): prompt lookup.

On a miss something must draft the next speculation on the critical path. The neural
backup (the draft model, as in ordinary SD) is accurate but slow; the fast backup (prompt
lookup: continue an earlier occurrence of the last few tokens) is nearly free and
deterministic, so it is verified with a one-hot q, losslessly. One miss stalls the whole
batch step, so the neural backup pays at small batch and not at large batch: which one
drafts (or neither) is the controller's choice, by the same objective as every length
(core/controller.py).

How likely a lookup draft is to be accepted depends above all on how long a match it
continues (MatchAcceptance). Measured on the reference target's greedy output (8 prompts
a set, 64 tokens, K = 3, every position; benchmarks/lookup_acceptance.py): on HumanEval a
3-token match stood at 52% of the positions and had 2.42 of its 3 tokens accepted, no
match (the last token repeated) at 17% and none accepted; on MT-Bench 7% and 1.86, 56%
and none. One acceptance for every lookup draft (0.2-0.5) put the fast backup below the
neural one on every miss, where on code its 3-token matches beat it at no draft cost.
"""
from __future__ import annotations

from typing import NamedTuple

from vllm_saguaro.core.fanout import AcceptanceFit

# The fast backup's acceptance priors by match length 0..3, below the measured (above)
# until its own rounds say otherwise.
MATCH_PRIORS = (0.02, 0.15, 0.35, 0.55)
# The same for sampled requests, which accept a lookup token with the target's
# probability of it. Measured per token (accepted / (accepted + rejections),
# benchmarks/lookup_acceptance.py, 8 prompts a set, 64 tokens, K = 3) by match length
# 1 / 2 / 3: greedy 0.13 / 0.39 / 0.79 on MT-Bench, 0.31 / 0.65 / 0.90 on HumanEval;
# sampled at T = 1 0.08 / 0.31 / 0.27 (3-token matches at 2% of the positions) and
# 0.18 / 0.47 / 0.72.
SAMPLED_MATCH_PRIORS = (0.01, 0.05, 0.2, 0.3)


class FastDraft(NamedTuple):
    """A lookup draft: its tokens, the length n of the match it continues (0: none), and
    the length of the token list it was made from (the draft for those tokens)."""

    tokens: list[int]
    n: int
    at: int


def ngram_match(tokens: list[int], k: int, max_n: int = 3) -> FastDraft:
    """k tokens continuing the most recent earlier occurrence of the last n tokens (the
    longest n up to max_n that occurs); the last token repeated if nothing matches (n = 0).
    The earlier occurrences of the last token are found by list.index on the reversed
    list (C speed: a draft is made for every miss, and no match is the common case on
    prose: 0.2 ms scanned in Python at 600 tokens)."""
    length, last = len(tokens), tokens[-1]
    rev = tokens[::-1]
    best_n, best_end, i = 0, -1, 0
    while best_n < max_n:
        try:
            i = rev.index(last, i + 1)
        except ValueError:
            break
        end = length - 1 - i  # an earlier occurrence of the last token
        n = 1
        while n < max_n and n <= end and tokens[end - n] == tokens[length - 1 - n]:
            n += 1
        if n > best_n:  # the most recent occurrence of the longest match
            best_n, best_end = n, end
    if not best_n:
        return FastDraft([last] * k, 0, length)
    seq = list(tokens)
    for j in range(k):  # a match close to the end continues into its own copy
        seq.append(seq[best_end + 1 + j])
    return FastDraft(seq[length:], best_n, length)


def recent_matches(tokens: list[int], window: int = 32, max_n: int = 3) -> list[int]:
    """The match length of the lookup draft at each of the last `window` positions of
    `tokens` (made from the tokens before it)."""
    return [ngram_match(tokens[:t], 1, max_n).n for t in range(max(1, len(tokens) - window),
                                                              len(tokens))]


class MatchAcceptance:
    """The fast backup's per-token acceptance by match length (AcceptanceFit each, from
    its drafts sent and those judged without being sent), for greedy and for sampled
    requests apart, and how often each match length comes up (decayed counts of the
    drafts made): the idle decision's model weighs the misses the fast backup would serve
    by both (core/theory.py ssd_rate's `fast`).

    A sampled request accepts a lookup token (verified with a one-hot q) with the
    target's probability of it, a greedy one where it is the argmax (SAMPLED_MATCH_PRIORS
    above: at T = 1 a 3-token match's tokens 0.27-0.72 where greedy 0.79-0.90); one fit
    for both carried the T = 0 rounds' rates into a T = 1 batch (issue 19's twentieth
    round). A batch's rate is the mix of its rows' (sampled_share, set by the draft
    worker each step)."""

    def __init__(self, priors: tuple[float, ...] = MATCH_PRIORS,
                 sampled_priors: tuple[float, ...] = SAMPLED_MATCH_PRIORS, decay: float = 0.99):
        if len(priors) != len(sampled_priors):
            raise ValueError("one prior per match length, for greedy and sampled requests alike")
        self.fits = {True: [AcceptanceFit(p) for p in priors],
                     False: [AcceptanceFit(p) for p in sampled_priors]}
        self.decay = decay
        self.seen = [0.0] * len(priors)
        self.sampled_share = 0.0

    @property
    def lengths(self) -> int:
        """How many match lengths (0..max) it keeps."""
        return len(self.seen)

    def note(self, n: int) -> None:
        """A draft was made with a match of length n."""
        self.seen = [s * self.decay for s in self.seen]
        self.seen[n] += 1.0

    def observe(self, n: int, accepted: int, judged: int, greedy: bool = True) -> None:
        self.fits[greedy][n].observe(accepted, judged)

    def rate(self, n: int, greedy: bool | None = None) -> float:
        """A token's acceptance after a match of length n: a greedy or a sampled
        request's, or (None) the batch's mix."""
        if greedy is not None:
            return self.fits[greedy][n].rate
        s = self.sampled_share
        return (1.0 - s) * self.fits[True][n].rate + s * self.fits[False][n].rate

    def rates(self, greedy: bool | None = None) -> tuple[float, ...]:
        return tuple(self.rate(n, greedy) for n in range(self.lengths))

    def shares(self) -> list[float]:
        """Each match length's share of the drafts made (all 'no match' before any)."""
        total = sum(self.seen)
        if total <= 0:
            return [1.0] + [0.0] * (len(self.seen) - 1)
        return [s / total for s in self.seen]

    def seen_in(self, lengths: list[int]) -> None:
        """The match lengths of the text now in the batch (recent_matches of its
        sequences' latest positions) replace the counts: what came up before was of
        text that is gone, or that the draft did not see while it idled."""
        if lengths:
            self.seen = [float(lengths.count(n)) for n in range(len(self.seen))]

    @property
    def overall(self) -> float:
        """The acceptance of a lookup draft, all match lengths as they come up (the
        batch's mix)."""
        return sum(s * r for s, r in zip(self.shares(), self.rates()))


class LookupWatch:
    """The share of the batch's latest positions whose lookup draft continues a match of
    max_n tokens, as an exponential average over about `window` positions: what the
    proposer watches while the draft idles (IdleAdvice.wake_share)."""

    def __init__(self, window: int = 32, min_positions: int = 16, max_n: int = 3):
        self.decay, self.min_positions, self.max_n = 1.0 - 1.0 / window, min_positions, max_n
        self.matched = self.positions = 0.0
        self.seen = 0  # positions observed, not decayed

    def observe(self, tokens: list[int]) -> None:
        """One position: the sequence's tokens so far."""
        self.observe_match(ngram_match(tokens, 1, self.max_n).n)

    def observe_match(self, n: int) -> None:
        """One position whose lookup draft continues a match of n tokens (made already)."""
        long = n >= self.max_n
        self.matched = self.decay * self.matched + long
        self.positions = self.decay * self.positions + 1.0
        self.seen += 1

    def shows(self, share: float) -> bool:
        """At least min_positions observed, and the share of long matches at `share`."""
        return self.seen >= self.min_positions and self.matched >= share * self.positions
