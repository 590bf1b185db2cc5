"""Where the target's and the draft's threads go on CPU (core/placement.py)."""
import os
import threading
import time

import pytest

from vllm_saguaro.core.placement import (compute_threads, explicit_binding,
                                         note_ray_client_threads, omp_env, parse_cores,
                                         plan_draft_cores, process_threads, target_cpu_lists)


def test_parse_cores_and_explicit_binding():
    assert parse_cores("0-2,5") == {0, 1, 2, 5}
    assert parse_cores("3") == {3}
    assert explicit_binding("0-1|2-3") == {0, 1, 2, 3}
    for unbound in (None, "auto", "nobind", "all", ""):
        assert explicit_binding(unbound) is None


def test_default_draft_core_is_the_highest_core_the_target_is_not_bound_to():
    assert plan_draft_cores(None, {0, 1}, "auto") == [1]
    assert plan_draft_cores(None, {0, 1, 2, 3}, None) == [3]
    assert plan_draft_cores(None, {0, 1, 2, 3}, "2-3") == [1]   # the user's binding is kept
    assert plan_draft_cores([0], {0, 1}, "1") == [0]


@pytest.mark.parametrize("requested, allowed, bind, message", [
    ([0], {0, 1}, "0", "overlap the cores the target is bound to"),
    (None, {0, 1}, "0-1", "leaves none for the draft"),
    ([0, 1], {0, 1}, "auto", "no CPU core is left for the target"),
    ([7], {0, 1}, None, r"core\(s\) \[7\] are not available"),
    (None, {0}, None, "no CPU core is left for the target"),
])
def test_bad_placements_name_the_field_and_the_fix(requested, allowed, bind, message):
    with pytest.raises(ValueError, match=message):
        plan_draft_cores(requested, allowed, bind)


def test_target_lists_lose_the_draft_cores_under_auto_binding_only():
    assert target_cpu_lists([[0, 1]], [1], "auto", {0, 1}) == [[0]]
    assert target_cpu_lists([[0, 1, 2], [3, 4]], [4], None, set(range(5))) == [[0, 1, 2], [3]]
    # a rank whose whole list was the draft's gets the cores the draft leaves
    assert target_cpu_lists([[1]], [1], "auto", {0, 1}) == [[0]]
    # an explicit binding is the user's: kept as it is
    assert target_cpu_lists([[0]], [1], "0", {0, 1}) == [[0]]


def test_omp_env_binds_every_openmp_flavour_to_the_same_cores():
    env = omp_env([2, 3])
    assert env["OMP_NUM_THREADS"] == "2"
    assert env["OMP_PLACES"] == "{2,3}" and env["OMP_PROC_BIND"] == "true"
    assert env["GOMP_CPU_AFFINITY"] == "2 3"
    assert env["KMP_AFFINITY"].endswith("proclist=[2,3]")


def test_process_threads_see_a_busy_thread_and_its_affinity():
    cores = sorted(os.sched_getaffinity(0))
    stop = threading.Event()

    def spin():
        os.sched_setaffinity(0, {cores[0]})
        while not stop.is_set():
            pass

    before = [t.as_dict() for t in process_threads()]
    t0 = time.perf_counter()
    th = threading.Thread(target=spin, name="spinner")
    th.start()
    time.sleep(0.5)
    after = [t.as_dict() for t in process_threads()]
    wall = time.perf_counter() - t0
    stop.set()
    th.join()
    busy = compute_threads(before, after, wall, share=0.3)
    spinner = [t for t in busy if t["tid"] == th.native_id]
    assert spinner, f"the spinning thread was not seen as busy: {busy}"
    assert spinner[0]["cores"] == [cores[0]]
    assert all(t["busy_s"] >= 0.3 * wall for t in busy)


def test_threads_started_since_a_snapshot_are_marked_as_ray_clients():
    """make_ray_worker snapshots the tids, runs ray.init, and marks the new threads: only
    those, not the ones that were there before or start later."""
    stop = threading.Event()
    old = threading.Thread(target=stop.wait)
    old.start()
    before = {t.tid for t in process_threads()}
    new = threading.Thread(target=stop.wait)  # stands for Ray's IO thread
    new.start()
    note_ray_client_threads(before)
    later = threading.Thread(target=stop.wait)
    later.start()
    marks = {t["tid"]: t["ray_client"] for t in (i.as_dict() for i in process_threads())}
    stop.set()
    for th in (old, new, later):
        th.join()
    assert marks[new.native_id] is True
    assert marks[old.native_id] is False and marks[later.native_id] is False
    assert marks[os.getpid()] is False


def test_swap_environ_sets_unsets_and_restores(monkeypatch):
    from vllm_saguaro.core.placement import swap_environ

    monkeypatch.setenv("SAGUARO_T_A", "1")
    monkeypatch.delenv("SAGUARO_T_B", raising=False)
    saved = swap_environ({"SAGUARO_T_A": None, "SAGUARO_T_B": "2"})
    assert "SAGUARO_T_A" not in os.environ and os.environ["SAGUARO_T_B"] == "2"
    swap_environ(saved)
    assert os.environ["SAGUARO_T_A"] == "1" and "SAGUARO_T_B" not in os.environ
