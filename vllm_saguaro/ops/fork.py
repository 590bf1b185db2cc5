"""The fork as one op: the top-F candidates of each position other than its drafted token.

Position j of the glue pass predicts the token after s_1..s_j; its likely tokens other
than the drafted s_{j+1} are the bonus tokens the pre-speculation bets on (draft/fork.py).
One row per position: the best `fanout[row]` tokens by ops/keys.py's rank (higher logit,
then lower index), never `drafted[row]` (-1: none, the last position) nor a -inf logit;
-1 fills the rest of the `width` columns.
"""
from __future__ import annotations

import torch

from vllm_saguaro.ops.backend import kernels, next_power_of_2
from vllm_saguaro.ops.keys import rank_key, sortable_key


def fork_candidates_reference(logits: torch.Tensor, drafted: torch.Tensor,
                              fanout: torch.Tensor, width: int) -> torch.Tensor:
    """logits [P, V]; drafted, fanout [P] int -> candidates [P, width] int64."""
    P, V = logits.shape
    x = logits.float()
    rank = rank_key(sortable_key(x))
    idx = torch.arange(V, device=x.device)
    out_ = (idx[None, :] == drafted.long()[:, None]) | torch.isneginf(x)
    rank = rank.masked_fill(out_, torch.iinfo(torch.long).min)
    w = min(width, V)
    top = rank.topk(w, dim=-1)
    cand = torch.where(top.values > torch.iinfo(torch.long).min, top.indices, -1)
    place = torch.arange(w, device=x.device)[None, :]
    cand = torch.where(place < fanout.long().to(x.device)[:, None], cand, -1)
    pad = torch.full((P, width - w), -1, dtype=torch.long, device=x.device)
    return torch.cat([cand, pad], dim=-1)


def fork_candidates_triton(logits: torch.Tensor, drafted: torch.Tensor,
                           fanout: torch.Tensor, width: int) -> torch.Tensor:
    """The same, one Triton program per row: `width` max passes over its ranks."""
    P, V = logits.shape
    out = torch.empty(P, width, dtype=torch.long, device=logits.device)
    if P == 0 or width == 0:
        return out
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    dev = logits.device
    kernels().fork_kernel[(P,)](logits, logits.stride(0), drafted.to(dev, torch.long),
                                fanout.to(dev, torch.int32), out, V, WIDTH=width,
                                BLOCK=min(next_power_of_2(V), 4096))
    return out
