"""How a round speculates, decided every step at the batch size running: SSD (the draft
pre-speculates on its own cores while the target verifies on its own), SD on the lent
cores (the draft drafts while the target waits, on the target's cores too, and the target
verifies on every core), or not at all (the draft idles and lends its cores: plain
decoding). Each is weighed by its model (core/theory.py with the measured step costs),
clamped to what it was measured to give (core/controller.py RealizedRate); plain
decoding on the lent cores is probed where it was not measured, or not lately, and SSD
is explored where SD on the lent cores runs instead (SSD_EXPLORE_ROUNDS); where both
were measured, what they gave decides between them. The fast backup's lookup drafts
count in both regimes by the share of the text that continues a match, which an idle
names for the proposer to watch (LOOKUP_WAKE_SHARES), and text whose matches moved makes
what was measured on the text before forgotten (TEXT_CHANGE_SHARE).

A mixin of DraftWorker (draft/worker.py), whose __init__ holds the state it uses (the
cost lines, the realized rates, the probes, the regime's counters).
"""
from __future__ import annotations

import time
from typing import NamedTuple

from vllm_saguaro.core.controller import (Candidate, StepCost, batch_limit, beats_plain,
                                          catch_up_pays, lent_sd_pays, lent_sd_worth,
                                          schedule_limit, speculation_pays)
from vllm_saguaro.core.fallback import recent_matches
from vllm_saguaro.core.idle_lookup import (LOOKUP_ENTRY_MARGIN, IdleLookupAdvice,
                                           idle_lookup_rate)
from vllm_saguaro.core.sampling import SamplingSpec
from vllm_saguaro.core.theory import sd_rate, ssd_rate
from vllm_saguaro.draft.drafting import lcp
from vllm_saguaro.draft.state import Update

# An idle decision against SD on the lent cores that its model puts within this share of
# plain decoding is a close one: the proposer asks again after CLOSE_RECHECK_S rather
# than its default 30 s, and the draft then tries it for a few rounds (_explore).
CLOSE_SHARE = 0.1
CLOSE_RECHECK_S = 10.0

# Plain decoding on the lent cores is measured again (a probe, IdleAdvice.probe) at a
# batch size where it was not probed for this long and speculation is chosen there, the
# old line then weighed by LENT_REPROBE_KEEP: while SD on the lent cores or SSD runs,
# only the odd round measures it (a new request's first, at batch 1). Measured at batch
# 1 (T = 1): the first probe ran in the engine's warm-up and put plain decoding at 11
# tok/s, 13-16 after, where plain vLLM ran 18, and SD on the lent cores at 17-20 was
# taken as far ahead of it (0.94-0.95x plain vLLM).
LENT_REPROBE_S = 30.0
LENT_REPROBE_KEEP = 0.1


# SSD is measured where SD on the lent cores is chosen over it (an exploration,
# _ssd_explore_due): SSD_EXPLORE_ROUNDS of SSD's rounds at that batch size, once per
# SSD_EXPLORE_S there while what SSD gave is not known (RealizedRate.ttl_s). Its model's
# inputs are SSD's own (the target's step on its own cores, the hit rate, the acceptance
# at K), which only its rounds measure, and SD on the lent cores runs none; and where
# both were measured, the choice goes by what they gave (_lent_sd_step). Measured at
# batch 1 (HumanEval, T = 0): under SD on the lent cores the target's own line was
# the cold first steps of the engine's run (53-67 ms a step, SSD's steady ones 38-42) and
# the hit rate its 0.5 prior (0.57 measured), so SSD's model said 23-31 tok/s; SSD pinned
# ran 43-48, the auto choice 34 (plain vLLM 31).
SSD_EXPLORE_ROUNDS = 48
SSD_EXPLORE_S = 60.0

# An exploration of SSD after which SSD was not chosen (it lost to SD on the lent cores
# or the idle) makes the next one at that batch size wait SSD_EXPLORE_S doubled, for
# each such exploration in a row (up to 4x); one after which SSD runs, or text or
# sampling that changed what the regimes gave (TEXT_CHANGE_SHARE, SAMPLING_CHANGE_SHARE),
# ends the backoff. Traced at batch 1 (MT-Bench, T = 0, issue 19's twenty-fifth round):
# SSD gave 19-20 tok/s where SD on the lent cores gave 23, and an exploration every
# ~70 s ran its 48 rounds over one and a half prompts each time, 1.13x and 0.95x
# plain decoding on those prompts where SD on the lent cores pinned ran 1.49x and 1.20x.
SSD_EXPLORE_BACKOFF_MAX = 2  # doublings

# SSD is tried from an idle (_ssd_try_due: SSD_EXPLORE_ROUNDS of its rounds, on a recheck
# after CLOSE_RECHECK_S) at a batch size where it was not measured nor explored for
# SSD_EXPLORE_S and its model puts it within SSD_TRY_SHARE of plain decoding: while idle
# nothing else measures it, and its model runs low. Measured at batch 1 (HumanEval,
# T = 0): the engine's cold first steps put the target's own step at 66 ms (SSD's steady
# ones 54-60 in the other start), SSD's model at 25.1 tok/s against plain decoding's
# 25.4, and the draft idled through the whole run (0.94x plain vLLM; the other start ran
# SSD, 1.18x). Tried once per batch size only, HumanEval after MT-Bench on one engine
# idled in 61% of its rounds (SSD 0.77x the schedule), where the model's one a_p for
# every position misses the runs of accepted tokens on code.
SSD_TRY_SHARE = 0.25

# A try of SSD from an idle (SSD_TRY_SHARE) after which SSD was not chosen: the next try
# at that batch size waits until SSD's model, against what the idle gives, has risen by
# SSD_RETRY_RISE since (the acceptance, the hit rate, the text's lookups or the costs
# moved its way): the same model would try, and lose, again. Text or sampling that
# changed does not end the wait by itself, as it ends the explorations' backoff: the
# model's inputs carry them. Kept SSD_RETRY_S. Measured at batch 4 (issue 19,
# twenty-seventh round, the plugin paused and plain vLLM beside): each try there catches
# the batch up on the draft's core and runs ~10 rounds of SSD with the target on its own
# core; the two batches of prompts with one ran 0.83x and 0.90x the plugin paused (their
# cells' other batches 0.97-1.03, but for one with a probe of the lent cores), and the
# second, on MT-Bench at T = 1 after one lost at T = 0, came as the text changes between
# had ended the backoff.
SSD_RETRY_RISE = 0.1
SSD_RETRY_S = 600.0

# While the draft idles nothing measures the text, and a share of 3-token matches that
# would make the fast backup worth speculating with (SD on the lent cores or SSD with
# lookup drafts) goes unseen: the idle names that share (IdleAdvice.wake_share, the
# lowest of LOOKUP_WAKE_SHARES at which the models put speculation LOOKUP_WAKE_MARGIN
# above plain decoding, the other positions matching nothing), and the proposer wakes
# the draft once the text shows it. Measured at batch 1 (T = 0): MT-Bench put the draft
# idle (SSD measured at 18.5 tok/s, plain decoding 21.7), and it idled through the
# whole HumanEval set (26.4 tok/s), where the other start ran SD on the lent cores with
# lookup drafts at 44.2 (plain vLLM 26.7-28.3).
LOOKUP_WAKE_SHARES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
LOOKUP_WAKE_MARGIN = 0.1

# The text of the batch's new or resynced sequences changed what the fast backup can do
# (its share of 3-token matches moved by this much, RegimeChoice._see_text): what both
# regimes gave lately (RealizedRate) was measured on other text, and is forgotten.
# Measured at batch 1 (T = 0): at the turn from MT-Bench to HumanEval, SSD's and SD on
# the lent cores' rates from MT-Bench (24-25 tok/s) held the draft idle (plain decoding
# 25.8) for the first 10 s of HumanEval, where SD on the lent cores then gave 45.
TEXT_CHANGE_SHARE = 0.25

# The same for the batch's share of sampled requests (RegimeChoice._see_sampling): a
# greedy and a sampled request accept drafts at rates of their own (core/fanout.py
# SplitAcceptanceFit), so what the regimes gave on one is no measure of the other.
# Measured at batch 4 (HumanEval, T = 1 after T = 0 on one engine): SD on the lent cores
# ran 76 of the ~250 rounds, 87 of its 336 tokens accepted (issue 19's twentieth round).
SAMPLING_CHANGE_SHARE = 0.25

# A close idle after a try of SD on the lent cores that did not pay (_wake, _close_idle):
# no wake on new text, a recheck after LENT_TRY_BACKOFF_S instead, doubled for each such
# try in a row (up to 4x); a try that pays ends the backoff. Measured at batch 1 (T = 1,
# HumanEval, 8 prompts): 6 tries on new text (min_rounds rounds each, about a whole
# 64-token request at batch 1), and the set ran 0.94x plain vLLM.
LENT_TRY_BACKOFF_S = 30.0


class IdleAdvice(NamedTuple):
    """The draft may idle while the batch is larger than `limit`; `probe`: only to
    measure plain decoding on the lent cores at this batch size, so ask again soon;
    `recheck_s`: ask again after this long (None: the proposer's default); `new_text`:
    ask again as soon as every request of the batch is one that joined since (what was
    measured is of text that is gone); `wake_share`: ask again once this share of the
    batch's latest positions continue a 3-token match (LOOKUP_WAKE_SHARES: the proposer
    watches the text while the draft idles; None: no share would make speculation pay);
    `lookup`: meanwhile the proposer sends prompt lookup drafts of its own where they pay
    (core/idle_lookup.py; None: it sends nothing)."""

    limit: int
    probe: bool
    recheck_s: float | None = None
    new_text: bool = False
    wake_share: float | None = None
    lookup: IdleLookupAdvice | None = None


class RegimeChoice:
    """DraftWorker's regime, chosen each step (see the module's docstring)."""

    def _draft_cost(self) -> StepCost:
        """The draft step's line for this step's team (_lent_sd_lines in a lent_sd step)."""
        return self._lent_sd_lines()[1] if self._lent_sd else self.draft_cost

    def _lent_sd_lines(self) -> tuple[StepCost, StepCost]:
        """SD on the lent cores' lines, (verification, draft step): their own once
        measured, else plain decoding's on the lent cores and the draft's on its own
        cores (the higher cost)."""
        verify = self.lent_sd_cost if self.lent_sd_cost.known else self.lent_cost
        draft = (self.borrowed_draft_cost if self.team.borrows and self.borrowed_draft_cost.known
                 else self.draft_cost)
        return verify, draft

    def _plain_s(self):
        """Plain decoding's step time with the draft's cores lent to the target, at the
        batch sizes it has run so (measured: the gain differs by width, and was found
        small at batch 1), the target's own elsewhere; None without lending."""
        if self.lent_cost is None or not self.lent_widths or not self.target_cost.known:
            return None
        lent, own, seen = self.lent_cost.predict, self.target_cost.predict, self.lent_widths
        return lambda w: min(lent(w), own(w)) if w in seen else own(w)

    def _beats_lent_plain(self, plan, batch: int) -> bool:
        """Speculating this step must beat plain decoding on every core (when the
        draft's cores can be lent to the target)."""
        if (not sum(plan.lengths) or self.cfg.controller.force_lengths is not None
                or self._lent_sd):  # lent_sd: the plan's own line is plain decoding's
            return True
        plain_s = self._plain_s()
        if self._ssd_as_measured(batch, plain_s):
            return True
        return beats_plain(plan, batch, plain_s)

    def _observe_round(self, updates: list[Update], now: float,
                       target_s: float | None = None) -> None:
        """The last round's realized rate (RealizedRate): the tokens this call commits over
        the time since the last call, when that call speculated at the same batch size
        and every sequence continues (no new or resynced one: a prefill round). Runs
        before this call's idle decision: self._limit is still the last call's. For a
        round of SD on the lent cores, also what it cost beyond the target's step
        (target_s, measured by the proposer) and the draft's forwards: lent_sd_overhead.
        Measured at batch 4: the round's wait on the draft was 19 ms where its forwards
        took 10 (this worker's planning and replies, the round trip); without it the
        model expected SD on the lent cores at 1.1x plain decoding where it gave 0.85x."""
        last = self._last_call
        if (last is None or self._limit is not None or last[1] != len(updates)
                or any(full is not None or not sampled for _, sampled, full, _ in updates)):
            return
        if not last[2] and self._ssd_steps < 2:
            return  # SSD's first round after a switch or a new request (_ssd_steps)
        realized = self.lent_sd_realized if last[2] else self.realized
        realized.observe(len(updates), sum(len(s) for _, s, _, _ in updates), now - last[0], now)
        if not last[2]:
            return
        plain_s, gave = self._plain_s(), self.lent_sd_realized.rate(last[1], now)
        if plain_s is not None and gave is not None:
            # paid: by the margin it is taken up with (lent_sd_worth; on a 2-core Xeon,
            # where it gave plain decoding's rate at batch 4 give or take noise, a mere
            # lead there made the close recheck try it again and again: 0.89-0.93x plain
            # vLLM); no longer, once it gave less than plain decoding
            plain = self._idle_bar(last[1], plain_s)
            if lent_sd_worth(gave, continuing=False) > plain:
                self.lent_sd_paid.add(last[1])
                self.lent_sd_ever_paid.add(last[1])
                self._lent_sd_tried.discard(last[1])  # a try that paid: no backoff
                self._lent_sd_unpaid_tries.pop(last[1], None)
            elif gave < plain:
                self.lent_sd_paid.discard(last[1])
        if self._lent_sd_steps >= 2 and target_s is not None:
            # not the first round after SSD's: measured, 40 ms more than the next ones
            # (the team's first turn on the borrowed cores, the verification's first
            # widths on the lent ones), which alone held SD on the lent cores off
            over = max(0.0, now - last[0] - target_s - self._last_draft_s)
            self.lent_sd_overhead = (over if self.lent_sd_overhead is None
                                     else 0.9 * self.lent_sd_overhead + 0.1 * over)

    def _see_text(self, updates: list[Update]) -> None:
        """The match lengths of the new or resynced sequences' latest text replace those
        that came up before (MatchAcceptance.seen_in), ahead of this step's idle decision,
        which weighs the fast backup by them: after an idle (the proposer resyncs every
        sequence) they are of text the draft did not see. Where they moved the share of
        3-token matches by TEXT_CHANGE_SHARE, what both regimes gave is forgotten."""
        if self.cfg.fallback == "neural":
            return
        lengths = [n for _, _, full, _ in updates if full is not None
                   for n in recent_matches(full)]
        if not lengths:
            return
        before = self.fast_acceptance.shares()[-1]
        self.fast_acceptance.seen_in(lengths)
        if abs(self.fast_acceptance.shares()[-1] - before) >= TEXT_CHANGE_SHARE:
            self.realized.forget_all()
            self.lent_sd_realized.forget_all()
            self._ssd_lost.clear()  # (SSD_EXPLORE_BACKOFF_MAX)
            self.stats.text_changes += 1

    def _see_sampling(self, updates: list[Update]) -> None:
        """Which of the batch's rows are greedy (_greedy_rows, for each row's rates) and
        the share of sampled ones, which mixes the batch's a_p and lookup rates
        (SplitAcceptanceFit, MatchAcceptance); where that share moved by
        SAMPLING_CHANGE_SHARE, what both regimes gave is forgotten."""
        self._greedy_rows = [
            (SamplingSpec(*sampling) if sampling else SamplingSpec()).greedy
            if full is not None or rid not in self.seqs else self.seqs[rid].sampling.greedy
            for rid, _, full, sampling in updates]
        if not updates:
            return
        share = self._greedy_rows.count(False) / len(updates)
        before = self.acceptance.sampled_share
        self.acceptance.sampled_share = self.fast_acceptance.sampled_share = share
        if abs(share - before) >= SAMPLING_CHANGE_SHARE:
            self.realized.forget_all()
            self.lent_sd_realized.forget_all()
            self._ssd_lost.clear()
            self.stats.sampling_changes += 1

    def _catch_up_tokens(self, updates: list[Update]) -> int:
        """Tokens the draft must prefill before it can speculate on this batch: those of
        new or resynced sequences beyond the KV it still holds for them."""
        n = 0
        for rid, _, full, _ in updates:
            if full is not None:
                st = self.seqs.get(rid)
                n += len(full) - (lcp(st.kv_tokens, full) if st is not None else 0)
        return n

    def _idle_limit(self, batch: int, catch_up_tokens: int = 0) -> IdleAdvice | None:
        """If speculation's expected rate (core/theory.py with the fitted a_p, the hit
        rate, the measured costs; the best K up to the cap) does not beat plain decoding
        at this batch size, the largest batch size at which it would: this step sends
        nothing, and the proposer leaves the draft idle (and lends its cores) while the
        batch is larger. None: speculate as the plan says.

        Plain decoding on the lent cores is only known where it ran, so the first time a
        batch size is found worth speculating on, the draft idles there for a few rounds
        anyway (a probe) and the next call decides with that measurement. Where the
        draft must first prefill the batch (catch_up_tokens) while the target loses the
        lent cores, speculation's expected gain must pay that back (catch_up_pays).
        Every idle but a probe names its lookup wake share: measured at batch 4 (T = 0),
        a catch-up idle at the end of the MT-Bench set named none, and the draft idled
        through the HumanEval set after it (30 s, the proposer's default recheck)."""
        ctl = self.cfg.controller
        if ctl.force_idle_lookup:  # (testing switch) idle at every batch size, every row sends
            return IdleAdvice(0, probe=False, lookup=IdleLookupAdvice(
                (1.0,) * self.fast_acceptance.lengths, (1.0,) * self.fast_acceptance.lengths,
                (1.0, 0.0), forced=True))
        if self._cap == 0 and ctl.idle and ctl.force_lengths is None and batch:
            # vLLM's schedule lets nothing be sent at this batch size, whatever the policy:
            # plain decoding on every core until the batch shrinks to where it lets some
            return IdleAdvice(schedule_limit(self.cfg.num_speculative_tokens_per_batch_size,
                                             batch, self.K), probe=False)
        if (ctl.policy != "auto" or not ctl.idle or ctl.force_lengths is not None
                or not self.target_cost.known or not batch or self._explore > 0):
            return None  # (_explore: trying SD on the lent cores after a close idle)
        plain = self._plain_s() or self.target_cost.predict
        now = time.perf_counter()

        def rate(b: int) -> float:  # the better way to speculate at b
            ssd, lent_sd = self._weighed_rates(b, now)
            return max(ssd, 0.0 if lent_sd is None else lent_sd)

        limit = batch_limit(rate, plain, max_batch=batch, idle_rate=self._idle_rate())
        if limit < batch:
            return self._watching(self._close_idle(limit, batch, plain), batch, plain)
        if self.lent_cost is not None and self._probe_due(batch, now):
            if batch in self.lent_widths:  # measured before: the probe's rounds decide
                self.lent_cost.discount(LENT_REPROBE_KEEP)
            self._probed[batch] = now
            self.stats.lent_probes += 1
            return IdleAdvice(batch - 1, probe=True)
        if catch_up_tokens and self.lent_cost is not None and self.lent_cost.known:
            # on the lent cores' line also at a batch size it was not measured at: the
            # batch grows and shrinks through sizes plain decoding ran at only briefly
            own = self.target_cost.predict(batch)
            lent = min(self.lent_cost.predict(batch), own)
            gain = rate(batch) - batch / max(lent, 1e-9)
            lost = batch / max(lent, 1e-9) - batch / max(own, 1e-9)
            if not catch_up_pays(gain, catch_up_tokens * self.prefill_s_per_token, lost):
                self.stats.catch_up_idles += 1  # (the text may yet show lookups that pay)
                return self._watching(IdleAdvice(batch - 1, probe=False), batch, plain)
        return None

    def _watching(self, advice: IdleAdvice, batch: int, plain_s) -> IdleAdvice:
        """An idle (not a probe: that measures plain decoding) with what the proposer
        does meanwhile: its own lookup drafts (_idle_lookup_advice) and the share of
        3-token matches that wakes the draft (_lookup_wake_share)."""
        lookup = self._idle_lookup_advice()
        return advice._replace(lookup=lookup,
                               wake_share=self._lookup_wake_share(batch, plain_s, lookup))

    def _idle_bar(self, batch: int, plain_s) -> float:
        """What idling gives at this batch size: plain decoding's rate (plain_s: its step
        time), or more with the proposer's own lookup drafts (_idle_rate). What SD on the
        lent cores gave is weighed against it (paid, a close idle) as the idle decision
        weighs its model."""
        plain = batch / max(plain_s(batch), 1e-9)
        idle = self._idle_rate()
        return plain if idle is None else max(plain, idle(batch))

    def _idle_rate(self):
        """What an idle is expected to give at batch size b with the proposer's own lookup
        drafts (_idle_lookup_advice): idle_lookup_rate at the text's share of 3-token
        matches (MatchAcceptance.shares, the batch's latest positions), a verification
        costing a plain step of its width on the lent cores' line, counted only where it
        clears the lookup's entry margin (what the proposer sends by). Speculation with
        the draft must beat it, not plain decoding alone. Measured at batch 1 on
        HumanEval, paired within one engine start (issue 19's twenty-second round): an
        idle with lookup drafts ran 1.74x (T = 0) and 1.20x (T = 1) plain decoding,
        where SD on the lent cores, taken for beating plain decoding, ran 1.56x and
        1.05x. None: no lookup drafts while idle."""
        lookup = self._idle_lookup_advice()
        if lookup is None:
            return None
        line, m = StepCost(*lookup.plain).predict, self.fast_acceptance
        share, rate = m.shares()[-1], m.rate(m.lengths - 1)

        def idle(b: int) -> float:
            plain = b / max(line(b), 1e-9)
            gives = idle_lookup_rate(b, share, rate, self.K, line, line)
            return gives if gives > (1.0 + LOOKUP_ENTRY_MARGIN) * plain else plain
        return idle

    def _idle_lookup_advice(self) -> IdleLookupAdvice | None:
        """The proposer's prompt lookup while the draft idles (core/idle_lookup.py): the
        fast backup's rates by match length and plain decoding's line on the cores the
        target then has (the lent cores', else its own). None where lookup drafts are no
        option (config controller.idle_lookup, fallback 'neural') or no line is known
        yet."""
        if not self.cfg.controller.idle_lookup or self.cfg.fallback == "neural":
            return None
        lending = self.lent_cost is not None and self.lent_cost.known
        plain = self.lent_cost if lending else self.target_cost
        if not plain.known:
            return None
        m = self.fast_acceptance
        return IdleLookupAdvice(m.rates(greedy=True), m.rates(greedy=False), plain.line())

    def _probe_due(self, batch: int, now: float) -> bool:
        """Plain decoding on the lent cores is to be measured at this batch size: never
        measured nor probed, or measured but not probed for LENT_REPROBE_S."""
        if batch not in self._probed:
            return batch not in self.lent_widths or now - self._started > LENT_REPROBE_S
        return now - self._probed[batch] > LENT_REPROBE_S

    def _close_idle(self, limit: int, batch: int, plain_s) -> IdleAdvice:
        """The idle, and when to ask again where it is a close one: SD on the lent cores'
        model puts it within CLOSE_SHARE of plain decoding (what it gave, or the entry
        margin, held it off), or SSD is to be tried (_ssd_try_due: after CLOSE_RECHECK_S).
        Text moves on, and while idle nothing measures it.

        After CLOSE_RECHECK_S where it has paid before (lent_sd_paid). Measured at batch
        1 (HumanEval after MT-Bench on one engine): a prompt whose drafts were rejected
        for a few dozen rounds put what it gave 9% below plain decoding, and the draft
        idled for the next 30 s, the rest of the set, where it had run 1.15x on
        MT-Bench. Not where it never paid: at batch 4 the model puts it at 0.98x plain
        decoding, and each try would first prefill 10 s of the batch's tokens on the
        draft's core.

        On new text where it ever paid (lent_sd_ever_paid): what held it off measured
        requests that are gone. Measured at batch 1: after that HumanEval prompt had
        put it below plain decoding (no longer paid), the draft idled through the rest
        of the set while the model still put it at 28.6 tok/s against 26.5.

        Neither after a try that did not pay (_wake): a recheck after LENT_TRY_BACKOFF_S,
        doubled for each such try in a row."""
        plain = self._idle_bar(batch, plain_s)
        model = self._ssd_try_due(batch, plain)
        self._ssd_try = None if model is None else (batch, model)
        if self._ssd_try is not None:
            return IdleAdvice(limit, probe=False, recheck_s=CLOSE_RECHECK_S)
        expected = self._lent_sd_rate(batch, time.perf_counter(), measured=False)
        if expected is None or expected < (1.0 - CLOSE_SHARE) * plain:
            return IdleAdvice(limit, probe=False)
        if batch in self._lent_sd_tried:  # a try since the last close idle, unpaid
            self._lent_sd_tried.discard(batch)
            self._lent_sd_unpaid_tries[batch] = self._lent_sd_unpaid_tries.get(batch, 0) + 1
        unpaid = self._lent_sd_unpaid_tries.get(batch, 0)
        if unpaid:  # (LENT_TRY_BACKOFF_S)
            return IdleAdvice(limit, probe=False,
                              recheck_s=LENT_TRY_BACKOFF_S * 2 ** min(unpaid - 1, 2))
        return IdleAdvice(limit, probe=False,
                          recheck_s=CLOSE_RECHECK_S if batch in self.lent_sd_paid else None,
                          new_text=batch in self.lent_sd_ever_paid)

    def _lookup_wake_share(self, batch: int, plain_s,
                           lookup: IdleLookupAdvice | None = None) -> float | None:
        """The lowest share of positions continuing a 3-token match (LOOKUP_WAKE_SHARES,
        the rest matching nothing) at which the models (unclamped: what was measured was
        of other text) put SSD or SD on the lent cores LOOKUP_WAKE_MARGIN above what the
        idle gives: plain decoding (plain_s: its step time), or with `lookup` the
        proposer's own lookup drafts at that share (core/idle_lookup.py
        idle_lookup_rate); None where no share does, or where the fast backup is no
        option."""
        if self.cfg.fallback == "neural" or not self.cfg.async_:
            return None
        plain = batch / max(plain_s(batch), 1e-9)
        now = time.perf_counter()
        lengths = self.fast_acceptance.lengths
        if lookup is not None:
            lines = (StepCost(*lookup.plain).predict,) * 2  # (IdleLookup: a verification's)
        for share in LOOKUP_WAKE_SHARES:
            shares = [1.0 - share] + [0.0] * (lengths - 2) + [share]
            lent_sd = self._lent_sd_rate(batch, now, measured=False, shares=shares)
            best = max(self._expected_rate(batch, shares), lent_sd or 0.0)
            idle = plain if lookup is None else idle_lookup_rate(
                batch, share, self.fast_acceptance.rate(lengths - 1), self.K, *lines)
            if best > (1.0 + LOOKUP_WAKE_MARGIN) * idle:
                return share
        return None

    def _ssd_try_due(self, batch: int, plain: float) -> float | None:
        """Whether an idle at this batch size is to try SSD on its recheck (SSD_TRY_SHARE):
        SSD an option, neither measured (RealizedRate: kept SSD_EXPLORE_S) nor explored
        there for SSD_EXPLORE_S, its model within the share of what the idle gives
        (plain), and risen by SSD_RETRY_RISE since a try there that SSD lost. The model
        against the idle's rate where it is, else None."""
        now = time.perf_counter()
        if (not self.cfg.async_ or self.cfg.controller.regime == "lent_sd"
                or not self._ssd_unmeasured(batch, now)):
            return None
        model = self._expected_rate(batch) / max(plain, 1e-9)
        if model < 1.0 - SSD_TRY_SHARE:
            return None
        lost = self._ssd_try_lost.get(batch)
        if lost is not None and now - lost[1] < SSD_RETRY_S:
            if model < lost[0] * (1.0 + SSD_RETRY_RISE):
                self.stats.ssd_retries_held += 1
                return None
        return model

    def _wake(self, batch: int) -> None:
        """The first step after a close idle (IdleAdvice.recheck_s or new_text): try SD
        on the lent cores for as many steps as its measurement needs (rounds_needed), by
        the model alone (its stale measurement forgotten, no entry margin), so that the
        next decision sees the text running now; or, where the idle said so
        (SSD_TRY_SHARE), explore SSD (SSD_EXPLORE_ROUNDS)."""
        try_ssd, self._ssd_try = self._ssd_try, None
        if self._limit is not None and try_ssd is not None and try_ssd[0] == batch:
            # this step's _ssd_exploration_goes_on counts it as the first
            self._start_ssd_exploration(batch, SSD_EXPLORE_ROUNDS, tried=try_ssd[1])
        elif (self._limit is not None and try_ssd is None
              and (self._limit.recheck_s is not None or self._limit.new_text)):
            self.lent_sd_realized.forget(batch)
            self._explore = self.lent_sd_realized.rounds_needed(batch)
            self._explore_batch = batch
            self._lent_sd_tried.add(batch)  # (_close_idle's backoff)
            self.stats.lent_sd_explores += 1
        elif self._explore > 0:  # another batch size: its own decision
            self._explore = self._explore - 1 if batch == self._explore_batch else 0

    def _ssd_exploration_goes_on(self, batch: int) -> bool:
        """Whether this step goes on with an exploration of SSD (SSD_EXPLORE_ROUNDS):
        neither idle nor SD on the lent cores, whatever the models say. Ends early where
        the batch size changes, or once what SSD gave there is surely below what the
        idle gives (_ssd_measured_below): measured (issue 19, twenty-second round), an
        exploration at batch 4 on MT-Bench (T = 0) ran 34 rounds in one batch of
        prompts, which ran 0.74x plain decoding."""
        if self._ssd_explore > 0 and batch == self._ssd_explore_batch:
            if self._ssd_measured_below(batch):
                self.stats.ssd_explores_cut += 1
            else:
                self._ssd_explore -= 1
                return True
        self._ssd_explore = 0
        return False

    def _ssd_measured_below(self, batch: int) -> bool:
        """SSD measured (RealizedRate.bounds: once it has rounds_needed rounds) surely
        below what the idle gives at this batch size (_idle_bar), with lent cores, or
        surely below what SD on the lent cores gave there (its bounds' lower end): the
        choice after the exploration goes by what the two gave (_weighed_rates), and
        SSD could not win it: the rest of the exploration would run below what SD on
        the lent cores gives. Where SD on the lent cores gives more than the idle, the
        idle's bar alone let such an exploration run its SSD_EXPLORE_ROUNDS (not
        measured apart: issue 19, twenty-fourth round)."""
        plain_s = self._plain_s()
        now = time.perf_counter()
        b = None if plain_s is None else self.realized.bounds(batch, now)
        if b is None:
            return False
        lent = self.lent_sd_realized.bounds(batch, now)
        bar = self._idle_bar(batch, plain_s)
        return b[1] < (bar if lent is None else max(bar, lent[0]))

    def _ssd_explore_due(self, batch: int) -> bool:
        """Whether this step, chosen SD on the lent cores, starts an exploration of SSD
        instead (SSD_EXPLORE_ROUNDS steps): regime auto, SD on the lent cores measured at
        this batch size (what it gave: the two are then compared on what they gave), SSD
        not (RealizedRate), nor explored there for SSD_EXPLORE_S. Measured before the
        first condition: an exploration in an engine's first rounds (a cold start, a
        first MT-Bench prompt) put the acceptance at 0.38 and SSD at 25.9 tok/s, and the
        draft idled for the rest of the run at plain decoding's 28.5."""
        if self.cfg.controller.regime != "auto" or not self.cfg.async_ or self._explore > 0:
            return False  # (_explore: trying SD on the lent cores after a close idle)
        now = time.perf_counter()
        if (self.lent_sd_realized.rate(batch, now) is None  # what it gives: measured first
                or not self._ssd_unmeasured(batch, now)):
            return False
        self._start_ssd_exploration(batch, SSD_EXPLORE_ROUNDS - 1)  # this step is one
        return True

    def _ssd_unmeasured(self, batch: int, now: float) -> bool:
        """SSD neither measured at this batch size (RealizedRate: what it gave is kept
        SSD_EXPLORE_S) nor explored there for SSD_EXPLORE_S, doubled for each
        exploration in a row after which SSD was not chosen (SSD_EXPLORE_BACKOFF_MAX):
        an exploration may start (_ssd_explore_due, _ssd_try_due)."""
        wait = SSD_EXPLORE_S * 2 ** min(self._ssd_lost.get(batch, 0), SSD_EXPLORE_BACKOFF_MAX)
        return (self.realized.rate(batch, now) is None
                and now - self._ssd_explored.get(batch, -wait) >= wait)

    def _after_ssd_exploration(self, batch: int) -> None:
        """The step after an exploration of SSD chose its regime: SSD not chosen (SD on
        the lent cores, or the idle) counts against the next exploration there
        (SSD_EXPLORE_BACKOFF_MAX), and where it was a try from an idle at this batch
        size, the model it was tried at holds the next try (SSD_RETRY_RISE); SSD chosen
        ends both."""
        tried, self._ssd_explore_tried = self._ssd_explore_tried, None
        if self._lent_sd or self._limit is not None:
            self._ssd_lost[batch] = self._ssd_lost.get(batch, 0) + 1
            if tried is not None and batch == self._ssd_explore_batch:
                self._ssd_try_lost[batch] = (tried, time.perf_counter())
        else:
            self._ssd_lost.pop(batch, None)
            self._ssd_try_lost.pop(batch, None)

    def _start_ssd_exploration(self, batch: int, left: int, tried: float | None = None
                               ) -> None:
        """An exploration of SSD at this batch size (SSD_EXPLORE_ROUNDS): `left`, the
        steps _ssd_exploration_goes_on counts down from its next call (in _wake, this
        very step's); `tried`, where an idle tries it, its model against the idle's
        rate (_ssd_try_due)."""
        self._ssd_explored[batch] = time.perf_counter()
        self._ssd_explore, self._ssd_explore_batch = left, batch
        self._ssd_explore_tried = tried
        self.stats.ssd_explores += 1

    def _any_new(self, updates: list[Update]) -> bool:
        """A new or resynced sequence in the batch (its prompt for the draft to prefill)."""
        return any(full is not None or rid not in self.seqs for rid, _, full, _ in updates)

    def _ssd_measured_ahead(self, batch: int, plain_s) -> bool:
        """SSD measured (RealizedRate.bounds) surely above plain decoding (plain_s: its
        step time, None without lent cores) at this batch size: the plan's model, which
        held it behind, is overruled."""
        b = None if plain_s is None else self.realized.bounds(batch, time.perf_counter())
        return b is not None and b[0] > batch / max(plain_s(batch), 1e-9)

    def _ssd_as_measured(self, batch: int, plain_s) -> bool:
        """SSD runs as it is, whatever its model says of this step's plan and
        pre-speculation: it was measured surely ahead of plain decoding
        (_ssd_measured_ahead: the model that put it behind is overruled), or this step
        is an exploration of it, which measures it (SSD_EXPLORE_ROUNDS)."""
        return self._exploring_ssd or self._ssd_measured_ahead(batch, plain_s)

    def _ssd_rate(self, batch: int, now: float) -> float:
        """SSD's rate at this batch size: the model's, clamped to what it was measured
        to give (RealizedRate.clamp; 0 when the regime is pinned to lent_sd)."""
        if self.cfg.controller.regime == "lent_sd" and self.lent_cost is not None:
            return 0.0
        return self.realized.clamp(self._expected_rate(batch), batch, now)

    def _lent_sd_rate(self, batch: int, now: float, measured: bool = True,
                      shares: list[float] | None = None) -> float | None:
        """SD on the lent cores' rate at this batch size (core/theory.py sd_rate with its
        lines, _lent_sd_lines, and the round's overhead, the best K up to the cap, the
        fast backup's drafts where they are worth more: _fast_backup_options),
        clamped to what it was measured to give (RealizedRate.clamp; `measured`, else
        the model's alone). None where it is no option (no lent cores, regime ssd) or not
        known yet (the lent cores or the draft's step not measured)."""
        if (self.lent_cost is None or self.cfg.controller.regime == "ssd"
                or not self.lent_cost.known or not self.draft_cost.known):
            return None
        verify, draft = self._lent_sd_lines()
        a, over = self.acceptance.rate, self.lent_sd_overhead or 0.0
        # SD with the fast backup for the sequences whose match makes it worth more: SSD's
        # round with no hit (ssd_rate with p_hit 0 and no fast backup is sd_rate)
        expected = self._best_ssd_rate(a, 0.0, batch, verify.predict, draft.predict,
                                       shares, over)
        return self.lent_sd_realized.clamp(expected, batch, now) if measured else expected

    def _lent_sd_continues(self) -> bool:
        """SD on the lent cores would go on, not be taken up (lent_sd_worth's margin): the
        last step was one, or tries it after a close idle (_explore), or ended an
        exploration of SSD that began from it (a detour that measured the other), or
        was SSD's only for a new sequence's glue pass where SD on the lent cores ran
        (_glue_detour: the switch back is the new prompt's, which no choice spares).
        Traced at batch 1 (MT-Bench, T = 0, issue 19's twenty-fifth round): each new
        request's glue round put the next step's choice under the entry margin, and
        what SD on the lent cores had given (21.2 tok/s) then fell below plain
        decoding's 20.8 with it: the draft idled through that prompt."""
        return (self._lent_sd_steps > 0 or self._explore > 0 or self._ssd_explore_ended
                or self._glue_detour)

    def _lent_sd_step(self, updates: list[Update]) -> bool:
        """Whether this step is SD on the lent cores (controller.regime; auto: where it is
        expected faster than SSD, lent_sd_pays). Never with a new or resynced sequence in
        the batch: its prompt goes through the draft in the glue pass of a pre-speculation
        (_catch_up_glue), off the critical path, where SD would draft it on it."""
        regime = self.cfg.controller.regime
        if self.lent_cost is None or regime == "ssd" or not updates:
            return False
        if self._any_new(updates):
            return False
        if regime == "lent_sd":
            return True
        if not self.target_cost.known:  # SSD's rounds measure it first
            return False
        ssd, lent_sd = self._weighed_rates(len(updates), time.perf_counter())
        return lent_sd_pays(ssd, lent_sd, continuing=self._lent_sd_continues())

    def _weighed_rates(self, batch: int, now: float) -> tuple[float, float | None]:
        """SSD's and SD on the lent cores' rates at this batch size as the regime's choice
        weighs them, against each other and against plain decoding alike: where both
        were measured lately (an exploration of SSD), what they gave; else their models
        clamped to what they gave (_ssd_rate, _lent_sd_rate). SD on the lent cores' with
        its entry margin (lent_sd_worth). Measured before, at batch 1 (T = 1), where only
        the choice between the two used what they gave: SSD's model (28.1 tok/s) held
        speculation above plain decoding (27.6), and SD on the lent cores then ran, at
        26.4, since SSD had given 23.8."""
        continuing, lent_sd = self._lent_sd_continues(), self._lent_sd_rate(batch, now)
        if self.cfg.controller.regime == "auto" and lent_sd is not None:
            gave = self.realized.rate(batch, now), self.lent_sd_realized.rate(batch, now)
            if None not in gave:
                return gave[0], lent_sd_worth(gave[1], continuing)
        return self._ssd_rate(batch, now), lent_sd_worth(lent_sd, continuing)

    def _expected_rate(self, batch: int, shares: list[float] | None = None) -> float:
        """Tokens per second speculation is expected to give at this batch size (shares:
        _fast_backup_options')."""
        a, t, d = self.acceptance.rate, self.target_cost.predict, self.draft_cost.predict
        if not self.cfg.async_:
            return max((sd_rate(a, k, batch, t, d) for k in range(1, self._cap + 1)),
                       default=0.0)
        return self._best_ssd_rate(a, self.hit_rate, batch, t, d, shares)

    def _best_ssd_rate(self, a: float, p_hit: float, batch: int, target_s, draft_s,
                       shares: list[float] | None = None, overhead_s: float = 0.0) -> float:
        """core/theory.py ssd_rate at the best K up to the cap and the best of the fast
        backup's options (_fast_backup_options, by `shares`): SSD's model (_expected_rate)
        and, with no hit, SD on the lent cores' (_lent_sd_rate)."""
        fast = self._fast_backup_options(shares)
        return max((ssd_rate(a, k, p_hit, batch, target_s, draft_s, fast=f, rest_neural=r,
                             overhead_s=overhead_s)
                    for k in range(1, self._cap + 1) for f, r in fast), default=0.0)

    def _fast_backup_options(self, shares: list[float] | None = None
                             ) -> list[tuple[list[tuple[float, float]], bool]]:
        """What the fast backup may do for the misses, as ssd_rate's (`fast`,
        `rest_neural`), by config `fallback`: with `auto` the match lengths its
        acceptance ranks highest first (the controller gives a miss the fast backup
        where its match makes it worth more: core/fallback.py), one option per how many,
        the other misses the neural fallback's or sending nothing; with `fast` the
        same, the others sending nothing; with `neural` none ([], every miss the neural
        fallback's). shares: of each match length (default: as they came up,
        MatchAcceptance). Sending nothing is what the controller does with a miss
        that no draft makes worth verifying (choose_lengths); at batch 4 and up, where
        one neural stall holds the whole batch and every token sent widens the
        verification, it is often the only way lookup drafts pay, and without it the
        models (and the idle's lookup wake share) left that way out."""
        m = self.fast_acceptance
        by_rate = sorted(zip(shares or m.shares(), m.rates()), key=lambda x: -x[1])
        if self.cfg.fallback == "neural":
            return [([], True)]
        served = [by_rate[:j] for j in range(1, len(by_rate) + 1)]
        if self.cfg.fallback == "fast":
            return [(f, False) for f in served]
        return [([], True)] + [(f, r) for f in served for r in (True, False)]

    def _prespeculation_pays(self, batch: int) -> bool:
        """Pre-speculate only what the next step could use: with the fitted a_p, would any
        of the batch's cached tokens be sent? (On CPU an unused pre-speculation still takes
        the memory bus from the target.)"""
        ctl = self.cfg.controller
        if ctl.policy != "auto" or ctl.force_lengths is not None or not self.target_cost.known:
            return True
        plain_s = self._plain_s()
        if self._ssd_as_measured(batch, plain_s):
            return True
        hit = Candidate(free=(self.acceptance.rate,) * self._cap, cap=self._cap)
        return speculation_pays([hit] * batch, self.target_cost.predict, plain_s)
