"""Target-side client of the draft worker: outcomes out, speculations in.

vLLM builds it as a ``custom_class`` drafter; patches.py routes the runner's draft call to
``propose_round`` so that it sees request ids and finished requests. The only wait on the
draft is at the top of each round (for the pre-speculation of the round just verified
and then the lookup); that wait is measured. So is the target's side of each round (from
the drafts returned to the next call), which the draft's controller weighs against what
speculation gains. While the controller finds that speculation cannot pay at the batch
size running, the draft is not called at all: the rounds are plain decoding.
"""
from __future__ import annotations

import logging
import os
import time
import weakref
from dataclasses import dataclass

import torch

from vllm_saguaro.config import SaguaroConfig
from vllm_saguaro.core.controller import may_idle
from vllm_saguaro.core.fallback import FastDraft, LookupWatch, ngram_match
from vllm_saguaro.core.idle_lookup import IdleLookup
from vllm_saguaro.core.outcome import is_consistent
from vllm_saguaro.core.placement import process_threads
from vllm_saguaro.core.sampling import SamplingSpec, unpack_counts
from vllm_saguaro.draft.model import check_draft_vocabulary
from vllm_saguaro.core.supervision import RestartPolicy, describe
from vllm_saguaro.vllm_glue.metrics import SaguaroMetrics
from vllm_saguaro.vllm_glue.supervisor import DraftSupervisor, DraftUnavailable

logger = logging.getLogger("vllm_saguaro")


@dataclass
class _Mirror:
    """What the draft worker holds for a request, so mismatches are caught here."""

    num_tokens: int
    spec: list[int]


_cores_before_binding: set[int] | None = None

# While idle, ask the draft again after this long (its acceptance, the target's costs may
# have moved; sooner where its IdleAdvice says so), or as soon as the batch shrinks to
# where speculation could pay.
IDLE_RECHECK_S = 30.0
# The target's steps sent to the draft's controller with each call: the last this many.
STEPS_SENT = 8
# A probe of plain decoding on the lent cores (the draft worker's IdleAdvice): this many
# idle rounds, of which the last STEPS_SENT are measured. The first steps after the team
# grows run slower than later ones (measured at batch 4 on a 2-core Xeon: plain decoding
# on the lent cores put at 52.6 tok/s from an 8-round probe, 61-65 once later steps
# came in, plain vLLM 59-62), and a low line for plain decoding made SD on the lent cores
# look ahead of it where it was not.
PROBE_ROUNDS = 2 * STEPS_SENT
# After an idle that the text's lookup matches ended (IdleAdvice.wake_share), the next
# idles watch them only after this long: the draft, woken, may find speculation does
# not pay after all (its catch-up, its own measures), and each wake resyncs the batch.
LOOKUP_REWAKE_S = 10.0
LOOKUP_ROWS = 4  # rows a step whose text the idle's LookupWatch looks at
# An idle does not end because the batch shrank while no request waits and every row of
# the batch has fewer tokens left than this: the draft, woken, first catches up every
# row's sequence on its cores, and the cores lent to the target go back, for a few steps
# of speculation at most (a recheck still ends it: at batch 1 a few steps of SD can
# repay its catch-up of one sequence). Traced at batch 4 (MT-Bench,
# T = 0; issue 19's twenty-third round): rows that finished a step or three apart
# shrank the batch to 3 and 2 rows with 0-3 tokens left, and the draft was woken 2-3
# times a batch of prompts, each a round of catching up; those batches ran 0.90-1.00x
# plain decoding (0.938 over the cell).
WAKE_MIN_LEFT = 16


def channel_backend(cfg: SaguaroConfig, target_device) -> str | None:
    """The TensorChannel's backend for q, or None for Ray's reply (config 'transport')."""
    transport = cfg.transport
    on_gpu = cfg.draft_device.startswith("cuda")
    if transport == "auto":
        transport = "channel" if on_gpu else "ray"
    if transport == "ray":
        return None
    return "nccl" if on_gpu and str(target_device).startswith("cuda") else "gloo"


def draft_runtime(cfg: SaguaroConfig):
    """What runs the draft worker (config 'draft_runtime'): a child process on CPU, where
    an idle Ray cluster beside the target cost plain decoding 2-3%; Ray for a GPU draft."""
    name = cfg.draft_runtime
    if name == "auto":
        name = "process" if cfg.draft_device == "cpu" else "ray"
    if name == "process":
        from vllm_saguaro.draft.process_actor import ProcessRuntime

        return ProcessRuntime
    from vllm_saguaro.draft.ray_actor import RayRuntime

    return RayRuntime


def payload_bytes(updates: list, results: list) -> int:
    """What a round moves between target and draft: 4 bytes a token id (outcomes out,
    resync prompts out, drafts back), a byte a hit flag, q's uint16 counts back."""
    out = sum(4 * len(u[1] if u[1] is not None else u[2]) for u in updates)
    back = sum(4 * len(tokens) + 1 + (0 if q is None else q.nbytes) for tokens, _, q in results)
    return out + back


def process_cores() -> set[int]:
    """The cores this process may use, as it had them before an in-process engine's
    binding narrowed its main thread (so a second engine plans from the same cores)."""
    return set(_cores_before_binding or os.sched_getaffinity(0))


def bind_in_process_target(draft: list[int]) -> None:
    """An in-process engine (vLLM's single-process executor) is bound by nobody: plain vLLM
    runs it on one unbound thread. Keep that thread off the draft's cores."""
    global _cores_before_binding
    cores = process_cores() - set(draft)
    if cores and set(os.sched_getaffinity(0)) != cores:
        _cores_before_binding = process_cores()
        os.sched_setaffinity(0, cores)
        torch._C.set_num_threads(len(cores))  # vLLM's CPU worker stubs torch.set_num_threads
        logger.info("Saguaro: in-process engine, target thread bound to cores %s", sorted(cores))


def check_target_placement(draft: list[int], lent: bool = False) -> None:
    """Multiprocess engines: vLLM bound this worker's threads (patches.patch_omp_binding);
    say so once if they can still reach the draft's cores (VLLM_CPU_OMP_THREADS_BIND=nobind).
    Not where the draft's cores are lent (lending.py): the target's team has a thread
    there by design, and the warning stood in every such engine's log."""
    if lent:
        return
    shared = sorted({c for t in process_threads() for c in t.cores} & set(draft))
    if shared:
        logger.warning("Saguaro: target threads may run on the draft's cores %s (target not "
                       "bound by vLLM); expect both to slow down", shared)


def check_draft_gpu(cfg: SaguaroConfig, target_device) -> None:
    """cuda:N counts in the target process's visible devices (CUDA_VISIBLE_DEVICES)."""
    dev = torch.device(target_device)
    if dev.type != "cuda":
        return
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if cfg.draft_device == f"cuda:{index}":
        raise ValueError(
            f"draft_device {cfg.draft_device} is the target's own device; SSD needs the draft "
            "on a device of its own (another GPU)")


class SaguaroProposer:
    def __init__(self, vllm_config):
        extra = vllm_config.additional_config or {}
        if "saguaro" not in extra:
            raise ValueError("SaguaroProposer needs additional_config['saguaro']; use "
                             "speculative_config with method 'saguaro'")
        self.cfg = SaguaroConfig.model_validate(extra["saguaro"])
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.target_device = getattr(vllm_config.device_config, "device", "cpu")
        # vLLM's single-process executor: the target runs in the user's own process
        self.in_process = vllm_config.parallel_config.distributed_executor_backend == "uni"
        self.supervisor: DraftSupervisor | None = None  # the draft worker, kept alive
        self.pending = None          # ObjectRef of the last pre-speculation
        self.head_ids = None         # the draft head's vocabulary ids (q's columns)
        self.mirror: dict[str, _Mirror] = {}
        self.metrics = SaguaroMetrics(self.cfg.log_stats_interval_s)
        # measured since the last call: (width, seconds, lent, with draft tokens)
        self.target_steps: list[tuple[int, float, bool, bool]] = []
        self._drafted = False  # the next target step verifies draft tokens
        self._looked_up = False  # ... the idle's own lookup drafts (_look_up)
        self._width: int | None = None    # tokens the last round verified (None: not clean)
        self._last_done: float | None = None
        self._prev_ids: set[str] = set()  # the batch's requests at the last call
        self.idle_above: int | None = None  # the draft idles while the batch is larger
        self._idle_since = 0.0
        self._recheck_s = IDLE_RECHECK_S  # this idle's (IdleAdvice.recheck_s)
        # IdleAdvice.new_text: the requests of the batch when this idle began (it ends
        # once none of them is left), else None
        self._idle_ids: set[str] | None = None
        self._probe_rounds: int | None = None  # idle rounds left in a probe (None: no probe)
        # IdleAdvice.wake_share: this idle ends once the text shows it (LookupWatch)
        self._wake_share: float | None = None
        self._lookup: LookupWatch | None = None
        # IdleAdvice.lookup: this idle's own prompt lookup drafts (None: it sends nothing)
        self._idle_lookup: IdleLookup | None = None
        self._lookup_before: IdleLookup | None = None  # the latest idle's: the next goes on from it
        self._lookup_woke = float("-inf")  # when an idle last ended so (monotonic)
        # requests finished or preempted that the draft worker has not been told of yet
        self._gone: set[str] = set()
        self.lending = None  # CoreLending: the draft's cores for the target while it idles
        # the last round was SD on the lent cores (the worker's regime): the team stays
        # whole while the draft drafts, since the target only waits meanwhile
        self.lent_sd = False
        self.channel = None  # TensorChannel for q (transport 'channel'), rank 0
        self.channel_backend = channel_backend(self.cfg, self.target_device)
        self.paused = False  # pause(): plain decoding, the draft idle, until resumed

    # vLLM calls this once the target is loaded; the draft starts then, on its own device.
    def load_model(self, target_model=None) -> None:
        cfg = self.cfg.model_copy()
        check_draft_vocabulary(cfg.draft_model, self.vocab_size)  # here, not in the actor
        if cfg.draft_device == "cpu":
            if not cfg.draft_cpu_cores:  # config not made by the plugin's engine-args hook
                raise RuntimeError("Saguaro: the draft's CPU cores were not chosen; start "
                                   "the engine with speculative_config method 'saguaro'")
            if self.in_process:
                bind_in_process_target(cfg.draft_cpu_cores)
            ctl = cfg.controller
            if (ctl.lend_cores and not self.in_process
                    and may_idle(ctl.policy, ctl.idle, cfg.num_speculative_tokens_per_batch_size)):
                from vllm_saguaro.vllm_glue.lending import CoreLending, lending_binding

                if lending_binding(cfg.draft_cpu_cores):
                    self.lending = CoreLending(cfg.draft_cpu_cores)
                    if target_model is not None:
                        from vllm_saguaro.vllm_glue.patches import patch_lent_gemms

                        patch_lent_gemms(target_model, self.lending)
            if self.lending is None:  # the draft's controller must not count on it
                cfg.controller = cfg.controller.model_copy(update={"lend_cores": False})
                from vllm_saguaro.vllm_glue.lending import keep_off_the_draft_cores

                keep_off_the_draft_cores()
            if not self.in_process:
                check_target_placement(cfg.draft_cpu_cores, lent=self.lending is not None)
        else:
            check_draft_gpu(cfg, self.target_device)
        sup = cfg.supervision
        policy = RestartPolicy(floor_s=sup.timeout_s, factor=sup.timeout_factor,
                               base_s=sup.restart_s, max_s=sup.restart_max_s)
        worker_config = cfg.to_json_dict()
        runtime = draft_runtime(cfg)
        # in lent_sd rounds the draft borrows the target's cores in turn (the target waits)
        borrow = (self.lending.target_cores
                  if self.lending is not None and cfg.controller.regime != "ssd" else [])
        self.supervisor = DraftSupervisor(
            lambda incarnation: runtime.start(worker_config, self.vocab_size, incarnation,
                                              borrow=borrow),
            runtime, policy, on_event=self.metrics.record_draft_event)
        self.supervisor.start()  # surface load errors (bad checkpoint, vocab) now
        self._connect_channel()
        # where q's columns go in the vocabulary
        head = self.supervisor.get(self.actor.head_ids.remote(), "head_ids")
        self.head_ids = None if head is None else torch.tensor(head, dtype=torch.long)
        weakref.finalize(self, self.supervisor.shutdown)
        logger.info("Saguaro draft worker ready (%s, cores %s, %s, K=%d, fan-out %s, async=%s)",
                    cfg.draft_device, cfg.draft_cpu_cores, runtime.name,
                    cfg.num_speculative_tokens, cfg.fanout.policy, cfg.async_)

    @property
    def actor(self):
        """The draft worker's handle now (None while it is down)."""
        return self.supervisor.actor if self.supervisor is not None else None

    def pause(self, paused: bool = True) -> None:
        """Speculation off (paused) or back on, from the next step, without a restart.
        Paused, every round sends nothing and the draft idles with its cores lent, as in
        an idle the controller chose, but with no prompt lookup drafts and no recheck:
        plain decoding under the plugin. Resumed, the controller decides again and the
        draft re-prefills what the batch holds, as after any idle. For an operator
        (``LLM.collective_rpc("saguaro_pause", args=(True,))``) and for measuring
        speculation against plain decoding within one engine start
        (benchmarks/paired.py): on these CPUs one start's speed differs from the next
        by ~5% (up to 25%), more than the differences to be measured."""
        self.paused = paused

    def propose(self, *args, **kwargs):
        raise RuntimeError("vllm-saguaro's runner patch is not active: was the plugin loaded?")

    def propose_round(self, req_ids: list[str], num_tokens, token_ids_cpu,
                      sampled_token_ids: list[list[int]], finished: set[str],
                      sampling_of, k_cap: int | None = None, left: list[int] | None = None
                      ) -> tuple[list[list[int]], torch.Tensor | None]:
        """One round: send each request's outcome (or its tokens on a resync), get drafts
        of 0..K tokens per row.

        Returns the drafts per row and, when any request samples, the draft distributions
        q [rows, K, V] the verifier must use (one-hot rows for greedy requests, which the
        rejection sampler verifies by argmax anyway; rows past a draft's length unused).
        sampling_of(req_id) gives a new request's SamplingSpec; k_cap: the most tokens a
        row may send this step (vLLM's num_speculative_tokens_per_batch_size); left: the
        tokens each row has left where no request waits (None: some do, or unknown),
        for the controller's 'span' objective (core/span.py).
        """
        if self.supervisor is None:
            self.load_model()
        start = time.perf_counter()
        # the target's last step, for the controller's cost model: a decode step only (a
        # request that joined the batch had its prefill in it), not after an idle gap
        joined = bool(set(req_ids) - self._prev_ids)
        self._prev_ids = set(req_ids)
        step = None
        if (self._width is not None and not joined and self._last_done is not None
                and start - self._last_done < 5.0):
            lent = self.lending is not None and self.lending.lent
            step = (self._width, start - self._last_done, lent, self._drafted)
            if not self._looked_up:
                # (a verification of the idle's lookup drafts is the IdleLookup's alone:
                # the worker's would take it for one of SD on the lent cores, whose
                # verifications follow the draft's turn on the target's cores. Traced at
                # batch 4 (HumanEval, T = 0), that line put a width-8 verification at
                # 78 ms where these took 39-64 ms at widths 5-11)
                self.target_steps = (self.target_steps + [step])[-STEPS_SENT:]
        decoding = sum(1 for s in sampled_token_ids if s)
        self._width = None
        k = self.cfg.num_speculative_tokens
        cap = k if k_cap is None else min(k_cap, k)  # the most tokens a row may send
        looked_up = self._look_up(req_ids, num_tokens, token_ids_cpu, sampled_token_ids,
                                  sampling_of, cap, step)
        # a batch arriving: requests joined, and the draft holds none of the batch's yet
        arriving = joined and not any(rid in self.mirror for rid in req_ids)
        woken = self._watch_lookup(sampled_token_ids, num_tokens, token_ids_cpu,
                                   None if looked_up is None else looked_up[0])
        if self._idle(req_ids, decoding, finished, arriving, woken, left):
            drafts = [[] for _ in req_ids]
            if self._idle_lookup is not None and looked_up is not None:
                made, greedy = looked_up
                span = (left if left is not None and self.cfg.controller.objective == "span"
                        else None)
                if span is not None:
                    self.metrics.record_drain_round()
                lengths = self._idle_lookup.lengths(
                    req_ids, [None if d is None else d.n for d in made], greedy, cap, span)
                drafts = [d.tokens[:n] if n else [] for d, n in zip(made, lengths)]
            self._width = (decoding + sum(map(len, drafts))) if decoding == len(req_ids) else None
            self._drafted = self._looked_up = any(drafts)
            self.metrics.record_idle_round([len(d) for d, s in zip(drafts, sampled_token_ids) if s])
            self._last_done = time.perf_counter()
            self.metrics.round_done(self._last_done)
            # no q: a lookup draft is drawn from no distribution but itself, and the
            # verifier takes a token without q as drawn one-hot (vLLM's ngram drafts; on
            # CPU core/verification.py), so a sampled row's tokens are accepted with p
            return drafts, None
        finished = finished | self._gone
        self._gone = set()
        if not self.supervisor.available():  # failed; a new worker may be starting
            return self._plain_round(len(req_ids), decoding)
        if self.supervisor.resync:  # a new worker knows no sequence: all re-prefill
            self.supervisor.resync = False
            self.mirror.clear()
            self.pending = None
            finished = set()
            try:
                self._connect_channel()
            except DraftUnavailable:
                return self._plain_round(len(req_ids), decoding)
        for rid in finished:
            self.mirror.pop(rid, None)
        updates, rows = [], []
        for row, (rid, sampled) in enumerate(zip(req_ids, sampled_token_ids)):
            if not sampled:  # still prefilling, or nothing to continue from
                continue
            n = int(num_tokens[row])
            m = self.mirror.get(rid)
            if m is not None and m.num_tokens + len(sampled) == n and is_consistent(sampled, m.spec):
                updates.append((rid, list(sampled), None, None))
            else:  # new, preempted-and-resumed, or out of step: the draft re-prefills
                spec = sampling_of(rid) if self.cfg.draft_sampling == "saguaro" else SamplingSpec()
                updates.append((rid, None, token_ids_cpu[row, :n].tolist(), tuple(spec)))
            rows.append((row, rid, n))
        drafts: list[list[int]] = [[] for _ in req_ids]
        # a new or resynced sequence makes the round SSD's (DraftWorker._lent_sd_step)
        keep_lent = self.lent_sd and all(u[2] is None for u in updates)
        if (updates or finished) and self.lending is not None and not keep_lent:
            self.lending.give_back()  # lent while the batch was empty: the draft runs now
        t0 = time.perf_counter()
        try:
            if self.pending is not None:  # the last pre-speculation: surface its failure
                if self.supervisor.ready(self.pending):
                    pending, self.pending = self.pending, None
                    self.supervisor.get(pending, "pre-speculation")
            prefill = sum(len(u[2]) for u in updates if u[2] is not None)
            results, waited, computed, limit, lent_sd = self.supervisor.get(
                self.actor.step.remote(updates, sorted(finished), self.target_steps, k_cap),
                "step", prefill) if (updates or finished) else ([], 0.0, 0.0, None, False)
            results = self._receive_q(results)
        except DraftUnavailable:  # this round decodes plainly; nothing unverified is kept
            self.mirror.clear()
            self.pending = None
            return self._plain_round(len(req_ids), decoding)
        self.target_steps = []
        t1 = time.perf_counter()
        for (row, rid, n), (tokens, _, _) in zip(rows, results):
            drafts[row] = tokens
            self.mirror[rid] = _Mirror(n, tokens)
        self.lent_sd = lent_sd and self.lending is not None
        if limit is not None:
            self.idle_above, self._idle_since = limit.limit, time.monotonic()
            self._recheck_s = limit.recheck_s or IDLE_RECHECK_S
            self._idle_ids = set(req_ids) if limit.new_text else None
            self._probe_rounds = PROBE_ROUNDS if limit.probe else None
            self._wake_share = limit.wake_share
            self._lookup = LookupWatch() if limit.wake_share is not None else None
            if limit.lookup is not None:  # (what the last idle's measured goes on)
                self._idle_lookup = self._lookup_before = IdleLookup(
                    limit.lookup, before=self._lookup_before)
            else:
                self._idle_lookup = None
            if self.lending is not None:
                self.lending.lend()
        elif self.lent_sd:  # the target verifies on every core; nothing to pre-speculate
            self.lending.lend()
        elif self.cfg.async_ and rows:
            if self.lending is not None:  # still lent if the last round was lent_sd's
                self.lending.give_back()
            self.pending = self.actor.prespeculate.remote()
        probs = self._draft_probs(len(req_ids), rows, results)
        t2 = time.perf_counter()
        if rows:
            # the target's side before a round with a new sequence was its prefill
            fresh = any(u[1] is None for u in updates)
            self.metrics.record_round([flag for _, flag, _ in results], waited, t1 - t0 - waited,
                                      draft_s=computed, unpack_s=t2 - t1,
                                      started=None if fresh else t0,
                                      lengths=[len(tokens) for tokens, _, _ in results],
                                      transfer_bytes=payload_bytes(updates, results),
                                      lent_sd=self.lent_sd)
        # the next target step is clean (decode only) when no row is still prefilling
        if rows and len(rows) == len(req_ids):
            self._width = sum(1 + len(d) for d in drafts)
            self._drafted, self._looked_up = any(drafts), False
        self._last_done = time.perf_counter()
        self.metrics.round_done(self._last_done)
        return drafts, probs

    def note_gone(self, req_ids) -> None:
        """Requests the scheduler finished or preempted: the worker frees their state with
        the next step. Noted on every runner step (vLLM skips the drafter on some, e.g. when
        a request of the batch is within K tokens of max_model_len), so none is lost."""
        self._gone |= set(req_ids)

    def release(self) -> dict:
        """The batch has emptied (a step that schedules nothing, on which the runner calls
        no drafter): the worker frees every gone request now rather than when the next
        request comes. Returns what it still holds (DraftWorker.release)."""
        gone, self._gone = self._gone, set()
        for rid in gone:
            self.mirror.pop(rid, None)
        held = {}
        if gone and self.supervisor is not None and self.supervisor.up:
            try:
                held = self.supervisor.get(self.actor.release.remote(sorted(gone)), "release")
                self.metrics.record_draft_held(held)
            except DraftUnavailable:
                pass  # nothing held to report; the batch is empty all the same
        self._lend_while_quiet()
        return held

    def _lend_while_quiet(self) -> bool:
        """Lend the draft's cores for the next steps if nothing runs on them (no
        pre-speculation still going); whether they are lent. Called when the batch empties:
        the next steps are the prefills of requests yet to come, which the draft has no
        part in (it hears of a request once the target sampled its first token); the
        draft's next call takes the cores back. Measured before: each batch of the
        benchmark began with its first prefill on the target's core alone (288 tokens,
        751 ms on one thread), the draft having been woken by the batch's last, shrinking
        rounds."""
        if self.lending is None:
            return False
        if not self.lending.lent and self.pending is not None:
            if not self.supervisor.ready(self.pending):
                return False
        self.lending.lend()
        return True

    def _plain_round(self, rows: int, decoding: int) -> tuple[list[list[int]], None]:
        """A round without the draft worker (it failed): every row sends nothing."""
        self.target_steps = []
        self.metrics.record_down_round(decoding)
        self._last_done = time.perf_counter()
        self.metrics.round_done(self._last_done)
        return [[] for _ in range(rows)], None

    def _look_up(self, req_ids, num_tokens, token_ids_cpu, sampled_token_ids, sampling_of,
                 cap: int, step) -> tuple[list[FastDraft | None], list[bool]] | None:
        """While idle with prompt lookup of its own (IdleAdvice.lookup): what the last
        step measured and accepted goes into the IdleLookup, and each decoding row gets
        its lookup draft of `cap` tokens (None: the row may send nothing: still
        prefilling, or a seeded request, whose drafts must not depend on timing), and
        whether its request is greedy. ~0.03 ms a row at 2k tokens. None: no lookup this
        idle."""
        look = self._idle_lookup
        if look is None or self.idle_above is None or cap <= 0 or self.paused:
            return None
        if step is not None:
            look.observe_step(step[0], step[1], step[3])
        made: list[FastDraft | None] = []
        greedy: list[bool] = []
        for row, (rid, sampled) in enumerate(zip(req_ids, sampled_token_ids)):
            look.observe_outcome(rid, sampled)
            spec = sampling_of(rid)
            greedy.append(spec.greedy)
            if not sampled or spec.seeded:
                made.append(None)
            else:
                made.append(ngram_match(token_ids_cpu[row, :int(num_tokens[row])].tolist(), cap))
        return made, greedy

    def _watch_lookup(self, sampled_token_ids, num_tokens, token_ids_cpu,
                      looked_up: list[FastDraft | None] | None = None) -> bool:
        """While idle with a wake share (IdleAdvice.wake_share): the latest position of
        up to LOOKUP_ROWS decoding rows a step (in turn) goes into the LookupWatch (each
        ~0.03 ms at 2k tokens; the match of this round's lookup draft where one was
        made, _look_up); whether it now shows the share."""
        if (self.idle_above is None or self._wake_share is None or self._lookup is None
                or time.monotonic() - self._lookup_woke < LOOKUP_REWAKE_S):
            return False
        rows = [row for row, sampled in enumerate(sampled_token_ids) if sampled]
        turn = self._lookup.seen
        for row in (rows[(turn + i) % len(rows)] for i in range(min(LOOKUP_ROWS, len(rows)))):
            made = None if looked_up is None else looked_up[row]
            if made is not None:
                self._lookup.observe_match(made.n)
            else:
                self._lookup.observe(token_ids_cpu[row, :int(num_tokens[row])].tolist())
        return self._lookup.shows(self._wake_share)

    def _idle(self, req_ids: list[str], decoding: int, finished: set[str],
              arriving: bool = False, woken: bool = False, left: list[int] | None = None
              ) -> bool:
        """Stay away from the draft while the controller said speculation cannot pay at a
        batch this large; wake when the batch shrinks to where it could, or to recheck
        (after the advice's recheck_s, or where it says new_text once the batch holds
        only requests that joined since, or once the text's lookup matches show its
        wake_share: `woken`); not on a shrink while no request waits and every row is
        within WAKE_MIN_LEFT tokens of its end (`left`, the tokens each row has left).
        The batch counts the requests still prefilling: while a batch is arriving (its
        requests join a few at a time) the draft stays idle and the cores stay lent.
        A round in which a batch arrives (requests joined, and the draft holds none of
        the batch's yet, so sitting out loses it no speculation in flight) is one the
        draft sits out when it can lend its cores: more prefills are likely to follow
        (the frontend adds a batch's requests over a few steps), and they are most of the
        next step. Measured before: the draft woke for the first request of each
        benchmark batch, and the other 15 prompts' prefill (1342 tokens) took 4.2 s on
        the target's core alone, 1.98-2.85 s on both. A lone request loses one round of
        speculation. Paused (pause()), every round is idle, and the cores are lent as
        soon as no pre-speculation runs on them."""
        if self.paused:
            self._gone |= finished
            self._lend_while_quiet()
            return True
        if arriving and self._lend_while_quiet():
            self._gone |= finished
            return True
        if self.idle_above is None:
            return False
        if not decoding:  # only prefills in this step (a batch arriving): nothing to decide
            self._gone |= finished
            return True
        if self._probe_rounds is not None:  # measuring the lent cores: a few rounds only
            self._probe_rounds -= 1
            recheck = self._probe_rounds < 0
        else:
            recheck = (time.monotonic() - self._idle_since >= self._recheck_s
                       or (self._idle_ids is not None and not self._idle_ids & set(req_ids))
                       or woken)
        if not recheck and (len(req_ids) > self.idle_above
                            or (left is not None and max(left, default=0) < WAKE_MIN_LEFT)):
            self._gone |= finished  # (WAKE_MIN_LEFT: a draining batch near its end)
            return True
        if woken:
            self._lookup_woke = time.monotonic()
        self._probe_rounds = self._idle_ids = self._wake_share = self._lookup = None
        self._idle_lookup = None
        self.idle_above = None  # the draft resynchronises every sequence (mirror mismatch)
        if self.lending is not None:
            self.lending.give_back()  # before the draft runs again on its cores
        return False

    def _connect_channel(self) -> None:
        """transport 'channel': a new TensorChannel with the worker now up (the first, or
        one restarted after a failure); the worker constructs its end meanwhile."""
        if self.channel_backend is None:
            return
        from vllm_saguaro.transport import TensorChannel, free_address

        self.channel = None
        address = free_address()
        timeout = self.cfg.supervision.timeout_s
        ref = self.actor.connect_channel.remote(address, self.channel_backend, timeout)
        device = self.target_device if self.channel_backend == "nccl" else "cpu"
        try:
            channel = TensorChannel(address, 0, self.channel_backend, timeout, device=device)
        except Exception as error:
            self.supervisor.failed(f"channel: {describe(error)}", error)
            raise DraftUnavailable(self.supervisor.last_cause) from error
        self.supervisor.get(ref, "channel")
        self.channel = channel

    def _receive_q(self, results: list) -> list:
        """transport 'channel': the reply says how many q rows each sequence has; they
        arrive as one tensor over the channel (already sent when the reply came)."""
        if self.channel is None:  # the call's reply: q came in it, as uint16 arrays
            return results
        n = sum(q for _, _, q in results if q is not None)
        if not n:
            return results
        head = self.vocab_size if self.head_ids is None else len(self.head_ids)
        try:
            (counts,) = self.channel.recv([((n, head), "torch.int16")])
        except Exception as error:  # the worker died after replying: a failure as any
            self.channel = None
            self.supervisor.failed(f"channel: {describe(error)}", error)
            raise DraftUnavailable(self.supervisor.last_cause) from error
        out, at = [], 0
        for tokens, flag, q in results:
            if q is not None:
                q, at = counts[at: at + q], at + q
            out.append((tokens, flag, q))
        return out

    def _draft_probs(self, num_rows: int, rows, results) -> torch.Tensor | None:
        if all(q is None for _, _, q in results):
            return None
        k = self.cfg.num_speculative_tokens
        probs = torch.zeros(num_rows, k, self.vocab_size)
        sampled = [(row, q) for (row, _, _), (_, _, q) in zip(rows, results) if q is not None]
        q = unpack_counts([c for _, c in sampled], self.head_ids, self.vocab_size)
        probs[torch.tensor([row for row, _ in sampled]), : q.shape[1]] = q
        for (row, _, _), (tokens, _, c) in zip(rows, results):
            if c is None and tokens:  # greedy request: q one-hot on the drafted tokens
                probs[row, torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
        return probs

    def draft_stats(self) -> dict:
        """The draft worker's own counters (pre-speculation time, branches, ...); those of
        the worker now up ({} while none is)."""
        return self._ask("get_stats")

    def draft_threads(self) -> dict:
        """The draft worker's process id and its threads (affinity, CPU time)."""
        return self._ask("threads")

    def _ask(self, method: str) -> dict:
        if self.supervisor is None or not self.supervisor.up:
            return {}
        try:
            return self.supervisor.get(getattr(self.actor, method).remote(), method)
        except DraftUnavailable:
            return {}

    def shutdown(self) -> None:
        if self.lending is not None:
            self.lending.give_back()
        if self.supervisor is not None:
            self.supervisor.shutdown()


def worker_report(proposer: SaguaroProposer | None, runner=None) -> dict:
    """What ``collective_rpc("saguaro_stats")`` returns from a worker: its threads, the
    target's forward times per width (patches.patch_forward_timer) and, with SSD, the
    proposer's figures, the draft worker's counters and its threads."""
    forward = getattr(runner, "saguaro_forward_s", {})
    report = {"target": {"pid": os.getpid(), "threads": [t.as_dict() for t in process_threads()]},
              "forward_s": {str(w): list(v) for w, v in sorted(forward.items())}}
    if proposer is not None and proposer.actor is not None:
        report.update(metrics=proposer.metrics.as_dict(), draft=proposer.draft_stats(),
                      draft_threads=proposer.draft_threads())
    return report
