"""The draft worker against transformers: forward, fallback drafts and tree-decoded branches."""
import os
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaForCausalLM

from vllm_saguaro.config import SaguaroConfig
from vllm_saguaro.core.cache import SpeculationCache
from vllm_saguaro.core.controller import RealizedRate, StepCost
from vllm_saguaro.core.outcome import Outcome
from vllm_saguaro.draft.model import DraftModel
from vllm_saguaro.draft.worker import DraftWorker


@pytest.fixture(scope="module")
def hf(tiny_target):
    """The transformers reference every test compares with, loaded once."""
    return LlamaForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32)


def hf_greedy(model, tokens, n):
    out = list(tokens)
    for _ in range(n):
        logits = model(torch.tensor([out])).logits[0, -1]
        out.append(int(logits.argmax()))
    return out[len(tokens):]


def step(w, updates, finished, target_steps=(), k_cap=None):
    results, waited, compute, idle, _ = w.step(updates, finished, target_steps, k_cap)
    assert waited >= 0 and compute >= 0
    return results


def worker(path, **kw):
    cfg = dict(draft_model=str(path), num_speculative_tokens=3, draft_dtype="float32",
               fanout={"policy": "uniform", "width": 3}, fallback="neural",
               controller={"policy": "fixed"})  # K every round unless a test says otherwise
    cfg.update(kw)
    return DraftWorker(SaguaroConfig.model_validate(cfg).to_json_dict(), 512, bind=False)


def test_forward_matches_transformers(tiny_target, hf):
    ours = DraftModel(tiny_target, torch.float32)
    ids = torch.tensor([[5, 17, 99, 3, 250, 7]])
    pos = torch.arange(6)[None]
    mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    hidden, _ = ours.forward(ids, pos, mask)
    with torch.no_grad():
        ref = hf(ids).logits
    torch.testing.assert_close(ours.logits(hidden), ref, atol=2e-4, rtol=2e-4)


def test_repeated_kv_heads_attend_like_grouped_attention(tmp_path):
    """The CUDA way (KV heads repeated to the query's, model.CUDA_ATTENTION) gives what
    enable_gqa gives, over context, scratch and a tree mask: 4 query heads on 2 KV heads, so
    repeating the heads in the wrong order (head h reading KV head h % 2) fails."""
    from tests.tiny_models import make_tiny_llama

    path = make_tiny_llama(tmp_path / "gqa", heads=4, kv_heads=2, hidden=256)
    grouped, repeated = (DraftModel(path, torch.float32) for _ in range(2))
    repeated.expand_kv = True
    ids = torch.tensor([[5, 17, 99, 3, 250, 7], [8, 9, 10, 11, 12, 13]])
    pos = torch.arange(6)[None].expand(2, 6)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None].expand(2, 1, 6, 6)
    (h1, ctx), (h2, _) = grouped.forward(ids, pos, causal), repeated.forward(ids, pos, causal)
    torch.testing.assert_close(h2, h1)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # two branches
    mask = torch.cat([torch.ones(3, 6, dtype=torch.bool), tree], 1)[None, None].expand(2, 1, 3, 9)
    nxt, npos = torch.tensor([[4, 40, 41], [6, 60, 61]]), torch.tensor([[6, 7, 7]] * 2)
    a, _ = grouped.forward(nxt, npos, mask, context=ctx)
    b, _ = repeated.forward(nxt, npos, mask, context=ctx)
    torch.testing.assert_close(b, a)


@pytest.fixture(params=[False, True], ids=["dict_cache", "device_table"])
def cache_kind(request, monkeypatch):
    """The speculation cache as a dict per sequence (CPU) or as the device table the worker
    uses with the ops (CUDA; SAGUARO_DRAFT_OPS=1 on CPU)."""
    from vllm_saguaro.draft.speculation_table import TableView
    from vllm_saguaro.draft.worker import OPS_ENV

    if request.param:
        monkeypatch.setenv(OPS_ENV, "1")
    else:
        monkeypatch.delenv(OPS_ENV, raising=False)
    return TableView if request.param else SpeculationCache


def test_fallback_and_branches_are_greedy_continuations(tiny_target, hf, cache_kind):
    w = worker(tiny_target)
    prompts = {"a": [5, 17, 99, 3, 250, 7], "b": [9, 8, 7, 300, 301, 302, 303, 11, 12]}
    out = step(w, [(r, None, p, None) for r, p in prompts.items()], [])
    for (draft, hit, q), p in zip(out, prompts.values()):
        assert hit is None and q is None
        assert draft == hf_greedy(hf, p, 3)
    w.prespeculate()
    for rid, p in prompts.items():
        st = w.seqs[rid]
        assert isinstance(st.cache, cache_kind)
        assert len(st.cache) == 4 * 3
        for (k, bonus), branch in st.cache.entries.items():
            prefix = p + st.spec[:k] + [bonus]
            assert branch.tokens == hf_greedy(hf, prefix, 3), (rid, k, bonus)
            if k < 3:
                assert bonus != st.spec[k], "the sent token is never a bonus candidate"


def test_hits_misses_and_rollback(tiny_target, hf, cache_kind):
    w = worker(tiny_target)
    p = [5, 17, 99, 3, 250, 7]
    (spec, _, _), = step(w, [("a", None, p, None)], [])
    w.prespeculate()
    assert isinstance(w.seqs["a"].cache, cache_kind)
    cached = w.seqs["a"].cache.entries
    (k, bonus), branch = next(iter(cached.items()))
    sampled = spec[:k] + [bonus]
    (nxt, hit, _), = step(w, [("a", sampled, None, None)], [])
    assert hit and nxt == branch.tokens
    tokens = p + sampled
    # A bonus token nobody cached: the fallback drafts from the rolled-back KV.
    w.prespeculate()
    spec2 = nxt
    miss_bonus = next(t for t in range(10, 512)
                      if Outcome(0, t) not in w.seqs["a"].cache.entries and t != spec2[0])
    (nxt2, hit2, _), = step(w, [("a", [miss_bonus], None, None)], [])
    assert not hit2
    assert nxt2 == hf_greedy(hf, tokens + [miss_bonus], 3)
    assert w.stats.lookups == 2 and w.stats.hits == 1
    # outcomes by who drafted the speculation: the first draft (neural), then the cached one
    s = w.stats
    assert (s.neural_outcomes, s.neural_tokens, s.hit_outcomes, s.hit_tokens) == (1, len(sampled), 1, 1)


def test_force_cache_miss_and_finish(tiny_target):
    w = worker(tiny_target, force_cache_miss=True)
    (spec, _, _), = step(w, [("a", None, [5, 6, 7], None)], [])
    w.prespeculate()
    (_, hit, _), = step(w, [("a", spec + [0], None, None)], [])
    assert not hit and w.stats.hits == 0 and w.stats.lookups == 1
    step(w, [], ["a"])
    assert "a" not in w.seqs and w.kv.length("a") == 0


def test_cut_head_drafts_only_kept_tokens(tiny_target, hf):
    w = worker(tiny_target, draft_head_tokens=300)
    p = [5, 17, 99, 3, 250, 7]
    (spec, _, _), = step(w, [("a", None, p, None)], [])
    w.prespeculate()
    drafted = set(spec)
    for (k, bonus), branch in w.seqs["a"].cache.entries.items():
        drafted |= set(branch.tokens) | {bonus}
    assert max(drafted) < 300, "token ids outside the kept head were proposed"
    # the draft's greedy choice restricted to the kept head, checked against transformers
    with torch.no_grad():
        ref = hf(torch.tensor([p])).logits[0, -1, :300].argmax().item()
    assert spec[0] == ref


def test_sampled_drafts_carry_q_and_seeds_reproduce(tiny_target):
    from vllm_saguaro.core.sampling import SamplingSpec

    def run(seed):
        w = worker(tiny_target, saguaro_c=0.3, draft_head_tokens=400)
        spec = tuple(SamplingSpec(temperature=0.8, top_p=0.95, seed=seed))
        (toks, _, q), = step(w, [("a", None, [5, 17, 99, 3], spec)], [])
        w.prespeculate()
        branches = {o: s.tokens for o, s in w.seqs["a"].cache.entries.items()}
        return toks, q, branches, w

    toks, counts, branches, w = run(7)
    from vllm_saguaro.core.sampling import Q_SCALE, from_wire

    assert counts.shape == (3, 400) and counts.dtype.name == "uint16", "counts over the head"
    q = from_wire(counts)
    assert (counts.sum(-1) == Q_SCALE).all() and (q.sum(-1) == 1).all(), "exactly 1"
    assert w.head_ids() == list(range(400))
    assert all(q[i, t] > 0 for i, t in enumerate(toks)), "drafted tokens have mass under q"
    for spec in w.seqs["a"].cache.entries.values():
        assert spec.probs.shape == (3, 400)
    toks2, q2, branches2, _ = run(7)
    assert toks2 == toks and (q2 == counts).all() and branches2 == branches
    assert any(run(s)[0] != toks for s in (8, 9, 10, 11)), "different seeds, same drafts"


def test_certain_miss_cuts_prespeculation_short(tiny_target, hf):
    w = worker(tiny_target)
    p = [5, 17, 99, 3, 250, 7]
    (spec, _, _), = step(w, [("a", None, p, None)], [])
    w.prespeculate()
    roots = w.seqs["a"].roots
    (k, bonus) = next(iter(roots))
    assert not w._certain_miss(("a", spec[:k] + [bonus], None, None))
    assert w._certain_miss(("a", [100000], None, None))
    assert w._certain_miss(("b", None, [1, 2], None)), "a new sequence always needs the fallback"
    # next round: the first tree step finds step()'s abort request and stops
    (nxt, _, _), = step(w, [("a", spec[:k] + [bonus], None, None)], [])
    forward = w.model.forward
    calls = []

    def forward_then_abort(*args, **kw):
        calls.append(1)
        if len(calls) == 1:  # the glue pass; the tree decode checks before each step
            w._abort.set()
        return forward(*args, **kw)

    w.model.forward = forward_then_abort
    w._prespeculate()
    w.model.forward = forward
    assert w.stats.aborted == 1 and w.seqs["a"].cache is None and len(calls) == 1
    tokens = p + spec[:k] + [bonus]
    (k2, b2) = next(iter(w.seqs["a"].roots))
    (after, hit, _), = step(w, [("a", nxt[:k2] + [b2], None, None)], [])
    assert hit is False, "an aborted pre-speculation is a miss, counted as one"
    assert after == hf_greedy(hf, tokens + nxt[:k2] + [b2], 3)


def test_seeded_branch_draws_like_the_fallback(tiny_target):
    """Hit or miss (a matter of timing), a seeded request gets the same drafts."""
    from vllm_saguaro.core.sampling import SamplingSpec

    spec = tuple(SamplingSpec(temperature=1.0, seed=3))
    p = [5, 17, 99, 3, 250, 7]
    w = worker(tiny_target, saguaro_c=0.5)
    (toks, _, _), = step(w, [("a", None, p, spec)], [])
    w.prespeculate()
    (k, bonus), branch = next(iter(w.seqs["a"].cache.entries.items()))
    w2 = worker(tiny_target, saguaro_c=0.5, force_cache_miss=True)
    (toks2, _, _), = step(w2, [("a", None, p, spec)], [])
    assert toks2 == toks
    w2.prespeculate()
    (fallback, hit, _), = step(w2, [("a", toks[:k] + [bonus], None, None)], [])
    assert hit is False and fallback == branch.tokens


def test_geometric_fanout_follows_the_fitted_acceptance(tiny_target):
    """Rounds that accept every draft shift the geometric budget to the full-acceptance
    outcome; with fit_acceptance off the prior's allocation stays."""
    def run(fit: bool):
        w = worker(tiny_target, fanout={"policy": "geometric", "budget": 8, "acceptance_rate": 0.3,
                                        "fit_acceptance": fit, "fit_to_round": False})
        start = list(w.fanout)
        (spec, _, _), = step(w, [("a", None, [5, 17, 99, 3, 250, 7], None)], [])
        for _ in range(12):
            w.prespeculate()
            bonus = next(t for t in range(10, 512) if t not in spec)
            (spec, _, _), = step(w, [("a", spec + [bonus], None, None)], [])  # all K accepted
        return start, w.fanout, w.stats.acceptance_rate

    start, fitted, rate = run(True)
    assert sum(fitted) == 8 and rate > 0.6
    assert fitted[-1] > start[-1] and fitted[0] < start[0], (start, fitted)
    start, kept, _ = run(False)
    assert kept == start


def test_fast_backup_drafts_by_prompt_lookup_and_the_next_round_goes_on(tiny_target, hf):
    from vllm_saguaro.core.fallback import ngram_match

    w = worker(tiny_target, fallback="fast")
    p = [5, 17, 99, 3, 250, 7, 17, 99]
    (spec, _, _), = step(w, [("a", None, p, None)], [])   # a new sequence: neural
    assert spec == hf_greedy(hf, p, 3)
    w.prespeculate()
    bonus = next(t for t in range(10, 512)
                 if Outcome(0, t) not in w.seqs["a"].cache.entries and t != spec[0])
    (nxt, hit, q), = step(w, [("a", [bonus], None, None)], [])  # a miss
    assert hit is False and q is None and w.stats.fast_seqs == 1
    assert nxt == ngram_match(p + [bonus], 3).tokens, (w.seqs["a"].tokens, bonus)
    w.prespeculate()  # glue over the lookup draft; then a cached branch serves again
    (k, b), branch = next(iter(w.seqs["a"].cache.entries.items()))
    (nxt2, hit2, _), = step(w, [("a", nxt[:k] + [b], None, None)], [])
    assert hit2 and nxt2 == branch.tokens == hf_greedy(hf, p + [bonus] + nxt[:k] + [b], 3)
    s = w.stats
    assert (s.neural_outcomes, s.neural_tokens, s.fast_outcomes, s.fast_tokens) == (1, 1, 1, k + 1)
    assert s.fast_rounds == 1 and s.fallback_rounds == 1  # the new sequence's draft was neural


def test_fit_to_round_shrinks_the_budget_when_the_round_overran(tiny_target):
    """A step that finds the pre-speculation still running shrinks the next budget; clean
    rounds grow it back; with fit_to_round off the configured budget stays."""
    import threading

    def run(fit: bool):
        w = worker(tiny_target, fanout={"policy": "probable", "budget": 8, "fit_to_round": fit})
        (spec, _, _), = step(w, [("a", None, [5, 17, 99, 3], None)], [])
        budgets = []
        for overrun in (True, True, False, False, False, False):
            w.prespeculate()
            bonus = next(t for t in range(10, 512) if t != spec[0])
            if overrun:  # hold the lock as a pre-speculation still in flight would
                w._lock.acquire()
                threading.Timer(0.05, w._lock.release).start()
            (spec, _, _), = step(w, [("a", [bonus], None, None)], [])
            budgets.append(w.stats.budget)
        return budgets

    assert run(True) == [6, 4, 4, 5, 5, 6]
    assert run(False) == [8] * 6


def test_probable_selection_spends_the_batch_budget_on_greedy_branches(tiny_target, hf):
    w = worker(tiny_target, fanout={"policy": "probable", "budget": 5, "fit_to_round": False})
    prompts = {"a": [5, 17, 99, 3, 250, 7], "b": [9, 8, 7, 300, 301, 302]}
    out = step(w, [(r, None, p, None) for r, p in prompts.items()], [])
    w.prespeculate()
    total = 0
    for (spec, _, _), (rid, p) in zip(out, prompts.items()):
        st = w.seqs[rid]
        assert len(st.confidence) == 3 and all(0 <= c <= 1 for c in st.confidence)
        assert len(st.cache) >= 1 and set(st.cache.entries) == set(st.roots)
        total += len(st.cache)
        for (k, bonus), branch in st.cache.entries.items():
            if k < 3:
                assert bonus != spec[k], "the sent token is never a bonus candidate"
            assert branch.tokens == hf_greedy(hf, p + spec[:k] + [bonus], 3), (rid, k, bonus)
    assert total == 5 * 2, "budget x batch branches in all"
    # the verified outcome feeds the calibration; a miss is counted under its reason
    seen = sum(w.calibration.seen)
    roots, spec_a = w.seqs["a"].roots, out[0][0]
    bonus = next(x for x in range(512) if x != spec_a[0] and (0, x) not in roots)
    reason = "bonus" if any(o.k == 0 for o in roots) else "k"
    (_, hit, _), = step(w, [("a", [bonus], None, None)], [])
    assert hit is False and sum(w.calibration.seen) == pytest.approx(seen * 0.998 + 1.0)
    assert getattr(w.stats, f"miss_{reason}") == 1 and w.stats.lookups == 1


def test_probable_never_bets_on_the_rejected_token_when_sampling(tiny_target):
    """At T > 0 Saguaro sampling lowers q below p_d on the top tokens, so max(0, p_d - q)
    is positive at the sent token; a rejected token cannot be the bonus all the same."""
    from vllm_saguaro.core.sampling import SamplingSpec
    from vllm_saguaro.draft.fork import outcome_estimates

    w = worker(tiny_target, saguaro_c=0.2, fanout={"policy": "probable", "budget": 8})
    spec = tuple(SamplingSpec(temperature=1.0))
    (toks, _, _), = step(w, [("a", None, [5, 17, 99, 3], spec)], [])
    st = w.seqs["a"]
    hidden = w._glue(["a"])
    logits = w.model.logits(hidden[0])
    conf, cands = outcome_estimates(logits, toks, st.sampling, w.fanout, 0.2, w.model, 512)
    for j in range(3):
        assert toks[j] not in {x for x, _ in cands[j]}, j
        assert sum(p for _, p in cands[j]) == pytest.approx(1.0, abs=1e-4)
    assert all(0 < c <= 1 for c in conf)


# ----------------------------------------------------------------- the length controller
CHEAP = [(4, 0.050, False), (16, 0.0505, False), (8, 0.0502, False)]  # tokens ~free to verify


def dear_draft(w, seconds=0.05):
    """A draft step of `seconds` (the tiny test draft's is ~free, which would make SD on
    the lent cores pay wherever they verify fast)."""
    w.draft_cost = type(w.draft_cost)()
    w.draft_cost.observe(1, seconds)
    return w
DEAR = [(4, 0.05, False), (16, 0.50, False), (8, 0.2, False)]  # a token costs most of a step


def test_forced_mixed_lengths_and_empty_drafts_go_round(tiny_target, hf):
    """Lengths 0, 1 and 3 in one batch: each row sends that prefix of its greedy draft, a
    row that sent nothing is pre-speculated for its k = 0 outcomes and can hit."""
    w = worker(tiny_target, controller={"force_lengths": [0, 1, 3]})
    prompts = {"a": [5, 17, 99, 3, 250, 7], "b": [9, 8, 7, 300, 301], "c": [40, 41, 42, 43]}
    tokens = {r: list(p) for r, p in prompts.items()}
    out = step(w, [(r, None, p, None) for r, p in prompts.items()], [])
    hits = 0
    for rnd in range(6):
        lengths = [len(d) for d, _, _ in out]
        assert lengths == [[0, 1, 3][(i + rnd + 1) % 3] for i in range(3)], (rnd, lengths)
        for (draft, _, _), rid in zip(out, prompts):
            full = hf_greedy(hf, tokens[rid], 3)
            assert draft == full[:len(draft)]
        w.prespeculate()
        for rid in prompts:
            st = w.seqs[rid]
            assert st.cache is not None and all(o.k <= len(st.spec) for o in st.cache.entries)
        updates = []
        for (draft, _, _), rid in zip(out, prompts):
            sampled = hf_greedy(hf, tokens[rid], len(draft) + 1)  # what greedy verification gives
            k = next((i for i, (x, y) in enumerate(zip(draft, sampled)) if x != y), len(draft))
            sampled = sampled[:k + 1]
            tokens[rid] += sampled
            updates.append((rid, sampled, None, None))
        out = step(w, updates, [])
        hits += sum(bool(h) for _, h, _ in out)
    assert hits > 0
    assert w.stats.sent[0] > 0 and w.stats.sent[1] > 0 and w.stats.sent[3] > 0
    assert w.stats.plain_outcomes > 0


def test_controller_sends_everything_when_verifying_is_free(tiny_target, hf):
    """A new sequence sends nothing at first (its draft prefill goes to the
    pre-speculation, off the critical path); its next round hits and sends all K."""
    w = worker(tiny_target, controller={"policy": "auto"})
    p = [5, 17, 99, 3, 250, 7]
    (spec, _, _), = step(w, [("a", None, p, None)], [], CHEAP)
    assert spec == [] and w.stats.fallback_rounds == 0
    w.prespeculate()
    bonus = hf_greedy(hf, p, 1)
    (spec, hit, _), = step(w, [("a", bonus, None, None)], [], CHEAP)
    assert hit and spec == hf_greedy(hf, p + bonus, 3)


def test_controller_plain_decoding_and_idle_when_nothing_pays(tiny_target):
    w = worker(tiny_target, controller={"policy": "auto"})
    updates = [(r, None, [5, 17, 99, 3 + i], None) for i, r in enumerate("abcd")]
    results, _, _, idle, _ = w.step(updates, [], DEAR)
    assert all(d == [] for d, _, _ in results)
    assert idle is not None and idle.limit < 4 and not idle.probe  # the proposer leaves the draft alone above it
    assert w.stats.fallback_rounds == 0, "nothing was sent, so nothing should be drafted"
    w.prespeculate()
    assert w.stats.prespec_skipped == 1 and all(st.cache is None for st in w.seqs.values())
    pinned = worker(tiny_target, controller={"policy": "fixed"})
    results, _, _, idle, _ = pinned.step(updates, [], DEAR)
    assert all(len(d) == 3 for d, _, _ in results) and idle is None


def test_k_cap_from_vllms_schedule(tiny_target):
    w = worker(tiny_target, controller={"policy": "fixed"})
    (spec, _, _), = step(w, [("a", None, [5, 17, 99, 3], None)], [], (), k_cap=1)
    assert len(spec) == 1


def test_a_batch_size_vllms_schedule_sends_nothing_at_idles_the_draft(tiny_target):
    """K = 0 in vLLM's schedule at this batch size: whatever the policy, the draft idles
    (the proposer lends its cores and asks for no pre-speculation) until the batch
    shrinks to the largest size the schedule lets send (core/controller.py
    schedule_limit), not called every round."""
    updates = [(r, None, [5, 17, 99, 3 + i], None) for i, r in enumerate("abcd")]
    for policy in ("fixed", "auto"):
        w = worker(tiny_target, controller={"policy": policy},
                   num_speculative_tokens_per_batch_size=[[1, 2, 3], [3, 1024, 0]])
        results, _, _, idle, lent_sd = w.step(updates, [], DEAR, k_cap=0)
        assert all(d == [] for d, _, _ in results) and not lent_sd
        assert idle is not None and idle.limit == 2 and not idle.probe and idle.lookup is None
    pinned = worker(tiny_target, controller={"policy": "fixed"},
                    num_speculative_tokens_per_batch_size=[[1, 2, 3], [3, 1024, 0]])
    results, _, _, idle, _ = pinned.step(updates[:2], [], DEAR, k_cap=3)
    assert all(len(d) == 3 for d, _, _ in results) and idle is None


def test_sampled_confidence_only_where_no_drawn_token_decides(tiny_target):
    """Losslessness of the controller at T > 0: a sampled speculation's alphas must not
    depend on its own drawn tokens, so only the first (an expectation over q) is kept."""
    from vllm_saguaro.core.sampling import SamplingSpec

    w = worker(tiny_target, controller={"policy": "auto"})
    spec = tuple(SamplingSpec(temperature=1.0))
    step(w, [("s", None, [5, 17, 99, 3], spec), ("g", None, [5, 17, 99, 3], None)], [])
    w.prespeculate()
    for branch in w.seqs["s"].cache.entries.values():
        assert branch.confidence[0] is not None and branch.confidence[1:] == [None, None]
        assert 0.0 < branch.confidence[0] <= 1.0
    for branch in w.seqs["g"].cache.entries.values():
        assert all(c is not None and 0.0 < c <= 1.0 for c in branch.confidence)


def test_speculation_must_beat_plain_decoding_on_the_lent_cores(tiny_target, hf):
    """On CPU the draft's core can run the target while the draft idles: a speculation
    that beats plain decoding on the target's own core but not on both sends nothing."""
    w = dear_draft(worker(tiny_target, controller={"policy": "auto"}))
    p = [5, 17, 99, 3, 250, 7]
    step(w, [("a", None, p, None)], [], CHEAP)
    w.prespeculate()
    bonus = hf_greedy(hf, p, 1)
    lent = [(1, 0.005, True), (2, 0.0051, True)]  # ten times faster on every core
    results, _, _, idle, _ = w.step([("a", bonus, None, None)], [], CHEAP + lent)
    assert results[0][0] == [] and idle.limit == 0  # no batch size pays: the proposer lends
    pinned = worker(tiny_target, controller={"policy": "auto", "lend_cores": False})
    step(pinned, [("a", None, p, None)], [], CHEAP)
    pinned.prespeculate()
    (spec, _, _), = step(pinned, [("a", bonus, None, None)], [], CHEAP + lent)
    assert len(spec) == 3  # no lending: the lent measurements are not its alternative


def test_what_speculation_gave_overrules_the_model_when_lower(tiny_target, hf):
    """The model expects speculation to beat plain decoding (tokens ~free to verify), but
    the rounds measured at this batch size gave less than plain decoding does: the draft
    idles (and the proposer lends its cores)."""
    w = worker(tiny_target, controller={"policy": "auto", "lend_cores": False})
    p = [5, 17, 99, 3, 250, 7]
    step(w, [("a", None, p, None)], [], CHEAP)
    w.prespeculate()
    bonus = hf_greedy(hf, p, 1)
    results, _, _, idle, _ = w.step([("a", bonus, None, None)], [], CHEAP)
    assert idle is None and len(results[0][0]) > 0  # the model: speculation pays
    # this test's own (instant) rounds stay out of the measurement: the round just run was
    # observed already, and weighed with 0.8^8 it could still beat plain decoding
    w.realized = RealizedRate(w.realized.min_rounds, w.realized.ttl_s, w.realized.alpha)
    for _ in range(w.realized.min_rounds):  # 1 token a second, plain decoding gives 20
        w.realized.observe(1, tokens=1, seconds=1.0, now=time.perf_counter())
    w._last_call = None
    w.prespeculate()
    bonus = hf_greedy(hf, p + bonus + results[0][0], 1)
    results, _, _, idle, _ = w.step([("a", bonus, None, None)], [], CHEAP)
    assert idle is not None and idle.limit == 0 and results[0][0] == []


def test_rounds_are_measured_start_to_start_while_speculating(tiny_target):
    """_observe_round: a continuing round after a speculating call at the same batch size
    is measured; after an idle advice, a change of batch, or with a (re)synced sequence
    it is not; nor SSD's first round after a switch or a new request (_ssd_steps)."""
    from vllm_saguaro.draft.regime import IdleAdvice

    w = worker(tiny_target, controller={"policy": "auto"})
    now = time.perf_counter()
    w._last_call, w._limit = (now - 0.5, 2, False), None
    for steps in (0, 1):  # the last call was no SSD step on continuing sequences, or the first
        w._ssd_steps = steps
        w._observe_round([("a", [1, 2], None, None), ("b", [3], None, None)], now)
        assert w.realized.rounds(2) == 0
    w._ssd_steps = 2
    w._observe_round([("a", [1, 2], None, None), ("b", [3], None, None)], now)
    means, rounds, _ = w.realized._seen[2]
    assert means[:2] == (3, pytest.approx(0.5)) and rounds == 1  # 3 tokens in 0.5 s
    idle = IdleAdvice(0, probe=False)
    for last, limit, updates in [((now - 0.5, 2, False), idle, [("a", [1], None, None)] * 2),
                                 ((now - 0.5, 3, False), None, [("a", [1], None, None)] * 2),
                                 ((now - 0.5, 2, False), None, [("a", [1], None, None),
                                                                ("b", None, [1, 2, 3], None)])]:
        w._last_call, w._limit = last, limit
        w._observe_round(updates, now)
    assert w.realized.rounds(2) == 1 and set(w.realized._seen) == {2}
    # a round of SD on the lent cores goes to its own measurement; what it cost beyond
    # the target's step and the draft's forwards only from the second such round in a row
    w._last_call, w._limit = (now - 1.0, 2, True), None
    w._lent_sd_steps, w._last_draft_s = 1, 0.2
    w._observe_round([("a", [1, 2], None, None), ("b", [3], None, None)], now, target_s=0.5)
    means, rounds, _ = w.lent_sd_realized._seen[2]
    assert means[:2] == (3, pytest.approx(1.0)) and rounds == 1
    assert w.realized.rounds(2) == 1 and w.lent_sd_overhead is None
    w._lent_sd_steps = 2
    w._observe_round([("a", [1, 2], None, None), ("b", [3], None, None)], now, target_s=0.5)
    assert w.lent_sd_overhead == pytest.approx(0.3)  # 1 s - 0.5 target - 0.2 drafting
    # paid: once what it gave over min_rounds beats plain decoding on the lent cores
    # there by the entry margin; no longer once it gives less than plain decoding
    w.lent_cost = type(w.target_cost)()
    measured_lent(w, {2})
    for _ in range(4):
        w.lent_cost.observe(2, 1.0)  # plain decoding: 2 tokens a second at batch 2
        w.target_cost.observe(2, 2.0)  # (on the target's own cores: 1)
    w.lent_sd_realized.forget(2)
    # 2 tokens a second (plain decoding's), 2.06 (ahead, short of the margin), 3 (paid)
    for seconds, tokens in ((1.0, [1]), (0.97, [1]), (1.0, [1, 2])):
        w.lent_sd_realized.forget(2)
        w._last_call = (now - seconds, 2, True)
        for _ in range(w.lent_sd_realized.rounds_needed(2)):
            w._observe_round([("a", tokens, None, None), ("b", [3], None, None)], now)
        assert (2 in w.lent_sd_paid) == (len(tokens) == 2)
    w._last_call = (now - 1.05, 2, True)  # then 2 tokens in 1.05 s: below plain decoding
    for _ in range(4 * w.lent_sd_realized.min_rows):  # (the average forgets slowly)
        w._observe_round([("a", [1], None, None), ("b", [3], None, None)], now)
    assert 2 not in w.lent_sd_paid and 2 in w.lent_sd_ever_paid  # (ever: IdleAdvice.new_text)


def test_lent_cores_are_probed_once_per_batch_size(tiny_target, hf):
    """Where speculation beats plain decoding on the target's own core, plain decoding on
    the lent cores has not run yet: the draft idles a few rounds there first (a probe),
    then decides with that measurement, and does not probe that batch size again (until
    it is stale: the next test)."""
    w = worker(tiny_target, controller={"policy": "auto"})
    p = [5, 17, 99, 3, 250, 7]
    results, _, _, idle, _ = w.step([("a", None, p, None)], [], CHEAP)
    assert idle is not None and idle.probe and idle.limit == 0
    assert w.stats.lent_probes == 1
    bonus = hf_greedy(hf, p, 1)
    slow = [(1, 0.06, True), (1, 0.061, True), (2, 0.07, True)]  # no faster than its own core
    results, _, _, idle, _ = w.step([("a", bonus, None, None)], [], CHEAP + slow)
    assert idle is None and len(results[0][0]) > 0 and w.stats.lent_probes == 1
    fast = [(1, 0.005, True), (1, 0.0051, True)]  # ten times faster: plain decoding wins
    w.draft_cost = type(w.draft_cost)()  # and SD on them would draft for 50 ms a step
    w.draft_cost.observe(1, 0.05)
    bonus = hf_greedy(hf, p + bonus + results[0][0], 1)
    results, _, _, idle, _ = w.step([("a", bonus, None, None)], [], fast * 4)
    assert idle is not None and not idle.probe and results[0][0] == []


def test_plain_decoding_on_the_lent_cores_is_probed_again_once_stale(tiny_target):
    """Where speculation is chosen and plain decoding on the lent cores was not probed for
    LENT_REPROBE_S (only the odd round measures it while speculating), it is probed
    again, and the old line weighs LENT_REPROBE_KEEP against the probe's rounds: a first
    probe in a cold engine (slow) does not hold plain decoding low for good."""
    from vllm_saguaro.draft.regime import LENT_REPROBE_KEEP, LENT_REPROBE_S, IdleAdvice

    w = lent_worker(tiny_target, regime="lent_sd")  # speculation (SD on the lent cores) chosen
    w._lent_sd_rate = lambda b, now, measured=True: 1e3
    assert w._idle_limit(1) is None  # measured (not probed) in the worker's first 30 s
    w._started -= LENT_REPROBE_S + 1
    weight = w.lent_cost.s0
    assert w._idle_limit(1) == IdleAdvice(0, probe=True) and w.stats.lent_probes == 1
    assert w.lent_cost.s0 == pytest.approx(LENT_REPROBE_KEEP * weight)
    assert w._idle_limit(1) is None  # probed just now: its rounds come with the next step
    w._probed[1] -= LENT_REPROBE_S + 1
    assert w._idle_limit(1).probe and w.stats.lent_probes == 2


def test_a_batch_the_draft_must_first_prefill_idles_unless_the_gain_repays_it(tiny_target):
    """_idle_limit with a catch-up: speculation beats plain decoding on the lent cores by
    1 token/s (5 tokens in the 5 s horizon); prefilling 100 tokens (0.1 s without the lent
    cores: under 1 token lost) is repaid, 2000 (2 s: 12-16 tokens lost) is not, and the
    draft idles; with a 5 tokens/s gain it is. Such an idle names its lookup wake share."""
    from vllm_saguaro.draft.regime import LOOKUP_WAKE_SHARES, IdleAdvice

    w = dear_draft(worker(tiny_target, controller={"policy": "auto"}))  # SSD's rate decides
    for _ in range(4):
        for width, own, lent in [(1, 0.06, 0.04), (2, 0.07, 0.05)]:
            w.target_cost.observe(width, own)
            w.lent_cost.observe(width, lent)
    measured_lent(w, {1, 2})
    plain, own = 1 / w.lent_cost.predict(1), 1 / w.target_cost.predict(1)  # ~23 and ~16 tok/s
    assert 6 < plain - own < 8
    w._expected_rate = lambda b: plain + 1.0
    w.prefill_s_per_token = 1e-3
    assert w._idle_limit(1, 0) is None
    assert w._idle_limit(1, 100) is None
    assert w._idle_limit(1, 2000) == IdleAdvice(0, probe=False)
    assert w.stats.catch_up_idles == 1
    w._expected_rate = lambda b: plain + 5.0  # a larger gain repays even that
    assert w._idle_limit(1, 2000) is None
    # a batch size plain decoding on the lent cores ran at only briefly (the batch arriving
    # or draining): the lent cores' line stands in for a measurement there
    w.lent_widths, w._probed = {2}, {1: time.perf_counter()}  # probed, too briefly to measure
    w._expected_rate = lambda b, shares=None: plain + 1.0
    assert w._idle_limit(1, 2000) == IdleAdvice(0, probe=False)
    # such an idle names its lookup wake share too: text that shows it wakes the draft
    # (without the proposer's own lookup drafts, whose rate would be the bar: below)
    w.cfg.fallback = "auto"
    w.cfg.controller.idle_lookup = False
    advice = w._idle_limit(1, 2000)
    assert advice.limit == 0 and advice.wake_share in LOOKUP_WAKE_SHARES
    assert advice.lookup is None


def test_an_idle_hands_the_proposer_its_lookup_drafts_lines_and_rates(tiny_target):
    """IdleAdvice.lookup (_idle_lookup_advice): the fast backup's rates by match length
    and plain decoding's line on the lent cores (not SD on the lent cores' verification
    line, measured after the draft's turn); none with fallback 'neural', with
    controller.idle_lookup off, or for a probe. The wake share then has the proposer's
    own lookup drafts as its bar: a higher share, or none."""
    from vllm_saguaro.core.controller import StepCost
    from vllm_saguaro.core.fanout import SplitAcceptanceFit
    from vllm_saguaro.draft.regime import LOOKUP_WAKE_SHARES, IdleAdvice

    w = lent_worker(tiny_target, regime="auto")
    w.cfg.fallback = "auto"
    for _ in range(60):
        w.fast_acceptance.observe(3, 3, 3)
    lookup = w._idle_lookup_advice()
    assert lookup.rates == tuple(w.fast_acceptance.rate(n, greedy=True) for n in range(4))
    assert lookup.sampled_rates == tuple(w.fast_acceptance.rate(n, greedy=False) for n in range(4))
    assert lookup.rates[3] > 0.8
    assert lookup.plain == pytest.approx(w.lent_cost.line())
    w.lent_sd_cost = StepCost()
    for width in (2, 4):
        w.lent_sd_cost.observe(width, 0.05 + 0.002 * width)
    assert w._idle_lookup_advice().plain == pytest.approx(w.lent_cost.line())
    advice = w._watching(IdleAdvice(0, probe=False), 1, w._plain_s())
    assert advice.lookup == w._idle_lookup_advice()
    # where only lookup drafts pay (the neural draft of no use), the draft woken would
    # add nothing to the proposer's own: no share wakes it (as in the wake share's test)
    w.acceptance = SplitAcceptanceFit(0.05, prior_weight=1e6)
    w.lent_cost, w.lent_sd_cost = StepCost(), StepCost()
    for _ in range(4):
        for width, seconds in [(1, 0.03), (4, 0.06)]:
            w.lent_cost.observe(width, seconds)
    for _ in range(60):
        w.fast_acceptance.observe(3, 2, 3)
        w.fast_acceptance.observe(0, 0, 1)
    assert w._lookup_wake_share(1, w._plain_s()) in LOOKUP_WAKE_SHARES
    assert w._watching(IdleAdvice(0, probe=False), 1, w._plain_s()).wake_share is None
    w.cfg.controller.idle_lookup = False
    assert w._idle_lookup_advice() is None
    w.cfg.controller.idle_lookup, w.cfg.fallback = True, "neural"
    assert w._idle_lookup_advice() is None
    w.cfg.fallback = "auto"
    w._probed, w.lent_widths = {}, set()  # never measured at batch 1: a probe, plain
    assert w._idle_limit(1).lookup is not None  # (the idle's own lookup drafts beat it)
    w.cfg.controller.idle_lookup = False
    assert w._idle_limit(1) == IdleAdvice(0, probe=True)


def test_speculation_must_beat_the_idles_own_lookup_drafts(tiny_target):
    """The idle's bar (_idle_bar, batch_limit's idle_rate): where the text continues
    3-token matches whose tokens are accepted, the proposer's own lookup drafts give more
    than plain decoding, and speculation that beats plain decoding but not them idles;
    with controller.idle_lookup off, or text without matches, plain decoding is the bar."""
    w = lent_worker(tiny_target, regime="auto")
    w.cfg.fallback = "auto"
    plain = 1 / w.lent_cost.predict(1)
    w._expected_rate = lambda b, shares=None: 1.2 * plain
    w._lent_sd_rate = lambda b, now, measured=True, shares=None: 1.2 * plain
    for _ in range(60):
        w.fast_acceptance.observe(3, 3, 3)
    w.fast_acceptance.seen_in([0] * 10)  # no match in the batch's text
    assert w._idle_bar(1, w._plain_s()) == pytest.approx(plain)
    assert w._idle_limit(1) is None
    w.fast_acceptance.seen_in([3] * 10)  # every position continues a 3-token match
    bar = w._idle_bar(1, w._plain_s())
    assert bar > 1.2 * plain
    advice = w._idle_limit(1)
    assert advice is not None and advice.limit == 0 and advice.lookup is not None
    w.cfg.controller.idle_lookup = False
    assert w._idle_bar(1, w._plain_s()) == pytest.approx(plain)
    assert w._idle_limit(1) is None


def test_the_catch_up_counts_the_tokens_beyond_the_kv_the_draft_holds(tiny_target):
    w = worker(tiny_target)
    prompt = [5, 17, 99, 3]
    step(w, [("a", None, prompt, None)], [])  # the prompt's KV is in the pool now, and
    assert w.seqs["a"].kv_tokens[:4] == prompt  # that of the tokens drafted after it
    # the draft's own tokens past the prompt are not the ones verified (7 8 9): 3 to
    # prefill for "a", 5 for the new "b", none for "c", which continues
    full = prompt + [7, 8, 9]
    assert w.seqs["a"].kv_tokens[4:5] != [7]
    assert w._catch_up_tokens([("a", None, full, None), ("b", None, [1, 2, 3, 4, 5], None),
                               ("c", [4], None, None)]) == 3 + 5


def measured_lent(w, widths):
    """Plain decoding on the lent cores measured just now at these widths."""
    w.lent_widths |= widths


def lent_worker(tiny_target, **controller):
    """A worker whose target verifies on every core (lent) twice as fast as on its own
    core, with a cheap draft step: SD on the lent cores beats SSD and plain decoding."""
    w = worker(tiny_target, controller={"policy": "auto", **controller})
    for _ in range(4):
        for width, own, lent in [(1, 0.06, 0.03), (2, 0.0605, 0.0301), (4, 0.061, 0.0302)]:
            w.target_cost.observe(width, own)
            w.lent_cost.observe(width, lent)
    measured_lent(w, {1, 2, 4})
    # the draft's step as a line of its own: the one measured at start times the tiny
    # model on a machine that may be busy (CI), which once idled a test's lent_sd step
    w.draft_cost = StepCost()
    for rows in (1, 4):
        w.draft_cost.observe(rows, 0.002)
    # SSD explored at these batch sizes just now (regime.py SSD_EXPLORE_ROUNDS): the
    # regime's choice is the models' (test_ssd_is_explored_... tests the exploration)
    w._ssd_explored = {b: time.perf_counter() for b in (1, 2, 4)}
    return w


@pytest.mark.parametrize("regime", ["auto", "lent_sd", "ssd"])
def test_sd_on_the_lent_cores_where_it_beats_ssd(tiny_target, hf, regime):
    """controller.regime: where the lent cores verify twice as fast and the draft's step
    is cheap, a continuing batch runs as SD on the lent cores (auto, or pinned): the
    fallback drafts on the critical path without a lookup, from plain q (C = 1), and the
    step says so; the round with a new sequence is SSD's, so that its prompt goes
    through the pre-speculation's glue pass. Pinned to ssd, nothing changes."""
    w = lent_worker(tiny_target, regime=regime)
    w.saguaro_c = w.cfg.saguaro_c = 0.5
    p = [5, 17, 99, 3, 250, 7]
    results, _, _, idle, lent_sd = w.step([("a", None, p, None)], [], ())
    assert idle is None and not lent_sd and results[0][0] == []  # new: nothing sent
    w.prespeculate()
    assert len(w.seqs["a"].kv_tokens) >= len(p)  # the prompt is in the draft's KV
    bonus = hf_greedy(hf, p, 1)
    results, _, _, idle, lent_sd = w.step([("a", bonus, None, None)], [], ())
    (spec, flag, _), = results
    assert idle is None and spec == hf_greedy(hf, p + bonus, len(spec)) and spec
    if regime == "ssd":
        assert not lent_sd and flag is not None and w.stats.lent_sd_steps == 0
        assert w.saguaro_c == 0.5
    else:
        assert lent_sd and flag is None and w.stats.lent_sd_steps == 1
        assert w.saguaro_c == 1.0 and w.stats.fallback_rounds == 1


def test_sd_on_the_lent_cores_is_taken_up_only_with_a_margin(tiny_target):
    """lent_sd_worth: from a step that was not SD on the lent cores, it must be expected
    LENT_SD_ENTRY_MARGIN faster than SSD (the regime's choice) and than plain decoding
    on the lent cores (the idle decision); once running, merely faster."""
    from vllm_saguaro.core.controller import LENT_SD_ENTRY_MARGIN

    w = lent_worker(tiny_target, regime="auto")
    w.step([("a", None, [5, 17, 99, 3, 250, 7], None)], [], ())
    w.prespeculate()
    update = [("a", [1], None, None)]
    w._ssd_rate = lambda b, now: 30.0
    for gain, entering, continuing in [(LENT_SD_ENTRY_MARGIN / 2, False, True),
                                       (2 * LENT_SD_ENTRY_MARGIN, True, True)]:
        w._lent_sd_rate = lambda b, now, measured=True: 30.0 * (1 + gain)
        for steps, taken in [(0, entering), (3, continuing)]:
            w._lent_sd_steps = steps
            assert w._lent_sd_step(update) == taken
    # against plain decoding (SSD no option here): idle unless it pays by the margin
    w._ssd_rate = lambda b, now: 0.0
    plain = 1 / w._plain_s()(1)
    w._lent_sd_rate = lambda b, now, measured=True: plain * (1 + LENT_SD_ENTRY_MARGIN / 2)
    w._lent_sd_steps = 0
    assert w._idle_limit(1) is not None and w._idle_limit(1).limit == 0
    w._lent_sd_steps = 1
    assert w._idle_limit(1) is None


def test_a_new_requests_glue_round_does_not_end_sd_on_the_lent_cores(tiny_target, hf):
    """A new sequence makes its step SSD's (the glue pass of its prompt); where SD on the
    lent cores ran before it, the step after still counts it as going on
    (_lent_sd_continues: no entry margin), so that a rate within the margin of plain
    decoding keeps it rather than idling. Not where SSD ran before the new sequence."""
    from vllm_saguaro.core.controller import LENT_SD_ENTRY_MARGIN

    w = lent_worker(tiny_target, regime="auto")
    p, q = [5, 17, 99, 3, 250, 7], [9, 8, 7, 6, 5, 4]
    w.step([("a", None, p, None)], [], ())
    w.prespeculate()
    _, _, _, idle, lent_sd = w.step([("a", hf_greedy(hf, p, 1), None, None)], [], ())
    assert idle is None and lent_sd and w._lent_sd_continues()
    # request a ends, b comes: its glue round is SSD's, and SD on the lent cores goes on
    _, _, _, idle, lent_sd = w.step([("b", None, q, None)], ["a"], ())
    assert idle is None and not lent_sd and w._lent_sd_steps == 0
    assert w._glue_detour and w._lent_sd_continues()
    w.prespeculate()
    plain = 1 / w._plain_s()(1)
    w._ssd_rate = lambda b, now: 0.0
    w._lent_sd_rate = lambda b, now, measured=True: plain * (1 + LENT_SD_ENTRY_MARGIN / 2)
    _, _, _, idle, lent_sd = w.step([("b", hf_greedy(hf, q, 1), None, None)], [], ())
    assert idle is None and lent_sd and not w._glue_detour
    # SSD ran before the new sequence: its glue round continues nothing
    w._lent_sd_rate = lambda b, now, measured=True: 0.0
    w._ssd_rate = lambda b, now: 10 * plain
    w._lent_sd_steps = 0
    w.prespeculate()
    w.step([("c", None, p, None)], ["b"], ())
    assert not w._glue_detour and not w._lent_sd_continues()


def test_explorations_of_ssd_that_lose_back_off(tiny_target):
    """An exploration of SSD after which SSD is not chosen doubles the wait before the
    next at that batch size (SSD_EXPLORE_BACKOFF_MAX doublings at most); one after
    which SSD runs, or text that moved the match share, ends the backoff."""
    from vllm_saguaro.draft.regime import SSD_EXPLORE_BACKOFF_MAX, SSD_EXPLORE_S

    w = lent_worker(tiny_target, regime="auto")
    w._ssd_explored = {}
    now = time.perf_counter()
    for lost in range(SSD_EXPLORE_BACKOFF_MAX + 2):
        assert w._ssd_lost.get(1, 0) == lost
        wait = SSD_EXPLORE_S * 2 ** min(lost, SSD_EXPLORE_BACKOFF_MAX)
        w._ssd_explored[1] = now - wait + 1.0
        assert not w._ssd_unmeasured(1, now)
        w._ssd_explored[1] = now - wait - 1.0
        assert w._ssd_unmeasured(1, now)
        w._lent_sd, w._limit = True, None  # the step after it: SD on the lent cores
        w._after_ssd_exploration(1)
    w._after_ssd_exploration(2)  # another batch size counts apart
    assert w._ssd_lost == {1: SSD_EXPLORE_BACKOFF_MAX + 2, 2: 1}
    w._lent_sd = False  # SSD chosen after an exploration: no backoff there
    w._after_ssd_exploration(1)
    assert w._ssd_lost == {2: 1}
    # text whose share of 3-token matches moved: what was measured, and lost, is gone
    w.cfg.fallback = "auto"
    matching = [1, 2, 3, 4] * 20
    w._see_text([("t", None, matching, None)])
    assert w.stats.text_changes == 1 and w._ssd_lost == {}  # (TEXT_CHANGE_SHARE)


def test_a_close_idle_is_rechecked_soon_and_then_tried_again(tiny_target):
    """Where SD on the lent cores' model is within CLOSE_SHARE of plain decoding and it
    has paid before, the idle advice asks for a recheck after CLOSE_RECHECK_S, and where
    it ever paid, also on new text; the step after it tries SD on the lent cores for
    rounds_needed steps at that batch size (its old measurement forgotten) even though the
    model is below plain decoding, then decides as before. Far below, the proposer's
    default recheck."""
    from vllm_saguaro.draft.regime import CLOSE_RECHECK_S, CLOSE_SHARE, IdleAdvice

    w = lent_worker(tiny_target, regime="auto")
    w.step([("a", None, [5, 17, 99, 3, 250, 7], None)], [], ())
    w.prespeculate()
    plain = 1 / w._plain_s()(1)
    w._ssd_rate = lambda b, now: 0.0
    model = plain * (1 - CLOSE_SHARE / 2)
    w._lent_sd_rate = lambda b, now, measured=True: model
    assert w._idle_limit(1) == IdleAdvice(0, False, None, False)  # it never paid at batch 1
    w.lent_sd_ever_paid.add(1)  # paid once, no longer
    assert w._idle_limit(1) == IdleAdvice(0, False, None, True)
    w.lent_sd_paid.add(1)
    assert w._idle_limit(1) == IdleAdvice(0, False, CLOSE_RECHECK_S, True)
    model = plain * (1 - 2 * CLOSE_SHARE)
    assert w._idle_limit(1) == IdleAdvice(0, False, None, False)
    model = plain * (1 - CLOSE_SHARE / 2)
    one = [("a", [1], None, None)]
    for explores, advice in [(1, IdleAdvice(0, False, CLOSE_RECHECK_S)),
                             (2, IdleAdvice(0, False, None, True))]:
        w._limit = advice
        for _ in range(w.lent_sd_realized.rounds_needed(1)):
            w.lent_sd_realized.observe(1, 1, 1.0, time.perf_counter())  # what it gave, then
        w._wake(1)
        w._limit = None
        assert w.lent_sd_realized.rounds(1) == 0 and w.stats.lent_sd_explores == explores
        for _ in range(w.lent_sd_realized.rounds_needed(1)):  # the waking step and those after
            assert w._idle_limit(1) is None and w._lent_sd_step(one)
            w._wake(1)
        assert w._idle_limit(1) is not None  # tried: the model decides again
    w._explore = 5
    w._wake(2)
    assert w._explore == 0  # another batch size: not tried there


def test_a_try_that_did_not_pay_backs_off_the_next(tiny_target):
    """A close idle after a try of SD on the lent cores (_wake) that did not pay: no wake
    on new text, a recheck after LENT_TRY_BACKOFF_S, doubled for the next such try; a
    try that pays (lent_sd_paid) ends the backoff."""
    from vllm_saguaro.draft.regime import CLOSE_RECHECK_S, CLOSE_SHARE, LENT_TRY_BACKOFF_S

    w = lent_worker(tiny_target, regime="auto")
    w.step([("a", None, [5, 17, 99, 3, 250, 7], None)], [], ())
    w.prespeculate()
    plain = 1 / w._plain_s()(1)
    w._ssd_rate = lambda b, now: 0.0
    w._lent_sd_rate = lambda b, now, measured=True: plain * (1 - CLOSE_SHARE / 2)
    w.lent_sd_ever_paid.add(1)
    advice = w._idle_limit(1)
    assert advice.new_text and advice.recheck_s is None
    for backoff in (LENT_TRY_BACKOFF_S, 2 * LENT_TRY_BACKOFF_S):
        w._limit = advice
        w._wake(1)  # the try
        w._limit, w._explore = None, 0  # its rounds, which gave too little
        advice = w._idle_limit(1)
        assert advice.limit == 0 and not advice.new_text and advice.recheck_s == backoff
    # a try that pays: the backoff ends
    w._limit = advice
    w._wake(1)
    w._limit, w._explore = None, 0
    now = time.perf_counter()
    for _ in range(w.lent_sd_realized.rounds_needed(1)):
        w.lent_sd_realized.observe(1, 2, 1.0 / plain, now)  # twice plain decoding's rate
    w._last_call = (now - 1.0 / plain, 1, True)
    w._observe_round([("a", [1, 2], None, None)], now)
    assert 1 in w.lent_sd_paid
    assert w._idle_limit(1).recheck_s == CLOSE_RECHECK_S and w._idle_limit(1).new_text


def ssd_alone_worker(tiny_target):
    """A lent worker past its first round, SSD the only way to speculate (SD on the lent
    cores no option), never explored; SSD's model and rate at `model.share` of plain
    decoding's rate. Returns the worker, plain decoding's rate and `model`."""
    w = lent_worker(tiny_target, regime="auto")
    w.step([("a", None, [5, 17, 99, 3, 250, 7], None)], [], ())
    w.prespeculate()
    w._ssd_explored = {}
    plain = 1 / w._plain_s()(1)
    model = SimpleNamespace(share=1.0)
    w._lent_sd_rate = lambda b, now, measured=True: None
    w._expected_rate = lambda b: plain * model.share
    w._ssd_rate = lambda b, now: plain * model.share
    return w, plain, model


def test_an_idle_tries_ssd_where_it_was_not_measured_lately(tiny_target):
    """An idle at a batch size where SSD was neither measured nor explored for
    SSD_EXPLORE_S, its model within SSD_TRY_SHARE of plain decoding: the recheck comes
    after CLOSE_RECHECK_S, and its step starts an exploration of SSD
    (SSD_EXPLORE_ROUNDS). Not where the model is further below, nor within SSD_EXPLORE_S
    of an exploration, nor while what SSD gave is known."""
    from vllm_saguaro.draft.regime import (CLOSE_RECHECK_S, SSD_EXPLORE_ROUNDS, SSD_EXPLORE_S,
                                           SSD_TRY_SHARE, IdleAdvice)

    w, plain, model = ssd_alone_worker(tiny_target)
    model.share = 1 - 2 * SSD_TRY_SHARE
    assert w._idle_limit(1) == IdleAdvice(0, False)  # far below: the default recheck
    model.share = 1 - SSD_TRY_SHARE / 2
    w._limit = w._idle_limit(1)
    assert w._limit == IdleAdvice(0, False, CLOSE_RECHECK_S)
    w._wake(1)
    assert w.stats.ssd_explores == 1 and w._ssd_exploration_goes_on(1)
    assert w._ssd_explore == SSD_EXPLORE_ROUNDS - 1
    w._ssd_explore = 0
    assert w._idle_limit(1) == IdleAdvice(0, False)  # explored just now: no second try
    w._ssd_explored[1] -= SSD_EXPLORE_S + 1
    assert w._idle_limit(1) == IdleAdvice(0, False, CLOSE_RECHECK_S)  # a minute on: again
    for _ in range(w.realized.min_rounds):
        w.realized.observe(1, 1, 1.0 / (model.share * plain), time.perf_counter())
    assert w._idle_limit(1) == IdleAdvice(0, False)  # what SSD gave is known: no try
    w.realized.forget(1)
    w._limit = w._idle_limit(1)  # a try again, but woken at another batch size: neither
    w._wake(2)  # SSD's try nor SD on the lent cores' (whose recheck it is not)
    assert w._explore == 0 and w.stats.lent_sd_explores == 0 and w.stats.ssd_explores == 1


def test_an_idle_tries_ssd_again_only_once_its_model_rose(tiny_target):
    """A try of SSD from an idle after which SSD was not chosen holds the next try at
    that batch size until SSD's model, against what the idle gives, has risen by
    SSD_RETRY_RISE, text that changed notwithstanding, for SSD_RETRY_S; a try after
    which SSD runs holds nothing, nor does an exploration from SD on the lent cores."""
    from vllm_saguaro.draft.regime import (CLOSE_RECHECK_S, SSD_EXPLORE_S, SSD_RETRY_RISE,
                                           SSD_RETRY_S, SSD_TRY_SHARE, IdleAdvice)

    w, _, model = ssd_alone_worker(tiny_target)
    model.share = 1 - 0.9 * SSD_TRY_SHARE
    tried = IdleAdvice(0, False, CLOSE_RECHECK_S)

    def explore(then: IdleAdvice | None, advice=tried):
        """The idle (a try where `advice` says so), its wake, the exploration, and the
        step after it: idle (`then`) or SSD (None); the next exploration's wait over."""
        w._limit = w._idle_limit(1)
        assert w._limit == advice
        w._wake(1)
        w._ssd_explore, w._limit, w._lent_sd = 0, then, False
        w._after_ssd_exploration(1)
        w._ssd_explored[1] -= 10 * SSD_EXPLORE_S  # past the explorations' backoff

    explore(then=IdleAdvice(0, False))  # tried, and lost
    assert w._ssd_try_lost[1][0] == pytest.approx(model.share, rel=1e-6)
    assert w._idle_limit(1) == IdleAdvice(0, False) and w.stats.ssd_retries_held == 1
    w.cfg.fallback = "auto"  # text whose share of 3-token matches moved
    w._see_text([("t", None, [1, 2, 3, 4] * 20, None)])
    w.cfg.fallback = "neural"
    assert w.stats.text_changes == 1 and w._ssd_lost == {} and 1 in w._ssd_try_lost
    assert w._idle_limit(1) == IdleAdvice(0, False)  # the same model: held still
    model.share *= 1 + SSD_RETRY_RISE / 2
    assert w._idle_limit(1) == IdleAdvice(0, False)  # risen, not by enough
    assert w.stats.ssd_retries_held == 3
    model.share *= 1 + SSD_RETRY_RISE
    explore(then=None)  # risen enough: tried, and SSD runs after it
    assert w._ssd_try_lost == {} and w.stats.ssd_explores == 2
    explore(then=IdleAdvice(0, False))  # lost again, at this model
    lost_at = w._ssd_try_lost[1][1]
    w._ssd_try_lost[1] = (w._ssd_try_lost[1][0], lost_at - SSD_RETRY_S - 1)
    explore(then=IdleAdvice(0, False))  # kept SSD_RETRY_S only: tried again
    assert w.stats.ssd_explores == 4
    # an exploration from SD on the lent cores (_ssd_explore_due) that loses holds nothing
    w._ssd_try_lost.clear()
    w._start_ssd_exploration(1, 0)
    w._limit = IdleAdvice(0, False)
    w._after_ssd_exploration(1)
    assert w._ssd_try_lost == {} and w._ssd_lost[1] >= 1


def test_speculation_against_plain_decoding_weighs_what_both_regimes_gave(tiny_target):
    """Where both SSD and SD on the lent cores were measured at this batch size lately,
    the idle decision weighs what they gave, as the choice between them does
    (_weighed_rates): SSD's model above plain decoding does not hold speculation on
    where both gave less."""
    w = lent_worker(tiny_target, regime="auto")
    w.step([("a", None, [5, 17, 99, 3, 250, 7], None)], [], ())
    w.prespeculate()
    known, w.cfg.fallback = w.target_cost, "auto"  # (auto: a miss may cost no draft step)
    w.target_cost = StepCost()  # the target's step not measured yet: SSD measures it
    assert not w._lent_sd_step([("a", [1], None, None)])  # (no model: it would divide by 0)
    w.target_cost, w.cfg.fallback = known, "neural"
    plain = 1 / w._plain_s()(1)
    w._ssd_rate = lambda b, now: 1.2 * plain  # the models: both ahead of plain decoding
    w._lent_sd_rate = lambda b, now, measured=True: 1.02 * plain
    w._lent_sd_steps = 1  # running
    now = time.perf_counter()
    for _ in range(w.realized.min_rounds):
        w.realized.observe(1, 1, 1.0 / (0.8 * plain), now)  # SSD gave 0.8x plain decoding
    assert w._idle_limit(1) is None  # SD on the lent cores not measured: the models
    for _ in range(w.lent_sd_realized.rounds_needed(1)):
        w.lent_sd_realized.observe(1, 1, 1.0 / (0.95 * plain), now)  # and it 0.95x
    advice = w._idle_limit(1)
    assert advice is not None and advice.limit == 0


def test_the_fallback_drafts_on_while_its_tokens_are_likely(tiny_target, hf):
    """_draft_now drafts its planned steps, then more while `more` says so (up to K), the
    same greedy tokens as the planned ones; _draft_more says so where the last token's
    calibrated confidence makes the next one pay (core/controller.py draft_more_pays),
    not where it is unlikely, and never under a pinned K."""
    from vllm_saguaro.core.cache import Speculation
    from vllm_saguaro.core.controller import Candidate
    from vllm_saguaro.core.sampling import SamplingSpec

    w = lent_worker(tiny_target, regime="ssd")
    p = [5, 17, 99, 3, 250, 7]
    w._sync("a", p, SamplingSpec())
    asked = []
    drafts = w._draft_now(["a"], 1, lambda d: asked.append(len(d[0].tokens)) or True)
    assert drafts[0].tokens == hf_greedy(hf, p, w.K) and asked == [1, 2]
    assert len(drafts[0].confidence) == w.K
    assert w._draft_now(["a"], 1, lambda d: False)[0].tokens == hf_greedy(hf, p, 1)
    cands = [Candidate(neural=(0.5,) * w.K, cap=w.K)]
    w._greedy_rows = [True]  # (step()'s _see_sampling sets it)
    one = [Speculation([7], None, [0.97])]
    for rate, expected in [(0.1, False), (0.97, True)]:
        w.calibration.rate = lambda c, r=rate: r
        more = w._draft_more(cands, [0], {}, {}, time.perf_counter())
        assert more(one) is expected
    assert more([Speculation([7, 8, 9], None, [0.97] * 3)]) is False  # at the cap
    w.cfg.controller.policy = "fixed"  # K pinned
    assert w._draft_more(cands, [0], {}, {}, time.perf_counter()) is None


def test_ssd_measured_ahead_of_plain_decoding_is_not_cut_by_the_plan(tiny_target):
    """_ssd_measured_ahead: SSD measured (its rounds' bounds) surely above plain decoding
    on the lent cores: the plan's model, which put it behind, no longer cuts its
    lengths to plain decoding (_beats_lent_plain, _prespeculation_pays)."""
    w = lent_worker(tiny_target, regime="ssd")
    plain = 1 / w._plain_s()(1)
    plan = type("P", (), {"lengths": [1], "tokens": 1.0, "seconds": 1.0, "rate": 1.0})
    now = time.perf_counter()
    assert not w._ssd_measured_ahead(1, w._plain_s())  # nothing measured
    assert not w._beats_lent_plain(plan, 1)  # the model's plan: 1 token/s
    for _ in range(w.realized.min_rounds):
        w.realized.observe(1, 1, 1.05 / plain, now)  # just below plain decoding
    assert not w._ssd_measured_ahead(1, w._plain_s())
    w.realized.forget(1)
    for _ in range(w.realized.min_rounds):
        w.realized.observe(1, 2, 1.0 / plain, now)  # twice plain decoding's rate
    assert w._ssd_measured_ahead(1, w._plain_s())
    assert w._beats_lent_plain(plan, 1) and w._prespeculation_pays(1)


def test_ssd_where_the_lent_cores_verify_no_faster(tiny_target, hf):
    """auto: the same, but the lent cores verify no faster than the target's own core,
    so SD on them has nothing over SSD (whose draft works beside the verification)."""
    w = lent_worker(tiny_target, regime="auto")
    w.lent_cost = type(w.target_cost)()
    for _ in range(4):
        for width, lent in [(1, 0.06), (2, 0.0605), (4, 0.061)]:
            w.lent_cost.observe(width, lent)
    w.hit_rate = 0.9
    p = [5, 17, 99, 3, 250, 7]
    w.step([("a", None, p, None)], [], ())
    w.prespeculate()
    results, _, _, _, lent_sd = w.step([("a", hf_greedy(hf, p, 1), None, None)], [], ())
    assert not lent_sd and results[0][1] is not None  # looked up in the cache


@pytest.mark.parametrize("regime", ["auto", "ssd"])
def test_a_skipped_prespeculation_still_prefills_a_new_prompt(tiny_target, regime):
    """Where speculation may run as SD on the lent cores, a pre-speculation skipped
    because no cached token would be sent still runs the glue pass for a new sequence,
    so its prompt's prefill is not on SD's critical path later; with regime ssd it is
    skipped whole, as before."""
    w = lent_worker(tiny_target, regime=regime)
    w._prespeculation_pays = lambda batch: False
    p = [5, 17, 99, 3, 250, 7]
    w.step([("a", None, p, None)], [], ())
    kv_before = len(w.seqs["a"].kv_tokens)
    w.prespeculate()
    assert w.stats.prespec_skipped == 1 and w.seqs["a"].cache is None
    if regime == "auto":
        assert w.stats.catch_up_glues == 1 and len(w.seqs["a"].kv_tokens) >= len(p)
    else:
        assert w.stats.catch_up_glues == 0 and len(w.seqs["a"].kv_tokens) == kv_before < len(p)


def test_the_team_borrows_the_target_cores_only_in_lent_sd_steps(tiny_target, hf, monkeypatch):
    """DraftTeam.use: with a core to borrow, the thread computing a lent_sd step asks for
    a team of its own core and the borrowed one, an SSD step and a pre-speculation for its
    own only (the target verifies meanwhile), each time put back on the draft's core;
    without one the team is left alone. The draft's step on the larger team goes to a
    cost line of its own."""
    from vllm_saguaro.draft.team import DraftTeam

    teams, bound = [], []
    monkeypatch.setattr(torch._C, "set_num_threads", teams.append)
    monkeypatch.setattr(os, "sched_setaffinity", lambda tid, cores: bound.append(set(cores)))
    w = lent_worker(tiny_target, regime="auto")
    p = [5, 17, 99, 3, 250, 7]
    w.step([("a", None, p, None)], [], ())
    w.prespeculate()
    assert teams == [] and bound == []  # nothing to borrow: no change
    w.team = DraftTeam([3], [7])
    w.team.bind_added = lambda: bound.append("added")  # (test_process_actor binds real threads)
    w.step([("b", None, p, None)], ["a"], ())  # a new sequence: SSD's step
    w.prespeculate()
    assert teams == [1, 1] and bound == [{3}, {3}]
    bonus = hf_greedy(hf, p, 1)
    results, _, _, _, lent_sd = w.step([("b", bonus, None, None)], [], ())
    assert lent_sd and teams[-1] == 2 and results[0][0]
    assert bound[2:] == [{3}, "added"]
    assert not w.borrowed_draft_cost.known  # the run's first step: not measured
    spec = results[0][0]
    w.step([("b", spec + hf_greedy(hf, p + bonus + spec, 1), None, None)], [], ())
    assert w.borrowed_draft_cost.known
    assert DraftTeam([0, 1], [2]).borrow == []  # the draft on two cores: no borrowing


def test_verifications_on_the_lent_cores_have_a_line_of_their_own(tiny_target, hf):
    """A target step with draft tokens on the lent cores (the proposer's fourth field)
    fits the lent_sd line, not plain decoding's on the same cores, which SD on the lent
    cores is weighed against; without the field a lent step is plain decoding's."""
    w = lent_worker(tiny_target, regime="auto")
    before = w.lent_cost.predict(1)
    p = [5, 17, 99, 3, 250, 7]
    w.step([("a", None, p, None)], [], [(2, 0.09, True, True), (4, 0.1, True, True)])
    assert w.lent_sd_cost.predict(2) == pytest.approx(0.09, rel=0.05)
    assert w.lent_cost.predict(1) == pytest.approx(before)
    w.step([("a", hf_greedy(hf, p, 1), None, None)], [], [(1, 0.5, True)])
    assert w.lent_cost.predict(1) > before


def test_sending_nothing_in_a_lent_sd_step_costs_a_plain_step(tiny_target, hf):
    """In a lent_sd step the plan weighs sending nothing at plain decoding's line on the
    lent cores (that step is vLLM's plain one), not at the lent_sd line's width-1 end:
    here that line, fitted on widths 2 and 4, puts width 1 below plain decoding, and
    with it a token accepted 3 times in 10 did not pay, so the draft was called for a
    plain step. With plain decoding's cost it does (1.3 tokens in 33 ms against 1 in
    30), as the regime's choice (sd_rate against plain decoding) assumed."""
    from vllm_saguaro.core.fanout import SplitAcceptanceFit

    w = lent_worker(tiny_target, regime="lent_sd")
    for _ in range(4):
        w.lent_sd_cost.observe(2, 0.031)
        w.lent_sd_cost.observe(4, 0.045)
    assert w.lent_sd_cost.predict(1) < w.lent_cost.predict(1)
    w.acceptance = SplitAcceptanceFit(0.3, prior_weight=1e9)
    w.calibration.rate = lambda c: 0.3
    p = [5, 17, 99, 3, 250, 7]
    w.step([("a", None, p, None)], [], ())
    w.prespeculate()
    bonus = hf_greedy(hf, p, 1)
    results, _, _, idle, lent_sd = w.step([("a", bonus, None, None)], [], ())
    assert idle is None and lent_sd
    spec = results[0][0]  # (more than one where the fallback drafts on: timing)
    assert spec and spec == hf_greedy(hf, p + bonus, len(spec)) and w.stats.fallback_rounds == 1


def test_the_fast_backup_is_measured_where_it_does_not_draft(tiny_target, hf):
    """SeqState.shadow_fast: rows that did not send the fast backup's draft (SD on the lent
    cores, neural misses, hits) still have it made, and their outcome judges it as far
    as it shows the target's tokens: a mismatch inside them is a rejection, a match up to
    the bonus a run of acceptances with nothing rejected (AcceptanceFit). Measured on
    HumanEval at batch 1: SD on the lent cores never drafted with the fast backup, its
    acceptance stayed at the 0.2 prior, and SSD's model (which serves misses with it) ran
    19-23 tok/s where SSD pinned ran 29-36 with that acceptance measured at 0.65-0.69.
    Not with `fallback: neural` (no fast backup to measure)."""
    from vllm_saguaro.core.fallback import FastDraft, ngram_match
    from vllm_saguaro.draft.state import SeqState

    w = lent_worker(tiny_target, regime="lent_sd")
    w.cfg.fallback = "auto"
    st = SeqState(tokens=[1, 2, 3])
    for shadow, n, sampled, accepted, rejected in [([4, 5, 6], 2, [4, 5, 9], 2, 1),
                                                   ([4, 5, 6], 2, [4, 5], 2, 0),
                                                   ([7, 8, 9], 0, [4], 0, 1),
                                                   ([4], 3, [4, 5, 6], 1, 0)]:
        fit = w.fast_acceptance.fits[True][n]  # the fit of its match length (greedy)
        a0, r0 = fit.accepted, fit.rejected
        st.shadow_fast, st.spec = FastDraft(shadow, n, 3), []
        w._observe_outcome(st, sampled)
        assert (fit.accepted - a0 * fit.decay, fit.rejected - r0 * fit.decay) == pytest.approx(
            (accepted, rejected)) and st.shadow_fast is None
    assert w.stats.fast_shadowed == 4
    p = [5, 17, 99, 3, 250, 7, 5, 17]
    w.step([("a", None, p, None)], [], ())
    w.prespeculate()
    bonus = hf_greedy(hf, p, 1)
    (spec, _, _), = w.step([("a", bonus, None, None)], [], ())[0]
    assert spec and w.seqs["a"].shadow_fast == ngram_match(p + bonus, w.K)
    w.step([("a", spec + hf_greedy(hf, p + bonus + spec, 1), None, None)], [], ())
    assert w.stats.fast_shadowed == 6
    w.cfg.fallback = "neural"
    w.step([("b", None, p, None)], ["a"], ())
    assert w.seqs["b"].shadow_fast is None


def test_the_first_lent_sd_step_of_a_run_is_not_measured(tiny_target, hf):
    """The first lent_sd step after a switch runs cold (the borrowed team's first turn,
    the verification's first widths on the lent cores): neither its verification (in the
    next call's target steps) nor its draft step feeds the lines; the second's do. One
    such measurement once put SD on the lent cores below plain decoding for good."""
    w = lent_worker(tiny_target, regime="lent_sd")
    p = [5, 17, 99, 3, 250, 7]
    w.step([("a", None, p, None)], [], ())  # new: SSD's step
    w.prespeculate()
    bonus = hf_greedy(hf, p, 1)
    draft_s0 = w.draft_cost.s0
    (spec, _, _), = w.step([("a", bonus, None, None)], [], ())[0]  # the run's first
    assert spec and w._lent_sd_steps == 1 and w.draft_cost.s0 == draft_s0
    out = p + bonus + spec
    (spec, _, _), = w.step([("a", spec + hf_greedy(hf, out, 1), None, None)], [],
                           [(1 + len(spec), 0.5, True, True)])[0]  # its verification: cold
    assert not w.lent_sd_cost.known and w.lent_sd_cost.s0 == 0.0
    assert w.draft_cost.s0 > draft_s0  # the second step's draft is measured
    w.step([("a", spec + hf_greedy(hf, out + hf_greedy(hf, out, 1) + spec, 1), None, None)],
           [], [(1 + len(spec), 0.09, True, True)])
    assert w.lent_sd_cost.s0 > 0.0


def test_the_step_beside_a_prompts_prefill_is_not_the_targets_cost(tiny_target, hf):
    """The target's step after a call with a new sequence runs beside that call's
    pre-speculation, whose glue pass prefills the prompt on the draft's cores: it does
    not feed the target's own line; the next steps on its own cores do. Under SD on the
    lent cores those steps were the only ones that line saw, and put it 50% high."""
    w = worker(tiny_target, controller={"policy": "auto", "regime": "ssd"})
    p = [5, 17, 99, 3, 250, 7]
    w.step([("a", None, p, None)], [], ())  # new: its prompt goes into the glue pass
    w.prespeculate()
    bonus = hf_greedy(hf, p, 1)
    (spec, _, _), = w.step([("a", bonus, None, None)], [], [(1, 0.5, False)])[0]
    assert not w.target_cost.known  # the step beside the prefill
    w.prespeculate()
    out = p + bonus
    w.step([("a", spec + hf_greedy(hf, out + spec, 1), None, None)], [],
           [(1 + len(spec), 0.04, False)])
    assert w.target_cost.known and w.target_cost.predict(1 + len(spec)) == pytest.approx(0.04)


def test_ssd_is_explored_where_sd_on_the_lent_cores_is_chosen(tiny_target, hf):
    """Where SD on the lent cores is chosen and SSD was not measured lately at that batch
    size, the step starts SSD_EXPLORE_ROUNDS steps of SSD instead (not idle, not SD on
    the lent cores, whatever the models say; pre-speculating, its plan not cut), once per
    SSD_EXPLORE_S; a change of batch size ends it. Not under a pinned regime."""
    from vllm_saguaro.draft.regime import SSD_EXPLORE_ROUNDS, SSD_EXPLORE_S, IdleAdvice

    w = lent_worker(tiny_target, regime="auto")
    w._ssd_explored = {}
    assert not w._ssd_explore_due(1)  # SD on the lent cores is measured first
    for _ in range(w.lent_sd_realized.rounds_needed(1)):  # (well ahead: chosen)
        w.lent_sd_realized.observe(1, 2, 0.01, time.perf_counter())
    p = [5, 17, 99, 3, 250, 7]
    w.step([("a", None, p, None)], [], ())
    w.prespeculate()
    out = p + hf_greedy(hf, p, 1)
    results, _, _, idle, lent_sd = w.step([("a", out[len(p):], None, None)], [], ())
    assert idle is None and not lent_sd and w.stats.ssd_explores == 1
    assert w._exploring_ssd and w._prespeculation_pays(1)
    w._idle_limit = lambda *a: IdleAdvice(0, probe=False)  # the models: idle, or lent_sd
    # (the rounds' times are the HF model's between the steps, not SSD's: on a loaded
    # machine they measured SSD surely below plain decoding, which cuts an exploration;
    # that cut is tested apart)
    w._ssd_measured_below = lambda b: False
    for _ in range(SSD_EXPLORE_ROUNDS - 1):
        w.prespeculate()
        spec = results[0][0]
        n = len(out)
        out += spec + hf_greedy(hf, out + spec, 1)
        results, _, _, idle, lent_sd = w.step([("a", out[n:], None, None)], [], ())
        assert idle is None and not lent_sd and results[0][0]
    del w._idle_limit, w._ssd_measured_below
    w.realized.forget(1)  # (the test's rounds are instant) the models decide
    results, _, _, idle, lent_sd = w.step(
        [("a", results[0][0] + hf_greedy(hf, out + results[0][0], 1), None, None)], [], ())
    assert lent_sd and w.stats.ssd_explores == 1  # explored: the models decide
    assert w._ssd_explore_ended and not w._exploring_ssd
    # SSD not chosen after it: the next waits twice as long (SSD_EXPLORE_BACKOFF_MAX)
    assert w._ssd_lost == {1: 1}
    w._ssd_explored[1] -= SSD_EXPLORE_S
    w.realized.forget(1)
    assert not w._ssd_explore_due(1)
    w._ssd_explored[1] -= SSD_EXPLORE_S
    assert w._ssd_explore_due(1) and w.stats.ssd_explores == 2
    assert [w._ssd_exploration_goes_on(1) for _ in range(2)] == [True, True]
    assert not w._ssd_exploration_goes_on(2) and not w._ssd_exploration_goes_on(1)
    w._ssd_explored[1] -= SSD_EXPLORE_S
    for _ in range(w.realized.min_rounds):  # SSD measured lately: no exploration
        w.realized.observe(1, 2, 0.05, time.perf_counter())
    assert not w._ssd_explore_due(1)
    w.realized.forget(1)
    pinned = lent_worker(tiny_target, regime="lent_sd")
    pinned._ssd_explored = {}
    assert not pinned._ssd_explore_due(1)


def test_an_exploration_of_ssd_ends_once_what_it_gave_is_surely_below(tiny_target):
    """An exploration of SSD (SSD_EXPLORE_ROUNDS) ends early once what SSD gave at its
    batch size is surely below what the idle gives there (RealizedRate.bounds against
    _idle_bar), or below what SD on the lent cores surely gave; while it is not known,
    or not surely below, it goes on."""
    w = lent_worker(tiny_target, regime="auto")
    w.step([("a", None, [5, 17, 99, 3, 250, 7], None)], [], ())
    w.prespeculate()
    w._ssd_explored = {}
    plain = w._idle_bar(1, w._plain_s())
    w._start_ssd_exploration(1, 40)
    assert w._ssd_exploration_goes_on(1)  # nothing measured yet
    now = time.perf_counter()
    for i in range(w.realized.rounds_needed(1)):  # gave ~1.2x the idle's: goes on
        w.realized.observe(1, 2, 2.0 / (plain * (1.2 + 0.02 * (i % 2))), now)
    assert w._ssd_exploration_goes_on(1) and w.stats.ssd_explores_cut == 0
    w.realized.forget(1)
    for i in range(w.realized.rounds_needed(1)):  # gave ~0.6x: surely below, it ends
        w.realized.observe(1, 2, 2.0 / (plain * (0.6 + 0.02 * (i % 2))), now)
    assert not w._ssd_exploration_goes_on(1) and w._ssd_explore == 0
    assert w.stats.ssd_explores_cut == 1
    assert not w._ssd_exploration_goes_on(1)  # ended: not counted twice
    assert w.stats.ssd_explores_cut == 1
    # above the idle's bar but surely below what SD on the lent cores gave: it ends too
    w.realized.forget(1)
    for i in range(w.realized.rounds_needed(1)):
        w.realized.observe(1, 2, 2.0 / (plain * (1.2 + 0.02 * (i % 2))), now)
    w._start_ssd_exploration(1, 40)
    assert w._ssd_exploration_goes_on(1)  # SD on the lent cores not measured
    for i in range(w.lent_sd_realized.rounds_needed(1)):
        w.lent_sd_realized.observe(1, 2, 2.0 / (plain * (1.6 + 0.02 * (i % 2))), now)
    assert not w._ssd_exploration_goes_on(1) and w.stats.ssd_explores_cut == 2
    w.lent_sd_realized.forget(1)  # SD on the lent cores gave as much: it goes on
    for i in range(w.lent_sd_realized.rounds_needed(1)):
        w.lent_sd_realized.observe(1, 2, 2.0 / (plain * (1.2 + 0.02 * (i % 2))), now)
    w._start_ssd_exploration(1, 40)
    assert w._ssd_exploration_goes_on(1) and w.stats.ssd_explores_cut == 2


def test_ssd_and_sd_on_the_lent_cores_both_measured_choose_by_what_they_gave(tiny_target):
    """Where both regimes were measured at this batch size lately (an exploration of
    SSD), the choice goes by what they gave, whatever the models say: SD on the lent
    cores taken up with its entry margin, and where it runs (or ran before the
    exploration) SSD taking over with its own (SSD_ENTRY_MARGIN)."""
    from vllm_saguaro.core.controller import LENT_SD_ENTRY_MARGIN, SSD_ENTRY_MARGIN

    w = lent_worker(tiny_target, regime="auto")
    w.step([("a", None, [5, 17, 99, 3, 250, 7], None)], [], ())
    w.prespeculate()
    update = [("a", [1], None, None)]
    w._ssd_rate = lambda b, now: 10.0
    w._lent_sd_rate = lambda b, now, measured=True: 50.0  # the models: SD on the lent cores
    assert w._lent_sd_step(update)
    now = time.perf_counter()
    for _ in range(w.lent_sd_realized.rounds_needed(1)):
        w.lent_sd_realized.observe(1, 2, 0.1, now)  # gave 20 tok/s
    assert 19.5 * (1 + LENT_SD_ENTRY_MARGIN) > 20.0 > 19.5  # entering, 20 counts as 19.05
    assert 20.0 * (1 + SSD_ENTRY_MARGIN) < 21.5  # running, SSD must give more than 21
    for ssd, steps, taken in [(21.5, 3, False), (20.5, 3, True), (19.5, 0, False),
                              (19.5, 3, True), (18.5, 0, True)]:
        w.realized.forget(1)
        for _ in range(w.realized.min_rounds):
            w.realized.observe(1, 1, 1.0 / ssd, now)
        w._lent_sd_steps = steps
        assert w._lent_sd_step(update) == taken, (ssd, steps)
        w._lent_sd_steps, w._ssd_explore_ended = 0, True  # the exploration's next step
        assert w._lent_sd_step(update) == (ssd < 20.0 * (1 + SSD_ENTRY_MARGIN)), ssd
        w._ssd_explore_ended = False


def test_plain_decoding_on_the_lent_cores_is_measured_while_the_draft_idles(tiny_target, hf):
    """A lent step without draft tokens after a lent_sd step (the plan sent nothing) does
    not feed plain decoding's line on the lent cores: it follows the draft's turn on the
    target's cores. After a step that was not lent_sd's (the draft idled) it does."""
    w = lent_worker(tiny_target, regime="lent_sd")
    before = w.lent_cost.predict(1)
    p = [5, 17, 99, 3, 250, 7]
    w.step([("a", None, p, None)], [], ())
    w.prespeculate()
    out = p + hf_greedy(hf, p, 1)
    results, _, _, _, lent_sd = w.step([("a", out[len(p):], None, None)], [], ())
    assert lent_sd
    spec = results[0][0]
    n = len(out)
    out += spec + hf_greedy(hf, out + spec, 1)
    w.step([("a", out[n:], None, None)], [], [(1, 0.5, True, False)])
    assert w.lent_cost.predict(1) == pytest.approx(before)
    w._lent_sd = False  # as after an idle step
    w.step([("a", None, out, None)], [], [(1, 0.5, True, False)])
    assert w.lent_cost.predict(1) > before


def test_the_fast_backup_serves_the_misses_whose_match_makes_it_worth_more(tiny_target):
    """MatchAcceptance: the fast backup's acceptance by the length of the match its draft
    continues. A miss that continues a 3-token match gets the lookup draft (free, and
    likely accepted on its fit), where a miss with no match gets the neural fallback, in
    SSD's rounds and in SD on the lent cores alike; and the models (_expected_rate,
    _lent_sd_rate) count the misses the fast backup would serve at their own acceptance. Before, one acceptance for every lookup draft (0.2-0.5, most drafts
    matching nothing) gave every miss the neural fallback, and SSD's model ran below what
    SSD gave on HumanEval (ssd_rate in core/theory.py; core/fallback.py's docstring)."""
    from vllm_saguaro.core.sampling import SamplingSpec

    w = lent_worker(tiny_target, regime="ssd")
    w.cfg.fallback = "auto"
    repeat, plain = [5, 17, 99, 3, 5, 17, 99], [5, 17, 99, 3, 250, 7]
    w._sync("a", repeat, SamplingSpec())
    w._sync("b", plain, SamplingSpec())
    neural_only = w._expected_rate(2)
    for _ in range(60):
        w.fast_acceptance.observe(3, 3, 3)   # long matches: accepted whole
        w.fast_acceptance.observe(0, 0, 1)   # none: rejected at once
    cands = [w._candidate(i, rid, None, True, False) for i, rid in enumerate("ab")]
    assert w.seqs["a"].fast.n == 3 and w.seqs["b"].fast.n == 0
    assert cands[0].free[0] > 0.9 > 0.05 > cands[1].free[0]
    plan = w._plan(cands)
    assert plan.lengths[0] == w.K and not plan.neural[0]   # the lookup draft, whole
    assert plan.neural[1]                                  # the neural fallback
    assert w._expected_rate(2) > neural_only  # half the misses at the 3-match's acceptance
    # SD on the lent cores: no lookup, every sequence a miss, the same choice
    assert not w._candidate(0, "a", None, False, False).free
    w._lent_sd = True
    assert w._candidate(0, "a", None, False, False).free == cands[0].free
    w._lent_sd = False
    w.cfg.controller.regime = "auto"  # (pinned to ssd, SD on the lent cores has no rate)
    lent_sd_with_fast = w._lent_sd_rate(2, time.perf_counter(), measured=False)
    w.cfg.fallback = "neural"
    assert w._fast_backup_options() == [([], True)]
    assert w._expected_rate(2) == pytest.approx(neural_only)
    assert w._lent_sd_rate(2, time.perf_counter(), measured=False) < lent_sd_with_fast


def test_an_idle_names_the_lookup_share_that_would_make_speculation_pay(tiny_target):
    """IdleAdvice.wake_share (_lookup_wake_share): where the neural draft does not pay
    (accepted rarely) and verifying more tokens costs, the share of 3-token matches at
    which SD on the lent cores with lookup drafts beats plain decoding by the margin, the
    other positions sending nothing; None with no fast backup. And the text of a
    resynced sequence (after an idle) replaces the match lengths that came up before,
    ahead of the step's idle decision
    (_see_text); where it moved the share of 3-token matches by TEXT_CHANGE_SHARE, what
    both regimes gave is forgotten (measured on other text)."""
    from vllm_saguaro.core.controller import StepCost
    from vllm_saguaro.core.fanout import SplitAcceptanceFit
    from vllm_saguaro.draft.regime import LOOKUP_WAKE_MARGIN, LOOKUP_WAKE_SHARES

    w = lent_worker(tiny_target, regime="auto")
    w.cfg.fallback = "auto"
    w.acceptance = SplitAcceptanceFit(0.05, prior_weight=1e6)  # the neural draft: no use
    w.lent_cost = StepCost()
    for _ in range(4):
        for width, seconds in [(1, 0.03), (4, 0.06)]:
            w.lent_cost.observe(width, seconds)
    for _ in range(60):  # a 3-token match's draft: 2 of 3 accepted (lookup_acceptance)
        w.fast_acceptance.observe(3, 2, 3)
        w.fast_acceptance.observe(0, 0, 1)
    plain_s = w._plain_s()
    share = w._lookup_wake_share(1, plain_s)
    assert share in LOOKUP_WAKE_SHARES and 0.2 <= share <= 0.7, share
    lower = LOOKUP_WAKE_SHARES[LOOKUP_WAKE_SHARES.index(share) - 1]
    now, plain = time.perf_counter(), 1 / plain_s(1)
    at = w._lent_sd_rate(1, now, measured=False, shares=[1 - share, 0, 0, share])
    below = w._lent_sd_rate(1, now, measured=False, shares=[1 - lower, 0, 0, lower])
    assert at > (1 + LOOKUP_WAKE_MARGIN) * plain >= below
    # batch 4: the unmatched positions may send nothing, which wakes it at a lower share
    # than where each waits for the neural fallback's stall or verifies its lookup draft
    share4 = w._lookup_wake_share(4, plain_s)
    options = w._fast_backup_options
    w._fast_backup_options = lambda shares=None: [(f, True) for f, r in options(shares) if r]
    assert share4 in LOOKUP_WAKE_SHARES and share4 < w._lookup_wake_share(4, plain_s)
    w._fast_backup_options = options
    w.cfg.fallback = "neural"
    assert w._lookup_wake_share(1, plain_s) is None
    w.cfg.fallback = "auto"
    w._see_text([("b", None, list(range(80)), None)])  # prose: no match
    now = time.perf_counter()
    for measured in (w.realized, w.lent_sd_realized):
        for _ in range(measured.rounds_needed(1)):
            measured.observe(1, 2, 0.05, now)
    w._see_text([("c", None, list(range(100, 180)), None)])  # more of it: kept
    assert w.realized.rate(1, now) and w.lent_sd_realized.rate(1, now)
    w._see_text([("a", None, [1, 2, 3, 4] * 20, None)])  # code: every position a match
    assert w.fast_acceptance.shares()[3] == 1.0 and w.stats.text_changes == 1
    assert w.realized.rate(1, now) is None and w.lent_sd_realized.rate(1, now) is None
    w._see_text([("a", [5], None, None)])  # nothing resynced: the counts stay
    assert w.fast_acceptance.shares()[3] == 1.0
    w._see_text([("b", None, list(range(80)), None)])
    assert w.fast_acceptance.shares()[0] == 1.0 and w.stats.text_changes == 2


def test_greedy_and_sampled_rows_weigh_their_own_rates(tiny_target):
    """_see_sampling: each row's kind (a sampled request accepts a draft token with the
    target's probability of it), the batch's sampled share mixing a_p and the lookup
    rates, what both regimes gave forgotten where that share moved; a miss's candidate
    at its own kind's rates; an outcome teaches its own kind's fits alone."""
    from vllm_saguaro.core.fanout import SplitAcceptanceFit
    from vllm_saguaro.core.sampling import SamplingSpec

    w = lent_worker(tiny_target)
    w.cfg.fallback = "auto"
    code = [1, 2, 3, 4] * 5
    w._sync("g", code, SamplingSpec())
    w._sync("s", code, SamplingSpec(1.0))
    w.acceptance = SplitAcceptanceFit(0.6, prior_weight=1e9)
    w.acceptance.fits[False] = SplitAcceptanceFit(0.2, prior_weight=1e9).fits[False]
    now = time.perf_counter()
    for measured in (w.realized, w.lent_sd_realized):
        for _ in range(measured.rounds_needed(2)):
            measured.observe(2, 2, 0.05, now)
    assert w.realized.rate(2, now) and w.lent_sd_realized.rate(2, now)
    w._see_sampling([("g", [5], None, None), ("s", [5], None, None)])
    assert w._greedy_rows == [True, False] and w.stats.sampling_changes == 1
    assert w.acceptance.sampled_share == w.fast_acceptance.sampled_share == 0.5
    assert w.acceptance.rate == pytest.approx(0.4)
    assert w.realized.rate(2, now) is None and w.lent_sd_realized.rate(2, now) is None
    g, s = (w._candidate(i, rid, None, True, False) for i, rid in enumerate("gs"))
    assert g.neural == (0.6,) * w.K and s.neural == (0.2,) * w.K
    n = w._fast_draft(w.seqs["g"]).n
    assert g.free == (w.fast_acceptance.rate(n, True),) * w.K
    assert s.free == (w.fast_acceptance.rate(n, False),) * w.K != g.free
    w._see_sampling([("g", [5], None, None), ("s", [5], None, None)])  # the same batch
    assert w.stats.sampling_changes == 1
    w._see_sampling([("n", None, code, tuple(SamplingSpec(1.0)))])  # a new sampled one
    assert w._greedy_rows == [False] and w.stats.sampling_changes == 2

    w.acceptance = SplitAcceptanceFit(0.6)
    st = w.seqs["s"]
    st.spec, st.source, st.shadow_fast = [7, 8, 9], "neural", None
    w._observe_outcome(st, [7, 5])  # one accepted, then rejected
    assert w.acceptance.fits[False].accepted == 1 and w.acceptance.fits[False].rejected == 1
    assert w.acceptance.fits[True].accepted == w.acceptance.fits[True].rejected == 0
