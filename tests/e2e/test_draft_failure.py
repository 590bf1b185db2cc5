"""The draft worker fails mid-batch (killed, raising, hung): every request completes with
exactly plain decoding's tokens, the failure is counted, and a new worker takes over.

In-process engines on tiny models; the server's case is in test_server.py. Each test
shows its failure was real (the counters) and that speculation came back (a restart,
then rounds with draft tokens sent)."""
import os
import signal
import threading
import time

import pytest

from tests.e2e.conftest import drafter_of, make_llm, release, saguaro_counters
from tests.e2e.test_greedy_identity import make_params, make_prompts

BATCH = 4
# restarts fast enough for a test; the deadline floor short enough that a hang costs 1 s
SUPERVISION = {"timeout_s": 1.0, "restart_s": 0.2, "restart_max_s": 1.0}


def params(n):
    from vllm import SamplingParams

    return [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True) for _ in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_target):
    llm = make_llm(tiny_target)
    out = [o.outputs[0].token_ids for o in llm.generate(make_prompts(BATCH, 7), params(BATCH))]
    again = [o.outputs[0].token_ids for o in llm.generate(make_prompts(16, 16), make_params(16, 16))]
    release(llm)
    return out, again


def ssd(tiny_target, spec_base, monkeypatch, fault=None, transport="ray"):
    """An SSD engine whose draft workers get `fault` (the first one only, unless it ends
    in ":always"; set for the whole test: restarts read it when they start)."""
    if fault:
        monkeypatch.setenv("SAGUARO_FAULT_INJECTION", fault)
    return make_llm(tiny_target, dict(spec_base, supervision=SUPERVISION, transport=transport))


def check(llm, reference, before):
    """Outputs identical to plain decoding; the failure counted once; after the restart a
    second batch, also identical, sends draft tokens again."""
    ref, again = reference
    got = [o.outputs[0].token_ids for o in llm.generate(make_prompts(BATCH, 7), params(BATCH))]
    assert got == ref
    mid = saguaro_counters(llm)
    assert mid.get("vllm:saguaro_draft_failures", 0) - before.get(
        "vllm:saguaro_draft_failures", 0) == 1
    drafter = drafter_of(llm)
    deadline = time.time() + 60
    while not drafter.supervisor.available():  # the restart, in the background
        assert time.time() < deadline, "no new draft worker within 60 s"
        time.sleep(0.1)
    got = [o.outputs[0].token_ids for o in llm.generate(make_prompts(16, 16), make_params(16, 16))]
    assert got == again
    after = saguaro_counters(llm)
    assert after.get("vllm:saguaro_draft_restarts", 0) >= 1
    assert after["vllm:spec_decode_num_draft_tokens"] > mid.get("vllm:spec_decode_num_draft_tokens", 0)


@pytest.mark.parametrize("transport", ["ray", "channel"])
def test_draft_process_killed_mid_batch(tiny_target, spec_base, reference, monkeypatch,
                                        transport):
    """SIGKILL of the draft worker's process from outside, while the batch decodes; with
    q over the TensorChannel too (the new worker gets a new channel)."""
    llm = ssd(tiny_target, spec_base, monkeypatch, transport=transport)
    before = saguaro_counters(llm)
    drafter = drafter_of(llm)
    pid = drafter.draft_threads()["pid"]
    killed = threading.Event()

    def kill_after_a_few_rounds():
        deadline = time.time() + 120
        while drafter.metrics.rounds < 3 and time.time() < deadline:
            time.sleep(0.005)
        os.kill(pid, signal.SIGKILL)
        killed.set()

    killer = threading.Thread(target=kill_after_a_few_rounds, daemon=True)
    killer.start()
    try:
        first = drafter.channel
        check(llm, reference, before)
        assert killed.is_set()
        if transport == "channel":
            assert first is not None and drafter.channel is not None
            assert drafter.channel is not first, "the restarted worker kept the old channel"
            from vllm import SamplingParams

            sampled = [SamplingParams(temperature=1.0, seed=i, max_tokens=20, ignore_eos=True)
                       for i in range(4)]
            out = llm.generate(make_prompts(4, 3), sampled, use_tqdm=False)
            assert [len(o.outputs[0].token_ids) for o in out] == [20] * 4
            assert drafter.draft_stats()["channel_sends"] > 0, "no q crossed the new channel"
    finally:
        release(llm)


@pytest.mark.parametrize("fault", ["raise_at_step:3", "hang_at_step:3"])
def test_draft_raising_or_hung(tiny_target, spec_base, reference, monkeypatch, fault):
    """A worker that raises in step(), or never answers (the deadline: 1 s here)."""
    llm = ssd(tiny_target, spec_base, monkeypatch, fault)
    try:
        t0 = time.perf_counter()
        check(llm, reference, saguaro_counters(llm))
        assert time.perf_counter() - t0 < 120
    finally:
        release(llm)


def test_repeated_crashes_back_off(tiny_target, spec_base, reference, monkeypatch):
    """Every worker dies at its 2nd step: restarts come later and later (no restart loop),
    and every output is still plain decoding's."""
    llm = ssd(tiny_target, spec_base, monkeypatch, "die_at_step:2:always")
    try:
        drafter = drafter_of(llm)
        before = saguaro_counters(llm).get("vllm:saguaro_draft_failures", 0)
        ref, _ = reference
        t0 = time.time()
        while time.time() - t0 < 6:
            got = [o.outputs[0].token_ids for o in llm.generate(make_prompts(BATCH, 7), params(BATCH))]
            assert got == ref
        policy = drafter.supervisor.policy
        # backoff 0.2, 0.4, 0.8, 1.0, 1.0 ... s: in 6 s at most ~8 starts, never one per round
        assert policy.failures >= 2 and policy.restarts <= 10
        assert saguaro_counters(llm)["vllm:saguaro_draft_failures"] - before == policy.failures
    finally:
        release(llm)
