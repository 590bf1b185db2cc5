"""How fast the target's GEMMs run on cores the draft lends (patches.patch_lent_gemms).

vLLM's oneDNN primitives keep the thread count they were created with, so a team grown
from 1 to 2 threads needs GEMMs under keys of their own. This times the reference target's
layer GEMMs (30 layers x qkv, o, gate_up, down; fp32) at one width, each way, in a fresh
process bound the way vLLM binds a worker that lends (Intel OpenMP's proclist of both
cores, a team of one to start):

  two-threads  a team of two from the start (plain vLLM on two cores)
  grown        grown to two after one-thread primitives were made, no new key (the bug)
  zero-bias    grown, a zero bias as the new key (what the plugin does)
  strided      grown, a padded row stride as the new key (the plugin's fallback)

Runs alternate, repeats times each; prints min / median / max ms per step and writes JSON.
  python -m benchmarks.lent_gemms --repeats 4 --width 16 --out lent_gemms.json
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

MODES = ("two-threads", "grown", "zero-bias", "strided")
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out) of the reference target
LAYERS = 30


def child(mode: str, width: int, steps: int) -> float:
    """In the bound process: the median seconds of one step of every layer's GEMMs."""
    import torch
    from vllm import _custom_ops as ops

    from vllm_saguaro.vllm_glue.lending import rekey_bias, rekey_input

    torch.manual_seed(0)
    handlers = [ops.create_onednn_mm(torch.randn(n, k).t(), 32)
                for _ in range(LAYERS) for (k, n) in SHAPES]
    xs = {k: torch.randn(width, k) for k, _ in SHAPES}

    def step(key: str | None) -> None:
        for h in handlers:
            x = xs[h.k]
            if key == "zero-bias":
                ops.onednn_mm(h, x, rekey_bias(h.n, x.dtype))
            else:
                ops.onednn_mm(h, rekey_input(x) if key == "strided" else x, None)

    if mode != "two-threads":
        step(None)  # the one-thread primitives vLLM's worker makes first
        torch._C.set_num_threads(2)
    key = mode if mode in ("zero-bias", "strided") else None
    for _ in range(5):
        step(key)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step(key)
        times.append(time.perf_counter() - t)
    assert torch.get_num_threads() == 2
    return statistics.median(times)


def run_mode(mode: str, width: int, steps: int, preload: str | None) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "2" if mode == "two-threads" else "1",
           "KMP_AFFINITY": "granularity=fine,explicit,proclist=[0,1]",
           "KMP_BLOCKTIME": "5", "KMP_TPAUSE": "0"}
    if preload:
        env["LD_PRELOAD"] = preload
    code = ("import sys; from benchmarks.lent_gemms import child; "
            f"print('STEP', child({mode!r}, {width}, {steps}))")
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, text=True,
                          capture_output=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("STEP ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{mode}: the timing process failed:\n{proc.stderr[-2000:]}")
    return float(lines[-1].split()[1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=4, help="processes per mode (alternated)")
    p.add_argument("--width", type=int, default=16, help="tokens per step (GEMM rows)")
    p.add_argument("--steps", type=int, default=100, help="timed steps per process")
    p.add_argument("--ld-preload", default="docs",
                   help="'docs' (tcmalloc + Intel OpenMP, as the CPU docs say), 'none', or a value")
    p.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = p.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0):
        raise SystemExit("needs cores 0 and 1")
    from benchmarks.run import resolve_preload

    preload = resolve_preload(args.ld_preload)
    figures: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.repeats):
        for mode in MODES:
            figures[mode].append(run_mode(mode, args.width, args.steps, preload) * 1e3)
            print(f"[{r + 1}/{args.repeats}] {mode:12s} {figures[mode][-1]:6.1f} ms/step",
                  flush=True)
    print(f"\n{LAYERS * len(SHAPES)} GEMMs at width {args.width}, ms per step "
          f"(min / median / max of {args.repeats} processes):")
    for mode in MODES:
        t = figures[mode]
        print(f"  {mode:12s} {min(t):6.1f} / {statistics.median(t):6.1f} / {max(t):6.1f}")
    if args.out:
        args.out.write_text(json.dumps({"width": args.width, "steps": args.steps,
                                        "ms_per_step": figures}, indent=1))


if __name__ == "__main__":
    main()
