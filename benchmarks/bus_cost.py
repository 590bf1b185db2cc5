"""What the draft's work on its own core costs the target's forward (the shared memory bus).

    python -m benchmarks.bus_cost [--rounds 3] [--tokens 48] [--batches 1,4] [--out DIR]

Plain vLLM (the target alone, bound by VLLM_CPU_OMP_THREADS_BIND to the first core)
decodes while the second core is idle and while it runs the reference draft's forward in
a loop (one thread, its own process, the width of a tree decode), alternated. The target's
forward time per width comes from the plugin's forward timer (patches.patch_forward_timer),
so only the model forward is compared, not scheduling. Writes bus_cost.json / .md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.run import ENV, environment, forward_ms, log
from vllm_saguaro.core.placement import BIND_ENV, omp_env
from vllm_saguaro.vllm_glue.offline import engine_report, shutdown

LOAD = """
import os, sys, torch
from vllm_saguaro.core.placement import bind_process
from vllm_saguaro.draft.model import DraftModel
bind_process([int(sys.argv[2])]); torch.set_num_threads(1)
m = DraftModel(sys.argv[1], torch.float32, head_tokens=16384)
ids = torch.randint(0, 1000, (8, 4)); pos = torch.arange(4).expand(8, 4)
print("ready", flush=True)
while True:
    h, _ = m.forward(ids, pos, None)
    m.logits(h)
"""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="idle/busy alternations")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--out", default="benchmarks/results/bus_cost")
    args = ap.parse_args(argv)
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # bound by vLLM, as a user runs it
    from vllm import LLM, SamplingParams

    from benchmarks.reference_pair import build_reference_pair

    target, draft = build_reference_pair()
    cores = sorted(os.sched_getaffinity(0))[:2]
    with environment({BIND_ENV: str(cores[0])}):
        llm = LLM(model=str(target), enforce_eager=True, dtype="float32", max_model_len=2048,
                  seed=0, disable_log_stats=False)
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = ["Write a poem about the sea.", "def add(a, b):", "Explain photosynthesis.",
               "List three uses of copper."]
    llm.generate(prompts[:1], sp, use_tqdm=False)  # warm-up
    rows: dict[str, list[float]] = {}
    load = None
    try:
        for r in range(2 * args.rounds):
            busy = r % 2 == 1
            if busy:
                load = subprocess.Popen([sys.executable, "-c", LOAD, str(draft), str(cores[1])],
                                        stdout=subprocess.PIPE, text=True,
                                        env=dict(os.environ, **omp_env(cores[1:])))
                assert load.stdout.readline().strip() == "ready"
                time.sleep(1.0)
            for b in batches:
                before = engine_report(llm)
                llm.generate([prompts[i % len(prompts)] for i in range(b)], sp, use_tqdm=False)
                for w, ms in forward_ms(before, engine_report(llm)).items():
                    rows.setdefault(f"{'busy' if busy else 'idle'}:{w}", []).append(ms)
            if load is not None:
                load.kill()
                load.wait()
                load = None
            log(f"round {r + 1}/{2 * args.rounds} ({'draft load on' if busy else 'idle'} "
                f"core {cores[1]}) done")
    finally:
        if load is not None:
            load.kill()
        shutdown(llm)
    widths = sorted({k.split(":")[1] for k in rows}, key=int)
    table = []
    for w in widths:
        idle, busy = rows.get(f"idle:{w}", []), rows.get(f"busy:{w}", [])
        if idle and busy:
            mi, mb = statistics.median(idle), statistics.median(busy)
            table.append({"width": int(w), "idle_ms": mi, "busy_ms": mb, "ratio": mb / mi,
                          "idle_all": idle, "busy_all": busy})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bus_cost.json").write_text(json.dumps({"cores": cores, "rows": table}, indent=1))
    lines = ["| width (tokens/step) | target forward, core 1 idle (ms) | with the draft's load "
             "on core 1 (ms) | ratio |", "|---|---|---|---|"]
    lines += [f"| {t['width']} | {t['idle_ms']:.1f} | {t['busy_ms']:.1f} | {t['ratio']:.3f} |"
              for t in table]
    (out / "bus_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
