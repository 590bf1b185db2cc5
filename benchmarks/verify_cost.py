"""What a verification at T > 0 costs on CPU: vLLM 0.32's rejection_sample against the
plugin's (core/verification.py, installed by patches.patch_cpu_rejection_sample), in one
process, by batch size and draft length, on the reference target's vocabulary.

  python -m benchmarks.verify_cost [--batches 1,4,16] [--ks 1,3] [--vocab 49152]
                                   [--threads 2] [--out FILE.json]

Every request samples at T = 1 with K draft tokens; the draft distributions q are dense
(the draft's own) or none (prompt lookup drafts, taken as one-hot). The target's logits
are random, so most drafts are rejected at their first token: the plugin then draws a
recovered token for every request, its costliest case. Median of repeated calls, the
two versions alternating.
"""
from __future__ import annotations

import argparse
import json

import torch

from benchmarks.ops_timing import _median_ms

REPEATS = 30  # timed calls per version and shape, after one warm-up call


def sampling_metadata(batch: int):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=torch.ones(batch), all_greedy=False, all_random=True, top_p=None,
        top_k=None, generators={}, max_num_logprobs=None, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(batch),
        presence_penalties=torch.zeros(batch), repetition_penalties=torch.ones(batch),
        output_token_ids=[[] for _ in range(batch)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--ks", default="1,3")
    ap.add_argument("--vocab", type=int, default=49152, help="the reference target's")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler as rs
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from vllm_saguaro.vllm_glue import patches

    patches.apply_all()
    current_platform.register_triton_kernel_overrides()  # vLLM's C++ kernels, as its worker
    plugin = rs.rejection_sample
    vllm_own = plugin.original.original  # under the no-drafts shortcut
    rows = []
    print("| batch | K | q | vLLM (ms) | plugin (ms) | vLLM / plugin |")
    print("|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        for k in (int(x) for x in args.ks.split(",")):
            drafts = [list(range(5, 5 + k))] * batch
            meta = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
            logits = torch.randn(batch * k, args.vocab)
            bonus = torch.randint(0, args.vocab, (batch, 1))
            for q_kind in ("dense", "none"):
                q = (torch.softmax(torch.randn(batch * k, args.vocab), -1)
                     if q_kind == "dense" else None)
                call = (meta.draft_token_ids, meta.num_draft_tokens, meta.max_spec_len,
                        meta.cu_num_draft_tokens, q, logits, bonus, sampling_metadata(batch))
                theirs = _median_ms(lambda: vllm_own(*call), REPEATS)
                ours = _median_ms(lambda: plugin(*call), REPEATS)
                rows.append(dict(batch=batch, k=k, q=q_kind, vllm_ms=theirs, plugin_ms=ours))
                print(f"| {batch} | {k} | {q_kind} | {theirs:.2f} | {ours:.2f} | "
                      f"{theirs / ours:.1f}x |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(vocab=args.vocab, threads=args.threads, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
