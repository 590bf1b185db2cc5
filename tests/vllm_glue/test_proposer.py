"""The proposer's idle state: while the controller says speculation cannot pay at the
batch size running, rounds are answered without the draft (plain decoding)."""
import time

from vllm_saguaro.vllm_glue import proposer as mod
from vllm_saguaro.vllm_glue.metrics import SaguaroMetrics


class _NoActor:
    def __getattr__(self, name):
        raise AssertionError(f"the draft was called ({name}) while idle")


def idle_proposer(limit):
    p = mod.SaguaroProposer.__new__(mod.SaguaroProposer)
    p.actor, p.pending, p.mirror = _NoActor(), None, {}
    p.metrics = SaguaroMetrics(0.0)
    p.target_steps, p._width, p._last_done = [], None, None
    p.idle_above, p._idle_since, p._finished_while_idle = limit, time.monotonic(), set()
    return p


def test_idle_rounds_skip_the_draft_and_keep_the_finished():
    p = idle_proposer(2)
    sampled = [[5], [6], [7], [8]]
    drafts, probs = p.propose_round(["a", "b", "c", "d"], [4, 4, 4, 4], None, sampled,
                                    {"x"}, None)
    assert drafts == [[], [], [], []] and probs is None
    assert p._finished_while_idle == {"x"}
    assert p.metrics.idle_rounds == 1 and p.metrics.plain_rounds == 1
    assert p.metrics.sent[0] == 4
    assert p._width == 4  # the plain step's width: the controller's cost model gets it next


def test_idle_ends_when_the_batch_shrinks_or_after_a_while(monkeypatch):
    p = idle_proposer(2)
    assert p._idle(4, set(), 0.0) and p.idle_above == 2
    assert not p._idle(2, set(), 0.0) and p.idle_above is None  # small enough: ask the draft
    p = idle_proposer(2)
    p._idle_since -= mod.IDLE_RECHECK_S + 1
    assert not p._idle(8, set(), 0.0)
