"""Where the target's and the draft's threads run on a CPU machine.

On CPU the draft's "device of its own" is a set of cores. vLLM already has a mechanism to
put the target's compute threads on cores: ``VLLM_CPU_OMP_THREADS_BIND``, read by
``OMPProcessManager`` (vllm/utils/ompmultiprocessing.py) in the process that starts the
worker, which exports OMP_NUM_THREADS / OMP_PLACES / OMP_PROC_BIND (or the KMP_/GOMP_
equivalents) so that OpenMP binds every compute thread when the worker process starts.
The plugin uses that mechanism rather than moving threads after the fact
(docs/cpu-thread-placement.md has the measurements behind this):

1. ``plan_draft_cores`` runs once, where the engine's config is made (the user's
   process, or the API server), and writes the draft's cores into the Saguaro config, so
   every later process (engine core, worker, draft actor) reads the same decision.
2. ``target_cpu_lists`` takes those cores out of the lists vLLM's binding would use
   (auto binding); a user's own binding is kept, once ``plan_draft_cores`` has checked
   that it leaves the draft's cores free.
3. The draft worker binds all of its own threads to its cores (``bind_process``).

An in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) has vLLM's single-process
executor, which binds nothing: plain vLLM runs its target there on one unbound thread.
There the plugin binds that thread to the target's cores (vllm_glue/patches.py).
Nothing here imports vLLM: the patches in vllm_glue/ call these functions.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
_UNBOUND = ("auto", "nobind", "all", "")


def parse_cores(text: str) -> set[int]:
    """'0-2,5' -> {0, 1, 2, 5} (the syntax of VLLM_CPU_OMP_THREADS_BIND and taskset; vLLM's
    own parse_id_list does the same, but core/ does not import vLLM)."""
    cores: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def explicit_binding(value: str | None) -> set[int] | None:
    """The cores a user's VLLM_CPU_OMP_THREADS_BIND gives the target (all ranks), or None
    for auto / nobind."""
    value = (value or "auto").strip()
    if value in _UNBOUND:
        return None
    return {c for rank in value.split("|") for c in parse_cores(rank)}


def plan_draft_cores(requested: list[int] | None, allowed: set[int],
                     bind_value: str | None) -> list[int]:
    """The draft worker's cores: the user's ``draft_cpu_cores``, else the highest allowed
    core the target is not bound to. Raises ValueError naming the field and the fix."""
    bound = explicit_binding(bind_value)
    if requested is not None:
        draft = sorted(requested)
        missing = sorted(set(draft) - allowed)
        if missing:
            raise ValueError(
                f"draft_cpu_cores {draft}: core(s) {missing} are not available to this "
                f"process (allowed: {sorted(allowed)}); pick draft cores from that set")
        clash = sorted(set(draft) & (bound or set()))
        if clash:
            raise ValueError(
                f"draft_cpu_cores {draft} overlap the cores the target is bound to "
                f"({BIND_ENV}={bind_value}): give the draft cores of its own, e.g. "
                f"draft_cpu_cores: [{max(allowed - bound) if allowed - bound else '?'}]")
    else:
        free = sorted(allowed - (bound or set()))
        if not free:
            raise ValueError(
                f"{BIND_ENV}={bind_value} binds the target to every core this process may "
                f"use ({sorted(allowed)}), which leaves none for the draft worker: bind the "
                f"target to fewer cores (e.g. {BIND_ENV}={_fmt(sorted(allowed)[:-1])}) "
                "or set draft_device to a GPU")
        draft = [free[-1]]
    if bound is None and not allowed - set(draft):
        raise ValueError(
            f"no CPU core is left for the target: this process may use {sorted(allowed)} "
            f"and the draft takes {draft}. SSD on CPU needs at least two cores (one for "
            "the draft); set draft_cpu_cores to fewer cores")
    return draft


def target_cpu_lists(cpu_lists: list[list[int]], draft: list[int], bind_value: str | None,
                     allowed: set[int]) -> list[list[int]]:
    """vLLM's per-rank OpenMP core lists with the draft's cores taken out.

    Auto binding: vLLM chose the lists; remove the draft's cores (a rank left with none
    gets the allowed cores the draft does not use). A user's explicit binding is kept as
    it is (plan_draft_cores already refused one that overlaps the draft)."""
    if explicit_binding(bind_value) is not None:
        return cpu_lists
    out = []
    for cores in cpu_lists:
        kept = [c for c in cores if c not in draft]
        out.append(kept or sorted(allowed - set(draft)))
    return out


def _fmt(cores: list[int]) -> str:
    return ",".join(str(c) for c in cores) if cores else "<none>"


# ----------------------------------------------------------------------------- threads
@dataclass(frozen=True)
class ThreadInfo:
    """One thread of a process: where it may run and how much CPU it has used."""

    tid: int
    name: str
    cores: tuple[int, ...]
    cpu_s: float

    def as_dict(self) -> dict:
        return {"tid": self.tid, "name": self.name, "cores": list(self.cores),
                "cpu_s": round(self.cpu_s, 4), "ray_client": is_ray_client_thread(self.tid)}


def process_threads(pid: int | None = None) -> list[ThreadInfo]:
    """Every thread of `pid` (default: this process) with its affinity and CPU time."""
    pid = pid or os.getpid()
    tick = os.sysconf("SC_CLK_TCK")
    out = []
    for name in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        tid = int(name)
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
            comm = stat[stat.index("(") + 1: stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            cpu_s = (int(fields[11]) + int(fields[12])) / tick   # utime + stime
            cores = tuple(sorted(os.sched_getaffinity(tid)))
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
        out.append(ThreadInfo(tid, comm, cores, cpu_s))
    return out


_ray_client_tids: set[int] = set()


def note_ray_client_threads(before: set[int]) -> None:
    """Remember the threads of this process that appeared since `before` (tids taken just
    before ray.init): Ray's client threads (its IO and gRPC threads, which carry every
    round's calls to the draft), started on the draft's cores on purpose. Placement checks
    tell them from the target's own threads by this mark, not by their CPU time."""
    _ray_client_tids.update(t.tid for t in process_threads() if t.tid not in before)


def is_ray_client_thread(tid: int) -> bool:
    return tid in _ray_client_tids


def bind_process(cores: list[int] | set[int]) -> None:
    """Bind every thread of this process to `cores` (threads started later inherit it)."""
    cores = set(cores)
    for t in process_threads():
        try:
            os.sched_setaffinity(t.tid, cores)
        except (ProcessLookupError, OSError):
            pass
    os.sched_setaffinity(0, cores)


def compute_threads(before: list[dict], after: list[dict], wall_s: float,
                    share: float = 0.05) -> list[dict]:
    """Threads that used at least `share` of `wall_s` CPU time between two snapshots
    (dicts as ThreadInfo.as_dict gives): the ones doing the work."""
    used = {t["tid"]: t["cpu_s"] for t in before}
    out = []
    for t in after:
        busy = t["cpu_s"] - used.get(t["tid"], 0.0)
        if wall_s > 0 and busy >= share * wall_s:
            out.append({**t, "busy_s": round(busy, 3)})
    return out


def swap_environ(env: dict[str, str | None]) -> dict[str, str | None]:
    """Apply `env` to os.environ (None = unset); return what it replaced, for restoring
    with another call. Child processes take their environment (and so their OpenMP
    binding) from os.environ when they start."""
    saved = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    return saved


def omp_env(cores: list[int], threads: int | None = None) -> dict[str, str]:
    """The OpenMP variables that bind a process's threads to `cores`, as vLLM's
    OMPProcessManager.configure_omp_envs exports them for its workers. All three forms
    (plain OMP, GNU's GOMP_, Intel's KMP_) are set to the same cores: a child process
    inherits its parent's, and a stale one (e.g. the target's OMP_PLACES, inherited
    through Ray from the process that started it) must not bind the draft elsewhere.
    threads: the team's size at start (default: one per core); thread i is bound to the
    i-th core of the list, so a team grown later takes the cores after the first ones."""
    listed = _fmt(cores)
    return {"OMP_NUM_THREADS": str(threads or len(cores)), "OMP_PLACES": "{" + listed + "}",
            "OMP_PROC_BIND": "true", "GOMP_CPU_AFFINITY": " ".join(str(c) for c in cores),
            "KMP_AFFINITY": f"granularity=fine,explicit,proclist=[{listed}]"}


# Measured on the reference pair (105 MB draft checkpoint): the draft worker's process
# 0.63 GB, Ray's own processes 0.70 GB; Ray's object store (capped at 512 MiB) on top.
DRAFT_RUNTIME_BYTES = 2 * 2**30


def draft_memory_reserve(checkpoint_bytes: int) -> int:
    """Memory the draft worker's side needs on a CPU machine: Ray and the worker's runtime,
    plus the weights in float32, their KV and scratch (a generous 4x the checkpoint)."""
    return DRAFT_RUNTIME_BYTES + 4 * checkpoint_bytes
