"""Pre-speculation, the paper's three steps while the target verifies: the glue pass
(the speculation in flight into the draft's KV), the fork (which outcomes (k, bonus) to
branch on: geometric / uniform fan-out, or the batch's most probable outcomes) and the
tree decode (K steps over every branch of every sequence, one forward a step), into
each sequence's speculation cache.

A mixin of DraftWorker (draft/worker.py), whose __init__ holds the state it uses.
"""
from __future__ import annotations

import time

import torch

from vllm_saguaro.core.cache import Speculation, SpeculationCache
from vllm_saguaro.core.outcome import Outcome
from vllm_saguaro.core.selection import accepted_length_probs, select_outcomes
from vllm_saguaro.draft.drafting import Draws
from vllm_saguaro.draft.fork import fanout_roots, outcome_estimates
from vllm_saguaro.draft.speculation_table import TableView


class Prespeculation:
    """DraftWorker's pre-speculation: glue, fork, tree decode (see the module's docstring)."""

    def prespeculate(self) -> None:
        """Glue, fork and tree-decode for every sequence with a speculation in flight."""
        with self._lock:
            self.team.use(False)  # the target verifies meanwhile, on its own cores
            self._abort.clear()
            self._prespeculate()

    def _prespeculate(self) -> None:
        rids = [r for r, st in self.seqs.items() if st.spec is not None and st.cache is None]
        if not rids:
            return
        if not self._prespeculation_pays(len(rids)):
            self.stats.prespec_skipped += 1
            self._catch_up_glue(rids)
            return
        self.stats.prespec_runs += 1
        self._prespec_pending = True
        if self.table is not None:  # the branches still waiting for their outcome stay
            self.table.retain([r for r, st in self.seqs.items()
                               if isinstance(st.cache, TableView)])
        t0 = time.perf_counter()
        hidden = self._glue(rids)
        roots = self._fork(rids, hidden)
        t1 = time.perf_counter()
        self.stats.glue_s += t1 - t0
        drafted = self._tree_decode(rids, roots)
        self.stats.tree_s += time.perf_counter() - t1
        self.stats.prespec_s += time.perf_counter() - t0
        if drafted is None:
            self.stats.aborted += 1
            for rid in rids:
                self.seqs[rid].aborted = True
            return
        self.stats.prespec_done += 1
        for rid, branches, specs in zip(rids, roots, drafted):
            outcomes = [Outcome(j, x) for j, x in branches]
            if self.table is not None:
                self.table.put(rid, outcomes, specs)
                cache = TableView(self.table, rid, len(outcomes))
            else:
                cache = SpeculationCache({o: spec for o, spec in zip(outcomes, specs)})
            self.seqs[rid].cache = cache
            self.stats.branches += len(branches)

    def _catch_up_glue(self, rids: list[str]) -> None:
        """The glue pass alone for the sequences whose KV is far behind (new or resynced:
        a prompt to prefill), where SD on the lent cores may follow: it drafts on the
        critical path, so their prefill goes here, off it, while the target decodes on
        its own cores (at the draft's ~0.5 ms a token on one core, PREFILL_S_PER_TOKEN, a
        200-token prompt is ~100 ms: a few % of a short request's decode)."""
        if self.lent_cost is None or self.cfg.controller.regime == "ssd":
            return
        behind = [r for r in rids
                  if len(self.seqs[r].tokens) - len(self.seqs[r].kv_tokens) > self.K + 1]
        if behind:
            self.stats.catch_up_glues += 1
            self._glue(behind)

    def _glue(self, rids: list[str]) -> list[torch.Tensor]:
        """Glue pass: run the speculation in flight (after the last verified token) into
        the KV, so every outcome's branch can start from it; hidden states of its
        m + 1 positions per sequence."""
        windows = []
        for rid in rids:
            st = self.seqs[rid]
            glue = st.tokens + st.spec
            self._keep_kv(rid, glue, limit=len(st.tokens) - 1)
            windows.append(glue[len(st.kv_tokens):])
        return [h[-(len(self.seqs[r].spec) + 1):] for r, h in zip(rids, self._extend(rids, windows))]

    def _fork(self, rids: list[str], hidden: list[torch.Tensor]) -> list[list[tuple[int, int]]]:
        """Fork: the outcomes (k, bonus) to pre-speculate for each sequence. Position j
        predicts the token after t*_prev, s_1..s_j; its likely tokens other than s_{j+1}
        are the bonus tokens bet on for outcome k = j."""
        logits = [self.model.logits(h) for h in hidden]
        if self.cfg.fanout.policy == "probable":
            roots = self._probable_roots(rids, logits)
        else:
            roots = [fanout_roots(self.model, self.seqs[r].spec, lg, self.fanout,
                                  use_op=self.use_ops) for r, lg in zip(rids, logits)]
            if self.use_ops:
                self.stats.ops_forks += sum(len(self.seqs[r].spec) + 1 for r in rids)
        for rid, branches in zip(rids, roots):
            self.seqs[rid].roots = frozenset(Outcome(j, x) for j, x in branches)
        return roots

    def _probable_roots(self, rids: list[str], logits: list[torch.Tensor]
                        ) -> list[list[tuple[int, int]]]:
        """probable: the batch's most likely outcomes by the draft's calibrated estimate
        (core/selection.py); also keeps each speculation's confidences for calibration."""
        k_probs, bonus = [], []
        for rid, lg in zip(rids, logits):
            st = self.seqs[rid]
            conf, cands = outcome_estimates(lg, st.spec, st.sampling, self.fanout,
                                            self.saguaro_c, self.model, self.budget,
                                            one_hot=st.source == "fast")
            st.confidence = conf
            k_probs.append(accepted_length_probs([self.calibration.rate(c) for c in conf]))
            bonus.append(cands)
        return select_outcomes(k_probs, bonus, self.budget * len(rids))

    def _tree_decode(self, rids: list[str], roots: list[list[tuple[int, int]]],
                     ) -> list[list[Speculation]] | None:
        """K decode steps over all branches of all sequences, one forward per step.

        Branch b of sequence n, forked at j, sees the sequence's KV up to its fork point
        (verified tokens + s_1..s_j) and its own earlier branch tokens (scratch KV).
        None if step() asked to cut it short.
        """
        n = len(rids)
        nb = max((len(r) for r in roots), default=0)
        if nb == 0:
            return [[] for _ in rids]
        ctx, lens = self.kv.gather(rids)
        lc = ctx[0][0].shape[2]
        cur = torch.zeros(n, nb, dtype=torch.long)
        seen = torch.zeros(n, nb, dtype=torch.long)   # context tokens visible to the branch
        origins = [(0, 0)] * (n * nb)  # per row: the verified (length, last token) if hit
        for i, (rid, branches) in enumerate(zip(rids, roots)):
            base = len(self.seqs[rid].tokens)
            for b, (j, x) in enumerate(branches):
                cur[i, b], seen[i, b] = x, base + j
                origins[i * nb + b] = (base + j + 1, x)
        pos = seen.clone()
        ctx_mask = (torch.arange(lc)[None, None, :] < seen[:, :, None])        # [N, nb, Lc]
        eye = torch.eye(nb, dtype=torch.bool)[None].expand(n, nb, nb)
        row_rids = [rid for rid in rids for _ in range(nb)]  # rows of the [N * nb] batch
        scratch = None
        draws = Draws(len(row_rids))
        for step in range(self.K):
            if self._abort.is_set():
                return None
            mask = torch.cat([ctx_mask] + [eye] * (step + 1), dim=2)[:, None].to(self.device)
            out = self.model.forward(cur.to(self.device), pos.to(self.device), mask,
                                     context=ctx, scratch=scratch, stop=self._abort.is_set)
            if out is None:  # cut short between two layers: a miss waits at most one layer
                return None
            hidden, new_kv = out
            chosen, qs, conf = self._choose(row_rids, hidden.reshape(n * nb, -1), step, origins)
            draws.add(chosen, qs, conf)
            cur = torch.tensor(chosen, dtype=torch.long).view(n, nb)
            pos = pos + 1
            if step + 1 < self.K:
                scratch = new_kv if scratch is None else [
                    (torch.cat([sk, k], dim=2), torch.cat([sv, v], dim=2))
                    for (sk, sv), (k, v) in zip(scratch, new_kv)]
        specs = draws.speculations()
        return [specs[i * nb: i * nb + len(roots[i])] for i in range(n)]
