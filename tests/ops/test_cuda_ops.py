"""The CUDA ops (csrc/, vllm_saguaro/ops/cuda.py) against the torch references.

On a GPU (tests marked gpu): tokens and branch indices exactly equal, q's counts within 1.
They skip, saying so, where the extension was not built (a CUDA torch without nvcc). On a
CPU install: the extension is absent, available() says so quietly, nothing is registered
under torch.ops.saguaro, and the wrappers refuse with a clear error.
"""
from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

from tests.ops.inputs import sampling_rows
from vllm_saguaro.core.sampling import Q_SCALE
from vllm_saguaro.ops import cuda as saguaro_cuda
from vllm_saguaro.ops.cache_lookup import cache_lookup_reference
from vllm_saguaro.ops.saguaro_sampling import saguaro_sample_reference

cpu_torch = pytest.mark.skipif(torch.version.cuda is not None,
                               reason="a CUDA torch: the extension may be built here")


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@cpu_torch
def test_cpu_install_has_no_extension_and_says_so_quietly(capfd):
    saguaro_cuda.available.cache_clear()
    seen = _Records()
    saguaro_cuda.log.addHandler(seen)
    try:
        assert saguaro_cuda.available() is False
    finally:
        saguaro_cuda.log.removeHandler(seen)
    assert not seen.records and capfd.readouterr() == ("", "")
    assert importlib.util.find_spec(saguaro_cuda.EXTENSION) is None
    # no library loaded: no op (and so no fake) under torch.ops.saguaro
    assert not hasattr(torch.ops.saguaro, "cache_lookup")
    assert not hasattr(torch.ops.saguaro, "saguaro_sample")
    with pytest.raises(RuntimeError, match="not built"):
        saguaro_cuda.cache_lookup_cuda(torch.zeros(0, 3, dtype=torch.long),
                                       torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(RuntimeError, match="not built"):
        saguaro_cuda.saguaro_sample_cuda(torch.zeros(1, 4), torch.ones(1),
                                         torch.zeros(1, dtype=torch.long), torch.ones(1),
                                         torch.zeros(1, dtype=torch.long), 0.5,
                                         torch.zeros(1, dtype=torch.long))


def test_available_never_raises_on_a_broken_build(monkeypatch):
    def broken():
        raise OSError("_C.so: undefined symbol: _ZN3c104cuda9SetDeviceEa")

    monkeypatch.setattr(saguaro_cuda, "_load_extension", broken)
    saguaro_cuda.available.cache_clear()
    try:
        assert saguaro_cuda.available() is False
    finally:
        saguaro_cuda.available.cache_clear()


def test_fake_implementations_give_the_ops_shapes():
    keys = torch.empty(7, 3, dtype=torch.long, device="meta")
    queries = torch.empty(5, 3, dtype=torch.long, device="meta")
    out = saguaro_cuda._fake_cache_lookup(keys, queries)
    assert (out.shape, out.dtype, out.device.type) == ((5,), torch.long, "meta")
    logits = torch.empty(4, 11, device="meta")
    rows = torch.empty(4, device="meta")
    tokens, q = saguaro_cuda._fake_saguaro_sample(logits, rows, rows, rows, rows, 0.5, rows)
    assert (tokens.shape, tokens.dtype) == ((4,), torch.long)
    assert (q.shape, q.dtype, q.device.type) == ((4, 11), torch.float32, "meta")


@pytest.fixture
def built():
    if not saguaro_cuda.available():
        pytest.skip("vllm_saguaro._C is not built (setup.py builds it only with a CUDA "
                    "toolkit and a CUDA torch): nothing to check")


def _rows(gen, R, V, ties=False):
    return sampling_rows(gen, R, V, ties, edges=R >= 7)


def _check_sample(args, c, logits=None):
    logits = args[0] if logits is None else logits
    tok_ref, q_ref = saguaro_sample_reference(args[0], *args[1:5], c, args[5])
    tok, q = saguaro_cuda.saguaro_sample_cuda(logits.cuda(), *[a.cuda() for a in args[1:5]],
                                              c, args[5].cuda())
    tok, q = tok.cpu(), q.cpu()
    assert tok.dtype == torch.long and q.dtype == torch.float32 and q.shape == q_ref.shape
    counts, counts_ref = torch.round(q * Q_SCALE), torch.round(q_ref * Q_SCALE)
    assert bool((counts.sum(-1) == Q_SCALE).all())
    assert int((counts - counts_ref).abs().max()) <= 1
    assert torch.equal(tok, tok_ref), (tok, tok_ref)
    assert bool((counts.gather(1, tok[:, None]) > 0).all())  # never a token q gives 0


@pytest.mark.gpu
@pytest.mark.parametrize("V,c,ties", [(1, 0.5, False), (7, 0.0, False), (100, 0.5, True),
                                      (1000, 0.3, False), (2048, 0.5, False),
                                      (5000, 1.0, False), (5000, 0.0, True),
                                      (32771, 0.2, False), (151936, 0.5, False)])
def test_saguaro_sample_cuda_matches_reference(built, V, c, ties):
    gen = torch.Generator().manual_seed(V)
    _check_sample(_rows(gen, 16, V, ties), c)


@pytest.mark.gpu
def test_saguaro_sample_cuda_takes_bf16_and_strided_logits(built):
    gen = torch.Generator().manual_seed(3)
    args = _rows(gen, 12, 3000)
    bf16 = args[0].bfloat16()
    _check_sample((bf16.float(),) + args[1:], 0.4, logits=bf16)
    wide = torch.randn(12, 3100, generator=gen)
    strided = wide[:, 50:3050]                # row stride 3100, not the vocabulary
    _check_sample((strided.contiguous(),) + args[1:], 0.4, logits=strided)


@pytest.mark.gpu
def test_saguaro_sample_cuda_seeds_and_signed_zeros(built):
    gen = torch.Generator().manual_seed(4)
    args = list(_rows(gen, 64, 257))
    args[0] = -args[0].abs()                  # the zeros are each row's top 40 tokens:
    args[0][:, :40] = 0.0                     # top-k and the top F+1 cut inside them
    args[0][::2, :20] = -0.0                  # equal floats: one key (ops/keys.py)
    args[2][6:] = torch.arange(1, 59)         # every top-k, from inside the zeros to past them
    args[5] = torch.arange(-32, 32, dtype=torch.long) * (2**40 + 12345)  # negative seeds too
    _check_sample(tuple(args), 0.5)


@pytest.mark.gpu
def test_cache_lookup_cuda_matches_reference(built):
    gen = torch.Generator().manual_seed(2)
    for N, B in [(0, 4), (1, 1), (37, 9), (300, 64), (5000, 33)]:
        keys = torch.stack([torch.randint(0, 8, (N,), generator=gen),
                            torch.randint(0, 4, (N,), generator=gen),
                            torch.randint(0, 6, (N,), generator=gen)], dim=1)  # duplicates
        queries = torch.stack([torch.randint(0, 9, (B,), generator=gen),
                               torch.randint(0, 5, (B,), generator=gen),
                               torch.randint(0, 7, (B,), generator=gen)], dim=1)
        ref = cache_lookup_reference(keys, queries)
        got = saguaro_cuda.cache_lookup_cuda(keys.cuda(), queries.cuda())
        assert got.dtype == torch.long and got.device.type == "cuda"
        assert torch.equal(got.cpu(), ref), (N, B)
    assert saguaro_cuda.cache_lookup_cuda(keys.cuda(), queries[:0].cuda()).shape == (0,)


@pytest.mark.gpu
def test_cuda_ops_trace_with_their_fakes(built):
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    real = [torch.randn(3, 50, device="cuda"), torch.ones(3, device="cuda"),
            torch.zeros(3, dtype=torch.int32, device="cuda"), torch.ones(3, device="cuda"),
            torch.zeros(3, dtype=torch.int32, device="cuda"),
            torch.zeros(3, dtype=torch.long, device="cuda")]
    logits, temperature, top_k, top_p, fanout, seeds = [mode.from_tensor(t) for t in real]
    keys = mode.from_tensor(torch.zeros(7, 3, dtype=torch.long, device="cuda"))
    with mode:
        tokens, q = torch.ops.saguaro.saguaro_sample(logits, temperature, top_k, top_p,
                                                     fanout, 0.5, seeds)
        found = torch.ops.saguaro.cache_lookup(keys, keys[:2])
    assert (tokens.shape, tokens.dtype, q.shape, q.dtype) == ((3,), torch.long, (3, 50),
                                                              torch.float32)
    assert (found.shape, found.dtype) == ((2,), torch.long)
