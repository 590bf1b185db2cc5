"""Verification of draft tokens: speculative rejection sampling, with the recovered token
drawn only where it is used.

Per request, each draft token x is accepted with probability min(1, p(x) / q(x)) (greedy
requests: while it is the target's argmax); at the first rejection the request gets a
token drawn from the residual max(p - q, 0), normalised, and stops; with every draft
token accepted it gets the bonus token, drawn from p after the last. The first token out
of a position is then distributed as p, whatever q was.

vLLM's rejection sampler draws the recovered token at every draft position, from an
exponential noise over the whole vocabulary per request, and keeps at most one per
request (the first rejected). On CPU that noise is torch's exponential_: 3.7 ms for 4 x
49152 on one of these cores, and inside the engine the sampler measured 6-60 ms per
verification at batch 4, T = 1, against ~1 ms for plain decoding's sampler. Here the
acceptance comes first, from the probabilities of the drafted tokens alone, and the
recovered token is drawn only at each request's first rejected position, by inverse CDF:
one uniform and a cumulative sum over its residual.
"""
from __future__ import annotations

import torch


def recovered_tokens(probs: torch.Tensor, q: torch.Tensor | None, drafted: torch.Tensor,
                     generator: torch.Generator | None = None,
                     rows: list[int] | None = None) -> torch.Tensor:
    """One token per row drawn from max(p - q, 0), normalised: for each of `rows` (None:
    all). probs, q [R, V]; q None: one-hot on `drafted` [R] (prompt lookup drafts, vLLM's
    ngram: a token drafted from no distribution); -1 drafted nothing. Row by row, so that
    every buffer has the vocabulary's size whatever the rows are: traced in the engine,
    filling buffers of a size new to the allocator took 5-20 ms a verification on these
    VMs, against ~0.1 ms for sizes seen before. The cumulative sums in float64: a sharp p
    leaves a residual of ~1e-7."""
    rows = list(range(len(probs))) if rows is None else rows
    u = torch.rand(len(rows), dtype=torch.float64, generator=generator).tolist()
    tokens = []
    for row, u_row in zip(rows, u):
        residual = probs[row].clone()
        token = int(drafted[row])
        if q is not None:
            residual.sub_(q[row]).clamp_(min=0.0)
        elif token >= 0:
            residual[token] = 0.0
        cdf = torch.cumsum(residual, dim=0, dtype=torch.float64)
        # the first token whose cumulative mass exceeds u: never one with no mass of its own
        at = torch.searchsorted(cdf, cdf[-1:] * u_row, right=True)
        tokens.append(min(int(at), len(cdf) - 1))
    return torch.tensor(tokens, dtype=torch.long)


def verify_drafts(draft_token_ids: torch.Tensor, num_draft_tokens: list[int],
                  draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                  bonus_token_ids: torch.Tensor, greedy: torch.Tensor | None,
                  uniform: torch.Tensor, placeholder: int = -1,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """The tokens each request keeps, [batch, max drafts + 1] int32 (placeholder after the
    last), as vLLM's rejection_sample writes them.

    draft_token_ids [n] (-1: padding, rejected), num_draft_tokens per request;
    draft_probs [n, V] the q each token was drawn from (None: one-hot on it);
    target_logits [n, V] after temperature / top-k / top-p; bonus_token_ids [batch, 1];
    greedy [batch] bool (None: no greedy request); uniform [n]: the acceptance draws."""
    batch, n = len(num_draft_tokens), draft_token_ids.numel()
    x = draft_token_ids.to(torch.long)
    xs = x.clamp(min=0)
    rows = torch.arange(n)
    row_of = torch.repeat_interleave(torch.arange(batch), torch.tensor(num_draft_tokens,
                                                                       dtype=torch.long))
    greedy_tok = (torch.zeros(n, dtype=torch.bool) if greedy is None
                  else greedy.to(torch.bool)[row_of])
    accept = torch.zeros(n, dtype=torch.bool)
    argmax = probs = None
    if bool(greedy_tok.any()):
        argmax = target_logits.argmax(dim=-1)
        accept |= greedy_tok & (x == argmax)
    if not bool(greedy_tok.all()):
        probs = target_logits.softmax(dim=-1, dtype=torch.float32)
        p_x = probs[rows, xs]
        q_x = torch.ones(n) if draft_probs is None else draft_probs[rows, xs].to(torch.float32)
        # as vLLM's kernel: a token the draft gave no mass is rejected (no 0 / 0)
        sampled_ok = (x >= 0) & (q_x > 0) & (p_x / q_x >= uniform.to(torch.float32))
        accept |= ~greedy_tok & sampled_ok
    accepted, drafted, bonus = accept.tolist(), x.tolist(), bonus_token_ids.reshape(-1).tolist()
    is_greedy = greedy_tok.tolist()
    width = max(num_draft_tokens, default=0) + 1
    out = [[placeholder] * width for _ in range(batch)]
    rejected: list[tuple[int, int, int]] = []  # (request, position, draft index)
    start = 0
    for i, m in enumerate(num_draft_tokens):
        k = 0
        while k < m and accepted[start + k]:
            k += 1
        out[i][:k] = drafted[start: start + k]
        if k < m:
            rejected.append((i, k, start + k))
        else:
            out[i][m] = bonus[i]
        start += m
    sampled = [(i, k, j) for i, k, j in rejected if not is_greedy[j]]
    for i, k, j in rejected:
        if is_greedy[j]:
            out[i][k] = int(argmax[j])
    if sampled:
        tokens = recovered_tokens(probs, draft_probs, x, generator,
                                  rows=[j for _, _, j in sampled]).tolist()
        for (i, k, _), token in zip(sampled, tokens):
            out[i][k] = token
    return torch.tensor(out, dtype=torch.int32).reshape(batch, width)
