"""Distil the draft from the target's generated data (output of gen_data.py).

Usage (heavy: one core):
  taskset -c 1 python -m benchmarks.reference_pair.distill --target ~/.cache/vllm_saguaro/target \
      --data /tmp/rp_work/data --work /tmp/rp_work/run --layers 4 --minutes 50

Draft: a standard LlamaForCausalLM with the target's config but few layers (initialised from
the target's layers), the target's embedding matrix (frozen, tied head, full 49152 vocab)
and a trained final norm. Only layers + norm are trained and exported
(draft_delta.safetensors[.xz] + draft_config.json, bf16), so the committed artifact stays small.

Loss: KL(target || draft) with the draft's softmax over the full vocabulary and the target
distribution given by vLLM's top-k logprobs plus one "rest" bucket (all other tokens):
  sum_k p_k (log p_k - log q_k) + p_rest (log p_rest - log q_rest).
This is the exact KL between the two distributions coarsened to {top-k, rest}; with k=20 the
rest mass of this target is small, and every logit still gets a gradient through q_rest.
Only generated positions are trained (they are what the draft must predict in decoding).
The learning rate follows a cosine schedule over the wall-clock budget, so a time-boxed
run always finishes annealed; held-out shards give an agreement number along the way.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch


def load_shards(data_dir: str) -> list[dict]:
    seqs = []
    for p in sorted(Path(data_dir).glob("shard_*.pt")):
        rec = torch.load(p)
        for i in range(len(rec["gen_ids"])):
            seqs.append({k: rec[k][i] for k in rec})
    return seqs


def prepare(seqs: list[dict], target_path: str, say) -> list[dict]:
    """Drop prompts too close to an evaluation question; skip the fixed system-prompt prefix.

    One chat template ("travel blog post about a trip to {place}") could draw "Hawaii", which
    is MT-Bench question 81, so those sequences are removed. Chat prompts all start with the
    same default system prompt; its positions teach nothing, so their loss is skipped.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_path)
    pre = tok.apply_chat_template([{"role": "user", "content": "X"}], add_generation_prompt=False, tokenize=True)
    if hasattr(pre, "keys"):
        pre = pre["input_ids"]
    pre = list(pre)
    user_at = max(i for i in range(len(pre)) if pre[i] == pre[0])  # second <|im_start|> opens the user turn
    prefix = torch.tensor(pre[: user_at + 2])
    out, dropped = [], 0
    for s in seqs:
        p = s["prompt_ids"].long()
        if "hawaii" in tok.decode(p).lower():
            dropped += 1
            continue
        s["loss_start"] = len(prefix) - 1 if len(p) > len(prefix) and torch.equal(p[: len(prefix)], prefix) else 0
        out.append(s)
    say(f"dropped {dropped} sequences mentioning Hawaii (MT-Bench q81); chat prefix {len(prefix)} tokens")
    return out


def make_draft(target, layer_ids: list[int]):
    """Draft = target config with len(layer_ids) layers, weights copied from the target."""
    from transformers import LlamaForCausalLM

    cfg = target.config.__class__.from_dict(target.config.to_dict())
    cfg.num_hidden_layers = len(layer_ids)
    cfg.tie_word_embeddings = True
    if hasattr(cfg, "layer_types") and cfg.layer_types is not None:
        cfg.layer_types = cfg.layer_types[: len(layer_ids)]
    draft = LlamaForCausalLM(cfg).float()
    sd = target.state_dict()
    new = {"model.embed_tokens.weight": sd["model.embed_tokens.weight"], "model.norm.weight": sd["model.norm.weight"]}
    for j, i in enumerate(layer_ids):
        for k, v in sd.items():
            pre = f"model.layers.{i}."
            if k.startswith(pre):
                new[f"model.layers.{j}." + k[len(pre):]] = v
    missing, unexpected = draft.load_state_dict(new, strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    draft.tie_weights()
    draft.model.embed_tokens.weight.requires_grad_(False)
    return draft


def init_from(draft, init_dir: Path, new_layers: tuple[int, ...] = ()) -> None:
    """Load an exported delta (layers + final norm) into the draft.

    new_layers grows the draft without changing what it computes: those draft layers keep
    their target-layer copy but with zeroed output projections (o_proj, down_proj), so each
    starts as the identity on the residual stream, and the delta's layers fill the others
    in order. Training then starts from the smaller draft's predictions, not from scratch.
    """
    from benchmarks.reference_pair.build import load_delta

    delta = load_delta(init_dir)
    old = [j for j in range(len(draft.model.layers)) if j not in set(new_layers)]
    n_old = len({k.split(".")[2] for k in delta if k.startswith("model.layers.")})
    if n_old != len(old):
        raise ValueError(f"{init_dir} does not fit --layers/--grow: it has {n_old} layers, "
                         f"the draft keeps {len(old)} of {len(draft.model.layers)}")
    renamed = {}
    for k, v in delta.items():
        if k.startswith("model.layers."):
            _, _, j, rest = k.split(".", 3)
            k = f"model.layers.{old[int(j)]}.{rest}"
        renamed[k] = v.float()
    missing, unexpected = draft.load_state_dict(renamed, strict=False)
    missing = [k for k in missing if k not in ("lm_head.weight", "model.embed_tokens.weight")
               and not any(k.startswith(f"model.layers.{j}.") for j in new_layers)]
    if missing or unexpected:
        raise ValueError(f"{init_dir} does not fit --layers: missing {missing[:2]}, unexpected {unexpected[:2]}")
    with torch.no_grad():
        for j in new_layers:
            draft.model.layers[j].self_attn.o_proj.weight.zero_()
            draft.model.layers[j].mlp.down_proj.weight.zero_()


def batches(seqs: list[dict], tokens_per_batch: int, max_prompt: int, rng: random.Random):
    """Yield lists of sequences with about tokens_per_batch generated (loss) tokens."""
    order = list(range(len(seqs)))
    rng.shuffle(order)
    cur, n = [], 0
    for i in order:
        cur.append(seqs[i])
        n += len(seqs[i]["gen_ids"])
        if n >= tokens_per_batch:
            yield cur
            cur, n = [], 0


def forward_loss(draft, group: list[dict], max_prompt: int, pad_id: int, prompt_weight: float = 0.5,
                 head: "Head | None" = None):
    """Weighted mean per-position KL over a group of sequences (+ greedy agreement on generated positions).

    Position i of x = prompt + gen[:-1] predicts x[i+1]; the target's top-k rows for the
    prompt (if gen_data stored them) and for the generated tokens line up with that.
    """
    ids, pos, tids, tlps, wts, is_gen = [], [], [], [], [], []
    for s in group:
        p = s["prompt_ids"].long()
        g = s["gen_ids"].long()
        x = torch.cat([p, g[:-1]])
        start = s.get("loss_start", 0)
        use_prompt = prompt_weight > 0 and "prompt_top_ids" in s and len(p) <= max_prompt
        if len(p) > max_prompt:  # keep the last max_prompt prompt tokens, train on the generated part only
            x = x[len(p) - max_prompt:]
            p = p[len(p) - max_prompt:]
        first = start if use_prompt else len(p) - 1
        ids.append(x)
        pos.append(torch.arange(first, len(x)))
        pt = [s["prompt_top_ids"][first:].long()] if use_prompt else []
        pl = [s["prompt_top_lp"][first:].float()] if use_prompt else []
        tids.append(torch.cat(pt + [s["top_ids"].long()]))
        tlps.append(torch.cat(pl + [s["top_lp"].float()]))
        n_p = (len(p) - 1 - first)
        wts.append(torch.cat([torch.full((n_p,), prompt_weight), torch.ones(len(g))]))
        is_gen.append(torch.cat([torch.zeros(n_p, dtype=torch.bool), torch.ones(len(g), dtype=torch.bool)]))
    L = max(len(x) for x in ids)
    inp = torch.full((len(ids), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), L), dtype=torch.long)
    for b, x in enumerate(ids):
        inp[b, : len(x)] = x
        mask[b, : len(x)] = 1
    h = draft.model(input_ids=inp, attention_mask=mask).last_hidden_state  # [B, L, H] (final norm applied)
    hs = torch.cat([h[b, q] for b, q in enumerate(pos)])  # [N, H]
    top_ids, top_lp = torch.cat(tids), torch.cat(tlps)
    w, gen_mask = torch.cat(wts), torch.cat(is_gen)
    assert hs.shape[0] == top_ids.shape[0] == w.shape[0], (hs.shape, top_ids.shape, w.shape)
    if head is None:
        logits = hs @ draft.model.embed_tokens.weight.t()  # full vocabulary (tied head)
    else:  # cut head: target tokens outside it fall into the "rest" bucket, where q has them at 0
        logits = hs @ draft.model.embed_tokens.weight[head.ids].t()
        first_ids = top_ids[:, 0]
        top_ids = head.index_of(top_ids)
    lq = torch.log_softmax(logits, dim=-1)
    valid = top_ids >= 0
    safe_ids = top_ids.clamp(min=0)
    lq_k = lq.gather(1, safe_ids)
    p_k = torch.where(valid, top_lp.exp(), torch.zeros_like(top_lp))
    term_k = (p_k * (torch.where(valid, top_lp, torch.zeros_like(top_lp)) - lq_k)).sum(-1)
    # rest bucket: log q_rest = logsumexp of lq over the tokens outside the stored top set
    lq_rest_all = lq.scatter(1, safe_ids, torch.where(valid, torch.full_like(lq_k, float("-inf")), lq_k))
    log_q_rest = torch.logsumexp(lq_rest_all, dim=-1)
    p_rest = (1.0 - p_k.sum(-1)).clamp(min=0.0)
    term_rest = torch.where(p_rest > 1e-6, p_rest * (torch.log(p_rest.clamp(min=1e-6)) - log_q_rest), torch.zeros_like(p_rest))
    kl = term_k + term_rest
    pred = logits.argmax(-1)
    agree = (pred == top_ids[:, 0]).float() if head is None else (head.ids[pred] == first_ids).float()
    ng = int(gen_mask.sum())
    return (kl * w).sum() / w.sum(), (agree[gen_mask].sum() / max(ng, 1)).item(), float(w.sum()), ng


class Head:
    """The draft's cut output vocabulary: the n most frequent tokens of the training data.

    The draft worker cuts its head the same way at load time (draft_head_tokens, from the
    token_frequencies.json exported next to the delta), so the draft is trained for the
    softmax it will run; q is zero outside the head, which verification handles losslessly.
    """

    def __init__(self, order: list[int], n: int, vocab: int):
        self.ids = torch.tensor(sorted(order[:n]), dtype=torch.long)
        self.index = torch.full((vocab,), -1, dtype=torch.long)
        self.index[self.ids] = torch.arange(len(self.ids))

    def index_of(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary ids -> head indices; -1 (padding) and tokens outside the head -> -1."""
        return torch.where(token_ids >= 0, self.index[token_ids.clamp(min=0)], token_ids)


def frequency_order(seqs: list[dict], vocab: int) -> list[int]:
    """All token ids, most frequent first in the training text (prompts and generations)."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in seqs:
        for key in ("prompt_ids", "gen_ids"):
            counts += torch.bincount(s[key].long(), minlength=vocab)
    return torch.argsort(counts, descending=True, stable=True).tolist()


def export(draft, out_dir: Path, order: list[int] | None = None, compress: bool = False) -> None:
    """Write only what differs from the target: decoder layers + final norm, bf16 (xz-packed if compress)."""
    import lzma

    from safetensors.torch import save

    from benchmarks.reference_pair.build import DELTA_NAME, PACKED_DELTA_NAME

    out_dir.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in draft.state_dict().items()
          if k.startswith("model.layers.") or k == "model.norm.weight"}
    data = save(sd, metadata={"format": "pt"})
    plain, packed = out_dir / DELTA_NAME, out_dir / PACKED_DELTA_NAME
    keep, drop = (packed, plain) if compress else (plain, packed)
    keep.write_bytes(lzma.compress(data) if compress else data)
    drop.unlink(missing_ok=True)  # never two deltas side by side
    cfg = draft.config.to_dict()
    cfg["dtype"] = "bfloat16"
    cfg.pop("_name_or_path", None)
    cfg.pop("_model_name_or_path", None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    (out_dir / "draft_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    freq = out_dir / "token_frequencies.json"
    if order is not None:
        freq.write_text(json.dumps(order) + "\n")
    elif freq.exists():
        freq.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", required=True, nargs="+")
    ap.add_argument("--work", required=True, help="checkpoints and log go here")
    ap.add_argument("--export-dir", default=str(Path(__file__).resolve().parent))
    ap.add_argument("--layers", default="0,1,2,3", help="target layer ids copied into the draft")
    ap.add_argument("--minutes", type=float, default=50.0)
    ap.add_argument("--max-steps", type=int, default=10**9)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--tokens-per-step", type=int, default=4096)
    ap.add_argument("--micro-tokens", type=int, default=1024)
    ap.add_argument("--max-prompt", type=int, default=384)
    ap.add_argument("--prompt-weight", type=float, default=0.5, help="loss weight of prompt positions (0: generated only)")
    ap.add_argument("--heldout", type=int, default=150, help="sequences held out for the running agreement")
    ap.add_argument("--head-tokens", type=int, default=0,
                    help="train with the draft's head cut to the N most frequent tokens (0: full vocabulary)")
    ap.add_argument("--init", help="continue from a draft directory (draft_delta.safetensors, and its "
                    "token_frequencies.json for the head) instead of copying target layers")
    ap.add_argument("--grow", default="", help="with --init: draft layer positions that are new (the "
                    "--layers target layer there, output projections zeroed), e.g. --layers 0,1,2,3,27,28,29 --grow 3")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.grow and not args.init:
        ap.error("--grow needs --init (the smaller draft to grow)")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers import AutoModelForCausalLM

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    log = open(work / "log.txt", "a")

    def say(msg: str) -> None:
        print(msg, flush=True)
        log.write(msg + "\n")
        log.flush()

    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    pad_id = target.config.eos_token_id if isinstance(target.config.eos_token_id, int) else 2
    draft = make_draft(target, [int(x) for x in args.layers.split(",")])
    del target
    if args.init:
        init_from(draft, Path(args.init), tuple(int(x) for x in args.grow.split(",") if x))
    seqs = []
    for d in args.data:
        seqs += load_shards(d)
    seqs = prepare(seqs, args.target, say)
    rng = random.Random(args.seed)
    rng.shuffle(seqs)
    held, train = seqs[: args.heldout], seqs[args.heldout:]
    ntok = sum(len(s["gen_ids"]) for s in train)
    say(f"train: {len(train)} sequences, {ntok} generated tokens; heldout {len(held)}")
    vocab = draft.model.embed_tokens.weight.shape[0]
    init_order = Path(args.init, "token_frequencies.json") if args.init else None
    if args.head_tokens and init_order and init_order.exists():  # keep the head the draft was trained for
        order = json.loads(init_order.read_text())
    else:
        order = frequency_order(train, vocab) if args.head_tokens else None
    head = Head(order, args.head_tokens, vocab) if order else None
    if head is not None:
        covered = sum(int((head.index[s["gen_ids"].long()] >= 0).sum()) for s in held)
        say(f"head: {len(head.ids)} tokens, covering {covered / sum(len(s['gen_ids']) for s in held):.4f} "
            "of the held-out generated tokens")

    params = [p for p in draft.parameters() if p.requires_grad]
    say(f"trainable parameters: {sum(p.numel() for p in params) / 1e6:.2f}M")
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)

    def evaluate(eval_head: Head | None = head) -> tuple[float, float]:
        draft.eval()
        kls, ags, ns = [], [], []
        with torch.no_grad():
            for i in range(0, len(held), 16):
                kl, ag, _, n = forward_loss(draft, held[i:i + 16], args.max_prompt, pad_id, 0.0, eval_head)
                kls.append(kl.item() * n); ags.append(ag * n); ns.append(n)
        draft.train()
        return sum(kls) / sum(ns), sum(ags) / sum(ns)

    kl0, ag0 = evaluate()
    say(f"init heldout KL {kl0:.3f} agreement {ag0:.3f}")
    t0 = time.time()
    budget = args.minutes * 60
    step, epoch = 0, 0
    done = False
    while not done:
        for group in batches(train, args.tokens_per_step, args.max_prompt, rng):
            progress = max(step / args.max_steps, (time.time() - t0) / budget)
            if progress >= 1.0:
                done = True
                break
            lr = args.lr * min(1.0, (step + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
            for g in opt.param_groups:
                g["lr"] = lr
            # micro-batches: bound the [tokens x 49152] logits memory
            # sorted by length so that micro-batches carry little padding (padding costs layer time)
            micro, cur, n = [], [], 0
            for s in sorted(group, key=lambda s: len(s["prompt_ids"]) + len(s["gen_ids"])):
                cur.append(s); n += len(s["gen_ids"])
                if n >= args.micro_tokens:
                    micro.append(cur); cur, n = [], 0
            if cur:
                micro.append(cur)
            total = sum(len(s["gen_ids"]) for s in group)
            tl, ta = 0.0, 0.0
            for m in micro:
                kl, ag, wsum, n = forward_loss(draft, m, args.max_prompt, pad_id, args.prompt_weight, head)
                (kl * n / total).backward()
                tl += kl.item() * n / total; ta += ag * n / total
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0:
                say(f"step {step} ep {epoch} {time.time() - t0:.0f}s lr {lr:.2e} KL {tl:.3f} agree {ta:.3f} tok/s {step * args.tokens_per_step / (time.time() - t0):.0f}")
            if step % 100 == 0:
                kl_h, ag_h = evaluate()
                say(f"  heldout KL {kl_h:.3f} agreement {ag_h:.3f}")
                export(draft, work / "latest", order)
        epoch += 1
        if not done:
            say(f"epoch {epoch} finished at step {step}")
    kl_h, ag_h = evaluate()
    say(f"final step {step} heldout KL {kl_h:.3f} agreement {ag_h:.3f} ({(time.time() - t0) / 60:.1f} min)")
    if head is not None:  # what a full-vocabulary user of the checkpoint (vLLM's draft_model) gets
        kl_f, ag_f = evaluate(None)
        say(f"  same draft, full-vocabulary head: heldout KL {kl_f:.3f} agreement {ag_f:.3f}")
    export(draft, work / "latest", order)
    export(draft, Path(args.export_dir), order, compress=True)
    say(f"exported to {args.export_dir}")


if __name__ == "__main__":
    main()
