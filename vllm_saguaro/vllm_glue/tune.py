"""``vllm-saguaro tune``: measure a target and a draft, predict each configuration's speedup,
write the recommended ``saguaro.yaml``.

Three measured steps, each one engine started as a user starts it (multiprocess):
  1. costs    synchronous SD with the controller forced to send 0..K tokens in turn, at
              every batch size asked for: the target's step time over many widths (the
              line t(w) the controller uses), a neural draft step by rows, a_p.
  2. hits     SSD with K pinned at every batch size: the cache hit rate per batch size.
  3. check    (--check) the recommended config and the target alone, side by side: the
              measured speedup next to the predicted one.
Predictions come from core/theory.py with these measurements (i.i.d. acceptance a_p, the
hit rate measured at the configured K and budget held for the other K). Budget and C are
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

from vllm_saguaro.core.controller import StepCost
from vllm_saguaro.core.theory import sd_rate, ssd_rate, target_alone_rate

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
    from vllm import LLM

    return LLM(model=target, speculative_config=spec, enforce_eager=True,
               max_model_len=args.max_model_len, max_num_seqs=max(args.batches),
               dtype=args.dtype, disable_log_stats=False)  # per-request timestamps


def decode(llm, prompts: list[str], batch: int, max_tokens: int, num_prompts: int) -> float:
    """Decode tok/s of the whole batch (prefill left out: from the first token to the last,
    vLLM's per-request timestamps), median over max(num_prompts, batch) prompts' batches."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    use = prompts[:max(num_prompts, batch)]
    rates = []
    for i in range(0, len(use) - batch + 1, batch):
        outs = llm.generate(use[i:i + batch], sp, use_tqdm=False)
        first = min(o.metrics.first_token_ts for o in outs)
        last = max(o.metrics.last_token_ts for o in outs)
        rates.append(batch * (max_tokens - 1) / max(last - first, 1e-9))
    return statistics.median(rates)


def base_spec(args, **over) -> dict:
    spec = {"method": "saguaro", "draft_model": args.draft, "num_speculative_tokens": args.k,
            "fanout": {"budget": args.budget}, "saguaro_c": args.saguaro_c,
            "draft_head_tokens": args.draft_head_tokens, "log_stats_interval_s": 0}
    spec.update(over)
    return spec


def measure_costs(args, prompts) -> dict:
    """Step 1: sync SD with lengths 0..K in turn per row and round (widths spread)."""
    from vllm_saguaro.vllm_glue.offline import engine_report, shutdown

    spec = base_spec(args, **{"async": False, "fallback": "neural",
                              "controller": {"force_lengths": list(range(args.k + 1))}})
    llm = engine(args.target, spec, args)
    out = {}
    for b in args.batches:
        log(f"costs: batch {b}")
        decode(llm, prompts, b, args.max_tokens, args.num_prompts)
    d = engine_report(llm)["draft"]
    shutdown(llm)
    for key in ("target_fixed_s", "target_per_token_s", "draft_fixed_s", "draft_per_row_s",
                "acceptance_rate"):
        out[key] = d[key]
    if out["target_fixed_s"] is None or out["draft_fixed_s"] is None:
        raise SystemExit("tune: no decode step was measured; give longer --max-tokens")
    return out


def measure_hits(args, prompts) -> dict[int, dict]:
    """Step 2: SSD with K pinned: hit rate and tok/s per batch size."""
    from vllm_saguaro.vllm_glue.offline import engine_report, shutdown

    llm = engine(args.target, base_spec(args, controller={"policy": "fixed"}), args)
    out = {}
    for b in args.batches:
        before = engine_report(llm)["draft"]
        rate = decode(llm, prompts, b, args.max_tokens, args.num_prompts)
        after = engine_report(llm)["draft"]
        lookups = after["lookups"] - before["lookups"]
        p = (after["hits"] - before["hits"]) / lookups if lookups else 0.0
        out[b] = {"hit_rate": p, "tok_s": rate}
        log(f"hits: batch {b}: hit rate {p:.2f}")
    shutdown(llm)
    return out


def predict(costs: dict, hits: dict[int, dict], ks: list[int]) -> list[dict]:
    """Every (batch, K, fallback) with its predicted speedup over the target alone."""
    target = StepCost(costs["target_fixed_s"], costs["target_per_token_s"]).predict
    draft = StepCost(costs["draft_fixed_s"], costs["draft_per_row_s"]).predict
    a = costs["acceptance_rate"]
    rows = []
    for b, h in hits.items():
        base = target_alone_rate(b, target)
        for k in ks:
            rows.append({"batch": b, "k": k, "system": "SD", "fallback": "neural",
                         "speedup": sd_rate(a, k, b, target, draft) / base})
            rows.append({"batch": b, "k": k, "system": "SSD", "fallback": "neural",
                         "speedup": ssd_rate(a, k, h["hit_rate"], b, target, draft) / base})
    return rows


def recommend(rows: list[dict], ks: list[int], plain: float = 1.0) -> tuple[int, dict[int, float]]:
    """K for the yaml: the controller may send fewer at any batch size (0 = plain
    decoding, at speedup `plain`), so K scores the mean over batch sizes of the best SSD
    speedup at any length up to K; ties go to the smaller K."""
    def at(b: int, k: int) -> float:
        got = [r["speedup"] for r in rows if r["batch"] == b and r["system"] == "SSD" and r["k"] <= k]
        return max([plain] + got)

    batches = sorted({r["batch"] for r in rows})
    score = {k: statistics.mean(at(b, k) for b in batches) for k in ks}
    best = min(ks, key=lambda k: (-round(score[k], 3), k))
    return best, {b: at(b, best) for b in batches}


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


def check(args, cfg: dict, prompts) -> dict[int, float]:
    """Step 3: the recommended config and the target alone, measured speedup per batch."""
    from vllm_saguaro.vllm_glue.offline import shutdown

    measured = {}
    llm = engine(args.target, None, args)
    alone = {b: decode(llm, prompts, b, args.max_tokens, args.num_prompts) for b in args.batches}
    shutdown(llm)
    llm = engine(args.target, cfg, args)
    for b in args.batches:
        measured[b] = decode(llm, prompts, b, args.max_tokens, args.num_prompts) / alone[b]
        log(f"check: batch {b}: measured speedup {measured[b]:.2f}")
    shutdown(llm)
    return measured


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
                   "and the target alone, and print measured next to predicted")
    p.add_argument("--json", help="write every measurement and prediction here")
    args = p.parse_args(argv)
    args.batches = sorted({int(x) for x in args.batches.split(",")})
    args.ks = sorted({int(x) for x in args.ks.split(",")})
    for name in ("target", "draft"):
        if not (Path(getattr(args, name)) / "config.json").is_file():
            p.error(f"{name} {getattr(args, name)!r} is not a local HF checkpoint directory")
    args.draft = str(Path(args.draft).resolve())
    if args.k < 1 or min(args.ks) < 1 or max(args.ks) > 32:
        p.error("K must be in 1..32")
    return args


def main(argv=None) -> dict:
    args = parse_args(sys.argv[2:] if argv is None else argv)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    t0 = time.monotonic()
    prompts = read_prompts(args.prompts, max(args.num_prompts, max(args.batches)))
    log(f"target {args.target}, draft {args.draft}, batches {args.batches}, "
        f"{len(prompts)} prompts x {args.max_tokens} tokens")
    costs = measure_costs(args, prompts)
    log(f"target step {1000 * costs['target_fixed_s']:.1f} ms + "
        f"{1000 * costs['target_per_token_s']:.2f} ms/token; draft step "
        f"{1000 * costs['draft_fixed_s']:.1f} ms + {1000 * costs['draft_per_row_s']:.2f} ms/row; "
        f"a_p {costs['acceptance_rate']:.2f}")
    hits = measure_hits(args, prompts)
    rows = predict(costs, hits, args.ks)
    k, expected = recommend(rows, args.ks)
    print("\npredicted speedup over the target alone (budget "
          f"{args.budget}, C {args.saguaro_c}; hit rates measured at K={args.k}):")
    print("batch | " + " | ".join(f"SD K{x}" for x in args.ks) + " | "
          + " | ".join(f"SSD K{x}" for x in args.ks) + " | with the controller")
    for b in args.batches:
        sd = [r["speedup"] for r in rows if r["batch"] == b and r["system"] == "SD"]
        ssd = [r["speedup"] for r in rows if r["batch"] == b and r["system"] == "SSD"]
        print(f"{b:5d} | " + " | ".join(f"{x:.2f}" for x in sd) + " | "
              + " | ".join(f"{x:.2f}" for x in ssd) + f" | {expected[b]:.2f}")
    cfg = write_yaml(args.out, args, k, costs)
    log(f"recommended K={k} (the controller picks 0..K per sequence and step): {args.out}")
    result = {"costs": costs, "hits": hits, "predictions": rows, "recommended_k": k,
              "expected": expected, "config": cfg}
    if args.check:
        measured = check(args, cfg, prompts)
        result["measured"] = measured
        print("\nbatch | predicted | measured | error")
        for b in args.batches:
            err = expected[b] / measured[b] - 1
            print(f"{b:5d} | {expected[b]:.2f} | {measured[b]:.2f} | {100 * err:+.0f}%")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    log(f"done in {time.monotonic() - t0:.0f} s")
    return result
