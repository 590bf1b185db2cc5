"""The Triton kernels against their torch references, on CPU tensors under the
interpreter. Run by test_ops.py in a process of its own with TRITON_INTERPRET=1 (it must
be set before Triton is first imported); on a GPU (tests marked gpu) they run compiled.

Exact: tokens, branch indices, fork candidates. q: counts within 1 of the reference.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.ops.inputs import sampling_rows as _rows
from vllm_saguaro.core.sampling import Q_SCALE
from vllm_saguaro.ops.cache_lookup import cache_lookup_reference, cache_lookup_triton
from vllm_saguaro.ops.fork import fork_candidates_reference, fork_candidates_triton
from vllm_saguaro.ops.saguaro_sampling import (saguaro_sample_reference,
                                               saguaro_sample_triton)

DEVICE = os.environ.get("SAGUARO_OPS_TEST_DEVICE", "cpu")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 on CPU (tests/ops/test_ops.py sets it)",
                allow_module_level=True)
if DEVICE.startswith("cuda") and not torch.cuda.is_available():
    pytest.skip(f"SAGUARO_OPS_TEST_DEVICE={DEVICE} but torch sees no CUDA device",
                allow_module_level=True)


def _on(*ts):
    return [t.to(DEVICE) for t in ts]


@pytest.mark.parametrize("V,c,ties", [(1, 0.5, False), (7, 0.0, False), (100, 0.5, True),
                                      (1000, 0.3, False), (5000, 1.0, False),
                                      (5000, 0.0, True)])
def test_saguaro_sample_matches_reference(V, c, ties):
    gen = torch.Generator().manual_seed(V)
    args = _rows(gen, 16, V, ties)
    tok_ref, q_ref = saguaro_sample_reference(*args[:5], c, args[5])
    tok, q = saguaro_sample_triton(*_on(*args[:5]), c, args[5].to(DEVICE))
    tok, q = tok.cpu(), q.cpu()
    counts, counts_ref = torch.round(q * Q_SCALE), torch.round(q_ref * Q_SCALE)
    assert bool((counts.sum(-1) == Q_SCALE).all())
    assert bool(((counts - counts_ref).abs() <= 1).all())
    assert torch.equal(tok, tok_ref)
    assert bool((counts.gather(1, tok[:, None]) > 0).all())  # never a token q gives 0


def test_fork_candidates_match_reference():
    gen = torch.Generator().manual_seed(1)
    for P, V, width, ties in [(1, 1, 1, False), (9, 50, 4, True), (16, 3000, 8, False),
                              (5, 6, 8, False), (7, 5000, 3, True)]:
        logits = torch.randn(P, V, generator=gen)
        if ties:
            logits = torch.round(logits * 2)
        logits[0, : V // 2] = float("-inf")
        drafted = torch.randint(-1, V, (P,), generator=gen)
        drafted[-1] = -1
        fanout = torch.randint(0, width + 1, (P,), generator=gen)
        ref = fork_candidates_reference(logits, drafted, fanout, width)
        got = fork_candidates_triton(*_on(logits, drafted, fanout), width).cpu()
        assert torch.equal(got, ref), (P, V, width)


def test_cache_lookup_matches_reference():
    gen = torch.Generator().manual_seed(2)
    for N, B in [(0, 3), (1, 1), (40, 16), (3000, 64)]:
        keys = torch.stack([torch.randint(0, 16, (N,), generator=gen),
                            torch.randint(0, 8, (N,), generator=gen),
                            torch.randint(0, 30, (N,), generator=gen)], dim=-1)
        queries = torch.stack([torch.randint(0, 16, (B,), generator=gen),
                               torch.randint(0, 8, (B,), generator=gen),
                               torch.randint(0, 30, (B,), generator=gen)], dim=-1)
        if N:
            queries[: B // 2] = keys[torch.randint(0, N, (B // 2,), generator=gen)]
        ref = cache_lookup_reference(keys, queries)
        got = cache_lookup_triton(*_on(keys, queries)).cpu()
        assert torch.equal(got, ref), (N, B)
        assert N == 0 or bool((ref[: B // 2] >= 0).all())
