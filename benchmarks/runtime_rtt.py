"""What one call to the draft worker costs in each runtime, beyond the worker's own work.

    python -m benchmarks.runtime_rtt [--calls 300] [--json-out FILE]

Starts the reference draft's worker (as the proposer does: its own core, the plugin's
config) once as a child process (draft_runtime 'process', the CPU default) and once as a
Ray actor ('ray'), and times calls from the target's side, alternating the two call for
call: `ping` (no work, a few bytes back: the bare round trip), `held` (a small dict) and
`threads` (the worker's threads read from /proc: ~2 KB back). A round of SSD makes one or
two such calls (step; prespeculate, whose reply is read a round later); what its payload
(q) costs through Ray's reply is benchmarks/q_transport.py's. Medians and 10-90%
spread, ms.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from benchmarks import write_json_out


def _config(draft: str, core: int) -> dict:
    from vllm_saguaro.config import SaguaroConfig

    return SaguaroConfig.model_validate(dict(
        draft_model=draft, num_speculative_tokens=3, draft_cpu_cores=[core])).to_json_dict()


def _spread(xs: list[float]) -> dict:
    xs = sorted(xs)
    pick = lambda f: round(1000 * xs[int(f * (len(xs) - 1))], 3)  # noqa: E731
    return {"median_ms": round(1000 * statistics.median(xs), 3), "p10_ms": pick(0.1),
            "p90_ms": pick(0.9)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--draft", help="draft checkpoint (default: the reference draft)")
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    from vllm_saguaro.draft.process_actor import ProcessRuntime
    from vllm_saguaro.draft.ray_actor import RayRuntime

    if args.draft:
        draft = args.draft
    else:
        from benchmarks.reference_pair import build_reference_pair

        draft = str(build_reference_pair()[1])
    from vllm_saguaro.draft.model import DraftSpec

    vocab = DraftSpec.from_dir(draft).vocab_size
    core = max(os.sched_getaffinity(0))
    runtimes = {"process": ProcessRuntime, "ray": RayRuntime}
    workers = {name: rt.start(_config(draft, core), vocab) for name, rt in runtimes.items()}
    for name, rt in runtimes.items():
        rt.get(workers[name].ping.remote(), 300)
    calls = ("ping", "held", "threads")  # the worker's own methods, without arguments
    times: dict[str, dict[str, list[float]]] = {n: {c: [] for c in calls} for n in runtimes}
    for _ in range(args.calls):
        for label in calls:
            for name, rt in runtimes.items():  # alternate, call for call
                t0 = time.perf_counter()
                rt.get(getattr(workers[name], label).remote(), 60)
                times[name][label].append(time.perf_counter() - t0)
    for name, rt in runtimes.items():
        rt.kill(workers[name])
    result = {name: {label: _spread(xs) for label, xs in per.items()} for name, per in times.items()}
    print("| call | process ms (p10-p90) | Ray ms (p10-p90) | Ray / process |")
    print("|---|---|---|---|")
    for label in calls:
        p, r = result["process"][label], result["ray"][label]
        print(f"| {label} | {p['median_ms']} ({p['p10_ms']}-{p['p90_ms']}) | {r['median_ms']} "
              f"({r['p10_ms']}-{r['p90_ms']}) | {r['median_ms'] / p['median_ms']:.1f} |")
    write_json_out(args.json_out, result)
    return result


if __name__ == "__main__":
    main()
