"""The draft worker's failure handling as pure logic (core/supervision.py)."""
from vllm_saguaro.core.supervision import RestartPolicy, reply_deadline, restart_delay


def test_reply_deadline_follows_the_slowest_recent_reply():
    assert reply_deadline([], 10.0, 20.0) == 10.0
    assert reply_deadline([0.01, 0.05], 10.0, 20.0) == 10.0
    assert reply_deadline([0.01, 0.9, 0.05], 10.0, 20.0) == 18.0


def test_restart_delay_doubles_and_is_capped():
    assert [restart_delay(n, 5.0, 60.0) for n in range(6)] == [0.0, 5.0, 10.0, 20.0, 40.0, 60.0]


def test_repeated_failures_back_off_and_a_healthy_worker_starts_over():
    p = RestartPolicy(base_s=5.0, max_s=300.0, healthy_s=120.0)
    p.started(1000.0)
    assert p.fail(1300.0) == 5.0 and p.state == "down"
    assert not p.restart_due(1304.0) and p.restart_due(1305.0)
    p.starting()
    assert p.state == "starting" and p.restarts == 1
    p.started(1306.0)
    assert p.fail(1310.0) == 10.0        # failed again soon after: a loop, back off
    p.starting()
    assert p.fail(1330.0) == 20.0        # its start failed too
    p.starting()
    p.started(1400.0)
    assert p.fail(1400.0 + 121.0) == 5.0  # up for longer than healthy_s: counted anew
    assert p.restarts == 3


def test_a_failure_forgets_the_old_workers_replies():
    p = RestartPolicy(floor_s=1.0, factor=10.0)
    p.replied(0.5)
    assert p.deadline() == 5.0
    p.fail(10.0)
    assert p.deadline() == 1.0


def test_a_reply_that_prefills_gets_time_for_its_tokens():
    from vllm_saguaro.core.supervision import PREFILL_S_PER_TOKEN

    assert reply_deadline([0.01], 10.0, 20.0, prefill_tokens=4000) == 10.0 + 4000 * PREFILL_S_PER_TOKEN
