"""Decode speed of a vLLM engine started exactly as a user starts it: an independent check.

    python scripts/plain_decode.py --target DIR [--spec JSON] [--runs 3] [--batch 1]

Shares no code with benchmarks/: the engine is `LLM(model=...)` with vLLM's defaults
(multiprocess engine, vLLM's own thread binding from VLLM_CPU_OMP_THREADS_BIND), and decode
time per token is measured by difference, (t(1 + N tokens) - t(1 token)) / N, so it does
not rely on vLLM's per-request timestamps either. Prints one JSON line per run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "List five tips for staying focused while working from home.",
    "def is_palindrome(s: str) -> bool:\n    \"\"\"Check whether s reads the same backwards.\"\"\"\n",
    "What are the main differences between a comet and an asteroid?",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--spec", help="speculative_config: JSON, or a YAML/JSON file (default: none)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--label", default="")
    ap.add_argument("--eager", action="store_true", help="enforce_eager=True (no compile)")
    ap.add_argument("--old-pinning", action="store_true",
                    help="reproduce the old benchmark's 'AR, 1 core': an in-process engine in a "
                    "process pinned to core 0 with one torch thread")
    args = ap.parse_args()
    if args.old_pinning:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import torch

        os.sched_setaffinity(0, {0})
        torch._C.set_num_threads(1)

    from vllm import LLM, SamplingParams

    spec = (json.loads(args.spec) if args.spec.lstrip().startswith("{") else args.spec) \
        if args.spec else None
    llm = LLM(model=args.target, speculative_config=spec, dtype="float32", max_model_len=2048,
              max_num_seqs=max(16, args.batch), seed=0, enforce_eager=args.eager)
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                       add_generation_prompt=True) for p in PROMPTS]
    one = SamplingParams(temperature=args.temperature, max_tokens=1, ignore_eos=True, seed=1)
    many = SamplingParams(temperature=args.temperature, max_tokens=1 + args.tokens,
                          ignore_eos=True, seed=1)
    llm.generate(prompts[:1], many, use_tqdm=False)  # warm-up
    for run in range(args.runs):
        per_prompt = []
        for i in range(0, len(prompts), args.batch):
            batch = [prompts[(i + j) % len(prompts)] for j in range(args.batch)]
            t0 = time.perf_counter()
            llm.generate(batch, one, use_tqdm=False)
            t1 = time.perf_counter()
            llm.generate(batch, many, use_tqdm=False)
            t2 = time.perf_counter()
            per_tok = ((t2 - t1) - (t1 - t0)) / args.tokens
            per_prompt.append(1.0 / per_tok)
        print(json.dumps({"label": args.label, "run": run, "batch": args.batch,
                          "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
                          "eager": args.eager, "old_pinning": args.old_pinning,
                          "spec": bool(spec), "ld_preload": os.environ.get("LD_PRELOAD", ""), "tok_s_seq": [round(x, 2) for x in per_prompt],
                          "median_tok_s_seq": round(statistics.median(per_prompt), 2)}),
              flush=True)


if __name__ == "__main__":
    main()
