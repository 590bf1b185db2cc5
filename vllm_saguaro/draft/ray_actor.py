"""The draft worker as a Ray actor: Ray started for it (its daemons on the draft's
cores, with the plugin's defaults) and the actor itself (worker.py's DraftWorker).

On CPU the draft's cores are lent to the target whenever the draft idles, and Ray's
daemons share them with the target's borrowed OpenMP thread: an idle Ray cluster beside
plain vLLM on both cores cost it 2-3% at batch 1 and 16 (benchmarks/ray_idle_cost.py;
docs/measurements.md, issue 19's "Seventh round")."""

from __future__ import annotations

import os

from vllm_saguaro.core.placement import note_ray_client_threads, omp_env, process_threads, swap_environ
from vllm_saguaro.core.supervision import describe
from vllm_saguaro.draft.worker import DraftWorker, worker_env

# Only small objects cross (outcomes, drafts, q rows): Ray's default object store would
# reserve 30% of the machine's memory in /dev/shm.
OBJECT_STORE_BYTES = 512 * 2**20

RAY_DEFAULTS = {
    # Ray starts workers at nice 15: the draft would lose its own core to anything else.
    "RAY_worker_niceness": "0",
    # Ray's memory monitor kills the newest worker when the machine's memory use passes
    # 95%; vLLM's CPU KV reservation alone can take most of it, and the draft is then the
    # one killed. The draft belongs to the server like the target: leave it to the kernel,
    # as vLLM's own processes are (docs/cpu-thread-placement.md, "Memory").
    "RAY_memory_monitor_refresh_ms": "0",
    # Ray prestarts a worker process for the first driver; the draft's actor never uses it
    # (its runtime env differs), and it woke ~150 times a second on the draft's core,
    # which the target borrows while the draft idles (0.6% of a core, measured).
    "RAY_prestart_worker_first_driver": "0",
}


def start_ray(cores: list[int] | None) -> None:
    """ray.init for the draft, its daemons started on the draft's cores."""
    import ray

    for name, value in RAY_DEFAULTS.items():  # unless the user set them
        os.environ.setdefault(name, value)
    # Ray's daemons and worker processes inherit the affinity of the thread that starts
    # them and its OpenMP variables: from the target's worker, the target's cores. Start
    # them with the draft's instead, so nothing of Ray's runs on the target's cores (and
    # libgomp is not told to bind to cores it may not use).
    here, saved = os.sched_getaffinity(0), {}
    if cores:
        os.sched_setaffinity(0, set(cores))
        saved = swap_environ(omp_env(cores))
    try:
        threads = {t.tid for t in process_threads()}
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=True,
                 configure_logging=False, ignore_reinit_error=True,
                 object_store_memory=OBJECT_STORE_BYTES)
        note_ray_client_threads(threads)
    except Exception as err:
        raise RuntimeError(
            f"Saguaro: Ray could not start for the draft worker ({describe(err)}). "
            f"The draft runs on this machine: unset RAY_ADDRESS (now "
            f"{os.environ.get('RAY_ADDRESS', 'unset')!r}) or point it at a running "
            "cluster, and check that /tmp has space for Ray's session files") from None
    finally:
        os.sched_setaffinity(0, here)
        swap_environ(saved)


def make_ray_worker(config: dict, target_vocab_size: int, incarnation: int = 0,
                    borrow: list[int] = ()):
    """Start the draft worker as a Ray actor (own process; own cores or own GPU).
    incarnation: 0 for the first worker, n for the n-th restart after a failure. borrow
    is not supported here (the actor stays on its own cores; process_actor does it)."""
    import ray

    cores = config.get("draft_cpu_cores") if config.get("draft_device", "cpu") == "cpu" else None
    if not ray.is_initialized():
        start_ray(cores)
    env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", **worker_env(cores, incarnation)}
    # Two threads: step() must be able to cut a pre-speculation short (see step()).
    actor_cls = ray.remote(num_cpus=0, max_concurrency=2)(DraftWorker)
    return actor_cls.options(runtime_env={"env_vars": env}).remote(config, target_vocab_size)


class RayRuntime:
    """The supervisor's runtime for a Ray actor (vllm_glue/supervisor.py)."""

    name = "ray"
    start = staticmethod(make_ray_worker)

    @staticmethod
    def get(ref, timeout: float | None):
        import ray

        return ray.get(ref, timeout=timeout)

    @staticmethod
    def ready(ref) -> bool:
        import ray

        return bool(ray.wait([ref], timeout=0)[0])

    @staticmethod
    def kill(actor) -> None:
        import ray

        if ray.is_initialized():  # after ray.shutdown, ray.kill would start a new cluster
            ray.kill(actor, no_restart=True)
