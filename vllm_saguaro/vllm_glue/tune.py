"""``vllm-saguaro tune``: measure a target and a draft, predict each configuration's speedup,
write the recommended ``saguaro.yaml``.

The measured steps, each one engine started as a user starts it (multiprocess):
  0. alone    the target alone, as the user would run it instead (no speculative config;
              on CPU its threads on every core, alone_binding): decode tok/s per batch
              size, the baseline every speedup is over.
  1. costs    synchronous SD with the controller forced to send 0..K tokens in turn, at
              every batch size asked for: the target's step time over many widths (the
              line t(w) the controller uses), a neural draft step by rows, a_p.
  1b. lent    (CPU) the same as SD on the lent cores (controller.regime lent_sd): the
              target's verification on every core, the draft's step on the target's
              cores borrowed, what such a round costs beyond the two.
  2. hits     SSD with K pinned at every batch size: the cache hit rate per batch size,
              and what a speculating round costs beyond the target's step and the
              fallback (the draft's reply crossing, a pre-speculation that overran, the
              target's step running slower beside the working draft).
  2b. lent SD (CPU, where step 1b could lend the cores) SD on the lent cores pinned, the
              controller choosing each row's length as it does under auto: what that
              regime gives per batch size, tok/s.
  3. check    (--check) the recommended config and the target alone, --starts engine
              starts each in turn (step 0 counts as the alone's first), pooled: the
              measured speedup next to the one predicted over the pooled target alone.
Predictions come from core/theory.py with these measurements (i.i.d. acceptance a_p, the
hit rate and the round's overhead measured at the configured K and budget held for the
other K). Plain decoding under the plugin counts as the target alone (on CPU the draft's
cores are lent to it). "With the controller" is what controller.regime auto settles on
at each batch size (core/controller.py auto_regime): plain decoding, SSD, or SD on the
lent cores, with the best length up to K, each regime's model moved into what step 2b
measured it to give where it was measured (measured_ranges), as the draft worker does
with what each regime gave (core/controller.py RealizedRate.clamp). Budget and C are
measured as configured, not searched (each needs its own run; benchmarks/c_sweep.py
sweeps C).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import yaml

from vllm_saguaro.core.controller import StepCost, auto_regime
from vllm_saguaro.core.placement import BIND_ENV, swap_environ
from vllm_saguaro.core.theory import sd_rate, ssd_rate
from vllm_saguaro.vllm_glue.vllm_logs import (engine_failures_explained, send_engine_stderr_to,
                                              send_vllm_logs_to)

# Prompts when the user gives none: mixed chat and code, like the reference pair's sets.
DEFAULT_PROMPTS = [
    "Explain how a hash table handles collisions, with an example.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Summarise the causes of the French Revolution in a few sentences.",
    "def quicksort(xs):\n    \"\"\"Sort a list with quicksort.\"\"\"\n",
    "Give three tips for writing clear technical documentation.",
    "Write a SQL query that finds the ten customers with the most orders.",
    "What is the difference between a process and a thread?",
    "def parse_csv_line(line: str) -> list[str]:\n",
]


def log(msg: str) -> None:
    print(f"[tune {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def read_prompts(path: str | None, n: int) -> list[str]:
    """One prompt per line, or JSON lines with a "prompt" field; the defaults otherwise."""
    if path is None:
        prompts = DEFAULT_PROMPTS
    else:
        text = Path(path).read_text().splitlines()
        prompts = [json.loads(x)["prompt"] if x.lstrip().startswith("{") else x
                   for x in text if x.strip()]
        if not prompts:
            raise SystemExit(f"--prompts {path}: no prompts in the file")
    return (prompts * (n // len(prompts) + 1))[:n]


def engine(target: str, spec: dict | None, args):
    """An engine as a user starts it, warmed: its first generate runs slower (one-time
    allocations, the draft's first calls), and step 0 measured batch 1 first, ~25% low."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=target, speculative_config=spec, enforce_eager=True,
              max_model_len=args.max_model_len, max_num_seqs=max(args.batches),
              dtype=args.dtype, disable_log_stats=False,  # per-request timestamps
              use_tqdm_on_load=False)  # vLLM's loading bar ignores TQDM_DISABLE
    llm.generate(["Warm up."], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    return llm


MIN_BATCHES = 3  # batches timed per batch size at least: one 31-step batch varies by ~10%


def prompts_needed(num_prompts: int, batch: int) -> int:
    return max(num_prompts, MIN_BATCHES * batch)


def decode_rates(llm, prompts: list[str], batch: int, max_tokens: int,
                 num_prompts: int) -> list[float]:
    """Decode tok/s of the whole batch (prefill left out: from the first token to the last,
    vLLM's per-request timestamps), one per batch of prompts_needed() prompts."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    use = prompts[:prompts_needed(num_prompts, batch)]
    rates = []
    for i in range(0, len(use) - batch + 1, batch):
        outs = llm.generate(use[i:i + batch], sp, use_tqdm=False)
        first = min(o.metrics.first_token_ts for o in outs)
        last = max(o.metrics.last_token_ts for o in outs)
        rates.append(batch * (max_tokens - 1) / max(last - first, 1e-9))
    return rates


def decode(llm, prompts: list[str], batch: int, max_tokens: int, num_prompts: int) -> float:
    """The median of decode_rates."""
    return statistics.median(decode_rates(llm, prompts, batch, max_tokens, num_prompts))


def base_spec(args, **over) -> dict:
    spec = {"method": "saguaro", "draft_model": args.draft, "num_speculative_tokens": args.k,
            "fanout": {"budget": args.budget}, "saguaro_c": args.saguaro_c,
            "draft_head_tokens": args.draft_head_tokens, "log_stats_interval_s": 0}
    spec.update(over)
    return spec


def forced_sd_stats(args, prompts, step: str, **controller) -> dict:
    """Sync SD with lengths 0..K in turn per row and round (widths spread) at every batch
    size asked for, one engine: the draft worker's stats after it (its fitted lines)."""
    from vllm_saguaro.vllm_glue.offline import engine_report, shutdown

    spec = base_spec(args, **{"async": False, "fallback": "neural",
                              "controller": {**controller,
                                             "force_lengths": list(range(args.k + 1))}})
    llm = engine(args.target, spec, args)
    for b in args.batches:
        log(f"{step}: batch {b}")
        decode(llm, prompts, b, args.max_tokens, args.num_prompts)
    d = engine_report(llm)["draft"]
    shutdown(llm)
    return d


def measure_costs(args, prompts) -> dict:
    """Step 1: sync SD with lengths 0..K in turn (forced_sd_stats)."""
    d = forced_sd_stats(args, prompts, "costs")
    out = {}
    for key in ("target_fixed_s", "target_per_token_s", "draft_fixed_s", "draft_per_row_s",
                "acceptance_rate"):
        out[key] = d[key]
    if out["target_fixed_s"] is None or out["draft_fixed_s"] is None:
        raise SystemExit("tune: no decode step was measured; give longer --max-tokens")
    return out


LENT_KEYS = ("lent_sd_fixed_s", "lent_sd_per_token_s", "borrowed_draft_fixed_s",
             "borrowed_draft_per_row_s", "lent_sd_overhead_s")


def measure_lent_costs(args, prompts) -> dict | None:
    """Step 1b (CPU): SD on the lent cores (regime lent_sd) with lengths 0..K in turn: the
    target's verification on every core, the draft's step with the target's cores
    borrowed, the round's overhead beyond both (DraftWorker.lent_sd_overhead). None
    where the draft's cores cannot be lent (a GPU target; an OpenMP without affinity
    lists, patches.patch_omp_binding): auto then chooses between SSD and plain only."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    d = forced_sd_stats(args, prompts, "lent", regime="lent_sd")
    if any(d.get(key) is None for key in LENT_KEYS[:4]):
        log("lent: the draft's cores could not be lent to the target here; no predictions "
            "for SD on the lent cores")
        return None
    return {key: d.get(key) for key in LENT_KEYS}


def alone_binding() -> dict[str, str]:
    """The target alone's thread binding on CPU: every core this process may use, unless
    the user set VLLM_CPU_OMP_THREADS_BIND. vLLM's default (auto) keeps one core for its
    front end, which on a 2-core machine leaves the target one thread: 20-30% slower
    than both cores here (docs/cpu-thread-placement.md), not the baseline to beat."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or os.environ.get(BIND_ENV):
        return {}
    return {BIND_ENV: ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))}


def measure_rates(args, prompts, spec: dict | None, step: str) -> dict[int, list[float]]:
    """One engine start with spec (None: the target alone, on every core): decode tok/s
    per batch size."""
    from vllm_saguaro.vllm_glue.offline import shutdown

    saved = swap_environ(alone_binding() if spec is None else {})
    try:
        llm = engine(args.target, spec, args)  # the engine's worker takes the binding now
    finally:
        swap_environ(saved)
    out = {}
    for b in args.batches:
        out[b] = decode_rates(llm, prompts, b, args.max_tokens, args.num_prompts)
        log(f"{step}: batch {b}: {statistics.median(out[b]):.1f} tok/s")
    shutdown(llm)
    return out


def pooled(starts: list[dict[int, list[float]]]) -> dict[int, float]:
    """Per batch size, the median over every batch of every engine start: one start's
    decode speed differs from the next by up to ~20% here, so one start is not a baseline."""
    return {b: statistics.median(r for s in starts for r in s[b]) for b in starts[0]}


def round_overhead(before: dict, after: dict, target_step_s: float) -> float:
    """What a speculating round cost beyond the model's target step and fallback, from the
    proposer's metrics (SaguaroMetrics.as_dict) before and after a run: the target's side
    of the round over t(w) at the width it verified, the draft's reply crossing (its call
    minus the worker's compute, plus unpacking), and the wait for a pre-speculation still
    in flight (theory assumes it hidden). Each per round, at least 0 in all."""
    d = {k: after[k] - before[k] for k in ("rounds", "target_rounds", "target_s",
                                           "transport_s", "wait_prespec_s")}
    if not d["rounds"]:
        return 0.0
    slower = d["target_s"] / d["target_rounds"] - target_step_s if d["target_rounds"] else 0.0
    return max(0.0, slower + (d["transport_s"] + d["wait_prespec_s"]) / d["rounds"])


def measure_hits(args, prompts, costs: dict) -> dict[int, dict]:
    """Step 2: SSD with K pinned: hit rate, the round's overhead and tok/s per batch size."""
    from vllm_saguaro.vllm_glue.offline import engine_report, shutdown

    target = StepCost(costs["target_fixed_s"], costs["target_per_token_s"]).predict
    llm = engine(args.target, base_spec(args, controller={"policy": "fixed"}), args)
    out = {}
    for b in args.batches:
        before = engine_report(llm)
        rate = decode(llm, prompts, b, args.max_tokens, args.num_prompts)
        after = engine_report(llm)
        lookups = after["draft"]["lookups"] - before["draft"]["lookups"]
        p = (after["draft"]["hits"] - before["draft"]["hits"]) / lookups if lookups else 0.0
        overhead = round_overhead(before["metrics"], after["metrics"], target(b * (args.k + 1)))
        out[b] = {"hit_rate": p, "overhead_s": overhead, "tok_s": rate}
        log(f"hits: batch {b}: hit rate {p:.2f}, round overhead {1000 * overhead:.1f} ms")
    shutdown(llm)
    return out


def measure_lent_rates(args, prompts) -> dict[int, list[float]]:
    """Step 2b (CPU, where step 1b could lend the draft's cores): SD on the lent cores
    pinned (controller.regime lent_sd), each row's length the controller's choice as
    under auto: decode tok/s per batch size, one per batch of prompts. Its model (one
    a_p for every position, the lines of step 1b) was measured to run high at batch 4:
    1.09x the target alone predicted, where the regime ran 0.87x plain decoding on
    MT-Bench and 1.06x on HumanEval (issue 19's twenty-fourth round), and auto, which
    follows what the regime gives, decoded plainly there."""
    spec = base_spec(args, controller={"regime": "lent_sd"})
    return measure_rates(args, prompts, spec, "lent SD")


def measured_ranges(lent_rates: dict[int, list[float]] | None,
                    alone: dict[int, float]) -> dict[str, dict[int, tuple[float, float]]]:
    """What step 2b measured, as speedups over the target alone: per batch size the
    slowest and the fastest batch of prompts (the measurement's spread, what it cannot
    rule out)."""
    if not lent_rates:
        return {}
    return {"lent SD": {b: (min(r) / alone[b], max(r) / alone[b])
                        for b, r in lent_rates.items() if r and b in alone}}


def predict(costs: dict, hits: dict[int, dict], ks: list[int],
            alone: dict[int, float], lent: dict | None = None) -> list[dict]:
    """Every (batch, K, system) with its predicted speedup over the target alone: SD and
    SSD on the target's and the draft's own cores, and with `lent` (step 1b) SD on the
    lent cores ("lent SD")."""
    target = StepCost(costs["target_fixed_s"], costs["target_per_token_s"]).predict
    draft = StepCost(costs["draft_fixed_s"], costs["draft_per_row_s"]).predict
    a = costs["acceptance_rate"]
    if lent is not None:
        verify = StepCost(lent["lent_sd_fixed_s"], lent["lent_sd_per_token_s"]).predict
        borrowed = StepCost(lent["borrowed_draft_fixed_s"],
                            lent["borrowed_draft_per_row_s"]).predict
        lent_over = lent.get("lent_sd_overhead_s") or 0.0
    rows = []
    for b, h in hits.items():
        base, o = alone[b], h.get("overhead_s", 0.0)
        for k in ks:
            rows.append({"batch": b, "k": k, "system": "SD", "fallback": "neural",
                         "speedup": sd_rate(a, k, b, target, draft, overhead_s=o) / base})
            rows.append({"batch": b, "k": k, "system": "SSD", "fallback": "neural",
                         "speedup": ssd_rate(a, k, h["hit_rate"], b, target, draft,
                                             overhead_s=o) / base})
            if lent is not None:
                rows.append({"batch": b, "k": k, "system": "lent SD", "fallback": "neural",
                             "speedup": sd_rate(a, k, b, verify, borrowed,
                                                overhead_s=lent_over) / base})
    return rows


def with_controller(rows: list[dict], batch: int, k: int, plain: float = 1.0,
                    measured: dict[str, dict[int, tuple[float, float]]] | None = None
                    ) -> tuple[str, float]:
    """What controller.regime auto settles on at this batch size with K = k (the best
    length up to k of SSD and of SD on the lent cores, or plain decoding at speedup
    `plain`), and its predicted speedup (core/controller.py auto_regime). measured: a
    regime's measured range per batch size (measured_ranges), into which its model's
    best is moved, as the worker clamps its models to what each regime gave."""
    def best(system: str) -> float | None:
        model = max((r["speedup"] for r in rows if r["batch"] == batch
                     and r["system"] == system and r["k"] <= k), default=None)
        span = (measured or {}).get(system, {}).get(batch)
        return model if model is None or span is None else min(max(model, span[0]), span[1])

    return auto_regime(best("SSD") or 0.0, best("lent SD"), plain)


def recommend(rows: list[dict], ks: list[int], plain: float = 1.0,
              measured: dict[str, dict[int, tuple[float, float]]] | None = None
              ) -> tuple[int, dict[int, float]]:
    """K for the yaml: the controller may send fewer at any batch size (0 = plain
    decoding, at speedup `plain`), so K scores the mean over batch sizes of what the
    controller settles on with it (with_controller); ties go to the smaller K."""
    batches = sorted({r["batch"] for r in rows})
    score = {k: statistics.mean(with_controller(rows, b, k, plain, measured)[1]
                                for b in batches) for k in ks}
    best = min(ks, key=lambda k: (-round(score[k], 3), k))
    return best, {b: with_controller(rows, b, best, plain, measured)[1] for b in batches}


def write_yaml(path: str, args, k: int, costs: dict) -> dict:
    cfg = {"method": "saguaro", "draft_model": args.draft, "num_speculative_tokens": k,
           "fanout": {"policy": "probable", "budget": args.budget},
           "saguaro_c": args.saguaro_c, "fallback": "auto",
           "draft_head_tokens": args.draft_head_tokens,
           "controller": {"policy": "auto",
                          "target_fixed_s": round(max(costs["target_fixed_s"], 1e-4), 5),
                          "target_per_token_s": round(max(costs["target_per_token_s"], 0.0), 6)}}
    header = (f"# written by vllm-saguaro tune on {time.strftime('%Y-%m-%d %H:%M')}: target "
              f"{args.target}\n# the controller's prior costs were measured here; it refines "
              "them online\n")
    Path(path).write_text(header + yaml.safe_dump(cfg, sort_keys=False))
    return cfg


def check(args, cfg: dict, prompts, alone: list[dict[int, list[float]]]):
    """Step 3: the recommended config and the target alone, --starts engine starts each in
    turn (step 0 was the target alone's first): pooled tok/s of each per batch size."""
    starts = []
    for i in range(args.starts):
        starts.append(measure_rates(args, prompts, cfg, f"check {i + 1}/{args.starts}"))
        if len(alone) < args.starts:
            alone.append(measure_rates(args, prompts, None, f"alone {i + 2}/{args.starts}"))
    return pooled(starts), pooled(alone)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="vllm-saguaro tune", description=__doc__.split("\n")[0])
    p.add_argument("target", help="the target model (path)")
    p.add_argument("--draft", required=True, help="the draft checkpoint (path)")
    p.add_argument("--batches", default="1,4,16", help="batch sizes to measure (default 1,4,16)")
    p.add_argument("--ks", default="1,2,3,4", help="K values to predict (default 1,2,3,4)")
    p.add_argument("-k", type=int, default=3, help="K measured for the hit rate (default 3)")
    p.add_argument("--budget", type=int, default=8, help="fan-out budget (default 8)")
    p.add_argument("--saguaro-c", type=float, default=0.5, help="C of Saguaro sampling (0.5)")
    p.add_argument("--draft-head-tokens", type=int, help="the draft's head cut "
                   "(draft_head_tokens; default: the whole vocabulary)")
    p.add_argument("--prompts", help="a file of prompts: one per line, or JSON lines "
                   "with a 'prompt' field (default: 8 built-in chat and code prompts)")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per batch size (8)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request (32)")
    p.add_argument("--dtype", default="auto", help="the target's dtype (vLLM's --dtype)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--out", default="saguaro.yaml", help="where the recommended config goes")
    p.add_argument("--check", action="store_true", help="also run the recommended config "
                   "and print its measured speedup next to the predicted one")
    p.add_argument("--starts", type=int, default=2, help="with --check: engine starts of the "
                   "recommended config and of the target alone, in turn, pooled (default 2)")
    p.add_argument("--json", help="write every measurement and prediction here")
    p.add_argument("--log-file", help="where vLLM's own log lines go, of every engine tune "
                   "starts, with whatever else the engines' processes write to stderr "
                   "(default: beside --out, NAME.tune.log); the terminal shows tune's "
                   "progress only")
    args = p.parse_args(argv)
    args.batches = sorted({int(x) for x in args.batches.split(",")})
    args.ks = sorted({int(x) for x in args.ks.split(",")})
    for name in ("target", "draft"):
        if not (Path(getattr(args, name)) / "config.json").is_file():
            p.error(f"{name} {getattr(args, name)!r} is not a local HF checkpoint directory")
    args.draft = str(Path(args.draft).resolve())
    if args.k < 1 or min(args.ks) < 1 or max(args.ks) > 32:
        p.error("K must be in 1..32")
    if args.starts < 1:
        p.error("--starts must be at least 1")
    if not args.log_file:
        args.log_file = str(Path(args.out).with_suffix(".tune.log"))
    for name in ("out", "json", "log_file"):  # made now, not after minutes of measuring
        if getattr(args, name):
            try:
                Path(getattr(args, name)).parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                p.error(f"--{name.replace('_', '-')} {getattr(args, name)!r}: cannot make "
                        f"its directory ({e})")
    return args


def main(argv=None) -> dict:
    args = parse_args(sys.argv[2:] if argv is None else argv)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    t0 = time.monotonic()
    send_vllm_logs_to(args.log_file)
    send_engine_stderr_to(args.log_file)
    log(f"vLLM's own log: {args.log_file}")
    with engine_failures_explained(args.log_file, "vllm-saguaro tune"):
        return tune(args, t0)


def tune(args, t0: float) -> dict:
    """The steps (see the module's docstring), their predictions, the yaml, the check."""
    prompts = read_prompts(args.prompts, prompts_needed(args.num_prompts, max(args.batches)))
    log(f"target {args.target}, draft {args.draft}, batches {args.batches}, "
        f"{len(prompts)} prompts x {args.max_tokens} tokens")
    alone_starts = [measure_rates(args, prompts, None, "alone 1")]
    alone = pooled(alone_starts)
    costs = measure_costs(args, prompts)
    log(f"target step {1000 * costs['target_fixed_s']:.1f} ms + "
        f"{1000 * costs['target_per_token_s']:.2f} ms/token; draft step "
        f"{1000 * costs['draft_fixed_s']:.1f} ms + {1000 * costs['draft_per_row_s']:.2f} ms/row; "
        f"a_p {costs['acceptance_rate']:.2f}")
    lent = measure_lent_costs(args, prompts)
    if lent is not None:
        log(f"lent: verification {1000 * lent['lent_sd_fixed_s']:.1f} ms + "
            f"{1000 * lent['lent_sd_per_token_s']:.2f} ms/token on every core; draft step "
            f"{1000 * lent['borrowed_draft_fixed_s']:.1f} ms + "
            f"{1000 * lent['borrowed_draft_per_row_s']:.2f} ms/row on the borrowed cores; "
            f"round overhead {1000 * (lent['lent_sd_overhead_s'] or 0.0):.1f} ms")
    hits = measure_hits(args, prompts, costs)
    lent_rates = measure_lent_rates(args, prompts) if lent is not None else None
    gave = measured_ranges(lent_rates, alone)
    rows = predict(costs, hits, args.ks, alone, lent)
    k, expected = recommend(rows, args.ks, measured=gave)
    print("\npredicted speedup over the target alone as measured in step 0 (budget "
          f"{args.budget}, C {args.saguaro_c}; hit rates and round overhead measured at "
          f"K={args.k}; lent SD: SD on the lent cores):")
    systems = ["SD", "SSD"] + (["lent SD"] if lent is not None else [])
    print("batch | " + " | ".join(f"{name} K{x}" for name in systems for x in args.ks)
          + f" | with the controller at K={k}")
    settled = {b: with_controller(rows, b, k, measured=gave) for b in args.batches}
    for b in args.batches:
        cells = [r["speedup"] for name in systems for r in rows
                 if r["batch"] == b and r["system"] == name]
        regime, speedup = settled[b]
        print(f"{b:5d} | " + " | ".join(f"{x:.2f}" for x in cells)
              + f" | {speedup:.2f} ({regime})")
    if gave:
        print("with the controller: SD on the lent cores' model moved into what step 2b "
              "measured it to give (" + ", ".join(
                  f"batch {b} {lo:.2f}-{hi:.2f}x" for b, (lo, hi) in gave["lent SD"].items())
              + ")")
    cfg = write_yaml(args.out, args, k, costs)
    log(f"recommended K={k} (the controller picks 0..K per sequence and step): {args.out}")
    result = {"alone_tok_s": alone, "costs": costs, "lent": lent, "hits": hits,
              "lent_sd_tok_s": lent_rates,
              "predictions": rows, "recommended_k": k, "expected": expected,
              "regimes": {b: regime for b, (regime, _) in settled.items()},
              "config": cfg}
    if args.check:
        ssd, alone = check(args, cfg, prompts, alone_starts)
        _, expected = recommend(predict(costs, hits, [k], alone, lent), [k],  # over the pooled
                                measured=measured_ranges(lent_rates, alone))
        measured = {b: ssd[b] / alone[b] for b in args.batches}
        result.update(measured=measured, expected_pooled=expected, alone_pooled_tok_s=alone,
                      check_tok_s=ssd)
        print(f"\nthe recommended config against the target alone, {args.starts} engine "
              "starts each, pooled:")
        print("batch | alone tok/s | recommended tok/s | predicted | measured | error")
        for b in args.batches:
            err = expected[b] / measured[b] - 1
            print(f"{b:5d} | {alone[b]:.1f} | {ssd[b]:.1f} | {expected[b]:.2f} | "
                  f"{measured[b]:.2f} | {100 * err:+.0f}%")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    log(f"done in {time.monotonic() - t0:.0f} s")
    return result
