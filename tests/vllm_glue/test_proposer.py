"""The proposer's idle state: while the controller says speculation cannot pay at the
batch size running, rounds are answered without the draft (plain decoding)."""
import time
from types import SimpleNamespace

import pytest

from vllm_saguaro.core.controller import StepCost
from vllm_saguaro.core.idle_lookup import IdleLookup, IdleLookupAdvice
from vllm_saguaro.core.sampling import SamplingSpec
from vllm_saguaro.vllm_glue import proposer as mod
from vllm_saguaro.vllm_glue.metrics import SaguaroMetrics


class _NoActor:
    def __getattr__(self, name):
        raise AssertionError(f"the draft was called ({name}) while idle")


def idle_proposer(limit):
    p = mod.SaguaroProposer.__new__(mod.SaguaroProposer)
    p.supervisor, p.pending, p.mirror = _NoActor(), None, {}
    p.metrics = SaguaroMetrics(0.0)
    p.target_steps, p._width, p._last_done, p._prev_ids = [], None, None, set()
    p.idle_above, p._idle_since, p._gone = limit, time.monotonic(), set()
    p._probe_rounds, p._recheck_s, p._idle_ids = None, mod.IDLE_RECHECK_S, None
    p.lending = None
    p.lent_sd = False
    p._wake_share, p._lookup, p._lookup_woke = None, None, float("-inf")
    p._idle_lookup, p._looked_up, p._lookup_before = None, False, None
    p.paused = False
    p.cfg = SimpleNamespace(num_speculative_tokens=3)
    p.vocab_size = 16
    return p


def test_a_draining_batch_near_its_end_does_not_wake_the_draft_as_it_shrinks():
    """The batch shrank to where speculation could pay: the draft is woken, unless no
    request waits and every row is within WAKE_MIN_LEFT tokens of its end (its catch-up
    would cost more than the few steps could give). A recheck still wakes it."""
    near = [mod.WAKE_MIN_LEFT - 1, 3]
    p = idle_proposer(2)
    assert p._idle(ids(2), 2, {"x"}, left=near) and p.idle_above == 2 and p._gone == {"x"}
    assert not p._idle(ids(2), 2, set(), left=[mod.WAKE_MIN_LEFT, 3])  # one row far from it
    p = idle_proposer(2)
    assert not p._idle(ids(2), 2, set())  # requests waiting (left unknown): woken
    for woken in (False, True):  # a recheck due, or the text woke it: woken near the end too
        p = idle_proposer(2)
        p._idle_since -= 0 if woken else mod.IDLE_RECHECK_S
        assert not p._idle(ids(4), 4, set(), woken=woken, left=near + near)


def test_idle_rounds_skip_the_draft_and_keep_the_finished():
    p = idle_proposer(2)
    sampled = [[5], [6], [7], [8]]
    drafts, probs = p.propose_round(["a", "b", "c", "d"], [4, 4, 4, 4], None, sampled,
                                    {"x"}, None)
    assert drafts == [[], [], [], []] and probs is None
    assert p._gone == {"x"}
    assert p.metrics.idle_rounds == 1 and p.metrics.plain_rounds == 1
    assert p.metrics.sent[0] == 4
    assert p._width == 4  # the plain step's width: the controller's cost model gets it next


class _Supervisor:
    """Up, with a worker whose release() answers what it still holds."""

    up = True

    def __init__(self):
        self.released = []
        outer = self

        class Actor:
            class release:
                @staticmethod
                def remote(ids):
                    outer.released.append(ids)
                    return {"live_seqs": 0, "kv_blocks_used": 0, "kv_blocks": 64}
        self.actor = Actor()

    def get(self, ref, what, prefill_tokens=0):
        return ref


def test_gone_requests_are_kept_until_sent_and_released_when_the_batch_empties():
    """Finished / preempted ids noted on steps that call no drafter are not lost: the
    next round sends them, or release() frees them when the batch has emptied."""
    p = idle_proposer(2)
    p.supervisor = _Supervisor()
    p.mirror = {"a": object(), "b": object()}
    p.note_gone({"a"})
    p.note_gone({"b"})
    held = p.release()
    assert p.supervisor.released == [["a", "b"]] and p.mirror == {} and p._gone == set()
    assert held["live_seqs"] == 0 and p.metrics.draft_held["kv_blocks_used"] == 0
    assert p.release() == {} and len(p.supervisor.released) == 1  # nothing new: no call


class _Lending:
    def __init__(self):
        self.lent = False

    def lend(self):
        self.lent = True

    def give_back(self):
        self.lent = False


def test_an_empty_batch_lends_the_cores_and_the_drafts_next_call_takes_them_back():
    """The prefills of the next batch run on the draft's cores too (the draft has no part
    in them); the first round that calls the draft gives them back before the call."""
    import torch

    p = idle_proposer(None)
    p.supervisor = _Supervisor()
    p.supervisor.available = lambda: True
    p.supervisor.resync = False
    p.cfg = SimpleNamespace(draft_sampling="target", async_=True, num_speculative_tokens=3)
    p.channel = None
    p.lending = _Lending()
    p.note_gone({"a"})
    p.release()
    assert p.supervisor.released == [["a"]] and p.lending.lent
    p.lending.give_back()
    p.release()  # nothing gone, no call: still an empty batch
    assert p.lending.lent and len(p.supervisor.released) == 1
    # a prefill-only step keeps them: nothing for the draft to do
    drafts, _ = p.propose_round(["b"], [3], torch.tensor([[1, 2, 3]]), [[]], set(), None)
    assert drafts == [[]] and p.lending.lent

    class Called(Exception):
        pass

    seen = []

    class Step:
        @staticmethod
        def remote(*args):
            seen.append(p.lending.lent)
            raise Called

    p.supervisor.actor.step = Step
    with pytest.raises(Called):
        p.propose_round(["b"], [4], torch.tensor([[1, 2, 3, 4]]), [[4]], set(), None)
    assert seen == [False]


def test_sd_on_the_lent_cores_keeps_the_team_whole():
    """A round the worker ran as SD on the lent cores: the target verifies on every core
    (lent after the reply) and nothing is pre-speculated; the next call keeps them lent
    while the draft drafts (the target only waits); a round with a new sequence gives
    them back first (its prompt goes to the pre-speculation's glue pass)."""
    import torch

    p = idle_proposer(None)
    p.supervisor = _Supervisor()
    p.supervisor.available = lambda: True
    p.supervisor.resync = False
    p.supervisor.ready = lambda ref: False
    p.cfg = SimpleNamespace(draft_sampling="target", async_=True, num_speculative_tokens=3)
    p.channel = None
    p.lending = _Lending()
    calls, regime = [], iter([False, True, True, False, True, False])

    class Step:
        @staticmethod
        def remote(updates, finished, target_steps, k_cap):
            calls.append((p.lending.lent, [u[0] for u in updates if u[2] is not None]))
            lent_sd = next(regime)
            return [([9], None, None)] * len(updates), 0.0, 0.0, None, lent_sd

    class Prespeculate:
        @staticmethod
        def remote():
            calls.append("prespeculate")
            return "pending"

    p.supervisor.actor.step, p.supervisor.actor.prespeculate = Step, Prespeculate
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6]])
    p._prev_ids = {"a"}  # not a batch arriving (that round would lend and idle)
    p.propose_round(["a"], [3], tokens, [[3]], set(), None)  # new: SSD's round
    assert calls == [(False, ["a"]), "prespeculate"] and not p.lending.lent
    p.propose_round(["a"], [4], tokens, [[9]], set(), None)  # SD on the lent cores
    assert calls[2:] == [(False, [])] and p.lending.lent and p.lent_sd
    p.propose_round(["a"], [5], tokens, [[9]], set(), None)  # stays lent through the call
    assert calls[3:] == [(True, [])] and p.lending.lent
    p.propose_round(["a", "b"], [6, 3], torch.cat([tokens, tokens]), [[9], [3]], set(), None)
    assert calls[4:] == [(False, ["b"]), "prespeculate"] and not p.lending.lent
    p.propose_round(["a", "b"], [7, 4], torch.cat([tokens, tokens]), [[9], [9]], set(), None)
    assert calls[6:] == [(False, [])] and p.lending.lent
    # the worker turns to SSD with no new sequence: the cores go back before the
    # pre-speculation, which runs beside the target's verification
    p.propose_round(["a", "b"], [8, 5], torch.cat([tokens, tokens]), [[9], [9]], set(), None)
    assert calls[7:] == [(True, []), "prespeculate"] and not p.lending.lent
    assert p.metrics.lent_sd_rounds == 3 and "SD on the lent cores in 50%" in p.metrics.lengths_summary()


def test_a_batch_arriving_keeps_the_draft_out_and_the_cores_lent():
    """Requests joined and the draft holds none of the batch: the round is plain and the
    next step's prefills get the draft's cores. Once the draft holds a request of the
    batch, one joining does not stop speculation."""
    import torch

    p = idle_proposer(None)  # the draft is not idling: without the rule it would be called
    p.lending = _Lending()
    drafts, _ = p.propose_round(["a"], [3], torch.tensor([[1, 2, 3]]), [[3]], set(), None)
    assert drafts == [[]] and p.lending.lent and p.metrics.idle_rounds == 1
    drafts, _ = p.propose_round(["a", "b"], [4, 3], torch.tensor([[1, 2, 3, 4], [1, 2, 3, 0]]),
                                [[4], [3]], {"x"}, None)
    assert drafts == [[], []] and p._gone == {"x"} and p.metrics.idle_rounds == 2
    p.mirror = {"a": object()}
    with pytest.raises(AssertionError, match="the draft was called"):
        p.propose_round(["a", "b", "c"], [5, 4, 3], torch.zeros(3, 5, dtype=torch.long),
                        [[5], [4], [3]], set(), None)


def test_an_empty_batch_leaves_the_cores_to_a_running_prespeculation():
    p = idle_proposer(None)
    p.supervisor = _Supervisor()
    p.lending = _Lending()
    p.pending = object()
    p.supervisor.ready = lambda ref: False
    p.release()
    assert not p.lending.lent
    p.supervisor.ready = lambda ref: ref is p.pending
    p.release()
    assert p.lending.lent


def ids(n: int, first: int = 0) -> list[str]:
    return [f"r{i}" for i in range(first, first + n)]


def test_idle_ends_when_the_batch_shrinks_or_after_a_while(monkeypatch):
    p = idle_proposer(2)
    assert p._idle(ids(4), 4, set()) and p.idle_above == 2
    assert not p._idle(ids(2), 2, set()) and p.idle_above is None  # small enough: ask the draft
    p = idle_proposer(2)
    p._idle_since -= mod.IDLE_RECHECK_S + 1
    assert not p._idle(ids(8), 8, set())
    # a close idle (IdleAdvice.recheck_s): asked again sooner
    p = idle_proposer(2)
    p._recheck_s = 5.0
    p._idle_since -= 4.0
    assert p._idle(ids(8), 8, set())
    p._idle_since -= 1.5
    assert not p._idle(ids(8), 8, set())


def test_an_idle_on_new_text_ends_once_its_requests_are_gone():
    """IdleAdvice.new_text: what held speculation off measured the requests of the batch
    then; once every request is one that joined since, the draft is asked again."""
    p = idle_proposer(0)
    p._idle_ids = set(ids(1))
    assert p._idle(ids(1), 1, set())  # the same request: still idle
    assert not p._idle(ids(1, first=1), 1, set()) and p.idle_above is None
    assert p._idle_ids is None
    p = idle_proposer(2)
    p._idle_ids = set(ids(4))
    assert p._idle(ids(4, first=3), 4, set())  # one of them still in the batch
    assert not p._idle(ids(4, first=4), 4, set())
    p = idle_proposer(0)  # no new_text: the request changing does not end it
    assert p._idle(ids(1, first=1), 1, set())


def test_idle_holds_while_a_batch_arrives():
    """Requests join a few at a time (their prefills): the batch, not the rows decoding
    so far, decides, so the cores stay lent through the arrival."""
    p = idle_proposer(2)
    assert p._idle(ids(8), 1, set()) and p._idle(ids(8), 2, set()) and p.idle_above == 2


def test_a_probe_of_the_lent_cores_lasts_a_few_rounds():
    p = idle_proposer(3)
    p._probe_rounds = mod.PROBE_ROUNDS
    assert all(p._idle(ids(4), 4, set()) for _ in range(mod.PROBE_ROUNDS))
    assert not p._idle(ids(4), 4, set()) and p.idle_above is None and p._probe_rounds is None


def test_a_probe_sends_only_its_later_steps():
    """The first steps on the grown team run slower: of a probe's rounds, the controller
    gets the last STEPS_SENT, the first half left out."""
    p = idle_proposer(3)
    p._probe_rounds = mod.PROBE_ROUNDS
    rows, sampled = ["a", "b", "c", "d"], [[5], [6], [7], [8]]
    p._prev_ids = set(rows)
    for _ in range(mod.PROBE_ROUNDS):
        p.propose_round(rows, [4] * 4, None, sampled, set(), None)
    assert mod.PROBE_ROUNDS >= 2 * mod.STEPS_SENT
    assert len(p.target_steps) == mod.STEPS_SENT  # of PROBE_ROUNDS - 1 measured steps
    assert all(width == 4 for width, *_ in p.target_steps)


LENDING_SCRIPT = """
import json, os, torch
from vllm_saguaro.core.placement import process_threads
from vllm_saguaro.vllm_glue.lending import CoreLending, lending_binding
a, b = int(os.environ["A"]), int(os.environ["B"])
torch.ones(1 << 20).sum()  # the team vLLM's worker starts with
lending = CoreLending([b])
out = {"binding": lending_binding([b]), "own": lending.own,
       "start": [lending.lent, lending.rekeyed, torch.get_num_threads()]}
lending.give_back()
torch.ones(1 << 22).sum()
out["back"] = [torch.get_num_threads(), lending.rekeyed]
lending.lend()
torch.ones(1 << 22).sum()
out["lent"] = [torch.get_num_threads(), sorted({c for t in process_threads() for c in t.cores}),
               lending.rekeyed]
print(json.dumps(out))
"""


@pytest.mark.parametrize("start", ["whole", "own"])
def test_core_lending_grows_the_team_onto_the_draft_cores_and_back(start):
    """The target's OpenMP team takes the draft's core while the draft idles, bound there
    by OpenMP from the affinity list vLLM starts the worker with (target's cores, then the
    draft's), and shrinks back to its own size. A fresh process with GNU OpenMP's list;
    the team starts whole (as patches.patch_omp_binding starts it: lent, the target's own
    count in TARGET_THREADS_ENV) or, started by anyone else, with the target's cores."""
    import json
    import os
    import subprocess
    import sys

    import pytest

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    a, b = cores[:2]
    from vllm_saguaro.vllm_glue.lending import TARGET_THREADS_ENV

    env = {**os.environ, "OMP_NUM_THREADS": "2" if start == "whole" else "1",
           "GOMP_CPU_AFFINITY": f"{a} {b}", "A": str(a), "B": str(b)}
    env.pop("KMP_AFFINITY", None)
    env.pop(TARGET_THREADS_ENV, None)
    if start == "whole":
        env[TARGET_THREADS_ENV] = "1"
    proc = subprocess.run([sys.executable, "-c", LENDING_SCRIPT], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["binding"] and r["own"] == 1
    whole = start == "whole"
    assert r["start"] == [whole, False, 2 if whole else 1]
    assert r["back"] == [1, whole]  # the draft's turn: its core free; rekeyed if not native
    assert r["lent"] == [2, [a, b], not whole]  # a thread on each core


def test_lending_binding_reads_openmps_lists(monkeypatch):
    from vllm_saguaro.vllm_glue.lending import lending_binding

    monkeypatch.setenv("KMP_AFFINITY", "granularity=fine,explicit,proclist=[0,1]")
    assert lending_binding([1]) and not lending_binding([0])
    monkeypatch.setenv("KMP_AFFINITY", "granularity=fine,explicit,proclist=[0]")
    assert not lending_binding([1])
    monkeypatch.delenv("KMP_AFFINITY")
    monkeypatch.setenv("GOMP_CPU_AFFINITY", "2 3 7")
    assert lending_binding([7]) and not lending_binding([3])
    monkeypatch.delenv("GOMP_CPU_AFFINITY")
    assert not lending_binding([1])


def test_payload_bytes_and_the_transfer_line():
    """A round's payload: token ids at 4 bytes (outcomes and resync prompts out, drafts
    back), a byte a hit flag, q's uint16 counts; the SSD line shows it per round."""
    import numpy as np

    updates = [("a", [7, 8], None, None), ("b", None, list(range(10)), (0.0, 0, 1.0, None))]
    q = np.zeros((3, 100), dtype=np.uint16)
    results = [([1, 2, 3], True, None), ([4, 5, 6], None, q)]
    assert mod.payload_bytes(updates, results) == 4 * 12 + (12 + 1) * 2 + 600
    m = SaguaroMetrics(0.0)
    m.record_round([True, None], 0.0, 0.004, draft_s=0.003, unpack_s=0.001,
                   lengths=[3, 3], transfer_bytes=2048)
    m.record_round([True, True], 0.0, 0.002, draft_s=0.002, lengths=[3, 3], transfer_bytes=0)
    assert m.transfer_bytes == 2048 and abs(m.transport_s - 0.002) < 1e-9
    assert "transfer 1.0 KB/round in 1.00 ms" in m.summary()


def test_transport_resolves_to_the_channel_backend_the_devices_allow(tiny_target):
    from vllm_saguaro.config import SaguaroConfig

    def backend(transport, draft_device, target_device):
        cfg = SaguaroConfig.model_validate(dict(draft_model=str(tiny_target),
                                                transport=transport, draft_device=draft_device))
        return mod.channel_backend(cfg, target_device)

    assert backend("auto", "cpu", "cpu") is None                 # CPU keeps Ray's reply
    assert backend("auto", "cuda:1", "cuda:0") == "nccl"         # GPU to GPU
    assert backend("channel", "cpu", "cpu") == "gloo"            # the CPU test of the path
    assert backend("channel", "cuda:1", "cpu") == "gloo"
    assert backend("ray", "cuda:1", "cuda:0") is None


def test_target_placement_warns_only_where_the_draft_cores_are_not_lent(monkeypatch, caplog):
    """A target thread on the draft's core: a warning where the cores are not lent (vLLM
    did not bind the target), none where they are (the lent team's thread is there by
    design)."""
    import logging

    from vllm_saguaro.vllm_glue import proposer

    monkeypatch.setattr(proposer, "process_threads",
                        lambda: [SimpleNamespace(cores=[0]), SimpleNamespace(cores=[1])])
    with caplog.at_level(logging.WARNING, logger="vllm_saguaro"):
        proposer.check_target_placement([1], lent=True)
        assert not caplog.records
        proposer.check_target_placement([1])
    assert len(caplog.records) == 1 and "[1]" in caplog.records[0].getMessage()


def test_an_idle_ends_once_the_text_shows_its_lookup_wake_share():
    """IdleAdvice.wake_share: while idle, each decoding row's latest position goes into a
    LookupWatch; the idle ends once the share of positions continuing a 3-token match
    reaches it (code after prose: text the draft did not see while it idled), and the
    next idles watch only after LOOKUP_REWAKE_S."""
    import torch

    from vllm_saguaro.core.fallback import LookupWatch

    p = idle_proposer(0)
    p._wake_share, p._lookup = 0.5, LookupWatch()
    prose = torch.arange(100, 200)[None]           # no token repeats: no match
    code = torch.tensor([[1, 2, 3, 4] * 25])       # every position past 7 a 3-token match
    for n in range(20, 40):
        assert not p._watch_lookup([[7]], [n], prose) and p._idle(ids(1), 1, set())
    woke = [p._watch_lookup([[7]], [n], code) for n in range(20, 60)]
    assert woke[-1] and not woke[0]
    assert not p._idle(ids(1), 1, set(), woken=True)
    assert p.idle_above is None and p._lookup is None and p._wake_share is None
    p.idle_above, p._wake_share, p._lookup = 0, 0.5, LookupWatch()  # the next idle
    assert not any(p._watch_lookup([[7]], [n], code) for n in range(20, 60))
    p._lookup_woke -= mod.LOOKUP_REWAKE_S
    assert any(p._watch_lookup([[7]], [n], code) for n in range(20, 60))
    p._wake_share = None  # an idle without a wake share watches nothing
    assert not p._watch_lookup([[7]], [60], code)
    p = idle_proposer(0)  # a large batch: LOOKUP_ROWS rows a step, in turn
    p._wake_share, p._lookup = 0.5, LookupWatch()
    p._watch_lookup([[7]] * 8, [60] * 8, code.repeat(8, 1))
    assert p._lookup.seen == mod.LOOKUP_ROWS


def test_an_idle_sends_its_own_lookup_drafts_where_they_pay():
    """IdleAdvice.lookup: while idle the proposer drafts from each decoding row's own
    tokens (core/idle_lookup.py), without the draft (_NoActor): a row continuing a
    3-token match sends its continuation, one of prose nothing, a seeded sampled row
    nothing (its drafts must not depend on timing). No q, greedy rows or sampled: the
    verifier takes a draft without q as drawn one-hot (core/verification.py). The next
    round learns what was accepted and measures the step as a verification's."""
    import torch

    code = [1, 2, 3, 4] * 5                     # ... 2 3 4 | continues 1 2 3
    prose = list(range(100, 120))               # no token repeats
    tokens = torch.tensor([code, prose, code])
    p = idle_proposer(0)
    rates = (0.02, 0.15, 0.35, 0.8)
    p._idle_lookup = IdleLookup(IdleLookupAdvice(rates, rates, (0.036, 0.001)))
    greedy = lambda rid: SamplingSpec()  # noqa: E731
    drafts, probs = p.propose_round(["a", "b", "c"], [20, 20, 20], tokens, [[4], [119], [4]],
                                    set(), greedy)
    assert drafts == [[1, 2, 3], [], [1, 2, 3]] and probs is None
    assert p._width == 3 + 6 and p._drafted
    assert p.metrics.idle_rounds == 1 and p.metrics.idle_lookup_rounds == 1
    assert p.metrics.sent[3] == 2 and p.metrics.sent[0] == 1 and p.metrics.plain_rounds == 0
    assert "draft idle in 100% (prompt lookup drafts in 100%)" in p.metrics.lengths_summary()

    specs = {"a": SamplingSpec(1.0), "b": SamplingSpec(), "c": SamplingSpec(1.0, seed=7)}
    p._last_done = time.perf_counter() - 0.04
    accepted = torch.tensor([code + [1, 2, 3, 4], prose + [120, 121, 0, 0], code + [1, 2, 3, 4]])
    drafts, probs = p.propose_round(["a", "b", "c"], [24, 22, 24], accepted,
                                    [[1, 2, 3, 4], [121], [1, 2, 3, 4]], set(), specs.get)
    assert drafts == [[1, 2, 3], [], []] and probs is None  # "c" is seeded
    look = p._idle_lookup
    # all 3 accepted, taught to the greedy fit ("a" was greedy when it sent them)
    fits = look.acceptance.fits
    assert fits[True][3].accepted > 0 and fits[True][3].rejected == 0
    assert fits[False][3].accepted == 0
    assert look.verify[False].predict(9) < StepCost(0.036, 0.001).predict(9)  # 40 ms, not 45
    assert p.target_steps == []  # the IdleLookup's alone, not the worker's (SD's line)

    p.idle_above = 1
    assert not p._idle(ids(1), 1, set())       # the batch shrank: the idle ends
    assert p._idle_lookup is None


@pytest.mark.parametrize("objective", ["span", "tokens"])
def test_a_draining_batch_sends_lookup_drafts_only_where_they_shorten_it(objective):
    """The runner passes the tokens each row has left where no request waits (`left`,
    patches.patch_runner_propose). With the span objective the proposer's lookup drafts
    are valued by the batch's last row (core/span.py): one row of four continuing a
    match, all with 40 tokens left, sends nothing, and the round counts as a draining
    one; with the tokens objective `left` changes nothing."""
    import torch

    code = [1, 2, 3, 4] * 5
    prose = list(range(100, 120))
    tokens = torch.tensor([code, prose, prose, prose])
    p = idle_proposer(0)
    p.cfg = SimpleNamespace(num_speculative_tokens=3,
                            controller=SimpleNamespace(objective=objective))
    rates = (0.02, 0.15, 0.35, 0.8)
    p._idle_lookup = IdleLookup(IdleLookupAdvice(rates, rates, (0.036, 0.001)))
    greedy = lambda rid: SamplingSpec()  # noqa: E731
    drafts, _ = p.propose_round(["a", "b", "c", "d"], [20] * 4, tokens,
                                [[4], [119], [119], [119]], set(), greedy, left=[40] * 4)
    if objective == "span":
        assert drafts == [[], [], [], []] and p.metrics.drain_rounds == 1
        assert "valued by the draining batch's span in 100%" in p.metrics.lengths_summary()
    else:
        assert drafts == [[1, 2, 3], [], [], []] and p.metrics.drain_rounds == 0


def test_paused_rounds_send_nothing_lend_the_cores_and_resume_calling_the_draft():
    """pause(): every round plain (no draft call, no lookup drafts even where an idle
    had them), the cores lent once no pre-speculation runs; finished requests kept for
    the draft's next call. Resumed, the draft is called again (a batch it holds)."""
    import torch

    code = [1, 2, 3, 4] * 5
    tokens = torch.tensor([code, code])
    p = idle_proposer(0)  # an idle with lookup drafts that would be sent
    rates = (0.02, 0.15, 0.35, 0.8)
    p._idle_lookup = IdleLookup(IdleLookupAdvice(rates, rates, (0.036, 0.001)))
    p.supervisor = _Supervisor()
    p.lending, p.pending = _Lending(), object()
    p.supervisor.ready = lambda ref: False  # a pre-speculation still running
    p.pause()
    greedy = lambda rid: SamplingSpec()  # noqa: E731
    drafts, probs = p.propose_round(["a", "b"], [20, 20], tokens, [[4], [4]], {"x"}, greedy)
    assert drafts == [[], []] and probs is None and not p.lending.lent
    assert p._gone == {"x"} and p.metrics.idle_lookup_rounds == 0
    p.supervisor.ready = lambda ref: True
    p.idle_above = None  # no idle of the controller's either: paused all the same
    drafts, _ = p.propose_round(["a", "b"], [20, 20], tokens, [[4], [4]], set(), greedy)
    assert drafts == [[], []] and p.lending.lent and p.metrics.idle_rounds == 2

    p = idle_proposer(None)
    p.mirror = {"a": object()}
    p.pause()
    drafts, _ = p.propose_round(["a"], [5], torch.zeros(1, 5, dtype=torch.long), [[5]],
                                set(), None)
    assert drafts == [[]]
    p.pause(False)
    with pytest.raises(AssertionError, match="the draft was called"):
        p.propose_round(["a"], [6], torch.zeros(1, 6, dtype=torch.long), [[6]], set(), None)
