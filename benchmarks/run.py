"""Side-by-side benchmark: target alone, vLLM's draft_model SD, the plugin's sync SD, Saguaro SSD.

Usage:
  python -m benchmarks.run --quick                 # minutes: 2 prompts/set, 32 tokens, b=1,2
  python -m benchmarks.run --full                  # hours: all prompts, 128 tokens, b=1..16, T=0,1
  python -m benchmarks.run --project               # GPU projection from the latest results JSON
Options: --out DIR, --target/--draft PATH, --prompts-file F.jsonl, --systems a,b,...

Why it is built this way (see benchmarks/README.md for the details):
- Every system is started as its user would start it: a multiprocess engine (vLLM's
  default) with vLLM's own thread binding. "AR" (1 core) is plain vLLM with
  VLLM_CPU_OMP_THREADS_BIND=<first core>, "AR-2c" plain vLLM bound to both cores, vLLM's
  SD likewise; the plugin's sync SD and SSD get no binding from the harness (the plugin
  places the target and its draft itself). The harness pins nothing.
- Each record says which threads did the work and on which cores, and the run stops
  rather than report a system whose threads are not where its name says.
- Systems are *interleaved per block*: for each batch size, every system starts an
  engine, runs all of that block's prompt groups and is released, and the system order
  rotates from block to block, so drift hits all alike.
- Decode is timed apart from prefill with vLLM's per-request timestamps (first to last
  token), fixed output length (ignore_eos); figures are medians over requests.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_saguaro.core.placement import BIND_ENV, compute_threads, swap_environ
from vllm_saguaro.vllm_glue.offline import engine_report, shutdown
from vllm_saguaro.vllm_glue.vllm_logs import (engine_failures_explained, send_engine_stderr_to,
                                              send_vllm_logs_to)

ENV = {"VLLM_CPU_KVCACHE_SPACE": "2",
       "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
       "RAY_DEDUP_LOGS": "0",
       # Ray starts workers at nice 15; on a shared machine the draft worker then loses
       # its core to any other process, so the draft's "device" runs at normal priority.
       "RAY_worker_niceness": "0"}
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
PLUGIN_FIELDS = ("rounds", "seqs", "lookups", "hits", "fallbacks", "wait_prespec_s", "wait_step_s",
                 "draft_step_s", "unpack_s", "hit_rounds", "hit_reply_s", "miss_reply_s",
                 "target_rounds", "target_s", "plain_rounds", "idle_rounds", "lent_sd_rounds",
                 "transfer_bytes", "idle_lookup_rounds", "drain_rounds")
DRAFT_FIELDS = ("prespec_s", "fallback_s", "fallback_rounds", "fallback_seqs", "fast_seqs", "fast_rounds",
                "branches", "hit_outcomes", "hit_tokens", "neural_outcomes", "neural_tokens",
                "fast_outcomes", "fast_tokens", "miss_k", "miss_bonus", "miss_cut_short",
                "miss_not_started", "glue_s", "tree_s", "prespec_runs", "prespec_done", "q_bytes",
                "lent_probes", "catch_up_idles", "lent_sd_steps", "catch_up_glues",
                "lent_sd_explores", "ssd_explores", "ssd_explores_cut", "ssd_retries_held")
NOT_LOSSLESS = "not lossless on unpatched vllm-cpu 0.32 (plugin patch active here)"

# The paper's GPU setting for --project: Llama-3.1-70B on 4xH100 (TP4) verifies at the
# autoregressive rate 54.7 tok/s; a Llama-3.2-1B draft step on one H100 is assumed 2.5 ms.
GPU_TARGET_TOK_S = 54.7
GPU_DRAFT_STEP_MS = 2.5


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class System:
    """One decoding system: kind in {ar, vllm_sd, sync_sd, ssd}; cores = 1 or 2."""

    kind: str
    k: int = 0
    cores: int = 1
    budget: int = 8
    policy: str | None = None   # SSD's fan-out policy (None: the plugin's default)
    controller: str | None = None   # the plugin's controller policy (None: its default, auto)
    schedule: tuple | None = None   # vLLM's num_speculative_tokens_per_batch_size
    runtime: str | None = None      # the plugin's draft_runtime (None: its default)
    regime: str | None = None       # the plugin's controller.regime (None: its default)
    idle_lookup: bool = True        # the plugin's controller.idle_lookup

    @property
    def plugin(self) -> bool:
        return self.kind in ("sync_sd", "ssd")

    @property
    def may_borrow(self) -> bool:
        """The draft's team may grow onto the target's core: SD on the lent cores is
        among the controller's regimes (policy auto, regime not pinned to ssd). The
        worker then measures its borrowed step at start (draft/worker.py), so a thread
        bound to the target's core exists before any such round, parked between them."""
        return self.plugin and self.controller is None and self.regime != "ssd"

    def env(self, pair: list[int], s: "Settings") -> dict[str, str | None]:
        """The engine's environment: vLLM's own binding for the plain-vLLM systems (one or
        both cores); none for the plugin's, which a user starts without one. The same
        LD_PRELOAD for all (vLLM's CPU docs: tcmalloc + Intel OpenMP, which made plain
        vLLM faster here and left SSD where it was; docs/cpu-thread-placement.md)."""
        env: dict[str, str | None] = {"LD_PRELOAD": s.ld_preload}
        if self.plugin:
            return {**env, BIND_ENV: None}
        cores = pair[:self.cores]
        return {**env, BIND_ENV: str(cores[0]) if len(cores) == 1 else f"{cores[0]}-{cores[-1]}"}

    @property
    def name(self) -> str:
        base = {"ar": "AR", "vllm_sd": "vLLM-SD", "sync_sd": "sync-SD", "ssd": "SSD"}[self.kind]
        name = base if self.kind == "ar" else f"{base}-K{self.k}"
        if self.policy:
            name += "-" + self.policy
        if self.controller:
            name += "-" + self.controller
        if self.schedule:
            name += "-sched"
        if self.runtime:
            name += "-" + self.runtime
        if self.regime:
            name += "-" + self.regime
        if not self.idle_lookup:
            name += "-nolookup"
        return name + ("-2c" if self.cores == 2 else "")

    def spec(self, draft: str, s: "Settings") -> dict | None:
        if self.kind == "ar":
            return None
        if self.kind == "vllm_sd":
            return {"method": "draft_model", "model": draft, "num_speculative_tokens": self.k}
        spec = {"method": "saguaro", "draft_model": draft, "num_speculative_tokens": self.k,
                "draft_dtype": s.draft_dtype, "async": self.kind == "ssd",
                "draft_head_tokens": s.head_tokens, "draft_sampling": s.draft_sampling,
                "log_stats_interval_s": 0}
        if s.fallback:
            spec["fallback"] = s.fallback
        if s.draft_weights:
            spec["draft_weights"] = s.draft_weights
        if self.controller:
            spec["controller"] = {"policy": self.controller}
        if self.regime:
            spec["controller"] = {**spec.get("controller", {}), "regime": self.regime}
        if not self.idle_lookup:
            spec["controller"] = {**spec.get("controller", {}), "idle_lookup": False}
        if self.schedule:
            spec["num_speculative_tokens_per_batch_size"] = [list(r) for r in self.schedule]
        if self.runtime:
            spec["draft_runtime"] = self.runtime
        if self.kind == "ssd":
            spec["fanout"] = {"budget": self.budget}
            if self.policy:  # uniform at equal budget: budget / (K + 1) per accepted length
                spec["fanout"].update(policy=self.policy,
                                      width=max(1, self.budget // (self.k + 1)))
            if s.fit_to_round is not None:
                spec["fanout"]["fit_to_round"] = s.fit_to_round
            if s.saguaro_c is not None:
                spec["saguaro_c"] = s.saguaro_c
        return spec


@dataclass(frozen=True)
class Group:
    """Prompts of one dataset decoded at one temperature and batch size."""

    dataset: str
    temperature: float
    batch: int


@dataclass
class Settings:
    mode: str
    max_tokens: int
    batches: list[int]
    temperatures: list[float]
    ks: list[int]
    budget: int
    prompts_per_set: int | None
    systems: list[str] | None = None   # names to keep (None = all)
    # float32 for both: this machine kind has AVX2 but no AVX-512, and bf16 matmuls run
    # ~3x slower than fp32 on it (measured; see benchmarks/README.md)
    dtype: str = "float32"
    draft_dtype: str = "float32"
    max_model_len: int = 2048
    head_tokens: int | None = None   # the plugin's draft head cut (vLLM's SD keeps it whole)
    saguaro_c: float | None = None   # C of Saguaro sampling for SSD (None: the plugin's default)
    draft_sampling: str = "saguaro"  # the plugin's draft_sampling ("greedy": one-hot q)
    fallback: str | None = None      # the plugin's fallback (None: its default, auto)
    fit_to_round: bool | None = None  # the plugin's fanout.fit_to_round (None: its default)
    policies: list[str] | None = None  # SSD fan-out policies, one SSD system each (None: default)
    draft_weights: str | None = None   # the plugin's draft_weights (None: its default, auto)
    pair: list[int] = field(default_factory=lambda: [0, 1])  # the two cores the run uses
    # vLLM's default compiles the target (torch.compile): ~20% faster decode on the reference
    # target, but ~70 s more per engine start; eager for every system unless --compile
    compile: bool = False
    ld_preload: str | None = None   # LD_PRELOAD of every engine (None: vLLM's own)
    schedule: tuple | None = None   # the SSD-...-sched systems' schedule (None: SCHEDULE)
    # engine starts per system and block: on this machine one start's decode speed varies
    # by up to ~20% from the next (the same system, same prompts), so a cell measured on
    # one start each can swing by that much; with N starts the cell pools all of them
    starts: int = 1


def settings_for(mode: str) -> Settings:
    if mode == "quick":
        return Settings("quick", 32, [1, 2], [0.0], [3], 8, 2)
    return Settings("full", 128, [1, 2, 4, 8, 16], [0.0, 1.0], [2, 3, 4], 8, None)


# The best hand-written vLLM schedule (num_speculative_tokens_per_batch_size) found for SSD
# on the reference pair (issue 19's baseline): K=3 at batch 1-2, 2 at 3-4, 1 at 5-8, none
# above, where the grids before the controller had SSD below the target alone.
SCHEDULE = ((1, 2, 3), (3, 4, 2), (5, 8, 1), (9, 1024, 0))


def plan_systems(s: Settings) -> list[System]:
    systems = [System("ar"), System("ar", cores=2)]
    for k in s.ks:
        systems += [System("vllm_sd", k), System("vllm_sd", k, cores=2), System("sync_sd", k)]
        systems += [System("ssd", k, budget=s.budget, policy=p) for p in (s.policies or [None])]
        # the controller's baselines: K pinned, and pinned per batch size by vLLM's schedule
        systems += [System("ssd", k, budget=s.budget, controller="fixed"),
                    System("ssd", k, budget=s.budget, controller="fixed",
                           schedule=s.schedule or SCHEDULE),
                    System("sync_sd", k, controller="fixed"),
                    # the draft as a Ray actor, the CPU runtime before the child process
                    System("ssd", k, budget=s.budget, runtime="ray"),
                    # pre-speculation only: never SD on the lent cores (regime auto,
                    # the default, takes it where the controller expects it faster)
                    System("ssd", k, budget=s.budget, regime="ssd"),
                    # SD on the lent cores pinned (regime lent_sd): what tune's step 2b
                    # measures, against plain decoding within one start (benchmarks.paired)
                    System("ssd", k, budget=s.budget, regime="lent_sd"),
                    # no lookup drafts of the proposer's own while the draft idles
                    System("ssd", k, budget=s.budget, idle_lookup=False)]
    if s.systems:
        unknown = set(s.systems) - {x.name for x in systems}
        if unknown:
            raise SystemExit(f"unknown systems {sorted(unknown)}; with these K the systems are "
                             f"{', '.join(x.name for x in systems)}")
        systems = [x for x in systems if x.name in s.systems]
    return systems


def blocks(s: Settings, datasets: list[str]) -> list[list[Group]]:
    """One block per batch size: the unit each system's engine runs before the next system."""
    return [[Group(d, t, b) for t in s.temperatures for d in datasets] for b in s.batches]


# ----------------------------------------------------------------------------- engine side
@contextmanager
def environment(env: dict[str, str | None]):
    """os.environ with `env` applied (None = unset) while an engine starts, then restored."""
    saved = swap_environ(env)
    try:
        yield
    finally:
        swap_environ(saved)


def make_engine(target: str, spec: dict | None, s: Settings):
    from vllm import LLM

    return LLM(model=target, speculative_config=spec, enforce_eager=not s.compile, seed=0, dtype=s.dtype,
               max_model_len=s.max_model_len, max_num_seqs=max(s.batches),
               disable_log_stats=False,
               use_tqdm_on_load=False)  # vLLM's loading bar ignores TQDM_DISABLE


def snapshot(llm) -> tuple[dict, dict]:
    """(cumulative counters: vLLM's spec-decode ones and, for the plugin, its own;
    the worker's report with the target's and the draft's threads)."""
    snap = {name: 0.0 for name in SPEC_COUNTERS}
    for m in llm.get_metrics():
        if m.name in snap and hasattr(m, "value"):
            snap[m.name] += m.value
    report = engine_report(llm)
    if "metrics" in report:
        snap.update({f"plugin.{k}": v for k, v in report["metrics"].items() if k in PLUGIN_FIELDS})
        snap.update({f"plugin.sent_{n}": v for n, v in enumerate(report["metrics"].get("sent", []))})
        snap.update({f"draft.{k}": v for k, v in report["draft"].items() if k in DRAFT_FIELDS})
    return snap, report


def placement(before: dict, after: dict, wall_s: float) -> dict:
    """Which threads did the work during a group, and on which cores they may run."""
    def side(key: str, share: float) -> dict | None:
        if key not in after:
            return None
        busy = compute_threads(before[key]["threads"], after[key]["threads"], wall_s, share)
        return {"pid": after[key]["pid"], "threads": len(after[key]["threads"]),
                "busy_threads": busy,
                "busy_cores": sorted({c for t in busy for c in t["cores"]}),
                "all_cores": sorted({c for t in after[key]["threads"] for c in t["cores"]}),
                "thread_cores": sorted({tuple(t["cores"]) for t in after[key]["threads"]})}

    return {"target": side("target", 0.05), "draft": side("draft_threads", 0.01)}


def forward_ms(before: dict, after: dict, min_calls: int = 5) -> dict[str, float]:
    """Mean ms per target forward at each width (tokens per step) between two worker
    reports (patches.patch_forward_timer); widths seen fewer than min_calls times are left
    out."""
    out = {}
    for w, (n, sec) in after["forward_s"].items():
        n0, s0 = before["forward_s"].get(w, (0, 0.0))
        if n - n0 >= min_calls:
            out[w] = 1000 * (sec - s0) / (n - n0)
    return out


def check_placement(system: "System", where: dict, pair: list[int], draft_idle: bool = False,
                    borrowed: bool = False) -> None:
    """Refuse to report a system whose threads are not where its name says: the target's
    busy threads on its cores (one core, or both for -2c), and for the plugin every
    thread of the draft worker on the other core (Ray's client threads in the target's
    process may sit there too, never on the target's core). draft_idle: the controller
    left the draft idle (speculation could not pay), so it may have had no work to do.
    borrowed: the engine ran rounds of SD on the lent cores, in which the draft's team
    grows onto the target's core (draft/team.py): its threads may sit there, each
    bound to one core by OpenMP."""
    target, draft = where["target"], where["draft"]
    want = pair[:system.cores] if not system.plugin else pair[:1]
    allowed = [set(want)] + ([set(pair[1:])] if system.plugin else [])
    busy = sorted(target["busy_threads"], key=lambda t: -t["busy_s"])
    # The worker's main thread (the OpenMP master, which runs vLLM's Python) is the one
    # that must be on the target's cores. The busiest thread need not be: with the draft's
    # cores lent, the team's thread on the draft's core spins between parallel regions
    # (KMP_BLOCKTIME) while the master runs Python, and was seen busier than the master
    # (6.1 s against 5.2 s in one b=16 group).
    main = next((t for t in busy if t.get("tid") == target.get("pid")), busy[0] if busy else None)
    problems = []
    if not busy:
        problems.append("no busy target thread seen")
    elif not set(main["cores"]) <= set(want):
        problems.append(f"the target's main thread may run on {main['cores']}, not {want}")
    for t in busy:
        if not any(set(t["cores"]) <= a for a in allowed):
            problems.append(f"target thread {t['name']} may run on {t['cores']}")
    if system.kind in ("ar", "vllm_sd") and system.cores == 2:
        # GNU OpenMP binds each thread to the place {0,1}; Intel OpenMP one thread per core
        covered = {c for t in busy for c in t["cores"]}
        if len(busy) < 2 or covered != set(pair):
            problems.append(f"{len(busy)} busy target thread(s) covering cores "
                            f"{sorted(covered)}, expected 2 covering {pair}")
    if system.plugin:
        if draft is None:
            problems.append("no draft worker")
        elif not all(set(c) <= set(pair[1:]) or borrowed and len(c) == 1 and c[0] in pair
                     for c in draft.get("thread_cores") or [tuple(t["cores"]) for t in
                                                            draft["busy_threads"]]):
            problems.append(f"draft threads on cores {draft['all_cores']}, expected {pair[1:]}"
                            + (" (or one thread per core of the pair)" if borrowed else ""))
        elif not draft["busy_threads"] and not draft_idle:
            problems.append("the draft worker did no work")
    if problems:
        raise SystemExit(f"{system.name}: threads not where the benchmark says "
                         f"({'; '.join(problems)}): {json.dumps(where)}")


def diff(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def chunks(prompts: list[str], batch: int) -> list[list[str]]:
    """Consecutive batches of `batch` prompts; the last (or only) one wraps around."""
    n = max(1, math.ceil(len(prompts) / batch))
    return [[prompts[(i * batch + j) % len(prompts)] for j in range(batch)] for i in range(n)]


def decode_times(outputs, max_tokens: int) -> tuple[list[float], float]:
    """(per-request seconds per decoded token, the chunk's decode span in seconds)."""
    per_tok, firsts, lasts = [], [], []
    for o in outputs:
        m = o.metrics
        firsts.append(m.first_token_ts)
        lasts.append(m.last_token_ts)
        per_tok.append((m.last_token_ts - m.first_token_ts) / max(1, max_tokens - 1))
    return per_tok, max(lasts) - min(firsts)


def run_group(llm, system: System, group: Group, prompts: list[str], s: Settings) -> dict:
    """Decode every batch of the group; return its raw measurements and counter deltas."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=group.temperature, max_tokens=s.max_tokens, ignore_eos=True)
    before, report0 = snapshot(llm)
    t_group = time.perf_counter()
    per_tok, spans, walls = [], [], []
    for chunk in chunks(prompts, group.batch):
        t0 = time.perf_counter()
        outs = llm.generate(chunk, sp, use_tqdm=False)
        walls.append(time.perf_counter() - t0)
        assert all(len(o.outputs[0].token_ids) == s.max_tokens for o in outs)
        tok, span = decode_times(outs, s.max_tokens)
        per_tok += tok
        spans.append(span)
    wall = time.perf_counter() - t_group
    after, report1 = snapshot(llm)
    where = placement(report0, report1, wall)
    counters = diff(after, before)
    rounds = counters.get("plugin.rounds", 0) + counters.get("plugin.idle_rounds", 0)
    idle = counters.get("plugin.idle_rounds", 0) > 0 or (
        rounds > 0 and counters.get("plugin.plain_rounds", 0) == rounds)
    # (a start with no round of SD on the lent cores was refused for the thread the
    # worker's start-up measure binds to the target's core: System.may_borrow)
    check_placement(system, where, s.pair, draft_idle=idle,
                    borrowed=system.may_borrow or after.get("plugin.lent_sd_rounds", 0) > 0)
    return {"system": system.name, "kind": system.kind, "k": system.k, "cores": system.cores,
            **asdict(group), "max_tokens": s.max_tokens, "n_requests": len(per_tok),
            "n_chunks": len(spans), "per_token_s": per_tok, "spans_s": spans,
            "wall_s": walls, "counters": counters, "placement": where,
            "forward_ms": forward_ms(report0, report1)}


def run_system(system: System, block: list[Group], prompts: dict[str, list[str]],
               target: str, draft: str, s: Settings) -> list[dict]:
    """One engine for `system`, started as its user would, every group of the block, then
    release."""
    with environment(system.env(s.pair, s)):
        llm = make_engine(target, system.spec(draft, s), s)
    try:
        from vllm import SamplingParams

        first = next(iter(prompts.values()))[:1]
        llm.generate(first, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                     use_tqdm=False)  # warm-up, not measured
        records = []
        for g in block:
            rec = run_group(llm, system, g, prompts[g.dataset], s)
            summarize(rec)
            log(progress_line(rec))
            records.append(rec)
        return records
    finally:
        shutdown(llm)


def pool_starts(runs: list[dict]) -> list[dict]:
    """One record per system and group from the records of its engine starts: the
    requests, spans and counters of all starts together (figures are medians over them),
    and each start's tok/s total kept as `starts_tok_s` for the spread, its counters as
    `starts_counters` and its forward times as `starts_forward_ms` (a slow start is then
    told apart: at batch 4, T = 1, the slow starts were those in which the draft ran,
    docs/measurements.md, issue 19's twentieth round)."""
    pooled: dict[tuple, dict] = {}
    for r in runs:
        key = (r["system"], r["dataset"], r["temperature"], r["batch"])
        if key not in pooled:
            pooled[key] = {**r, "starts_tok_s": [r["tok_s_total"]],
                           "starts_forward_ms": [r["forward_ms"]],
                           "starts_counters": [r["counters"]]}
            continue
        p = pooled[key]
        for f in ("per_token_s", "spans_s", "wall_s"):
            p[f] = p[f] + r[f]
        p["n_requests"] += r["n_requests"]
        p["n_chunks"] += r["n_chunks"]
        p["counters"] = {k: p["counters"].get(k, 0) + r["counters"].get(k, 0)
                         for k in p["counters"].keys() | r["counters"].keys()}
        p["starts_forward_ms"].append(r["forward_ms"])
        p["starts_counters"].append(r["counters"])
        p["starts_tok_s"].append(r["tok_s_total"])
    records = list(pooled.values())
    for rec in records:
        # forward ms: width by width, the mean over the starts that ran that width
        starts = rec["starts_forward_ms"]
        rec["forward_ms"] = {w: statistics.mean(d[w] for d in starts if w in d)
                             for w in dict.fromkeys(w for d in starts for w in d)}
        summarize(rec)
    return records


def progress_line(rec: dict) -> str:
    line = (f"  {rec['system']:14s} {rec['dataset']:9s} T={rec['temperature']:g} "
            f"b={rec['batch']:<2d} {_f(rec['tok_s_seq'], '7.1f')} tok/s/seq  "
            f"{_f(rec['tok_s_total'], '7.1f')} tok/s total")
    if rec.get("accept_len"):
        line += f"  accept {rec['accept_len']:.2f}"
    if rec.get("hit_rate") is not None:
        line += f"  hit {rec['hit_rate']:.2f}"
    return line


# ----------------------------------------------------------------------------- summary
def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None  # None, not NaN: strict JSON readers


def summarize(rec: dict) -> None:
    """Per-record figures: tok/s, TPOT, acceptance length, SSD hit/fallback rates, waits."""
    tpot = _median(rec["per_token_s"])
    c = rec["counters"]
    rec["tpot_ms"] = 1000 * tpot
    rec["tok_s_seq"] = 1 / tpot
    decoded = rec["batch"] * (rec["max_tokens"] - 1)
    rec["tok_s_total"] = _median([decoded / sp for sp in rec["spans_s"] if sp > 0])
    drafts = c.get("vllm:spec_decode_num_drafts", 0)
    rec["accept_len"] = 1 + c["vllm:spec_decode_num_accepted_tokens"] / drafts if drafts else None
    if "plugin.rounds" in c and c["plugin.rounds"]:
        rounds = c["plugin.rounds"]
        rec["hit_rate"] = c["plugin.hits"] / c["plugin.lookups"] if c["plugin.lookups"] else None
        rec["fallback_rate"] = c["plugin.fallbacks"] / c["plugin.seqs"] if c["plugin.seqs"] else None
        rec["wait_ms_per_round"] = 1000 * (c["plugin.wait_prespec_s"] + c["plugin.wait_step_s"]) / rounds
        rec["draft_wait_s"] = c["plugin.wait_prespec_s"] + c["plugin.wait_step_s"]
        # misses drafted by the fast backup (prompt lookup) rather than the draft model
        rec["fast_rate"] = c.get("draft.fast_seqs", 0) / c["plugin.seqs"] if c["plugin.seqs"] else None
    else:
        rec["hit_rate"] = rec["fallback_rate"] = rec["wait_ms_per_round"] = rec["draft_wait_s"] = rec["fast_rate"] = None
    rec["accept_len_hit"], rec["accept_len_miss"] = accept_len_by_source(c)
    rec["profile"] = round_profile(rec)
    rec["lengths"] = lengths_sent(rec)


def lengths_sent(rec: dict) -> dict | None:
    """What the controller sent: shares of sequence-rounds by length 0..K, and of rounds
    that were plain decoding (and, of those, with the draft left idle), and of rounds of SD
    on the lent cores."""
    c = rec["counters"]
    sent = [c.get(f"plugin.sent_{n}", 0) for n in range(rec["k"] + 1)]
    if not sum(sent):
        return None
    rounds = c.get("plugin.rounds", 0) + c.get("plugin.idle_rounds", 0)
    return {"shares": [x / sum(sent) for x in sent],
            "mean": sum(n * x for n, x in enumerate(sent)) / sum(sent),
            "plain_share": c.get("plugin.plain_rounds", 0) / rounds if rounds else None,
            "idle_share": c.get("plugin.idle_rounds", 0) / rounds if rounds else None,
            "lent_sd_share": c.get("plugin.lent_sd_rounds", 0) / rounds if rounds else None,
            "idle_lookup_share": (c.get("plugin.idle_lookup_rounds", 0) / rounds
                                  if rounds else None)}


def accept_len_by_source(c: dict) -> tuple[float | None, float | None]:
    """(E_hit, E_miss): tokens per verified speculation drafted by the cache / by a backup
    (neural or fast), from the draft worker's counters; None where there were none."""
    def mean(*srcs: str) -> float | None:
        n = sum(c.get(f"draft.{s}_outcomes", 0) for s in srcs)
        return sum(c.get(f"draft.{s}_tokens", 0) for s in srcs) / n if n else None

    return mean("hit"), mean("neural", "fast")


def acceptance_rate(e: float, k: int) -> float:
    """The i.i.d. per-token acceptance a with expected_tokens_per_round(a, K) = E (bisection)."""
    from vllm_saguaro.core.theory import expected_tokens_per_round

    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_round(mid, k) < e else (lo, mid)
    return (lo + hi) / 2


def plugin_latencies(rec: dict) -> dict | None:
    """Seconds per round from a plugin run's own counters: verify V, draft-side times.

    A round = target verify + the wait on the draft; rounds in the prefill step (one per
    chunk) fall outside the decode spans, so V = span / decode rounds - wait / round.
    """
    c = rec["counters"]
    rounds = c.get("plugin.rounds", 0)
    # rounds the proposer answered without the draft (the controller left it idle) are
    # rounds of the span too, with no wait
    decode_rounds = rounds + c.get("plugin.idle_rounds", 0) - rec["n_chunks"]
    if decode_rounds <= 0 or not rounds:
        return None
    round_s = sum(rec["spans_s"]) / decode_rounds
    wait = (c["plugin.wait_prespec_s"] + c["plugin.wait_step_s"]) / (decode_rounds + rec["n_chunks"])
    fb_rounds = c.get("draft.fallback_rounds", 0)
    # rounds with a miss: the neural backup's, and those the fast backup alone drafted
    # (nearly free); older results lack the second count
    miss_rounds = fb_rounds + c.get("draft.fast_rounds", 0)
    return {"round_s": round_s, "verify_s": round_s - wait,
            "draft_sync_s": c["plugin.wait_step_s"] / rounds,
            "prespec_s": c.get("draft.prespec_s", 0.0) / rounds,
            "fallback_s": c["draft.fallback_s"] / fb_rounds if fb_rounds else None,
            "backup_s": c["draft.fallback_s"] / miss_rounds if miss_rounds else None}


def impl_round_time(p_hit: float, t_p: float, t_b: float, batch: int) -> float:
    """Round time (in verifies) of this implementation: the target always waits for the
    pre-speculation in flight, and a miss then adds the fallback draft on top; Theorem 7
    instead charges a miss only 1 + T_b (as if the pre-speculation were abandoned)."""
    return max(1.0, t_p) + (1.0 - p_hit ** batch) * t_b


def add_theory(records: list[dict]) -> None:
    """Measured speedup, the theory's prediction from the run's own figures, and the limit.

    speedup = t1 / TPOT, t1 = the target alone's step time (AR on one core, same group).
    SD:  sd_speedup(E, T_draft / V) * t1 / V;  SSD: ssd_speedup(p_hit, E_hit, E_miss, T_p/V,
    T_b/V, b) * t1 / V, with E_hit / E_miss the tokens per speculation drafted by the cache /
    by a backup, and T_b the backup's time per round with a miss (the fast backup's rounds
    count as nearly free). Results from before the worker counted these fall back to
    E_hit = E_miss = E and the neural backup's time. The factor t1 / V converts 'rounds per
    verify' into 'per 1-token step'. limit = E * t1 / V.
    """
    from vllm_saguaro.core.theory import sd_speedup, ssd_speedup

    def key(r, **kw):
        return (r["dataset"], r["temperature"], r["batch"], *kw.values())

    ar = {key(r, cores=r["cores"]): r for r in records if r["kind"] == "ar"}
    sync = {key(r, k=r["k"]): r for r in records if r["kind"] == "sync_sd"}
    best2 = {}
    for r in records:
        if r["cores"] == 2:
            kk = key(r)
            best2[kk] = max(best2.get(kk, 0.0), r["tok_s_seq"])
    for r in records:
        base = ar.get(key(r, cores=1))
        r["speedup"] = base["tpot_ms"] / r["tpot_ms"] if base else None
        r["speedup_vs_best_2c"] = r["tok_s_seq"] / best2[key(r)] if best2.get(key(r)) else None
        r["predicted"] = r["predicted_impl"] = r["limit"] = r["measured_over_limit"] = None
        r["latencies"] = None
        r["note"] = NOT_LOSSLESS if r["kind"] == "vllm_sd" and r["temperature"] > 0 else ""
        if r.get("fast_rate") and r.get("accept_len_miss") is None:
            r["note"] = (f"{r['fast_rate']:.0%} of rounds drafted by prompt lookup; the "
                         "prediction assumes the neural backup")
        e = r.get("accept_len")
        if not e or not base:
            continue
        r["a_est"] = acceptance_rate(e, r["k"])
        own = plugin_latencies(r) if r["kind"] in ("sync_sd", "ssd") else None
        proxy = sync.get(key(r, k=r["k"])) if r["kind"] == "vllm_sd" and r["cores"] == 1 else None
        lat = own or (plugin_latencies(proxy) if proxy else None)
        if lat is None or lat["verify_s"] <= 0:
            continue
        t1, v = base["tpot_ms"] / 1000, lat["verify_s"]
        r["latencies"] = {**lat, "t1_s": t1, "source": "own run" if own else "sync-SD run (proxy)"}
        if r["kind"] == "ssd":
            p = r["hit_rate"] or 0.0
            by_source = r.get("accept_len_miss") is not None
            e_hit = (r.get("accept_len_hit") or e) if by_source else e
            e_miss = r["accept_len_miss"] if by_source else e
            t_b = lat.get("backup_s") if by_source else lat["fallback_s"]
            if t_b is None:
                t_b = lat["draft_sync_s"]
            t_p = lat["prespec_s"] / v
            theory = ssd_speedup(p, e_hit, e_miss, t_p, t_b / v, r["batch"])
            tokens = p * e_hit + (1.0 - p) * e_miss
            r["predicted_impl"] = tokens / impl_round_time(p, t_p, t_b / v, r["batch"]) * t1 / v
        else:
            theory = sd_speedup(e, lat["draft_sync_s"] / v)
        r["predicted"] = theory * t1 / v
        r["limit"] = e * t1 / v
        r["measured_over_limit"] = r["speedup"] / r["limit"]


def project_gpu(records: list[dict], target_tok_s: float, draft_ms: float) -> list[dict]:
    """A PROJECTION, not a measurement: measured a and p_hit on the paper's GPU latencies.

    Assumptions: verifying K+1 tokens costs one 70B step (1/target_tok_s; memory-bound at
    these batch sizes); a draft step costs draft_ms whatever the number of branches (tree
    decode is one batched forward per step); SD drafts K steps per round; SSD's
    pre-speculation is a glue pass + K tree steps, hidden behind verification when < V;
    the neural fallback costs K steps.
    """
    from vllm_saguaro.core.theory import expected_tokens_per_round, sd_speedup, ssd_speedup

    out = []
    v, d = 1.0 / target_tok_s, draft_ms / 1000
    for r in records:
        if r["kind"] not in ("sync_sd", "ssd") or not r.get("a_est"):
            continue
        k = r["k"]
        e = expected_tokens_per_round(r["a_est"], k)
        if r["kind"] == "ssd":
            sp = ssd_speedup(r["hit_rate"] or 0.0, e, e, (k + 1) * d / v, k * d / v, r["batch"])
        else:
            sp = sd_speedup(e, k * d / v)
        out.append({"dataset": r["dataset"], "temperature": r["temperature"],
                    "batch": r["batch"], "system": r["system"], "a": r["a_est"],
                    "hit_rate": r["hit_rate"], "projected_speedup": sp,
                    "projected_tok_s": sp * target_tok_s})
    return out


# ----------------------------------------------------------------------------- output
def _f(x, fmt=".2f") -> str:
    return "—" if x is None else format(x, fmt)


def markdown(result: dict) -> str:
    m = result["meta"]
    lines = [f"# Benchmark ({m['mode']}), {m['started']}", "",
             f"target `{m['target']}`, draft `{m['draft']}`, {m['max_tokens']} output tokens "
             f"(ignore_eos), decode only, medians over requests, "
             f"{'compiled' if m['settings'].get('compile') else 'eager'}, LD_PRELOAD "
             f"`{m['settings'].get('ld_preload') or 'vLLM default'}`. Every engine started as "
             f"its user starts it (multiprocess): AR and vLLM-SD bound by "
             f"VLLM_CPU_OMP_THREADS_BIND to core {m['cores'][0]} (`-2c`: to both cores); "
             f"sync-SD and SSD with the plugin's own placement. Speedup is against AR on one "
             f"core; 'vs best 2c' against the best plain-vLLM system bound to both cores.", "",
             "| dataset | T | b | system | threads | tok/s/seq | tok/s total | TPOT ms | accept len "
             "| accept hit / miss | hit rate | fallback rate | wait ms/round | speedup | vs best 2c "
             "| predicted | pred (impl) | limit | meas/limit | note |",
             "|" + "---|" * 20]
    for r in result["records"]:
        lines.append(
            f"| {r['dataset']} | {r['temperature']:g} | {r['batch']} | {r['system']} "
            f"| {_threads(r)} | {_f(r['tok_s_seq'], '.1f')} | {_f(r['tok_s_total'], '.1f')} "
            f"| {_f(r['tpot_ms'], '.1f')} | {_f(r['accept_len'])} "
            f"| {_f(r.get('accept_len_hit'))} / {_f(r.get('accept_len_miss'))} | {_f(r['hit_rate'])} "
            f"| {_f(r['fallback_rate'])} | {_f(r['wait_ms_per_round'], '.1f')} "
            f"| {_f(r['speedup'])} | {_f(r['speedup_vs_best_2c'])} | {_f(r['predicted'])} "
            f"| {_f(r.get('predicted_impl'))} | {_f(r['limit'])} | {_f(r['measured_over_limit'])} | {r['note']} |")
    lines += forward_table(result["records"])
    lines += profile_table(result["records"])
    lines += lengths_table(result["records"])
    lines += goal_table(result["records"])
    lines += starts_table(result["records"])
    lines += ["", "threads: the threads that did the work, as `count@cores`, for the target "
              "(T) and the draft worker (D); the run refuses a system whose threads are "
              "elsewhere (benchmarks/README.md).",
              "", "vLLM's built-in SD (`vLLM-SD`) at T > 0 is not lossless on unpatched "
              "vllm-cpu 0.32 (docs/vllm-cpu-sampled-sd.md); the plugin, loaded as a vLLM "
              "plugin in every engine process here, patches it, so those rows ran on a "
              "fixed engine.",
              "'predicted' = theory.py from the run's own acceptance, hit rate and latencies "
              "(vLLM-SD borrows the sync-SD run's verify/draft times); 'pred (impl)' = the "
              "same for SSD with this implementation's round time (it waits for the "
              "pre-speculation in flight even on a miss); 'limit' = "
              "E[tokens/round] x t(1-token step) / t(verify K+1). See benchmarks/README.md."]
    if result.get("projection"):
        p = result["projection"]
        lines += ["", "## GPU projection (NOT a measurement)", "",
                  f"Measured a and hit rate fed into theory.py with the paper's GPU latencies: "
                  f"70B target on 4xH100 at {p['target_tok_s']} tok/s per step (verify K+1 "
                  f"assumed = one step), 1B draft step {p['draft_ms']} ms. Assumptions in "
                  f"benchmarks/README.md.", "",
                  "| dataset | T | b | system | a | hit rate | projected speedup | projected tok/s |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in p["rows"]:
            lines.append(f"| {r['dataset']} | {r['temperature']:g} | {r['batch']} | {r['system']} "
                         f"| {_f(r['a'])} | {_f(r['hit_rate'])} | {_f(r['projected_speedup'])} "
                         f"| {_f(r['projected_tok_s'], '.0f')} |")
    return "\n".join(lines) + "\n"


def _threads(r: dict) -> str:
    where = r.get("placement") or {}

    def side(tag: str, w: dict | None) -> str:
        if not w or not w["busy_threads"]:
            return ""
        groups: dict[str, int] = {}
        for t in w["busy_threads"]:
            key = ",".join(map(str, t["cores"]))
            groups[key] = groups.get(key, 0) + 1
        return tag + " " + " ".join(f"{n}@[{k}]" for k, n in groups.items())

    return " / ".join(x for x in (side("T", where.get("target")), side("D", where.get("draft"))) if x) or "—"


def forward_table(records: list[dict]) -> list[str]:
    """The target's forward time per width: the same width with and without a draft
    beside it (AR at batch w vs SD / SSD at batch w / (K+1)), medians over groups."""
    by: dict[tuple[str, int], list[float]] = {}
    for r in records:
        for w, ms in (r.get("forward_ms") or {}).items():
            by.setdefault((r["system"], int(w)), []).append(ms)
    systems = list(dict.fromkeys(r["system"] for r in records if r.get("forward_ms")))
    widths = sorted({w for _, w in by})
    if not by:
        return []
    lines = ["", "## The target's forward time by width (ms per forward, median over groups)", "",
             "| width | " + " | ".join(systems) + " |", "|---|" + "---|" * len(systems)]
    for w in widths:
        cells = [_f(statistics.median(by[(x, w)]), ".1f") if (x, w) in by else "—" for x in systems]
        if sum(c != "—" for c in cells) >= 2:
            lines.append(f"| {w} | " + " | ".join(cells) + " |")
    return lines


def round_profile(rec: dict) -> dict | None:
    """Where an SSD (or sync-SD) round goes, per decode round, from the run's counters.

    round = the target's side (verification, sampling, vLLM's step: from one round's drafts
    to the next round's call) + the target's wait on the draft, split into: waiting for the
    pre-speculation in flight, the fallback drafting, the rest of the draft's step (lookups),
    transport (Ray and (de)serialisation: the reply time the draft did not spend) and
    unpacking drafts and q into the verifier's tensors. Misses by reason as shares of the
    lookups (draft/stats.py); reply time on all-hit rounds and on the others.
    """
    c = rec["counters"]
    rounds = c.get("plugin.rounds", 0)
    if not rounds or "plugin.draft_step_s" not in c:
        return None
    ms = lambda x, n=rounds: 1000 * x / n if n else None  # noqa: E731
    lookups = c["plugin.lookups"]
    miss_rounds = rounds - c["plugin.hit_rounds"]
    lat = plugin_latencies(rec) or {}
    reply = c["plugin.wait_prespec_s"] + c["plugin.wait_step_s"] + c["plugin.unpack_s"]
    out = {
        "round_ms": 1000 * lat["round_s"] if lat else None,
        "target_ms": ms(c["plugin.target_s"], c["plugin.target_rounds"]),
        "reply_ms": ms(reply),
        "wait_prespec_ms": ms(c["plugin.wait_prespec_s"]),
        "fallback_ms": ms(c["draft.fallback_s"]),
        "lookup_ms": ms(c["plugin.draft_step_s"] - c["draft.fallback_s"]),
        "transport_ms": ms(c["plugin.wait_step_s"] - c["plugin.draft_step_s"]),
        "unpack_ms": ms(c["plugin.unpack_s"]),
        "reply_hit_ms": ms(c["plugin.hit_reply_s"], c["plugin.hit_rounds"]),
        "reply_miss_ms": ms(c["plugin.miss_reply_s"], miss_rounds),
        "hit_round_share": c["plugin.hit_rounds"] / rounds,
        "hit_rate": c["plugin.hits"] / lookups if lookups else None,
        "glue_ms": ms(c["draft.glue_s"], c["draft.prespec_runs"]),
        "tree_ms": ms(c["draft.tree_s"], c["draft.prespec_runs"]),
        "prespec_done": (c["draft.prespec_done"] / c["draft.prespec_runs"]
                         if c["draft.prespec_runs"] else None),
        "branches_per_seq": c["draft.branches"] / lookups if lookups else None,
        "q_kb_per_round": c["draft.q_bytes"] / rounds / 1024,
        "transfer_kb_per_round": (c["plugin.transfer_bytes"] / rounds / 1024
                                  if "plugin.transfer_bytes" in c else None),
    }
    for r in ("k", "bonus", "cut_short", "not_started"):
        out[f"miss_{r}"] = c[f"draft.miss_{r}"] / lookups if lookups else None
    if out["round_ms"]:
        out["wait_share"] = out["reply_ms"] / out["round_ms"]
    return out


def profile_table(records: list[dict]) -> list[str]:
    rows = [(r, r.get("profile")) for r in records if r.get("profile")]
    if not rows:
        return []
    lines = ["", "## Round profile (ms per decode round; misses as shares of lookups)", "",
             "| dataset | T | b | system | round | target | reply | of round | prespec wait "
             "| fallback | lookup | transport | unpack | reply hit / miss | hit rate "
             "| miss: k / bonus / cut / not started | glue / tree | branches/seq | q KB/round |",
             "|" + "---|" * 19]
    for r, p in rows:
        lines.append(
            f"| {r['dataset']} | {r['temperature']:g} | {r['batch']} | {r['system']} "
            f"| {_f(p['round_ms'], '.1f')} | {_f(p['target_ms'], '.1f')} | {_f(p['reply_ms'], '.1f')} "
            f"| {_f(p.get('wait_share'))} | {_f(p['wait_prespec_ms'], '.1f')} "
            f"| {_f(p['fallback_ms'], '.1f')} | {_f(p['lookup_ms'], '.1f')} "
            f"| {_f(p['transport_ms'], '.1f')} | {_f(p['unpack_ms'], '.1f')} "
            f"| {_f(p['reply_hit_ms'], '.1f')} / {_f(p['reply_miss_ms'], '.1f')} "
            f"| {_f(p['hit_rate'])} | {_f(p['miss_k'])} / {_f(p['miss_bonus'])} / "
            f"{_f(p['miss_cut_short'])} / {_f(p['miss_not_started'])} "
            f"| {_f(p['glue_ms'], '.1f')} / {_f(p['tree_ms'], '.1f')} "
            f"| {_f(p['branches_per_seq'], '.1f')} | {_f(p['q_kb_per_round'], '.0f')} |")
    return lines


def lengths_table(records: list[dict]) -> list[str]:
    rows = [(r, r["lengths"]) for r in records if r.get("lengths")]
    if not rows:
        return []
    lines = ["", "## Lengths sent (the controller; shares of sequence-rounds)", "",
             "| dataset | T | b | system | 0 / 1 / .. / K | mean length | plain-decoding rounds "
             "| draft idle | its lookup drafts | SD on the lent cores | accept len |",
             "|" + "---|" * 11]
    for r, x in rows:
        lines.append(f"| {r['dataset']} | {r['temperature']:g} | {r['batch']} | {r['system']} "
                     f"| {' / '.join(f'{v:.2f}' for v in x['shares'])} | {x['mean']:.2f} "
                     f"| {_f(x['plain_share'])} | {_f(x['idle_share'])} "
                     f"| {_f(x.get('idle_lookup_share'))} "
                     f"| {_f(x.get('lent_sd_share'))} | {_f(r['accept_len'])} |")
    return lines


def goal_table(records: list[dict]) -> list[str]:
    """Issue 19's goals per cell: SSD (the plugin's defaults) against the best of the
    target alone (1 and 2 cores), the best SD (vLLM's draft_model at any K run, the
    plugin's sync SD) and SSD with K pinned and with vLLM's hand-written schedule."""
    cells: dict[tuple, dict[str, float]] = {}
    for r in records:
        cells.setdefault((r["dataset"], r["temperature"], r["batch"]), {})[r["system"]] = r["tok_s_total"]
    lines = []
    for (d, t, b), got in sorted(cells.items()):
        ssd = {n: v for n, v in got.items() if n.startswith("SSD-") and n.count("-") == 1}
        if not ssd:
            continue
        name, v = next(iter(ssd.items()))
        best = lambda pred: max((x for n, x in got.items() if pred(n) and x), default=None)  # noqa: E731
        refs = {"target alone": best(lambda n: n.startswith("AR")),
                "best SD": best(lambda n: n.startswith(("vLLM-SD", "sync-SD"))),
                "SSD fixed K": best(lambda n: n.startswith("SSD-") and n.endswith("-fixed")),
                "SSD schedule": best(lambda n: n.endswith("-sched"))}
        if not lines:
            lines = ["", "## Goals (issue 19): the plugin's default SSD over each baseline "
                     "(tok/s total; >= 0.97 over the target alone, >= 1 over the others)", "",
                     "| dataset | T | b | system | " + " | ".join(f"/ {k}" for k in refs) + " |",
                     "|" + "---|" * (4 + len(refs))]
        lines.append(f"| {d} | {t:g} | {b} | {name} | " + " | ".join(
            _f(v / x) if x else "—" for x in refs.values()) + " |")
    return lines


def starts_table(records: list[dict]) -> list[str]:
    """Each engine start's tok/s total, for runs with --starts > 1: how far one start's
    figure is from the next tells how much a ratio of the table can be trusted."""
    rows = [r for r in records if len(r.get("starts_tok_s") or []) > 1]
    if not rows:
        return []
    lines = ["", "## Engine starts (tok/s total of each start; the tables above pool them)", "",
             "| dataset | T | b | system | per start | min / median / max |", "|" + "---|" * 6]
    for r in rows:
        v = r["starts_tok_s"]
        lines.append(f"| {r['dataset']} | {r['temperature']:g} | {r['batch']} | {r['system']} "
                     f"| {', '.join(_f(x, '.1f') for x in v)} "
                     f"| {_f(min(v), '.1f')} / {_f(statistics.median(v), '.1f')} / {_f(max(v), '.1f')} |")
    return lines


def plots(records: list[dict], out: Path) -> list[str]:
    """speedup per dataset (smallest batch, per temperature) and throughput vs latency."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plots (pip install matplotlib)")
        return []
    files = []
    datasets = sorted({r["dataset"] for r in records})
    systems = list(dict.fromkeys(r["system"] for r in records))
    b0 = min(r["batch"] for r in records)
    for temp in sorted({r["temperature"] for r in records}):
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(systems) * len(datasets) / 2), 4))
        width = 0.8 / len(systems)
        for i, name in enumerate(systems):
            ys = [next((r["speedup"] for r in records if r["system"] == name and r["dataset"] == d
                        and r["temperature"] == temp and r["batch"] == b0), None) or 0
                  for d in datasets]
            xs = [j + i * width for j in range(len(datasets))]
            ax.bar(xs, ys, width, label=name)
            pred = [next((r["predicted"] for r in records if r["system"] == name
                          and r["dataset"] == d and r["temperature"] == temp
                          and r["batch"] == b0), None) for d in datasets]
            ax.plot([x for x, p in zip(xs, pred) if p], [p for p in pred if p], "k_", ms=12,
                    label="predicted (theory)" if i == len(systems) - 1 else None)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(datasets))], datasets)
        ax.set_ylabel("decode speedup vs AR (1 core)")
        ax.set_title(f"speedup per dataset, batch {b0}, T={temp:g}")
        ax.legend(fontsize=7, ncol=2)
        path = out / f"speedup_T{temp:g}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path.name)
    fig, axes = plt.subplots(1, len(datasets), figsize=(6 * len(datasets), 4), squeeze=False)
    for ax, d in zip(axes[0], datasets):
        for name in systems:
            rs = sorted((r for r in records if r["system"] == name and r["dataset"] == d
                         and r["temperature"] == 0), key=lambda r: r["batch"])
            if rs:
                ax.plot([r["tpot_ms"] for r in rs], [r["tok_s_total"] for r in rs], "o-",
                        label=name)
                for r in rs:
                    ax.annotate(f"b{r['batch']}", (r["tpot_ms"], r["tok_s_total"]), fontsize=6)
        ax.set_xlabel("time per output token, ms (per sequence)")
        ax.set_ylabel("total tok/s")
        ax.set_title(f"{d}, T=0: throughput vs latency over batch size")
        ax.legend(fontsize=7)
    path = out / "throughput_vs_latency.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return files + [path.name]


def write_results(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    result["plots"] = plots(result["records"], out)
    stamp = result["meta"]["started"].replace(":", "").replace("-", "")
    text = json.dumps(result, indent=1)
    (out / f"{result['meta']['mode']}-{stamp}.json").write_text(text)
    (out / "latest.json").write_text(text)
    (out / "latest.md").write_text(markdown(result))
    log(f"wrote {out}/latest.json, latest.md, {', '.join(result['plots'])}")


# ----------------------------------------------------------------------------- driver
def resolve_models(args) -> tuple[str, str]:
    if args.target and args.draft:
        return str(Path(args.target).resolve()), str(Path(args.draft).resolve())
    from benchmarks.reference_pair import build_reference_pair

    target, draft = build_reference_pair()
    return str(args.target or target), str(args.draft or draft)


def load_prompts(args, target: str, s: Settings) -> dict[str, list[str]]:
    from benchmarks import prompts

    if args.prompts_file:
        return prompts.load_prompts_file(args.prompts_file, target, s.prompts_per_set)
    return prompts.load_prompt_sets(target, s.prompts_per_set)


def run_benchmark(s: Settings, target: str, draft: str, prompts: dict[str, list[str]]) -> dict:
    """Every block, every system (rotating order), in this process tree; returns results."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) != 2:
        raise SystemExit(f"the benchmark needs exactly 2 cores (target core + draft core), "
                         f"this process has {cores}; run it under taskset -c A,B")
    s.pair = cores
    systems = plan_systems(s)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    runs = []
    groups = blocks(s, list(prompts))
    for bi, block in enumerate(groups):
        for start in range(s.starts):
            rotation = (bi * s.starts + start) % len(systems)
            order = systems[rotation:] + systems[:rotation]
            for si, system in enumerate(order):
                log(f"block {bi + 1}/{len(groups)} (b={block[0].batch})"
                    + (f" start {start + 1}/{s.starts}" if s.starts > 1 else "")
                    + f" system {si + 1}/{len(order)}: {system.name}")
                runs += run_system(system, block, prompts, target, draft, s)
    records = pool_starts(runs)
    order_key = {x.name: i for i, x in enumerate(systems)}
    records.sort(key=lambda r: (r["dataset"], r["temperature"], r["batch"], order_key[r["system"]]))
    add_theory(records)
    meta = {"mode": s.mode, "started": started, "target": target, "draft": draft,
            "cores": s.pair, "max_tokens": s.max_tokens, "settings": asdict(s),
            "prompts_per_set": {k: len(v) for k, v in prompts.items()},
            "systems": [x.name for x in systems]}
    return {"meta": meta, "records": records}


def add_projection(result: dict, target_tok_s: float, draft_ms: float) -> None:
    result["projection"] = {"label": "PROJECTION from measured acceptance and hit rate; "
                                     "not a measurement",
                            "target_tok_s": target_tok_s, "draft_ms": draft_ms,
                            "rows": project_gpu(result["records"], target_tok_s, draft_ms)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_const", dest="mode", const="quick")
    mode.add_argument("--full", action="store_const", dest="mode", const="full")
    p.add_argument("--project", action="store_true",
                   help="add a GPU projection; alone, re-analyse OUT/latest.json without running")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--log-file", help="where vLLM's own log lines go, of every engine the run "
                   "starts (default: vllm.log in --out); the terminal gets the benchmark's")
    p.add_argument("--target"), p.add_argument("--draft")
    p.add_argument("--prompts-file", help="JSON lines {set, prompt, chat} instead of the PyPI sets")
    p.add_argument("--prompts-per-set", type=int, help="override the mode's subset size")
    p.add_argument("--max-tokens", type=int), p.add_argument("--batches")
    p.add_argument("--ks"), p.add_argument("--temperatures")
    p.add_argument("--systems", help="comma list of system names to keep, e.g. AR,SSD-K3")
    p.add_argument("--budget", type=int, help="SSD geometric fan-out budget")
    p.add_argument("--draft-dtype", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--dtype", choices=["bfloat16", "float32"], help="the target's dtype")
    p.add_argument("--saguaro-c", type=float, help="C of Saguaro sampling for SSD (default: the plugin's, 0.5)")
    p.add_argument("--head-tokens", type=int,
                   help="the plugin's draft_head_tokens, 0 = full head (default: the reference "
                   "draft's trained head; vLLM's draft_model keeps the full head)")
    p.add_argument("--draft-sampling", choices=["saguaro", "greedy"],
                   help="the plugin's draft_sampling: greedy = argmax drafts verified with a one-hot q")
    p.add_argument("--fallback", choices=["neural", "fast", "auto"],
                   help="the plugin's backup on a cache miss (default: the plugin's, auto)")
    p.add_argument("--fit-to-round", choices=["on", "off"],
                   help="SSD: fanout.fit_to_round (shrink the budget so the tree decode fits the round)")
    p.add_argument("--policies", help="SSD fan-out policies to compare at equal budget, one SSD "
                   "system each (SSD-K3-probable, ...), e.g. geometric,uniform,probable")
    p.add_argument("--draft-weights", choices=["auto", "dtype", "fp16"],
                   help="the plugin's draft_weights (default: its own, auto)")
    p.add_argument("--schedule", help="the SSD-K*-fixed-sched systems' vLLM schedule "
                   "num_speculative_tokens_per_batch_size as first-last:K,... (default "
                   "1-2:3,3-4:2,5-8:1,9-1024:0)")
    p.add_argument("--starts", type=int, help="engine starts per system and block, in rotation "
                   "(default 1); a cell pools them and reports their spread")
    p.add_argument("--profile", action="store_true",
                   help="print the round profile of every plugin cell at the end (it is always "
                        "in latest.md)")
    p.add_argument("--compile", action="store_true",
                   help="vLLM's default torch.compile for every engine (default: enforce_eager, "
                   "which starts ~70 s faster per engine)")
    p.add_argument("--ld-preload", default="docs",
                   help="LD_PRELOAD of every engine: 'docs' = what vLLM's CPU docs ask for "
                   "(tcmalloc + Intel OpenMP, found by scripts/cpu_env.sh; the default), "
                   "'none' = vLLM's own (torch's libgomp), or a path list")
    p.add_argument("--gpu-target-tok-s", type=float, default=GPU_TARGET_TOK_S)
    p.add_argument("--gpu-draft-ms", type=float, default=GPU_DRAFT_STEP_MS)
    return p.parse_args(argv)


def resolve_preload(value: str) -> str | None:
    """'docs' -> tcmalloc + Intel OpenMP as found here (refused if either is missing),
    'none' -> None, else the value itself."""
    if value == "none":
        return None
    if value != "docs":
        return value
    import subprocess

    root = Path(__file__).resolve().parent.parent
    libs = subprocess.run(["bash", str(root / "scripts" / "cpu_env.sh")], capture_output=True,
                          text=True).stdout.strip()
    if "tcmalloc" not in libs or "libiomp" not in libs:
        raise SystemExit(f"--ld-preload docs: tcmalloc and Intel OpenMP not both found "
                         f"({libs or 'neither'}); run scripts/install.sh, or pass --ld-preload none")
    return libs


def parse_schedule(text: str) -> tuple:
    """'1-2:3,3-8:1' -> ((1, 2, 3), (3, 8, 1))"""
    out = []
    for part in text.split(","):
        rng, k = part.split(":")
        lo, hi = rng.split("-")
        out.append((int(lo), int(hi), int(k)))
    return tuple(out)


def apply_overrides(s: Settings, args) -> Settings:
    ints = lambda v: [int(x) for x in v.split(",")]  # noqa: E731
    if args.prompts_per_set:
        s.prompts_per_set = args.prompts_per_set
    if args.max_tokens:
        s.max_tokens = args.max_tokens
    if args.batches:
        s.batches = ints(args.batches)
    if args.ks:
        s.ks = ints(args.ks)
    if args.temperatures:
        s.temperatures = [float(x) for x in args.temperatures.split(",")]
    if args.systems:
        s.systems = args.systems.split(",")
    if args.budget:
        s.budget = args.budget
    if args.draft_dtype:
        s.draft_dtype = args.draft_dtype
    if args.dtype:
        s.dtype = args.dtype
    if args.saguaro_c is not None:
        s.saguaro_c = args.saguaro_c
    if args.head_tokens is not None:
        s.head_tokens = args.head_tokens or None
    elif not args.draft:  # the reference draft runs with the head it was trained for
        from benchmarks.reference_pair import HEAD_TOKENS

        s.head_tokens = HEAD_TOKENS
    if args.draft_sampling:
        s.draft_sampling = args.draft_sampling
    if args.fallback:
        s.fallback = args.fallback
    if args.compile:
        s.compile = True
    s.ld_preload = resolve_preload(args.ld_preload)
    if args.fit_to_round is not None:
        s.fit_to_round = args.fit_to_round == "on"
    if args.policies:
        s.policies = args.policies.split(",")
    if args.schedule:
        s.schedule = parse_schedule(args.schedule)
    if args.draft_weights:
        s.draft_weights = args.draft_weights
    if args.starts is not None:
        if args.starts < 1:
            raise SystemExit("--starts must be >= 1")
        s.starts = args.starts
    if s.max_tokens < 2:
        raise SystemExit("--max-tokens must be >= 2 (decode time is first to last token)")
    return s


def main(argv=None) -> dict | None:
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    # every engine as a user starts it: vLLM's default multiprocess engine (an in-process
    # engine is bound by nobody, so VLLM_CPU_OMP_THREADS_BIND would mean nothing)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    args = parse_args(argv)
    out = Path(args.out)
    if args.project and not args.mode:
        result = json.loads((out / "latest.json").read_text())
        add_theory(result["records"])  # re-derived from the raw timings and counters
        add_projection(result, args.gpu_target_tok_s, args.gpu_draft_ms)
        write_results(result, out)
        return result
    s = apply_overrides(settings_for(args.mode or "quick"), args)
    log_file = Path(args.log_file) if args.log_file else out / "vllm.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    send_vllm_logs_to(str(log_file))
    send_engine_stderr_to(str(log_file))
    log(f"vLLM's own log: {log_file}")
    with engine_failures_explained(str(log_file), "benchmarks.run"):
        target, draft = resolve_models(args)
        prompts = load_prompts(args, target, s)
        log(f"{s.mode}: {len(plan_systems(s))} systems, sets "
            f"{', '.join(f'{k}={len(v)}' for k, v in prompts.items())}, "
            f"batches {s.batches}, T {s.temperatures}, {s.max_tokens} tokens")
        result = run_benchmark(s, target, draft, prompts)
    if args.project:
        add_projection(result, args.gpu_target_tok_s, args.gpu_draft_ms)
    write_results(result, out)
    if args.profile:
        print("\n".join(profile_table(result["records"])))
    return result


if __name__ == "__main__":
    main()
