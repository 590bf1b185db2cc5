"""The draft worker: owns the draft model, its paged KV and each sequence's speculation cache.

Round protocol (driven by the target side, see vllm_glue/proposer.py):
  step(updates, finished)  -> next speculation per sequence: a cache hit costs nothing,
                              a miss (or a new / resynced sequence) drafts just in time.
  prespeculate()           -> while the target verifies that speculation: glue pass, fork
                              the likely outcomes, tree-decode K tokens for every branch.
In synchronous mode (``async: false``) prespeculate is never called: plain SD.
The class is plain Python; draft/process_actor.py runs it in a process of its own (CPU),
draft/ray_actor.py as a Ray actor (GPU), each on a device of its own.
"""
from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from vllm_saguaro.config import SaguaroConfig
from vllm_saguaro.core.cache import Speculation, SpeculationCache
from vllm_saguaro.core.controller import (Candidate, RealizedRate, StepCost, batch_limit,
                                          beats_plain, catch_up_pays, choose_lengths,
                                          draft_more_pays, lent_sd_pays, lent_sd_worth,
                                          speculation_pays)
from vllm_saguaro.core.fallback import ngram_draft
from vllm_saguaro.core.fanout import AcceptanceFit, BudgetControl, fanout_for
from vllm_saguaro.core.outcome import Outcome, is_consistent, outcome_from_sampled
from vllm_saguaro.core.placement import omp_env, process_threads
from vllm_saguaro.core.sampling import (SamplingSpec, counts_int16, draft_distribution,
                                        quantize_distribution, wire_counts)
from vllm_saguaro.core.selection import (AcceptanceCalibration, accepted_length_probs,
                                         select_outcomes)
from vllm_saguaro.core.theory import sd_rate, ssd_rate, target_alone_rate
from vllm_saguaro.draft.fork import fanout_roots, outcome_estimates
from vllm_saguaro.draft.kv import PagedKVCache
from vllm_saguaro.draft.linear import fp16_supported
from vllm_saguaro.draft.model import DraftModel, check_draft_vocabulary
from vllm_saguaro.draft.speculation_table import SpeculationTable, TableView
from vllm_saguaro.draft.stats import DraftStats
from vllm_saguaro.draft.team import DraftTeam
from vllm_saguaro.ops import saguaro_sample

# (request id, tokens sampled this round or None, full token list on (re)sync or None,
#  the request's SamplingSpec fields on (re)sync or None)
Update = tuple[str, "list[int] | None", "list[int] | None", "tuple | None"]
# (draft tokens, 0..K of them, hit flag, q as uint16 counts [len(tokens), head]
#  (core/sampling.py) or None for greedy)
Result = tuple[list[int], "bool | None", object]
# A target step the proposer measured: (tokens it verified, seconds, whether it ran on the
# draft's cores too: vllm_glue/lending.py[, whether it verified draft tokens])
TargetStep = tuple[int, float, bool] | tuple[int, float, bool, bool]

# Test-only fault injection. "unmodified_q": verify with the unmodified draft q instead of
# the sigma the draft sampled from (the losslessness tests show they catch such a bug).
# "die_at_step:N", "raise_at_step:N", "hang_at_step:N": the worker kills its own process,
# raises or never answers in its N-th step() (the draft-failure tests); only the first
# worker gets it, a restarted one too with a ":always" suffix.
FAULT_ENV = "SAGUARO_FAULT_INJECTION"

# The sampling and fork ops (vllm_saguaro/ops) run where the draft's device is CUDA; on CPU
# the worker keeps the per-group torch code below, which measured faster there
# (benchmarks/ops_timing.py). "1" runs the ops (their torch references) on CPU too, so that
# the tests drive the path a GPU takes through the real engine.
OPS_ENV = "SAGUARO_DRAFT_OPS"


def worker_env(cores: list[int] | None, incarnation: int,
               borrow: list[int] = ()) -> dict[str, str]:
    """What a draft worker's process gets added to the target's environment, in either
    runtime (draft/ray_actor.py, draft/process_actor.py): OpenMP bound to the draft's
    cores (not the target's inherited OMP_PLACES), the test switches passed on, and a
    fault injected into the first worker only (incarnation 0) unless ':always'. Intel
    OpenMP's warnings off: it reads KMP_AFFINITY and said, on the server's terminal,
    that it ignores the OMP_* forms of the same binding (there for GNU OpenMP).
    borrow: the target's cores, listed after the draft's, where the draft's team may
    grow while the target waits (draft/team.py); it starts on the draft's."""
    env = omp_env(list(cores) + list(borrow), threads=len(cores)) if cores else {}
    if cores and borrow:
        # Intel OpenMP's thread on a borrowed core spins this long after the draft's step
        # before it sleeps, while the target starts its verification there (vLLM sets 5)
        env["KMP_BLOCKTIME"] = "1"
    if cores:
        env["KMP_WARNINGS"] = "0"
    if os.environ.get(OPS_ENV):
        env[OPS_ENV] = os.environ[OPS_ENV]
    fault = os.environ.get(FAULT_ENV, "")
    if fault:  # set either way: a worker process may inherit it from whoever started it
        env[FAULT_ENV] = fault if incarnation == 0 or fault.endswith(":always") else ""
    return env


# Windows longer than this (prefills, resyncs) run one sequence at a time, so that one
# long prompt does not pad every other sequence of the batch to its length.
_BATCHED_WINDOW = 64
# The draft's prefill speed before it is measured (the reference draft on one CPU core:
# 0.55 ms a token in a 16-prompt glue pass); a step of at least this many tokens measures it.
PREFILL_S_PER_TOKEN = 5e-4
PREFILL_MEASURE_TOKENS = 64


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
# Rows a round whose fast-backup draft is made but not sent, to measure its acceptance
# where it does not draft (_shadow_fast): ~0.05-0.15 ms each on the step's critical path
SHADOW_ROWS = 4


class IdleAdvice(NamedTuple):
    """The draft may idle while the batch is larger than `limit`; `probe`: only to
    measure plain decoding on the lent cores at this batch size, so ask again soon;
    `recheck_s`: ask again after this long (None: the proposer's default); `new_text`:
    ask again as soon as every request of the batch is one that joined since (what was
    measured is of text that is gone)."""

    limit: int
    probe: bool
    recheck_s: float | None = None
    new_text: bool = False


@dataclass
class SeqState:
    tokens: list[int]                       # verified tokens (prompt + output)
    sampling: SamplingSpec = SamplingSpec()
    kv_tokens: list[int] = field(default_factory=list)  # tokens whose KV is in the pool
    spec: list[int] | None = None           # speculation sent, awaiting its outcome
    cache: SpeculationCache | TableView | None = None  # outcomes pre-speculated for it
    roots: frozenset | None = None          # the outcomes being pre-speculated (after fork)
    source: str = "neural"                  # who drafted spec: "hit" (the cache), "neural",
                                            # "fast"; "plain" = nothing sent
    aborted: bool = False                   # its pre-speculation was cut short
    confidence: list[float] | None = None   # the draft's confidence in each token of spec
    shadow_fast: list[int] | None = None    # the fast backup's draft for this round, not
                                            # sent: its acceptance measured all the same


class _Draws:
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


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def draft_weights(cfg: SaguaroConfig, device: torch.device, dtype: str) -> str:
    """The draft's linear layers (draft/linear.py): fp16 weights where they pay, a float32
    draft on a CPU with fbgemm; 'none' = in the draft's dtype."""
    if cfg.draft_weights == "fp16":
        return "fp16"
    auto = cfg.draft_weights == "auto" and device.type == "cpu" and dtype == "float32"
    return "fp16" if auto and fp16_supported() else "none"


class DraftWorker:
    def __init__(self, config: dict, target_vocab_size: int, bind: bool = True,
                 borrow: list[int] = ()):
        """borrow: the target's cores, where the team grows in lent_sd steps (the
        process was started bound to them as well: process_actor.ProcessRuntime)."""
        cfg = SaguaroConfig.model_validate(config)
        self.cfg = cfg
        # the draft's threads: its own cores, and the target's it borrows while it waits
        self.team = DraftTeam(cfg.draft_cpu_cores or [max(os.sched_getaffinity(0))],
                              borrow if bind else [])
        if cfg.draft_device == "cpu":
            if bind:
                self.team.bind()
            device = torch.device("cpu")
        else:
            device = torch.device(cfg.draft_device)
        torch.manual_seed(0)
        check_draft_vocabulary(cfg.draft_model, target_vocab_size)
        dtype = cfg.draft_dtype
        if dtype == "auto":
            dtype = "float32" if device.type == "cpu" else "bfloat16"
        self.model = DraftModel(cfg.draft_model, getattr(torch, dtype), device,
                                head_tokens=cfg.draft_head_tokens,
                                quantization=draft_weights(cfg, device, dtype))
        s = self.model.spec
        self.device = device
        self.kv = PagedKVCache(s.num_layers, s.num_kv_heads, s.head_dim, self.model.dtype, device)
        self.K = cfg.num_speculative_tokens
        self.acceptance = AcceptanceFit(cfg.fanout.acceptance_rate)
        self.calibration = AcceptanceCalibration()  # for the 'probable' outcome selection
        # What the speculation-length controller weighs (core/controller.py): the target's
        # step time by tokens verified (measured by the proposer), the neural fallback's
        # step time by rows, the fast backup's acceptance (pessimistic until measured).
        ctl = cfg.controller
        self.target_cost = StepCost(ctl.target_fixed_s, ctl.target_per_token_s,
                                    token_cost=ctl.token_cost)
        self.draft_cost = StepCost()
        # the same with the target's cores borrowed (lent_sd steps, draft/team.py)
        self.borrowed_draft_cost = StepCost()
        # plain decoding with the draft's cores lent to the target (CPU, while idle): the
        # alternative speculation must beat there (None: no lending)
        self.lent_cost = StepCost() if (ctl.lend_cores and ctl.idle and ctl.policy == "auto"
                                        and cfg.draft_device == "cpu") else None
        self.lent_widths: set[int] = set()
        # and a verification of draft tokens there (SD on the lent cores), kept apart:
        # vLLM's verification path costs more than a plain step at the same width, and
        # one line for both raises plain decoding's estimate (suspected at batch 4, where
        # SD on the lent cores ran 0.89x plain decoding while expected faster)
        self.lent_sd_cost = StepCost() if self.lent_cost is not None else None
        # batch size -> when plain decoding on the lent cores was last probed there
        self._probed: dict[int, float] = {}
        self._started = time.perf_counter()
        self.realized = RealizedRate(alpha=0.05)  # what speculation gave, round to round
        # and SD on the lent cores, over more rounds: it is weighed against plain decoding
        # on the same cores, 0-25% apart at batch 1, and its first rounds on an engine ran
        # ~25% slower than later ones (measured: 25.7 tok/s over the first 24 rounds, 32
        # over the first 48, plain decoding 25); kept for 30 s only (the idle recheck), so
        # that a low first measurement does not idle it for the default two minutes. Over
        # ~100 rounds (alpha 0.02): over ~40 (0.05), one HumanEval prompt whose drafts
        # were rejected for a few dozen rounds idled it where it gave 1.10x plain
        # decoding over the set (measured at batch 1: 26.3 tok/s against 26.2, then
        # 28.9 against 26.3 with 0.02)
        self.lent_sd_realized = RealizedRate(min_rounds=48, ttl_s=30.0, alpha=0.02)
        self._lent_sd = False  # this step is SD on the lent cores (controller.regime)
        # (when, batch, lent_sd) of the last step
        self._last_call: tuple[float, int, bool] | None = None
        self._last_draft_s = 0.0  # the last step's neural drafting (the fallback's steps)
        self._lent_sd_steps = 0  # lent_sd steps in a row, up to the last one
        # batch sizes where SD on the lent cores gave more than plain decoding (over
        # min_rounds rounds), so that a close idle there is tried again (_close_recheck);
        # and where it ever did (a close idle there ends on new text)
        self.lent_sd_paid: set[int] = set()
        self.lent_sd_ever_paid: set[int] = set()
        # steps left that try SD on the lent cores after a close idle, at this batch size
        self._explore, self._explore_batch = 0, 0
        # steps in a row that were SSD's on continuing sequences (not idle, not lent_sd,
        # none new), up to the last one: the realized rate measures SSD from the second
        # on (the first after a switch or a new request is a cold miss: measured at
        # batch 1, SSD's rounds after new requests put it at 13.4 tok/s, plain decoding 21)
        self._ssd_steps = 0
        # what a round of SD on the lent cores costs beyond the target's step and the
        # draft's forwards (this worker's own work around them, the round trip, the
        # proposer), an average
        self.lent_sd_overhead: float | None = None
        self.fast_acceptance = AcceptanceFit(0.2)
        self.prefill_s_per_token = PREFILL_S_PER_TOKEN  # the catch-up's cost (_idle_limit)
        self.hit_rate = 0.5  # of lookups, an exponential average (the idle decision's p_hit)
        self._cap = self.K        # the most tokens a sequence may send this step
        self._limit: IdleAdvice | None = None  # this step: the draft idles above limit
        self._round = 0
        self.budget_control = BudgetControl(cfg.fanout.budget)  # fit_to_round
        # Saguaro sampling only pays with a cache to hit; plain SD drafts from plain q
        # (set again each step: SD on the lent cores has no cache either).
        self.saguaro_c = cfg.saguaro_c if cfg.async_ else 1.0
        self.fault = os.environ.get(FAULT_ENV, "")
        self.use_ops = device.type == "cuda" or os.environ.get(OPS_ENV) == "1"
        self.channel = None  # a TensorChannel to the target, when transport is 'channel'
        self._sending: list = []
        # with the ops, the speculation cache of the whole batch is one table on the device
        self.table = (SpeculationTable(self.K, self.model.lm_head.shape[0], device)
                      if self.use_ops else None)
        self._steps = 0
        self.generator = torch.Generator().manual_seed(0)
        self.seqs: dict[str, SeqState] = {}
        self.stats = DraftStats()
        self.fanout = self._fanout()
        # step() and prespeculate() may run on two threads (the Ray actor allows it): the
        # lock keeps the model and KV single-user, the event lets step() cut a
        # pre-speculation short when its result cannot be used.
        self._lock = threading.Lock()
        self._abort = threading.Event()
        self._prespec_pending = False  # a pre-speculation ran since the last step
        if self.lent_cost is not None and cfg.controller.regime != "ssd":
            self._measure_draft_step()

    def _measure_draft_step(self, steps: int = 4) -> None:
        """The draft step's cost, on its own cores and with the target's borrowed, before
        a round needs it: the controller weighs SD on the lent cores with it, and the
        rounds that would measure it are fallback drafts, which an idle or all-hit draft
        never runs. Measured before: at batch 1 the draft idled from the third round on,
        its step never timed, so SD on the lent cores never came into question. Timed
        here while the target waits for this worker to start (its cores are free): one
        sequence and a batch of 4, each of 16 tokens, their last drafted again `steps` times
        per team (two batch sizes give the line's slope by rows, which one leaves to a
        prior)."""
        rids = [f"\0measure{i}" for i in range(4)]
        for rid in rids:
            self.seqs[rid] = SeqState(tokens=list(range(1, 17)))
        teams = [(self.draft_cost, False)] + ([(self.borrowed_draft_cost, True)]
                                              if self.team.borrows else [])
        try:
            for line, borrowed in teams:
                self.team.use(borrowed)
                for batch in (rids[:1], rids):
                    self._draft_now(batch, 1)  # warm-up (and the prefill)
                    if borrowed:  # the threads the team added, before they are timed
                        self.team.bind_added()
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        self._draft_now(batch, 1)
                        line.observe(len(batch), time.perf_counter() - t0)
        finally:
            self.team.use(False)
            for rid in rids:
                self.drop(rid)

    def _fanout(self) -> list[int]:
        f = self.cfg.fanout
        a_p = self.acceptance.rate if f.fit_acceptance else f.acceptance_rate
        budget = f.budget
        if f.fit_to_round:
            budget = self.budget_control.budget
        self.stats.budget = budget if f.policy != "uniform" else 0
        self.budget = budget
        # 'probable' chooses its branches per round (_fork); the geometric counts still give
        # Saguaro sampling its F (the draft does not know the next round's choice yet).
        policy = "geometric" if f.policy == "probable" else f.policy
        return fanout_for(policy, self.K, budget=budget, width=f.width,
                          acceptance_rate=a_p, miss_exponent=f.miss_exponent)

    # ----------------------------------------------------------------- protocol
    def ping(self) -> int:
        return os.getpid()

    def connect_channel(self, address: tuple[str, int], backend: str, timeout_s: float) -> None:
        """Become rank 1 of a TensorChannel (vllm_saguaro/transport.py) with the target,
        which constructs rank 0 meanwhile: from now on each round's q crosses over it, and
        the reply says only how many of its rows belong to each sequence."""
        from vllm_saguaro.transport import TensorChannel

        device = self.device if backend == "nccl" else "cpu"  # gloo: host tensors
        self.channel = TensorChannel(tuple(address), 1, backend, timeout_s, device=device)
        self._sending = []

    def get_stats(self) -> dict:
        """The cumulative counters, and what the worker holds now (held())."""
        return {**self.stats.as_dict(), **self.held()}

    def held(self) -> dict:
        """The sequences the worker keeps state for and its KV pool's blocks in use and
        in all (the pool grows, never shrinks): after aborts and preemptions both must
        come back down."""
        return dict(live_seqs=len(self.seqs), kv_blocks_used=self.kv.num_blocks - len(self.kv.free_blocks),
                    kv_blocks=self.kv.num_blocks)

    def threads(self) -> dict:
        """This process and its threads (affinity, CPU time): where the draft really runs."""
        return {"pid": os.getpid(), "threads": [t.as_dict() for t in process_threads()]}

    def step(self, updates: list[Update], finished: list[str],
             target_steps: list[TargetStep] = (), k_cap: int | None = None
             ) -> tuple[list[Result], float, float, "IdleAdvice | None", bool]:
        """Commit each sequence's outcome and return its next speculation (0..K tokens, as
        the controller chose), how long this call waited for the pre-speculation in flight,
        how long it then computed (lookups, fallback; the rest of the target's wait is
        transport) and, when the draft may stay idle, an IdleAdvice: the largest batch
        size at which speculation could pay (the proposer stops calling while the batch is
        larger) and whether the idling is a probe of the lent cores (ask again soon);
        last, whether this step is SD on the lent cores (controller.regime lent_sd): the
        proposer then keeps the draft's cores lent to the target for its verification
        and asks for no pre-speculation.

        target_steps: the target's steps measured since the last call (the controller's
        cost model); k_cap: the most tokens a sequence may send (vLLM's
        num_speculative_tokens_per_batch_size at this batch size). The flag says True =
        cache hit, False = cache miss, None = no lookup was possible (a new or resynced
        sequence, or synchronous mode). If some sequence of the batch needs the fallback
        anyway (a certain miss, a new sequence), the pre-speculation in flight is cut
        short: the fallback then drafts for the whole batch at once instead of after the
        tree decode.
        """
        self._steps += 1
        if self.fault:
            self._inject_fault()
        t0 = time.perf_counter()
        overran = self._lock.locked()  # the pre-speculation did not fit the round
        if overran and any(self._certain_miss(u) for u in updates):
            self._abort.set()
        with self._lock:
            wait = time.perf_counter() - t0
            self.stats.lock_wait_s += wait
            if self._prespec_pending and self.cfg.fanout.fit_to_round:
                self.budget_control.observe(overran)
            self._prespec_pending = False
            for width, seconds, lent, *drafted in target_steps:
                if not lent:
                    self.target_cost.observe(width, seconds)
                elif drafted and drafted[0] and self.lent_sd_cost is not None:
                    self.lent_sd_cost.observe(width, seconds)
                elif self.lent_cost is not None:
                    self.lent_cost.observe(width, seconds)
                    self.lent_widths.add(width)
            self._cap = self.K if k_cap is None else max(0, min(self.K, k_cap))
            self._observe_round(updates, t0, target_steps[-1][1] if target_steps else None)
            self._wake(len(updates))
            self._limit = self._idle_limit(len(updates), self._catch_up_tokens(updates))
            self._lent_sd = self._limit is None and self._lent_sd_step(updates)
            self.stats.lent_sd_steps += self._lent_sd
            self._lent_sd_steps = self._lent_sd_steps + 1 if self._lent_sd else 0
            steady = self._limit is None and not self._lent_sd and not self._any_new(updates)
            self._ssd_steps = self._ssd_steps + 1 if steady else 0
            self.team.use(self._lent_sd)  # lent_sd: the target waits, its cores are free
            # Saguaro sampling only pays with a cache to hit; plain SD drafts from plain q
            self.saguaro_c = self.cfg.saguaro_c if self.cfg.async_ and not self._lent_sd else 1.0
            self._last_call = (t0, len(updates), self._lent_sd)
            results = self._step(updates, finished)
            if self._lent_sd:
                self.team.bind_added()
            self._note_models()
            self.stats.q_bytes += sum(q.nbytes for _, _, q in results if q is not None)
            results = self._send_q(results)
        done = time.perf_counter()
        # hit and miss rounds' waits are the proposer's to split (vllm_glue/metrics.py)
        return results, wait, done - t0 - wait, self._limit, self._lent_sd

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

    def _inject_fault(self) -> None:
        """Test-only (FAULT_ENV): die, raise or hang in the N-th step()."""
        kind, _, at = self.fault.partition("_at_step:")
        if kind not in ("die", "raise", "hang") or int(at.split(":")[0]) != self._steps:
            return
        if kind == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "raise":
            raise RuntimeError(f"injected fault in step {self._steps}")
        time.sleep(3600)

    def _certain_miss(self, update: Update) -> bool:
        rid, sampled, full, _ = update
        st = self.seqs.get(rid)
        if full is not None or st is None or self.cfg.force_cache_miss:
            return True
        roots = st.roots  # None while the glue pass runs: not known yet
        return roots is not None and outcome_from_sampled(sampled) not in roots

    def _step(self, updates: list[Update], finished: list[str]) -> list[Result]:
        for rid in finished:
            self.drop(rid)
        self._round += 1
        on_table = self._table_lookups(updates)
        hits: dict[int, Speculation] = {}
        misses: list[int] = []
        looked_up: set[int] = set()
        fresh: set[int] = set()  # new or resynced: the draft prefills them
        for i, (rid, sampled, full, sampling) in enumerate(updates):
            st = self.seqs.get(rid)
            if full is not None or st is None:
                if full is None:
                    raise ValueError(f"sequence {rid!r} is unknown to the draft; send its tokens")
                self._sync(rid, full, SamplingSpec(*sampling) if sampling else SamplingSpec())
                misses.append(i)
                fresh.add(i)
                continue
            assert sampled and st.spec is not None and is_consistent(sampled, st.spec), (
                f"outcome {sampled} of {rid!r} does not extend speculation {st.spec}")
            st.tokens.extend(sampled)
            self._observe_outcome(st, sampled)
            cache, roots, aborted = st.cache, st.roots, st.aborted
            st.cache, st.spec, st.roots, st.aborted, st.confidence = None, None, None, False, None
            if not self.cfg.async_ or self._lent_sd:  # nothing pre-speculated
                misses.append(i)
                continue
            self.stats.lookups += 1
            looked_up.add(i)
            outcome, hit = outcome_from_sampled(sampled), None
            if rid in on_table:
                hit = on_table[rid]
            elif cache is not None and not self.cfg.force_cache_miss:  # None: cut short
                hit = cache.lookup(outcome)
            if hit is None:
                misses.append(i)
                if not self.cfg.force_cache_miss:
                    self._note_miss(outcome, cache, roots, aborted)
            else:
                self.stats.hits += 1
                hits[i] = hit
            self.hit_rate = 0.98 * self.hit_rate + 0.02 * (hit is not None)
        f = self.cfg.fanout
        if f.policy != "uniform" and (f.fit_acceptance or f.fit_to_round):
            self.fanout = self._fanout()
        # who drafts each miss and how many steps: the controller (core/controller.py)
        cands = [self._candidate(i, updates[i][0], hits.get(i), i in looked_up, i in fresh)
                 for i in range(len(updates))]
        plan = self._plan(cands)
        if self._limit is not None or not self._beats_lent_plain(plan, len(updates)):
            plan = choose_lengths([Candidate(cap=0)] * len(updates), self._verify_cost().predict,
                                  self._draft_cost().predict)
            cands = [Candidate(cap=0)] * len(updates)
        specs: dict[int, Speculation] = dict(hits)
        sources = {i: "hit" for i in hits}
        neural = [i for i in misses if plan.neural[i]]
        for i in misses:
            if plan.neural[i]:
                continue
            st = self.seqs[updates[i][0]]
            if plan.lengths[i] and cands[i].free:  # deterministic: verified with a one-hot q
                specs[i], sources[i] = Speculation(ngram_draft(st.tokens, self.K)), "fast"
                self.stats.fast_seqs += 1
            else:
                specs[i], sources[i] = Speculation([]), "plain"
        self.stats.fast_rounds += any(s == "fast" for s in sources.values()) and not neural
        sunk = 0.0
        self._last_draft_s = 0.0
        if neural:
            t0 = time.perf_counter()
            rids = [updates[i][0] for i in neural]
            more = self._draft_more(cands, neural, specs, sources, t0)
            drafts = self._draft_now(rids, plan.draft_steps, more)
            for i, draft in zip(neural, drafts):
                specs[i], sources[i] = draft, "neural"
            sunk = self._last_draft_s = time.perf_counter() - t0
            if not fresh & set(neural):  # a prefill would inflate the step's time
                line = (self.borrowed_draft_cost if self._lent_sd and self.team.borrows
                        else self.draft_cost)
                line.observe(len(neural), sunk / max(len(d.tokens) for d in drafts))
            self.stats.fallback_s += sunk
            self.stats.fallback_rounds += 1
            self.stats.fallback_seqs += len(neural)
        lengths = self._final_lengths(cands, specs, sources, sunk)
        results: list[Result] = []
        for i, (rid, *_) in enumerate(updates):
            st, spec, n = self.seqs[rid], specs[i], lengths[i]
            st.spec = spec.tokens[:n]
            st.source = sources[i] if n else "plain"
            if sources[i] == "neural" and n and spec.confidence:
                # calibrated from rounds with no pre-speculation too (SD on the lent
                # cores): the confidences known at the draw (a sampled row's first only)
                known = list(itertools.takewhile(lambda c: c is not None, spec.confidence[:n]))
                st.confidence = known or None
            probs = spec.probs[:n] if spec.probs is not None and n else None
            flag = True if i in hits else (False if i in looked_up else None)
            results.append((st.spec, flag, self._wire_q(probs)))
            self.stats.sent[n] += 1
            st.shadow_fast = (ngram_draft(st.tokens, self.K) if st.source != "fast"
                              and (i + self._round) % len(updates) < SHADOW_ROWS
                              and self._fast_allowed(st) else None)
        return results

    def _note_models(self) -> None:
        st, t, d = self.stats, self.target_cost.as_dict(), self.draft_cost.as_dict()
        st.target_fixed_s, st.target_per_token_s = t["fixed_s"], t["per_token_s"]
        st.draft_fixed_s, st.draft_per_row_s = d["fixed_s"], d["per_token_s"]
        if self.lent_cost is not None:
            lent, sd = self.lent_cost.as_dict(), self.lent_sd_cost.as_dict()
            borrowed = self.borrowed_draft_cost.as_dict()
            st.lent_fixed_s, st.lent_per_token_s = lent["fixed_s"], lent["per_token_s"]
            st.lent_sd_fixed_s, st.lent_sd_per_token_s = sd["fixed_s"], sd["per_token_s"]
            st.borrowed_draft_fixed_s = borrowed["fixed_s"]
            st.borrowed_draft_per_row_s = borrowed["per_token_s"]
            st.lent_sd_overhead_s = self.lent_sd_overhead
        st.acceptance_rate = self.acceptance.rate
        st.fast_acceptance_rate = self.fast_acceptance.rate

    def _observe_outcome(self, st: SeqState, sampled: list[int]) -> None:
        """What the verified outcome teaches: the calibration, a_p, the fast backup's rate
        (also from its draft not sent: _shadow_fast)."""
        self.stats.note_outcome(st.source, len(sampled))
        if st.shadow_fast is not None:
            # the outcome shows the target's tokens up to its bonus: a shadow token judged
            # wrong there is a rejection, one past them is not judged (as in AcceptanceFit)
            m = _lcp(st.shadow_fast, sampled)
            judged = m + 1 if m < min(len(sampled), len(st.shadow_fast)) else m
            self.fast_acceptance.observe(m, judged)
            self.stats.fast_shadowed += 1
            st.shadow_fast = None
        if not st.spec:
            return
        if st.confidence is not None:
            self.calibration.observe(st.confidence, len(sampled) - 1)
        if st.source == "fast":
            self.fast_acceptance.observe(len(sampled) - 1, len(st.spec))
        else:
            self.acceptance.observe(len(sampled) - 1, len(st.spec))

    def _source_alphas(self, spec: Speculation, source: str) -> tuple[float, ...]:
        """_alphas by who drafted it: the fast backup's tokens at its own rate."""
        if source == "fast":
            return (self.fast_acceptance.rate,) * len(spec.tokens)
        return () if source == "plain" else self._alphas(spec)

    def _alphas(self, spec: Speculation) -> tuple[float, ...]:
        """P(accept) of each token of a drafted speculation: its calibrated confidence where
        one was recorded (not after the first token of a sampled one: see
        core/controller.py on losslessness), a_p elsewhere."""
        a_p = self.acceptance.rate
        conf = spec.confidence or [None] * len(spec.tokens)
        return tuple(a_p if c is None else self.calibration.rate(c) for c in conf)

    def _candidate(self, i: int, rid: str, hit: Speculation | None, looked_up: bool,
                   fresh: bool) -> Candidate:
        """Sequence i's options: a hit's tokens (free); for a miss the fast backup (free, if
        allowed) and the neural fallback. A new or resynced sequence sends nothing in its
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
            return Candidate(free=self._alphas(hit), cap=cap, fixed=fixed)
        if fresh and not fixed and self.cfg.async_:
            return Candidate(cap=0)
        fast_ok = looked_up and self._fast_allowed(st)
        free = (self.fast_acceptance.rate,) * self.K if fast_ok else ()
        neural = (self.acceptance.rate,) * self.K if not (fast_ok and self.cfg.fallback == "fast") else ()
        return Candidate(free=free, neural=neural, cap=cap, fixed=fixed)

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
        sent) is plain decoding's on the lent cores, the step vLLM then takes and the
        line SD on the lent cores was chosen against. Measured at batch 1 (MT-Bench,
        T = 1): the lent_sd line, fitted on widths 2-4, put width 1 at 34 ms where plain
        steps took 40, so the plan sent nothing in 97% of the lent_sd rounds, each a plain
        step plus the draft's round trip (23.5 tok/s, plain decoding 24.3)."""
        line = self._verify_cost().predict
        if not self._lent_sd or not self.lent_cost.known:
            return line
        plain = self.lent_cost.predict
        return lambda w: plain(w) if w <= batch else line(w)

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
            final.append(Candidate(free=self._source_alphas(specs[i], sources[i]), cap=c.cap,
                                   fixed=fixed))
        return choose_lengths(final, self._verify_s(len(cands)), lambda rows: 0.0,
                              sunk_s=sunk).lengths

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
        if self._ssd_measured_ahead(batch, plain_s):
            return True  # measured ahead: the model that put it behind is overruled
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
            plain = target_alone_rate(last[1], plain_s)
            if lent_sd_worth(gave, continuing=False) > plain:
                self.lent_sd_paid.add(last[1])
                self.lent_sd_ever_paid.add(last[1])
            elif gave < plain:
                self.lent_sd_paid.discard(last[1])
        if self._lent_sd_steps >= 2 and target_s is not None:
            # not the first round after SSD's: measured, 40 ms more than the next ones
            # (the team's first turn on the borrowed cores, the verification's first
            # widths on the lent ones), which alone held SD on the lent cores off
            over = max(0.0, now - last[0] - target_s - self._last_draft_s)
            self.lent_sd_overhead = (over if self.lent_sd_overhead is None
                                     else 0.9 * self.lent_sd_overhead + 0.1 * over)

    def _catch_up_tokens(self, updates: list[Update]) -> int:
        """Tokens the draft must prefill before it can speculate on this batch: those of
        new or resynced sequences beyond the KV it still holds for them."""
        n = 0
        for rid, _, full, _ in updates:
            if full is not None:
                st = self.seqs.get(rid)
                n += len(full) - (_lcp(st.kv_tokens, full) if st is not None else 0)
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
        lent cores, speculation's expected gain must pay that back (catch_up_pays)."""
        ctl = self.cfg.controller
        if (ctl.policy != "auto" or not ctl.idle or ctl.force_lengths is not None
                or not self.target_cost.known or not batch or self._explore > 0):
            return None  # (_explore: trying SD on the lent cores after a close idle)
        plain = self._plain_s() or self.target_cost.predict
        now = time.perf_counter()

        def rate(b: int) -> float:  # the better way to speculate at b
            lent_sd = self._lent_sd_worth(b, now)
            return max(self._ssd_rate(b, now), 0.0 if lent_sd is None else lent_sd)

        limit = batch_limit(rate, plain, max_batch=batch)
        if limit < batch:
            return self._close_idle(limit, batch, plain)
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
                self.stats.catch_up_idles += 1
                return IdleAdvice(batch - 1, probe=False)
        return None

    def _probe_due(self, batch: int, now: float) -> bool:
        """Plain decoding on the lent cores is to be measured at this batch size: never
        measured nor probed, or measured but not probed for LENT_REPROBE_S."""
        if batch not in self._probed:
            return batch not in self.lent_widths or now - self._started > LENT_REPROBE_S
        return now - self._probed[batch] > LENT_REPROBE_S

    def _close_idle(self, limit: int, batch: int, plain_s) -> IdleAdvice:
        """The idle, and when to ask again where it is a close one: SD on the lent cores'
        model puts it within CLOSE_SHARE of plain decoding (what it gave, or the entry
        margin, held it off). Text moves on, and while idle nothing measures it.

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
        of the set while the model still put it at 28.6 tok/s against 26.5."""
        expected = self._lent_sd_rate(batch, time.perf_counter(), measured=False)
        if expected is None or expected < (1.0 - CLOSE_SHARE) * batch / max(plain_s(batch), 1e-9):
            return IdleAdvice(limit, probe=False)
        return IdleAdvice(limit, probe=False,
                          recheck_s=CLOSE_RECHECK_S if batch in self.lent_sd_paid else None,
                          new_text=batch in self.lent_sd_ever_paid)

    def _wake(self, batch: int) -> None:
        """The first step after a close idle (IdleAdvice.recheck_s or new_text): try SD
        on the lent cores for as many steps as its measurement needs (min_rounds), by
        the model alone (its stale measurement forgotten, no entry margin), so that the
        next decision sees the text running now."""
        if self._limit is not None and (self._limit.recheck_s is not None or self._limit.new_text):
            self.lent_sd_realized.forget(batch)
            self._explore, self._explore_batch = self.lent_sd_realized.min_rounds, batch
            self.stats.lent_sd_explores += 1
        elif self._explore > 0:  # another batch size: its own decision
            self._explore = self._explore - 1 if batch == self._explore_batch else 0

    def _any_new(self, updates: list[Update]) -> bool:
        """A new or resynced sequence in the batch (its prompt for the draft to prefill)."""
        return any(full is not None or rid not in self.seqs for rid, _, full, _ in updates)

    def _ssd_measured_ahead(self, batch: int, plain_s) -> bool:
        """SSD measured (RealizedRate.bounds) surely above plain decoding (plain_s: its
        step time, None without lent cores) at this batch size: the plan's model, which
        held it behind, is overruled."""
        b = None if plain_s is None else self.realized.bounds(batch, time.perf_counter())
        return b is not None and b[0] > batch / max(plain_s(batch), 1e-9)

    def _ssd_rate(self, batch: int, now: float) -> float:
        """SSD's rate at this batch size: the model's, clamped to what it was measured
        to give (RealizedRate.clamp; 0 when the regime is pinned to lent_sd)."""
        if self.cfg.controller.regime == "lent_sd" and self.lent_cost is not None:
            return 0.0
        return self.realized.clamp(self._expected_rate(batch), batch, now)

    def _lent_sd_rate(self, batch: int, now: float, measured: bool = True) -> float | None:
        """SD on the lent cores' rate at this batch size (core/theory.py sd_rate with its
        lines, _lent_sd_lines, and the round's overhead, the best K up to the cap),
        clamped to what it was measured to give (RealizedRate.clamp; `measured`, else
        the model's alone). None where it is no option (no lent cores, regime ssd) or not
        known yet (the lent cores or the draft's step not measured)."""
        if (self.lent_cost is None or self.cfg.controller.regime == "ssd"
                or not self.lent_cost.known or not self.draft_cost.known):
            return None
        verify, draft = self._lent_sd_lines()
        a, over = self.acceptance.rate, self.lent_sd_overhead or 0.0
        expected = max((sd_rate(a, k, batch, verify.predict, draft.predict, overhead_s=over)
                        for k in range(1, self._cap + 1)), default=0.0)
        return self.lent_sd_realized.clamp(expected, batch, now) if measured else expected

    def _lent_sd_worth(self, batch: int, now: float) -> float | None:
        """_lent_sd_rate as the choice weighs it: discounted unless the last step was SD
        on the lent cores already (core/controller.py lent_sd_worth)."""
        return lent_sd_worth(self._lent_sd_rate(batch, now),
                             continuing=self._lent_sd_steps > 0 or self._explore > 0)

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
        now = time.perf_counter()
        lent_sd = self._lent_sd_worth(len(updates), now)
        if lent_sd is None or not self.target_cost.known:  # SSD's rounds measure it first
            return False
        return lent_sd_pays(self._ssd_rate(len(updates), now), lent_sd)

    def _expected_rate(self, batch: int) -> float:
        """Tokens per second speculation is expected to give at this batch size."""
        a, t, d = self.acceptance.rate, self.target_cost.predict, self.draft_cost.predict
        ks = range(1, self._cap + 1)
        if not self.cfg.async_:
            return max((sd_rate(a, k, batch, t, d) for k in ks), default=0.0)
        # the backups a miss may get (None: the neural one): config `fallback`
        fast = {"neural": [None], "fast": [self.fast_acceptance.rate],
                "auto": [None, self.fast_acceptance.rate]}[self.cfg.fallback]
        return max((ssd_rate(a, k, self.hit_rate, batch, t, d, a_fast=f) for k in ks for f in fast),
                   default=0.0)

    def _prespeculation_pays(self, batch: int) -> bool:
        """Pre-speculate only what the next step could use: with the fitted a_p, would any
        of the batch's cached tokens be sent? (On CPU an unused pre-speculation still takes
        the memory bus from the target.)"""
        ctl = self.cfg.controller
        if ctl.policy != "auto" or ctl.force_lengths is not None or not self.target_cost.known:
            return True
        plain_s = self._plain_s()
        if self._ssd_measured_ahead(batch, plain_s):
            return True  # measured ahead: the model that put it behind is overruled
        hit = Candidate(free=(self.acceptance.rate,) * self._cap, cap=self._cap)
        return speculation_pays([hit] * batch, self.target_cost.predict, plain_s)

    def _table_lookups(self, updates: list[Update]) -> dict[str, Speculation | None]:
        """The verified outcomes of every sequence whose branches are on the table, matched
        in one op (cache_lookup) before the round's loop reads them."""
        if self.table is None or self.cfg.force_cache_miss or not self.cfg.async_ or self._lent_sd:
            return {}
        queries = [(rid, outcome_from_sampled(sampled)) for rid, sampled, full, _ in updates
                   if full is None and isinstance(getattr(self.seqs.get(rid), "cache", None),
                                                  TableView)]
        return {rid: hit for (rid, _), hit in zip(queries, self.table.lookup(queries))}

    def _note_miss(self, outcome: Outcome, cache, roots, aborted: bool) -> None:
        """Count the miss under its reason (stats.MISS_REASONS)."""
        if cache is None:
            reason = "cut_short" if aborted else "not_started"
        elif any(o.k == outcome.k for o in roots or ()):
            reason = "bonus"
        else:
            reason = "k"
        setattr(self.stats, f"miss_{reason}", getattr(self.stats, f"miss_{reason}") + 1)

    def _wire_q(self, probs: torch.Tensor | None):
        """q over the draft head's tokens as uint16 counts; the target places them in the
        vocabulary by head_ids(). For the channel: the same counts as int16 bit patterns,
        a tensor on the draft's device."""
        if probs is None:
            return None
        if self.channel is not None:
            return counts_int16(probs)
        return wire_counts(probs)

    def _send_q(self, results: list[Result]) -> list[Result]:
        """With a channel: every row's q in one tensor over it (sent before the reply, so
        the target receives it as soon as the reply is in); each row's q in the reply
        becomes the number of its rows there."""
        if self.channel is None:
            return results
        self.channel.wait(self._sending)  # the last round's: long received
        qs = [q for _, _, q in results if q is not None]
        self._sending = self.channel.send([torch.cat(qs)]) if qs else []
        self.stats.channel_sends += bool(qs)
        return [(tokens, flag, None if q is None else q.shape[0]) for tokens, flag, q in results]

    def head_ids(self) -> list[int] | None:
        """The vocabulary ids of the draft head's tokens (None: the whole vocabulary)."""
        return None if self.model.head_ids is None else self.model.head_ids.tolist()

    def drop(self, rid: str) -> None:
        self.seqs.pop(rid, None)
        self.kv.free(rid)

    def release(self, finished: list[str]) -> dict:
        """Forget finished (or preempted) requests now: the batch has emptied, so the
        pre-speculation in flight (for those requests) is cut short first. Returns what
        the worker still holds (get_stats' live fields)."""
        self._abort.set()
        with self._lock:
            for rid in finished:
                self.drop(rid)
        return self.held()

    # ----------------------------------------------------------------- passes
    def _sync(self, rid: str, tokens: list[int], sampling: SamplingSpec) -> None:
        """(Re)start a sequence from the target's tokens, keeping KV of the common prefix."""
        self.stats.syncs += 1
        st = self.seqs.get(rid) or SeqState(tokens=[])
        st.tokens, st.spec, st.cache, st.sampling = list(tokens), None, None, sampling
        st.source = "neural"
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
        draws = _Draws(len(rids))
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
        others = [Candidate(free=self._source_alphas(specs[i], sources[i]), cap=c.cap,
                            fixed=c.fixed) for i, c in enumerate(cands) if i not in rows]
        verify, step_s = self._verify_s(len(cands)), self._draft_cost().predict(len(neural))
        over = (self.lent_sd_overhead or 0.0) if self._lent_sd else 0.0

        def more(drafts: list[Speculation]) -> bool:
            now, nxt = list(others), list(others)
            for i, d in zip(neural, drafts):
                a = self._alphas(d)
                now.append(Candidate(free=a, cap=min(len(a), cands[i].cap)))
                longer = a + a[-1:] if len(a) < cands[i].cap else a
                nxt.append(Candidate(free=longer, cap=min(len(longer), cands[i].cap)))
            spent = time.perf_counter() - t0 + over
            return nxt != now and draft_more_pays(now, nxt, verify, step_s, spent)
        return more

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
        draws = _Draws(len(row_rids))
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
