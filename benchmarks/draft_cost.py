"""What the draft worker's steps cost on its own core: glue pass, tree decode, fallback.

SSD hides the draft only if its pre-speculation (glue pass + K tree-decode steps over
every branch of the batch) fits in one verification of the target, and a miss costs the
fallback's K steps on top of the round. This times those steps in-process, without vLLM,
for each batch and fan-out budget, with the draft's weights as draft_weights says:

  taskset -c 1 python -m benchmarks.draft_cost [--draft DIR] [--weights dtype,fp16]
      [--batches 1,4] [--budgets 1,4,8,16] [--context 300] [--json-out FILE]

Prompts are random tokens (the cost does not depend on them); the draft is bound to the
cores taskset gives it, one thread per core. Medians of --reps rounds, each round: one
pre-speculation, then an outcome nobody cached (a miss), so the fallback drafts.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from benchmarks import write_json_out


def measure(draft: str, weights: str, batch: int, budget: int, k: int, context: int,
            head_tokens: int | None, reps: int) -> dict:
    from vllm_saguaro.draft.model import DraftSpec
    from vllm_saguaro.draft.worker import DraftWorker

    cfg = {"method": "saguaro", "draft_model": draft, "num_speculative_tokens": k,
           "draft_head_tokens": head_tokens, "draft_weights": weights, "fallback": "neural",
           "fanout": {"policy": "geometric", "budget": budget, "fit_to_round": False,
                      "fit_acceptance": False}}
    w = DraftWorker(cfg, DraftSpec.from_dir(draft).vocab_size, bind=False)
    rng = random.Random(0)
    rids = [f"r{i}" for i in range(batch)]
    w.step([(r, None, [rng.randrange(1000, 5000) for _ in range(context)], None)
            for r in rids], [])
    prespec, glue, fallback = [], [], []
    for _ in range(reps + 1):
        g0 = w.stats.glue_s
        t0 = time.perf_counter()
        w.prespeculate()
        prespec.append(time.perf_counter() - t0)
        glue.append(w.stats.glue_s - g0)
        # an outcome no branch holds: k = 0 with a token the draft would not propose
        _, _, computed, _, _ = w.step([(r, [rng.randrange(40000, 49000)], None, None) for r in rids], [])
        fallback.append(computed)
    ms = lambda xs: round(1000 * statistics.median(xs[1:]), 2)  # noqa: E731 (first: warm-up)
    return {"weights": weights, "batch": batch, "budget": budget, "fanout": list(w.fanout),
            "prespec_ms": ms(prespec), "glue_ms": ms(glue),
            "tree_ms": round(ms(prespec) - ms(glue), 2), "fallback_ms": ms(fallback),
            "quantization": w.model.quantization}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default=None, help="draft checkpoint (default: the reference draft)")
    ap.add_argument("--weights", default="dtype,fp16", help="draft_weights values to compare")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--budgets", default="1,4,8,16")
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--context", type=int, default=300, help="tokens of context per sequence")
    ap.add_argument("--head-tokens", type=int, default=None,
                    help="draft_head_tokens (default: the reference draft's)")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    draft, head = args.draft, args.head_tokens
    if draft is None:
        from benchmarks.reference_pair import HEAD_TOKENS
        from benchmarks.reference_pair.build import build_reference_pair, default_cache_dir

        draft = str(build_reference_pair(default_cache_dir())[1])
        head = head or HEAD_TOKENS
    rows = []
    print("| weights | batch | budget | fan-out | prespec ms | glue ms | tree ms | fallback ms |")
    print("|---|---|---|---|---|---|---|---|")
    for weights in args.weights.split(","):
        for batch in map(int, args.batches.split(",")):
            for budget in map(int, args.budgets.split(",")):
                r = measure(draft, weights, batch, budget, args.k, args.context, head, args.reps)
                rows.append(r)
                print(f"| {weights} ({r['quantization']}) | {batch} | {budget} | {r['fanout']} "
                      f"| {r['prespec_ms']} | {r['glue_ms']} | {r['tree_ms']} "
                      f"| {r['fallback_ms']} |", flush=True)
    write_json_out(args.json_out, rows)


if __name__ == "__main__":
    main()
