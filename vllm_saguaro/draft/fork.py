"""The fork: which verification outcomes (k, bonus) the pre-speculation branches on.

Runs on the glue pass's logits over the speculation in flight: position j predicts the
token after t*_prev, s_1..s_j, and its likely tokens other than s_{j+1} are the bonus
tokens bet on for outcome k = j. The fan-out policies (geometric, uniform) take a fixed
number per j; 'probable' estimates every outcome's probability here and leaves the
choice across the batch to core/selection.py.
"""
from __future__ import annotations

import torch

from vllm_saguaro.core.sampling import SamplingSpec, draft_distribution
from vllm_saguaro.draft.model import DraftModel
from vllm_saguaro.ops import fork_candidates


def fanout_roots(model: DraftModel, spec: list[int], logits: torch.Tensor,
                 fanout: list[int], use_op: bool = False) -> list[tuple[int, int]]:
    """geometric / uniform: the draft's top F_j tokens at every position j (not s_{j+1}).
    use_op: by ops.fork_candidates, one call for all positions (the GPU's way; on CPU the
    loop below measured faster)."""
    if use_op:
        m = len(spec)
        ids, in_head = model.head_index(torch.tensor(spec, dtype=torch.long))
        drafted = torch.full((m + 1,), -1, dtype=torch.long)
        drafted[:m] = torch.where(in_head, ids, -1)
        fan = torch.tensor(fanout[: m + 1], dtype=torch.long)
        width = max(1, int(fan.max()))
        dev = logits.device
        cand = fork_candidates(logits[: m + 1], drafted.to(dev), fan.to(dev), width).cpu()
        return [(j, x) for j in range(m + 1) for x in
                model.token_ids(cand[j][cand[j] >= 0]).tolist()]
    branches = []
    for j in range(len(spec) + 1):
        f = fanout[j]
        if f == 0:
            continue
        top = model.token_ids(torch.topk(logits[j], min(f + 1, logits.shape[-1])).indices).tolist()
        if j < len(spec):
            top = [x for x in top if x != spec[j]]
        branches.extend((j, x) for x in top[:f])
    return branches


def outcome_estimates(logits: torch.Tensor, spec: list[int], sampling: SamplingSpec,
                      fanout: list[int], c: float, model: DraftModel, width: int,
                      one_hot: bool = False) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """What the 'probable' selection needs of one sequence, from the glue pass's logits
    [m + 1, head] over its speculation s_1..s_m: the draft's confidence in each s_j and, at
    each position j, up to `width` bonus candidates with P(bonus | k = j).

    p_d (the draft's distribution, tempered and masked like the request's; temperature 1
    at greedy) stands in for the target's p. After a rejection at j the verifier draws the
    bonus from max(0, p - q) (q = the speculation's sigma, one-hot at greedy); after m
    acceptances from p itself. Confidence: p_d(s_j) at greedy, min(1, p_d / q) sampled
    (the acceptance probability if p were p_d). one_hot: the speculation was verified with
    a one-hot q although the request samples (the fast backup's drafts).
    """
    m = len(spec)
    dev = logits.device  # everything below on the draft's device (a GPU's, or the CPU)
    fan = torch.tensor([fanout[min(j, len(fanout) - 1)] for j in range(m + 1)], device=dev)
    plain = SamplingSpec(1.0) if sampling.greedy else sampling._replace(seed=None)
    p_d = draft_distribution(logits, plain, fan, 1.0)
    ids, in_head = model.head_index(torch.tensor(spec, dtype=torch.long, device=dev))
    rows = torch.arange(m, device=dev)
    p_sent = torch.where(in_head, p_d[rows, ids], 0.0)
    if sampling.greedy or one_hot:
        conf = p_sent
        residual = p_d[:m].clone()
    else:  # a sampled speculation's tokens are the head's; q as now (F may have moved)
        q = draft_distribution(logits[:m], sampling, fan[:m], c)
        conf = torch.clamp(p_sent / q[rows, ids].clamp_min(1e-30), max=1.0)
        residual = (p_d[:m] - q).clamp_min(0.0)
    # A rejected token is never the bonus: it was rejected because p < q there, where the
    # residual is 0 (p_d, only an estimate of p, may say otherwise).
    residual[rows[in_head], ids[in_head]] = 0.0
    residual = residual / residual.sum(-1, keepdim=True).clamp_min(1e-30)
    dists = torch.cat([residual, p_d[m:]], dim=0)
    top = torch.topk(dists, min(width, dists.shape[-1]), dim=-1)
    tokens = model.token_ids(top.indices).tolist()
    cands = [[(x, p) for x, p in zip(tk, pr) if p > 0.0]
             for tk, pr in zip(tokens, top.values.tolist())]
    return conf.tolist(), cands
