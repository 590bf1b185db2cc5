"""The ops' torch references (what every kernel is compared with) against the draft's own
logic in core/ and draft/, and the Triton kernels against the references (kernel_checks.py,
in a process of its own under TRITON_INTERPRET=1)."""
from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_saguaro.core.cache import Speculation, SpeculationCache
from vllm_saguaro.core.outcome import Outcome
from vllm_saguaro.core.sampling import (Q_SCALE, SamplingSpec, draft_distribution,
                                        quantize_distribution)
from vllm_saguaro.ops import backend
from vllm_saguaro.ops.cache_lookup import cache_lookup_reference
from vllm_saguaro.ops.fork import fork_candidates_reference
from vllm_saguaro.ops.keys import hash32, rank_key, sortable_key
from vllm_saguaro.ops.saguaro_sampling import saguaro_sample_reference

ROOT = Path(__file__).resolve().parents[2]


def test_sortable_key_orders_like_floats():
    x = torch.tensor([float("-inf"), -3.5, -1e-38, -0.0, 0.0, 1e-45, 0.5, 7.0, float("inf")])
    key = sortable_key(x)
    assert bool((key[1:] >= key[:-1]).all())
    assert int(key[3]) == int(key[4]) == 0                      # -0.0 == +0.0
    assert int((key[1:] == key[:-1]).sum()) == 1
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(1000, generator=gen) * 100
    assert torch.equal(sortable_key(y).argsort(stable=True), y.argsort(stable=True))


def test_rank_prefers_the_higher_logit_then_the_lower_index():
    rank = rank_key(sortable_key(torch.tensor([[1.0, 3.0, 3.0, 2.0]])))
    assert rank[0].argsort(descending=True).tolist() == [1, 2, 3, 0]
    assert len(set(rank[0].tolist())) == 4


def test_hash32_is_32_bits_and_spreads_low_bits():
    seeds = torch.arange(-50_000, 50_000, dtype=torch.long)
    h = hash32(seeds)
    assert int(h.min()) >= 0 and int(h.max()) < 2**32
    r = h & (Q_SCALE - 1)
    counts = torch.bincount(r // 1024, minlength=32).double()  # 32 bins of the draw
    chi2 = float(((counts - counts.mean()) ** 2 / counts.mean()).sum())
    assert chi2 < 70, chi2                                      # df 31: p ~ 1e-4


@pytest.mark.parametrize("temperature,top_k,top_p,fanout,c", [
    (1.0, 0, 1.0, 3, 0.5), (0.7, 20, 1.0, 0, 0.0), (1.3, 0, 0.8, 5, 0.3),
    (0.5, 5, 0.5, 2, 1.0), (1.0, 1, 1.0, 1, 0.0)])
def test_reference_q_is_the_workers_q(temperature, top_k, top_p, fanout, c):
    """The op samples from the q the worker's core/sampling.py path sends (to one count:
    float64 against float32 rounding)."""
    gen = torch.Generator().manual_seed(fanout)
    logits = torch.randn(8, 3000, generator=gen) * 3
    fan = torch.full((8,), fanout)
    spec = SamplingSpec(temperature, top_k, top_p)
    q_core = quantize_distribution(draft_distribution(logits, spec, fan, c))
    _, q = saguaro_sample_reference(logits, torch.full((8,), temperature),
                                    torch.full((8,), top_k), torch.full((8,), top_p),
                                    fan, c, torch.arange(8))
    assert float((q - q_core).abs().max()) <= 1.5 / Q_SCALE
    assert bool(((q * Q_SCALE).round().sum(-1) == Q_SCALE).all())


def test_reference_draws_follow_q():
    """Over many seeds the drawn token is distributed as q (chi-square, fixed seeds)."""
    gen = torch.Generator().manual_seed(3)
    row = torch.randn(1, 40, generator=gen) * 1.5
    n = 40_000
    tokens, q = saguaro_sample_reference(row.expand(n, 40), torch.full((n,), 0.9),
                                         torch.zeros(n, dtype=torch.long), torch.full((n,), 0.9),
                                         torch.full((n,), 2), 0.4,
                                         torch.randint(-2**62, 2**62, (n,), generator=gen))
    expected = q[0].double() * n
    seen = torch.bincount(tokens, minlength=40).double()
    assert float(seen[expected == 0].sum()) == 0            # never a token q gives 0
    live = expected > 0
    chi2 = float(((seen[live] - expected[live]) ** 2 / expected[live]).sum())
    df = int(live.sum()) - 1
    assert chi2 < df + 6 * math.sqrt(2 * df), (chi2, df)


def test_reference_seeded_draw_repeats_and_seeds_differ():
    logits = torch.randn(2, 500, generator=torch.Generator().manual_seed(4)).repeat(50, 1)
    args = (torch.ones(100), torch.zeros(100, dtype=torch.long), torch.ones(100),
            torch.full((100,), 3), 0.5)
    a, _ = saguaro_sample_reference(logits, *args, torch.arange(100))
    b, _ = saguaro_sample_reference(logits, *args, torch.arange(100))
    assert torch.equal(a, b)
    assert len(set(a[0::2].tolist())) > 10


def test_reference_fork_is_the_workers_fork():
    """fork_candidates = draft/fork.py's top-F per position without the drafted token."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(8, 400, generator=gen)
    spec = torch.randint(0, 400, (7,), generator=gen).tolist()
    fanout = [3, 3, 2, 2, 1, 1, 0, 4]
    drafted = torch.tensor(spec + [-1])
    got = fork_candidates_reference(logits, drafted, torch.tensor(fanout), 4)
    for j in range(8):
        top = torch.topk(logits[j], fanout[j] + 1).indices.tolist()
        want = [x for x in top if j == 7 or x != spec[j]][: fanout[j]]
        assert got[j].tolist() == want + [-1] * (4 - len(want))


def test_reference_lookup_is_the_speculation_cache():
    gen = torch.Generator().manual_seed(6)
    keys = torch.stack([torch.randint(0, 4, (60,), generator=gen),
                        torch.randint(0, 8, (60,), generator=gen),
                        torch.randint(0, 10, (60,), generator=gen)], dim=-1)
    caches = [SpeculationCache() for _ in range(4)]
    for i, (row, k, t) in enumerate(keys.tolist()):
        if Outcome(k, t) not in caches[row].entries:           # the first branch per key
            caches[row].put(Outcome(k, t), Speculation([i]))
    queries = torch.stack([torch.randint(0, 4, (200,), generator=gen),
                           torch.randint(0, 8, (200,), generator=gen),
                           torch.randint(0, 10, (200,), generator=gen)], dim=-1)
    got = cache_lookup_reference(keys, queries).tolist()
    want = []
    for row, k, t in queries.tolist():
        hit = caches[row].lookup(Outcome(k, t))
        want.append(-1 if hit is None else hit.tokens[0])
    assert got == want and -1 in got and max(got) >= 0


def test_backend_choice(monkeypatch):
    monkeypatch.delenv("SAGUARO_OPS_BACKEND", raising=False)
    assert backend("cpu") == "torch"
    from vllm_saguaro.ops import cuda

    # the csrc/ ops where built (a GPU box after setup.py build_ext), else Triton
    assert backend("cuda:0") == ("cuda" if cuda.available() else "triton")
    monkeypatch.setenv("SAGUARO_OPS_BACKEND", "triton")
    assert backend("cpu") == "triton"
    monkeypatch.setenv("SAGUARO_OPS_BACKEND", "cuda-graphs")
    with pytest.raises(ValueError, match="SAGUARO_OPS_BACKEND"):
        backend("cpu")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_triton_kernels_match_references_under_the_interpreter():
    """kernel_checks.py in a process with TRITON_INTERPRET=1 (read when Triton is first
    imported, and this process may have imported it already)."""
    env = dict(os.environ, TRITON_INTERPRET="1", SAGUARO_OPS_TEST_DEVICE="cpu")
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/ops/kernel_checks.py",
                           "-q", "-p", "no:logging", "-rA"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("PASSED tests/ops/kernel_checks.py") >= 8, out[-2000:]
    assert "SKIPPED" not in out and "FAILED" not in out, out[-2000:]
