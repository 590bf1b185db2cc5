"""The fast backup for a cache miss (paper sec. 4.3): prompt lookup.

On a miss something must draft the next speculation on the critical path. The neural
backup (the draft model, as in ordinary SD) is accurate but slow; the fast backup (prompt
lookup: continue an earlier occurrence of the last few tokens) is nearly free and
deterministic, so it is verified with a one-hot q, losslessly. One miss stalls the whole
batch step, so the neural backup pays at small batch and not at large batch: which one
drafts (or neither) is the controller's choice, by the same objective as every length
(core/controller.py).
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
