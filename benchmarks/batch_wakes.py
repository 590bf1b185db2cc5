"""SSD decoding batch after batch on one engine: each batch's speed and the draft's wakes.

    python -m benchmarks.batch_wakes [--batch 16] [--seconds 100] [--json-out FILE]

One SSD engine (the plugin's defaults, the reference pair, started as benchmarks.run
starts it) decodes the same `--batch` HumanEval prompts x 48 tokens (greedy) again and
again for `--seconds`, the way a server under steady load sees batch after batch. It
prints each batch's tok/s and what the draft did meanwhile: pre-speculations run and
their glue passes (the draft prefilling sequences it did not hold), steps it idled
rather than catch up (core/controller.py catch_up_pays), lent-core probes. A batch in
which the draft wakes to prefill the whole batch decodes on the target's own core for
that long; benchmarks.run's short cells catch such a wake only now and then.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from benchmarks import write_json_out

FIELDS = ("prespec_runs", "glue_s", "catch_up_idles", "lent_probes", "prefill_s_per_token")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=100.0)
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    from benchmarks.prompts import humaneval_prompts
    from benchmarks.reference_pair import HEAD_TOKENS, build_reference_pair
    from benchmarks.run import ENV, resolve_preload

    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"   # as benchmarks.run starts SSD
    os.environ["LD_PRELOAD"] = resolve_preload("docs")
    os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    target, draft = build_reference_pair()
    from vllm import LLM, SamplingParams

    from vllm_saguaro.vllm_glue.offline import engine_report

    llm = LLM(model=str(target), enforce_eager=True, seed=0, dtype="float32",
              max_model_len=2048, max_num_seqs=args.batch, disable_log_stats=False,
              speculative_config={"method": "saguaro", "draft_model": str(draft),
                                  "num_speculative_tokens": 3, "draft_dtype": "float32",
                                  "draft_head_tokens": HEAD_TOKENS, "log_stats_interval_s": 0})
    prompts = (humaneval_prompts() * args.batch)[:args.batch]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    rates = []
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        out = llm.generate(prompts, params, use_tqdm=False)
        rates.append(sum(len(o.outputs[0].token_ids) for o in out) / (time.perf_counter() - t0))
        print(f"[batch_wakes] batch {len(rates)}: {rates[-1]:.1f} tok/s", flush=True)
    draft_stats = engine_report(llm)["draft"]
    result = {"batch": args.batch, "batches": len(rates), "tok_s": [round(r, 1) for r in rates],
              "median_tok_s": round(statistics.median(rates), 1),
              "mean_tok_s": round(statistics.mean(rates), 1),
              **{k: draft_stats.get(k) for k in FIELDS}}
    print(json.dumps(result))
    write_json_out(args.json_out, result)
    return result


if __name__ == "__main__":
    main()
