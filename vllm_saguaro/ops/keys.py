"""Integer keys the ops order and draw by, defined once for the torch references, the
Triton kernels and the CUDA ops, so that all three pick the same tokens.

- `sortable_key`: a float32's bits as an int32 whose integer order is the float order, so
  thresholds (the k-th largest logit, the top-p cut) are found by bisection over integers,
  exactly, in 33 passes over a row, without sorting it.
- `rank_key`: (key, index) in one int64, larger = preferred: a higher logit first, the
  lower index among equal logits. Every token of a row has a distinct rank, so "the top F"
  is one set, whatever the order a kernel visits the row in.
- `hash32`: a counter-based hash (the 'lowbias' integer mix) of a row's int64 seed. The
  draw of a sampled token is uniform in [0, Q_SCALE) from it, so a seeded row draws the
  same token on every backend and device, with no generator state.
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
MIX = 0x45D9F3B  # < 2^27: (x < 2^32) * MIX stays inside int64


NEG_ZERO = -(1 << 31)  # the bits of -0.0 as an int32


def sortable_key(x: torch.Tensor) -> torch.Tensor:
    """float32 [...] -> int64 [...] (int32 range), monotone in x; -0.0 and +0.0 (equal
    floats) get the same key, 0."""
    bits = x.float().view(torch.int32)
    bits = torch.where(bits == NEG_ZERO, 0, bits)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long()


def rank_key(key: torch.Tensor) -> torch.Tensor:
    """sortable keys [R, V] -> int64 ranks [R, V]: key * 2^32 + (2^32 - 1 - index)."""
    idx = torch.arange(key.shape[-1], dtype=torch.long, device=key.device)
    return key * (1 << 32) + (MASK32 - idx)


def hash32(seed: torch.Tensor) -> torch.Tensor:
    """int64 [...] -> int64 in [0, 2^32): fold the high half in, then two multiply-xorshift
    rounds (every intermediate below 2^59)."""
    x = (seed ^ (seed >> 32)) & MASK32
    x = (((x >> 16) ^ x) * MIX) & MASK32
    x = (((x >> 16) ^ x) * MIX) & MASK32
    return (x >> 16) ^ x
