"""The draft worker's fallback draft and pre-speculation, GPU against CPU (both eager), on
the tiny test target (tests/tiny_models.py): stage 5 of scripts/gpu_check.sh.

    python3 scripts/gpu_worker_timing.py [--batches 1,4,16] [--reps 5] [--out F]

Per device and batch: a fresh worker prefills `--context` random tokens per sequence, then
each round pre-speculates (geometric fan-out, budget 8, K = 3) and steps with an outcome
nobody cached, so the fallback drafts K tokens. Medians of --reps rounds after one warm-up
round (Triton compiles there), synchronized on the GPU. The tiny model (2 layers, 128 wide,
512 tokens) measures the worker's overheads (launches, syncs, Python), not a draft's
arithmetic.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.tiny_models import make_tiny_llama  # noqa: E402
from vllm_saguaro.config import SaguaroConfig  # noqa: E402
from vllm_saguaro.core.outcome import Outcome  # noqa: E402
from vllm_saguaro.draft.worker import DraftWorker  # noqa: E402


def measure(path: Path, device: str, dtype: str, batch: int, context: int, reps: int,
            hook=None) -> dict:
    cfg = dict(draft_model=str(path), num_speculative_tokens=3, draft_device=device,
               draft_dtype=dtype, fallback="neural", controller={"policy": "fixed"},
               fanout={"policy": "geometric", "budget": 8, "fit_to_round": False,
                       "fit_acceptance": False})
    w = DraftWorker(SaguaroConfig.model_validate(cfg).to_json_dict(), 512, bind=False)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    rng = random.Random(0)
    rids = [f"r{i}" for i in range(batch)]
    w.step([(r, None, [rng.randrange(10, 500) for _ in range(context)], None) for r in rids], [])
    prespec, fallback = [], []
    for rep in range(reps + 1):
        if rep == 1 and hook is not None:  # after the warm-up round
            hook.__enter__()
        sync()
        t0 = time.perf_counter()
        w.prespeculate()
        sync()
        prespec.append(time.perf_counter() - t0)
        ups = []
        for r in rids:  # k = 0 with a bonus no branch holds: a miss, the fallback drafts
            st = w.seqs[r]
            cached = st.cache.entries if st.cache is not None else {}
            bonus = next(t for t in range(10, 512)
                         if Outcome(0, t) not in cached and (not st.spec or t != st.spec[0]))
            ups.append((r, [bonus], None, None))
        sync()
        t0 = time.perf_counter()
        w.step(ups, [])
        sync()
        fallback.append(time.perf_counter() - t0)
    if hook is not None:
        sync()
        hook.__exit__(None, None, None)
    ms = lambda xs: round(1000 * statistics.median(xs[1:]), 3)  # noqa: E731 (first: warm-up)
    return {"device": device, "dtype": dtype, "batch": batch, "fanout": list(w.fanout),
            "prespec_ms": ms(prespec), "fallback_ms": ms(fallback),
            "weights": w.model.quantization, "prespec_runs": w.stats.prespec_runs,
            "ops_forks": w.stats.ops_forks}


def profile(path: Path, device: str, dtype: str, batch: int, context: int, reps: int) -> None:
    """Where one setup's rounds go: Python (cProfile: Triton compiles, syncs, loops) and the
    device (torch.profiler), after the warm-up round."""
    import cProfile
    import contextlib
    import pstats

    prof = cProfile.Profile()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    tp = torch.profiler.profile(activities=acts)

    @contextlib.contextmanager
    def both():
        with tp:
            prof.enable()
            try:
                yield
            finally:
                prof.disable()

    r = measure(path, device, dtype, batch, context, reps, hook=both())
    print(f"{device} {dtype} batch {batch}: prespec {r['prespec_ms']} ms, "
          f"fallback {r['fallback_ms']} ms")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    if device.startswith("cuda"):  # and where the device's own time goes
        print(tp.key_averages().table(sort_by="self_cuda_time_total", row_limit=20))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default=None, metavar="DEVICE:DTYPE:BATCH",
                    help="instead of the table: cProfile (top 30 by cumulative time) and "
                         "torch.profiler (top 20 by self CPU time, on CUDA by device time "
                         "too) of --reps rounds of one setup, e.g. cuda:0:bfloat16:4")
    a = ap.parse_args(argv)
    if a.profile:
        *dev, dtype, batch = a.profile.split(":")
        with tempfile.TemporaryDirectory(prefix="gpu_worker_timing_") as tmp:
            profile(make_tiny_llama(Path(tmp) / "target"), ":".join(dev), dtype, int(batch),
                    a.context, a.reps)
        return 0
    setups = [("cpu", "float32")]
    if torch.cuda.is_available():
        setups += [("cuda:0", "float32"), ("cuda:0", "bfloat16")]
    else:
        print("gpu_worker_timing: torch sees no CUDA device: CPU only", flush=True)
    out = {"torch": torch.__version__, "cpu_threads": torch.get_num_threads(),
           "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
           "context": a.context, "reps": a.reps, "rows": []}
    with tempfile.TemporaryDirectory(prefix="gpu_worker_timing_") as tmp:
        path = make_tiny_llama(Path(tmp) / "target")
        print(f"{'device':8s} {'dtype':9s} {'batch':>5s} {'prespec ms':>11s} {'fallback ms':>12s}")
        for device, dtype in setups:
            for batch in map(int, a.batches.split(",")):
                r = measure(path, device, dtype, batch, a.context, a.reps)
                out["rows"].append(r)
                print(f"{device:8s} {dtype:9s} {batch:5d} {r['prespec_ms']:11.3f} "
                      f"{r['fallback_ms']:12.3f}", flush=True)
                if a.out:
                    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if torch.cuda.is_available() else 1


if __name__ == "__main__":
    sys.exit(main())
