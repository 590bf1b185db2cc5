"""How often the fast backup's lookup draft is accepted, by the length of its match.

The fast backup (core/fallback.py) continues the most recent earlier occurrence of the
last n tokens (n = 3, else 2, else 1; n = 0: nothing matches and the last token is
repeated). This decodes each prompt with the target (transformers, no vLLM; greedily,
or sampled at --temperature), then at every position of the output makes the lookup
draft from the tokens before it and counts how many of its K tokens the target's own
continuation accepts:

  python -m benchmarks.lookup_acceptance [--target DIR] [--prompts-per-set 8]
      [--max-tokens 64] [-k 3] [--temperature 0] [--json-out FILE]

Per set and match length: the share of positions, the mean tokens accepted (of K), the
share accepted whole, and the per-token rate a fit sees (accepted / (accepted +
rejections)); core/fallback.py MatchAcceptance keeps one fit per length, for greedy and
for sampled requests apart. Sampled, the common prefix with one sampled continuation
is distributed as the tokens a one-hot q's verification accepts: token i is accepted
with the target's probability of it given those before, and the sample matches it with
that same probability.
"""
from __future__ import annotations

import argparse
import os

from benchmarks import write_json_out


def accepted(draft: list[int], truth: list[int]) -> int:
    """Draft tokens accepted under greedy verification: the common prefix."""
    n = 0
    while n < len(draft) and n < len(truth) and draft[n] == truth[n]:
        n += 1
    return n


def by_match_length(outputs: list[tuple[list[int], int]], k: int) -> dict[int, dict]:
    """outputs: (token list, prompt length) pairs; per match length n, the positions
    (`positions`), tokens accepted (`accepted`) and drafts accepted whole (`whole`)."""
    from vllm_saguaro.core.fallback import ngram_match

    rows: dict[int, dict] = {}
    for tokens, prompt_len in outputs:
        for t in range(prompt_len, len(tokens) - k + 1):
            draft = ngram_match(tokens[:t], k)
            a = accepted(draft.tokens, tokens[t:t + k])
            r = rows.setdefault(draft.n, {"positions": 0, "accepted": 0, "whole": 0})
            r["positions"] += 1
            r["accepted"] += a
            r["whole"] += a == k
    return rows


def per_token_rate(row: dict) -> float:
    """What an AcceptanceFit learns from these drafts: tokens accepted over tokens
    accepted plus rejections (a draft not accepted whole ends in one)."""
    rejected = row["positions"] - row["whole"]
    return row["accepted"] / max(row["accepted"] + rejected, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="target checkpoint (default: the reference target)")
    ap.add_argument("--prompts-per-set", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy; else sampled at this temperature (no top-k / top-p)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.prompts import load_prompt_sets

    target = args.target
    if target is None:
        from benchmarks.reference_pair.build import build_reference_pair, default_cache_dir

        target = str(build_reference_pair(default_cache_dir())[0])
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(0)
    sampling = ({"do_sample": False} if args.temperature <= 0 else
                {"do_sample": True, "temperature": args.temperature, "top_k": 0, "top_p": 1.0})
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    result = {}
    print(f"T = {args.temperature}")
    print("| set | match length | share of positions | accepted (of K) | accepted whole "
          "| per-token rate |")
    print("|---|---|---|---|---|---|")
    for name, prompts in load_prompt_sets(target, limit=args.prompts_per_set).items():
        outputs = []
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=args.max_tokens, **sampling)
            outputs.append((out[0].tolist(), ids.shape[1]))
        rows = by_match_length(outputs, args.k)
        total = sum(r["positions"] for r in rows.values())
        result[name] = {str(n): rows[n] for n in sorted(rows)}
        for n in sorted(rows):
            r = rows[n]
            print(f"| {name} | {n} | {r['positions'] / total:.2f} | "
                  f"{r['accepted'] / r['positions']:.2f} | {r['whole'] / r['positions']:.2f} | "
                  f"{per_token_rate(r):.2f} |", flush=True)
    write_json_out(args.json_out, {"k": args.k, "max_tokens": args.max_tokens,
                                   "temperature": args.temperature,
                                   "prompts_per_set": args.prompts_per_set, "sets": result})


if __name__ == "__main__":
    main()
