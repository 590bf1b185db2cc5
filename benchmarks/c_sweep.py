"""Saguaro sampling's trade-off on the reference pair: hit rate and acceptance against C.

    python -m benchmarks.c_sweep [--cs 1,0.5,0.25,0.1,0] [--prompts 2] [--max-tokens 64]
                                 [--fallback neural] [--target T --draft D] [--out DIR]

SSD at temperature 1, batch 1, one benchmarks/run.py quick run per C (results under
benchmarks/results/c_sweep/), then one table: like the paper's figure 5, a smaller C
should raise the cache hit rate and lower the acceptance length. A last run drafts argmax
tokens verified with a one-hot q: the acceptance before the real q was passed. Misses go
to the neural backup by default, so every drafted round samples from sigma_{F,C}
(prompt-lookup rounds would be verified with a one-hot q at every C and blur its effect).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "c_sweep"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cs", default="1,0.5,0.25,0.1,0")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--budget", type=int, default=4)
    ap.add_argument("--fallback", choices=["neural", "fast", "auto"], default="neural",
                    help="the backup on a cache miss (default neural: every round uses the C under test)")
    ap.add_argument("--target", help="target checkpoint (default: the reference pair's)")
    ap.add_argument("--draft", help="draft checkpoint (default: the reference pair's)")
    ap.add_argument("--out", default=str(OUT), help="results directory")
    ap.add_argument("--no-baseline", action="store_true", help="skip the one-hot q run")
    args = ap.parse_args(argv)

    import os

    from benchmarks.run import main as run_benchmark

    out_dir = Path(args.out)
    models = [x for flag, v in (("--target", args.target), ("--draft", args.draft)) if v for x in (flag, v)]
    cores = os.sched_getaffinity(0)
    runs = [(f"{float(c):g}", ["--saguaro-c", c]) for c in args.cs.split(",")]
    if not args.no_baseline:  # "before": argmax drafts verified with a one-hot q
        runs.append(("one-hot q", ["--draft-sampling", "greedy"]))
    rows = []
    for label, extra in runs:
        os.sched_setaffinity(0, cores)  # each run pins the process to its target core
        out = out_dir / ("C" + label if extra[0] == "--saguaro-c" else "one_hot_q")
        result = run_benchmark([
            "--quick", "--systems", f"SSD-K{args.k}", "--batches", "1", "--temperatures", "1",
            "--ks", str(args.k), "--budget", str(args.budget), "--fallback", args.fallback, *extra,
            "--max-tokens", str(args.max_tokens),
            "--prompts-per-set", str(args.prompts), "--out", str(out), *models])
        for r in result["records"]:
            rows.append((label, r["dataset"], r["hit_rate"], r["accept_len"], r["tok_s_seq"]))
    lines = ["| C | dataset | hit rate | acceptance length | decode tok/s |", "|---|---|---|---|---|"]
    lines += [f"| {c} | {d} | {h:.3f} | {a:.2f} | {t:.1f} |" for c, d, h, a, t in rows]
    table = "\n".join(lines)
    (out_dir / "c_sweep.md").write_text(
        f"SSD K={args.k}, geometric budget {args.budget}, T=1, batch 1, "
        f"{args.prompts} prompts per set, {args.max_tokens} tokens, fallback {args.fallback}. 'one-hot q': the draft "
        "drafts argmax tokens and the verifier gets a one-hot q (vLLM's way for custom "
        f"proposers), the before of passing the real q.\n\n{table}\n")
    (out_dir / "c_sweep.json").write_text(json.dumps(rows))
    print(table)


if __name__ == "__main__":
    main()
