"""CPU time of each op (vllm_saguaro/ops) against what the draft worker runs today.

    python -m benchmarks.ops_timing [--rows 16] [--vocab 16384] [--threads 1] [--out F]

Shapes of the reference pair at batch `rows`: the draft head's 16k tokens, K = 7, the
default fan-out. Prints the median of --repeats timings per op (ms) and writes JSON.
The Triton kernels are not timed here: on CPU they only run under the interpreter.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from vllm_saguaro.core.cache import Speculation, SpeculationCache
from vllm_saguaro.core.outcome import Outcome
from vllm_saguaro.core.sampling import SamplingSpec, draft_distribution, quantize_distribution
from vllm_saguaro.ops.cache_lookup import cache_lookup_reference
from vllm_saguaro.ops.fork import fork_candidates_reference
from vllm_saguaro.ops.saguaro_sampling import saguaro_sample_reference


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--fanout", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    R, V = a.rows, a.vocab
    logits = torch.randn(R, V, generator=gen) * 3
    fan = torch.full((R,), a.fanout)
    spec = SamplingSpec(0.8, 0, 0.95)
    out = {"rows": R, "vocab": V, "threads": a.threads, "ms": {}}

    def today_sample():  # DraftWorker._choose for one group of unseeded rows
        q = quantize_distribution(draft_distribution(logits, spec, fan, 0.5))
        torch.multinomial(q, 1, generator=gen)

    def op_sample():
        saguaro_sample_reference(logits, torch.full((R,), 0.8), torch.zeros(R, dtype=torch.long),
                                 torch.full((R,), 0.95), fan, 0.5,
                                 torch.randint(0, 2**62, (R,), generator=gen))

    P = R * (a.k + 1)
    glue = torch.randn(P, V, generator=gen)
    drafted = torch.randint(0, V, (P,), generator=gen)

    def today_fork():  # draft/fork.py fanout_roots, per position
        for j in range(P):
            top = torch.topk(glue[j], a.fanout + 1).indices.tolist()
            [x for x in top if x != int(drafted[j])][: a.fanout]

    def op_fork():
        fork_candidates_reference(glue, drafted, torch.full((P,), a.fanout), a.fanout)

    n = R * 21
    keys = torch.stack([torch.randint(0, R, (n,)), torch.randint(0, a.k + 1, (n,)),
                        torch.randint(0, V, (n,))], dim=-1)
    caches = [SpeculationCache() for _ in range(R)]
    for row, k, t in keys.tolist():
        caches[row].put(Outcome(k, t), Speculation([0]))
    queries = keys[torch.randint(0, n, (R,))]
    queries[:, 0] = torch.arange(R)

    def today_lookup():
        for row, k, t in queries.tolist():
            caches[row].lookup(Outcome(k, t))

    def op_lookup():
        cache_lookup_reference(keys, queries)

    for name, today, op in [("saguaro_sample", today_sample, op_sample),
                            ("fork_candidates", today_fork, op_fork),
                            ("cache_lookup", today_lookup, op_lookup)]:
        t_today, t_op = _median_ms(today, a.repeats), _median_ms(op, a.repeats)
        out["ms"][name] = {"worker_today": round(t_today, 3), "op_reference": round(t_op, 3)}
        print(f"{name:16s} worker today {t_today:8.3f} ms   op (torch reference) {t_op:8.3f} ms"
              f"   ratio {t_op / t_today:5.2f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
