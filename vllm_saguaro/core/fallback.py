"""Fallback on a cache miss (paper sec. 4.3): the fast backup and the batch-size-aware choice.

On a miss something must draft the next speculation on the critical path. The neural
backup (the draft model, as in ordinary SD) is accurate but slow; the fast backup (prompt
lookup: continue an earlier occurrence of the last few tokens) is nearly free and
deterministic, so it is verified with a one-hot q, losslessly. One miss stalls the whole
batch step, so the neural backup pays at small batch and not at large batch.
"""
from __future__ import annotations


def ngram_draft(tokens: list[int], k: int, max_n: int = 3) -> list[int]:
    """k tokens continuing the most recent earlier occurrence of the last n tokens (n from
    max_n down to 1); the last token repeated if nothing matches."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), 0, -1):
        tail = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                seq = list(tokens)
                for i in range(k):  # a match close to the end continues into its own copy
                    seq.append(seq[start + n + i])
                return seq[length:]
    return [tokens[-1]] * k


def use_neural_fallback(misses: int, batch: int, tokens_neural: float, tokens_fast: float,
                        t_round: float, t_neural: float) -> bool:
    """Per step: the neural backup gives each missed sequence tokens_neural - tokens_fast
    more tokens, and stalls the whole batch (batch x tokens_neural tokens a round) for
    t_neural on top of the t_round the step takes anyway. It pays when the batch's
    tokens per second come out higher: misses * gain * (t_round + t_neural) exceeds
    batch * tokens_neural * t_neural. The static form of this is the paper's b*.
    """
    gain = misses * max(tokens_neural - tokens_fast, 0.0)
    return gain * (t_round + t_neural) > batch * tokens_neural * t_neural


class RunningMean:
    """Exponential moving average that starts at a prior worth `weight` observations."""

    def __init__(self, prior: float, weight: float = 4.0, decay: float = 0.98):
        self.total, self.count, self.decay = prior * weight, weight, decay

    def add(self, x: float) -> None:
        self.total = self.total * self.decay + x
        self.count = self.count * self.decay + 1.0

    @property
    def value(self) -> float:
        return self.total / self.count
