"""The device speculation table against the per-sequence dict it replaces on CUDA: the
same speculation (tokens, exact q, confidence) for every outcome, hit or miss."""
import random

import torch

from vllm_saguaro.core.cache import Speculation, SpeculationCache
from vllm_saguaro.core.outcome import Outcome
from vllm_saguaro.core.sampling import Q_SCALE, quantize_distribution
from vllm_saguaro.draft.speculation_table import SpeculationTable, TableView

K, HEAD = 4, 12


def _spec(rng: random.Random, sampled: bool) -> Speculation:
    m = rng.randint(0, K)
    probs = None
    if sampled:
        rows = torch.rand(m, HEAD, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
        rows = rows ** 4 / (rows ** 4).sum(-1, keepdim=True)
        probs = quantize_distribution(rows) if m else torch.zeros(0, HEAD)
        if m:  # all the mass on one token: a count of Q_SCALE, one past int16
            probs[0] = 0.0
            probs[0, rng.randrange(HEAD)] = 1.0
    conf = [rng.choice([None, rng.random()]) for _ in range(m)]
    return Speculation([rng.randrange(1000) for _ in range(m)], probs, conf)


def _fill(rng, table, rids, sampled):
    caches = {}
    for rid in rids:
        outcomes = list({Outcome(rng.randrange(K + 1), rng.randrange(50))
                         for _ in range(rng.randint(0, 9))})
        specs = [_spec(rng, sampled) for _ in outcomes]
        table.put(rid, outcomes, specs)
        caches[rid] = SpeculationCache({o: s for o, s in zip(outcomes, specs)})
    return caches


def _same(a: Speculation | None, b: Speculation | None):
    assert (a is None) == (b is None), (a, b)
    if a is None:
        return
    assert a.tokens == b.tokens
    assert (a.probs is None) == (b.probs is None)
    if a.probs is not None:
        assert torch.equal(a.probs, b.probs)  # exact: the verifier is told this very q
        assert torch.allclose(a.probs.sum(-1), torch.ones(len(a.tokens)))
    assert [c is None for c in a.confidence] == [c is None for c in b.confidence]
    assert all(c is None or abs(c - d) < 1e-6 for c, d in zip(a.confidence, b.confidence))


def _check(rng, table, caches, absent=()):
    queries, want = [], []
    for rid, cache in caches.items():
        for o in list(cache.entries):
            queries.append((rid, o))
            want.append(cache.lookup(o))
        for _ in range(5):  # mostly misses
            o = Outcome(rng.randrange(K + 1), rng.randrange(50))
            queries.append((rid, o))
            want.append(cache.lookup(o))
    for rid in absent:
        queries.append((rid, Outcome(0, 1)))
        want.append(None)
    order = list(range(len(queries)))
    rng.shuffle(order)
    got = table.lookup([queries[i] for i in order])
    for i, g in zip(order, got):
        _same(g, want[i])
    assert any(w is not None for w in want) and any(w is None for w in want)


def test_the_table_answers_as_the_dict_does_hits_misses_exact_q_and_growth():
    for seed, sampled in [(0, True), (1, False), (2, True)]:
        rng = random.Random(seed)
        table = SpeculationTable(K, HEAD, "cpu", capacity=4)  # grows several times
        caches = _fill(rng, table, [f"r{i}" for i in range(7)], sampled)
        assert table.capacity >= table.size > 4
        _check(rng, table, caches, absent=["unknown"])
        view = TableView(table, "r3", len(caches["r3"]))
        for o in list(caches["r3"].entries)[:3]:
            _same(view.lookup(o), caches["r3"].lookup(o))


def test_retain_keeps_the_sequences_still_waiting_and_new_branches_join_them():
    rng = random.Random(5)
    table = SpeculationTable(K, HEAD, "cpu", capacity=8)
    caches = _fill(rng, table, ["a", "b", "c", "d"], True)
    table.retain(["d", "b"])  # a and c were verified (their caches consumed)
    assert set(table.slots) == {"d", "b"}
    caches.update(_fill(rng, table, ["a", "e"], True))  # the next round's pre-speculation
    kept = {r: caches[r] for r in ("b", "d", "a", "e")}
    _check(rng, table, kept, absent=["c"])
    table.retain([])
    assert table.size == 0 and table.lookup([("b", Outcome(0, 1))]) == [None]


def test_a_count_of_q_scale_survives_the_int16_storage():
    table = SpeculationTable(1, 3, "cpu")
    q = torch.tensor([[0.0, 1.0, 0.0]])
    table.put("r", [Outcome(0, 7)], [Speculation([1], q, [0.5])])
    got = table.lookup([("r", Outcome(0, 7))])[0]
    assert torch.equal(got.probs, q) and got.probs[0, 1] * Q_SCALE == Q_SCALE
