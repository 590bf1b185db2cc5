"""Each sequence's speculation length this step, 0..K, and who drafts a miss: the
controller's candidates (a hit's tokens and the fast backup's are free, the neural
fallback costs its steps), its plan before drafting, and the lengths once more with the
drafted tokens' calibrated confidences in hand (core/controller.py choose_lengths).

A mixin of DraftWorker (draft/worker.py), whose __init__ holds the state it uses.
"""
from __future__ import annotations

import time
from typing import Callable

from vllm_saguaro.core.cache import Speculation
from vllm_saguaro.core.controller import (Candidate, StepCost, choose_lengths, draft_more_pays,
                                          plain_then_verify)
from vllm_saguaro.core.fallback import FastDraft, ngram_match
from vllm_saguaro.draft.state import SeqState


class LengthPlanning:
    """DraftWorker's speculation lengths and fallback, each step (see the module's docstring)."""

    def _source_alphas(self, spec: Speculation, source: str, cand: Candidate,
                       greedy: bool) -> tuple[float, ...]:
        """_alphas by who drafted it: the fast backup's tokens at the rate its candidate
        had (that of its match length)."""
        if source == "fast":
            return cand.free[:len(spec.tokens)]
        return () if source == "plain" else self._alphas(spec, greedy)

    def _alphas(self, spec: Speculation, greedy: bool) -> tuple[float, ...]:
        """P(accept) of each token of a drafted speculation: its calibrated confidence where
        one was recorded (not after the first token of a sampled one: see
        core/controller.py on losslessness), a_p elsewhere (a greedy or a sampled
        request's)."""
        a_p = self.acceptance.rate_of(greedy)
        conf = spec.confidence or [None] * len(spec.tokens)
        return tuple(a_p if c is None else self.calibration.rate(c) for c in conf)

    def _candidate(self, i: int, rid: str, hit: Speculation | None, looked_up: bool,
                   fresh: bool) -> Candidate:
        """Sequence i's options: a hit's tokens (free); for a miss, and for every
        sequence of a round of SD on the lent cores (nothing pre-speculated: each is a
        miss), the fast backup (free, if allowed; its acceptance that of its draft's match
        length) and the neural fallback. A new or resynced sequence sends nothing in its
        first round under the auto policy: drafting it now would put the draft's prefill
        of its whole context on the critical path, while the pre-speculation of its k = 0
        outcomes does that prefill off it (and usually makes its next round a hit). With K
        pinned it gets the neural backup, as do seeded sampled requests: a seeded request
        reproduces only if its drafts and lengths do not depend on timing (it sends K
        tokens every round)."""
        st, ctl = self.seqs[rid], self.cfg.controller
        fixed = ctl.policy == "fixed" or st.sampling.seeded
        cap = self._cap
        if ctl.force_lengths is not None:
            cap, fixed = min(cap, ctl.force_lengths[(i + self._round) % len(ctl.force_lengths)]), True
        if hit is not None:
            return Candidate(free=self._alphas(hit, st.sampling.greedy), cap=cap, fixed=fixed)
        if fresh and not fixed and self.cfg.async_:
            return Candidate(cap=0)
        fast_ok = (looked_up or self._lent_sd) and self._fast_allowed(st)
        greedy = st.sampling.greedy
        free = ((self.fast_acceptance.rate(self._fast_draft(st).n, greedy),) * self.K
                if fast_ok else ())
        neural = ((self.acceptance.rate_of(greedy),) * self.K
                  if not (fast_ok and self.cfg.fallback == "fast") else ())
        return Candidate(free=free, neural=neural, cap=cap, fixed=fixed)

    def _fast_draft(self, st: SeqState) -> FastDraft:
        """The fast backup's draft for the sequence's tokens now (made once for them: a
        miss's candidate, its fallback and its shadow share it), its match length counted
        (MatchAcceptance.note)."""
        if st.fast is None or st.fast.at != len(st.tokens):
            st.fast = ngram_match(st.tokens, self.K)
            self.fast_acceptance.note(st.fast.n)
        return st.fast

    def _fast_allowed(self, st: SeqState) -> bool:
        """Whether a miss of this sequence may get the fast backup (config `fallback`; not
        a seeded request, whose drafts must not depend on timing)."""
        return self.cfg.async_ and not st.sampling.seeded and self.cfg.fallback != "neural"

    def _verify_cost(self) -> StepCost:
        """The line of the target's step this step verifies on: every core's in the
        lent_sd regime, its own cores' otherwise."""
        return self._lent_sd_lines()[0] if self._lent_sd else self.target_cost

    def _verify_s(self, batch: int) -> Callable[[int], float]:
        """The target's step time by tokens verified, as this step's plan weighs it: its
        line (_verify_cost), except that in a lent_sd step a width of `batch` (nothing
        sent) is plain decoding's on the lent cores (lent_cost), the step vLLM then
        takes; the regime's choice weighed SD on the lent cores against plain decoding
        too (_plain_s, this line where it was measured). Measured at batch 1 (MT-Bench,
        T = 1): the lent_sd line, fitted on widths 2-4, put width 1 at 34 ms where plain
        steps took 40, so the plan sent nothing in 97% of the lent_sd rounds, each a plain
        step plus the draft's round trip (23.5 tok/s, plain decoding 24.3)."""
        line = self._verify_cost().predict
        if not self._lent_sd or not self.lent_cost.known:
            return line
        return plain_then_verify(self.lent_cost.predict, line, batch)

    def _plan(self, cands: list[Candidate]):
        """The controller's plan; until the target's step time is known (the first rounds)
        every sequence sends what it can, as plain SD does."""
        if not self._verify_cost().known:
            cands = [Candidate(c.free, c.neural, c.cap, True) for c in cands]
        return choose_lengths(cands, self._verify_s(len(cands)), self._draft_cost().predict)

    def _final_lengths(self, cands: list[Candidate], specs: dict[int, Speculation],
                       sources: dict[int, str], sunk: float) -> list[int]:
        """With the tokens in hand (the fallback's cost now spent), the lengths once more:
        a drafted token the draft turned out unsure of is not worth verifying."""
        final = []
        for i, c in enumerate(cands):
            fixed = c.fixed or not self._verify_cost().known
            final.append(Candidate(free=self._source_alphas(specs[i], sources[i], c,
                                                            self._greedy_rows[i]),
                                   cap=c.cap, fixed=fixed))
        return choose_lengths(final, self._verify_s(len(cands)), lambda rows: 0.0,
                              sunk_s=sunk).lengths

    def _draft_more(self, cands: list[Candidate], neural: list[int],
                    specs: dict[int, Speculation], sources: dict[int, str], t0: float):
        """The fallback's `more` (_draft_now): one more step where it raises the batch's
        expected rate (core/controller.py draft_more_pays), each drafting row's next
        token guessed as likely to be accepted as its last (calibrated confidence; a
        sampled row's is not its draw's: a_p after the first, as losslessness needs).
        None under a pinned K or for seeded rows (their lengths must not vary)."""
        ctl = self.cfg.controller
        if (ctl.policy != "auto" or ctl.force_lengths is not None
                or any(cands[i].fixed for i in neural)):
            return None
        rows = set(neural)
        others = [Candidate(free=self._source_alphas(specs[i], sources[i], c,
                                                     self._greedy_rows[i]),
                            cap=c.cap, fixed=c.fixed) for i, c in enumerate(cands) if i not in rows]
        verify, step_s = self._verify_s(len(cands)), self._draft_cost().predict(len(neural))
        over = (self.lent_sd_overhead or 0.0) if self._lent_sd else 0.0

        def more(drafts: list[Speculation]) -> bool:
            now, nxt = list(others), list(others)
            for i, d in zip(neural, drafts):
                a = self._alphas(d, self._greedy_rows[i])
                now.append(Candidate(free=a, cap=min(len(a), cands[i].cap)))
                longer = a + a[-1:] if len(a) < cands[i].cap else a
                nxt.append(Candidate(free=longer, cap=min(len(longer), cands[i].cap)))
            spent = time.perf_counter() - t0 + over
            return nxt != now and draft_more_pays(now, nxt, verify, step_s, spent)
        return more
