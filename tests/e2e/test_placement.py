"""Where the threads run: the target's on the cores vLLM bound them to, the draft's on its own.

The threads that did the work (CPU time during generation) must be on their side's cores;
every thread of the draft worker's process is on the draft's cores, and no thread of the
target's worker may run on both sides (with draft_runtime 'ray', Ray's client threads there,
which carry the calls to the draft, start on the draft's: they are marked when ray.init
starts them and may be busy there, on those cores only; the default CPU runtime, a child
process, leaves none). A
multiprocess engine is started as a user starts it (vLLM's default), once with vLLM's auto
binding and once with the user's own VLLM_CPU_OMP_THREADS_BIND; the in-process engine,
which vLLM does not bind, is checked too.
"""
import os
import time

import pytest

from tests.e2e.conftest import make_llm, release
from vllm_saguaro.core.placement import compute_threads
from vllm_saguaro.vllm_glue.offline import engine_report

CORES = sorted(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(len(CORES) < 2, reason="SSD on CPU needs 2 cores")


def _busy(llm, prompts, params):
    """Generate, and return (report after, threads that worked: target's, draft's)."""
    before = engine_report(llm)
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = engine_report(llm)
    return (after, compute_threads(before["target"]["threads"], after["target"]["threads"], wall),
            compute_threads(before["draft_threads"]["threads"], after["draft_threads"]["threads"],
                            wall, share=0.01))


def _check(report, target_busy, draft_busy, target_cores, draft_cores, all_target=True,
           runtime="process"):
    assert report["metrics"]["rounds"] > 0, "SSD did not run"
    assert target_busy, "no thread of the target did any work?"
    assert draft_busy, "no thread of the draft worker did any work?"
    for t in target_busy:  # Ray's client threads (the transport) are the draft's side
        cores = draft_cores if t["ray_client"] else target_cores
        assert set(t["cores"]) <= cores, f"target process thread off its cores: {t}"
    assert any(not t["ray_client"] for t in target_busy), "no target compute thread busy?"
    ray_threads = [t for t in report["target"]["threads"] if t["ray_client"]]
    if runtime == "ray":
        assert ray_threads, "Ray's client threads in the target's process not found"
    else:
        assert not ray_threads, "Ray started in the target's process without draft_runtime 'ray'"
    for t in report["draft_threads"]["threads"]:  # all of them, Ray's own threads too
        assert set(t["cores"]) <= draft_cores, f"draft thread off its cores: {t}"
    if all_target:  # no thread of the worker may roam: the target's, or Ray's client
        for t in report["target"]["threads"]:  # threads, started on the draft's cores
            cores = set(t["cores"])
            assert cores <= target_cores or cores <= draft_cores, f"thread spans both: {t}"


def _stat(pid: int) -> tuple[str, int]:
    """A process's name and its parent's pid."""
    text = open(f"/proc/{pid}/stat").read()
    return text[text.index("(") + 1: text.rindex(")")], int(text[text.rindex(")") + 2:].split()[1])


def _ray_idle_workers(draft_pid: int) -> list[int]:
    """The idle worker processes ("ray::IDLE") of the raylet that started the draft's."""
    stat = _stat
    raylet = stat(draft_pid)[1]
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                comm, parent = stat(int(name))
            except (FileNotFoundError, ProcessLookupError):
                continue
            if parent == raylet and comm.startswith("ray::IDLE"):
                out.append(int(name))
    return out


@pytest.fixture
def multiprocess(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # as a user runs it


@pytest.mark.parametrize("bind,runtime", [(None, "process"), ("0", "process"), (None, "ray")])
def test_multiprocess_engine_threads(tiny_target, spec_base, multiprocess, monkeypatch, bind,
                                     runtime):
    from vllm import SamplingParams

    if bind is None:
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    else:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    llm = make_llm(tiny_target, dict(spec_base, draft_runtime=runtime))
    try:
        params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
        report, target_busy, draft_busy = _busy(llm, ["a b c d"] * 4, params)
        draft_pid = report["draft_threads"]["pid"]
        parent = _stat(draft_pid)[1]
        idle_workers = _ray_idle_workers(draft_pid) if runtime == "ray" else []
    finally:
        release(llm)
    assert report["target"]["pid"] != os.getpid(), "expected the worker in its own process"
    _check(report, target_busy, draft_busy, {CORES[0]}, {CORES[-1]}, runtime=runtime)
    if runtime == "process":  # the target's worker started it: no raylet between them
        assert parent == report["target"]["pid"]
    # Ray prestarts no idle worker beside the draft's (it woke ~150 times a second on the
    # draft's core; make_ray_worker): the raylet's only worker process is the draft's
    assert idle_workers == [], f"Ray worker processes idling beside the draft: {idle_workers}"


def test_in_process_engine_threads(tiny_target, spec_base):
    from vllm import SamplingParams

    llm = make_llm(tiny_target, spec_base)
    try:
        params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
        report, target_busy, draft_busy = _busy(llm, ["a b c d"] * 4, params)
        engine_thread_cores = set(os.sched_getaffinity(0))
    finally:
        release(llm)
    assert report["target"]["pid"] == os.getpid()
    assert engine_thread_cores == {CORES[0]}
    # pytest's own process: only the engine's thread is the target's; others are the user's
    _check(report, target_busy, draft_busy, {CORES[0]}, {CORES[-1]}, all_target=False)


def test_binding_the_target_to_every_core_is_refused(tiny_target, spec_base, multiprocess,
                                                     monkeypatch):
    from vllm_saguaro.config import SaguaroConfigError

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, CORES)))
    t0 = time.perf_counter()
    with pytest.raises(SaguaroConfigError, match="leaves none for the draft"):
        make_llm(tiny_target, spec_base)
    assert time.perf_counter() - t0 < 30
