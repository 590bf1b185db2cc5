"""Throwaway: plain decoding under the plugin (paused) against plain vLLM at batch 4,
both engines resident, chunks alternating; per chunk the decode span and the target's
forward time at width 4 (patch_forward_timer), to split the gap into forward and the rest
of the step. Two blocks, the start order swapped."""
import os, json
from benchmarks import paired
from benchmarks.run import ENV, Settings, System, chunks, load_prompts, resolve_models, resolve_preload, log, plan_systems
from vllm_saguaro.vllm_glue.offline import engine_report
from vllm_saguaro.vllm_glue.vllm_logs import send_vllm_logs_to, send_engine_stderr_to

def fwd(llm):
    return engine_report(llm)["forward_s"]

if __name__ == "__main__":
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    send_vllm_logs_to("/tmp/fw/vllm.log"); send_engine_stderr_to("/tmp/fw/vllm.log")
    args = paired.parse_args(["--batches", "4", "--temperatures", "0"])
    cores = sorted(os.sched_getaffinity(0))
    s = Settings("paired", 64, [4], [0.0], [3], 8, 8, pair=cores, ld_preload=resolve_preload("docs"))
    from benchmarks.reference_pair import HEAD_TOKENS
    s.head_tokens = HEAD_TOKENS
    target, draft = resolve_models(args)
    prompts = load_prompts(args, target, s)
    from vllm import SamplingParams
    from contextlib import ExitStack
    ar = System("ar", cores=2)
    ssd = {x.name: x for x in plan_systems(s) if x.kind == "ssd"}["SSD-K3"]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    out = []
    for block, plugin_first in enumerate((True, False)):
        with ExitStack() as st:
            eng = lambda sysm, spec: st.enter_context(paired.engine(sysm, spec, prompts, target, s))
            if plugin_first:
                plug = eng(ssd, ssd.spec(draft, s)); plain = eng(ar, None)
            else:
                plain = eng(ar, None); plug = eng(ssd, ssd.spec(draft, s))
            paired.set_paused(plug, True)
            for i, chunk in enumerate((chunks(prompts["mt_bench"], 4) + chunks(prompts["humaneval"], 4)) * 2):
                rec = {"block": block, "plugin_first": plugin_first}
                for name in (("plain", "plug") if i % 2 == 0 else ("plug", "plain")):
                    llm = plain if name == "plain" else plug
                    f0 = fwd(llm)
                    r = paired.run_chunk(llm, chunk, sp, 64, cold=True)
                    f1 = fwd(llm)
                    n = f1.get("4", f1.get(4, (0, 0)))[0] - f0.get("4", f0.get(4, (0, 0)))[0]
                    sec = f1.get("4", f1.get(4, (0, 0)))[1] - f0.get("4", f0.get(4, (0, 0)))[1]
                    rec[name] = {"span_s": r["span_s"], "fwd4_n": n, "fwd4_ms": 1000 * sec / max(n, 1),
                                 "step_ms": 1000 * r["span_s"] / 63}
                log(f"block {block} chunk {i}: plain {rec['plain']['step_ms']:.1f} ms/step (fwd {rec['plain']['fwd4_ms']:.1f}), "
                    f"plugin paused {rec['plug']['step_ms']:.1f} (fwd {rec['plug']['fwd4_ms']:.1f})")
                out.append(rec)
            json.dump(out, open("/tmp/fw/fw.json", "w"), indent=1)
