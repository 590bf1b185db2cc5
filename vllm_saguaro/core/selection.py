"""Outcome selection: which verification outcomes (k, bonus) to pre-speculate.

The paper fixes a fan-out per accepted length k (geometric, Theorem 12) and caches the
draft's top tokens at each k. That spends the same branches on a sequence whose round is
nearly certain as on one that is a coin toss. The ``probable`` policy instead ranks every
outcome of every sequence by the draft's own estimate of its probability and spends the
round's budget where it buys the most:

  P(k = j)            = prod_{i<j} alpha_i * (1 - alpha_j)   (j < m),  prod_{i<m} alpha_i (j = m)
  P(bonus = x | k=j)  = the residual the verifier draws the bonus from, with the draft's own
                        distribution p_d standing in for the target's p:
                        max(0, p_d - q) / Z after a rejection (q one-hot at greedy: p_d
                        without the sent token), p_d itself after m acceptances
  alpha_i             = P(the target accepts draft token i), from the draft's confidence in
                        it (p_d at greedy, min(1, p_d / q) when sampled), calibrated online
                        against the verified outcomes (AcceptanceCalibration).

A round only saves the fallback when every sequence of the batch hits, so the budget goes
to maximise prod_n P(hit_n) (allocate_budget): a sequence whose outcome is nearly certain
gets one branch, an uncertain one more.
"""
from __future__ import annotations

import heapq
import math


class AcceptanceCalibration:
    """P(accept | draft confidence c): acceptance frequency per confidence bin, learned online.

    The prior of each bin is its centre (a calibrated draft), worth prior_weight
    observations; decay < 1 follows a change of prompt mix. A verified round with k of the
    n drafted tokens accepted shows tokens 0..k-1 accepted and, if k < n, token k rejected;
    later tokens were never judged.
    """

    def __init__(self, bins: int = 10, prior_weight: float = 4.0, decay: float = 0.998):
        self.bins, self.decay = bins, decay
        self.accepted = [prior_weight * (b + 0.5) / bins for b in range(bins)]
        self.seen = [prior_weight] * bins

    def _bin(self, c: float) -> int:
        return min(self.bins - 1, max(0, int(c * self.bins)))

    def rate(self, c: float) -> float:
        b = self._bin(c)
        return min(max(self.accepted[b] / self.seen[b], 1e-3), 1.0 - 1e-3)

    def observe(self, confidences: list[float], accepted: int) -> None:
        judged = confidences[: accepted + 1]
        for i, c in enumerate(judged):
            b = self._bin(c)
            self.accepted = [a * self.decay for a in self.accepted]
            self.seen = [n * self.decay for n in self.seen]
            self.seen[b] += 1.0
            self.accepted[b] += 1.0 if i < accepted else 0.0


def accepted_length_probs(alphas: list[float]) -> list[float]:
    """P(k = j) for j = 0..m under independent acceptances alpha_0..alpha_{m-1}."""
    probs, alive = [], 1.0
    for a in alphas:
        probs.append(alive * (1.0 - a))
        alive *= a
    probs.append(alive)
    return probs


def rank_outcomes(k_probs: list[float], bonus: list[list[tuple[int, float]]]
                  ) -> list[tuple[float, int, int]]:
    """Every outcome (probability, k, bonus token) of one sequence, most likely first.

    bonus[j] = (token, P(bonus = token | k = j)) candidates at accepted length j."""
    out = [(pk * pb, j, x) for j, (pk, cands) in enumerate(zip(k_probs, bonus))
           for x, pb in cands]
    out.sort(key=lambda o: -o[0])
    return out


def allocate_budget(ranked: list[list[tuple[float, int, int]]], total: int) -> list[int]:
    """How many of each sequence's ranked outcomes to pre-speculate, `total` in all.

    Greedy on the marginal gain of log P(hit_n) (each sequence's outcomes taken most likely
    first, so gains only shrink): optimal for maximising prod_n P(hit_n), the chance that
    the whole batch hits. A sequence with no branch yet always gains most; ties go to the
    more likely outcome.
    """
    counts = [0] * len(ranked)
    covered = [0.0] * len(ranked)
    heap = [(-math.inf, -r[0][0], n) for n, r in enumerate(ranked) if r]
    heapq.heapify(heap)
    for _ in range(total):
        if not heap:
            break
        _, _, n = heapq.heappop(heap)
        covered[n] += ranked[n][counts[n]][0]
        counts[n] += 1
        if counts[n] < len(ranked[n]):
            p = ranked[n][counts[n]][0]
            gain = math.log1p(p / covered[n]) if covered[n] > 0 else math.inf
            heapq.heappush(heap, (-gain, -p, n))
    return counts


def select_outcomes(k_probs: list[list[float]], bonus: list[list[list[tuple[int, float]]]],
                    total: int) -> list[list[tuple[int, int]]]:
    """The (k, bonus token) branches to pre-speculate for each sequence of the batch, and
    (in the same order) nothing else: k_probs[n] from accepted_length_probs, bonus[n][j] as
    in rank_outcomes."""
    ranked = [rank_outcomes(kp, b) for kp, b in zip(k_probs, bonus)]
    counts = allocate_budget(ranked, total)
    return [[(j, x) for _, j, x in r[:c]] for r, c in zip(ranked, counts)]


def hit_probability(k_probs: list[float], bonus: list[list[tuple[int, float]]],
                    chosen: list[tuple[int, int]]) -> float:
    """The draft's estimate of P(hit) for one sequence's chosen branches."""
    p = {(j, x): pk * pb for j, (pk, c) in enumerate(zip(k_probs, bonus)) for x, pb in c}
    return sum(p.get(o, 0.0) for o in chosen)
