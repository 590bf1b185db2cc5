"""Exact target distributions and a chi-square test, for losslessness checks."""
from __future__ import annotations

import numpy as np
import torch


def exact_two_token_distribution(model_dir, prompt_ids: list[int], temperature: float = 1.0,
                                 top_p: float = 1.0) -> torch.Tensor:
    """P(t1, t2 | prompt) under (temperature, top-p) sampling, float64 [V, V], computed
    with transformers and vLLM's top-p rule (the smallest top set reaching top_p)."""
    from transformers import LlamaForCausalLM

    from vllm_saguaro.core.sampling import top_k_top_p_mask

    def dist(logits):
        return top_k_top_p_mask(logits.double() / temperature, 0, top_p).softmax(-1)

    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt_ids])
        p1 = dist(model(ids).logits[0, -1:])[0]
        v = p1.shape[0]
        batch = torch.cat([ids.expand(v, -1), torch.arange(v)[:, None]], dim=1)
        p2 = dist(model(batch).logits[:, -1])
    return p1[:, None] * p2


def chi_square_pvalue(counts: dict, probs: torch.Tensor, n: int, min_expected: float = 5.0):
    """Pearson chi-square of (t1, t2) counts against probs; rare cells pooled into one.

    Returns (statistic, degrees of freedom, p-value).
    """
    expected = probs.numpy() * n
    big = expected >= min_expected
    observed = np.zeros_like(expected)
    for (a, b), c in counts.items():
        observed[a, b] += c
    o, e = list(observed[big]), list(expected[big])
    if n - sum(e) > 1e-9:
        o.append(n - sum(o))
        e.append(n - sum(e))
    o, e = np.asarray(o), np.asarray(e)
    stat = float(((o - e) ** 2 / e).sum())
    dof = len(o) - 1
    p = torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                torch.tensor(stat / 2.0, dtype=torch.float64))
    return stat, dof, float(p)
