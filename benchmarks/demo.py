"""The main job on a fresh machine: Saguaro SSD on the CPU reference pair, beside the target.

    python -m benchmarks.demo [--prompts 6] [--max-tokens 64] [-k 3] [--budget 4]

Builds the reference pair if needed, then decodes MT-Bench and HumanEval prompts at batch
1, greedy, with plain vLLM bound to one core and to both (VLLM_CPU_OMP_THREADS_BIND), the
plugin's synchronous SD and Saguaro SSD (started as a user starts them: the plugin puts
the target on one core and the draft worker on the other), and prints decode speed,
speedup, cache hit rate and acceptance length. It is benchmarks/run.py with a small
preset; results go to benchmarks/results/demo/.
"""
from __future__ import annotations

import argparse
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "demo"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=6, help="prompts per set (MT-Bench, HumanEval)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("-k", type=int, default=3, help="draft tokens per round")
    ap.add_argument("--budget", type=int, default=4, help="geometric fan-out budget")
    args = ap.parse_args(argv)

    from benchmarks.run import main as run_benchmark

    k = args.k
    run_benchmark(["--quick", "--systems", f"AR,AR-2c,sync-SD-K{k},SSD-K{k}", "--batches", "1",
                   "--ks", str(k), "--budget", str(args.budget),
                   "--max-tokens", str(args.max_tokens),
                   "--prompts-per-set", str(args.prompts), "--out", str(OUT)])
    print((OUT / "latest.md").read_text())


if __name__ == "__main__":
    main()
