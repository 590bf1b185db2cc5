"""Throwaway A/A check of --beside-vllm: two plain vLLM engines resident, chunks alternating.
A ratio of ~1.0 says the resident setup itself favours neither engine (nor the first started)."""
import os, sys, json
from benchmarks import paired
from benchmarks.run import ENV, Settings, System, chunks, load_prompts, resolve_models, resolve_preload, log
from vllm_saguaro.vllm_glue.vllm_logs import send_vllm_logs_to, send_engine_stderr_to

if __name__ == "__main__":
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    send_vllm_logs_to("/tmp/aa/vllm.log"); send_engine_stderr_to("/tmp/aa/vllm.log")
    args = paired.parse_args(["--batches", "4,16", "--temperatures", "0"])
    cores = sorted(os.sched_getaffinity(0))
    s = Settings("paired", 64, [4, 16], [0.0], [3], 8, 8, pair=cores, ld_preload=resolve_preload("docs"))
    from benchmarks.reference_pair import HEAD_TOKENS
    s.head_tokens = HEAD_TOKENS
    target, draft = resolve_models(args)
    prompts = load_prompts(args, target, s)
    from vllm import SamplingParams
    ar = System("ar", cores=2)
    out = {}
    with paired.engine(ar, None, prompts, target, s) as a, paired.engine(ar, None, prompts, target, s) as b:
        for batch, reps in ((4, 3), (16, 6)):
            sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
            ratios = []
            for i, chunk in enumerate(chunks(prompts["mt_bench"], batch) * reps + chunks(prompts["humaneval"], batch) * reps):
                order = (a, b) if i % 2 == 0 else (b, a)
                r = {}
                for llm in order:
                    r[id(llm)] = paired.run_chunk(llm, chunk, sp, 64, cold=True)
                ratios.append(r[id(a)]["span_s"] / r[id(b)]["span_s"])  # B's tok/s over A's
                log(f"b={batch} pair {i}: A {r[id(a)]['tok_s']:.1f} B {r[id(b)]['tok_s']:.1f}")
            out[batch] = paired.ratio_interval(ratios)
            log(f"b={batch}: second-started / first-started {out[batch]}")
    json.dump(out, open("/tmp/aa/aa.json", "w"), indent=1)
