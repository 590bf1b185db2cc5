"""Speculation-cache lookup as one op: each sequence's verified outcome against the flat
key table of the branches cached on the draft device.

A key is (row, k, t*): the sequence's row in the batch, the accepted length and the bonus
token. The answer for each query is the index of the first branch with that key, or -1
(a miss: the fallback drafts). One pass over the table per query: the table holds a few
hundred branches (batch x fan-out budget), so a scan beats building a hash on the device.
"""
from __future__ import annotations

import torch

from vllm_saguaro.ops.backend import kernels, next_power_of_2


def cache_lookup_reference(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """keys [N, 3], queries [B, 3] int64 -> [B] int64 branch index or -1."""
    N = keys.shape[0]
    if N == 0:
        return torch.full((queries.shape[0],), -1, dtype=torch.long, device=queries.device)
    match = (queries[:, None, :] == keys[None, :, :]).all(-1)          # [B, N]
    first = torch.where(match, torch.arange(N, device=keys.device), N).min(-1).values
    return torch.where(first < N, first, -1)


def cache_lookup_triton(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """The same, one Triton program per query."""
    B, N = queries.shape[0], keys.shape[0]
    out = torch.empty(B, dtype=torch.long, device=queries.device)
    if B == 0:
        return out
    kernels().cache_lookup_kernel[(B,)](keys.long().contiguous(), queries.long().contiguous(),
                                        out, N, BLOCK=min(next_power_of_2(max(N, 1)), 1024))
    return out
