"""Saguaro sampling as one op: draft logits -> (token, q) for every sampled row.

Per row: temperature, top-k, top-p (as vLLM: the smallest set of the highest tokens whose
mass reaches top_p), then sigma_{F,C} (the row's top F+1 tokens scaled by C, renormalised;
core/sampling.py says why), then q quantized to integer counts over Q_SCALE (the exact q
the verifier is told), and the token drawn from that q with r = hash32(seed) mod Q_SCALE:
the first token whose cumulative count exceeds r.

The probabilities are computed in float64 so that the counts, and with them the tokens,
come out the same on every backend (a float32 softmax moves ~1% of a 16k row's counts by
one between two summation orders; float64 makes that ~1e-11). Ties are broken by
ops/keys.py's rank: equal logits are all kept by top-k and top-p, and the lower index wins
a place in the top F+1.

Greedy rows are not this op's business (the caller takes their argmax).
"""
from __future__ import annotations

import torch

from vllm_saguaro.core.sampling import Q_SCALE
from vllm_saguaro.ops.backend import kernels, next_power_of_2
from vllm_saguaro.ops.keys import hash32, rank_key, sortable_key


def _top_p_keep(p: torch.Tensor, key: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """keep[i] = (mass of the tokens with a strictly larger logit than i) < top_p."""
    key_s, order = key.sort(dim=-1, descending=True, stable=True)
    p_s = p.gather(-1, order)
    above = torch.cumsum(p_s, dim=-1) - p_s            # mass before i in sorted order
    pos = torch.arange(key.shape[-1], device=key.device).expand_as(key_s)
    first = torch.ones_like(key_s, dtype=torch.bool)
    first[:, 1:] = key_s[:, 1:] != key_s[:, :-1]
    start = torch.cummax(torch.where(first, pos, torch.zeros_like(pos)), dim=-1).values
    above = above.gather(-1, start)                    # ...before its group of equal logits
    keep_s = above < top_p[:, None]
    return torch.zeros_like(keep_s).scatter(-1, order, keep_s)


def saguaro_sample_reference(logits: torch.Tensor, temperature: torch.Tensor,
                             top_k: torch.Tensor, top_p: torch.Tensor, fanout: torch.Tensor,
                             c: float, seeds: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V]; temperature, top_p [R] float; top_k (<= 0: off), fanout [R] int;
    seeds [R] int64 -> tokens [R] int64, q [R, V] float32 (= counts / Q_SCALE)."""
    R, V = logits.shape
    if R == 0:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, V)
    c = float(torch.tensor(c, dtype=torch.float32))  # the kernels' C is a float32
    x = logits.float()
    key = sortable_key(x)
    z = x.double() / temperature.double()[:, None]
    keep = torch.ones_like(key, dtype=torch.bool)
    k = top_k.long()
    on = (k > 0) & (k < V)
    if bool(on.any()):
        kth = key.sort(dim=-1, descending=True).values.gather(
            -1, (k.clamp(1, V) - 1)[:, None])
        keep &= (key >= kth) | ~on[:, None]
    e = torch.exp(z - z.max(dim=-1, keepdim=True).values) * keep
    tp = top_p.double()
    if bool((tp < 1.0).any()):
        keep &= _top_p_keep(e / e.sum(-1, keepdim=True), key, tp) | (tp >= 1.0)[:, None]
        e = e * keep
    p = e / e.sum(-1, keepdim=True)
    if c < 1.0:
        rank = rank_key(key)
        nth = rank.sort(dim=-1, descending=True).values.gather(
            -1, fanout.long().clamp(0, V - 1)[:, None])   # the (F+1)-th largest rank
        sigma = p * torch.where(rank >= nth, c, 1.0)
        total = sigma.sum(-1, keepdim=True)
        p = torch.where(total > 0, sigma / total.clamp_min(1e-300), p)
    steps = torch.floor(torch.cumsum(p, dim=-1) * Q_SCALE + 0.5).clamp(max=Q_SCALE)
    steps[:, -1] = Q_SCALE
    counts = torch.diff(steps, dim=-1, prepend=torch.zeros_like(steps[:, :1]))
    r = hash32(seeds.long()) & (Q_SCALE - 1)
    tokens = (steps <= r[:, None]).sum(-1)
    return tokens, (counts / Q_SCALE).float()


MAX_BLOCK = 4096  # lanes per chunk of a row (registers); longer rows loop


def saguaro_sample_triton(logits: torch.Tensor, temperature: torch.Tensor,
                          top_k: torch.Tensor, top_p: torch.Tensor, fanout: torch.Tensor,
                          c: float, seeds: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same, one Triton program per row (arguments as saguaro_sample_reference)."""
    R, V = logits.shape
    dev = logits.device
    tokens = torch.empty(R, dtype=torch.long, device=dev)
    q = torch.empty(R, V, dtype=torch.float32, device=dev)
    if R == 0:
        return tokens, q
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    steps = torch.empty(R, V, dtype=torch.int32, device=dev)
    kernels().saguaro_sample_kernel[(R,)](
        logits, logits.stride(0), temperature.float().to(dev), top_k.to(dev, torch.int32),
        top_p.float().to(dev), fanout.to(dev, torch.int32), seeds.to(dev, torch.long),
        tokens, q, steps, V, C=float(c), Q=Q_SCALE, BLOCK=min(next_power_of_2(V), MAX_BLOCK))
    return tokens, q
