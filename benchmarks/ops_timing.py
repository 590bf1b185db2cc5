"""CPU time of each op (vllm_saguaro/ops) against what the draft worker runs today.

    python -m benchmarks.ops_timing [--rows 16] [--vocab 16384] [--threads 1] [--out F]

Shapes of the reference pair at batch `rows`: the draft head's 16k tokens, K = 7, the
default fan-out. Prints the median of --repeats timings per op (ms) and writes JSON.
The Triton kernels are not timed here: on CPU they only run under the interpreter.

Backends on a device (scripts/gpu_check.sh, on a GPU):

    python -m benchmarks.ops_timing --device cuda --backends torch,triton,cuda \
        --rows 16,64 --vocab 16384,151936 --out F

times each implementation of each op on that device (`worker`: the worker's own CPU-path
code there; `torch`: the references; `triton`; `cuda`: the csrc/ ops, where built; the
fork has none), after a warm-up (Triton's compile excluded), synchronizing around every
call, and says whether its tokens / indices equal the reference's. On CPU, Triton runs
only under TRITON_INTERPRET=1 (set before the run; slow, one timing).
"""
from __future__ import annotations

import argparse
import json
import os
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


def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=_ints, default=[16], help="rows (several: 16,64 with --backends)")
    ap.add_argument("--vocab", type=_ints, default=[16384], help="vocabulary (several with --backends)")
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--fanout", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N] (backend timings)")
    ap.add_argument("--backends", default=None, help=f"comma list of {BACKEND_NAMES}: time "
                    "these implementations on --device (default on cuda: torch,triton,cuda)")
    a = ap.parse_args(argv)
    if a.backends is not None or a.device != "cpu":
        return backends_main(a, ap)
    if len(a.rows) != 1 or len(a.vocab) != 1:
        ap.error("several --rows / --vocab values need --backends")
    a.rows, a.vocab = a.rows[0], a.vocab[0]
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


BACKEND_NAMES = ("worker", "torch", "triton", "cuda")


def _timer(device: torch.device):
    """median ms of fn over `repeats` calls after `warmup` (compiles, caches), each call
    synchronized on a GPU."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def median_ms(fn, repeats: int, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return median_ms


def _unavailable(name: str, device: torch.device) -> str | None:
    """Why backend `name` cannot run on `device` (None: it can)."""
    if name == "triton":
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            return "Triton is not installed"
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return "Triton needs a CUDA device (or TRITON_INTERPRET=1: the interpreter, on CPU)"
    if name == "cuda":
        from vllm_saguaro.ops import cuda

        if device.type != "cuda":
            return "the CUDA ops need --device cuda"
        if not cuda.available():
            return "vllm_saguaro._C is not built (setup.py build_ext with a CUDA toolkit)"
    return None


def backends_main(a, ap) -> dict:
    """Each op's implementations timed on a.device (see the module docstring)."""
    from vllm_saguaro.ops import cuda
    from vllm_saguaro.ops.cache_lookup import cache_lookup_triton
    from vllm_saguaro.ops.fork import fork_candidates_triton
    from vllm_saguaro.ops.saguaro_sampling import saguaro_sample_triton

    names = [b for b in (a.backends or "torch,triton,cuda").split(",") if b]
    bad = [b for b in names if b not in BACKEND_NAMES]
    if bad:
        ap.error(f"--backends {bad}: use some of {BACKEND_NAMES}")
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {a.device}: torch sees no CUDA device")
    if device.type == "cpu":
        torch.set_num_threads(a.threads)
    skipped = {b: r for b in names if (r := _unavailable(b, device))}
    for b, why in skipped.items():
        print(f"{b}: skipped, {why}")
    interp = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    median_ms = _timer(device)
    out = {"device": str(device), "threads": a.threads, "repeats": a.repeats,
           "torch": torch.__version__, "backends": names, "skipped": skipped, "results": []}
    if device.type == "cuda":
        out["device_name"] = torch.cuda.get_device_name(device)
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError:
        pass
    run = [b for b in names if b not in skipped]
    for R in a.rows:
        for V in a.vocab:
            gen = torch.Generator().manual_seed(0)
            logits = (torch.randn(R, V, generator=gen) * 3).to(device)
            temp = torch.full((R,), 0.8, device=device)
            top_k = torch.zeros(R, dtype=torch.long, device=device)
            top_p = torch.full((R,), 0.95, device=device)
            fan = torch.full((R,), a.fanout, device=device)
            seeds = torch.randint(0, 2**62, (R,), generator=gen).to(device)
            spec = SamplingSpec(0.8, 0, 0.95)
            sample_args = (logits, temp, top_k, top_p, fan, 0.5, seeds)
            P = R * (a.k + 1)
            glue = torch.randn(P, V, generator=gen).to(device)
            drafted = torch.randint(0, V, (P,), generator=gen).to(device)
            pfan = torch.full((P,), a.fanout, device=device)
            n = R * 21
            keys = torch.stack([torch.randint(0, R, (n,), generator=gen),
                                torch.randint(0, a.k + 1, (n,), generator=gen),
                                torch.randint(0, V, (n,), generator=gen)], dim=-1)
            queries = keys[torch.randint(0, n, (R,), generator=gen)]
            queries[:, 0] = torch.arange(R)
            caches = [SpeculationCache() for _ in range(R)]
            for row, k, t in keys.tolist():
                caches[row].put(Outcome(k, t), Speculation([0]))
            keys, queries = keys.to(device), queries.to(device)

            def worker_sample():  # DraftWorker._choose's per-group code, on this device
                q = quantize_distribution(draft_distribution(logits, spec, fan, 0.5))
                return torch.multinomial(q, 1)[:, 0]

            def worker_fork():  # draft/fork.py's loop per position
                for j in range(P):
                    top = torch.topk(glue[j], a.fanout + 1).indices.tolist()
                    [x for x in top if x != int(drafted[j])][: a.fanout]

            def worker_lookup():
                for row, k, t in queries.tolist():
                    caches[row].lookup(Outcome(k, t))

            impls = {
                "saguaro_sample": {
                    "worker": worker_sample,
                    "torch": lambda: saguaro_sample_reference(*sample_args),
                    "triton": lambda: saguaro_sample_triton(*sample_args),
                    "cuda": lambda: cuda.saguaro_sample_cuda(*sample_args)},
                "fork_candidates": {
                    "worker": worker_fork,
                    "torch": lambda: fork_candidates_reference(glue, drafted, pfan, a.fanout),
                    "triton": lambda: fork_candidates_triton(glue, drafted, pfan, a.fanout),
                    "cuda": None},  # no CUDA op: Triton runs the fork under "cuda"
                "cache_lookup": {
                    "worker": worker_lookup,
                    "torch": lambda: cache_lookup_reference(keys, queries),
                    "triton": lambda: cache_lookup_triton(keys, queries),
                    "cuda": lambda: cuda.cache_lookup_cuda(keys, queries)},
            }
            for op, fns in impls.items():
                entry = {"rows": R, "vocab": V, "op": op, "ms": {}, "agree": {}}
                ref = fns["torch"]() if any(b in run for b in ("triton", "cuda")) else None
                for b in run:
                    fn = fns[b]
                    if fn is None:
                        entry["ms"][b] = None
                        continue
                    reps, warm = (1, 1) if (b == "triton" and interp) else (a.repeats, 2)
                    if b == "worker":  # python loops over rows: fewer repeats
                        reps = max(3, min(reps, 10))
                    entry["ms"][b] = round(median_ms(fn, reps, warm), 4)
                    if b in ("triton", "cuda") and ref is not None:
                        got = fn()
                        got_t = got[0] if isinstance(got, tuple) else got
                        ref_t = ref[0] if isinstance(ref, tuple) else ref
                        entry["agree"][b] = bool(torch.equal(got_t.cpu(), ref_t.cpu()))
                out["results"].append(entry)
                cells = "  ".join(
                    f"{b} {'-' if entry['ms'][b] is None else format(entry['ms'][b], '9.3f')}"
                    + ("" if b not in entry["agree"] else (" =" if entry["agree"][b] else " DIFFERS"))
                    for b in run)
                print(f"rows {R:4d} vocab {V:7d} {op:16s} ms: {cells}", flush=True)
            if a.out:  # after every shape: a run cut short keeps what it measured
                with open(a.out, "w") as f:
                    json.dump(out, f, indent=2)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
