"""The draft worker on a GPU: draft_device "cuda:0" against the CPU worker and transformers.

Every test is marked gpu (skipped without CUDA, tests/conftest.py; scripts/gpu_check.sh
runs them on a lent GPU). float32 on both devices, so the greedy drafts and branches must
be the very same tokens. On CUDA the worker samples and forks with the ops
(vllm_saguaro/ops: the CUDA ops where built, else Triton); the CPU worker is forced onto
them (SAGUARO_DRAFT_OPS=1) where a test compares the op paths.
"""
from __future__ import annotations

import pytest
import torch

from tests.draft.test_worker import hf, hf_greedy, step, worker  # noqa: F401 (hf: a fixture)
from vllm_saguaro.core.outcome import Outcome
from vllm_saguaro.core.sampling import Q_SCALE, SamplingSpec, from_wire
from vllm_saguaro.draft.worker import OPS_ENV

pytestmark = pytest.mark.gpu

GPU = "cuda:0"
PROMPTS = {"a": [5, 17, 99, 3, 250, 7], "b": [9, 8, 7, 300, 301, 302, 303, 11, 12]}
GEOMETRIC = {"policy": "geometric", "budget": 8, "acceptance_rate": 0.5,
             "fit_acceptance": False, "fit_to_round": False}


@pytest.fixture(autouse=True)
def _exact_float32(monkeypatch):
    """No TF32 in the GPU's float32 matmuls (torch's default; pinned so that no import
    changes it): the GPU draft must pick the CPU draft's argmax tokens."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    monkeypatch.delenv(OPS_ENV, raising=False)
    yield
    torch.set_float32_matmul_precision(precision)


def cpu_worker(path, ops: bool, monkeypatch, **kw):
    """A CPU worker with float32 weights as on the GPU (not the CPU's default fp16 ones);
    ops=True: on the ops' torch references, the path a GPU takes."""
    if ops:
        monkeypatch.setenv(OPS_ENV, "1")
    try:
        w = worker(path, draft_weights="dtype", **kw)
        assert w.model.quantization == "none"
        return w
    finally:
        monkeypatch.delenv(OPS_ENV, raising=False)


def branches(w, rid):
    return {o: s.tokens for o, s in w.seqs[rid].cache.entries.items()}


def updates_for(prompts):
    return [(r, None, p, None) for r, p in prompts.items()]


def test_the_worker_lives_on_the_gpu(tiny_target):
    w = worker(tiny_target, draft_device=GPU)
    assert w.device == torch.device(GPU) and w.use_ops
    assert w.model.embed.device.type == "cuda" and w.kv.k.device.type == "cuda"
    assert w.model.head.quantization == "none"  # fp16 weights are a CPU kernel


def test_greedy_drafts_and_branches_match_cpu_and_transformers(tiny_target, hf, monkeypatch):
    """Fallback drafts, pre-speculated branches, then a hit and a miss (KV rolled back
    on the GPU) and the next round: token for token the CPU worker's and transformers'."""
    gpu, cpu = worker(tiny_target, draft_device=GPU), cpu_worker(tiny_target, False, monkeypatch)
    out_g, out_c = step(gpu, updates_for(PROMPTS), []), step(cpu, updates_for(PROMPTS), [])
    for (dg, hg, qg), (dc, _, _), p in zip(out_g, out_c, PROMPTS.values()):
        assert hg is None and qg is None
        assert dg == dc == hf_greedy(hf, p, 3)
    gpu.prespeculate()
    cpu.prespeculate()
    for rid, p in PROMPTS.items():
        got = branches(gpu, rid)
        assert got == branches(cpu, rid) and len(got) == 4 * 3
        spec = gpu.seqs[rid].spec
        for (k, bonus), tokens in got.items():
            assert tokens == hf_greedy(hf, p + spec[:k] + [bonus], 3), (rid, k, bonus)
    assert gpu.stats.ops_forks > 0 and gpu.stats.ops_rows == 0  # greedy: no sampling op
    # round 2: "a" hits a cached branch, "b" misses (a bonus nobody cached)
    (k, bonus), hit_tokens = next(iter(branches(gpu, "a").items()))
    sampled_a = gpu.seqs["a"].spec[:k] + [bonus]
    spec_b = gpu.seqs["b"].spec
    miss = next(t for t in range(10, 512)
                if Outcome(0, t) not in gpu.seqs["b"].cache.entries and t != spec_b[0])
    ups = [("a", sampled_a, None, None), ("b", [miss], None, None)]
    r_g, r_c = step(gpu, ups, []), step(cpu, ups, [])
    assert [(d, h) for d, h, _ in r_g] == [(d, h) for d, h, _ in r_c]
    assert r_g[0][1] is True and r_g[0][0] == hit_tokens
    assert r_g[1][1] is False
    assert r_g[1][0] == hf_greedy(hf, PROMPTS["b"] + [miss], 3)
    gpu.prespeculate()
    cpu.prespeculate()
    for rid in PROMPTS:
        assert branches(gpu, rid) == branches(cpu, rid)


def test_long_prompt_grows_the_gpu_kv_pool(tiny_target, monkeypatch):
    """A prompt longer than the pool (64 blocks of 16) and than a batched window: the
    pool doubles on the GPU and the drafts still match the CPU worker's."""
    long = [(7 * i + 3) % 500 + 10 for i in range(1100)]
    prompts = {"long": long, "short": [9, 8, 7, 300]}
    gpu, cpu = worker(tiny_target, draft_device=GPU), cpu_worker(tiny_target, False, monkeypatch)
    out_g, out_c = step(gpu, updates_for(prompts), []), step(cpu, updates_for(prompts), [])
    assert [d for d, _, _ in out_g] == [d for d, _, _ in out_c]
    assert gpu.kv.num_blocks > 64
    gpu.prespeculate()
    cpu.prespeculate()
    for rid in prompts:
        assert branches(gpu, rid) == branches(cpu, rid)


def test_cut_head_on_the_gpu(tiny_target, hf, monkeypatch):
    """draft_head_tokens: the head's ids live on the GPU; the fork maps the drafted tokens
    into the head (DraftModel.head_index) across devices."""
    p = PROMPTS["a"]
    gpu = worker(tiny_target, draft_device=GPU, draft_head_tokens=300)
    cpu = cpu_worker(tiny_target, False, monkeypatch, draft_head_tokens=300)
    (spec, _, _), = step(gpu, [("a", None, p, None)], [])
    (spec_c, _, _), = step(cpu, [("a", None, p, None)], [])
    with torch.no_grad():
        ref = hf(torch.tensor([p])).logits[0, -1, :300].argmax().item()
    assert spec == spec_c and spec[0] == ref
    gpu.prespeculate()
    cpu.prespeculate()
    got = branches(gpu, "a")
    assert got == branches(cpu, "a")
    drafted = set(spec) | {b for _, b in got} | {t for ts in got.values() for t in ts}
    assert max(drafted) < 300, "token ids outside the kept head were proposed"


def _check_sampled(toks, counts, w, rid, head):
    assert counts.shape == (len(toks), head) and counts.dtype.name == "uint16"
    assert (counts.astype("int64").sum(-1) == Q_SCALE).all(), "q rows are exact counts"
    q = from_wire(counts)
    assert all(q[i, t] > 0 for i, t in enumerate(toks)), "drafted tokens have mass under q"
    for (k, bonus), spec in w.seqs[rid].cache.entries.items():
        assert spec.probs.shape == (len(spec.tokens), head) and spec.probs.device == w.device
        c = torch.round(spec.probs * Q_SCALE)
        assert bool((c.sum(-1) == Q_SCALE).all())
        assert all(c[i, t] > 0 for i, t in enumerate(spec.tokens)), (k, bonus)


def test_sampled_requests_go_through_the_ops_and_seeds_reproduce(tiny_target):
    """Sampled rows on CUDA: one ops.saguaro_sample call per step (stats.ops_rows), q as
    exact counts, drafted tokens with mass under q, and a seeded request drawing the same
    drafts, q and branches in two fresh workers."""
    def run(seed):
        w = worker(tiny_target, draft_device=GPU, saguaro_c=0.3, draft_head_tokens=400)
        sp = tuple(SamplingSpec(temperature=0.8, top_p=0.95, seed=seed))
        (toks, _, counts), = step(w, [("a", None, [5, 17, 99, 3], sp)], [])
        w.prespeculate()
        return toks, counts, branches(w, "a"), w

    toks, counts, br, w = run(7)
    assert w.stats.ops_rows > 0 and w.stats.ops_forks > 0
    assert w.head_ids() == list(range(400))
    _check_sampled(toks, counts, w, "a", 400)
    toks2, counts2, br2, _ = run(7)
    assert toks2 == toks and (counts2 == counts).all() and br2 == br
    assert any(run(s)[0] != toks for s in (8, 9, 10, 11)), "different seeds, same drafts"


def test_mixed_batch_on_the_gpu(tiny_target, hf):
    """Greedy, seeded and unseeded rows with different parameters in one batch: the
    greedy row is transformers' continuation, the sampled ones carry valid q."""
    w = worker(tiny_target, draft_device=GPU, saguaro_c=0.5)
    ups = [("g", None, PROMPTS["a"], None),
           ("s", None, PROMPTS["b"], tuple(SamplingSpec(temperature=0.8, top_p=0.9, seed=3))),
           ("u", None, [40, 41, 42, 43], tuple(SamplingSpec(temperature=1.2, top_k=20)))]
    out = step(w, ups, [])
    assert out[0][0] == hf_greedy(hf, PROMPTS["a"], 3) and out[0][2] is None
    rows = w.stats.ops_rows
    assert rows == 2 * 3, "two sampled rows, K steps, one op call per step"
    w.prespeculate()
    assert w.stats.ops_rows > rows
    for (toks, _, counts), rid in zip(out[1:], ("s", "u")):
        _check_sampled(toks, counts, w, rid, 512)
    for (k, bonus), tokens in branches(w, "g").items():
        assert tokens == hf_greedy(hf, PROMPTS["a"] + out[0][0][:k] + [bonus], 3)


def test_fork_op_on_the_gpu_branches_like_the_cpu_ops(tiny_target, hf, monkeypatch):
    """geometric fan-out: the fork op on CUDA (Triton) and its torch reference on CPU
    (SAGUARO_DRAFT_OPS=1) pre-speculate the same outcomes, the same greedy branches."""
    gpu = worker(tiny_target, draft_device=GPU, fanout=GEOMETRIC)
    cpu = cpu_worker(tiny_target, True, monkeypatch, fanout=GEOMETRIC)
    assert gpu.use_ops and cpu.use_ops and gpu.fanout == cpu.fanout
    out_g, out_c = step(gpu, updates_for(PROMPTS), []), step(cpu, updates_for(PROMPTS), [])
    assert [d for d, _, _ in out_g] == [d for d, _, _ in out_c]
    gpu.prespeculate()
    cpu.prespeculate()
    for (spec, _, _), (rid, p) in zip(out_g, PROMPTS.items()):
        got = branches(gpu, rid)
        assert set(got) == set(branches(cpu, rid)) and len(got) == sum(gpu.fanout)
        assert got == branches(cpu, rid)
        for (k, bonus), tokens in got.items():
            if k < len(spec):
                assert bonus != spec[k], "the sent token is never a bonus candidate"
            assert tokens == hf_greedy(hf, p + spec[:k] + [bonus], 3), (rid, k, bonus)
    assert gpu.stats.ops_forks == cpu.stats.ops_forks > 0


def test_probable_policy_on_the_gpu(tiny_target, hf):
    """The default fan-out (probable) on CUDA: outcome estimates on the GPU's logits,
    greedy and sampled (sigma_{F,C} with C < 1), budget x batch branches."""
    fan = {"policy": "probable", "budget": 5, "fit_to_round": False}
    w = worker(tiny_target, draft_device=GPU, saguaro_c=0.2, fanout=fan)
    ups = [("g", None, PROMPTS["a"], None),
           ("s", None, PROMPTS["b"], tuple(SamplingSpec(temperature=1.0)))]
    out = step(w, ups, [])
    w.prespeculate()
    total = 0
    for (spec, _, _), rid in zip(out, ("g", "s")):
        st = w.seqs[rid]
        assert len(st.confidence) == 3 and all(0 <= c <= 1 for c in st.confidence)
        assert set(st.cache.entries) == set(st.roots)
        total += len(st.cache)
        for (k, bonus) in st.cache.entries:
            if k < 3:
                assert bonus != spec[k], "the sent token is never a bonus candidate"
    assert total == 5 * 2
    for (k, bonus), tokens in branches(w, "g").items():
        assert tokens == hf_greedy(hf, PROMPTS["a"] + out[0][0][:k] + [bonus], 3)


def test_seeded_branch_draws_like_the_fallback_on_the_gpu(tiny_target):
    """Hit or miss, a seeded request gets the same drafts on the GPU too."""
    sp = tuple(SamplingSpec(temperature=1.0, seed=3))
    p = PROMPTS["a"]
    w = worker(tiny_target, draft_device=GPU, saguaro_c=0.5)
    (toks, _, _), = step(w, [("a", None, p, sp)], [])
    w.prespeculate()
    (k, bonus), branch = next(iter(w.seqs["a"].cache.entries.items()))
    w2 = worker(tiny_target, draft_device=GPU, saguaro_c=0.5, force_cache_miss=True)
    (toks2, _, _), = step(w2, [("a", None, p, sp)], [])
    assert toks2 == toks
    w2.prespeculate()
    (fallback, hit, _), = step(w2, [("a", toks[:k] + [bonus], None, None)], [])
    assert hit is False and fallback == branch.tokens


def test_bf16_attention_on_the_gpu_leaves_cudnn_out(tmp_path):
    """bf16 on CUDA: attention runs without cuDNN's (a new cuDNN graph for every shape cost
    ~60 ms a call, model.CUDA_ATTENTION) and with grouped heads gives what the CPU gives."""
    from tests.tiny_models import make_tiny_llama
    from vllm_saguaro.draft.model import DraftModel

    path = make_tiny_llama(tmp_path / "gqa", heads=4, kv_heads=2, hidden=256)
    gpu, cpu = DraftModel(path, torch.bfloat16, GPU), DraftModel(path, torch.float32)
    ids = torch.tensor([[5, 17, 99, 3, 250, 7, 8]])
    for n in (5, 6, 7):  # three shapes, as a growing context gives
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        pos = torch.arange(n)[None]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            hg, _ = gpu.forward(ids[:, :n].to(GPU), pos.to(GPU), mask.to(GPU))
            torch.cuda.synchronize()
        names = {e.key for e in prof.key_averages()}
        assert not [k for k in names if "cudnn_attention" in k], sorted(names)
        assert [k for k in names if "attention" in k], "no attention op profiled"
        hc, _ = cpu.forward(ids[:, :n], pos, mask)
        torch.testing.assert_close(hg.float().cpu(), hc, atol=0.1, rtol=0.05)
