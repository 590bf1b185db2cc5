"""Exact target distributions and a chi-square test, for losslessness checks."""
from __future__ import annotations

import numpy as np
import torch


def process_logits(logits: torch.Tensor, prompt_ids: list[int], outputs: list[list[int]],
                   logit_bias: dict | None = None, repetition_penalty: float = 1.0,
                   frequency_penalty: float = 0.0, presence_penalty: float = 0.0) -> torch.Tensor:
    """Logits [R, V] -> what temperature then divides, by the definitions (OpenAI's for
    frequency / presence, CTRL's repetition penalty over prompt and output tokens): the
    bias first, then the penalties, as vLLM's Sampler orders them. outputs: each row's
    generated tokens so far."""
    x = logits.double().clone()
    if logit_bias:
        for tok, b in logit_bias.items():
            x[:, tok] += b
    for r, out in enumerate(outputs):
        seen = sorted(set(prompt_ids) | set(out))
        row = x[r, seen]
        x[r, seen] = torch.where(row > 0, row / repetition_penalty, row * repetition_penalty)
        for tok in set(out):
            x[r, tok] -= frequency_penalty * out.count(tok) + presence_penalty
    return x


def exact_two_token_distribution(model_dir, prompt_ids: list[int], temperature: float = 1.0,
                                 top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                                 **processing) -> torch.Tensor:
    """P(t1, t2 | prompt) under sampling with these parameters, float64 [V, V], computed
    with transformers: process_logits(**processing), temperature, min_p (tokens below
    min_p x the top probability dropped), then vLLM's top-k / top-p rule (top-p: the
    smallest top set reaching top_p)."""
    from transformers import LlamaForCausalLM

    from vllm_saguaro.core.sampling import top_k_top_p_mask

    def dist(logits, outputs):
        x = process_logits(logits, prompt_ids, outputs, **processing) / temperature
        if min_p > 0:
            probs = x.softmax(-1)
            x = x.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
        return top_k_top_p_mask(x, top_k, top_p).softmax(-1)

    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt_ids])
        p1 = dist(model(ids).logits[0, -1:], [[]])[0]
        v = p1.shape[0]
        batch = torch.cat([ids.expand(v, -1), torch.arange(v)[:, None]], dim=1)
        p2 = dist(model(batch).logits[:, -1], [[t] for t in range(v)])
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


def two_sample_pvalue(a: dict, b: dict, min_expected: float = 5.0):
    """Chi-square test of homogeneity: do the counts a and b (outcome -> count) come from
    one distribution? Outcomes expected fewer than min_expected times in either sample
    are pooled into one cell. Returns (statistic, degrees of freedom, p-value)."""
    na, nb = sum(a.values()), sum(b.values())
    keys = set(a) | set(b)
    big = [k for k in keys if (a.get(k, 0) + b.get(k, 0)) * min(na, nb) / (na + nb) >= min_expected]
    rows = [(a.get(k, 0), b.get(k, 0)) for k in big]
    rest = (na - sum(r[0] for r in rows), nb - sum(r[1] for r in rows))
    if sum(rest) > 0:
        rows.append(rest)
    stat = 0.0
    for ca, cb in rows:
        tot = ca + cb
        for c, n in ((ca, na), (cb, nb)):
            e = tot * n / (na + nb)
            stat += (c - e) ** 2 / e
    dof = len(rows) - 1
    p = torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                torch.tensor(stat / 2.0, dtype=torch.float64))
    return stat, dof, float(p)
