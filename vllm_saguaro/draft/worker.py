"""The draft worker: owns the draft model, its paged KV and each sequence's speculation cache.

Round protocol (driven by the target side, see vllm_glue/proposer.py):
  step(updates, finished)  -> next speculation per sequence: a cache hit costs nothing,
                              a miss (or a new / resynced sequence) drafts just in time.
  prespeculate()           -> while the target verifies that speculation: glue pass, fork
                              the likely outcomes, tree-decode K tokens for every branch.
In synchronous mode (``async: false``) prespeculate is never called: plain SD.
The class is plain Python; RayDraftWorker wraps it as an actor on a device of its own.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from vllm_saguaro.config import SaguaroConfig
from vllm_saguaro.core.cache import SpeculationCache
from vllm_saguaro.core.fanout import fanout_for
from vllm_saguaro.core.outcome import Outcome, is_consistent, outcome_from_sampled
from vllm_saguaro.draft.kv import PagedKVCache
from vllm_saguaro.draft.model import DraftModel

# (request id, tokens sampled this round or None, full token list on (re)sync or None)
Update = tuple[str, "list[int] | None", "list[int] | None"]

# Windows longer than this (prefills, resyncs) run one sequence at a time, so that one
# long prompt does not pad every other sequence of the batch to its length.
_BATCHED_WINDOW = 64


@dataclass
class SeqState:
    tokens: list[int]                       # verified tokens (prompt + output)
    kv_tokens: list[int] = field(default_factory=list)  # tokens whose KV is in the pool
    spec: list[int] | None = None           # speculation sent, awaiting its outcome
    cache: SpeculationCache | None = None   # outcomes pre-speculated for that speculation


@dataclass
class DraftStats:
    lookups: int = 0
    hits: int = 0
    fallback_rounds: int = 0      # rounds in which the neural fallback drafted
    fallback_seqs: int = 0        # sequences drafted by the fallback (misses + syncs)
    syncs: int = 0                # new or resynchronised sequences
    branches: int = 0             # branches pre-speculated
    prespec_s: float = 0.0        # time spent pre-speculating (hidden behind verification)
    fallback_s: float = 0.0       # time spent drafting on the critical path

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def bind_to_cores(cores: list[int]) -> None:
    """Give the draft a 'device' of its own on CPU machines: its own cores and threads."""
    os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(len(cores))


def default_draft_cores() -> list[int]:
    return [max(os.sched_getaffinity(0) | {0})]


class DraftWorker:
    def __init__(self, config: dict, target_vocab_size: int, bind: bool = True):
        cfg = SaguaroConfig.model_validate(config)
        self.cfg = cfg
        if cfg.draft_device == "cpu":
            if bind:
                bind_to_cores(cfg.draft_cpu_cores or default_draft_cores())
            device = torch.device("cpu")
        else:
            device = torch.device(cfg.draft_device)
        torch.manual_seed(0)
        self.model = DraftModel(cfg.draft_model, getattr(torch, cfg.draft_dtype), device)
        s = self.model.spec
        if s.vocab_size != target_vocab_size:
            raise ValueError(
                f"draft vocabulary ({s.vocab_size}) differs from the target's "
                f"({target_vocab_size}); SSD needs a draft with the target's tokenizer"
            )
        self.device = device
        self.kv = PagedKVCache(s.num_layers, s.num_kv_heads, s.head_dim, self.model.dtype, device)
        self.K = cfg.num_speculative_tokens
        f = cfg.fanout
        self.fanout = fanout_for(f.policy, self.K, budget=f.budget, width=f.width,
                                 acceptance_rate=f.acceptance_rate, miss_exponent=f.miss_exponent)
        self.seqs: dict[str, SeqState] = {}
        self.stats = DraftStats()

    # ----------------------------------------------------------------- protocol
    def ping(self) -> int:
        return os.getpid()

    def get_stats(self) -> dict:
        return self.stats.as_dict()

    def step(self, updates: list[Update], finished: list[str]) -> list[tuple[list[int], bool | None]]:
        """Commit each sequence's outcome and return its next speculation.

        The flag says True = cache hit, False = cache miss, None = no lookup was possible
        (a new or resynced sequence, or synchronous mode).
        """
        for rid in finished:
            self.drop(rid)
        results: list[tuple[list[int], bool | None] | None] = [None] * len(updates)
        misses: list[int] = []
        looked_up: set[int] = set()
        for i, (rid, sampled, full) in enumerate(updates):
            st = self.seqs.get(rid)
            if full is not None or st is None:
                if full is None:
                    raise ValueError(f"sequence {rid!r} is unknown to the draft; send its tokens")
                self._sync(rid, full)
                misses.append(i)
                continue
            assert sampled and st.spec is not None and is_consistent(sampled, st.spec), (
                f"outcome {sampled} of {rid!r} does not extend speculation {st.spec}")
            st.tokens.extend(sampled)
            cache, st.cache, st.spec = st.cache, None, None
            if cache is None:  # synchronous mode, or nothing was pre-speculated
                misses.append(i)
                continue
            self.stats.lookups += 1
            looked_up.add(i)
            hit = None if self.cfg.force_cache_miss else cache.lookup(outcome_from_sampled(sampled))
            if hit is None:
                misses.append(i)
            else:
                self.stats.hits += 1
                st.spec = hit
                results[i] = (hit, True)
        if misses:
            t0 = time.perf_counter()
            rids = [updates[i][0] for i in misses]
            for i, draft in zip(misses, self._draft_now(rids)):
                self.seqs[updates[i][0]].spec = draft
                results[i] = (draft, False if i in looked_up else None)
            self.stats.fallback_s += time.perf_counter() - t0
            self.stats.fallback_rounds += 1
            self.stats.fallback_seqs += len(misses)
        return results  # type: ignore[return-value]

    def drop(self, rid: str) -> None:
        self.seqs.pop(rid, None)
        self.kv.free(rid)

    # ----------------------------------------------------------------- passes
    def _sync(self, rid: str, tokens: list[int]) -> None:
        """(Re)start a sequence from the target's tokens, keeping KV of the common prefix."""
        self.stats.syncs += 1
        st = self.seqs.get(rid) or SeqState(tokens=[])
        st.tokens, st.spec, st.cache = list(tokens), None, None
        self.seqs[rid] = st
        self._keep_kv(rid, tokens)

    def _keep_kv(self, rid: str, tokens: list[int], limit: int | None = None) -> None:
        """Roll the pool back to the prefix it shares with `tokens` (at most `limit`)."""
        st = self.seqs[rid]
        n = _lcp(st.kv_tokens, tokens)
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
        hidden, new_kv = self.model.forward(ids.to(self.device), positions.to(self.device), mask,
                                            context=ctx if lc else None)
        counts = [len(w) for w in windows]
        self.kv.append(rids, counts, new_kv)
        for rid, w in zip(rids, windows):
            self.seqs[rid].kv_tokens.extend(w)
        return hidden

    def _argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden).argmax(dim=-1)

    def _draft_now(self, rids: list[str]) -> list[list[int]]:
        """Neural fallback = ordinary SD drafting: K greedy tokens, on the critical path."""
        windows = []
        for rid in rids:
            st = self.seqs[rid]
            self._keep_kv(rid, st.tokens, limit=len(st.tokens) - 1)
            windows.append(st.tokens[len(st.kv_tokens):])
        hidden = self._extend(rids, windows)
        last = torch.stack([h[-1] for h in hidden])
        drafts = [[int(x)] for x in self._argmax(last)]
        for _ in range(self.K - 1):
            hidden = self._extend(rids, [[d[-1]] for d in drafts])
            nxt = self._argmax(torch.stack([h[-1] for h in hidden]))
            for d, x in zip(drafts, nxt.tolist()):
                d.append(int(x))
        return drafts

    def prespeculate(self) -> None:
        """Glue, fork and tree-decode for every sequence with a speculation in flight."""
        rids = [r for r, st in self.seqs.items() if st.spec is not None and st.cache is None]
        if not rids:
            return
        t0 = time.perf_counter()
        windows = []
        for rid in rids:
            st = self.seqs[rid]
            glue = st.tokens + st.spec
            self._keep_kv(rid, glue, limit=len(st.tokens) - 1)
            windows.append(glue[len(st.kv_tokens):])
        hidden = self._extend(rids, windows)
        # Fork: position j predicts the token after t*_prev, s_1..s_j; its top tokens other
        # than s_{j+1} are the bonus tokens we bet on for outcome k = j.
        roots: list[list[tuple[int, int]]] = []
        for rid, h in zip(rids, hidden):
            spec = self.seqs[rid].spec
            m = len(spec)
            logits = self.model.logits(h[-(m + 1):])
            branches = []
            for j in range(m + 1):
                f = self.fanout[j]
                if f == 0:
                    continue
                top = torch.topk(logits[j], min(f + 1, logits.shape[-1])).indices.tolist()
                if j < m:
                    top = [x for x in top if x != spec[j]]
                branches.extend((j, x) for x in top[:f])
            roots.append(branches)
        drafted = self._tree_decode(rids, roots)
        for rid, branches, toks in zip(rids, roots, drafted):
            cache = SpeculationCache()
            for (j, x), d in zip(branches, toks):
                cache.put(Outcome(j, x), d)
            self.seqs[rid].cache = cache
            self.stats.branches += len(branches)
        self.stats.prespec_s += time.perf_counter() - t0

    def _tree_decode(self, rids: list[str], roots: list[list[tuple[int, int]]]) -> list[list[list[int]]]:
        """K decode steps over all branches of all sequences, one forward per step.

        Branch b of sequence n, forked at j, sees the sequence's KV up to its fork point
        (verified tokens + s_1..s_j) and its own earlier branch tokens (scratch KV).
        """
        n = len(rids)
        nb = max((len(r) for r in roots), default=0)
        if nb == 0:
            return [[] for _ in rids]
        ctx, lens = self.kv.gather(rids)
        lc = ctx[0][0].shape[2]
        cur = torch.zeros(n, nb, dtype=torch.long)
        seen = torch.zeros(n, nb, dtype=torch.long)   # context tokens visible to the branch
        for i, (rid, branches) in enumerate(zip(rids, roots)):
            base = len(self.seqs[rid].tokens)
            for b, (j, x) in enumerate(branches):
                cur[i, b], seen[i, b] = x, base + j
        pos = seen.clone()
        ctx_mask = (torch.arange(lc)[None, None, :] < seen[:, :, None])        # [N, nb, Lc]
        eye = torch.eye(nb, dtype=torch.bool)[None].expand(n, nb, nb)
        scratch = None
        out = []
        for step in range(self.K):
            mask = torch.cat([ctx_mask] + [eye] * (step + 1), dim=2)[:, None].to(self.device)
            hidden, new_kv = self.model.forward(cur.to(self.device), pos.to(self.device), mask,
                                                context=ctx, scratch=scratch)
            cur = self._argmax(hidden).cpu()
            out.append(cur)
            pos = pos + 1
            if step + 1 < self.K:
                scratch = new_kv if scratch is None else [
                    (torch.cat([sk, k], dim=2), torch.cat([sv, v], dim=2))
                    for (sk, sv), (k, v) in zip(scratch, new_kv)]
        toks = torch.stack(out, dim=-1).tolist()  # [N, nb, K]
        return [toks[i][: len(roots[i])] for i in range(n)]


def make_ray_worker(config: dict, target_vocab_size: int):
    """Start the draft worker as a Ray actor (own process; own cores or own GPU)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=True,
                 configure_logging=False, ignore_reinit_error=True)
    env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
    actor_cls = ray.remote(num_cpus=0)(DraftWorker)
    return actor_cls.options(runtime_env={"env_vars": env}).remote(config, target_vocab_size)
