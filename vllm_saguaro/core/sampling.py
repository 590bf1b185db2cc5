"""Draft sampling: the distribution q the draft samples from, and that the verifier must use.

Saguaro sampling (paper sec. 4.2) scales the probability of the draft's top tokens by
C in [0, 1]. The cache holds exactly those tokens as bonus-token candidates, and the
residual max(0, p - q) that the bonus token is drawn from after a rejection grows where q
shrinks: a smaller C means more cache hits and fewer accepted tokens. Lossless only if
the verifier gets this very q.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

GREEDY_EPS = 1e-5  # vLLM treats temperatures below this as greedy


class SamplingSpec(NamedTuple):
    """What the draft needs of a request's sampling parameters."""

    temperature: float = 0.0
    top_k: int = 0         # <= 0: disabled
    top_p: float = 1.0     # 1.0: disabled
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def seeded(self) -> bool:
        """A sampled request with its own seed: its draws must not depend on timing."""
        return not self.greedy and self.seed is not None


def top_k_top_p_mask(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits [R, V] to -inf outside the top-k and the top-p nucleus (as vLLM does:
    the smallest set of the highest tokens whose probability reaches top_p)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        drop = before >= top_p
        drop[..., 0] = False
        logits = logits.scatter(-1, idx, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def saguaro_sigma(probs: torch.Tensor, logits: torch.Tensor, fanout: torch.Tensor,
                  c: float) -> torch.Tensor:
    """sigma_{F,C}: scale the draft's top-(F+1) tokens (by logit) by C, renormalise.

    F+1 because one of the top tokens is usually the one sent, which is never a bonus
    candidate. Rows whose whole mass would vanish (C = 0 and the support inside the top
    tokens) keep the unscaled distribution. probs, logits [R, V]; fanout [R] ints.
    """
    if c >= 1.0 or probs.shape[0] == 0:
        return probs
    dev = probs.device  # fanout may come from the CPU while the rows are on a GPU
    fanout = fanout.to(dev)
    width = min(int(fanout.max()) + 1, probs.shape[-1])
    top = torch.topk(logits, width, dim=-1).indices                     # [R, W]
    keep = torch.arange(top.shape[1], device=dev)[None, :] < (fanout[:, None] + 1)  # [R, W]
    scale = torch.ones_like(probs)
    scale.scatter_(1, top, torch.where(keep, torch.tensor(c, dtype=probs.dtype, device=dev),
                                       torch.tensor(1.0, dtype=probs.dtype, device=dev)))
    sigma = probs * scale
    total = sigma.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, sigma / total.clamp_min(1e-30), probs)


def draft_distribution(logits: torch.Tensor, spec: SamplingSpec, fanout: torch.Tensor,
                       c: float) -> torch.Tensor:
    """q for rows of draft logits [R, V] of one request: temperature, top-k/top-p, sigma."""
    z = logits.float() / spec.temperature
    z = top_k_top_p_mask(z, spec.top_k, spec.top_p)
    return saguaro_sigma(z.softmax(dim=-1), z, fanout, c)


# q crosses from the draft to the verifier as integer counts over the draft head's tokens:
# q = counts / Q_SCALE exactly (counts < 2^24, a power-of-two scale: exact in float32 on
# both sides), summing to exactly 1. The draft samples from that very q, so nothing is
# lost; uint16 over the head is 2 bytes a token where float32 over the vocabulary was 4
# (x 3 for the reference draft's 16k head in a 49k vocabulary). Each probability moves by
# less than 1 / Q_SCALE; tokens that round to 0 are never proposed, which the verifier's
# residual covers (lossless for any q it is told).
Q_SCALE = 2 ** 15


def quantize_distribution(q: torch.Tensor) -> torch.Tensor:
    """q [R, V] -> q' [R, V] float32 with q' = counts / Q_SCALE, integer counts summing to
    Q_SCALE per row. Cumulative rounding: counts are the steps of round(cumsum(q) x
    Q_SCALE), so each is within 1 of q x Q_SCALE and the tail's mass is not piled onto one
    token, in one pass (a largest-remainder sort costs ~1 ms a row of 16k)."""
    c = torch.cumsum(q.float(), dim=-1)  # monotone: every count >= 0
    total = c[:, -1:]
    if q.shape[0] and not bool(((total - 1).abs() < 1e-3).all()):
        raise ValueError("quantize_distribution: rows that are not distributions")
    steps = torch.round(c * (Q_SCALE / total))
    counts = torch.diff(steps, dim=-1, prepend=torch.zeros_like(steps[:, :1]))
    return counts.float() / Q_SCALE


def wire_counts(q: torch.Tensor):
    """A quantized q (quantize_distribution) as uint16 counts, what crosses Ray."""
    return torch.round(q * Q_SCALE).to(torch.int32).numpy().astype("uint16")


def counts_int16(q: torch.Tensor) -> torch.Tensor:
    """A quantized q as its counts in an int16 tensor on q's device (the device speculation
    table's and the channel's form, 2 bytes a token like the wire's uint16): a count of
    Q_SCALE = 2^15 (all the mass on one token) is one past int16, so the bits are uint16's."""
    return torch.round(q * Q_SCALE).to(torch.int32).to(torch.int16)


def q_from_int16(counts: torch.Tensor) -> torch.Tensor:
    """counts_int16's tensor -> the exact float32 q, on its device."""
    return (counts.to(torch.int32) & 0xFFFF).float() / Q_SCALE


def from_wire(counts) -> torch.Tensor:
    """uint16 counts (or counts_int16's tensor, from the channel) -> the exact float32 q
    the draft sampled from."""
    if isinstance(counts, torch.Tensor):
        return q_from_int16(counts).cpu()
    return torch.from_numpy(counts.astype("float32")) / Q_SCALE


def unpack_counts(counts: list, head_ids: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """Rows of uint16 counts [K_i, head] (or counts_int16's tensors) -> the exact q
    [rows, max K_i, vocab] float32 the verifier needs, zero outside the head: one scatter
    for the whole batch."""
    k = max(c.shape[0] for c in counts)
    head = counts[0].shape[1]
    dense = torch.zeros(len(counts), k, head)
    for i, c in enumerate(counts):
        dense[i, : c.shape[0]] = from_wire(c)
    if head_ids is None:
        return dense
    out = torch.zeros(len(counts) * k, vocab)
    rows = dense.view(-1, head)  # scatter_ with expanded indices: 2x faster than index_copy_
    out.scatter_(1, head_ids.expand(rows.shape[0], head), rows)
    return out.view(len(counts), k, vocab)
