"""The draft worker: owns the draft model, its paged KV and each sequence's speculation cache.

Round protocol (driven by the target side, see vllm_glue/proposer.py):
  step(updates, finished)  -> next speculation per sequence: a cache hit costs nothing,
                              a miss (or a new / resynced sequence) drafts just in time.
  prespeculate()           -> while the target verifies that speculation: glue pass, fork
                              the likely outcomes, tree-decode K tokens for every branch.
In synchronous mode (``async: false``) prespeculate is never called: plain SD.
The class is plain Python; draft/process_actor.py runs it in a process of its own (CPU),
draft/ray_actor.py as a Ray actor (GPU), each on a device of its own.

This file holds the round itself (step: commit the outcomes, look the next speculation
up, draft the misses, reply) and what the outcomes teach. Its parts, one per file:
  regime.py          how this round speculates: SSD, SD on the lent cores, or idle
  lengths.py         each sequence's length 0..K and who drafts a miss (the controller)
  drafting.py        the fallback's drafting and the draw, the draft's KV around them
  prespeculation.py  glue pass, fork, tree decode (the paper's three steps)
  state.py           what is held per sequence; the protocol's messages
"""
from __future__ import annotations

import itertools
import os
import signal
import threading
import time

import torch

from vllm_saguaro.config import SaguaroConfig
from vllm_saguaro.core.cache import Speculation
from vllm_saguaro.core.controller import Candidate, RealizedRate, StepCost, choose_lengths
from vllm_saguaro.core.fallback import MatchAcceptance
from vllm_saguaro.core.fanout import BudgetControl, SplitAcceptanceFit, fanout_for
from vllm_saguaro.core.outcome import Outcome, is_consistent, outcome_from_sampled
from vllm_saguaro.core.placement import omp_env, process_threads
from vllm_saguaro.core.sampling import SamplingSpec, counts_int16, wire_counts
from vllm_saguaro.core.selection import AcceptanceCalibration
from vllm_saguaro.draft.drafting import PREFILL_S_PER_TOKEN, Drafting, lcp
from vllm_saguaro.draft.kv import PagedKVCache
from vllm_saguaro.draft.lengths import LengthPlanning
from vllm_saguaro.draft.linear import fp16_supported
from vllm_saguaro.draft.model import DraftModel, check_draft_vocabulary
from vllm_saguaro.draft.prespeculation import Prespeculation
from vllm_saguaro.draft.regime import SSD_EXPLORE_S, IdleAdvice, RegimeChoice
from vllm_saguaro.draft.speculation_table import SpeculationTable, TableView
from vllm_saguaro.draft.state import Result, SeqState, TargetStep, Update
from vllm_saguaro.draft.stats import DraftStats
from vllm_saguaro.draft.team import DraftTeam

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


# Rows a round whose fast-backup draft is made but not sent, to measure its acceptance
# where it does not draft (SeqState.shadow_fast): ~0.05-0.15 ms each on the step's critical path
SHADOW_ROWS = 4


def draft_weights(cfg: SaguaroConfig, device: torch.device, dtype: str) -> str:
    """The draft's linear layers (draft/linear.py): fp16 weights where they pay, a float32
    draft on a CPU with fbgemm; 'none' = in the draft's dtype."""
    if cfg.draft_weights == "fp16":
        return "fp16"
    auto = cfg.draft_weights == "auto" and device.type == "cpu" and dtype == "float32"
    return "fp16" if auto and fp16_supported() else "none"


class DraftWorker(RegimeChoice, LengthPlanning, Drafting, Prespeculation):
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
        self.acceptance = SplitAcceptanceFit(cfg.fanout.acceptance_rate)  # greedy / sampled
        self._greedy_rows: list[bool] = []  # this step's rows: greedy or sampled
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
        # what SSD gave, round to round; kept SSD_EXPLORE_S after its last round (then
        # explored again where SD on the lent cores runs instead: regime.py). Measured
        # with the default two minutes, at batch 1: what SSD gave as the HumanEval
        # prompts ended (22.7 tok/s) stood for the rest of the run, and the choice
        # weighed it against what SD on the lent cores gave on the prompts after them
        self.realized = RealizedRate(alpha=0.05, ttl_s=SSD_EXPLORE_S)
        # and SD on the lent cores, over more rounds: it is weighed against plain decoding
        # on the same cores, 0-25% apart at batch 1, and its first rounds on an engine ran
        # ~25% slower than later ones (measured: 25.7 tok/s over the first 24 rounds, 32
        # over the first 48, plain decoding 25); kept for 30 s only (the idle recheck), so
        # that a low first measurement does not idle it for the default two minutes. Over
        # ~100 rounds (alpha 0.02): over ~40 (0.05), one HumanEval prompt whose drafts
        # were rejected for a few dozen rounds idled it where it gave 1.10x plain
        # decoding over the set (measured at batch 1: 26.3 tok/s against 26.2, then
        # 28.9 against 26.3 with 0.02). 48 rows (rounds x batch), not 48 rounds: at batch
        # 4 (T = 1) a first batch ran it in every round (~40) unmeasured, 0.84x plain
        # vLLM, where 12 rounds showed it below plain decoding (issue 19's twentieth round)
        self.lent_sd_realized = RealizedRate(min_rounds=8, ttl_s=30.0, alpha=0.02,
                                             min_rows=48)
        self._lent_sd = False  # this step is SD on the lent cores (controller.regime)
        # (when, batch, lent_sd) of the last step
        self._last_call: tuple[float, int, bool] | None = None
        self._last_draft_s = 0.0  # the last step's neural drafting (the fallback's steps)
        self._lent_sd_steps = 0  # lent_sd steps in a row, up to the last one
        # batch sizes where SD on the lent cores gave more than plain decoding (over
        # min_rounds rounds), so that a close idle there is tried again (_close_idle);
        # and where it ever did (a close idle there ends on new text)
        self.lent_sd_paid: set[int] = set()
        self.lent_sd_ever_paid: set[int] = set()
        # steps left that try SD on the lent cores after a close idle, at this batch size;
        # per batch size, a try since the last close idle there that has not paid, and
        # how many such tries in a row did not (regime.py LENT_TRY_BACKOFF_S)
        self._explore, self._explore_batch = 0, 0
        self._lent_sd_tried: set[int] = set()
        self._lent_sd_unpaid_tries: dict[int, int] = {}
        # an exploration of SSD (regime.py SSD_EXPLORE_ROUNDS): this step is one, the
        # steps left after it and its batch size, when one last started per batch size
        self._exploring_ssd = self._ssd_explore_ended = False  # (and it ended last step)
        self._ssd_explore, self._ssd_explore_batch = 0, 0
        self._ssd_explored: dict[int, float] = {}
        # per batch size, explorations in a row after which SSD was not chosen
        # (regime.py SSD_EXPLORE_BACKOFF_MAX)
        self._ssd_lost: dict[int, int] = {}
        # the last step was SSD's only for a new sequence's glue pass, where SD on the
        # lent cores ran before it (regime.py _lent_sd_continues)
        self._glue_detour = False
        # an idle at this batch size tries SSD on waking, its model against the idle's
        # rate then; the exploration now running's (None: not a try from an idle); per
        # batch size, the model at the last try that SSD lost there, and when (regime.py
        # SSD_RETRY_RISE)
        self._ssd_try: tuple[int, float] | None = None
        self._ssd_explore_tried: float | None = None
        self._ssd_try_lost: dict[int, tuple[float, float]] = {}
        # steps in a row that were SSD's on continuing sequences (not idle, not lent_sd,
        # none new), up to the last one: the realized rate measures SSD from the second
        # on (the first after a switch or a new request is a cold miss: measured at
        # batch 1, SSD's rounds after new requests put it at 13.4 tok/s, plain decoding 21)
        self._ssd_steps = 0
        # the last call sent a new or resynced sequence into a pre-speculation: the
        # target's step that ran beside its glue pass (the prompt's prefill on the
        # draft's cores) is no measure of the target's own cost. Measured at batch 1
        # (HumanEval, T = 0): under SD on the lent cores these steps were the only ones
        # on the target's own cores, and put its line at 52-65 ms a step at width 1,
        # where SSD's steady steps took 38-42 (and SSD's model gave it 23-27 tok/s
        # where SSD pinned ran 46: plain decoding 31, auto 34)
        self._beside_prefill = False
        # what a round of SD on the lent cores costs beyond the target's step and the
        # draft's forwards (this worker's own work around them, the round trip, the
        # proposer), an average
        self.lent_sd_overhead: float | None = None
        self.fast_acceptance = MatchAcceptance()  # by match length (core/fallback.py)
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
            # The first lent_sd step of a run is not measured: its verification and the
            # borrowed team's draft step run ~40 ms slower than the next ones (the team's
            # first turn on the borrowed cores, the verification's first widths on the
            # lent ones). Traced at batch 1: that one measurement put SD on the lent
            # cores' model at 21 tok/s (33 before it), below plain decoding's 23, and the
            # draft idled for the rest of the engine's run, where other starts ran it at
            # 1.05-1.1x plain decoding. (_lent_sd_steps is still the last call's here: 1
            # = it began a run.)
            first_lent_sd = self._lent_sd_steps == 1
            for width, seconds, lent, *drafted in target_steps:
                if not lent:
                    if not self._beside_prefill:  # (see __init__)
                        self.target_cost.observe(width, seconds)
                elif drafted and drafted[0]:
                    if self.lent_sd_cost is not None and not first_lent_sd:
                        self.lent_sd_cost.observe(width, seconds)
                elif self.lent_cost is not None and not self._lent_sd:
                    # plain decoding on the lent cores: a step while the draft idles, not
                    # one of a lent_sd round that sent nothing (self._lent_sd is still the
                    # last call's), which follows the draft's turn on the target's cores.
                    # Measured at batch 1 (T = 1): with those, plain decoding's line said
                    # 24-27 tok/s where plain vLLM ran 27.5-30.7, and SD on the lent cores
                    # at 24-26 was tried again and again (0.79-0.87x plain vLLM)
                    self.lent_cost.observe(width, seconds)
                    self.lent_widths.add(width)
            self._cap = self.K if k_cap is None else max(0, min(self.K, k_cap))
            self._see_text(updates)
            self._see_sampling(updates)
            self._observe_round(updates, t0, target_steps[-1][1] if target_steps else None)
            self._wake(len(updates))
            # an exploration of SSD (regime.py SSD_EXPLORE_ROUNDS) goes on, or starts
            # where SD on the lent cores is chosen
            explored = self._exploring_ssd
            self._exploring_ssd = self._ssd_exploration_goes_on(len(updates))
            self._ssd_explore_ended = explored and not self._exploring_ssd
            self._limit = (None if self._exploring_ssd else
                           self._idle_limit(len(updates), self._catch_up_tokens(updates)))
            self._lent_sd = (not self._exploring_ssd and self._limit is None
                             and self._lent_sd_step(updates))
            if self._lent_sd and self._ssd_explore_due(len(updates)):
                self._lent_sd, self._exploring_ssd = False, True
            if self._ssd_explore_ended:
                self._after_ssd_exploration(len(updates))
            ssd, new = self._limit is None and not self._lent_sd, self._any_new(updates)
            self._glue_detour = (ssd and new and not self._exploring_ssd
                                 and self.cfg.controller.regime == "auto"
                                 and self._lent_sd_continues())
            self.stats.lent_sd_steps += self._lent_sd
            self._lent_sd_steps = self._lent_sd_steps + 1 if self._lent_sd else 0
            steady = ssd and not new
            # the target's next step runs beside this call's pre-speculation, which
            # prefills a new prompt (its glue pass): not one of the target's own cost
            self._beside_prefill = ssd and new
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
                specs[i], sources[i] = Speculation(list(self._fast_draft(st).tokens)), "fast"
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
            # a prefill would inflate the step's time, as would the borrowed team's first
            # turn (the first lent_sd step of a run: see step())
            if not fresh & set(neural) and not (self._lent_sd and self._lent_sd_steps == 1):
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
            st.shadow_fast = (self._fast_draft(st) if st.source != "fast"
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
        st.fast_acceptance_rate = self.fast_acceptance.overall

    def _observe_outcome(self, st: SeqState, sampled: list[int]) -> None:
        """What the verified outcome teaches: the calibration, a_p, the fast backup's rate
        (also from its draft not sent: SeqState.shadow_fast)."""
        self.stats.note_outcome(st.source, len(sampled))
        if st.shadow_fast is not None:
            # the outcome shows the target's tokens up to its bonus: a shadow token judged
            # wrong there is a rejection, one past them is not judged (as in AcceptanceFit)
            shadow = st.shadow_fast
            m = lcp(shadow.tokens, sampled)
            judged = m + 1 if m < min(len(sampled), len(shadow.tokens)) else m
            self.fast_acceptance.observe(shadow.n, m, judged, st.sampling.greedy)
            self.stats.fast_shadowed += 1
            st.shadow_fast = None
        if not st.spec:
            return
        if st.confidence is not None:
            self.calibration.observe(st.confidence, len(sampled) - 1)
        if st.source == "fast":
            self.fast_acceptance.observe(st.fast.n, len(sampled) - 1, len(st.spec),
                                         st.sampling.greedy)
        else:
            self.acceptance.observe(len(sampled) - 1, len(st.spec), st.sampling.greedy)

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















