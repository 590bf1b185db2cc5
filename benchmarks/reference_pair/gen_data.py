"""Generate distillation data: the target's own continuations plus its top-k logprobs.

Usage (heavy: run on one core):
  VLLM_CPU_OMP_THREADS_BIND=1 taskset -c 1 python -m benchmarks.reference_pair.gen_data \
      --target ~/.cache/vllm_saguaro/target --out /tmp/rp_work/data --n-prompts 20000

Why vLLM: batched offline generation is far faster than transformers' generate (the first
trial got only ~300 tok/s). Why top-k logprobs: vLLM returns the target's top-k
log-probabilities for every generated position almost for free, so distillation needs no
second target forward pass; distill.py trains on KL over {top-k tokens, "everything else"}
(the draft's softmax is still over the full vocabulary).
Shards are written as they finish (shard_XXXX.pt), so a time budget can stop the run and
whatever is on disk is usable. Prompts come from prompts.py or self_instruct.py (never MT-Bench/HumanEval).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")


def _topk_rows(logprob_dicts, K: int):
    """vLLM's per-position {token: Logprob} dicts -> [T, K] ids (-1 pad) and fp16 logprobs, by rank."""
    import torch

    T = len(logprob_dicts)
    tid = torch.full((T, K), -1, dtype=torch.int32)
    tlp = torch.full((T, K), float("-inf"), dtype=torch.float16)
    for t, d in enumerate(logprob_dicts):
        items = sorted(d.items(), key=lambda kv: kv[1].rank)[:K]
        for j, (k, v) in enumerate(items):
            tid[t, j] = k
            tlp[t, j] = max(v.logprob, -60.0)
    return tid, tlp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n-prompts", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mix", default="default", help="prompt mix of prompts.MIXES (chat: the MT-Bench-like second round)")
    ap.add_argument("--prompts-file", help="JSONL of prompt dicts (self_instruct.py's requests: the third round) instead of --mix")
    ap.add_argument("--shard-size", type=int, default=512, help="prompts per LLM.generate call / shard")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--max-prompt-tokens", type=int, default=384)
    ap.add_argument("--logprobs", type=int, default=20)
    ap.add_argument("--sampled-frac", type=float, default=0.4, help="fraction of prompts continued with sampling")
    ap.add_argument("--time-budget", type=float, default=1e9, help="seconds; stop starting new shards after this")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--dtype", default="float32", help="float32: bf16 matmuls are ~6x slower on AVX2-only CPUs")
    ap.add_argument("--no-prompt-logprobs", action="store_true",
                    help="skip the target's top-k at prompt positions (they come free with the prefill)")
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt

    from benchmarks.reference_pair.prompts import build_prompts

    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(args.target)
    if args.prompts_file:
        prompts = [json.loads(line) for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
        prompts = prompts[: args.n_prompts]
    else:
        prompts = build_prompts(args.n_prompts, seed=args.seed, mix=args.mix)
    r = random.Random(args.seed + 1)
    ids_all = []
    for p in prompts:
        if p["chat"]:
            ids = tok.apply_chat_template([{"role": "user", "content": p["text"]}], add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
        else:
            ids = tok(p["text"], add_special_tokens=False)["input_ids"]
        ids_all.append(list(ids)[-args.max_prompt_tokens:])
    print(f"built {len(prompts)} prompts in {time.time() - t0:.0f}s", flush=True)

    llm = LLM(model=args.target, dtype=args.dtype, enforce_eager=True, max_model_len=args.max_prompt_tokens + args.max_tokens + 8,
              max_num_seqs=args.max_num_seqs, max_logprobs=args.logprobs, seed=args.seed)
    K = args.logprobs + 1  # top-k plus possibly the sampled token
    total_tok = 0
    for s in range(0, len(prompts), args.shard_size):
        path = out / f"shard_{s // args.shard_size:04d}.pt"
        if path.exists():
            continue
        if time.time() - t0 > args.time_budget:
            print("time budget reached", flush=True)
            break
        ts = time.time()
        batch = list(range(s, min(s + args.shard_size, len(prompts))))
        sps = []
        plp = None if args.no_prompt_logprobs else args.logprobs
        for _ in batch:
            # No per-request seed: on unpatched vllm-cpu 0.32 a seeded request whose prefill
            # is chunked crashes ("CPU Generator does not use offset"; patches.py now fixes it).
            if r.random() < args.sampled_frac:
                # No top-p: vLLM then sorts the full vocabulary of every row at every step,
                # a third of the generation time on CPU.
                sps.append(SamplingParams(temperature=r.choice([0.6, 0.8, 1.0]),
                                          max_tokens=args.max_tokens, logprobs=args.logprobs, prompt_logprobs=plp, detokenize=False))
            else:
                sps.append(SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=args.logprobs, prompt_logprobs=plp, detokenize=False))
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids_all[i]) for i in batch], sps, use_tqdm=False)
        rec = {"prompt_ids": [], "gen_ids": [], "top_ids": [], "top_lp": [], "kind": [], "greedy": []}
        for i, o, sp in zip(batch, outs, sps):
            c = o.outputs[0]
            gen = list(c.token_ids)
            if not gen:
                continue
            T = len(gen)
            tid, tlp = _topk_rows(c.logprobs, K)
            if o.prompt_logprobs is not None:
                pid, plp_t = _topk_rows(o.prompt_logprobs[1:], K)  # row i predicts prompt token i+1
                rec.setdefault("prompt_top_ids", []).append(pid)
                rec.setdefault("prompt_top_lp", []).append(plp_t)
            rec["prompt_ids"].append(torch.tensor(ids_all[i], dtype=torch.int32))
            rec["gen_ids"].append(torch.tensor(gen, dtype=torch.int32))
            rec["top_ids"].append(tid)
            rec["top_lp"].append(tlp)
            rec["kind"].append(prompts[i]["kind"])
            rec["greedy"].append(sp.temperature == 0.0)
            total_tok += T
        torch.save(rec, str(path) + ".part")
        os.replace(str(path) + ".part", path)
        dt = time.time() - ts
        ntok = sum(len(g) for g in rec["gen_ids"])
        nptok = sum(len(g) for g in rec.get("prompt_top_ids", []))
        print(f"{path.name}: {len(batch)} prompts, {ntok} gen tokens, {nptok} prompt positions, {dt:.0f}s ({ntok / dt:.0f} tok/s); "
              f"total {total_tok} tokens, {time.time() - t0:.0f}s elapsed", flush=True)


if __name__ == "__main__":
    main()
