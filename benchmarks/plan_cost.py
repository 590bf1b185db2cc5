"""What the controller's plan costs per step: choose_lengths on a batch of lookup-draft
candidates (the idle lookup plans every idle step, core/idle_lookup.py), by batch size.

  python -m benchmarks.plan_cost [--batches 16,64,256] [--against OLD/controller.py]

--against times another version of core/controller.py in the same process (e.g.
`git show f8c823c:vllm_saguaro/core/controller.py > /tmp/old.py`), so the two figures
are comparable. Rows match 0, 0, 1 or 3 tokens or may send nothing, at random (seed 0);
the target's step is 36 ms + 1 ms a token, the CPU line of the reference target.
"""
from __future__ import annotations

import argparse
import importlib.util
import random
import sys
import time

RATES = (0.02, 0.15, 0.35, 0.8)  # a lookup token's acceptance by match length 0..3


def load(path: str):
    spec = importlib.util.spec_from_file_location("controller_against", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def per_step_ms(mod, matches: list[int | None], k: int = 3) -> float:
    cands = [mod.Candidate() if m is None else mod.Candidate(free=(RATES[m],) * k, cap=k)
             for m in matches]
    line = lambda w: 0.036 + 0.001 * w  # noqa: E731
    reps, t0 = 0, time.perf_counter()
    while reps < 5 or time.perf_counter() - t0 < 0.5:
        mod.choose_lengths(cands, line, lambda rows: 0.0)
        reps += 1
    return 1e3 * (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="16,64,256")
    ap.add_argument("--against", help="another core/controller.py to time beside this one")
    args = ap.parse_args()
    from vllm_saguaro.core import controller

    versions = [("this", controller)] + ([("against", load(args.against))] if args.against else [])
    rng = random.Random(0)
    print("| batch | " + " | ".join(f"{name} (ms a step)" for name, _ in versions) + " |")
    print("|---|" + "---|" * len(versions))
    for b in (int(x) for x in args.batches.split(",")):
        matches = [rng.choice([0, 0, 1, 3, None]) for _ in range(b)]
        cells = " | ".join(f"{per_step_ms(mod, matches):.3f}" for _, mod in versions)
        print(f"| {b} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
