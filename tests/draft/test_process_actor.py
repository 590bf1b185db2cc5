"""The draft worker in a child process (draft/process_actor.py): its calls answer as the
worker's own would, two at a time, its errors and its death reach the caller at once, a
hang ends at the deadline, and the child leaves when its target does."""
import os
import signal
import subprocess
import sys
import time

import pytest

from vllm_saguaro.config import SaguaroConfig
from vllm_saguaro.draft.process_actor import (DraftCallError, DraftProcess, DraftProcessDied,
                                              ProcessRuntime)
from vllm_saguaro.draft.worker import FAULT_ENV

CORE = max(os.sched_getaffinity(0))


def config(path, **kw):
    cfg = dict(draft_model=str(path), num_speculative_tokens=3, draft_dtype="float32",
               draft_cpu_cores=[CORE], fanout={"policy": "uniform", "width": 2},
               fallback="neural", controller={"policy": "fixed"})
    cfg.update(kw)
    return SaguaroConfig.model_validate(cfg).to_json_dict()


@pytest.fixture(scope="module")
def draft(tiny_draft):
    process = ProcessRuntime.start(config(tiny_draft), 512)
    yield process
    process.kill()


def test_calls_answer_as_the_worker_does(draft):
    assert ProcessRuntime.get(draft.ping.remote(), 60) == draft.pid
    threads = ProcessRuntime.get(draft.threads.remote(), 10)
    assert threads["pid"] == draft.pid
    assert all(t["cores"] == [CORE] for t in threads["threads"])  # bound from the start
    prompt = [1, 5, 9, 13, 2, 7]
    results, waited, computed, idle, lent_sd = ProcessRuntime.get(
        draft.step.remote([("r", None, prompt, None)], []), 30)
    (tokens, flag, q), = results
    assert len(tokens) == 3 and flag is None and q is None and waited >= 0
    # replies are matched to their calls, not taken in order
    first, second = draft.get_stats.remote(), draft.release.remote(["r"])
    assert ProcessRuntime.get(second, 10)["live_seqs"] == 0
    assert ProcessRuntime.get(first, 10)["live_seqs"] == 1
    # a reply nobody holds the call of any more (a replaced pre-speculation) is not kept
    draft.ping.remote()
    assert ProcessRuntime.get(draft.ping.remote(), 10) == draft.pid
    assert draft._replies == {}


def test_a_worker_error_is_raised_with_its_own_message(draft):
    with pytest.raises(DraftCallError, match="RuntimeError in step"):  # a sequence of no tokens
        ProcessRuntime.get(draft.step.remote([("x", None, [], None)], []), 10)
    with pytest.raises(DraftCallError, match="AttributeError in no_such_call"):
        ProcessRuntime.get(draft.no_such_call.remote(), 10)
    assert ProcessRuntime.get(draft.ping.remote(), 10) == draft.pid  # still serving


def test_two_calls_run_at_once(tiny_draft):
    """A step() must be able to run while a pre-speculation holds the other thread: a
    hang injected into step 1 leaves ping answering, and the wait ends at its timeout."""
    os.environ[FAULT_ENV] = "hang_at_step:1"
    try:
        process = ProcessRuntime.start(config(tiny_draft), 512)
    finally:
        del os.environ[FAULT_ENV]
    try:
        stuck = process.step.remote([("r", None, [1, 2, 3], None)], [])
        assert ProcessRuntime.get(process.ping.remote(), 60) == process.pid
        assert not ProcessRuntime.ready(stuck)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            ProcessRuntime.get(stuck, 0.5)
        assert time.monotonic() - t0 < 5
    finally:
        process.kill()
    assert process.proc.poll() is not None


def test_a_killed_process_fails_the_wait_at_once(tiny_draft):
    process = ProcessRuntime.start(config(tiny_draft), 512)
    assert ProcessRuntime.get(process.ping.remote(), 60) == process.pid
    pending = process.step.remote([("r", None, [1, 2, 3], None)], [])
    os.kill(process.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(DraftProcessDied, match="exited"):
        ProcessRuntime.get(pending, 60)
    assert time.monotonic() - t0 < 10
    assert ProcessRuntime.ready(process.ping.remote())  # dead: nothing to wait for
    process.kill()


def test_a_bad_checkpoint_fails_the_start_with_the_workers_error(tiny_draft, tmp_path):
    cfg = config(tiny_draft)
    process = DraftProcess(cfg, 7, {}, [CORE])  # vocabulary of 7: the draft's is larger
    try:
        with pytest.raises(DraftCallError, match="vocabulary of 512 tokens but the target has 7"):
            ProcessRuntime.get(process.ping.remote(), 60)
        with pytest.raises(DraftCallError):  # and so does every later call
            ProcessRuntime.get(process.ping.remote(), 60)
    finally:
        process.kill()


CHILD = """
import sys, time
from vllm_saguaro.draft.process_actor import DraftProcess
p = DraftProcess({cfg!r}, 512, {{}}, None)
print(p.pid, flush=True)
time.sleep(60)
"""


def test_the_child_exits_when_its_target_dies(tiny_draft):
    target = subprocess.Popen([sys.executable, "-c", CHILD.format(cfg=config(tiny_draft))],
                              stdout=subprocess.PIPE, text=True)
    child = int(target.stdout.readline())
    target.kill()
    target.wait()
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{child}/stat") as f:
            if f.read().split()[2] == "Z":  # exited, waiting for init to reap it
                return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the draft process outlived its target")


def test_the_child_imports_what_the_target_imported_not_the_working_directorys(
        tiny_draft, tmp_path, monkeypatch):
    """A server started from a directory holding another vllm_saguaro (a checkout of
    another version): the draft process still runs the target's."""
    shadow = tmp_path / "vllm_saguaro"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('the working directory copy')\n")
    monkeypatch.chdir(tmp_path)
    process = ProcessRuntime.start(config(tiny_draft), 512)
    try:
        assert ProcessRuntime.get(process.ping.remote(), 60) == process.pid
    finally:
        process.kill()


def test_the_worker_environment(monkeypatch):
    """worker_env: OpenMP bound to the draft's cores in every form, Intel OpenMP's
    warnings off, and a fault only for the first worker unless ':always'."""
    from vllm_saguaro.draft.worker import worker_env

    monkeypatch.delenv(FAULT_ENV, raising=False)
    env = worker_env([1], 0)
    assert env["OMP_NUM_THREADS"] == "1" and env["GOMP_CPU_AFFINITY"] == "1"
    assert "proclist=[1]" in env["KMP_AFFINITY"] and env["KMP_WARNINGS"] == "0"
    assert FAULT_ENV not in env and worker_env(None, 0) == {}
    monkeypatch.setenv(FAULT_ENV, "die_at_step:3")
    assert worker_env([1], 0)[FAULT_ENV] == "die_at_step:3"
    assert worker_env([1], 1)[FAULT_ENV] == ""  # a restarted worker: no fault
    monkeypatch.setenv(FAULT_ENV, "die_at_step:3:always")
    assert worker_env([1], 2)[FAULT_ENV] == "die_at_step:3:always"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="borrowing a core needs 2")
def test_the_team_grows_onto_the_borrowed_cores_only_in_lent_sd_steps(tiny_draft):
    """ProcessRuntime.start with the target's cores to borrow: the worker times its step
    on both teams at start, so the thread the team adds is there from the start, bound
    to the borrowed core; the other threads (main, calls) stay on the draft's core
    through an SSD step, a pre-speculation and a lent_sd step (run with either OpenMP:
    they place such threads differently; nothing may be left free on both cores)."""
    other = min(os.sched_getaffinity(0))
    cfg = config(tiny_draft, controller={"policy": "auto", "regime": "lent_sd",
                                         "force_lengths": [2]})
    process = ProcessRuntime.start(cfg, 512, borrow=[other])
    try:
        def cores():
            threads = ProcessRuntime.get(process.threads.remote(), 30)["threads"]
            return sorted({tuple(t["cores"]) for t in threads})

        both = sorted([(other,), (CORE,)])
        assert sorted(cores()) == both
        prompt = [1, 5, 9, 13, 2, 7] * 20
        (spec, _, _), = ProcessRuntime.get(process.step.remote([("r", None, prompt, None)], []), 60)[0]
        ProcessRuntime.get(process.prespeculate.remote(), 60)
        assert sorted(cores()) == both
        sampled = spec[:1] + [3]
        results, _, _, _, lent_sd = ProcessRuntime.get(
            process.step.remote([("r", sampled, None, None)], []), 60)
        assert lent_sd and len(results[0][0]) == 2
        assert sorted(cores()) == both
        ProcessRuntime.get(process.prespeculate.remote(), 60)
        assert sorted(cores()) == both
        stats = ProcessRuntime.get(process.get_stats.remote(), 30)
        assert stats["lent_sd_steps"] == 1
    finally:
        process.kill()
