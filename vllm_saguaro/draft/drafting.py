"""Drafting on the critical path: the neural fallback (ordinary SD drafting, K steps or
fewer, then on while its tokens are likely), the per-row draw (greedy, or Saguaro
sampling's sigma_{F,C} with its q) and the draft's KV around them: extend a window after
a sequence's KV, roll it back to a prefix, (re)start a sequence from the target's tokens.

A mixin of DraftWorker (draft/worker.py), whose __init__ holds the state it uses (the
model, the KV pool, the sequences, the fan-out, the generator).
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from vllm_saguaro.core.cache import Speculation
from vllm_saguaro.core.sampling import SamplingSpec, draft_distribution, quantize_distribution
from vllm_saguaro.draft.state import SeqState
from vllm_saguaro.ops import saguaro_sample

# Windows longer than this (prefills, resyncs) run one sequence at a time, so that one
# long prompt does not pad every other sequence of the batch to its length.
_BATCHED_WINDOW = 64
# The draft's prefill speed before it is measured (the reference draft on one CPU core:
# 0.55 ms a token in a 16-prompt glue pass); a step of at least this many tokens measures it.
PREFILL_S_PER_TOKEN = 5e-4
PREFILL_MEASURE_TOKENS = 64


class Draws:
    """Each row's draft tokens, the draft's confidence in each (the controller's input) and,
    for sampled rows, the q of each, grown step by step."""

    def __init__(self, rows: int):
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.probs: list[list[torch.Tensor]] = [[] for _ in range(rows)]
        self.conf: list[list[float | None]] = [[] for _ in range(rows)]

    def add(self, chosen: list[int], qs: list[torch.Tensor | None],
            conf: list[float | None]) -> None:
        for t, p, cf, x, q, c in zip(self.tokens, self.probs, self.conf, chosen, qs, conf):
            t.append(x)
            cf.append(c)
            if q is not None:
                p.append(q)

    def speculations(self) -> list[Speculation]:
        return [Speculation(t, torch.stack(p) if p else None, c)
                for t, p, c in zip(self.tokens, self.probs, self.conf)]


def lcp(a: list[int], b: list[int]) -> int:
    """The length of the common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Drafting:
    """DraftWorker's drafting on the critical path and its KV (see the module's docstring)."""

    def _sync(self, rid: str, tokens: list[int], sampling: SamplingSpec) -> None:
        """(Re)start a sequence from the target's tokens, keeping KV of the common prefix."""
        self.stats.syncs += 1
        st = self.seqs.get(rid) or SeqState(tokens=[])
        st.tokens, st.spec, st.cache, st.sampling = list(tokens), None, None, sampling
        st.source, st.fast = "neural", None  # (a lookup draft is made for its tokens)
        self.seqs[rid] = st
        self._keep_kv(rid, tokens)

    def _keep_kv(self, rid: str, tokens: list[int], limit: int | None = None) -> None:
        """Roll the pool back to the prefix it shares with `tokens` (at most `limit`)."""
        st = self.seqs[rid]
        n = lcp(st.kv_tokens, tokens)
        if limit is not None:
            n = min(n, limit)
        self.kv.truncate(rid, n)
        del st.kv_tokens[n:]

    def _extend(self, rids: list[str], windows: list[list[int]]) -> list[torch.Tensor]:
        """Run each window after its sequence's KV, append the KV; per-seq hidden [T_i, H]."""
        out: list[torch.Tensor | None] = [None] * len(rids)
        short = [i for i, w in enumerate(windows) if len(w) <= _BATCHED_WINDOW]
        groups = [short] if short else []
        groups += [[i] for i, w in enumerate(windows) if len(w) > _BATCHED_WINDOW]
        for group in groups:
            g_rids = [rids[i] for i in group]
            g_win = [windows[i] for i in group]
            hidden = self._extend_batch(g_rids, g_win)
            for j, i in enumerate(group):
                out[i] = hidden[j, : len(windows[i])]
        return out  # type: ignore[return-value]

    def _extend_batch(self, rids: list[str], windows: list[list[int]]) -> torch.Tensor:
        n, t = len(rids), max(len(w) for w in windows)
        ctx, lens = self.kv.gather(rids)
        lc = ctx[0][0].shape[2]
        ids = torch.zeros(n, t, dtype=torch.long)
        for i, w in enumerate(windows):
            ids[i, : len(w)] = torch.tensor(w)
        ar = torch.arange(t)
        positions = lens[:, None] + ar[None, :]
        ctx_mask = torch.arange(lc)[None, None, :] < lens[:, None, None]          # [N, 1, Lc]
        ctx_mask = ctx_mask.expand(n, t, lc)
        new_mask = (ar[None, :] <= ar[:, None])[None].expand(n, t, t)           # causal
        mask = torch.cat([ctx_mask, new_mask], dim=2)[:, None].to(self.device)
        t0 = time.perf_counter()
        hidden, new_kv = self.model.forward(ids.to(self.device), positions.to(self.device), mask,
                                            context=ctx if lc else None)
        counts = [len(w) for w in windows]
        if sum(counts) >= PREFILL_MEASURE_TOKENS:  # a prefill: its speed, for _idle_limit
            per = (time.perf_counter() - t0) / sum(counts)
            self.prefill_s_per_token = 0.7 * self.prefill_s_per_token + 0.3 * per
            self.stats.prefill_s_per_token = self.prefill_s_per_token
        self.kv.append(rids, counts, new_kv)
        for rid, w in zip(rids, windows):
            self.seqs[rid].kv_tokens.extend(w)
        return hidden

    def _choose(self, rids: list[str], hidden: torch.Tensor, step: int,
                origins: list[tuple[int, int]]
                ) -> tuple[list[int], list[torch.Tensor | None], list[float | None]]:
        """The next draft token of each row (row i belongs to sequence rids[i]), its q and
        the draft's confidence in it.

        Greedy requests take the argmax. Sampled ones draw from q = sigma_{F,C} of the
        tempered, top-k/top-p-masked draft distribution, F being the fan-out at `step`
        (the position where a rejection of this token would fork), and return q too.
        Confidence (what the controller calibrates): p_d(token) at greedy; for a sampled
        request only at step 0, and then the expected acceptance sum(min(p_d, q)), which
        does not depend on the token drawn (core/controller.py: losslessness).

        A seeded request draws each row from a generator keyed by (seed, origin, step),
        origin = (verified length, last verified token) the speculation starts from. A
        cached branch and the fallback for the same outcome thus draw alike, so a seeded
        request's output does not depend on whether the cache hit (which depends on
        timing). A speculation that gets verified is the only draw with its key, so it is
        distributed as q given everything verified before it.
        """
        logits = self.model.logits(hidden)
        top = torch.softmax(logits, dim=-1).max(dim=-1)
        choice = top.indices
        conf: list[float | None] = top.values.tolist()
        qs: list[torch.Tensor | None] = [None] * len(rids)
        sampled = [i for i, rid in enumerate(rids) if not self.seqs[rid].sampling.greedy]
        if self.use_ops and sampled:  # every sampled row in one op, each with its own draw
            q_ops = self._sample_with_ops(logits, rids, sampled, step, origins, choice)
        # One batched draw per group: unseeded requests with the same parameters share
        # one; a seeded request's rows draw one by one from keyed generators.
        groups: dict[tuple, list[int]] = {}
        for i in sampled:
            sampling = self.seqs[rids[i]].sampling
            groups.setdefault((sampling, sampling.seeded), []).append(i)
        for (sampling, seeded), rows in groups.items():
            idx = torch.tensor(rows)
            fan = torch.full((len(rows),), self.fanout[step])
            if self.use_ops:
                q = q_ops[[sampled.index(r) for r in rows]]
            else:  # the exact q the verifier is told (sent as counts, core/sampling.py)
                q = quantize_distribution(draft_distribution(logits[idx], sampling, fan,
                                                             self.saguaro_c))
                if seeded:
                    for r, row in enumerate(rows):
                        gen = torch.Generator().manual_seed(
                            self._seed_key(sampling, origins[row], step))
                        choice[row] = torch.multinomial(q[r], 1, generator=gen)[0]
                else:
                    choice[idx] = torch.multinomial(q, 1, generator=self.generator)[:, 0]
            expected = [None] * len(rows)
            if step == 0:
                p_d = draft_distribution(logits[idx], sampling._replace(seed=None), fan, 1.0)
                expected = torch.minimum(p_d, q.to(p_d.device)).sum(-1).tolist()
            if self.fault == "unmodified_q":
                q = quantize_distribution(draft_distribution(logits[idx], sampling, fan, 1.0))
            for r, row in enumerate(rows):
                qs[row], conf[row] = q[r], expected[r]
        return self.model.token_ids(choice).tolist(), qs, conf

    @staticmethod
    def _seed_key(sampling: SamplingSpec, origin: tuple[int, int], step: int) -> int:
        """A seeded row's draw: keyed by (seed, origin, step), see _choose."""
        return hash((sampling.seed, *origin, step)) & 0x7FFFFFFFFFFFFFFF

    def _sample_with_ops(self, logits: torch.Tensor, rids: list[str], rows: list[int],
                         step: int, origins: list[tuple[int, int]], choice: torch.Tensor
                         ) -> torch.Tensor:
        """ops.saguaro_sample for the sampled rows: sets their tokens in `choice`, returns
        their q [len(rows), head]. Each row draws from a hash of its seed (ops/keys.py):
        the keyed one for seeded requests, one from the worker's generator otherwise."""
        specs = [self.seqs[rids[i]].sampling for i in rows]
        seeds = torch.randint(-2**63, 2**63 - 1, (len(rows),), generator=self.generator)
        for r, (sp, i) in enumerate(zip(specs, rows)):
            if sp.seeded:
                seeds[r] = self._seed_key(sp, origins[i], step)
        dev = logits.device
        tokens, q = saguaro_sample(
            logits[torch.tensor(rows, device=dev)],
            torch.tensor([sp.temperature for sp in specs], device=dev),
            torch.tensor([sp.top_k for sp in specs], device=dev),
            torch.tensor([sp.top_p for sp in specs], device=dev),
            torch.full((len(rows),), self.fanout[step], device=dev),
            self.saguaro_c, seeds.to(dev))
        choice[torch.tensor(rows, device=choice.device)] = tokens.to(choice.device)
        self.stats.ops_rows += len(rows)
        return q.cpu()

    def _draft_now(self, rids: list[str], steps: int | None = None,
                   more: Callable[[list[Speculation]], bool] | None = None) -> list[Speculation]:
        """Neural fallback = ordinary SD drafting of `steps` (K) tokens, on the critical
        path; then one more while more(the drafts so far) says so, up to K."""
        windows = []
        for rid in rids:
            st = self.seqs[rid]
            self._keep_kv(rid, st.tokens, limit=len(st.tokens) - 1)
            windows.append(st.tokens[len(st.kv_tokens):])
        hidden = [h[-1] for h in self._extend(rids, windows)]
        draws = Draws(len(rids))
        origins = [(len(self.seqs[r].tokens), self.seqs[r].tokens[-1]) for r in rids]
        planned = self.K if steps is None else steps
        step = 0
        while step < planned or (more is not None and 0 < step < self.K
                                 and more(draws.speculations())):
            if step:
                hidden = [h[-1] for h in self._extend(rids, [[t[-1]] for t in draws.tokens])]
            draws.add(*self._choose(rids, torch.stack(hidden), step, origins))
            step += 1
        return draws.speculations()
