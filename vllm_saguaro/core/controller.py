"""The speculation-length controller: how many draft tokens each sequence sends, 0..K.

Speculation pays only when what it is expected to add is worth more than it costs: the
target verifies every token sent (its step grows with the tokens of the whole batch) and
a draft that is not cached must be drafted now, on the critical path, while the whole
batch waits. Each step the controller maximises the batch's expected output tokens per
second over every sequence's length and over who drafts a miss:

  E[tokens] = sum_n (1 + sum_{i <= L_n} prod_{j <= i} alpha_nj)
  seconds   = target(sum_n (1 + L_n)) + draft_steps * draft_step(rows drafted)

alpha_nj is the probability that sequence n's j-th draft token is accepted (calibrated
from the draft's confidence, core/selection.py); target(w) and draft_step(rows) are
learned online from measured steps (StepCost). A cache hit's tokens and the fast
backup's are free; the neural fallback's cost draft_steps steps. With nothing worth
sending every length is 0 and the step is plain decoding. The plan space holds every
fixed K and "no speculation", so under the model the choice is never worse than either.

Losslessness for sampled requests: the decision to send token i may depend only on what
was known before token i was drawn, or the tokens sent are no longer distributed as q
(a token kept because it came out likely is biased). Sampled sequences therefore pass
alphas that do not depend on their own drawn tokens (the expected acceptance of the
first position, then the fitted a_p); greedy output is the target's argmax whatever
is sent, so greedy sequences use each drawn token's own confidence.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Candidate:
    """One sequence's options this step.

    free: acceptance probabilities of the tokens available at no draft cost (a cache hit's
    speculation, the fast backup's), in order; neural: of the tokens the neural fallback
    would draft (empty: not an option); cap: the most tokens it may send; fixed: send
    exactly as many as its source has, up to cap (seeded requests, a pinned K).
    """

    free: tuple[float, ...] = ()
    neural: tuple[float, ...] = ()
    cap: int = 0
    fixed: bool = False


@dataclass
class Plan:
    lengths: list[int]
    neural: list[bool]     # drafted by the neural fallback (lengths > 0 only)
    draft_steps: int       # neural fallback steps (the longest neural length)
    tokens: float          # expected output tokens of the step
    seconds: float         # expected step time

    @property
    def rate(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def expected_tokens(alphas) -> float:
    """E[accepted draft tokens] when each is accepted with its alpha until the first
    rejection: sum over i of prod_{j <= i} alpha_j."""
    total, alive = 0.0, 1.0
    for a in alphas:
        alive *= a
        total += alive
    return total


def _prefix_probs(alphas) -> list[float]:
    out, alive = [], 1.0
    for a in alphas:
        alive *= a
        out.append(alive)
    return out


def choose_lengths(cands: list[Candidate], target_s: Callable[[int], float],
                   draft_step_s: Callable[[int], float], sunk_s: float = 0.0) -> Plan:
    """The lengths (and neural rows) that maximise the batch's expected tokens per second.

    For each number d of neural draft steps (0 = no neural fallback) every miss takes the
    source that gives it more tokens; then, since each sequence's prefix probabilities
    only fall with i, the best m tokens of the batch are its m largest prefix
    probabilities, and every m is tried. sunk_s: time already spent this step (the
    fallback, when the lengths are chosen again after it drafted).
    """
    n = len(cands)
    if n == 0:
        return Plan([], [], 0, 0.0, 0.0)
    steps = [0] + sorted({d for c in cands if c.neural for d in range(1, min(c.cap, len(c.neural)) + 1)})
    # a fixed sequence whose free tokens fall short of its cap must be drafted whole
    need = max((min(c.cap, len(c.neural)) for c in cands
                if c.fixed and c.neural and len(c.free) < c.cap), default=0)
    steps = [d for d in steps if d >= need]
    best: Plan | None = None
    for d in steps:
        alphas, neural = [], []
        for c in cands:
            free = c.free[:c.cap]
            whole = min(c.cap, len(c.neural))  # a fixed sequence is drafted whole or not
            use = d > 0 and bool(c.neural) and (not c.fixed or d >= whole) and (
                expected_tokens(c.neural[:min(d, c.cap)]) > expected_tokens(free)
                or (c.fixed and len(free) < c.cap))
            alphas.append(tuple(c.neural[:min(d, c.cap)]) if use else free)
            neural.append(use)
        base = [len(a) if c.fixed else 0 for a, c in zip(alphas, cands)]  # fixed rows: whole
        tokens = n + sum(expected_tokens(a) for a, c in zip(alphas, cands) if c.fixed)
        items = sorted(((p, i) for i, (a, c) in enumerate(zip(alphas, cands)) if not c.fixed
                        for p in _prefix_probs(a)), key=lambda x: -x[0])

        def drafting(ls: list[int]) -> tuple[list[bool], int]:
            """The rows the neural fallback drafts, and its steps (the longest of them)."""
            used = [u and L > 0 for u, L in zip(neural, ls)]
            return used, max((L for u, L in zip(used, ls) if u), default=0)

        # The batch's m best tokens for every m, each step's cost kept as running totals
        # (lengths only grow): O(1) per m. Rebuilding the plan for each m took 8.8 ms a
        # step at batch 256, this 0.5 (benchmarks/plan_cost.py)
        lengths, sent = list(base), sum(base)
        drafted, steps_needed = drafting(lengths)
        rows = sum(drafted)

        def seconds() -> float:
            draft = steps_needed * draft_step_s(rows) if steps_needed else 0.0
            return target_s(n + sent) + draft + sunk_s

        top_tokens, top_seconds, top_m = tokens, seconds(), 0
        for m, (p, i) in enumerate(items, 1):
            lengths[i] += 1
            tokens += p
            sent += 1
            if neural[i]:
                rows += lengths[i] == 1
                steps_needed = max(steps_needed, lengths[i])
            t = seconds()
            if tokens / max(t, 1e-9) > top_tokens / max(top_seconds, 1e-9) + 1e-12:
                top_tokens, top_seconds, top_m = tokens, t, m
        lengths = list(base)
        for _, i in items[:top_m]:
            lengths[i] += 1
        plan = Plan(lengths, *drafting(lengths), top_tokens, top_seconds)
        if best is None or plan.rate > best.rate + 1e-12:
            best = plan
    return best  # type: ignore[return-value]


def plain_then_verify(plain_s: Callable[[int], float], verify_s: Callable[[int], float],
                      batch: int) -> Callable[[int], float]:
    """A step's time by width for a plan whose zero-length step is plain decoding on other
    lines than its verifications: plain_s where nothing is sent (width <= batch),
    verify_s above (SD on the lent cores' plan, draft/lengths.py; the idle's lookup
    drafts, core/idle_lookup.py)."""
    return lambda w: plain_s(w) if w <= batch else verify_s(w)


def draft_more_pays(now: list[Candidate], more: list[Candidate],
                    target_s: Callable[[int], float], step_s: float, spent_s: float) -> bool:
    """Whether the fallback should draft one more step: the batch's best plan with the
    tokens in hand (`now`: free, the drafting already spent, spent_s) against the best
    with each drafting row's next token too (`more`: its acceptance guessed) after one
    more step (step_s). The plan before drafting sees one a_p for every position, while
    on code the draft's tokens come in runs: at batch 1 (HumanEval, T = 0) SD at K = 1
    accepted 1.46 tokens a round (a_p 0.46) where SSD at K = 3 accepted 2.1; with the
    calibrated confidence of each token drafted, a run is followed while it lasts.
    Myopic (one step ahead), so it stops where one more token does not pay even if two
    would."""
    zero = lambda rows: 0.0  # noqa: E731 (the drafting is counted in the sunk time)
    return (choose_lengths(more, target_s, zero, spent_s + step_s).rate
            > choose_lengths(now, target_s, zero, spent_s).rate + 1e-12)


def scheduled_k(schedule, batch: int, k: int) -> int:
    """The most tokens a sequence may send at this batch size under vLLM's hand-written
    schedule (num_speculative_tokens_per_batch_size: (first, last, K) ranges, sorted, the
    first from batch 1), as vLLM 0.32's scheduler reads it
    (v1/spec_decode/dynamic/utils.py build_dynamic_sd_schedule_lookup): a batch size in
    a gap or past the last range takes the K of the range before it; at most k."""
    if not schedule:
        return k
    cap = None
    for first, last, ks in schedule:
        if batch < first:
            break
        cap = ks
        if batch <= last:
            break
    return k if cap is None else min(k, cap)


def may_idle(policy: str, idle: bool, schedule) -> bool:
    """Whether the draft may idle (and so lend its cores to the target on CPU): `idle` on,
    and the controller's `auto` policy or, whatever the policy, vLLM's schedule letting no
    token be sent at some batch size (schedule_limit)."""
    return idle and (policy == "auto" or any(ks == 0 for _, _, ks in schedule or ()))


def schedule_limit(schedule, batch: int, k: int) -> int:
    """The largest batch size below `batch` at which vLLM's schedule lets a sequence send
    a token (scheduled_k), 0 if none: where it lets none at `batch`, the draft idles
    while the batch is larger (DraftWorker's idle), as it would have nothing to send.
    Measured before it (issue 19's twenty-fourth grid, K = 0 from batch 9): with the
    controller's K pinned the draft was called every round at batch 16 and the target
    kept to its own core, 0.50-0.55x plain vLLM on two cores."""
    return next((b for b in range(batch - 1, 0, -1) if scheduled_k(schedule, b, k) > 0), 0)


def batch_limit(speculative_rate: Callable[[int], float], plain_s: Callable[[int], float],
                max_batch: int, idle_rate: Callable[[int], float] | None = None) -> int:
    """The largest batch size (up to max_batch) at which speculation's expected tokens per
    second beat plain decoding's (batch / plain_s(batch)), or what the idle gives where
    that is more (idle_rate: with the proposer's own lookup drafts); 0 if none. Above it
    the draft can stay idle. plain_s is the step time of plain decoding: on the target's
    own cores, or on the draft's too when they can be lent to it (vllm_glue/lending.py)."""
    for b in range(max_batch, 0, -1):
        bar = b / max(plain_s(b), 1e-9)
        if idle_rate is not None:
            bar = max(bar, idle_rate(b))
        if speculative_rate(b) > bar:
            return b
    return 0


# What SSD must be expected to gain over SD on the lent cores, as a share, to take over
# from it (lent_sd_pays, continuing): the way back costs as well (SSD's first round after
# a switch is a cold miss, and a switch to SD on the lent cores again pays
# LENT_SD_ENTRY_MARGIN's cost). Traced at batch 1 (T = 1) without it: while SD on the
# lent cores was tried after a close idle (no entry margin), its model and SSD's were
# within 1% of each other and the regime changed from one step to the next.
SSD_ENTRY_MARGIN = 0.05


def lent_sd_pays(ssd_rate: float, lent_sd_rate: float | None, continuing: bool = False) -> bool:
    """Whether a batch size that speculates (it beats plain decoding) does it as SD on
    the lent cores rather than as SSD. On CPU the draft's "device" is a core taken from
    the target: SSD drafts on it while the target verifies on its own cores, SD on the
    lent cores drafts while the target waits and verifies on every core. Measured at
    batch 1 on the 2-core reference machine: the target's step on two cores is ~0.6x its
    step on one, so SD on both (K = 1) ran 1.01-1.04x plain decoding at T = 0 where SSD
    (its verification on one core) ran below it. None: not known yet (no lent cores, or
    the draft's step not measured). continuing: SD on the lent cores runs already, and
    SSD takes over only where it is expected SSD_ENTRY_MARGIN faster (the other way, the
    margin is lent_sd_worth's)."""
    if lent_sd_rate is None:
        return False
    if continuing:
        return lent_sd_rate * (1.0 + SSD_ENTRY_MARGIN) >= ssd_rate
    return lent_sd_rate > ssd_rate


# What SD on the lent cores must be expected to gain, as a share, to be taken up from a
# round that was not one (lent_sd_worth).
LENT_SD_ENTRY_MARGIN = 0.05


def lent_sd_worth(lent_sd_rate: float | None, continuing: bool) -> float | None:
    """SD on the lent cores' expected rate as the choice weighs it (against SSD and plain
    decoding): discounted by LENT_SD_ENTRY_MARGIN unless the last round was one already.
    Why: a switch costs what no round's model holds, and the model runs a few % high
    where the choice is close. Measured at batch 4 (MT-Bench, T = 0, the reference pair):
    the first such round after SSD's waited 36-82 ms more on the draft (its glue pass of
    the batch's prompts) and its verification took 66-75 ms against 48 after; held there
    for whole batches it gave 0.94-0.96x plain decoding where the model expected 0.98x,
    and when noise lifted the model above plain decoding it was taken (19-71% of the
    rounds in two grids, 0.89-0.90x plain vLLM). At batch 1 it is expected 1.10-1.19x
    plain decoding, and gave 1.15x."""
    if lent_sd_rate is None or continuing:
        return lent_sd_rate
    return lent_sd_rate / (1.0 + LENT_SD_ENTRY_MARGIN)


def auto_regime(ssd_rate: float, lent_sd_rate: float | None, plain_rate: float
                ) -> tuple[str, float]:
    """What controller.regime 'auto' settles on at one batch size, and the rate it then
    runs at: 'plain' (the draft idles, its cores lent), 'lent_sd' or 'ssd'. The worker's
    rules composed for one batch size held steady: speculate where the better of SSD and
    SD on the lent cores as weighed on entry (lent_sd_worth) beats plain decoding
    (batch_limit), and then as SD on the lent cores where that beats SSD (lent_sd_pays);
    once taken it runs at its own rate. For predictions (`vllm-saguaro tune`): the
    worker decides step by step with these same functions."""
    worth = lent_sd_worth(lent_sd_rate, continuing=False)
    if max(ssd_rate, worth or 0.0) <= plain_rate:
        return "plain", plain_rate
    if lent_sd_pays(ssd_rate, worth):
        return "lent_sd", lent_sd_rate
    return "ssd", ssd_rate


# How soon speculation at a batch size must pay back the draft's catch-up (catch_up_pays).
CATCH_UP_HORIZON_S = 5.0


def catch_up_pays(gain_tok_s: float, catch_up_s: float, lost_tok_s: float,
                  horizon_s: float = CATCH_UP_HORIZON_S) -> bool:
    """Whether to start speculating on sequences the draft does not hold yet (a batch
    that arrived, or one it left while idle): it must first prefill them, catch_up_s on
    its cores, and meanwhile plain decoding runs without those cores (they were lent to
    the target), losing lost_tok_s tokens a second. Worth it when speculation's expected
    gain over plain decoding (gain_tok_s) pays that back within horizon_s: the
    batch's requests may not last much longer. Measured before: at batch 16 a wake
    prefilled 16 prompts on the draft's core for 0.8-2.3 s per cell, for a gain the
    controller then did not find, and plain decoding ran on one core meanwhile."""
    return gain_tok_s * horizon_s >= max(lost_tok_s, 0.0) * catch_up_s


def beats_plain(plan: Plan, batch: int, plain_s: Callable[[int], float] | None) -> bool:
    """Whether a plan's expected rate beats plain decoding's at step time plain_s (None:
    plain decoding on the same cores, which the plan space already holds)."""
    return plain_s is None or plan.rate > batch / max(plain_s(batch), 1e-9)


def speculation_pays(cands: list[Candidate], target_s: Callable[[int], float],
                     plain_s: Callable[[int], float] | None = None) -> bool:
    """Whether the best plan with free tokens sends anything and beats plain decoding."""
    plan = choose_lengths(cands, target_s, lambda rows: 0.0)
    return sum(plan.lengths) > 0 and beats_plain(plan, len(cands), plain_s)


# How many standard errors from the model a realized rate must be to overrule it
# (RealizedRate.clamp): a round gives 1, 2 or 3 tokens, so a short average swings.
REALIZED_Z = 2.0


class RealizedRate:
    """The tokens per second speculation actually gave at each batch size, measured round
    to round (the whole round: the target's step, the wait for the draft, transport, and
    the rows the controller sent nothing for), an exponential average.

    Why: the idle decision compares speculation with plain decoding, and theory.py's rate
    sees only what its model holds. Measured before: at batch 1 it said 1.74x of the
    target on one core while speculation gave 1.22x, below plain decoding on the lent
    cores (1.40x), so the draft kept speculating at 0.87x of plain vLLM on two cores. The
    decision takes the model's rate clamped to this one's bounds (clamp: REALIZED_Z
    standard errors either side), where this one is known: after `min_rounds` rounds at
    that batch size and `min_rows` rows (rounds times the batch: a round of b rows sums b
    rows' tokens, so its rate is known as well after 1/b as many rounds; rounds_needed),
    and for `ttl_s` after the last (then speculation is tried again, since acceptance
    moves with the text).

    The rate is the average tokens over the average seconds (a ratio estimator), each a
    plain mean over the first 1/alpha rounds and an exponential average after. Measured
    before: at batch 1 a round gives 1, 2 or 3 tokens, so an average of per-round rates
    over 8 rounds swung by a third and once put SD on the lent cores below plain decoding
    for two minutes; and the point estimate with alpha 0.05 (~40 rounds) still dipped
    below plain decoding (25.1 against 25.3 tok/s) on one HumanEval prompt at batch 1,
    idling the draft for the next 30 s, where SD on the lent cores, kept, gave 1.10x
    plain vLLM over the set: hence the upper bound (and, for SD on the lent cores, an
    average over ~100 rounds; DraftWorker.lent_sd_realized)."""

    def __init__(self, min_rounds: int = 8, ttl_s: float = 120.0, alpha: float = 0.2,
                 min_rows: int = 0):
        self.min_rounds, self.ttl_s, self.alpha = min_rounds, ttl_s, alpha
        self.min_rows = min_rows
        # batch -> (averages of tokens, seconds, tokens^2, seconds^2, tokens*seconds;
        # rounds, when last)
        self._seen: dict[int, tuple[tuple[float, ...], int, float]] = {}

    def observe(self, batch: int, tokens: int, seconds: float, now: float) -> None:
        """A round at this batch size gave `tokens` in `seconds` (start to start)."""
        if seconds <= 0:
            return
        means, rounds, at = self._seen.get(batch, ((0.0,) * 5, 0, now))
        if rounds and now - at > self.ttl_s:
            means, rounds = (0.0,) * 5, 0
        w = max(self.alpha, 1.0 / (rounds + 1))
        x = (tokens, seconds, tokens * tokens, seconds * seconds, tokens * seconds)
        self._seen[batch] = (tuple((1 - w) * m + w * v for m, v in zip(means, x)), rounds + 1, now)

    def rounds(self, batch: int) -> int:
        return self._seen.get(batch, ((), 0, 0.0))[1]

    def rounds_needed(self, batch: int) -> int:
        """Rounds at this batch size before its rate is known."""
        return max(self.min_rounds, -(-self.min_rows // max(batch, 1)))

    def forget(self, batch: int) -> None:
        """Drop what this batch size gave (it is to be measured anew)."""
        self._seen.pop(batch, None)

    def forget_all(self) -> None:
        """Drop what every batch size gave (the text it was measured on is gone)."""
        self._seen.clear()

    def _known(self, batch: int, now: float):
        means, rounds, at = self._seen.get(batch, ((), 0, now))
        if rounds < self.rounds_needed(batch) or now - at > self.ttl_s:
            return None
        return means, rounds

    def rate(self, batch: int, now: float) -> float | None:
        """The measured rate at this batch size, or None while not known (too few rounds,
        or none for ttl_s)."""
        known = self._known(batch, now)
        return None if known is None else known[0][0] / known[0][1]

    def bounds(self, batch: int, now: float, z: float = REALIZED_Z
               ) -> tuple[float, float] | None:
        """rate -/+ z standard errors (None where rate is): what the measurement cannot
        rule out. The ratio estimator's variance, var(t - R s) / (n mean(s)^2), over the
        rounds the average holds (n: at most (2 - alpha) / alpha, an exponential
        average's effective count)."""
        known = self._known(batch, now)
        if known is None:
            return None
        (t, s, tt, ss, ts), rounds = known
        r = t / s
        var = max(0.0, (tt - t * t) - 2 * r * (ts - t * s) + r * r * (ss - s * s))
        n = min(rounds, (2 - self.alpha) / self.alpha)
        half = z * math.sqrt(var / max(n - 1, 1.0)) / s
        return r - half, r + half

    def clamp(self, expected: float, batch: int, now: float) -> float:
        """The model's rate moved into what the measurement cannot rule out (bounds), or
        the model's alone where nothing is measured. Both ways: the model holds one a_p
        for every position of a speculation, while on code the draft's tokens come in
        runs (measured at batch 1, HumanEval, T = 0: SD on the lent cores at K = 1 put a_p
        at 0.41-0.46, where SSD at K = 3 accepted 2.1 tokens a round and ran 1.22x plain
        decoding, above what the model gave it); and down, as before."""
        b = self.bounds(batch, now)
        return expected if b is None else min(max(expected, b[0]), b[1])


class StepCost:
    """A step's time as a function of its width, t(w) = fixed + per_token * w, learned online.

    Least squares over the measured (width, seconds) with exponential forgetting. While
    the widths seen do not spread (plain decoding at one batch size, a pinned K), the
    slope is the last one identified, or the prior: per_token = token_cost x fixed. A
    prior (fixed_s, per_token_s), e.g. measured by `vllm-saguaro tune`, counts as
    prior_weight observations at two widths. Linear holds well for a CPU target (weights
    streamed once per step, attention and MLP per token); on a GPU the curve is flat up to
    the width that saturates it, which a linear fit overstates at small widths.
    """

    def __init__(self, fixed_s: float | None = None, per_token_s: float | None = None,
                 token_cost: float = 0.05, decay: float = 0.98, prior_weight: float = 4.0):
        self.token_cost, self.decay = token_cost, decay
        self.s0 = self.s1 = self.s2 = self.t0 = self.t1 = 0.0
        self._slope: float | None = None
        if fixed_s is not None and per_token_s is not None:
            self._slope = per_token_s
            for w in (1, 16):
                self._add(w, fixed_s + per_token_s * w, prior_weight / 2)

    def _add(self, w: float, t: float, weight: float = 1.0) -> None:
        g = self.decay
        self.s0, self.s1, self.s2 = g * self.s0 + weight, g * self.s1 + weight * w, g * self.s2 + weight * w * w
        self.t0, self.t1 = g * self.t0 + weight * t, g * self.t1 + weight * w * t

    def observe(self, width: int, seconds: float) -> None:
        if width > 0 and seconds > 0:
            self._add(float(width), seconds)

    def discount(self, keep: float) -> None:
        """Weigh what was measured so far by `keep` (0..1): the next observations, a new
        measurement, dominate the line (the slope once identified stays)."""
        self.s0, self.s1, self.s2 = keep * self.s0, keep * self.s1, keep * self.s2
        self.t0, self.t1 = keep * self.t0, keep * self.t1

    @property
    def known(self) -> bool:
        return self.s0 > 0

    def slope(self) -> float:
        if not self.known:
            return 0.0
        mw = self.s1 / self.s0
        var = self.s2 / self.s0 - mw * mw
        if var > 0.25:  # widths spread by more than about one token
            cov = self.t1 / self.s0 - mw * self.t0 / self.s0
            self._slope = max(cov / var, 0.0)
        if self._slope is not None:
            return self._slope
        mt = self.t0 / self.s0  # t = fixed (1 + token_cost * w) at the mean width
        return self.token_cost * mt / (1.0 + self.token_cost * mw)

    def line(self) -> tuple[float, float]:
        """(fixed_s, per_token_s) of the line predict draws (its fixed part at least 0),
        e.g. as the prior of another StepCost that goes on from this one's measurements."""
        slope = self.slope()
        return max(self.t0 / self.s0 - slope * self.s1 / self.s0, 0.0), slope

    def predict(self, width: int) -> float:
        """Seconds for a step of `width`; 0.0 while nothing is known (optimistic: the
        first use measures it)."""
        if not self.known:
            return 0.0
        mw, mt = self.s1 / self.s0, self.t0 / self.s0
        return max(mt + self.slope() * (width - mw), 1e-6)

    def as_dict(self) -> dict:
        if not self.known:
            return {"fixed_s": None, "per_token_s": None}
        slope = self.slope()
        return {"fixed_s": self.t0 / self.s0 - slope * self.s1 / self.s0, "per_token_s": slope}
