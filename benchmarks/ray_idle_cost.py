"""What an idle Ray cluster beside the target costs plain decoding on both cores.

While the controller leaves the draft idle, SSD decodes plainly on every core, the draft's
included, and there Ray's daemons and the idle draft actor wake some 500 times a second
(README, "Where the threads run on CPU"). This measures that cost alone: one plain vLLM
engine on both cores (AR-2c, started as benchmarks.run starts it) decodes the same prompts
in rounds, with and without a Ray cluster started as the plugin starts it (its defaults,
its daemons on the last core, one idle zero-CPU actor) in another process. The engine stays
up, so the engine-start spread (20-40% at batch 16 here) is out of the ratio; the order
rotates per round. --quiet adds a third mode, Ray with a candidate remedy.

    python -m benchmarks.ray_idle_cost --batch 1 --rounds 6 --out benchmarks/results/ray_idle_cost
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

ROOT = Path(__file__).resolve().parent.parent


# --quiet: a candidate remedy, measured here before it goes into the plugin: Ray's periodic
# work made less frequent (every 100-200 ms by default: resource reports, GC check, object
# manager timer, disk check, idle-worker reaper; task events, metrics, event stats) and
# the daemons no round waits on (not the raylet: the draft's worker inherits its
# priority) at nice 19.
QUIET_ENV = {"RAY_raylet_report_resources_period_milliseconds": "1000",
             "RAY_raylet_check_gc_period_milliseconds": "1000",
             "RAY_object_manager_timer_freq_ms": "1000", "RAY_local_fs_monitor_interval_ms": "5000",
             "RAY_kill_idle_workers_interval_ms": "1000", "RAY_task_events_report_interval_ms": "5000",
             "RAY_metrics_report_interval_ms": "60000", "RAY_event_stats": "0"}
QUIET_DAEMONS = ("gcs_server", "monitor", "dashboard", "log_monitor")
QUIET_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def nice_quiet_daemons() -> int:
    """nice 19 for every thread of QUIET_DAEMONS and of the raylet's QUIET_AGENTS."""
    import ray

    procs = ray._private.worker._global_node.all_processes
    pids = [i.process.pid for kind in QUIET_DAEMONS for i in procs.get(kind, [])]
    raylets = {i.process.pid for i in procs.get("raylet", [])}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = Path(f"/proc/{entry}/cmdline").read_text()
        except (OSError, ValueError):
            continue
        if ppid in raylets and cmd.startswith(QUIET_AGENTS):
            pids.append(int(entry))
    changed = 0
    for pid in pids:
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.setpriority(os.PRIO_PROCESS, int(tid), 19)
                changed += 1
        except OSError:  # gone meanwhile
            continue
    return changed


def hold(core: int, ready: Path, quiet: bool) -> None:
    """Ray as the plugin starts it, on `core`, with one idle actor; until killed."""
    import ray

    from vllm_saguaro.draft.ray_actor import start_ray

    if quiet:
        os.environ.update(QUIET_ENV)
    start_ray([core])
    if quiet:
        nice_quiet_daemons()

    @ray.remote(num_cpus=0, max_concurrency=2)
    class Idle:
        def ping(self) -> int:
            return os.getpid()

    actor = Idle.remote()
    ray.get(actor.ping.remote())
    ready.write_text("1")
    time.sleep(24 * 3600)


def start_holder(core: int, ready: Path, quiet: bool, settle_s: float = 3.0) -> subprocess.Popen:
    ready.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("VLLM")}
    env["RAY_AUTH_MODE"] = "disabled"
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.ray_idle_cost", "--hold", str(core),
                             "--ready", str(ready)] + (["--quiet"] if quiet else []), cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the Ray holder did not start")
        time.sleep(0.3)
    time.sleep(settle_s)  # its start-up work done
    return proc


def stop_holder(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "ray"), "stop", "--force"],
                   capture_output=True)
    time.sleep(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1, help="requests decoded together")
    ap.add_argument("--rounds", type=int, default=6, help="paired rounds (each mode once per round)")
    ap.add_argument("--prompts", type=int, default=8, help="per round (half HumanEval, half MT-Bench)")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per request")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/ray_idle_cost"),
                    help="where bN[_quiet].json and vLLM's log (vllm.log) go")
    ap.add_argument("--quiet", action="store_true",
                    help="also measure Ray with the candidate remedy (QUIET_ENV, daemons at nice 19)")
    ap.add_argument("--hold", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--ready", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.hold is not None:
        hold(args.hold, args.ready, args.quiet)
        return
    if args.batch < 1 or args.rounds < 1 or args.prompts < 2 or args.max_tokens < 2:
        ap.error("--batch and --rounds must be >= 1, --prompts and --max-tokens >= 2")
    args.out.mkdir(parents=True, exist_ok=True)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs 2 cores: the target on both, Ray's daemons on the last")
    from benchmarks.run import resolve_preload

    os.environ.update({"LD_PRELOAD": resolve_preload("docs"), "VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}-{cores[-1]}",
                       "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"})
    from vllm_saguaro.vllm_glue.vllm_logs import send_vllm_logs_to

    send_vllm_logs_to(str(args.out / "vllm.log"))
    from vllm import LLM, SamplingParams

    from benchmarks.prompts import humaneval_prompts, mt_bench_questions
    from benchmarks.reference_pair import build_reference_pair

    target, _ = build_reference_pair()
    prompts = humaneval_prompts()[:args.prompts // 2] + mt_bench_questions()[:args.prompts - args.prompts // 2]
    llm = LLM(model=str(target), enforce_eager=True, seed=0, dtype="float32", max_model_len=2048,
              max_num_seqs=max(args.batch, 1), disable_log_stats=False)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    def decode_rate() -> float:
        """Median decode tok/s per sequence (first to last token, vLLM's timestamps)."""
        rates = []
        for i in range(0, len(prompts), args.batch):
            for o in llm.generate(prompts[i:i + args.batch], params, use_tqdm=False):
                m = o.metrics
                rates.append((len(o.outputs[0].token_ids) - 1) / (m.last_token_ts - m.first_token_ts))
        return statistics.median(rates)

    decode_rate()  # warm-up
    ready = args.out / ".holder_ready"
    modes = ["none", "ray"] + (["ray-quiet"] if args.quiet else [])
    rates: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:  # rotated per round
            holder = None if mode == "none" else start_holder(cores[-1], ready, mode == "ray-quiet")
            try:
                rates[mode].append(decode_rate())
            finally:
                if holder:
                    stop_holder(holder)
            print(f"round {r + 1}/{args.rounds} {mode:4s} {rates[mode][-1]:.2f} tok/s/seq", flush=True)
    ready.unlink(missing_ok=True)
    summary = {"batch": args.batch, "rounds": args.rounds, "prompts": len(prompts),
               "max_tokens": args.max_tokens, "rates": rates,
               "command": " ".join(["python -m benchmarks.ray_idle_cost"] + sys.argv[1:]),
               "date": time.strftime("%Y-%m-%d")}
    for mode in modes[1:]:
        ratios = [a / b for a, b in zip(rates[mode], rates["none"])]
        summary[f"{mode}_over_none"] = {"median": statistics.median(ratios), "min": min(ratios),
                                        "max": max(ratios), "per_round": ratios}
        print(f"batch {args.batch}: {mode} idle beside it / without: median "
              f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}) "
              f"over {args.rounds} paired rounds", flush=True)
    name = f"b{args.batch}{'_quiet' if args.quiet else ''}.json"
    (args.out / name).write_text(json.dumps(summary, indent=1))
    print(f"wrote {args.out / name}")
    from vllm_saguaro.vllm_glue.offline import shutdown

    shutdown(llm)


if __name__ == "__main__":
    main()
